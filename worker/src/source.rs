//! Reading the source: one page per `COPY (SELECT … ORDER BY … LIMIT n) TO STDOUT`, streamed
//! into memory as the staged bytes, plus the position of the page's last row.

use bytes::{Bytes, BytesMut};
use futures::TryStreamExt;
use sqlx::postgres::PgPool;
use tidemark_common::copy_text;
use tidemark_common::cursor::KeyValue;
use tidemark_common::pg::TableSql;

use crate::error::WorkerError;

/// One page as read: the COPY text bytes and where the last row sits.
pub struct Page {
    pub data: Bytes,
    pub row_count: u64,
    /// Key and cursor time (microseconds) of the last row, when the page has rows.
    pub last: Option<(Vec<KeyValue>, i64)>,
}

pub async fn read_page(
    source: &PgPool,
    sql: &TableSql,
    statement: &str,
) -> Result<Page, WorkerError> {
    let mut conn = source.acquire().await?;
    let mut stream = conn.copy_out_raw(statement).await?;
    let mut buffer = BytesMut::new();
    while let Some(chunk) = stream.try_next().await? {
        buffer.extend_from_slice(&chunk);
    }
    drop(stream);
    let data = buffer.freeze();
    let mut row_count = 0u64;
    let mut last_row: Option<&[u8]> = None;
    for row in copy_text::rows(&data) {
        row_count += 1;
        last_row = Some(row);
    }
    let last = match last_row {
        None => None,
        Some(row) => Some(decode_position(sql, row)?),
    };
    Ok(Page {
        data,
        row_count,
        last,
    })
}

/// The key values and the version (cursor time) of a staged row.
fn decode_position(sql: &TableSql, row: &[u8]) -> Result<(Vec<KeyValue>, i64), WorkerError> {
    let field = |index: usize| -> Result<String, WorkerError> {
        let raw = copy_text::raw_field(row, index)
            .ok_or_else(|| WorkerError::Data(format!("staged row has no field {index}")))?;
        copy_text::decode_field(raw)
            .map_err(WorkerError::Data)?
            .ok_or_else(|| WorkerError::Data(format!("field {index} of a staged row is NULL")))
    };
    let keys = sql
        .key_positions()
        .into_iter()
        .zip(sql.key_types())
        .map(|(index, sql_type)| {
            Ok(KeyValue {
                sql_type,
                value: field(index)?,
            })
        })
        .collect::<Result<Vec<_>, WorkerError>>()?;
    let version_text = field(sql.columns.len())?;
    let version = version_text
        .parse::<i64>()
        .map_err(|_| WorkerError::Data(format!("version {version_text:?} is not an integer")))?;
    Ok((keys, version))
}

/// The source's clock, in microseconds since the Unix epoch.
pub async fn source_now_micros(source: &PgPool) -> Result<i64, WorkerError> {
    Ok(
        sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
            .fetch_one(source)
            .await?,
    )
}
