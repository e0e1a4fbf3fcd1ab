//! PostgreSQL behind the boundary: the [`Engine`] entry, the [`Source`], [`Target`] and
//! [`SideReads`] implementations. The statements are this folder's (`pg.rs`, `deletes`,
//! `visibility`, `reconcile`).

use std::any::Any;

use sqlx::Row;
use sqlx::postgres::PgPool;

use super::deletes::LogUpper;
use super::reconcile::{Scope, Side};
use super::visibility::{self, PreparedTransaction, Visibility};
use super::{ColumnTypes, TableName, TableSql};
use crate::cursor::{KeyValue, ShardRange};
use crate::engines::Engine;
use crate::reconcile_reads::{BucketSums, KeyVersions, ReadError, SideReads};
use crate::source::{CopyPage, PageRequest, PageStatements, Source, SourcePool, SourceReads};
use crate::target::{Target, TargetPool};

pub static ENGINE: Engine = Engine {
    id: "postgres",
    name: "PostgreSQL",
    schemes: &["postgres", "postgresql"],
    hashes_content: true,
    // A bare table name is in the search path's first schema.
    url_database: None,
    retry_fixes: |error| {
        // lock_not_available: `lock_timeout` ended a wait for a lock a zombie holds.
        let lock_timeout = matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"));
        super::is_transient(error) || lock_timeout
    },
    row_error_class: |db| {
        db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
        super::row_error_class(db.code()?.as_ref())
    },
    source: |url, application_name, max_connections, guard| {
        Ok(source_pool(super::guarded_pool(
            url,
            application_name,
            max_connections,
            guard,
        )?))
    },
    target: Some(|url, application_name, max_connections, guard| {
        Ok(target_pool(super::guarded_pool(
            url,
            application_name,
            max_connections,
            guard,
        )?))
    }),
};

/// A PostgreSQL source.
#[derive(Debug, Clone)]
pub struct PgSource {
    pub pool: PgPool,
}

/// A PostgreSQL target.
#[derive(Debug, Clone)]
pub struct PgTarget {
    pub pool: PgPool,
}

pub fn source_pool(pool: PgPool) -> SourcePool {
    SourcePool::new(PgSource { pool })
}

pub fn target_pool(pool: PgPool) -> TargetPool {
    TargetPool::new(PgTarget { pool })
}

/// The PostgreSQL pool of a source, if it is one.
pub fn pg_source(source: &SourcePool) -> Option<&PgPool> {
    source.downcast::<PgSource>().map(|source| &source.pool)
}

/// The PostgreSQL pool of a target, if it is one.
pub fn pg_target(target: &TargetPool) -> Option<&PgPool> {
    target.downcast::<PgTarget>().map(|target| &target.pool)
}

/// `COPY (SELECT …) TO STDOUT` statements from [`TableSql`].
#[derive(Debug, Clone, Copy)]
pub struct PgReads;

impl PageStatements for PgReads {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn snapshot_page(
        &self,
        sql: &TableSql,
        range: &ShardRange,
        after_key: Option<&[KeyValue]>,
        max_key: Option<&KeyValue>,
        limit: u32,
    ) -> String {
        sql.snapshot_page(range, after_key, max_key, limit)
    }

    fn incremental_page(
        &self,
        sql: &TableSql,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        high_micros: i64,
        upto: Option<(i64, &[KeyValue])>,
        limit: u32,
    ) -> String {
        sql.incremental_page_upto(range, t_micros, after_key, high_micros, upto, limit)
    }

    fn delete_log_page(
        &self,
        sql: &TableSql,
        log: &TableName,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        upper: LogUpper<'_>,
        limit: u32,
    ) -> String {
        sql.delete_log_page(log, range, t_micros, after_key, upper, limit)
    }

    fn rows_by_key(&self, sql: &TableSql, keys: &[Vec<KeyValue>]) -> String {
        sql.rows_by_key(keys)
    }

    fn key_sample(&self, sql: &TableSql) -> String {
        sql.key_sample()
    }
}

#[async_trait::async_trait]
impl Source for PgSource {
    fn engine(&self) -> &'static Engine {
        &ENGINE
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    async fn now_micros(&self) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(super::source_now_query()))
            .fetch_one(&self.pool)
            .await
    }

    async fn visibility(&self, table: &TableName) -> Result<(Visibility, Option<PreparedTransaction>), sqlx::Error> {
        visibility::read(&self.pool, table).await
    }

    async fn key_sample(&self, reads: &SourceReads, sql: &TableSql) -> Result<(Option<i64>, i64), sqlx::Error> {
        sqlx::query_as(sqlx::AssertSqlSafe(reads.key_sample(sql)))
            .fetch_one(&self.pool)
            .await
    }

    async fn reads_for(&self, _sql: &TableSql) -> Result<Result<SourceReads, String>, sqlx::Error> {
        Ok(Ok(SourceReads::new(PgReads)))
    }

    fn bare_reads(&self, _table: &TableName) -> SourceReads {
        SourceReads::new(PgReads)
    }

    fn is_transient(&self, error: &sqlx::Error) -> bool {
        super::is_transient(error)
    }

    async fn cursor_extremes(&self, sql: &TableSql) -> Result<Option<(Option<Vec<String>>, Option<i64>)>, sqlx::Error> {
        Ok(Some(
            sqlx::query_as(sqlx::AssertSqlSafe(sql.cursor_extremes()))
                .fetch_one(&self.pool)
                .await?,
        ))
    }

    async fn median_key(
        &self,
        _reads: &SourceReads,
        sql: &TableSql,
        range: &ShardRange,
    ) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.median_key(range)))
            .fetch_one(&self.pool)
            .await
    }

    async fn key_less(
        &self,
        _reads: &SourceReads,
        _sql: &TableSql,
        a: &KeyValue,
        b: &KeyValue,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(TableSql::key_less(a, b)))
            .fetch_one(&self.pool)
            .await
    }

    async fn purge_delete_log(&self, table: &TableName, cutoff_micros: i64) -> Result<u64, sqlx::Error> {
        let purged: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(super::deletes::purge_query(table)))
            .bind(cutoff_micros)
            .fetch_one(&self.pool)
            .await?;
        Ok(purged.max(0) as u64)
    }

    async fn last_truncate_micros(&self, table: &TableName) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(super::deletes::last_truncate_query(table)))
            .fetch_one(&self.pool)
            .await
    }

    async fn table_identity(&self, _table: &TableName) -> Result<Option<String>, sqlx::Error> {
        Ok(None)
    }

    async fn read_copy(
        &self,
        statement: &str,
        table: &TableName,
        page: PageRequest<'_>,
    ) -> Result<CopyPage, sqlx::Error> {
        let (buffer, mut conn) = super::copy_out::read_all(self.pool.acquire().await?, statement).await?;
        let types = super::column_types(&mut *conn, table).await?;
        Ok(CopyPage {
            data: buffer.freeze(),
            // The statement names the format (`COPY … TO STDOUT (FORMAT binary)`).
            format: page.format,
            types: Some(types),
        })
    }

    async fn binary_column_types(&self, table: &TableName) -> Result<Option<ColumnTypes>, sqlx::Error> {
        Ok(Some(super::column_types(&self.pool, table).await?))
    }

    fn reconcile_reads<'a>(
        &'a self,
        _reads: &'a SourceReads,
        sql: &'a TableSql,
    ) -> Result<Box<dyn SideReads + 'a>, ReadError> {
        Ok(Box::new(PgSide {
            pool: &self.pool,
            side: Side::Source,
            sql,
        }))
    }

    async fn close(&self) {
        self.pool.close().await
    }
}

#[async_trait::async_trait]
impl Target for PgTarget {
    fn engine(&self) -> &'static Engine {
        &ENGINE
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    async fn binary_column_types(&self, table: &TableName) -> Result<Option<ColumnTypes>, sqlx::Error> {
        Ok(Some(super::column_types(&self.pool, table).await?))
    }

    async fn live_epoch(&self, task: &str) -> Result<Option<u64>, sqlx::Error> {
        let epoch: Option<i64> = sqlx::query_scalar(crate::pg::TARGET_EPOCH_NOW)
            .bind(task)
            .fetch_optional(&self.pool)
            .await?;
        Ok(epoch.map(|e| e as u64))
    }

    fn reconcile_reads<'a>(&'a self, sql: &'a TableSql) -> Box<dyn SideReads + 'a> {
        Box::new(PgSide {
            pool: &self.pool,
            side: Side::Target,
            sql,
        })
    }

    async fn close(&self) {
        self.pool.close().await
    }
}

/// One PostgreSQL side of a reconciliation.
struct PgSide<'a> {
    pool: &'a PgPool,
    side: Side,
    sql: &'a TableSql,
}

#[async_trait::async_trait]
impl SideReads for PgSide<'_> {
    async fn bucket_sums(&self, scope: &Scope<'_>, thresholds: &[KeyValue]) -> Result<BucketSums, ReadError> {
        let statement = self
            .sql
            .checksum_buckets(self.side, scope, thresholds)
            .map_err(ReadError::Unsupported)?;
        Ok(sqlx::query(sqlx::AssertSqlSafe(statement))
            .fetch_all(self.pool)
            .await?
            .into_iter()
            .map(|row| (row.get::<i32, _>(0), (row.get::<i64, _>(1), row.get::<String, _>(2))))
            .collect())
    }

    async fn key_bounds(&self, scope: &Scope<'_>) -> Result<(Option<String>, Option<String>), ReadError> {
        Ok(
            sqlx::query_as(sqlx::AssertSqlSafe(self.sql.key_bounds(self.side, scope)))
                .fetch_one(self.pool)
                .await?,
        )
    }

    async fn key_quantiles(&self, scope: &Scope<'_>, parts: u32) -> Result<Option<Vec<String>>, ReadError> {
        Ok(
            sqlx::query_scalar(sqlx::AssertSqlSafe(self.sql.key_quantiles(self.side, scope, parts)))
                .fetch_one(self.pool)
                .await?,
        )
    }

    async fn key_versions(&self, scope: &Scope<'_>) -> Result<KeyVersions, ReadError> {
        Ok(sqlx::query(sqlx::AssertSqlSafe(
            self.sql
                .key_versions(self.side, scope)
                .map_err(ReadError::Unsupported)?,
        ))
        .fetch_all(self.pool)
        .await?
        .into_iter()
        .map(|row| {
            (
                row.get::<Vec<String>, _>(0),
                (row.get::<i64, _>(1), row.get::<i64, _>(2)),
            )
        })
        .collect())
    }
}
