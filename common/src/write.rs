//! Writing rows into a task's target: the error a write ends in, whatever the engine. Each
//! engine's writes (what a worker's batch and a dead-letter retry run alike, inside the
//! caller's transaction) are its own: `pg::write`, `mysql::target`.

use crate::transform::RowError;

/// Why a write failed: the database refused it, or (before it reached the database) a row
/// could not be rendered for the target.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{0}")]
    Database(#[from] sqlx::Error),
    #[error("{}: {}", .0.class, .0.message)]
    Row(RowError),
}

impl WriteError {
    /// The row error this is (a value the target refuses, a row that cannot be rendered), or
    /// `None` when it is not about a row.
    pub fn row_error(&self) -> Option<RowError> {
        match self {
            WriteError::Database(error) => crate::dead_letters::as_row_error(error),
            WriteError::Row(error) => Some(error.clone()),
        }
    }
}
