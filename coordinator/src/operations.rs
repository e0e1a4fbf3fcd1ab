//! Operating shards and workers while tasks run: split, merge, move, drain and balancing.
//!
//! An operation is recorded on the shard (`pending_op`) together with a release request.
//! The owner hears the request on its next commit or poll, finishes the batch in flight and
//! releases the shard. Once the shard is unowned, the leader performs the operation in one
//! control-database transaction that checks the fence it saw (no new owner slipped in):
//! - **move**: the shard is reserved for the target worker for 30 s, which acquires it first;
//! - **split at K**: the parent is retired and two children `[lo, K)`, `[K, hi)` get new ids;
//! - **merge**: both parents are retired and one child covers both ranges.
//!
//! Children's cursors come from the parents' committed cursors, never from anything
//! uncommitted, so a child re-reads at worst what a parent had read but not committed
//! (idempotent: versioned upserts, ledgered batches), and never skips a row:
//! - snapshot (and append), split: the child holding the parent's last key continues after
//!   it; the child wholly below it has finished its snapshot (it starts incremental at the
//!   epoch's start bound H0); the child wholly above it starts from its beginning;
//! - incremental, split: both children continue from the parent's cursor;
//! - merge: the lower of the two positions (snapshot before incremental; the first shard's key
//!   position in the snapshot; the lower watermark, between cycles, in the incremental phase).
//!
//! Staged batches of a retired parent are abandoned (a parent's batch is never committed
//! after its children exist; its rows, if applied, are re-read by the children).

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::Row;
use tidemark_common::cursor::{Cursor, KeyValue, Position, ShardRange};
use tidemark_common::pg::TableSql;
use tidemark_common::source::{SourcePool, SourceReads};

use crate::batches::{self, Staged};
use crate::capacity::Capacity;
use crate::checkpoints::{ControlDb, ShardKey};
use crate::error::CoordinatorError;
use crate::leader::Leadership;
use crate::leases::Leases;
use crate::planner::PreparedTask;
use crate::planner::{connect_source, table_sql};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ShardOp {
    Split { at: KeyValue },
    Merge { with: u32 },
    Move { to: String },
}

impl ShardOp {
    pub fn describe(&self) -> String {
        match self {
            ShardOp::Split { at } => format!("split at {}", at.value),
            ShardOp::Merge { with } => format!("merge with shard {with}"),
            ShardOp::Move { to } => format!("move to {to}"),
        }
    }
}

/// One shard as `shards list` shows it.
#[derive(Debug, Clone)]
pub struct ShardRow {
    pub key: ShardKey,
    pub range: ShardRange,
    pub phase: String,
    pub cursor: Cursor,
    pub rows_applied: u64,
    pub fence: u64,
    pub pending_op: Option<ShardOp>,
    pub reserved_for: Option<String>,
}

#[derive(Debug, Clone)]
pub struct WorkerRow {
    pub id: String,
    pub lease_id: i64,
    pub draining: bool,
    pub seconds_since_seen: f64,
}

/// How long a moved shard is reserved for its new worker.
const MOVE_RESERVATION: Duration = Duration::from_secs(30);

fn bad(message: String) -> CoordinatorError {
    CoordinatorError::InvalidRequest(message)
}

impl ControlDb {
    /// The current epoch's live shards (of one task, or all).
    pub async fn list_shards(&self, task: Option<&str>) -> Result<Vec<ShardRow>, CoordinatorError> {
        self.shards_where(task, false).await
    }

    /// The current epoch's live shards with an operation pending: the operations loop's
    /// work, found without reading every shard's row (at 50,000 shards, reading and decoding
    /// them all took most of a round of 2-8 s, issue 20).
    pub async fn shards_with_ops(&self) -> Result<Vec<ShardRow>, CoordinatorError> {
        self.shards_where(None, true).await
    }

    async fn shards_where(
        &self,
        task: Option<&str>,
        pending_ops_only: bool,
    ) -> Result<Vec<ShardRow>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            let mut shards = lite.list_shards(task).await?;
            shards.retain(|shard| !pending_ops_only || shard.pending_op.is_some());
            return Ok(shards);
        }
        let rows = sqlx::query(
            "SELECT c.task, c.epoch, c.shard_id, c.range, c.phase, c.cursor, c.rows_applied, c.fence, c.pending_op, \
             CASE WHEN c.reserved_until > now() THEN c.reserved_for END \
             FROM checkpoints c JOIN tasks t ON t.name = c.task AND t.current_epoch = c.epoch \
             WHERE NOT c.retired AND ($1::text IS NULL OR c.task = $1) AND (NOT $2 OR c.pending_op IS NOT NULL) \
             ORDER BY c.task, c.shard_id",
        )
        .bind(task)
        .bind(pending_ops_only)
        .fetch_all(self.pool())
        .await?;
        crate::off_runtime::run(move || {
            rows.into_iter()
                .map(|row| {
                    let range: serde_json::Value = row.get(3);
                    let cursor: serde_json::Value = row.get(5);
                    let op: Option<serde_json::Value> = row.get(8);
                    Ok(ShardRow {
                        key: ShardKey::from_pg_row(&row),
                        range: serde_json::from_value(range).map_err(|e| bad(format!("stored range: {e}")))?,
                        phase: row.get(4),
                        cursor: Cursor::from_value(&cursor).map_err(|e| bad(e.to_string()))?,
                        rows_applied: row.get::<i64, _>(6) as u64,
                        fence: row.get::<i64, _>(7) as u64,
                        pending_op: op.and_then(|v| serde_json::from_value(v).ok()),
                        reserved_for: row.get(9),
                    })
                })
                .collect()
        })
        .await
    }

    async fn shard_row(&self, task: &str, shard_id: u32) -> Result<ShardRow, CoordinatorError> {
        self.list_shards(Some(task))
            .await?
            .into_iter()
            .find(|s| s.key.shard_id == shard_id)
            .ok_or_else(|| bad(format!("task {task} has no shard {shard_id} in its current epoch")))
    }

    /// Records an operation on a shard and asks its owner to release it.
    async fn request_op(&self, shard: &ShardKey, op: &ShardOp) -> Result<(), CoordinatorError> {
        let updated = match self.lite() {
            Some(lite) => u64::from(lite.request_op(shard, op).await?),
            None => self.request_op_pg(shard, op).await?,
        };
        if updated == 0 {
            return Err(bad(format!(
                "shard {} of task {} already has an operation pending",
                shard.shard_id, shard.task
            )));
        }
        Ok(())
    }

    async fn request_op_pg(&self, shard: &ShardKey, op: &ShardOp) -> Result<u64, CoordinatorError> {
        Ok(sqlx::query(
            "UPDATE checkpoints SET pending_op = $4, release_requested = true \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND NOT retired AND pending_op IS NULL",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32)
        .bind(serde_json::to_value(op).expect("op serializes"))
        .execute(self.pool())
        .await?
        .rows_affected())
    }

    /// Forgets a shard's operation and its release request.
    async fn clear_op(&self, shard: &ShardKey) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.clear_op(shard).await;
        }
        sqlx::query(
            "UPDATE checkpoints SET pending_op = NULL, release_requested = false \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// A move's last step: the unowned shard (still at `fence`) is reserved for worker `to`
    /// for `MOVE_RESERVATION`; false when it changed since it was seen.
    async fn reserve_for(&self, shard: &ShardKey, fence: u64, to: &str) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.reserve_for(shard, fence, to, MOVE_RESERVATION).await;
        }
        let done = sqlx::query(
            "UPDATE checkpoints SET pending_op = NULL, release_requested = false, reserved_for = $4, \
             reserved_until = now() + make_interval(secs => $6) \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence = $5 AND NOT retired",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i32)
        .bind(to)
        .bind(fence as i64)
        .bind(MOVE_RESERVATION.as_secs_f64())
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(done == 1)
    }

    pub async fn register_worker_row(&self, id: &str, lease_id: i64) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.register_worker_row(id, lease_id).await;
        }
        sqlx::query(
            "INSERT INTO workers (id, lease_id) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE \
             SET lease_id = EXCLUDED.lease_id, last_seen = now(), registered_at = now()",
        )
        .bind(id)
        .bind(lease_id)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    pub async fn workers_seen(&self, ids: &[String]) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.workers_seen(ids).await;
        }
        sqlx::query("UPDATE workers SET last_seen = now() WHERE id = ANY($1)")
            .bind(ids)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    pub async fn worker_draining(&self, id: &str) -> Result<bool, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.worker_draining(id).await;
        }
        Ok(sqlx::query_scalar("SELECT draining FROM workers WHERE id = $1")
            .bind(id)
            .fetch_optional(self.pool())
            .await?
            .unwrap_or(false))
    }

    pub async fn list_workers(&self) -> Result<Vec<WorkerRow>, CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.list_workers().await;
        }
        let rows = sqlx::query(
            "SELECT id, lease_id, draining, extract(epoch from now() - last_seen)::float8 FROM workers ORDER BY id",
        )
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| WorkerRow {
                id: row.get(0),
                lease_id: row.get(1),
                draining: row.get(2),
                seconds_since_seen: row.get(3),
            })
            .collect())
    }

    /// Marks a worker draining: it gets no new shard, and each of its shards is asked back.
    pub async fn drain_worker(&self, id: &str) -> Result<(), CoordinatorError> {
        let updated = match self.lite() {
            Some(lite) => u64::from(lite.drain_worker(id).await?),
            None => sqlx::query("UPDATE workers SET draining = true WHERE id = $1")
                .bind(id)
                .execute(self.pool())
                .await?
                .rows_affected(),
        };
        if updated == 0 {
            return Err(bad(format!("no worker {id:?} has registered")));
        }
        Ok(())
    }

    /// Asks the owner of these shards to release them (no operation: anyone may take them).
    pub async fn request_release(&self, shards: &[ShardKey]) -> Result<(), CoordinatorError> {
        if let Some(lite) = self.lite() {
            return lite.request_release(shards).await;
        }
        for shard in shards {
            sqlx::query(
                "UPDATE checkpoints SET release_requested = true WHERE task = $1 AND epoch = $2 AND shard_id = $3",
            )
            .bind(&shard.task)
            .bind(shard.epoch as i64)
            .bind(shard.shard_id as i32)
            .execute(self.pool())
            .await?;
        }
        Ok(())
    }
}

/// `shards split`: validates the split point (strictly inside the range, in the source's own
/// ordering) and records the operation. Without `at`, the median key of the range.
pub async fn request_split(
    control: &ControlDb,
    task: &PreparedTask,
    shard_id: u32,
    at: Option<String>,
) -> Result<String, CoordinatorError> {
    let name = task.config.name.as_str();
    let shard = control.shard_row(name, shard_id).await?;
    let key_type = first_key_type(task)?;
    let (source, sql, reads) = source_reads(task).await?;
    let at = match at {
        Some(value) => value,
        None => source
            .median_key(&reads, &sql, &shard.range)
            .await
            .map_err(CoordinatorError::Source)?
            .ok_or_else(|| bad(format!("shard {shard_id} holds no rows; give --at")))?,
    };
    let at = KeyValue {
        sql_type: key_type,
        value: at,
    };
    // Strictly inside the range, in the key column's own order (its collation on MySQL).
    let checked = async {
        let above_lo = match &shard.range.lo {
            Some(lo) => source.key_less(&reads, &sql, lo, &at).await?,
            None => true,
        };
        let below_hi = match &shard.range.hi {
            Some(hi) => source.key_less(&reads, &sql, &at, hi).await?,
            None => true,
        };
        Ok::<bool, sqlx::Error>(above_lo && below_hi)
    };
    let inside = checked
        .await
        .map_err(|e| bad(format!("split point {:?}: {e}", at.value)))?;
    source.close().await;
    if !inside {
        return Err(bad(format!(
            "split point {} is not strictly inside shard {shard_id}'s range {}",
            at.value,
            shard.range.describe()
        )));
    }
    let op = ShardOp::Split { at };
    control.request_op(&shard.key, &op).await?;
    Ok(format!("shard {shard_id}: {} requested", op.describe()))
}

/// `shards merge`: the two shards must be adjacent (`a.hi == b.lo`, in either order).
pub async fn request_merge(control: &ControlDb, task: &str, a: u32, b: u32) -> Result<String, CoordinatorError> {
    let (first, second) = {
        let x = control.shard_row(task, a).await?;
        let y = control.shard_row(task, b).await?;
        if x.range.hi.is_some() && x.range.hi == y.range.lo {
            (x, y)
        } else if y.range.hi.is_some() && y.range.hi == x.range.lo {
            (y, x)
        } else {
            return Err(bad(format!(
                "shards {a} ({}) and {b} ({}) are not adjacent",
                x.range.describe(),
                y.range.describe()
            )));
        }
    };
    control
        .request_op(
            &first.key,
            &ShardOp::Merge {
                with: second.key.shard_id,
            },
        )
        .await?;
    // The second shard is only asked back; the operation lives on the first.
    if let Err(error) = control
        .request_op(
            &second.key,
            &ShardOp::Merge {
                with: first.key.shard_id,
            },
        )
        .await
    {
        control.clear_op(&first.key).await?;
        control.candidates_changed();
        return Err(error);
    }
    Ok(format!("shards {a} and {b}: merge requested"))
}

pub async fn request_move(
    control: &ControlDb,
    task: &str,
    shard_id: u32,
    to: &str,
) -> Result<String, CoordinatorError> {
    let workers = control.list_workers().await?;
    if !workers.iter().any(|w| w.id == to && !w.draining) {
        return Err(bad(format!("no live, non-draining worker {to:?}")));
    }
    let shard = control.shard_row(task, shard_id).await?;
    let op = ShardOp::Move { to: to.to_string() };
    control.request_op(&shard.key, &op).await?;
    Ok(format!("shard {shard_id}: {} requested", op.describe()))
}

fn first_key_type(task: &PreparedTask) -> Result<String, CoordinatorError> {
    task.columns
        .iter()
        .find(|c| c.name == task.config.key[0])
        .map(|c| c.sql_type.clone())
        .ok_or_else(|| bad("the first key column is not in the epoch's columns".into()))
}

/// The leader's loop: performs operations on released shards, asks draining workers' shards
/// back, and (with `balance`) evens shards per worker by moves.
pub async fn run_operations(
    control: ControlDb,
    leases: Leases,
    tasks: HashMap<String, PreparedTask>,
    leadership: Leadership,
    balance: bool,
    capacity: Capacity,
) {
    let mut took = Duration::ZERO;
    loop {
        tokio::time::sleep(crate::pacing::wait_after(Duration::from_millis(500), took)).await;
        let started = std::time::Instant::now();
        // Every replica notes which shards wait (for its `status`); the leader acts.
        let observed = async {
            let running = control.running_shards().await?;
            let owners = leases.owners().await?;
            capacity.observe(&running, |key| owners.contains_key(key));
            Ok::<_, CoordinatorError>((running, owners))
        }
        .await;
        if !leadership.is_leader() {
            took = started.elapsed();
            crate::metrics::observe_scan("operations", took);
            continue;
        }
        let result = async {
            let (running, owners) = observed?;
            operate(&control, &leases, &tasks, balance, &owners).await?;
            crate::capacity::rotate(
                &control,
                &capacity,
                &running,
                |key| owners.contains_key(key),
                leases.ttl(),
            )
            .await
        }
        .await;
        if let Err(error) = result {
            tracing::warn!(%error, "shard operations: retrying");
        }
        took = started.elapsed();
        crate::metrics::observe_scan("operations", took);
    }
}

/// `owners`: the lease store's, read in the same round.
async fn operate(
    control: &ControlDb,
    leases: &Leases,
    tasks: &HashMap<String, PreparedTask>,
    balance: bool,
    owners: &HashMap<ShardKey, (String, u64)>,
) -> Result<(), CoordinatorError> {
    let shards = control.shards_with_ops().await?;
    let workers = control.list_workers().await?;
    let ttl = leases.ttl().as_secs_f64();
    let draining: Vec<&str> = workers.iter().filter(|w| w.draining).map(|w| w.id.as_str()).collect();
    let drained: Vec<ShardKey> = owners
        .iter()
        .filter(|(_, (worker, _))| draining.contains(&worker.as_str()))
        .map(|(shard, _)| shard.clone())
        .collect();
    if !drained.is_empty() {
        control.request_release(&drained).await?;
    }
    let mut pending_move = false;
    for shard in &shards {
        let Some(op) = &shard.pending_op else { continue };
        pending_move |= matches!(op, ShardOp::Move { .. });
        if owners.contains_key(&shard.key) {
            continue;
        }
        let Some(task) = tasks.get(&shard.key.task) else {
            continue;
        };
        match op {
            ShardOp::Move { to } => {
                if control.reserve_for(&shard.key, shard.fence, to).await? {
                    control.candidates_changed();
                    // When the reservation runs out, any worker may take the shard.
                    let control = control.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(MOVE_RESERVATION).await;
                        control.candidates_changed();
                    });
                    tracing::info!(task = %shard.key.task, shard = shard.key.shard_id, to = %to, "shard reserved for its new worker");
                }
            }
            ShardOp::Split { at } => {
                split(control, task, shard, at).await?;
                control.candidates_changed();
            }
            ShardOp::Merge { with } => {
                // Its partner has no operation of its own.
                let Some(other) = control
                    .list_shards(Some(&shard.key.task))
                    .await?
                    .into_iter()
                    .find(|s| s.key.shard_id == *with)
                else {
                    continue;
                };
                if owners.contains_key(&other.key) {
                    continue;
                }
                // Performed once, from the lower of the two.
                if shard.range.hi.is_some() && shard.range.hi == other.range.lo {
                    merge(control, task, shard, &other).await?;
                    control.candidates_changed();
                }
            }
        }
    }
    if balance && !pending_move {
        // Moves are performed on the current epoch's shards only (`shards_with_ops`).
        let shards = control.list_shards(None).await?;
        rebalance(control, owners, &workers, ttl, &shards).await?;
    }
    Ok(())
}

/// Moves one shard from the busiest live worker to the idlest when they differ by two or more.
async fn rebalance(
    control: &ControlDb,
    owners: &HashMap<ShardKey, (String, u64)>,
    workers: &[WorkerRow],
    ttl: f64,
    shards: &[ShardRow],
) -> Result<(), CoordinatorError> {
    let live: Vec<&WorkerRow> = workers
        .iter()
        .filter(|w| !w.draining && w.seconds_since_seen < ttl)
        .collect();
    if live.len() < 2 {
        return Ok(());
    }
    // Counted in one pass: once per worker, it was workers × shards comparisons.
    let mut held: HashMap<&str, usize> = HashMap::new();
    for (worker, _) in owners.values() {
        *held.entry(worker.as_str()).or_default() += 1;
    }
    let count = |id: &str| held.get(id).copied().unwrap_or(0);
    let busiest = live.iter().max_by_key(|w| count(&w.id)).expect("non-empty");
    let idlest = live.iter().min_by_key(|w| count(&w.id)).expect("non-empty");
    if count(&busiest.id) < count(&idlest.id) + 2 {
        return Ok(());
    }
    let Some(shard) = shards
        .iter()
        .find(|s| s.pending_op.is_none() && owners.get(&s.key).is_some_and(|(w, _)| w == &busiest.id))
    else {
        return Ok(());
    };
    let op = ShardOp::Move { to: idlest.id.clone() };
    if control.request_op(&shard.key, &op).await.is_ok() {
        tracing::info!(task = %shard.key.task, shard = shard.key.shard_id, from = %busiest.id, to = %idlest.id, "balancing: moving a shard");
    }
    Ok(())
}

/// The task's source, its statements and how the source reads them (split points are
/// compared there).
async fn source_reads(task: &PreparedTask) -> Result<(SourcePool, TableSql, SourceReads), CoordinatorError> {
    let source = connect_source(&task.config).await?;
    let sql = table_sql(task)?;
    let reads = source
        .reads_for(&sql)
        .await
        .map_err(CoordinatorError::Source)?
        .map_err(|reason| bad(format!("schema changed: {reason}")))?;
    Ok((source, sql, reads))
}

/// The first key column's value of a key-paged cursor.
fn key_position(cursor: &Cursor) -> Option<&KeyValue> {
    cursor.key_position().and_then(|k| k.first())
}

async fn split(
    control: &ControlDb,
    task: &PreparedTask,
    shard: &ShardRow,
    at: &KeyValue,
) -> Result<(), CoordinatorError> {
    let epoch = control
        .current_epoch(&shard.key.task)
        .await?
        .ok_or_else(|| bad("no epoch".into()))?;
    let (low_cursor, high_cursor) = match &shard.cursor.position {
        Position::Snapshot { .. } | Position::Append { .. } => match key_position(&shard.cursor) {
            None => (shard.cursor.clone(), shard.cursor.clone()),
            Some(last) => {
                let (source, sql, reads) = source_reads(task).await?;
                let below = source
                    .key_less(&reads, &sql, last, at)
                    .await
                    .map_err(CoordinatorError::Source)?;
                source.close().await;
                let start = match shard.cursor.position {
                    Position::Snapshot { .. } => Cursor::snapshot_start(shard.key.epoch),
                    _ => Cursor::new(shard.key.epoch, Position::Append { after_key: None }),
                };
                if below {
                    (shard.cursor.clone(), start)
                } else {
                    let finished = match shard.cursor.position {
                        Position::Snapshot { .. } => epoch.incremental_start.clone(),
                        // An append child below the last key read has read everything it holds.
                        _ => shard.cursor.clone(),
                    };
                    (finished, shard.cursor.clone())
                }
            }
        },
        Position::Incremental { .. } => (shard.cursor.clone(), shard.cursor.clone()),
    };
    let children = [
        (
            ShardRange {
                lo: shard.range.lo.clone(),
                hi: Some(at.clone()),
            },
            low_cursor,
        ),
        (
            ShardRange {
                lo: Some(at.clone()),
                hi: shard.range.hi.clone(),
            },
            high_cursor,
        ),
    ];
    replace_shards(control, &[shard], &children).await
}

/// The lower of two cursors of adjacent shards (`low` holds the lower keys).
fn merged_cursor(low: &Cursor, high: &Cursor) -> Cursor {
    match (&low.position, &high.position) {
        (Position::Incremental { floor_micros: a, .. }, Position::Incremental { floor_micros: b, .. }) => {
            Cursor::incremental_at(low.epoch, (*a).min(*b))
        }
        (Position::Incremental { .. }, _) => high.clone(),
        _ => low.clone(),
    }
}

async fn merge(
    control: &ControlDb,
    _task: &PreparedTask,
    low: &ShardRow,
    high: &ShardRow,
) -> Result<(), CoordinatorError> {
    let range = ShardRange {
        lo: low.range.lo.clone(),
        hi: high.range.hi.clone(),
    };
    replace_shards(
        control,
        &[low, high],
        &[(range, merged_cursor(&low.cursor, &high.cursor))],
    )
    .await
}

/// Retires `parents` (checking that none was claimed since it was seen) and inserts the
/// children with new shard ids, moving pending reconciliation parts to them.
async fn replace_shards(
    control: &ControlDb,
    parents: &[&ShardRow],
    children: &[(ShardRange, Cursor)],
) -> Result<(), CoordinatorError> {
    let task = &parents[0].key.task;
    let epoch = parents[0].key.epoch;
    if let Some(lite) = control.lite() {
        let seen: Vec<(u32, u64)> = parents.iter().map(|p| (p.key.shard_id, p.fence)).collect();
        if let Some(child_ids) = lite.replace_shards(task, epoch, &seen, children).await? {
            tracing::info!(task = %task, parents = ?seen, children = ?child_ids, "shards replaced");
        }
        return Ok(());
    }
    let mut tx = control.pool().begin().await?;
    for parent in parents {
        let retired = sqlx::query(
            "UPDATE checkpoints SET retired = true, pending_op = NULL, release_requested = false, updated_at = now() \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence = $4 AND NOT retired",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(parent.key.shard_id as i32)
        .bind(parent.fence as i64)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if retired != 1 {
            // Claimed (or changed) since we looked: try again on the next round.
            tx.rollback().await?;
            return Ok(());
        }
    }
    let parent_ids: Vec<i32> = parents.iter().map(|p| p.key.shard_id as i32).collect();
    batches::abandon(
        &mut tx,
        Staged::Shards {
            task,
            epoch,
            shard_ids: &parent_ids,
        },
    )
    .await?;
    let mut next_id: i32 =
        sqlx::query_scalar("SELECT max(shard_id) + 1 FROM checkpoints WHERE task = $1 AND epoch = $2")
            .bind(task)
            .bind(epoch as i64)
            .fetch_one(&mut *tx)
            .await?;
    let mut child_ids = Vec::new();
    for (range, cursor) in children {
        let phase = if cursor.is_incremental() {
            "INCREMENTAL"
        } else {
            "SNAPSHOT"
        };
        sqlx::query(
            "INSERT INTO checkpoints (task, epoch, shard_id, range, phase, cursor) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(next_id)
        .bind(serde_json::from_str::<serde_json::Value>(&range.encode()).expect("range is JSON"))
        .bind(phase)
        .bind(serde_json::to_value(cursor).expect("cursor serializes"))
        .execute(&mut *tx)
        .await?;
        child_ids.push(next_id);
        next_id += 1;
    }
    for child in &child_ids {
        sqlx::query(
            "INSERT INTO reconcile_shards (run_id, shard_id, state) SELECT DISTINCT run_id, $2, 'PENDING' \
             FROM reconcile_shards s JOIN reconcile_runs r ON r.id = s.run_id \
             WHERE r.task = $1 AND s.shard_id = ANY($3) AND s.state = 'PENDING' ON CONFLICT DO NOTHING",
        )
        .bind(task)
        .bind(child)
        .bind(&parent_ids)
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query(
        "DELETE FROM reconcile_shards s USING reconcile_runs r WHERE r.id = s.run_id AND r.task = $1 \
         AND s.shard_id = ANY($2) AND s.state = 'PENDING'",
    )
    .bind(task)
    .bind(&parent_ids)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::info!(task = %task, parents = ?parent_ids, children = ?child_ids, "shards replaced");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_cursor_is_the_lower_position() {
        let snap = |v: Option<&str>| {
            Cursor::new(
                1,
                Position::Snapshot {
                    after_key: v.map(|v| {
                        vec![KeyValue {
                            sql_type: "bigint".into(),
                            value: v.into(),
                        }]
                    }),
                },
            )
        };
        let inc = |t| Cursor::incremental_at(1, t);
        assert_eq!(merged_cursor(&snap(Some("5")), &snap(Some("50"))), snap(Some("5")));
        assert_eq!(merged_cursor(&inc(10), &snap(Some("50"))), snap(Some("50")));
        assert_eq!(merged_cursor(&snap(None), &inc(10)), snap(None));
        assert_eq!(merged_cursor(&inc(30), &inc(10)), inc(10));
    }
}
