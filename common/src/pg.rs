//! PostgreSQL SQL, written in one audited place.
//!
//! Identifiers come from config and literals from source rows; both are quoted here and only
//! here. Literals are needed because `COPY (query) TO STDOUT` takes no bind parameters.
//! Sessions that run this SQL set `standard_conforming_strings = on`, under which doubling a
//! single quote is the complete escaping of a string literal.

use crate::copy_format::CopyFormat;
use crate::cursor::{KeyValue, ShardRange};

pub mod accumulate;
pub mod connector;
pub mod copy_out;
pub mod cursor_zone;
pub mod deletes;
pub mod reconcile;
pub mod visibility;
pub mod write;

pub use deletes::{DeleteSource, DeleteSql};

/// The column that carries each row's source version in the target table.
pub const VERSION_COLUMN: &str = "_tidemark_version";
/// The target-side ledger of applied batches.
pub const LEDGER_TABLE: &str = "tidemark_ledger";
/// The task's live epoch in the target (`$1`: the task), its fence: read in each batch's
/// transaction under a shared transaction-level advisory lock of the task, which the switch
/// takes exclusively while it renames the tables and moves the fence: a batch either commits
/// before the switch or sees it. A batch of an older epoch is refused; a newer epoch's writes
/// its own table (see [`TableSql::routed`]). (An advisory lock, not `FOR SHARE`: no row is
/// written per batch.)
pub const TARGET_EPOCH: &str = "SELECT (SELECT epoch FROM tidemark_epochs WHERE task = $1) \
     FROM (SELECT pg_advisory_xact_lock_shared(hashtext('tidemark.epoch'), hashtext($1))) lock";
/// The task's epoch in the target (`$1`), without the lock.
pub const TARGET_EPOCH_NOW: &str = "SELECT epoch FROM tidemark_epochs WHERE task = $1";
/// Takes the task's epoch lock exclusively (`$1`: the task), for a switch.
pub const LOCK_TARGET_EPOCH: &str = "SELECT pg_advisory_xact_lock(hashtext('tidemark.epoch'), hashtext($1))";
/// A staged row's cursor time in microseconds: the last field of the staged layout (when the
/// task has a cursor column); it exists only in the session's stage table.
pub const CURSOR_MICROS_COLUMN: &str = "_tidemark_cursor_micros";
/// A staged row's delete flag: the last field of the staged layout of a task with a delete
/// policy. In the target it is the soft-delete column (`target_deletes = "soft"`).
pub const DELETED_COLUMN: &str = "_tidemark_deleted";
/// In a reconciliation's repair batch, the target version the comparison saw for the row's
/// key (NULL: absent). A repair replaces that exact version even when the source's is lower.
pub const EXPECTED_COLUMN: &str = "_tidemark_expected";

pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// PostgreSQL's identifier limit in bytes (NAMEDATALEN − 1); longer names are cut silently.
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// A name derived from a table's (`prefix + table + suffix`), never longer than an identifier
/// may be. PostgreSQL would cut a longer one at 63 bytes, so that two long table names with
/// a common beginning would share one delete log, trigger or tombstone table and corrupt
/// each other. A name that does not fit keeps the start of the table's name and ends with 8
/// hex digits of a hash of the whole name: bounded, and distinct for distinct tables. Names
/// that fit are unchanged.
pub fn derived_name(prefix: &str, table: &str, suffix: &str) -> String {
    use sha2::{Digest, Sha256};
    let whole = format!("{prefix}{table}{suffix}");
    if whole.len() <= MAX_IDENTIFIER_BYTES {
        return whole;
    }
    let hash = &hex::encode(Sha256::digest(table.as_bytes()))[..8];
    let mut room = MAX_IDENTIFIER_BYTES.saturating_sub(prefix.len() + suffix.len() + hash.len() + 1);
    while !table.is_char_boundary(room) {
        room -= 1;
    }
    format!("{prefix}{}_{hash}{suffix}", &table[..room])
}

/// `schema.table` or `table` (schema `public`), as written in config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

impl TableName {
    pub fn parse(text: &str) -> Result<TableName, String> {
        let parts: Vec<&str> = text.split('.').collect();
        let (schema, name) = match parts.as_slice() {
            [name] => ("public", *name),
            [schema, name] => (*schema, *name),
            _ => {
                return Err(format!("table name {text:?} must be `table` or `schema.table`"));
            }
        };
        if schema.is_empty() || name.is_empty() {
            return Err(format!("table name {text:?} must be `table` or `schema.table`"));
        }
        Ok(TableName {
            schema: schema.to_string(),
            name: name.to_string(),
        })
    }

    pub fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }

    /// The table beside this one where epoch `epoch` of the task writing it lives while it is
    /// not the live epoch: built there by `tasks reinit`, renamed to this table's name by the
    /// switch, and back here when a newer epoch replaces it (retained for a rollback).
    /// `<table>__tm_e<epoch>` in the same schema, bounded like every derived name.
    pub fn epoch_table(&self, epoch: u64) -> TableName {
        TableName {
            schema: self.schema.clone(),
            name: derived_name("", &self.name, &format!("__tm_e{epoch}")),
        }
    }
}

impl std::fmt::Display for TableName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    /// As `format_type` prints it, e.g. `timestamp(3) with time zone`.
    pub sql_type: String,
}

fn key_literal(value: &KeyValue) -> String {
    format!("{}::{}", quote_literal(&value.value), value.sql_type)
}

/// `(k1, k2) > ('1'::bigint, 'a'::text)`: a row comparison, lexicographic and index-friendly.
fn keys_after(key_columns: &[String], after: &[KeyValue]) -> String {
    let columns: Vec<String> = key_columns.iter().map(|c| quote_ident(c)).collect();
    let values: Vec<String> = after.iter().map(key_literal).collect();
    format!("({}) > ({})", columns.join(", "), values.join(", "))
}

/// A time (microseconds since the Unix epoch) as a `timestamptz` literal.
fn time_literal(micros: i64) -> String {
    format!("('1970-01-01 00:00:00+00'::timestamptz + {micros} * interval '1 microsecond')")
}

/// Whether a cursor type stores local times without a zone (`timestamp without time zone`).
pub fn is_naive_timestamp(sql_type: &str) -> bool {
    sql_type.starts_with("timestamp") && !sql_type.contains("with time zone")
}

/// A cursor time (microseconds since the Unix epoch, an instant) as a literal of the cursor
/// column's type: for a `timestamp without time zone` column, the wall-clock time of that
/// instant in the zone its values are written in (`zone`; none: UTC, as epochs planned before
/// the zone was learned read them).
fn cursor_literal(micros: i64, cursor_type: &str, zone: Option<&str>) -> String {
    match (is_naive_timestamp(cursor_type), zone) {
        (false, _) => time_literal(micros),
        (true, Some(zone)) => format!("({} AT TIME ZONE {})", time_literal(micros), quote_literal(zone)),
        (true, None) => format!("('1970-01-01 00:00:00'::timestamp + {micros} * interval '1 microsecond')"),
    }
}

/// `expression` (a cursor value of `cursor_type`) as microseconds since the Unix epoch: the
/// instant it names, a naive value read in `zone` (none: UTC).
pub fn cursor_micros_expr(expression: &str, cursor_type: &str, zone: Option<&str>) -> String {
    match (is_naive_timestamp(cursor_type), zone) {
        (true, Some(zone)) => format!(
            "(extract(epoch from ({expression} AT TIME ZONE {})) * 1000000)::bigint",
            quote_literal(zone)
        ),
        _ => format!("(extract(epoch from {expression}) * 1000000)::bigint"),
    }
}

/// The statements a task runs against its source and target tables.
#[derive(Debug, Clone)]
pub struct TableSql {
    pub source: TableName,
    pub target: TableName,
    pub columns: Vec<Column>,
    pub key_columns: Vec<String>,
    /// Absent for append-only tasks, which page by key alone.
    pub cursor_column: Option<String>,
    /// The integer column holding each row's source version; `None` means the cursor time
    /// in microseconds (the default, and the weakest version).
    pub version_column: Option<String>,
    /// How deletions are read and applied; `None`: the task does not capture them.
    pub deletes: Option<DeleteSql>,
    /// A predicate on the source rows a task reads (`filter`, append and accumulate modes),
    /// written by the operator in the source's SQL.
    pub filter: Option<String>,
    /// The COPY format of the pages the worker reads (snapshot, append and incremental pages
    /// and the delete-log pages beside them). Binary only when the target's column types
    /// equal the source's; reconciliation reads text.
    pub page_format: CopyFormat,
    /// The zone a `timestamp without time zone` cursor's values are written in, frozen with
    /// the epoch (`cursor_time_zone`); `None`: UTC, or a cursor with a zone.
    pub cursor_zone: Option<String>,
}

impl TableSql {
    /// The statements for a batch of `epoch` when the target's live epoch (its fence) is
    /// `live`: a newer epoch builds beside the live table, in its [`TableName::epoch_table`];
    /// `None` when the batch writes the configured table. Kept tombstones are the task's, one
    /// table for every epoch (they record the source's deletes, whichever epoch read them).
    pub fn routed(&self, epoch: u64, live: Option<u64>) -> Option<TableSql> {
        let live = live?;
        (epoch > live).then(|| TableSql {
            target: self.target.epoch_table(epoch),
            ..self.clone()
        })
    }

    fn cursor_type(&self) -> &str {
        self.columns
            .iter()
            .find(|c| Some(&c.name) == self.cursor_column.as_ref())
            .map_or("timestamp with time zone", |c| c.sql_type.as_str())
    }

    /// One unit of the cursor column's precision, in microseconds.
    pub fn cursor_unit_micros(&self) -> i64 {
        timestamp_unit_micros(self.cursor_type())
    }

    fn cursor(&self) -> String {
        quote_ident(
            self.cursor_column
                .as_deref()
                .expect("incremental reads need a cursor column"),
        )
    }

    /// The cursor's instant in microseconds since the Unix epoch over the given row alias.
    fn cursor_micros(&self, alias: &str) -> String {
        cursor_micros_expr(
            &format!("{alias}{}", self.cursor()),
            self.cursor_type(),
            self.cursor_zone.as_deref(),
        )
    }

    /// A cursor time (an instant, microseconds) as a literal of the cursor column's type.
    fn cursor_time_literal(&self, micros: i64) -> String {
        cursor_literal(micros, self.cursor_type(), self.cursor_zone.as_deref())
    }

    fn version_expr(&self) -> String {
        match &self.version_column {
            Some(column) => format!("{}::bigint", quote_ident(column)),
            None => self.cursor_micros(""),
        }
    }

    /// Source columns followed by the row's version. The same list, in the same order, is the
    /// staged data's layout.
    fn select_list(&self) -> String {
        let mut list: Vec<String> = self.columns.iter().map(|c| quote_ident(&c.name)).collect();
        list.push(self.version_expr());
        if self.cursor_column.is_some() {
            list.push(self.cursor_micros(""));
        }
        if let Some(deletes) = &self.deletes {
            list.push(deletes.row_flag(&self.columns));
        }
        list.join(", ")
    }

    /// The staged layout: source columns, the version, then (with a cursor column) the cursor
    /// time in microseconds.
    pub fn staged_columns(&self) -> Vec<String> {
        let mut names = self.target_columns();
        if self.cursor_column.is_some() {
            names.push(quote_ident(CURSOR_MICROS_COLUMN));
        }
        if self.deletes.is_some() {
            names.push(quote_ident(DELETED_COLUMN));
        }
        names
    }

    /// The target's columns: the source columns and the version.
    fn target_columns(&self) -> Vec<String> {
        let mut names: Vec<String> = self.columns.iter().map(|c| quote_ident(&c.name)).collect();
        names.push(quote_ident(VERSION_COLUMN));
        names
    }

    /// Index of the staged field holding the cursor time in microseconds, if any.
    pub fn cursor_micros_position(&self) -> Option<usize> {
        self.cursor_column.as_ref().map(|_| self.columns.len() + 1)
    }

    /// Index of each key column inside a staged row.
    pub fn key_positions(&self) -> Vec<usize> {
        self.key_columns
            .iter()
            .map(|k| {
                self.columns
                    .iter()
                    .position(|c| &c.name == k)
                    .expect("key column is a column")
            })
            .collect()
    }

    pub fn key_types(&self) -> Vec<String> {
        self.key_positions()
            .into_iter()
            .map(|i| self.columns[i].sql_type.clone())
            .collect()
    }

    /// The median of the first key column inside `range` (a split point), as text.
    pub fn median_key(&self, range: &ShardRange) -> String {
        let conditions = self.range_condition(range);
        format!(
            "SELECT (percentile_disc(0.5) WITHIN GROUP (ORDER BY {}))::text FROM {}{}",
            quote_ident(&self.key_columns[0]),
            self.source.quoted(),
            if conditions.is_empty() {
                String::new()
            } else {
                format!(" WHERE {}", conditions.join(" AND "))
            }
        )
    }

    /// Whether `a < b` in the key type's order.
    pub fn key_less(a: &KeyValue, b: &KeyValue) -> String {
        format!("SELECT {} < {}", key_literal(a), key_literal(b))
    }

    fn range_condition(&self, range: &ShardRange) -> Vec<String> {
        let first = quote_ident(&self.key_columns[0]);
        let mut conditions = Vec::new();
        if let Some(lo) = &range.lo {
            conditions.push(format!("{first} >= {}", key_literal(lo)));
        }
        if let Some(hi) = &range.hi {
            conditions.push(format!("{first} < {}", key_literal(hi)));
        }
        conditions
    }

    fn key_order(&self) -> String {
        self.key_columns
            .iter()
            .map(|c| quote_ident(c))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether key-ordered pages (snapshot, append) are read in the target's own layout (its
    /// columns, no cursor time or delete flag), so that a batch whose keys the target does not
    /// hold yet can be copied straight into the target table. Not with a delete policy: its
    /// kept tombstones must be consulted row by row.
    pub fn key_pages_in_target_layout(&self) -> bool {
        self.deletes.is_none()
    }

    /// A snapshot page: rows of the range after `after_key` in key order, up to `max_key` on
    /// the first key column when the planner captured one.
    pub fn snapshot_page(
        &self,
        range: &ShardRange,
        after_key: Option<&[KeyValue]>,
        max_key: Option<&KeyValue>,
        limit: u32,
    ) -> String {
        let mut conditions = self.range_condition(range);
        if let Some(after) = after_key {
            conditions.push(keys_after(&self.key_columns, after));
        }
        if let Some(max) = max_key {
            conditions.push(format!("{} <= {}", quote_ident(&self.key_columns[0]), key_literal(max)));
        }
        if let Some(filter) = &self.filter {
            conditions.push(format!("({filter})"));
        }
        if self.key_pages_in_target_layout() {
            let mut list: Vec<String> = self.columns.iter().map(|c| quote_ident(&c.name)).collect();
            list.push(self.version_expr());
            return self.copy_out_list(&list.join(", "), &conditions, &self.key_order(), limit);
        }
        self.copy_out(&conditions, &self.key_order(), limit)
    }

    /// An incremental page: rows with `(cursor, key) > (t, after_key)` (or `cursor >= t` when
    /// no key is given) and `cursor < high`, in `(cursor, key)` order.
    pub fn incremental_page(
        &self,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        high_micros: i64,
        limit: u32,
    ) -> String {
        self.incremental_page_upto(range, t_micros, after_key, high_micros, None, limit)
    }

    /// An incremental page that also stops at `(t, key)` inclusive (where a full page of the
    /// delete log ended).
    pub fn incremental_page_upto(
        &self,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        high_micros: i64,
        upto: Option<(i64, &[KeyValue])>,
        limit: u32,
    ) -> String {
        let cursor = self.cursor();
        let mut conditions = self.range_condition(range);
        conditions.push(self.position_after(&cursor, self.cursor_time_literal(t_micros), after_key));
        conditions.push(format!("{cursor} < {}", self.cursor_time_literal(high_micros)));
        if let Some((t, key)) = upto {
            let mut columns = vec![cursor.clone()];
            columns.extend(self.key_columns.iter().map(|c| quote_ident(c)));
            let mut values = vec![self.cursor_time_literal(t)];
            values.extend(key.iter().map(key_literal));
            conditions.push(format!("({}) <= ({})", columns.join(", "), values.join(", ")));
        }
        let order = format!("{cursor}, {}", self.key_order());
        self.copy_out(&conditions, &order, limit)
    }

    /// `time >= t` without a key, `(time, k1..kn) > (t, key)` with one.
    fn position_after(&self, time_column: &str, t: String, after_key: Option<&[KeyValue]>) -> String {
        match after_key {
            None => format!("{time_column} >= {t}"),
            Some(after) => {
                let mut columns = vec![time_column.to_string()];
                columns.extend(self.key_columns.iter().map(|c| quote_ident(c)));
                let mut values = vec![t];
                values.extend(after.iter().map(key_literal));
                format!("({}) > ({})", columns.join(", "), values.join(", "))
            }
        }
    }

    fn copy_out(&self, conditions: &[String], order: &str, limit: u32) -> String {
        self.copy_out_list(&self.select_list(), conditions, order, limit)
    }

    fn copy_out_list(&self, list: &str, conditions: &[String], order: &str, limit: u32) -> String {
        let where_clause = if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        };
        format!(
            "COPY (SELECT {list} FROM {}{where_clause} ORDER BY {order} LIMIT {limit}) TO STDOUT{}",
            self.source.quoted(),
            self.page_format.copy_option()
        )
    }

    /// The largest integer key and the source clock read after the statement's snapshot
    /// (microseconds): one [`crate::id_tail::Sample`].
    pub fn key_sample(&self) -> String {
        format!(
            "SELECT max({})::bigint, (extract(epoch from {}) * 1000000)::bigint FROM {}",
            quote_ident(&self.key_columns[0]),
            source_clock_sql(),
            self.source.quoted()
        )
    }

    /// A key whose cursor is `'infinity'` or `'-infinity'` (its key values as text, then the
    /// value), and the newest finite cursor time (microseconds). No read window holds an
    /// infinite time; the newest one tells whether writers' times agree with the source clock.
    /// Two probes, the highest and the lowest cursor, each an `ORDER BY … LIMIT 1` that reads
    /// one entry of an index on the cursor. (A filter for the infinite values under `LIMIT 1`
    /// was planned as a sequential scan expected to stop early while the table had no
    /// statistics, and it reads the whole table when, as usual, no row matches.)
    pub fn cursor_extremes(&self) -> String {
        let cursor = self.cursor();
        let keys: Vec<String> = self
            .key_columns
            .iter()
            .map(|k| format!("{}::text", quote_ident(k)))
            .collect();
        let probe = |order: &str| {
            format!(
                "SELECT {cursor} AS c, ARRAY[{keys}, {cursor}::text] AS r FROM {table} WHERE {cursor} IS NOT NULL \
                 ORDER BY {cursor} {order} LIMIT 1",
                keys = keys.join(", "),
                table = self.source.quoted(),
            )
        };
        format!(
            "WITH hi AS ({hi}), lo AS ({lo}) \
             SELECT coalesce((SELECT r FROM hi WHERE c = 'infinity'), (SELECT r FROM lo WHERE c = '-infinity')), \
             (SELECT {newest} FROM hi WHERE isfinite(c))",
            hi = probe("DESC"),
            lo = probe("ASC"),
            newest = cursor_micros_expr("c", self.cursor_type(), self.cursor_zone.as_deref()),
        )
    }

    /// Rows of the staged batch that lie below the watermark `floor_micros` (found by the
    /// overlap re-read) and that the target does not hold at their version yet: late rows.
    /// Returns their lateness in microseconds, `high_micros − cursor time`.
    pub fn late_rows(&self, floor_micros: i64, high_micros: i64) -> String {
        let joins: Vec<String> = self
            .key_columns
            .iter()
            .map(|k| format!("t.{k} = s.{k}", k = quote_ident(k)))
            .collect();
        let version = quote_ident(VERSION_COLUMN);
        format!(
            "SELECT {high_micros} - {s_micros} FROM {stage} s LEFT JOIN {target} t ON {on} \
             WHERE {s_micros} < {floor_micros} AND (t.{version} IS NULL OR t.{version} < s.{version}){live}",
            live = if self.deletes.is_some() {
                format!(" AND NOT s.{}", quote_ident(DELETED_COLUMN))
            } else {
                String::new()
            },
            s_micros = format!("s.{}", quote_ident(CURSOR_MICROS_COLUMN)),
            stage = self.stage_table(),
            target = self.target.quoted(),
            on = joins.join(" AND "),
        )
    }

    /// The SELECT inside an incremental page's COPY, for `EXPLAIN`.
    pub fn explain_incremental_page(
        &self,
        range: &ShardRange,
        t_micros: i64,
        after_key: &[KeyValue],
        high: i64,
    ) -> String {
        let copy = self.incremental_page(range, t_micros, Some(after_key), high, 1000);
        let select = copy
            .trim_start_matches("COPY (")
            .trim_end_matches(self.page_format.copy_option())
            .trim_end_matches(") TO STDOUT");
        format!("EXPLAIN {select}")
    }

    /// The target table, created from the source's columns: the key as primary key and the
    /// source version column that guards against old values overwriting new ones.
    pub fn create_target_table(&self, not_null: &[bool]) -> String {
        let mut definitions: Vec<String> = self
            .columns
            .iter()
            .zip(not_null)
            .map(|(c, nn)| {
                format!(
                    "{} {}{}",
                    quote_ident(&c.name),
                    c.sql_type,
                    if *nn { " NOT NULL" } else { "" }
                )
            })
            .collect();
        definitions.push(format!("{} bigint NOT NULL", quote_ident(VERSION_COLUMN)));
        definitions.push(format!("PRIMARY KEY ({})", self.key_order()));
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({})",
            self.target.quoted(),
            definitions.join(", ")
        )
    }

    /// The session-local staging table a batch is copied into before the upsert. Its name
    /// carries a hash of the columns: a pooled session that staged for the table before its
    /// columns changed (`schema_changes = "evolve"`, `tasks reinit --alter-target`) creates a
    /// new one instead of copying into one of the old shape.
    pub fn stage_table(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        for column in &self.columns {
            hasher.update(column.name.as_bytes());
            hasher.update(b" ");
            hasher.update(column.sql_type.as_bytes());
            hasher.update(b"\n");
        }
        let shape = &hex::encode(hasher.finalize())[..8];
        quote_ident(&derived_name(
            "tidemark_stage_",
            &self.target.name,
            &format!("_{shape}"),
        ))
    }

    /// The stage table has the target's columns without their constraints (a tombstone
    /// carries only its key), plus the cursor time, the delete flag and the expected version.
    pub fn create_stage_table(&self) -> String {
        format!(
            "CREATE TEMP TABLE IF NOT EXISTS {} ON COMMIT DELETE ROWS AS SELECT {}, NULL::bigint AS {}, \
             false AS {}, NULL::bigint AS {} FROM {} WITH NO DATA",
            self.stage_table(),
            self.target_columns().join(", "),
            quote_ident(CURSOR_MICROS_COLUMN),
            quote_ident(DELETED_COLUMN),
            quote_ident(EXPECTED_COLUMN),
            self.target.quoted()
        )
    }

    /// `COPY stage (…) FROM STDIN` for the staged layout (plus the expected version in a
    /// repair batch), in the batch's format.
    pub fn copy_into_stage(&self, repair: bool, target_layout: bool, format: CopyFormat) -> String {
        let columns: Vec<String> = self
            .payload_columns(repair, target_layout)
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        format!(
            "COPY {} ({}) FROM STDIN{}",
            self.stage_table(),
            columns.join(", "),
            format.copy_option()
        )
    }

    /// The fields of a staged row in the given layout, in order, each quoted with the SQL type
    /// it was read as: the source columns, the version, then (staged layout) the cursor time
    /// and the delete flag, then (repair) the expected target version.
    pub fn payload_columns(&self, repair: bool, target_layout: bool) -> Vec<(String, String)> {
        let bigint = || "bigint".to_string();
        let mut columns: Vec<(String, String)> = self
            .columns
            .iter()
            .map(|c| (quote_ident(&c.name), c.sql_type.clone()))
            .collect();
        columns.push((quote_ident(VERSION_COLUMN), bigint()));
        if !target_layout {
            if self.cursor_column.is_some() {
                columns.push((quote_ident(CURSOR_MICROS_COLUMN), bigint()));
            }
            if self.deletes.is_some() {
                columns.push((quote_ident(DELETED_COLUMN), "boolean".into()));
            }
        }
        if repair {
            columns.push((quote_ident(EXPECTED_COLUMN), bigint()));
        }
        columns
    }

    /// `COPY target (…) FROM STDIN` for a batch in the target's layout whose keys the target
    /// does not hold (the snapshot's fast path).
    pub fn copy_into_target(&self, format: CopyFormat) -> String {
        format!(
            "COPY {} ({}) FROM STDIN{}",
            self.target.quoted(),
            self.target_columns().join(", "),
            format.copy_option()
        )
    }

    /// `t.k1 = s.k1 AND …` between two aliases.
    fn keys_equal(&self, left: &str, right: &str) -> String {
        self.key_columns
            .iter()
            .map(|k| format!("{left}.{k} = {right}.{k}", k = quote_ident(k)))
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    /// The statements that apply a staged batch, in order, inside its one transaction:
    /// (repair) replace rows whose target version the comparison saw, (deletes) record
    /// tombstones and delete or flag the rows they cover, then the versioned upsert.
    pub fn apply_statements(&self, repair: bool, read: Read) -> Vec<String> {
        let target = self.target.quoted();
        let stage = self.stage_table();
        let version = quote_ident(VERSION_COLUMN);
        let mut statements = Vec::new();
        if repair {
            // The source is authoritative: a row the comparison saw at a version the source no
            // longer has (e.g. a backdated update) is replaced, but only if it is still the
            // row the comparison saw (a newer change applied meanwhile stays).
            statements.push(format!(
                "DELETE FROM {target} t USING {stage} s WHERE {on} AND s.{expected} IS NOT NULL \
                 AND t.{version} = s.{expected} AND t.{version} > s.{version}",
                on = self.keys_equal("t", "s"),
                expected = quote_ident(EXPECTED_COLUMN),
            ));
        }
        if let Some(deletes) = &self.deletes {
            if repair {
                // The source holds these rows live now, so any kept tombstone of their keys is
                // stale (a tie of cursor times, a re-insert with a lower version): lift it, or
                // it would keep the repaired row out while the run counts it repaired.
                statements.push(format!(
                    "DELETE FROM {tombs} d USING {stage} s WHERE {on} AND NOT s.{deleted}",
                    tombs = deletes.tombstones.quoted(),
                    on = self.keys_equal("d", "s"),
                    deleted = quote_ident(DELETED_COLUMN),
                ));
            }
            statements.extend(deletes.apply_tombstones(self));
        }
        statements.push(self.upsert_from_stage(read));
        statements
    }

    /// The versioned upsert: an older source version never overwrites a newer one, and a
    /// kept tombstone blocks every version up to its own. Rows go in key order: an incremental
    /// page comes in cursor order, and key order turns its random index and heap visits into
    /// a forward walk.
    ///
    /// A row equal to the target's in every column and version (the overlap re-reads each
    /// cycle's last `overlap` of changes; a replay repeats a batch) is left alone instead of
    /// rewritten: no new row version, no WAL. Only when every column's type has an equality
    /// operator (see [`has_equality`]); otherwise such rows are rewritten, which is harmless.
    pub fn upsert_from_stage(&self, read: Read) -> String {
        let mut columns = self.target_columns();
        let mut values: Vec<String> = columns.iter().map(|c| format!("s.{c}")).collect();
        let mut conditions = Vec::new();
        if let Some(deletes) = &self.deletes {
            if deletes.target_soft {
                columns.push(quote_ident(DELETED_COLUMN));
                values.push(format!("s.{}", quote_ident(DELETED_COLUMN)));
            }
            if !deletes.upserts_tombstone_rows() {
                conditions.push(format!("NOT s.{}", quote_ident(DELETED_COLUMN)));
            }
            conditions.push(deletes.not_blocked_by_tombstone(self, "s"));
        }
        let version = quote_ident(VERSION_COLUMN);
        // The version first: a changed row differs there, and the comparison stops.
        let mut updated: Vec<&String> = columns
            .iter()
            .filter(|c| !self.key_columns.iter().any(|k| quote_ident(k) == **c))
            .collect();
        updated.sort_by_key(|c| **c != version);
        let updates: Vec<String> = updated.iter().map(|c| format!("{c} = EXCLUDED.{c}")).collect();
        let mut guard = format!("t.{version} <= EXCLUDED.{version}");
        if read == Read::Earlier {
            guard = format!("t.{version} < EXCLUDED.{version}");
        } else if self.columns.iter().all(|c| has_equality(&c.sql_type)) {
            let side = |alias: &str| {
                updated
                    .iter()
                    .map(|c| format!("{alias}.{c}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            guard = format!(
                "{guard} AND ROW({}) IS DISTINCT FROM ROW({})",
                side("t"),
                side("EXCLUDED")
            );
        }
        let where_clause = if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        };
        format!(
            "INSERT INTO {target} AS t ({cols}) SELECT {values} FROM {stage} s{where_clause} ORDER BY {s_keys} \
             ON CONFLICT ({keys}) DO UPDATE SET {updates} WHERE {guard}",
            s_keys = self
                .key_columns
                .iter()
                .map(|k| format!("s.{}", quote_ident(k)))
                .collect::<Vec<_>>()
                .join(", "),
            target = self.target.quoted(),
            cols = columns.join(", "),
            values = values.join(", "),
            stage = self.stage_table(),
            keys = self.key_order(),
            updates = updates.join(", "),
        )
    }
}

/// How recent a write's rows are as reads of the source; it decides a tie of versions whose
/// content differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// A batch's rows are the latest read of their keys: a shard's batches apply in the order
    /// they were read, a replay repeats the latest (and the ledger makes it a no-op), and a
    /// zombie's batch is refused at register. At an equal version they replace other content:
    /// two updates within one unit of the cursor's precision leave the later one.
    Latest,
    /// A dead letter's payload was read before the rows applied since: at an equal version
    /// the target's content stays, since it may be newer (a repair, a later read).
    Earlier,
}

/// A table's columns in order: name, type as `format_type` prints it, whether the type is
/// built in (a binary array or record names its element types by OID, which differ between
/// databases), and NOT NULL. `$1`: the quoted table name. The planner's introspection and the
/// worker's type checks both read it.
pub const COLUMN_TYPES: &str = "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.atttypid < 16384, \
     a.attnotnull FROM pg_attribute a WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped \
     ORDER BY a.attnum";

/// A table's columns: name, type (as `format_type` prints it) and whether it is built in.
pub type ColumnTypes = Vec<(String, String, bool)>;

/// [`ColumnTypes`] of `table`, read on `conn`.
pub async fn column_types(conn: impl sqlx::PgExecutor<'_>, table: &TableName) -> Result<ColumnTypes, sqlx::Error> {
    let rows: Vec<(String, String, bool, bool)> = sqlx::query_as(COLUMN_TYPES)
        .bind(table.quoted())
        .fetch_all(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(name, sql_type, built_in, _)| (name, sql_type, built_in))
        .collect())
}

impl TableSql {
    /// Whether every task column is in `types` (one table's [`COLUMN_TYPES`]) with the same
    /// type, modifiers included.
    pub fn columns_match(&self, types: &[(String, String, bool)]) -> bool {
        self.columns
            .iter()
            .all(|c| types.iter().any(|(n, t, _)| *n == c.name && *t == c.sql_type))
    }

    /// Whether binary pages can go from the source into the target: the task's columns match
    /// `types` and are all of built-in types; in the target (`target`) the version column is a
    /// `bigint`.
    pub fn binary_types_match(&self, types: &[(String, String, bool)], target: bool) -> bool {
        let find = |name: &str| types.iter().find(|(n, _, _)| n == name);
        self.columns_match(types)
            && self
                .columns
                .iter()
                .all(|c| find(&c.name).is_some_and(|(_, _, builtin)| *builtin))
            && (!target || find(VERSION_COLUMN).is_some_and(|(_, t, _)| t == "bigint"))
    }
}

/// Whether values of a type compare with `IS DISTINCT FROM`: built-in types with an equality
/// operator, and arrays of them. (`json`, `xml`, geometric types and unknown types are
/// left out.)
pub fn has_equality(sql_type: &str) -> bool {
    let base = sql_type.trim_end_matches("[]");
    let name = base.split_once('(').map_or(base, |(name, _)| name).trim();
    matches!(
        name,
        "smallint"
            | "integer"
            | "bigint"
            | "numeric"
            | "real"
            | "double precision"
            | "money"
            | "text"
            | "character varying"
            | "character"
            | "name"
            | "boolean"
            | "uuid"
            | "jsonb"
            | "bytea"
            | "date"
            | "interval"
            | "inet"
            | "cidr"
            | "macaddr"
            | "bit"
            | "bit varying"
            | "oid"
    ) || name == "time"
        || name.starts_with("timestamp")
        || name.starts_with("time ")
}

/// Every setting that changes how a value is written as text, read from text or hashed,
/// pinned on every Tidemark session (source, target and control), whatever the database,
/// the role or the URL's `options` set. COPY text pages are rendered by the source and
/// parsed by the target: an `IntervalStyle = sql_standard` source writes `-1 day -2 hours`
/// as `-1 2:00:00`, which a `postgres`-style target reads as `-1 day +02:00:00`.
/// Reconciliation hashes the same text on both sides. Appended last, so they win over the
/// URL's own `options`. The literal quoting above relies on standard-conforming strings;
/// the ON CONFLICT guards rely on READ COMMITTED.
pub const SESSION_SETTINGS: &[(&str, &str)] = &[
    ("DateStyle", "ISO, MDY"),
    ("IntervalStyle", "postgres"),
    ("TimeZone", "UTC"),
    ("extra_float_digits", "3"),
    ("bytea_output", "hex"),
    ("lc_monetary", "C"),
    ("standard_conforming_strings", "on"),
    ("client_encoding", "UTF8"),
    ("default_transaction_isolation", "read committed"),
];

/// Connection options for every Tidemark session: the pinned [`SESSION_SETTINGS`] and an
/// application name that shows in `pg_stat_activity`.
pub fn connect_options(url: &str, application_name: &str) -> Result<sqlx::postgres::PgConnectOptions, String> {
    let options: sqlx::postgres::PgConnectOptions = url
        .parse()
        .map_err(|e| format!("{}: {e}", crate::redact::redact_url(url)))?;
    Ok(options
        .application_name(application_name)
        .extra_float_digits(3)
        .options(SESSION_SETTINGS.iter().copied()))
}

/// A lazily connecting pool whose sessions never hold a lock or an idle transaction longer
/// than `guard` (`lock_timeout`, `idle_in_transaction_session_timeout`): a stopped zombie
/// cannot block a shard's next owner.
pub fn guarded_pool(
    url: &str,
    application_name: &str,
    max_connections: u32,
    guard: std::time::Duration,
) -> Result<sqlx::postgres::PgPool, String> {
    let guard_ms = guard.as_millis().max(1000).to_string();
    let options = connect_options(url, application_name)?.options([
        ("lock_timeout", guard_ms.as_str()),
        ("idle_in_transaction_session_timeout", guard_ms.as_str()),
    ]);
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect_lazy_with(options))
}

/// One unit of a timestamp type's precision in microseconds: `timestamp(3)` → 1,000. Stored
/// values are rounded to it, so a row written at time `x` may carry a cursor time up to half a
/// unit below `x`; bounds derived from transaction start times step one unit down.
pub fn timestamp_unit_micros(sql_type: &str) -> i64 {
    let precision = sql_type
        .split_once('(')
        .and_then(|(_, rest)| rest.split_once(')'))
        .and_then(|(digits, _)| digits.trim().parse::<u32>().ok())
        .unwrap_or(6)
        .min(6);
    10_i64.pow(6 - precision)
}

/// The SQL expression read as the source's clock. `TIDEMARK_SOURCE_CLOCK_SQL` replaces it in
/// tests that need a clock that jumps (a test hook; never set it in production).
pub fn source_clock_sql() -> String {
    std::env::var("TIDEMARK_SOURCE_CLOCK_SQL").unwrap_or_else(|_| "clock_timestamp()".to_string())
}

/// The source clock in microseconds since the Unix epoch.
pub fn source_now_query() -> String {
    format!("SELECT (extract(epoch from {}) * 1000000)::bigint", source_clock_sql())
}

/// Whether a driver error is worth retrying (the server is unreachable or restarting), as
/// opposed to a problem that retrying cannot fix (bad credentials, missing database, SQL).
pub fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            // admin_shutdown, crash_shutdown, cannot_connect_now, serialization, deadlock
            Some("57P01") | Some("57P02") | Some("57P03") | Some("40001") | Some("40P01")
        ),
        _ => false,
    }
}

/// The row error class of an SQLSTATE (PostgreSQL's condition names).
pub fn row_error_class(code: &str) -> Option<String> {
    let name = match code {
        "22001" => "string_data_right_truncation",
        "22003" => "numeric_value_out_of_range",
        "22007" => "invalid_datetime_format",
        "22008" => "datetime_field_overflow",
        "22012" => "division_by_zero",
        "22021" => "character_not_in_repertoire",
        "22023" => "invalid_parameter_value",
        "22P02" => "invalid_text_representation",
        "22P03" => "invalid_binary_representation",
        "22P04" => "bad_copy_file_format",
        "22P05" => "untranslatable_character",
        "23502" => "not_null_violation",
        "23503" => "foreign_key_violation",
        "23505" => "unique_violation",
        "23514" => "check_violation",
        "54000" => "program_limit_exceeded",
        other if other.starts_with("22") || other.starts_with("23") => {
            return Some(format!("sqlstate_{other}"));
        }
        _ => return None,
    };
    Some(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_column_set_gets_its_own_stage_table() {
        // A pooled session keeps its temporary stage table: after the target's columns
        // change, copying into the old one would fail (or miss the new column).
        let before = items();
        let mut added = items();
        added.columns.push(Column {
            name: "color".into(),
            sql_type: "text".into(),
        });
        let mut retyped = items();
        retyped.columns[1].sql_type = "bigint".into();
        assert_ne!(before.stage_table(), added.stage_table());
        assert_ne!(before.stage_table(), retyped.stage_table());
        assert_eq!(before.stage_table(), items().stage_table());
        assert!(
            before.stage_table().starts_with("\"tidemark_stage_items_"),
            "{}",
            before.stage_table()
        );
    }

    fn items() -> TableSql {
        TableSql {
            source: TableName::parse("public.items").unwrap(),
            target: TableName::parse("items").unwrap(),
            columns: vec![
                Column {
                    name: "id".into(),
                    sql_type: "bigint".into(),
                },
                Column {
                    name: "updated_at".into(),
                    sql_type: "timestamp(3) with time zone".into(),
                },
                Column {
                    name: "na\"me".into(),
                    sql_type: "text".into(),
                },
            ],
            key_columns: vec!["id".into()],
            cursor_column: Some("updated_at".into()),
            version_column: None,
            deletes: None,
            filter: None,
            page_format: CopyFormat::Text,
            cursor_zone: None,
        }
    }

    #[test]
    fn timestamp_units() {
        assert_eq!(timestamp_unit_micros("timestamp(3) with time zone"), 1_000);
        assert_eq!(timestamp_unit_micros("timestamp(0) without time zone"), 1_000_000);
        assert_eq!(timestamp_unit_micros("timestamp with time zone"), 1);
    }

    #[test]
    fn a_newer_epoch_writes_its_own_table_beside_the_live_one() {
        let items = TableName::parse("app.items").unwrap();
        assert_eq!(items.epoch_table(7).to_string(), "app.items__tm_e7");
        let long = TableName::parse(&"t".repeat(70)).unwrap().epoch_table(12);
        assert!(
            long.name.len() <= MAX_IDENTIFIER_BYTES && long.name.ends_with("__tm_e12"),
            "{long}"
        );
    }

    #[test]
    fn derived_names_are_bounded_and_distinct() {
        assert_eq!(
            derived_name("tidemark_tombstones_", "items", ""),
            "tidemark_tombstones_items"
        );
        let a = "orders_archive_for_the_european_customers_of_fiscal_year_2025";
        let b = "orders_archive_for_the_european_customers_of_fiscal_year_2026";
        let (da, db) = (
            derived_name("", a, "_tidemark_deletes"),
            derived_name("", b, "_tidemark_deletes"),
        );
        assert_ne!(da, db);
        assert!(
            da.len() <= MAX_IDENTIFIER_BYTES && db.len() <= MAX_IDENTIFIER_BYTES,
            "{da} {db}"
        );
        assert!(
            da.ends_with("_tidemark_deletes") && da.starts_with("orders_archive"),
            "{da}"
        );
        // Multi-byte characters are never split.
        let wide = "ä".repeat(40);
        let name = derived_name("tidemark_tombstones_", &wide, "");
        assert!(name.len() <= MAX_IDENTIFIER_BYTES, "{name}");
    }

    #[test]
    fn quoting_escapes_embedded_quotes() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert!(TableName::parse("a.b.c").is_err());
    }

    #[test]
    fn incremental_page_is_a_row_comparison_below_high() {
        let sql = items().incremental_page(
            &ShardRange {
                lo: None,
                hi: Some(KeyValue {
                    sql_type: "bigint".into(),
                    value: "100".into(),
                }),
            },
            1_000_000,
            Some(&[KeyValue {
                sql_type: "bigint".into(),
                value: "7".into(),
            }]),
            2_000_000,
            500,
        );
        assert!(sql.contains("\"id\" < '100'::bigint"), "{sql}");
        assert!(sql.contains("(\"updated_at\", \"id\") > ((\'1970-01-01 00:00:00+00\'::timestamptz + 1000000 * interval '1 microsecond'), '7'::bigint)"), "{sql}");
        assert!(sql.contains("ORDER BY \"updated_at\", \"id\" LIMIT 500"), "{sql}");
    }

    #[test]
    fn upsert_is_guarded_by_version() {
        let sql = items().upsert_from_stage(Read::Latest);
        assert!(
            sql.contains("WHERE t.\"_tidemark_version\" <= EXCLUDED.\"_tidemark_version\""),
            "{sql}"
        );
        assert!(sql.contains("\"na\"\"me\" = EXCLUDED.\"na\"\"me\""), "{sql}");
        assert!(!sql.contains("\"id\" = EXCLUDED"), "{sql}");
        // Unchanged rows are not rewritten; the version is compared first.
        assert!(
            sql.contains(
                "ROW(t.\"_tidemark_version\", t.\"updated_at\", t.\"na\"\"me\") IS DISTINCT FROM \
                 ROW(EXCLUDED.\"_tidemark_version\", EXCLUDED.\"updated_at\", EXCLUDED.\"na\"\"me\")"
            ),
            "{sql}"
        );
        let mut with_json = items();
        with_json.columns[2].sql_type = "json".into();
        assert!(!with_json.upsert_from_stage(Read::Latest).contains("IS DISTINCT FROM"));
        // A dead-letter retry never replaces a row of its own version.
        assert!(
            items()
                .upsert_from_stage(Read::Earlier)
                .contains("WHERE t.\"_tidemark_version\" < EXCLUDED.\"_tidemark_version\""),
        );
    }

    #[test]
    fn equality_is_known_for_built_in_types_only() {
        for t in [
            "bigint",
            "numeric(12,2)",
            "character varying(16)",
            "timestamp(3) with time zone",
            "time without time zone",
            "jsonb",
            "text[]",
            "interval",
        ] {
            assert!(has_equality(t), "{t}");
        }
        for t in ["json", "xml", "point", "json[]", "my_enum", "tsvector"] {
            assert!(!has_equality(t), "{t}");
        }
    }
}
