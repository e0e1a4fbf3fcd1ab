//! The embedded control store: the control state in one SQLite file (`control_db =
//! "sqlite://.tidemark/control.db"`), for a coordinator that runs without a database server
//! (`tidemark sync`'s default). It keeps the same tables and the same rules as the PostgreSQL
//! control database: every checkpoint change runs in one transaction that compares the fence,
//! the CAS version and the lower bound before it moves anything, and the batch registry's
//! transitions are the ones `crate::batches` documents.
//!
//! Transactions start with `BEGIN IMMEDIATE`: a transaction holds the file's write lock from
//! its first statement, so that what it read cannot change before it writes (SQLite's
//! equivalent of `FOR UPDATE`). The pool has one connection: the coordinator is the store's
//! only user (`hold_sole_coordinator`), and its statements take microseconds. Each commit is
//! synced to disk (`synchronous = FULL`): a fence token or checkpoint once answered is never
//! lost to a power cut.

mod batches;
mod checkpoints;
mod epochs;
mod operations;
mod runs;

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use sqlx::Row;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use tidemark_common::cursor::Cursor;

use crate::checkpoints::{EpochRecord, ShardKey};
use crate::error::CoordinatorError;

pub use runs::PRUNE_CHUNK;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/control_sqlite");

/// Whether a `control_db` URL names the embedded store.
pub fn is_sqlite_url(url: &str) -> bool {
    url.starts_with("sqlite:")
}

#[derive(Clone)]
pub struct SqliteControl {
    pool: SqlitePool,
    /// The database file (`None`: in memory).
    path: Option<PathBuf>,
}

/// Holds the store's lock file while it lives (see `SqliteControl::hold_sole_coordinator`).
pub struct LockFile {
    _file: std::fs::File,
}

fn bad(message: String) -> CoordinatorError {
    CoordinatorError::InvalidRequest(message)
}

/// Now, as the store keeps times: microseconds since the Unix epoch.
pub(crate) fn now_micros() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// The canonical text of a JSON value as the store keeps it: equal values, equal text.
pub(crate) fn json_text(value: &serde_json::Value) -> String {
    value.to_string()
}

pub(crate) fn cursor_text(cursor: &Cursor) -> String {
    json_text(&serde_json::to_value(cursor).expect("cursor serializes"))
}

pub(crate) fn parse_json(text: &str, what: &str) -> Result<serde_json::Value, CoordinatorError> {
    serde_json::from_str(text).map_err(|e| bad(format!("stored {what}: {e}")))
}

pub(crate) fn decode_cursor(text: &str) -> Result<Cursor, CoordinatorError> {
    Cursor::decode(text).map_err(|e| bad(e.to_string()))
}

pub(crate) fn micros_time(micros: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_micros(micros).unwrap_or_else(chrono::Utc::now)
}

pub(crate) fn shard_of(row: &SqliteRow, from: usize) -> ShardKey {
    ShardKey {
        task: row.get(from),
        epoch: row.get::<i64, _>(from + 1) as u64,
        shard_id: row.get::<i64, _>(from + 2) as u32,
    }
}

/// The epoch columns `EPOCH_COLUMNS` names, from `from` on.
pub(crate) const EPOCH_COLUMNS: &str =
    "e.epoch, e.schema_id, e.columns, e.h0_max_key, e.incremental_start, e.cursor_zone, e.source_table_id";

pub(crate) fn epoch_from(row: &SqliteRow, from: usize) -> Result<EpochRecord, CoordinatorError> {
    Ok(EpochRecord {
        epoch: row.get::<i64, _>(from) as u64,
        schema_id: row.get(from + 1),
        columns: parse_json(&row.get::<String, _>(from + 2), "columns")?,
        h0_max_key: row
            .get::<Option<String>, _>(from + 3)
            .map(|text| parse_json(&text, "h0_max_key"))
            .transpose()?,
        incremental_start: decode_cursor(&row.get::<String, _>(from + 4))?,
        cursor_zone: row.get(from + 5),
        source_table_id: row.get(from + 6),
    })
}

impl SqliteControl {
    /// Opens (creating the file and its directory when missing) and migrates the store.
    pub async fn open(url: &str) -> Result<SqliteControl, CoordinatorError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| bad(format!("control_db {url}: not a SQLite URL ({e})")))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let file = options.get_filename();
        let path = (file != Path::new(":memory:") && !file.as_os_str().is_empty()).then(|| file.to_path_buf());
        if let Some(dir) = path
            .as_deref()
            .and_then(Path::parent)
            .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir)
                .map_err(|e| bad(format!("control_db {url}: cannot create {}: {e}", dir.display())))?;
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await?;
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| CoordinatorError::ControlDb(sqlx::Error::Migrate(Box::new(e))))?;
        Ok(SqliteControl { pool, path })
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// A write transaction: it holds the store's write lock from its start.
    pub(crate) async fn write(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, CoordinatorError> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    /// Makes this the only coordinator on this store while the returned lock lives: an
    /// exclusive lock on `<file>.lock`, which the operating system releases when the process
    /// ends, however it ends.
    pub fn hold_sole_coordinator(&self) -> Result<Option<LockFile>, CoordinatorError> {
        let Some(path) = &self.path else {
            return Ok(None);
        };
        let mut lock_path = path.clone().into_os_string();
        lock_path.push(".lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| bad(format!("cannot open {}: {e}", Path::new(&lock_path).display())))?;
        match file.try_lock() {
            Ok(()) => Ok(Some(LockFile { _file: file })),
            Err(std::fs::TryLockError::WouldBlock) => Err(bad(format!(
                "another coordinator with in-process leases (e.g. a `tidemark sync`) is running on the \
                 control state {}; stop it first, or give this one its own state",
                path.display()
            ))),
            Err(std::fs::TryLockError::Error(e)) => {
                Err(bad(format!("cannot lock {}: {e}", Path::new(&lock_path).display())))
            }
        }
    }

    pub async fn max_fence(&self) -> Result<u64, CoordinatorError> {
        let fence: i64 = sqlx::query_scalar("SELECT coalesce(max(fence), 0) FROM checkpoints")
            .fetch_one(&self.pool)
            .await?;
        Ok(fence as u64)
    }
}
