//! Runs a read statement of [`super::MySqlStatements`] and writes its rows as a COPY stream:
//! every field is already text of the mapped type, so text only escapes it, and binary
//! encodes it in the mapped type's `send` form ([`crate::text_to_binary`]), which spares a
//! PostgreSQL target the parsing of every number, time and uuid. A cursor time comes as a UTC
//! date and time under [`MICROS_ALIAS`] and is turned into microseconds here, where the
//! server's `TIMESTAMPDIFF` cost more than the rest of the row's rendering.

use futures::TryStreamExt;
use sqlx::mysql::{MySqlPool, MySqlRow};
use sqlx::{Column, Row};

use super::statements::MICROS_ALIAS;

use crate::copy_binary;
use crate::copy_text::{NULL_FIELD, encode_bytes};
use crate::text_to_binary::{FieldEncoder, timestamp_micros};

/// The rows of `statement` as COPY text, and how many there are.
pub async fn copy_text(pool: &MySqlPool, statement: &str) -> Result<(Vec<u8>, u64), sqlx::Error> {
    read(pool, statement, |row, micros, out| {
        for index in 0..row.len() {
            if index > 0 {
                out.push(b'\t');
            }
            match field(row, micros, index)? {
                Field::Null => out.extend_from_slice(NULL_FIELD),
                Field::Text(bytes) => encode_bytes(bytes, out),
                Field::Micros(micros) => {
                    use std::io::Write;
                    write!(out, "{micros}").expect("writing to a Vec");
                }
            }
        }
        out.push(b'\n');
        Ok(Ok(()))
    })
    .await
    .map(|(out, count)| (out.expect("text takes every value"), count))
}

/// One value of a page row.
enum Field<'r> {
    Null,
    Text(&'r [u8]),
    /// A cursor time (a [`MICROS_ALIAS`] column) in microseconds since the Unix epoch.
    Micros(i64),
}

/// The Unix epoch in `timestamp_micros`' count (microseconds since 2000-01-01).
const UNIX_EPOCH_FROM_2000_MICROS: i64 = -946_684_800_000_000;

fn field<'r>(row: &'r MySqlRow, micros: &[bool], index: usize) -> Result<Field<'r>, sqlx::Error> {
    let value = row.try_get_unchecked::<Option<&[u8]>, _>(index)?;
    Ok(match value {
        None => Field::Null,
        // `TIMESTAMPDIFF`'s microseconds of the same date and time, and its NULL for a zero
        // date (or a zero month or day), which `timestamp_micros` refuses.
        Some(text) if micros[index] => match timestamp_micros(text) {
            Ok(since_2000) => Field::Micros(since_2000 - UNIX_EPOCH_FROM_2000_MICROS),
            Err(_) => Field::Null,
        },
        Some(text) => Field::Text(text),
    })
}

/// The rows of `statement` as binary COPY, each field encoded by its encoder; `Ok(Err(why))`
/// when a value has no exact binary form (the page is then to be read as text).
pub async fn copy_binary(
    pool: &MySqlPool,
    statement: &str,
    encoders: &[FieldEncoder],
) -> Result<(Result<Vec<u8>, String>, u64), sqlx::Error> {
    let (out, count) = read(pool, statement, |row, micros, out| {
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
            match field(row, micros, index)? {
                Field::Null => out.extend_from_slice(&(-1i32).to_be_bytes()),
                Field::Micros(micros) if *encoder == FieldEncoder::Int8 => {
                    out.extend_from_slice(&8i32.to_be_bytes());
                    out.extend_from_slice(&micros.to_be_bytes());
                }
                Field::Micros(_) => {
                    return Ok(Err(format!(
                        "field {index}: a cursor time where the layout has {encoder:?}"
                    )));
                }
                Field::Text(bytes) => {
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
/// `write` answers `Ok(Err(_))`. `write` is told which columns are cursor times to convert
/// (named [`MICROS_ALIAS`]).
async fn read(
    pool: &MySqlPool,
    statement: &str,
    mut write: impl FnMut(&MySqlRow, &[bool], &mut Vec<u8>) -> Result<Result<(), String>, sqlx::Error>,
) -> Result<(Result<Vec<u8>, String>, u64), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let mut rows = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string())).fetch(&mut *conn);
    let mut out = Vec::new();
    let mut count = 0u64;
    let mut micros: Option<Vec<bool>> = None;
    while let Some(row) = rows.try_next().await? {
        let micros = micros.get_or_insert_with(|| row.columns().iter().map(|c| c.name() == MICROS_ALIAS).collect());
        if let Err(why) = write(&row, micros, &mut out)? {
            return Ok((Err(why), count));
        }
        count += 1;
    }
    Ok((Ok(out), count))
}
