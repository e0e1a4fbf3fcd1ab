//! The trigger-fed delete log of a MySQL/MariaDB source (`delete_policy = { kind =
//! "tombstone_table" }`): what `source install` creates, the page the workers read it by,
//! the retention purge, and how a TRUNCATE (which fires no trigger) is noticed.
//!
//! The log is `<table>_tidemark_deletes` in the table's database: the key columns (the
//! source's types and collations), `version` and `deleted_at` (`DATETIME(6)`, UTC). An AFTER
//! DELETE trigger, and an AFTER UPDATE trigger for key changes, insert one entry per removed
//! key. Both triggers run with their definer's privileges, so writers need no grant on it.
//!
//! Times inside a trigger are the row's own: `NOW(6)` is the statement's start and the
//! session's zone is the writer's, so the entry's time is `UTC_TIMESTAMP(6)` moved on by the
//! time the statement has run (`SYSDATE(6) − NOW(6)`), the analogue of PostgreSQL's
//! `clock_timestamp()`. The open-transaction bound (`innodb_trx`) keeps the watermark below
//! every open deleter's start, as it does for rows.

use super::types::SourceColumn;
use super::{MySqlStatements, quote_ident, quote_literal};
use crate::cursor::{KeyValue, ShardRange};
use crate::pg::deletes::LogUpper;
use crate::pg::{TableName, TableSql, derived_name, timestamp_unit_micros};

/// `TABLE`'s qualified name.
fn qualified(table: &TableName) -> String {
    format!("{}.{}", quote_ident(&table.schema), quote_ident(&table.name))
}

/// The wall-clock instant of the row's change, UTC, as `DATETIME(6)` (see the module text).
const ROW_TIME_UTC: &str = "(UTC_TIMESTAMP(6) + INTERVAL TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6)) MICROSECOND)";

fn micros_of_utc(datetime: &str) -> String {
    format!("CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {datetime}) AS SIGNED)")
}

fn utc_of_micros(micros: i64) -> String {
    format!("(TIMESTAMP'1970-01-01 00:00:00' + INTERVAL {micros} MICROSECOND)")
}

/// A key column as the log defines it: the source's type, character set and collation, so
/// that the log's keys are the table's keys byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogKey {
    pub column: SourceColumn,
    pub charset: Option<String>,
    pub collation: Option<String>,
}

/// The key columns' character sets and collations (`?` database, `?` table, `?` column).
pub const KEY_COLLATION: &str = "SELECT CAST(character_set_name AS CHAR), CAST(collation_name AS CHAR) \
     FROM information_schema.columns WHERE table_schema = ? AND table_name = ? AND column_name = ?";

/// Everything `source install` needs to write the triggers.
#[derive(Debug, Clone)]
pub struct DeleteLogInstall<'a> {
    pub table: &'a TableName,
    pub log: &'a TableName,
    pub keys: &'a [LogKey],
    /// The cursor column, which the entry's version must exceed (`version = "cursor"`).
    pub cursor: Option<&'a SourceColumn>,
    /// `version = "trigger"`: the entry takes the table's sequence's next value.
    pub sequence_version: bool,
    /// The zone a `DATETIME` cursor is written in (as the epoch reads it).
    pub cursor_zone: Option<&'a str>,
}

impl DeleteLogInstall<'_> {
    fn trigger(&self, prefix: &str) -> String {
        quote_ident(&derived_name(prefix, &self.table.name, ""))
    }

    /// The entry's version: above the row's last one (its cursor's microseconds + 1), and the
    /// change's time on the cursor's precision, so that a re-insert in a later unit of it
    /// wins (within one unit the delete wins the tie, as on PostgreSQL).
    fn version(&self) -> String {
        let Some(cursor_column) = self.cursor.filter(|_| !self.sequence_version) else {
            return super::versions::next_version(self.table);
        };
        let cursor = format!("OLD.{}", quote_ident(&cursor_column.name));
        let old = match (cursor_column.is_naive_time(), self.cursor_zone) {
            (true, Some(zone)) => micros_of_utc(&format!("CONVERT_TZ({cursor}, {}, '+00:00')", quote_literal(zone))),
            (true, None) => micros_of_utc(&cursor),
            // A TIMESTAMP's instant, whatever the writer's session zone.
            (false, _) => format!("CAST(UNIX_TIMESTAMP({cursor}) * 1000000 AS SIGNED)"),
        };
        let unit = cursor_column
            .target_type()
            .map_or(1, |t| timestamp_unit_micros(&t))
            .max(1);
        format!(
            "GREATEST({old} + 1, ({} DIV {unit}) * {unit})",
            micros_of_utc(ROW_TIME_UTC)
        )
    }

    fn insert_entry(&self) -> String {
        let keys: Vec<String> = self.keys.iter().map(|k| quote_ident(&k.column.name)).collect();
        let old: Vec<String> = keys.iter().map(|k| format!("OLD.{k}")).collect();
        format!(
            "INSERT INTO {} ({}, `version`, `deleted_at`) VALUES ({}, {}, {ROW_TIME_UTC})",
            qualified(self.log),
            keys.join(", "),
            old.join(", "),
            self.version()
        )
    }

    /// The statements, each idempotent, in order. MySQL's DDL is not transactional: a failed
    /// install is run again.
    pub fn statements(&self) -> Vec<String> {
        let mut definitions: Vec<String> = self
            .keys
            .iter()
            .map(|k| {
                let mut definition = format!("{} {}", quote_ident(&k.column.name), k.column.column_type);
                if let (Some(charset), Some(collation)) = (&k.charset, &k.collation) {
                    definition.push_str(&format!(" CHARACTER SET {charset} COLLATE {collation}"));
                }
                definition + " NOT NULL"
            })
            .collect();
        let keys: Vec<String> = self.keys.iter().map(|k| quote_ident(&k.column.name)).collect();
        definitions.push("`version` BIGINT NOT NULL".into());
        definitions.push("`deleted_at` DATETIME(6) NOT NULL".into());
        definitions.push(format!("KEY `position` (`deleted_at`, {})", keys.join(", ")));
        // A key change is the old key's delete. Bytes decide (`BINARY`): in a case-insensitive
        // collation `'a'` → `'A'` is a new key for the target.
        let changed: Vec<String> = keys
            .iter()
            .map(|k| format!("NOT (BINARY OLD.{k} <=> BINARY NEW.{k})"))
            .collect();
        let table = qualified(self.table);
        let deletes = self.trigger("tidemark_deletes_");
        let key_changes = self.trigger("tidemark_key_changes_");
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE=InnoDB",
                qualified(self.log),
                definitions.join(", ")
            ),
            format!("DROP TRIGGER IF EXISTS {}.{deletes}", quote_ident(&self.table.schema)),
            format!(
                "CREATE TRIGGER {}.{deletes} AFTER DELETE ON {table} FOR EACH ROW {}",
                quote_ident(&self.table.schema),
                self.insert_entry()
            ),
            format!(
                "DROP TRIGGER IF EXISTS {}.{key_changes}",
                quote_ident(&self.table.schema)
            ),
            format!(
                "CREATE TRIGGER {}.{key_changes} AFTER UPDATE ON {table} FOR EACH ROW \
                 IF {} THEN {}; END IF",
                quote_ident(&self.table.schema),
                changed.join(" OR "),
                self.insert_entry()
            ),
        ]
    }
}

/// Removes the entries older than `cutoff_micros` (the retention purge).
pub fn purge(log: &TableName, cutoff_micros: i64) -> String {
    format!(
        "DELETE FROM {} WHERE `deleted_at` < {}",
        qualified(log),
        utc_of_micros(cutoff_micros)
    )
}

/// Reads nothing, but needs SELECT and DELETE on the log: the privilege check at planning.
pub fn privilege_probes(log: &TableName) -> [String; 2] {
    [
        format!("SELECT 1 FROM {} WHERE FALSE", qualified(log)),
        format!("DELETE FROM {} WHERE FALSE", qualified(log)),
    ]
}

/// InnoDB's id of the table. A TRUNCATE gives the table a new id (so does a rebuild:
/// `OPTIMIZE TABLE`, `ALTER TABLE … FORCE`), and TRUNCATE fires no trigger: a changed id
/// means deletes the log never saw. Needs PROCESS. MariaDB names the view
/// `INNODB_SYS_TABLES`, MySQL 8 `INNODB_TABLES`; the name is `database/table` in the
/// server's file-name encoding.
pub fn table_id_queries(table: &TableName) -> [String; 2] {
    let name = quote_literal(&format!(
        "{}/{}",
        filename_encoding(&table.schema),
        filename_encoding(&table.name)
    ));
    ["INNODB_SYS_TABLES", "INNODB_TABLES"]
        .map(|view| format!("SELECT CAST(TABLE_ID AS CHAR) FROM information_schema.{view} WHERE NAME = {name}"))
}

/// The server's file-name encoding of an identifier for ASCII names: letters, digits and `_`
/// stay, any other character is `@` and four hex digits of its code point.
fn filename_encoding(name: &str) -> String {
    name.chars()
        .map(|ch| {
            if ch.is_ascii_alphanumeric() || ch == '_' {
                ch.to_string()
            } else {
                format!("@{:04x}", ch as u32)
            }
        })
        .collect()
}

impl MySqlStatements {
    /// A page of the delete log in the staged layout (key columns, NULL elsewhere, the
    /// logged version, `deleted_at` as the cursor time, the flag set), in `(deleted_at, key)`
    /// order, between the same positions as the row page it accompanies. An entry whose key
    /// the table holds again (byte for byte) was re-inserted after its delete: it is stale,
    /// and the live row arrives by its cursor.
    #[allow(clippy::too_many_arguments)]
    pub fn delete_log_page(
        &self,
        sql: &TableSql,
        log: &TableName,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        upper: LogUpper<'_>,
        limit: u32,
    ) -> String {
        let deleted_at = "`deleted_at`".to_string();
        let mut columns = vec![deleted_at.clone()];
        columns.extend(sql.key_columns.iter().map(|k| quote_ident(k)));
        let values = |t: i64, key: &[KeyValue]| {
            let mut values = vec![utc_of_micros(t)];
            values.extend(
                sql.key_columns
                    .iter()
                    .zip(key)
                    .map(|(name, value)| self.key_literal(value, name)),
            );
            values
        };
        let mut conditions = self.range_condition(sql, range);
        match after_key {
            None => conditions.push(format!("{deleted_at} >= {}", utc_of_micros(t_micros))),
            Some(after) => conditions.push(Self::tuple_after(&columns, &values(t_micros, after), true)),
        }
        match upper {
            LogUpper::Below(high) => conditions.push(format!("{deleted_at} < {}", utc_of_micros(high))),
            LogUpper::AtMost(t, key) => {
                conditions.push(format!("NOT {}", Self::tuple_after(&columns, &values(t, key), true)));
            }
        }
        let same_key: Vec<String> = sql
            .key_columns
            .iter()
            .map(|name| {
                let k = quote_ident(name);
                let column = self.column(name);
                if column.is_integer() || column.data_type.contains("binary") || column.data_type.contains("blob") {
                    format!("t.{k} = l.{k}")
                } else {
                    format!("t.{k} = l.{k} AND BINARY t.{k} = BINARY l.{k}")
                }
            })
            .collect();
        conditions.push(format!(
            "NOT EXISTS (SELECT 1 FROM {} t WHERE {})",
            self.table(),
            same_key.join(" AND ")
        ));
        let mut list: Vec<String> = self
            .columns
            .iter()
            .map(|c| {
                if sql.key_columns.contains(&c.name) {
                    c.text_expr()
                } else {
                    "NULL".to_string()
                }
            })
            .collect();
        list.push("CAST(`version` AS SIGNED)".to_string());
        list.push(micros_of_utc(&deleted_at));
        list.push("'t'".to_string());
        format!(
            "SELECT {} FROM {} l WHERE {} ORDER BY {} LIMIT {limit}",
            list.join(", "),
            qualified(log),
            conditions.join(" AND "),
            columns.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(name: &str, column_type: &str) -> SourceColumn {
        SourceColumn {
            name: name.into(),
            column_type: column_type.into(),
            data_type: column_type.split(['(', ' ']).next().unwrap().into(),
            not_null: true,
        }
    }

    #[test]
    fn the_install_logs_deletes_and_byte_level_key_changes() {
        let table = TableName {
            schema: "shop".into(),
            name: "items".into(),
        };
        let log = crate::pg::deletes::delete_log_table(&table);
        let keys = [LogKey {
            column: column("code", "varchar(20)"),
            charset: Some("utf8mb4".into()),
            collation: Some("utf8mb4_general_ci".into()),
        }];
        let cursor = column("updated_at", "timestamp(3)");
        let install = DeleteLogInstall {
            table: &table,
            log: &log,
            keys: &keys,
            cursor: Some(&cursor),
            sequence_version: false,
            cursor_zone: None,
        };
        let statements = install.statements();
        assert!(
            statements[0].contains("`code` varchar(20) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL"),
            "{}",
            statements[0]
        );
        assert!(statements[2].starts_with("CREATE TRIGGER `shop`.`tidemark_deletes_items` AFTER DELETE"));
        assert!(
            statements[2].contains("GREATEST(CAST(UNIX_TIMESTAMP(OLD.`updated_at`) * 1000000 AS SIGNED) + 1")
                && statements[2].contains("DIV 1000) * 1000"),
            "{}",
            statements[2]
        );
        assert!(
            statements[4].contains("IF NOT (BINARY OLD.`code` <=> BINARY NEW.`code`) THEN INSERT"),
            "{}",
            statements[4]
        );
    }

    #[test]
    fn innodb_names_use_the_file_name_encoding() {
        let table = TableName {
            schema: "tm-db".into(),
            name: "items".into(),
        };
        assert!(table_id_queries(&table)[0].ends_with("WHERE NAME = 'tm@002ddb/items'"));
    }
}
