//! Which COPY format a shard reads its pages in, and the checks that keep a binary batch's
//! bytes in the types they were read as.
//!
//! Binary skips rendering and parsing every number, time and uuid as text on both databases,
//! but its bytes only mean something in the exact type that wrote them. So a shard reads binary
//! only when the source's live column types, the task's frozen ones and the target's are the
//! same built-in types. And the checks run again, after the fact: every page, in either format,
//! checks the source's columns against the epoch's (`WorkerError::SchemaChanged`: the page is
//! refused and the coordinator pauses the task), and every binary apply checks the target's
//! (`WorkerError::BinaryTypes`: the batch is abandoned and read again as text).

use tidemark_common::copy_binary;
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::pg::{ColumnTypes, TableSql};
use tidemark_common::source::SourcePool;

use crate::apply::TaskWrite;
use crate::error::WorkerError;
use tidemark_common::target::TargetPool;

/// `TIDEMARK_COPY_FORMAT=text` makes every shard read text (to compare, or to rule binary
/// out); unset or `auto`, the shard chooses.
const FORMAT_ENV: &str = "TIDEMARK_COPY_FORMAT";

/// The format this shard's pages are read in. Text when the column types cannot be read
/// (a database is unreachable): always correct, and the next run chooses again.
pub async fn choose(sql: &TableSql, write: &TaskWrite, source: &SourcePool, target: &TargetPool) -> CopyFormat {
    match choose_checked(sql, write, source, target).await {
        Ok(format) => format,
        Err(error) => {
            tracing::warn!(table = %sql.source, %error, "could not compare column types; reading pages as COPY text");
            CopyFormat::Text
        }
    }
}

async fn choose_checked(
    sql: &TableSql,
    write: &TaskWrite,
    source: &SourcePool,
    target: &TargetPool,
) -> Result<CopyFormat, WorkerError> {
    let text = |reason: &str| {
        tracing::info!(table = %sql.source, reason, "reading pages as COPY text");
        Ok(CopyFormat::Text)
    };
    match std::env::var(FORMAT_ENV).as_deref() {
        Ok("text") => return text("TIDEMARK_COPY_FORMAT=text"),
        Ok("auto") | Err(_) => {}
        Ok(other) => tracing::warn!(value = other, "TIDEMARK_COPY_FORMAT is `text` or `auto`; choosing"),
    }
    if !matches!(write, TaskWrite::Upsert) {
        return text("an accumulate task's transform reads text");
    }
    if !sql.key_types().iter().all(|t| copy_binary::decodable(t)) {
        return text("a key column's type has no binary decoder here");
    }
    let Some(source_types) = source.binary_column_types(&sql.source).await? else {
        return text("the source's engine renders its pages as COPY text");
    };
    if !sql.binary_types_match(&source_types, false) {
        return text("a source column's type differs from the task's, or is not built in");
    }
    let Some(target_types) = target.binary_column_types(&sql.target).await? else {
        return text("the target's engine takes its batches as COPY text");
    };
    if !sql.binary_types_match(&target_types, true) {
        return text("a target column's type differs from the source's");
    }
    tracing::info!(table = %sql.source, "reading pages as COPY binary");
    Ok(CopyFormat::Binary)
}

/// After a page was read (in either format): the source's columns still have the types of
/// the task's epoch, or the page is refused with `SchemaChanged` (the coordinator pauses the
/// task with `schema changed`). A binary page also needs them built in. Checked after the
/// read, a change can only make a page fail, never pass one of other types.
pub fn check_source(types: &ColumnTypes, sql: &TableSql, format: CopyFormat) -> Result<(), WorkerError> {
    if !sql.columns_match(types) {
        return Err(WorkerError::SchemaChanged(format!(
            "page refused: a column of {} was dropped, renamed or changed its type since the epoch was planned",
            sql.source
        )));
    }
    if format == CopyFormat::Binary && !sql.binary_types_match(types, false) {
        return Err(WorkerError::BinaryTypes(format!(
            "a column of {} is no longer of a built-in type",
            sql.source
        )));
    }
    Ok(())
}

/// Inside a binary batch's transaction, after its rows were written (so that no type change
/// can come between this check and the writes): the target's columns have the batch's types.
/// Also before a binary batch's rows are isolated: a target column whose type changed rejects
/// every row, which is no row's fault.
pub fn check_target(types: &ColumnTypes, sql: &TableSql) -> Result<(), WorkerError> {
    if sql.binary_types_match(types, true) {
        return Ok(());
    }
    Err(WorkerError::BinaryTypes(format!(
        "a column of {} no longer has the type the binary pages were read in",
        sql.target
    )))
}
