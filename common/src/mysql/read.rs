//! Runs a read statement of [`super::MySqlStatements`] and writes its rows as a COPY stream:
//! every field is already text of the mapped type, so text only escapes it, and binary
//! encodes it in the mapped type's `send` form ([`crate::text_to_binary`]), which spares a
//! PostgreSQL target the parsing of every number, time and uuid.

use futures::TryStreamExt;
use sqlx::Row;
use sqlx::mysql::{MySqlPool, MySqlRow};

use crate::copy_binary;
use crate::copy_text::{NULL_FIELD, encode_bytes};
use crate::text_to_binary::FieldEncoder;

/// The rows of `statement` as COPY text, and how many there are.
pub async fn copy_text(pool: &MySqlPool, statement: &str) -> Result<(Vec<u8>, u64), sqlx::Error> {
    read(pool, statement, |row, out| {
        for index in 0..row.len() {
            if index > 0 {
                out.push(b'\t');
            }
            match row.try_get_unchecked::<Option<&[u8]>, _>(index)? {
                None => out.extend_from_slice(NULL_FIELD),
                Some(bytes) => encode_bytes(bytes, out),
            }
        }
        out.push(b'\n');
        Ok(Ok(()))
    })
    .await
    .map(|(out, count)| (out.expect("text takes every value"), count))
}

/// The rows of `statement` as binary COPY, each field encoded by its encoder; `Ok(Err(why))`
/// when a value has no exact binary form (the page is then to be read as text).
pub async fn copy_binary(
    pool: &MySqlPool,
    statement: &str,
    encoders: &[FieldEncoder],
) -> Result<(Result<Vec<u8>, String>, u64), sqlx::Error> {
    let (out, count) = read(pool, statement, |row, out| {
        if row.len() != encoders.len() {
            return Ok(Err(format!(
                "a page row has {} fields where its layout has {}",
                row.len(),
                encoders.len()
            )));
        }
        if out.is_empty() {
            out.extend_from_slice(&copy_binary::HEADER);
        }
        out.extend_from_slice(&(encoders.len() as i16).to_be_bytes());
        for (index, encoder) in encoders.iter().enumerate() {
            match row.try_get_unchecked::<Option<&[u8]>, _>(index)? {
                None => out.extend_from_slice(&(-1i32).to_be_bytes()),
                Some(bytes) => {
                    if let Err(why) = encoder.encode(bytes, out) {
                        return Ok(Err(format!("field {index}: {why}")));
                    }
                }
            }
        }
        Ok(Ok(()))
    })
    .await?;
    // A page of no rows is an empty stream, as in text (see `copy_binary::rows`).
    Ok((
        out.map(|mut out| {
            if !out.is_empty() {
                out.extend_from_slice(&copy_binary::TRAILER);
            }
            out
        }),
        count,
    ))
}

/// Streams the statement's rows through `write` into one buffer; stops at the first row that
/// `write` answers `Ok(Err(_))`.
async fn read(
    pool: &MySqlPool,
    statement: &str,
    mut write: impl FnMut(&MySqlRow, &mut Vec<u8>) -> Result<Result<(), String>, sqlx::Error>,
) -> Result<(Result<Vec<u8>, String>, u64), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let mut rows = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).fetch(&mut *conn);
    let mut out = Vec::new();
    let mut count = 0u64;
    while let Some(row) = rows.try_next().await? {
        if let Err(why) = write(&row, &mut out)? {
            return Ok((Err(why), count));
        }
        count += 1;
    }
    Ok((Ok(out), count))
}
