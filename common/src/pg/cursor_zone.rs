//! What a `timestamp without time zone` cursor means. Its values name no zone: applications
//! write them in local time (`now()` under the session's TimeZone, a JVM's zone). Tidemark's
//! windows, watermarks and open-transaction bounds are instants, so each epoch freezes the zone
//! its cursor values are read in: `cursor_time_zone` when configured, else the zone the
//! source gives the task's role in its database, as an application session would get it.
//!
//! Tidemark's own sessions pin `TimeZone = UTC` (see `SESSION_SETTINGS`), so the default is
//! read from the catalogs: the role-in-database, role and database settings
//! (`pg_db_role_setting`, readable by every role), then the server's configuration files
//! (`pg_file_settings`, which needs `pg_read_all_settings`). When neither tells, the task
//! refuses to start and asks for `cursor_time_zone`.

use sqlx::Row;

use super::quote_literal;

/// Database- and role-level settings that apply to this session, most specific first
/// (role in database, role, database).
const ROLE_DATABASE_SETTINGS: &str = "SELECT s.setconfig FROM pg_db_role_setting s \
     WHERE s.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database())) \
     AND s.setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = current_user)) \
     ORDER BY (s.setdatabase <> 0 AND s.setrole <> 0) DESC, (s.setrole <> 0) DESC";

/// The server's `TimeZone` from its configuration files (needs `pg_read_all_settings`).
const SERVER_SETTING: &str = "SELECT setting FROM pg_file_settings WHERE lower(name) = 'timezone' AND applied \
     ORDER BY seqno DESC LIMIT 1";

/// A cursor zone and where it came from (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorZone {
    pub name: String,
    pub learned_from: String,
}

/// The `TimeZone=…` entry of a `setconfig` array.
fn time_zone_setting(config: &[String]) -> Option<String> {
    config.iter().find_map(|entry| {
        let (name, value) = entry.split_once('=')?;
        name.eq_ignore_ascii_case("timezone").then(|| value.to_string())
    })
}

/// The zone of a naive cursor: `configured`, else learned from the source (see the module).
/// `Err` names what to set.
pub async fn resolve(source: &sqlx::PgPool, configured: Option<&str>, cursor: &str) -> Result<CursorZone, String> {
    let zone = match configured {
        Some(zone) => CursorZone {
            name: zone.to_string(),
            learned_from: "cursor_time_zone".into(),
        },
        None => learn(source, cursor).await?,
    };
    // PostgreSQL accepts the name, or says why not.
    let check = format!("SELECT now() AT TIME ZONE {}", quote_literal(&zone.name));
    sqlx::query(sqlx::AssertSqlSafe(check))
        .execute(source)
        .await
        .map_err(|e| format!("cursor time zone {:?} ({}): {e}", zone.name, zone.learned_from))?;
    Ok(zone)
}

async fn learn(source: &sqlx::PgPool, cursor: &str) -> Result<CursorZone, String> {
    let reading = |e: sqlx::Error| format!("reading the source's TimeZone settings: {e}");
    let rows = sqlx::query(ROLE_DATABASE_SETTINGS)
        .fetch_all(source)
        .await
        .map_err(reading)?;
    for row in rows {
        let config: Vec<String> = row.get::<Option<Vec<String>>, _>(0).unwrap_or_default();
        if let Some(zone) = time_zone_setting(&config) {
            return Ok(CursorZone {
                name: zone,
                learned_from: "the source's TimeZone for this role and database".into(),
            });
        }
    }
    match sqlx::query_scalar::<_, String>(SERVER_SETTING)
        .fetch_optional(source)
        .await
    {
        Ok(Some(zone)) => Ok(CursorZone {
            name: zone,
            learned_from: "the source server's TimeZone".into(),
        }),
        Ok(None) => Ok(CursorZone {
            name: "GMT".into(),
            learned_from: "the source server's built-in TimeZone".into(),
        }),
        Err(error) => Err(format!(
            "cursor_column {cursor:?} is timestamp without time zone, whose values name no zone, and the source role \
             cannot read the server's TimeZone ({error}): set cursor_time_zone to the zone its writers use (`SHOW \
             TimeZone` in an application session), or GRANT pg_read_all_settings to the source role"
        )),
    }
}

/// How far the zone's UTC offset moves within the next year (seconds; 0 for a zone without
/// daylight saving time). A naive cursor repeats local times when the offset falls.
pub async fn offset_shift_seconds(source: &sqlx::PgPool, zone: &str) -> Result<i64, sqlx::Error> {
    let query = format!(
        "SELECT coalesce(extract(epoch from max(o) - min(o)), 0)::bigint FROM (SELECT (t AT TIME ZONE {z}) - \
         (t AT TIME ZONE 'UTC') AS o FROM generate_series(now(), now() + interval '400 days', interval '1 day') t) s",
        z = quote_literal(zone)
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(query)).fetch_one(source).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_zone_entry_of_a_setting_array() {
        let config = vec!["search_path=app".to_string(), "TimeZone=Asia/Kolkata".to_string()];
        assert_eq!(time_zone_setting(&config).as_deref(), Some("Asia/Kolkata"));
        assert_eq!(time_zone_setting(&["timezone=UTC".to_string()]).as_deref(), Some("UTC"));
        assert_eq!(time_zone_setting(&["DateStyle=ISO".to_string()]), None);
    }
}
