//! The batch registry's transitions on the embedded store (see `crate::batches` for the
//! states and when each transition happens). Each runs on the caller's transaction, beside
//! the checkpoint change it belongs to. The states are literals, as in `crate::batches`: the
//! partial index `batches_staged` serves only a literal `'STAGED'`.

use sqlx::SqliteConnection;

use crate::batches::Staged;
use crate::checkpoints::ShardKey;

use super::now_micros;

/// Registers a staged batch unless its id is registered already; true when inserted now.
#[allow(clippy::too_many_arguments)]
pub(super) async fn register(
    conn: &mut SqliteConnection,
    shard: &ShardKey,
    batch_id: &str,
    lower: &str,
    upper: &str,
    row_count: i64,
    byte_size: i64,
    content_hash: &str,
    manifest_path: &str,
    fence: u64,
) -> Result<bool, sqlx::Error> {
    let inserted = sqlx::query(
        "INSERT INTO batches (batch_id, task, epoch, shard_id, lower, upper, row_count, byte_size, content_hash, \
         manifest_path, fence, state, staged_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'STAGED', $12) \
         ON CONFLICT (batch_id) DO NOTHING",
    )
    .bind(batch_id)
    .bind(&shard.task)
    .bind(shard.epoch as i64)
    .bind(shard.shard_id as i64)
    .bind(lower)
    .bind(upper)
    .bind(row_count)
    .bind(byte_size)
    .bind(content_hash)
    .bind(manifest_path)
    .bind(fence as i64)
    .bind(now_micros())
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(inserted == 1)
}

/// A batch registered under `batch_id`: (content hash, state).
pub(super) async fn existing(
    conn: &mut SqliteConnection,
    batch_id: &str,
) -> Result<Option<(String, String)>, sqlx::Error> {
    sqlx::query_as("SELECT content_hash, state FROM batches WHERE batch_id = $1")
        .bind(batch_id)
        .fetch_optional(&mut *conn)
        .await
}

/// Staged → committed when the batch is staged for its shard with exactly this upper bound,
/// and then every other staged batch of the shard → abandoned. False: nothing changed.
pub(super) async fn commit(
    conn: &mut SqliteConnection,
    shard: &ShardKey,
    batch_id: &str,
    upper: &str,
    replayed: bool,
) -> Result<bool, sqlx::Error> {
    let committed = sqlx::query(
        "UPDATE batches SET state = 'COMMITTED', committed_at = $6, replayed = $7 WHERE batch_id = $1 \
         AND state = 'STAGED' AND upper = $5 AND task = $2 AND epoch = $3 AND shard_id = $4",
    )
    .bind(batch_id)
    .bind(&shard.task)
    .bind(shard.epoch as i64)
    .bind(shard.shard_id as i64)
    .bind(upper)
    .bind(now_micros())
    .bind(replayed)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if committed != 1 {
        return Ok(false);
    }
    sqlx::query(
        "UPDATE batches SET state = 'ABANDONED' WHERE state = 'STAGED' AND task = $1 AND epoch = $2 \
         AND shard_id = $3 AND batch_id <> $4",
    )
    .bind(&shard.task)
    .bind(shard.epoch as i64)
    .bind(shard.shard_id as i64)
    .bind(batch_id)
    .execute(&mut *conn)
    .await?;
    Ok(true)
}

/// Staged → abandoned for `which`; returns how many.
pub(super) async fn abandon(conn: &mut SqliteConnection, which: Staged<'_>) -> Result<u64, sqlx::Error> {
    let query = match which {
        Staged::Batch { batch_id, shard } => sqlx::query(
            "UPDATE batches SET state = 'ABANDONED' WHERE state = 'STAGED' AND batch_id = $1 AND task = $2 \
             AND epoch = $3 AND shard_id = $4",
        )
        .bind(batch_id)
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64),
        Staged::Shards { task, epoch, shard_ids } => sqlx::query(
            "UPDATE batches SET state = 'ABANDONED' WHERE state = 'STAGED' AND task = $1 AND epoch = $2 \
             AND shard_id IN (SELECT value FROM json_each($3))",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(serde_json::json!(shard_ids).to_string()),
        Staged::Epoch { task, epoch } => {
            sqlx::query("UPDATE batches SET state = 'ABANDONED' WHERE state = 'STAGED' AND task = $1 AND epoch = $2")
                .bind(task)
                .bind(epoch as i64)
        }
        Staged::EpochsBefore { task, epoch } => {
            sqlx::query("UPDATE batches SET state = 'ABANDONED' WHERE state = 'STAGED' AND task = $1 AND epoch < $2")
                .bind(task)
                .bind(epoch as i64)
        }
    };
    Ok(query.execute(conn).await?.rows_affected())
}
