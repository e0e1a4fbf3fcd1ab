//! Task setup: validates the source table against the task's contract, plans epoch 1 at the
//! start bound H0 (source time and largest key) with its shard ranges, and creates the
//! target table and ledger when they are missing. Also installs the trigger-maintained
//! version column (`source install`).

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use sha2::{Digest, Sha256};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tidemark_common::config::{
    DeletePolicy, TRIGGER_VERSION_COLUMN, TargetDeletes, TaskConfig, TaskMode, VersionConfig,
};
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::cursor::{Cursor, KeyDomain, KeyValue, format_micros, plan_ranges};
use tidemark_common::duration::format_duration;
use tidemark_common::id_tail::{IdTail, Sample};
use tidemark_common::mysql;
use tidemark_common::pg::deletes::{delete_log_table, truncate_log_table};
use tidemark_common::pg::{
    self, Column, DeleteSql, TableName, TableSql, VERSION_COLUMN, connect_options, is_transient, quote_ident,
    visibility,
};
use tidemark_common::redact::redact_url;
use tidemark_common::source::{SourceEngine, SourcePool, SourceReads};
use tidemark_common::target::TargetPool;

use crate::checkpoints::{ControlDb, EpochPlan, EpochRecord};
use crate::error::CoordinatorError;

const LEDGER_DDL: &str = include_str!("../../migrations/target/ledger.sql");
const DEAD_LETTERS_DDL: &str = include_str!("../../migrations/target/dead_letters.sql");

/// A task as the coordinator serves it: its config and its current epoch's frozen plan.
#[derive(Debug, Clone)]
pub struct PreparedTask {
    pub config: TaskConfig,
    pub epoch: EpochRecord,
    pub columns: Vec<Column>,
    /// The integer column holding each row's version; `None`: the cursor time.
    pub version_column: Option<String>,
}

/// Connects to a task database, retrying while it is unreachable.
pub async fn connect_database(task: &str, role: &str, url: &str) -> Result<PgPool, CoordinatorError> {
    let options = connect_options(url, "tidemark-coordinator")
        .map_err(|e| CoordinatorError::task_setup(task, format!("{role} URL: {e}")))?;
    let connect = || async {
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone())
            .await
    };
    connect
        .retry(
            ExponentialBuilder::default()
                .with_max_times(6)
                .with_max_delay(Duration::from_secs(10)),
        )
        .when(is_transient)
        .notify(|error, delay| {
            tracing::warn!(task, role, url = %redact_url(url), %error, ?delay, "database unreachable; retrying");
        })
        .await
        .map_err(|e| CoordinatorError::task_setup(task, format!("cannot connect to {role} {}: {e}", redact_url(url))))
}

pub(crate) struct SourceColumn {
    pub(crate) column: Column,
    pub(crate) not_null: bool,
}

pub(crate) async fn introspect(
    pool: &PgPool,
    task: &str,
    role: &str,
    table: &TableName,
) -> Result<Option<Vec<SourceColumn>>, CoordinatorError> {
    let query_error = |e: sqlx::Error| CoordinatorError::task_setup(task, format!("{role} table {table}: {e}"));
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(table.quoted())
        .fetch_one(pool)
        .await
        .map_err(query_error)?;
    if exists.is_none() {
        return Ok(None);
    }
    let rows = sqlx::query(pg::COLUMN_TYPES)
        .bind(table.quoted())
        .fetch_all(pool)
        .await
        .map_err(query_error)?;
    Ok(Some(
        rows.into_iter()
            .map(|row| SourceColumn {
                column: Column {
                    name: row.get(0),
                    sql_type: row.get(1),
                },
                not_null: row.get(3),
            })
            .collect(),
    ))
}

/// A source table's columns whatever the engine (a MySQL column as the PostgreSQL type it
/// maps to; one that maps to none shows as `unmapped <type>`, which changes the schema id).
pub(crate) async fn introspect_source(
    source: &SourcePool,
    task: &str,
    table: &TableName,
) -> Result<Option<Vec<SourceColumn>>, CoordinatorError> {
    let pool = match source {
        SourcePool::Postgres(pool) => return introspect(pool, task, "source", table).await,
        SourcePool::MySql(pool) => pool,
    };
    let columns = mysql::types::columns(pool, &table.schema, &table.name)
        .await
        .map_err(CoordinatorError::Source)?;
    Ok(columns.map(|columns| {
        columns
            .into_iter()
            .map(|c| SourceColumn {
                column: Column {
                    sql_type: c
                        .target_type()
                        .unwrap_or_else(|_| format!("unmapped {}", c.column_type)),
                    name: c.name,
                },
                not_null: c.not_null,
            })
            .collect()
    }))
}

/// Whether a unique, non-partial index (or the primary key) covers exactly `key`.
async fn key_is_unique(pool: &PgPool, table: &TableName, key: &[String]) -> Result<bool, CoordinatorError> {
    let indexes: Vec<Vec<String>> = sqlx::query_scalar(
        "SELECT array_agg(a.attname::text) FROM pg_index i \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
         WHERE i.indrelid = $1::regclass AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL \
         GROUP BY i.indexrelid",
    )
    .bind(table.quoted())
    .fetch_all(pool)
    .await
    .map_err(|e| CoordinatorError::InvalidRequest(format!("reading the unique indexes of {table}: {e}")))?;
    let mut wanted = key.to_vec();
    wanted.sort();
    Ok(indexes.into_iter().any(|mut columns| {
        columns.sort();
        columns == wanted
    }))
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
fn integer_minimum(sql_type: &str) -> i64 {
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
fn validate_columns(
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

/// Refuses, naming the grant, when the source role lacks a privilege on a table.
async fn require_privileges(pool: &PgPool, task: &str, needed: &[(TableName, &str)]) -> Result<(), CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    for (table, privilege) in needed {
        let (role, held): (String, bool) =
            sqlx::query_as("SELECT current_user::text, has_table_privilege($1::regclass, $2)")
                .bind(table.quoted())
                .bind(*privilege)
                .fetch_one(pool)
                .await
                .map_err(|e| setup(format!("reading the privileges on {table}: {e}")))?;
        if !held {
            return Err(setup(format!(
                "the source role {role} cannot {} {table}: GRANT {privilege} ON {} TO {}",
                privilege.to_lowercase(),
                table.quoted(),
                pg::quote_ident(&role)
            )));
        }
    }
    Ok(())
}

/// The source table as a task sees it: columns, version column and schema id.
struct SourceInfo {
    pool: SourcePool,
    /// A MySQL source's columns as it types them (empty for PostgreSQL).
    mysql_columns: Vec<mysql::SourceColumn>,
    table: TableName,
    columns: Vec<SourceColumn>,
    version_column: Option<String>,
    schema_id: String,
    first_key_type: String,
}

/// Connects to the source and checks the task's contract against its table.
async fn inspect_source(config: &TaskConfig) -> Result<SourceInfo, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    if SourceEngine::of_url(&config.source).map_err(&setup)? == SourceEngine::MySql {
        return inspect_mysql_source(config).await;
    }
    let table = TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?;
    let pool = connect_database(task, "source", &config.source).await?;
    let columns = introspect(&pool, task, "source", &table)
        .await?
        .ok_or_else(|| setup(format!("source table {table} does not exist")))?;
    let version_column = validate_columns(config, &table, &columns)?;
    if !key_is_unique(&pool, &table, &config.key).await? {
        return Err(setup(format!(
            "key ({}) of {table} is not unique: no unique index or primary key covers exactly these columns",
            config.key.join(", ")
        )));
    }
    if let Some(DeletePolicy::TombstoneTable { .. }) = &config.delete_policy {
        for (log, what) in [
            (delete_log_table(&table), "the delete log"),
            (truncate_log_table(&table), "the TRUNCATE log"),
        ] {
            let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
                .bind(log.quoted())
                .fetch_one(&pool)
                .await
                .map_err(|e| setup(format!("source table {log}: {e}")))?;
            if exists.is_none() {
                return Err(setup(format!(
                    "delete_policy tombstone_table: {what} {log} does not exist; run \
                     `tidemark-coordinator source install --task {task}` (again, after an upgrade)"
                )));
            }
        }
        // The workers read both logs; the coordinator purges the delete log past retention.
        require_privileges(
            &pool,
            task,
            &[
                (delete_log_table(&table), "SELECT"),
                (delete_log_table(&table), "DELETE"),
                (truncate_log_table(&table), "SELECT"),
            ],
        )
        .await?;
    }
    if config.open_transaction_bound {
        let (seen, _) = visibility::read(&pool, &table)
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
        pool: SourcePool::Postgres(pool),
        mysql_columns: Vec::new(),
        table,
        columns,
        version_column,
        schema_id,
        first_key_type,
    })
}

/// A MySQL source's delete log exists, the task's account can read and purge it, and it can
/// read the table id that reveals a TRUNCATE.
async fn check_mysql_delete_log(
    config: &TaskConfig,
    pool: &SourcePool,
    table: &TableName,
) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let SourcePool::MySql(mysql_pool) = pool else {
        return Ok(());
    };
    let log = delete_log_table(table);
    let log_sql = format!("{}.{}", mysql::quote_ident(&log.schema), mysql::quote_ident(&log.name));
    for (probe, privilege) in mysql::deletes::privilege_probes(&log)
        .into_iter()
        .zip(["SELECT", "DELETE"])
    {
        match sqlx::query(sqlx::AssertSqlSafe(probe)).execute(mysql_pool).await {
            Ok(_) => {}
            // ER_NO_SUCH_TABLE
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42S02") => {
                return Err(setup(format!(
                    "delete_policy tombstone_table: the delete log {log_sql} does not exist; run \
                     `tidemark-coordinator source install --task {task}` (again, after an upgrade)"
                )));
            }
            Err(e) => {
                return Err(setup(format!(
                    "delete_policy tombstone_table: the task's account cannot {privilege} the delete log \
                     ({e}): GRANT SELECT, DELETE ON {log_sql} TO …"
                )));
            }
        }
    }
    match pool.table_identity(table).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(setup(format!(
            "delete_policy tombstone_table: InnoDB does not list {table} (information_schema.INNODB_SYS_TABLES or \
             INNODB_TABLES), so a TRUNCATE, which bypasses the delete log, could not be noticed; the table must \
             be InnoDB, and its database and table names plain ASCII"
        ))),
        Err(e) => Err(setup(format!(
            "delete_policy tombstone_table: reading {table}'s InnoDB table id, which reveals a TRUNCATE, needs \
             PROCESS ({e}): GRANT PROCESS ON *.* TO …"
        ))),
    }
}

/// [`inspect_source`] for a MySQL/MariaDB source: every column must map to a PostgreSQL
/// type, the key must be unique, and the bound must see every writer.
async fn inspect_mysql_source(config: &TaskConfig) -> Result<SourceInfo, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let table = TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?;
    let pool = mysql::pool(&config.source, 2).map_err(|e| setup(format!("source URL: {e}")))?;
    let reading = |e: sqlx::Error| setup(format!("source {} table {table}: {e}", redact_url(&config.source)));
    let found = mysql::types::columns(&pool, &table.schema, &table.name)
        .await
        .map_err(reading)?
        .ok_or_else(|| {
            setup(format!(
                "source table {table} does not exist, or the source role has no privilege on it: GRANT SELECT ON {}.{} TO …",
                mysql::quote_ident(&table.schema),
                mysql::quote_ident(&table.name)
            ))
        })?;
    let mut columns = Vec::new();
    for column in &found {
        columns.push(SourceColumn {
            column: Column {
                name: column.name.clone(),
                sql_type: column
                    .target_type()
                    .map_err(|e| setup(format!("source table {table}: {e}")))?,
            },
            not_null: column.not_null,
        });
    }
    let version_column = validate_columns(config, &table, &columns)?;
    let reconciles =
        config.reconcile_every.is_some() || matches!(config.delete_policy, Some(DeletePolicy::Reconcile {}));
    let first_key = columns
        .iter()
        .find(|c| c.column.name == config.key[0])
        .expect("validated");
    if reconciles && (config.key.len() != 1 || !is_integer_type(&first_key.column.sql_type)) {
        return Err(setup(format!(
            "reconciliation on a MySQL/MariaDB source needs a single integer key (buckets split at integer \
             thresholds compare alike on both engines; text collations do not); {:?} is {}",
            config.key.join(", "),
            first_key.column.sql_type
        )));
    }
    if !mysql::inspect::key_is_unique(&pool, &table, &config.key)
        .await
        .map_err(reading)?
    {
        return Err(setup(format!(
            "key ({}) of {table} is not unique: no unique index or primary key covers exactly these columns",
            config.key.join(", ")
        )));
    }
    let pool = SourcePool::MySql(pool);
    if let Some(DeletePolicy::TombstoneTable { .. }) = &config.delete_policy {
        check_mysql_delete_log(config, &pool, &table).await?;
    }
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
        mysql_columns: found,
        table,
        columns,
        version_column,
        schema_id,
        first_key_type,
    })
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
        tracing::error!(task, %reason, "pausing task");
        control.pause_task(task, &reason).await?;
    }
    if let (Some(configured), Some(frozen)) = (&config.cursor_time_zone, &epoch.cursor_zone)
        && configured != frozen
    {
        tracing::warn!(task, configured = %configured, epoch = epoch.epoch, reads_in = %frozen,
            "cursor_time_zone differs from the zone the epoch froze; `tasks reinit` applies it");
    }
    let frozen_columns = epoch_columns(task, &epoch)?;
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
    let target_epoch = match SourceEngine::of_url(&config.target).map_err(&setup)? {
        SourceEngine::Postgres => {
            let target = connect_database(task, "target", &config.target).await?;
            ensure_target(&target, config, &sql, &not_null).await?;
            let target_epoch: Option<i64> = sqlx::query_scalar(pg::TARGET_EPOCH_NOW)
                .bind(task)
                .fetch_optional(&target)
                .await
                .map_err(|e| setup(format!("reading the task's epoch in the target: {e}")))?;
            target.close().await;
            target_epoch.map(|e| e as u64)
        }
        SourceEngine::MySql => crate::target_mysql::prepare(config, &sql, &not_null, epoch.epoch).await?,
    };
    if let Some(target_epoch) = target_epoch
        && target_epoch > epoch.epoch
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

/// An accumulate task's summary table: created when missing, else it must have the group and
/// aggregate columns.
async fn ensure_summary_table(
    target: &PgPool,
    task: &str,
    sql: &TableSql,
    spec: &tidemark_common::transform::AccumulateSpec,
) -> Result<(), CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let summary = tidemark_common::pg::accumulate::AccumulateSql { table: sql, spec };
    match introspect(target, task, "target", &sql.target).await? {
        None => {
            sqlx::query(sqlx::AssertSqlSafe(summary.create_target_table()))
                .execute(target)
                .await
                .map_err(|e| setup(format!("creating summary table {}: {e}", sql.target)))?;
            tracing::info!(task, table = %sql.target, "created summary table");
        }
        Some(existing) => {
            if let Some(missing) = summary
                .required_columns()
                .into_iter()
                .find(|name| !existing.iter().any(|c| &c.column.name == name))
            {
                return Err(setup(format!("summary table {} has no column {missing:?}", sql.target)));
            }
            if !key_is_unique(target, &sql.target, &spec.group_by).await? {
                return Err(setup(format!(
                    "summary table {}: no unique index or primary key covers exactly group_by ({})",
                    sql.target,
                    spec.group_by.join(", ")
                )));
            }
        }
    }
    Ok(())
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
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    if SourceEngine::of_url(&config.target).map_err(&setup)? == SourceEngine::MySql {
        return Ok(TargetPool::MySql(crate::target_mysql::pool(config)?));
    }
    let options =
        connect_options(&config.target, "tidemark-coordinator").map_err(|e| setup(format!("target URL: {e}")))?;
    Ok(TargetPool::Postgres(
        PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(options),
    ))
}

/// The columns an epoch froze.
pub fn epoch_columns(task: &str, epoch: &EpochRecord) -> Result<Vec<Column>, CoordinatorError> {
    crate::checkpoints::stored_columns(epoch.columns.clone())
        .map_err(|e| CoordinatorError::task_setup(task, format!("stored epoch columns: {e}")))
}

/// One way an existing target table differs from the source's columns, and the statement
/// that removes the difference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TargetChange {
    pub(crate) difference: String,
    pub(crate) statement: String,
}

/// How the target table must change to hold the source's columns as the source types them:
/// a missing column is added (nullable: the new epoch's snapshot fills it), a column of
/// another type is converted (`USING column::type`). Columns only the target has stay.
pub(crate) fn target_changes(table: &TableName, source: &[Column], target: &[Column]) -> Vec<TargetChange> {
    source
        .iter()
        .filter_map(|column| {
            let quoted = pg::quote_ident(&column.name);
            match target.iter().find(|t| t.name == column.name) {
                None => Some(TargetChange {
                    difference: format!(
                        "column {:?} is missing (the source's is {})",
                        column.name, column.sql_type
                    ),
                    statement: format!("ALTER TABLE {} ADD COLUMN {quoted} {}", table.quoted(), column.sql_type),
                }),
                Some(existing) if existing.sql_type != column.sql_type => Some(TargetChange {
                    difference: format!(
                        "column {:?} is {} where the source's is {}",
                        column.name, existing.sql_type, column.sql_type
                    ),
                    statement: format!(
                        "ALTER TABLE {} ALTER COLUMN {quoted} TYPE {} USING {quoted}::{}",
                        table.quoted(),
                        column.sql_type,
                        column.sql_type
                    ),
                }),
                Some(_) => None,
            }
        })
        .collect()
}

/// What `tasks reinit` did.
pub struct Reinit {
    pub epoch: u64,
    /// Statements that changed the target table (`alter_target`).
    pub target_changes: Vec<String>,
    /// Differences left in the target table (without `alter_target`).
    pub target_differences: Vec<String>,
}

/// `tasks reinit`: plans the next epoch from the source as it is now (a fresh snapshot, start
/// bound H0 read now), checks the target against it (with `alter_target`, first changes it
/// to hold the source's columns), and switches the task to it.
pub async fn reinit_task(
    control: &ControlDb,
    config: &TaskConfig,
    alter_target: bool,
) -> Result<Reinit, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let current = control
        .current_epoch(task)
        .await?
        .ok_or_else(|| setup("the task has no epoch yet; start the coordinator first".into()))?;
    let source = inspect_source(config).await?;
    let not_null: Vec<bool> = source.columns.iter().map(|c| c.not_null).collect();
    let plan = plan_epoch(&source, config, current.epoch + 1).await?;
    source.pool.close().await;
    let sql = TableSql {
        source: source.table,
        target: TableName::parse(&config.target_table).map_err(|e| setup(format!("target_table: {e}")))?,
        columns: source.columns.iter().map(|c| c.column.clone()).collect(),
        key_columns: config.key.clone(),
        cursor_column: config.cursor_column.clone(),
        version_column: source.version_column,
        deletes: delete_sql(config)?,
        filter: config.filter.clone(),
        page_format: CopyFormat::Text,
        cursor_zone: None,
    };
    let mut reinit = Reinit {
        epoch: plan.epoch,
        target_changes: Vec::new(),
        target_differences: Vec::new(),
    };
    if SourceEngine::of_url(&config.target).map_err(&setup)? == SourceEngine::MySql {
        reinit.target_changes = crate::target_mysql::reinit(config, &sql, &not_null, plan.epoch, alter_target).await?;
        return switch_to(control, task, &plan, reinit).await;
    }
    let target = connect_database(task, "target", &config.target).await?;
    // An accumulate task's target is its summary table, not a copy of the source's columns.
    if config.accumulate_spec().map_err(&setup)?.is_none()
        && let Some(existing) = introspect(&target, task, "target", &sql.target).await?
    {
        let existing: Vec<Column> = existing.into_iter().map(|c| c.column).collect();
        let changes = target_changes(&sql.target, &sql.columns, &existing);
        if alter_target && !changes.is_empty() {
            let altering = |e: sqlx::Error| setup(format!("altering target table {}: {e}", sql.target));
            let mut tx = target.begin().await.map_err(altering)?;
            for change in &changes {
                sqlx::query(sqlx::AssertSqlSafe(change.statement.clone()))
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| setup(format!("{}: {e}", change.statement)))?;
            }
            tx.commit().await.map_err(altering)?;
            tracing::warn!(task, table = %sql.target, changes = changes.len(), "target table altered to the source's columns");
            reinit.target_changes = changes.into_iter().map(|c| c.statement).collect();
        } else {
            let missing: Vec<&str> = changes
                .iter()
                .filter(|c| c.statement.contains(" ADD COLUMN "))
                .map(|c| c.difference.as_str())
                .collect();
            if !missing.is_empty() {
                return Err(setup(format!(
                    "target table {}: {}; add the columns, or run `tidemark-coordinator tasks reinit {task} --alter-target`",
                    sql.target,
                    missing.join("; ")
                )));
            }
            reinit.target_differences = changes.into_iter().map(|c| c.difference).collect();
        }
    }
    ensure_target(&target, config, &sql, &not_null).await?;
    fence_target_epoch(&target, config, &sql, plan.epoch).await?;
    target.close().await;
    switch_to(control, task, &plan, reinit).await
}

/// Switches the control database to the planned epoch, once the target refuses older ones.
async fn switch_to(
    control: &ControlDb,
    task: &str,
    plan: &EpochPlan,
    reinit: Reinit,
) -> Result<Reinit, CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    if !control.switch_epoch(plan).await? {
        return Err(setup(format!(
            "epoch {} already exists: another reinitialization won",
            plan.epoch
        )));
    }
    tracing::warn!(
        task,
        epoch = plan.epoch,
        shards = plan.ranges.len(),
        "task reinitialized: new epoch planned"
    );
    Ok(reinit)
}

/// Raises the task's epoch in the target, before the control database switches to it: from
/// then on every batch of an older epoch is refused in the target (see `pg::TARGET_EPOCH`).
/// An accumulate task's totals are emptied in the same transaction, with its dead letters:
/// the new epoch counts every row again, so totals never double. (Readers see the totals
/// rebuilt from zero; building beside the live table is issue 17's epoch switch.)
async fn fence_target_epoch(
    target: &PgPool,
    config: &TaskConfig,
    sql: &TableSql,
    epoch: u64,
) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let failed =
        |e: sqlx::Error| CoordinatorError::task_setup(task, format!("raising epoch {epoch} in the target: {e}"));
    let mut tx = target.begin().await.map_err(failed)?;
    sqlx::query(pg::LOCK_TARGET_EPOCH)
        .bind(task)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    sqlx::query(pg::RAISE_TARGET_EPOCH)
        .bind(task)
        .bind(epoch as i64)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    if let Some(spec) = config
        .accumulate_spec()
        .map_err(|e| CoordinatorError::task_setup(task, e))?
    {
        let summary = pg::accumulate::AccumulateSql {
            table: sql,
            spec: &spec,
        };
        sqlx::query(sqlx::AssertSqlSafe(summary.reset_totals()))
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        sqlx::query(tidemark_common::dead_letters::DELETE_TASK_LETTERS)
            .bind(task)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        tracing::warn!(task, epoch, table = %sql.target, "accumulate totals reset for the new epoch");
    }
    tx.commit().await.map_err(failed)
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
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    match SourceEngine::of_url(&config.source).map_err(&setup)? {
        SourceEngine::Postgres => Ok(SourcePool::Postgres(
            connect_database(&config.name, "source", &config.source).await?,
        )),
        SourceEngine::MySql => Ok(SourcePool::MySql(
            mysql::pool(&config.source, 2).map_err(|e| setup(format!("source URL: {e}")))?,
        )),
    }
}

/// How long planning waits for prepared transactions to end before it refuses.
const PREPARED_WAIT: Duration = Duration::from_secs(30);

/// H0's time: the source clock, held below the start of the oldest open transaction when the
/// task uses the open-transaction bound (rows such a transaction writes carry later times).
/// A prepared transaction has no known start, so no H0 covers it: planning waits for it to
/// end (up to [`PREPARED_WAIT`]), then refuses and names it.
async fn start_time_micros(
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
        let Some(prepared) = prepared else {
            return Ok(seen
                .oldest_start_micros
                .map_or(now, |o| (o - cursor_unit_micros).min(now)));
        };
        let hold = visibility::prepared_hold(&prepared);
        if std::time::Instant::now() >= deadline {
            return Err(setup(format!("cannot plan the snapshot's start bound: {hold}")));
        }
        tracing::warn!(task = %config.name, %hold, "waiting to plan the snapshot's start bound");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn plan_epoch(source_info: &SourceInfo, config: &TaskConfig, epoch: u64) -> Result<EpochPlan, CoordinatorError> {
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
    let cursor_zone = match (&config.cursor_column, source) {
        (Some(cursor), SourcePool::Postgres(pool)) if pg::is_naive_timestamp(cursor_type) => {
            Some(naive_cursor_zone(pool, config, cursor).await?)
        }
        (Some(cursor), SourcePool::MySql(pool)) if pg::is_naive_timestamp(cursor_type) => {
            Some(mysql_cursor_zone(pool, config, cursor).await?)
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
    let (domain, h0_max_key) = match source {
        SourcePool::Postgres(pool) => pg_key_domain(pool, source_info, config).await?,
        SourcePool::MySql(pool) => mysql_key_domain(pool, source_info, config).await?,
    };
    let estimated_rows: Option<i64> = match source {
        SourcePool::Postgres(pool) => {
            sqlx::query_scalar("SELECT reltuples::bigint FROM pg_class WHERE oid = $1::regclass")
                .bind(table.quoted())
                .fetch_optional(pool)
                .await
                .map_err(reading)?
        }
        SourcePool::MySql(pool) => mysql::inspect::estimated_rows(pool, table).await.map_err(reading)?,
    }
    .filter(|n: &i64| *n >= 0);
    let _ = first_key_type;
    let columns_json = serde_json::to_value(
        columns
            .iter()
            .map(|c| (c.name.clone(), c.sql_type.clone()))
            .collect::<Vec<_>>(),
    )
    .expect("columns serialize");
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
fn integer_domain(sql_type: &str, min: Option<i64>, max: Option<i64>) -> (KeyDomain, Option<KeyValue>) {
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

/// The first key's domain (how shards split it) and H0's largest key, on PostgreSQL.
async fn pg_key_domain(
    pool: &PgPool,
    source_info: &SourceInfo,
    config: &TaskConfig,
) -> Result<(KeyDomain, Option<KeyValue>), CoordinatorError> {
    let table = &source_info.table;
    let first_key_type = source_info.first_key_type.as_str();
    let reading = |e: sqlx::Error| {
        CoordinatorError::task_setup(&config.name, format!("reading the start bound from {table}: {e}"))
    };
    let first_key = quote_ident(&config.key[0]);
    let (domain, h0_max_key) = if first_key_type == "uuid" {
        // uuid keys split by prefix and need no bounds (and PostgreSQL has no min(uuid)).
        (KeyDomain::Uuid, None)
    } else if is_integer_type(first_key_type) {
        let query = format!(
            "SELECT min({first_key})::text, max({first_key})::text FROM {}",
            table.quoted()
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .fetch_one(pool)
            .await
            .map_err(reading)?;
        let parse = |text: Option<String>| text.and_then(|t| t.parse::<i64>().ok());
        let min = parse(row.get(0));
        let mut max = parse(row.get(1));
        if config.mode.appends() && config.open_transaction_bound {
            // Keys are read once, in order: the snapshot stops below any key a transaction
            // still open may add (see `id_tail`).
            max = settled_max_key(&source_info.pool, &SourceReads::Postgres, config, table).await?;
        }
        integer_domain(first_key_type, min, max)
    } else {
        // Other ordered types: boundaries at sampled quantiles (one sorted pass at planning).
        let fractions: Vec<String> = (1..config.shards)
            .map(|i| format!("{}", f64::from(i) / f64::from(config.shards)))
            .collect();
        let query = format!(
            "SELECT (percentile_disc(ARRAY[{}]::float8[]) WITHIN GROUP (ORDER BY {first_key}))::text[], max({first_key})::text FROM {}",
            if fractions.is_empty() {
                "0.5".to_string()
            } else {
                fractions.join(", ")
            },
            table.quoted()
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .fetch_one(pool)
            .await
            .map_err(reading)?;
        let boundaries: Option<Vec<String>> = row.get(0);
        let boundaries = if config.shards > 1 {
            boundaries.unwrap_or_default()
        } else {
            Vec::new()
        };
        let max: Option<String> = row.get(1);
        let h0_max = max.map(|value| KeyValue {
            sql_type: first_key_type.to_string(),
            value,
        });
        (
            KeyDomain::Sampled {
                sql_type: first_key_type.to_string(),
                boundaries,
            },
            h0_max,
        )
    };
    Ok((domain, h0_max_key))
}

/// [`pg_key_domain`] on MySQL/MariaDB: integer keys split by range, others at quantiles
/// the server computes in the key's own collation.
async fn mysql_key_domain(
    pool: &sqlx::MySqlPool,
    source_info: &SourceInfo,
    config: &TaskConfig,
) -> Result<(KeyDomain, Option<KeyValue>), CoordinatorError> {
    let table = &source_info.table;
    let first_key_type = source_info.first_key_type.as_str();
    let reading = |e: sqlx::Error| {
        CoordinatorError::task_setup(&config.name, format!("reading the start bound from {table}: {e}"))
    };
    let key = source_info
        .mysql_columns
        .iter()
        .find(|c| c.name == config.key[0])
        .expect("validated");
    if is_integer_type(first_key_type) {
        let (min, max) = mysql::inspect::integer_extremes(pool, table, &key.name)
            .await
            .map_err(reading)?;
        let parse = |text: Option<String>| text.and_then(|t| t.parse::<i64>().ok());
        let min = parse(min);
        let mut max = parse(max);
        if config.mode.appends() && config.open_transaction_bound {
            let reads = SourceReads::MySql(mysql::MySqlStatements {
                table: table.clone(),
                columns: source_info.mysql_columns.clone(),
            });
            max = settled_max_key(&source_info.pool, &reads, config, table).await?;
        }
        return Ok(integer_domain(first_key_type, min, max));
    }
    let (boundaries, max) = mysql::inspect::quantiles(pool, table, key, config.shards)
        .await
        .map_err(reading)?;
    let h0_max = max.map(|value| KeyValue {
        sql_type: first_key_type.to_string(),
        value,
    });
    Ok((
        KeyDomain::Sampled {
            sql_type: first_key_type.to_string(),
            boundaries,
        },
        h0_max,
    ))
}

/// The zone a MySQL `DATETIME` cursor is read in (see `mysql::inspect::cursor_zone`), with
/// the same daylight-saving rule as PostgreSQL's naive cursors.
async fn mysql_cursor_zone(
    pool: &sqlx::MySqlPool,
    config: &TaskConfig,
    cursor: &str,
) -> Result<String, CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    let zone = mysql::inspect::cursor_zone(pool, config.cursor_time_zone.as_deref())
        .await
        .map_err(setup)?;
    if zone.shift_seconds > 0 && (config.overlap.as_secs() as i64) < zone.shift_seconds {
        return Err(setup(format!(
            "cursor_column {cursor:?} is DATETIME written in {} ({}), whose clocks go back {} when daylight saving \
             time ends: rows written in the repeated hour would fall below the watermark. Use a TIMESTAMP column, \
             or set overlap to at least {}",
            zone.name,
            zone.learned_from,
            format_duration(Duration::from_secs(zone.shift_seconds as u64)),
            format_duration(Duration::from_secs(zone.shift_seconds as u64)),
        )));
    }
    tracing::info!(task = %config.name, cursor, zone = %zone.name, from = %zone.learned_from,
        "DATETIME cursor values are read as local times of this zone");
    Ok(zone.name)
}

/// The largest key of an append-only table that no open transaction can still add a key
/// below (see `tidemark_common::id_tail`). Waits for older transactions to end (up to
/// [`PREPARED_WAIT`]), then refuses and says why.
async fn settled_max_key(
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
        let hold = match prepared {
            Some(prepared) => visibility::prepared_hold(&prepared),
            None => match tail.safe_bound(seen.oldest_start_micros) {
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

/// The zone a naive cursor is read in for a new epoch (see `pg::cursor_zone`). Refused when
/// the zone's clocks go back (daylight saving time) by more than the overlap: the local times
/// of the repeated hour would fall below the watermark.
pub(crate) async fn naive_cursor_zone(
    source: &PgPool,
    config: &TaskConfig,
    cursor: &str,
) -> Result<String, CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
    let zone = pg::cursor_zone::resolve(source, config.cursor_time_zone.as_deref(), cursor)
        .await
        .map_err(setup)?;
    let shift = pg::cursor_zone::offset_shift_seconds(source, &zone.name)
        .await
        .map_err(|e| setup(format!("reading the offsets of time zone {}: {e}", zone.name)))?;
    if shift > 0 && (config.overlap.as_secs() as i64) < shift {
        return Err(setup(format!(
            "cursor_column {cursor:?} is timestamp without time zone written in {} ({}), whose clocks go back {}              when daylight saving time ends: rows written in the repeated hour would fall below the watermark.              Convert the column (ALTER TABLE … ALTER COLUMN {} TYPE timestamptz USING {} AT TIME ZONE '{}'), or              set overlap to at least {}",
            zone.name,
            zone.learned_from,
            format_duration(Duration::from_secs(shift as u64)),
            pg::quote_ident(cursor),
            pg::quote_ident(cursor),
            zone.name,
            format_duration(Duration::from_secs(shift as u64)),
        )));
    }
    tracing::info!(task = %config.name, cursor, zone = %zone.name, from = %zone.learned_from,
        "naive cursor values are read as local times of this zone");
    Ok(zone.name)
}

/// Creates the target table and the ledger when missing; an existing target table must carry
/// the version column and every source column.
async fn ensure_target(
    target: &PgPool,
    config: &TaskConfig,
    sql: &TableSql,
    not_null: &[bool],
) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    for (ddl, table) in [
        (LEDGER_DDL, pg::LEDGER_TABLE),
        (DEAD_LETTERS_DDL, tidemark_common::dead_letters::TABLE),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
            .execute(target)
            .await
            .map_err(|e| setup(format!("creating {table}: {e}")))?;
    }
    if let Some(spec) = config.accumulate_spec().map_err(&setup)? {
        return ensure_summary_table(target, task, sql, &spec).await;
    }
    match introspect(target, task, "target", &sql.target).await? {
        None => {
            let ddl = sql.create_target_table(not_null);
            sqlx::query(sqlx::AssertSqlSafe(ddl))
                .execute(target)
                .await
                .map_err(|e| setup(format!("creating target table {}: {e}", sql.target)))?;
            tracing::info!(task, table = %sql.target, "created target table");
        }
        Some(existing) => {
            let has = |name: &str| existing.iter().any(|c| c.column.name == name);
            if !has(VERSION_COLUMN) {
                return Err(setup(format!(
                    "target table {} exists but has no {VERSION_COLUMN} column; drop it or let Tidemark create it",
                    sql.target
                )));
            }
            if let Some(missing) = sql.columns.iter().find(|c| !has(&c.name)) {
                return Err(setup(format!(
                    "target table {} has no column {:?}",
                    sql.target, missing.name
                )));
            }
        }
    }
    if let Some(deletes) = &sql.deletes {
        let mut statements = vec![deletes.create_tombstone_table(sql)];
        if deletes.target_soft {
            statements.push(DeleteSql::add_soft_delete_column(sql));
        }
        for statement in statements {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(target)
                .await
                .map_err(|e| setup(format!("preparing deletes in the target {}: {e}", sql.target)))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(name: &str, sql_type: &str) -> Column {
        Column {
            name: name.into(),
            sql_type: sql_type.into(),
        }
    }

    #[test]
    fn target_changes_add_missing_columns_and_convert_other_types() {
        let table = TableName::parse("public.items").unwrap();
        let source = [column("id", "bigint"), column("qty", "bigint"), column("Color", "text")];
        let target = [
            column("id", "bigint"),
            column("qty", "integer"),
            column("_tidemark_version", "bigint"),
        ];
        let changes = target_changes(&table, &source, &target);
        assert_eq!(
            changes,
            vec![
                TargetChange {
                    difference: "column \"qty\" is integer where the source's is bigint".into(),
                    statement: format!(
                        "ALTER TABLE {} ALTER COLUMN \"qty\" TYPE bigint USING \"qty\"::bigint",
                        table.quoted()
                    ),
                },
                TargetChange {
                    difference: "column \"Color\" is missing (the source's is text)".into(),
                    statement: format!("ALTER TABLE {} ADD COLUMN \"Color\" text", table.quoted()),
                },
            ]
        );
        assert_eq!(target_changes(&table, &source[..1], &target), vec![], "equal columns");
    }
}
