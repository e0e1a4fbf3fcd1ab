//! The epoch lifecycle: `tasks reinit` builds a new epoch in a table beside the live one
//! (`<table>__tm_e<N>`) while the live epoch keeps serving and, unless its reads broke,
//! syncing. Once every shard of the new epoch finished its snapshot and its watermark passed
//! that point, a full reconciliation of the new table against the source validates it: it
//! passes when it repaired no row the watermark had already passed (rows changed since are in
//! flight, repaired as in any reconciliation). Then one target transaction swaps the tables
//! (automatically, or on `tasks switch` with `switch = "manual"`), and the control database
//! follows. The replaced epoch's table is retained for `tasks rollback` until
//! `epoch_retention` has passed, then dropped.
//!
//! ```text
//! building -> live -> retained -> dropped
//!     \                 (rollback: a retained epoch becomes live again; the one it
//!      abandoned          replaces is abandoned)
//! ```
//!
//! A swap in flight is recorded (`tasks.swap_to`) before the target renames anything, and
//! cleared only after the control database follows: a leader that finds it set (a restart in
//! between) finishes it, and the target's swap is idempotent. Every fence, ledger and CAS rule
//! holds for the building epoch as for any: its shards are ordinary shards of their epoch, its
//! batches carry their epoch, and the target routes each batch to its epoch's table under
//! the fence (a batch of a replaced epoch is refused there).

use std::collections::HashMap;
use std::time::Duration;

use sqlx::Row;
use tidemark_common::config::SwitchMode;
use tidemark_common::cursor::format_micros;
use tidemark_common::pg::TableName;
use tidemark_proto::v1 as pb;

use crate::batches::{self, Staged};
use crate::checkpoints::{ControlDb, EpochPlan};
use crate::engines;
use crate::error::CoordinatorError;
use crate::leader::Leadership;
use crate::planner::PreparedTask;

/// A task's epochs as the lifecycle sees them.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    pub live: u64,
    pub live_frozen: bool,
    pub building: Option<Building>,
    /// A swap in flight (see the module's documentation), and why its last attempt failed.
    pub swap_to: Option<u64>,
    pub swap_error: Option<String>,
    /// Retained (and not yet dropped) epochs, newest first: `(epoch, retired at)`.
    pub retained: Vec<(u64, chrono::DateTime<chrono::Utc>)>,
    /// Abandoned epochs whose tables are still to drop.
    pub abandoned: Vec<u64>,
}

#[derive(Debug, Clone)]
pub struct Building {
    pub epoch: u64,
    pub snapshot_done_micros: Option<i64>,
    pub validation_run: Option<u64>,
    pub validated: bool,
    pub blocked_reason: Option<String>,
    pub switch_requested: bool,
}

fn bad(message: String) -> CoordinatorError {
    CoordinatorError::InvalidRequest(message)
}

impl ControlDb {
    /// The epoch a new `tasks reinit` plans: above every epoch the task ever had.
    pub async fn next_epoch(&self, task: &str) -> Result<u64, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.next_epoch(task).await;
        }
        let max: Option<i64> = sqlx::query_scalar("SELECT max(epoch) FROM epochs WHERE task = $1")
            .bind(task)
            .fetch_one(self.pool())
            .await?;
        Ok(max.unwrap_or(0) as u64 + 1)
    }

    pub async fn lifecycle(&self, task: &str) -> Result<Option<Lifecycle>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.lifecycle(task).await;
        }
        let Some(row) = sqlx::query(
            "SELECT t.current_epoch, t.building_epoch, t.swap_to, e.frozen, t.swap_error FROM tasks t \
             JOIN epochs e ON e.task = t.name AND e.epoch = t.current_epoch WHERE t.name = $1",
        )
        .bind(task)
        .fetch_optional(self.pool())
        .await?
        else {
            return Ok(None);
        };
        let building: Option<i64> = row.get(1);
        let building = match building {
            None => None,
            Some(epoch) => {
                let b = sqlx::query(
                    "SELECT snapshot_done_micros, validation_run, validated_at IS NOT NULL, blocked_reason, \
                     switch_requested FROM epochs WHERE task = $1 AND epoch = $2",
                )
                .bind(task)
                .bind(epoch)
                .fetch_one(self.pool())
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
        .fetch_all(self.pool())
        .await?;
        let mut retained = Vec::new();
        let mut abandoned = Vec::new();
        for other in others {
            let epoch = other.get::<i64, _>(0) as u64;
            match other.get::<String, _>(1).as_str() {
                "retained" => retained.push((
                    epoch,
                    other
                        .get::<Option<chrono::DateTime<chrono::Utc>>, _>(2)
                        .unwrap_or_else(chrono::Utc::now),
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

    /// `tasks reinit`: records the planned epoch as building beside the live one and clears
    /// the task's pause. An epoch still building is abandoned (its table is dropped). With
    /// `freeze_live`, the live epoch's shards stop (its reads broke: the pause that asked for
    /// the reinit); its table keeps serving until the switch. False when another reinit
    /// planned this epoch first.
    pub async fn begin_building(
        &self,
        plan: &EpochPlan,
        freeze_live: bool,
        deferred: &[String],
    ) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.begin_building(plan, freeze_live, deferred).await;
        }
        let mut tx = self.pool().begin().await?;
        let row = sqlx::query("SELECT current_epoch, building_epoch, swap_to FROM tasks WHERE name = $1 FOR UPDATE")
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
        Self::insert_epoch(&mut tx, plan).await?;
        sqlx::query("UPDATE epochs SET state = 'building', deferred_ddl = $3 WHERE task = $1 AND epoch = $2")
            .bind(&plan.task)
            .bind(plan.epoch as i64)
            .bind(serde_json::json!(deferred))
            .execute(&mut *tx)
            .await?;
        run(
            &mut tx,
            "UPDATE tasks SET building_epoch = $2, paused_reason = NULL, max_source_clock_micros = NULL \
             WHERE name = $1",
            &plan.task,
            plan.epoch,
        )
        .await?;
        if freeze_live {
            sqlx::query("UPDATE epochs SET frozen = true WHERE task = $1 AND epoch = $2")
                .bind(&plan.task)
                .bind(row.get::<i64, _>(0))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Whether every shard of the epoch reads incrementally, and the epoch's watermark (the
    /// lowest committed incremental time) when they all do.
    pub async fn epoch_progress(&self, task: &str, epoch: u64) -> Result<(bool, Option<i64>), CoordinatorError> {
        let cursors = self.epoch_cursors(task, epoch).await?;
        let mut watermark: Option<i64> = None;
        let mut timed = true;
        let mut any = false;
        for cursor in cursors {
            if !cursor.is_incremental() {
                return Ok((false, None));
            }
            any = true;
            match cursor.incremental_time() {
                Some(t) => watermark = Some(watermark.map_or(t, |w| w.min(t))),
                None => timed = false,
            }
        }
        Ok((any, watermark.filter(|_| timed)))
    }

    async fn set_building(
        &self,
        task: &str,
        epoch: u64,
        assignments: &str,
        value: Option<i64>,
    ) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.update_epoch(task, epoch, assignments, "'building'", value).await;
        }
        let statement =
            format!("UPDATE epochs SET {assignments} WHERE task = $1 AND epoch = $2 AND state = 'building'");
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .bind(task)
            .bind(epoch as i64)
            .bind(value)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    async fn set_swap_error(&self, task: &str, error: &str) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.set_swap_error(task, error).await;
        }
        sqlx::query("UPDATE tasks SET swap_error = $2 WHERE name = $1 AND swap_to IS NOT NULL")
            .bind(task)
            .bind(error)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// The statements deferred to after the epoch's snapshot (see `TargetSide::build_epoch`).
    async fn deferred_ddl(&self, task: &str, epoch: u64) -> Result<Vec<String>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.deferred_ddl(task, epoch).await;
        }
        let value: serde_json::Value =
            sqlx::query_scalar("SELECT deferred_ddl FROM epochs WHERE task = $1 AND epoch = $2")
                .bind(task)
                .bind(epoch as i64)
                .fetch_one(self.pool())
                .await?;
        serde_json::from_value(value).map_err(|e| bad(format!("stored deferred statements: {e}")))
    }

    /// `UPDATE epochs SET {set}` for one epoch, while its state is one of `states`.
    async fn update_epoch(&self, task: &str, epoch: u64, set: &str, states: &str) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.update_epoch(task, epoch, set, states, None).await;
        }
        let statement = format!("UPDATE epochs SET {set} WHERE task = $1 AND epoch = $2 AND state IN ({states})");
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .bind(task)
            .bind(epoch as i64)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    async fn mark_validated(&self, task: &str, epoch: u64) -> Result<(), CoordinatorError> {
        self.update_epoch(task, epoch, "validated_at = now()", "'building'")
            .await
    }

    async fn mark_dropped(&self, task: &str, epoch: u64) -> Result<(), CoordinatorError> {
        self.update_epoch(task, epoch, "state = 'dropped'", "'retained', 'abandoned'")
            .await
    }

    /// `tasks validate`: forgets the building epoch's last validation; the next round starts
    /// another.
    async fn revalidate(&self, task: &str, epoch: u64) -> Result<(), CoordinatorError> {
        self.update_epoch(
            task,
            epoch,
            "validation_run = NULL, validated_at = NULL, blocked_reason = NULL",
            "'building'",
        )
        .await
    }

    async fn request_switch(&self, task: &str, epoch: u64) -> Result<(), CoordinatorError> {
        self.update_epoch(task, epoch, "switch_requested = true", "'building'")
            .await
    }

    async fn set_blocked(&self, task: &str, epoch: u64, reason: &str) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.set_blocked(task, epoch, reason).await;
        }
        sqlx::query("UPDATE epochs SET blocked_reason = $3 WHERE task = $1 AND epoch = $2 AND state = 'building'")
            .bind(task)
            .bind(epoch as i64)
            .bind(reason)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Records a swap in flight (the epoch whose table becomes live); false when another one
    /// is recorded.
    async fn request_swap(&self, task: &str, to: u64) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.request_swap(task, to).await;
        }
        Ok(
            sqlx::query("UPDATE tasks SET swap_to = $2 WHERE name = $1 AND (swap_to IS NULL OR swap_to = $2)")
                .bind(task)
                .bind(to as i64)
                .execute(self.pool())
                .await?
                .rows_affected()
                == 1,
        )
    }

    /// The control database follows a swap the target finished: `to` is live (its shards
    /// run), the epoch it replaced is retained (a switch) or abandoned (a rollback), and that
    /// epoch's staged batches are abandoned (commits of its shards are refused from now on).
    async fn complete_swap(&self, task: &str, to: u64) -> Result<Option<u64>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.complete_swap(task, to).await;
        }
        let mut tx = self.pool().begin().await?;
        let row = sqlx::query("SELECT current_epoch, building_epoch, swap_to FROM tasks WHERE name = $1 FOR UPDATE")
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
        sqlx::query("UPDATE epochs SET state = $3, retired_at = now(), frozen = false WHERE task = $1 AND epoch = $2")
            .bind(task)
            .bind(from as i64)
            .bind(replaced)
            .execute(&mut *tx)
            .await?;
        run(
            &mut tx,
            "UPDATE epochs SET state = 'live', retired_at = NULL, frozen = false WHERE task = $1 AND epoch = $2",
            task,
            to,
        )
        .await?;
        run(
            &mut tx,
            "UPDATE tasks SET current_epoch = $2, swap_to = NULL, swap_error = NULL, \
             building_epoch = CASE WHEN building_epoch = $2 THEN NULL ELSE building_epoch END WHERE name = $1",
            task,
            to,
        )
        .await?;
        batches::abandon(&mut tx, Staged::Epoch { task, epoch: from }).await?;
        tx.commit().await?;
        Ok(Some(from))
    }
}

impl ControlDb {
    /// A building epoch's rows applied so far and when it started.
    async fn building_progress(
        &self,
        task: &str,
        epoch: u64,
    ) -> Result<(i64, Option<chrono::DateTime<chrono::Utc>>), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.building_progress(task, epoch).await;
        }
        Ok(sqlx::query_as(
            "SELECT coalesce(sum(c.rows_applied), 0)::bigint, min(e.started_at) FROM checkpoints c \
             JOIN epochs e ON e.task = c.task AND e.epoch = c.epoch WHERE c.task = $1 AND c.epoch = $2",
        )
        .bind(task)
        .bind(epoch as i64)
        .fetch_one(self.pool())
        .await?)
    }
}

/// Runs `statement` with `$1` the task and `$2` an epoch.
async fn run(
    conn: &mut sqlx::PgConnection,
    statement: &'static str,
    task: &str,
    epoch: u64,
) -> Result<(), CoordinatorError> {
    sqlx::query(statement)
        .bind(task)
        .bind(epoch as i64)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// An epoch still building is given up: its shards stop (commits refused), its staged
/// batches are abandoned, its table is dropped by the next lifecycle round.
async fn abandon(tx: &mut sqlx::PgConnection, task: &str, epoch: u64) -> Result<(), CoordinatorError> {
    run(
        tx,
        "UPDATE epochs SET state = 'abandoned', retired_at = now() WHERE task = $1 AND epoch = $2",
        task,
        epoch,
    )
    .await?;
    batches::abandon(tx, Staged::Epoch { task, epoch }).await?;
    run(
        tx,
        "UPDATE tasks SET building_epoch = NULL WHERE name = $1 AND building_epoch = $2",
        task,
        epoch,
    )
    .await?;
    Ok(())
}

/// How long a switch waits for queries running on the live table before it gives up (and
/// tries again at the next lifecycle round): readers queue behind its lock meanwhile.
pub const SWAP_LOCK_WAIT: Duration = Duration::from_secs(2);

/// Test hook: while this file exists, no validation starts (a test changes the new table
/// between its snapshot and its validation).
const VALIDATION_GATE: &str = "TIDEMARK_TEST_VALIDATION_GATE";

/// The leader's lifecycle loop over every task.
pub async fn drive(control: ControlDb, tasks: HashMap<String, PreparedTask>, leadership: Leadership) {
    let interval = tasks
        .values()
        .map(|t| t.config.poll_interval)
        .min()
        .unwrap_or(Duration::from_secs(1))
        .clamp(Duration::from_millis(200), Duration::from_secs(2));
    loop {
        tokio::time::sleep(interval).await;
        if !leadership.is_leader() {
            continue;
        }
        for task in tasks.values() {
            if let Err(error) = round(&control, task).await {
                tracing::warn!(task = %task.config.name, %error, "epoch lifecycle round failed; retrying");
            }
        }
    }
}

/// One round for one task: finish a swap in flight, move a building epoch on (snapshot done,
/// validation, switch), drop tables past their retention.
async fn round(control: &ControlDb, task: &PreparedTask) -> Result<(), CoordinatorError> {
    let name = task.config.name.as_str();
    let Some(lifecycle) = control.lifecycle(name).await? else {
        return Ok(());
    };
    if let Some(to) = lifecycle.swap_to {
        return finish_swap(control, task, to).await;
    }
    if let Some(building) = &lifecycle.building {
        advance(control, task, building).await?;
    }
    let side = engines::target_side(&task.config)?;
    for epoch in &lifecycle.abandoned {
        side.drop_epoch_table(&task.config, *epoch).await?;
        control.mark_dropped(name, *epoch).await?;
        tracing::info!(task = name, epoch, "abandoned epoch's table dropped");
    }
    let retention = retention(task);
    for (epoch, retired_at) in &lifecycle.retained {
        if chrono::Utc::now() - *retired_at >= retention {
            side.drop_epoch_table(&task.config, *epoch).await?;
            control.mark_dropped(name, *epoch).await?;
            tracing::info!(
                task = name,
                epoch,
                "retained epoch's table dropped after epoch_retention"
            );
        }
    }
    Ok(())
}

/// A building epoch's next step.
async fn advance(control: &ControlDb, task: &PreparedTask, building: &Building) -> Result<(), CoordinatorError> {
    let name = task.config.name.as_str();
    let epoch = building.epoch;
    if building.validated {
        if (task.config.switch == SwitchMode::Auto || building.switch_requested)
            && control.request_swap(name, epoch).await?
        {
            finish_swap(control, task, epoch).await?;
        }
        return Ok(());
    }
    if building.blocked_reason.is_some() {
        return Ok(());
    }
    let (snapshot_done, watermark) = control.epoch_progress(name, epoch).await?;
    if !snapshot_done {
        return Ok(());
    }
    let Some(done) = building.snapshot_done_micros else {
        // The secondary indexes, now that the snapshot is loaded; the validation reads the
        // table as readers will.
        let deferred = control.deferred_ddl(name, epoch).await?;
        if !deferred.is_empty() {
            let failed = engines::target_side(&task.config)?
                .build_deferred(&task.config, &deferred)
                .await?;
            for failure in &failed {
                tracing::warn!(task = name, epoch, %failure, "index of the live table not carried over");
            }
            tracing::info!(
                task = name,
                epoch,
                built = deferred.len() - failed.len(),
                "secondary indexes built after the snapshot's load"
            );
        }
        let now = crate::planner::source_now_micros(&task.config).await?;
        control
            .set_building(name, epoch, "snapshot_done_micros = $3", Some(now))
            .await?;
        tracing::info!(task = name, epoch, at = %format_micros(now), "new epoch's snapshot complete; validation waits for its watermark");
        return Ok(());
    };
    match building.validation_run {
        None => {
            if std::env::var_os(VALIDATION_GATE).is_some_and(|f| std::path::Path::new(&f).exists()) {
                return Ok(());
            }
            if task.config.mode.appends() {
                // Append and accumulate epochs read inserts by key: they have no versions to
                // compare (a summary table holds totals, not rows). A complete snapshot and a
                // cycle past it are their validation.
                let now = crate::planner::source_now_micros(&task.config).await?;
                let cycle = (task.config.safety_delay + 2 * task.config.poll_interval).as_micros() as i64;
                if now - done > cycle {
                    control.mark_validated(name, epoch).await?;
                    tracing::info!(
                        task = name,
                        epoch,
                        "new epoch validated (read by key: its snapshot is complete)"
                    );
                }
                return Ok(());
            }
            if watermark.is_none_or(|w| w <= done) {
                return Ok(());
            }
            let compare = validation_compare(task);
            let run = control.start_reconcile_of(name, epoch, "reinit", None, compare).await?;
            control
                .set_building(name, epoch, "validation_run = $3", Some(run as i64))
                .await?;
            tracing::info!(
                task = name,
                epoch,
                run,
                "validating the new epoch: a full reconciliation of its table"
            );
        }
        Some(run_id) => {
            let Some(run) = control.reconcile_run(run_id).await? else {
                return Ok(());
            };
            if !run.finished {
                return Ok(());
            }
            if run.keys_missed == 0 {
                control.mark_validated(name, epoch).await?;
                tracing::info!(
                    task = name,
                    epoch,
                    run = run_id,
                    repaired = run.keys_repaired,
                    "new epoch validated: its reconciliation found no row it missed"
                );
            } else {
                let reason = format!(
                    "validation (reconciliation run {run_id}) found {} row(s) of the source that epoch {epoch}'s table \
                     lacked or held otherwise although its watermark had passed them ({} repaired in all); they are \
                     repaired, but the switch waits: find the cause (a write that moved a row's cursor back, a change \
                     to the new table), then `tidemark-coordinator tasks validate {name}` validates again",
                    run.keys_missed, run.keys_repaired
                );
                tracing::error!(task = name, epoch, %reason, "switch blocked");
                control.set_blocked(name, epoch, &reason).await?;
            }
        }
    }
    Ok(())
}

/// A validation compares content, unless the engine pair cannot hash some column alike
/// (then versions, as the task's own reconciliations do).
fn validation_compare(task: &PreparedTask) -> tidemark_common::config::ReconcileCompare {
    use tidemark_common::config::ReconcileCompare;
    if tidemark_common::config::hash_content(&task.config)
        || crate::planner::portable_content_columns(&task.columns).is_ok()
    {
        ReconcileCompare::Content
    } else {
        task.config.reconcile_compare
    }
}

/// The target swaps the tables (idempotent), then the control database follows.
async fn finish_swap(control: &ControlDb, task: &PreparedTask, to: u64) -> Result<(), CoordinatorError> {
    let name = task.config.name.as_str();
    let swapped = match engines::target_side(&task.config)?.swap_epoch(&task.config, to).await {
        Ok(swapped) => swapped,
        Err(error) => {
            // Retried every round; status shows why until it succeeds.
            control.set_swap_error(name, &error.to_string()).await?;
            return Err(error);
        }
    };
    tidemark_common::crash::point("swap_before_control");
    if let Some(from) = control.complete_swap(name, to).await? {
        // A rollback makes the previous epoch's shards claimable again.
        control.candidates_changed();
        crate::metrics::count(&crate::metrics::METRICS.epoch_switches, &[("task", name)], 1);
        tracing::warn!(task = name, from, to, swapped_now = swapped, table = %task.config.target_table,
            "epoch switched: the target's live table is epoch {to}'s now");
    }
    Ok(())
}

async fn lifecycle_of(control: &ControlDb, name: &str) -> Result<Lifecycle, CoordinatorError> {
    control
        .lifecycle(name)
        .await?
        .ok_or_else(|| bad(format!("no task {name}")))
}

/// The task's lifecycle and its building epoch; an error naming `tasks reinit` without one.
async fn building_of(control: &ControlDb, name: &str) -> Result<(Lifecycle, Building), CoordinatorError> {
    let lifecycle = lifecycle_of(control, name).await?;
    let building = lifecycle.building.clone().ok_or_else(|| {
        bad(format!(
            "task {name} has no epoch building: `tidemark-coordinator tasks reinit {name}` starts one"
        ))
    })?;
    Ok((lifecycle, building))
}

/// How long a replaced epoch is kept.
fn retention(task: &PreparedTask) -> chrono::Duration {
    chrono::Duration::from_std(task.config.epoch_retention).unwrap_or(chrono::Duration::MAX)
}

/// `tasks switch`: the validated building epoch becomes live now.
pub async fn switch(control: &ControlDb, task: &PreparedTask) -> Result<String, CoordinatorError> {
    let name = task.config.name.as_str();
    let (lifecycle, building) = building_of(control, name).await?;
    if !building.validated {
        return Err(bad(format!(
            "epoch {} of task {name} is not validated yet ({}); it switches after its validation",
            building.epoch,
            validation_text(control, &building).await?
        )));
    }
    control.request_switch(name, building.epoch).await?;
    if control.request_swap(name, building.epoch).await? {
        finish_swap(control, task, building.epoch).await?;
    }
    Ok(format!(
        "task {name}: epoch {} is live in {}; epoch {} is retained for `tasks rollback` for {}",
        building.epoch,
        task.config.target_table,
        lifecycle.live,
        tidemark_common::duration::format_duration(task.config.epoch_retention)
    ))
}

/// `tasks validate`: the building epoch's validation starts again.
pub async fn validate(control: &ControlDb, task: &PreparedTask) -> Result<String, CoordinatorError> {
    let name = task.config.name.as_str();
    let (_, building) = building_of(control, name).await?;
    control.revalidate(name, building.epoch).await?;
    Ok(format!(
        "task {name}: epoch {} is validated again (a full reconciliation of its table)",
        building.epoch
    ))
}

/// `tasks rollback`: the newest retained epoch becomes live again (the target swaps the tables
/// back); the epoch it replaces is abandoned and its table dropped.
pub async fn rollback(control: &ControlDb, task: &PreparedTask) -> Result<String, CoordinatorError> {
    let name = task.config.name.as_str();
    let lifecycle = lifecycle_of(control, name).await?;
    if let Some(building) = &lifecycle.building {
        return Err(bad(format!(
            "task {name}: epoch {} is building; a rollback would leave it without the epoch it builds beside. \
             Let it switch, or reinitialize again",
            building.epoch
        )));
    }
    let retention = retention(task);
    let Some((previous, retired_at)) = lifecycle.retained.first().copied() else {
        return Err(bad(format!(
            "task {name}: no epoch is retained to roll back to (a replaced epoch is kept for epoch_retention = {})",
            tidemark_common::duration::format_duration(task.config.epoch_retention)
        )));
    };
    if chrono::Utc::now() - retired_at >= retention {
        return Err(bad(format!(
            "task {name}: epoch {previous} was retained until {}; its table is being dropped",
            retired_at + retention
        )));
    }
    if !control.request_swap(name, previous).await? {
        return Err(bad(format!("task {name}: another switch is in progress")));
    }
    finish_swap(control, task, previous).await?;
    Ok(format!(
        "task {name}: epoch {previous} is live again in {}; epoch {} is abandoned and its table dropped",
        task.config.target_table, lifecycle.live
    ))
}

/// How a building epoch's validation stands, in words.
async fn validation_text(control: &ControlDb, building: &Building) -> Result<String, CoordinatorError> {
    if let Some(reason) = &building.blocked_reason {
        return Ok(format!("blocked: {reason}"));
    }
    if building.validated {
        return Ok("passed".into());
    }
    let Some(done) = building.snapshot_done_micros else {
        return Ok("waiting for the snapshot".into());
    };
    match building.validation_run {
        None => Ok(format!("waiting for the watermark to pass {}", format_micros(done))),
        Some(run) => Ok(match control.reconcile_run(run).await? {
            Some(r) => format!(
                "running (reconciliation run {run}: {}/{} shards)",
                r.shards_done, r.shards_total
            ),
            None => format!("running (reconciliation run {run})"),
        }),
    }
}

/// What `status` shows of a task's epochs besides the live one.
#[derive(Default)]
pub struct EpochsView {
    pub building: Option<pb::EpochStatus>,
    pub retained: Vec<pb::EpochStatus>,
    pub live_frozen: bool,
    pub warnings: Vec<String>,
}

/// The building and retained epochs of a task, for `status`.
pub async fn status(control: &ControlDb, task: &PreparedTask) -> Result<EpochsView, CoordinatorError> {
    let name = task.config.name.as_str();
    let Some(lifecycle) = control.lifecycle(name).await? else {
        return Ok(EpochsView::default());
    };
    let mut warnings = Vec::new();
    if let (Some(to), Some(error)) = (lifecycle.swap_to, &lifecycle.swap_error) {
        warnings.push(format!("the switch to epoch {to} failed and is retried: {error}"));
    }
    let live = TableName::parse(&task.config.target_table).map_err(bad)?;
    let building = match &lifecycle.building {
        None => None,
        Some(building) => {
            let (snapshot_complete, watermark) = control.epoch_progress(name, building.epoch).await?;
            let (rows_applied, started) = control.building_progress(name, building.epoch).await?;
            let estimated = control.estimated_rows(name, building.epoch).await?.unwrap_or(0);
            let eta_seconds = match (snapshot_complete, started) {
                (false, Some(started)) if rows_applied > 0 && estimated > rows_applied as u64 => {
                    let elapsed = (chrono::Utc::now() - started).num_milliseconds().max(1) as f64 / 1000.0;
                    Some((estimated - rows_applied as u64) as f64 / (rows_applied as f64 / elapsed))
                }
                _ => None,
            };
            Some(pb::EpochStatus {
                epoch: building.epoch,
                state: "building".into(),
                table: live.epoch_table(building.epoch).to_string(),
                snapshot_complete,
                rows_applied: rows_applied.max(0) as u64,
                estimated_rows: estimated,
                watermark_micros: watermark,
                validation: validation_text(control, building).await?,
                eta_seconds,
                retained_until_micros: None,
                awaiting_switch: building.validated && task.config.switch == SwitchMode::Manual,
            })
        }
    };
    let retention = retention(task);
    let retained = lifecycle
        .retained
        .iter()
        .map(|(epoch, retired_at)| pb::EpochStatus {
            epoch: *epoch,
            state: "retained".into(),
            table: live.epoch_table(*epoch).to_string(),
            retained_until_micros: (*retired_at + retention).timestamp_micros().into(),
            ..Default::default()
        })
        .collect();
    if let Some(building) = &building
        && building.validation.starts_with("blocked")
    {
        warnings.push(format!(
            "epoch {} cannot switch: {}",
            building.epoch, building.validation
        ));
    }
    if lifecycle.live_frozen {
        warnings.push(format!(
            "epoch {} does not sync while epoch {} builds (its reads broke); its table serves until the switch",
            lifecycle.live,
            building.as_ref().map_or(0, |b| b.epoch)
        ));
    }
    Ok(EpochsView {
        building,
        retained,
        live_frozen: lifecycle.live_frozen,
        warnings,
    })
}
