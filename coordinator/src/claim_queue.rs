//! Which shards an acquiring worker tries to claim, in O(1) per acquire.
//!
//! Reading the candidates (control database) and every ownership (lease store) on each
//! acquire cost O(shards) per call: 1,000 idle workers asking once a second overwhelmed the
//! coordinator (BENCHMARKS.md, issue 20). Instead the leader keeps the shards that were free,
//! in the candidates' order, in a queue; each acquire takes from its front. A claim is atomic
//! in the lease store, so a stale queue costs a failed claim, never a second owner.
//!
//! The queue follows changes, not the clock. The lease store's feed of ended ownerships
//! (`Leases::watch_freed`) puts a vanished or released worker's shards in front of the queue
//! as soon as their ownership ends, each checked against the control database (paused,
//! retired, reserved) in one query for all that ended together. Every change this process
//! makes that can make shards claimable (`ControlDb::candidates_changed`: a planned or
//! switched epoch, a split's or merge's children, a move, a resume) and every new term as
//! leader make the next acquire read everything. A shard its worker released is checked like
//! a freed one, and goes behind the shards already waiting (it was worked on until now); when
//! each release made the next acquire read everything, a thousand releases at 50,000 shards
//! kept the coordinator reading every shard for 32 s. Besides, everything is read every
//! [`CORRECTION`] or longer (see `pacing`), to correct what no change reported. At 50,000
//! shards such a read takes about a second of the control database and etcd; read every
//! 10-20 s (the pace when an empty queue was read again after 500 ms), it set the tail of
//! every other call.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::checkpoints::{Candidate, ControlDb, ShardKey};
use crate::error::CoordinatorError;
use crate::leases::Leases;
use crate::metrics::observe_scan;

/// Everything is read again after this long (or longer, see `pacing`) even when no change
/// was reported: a reservation that ran out, a change made by another process.
pub(crate) const CORRECTION: Duration = Duration::from_secs(60);
/// How long a broken feed of freed shards waits before it is opened again.
const FEED_RETRY: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(crate) struct ClaimQueue {
    /// Held only to look or change, never across a read: acquires go on while one runs.
    state: Mutex<State>,
    /// Held by the one acquire that reads (everything, or the freed shards).
    reading: tokio::sync::Mutex<()>,
    /// The task following the lease store's freed ownerships (`follow`).
    follower: Mutex<Option<tokio::task::AbortHandle>>,
}

#[derive(Default)]
struct State {
    read_at: Option<Instant>,
    /// The changes reported when the last read began (`ClaimQueue::next`'s `changes`).
    changes: u64,
    /// How long the last read took: the read ages are paced by it (see `pacing`).
    took: Duration,
    /// Free at the last read, in the candidates' order, not reserved for a worker.
    free: VecDeque<ShardKey>,
    /// Free at the last read and reserved for a worker (a move).
    reserved: HashMap<String, VecDeque<ShardKey>>,
    /// Shards whose ownership ended since, not yet checked against the control database.
    freed: Vec<ShardKey>,
    /// Released by their workers since the last read of everything, and not taken since:
    /// offered behind the others.
    released: HashSet<ShardKey>,
}

/// What an acquire must read before it takes from the queue.
#[derive(PartialEq)]
enum Read {
    Nothing,
    /// Every candidate and every owner: the queue is old.
    Everything,
    /// The candidates among the freed shards.
    Freed,
}

impl State {
    /// Nothing left from the last read that `worker` may take.
    fn empty_for(&self, worker: &str) -> bool {
        self.free.is_empty() && self.reserved.get(worker).is_none_or(VecDeque::is_empty)
    }

    fn to_read(&self, changes: u64) -> Read {
        let stale = self
            .read_at
            .is_none_or(|at| at.elapsed() >= crate::pacing::wait_after(CORRECTION, self.took));
        if stale || changes != self.changes {
            Read::Everything
        } else if !self.freed.is_empty() {
            Read::Freed
        } else {
            Read::Nothing
        }
    }

    /// Whether an acquire that finds a read due must wait for it, rather than take from the
    /// queue as it is while another acquire reads. It must when the queue may hold shards it
    /// must not take (never read, or a change was reported since), or holds nothing for it
    /// while ended ownerships wait to be checked. A queue that is only old, or that has
    /// shards for it besides those waiting to be checked, serves it at once: when every
    /// acquire waited for the one that read the freed shards, a vanished tenth of a
    /// 50,000-shard pool held each acquire up to 3 s, and the correcting read every minute
    /// held up every idle worker's acquire for the second it took.
    fn must_wait(&self, read: &Read, worker: &str, changes: u64) -> bool {
        match read {
            Read::Nothing => false,
            Read::Everything if self.read_at.is_none() || changes != self.changes => true,
            Read::Everything | Read::Freed => self.empty_for(worker) && !self.freed.is_empty(),
        }
    }

    /// Puts candidates in front of what the queue holds: freed shards were being worked on.
    /// Released ones go behind: a worker gave them up, and shards waiting for a turn come
    /// first.
    fn offer(&mut self, candidates: Vec<Candidate>) {
        for candidate in candidates.into_iter().rev() {
            match candidate.reserved_for {
                Some(worker) => self.reserved.entry(worker).or_default().push_front(candidate.shard),
                None if self.released.contains(&candidate.shard) => self.free.push_back(candidate.shard),
                None => self.free.push_front(candidate.shard),
            }
        }
    }

    /// The next shard for `worker`: one reserved for it, else the front of the queue.
    fn take(&mut self, worker: &str) -> Option<ShardKey> {
        let mine = self.reserved.get_mut(worker).and_then(VecDeque::pop_front);
        // Each shard is handed out once per read, so concurrent acquires try different ones.
        let shard = mine.or_else(|| self.free.pop_front())?;
        self.released.remove(&shard);
        Some(shard)
    }
}

impl Drop for ClaimQueue {
    fn drop(&mut self) {
        if let Some(follower) = self.locked_follower().take() {
            follower.abort();
        }
    }
}

impl ClaimQueue {
    fn locked(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn locked_follower(&self) -> MutexGuard<'_, Option<tokio::task::AbortHandle>> {
        self.follower.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Follows the lease store's ended ownerships for as long as the queue lives, so that a
    /// shard whose worker vanished is offered as soon as its lease expires, not at the next
    /// read of every shard (which at 50,000 shards came up to 9 s later, `pacing`). When the
    /// feed breaks, the next acquire reads everything and the feed is opened again.
    pub(crate) fn follow(self: &Arc<Self>, leases: Leases) {
        let queue = Arc::downgrade(self);
        let follower = tokio::spawn(async move {
            loop {
                let ended = match leases.watch_freed().await {
                    Ok(mut feed) => loop {
                        match feed.next().await {
                            Ok(shards) => match queue.upgrade() {
                                Some(queue) => queue.locked().freed.extend(shards),
                                None => return,
                            },
                            Err(error) => break error,
                        }
                    },
                    Err(error) => error,
                };
                tracing::warn!(%ended, "the feed of freed shards broke; reading every shard, then opening it again");
                match queue.upgrade() {
                    Some(queue) => queue.invalidate(),
                    None => return,
                }
                tokio::time::sleep(FEED_RETRY).await;
            }
        });
        *self.locked_follower() = Some(follower.abort_handle());
    }

    /// `shard`'s worker is releasing it: when its ownership ends (the lease store's feed may
    /// report that before [`Self::released`]), it is offered behind the shards already waiting.
    pub(crate) fn releasing(&self, shard: &ShardKey) {
        self.locked().released.insert(shard.clone());
    }

    /// `shard`'s ownership ended by its release: the next acquire checks it (not every
    /// shard).
    pub(crate) fn released(&self, shard: ShardKey) {
        self.locked().freed.push(shard);
    }

    /// Shards taken from the queue but not claimed (the acquiring worker's lease was gone):
    /// the next acquire checks them again.
    pub(crate) fn unclaimed(&self, shards: Vec<ShardKey>) {
        self.locked().freed.extend(shards);
    }

    /// Forgets the last read: a task resumed or a claim failed, and the next acquire should
    /// read everything.
    pub(crate) fn invalidate(&self) {
        self.locked().read_at = None;
    }

    /// False when the last read left nothing for `worker`, and no ownership ended and nothing
    /// changed since: the acquire answers at once, without a round trip to the lease store or
    /// the control database (an idle pool asks every second).
    pub(crate) fn may_have(&self, worker: &str, changes: u64) -> bool {
        let state = self.locked();
        !(state.to_read(changes) == Read::Nothing && state.empty_for(worker))
    }

    /// How many shards from the last read `worker` may still take (the freed ones not yet
    /// checked are not counted).
    pub(crate) fn waiting(&self, worker: &str) -> usize {
        let state = self.locked();
        state.free.len() + state.reserved.get(worker).map_or(0, VecDeque::len)
    }

    /// The next shard `worker` should try to claim, or `None` when none was free at the last
    /// read and none was freed since. `changes` counts the reported changes (see the module
    /// documentation); when it moved, everything is read. An acquire that finds another reading
    /// waits for that read and takes from its result when it must (`State::must_wait`):
    /// answered `None` instead, its worker would ask again only a second later (at a
    /// cluster's start, the second worker's first acquire came while the first worker's read
    /// the queue, and it began 1.2 s late). Otherwise it takes from the queue as it is.
    pub(crate) async fn next(
        &self,
        worker: &str,
        changes: u64,
        tasks: &[String],
        control: &ControlDb,
        leases: &Leases,
    ) -> Result<Option<ShardKey>, CoordinatorError> {
        let (read, wait) = {
            let state = self.locked();
            let read = state.to_read(changes);
            let wait = state.must_wait(&read, worker, changes);
            (read, wait)
        };
        if read != Read::Nothing {
            let _reading = if wait {
                self.reading.lock().await
            } else {
                match self.reading.try_lock() {
                    Ok(reading) => reading,
                    // Another acquire reads: take from the queue as it is.
                    Err(_) => return Ok(self.locked().take(worker)),
                }
            };
            // Asked again: the read waited for may have made it unnecessary.
            let read = self.locked().to_read(changes);
            match read {
                Read::Nothing => {}
                Read::Everything => self.read_everything(changes, tasks, control, leases).await?,
                Read::Freed => {
                    let started = Instant::now();
                    let mut freed = std::mem::take(&mut self.locked().freed);
                    // Released shards are also reported by the lease store's feed.
                    let mut seen = HashSet::new();
                    freed.retain(|shard| seen.insert(shard.clone()));
                    let candidates = match control.shard_candidates_among(tasks, &freed).await {
                        Ok(candidates) => candidates,
                        Err(error) => {
                            self.locked().freed.extend(freed);
                            return Err(error);
                        }
                    };
                    observe_scan("freed", started.elapsed());
                    self.locked().offer(candidates);
                }
            }
        }
        Ok(self.locked().take(worker))
    }

    /// Replaces the queue by every candidate no one owns. Ownerships that end during the
    /// read stay in `freed`, to be checked by the next acquire.
    async fn read_everything(
        &self,
        changes: u64,
        tasks: &[String],
        control: &ControlDb,
        leases: &Leases,
    ) -> Result<(), CoordinatorError> {
        let started = Instant::now();
        self.locked().freed.clear();
        let candidates = control.shard_candidates(tasks).await?;
        let owners = leases.owners().await?;
        let mut fresh = State::default();
        fresh.offer(
            candidates
                .into_iter()
                .filter(|candidate| !owners.contains_key(&candidate.shard))
                .collect(),
        );
        let took = started.elapsed();
        observe_scan("claim_queue", took);
        let mut state = self.locked();
        state.read_at = Some(Instant::now());
        // Changes reported during the read are read again at the next acquire.
        state.changes = changes;
        state.took = took;
        state.free = fresh.free;
        state.reserved = fresh.reserved;
        // The read ordered every shard by when it was last worked on.
        state.released.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(shard_id: u32) -> ShardKey {
        ShardKey::of_items(shard_id)
    }

    fn candidate(shard_id: u32) -> Candidate {
        Candidate {
            shard: shard(shard_id),
            reserved_for: None,
        }
    }

    #[test]
    fn a_released_shard_goes_behind_the_waiting_ones_and_a_vanished_workers_in_front() {
        let mut state = State::default();
        state.offer(vec![candidate(1), candidate(2)]);
        state.released.insert(shard(3));
        state.offer(vec![candidate(3), candidate(4)]);
        assert_eq!(state.take("w"), Some(shard(4)), "freed by a vanished worker: first");
        assert_eq!(state.take("w"), Some(shard(1)));
        assert_eq!(state.take("w"), Some(shard(2)));
        assert_eq!(
            state.take("w"),
            Some(shard(3)),
            "released: after the shards already waiting"
        );
        assert!(state.released.is_empty(), "taken: offered like any other from now on");
        assert_eq!(state.take("w"), None);
    }

    #[test]
    fn an_acquire_waits_for_a_read_only_when_the_queue_cannot_serve_it() {
        let mut state = State::default();
        assert!(state.must_wait(&state.to_read(0), "w", 0), "never read");
        state.read_at = Some(Instant::now());
        state.changes = 7;
        assert!(!state.must_wait(&state.to_read(7), "w", 7), "nothing to read");
        assert!(state.must_wait(&state.to_read(8), "w", 8), "a change was reported");
        state.freed.push(shard(3));
        assert!(
            state.must_wait(&state.to_read(7), "w", 7),
            "nothing queued for it, and a freed shard to check"
        );
        state.offer(vec![candidate(1)]);
        assert!(
            !state.must_wait(&state.to_read(7), "w", 7),
            "shard 1 is queued: it takes that while another checks the freed one"
        );
        state.read_at = Some(Instant::now() - CORRECTION);
        assert!(state.to_read(7) == Read::Everything);
        assert!(
            !state.must_wait(&state.to_read(7), "w", 7),
            "old, not wrong, and shard 1 is queued"
        );
        state.take("w");
        assert!(
            state.must_wait(&state.to_read(7), "w", 7),
            "old and empty, with a freed shard to check"
        );
        state.freed.clear();
        assert!(
            !state.must_wait(&state.to_read(7), "w", 7),
            "old and empty with nothing freed: the correcting read rarely finds anything"
        );
        assert!(state.must_wait(&state.to_read(9), "w", 9), "a change was reported");
    }

    #[test]
    fn only_a_reported_change_a_freed_shard_or_age_makes_an_acquire_read() {
        let mut state = State::default();
        assert!(state.to_read(0) == Read::Everything, "never read");
        state.read_at = Some(Instant::now());
        state.changes = 7;
        assert!(state.to_read(7) == Read::Nothing, "read just now, nothing changed");
        assert!(state.empty_for("w1"), "an empty queue is not read again by itself");
        assert!(state.to_read(8) == Read::Everything, "a change was reported since");
        state.freed.push(shard(3));
        assert!(state.to_read(7) == Read::Freed, "an ownership ended since");
        state.read_at = Some(Instant::now() - CORRECTION);
        assert!(state.to_read(7) == Read::Everything, "the correcting read is due");
        state.took = Duration::from_secs(4);
        state.read_at = Some(Instant::now() - CORRECTION);
        assert!(
            state.to_read(7) == Read::Freed,
            "a read of 4 s rests 19 times as long: 76 s, more than the correction's 60 s"
        );
    }
}
