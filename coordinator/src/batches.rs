//! The batch registry's state machine, the one place its states are written. A batch is
//! registered `Staged` (its objects are in the staging store, immutable); it becomes
//! `Committed` exactly once, in the transaction that advances its shard's checkpoint past it
//! (a replay, after a crash, is the same commit with `replayed`); it becomes `Abandoned` when
//! it can never commit any more: its owner gave it up, another batch committed from the same
//! position, its shard was split or merged, or its epoch was replaced or given up. Committed
//! and abandoned are final. Every transition runs on the caller's transaction, beside the
//! checkpoint change it belongs to.

use std::collections::HashSet;

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::checkpoints::{LOCK_COLUMNS_FROM, ShardKey};

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

/// What `register` found.
pub struct Registered {
    /// The shard's checkpoint row as `checkpoints::LOCK_COLUMNS_FROM` reads it (locked for
    /// the statement), for the caller's checks; `None`: no such shard.
    pub checkpoint: Option<PgRow>,
    /// The batch was inserted now.
    pub inserted: bool,
    /// A batch registered before under this id: (content hash, state).
    pub existing: Option<(String, String)>,
}

/// Registers staged batches of distinct shards in one statement, each if its shard's
/// checkpoint allows it: the shard is not retired, its epoch runs, the task is not paused,
/// `fence` is the current owner's and `lower` its committed cursor (the caller checks the
/// returned row the same way, to say which refused it). A batch id registered before is
/// left as it was and reported in `existing`. One answer per batch, in order.
pub async fn register(conn: &mut PgConnection, group: &[Registration<'_>]) -> Result<Vec<Registered>, sqlx::Error> {
    if group.is_empty() {
        return Ok(Vec::new());
    }
    let statement = format!(
        "WITH c (i, cursor, version, fence, last_batch_id, paused_reason, current_epoch, retired, \
           release_requested, running) AS ({lock}), \
         g AS (SELECT * FROM unnest($4::text[], $5::jsonb[], $6::jsonb[], $7::bigint[], $8::bigint[], \
           $9::text[], $10::text[], $11::bigint[]) WITH ORDINALITY \
           AS g(batch_id, lower, upper, row_count, byte_size, content_hash, manifest_path, fence, i)), \
         inserted AS (\
           INSERT INTO batches (batch_id, task, epoch, shard_id, lower, upper, row_count, byte_size, \
           content_hash, manifest_path, fence, state) \
           SELECT g.batch_id, $1[g.i::int], $2[g.i::int], $3[g.i::int], g.lower, g.upper, g.row_count, \
           g.byte_size, g.content_hash, g.manifest_path, g.fence, 'STAGED' FROM g JOIN c ON c.i = g.i \
           WHERE c.fence = g.fence AND NOT c.retired AND c.running AND c.paused_reason IS NULL \
           AND c.cursor = g.lower \
           ON CONFLICT (batch_id) DO NOTHING RETURNING batch_id) \
         SELECT c.*, EXISTS (SELECT 1 FROM inserted n WHERE n.batch_id = g.batch_id), b.content_hash, b.state \
         FROM g LEFT JOIN c ON c.i = g.i LEFT JOIN batches b ON b.batch_id = g.batch_id ORDER BY g.i",
        lock = LOCK_COLUMNS_FROM
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(group.iter().map(|b| b.shard.task.as_str()).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.shard.epoch as i64).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.shard.shard_id as i32).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.batch_id).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.lower.clone()).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.upper.clone()).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.row_count).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.byte_size).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.content_hash).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.manifest_path).collect::<Vec<_>>())
        .bind(group.iter().map(|b| b.fence as i64).collect::<Vec<_>>())
        .fetch_all(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let inserted: bool = row.get(10);
            let existing = row
                .get::<Option<String>, _>(11)
                .map(|hash| (hash, row.get::<String, _>(12)));
            let shard_found = row.get::<Option<i64>, _>(0).is_some();
            Registered {
                checkpoint: shard_found.then_some(row),
                inserted,
                existing,
            }
        })
        .collect())
}

/// One batch of a commit group: `index` names it in the answer.
pub struct Commit<'a> {
    pub index: i64,
    pub batch_id: &'a str,
    pub shard: &'a ShardKey,
    pub upper: serde_json::Value,
    pub replayed: bool,
}

/// Staged → committed for each batch that is staged for its shard with exactly these upper
/// bounds, and then every other staged batch of those shards → abandoned (they were read
/// from the same position and can never commit now). Returns the indices of the batches
/// committed; the others changed nothing (the caller refuses them). One statement for the
/// whole group: commits are the coordinator's most frequent transaction (issue 20). The
/// shards of a group are distinct.
pub async fn commit(conn: &mut PgConnection, group: &[Commit<'_>]) -> Result<HashSet<i64>, sqlx::Error> {
    if group.is_empty() {
        return Ok(HashSet::new());
    }
    // The states are literals, not parameters: a generic plan could not use the partial
    // index `batches_staged` for a parameter.
    let committed: Vec<i64> = sqlx::query_scalar(
        "WITH g AS (SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bigint[], $5::int[], $6::jsonb[], \
           $7::bool[]) AS g(i, batch_id, task, epoch, shard_id, upper, replayed)), \
         committed AS (\
           UPDATE batches b SET state = 'COMMITTED', committed_at = now(), replayed = g.replayed FROM g \
           WHERE b.batch_id = g.batch_id AND b.state = 'STAGED' AND b.upper = g.upper AND b.task = g.task \
           AND b.epoch = g.epoch AND b.shard_id = g.shard_id \
           RETURNING g.i, b.task, b.epoch, b.shard_id, b.batch_id), \
         abandoned AS (\
           UPDATE batches b SET state = 'ABANDONED' FROM committed k \
           WHERE b.state = 'STAGED' AND b.task = k.task AND b.epoch = k.epoch AND b.shard_id = k.shard_id \
           AND b.batch_id <> k.batch_id) \
         SELECT i FROM committed",
    )
    .bind(group.iter().map(|c| c.index).collect::<Vec<_>>())
    .bind(group.iter().map(|c| c.batch_id).collect::<Vec<_>>())
    .bind(group.iter().map(|c| c.shard.task.as_str()).collect::<Vec<_>>())
    .bind(group.iter().map(|c| c.shard.epoch as i64).collect::<Vec<_>>())
    .bind(group.iter().map(|c| c.shard.shard_id as i32).collect::<Vec<_>>())
    .bind(group.iter().map(|c| c.upper.clone()).collect::<Vec<_>>())
    .bind(group.iter().map(|c| c.replayed).collect::<Vec<_>>())
    .fetch_all(conn)
    .await?;
    Ok(committed.into_iter().collect())
}

/// Staged → abandoned for `which`; returns how many.
pub async fn abandon(conn: &mut PgConnection, which: Staged<'_>) -> Result<u64, sqlx::Error> {
    // Literal states, as in `commit`.
    let query = match which {
        Staged::Batch { batch_id, shard } => sqlx::query(
            "UPDATE batches SET state = 'ABANDONED' WHERE state = 'STAGED' AND batch_id = $1 AND task = $2 \
             AND epoch = $3 AND shard_id = $4",
        )
        .bind(batch_id)
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32),
        Staged::Shards { task, epoch, shard_ids } => sqlx::query(
            "UPDATE batches SET state = 'ABANDONED' WHERE state = 'STAGED' AND task = $1 AND epoch = $2 \
             AND shard_id = ANY($3)",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(shard_ids),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_back_as_written() {
        for state in [BatchState::Staged, BatchState::Committed, BatchState::Abandoned] {
            assert_eq!(BatchState::parse(state.as_str()), Some(state));
        }
        assert_eq!(BatchState::parse("staged"), None);
        // The statements above write these literals.
        assert_eq!(BatchState::Staged.as_str(), "STAGED");
        assert_eq!(BatchState::Committed.as_str(), "COMMITTED");
        assert_eq!(BatchState::Abandoned.as_str(), "ABANDONED");
    }
}
