//! Runs a read statement of [`super::MySqlStatements`] and writes its rows as a COPY text
//! stream: every field is already text of the mapped type, so this only escapes it.

use futures::TryStreamExt;
use sqlx::Row;
use sqlx::mysql::MySqlPool;

use crate::copy_text::{NULL_FIELD, encode_bytes};

/// The rows of `statement` as COPY text, and how many there are.
pub async fn copy_text(pool: &MySqlPool, statement: &str) -> Result<(Vec<u8>, u64), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let mut rows = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).fetch(&mut *conn);
    let mut out = Vec::new();
    let mut count = 0u64;
    while let Some(row) = rows.try_next().await? {
        for index in 0..row.len() {
            if index > 0 {
                out.push(b'\t');
            }
            match row.try_get_unchecked::<Option<&[u8]>, _>(index)? {
                None => out.extend_from_slice(NULL_FIELD),
                Some(bytes) => encode_bytes(bytes, &mut out),
            }
        }
        out.push(b'\n');
        count += 1;
    }
    Ok((out, count))
}
