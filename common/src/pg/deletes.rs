//! Deletes: how a task reads them from its source (a soft-delete flag, a trigger-fed delete
//! log, or only reconciliation) and how they land in the target (rows deleted or flagged, and
//! a kept tombstone per key whose version blocks every older upsert replayed later).

use super::{Column, DELETED_COLUMN, KeyValue, ShardRange, TableName, TableSql, VERSION_COLUMN, quote_ident};

/// Where a task's deletes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeleteSource {
    /// A column of the source table marks deleted rows: a boolean that is true, or any other
    /// type that is not NULL.
    Flag(String),
    /// The delete log that `source install` creates: key columns, `version`, `deleted_at`.
    Log(TableName),
    /// The source records nothing; reconciliation finds deleted keys.
    Reconcile,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteSql {
    pub source: DeleteSource,
    /// `target_deletes = "soft"`: the target keeps the row with `_tidemark_deleted = true`.
    pub target_soft: bool,
    /// The target-side table of kept tombstones (key columns and version).
    pub tombstones: TableName,
}

/// The delete log's name for a source table: `<table>_tidemark_deletes`, same schema (see
/// [`super::derived_name`] for long names).
pub fn delete_log_table(source: &TableName) -> TableName {
    TableName {
        schema: source.schema.clone(),
        name: super::derived_name("", &source.name, "_tidemark_deletes"),
    }
}

/// Where the source's `TRUNCATE`s of a table are recorded: `<table>_tidemark_truncates`
/// (`truncated_at`), fed by a statement trigger. A TRUNCATE removes rows without firing the
/// row trigger that feeds the delete log, so the target would keep every row.
pub fn truncate_log_table(source: &TableName) -> TableName {
    TableName {
        schema: source.schema.clone(),
        name: super::derived_name("", &source.name, "_tidemark_truncates"),
    }
}

/// The latest recorded TRUNCATE of the source table (microseconds), from [`truncate_log_table`].
pub fn last_truncate_query(source: &TableName) -> String {
    format!(
        "SELECT (extract(epoch from max(truncated_at)) * 1000000)::bigint FROM {}",
        truncate_log_table(source).quoted()
    )
}

/// The purge function's name for a source table (created by `source install`).
pub fn purge_function(table: &TableName) -> String {
    format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&super::derived_name("tidemark_purge_", &table.name, ""))
    )
}

/// Purges the delete-log entries older than `$1` (microseconds); returns how many.
pub fn purge_query(table: &TableName) -> String {
    format!(
        "SELECT {}('1970-01-01 00:00:00+00'::timestamptz + $1::bigint * interval '1 microsecond')",
        purge_function(table)
    )
}

/// The kept-tombstone table for a target table: `tidemark_tombstones_<table>`, same schema.
pub fn tombstone_table(target: &TableName) -> TableName {
    TableName {
        schema: target.schema.clone(),
        name: super::derived_name("tidemark_tombstones_", &target.name, ""),
    }
}

impl DeleteSql {
    /// From `TaskSpec`'s form: kind `""` (no deletes), `flag` (with its column), `log` or
    /// `reconcile`.
    pub fn from_spec(
        kind: &str,
        column: &str,
        target_soft: bool,
        source: &TableName,
        target: &TableName,
    ) -> Result<Option<DeleteSql>, String> {
        let source = match kind {
            "" => return Ok(None),
            "flag" if !column.is_empty() => DeleteSource::Flag(column.to_string()),
            "log" => DeleteSource::Log(delete_log_table(source)),
            "reconcile" => DeleteSource::Reconcile,
            other => return Err(format!("unknown delete source {other:?}")),
        };
        Ok(Some(DeleteSql {
            source,
            target_soft,
            tombstones: tombstone_table(target),
        }))
    }

    /// The staged delete flag of a row read from the source table.
    pub(super) fn row_flag(&self, columns: &[Column]) -> String {
        match &self.source {
            DeleteSource::Flag(column) => {
                let is_boolean = columns.iter().any(|c| &c.name == column && c.sql_type == "boolean");
                if is_boolean {
                    format!("coalesce({}, false)", quote_ident(column))
                } else {
                    format!("({} IS NOT NULL)", quote_ident(column))
                }
            }
            DeleteSource::Log(_) | DeleteSource::Reconcile => "false".to_string(),
        }
    }

    /// Whether the source's live rows are filtered by a flag (for reconciliation).
    pub fn live_row_filter(&self, columns: &[Column]) -> Option<String> {
        match &self.source {
            DeleteSource::Flag(_) => Some(format!("NOT {}", self.row_flag(columns))),
            DeleteSource::Log(_) | DeleteSource::Reconcile => None,
        }
    }

    /// Flagged rows carry every column (a soft-deleted source row): in a soft target they are
    /// upserted with the flag set instead of only flagging the existing row.
    pub fn upserts_tombstone_rows(&self) -> bool {
        self.target_soft && matches!(self.source, DeleteSource::Flag(_))
    }

    /// `NOT EXISTS` a kept tombstone that covers the staged row `alias`: one with a higher
    /// version, or the same version when the row is live (a delete wins a tie).
    pub(super) fn not_blocked_by_tombstone(&self, sql: &TableSql, alias: &str) -> String {
        let version = quote_ident(VERSION_COLUMN);
        format!(
            "NOT EXISTS (SELECT 1 FROM {tombs} d WHERE {on} AND (d.{version} > {alias}.{version} \
             OR (d.{version} = {alias}.{version} AND NOT {alias}.{deleted})))",
            tombs = self.tombstones.quoted(),
            on = sql.keys_equal("d", alias),
            deleted = quote_ident(DELETED_COLUMN),
        )
    }

    /// Records the batch's tombstones (the highest version per key wins) and deletes or flags
    /// the target rows they cover.
    pub(super) fn apply_tombstones(&self, sql: &TableSql) -> Vec<String> {
        let target = sql.target.quoted();
        let stage = sql.stage_table();
        let version = quote_ident(VERSION_COLUMN);
        let deleted = quote_ident(DELETED_COLUMN);
        let keys = sql.key_order();
        let newest = format!(
            "SELECT DISTINCT ON ({keys}) {keys}, {version} FROM {stage} WHERE {deleted} ORDER BY {keys}, {version} DESC"
        );
        let mut statements = vec![format!(
            "INSERT INTO {tombs} AS d ({keys}, {version}) {newest} \
             ON CONFLICT ({keys}) DO UPDATE SET {version} = EXCLUDED.{version} WHERE d.{version} < EXCLUDED.{version}",
            tombs = self.tombstones.quoted(),
        )];
        if !self.target_soft {
            statements.push(format!(
                "DELETE FROM {target} t USING {stage} s WHERE s.{deleted} AND {on} AND t.{version} <= s.{version}",
                on = sql.keys_equal("t", "s"),
            ));
        } else if !self.upserts_tombstone_rows() {
            statements.push(format!(
                "UPDATE {target} t SET {deleted} = true, {version} = s.{version} FROM ({newest}) s \
                 WHERE {on} AND t.{version} <= s.{version}",
                on = sql.keys_equal("t", "s"),
            ));
        }
        statements
    }

    /// `CREATE TABLE IF NOT EXISTS` for the kept tombstones.
    pub fn create_tombstone_table(&self, sql: &TableSql) -> String {
        let mut definitions: Vec<String> = sql
            .key_columns
            .iter()
            .zip(sql.key_types())
            .map(|(k, t)| format!("{} {t} NOT NULL", quote_ident(k)))
            .collect();
        definitions.push(format!("{} bigint NOT NULL", quote_ident(VERSION_COLUMN)));
        definitions.push(format!("PRIMARY KEY ({})", sql.key_order()));
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({})",
            self.tombstones.quoted(),
            definitions.join(", ")
        )
    }

    /// Adds the soft-delete column to the target table.
    pub fn add_soft_delete_column(sql: &TableSql) -> String {
        format!(
            "ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} boolean NOT NULL DEFAULT false",
            sql.target.quoted(),
            quote_ident(DELETED_COLUMN)
        )
    }
}

/// Where a delete-log page stops: below the cycle's high (the row page was short), or at the
/// row page's last position `(t, key)` inclusive.
#[derive(Debug, Clone)]
pub enum LogUpper<'a> {
    Below(i64),
    AtMost(i64, &'a [KeyValue]),
}

impl TableSql {
    /// A page of the delete log in the staged layout (key columns, NULL elsewhere, the logged
    /// version, `deleted_at` as the cursor time, the flag set), in `(deleted_at, key)` order,
    /// between the same positions as the row page it accompanies.
    pub fn delete_log_page(
        &self,
        log: &TableName,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        upper: LogUpper<'_>,
        limit: u32,
    ) -> String {
        let deleted_at = quote_ident("deleted_at");
        let mut conditions = self.range_condition(range);
        conditions.push(self.position_after(&deleted_at, super::time_literal(t_micros), after_key));
        match upper {
            LogUpper::Below(high) => {
                conditions.push(format!("{deleted_at} < {}", super::time_literal(high)));
            }
            LogUpper::AtMost(t, key) => {
                let mut columns = vec![deleted_at.clone()];
                columns.extend(self.key_columns.iter().map(|c| quote_ident(c)));
                let mut values = vec![super::time_literal(t)];
                values.extend(key.iter().map(super::key_literal));
                conditions.push(format!("({}) <= ({})", columns.join(", "), values.join(", ")));
            }
        }
        let mut list: Vec<String> = self
            .columns
            .iter()
            .map(|c| {
                if self.key_columns.contains(&c.name) {
                    // Typed as the source's key, which a binary page needs.
                    format!("{}::{}", quote_ident(&c.name), c.sql_type)
                } else {
                    "NULL".to_string()
                }
            })
            .collect();
        list.push(format!("{}::bigint", quote_ident("version")));
        list.push(format!("(extract(epoch from {deleted_at}) * 1000000)::bigint"));
        list.push("true".to_string());
        // A key the source holds again was re-inserted after its delete (in the same
        // transaction, by one that began earlier, or by `WITH d AS (DELETE …) INSERT …`): the
        // entry is stale and the live row arrives by its cursor. Were the tombstone applied,
        // its version (taken after the re-insert's cursor time or its BEFORE trigger) would
        // keep the re-inserted row out. The open-transaction bound keeps an entry unread while
        // a transaction that could still re-insert its key is open.
        conditions.push(format!(
            "NOT EXISTS (SELECT 1 FROM {} t WHERE {})",
            self.source.quoted(),
            self.keys_equal("t", "l")
        ));
        format!(
            "COPY (SELECT {} FROM {} l WHERE {} ORDER BY {deleted_at}, {} LIMIT {limit}) TO STDOUT{}",
            list.join(", "),
            log.quoted(),
            conditions.join(" AND "),
            self.key_order(),
            self.page_format.copy_option()
        )
    }
}
