//! Group commit: the commits that arrive while the control database works on earlier ones
//! go in together, one transaction for the group (`ControlDb::commit_batches`). A commit is
//! the coordinator's most frequent call (every batch and every idle shard's empty advance,
//! per poll interval), and its cost was per transaction and statement, not per row: at 1,000
//! workers the queue for control connections, not the database, set the commit latency
//! (issue 20).
//!
//! Each commit is still checked and refused on its own; grouping changes only how many
//! commits share a transaction. A group holds each shard once (a retry racing its original
//! waits for the next round). When a statement of a group's transaction fails, its commits
//! run again one by one, so that each gets its own answer and one bad commit cannot fail
//! the others; when the control database is out of reach, all get that answer at once.

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use tokio::sync::{Mutex, mpsc, oneshot};

use crate::checkpoints::{CommitBatch, Committed, ControlDb};
use crate::error::CoordinatorError;
use crate::metrics::METRICS;

/// Groups in flight at once, each on its own control connection.
const COMMITTERS: usize = 4;
/// The most commits in one group.
const MAX_GROUP: usize = 256;

type Reply = oneshot::Sender<Result<Committed, CoordinatorError>>;

#[derive(Default)]
pub struct CommitGroups {
    queue: OnceLock<mpsc::UnboundedSender<(CommitBatch, Reply)>>,
}

impl CommitGroups {
    /// Commits `commit` in the next group; the committers start on first use.
    pub async fn commit(&self, control: &ControlDb, commit: CommitBatch) -> Result<Committed, CoordinatorError> {
        let queue = self.queue.get_or_init(|| start(control.clone()));
        let (reply, answer) = oneshot::channel();
        // Both fail only when the committers are gone (the runtime shuts down): unavailable,
        // which the worker retries, against this replica or the next leader.
        if queue.send((commit, reply)).is_err() {
            return Err(CoordinatorError::ControlDb(sqlx::Error::PoolClosed));
        }
        answer
            .await
            .unwrap_or(Err(CoordinatorError::ControlDb(sqlx::Error::PoolClosed)))
    }
}

fn start(control: ControlDb) -> mpsc::UnboundedSender<(CommitBatch, Reply)> {
    let (sender, receiver) = mpsc::unbounded_channel();
    let receiver = Arc::new(Mutex::new(receiver));
    for _ in 0..COMMITTERS {
        tokio::spawn(committer(control.clone(), receiver.clone()));
    }
    sender
}

async fn committer(control: ControlDb, receiver: Arc<Mutex<mpsc::UnboundedReceiver<(CommitBatch, Reply)>>>) {
    loop {
        let mut taken = Vec::new();
        {
            let mut receiver = receiver.lock().await;
            match receiver.recv().await {
                Some(first) => taken.push(first),
                None => return,
            }
            while taken.len() < MAX_GROUP {
                match receiver.try_recv() {
                    Ok(next) => taken.push(next),
                    Err(_) => break,
                }
            }
        }
        for round in rounds(taken) {
            run(&control, round).await;
        }
    }
}

/// Splits commits into groups of distinct shards, keeping each shard's commits in order.
fn rounds<T>(taken: Vec<(CommitBatch, T)>) -> Vec<Vec<(CommitBatch, T)>> {
    let mut rounds: Vec<Vec<(CommitBatch, T)>> = Vec::new();
    let mut shards: Vec<HashSet<crate::checkpoints::ShardKey>> = Vec::new();
    for (commit, reply) in taken {
        // After the last round that holds this shard: a later commit of a shard never goes
        // before an earlier one.
        let after = shards
            .iter()
            .rposition(|held| held.contains(&commit.shard))
            .map_or(0, |r| r + 1);
        if after == rounds.len() {
            rounds.push(Vec::new());
            shards.push(HashSet::new());
        }
        shards[after].insert(commit.shard.clone());
        rounds[after].push((commit, reply));
    }
    rounds
}

async fn run(control: &ControlDb, group: Vec<(CommitBatch, Reply)>) {
    let (commits, replies): (Vec<CommitBatch>, Vec<Reply>) = group.into_iter().unzip();
    METRICS.commit_group_size.observe(commits.len() as f64);
    let started = std::time::Instant::now();
    let outcome = control.commit_batches(&commits).await;
    METRICS.commit_group_seconds.observe(started.elapsed().as_secs_f64());
    match outcome {
        Ok(outcomes) => {
            for (reply, outcome) in replies.into_iter().zip(outcomes) {
                // The caller may have gone (its RPC was cancelled): its retry finds the commit.
                let _ = reply.send(outcome);
            }
        }
        // A statement failed (a deadlock with another transaction, a row the database
        // refused): one by one, each commit gets its own answer.
        Err(CoordinatorError::ControlDb(sqlx::Error::Database(error))) if commits.len() > 1 => {
            tracing::warn!(commits = commits.len(), %error, "commit group failed; committing its commits one by one");
            for (commit, reply) in commits.iter().zip(replies) {
                let _ = reply.send(control.commit_batch(commit).await);
            }
        }
        // The control database is out of reach: every commit of the group gets the same
        // answer at once (trying each again would hold this committer for as many timeouts).
        Err(error) => {
            let mut replies = replies.into_iter();
            let last = replies.next_back();
            for reply in replies {
                let _ = reply.send(Err(same_error(&error)));
            }
            if let Some(last) = last {
                let _ = last.send(Err(error));
            }
        }
    }
}

/// A copy of `error` with the same gRPC status: sqlx's errors cannot be cloned.
fn same_error(error: &CoordinatorError) -> CoordinatorError {
    match error {
        CoordinatorError::ControlDb(sqlx::Error::PoolTimedOut) => {
            CoordinatorError::ControlDb(sqlx::Error::PoolTimedOut)
        }
        CoordinatorError::ControlDb(sqlx::Error::PoolClosed) => CoordinatorError::ControlDb(sqlx::Error::PoolClosed),
        CoordinatorError::ControlDb(sqlx::Error::Io(io)) => {
            CoordinatorError::ControlDb(sqlx::Error::Io(std::io::Error::new(io.kind(), io.to_string())))
        }
        // Displayed as its message alone.
        CoordinatorError::ControlDb(other) => {
            CoordinatorError::ControlDb(sqlx::Error::InvalidArgument(other.to_string()))
        }
        CoordinatorError::InvalidRequest(message) => CoordinatorError::InvalidRequest(message.clone()),
        // `commit_batches` fails a group with the two kinds above only.
        other => CoordinatorError::InvalidRequest(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoints::ShardKey;
    use tidemark_common::cursor::Cursor;

    fn commit(shard_id: u32, batch: &str) -> CommitBatch {
        CommitBatch {
            shard: ShardKey {
                task: "t".into(),
                epoch: 1,
                shard_id,
            },
            fence: 1,
            expected_version: 0,
            batch_id: batch.into(),
            lower: Cursor::snapshot_start(1),
            upper: Cursor::snapshot_start(1),
            row_count: 0,
            empty: false,
            replayed: false,
            late_row_lateness_micros: Vec::new(),
        }
    }

    fn ids(rounds: &[Vec<(CommitBatch, ())>]) -> Vec<Vec<&str>> {
        rounds
            .iter()
            .map(|round| round.iter().map(|(c, _)| c.batch_id.as_str()).collect())
            .collect()
    }

    #[test]
    fn a_group_holds_each_shard_once_and_keeps_each_shards_order() {
        let taken = vec![
            (commit(1, "a1"), ()),
            (commit(2, "b1"), ()),
            (commit(1, "a2"), ()),
            (commit(3, "c1"), ()),
            (commit(1, "a3"), ()),
            (commit(2, "b2"), ()),
        ];
        assert_eq!(
            ids(&rounds(taken)),
            vec![vec!["a1", "b1", "c1"], vec!["a2", "b2"], vec!["a3"]]
        );
    }

    #[test]
    fn a_group_failure_reaches_every_commit_with_the_same_status() {
        for error in [
            CoordinatorError::ControlDb(sqlx::Error::PoolTimedOut),
            CoordinatorError::ControlDb(sqlx::Error::Io(std::io::Error::other("reset"))),
            CoordinatorError::ControlDb(sqlx::Error::RowNotFound),
            CoordinatorError::InvalidRequest("3 of 4 locked checkpoints moved".into()),
        ] {
            let copy = same_error(&error);
            assert_eq!(copy.to_string(), error.to_string());
            assert_eq!(tonic::Status::from(copy).code(), tonic::Status::from(error).code());
        }
    }

    #[test]
    fn distinct_shards_make_one_group() {
        let taken: Vec<_> = (0..10).map(|i| (commit(i, "x"), ())).collect();
        assert_eq!(rounds(taken).len(), 1);
    }
}
