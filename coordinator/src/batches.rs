//! The batch registry's state machine, the one place its states are written. A batch is
//! registered `Staged` (its objects are in the staging store, immutable); it becomes
//! `Committed` exactly once, in the transaction that advances its shard's checkpoint past it
//! (a replay, after a crash, is the same commit with `replayed`); it becomes `Abandoned` when
//! it can never commit any more: its owner gave it up, another batch committed from the same
//! position, its shard was split or merged, or its epoch was replaced or given up. Committed
//! and abandoned are final. Every transition runs on the caller's transaction, beside the
//! checkpoint change it belongs to.

use sqlx::PgConnection;

use crate::checkpoints::ShardKey;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchState {
    Staged,
    Committed,
    Abandoned,
}

impl BatchState {
    /// As the registry stores it.
    pub fn as_str(self) -> &'static str {
        match self {
            BatchState::Staged => "STAGED",
            BatchState::Committed => "COMMITTED",
            BatchState::Abandoned => "ABANDONED",
        }
    }

    pub fn parse(text: &str) -> Option<BatchState> {
        [BatchState::Staged, BatchState::Committed, BatchState::Abandoned]
            .into_iter()
            .find(|state| state.as_str() == text)
    }
}

/// Which staged batches can no longer commit.
pub enum Staged<'a> {
    /// One batch its owner gave up.
    Batch { batch_id: &'a str, shard: &'a ShardKey },
    /// Every staged batch of these shards (another batch committed from their position, or
    /// they were split or merged).
    Shards {
        task: &'a str,
        epoch: u64,
        shard_ids: &'a [i32],
    },
    /// Every staged batch of an epoch (given up, rolled back, or read again from its start).
    Epoch { task: &'a str, epoch: u64 },
    /// Every staged batch of the epochs before `epoch` (it replaced them).
    EpochsBefore { task: &'a str, epoch: u64 },
}

/// Registers a staged batch.
pub struct Registration<'a> {
    pub batch_id: &'a str,
    pub shard: &'a ShardKey,
    pub lower: serde_json::Value,
    pub upper: serde_json::Value,
    pub row_count: i64,
    pub byte_size: i64,
    pub content_hash: &'a str,
    pub manifest_path: &'a str,
    pub fence: u64,
}

/// False when a batch with this id is registered already: the caller compares its content.
pub async fn register(conn: &mut PgConnection, batch: Registration<'_>) -> Result<bool, sqlx::Error> {
    let inserted = sqlx::query(
        "INSERT INTO batches (batch_id, task, epoch, shard_id, lower, upper, row_count, byte_size, \
         content_hash, manifest_path, fence, state) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12) \
         ON CONFLICT (batch_id) DO NOTHING",
    )
    .bind(batch.batch_id)
    .bind(&batch.shard.task)
    .bind(batch.shard.epoch as i64)
    .bind(batch.shard.shard_id as i32)
    .bind(batch.lower)
    .bind(batch.upper)
    .bind(batch.row_count)
    .bind(batch.byte_size)
    .bind(batch.content_hash)
    .bind(batch.manifest_path)
    .bind(batch.fence as i64)
    .bind(BatchState::Staged.as_str())
    .execute(conn)
    .await?
    .rows_affected();
    Ok(inserted == 1)
}

/// Staged → committed, if the batch is staged for `shard` with exactly these upper bounds,
/// and then every other staged batch of `shard` → abandoned (they were read from the same
/// position and can never commit now); false, changing nothing, otherwise (the caller
/// refuses the commit). One statement: a commit is the coordinator's most frequent
/// transaction, and each round trip counts at thousands of shards (issue 20).
pub async fn commit(
    conn: &mut PgConnection,
    batch_id: &str,
    shard: &ShardKey,
    upper: serde_json::Value,
    replayed: bool,
) -> Result<bool, sqlx::Error> {
    let committed: i64 = sqlx::query_scalar(
        "WITH committed AS (\
           UPDATE batches SET state = $4, committed_at = now(), replayed = $2 \
           WHERE batch_id = $1 AND state = $5 AND upper = $3 AND task = $7 AND epoch = $8 AND shard_id = $9 \
           RETURNING 1), \
         abandoned AS (\
           UPDATE batches SET state = $6 \
           WHERE state = $5 AND task = $7 AND epoch = $8 AND shard_id = $9 AND batch_id <> $1 \
           AND EXISTS (SELECT 1 FROM committed)) \
         SELECT count(*) FROM committed",
    )
    .bind(batch_id)
    .bind(replayed)
    .bind(upper)
    .bind(BatchState::Committed.as_str())
    .bind(BatchState::Staged.as_str())
    .bind(BatchState::Abandoned.as_str())
    .bind(&shard.task)
    .bind(shard.epoch as i64)
    .bind(shard.shard_id as i32)
    .fetch_one(conn)
    .await?;
    Ok(committed == 1)
}

/// Staged → abandoned for `which`; returns how many.
pub async fn abandon(conn: &mut PgConnection, which: Staged<'_>) -> Result<u64, sqlx::Error> {
    let abandoned = BatchState::Abandoned.as_str();
    let staged = BatchState::Staged.as_str();
    let query = match which {
        Staged::Batch { batch_id, shard } => sqlx::query(
            "UPDATE batches SET state = $1 WHERE state = $2 AND batch_id = $3 AND task = $4 AND epoch = $5 \
             AND shard_id = $6",
        )
        .bind(abandoned)
        .bind(staged)
        .bind(batch_id)
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32),
        Staged::Shards { task, epoch, shard_ids } => sqlx::query(
            "UPDATE batches SET state = $1 WHERE state = $2 AND task = $3 AND epoch = $4 AND shard_id = ANY($5)",
        )
        .bind(abandoned)
        .bind(staged)
        .bind(task)
        .bind(epoch as i64)
        .bind(shard_ids),
        Staged::Epoch { task, epoch } => {
            sqlx::query("UPDATE batches SET state = $1 WHERE state = $2 AND task = $3 AND epoch = $4")
                .bind(abandoned)
                .bind(staged)
                .bind(task)
                .bind(epoch as i64)
        }
        Staged::EpochsBefore { task, epoch } => {
            sqlx::query("UPDATE batches SET state = $1 WHERE state = $2 AND task = $3 AND epoch < $4")
                .bind(abandoned)
                .bind(staged)
                .bind(task)
                .bind(epoch as i64)
        }
    };
    Ok(query.execute(conn).await?.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_back_as_written() {
        for state in [BatchState::Staged, BatchState::Committed, BatchState::Abandoned] {
            assert_eq!(BatchState::parse(state.as_str()), Some(state));
        }
        assert_eq!(BatchState::parse("staged"), None);
    }
}
