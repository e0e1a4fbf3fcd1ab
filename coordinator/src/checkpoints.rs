//! The control database: epochs, shard checkpoints and the batch registry.
//!
//! Every checkpoint change is one transaction that locks the shard's row, compares the fence
//! token (only the current lease holder may move it), the CAS version and the lower bound,
//! and then advances. Nothing else writes `cursor`, `version` or `fence`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Acquire, Row};
use tidemark_common::cursor::Cursor;
use tidemark_common::pg::{Column, connect_options, quote_ident};

use crate::batches::{self, Registration, Staged};
use crate::error::{CoordinatorError, display_url};
use crate::reconcile_runs::{ShardWork, shard_works_on};
use crate::sqlite_control::SqliteControl;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/control");

/// Identifies one shard of one epoch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShardKey {
    pub task: String,
    pub epoch: u64,
    pub shard_id: u32,
}

impl ShardKey {
    /// The key in a control-database row's first three columns: task, epoch, shard id.
    pub(crate) fn from_pg_row(row: &sqlx::postgres::PgRow) -> ShardKey {
        ShardKey {
            task: row.get(0),
            epoch: row.get::<i64, _>(1) as u64,
            shard_id: row.get::<i32, _>(2) as u32,
        }
    }
}

#[cfg(test)]
impl ShardKey {
    /// Shard `shard_id` of epoch 1 of a task `items`, for unit tests.
    pub(crate) fn of_items(shard_id: u32) -> ShardKey {
        ShardKey {
            task: "items".into(),
            epoch: 1,
            shard_id,
        }
    }
}

/// A shard a worker may claim, and the worker it is reserved for, if any.
pub struct Candidate {
    pub shard: ShardKey,
    pub reserved_for: Option<String>,
}

/// An epoch's frozen source columns as `epochs.columns` stores them: `[[name, type], …]`.
pub fn stored_columns(value: serde_json::Value) -> Result<Vec<Column>, serde_json::Error> {
    Ok(serde_json::from_value::<Vec<(String, String)>>(value)?
        .into_iter()
        .map(|(name, sql_type)| Column { name, sql_type })
        .collect())
}

/// A shard's row as the coordinator hands it to a new owner.
#[derive(Debug, Clone)]
pub struct ShardRecord {
    pub key: ShardKey,
    pub range: String,
    pub cursor: Cursor,
    pub version: u64,
    pub fence: u64,
}

#[derive(Debug, Clone)]
pub struct PendingBatchRecord {
    pub batch_id: String,
    pub manifest_path: String,
    pub lower: Cursor,
    pub upper: Cursor,
    pub row_count: u64,
    pub content_hash: String,
}

/// What an epoch froze at planning time.
#[derive(Debug, Clone)]
pub struct EpochRecord {
    pub epoch: u64,
    pub schema_id: String,
    pub columns: serde_json::Value,
    pub h0_max_key: Option<serde_json::Value>,
    pub incremental_start: Cursor,
    /// The zone of a `timestamp without time zone` cursor (see `TableSql::cursor_zone`).
    pub cursor_zone: Option<String>,
    /// The source table's storage identity at planning (see `SourcePool::table_identity`).
    pub source_table_id: Option<String>,
}

/// A planned epoch, written once.
#[derive(Debug, Clone)]
pub struct EpochPlan {
    pub task: String,
    pub epoch: u64,
    pub schema_id: String,
    pub columns: serde_json::Value,
    pub h0_time_micros: i64,
    pub h0_max_key: Option<serde_json::Value>,
    pub incremental_start: Cursor,
    /// Encoded shard ranges, in shard id order.
    pub ranges: Vec<String>,
    /// `pg_class.reltuples` at planning, when the table was ever analyzed.
    pub estimated_rows: Option<i64>,
    pub cursor_zone: Option<String>,
    pub source_table_id: Option<String>,
}

/// A shard claimed in the lease store, to be recorded under its new fence (`claim_shards`).
pub struct Claim {
    pub shard: ShardKey,
    pub fence: u64,
    pub owner: String,
}

/// A claim recorded: the shard's checkpoint, its pending batch, its epoch (`None`: it no
/// longer runs).
pub struct Claimed {
    pub record: ShardRecord,
    pub pending: Option<PendingBatchRecord>,
    pub epoch: Option<EpochRecord>,
}

pub struct RegisterBatch {
    pub shard: ShardKey,
    pub fence: u64,
    pub batch_id: String,
    pub lower: Cursor,
    pub upper: Cursor,
    pub row_count: u64,
    pub byte_size: u64,
    pub content_hash: String,
    pub manifest_path: String,
}

/// A shard's checkpoint row, locked for a change by its current owner.
pub(crate) struct LockedCheckpoint {
    pub cursor: Cursor,
    pub version: u64,
    pub last_batch_id: Option<String>,
    pub release_requested: bool,
}

/// The result of a commit: the new checkpoint version, and whether the owner is asked to
/// release the shard (a move, split, merge or drain waits for it).
#[derive(Debug, Clone)]
pub struct Committed {
    pub new_version: u64,
    pub release_requested: bool,
    /// A retry of a commit that had already succeeded (its reply was lost).
    pub repeated: bool,
    /// The shard's work beside reading as of the commit (what `shard_works` would answer);
    /// `None` for a repeated commit.
    pub work: Option<ShardWork>,
}

pub struct CommitBatch {
    pub shard: ShardKey,
    pub fence: u64,
    pub expected_version: u64,
    pub batch_id: String,
    pub lower: Cursor,
    pub upper: Cursor,
    pub row_count: u64,
    pub empty: bool,
    pub replayed: bool,
    pub late_row_lateness_micros: Vec<i64>,
}

/// What the checks on a locked checkpoint decided for one commit.
pub(crate) enum Judged {
    /// A retry of a commit that already succeeded.
    Repeated(Committed),
    /// The commit may move the checkpoint from `version`.
    Proceed { version: u64, release_requested: bool },
}

/// The compare-and-swap's checks of one commit against its shard's locked checkpoint.
///
/// A retry of a commit that already succeeded (its reply was lost) is recognised by the
/// stored cursor and last batch id and answered with the current version.
pub(crate) fn judge(commit: &CommitBatch, locked: LockedCheckpoint) -> Result<Judged, CoordinatorError> {
    let LockedCheckpoint {
        cursor,
        version,
        last_batch_id,
        release_requested,
    } = locked;
    if !commit.empty
        && cursor == commit.upper
        && last_batch_id.as_deref() == Some(commit.batch_id.as_str())
        && version == commit.expected_version + 1
    {
        return Ok(Judged::Repeated(Committed {
            new_version: version,
            release_requested,
            repeated: true,
            work: None,
        }));
    }
    let conflict = |message: String| CoordinatorError::CheckpointConflict {
        task: commit.shard.task.clone(),
        shard: commit.shard.shard_id,
        message,
    };
    if version != commit.expected_version {
        return Err(conflict(format!(
            "expected version {}, found {version}",
            commit.expected_version
        )));
    }
    if cursor != commit.lower {
        return Err(conflict(format!(
            "batch lower bound {} is not the committed cursor {}",
            commit.lower.describe(),
            cursor.describe()
        )));
    }
    Ok(Judged::Proceed {
        version,
        release_requested,
    })
}

/// Late rows of a task's current epoch.
#[derive(Debug, Clone, Default)]
pub struct Lateness {
    pub count: u64,
    pub p99_micros: i64,
    pub max_micros: i64,
}

#[derive(Debug, Clone)]
pub struct ShardStatusRow {
    pub shard_id: u32,
    pub range: String,
    pub phase: String,
    pub cursor: Cursor,
    pub rows_applied: u64,
}

/// A task's running epoch and pause, without its shards (`ControlDb::task_states`).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskState {
    pub name: String,
    pub epoch: u64,
    pub paused_reason: Option<String>,
}

#[derive(Debug, Clone)]
pub struct TaskStatusRow {
    pub name: String,
    pub epoch: u64,
    pub paused_reason: Option<String>,
    /// Why the source holds the watermark without a pause (see `set_source_hold`).
    pub source_hold: Option<String>,
    pub shards: Vec<ShardStatusRow>,
}

/// The control state: a PostgreSQL database (`postgres://…`, the cluster's), or the embedded
/// store (`sqlite://…`, see `crate::sqlite_control`). Both keep the same records under the
/// same rules; the checks below (`checked_lock`, `judge`, `admit_registration`) are shared.
#[derive(Clone)]
pub struct ControlDb {
    store: Store,
    /// Counts the changes this process made that can make shards claimable (see
    /// [`ControlDb::candidates_changed`]); shared by every clone.
    candidates: Arc<AtomicU64>,
}

#[derive(Clone)]
enum Store {
    Postgres(PgPool),
    Sqlite(SqliteControl),
}

/// Holds the right to be the only coordinator on a control state (see
/// [`ControlDb::hold_sole_coordinator`]) while it lives.
pub enum SoleCoordinator {
    Session(sqlx::PgConnection),
    LockFile(Option<crate::sqlite_control::LockFile>),
}

/// A shard's checkpoint row with what the owner checks need (see `checked_lock`).
pub(crate) struct CheckpointRow {
    pub cursor: Cursor,
    pub version: u64,
    pub fence: u64,
    pub last_batch_id: Option<String>,
    pub paused_reason: Option<String>,
    pub current_epoch: u64,
    pub retired: bool,
    pub release_requested: bool,
    /// Its epoch runs (see the `running_epochs` view).
    pub running: bool,
}

impl CheckpointRow {
    /// From a row read by `LOCK_COLUMNS_FROM` (column 0 is the position in the group).
    fn from_pg(row: &sqlx::postgres::PgRow) -> Result<CheckpointRow, CoordinatorError> {
        Ok(CheckpointRow {
            cursor: decode_cursor(row.get(1))?,
            version: row.get::<i64, _>(2) as u64,
            fence: row.get::<i64, _>(3) as u64,
            last_batch_id: row.get(4),
            paused_reason: row.get(5),
            current_epoch: row.get::<i64, _>(6) as u64,
            retired: row.get(7),
            release_requested: row.get(8),
            running: row.get(9),
        })
    }
}

fn decode_cursor(value: serde_json::Value) -> Result<Cursor, CoordinatorError> {
    Cursor::from_value(&value).map_err(|e| CoordinatorError::InvalidRequest(e.to_string()))
}

fn parse_cursor(text: &str) -> Result<Cursor, CoordinatorError> {
    Cursor::decode(text).map_err(|e| CoordinatorError::InvalidRequest(e.to_string()))
}

fn cursor_json(cursor: &Cursor) -> serde_json::Value {
    serde_json::to_value(cursor).expect("cursor serializes")
}

/// An epoch's columns from `from` on: epoch, schema_id, columns, h0_max_key,
/// incremental_start, cursor_zone, source_table_id.
fn epoch_from(row: &sqlx::postgres::PgRow, from: usize) -> Result<EpochRecord, CoordinatorError> {
    Ok(EpochRecord {
        epoch: row.get::<i64, _>(from) as u64,
        schema_id: row.get(from + 1),
        columns: row.get(from + 2),
        h0_max_key: row.get(from + 3),
        incremental_start: decode_cursor(row.get(from + 4))?,
        cursor_zone: row.get(from + 5),
        source_table_id: row.get(from + 6),
    })
}

/// Locks the checkpoint rows of the shards given as three arrays (task, epoch, shard id), in
/// key order (two groups never wait on each other in a cycle), with what the owner checks
/// need. Column 0 is the shard's 1-based position in the arrays.
pub(crate) const LOCK_COLUMNS_FROM: &str = "SELECT g.i, c.cursor, c.version, c.fence, c.last_batch_id, t.paused_reason, \
     t.current_epoch, c.retired, c.release_requested, \
     EXISTS (SELECT 1 FROM running_epochs r WHERE r.task = c.task AND r.epoch = c.epoch) \
     FROM unnest($1::text[], $2::bigint[], $3::int[]) WITH ORDINALITY AS g(task, epoch, shard_id, i) \
     JOIN checkpoints c ON c.task = g.task AND c.epoch = g.epoch AND c.shard_id = g.shard_id \
     JOIN tasks t ON t.name = c.task \
     ORDER BY c.task, c.epoch, c.shard_id FOR UPDATE OF c";

/// The checks of a change by the shard's owner on its locked row: the shard exists, `fence`
/// is current, the shard is not retired, its epoch runs, and the task is not paused, refused
/// in that order.
pub(crate) fn checked_lock(
    row: Option<CheckpointRow>,
    shard: &ShardKey,
    fence: u64,
) -> Result<LockedCheckpoint, CoordinatorError> {
    let row = row.ok_or_else(|| {
        CoordinatorError::InvalidRequest(format!(
            "no shard {} in epoch {} of task {}",
            shard.shard_id, shard.epoch, shard.task
        ))
    })?;
    if row.fence != fence {
        return Err(CoordinatorError::Fenced {
            task: shard.task.clone(),
            shard: shard.shard_id,
            current: row.fence,
            given: fence,
        });
    }
    if row.retired {
        return Err(CoordinatorError::ShardRetired {
            task: shard.task.clone(),
            shard: shard.shard_id,
        });
    }
    if !row.running {
        return Err(CoordinatorError::EpochSuperseded {
            task: shard.task.clone(),
            epoch: shard.epoch,
            current: row.current_epoch,
        });
    }
    if let Some(reason) = row.paused_reason {
        return Err(CoordinatorError::Paused {
            task: shard.task.clone(),
            reason,
        });
    }
    Ok(LockedCheckpoint {
        cursor: row.cursor,
        version: row.version,
        last_batch_id: row.last_batch_id,
        release_requested: row.release_requested,
    })
}

/// Whether the shard's checkpoint admits registering `batch`: the owner checks, and its lower
/// bound is the committed cursor.
pub(crate) fn admit_registration(batch: &RegisterBatch, row: Option<CheckpointRow>) -> Result<(), CoordinatorError> {
    let cursor = checked_lock(row, &batch.shard, batch.fence)?.cursor;
    if cursor != batch.lower {
        return Err(CoordinatorError::CheckpointConflict {
            task: batch.shard.task.clone(),
            shard: batch.shard.shard_id,
            message: format!(
                "batch lower bound {} is not the committed cursor {}",
                batch.lower.describe(),
                cursor.describe()
            ),
        });
    }
    Ok(())
}

/// A batch id registered before (a retry whose answer was lost, or a replay), found as
/// (content hash, state): the same content is the same batch; other content under its id is
/// refused.
pub(crate) fn judge_existing(batch: &RegisterBatch, (hash, state): (String, String)) -> Result<(), CoordinatorError> {
    if hash != batch.content_hash {
        return Err(CoordinatorError::Batch {
            batch_id: batch.batch_id.clone(),
            message: format!("already registered ({state}) with content {hash}; replay the staged batch"),
        });
    }
    Ok(())
}

/// A registration's answer from what its statement found; `None`: neither inserted nor
/// found (see `register_batches`).
fn judge_registration(
    batch: &RegisterBatch,
    registered: batches::Registered,
) -> Result<Option<Result<(), CoordinatorError>>, CoordinatorError> {
    let row = registered.checkpoint.as_ref().map(CheckpointRow::from_pg).transpose()?;
    if let Err(refused) = admit_registration(batch, row) {
        return Ok(Some(Err(refused)));
    }
    if registered.inserted {
        return Ok(Some(Ok(())));
    }
    Ok(registered.existing.map(|existing| judge_existing(batch, existing)))
}

impl ControlDb {
    /// Connects (creating the database when it does not exist) and runs the migrations.
    /// sqlx holds an advisory lock while migrating, so concurrent coordinators are safe.
    /// `schema`: the schema that holds the control tables (created when missing); `None`:
    /// the role's search path.
    pub async fn connect(url: &str, schema: Option<&str>) -> Result<ControlDb, CoordinatorError> {
        if crate::sqlite_control::is_sqlite_url(url) {
            if schema.is_some() {
                return Err(CoordinatorError::InvalidRequest(
                    "control_schema applies to a PostgreSQL control database, not to sqlite://".into(),
                ));
            }
            let store = SqliteControl::open(url).await?;
            return Ok(ControlDb {
                store: Store::Sqlite(store),
                candidates: Arc::default(),
            });
        }
        // One plan per statement and session, made once: the control statements are key
        // lookups over arrays whose best plan does not depend on the values bound, and
        // PostgreSQL otherwise plans each of them anew on most executions (a custom plan is
        // estimated cheaper for an array parameter). At 1,000 workers that planning was 29 %
        // of the control database's CPU (BENCHMARKS.md, issue 20, session 32). A plan made
        // while a table was small is replaced when its statistics are refreshed
        // (`control_statistics`).
        let mut options = connect_options(url, "tidemark-coordinator")
            .map_err(CoordinatorError::InvalidRequest)?
            .options([("plan_cache_mode", "force_generic_plan")]);
        if let Some(schema) = schema {
            options = options.options([("search_path", schema)]);
        }
        let pool_options = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10));
        let pool = match pool_options.clone().connect_with(options.clone()).await {
            Ok(pool) => pool,
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("3D000") => {
                let database = options.get_database().unwrap_or("tidemark").to_string();
                tracing::info!(database, url = %display_url(url), "control database does not exist; creating it");
                let admin = PgPoolOptions::new()
                    .max_connections(1)
                    .connect_with(options.clone().database("postgres"))
                    .await?;
                let create = format!("CREATE DATABASE {}", quote_ident(&database));
                if let Err(error) = sqlx::query(sqlx::AssertSqlSafe(create)).execute(&admin).await {
                    let raced = matches!(&error, sqlx::Error::Database(db) if db.code().as_deref() == Some("42P04"));
                    if !raced {
                        return Err(error.into());
                    }
                }
                admin.close().await;
                pool_options.connect_with(options).await?
            }
            Err(error) => return Err(error.into()),
        };
        if let Some(schema) = schema {
            let create = format!("CREATE SCHEMA IF NOT EXISTS {}", quote_ident(schema));
            if let Err(error) = sqlx::query(sqlx::AssertSqlSafe(create)).execute(&pool).await {
                // Two coordinators starting at once: one creates it, the other races.
                let raced = matches!(&error, sqlx::Error::Database(db) if db.code().as_deref() == Some("23505"));
                if !raced {
                    return Err(error.into());
                }
            }
        }
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| CoordinatorError::ControlDb(sqlx::Error::Migrate(Box::new(e))))?;
        Ok(ControlDb {
            store: Store::Postgres(pool),
            candidates: Arc::default(),
        })
    }

    /// The PostgreSQL control database. Every method answers for the embedded store before
    /// it gets here (`lite`).
    pub(crate) fn pool(&self) -> &PgPool {
        self.postgres_pool()
            .expect("a statement for PostgreSQL on the embedded control store")
    }

    /// The PostgreSQL control database's pool; `None` for the embedded store. For
    /// diagnostics: what its sessions planned (`pg_prepared_statements`).
    pub fn postgres_pool(&self) -> Option<&PgPool> {
        match &self.store {
            Store::Postgres(pool) => Some(pool),
            Store::Sqlite(_) => None,
        }
    }

    /// The embedded store, when the control state is one.
    pub(crate) fn lite(&self) -> Option<&SqliteControl> {
        match &self.store {
            Store::Postgres(_) => None,
            Store::Sqlite(store) => Some(store),
        }
    }

    /// Whether the control state is the embedded store.
    pub fn is_embedded(&self) -> bool {
        self.lite().is_some()
    }

    /// Makes this the only coordinator on this control state, for as long as the returned
    /// session lives (in-process leases have no election: a second one would hand out the
    /// same shards).
    pub async fn hold_sole_coordinator(&self) -> Result<SoleCoordinator, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return Ok(SoleCoordinator::LockFile(lite.hold_sole_coordinator()?));
        }
        let mut session = self.pool().acquire().await?;
        let held: bool = sqlx::query_scalar(
            "SELECT pg_try_advisory_lock(hashtextextended('tidemark sole coordinator ' || current_schema(), 0))",
        )
        .fetch_one(&mut *session)
        .await?;
        if !held {
            return Err(CoordinatorError::InvalidRequest(
                "another coordinator with in-process leases (e.g. a `tidemark sync`) is running on this control state; \
                 stop it first, or give this one its own state"
                    .into(),
            ));
        }
        // The session holds the lock: it leaves the pool, which would close it when idle.
        Ok(SoleCoordinator::Session(session.detach()))
    }

    /// The largest fence token any shard ever recorded: in-process leases count on from it.
    pub async fn max_fence(&self) -> Result<u64, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.max_fence().await;
        }
        let fence: i64 = sqlx::query_scalar("SELECT coalesce(max(fence), 0) FROM checkpoints")
            .fetch_one(self.pool())
            .await?;
        Ok(fence as u64)
    }

    /// The task's live epoch.
    pub async fn current_epoch(&self, task: &str) -> Result<Option<EpochRecord>, CoordinatorError> {
        self.epoch_where(task, "e.epoch = t.current_epoch").await
    }

    /// The epoch whose contract the source checks watch: the one building beside the live
    /// one (it will be live), else the live one.
    pub async fn watched_epoch(&self, task: &str) -> Result<Option<EpochRecord>, CoordinatorError> {
        self.epoch_where(task, "e.epoch = coalesce(t.building_epoch, t.current_epoch)")
            .await
    }

    async fn epoch_where(&self, task: &str, condition: &str) -> Result<Option<EpochRecord>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.epoch_where(task, condition).await;
        }
        let query = format!(
            "SELECT e.epoch, e.schema_id, e.columns, e.h0_max_key, e.incremental_start, e.cursor_zone, \
             e.source_table_id FROM tasks t JOIN epochs e ON e.task = t.name AND {condition} WHERE t.name = $1"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(task)
            .fetch_optional(self.pool())
            .await?;
        row.map(|row| epoch_from(&row, 0)).transpose()
    }

    /// The planner's row estimate for an epoch.
    pub async fn estimated_rows(&self, task: &str, epoch: u64) -> Result<Option<u64>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.estimated_rows(task, epoch).await;
        }
        Ok(
            sqlx::query_scalar::<_, Option<i64>>("SELECT estimated_rows FROM epochs WHERE task = $1 AND epoch = $2")
                .bind(task)
                .bind(epoch as i64)
                .fetch_optional(self.pool())
                .await?
                .flatten()
                .map(|n| n.max(0) as u64),
        )
    }

    /// Writes a planned epoch with its shards, unless another coordinator already did: the
    /// task row's primary key decides, and the loser reads the winner's plan.
    pub async fn create_epoch(&self, plan: &EpochPlan) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.create_epoch(plan).await;
        }
        let mut tx = self.pool().begin().await?;
        let inserted =
            sqlx::query("INSERT INTO tasks (name, current_epoch) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING")
                .bind(&plan.task)
                .bind(plan.epoch as i64)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        if inserted == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        Self::insert_epoch(&mut tx, plan).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Makes a freshly planned epoch the task's current one (`tasks reinit`): its shards
    /// start their snapshot, the old epoch's staged batches are abandoned (commits of its
    /// shards are refused from now on), and the pause is cleared. Returns false when the
    /// epoch already exists (another reinit won).
    pub async fn switch_epoch(&self, plan: &EpochPlan) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.switch_epoch(plan).await;
        }
        let mut tx = self.pool().begin().await?;
        let current: i64 = sqlx::query_scalar("SELECT current_epoch FROM tasks WHERE name = $1 FOR UPDATE")
            .bind(&plan.task)
            .fetch_one(&mut *tx)
            .await?;
        if current as u64 >= plan.epoch {
            tx.rollback().await?;
            return Ok(false);
        }
        Self::insert_epoch(&mut tx, plan).await?;
        batches::abandon(
            &mut tx,
            Staged::EpochsBefore {
                task: &plan.task,
                epoch: plan.epoch,
            },
        )
        .await?;
        sqlx::query(
            "UPDATE tasks SET current_epoch = $2, paused_reason = NULL, max_source_clock_micros = NULL WHERE name = $1",
        )
        .bind(&plan.task)
        .bind(plan.epoch as i64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The epoch's watermark: the lowest floor among its shards (a shard still in its
    /// snapshot counts with the epoch's incremental start, where its incremental reading
    /// begins).
    pub async fn epoch_floor(&self, task: &str, epoch: &EpochRecord) -> Result<Option<i64>, CoordinatorError> {
        let cursors = self.epoch_cursors(task, epoch.epoch).await?;
        let start = epoch.incremental_start.incremental_time();
        let mut floor: Option<i64> = None;
        for cursor in cursors {
            let shard = cursor.incremental_time().or(start);
            floor = match (floor, shard) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Ok(floor)
    }

    /// `schema_changes = "evolve"`: the live epoch takes the source's columns (`columns`,
    /// `schema_id`) in place of `old_schema_id`'s, every incremental shard whose floor is
    /// above `reread_from_micros` reads again from there, and every shard's checkpoint
    /// version moves on, so that a run holding the old columns can commit nothing more and
    /// its next run reads with the new ones. Staged batches are abandoned. False when the
    /// epoch no longer has `old_schema_id` (another leader evolved it, or a reinit).
    pub async fn evolve_epoch(
        &self,
        task: &str,
        epoch: u64,
        old_schema_id: &str,
        schema_id: &str,
        columns: &serde_json::Value,
        reread_from_micros: i64,
    ) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite
                .evolve_epoch(task, epoch, old_schema_id, schema_id, columns, reread_from_micros)
                .await;
        }
        let mut tx = self.pool().begin().await?;
        let changed = sqlx::query(
            "UPDATE epochs SET schema_id = $4, columns = $5 WHERE task = $1 AND epoch = $2 AND schema_id = $3",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(old_schema_id)
        .bind(schema_id)
        .bind(columns)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        let shards: Vec<(i32, serde_json::Value)> = sqlx::query_as(
            "SELECT shard_id, cursor FROM checkpoints WHERE task = $1 AND epoch = $2 ORDER BY shard_id FOR UPDATE",
        )
        .bind(task)
        .bind(epoch as i64)
        .fetch_all(&mut *tx)
        .await?;
        for (shard_id, cursor) in shards {
            let cursor = decode_cursor(cursor)?;
            let reread = cursor
                .incremental_time()
                .is_some_and(|floor| floor > reread_from_micros)
                .then(|| Cursor::incremental_at(epoch, reread_from_micros));
            sqlx::query(
                "UPDATE checkpoints SET cursor = COALESCE($4, cursor), version = version + 1, updated_at = now() \
                 WHERE task = $1 AND epoch = $2 AND shard_id = $3",
            )
            .bind(task)
            .bind(epoch as i64)
            .bind(shard_id)
            .bind(reread.as_ref().map(cursor_json))
            .execute(&mut *tx)
            .await?;
        }
        batches::abandon(&mut tx, Staged::Epoch { task, epoch }).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The epoch's row and its shards, each starting its snapshot.
    pub(crate) async fn insert_epoch(tx: &mut sqlx::PgConnection, plan: &EpochPlan) -> Result<(), CoordinatorError> {
        sqlx::query(
            "INSERT INTO epochs (task, epoch, schema_id, columns, h0_time_micros, h0_max_key, incremental_start, \
             estimated_rows, cursor_zone, source_table_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(&plan.task)
        .bind(plan.epoch as i64)
        .bind(&plan.schema_id)
        .bind(&plan.columns)
        .bind(plan.h0_time_micros)
        .bind(&plan.h0_max_key)
        .bind(cursor_json(&plan.incremental_start))
        .bind(plan.estimated_rows)
        .bind(&plan.cursor_zone)
        .bind(&plan.source_table_id)
        .execute(&mut *tx)
        .await?;
        Self::insert_shards(tx, plan).await
    }

    async fn insert_shards(tx: &mut sqlx::PgConnection, plan: &EpochPlan) -> Result<(), CoordinatorError> {
        let start = cursor_json(&Cursor::snapshot_start(plan.epoch));
        for (shard_id, range) in plan.ranges.iter().enumerate() {
            let range: serde_json::Value = serde_json::from_str(range).expect("encoded range is JSON");
            sqlx::query(
                "INSERT INTO checkpoints (task, epoch, shard_id, range, phase, cursor) \
                 VALUES ($1, $2, $3, $4, 'SNAPSHOT', $5)",
            )
            .bind(&plan.task)
            .bind(plan.epoch as i64)
            .bind(shard_id as i32)
            .bind(range)
            .bind(&start)
            .execute(&mut *tx)
            .await?;
        }
        Ok(())
    }

    /// Pauses a task: its shards can no longer be acquired and every register or commit is
    /// refused until it is resumed. A task that is already paused keeps its first reason.
    /// Pauses the task if `epoch` is still the one its checks watch (see [`Self::watched_epoch`]):
    /// a verdict reached on an epoch that `tasks reinit` replaced meanwhile is not the new
    /// epoch's (its next check decides).
    pub async fn pause_epoch(&self, task: &str, epoch: u64, reason: &str) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.pause_epoch(task, epoch, reason).await;
        }
        let updated = sqlx::query(
            "UPDATE tasks SET paused_reason = $3 WHERE name = $1 AND paused_reason IS NULL \
             AND coalesce(building_epoch, current_epoch) = $2",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(reason)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(updated == 1)
    }

    pub async fn pause_task(&self, task: &str, reason: &str) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.pause_task(task, reason).await;
        }
        let updated = sqlx::query("UPDATE tasks SET paused_reason = $2 WHERE name = $1 AND paused_reason IS NULL")
            .bind(task)
            .bind(reason)
            .execute(self.pool())
            .await?
            .rows_affected();
        Ok(updated == 1)
    }

    /// Clears a pause. The source clock's high-water mark starts afresh, so a clock that was
    /// reset on purpose does not pause the task again at once.
    pub async fn resume_task(&self, task: &str) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.resume_task(task).await;
        }
        let mut tx = self.pool().begin().await?;
        let updated = sqlx::query(
            "UPDATE tasks SET paused_reason = NULL, max_source_clock_micros = NULL, resumed_at = now() WHERE name = $1",
        )
        .bind(task)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        // The operator fixed the cause: repeats count afresh.
        sqlx::query("UPDATE checkpoints SET failures = 0, last_failure = NULL WHERE task = $1 AND failures > 0")
            .bind(task)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(updated == 1)
    }

    /// Records why the source holds the task's watermark (`None`: it does not).
    pub async fn set_source_hold(&self, task: &str, hold: Option<&str>) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.set_source_hold(task, hold).await;
        }
        sqlx::query("UPDATE tasks SET source_hold = $2 WHERE name = $1 AND source_hold IS DISTINCT FROM $2")
            .bind(task)
            .bind(hold)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    pub async fn paused_reason(&self, task: &str) -> Result<Option<String>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.paused_reason(task).await;
        }
        Ok(
            sqlx::query_scalar::<_, Option<String>>("SELECT paused_reason FROM tasks WHERE name = $1")
                .bind(task)
                .fetch_optional(self.pool())
                .await?
                .flatten(),
        )
    }

    /// Records a source clock reading; returns the highest reading seen before it.
    pub async fn record_source_clock(&self, task: &str, now_micros: i64) -> Result<Option<i64>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.record_source_clock(task, now_micros).await;
        }
        let previous: Option<i64> = sqlx::query_scalar(
            "WITH old AS (SELECT max_source_clock_micros AS m FROM tasks WHERE name = $1 FOR UPDATE) \
             UPDATE tasks SET max_source_clock_micros = GREATEST(coalesce((SELECT m FROM old), $2), $2) \
             WHERE name = $1 RETURNING (SELECT m FROM old)",
        )
        .bind(task)
        .bind(now_micros)
        .fetch_optional(self.pool())
        .await?
        .flatten();
        Ok(previous)
    }

    /// The committed key positions (snapshot and append cursors) of a task's current epoch.
    /// The committed cursors of the epoch's live shards.
    pub async fn committed_key_positions(&self, task: &str, epoch: u64) -> Result<Vec<Cursor>, CoordinatorError> {
        self.epoch_cursors(task, epoch).await
    }

    /// The epoch's watermark as its checkpoints hold it: the lowest incremental floor when
    /// every live shard reads incrementally (`None` while any is in its snapshot or appends,
    /// or when there is none). One aggregate in the store: a watcher round needs this figure,
    /// not every shard's cursor (at 50,000 shards those took 30 ms of the control database
    /// and decoding them a good part of the coordinator's CPU, once per round).
    pub async fn epoch_watermark(&self, task: &str, epoch: u64) -> Result<Option<i64>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.epoch_watermark(task, epoch).await;
        }
        let (shards, incremental, floor): (i64, i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE cursor->>'kind' = 'incremental'), \
             min((cursor->>'floor_micros')::bigint) FILTER (WHERE cursor->>'kind' = 'incremental') \
             FROM checkpoints WHERE task = $1 AND epoch = $2 AND NOT retired",
        )
        .bind(task)
        .bind(epoch as i64)
        .fetch_one(self.pool())
        .await?;
        Ok(floor.filter(|_| shards > 0 && incremental == shards))
    }

    /// The committed cursors of the epoch's live (not retired) shards.
    pub async fn epoch_cursors(&self, task: &str, epoch: u64) -> Result<Vec<Cursor>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.epoch_cursors(task, epoch).await;
        }
        let rows: Vec<serde_json::Value> =
            sqlx::query_scalar("SELECT cursor FROM checkpoints WHERE task = $1 AND epoch = $2 AND NOT retired")
                .bind(task)
                .bind(epoch as i64)
                .fetch_all(self.pool())
                .await?;
        rows.into_iter().map(decode_cursor).collect()
    }

    pub async fn lateness(&self, task: &str, epoch: u64) -> Result<Lateness, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.lateness(task, epoch).await;
        }
        let row = sqlx::query(
            "SELECT count(*), coalesce(percentile_disc(0.99) WITHIN GROUP (ORDER BY lateness_micros), 0)::bigint, \
             coalesce(max(lateness_micros), 0)::bigint FROM late_rows WHERE task = $1 AND epoch = $2",
        )
        .bind(task)
        .bind(epoch as i64)
        .fetch_one(self.pool())
        .await?;
        Ok(Lateness {
            count: row.get::<i64, _>(0) as u64,
            p99_micros: row.get(1),
            max_micros: row.get(2),
        })
    }

    /// Every shard a worker may claim: of the given tasks' running epochs (the live one, and
    /// one building beside it), not paused, least recently touched first, with the worker it
    /// is reserved for (a move) while the reservation lasts. Shards waiting for a split or
    /// merge are left out.
    pub async fn shard_candidates(&self, tasks: &[String]) -> Result<Vec<Candidate>, CoordinatorError> {
        self.candidates(tasks, None).await
    }

    /// [`Self::shard_candidates`] among `shards` only: what became of shards whose owners
    /// just ended, in O(those shards) instead of O(every shard).
    pub async fn shard_candidates_among(
        &self,
        tasks: &[String],
        shards: &[ShardKey],
    ) -> Result<Vec<Candidate>, CoordinatorError> {
        self.candidates(tasks, Some(shards)).await
    }

    async fn candidates(
        &self,
        tasks: &[String],
        among: Option<&[ShardKey]>,
    ) -> Result<Vec<Candidate>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.candidates(tasks, among).await;
        }
        let among_join = if among.is_some() {
            "JOIN unnest($2::text[], $3::bigint[], $4::int[]) AS f(task, epoch, shard_id) \
             ON f.task = c.task AND f.epoch = c.epoch AND f.shard_id = c.shard_id "
        } else {
            ""
        };
        let sql = format!(
            "SELECT c.task, c.epoch, c.shard_id, \
             CASE WHEN c.reserved_until >= now() THEN c.reserved_for END FROM checkpoints c {among_join}\
             JOIN running_epochs r ON r.task = c.task AND r.epoch = c.epoch JOIN tasks t ON t.name = c.task \
             WHERE t.paused_reason IS NULL AND c.task = ANY($1) AND NOT c.retired AND c.pending_op IS NULL \
             ORDER BY c.updated_at, c.task, c.shard_id"
        );
        // `among_join` is one of two constants.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(tasks);
        if let Some(shards) = among {
            query = query
                .bind(shards.iter().map(|s| s.task.clone()).collect::<Vec<_>>())
                .bind(shards.iter().map(|s| s.epoch as i64).collect::<Vec<_>>())
                .bind(shards.iter().map(|s| s.shard_id as i32).collect::<Vec<_>>());
        }
        let rows = query.fetch_all(self.pool()).await?;
        let decode = move || {
            rows.into_iter()
                .map(|row| Candidate {
                    shard: ShardKey::from_pg_row(&row),
                    reserved_for: row.get(3),
                })
                .collect()
        };
        Ok(crate::off_runtime::run(decode).await)
    }

    /// Records the new owners of a group of claimed shards (distinct), each under a fence token
    /// that must be larger than every earlier one, in one statement: one answer per claim, in
    /// order, `None` where the fence did not increase or the shard is retired or gone. Each
    /// claimed shard comes with what its assignment needs: the staged, uncommitted batch that
    /// starts at its committed cursor (if any) and its epoch, if it still runs.
    pub async fn claim_shards(&self, group: &[Claim]) -> Result<Vec<Option<Claimed>>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.claim_shards(group).await;
        }
        // The rows are locked in key order first, as every group does (`LOCK_COLUMNS_FROM`), so
        // that two groups never wait on each other in a cycle.
        let rows = sqlx::query(
            "WITH g AS MATERIALIZED (SELECT * FROM unnest($1::text[], $2::bigint[], $3::int[], $4::bigint[], $5::text[]) \
               WITH ORDINALITY AS g(task, epoch, shard_id, fence, owner, i)), \
             l AS MATERIALIZED (SELECT g.i FROM g JOIN checkpoints c \
               ON c.task = g.task AND c.epoch = g.epoch AND c.shard_id = g.shard_id \
               ORDER BY c.task, c.epoch, c.shard_id FOR UPDATE OF c), \
             claimed AS (\
               UPDATE checkpoints c SET fence = g.fence, owner = g.owner, updated_at = now(), acquired_at = now(), \
               release_requested = (c.pending_op IS NOT NULL), reserved_for = NULL, reserved_until = NULL \
               FROM g JOIN l ON l.i = g.i \
               WHERE c.task = g.task AND c.epoch = g.epoch AND c.shard_id = g.shard_id AND c.fence < g.fence \
               AND NOT c.retired \
               RETURNING g.i, c.task, c.epoch, c.shard_id, c.range, c.cursor, c.version, c.fence) \
             SELECT cl.i, cl.range, cl.cursor, cl.version, cl.fence, \
               p.batch_id, p.manifest_path, p.lower, p.upper, p.row_count, p.content_hash, \
               e.epoch, e.schema_id, e.columns, e.h0_max_key, e.incremental_start, e.cursor_zone, e.source_table_id \
             FROM claimed cl \
             LEFT JOIN LATERAL (SELECT b.batch_id, b.manifest_path, b.lower, b.upper, b.row_count, b.content_hash \
               FROM batches b WHERE b.task = cl.task AND b.epoch = cl.epoch AND b.shard_id = cl.shard_id \
               AND b.state = 'STAGED' AND b.lower = cl.cursor ORDER BY b.staged_at LIMIT 1) p ON true \
             LEFT JOIN epochs e ON e.task = cl.task AND e.epoch = cl.epoch \
               AND EXISTS (SELECT 1 FROM running_epochs r WHERE r.task = e.task AND r.epoch = e.epoch)",
        )
        .bind(group.iter().map(|c| c.shard.task.as_str()).collect::<Vec<_>>())
        .bind(group.iter().map(|c| c.shard.epoch as i64).collect::<Vec<_>>())
        .bind(group.iter().map(|c| c.shard.shard_id as i32).collect::<Vec<_>>())
        .bind(group.iter().map(|c| c.fence as i64).collect::<Vec<_>>())
        .bind(group.iter().map(|c| c.owner.as_str()).collect::<Vec<_>>())
        .fetch_all(self.pool())
        .await?;
        let mut answers: Vec<Option<Claimed>> = group.iter().map(|_| None).collect();
        for row in rows {
            let i = row.get::<i64, _>(0) as usize - 1;
            let pending = row
                .get::<Option<String>, _>(5)
                .map(|batch_id| -> Result<_, CoordinatorError> {
                    Ok(PendingBatchRecord {
                        batch_id,
                        manifest_path: row.get(6),
                        lower: decode_cursor(row.get(7))?,
                        upper: decode_cursor(row.get(8))?,
                        row_count: row.get::<i64, _>(9) as u64,
                        content_hash: row.get(10),
                    })
                })
                .transpose()?;
            let epoch = row
                .get::<Option<i64>, _>(11)
                .map(|_| epoch_from(&row, 11))
                .transpose()?;
            answers[i] = Some(Claimed {
                record: ShardRecord {
                    key: group[i].shard.clone(),
                    range: row.get::<serde_json::Value, _>(1).to_string(),
                    cursor: decode_cursor(row.get(2))?,
                    version: row.get::<i64, _>(3) as u64,
                    fence: row.get::<i64, _>(4) as u64,
                },
                pending,
                epoch,
            });
        }
        Ok(answers)
    }

    /// Locks the shard's checkpoint row and checks that `fence` is the current owner's.
    pub(crate) async fn lock_checkpoint(
        conn: &mut sqlx::PgConnection,
        shard: &ShardKey,
        fence: u64,
    ) -> Result<LockedCheckpoint, CoordinatorError> {
        let row = sqlx::query(LOCK_COLUMNS_FROM)
            .bind(vec![shard.task.as_str()])
            .bind(vec![shard.epoch as i64])
            .bind(vec![shard.shard_id as i32])
            .fetch_optional(&mut *conn)
            .await?;
        checked_lock(row.as_ref().map(CheckpointRow::from_pg).transpose()?, shard, fence)
    }

    /// Records staged batches of distinct shards, in one statement (issue 20). Their bounds
    /// are fixed from here on (invariant 2): registering the same id again with other
    /// content is refused. Each is checked and answered on its own, in order.
    pub async fn register_batches(
        &self,
        group: &[RegisterBatch],
    ) -> Result<Vec<Result<(), CoordinatorError>>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.register_batches(group).await;
        }
        let mut answers: Vec<Option<Result<(), CoordinatorError>>> = group.iter().map(|_| None).collect();
        let mut conn = self.pool().acquire().await?;
        // A second statement only for a batch whose registration of the same id raced this
        // one and committed while it waited for the checkpoint's lock, so that it was not
        // yet visible to the statement's read of `existing`.
        for _ in 0..2 {
            let pending: Vec<usize> = (0..group.len()).filter(|&i| answers[i].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let registrations: Vec<Registration> = pending
                .iter()
                .map(|&i| {
                    let batch = &group[i];
                    Registration {
                        batch_id: &batch.batch_id,
                        shard: &batch.shard,
                        lower: cursor_json(&batch.lower),
                        upper: cursor_json(&batch.upper),
                        row_count: batch.row_count as i64,
                        byte_size: batch.byte_size as i64,
                        content_hash: &batch.content_hash,
                        manifest_path: &batch.manifest_path,
                        fence: batch.fence,
                    }
                })
                .collect();
            let registered = batches::register(&mut conn, &registrations).await?;
            for (&i, registered) in pending.iter().zip(registered) {
                answers[i] = judge_registration(&group[i], registered)?;
            }
        }
        Ok(group
            .iter()
            .zip(answers)
            .map(|(batch, answer)| {
                answer.unwrap_or_else(|| {
                    Err(CoordinatorError::Batch {
                        batch_id: batch.batch_id.clone(),
                        message:
                            "could not be registered: its checkpoint allows it, yet it was neither inserted nor found"
                                .into(),
                    })
                })
            })
            .collect())
    }

    /// The compare-and-swap for a group of commits of distinct shards, in one transaction of
    /// five statements whatever the group's size: each commit is checked against its own
    /// locked checkpoint and refused on its own, exactly as alone. One outcome per commit,
    /// in order. Err: the transaction failed, and no commit of the group took effect.
    pub async fn commit_batches(
        &self,
        group: &[CommitBatch],
    ) -> Result<Vec<Result<Committed, CoordinatorError>>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.commit_batches(group).await;
        }
        debug_assert!(
            group.iter().map(|c| &c.shard).collect::<HashSet<_>>().len() == group.len(),
            "a commit group holds distinct shards"
        );
        let mut tx = self.pool().begin().await?;
        let rows = sqlx::query(LOCK_COLUMNS_FROM)
            .bind(group.iter().map(|c| c.shard.task.as_str()).collect::<Vec<_>>())
            .bind(group.iter().map(|c| c.shard.epoch as i64).collect::<Vec<_>>())
            .bind(group.iter().map(|c| c.shard.shard_id as i32).collect::<Vec<_>>())
            .fetch_all(&mut *tx)
            .await?;
        let mut locked: HashMap<i64, sqlx::postgres::PgRow> =
            rows.into_iter().map(|row| (row.get::<i64, _>(0), row)).collect();
        let mut outcomes: Vec<Result<Judged, CoordinatorError>> = group
            .iter()
            .enumerate()
            .map(|(i, commit)| {
                let row = locked
                    .remove(&(i as i64 + 1))
                    .as_ref()
                    .map(CheckpointRow::from_pg)
                    .transpose()?;
                checked_lock(row, &commit.shard, commit.fence).and_then(|row| judge(commit, row))
            })
            .collect();
        let with_rows: Vec<batches::Commit> = group
            .iter()
            .zip(&outcomes)
            .enumerate()
            .filter(|(_, (commit, judged))| !commit.empty && matches!(judged, Ok(Judged::Proceed { .. })))
            .map(|(i, (commit, _))| batches::Commit {
                index: i as i64,
                batch_id: &commit.batch_id,
                shard: &commit.shard,
                upper: cursor_json(&commit.upper),
                replayed: commit.replayed,
            })
            .collect();
        // Also abandons anything else staged from these positions: it can never commit now.
        let committed = batches::commit(&mut tx, &with_rows).await?;
        for batch in &with_rows {
            if !committed.contains(&batch.index) {
                outcomes[batch.index as usize] = Err(CoordinatorError::Batch {
                    batch_id: batch.batch_id.to_string(),
                    message: "is not a staged batch with these bounds".into(),
                });
            }
        }
        let moving: Vec<(usize, &CommitBatch, u64)> = group
            .iter()
            .zip(&outcomes)
            .enumerate()
            .filter_map(|(i, (commit, judged))| match judged {
                Ok(Judged::Proceed { version, .. }) => Some((i, commit, version + 1)),
                _ => None,
            })
            .collect();
        // What each moved shard's owner would ask next (`NextShardWork`), answered here.
        let mut works = Vec::new();
        if !moving.is_empty() {
            Self::move_checkpoints(&mut tx, &moving).await?;
            let shards: Vec<ShardKey> = moving.iter().map(|(_, commit, _)| commit.shard.clone()).collect();
            works = shard_works_on(&mut tx, &shards).await?;
        }
        tx.commit().await?;
        let mut works = works.into_iter();
        Ok(outcomes
            .into_iter()
            .map(|judged| {
                Ok(match judged? {
                    Judged::Repeated(committed) => committed,
                    Judged::Proceed {
                        version,
                        release_requested,
                    } => Committed {
                        new_version: version + 1,
                        release_requested,
                        repeated: false,
                        work: works.next(),
                    },
                })
            })
            .collect())
    }

    /// Moves the checkpoints of `moving` (position in the group, commit, new version), adds
    /// the history row of each commit with rows and records their late rows: one statement.
    async fn move_checkpoints(
        tx: &mut sqlx::PgConnection,
        moving: &[(usize, &CommitBatch, u64)],
    ) -> Result<(), CoordinatorError> {
        let late: Vec<(i64, i64)> = moving
            .iter()
            .flat_map(|(i, commit, _)| commit.late_row_lateness_micros.iter().map(|l| (*i as i64, *l)))
            .collect();
        let moved: i64 = sqlx::query_scalar(
            "WITH g AS (SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::int[], $5::jsonb[], \
               $6::bigint[], $7::text[], $8::text[], $9::bool[], $10::bigint[], $11::bigint[]) \
               AS g(i, task, epoch, shard_id, cursor, version, phase, batch_id, empty, row_count, fence)), \
             moved AS (\
               UPDATE checkpoints c SET cursor = g.cursor, version = g.version, phase = g.phase, \
               last_batch_id = CASE WHEN g.empty THEN c.last_batch_id ELSE g.batch_id END, \
               rows_applied = c.rows_applied + g.row_count, updated_at = now(), failures = 0, last_failure = NULL \
               FROM g WHERE c.task = g.task AND c.epoch = g.epoch AND c.shard_id = g.shard_id RETURNING 1), \
             history AS (\
               INSERT INTO checkpoint_history (task, epoch, shard_id, version, fence, cursor, batch_id, row_count) \
               SELECT task, epoch, shard_id, version, fence, cursor, batch_id, row_count FROM g WHERE NOT empty), \
             late AS (\
               INSERT INTO late_rows (task, epoch, shard_id, batch_id, lateness_micros) \
               SELECT g.task, g.epoch, g.shard_id, g.batch_id, l.lateness \
               FROM unnest($12::bigint[], $13::bigint[]) AS l(i, lateness) JOIN g ON g.i = l.i) \
             SELECT count(*) FROM moved",
        )
        .bind(moving.iter().map(|(i, _, _)| *i as i64).collect::<Vec<_>>())
        .bind(moving.iter().map(|(_, c, _)| c.shard.task.as_str()).collect::<Vec<_>>())
        .bind(moving.iter().map(|(_, c, _)| c.shard.epoch as i64).collect::<Vec<_>>())
        .bind(
            moving
                .iter()
                .map(|(_, c, _)| c.shard.shard_id as i32)
                .collect::<Vec<_>>(),
        )
        .bind(moving.iter().map(|(_, c, _)| cursor_json(&c.upper)).collect::<Vec<_>>())
        .bind(moving.iter().map(|(_, _, v)| *v as i64).collect::<Vec<_>>())
        .bind(
            moving
                .iter()
                .map(|(_, c, _)| {
                    if c.upper.is_incremental() {
                        "INCREMENTAL"
                    } else {
                        "SNAPSHOT"
                    }
                })
                .collect::<Vec<_>>(),
        )
        .bind(moving.iter().map(|(_, c, _)| c.batch_id.as_str()).collect::<Vec<_>>())
        .bind(moving.iter().map(|(_, c, _)| c.empty).collect::<Vec<_>>())
        .bind(moving.iter().map(|(_, c, _)| c.row_count as i64).collect::<Vec<_>>())
        .bind(moving.iter().map(|(_, c, _)| c.fence as i64).collect::<Vec<_>>())
        .bind(late.iter().map(|(i, _)| *i).collect::<Vec<_>>())
        .bind(late.iter().map(|(_, l)| *l).collect::<Vec<_>>())
        .fetch_one(&mut *tx)
        .await?;
        if moved as usize != moving.len() {
            // The rows are locked: this cannot happen short of a bug; roll the group back.
            return Err(CoordinatorError::InvalidRequest(format!(
                "{} of {} locked checkpoints moved",
                moved,
                moving.len()
            )));
        }
        Ok(())
    }

    /// Marks a staged batch ABANDONED on behalf of the shard's current owner and bumps the
    /// checkpoint version, so that the next read of the same bounds gets a new batch id.
    /// Returns the new version.
    pub async fn abandon_batch(&self, shard: &ShardKey, fence: u64, batch_id: &str) -> Result<u64, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.abandon_batch(shard, fence, batch_id).await;
        }
        let mut tx = self.pool().begin().await?;
        Self::lock_checkpoint(tx.acquire().await?, shard, fence).await?;
        batches::abandon(&mut tx, Staged::Batch { batch_id, shard }).await?;
        let version: i64 = sqlx::query_scalar(
            "UPDATE checkpoints SET version = version + 1, updated_at = now() \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3 RETURNING version",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(version as u64)
    }

    /// Pauses the task on behalf of the shard's current owner (`fence`, `owner`), unless the
    /// task was resumed after the owner acquired the shard: its failure may predate the fix
    /// the operator resumed after. False when the request did not pause the task.
    /// Counts a failure of the shard's current owner; returns how many times in a row the
    /// shard's runs ended with this same error (0 when `fence`/`owner` are not current).
    pub async fn record_failure(
        &self,
        shard: &ShardKey,
        fence: u64,
        owner: &str,
        failure: &str,
    ) -> Result<u32, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.record_failure(shard, fence, owner, failure).await;
        }
        let count: Option<i32> = sqlx::query_scalar(
            "UPDATE checkpoints SET failures = CASE WHEN last_failure = $6 THEN failures + 1 ELSE 1 END, \
             last_failure = $6 WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence = $4 AND owner = $5 \
             RETURNING failures",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32)
        .bind(fence as i64)
        .bind(owner)
        .bind(failure)
        .fetch_optional(self.pool())
        .await?;
        Ok(count.unwrap_or(0).max(0) as u32)
    }

    pub async fn pause_for_owner(
        &self,
        shard: &ShardKey,
        fence: u64,
        owner: &str,
        reason: &str,
    ) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.pause_for_owner(shard, fence, owner, reason).await;
        }
        let paused = sqlx::query(
            "UPDATE tasks t SET paused_reason = $6 WHERE t.name = $1 AND t.paused_reason IS NULL AND EXISTS ( \
               SELECT 1 FROM checkpoints c WHERE c.task = $1 AND c.epoch = $2 AND c.shard_id = $3 AND c.fence = $4 \
               AND c.owner = $5 AND (t.resumed_at IS NULL OR c.acquired_at >= t.resumed_at))",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32)
        .bind(fence as i64)
        .bind(owner)
        .bind(reason)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(paused == 1)
    }

    /// The source columns (and their types) of a task's epoch, as frozen when the epoch was
    /// planned; `None` for an epoch the control database does not know.
    pub async fn epoch_columns(&self, task: &str, epoch: i64) -> Result<Option<Vec<Column>>, CoordinatorError> {
        let columns: Option<serde_json::Value> = match self.lite() {
            Some(lite) => lite.epoch_columns(task, epoch).await?,
            None => {
                sqlx::query_scalar("SELECT columns FROM epochs WHERE task = $1 AND epoch = $2")
                    .bind(task)
                    .bind(epoch)
                    .fetch_optional(self.pool())
                    .await?
            }
        };
        columns
            .map(|value| {
                stored_columns(value).map_err(|e| {
                    CoordinatorError::InvalidRequest(format!("stored columns of {task} epoch {epoch}: {e}"))
                })
            })
            .transpose()
    }

    pub async fn release(&self, shard: &ShardKey, fence: u64, owner: &str) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.release(shard, fence, owner).await;
        }
        sqlx::query(
            "UPDATE checkpoints SET owner = NULL WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence = $4 AND owner = $5",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32)
        .bind(fence as i64)
        .bind(owner)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Says that shards may have become claimable through a change this process just made
    /// (an epoch planned or switched, a split's or merge's children, a move's reservation, a
    /// cancelled operation, a resume): the claim queue reads every candidate at its next
    /// acquire instead of at its next correcting read (`claim_queue`). Call it after the
    /// change is committed.
    pub(crate) fn candidates_changed(&self) {
        self.candidates.fetch_add(1, Ordering::SeqCst);
    }

    /// How many such changes this process made (see [`Self::candidates_changed`]).
    pub(crate) fn candidates_generation(&self) -> u64 {
        self.candidates.load(Ordering::SeqCst)
    }

    /// Every task's running epoch and pause, in name order: one row per task, however many
    /// shards it has (the gauges read it every 2 s; `status` reads every shard).
    pub async fn task_states(&self) -> Result<Vec<TaskState>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.task_states().await;
        }
        let rows = sqlx::query("SELECT name, current_epoch, paused_reason FROM tasks ORDER BY name")
            .fetch_all(self.pool())
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| TaskState {
                name: row.get(0),
                epoch: row.get::<i64, _>(1) as u64,
                paused_reason: row.get(2),
            })
            .collect())
    }

    pub async fn status(&self) -> Result<Vec<TaskStatusRow>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.status().await;
        }
        let rows = sqlx::query(
            "SELECT t.name, t.current_epoch, t.paused_reason, c.shard_id, c.range, c.phase, c.cursor, c.rows_applied, \
             t.source_hold \
             FROM tasks t JOIN checkpoints c ON c.task = t.name AND c.epoch = t.current_epoch \
             WHERE NOT c.retired ORDER BY t.name, c.shard_id",
        )
        .fetch_all(self.pool())
        .await?;
        crate::off_runtime::run(move || Self::status_rows(rows)).await
    }

    /// [`Self::status`]'s rows, decoded: O(every shard), off the runtime.
    fn status_rows(rows: Vec<sqlx::postgres::PgRow>) -> Result<Vec<TaskStatusRow>, CoordinatorError> {
        let mut tasks: Vec<TaskStatusRow> = Vec::new();
        for row in rows {
            let name: String = row.get(0);
            if tasks.last().is_none_or(|t| t.name != name) {
                tasks.push(TaskStatusRow {
                    name: name.clone(),
                    epoch: row.get::<i64, _>(1) as u64,
                    paused_reason: row.get(2),
                    source_hold: row.get(8),
                    shards: Vec::new(),
                });
            }
            let task = tasks.last_mut().expect("pushed above");
            task.shards.push(ShardStatusRow {
                shard_id: row.get::<i32, _>(3) as u32,
                range: row.get::<serde_json::Value, _>(4).to_string(),
                phase: row.get(5),
                cursor: decode_cursor(row.get(6))?,
                rows_applied: row.get::<i64, _>(7) as u64,
            });
        }
        Ok(tasks)
    }
}

pub fn parse_request_cursor(text: &str) -> Result<Cursor, CoordinatorError> {
    parse_cursor(text)
}
