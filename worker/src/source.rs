//! Reading the source: one page per `COPY (SELECT … ORDER BY … LIMIT n) TO STDOUT`, streamed
//! into memory as the staged bytes, plus the position of the page's last row.

use bytes::{Bytes, BytesMut};
use futures::TryStreamExt;
use sqlx::postgres::PgPool;
use tidemark_common::copy_text;
use tidemark_common::cursor::KeyValue;
use tidemark_common::pg::{self, TableSql};

use crate::error::WorkerError;

/// One page as read: the COPY text bytes and where the last row sits.
pub struct Page {
    pub data: Bytes,
    pub row_count: u64,
    /// Key and cursor time (microseconds; absent without a cursor column) of the last row.
    pub last: Option<(Vec<KeyValue>, Option<i64>)>,
}

impl Page {
    /// Two pages in the same staged layout as one; `first_is_last`: the position is the first
    /// page's last row, else the second's.
    pub fn concat(first: Page, second: Page, first_is_last: bool) -> Page {
        let mut data = BytesMut::with_capacity(first.data.len() + second.data.len());
        data.extend_from_slice(&first.data);
        data.extend_from_slice(&second.data);
        Page {
            data: data.freeze(),
            row_count: first.row_count + second.row_count,
            last: if first_is_last { first.last } else { second.last },
        }
    }
}

/// Reads one page. `target_layout`: the rows carry only the target's columns (no cursor time).
pub async fn read_page(
    source: &PgPool,
    sql: &TableSql,
    statement: &str,
    target_layout: bool,
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
        Some(row) => Some(decode_position(sql, row, target_layout)?),
    };
    Ok(Page { data, row_count, last })
}

/// The key values and the version (cursor time) of a staged row.
fn decode_position(
    sql: &TableSql,
    row: &[u8],
    target_layout: bool,
) -> Result<(Vec<KeyValue>, Option<i64>), WorkerError> {
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
    let cursor_micros = match sql.cursor_micros_position().filter(|_| !target_layout) {
        None => None,
        Some(index) => {
            let text = field(index)?;
            Some(
                text.parse::<i64>()
                    .map_err(|_| WorkerError::Data(format!("cursor time {text:?} is not an integer")))?,
            )
        }
    };
    Ok((keys, cursor_micros))
}

/// The source's clock, in microseconds since the Unix epoch.
pub async fn source_now_micros(source: &PgPool) -> Result<i64, WorkerError> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(pg::source_now_query()))
        .fetch_one(source)
        .await?)
}

/// The start of the oldest transaction still open on the source, if any.
pub async fn oldest_open_transaction_micros(source: &PgPool) -> Result<Option<i64>, WorkerError> {
    Ok(sqlx::query_scalar(pg::OLDEST_OPEN_TRANSACTION)
        .fetch_one(source)
        .await?)
}

/// Whether this session can see every session's transaction start.
pub async fn can_see_all_transactions(source: &PgPool) -> Result<bool, WorkerError> {
    Ok(sqlx::query_scalar::<_, Option<bool>>(pg::CAN_SEE_ALL_TRANSACTIONS)
        .fetch_one(source)
        .await?
        .unwrap_or(false))
}
