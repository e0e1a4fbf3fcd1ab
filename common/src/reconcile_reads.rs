//! What reconciliation reads of each side of a task, whatever engine serves it: per bucket a
//! count and a hash sum, the first key's bounds, key quantiles, and a small range's `(key,
//! version, content)` rows. Each engine implements [`SideReads`] with its own statements
//! (`pg::reconcile`, `mysql::reconcile`) and returns plain values, so the worker's
//! reconciliation names no driver.

use std::collections::HashMap;

use crate::cursor::KeyValue;
use crate::pg::reconcile::Scope;

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The engine does not offer this comparison (the coordinator refuses such runs).
    #[error("{0}")]
    Unsupported(String),
}

/// A bucket's row count and hash sum, by bucket number.
pub type BucketSums = HashMap<i32, (i64, String)>;

/// A range's rows: key values (as text) → (version, content hash).
pub type KeyVersions = HashMap<Vec<String>, (i64, i64)>;

/// One side's reads.
#[async_trait::async_trait]
pub trait SideReads: Send + Sync {
    /// Count and hash sum per bucket of the first key split at `thresholds`.
    async fn bucket_sums(&self, scope: &Scope<'_>, thresholds: &[KeyValue]) -> Result<BucketSums, ReadError>;

    /// The first key's smallest and largest value in the scope, as text.
    async fn key_bounds(&self, scope: &Scope<'_>) -> Result<(Option<String>, Option<String>), ReadError>;

    /// Quantiles of the first key that split the scope into `parts` (non-integer keys).
    async fn key_quantiles(&self, scope: &Scope<'_>, parts: u32) -> Result<Option<Vec<String>>, ReadError>;

    /// The rows of a small range.
    async fn key_versions(&self, scope: &Scope<'_>) -> Result<KeyVersions, ReadError>;
}

/// How a column's value is rendered for a content hash that PostgreSQL and MySQL/MariaDB
/// compute alike (`Scope::portable` with `Scope::content`): one canonical text per kind of
/// the epoch's (PostgreSQL) type. Every engine's [`SideReads`] renders these kinds the same
/// way: integers and dates as their text, numerics without trailing fractional zeros, text
/// as its UTF-8 characters, booleans as `t`/`f`, times as microseconds since the Unix epoch,
/// bytes as lowercase hex; a NULL as `n`, any value as `v` and its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortableKind {
    Integer,
    Numeric,
    Text,
    Boolean,
    Micros,
    Date,
    Bytes,
}

/// The kind of a PostgreSQL type (as `format_type` prints it), or `None` for one no portable
/// content hash covers (JSON, floating point, arrays, intervals, …).
pub fn portable_kind(sql_type: &str) -> Option<PortableKind> {
    let base = match sql_type.split_once('(') {
        Some((head, rest)) => format!("{}{}", head.trim(), rest.split_once(')').map_or("", |(_, tail)| tail)),
        None => sql_type.trim().to_string(),
    };
    Some(match base.as_str() {
        "smallint" | "integer" | "bigint" => PortableKind::Integer,
        "numeric" => PortableKind::Numeric,
        "text" | "character varying" | "character" => PortableKind::Text,
        "boolean" => PortableKind::Boolean,
        "timestamp with time zone" | "timestamp without time zone" => PortableKind::Micros,
        "date" => PortableKind::Date,
        "bytea" => PortableKind::Bytes,
        _ => return None,
    })
}

/// The kinds of `columns` (name, type), or the first column no portable content hash covers,
/// named for the operator.
pub fn portable_kinds<'a>(columns: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Vec<PortableKind>, String> {
    columns
        .into_iter()
        .map(|(name, sql_type)| {
            portable_kind(sql_type).ok_or_else(|| {
                format!(
                    "column {name:?} ({sql_type}) has no content hash both engines compute alike (JSON, floating \
                     point, arrays, intervals and the like are not covered): compare versions \
                     (`--compare versions`, reconcile_compare = \"versions\")"
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_postgres_type() {
        assert_eq!(portable_kind("numeric(12,3)"), Some(PortableKind::Numeric));
        assert_eq!(portable_kind("numeric"), Some(PortableKind::Numeric));
        assert_eq!(portable_kind("character varying(200)"), Some(PortableKind::Text));
        assert_eq!(portable_kind("character(36)"), Some(PortableKind::Text));
        assert_eq!(portable_kind("timestamp(3) with time zone"), Some(PortableKind::Micros));
        assert_eq!(
            portable_kind("timestamp(6) without time zone"),
            Some(PortableKind::Micros)
        );
        assert_eq!(portable_kind("timestamp with time zone"), Some(PortableKind::Micros));
        assert_eq!(portable_kind("jsonb"), None);
        assert_eq!(portable_kind("double precision"), None);
        assert_eq!(portable_kind("integer[]"), None);
        let error = portable_kinds([("id", "bigint"), ("payload", "jsonb")]).unwrap_err();
        assert!(
            error.starts_with("column \"payload\" (jsonb) has no content hash"),
            "{error}"
        );
    }
}
