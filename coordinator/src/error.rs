//! The coordinator's errors and their one mapping to gRPC status codes.

use tidemark_common::redact::redact_url;

#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// The caller's fence token is not the shard's current one: another worker owns it now.
    #[error("fenced: shard {shard} of task {task} is owned under fence {current}, not {given}")]
    Fenced {
        task: String,
        shard: u32,
        current: u64,
        given: u64,
    },
    /// The checkpoint moved since the caller read it (version or lower bound differ).
    #[error("checkpoint conflict on shard {shard} of task {task}: {message}")]
    CheckpointConflict { task: String, shard: u32, message: String },
    #[error("batch {batch_id}: {message}")]
    Batch { batch_id: String, message: String },
    #[error("worker lease {lease_id} has expired; register again")]
    LeaseExpired { lease_id: i64 },
    /// The shard belongs to an epoch that `tasks reinit` replaced.
    #[error("epoch {epoch} of task {task} was replaced by epoch {current}")]
    EpochSuperseded { task: String, epoch: u64, current: u64 },
    /// The shard was split or merged into new shards.
    #[error("shard {shard} of task {task} was split or merged; it no longer exists")]
    ShardRetired { task: String, shard: u32 },
    #[error("task {task} is paused: {reason}")]
    Paused { task: String, reason: String },
    #[error("unknown task {0}")]
    UnknownTask(String),
    /// This replica is not the leader; the caller should try another address.
    #[error("not the leader{}", leader.as_deref().map(|l| format!("; the leader is {l}")).unwrap_or_default())]
    NotLeader { leader: Option<String> },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("task {task}: {message}")]
    TaskSetup { task: String, message: String },
    // Not `#[from]`: that would also make the error its source and print it twice.
    #[error("control database: {0}")]
    ControlDb(sqlx::Error),
    /// A query on a task's source database (the watcher's checks).
    #[error("source database: {0}")]
    Source(sqlx::Error),
    #[error("etcd: {0}")]
    Etcd(etcd_client::Error),
}

impl From<sqlx::Error> for CoordinatorError {
    fn from(error: sqlx::Error) -> CoordinatorError {
        CoordinatorError::ControlDb(error)
    }
}

impl From<etcd_client::Error> for CoordinatorError {
    fn from(error: etcd_client::Error) -> CoordinatorError {
        CoordinatorError::Etcd(error)
    }
}

impl CoordinatorError {
    pub fn task_setup(task: &str, message: impl Into<String>) -> CoordinatorError {
        CoordinatorError::TaskSetup {
            task: task.to_string(),
            message: message.into(),
        }
    }
}

impl From<CoordinatorError> for tonic::Status {
    fn from(error: CoordinatorError) -> tonic::Status {
        let message = error.to_string();
        match error {
            // FAILED_PRECONDITION tells the worker to drop the shard; the checkpoint did not move.
            CoordinatorError::Fenced { .. }
            | CoordinatorError::Paused { .. }
            | CoordinatorError::EpochSuperseded { .. }
            | CoordinatorError::ShardRetired { .. } => tonic::Status::failed_precondition(message),
            CoordinatorError::CheckpointConflict { .. } | CoordinatorError::Batch { .. } => {
                tonic::Status::aborted(message)
            }
            CoordinatorError::LeaseExpired { .. } => tonic::Status::unauthenticated(message),
            CoordinatorError::UnknownTask(_) | CoordinatorError::InvalidRequest(_) => {
                tonic::Status::invalid_argument(message)
            }
            CoordinatorError::TaskSetup { .. } => tonic::Status::failed_precondition(message),
            CoordinatorError::ControlDb(_)
            | CoordinatorError::Source(_)
            | CoordinatorError::Etcd(_)
            | CoordinatorError::NotLeader { .. } => tonic::Status::unavailable(message),
        }
    }
}

/// A printable form of a database URL for messages.
pub fn display_url(url: &str) -> String {
    redact_url(url)
}
