//! Reconciliation against a MySQL/MariaDB source: the statements of `pg::reconcile` with a
//! hash both engines compute the same way. Per row, the first 60 bits of
//! `MD5(key CHAR(31) version)` (the key and version as decimal text); per bucket the count and
//! the exact sum of those hashes. PostgreSQL computes the same on the target side
//! ([`crate::pg::reconcile::Scope::portable`]). Versions only (rendering every column's
//! content identically on both engines is not done), on a single integer key (buckets split
//! at integer thresholds compare the same on both engines; text collations do not).

use super::statements::MySqlStatements;
use super::{quote_ident, quote_literal};
use crate::cursor::KeyValue;
use crate::pg::TableSql;
use crate::pg::deletes::DeleteSource;
use crate::pg::reconcile::Scope;

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
    pub fn checksum_buckets(&self, sql: &TableSql, scope: &Scope<'_>, thresholds: &[KeyValue]) -> String {
        let key = Self::first_key(sql);
        let bucket = if thresholds.is_empty() {
            "0".to_string()
        } else {
            let values: Vec<&str> = thresholds.iter().map(|t| t.value.as_str()).collect();
            format!("INTERVAL({key}, {})", values.join(", "))
        };
        format!(
            "SELECT CAST({bucket} AS SIGNED) AS bucket, COUNT(*), CAST(COALESCE(SUM(CAST(CONV(SUBSTRING(MD5(CONCAT_WS({sep}, \
             CAST({key} AS CHAR), CAST({version} AS CHAR))), 1, 15), 16, 10) AS UNSIGNED)), 0) AS CHAR) FROM {}{} \
             GROUP BY 1 ORDER BY 1",
            self.table(),
            self.reconcile_where(sql, scope),
            sep = "CHAR(31 USING utf8mb4)",
            version = self.version_expr(sql),
        )
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

    /// Every `(key as text, version, 0)` of the scope.
    pub fn key_versions(&self, sql: &TableSql, scope: &Scope<'_>) -> String {
        format!(
            "SELECT CAST({} AS CHAR), CAST({} AS SIGNED), CAST(0 AS SIGNED) FROM {}{}",
            Self::first_key(sql),
            self.version_expr(sql),
            self.table(),
            self.reconcile_where(sql, scope)
        )
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
