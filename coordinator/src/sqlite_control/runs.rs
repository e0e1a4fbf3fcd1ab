//! Reconciliation runs, what a shard's owner does beside reading, and housekeeping (history
//! pruning, the staging janitor's lookup, the capacity view) on the embedded store.

use std::time::Duration;

use sqlx::{Row, SqliteConnection};
use tidemark_common::config::ReconcileCompare;
use tidemark_proto::v1 as pb;

use crate::capacity::RunningShard;
use crate::checkpoints::ShardKey;
use crate::error::CoordinatorError;
use crate::history::Pruned;
use crate::reconcile_runs::{ShardReconcile, ShardWork};

use super::checkpoints::lock_checkpoint;
use super::{SqliteControl, decode_cursor, now_micros, shard_of};

/// Rows deleted per statement when pruning history.
pub const PRUNE_CHUNK: i64 = 10_000;

/// A run with its parts' sums; `$1` is now (microseconds).
const RUN_SELECT: &str = "SELECT r.id, r.task, r.epoch, r.reason, r.since_micros, r.requested_at, \
     r.finished_at IS NOT NULL, count(s.shard_id), count(s.shard_id) FILTER (WHERE s.state = 'DONE'), \
     coalesce(sum(s.ranges_compared), 0), coalesce(sum(s.rows_read), 0), coalesce(sum(s.keys_repaired), 0), \
     coalesce(sum(s.extra_in_target), 0), (coalesce(r.finished_at, $1) - r.requested_at) / 1000, r.compare, \
     coalesce(sum(s.keys_missed), 0) FROM reconcile_runs r LEFT JOIN reconcile_shards s ON s.run_id = r.id";

fn run_from_row(row: &sqlx::sqlite::SqliteRow) -> pb::ReconcileRun {
    pb::ReconcileRun {
        run_id: row.get::<i64, _>(0) as u64,
        task: row.get(1),
        epoch: row.get::<i64, _>(2) as u64,
        reason: row.get(3),
        since_micros: row.get(4),
        requested_at_micros: row.get(5),
        finished: row.get(6),
        shards_total: row.get::<i64, _>(7) as u32,
        shards_done: row.get::<i64, _>(8) as u32,
        ranges_compared: row.get::<i64, _>(9) as u64,
        rows_read: row.get::<i64, _>(10) as u64,
        keys_repaired: row.get::<i64, _>(11) as u64,
        extra_in_target: row.get::<i64, _>(12) as u64,
        duration_ms: row.get::<i64, _>(13).max(0) as u64,
        compare: row.get(14),
        keys_missed: row.get::<i64, _>(15) as u64,
    }
}

/// What each shard's owner should do beside reading (see `ControlDb::shard_works`).
pub(super) async fn shard_works_on(
    conn: &mut SqliteConnection,
    shards: &[ShardKey],
) -> Result<Vec<ShardWork>, CoordinatorError> {
    let mut works = Vec::with_capacity(shards.len());
    for shard in shards {
        let row = sqlx::query(
            "SELECT c.release_requested OR NOT EXISTS (SELECT 1 FROM running_epochs e \
             WHERE e.task = c.task AND e.epoch = c.epoch), o.id, o.since_micros, o.compare = 'versions' \
             FROM checkpoints c LEFT JOIN (SELECT r.id, r.since_micros, r.compare FROM reconcile_runs r \
               JOIN reconcile_shards s ON s.run_id = r.id WHERE r.task = $1 AND r.epoch = $2 AND s.shard_id = $3 \
               AND s.state = 'PENDING' ORDER BY r.id LIMIT 1) o ON true \
             WHERE c.task = $1 AND c.epoch = $2 AND c.shard_id = $3",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .fetch_optional(&mut *conn)
        .await?;
        let mut work = ShardWork::default();
        if let Some(row) = row {
            if row.get::<bool, _>(0) {
                work.release = true;
            } else {
                work.reconcile = row.get::<Option<i64>, _>(1).map(|id| pb::ReconcileOrder {
                    run_id: id as u64,
                    since_micros: row.get(2),
                    versions_only: row.get::<Option<bool>, _>(3).unwrap_or(false),
                });
            }
        }
        works.push(work);
    }
    Ok(works)
}

impl SqliteControl {
    pub async fn current_epoch_number(&self, task: &str) -> Result<Option<u64>, CoordinatorError> {
        let epoch: Option<i64> = sqlx::query_scalar("SELECT current_epoch FROM tasks WHERE name = $1")
            .bind(task)
            .fetch_optional(&self.pool)
            .await?;
        Ok(epoch.map(|e| e as u64))
    }

    pub async fn start_reconcile_of(
        &self,
        task: &str,
        epoch: u64,
        reason: &str,
        since_micros: Option<i64>,
        compare: ReconcileCompare,
    ) -> Result<u64, CoordinatorError> {
        let mut tx = self.write().await?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO reconcile_runs (task, epoch, reason, since_micros, compare, requested_at) \
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(reason)
        .bind(since_micros)
        .bind(compare.as_str())
        .bind(now_micros())
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO reconcile_shards (run_id, shard_id, state) \
             SELECT $1, c.shard_id, 'PENDING' FROM checkpoints c \
             WHERE c.task = $2 AND c.epoch = $3 AND NOT c.retired",
        )
        .bind(id)
        .bind(task)
        .bind(epoch as i64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(id as u64)
    }

    pub async fn shard_works(&self, shards: &[ShardKey]) -> Result<Vec<ShardWork>, CoordinatorError> {
        shard_works_on(&mut *self.pool.acquire().await?, shards).await
    }

    pub async fn report_reconcile(
        &self,
        shard: &ShardKey,
        fence: u64,
        run_id: u64,
        result: &ShardReconcile,
    ) -> Result<(), CoordinatorError> {
        let mut tx = self.write().await?;
        lock_checkpoint(&mut tx, shard, fence).await?;
        let now = now_micros();
        sqlx::query(
            "UPDATE reconcile_shards SET state = 'DONE', ranges_compared = $3, rows_read = $4, keys_repaired = $5, \
             extra_in_target = $6, duration_ms = $7, keys_missed = $8, finished_at = $9 \
             WHERE run_id = $1 AND shard_id = $2 AND state = 'PENDING'",
        )
        .bind(run_id as i64)
        .bind(shard.shard_id as i64)
        .bind(result.ranges_compared as i64)
        .bind(result.rows_read as i64)
        .bind(result.keys_repaired as i64)
        .bind(result.extra_in_target as i64)
        .bind(result.duration_ms as i64)
        .bind(result.keys_missed as i64)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE reconcile_runs SET finished_at = $2 WHERE id = $1 AND finished_at IS NULL \
             AND NOT EXISTS (SELECT 1 FROM reconcile_shards WHERE run_id = $1 AND state = 'PENDING')",
        )
        .bind(run_id as i64)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn reconcile_run(&self, run_id: u64) -> Result<Option<pb::ReconcileRun>, CoordinatorError> {
        let query = format!("{RUN_SELECT} WHERE r.id = $2 GROUP BY r.id");
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(now_micros())
            .bind(run_id as i64)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(run_from_row))
    }

    pub async fn last_reconcile(&self, task: &str) -> Result<Option<pb::ReconcileRun>, CoordinatorError> {
        let query = format!("{RUN_SELECT} WHERE r.task = $2 GROUP BY r.id ORDER BY r.id DESC LIMIT 1");
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(now_micros())
            .bind(task)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(run_from_row))
    }

    pub async fn seconds_since_last_reconcile(&self, task: &str) -> Result<Option<f64>, CoordinatorError> {
        let last: Option<i64> = sqlx::query_scalar("SELECT max(requested_at) FROM reconcile_runs WHERE task = $1")
            .bind(task)
            .fetch_one(&self.pool)
            .await?;
        Ok(last.map(|at| (now_micros() - at) as f64 / 1e6))
    }

    /// Deletes, chunk by chunk, the committed and abandoned batches, history and late rows
    /// older than `retention` (never a staged batch).
    pub async fn prune(&self, retention: Duration) -> Result<Pruned, sqlx::Error> {
        const STATEMENTS: [&str; 3] = [
            "DELETE FROM batches WHERE batch_id IN (SELECT batch_id FROM batches \
             WHERE state IN ('COMMITTED', 'ABANDONED') AND coalesce(committed_at, staged_at) < $1 LIMIT $2)",
            "DELETE FROM checkpoint_history WHERE id IN (SELECT id FROM checkpoint_history \
             WHERE committed_at < $1 ORDER BY id LIMIT $2)",
            "DELETE FROM late_rows WHERE id IN (SELECT id FROM late_rows WHERE found_at < $1 ORDER BY id LIMIT $2)",
        ];
        let before = now_micros() - retention.as_micros().min(i64::MAX as u128) as i64;
        let mut deleted = [0u64; 3];
        for (statement, count) in STATEMENTS.iter().zip(deleted.iter_mut()) {
            loop {
                let n = sqlx::query(*statement)
                    .bind(before)
                    .bind(PRUNE_CHUNK)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                *count += n;
                if n < PRUNE_CHUNK as u64 {
                    break;
                }
            }
        }
        let [batches, checkpoint_history, late_rows] = deleted;
        Ok(Pruned {
            batches,
            checkpoint_history,
            late_rows,
        })
    }

    /// The registered batches among `ids`: (batch id, state, manifest path, content hash).
    pub async fn batches_among(
        &self,
        ids: &[String],
    ) -> Result<Vec<(String, String, String, String)>, CoordinatorError> {
        Ok(sqlx::query_as(
            "SELECT batch_id, state, manifest_path, content_hash FROM batches \
             WHERE batch_id IN (SELECT value FROM json_each($1))",
        )
        .bind(serde_json::json!(ids).to_string())
        .fetch_all(&self.pool)
        .await?)
    }

    pub async fn running_shards(&self) -> Result<Vec<RunningShard>, CoordinatorError> {
        let rows = sqlx::query(
            "SELECT c.task, c.epoch, c.shard_id, c.cursor, $1 - coalesce(c.acquired_at, c.updated_at), \
             c.release_requested OR c.pending_op IS NOT NULL \
             FROM checkpoints c JOIN running_epochs r ON r.task = c.task AND r.epoch = c.epoch \
             JOIN tasks t ON t.name = c.task WHERE NOT c.retired AND t.paused_reason IS NULL",
        )
        .bind(now_micros())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|row| {
                Ok(RunningShard {
                    key: shard_of(&row, 0),
                    incremental: decode_cursor(&row.get::<String, _>(3))?.is_incremental(),
                    held: Duration::from_micros(row.get::<i64, _>(4).max(0) as u64),
                    releasing: row.get(5),
                })
            })
            .collect()
    }
}
