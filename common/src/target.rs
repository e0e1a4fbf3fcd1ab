//! The target boundary: the database a task writes into, whatever engine serves it (named by
//! the URL's scheme, as a source is; see [`SourceEngine::of_url`]). Each engine's statements
//! live in its own folder (`pg/`, `mysql/target.rs`).

use sqlx::mysql::MySqlPool;
use sqlx::postgres::PgPool;

use crate::source::SourceEngine;

/// A connection pool to a target.
#[derive(Debug, Clone)]
pub enum TargetPool {
    Postgres(PgPool),
    MySql(MySqlPool),
}

impl TargetPool {
    /// A lazily connecting pool to the target at `url`, of the engine its scheme names; no
    /// session holds a lock or an idle transaction longer than `guard`.
    pub fn connect_lazy(
        url: &str,
        application_name: &str,
        max_connections: u32,
        guard: std::time::Duration,
    ) -> Result<TargetPool, String> {
        Ok(match SourceEngine::of_url(url)? {
            SourceEngine::Postgres => {
                TargetPool::Postgres(crate::pg::guarded_pool(url, application_name, max_connections, guard)?)
            }
            SourceEngine::MySql => TargetPool::MySql(crate::mysql::target_pool(url, max_connections, guard.as_secs())?),
        })
    }

    pub fn engine(&self) -> SourceEngine {
        match self {
            TargetPool::Postgres(_) => SourceEngine::Postgres,
            TargetPool::MySql(_) => SourceEngine::MySql,
        }
    }

    /// The PostgreSQL pool, or an error naming `what` as not yet offered on this engine.
    pub fn postgres(&self, what: &str) -> Result<&PgPool, String> {
        match self {
            TargetPool::Postgres(pool) => Ok(pool),
            TargetPool::MySql(_) => Err(format!("{what} is not supported on a MySQL/MariaDB target yet")),
        }
    }

    /// The table's column types where the engine takes binary batches (PostgreSQL).
    pub async fn binary_column_types(
        &self,
        table: &crate::pg::TableName,
    ) -> Result<Option<crate::pg::ColumnTypes>, sqlx::Error> {
        match self {
            TargetPool::Postgres(pool) => Ok(Some(crate::pg::column_types(pool, table).await?)),
            TargetPool::MySql(_) => Ok(None),
        }
    }

    pub async fn close(&self) {
        match self {
            TargetPool::Postgres(pool) => pool.close().await,
            TargetPool::MySql(pool) => pool.close().await,
        }
    }
}
