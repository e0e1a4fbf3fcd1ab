//! The source boundary: what the worker and the coordinator ask of a source table, whatever
//! engine serves it. The engine is named by the URL's scheme (see [`crate::engines`]); each
//! engine implements [`Source`] and [`PageStatements`] in its own folder (`pg/connector.rs`,
//! `mysql/connector.rs`). A source answers the clock, what the open-transaction bound sees,
//! the largest key, and pages of rows as COPY text or (PostgreSQL to PostgreSQL) COPY binary
//! in the staged layout.

use std::any::Any;
use std::fmt::Debug;
use std::ops::Deref;
use std::sync::Arc;

use crate::copy_format::CopyFormat;
use crate::cursor::{KeyValue, ShardRange};
use crate::engines::Engine;
use crate::pg::deletes::LogUpper;
use crate::pg::visibility::{PreparedTransaction, Visibility};
use crate::pg::{ColumnTypes, TableName, TableSql};
use crate::reconcile_reads::{ReadError, SideReads};

/// One engine's source.
#[async_trait::async_trait]
pub trait Source: Send + Sync + Debug {
    fn engine(&self) -> &'static Engine;

    /// For the engine's own code (its coordinator and worker folders) to reach its pool.
    fn as_any(&self) -> &dyn Any;

    /// The source's clock, microseconds since the Unix epoch.
    async fn now_micros(&self) -> Result<i64, sqlx::Error>;

    /// What the open-transaction bound sees of `table`'s writers, and the oldest prepared
    /// transaction where the engine has ones without a known start.
    async fn visibility(&self, table: &TableName) -> Result<(Visibility, Option<PreparedTransaction>), sqlx::Error>;

    /// One sample of the largest integer key and the clock after it (see `id_tail`).
    async fn key_sample(&self, reads: &SourceReads, sql: &TableSql) -> Result<(Option<i64>, i64), sqlx::Error>;

    /// The statements a run reads the epoch's columns (`sql.columns`) with. Where the engine
    /// reads its columns again, they must still map to the epoch's types: `Ok(Err(reason))`
    /// when the schema changed.
    async fn reads_for(&self, sql: &TableSql) -> Result<Result<SourceReads, String>, sqlx::Error>;

    /// Statements on `table` that need none of its columns (the key sample).
    fn bare_reads(&self, table: &TableName) -> SourceReads;

    /// Whether a driver error is worth retrying on this engine.
    fn is_transient(&self, error: &sqlx::Error) -> bool;

    /// The cursor's infinite values, where the engine has them (PostgreSQL), and its newest
    /// finite time (microseconds); `None` when the cursor column is gone (the schema check
    /// pauses the task).
    async fn cursor_extremes(&self, sql: &TableSql) -> Result<Option<(Option<Vec<String>>, Option<i64>)>, sqlx::Error>;

    /// The median of the first key inside `range` (a split point) as text; `None` when the
    /// range holds no rows.
    async fn median_key(
        &self,
        reads: &SourceReads,
        sql: &TableSql,
        range: &ShardRange,
    ) -> Result<Option<String>, sqlx::Error>;

    /// Whether `a < b` in the first key column's own order (on MySQL, its collation).
    async fn key_less(
        &self,
        reads: &SourceReads,
        sql: &TableSql,
        a: &KeyValue,
        b: &KeyValue,
    ) -> Result<bool, sqlx::Error>;

    /// Removes the delete-log entries of `table` older than `cutoff_micros`; how many.
    async fn purge_delete_log(&self, table: &TableName, cutoff_micros: i64) -> Result<u64, sqlx::Error>;

    /// The latest TRUNCATE of `table` a delete-logged source recorded (microseconds), where
    /// the engine records them (PostgreSQL's statement trigger); `None` elsewhere.
    async fn last_truncate_micros(&self, table: &TableName) -> Result<Option<i64>, sqlx::Error>;

    /// An identity of the table's storage that a TRUNCATE changes, where the engine has no
    /// TRUNCATE trigger (MySQL's InnoDB table id); `None` where TRUNCATEs are recorded instead.
    async fn table_identity(&self, table: &TableName) -> Result<Option<String>, sqlx::Error>;

    /// Runs a page statement and returns its rows as COPY bytes in `page.format` (text, or
    /// binary where the statement or the engine's encoding makes it; an engine that renders
    /// text may answer a page in text where a value has no exact binary form, and says so in
    /// [`CopyPage::format`]) and, where pages can be binary, the table's column types read on
    /// the same session right after the page (a type change is seen by the page it could
    /// affect).
    async fn read_copy(
        &self,
        statement: &str,
        table: &TableName,
        page: PageRequest<'_>,
    ) -> Result<CopyPage, sqlx::Error>;

    /// The table's column types (as PostgreSQL types, with whether each is built in) where the
    /// engine's pages can be binary: PostgreSQL's own, or a text-rendering engine's mapped
    /// types, marked built in where they can be encoded ([`crate::text_to_binary`]).
    async fn binary_column_types(&self, table: &TableName) -> Result<Option<ColumnTypes>, sqlx::Error>;

    /// What reconciliation reads of this side.
    fn reconcile_reads<'a>(
        &'a self,
        reads: &'a SourceReads,
        sql: &'a TableSql,
    ) -> Result<Box<dyn SideReads + 'a>, ReadError>;

    async fn close(&self);
}

/// How a page is asked for: its COPY format and the types of its staged fields, in order (see
/// [`TableSql::payload_columns`]).
#[derive(Debug, Clone, Copy)]
pub struct PageRequest<'a> {
    pub format: CopyFormat,
    pub field_types: &'a [String],
}

/// A page as the source returned it.
#[derive(Debug)]
pub struct CopyPage {
    pub data: bytes::Bytes,
    pub format: CopyFormat,
    /// The table's column types, read on the page's session right after it, where the engine
    /// reads them per page.
    pub types: Option<ColumnTypes>,
}

/// A connection pool to a source, of whichever engine.
#[derive(Debug, Clone)]
pub struct SourcePool(Arc<dyn Source>);

impl SourcePool {
    pub fn new(source: impl Source + 'static) -> SourcePool {
        SourcePool(Arc::new(source))
    }

    /// A lazily connecting pool to the source at `url`, of the engine its scheme names (see
    /// [`crate::pg::guarded_pool`] for `guard`; a MySQL source session reads only).
    pub fn connect_lazy(
        url: &str,
        application_name: &str,
        max_connections: u32,
        guard: std::time::Duration,
    ) -> Result<SourcePool, String> {
        (crate::engines::of_url(url)?.source)(url, application_name, max_connections, guard)
    }

    /// The engine's own source type, for that engine's code.
    pub fn downcast<T: 'static>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref()
    }
}

impl Deref for SourcePool {
    type Target = dyn Source;

    fn deref(&self) -> &(dyn Source + 'static) {
        &*self.0
    }
}

/// The statements a task reads its source table with, in one engine's dialect.
pub trait PageStatements: Send + Sync + Debug {
    fn as_any(&self) -> &dyn Any;

    fn snapshot_page(
        &self,
        sql: &TableSql,
        range: &ShardRange,
        after_key: Option<&[KeyValue]>,
        max_key: Option<&KeyValue>,
        limit: u32,
    ) -> String;

    #[allow(clippy::too_many_arguments)]
    fn incremental_page(
        &self,
        sql: &TableSql,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        high_micros: i64,
        upto: Option<(i64, &[KeyValue])>,
        limit: u32,
    ) -> String;

    /// A page of the trigger-fed delete log `log` (see `pg::deletes`, `mysql::deletes`).
    #[allow(clippy::too_many_arguments)]
    fn delete_log_page(
        &self,
        sql: &TableSql,
        log: &TableName,
        range: &ShardRange,
        t_micros: i64,
        after_key: Option<&[KeyValue]>,
        upper: LogUpper<'_>,
        limit: u32,
    ) -> String;

    /// The source rows of `keys` in the staged layout (reconciliation's repairs).
    fn rows_by_key(&self, sql: &TableSql, keys: &[Vec<KeyValue>]) -> String;

    fn key_sample(&self, sql: &TableSql) -> String;
}

/// A run's source statements, of whichever engine.
#[derive(Debug, Clone)]
pub struct SourceReads(Arc<dyn PageStatements>);

impl SourceReads {
    pub fn new(statements: impl PageStatements + 'static) -> SourceReads {
        SourceReads(Arc::new(statements))
    }

    /// The engine's own statements type, for that engine's code.
    pub fn downcast<T: 'static>(&self) -> Option<&T> {
        self.0.as_any().downcast_ref()
    }
}

impl Deref for SourceReads {
    type Target = dyn PageStatements;

    fn deref(&self) -> &(dyn PageStatements + 'static) {
        &*self.0
    }
}

/// The error of statements handed to another engine's source (a bug, never the user's).
pub fn foreign_reads(engine: &Engine) -> sqlx::Error {
    sqlx::Error::Protocol(format!(
        "a {} source read with another engine's statements",
        engine.name
    ))
}
