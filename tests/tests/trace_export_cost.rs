//! Observability (issue 7): with the OTLP collector down, the sync is not slowed down.
//! A test binary of its own: `cargo test` runs binaries one after another, so no other test
//! competes for the two cores while this one measures wall time.
//! Boundary: everything committed before the watermark; delete policy: none.

use std::time::{Duration, Instant};

use tidemark_tests::otlp::{sample, scrape};
use tidemark_tests::{Cluster, KeyKind, TaskSettings, create_items, free_port};

const ROWS: i64 = 180_000;

/// Snapshot time of 180k rows with the given extra worker and coordinator settings. Long
/// enough (about 3 s) that the start-up, whose timing varies by about 0.2 s from run to run
/// (60k rows with tracing off took 0.92 s in some runs and 1.15 s in others), does not
/// decide the ratio.
async fn timed_snapshot(tag: &str, otlp: Option<&str>) -> (Duration, Option<f64>) {
    let mut cluster = Cluster::new(tag).await;
    create_items(&cluster.source, KeyKind::Bigint, ROWS).await;
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut env = vec![("TIDEMARK_METRICS_LISTEN", metrics.as_str())];
    if let Some(endpoint) = otlp {
        env.push(("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint));
    }
    cluster
        .start(&TaskSettings {
            shards: 4,
            page_size: 1000,
            coordinator_extra: otlp.map(|e| format!("otlp_endpoint = \"{e}\"")).unwrap_or_default(),
            ..TaskSettings::default()
        })
        .await;
    let started = Instant::now();
    cluster.spawn_worker(&format!("{tag}-w"), 4, &env);
    cluster
        .wait_for("snapshot done", Duration::from_secs(120), |t| t.snapshot_complete)
        .await;
    let elapsed = started.elapsed();
    // A failed export is counted when it ends, up to its 5 s timeout after it started: a
    // snapshot that finishes in a second is done before the first export to a dead collector
    // has failed.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let dropped = sample(&scrape(&metrics).await, "tidemark_trace_spans_dropped_total", "");
        if otlp.is_none() || dropped.is_some_and(|d| d > 0.0) || Instant::now() > deadline {
            return (elapsed, dropped);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// With the collector address pointing at a closed port the sync finishes, spans are dropped
/// and counted, and it takes no more than 1.2× the time with tracing off (best of three
/// interleaved runs each, measured in this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_does_not_slow_the_sync() {
    let closed = format!("http://127.0.0.1:{}", free_port());
    let mut off = Vec::new();
    let mut dead = Vec::new();
    let mut dropped = 0.0;
    for round in 0..3 {
        off.push(timed_snapshot(&format!("obs_off{round}"), None).await.0);
        let (time, spans_dropped) = timed_snapshot(&format!("obs_dead{round}"), Some(&closed)).await;
        dead.push(time);
        dropped += spans_dropped.unwrap_or(0.0);
    }
    let best_off = off.iter().min().unwrap().as_secs_f64();
    let best_dead = dead.iter().min().unwrap().as_secs_f64();
    eprintln!(
        "snapshot of {ROWS} rows: tracing off {off:?}, dead collector {dead:?}, ratio {:.2}",
        best_dead / best_off
    );
    assert!(dropped > 0.0, "spans for the dead collector are counted as dropped");
    assert!(
        best_dead <= best_off * 1.2,
        "dead collector {best_dead:.2}s vs off {best_off:.2}s"
    );
}
