//! A MySQL/MariaDB source as the coordinator plans it: every column must map to a PostgreSQL
//! type, the key must be unique, the bound must see every writer, the delete log must be
//! readable and purgeable; the key's domain at H0 and the zone a DATETIME cursor is written in.
use std::time::Duration;

use tidemark_common::config::{DeletePolicy, TaskConfig};
use tidemark_common::cursor::{KeyDomain, KeyValue};
use tidemark_common::duration::format_duration;
use tidemark_common::mysql;
use tidemark_common::pg::deletes::delete_log_table;
use tidemark_common::pg::{Column, TableName};
use tidemark_common::redact::redact_url;
use tidemark_common::source::{SourcePool, SourceReads};

use crate::error::CoordinatorError;
use crate::planner::*;

/// A MySQL source's delete log exists, the task's account can read and purge it, and it can
/// read the table id that reveals a TRUNCATE.
pub(crate) async fn check_mysql_delete_log(
    config: &TaskConfig,
    pool: &SourcePool,
    table: &TableName,
) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let Some(mysql_pool) = tidemark_common::mysql::connector::mysql_source(pool) else {
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
pub(crate) async fn inspect_mysql_source(config: &TaskConfig) -> Result<SourceInfo, CoordinatorError> {
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
    let pool = tidemark_common::mysql::connector::source_pool(pool);
    if let Some(DeletePolicy::TombstoneTable { .. }) = &config.delete_policy {
        check_mysql_delete_log(config, &pool, &table).await?;
    }
    let reads = SourceReads::new(mysql::MySqlStatements {
        table: table.clone(),
        columns: found,
    });
    source_info(config, pool, reads, table, columns, version_column).await
}

/// [`pg_key_domain`] on MySQL/MariaDB: integer keys split by range, others at quantiles
/// the server computes in the key's own collation.
pub(crate) async fn mysql_key_domain(
    pool: &sqlx::MySqlPool,
    source_info: &SourceInfo,
    config: &TaskConfig,
) -> Result<(KeyDomain, Option<KeyValue>), CoordinatorError> {
    let table = &source_info.table;
    let first_key_type = source_info.first_key_type.as_str();
    let reading = |e: sqlx::Error| {
        CoordinatorError::task_setup(&config.name, format!("reading the start bound from {table}: {e}"))
    };
    let statements = source_info
        .reads
        .downcast::<mysql::MySqlStatements>()
        .ok_or_else(|| crate::engines::foreign_pool("MySQL/MariaDB"))?;
    let key = statements
        .columns
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
            max = settled_max_key(&source_info.pool, &source_info.reads, config, table).await?;
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
pub(crate) async fn mysql_cursor_zone(
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

/// The table's columns as the PostgreSQL types they map to (`unmapped <type>` for one that
/// maps to none, which changes the schema id).
pub(crate) async fn introspect_mysql(
    pool: &sqlx::MySqlPool,
    table: &TableName,
) -> Result<Option<Vec<SourceColumn>>, CoordinatorError> {
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

/// A pool on a source URL that connects on first use.
pub(crate) fn connect_mysql(task: &str, url: &str) -> Result<sqlx::MySqlPool, CoordinatorError> {
    mysql::pool(url, 2).map_err(|e| CoordinatorError::task_setup(task, format!("source URL: {e}")))
}

/// The table's primary key columns in key order.
pub(crate) async fn primary_key(pool: &sqlx::MySqlPool, table: &TableName) -> Result<Vec<String>, CoordinatorError> {
    sqlx::query_scalar(
        "SELECT CAST(column_name AS CHAR) FROM information_schema.key_column_usage \
         WHERE table_schema = ? AND table_name = ? AND constraint_name = 'PRIMARY' ORDER BY ordinal_position",
    )
    .bind(&table.schema)
    .bind(&table.name)
    .fetch_all(pool)
    .await
    .map_err(CoordinatorError::Source)
}
