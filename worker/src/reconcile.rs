//! Reconciliation of one shard's key range, run by the shard's owner between cycles.
//!
//! Both sides compute, inside their databases, a count and a sum of hashes of `(key, version,
//! content)` (content: every column as text; a run may compare versions only) per bucket of
//! the first key column. Buckets that differ are split again (16 ways) until
//! they hold at most `LEAF_ROWS` rows on either side; only those small ranges are read, as
//! `(key, version)` pairs. Keys whose version differs, that the target lacks, or that only the
//! target has are then repaired through the normal batch protocol: the source rows are read
//! by key and staged (keys the source no longer has become tombstones when the task has a
//! delete policy), registered, applied and committed under the shard's fence like any batch,
//! with `lower == upper` because the cursor does not move.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use bytes::Bytes;
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::copy_text;
use tidemark_common::cursor::{KeyValue, ShardRange};
use tidemark_common::pg::reconcile::{Scope, Side};
use tidemark_common::reconcile_reads::SideReads;
use tidemark_proto::v1 as pb;

use crate::client::CoordinatorClient;
use crate::error::WorkerError;
use crate::pipeline::{PageToDeliver, ShardRun};
use crate::source::read_page;

/// Buckets per split.
const SPLIT: u32 = 16;
/// A range with at most this many rows on each side is compared row by row...
const LEAF_ROWS: i64 = 16;
/// ...and so is one of up to this many rows whose counts differ by a quarter or more (the
/// drift is dense: splitting further would cost more queries than reading it).
const DENSE_LEAF_ROWS: i64 = 4096;

#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub ranges_compared: u64,
    pub rows_read: u64,
    pub keys_repaired: u64,
    pub extra_in_target: u64,
    /// Of the keys repaired, those the shard's watermark had passed (see [`ShardRun::missed`]).
    pub keys_missed: u64,
}

/// Count and hash sum of one bucket on one side.
type Sums = HashMap<i32, (i64, String)>;

/// A key that differs, with the target version the comparison saw (None: absent).
struct Repair {
    key: Vec<KeyValue>,
    expected: Option<i64>,
}

fn is_integer(sql_type: &str) -> bool {
    matches!(sql_type, "bigint" | "integer" | "smallint")
}

impl ShardRun {
    /// Runs one reconciliation order for this shard and reports the result.
    pub async fn reconcile(
        &mut self,
        client: &CoordinatorClient,
        order: &pb::ReconcileOrder,
    ) -> Result<(), WorkerError> {
        let started = Instant::now();
        tracing::info!(task = %self.task.name, shard = self.shard_id, run_id = order.run_id, "reconciling shard");
        // An epoch building beside the live one is compared in its own table (a validation).
        let live = self.resources.target.live_epoch(&self.task.name).await?;
        self.epoch_sql = self.sql.routed(self.epoch, live);
        let outcome = self
            .compare_and_repair(client, order.since_micros, !order.versions_only)
            .await?;
        let duration_ms = started.elapsed().as_millis() as u64;
        tracing::info!(
            task = %self.task.name, shard = self.shard_id, run_id = order.run_id, ranges = outcome.ranges_compared,
            rows_read = outcome.rows_read, repaired = outcome.keys_repaired, duration_ms, "shard reconciled"
        );
        client
            .report_reconcile(pb::ReportReconcileRequest {
                worker_id: self.worker_id.clone(),
                task: self.task.name.clone(),
                epoch: self.epoch,
                shard_id: self.shard_id,
                fence_token: self.fence,
                run_id: order.run_id,
                ranges_compared: outcome.ranges_compared,
                rows_read: outcome.rows_read,
                keys_repaired: outcome.keys_repaired,
                extra_in_target: outcome.extra_in_target,
                keys_missed: outcome.keys_missed,
                duration_ms,
            })
            .await
    }

    async fn compare_and_repair(
        &mut self,
        client: &CoordinatorClient,
        since_micros: Option<i64>,
        content: bool,
    ) -> Result<Outcome, WorkerError> {
        // Across engines every column is hashed in its portable form; a column none covers
        // fails the run (the coordinator refuses such runs first): never compare less than
        // was asked.
        let portable = self.portable();
        let mut outcome = Outcome::default();
        let mut repairs: Vec<Repair> = Vec::new();
        // (range, counts per side when already known from the parent's buckets)
        let mut work: Vec<(ShardRange, Option<(i64, i64)>)> = vec![(self.range.clone(), None)];
        while let Some((range, known)) = work.pop() {
            let scope = Scope {
                range: &range,
                since_micros,
                content,
                portable,
            };
            let (source_count, target_count) = match known {
                Some(counts) => counts,
                None => {
                    outcome.ranges_compared += 1;
                    let source = self.sums(Side::Source, &scope, &[]).await?;
                    let target = self.sums(Side::Target, &scope, &[]).await?;
                    if source == target {
                        continue;
                    }
                    let count = |sums: &Sums| sums.get(&0).map_or(0, |s| s.0);
                    (count(&source), count(&target))
                }
            };
            let larger = source_count.max(target_count);
            let dense = (source_count - target_count).abs() * 4 >= larger && larger <= DENSE_LEAF_ROWS;
            let thresholds = if larger <= LEAF_ROWS || dense {
                Vec::new()
            } else {
                self.thresholds(&scope, source_count >= target_count).await?
            };
            if thresholds.is_empty() {
                self.diff_leaf(&scope, &mut outcome, &mut repairs).await?;
                if repairs.len() >= self.task.page_size as usize {
                    self.repair(client, std::mem::take(&mut repairs), &mut outcome).await?;
                }
                continue;
            }
            let source = self.sums(Side::Source, &scope, &thresholds).await?;
            let target = self.sums(Side::Target, &scope, &thresholds).await?;
            for bucket in 0..=thresholds.len() as i32 {
                let (s, t) = (source.get(&bucket), target.get(&bucket));
                if s.is_none() && t.is_none() {
                    continue;
                }
                outcome.ranges_compared += 1;
                if s == t {
                    continue;
                }
                let lo = if bucket == 0 {
                    range.lo.clone()
                } else {
                    Some(thresholds[bucket as usize - 1].clone())
                };
                let hi = if bucket as usize == thresholds.len() {
                    range.hi.clone()
                } else {
                    Some(thresholds[bucket as usize].clone())
                };
                let counts = (s.map_or(0, |v| v.0), t.map_or(0, |v| v.0));
                work.push((ShardRange { lo, hi }, Some(counts)));
            }
        }
        if !repairs.is_empty() {
            self.repair(client, repairs, &mut outcome).await?;
        }
        Ok(outcome)
    }

    /// What reconciliation reads of one side.
    fn side(&self, side: Side) -> Result<Box<dyn SideReads + '_>, WorkerError> {
        Ok(match side {
            Side::Source => self.resources.source.reconcile_reads(&self.reads, &self.sql)?,
            Side::Target => self
                .resources
                .target
                .reconcile_reads(self.epoch_sql.as_ref().unwrap_or(&self.sql)),
        })
    }

    /// Both sides hash every column's row text natively only when both engines do
    /// (PostgreSQL); otherwise both hash the portable form.
    fn portable(&self) -> bool {
        !(self.resources.source.engine().hashes_content && self.resources.target.engine().hashes_content)
    }

    async fn sums(&self, side: Side, scope: &Scope<'_>, thresholds: &[KeyValue]) -> Result<Sums, WorkerError> {
        Ok(self.side(side)?.bucket_sums(scope, thresholds).await?)
    }

    /// Split points inside the scope: even steps for integer keys, sampled quantiles (from the
    /// side with more rows) otherwise. Empty when the range cannot be split.
    async fn thresholds(&self, scope: &Scope<'_>, source_is_larger: bool) -> Result<Vec<KeyValue>, WorkerError> {
        let key_type = self.sql.key_types()[0].clone();
        let value = |v: String| KeyValue {
            sql_type: key_type.clone(),
            value: v,
        };
        let mut points: Vec<String> = Vec::new();
        if is_integer(&key_type) {
            let mut lo = i64::MAX;
            let mut hi = i64::MIN;
            for side in [Side::Source, Side::Target] {
                let (min, max) = self.side(side)?.key_bounds(scope).await?;
                let parse = |t: Option<String>| t.and_then(|t| t.parse::<i64>().ok());
                if let (Some(min), Some(max)) = (parse(min), parse(max)) {
                    lo = lo.min(min);
                    hi = hi.max(max);
                }
            }
            if lo < hi {
                let width = (hi as i128 - lo as i128 + 1) as u128;
                let step = width.div_ceil(u128::from(SPLIT)).max(1) as i128;
                let mut point = lo as i128 + step;
                while point <= hi as i128 && points.len() < SPLIT as usize - 1 {
                    points.push(point.to_string());
                    point += step;
                }
            }
        } else {
            let side = if source_is_larger { Side::Source } else { Side::Target };
            let quantiles = self.side(side)?.key_quantiles(scope, SPLIT).await?;
            for q in quantiles.unwrap_or_default() {
                if points.last() != Some(&q) && scope.range.lo.as_ref().is_none_or(|lo| lo.value != q) {
                    points.push(q);
                }
            }
        }
        Ok(points.into_iter().map(value).collect())
    }

    /// Reads a small range's `(key, version)` pairs on both sides and collects the keys that
    /// differ.
    async fn diff_leaf(
        &self,
        scope: &Scope<'_>,
        outcome: &mut Outcome,
        repairs: &mut Vec<Repair>,
    ) -> Result<(), WorkerError> {
        let source = self.side(Side::Source)?.key_versions(scope).await?;
        let target = self.side(Side::Target)?.key_versions(scope).await?;
        outcome.rows_read += (source.len() + target.len()) as u64;
        let key_types = self.sql.key_types();
        let to_key = |values: &[String]| -> Vec<KeyValue> {
            values
                .iter()
                .zip(&key_types)
                .map(|(value, sql_type)| KeyValue {
                    sql_type: sql_type.clone(),
                    value: value.clone(),
                })
                .collect()
        };
        // A key differs when the target lacks it, holds another version, or (comparing
        // content) holds other values at the same version.
        for (key, state) in &source {
            let seen = target.get(key).copied();
            if seen != Some(*state) {
                repairs.push(Repair {
                    key: to_key(key),
                    expected: seen.map(|(version, _)| version),
                });
            }
        }
        for (key, (version, _)) in &target {
            if !source.contains_key(key) {
                repairs.push(Repair {
                    key: to_key(key),
                    expected: Some(*version),
                });
            }
        }
        Ok(())
    }

    /// Stages the differing keys as one repair batch: the source rows as they are now (with
    /// the target version the comparison saw), and a tombstone for each key the source no
    /// longer has (when the task has a delete policy).
    async fn repair(
        &mut self,
        client: &CoordinatorClient,
        repairs: Vec<Repair>,
        outcome: &mut Outcome,
    ) -> Result<(), WorkerError> {
        let keys: Vec<Vec<KeyValue>> = repairs.iter().map(|r| r.key.clone()).collect();
        let page = read_page(
            &self.resources.source,
            &self.sql,
            &self.reads.rows_by_key(&self.sql, &keys),
            CopyFormat::Text,
            false,
        )
        .await?;
        let expected: HashMap<Vec<String>, Option<i64>> = repairs
            .iter()
            .map(|r| (r.key.iter().map(|k| k.value.clone()).collect(), r.expected))
            .collect();
        let positions = self.sql.key_positions();
        let mut data: Vec<u8> = Vec::with_capacity(page.data.len() + repairs.len() * 32);
        let mut found: HashSet<Vec<String>> = HashSet::new();
        let mut row_count = 0u64;
        for row in copy_text::rows(&page.data) {
            let key = positions
                .iter()
                .map(|&i| {
                    copy_text::raw_field(row, i)
                        .and_then(|raw| copy_text::decode_field(raw).ok().flatten())
                        .ok_or_else(|| WorkerError::Data("a repaired row has no key".into()))
                })
                .collect::<Result<Vec<String>, WorkerError>>()?;
            if self.missed(row, &key) {
                outcome.keys_missed += 1;
            }
            data.extend_from_slice(row);
            data.push(b'\t');
            push_version(&mut data, expected.get(&key).copied().flatten());
            data.push(b'\n');
            found.insert(key);
            row_count += 1;
        }
        for repair in &repairs {
            let values: Vec<String> = repair.key.iter().map(|k| k.value.clone()).collect();
            if found.contains(&values) {
                continue;
            }
            let Some(version) = repair.expected else {
                // Gone from the source since the comparison, and never in the target.
                continue;
            };
            if self.sql.deletes.is_none() {
                outcome.extra_in_target += 1;
                continue;
            }
            self.push_tombstone(&mut data, &values, version);
            row_count += 1;
        }
        outcome.rows_read += page.row_count;
        outcome.keys_repaired += row_count;
        if row_count == 0 {
            return Ok(());
        }
        let cursor = self.cursor.clone();
        let page = PageToDeliver {
            lower: cursor.clone(),
            upper: cursor,
            data: Bytes::from(data),
            format: CopyFormat::Text,
            row_count,
            repair: true,
            target_layout: false,
        };
        // The repair writes the target: what the overlap re-read may leave out is not known.
        self.recent.clear();
        self.deliver(client, page).await.map(|_| ())
    }

    /// Whether a repaired source row (staged layout) is one the shard had already passed: its
    /// cursor time lies below the committed watermark minus the overlap (append: its integer
    /// key at or below the last one read). Such a row was missed; any other repair is a
    /// change still in flight, which the next cycle would have brought.
    fn missed(&self, row: &[u8], key: &[String]) -> bool {
        if self.sql.cursor_column.is_some() {
            let Some(watermark) = self.cursor.incremental_time() else {
                return false;
            };
            let field = copy_text::raw_field(row, self.sql.columns.len() + 1)
                .and_then(|raw| copy_text::decode_field(raw).ok().flatten())
                .and_then(|text| text.parse::<i64>().ok());
            let overlap = self.task.overlap_ms as i64 * 1000;
            return field.is_some_and(|t| t < watermark - overlap);
        }
        let read = self
            .cursor
            .key_position()
            .and_then(|k| k.first())
            .and_then(|k| k.value.parse::<i64>().ok());
        let key = key.first().and_then(|k| k.parse::<i64>().ok());
        matches!((key, read), (Some(key), Some(read)) if key <= read)
    }

    /// A tombstone in the staged layout: the key, NULL elsewhere, the version, no cursor time,
    /// the delete flag, and the expected version (the same: replace exactly what was seen).
    fn push_tombstone(&self, data: &mut Vec<u8>, key: &[String], version: i64) {
        let positions = self.sql.key_positions();
        for index in 0..self.sql.columns.len() {
            match positions.iter().position(|&p| p == index) {
                Some(k) => copy_text::encode_field(&key[k], data),
                None => data.extend_from_slice(copy_text::NULL_FIELD),
            }
            data.push(b'\t');
        }
        push_version(data, Some(version));
        if self.sql.cursor_column.is_some() {
            data.push(b'\t');
            data.extend_from_slice(copy_text::NULL_FIELD);
        }
        data.extend_from_slice(b"\tt\t");
        push_version(data, Some(version));
        data.push(b'\n');
    }
}

fn push_version(data: &mut Vec<u8>, version: Option<i64>) {
    match version {
        Some(v) => data.extend_from_slice(v.to_string().as_bytes()),
        None => data.extend_from_slice(copy_text::NULL_FIELD),
    }
}
