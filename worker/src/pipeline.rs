//! One shard's loop: replay the pending batch if there is one, then read → stage → register →
//! apply → verify → commit, page after page. Every step's result is durable before the next
//! begins, so the loop can die anywhere and a new owner resumes from the checkpoint.
//!
//! Incremental reading runs in cycles (see `Position::Incremental`): a cycle fixes its read
//! window `[watermark − overlap, high)` with `high = min(source now − safety_delay, start of
//! the oldest open source transaction)`, pages through it by `(cursor, key)`, and on its last
//! (short) page moves the watermark up to `high`.

use std::time::Duration;

use bytes::Bytes;
use tidemark_common::batch::{self, MANIFEST_FORMAT_VERSION, Manifest};
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::crash;
use tidemark_common::cursor::{Cursor, KeyValue, Position, ShardRange};
use tidemark_common::id_tail::{IdTail, Sample};
use tidemark_common::pg::deletes::LogUpper;
use tidemark_common::pg::visibility;
use tidemark_common::pg::{Column, DeleteSource, DeleteSql, TableName, TableSql};
use tidemark_common::source::{SourcePool, SourceReads};
use tidemark_proto::v1 as pb;
use tokio::sync::watch;
use tracing::Instrument;

use crate::metrics;

use crate::apply::{ApplyOutcome, BatchToApply, OverlapRegion, TaskWrite, apply_batch, ledger_holds};
use crate::client::CoordinatorClient;
use crate::error::WorkerError;
use crate::recent_rows::{Filtered, RecentRows};
use crate::resources::TaskResources;
use crate::source::{Page, read_page, source_now_micros};

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
    /// The statements the source table is read with, in its engine's dialect.
    pub reads: SourceReads,
    /// How rows reach the target (the upsert, or an accumulate task's transform).
    pub write: TaskWrite,
    pub resources: TaskResources,
    /// The last reason the open-transaction bound held the watermark (logged when it changes).
    bound_hold: Option<String>,
    /// Append and accumulate reads: samples of the largest key, and the bound they allow
    /// (keys no open transaction can still add below; see `id_tail`).
    id_tail: IdTail,
    append_bound: Option<KeyValue>,
    /// The coordinator asked for the shard back (a move, split, merge or drain).
    release_requested: bool,
    /// The reconciliation order (or none) that the current step's last commit answered with,
    /// when it answered `NextShardWork` too: the owner then need not ask.
    work_from_commit: Option<Option<pb::ReconcileOrder>>,
    /// The next page, read while the previous one was applied.
    prefetched: Option<(ReadPlan, Page, bool)>,
    /// The rows this run applied in its last cycles, one per key: what the overlap re-read
    /// need not stage again.
    pub(crate) recent: RecentRows,
    /// The statements of the epoch's own table while it builds beside the live one (what a
    /// reconciliation reads of the target); `None`: the configured table.
    pub(crate) epoch_sql: Option<TableSql>,
}

/// A batch about to be committed: its bounds, how many rows it carried, and the lateness of
/// the late rows it brought in.
struct Bounds {
    batch_id: String,
    lower: Cursor,
    upper: Cursor,
    row_count: u64,
    late_row_lateness_micros: Vec<i64>,
}

/// Where a page's cursor goes: after its last row when the page is full, or to `on_short`
/// when the page is short (the range or the cycle is exhausted).
struct ReadPlan {
    statement: String,
    on_short: Cursor,
    cycle: Option<(i64, i64)>,
    /// Incremental pages: where the scan starts `(t, key)` and the cycle's high.
    scan: Option<Scan>,
    /// The page's rows carry only the target's columns (key-ordered pages, no delete policy).
    target_layout: bool,
}

struct Scan {
    t_micros: i64,
    after_key: Option<Vec<KeyValue>>,
    high_micros: i64,
}

/// What `deliver` stages, applies and commits: rows read at the committed cursor.
pub(crate) struct PageToDeliver {
    pub lower: Cursor,
    pub upper: Cursor,
    pub data: Bytes,
    pub format: CopyFormat,
    pub row_count: u64,
    /// A reconciliation's repair batch (`lower == upper`).
    pub repair: bool,
    /// The rows carry only the target's columns.
    pub target_layout: bool,
}

/// The overlap region of an incremental batch: its cycle's watermark and high.
fn overlap_region(lower: &Cursor, upper: &Cursor) -> Option<OverlapRegion> {
    let Position::Incremental { floor_micros, .. } = lower.position else {
        return None;
    };
    let high_micros = match (&lower.position, &upper.position) {
        (
            Position::Incremental {
                cycle_high_micros: Some(high),
                ..
            },
            _,
        ) => *high,
        (
            _,
            Position::Incremental {
                cycle_high_micros: Some(high),
                ..
            },
        ) => *high,
        (
            _,
            Position::Incremental {
                floor_micros: high,
                cycle_high_micros: None,
                ..
            },
        ) => *high,
        _ => return None,
    };
    Some(OverlapRegion {
        floor_micros,
        high_micros,
    })
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
        let range = ShardRange::decode(&assignment.range).map_err(|e| bad("range", e.to_string()))?;
        let cursor = Cursor::decode(&assignment.cursor).map_err(|e| bad("cursor", e.to_string()))?;
        let incremental_start =
            Cursor::decode(&assignment.incremental_start).map_err(|e| bad("incremental start", e.to_string()))?;
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
            cursor_column: Some(task.cursor_column.clone()).filter(|c| !c.is_empty()),
            version_column: Some(task.version_column.clone()).filter(|c| !c.is_empty()),
            deletes: None,
            filter: Some(task.filter.clone()).filter(|f| !f.is_empty()),
            // Chosen when the run starts (`page_format::choose`).
            page_format: CopyFormat::Text,
            cursor_zone: Some(task.cursor_time_zone.clone()).filter(|z| !z.is_empty()),
        };
        let sql = TableSql {
            deletes: DeleteSql::from_spec(
                &task.delete_source,
                &task.delete_column,
                task.target_soft_deletes,
                &sql.source,
                &sql.target,
            )
            .map_err(|e| bad("delete source", e))?,
            ..sql
        };
        let write = if task.accumulate.is_empty() {
            TaskWrite::Upsert
        } else {
            let spec: tidemark_common::transform::AccumulateSpec =
                serde_json::from_str(&task.accumulate).map_err(|e| bad("accumulate spec", e.to_string()))?;
            let transform = tidemark_common::transform::RowTransform::new(&spec, &sql.columns)
                .map_err(|e| bad("accumulate spec", e))?;
            TaskWrite::Accumulate { spec, transform }
        };
        // Replaced by `source_reads` when the run starts.
        let reads = resources.source.bare_reads(&sql.source);
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
            reads,
            write,
            resources,
            task,
            bound_hold: None,
            id_tail: IdTail::default(),
            append_bound: None,
            release_requested: false,
            work_from_commit: None,
            prefetched: None,
            recent: RecentRows::default(),
            epoch_sql: None,
        })
    }

    /// The statements this run reads the source with (checked against the epoch's columns).
    async fn source_reads(&self) -> Result<SourceReads, WorkerError> {
        self.resources
            .source
            .reads_for(&self.sql)
            .await?
            .map_err(WorkerError::SchemaChanged)
    }

    /// Runs until the shard is lost, an error ends it, or `stop` turns true (then it returns
    /// Ok after the batch in flight is committed).
    pub async fn run(
        &mut self,
        client: &CoordinatorClient,
        pending: Option<pb::PendingBatch>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<(), WorkerError> {
        self.reads = self.source_reads().await?;
        // A newer epoch than the target's live one writes its own table: compare with that.
        let live = self.resources.target.live_epoch(&self.task.name).await.unwrap_or(None);
        let written = self.sql.routed(self.epoch, live);
        self.sql.page_format = crate::page_format::choose(
            written.as_ref().unwrap_or(&self.sql),
            &self.write,
            &self.resources.source,
            &self.resources.target,
        )
        .await;
        if let Some(pending) = pending {
            self.replay(client, &pending).await?;
        }
        let poll_interval = Duration::from_millis(self.task.poll_interval_ms.max(10));
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            self.work_from_commit = None;
            let caught_up = self.step(client).await?;
            if caught_up && !self.release_requested {
                self.shard_work(client).await?;
            }
            if self.release_requested {
                tracing::info!(task = %self.task.name, shard = self.shard_id, "the coordinator asked for the shard back; releasing it");
                return Ok(());
            }
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
    async fn replay(&mut self, client: &CoordinatorClient, pending: &pb::PendingBatch) -> Result<(), WorkerError> {
        let span = tracing::info_span!(
            "batch",
            task = %self.task.name,
            epoch = self.epoch,
            shard = self.shard_id,
            batch_id = %pending.batch_id,
            rows = pending.row_count,
            bytes = tracing::field::Empty,
            format = tracing::field::Empty,
            lower = tracing::field::Empty,
            upper = tracing::field::Empty,
            replay = true,
        );
        metrics::count(&metrics::METRICS.replays, &self.task.name, 1);
        self.replay_in(client, pending).instrument(span).await
    }

    async fn replay_in(&mut self, client: &CoordinatorClient, pending: &pb::PendingBatch) -> Result<(), WorkerError> {
        let (manifest, data) = match self.resources.staging.read_batch(&pending.manifest_path).await {
            Ok(batch) => batch,
            Err(error) => return self.recover_unreadable(client, pending, error).await,
        };
        let lower = Cursor::decode(&manifest.lower).map_err(|e| WorkerError::Data(e.to_string()))?;
        let upper = Cursor::decode(&manifest.upper).map_err(|e| WorkerError::Data(e.to_string()))?;
        if lower != self.cursor || manifest.batch_id != pending.batch_id {
            return Err(WorkerError::Assignment(format!(
                "pending batch {} does not start at the committed cursor",
                pending.batch_id
            )));
        }
        let overlap = if manifest.repair {
            None
        } else {
            overlap_region(&lower, &upper)
        };
        let batch = self.batch(&manifest, &data, overlap)?;
        tracing::Span::current().record("format", batch.format.name());
        let applied = match apply_batch(&self.resources.target, &batch).await {
            Err(WorkerError::BinaryTypes(reason)) => {
                self.abandon(client, &pending.batch_id, reason.clone()).await?;
                self.read_text(&reason);
                return Ok(());
            }
            other => other?,
        };
        self.count_dead_letters(&applied);
        tracing::info!(
            task = %self.task.name, shard = self.shard_id, batch_id = %manifest.batch_id,
            rows = manifest.row_count, outcome = ?applied.outcome, "replayed pending batch from staging"
        );
        let late = applied.late;
        let bounds = Bounds {
            batch_id: manifest.batch_id.clone(),
            lower,
            upper,
            row_count: manifest.row_count,
            late_row_lateness_micros: late,
        };
        self.commit(client, bounds, false, true).await
    }

    /// The pending batch's staged objects are corrupt or gone. If the target's ledger holds the
    /// batch it was applied: commit it by its registered bounds. Otherwise none of it reached
    /// the target: abandon it and read again from the committed cursor.
    async fn recover_unreadable(
        &mut self,
        client: &CoordinatorClient,
        pending: &pb::PendingBatch,
        error: tidemark_common::staging::StagingError,
    ) -> Result<(), WorkerError> {
        let decode = |text: &str| Cursor::decode(text).map_err(|e| WorkerError::Data(e.to_string()));
        let (lower, upper) = (decode(&pending.lower)?, decode(&pending.upper)?);
        if ledger_holds(&self.resources.target, &pending.batch_id, &pending.content_hash).await? {
            tracing::warn!(task = %self.task.name, shard = self.shard_id, batch_id = %pending.batch_id, %error,
                "pending batch unreadable in staging but applied in the target; committing it");
            let bounds = Bounds {
                batch_id: pending.batch_id.clone(),
                lower,
                upper,
                row_count: pending.row_count,
                late_row_lateness_micros: Vec::new(),
            };
            return self.commit(client, bounds, false, true).await;
        }
        tracing::warn!(task = %self.task.name, shard = self.shard_id, batch_id = %pending.batch_id, %error,
            "pending batch unreadable in staging and never applied; abandoning it");
        self.abandon(client, &pending.batch_id, error.to_string()).await
    }

    /// Gives up a registered batch that never reached the target: the checkpoint stays, its
    /// version moves, and the next read names a new batch.
    async fn abandon(&mut self, client: &CoordinatorClient, batch_id: &str, reason: String) -> Result<(), WorkerError> {
        self.version = client
            .abandon_batch(pb::AbandonBatchRequest {
                worker_id: self.worker_id.clone(),
                task: self.task.name.clone(),
                epoch: self.epoch,
                shard_id: self.shard_id,
                fence_token: self.fence,
                batch_id: batch_id.to_string(),
                reason,
            })
            .await?;
        Ok(())
    }

    /// A column type changed under a binary read or apply, or rows and delete-log entries
    /// came in different formats: read text from now on.
    fn read_text(&mut self, reason: &str) {
        tracing::warn!(task = %self.task.name, shard = self.shard_id, reason,
            "reading COPY text from now on");
        self.sql.page_format = CopyFormat::Text;
        self.prefetched = None;
        self.recent.clear();
    }

    /// Decides what the next page reads. `None`: nothing can be read yet.
    async fn plan_read(&mut self) -> Result<Option<ReadPlan>, WorkerError> {
        let new_cycle_high = match &self.cursor.position {
            Position::Incremental {
                floor_micros,
                cycle_high_micros: None,
                ..
            } => {
                let floor = *floor_micros;
                match self.read_window_high().await? {
                    Some(high) if high > floor => {
                        self.recent.forget_below(floor - (self.task.overlap_ms as i64) * 1000);
                        Some(high)
                    }
                    // Nothing new can be read yet; the watermark never moves back.
                    _ => return Ok(None),
                }
            }
            Position::Append { .. } => {
                match self.append_read_bound().await? {
                    Some(bound) => self.append_bound = Some(bound),
                    None => return Ok(None),
                }
                None
            }
            _ => None,
        };
        Ok(Some(self.plan_at(&self.cursor, new_cycle_high)))
    }

    /// How far an append read may go now (see `id_tail`): `None` holds the read. Without the
    /// open-transaction bound, the largest key (a transaction holding a lower one that commits
    /// later is missed, as the contract then says).
    async fn append_read_bound(&mut self) -> Result<Option<KeyValue>, WorkerError> {
        let (max_key, at_micros) = self.resources.source.key_sample(&self.reads, &self.sql).await?;
        self.id_tail.record(Sample { at_micros, max_key });
        let bound = if self.task.open_transaction_bound {
            let Some(visibility) = self.visible_writers().await? else {
                return Ok(None);
            };
            self.id_tail.safe_bound(visibility.oldest_start_micros).flatten()
        } else {
            max_key
        };
        let sql_type = self.sql.key_types()[0].clone();
        Ok(bound.map(|value| KeyValue {
            sql_type,
            value: value.to_string(),
        }))
    }

    /// What the open-transaction bound sees of the source's writers, or `None` while it must
    /// hold the reads where they are: it cannot see every writer (the coordinator's watcher
    /// pauses the task and names the fix), or a prepared transaction, whose start is unknown,
    /// is open. Logs when the reason changes.
    async fn visible_writers(&mut self) -> Result<Option<visibility::Visibility>, WorkerError> {
        let (visibility, prepared) = self.resources.source.visibility(&self.sql.source).await?;
        let hold = visibility
            .blind_spot(&self.sql.source)
            .or_else(|| visibility.unreadable.clone())
            .or_else(|| prepared.as_ref().map(visibility::prepared_hold));
        if hold != self.bound_hold {
            match &hold {
                Some(reason) => {
                    tracing::warn!(task = %self.task.name, shard = self.shard_id, %reason, "holding the reads")
                }
                None => tracing::info!(task = %self.task.name, shard = self.shard_id, "the reads move on again"),
            }
            self.bound_hold = hold.clone();
        }
        Ok(hold.is_none().then_some(visibility))
    }

    /// The plan for the page after a full one, when it needs nothing from the source (the
    /// snapshot, the append scan or the cycle continues): it can be read while the full page
    /// is being applied.
    fn plan_next(&self, upper: &Cursor) -> Option<ReadPlan> {
        match upper.position {
            Position::Incremental {
                cycle_high_micros: None,
                ..
            } => None,
            _ => Some(self.plan_at(upper, None)),
        }
    }

    /// What the page at `cursor` reads; `new_cycle_high` is the high of a new cycle (for an
    /// incremental cursor between cycles).
    fn plan_at(&self, cursor: &Cursor, new_cycle_high: Option<i64>) -> ReadPlan {
        let page_size = self.task.page_size;
        let epoch = self.epoch;
        match &cursor.position {
            Position::Snapshot { after_key } => ReadPlan {
                statement: self.reads.snapshot_page(
                    &self.sql,
                    &self.range,
                    after_key.as_deref(),
                    self.snapshot_max_key.as_ref(),
                    page_size,
                ),
                // A short snapshot page is the range's last: the shard moves on.
                on_short: if self.appends() {
                    Cursor::new(
                        epoch,
                        Position::Append {
                            after_key: after_key.clone(),
                        },
                    )
                } else {
                    self.incremental_start.clone()
                },
                cycle: None,
                scan: None,
                target_layout: self.sql.key_pages_in_target_layout(),
            },
            Position::Append { after_key } => ReadPlan {
                // Up to the bound no open transaction can still add a key below.
                statement: self.reads.snapshot_page(
                    &self.sql,
                    &self.range,
                    after_key.as_deref(),
                    self.append_bound.as_ref(),
                    page_size,
                ),
                on_short: cursor.clone(),
                cycle: None,
                scan: None,
                target_layout: self.sql.key_pages_in_target_layout(),
            },
            Position::Incremental {
                floor_micros,
                t_micros,
                after_key,
                cycle_high_micros,
            } => {
                let floor = *floor_micros;
                let (scan_t, scan_key, high) = match cycle_high_micros {
                    Some(high) => (*t_micros, after_key.clone(), *high),
                    // A new cycle re-reads the overlap below the watermark once.
                    None => (
                        floor - (self.task.overlap_ms as i64) * 1000,
                        None,
                        new_cycle_high.expect("a new cycle's high is read before planning it"),
                    ),
                };
                ReadPlan {
                    statement: self.reads.incremental_page(
                        &self.sql,
                        &self.range,
                        scan_t,
                        scan_key.as_deref(),
                        high,
                        None,
                        page_size,
                    ),
                    // A short page ends the cycle: everything below `high` has been read.
                    on_short: Cursor::incremental_at(epoch, high),
                    cycle: Some((floor, high)),
                    scan: Some(Scan {
                        t_micros: scan_t,
                        after_key: scan_key,
                        high_micros: high,
                    }),
                    target_layout: false,
                }
            }
        }
    }

    /// Rows are only ever inserted and read by key alone (append and accumulate modes).
    fn appends(&self) -> bool {
        matches!(self.task.mode.as_str(), "append" | "accumulate")
    }

    fn batch<'a>(
        &'a self,
        manifest: &'a Manifest,
        data: &'a Bytes,
        overlap: Option<OverlapRegion>,
    ) -> Result<BatchToApply<'a>, WorkerError> {
        Ok(BatchToApply {
            sql: &self.sql,
            write: &self.write,
            format: CopyFormat::from_data_format(&manifest.data_format).map_err(WorkerError::Data)?,
            manifest,
            data,
            overlap,
            max_dead_letter_ratio: self.task.max_dead_letter_ratio,
        })
    }

    fn count_dead_letters(&self, applied: &crate::apply::Applied) {
        if applied.dead_letters > 0 {
            metrics::count(&metrics::METRICS.dead_letters, &self.task.name, applied.dead_letters);
        }
    }

    /// The cursor after a page whose last row is `(key, t)`.
    fn after_row(&self, plan: &ReadPlan, key: &[KeyValue], t_micros: Option<i64>, full: bool) -> Cursor {
        let key = Some(key.to_vec());
        match (&self.cursor.position, plan.cycle, full) {
            (Position::Snapshot { .. }, _, true) => Cursor::new(self.epoch, Position::Snapshot { after_key: key }),
            (Position::Append { .. }, _, _) => Cursor::new(self.epoch, Position::Append { after_key: key }),
            (Position::Snapshot { .. }, _, false) if self.appends() => {
                Cursor::new(self.epoch, Position::Append { after_key: key })
            }
            (Position::Incremental { .. }, Some((floor, high)), true) => Cursor::new(
                self.epoch,
                Position::Incremental {
                    floor_micros: floor,
                    t_micros: t_micros.expect("incremental rows carry their cursor time"),
                    after_key: key,
                    cycle_high_micros: Some(high),
                },
            ),
            _ => plan.on_short.clone(),
        }
    }

    /// Reads the page the plan describes. With a delete log, the log's entries between the
    /// same positions come with it; when they fill a page of their own, the rows stop where
    /// the log page stopped. Returns the page and whether it was full (more to read).
    fn reader(&self) -> Reader {
        Reader {
            source: self.resources.source.clone(),
            reads: self.reads.clone(),
            sql: self.sql.clone(),
            range: self.range.clone(),
            page_size: self.task.page_size,
        }
    }
}

/// What reading a page needs, owned, so that a read can run beside the shard's apply.
struct Reader {
    source: SourcePool,
    reads: SourceReads,
    sql: TableSql,
    range: ShardRange,
    page_size: u32,
}

impl Reader {
    async fn read_changes(&self, plan: &ReadPlan) -> Result<(Page, bool), WorkerError> {
        let source = &self.source;
        let page_size = self.page_size;
        let rows = read_page(
            source,
            &self.sql,
            &plan.statement,
            self.sql.page_format,
            plan.target_layout,
        )
        .await?;
        let rows_full = rows.row_count == u64::from(page_size);
        let log = match self.sql.deletes.as_ref().map(|d| &d.source) {
            Some(DeleteSource::Log(log)) => log,
            _ => return Ok((rows, rows_full)),
        };
        let Some(scan) = &plan.scan else {
            return Ok((rows, rows_full));
        };
        let upper = match (&rows.last, rows_full) {
            (Some((key, Some(t))), true) => LogUpper::AtMost(*t, key),
            _ => LogUpper::Below(scan.high_micros),
        };
        let statement = self.reads.delete_log_page(
            &self.sql,
            log,
            &self.range,
            scan.t_micros,
            scan.after_key.as_deref(),
            upper,
            page_size,
        );
        // In the format the rows came in (text where one of their values had no binary form),
        // so that the two join into one stream.
        let deletes = read_page(source, &self.sql, &statement, rows.format, false).await?;
        same_format(&rows, &deletes)?;
        if deletes.row_count < u64::from(page_size) {
            return Ok((Page::concat(rows, deletes, true)?, rows_full));
        }
        let Some((log_key, Some(log_t))) = deletes.last.clone() else {
            return Err(WorkerError::Data("a full delete-log page without a position".into()));
        };
        let statement = self.reads.incremental_page(
            &self.sql,
            &self.range,
            scan.t_micros,
            scan.after_key.as_deref(),
            scan.high_micros,
            Some((log_t, &log_key)),
            page_size,
        );
        let rows = read_page(source, &self.sql, &statement, deletes.format, false).await?;
        same_format(&rows, &deletes)?;
        Ok((Page::concat(rows, deletes, false)?, true))
    }
}

/// Rows and delete-log entries join into one stream only in one format. A source that renders
/// text answers a page in text where one of its values has no binary form; when only one of
/// the two came so, the shard reads text from then on (`BinaryTypes`; nothing was staged).
fn same_format(rows: &Page, deletes: &Page) -> Result<(), WorkerError> {
    if rows.format == deletes.format {
        return Ok(());
    }
    Err(WorkerError::BinaryTypes(format!(
        "the rows came as COPY {} and the delete-log entries as COPY {}",
        rows.format.name(),
        deletes.format.name()
    )))
}

impl ShardRun {
    /// One page. Returns true when the shard has caught up with the source (wait a poll).
    async fn step(&mut self, client: &CoordinatorClient) -> Result<bool, WorkerError> {
        let (plan, read) = match self.prefetched.take() {
            Some((plan, page, full)) => (plan, Some((page, full))),
            None => match self.plan_read().await? {
                Some(plan) => (plan, None),
                None => return Ok(true),
            },
        };
        let span = tracing::info_span!(
            "batch",
            task = %self.task.name,
            epoch = self.epoch,
            shard = self.shard_id,
            batch_id = tracing::field::Empty,
            rows = tracing::field::Empty,
            bytes = tracing::field::Empty,
            format = tracing::field::Empty,
            unchanged = tracing::field::Empty,
            lower = tracing::field::Empty,
            upper = tracing::field::Empty,
            replay = false,
        );
        match self.step_in(client, plan, read).instrument(span).await {
            Err(WorkerError::BinaryTypes(reason)) => {
                self.read_text(&reason);
                Ok(false)
            }
            other => other,
        }
    }

    /// `read`: the page when it was read ahead, during the previous batch's apply.
    async fn step_in(
        &mut self,
        client: &CoordinatorClient,
        plan: ReadPlan,
        read: Option<(Page, bool)>,
    ) -> Result<bool, WorkerError> {
        let (page, full) = match read {
            Some(read) => read,
            None => metrics::step("read", self.reader().read_changes(&plan)).await?,
        };
        metrics::count(&metrics::METRICS.rows_read, &self.task.name, page.row_count);
        crash::point("after_read");
        let upper = match &page.last {
            Some((key, t_micros)) => self.after_row(&plan, key, *t_micros, full),
            None => plan.on_short.clone(),
        };
        if upper == self.cursor {
            // Append-only and caught up: nothing to commit.
            return Ok(true);
        }
        let lower = self.cursor.clone();
        let mut page = page;
        let filtered = self.leave_out_applied(&plan, &mut page)?;
        // After a full page the next one is known already: read it while this one is staged,
        // applied and committed (at most one page ahead; it is dropped if this batch fails).
        let next = if full { self.plan_next(&upper) } else { None };
        let page = PageToDeliver {
            lower,
            upper,
            data: page.data,
            format: page.format,
            row_count: page.row_count,
            repair: false,
            target_layout: plan.target_layout,
        };
        let clean = match next {
            None => self.deliver(client, page).await?,
            Some(next) => {
                let reader = self.reader();
                let read_ahead = async {
                    let read = reader.read_changes(&next).await;
                    (next, read)
                };
                let (delivered, (next, read)) =
                    tokio::join!(self.deliver(client, page), metrics::step("read", read_ahead));
                let clean = delivered?;
                // A failed read ahead is simply read again by the next step.
                if let Ok((page, full)) = read {
                    self.prefetched = Some((next, page, full));
                }
                clean
            }
        };
        if let Some(filtered) = filtered {
            self.recent.committed(filtered, clean);
        }
        Ok(!full)
    }

    /// Leaves out of an incremental page the rows this run applied already, unchanged (see
    /// `recent_rows`), and returns what to remember once the page commits. Other pages go as
    /// they were read.
    fn leave_out_applied(&self, plan: &ReadPlan, page: &mut Page) -> Result<Option<Filtered>, WorkerError> {
        let Some((_, high)) = plan.cycle else {
            return Ok(None);
        };
        if self.task.overlap_ms == 0 || page.row_count == 0 {
            return Ok(None);
        }
        let mut filtered = self
            .recent
            .filter(page.format, &page.data, &self.sql.key_positions(), high)
            .map_err(WorkerError::Data)?;
        if let Some(data) = filtered.data.take() {
            tracing::Span::current().record("unchanged", filtered.skipped);
            metrics::count(&metrics::METRICS.rows_unchanged, &self.task.name, filtered.skipped);
            page.data = Bytes::from(data);
            page.row_count = filtered.kept;
        }
        Ok(Some(filtered))
    }

    /// The batch protocol for one page of data read at the committed cursor: stage, register,
    /// apply, verify, commit. A repair batch (reconciliation) has `upper == lower`. Returns
    /// whether every row reached the target (none went to the dead letters).
    pub(crate) async fn deliver(
        &mut self,
        client: &CoordinatorClient,
        page: PageToDeliver,
    ) -> Result<bool, WorkerError> {
        let PageToDeliver {
            lower,
            upper,
            data,
            format,
            row_count,
            repair,
            target_layout,
        } = page;
        let batch_id = batch::batch_id(&self.task.name, self.epoch, self.shard_id, self.version, &lower, &upper);
        let span = tracing::Span::current();
        span.record("batch_id", batch_id.as_str());
        span.record("rows", row_count);
        span.record("bytes", data.len() as u64);
        span.record("format", format.name());
        span.record("lower", lower.describe().as_str());
        span.record("upper", upper.describe().as_str());
        let bounds = Bounds {
            batch_id,
            lower,
            upper,
            row_count,
            late_row_lateness_micros: Vec::new(),
        };
        if row_count == 0 {
            metrics::step("commit", self.commit(client, bounds, true, false)).await?;
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
            row_count,
            byte_size: data.len() as u64,
            content_hash: batch::content_hash(&data),
            schema_id: self.task.schema_id.clone(),
            fence_token: self.fence,
            data_path: String::new(),
            data_format: format.data_format().to_string(),
            repair,
            target_layout,
        };
        let manifest_path =
            metrics::step("stage", self.resources.staging.write_batch(&mut manifest, data.clone())).await?;
        crash::point("after_stage");
        let register = client.register_batch(pb::RegisterBatchRequest {
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
        });
        metrics::step("register", register).await?;
        crash::point("after_register");
        let overlap = if repair {
            None
        } else {
            overlap_region(&bounds.lower, &bounds.upper)
        };
        let applied = match metrics::step(
            "apply",
            apply_batch(&self.resources.target, &self.batch(&manifest, &data, overlap)?),
        )
        .await
        {
            Err(WorkerError::BinaryTypes(reason)) => {
                // Nothing of it reached the target: abandon it; the step reads it again as text.
                self.abandon(client, &manifest.batch_id, reason.clone()).await?;
                return Err(WorkerError::BinaryTypes(reason));
            }
            other => other?,
        };
        self.count_dead_letters(&applied);
        let clean = applied.dead_letters == 0;
        let (outcome, late) = (applied.outcome, applied.late);
        if outcome == ApplyOutcome::Applied {
            metrics::count(&metrics::METRICS.rows_applied, &self.task.name, row_count);
        }
        if outcome == ApplyOutcome::AlreadyApplied {
            // A commit whose outcome looked unknown had gone through; the ledger said so.
            tracing::info!(task = %self.task.name, shard = self.shard_id, batch_id = %manifest.batch_id, "batch was already applied");
        }
        crash::point("after_apply");
        if !late.is_empty() {
            tracing::info!(
                task = %self.task.name, shard = self.shard_id, late_rows = late.len(),
                max_lateness_ms = late.iter().max().copied().unwrap_or(0) / 1000,
                "overlap re-read found late rows"
            );
        }
        let bounds = Bounds {
            late_row_lateness_micros: late,
            ..bounds
        };
        crash::stop_point("before_commit");
        metrics::step("commit", self.commit(client, bounds, false, false)).await?;
        metrics::METRICS
            .batches
            .get_or_create(&tidemark_common::metrics::labels(&[
                ("task", &self.task.name),
                ("kind", if repair { "repair" } else { "rows" }),
                ("format", format.name()),
            ]))
            .inc();
        crash::point("after_commit");
        Ok(clean)
    }

    /// Work beside reading (a reconciliation of this shard), as the step's last commit
    /// answered it or else asked of the coordinator, and does it.
    async fn shard_work(&mut self, client: &CoordinatorClient) -> Result<(), WorkerError> {
        let reconcile = match self.work_from_commit.take() {
            Some(reconcile) => reconcile,
            None => {
                let work = client
                    .next_shard_work(pb::ShardWorkRequest {
                        worker_id: self.worker_id.clone(),
                        task: self.task.name.clone(),
                        epoch: self.epoch,
                        shard_id: self.shard_id,
                        fence_token: self.fence,
                    })
                    .await?;
                self.release_requested |= work.release;
                work.reconcile
            }
        };
        if let Some(order) = reconcile
            && self.cursor.incremental_time().is_some()
        {
            self.reconcile(client, &order).await?;
        }
        Ok(())
    }

    /// `high = min(source now − safety_delay, start of the oldest open source transaction)`.
    /// `None` holds the watermark where it is (see `visible_writers`).
    async fn read_window_high(&mut self) -> Result<Option<i64>, WorkerError> {
        let source = &self.resources.source;
        // The clock first: a transaction that starts after this reading writes times above it.
        let now = source_now_micros(source).await?;
        let high = now - (self.task.safety_delay_ms as i64) * 1000;
        if !self.task.open_transaction_bound {
            return Ok(Some(high));
        }
        let Some(visibility) = self.visible_writers().await? else {
            return Ok(None);
        };
        // Its rows may carry times rounded down to the cursor's precision.
        Ok(Some(visibility.oldest_start_micros.map_or(high, |oldest| {
            high.min(oldest - self.sql.cursor_unit_micros())
        })))
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
                late_row_lateness_micros: bounds.late_row_lateness_micros,
            })
            .await?;
        tracing::debug!(
            task = %self.task.name, shard = self.shard_id, batch_id = %bounds.batch_id, rows = bounds.row_count,
            upper = %bounds.upper.describe(), version = response.new_version, "batch committed"
        );
        self.version = response.new_version;
        self.cursor = bounds.upper;
        self.release_requested |= response.release;
        self.work_from_commit = response.shard_work.then_some(response.reconcile);
        Ok(())
    }
}
