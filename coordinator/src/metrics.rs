//! The coordinator's metrics: counters updated as workers register, acquire and commit, and
//! gauges set every two seconds (watermark lag per task and shard, from the commits this
//! replica answered; late rows, pauses, leadership).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tidemark_common::metrics::{CounterFamily, GaugeFamily, HistogramFamily, labels, register_trace_counters};

use crate::checkpoints::{ControlDb, ShardKey, TaskState, TaskStatusRow};
use crate::leader::Leadership;

pub struct CoordinatorMetrics {
    pub rows_applied: CounterFamily,
    pub batches: CounterFamily,
    pub replays: CounterFamily,
    pub commits_refused: CounterFamily,
    pub leases_acquired: CounterFamily,
    pub leases_lost: CounterFamily,
    pub reconcile_ranges: CounterFamily,
    pub reconcile_rows_read: CounterFamily,
    pub reconcile_keys_repaired: CounterFamily,
    pub schema_evolutions: CounterFamily,
    pub epoch_switches: CounterFamily,
    pub late_rows: GaugeFamily,
    pub task_paused: GaugeFamily,
    pub shards_unassigned: GaugeFamily,
    pub leader: Gauge,
    /// Calls per control-database statement or transaction, by RPC (`groups`).
    pub group_size: HistogramFamily,
    /// A commit's time in the coordinator, from its arrival to its answer: the wait for a
    /// group and the group's transaction.
    pub commit_seconds: Histogram,
    /// One group's control-database statement or transaction, by RPC, including its wait
    /// for a connection.
    pub group_seconds: HistogramFamily,
    /// A call's wait, by RPC, from its arrival until its group's statement starts: the
    /// groups in flight before it.
    pub group_wait_seconds: HistogramFamily,
    /// How late a task that asked to wake is run (`probe_runtime_delay`).
    pub runtime_delay_seconds: Histogram,
    /// One read of shards, by `scan`: `claim_queue` and `gauges` read every shard and their
    /// pace follows their length (`pacing`); `freed` reads the shards whose owners just ended.
    pub scan_seconds: HistogramFamily,
}

pub static METRICS: LazyLock<CoordinatorMetrics> = LazyLock::new(|| CoordinatorMetrics {
    rows_applied: CounterFamily::default(),
    batches: CounterFamily::default(),
    replays: CounterFamily::default(),
    commits_refused: CounterFamily::default(),
    leases_acquired: CounterFamily::default(),
    leases_lost: CounterFamily::default(),
    reconcile_ranges: CounterFamily::default(),
    reconcile_rows_read: CounterFamily::default(),
    reconcile_keys_repaired: CounterFamily::default(),
    schema_evolutions: CounterFamily::default(),
    epoch_switches: CounterFamily::default(),
    late_rows: GaugeFamily::default(),
    task_paused: GaugeFamily::default(),
    shards_unassigned: GaugeFamily::default(),
    leader: Gauge::default(),
    group_size: HistogramFamily::new_with_constructor(|| Histogram::new(exponential_buckets(1.0, 2.0, 9))),
    commit_seconds: Histogram::new(LATENCY_BUCKETS.iter().copied()),
    group_seconds: HistogramFamily::new_with_constructor(|| Histogram::new(LATENCY_BUCKETS.iter().copied())),
    group_wait_seconds: HistogramFamily::new_with_constructor(|| Histogram::new(LATENCY_BUCKETS.iter().copied())),
    runtime_delay_seconds: Histogram::new(LATENCY_BUCKETS.iter().copied()),
    scan_seconds: HistogramFamily::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 16))),
});

/// Upper bounds (seconds) of the latency histograms: fine enough around the goals (a commit
/// within 50 ms) to tell 40 from 60 ms, which doubling buckets (32, 64) could not.
const LATENCY_BUCKETS: [f64; 26] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.13, 0.16, 0.2, 0.25, 0.32, 0.4, 0.5,
    0.65, 0.8, 1.0, 1.6, 2.5, 5.0, 10.0,
];

/// Records one periodic read of every shard (`scan_seconds`).
pub fn observe_scan(scan: &str, took: Duration) {
    tracing::debug!(scan, took_ms = took.as_millis() as u64, "read every shard");
    METRICS
        .scan_seconds
        .get_or_create(&labels(&[("scan", scan)]))
        .observe(took.as_secs_f64());
}

pub fn count(family: &CounterFamily, pairs: &[(&str, &str)], by: u64) {
    family.get_or_create(&labels(pairs)).inc_by(by);
}

pub fn registry() -> (Arc<Registry>, Arc<dyn Fn() + Send + Sync>) {
    let mut r = Registry::default();
    let m = &*METRICS;
    r.register(
        "tidemark_rows_applied",
        "Rows of committed batches (equals the target ledger's sum)",
        m.rows_applied.clone(),
    );
    r.register("tidemark_batches", "Batches committed", m.batches.clone());
    r.register(
        "tidemark_batch_replays",
        "Batches committed after a replay from staging",
        m.replays.clone(),
    );
    r.register(
        "tidemark_commits_refused",
        "Register or commit calls refused, by reason (fenced = stale fence token)",
        m.commits_refused.clone(),
    );
    r.register(
        "tidemark_leases_acquired",
        "Shard leases granted to workers",
        m.leases_acquired.clone(),
    );
    r.register(
        "tidemark_leases_lost",
        "Worker leases found expired on heartbeat",
        m.leases_lost.clone(),
    );
    r.register(
        "tidemark_reconcile_ranges_compared",
        "Key ranges compared by reconciliation",
        m.reconcile_ranges.clone(),
    );
    r.register(
        "tidemark_reconcile_rows_read",
        "Rows read by reconciliation",
        m.reconcile_rows_read.clone(),
    );
    r.register(
        "tidemark_reconcile_keys_repaired",
        "Keys repaired by reconciliation",
        m.reconcile_keys_repaired.clone(),
    );
    r.register(
        "tidemark_schema_evolutions",
        "Columns added to a live epoch (schema_changes = \"evolve\")",
        m.schema_evolutions.clone(),
    );
    r.register(
        "tidemark_epoch_switches",
        "Swaps of a task's live table: a validated epoch made live, or a rollback",
        m.epoch_switches.clone(),
    );
    r.register_collector(Box::new(WatermarkLag));
    r.register(
        "tidemark_late_rows",
        "Late rows found by the overlap re-read in the current epoch",
        m.late_rows.clone(),
    );
    r.register(
        "tidemark_task_paused",
        "1 while the task is paused (the reason is in `status`), else 0",
        m.task_paused.clone(),
    );
    r.register(
        "tidemark_shards_unassigned",
        "Shards of a task's running epochs that no worker holds (they wait for capacity, or are moving)",
        m.shards_unassigned.clone(),
    );
    r.register(
        "tidemark_leader",
        "1 while this replica is the leader",
        m.leader.clone(),
    );
    r.register(
        "tidemark_control_group_size",
        "Calls per control-database statement, by RPC (calls that arrive together share one)",
        m.group_size.clone(),
    );
    r.register(
        "tidemark_commit_seconds",
        "A commit's time in the coordinator, from arrival to answer (waiting for a group, then its transaction)",
        m.commit_seconds.clone(),
    );
    r.register(
        "tidemark_control_group_seconds",
        "One group's control-database statement or transaction, by RPC, with its wait for a connection",
        m.group_seconds.clone(),
    );
    r.register(
        "tidemark_control_group_wait_seconds",
        "A call's wait for its group's statement to start, by RPC (the groups in flight before it)",
        m.group_wait_seconds.clone(),
    );
    r.register(
        "tidemark_runtime_delay_seconds",
        "How much later than asked a sleeping task is run: time every RPC and statement waits for a core",
        m.runtime_delay_seconds.clone(),
    );
    r.register(
        "tidemark_shard_scan_seconds",
        "One read of shards, by scan (claim_queue: every free shard acquires take from; freed: the shards whose owners just ended; gauges)",
        m.scan_seconds.clone(),
    );
    let refresh = register_trace_counters(&mut r);
    (Arc::new(r), refresh)
}

/// Sleeps 50 ms at a time and records how much longer each sleep took: the wait of a woken
/// task for a core of the runtime, which every RPC and every statement's reply pays too
/// (a few milliseconds on an idle process; hundreds mean the coordinator is short of CPU).
pub async fn probe_runtime_delay() {
    const PERIOD: Duration = Duration::from_millis(50);
    loop {
        let asked = std::time::Instant::now();
        tokio::time::sleep(PERIOD).await;
        METRICS
            .runtime_delay_seconds
            .observe(asked.elapsed().saturating_sub(PERIOD).as_secs_f64());
    }
}

/// How often the gauges are set.
const GAUGE_PERIOD: Duration = Duration::from_secs(2);
/// How often (or longer, see `pacing`) every shard's watermark is read from the control
/// database, to correct what the commits recorded here do not show: the commits before this
/// replica led, and shards retired by a merge or an epoch switch.
const WATERMARKS_READ: Duration = Duration::from_secs(30);

/// Each shard's newest committed watermark, by task and shard: (epoch, microseconds).
type Watermarks = HashMap<(String, u32), (u64, i64)>;

/// What the commits this replica answered moved, between reads of every shard.
static WATERMARKS: LazyLock<Mutex<Watermarks>> = LazyLock::new(Default::default);

fn watermarks() -> std::sync::MutexGuard<'static, Watermarks> {
    WATERMARKS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Records a committed checkpoint's watermark (an incremental cursor's,
/// `Cursor::incremental_time`), so that its lag gauge follows the commit without a read of
/// every shard.
pub fn record_watermark(shard: &ShardKey, micros: i64) {
    let recorded = (shard.epoch, micros);
    let mut watermarks = watermarks();
    let entry = watermarks
        .entry((shard.task.clone(), shard.shard_id))
        .or_insert(recorded);
    // A late answer of an older epoch or an older commit never moves it back.
    *entry = (*entry).max(recorded);
}

/// Sets the gauges every [`GAUGE_PERIOD`]: pauses and each task's current epoch from one row
/// per task, late rows from one count per task (paced by its own cost). Each shard's
/// watermark lag is computed when scraped ([`WatermarkLag`]) from the watermarks the commits
/// recorded. Every shard is read only every [`WATERMARKS_READ`] or longer, and decoded off
/// the runtime: at 50,000 shards that read takes about a second of the control database
/// and half a second of a core, and it was one of the reads that set the tail of every other
/// call (BENCHMARKS.md, issue 20).
pub async fn refresh_gauges(control: ControlDb, leadership: Leadership) {
    let mut read_at: Option<std::time::Instant> = None;
    let mut took = Duration::ZERO;
    // The late-row counts aggregate the rows recorded, so they are paced by their own cost.
    let mut lateness_at: Option<std::time::Instant> = None;
    let mut lateness_took = Duration::ZERO;
    loop {
        METRICS.leader.set(i64::from(leadership.is_leader()));
        if read_at.is_none_or(|at| at.elapsed() >= crate::pacing::wait_after(WATERMARKS_READ, took)) {
            let started = std::time::Instant::now();
            let read = control.status().await;
            took = started.elapsed();
            observe_scan("gauges", took);
            if let Ok(tasks) = read {
                read_at = Some(std::time::Instant::now());
                crate::off_runtime::run(move || replace_watermarks(tasks)).await;
            }
        }
        if let Ok(tasks) = control.task_states().await {
            set_gauges(&tasks);
            if lateness_at.is_none_or(|at| at.elapsed() >= crate::pacing::wait_after(GAUGE_PERIOD, lateness_took)) {
                let started = std::time::Instant::now();
                set_lateness(&control, &tasks).await;
                lateness_at = Some(std::time::Instant::now());
                lateness_took = started.elapsed();
            }
        }
        tokio::time::sleep(GAUGE_PERIOD).await;
    }
}

/// Every shard's watermark as read, or as recorded by a commit answered during the read
/// where that is newer.
fn replace_watermarks(tasks: Vec<TaskStatusRow>) {
    let mut fresh = Watermarks::new();
    for task in tasks {
        for shard in task.shards {
            if let Some(micros) = shard.cursor.incremental_time() {
                fresh.insert((task.name.clone(), shard.shard_id), (task.epoch, micros));
            }
        }
    }
    let mut watermarks = watermarks();
    for (shard, newer) in watermarks.drain() {
        if let Some(read) = fresh.get_mut(&shard)
            && newer > *read
        {
            *read = newer;
        }
    }
    *watermarks = fresh;
}

fn set_gauges(tasks: &[TaskState]) {
    *epochs() = tasks.iter().map(|task| (task.name.clone(), task.epoch)).collect();
    for task in tasks {
        METRICS
            .task_paused
            .get_or_create(&labels(&[("task", &task.name)]))
            .set(if task.paused_reason.is_some() { 1.0 } else { 0.0 });
    }
}

/// Each task's current epoch as of the last read of the tasks: the lag gauges show its
/// shards only.
static EPOCHS: LazyLock<Mutex<HashMap<String, u64>>> = LazyLock::new(Default::default);

fn epochs() -> std::sync::MutexGuard<'static, HashMap<String, u64>> {
    EPOCHS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `tidemark_watermark_lag_seconds`, per task and shard: computed when scraped, from the
/// watermarks recorded. Set as gauges every 2 s, 50,000 shards' lags took 140-220 ms of a
/// core each time (issue 20); a scrape pays it once per scrape instead.
#[derive(Debug)]
struct WatermarkLag;

impl Collector for WatermarkLag {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64);
        let epochs = epochs().clone();
        // Copied out, so that commits recording theirs do not wait for the encoding.
        let mut lags: Vec<(String, u32, f64)> = watermarks()
            .iter()
            .filter(|((task, _), (epoch, _))| epochs.get(task.as_str()) == Some(epoch))
            .map(|((task, shard), (_, micros))| (task.clone(), *shard, (now - micros) as f64 / 1e6))
            .collect();
        lags.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        let mut family = encoder.encode_descriptor(
            "tidemark_watermark_lag_seconds",
            "Source clock minus the committed watermark, per task and shard (incremental phase)",
            None,
            MetricType::Gauge,
        )?;
        for (task, shard, lag) in &lags {
            let labels = ([("task", task.as_str())], [("shard", *shard)]);
            family.encode_family(&labels)?.encode_gauge(lag)?;
        }
        Ok(())
    }
}

async fn set_lateness(control: &ControlDb, tasks: &[TaskState]) {
    for task in tasks {
        if let Ok(lateness) = control.lateness(&task.name, task.epoch).await {
            METRICS
                .late_rows
                .get_or_create(&labels(&[("task", &task.name)]))
                .set(lateness.count as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_watermark_moves_forward_only() {
        let shard = |epoch| ShardKey {
            task: "metrics_unit".into(),
            epoch,
            shard_id: 7,
        };
        let now = || watermarks().get(&("metrics_unit".to_string(), 7)).copied();
        record_watermark(&shard(2), 1_000);
        record_watermark(&shard(2), 900);
        assert_eq!(now(), Some((2, 1_000)), "an older commit's late answer");
        record_watermark(&shard(1), 5_000);
        assert_eq!(now(), Some((2, 1_000)), "an older epoch's commit");
        record_watermark(&shard(3), 10);
        assert_eq!(now(), Some((3, 10)), "a newer epoch starts its own watermarks");
        record_watermark(&shard(3), 2_000);
        assert_eq!(now(), Some((3, 2_000)));
    }

    #[test]
    fn the_lag_is_computed_when_scraped_for_the_current_epochs_shards_only() {
        let micros_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64;
        let shard = |epoch, shard_id| ShardKey {
            task: "lag_unit".into(),
            epoch,
            shard_id,
        };
        record_watermark(&shard(4, 1), micros_now - 5_000_000);
        record_watermark(&shard(3, 2), micros_now - 1_000_000);
        epochs().insert("lag_unit".into(), 4);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(WatermarkLag));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let line = text
            .lines()
            .find(|line| line.starts_with("tidemark_watermark_lag_seconds{task=\"lag_unit\",shard=\"1\"} "))
            .unwrap_or_else(|| panic!("no lag for shard 1 of the current epoch:\n{text}"));
        let lag: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((5.0..6.0).contains(&lag), "lag {lag} s, expected 5 s and a little");
        assert!(
            !text.contains("task=\"lag_unit\",shard=\"2\""),
            "a shard of an older epoch has no lag:\n{text}"
        );
        assert!(text.contains("# TYPE tidemark_watermark_lag_seconds gauge"), "{text}");
    }
}
