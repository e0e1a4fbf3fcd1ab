//! What reconciliation reads of each side of a task, whatever engine serves it: per bucket a
//! count and a hash sum, the first key's bounds, key quantiles, and a small range's `(key,
//! version, content)` rows. Each engine implements [`SideReads`] with its own statements
//! (`pg::reconcile`, `mysql::reconcile`) and returns plain values, so the worker's
//! reconciliation names no driver.

use std::collections::HashMap;

use crate::cursor::KeyValue;
use crate::pg::reconcile::Scope;

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

/// One side's reads.
#[async_trait::async_trait]
pub trait SideReads: Send + Sync {
    /// Whether this side hashes every column's content as the other engine would (only
    /// PostgreSQL on both sides does); otherwise runs compare versions with the portable hash.
    fn hashes_content(&self) -> bool;

    /// Count and hash sum per bucket of the first key split at `thresholds`.
    async fn bucket_sums(&self, scope: &Scope<'_>, thresholds: &[KeyValue]) -> Result<BucketSums, ReadError>;

    /// The first key's smallest and largest value in the scope, as text.
    async fn key_bounds(&self, scope: &Scope<'_>) -> Result<(Option<String>, Option<String>), ReadError>;

    /// Quantiles of the first key that split the scope into `parts` (non-integer keys).
    async fn key_quantiles(&self, scope: &Scope<'_>, parts: u32) -> Result<Option<Vec<String>>, ReadError>;

    /// The rows of a small range.
    async fn key_versions(&self, scope: &Scope<'_>) -> Result<KeyVersions, ReadError>;
}
