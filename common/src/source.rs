//! The source boundary: what the worker and the coordinator ask of a source table, whatever
//! engine serves it. The engine is named by the URL's scheme (`postgres://`, `mysql://`,
//! `mariadb://`); its SQL lives in its own folder (`pg/`, `mysql/`). A source answers the
//! clock, what the open-transaction bound sees, the largest key, and pages of rows as COPY
//! text or (PostgreSQL to PostgreSQL) COPY binary in the staged layout.

use sqlx::mysql::MySqlPool;
use sqlx::postgres::PgPool;

use crate::cursor::{KeyValue, ShardRange};
use crate::mysql::MySqlStatements;
use crate::pg::deletes::LogUpper;
use crate::pg::visibility::{self, PreparedTransaction, Visibility};
use crate::pg::{TableName, TableSql};

/// A source database's engine, from its URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceEngine {
    Postgres,
    MySql,
}

impl SourceEngine {
    pub fn of_url(url: &str) -> Result<SourceEngine, String> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(SourceEngine::Postgres)
        } else if crate::mysql::is_mysql_url(url) {
            Ok(SourceEngine::MySql)
        } else {
            let scheme = url.split_once("://").map_or("", |(s, _)| s);
            Err(format!(
                "unknown database URL scheme {scheme:?}: use postgres://, mysql:// or mariadb://"
            ))
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SourceEngine::Postgres => "PostgreSQL",
            SourceEngine::MySql => "MySQL/MariaDB",
        }
    }
}

/// A connection pool to a source.
#[derive(Debug, Clone)]
pub enum SourcePool {
    Postgres(PgPool),
    MySql(MySqlPool),
}

impl SourcePool {
    /// A lazily connecting pool to the source at `url`, of the engine its scheme names (see
    /// [`crate::pg::guarded_pool`] for `guard`; a MySQL source session reads only).
    pub fn connect_lazy(
        url: &str,
        application_name: &str,
        max_connections: u32,
        guard: std::time::Duration,
    ) -> Result<SourcePool, String> {
        Ok(match SourceEngine::of_url(url)? {
            SourceEngine::Postgres => {
                SourcePool::Postgres(crate::pg::guarded_pool(url, application_name, max_connections, guard)?)
            }
            SourceEngine::MySql => SourcePool::MySql(crate::mysql::pool(url, max_connections)?),
        })
    }

    pub fn engine(&self) -> SourceEngine {
        match self {
            SourcePool::Postgres(_) => SourceEngine::Postgres,
            SourcePool::MySql(_) => SourceEngine::MySql,
        }
    }

    /// The PostgreSQL pool, for what only a PostgreSQL source offers (a delete log read by
    /// SQL of its own, binary pages, reconciliation's bucket hashes).
    pub fn postgres(&self) -> Option<&PgPool> {
        match self {
            SourcePool::Postgres(pool) => Some(pool),
            SourcePool::MySql(_) => None,
        }
    }

    /// The source's clock, microseconds since the Unix epoch.
    pub async fn now_micros(&self) -> Result<i64, sqlx::Error> {
        match self {
            SourcePool::Postgres(pool) => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(crate::pg::source_now_query()))
                    .fetch_one(pool)
                    .await
            }
            SourcePool::MySql(pool) => crate::mysql::source_now_micros(pool).await,
        }
    }

    /// What the open-transaction bound sees of `table`'s writers, and the oldest prepared
    /// transaction where the engine has ones without a known start.
    pub async fn visibility(
        &self,
        table: &TableName,
    ) -> Result<(Visibility, Option<PreparedTransaction>), sqlx::Error> {
        match self {
            SourcePool::Postgres(pool) => visibility::read(pool, table).await,
            SourcePool::MySql(pool) => Ok((crate::mysql::visibility::read(pool).await?, None)),
        }
    }

    /// One sample of the largest integer key and the clock after it (see `id_tail`).
    pub async fn key_sample(&self, reads: &SourceReads, sql: &TableSql) -> Result<(Option<i64>, i64), sqlx::Error> {
        let statement = reads.key_sample(sql);
        match self {
            SourcePool::Postgres(pool) => sqlx::query_as(sqlx::AssertSqlSafe(statement)).fetch_one(pool).await,
            SourcePool::MySql(pool) => sqlx::query_as(sqlx::AssertSqlSafe(statement)).fetch_one(pool).await,
        }
    }

    /// The statements a run reads the epoch's columns (`sql.columns`) with. A MySQL source's
    /// columns are read again and must still map to the epoch's types: `Ok(Err(reason))`
    /// when the schema changed.
    pub async fn reads_for(&self, sql: &TableSql) -> Result<Result<SourceReads, String>, sqlx::Error> {
        match self {
            SourcePool::Postgres(_) => Ok(Ok(SourceReads::Postgres)),
            SourcePool::MySql(pool) => Ok(MySqlStatements::for_epoch(pool, sql).await?.map(SourceReads::MySql)),
        }
    }

    /// Whether a driver error is worth retrying on this engine.
    pub fn is_transient(&self, error: &sqlx::Error) -> bool {
        match self {
            SourcePool::Postgres(_) => crate::pg::is_transient(error),
            SourcePool::MySql(_) => crate::mysql::is_transient(error),
        }
    }

    /// Statements on `table` that need none of its columns (the key sample).
    pub fn bare_reads(&self, table: &TableName) -> SourceReads {
        match self {
            SourcePool::Postgres(_) => SourceReads::Postgres,
            SourcePool::MySql(_) => SourceReads::MySql(MySqlStatements {
                table: table.clone(),
                columns: Vec::new(),
            }),
        }
    }

    /// The cursor's infinite values, where the engine has them (PostgreSQL), and its newest
    /// finite time (microseconds); `None` when the cursor column is gone (the schema check
    /// pauses the task).
    pub async fn cursor_extremes(
        &self,
        sql: &TableSql,
    ) -> Result<Option<(Option<Vec<String>>, Option<i64>)>, sqlx::Error> {
        match self {
            SourcePool::Postgres(pool) => Ok(Some(
                sqlx::query_as(sqlx::AssertSqlSafe(sql.cursor_extremes()))
                    .fetch_one(pool)
                    .await?,
            )),
            SourcePool::MySql(pool) => {
                let table = &sql.source;
                let columns = crate::mysql::types::columns(pool, &table.schema, &table.name)
                    .await?
                    .unwrap_or_default();
                if !columns.iter().any(|c| Some(&c.name) == sql.cursor_column.as_ref()) {
                    return Ok(None);
                }
                let reads = MySqlStatements {
                    table: table.clone(),
                    columns,
                };
                let newest: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(reads.newest_cursor(sql)))
                    .fetch_one(pool)
                    .await?;
                Ok(Some((None, newest)))
            }
        }
    }

    /// The median of the first key inside `range` (a split point) as text; `None` when the
    /// range holds no rows.
    pub async fn median_key(
        &self,
        reads: &SourceReads,
        sql: &TableSql,
        range: &ShardRange,
    ) -> Result<Option<String>, sqlx::Error> {
        match (self, reads) {
            (SourcePool::MySql(pool), SourceReads::MySql(m)) => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(m.median_key(sql, range)))
                    .fetch_optional(pool)
                    .await
            }
            (SourcePool::Postgres(pool), _) => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql.median_key(range)))
                    .fetch_one(pool)
                    .await
            }
            (SourcePool::MySql(_), SourceReads::Postgres) => Err(sqlx::Error::Protocol(
                "a MySQL source read with PostgreSQL statements".into(),
            )),
        }
    }

    /// Whether `a < b` in the first key column's own order (on MySQL, its collation).
    pub async fn key_less(
        &self,
        reads: &SourceReads,
        sql: &TableSql,
        a: &KeyValue,
        b: &KeyValue,
    ) -> Result<bool, sqlx::Error> {
        match (self, reads) {
            (SourcePool::MySql(pool), SourceReads::MySql(m)) => {
                let (charset, collation): (Option<String>, Option<String>) =
                    sqlx::query_as(crate::mysql::deletes::KEY_COLLATION)
                        .bind(&sql.source.schema)
                        .bind(&sql.source.name)
                        .bind(&sql.key_columns[0])
                        .fetch_one(pool)
                        .await?;
                let text = charset.as_deref().zip(collation.as_deref());
                let less: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(m.key_less(sql, a, b, text)))
                    .fetch_one(pool)
                    .await?;
                Ok(less != 0)
            }
            (SourcePool::Postgres(pool), _) => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(TableSql::key_less(a, b)))
                    .fetch_one(pool)
                    .await
            }
            (SourcePool::MySql(_), SourceReads::Postgres) => Err(sqlx::Error::Protocol(
                "a MySQL source read with PostgreSQL statements".into(),
            )),
        }
    }

    /// Removes the delete-log entries of `table` older than `cutoff_micros`; how many.
    pub async fn purge_delete_log(&self, table: &TableName, cutoff_micros: i64) -> Result<u64, sqlx::Error> {
        match self {
            SourcePool::Postgres(pool) => {
                let purged: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(crate::pg::deletes::purge_query(table)))
                    .bind(cutoff_micros)
                    .fetch_one(pool)
                    .await?;
                Ok(purged.max(0) as u64)
            }
            SourcePool::MySql(pool) => {
                let log = crate::pg::deletes::delete_log_table(table);
                let done = sqlx::query(sqlx::AssertSqlSafe(crate::mysql::deletes::purge(&log, cutoff_micros)))
                    .execute(pool)
                    .await?;
                Ok(done.rows_affected())
            }
        }
    }

    /// The latest TRUNCATE of `table` a delete-logged source recorded (microseconds), where
    /// the engine records them (PostgreSQL's statement trigger); `None` elsewhere.
    pub async fn last_truncate_micros(&self, table: &TableName) -> Result<Option<i64>, sqlx::Error> {
        match self {
            SourcePool::Postgres(pool) => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(crate::pg::deletes::last_truncate_query(table)))
                    .fetch_one(pool)
                    .await
            }
            SourcePool::MySql(_) => Ok(None),
        }
    }

    /// An identity of the table's storage that a TRUNCATE changes, where the engine has no
    /// TRUNCATE trigger (MySQL's InnoDB table id, see `mysql::deletes::table_id_queries`);
    /// `None` where TRUNCATEs are recorded instead.
    pub async fn table_identity(&self, table: &TableName) -> Result<Option<String>, sqlx::Error> {
        match self {
            SourcePool::Postgres(_) => Ok(None),
            SourcePool::MySql(pool) => {
                let mut last = Ok(None);
                for query in crate::mysql::deletes::table_id_queries(table) {
                    match sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(query))
                        .fetch_optional(pool)
                        .await
                    {
                        Ok(Some(id)) => return Ok(Some(id)),
                        // MariaDB lacks MySQL 8's view and the other way round.
                        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42S02") => {}
                        Err(e) => last = Err(e),
                        Ok(None) => {}
                    }
                }
                last
            }
        }
    }

    /// Runs a page statement and returns its rows as COPY bytes (text, or binary where the
    /// statement asks for it) and, on PostgreSQL, the table's column types read on the same
    /// session right after the page (a type change is seen by the page it could affect).
    pub async fn read_copy(
        &self,
        statement: &str,
        table: &TableName,
    ) -> Result<(bytes::Bytes, Option<crate::pg::ColumnTypes>), sqlx::Error> {
        match self {
            SourcePool::Postgres(pool) => {
                use futures::TryStreamExt;
                let mut conn = pool.acquire().await?;
                let mut stream = conn.copy_out_raw(statement).await?;
                let mut buffer = bytes::BytesMut::new();
                while let Some(chunk) = stream.try_next().await? {
                    buffer.extend_from_slice(&chunk);
                }
                drop(stream);
                let types = crate::pg::column_types(&mut *conn, table).await?;
                Ok((buffer.freeze(), Some(types)))
            }
            // The statement renders every field as COPY text of the mapped type.
            SourcePool::MySql(pool) => Ok((
                bytes::Bytes::from(crate::mysql::read::copy_text(pool, statement).await?.0),
                None,
            )),
        }
    }

    /// The table's column types where the engine's pages can be binary (PostgreSQL).
    pub async fn binary_column_types(&self, table: &TableName) -> Result<Option<crate::pg::ColumnTypes>, sqlx::Error> {
        match self {
            SourcePool::Postgres(pool) => Ok(Some(crate::pg::column_types(pool, table).await?)),
            SourcePool::MySql(_) => Ok(None),
        }
    }

    pub async fn close(&self) {
        match self {
            SourcePool::Postgres(pool) => pool.close().await,
            SourcePool::MySql(pool) => pool.close().await,
        }
    }
}

/// The statements a task reads its source table with, in the source's dialect.
#[derive(Debug, Clone)]
pub enum SourceReads {
    /// `COPY (SELECT …) TO STDOUT` from [`TableSql`].
    Postgres,
    MySql(MySqlStatements),
}

impl SourceReads {
    pub fn snapshot_page(
        &self,
        sql: &TableSql,
        range: &ShardRange,
        after_key: Option<&[KeyValue]>,
        max_key: Option<&KeyValue>,
        limit: u32,
    ) -> String {
        match self {
            SourceReads::Postgres => sql.snapshot_page(range, after_key, max_key, limit),
            SourceReads::MySql(m) => m.snapshot_page(sql, range, after_key, max_key, limit),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn incremental_page(
        &self,
        sql: &TableSql,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        high_micros: i64,
        upto: Option<(i64, &[KeyValue])>,
        limit: u32,
    ) -> String {
        match self {
            SourceReads::Postgres => sql.incremental_page_upto(range, t_micros, after_key, high_micros, upto, limit),
            SourceReads::MySql(m) => m.incremental_page(sql, range, t_micros, after_key, high_micros, upto, limit),
        }
    }

    /// A page of the trigger-fed delete log `log` (see `pg::deletes`, `mysql::deletes`).
    #[allow(clippy::too_many_arguments)]
    pub fn delete_log_page(
        &self,
        sql: &TableSql,
        log: &TableName,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        upper: LogUpper<'_>,
        limit: u32,
    ) -> String {
        match self {
            SourceReads::Postgres => sql.delete_log_page(log, range, t_micros, after_key, upper, limit),
            SourceReads::MySql(m) => m.delete_log_page(sql, log, range, t_micros, after_key, upper, limit),
        }
    }

    /// The source rows of `keys` in the staged layout (reconciliation's repairs).
    pub fn rows_by_key(&self, sql: &TableSql, keys: &[Vec<KeyValue>]) -> String {
        match self {
            SourceReads::Postgres => sql.rows_by_key(keys),
            SourceReads::MySql(m) => m.rows_by_key(sql, keys),
        }
    }

    pub fn key_sample(&self, sql: &TableSql) -> String {
        match self {
            SourceReads::Postgres => sql.key_sample(),
            SourceReads::MySql(m) => m.key_sample(sql),
        }
    }
}
