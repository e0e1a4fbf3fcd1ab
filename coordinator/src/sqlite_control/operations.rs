//! Shard operations and the worker registry on the embedded store (see `crate::operations`).

use std::time::Duration;

use sqlx::Row;
use tidemark_common::cursor::{Cursor, ShardRange};

use crate::batches::Staged;
use crate::checkpoints::ShardKey;
use crate::error::CoordinatorError;
use crate::operations::{ShardOp, ShardRow, WorkerRow};

use super::checkpoints::insert_shard;
use super::{SqliteControl, bad, batches, cursor_text, decode_cursor, now_micros, parse_json, shard_of};

impl SqliteControl {
    pub async fn list_shards(&self, task: Option<&str>) -> Result<Vec<ShardRow>, CoordinatorError> {
        let rows = sqlx::query(
            "SELECT c.task, c.epoch, c.shard_id, c.range, c.phase, c.cursor, c.rows_applied, c.fence, c.pending_op, \
             CASE WHEN c.reserved_until > $2 THEN c.reserved_for END \
             FROM checkpoints c JOIN tasks t ON t.name = c.task AND t.current_epoch = c.epoch \
             WHERE NOT c.retired AND ($1 IS NULL OR c.task = $1) ORDER BY c.task, c.shard_id",
        )
        .bind(task)
        .bind(now_micros())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|row| {
                let range = parse_json(&row.get::<String, _>(3), "range")?;
                let op: Option<String> = row.get(8);
                Ok(ShardRow {
                    key: shard_of(&row, 0),
                    range: serde_json::from_value(range).map_err(|e| bad(format!("stored range: {e}")))?,
                    phase: row.get(4),
                    cursor: decode_cursor(&row.get::<String, _>(5))?,
                    rows_applied: row.get::<i64, _>(6) as u64,
                    fence: row.get::<i64, _>(7) as u64,
                    pending_op: op.and_then(|text| serde_json::from_str(&text).ok()),
                    reserved_for: row.get(9),
                })
            })
            .collect()
    }

    /// Records an operation on a shard that has none and asks its owner to release it; false
    /// when the shard already has one.
    pub async fn request_op(&self, shard: &ShardKey, op: &ShardOp) -> Result<bool, CoordinatorError> {
        let updated = sqlx::query(
            "UPDATE checkpoints SET pending_op = $4, release_requested = 1 \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND NOT retired AND pending_op IS NULL",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .bind(serde_json::to_string(op).expect("op serializes"))
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(updated == 1)
    }

    pub async fn clear_op(&self, shard: &ShardKey) -> Result<(), CoordinatorError> {
        sqlx::query(
            "UPDATE checkpoints SET pending_op = NULL, release_requested = 0 \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn reserve_for(
        &self,
        shard: &ShardKey,
        fence: u64,
        to: &str,
        lasting: Duration,
    ) -> Result<bool, CoordinatorError> {
        let now = now_micros();
        let done = sqlx::query(
            "UPDATE checkpoints SET pending_op = NULL, release_requested = 0, reserved_for = $4, reserved_until = $6 \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence = $5 AND NOT retired",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .bind(to)
        .bind(fence as i64)
        .bind(now + lasting.as_micros() as i64)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(done == 1)
    }

    pub async fn register_worker_row(&self, id: &str, lease_id: i64) -> Result<(), CoordinatorError> {
        sqlx::query(
            "INSERT INTO workers (id, lease_id, registered_at, last_seen) VALUES ($1, $2, $3, $3) \
             ON CONFLICT (id) DO UPDATE SET lease_id = excluded.lease_id, last_seen = $3, registered_at = $3",
        )
        .bind(id)
        .bind(lease_id)
        .bind(now_micros())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn workers_seen(&self, ids: &[String]) -> Result<(), CoordinatorError> {
        sqlx::query("UPDATE workers SET last_seen = $2 WHERE id IN (SELECT value FROM json_each($1))")
            .bind(serde_json::json!(ids).to_string())
            .bind(now_micros())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn worker_draining(&self, id: &str) -> Result<bool, CoordinatorError> {
        Ok(sqlx::query_scalar("SELECT draining FROM workers WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .unwrap_or(false))
    }

    pub async fn list_workers(&self) -> Result<Vec<WorkerRow>, CoordinatorError> {
        let rows = sqlx::query("SELECT id, lease_id, draining, ($1 - last_seen) / 1e6 FROM workers ORDER BY id")
            .bind(now_micros())
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| WorkerRow {
                id: row.get(0),
                lease_id: row.get(1),
                draining: row.get(2),
                seconds_since_seen: row.get(3),
            })
            .collect())
    }

    /// Marks a worker draining; false when no such worker registered.
    pub async fn drain_worker(&self, id: &str) -> Result<bool, CoordinatorError> {
        let updated = sqlx::query("UPDATE workers SET draining = 1 WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(updated == 1)
    }

    pub async fn request_release(&self, shards: &[ShardKey]) -> Result<(), CoordinatorError> {
        let mut tx = self.write().await?;
        for shard in shards {
            sqlx::query(
                "UPDATE checkpoints SET release_requested = 1 WHERE task = $1 AND epoch = $2 AND shard_id = $3",
            )
            .bind(&shard.task)
            .bind(shard.epoch as i64)
            .bind(shard.shard_id as i64)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Retires `parents` (each at the fence it was seen with) and inserts the children with
    /// new shard ids, moving pending reconciliation parts to them. `None`: a parent was
    /// claimed or changed since it was seen (nothing changed); else the children's ids.
    pub async fn replace_shards(
        &self,
        task: &str,
        epoch: u64,
        parents: &[(u32, u64)],
        children: &[(ShardRange, Cursor)],
    ) -> Result<Option<Vec<i64>>, CoordinatorError> {
        let mut tx = self.write().await?;
        let now = now_micros();
        for (shard_id, fence) in parents {
            let retired = sqlx::query(
                "UPDATE checkpoints SET retired = 1, pending_op = NULL, release_requested = 0, updated_at = $5 \
                 WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence = $4 AND NOT retired",
            )
            .bind(task)
            .bind(epoch as i64)
            .bind(*shard_id as i64)
            .bind(*fence as i64)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if retired != 1 {
                tx.rollback().await?;
                return Ok(None);
            }
        }
        let parent_ids: Vec<i32> = parents.iter().map(|(id, _)| *id as i32).collect();
        batches::abandon(
            &mut tx,
            Staged::Shards {
                task,
                epoch,
                shard_ids: &parent_ids,
            },
        )
        .await?;
        let mut next_id: i64 =
            sqlx::query_scalar("SELECT max(shard_id) + 1 FROM checkpoints WHERE task = $1 AND epoch = $2")
                .bind(task)
                .bind(epoch as i64)
                .fetch_one(&mut *tx)
                .await?;
        let parents_json = serde_json::json!(parent_ids).to_string();
        let mut child_ids = Vec::new();
        for (range, cursor) in children {
            let phase = if cursor.is_incremental() {
                "INCREMENTAL"
            } else {
                "SNAPSHOT"
            };
            insert_shard(
                &mut tx,
                task,
                epoch,
                next_id,
                &range.encode(),
                phase,
                &cursor_text(cursor),
                now,
            )
            .await?;
            sqlx::query(
                "INSERT INTO reconcile_shards (run_id, shard_id, state) SELECT DISTINCT run_id, $2, 'PENDING' \
                 FROM reconcile_shards s JOIN reconcile_runs r ON r.id = s.run_id \
                 WHERE r.task = $1 AND s.shard_id IN (SELECT value FROM json_each($3)) AND s.state = 'PENDING' \
                 ON CONFLICT DO NOTHING",
            )
            .bind(task)
            .bind(next_id)
            .bind(&parents_json)
            .execute(&mut *tx)
            .await?;
            child_ids.push(next_id);
            next_id += 1;
        }
        sqlx::query(
            "DELETE FROM reconcile_shards WHERE state = 'PENDING' AND shard_id IN (SELECT value FROM json_each($2)) \
             AND run_id IN (SELECT id FROM reconcile_runs WHERE task = $1)",
        )
        .bind(task)
        .bind(&parents_json)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(child_ids))
    }
}
