//! MySQL and MariaDB behind the boundary: the [`Engine`] entry, the [`Source`], [`Target`]
//! and [`SideReads`] implementations. The statements are this folder's.

use std::any::Any;

use sqlx::mysql::MySqlPool;

use super::MySqlStatements;
use super::reconcile::TargetStatements;
use crate::copy_format::CopyFormat;
use crate::cursor::{KeyValue, ShardRange};
use crate::engines::Engine;
use crate::pg::deletes::LogUpper;
use crate::pg::reconcile::Scope;
use crate::pg::visibility::{PreparedTransaction, Visibility};
use crate::pg::{ColumnTypes, TableName, TableSql};
use crate::reconcile_reads::{BucketSums, KeyVersions, ReadError, SideReads};
use crate::source::{CopyPage, PageRequest, PageStatements, Source, SourcePool, SourceReads, foreign_reads};
use crate::target::{Target, TargetPool};
use crate::text_to_binary::FieldEncoder;

pub static ENGINE: Engine = Engine {
    id: "mysql",
    name: "MySQL/MariaDB",
    schemes: &["mysql", "mariadb"],
    hashes_content: false,
    url_database: Some(super::url_database),
    // ER_LOCK_WAIT_TIMEOUT is among the transient errors.
    retry_fixes: super::is_transient,
    row_error_class: |db| {
        let error = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()?;
        super::target::row_error_class(error.number()).map(str::to_string)
    },
    // A source session reads only: it holds no lock a guard would have to end.
    source: |url, _application_name, max_connections, _guard| Ok(source_pool(super::pool(url, max_connections)?)),
    target: Some(|url, _application_name, max_connections, guard| {
        Ok(target_pool(super::target_pool(url, max_connections, guard.as_secs())?))
    }),
};

/// A MySQL/MariaDB source.
#[derive(Debug, Clone)]
pub struct MySqlSource {
    pub pool: MySqlPool,
}

/// A MySQL/MariaDB target.
#[derive(Debug, Clone)]
pub struct MySqlTarget {
    pub pool: MySqlPool,
}

pub fn source_pool(pool: MySqlPool) -> SourcePool {
    SourcePool::new(MySqlSource { pool })
}

pub fn target_pool(pool: MySqlPool) -> TargetPool {
    TargetPool::new(MySqlTarget { pool })
}

/// The MySQL pool of a source, if it is one.
pub fn mysql_source(source: &SourcePool) -> Option<&MySqlPool> {
    source.downcast::<MySqlSource>().map(|source| &source.pool)
}

/// The MySQL pool of a target, if it is one.
pub fn mysql_target(target: &TargetPool) -> Option<&MySqlPool> {
    target.downcast::<MySqlTarget>().map(|target| &target.pool)
}

fn statements(reads: &SourceReads) -> Result<&MySqlStatements, sqlx::Error> {
    reads
        .downcast::<MySqlStatements>()
        .ok_or_else(|| foreign_reads(&ENGINE))
}

impl PageStatements for MySqlStatements {
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
        MySqlStatements::snapshot_page(self, sql, range, after_key, max_key, limit)
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
        MySqlStatements::incremental_page(self, sql, range, t_micros, after_key, high_micros, upto, limit)
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
        MySqlStatements::delete_log_page(self, sql, log, range, t_micros, after_key, upper, limit)
    }

    fn rows_by_key(&self, sql: &TableSql, keys: &[Vec<KeyValue>]) -> String {
        MySqlStatements::rows_by_key(self, sql, keys)
    }

    fn key_sample(&self, sql: &TableSql) -> String {
        MySqlStatements::key_sample(self, sql)
    }
}

#[async_trait::async_trait]
impl Source for MySqlSource {
    fn engine(&self) -> &'static Engine {
        &ENGINE
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    async fn now_micros(&self) -> Result<i64, sqlx::Error> {
        super::source_now_micros(&self.pool).await
    }

    async fn visibility(&self, _table: &TableName) -> Result<(Visibility, Option<PreparedTransaction>), sqlx::Error> {
        Ok((super::visibility::read(&self.pool).await?, None))
    }

    async fn key_sample(&self, reads: &SourceReads, sql: &TableSql) -> Result<(Option<i64>, i64), sqlx::Error> {
        sqlx::query_as(sqlx::AssertSqlSafe(reads.key_sample(sql)))
            .fetch_one(&self.pool)
            .await
    }

    /// The columns are read again and must still map to the epoch's types.
    async fn reads_for(&self, sql: &TableSql) -> Result<Result<SourceReads, String>, sqlx::Error> {
        Ok(MySqlStatements::for_epoch(&self.pool, sql).await?.map(SourceReads::new))
    }

    fn bare_reads(&self, table: &TableName) -> SourceReads {
        SourceReads::new(MySqlStatements {
            table: table.clone(),
            columns: Vec::new(),
        })
    }

    fn is_transient(&self, error: &sqlx::Error) -> bool {
        super::is_transient(error)
    }

    async fn cursor_extremes(&self, sql: &TableSql) -> Result<Option<(Option<Vec<String>>, Option<i64>)>, sqlx::Error> {
        let table = &sql.source;
        let columns = super::types::columns(&self.pool, &table.schema, &table.name)
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
            .fetch_one(&self.pool)
            .await?;
        Ok(Some((None, newest)))
    }

    async fn median_key(
        &self,
        reads: &SourceReads,
        sql: &TableSql,
        range: &ShardRange,
    ) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(statements(reads)?.median_key(sql, range)))
            .fetch_optional(&self.pool)
            .await
    }

    async fn key_less(
        &self,
        reads: &SourceReads,
        sql: &TableSql,
        a: &KeyValue,
        b: &KeyValue,
    ) -> Result<bool, sqlx::Error> {
        let statements = statements(reads)?;
        let (charset, collation): (Option<String>, Option<String>) = sqlx::query_as(super::deletes::KEY_COLLATION)
            .bind(&sql.source.schema)
            .bind(&sql.source.name)
            .bind(&sql.key_columns[0])
            .fetch_one(&self.pool)
            .await?;
        let text = charset.as_deref().zip(collation.as_deref());
        let less: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(statements.key_less(sql, a, b, text)))
            .fetch_one(&self.pool)
            .await?;
        Ok(less != 0)
    }

    async fn purge_delete_log(&self, table: &TableName, cutoff_micros: i64) -> Result<u64, sqlx::Error> {
        let log = crate::pg::deletes::delete_log_table(table);
        let done = sqlx::query(sqlx::AssertSqlSafe(super::deletes::purge(&log, cutoff_micros)))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// TRUNCATE fires no trigger here: [`Source::table_identity`] sees it instead.
    async fn last_truncate_micros(&self, _table: &TableName) -> Result<Option<i64>, sqlx::Error> {
        Ok(None)
    }

    /// The InnoDB table id (see `mysql::deletes::table_id_queries`).
    async fn table_identity(&self, table: &TableName) -> Result<Option<String>, sqlx::Error> {
        let mut last = Ok(None);
        for query in super::deletes::table_id_queries(table) {
            match sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(query))
                .fetch_optional(&self.pool)
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

    /// The statement renders every field as COPY text of the mapped type.
    async fn read_copy(
        &self,
        statement: &str,
        _table: &TableName,
        page: PageRequest<'_>,
    ) -> Result<CopyPage, sqlx::Error> {
        let encoders: Option<Vec<FieldEncoder>> = match page.format {
            CopyFormat::Binary => page.field_types.iter().map(|t| FieldEncoder::for_type(t)).collect(),
            CopyFormat::Text => None,
        };
        if let Some(encoders) = encoders {
            match super::read::copy_binary(&self.pool, statement, &encoders).await? {
                (Ok(data), _) => {
                    return Ok(CopyPage {
                        data: data.into(),
                        format: CopyFormat::Binary,
                        types: None,
                    });
                }
                (Err(why), row) => {
                    tracing::debug!(row, reason = %why, "a value has no exact binary form; reading the page as COPY text")
                }
            }
        }
        Ok(CopyPage {
            data: super::read::copy_text(&self.pool, statement).await?.0.into(),
            format: CopyFormat::Text,
            types: None,
        })
    }

    /// The columns' mapped types, built in where a page can encode them in binary.
    async fn binary_column_types(&self, table: &TableName) -> Result<Option<ColumnTypes>, sqlx::Error> {
        let Some(columns) = super::types::columns(&self.pool, &table.schema, &table.name).await? else {
            return Ok(Some(Vec::new()));
        };
        Ok(Some(
            columns
                .into_iter()
                .filter_map(|column| {
                    let mapped = column.target_type().ok()?;
                    let encodable = FieldEncoder::for_type(&mapped).is_some();
                    Some((column.name, mapped, encodable))
                })
                .collect(),
        ))
    }

    fn reconcile_reads<'a>(
        &'a self,
        reads: &'a SourceReads,
        sql: &'a TableSql,
    ) -> Result<Box<dyn SideReads + 'a>, ReadError> {
        let statements = statements(reads)?;
        Ok(Box::new(MySqlSide {
            pool: &self.pool,
            sql,
            statements: Statements::Source(statements),
        }))
    }

    async fn close(&self) {
        self.pool.close().await
    }
}

#[async_trait::async_trait]
impl Target for MySqlTarget {
    fn engine(&self) -> &'static Engine {
        &ENGINE
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    async fn binary_column_types(&self, _table: &TableName) -> Result<Option<ColumnTypes>, sqlx::Error> {
        Ok(None)
    }

    async fn live_epoch(&self, task: &str) -> Result<Option<u64>, sqlx::Error> {
        let epoch: Option<i64> = sqlx::query_scalar(super::target::TARGET_EPOCH_NOW)
            .bind(task)
            .fetch_optional(&self.pool)
            .await?;
        Ok(epoch.map(|e| e as u64))
    }

    fn reconcile_reads<'a>(&'a self, sql: &'a TableSql) -> Box<dyn SideReads + 'a> {
        Box::new(MySqlSide {
            pool: &self.pool,
            sql,
            statements: Statements::Target(TargetStatements { sql }),
        })
    }

    async fn close(&self) {
        self.pool.close().await
    }
}

enum Statements<'a> {
    Source(&'a MySqlStatements),
    Target(TargetStatements<'a>),
}

/// One MySQL/MariaDB side of a reconciliation: versions with the portable hash, on a single
/// integer key.
struct MySqlSide<'a> {
    pool: &'a MySqlPool,
    sql: &'a TableSql,
    statements: Statements<'a>,
}

#[async_trait::async_trait]
impl SideReads for MySqlSide<'_> {
    async fn bucket_sums(&self, scope: &Scope<'_>, thresholds: &[KeyValue]) -> Result<BucketSums, ReadError> {
        let statement = match &self.statements {
            Statements::Source(statements) => statements
                .checksum_buckets(self.sql, scope, thresholds)
                .map_err(ReadError::Unsupported)?,
            Statements::Target(statements) => statements
                .checksum_buckets(scope, thresholds)
                .map_err(ReadError::Unsupported)?,
        };
        let rows: Vec<(i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(statement))
            .fetch_all(self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(bucket, count, hash)| (bucket as i32, (count, hash)))
            .collect())
    }

    async fn key_bounds(&self, scope: &Scope<'_>) -> Result<(Option<String>, Option<String>), ReadError> {
        let statement = match &self.statements {
            Statements::Source(statements) => statements.key_bounds(self.sql, scope),
            Statements::Target(statements) => statements.key_bounds(scope).map_err(ReadError::Unsupported)?,
        };
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(statement))
            .fetch_one(self.pool)
            .await?)
    }

    /// Refused at planning: buckets of text keys do not compare alike across engines.
    async fn key_quantiles(&self, _scope: &Scope<'_>, _parts: u32) -> Result<Option<Vec<String>>, ReadError> {
        Err(ReadError::Unsupported(
            "reconciliation with a MySQL/MariaDB side needs a single integer key".into(),
        ))
    }

    async fn key_versions(&self, scope: &Scope<'_>) -> Result<KeyVersions, ReadError> {
        let statement = match &self.statements {
            Statements::Source(statements) => statements
                .key_versions(self.sql, scope)
                .map_err(ReadError::Unsupported)?,
            Statements::Target(statements) => statements.key_versions(scope).map_err(ReadError::Unsupported)?,
        };
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(statement))
            .fetch_all(self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(key, version, content)| (vec![key], (version, content)))
            .collect())
    }
}
