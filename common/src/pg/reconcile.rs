//! Reconciliation SQL: each side computes, inside its own database, a count and an aggregate
//! hash of `(key, version)` per key range, bucketed by thresholds on the first key column, so
//! that only ranges that differ are split further and only small ranges are read row by row.

use super::{DELETED_COLUMN, KeyValue, ShardRange, TableSql, VERSION_COLUMN, key_literal, quote_ident};
use crate::reconcile_reads::{PortableKind, portable_kinds};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Target,
}

/// What a comparison covers: a key range and, for a windowed run, rows whose cursor time is
/// at or after `since_micros` on both sides.
#[derive(Debug, Clone)]
pub struct Scope<'a> {
    pub range: &'a ShardRange,
    pub since_micros: Option<i64>,
    /// Compare every column's content besides the version (drift at an equal version: a
    /// target row edited by hand, a backfill that kept the cursor, a corrupted value).
    pub content: bool,
    /// Hash `(key, version)` the way another engine's source computes it too (see
    /// `mysql::reconcile`): the first 60 bits of `md5(key chr(31) version)`. Versions only.
    pub portable: bool,
}

impl TableSql {
    fn side_table(&self, side: Side) -> String {
        match side {
            Side::Source => self.source.quoted(),
            Side::Target => self.target.quoted(),
        }
    }

    fn side_version(&self, side: Side) -> String {
        match side {
            Side::Source => self.version_expr(),
            Side::Target => quote_ident(VERSION_COLUMN),
        }
    }

    /// The live rows of the scope on one side.
    fn side_where(&self, side: Side, scope: &Scope<'_>) -> String {
        let mut conditions = self.range_condition(scope.range);
        if let (Some(since), Some(_)) = (scope.since_micros, &self.cursor_column) {
            conditions.push(format!("{} >= {}", self.cursor(), self.cursor_time_literal(since)));
        }
        match (side, &self.deletes) {
            (Side::Source, Some(deletes)) => conditions.extend(deletes.live_row_filter(&self.columns)),
            (Side::Target, Some(deletes)) if deletes.target_soft => {
                conditions.push(format!("NOT {}", quote_ident(DELETED_COLUMN)));
            }
            _ => {}
        }
        if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        }
    }

    /// Every task column as text, in one value: `ROW(c1::t1, …)::text`, cast to the frozen
    /// source types on both sides (so a target column of another type compares by value),
    /// rendered under the sessions' pinned settings (see `SESSION_SETTINGS`).
    fn row_text(&self) -> String {
        let columns: Vec<String> = self
            .columns
            .iter()
            .map(|c| format!("{}::{}", quote_ident(&c.name), c.sql_type))
            .collect();
        format!("ROW({})::text", columns.join(", "))
    }

    /// Every task column rendered for the content hash both engines compute alike (see
    /// [`crate::reconcile_reads::PortableKind`]); an error names a column none covers.
    fn portable_content(&self) -> Result<Vec<String>, String> {
        let kinds = portable_kinds(self.columns.iter().map(|c| (c.name.as_str(), c.sql_type.as_str())))?;
        Ok(self
            .columns
            .iter()
            .zip(kinds)
            .map(|(column, kind)| {
                let c = format!("{}::{}", quote_ident(&column.name), column.sql_type);
                let text = match kind {
                    PortableKind::Integer | PortableKind::Text | PortableKind::Date => format!("{c}::text"),
                    PortableKind::Numeric => format!("trim_scale({c})::text"),
                    PortableKind::Boolean => format!("CASE WHEN {c} THEN 't' ELSE 'f' END"),
                    PortableKind::Micros => format!("(extract(epoch from {c}) * 1000000)::bigint::text"),
                    PortableKind::Bytes => format!("encode({c}, 'hex')"),
                };
                format!("coalesce('v' || {text}, 'n')")
            })
            .collect())
    }

    fn first_key(&self) -> String {
        quote_ident(&self.key_columns[0])
    }

    /// `SELECT bucket, count, hash` per bucket of the first key column split at `thresholds`
    /// (`width_bucket`: bucket i holds keys in `[thresholds[i-1], thresholds[i])`).
    pub fn checksum_buckets(&self, side: Side, scope: &Scope<'_>, thresholds: &[KeyValue]) -> Result<String, String> {
        let bucket = if thresholds.is_empty() {
            "0".to_string()
        } else {
            let values: Vec<String> = thresholds.iter().map(key_literal).collect();
            format!(
                "width_bucket({}, ARRAY[{}]::{}[])",
                self.first_key(),
                values.join(", "),
                thresholds[0].sql_type
            )
        };
        let mut parts: Vec<String> = self
            .key_columns
            .iter()
            .map(|k| format!("{}::text", quote_ident(k)))
            .collect();
        parts.push(format!("({})::text", self.side_version(side)));
        if scope.content && !scope.portable {
            parts.push(self.row_text());
        }
        if scope.content && scope.portable {
            parts.extend(self.portable_content()?);
        }
        let row_hash = if scope.portable {
            format!(
                "('x' || substr(md5(concat_ws(chr(31), {})), 1, 15))::bit(60)::bigint",
                parts.join(", ")
            )
        } else {
            format!("hashtextextended(concat_ws(chr(31), {}), 0)", parts.join(", "))
        };
        Ok(format!(
            "SELECT {bucket} AS bucket, count(*), coalesce(sum(({row_hash})::numeric), 0)::text \
             FROM {}{} GROUP BY 1 ORDER BY 1",
            self.side_table(side),
            self.side_where(side, scope)
        ))
    }

    /// The smallest and largest first-key value of the scope (text) on one side.
    pub fn key_bounds(&self, side: Side, scope: &Scope<'_>) -> String {
        let key = self.first_key();
        format!(
            "SELECT min({key})::text, max({key})::text FROM {}{}",
            self.side_table(side),
            self.side_where(side, scope)
        )
    }

    /// `parts − 1` quantiles of the first key column over the scope (one sorted pass inside
    /// the database), for key types without arithmetic.
    pub fn key_quantiles(&self, side: Side, scope: &Scope<'_>, parts: u32) -> String {
        let fractions: Vec<String> = (1..parts)
            .map(|i| format!("{}", f64::from(i) / f64::from(parts)))
            .collect();
        format!(
            "SELECT (percentile_disc(ARRAY[{}]::float8[]) WITHIN GROUP (ORDER BY {}))::text[] FROM {}{}",
            fractions.join(", "),
            self.first_key(),
            self.side_table(side),
            self.side_where(side, scope)
        )
    }

    /// Every `(key as text[], version, content hash)` of the scope on one side: a small
    /// range's rows (the hash is 0 when the scope compares versions only).
    pub fn key_versions(&self, side: Side, scope: &Scope<'_>) -> Result<String, String> {
        let keys: Vec<String> = self
            .key_columns
            .iter()
            .map(|k| format!("{}::text", quote_ident(k)))
            .collect();
        let content = match (scope.content, scope.portable) {
            (true, false) => format!("hashtextextended({}, 0)", self.row_text()),
            (true, true) => format!(
                "('x' || substr(md5(concat_ws(chr(31), {})), 1, 15))::bit(60)::bigint",
                self.portable_content()?.join(", ")
            ),
            (false, _) => "0::bigint".to_string(),
        };
        Ok(format!(
            "SELECT ARRAY[{}], ({})::bigint, {content} FROM {}{}",
            keys.join(", "),
            self.side_version(side),
            self.side_table(side),
            self.side_where(side, scope)
        ))
    }

    /// The source rows with these keys, in the staged layout (deleted or flagged rows too).
    pub fn rows_by_key(&self, keys: &[Vec<KeyValue>]) -> String {
        let columns: Vec<String> = self.key_columns.iter().map(|k| quote_ident(k)).collect();
        let tuples: Vec<String> = keys
            .iter()
            .map(|key| format!("({})", key.iter().map(key_literal).collect::<Vec<_>>().join(", ")))
            .collect();
        format!(
            "COPY (SELECT {} FROM {} WHERE ({}) IN ({})) TO STDOUT",
            self.select_list(),
            self.source.quoted(),
            columns.join(", "),
            tuples.join(", ")
        )
    }
}
