//! What the open-transaction bound sees on MySQL/MariaDB: `information_schema.innodb_trx`,
//! which lists every InnoDB transaction of the server with its start, but only to a role
//! with the PROCESS privilege (without it the query is refused). A replica applying its
//! primary's changes (a replication SQL thread in the process list) cannot see the
//! primary's open transactions. `trx_started` has second precision and is truncated, so
//! it never lies after the true start: the bound stays safe.
//!
//! `trx_started` is rendered in the server process's local time (InnoDB formats it with
//! `localtime_r`), not in the session's `time_zone`: on a server whose system zone is not UTC,
//! reading it as UTC would put an open transaction's start hours away, and the bound would
//! hold nothing (a zone east of UTC) or stall (west). It is converted from `SYSTEM`. In the
//! repeated hour when daylight saving time ends a local time names two instants: the earlier
//! one is taken (the least of the conversions of the time and of it an hour either side,
//! moved back), so the bound errs early, never late.

use sqlx::mysql::MySqlPool;

use crate::pg::visibility::{Engine, Visibility};

/// The oldest transaction of another session (microseconds, UTC under the pinned session).
pub fn oldest_transaction_query() -> String {
    format!(
        "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {}) AS SIGNED) \
         FROM (SELECT MIN(trx_started) AS s FROM information_schema.innodb_trx \
         WHERE trx_mysql_thread_id <> CONNECTION_ID()) oldest",
        system_time_to_utc("s")
    )
}

/// A `DATETIME` of the server's system zone as UTC; in a repeated hour, the earlier instant.
pub fn system_time_to_utc(local: &str) -> String {
    format!(
        "LEAST(CONVERT_TZ({local}, 'SYSTEM', '+00:00'), \
         CONVERT_TZ({local} - INTERVAL 1 HOUR, 'SYSTEM', '+00:00') + INTERVAL 1 HOUR, \
         CONVERT_TZ({local} + INTERVAL 1 HOUR, 'SYSTEM', '+00:00') - INTERVAL 1 HOUR)"
    )
}

/// Replication threads applying a primary's changes on this server.
pub const REPLICA_THREADS: &str = "SELECT COUNT(*) FROM information_schema.processlist \
     WHERE command IN ('Slave_SQL', 'Slave_worker', 'Replica_SQL', 'Replica_worker')";

/// Reads what the bound can see.
pub async fn read(pool: &MySqlPool) -> Result<Visibility, sqlx::Error> {
    let role: String = sqlx::query_scalar("SELECT CAST(CURRENT_USER() AS CHAR)")
        .fetch_one(pool)
        .await?;
    let (user, host) = role.rsplit_once('@').unwrap_or((role.as_str(), "%"));
    let role = format!("'{user}'@'{host}'");
    let oldest = sqlx::query_scalar::<_, Option<i64>>(sqlx::AssertSqlSafe(oldest_transaction_query()))
        .fetch_one(pool)
        .await;
    let (sees_all_sessions, oldest_start_micros) = match oldest {
        Ok(oldest) => (true, oldest),
        Err(sqlx::Error::Database(e)) if e.message().contains("PROCESS") => (false, None),
        Err(e) => return Err(e),
    };
    let replica_threads: i64 = sqlx::query_scalar(REPLICA_THREADS).fetch_one(pool).await?;
    Ok(Visibility {
        engine: Engine::MySql,
        role,
        sees_all_sessions,
        in_recovery: replica_threads > 0,
        subscriptions: Vec::new(),
        oldest_start_micros,
    })
}
