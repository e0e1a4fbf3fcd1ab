//! Applying a batch to the target: ONE transaction that writes its rows (the versioned upsert
//! through a session-local stage table, or an accumulate task's deltas), its dead letters and
//! the ledger row. A batch already in the ledger is not applied again.
//!
//! A row the target rejects (a value its column type refuses, an overflow, a NUL character, a
//! constraint) fails the whole statement. The batch is then applied again in a new transaction
//! that isolates such rows by bisection: halves are written under savepoints, a failing half is
//! split again, and a failing single row becomes a dead letter. The rest of the batch, its dead
//! letters and the ledger row commit together, so the shard moves past the bad rows without
//! losing them.
//!
//! A binary batch (see `page_format`) also checks, inside its transaction and after its
//! writes, that the target's column types are still the ones its bytes were read as.

mod mysql;
mod postgres;

use bytes::Bytes;
use tidemark_common::batch::Manifest;
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::dead_letters::{self, DeadLetter, Layout};
use tidemark_common::pg::TableSql;
use tidemark_common::target::TargetPool;
use tidemark_common::transform::{AccumulateSpec, DeltaKey, Deltas, RowError, RowTransform};
use tidemark_common::write::WriteError;

use crate::error::WorkerError;

/// A target transaction as the batch protocol uses it. Each engine's is in its own file
/// (`apply/postgres.rs`, `apply/mysql.rs`); everything else here is the protocol, the same
/// for every engine.
pub(crate) trait TargetTx: Sized + Send {
    type Pool: Sync;

    /// The engine's pool inside a target pool, when the target is of this engine.
    fn pool_of(target: &TargetPool) -> Option<&Self::Pool>;
    /// The ledger's content hash for `batch_id`, if it holds the batch.
    async fn ledger_hash(pool: &Self::Pool, batch_id: &str) -> Result<Option<String>, sqlx::Error>;

    /// The batch's transaction and the task's live epoch in the target (its fence, read under
    /// the epoch lock that the switch takes exclusively), or `None` when the ledger already
    /// holds the batch. A batch of an epoch older than the live one is refused here, in the
    /// target, where its rows would go: its shard can no longer commit, and its table is
    /// retained or gone.
    async fn begin_unless_applied(
        pool: &Self::Pool,
        manifest: &Manifest,
    ) -> Result<Option<(Self, Option<u64>)>, WorkerError>;
    /// The ledger holds the batch with the manifest's row count and content.
    async fn verify(pool: &Self::Pool, manifest: &Manifest) -> Result<(), WorkerError>;
    async fn savepoint(&mut self) -> Result<(), sqlx::Error>;
    /// Keeps (`keep`) or undoes the savepoint's work, and drops the savepoint.
    async fn end_savepoint(&mut self, keep: bool) -> Result<(), sqlx::Error>;
    /// Writes a COPY stream (in the batch's layout and format) with the versioned upsert;
    /// `overlap = (floor, high)` also reports the lateness of rows below the watermark that
    /// the target lacks. Returns the rows written and the lateness.
    async fn upsert(
        &mut self,
        batch: &BatchToApply<'_>,
        data: &[u8],
        overlap: Option<(i64, i64)>,
    ) -> Result<(u64, Vec<i64>), WriteError>;
    /// Between two upserts of one transaction.
    async fn clear_stage(&mut self, sql: &TableSql) -> Result<(), sqlx::Error>;
    async fn accumulate(&mut self, sql: &TableSql, spec: &AccumulateSpec, deltas: &Deltas) -> Result<(), WriteError>;
    /// The engine's fast path for a batch whose keys the target does not hold yet; `false`
    /// when it does not apply (nothing written).
    async fn write_fresh(&mut self, batch: &BatchToApply<'_>) -> Result<bool, WorkerError>;
    /// A binary batch: the target's columns still have the types its bytes were read as.
    async fn check_types(&mut self, batch: &BatchToApply<'_>) -> Result<(), WorkerError>;
    async fn insert_dead_letters(
        &mut self,
        batch: &BatchToApply<'_>,
        letters: &[DeadLetter],
    ) -> Result<(), sqlx::Error>;
    /// The ledger row; 0 when another owner's transaction wrote it first.
    async fn insert_ledger(&mut self, manifest: &Manifest, dead_letters: u64) -> Result<u64, sqlx::Error>;
    async fn commit(self) -> Result<(), sqlx::Error>;
    async fn rollback(self) -> Result<(), sqlx::Error>;
}

#[derive(Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    Applied,
    /// The ledger already held this batch (a replay after a crash, or a concurrent owner).
    AlreadyApplied,
}

/// What applying a batch did.
#[derive(Debug)]
pub struct Applied {
    pub outcome: ApplyOutcome,
    /// The lateness of each late row the batch brought in (microseconds).
    pub late: Vec<i64>,
    /// Rows that went to the dead letters.
    pub dead_letters: u64,
}

impl Applied {
    fn already() -> Applied {
        Applied {
            outcome: ApplyOutcome::AlreadyApplied,
            late: Vec::new(),
            dead_letters: 0,
        }
    }
}

/// How a task writes its rows.
#[derive(Debug, Clone)]
pub enum TaskWrite {
    /// The versioned upsert (upsert and append modes).
    Upsert,
    /// Transform each row and add the batch's deltas to the running totals.
    Accumulate {
        spec: AccumulateSpec,
        transform: RowTransform,
    },
}

/// The overlap region of an incremental batch: rows below `floor_micros` were re-read by the
/// overlap, and those the target lacks at their version are late (lateness measured against
/// the cycle's `high_micros`).
#[derive(Debug, Clone, Copy)]
pub struct OverlapRegion {
    pub floor_micros: i64,
    pub high_micros: i64,
}

/// One batch as the apply sees it.
#[derive(Clone, Copy)]
pub struct BatchToApply<'a> {
    pub sql: &'a TableSql,
    pub write: &'a TaskWrite,
    pub manifest: &'a Manifest,
    pub data: &'a Bytes,
    /// The data's COPY format, as the manifest names it.
    pub format: CopyFormat,
    pub overlap: Option<OverlapRegion>,
    /// The task's `max_dead_letter_ratio` (see [`dead_letters::limit`]).
    pub max_dead_letter_ratio: f64,
}

impl<'a> BatchToApply<'a> {
    /// The batch writing the table `sql` names (an epoch's own table), or as it is.
    fn routed(&self, sql: Option<&'a TableSql>) -> BatchToApply<'a> {
        BatchToApply {
            sql: sql.unwrap_or(self.sql),
            ..*self
        }
    }

    fn layout(&self) -> Layout {
        Layout {
            target_layout: self.manifest.target_layout,
            repair: self.manifest.repair,
            format: self.format,
        }
    }

    /// The batch's rows, each a text line or a binary tuple.
    fn rows(&self) -> Result<Vec<&[u8]>, WorkerError> {
        self.format
            .rows(self.data)
            .map_err(|e| WorkerError::Data(format!("batch {}: {e}", self.manifest.batch_id)))
    }

    fn overlap(&self) -> Option<(i64, i64)> {
        self.overlap.map(|o| (o.floor_micros, o.high_micros))
    }

    /// Refuses the batch when the target rejected more of its rows than the task allows
    /// (`rejected` counts target rejections only, not rows the transform refused).
    fn check_rejected(&self, rows: usize, rejected: usize, first: Option<&DeadLetter>) -> Result<(), WorkerError> {
        if rejected <= dead_letters::limit(rows, self.max_dead_letter_ratio) {
            return Ok(());
        }
        let first = first
            .map(|letter| format!("; first: {}", letter.describe()))
            .unwrap_or_default();
        Err(WorkerError::TargetRejects(format!(
            "batch {}: the target rejected more than {} of its {rows} rows (max_dead_letter_ratio){first}",
            self.manifest.batch_id,
            dead_letters::limit(rows, self.max_dead_letter_ratio)
        )))
    }

    fn dead_letter(&self, row: &[u8], error: RowError) -> DeadLetter {
        DeadLetter {
            key: dead_letters::row_key(self.sql, self.format, row),
            payload: row.to_vec(),
            error,
        }
    }
}

/// Whether an apply error is a row the target refuses (the batch is then applied again with
/// the bad rows isolated).
fn is_row_error(error: &WorkerError) -> bool {
    match error {
        WorkerError::Database(error) => dead_letters::row_error_class(error).is_some(),
        WorkerError::Row(_) => true,
        _ => false,
    }
}

impl From<WriteError> for WorkerError {
    fn from(error: WriteError) -> WorkerError {
        match error {
            WriteError::Database(error) => WorkerError::Database(error),
            WriteError::Row(error) => WorkerError::Row(error),
        }
    }
}

/// The target engines this worker applies batches to, one line each: runs
/// `function::<Tx>(pool, args…)` with the transaction type of `target`'s engine.
macro_rules! on_target {
    ($target:expr, $function:ident($($arg:expr),*)) => {
        if let Some(pool) = postgres::PgTx::pool_of($target) {
            $function::<postgres::PgTx>(pool, $($arg),*).await
        } else if let Some(pool) = mysql::MySqlTx::pool_of($target) {
            $function::<mysql::MySqlTx>(pool, $($arg),*).await
        } else {
            Err(WorkerError::Assignment(format!(
                "this worker cannot apply batches to a {} target",
                $target.engine().name
            )))
        }
    };
}

async fn ledger_hash<T: TargetTx>(pool: &T::Pool, batch_id: &str) -> Result<Option<String>, WorkerError> {
    Ok(T::ledger_hash(pool, batch_id).await?)
}

/// Applies a batch.
pub async fn apply_batch(target: &TargetPool, batch: &BatchToApply<'_>) -> Result<Applied, WorkerError> {
    on_target!(target, apply_with(batch))
}

async fn apply_with<T: TargetTx>(target: &T::Pool, batch: &BatchToApply<'_>) -> Result<Applied, WorkerError> {
    if matches!(batch.write, TaskWrite::Accumulate { .. }) && batch.format != CopyFormat::Text {
        // The transform reads text fields; the worker never stages an accumulate task in binary.
        return Err(WorkerError::Data(format!(
            "batch {}: an accumulate task's batch must be COPY text",
            batch.manifest.batch_id
        )));
    }
    let attempt = match apply_once::<T>(target, batch).await {
        Err(error) if is_row_error(&error) => {
            tracing::warn!(batch_id = %batch.manifest.batch_id, %error,
                "the target rejected a row; isolating the bad rows by bisection");
            apply_isolating::<T>(target, batch).await
        }
        other => other,
    };
    match attempt {
        Ok(applied) => {
            crate::metrics::step("verify", T::verify(target, batch.manifest)).await?;
            Ok(applied)
        }
        Err(error) => {
            // The outcome of a failed COMMIT is unknown: the ledger is the one answer.
            if T::verify(target, batch.manifest).await.is_ok() {
                tracing::warn!(batch_id = %batch.manifest.batch_id, %error, "apply reported an error but the ledger holds the batch");
                return Ok(Applied::already());
            }
            Err(error)
        }
    }
}

/// Each row's delta keys, and the rows the transform rejects as dead letters.
fn transform_rows<'r>(
    batch: &BatchToApply<'_>,
    transform: &RowTransform,
    rows: impl Iterator<Item = &'r [u8]>,
) -> (Vec<(usize, Vec<DeltaKey>)>, Vec<DeadLetter>) {
    let mut candidates = Vec::new();
    let mut letters = Vec::new();
    for (index, row) in rows.enumerate() {
        match transform.elements(row) {
            Ok(keys) => candidates.push((index, keys)),
            Err(error) => letters.push(batch.dead_letter(row, error)),
        }
    }
    (candidates, letters)
}

/// The whole batch in one go: the fast path, and the only one when no row is bad.
async fn apply_once<T: TargetTx>(target: &T::Pool, batch: &BatchToApply<'_>) -> Result<Applied, WorkerError> {
    let manifest = batch.manifest;
    let Some((mut tx, live)) = T::begin_unless_applied(target, manifest).await? else {
        return Ok(Applied::already());
    };
    let routed = batch.sql.routed(manifest.epoch, live);
    let batch = &batch.routed(routed.as_ref());
    match batch.write {
        TaskWrite::Upsert => {
            if manifest.target_layout && tx.write_fresh(batch).await? {
                return finish(tx, batch, Vec::new(), Vec::new()).await;
            }
            let (copied, late) = tx.upsert(batch, batch.data, batch.overlap()).await?;
            check_count(manifest, copied)?;
            finish(tx, batch, late, Vec::new()).await
        }
        TaskWrite::Accumulate { spec, transform } => {
            let (candidates, letters) = transform_rows(batch, transform, batch.rows()?.into_iter());
            let mut deltas = Deltas::default();
            for (_, keys) in candidates {
                deltas.add(keys);
            }
            tx.accumulate(batch.sql, spec, &deltas).await?;
            finish(tx, batch, Vec::new(), letters).await
        }
    }
}

/// The batch again, bad rows isolated, in one transaction. Upsert: halves of the rows under
/// savepoints until each failing row is alone, then it is a dead letter (with b bad rows
/// among n this writes O(b·log n) subsets). Accumulate: the target rejects a group (a value
/// its column refuses), so the groups are bisected instead, and every row contributing to a
/// rejected group becomes a dead letter; the rest is written in one statement.
async fn apply_isolating<T: TargetTx>(target: &T::Pool, batch: &BatchToApply<'_>) -> Result<Applied, WorkerError> {
    let manifest = batch.manifest;
    let Some((mut tx, live)) = T::begin_unless_applied(target, manifest).await? else {
        return Ok(Applied::already());
    };
    let routed = batch.sql.routed(manifest.epoch, live);
    let batch = &batch.routed(routed.as_ref());
    if batch.format == CopyFormat::Binary {
        // A target column whose type changed rejects binary rows: that is no row's fault.
        tx.check_types(batch).await?;
    }
    let rows = batch.rows()?;
    check_count(manifest, rows.len() as u64)?;
    let (letters, late, attempts) = match batch.write {
        TaskWrite::Upsert => {
            probe_sample(&mut tx, batch, &rows).await?;
            isolate_rows(&mut tx, batch, &rows).await?
        }
        TaskWrite::Accumulate { spec, transform } => isolate_groups(&mut tx, batch, spec, transform, &rows).await?,
    };
    tracing::warn!(
        batch_id = %manifest.batch_id, rows = rows.len(), dead_letters = letters.len(), attempts,
        "bad rows isolated; they go to the dead letters with the rest of the batch"
    );
    finish(tx, batch, late, letters).await
}

/// Before a bisection: writes up to [`dead_letters::SAMPLE_ROWS`] rows spread evenly over the
/// batch, each alone and always undone. When so many are rejected that a rejected share within
/// `max_dead_letter_ratio` is implausible ([`dead_letters::decisive_rejections`]), the batch is
/// refused as a target problem at once, instead of after isolating every rejected row. Stops
/// as soon as the sample can no longer reach that count.
async fn probe_sample<T: TargetTx>(conn: &mut T, batch: &BatchToApply<'_>, rows: &[&[u8]]) -> Result<(), WorkerError> {
    let limit = dead_letters::limit(rows.len(), batch.max_dead_letter_ratio);
    if limit >= rows.len() {
        return Ok(());
    }
    let sample = dead_letters::SAMPLE_ROWS.min(rows.len());
    let needed = dead_letters::decisive_rejections(sample, limit as f64 / rows.len() as f64);
    let mut rejected: Vec<DeadLetter> = Vec::new();
    for probe in 0..sample {
        if rejected.len() + (sample - probe) < needed {
            return Ok(());
        }
        let row = rows[probe * rows.len() / sample];
        conn.savepoint().await?;
        let written = conn.upsert(batch, &batch.format.join([row]), None).await;
        conn.end_savepoint(false).await?;
        if let Err(error) = written {
            let Some(row_error) = error.row_error() else {
                return Err(error.into());
            };
            rejected.push(batch.dead_letter(row, row_error));
        }
        if rejected.len() >= needed {
            return Err(WorkerError::TargetRejects(format!(
                "batch {}: the target rejected {} of {} rows sampled from its {}: more than the {limit} that \
                 max_dead_letter_ratio allows would go to the dead letters; first: {}",
                batch.manifest.batch_id,
                rejected.len(),
                probe + 1,
                rows.len(),
                rejected[0].describe()
            )));
        }
    }
    Ok(())
}

type Isolated = (Vec<DeadLetter>, Vec<i64>, u64);

async fn isolate_rows<T: TargetTx>(
    conn: &mut T,
    batch: &BatchToApply<'_>,
    rows: &[&[u8]],
) -> Result<Isolated, WorkerError> {
    let mut letters = Vec::new();
    let mut late = Vec::new();
    let mut pending = vec![(0, rows.len())];
    let mut attempts = 0u64;
    while let Some((lo, hi)) = pending.pop() {
        if lo >= hi {
            continue;
        }
        attempts += 1;
        let data = batch.format.join(rows[lo..hi].iter().copied());
        conn.savepoint().await?;
        let written = conn.upsert(batch, &data, batch.overlap()).await;
        match written {
            Ok((_, found_late)) => {
                conn.clear_stage(batch.sql).await?;
                conn.end_savepoint(true).await?;
                late.extend(found_late);
            }
            Err(error) => {
                let Some(row_error) = error.row_error() else {
                    return Err(error.into());
                };
                conn.end_savepoint(false).await?;
                if hi - lo == 1 {
                    letters.push(batch.dead_letter(rows[lo], row_error));
                    // Stop as soon as the target is at fault, not after bisecting every row.
                    batch.check_rejected(rows.len(), letters.len(), letters.first())?;
                } else {
                    let mid = lo + (hi - lo) / 2;
                    pending.push((mid, hi));
                    pending.push((lo, mid));
                }
            }
        }
    }
    Ok((letters, late, attempts))
}

async fn isolate_groups<T: TargetTx>(
    conn: &mut T,
    batch: &BatchToApply<'_>,
    spec: &AccumulateSpec,
    transform: &RowTransform,
    rows: &[&[u8]],
) -> Result<Isolated, WorkerError> {
    let (mut candidates, mut letters) = transform_rows(batch, transform, rows.iter().copied());
    let refused_by_transform = letters.len();
    let mut attempts = 0u64;
    loop {
        let mut deltas = Deltas::default();
        for (_, keys) in &candidates {
            deltas.add(keys.iter().cloned());
        }
        attempts += 1;
        conn.savepoint().await?;
        let error = match conn.accumulate(batch.sql, spec, &deltas).await {
            Ok(()) => {
                conn.end_savepoint(true).await?;
                return Ok((letters, Vec::new(), attempts));
            }
            Err(error) if error.row_error().is_some() => error,
            Err(error) => return Err(error.into()),
        };
        conn.end_savepoint(false).await?;
        // Probe halves of the groups (always undone) until each rejected group is alone.
        let entries = deltas.entries();
        let mut rejected: std::collections::HashMap<DeltaKey, RowError> = std::collections::HashMap::new();
        let mut pending = vec![(0, entries.len())];
        while let Some((lo, hi)) = pending.pop() {
            if lo >= hi {
                continue;
            }
            attempts += 1;
            conn.savepoint().await?;
            let probe = conn
                .accumulate(batch.sql, spec, &Deltas::from_entries(entries[lo..hi].iter().copied()))
                .await;
            conn.end_savepoint(false).await?;
            match probe {
                Ok(()) => {}
                Err(error) => {
                    let Some(row_error) = error.row_error() else {
                        return Err(error.into());
                    };
                    if hi - lo == 1 {
                        rejected.insert(entries[lo].0.clone(), row_error);
                    } else {
                        let mid = lo + (hi - lo) / 2;
                        pending.push((mid, hi));
                        pending.push((lo, mid));
                    }
                }
            }
        }
        if rejected.is_empty() {
            // Every group alone is fine, together they are not: not a row's fault.
            return Err(error.into());
        }
        let before = candidates.len();
        candidates.retain(|(index, keys)| match keys.iter().find_map(|k| rejected.get(k)) {
            Some(row_error) => {
                letters.push(batch.dead_letter(rows[*index], row_error.clone()));
                false
            }
            None => true,
        });
        debug_assert!(candidates.len() < before);
        let rejected = &letters[refused_by_transform..];
        batch.check_rejected(rows.len(), rejected.len(), rejected.first())?;
    }
}

fn check_count(manifest: &Manifest, copied: u64) -> Result<(), WorkerError> {
    if copied != manifest.row_count {
        return Err(WorkerError::Data(format!(
            "batch {}: copied {copied} rows, manifest says {}",
            manifest.batch_id, manifest.row_count
        )));
    }
    Ok(())
}

/// Writes the dead letters and the ledger row, and commits (or yields to a concurrent owner
/// that applied the batch).
async fn finish<T: TargetTx>(
    mut tx: T,
    batch: &BatchToApply<'_>,
    late: Vec<i64>,
    letters: Vec<DeadLetter>,
) -> Result<Applied, WorkerError> {
    let manifest = batch.manifest;
    if batch.format == CopyFormat::Binary {
        tx.check_types(batch).await?;
    }
    if !letters.is_empty() {
        tx.insert_dead_letters(batch, &letters).await?;
    }
    let inserted = tx.insert_ledger(manifest, letters.len() as u64).await?;
    tidemark_common::crash::point("in_apply");
    // A zombie frozen here holds row locks in an open transaction; the session's idle
    // transaction timeout (half the lease TTL) ends it for the next owner.
    tidemark_common::crash::stop_point("in_apply");
    if inserted == 0 {
        // Another owner applied it concurrently; its transaction won.
        tx.rollback().await?;
        return Ok(Applied::already());
    }
    tx.commit().await?;
    Ok(Applied {
        outcome: ApplyOutcome::Applied,
        late,
        dead_letters: letters.len() as u64,
    })
}

/// Whether the target's ledger holds `batch_id` with this content: the batch was applied.
pub async fn ledger_holds(target: &TargetPool, batch_id: &str, content_hash: &str) -> Result<bool, WorkerError> {
    let stored = on_target!(target, ledger_hash(batch_id))?;
    Ok(stored.as_deref() == Some(content_hash))
}

/// A batch of an epoch that `tasks reinit` replaced, refused by the target (at `current`).
fn stale_epoch(manifest: &Manifest, current: i64) -> WorkerError {
    WorkerError::Fenced(format!(
        "batch {} of epoch {} refused by the target: task {} is at epoch {current} there",
        manifest.batch_id, manifest.epoch, manifest.task
    ))
}

/// Verification of the ledger row (`row count, content hash`) read for a manifest's batch.
fn check_ledger_row(manifest: &Manifest, row: Option<(i64, String)>) -> Result<(), WorkerError> {
    let (row_count, content_hash) =
        row.ok_or_else(|| WorkerError::Verify(format!("batch {} is not in the ledger", manifest.batch_id)))?;
    if row_count as u64 != manifest.row_count || content_hash != manifest.content_hash {
        return Err(WorkerError::Verify(format!(
            "ledger has batch {} with {row_count} rows / {content_hash}, manifest says {} / {}",
            manifest.batch_id, manifest.row_count, manifest.content_hash
        )));
    }
    Ok(())
}
