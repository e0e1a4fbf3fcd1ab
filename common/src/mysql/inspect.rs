//! What the coordinator reads of a MySQL/MariaDB source table when it plans an epoch: whether
//! the key is unique, the key's extremes and quantiles (shard boundaries), the row estimate,
//! and the zone `DATETIME` cursor values are written in.

use sqlx::mysql::MySqlPool;

use super::types::SourceColumn;
use super::{quote_ident, quote_literal};
use crate::pg::TableName;

fn table_sql(table: &TableName) -> String {
    format!("{}.{}", quote_ident(&table.schema), quote_ident(&table.name))
}

/// Whether a unique index (or the primary key) covers exactly `key`, on whole columns.
pub async fn key_is_unique(pool: &MySqlPool, table: &TableName, key: &[String]) -> Result<bool, sqlx::Error> {
    let rows: Vec<(String, String, Option<i64>)> = sqlx::query_as(
        "SELECT CAST(index_name AS CHAR), CAST(column_name AS CHAR), CAST(sub_part AS SIGNED) FROM information_schema.statistics \
         WHERE table_schema = ? AND table_name = ? AND non_unique = 0 ORDER BY index_name, seq_in_index",
    )
    .bind(&table.schema)
    .bind(&table.name)
    .fetch_all(pool)
    .await?;
    let mut indexes: std::collections::BTreeMap<String, (Vec<String>, bool)> = Default::default();
    for (index, column, sub_part) in rows {
        let entry = indexes.entry(index).or_default();
        entry.0.push(column);
        entry.1 |= sub_part.is_some();
    }
    let mut wanted = key.to_vec();
    wanted.sort();
    Ok(indexes.into_values().any(|(mut columns, prefix)| {
        columns.sort();
        !prefix && columns == wanted
    }))
}

/// The smallest and largest value of an integer key, as text.
pub async fn integer_extremes(
    pool: &MySqlPool,
    table: &TableName,
    key: &str,
) -> Result<(Option<String>, Option<String>), sqlx::Error> {
    let k = quote_ident(key);
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT CAST(MIN({k}) AS CHAR), CAST(MAX({k}) AS CHAR) FROM {}",
        table_sql(table)
    )))
    .fetch_one(pool)
    .await
}

/// Shard boundaries at the quantiles `1/shards … (shards−1)/shards` of the key (in the key's
/// own order and collation, on the server), and the largest key; values as COPY text of the
/// mapped type. One sorted pass at planning.
pub async fn quantiles(
    pool: &MySqlPool,
    table: &TableName,
    key: &SourceColumn,
    shards: u32,
) -> Result<(Vec<String>, Option<String>), sqlx::Error> {
    let k = quote_ident(&key.name);
    let (count, max): (i64, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*), (SELECT {} FROM {t} ORDER BY {k} DESC LIMIT 1) FROM {t}",
        key.text_expr(),
        t = table_sql(table)
    )))
    .fetch_one(pool)
    .await?;
    if shards <= 1 || count == 0 {
        return Ok((Vec::new(), max));
    }
    let positions: Vec<String> = (1..shards)
        .map(|i| ((count * i64::from(i)) as f64 / f64::from(shards)).ceil().max(1.0) as i64)
        .map(|p| p.to_string())
        .collect();
    let boundaries: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT v FROM (SELECT {} AS v, ROW_NUMBER() OVER (ORDER BY {k}) AS rn FROM {}) s WHERE rn IN ({}) ORDER BY rn",
        key.text_expr(),
        table_sql(table),
        positions.join(", ")
    )))
    .fetch_all(pool)
    .await?;
    let mut unique = boundaries;
    unique.dedup();
    Ok((unique, max))
}

/// The server's estimate of the table's rows.
pub async fn estimated_rows(pool: &MySqlPool, table: &TableName) -> Result<Option<i64>, sqlx::Error> {
    let rows: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT CAST(table_rows AS SIGNED) FROM information_schema.tables WHERE table_schema = ? AND table_name = ?",
    )
    .bind(&table.schema)
    .bind(&table.name)
    .fetch_optional(pool)
    .await?;
    Ok(rows.flatten())
}

/// The zone a `DATETIME` cursor's values are read in, and where it was learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorZone {
    pub name: String,
    pub learned_from: String,
    /// How far the zone's clocks go back once a year (daylight saving time), seconds.
    pub shift_seconds: i64,
}

/// `cursor_time_zone` when set, else the server's `time_zone` (applications' `NOW()` writes
/// local times of it). Refused when the server cannot convert it (named zones need the time
/// zone tables: `mysql_tzinfo_to_sql`).
pub async fn cursor_zone(pool: &MySqlPool, configured: Option<&str>) -> Result<CursorZone, String> {
    let reading = |e: sqlx::Error| format!("reading the server's time zone: {e}");
    let (name, learned_from) = match configured {
        Some(zone) => (zone.to_string(), "cursor_time_zone".to_string()),
        None => {
            let (global, system): (String, String) =
                sqlx::query_as("SELECT CAST(@@global.time_zone AS CHAR), CAST(@@system_time_zone AS CHAR)")
                    .fetch_one(pool)
                    .await
                    .map_err(reading)?;
            if global.eq_ignore_ascii_case("SYSTEM") {
                (
                    "SYSTEM".to_string(),
                    format!("the server's time_zone SYSTEM ({system})"),
                )
            } else {
                (global.clone(), format!("the server's time_zone {global}"))
            }
        }
    };
    let offset = |day: &str| {
        format!(
            "TIMESTAMPDIFF(SECOND, CONVERT_TZ('{day} 12:00:00', {z}, '+00:00'), '{day} 12:00:00')",
            z = quote_literal(&name)
        )
    };
    let (january, july): (Option<i64>, Option<i64>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {}, {}",
        offset("2024-01-15"),
        offset("2024-07-15")
    )))
    .fetch_one(pool)
    .await
    .map_err(reading)?;
    let (Some(january), Some(july)) = (january, july) else {
        return Err(format!(
            "the DATETIME cursor's zone {name} (from {learned_from}) is unknown to the server: load its time zone \
             tables (mysql_tzinfo_to_sql), or set cursor_time_zone to an offset such as '+01:00'"
        ));
    };
    Ok(CursorZone {
        name,
        learned_from,
        shift_seconds: (january - july).abs(),
    })
}
