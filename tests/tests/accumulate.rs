//! Accumulate mode (seed 003): JSON events exploded and counted into a summary table, exactly
//! once per row across crashes and retries, with every row the transform or the target
//! rejects in the dead letters (fault matrix S14).
//!
//! Expected values are recomputed independently in SQL on the source (`jsonb_array_elements`
//! over the rows the generator made well-formed) and compared per app and per key.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::Row;
use tidemark_tests::{Cluster, TaskSettings, TestDb};

const TASK: &str = r#"mode = "accumulate"
filter = "type = 5"
transform = { explode = "$.apps[*].name", from = "event", as = "app_name" }
group_by = ["app_name"]
aggregates = { app_count = "count" }
max_retries = 2"#;

/// A name longer than the `varchar(12)` summary column of the retry test.
const LONG_NAME: &str = "an-app-with-a-very-long-name";

/// Events `from..=to`: type 5 except every 10th (type 3, filtered out); apps lists of 0–20
/// names out of 60. Of the type-5 rows, 2 % carry truncated (malformed) JSON, 1 in 300 an
/// `apps` that is an object, not an array, and with `long` 1 in 400 an app name too long for
/// a `varchar(12)` target. `kind` records which, for the independent recount.
async fn insert_events(db: &TestDb, from: i64, to: i64, long: bool) {
    db.exec(&format!(
        "INSERT INTO events (id, type, kind, event)
         SELECT g, t, kind, CASE kind
             WHEN 'malformed' THEN left(doc, length(doc) - 3)
             WHEN 'not_array' THEN '{{\"apps\": {{\"name\": \"app-' || (g % 60) || '\"}}}}'
             WHEN 'long' THEN '{{\"apps\": [{{\"name\": \"app-' || (g % 60) || '\"}}, {{\"name\": \"{LONG_NAME}\"}}]}}'
             ELSE doc END
         FROM (SELECT g,
                 CASE WHEN g % 10 = 0 THEN 3 ELSE 5 END AS t,
                 CASE WHEN g % 50 = 7 THEN 'malformed' WHEN g % 300 = 11 THEN 'not_array'
                      WHEN {long} AND g % 400 = 123 THEN 'long' ELSE 'ok' END AS kind,
                 (SELECT json_build_object('apps', coalesce(json_agg(json_build_object('name', 'app-' || ((g * 7 + i * 13) % 60))), '[]'::json))::text
                  FROM generate_series(1, (g % 21)::int) i) AS doc
               FROM generate_series({from}::bigint, {to}::bigint) g) s"
    ))
    .await;
}

async fn create_events(db: &TestDb, rows: i64, long: bool) {
    db.exec("CREATE TABLE events (id bigint PRIMARY KEY, type int NOT NULL, kind text NOT NULL, event text)")
        .await;
    insert_events(db, 1, rows, long).await;
}

async fn type5_rows(db: &TestDb) -> u64 {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM events WHERE type = 5")
        .fetch_one(&db.pool)
        .await
        .unwrap() as u64
}

/// The independent recount: apps per name over the type-5 rows of the given kinds.
async fn recount(db: &TestDb, kinds: &[&str]) -> BTreeMap<String, i64> {
    let kinds: Vec<String> = kinds.iter().map(|k| k.to_string()).collect();
    sqlx::query(
        "WITH good AS MATERIALIZED (SELECT event FROM events WHERE type = 5 AND kind = ANY($1)) \
         SELECT a->>'name', count(*) FROM good, jsonb_array_elements(good.event::jsonb->'apps') a \
         WHERE a->>'name' IS NOT NULL GROUP BY 1",
    )
    .bind(&kinds)
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|row| (row.get(0), row.get(1)))
    .collect()
}

async fn app_counts(db: &TestDb) -> BTreeMap<String, i64> {
    sqlx::query("SELECT app_name::text, app_count FROM app_stat")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

fn assert_counts(actual: &BTreeMap<String, i64>, expected: &BTreeMap<String, i64>, context: &str) {
    let wrong: Vec<String> = expected
        .keys()
        .chain(actual.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|app| actual.get(*app) != expected.get(*app))
        .map(|app| format!("{app}: target {:?}, recount {:?}", actual.get(app), expected.get(app)))
        .collect();
    assert!(wrong.is_empty(), "{context}: {} apps differ: {wrong:?}", wrong.len());
    assert!(!expected.is_empty(), "{context}: the recount is empty");
}

/// Key → (error class, status, retry count) of the task's dead letters.
async fn dead_letters(db: &TestDb) -> BTreeMap<String, (String, String, i32)> {
    sqlx::query("SELECT key, error_class, status, retry_count FROM tidemark_dead_letters WHERE task = 'items'")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2), row.get(3))))
        .collect()
}

/// Key → expected error class of the type-5 rows the generator made bad.
async fn expected_letters(db: &TestDb, kinds: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut expected = BTreeMap::new();
    for (kind, class) in kinds {
        let keys: Vec<String> = sqlx::query_scalar("SELECT id::text FROM events WHERE type = 5 AND kind = $1")
            .bind(kind)
            .fetch_all(&db.pool)
            .await
            .unwrap();
        expected.extend(keys.into_iter().map(|k| (k, class.to_string())));
    }
    expected
}

fn assert_letters(
    actual: &BTreeMap<String, (String, String, i32)>,
    expected: &BTreeMap<String, String>,
    status: &str,
    context: &str,
) {
    let wrong: Vec<String> = expected
        .keys()
        .chain(actual.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|key| {
            actual.get(*key).map(|(class, s, _)| (class.as_str(), s.as_str()))
                != expected.get(*key).map(|class| (class.as_str(), status))
        })
        .map(|key| format!("{key}: letter {:?}, expected {:?}", actual.get(key), expected.get(key)))
        .take(20)
        .collect();
    assert!(wrong.is_empty(), "{context}: dead letters differ: {wrong:?}");
    assert!(!expected.is_empty(), "{context}: no bad rows generated");
}

/// The totals equal the recount over the well-formed rows, and the dead letters are exactly
/// the malformed ones (INIT). Returns those letters.
async fn assert_exact(cluster: &Cluster, context: &str) -> BTreeMap<String, String> {
    assert_counts(
        &app_counts(&cluster.target).await,
        &recount(&cluster.source, &["ok"]).await,
        context,
    );
    let expected = expected_letters(&cluster.source, &BAD_KINDS).await;
    assert_letters(&dead_letters(&cluster.target).await, &expected, "INIT", context);
    expected
}

/// `dead-letters retry` for the task, with JSON output.
fn retry_args(address: &str) -> [&str; 7] {
    [
        "dead-letters",
        "retry",
        "--task",
        "items",
        "--json",
        "--coordinator",
        address,
    ]
}

fn settings() -> TaskSettings {
    TaskSettings {
        source_table: "public.events".into(),
        target_table: "public.app_stat".into(),
        cursor_column: String::new(),
        shards: 4,
        page_size: 5000,
        extra: TASK.into(),
        ..TaskSettings::default()
    }
}

const BAD_KINDS: [(&str, &str); 2] = [("malformed", "malformed_json"), ("not_array", "transform_error")];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accumulate_counts_every_app_exactly_and_dead_letters_exactly_the_malformed_rows() {
    let mut cluster = Cluster::new("accum").await;
    create_events(&cluster.source, 300_000, false).await;
    cluster.start(&settings()).await;
    cluster.spawn_worker("a", 4, &[]);
    cluster.spawn_worker("b", 4, &[]);
    let snapshot = type5_rows(&cluster.source).await;
    let started = std::time::Instant::now();
    cluster
        .wait_for("the snapshot's events", Duration::from_secs(300), |t| {
            t.rows_applied == snapshot
        })
        .await;
    eprintln!(
        "accumulated {snapshot} events in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert_counts(
        &app_counts(&cluster.target).await,
        &recount(&cluster.source, &["ok"]).await,
        "after the snapshot",
    );

    // Later events are counted by the same task's incremental phase.
    insert_events(&cluster.source, 300_001, 320_000, false).await;
    let total = type5_rows(&cluster.source).await;
    let status = cluster
        .wait_for("the later events", Duration::from_secs(120), |t| {
            t.rows_applied == total
        })
        .await;
    let expected = assert_exact(&cluster, "after the incremental events").await;
    let ledger_letters: i64 =
        sqlx::query_scalar("SELECT sum(dead_letters)::bigint FROM tidemark_ledger WHERE task = 'items'")
            .fetch_one(&cluster.target.pool)
            .await
            .unwrap();
    assert_eq!(
        ledger_letters as usize,
        expected.len(),
        "the ledger counts each letter once"
    );
    let status_letters = cluster.task_status().await.dead_letters;
    assert_eq!(
        status_letters.get("INIT").copied(),
        Some(expected.len() as u64),
        "{status:?}"
    );
    assert_eq!(cluster.task_status().await.mode, "accumulate");
    eprintln!("{} dead letters out of {total} events", expected.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accumulate_stays_exact_when_workers_are_killed_during_and_after_the_apply() {
    let mut cluster = Cluster::new("accum_kill").await;
    create_events(&cluster.source, 100_000, false).await;
    let settings = TaskSettings {
        page_size: 2000,
        ..settings()
    };
    cluster.start(&settings).await;
    // Killed inside the target transaction (counts added, not committed) and right after the
    // target committed (checkpoint not advanced): both batches are replayed from staging.
    let in_apply = cluster.spawn_worker("in-apply", 4, &[("TIDEMARK_CRASH_AT", "in_apply:3")]);
    let after_apply = cluster.spawn_worker("after-apply", 4, &[("TIDEMARK_CRASH_AT", "after_apply:5")]);
    for index in [in_apply, after_apply] {
        let exit = cluster.workers[index].wait_exit(Duration::from_secs(120));
        assert!(exit.is_some(), "worker {} did not crash", cluster.workers[index].name);
    }
    cluster.spawn_worker("survivor", 4, &[]);
    let total = type5_rows(&cluster.source).await;
    cluster
        .wait_for("every event", Duration::from_secs(300), |t| t.rows_applied == total)
        .await;
    assert_exact(&cluster, "after two kills").await;
    // Both killed batches were re-applied from staging by their next owner.
    let replayed: i64 = sqlx::query_scalar("SELECT count(*) FROM batches WHERE replayed AND state = 'COMMITTED'")
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();
    assert!(replayed >= 2, "{replayed} batches replayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_dead_letter_retries_count_each_row_once() {
    let mut cluster = Cluster::new("accum_retry").await;
    create_events(&cluster.source, 60_000, true).await;
    // The summary table's name column is too narrow for one app: rows naming it are rejected
    // by the target (bisected out of their batches) until the operator widens the column.
    cluster
        .target
        .exec("CREATE TABLE app_stat (app_name varchar(12) PRIMARY KEY, app_count bigint NOT NULL DEFAULT 0)")
        .await;
    cluster.start(&settings()).await;
    cluster.spawn_worker("a", 4, &[]);
    cluster.spawn_worker("b", 4, &[]);
    let total = type5_rows(&cluster.source).await;
    let started = std::time::Instant::now();
    cluster
        .wait_for("every event", Duration::from_secs(300), |t| t.rows_applied == total)
        .await;
    eprintln!("accumulated {total} events in {:.1}s", started.elapsed().as_secs_f64());
    assert_counts(
        &app_counts(&cluster.target).await,
        &recount(&cluster.source, &["ok"]).await,
        "rows naming the long app are held back",
    );
    let long = expected_letters(&cluster.source, &[("long", "string_data_right_truncation")]).await;
    let bad = expected_letters(&cluster.source, &BAD_KINDS).await;
    let mut all = long.clone();
    all.extend(bad.clone());
    assert_letters(&dead_letters(&cluster.target).await, &all, "INIT", "before the retries");

    cluster
        .target
        .exec("ALTER TABLE app_stat ALTER COLUMN app_name TYPE text")
        .await;
    // Two retry runs at once over the same letters: each row is claimed by one of them.
    let retry = || {
        std::process::Command::new(tidemark_tests::binary("tidemark-coordinator"))
            .args(retry_args(&cluster.address))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let started = std::time::Instant::now();
    let runs = [retry(), retry()];
    let mut totals = BTreeMap::<String, u64>::new();
    for run in runs {
        let output = run.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "retry failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let result: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        eprintln!("retry run: {result}");
        for field in ["resolved", "retry", "failed"] {
            *totals.entry(field.into()).or_default() += result[field].as_u64().unwrap();
        }
    }
    eprintln!("two concurrent retries took {:.1}s", started.elapsed().as_secs_f64());
    assert_eq!(totals["resolved"], long.len() as u64, "{totals:?}");
    assert_eq!(totals["retry"], bad.len() as u64, "{totals:?}");
    assert_eq!(totals["failed"], 0, "{totals:?}");
    assert_counts(
        &app_counts(&cluster.target).await,
        &recount(&cluster.source, &["ok", "long"]).await,
        "after two concurrent retries",
    );
    let letters = dead_letters(&cluster.target).await;
    let subset = |keys: &BTreeMap<String, String>| -> BTreeMap<String, (String, String, i32)> {
        letters
            .iter()
            .filter(|(key, _)| keys.contains_key(*key))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    assert_eq!(letters.len(), all.len());
    assert_letters(&subset(&long), &long, "RESOLVED", "retried long names");
    let still_bad = subset(&bad);
    assert_letters(&still_bad, &bad, "RETRY", "malformed rows failed again");
    assert!(still_bad.values().all(|(_, _, retries)| *retries == 1));

    // The second failure reaches max_retries = 2: FAILED; counts do not move.
    let (ok, stdout, stderr) = cluster.cli(&retry_args(&cluster.address));
    assert!(ok, "{stderr}");
    let result: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(result["failed"].as_u64(), Some(bad.len() as u64), "{result}");
    assert_eq!(result["resolved"].as_u64(), Some(0), "{result}");
    assert_counts(
        &app_counts(&cluster.target).await,
        &recount(&cluster.source, &["ok", "long"]).await,
        "after the failing retry",
    );
    let (ok, stdout, stderr) = cluster.cli(&[
        "dead-letters",
        "list",
        "--task",
        "items",
        "--status",
        "failed",
        "--limit",
        "100000",
        "--json",
        "--coordinator",
        cluster.address.as_str(),
    ]);
    assert!(ok, "{stderr}");
    let listed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let listed = listed["dead_letters"].as_array().unwrap();
    assert_eq!(listed.len(), bad.len());
    assert!(listed.iter().all(|l| l["retry_count"] == 2 && l["status"] == "FAILED"));
    let status = cluster.task_status().await;
    assert_eq!(status.dead_letters.get("FAILED").copied(), Some(bad.len() as u64));
    assert_eq!(status.dead_letters.get("RESOLVED").copied(), Some(long.len() as u64));

    let resolved = cluster.cli_json(&["dead-letters", "resolve", "--task", "items", "--all-failed"]);
    assert_eq!(resolved["resolved"].as_u64(), Some(bad.len() as u64), "{resolved}");
    let status = cluster.task_status().await;
    assert_eq!(status.dead_letters.get("RESOLVED").copied(), Some(all.len() as u64));
    assert!(!status.dead_letters.contains_key("FAILED"));
}

/// An event with one app, written with the id its sequence hands out.
const ONE_EVENT: &str = "INSERT INTO events (type, kind, event) VALUES (5, 'ok', '{\"apps\": [{\"name\": \"held\"}]}')";

/// S25: `bigserial` ids and concurrent writers. Transaction A takes a low id and commits
/// 4 s later, while 20 later events with higher ids commit and are read. A's event is counted
/// exactly once: the read never passes a key an open transaction may still add below. The
/// same in append mode, per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_low_id_committing_after_higher_ones_is_counted_once() {
    async fn run(tag: &str, append: bool) -> Cluster {
        let mut cluster = Cluster::new(tag).await;
        cluster
            .source
            .exec("CREATE TABLE events (id bigserial PRIMARY KEY, type int NOT NULL, kind text NOT NULL, event text)")
            .await;
        insert_events(&cluster.source, 1, 2_000, false).await;
        cluster.source.exec("SELECT setval('events_id_seq', 2000)").await;
        let task = if append {
            TaskSettings {
                target_table: "public.events".into(),
                extra: "mode = \"append\"".into(),
                ..settings()
            }
        } else {
            settings()
        };
        cluster.start(&TaskSettings { shards: 2, ..task }).await;
        cluster.spawn_worker(&format!("{tag}-w"), 2, &[]);
        let snapshot = type5_rows(&cluster.source).await;
        let expected_rows = if append { 2_000 } else { snapshot };
        cluster
            .wait_for("the snapshot", Duration::from_secs(120), |t| {
                t.rows_applied == expected_rows
            })
            .await;
        let mut held = cluster.source.pool.begin().await.unwrap();
        sqlx::query(ONE_EVENT).execute(&mut *held).await.unwrap();
        for _ in 0..20 {
            cluster.source.exec(ONE_EVENT).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        held.commit().await.unwrap();
        let all = if append { 2_021 } else { snapshot + 21 };
        cluster
            .wait_for("every event", Duration::from_secs(60), |t| t.rows_applied == all)
            .await;
        // Nothing more arrives later either.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(cluster.task_status().await.rows_applied, all, "{tag}: each event once");
        cluster
    }
    let (accumulate, append) = tokio::join!(run("idtail_acc", false), run("idtail_app", true));
    let counts = app_counts(&accumulate.target).await;
    assert_eq!(
        counts.get("held"),
        Some(&21),
        "21 'held' events, the late one included: {counts:?}"
    );
    assert_counts(
        &counts.into_iter().filter(|(app, _)| app != "held").collect(),
        &recount(&accumulate.source, &["ok"])
            .await
            .into_iter()
            .filter(|(app, _)| app != "held")
            .collect(),
        "the snapshot's apps",
    );
    let columns = ["id", "type", "kind", "event"];
    let diff = tidemark_tests::compare_table(
        &append.source.pool,
        &append.target.pool,
        "events",
        &["id"],
        &columns,
        "id",
    )
    .await;
    assert_eq!(diff.keys, 2_021);
    diff.assert_clean("append mode: every key once, the late one included");
}

/// S26: `tasks reinit` of an accumulate task builds a new summary table beside the live one,
/// counting every event once from zero: the live totals stay exact while it builds (never
/// emptied, never doubled), and exact after the switch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reinit_of_an_accumulate_task_keeps_the_totals_exact() {
    let mut cluster = Cluster::new("accreinit").await;
    create_events(&cluster.source, 20_000, false).await;
    cluster
        .start(&TaskSettings {
            shards: 2,
            ..settings()
        })
        .await;
    // Room for epoch 2's shards beside epoch 1's while it builds.
    cluster.spawn_worker("accreinit-w", 4, &[]);
    let rows = type5_rows(&cluster.source).await;
    cluster
        .wait_for("the snapshot", Duration::from_secs(120), |t| t.rows_applied == rows)
        .await;
    assert_exact(&cluster, "epoch 1").await;
    let reinit = cluster.cli_json(&["tasks", "reinit", "items"]);
    assert_eq!(reinit["epoch"], 2, "{reinit}");
    assert_eq!(cluster.task_status().await.epoch, 1);
    assert_exact(&cluster, "while epoch 2 builds beside").await;
    insert_events(&cluster.source, 20_001, 21_000, false).await;
    let rows = type5_rows(&cluster.source).await;
    cluster
        .wait_for("epoch 2 counted every event", Duration::from_secs(120), |t| {
            t.epoch == 2 && t.rows_applied == rows
        })
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_exact(&cluster, "after reinit (epoch 2)").await;
}
