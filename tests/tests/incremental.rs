//! Incremental correctness where timestamp cursors usually lose rows: late commits, ties on a
//! composite key, old values overwriting new ones, id regression and clocks that jump back.
//! Boundary of every test: everything committed in the source before the watermark; delete
//! policy: none (soft deletes are a data column).

use std::time::{Duration, Instant};

use sqlx::Row;
use tidemark_common::cursor::{Cursor, KeyValue, ShardRange};
use tidemark_common::pg::TableSql;
use tidemark_common::staging::Staging;
use tidemark_tests::otlp::{sample, scrape};
use tidemark_tests::{
    Cluster, ITEM_COLUMNS, KeyKind, TaskSettings, TestDb, compare_table, create_items, free_port, insert_items,
    key_states, write_changes,
};

const MICROS_PER_SECOND: i64 = 1_000_000;

async fn source_micros(db: &TestDb, expression: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT (extract(epoch from {expression}) * 1000000)::bigint"
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn row_name(db: &TestDb, id: i64) -> Option<String> {
    sqlx::query_scalar("SELECT name FROM items WHERE id = $1")
        .bind(id)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

/// What one late-commit run observed.
struct LateCommitRun {
    arrived: bool,
    watermark_while_open: i64,
    transaction_start: i64,
    late_rows: u64,
    late_max_micros: i64,
    warnings: Vec<String>,
    status_json: serde_json::Value,
}

/// Transaction A begins, inserts a row whose cursor time is its start, stays open 20 s while
/// other rows commit and many cycles pass, then commits.
async fn late_commit(tag: &str, open_transaction_bound: bool, overlap: &'static str) -> LateCommitRun {
    let mut cluster = Cluster::new(tag).await;
    create_items(&cluster.source, KeyKind::Bigint, 100).await;
    let settings = TaskSettings {
        shards: 2,
        overlap,
        open_transaction_bound,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker(&format!("{tag}-w"), 2, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;

    let mut transaction = cluster.source.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO items (id, seq, name, qty, price, payload, note, updated_at) \
         VALUES (1000001, 1000001, 'late', 1, 1, NULL, NULL, now())",
    )
    .execute(&mut *transaction)
    .await
    .unwrap();
    let transaction_start: i64 = sqlx::query_scalar("SELECT (extract(epoch from now()) * 1000000)::bigint")
        .fetch_one(&mut *transaction)
        .await
        .unwrap();
    // Other rows commit while A stays open.
    let held_until = Instant::now() + Duration::from_secs(20);
    let mut other = 0;
    let mut watermark_while_open = 0;
    while Instant::now() < held_until {
        other += 1;
        insert_items(
            &cluster.source,
            KeyKind::Bigint,
            2_000_000 + other,
            1,
            "clock_timestamp()",
        )
        .await;
        if Instant::now() + Duration::from_secs(5) > held_until && watermark_while_open == 0 {
            watermark_while_open = cluster.task_status().await.watermark_micros.unwrap_or(0);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    transaction.commit().await.unwrap();
    let committed = cluster.source_now_micros().await;
    cluster.wait_for_watermark(committed, Duration::from_secs(60)).await;
    let status = cluster.task_status().await;
    let others_present: i64 = sqlx::query_scalar("SELECT count(*) FROM items WHERE id > 2000000")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(others_present, other, "{tag}: every other row arrived");
    let (ok, stdout, stderr) = cluster.cli(&["status", "--coordinator", &cluster.address, "--json"]);
    assert!(ok, "{stderr}");
    LateCommitRun {
        arrived: row_name(&cluster.target, 1_000_001).await.is_some(),
        watermark_while_open,
        transaction_start,
        late_rows: status.late_rows,
        late_max_micros: status.late_max_micros,
        warnings: status.warnings,
        status_json: serde_json::from_str(&stdout).unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_commit_is_caught_by_the_open_transaction_bound_or_the_overlap() {
    let (bound, overlap, neither) = tokio::join!(
        late_commit("late_bound", true, "0s"),
        late_commit("late_overlap", false, "30s"),
        late_commit("late_none", false, "0s"),
    );
    // The open-transaction bound holds the watermark at A's start until A commits.
    assert!(bound.arrived, "bound on, overlap 0: the late row arrives");
    assert!(
        bound.watermark_while_open <= bound.transaction_start,
        "the watermark waited for the open transaction ({} > {})",
        bound.watermark_while_open,
        bound.transaction_start
    );
    assert_eq!(bound.late_rows, 0, "nothing was late: the window waited");
    // Without the bound the watermark passes A's start; the overlap re-read finds the row.
    assert!(overlap.arrived, "bound off, overlap 30s: the late row arrives");
    assert!(overlap.watermark_while_open > overlap.transaction_start);
    assert_eq!(overlap.late_rows, 1, "exactly the late row is counted as late");
    let late = &overlap.status_json["tasks"][0]["late_rows"];
    assert_eq!(late["count"], 1, "{late}");
    // Lateness is measured against the high bound of the cycle that found the row. That
    // cycle came after the commit, so its bound is at least the watermark published while A
    // was still open (about 15 s into its 20 s). How much more depends on how promptly the
    // cycle ran, which a loaded machine delays (16.3 s was measured in a full suite run).
    let open_for = overlap.watermark_while_open - overlap.transaction_start;
    assert!(
        open_for >= 5 * MICROS_PER_SECOND,
        "the watermark passed A's start by {open_for} µs"
    );
    assert!(
        late["max_ms"].as_i64().unwrap() * 1000 >= open_for - 1000,
        "{late} vs {open_for} µs"
    );
    assert!(
        overlap.late_max_micros >= open_for,
        "lateness {} µs, the watermark was {open_for} µs past A's start while A was open",
        overlap.late_max_micros
    );
    assert!(
        overlap
            .warnings
            .iter()
            .any(|w| w.contains("more than half the overlap")),
        "{:?}",
        overlap.warnings
    );
    // Proof that the scenario bites: with neither, the row is lost.
    assert!(!neither.arrived, "bound off, overlap 0: the late row is missed");
    assert!(neither.watermark_while_open > neither.transaction_start);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn composite_key_ties_in_one_millisecond_survive_a_crash_between_pages() {
    let mut cluster = Cluster::new("composite").await;
    cluster
        .source
        .exec(
            "CREATE TABLE orders (
                tenant_id integer NOT NULL,
                order_id bigint NOT NULL,
                amount numeric(12,2),
                status text NOT NULL,
                updated_at timestamptz(3) NOT NULL,
                PRIMARY KEY (tenant_id, order_id)
            );
            CREATE INDEX orders_cursor ON orders (updated_at, tenant_id, order_id);",
        )
        .await;
    let settings = TaskSettings {
        source_table: "public.orders".into(),
        key: vec!["tenant_id".into(), "order_id".into()],
        shards: 1,
        page_size: 700,
        overlap: "0s",
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    let first = cluster.spawn_worker("first", 1, &[("TIDEMARK_CRASH_AT", "after_commit:3")]);
    cluster
        .wait_for("snapshot of the empty table", Duration::from_secs(60), |t| {
            t.snapshot_complete
        })
        .await;
    // 5,000 rows, one transaction, one millisecond; order_id values repeat across tenants.
    cluster
        .source
        .exec(
            "INSERT INTO orders SELECT g % 7, g / 7, g / 100.0, 'new ' || g, now() FROM generate_series(1, 5000) g;
             ANALYZE orders;",
        )
        .await;
    let exit = cluster.workers[first]
        .wait_exit(Duration::from_secs(60))
        .expect("crash after the third page");
    assert!(!exit.success());
    cluster.spawn_worker("second", 1, &[]);
    let end = cluster.source_now_micros().await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;

    let columns = ["tenant_id", "order_id", "amount", "status", "updated_at"];
    let version = "(extract(epoch from updated_at) * 1000000)::bigint";
    let diff = compare_table(
        &cluster.source.pool,
        &cluster.target.pool,
        "orders",
        &["tenant_id", "order_id"],
        &columns,
        version,
    )
    .await;
    diff.assert_clean("composite key, 5,000 rows in one millisecond");
    assert_eq!(diff.keys, 5000);
    // None skipped, none read twice: pages of 700 whose bounds chain, 5,000 rows in all.
    let counts = cluster.committed_batch_counts().await;
    assert_eq!(counts, vec![700, 700, 700, 700, 700, 700, 700, 100]);

    // The cursor condition is served by the (updated_at, tenant_id, order_id) index: no sort.
    let typed: Vec<(String, String)> = columns
        .iter()
        .map(|c| {
            let sql_type = if *c == "updated_at" {
                "timestamp(3) with time zone"
            } else {
                "text"
            };
            (c.to_string(), sql_type.to_string())
        })
        .collect();
    let sql = tidemark_tests::cursor_table_sql("public.orders", &typed, &["tenant_id", "order_id"]);
    let t: i64 = source_micros(&cluster.source, "(SELECT min(updated_at) FROM orders)").await;
    let after = [
        KeyValue {
            sql_type: "integer".into(),
            value: "3".into(),
        },
        KeyValue {
            sql_type: "bigint".into(),
            value: "100".into(),
        },
    ];
    let explain = sql.explain_incremental_page(&ShardRange { lo: None, hi: None }, t, &after, t + 1000);
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
        .fetch_all(&cluster.source.pool)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(
        plan.contains("Index Scan using orders_cursor") || plan.contains("Index Only Scan using orders_cursor"),
        "{plan}"
    );
    assert!(!plan.contains("Sort"), "{plan}");
}

/// Runs a task over `items` with the given version setting, updates row 1 normally and then
/// with its cursor backdated by 30 s (inside the 60 s overlap). Returns the cluster.
async fn backdated_update(tag: &str, version: &str) -> Cluster {
    let mut cluster = Cluster::new(tag).await;
    create_items(&cluster.source, KeyKind::Bigint, 1000).await;
    let settings = TaskSettings {
        shards: 2,
        overlap: "60s",
        extra: format!("version = {version}"),
        ..TaskSettings::default()
    };
    if version.contains("trigger") {
        let config = cluster.write_config(&settings);
        let (ok, stdout, stderr) = cluster.cli(&[
            "source",
            "install",
            "--task",
            "items",
            "--config",
            config.to_str().unwrap(),
        ]);
        assert!(ok, "source install: {stderr}");
        assert!(stdout.contains("tidemark_row_version"), "{stdout}");
        // Installing twice is harmless.
        assert!(
            cluster
                .cli(&[
                    "source",
                    "install",
                    "--task",
                    "items",
                    "--config",
                    config.to_str().unwrap()
                ])
                .0
        );
    }
    cluster.start(&settings).await;
    cluster.spawn_worker(&format!("{tag}-w"), 2, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    cluster
        .source
        .exec("UPDATE items SET name = 'v2', updated_at = clock_timestamp() WHERE id = 1")
        .await;
    let end = cluster.source_now_micros().await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    assert_eq!(row_name(&cluster.target, 1).await.as_deref(), Some("v2"));
    cluster
        .source
        .exec("UPDATE items SET name = 'v3 backdated', updated_at = clock_timestamp() - interval '30 seconds' WHERE id = 1")
        .await;
    let end = cluster.source_now_micros().await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    cluster
}

/// Per key, every column including `tidemark_row_version`, which is also the version.
async fn assert_trigger_versions_equal(cluster: &Cluster, context: &str) {
    let mut columns = ITEM_COLUMNS.to_vec();
    columns.push("tidemark_row_version");
    compare_table(
        &cluster.source.pool,
        &cluster.target.pool,
        "items",
        &["id"],
        &columns,
        "tidemark_row_version",
    )
    .await
    .assert_clean(context);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_guard_with_trigger_versions_and_with_the_weak_default() {
    let (trigger, default) = tokio::join!(
        backdated_update("ver_trigger", "\"trigger\""),
        backdated_update("ver_default", "\"cursor\"")
    );

    // Trigger version: the newer write wins although its cursor time went back 30 s.
    assert_eq!(row_name(&trigger.target, 1).await.as_deref(), Some("v3 backdated"));
    assert_trigger_versions_equal(&trigger, "trigger versions").await;

    // The default version is the cursor time: the backdated write loses (documented).
    assert_eq!(
        row_name(&default.target, 1).await.as_deref(),
        Some("v2"),
        "the default version is fooled"
    );
    let target_version = key_states(&default.target.pool, "items", &["id"], &["id"], "_tidemark_version").await;
    let source_version = key_states(
        &default.source.pool,
        "items",
        &["id"],
        &["id"],
        "(extract(epoch from updated_at) * 1000000)::bigint",
    )
    .await;
    let key = "[1]".to_string();
    assert!(target_version[&key].version > source_version[&key].version);

    // An older batch applied again (as a new batch id, so the ledger does not stop it) never
    // overwrites newer values: the version guard alone holds.
    let first_batch =
        sqlx::query("SELECT manifest_path FROM batches WHERE state = 'COMMITTED' ORDER BY committed_at LIMIT 1")
            .fetch_one(&trigger.control.pool)
            .await
            .unwrap();
    let staging = Staging::open(&format!("file://{}", trigger.dir.0.join("staging").display())).unwrap();
    let (mut manifest, data) = staging.read_batch(&first_batch.get::<String, _>(0)).await.unwrap();
    assert!(Cursor::decode(&manifest.lower).is_ok());
    manifest.batch_id = "replayed-old-batch".into();
    let columns_json: serde_json::Value = sqlx::query_scalar("SELECT columns FROM epochs")
        .fetch_one(&trigger.control.pool)
        .await
        .unwrap();
    let columns: Vec<(String, String)> = serde_json::from_value(columns_json).unwrap();
    let sql = TableSql {
        version_column: Some("tidemark_row_version".into()),
        ..tidemark_tests::cursor_table_sql("public.items", &columns, &["id"])
    };
    let batch = tidemark_worker::apply::BatchToApply {
        sql: &sql,
        write: &tidemark_worker::apply::TaskWrite::Upsert,
        manifest: &manifest,
        data: &data,
        format: tidemark_common::copy_format::CopyFormat::from_data_format(&manifest.data_format).unwrap(),
        overlap: None,
        max_dead_letter_ratio: 0.5,
    };
    let applied = tidemark_worker::apply::apply_batch(
        &tidemark_common::pg::connector::target_pool(trigger.target.pool.clone()),
        &batch,
    )
    .await
    .unwrap();
    assert_eq!(applied.outcome, tidemark_worker::apply::ApplyOutcome::Applied);
    assert_trigger_versions_equal(&trigger, "after re-applying an old batch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_only_pauses_on_id_regression_and_applies_nothing_after_it() {
    let mut cluster = Cluster::new("append").await;
    cluster
        .source
        .exec(
            "CREATE TABLE events (id bigserial PRIMARY KEY, payload text NOT NULL);
             INSERT INTO events (payload) SELECT 'event ' || g FROM generate_series(1, 1000) g;",
        )
        .await;
    let settings = TaskSettings {
        source_table: "public.events".into(),
        cursor_column: String::new(),
        shards: 2,
        page_size: 300,
        extra: "mode = \"append\"".into(),
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("w", 2, &[]);
    cluster
        .wait_for("1,000 rows", Duration::from_secs(60), |t| t.rows_applied == 1000)
        .await;
    cluster
        .source
        .exec("INSERT INTO events (payload) SELECT 'more ' || g FROM generate_series(1, 100) g")
        .await;
    let status = cluster
        .wait_for("1,100 rows", Duration::from_secs(60), |t| t.rows_applied == 1100)
        .await;
    assert_eq!(status.phase, "incremental");
    let columns = ["id", "payload"];
    compare_table(
        &cluster.source.pool,
        &cluster.target.pool,
        "events",
        &["id"],
        &columns,
        "id",
    )
    .await
    .assert_clean("append-only");

    // Delete the top keys, reset the sequence below the committed cursor, re-insert.
    cluster
        .source
        .exec(
            "DELETE FROM events WHERE id > 500;
             SELECT setval('events_id_seq', 500);
             INSERT INTO events (payload) SELECT 'reused ' || g FROM generate_series(1, 50) g;",
        )
        .await;
    let status = cluster
        .wait_for("id regression pause", Duration::from_secs(30), |t| t.phase == "paused")
        .await;
    assert!(
        status.paused_reason.contains("id regression"),
        "{}",
        status.paused_reason
    );
    assert!(
        status.paused_reason.contains("Reinitialization required"),
        "{}",
        status.paused_reason
    );
    // New keys above the old cursor would normally arrive within a poll; paused, none does.
    cluster
        .source
        .exec("SELECT setval('events_id_seq', 5000); INSERT INTO events (payload) SELECT 'after ' || g FROM generate_series(1, 20) g;")
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let applied_after: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events WHERE id > 5000 OR payload LIKE 'reused%'")
            .fetch_one(&cluster.target.pool)
            .await
            .unwrap();
    assert_eq!(applied_after, 0, "nothing is applied after the regression");
    let status = cluster.task_status().await;
    assert_eq!((status.phase.as_str(), status.rows_applied), ("paused", 1100));
    let (ok, stdout, _) = cluster.cli(&["status", "--coordinator", &cluster.address]);
    assert!(ok && stdout.contains("paused: id regression"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_rollback_within_tolerance_loses_nothing_and_beyond_it_pauses() {
    let mut cluster = Cluster::new("clock").await;
    create_items(&cluster.source, KeyKind::Bigint, 500).await;
    // The test's source clock: real time plus a skew the test moves.
    cluster
        .source
        .exec("CREATE TABLE tidemark_test_clock (skew interval NOT NULL); INSERT INTO tidemark_test_clock VALUES ('0')")
        .await;
    let clock = "(clock_timestamp() + (SELECT skew FROM tidemark_test_clock))".to_string();
    let settings = TaskSettings {
        shards: 2,
        overlap: "5s",
        coordinator_env: vec![("TIDEMARK_SOURCE_CLOCK_SQL", clock.clone())],
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("w", 2, &[("TIDEMARK_SOURCE_CLOCK_SQL", &clock)]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    // Let the watermark reach the unskewed clock.
    let now = source_micros(&cluster.source, &clock).await;
    cluster.wait_for_watermark(now, Duration::from_secs(30)).await;

    // Back 3 s (tolerance = overlap = 5 s): rows written now carry times below the watermark.
    cluster
        .source
        .exec("UPDATE tidemark_test_clock SET skew = '-3 seconds'")
        .await;
    for round in 0..10 {
        cluster
            .source
            .exec(&format!(
                "UPDATE items SET name = 'skewed {round}', updated_at = clock_timestamp() + (SELECT skew FROM tidemark_test_clock)
                 WHERE id % 10 = {round}"
            ))
            .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let end = source_micros(&cluster.source, &clock).await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    cluster
        .items_diff()
        .await
        .assert_clean("clock back 3 s, within tolerance");
    assert_eq!(
        cluster.task_status().await.phase,
        "incremental",
        "no pause within tolerance"
    );

    // Back 60 s: beyond tolerance, the task pauses with a named reason.
    cluster
        .source
        .exec("UPDATE tidemark_test_clock SET skew = '-63 seconds'")
        .await;
    let status = cluster
        .wait_for("clock pause", Duration::from_secs(30), |t| t.phase == "paused")
        .await;
    assert!(
        status.paused_reason.starts_with("clock moved backwards"),
        "{}",
        status.paused_reason
    );

    // The operator fixes the clock and resumes; the task catches up.
    cluster.source.exec("UPDATE tidemark_test_clock SET skew = '0'").await;
    let (ok, stdout, stderr) = cluster.cli(&["tasks", "resume", "items", "--coordinator", &cluster.address]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("resumed"), "{stdout}");
    cluster
        .source
        .exec("UPDATE items SET name = 'after resume', updated_at = clock_timestamp() WHERE id = 7")
        .await;
    let end = cluster.source_now_micros().await;
    let status = cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    assert_eq!(status.phase, "incremental");
    cluster.items_diff().await.assert_clean("after resume");

    // An operator pause while workers commit every poll: their commits are refused, and they
    // release their shards (a dropped but unreleased shard would stay owned for ever).
    let paused = cluster.cli_json(&["tasks", "pause", "items", "--reason", "maintenance"]);
    assert_eq!(
        (paused["task"].as_str(), paused["paused"].as_bool()),
        (Some("items"), Some(true))
    );
    let status = cluster
        .wait_for("every shard released", Duration::from_secs(30), |t| {
            t.shards.iter().all(|s| s.owner.is_empty())
        })
        .await;
    assert_eq!(
        (status.phase.as_str(), status.paused_reason.as_str()),
        ("paused", "maintenance")
    );
    assert!(
        cluster
            .cli(&["tasks", "resume", "items", "--coordinator", &cluster.address])
            .0
    );
    cluster
        .write_and_converge(
            "UPDATE items SET name = 'after pause', updated_at = clock_timestamp() WHERE id = 8",
            "after an operator pause and resume",
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_with_a_concurrent_writer_converges() {
    let rows = 200_000;
    let mut cluster = Cluster::new("converge").await;
    create_items(&cluster.source, KeyKind::Bigint, rows).await;
    cluster.start(&TaskSettings::default()).await;
    for i in 0..3 {
        cluster.spawn_worker(&format!("w{i}"), 3, &[]);
    }
    // Inserts, updates and soft deletes while the snapshot runs.
    let writes_end = write_changes(&cluster.source, KeyKind::Bigint, rows, 40).await;
    let during_snapshot = !cluster.task_status().await.snapshot_complete;
    cluster.wait_for_watermark(writes_end, Duration::from_secs(300)).await;
    let diff = cluster.items_diff().await;
    diff.assert_clean("snapshot with a concurrent writer");
    assert_eq!(diff.keys, rows as usize + 10_000);
    let soft_deleted: i64 = sqlx::query_scalar("SELECT count(*) FROM items WHERE note = 'deleted'")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(soft_deleted, 2000, "soft deletes arrive as data");
    eprintln!(
        "writer finished {} the snapshot",
        if during_snapshot { "during" } else { "after" }
    );
}

/// Each cycle re-reads its last `overlap` of changes. Rows the shard applied already, unchanged,
/// are left out of its batches: the re-read costs reads, not staged rows or new row versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_re_reads_leave_out_the_rows_the_shard_applied_unchanged() {
    let mut cluster = Cluster::new("reread").await;
    create_items(&cluster.source, KeyKind::Bigint, 2_000).await;
    let settings = TaskSettings {
        shards: 2,
        overlap: "3s",
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    let metrics = format!("127.0.0.1:{}", free_port());
    cluster.spawn_worker("w", 2, &[("TIDEMARK_METRICS_LISTEN", &metrics)]);
    let now = cluster.source_now_micros().await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;

    // Rows committed from here on: the 200 changed rows' first delivery, and nothing more.
    let applied_at: String = sqlx::query_scalar("SELECT now()::text")
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();
    let unchanged_before = rows_unchanged(&metrics).await;
    cluster
        .source
        .exec("UPDATE items SET qty = coalesce(qty, 0) + 1, updated_at = clock_timestamp() WHERE id % 10 = 1")
        .await;
    let changed = cluster.source_now_micros().await;
    cluster.wait_for_watermark(changed, Duration::from_secs(60)).await;
    let versions = "SELECT id::text || ':' || xmin::text FROM items WHERE id % 10 = 1 ORDER BY id";
    let written: Vec<String> = sqlx::query_scalar(versions)
        .fetch_all(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(written.len(), 200);

    // Past the overlap: the cycles since have re-read the 200 rows, at least once each.
    cluster
        .wait_for_watermark(changed + 4 * MICROS_PER_SECOND, Duration::from_secs(60))
        .await;
    let staged: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(row_count), 0)::bigint FROM batches WHERE state = 'COMMITTED' AND committed_at > $1::timestamptz",
    )
    .bind(&applied_at)
    .fetch_one(&cluster.control.pool)
    .await
    .unwrap();
    assert_eq!(
        staged, 200,
        "only the first delivery of the 200 changed rows was staged"
    );
    let left_out = rows_unchanged(&metrics).await - unchanged_before;
    assert!(
        left_out >= 200.0,
        "the overlap re-read the 200 rows and left them out ({left_out} rows left out)"
    );
    let after: Vec<String> = sqlx::query_scalar(versions)
        .fetch_all(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(after, written, "no row version was rewritten by the re-reads");
    cluster.items_diff().await.assert_clean("after the re-reads");
}

async fn rows_unchanged(metrics: &str) -> f64 {
    sample(
        &scrape(metrics).await,
        "tidemark_rows_unchanged_total",
        "task=\"items\"",
    )
    .unwrap_or(0.0)
}

/// A row changed and changed back at the same version (the writer sets the cursor time) is
/// applied each time: the overlap leaves a row out only when it equals the last row the shard
/// applied for its key, not any row it once applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_changed_back_at_the_same_version_reaches_the_target() {
    let mut cluster = Cluster::new("flipback").await;
    create_items(&cluster.source, KeyKind::Bigint, 100).await;
    let settings = TaskSettings {
        shards: 1,
        overlap: "30s",
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("w", 1, &[]);
    let pinned: String = sqlx::query_scalar("SELECT clock_timestamp()::timestamptz(3)::text")
        .fetch_one(&cluster.source.pool)
        .await
        .unwrap();
    for name in ["first", "second", "first", "second", "first"] {
        cluster
            .source
            .exec(&format!(
                "UPDATE items SET name = '{name}', updated_at = '{pinned}' WHERE id IN (7, 8)"
            ))
            .await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let names: Vec<String> = sqlx::query_scalar("SELECT name FROM items WHERE id IN (7, 8) ORDER BY id")
                .fetch_all(&cluster.target.pool)
                .await
                .unwrap();
            if names == [name, name] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the target kept {names:?} for 20 s after the source wrote {name:?} at the same version"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let now = cluster.source_now_micros().await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;
    cluster
        .items_diff()
        .await
        .assert_clean("after the same-version changes");
}
