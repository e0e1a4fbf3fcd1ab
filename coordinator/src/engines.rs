//! What the coordinator asks of each engine beyond the shared boundary
//! (`tidemark_common::source`, `tidemark_common::target`): inspecting a source table against
//! the task's contract, the key's domain, `source install`, and on the target side the table,
//! ledger and epoch fence, and dead letters. Each engine answers in its own folder
//! (`postgres/`, `mysql/`); the registry below is one line per engine, keyed by
//! [`Engine::id`](tidemark_common::engines::Engine).

use std::collections::BTreeMap;

use tidemark_common::config::TaskConfig;
use tidemark_common::cursor::{KeyDomain, KeyValue};
use tidemark_common::engines::Engine;
use tidemark_common::pg::{Column, TableName, TableSql};
use tidemark_common::source::SourcePool;
use tidemark_common::target::TargetPool;
use tidemark_proto::v1 as pb;

use crate::checkpoints::ControlDb;
use crate::error::CoordinatorError;
use crate::planner::{PreparedTask, SourceColumn, SourceInfo};

/// The coordinator's side of a source engine.
#[async_trait::async_trait]
pub(crate) trait SourceSide: Sync {
    /// A pool on a source URL (`task` names the errors).
    async fn connect_url(&self, task: &str, url: &str) -> Result<SourcePool, CoordinatorError>;

    /// A pool on the task's source.
    async fn connect(&self, config: &TaskConfig) -> Result<SourcePool, CoordinatorError> {
        self.connect_url(&config.name, &config.source).await
    }

    /// The table's primary key columns in key order; empty when it has none.
    async fn primary_key(&self, source: &SourcePool, table: &TableName) -> Result<Vec<String>, CoordinatorError>;

    /// Connects and checks the task's contract against its table (ending in
    /// [`crate::planner::source_info`]).
    async fn inspect(&self, config: &TaskConfig) -> Result<SourceInfo, CoordinatorError>;

    /// The table's columns as the PostgreSQL types a target stores them as (one that maps to
    /// none shows as `unmapped <type>`, which changes the schema id); `None`: no such table.
    async fn columns(
        &self,
        source: &SourcePool,
        task: &str,
        table: &TableName,
    ) -> Result<Option<Vec<SourceColumn>>, CoordinatorError>;

    /// The zone a naive (zoneless) cursor column is written in.
    async fn naive_cursor_zone(
        &self,
        source: &SourcePool,
        config: &TaskConfig,
        cursor: &str,
    ) -> Result<String, CoordinatorError>;

    /// The first key's domain (for the shard ranges) and H0's largest key.
    async fn key_domain(
        &self,
        source_info: &SourceInfo,
        config: &TaskConfig,
    ) -> Result<(KeyDomain, Option<KeyValue>), CoordinatorError>;

    /// The planner's row estimate (for `status`'s progress), if the engine keeps one.
    async fn estimated_rows(&self, source: &SourcePool, table: &TableName) -> Result<Option<i64>, sqlx::Error>;

    /// Which of the table's columns `names` gave the rows already there a value when they
    /// were added (a default, a generated or identity column), or are NOT NULL: such a column
    /// cannot evolve an epoch (those rows changed without their cursor moving).
    async fn prefilled_columns(
        &self,
        source: &SourcePool,
        table: &TableName,
        names: &[String],
    ) -> Result<Vec<String>, CoordinatorError>;

    /// `source install` for `version = "trigger"`.
    async fn install_trigger_version(&self, config: &TaskConfig) -> Result<String, CoordinatorError>;

    /// `source install` for `delete_policy = { kind = "tombstone_table" }`.
    async fn install_delete_log(&self, config: &TaskConfig) -> Result<String, CoordinatorError>;
}

/// The coordinator's side of a target engine.
#[async_trait::async_trait]
pub(crate) trait TargetSide: Sync {
    /// A pool on the task's target that connects on first use (status counts, dead letters).
    fn lazy_pool(&self, config: &TaskConfig) -> Result<TargetPool, CoordinatorError>;

    /// Creates what is missing (table, ledger, dead letters, epoch fence) and checks what
    /// exists; returns the epoch the target's fence holds for the task.
    async fn prepare(
        &self,
        config: &TaskConfig,
        sql: &TableSql,
        not_null: &[bool],
        epoch: u64,
    ) -> Result<Option<u64>, CoordinatorError>;

    /// `tasks reinit`: creates epoch `epoch`'s table beside the live one (`sql.target` names
    /// it: [`TableName::epoch_table`]) with the source's columns and the live table's unique
    /// indexes. Returns the statements run, and those of the live table's other secondary
    /// indexes, to build after the snapshot's load ([`Self::build_deferred`]).
    async fn build_epoch(
        &self,
        config: &TaskConfig,
        sql: &TableSql,
        not_null: &[bool],
        epoch: u64,
    ) -> Result<(Vec<String>, Vec<String>), CoordinatorError>;

    /// Runs statements [`Self::build_epoch`] deferred (idempotent); returns the ones that
    /// failed, with why.
    async fn build_deferred(&self, config: &TaskConfig, statements: &[String])
    -> Result<Vec<String>, CoordinatorError>;

    /// Makes epoch `to`'s table the live table (`target_table`) and the live one its epoch's
    /// table beside, and moves the fence to `to`, atomically for readers and batches (a switch
    /// or a rollback). Idempotent: false when the fence already held `to`.
    async fn swap_epoch(&self, config: &TaskConfig, to: u64) -> Result<bool, CoordinatorError>;

    /// Drops an epoch's table beside the live one (past its retention, or abandoned).
    async fn drop_epoch_table(&self, config: &TaskConfig, epoch: u64) -> Result<(), CoordinatorError>;

    /// Adds columns the source gained to the target table (nullable; `schema_changes =
    /// "evolve"`); returns the statements run.
    async fn add_columns(
        &self,
        config: &TaskConfig,
        table: &TableName,
        columns: &[Column],
    ) -> Result<Vec<String>, CoordinatorError>;

    /// Dead letters per status.
    async fn dead_letter_counts(&self, target: &TargetPool, task: &str) -> Result<BTreeMap<String, u64>, sqlx::Error>;

    async fn list_dead_letters(
        &self,
        target: &TargetPool,
        task: &str,
        status: Option<&str>,
        limit: u32,
    ) -> Result<Vec<pb::DeadLetter>, CoordinatorError>;

    async fn retry_dead_letters(
        &self,
        control: &ControlDb,
        target: &TargetPool,
        task: &PreparedTask,
        keys: &[String],
    ) -> Result<pb::RetryDeadLettersResponse, CoordinatorError>;

    async fn resolve_dead_letters(
        &self,
        target: &TargetPool,
        task: &str,
        keys: &[String],
        all_failed: bool,
    ) -> Result<u64, CoordinatorError>;

    async fn purge_dead_letters(
        &self,
        target: &TargetPool,
        task: &str,
        older_than: std::time::Duration,
    ) -> Result<u64, CoordinatorError>;
}

/// The coordinator's side of an engine; `target: None` for one that is only a source.
struct Sides {
    id: &'static str,
    source: &'static dyn SourceSide,
    target: Option<&'static dyn TargetSide>,
}

/// The coordinator's engines, one line each.
static SIDES: &[Sides] = &[
    Sides {
        id: "postgres",
        source: &crate::postgres::Postgres,
        target: Some(&crate::postgres::Postgres),
    },
    Sides {
        id: "mysql",
        source: &crate::mysql::MySql,
        target: Some(&crate::mysql::MySql),
    },
];

fn sides_of(engine: &Engine) -> Result<&'static Sides, String> {
    SIDES
        .iter()
        .find(|sides| sides.id == engine.id)
        .ok_or_else(|| format!("the coordinator has no {} support", engine.name))
}

fn sides(task: &str, role: &str, url: &str) -> Result<(&'static Sides, &'static Engine), CoordinatorError> {
    let setup = |e: String| CoordinatorError::task_setup(task, format!("{role}: {e}"));
    let engine = tidemark_common::engines::of_url(url).map_err(setup)?;
    Ok((sides_of(engine).map_err(setup)?, engine))
}

/// The coordinator's side of a source pool's engine.
pub(crate) fn side_of_source(task: &str, source: &SourcePool) -> Result<&'static dyn SourceSide, CoordinatorError> {
    Ok(sides_of(source.engine())
        .map_err(|e| CoordinatorError::task_setup(task, format!("source: {e}")))?
        .source)
}

/// The coordinator's side of a source URL's engine.
pub(crate) fn source_side_of_url(task: &str, url: &str) -> Result<&'static dyn SourceSide, CoordinatorError> {
    Ok(sides(task, "source", url)?.0.source)
}

/// The coordinator's side of the task's source engine.
pub(crate) fn source_side(config: &TaskConfig) -> Result<&'static dyn SourceSide, CoordinatorError> {
    Ok(sides(&config.name, "source", &config.source)?.0.source)
}

/// The coordinator's side of the task's target engine.
pub(crate) fn target_side(config: &TaskConfig) -> Result<&'static dyn TargetSide, CoordinatorError> {
    let (sides, engine) = sides(&config.name, "target", &config.target)?;
    sides.target.ok_or_else(|| {
        CoordinatorError::task_setup(
            &config.name,
            format!("target: {} is a source only: it cannot be a target", engine.name),
        )
    })
}

/// The error of a pool handed to another engine's code (a bug, never the user's).
pub(crate) fn foreign_pool(engine: &str) -> CoordinatorError {
    CoordinatorError::InvalidRequest(format!("a pool of another engine handed to the {engine} code"))
}
