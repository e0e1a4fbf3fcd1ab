//! MySQL and MariaDB as a source, written in one audited place: the pinned session, the
//! mapping of column types to the PostgreSQL types a target stores them as, the read
//! statements (keyset pages on `(t, k)` and key ranges, never OFFSET), introspection, the
//! source clock and what the open-transaction bound can see (`information_schema.innodb_trx`).
//!
//! Pages are rendered by the source itself as COPY text of the mapped PostgreSQL types (see
//! [`types::text_expr`]), so that everything after the read (staging, manifests, apply,
//! bisection, the ledger) is the same as for a PostgreSQL source. Identifiers are quoted with
//! backticks; literals by doubling quotes, which is complete under the pinned
//! `NO_BACKSLASH_ESCAPES`.

pub mod connector;
pub mod deletes;
pub mod inspect;
pub mod read;
pub mod reconcile;
pub mod statements;
pub mod target;
pub mod types;
pub mod versions;
pub mod visibility;

use std::time::Duration;

use sqlx::Executor;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};

pub use statements::MySqlStatements;
pub use types::SourceColumn;

pub fn quote_ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// A string literal; doubling the quote is the whole escaping under `NO_BACKSLASH_ESCAPES`.
pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Every setting that changes how a value is written as text or compared, pinned on every
/// Tidemark session whatever the server's or the account's defaults: times are rendered and
/// read in UTC (`TIMESTAMP` values are instants; `DATETIME` ones are read in the zone they
/// are written in, see `cursor_time_zone`), backslashes are not escapes, and statements fail
/// rather than truncate.
pub const SESSION_SQL: &str = "SET SESSION sql_mode = 'STRICT_ALL_TABLES,NO_BACKSLASH_ESCAPES,NO_ENGINE_SUBSTITUTION', \
     time_zone = '+00:00', character_set_results = 'utf8mb4', group_concat_max_len = 1048576";

/// Whether a URL names a MySQL or MariaDB server.
pub fn is_mysql_url(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

/// Connection options from a `mysql://` or `mariadb://` URL (utf8mb4, UTC).
pub fn connect_options(url: &str) -> Result<MySqlConnectOptions, String> {
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_string(),
    };
    let options: MySqlConnectOptions = url
        .parse()
        .map_err(|e| format!("{}: {e}", crate::redact::redact_url(&url)))?;
    Ok(options.charset("utf8mb4").timezone(Some("+00:00".to_string())))
}

/// A lazily connecting pool whose every session runs [`SESSION_SQL`] and reads at READ
/// COMMITTED (each page is one statement with its own consistent view).
pub fn pool(url: &str, max_connections: u32) -> Result<MySqlPool, String> {
    let options = connect_options(url)?;
    Ok(MySqlPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(SESSION_SQL).await?;
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    .await?;
                Ok(())
            })
        })
        .connect_lazy_with(options))
}

/// A target's pool: [`pool`]'s sessions, and none of them holds a lock or an idle
/// transaction longer than `guard_secs` (half a lease), so that a stopped zombie cannot block
/// a shard's next owner: `innodb_lock_wait_timeout`, and MariaDB's `idle_transaction_timeout`
/// (MySQL, which lacks it, ends the idle session by `wait_timeout`).
pub fn target_pool(url: &str, max_connections: u32, guard_secs: u64) -> Result<MySqlPool, String> {
    let options = connect_options(url)?;
    let guard = guard_secs.max(1);
    Ok(MySqlPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(SESSION_SQL).await?;
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    .await?;
                conn.execute(sqlx::AssertSqlSafe(format!(
                    "SET SESSION innodb_lock_wait_timeout = {guard}"
                )))
                .await?;
                let idle = format!("SET SESSION idle_transaction_timeout = {guard}");
                if conn.execute(sqlx::AssertSqlSafe(idle)).await.is_err() {
                    conn.execute(sqlx::AssertSqlSafe(format!("SET SESSION wait_timeout = {guard}")))
                        .await?;
                }
                Ok(())
            })
        })
        .connect_lazy_with(options))
}

/// The database a `mysql://…/db` URL names, if any.
pub fn url_database(url: &str) -> Option<String> {
    connect_options(url).ok()?.get_database().map(str::to_string)
}

/// The source clock in microseconds since the Unix epoch (UTC, read on the server).
/// `TIDEMARK_SOURCE_CLOCK_SQL` replaces the expression in tests (a test hook).
pub fn source_now_query() -> String {
    let clock = std::env::var("TIDEMARK_SOURCE_CLOCK_SQL_MYSQL").unwrap_or_else(|_| "UTC_TIMESTAMP(6)".to_string());
    format!("SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {clock}) AS SIGNED)")
}

/// The source clock now.
pub async fn source_now_micros(pool: &MySqlPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(source_now_query()))
        .fetch_one(pool)
        .await
}

/// Whether a driver error is worth retrying: the server is unreachable, restarting or
/// shutting down, the session was killed, a lock wait timed out or a deadlock was broken,
/// or the server has no connection left. Only MySQL server errors match the error numbers.
pub fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            // ER_CON_COUNT_ERROR, ER_SERVER_SHUTDOWN, ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK,
            // ER_QUERY_INTERRUPTED, ER_CONNECTION_KILLED
            .is_some_and(|e| matches!(e.number(), 1040 | 1053 | 1205 | 1213 | 1317 | 1927)),
        _ => false,
    }
}
