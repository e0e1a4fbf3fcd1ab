//! MySQL and MariaDB as a target: the table a task creates there, the ledger, epoch and
//! dead-letter tables in InnoDB, and the statements that write a staged batch.
//!
//! The staged batch is the neutral format every pair shares: COPY text of PostgreSQL types
//! (a MySQL source renders its pages that way too, see [`super::types::text_expr`]). Here
//! each field becomes a MySQL literal of the column's mapped type ([`column_type`],
//! [`literal`]) and the rows go in as large multi-row statements, never one round trip per
//! row. The versioned upsert is `INSERT … ON DUPLICATE KEY UPDATE` with every assignment
//! guarded by the version and the version assigned last: MySQL evaluates the assignments left
//! to right, each seeing the ones before it, so the guard reads the row's old version in every
//! assignment.

use super::{quote_ident, quote_literal};
use crate::copy_text;
use crate::pg::accumulate::WEIGHT_COLUMN;
use crate::pg::{Read, TableName, TableSql, VERSION_COLUMN};
use crate::transform::{AccumulateSpec, AggregateFunction, RowError};

/// Longest text key, in characters: InnoDB keys hold at most 3072 bytes (768 utf8mb4
/// characters). A longer key is a row the target rejects (a dead letter).
pub const TEXT_KEY_CHARS: u32 = 768;

/// A statement of a batch is cut after this many bytes of values (MariaDB's
/// `max_allowed_packet` is 16 MiB by default, MySQL 8's 64 MiB).
pub const STATEMENT_BYTES: usize = 4 << 20;

/// The ledger, epochs and dead-letter tables, one statement each (InnoDB: they commit with
/// the batch's rows).
pub const CONTROL_DDL: [(&str, &str); 3] = [
    (
        "tidemark_ledger",
        "CREATE TABLE IF NOT EXISTS tidemark_ledger (
            batch_id      VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PRIMARY KEY,
            task          VARCHAR(255) NOT NULL,
            epoch         BIGINT NOT NULL,
            shard_id      INT NOT NULL,
            row_count     BIGINT NOT NULL,
            content_hash  VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
            fence         BIGINT NOT NULL,
            dead_letters  BIGINT NOT NULL DEFAULT 0,
            applied_at    DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
    ),
    (
        "tidemark_epochs",
        "CREATE TABLE IF NOT EXISTS tidemark_epochs (
            task      VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PRIMARY KEY,
            epoch     BIGINT NOT NULL,
            swapping  BIGINT NULL
        ) ENGINE = InnoDB",
    ),
    (
        "tidemark_dead_letters",
        "CREATE TABLE IF NOT EXISTS tidemark_dead_letters (
            task            VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            `key`           VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
            shard_id        INT NOT NULL,
            batch_id        VARCHAR(255) NOT NULL,
            payload         LONGBLOB NOT NULL,
            payload_layout  VARCHAR(32) NOT NULL,
            error_class     VARCHAR(64) NOT NULL,
            message         TEXT NOT NULL,
            status          VARCHAR(16) NOT NULL DEFAULT 'INIT'
                            CHECK (status IN ('INIT', 'RETRY', 'PROCESSING', 'RESOLVED', 'FAILED')),
            retry_count     INT NOT NULL DEFAULT 0,
            claimed_by      VARCHAR(255),
            claimed_at      DATETIME(6),
            created_at      DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
            updated_at      DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
            PRIMARY KEY (task, `key`),
            KEY tidemark_dead_letters_status (task, status)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
    ),
];

/// The task's live epoch in the target and the epoch a swap is making live (see
/// [`SWAP_BEGIN`]), read under a shared row lock: a swap marks the row under an exclusive
/// one, so no batch is between this read and its commit when the tables are renamed.
pub const TARGET_EPOCH: &str = "SELECT epoch, swapping FROM tidemark_epochs WHERE task = ? LOCK IN SHARE MODE";
/// `tidemark_epochs` of a target that predates swaps has no `swapping` column.
pub const HAS_SWAPPING: &str = "SELECT COUNT(*) FROM information_schema.columns WHERE table_schema = DATABASE() \
     AND table_name = 'tidemark_epochs' AND column_name = 'swapping'";
pub const ADD_SWAPPING: &str = "ALTER TABLE tidemark_epochs ADD COLUMN swapping BIGINT NULL";
/// A swap's first step (`?` epoch, `?` task), committed alone: MySQL's RENAME TABLE commits
/// implicitly, so the row lock cannot span it. Every batch that reads the mark refuses
/// itself until the swap ends ([`SWAP_END`]).
pub const SWAP_BEGIN: &str = "UPDATE tidemark_epochs SET swapping = ? WHERE task = ?";
/// A swap's last step (`?` epoch, `?` task), after the RENAME.
pub const SWAP_END: &str = "UPDATE tidemark_epochs SET epoch = ?, swapping = NULL WHERE task = ?";
pub const TARGET_EPOCH_NOW: &str = "SELECT epoch FROM tidemark_epochs WHERE task = ?";
/// Records the task's epoch when it has none (so every batch has a row to lock).
pub const SEED_TARGET_EPOCH: &str = "INSERT IGNORE INTO tidemark_epochs (task, epoch) VALUES (?, ?)";
pub const LEDGER_HAS: &str = "SELECT 1 FROM tidemark_ledger WHERE batch_id = ?";
pub const LEDGER_ROW: &str = "SELECT row_count, content_hash FROM tidemark_ledger WHERE batch_id = ?";
pub const LEDGER_INSERT: &str = "INSERT IGNORE INTO tidemark_ledger \
     (batch_id, task, epoch, shard_id, row_count, content_hash, fence, dead_letters) VALUES (?, ?, ?, ?, ?, ?, ?, ?)";

/// `database.table`, quoted.
pub fn quoted_table(table: &TableName) -> String {
    format!("{}.{}", quote_ident(&table.schema), quote_ident(&table.name))
}

/// The MySQL type a column of PostgreSQL type `pg_type` (the staged vocabulary) is stored as.
/// Key columns need a bounded type (InnoDB indexes no `TEXT` or `BLOB` whole). Types with no
/// MySQL counterpart (intervals, arrays, network and geometric types, …) keep PostgreSQL's
/// text form in a text column, which loses nothing.
pub fn column_type(pg_type: &str, key: bool) -> String {
    let t = pg_type.trim();
    let (base, modifier) = match t.split_once('(') {
        Some((base, rest)) => {
            let (modifier, tail) = rest.split_once(')').unwrap_or((rest, ""));
            (format!("{}{}", base.trim(), tail), Some(modifier.replace(' ', "")))
        }
        None => (t.to_string(), None),
    };
    let text = |chars: Option<u32>| match chars {
        Some(n) if n <= 16383 && (!key || n <= TEXT_KEY_CHARS) => format!("VARCHAR({n})"),
        _ if key => format!("VARCHAR({TEXT_KEY_CHARS})"),
        _ => "LONGTEXT".to_string(),
    };
    let length = modifier.as_deref().and_then(|m| m.parse::<u32>().ok());
    match base.as_str() {
        "smallint" | "int2" => "SMALLINT".into(),
        "integer" | "int" | "int4" => "INT".into(),
        "bigint" | "int8" => "BIGINT".into(),
        "numeric" | "decimal" => match modifier.as_deref().map(|m| m.split_once(',').unwrap_or((m, "0"))) {
            Some((p, s)) if p.parse::<u32>().is_ok_and(|p| p <= 65) && s.parse::<u32>().is_ok_and(|s| s <= 30) => {
                format!("DECIMAL({p},{s})")
            }
            _ => "DECIMAL(65,30)".into(),
        },
        "real" | "float4" => "FLOAT".into(),
        "double precision" | "float8" => "DOUBLE".into(),
        "boolean" | "bool" => "TINYINT(1)".into(),
        "text" => text(None),
        "character varying" | "varchar" => text(length),
        "character" | "char" | "bpchar" => match length {
            Some(n) if n <= 255 => format!("CHAR({n})"),
            _ => text(length),
        },
        "bytea" if key => "VARBINARY(3072)".into(),
        "bytea" => "LONGBLOB".into(),
        "bit" => match length {
            Some(n) if n <= 64 => format!("BIT({n})"),
            _ => text(length),
        },
        "date" => "DATE".into(),
        "timestamp without time zone" | "timestamp" => format!("DATETIME({})", fraction(length)),
        // An instant, stored as its UTC time (`TIMESTAMP` ends in 2038).
        "timestamp with time zone" | "timestamptz" => format!("DATETIME({})", fraction(length)),
        "time without time zone" | "time" => format!("TIME({})", fraction(length)),
        "uuid" => "CHAR(36) CHARACTER SET ascii".into(),
        "json" | "jsonb" if !key => "JSON".into(),
        _ => text(None),
    }
}

/// Fractional digits of a time type: PostgreSQL's default and maximum is 6, as is MySQL's
/// maximum.
fn fraction(precision: Option<u32>) -> u32 {
    precision.unwrap_or(6).min(6)
}

/// A type's name without its modifier: `timestamp with time zone` of
/// `timestamp(6) with time zone`.
fn base_name(pg_type: &str) -> String {
    match pg_type.split_once('(') {
        Some((head, rest)) => {
            let tail = rest.split_once(')').map_or("", |(_, tail)| tail);
            format!("{}{tail}", head.trim())
        }
        None => pg_type.trim().to_string(),
    }
}

fn is_type(pg_type: &str, names: &[&str]) -> bool {
    names.contains(&base_name(pg_type).as_str())
}

/// How a staged field of one PostgreSQL type is written as a MySQL literal; decided once per
/// column, not per value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiteralKind {
    Bytea,
    Boolean,
    /// A `bit(n)` mapped to MySQL's `BIT(n)`.
    Bit,
    TimestampTz,
    Text,
}

impl LiteralKind {
    pub fn of(pg_type: &str) -> LiteralKind {
        if is_type(pg_type, &["bytea"]) {
            LiteralKind::Bytea
        } else if is_type(pg_type, &["boolean", "bool"]) {
            LiteralKind::Boolean
        } else if is_type(pg_type, &["bit"]) && column_type(pg_type, false).starts_with("BIT") {
            LiteralKind::Bit
        } else if is_type(pg_type, &["timestamp with time zone", "timestamptz"]) {
            LiteralKind::TimestampTz
        } else {
            LiteralKind::Text
        }
    }
}

/// One staged field (raw COPY text) as a MySQL literal of the column the type `pg_type`
/// maps to. A field that cannot be decoded is the row's error; a value the column refuses
/// (too long, out of range, a malformed date) is left for the server to refuse, in strict
/// mode, as a row error.
pub fn literal(pg_type: &str, raw: &[u8]) -> Result<String, RowError> {
    let mut out = String::new();
    write_literal(LiteralKind::of(pg_type), raw, &mut out)?;
    Ok(out)
}

/// [`literal`] appended to `out` (a statement being built), with the column's kind.
pub fn write_literal(kind: LiteralKind, raw: &[u8], out: &mut String) -> Result<(), RowError> {
    // Most fields carry no COPY escape: their bytes are the value.
    let decoded;
    let bytes: &[u8] = if raw.contains(&b'\\') {
        match copy_text::decode_bytes(raw).map_err(|e| RowError::new("bad_copy_file_format", e))? {
            None => {
                out.push_str("NULL");
                return Ok(());
            }
            Some(bytes) => {
                decoded = bytes;
                &decoded
            }
        }
    } else {
        raw
    };
    if kind == LiteralKind::Bytea {
        let hex = bytes.strip_prefix(b"\\x").ok_or_else(|| {
            RowError::new(
                "invalid_binary_representation",
                "bytea value is not in hex format (\\x…)".to_string(),
            )
        })?;
        if !hex.iter().all(u8::is_ascii_hexdigit) || hex.len() % 2 == 1 {
            return Err(RowError::new(
                "invalid_binary_representation",
                "bytea value has a bad hex digit".to_string(),
            ));
        }
        out.push_str("X'");
        out.push_str(std::str::from_utf8(hex).expect("hex digits"));
        out.push('\'');
        return Ok(());
    }
    let Ok(text) = std::str::from_utf8(bytes) else {
        // Bytes of another character set: the column converts them, or refuses the row.
        out.push_str("X'");
        out.push_str(&hex::encode(bytes));
        out.push('\'');
        return Ok(());
    };
    match kind {
        LiteralKind::Boolean if matches!(text, "t" | "true") => out.push('1'),
        LiteralKind::Boolean if matches!(text, "f" | "false") => out.push('0'),
        LiteralKind::Bit => {
            out.push('b');
            push_quoted(text, out);
        }
        LiteralKind::TimestampTz => push_utc_time(text, out),
        _ => push_quoted(text, out),
    }
    Ok(())
}

/// `'text'`, quotes doubled (the whole escaping under `NO_BACKSLASH_ESCAPES`).
fn push_quoted(text: &str, out: &mut String) {
    out.push('\'');
    for (i, part) in text.split('\'').enumerate() {
        if i > 0 {
            out.push_str("''");
        }
        out.push_str(part);
    }
    out.push('\'');
}

/// A `timestamp with time zone` as the UTC `DATETIME` literal `'YYYY-MM-DD HH:MM:SS.ffffff'`;
/// a text that does not parse is left for the server to refuse. PostgreSQL sources render it
/// in UTC (`+00`), which is read without chrono.
fn push_utc_time(text: &str, out: &mut String) {
    if let Some(utc) = text.strip_suffix("+00")
        && crate::text_to_binary::timestamp_micros(utc.as_bytes()).is_ok()
    {
        let (time, fraction) = utc.split_at(19);
        out.push('\'');
        out.push_str(time);
        out.push('.');
        let digits = fraction.strip_prefix('.').unwrap_or("");
        out.push_str(digits);
        out.extend(std::iter::repeat_n('0', 6 - digits.len()));
        out.push('\'');
        return;
    }
    match chrono::DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z") {
        Ok(instant) => push_quoted(&instant.naive_utc().format("%Y-%m-%d %H:%M:%S%.6f").to_string(), out),
        Err(_) => push_quoted(text, out),
    }
}

/// The target table, created from the source's columns (in their mapped types): the key as
/// primary key, and the version that guards against old values overwriting new ones. Text is
/// compared byte for byte without padding (`collation`): keys distinct in the source stay
/// distinct here whatever the source's collation.
pub fn create_target_table(sql: &TableSql, not_null: &[bool], collation: &str) -> String {
    let mut definitions: Vec<String> = sql
        .columns
        .iter()
        .zip(not_null)
        .map(|(c, nn)| {
            let key = sql.key_columns.contains(&c.name);
            format!(
                "{} {}{}",
                quote_ident(&c.name),
                column_type(&c.sql_type, key),
                if *nn || key { " NOT NULL" } else { "" }
            )
        })
        .collect();
    definitions.push(format!("{} BIGINT NOT NULL", quote_ident(VERSION_COLUMN)));
    if sql.deletes.as_ref().is_some_and(|d| d.target_soft) {
        definitions.push(format!(
            "{} TINYINT(1) NOT NULL DEFAULT 0",
            quote_ident(crate::pg::DELETED_COLUMN)
        ));
    }
    definitions.push(format!("PRIMARY KEY ({})", key_list(&sql.key_columns)));
    format!(
        "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}",
        quoted_table(&sql.target),
        definitions.join(", ")
    )
}

/// Adds a column the source gained (nullable, in the table's default collation), unless it is
/// there already.
pub fn add_column(table: &TableName, column: &crate::pg::Column) -> String {
    format!(
        "ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}",
        quoted_table(table),
        quote_ident(&column.name),
        column_type(&column.sql_type, false)
    )
}

/// The kept tombstones of a task with a delete policy: its key columns (mapped as keys) and
/// the version.
pub fn create_tombstone_table(sql: &TableSql, tombstones: &TableName, collation: &str) -> String {
    let mut definitions: Vec<String> = sql
        .key_columns
        .iter()
        .zip(sql.key_types())
        .map(|(k, t)| format!("{} {} NOT NULL", quote_ident(k), column_type(&t, true)))
        .collect();
    definitions.push(format!("{} BIGINT NOT NULL", quote_ident(VERSION_COLUMN)));
    definitions.push(format!("PRIMARY KEY ({})", key_list(&sql.key_columns)));
    format!(
        "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}",
        quoted_table(tombstones),
        definitions.join(", ")
    )
}

/// Adds the soft-delete flag to a target table that lacks it.
pub fn add_soft_delete_column(sql: &TableSql) -> String {
    format!(
        "ALTER TABLE {} ADD COLUMN {} TINYINT(1) NOT NULL DEFAULT 0",
        quoted_table(&sql.target),
        quote_ident(crate::pg::DELETED_COLUMN)
    )
}

/// The binary collation without padding: `utf8mb4_nopad_bin` on MariaDB, `utf8mb4_0900_bin`
/// on MySQL 8 (`version` as `SELECT VERSION()` prints it).
pub fn exact_collation(version: &str) -> &'static str {
    if version.contains("MariaDB") {
        "utf8mb4_nopad_bin"
    } else {
        "utf8mb4_0900_bin"
    }
}

fn key_list(keys: &[String]) -> String {
    keys.iter().map(|k| quote_ident(k)).collect::<Vec<_>>().join(", ")
}

/// The statements writing a batch's rows (staged layout or target layout) with the versioned
/// upsert, each at most about [`STATEMENT_BYTES`]. `Err((row index, error))` names the first
/// row that cannot be rendered.
pub fn upsert_statements(
    sql: &TableSql,
    target_layout: bool,
    rows: &[&[u8]],
    read: Read,
) -> Result<Vec<String>, (usize, RowError)> {
    if let Some(deletes) = &sql.deletes {
        return delete_aware_statements(sql, deletes, rows, read);
    }
    let _ = target_layout; // the target's columns come first in either layout
    let width = sql.columns.len() + 1;
    let types: Vec<&str> = sql.columns.iter().map(|c| c.sql_type.as_str()).collect();
    let mut columns: Vec<String> = sql.columns.iter().map(|c| quote_ident(&c.name)).collect();
    columns.push(quote_ident(VERSION_COLUMN));
    let head = format!(
        "INSERT INTO {} ({}) VALUES ",
        quoted_table(&sql.target),
        columns.join(", ")
    );
    let tail = upsert_tail(sql, read, &[]);
    let kinds: Vec<LiteralKind> = types.iter().map(|t| LiteralKind::of(t)).collect();
    let mut statements = Vec::new();
    let mut current = String::new();
    // The rows' bytes not yet written: a statement's buffer is sized once for what it will
    // hold (literals add quotes and commas to the staged text).
    let mut left: usize = rows.iter().map(|r| r.len() + 4).sum();
    for (index, row) in rows.iter().enumerate() {
        let mut fields = row.split(|b| *b == b'\t');
        if current.is_empty() {
            current.reserve((head.len() + left * 5 / 4 + tail.len()).min(STATEMENT_BYTES + STATEMENT_BYTES / 4));
            current.push_str(&head);
        } else {
            current.push(',');
        }
        current.push('(');
        for position in 0..width {
            let raw = fields.next().ok_or_else(|| {
                (
                    index,
                    RowError::new("bad_copy_file_format", format!("row has fewer than {width} fields")),
                )
            })?;
            if position > 0 {
                current.push(',');
            }
            let written = if position < kinds.len() {
                write_literal(kinds[position], raw, &mut current)
            } else {
                version_literal(raw).map(|v| current.push_str(&v))
            };
            written.map_err(|e| (index, e))?;
        }
        current.push(')');
        left -= row.len() + 4;
        if current.len() >= STATEMENT_BYTES {
            current.push_str(&tail);
            statements.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        current.push_str(&tail);
        statements.push(current);
    }
    Ok(statements)
}

/// One staged row of a task with a delete policy (staged layout: the columns, the version,
/// the cursor time, the delete flag), rendered.
struct StagedRow {
    /// The columns' literals, then the version's.
    values: Vec<String>,
    deleted: bool,
}

fn parse_staged(sql: &TableSql, row: &[u8]) -> Result<StagedRow, RowError> {
    let fields: Vec<&[u8]> = row.split(|b| *b == b'\t').collect();
    let flag = sql.columns.len() + 1 + usize::from(sql.cursor_column.is_some());
    if fields.len() <= flag {
        return Err(RowError::new(
            "bad_copy_file_format",
            format!("row has fewer than {} fields", flag + 1),
        ));
    }
    let mut values = Vec::with_capacity(sql.columns.len() + 1);
    for (column, raw) in sql.columns.iter().zip(&fields) {
        values.push(literal(&column.sql_type, raw)?);
    }
    values.push(version_literal(fields[sql.columns.len()])?);
    let deleted = match fields[flag] {
        b"t" => true,
        b"f" => false,
        other => {
            return Err(RowError::new(
                "bad_copy_file_format",
                format!("delete flag {:?} is not t or f", String::from_utf8_lossy(other)),
            ));
        }
    };
    Ok(StagedRow { values, deleted })
}

/// `SELECT a AS _c0, b AS _c1 … UNION ALL …`: rows as a derived table.
fn derived(rows: &[Vec<String>]) -> String {
    rows.iter()
        .map(|row| {
            let fields: Vec<String> = row.iter().enumerate().map(|(i, v)| format!("{v} AS `_c{i}`")).collect();
            format!("SELECT {}", fields.join(", "))
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ")
}

/// A batch of a task with a delete policy, as the PostgreSQL target applies it: its
/// tombstones are kept (the highest version per key wins) and delete (or flag, in a soft
/// target) the rows they cover at that version or below; then the rows are upserted unless a
/// kept tombstone blocks them (one with a higher version, or the same version for a live
/// row: a delete wins a tie).
fn delete_aware_statements(
    sql: &TableSql,
    deletes: &crate::pg::deletes::DeleteSql,
    rows: &[&[u8]],
    read: Read,
) -> Result<Vec<String>, (usize, RowError)> {
    let version = quote_ident(VERSION_COLUMN);
    let deleted = quote_ident(crate::pg::DELETED_COLUMN);
    let target = quoted_table(&sql.target);
    let tombs = quoted_table(&deletes.tombstones);
    let keys = sql.key_positions();
    let width = sql.columns.len() + 1;
    let mut tombstones: Vec<Vec<String>> = Vec::new();
    let mut upserts: Vec<Vec<String>> = Vec::new();
    for (index, row) in rows.iter().enumerate() {
        let staged = parse_staged(sql, row).map_err(|e| (index, e))?;
        if staged.deleted {
            let mut tomb: Vec<String> = keys.iter().map(|k| staged.values[*k].clone()).collect();
            tomb.push(staged.values[width - 1].clone());
            tombstones.push(tomb);
        }
        if !staged.deleted || deletes.upserts_tombstone_rows() {
            let mut values = staged.values;
            values.push(if staged.deleted { "1" } else { "0" }.to_string());
            upserts.push(values);
        }
    }
    let key_names: Vec<String> = sql.key_columns.iter().map(|k| quote_ident(k)).collect();
    let on = |left: &str, right: &str| -> String {
        key_names
            .iter()
            .enumerate()
            .map(|(i, k)| format!("{left}.{k} = {right}.`_c{i}`"))
            .collect::<Vec<_>>()
            .join(" AND ")
    };
    let mut statements = Vec::new();
    let chunk_rows = (STATEMENT_BYTES / 512).max(1);
    for chunk in tombstones.chunks(chunk_rows) {
        let values: Vec<String> = chunk.iter().map(|t| format!("({})", t.join(","))).collect();
        statements.push(format!(
            "INSERT INTO {tombs} ({}, {version}) VALUES {} ON DUPLICATE KEY UPDATE {version} = GREATEST({version}, VALUES({version}))",
            key_names.join(", "),
            values.join(",")
        ));
        let groups: Vec<String> = (0..key_names.len()).map(|i| format!("`_c{i}`")).collect();
        let newest = format!(
            "(SELECT {groups}, MAX(`_c{v}`) AS `_v` FROM ({rows}) x GROUP BY {groups})",
            groups = groups.join(", "),
            v = key_names.len(),
            rows = derived(chunk),
        );
        if !deletes.target_soft {
            statements.push(format!(
                "DELETE t FROM {target} t JOIN {newest} s ON {on} WHERE t.{version} <= s.`_v`",
                on = on("t", "s")
            ));
        } else if !deletes.upserts_tombstone_rows() {
            statements.push(format!(
                "UPDATE {target} t JOIN {newest} s ON {on} SET t.{deleted} = 1, t.{version} = s.`_v` \
                 WHERE t.{version} <= s.`_v`",
                on = on("t", "s")
            ));
        }
    }
    if upserts.is_empty() {
        return Ok(statements);
    }
    let mut columns: Vec<String> = sql.columns.iter().map(|c| quote_ident(&c.name)).collect();
    columns.push(version.clone());
    let mut extra = Vec::new();
    if deletes.target_soft {
        columns.push(deleted.clone());
        extra.push(crate::pg::DELETED_COLUMN.to_string());
    }
    let selected: Vec<String> = (0..columns.len()).map(|i| format!("s.`_c{i}`")).collect();
    let v = format!("s.`_c{}`", width - 1);
    let flag = format!("s.`_c{width}`");
    let key_on: Vec<String> = key_names
        .iter()
        .zip(&keys)
        .map(|(k, i)| format!("d.{k} = s.`_c{i}`"))
        .collect();
    let tail = upsert_tail(sql, read, &extra);
    for chunk in upserts.chunks(chunk_rows.min(2000)) {
        statements.push(format!(
            "INSERT INTO {target} ({columns}) SELECT {selected} FROM ({rows}) s LEFT JOIN {tombs} d ON {key_on} \
             WHERE d.{version} IS NULL OR d.{version} < {v} OR (d.{version} = {v} AND {flag} = 1){tail}",
            columns = columns.join(", "),
            selected = selected.join(", "),
            rows = derived(chunk),
            key_on = key_on.join(" AND "),
        ));
    }
    Ok(statements)
}

/// Before a repair batch's upsert (reconciliation; the staged layout with the expected
/// target version last): a row the comparison saw at a version the source no longer has (a
/// backdated update) is removed, but only while it is still that version, so that a newer
/// change applied meanwhile stays; with a delete policy, kept tombstones of keys the source
/// holds live again are lifted, or they would keep the repaired rows out.
pub fn repair_statements(sql: &TableSql, rows: &[&[u8]]) -> Result<Vec<String>, (usize, RowError)> {
    let version = quote_ident(VERSION_COLUMN);
    let positions = sql.key_positions();
    let types = sql.key_types();
    let flag = sql.columns.len() + 1 + usize::from(sql.cursor_column.is_some());
    let mut replaced = Vec::new();
    let mut lifted = Vec::new();
    for (index, row) in rows.iter().enumerate() {
        let fields: Vec<&[u8]> = row.split(|b| *b == b'\t').collect();
        let bad = |message: &str| (index, RowError::new("bad_copy_file_format", message.to_string()));
        let int = |raw: &[u8]| std::str::from_utf8(raw).ok().and_then(|t| t.parse::<i64>().ok());
        let expected = fields.last().copied().ok_or_else(|| bad("empty repair row"))?;
        let row_version = fields
            .get(sql.columns.len())
            .copied()
            .and_then(int)
            .ok_or_else(|| bad("repair row without a version"))?;
        let mut key = Vec::with_capacity(positions.len());
        for (k, (position, sql_type)) in sql.key_columns.iter().zip(positions.iter().zip(&types)) {
            let raw = fields
                .get(*position)
                .copied()
                .ok_or_else(|| bad("repair row without its key"))?;
            key.push(format!(
                "{} = {}",
                quote_ident(k),
                literal(sql_type, raw).map_err(|e| (index, e))?
            ));
        }
        let key = key.join(" AND ");
        if let Some(expected) = int(expected)
            && expected > row_version
        {
            replaced.push(format!("({key} AND {version} = {expected})"));
        }
        let live = sql.deletes.is_some() && fields.get(flag).copied() == Some(b"f");
        if live {
            lifted.push(format!("({key})"));
        }
    }
    let mut statements = Vec::new();
    for chunk in replaced.chunks(500) {
        statements.push(format!(
            "DELETE FROM {} WHERE {}",
            quoted_table(&sql.target),
            chunk.join(" OR ")
        ));
    }
    if let Some(deletes) = &sql.deletes {
        for chunk in lifted.chunks(500) {
            statements.push(format!(
                "DELETE FROM {} WHERE {}",
                quoted_table(&deletes.tombstones),
                chunk.join(" OR ")
            ));
        }
    }
    Ok(statements)
}

fn version_literal(raw: &[u8]) -> Result<String, RowError> {
    match copy_text::decode_bytes(raw).map_err(|e| RowError::new("bad_copy_file_format", e))? {
        Some(bytes)
            if !bytes.is_empty()
                && bytes
                    .iter()
                    .enumerate()
                    .all(|(i, b)| b.is_ascii_digit() || (i == 0 && *b == b'-')) =>
        {
            Ok(String::from_utf8(bytes).expect("digits"))
        }
        _ => Err(RowError::new("not_null_violation", "the row has no integer version")),
    }
}

/// ` ON DUPLICATE KEY UPDATE …`: each non-key column takes the new value only when the row's
/// version is not newer (strictly older for a dead letter's earlier read, see [`Read`]), and
/// the version itself is assigned last.
/// Column names are qualified by the target table: an `INSERT … SELECT` joined to the
/// tombstones has a second `_tidemark_version`. `extra`: columns beyond the source's (the
/// soft-delete flag).
fn upsert_tail(sql: &TableSql, read: Read, extra: &[String]) -> String {
    let table = quoted_table(&sql.target);
    let version = format!("{table}.{}", quote_ident(VERSION_COLUMN));
    let new_version = format!("VALUES({})", quote_ident(VERSION_COLUMN));
    let guard = match read {
        Read::Latest => format!("{version} <= {new_version}"),
        Read::Earlier => format!("{version} < {new_version}"),
    };
    let mut updates: Vec<String> = sql
        .columns
        .iter()
        .map(|c| &c.name)
        .filter(|c| !sql.key_columns.contains(c))
        .chain(extra)
        .map(|c| {
            let c = quote_ident(c);
            format!("{table}.{c} = IF({guard}, VALUES({c}), {table}.{c})")
        })
        .collect();
    updates.push(format!("{version} = IF({guard}, {new_version}, {version})"));
    format!(" ON DUPLICATE KEY UPDATE {}", updates.join(", "))
}

/// The staged rows below the watermark `floor_micros` (found by the overlap re-read), as
/// `(key literals, version, cursor micros)`, for [`late_versions_query`].
pub type OverlapRow = (Vec<String>, i64, i64);

pub fn overlap_rows(sql: &TableSql, rows: &[&[u8]], floor_micros: i64) -> Vec<OverlapRow> {
    let Some(cursor) = sql.cursor_micros_position() else {
        return Vec::new();
    };
    let keys = sql.key_positions();
    let types = sql.key_types();
    let version = sql.columns.len();
    let int = |row: &[u8], i: usize| {
        copy_text::raw_field(row, i)
            .and_then(|raw| std::str::from_utf8(raw).ok())
            .and_then(|s| s.parse::<i64>().ok())
    };
    rows.iter()
        .filter_map(|row| {
            let micros = int(row, cursor)?;
            let deleted = sql.deletes.is_some() && copy_text::raw_field(row, cursor + 1) == Some(b"t");
            if micros >= floor_micros || deleted {
                return None;
            }
            let key: Option<Vec<String>> = keys
                .iter()
                .zip(&types)
                .map(|(i, t)| copy_text::raw_field(row, *i).and_then(|raw| literal(t, raw).ok()))
                .collect();
            Some((key?, int(row, version)?, micros))
        })
        .collect()
}

/// The lateness (`high_micros − cursor time`) of those overlap rows the target does not
/// hold at their version: the rows as a derived table, joined to the target by key (a text
/// key compares in the column's collation).
pub fn late_rows_query(sql: &TableSql, rows: &[OverlapRow], high_micros: i64) -> String {
    let version = quote_ident(VERSION_COLUMN);
    let names: Vec<String> = (0..sql.key_columns.len()).map(|i| format!("`k{i}`")).collect();
    let selects: Vec<String> = rows
        .iter()
        .map(|(key, v, micros)| {
            let keys: Vec<String> = key.iter().zip(&names).map(|(k, n)| format!("{k} AS {n}")).collect();
            format!("SELECT {}, {v} AS `v`, {micros} AS `m`", keys.join(", "))
        })
        .collect();
    let on: Vec<String> = sql
        .key_columns
        .iter()
        .zip(&names)
        .map(|(k, n)| format!("t.{} = s.{n}", quote_ident(k)))
        .collect();
    format!(
        "SELECT CAST({high_micros} - s.`m` AS SIGNED) FROM ({rows}) s LEFT JOIN {table} t ON {on} \
         WHERE t.{version} IS NULL OR t.{version} < s.`v`",
        rows = selects.join(" UNION ALL "),
        table = quoted_table(&sql.target),
        on = on.join(" AND "),
    )
}

/// An accumulate task's summary table and the statement folding a batch's deltas into it.
pub struct AccumulateMySql<'a> {
    pub table: &'a TableSql,
    pub spec: &'a AccumulateSpec,
}

impl AccumulateMySql<'_> {
    fn source_type(&self, column: &str) -> Option<&str> {
        self.table
            .columns
            .iter()
            .find(|c| c.name == column)
            .map(|c| c.sql_type.as_str())
    }

    /// The staged (PostgreSQL) type of a group column: text for the exploded element.
    fn group_type(&self, column: &str) -> &str {
        match &self.spec.explode {
            Some(explode) if explode.as_column == column => "text",
            _ => self.source_type(column).unwrap_or("text"),
        }
    }

    pub fn create_target_table(&self, collation: &str) -> String {
        let mut definitions: Vec<String> = self
            .spec
            .group_by
            .iter()
            .map(|g| format!("{} {} NOT NULL", quote_ident(g), column_type(self.group_type(g), true)))
            .collect();
        for aggregate in &self.spec.aggregates {
            let sql_type = match (aggregate.function, &aggregate.column) {
                (AggregateFunction::Count, _) => "BIGINT NOT NULL DEFAULT 0".to_string(),
                (AggregateFunction::Sum, _) => "DECIMAL(65,30) NOT NULL DEFAULT 0".to_string(),
                (_, Some(column)) => column_type(self.source_type(column).unwrap_or("numeric"), false),
                (_, None) => "DECIMAL(65,30)".to_string(),
            };
            definitions.push(format!("{} {sql_type}", quote_ident(&aggregate.name)));
        }
        definitions.push(format!("PRIMARY KEY ({})", key_list(&self.spec.group_by)));
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = {collation}",
            quoted_table(&self.table.target),
            definitions.join(", ")
        )
    }

    pub fn reset_totals(&self) -> String {
        format!("DELETE FROM {}", quoted_table(&self.table.target))
    }

    /// The columns an existing summary table must have.
    pub fn required_columns(&self) -> Vec<String> {
        let mut names = self.spec.group_by.clone();
        names.extend(self.spec.aggregates.iter().map(|a| a.name.clone()));
        names
    }

    /// How an aggregate's input (text) is compared for MIN and MAX: as its column's type.
    fn cast(&self, value: &str, column: &str) -> String {
        let mapped = column_type(self.source_type(column).unwrap_or("numeric"), false);
        let target = match mapped.split('(').next().unwrap_or("") {
            "SMALLINT" | "INT" | "BIGINT" | "TINYINT" => "SIGNED".to_string(),
            "DECIMAL" => "DECIMAL(65,30)".to_string(),
            "FLOAT" | "DOUBLE" => "DOUBLE".to_string(),
            "DATE" => "DATE".to_string(),
            "DATETIME" => "DATETIME(6)".to_string(),
            "TIME" => "TIME(6)".to_string(),
            _ => "CHAR".to_string(),
        };
        format!("CAST({value} AS {target})")
    }

    /// One statement folding `entries` (delta key: group values then aggregate inputs, with
    /// its weight) into the totals; groups in key order, so concurrent batches sharing groups
    /// lock them in one order. `Err` names an entry whose value cannot be rendered.
    pub fn accumulate(&self, entries: &[(&Vec<Option<String>>, i64)]) -> Result<String, RowError> {
        let groups: Vec<String> = self.spec.group_by.iter().map(|g| quote_ident(g)).collect();
        let inputs: Vec<&str> = self
            .spec
            .aggregates
            .iter()
            .filter_map(|a| a.column.as_deref())
            .collect();
        let weight = quote_ident(WEIGHT_COLUMN);
        let mut selects = Vec::with_capacity(entries.len());
        for (key, w) in entries {
            let mut fields = Vec::with_capacity(key.len() + 1);
            for (i, value) in key.iter().enumerate() {
                let rendered = match value {
                    None => "NULL".to_string(),
                    Some(text) if i < groups.len() => {
                        let mut raw = Vec::new();
                        copy_text::encode_field(text, &mut raw);
                        literal(self.group_type(&self.spec.group_by[i]), &raw)?
                    }
                    Some(text) => quote_literal(text),
                };
                let name = if i < groups.len() {
                    groups[i].clone()
                } else {
                    quote_ident(&format!("_tidemark_in_{}", i - groups.len()))
                };
                fields.push(format!("{rendered} AS {name}"));
            }
            fields.push(format!("{w} AS {weight}"));
            selects.push(format!("SELECT {}", fields.join(", ")));
        }
        let mut columns = groups.clone();
        let mut values = groups.clone();
        let mut updates = Vec::new();
        let mut input = 0;
        for aggregate in &self.spec.aggregates {
            let name = quote_ident(&aggregate.name);
            let column_in = || quote_ident(&format!("_tidemark_in_{input}"));
            let (value, merge) = match aggregate.function {
                AggregateFunction::Count => (format!("SUM({weight})"), format!("{name} + VALUES({name})")),
                AggregateFunction::Sum => (
                    format!("COALESCE(SUM(CAST({} AS DECIMAL(65,30)) * {weight}), 0)", column_in()),
                    format!("{name} + VALUES({name})"),
                ),
                AggregateFunction::Min => (
                    format!("MIN({})", self.cast(&column_in(), inputs[input])),
                    format!("LEAST(COALESCE({name}, VALUES({name})), COALESCE(VALUES({name}), {name}))"),
                ),
                AggregateFunction::Max => (
                    format!("MAX({})", self.cast(&column_in(), inputs[input])),
                    format!("GREATEST(COALESCE({name}, VALUES({name})), COALESCE(VALUES({name}), {name}))"),
                ),
            };
            if aggregate.column.is_some() {
                input += 1;
            }
            columns.push(name.clone());
            values.push(value);
            updates.push(format!("{name} = {merge}"));
        }
        Ok(format!(
            "INSERT INTO {target} ({columns}) SELECT {values} FROM ({deltas}) d GROUP BY {groups} ORDER BY {groups} \
             ON DUPLICATE KEY UPDATE {updates}",
            target = quoted_table(&self.table.target),
            columns = columns.join(", "),
            values = values.join(", "),
            deltas = selects.join(" UNION ALL "),
            groups = groups.join(", "),
            updates = updates.join(", "),
        ))
    }
}

/// A MySQL server error one row's values caused (a value its column refuses, an overflow, a
/// missing value, a duplicate or a check), by error number: MySQL reports several of them
/// with the generic SQLSTATE `HY000`. `None`: not about a row.
pub fn row_error_class(number: u16) -> Option<&'static str> {
    Some(match number {
        1048 => "not_null_violation",
        1062 => "unique_violation",
        1264 | 1690 => "numeric_value_out_of_range",
        1265 => "data_truncated",
        1292 => "invalid_datetime_format",
        1366 | 1367 => "invalid_text_representation",
        1406 => "string_data_right_truncation",
        1411 => "invalid_parameter_value",
        1452 => "foreign_key_violation",
        3140 => "invalid_json_text",
        3819 | 4025 => "check_violation",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pg::Column;

    fn table(columns: &[(&str, &str)], keys: &[&str]) -> TableSql {
        TableSql {
            source: TableName::parse("src.items").unwrap(),
            target: TableName::parse("dst.items").unwrap(),
            columns: columns
                .iter()
                .map(|(n, t)| Column {
                    name: n.to_string(),
                    sql_type: t.to_string(),
                })
                .collect(),
            key_columns: keys.iter().map(|k| k.to_string()).collect(),
            cursor_column: Some("updated_at".into()),
            version_column: None,
            deletes: None,
            filter: None,
            page_format: crate::copy_format::CopyFormat::Text,
            cursor_zone: None,
        }
    }

    #[test]
    fn types_map_to_bounded_mysql_types() {
        let cases = [
            ("bigint", false, "BIGINT"),
            ("numeric(20,0)", false, "DECIMAL(20,0)"),
            ("numeric(65,30)", false, "DECIMAL(65,30)"),
            ("numeric", false, "DECIMAL(65,30)"),
            ("numeric(80,2)", false, "DECIMAL(65,30)"),
            ("boolean", false, "TINYINT(1)"),
            ("text", false, "LONGTEXT"),
            ("text", true, "VARCHAR(768)"),
            ("character varying(40)", true, "VARCHAR(40)"),
            ("character varying(2000)", true, "VARCHAR(768)"),
            ("character(3)", false, "CHAR(3)"),
            ("bytea", false, "LONGBLOB"),
            ("bytea", true, "VARBINARY(3072)"),
            ("timestamp(3) without time zone", false, "DATETIME(3)"),
            ("timestamp with time zone", false, "DATETIME(6)"),
            ("uuid", true, "CHAR(36) CHARACTER SET ascii"),
            ("jsonb", false, "JSON"),
            ("interval", false, "LONGTEXT"),
            ("integer[]", false, "LONGTEXT"),
            ("bit(8)", false, "BIT(8)"),
        ];
        for (pg, key, mysql) in cases {
            assert_eq!(column_type(pg, key), mysql, "{pg} key={key}");
        }
    }

    #[test]
    fn literals_render_each_staged_form() {
        let ok = |t: &str, raw: &str| literal(t, raw.as_bytes()).unwrap();
        assert_eq!(ok("text", "\\N"), "NULL");
        assert_eq!(ok("text", "it's"), "'it''s'");
        assert_eq!(
            ok("text", "a\\tb\\\\c"),
            "'a\tb\\c'",
            "COPY escapes are decoded; backslash is literal"
        );
        assert_eq!(ok("boolean", "t"), "1");
        assert_eq!(ok("boolean", "f"), "0");
        assert_eq!(ok("bytea", "\\\\x00ff"), "X'00ff'");
        assert_eq!(ok("bit(4)", "0101"), "b'0101'");
        assert_eq!(
            ok("timestamp with time zone", "2024-03-01 23:30:00.25+00"),
            "'2024-03-01 23:30:00.250000'"
        );
        assert_eq!(
            ok("timestamp(6) with time zone", "2024-03-01 23:30:00.000001+00"),
            "'2024-03-01 23:30:00.000001'",
            "the modifier sits inside the name"
        );
        assert_eq!(
            ok("timestamp with time zone", "2024-03-01 23:30:00-02:30"),
            "'2024-03-02 02:00:00.000000'"
        );
        assert_eq!(
            ok("timestamp with time zone", "infinity"),
            "'infinity'",
            "left for the server to refuse"
        );
        assert_eq!(ok("text", "😀"), "'😀'");
        assert_eq!(
            literal("bytea", b"abc").unwrap_err().class,
            "invalid_binary_representation"
        );
        assert_eq!(literal("text", b"x\\").unwrap_err().class, "bad_copy_file_format");
    }

    #[test]
    fn the_upsert_guards_every_column_by_the_old_version_and_assigns_the_version_last() {
        let sql = table(
            &[
                ("id", "bigint"),
                ("name", "text"),
                ("updated_at", "timestamp with time zone"),
            ],
            &["id"],
        );
        let rows: Vec<&[u8]> = vec![b"1\tx\t2024-01-01 00:00:00+00\t7\t7", b"2\t\\N\t\\N\t8\t8"];
        let statements = upsert_statements(&sql, false, &rows, Read::Latest).unwrap();
        assert_eq!(statements.len(), 1);
        assert_eq!(
            statements[0],
            "INSERT INTO `dst`.`items` (`id`, `name`, `updated_at`, `_tidemark_version`) VALUES \
             ('1','x','2024-01-01 00:00:00.000000',7),('2',NULL,NULL,8)"
                .to_string()
                + &" ON DUPLICATE KEY UPDATE T.`name` = IF(T.`_tidemark_version` <= VALUES(`_tidemark_version`), \
                   VALUES(`name`), T.`name`), T.`updated_at` = IF(T.`_tidemark_version` <= VALUES(`_tidemark_version`), \
                   VALUES(`updated_at`), T.`updated_at`), T.`_tidemark_version` = IF(T.`_tidemark_version` <= \
                   VALUES(`_tidemark_version`), VALUES(`_tidemark_version`), T.`_tidemark_version`)"
                    .replace("T.", "`dst`.`items`.")
        );
        let earlier = upsert_statements(&sql, false, &rows[..1], Read::Earlier).unwrap();
        assert!(
            earlier[0].contains("IF(`dst`.`items`.`_tidemark_version` < VALUES("),
            "{}",
            earlier[0]
        );
        let short: Vec<&[u8]> = vec![b"1\tx"];
        assert_eq!(upsert_statements(&sql, false, &short, Read::Latest).unwrap_err().0, 0);
    }

    #[test]
    fn tombstones_are_kept_delete_what_they_cover_and_block_older_rows() {
        let mut sql = table(
            &[
                ("id", "bigint"),
                ("name", "text"),
                ("updated_at", "timestamp with time zone"),
            ],
            &["id"],
        );
        sql.deletes =
            crate::pg::deletes::DeleteSql::from_spec("flag", "name", false, &sql.source, &sql.target).unwrap();
        // Staged layout: columns, version, cursor time, delete flag.
        let rows: Vec<&[u8]> = vec![b"1\tx\t\\N\t7\t7\tf", b"2\t\\N\t\\N\t9\t9\tt"];
        let statements = upsert_statements(&sql, false, &rows, Read::Latest).unwrap();
        assert_eq!(statements.len(), 3, "{statements:#?}");
        assert!(
            statements[0].starts_with(
                "INSERT INTO `dst`.`tidemark_tombstones_items` (`id`, `_tidemark_version`) VALUES ('2',9)"
            ) && statements[0].ends_with("GREATEST(`_tidemark_version`, VALUES(`_tidemark_version`))"),
            "{}",
            statements[0]
        );
        assert!(
            statements[1].starts_with("DELETE t FROM `dst`.`items` t JOIN")
                && statements[1].ends_with("WHERE t.`_tidemark_version` <= s.`_v`"),
            "{}",
            statements[1]
        );
        assert!(
            statements[2].contains("FROM (SELECT '1' AS `_c0`, 'x' AS `_c1`, NULL AS `_c2`, 7 AS `_c3`, 0 AS `_c4`) s")
                && statements[2].contains(
                    "WHERE d.`_tidemark_version` IS NULL OR d.`_tidemark_version` < s.`_c3` OR \
                     (d.`_tidemark_version` = s.`_c3` AND s.`_c4` = 1)"
                ),
            "only the live row is upserted, unless a tombstone blocks it: {}",
            statements[2]
        );
    }

    #[test]
    fn a_repair_replaces_a_row_only_while_it_is_the_version_the_comparison_saw() {
        let sql = table(
            &[
                ("id", "bigint"),
                ("name", "text"),
                ("updated_at", "timestamp with time zone"),
            ],
            &["id"],
        );
        // Staged layout plus the expected target version: a backdated row (5 < 8), a newer
        // one (9 > 4) and a key the target lacked (no expected version).
        let rows: Vec<&[u8]> = vec![b"1\tx\t\\N\t5\t5\t8", b"2\ty\t\\N\t9\t9\t4", b"3\tz\t\\N\t6\t6\t\\N"];
        assert_eq!(
            repair_statements(&sql, &rows).unwrap(),
            vec!["DELETE FROM `dst`.`items` WHERE (`id` = '1' AND `_tidemark_version` = 8)".to_string()]
        );
    }

    #[test]
    fn large_batches_split_into_statements_of_bounded_size() {
        let sql = table(&[("id", "bigint"), ("name", "text")], &["id"]);
        let text = "y".repeat(1000);
        let lines: Vec<String> = (0..10_000).map(|i| format!("{i}\t{text}\t{i}")).collect();
        let rows: Vec<&[u8]> = lines.iter().map(|l| l.as_bytes()).collect();
        let statements = upsert_statements(&sql, true, &rows, Read::Latest).unwrap();
        assert!(statements.len() >= 2, "{}", statements.len());
        assert!(statements.iter().all(|s| s.len() < STATEMENT_BYTES + 4096));
        let values: usize = statements.iter().map(|s| s.matches("),(").count() + 1).sum();
        assert_eq!(values, 10_000);
    }
}
