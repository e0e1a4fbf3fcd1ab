//! The coordinator's metrics: counters updated as workers register, acquire and commit, and
//! gauges refreshed from the control database every two seconds (watermark lag per task and
//! shard, late rows, leadership).

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tidemark_common::metrics::{CounterFamily, GaugeFamily, HistogramFamily, labels, register_trace_counters};

use crate::checkpoints::ControlDb;
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
    pub watermark_lag: GaugeFamily,
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
    watermark_lag: GaugeFamily::default(),
    late_rows: GaugeFamily::default(),
    task_paused: GaugeFamily::default(),
    shards_unassigned: GaugeFamily::default(),
    leader: Gauge::default(),
    group_size: HistogramFamily::new_with_constructor(|| Histogram::new(exponential_buckets(1.0, 2.0, 9))),
    commit_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
    group_seconds: HistogramFamily::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 14))),
    runtime_delay_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
    scan_seconds: HistogramFamily::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 16))),
});

/// Records one periodic read of every shard (`scan_seconds`).
pub fn observe_scan(scan: &str, took: Duration) {
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
    r.register(
        "tidemark_watermark_lag_seconds",
        "Source clock minus the committed watermark, per task and shard (incremental phase)",
        m.watermark_lag.clone(),
    );
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

/// Refreshes the gauges from the control database.
pub async fn refresh_gauges(control: ControlDb, leadership: Leadership) {
    let mut first = true;
    let mut took = Duration::ZERO;
    loop {
        if !first {
            tokio::time::sleep(crate::pacing::wait_after(Duration::from_secs(2), took)).await;
        }
        first = false;
        METRICS.leader.set(i64::from(leadership.is_leader()));
        let started = std::time::Instant::now();
        let tasks = control.status().await;
        took = started.elapsed();
        observe_scan("gauges", took);
        let Ok(tasks) = tasks else { continue };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64);
        for task in tasks {
            METRICS
                .task_paused
                .get_or_create(&labels(&[("task", &task.name)]))
                .set(if task.paused_reason.is_some() { 1.0 } else { 0.0 });
            for shard in &task.shards {
                if let Some(watermark) = shard.cursor.incremental_time() {
                    let shard_id = shard.shard_id.to_string();
                    METRICS
                        .watermark_lag
                        .get_or_create(&labels(&[("task", &task.name), ("shard", &shard_id)]))
                        .set((now - watermark) as f64 / 1e6);
                }
            }
            if let Ok(lateness) = control.lateness(&task.name, task.epoch).await {
                METRICS
                    .late_rows
                    .get_or_create(&labels(&[("task", &task.name)]))
                    .set(lateness.count as f64);
            }
        }
    }
}
