//! Applying a batch to the target: ONE transaction that copies the staged rows into a
//! session-local table, applies its tombstones and upserts its rows guarded by version (see
//! `TableSql::apply_statements`), and writes the ledger row. A batch already in the ledger is
//! not applied again.

use bytes::Bytes;
use sqlx::Row;
use sqlx::postgres::PgPool;
use tidemark_common::batch::Manifest;
use tidemark_common::pg::TableSql;

use crate::error::WorkerError;

#[derive(Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    Applied,
    /// The ledger already held this batch (a replay after a crash, or a concurrent owner).
    AlreadyApplied,
}

/// The overlap region of an incremental batch: rows below `floor_micros` were re-read by the
/// overlap, and those the target lacks at their version are late (lateness measured against
/// the cycle's `high_micros`).
#[derive(Debug, Clone, Copy)]
pub struct OverlapRegion {
    pub floor_micros: i64,
    pub high_micros: i64,
}

/// Applies a batch; returns the outcome and the lateness of each late row it brought in.
pub async fn apply_batch(
    target: &PgPool,
    sql: &TableSql,
    manifest: &Manifest,
    data: &Bytes,
    overlap: Option<OverlapRegion>,
) -> Result<(ApplyOutcome, Vec<i64>), WorkerError> {
    match apply_once(target, sql, manifest, data, overlap).await {
        Ok(outcome) => {
            crate::metrics::step("verify", verify(target, manifest)).await?;
            Ok(outcome)
        }
        Err(error) => {
            // The outcome of a failed COMMIT is unknown: the ledger is the one answer.
            if verify(target, manifest).await.is_ok() {
                tracing::warn!(batch_id = %manifest.batch_id, %error, "apply reported an error but the ledger holds the batch");
                return Ok((ApplyOutcome::AlreadyApplied, Vec::new()));
            }
            Err(error)
        }
    }
}

async fn apply_once(
    target: &PgPool,
    sql: &TableSql,
    manifest: &Manifest,
    data: &Bytes,
    overlap: Option<OverlapRegion>,
) -> Result<(ApplyOutcome, Vec<i64>), WorkerError> {
    let mut tx = target.begin().await?;
    let applied = sqlx::query("SELECT 1 FROM tidemark_ledger WHERE batch_id = $1")
        .bind(&manifest.batch_id)
        .fetch_optional(&mut *tx)
        .await?;
    if applied.is_some() {
        tx.rollback().await?;
        return Ok((ApplyOutcome::AlreadyApplied, Vec::new()));
    }
    if manifest.target_layout && copy_straight_into_target(&mut tx, sql, manifest, data).await? {
        return finish(tx, manifest, Vec::new()).await;
    }
    sqlx::query(sqlx::AssertSqlSafe(sql.create_stage_table()))
        .execute(&mut *tx)
        .await?;
    let mut copy = tx
        .copy_in_raw(&sql.copy_into_stage(manifest.repair, manifest.target_layout))
        .await?;
    copy.send(data.as_ref()).await?;
    let copied = copy.finish().await?;
    check_count(manifest, copied)?;
    let late = match overlap {
        Some(region) => {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(
                sql.late_rows(region.floor_micros, region.high_micros),
            ))
            .fetch_all(&mut *tx)
            .await?
        }
        None => Vec::new(),
    };
    for statement in sql.apply_statements(manifest.repair) {
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&mut *tx).await?;
    }
    finish(tx, manifest, late).await
}

fn check_count(manifest: &Manifest, copied: u64) -> Result<(), WorkerError> {
    if copied != manifest.row_count {
        return Err(WorkerError::Data(format!(
            "batch {}: copied {copied} rows, manifest says {}",
            manifest.batch_id, manifest.row_count
        )));
    }
    Ok(())
}

/// The snapshot's fast path: the rows go straight into the target table by COPY. It works
/// when the target holds none of their keys (a fresh table); a key it already holds fails the
/// primary key, and the savepoint falls back to the versioned upsert through the stage table.
async fn copy_straight_into_target(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    sql: &TableSql,
    manifest: &Manifest,
    data: &Bytes,
) -> Result<bool, WorkerError> {
    sqlx::query("SAVEPOINT tidemark_direct").execute(&mut **tx).await?;
    let attempt = async {
        let mut copy = tx.copy_in_raw(&sql.copy_into_target()).await?;
        copy.send(data.as_ref()).await?;
        copy.finish().await
    }
    .await;
    match attempt {
        Ok(copied) => {
            check_count(manifest, copied)?;
            Ok(true)
        }
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("23505") => {
            sqlx::query("ROLLBACK TO SAVEPOINT tidemark_direct")
                .execute(&mut **tx)
                .await?;
            Ok(false)
        }
        Err(error) => Err(error.into()),
    }
}

/// Writes the ledger row and commits (or yields to a concurrent owner that applied it).
async fn finish(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    manifest: &Manifest,
    late: Vec<i64>,
) -> Result<(ApplyOutcome, Vec<i64>), WorkerError> {
    let inserted = sqlx::query(
        "INSERT INTO tidemark_ledger (batch_id, task, epoch, shard_id, row_count, content_hash, fence) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (batch_id) DO NOTHING",
    )
    .bind(&manifest.batch_id)
    .bind(&manifest.task)
    .bind(manifest.epoch as i64)
    .bind(manifest.shard_id as i32)
    .bind(manifest.row_count as i64)
    .bind(&manifest.content_hash)
    .bind(manifest.fence_token as i64)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tidemark_common::crash::point("in_apply");
    // A zombie frozen here holds row locks in an open transaction; the session's
    // idle_in_transaction_session_timeout (half the lease TTL) ends it for the next owner.
    tidemark_common::crash::stop_point("in_apply");
    if inserted == 0 {
        // Another owner applied it concurrently; its transaction won.
        tx.rollback().await?;
        return Ok((ApplyOutcome::AlreadyApplied, Vec::new()));
    }
    tx.commit().await?;
    Ok((ApplyOutcome::Applied, late))
}

/// The ledger holds the batch with the manifest's row count and content.
async fn verify(target: &PgPool, manifest: &Manifest) -> Result<(), WorkerError> {
    let row = sqlx::query("SELECT row_count, content_hash FROM tidemark_ledger WHERE batch_id = $1")
        .bind(&manifest.batch_id)
        .fetch_optional(target)
        .await?
        .ok_or_else(|| WorkerError::Verify(format!("batch {} is not in the ledger", manifest.batch_id)))?;
    let row_count: i64 = row.get(0);
    let content_hash: String = row.get(1);
    if row_count as u64 != manifest.row_count || content_hash != manifest.content_hash {
        return Err(WorkerError::Verify(format!(
            "ledger has batch {} with {row_count} rows / {content_hash}, manifest says {} / {}",
            manifest.batch_id, manifest.row_count, manifest.content_hash
        )));
    }
    Ok(())
}

/// Whether the target's ledger holds `batch_id` with this content: the batch was applied.
pub async fn ledger_holds(target: &PgPool, batch_id: &str, content_hash: &str) -> Result<bool, WorkerError> {
    let stored: Option<String> = sqlx::query_scalar("SELECT content_hash FROM tidemark_ledger WHERE batch_id = $1")
        .bind(batch_id)
        .fetch_optional(target)
        .await?;
    Ok(stored.as_deref() == Some(content_hash))
}
