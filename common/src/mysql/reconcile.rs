//! Reconciliation against a MySQL/MariaDB source: the statements of `pg::reconcile` with a
//! hash both engines compute the same way. Per row, the first 60 bits of
//! `MD5(key CHAR(31) version)` (the key and version as decimal text), and with content every
//! column's canonical text after them (see [`crate::reconcile_reads::PortableKind`]); per
//! bucket the count and the exact sum of those hashes. PostgreSQL computes the same on its
//! side ([`crate::pg::reconcile::Scope::portable`]). On a single integer key (buckets split at
//! integer thresholds compare the same on both engines; text collations do not).

use super::statements::MySqlStatements;
use super::{quote_ident, quote_literal};
use crate::cursor::KeyValue;
use crate::pg::TableSql;
use crate::pg::deletes::DeleteSource;
use crate::pg::reconcile::Scope;
use crate::reconcile_reads::{PortableKind, portable_kinds};

/// The separator of the hashed parts, as PostgreSQL's `chr(31)`.
const SEPARATOR: &str = "CHAR(31 USING utf8mb4)";

/// Every task column of a MySQL/MariaDB table (a source's, or a target's mapped from the
/// epoch's types) rendered for the content hash PostgreSQL computes alike; an error names a
/// column none covers.
fn portable_content(sql: &TableSql) -> Result<Vec<String>, String> {
    let kinds = portable_kinds(sql.columns.iter().map(|c| (c.name.as_str(), c.sql_type.as_str())))?;
    Ok(sql
        .columns
        .iter()
        .zip(kinds)
        .map(|(column, kind)| {
            let c = quote_ident(&column.name);
            let text = match kind {
                PortableKind::Integer | PortableKind::Date => format!("CAST({c} AS CHAR)"),
                PortableKind::Numeric => format!(
                    "IF(LOCATE('.', CAST({c} AS CHAR)) > 0, TRIM(TRAILING '.' FROM TRIM(TRAILING '0' FROM \
                     CAST({c} AS CHAR))), CAST({c} AS CHAR))"
                ),
                PortableKind::Text => format!("CONVERT({c} USING utf8mb4)"),
                PortableKind::Boolean => format!("CASE {c} WHEN 0 THEN 'f' WHEN 1 THEN 't' ELSE CAST({c} AS CHAR) END"),
                PortableKind::Micros => {
                    format!("CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {c}) AS CHAR)")
                }
                PortableKind::Bytes => format!("LOWER(HEX({c}))"),
            };
            format!("COALESCE(CONCAT('v', {text}), 'n')")
        })
        .collect())
}

/// The hashed parts of a row: key and version, then (with content) every column.
fn hashed_parts(scope: &Scope<'_>, sql: &TableSql, key: &str, version: &str) -> Result<String, String> {
    let mut parts = vec![format!("CAST({key} AS CHAR)"), format!("CAST({version} AS CHAR)")];
    if scope.content {
        parts.extend(portable_content(sql)?);
    }
    Ok(parts.join(", "))
}

/// A row's content hash, as PostgreSQL's side computes it (0 when versions only).
fn content_hash(scope: &Scope<'_>, sql: &TableSql) -> Result<String, String> {
    Ok(if scope.content {
        format!(
            "CAST(CONV(SUBSTRING(MD5(CONCAT_WS({SEPARATOR}, {})), 1, 15), 16, 10) AS SIGNED)",
            portable_content(sql)?.join(", ")
        )
    } else {
        "CAST(0 AS SIGNED)".to_string()
    })
}

impl MySqlStatements {
    fn first_key(sql: &TableSql) -> String {
        quote_ident(&sql.key_columns[0])
    }

    /// The scope's live source rows.
    fn reconcile_where(&self, sql: &TableSql, scope: &Scope<'_>) -> String {
        let mut conditions = self.range_condition(sql, scope.range);
        if let (Some(since), Some(cursor)) = (scope.since_micros, &sql.cursor_column) {
            conditions.push(format!(
                "{} >= {}",
                quote_ident(cursor),
                self.cursor_literal(sql, since)
            ));
        }
        if let Some(DeleteSource::Flag(flag)) = sql.deletes.as_ref().map(|d| &d.source) {
            let c = quote_ident(flag);
            conditions.push(if self.column(flag).column_type == "tinyint(1)" {
                format!("COALESCE({c}, 0) = 0")
            } else {
                format!("{c} IS NULL")
            });
        }
        if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        }
    }

    /// `bucket, count, sum of row hashes` per bucket of the first key split at `thresholds`
    /// (`INTERVAL` numbers buckets as PostgreSQL's `width_bucket` does).
    pub fn checksum_buckets(
        &self,
        sql: &TableSql,
        scope: &Scope<'_>,
        thresholds: &[KeyValue],
    ) -> Result<String, String> {
        let key = Self::first_key(sql);
        let bucket = if thresholds.is_empty() {
            "0".to_string()
        } else {
            let values: Vec<&str> = thresholds.iter().map(|t| t.value.as_str()).collect();
            format!("INTERVAL({key}, {})", values.join(", "))
        };
        Ok(format!(
            "SELECT CAST({bucket} AS SIGNED) AS bucket, COUNT(*), CAST(COALESCE(SUM(CAST(CONV(SUBSTRING(MD5(CONCAT_WS(\
             {SEPARATOR}, {parts})), 1, 15), 16, 10) AS UNSIGNED)), 0) AS CHAR) FROM {}{} GROUP BY 1 ORDER BY 1",
            self.table(),
            self.reconcile_where(sql, scope),
            parts = hashed_parts(scope, sql, &key, &self.version_expr(sql))?,
        ))
    }

    /// The smallest and largest first-key value of the scope, as text.
    pub fn key_bounds(&self, sql: &TableSql, scope: &Scope<'_>) -> String {
        let key = Self::first_key(sql);
        format!(
            "SELECT CAST(MIN({key}) AS CHAR), CAST(MAX({key}) AS CHAR) FROM {}{}",
            self.table(),
            self.reconcile_where(sql, scope)
        )
    }

    /// Every `(key as text, version, content hash)` of the scope.
    pub fn key_versions(&self, sql: &TableSql, scope: &Scope<'_>) -> Result<String, String> {
        Ok(format!(
            "SELECT CAST({} AS CHAR), CAST({} AS SIGNED), {} FROM {}{}",
            Self::first_key(sql),
            self.version_expr(sql),
            content_hash(scope, sql)?,
            self.table(),
            self.reconcile_where(sql, scope)
        ))
    }

    /// The source rows with these keys, in the staged layout.
    pub fn rows_by_key(&self, sql: &TableSql, keys: &[Vec<KeyValue>]) -> String {
        let first = &sql.key_columns[0];
        let values: Vec<String> = keys
            .iter()
            .filter_map(|key| key.first())
            .map(|k| self.key_literal(k, first))
            .collect();
        let values = if values.is_empty() {
            quote_literal("")
        } else {
            values.join(", ")
        };
        format!(
            "SELECT {} FROM {} WHERE {} IN ({values})",
            self.list(sql, false),
            self.table(),
            quote_ident(first)
        )
    }
}

/// Reconciliation statements on a MySQL/MariaDB *target*: the task's table in the target,
/// its `_tidemark_version`, the same portable hash as the source side (either engine's), and
/// without the rows a soft target flags deleted. A single integer key, like the source side.
pub struct TargetStatements<'a> {
    pub sql: &'a TableSql,
}

impl TargetStatements<'_> {
    fn table(&self) -> String {
        super::target::quoted_table(&self.sql.target)
    }

    fn key(&self) -> String {
        quote_ident(&self.sql.key_columns[0])
    }

    fn version(&self) -> String {
        quote_ident(crate::pg::VERSION_COLUMN)
    }

    /// The scope's live target rows. A window (`since_micros`) needs a cursor whose target
    /// values are UTC times (`timestamp with time zone`, or a naive cursor read in UTC).
    fn where_clause(&self, scope: &Scope<'_>) -> Result<String, String> {
        let key = self.key();
        let integer = |k: &KeyValue| -> Result<i128, String> {
            k.value
                .parse::<i128>()
                .map_err(|_| format!("reconciling a MySQL target needs an integer key, not {:?}", k.value))
        };
        let mut conditions = Vec::new();
        if let Some(lo) = &scope.range.lo {
            conditions.push(format!("{key} >= {}", integer(lo)?));
        }
        if let Some(hi) = &scope.range.hi {
            conditions.push(format!("{key} < {}", integer(hi)?));
        }
        if let (Some(since), Some(cursor)) = (scope.since_micros, &self.sql.cursor_column) {
            let with_zone = self
                .sql
                .columns
                .iter()
                .any(|c| &c.name == cursor && c.sql_type.contains("with time zone"));
            let utc = self
                .sql
                .cursor_zone
                .as_deref()
                .is_none_or(|z| z == "UTC" || z == "+00:00");
            if !with_zone && !utc {
                return Err(format!(
                    "a windowed reconciliation on a MySQL target compares cursor times in UTC, and {cursor:?} is \
                     written in {}: run a full one",
                    self.sql.cursor_zone.as_deref().unwrap_or("?")
                ));
            }
            let at = chrono::DateTime::from_timestamp_micros(since)
                .ok_or_else(|| format!("cursor time {since} is out of range"))?
                .naive_utc()
                .format("%Y-%m-%d %H:%M:%S%.6f");
            conditions.push(format!("{} >= '{at}'", quote_ident(cursor)));
        }
        if self.sql.deletes.as_ref().is_some_and(|d| d.target_soft) {
            conditions.push(format!("{} = 0", quote_ident(crate::pg::DELETED_COLUMN)));
        }
        Ok(if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        })
    }

    /// `bucket, count, sum of row hashes` per bucket split at `thresholds`, as the source
    /// side computes it (see [`MySqlStatements::checksum_buckets`]).
    pub fn checksum_buckets(&self, scope: &Scope<'_>, thresholds: &[KeyValue]) -> Result<String, String> {
        let key = self.key();
        let bucket = if thresholds.is_empty() {
            "0".to_string()
        } else {
            let values: Vec<&str> = thresholds.iter().map(|t| t.value.as_str()).collect();
            format!("INTERVAL({key}, {})", values.join(", "))
        };
        Ok(format!(
            "SELECT CAST({bucket} AS SIGNED) AS bucket, CAST(COUNT(*) AS SIGNED), \
             CAST(COALESCE(SUM(CAST(CONV(SUBSTRING(MD5(CONCAT_WS({SEPARATOR}, {parts})), 1, 15), 16, 10) AS UNSIGNED)), \
             0) AS CHAR) FROM {table}{filter} GROUP BY 1 ORDER BY 1",
            parts = hashed_parts(scope, self.sql, &key, &self.version())?,
            table = self.table(),
            filter = self.where_clause(scope)?,
        ))
    }

    pub fn key_bounds(&self, scope: &Scope<'_>) -> Result<String, String> {
        let key = self.key();
        Ok(format!(
            "SELECT CAST(MIN({key}) AS CHAR), CAST(MAX({key}) AS CHAR) FROM {}{}",
            self.table(),
            self.where_clause(scope)?
        ))
    }

    /// Every `(key as text, version, content hash)` of the scope.
    pub fn key_versions(&self, scope: &Scope<'_>) -> Result<String, String> {
        Ok(format!(
            "SELECT CAST({} AS CHAR), CAST({} AS SIGNED), {} FROM {}{}",
            self.key(),
            self.version(),
            content_hash(scope, self.sql)?,
            self.table(),
            self.where_clause(scope)?
        ))
    }
}
