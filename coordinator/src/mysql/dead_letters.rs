//! The dead-letter commands (`list`, `retry`, `resolve`, `purge`) on a MySQL/MariaDB target:
//! the same statuses, claims and transactions as `dead_letters` on PostgreSQL, in MySQL's
//! SQL. A retried row is written by the target's own statements (`mysql::target`) as an
//! earlier read: it never replaces a row of its version.

use sqlx::Row;
use sqlx::mysql::MySqlPool;
use tidemark_common::dead_letters::{self, Layout, STALE_CLAIM_SECS};
use tidemark_common::mysql::target::{self as sql, AccumulateMySql};
use tidemark_common::pg::Read;
use tidemark_common::transform::{Deltas, RowError, RowTransform};
use tidemark_common::write::WriteError;
use tidemark_proto::v1 as pb;

use crate::error::CoordinatorError;
use crate::planner::PreparedTask;

fn target_error(error: sqlx::Error) -> CoordinatorError {
    CoordinatorError::InvalidRequest(format!("target database: {error}"))
}

pub async fn list(
    target: &MySqlPool,
    task: &str,
    status: Option<&str>,
    limit: u32,
) -> Result<Vec<pb::DeadLetter>, CoordinatorError> {
    dead_letters::check_status(status).map_err(CoordinatorError::InvalidRequest)?;
    let rows = sqlx::query(
        "SELECT `key`, shard_id, batch_id, payload, error_class, message, status, retry_count, \
         DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), DATE_FORMAT(updated_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
         payload_layout FROM tidemark_dead_letters WHERE task = ? AND (? IS NULL OR status = ?) ORDER BY `key` LIMIT ?",
    )
    .bind(task)
    .bind(status)
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
            payload: String::from_utf8_lossy(&row.get::<Vec<u8>, _>(3)).into_owned(),
            error_class: row.get(4),
            message: row.get(5),
            status: row.get(6),
            retry_count: row.get::<i32, _>(7) as u32,
            created_at: row.get(8),
            updated_at: row.get(9),
        })
        .collect())
}

/// Claimable by a run that started at `?` (the last parameter): INIT or RETRY (or a claim
/// older than [`STALE_CLAIM_SECS`]), and not touched since the run started.
fn retryable() -> String {
    format!(
        "(status IN ('INIT', 'RETRY') OR (status = 'PROCESSING' AND claimed_at < UTC_TIMESTAMP(6) - INTERVAL \
         {STALE_CLAIM_SECS} SECOND)) AND updated_at < ?"
    )
}

/// Retries the task's INIT/RETRY letters (or just `keys`), one claimed row at a time.
pub async fn retry(
    target: &MySqlPool,
    task: &PreparedTask,
    keys: &[String],
) -> Result<pb::RetryDeadLettersResponse, CoordinatorError> {
    let name = task.config.name.as_str();
    let table = crate::planner::table_sql(task)?;
    let setup = |message: String| CoordinatorError::task_setup(name, message);
    let accumulate = match task.config.accumulate_spec().map_err(setup)? {
        Some(spec) => {
            let transform = RowTransform::new(&spec, &table.columns).map_err(setup)?;
            Some((spec, transform))
        }
        None => None,
    };
    let max_retries = task.config.max_retries.max(1) as i32;
    let token = uuid::Uuid::new_v4().to_string();
    let started: String = sqlx::query_scalar("SELECT CAST(UTC_TIMESTAMP(6) AS CHAR)")
        .fetch_one(target)
        .await
        .map_err(target_error)?;
    let candidates: Vec<String> = if keys.is_empty() {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT `key` FROM tidemark_dead_letters WHERE task = ? AND {} ORDER BY `key`",
            retryable()
        )))
        .bind(name)
        .bind(&started)
        .fetch_all(target)
        .await
        .map_err(target_error)?
    } else {
        keys.to_vec()
    };
    let mut response = pb::RetryDeadLettersResponse::default();
    for key in candidates {
        let claimed = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE tidemark_dead_letters SET status = 'PROCESSING', claimed_by = ?, claimed_at = UTC_TIMESTAMP(6), \
             updated_at = UTC_TIMESTAMP(6) WHERE task = ? AND `key` = ? AND {}",
            retryable()
        )))
        .bind(&token)
        .bind(name)
        .bind(&key)
        .bind(&started)
        .execute(target)
        .await
        .map_err(target_error)?
        .rows_affected();
        if claimed != 1 {
            response.skipped += 1;
            continue;
        }
        let row = sqlx::query("SELECT payload, payload_layout FROM tidemark_dead_letters WHERE task = ? AND `key` = ?")
            .bind(name)
            .bind(&key)
            .fetch_one(target)
            .await
            .map_err(target_error)?;
        let payload: Vec<u8> = row.get(0);
        let layout = Layout::parse(&row.get::<String, _>(1)).map_err(CoordinatorError::InvalidRequest)?;
        let write = async {
            let mut tx = target.begin().await.map_err(|e| Err(e.into()))?;
            let statements = match &accumulate {
                None => sql::upsert_statements(&table, layout.target_layout, &[payload.as_slice()], Read::Earlier)
                    .map_err(|(_, e)| Ok(e))?,
                Some((spec, transform)) => {
                    let mut deltas = Deltas::default();
                    deltas.add(transform.elements(&payload).map_err(Ok)?);
                    let summary = AccumulateMySql { table: &table, spec };
                    vec![summary.accumulate(&deltas.entries()).map_err(Ok)?]
                }
            };
            for statement in statements {
                sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| match dead_letters::as_row_error(&e) {
                        Some(row_error) => Ok(row_error),
                        None => Err(WriteError::Database(e)),
                    })?;
            }
            let resolved = sqlx::query(
                "UPDATE tidemark_dead_letters SET status = 'RESOLVED', claimed_by = NULL, claimed_at = NULL, \
                 updated_at = UTC_TIMESTAMP(6) WHERE task = ? AND `key` = ? AND status = 'PROCESSING' AND claimed_by = ?",
            )
            .bind(name)
            .bind(&key)
            .bind(&token)
            .execute(&mut *tx)
            .await
            .map_err(|e| Err(e.into()))?
            .rows_affected();
            if resolved != 1 {
                tx.rollback().await.map_err(|e| Err(e.into()))?;
                return Ok::<bool, Result<RowError, WriteError>>(false);
            }
            tx.commit().await.map_err(|e| Err(e.into()))?;
            Ok(true)
        };
        match write.await {
            Ok(true) => response.resolved += 1,
            Ok(false) => response.skipped += 1,
            Err(Ok(row_error)) => {
                let updated = sqlx::query(
                    "UPDATE tidemark_dead_letters SET retry_count = retry_count + 1, \
                     status = IF(retry_count >= ?, 'FAILED', 'RETRY'), error_class = ?, message = ?, \
                     claimed_by = NULL, claimed_at = NULL, updated_at = UTC_TIMESTAMP(6) \
                     WHERE task = ? AND `key` = ? AND claimed_by = ?",
                )
                .bind(max_retries)
                .bind(&row_error.class)
                .bind(&row_error.message)
                .bind(name)
                .bind(&key)
                .bind(&token)
                .execute(target)
                .await
                .map_err(target_error)?
                .rows_affected();
                if updated == 0 {
                    response.skipped += 1;
                    continue;
                }
                let status: String =
                    sqlx::query_scalar("SELECT status FROM tidemark_dead_letters WHERE task = ? AND `key` = ?")
                        .bind(name)
                        .bind(&key)
                        .fetch_one(target)
                        .await
                        .map_err(target_error)?;
                if status == "FAILED" {
                    response.failed += 1;
                } else {
                    response.retry += 1;
                }
            }
            Err(Err(error)) => {
                // Not the row's fault (the target is down, …): give the claim back untouched.
                let _ = sqlx::query(
                    "UPDATE tidemark_dead_letters SET status = 'RETRY', claimed_by = NULL, claimed_at = NULL \
                     WHERE task = ? AND `key` = ? AND claimed_by = ?",
                )
                .bind(name)
                .bind(&key)
                .bind(&token)
                .execute(target)
                .await;
                return Err(CoordinatorError::InvalidRequest(format!("target database: {error}")));
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

/// Deletes the task's RESOLVED letters resolved at least `older_than` ago (the target's
/// clock). Letters in any other status are rows not yet in the target: never purged.
pub async fn purge(target: &MySqlPool, task: &str, older_than: std::time::Duration) -> Result<u64, CoordinatorError> {
    Ok(sqlx::query(
        "DELETE FROM tidemark_dead_letters WHERE task = ? AND status = 'RESOLVED' \
         AND updated_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
    )
    .bind(task)
    .bind(older_than.as_micros() as i64)
    .execute(target)
    .await
    .map_err(target_error)?
    .rows_affected())
}

/// Marks letters RESOLVED by hand: the given keys (unless PROCESSING), or every FAILED one.
pub async fn resolve(
    target: &MySqlPool,
    task: &str,
    keys: &[String],
    all_failed: bool,
) -> Result<u64, CoordinatorError> {
    if keys.is_empty() && !all_failed {
        return Err(CoordinatorError::InvalidRequest(
            "name the keys to resolve, or pass --all-failed".into(),
        ));
    }
    let mut resolved = 0;
    if all_failed {
        resolved += sqlx::query(
            "UPDATE tidemark_dead_letters SET status = 'RESOLVED', updated_at = UTC_TIMESTAMP(6) \
             WHERE task = ? AND status = 'FAILED'",
        )
        .bind(task)
        .execute(target)
        .await
        .map_err(target_error)?
        .rows_affected();
    }
    for key in keys {
        resolved += sqlx::query(
            "UPDATE tidemark_dead_letters SET status = 'RESOLVED', updated_at = UTC_TIMESTAMP(6) \
             WHERE task = ? AND `key` = ? AND status <> 'PROCESSING'",
        )
        .bind(task)
        .bind(key)
        .execute(target)
        .await
        .map_err(target_error)?
        .rows_affected();
    }
    Ok(resolved)
}
