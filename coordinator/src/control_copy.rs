//! `tidemark control copy`: a control state from the embedded store into a PostgreSQL control
//! database, for a `tidemark sync` that grows into a cluster (coordinator replicas need
//! PostgreSQL). Every record is copied as it is: epochs, checkpoints with their cursors,
//! versions and fences, the batch registry (a staged batch is replayed by the shard's next
//! owner as after any restart), the history, reconciliation runs and workers. The cluster then
//! continues from the checkpoints instead of snapshotting again.
//!
//! Both stores are held while copying: the embedded one by its lock file (no sync may run on
//! it), the PostgreSQL one by one transaction that finds no task there and writes everything.
//! Column values are converted by the PostgreSQL column's type (microseconds to
//! `timestamptz`, 0/1 to `boolean`, JSON text to `jsonb`); a column the embedded store lacks
//! fails the copy by name, before anything is committed.

use sqlx::Row;

use crate::checkpoints::ControlDb;
use crate::error::CoordinatorError;

/// The control tables, parents before children.
const TABLES: [&str; 9] = [
    "tasks",
    "epochs",
    "checkpoints",
    "batches",
    "checkpoint_history",
    "late_rows",
    "reconcile_runs",
    "reconcile_shards",
    "workers",
];

/// Tables whose `id` comes from a sequence in PostgreSQL.
const SERIAL: [&str; 3] = ["checkpoint_history", "late_rows", "reconcile_runs"];

/// Rows per INSERT.
const CHUNK: usize = 2_000;

fn bad(message: String) -> CoordinatorError {
    CoordinatorError::InvalidRequest(message)
}

/// One stored value in the form `jsonb_populate_recordset` reads for the column's type.
fn value_for(
    row: &sqlx::sqlite::SqliteRow,
    table: &str,
    column: &str,
    pg_type: &str,
) -> Result<serde_json::Value, CoordinatorError> {
    let missing = |e: sqlx::Error| bad(format!("{table}.{column}: not in the embedded store ({e})"));
    Ok(match pg_type {
        "bigint" | "integer" => row
            .try_get::<Option<i64>, _>(column)
            .map_err(missing)?
            .map_or(serde_json::Value::Null, serde_json::Value::from),
        "boolean" => row
            .try_get::<Option<i64>, _>(column)
            .map_err(missing)?
            .map_or(serde_json::Value::Null, |v| serde_json::Value::Bool(v != 0)),
        "timestamp with time zone" => match row.try_get::<Option<i64>, _>(column).map_err(missing)? {
            None => serde_json::Value::Null,
            Some(micros) => {
                let at = chrono::DateTime::from_timestamp_micros(micros)
                    .ok_or_else(|| bad(format!("{table}.{column}: {micros} is not a time")))?;
                serde_json::Value::String(at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
            }
        },
        "jsonb" => match row.try_get::<Option<String>, _>(column).map_err(missing)? {
            None => serde_json::Value::Null,
            Some(text) => serde_json::from_str(&text).map_err(|e| bad(format!("{table}.{column}: {e}")))?,
        },
        "text" => row
            .try_get::<Option<String>, _>(column)
            .map_err(missing)?
            .map_or(serde_json::Value::Null, serde_json::Value::String),
        other => {
            return Err(bad(format!(
                "{table}.{column}: no conversion for PostgreSQL type {other}"
            )));
        }
    })
}

/// Copies every record of the embedded store `from` into the PostgreSQL control database `to`
/// (schema `schema`, or the role's search path), which must hold no task. Returns the rows
/// copied per table, parents first.
pub async fn copy(from: &str, to: &str, schema: Option<&str>) -> Result<Vec<(&'static str, u64)>, CoordinatorError> {
    if !crate::sqlite_control::is_sqlite_url(from) {
        return Err(bad(format!("--from: {from} is not the embedded store (sqlite://…)")));
    }
    if crate::sqlite_control::is_sqlite_url(to) {
        return Err(bad(
            "--to: the copy goes into a PostgreSQL control database (postgres://…)".into(),
        ));
    }
    let source = ControlDb::connect(from, None).await?;
    let _held = source.hold_sole_coordinator().await?;
    let lite = source.lite().expect("a sqlite:// URL opens the embedded store");
    let target = ControlDb::connect(to, schema).await?;
    let mut tx = target.pool().begin().await?;
    let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks")
        .fetch_one(&mut *tx)
        .await?;
    if tasks > 0 {
        return Err(bad(format!(
            "--to already holds {tasks} task(s); copy into an empty control database or schema"
        )));
    }
    let mut copied = Vec::new();
    for table in TABLES {
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT column_name::text, data_type::text FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = $1 ORDER BY ordinal_position",
        )
        .bind(table)
        .fetch_all(&mut *tx)
        .await?;
        // The table names are the constants above.
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT * FROM {table}")))
            .fetch_all(lite.pool())
            .await?;
        let names = columns
            .iter()
            .map(|(name, _)| name.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let insert =
            format!("INSERT INTO {table} ({names}) SELECT {names} FROM jsonb_populate_recordset(NULL::{table}, $1)");
        for chunk in rows.chunks(CHUNK) {
            let records = chunk
                .iter()
                .map(|row| {
                    columns
                        .iter()
                        .map(|(name, pg_type)| Ok((name.clone(), value_for(row, table, name, pg_type)?)))
                        .collect::<Result<serde_json::Map<_, _>, CoordinatorError>>()
                        .map(serde_json::Value::Object)
                })
                .collect::<Result<Vec<_>, _>>()?;
            sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
                .bind(serde_json::Value::Array(records))
                .execute(&mut *tx)
                .await?;
        }
        if SERIAL.contains(&table) {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT setval(pg_get_serial_sequence('{table}', 'id'), coalesce(max(id), 1), max(id) IS NOT NULL) \
                 FROM {table}"
            )))
            .execute(&mut *tx)
            .await?;
        }
        copied.push((table, rows.len() as u64));
    }
    tx.commit().await?;
    Ok(copied)
}
