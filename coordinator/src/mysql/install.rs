//! `source install` on a MySQL/MariaDB source: the trigger-fed delete log and `version =
//! "trigger"` (MariaDB).

use tidemark_common::config::{TRIGGER_VERSION_COLUMN, TaskConfig, VersionConfig};
use tidemark_common::mysql;
use tidemark_common::pg::TableName;
use tidemark_common::pg::deletes::delete_log_table;

use crate::error::CoordinatorError;

/// The delete log of a MySQL/MariaDB source (see `tidemark_common::mysql::deletes`): the log
/// table and two triggers. MySQL's DDL commits as it goes; every step is idempotent, so a
/// failed install is run again. Creating triggers needs TRIGGER on the table (and, with
/// binary logging on, SUPER or `log_bin_trust_function_creators`).
pub(crate) async fn install_delete_log(config: &TaskConfig) -> Result<String, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let table = TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?;
    let pool = mysql::pool(&config.source, 1).map_err(|e| setup(format!("source URL: {e}")))?;
    let reading = |e: sqlx::Error| setup(format!("source table {table}: {e}"));
    let columns = mysql::types::columns(&pool, &table.schema, &table.name)
        .await
        .map_err(reading)?
        .ok_or_else(|| setup(format!("source table {table} does not exist")))?;
    let column = |name: &str| {
        columns
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| setup(format!("column {name:?} does not exist in {table}")))
    };
    let mut keys = Vec::new();
    for key in &config.key {
        let (charset, collation): (Option<String>, Option<String>) = sqlx::query_as(mysql::deletes::KEY_COLLATION)
            .bind(&table.schema)
            .bind(&table.name)
            .bind(key)
            .fetch_one(&pool)
            .await
            .map_err(reading)?;
        keys.push(mysql::deletes::LogKey {
            column: column(key)?.clone(),
            charset,
            collation,
        });
    }
    let (cursor, sequence_version) = match (&config.version, &config.cursor_column) {
        (VersionConfig::Trigger, _) => (None, true),
        (VersionConfig::Cursor, Some(cursor)) => (Some(column(cursor)?), false),
        _ => {
            return Err(setup(
                "contract clause coverage: a MySQL/MariaDB delete log needs version = \"trigger\" or \"cursor\" \
                 (the entry's version is above the row's)"
                    .into(),
            ));
        }
    };
    let zone = if cursor.is_some_and(|c| c.is_naive_time()) {
        Some(
            mysql::inspect::cursor_zone(&pool, config.cursor_time_zone.as_deref())
                .await
                .map_err(setup)?
                .name,
        )
    } else {
        None
    };
    let log = delete_log_table(&table);
    let install = mysql::deletes::DeleteLogInstall {
        table: &table,
        log: &log,
        keys: &keys,
        cursor,
        sequence_version,
        cursor_zone: zone.as_deref(),
    };
    for statement in install.statements() {
        // Trigger bodies hold `;`: sent as text, not prepared (which CREATE TRIGGER is not).
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&pool)
            .await
            .map_err(|e| setup(format!("installing the delete log on {table}: {e}")))?;
    }
    pool.close().await;
    Ok(format!(
        "task {task}: deletes from {table} (and key changes) are logged in {}.{} by triggers; a TRUNCATE is \
         noticed by InnoDB's table id and pauses the task; the coordinator purges entries past retention",
        log.schema, log.name
    ))
}

/// `version = "trigger"` on MariaDB (see `tidemark_common::mysql::versions`): a sequence, the
/// version column (existing rows numbered in one UPDATE, which rewrites the table: run it at a
/// quiet time, before the first sync) and two BEFORE triggers. MySQL has no sequences: refused.
pub(crate) async fn install_trigger_version(config: &TaskConfig) -> Result<String, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let table = TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?;
    let pool = mysql::pool(&config.source, 1).map_err(|e| setup(format!("source URL: {e}")))?;
    let reading = |e: sqlx::Error| setup(format!("source table {table}: {e}"));
    let server: String = sqlx::query_scalar("SELECT CAST(VERSION() AS CHAR)")
        .fetch_one(&pool)
        .await
        .map_err(reading)?;
    if !server.contains("MariaDB") {
        return Err(setup(format!(
            "version = \"trigger\" needs sequences, which MariaDB has (10.3+) and MySQL {server} does not; use \
             version = \"cursor\" or a version column the application maintains"
        )));
    }
    let columns = mysql::types::columns(&pool, &table.schema, &table.name)
        .await
        .map_err(reading)?
        .ok_or_else(|| setup(format!("source table {table} does not exist")))?;
    let has_column = columns.iter().any(|c| c.name == TRIGGER_VERSION_COLUMN);
    let on_update: Vec<String> = sqlx::query_scalar(mysql::versions::ON_UPDATE_COLUMNS)
        .bind(&table.schema)
        .bind(&table.name)
        .fetch_all(&pool)
        .await
        .map_err(reading)?;
    for statement in mysql::versions::install_statements(&table, has_column, &on_update) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&pool)
            .await
            .map_err(|e| setup(format!("installing the version trigger on {table}: {e}")))?;
    }
    pool.close().await;
    let sequence = mysql::versions::version_sequence(&table);
    Ok(format!(
        "task {task}: {table}.{TRIGGER_VERSION_COLUMN} is maintained by BEFORE INSERT and UPDATE triggers from \
         sequence {}.{}",
        sequence.schema, sequence.name
    ))
}
