//! Writing rows into a PostgreSQL target inside the caller's transaction: what a worker's
//! batch and a dead-letter retry run alike. The caller owns the transaction, the ledger row
//! and the dead letters; these functions only move rows.

use sqlx::PgConnection;

use super::accumulate::AccumulateSql;
use super::{Read, TableSql};
use crate::dead_letters::Layout;
use crate::transform::Deltas;

/// Copies a COPY stream (in `layout`) into the session's stage table and applies them with the
/// versioned upsert (and tombstones). `overlap = (floor, high)`: first report the lateness of
/// rows below the watermark that the target lacks. `read`: how recent the rows are as reads
/// (a batch's or a dead letter's; see [`Read`]). Returns the rows copied and the lateness.
pub async fn upsert_rows(
    conn: &mut PgConnection,
    sql: &TableSql,
    layout: Layout,
    data: &[u8],
    overlap: Option<(i64, i64)>,
    read: Read,
) -> Result<(u64, Vec<i64>), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(sql.create_stage_table()))
        .execute(&mut *conn)
        .await?;
    let mut copy = conn
        .copy_in_raw(&sql.copy_into_stage(layout.repair, layout.target_layout, layout.format))
        .await?;
    copy.send(data).await?;
    let copied = copy.finish().await?;
    let late = match overlap {
        Some((floor, high)) => {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.late_rows(floor, high)))
                .fetch_all(&mut *conn)
                .await?
        }
        None => Vec::new(),
    };
    for statement in sql.apply_statements(layout.repair, read) {
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&mut *conn).await?;
    }
    Ok((copied, late))
}

/// Empties the stage table between two writes of one transaction.
pub async fn clear_stage(conn: &mut PgConnection, sql: &TableSql) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {}", sql.stage_table())))
        .execute(conn)
        .await?;
    Ok(())
}

/// Adds a batch's deltas to the running totals (`count = count + delta`).
pub async fn accumulate(conn: &mut PgConnection, sql: &AccumulateSql<'_>, deltas: &Deltas) -> Result<(), sqlx::Error> {
    if deltas.is_empty() {
        return Ok(());
    }
    sqlx::query(sqlx::AssertSqlSafe(sql.create_delta_table()))
        .execute(&mut *conn)
        .await?;
    let mut copy = conn.copy_in_raw(&sql.copy_into_delta()).await?;
    copy.send(deltas.to_copy_text().as_slice()).await?;
    copy.finish().await?;
    sqlx::query(sqlx::AssertSqlSafe(sql.accumulate()))
        .execute(&mut *conn)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(sql.clear_delta()))
        .execute(&mut *conn)
        .await?;
    Ok(())
}
