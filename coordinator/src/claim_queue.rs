//! Which shards an acquiring worker tries to claim, in O(1) per acquire.
//!
//! Reading the candidates (control database) and every ownership (lease store) on each
//! acquire cost O(shards) per call: 1,000 idle workers asking once a second overwhelmed the
//! coordinator (BENCHMARKS.md, issue 20). Instead the leader reads both at most once per
//! [`REFRESH`] (and at least once per [`MAX_AGE`]) and keeps the shards that were free, in the
//! candidates' order, in a queue; each acquire takes from its front. A claim is atomic in the
//! lease store, so a stale queue costs a failed claim, never a second owner.
//!
//! Between reads, the lease store's watch ([`follow_freed`]) tells the queue of every shard
//! whose ownership ended (a release, an owner's lease expiring). A shard the last read knew as
//! a candidate, and not reserved for some worker, goes to the back of the queue at once, so that a
//! dead worker's shards are claimed as soon as its lease expires, not after the next read
//! (which, paced by its own cost, comes every 4–7 s at 50,000 shards: BENCHMARKS.md, issue 20).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use crate::checkpoints::{ControlDb, ShardKey};
use crate::error::CoordinatorError;
use crate::leader::Leadership;
use crate::leases::Leases;

/// An empty queue is read again after this long (or longer, see `pacing`): how soon a freed
/// shard is seen.
pub(crate) const REFRESH: Duration = Duration::from_millis(500);
/// A non-empty queue is read again after this long (or longer, see `pacing`): new shards,
/// resumed tasks, reservations.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(5);

#[derive(Default)]
pub(crate) struct ClaimQueue {
    state: Mutex<State>,
    /// Shards freed since the queue last took them in (`follow_freed`); a plain mutex, as
    /// the watch cannot wait for a read of the control database.
    freed: std::sync::Mutex<Vec<ShardKey>>,
}

#[derive(Default)]
struct State {
    read_at: Option<Instant>,
    /// How long the last read took: the read ages are paced by it (see `pacing`).
    took: Duration,
    /// Free at the last read, in the candidates' order, not reserved for a worker.
    free: VecDeque<ShardKey>,
    /// Free at the last read and reserved for a worker (a move).
    reserved: HashMap<String, VecDeque<ShardKey>>,
    /// Every candidate at the last read, owned or not: true when it was reserved for a worker
    /// (a freed one of those waits for the next read, which says for whom).
    known: HashMap<ShardKey, bool>,
}

impl State {
    /// How old an empty queue may be and how old any queue may be before it is read again.
    fn ages(&self) -> (Duration, Duration) {
        (
            crate::pacing::wait_after(REFRESH, self.took),
            crate::pacing::wait_after(MAX_AGE, self.took),
        )
    }

    /// Nothing left from the last read that `worker` may take.
    fn empty_for(&self, worker: &str) -> bool {
        self.free.is_empty() && self.reserved.get(worker).is_none_or(VecDeque::is_empty)
    }

    /// Queues the freed shards the last read knew as unreserved candidates.
    fn take_in(&mut self, freed: Vec<ShardKey>) {
        for shard in freed {
            if self.known.get(&shard) == Some(&false) {
                self.free.push_back(shard);
            }
        }
    }
}

impl ClaimQueue {
    /// Forgets the last read: a shard was released or a task resumed, and the next acquire
    /// should see it at once.
    pub(crate) async fn invalidate(&self) {
        self.state.lock().await.read_at = None;
    }

    /// False when the last read, at most [`REFRESH`] old, left nothing for `worker`: the
    /// acquire answers at once, without a round trip to the lease store or the control
    /// database (an idle pool asks every second).
    pub(crate) async fn may_have(&self, worker: &str) -> bool {
        let mut state = self.state.lock().await;
        state.take_in(self.take_freed());
        let fresh = state.read_at.is_some_and(|at| at.elapsed() < state.ages().0);
        !(fresh && state.empty_for(worker))
    }

    /// The next shard `worker` should try to claim, or `None` when none was free at the last
    /// read (which is at most [`REFRESH`] old then).
    pub(crate) async fn next(
        &self,
        worker: &str,
        tasks: &[String],
        control: &ControlDb,
        leases: &Leases,
    ) -> Result<Option<ShardKey>, CoordinatorError> {
        let mut state = self.state.lock().await;
        state.take_in(self.take_freed());
        let age = state.read_at.map(|at| at.elapsed());
        let (refresh, max_age) = state.ages();
        let stale = age.is_none_or(|age| age >= max_age || (state.empty_for(worker) && age >= refresh));
        if stale {
            let started = Instant::now();
            let candidates = control.shard_candidates(tasks).await?;
            let owners = leases.owners().await?;
            let mut free = VecDeque::new();
            let mut reserved: HashMap<String, VecDeque<ShardKey>> = HashMap::new();
            let mut known = HashMap::with_capacity(candidates.len());
            for candidate in candidates {
                known.insert(candidate.shard.clone(), candidate.reserved_for.is_some());
                if owners.contains_key(&candidate.shard) {
                    continue;
                }
                match candidate.reserved_for {
                    Some(for_worker) => reserved.entry(for_worker).or_default().push_back(candidate.shard),
                    None => free.push_back(candidate.shard),
                }
            }
            *state = State {
                read_at: Some(Instant::now()),
                took: started.elapsed(),
                free,
                reserved,
                known,
            };
        }
        let state = &mut *state;
        let mine = state.reserved.get_mut(worker).and_then(VecDeque::pop_front);
        // Each shard is handed out once per read, so concurrent acquires try different ones.
        Ok(mine.or_else(|| state.free.pop_front()))
    }
}

impl ClaimQueue {
    /// Notes a shard whose ownership ended; the next acquire queues it.
    fn freed(&self, shard: ShardKey) {
        self.freed.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(shard);
    }

    fn take_freed(&self) -> Vec<ShardKey> {
        std::mem::take(&mut *self.freed.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

/// Feeds `claims` with the shards the lease store reports freed, for as long as the process
/// runs. When the watch breaks (etcd restarted, the connection reset), events may have been
/// missed: the queue is read afresh on the next acquire and the watch is opened again.
/// A follower keeps nothing: it claims nothing, and a new leader reads the queue afresh.
pub(crate) async fn follow_freed(claims: Arc<ClaimQueue>, leases: Leases, leadership: Leadership) {
    let mut logged = false;
    loop {
        let watching = leases
            .watch_freed(&|shard| {
                if leadership.is_leader() {
                    claims.freed(shard);
                }
            })
            .await;
        match watching {
            Ok(false) => return,
            Ok(true) => logged = false,
            Err(error) => {
                if !logged {
                    tracing::warn!(%error, "watch of freed shards broken; reopening it (claims fall back to reads meanwhile)");
                    logged = true;
                }
            }
        }
        claims.invalidate().await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(id: u32) -> ShardKey {
        ShardKey {
            task: "items".into(),
            epoch: 1,
            shard_id: id,
        }
    }

    /// The last read knew shards 1 (free then, since claimed), 2 (owned) and 3 (reserved for
    /// a move); 9 is new since.
    fn read() -> State {
        State {
            read_at: Some(Instant::now()),
            took: Duration::ZERO,
            free: VecDeque::new(),
            reserved: HashMap::new(),
            known: HashMap::from([(shard(1), false), (shard(2), false), (shard(3), true)]),
        }
    }

    #[test]
    fn freed_candidates_are_queued_at_once() {
        let queue = ClaimQueue::default();
        let mut state = read();
        assert!(state.empty_for("w1"));
        queue.freed(shard(2));
        queue.freed(shard(1));
        state.take_in(queue.take_freed());
        assert_eq!(Vec::from(state.free.clone()), vec![shard(2), shard(1)]);
        assert!(!state.empty_for("w1"), "an acquire takes a freed shard without a read");
        assert!(queue.take_freed().is_empty(), "each freed shard is taken in once");
    }

    #[test]
    fn reserved_and_unknown_shards_wait_for_the_next_read() {
        let queue = ClaimQueue::default();
        let mut state = read();
        // A reserved shard freed must go to the worker it is reserved for, which only a read
        // says (a claim by anyone else would clear the reservation); a shard the last read
        // did not know may belong to a paused task or be waiting for a split.
        queue.freed(shard(3));
        queue.freed(shard(9));
        state.take_in(queue.take_freed());
        assert!(state.free.is_empty() && state.reserved.is_empty(), "{:?}", state.free);
    }

    #[tokio::test]
    async fn may_have_sees_a_freed_shard_before_the_next_read() {
        let queue = ClaimQueue::default();
        *queue.state.lock().await = read();
        assert!(!queue.may_have("w1").await, "a fresh, empty read answers no");
        queue.freed(shard(2));
        assert!(queue.may_have("w1").await, "a freed candidate answers yes at once");
    }
}
