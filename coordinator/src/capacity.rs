//! Shards no worker holds. When the running epochs have more shards than the live workers
//! take (`--max-shards` each), the rest wait unowned and their data goes stale. This module
//! notes how long each has waited, counts them in `tidemark_shards_unassigned`, lets `status`
//! warn, and gives waiting shards a turn: the leader asks the owner of a caught-up shard held
//! longest to release it, and the freed worker takes the shard touched least recently (the
//! waiting one). Turns are arranged only while the pool takes no shard: as long as workers
//! still claim shards (a large pool starting, a vanished worker's shards being taken over),
//! a shard waits for room that is coming, not for a turn. Without that gate, a pool of 1,000
//! workers ramping up to 50,000 shards for 37 s had 1,037 caught-up shards asked back for
//! turns no shard needed (issue 20).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::Row;

use crate::checkpoints::{ControlDb, ShardKey};
use crate::error::CoordinatorError;

/// A shard of a running epoch (the live one, and one building beside it) of a task that is
/// not paused.
#[derive(Debug, Clone)]
pub struct RunningShard {
    pub key: ShardKey,
    /// Past its snapshot: it only follows changes, so a turn away costs lag, not progress.
    pub incremental: bool,
    /// Since its current or last owner acquired it.
    pub held: Duration,
    /// A release (an operation, a drain, a turn) is already asked of its owner.
    pub releasing: bool,
}

impl ControlDb {
    pub async fn running_shards(&self) -> Result<Vec<RunningShard>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.running_shards().await;
        }
        // The cursor's kind, not the cursor: every running shard is read each round, and
        // shipping and decoding 50,000 cursors cost more than the rest of the read (issue 20).
        // `Cursor::is_incremental`: any kind but a snapshot.
        let rows = sqlx::query(
            "SELECT c.task, c.epoch, c.shard_id, c.cursor->>'kind' <> 'snapshot', \
             extract(epoch from now() - coalesce(c.acquired_at, c.updated_at))::float8, \
             c.release_requested OR c.pending_op IS NOT NULL \
             FROM checkpoints c JOIN running_epochs r ON r.task = c.task AND r.epoch = c.epoch \
             JOIN tasks t ON t.name = c.task WHERE NOT c.retired AND t.paused_reason IS NULL",
        )
        .fetch_all(self.pool())
        .await?;
        Ok(crate::off_runtime::run(move || {
            rows.into_iter()
                .map(|row| RunningShard {
                    key: ShardKey::from_pg_row(&row),
                    incremental: row.get(3),
                    held: Duration::from_secs_f64(row.get::<f64, _>(4).max(0.0)),
                    releasing: row.get(5),
                })
                .collect()
        })
        .await)
    }
}

/// Since when each running shard has had no owner (every replica keeps its own view).
#[derive(Clone, Default)]
pub struct Capacity {
    unowned_since: Arc<Mutex<HashMap<ShardKey, Instant>>>,
    /// When a worker last took a shard from this replica.
    last_claim: Arc<Mutex<Option<Instant>>>,
}

impl Capacity {
    /// Records which running shards have no owner now, and sets the gauge per task.
    pub fn observe(&self, running: &[RunningShard], owned: impl Fn(&ShardKey) -> bool) {
        let now = Instant::now();
        let mut since = self.unowned_since.lock().expect("capacity lock");
        let mut unassigned: HashMap<&str, u64> = HashMap::new();
        let mut seen = HashMap::new();
        for shard in running {
            let count = unassigned.entry(shard.key.task.as_str()).or_default();
            if owned(&shard.key) {
                continue;
            }
            *count += 1;
            let first = since.get(&shard.key).copied().unwrap_or(now);
            seen.insert(shard.key.clone(), first);
        }
        *since = seen;
        for (task, count) in unassigned {
            crate::metrics::METRICS
                .shards_unassigned
                .get_or_create(&tidemark_common::metrics::labels(&[("task", task)]))
                .set(count as f64);
        }
    }

    /// The task's shards that have had no owner for longer than `longer_than`.
    pub fn waiting(&self, task: &str, longer_than: Duration) -> Vec<ShardKey> {
        let since = self.unowned_since.lock().expect("capacity lock");
        let mut keys: Vec<ShardKey> = since
            .iter()
            .filter(|(key, first)| key.task == task && first.elapsed() > longer_than)
            .map(|(key, _)| key.clone())
            .collect();
        keys.sort_by_key(|k| (k.epoch, k.shard_id));
        keys
    }

    /// Every task's shards waiting longer than `longer_than`.
    fn all_waiting(&self, longer_than: Duration) -> usize {
        let since = self.unowned_since.lock().expect("capacity lock");
        since.values().filter(|first| first.elapsed() > longer_than).count()
    }

    /// A worker took a shard: the pool had room.
    pub fn claimed(&self) {
        *self.last_claim.lock().expect("capacity lock") = Some(Instant::now());
    }

    /// The shards that need a turn: those waiting longer than [`waiting_after`], unless a
    /// worker took a shard within that time (then the pool has room, and they will be taken).
    fn needing_turns(&self, lease_ttl: Duration) -> usize {
        let patience = waiting_after(lease_ttl);
        let pool_takes = self
            .last_claim
            .lock()
            .expect("capacity lock")
            .is_some_and(|at| at.elapsed() < patience);
        if pool_takes { 0 } else { self.all_waiting(patience) }
    }
}

/// How long a shard waits before `status` warns and a turn is arranged for it.
pub fn waiting_after(lease_ttl: Duration) -> Duration {
    2 * lease_ttl
}

/// How long an owner keeps a caught-up shard before it may be asked to give a waiting one a
/// turn.
pub fn turn(lease_ttl: Duration) -> Duration {
    3 * lease_ttl
}

/// The leader's part: for each shard waiting (beyond the releases already asked for) while
/// the pool takes none, the owner of the caught-up shard held longest (at least [`turn`]) is
/// asked to release it.
pub async fn rotate(
    control: &ControlDb,
    capacity: &Capacity,
    running: &[RunningShard],
    owned: impl Fn(&ShardKey) -> bool,
    lease_ttl: Duration,
) -> Result<(), CoordinatorError> {
    let waiting = capacity.needing_turns(lease_ttl);
    if waiting == 0 {
        return Ok(());
    }
    let releasing = running.iter().filter(|s| s.releasing && owned(&s.key)).count();
    let mut candidates: Vec<&RunningShard> = running
        .iter()
        .filter(|s| owned(&s.key) && s.incremental && !s.releasing && s.held >= turn(lease_ttl))
        .collect();
    candidates.sort_by_key(|s| std::cmp::Reverse(s.held));
    let turns: Vec<ShardKey> = candidates
        .into_iter()
        .take(waiting.saturating_sub(releasing))
        .map(|s| s.key.clone())
        .collect();
    if turns.is_empty() {
        return Ok(());
    }
    control.request_release(&turns).await?;
    for key in &turns {
        tracing::info!(task = %key.task, epoch = key.epoch, shard = key.shard_id, waiting,
            "capacity: a caught-up shard gives a waiting one a turn");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(shard_id: u32) -> ShardKey {
        ShardKey::of_items(shard_id)
    }

    #[test]
    fn shards_need_turns_only_while_the_pool_takes_none() {
        let ttl = Duration::from_secs(10);
        let capacity = Capacity::default();
        let long_ago = Instant::now() - waiting_after(ttl) - Duration::from_secs(1);
        capacity
            .unowned_since
            .lock()
            .unwrap()
            .extend([(shard(1), long_ago), (shard(2), Instant::now())]);
        assert_eq!(
            capacity.needing_turns(ttl),
            1,
            "no claim yet: the one waiting long needs a turn"
        );
        capacity.claimed();
        assert_eq!(
            capacity.needing_turns(ttl),
            0,
            "a worker just took a shard: the pool has room, and the waiting one will be taken"
        );
        *capacity.last_claim.lock().unwrap() = Some(long_ago);
        assert_eq!(
            capacity.needing_turns(ttl),
            1,
            "no worker took a shard for as long as it waited"
        );
    }
}
