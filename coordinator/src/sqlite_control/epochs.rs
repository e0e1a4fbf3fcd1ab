//! The epoch lifecycle's records on the embedded store (see `crate::epochs`).

use sqlx::{Row, SqliteConnection};

use crate::batches::Staged;
use crate::checkpoints::EpochPlan;
use crate::epochs::{Building, Lifecycle};
use crate::error::CoordinatorError;

use super::checkpoints::insert_epoch;
use super::{SqliteControl, bad, batches, micros_time, now_micros};

/// SQLite's spelling of `now()` in the lifecycle's `SET` fragments (microseconds).
const NOW: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";

/// An epoch still building is given up (see `crate::epochs`).
async fn abandon(conn: &mut SqliteConnection, task: &str, epoch: u64) -> Result<(), CoordinatorError> {
    sqlx::query("UPDATE epochs SET state = 'abandoned', retired_at = $3 WHERE task = $1 AND epoch = $2")
        .bind(task)
        .bind(epoch as i64)
        .bind(now_micros())
        .execute(&mut *conn)
        .await?;
    batches::abandon(conn, Staged::Epoch { task, epoch }).await?;
    sqlx::query("UPDATE tasks SET building_epoch = NULL WHERE name = $1 AND building_epoch = $2")
        .bind(task)
        .bind(epoch as i64)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

impl SqliteControl {
    pub async fn next_epoch(&self, task: &str) -> Result<u64, CoordinatorError> {
        let max: Option<i64> = sqlx::query_scalar("SELECT max(epoch) FROM epochs WHERE task = $1")
            .bind(task)
            .fetch_one(&self.pool)
            .await?;
        Ok(max.unwrap_or(0) as u64 + 1)
    }

    pub async fn lifecycle(&self, task: &str) -> Result<Option<Lifecycle>, CoordinatorError> {
        let Some(row) = sqlx::query(
            "SELECT t.current_epoch, t.building_epoch, t.swap_to, e.frozen, t.swap_error FROM tasks t \
             JOIN epochs e ON e.task = t.name AND e.epoch = t.current_epoch WHERE t.name = $1",
        )
        .bind(task)
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(None);
        };
        let building = match row.get::<Option<i64>, _>(1) {
            None => None,
            Some(epoch) => {
                let b = sqlx::query(
                    "SELECT snapshot_done_micros, validation_run, validated_at IS NOT NULL, blocked_reason, \
                     switch_requested FROM epochs WHERE task = $1 AND epoch = $2",
                )
                .bind(task)
                .bind(epoch)
                .fetch_one(&self.pool)
                .await?;
                Some(Building {
                    epoch: epoch as u64,
                    snapshot_done_micros: b.get(0),
                    validation_run: b.get::<Option<i64>, _>(1).map(|r| r as u64),
                    validated: b.get(2),
                    blocked_reason: b.get(3),
                    switch_requested: b.get(4),
                })
            }
        };
        let others = sqlx::query(
            "SELECT epoch, state, retired_at FROM epochs WHERE task = $1 AND state IN ('retained', 'abandoned') \
             ORDER BY epoch DESC",
        )
        .bind(task)
        .fetch_all(&self.pool)
        .await?;
        let mut retained = Vec::new();
        let mut abandoned = Vec::new();
        for other in others {
            let epoch = other.get::<i64, _>(0) as u64;
            match other.get::<String, _>(1).as_str() {
                "retained" => retained.push((
                    epoch,
                    other
                        .get::<Option<i64>, _>(2)
                        .map_or_else(chrono::Utc::now, micros_time),
                )),
                _ => abandoned.push(epoch),
            }
        }
        Ok(Some(Lifecycle {
            live: row.get::<i64, _>(0) as u64,
            live_frozen: row.get(3),
            building,
            swap_to: row.get::<Option<i64>, _>(2).map(|e| e as u64),
            swap_error: row.get(4),
            retained,
            abandoned,
        }))
    }

    pub async fn begin_building(
        &self,
        plan: &EpochPlan,
        freeze_live: bool,
        deferred: &[String],
    ) -> Result<bool, CoordinatorError> {
        let mut tx = self.write().await?;
        let row = sqlx::query("SELECT current_epoch, building_epoch, swap_to FROM tasks WHERE name = $1")
            .bind(&plan.task)
            .fetch_one(&mut *tx)
            .await?;
        if let Some(to) = row.get::<Option<i64>, _>(2) {
            return Err(bad(format!(
                "task {}: a switch to epoch {to} is in progress; reinitialize after it",
                plan.task
            )));
        }
        let newest: i64 = sqlx::query_scalar("SELECT max(epoch) FROM epochs WHERE task = $1")
            .bind(&plan.task)
            .fetch_one(&mut *tx)
            .await?;
        if newest as u64 >= plan.epoch {
            tx.rollback().await?;
            return Ok(false);
        }
        if let Some(building) = row.get::<Option<i64>, _>(1) {
            abandon(&mut tx, &plan.task, building as u64).await?;
        }
        insert_epoch(&mut tx, plan).await?;
        sqlx::query("UPDATE epochs SET state = 'building', deferred_ddl = $3 WHERE task = $1 AND epoch = $2")
            .bind(&plan.task)
            .bind(plan.epoch as i64)
            .bind(serde_json::json!(deferred).to_string())
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "UPDATE tasks SET building_epoch = $2, paused_reason = NULL, max_source_clock_micros = NULL \
             WHERE name = $1",
        )
        .bind(&plan.task)
        .bind(plan.epoch as i64)
        .execute(&mut *tx)
        .await?;
        if freeze_live {
            sqlx::query("UPDATE epochs SET frozen = 1 WHERE task = $1 AND epoch = $2")
                .bind(&plan.task)
                .bind(row.get::<i64, _>(0))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// `UPDATE epochs SET {set}` for one epoch, while its state is one of `states`; `set`
    /// may bind `$3` to `value` and say `now()`.
    pub async fn update_epoch(
        &self,
        task: &str,
        epoch: u64,
        set: &str,
        states: &str,
        value: Option<i64>,
    ) -> Result<(), CoordinatorError> {
        let set = set.replace("now()", NOW);
        let statement = format!("UPDATE epochs SET {set} WHERE task = $1 AND epoch = $2 AND state IN ({states})");
        let mut query = sqlx::query(sqlx::AssertSqlSafe(statement))
            .bind(task)
            .bind(epoch as i64);
        if statement_binds_value(&set) {
            query = query.bind(value);
        }
        query.execute(&self.pool).await?;
        Ok(())
    }

    pub async fn set_blocked(&self, task: &str, epoch: u64, reason: &str) -> Result<(), CoordinatorError> {
        sqlx::query("UPDATE epochs SET blocked_reason = $3 WHERE task = $1 AND epoch = $2 AND state = 'building'")
            .bind(task)
            .bind(epoch as i64)
            .bind(reason)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn set_swap_error(&self, task: &str, error: &str) -> Result<(), CoordinatorError> {
        sqlx::query("UPDATE tasks SET swap_error = $2 WHERE name = $1 AND swap_to IS NOT NULL")
            .bind(task)
            .bind(error)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn deferred_ddl(&self, task: &str, epoch: u64) -> Result<Vec<String>, CoordinatorError> {
        let text: String = sqlx::query_scalar("SELECT deferred_ddl FROM epochs WHERE task = $1 AND epoch = $2")
            .bind(task)
            .bind(epoch as i64)
            .fetch_one(&self.pool)
            .await?;
        serde_json::from_str(&text).map_err(|e| bad(format!("stored deferred statements: {e}")))
    }

    pub async fn request_swap(&self, task: &str, to: u64) -> Result<bool, CoordinatorError> {
        Ok(
            sqlx::query("UPDATE tasks SET swap_to = $2 WHERE name = $1 AND (swap_to IS NULL OR swap_to = $2)")
                .bind(task)
                .bind(to as i64)
                .execute(&self.pool)
                .await?
                .rows_affected()
                == 1,
        )
    }

    pub async fn complete_swap(&self, task: &str, to: u64) -> Result<Option<u64>, CoordinatorError> {
        let mut tx = self.write().await?;
        let row = sqlx::query("SELECT current_epoch, building_epoch, swap_to FROM tasks WHERE name = $1")
            .bind(task)
            .fetch_one(&mut *tx)
            .await?;
        if row.get::<Option<i64>, _>(2) != Some(to as i64) {
            tx.rollback().await?;
            return Ok(None);
        }
        let from = row.get::<i64, _>(0) as u64;
        let switching = row.get::<Option<i64>, _>(1) == Some(to as i64);
        let replaced = if switching { "retained" } else { "abandoned" };
        let now = now_micros();
        sqlx::query("UPDATE epochs SET state = $3, retired_at = $4, frozen = 0 WHERE task = $1 AND epoch = $2")
            .bind(task)
            .bind(from as i64)
            .bind(replaced)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE epochs SET state = 'live', retired_at = NULL, frozen = 0 WHERE task = $1 AND epoch = $2")
            .bind(task)
            .bind(to as i64)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "UPDATE tasks SET current_epoch = $2, swap_to = NULL, swap_error = NULL, \
             building_epoch = CASE WHEN building_epoch = $2 THEN NULL ELSE building_epoch END WHERE name = $1",
        )
        .bind(task)
        .bind(to as i64)
        .execute(&mut *tx)
        .await?;
        batches::abandon(&mut tx, Staged::Epoch { task, epoch: from }).await?;
        tx.commit().await?;
        Ok(Some(from))
    }

    /// A building epoch's rows applied so far and when it started.
    pub async fn building_progress(
        &self,
        task: &str,
        epoch: u64,
    ) -> Result<(i64, Option<chrono::DateTime<chrono::Utc>>), CoordinatorError> {
        let (rows, started): (i64, Option<i64>) = sqlx::query_as(
            "SELECT coalesce(sum(c.rows_applied), 0), min(e.started_at) FROM checkpoints c \
             JOIN epochs e ON e.task = c.task AND e.epoch = c.epoch WHERE c.task = $1 AND c.epoch = $2",
        )
        .bind(task)
        .bind(epoch as i64)
        .fetch_one(&self.pool)
        .await?;
        Ok((rows, started.map(micros_time)))
    }
}

/// Whether a `SET` fragment binds `$3`.
fn statement_binds_value(set: &str) -> bool {
    set.contains("$3")
}
