//! `tidemark-coordinator source install --task T`: prepares a task's source table for the
//! contract its configuration claims: the trigger-maintained version column (`version =
//! "trigger"`) and the trigger-fed delete log (`delete_policy = { kind = "tombstone_table" }`)
//! with its purge function, on PostgreSQL and (the delete log) on MySQL/MariaDB. Every step
//! is idempotent.

use tidemark_common::config::{DeletePolicy, TRIGGER_VERSION_COLUMN, TaskConfig, VersionConfig};
use tidemark_common::pg::deletes::{delete_log_table, purge_function, truncate_log_table};
use tidemark_common::pg::{
    TableName, cursor_micros_expr, derived_name, is_naive_timestamp, quote_ident, timestamp_unit_micros,
};

use tidemark_common::mysql;
use tidemark_common::source::SourceEngine;

use crate::error::CoordinatorError;
use crate::source_pg::{connect_database, introspect};

/// Installs what the task's configuration needs; returns one line per installed part.
pub async fn install(config: &TaskConfig) -> Result<Vec<String>, CoordinatorError> {
    let mut done = Vec::new();
    if config.version == VersionConfig::Trigger {
        done.push(install_trigger_version(config).await?);
    }
    if let Some(DeletePolicy::TombstoneTable { .. }) = &config.delete_policy {
        done.push(install_delete_log(config).await?);
    }
    if done.is_empty() {
        return Err(CoordinatorError::task_setup(
            &config.name,
            "nothing to install: neither version = \"trigger\" nor delete_policy tombstone_table is configured",
        ));
    }
    Ok(done)
}

/// All or nothing: an install that fails halfway leaves the source as it was. Closes the pool.
async fn run_in_one_transaction(source: sqlx::PgPool, statements: &[String]) -> Result<(), sqlx::Error> {
    let mut tx = source.begin().await?;
    for statement in statements {
        sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    source.close().await;
    Ok(())
}

fn version_sequence(table: &TableName) -> String {
    format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&derived_name("", &table.name, "_tidemark_version_seq"))
    )
}

/// The delete log: an AFTER DELETE trigger (and an AFTER UPDATE trigger for key changes)
/// records each removed key with a version above the row's last one and the time, and a
/// purge function removes entries older than a cutoff.
async fn install_delete_log(config: &TaskConfig) -> Result<String, CoordinatorError> {
    if SourceEngine::of_url(&config.source) == Ok(SourceEngine::MySql) {
        return install_mysql_delete_log(config).await;
    }
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let table = TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?;
    let source = connect_database(task, "source", &config.source).await?;
    let columns = introspect(&source, task, "source", &table)
        .await?
        .ok_or_else(|| setup(format!("source table {table} does not exist")))?;
    let mut key_definitions = Vec::new();
    for key in &config.key {
        let column = columns
            .iter()
            .find(|c| &c.column.name == key)
            .ok_or_else(|| setup(format!("key column {key:?} does not exist in {table}")))?;
        key_definitions.push(format!("{} {} NOT NULL", quote_ident(key), column.column.sql_type));
    }
    let version = match (&config.version, &config.cursor_column) {
        (VersionConfig::Trigger, _) => format!("nextval('{}')", version_sequence(&table)),
        (VersionConfig::Cursor, Some(cursor)) => {
            // Above the row's last version, and on the cursor's precision so that a re-insert
            // in a later unit of it wins (within the same unit the delete wins the tie: the
            // cursor version cannot order them; `version = "trigger"` can).
            let cursor_type = columns
                .iter()
                .find(|c| &c.column.name == cursor)
                .map_or("timestamp with time zone", |c| c.column.sql_type.as_str());
            let unit = timestamp_unit_micros(cursor_type);
            // The row's cursor as the instant the task reads it as (a naive cursor in its zone).
            let zone = if is_naive_timestamp(cursor_type) {
                Some(crate::source_pg::naive_cursor_zone(&source, config, cursor).await?)
            } else {
                None
            };
            let old_micros = cursor_micros_expr(&format!("OLD.{}", quote_ident(cursor)), cursor_type, zone.as_deref());
            format!(
                "GREATEST({old_micros} + 1, ((extract(epoch from clock_timestamp()) * 1000000)::bigint / {unit}) * {unit})"
            )
        }
        _ => {
            return Err(setup(
                "contract clause coverage: a delete log needs version = \"trigger\" or \"cursor\"".into(),
            ));
        }
    };
    let log = delete_log_table(&table);
    let keys: Vec<String> = config.key.iter().map(|k| quote_ident(k)).collect();
    let old_keys: Vec<String> = keys.iter().map(|k| format!("OLD.{k}")).collect();
    let function = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&derived_name("tidemark_log_delete_", &table.name, ""))
    );
    let trigger = quote_ident(&derived_name("tidemark_deletes_", &table.name, ""));
    let key_trigger = quote_ident(&derived_name("tidemark_key_changes_", &table.name, ""));
    let truncates = truncate_log_table(&table);
    let truncate_function = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&derived_name("tidemark_log_truncate_", &table.name, ""))
    );
    let truncate_trigger = quote_ident(&derived_name("tidemark_truncates_", &table.name, ""));
    let key_changed: Vec<String> = keys
        .iter()
        .map(|k| format!("OLD.{k} IS DISTINCT FROM NEW.{k}"))
        .collect();
    let statements = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}, version bigint NOT NULL, deleted_at timestamptz NOT NULL DEFAULT clock_timestamp())",
            log.quoted(),
            key_definitions.join(", ")
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {} (deleted_at, {})",
            quote_ident(&derived_name("", &log.name, "_position")),
            log.quoted(),
            keys.join(", ")
        ),
        format!(
            "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             INSERT INTO {} ({}, version) VALUES ({}, {version}); RETURN NULL; END $$",
            log.quoted(),
            keys.join(", "),
            old_keys.join(", ")
        ),
        format!("DROP TRIGGER IF EXISTS {trigger} ON {}", table.quoted()),
        format!(
            "CREATE TRIGGER {trigger} AFTER DELETE ON {} FOR EACH ROW EXECUTE FUNCTION {function}()",
            table.quoted()
        ),
        format!("DROP TRIGGER IF EXISTS {key_trigger} ON {}", table.quoted()),
        format!(
            "CREATE TRIGGER {key_trigger} AFTER UPDATE ON {} FOR EACH ROW WHEN ({}) EXECUTE FUNCTION {function}()",
            table.quoted(),
            key_changed.join(" OR ")
        ),
        // TRUNCATE fires no row trigger: a statement trigger records it, and the coordinator
        // pauses the task with `reinitialization required`.
        format!(
            "CREATE TABLE IF NOT EXISTS {} (truncated_at timestamptz NOT NULL DEFAULT clock_timestamp())",
            truncates.quoted()
        ),
        format!(
            "CREATE OR REPLACE FUNCTION {truncate_function}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             INSERT INTO {} DEFAULT VALUES; RETURN NULL; END $$",
            truncates.quoted()
        ),
        format!("DROP TRIGGER IF EXISTS {truncate_trigger} ON {}", table.quoted()),
        format!(
            "CREATE TRIGGER {truncate_trigger} AFTER TRUNCATE ON {} FOR EACH STATEMENT EXECUTE FUNCTION {truncate_function}()",
            table.quoted()
        ),
        format!(
            "CREATE OR REPLACE FUNCTION {}(cutoff timestamptz) RETURNS bigint LANGUAGE sql AS $$ \
             WITH gone AS (DELETE FROM {} WHERE deleted_at < cutoff RETURNING 1) SELECT count(*) FROM gone $$",
            purge_function(&table),
            log.quoted()
        ),
    ];
    run_in_one_transaction(source, &statements)
        .await
        .map_err(|e| setup(format!("installing the delete log on {table}: {e}")))?;
    Ok(format!(
        "task {task}: deletes from {table} are logged in {log} by trigger {trigger}, TRUNCATEs in {truncates}; {} \
         purges entries",
        purge_function(&table)
    ))
}

/// The delete log of a MySQL/MariaDB source (see `tidemark_common::mysql::deletes`): the log
/// table and two triggers. MySQL's DDL commits as it goes; every step is idempotent, so a
/// failed install is run again. Creating triggers needs TRIGGER on the table (and, with
/// binary logging on, SUPER or `log_bin_trust_function_creators`).
async fn install_mysql_delete_log(config: &TaskConfig) -> Result<String, CoordinatorError> {
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
async fn install_mysql_trigger_version(config: &TaskConfig) -> Result<String, CoordinatorError> {
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

/// `tidemark-coordinator source install --task T`: adds `tidemark_row_version` to the
/// source table, fed by a global sequence on every insert and update, so that versions are
/// monotone per key whatever the clocks do and across delete/re-insert. Existing rows get a
/// version in one UPDATE (this rewrites the table: run it before the first sync, at a quiet
/// time). Idempotent.
pub async fn install_trigger_version(config: &TaskConfig) -> Result<String, CoordinatorError> {
    if SourceEngine::of_url(&config.source) == Ok(SourceEngine::MySql) {
        return install_mysql_trigger_version(config).await;
    }
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let table = TableName::parse(&config.source_table).map_err(|e| setup(format!("source_table: {e}")))?;
    let source = connect_database(task, "source", &config.source).await?;
    let columns = introspect(&source, task, "source", &table)
        .await?
        .ok_or_else(|| setup(format!("source table {table} does not exist")))?;
    let column = quote_ident(TRIGGER_VERSION_COLUMN);
    let qualified_sequence = version_sequence(&table);
    let function = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&derived_name("tidemark_version_", &table.name, ""))
    );
    let trigger = quote_ident(&derived_name("tidemark_version_", &table.name, ""));
    let has_column = columns.iter().any(|c| c.column.name == TRIGGER_VERSION_COLUMN);
    let mut statements = vec![format!("CREATE SEQUENCE IF NOT EXISTS {qualified_sequence}")];
    if !has_column {
        statements.push(format!("ALTER TABLE {} ADD COLUMN {column} bigint", table.quoted()));
        statements.push(format!(
            "UPDATE {} SET {column} = nextval('{qualified_sequence}')",
            table.quoted()
        ));
        statements.push(format!(
            "ALTER TABLE {} ALTER COLUMN {column} SET DEFAULT nextval('{qualified_sequence}'), ALTER COLUMN {column} SET NOT NULL",
            table.quoted()
        ));
    }
    statements.push(format!(
        "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN NEW.{column} := nextval('{qualified_sequence}'); RETURN NEW; END $$"
    ));
    statements.push(format!("DROP TRIGGER IF EXISTS {trigger} ON {}", table.quoted()));
    statements.push(format!(
        "CREATE TRIGGER {trigger} BEFORE INSERT OR UPDATE ON {} FOR EACH ROW EXECUTE FUNCTION {function}()",
        table.quoted()
    ));
    run_in_one_transaction(source, &statements)
        .await
        .map_err(|e| setup(format!("installing the version trigger on {table}: {e}")))?;
    Ok(format!(
        "task {task}: {table}.{TRIGGER_VERSION_COLUMN} is maintained by trigger {trigger} from sequence {qualified_sequence}"
    ))
}
