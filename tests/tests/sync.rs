//! `tidemark sync`: one process, no etcd, the control state in the embedded store (a SQLite
//! file in the state directory) or, with `--control target`, in a schema of the target. The
//! real binary against real PostgreSQL databases, read through a role with only the README's
//! grants. Every test ends in a per-key comparison of the target with the source (value,
//! version).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tidemark_tests::{
    ITEM_COLUMNS, KeyKind, Process, TempDir, TestDb, TestRole, binary, compare, create_items, key_states, write_changes,
};

const VERSION: &str = "(extract(epoch from updated_at) * 1000000)::bigint";

/// A source with `rows` items and a role that may read them (SELECT, pg_read_all_stats for the
/// open-transaction bound), a target, and the role's source URL.
async fn source_and_target(tag: &str, rows: i64) -> (TestRole, TestDb, TestDb, String) {
    let role = TestRole::create(&format!("{tag}_reader")).await;
    let source = TestDb::create(&format!("{tag}_src")).await;
    let target = TestDb::create(&format!("{tag}_dst")).await;
    create_items(&source, KeyKind::Bigint, rows).await;
    source
        .exec(&format!(
            "GRANT CONNECT ON DATABASE \"{db}\" TO \"{r}\"; GRANT USAGE ON SCHEMA public TO \"{r}\";
             GRANT SELECT ON public.items TO \"{r}\"; GRANT pg_read_all_stats TO \"{r}\"",
            db = source.name,
            r = role.name
        ))
        .await;
    let url = source.url_as(&role.name);
    (role, source, target, url)
}

fn sync(name: &str, dir: &Path, args: &[&str]) -> Process {
    let mut all = vec!["sync"];
    all.extend_from_slice(args);
    Process::spawn(name, &binary("tidemark"), &all, &[("RUST_LOG", "warn")], dir)
}

fn flags<'a>(source: &'a str, target: &'a str, state: &'a str) -> Vec<&'a str> {
    vec![
        "--source",
        source,
        "--table",
        "public.items",
        "--target",
        target,
        "--state",
        state,
    ]
}

async fn assert_converged(source: &TestDb, target: &TestDb, context: &str) {
    compare(&source.pool, &target.pool, &["id"], ITEM_COLUMNS, "updated_at")
        .await
        .assert_clean(context);
}

/// Polls until the target matches the source per key, or panics with the last difference.
async fn wait_converged(source: &TestDb, target: &TestDb, timeout: Duration, context: &str) {
    let deadline = Instant::now() + timeout;
    loop {
        let diff = compare(&source.pool, &target.pool, &["id"], ITEM_COLUMNS, "updated_at").await;
        if diff.lost.is_empty() && diff.stale.is_empty() && diff.phantom.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            diff.assert_clean(context);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `--once` under live writes catches every key up to at least the state it had when the
/// command started, then exits 0 with a summary; `--follow` then keeps the target in step per
/// key until SIGINT, which drains and exits 0. A second sync on the same state is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_then_follow_keep_every_key_with_live_writes() {
    let (_role, source, target, source_url) = source_and_target("sync_once", 100_000).await;
    let source = Arc::new(source);
    let dir = TempDir::new("sync_once");
    let state = dir.0.join("state").display().to_string();
    let args = flags(&source_url, &target.url, &state);

    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let writing = writing.clone();
        let db = source.clone();
        tokio::spawn(async move {
            let mut rows = 100_000;
            while writing.load(Ordering::SeqCst) {
                write_changes(&db, KeyKind::Bigint, rows, 1).await;
                rows += 250;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            rows
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Every key as it was before the command started: the run must end at or past it.
    let before = key_states(&source.pool, "items", &["id"], ITEM_COLUMNS, VERSION).await;
    let mut once = sync("sync-once", &dir.0, &args);
    let status = once.wait_exit(Duration::from_secs(120)).expect("--once exits");
    let log = once.log_text();
    assert!(status.success(), "--once failed: {log}");
    assert!(log.contains("key: id (the primary key)"), "{log}");
    assert!(log.contains("cursor: updated_at"), "{log}");
    assert!(log.contains("rows applied, caught up to"), "{log}");
    assert!(
        dir.0.join("state/items.control.db").exists(),
        "the control state is the embedded store in --state"
    );
    let after = key_states(&target.pool, "items", &["id"], ITEM_COLUMNS, "_tidemark_version").await;
    let behind: Vec<&String> = before
        .iter()
        .filter(|(key, was)| after.get(*key).is_none_or(|now| now.version < was.version))
        .map(|(key, _)| key)
        .collect();
    assert!(
        behind.is_empty(),
        "{} of {} keys ended behind the state they had before --once started, e.g. {:?}",
        behind.len(),
        before.len(),
        behind.iter().take(3).collect::<Vec<_>>()
    );
    writing.store(false, Ordering::SeqCst);
    let rows = writer.await.unwrap();

    let mut follow_args = args.clone();
    follow_args.push("--follow");
    let mut follow = sync("sync-follow", &dir.0, &follow_args);
    wait_converged(&source, &target, Duration::from_secs(60), "follow caught up").await;
    // The same state cannot have two syncs: the second is refused by name.
    let mut second = sync("sync-second", &dir.0, &args);
    let refused = second
        .wait_exit(Duration::from_secs(60))
        .expect("the second sync exits");
    assert_eq!(refused.code(), Some(2), "{}", second.log_text());
    assert!(
        second.log_text().contains("another coordinator with in-process leases"),
        "{}",
        second.log_text()
    );
    write_changes(&source, KeyKind::Bigint, rows, 4).await;
    wait_converged(&source, &target, Duration::from_secs(60), "follow with writes").await;
    follow.signal("INT");
    let status = follow
        .wait_exit(Duration::from_secs(60))
        .expect("--follow drains and exits");
    assert!(status.success(), "--follow after SIGINT: {}", follow.log_text());
    assert!(follow.log_text().contains("finishing the batches in flight"));
    assert_converged(&source, &target, "after the drain").await;
}

/// kill -9 in the middle of the snapshot, three times; the same command each time resumes
/// from the checkpoints (the ledger's batches of a killed run stay applied, once each) and
/// the last run converges per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_snapshot_the_same_command_resumes() {
    let (_role, source, target, source_url) = source_and_target("sync_kill", 30_000).await;
    let dir = TempDir::new("sync_kill");
    // Small pages make the snapshot long enough to kill; the task comes from a config file
    // (the cluster's format: its etcd settings are ignored).
    let config = dir.0.join("task.toml");
    std::fs::write(
        &config,
        format!(
            r#"[coordinator]
listen = "127.0.0.1:7400"
etcd_endpoints = ["http://127.0.0.1:1"]
control_db = "sqlite://{control}"
staging = "file://{staging}"

[[tasks]]
name = "items"
source = "{source_url}"
source_table = "public.items"
target = "{target}"
target_table = "public.items"
key = ["id"]
cursor_column = "updated_at"
shards = 4
page_size = 100
safety_delay = "1s"
overlap = "2s"
"#,
            target = target.url,
            control = dir.0.join("state/control.db").display(),
            staging = dir.0.join("staging").display()
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let mut batches_at_kill = 0;
    for round in 0..3 {
        let mut run = sync(&format!("sync-kill-{round}"), &dir.0, &["--config", &config]);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let batches: i64 = sqlx::query_scalar("SELECT count(*) FROM tidemark_ledger")
                .fetch_one(&target.pool)
                .await
                .unwrap_or(0);
            if batches >= batches_at_kill + 10 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: no progress: {}",
                run.log_text()
            );
            assert!(
                run.child.try_wait().unwrap().is_none(),
                "round {round} ended: {}",
                run.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        run.kill9();
        batches_at_kill = sqlx::query_scalar("SELECT count(*) FROM tidemark_ledger")
            .fetch_one(&target.pool)
            .await
            .unwrap();
    }
    let rows_at_last_kill: i64 = sqlx::query_scalar("SELECT count(*) FROM items")
        .fetch_one(&target.pool)
        .await
        .unwrap();
    assert!(
        rows_at_last_kill < 30_000,
        "the snapshot finished before the last kill ({rows_at_last_kill} rows): the test proves nothing"
    );
    let mut last = sync("sync-kill-final", &dir.0, &["--config", &config]);
    let status = last.wait_exit(Duration::from_secs(180)).expect("the last run exits");
    assert!(status.success(), "{}", last.log_text());
    assert_converged(&source, &target, "after three kills and a full run").await;
    // Resumed, not restarted: the rows committed over all four runs (the control state's
    // checkpoint history, in the embedded store's file) are the table once, plus at
    // most the batches in flight at each kill (4 shards x 100 rows) and the overlap's re-read.
    // Each killed run had committed 1,000 rows or more, so a run that started over would add
    // 1,000 or more; control state kept anywhere else would leave less than the table.
    let control = sqlx::SqlitePool::connect(&format!("sqlite://{}", dir.0.join("state/control.db").display()))
        .await
        .unwrap();
    let committed: i64 = sqlx::query_scalar("SELECT sum(row_count) FROM checkpoint_history")
        .fetch_one(&control)
        .await
        .unwrap();
    assert!(
        (30_000..=30_000 + 3 * 4 * 100).contains(&committed),
        "{committed} rows committed for a 30,000-row table over three killed runs and a full one"
    );
}

/// What the user gets wrong gets one line naming it, and exit code 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_one_line_and_exit_2() {
    let (_role, source, target, source_url) = source_and_target("sync_bad", 10).await;
    source
        .exec("CREATE TABLE nokey (a int, t timestamptz NOT NULL); GRANT SELECT ON nokey TO PUBLIC")
        .await;
    let dir = TempDir::new("sync_bad");
    let state = dir.0.join("state").display().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--source".into(), "http://example.com/db".into()],
            "--source: unknown database URL scheme \"http\"",
        ),
        (
            vec!["--table".into(), "public.nokey".into()],
            "public.nokey has no primary key: pass --key",
        ),
        (
            vec!["--cursor".into(), "changed_at".into()],
            "--cursor changed_at: public.items has no such column",
        ),
        (
            vec!["--table".into(), "public.absent".into()],
            "--table public.absent: no such table in the source",
        ),
    ];
    for (n, (overrides, expected)) in cases.into_iter().enumerate() {
        let mut args: Vec<String> = flags(&source_url, &target.url, &state)
            .into_iter()
            .map(String::from)
            .collect();
        for pair in overrides.chunks(2) {
            match args.iter().position(|a| *a == pair[0]) {
                Some(at) => args[at + 1] = pair[1].clone(),
                None => args.extend(pair.iter().cloned()),
            }
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut run = sync(&format!("sync-bad-{n}"), &dir.0, &args);
        let status = run.wait_exit(Duration::from_secs(60)).expect("exits");
        let log = run.log_text();
        assert_eq!(status.code(), Some(2), "{expected}: {log}");
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 1, "one line for {expected}: {log}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains(expected), "{log}");
    }
    // Nothing was created in the target for any of them.
    let tables: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        .fetch_one(&target.pool)
        .await
        .unwrap();
    assert_eq!(tables, 0);
    // A control state that cannot be: one line, exit 2.
    let mut args = flags(&source_url, &target.url, &state);
    args.extend(["--control", "mysql://root@127.0.0.1/x"]);
    let mut run = sync("sync-bad-control", &dir.0, &args);
    assert_eq!(run.wait_exit(Duration::from_secs(60)).expect("exits").code(), Some(2));
    assert!(
        run.log_text().contains("error: --control is not PostgreSQL"),
        "{}",
        run.log_text()
    );
}

/// `--control target`: the control state in the schema `tidemark_<name>` of a PostgreSQL
/// target instead of the embedded store, and no file for it in the state directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_state_can_live_in_the_target() {
    let (_role, source, target, source_url) = source_and_target("sync_ctl", 2_000).await;
    let dir = TempDir::new("sync_ctl");
    let state = dir.0.join("state").display().to_string();
    let mut args = flags(&source_url, &target.url, &state);
    args.extend(["--control", "target"]);
    let mut once = sync("sync-ctl", &dir.0, &args);
    let status = once.wait_exit(Duration::from_secs(120)).expect("--once exits");
    assert!(status.success(), "{}", once.log_text());
    assert_converged(&source, &target, "control state in the target").await;
    let committed: i64 = sqlx::query_scalar("SELECT sum(row_count)::bigint FROM tidemark_items.checkpoint_history")
        .fetch_one(&target.pool)
        .await
        .unwrap();
    assert!(committed >= 2_000, "{committed} rows in the target's control schema");
    assert!(!dir.0.join("state/items.control.db").exists());
}

/// Moving up: a sync's embedded control state, copied into a PostgreSQL control database by
/// `tidemark control copy`, lets a cluster (etcd leases, a coordinator process, two worker
/// processes) continue from the sync's checkpoints: the same epoch, no snapshot again, the
/// changes made since converge per key. A copy into a control database that holds a task is
/// refused, and so is one while the sync runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_moves_up_to_a_cluster_with_its_checkpoints() {
    let mut cluster = tidemark_tests::Cluster::new("sync_up").await;
    create_items(&cluster.source, KeyKind::Bigint, 5_000).await;
    let state = cluster.dir.0.join("state").display().to_string();
    let args = flags(&cluster.source.url, &cluster.target.url, &state);
    let mut once = sync("sync-up", &cluster.dir.0, &args);
    let status = once.wait_exit(Duration::from_secs(120)).expect("--once exits");
    assert!(status.success(), "{}", once.log_text());
    cluster.items_diff().await.assert_clean("the sync");

    let from = format!("sqlite://{state}/items.control.db");
    let copy = |to: &str| {
        std::process::Command::new(binary("tidemark"))
            .args(["control", "copy", "--from", &from, "--to", to])
            .output()
            .unwrap()
    };
    // Not while a sync holds the state.
    let mut follow_args = args.clone();
    follow_args.push("--follow");
    let mut follow = sync("sync-up-follow", &cluster.dir.0, &follow_args);
    follow
        .wait_for_log("admin commands reach this sync", Duration::from_secs(60))
        .await;
    let held = copy(&cluster.control.url);
    assert!(!held.status.success());
    assert!(
        String::from_utf8_lossy(&held.stderr).contains("another coordinator with in-process leases"),
        "{}",
        String::from_utf8_lossy(&held.stderr)
    );
    follow.signal("INT");
    assert!(follow.wait_exit(Duration::from_secs(60)).expect("drains").success());

    let copied = copy(&cluster.control.url);
    let said = String::from_utf8_lossy(&copied.stdout);
    assert!(copied.status.success(), "{}", String::from_utf8_lossy(&copied.stderr));
    assert!(said.contains("tasks 1, epochs 1, checkpoints 8"), "{said}");
    let again = copy(&cluster.control.url);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds 1 task(s)"));
    let synced_rows: i64 = sqlx::query_scalar("SELECT sum(row_count)::bigint FROM checkpoint_history")
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();
    assert!(synced_rows >= 5_000, "{synced_rows} rows in the copied history");
    let copied_ids: i64 = sqlx::query_scalar("SELECT max(id) FROM checkpoint_history")
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();

    cluster.start(&tidemark_tests::TaskSettings::default()).await;
    cluster.spawn_worker("w1", 8, &[]);
    cluster.spawn_worker("w2", 8, &[]);
    cluster
        .write_and_converge(
            "UPDATE items SET name = name || ' moved', updated_at = clock_timestamp() WHERE id % 10 = 0; \
             INSERT INTO items (id, seq, name, qty, price, payload, note, updated_at) \
             SELECT g, g, 'after ' || g, 1, 1.5, NULL, NULL, clock_timestamp() FROM generate_series(5001, 5300) g",
            "the cluster after the move",
        )
        .await;
    let task = cluster.task_status().await;
    assert_eq!(task.epoch, 1, "the sync's epoch continues");
    // Only the changes were read again (800 rows, and the overlap's re-read), not the table.
    let since: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(row_count), 0)::bigint FROM checkpoint_history WHERE id > $1")
            .bind(copied_ids)
            .fetch_one(&cluster.control.pool)
            .await
            .unwrap();
    eprintln!("history: {synced_rows} rows by the sync, {since} by the cluster");
    assert!((800..5_000).contains(&since), "{since} rows committed by the cluster");
}
