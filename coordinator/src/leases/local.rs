//! Leases in the process's memory: the same rules as etcd's (a lease expires unless kept
//! alive within its TTL, an ownership lives and dies with its lease, a claim succeeds only on
//! a free shard, a release only under the fence it was claimed with), for one coordinator whose
//! workers run in the same process. Nothing here survives the process, and nothing needs to:
//! the workers die with it, and fence tokens restart above the largest one the control
//! database recorded.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::checkpoints::ShardKey;

pub(crate) struct LocalLeases {
    ttl: Duration,
    state: Mutex<State>,
}

struct State {
    next_lease: i64,
    last_fence: u64,
    /// Lease → when it expires.
    leases: HashMap<i64, Instant>,
    /// Shard → (worker, lease, fence).
    owners: HashMap<ShardKey, (String, i64, u64)>,
    /// Who hears of ended ownerships (`watch_freed`).
    watchers: Vec<UnboundedSender<ShardKey>>,
}

impl State {
    /// Forgets expired leases and what they owned.
    fn expire(&mut self, now: Instant) {
        self.leases.retain(|_, expires| *expires > now);
        let leases = &self.leases;
        let mut ended = Vec::new();
        self.owners.retain(|shard, (_, lease, _)| {
            let alive = leases.contains_key(lease);
            if !alive {
                ended.push(shard.clone());
            }
            alive
        });
        for shard in ended {
            self.freed(shard);
        }
    }

    /// Tells the watchers that `shard` has no owner any more.
    fn freed(&mut self, shard: ShardKey) {
        self.watchers.retain(|watcher| watcher.send(shard.clone()).is_ok());
    }
}

impl LocalLeases {
    pub(crate) fn new(ttl: Duration, fence_floor: u64) -> LocalLeases {
        LocalLeases {
            ttl,
            state: Mutex::new(State {
                next_lease: 1,
                last_fence: fence_floor,
                leases: HashMap::new(),
                owners: HashMap::new(),
                watchers: Vec::new(),
            }),
        }
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, State> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.expire(Instant::now());
        state
    }

    pub(crate) fn grant(&self) -> i64 {
        let mut state = self.locked();
        let id = state.next_lease;
        state.next_lease += 1;
        state.leases.insert(id, Instant::now() + self.ttl);
        id
    }

    pub(crate) fn keep_alive(&self, lease: i64) -> bool {
        let mut state = self.locked();
        match state.leases.get_mut(&lease) {
            Some(expires) => {
                *expires = Instant::now() + self.ttl;
                true
            }
            None => false,
        }
    }

    pub(crate) fn alive(&self, lease: i64) -> bool {
        self.locked().leases.contains_key(&lease)
    }

    pub(crate) fn try_claim(&self, shard: &ShardKey, worker: &str, lease: i64) -> Option<u64> {
        let mut state = self.locked();
        if !state.leases.contains_key(&lease) || state.owners.contains_key(shard) {
            return None;
        }
        state.last_fence += 1;
        let fence = state.last_fence;
        state.owners.insert(shard.clone(), (worker.to_string(), lease, fence));
        Some(fence)
    }

    pub(crate) fn release(&self, shard: &ShardKey, fence: u64) {
        let mut state = self.locked();
        if state.owners.get(shard).is_some_and(|(_, _, held)| *held == fence) {
            state.owners.remove(shard);
            state.freed(shard.clone());
        }
    }

    pub(crate) fn owners(&self) -> HashMap<ShardKey, (String, u64)> {
        self.locked()
            .owners
            .iter()
            .map(|(shard, (worker, _, fence))| (shard.clone(), (worker.clone(), *fence)))
            .collect()
    }

    /// Every ownership that ends from now on (a release, or its lease's expiry, which is
    /// noticed at the next call of any kind: a heartbeat, a claim, a read of the owners).
    pub(crate) fn watch_freed(&self) -> UnboundedReceiver<ShardKey> {
        let (sender, receiver) = unbounded_channel();
        self.locked().watchers.push(sender);
        receiver
    }
}
