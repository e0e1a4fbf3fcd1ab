//! The worker's metrics and per-step spans: every step of a batch (read, stage, register,
//! apply, verify, commit) is a child span of the batch's span and an observation of
//! `tidemark_batch_step_seconds{step}`.

use std::future::Future;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use prometheus_client::registry::Registry;
use tidemark_common::metrics::{CounterFamily, HistogramFamily, histogram_family, labels, register_trace_counters};
use tracing::Instrument;

pub struct WorkerMetrics {
    pub rows_read: CounterFamily,
    pub rows_applied: CounterFamily,
    pub rows_unchanged: CounterFamily,
    pub batches: CounterFamily,
    pub replays: CounterFamily,
    pub step_seconds: HistogramFamily,
    pub shards_lost: CounterFamily,
    pub dead_letters: CounterFamily,
}

pub static METRICS: LazyLock<WorkerMetrics> = LazyLock::new(|| WorkerMetrics {
    rows_read: CounterFamily::default(),
    rows_applied: CounterFamily::default(),
    rows_unchanged: CounterFamily::default(),
    batches: CounterFamily::default(),
    replays: CounterFamily::default(),
    step_seconds: histogram_family(),
    shards_lost: CounterFamily::default(),
    dead_letters: CounterFamily::default(),
});

/// The registry to serve, and the refresh to run before each scrape.
pub fn registry() -> (Arc<Registry>, Arc<dyn Fn() + Send + Sync>) {
    let mut registry = Registry::default();
    let m = &*METRICS;
    registry.register("tidemark_rows_read", "Rows read from the source", m.rows_read.clone());
    registry.register(
        "tidemark_rows_applied",
        "Rows applied to the target by this worker (batches it applied, not ones found already applied)",
        m.rows_applied.clone(),
    );
    registry.register(
        "tidemark_rows_unchanged",
        "Rows an overlap re-read found as this shard had last applied them, left out of the batch",
        m.rows_unchanged.clone(),
    );
    registry.register(
        "tidemark_batches",
        "Batches committed, by kind and COPY format",
        m.batches.clone(),
    );
    registry.register(
        "tidemark_batch_replays",
        "Pending batches re-applied from staging",
        m.replays.clone(),
    );
    registry.register(
        "tidemark_batch_step_seconds",
        "Time per protocol step of a batch",
        m.step_seconds.clone(),
    );
    registry.register(
        "tidemark_shards_lost",
        "Shards dropped because a commit was refused (stale fence, paused task, retired shard)",
        m.shards_lost.clone(),
    );
    registry.register(
        "tidemark_dead_letters",
        "Rows this worker sent to the dead letters (the target or the transform rejected them)",
        m.dead_letters.clone(),
    );
    let refresh = register_trace_counters(&mut registry);
    (Arc::new(registry), refresh)
}

/// Runs one step of a batch inside its span and records its duration.
pub async fn step<T>(name: &'static str, future: impl Future<Output = T>) -> T {
    let span = match name {
        "read" => tracing::info_span!("read"),
        "stage" => tracing::info_span!("stage"),
        "register" => tracing::info_span!("register"),
        "apply" => tracing::info_span!("apply"),
        "verify" => tracing::info_span!("verify"),
        "commit" => tracing::info_span!("commit"),
        _ => tracing::info_span!("step", name),
    };
    let started = Instant::now();
    let result = future.instrument(span).await;
    METRICS
        .step_seconds
        .get_or_create(&labels(&[("step", name)]))
        .observe(started.elapsed().as_secs_f64());
    result
}

pub fn count(family: &CounterFamily, task: &str, by: u64) {
    family.get_or_create(&labels(&[("task", task)])).inc_by(by);
}
