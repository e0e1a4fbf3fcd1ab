//! The registry of reconciliation runs in the control database. A run has one part per shard
//! of its epoch; each part is done by the shard's current owner (the only one allowed to
//! stage repair batches for it) and reported under its fence.

use sqlx::{Acquire, Row};
use tidemark_proto::v1 as pb;

use tidemark_common::config::ReconcileCompare;

use crate::checkpoints::{ControlDb, ShardKey};
use crate::error::CoordinatorError;

/// One shard's result.
#[derive(Debug, Clone, Default)]
pub struct ShardReconcile {
    pub ranges_compared: u64,
    pub rows_read: u64,
    pub keys_repaired: u64,
    pub extra_in_target: u64,
    pub duration_ms: u64,
    pub keys_missed: u64,
}

/// What a shard's owner should do beside reading (`ControlDb::shard_works`).
#[derive(Debug, Clone, Default)]
pub struct ShardWork {
    /// Give the shard up.
    pub release: bool,
    /// A reconciliation part to do.
    pub reconcile: Option<pb::ReconcileOrder>,
}

const RUN_SELECT: &str = "SELECT r.id, r.task, r.epoch, r.reason, r.since_micros, \
     (extract(epoch from r.requested_at) * 1000000)::bigint, r.finished_at IS NOT NULL, \
     count(s.shard_id), count(s.shard_id) FILTER (WHERE s.state = 'DONE'), \
     coalesce(sum(s.ranges_compared), 0)::bigint, coalesce(sum(s.rows_read), 0)::bigint, \
     coalesce(sum(s.keys_repaired), 0)::bigint, coalesce(sum(s.extra_in_target), 0)::bigint, \
     coalesce((extract(epoch from (coalesce(r.finished_at, now()) - r.requested_at)) * 1000)::bigint, 0), \
     r.compare, coalesce(sum(s.keys_missed), 0)::bigint FROM reconcile_runs r \
     LEFT JOIN reconcile_shards s ON s.run_id = r.id";

fn run_from_row(row: &sqlx::postgres::PgRow) -> pb::ReconcileRun {
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

impl ControlDb {
    /// Creates a run over every shard of the task's live epoch; returns its id.
    pub async fn start_reconcile(
        &self,
        task: &str,
        reason: &str,
        since_micros: Option<i64>,
        compare: ReconcileCompare,
    ) -> Result<u64, CoordinatorError> {
        let epoch = match self.lite() {
            Some(lite) => lite.current_epoch_number(task).await?,
            None => sqlx::query_scalar::<_, i64>("SELECT current_epoch FROM tasks WHERE name = $1")
                .bind(task)
                .fetch_optional(self.pool())
                .await?
                .map(|e| e as u64),
        }
        .ok_or_else(|| CoordinatorError::UnknownTask(task.to_string()))?;
        self.start_reconcile_of(task, epoch, reason, since_micros, compare)
            .await
    }

    /// Creates a run over every shard of one epoch (a building epoch's validation); returns
    /// its id.
    pub async fn start_reconcile_of(
        &self,
        task: &str,
        epoch: u64,
        reason: &str,
        since_micros: Option<i64>,
        compare: ReconcileCompare,
    ) -> Result<u64, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite
                .start_reconcile_of(task, epoch, reason, since_micros, compare)
                .await;
        }
        let mut tx = self.pool().begin().await?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO reconcile_runs (task, epoch, reason, since_micros, compare) \
             VALUES ($1, $2, $3, $4, $5) RETURNING id",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(reason)
        .bind(since_micros)
        .bind(compare.as_str())
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO reconcile_shards (run_id, shard_id, state) \
             SELECT $1, c.shard_id, 'PENDING' FROM checkpoints c JOIN reconcile_runs r ON r.id = $1 \
             WHERE c.task = r.task AND c.epoch = r.epoch AND NOT c.retired",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(id as u64)
    }

    /// What each shard's owner should do beside reading, in one query for a group of shards
    /// (every idle shard asks once per poll interval; issue 20): give the shard up (a move,
    /// split, merge or drain waits for it, or its epoch no longer runs: an idle shard with
    /// nothing to commit hears of it only here), else the oldest part of a reconciliation
    /// run still pending for it, if any. One answer per shard, in order; a shard that is
    /// not there has nothing to do.
    pub async fn shard_works(&self, shards: &[ShardKey]) -> Result<Vec<ShardWork>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.shard_works(shards).await;
        }
        shard_works_on(&mut *self.pool().acquire().await?, shards).await
    }

    /// Records a shard's result under its owner's fence; the run is finished with its last
    /// part.
    pub async fn report_reconcile(
        &self,
        shard: &ShardKey,
        fence: u64,
        run_id: u64,
        result: &ShardReconcile,
    ) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.report_reconcile(shard, fence, run_id, result).await;
        }
        let mut tx = self.pool().begin().await?;
        Self::lock_checkpoint(tx.acquire().await?, shard, fence).await?;
        // Shards of one run report concurrently: without the run's lock, the last two could
        // each see the other still PENDING, and neither would finish the run.
        sqlx::query("SELECT 1 FROM reconcile_runs WHERE id = $1 FOR UPDATE")
            .bind(run_id as i64)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "UPDATE reconcile_shards SET state = 'DONE', ranges_compared = $3, rows_read = $4, keys_repaired = $5, \
             extra_in_target = $6, duration_ms = $7, keys_missed = $8, finished_at = now() \
             WHERE run_id = $1 AND shard_id = $2 AND state = 'PENDING'",
        )
        .bind(run_id as i64)
        .bind(shard.shard_id as i32)
        .bind(result.ranges_compared as i64)
        .bind(result.rows_read as i64)
        .bind(result.keys_repaired as i64)
        .bind(result.extra_in_target as i64)
        .bind(result.duration_ms as i64)
        .bind(result.keys_missed as i64)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE reconcile_runs SET finished_at = now() WHERE id = $1 AND finished_at IS NULL \
             AND NOT EXISTS (SELECT 1 FROM reconcile_shards WHERE run_id = $1 AND state = 'PENDING')",
        )
        .bind(run_id as i64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn reconcile_run(&self, run_id: u64) -> Result<Option<pb::ReconcileRun>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.reconcile_run(run_id).await;
        }
        let query = format!("{RUN_SELECT} WHERE r.id = $1 GROUP BY r.id");
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(run_id as i64)
            .fetch_optional(self.pool())
            .await?;
        Ok(row.as_ref().map(run_from_row))
    }

    /// The task's most recent run.
    pub async fn last_reconcile(&self, task: &str) -> Result<Option<pb::ReconcileRun>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.last_reconcile(task).await;
        }
        let query = format!("{RUN_SELECT} WHERE r.task = $1 GROUP BY r.id ORDER BY r.id DESC LIMIT 1");
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(task)
            .fetch_optional(self.pool())
            .await?;
        Ok(row.as_ref().map(run_from_row))
    }

    /// Seconds since the task's last run was requested, if any.
    pub async fn seconds_since_last_reconcile(&self, task: &str) -> Result<Option<f64>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.seconds_since_last_reconcile(task).await;
        }
        Ok(sqlx::query_scalar(
            "SELECT extract(epoch from now() - max(requested_at))::float8 FROM reconcile_runs WHERE task = $1",
        )
        .bind(task)
        .fetch_one(self.pool())
        .await?)
    }
}

/// `ControlDb::shard_works` on `conn` (a commit group's transaction answers it for the
/// shards it moved).
pub(crate) async fn shard_works_on(
    conn: &mut sqlx::PgConnection,
    shards: &[ShardKey],
) -> Result<Vec<ShardWork>, CoordinatorError> {
    let rows = sqlx::query(
        "SELECT g.i, c.release_requested OR NOT EXISTS (SELECT 1 FROM running_epochs e \
         WHERE e.task = c.task AND e.epoch = c.epoch), o.id, o.since_micros, o.versions_only \
         FROM unnest($1::text[], $2::bigint[], $3::int[]) WITH ORDINALITY AS g(task, epoch, shard_id, i) \
         JOIN checkpoints c ON c.task = g.task AND c.epoch = g.epoch AND c.shard_id = g.shard_id \
         LEFT JOIN LATERAL (SELECT r.id, r.since_micros, r.compare = 'versions' AS versions_only \
           FROM reconcile_runs r JOIN reconcile_shards s ON s.run_id = r.id \
           WHERE r.task = c.task AND r.epoch = c.epoch AND s.shard_id = c.shard_id AND s.state = 'PENDING' \
           ORDER BY r.id LIMIT 1) o ON true",
    )
    .bind(shards.iter().map(|s| s.task.as_str()).collect::<Vec<_>>())
    .bind(shards.iter().map(|s| s.epoch as i64).collect::<Vec<_>>())
    .bind(shards.iter().map(|s| s.shard_id as i32).collect::<Vec<_>>())
    .fetch_all(conn)
    .await?;
    let mut works: Vec<ShardWork> = shards.iter().map(|_| ShardWork::default()).collect();
    for row in rows {
        let work = &mut works[row.get::<i64, _>(0) as usize - 1];
        if row.get::<bool, _>(1) {
            work.release = true;
            continue;
        }
        work.reconcile = row.get::<Option<i64>, _>(2).map(|id| pb::ReconcileOrder {
            run_id: id as u64,
            since_micros: row.get(3),
            versions_only: row.get(4),
        });
    }
    Ok(works)
}
