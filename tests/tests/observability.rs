//! Observability (issue 7): per-batch traces across worker and coordinator received by a real
//! OTLP collector, Prometheus metrics that agree with the target's ledger, and
//! connection-string passwords absent from every log. The timed dead-collector test is in
//! `trace_export_cost.rs`, a binary of its own so no other test shares the cores it measures.
//! Boundary: everything committed before the watermark; delete policy: none.

use std::time::{Duration, Instant};

use tidemark_tests::otlp::{Collector, sample, scrape};
use tidemark_tests::{Cluster, KeyKind, TaskSettings, create_items, free_port};

const WORKER_STEPS: &[&str] = &["read", "stage", "register", "apply", "verify", "commit"];

/// One batch's trace holds the worker's `batch` span with its attributes, its step spans, and
/// the coordinator's register and commit spans, all under one trace id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_one_trace_across_worker_and_coordinator() {
    let (collector, address) = Collector::start().await;
    let endpoint = format!("http://{address}");
    let mut cluster = Cluster::new("obs_trace").await;
    create_items(&cluster.source, KeyKind::Bigint, 5_000).await;
    cluster
        .start(&TaskSettings {
            shards: 2,
            page_size: 1000,
            coordinator_extra: format!("otlp_endpoint = \"{endpoint}\""),
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker(
        "obs-w",
        2,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_SERVICE_NAME", "tidemark-worker-test"),
        ],
    );
    cluster
        .wait_for("snapshot done", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;

    let deadline = Instant::now() + Duration::from_secs(30);
    let (batch, trace) = loop {
        let spans = collector.snapshot();
        let found = spans
            .iter()
            .filter(|s| s.name == "batch" && s.attribute("rows").is_some_and(|r| r != "0"))
            .find_map(|batch| {
                let trace: Vec<_> = spans.iter().filter(|s| s.trace_id == batch.trace_id).cloned().collect();
                let names: Vec<&str> = trace.iter().map(|s| s.name.as_str()).collect();
                let complete = WORKER_STEPS.iter().all(|step| names.contains(step))
                    && names.contains(&"coordinator.register_batch")
                    && names.contains(&"coordinator.commit_batch");
                complete.then(|| (batch.clone(), trace))
            });
        if let Some(found) = found {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "no complete batch trace among {} spans: {:?}",
            spans.len(),
            spans.iter().map(|s| (&s.service, &s.name)).take(30).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(batch.service, "tidemark-worker-test", "OTEL_SERVICE_NAME is honoured");
    for attribute in [
        "task", "epoch", "shard", "batch_id", "rows", "bytes", "format", "lower", "upper", "replay",
    ] {
        assert!(
            batch.attribute(attribute).is_some(),
            "batch span lacks {attribute}: {batch:?}"
        );
    }
    assert_eq!(batch.attribute("task"), Some("items"));
    assert_eq!(batch.attribute("format"), Some("binary"));
    let batch_id = batch.attribute("batch_id").unwrap();
    for span in &trace {
        let expected_service = if span.name.starts_with("coordinator.") {
            "tidemark-coordinator"
        } else {
            "tidemark-worker-test"
        };
        assert_eq!(span.service, expected_service, "{span:?}");
        if span.name.starts_with("coordinator.") {
            assert_eq!(span.attribute("batch_id"), Some(batch_id), "{span:?}");
        }
    }
    // The coordinator's spans are children of the worker's register and commit steps.
    for (coordinator_span, worker_step) in [
        ("coordinator.register_batch", "register"),
        ("coordinator.commit_batch", "commit"),
    ] {
        let child = trace.iter().find(|s| s.name == coordinator_span).unwrap();
        let parent = trace.iter().find(|s| s.span_id == child.parent_span_id).unwrap();
        assert_eq!(parent.name, worker_step);
    }
}

/// The metrics endpoints expose the counters; rows applied equals the ledger's sum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_agree_with_the_ledger() {
    let coordinator_metrics = format!("127.0.0.1:{}", free_port());
    let worker_metrics = format!("127.0.0.1:{}", free_port());
    let mut cluster = Cluster::new("obs_metrics").await;
    create_items(&cluster.source, KeyKind::Bigint, 20_000).await;
    cluster
        .start(&TaskSettings {
            shards: 4,
            page_size: 2000,
            coordinator_extra: format!("metrics_listen = \"{coordinator_metrics}\""),
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("obs-m", 4, &[("TIDEMARK_METRICS_LISTEN", &worker_metrics)]);
    cluster
        .write_and_converge(
            "UPDATE items SET qty = coalesce(qty, 0) + 1, updated_at = clock_timestamp() WHERE id % 10 = 0",
            "metrics run",
        )
        .await;
    // The overlap re-reads recent rows for a few more cycles, so both numbers still move for
    // a moment. The ledger row is written before the commit is counted: read the metric first,
    // then the ledger, until they meet.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (metrics, ledger) = loop {
        let metrics = scrape(&coordinator_metrics).await;
        let ledger: i64 = sqlx::query_scalar("SELECT coalesce(sum(row_count), 0)::bigint FROM tidemark_ledger")
            .fetch_one(&cluster.target.pool)
            .await
            .unwrap();
        let applied = sample(&metrics, "tidemark_rows_applied_total", "task=\"items\"").unwrap_or(0.0) as i64;
        assert!(
            applied <= ledger,
            "counted {applied} rows applied, the ledger holds {ledger}"
        );
        if (applied == ledger && metrics.contains("tidemark_watermark_lag_seconds{")) || Instant::now() > deadline {
            break (metrics, ledger);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(ledger >= 22_000, "{ledger}");
    let applied = sample(&metrics, "tidemark_rows_applied_total", "task=\"items\"").expect("rows applied");
    assert_eq!(applied as i64, ledger, "rows applied = the ledger's sum\n{metrics}");
    assert_eq!(
        sample(&metrics, "tidemark_task_paused", "task=\"items\""),
        Some(0.0),
        "a running task is not paused\n{metrics}"
    );
    // Every commit is timed, in its group and in the coordinator: at least one per batch
    // (idle shards commit empty advances too), and never fewer commits than groups.
    let batches = sample(&metrics, "tidemark_batches_total", "task=\"items\"").expect("batches");
    let commits = sample(&metrics, "tidemark_commit_seconds_count", "").expect("commit histogram");
    let groups = |call: &str| {
        let labels = format!("call=\"{call}\"");
        let groups = sample(&metrics, "tidemark_control_group_seconds_count", &labels);
        let calls = sample(&metrics, "tidemark_control_group_size_sum", &labels);
        (groups.unwrap_or(0.0), calls.unwrap_or(0.0))
    };
    let (commit_groups, grouped_commits) = groups("commit_batch");
    assert!(
        commits >= batches && batches > 0.0,
        "{commits} commits timed for {batches} batches"
    );
    assert!(
        commit_groups >= 1.0 && commit_groups <= grouped_commits && grouped_commits >= commits,
        "{commit_groups} groups of {grouped_commits} commits for {commits} commits"
    );
    // A commit is grouped before it is timed. Registrations, claims and shard-work polls are
    // grouped the same way: a registration for every batch (none for an empty advance), a
    // claim recorded for every lease granted.
    let (register_groups, registrations) = groups("register_batch");
    assert!(
        registrations >= batches && register_groups >= 1.0 && register_groups <= registrations,
        "{register_groups} groups of {registrations} registrations for {batches} batches, {commits} commits\n{metrics}"
    );
    let leases = sample(&metrics, "tidemark_leases_acquired_total", "task=\"items\"").expect("leases");
    let (claim_groups, claims) = groups("acquire_shard");
    assert!(
        claims >= leases && leases > 0.0 && claim_groups >= 1.0 && claim_groups <= claims,
        "{claim_groups} groups of {claims} claims for {leases} leases\n{metrics}"
    );
    // A commit answers the poll (`shard_work`): a worker polls only after a step that
    // committed nothing, so there may be none here.
    let (poll_groups, polls) = groups("next_shard_work");
    assert!(
        poll_groups <= polls,
        "{poll_groups} groups of {polls} shard-work polls\n{metrics}"
    );
    assert!(
        sample(&metrics, "tidemark_runtime_delay_seconds_count", "").is_some_and(|n| n > 0.0),
        "the runtime's delay is probed\n{metrics}"
    );
    for name in [
        "tidemark_batches_total",
        "tidemark_leases_acquired_total",
        "tidemark_watermark_lag_seconds",
        "tidemark_late_rows",
        "tidemark_leader",
        "tidemark_trace_spans_dropped_total",
    ] {
        assert!(metrics.contains(name), "coordinator metrics lack {name}\n{metrics}");
    }
    let worker = scrape(&worker_metrics).await;
    let read = sample(&worker, "tidemark_rows_read_total", "task=\"items\"").expect("rows read");
    assert!(read as i64 >= ledger, "the worker read at least what was applied");
    let applied_by_worker = sample(&worker, "tidemark_rows_applied_total", "task=\"items\"").unwrap();
    // The target is created from the source's columns: every batch is binary COPY.
    assert!(
        worker.contains("tidemark_batches_total{task=\"items\",kind=\"rows\",format=\"binary\"}"),
        "{worker}"
    );
    assert!(!worker.contains("format=\"text\""), "{worker}");
    assert!(applied_by_worker as i64 >= ledger, "one worker applied every batch");
    for step in WORKER_STEPS {
        assert!(
            worker.contains(&format!("tidemark_batch_step_seconds_count{{step=\"{step}\"}}")),
            "no histogram for {step}\n{worker}"
        );
    }
    // The lag gauges follow the commits the coordinator answers, not only its reads of every
    // shard (every 30 s or longer): with a safety delay of 1 s and a poll interval of 200 ms,
    // no shard's lag grows past a few seconds in the 10 s sampled (read only every 30 s, it
    // would grow by the 10 s).
    let mut highest = [f64::NAN; 4];
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let metrics = scrape(&coordinator_metrics).await;
        for (shard, highest) in highest.iter_mut().enumerate() {
            let labels = format!("task=\"items\",shard=\"{shard}\"");
            let lag = sample(&metrics, "tidemark_watermark_lag_seconds", &labels)
                .unwrap_or_else(|| panic!("no lag gauge for shard {shard}\n{metrics}"));
            *highest = highest.max(lag);
        }
    }
    assert!(
        highest.iter().all(|lag| (0.0..8.0).contains(lag)),
        "the highest lag per shard over 10 s: {highest:?}"
    );
}

/// Connection strings carry a password; no line any process logs (at debug level, JSON and
/// human, including an error that names the URL) contains it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_contains_the_database_password() {
    const PASSWORD: &str = "Tm-s3cret-pw-4711";
    let mut cluster = Cluster::new("obs_mask").await;
    create_items(&cluster.source, KeyKind::Bigint, 3_000).await;
    // Trust authentication ignores the password, so the URLs work with it.
    for db in [&mut cluster.source, &mut cluster.target, &mut cluster.control] {
        db.url = db.url.replacen("postgres@", &format!("postgres:{PASSWORD}@"), 1);
        assert!(db.url.contains(PASSWORD), "{}", db.url);
    }
    cluster
        .start(&TaskSettings {
            shards: 2,
            coordinator_env: vec![("RUST_LOG", "debug".into()), ("TIDEMARK_LOG_FORMAT", "json".into())],
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("mask-w", 2, &[("RUST_LOG", "debug")]);
    cluster
        .write_and_converge(
            "UPDATE items SET name = 'masked', updated_at = clock_timestamp() WHERE id % 7 = 0",
            "with passwords in URLs",
        )
        .await;
    // An error that names a URL: a source database that does not exist.
    let config = std::fs::read_to_string(&cluster.config_path).unwrap();
    let broken = cluster.dir.0.join("broken.toml");
    let source_db = cluster.source.name.clone();
    std::fs::write(
        &broken,
        config.replace(&format!("/{source_db}\""), "/no_such_database_here\""),
    )
    .unwrap();
    let (ok, stdout, stderr) = cluster.cli(&["serve", "--config", broken.to_str().unwrap()]);
    assert!(!ok, "serving a missing source fails");
    assert!(stderr.contains("****"), "the URL is shown masked: {stderr}");
    let mut logs = vec![stdout, stderr];
    for entry in std::fs::read_dir(&cluster.dir.0).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "log") {
            logs.push(std::fs::read_to_string(&path).unwrap());
        }
    }
    let lines: usize = logs.iter().map(|l| l.lines().count()).sum();
    assert!(lines > 100, "debug logging produced {lines} lines");
    for log in &logs {
        if let Some(line) = log.lines().find(|l| l.contains(PASSWORD)) {
            panic!("a log line contains the password: {line}");
        }
    }
}
