//! When each worker was last heard from (`workers.last_seen`, shown by `workers list`), written
//! to the control database at most once per [`FLUSH_EVERY`] in one statement for every worker
//! heard since, instead of one UPDATE per heartbeat: 1,000 workers heartbeating every TTL/3
//! made 300 control-database transactions a second that nothing reads but the operator
//! (BENCHMARKS.md, issue 20). Liveness itself is the lease, never this column.
//!
//! The leader also counts the workers it heard from within a lease TTL: an acquire takes at
//! most its share of the shards waiting (`CoordinatorService::acquire`).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::checkpoints::ControlDb;

pub(crate) const FLUSH_EVERY: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(crate) struct WorkersSeen {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    heard: HashSet<String>,
    flushed_at: Option<Instant>,
    /// When each worker was last heard from by this process: registered, or a heartbeat that
    /// found its lease alive.
    last: HashMap<String, Instant>,
}

impl WorkersSeen {
    fn locked(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Notes that `worker` is alive now (it registered), for [`Self::live`].
    pub(crate) fn noted(&self, worker: &str) {
        self.locked().last.insert(worker.to_string(), Instant::now());
    }

    /// How many workers this process heard from within `within` (at least one: the caller's).
    pub(crate) fn live(&self, within: Duration) -> usize {
        let mut state = self.locked();
        state.last.retain(|_, at| at.elapsed() < within);
        state.last.len().max(1)
    }

    /// Notes that `worker` was heard from now. The heartbeat that finds the last write
    /// [`FLUSH_EVERY`] old writes every worker noted since (`last_seen` is at most that late).
    /// A failed write is logged and retried with the next heartbeat; it never fails the
    /// heartbeat, whose lease was renewed all the same.
    pub(crate) async fn heard(&self, worker: &str, control: &ControlDb) {
        let due: Vec<String> = {
            let mut state = self.locked();
            state.last.insert(worker.to_string(), Instant::now());
            state.heard.insert(worker.to_string());
            if state.flushed_at.is_some_and(|at| at.elapsed() < FLUSH_EVERY) {
                return;
            }
            state.flushed_at = Some(Instant::now());
            state.heard.drain().collect()
        };
        if let Err(error) = control.workers_seen(&due).await {
            // Heard again on their next heartbeat: keep them for the next write.
            let mut state = self.locked();
            state.heard.extend(due);
            state.flushed_at = None;
            tracing::warn!(%error, "could not record when workers were last seen; retrying");
        }
    }
}
