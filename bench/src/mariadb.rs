//! `--source mariadb`: the same snapshot from a MariaDB table into PostgreSQL (or, with
//! `--target mariadb`, into a MariaDB database), against a raw one-stream pipe measured in
//! the same run: `mariadb --batch -e 'SELECT …' | psql -c 'COPY … FROM STDIN'` (or `| mariadb
//! -e 'LOAD DATA LOCAL INFILE …'`) into an equivalent empty table with its primary key. Both
//! sides are checked by count and sums after the run.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tidemark_tests::mariadb::MariaDb;
use tidemark_tests::otlp::batches_by_format;
use tidemark_tests::usage::{box_ticks, process_usage};
use tidemark_tests::{Cluster, TaskSettings, TestDb, free_port};

use crate::Args;

const TABLE: &str = "CREATE TABLE bench_items (
    id BIGINT NOT NULL PRIMARY KEY,
    uid CHAR(36) NOT NULL,
    updated_at TIMESTAMP(3) NOT NULL,
    payload JSON NOT NULL,
    amount DECIMAL(12,2) NOT NULL,
    note TEXT NULL,
    KEY bench_items_cursor (updated_at, id)
) ENGINE=InnoDB";

/// The target types Tidemark maps the table to, for the baseline's table.
const PG_TABLE: &str = "CREATE TABLE bench_items (id bigint PRIMARY KEY, uid character(36) NOT NULL, \
     updated_at timestamp(3) with time zone NOT NULL, payload text NOT NULL, amount numeric(12,2) NOT NULL, note text)";

async fn generate(db: &MariaDb, rows: i64) {
    db.exec(TABLE).await;
    let chunk = 250_000;
    let mut first = 1;
    while first <= rows {
        let last = (first + chunk - 1).min(rows);
        db.exec(&format!(
            "INSERT INTO bench_items SELECT seq, UUID(), \
             TIMESTAMP'2026-01-01 00:00:00' + INTERVAL (seq DIV 50) * 1000 MICROSECOND, \
             JSON_OBJECT('user', CONCAT('user-', seq), 'plan', IF(seq % 3 = 0, 'pro', 'free'), \
                         'tags', JSON_ARRAY(CONCAT('a', seq % 10), CONCAT('b', seq % 7)), 'text', REPEAT('lorem ipsum ', 10)), \
             (seq % 100000) / 100.0, IF(seq % 4 = 0, NULL, CONCAT('note ', seq)) FROM seq_{first}_to_{last}"
        ))
        .await;
        first = last + 1;
    }
    db.exec("ANALYZE TABLE bench_items").await;
}

/// One stream: the MariaDB client's tab-separated output straight into COPY.
fn baseline(source: &MariaDb, target: &TestDb) -> f64 {
    let started = Instant::now();
    let mut out = Command::new("mariadb")
        .args([
            "-h",
            "127.0.0.1",
            "-u",
            "root",
            "--batch",
            "--skip-column-names",
            "--quick",
            &source.name,
            "-e",
            "SELECT id, uid, CONCAT(updated_at, '+00'), payload, amount, note FROM bench_items",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("mariadb client");
    let status = Command::new("psql")
        .args([
            "-X",
            "-q",
            "-d",
            &target.url,
            "-c",
            "COPY bench_items FROM STDIN WITH (NULL 'NULL')",
        ])
        .stdin(out.stdout.take().unwrap())
        .status()
        .expect("psql");
    assert!(
        status.success() && out.wait().unwrap().success(),
        "baseline pipe failed"
    );
    started.elapsed().as_secs_f64()
}

/// The MariaDB table Tidemark creates for `bench_items`, without the version column.
const MARIADB_TARGET_TABLE: &str = "CREATE TABLE bench_items (id BIGINT NOT NULL PRIMARY KEY, uid CHAR(36) NOT NULL, \
     updated_at DATETIME(3) NOT NULL, payload JSON NOT NULL, amount DECIMAL(12,2) NOT NULL, note LONGTEXT) \
     DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin";

/// One stream: the MariaDB client's tab-separated output straight into `LOAD DATA`.
fn mariadb_baseline(source: &MariaDb, target: &MariaDb) -> f64 {
    let started = Instant::now();
    let mut out = Command::new("mariadb")
        .args([
            "-h",
            "127.0.0.1",
            "-u",
            "root",
            "--batch",
            "--skip-column-names",
            "--quick",
            &source.name,
            "-e",
            "SELECT id, uid, updated_at, payload, amount, note FROM bench_items",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("mariadb client");
    let status = Command::new("mariadb")
        .args([
            "-h",
            "127.0.0.1",
            "-u",
            "root",
            "--local-infile=1",
            &target.name,
            "-e",
            "LOAD DATA LOCAL INFILE '/dev/stdin' INTO TABLE bench_items",
        ])
        .stdin(out.stdout.take().unwrap())
        .status()
        .expect("mariadb client");
    assert!(
        status.success() && out.wait().unwrap().success(),
        "baseline pipe failed"
    );
    started.elapsed().as_secs_f64()
}

async fn mariadb_check(db: &MariaDb) -> String {
    sqlx::query_scalar("SELECT CONCAT(COUNT(*), ' / ', SUM(id), ' / ', SUM(amount)) FROM bench_items")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn pg_check(db: &TestDb) -> String {
    sqlx::query_scalar("SELECT count(*)::text || ' / ' || sum(id)::text || ' / ' || sum(amount)::text FROM bench_items")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

pub async fn run(args: &Args) -> anyhow::Result<()> {
    let rows = args.rows;
    let source = MariaDb::create("bench_my").await;
    let started = Instant::now();
    generate(&source, rows).await;
    eprintln!(
        "generated {rows} MariaDB rows in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let source_check: String =
        sqlx::query_scalar("SELECT CONCAT(COUNT(*), ' / ', SUM(id), ' / ', SUM(amount)) FROM bench_items")
            .fetch_one(&source.pool)
            .await?;

    let into_mariadb = args.target == "mariadb";
    let base_ticks = box_ticks();
    let base_secs = if into_mariadb {
        let base = MariaDb::create("bench_my_base").await;
        base.exec(MARIADB_TARGET_TABLE).await;
        let secs = mariadb_baseline(&source, &base);
        assert_eq!(mariadb_check(&base).await, source_check, "the baseline moved every row");
        eprintln!("baseline mariadb | LOAD DATA: {secs:.1}s");
        secs
    } else {
        let base = TestDb::create("bench_my_base").await;
        base.exec(PG_TABLE).await;
        let secs = baseline(&source, &base);
        assert_eq!(pg_check(&base).await, source_check, "the baseline moved every row");
        eprintln!("baseline mariadb | psql COPY: {secs:.1}s");
        secs
    };
    // The check's read above is the machine's too; it is small beside the copy.
    let base_cpu = (box_ticks() - base_ticks) / 100.0;
    let target = if into_mariadb {
        Some(MariaDb::create("bench_my_dst").await)
    } else {
        None
    };

    let mut cluster = Cluster::new("bench_my").await;
    cluster
        .start(&TaskSettings {
            source_url: source.url.clone(),
            source_table: "bench_items".into(),
            target_table: if into_mariadb {
                "bench_items"
            } else {
                "public.bench_items"
            }
            .into(),
            target_url: target.as_ref().map(|t| t.url.clone()).unwrap_or_default(),
            cursor_column: "updated_at".into(),
            shards: args.shards,
            page_size: args.page_size,
            safety_delay: "2s",
            poll_interval: "500ms",
            lease_ttl: "10s",
            overlap: "2s",
            ..TaskSettings::default()
        })
        .await;
    let started = Instant::now();
    let started_ticks = box_ticks();
    let mut pids = Vec::new();
    let mut metrics = Vec::new();
    for i in 0..args.workers {
        let listen = format!("127.0.0.1:{}", free_port());
        let index = cluster.spawn_worker(
            &format!("bench-my-w{i}"),
            args.shards.div_ceil(args.workers.max(1) as u32),
            &[("TIDEMARK_METRICS_LISTEN", &listen)],
        );
        pids.push(cluster.workers[index].child.id());
        metrics.push(listen);
    }
    let timeout = Duration::from_secs((rows as u64 / 2_000).max(300));
    cluster
        .wait_for("snapshot complete", timeout, |t| {
            t.snapshot_complete && t.rows_applied >= rows as u64
        })
        .await;
    let secs = started.elapsed().as_secs_f64();
    let cpu = (box_ticks() - started_ticks) / 100.0;
    let worker_cpu: f64 = pids.iter().map(|p| process_usage(*p).0).sum();
    let coordinator_cpu = cluster
        .coordinator
        .as_ref()
        .map_or(0.0, |c| process_usage(c.child.id()).0);
    let rss: Vec<String> = pids.iter().map(|p| format!("{:.0}", crate::peak_rss_mib(*p))).collect();
    let target_check = match &target {
        Some(target) => mariadb_check(target).await,
        None => pg_check(&cluster.target).await,
    };
    assert_eq!(target_check, source_check, "the target equals the source");
    let steps: Vec<String> = crate::step_seconds(&metrics)
        .await
        .into_iter()
        .map(|(step, s)| format!("{step} {s:.1}s"))
        .collect();
    let formats: Vec<String> = batches_by_format(&metrics)
        .await
        .into_iter()
        .map(|(format, n)| format!("{n:.0} {format}"))
        .collect();
    println!(
        "MariaDB -> {}, {rows} rows, {} workers x {} shards, page {}:\n  \
         baseline (mariadb --batch | {}, one stream): {base_secs:.1}s ({:.0} rows/s)\n  \
         tidemark snapshot: {secs:.1}s ({:.0} rows/s), {:.2}x the baseline; worker peak RSS {} MiB\n  \
         worker time per step (summed over workers): {}\n  \
         batches by COPY format: {}\n  \
         CPU seconds, whole machine: baseline {base_cpu:.1}, tidemark {cpu:.1} (its workers {worker_cpu:.1}, coordinator {coordinator_cpu:.1}), {:.2}x\n  \
         checked: count / sum(id) / sum(amount) = {source_check} on both sides",
        if into_mariadb { "MariaDB" } else { "PostgreSQL" },
        args.workers,
        args.shards,
        args.page_size,
        if into_mariadb { "LOAD DATA" } else { "COPY" },
        rows as f64 / base_secs,
        rows as f64 / secs,
        base_secs / secs,
        rss.join(", "),
        steps.join(", "),
        formats.join(", "),
        base_cpu / cpu,
    );
    Ok(())
}
