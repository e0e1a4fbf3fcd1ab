//! Batches and their manifests.
//!
//! A batch is an immutable page of rows. Its id is derived from task, epoch, shard and both
//! bounds, so re-reading the same bounds names the same batch; its manifest records the
//! content hash that every reader verifies before applying.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::cursor::Cursor;

/// Deterministic batch id: the first 128 bits of SHA-256 over the batch's identity, which
/// includes the checkpoint version it was read at. A retry of the same read names the same
/// batch; a read after its predecessor was abandoned (which bumps the version) never reuses
/// the abandoned id, so an id can never stand for two contents.
pub fn batch_id(
    task: &str,
    epoch: u64,
    shard_id: u32,
    checkpoint_version: u64,
    lower: &Cursor,
    upper: &Cursor,
) -> String {
    let mut hasher = Sha256::new();
    let (epoch, shard_id, version) = (epoch.to_string(), shard_id.to_string(), checkpoint_version.to_string());
    for part in [task, &epoch, &shard_id, &version, &lower.encode(), &upper.encode()] {
        hasher.update(part.as_bytes());
        hasher.update([0u8]);
    }
    hex::encode(&hasher.finalize()[..16])
}

/// `sha256:<hex>` of the data object's bytes.
pub fn content_hash(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

pub const MANIFEST_FORMAT_VERSION: u32 = 1;

/// Written after the data object; a batch without a manifest does not exist.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub batch_id: String,
    pub task: String,
    pub epoch: u64,
    pub shard_id: u32,
    /// Encoded cursors.
    pub lower: String,
    pub upper: String,
    pub row_count: u64,
    pub byte_size: u64,
    pub content_hash: String,
    pub schema_id: String,
    pub fence_token: u64,
    /// Path of the data object inside the staging store.
    pub data_path: String,
    /// `pg_copy_text+lz4` or `pg_copy_binary+lz4`: PostgreSQL's COPY stream in that format,
    /// LZ4-compressed in the object (`pg_copy_text`: uncompressed, as staged by earlier
    /// versions). `byte_size` and `content_hash` are of the uncompressed stream. See
    /// `copy_format::CopyFormat`.
    pub data_format: String,
    /// A reconciliation's repair batch: its bounds are equal (the cursor does not move) and
    /// each row carries the target version the comparison saw (see `pg::EXPECTED_COLUMN`).
    #[serde(default)]
    pub repair: bool,
    /// The rows carry only the target's columns (key-ordered pages without a delete policy):
    /// when none of their keys is in the target yet they are copied straight into it.
    #[serde(default)]
    pub target_layout: bool,
}

/// The suffix of `data_format` for an object stored as an LZ4 block (uncompressed size
/// prepended).
pub const LZ4_SUFFIX: &str = "+lz4";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_id_depends_on_every_part() {
        let lower = Cursor::snapshot_start(1);
        let upper = Cursor::snapshot_start(2);
        let base = batch_id("items", 1, 0, 7, &lower, &upper);
        assert_eq!(base, batch_id("items", 1, 0, 7, &lower, &upper));
        assert_ne!(base, batch_id("items", 1, 1, 7, &lower, &upper));
        assert_ne!(base, batch_id("items", 2, 0, 7, &lower, &upper));
        assert_ne!(base, batch_id("items", 1, 0, 8, &lower, &upper));
        assert_ne!(base, batch_id("items", 1, 0, 7, &upper, &lower));
        assert_eq!(base.len(), 32);
    }
}
