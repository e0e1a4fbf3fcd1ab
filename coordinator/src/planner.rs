//! Task setup: validates the source table against the task's contract, plans epoch 1 at the
//! start bound H0 (source time and largest key) with its shard ranges, and creates the
//! target table and ledger when they are missing; `tasks reinit` plans the next epoch.
//!
//! This is the engine-neutral part. What each engine answers lives in its own folder
//! (`postgres/`, `mysql/`: columns, key uniqueness, grants, the key's domain, the cursor's
//! zone; the target table, ledger and fences), reached through [`crate::engines`].

use std::time::Duration;

use sha2::{Digest, Sha256};
use tidemark_common::config::{
    DeletePolicy, ReconcileCompare, SchemaChanges, TRIGGER_VERSION_COLUMN, TargetDeletes, TaskConfig, TaskMode,
    VersionConfig,
};
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::cursor::{Cursor, KeyDomain, KeyValue, format_micros, plan_ranges};
use tidemark_common::id_tail::{IdTail, Sample};
use tidemark_common::pg::{self, Column, DeleteSql, TableName, TableSql, VERSION_COLUMN, visibility};
use tidemark_common::source::{SourcePool, SourceReads};
use tidemark_common::target::TargetPool;

use crate::checkpoints::{ControlDb, EpochPlan, EpochRecord};
use crate::engines;
use crate::error::CoordinatorError;
/// A task as the coordinator serves it: its config and its current epoch's frozen plan.
#[derive(Debug, Clone)]
pub struct PreparedTask {
    pub config: TaskConfig,
    pub epoch: EpochRecord,
    pub columns: Vec<Column>,
    /// The integer column holding each row's version; `None`: the cursor time.
    pub version_column: Option<String>,
}

#[derive(Clone)]
pub(crate) struct SourceColumn {
    pub(crate) column: Column,
    pub(crate) not_null: bool,
}

/// A source table's columns whatever the engine (a MySQL column as the PostgreSQL type it
/// maps to; one that maps to none shows as `unmapped <type>`, which changes the schema id).
pub(crate) async fn introspect_source(
    source: &SourcePool,
    task: &str,
    table: &TableName,
) -> Result<Option<Vec<SourceColumn>>, CoordinatorError> {
    engines::side_of_source(task, source)?
        .columns(source, task, table)
        .await
}

/// An epoch's schema id: a hash of the source columns' names and types, and whether the
/// key and cursor columns are NOT NULL (a row with a NULL key or cursor is in no read window,
/// so dropping NOT NULL there is a schema change). Epochs planned before nullability counted
/// carry `schema-…` ids, compared the old way; new ones `schema2-…`.
pub(crate) fn schema_id(columns: &[SourceColumn], required: &[&str], like: &str) -> String {
    let legacy = like.starts_with("schema-");
    let mut hasher = Sha256::new();
    for column in columns {
        hasher.update(column.column.name.as_bytes());
        hasher.update(b" ");
        hasher.update(column.column.sql_type.as_bytes());
        if !legacy && column.not_null && required.contains(&column.column.name.as_str()) {
            hasher.update(b" not null");
        }
        hasher.update(b"\n");
    }
    let prefix = if legacy { "schema" } else { "schema2" };
    format!("{prefix}-{}", hex::encode(&hasher.finalize()[..8]))
}

/// The columns whose NOT NULL the schema id covers: the key and the cursor.
pub(crate) fn required_columns(config: &TaskConfig) -> Vec<&str> {
    config
        .key
        .iter()
        .map(String::as_str)
        .chain(config.cursor_column.as_deref())
        .collect()
}

/// The pause reason when the source table's columns no longer match the epoch's.
pub(crate) fn schema_changed_reason(table: &TableName, epoch: u64, now: &str, planned: &str) -> String {
    format!(
        "schema changed: source columns of {table} no longer match epoch {epoch} ({now} != {planned}); reinitialization required"
    )
}

/// The smallest value of an integer key type: H0's largest key of an empty table, so that the
/// snapshot reads nothing and every row arrives incrementally.
pub(crate) fn integer_minimum(sql_type: &str) -> i64 {
    match sql_type {
        "smallint" => i64::from(i16::MIN),
        "integer" => i64::from(i32::MIN),
        _ => i64::MIN,
    }
}

pub(crate) fn is_integer_type(sql_type: &str) -> bool {
    matches!(sql_type, "bigint" | "integer" | "smallint")
}

/// Checks the task's contract against the source's columns; returns the version column.
pub(crate) fn validate_columns(
    config: &TaskConfig,
    source_table: &TableName,
    columns: &[SourceColumn],
) -> Result<Option<String>, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let find = |name: &str| columns.iter().find(|c| c.column.name == name);
    for key in &config.key {
        let column = find(key).ok_or_else(|| setup(format!("key column {key:?} does not exist in {source_table}")))?;
        if !column.not_null {
            return Err(setup(format!(
                "key column {key:?} of {source_table} is nullable; keys must be NOT NULL"
            )));
        }
    }
    let first_key_type = &find(&config.key[0]).expect("checked above").column.sql_type;
    if let Some(DeletePolicy::Soft { column }) = &config.delete_policy
        && find(column).is_none()
    {
        return Err(setup(format!(
            "delete_policy soft: column {column:?} does not exist in {source_table}"
        )));
    }
    if columns.iter().any(|c| c.column.name == VERSION_COLUMN) {
        return Err(setup(format!(
            "source table {source_table} has a column named {VERSION_COLUMN}, which Tidemark reserves"
        )));
    }
    if let Some(cursor_column) = &config.cursor_column {
        let cursor = find(cursor_column).ok_or_else(|| {
            setup(format!(
                "cursor_column {cursor_column:?} does not exist in {source_table}"
            ))
        })?;
        if !cursor.not_null {
            return Err(setup(format!(
                "cursor_column {cursor_column:?} of {source_table} is nullable; the cursor column must be NOT NULL"
            )));
        }
        if !cursor.column.sql_type.starts_with("timestamp") {
            return Err(setup(format!(
                "cursor_column {cursor_column:?} has type {}; it must be a timestamp",
                cursor.column.sql_type
            )));
        }
    }
    let integer_not_null = |name: &str, hint: &str| -> Result<(), CoordinatorError> {
        let column = find(name).ok_or_else(|| {
            setup(format!(
                "version column {name:?} does not exist in {source_table}{hint}"
            ))
        })?;
        if !column.not_null || !is_integer_type(&column.column.sql_type) {
            return Err(setup(format!(
                "version column {name:?} of {source_table} must be a NOT NULL integer (it is {}{})",
                column.column.sql_type,
                if column.not_null { "" } else { ", nullable" }
            )));
        }
        Ok(())
    };
    if let Some(spec) = config.accumulate_spec().map_err(&setup)? {
        let explode_as = spec.explode.as_ref().map(|e| e.as_column.as_str());
        let mut needed: Vec<(&str, &str)> = spec
            .group_by
            .iter()
            .filter(|g| Some(g.as_str()) != explode_as)
            .map(|g| (g.as_str(), "group_by column"))
            .collect();
        needed.extend(
            spec.aggregates
                .iter()
                .filter_map(|a| a.column.as_deref())
                .map(|c| (c, "aggregate column")),
        );
        needed.extend(spec.explode.as_ref().map(|e| (e.from.as_str(), "transform.from")));
        for (name, what) in needed {
            if find(name).is_none() {
                return Err(setup(format!("{what} {name:?} does not exist in {source_table}")));
            }
        }
    }
    match (&config.mode, &config.version) {
        (TaskMode::Append | TaskMode::Accumulate, _) => {
            if !is_integer_type(first_key_type) {
                return Err(setup(format!(
                    "{} mode needs an integer key; {:?} is {first_key_type}",
                    config.mode.as_str(),
                    config.key[0]
                )));
            }
            Ok(Some(config.key[0].clone()))
        }
        (TaskMode::Upsert, VersionConfig::Cursor) => Ok(None),
        (TaskMode::Upsert, VersionConfig::Column(column)) => {
            integer_not_null(column, "")?;
            Ok(Some(column.clone()))
        }
        (TaskMode::Upsert, VersionConfig::Trigger) => {
            let hint = format!("; run `tidemark-coordinator source install --task {task}` first");
            integer_not_null(TRIGGER_VERSION_COLUMN, &hint)?;
            Ok(Some(TRIGGER_VERSION_COLUMN.to_string()))
        }
    }
}

/// The source table as a task sees it: columns, version column and schema id.
pub(crate) struct SourceInfo {
    pub(crate) pool: SourcePool,
    /// The statements the table is read with, as inspection found it (an engine's own type;
    /// MySQL's carry the columns as the source types them).
    pub(crate) reads: SourceReads,
    pub(crate) table: TableName,
    pub(crate) columns: Vec<SourceColumn>,
    pub(crate) version_column: Option<String>,
    pub(crate) schema_id: String,
    pub(crate) first_key_type: String,
}

/// The end of every engine's inspection: the bound must see every writer; then the schema id
/// and the first key's type.
pub(crate) async fn source_info(
    config: &TaskConfig,
    pool: SourcePool,
    reads: SourceReads,
    table: TableName,
    columns: Vec<SourceColumn>,
    version_column: Option<String>,
) -> Result<SourceInfo, CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    if config.open_transaction_bound {
        let (seen, _) = pool
            .visibility(&table)
            .await
            .map_err(|e| setup(format!("reading what the open-transaction bound can see: {e}")))?;
        if let Some(reason) = seen.blind_spot(&table) {
            return Err(setup(reason));
        }
    }
    let schema_id = schema_id(&columns, &required_columns(config), "schema2-");
    let first_key_type = columns
        .iter()
        .find(|c| c.column.name == config.key[0])
        .map(|c| c.column.sql_type.clone())
        .expect("validated");
    Ok(SourceInfo {
        pool,
        reads,
        table,
        columns,
        version_column,
        schema_id,
        first_key_type,
    })
}

/// Connects to the source and checks the task's contract against its table.
pub(crate) async fn inspect_source(config: &TaskConfig) -> Result<SourceInfo, CoordinatorError> {
    engines::source_side(config)?.inspect(config).await
}

/// How the task's deletes are read and applied, from its configuration.
pub fn delete_sql(config: &TaskConfig) -> Result<Option<DeleteSql>, CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    let source = TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?;
    let target = TableName::parse(&config.target_table).map_err(|e| setup(format!("target_table: {e}")))?;
    let (kind, column) = delete_spec(config);
    DeleteSql::from_spec(
        kind,
        column,
        config.target_deletes == TargetDeletes::Soft,
        &source,
        &target,
    )
    .map_err(setup)
}

/// The delete source as `TaskSpec` carries it: kind and soft-delete column.
pub fn delete_spec(config: &TaskConfig) -> (&'static str, &str) {
    match &config.delete_policy {
        None => ("", ""),
        Some(DeletePolicy::Soft { column }) => ("flag", column.as_str()),
        Some(DeletePolicy::TombstoneTable { .. }) => ("log", ""),
        Some(DeletePolicy::Reconcile {}) => ("reconcile", ""),
    }
}

/// Validates the source and target, plans the first epoch if the task has none, and returns
/// the task as served.
pub async fn prepare_task(control: &ControlDb, config: &TaskConfig) -> Result<PreparedTask, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let target_table = TableName::parse(&config.target_table).map_err(|e| setup(format!("target_table: {e}")))?;
    let source = inspect_source(config).await?;
    let not_null: Vec<bool> = source.columns.iter().map(|c| c.not_null).collect();

    let epoch = match control.current_epoch(task).await? {
        Some(epoch) => epoch,
        None => {
            let plan = plan_epoch(&source, config, 1).await?;
            if control.create_epoch(&plan).await? {
                control.candidates_changed();
                tracing::info!(task, epoch = plan.epoch, shards = plan.ranges.len(), schema_id = %plan.schema_id, "planned epoch");
            }
            control
                .current_epoch(task)
                .await?
                .ok_or_else(|| setup("epoch vanished after planning".into()))?
        }
    };
    source.pool.close().await;

    let now = schema_id(&source.columns, &required_columns(config), &epoch.schema_id);
    if epoch.schema_id != now {
        let reason = schema_changed_reason(&source.table, epoch.epoch, &now, &epoch.schema_id);
        if config.schema_changes == SchemaChanges::Evolve {
            // The watcher's first round evolves the epoch, or pauses with why it cannot.
            tracing::warn!(task, %reason, "source columns changed; schema_changes = \"evolve\" decides");
        } else {
            tracing::error!(task, %reason, "pausing task");
            control.pause_epoch(task, epoch.epoch, &reason).await?;
        }
    }
    if let (Some(configured), Some(frozen)) = (&config.cursor_time_zone, &epoch.cursor_zone)
        && configured != frozen
    {
        tracing::warn!(task, configured = %configured, epoch = epoch.epoch, reads_in = %frozen,
            "cursor_time_zone differs from the zone the epoch froze; `tasks reinit` applies it");
    }
    let frozen_columns = epoch_columns(task, &epoch)?;
    if config.reconcile_compare == ReconcileCompare::Content && !tidemark_common::config::hash_content(config) {
        portable_content_columns(&frozen_columns)
            .map_err(|e| setup(format!("reconcile_compare = \"content\": {e}")))?;
    }
    let sql = TableSql {
        source: source.table,
        target: target_table.clone(),
        columns: frozen_columns.clone(),
        key_columns: config.key.clone(),
        cursor_column: config.cursor_column.clone(),
        version_column: source.version_column.clone(),
        deletes: delete_sql(config)?,
        filter: config.filter.clone(),
        page_format: CopyFormat::Text,
        cursor_zone: None,
    };
    let target_epoch = engines::target_side(config)?
        .prepare(config, &sql, &not_null, epoch.epoch)
        .await?;
    // A switch the target finished before a restart, not yet followed here (the lifecycle
    // finishes it; see `epochs`).
    let swapping = control.lifecycle(task).await?.and_then(|l| l.swap_to);
    if let Some(target_epoch) = target_epoch
        && target_epoch > epoch.epoch
        && swapping != Some(target_epoch)
    {
        return Err(setup(format!(
            "the target holds epoch {target_epoch} of this task, ahead of the control database's epoch {} (a new or \
             restored control database?): every batch would be refused; run `tidemark-coordinator tasks reinit {task}` \
             until the epochs meet, or delete the task's row in the target's tidemark_epochs if the target was reset too",
            epoch.epoch
        )));
    }

    Ok(PreparedTask {
        config: config.clone(),
        epoch,
        columns: frozen_columns,
        version_column: source.version_column,
    })
}

/// The task's statements as its current epoch froze them, for the coordinator's own work on
/// the target (dead-letter retries).
pub fn table_sql(task: &PreparedTask) -> Result<TableSql, CoordinatorError> {
    let config = &task.config;
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    Ok(TableSql {
        source: TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?,
        target: TableName::parse(&config.target_table).map_err(|e| setup(format!("target_table: {e}")))?,
        columns: task.columns.clone(),
        key_columns: config.key.clone(),
        cursor_column: config.cursor_column.clone(),
        version_column: task.version_column.clone(),
        deletes: delete_sql(config)?,
        filter: config.filter.clone(),
        page_format: CopyFormat::Text,
        cursor_zone: task.epoch.cursor_zone.clone(),
    })
}

/// A pool on the task's target that connects on first use (status counts, dead letters).
pub fn lazy_target_pool(config: &TaskConfig) -> Result<TargetPool, CoordinatorError> {
    engines::target_side(config)?.lazy_pool(config)
}

/// Whether a content comparison across engines covers every one of `columns` (see
/// `tidemark_common::reconcile_reads::PortableKind`); the error names the first it does not.
pub(crate) fn portable_content_columns(columns: &[Column]) -> Result<(), String> {
    tidemark_common::reconcile_reads::portable_kinds(columns.iter().map(|c| (c.name.as_str(), c.sql_type.as_str())))
        .map(|_| ())
}

/// Columns as an epoch stores them (see `checkpoints::stored_columns`).
pub(crate) fn columns_json(columns: &[Column]) -> serde_json::Value {
    serde_json::to_value(
        columns
            .iter()
            .map(|c| (c.name.clone(), c.sql_type.clone()))
            .collect::<Vec<_>>(),
    )
    .expect("columns serialize")
}

/// The columns an epoch froze.
pub fn epoch_columns(task: &str, epoch: &EpochRecord) -> Result<Vec<Column>, CoordinatorError> {
    crate::checkpoints::stored_columns(epoch.columns.clone())
        .map_err(|e| CoordinatorError::task_setup(task, format!("stored epoch columns: {e}")))
}

/// What `tasks reinit` did.
pub struct Reinit {
    pub epoch: u64,
    /// The statements that built the new epoch's table beside the live one.
    pub target_changes: Vec<String>,
}

/// `tasks reinit`: plans the next epoch from the source as it is now (a fresh snapshot, start
/// bound H0 read now) and builds its table beside the live one (see `epochs`). The live epoch
/// keeps syncing unless the task was paused because its reads broke (`reinitialization
/// required`, or its columns changed): then it stops, and its table serves until the switch.
pub async fn reinit_task(control: &ControlDb, config: &TaskConfig) -> Result<Reinit, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let live = control
        .current_epoch(task)
        .await?
        .ok_or_else(|| setup("the task has no epoch yet; start the coordinator first".into()))?;
    let source = inspect_source(config).await?;
    let not_null: Vec<bool> = source.columns.iter().map(|c| c.not_null).collect();
    let epoch = control.next_epoch(task).await?;
    let plan = plan_epoch(&source, config, epoch).await?;
    source.pool.close().await;
    let broken = control
        .paused_reason(task)
        .await?
        .is_some_and(|reason| crate::watcher::requires_reinitialization(&reason))
        || plan.schema_id != live.schema_id;
    let live_table = TableName::parse(&config.target_table).map_err(|e| setup(format!("target_table: {e}")))?;
    let sql = TableSql {
        source: source.table,
        target: live_table.epoch_table(plan.epoch),
        columns: source.columns.iter().map(|c| c.column.clone()).collect(),
        key_columns: config.key.clone(),
        cursor_column: config.cursor_column.clone(),
        version_column: source.version_column,
        deletes: delete_sql(config)?,
        filter: config.filter.clone(),
        page_format: CopyFormat::Text,
        cursor_zone: None,
    };
    let (mut target_changes, deferred) = engines::target_side(config)?
        .build_epoch(config, &sql, &not_null, plan.epoch)
        .await?;
    if !control.begin_building(&plan, broken, &deferred).await? {
        return Err(setup(format!(
            "epoch {} already exists: another reinitialization won",
            plan.epoch
        )));
    }
    control.candidates_changed();
    tracing::warn!(
        task,
        epoch = plan.epoch,
        shards = plan.ranges.len(),
        table = %sql.target,
        live = live.epoch,
        live_keeps_syncing = !broken,
        "task reinitialized: the new epoch builds beside the live table"
    );
    target_changes.extend(deferred.into_iter().map(|d| format!("after the snapshot: {d}")));
    Ok(Reinit {
        epoch: plan.epoch,
        target_changes,
    })
}

/// The source's clock now (microseconds since the Unix epoch): windows over cursor times,
/// which the source writes, are measured by it, not by the coordinator's clock.
pub async fn source_now_micros(config: &TaskConfig) -> Result<i64, CoordinatorError> {
    let source = connect_source(config).await?;
    let now = source
        .now_micros()
        .await
        .map_err(|e| CoordinatorError::task_setup(&config.name, format!("reading the source clock: {e}")));
    source.close().await;
    now
}

/// Connects to a task's source, whatever its engine.
pub async fn connect_source(config: &TaskConfig) -> Result<SourcePool, CoordinatorError> {
    engines::source_side(config)?.connect(config).await
}

/// How long planning waits for prepared transactions to end before it refuses.
pub(crate) const PREPARED_WAIT: Duration = Duration::from_secs(30);

/// H0's time: the source clock, held below the start of the oldest open transaction when the
/// task uses the open-transaction bound (rows such a transaction writes carry later times).
/// A prepared transaction has no known start, so no H0 covers it: planning waits for it to
/// end (up to [`PREPARED_WAIT`]), then refuses and names it.
pub(crate) async fn start_time_micros(
    source: &SourcePool,
    config: &TaskConfig,
    table: &TableName,
    cursor_unit_micros: i64,
) -> Result<i64, CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    let reading = |e: sqlx::Error| setup(format!("reading the start bound from {table}: {e}"));
    let deadline = std::time::Instant::now() + PREPARED_WAIT;
    loop {
        let now: i64 = source.now_micros().await.map_err(reading)?;
        if !config.open_transaction_bound {
            return Ok(now);
        }
        let (seen, prepared) = source.visibility(table).await.map_err(reading)?;
        if let Some(reason) = seen.blind_spot(table) {
            return Err(setup(reason));
        }
        let hold = match (seen.unreadable, prepared) {
            (Some(unreadable), _) => unreadable,
            (None, Some(prepared)) => visibility::prepared_hold(&prepared),
            (None, None) => {
                return Ok(seen
                    .oldest_start_micros
                    .map_or(now, |o| (o - cursor_unit_micros).min(now)));
            }
        };
        if std::time::Instant::now() >= deadline {
            return Err(setup(format!("cannot plan the snapshot's start bound: {hold}")));
        }
        tracing::warn!(task = %config.name, %hold, "waiting to plan the snapshot's start bound");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

pub(crate) async fn plan_epoch(
    source_info: &SourceInfo,
    config: &TaskConfig,
    epoch: u64,
) -> Result<EpochPlan, CoordinatorError> {
    let source = &source_info.pool;
    let table = &source_info.table;
    let first_key_type = source_info.first_key_type.as_str();
    let columns: Vec<Column> = source_info.columns.iter().map(|c| c.column.clone()).collect();
    let schema_id = source_info.schema_id.as_str();
    let reading = |e: sqlx::Error| {
        CoordinatorError::task_setup(&config.name, format!("reading the start bound from {table}: {e}"))
    };
    let cursor_type = config
        .cursor_column
        .as_ref()
        .and_then(|name| columns.iter().find(|c| &c.name == name))
        .map_or("timestamp with time zone", |c| c.sql_type.as_str());
    let engine = engines::side_of_source(&config.name, source)?;
    let cursor_zone = match &config.cursor_column {
        Some(cursor) if pg::is_naive_timestamp(cursor_type) => {
            Some(engine.naive_cursor_zone(source, config, cursor).await?)
        }
        _ => None,
    };
    // Read before the start bound: a TRUNCATE after this changes it (see the watcher).
    let source_table_id = if matches!(config.delete_policy, Some(DeletePolicy::TombstoneTable { .. })) {
        source.table_identity(table).await.map_err(reading)?
    } else {
        None
    };
    let h0_time_micros = start_time_micros(source, config, table, pg::timestamp_unit_micros(cursor_type)).await?;
    let (domain, h0_max_key) = engine.key_domain(source_info, config).await?;
    let estimated_rows: Option<i64> = engine
        .estimated_rows(source, table)
        .await
        .map_err(reading)?
        .filter(|n: &i64| *n >= 0);
    let _ = first_key_type;
    let columns_json = columns_json(&columns);
    Ok(EpochPlan {
        task: config.name.clone(),
        epoch,
        schema_id: schema_id.to_string(),
        columns: columns_json,
        h0_time_micros,
        h0_max_key: h0_max_key.map(|k| serde_json::to_value(k).expect("key serializes")),
        // The first cycle re-reads [H0 − overlap, high): rows written during a long snapshot
        // converge (convergent, not log-exact).
        incremental_start: Cursor::incremental_at(epoch, h0_time_micros),
        ranges: plan_ranges(&domain, config.shards).iter().map(|r| r.encode()).collect(),
        estimated_rows,
        cursor_zone,
        source_table_id,
    })
}

/// An integer key's domain between its extremes, and H0's largest key. An empty table
/// snapshots nothing: every row it will hold arrives incrementally.
pub(crate) fn integer_domain(sql_type: &str, min: Option<i64>, max: Option<i64>) -> (KeyDomain, Option<KeyValue>) {
    let domain = KeyDomain::Integer {
        sql_type: sql_type.to_string(),
        min: min.unwrap_or(0),
        max: max.unwrap_or(0),
    };
    let h0_max = KeyValue {
        sql_type: sql_type.to_string(),
        value: max.map_or_else(|| integer_minimum(sql_type).to_string(), |m| m.to_string()),
    };
    (domain, Some(h0_max))
}

/// The largest key of an append-only table that no open transaction can still add a key
/// below (see `tidemark_common::id_tail`). Waits for older transactions to end (up to
/// [`PREPARED_WAIT`]), then refuses and says why.
pub(crate) async fn settled_max_key(
    source: &SourcePool,
    reads: &SourceReads,
    config: &TaskConfig,
    table: &TableName,
) -> Result<Option<i64>, CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    let reading = |e: sqlx::Error| setup(format!("reading the largest key of {table}: {e}"));
    let sql = TableSql {
        source: table.clone(),
        target: table.clone(),
        columns: Vec::new(),
        key_columns: config.key.clone(),
        cursor_column: None,
        version_column: None,
        deletes: None,
        filter: None,
        page_format: CopyFormat::Text,
        cursor_zone: None,
    };
    let mut tail = IdTail::default();
    let deadline = std::time::Instant::now() + PREPARED_WAIT;
    loop {
        let (max_key, at_micros) = source.key_sample(reads, &sql).await.map_err(reading)?;
        tail.record(Sample { at_micros, max_key });
        let (seen, prepared) = source.visibility(table).await.map_err(reading)?;
        if let Some(reason) = seen.blind_spot(table) {
            return Err(setup(reason));
        }
        let hold = match (seen.unreadable, prepared) {
            (Some(unreadable), _) => unreadable,
            (None, Some(prepared)) => visibility::prepared_hold(&prepared),
            (None, None) => match tail.safe_bound(seen.oldest_start_micros) {
                Some(bound) => return Ok(bound),
                None => format!(
                    "a transaction open since {} may still add keys below the largest one",
                    seen.oldest_start_micros.map(format_micros).unwrap_or_default()
                ),
            },
        };
        if std::time::Instant::now() >= deadline {
            return Err(setup(format!("cannot fix the snapshot's largest key: {hold}")));
        }
        tracing::warn!(task = %config.name, %hold, "waiting to fix the snapshot's largest key");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
