//! Prunes the control database's history past `history_retention`: the registry rows of
//! committed and abandoned batches, `checkpoint_history` and `late_rows`. Each of them grows
//! by a row per batch and nothing else removes them (issue 20: about 1.5 KiB per batch).
//!
//! What the protocol still needs is never touched: staged batches (they may be replayed),
//! every shard's checkpoint (a retried commit is recognised by its `last_batch_id`), and the
//! target's ledger (it proves a batch applied). A binary dead letter is decoded in its
//! epoch's columns, found through the ledger, not through the registry row deleted here.
//!
//! Deletes go in chunks of [`CHUNK`] rows, oldest first, each its own statement, so that no
//! lock is held long and the commits beside it do not wait.

use std::time::Duration;

use crate::checkpoints::ControlDb;
use crate::leader::Leadership;

/// Rows per DELETE statement.
pub const CHUNK: i64 = 5_000;

/// Rows deleted by one pass, per table.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    pub batches: u64,
    pub checkpoint_history: u64,
    pub late_rows: u64,
}

impl Pruned {
    pub fn total(&self) -> u64 {
        self.batches + self.checkpoint_history + self.late_rows
    }
}

/// The leader's loop: one pass per period (a tenth of the retention, between 1 s and 10 min),
/// the first at most 30 s after the start (a coordinator restarted often still prunes).
pub async fn prune_history(control: ControlDb, retention: Duration, leadership: Leadership) {
    let period = (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(600));
    let mut pause = period.min(Duration::from_secs(30));
    loop {
        tokio::time::sleep(pause).await;
        pause = period;
        if !leadership.is_leader() {
            continue;
        }
        let started = std::time::Instant::now();
        match prune_once(&control, retention).await {
            Ok(pruned) if pruned.total() == 0 => {}
            Ok(pruned) => tracing::info!(
                batches = pruned.batches,
                checkpoint_history = pruned.checkpoint_history,
                late_rows = pruned.late_rows,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "control history pruned past history_retention"
            ),
            Err(error) => tracing::warn!(%error, "pruning the control history failed; retrying"),
        }
    }
}

/// The DELETE of one chunk per table ($1: the retention in seconds, $2: the chunk size). The
/// states are literals (see `batches::commit`): `STAGED` rows are never deleted. History ids
/// grow with time, so the oldest rows come first in the primary key's order.
const STATEMENTS: [&str; 3] = [
    "DELETE FROM batches WHERE batch_id IN (SELECT batch_id FROM batches \
     WHERE state IN ('COMMITTED', 'ABANDONED') \
     AND coalesce(committed_at, staged_at) < now() - make_interval(secs => $1) LIMIT $2)",
    "DELETE FROM checkpoint_history WHERE id IN (SELECT id FROM checkpoint_history \
     WHERE committed_at < now() - make_interval(secs => $1) ORDER BY id LIMIT $2)",
    "DELETE FROM late_rows WHERE id IN (SELECT id FROM late_rows \
     WHERE found_at < now() - make_interval(secs => $1) ORDER BY id LIMIT $2)",
];

/// One pass: deletes, chunk by chunk, every row older than `retention`.
pub async fn prune_once(control: &ControlDb, retention: Duration) -> Result<Pruned, sqlx::Error> {
    if let Some(lite) = control.lite() {
        return lite.prune(retention).await;
    }
    let seconds = retention.as_secs_f64();
    let mut deleted = [0u64; 3];
    for (statement, count) in STATEMENTS.iter().zip(deleted.iter_mut()) {
        *count = chunked(control, statement, seconds).await?;
    }
    let [batches, checkpoint_history, late_rows] = deleted;
    Ok(Pruned {
        batches,
        checkpoint_history,
        late_rows,
    })
}

async fn chunked(control: &ControlDb, statement: &'static str, seconds: f64) -> Result<u64, sqlx::Error> {
    let mut deleted = 0;
    loop {
        let n = sqlx::query(statement)
            .bind(seconds)
            .bind(CHUNK)
            .execute(control.pool())
            .await?
            .rows_affected();
        deleted += n;
        if n < CHUNK as u64 {
            return Ok(deleted);
        }
    }
}
