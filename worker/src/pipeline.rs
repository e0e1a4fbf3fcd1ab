//! One shard's loop: replay the pending batch if there is one, then read → stage → register →
//! apply → verify → commit, page after page. Every step's result is durable before the next
//! begins, so the loop can die anywhere and a new owner resumes from the checkpoint.

use std::time::Duration;

use tidemark_common::batch::{self, DATA_FORMAT_PG_COPY_TEXT, MANIFEST_FORMAT_VERSION, Manifest};
use tidemark_common::cursor::{Cursor, KeyValue, Position, ShardRange};
use tidemark_common::pg::{Column, TableName, TableSql};
use tidemark_proto::v1 as pb;
use tokio::sync::watch;

use crate::apply::{ApplyOutcome, apply_batch};
use crate::client::CoordinatorClient;
use crate::crash;
use crate::error::WorkerError;
use crate::resources::TaskResources;
use crate::source::{read_page, source_now_micros};

/// Everything a shard loop knows; `cursor` and `version` follow its own commits.
pub struct ShardRun {
    pub worker_id: String,
    pub task: pb::TaskSpec,
    pub epoch: u64,
    pub shard_id: u32,
    pub range: ShardRange,
    pub cursor: Cursor,
    pub version: u64,
    pub fence: u64,
    pub snapshot_max_key: Option<KeyValue>,
    pub incremental_start: Cursor,
    pub sql: TableSql,
    pub resources: TaskResources,
}

/// A batch about to be committed: its bounds and how many rows it carried.
struct Bounds {
    batch_id: String,
    lower: Cursor,
    upper: Cursor,
    row_count: u64,
}

impl ShardRun {
    pub fn from_assignment(
        worker_id: &str,
        assignment: &pb::ShardAssignment,
        resources: TaskResources,
    ) -> Result<ShardRun, WorkerError> {
        let bad = |what: &str, e: String| WorkerError::Assignment(format!("{what}: {e}"));
        let task = assignment
            .task
            .clone()
            .ok_or_else(|| WorkerError::Assignment("no task spec".into()))?;
        let range =
            ShardRange::decode(&assignment.range).map_err(|e| bad("range", e.to_string()))?;
        let cursor =
            Cursor::decode(&assignment.cursor).map_err(|e| bad("cursor", e.to_string()))?;
        let incremental_start = Cursor::decode(&assignment.incremental_start)
            .map_err(|e| bad("incremental start", e.to_string()))?;
        let snapshot_max_key = if assignment.snapshot_max_key.is_empty() {
            None
        } else {
            Some(
                serde_json::from_str(&assignment.snapshot_max_key)
                    .map_err(|e| bad("snapshot max key", e.to_string()))?,
            )
        };
        let sql = TableSql {
            source: TableName::parse(&task.source_table).map_err(|e| bad("source table", e))?,
            target: TableName::parse(&task.target_table).map_err(|e| bad("target table", e))?,
            columns: task
                .columns
                .iter()
                .map(|c| Column {
                    name: c.name.clone(),
                    sql_type: c.sql_type.clone(),
                })
                .collect(),
            key_columns: task.key_columns.clone(),
            cursor_column: task.cursor_column.clone(),
        };
        Ok(ShardRun {
            worker_id: worker_id.to_string(),
            epoch: assignment.epoch,
            shard_id: assignment.shard_id,
            range,
            cursor,
            version: assignment.checkpoint_version,
            fence: assignment.fence_token,
            snapshot_max_key,
            incremental_start,
            sql,
            resources,
            task,
        })
    }

    /// Runs until the shard is lost, an error ends it, or `stop` turns true (then it returns
    /// Ok after the batch in flight is committed).
    pub async fn run(
        &mut self,
        client: &CoordinatorClient,
        pending: Option<pb::PendingBatch>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<(), WorkerError> {
        if let Some(pending) = pending {
            self.replay(client, &pending).await?;
        }
        let poll_interval = Duration::from_millis(self.task.poll_interval_ms.max(10));
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            let caught_up = self.step(client).await?;
            if caught_up {
                tokio::select! {
                    _ = tokio::time::sleep(poll_interval) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    }

    /// Re-applies exactly the staged batch that a previous owner left uncommitted
    /// (invariant 2: never re-extract it with fresher bounds).
    async fn replay(
        &mut self,
        client: &CoordinatorClient,
        pending: &pb::PendingBatch,
    ) -> Result<(), WorkerError> {
        let (manifest, data) = self
            .resources
            .staging
            .read_batch(&pending.manifest_path)
            .await?;
        let lower =
            Cursor::decode(&manifest.lower).map_err(|e| WorkerError::Data(e.to_string()))?;
        let upper =
            Cursor::decode(&manifest.upper).map_err(|e| WorkerError::Data(e.to_string()))?;
        if lower != self.cursor || manifest.batch_id != pending.batch_id {
            return Err(WorkerError::Assignment(format!(
                "pending batch {} does not start at the committed cursor",
                pending.batch_id
            )));
        }
        let outcome = apply_batch(&self.resources.target, &self.sql, &manifest, &data).await?;
        tracing::info!(
            task = %self.task.name, shard = self.shard_id, batch_id = %manifest.batch_id,
            rows = manifest.row_count, ?outcome, "replayed pending batch from staging"
        );
        let bounds = Bounds {
            batch_id: manifest.batch_id.clone(),
            lower,
            upper,
            row_count: manifest.row_count,
        };
        self.commit(client, bounds, false, true).await
    }

    /// One page. Returns true when the shard has caught up with the source (wait a poll).
    async fn step(&mut self, client: &CoordinatorClient) -> Result<bool, WorkerError> {
        let page_size = self.task.page_size;
        let (statement, high) = match &self.cursor.position {
            Position::Snapshot { after_key } => (
                self.sql.snapshot_page(
                    &self.range,
                    after_key.as_deref(),
                    self.snapshot_max_key.as_ref(),
                    page_size,
                ),
                None,
            ),
            Position::Incremental {
                t_micros,
                after_key,
            } => {
                let now = source_now_micros(&self.resources.source).await?;
                let high = now - (self.task.safety_delay_ms as i64) * 1000;
                if high <= *t_micros {
                    // Nothing can be read yet; the cursor never moves backwards.
                    return Ok(true);
                }
                (
                    self.sql.incremental_page(
                        &self.range,
                        *t_micros,
                        after_key.as_deref(),
                        high,
                        page_size,
                    ),
                    Some(high),
                )
            }
        };
        let page = read_page(&self.resources.source, &self.sql, &statement).await?;
        crash::point("after_read");
        let full = page.row_count == u64::from(page_size);
        let upper = match (&self.cursor.position, &page.last, full) {
            (Position::Snapshot { .. }, Some((key, _)), true) => Cursor::new(
                self.epoch,
                Position::Snapshot {
                    after_key: Some(key.clone()),
                },
            ),
            // A short snapshot page is the range's last: the shard moves to incremental.
            (Position::Snapshot { .. }, _, _) => self.incremental_start.clone(),
            (Position::Incremental { .. }, Some((key, t_micros)), true) => Cursor::new(
                self.epoch,
                Position::Incremental {
                    t_micros: *t_micros,
                    after_key: Some(key.clone()),
                },
            ),
            // A short incremental page read everything below `high`.
            (Position::Incremental { .. }, _, _) => Cursor::new(
                self.epoch,
                Position::Incremental {
                    t_micros: high.expect("incremental reads have a high bound"),
                    after_key: None,
                },
            ),
        };
        let lower = self.cursor.clone();
        let batch_id = batch::batch_id(&self.task.name, self.epoch, self.shard_id, &lower, &upper);
        let bounds = Bounds {
            batch_id,
            lower,
            upper,
            row_count: page.row_count,
        };
        if page.row_count == 0 {
            self.commit(client, bounds, true, false).await?;
            return Ok(true);
        }

        let mut manifest = Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            batch_id: bounds.batch_id.clone(),
            task: self.task.name.clone(),
            epoch: self.epoch,
            shard_id: self.shard_id,
            lower: bounds.lower.encode(),
            upper: bounds.upper.encode(),
            row_count: page.row_count,
            byte_size: page.data.len() as u64,
            content_hash: batch::content_hash(&page.data),
            schema_id: self.task.schema_id.clone(),
            fence_token: self.fence,
            data_path: String::new(),
            data_format: DATA_FORMAT_PG_COPY_TEXT.to_string(),
        };
        let manifest_path = self
            .resources
            .staging
            .write_batch(&mut manifest, page.data.clone())
            .await?;
        crash::point("after_stage");
        client
            .register_batch(pb::RegisterBatchRequest {
                worker_id: self.worker_id.clone(),
                task: self.task.name.clone(),
                epoch: self.epoch,
                shard_id: self.shard_id,
                fence_token: self.fence,
                batch_id: manifest.batch_id.clone(),
                lower: manifest.lower.clone(),
                upper: manifest.upper.clone(),
                row_count: manifest.row_count,
                byte_size: manifest.byte_size,
                content_hash: manifest.content_hash.clone(),
                manifest_path,
            })
            .await?;
        crash::point("after_register");
        let outcome = apply_batch(&self.resources.target, &self.sql, &manifest, &page.data).await?;
        debug_assert_eq!(outcome, ApplyOutcome::Applied);
        crash::point("after_apply");
        self.commit(client, bounds, false, false).await?;
        crash::point("after_commit");
        Ok(!full)
    }

    async fn commit(
        &mut self,
        client: &CoordinatorClient,
        bounds: Bounds,
        empty: bool,
        replayed: bool,
    ) -> Result<(), WorkerError> {
        let response = client
            .commit_batch(pb::CommitBatchRequest {
                worker_id: self.worker_id.clone(),
                task: self.task.name.clone(),
                epoch: self.epoch,
                shard_id: self.shard_id,
                fence_token: self.fence,
                expected_version: self.version,
                batch_id: bounds.batch_id.clone(),
                lower: bounds.lower.encode(),
                upper: bounds.upper.encode(),
                row_count: bounds.row_count,
                empty,
                replayed,
            })
            .await?;
        tracing::debug!(
            task = %self.task.name, shard = self.shard_id, batch_id = %bounds.batch_id, rows = bounds.row_count,
            upper = %bounds.upper.describe(), version = response.new_version, "batch committed"
        );
        self.version = response.new_version;
        self.cursor = bounds.upper;
        Ok(())
    }
}
