//! Dead letters in a PostgreSQL target as operators handle them (`dead_letters_mysql` is
//! MySQL/MariaDB's):
//! counts for `status`, `dead-letters list`, `retry` and `resolve`.
//!
//! A retry claims one row at a time by a conditional update (`INIT`/`RETRY` → `PROCESSING`,
//! with this run's claim token), so of two concurrent runs exactly one gets each row. It then
//! re-applies the row's staged payload (transform included) and marks it `RESOLVED` in the same
//! transaction, guarded by its claim: the row's data and its status change commit together
//! or not at all. A run that dies leaves its claim behind; after `STALE_CLAIM_SECS` another run
//! may take the row over, and the dead run's guard would then fail.

use std::collections::BTreeMap;

use futures::TryStreamExt;
use sqlx::Row;
use sqlx::postgres::PgPool;
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::dead_letters::{self, Layout, STALE_CLAIM_SECS};
use tidemark_common::pg::accumulate::AccumulateSql;
use tidemark_common::pg::write;
use tidemark_common::pg::{Column, Read, TableSql};
use tidemark_common::transform::{Deltas, RowError, RowTransform};
use tidemark_proto::v1 as pb;

use crate::checkpoints::ControlDb;
use crate::error::CoordinatorError;
use crate::planner::PreparedTask;

/// Letters per status, e.g. `{"INIT": 37}`.
pub async fn counts(target: &PgPool, task: &str) -> Result<BTreeMap<String, u64>, sqlx::Error> {
    let rows = sqlx::query("SELECT status, count(*) FROM tidemark_dead_letters WHERE task = $1 GROUP BY status")
        .bind(task)
        .fetch_all(target)
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| (row.get::<String, _>(0), row.get::<i64, _>(1) as u64))
        .collect())
}

/// A payload as `list` shows it: a text row as its COPY line, a binary tuple in hex (`\x…`).
fn payload_text(payload: &[u8], layout: &str) -> String {
    match Layout::parse(layout).map(|l| l.format) {
        Ok(CopyFormat::Text) => String::from_utf8_lossy(payload).into_owned(),
        _ => format!("\\x{}", hex::encode(payload)),
    }
}

pub async fn list(
    target: &PgPool,
    task: &str,
    status: Option<&str>,
    limit: u32,
) -> Result<Vec<pb::DeadLetter>, CoordinatorError> {
    dead_letters::check_status(status).map_err(CoordinatorError::InvalidRequest)?;
    let rows = sqlx::query(
        "SELECT key, shard_id, batch_id, payload, error_class, message, status, retry_count, \
         to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), \
         to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), payload_layout \
         FROM tidemark_dead_letters WHERE task = $1 AND ($2::text IS NULL OR status = $2) ORDER BY key LIMIT $3",
    )
    .bind(task)
    .bind(status)
    .bind(i64::from(limit.max(1)))
    .fetch_all(target)
    .await
    .map_err(target_error)?;
    Ok(rows
        .into_iter()
        .map(|row| pb::DeadLetter {
            task: task.to_string(),
            key: row.get(0),
            shard_id: row.get::<i32, _>(1) as u32,
            batch_id: row.get(2),
            payload: payload_text(&row.get::<Vec<u8>, _>(3), &row.get::<String, _>(10)),
            error_class: row.get(4),
            message: row.get(5),
            status: row.get(6),
            retry_count: row.get::<i32, _>(7) as u32,
            created_at: row.get(8),
            updated_at: row.get(9),
        })
        .collect())
}

fn target_error(error: sqlx::Error) -> CoordinatorError {
    CoordinatorError::InvalidRequest(format!("target database: {error}"))
}

/// How a task writes rows, for a retry.
enum Writer {
    Upsert(TableSql),
    Accumulate {
        sql: TableSql,
        spec: tidemark_common::transform::AccumulateSpec,
        transform: RowTransform,
    },
}

impl Writer {
    fn for_task(task: &PreparedTask) -> Result<Writer, CoordinatorError> {
        let config = &task.config;
        let setup = |message: String| CoordinatorError::task_setup(&config.name, message);
        let sql = crate::planner::table_sql(task)?;
        Ok(match config.accumulate_spec().map_err(setup)? {
            None => Writer::Upsert(sql),
            Some(spec) => {
                let transform = RowTransform::new(&spec, &sql.columns).map_err(setup)?;
                Writer::Accumulate { sql, spec, transform }
            }
        })
    }

    /// Writes one staged row; `Err(Ok(row error))` when the row is still bad.
    async fn write(
        &self,
        conn: &mut sqlx::PgConnection,
        letter: &Letter<'_>,
    ) -> Result<(), Result<RowError, sqlx::Error>> {
        let classify = |e: sqlx::Error| match dead_letters::as_row_error(&e) {
            Some(row_error) => Ok(row_error),
            None => Err(e),
        };
        match self {
            Writer::Upsert(sql) => {
                let (payload, layout) = match (letter.layout.format, letter.read_in) {
                    (CopyFormat::Binary, Some(read_in)) => {
                        let text = binary_as_text(conn, sql, read_in, letter).await.map_err(classify)?;
                        let layout = Layout {
                            format: CopyFormat::Text,
                            ..letter.layout
                        };
                        (text, layout)
                    }
                    _ => (letter.payload.to_vec(), letter.layout),
                };
                // The letter's payload is an old read: it never replaces a row of its version.
                write::upsert_rows(conn, sql, layout, &layout.stream(&payload), None, Read::Earlier)
                    .await
                    .map_err(classify)?;
            }
            Writer::Accumulate { sql, spec, transform } => {
                let keys = transform.elements(letter.payload).map_err(Ok)?;
                let mut deltas = Deltas::default();
                deltas.add(keys);
                let summary = AccumulateSql { table: sql, spec };
                write::accumulate(conn, &summary, &deltas).await.map_err(classify)?;
            }
        }
        Ok(())
    }
}

/// The temporary table a binary letter is decoded in.
const DECODE_TABLE: &str = "tidemark_letter_decode";

/// A binary letter's bytes are in the types its batch was read in (`read_in`, its epoch's
/// columns). The target's columns may have changed since: a widened column is the usual fix
/// before a retry, and `tasks reinit --alter-target` converts columns. Binary input in other
/// types fails, or worse, reads as something else. So PostgreSQL decodes the row through a
/// temporary table of the original types, and it is written as text, whose input functions
/// convert (a column the letter lacks is NULL).
async fn binary_as_text(
    conn: &mut sqlx::PgConnection,
    sql: &TableSql,
    read_in: &[Column],
    letter: &Letter<'_>,
) -> Result<Vec<u8>, sqlx::Error> {
    let (repair, target_layout) = (letter.layout.repair, letter.layout.target_layout);
    let original = TableSql {
        columns: read_in.to_vec(),
        ..sql.clone()
    }
    .payload_columns(repair, target_layout);
    let definitions: Vec<String> = original.iter().map(|(name, ty)| format!("{name} {ty}")).collect();
    let names: Vec<&str> = original.iter().map(|(name, _)| name.as_str()).collect();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TEMP TABLE {DECODE_TABLE} ({}) ON COMMIT DROP",
        definitions.join(", ")
    )))
    .execute(&mut *conn)
    .await?;
    let mut copy = conn
        .copy_in_raw(&format!(
            "COPY {DECODE_TABLE} ({}) FROM STDIN{}",
            names.join(", "),
            CopyFormat::Binary.copy_option()
        ))
        .await?;
    copy.send(letter.layout.stream(letter.payload)).await?;
    copy.finish().await?;
    let select: Vec<String> = sql
        .payload_columns(repair, target_layout)
        .into_iter()
        .map(|(name, _)| {
            if names.contains(&name.as_str()) {
                name
            } else {
                "NULL".into()
            }
        })
        .collect();
    let mut text = Vec::new();
    let mut rows = conn
        .copy_out_raw(&format!(
            "COPY (SELECT {} FROM {DECODE_TABLE}) TO STDOUT",
            select.join(", ")
        ))
        .await?;
    while let Some(chunk) = rows.try_next().await? {
        text.extend_from_slice(&chunk);
    }
    drop(rows);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {DECODE_TABLE}")))
        .execute(&mut *conn)
        .await?;
    // One row: its line without the newline, as a text letter stores it.
    if text.last() == Some(&b'\n') {
        text.pop();
    }
    Ok(text)
}

/// Claimable by a run that started at `started` (a parameter): INIT or RETRY (or a stale
/// claim, older than `stale` seconds), and not touched since the run started, so that two
/// concurrent runs try each row once between them.
fn retryable(stale: &str, started: &str) -> String {
    format!(
        "(status IN ('INIT', 'RETRY') OR (status = 'PROCESSING' AND claimed_at < now() - make_interval(secs => {stale}))) \
         AND updated_at < {started}"
    )
}

/// Retries the task's INIT/RETRY letters (or just `keys`), one claimed row at a time.
/// `control` tells which column types a binary letter's bytes were read in.
pub async fn retry(
    control: &ControlDb,
    target: &PgPool,
    task: &PreparedTask,
    keys: &[String],
) -> Result<pb::RetryDeadLettersResponse, CoordinatorError> {
    let name = task.config.name.as_str();
    let writer = Writer::for_task(task)?;
    let max_retries = task.config.max_retries.max(1) as i32;
    let token = uuid::Uuid::new_v4().to_string();
    let started: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT statement_timestamp()")
        .fetch_one(target)
        .await
        .map_err(target_error)?;
    let candidates: Vec<String> = if keys.is_empty() {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT key FROM tidemark_dead_letters WHERE task = $1 AND {} ORDER BY key",
            retryable("$2", "$3")
        )))
        .bind(name)
        .bind(STALE_CLAIM_SECS as f64)
        .bind(started)
        .fetch_all(target)
        .await
        .map_err(target_error)?
    } else {
        keys.to_vec()
    };
    let mut response = pb::RetryDeadLettersResponse::default();
    let mut epoch_columns: std::collections::HashMap<i64, Option<Vec<Column>>> = std::collections::HashMap::new();
    for key in candidates {
        let claimed = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE tidemark_dead_letters SET status = 'PROCESSING', claimed_by = $4, claimed_at = now(), \
             updated_at = now() WHERE task = $1 AND key = $2 AND {} RETURNING payload, payload_layout, \
             (SELECT epoch FROM tidemark_ledger l WHERE l.batch_id = tidemark_dead_letters.batch_id)",
            retryable("$3", "$5")
        )))
        .bind(name)
        .bind(&key)
        .bind(STALE_CLAIM_SECS as f64)
        .bind(&token)
        .bind(started)
        .fetch_optional(target)
        .await
        .map_err(target_error)?;
        let Some(claimed) = claimed else {
            response.skipped += 1;
            continue;
        };
        let payload: Vec<u8> = claimed.get(0);
        let layout = Layout::parse(&claimed.get::<String, _>(1)).map_err(CoordinatorError::InvalidRequest)?;
        let read_in = match layout.format {
            // The epoch comes from the target's ledger row, written in the transaction that
            // wrote the letter: the batch's registry row may be pruned (`history_retention`).
            // Its columns are read once per epoch.
            CopyFormat::Binary => match claimed.get::<Option<i64>, _>(2) {
                Some(epoch) => {
                    if let std::collections::hash_map::Entry::Vacant(slot) = epoch_columns.entry(epoch) {
                        slot.insert(control.epoch_columns(name, epoch).await?);
                    }
                    epoch_columns[&epoch].clone()
                }
                None => None,
            },
            CopyFormat::Text => None,
        };
        let letter = Letter {
            key: &key,
            payload: &payload,
            layout,
            read_in: read_in.as_deref(),
        };
        match retry_one(target, &writer, name, &token, &letter).await {
            Ok(true) => response.resolved += 1,
            Ok(false) => response.skipped += 1,
            Err(Ok(row_error)) => {
                let status: Option<String> = sqlx::query_scalar(
                    "UPDATE tidemark_dead_letters SET retry_count = retry_count + 1, \
                     status = CASE WHEN retry_count + 1 >= $4 THEN 'FAILED' ELSE 'RETRY' END, \
                     error_class = $5, message = $6, claimed_by = NULL, claimed_at = NULL, updated_at = now() \
                     WHERE task = $1 AND key = $2 AND claimed_by = $3 RETURNING status",
                )
                .bind(name)
                .bind(&key)
                .bind(&token)
                .bind(max_retries)
                .bind(&row_error.class)
                .bind(&row_error.message)
                .fetch_optional(target)
                .await
                .map_err(target_error)?;
                match status.as_deref() {
                    Some("FAILED") => response.failed += 1,
                    Some(_) => response.retry += 1,
                    None => response.skipped += 1,
                }
            }
            Err(Err(error)) => {
                // Not the row's fault (the target is down, …): give the claim back untouched.
                let _ = sqlx::query(
                    "UPDATE tidemark_dead_letters SET status = 'RETRY', claimed_by = NULL, claimed_at = NULL \
                     WHERE task = $1 AND key = $2 AND claimed_by = $3",
                )
                .bind(name)
                .bind(&key)
                .bind(&token)
                .execute(target)
                .await;
                return Err(target_error(error));
            }
        }
    }
    tracing::info!(
        task = name,
        resolved = response.resolved,
        retry = response.retry,
        failed = response.failed,
        skipped = response.skipped,
        "dead letters retried"
    );
    Ok(response)
}

/// One claimed letter: its stored row, and (binary rows) the column types its bytes are in.
struct Letter<'a> {
    key: &'a str,
    payload: &'a [u8],
    layout: Layout,
    read_in: Option<&'a [Column]>,
}

/// Applies one claimed row and resolves it in one transaction. `Ok(false)`: the claim was
/// taken over meanwhile (nothing committed).
async fn retry_one(
    target: &PgPool,
    writer: &Writer,
    task: &str,
    token: &str,
    letter: &Letter<'_>,
) -> Result<bool, Result<RowError, sqlx::Error>> {
    let key = letter.key;
    let mut tx = target.begin().await.map_err(Err)?;
    writer.write(&mut tx, letter).await?;
    let resolved = sqlx::query(
        "UPDATE tidemark_dead_letters SET status = 'RESOLVED', claimed_by = NULL, claimed_at = NULL, \
         updated_at = now() WHERE task = $1 AND key = $2 AND status = 'PROCESSING' AND claimed_by = $3",
    )
    .bind(task)
    .bind(key)
    .bind(token)
    .execute(&mut *tx)
    .await
    .map_err(Err)?
    .rows_affected();
    if resolved != 1 {
        tx.rollback().await.map_err(Err)?;
        return Ok(false);
    }
    tx.commit().await.map_err(Err)?;
    Ok(true)
}

/// Deletes the task's RESOLVED letters resolved at least `older_than` ago (by the target's
/// clock). Letters in any other status are never purged: they are rows not yet in the target.
pub async fn purge(target: &PgPool, task: &str, older_than: std::time::Duration) -> Result<u64, CoordinatorError> {
    let purged = sqlx::query(
        "DELETE FROM tidemark_dead_letters WHERE task = $1 AND status = 'RESOLVED' \
         AND updated_at <= now() - make_interval(secs => $2)",
    )
    .bind(task)
    .bind(older_than.as_secs_f64())
    .execute(target)
    .await
    .map_err(target_error)?
    .rows_affected();
    Ok(purged)
}

/// Marks letters RESOLVED by hand: the given keys (unless PROCESSING), or every FAILED one.
pub async fn resolve(target: &PgPool, task: &str, keys: &[String], all_failed: bool) -> Result<u64, CoordinatorError> {
    if keys.is_empty() && !all_failed {
        return Err(CoordinatorError::InvalidRequest(
            "name the keys to resolve, or pass --all-failed".into(),
        ));
    }
    let resolved = sqlx::query(
        "UPDATE tidemark_dead_letters SET status = 'RESOLVED', updated_at = now() WHERE task = $1 \
         AND ((key = ANY($2) AND status <> 'PROCESSING') OR ($3 AND status = 'FAILED'))",
    )
    .bind(task)
    .bind(keys)
    .bind(all_failed)
    .execute(target)
    .await
    .map_err(target_error)?
    .rows_affected();
    Ok(resolved)
}
