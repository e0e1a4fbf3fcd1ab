//! What reconciliation reads of each side of a task, whatever engine serves it: per bucket a
//! count and a hash sum, the first key's bounds, key quantiles, and a small range's `(key,
//! version, content)` rows. The statements are each engine's (`pg::reconcile`,
//! `mysql::reconcile`); this runs them and returns plain values, so the worker's
//! reconciliation names no driver.

use std::collections::HashMap;

use sqlx::Row;
use sqlx::mysql::MySqlPool;
use sqlx::postgres::PgPool;

use crate::cursor::KeyValue;
use crate::mysql::MySqlStatements;
use crate::mysql::reconcile::TargetStatements;
use crate::pg::TableSql;
use crate::pg::reconcile::{Scope, Side};
use crate::source::{SourcePool, SourceReads};
use crate::target::TargetPool;

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The engine does not offer this comparison (the coordinator refuses such runs).
    #[error("{0}")]
    Unsupported(String),
}

/// A bucket's row count and hash sum, by bucket number.
pub type BucketSums = HashMap<i32, (i64, String)>;

/// A range's rows: key values (as text) → (version, content hash).
pub type KeyVersions = HashMap<Vec<String>, (i64, i64)>;

enum Engine<'a> {
    Postgres(&'a PgPool),
    MySqlSource(&'a MySqlPool, &'a MySqlStatements),
    MySqlTarget(&'a MySqlPool),
}

/// One side's reads.
pub struct SideReads<'a> {
    side: Side,
    sql: &'a TableSql,
    engine: Engine<'a>,
}

impl<'a> SideReads<'a> {
    pub fn source(pool: &'a SourcePool, reads: &'a SourceReads, sql: &'a TableSql) -> Result<Self, ReadError> {
        let engine = match (pool, reads) {
            (SourcePool::Postgres(pool), _) => Engine::Postgres(pool),
            (SourcePool::MySql(pool), SourceReads::MySql(statements)) => Engine::MySqlSource(pool, statements),
            (SourcePool::MySql(_), SourceReads::Postgres) => {
                return Err(ReadError::Unsupported(
                    "a MySQL source read with PostgreSQL statements".into(),
                ));
            }
        };
        Ok(SideReads {
            side: Side::Source,
            sql,
            engine,
        })
    }

    pub fn target(pool: &'a TargetPool, sql: &'a TableSql) -> Self {
        let engine = match pool {
            TargetPool::Postgres(pool) => Engine::Postgres(pool),
            TargetPool::MySql(pool) => Engine::MySqlTarget(pool),
        };
        SideReads {
            side: Side::Target,
            sql,
            engine,
        }
    }

    /// Whether this side hashes every column's content as the other engine would (only
    /// PostgreSQL on both sides does); otherwise runs compare versions with the portable hash.
    pub fn hashes_content(&self) -> bool {
        matches!(self.engine, Engine::Postgres(_))
    }

    fn target_statements(&self) -> TargetStatements<'_> {
        TargetStatements { sql: self.sql }
    }

    /// Count and hash sum per bucket of the first key split at `thresholds`.
    pub async fn bucket_sums(&self, scope: &Scope<'_>, thresholds: &[KeyValue]) -> Result<BucketSums, ReadError> {
        let mysql_rows = |rows: Vec<(i64, i64, String)>| {
            rows.into_iter()
                .map(|(bucket, count, hash)| (bucket as i32, (count, hash)))
                .collect()
        };
        Ok(match &self.engine {
            Engine::Postgres(pool) => {
                let statement = self.sql.checksum_buckets(self.side, scope, thresholds);
                sqlx::query(sqlx::AssertSqlSafe(statement))
                    .fetch_all(*pool)
                    .await?
                    .into_iter()
                    .map(|row| (row.get::<i32, _>(0), (row.get::<i64, _>(1), row.get::<String, _>(2))))
                    .collect()
            }
            Engine::MySqlSource(pool, statements) => mysql_rows(
                sqlx::query_as(sqlx::AssertSqlSafe(
                    statements.checksum_buckets(self.sql, scope, thresholds),
                ))
                .fetch_all(*pool)
                .await?,
            ),
            Engine::MySqlTarget(pool) => {
                let statement = self
                    .target_statements()
                    .checksum_buckets(scope, thresholds)
                    .map_err(ReadError::Unsupported)?;
                mysql_rows(sqlx::query_as(sqlx::AssertSqlSafe(statement)).fetch_all(*pool).await?)
            }
        })
    }

    /// The first key's smallest and largest value in the scope, as text.
    pub async fn key_bounds(&self, scope: &Scope<'_>) -> Result<(Option<String>, Option<String>), ReadError> {
        Ok(match &self.engine {
            Engine::Postgres(pool) => {
                sqlx::query_as(sqlx::AssertSqlSafe(self.sql.key_bounds(self.side, scope)))
                    .fetch_one(*pool)
                    .await?
            }
            Engine::MySqlSource(pool, statements) => {
                sqlx::query_as(sqlx::AssertSqlSafe(statements.key_bounds(self.sql, scope)))
                    .fetch_one(*pool)
                    .await?
            }
            Engine::MySqlTarget(pool) => {
                let statement = self
                    .target_statements()
                    .key_bounds(scope)
                    .map_err(ReadError::Unsupported)?;
                sqlx::query_as(sqlx::AssertSqlSafe(statement)).fetch_one(*pool).await?
            }
        })
    }

    /// Quantiles of the first key that split the scope into `parts` (non-integer keys).
    pub async fn key_quantiles(&self, scope: &Scope<'_>, parts: u32) -> Result<Option<Vec<String>>, ReadError> {
        match &self.engine {
            Engine::Postgres(pool) => Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(
                self.sql.key_quantiles(self.side, scope, parts),
            ))
            .fetch_one(*pool)
            .await?),
            // Refused at planning: buckets of text keys do not compare alike across engines.
            Engine::MySqlSource(..) | Engine::MySqlTarget(_) => Err(ReadError::Unsupported(
                "reconciliation with a MySQL/MariaDB side needs a single integer key".into(),
            )),
        }
    }

    /// The rows of a small range.
    pub async fn key_versions(&self, scope: &Scope<'_>) -> Result<KeyVersions, ReadError> {
        let mysql_rows = |rows: Vec<(String, i64, i64)>| {
            rows.into_iter()
                .map(|(key, version, content)| (vec![key], (version, content)))
                .collect()
        };
        Ok(match &self.engine {
            Engine::Postgres(pool) => sqlx::query(sqlx::AssertSqlSafe(self.sql.key_versions(self.side, scope)))
                .fetch_all(*pool)
                .await?
                .into_iter()
                .map(|row| {
                    (
                        row.get::<Vec<String>, _>(0),
                        (row.get::<i64, _>(1), row.get::<i64, _>(2)),
                    )
                })
                .collect(),
            Engine::MySqlSource(pool, statements) => mysql_rows(
                sqlx::query_as(sqlx::AssertSqlSafe(statements.key_versions(self.sql, scope)))
                    .fetch_all(*pool)
                    .await?,
            ),
            Engine::MySqlTarget(pool) => {
                let statement = self
                    .target_statements()
                    .key_versions(scope)
                    .map_err(ReadError::Unsupported)?;
                mysql_rows(sqlx::query_as(sqlx::AssertSqlSafe(statement)).fetch_all(*pool).await?)
            }
        })
    }
}
