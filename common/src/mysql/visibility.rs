//! What the open-transaction bound sees on MySQL/MariaDB: `information_schema.innodb_trx`,
//! which lists every InnoDB transaction of the server with its start, but only to a role
//! with the PROCESS privilege (without it the query is refused). A replica applying its
//! primary's changes (a replication SQL thread in the process list) cannot see the
//! primary's open transactions. `trx_started` has second precision and is truncated, so
//! it never lies after the true start: the bound stays safe.

use sqlx::mysql::MySqlPool;

use crate::pg::visibility::{Engine, Visibility};

/// The oldest transaction of another session (microseconds, UTC under the pinned session).
pub const OLDEST_TRANSACTION: &str = "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(trx_started)) AS SIGNED) \
     FROM information_schema.innodb_trx WHERE trx_mysql_thread_id <> CONNECTION_ID()";

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
    let oldest = sqlx::query_scalar::<_, Option<i64>>(OLDEST_TRANSACTION)
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
