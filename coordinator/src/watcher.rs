//! Watches each task's source for broken contract clauses and pauses the task with a named
//! reason instead of guessing (invariant 10):
//! - `clock moved backwards`: the source clock reads more than `clock_tolerance` below the
//!   highest reading seen (rows written meanwhile may carry times below the watermark);
//! - `id regression` (append mode): the source's largest key is below a committed cursor
//!   (keys were reused or a sequence was reset; new rows would never be read);
//! - `open transactions not visible`: the open-transaction bound cannot see every writer of
//!   the table (a role without `pg_read_all_stats`, a hot standby, a logical-replication
//!   subscriber); a prepared transaction is shown in `status` while it holds the watermark;
//! - `schema changed`: a column of the source table was added, dropped, renamed or changed
//!   its type (or a key or cursor column lost its NOT NULL) since the epoch was planned (the workers also refuse every page read after such
//!   a change, so none reaches the target before the pause). With `schema_changes =
//!   "evolve"`, columns added without a value for the rows already there evolve the live
//!   epoch instead (see [`evolve`]).

use std::time::Duration;

use tidemark_common::config::{DeletePolicy, SchemaChanges};
use tidemark_common::cursor::format_micros;
use tidemark_common::duration::format_duration;
use tidemark_common::pg::{TableName, TableSql, visibility};

use crate::checkpoints::{ControlDb, EpochRecord};
use crate::error::CoordinatorError;
use crate::leader::Leadership;
use crate::planner::{self, PreparedTask};
use tidemark_common::source::SourcePool;

pub async fn watch_source(control: ControlDb, task: PreparedTask, leadership: Leadership) {
    let name = task.config.name.clone();
    // One session; it only reads, so the guard (lock and idle-transaction timeouts) is moot.
    let pool = SourcePool::connect_lazy(&task.config.source, "tidemark-coordinator", 1, Duration::from_secs(60));
    let pool = match pool {
        Ok(pool) => pool,
        Err(error) => {
            tracing::error!(task = %name, %error, "source watcher cannot start");
            return;
        }
    };
    let interval = task.config.poll_interval.max(Duration::from_millis(500));
    let mut seen = Seen::default();
    let mut failing = 0u32;
    loop {
        tokio::time::sleep(interval).await;
        if !leadership.is_leader() {
            continue;
        }
        let Err(error) = check(&control, &task, &pool, &mut seen).await else {
            failing = 0;
            continue;
        };
        tracing::warn!(task = %name, %error, "source check failed; retrying");
        // A check that keeps failing the same way (a missing grant, a dropped log) leaves the
        // task unwatched: no retention, TRUNCATE, visibility or cursor check runs. Never in
        // silence: pause it with the error.
        let persistent = matches!(&error, CoordinatorError::Source(e) if !pool.is_transient(e));
        failing = if persistent { failing + 1 } else { 0 };
        if failing == MAX_FAILED_CHECKS {
            let reason = format!(
                "source checks keep failing: {error} ({MAX_FAILED_CHECKS} rounds in a row); the task's contract cannot be \
                 checked: fix it (see the README's Source requirements), then `tidemark-coordinator tasks resume {name}`"
            );
            // About the source, not an epoch: it holds whichever epoch is current.
            match control.pause_task(&name, &reason).await {
                Ok(true) => tracing::error!(task = %name, reason, "task paused: the source checks keep failing"),
                Ok(false) => {}
                Err(error) => tracing::warn!(task = %name, %error, "pausing the task failed"),
            }
        }
    }
}

/// Rounds in a row a source check may fail the same persistent way before the task pauses.
const MAX_FAILED_CHECKS: u32 = 5;

/// What the watcher remembers between rounds.
#[derive(Default)]
struct Seen {
    /// The newest finite cursor time of the source table at the last round.
    newest_cursor_micros: Option<i64>,
    /// `(epoch, floor)`: the epoch's watermark read just before a round found the source's
    /// columns unchanged. A column added later was added after it, so every row changed
    /// since carries a cursor time at or above it (see [`evolve`]).
    confirmed_floor: Option<(u64, i64)>,
}

async fn check(
    control: &ControlDb,
    task: &PreparedTask,
    pool: &SourcePool,
    seen: &mut Seen,
) -> Result<(), CoordinatorError> {
    let name = task.config.name.as_str();
    // One epoch per round: every verdict below is about it, and a pause lands only while it
    // is still the watched one (a `tasks reinit` meanwhile voids the round). While a new
    // epoch builds, it is the one watched: the live one's table serves until the switch.
    let Some(epoch) = control.watched_epoch(name).await? else {
        return Ok(());
    };
    let now: i64 = pool.now_micros().await.map_err(CoordinatorError::Source)?;
    if let Some(DeletePolicy::TombstoneTable { retention }) = &task.config.delete_policy {
        enforce_retention(control, task, &epoch, pool, now, *retention).await?;
        check_truncation(control, task, &epoch, pool).await?;
    }
    if control.paused_reason(name).await?.is_some() {
        return Ok(());
    }
    // Test hook: without the watcher's check, only the workers' refusal guards the target.
    // Test hook: while this file exists the check is skipped (the last confirmed watermark
    // stays), so a test can have rows read without a column before the change is seen.
    let gated = std::env::var_os("TIDEMARK_TEST_SCHEMA_WATCH_GATE").is_some_and(|f| std::path::Path::new(&f).exists());
    let watch_schema = std::env::var_os("TIDEMARK_TEST_NO_SCHEMA_WATCH").is_none() && !gated;
    if watch_schema {
        // Read before the columns: see `Seen::confirmed_floor` (only an evolving task needs it).
        let floor = match task.config.schema_changes {
            SchemaChanges::Evolve => control.epoch_floor(name, &epoch).await?,
            SchemaChanges::Pause => None,
        };
        match schema_change(task, pool, &epoch).await? {
            None => seen.confirmed_floor = floor.map(|floor| (epoch.epoch, floor)),
            Some(drift) => {
                let confirmed = seen.confirmed_floor.filter(|(e, _)| *e == epoch.epoch).map(|(_, f)| f);
                let reason = match task.config.schema_changes {
                    SchemaChanges::Evolve => match evolve(control, task, pool, &epoch, &drift, confirmed).await? {
                        Ok(()) => {
                            seen.confirmed_floor = None;
                            return Ok(());
                        }
                        Err(reason) => reason,
                    },
                    SchemaChanges::Pause => drift.reason,
                };
                if control.pause_epoch(name, epoch.epoch, &reason).await? {
                    tracing::error!(task = name, %reason, "pausing task");
                }
                return Ok(());
            }
        }
    }
    let table = TableName::parse(&task.config.source_table).map_err(CoordinatorError::InvalidRequest)?;
    if task.config.open_transaction_bound {
        let (seen, prepared) = pool.visibility(&table).await.map_err(CoordinatorError::Source)?;
        if let Some(reason) = seen.blind_spot(&table) {
            pause(
                control,
                name,
                epoch.epoch,
                &format!("{reason}; then `tidemark-coordinator tasks resume {name}`"),
            )
            .await?;
            return Ok(());
        }
        let hold = prepared.as_ref().map(visibility::prepared_hold);
        control.set_source_hold(name, hold.as_deref()).await?;
    }
    if let Some(every) = task.config.reconcile_every
        && control
            .seconds_since_last_reconcile(name)
            .await?
            .is_none_or(|elapsed| elapsed >= every.as_secs_f64())
    {
        let since = task.config.reconcile_window.map(|w| now - w.as_micros() as i64);
        let run_id = control
            .start_reconcile(name, "schedule", since, task.config.reconcile_compare)
            .await?;
        tracing::info!(task = name, run_id, "scheduled reconciliation started");
    }
    let tolerance = task.config.clock_tolerance().as_micros() as i64;
    if task.config.cursor_column.is_some()
        && let Some(reason) = impossible_cursor_values(control, task, &epoch, pool, now, seen).await?
    {
        pause(control, name, epoch.epoch, &reason).await?;
        return Ok(());
    }
    if let Some(highest) = control.record_source_clock(name, now).await?
        && now < highest - tolerance
    {
        let reason = format!(
            "clock moved backwards: the source clock reads {} but has read {} ({:.1}s later; tolerance {:.1}s). \
             Rows written meanwhile may carry times below the watermark; fix the clock, repair (reconcile or \
             reinitialize), then `tidemark-coordinator tasks resume {name}`",
            format_micros(now),
            format_micros(highest),
            (highest - now) as f64 / 1e6,
            tolerance as f64 / 1e6
        );
        pause(control, name, epoch.epoch, &reason).await?;
        return Ok(());
    }
    if task.config.mode.appends() {
        let key = &task.config.key[0];
        let reads = pool.bare_reads(&table);
        let (source_max, _) = pool
            .key_sample(&reads, &planner::table_sql(task)?)
            .await
            .map_err(CoordinatorError::Source)?;
        let committed_max = control
            .committed_key_positions(name, epoch.epoch)
            .await?
            .iter()
            .filter_map(|cursor| {
                cursor
                    .key_position()
                    .and_then(|k| k.first())
                    .and_then(|v| v.value.parse::<i64>().ok())
            })
            .max();
        if let Some(committed) = committed_max
            && source_max.is_none_or(|m| m < committed)
        {
            let shown = source_max.map_or_else(|| "none (empty table)".to_string(), |m| m.to_string());
            let reason = format!(
                "id regression: the source's largest {key} is {shown}, below the committed cursor {committed}; \
                 keys were reused or a sequence was reset, and new rows would never be read. \
                 Reinitialization required"
            );
            pause(control, name, epoch.epoch, &reason).await?;
        }
    }
    Ok(())
}

/// The delete log keeps entries for `retention`. Before purging older ones, every shard's
/// read position is checked: a shard whose watermark (or, in its snapshot, the epoch's start
/// bound) is older than the cutoff would miss deletes, so the task pauses with
/// `reinitialization required` — never a silent partial resume. Only then are entries older
/// than the cutoff purged (this coordinator is the only one that purges).
async fn enforce_retention(
    control: &ControlDb,
    task: &PreparedTask,
    epoch: &EpochRecord,
    source: &SourcePool,
    now: i64,
    retention: Duration,
) -> Result<(), CoordinatorError> {
    let name = task.config.name.as_str();
    let cutoff = now - retention.as_micros() as i64;
    let start = epoch.incremental_start.incremental_time();
    let oldest = control
        .committed_key_positions(name, epoch.epoch)
        .await?
        .iter()
        .map(|cursor| {
            if cursor.is_incremental() {
                cursor.incremental_time()
            } else {
                start
            }
        })
        .min()
        .flatten();
    if let Some(oldest) = oldest
        && oldest < cutoff
    {
        let reason = format!(
            "reinitialization required: a checkpoint ({}) is older than the delete log's retention ({}, kept since {}); \
             deletes before it are purged. Run `tidemark-coordinator tasks reinit {name}`",
            format_micros(oldest),
            format_duration(retention),
            format_micros(cutoff)
        );
        pause(control, name, epoch.epoch, &reason).await?;
    }
    let table = TableName::parse(&task.config.source_table).map_err(CoordinatorError::InvalidRequest)?;
    let purged = source
        .purge_delete_log(&table, cutoff)
        .await
        .map_err(CoordinatorError::Source)?;
    if purged > 0 {
        tracing::info!(task = name, purged, cutoff = %format_micros(cutoff), "purged delete-log entries past retention");
    }
    Ok(())
}

/// A TRUNCATE of the source table since the epoch's start bound removed rows the delete log
/// never saw: the target still holds them, so the task pauses with `reinitialization
/// required` (the new epoch's snapshot and reconciliation remove them). PostgreSQL records
/// TRUNCATEs by a statement trigger; MySQL has none, so the table's storage identity
/// (InnoDB's table id, recorded when the epoch was planned) is compared instead.
async fn check_truncation(
    control: &ControlDb,
    task: &PreparedTask,
    epoch: &EpochRecord,
    source: &SourcePool,
) -> Result<(), CoordinatorError> {
    let name = task.config.name.as_str();
    let table = TableName::parse(&task.config.source_table).map_err(CoordinatorError::InvalidRequest)?;
    let truncated = source
        .last_truncate_micros(&table)
        .await
        .map_err(CoordinatorError::Source)?;
    if let (Some(truncated), Some(start)) = (truncated, epoch.incremental_start.incremental_time())
        && truncated >= start
    {
        let reason = format!(
            "reinitialization required: {table} was truncated at {} (TRUNCATE bypasses the delete log, so the \
             target still holds the removed rows); run `tidemark-coordinator tasks reinit {name}`",
            format_micros(truncated)
        );
        pause(control, name, epoch.epoch, &reason).await?;
        return Ok(());
    }
    if let Some(planned) = &epoch.source_table_id {
        let now = source.table_identity(&table).await.map_err(CoordinatorError::Source)?;
        if now.as_ref() != Some(planned) {
            let reason = format!(
                "reinitialization required: {table} was truncated or rebuilt (its InnoDB table id is {} and was {planned} \
                 when epoch {} was planned; TRUNCATE bypasses the delete log, so the target may still hold removed \
                 rows, and OPTIMIZE TABLE or ALTER TABLE … FORCE change the id too); run \
                 `tidemark-coordinator tasks reinit {name}`",
                now.as_deref().unwrap_or("gone"),
                epoch.epoch
            );
            pause(control, name, epoch.epoch, &reason).await?;
        }
    }
    Ok(())
}

/// Cursor values no read window can hold, or that disagree with the source clock:
/// - `'infinity'` / `'-infinity'`: the row is never inside a window (and its time in
///   microseconds is out of range), so it would be skipped or fail its page forever;
/// - a naive cursor whose newest value lies ahead of the source clock beyond
///   `clock_tolerance`: its writers use another zone than the epoch reads it in;
/// - new rows keep arriving with times below the watermark minus the overlap: a wrong zone,
///   or writers whose clocks lag; the incremental reads never see them.
async fn impossible_cursor_values(
    control: &ControlDb,
    task: &PreparedTask,
    epoch: &EpochRecord,
    source: &SourcePool,
    now: i64,
    seen: &mut Seen,
) -> Result<Option<String>, CoordinatorError> {
    let name = task.config.name.as_str();
    let cursor = task.config.cursor_column.as_deref().unwrap_or_default();
    let sql = TableSql {
        cursor_zone: epoch.cursor_zone.clone(),
        ..planner::table_sql(task)?
    };
    let Some((infinite, newest)) = source.cursor_extremes(&sql).await.map_err(CoordinatorError::Source)? else {
        return Ok(None);
    };
    if let Some(mut values) = infinite {
        let value = values.pop().unwrap_or_default();
        return Ok(Some(format!(
            "impossible cursor value: {cursor} of key ({}) in {} is '{value}', which no read window can hold (the row \
             would be skipped or its page fail forever); set a real time, then `tidemark-coordinator tasks resume {name}`",
            values.join(", "),
            sql.source
        )));
    }
    let previous = std::mem::replace(&mut seen.newest_cursor_micros, newest);
    let Some(newest) = newest else {
        return Ok(None);
    };
    let zone = epoch.cursor_zone.as_deref();
    let read_as = zone.map_or_else(String::new, |z| format!(" (read as local times of {z})"));
    let tolerance = task.config.clock_tolerance().as_micros() as i64;
    if zone.is_some() && newest > now + tolerance {
        return Ok(Some(format!(
            "cursor values ahead of the source clock: the newest {cursor}{read_as} is {} while the source clock reads \
             {} ({:.0}s ahead); its writers use another zone: set cursor_time_zone, then reinitialization required: \
             `tidemark-coordinator tasks reinit {name}`",
            format_micros(newest),
            format_micros(now),
            (newest - now) as f64 / 1e6
        )));
    }
    // Rows written since the last round with cursor values below the watermark: only when the
    // newest value moved is the watermark (an aggregate over every shard) read.
    if previous.is_none_or(|previous| newest <= previous) {
        return Ok(None);
    }
    let overlap = task.config.overlap.as_micros() as i64;
    if let Some(watermark) = control.epoch_watermark(name, epoch.epoch).await?
        && newest < watermark - overlap
    {
        let cause = if zone.is_some() {
            format!(
                "its writers use another zone than the epoch reads it in: set cursor_time_zone; reinitialization required: `tidemark-coordinator tasks reinit {name}`"
            )
        } else {
            format!(
                "its writers' clocks lag the source's by more than the overlap: fix them or raise overlap, repair with \
                 `tidemark-coordinator reconcile --task {name}`, then `tidemark-coordinator tasks resume {name}`"
            )
        };
        return Ok(Some(format!(
            "rows written below the watermark: the newest {cursor}{read_as} moved to {}, older than the watermark {} \
             minus the overlap, so the incremental reads never see them; {cause}",
            format_micros(newest),
            format_micros(watermark)
        )));
    }
    Ok(None)
}

/// Whether a pause reason says that only a new epoch can continue the task (`tasks resume`
/// refuses it and names `tasks reinit`).
pub fn requires_reinitialization(reason: &str) -> bool {
    reason.to_lowercase().contains("reinitialization required")
}

/// Pauses the task for a verdict on `epoch` (nothing when a reinit replaced it meanwhile).
async fn pause(control: &ControlDb, task: &str, epoch: u64, reason: &str) -> Result<(), CoordinatorError> {
    if control.pause_epoch(task, epoch, reason).await? {
        tracing::error!(task, reason, "task paused: the source broke its contract");
    }
    Ok(())
}

/// How the source table's columns differ from the epoch's.
struct Drift {
    /// The columns now; `None`: the table is gone.
    columns: Option<Vec<planner::SourceColumn>>,
    schema_id: String,
    reason: String,
}

/// Whether the source table's columns (names and types, in order) differ from the epoch's.
async fn schema_change(
    task: &PreparedTask,
    source: &SourcePool,
    epoch: &EpochRecord,
) -> Result<Option<Drift>, CoordinatorError> {
    let name = task.config.name.as_str();
    let table = TableName::parse(&task.config.source_table).map_err(CoordinatorError::InvalidRequest)?;
    let columns = planner::introspect_source(source, name, &table).await?;
    let now = match &columns {
        Some(columns) => planner::schema_id(columns, &planner::required_columns(&task.config), &epoch.schema_id),
        None => "no table".to_string(),
    };
    Ok((now != epoch.schema_id).then(|| Drift {
        reason: planner::schema_changed_reason(&table, epoch.epoch, &now, &epoch.schema_id),
        columns,
        schema_id: now,
    }))
}

/// `schema_changes = "evolve"`: when the only difference is columns added without a value for
/// the rows already there, adds them to the target table (nullable) and to the live epoch,
/// and has every shard read again from `confirmed_floor` (rows changed since the column was
/// added may have been read without it). Where no floor was confirmed under this epoch (a
/// new leader), the shards read again from the epoch's incremental start. `Ok(Err(reason))`:
/// the change is not additive, and the task pauses with the reason.
async fn evolve(
    control: &ControlDb,
    task: &PreparedTask,
    source: &SourcePool,
    epoch: &EpochRecord,
    drift: &Drift,
    confirmed_floor: Option<i64>,
) -> Result<Result<(), String>, CoordinatorError> {
    let config = &task.config;
    let name = config.name.as_str();
    let Some(columns) = &drift.columns else {
        return Ok(Err(drift.reason.clone()));
    };
    let planned = planner::epoch_columns(name, epoch)?;
    let (kept, added): (Vec<_>, Vec<_>) = columns
        .iter()
        .cloned()
        .partition(|c| planned.iter().any(|p| p.name == c.column.name));
    let required = planner::required_columns(config);
    if added.is_empty() || planner::schema_id(&kept, &required, &epoch.schema_id) != epoch.schema_id {
        return Ok(Err(format!(
            "{} (schema_changes = \"evolve\" covers added columns only; a column was dropped, renamed, reordered \
             or changed its type)",
            drift.reason
        )));
    }
    let table = TableName::parse(&config.source_table).map_err(CoordinatorError::InvalidRequest)?;
    if let Some(unmapped) = added.iter().find(|c| c.column.sql_type.starts_with("unmapped ")) {
        return Ok(Err(format!(
            "{}: added column {:?} is of a type Tidemark does not map ({})",
            drift.reason,
            unmapped.column.name,
            unmapped.column.sql_type.trim_start_matches("unmapped ")
        )));
    }
    let names: Vec<String> = added.iter().map(|c| c.column.name.clone()).collect();
    let prefilled = crate::engines::source_side(config)?
        .prefilled_columns(source, &table, &names)
        .await?;
    if !prefilled.is_empty() {
        return Ok(Err(format!(
            "{}: column(s) {} of {table} were added with a value for the rows already there (a default, a generated \
             or identity column, or NOT NULL), which changed those rows without moving their cursor; \
             schema_changes = \"evolve\" cannot carry that over",
            drift.reason,
            prefilled.join(", ")
        )));
    }
    let reread_from = match (confirmed_floor, epoch.incremental_start.incremental_time()) {
        (Some(floor), _) => floor,
        (None, Some(start)) => {
            tracing::warn!(
                task = name,
                "no watermark confirmed before the column was added: reading again from the epoch's start"
            );
            start
        }
        (None, None) => return Ok(Err(drift.reason.clone())),
    };
    let mut target = TableName::parse(&config.target_table).map_err(CoordinatorError::InvalidRequest)?;
    if control
        .current_epoch(name)
        .await?
        .is_some_and(|live| live.epoch != epoch.epoch)
    {
        // The epoch builds beside the live table: its own table gains the columns.
        target = target.epoch_table(epoch.epoch);
    }
    let added_columns: Vec<_> = added.iter().map(|c| c.column.clone()).collect();
    let statements = match crate::engines::target_side(config)?
        .add_columns(config, &target, &added_columns)
        .await
    {
        Ok(statements) => statements,
        // A missing grant: pause with what to fix; after a resume the next round evolves.
        Err(error) => {
            return Ok(Err(format!(
                "schema changed: column(s) {} of {table} could not be added to the target table {target}: {error}; fix \
                 that (a MySQL/MariaDB target's account needs ALTER), then `tidemark-coordinator tasks resume {name}`",
                names.join(", ")
            )));
        }
    };
    let all: Vec<_> = columns.iter().map(|c| c.column.clone()).collect();
    if !control
        .evolve_epoch(
            name,
            epoch.epoch,
            &epoch.schema_id,
            &drift.schema_id,
            &planner::columns_json(&all),
            reread_from,
        )
        .await?
    {
        return Ok(Ok(()));
    }
    crate::metrics::count(
        &crate::metrics::METRICS.schema_evolutions,
        &[("task", name)],
        names.len() as u64,
    );
    tracing::warn!(task = name, epoch = epoch.epoch, added = ?names, ?statements, reread_from = %format_micros(reread_from),
        "source columns added: the epoch evolved, the target gained them, and shards read again from the confirmed watermark");
    Ok(Ok(()))
}
