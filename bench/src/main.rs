//! `cargo run --release -p tidemark-bench -- --rows 10000000 [--peers] [--shape items|orders]`
//!
//! In one run, on this machine: generates a source table (`--shape`; by default a bigint key,
//! uuid, timestamptz(3) cursor with 50 rows per millisecond, ~200 bytes of jsonb, numeric,
//! text), measures the raw limit `COPY … TO STDOUT (FORMAT binary) | COPY … FROM STDIN (FORMAT
//! binary)` into an equivalent empty table with its primary key, as one pipe and as one pipe
//! per shard by key range, optionally runs the peers (sling, dlt) on the same table, then runs
//! a Tidemark snapshot end to end (coordinator + workers, local staging) into a fresh target,
//! then applies `--updates` source updates and measures the time until the watermark covers
//! them and the target has them (and the peers' incremental runs after them). Prints rows/s,
//! MB/s, the ratios, worker peak RSS, staging bytes and the time per protocol step.

use std::time::{Duration, Instant};

use clap::Parser;
use futures::TryStreamExt;
use sqlx::Connection;
use tidemark_tests::otlp::{sample, scrape};
use tidemark_tests::{Cluster, Process, TaskSettings, TempDir, TestDb, binary, free_port};

mod mariadb;
mod peers;
mod shapes;

use peers::{Peer, Peers};
use shapes::Shape;

#[derive(Parser)]
#[command(about = "Tidemark end-to-end benchmark against raw binary COPY pipes and the peers")]
pub(crate) struct Args {
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) rows: i64,
    #[arg(long, default_value_t = 100_000)]
    updates: i64,
    #[arg(long, default_value_t = 2)]
    pub(crate) workers: usize,
    #[arg(long, default_value_t = 8)]
    pub(crate) shards: u32,
    #[arg(long, default_value_t = 10_000)]
    pub(crate) page_size: u32,
    /// `text` makes the workers read and apply COPY text (`TIDEMARK_COPY_FORMAT`); `auto`
    /// lets them choose binary where the column types allow.
    #[arg(long, default_value = "auto")]
    copy_format: String,
    /// Print the results as one JSON object as well.
    #[arg(long)]
    json: bool,
    /// Then run the snapshot once more (source generated again) with S3 staging (a moto server; `scripts/setup.sh`
    /// installs it) into a fresh target, and print it beside the `file://` run.
    #[arg(long)]
    compare_s3: bool,
    /// `mariadb`: the snapshot from a MariaDB table (the machine's server) into PostgreSQL,
    /// against `mariadb --batch | COPY` measured in the same run.
    #[arg(long, default_value = "postgres")]
    source: String,
    /// With `--source mariadb`: `mariadb` writes into a MariaDB database instead, against
    /// `mariadb --batch | LOAD DATA LOCAL INFILE` measured in the same run.
    #[arg(long, default_value = "postgres")]
    pub(crate) target: String,
    /// Then run the same snapshot (source generated again) through `tidemark sync --once`
    /// (one process, in-process leases, control state in the embedded store) with the same workers,
    /// shards and page size, and print it beside the cluster's.
    #[arg(long)]
    compare_sync: bool,
    /// Also run sling and dlt on the same table in the same run, each into a fresh target
    /// (first run, then one incremental run after the updates), checked against the source;
    /// `bench/peers.sh` installs them into a venv under `target/` from PyPI.
    #[arg(long)]
    peers: bool,
    /// The generated table: `items` (the recorded runs before session 17) or `orders`.
    #[arg(long, value_enum, default_value = "items")]
    shape: Shape,
}

async fn generate(db: &TestDb, shape: Shape, rows: i64) {
    db.exec(shape.create()).await;
    let chunk = 1_000_000;
    let mut first = 1;
    while first <= rows {
        let last = (first + chunk - 1).min(rows);
        db.exec(&shape.insert(first, last)).await;
        first = last + 1;
    }
    db.exec("CREATE INDEX bench_items_cursor ON bench_items (updated_at, id)")
        .await;
    // Sets the fresh rows' hint bits and the visibility map, which the first reader of the
    // table would otherwise write, so that no path measured pays for them.
    db.exec("VACUUM ANALYZE bench_items").await;
}

/// The physical limit: binary COPY out of the source straight into an empty table with the
/// same primary key, in `streams` parallel pipes (one per key range when more than one, as
/// Tidemark's shards split it). Returns (seconds, bytes moved).
async fn baseline(source: &TestDb, target: &TestDb, shape: Shape, streams: u32, rows: i64) -> (f64, u64) {
    target.exec(shape.create()).await;
    let streams = i64::from(streams.max(1));
    let mut pipes = Vec::new();
    // Connected before the clock starts, as Tidemark's workers are before they read.
    for i in 0..streams {
        let out_conn = sqlx::PgConnection::connect(&source.url).await.unwrap();
        let in_conn = sqlx::PgConnection::connect(&target.url).await.unwrap();
        let select = if streams == 1 {
            "bench_items".to_string()
        } else {
            let (lo, hi) = (1 + rows * i / streams, 1 + rows * (i + 1) / streams);
            format!("(SELECT * FROM bench_items WHERE id >= {lo} AND id < {hi})")
        };
        pipes.push((out_conn, in_conn, select));
    }
    let started = Instant::now();
    let pipes = pipes.into_iter().map(|(mut out_conn, mut in_conn, select)| {
        tokio::spawn(async move {
            let mut copy_in = in_conn
                .copy_in_raw("COPY bench_items FROM STDIN (FORMAT binary)")
                .await
                .unwrap();
            let mut stream = out_conn
                .copy_out_raw(&format!("COPY {select} TO STDOUT (FORMAT binary)"))
                .await
                .unwrap();
            let mut bytes = 0u64;
            while let Some(chunk) = stream.try_next().await.unwrap() {
                bytes += chunk.len() as u64;
                copy_in.send(chunk).await.unwrap();
            }
            drop(stream);
            copy_in.finish().await.unwrap();
            bytes
        })
    });
    let mut bytes = 0;
    for pipe in futures::future::join_all(pipes).await {
        bytes += pipe.unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    same_rows(source, target, &format!("the {streams}-stream pipe")).await;
    (secs, bytes)
}

pub(crate) fn peak_rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn dir_bytes(path: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else { return 0 };
    entries
        .filter_map(Result::ok)
        .map(|e| {
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                dir_bytes(&e.path())
            } else {
                meta.len()
            }
        })
        .sum()
}

/// Asserts that `target`'s `bench_items` has the source's rows: their count, and the sums of
/// their keys, amounts and note lengths (the peers' column types differ from Tidemark's, so
/// the check reads what every mapping keeps).
async fn same_rows(source: &TestDb, target: &TestDb, who: &str) {
    let check = "SELECT count(*)::text || ' / ' || sum(id)::text || ' / ' || sum(amount)::text || ' / ' \
                 || sum(length(note))::text || ' / ' || count(note)::text FROM bench_items";
    assert_eq!(
        scalar(source, check).await,
        scalar(target, check).await,
        "{who}: the target has the source's rows"
    );
}

/// Writes every dirty buffer of the server out before a measured path, so that none pays
/// for a checkpoint of the writes before it (the generated table, the path measured last).
async fn settle(db: &TestDb) {
    db.exec("CHECKPOINT").await;
}

async fn scalar(db: &TestDb, sql: &str) -> String {
    sqlx::query_scalar::<_, Option<String>>(sqlx::AssertSqlSafe(sql.to_string()))
        .fetch_one(&db.pool)
        .await
        .unwrap()
        .unwrap_or_default()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.source == "mariadb" {
        if !matches!(args.shape, Shape::Items) {
            anyhow::bail!("--shape: a MariaDB source generates its own items table only");
        }
        return mariadb::run(&args).await;
    }
    let rows = args.rows;
    let mut cluster = Cluster::new("bench").await;
    let base = TestDb::create("bench_base").await;

    let started = Instant::now();
    generate(&cluster.source, args.shape, rows).await;
    let source_bytes: i64 = sqlx::query_scalar("SELECT pg_table_size('bench_items')")
        .fetch_one(&cluster.source.pool)
        .await?;
    eprintln!(
        "generated {rows} rows ({:.0} MB) in {:.1}s",
        source_bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );

    settle(&base).await;
    let (base_secs, base_bytes) = baseline(&cluster.source, &base, args.shape, 1, rows).await;
    eprintln!("baseline COPY binary pipe: {base_secs:.1}s");
    drop(base);
    let base = TestDb::create("bench_base_n").await;
    settle(&base).await;
    let (streams_secs, _) = baseline(&cluster.source, &base, args.shape, args.shards, rows).await;
    eprintln!(
        "baseline, {} COPY binary pipes by key range: {streams_secs:.1}s",
        args.shards
    );
    drop(base);
    let raw_secs = base_secs.min(streams_secs);

    // The peers' first runs, on the table as Tidemark's snapshot will find it.
    let peers = args.peers.then(Peers::install);
    let mut peer_runs = Vec::new();
    if let Some(peers) = &peers {
        for peer in Peer::ALL {
            let target = TestDb::create(&format!("bench_{}", peer.tag())).await;
            settle(&target).await;
            let secs = peers.run(peer, &cluster.source, &target);
            same_rows(&cluster.source, &target, peer.name()).await;
            eprintln!("{} first run: {secs:.1}s", peer.name());
            peer_runs.push((peer, target, secs));
        }
    }

    settle(&cluster.target).await;
    let (snapshot_secs, metrics) = snapshot(&mut cluster, &args, String::new()).await;
    let staging_bytes = dir_bytes(&cluster.dir.0.join("staging"));
    let check = "SELECT count(*)::text || ' / ' || sum(amount)::text FROM bench_items";
    let (source_sum, target_sum) = (
        scalar(&cluster.source, check).await,
        scalar(&cluster.target, check).await,
    );
    assert_eq!(source_sum, target_sum, "target equals source after the snapshot");
    eprintln!("tidemark snapshot: {snapshot_secs:.1}s");

    let steps = step_seconds(&metrics).await;
    let formats = cluster.staged_formats();

    // Updates: one statement, cursor = commit-time clock; latency until the target has them.
    let every = (rows / args.updates.max(1)).max(1);
    let statement = Instant::now();
    cluster
        .source
        .exec(&format!(
            "UPDATE bench_items SET amount = amount + 1, updated_at = clock_timestamp() WHERE id % {every} = 0"
        ))
        .await;
    let committed = Instant::now();
    // The source's own time for the same writes: a reference for the latency below.
    let statement_secs = statement.elapsed().as_secs_f64();
    let commit_micros = cluster.source_now_micros().await;
    let updated: i64 = rows / every;
    cluster
        .wait_for_watermark(commit_micros, Duration::from_secs(600))
        .await;
    // The watermark passing the commit means every update is in the target (the guarantee);
    // the sums are compared once afterwards, untimed (two full scans of large tables).
    let update_secs = committed.elapsed().as_secs_f64();
    let check = format!("SELECT sum(amount)::text FROM bench_items WHERE id % {every} = 0");
    assert_eq!(
        scalar(&cluster.source, &check).await,
        scalar(&cluster.target, &check).await,
        "the target has every update once the watermark passed their commit"
    );

    let rss: Vec<f64> = cluster.workers.iter().map(|w| peak_rss_mib(w.child.id())).collect();
    let after_updates = step_seconds(&metrics).await;

    // The peers' incremental runs after the same updates, with the cluster stopped.
    let mut peer_updates = Vec::new();
    if let Some(peers) = &peers {
        cluster.workers.clear();
        cluster.coordinator.take();
        for (peer, target, _) in &peer_runs {
            let secs = peers.run(*peer, &cluster.source, target);
            same_rows(&cluster.source, target, peer.name()).await;
            assert_eq!(
                scalar(&cluster.source, &check).await,
                scalar(target, &check).await,
                "{} has every update after its incremental run",
                peer.name()
            );
            eprintln!("{} incremental run: {secs:.1}s", peer.name());
            peer_updates.push(secs);
        }
    }

    let update_steps: Vec<(&str, f64)> = after_updates
        .iter()
        .zip(&steps)
        .map(|((step, total), (_, before))| (*step, total - before))
        .collect();

    let base_rate = rows as f64 / base_secs;
    let raw_rate = rows as f64 / raw_secs;
    let rate = rows as f64 / snapshot_secs;
    println!(
        "tidemark benchmark: {rows} rows, {} workers, {} shards, page {}",
        args.workers, args.shards, args.page_size
    );
    println!("  source table            {:>10.0} MB", source_bytes as f64 / 1e6);
    println!(
        "  baseline COPY binary    {:>10.1} s  {:>10.0} rows/s  {:>7.1} MB/s",
        base_secs,
        base_rate,
        base_bytes as f64 / 1e6 / base_secs
    );
    println!(
        "  {:>2} pipes by key range  {:>10.1} s  {:>10.0} rows/s ({:.2} of one pipe's time)",
        args.shards,
        streams_secs,
        rows as f64 / streams_secs,
        streams_secs / base_secs
    );
    println!(
        "  tidemark snapshot       {:>10.1} s  {:>10.0} rows/s  {:>7.1} MB/s (of the baseline's bytes)",
        snapshot_secs,
        rate,
        base_bytes as f64 / 1e6 / snapshot_secs
    );
    println!("  ratio to baseline       {:>10.2}", rate / base_rate);
    println!("  ratio to the faster raw {:>10.2}", rate / raw_rate);
    for ((peer, _, first), again) in peer_runs.iter().zip(&peer_updates) {
        println!(
            "  {:<14} first run {:>6.1} s  {:>10.0} rows/s (Tidemark {:.1}x faster); incremental run after the updates {:.1} s",
            peer.name(),
            first,
            rows as f64 / first,
            first / snapshot_secs,
            again
        );
    }
    println!(
        "  {updated} updates in target {:>6.1} s after their commit (safety_delay 2s; the source's UPDATE took {:.1} s)",
        update_secs, statement_secs
    );
    println!(
        "  worker peak RSS         {}",
        rss.iter().map(|r| format!("{r:.0} MiB")).collect::<Vec<_>>().join(", ")
    );
    println!(
        "  staging bytes           {:>10.0} MB ({})",
        staging_bytes as f64 / 1e6,
        formats
            .iter()
            .map(|(format, n)| format!("{n} batches {format}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (phase, steps) in [("snapshot", &steps), ("updates", &update_steps)] {
        let total: f64 = steps.iter().map(|(_, s)| s).sum();
        println!("  time per step in the {phase} (sum over workers and shards, share of all steps):");
        for (step, secs) in steps {
            println!(
                "    {step:<10} {secs:>8.1} s  {:>5.1} %",
                secs / total.max(1e-9) * 100.0
            );
        }
    }
    let sync_secs = if args.compare_sync {
        // The cluster's processes stop first: the machine is the sync's alone.
        cluster.workers.clear();
        cluster.coordinator.take();
        let (secs, plan_secs, syncing) = sync_snapshot(&args).await;
        println!(
            "  tidemark sync --once    {secs:>10.1} s  {:>10.0} rows/s (one process, from its start to its exit, \
             {plan_secs:.1} s of it planning; {:.2} of the baseline)",
            rows as f64 / secs,
            base_secs / secs
        );
        println!(
            "    its workers' start to caught up {syncing:>4.1} s  {:>10.0} rows/s ({:.2} of the cluster's snapshot, \
             timed the same way)",
            rows as f64 / syncing,
            snapshot_secs / syncing
        );
        Some(secs)
    } else {
        None
    };
    let s3_secs = if args.compare_s3 {
        drop(cluster);
        let s3 = tidemark_tests::s3::S3Server::start();
        let mut cluster = Cluster::new("bench_s3").await;
        cluster.client_env = tidemark_tests::s3::S3_ENV
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        generate(&cluster.source, args.shape, rows).await;
        let (secs, _) = snapshot(&mut cluster, &args, s3.staging_url("bench")).await;
        let check = "SELECT count(*)::text || ' / ' || sum(amount)::text FROM bench_items";
        assert_eq!(
            scalar(&cluster.source, check).await,
            scalar(&cluster.target, check).await,
            "target equals source after the S3 snapshot"
        );
        let objects = s3.keys("bench").await.len();
        println!(
            "  snapshot, S3 staging    {secs:>10.1} s  {:>10.0} rows/s (moto_server on loopback, {objects} objects; \
             {:.2} of the file:// run, {:.2} of the baseline)",
            rows as f64 / secs,
            snapshot_secs / secs,
            base_secs / secs
        );
        Some(secs)
    } else {
        None
    };
    if args.json {
        let value = serde_json::json!({
            "s3_snapshot_seconds": s3_secs,
            "sync_seconds": sync_secs,
            "rows": rows, "baseline_seconds": base_secs, "baseline_rows_per_second": base_rate,
            "streams": args.shards, "streams_seconds": streams_secs, "ratio_to_faster_raw": rate / raw_rate,
            "peers": peer_runs.iter().zip(&peer_updates).map(|((peer, _, first), again)| serde_json::json!({
                "peer": peer.name(), "first_run_seconds": first, "incremental_run_seconds": again,
            })).collect::<Vec<_>>(),
            "snapshot_seconds": snapshot_secs, "snapshot_rows_per_second": rate, "ratio": rate / base_rate,
            "updates": updated, "update_latency_seconds": update_secs, "update_statement_seconds": statement_secs, "worker_peak_rss_mib": rss,
            "staging_bytes": staging_bytes, "staged_formats": formats,
            "steps": steps.iter().map(|(s, t)| serde_json::json!({"step": s, "seconds": t})).collect::<Vec<_>>(),
            "update_steps": update_steps.iter().map(|(s, t)| serde_json::json!({"step": s, "seconds": t})).collect::<Vec<_>>(),
        });
        println!("{value}");
    }
    Ok(())
}

/// Starts the coordinator and the workers on `staging` (empty: the cluster's `file://`
/// directory) and waits for the whole snapshot; returns its seconds and the workers'
/// metrics addresses.
async fn snapshot(cluster: &mut Cluster, args: &Args, staging: String) -> (f64, Vec<String>) {
    let rows = args.rows;
    let settings = TaskSettings {
        source_table: "public.bench_items".into(),
        cursor_column: "updated_at".into(),
        shards: args.shards,
        page_size: args.page_size,
        safety_delay: "2s",
        poll_interval: "500ms",
        lease_ttl: "10s",
        overlap: "2s",
        staging_url: staging,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    let mut metrics = Vec::new();
    let started = Instant::now();
    for i in 0..args.workers {
        let listen = format!("127.0.0.1:{}", free_port());
        // An even share of the shards each, so that every worker's peak RSS is comparable.
        cluster.spawn_worker(
            &format!("bench-w{i}"),
            args.shards.div_ceil(args.workers.max(1) as u32),
            &[
                ("TIDEMARK_METRICS_LISTEN", &listen),
                ("TIDEMARK_COPY_FORMAT", &args.copy_format),
            ],
        );
        metrics.push(listen);
    }
    let timeout = Duration::from_secs((rows as u64 / 2_000).max(300));
    cluster
        .wait_for("snapshot complete", timeout, |t| {
            t.snapshot_complete && t.rows_applied >= rows as u64
        })
        .await;
    (started.elapsed().as_secs_f64(), metrics)
}

/// The snapshot through `tidemark sync --once` with the cluster run's workers, shards and
/// page size, into a fresh target, with the control state in the embedded store (the sync's
/// default, a SQLite file); seconds from the
/// process's start (planning included) to its exit, and the seconds it says it planned and
/// synced (from its workers' start until it saw the task caught up).
async fn sync_snapshot(args: &Args) -> (f64, f64, f64) {
    let source = TestDb::create("bench_sync_src").await;
    let target = TestDb::create("bench_sync_dst").await;
    let dir = TempDir::new("bench_sync");
    generate(&source, args.shape, args.rows).await;
    // The same first read as the cluster's source had (the baseline's COPY): it sets the
    // fresh rows' hint bits, which the first reader of a table otherwise writes.
    let base = TestDb::create("bench_sync_base").await;
    let (base_secs, _) = baseline(&source, &base, args.shape, 1, args.rows).await;
    eprintln!("baseline COPY binary pipe before the sync: {base_secs:.1}s");
    drop(base);
    let config = dir.0.join("sync.toml");
    std::fs::write(
        &config,
        format!(
            r#"[coordinator]
listen = "127.0.0.1:0"
control_db = "sqlite://{control}"
staging = "file://{staging}"

[[tasks]]
name = "bench"
source = "{source}"
source_table = "public.bench_items"
target = "{target}"
target_table = "public.bench_items"
key = ["id"]
cursor_column = "updated_at"
shards = {shards}
page_size = {page_size}
safety_delay = "2s"
poll_interval = "500ms"
overlap = "2s"
"#,
            target = target.url,
            source = source.url,
            staging = dir.0.join("staging").display(),
            control = dir.0.join("control.db").display(),
            shards = args.shards,
            page_size = args.page_size,
        ),
    )
    .unwrap();
    let workers = args.workers.to_string();
    let started = Instant::now();
    let mut sync = Process::spawn(
        "sync",
        &binary("tidemark"),
        &[
            "sync",
            "--once",
            "--workers",
            &workers,
            "--config",
            &config.display().to_string(),
        ],
        &[("TIDEMARK_COPY_FORMAT", &args.copy_format), ("RUST_LOG", "warn")],
        &dir.0,
    );
    let timeout = Duration::from_secs((args.rows as u64 / 2_000).max(300));
    let status = sync.wait_exit(timeout).expect("tidemark sync --once exits");
    let secs = started.elapsed().as_secs_f64();
    assert!(status.success(), "tidemark sync failed: {}", sync.log_text());
    let check = "SELECT count(*)::text || ' / ' || sum(amount)::text FROM bench_items";
    assert_eq!(
        scalar(&source, check).await,
        scalar(&target, check).await,
        "target equals source after tidemark sync"
    );
    // Its summary line ends `; 10.8s (1.2s to plan, 9.1s to sync, 0.5s to stop)`.
    let log = sync.log_text();
    let figure = |label: &str| -> f64 {
        log.split(label)
            .next()
            .and_then(|head| head.rsplit(['(', ',', ' ']).find(|part| !part.is_empty()))
            .and_then(|n| n.trim_end_matches('s').parse().ok())
            .unwrap_or_else(|| panic!("no {label:?} in the sync's summary: {log}"))
    };
    (secs, figure("s to plan"), figure("s to sync"))
}

/// Seconds per protocol step, summed over the workers' `tidemark_batch_step_seconds`.
pub(crate) async fn step_seconds(metrics: &[String]) -> Vec<(&'static str, f64)> {
    let mut steps = Vec::new();
    for step in ["read", "stage", "register", "apply", "verify", "commit"] {
        let mut total = 0.0;
        for listen in metrics {
            let text = scrape(listen).await;
            total += sample(&text, "tidemark_batch_step_seconds_sum", &format!("step=\"{step}\"")).unwrap_or(0.0);
        }
        steps.push((step, total));
    }
    steps
}
