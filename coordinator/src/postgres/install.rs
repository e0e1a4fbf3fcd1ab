//! `source install` on a PostgreSQL source: the trigger-maintained version column and the
//! trigger-fed delete log with its purge function, each in one transaction.

use tidemark_common::config::{TRIGGER_VERSION_COLUMN, TaskConfig, VersionConfig};
use tidemark_common::pg::deletes::{delete_log_table, purge_function, truncate_log_table};
use tidemark_common::pg::{
    TableName, cursor_micros_expr, derived_name, is_naive_timestamp, quote_ident, timestamp_unit_micros,
};

use super::source::{connect_database, introspect};
use crate::error::CoordinatorError;

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
pub(crate) async fn install_delete_log(config: &TaskConfig) -> Result<String, CoordinatorError> {
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
                Some(super::source::naive_cursor_zone(&source, config, cursor).await?)
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

/// `tidemark-coordinator source install --task T`: adds `tidemark_row_version` to the
/// source table, fed by a global sequence on every insert and update, so that versions are
/// monotone per key whatever the clocks do and across delete/re-insert. Existing rows get a
/// version in one UPDATE (this rewrites the table: run it before the first sync, at a quiet
/// time). Idempotent.
pub(crate) async fn install_trigger_version(config: &TaskConfig) -> Result<String, CoordinatorError> {
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
