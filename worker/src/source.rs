//! Reading the source: one page per statement (`COPY (SELECT … ORDER BY … LIMIT n) TO STDOUT`
//! on PostgreSQL, text or binary; a SELECT rendering COPY text on MySQL), read into memory as
//! the staged bytes, plus the position of the page's last row.

use bytes::Bytes;
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::cursor::KeyValue;
use tidemark_common::pg::TableSql;
use tidemark_common::source::{PageRequest, SourcePool};

use crate::error::WorkerError;

/// One page as read: the COPY bytes and where the last row sits.
pub struct Page {
    pub data: Bytes,
    pub format: CopyFormat,
    pub row_count: u64,
    /// Key and cursor time (microseconds; absent without a cursor column) of the last row.
    pub last: Option<(Vec<KeyValue>, Option<i64>)>,
}

impl Page {
    /// Two pages in the same staged layout and format as one; `first_is_last`: the position
    /// is the first page's last row, else the second's.
    pub fn concat(first: Page, second: Page, first_is_last: bool) -> Result<Page, WorkerError> {
        if first.format != second.format {
            return Err(WorkerError::Data("two pages of different COPY formats".into()));
        }
        let data = first
            .format
            .concat(&first.data, &second.data)
            .map_err(WorkerError::Data)?;
        Ok(Page {
            data: Bytes::from(data),
            format: first.format,
            row_count: first.row_count + second.row_count,
            last: if first_is_last { first.last } else { second.last },
        })
    }
}

/// Reads one page in `format`, or in text where the source answers a page in text (a value
/// without an exact binary form). `target_layout`: the rows carry only the target's columns
/// (no cursor time).
pub async fn read_page(
    source: &SourcePool,
    sql: &TableSql,
    statement: &str,
    format: CopyFormat,
    target_layout: bool,
) -> Result<Page, WorkerError> {
    let field_types: Vec<String> = sql
        .payload_columns(false, target_layout)
        .into_iter()
        .map(|(_, sql_type)| sql_type)
        .collect();
    let page = source
        .read_copy(
            statement,
            &sql.source,
            PageRequest {
                format,
                field_types: &field_types,
            },
        )
        .await?;
    if let Some(types) = &page.types {
        crate::page_format::check_source(types, sql, page.format)?;
    }
    let rows = page.format.rows(&page.data).map_err(WorkerError::Data)?;
    let last = match rows.last() {
        None => None,
        Some(row) => Some(decode_position(sql, page.format, row, target_layout)?),
    };
    Ok(Page {
        row_count: rows.len() as u64,
        data: page.data,
        format: page.format,
        last,
    })
}

/// The key values and the version (cursor time) of a staged row.
fn decode_position(
    sql: &TableSql,
    format: CopyFormat,
    row: &[u8],
    target_layout: bool,
) -> Result<(Vec<KeyValue>, Option<i64>), WorkerError> {
    let null = |index: usize| WorkerError::Data(format!("field {index} of a staged row is NULL"));
    let keys = sql
        .key_positions()
        .into_iter()
        .zip(sql.key_types())
        .map(|(index, sql_type)| {
            let value = format
                .field_text(row, index, &sql_type)
                .map_err(WorkerError::Data)?
                .ok_or_else(|| null(index))?;
            Ok(KeyValue { sql_type, value })
        })
        .collect::<Result<Vec<_>, WorkerError>>()?;
    let cursor_micros = match sql.cursor_micros_position().filter(|_| !target_layout) {
        None => None,
        Some(index) => Some(
            format
                .field_i64(row, index)
                .map_err(WorkerError::Data)?
                .ok_or_else(|| null(index))?,
        ),
    };
    Ok((keys, cursor_micros))
}

/// The source's clock, in microseconds since the Unix epoch.
pub async fn source_now_micros(source: &SourcePool) -> Result<i64, WorkerError> {
    Ok(source.now_micros().await?)
}
