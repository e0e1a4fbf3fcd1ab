//! Which shards an acquiring worker tries to claim, in O(1) per acquire.
//!
//! Reading the candidates (control database) and every ownership (lease store) on each
//! acquire cost O(shards) per call: 1,000 idle workers asking once a second overwhelmed the
//! coordinator (BENCHMARKS.md, issue 20). Instead the leader reads both at most once per
//! [`REFRESH`] (and at least once per [`MAX_AGE`]) and keeps the shards that were free, in the
//! candidates' order, in a queue; each acquire takes from its front. A claim is atomic in the
//! lease store, so a stale queue costs a failed claim, never a second owner.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use crate::checkpoints::{ControlDb, ShardKey};
use crate::error::CoordinatorError;
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
        let state = self.state.lock().await;
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
        let age = state.read_at.map(|at| at.elapsed());
        let (refresh, max_age) = state.ages();
        let stale = age.is_none_or(|age| age >= max_age || (state.empty_for(worker) && age >= refresh));
        if stale {
            let started = Instant::now();
            let candidates = control.shard_candidates(tasks).await?;
            let owners = leases.owners().await?;
            let mut free = VecDeque::new();
            let mut reserved: HashMap<String, VecDeque<ShardKey>> = HashMap::new();
            for candidate in candidates {
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
            };
        }
        let state = &mut *state;
        let mine = state.reserved.get_mut(worker).and_then(VecDeque::pop_front);
        // Each shard is handed out once per read, so concurrent acquires try different ones.
        Ok(mine.or_else(|| state.free.pop_front()))
    }
}
