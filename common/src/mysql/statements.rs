//! The statements a task reads a MySQL/MariaDB source table with. Each returns its rows in
//! the staged layout of [`crate::pg::TableSql`] (the columns as COPY text of their mapped
//! types, the version, then the cursor time in microseconds and the delete flag), or in the
//! target layout for key-ordered pages that [`TableSql::key_pages_in_target_layout`] allows.
//! Row comparisons are spelled out as `a > x OR (a = x AND …)`, which MariaDB turns into
//! index ranges; text keys compare in the column's own collation, on the server.

use super::types::SourceColumn;
use super::{quote_ident, quote_literal};
use crate::cursor::{KeyValue, ShardRange};
use crate::pg::deletes::DeleteSource;
use crate::pg::{TableName, TableSql};

/// The alias of a page column that holds a cursor time as a UTC `DATETIME`, which the read
/// (`super::read`) turns into microseconds since the Unix epoch, `NULL` where
/// `TIMESTAMPDIFF` gives `NULL` (a zero date).
pub const MICROS_ALIAS: &str = "_tidemark_utc_micros";

/// A task's read statements against one MySQL table, whose columns are `columns` (the
/// epoch's, in order, as the source types them).
#[derive(Debug, Clone)]
pub struct MySqlStatements {
    pub table: TableName,
    pub columns: Vec<SourceColumn>,
}

impl MySqlStatements {
    /// The statements for the epoch's columns (`sql.columns`, in order) as the table has them
    /// now; `Ok(Err(reason))` when one is gone or no longer maps to the epoch's type.
    pub async fn for_epoch(
        pool: &sqlx::MySqlPool,
        sql: &TableSql,
    ) -> Result<Result<MySqlStatements, String>, sqlx::Error> {
        let table = &sql.source;
        let Some(found) = super::types::columns(pool, &table.schema, &table.name).await? else {
            return Ok(Err(format!("source table {table} does not exist")));
        };
        let mut columns = Vec::new();
        for epoch_column in &sql.columns {
            let Some(column) = found.iter().find(|c| c.name == epoch_column.name) else {
                return Ok(Err(format!("column {:?} of {table} is gone", epoch_column.name)));
            };
            let mapped = match column.target_type() {
                Ok(mapped) => mapped,
                Err(reason) => return Ok(Err(reason)),
            };
            if mapped != epoch_column.sql_type {
                return Ok(Err(format!(
                    "column {:?} of {table} is {} ({mapped}) where the epoch's is {}",
                    column.name, column.column_type, epoch_column.sql_type
                )));
            }
            columns.push(column.clone());
        }
        Ok(Ok(MySqlStatements {
            table: table.clone(),
            columns,
        }))
    }

    pub(super) fn column(&self, name: &str) -> &SourceColumn {
        self.columns
            .iter()
            .find(|c| c.name == name)
            .expect("the task's columns are the table's")
    }

    pub(super) fn table(&self) -> String {
        format!("{}.{}", quote_ident(&self.table.schema), quote_ident(&self.table.name))
    }

    fn cursor<'a>(&'a self, sql: &TableSql) -> &'a SourceColumn {
        self.column(
            sql.cursor_column
                .as_deref()
                .expect("incremental reads need a cursor column"),
        )
    }

    /// The cursor's instant as a UTC date and time: a `TIMESTAMP` as the instant it is (the
    /// pinned session renders it in UTC), a `DATETIME` read as a wall-clock time of the task's
    /// zone (`cursor_time_zone`).
    fn cursor_utc(&self, sql: &TableSql) -> String {
        let cursor = self.cursor(sql);
        let column = quote_ident(&cursor.name);
        match (&sql.cursor_zone, cursor.is_naive_time()) {
            (Some(zone), true) => format!("CONVERT_TZ({column}, {}, '+00:00')", quote_literal(zone)),
            _ => column,
        }
    }

    /// The cursor's instant in microseconds since the Unix epoch.
    fn cursor_micros(&self, sql: &TableSql) -> String {
        format!(
            "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {}) AS SIGNED)",
            self.cursor_utc(sql)
        )
    }

    /// The cursor's instant in a page's select list: the UTC date and time under the alias
    /// [`MICROS_ALIAS`], which the read turns into microseconds (see `read`). Computed by the
    /// server, `TIMESTAMPDIFF` cost 0.2 s of its CPU per million rows, and a page has it twice
    /// (the version and the cursor time).
    fn cursor_micros_field(&self, sql: &TableSql) -> String {
        format!("{} AS `{MICROS_ALIAS}`", self.cursor_utc(sql))
    }

    /// A cursor time (an instant in microseconds) as a value comparable with the cursor column.
    pub(super) fn cursor_literal(&self, sql: &TableSql, micros: i64) -> String {
        let utc = format!("(TIMESTAMP'1970-01-01 00:00:00' + INTERVAL {micros} MICROSECOND)");
        match (&sql.cursor_zone, self.cursor(sql).is_naive_time()) {
            (Some(zone), true) => format!("CONVERT_TZ({utc}, '+00:00', {})", quote_literal(zone)),
            _ => utc,
        }
    }

    pub(super) fn version_expr(&self, sql: &TableSql) -> String {
        match &sql.version_column {
            Some(column) => format!("CAST({} AS SIGNED)", quote_ident(column)),
            None => self.cursor_micros(sql),
        }
    }

    fn delete_flag(&self, sql: &TableSql) -> Option<String> {
        let deletes = sql.deletes.as_ref()?;
        Some(match &deletes.source {
            DeleteSource::Flag(name) => {
                let column = self.column(name);
                let c = quote_ident(name);
                if column.column_type == "tinyint(1)" {
                    format!("IF(COALESCE({c}, 0) <> 0, 't', 'f')")
                } else {
                    format!("IF({c} IS NULL, 'f', 't')")
                }
            }
            DeleteSource::Log(_) | DeleteSource::Reconcile => "'f'".to_string(),
        })
    }

    /// A page's select list, in the staged layout (or the target layout).
    pub(super) fn list(&self, sql: &TableSql, target_layout: bool) -> String {
        let mut list: Vec<String> = self.columns.iter().map(SourceColumn::select_expr).collect();
        list.push(match &sql.version_column {
            Some(_) => self.version_expr(sql),
            None => self.cursor_micros_field(sql),
        });
        if !target_layout {
            if sql.cursor_column.is_some() {
                list.push(self.cursor_micros_field(sql));
            }
            list.extend(self.delete_flag(sql));
        }
        list.join(", ")
    }

    pub(super) fn key_literal(&self, key: &KeyValue, column: &str) -> String {
        self.column(column).key_literal(&key.value)
    }

    /// `(c1, …, cn) > (v1, …, vn)` spelled out lexicographically (`strict = false`: `>=` on
    /// the last column).
    pub(super) fn tuple_after(columns: &[String], values: &[String], strict: bool) -> String {
        let mut alternatives = Vec::new();
        for i in 0..columns.len() {
            let mut terms: Vec<String> = (0..i).map(|j| format!("{} = {}", columns[j], values[j])).collect();
            let last = i + 1 == columns.len();
            let op = if last && !strict { ">=" } else { ">" };
            terms.push(format!("{} {op} {}", columns[i], values[i]));
            alternatives.push(format!("({})", terms.join(" AND ")));
        }
        format!("({})", alternatives.join(" OR "))
    }

    fn keys(&self, sql: &TableSql) -> Vec<String> {
        sql.key_columns.iter().map(|k| quote_ident(k)).collect()
    }

    fn key_values(&self, sql: &TableSql, key: &[KeyValue]) -> Vec<String> {
        sql.key_columns
            .iter()
            .zip(key)
            .map(|(name, value)| self.key_literal(value, name))
            .collect()
    }

    pub(super) fn range_condition(&self, sql: &TableSql, range: &ShardRange) -> Vec<String> {
        let first = &sql.key_columns[0];
        let mut conditions = Vec::new();
        if let Some(lo) = &range.lo {
            conditions.push(format!("{} >= {}", quote_ident(first), self.key_literal(lo, first)));
        }
        if let Some(hi) = &range.hi {
            conditions.push(format!("{} < {}", quote_ident(first), self.key_literal(hi, first)));
        }
        conditions
    }

    fn select(&self, list: &str, conditions: &[String], order: &str, limit: u32) -> String {
        let where_clause = if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        };
        format!(
            "SELECT {list} FROM {}{where_clause} ORDER BY {order} LIMIT {limit}",
            self.table()
        )
    }

    /// A snapshot (or append) page: rows of the range after `after_key` in key order, up to
    /// `max_key` on the first key column.
    pub fn snapshot_page(
        &self,
        sql: &TableSql,
        range: &ShardRange,
        after_key: Option<&[KeyValue]>,
        max_key: Option<&KeyValue>,
        limit: u32,
    ) -> String {
        let mut conditions = self.range_condition(sql, range);
        if let Some(after) = after_key {
            conditions.push(Self::tuple_after(&self.keys(sql), &self.key_values(sql, after), true));
        }
        if let Some(max) = max_key {
            let first = &sql.key_columns[0];
            conditions.push(format!("{} <= {}", quote_ident(first), self.key_literal(max, first)));
        }
        if let Some(filter) = &sql.filter {
            conditions.push(format!("({filter})"));
        }
        let list = self.list(sql, sql.key_pages_in_target_layout());
        self.select(&list, &conditions, &self.keys(sql).join(", "), limit)
    }

    /// An incremental page: rows with `(cursor, key) > (t, after_key)` (or `cursor >= t`
    /// without a key), `cursor < high`, and (`upto`) `(cursor, key) <= upto`, in that order.
    #[allow(clippy::too_many_arguments)]
    pub fn incremental_page(
        &self,
        sql: &TableSql,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        high_micros: i64,
        upto: Option<(i64, &[KeyValue])>,
        limit: u32,
    ) -> String {
        let cursor = quote_ident(&self.cursor(sql).name);
        let mut columns = vec![cursor.clone()];
        columns.extend(self.keys(sql));
        let mut conditions = self.range_condition(sql, range);
        match after_key {
            None => conditions.push(format!("{cursor} >= {}", self.cursor_literal(sql, t_micros))),
            Some(after) => {
                let mut values = vec![self.cursor_literal(sql, t_micros)];
                values.extend(self.key_values(sql, after));
                conditions.push(Self::tuple_after(&columns, &values, true));
            }
        }
        conditions.push(format!("{cursor} < {}", self.cursor_literal(sql, high_micros)));
        if let Some((t, key)) = upto {
            let mut values = vec![self.cursor_literal(sql, t)];
            values.extend(self.key_values(sql, key));
            conditions.push(format!("NOT {}", Self::tuple_after(&columns, &values, true)));
        }
        self.select(&self.list(sql, false), &conditions, &columns.join(", "), limit)
    }

    /// The median of the first key column inside `range` (a split point), as COPY text, in
    /// the column's own order and collation.
    pub fn median_key(&self, sql: &TableSql, range: &ShardRange) -> String {
        let first = &sql.key_columns[0];
        let k = quote_ident(first);
        let conditions = self.range_condition(sql, range);
        let where_clause = if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        };
        format!(
            "SELECT v FROM (SELECT {} AS v, ROW_NUMBER() OVER (ORDER BY {k}) AS rn, COUNT(*) OVER () AS n FROM {}{where_clause}) s \
             WHERE rn = CEIL(n / 2)",
            self.column(first).text_expr(),
            self.table()
        )
    }

    /// Whether `a < b` for values of the first key column, compared as the column compares
    /// them: numbers as numbers, text converted to the column's character set and compared in
    /// its collation (`charset_collation`, from `information_schema.columns`).
    pub fn key_less(
        &self,
        sql: &TableSql,
        a: &KeyValue,
        b: &KeyValue,
        charset_collation: Option<(&str, &str)>,
    ) -> String {
        let first = &sql.key_columns[0];
        let value = |v: &KeyValue| {
            let literal = self.key_literal(v, first);
            match charset_collation {
                Some((charset, collation)) => format!("(CONVERT({literal} USING {charset}) COLLATE {collation})"),
                None => literal,
            }
        };
        format!("SELECT CAST({} < {} AS SIGNED)", value(a), value(b))
    }

    /// The newest cursor time (microseconds; MySQL has no infinite times), through the
    /// cursor index.
    pub fn newest_cursor(&self, sql: &TableSql) -> String {
        let cursor = self.cursor(sql);
        let column = quote_ident(&cursor.name);
        let newest = format!("(SELECT MAX({column}) FROM {})", self.table());
        let utc = match (&sql.cursor_zone, cursor.is_naive_time()) {
            (Some(zone), true) => format!("CONVERT_TZ({newest}, {}, '+00:00')", quote_literal(zone)),
            _ => newest,
        };
        format!("SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {utc}) AS SIGNED)")
    }

    /// The largest integer key and the source clock after the statement's view.
    pub fn key_sample(&self, sql: &TableSql) -> String {
        format!(
            "SELECT CAST(MAX({}) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS SIGNED) FROM {}",
            quote_ident(&sql.key_columns[0]),
            self.table()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_comparisons_are_spelled_out() {
        let columns = ["`t`".to_string(), "`k`".to_string()];
        let values = ["T".to_string(), "5".to_string()];
        assert_eq!(
            MySqlStatements::tuple_after(&columns, &values, true),
            "((`t` > T) OR (`t` = T AND `k` > 5))"
        );
    }
}
