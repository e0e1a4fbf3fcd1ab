//! Column types: what PostgreSQL type each MySQL/MariaDB column is stored as in a target,
//! and the SELECT expression that renders its values as COPY text of that type. A type
//! that has no faithful mapping is refused by name at planning; a value that the target
//! type cannot hold (a zero date, a NUL byte in text) fails in the target and becomes a dead
//! letter naming the row, as any rejected row does.

use super::quote_ident;

/// One source column as `information_schema.columns` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceColumn {
    pub name: String,
    /// `COLUMN_TYPE`, lower case, e.g. `bigint(20) unsigned`, `decimal(65,30)`, `datetime(6)`.
    pub column_type: String,
    /// `DATA_TYPE`, lower case, e.g. `bigint`.
    pub data_type: String,
    pub not_null: bool,
}

/// `information_schema.columns` of one table (`?` database, `?` table), in order.
pub const COLUMNS: &str = "SELECT CAST(column_name AS CHAR), CAST(LOWER(column_type) AS CHAR), \
     CAST(LOWER(data_type) AS CHAR), is_nullable = 'NO' FROM information_schema.columns \
     WHERE table_schema = ? AND table_name = ? ORDER BY ordinal_position";

/// Reads a table's columns; `None` when the table does not exist.
pub async fn columns(
    pool: &sqlx::MySqlPool,
    database: &str,
    table: &str,
) -> Result<Option<Vec<SourceColumn>>, sqlx::Error> {
    let rows: Vec<(String, String, String, bool)> = sqlx::query_as(COLUMNS)
        .bind(database)
        .bind(table)
        .fetch_all(pool)
        .await?;
    if rows.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        rows.into_iter()
            .map(|(name, column_type, data_type, not_null)| SourceColumn {
                name,
                column_type,
                data_type,
                not_null,
            })
            .collect(),
    ))
}

impl SourceColumn {
    fn unsigned(&self) -> bool {
        self.column_type.contains("unsigned")
    }

    /// The digits inside the type's parentheses, e.g. `6` of `datetime(6)`.
    fn modifier(&self) -> Option<&str> {
        let (_, rest) = self.column_type.split_once('(')?;
        Some(rest.split_once(')')?.0)
    }

    fn precision(&self) -> u32 {
        self.modifier().and_then(|m| m.parse().ok()).unwrap_or(0)
    }

    /// Whether the values are integers (keys shard by integer ranges).
    pub fn is_integer(&self) -> bool {
        matches!(
            self.data_type.as_str(),
            "tinyint" | "smallint" | "mediumint" | "int" | "bigint"
        ) && !self.is_boolean()
    }

    fn is_boolean(&self) -> bool {
        self.column_type == "tinyint(1)"
    }

    /// A `DATETIME` (a wall-clock time without zone) as opposed to a `TIMESTAMP` (an instant).
    pub fn is_naive_time(&self) -> bool {
        self.data_type == "datetime"
    }

    /// Whether the column can be a cursor: `TIMESTAMP` or `DATETIME`.
    pub fn is_time(&self) -> bool {
        matches!(self.data_type.as_str(), "timestamp" | "datetime")
    }

    /// The PostgreSQL type (as `format_type` prints it) its values are stored as in a target.
    pub fn target_type(&self) -> Result<String, String> {
        let unsupported = || {
            format!(
                "column {:?} of type {} has no PostgreSQL mapping (see the README's type table); \
                 leave it out with a view, or cast it there",
                self.name, self.column_type
            )
        };
        let t = match self.data_type.as_str() {
            "tinyint" if self.is_boolean() => "boolean".to_string(),
            "tinyint" => "smallint".to_string(),
            "smallint" if self.unsigned() => "integer".to_string(),
            "smallint" => "smallint".to_string(),
            "mediumint" => "integer".to_string(),
            "int" if self.unsigned() => "bigint".to_string(),
            "int" => "integer".to_string(),
            "bigint" if self.unsigned() => "numeric(20,0)".to_string(),
            "bigint" => "bigint".to_string(),
            "decimal" => match self.modifier() {
                Some(m) => format!("numeric({})", m.replace(' ', "")),
                None => "numeric(10,0)".to_string(),
            },
            "float" => "real".to_string(),
            "double" => "double precision".to_string(),
            "bit" => format!("bit({})", self.precision().max(1)),
            "char" => format!("character({})", self.precision().max(1)),
            "varchar" => format!("character varying({})", self.precision()),
            "tinytext" | "text" | "mediumtext" | "longtext" | "enum" | "set" => "text".to_string(),
            "json" => "jsonb".to_string(),
            "binary" | "varbinary" | "tinyblob" | "blob" | "mediumblob" | "longblob" => "bytea".to_string(),
            "date" => "date".to_string(),
            "datetime" => format!("timestamp({}) without time zone", self.precision()),
            "timestamp" => format!("timestamp({}) with time zone", self.precision()),
            // MySQL's TIME spans −838:59:59 to 838:59:59: a duration, not a time of day.
            "time" => "interval".to_string(),
            "year" => "smallint".to_string(),
            "uuid" => "uuid".to_string(),
            "inet4" | "inet6" => "inet".to_string(),
            _ => return Err(unsupported()),
        };
        Ok(t)
    }

    /// The SELECT expression rendering a value as COPY text of [`Self::target_type`] (NULL
    /// stays NULL). Under the pinned session, `TIMESTAMP` values render in UTC.
    pub fn text_expr(&self) -> String {
        let c = quote_ident(&self.name);
        match self.data_type.as_str() {
            "tinyint" if self.is_boolean() => {
                // 0 and 1 are booleans; any other value is refused by the target as a row.
                format!("CASE {c} WHEN 0 THEN 'f' WHEN 1 THEN 't' ELSE CAST({c} AS CHAR) END")
            }
            "bit" => format!("LPAD(BIN({c}), {}, '0')", self.precision().max(1)),
            "binary" | "varbinary" | "tinyblob" | "blob" | "mediumblob" | "longblob" => {
                format!("CONCAT('\\x', HEX({c}))")
            }
            "timestamp" => format!("CONCAT(CAST({c} AS CHAR), '+00')"),
            "float" => format!("CAST({c} AS CHAR)"),
            _ => format!("CAST({c} AS CHAR)"),
        }
    }

    /// The expression for the column in a select list whose values go to the client (a page).
    /// The text protocol already sends strings (converted to the pinned `utf8mb4` results
    /// charset), JSON, integers, decimals, dates and times as their COPY text, so those are
    /// read bare: the `CAST(… AS CHAR)` of [`Self::text_expr`] costs the server a copy of each
    /// value (a million 200-byte JSON values: about 1.1 s of server CPU). Inside an
    /// expression (a hash, a comparison), [`Self::text_expr`] stays the rendering.
    pub fn select_expr(&self) -> String {
        let bare = matches!(
            self.data_type.as_str(),
            "char"
                | "varchar"
                | "tinytext"
                | "text"
                | "mediumtext"
                | "longtext"
                | "enum"
                | "set"
                | "json"
                | "decimal"
                | "date"
                | "datetime"
                | "time"
                | "year"
        ) || self.is_integer();
        match self.data_type.as_str() {
            _ if bare => quote_ident(&self.name),
            "timestamp" => format!("CONCAT({}, '+00')", quote_ident(&self.name)),
            _ => self.text_expr(),
        }
    }

    /// A key value (as its COPY text) as a literal comparable with the column: numbers as
    /// numbers (a quoted string would compare as a double and lose digits past 2^53),
    /// bytes unhexed, anything else a string compared in the column's own collation.
    pub fn key_literal(&self, text: &str) -> String {
        let numeric = |t: &str| {
            let digits = t.strip_prefix('-').unwrap_or(t);
            !digits.is_empty() && digits.chars().all(|ch| ch.is_ascii_digit())
        };
        if self.is_integer() && numeric(text) {
            return text.to_string();
        }
        match self.data_type.as_str() {
            "decimal" if text.chars().all(|ch| ch.is_ascii_digit() || ch == '-' || ch == '.') => text.to_string(),
            "binary" | "varbinary" | "tinyblob" | "blob" | "mediumblob" | "longblob" => {
                let hex = text.trim_start_matches("\\x");
                if hex.chars().all(|ch| ch.is_ascii_hexdigit()) {
                    format!("UNHEX('{hex}')")
                } else {
                    super::quote_literal(text)
                }
            }
            "timestamp" => super::quote_literal(text.trim_end_matches("+00")),
            _ => super::quote_literal(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(column_type: &str) -> SourceColumn {
        let data_type = column_type.split(['(', ' ']).next().unwrap().to_string();
        SourceColumn {
            name: "c".into(),
            column_type: column_type.into(),
            data_type,
            not_null: true,
        }
    }

    #[test]
    fn types_map_to_postgres_types_that_hold_every_value() {
        for (mysql, pg) in [
            ("bigint(20) unsigned", "numeric(20,0)"),
            ("bigint(20)", "bigint"),
            ("int(10) unsigned", "bigint"),
            ("int(11)", "integer"),
            ("tinyint(1)", "boolean"),
            ("tinyint(4)", "smallint"),
            ("smallint(5) unsigned", "integer"),
            ("decimal(65,30)", "numeric(65,30)"),
            ("datetime(6)", "timestamp(6) without time zone"),
            ("datetime", "timestamp(0) without time zone"),
            ("timestamp(3)", "timestamp(3) with time zone"),
            ("binary(16)", "bytea"),
            ("enum('a','b')", "text"),
            ("varchar(200)", "character varying(200)"),
            ("bit(3)", "bit(3)"),
        ] {
            assert_eq!(column(mysql).target_type().unwrap(), pg, "{mysql}");
        }
        let error = column("geometry").target_type().unwrap_err();
        assert!(error.contains("\"c\"") && error.contains("geometry"), "{error}");
    }

    #[test]
    fn pages_read_text_the_protocol_already_renders_bare() {
        assert_eq!(column("json").select_expr(), "`c`");
        assert_eq!(column("bigint(20) unsigned").select_expr(), "`c`");
        assert_eq!(column("timestamp(3)").select_expr(), "CONCAT(`c`, '+00')");
        assert_eq!(column("tinyint(1)").select_expr(), column("tinyint(1)").text_expr());
        assert_eq!(column("double").select_expr(), "CAST(`c` AS CHAR)");
        assert_eq!(column("binary(16)").select_expr(), "CONCAT('\\x', HEX(`c`))");
        assert_eq!(column("bit(3)").select_expr(), column("bit(3)").text_expr());
    }

    #[test]
    fn integer_keys_stay_exact_past_two_to_the_fifty_three() {
        let key = column("bigint(20) unsigned");
        assert_eq!(key.key_literal("18446744073709551615"), "18446744073709551615");
        assert_eq!(column("varchar(10)").key_literal("O'Brien"), "'O''Brien'");
        assert_eq!(column("binary(16)").key_literal("\\x00ff"), "UNHEX('00ff')");
    }
}
