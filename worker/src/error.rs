//! The worker's errors. `Fenced` means another worker owns the shard now: drop it without
//! touching anything. Everything else ends the shard's loop; the shard is released and work
//! resumes from its committed checkpoint (and pending staged batch).

use tidemark_common::staging::StagingError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("shard lost: {0}")]
    Fenced(String),
    #[error("coordinator: {0}")]
    Coordinator(String),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("staging: {0}")]
    Staging(#[from] StagingError),
    #[error("bad data: {0}")]
    Data(String),
    #[error("verification failed: {0}")]
    Verify(String),
    #[error("invalid assignment: {0}")]
    Assignment(String),
    /// A binary batch met column types other than the ones it was read in (a source or target
    /// column's type changed): it is abandoned and read again as text.
    #[error("binary batch no longer matches the column types: {0}")]
    BinaryTypes(String),
    /// The source table's columns changed since the epoch was planned: the page is refused,
    /// and the coordinator pauses the task (`schema changed … reinitialization required`).
    #[error("schema changed: {0}")]
    SchemaChanged(String),
    /// The target rejected more of a batch's rows than `max_dead_letter_ratio` allows: a target
    /// problem, not bad rows. Nothing of the batch is written; the shard is released with a
    /// request to pause the task (`target rejects rows`).
    #[error("target rejects rows: {0}")]
    TargetRejects(String),
    /// The target is renaming the task's tables for an epoch switch (MySQL/MariaDB, where a
    /// rename cannot share a transaction with the fence): the batch is tried again after it.
    #[error("epoch switch in progress: {0}")]
    Switching(String),
    /// A row the target cannot take, found before it reached the database (a field that
    /// cannot be rendered for the target's engine): the batch isolates it as a dead letter.
    #[error("row refused: {}: {}", .0.class, .0.message)]
    Row(tidemark_common::transform::RowError),
}

impl WorkerError {
    /// Whether retrying the shard cannot fix this error: it is the data or the databases'
    /// state, not a connection, a lost lease or a lock held by a zombie. The coordinator
    /// counts such errors and pauses the task when one repeats (`max_batch_failures`).
    pub fn is_persistent(&self) -> bool {
        match self {
            WorkerError::Database(error) => !tidemark_common::engines::retry_fixes(error),
            WorkerError::Data(_)
            | WorkerError::Verify(_)
            | WorkerError::Assignment(_)
            | WorkerError::SchemaChanged(_)
            | WorkerError::Row(_) => true,
            WorkerError::Staging(error) => error.is_permanent(),
            WorkerError::Fenced(_)
            | WorkerError::Coordinator(_)
            | WorkerError::BinaryTypes(_)
            | WorkerError::Switching(_)
            | WorkerError::TargetRejects(_) => false,
        }
    }
}

impl From<tonic::Status> for WorkerError {
    fn from(status: tonic::Status) -> WorkerError {
        match status.code() {
            tonic::Code::FailedPrecondition | tonic::Code::Aborted | tonic::Code::Unauthenticated => {
                WorkerError::Fenced(status.message().to_string())
            }
            _ => WorkerError::Coordinator(format!("{:?}: {}", status.code(), status.message())),
        }
    }
}

impl From<tidemark_common::reconcile_reads::ReadError> for WorkerError {
    fn from(error: tidemark_common::reconcile_reads::ReadError) -> WorkerError {
        match error {
            tidemark_common::reconcile_reads::ReadError::Database(e) => WorkerError::Database(e),
            tidemark_common::reconcile_reads::ReadError::Unsupported(message) => WorkerError::Assignment(message),
        }
    }
}
