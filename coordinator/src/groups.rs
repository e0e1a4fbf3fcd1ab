//! Grouped control-database calls: the calls of one kind that arrive while the control
//! database works on earlier ones go in together, one statement or transaction for the
//! group. Every batch costs three such calls (its registration, its commit and the shard's
//! work poll after it), each once per batch and per idle shard's poll interval, and every
//! claimed shard one (a vanished worker's shards are claimed in a burst); their
//! cost is per use of a control connection, not per row: at 1,000 workers the queue for
//! control connections, not the database, set their latency (issue 20). A connection's use
//! is its statement, sqlx's ping as it goes back to the pool, and the wake-ups of both; a
//! group pays them once.
//!
//! Each call is still checked and answered on its own; grouping changes only how many
//! calls share a statement. A group holds each shard once (a retry racing its original
//! waits for the next round). When a statement of a group fails, its calls run again one
//! by one, so that each gets its own answer and one bad call cannot fail the others; when
//! the control database is out of reach, all get that answer at once.

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::sync::{Mutex, mpsc, oneshot};

use crate::checkpoints::{Claim, Claimed, CommitBatch, Committed, ControlDb, RegisterBatch, ShardKey};
use crate::error::CoordinatorError;
use crate::metrics::METRICS;
use crate::reconcile_runs::ShardWork;
use tidemark_common::metrics::labels;

/// The most calls in one group.
const MAX_GROUP: usize = 256;

/// One kind of call that can be grouped.
pub trait Work: Send + Sync + 'static {
    type Item: Send + Sync + 'static;
    type Out: Send + 'static;
    /// The RPC served: the `call` label of the group metrics.
    const CALL: &'static str;
    /// Groups in flight at once, each on its own control connection.
    const RUNNERS: usize;
    fn shard(item: &Self::Item) -> &ShardKey;
    /// One answer per item, in order. Err: the group's statement failed and none of it
    /// took effect.
    fn group(
        control: &ControlDb,
        items: &[Self::Item],
    ) -> impl Future<Output = Result<Vec<Result<Self::Out, CoordinatorError>>, CoordinatorError>> + Send;
}

/// Where a call's answer goes, and when the call arrived.
type Reply<O> = (oneshot::Sender<Result<O, CoordinatorError>>, std::time::Instant);
type Queue<W> = mpsc::UnboundedSender<(<W as Work>::Item, Reply<<W as Work>::Out>)>;

pub struct Groups<W: Work> {
    queue: OnceLock<Queue<W>>,
}

impl<W: Work> Default for Groups<W> {
    fn default() -> Self {
        Groups { queue: OnceLock::new() }
    }
}

impl<W: Work> Groups<W> {
    /// Runs `item` in the next group; the runners start on first use.
    pub async fn call(&self, control: &ControlDb, item: W::Item) -> Result<W::Out, CoordinatorError> {
        let queue = self.queue.get_or_init(|| start::<W>(control.clone()));
        let (reply, answer) = oneshot::channel();
        // Both fail only when the runners are gone (the runtime shuts down): unavailable,
        // which the worker retries, against this replica or the next leader.
        if queue.send((item, (reply, std::time::Instant::now()))).is_err() {
            return Err(CoordinatorError::ControlDb(sqlx::Error::PoolClosed));
        }
        answer
            .await
            .unwrap_or(Err(CoordinatorError::ControlDb(sqlx::Error::PoolClosed)))
    }
}

fn start<W: Work>(control: ControlDb) -> Queue<W> {
    let (sender, receiver) = mpsc::unbounded_channel();
    let receiver = Arc::new(Mutex::new(receiver));
    for _ in 0..W::RUNNERS {
        tokio::spawn(runner::<W>(control.clone(), receiver.clone()));
    }
    sender
}

type Received<W> = mpsc::UnboundedReceiver<(<W as Work>::Item, Reply<<W as Work>::Out>)>;

async fn runner<W: Work>(control: ControlDb, receiver: Arc<Mutex<Received<W>>>) {
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
        for round in rounds::<W, _>(taken) {
            run::<W>(&control, round).await;
        }
    }
}

/// Splits calls into groups of distinct shards, keeping each shard's calls in order.
fn rounds<W: Work, T>(taken: Vec<(W::Item, T)>) -> Vec<Vec<(W::Item, T)>> {
    let mut rounds: Vec<Vec<(W::Item, T)>> = Vec::new();
    let mut shards: Vec<HashSet<ShardKey>> = Vec::new();
    for (item, reply) in taken {
        // After the last round that holds this shard: a later call of a shard never goes
        // before an earlier one.
        let shard = W::shard(&item);
        let after = shards
            .iter()
            .rposition(|held| held.contains(shard))
            .map_or(0, |r| r + 1);
        if after == rounds.len() {
            rounds.push(Vec::new());
            shards.push(HashSet::new());
        }
        shards[after].insert(shard.clone());
        rounds[after].push((item, reply));
    }
    rounds
}

async fn run<W: Work>(control: &ControlDb, group: Vec<(W::Item, Reply<W::Out>)>) {
    let (items, replies): (Vec<W::Item>, Vec<Reply<W::Out>>) = group.into_iter().unzip();
    let call = labels(&[("call", W::CALL)]);
    METRICS.group_size.get_or_create(&call).observe(items.len() as f64);
    let started = std::time::Instant::now();
    {
        let waits = METRICS.group_wait_seconds.get_or_create(&call);
        for (_, arrived) in &replies {
            waits.observe(started.duration_since(*arrived).as_secs_f64());
        }
    }
    let replies: Vec<_> = replies.into_iter().map(|(reply, _)| reply).collect();
    let outcome = W::group(control, &items).await;
    METRICS
        .group_seconds
        .get_or_create(&call)
        .observe(started.elapsed().as_secs_f64());
    match outcome {
        Ok(outcomes) => {
            for (reply, outcome) in replies.into_iter().zip(outcomes) {
                // The caller may have gone (its RPC was cancelled): its retry finds the call's
                // effect.
                let _ = reply.send(outcome);
            }
        }
        // A statement failed (a deadlock with another transaction, a row the database
        // refused): one by one, each call gets its own answer.
        Err(CoordinatorError::ControlDb(sqlx::Error::Database(error))) if items.len() > 1 => {
            tracing::warn!(call = W::CALL, calls = items.len(), %error, "group failed; running its calls one by one");
            for (item, reply) in items.iter().zip(replies) {
                let answer = match W::group(control, std::slice::from_ref(item)).await {
                    Ok(mut outcomes) => outcomes.pop().expect("one outcome per call"),
                    Err(error) => Err(error),
                };
                let _ = reply.send(answer);
            }
        }
        // The control database is out of reach: every call of the group gets the same
        // answer at once (trying each again would hold this runner for as many timeouts).
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

/// Commits: the compare-and-swap of each shard's checkpoint (`ControlDb::commit_batches`).
pub struct Commits;

impl Work for Commits {
    type Item = CommitBatch;
    type Out = Committed;
    const CALL: &'static str = "commit_batch";
    const RUNNERS: usize = 4;
    fn shard(item: &CommitBatch) -> &ShardKey {
        &item.shard
    }
    async fn group(
        control: &ControlDb,
        items: &[CommitBatch],
    ) -> Result<Vec<Result<Committed, CoordinatorError>>, CoordinatorError> {
        control.commit_batches(items).await
    }
}

/// Registrations of staged batches (`ControlDb::register_batches`).
pub struct Registrations;

impl Work for Registrations {
    type Item = RegisterBatch;
    type Out = ();
    const CALL: &'static str = "register_batch";
    const RUNNERS: usize = 2;
    fn shard(item: &RegisterBatch) -> &ShardKey {
        &item.shard
    }
    async fn group(
        control: &ControlDb,
        items: &[RegisterBatch],
    ) -> Result<Vec<Result<(), CoordinatorError>>, CoordinatorError> {
        control.register_batches(items).await
    }
}

/// The new owners of shards claimed in the lease store (`ControlDb::claim_shards`): after a
/// worker vanishes, the survivors claim its shards all at once.
pub struct Claims;

impl Work for Claims {
    type Item = Claim;
    type Out = Option<Claimed>;
    const CALL: &'static str = "acquire_shard";
    const RUNNERS: usize = 2;
    fn shard(item: &Claim) -> &ShardKey {
        &item.shard
    }
    async fn group(
        control: &ControlDb,
        items: &[Claim],
    ) -> Result<Vec<Result<Option<Claimed>, CoordinatorError>>, CoordinatorError> {
        Ok(control.claim_shards(items).await?.into_iter().map(Ok).collect())
    }
}

/// A shard owner's poll for work beside reading (`ControlDb::shard_works`).
pub struct ShardWorkPolls;

impl Work for ShardWorkPolls {
    type Item = ShardKey;
    type Out = ShardWork;
    const CALL: &'static str = "next_shard_work";
    const RUNNERS: usize = 2;
    fn shard(item: &ShardKey) -> &ShardKey {
        item
    }
    async fn group(
        control: &ControlDb,
        items: &[ShardKey],
    ) -> Result<Vec<Result<ShardWork, CoordinatorError>>, CoordinatorError> {
        Ok(control.shard_works(items).await?.into_iter().map(Ok).collect())
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
            ids(&rounds::<Commits, _>(taken)),
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
        assert_eq!(rounds::<Commits, _>(taken).len(), 1);
    }
}
