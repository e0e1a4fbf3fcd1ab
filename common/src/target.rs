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

    pub async fn close(&self) {
        match self {
            TargetPool::Postgres(pool) => pool.close().await,
            TargetPool::MySql(pool) => pool.close().await,
        }
    }
}
