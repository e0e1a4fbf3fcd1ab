//! Deletes, reconciliation and the source contract (issue 5). Every test states its boundary
//! B (everything committed in the source before the watermark, or before the reconciliation
//! run) and its delete policy D, and checks `Target = Expected(Source, B, D)` per key: every
//! column, the version, and the delete state.

use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use tidemark_tests::mariadb::{MariaDb, MariaUser};
use tidemark_tests::{Cluster, TaskSettings, TestDb, TestRole, key_states};

const COLUMNS: &[&str] = &["id", "name", "qty", "updated_at", "deleted_at"];
const CURSOR_VERSION: &str = "(extract(epoch from updated_at) * 1000000)::bigint";

/// `items` with a nullable `deleted_at` (the soft-delete mark) and a graveyard of deleted keys
/// (with the round that deleted them) for re-inserts.
async fn create_fixture(db: &TestDb, rows: i64) {
    db.exec(&format!(
        "CREATE TABLE items (
            id bigint PRIMARY KEY,
            name text NOT NULL,
            qty integer NOT NULL,
            updated_at timestamptz(3) NOT NULL,
            deleted_at timestamptz
        );
        CREATE INDEX items_cursor ON items (updated_at, id);
        CREATE TABLE graveyard (id bigint PRIMARY KEY, round integer NOT NULL);
        INSERT INTO items SELECT g, 'item ' || g, g % 100, now() - interval '1 hour' + (g % 3600) * interval '1 second', NULL
        FROM generate_series(1, {rows}) g;"
    ))
    .await;
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Deletes {
    /// `DELETE` (tombstone_table and reconcile policies).
    Hard,
    /// `deleted_at = now()` (soft policy).
    Soft,
}

/// A delete-heavy writer: per round 40 updates, 30 deletes, 20 inserts and 10 re-inserts of
/// keys deleted in earlier rounds — 30 % of the operations are deletes. Returns the source
/// time after the last commit.
async fn write_with_deletes(db: &TestDb, deletes: Deletes, first_new_id: i64, rounds: i64) -> i64 {
    for round in 0..rounds {
        let live = if deletes == Deletes::Soft {
            "deleted_at IS NULL"
        } else {
            "true"
        };
        db.exec(&format!(
            "UPDATE items SET name = name || ' u{round}', qty = qty + 1, updated_at = clock_timestamp()
             WHERE id IN (SELECT id FROM items WHERE {live} ORDER BY random() LIMIT 40)"
        ))
        .await;
        match deletes {
            Deletes::Hard => {
                db.exec(&format!(
                    "WITH gone AS (DELETE FROM items WHERE id IN (SELECT id FROM items ORDER BY random() LIMIT 30) RETURNING id)
                     INSERT INTO graveyard SELECT id, {round} FROM gone ON CONFLICT (id) DO UPDATE SET round = EXCLUDED.round"
                ))
                .await;
            }
            Deletes::Soft => {
                db.exec(&format!(
                    "WITH gone AS (UPDATE items SET deleted_at = clock_timestamp(), updated_at = clock_timestamp()
                       WHERE id IN (SELECT id FROM items WHERE deleted_at IS NULL ORDER BY random() LIMIT 30) RETURNING id)
                     INSERT INTO graveyard SELECT id, {round} FROM gone ON CONFLICT (id) DO UPDATE SET round = EXCLUDED.round"
                ))
                .await;
            }
        }
        let first = first_new_id + round * 20;
        db.exec(&format!(
            "INSERT INTO items SELECT g, 'new ' || g, 0, clock_timestamp(), NULL FROM generate_series({first}, {first} + 19) g"
        ))
        .await;
        match deletes {
            Deletes::Hard => {
                db.exec(&format!(
                    "WITH back AS (DELETE FROM graveyard WHERE id IN (SELECT g.id FROM graveyard g WHERE g.round < {round}
                       AND NOT EXISTS (SELECT 1 FROM items i WHERE i.id = g.id) ORDER BY random() LIMIT 10) RETURNING id)
                     INSERT INTO items SELECT id, 'again ' || id, 1, clock_timestamp(), NULL FROM back"
                ))
                .await;
            }
            Deletes::Soft => {
                db.exec(&format!(
                    "WITH back AS (DELETE FROM graveyard WHERE id IN (SELECT id FROM graveyard WHERE round < {round}
                       ORDER BY random() LIMIT 10) RETURNING id)
                     UPDATE items SET deleted_at = NULL, name = 'again ' || id, updated_at = clock_timestamp()
                     WHERE id IN (SELECT id FROM back)"
                ))
                .await;
            }
        }
    }
    sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Per-key check of `Target = Expected(Source, B, D)`:
/// - every live source row is in the target, live, with every column and its version equal;
/// - a hard target holds no other key;
/// - a soft target holds other keys only flagged `_tidemark_deleted`, and each of them is
///   deleted in the source (absent, or marked) — never a live row flagged, never a deleted
///   row live.
async fn assert_expected(cluster: &Cluster, source_live: &str, source_version: &str, soft_target: bool, context: &str) {
    let expected = key_states(
        &cluster.source.pool,
        &format!("items WHERE {source_live}"),
        &["id"],
        COLUMNS,
        source_version,
    )
    .await;
    let live_filter = if soft_target {
        "items WHERE NOT _tidemark_deleted"
    } else {
        "items"
    };
    let actual = key_states(&cluster.target.pool, live_filter, &["id"], COLUMNS, "_tidemark_version").await;
    let mut lost = Vec::new();
    let mut stale = Vec::new();
    for (key, want) in &expected {
        match actual.get(key) {
            None => lost.push(key.clone()),
            Some(have) if have != want => stale.push((key.clone(), want.clone(), have.clone())),
            Some(_) => {}
        }
    }
    let resurrected: Vec<&String> = actual.keys().filter(|k| !expected.contains_key(*k)).collect();
    assert!(
        lost.is_empty() && stale.is_empty() && resurrected.is_empty(),
        "{context}: {} live keys; {} lost (e.g. {:?}), {} stale (e.g. {:?}), {} deleted in the source but live in the target (e.g. {:?})",
        expected.len(),
        lost.len(),
        lost.iter().take(3).collect::<Vec<_>>(),
        stale.len(),
        stale.iter().take(2).collect::<Vec<_>>(),
        resurrected.len(),
        resurrected.iter().take(3).collect::<Vec<_>>()
    );
    if soft_target {
        let flagged = key_states(
            &cluster.target.pool,
            "items WHERE _tidemark_deleted",
            &["id"],
            &["id"],
            "_tidemark_version",
        )
        .await;
        let overlap: Vec<&String> = flagged.keys().filter(|k| expected.contains_key(*k)).collect();
        assert!(
            overlap.is_empty(),
            "{context}: live source keys flagged deleted: {overlap:?}"
        );
        assert!(!flagged.is_empty(), "{context}: a soft target keeps flagged tombstones");
    }
}

struct PolicyCase {
    tag: &'static str,
    extra: &'static str,
    deletes: Deletes,
    install: bool,
    soft_target: bool,
    source_version: &'static str,
    reconcile: bool,
    /// The target is a MariaDB database (written by an account with the README's grants)
    /// instead of the cluster's PostgreSQL one.
    mariadb_target: bool,
}

/// Each row as one text, rendered alike by PostgreSQL (the source) and MariaDB (a target).
const PG_ROW: &str = "concat_ws('|', id, name, qty, to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US'), \
     coalesce(to_char(deleted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US'), 'NULL'))";
const MARIADB_ROW: &str = "CONCAT_WS('|', id, name, qty, DATE_FORMAT(updated_at, '%Y-%m-%d %H:%i:%s.%f'), \
     IFNULL(DATE_FORMAT(deleted_at, '%Y-%m-%d %H:%i:%s.%f'), 'NULL'))";

/// A row rendered as one text, and its version.
type Rendered = (String, i64);

/// [`assert_expected`] against a MariaDB target.
async fn assert_expected_in_mariadb(
    cluster: &Cluster,
    target: &MariaDb,
    source_live: &str,
    source_version: &str,
    soft_target: bool,
    context: &str,
) {
    let expected: BTreeMap<String, (String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id::text, {PG_ROW}, {source_version} FROM items WHERE {source_live}"
    )))
    .fetch_all(&cluster.source.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(k, row, v): (String, String, i64)| (k, (row, v)))
    .collect();
    let read = |filter: &str| {
        let sql = format!("SELECT CAST(id AS CHAR), {MARIADB_ROW}, _tidemark_version FROM items {filter}");
        async move {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(&target.pool)
                .await
                .unwrap()
                .into_iter()
                .map(|(k, row, v): (String, String, i64)| (k, (row, v)))
                .collect::<BTreeMap<String, (String, i64)>>()
        }
    };
    let actual = read(if soft_target { "WHERE NOT _tidemark_deleted" } else { "" }).await;
    let lost: Vec<&String> = expected.keys().filter(|k| !actual.contains_key(*k)).collect();
    let stale: Vec<(&String, &Rendered, &Rendered)> = expected
        .iter()
        .filter_map(|(k, e)| actual.get(k).filter(|a| *a != e).map(|a| (k, e, a)))
        .collect();
    let resurrected: Vec<&String> = actual.keys().filter(|k| !expected.contains_key(*k)).collect();
    assert!(
        lost.is_empty() && stale.is_empty() && resurrected.is_empty(),
        "{context}: {} live keys; {} lost (e.g. {:?}), {} stale (e.g. {:?}), {} deleted in the source but live in the target (e.g. {:?})",
        expected.len(),
        lost.len(),
        lost.iter().take(3).collect::<Vec<_>>(),
        stale.len(),
        stale.iter().take(2).collect::<Vec<_>>(),
        resurrected.len(),
        resurrected.iter().take(3).collect::<Vec<_>>()
    );
    if soft_target {
        let flagged = read("WHERE _tidemark_deleted").await;
        let overlap: Vec<&String> = flagged.keys().filter(|k| expected.contains_key(*k)).collect();
        assert!(
            overlap.is_empty(),
            "{context}: live source keys flagged deleted: {overlap:?}"
        );
        assert!(!flagged.is_empty(), "{context}: a soft target keeps flagged tombstones");
    }
}

async fn run_policy(case: PolicyCase) {
    let mut cluster = Cluster::new(case.tag).await;
    create_fixture(&cluster.source, 20_000).await;
    let mariadb = if case.mariadb_target {
        let db = MariaDb::create(&format!("{}_dst", case.tag)).await;
        let grants = format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, INDEX ON `{}`.* ",
            db.name
        );
        let user = MariaUser::create(&db, case.tag, &[&grants]).await;
        Some((db, user))
    } else {
        None
    };
    let settings = TaskSettings {
        shards: 4,
        page_size: 2000,
        extra: case.extra.to_string(),
        target_url: mariadb
            .as_ref()
            .map(|(db, user)| db.url_as(&user.name, &user.password))
            .unwrap_or_default(),
        target_table: if case.mariadb_target {
            "items".into()
        } else {
            String::new()
        },
        ..TaskSettings::default()
    };
    cluster.write_config(&settings);
    if case.install {
        cluster.source_install();
    }
    cluster.start(&settings).await;
    cluster.spawn_worker(&format!("{}-a", case.tag), 4, &[]);
    cluster.spawn_worker(&format!("{}-b", case.tag), 4, &[]);
    // Half the rounds run while the snapshot copies, half after it: only keys the target
    // already holds leave a trace there (a soft target's flagged rows), and on a slow machine
    // the first half may finish before the snapshot has copied anything.
    write_with_deletes(&cluster.source, case.deletes, 1_000_000, 20).await;
    cluster
        .wait_for("snapshot done", Duration::from_secs(90), |t| t.snapshot_complete)
        .await;
    let end = write_with_deletes(&cluster.source, case.deletes, 2_000_000, 20).await;
    let live = if case.deletes == Deletes::Soft {
        "deleted_at IS NULL"
    } else {
        "true"
    };
    cluster.wait_for_watermark(end, Duration::from_secs(90)).await;
    if case.reconcile {
        // Before reconciliation the target still holds keys deleted in the source.
        let deleted_in_source: i64 = sqlx::query_scalar("SELECT count(*) FROM graveyard")
            .fetch_one(&cluster.source.pool)
            .await
            .unwrap();
        assert!(deleted_in_source > 0);
        let run = cluster.reconcile(&["--full"]);
        eprintln!("{}: reconcile {run}", case.tag);
        assert!(run["finished"].as_bool().unwrap(), "{run}");
        assert!(run["keys_repaired"].as_u64().unwrap() > 0, "{run}");
    }
    match &mariadb {
        Some((db, _)) => {
            assert_expected_in_mariadb(&cluster, db, live, case.source_version, case.soft_target, case.tag).await
        }
        None => assert_expected(&cluster, live, case.source_version, case.soft_target, case.tag).await,
    }
    let status = cluster.task_status().await;
    let contract = status.contract.expect("status shows the contract");
    assert!(contract.covers_deletes, "{contract:?}");
}

/// D = soft (`deleted_at` marks rows), hard target: marked rows are deleted from the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_delete_policy_deletes_marked_rows() {
    run_policy(PolicyCase {
        tag: "del_soft",
        extra: "delete_policy = { kind = \"soft\", column = \"deleted_at\" }",
        deletes: Deletes::Soft,
        install: false,
        soft_target: false,
        source_version: CURSOR_VERSION,
        reconcile: false,
        mariadb_target: false,
    })
    .await;
}

/// D = tombstone_table (trigger-fed delete log), soft target: deleted keys stay flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_log_policy_flags_rows_in_a_soft_target() {
    run_policy(PolicyCase {
        tag: "del_log_soft",
        extra: "delete_policy = { kind = \"tombstone_table\", retention = \"1h\" }\ntarget_deletes = \"soft\"",
        deletes: Deletes::Hard,
        install: true,
        soft_target: true,
        source_version: CURSOR_VERSION,
        reconcile: false,
        mariadb_target: false,
    })
    .await;
}

/// D = tombstone_table with trigger versions, hard target: re-inserted keys beat their old
/// tombstones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_log_policy_with_trigger_versions() {
    run_policy(PolicyCase {
        tag: "del_log_trg",
        extra: "delete_policy = { kind = \"tombstone_table\", retention = \"1h\" }\nversion = \"trigger\"",
        deletes: Deletes::Hard,
        install: true,
        soft_target: false,
        source_version: "tidemark_row_version",
        reconcile: false,
        mariadb_target: false,
    })
    .await;
}

/// The same deletes suite into a MariaDB target. D = soft (`deleted_at`), hard target: a
/// MariaDB row is deleted by its tombstone, a re-insert with a newer version comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_policy_deletes_rows_in_a_mariadb_target() {
    run_policy(PolicyCase {
        tag: "del_soft_my",
        extra: "delete_policy = { kind = \"soft\", column = \"deleted_at\" }",
        deletes: Deletes::Soft,
        install: false,
        soft_target: false,
        source_version: CURSOR_VERSION,
        reconcile: false,
        mariadb_target: true,
    })
    .await;
}

/// D = tombstone_table (trigger-fed delete log), soft MariaDB target: deleted keys stay
/// flagged, kept tombstones block older versions replayed later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_log_policy_flags_rows_in_a_soft_mariadb_target() {
    run_policy(PolicyCase {
        tag: "del_log_my",
        extra: "delete_policy = { kind = \"tombstone_table\", retention = \"1h\" }\ntarget_deletes = \"soft\"",
        deletes: Deletes::Hard,
        install: true,
        soft_target: true,
        source_version: CURSOR_VERSION,
        reconcile: false,
        mariadb_target: true,
    })
    .await;
}

/// D = reconcile: the source records nothing; the run finds the hard deletes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_policy_finds_hard_deletes() {
    run_policy(PolicyCase {
        tag: "del_rec",
        extra: "delete_policy = { kind = \"reconcile\" }",
        deletes: Deletes::Hard,
        install: false,
        soft_target: false,
        source_version: CURSOR_VERSION,
        reconcile: true,
        mariadb_target: false,
    })
    .await;
}

async fn source_now(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn target_name(cluster: &Cluster, id: i64) -> Option<String> {
    sqlx::query_scalar("SELECT name FROM items WHERE id = $1")
        .bind(id)
        .fetch_optional(&cluster.target.pool)
        .await
        .unwrap()
}

/// B = the reconciliation run; D = none. An update that backdates `updated_at` beyond the
/// overlap lies below the watermark: incremental never reads it (asserted), and its version
/// is lower than the target's, so even a re-read could not apply it. The next reconciliation
/// finds the version mismatch and replaces the row (value and version) through a repair batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backdated_update_is_missed_by_incremental_and_repaired_by_reconcile() {
    let mut cluster = Cluster::new("del_backdate").await;
    create_fixture(&cluster.source, 5_000).await;
    let settings = TaskSettings {
        shards: 2,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("del-backdate-w", 2, &[]);
    let now = source_now(&cluster.source).await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;
    let backdated = [11_i64, 1_234, 2_500, 3_999, 4_321];
    cluster
        .source
        .exec(
            "UPDATE items SET name = 'backdated ' || id, updated_at = updated_at - interval '10 minutes' \
             WHERE id IN (11, 1234, 2500, 3999, 4321)",
        )
        .await;
    let after = source_now(&cluster.source).await;
    cluster.wait_for_watermark(after, Duration::from_secs(60)).await;
    for id in backdated {
        let name = target_name(&cluster, id).await.unwrap();
        assert_eq!(
            name,
            format!("item {id}"),
            "incremental cannot see a backdated update of {id}"
        );
    }
    let run = cluster.reconcile(&["--full"]);
    eprintln!("backdated: {run}");
    assert_eq!(run["keys_repaired"], 5, "{run}");
    assert_eq!(run["extra_in_target"], 0, "{run}");
    assert_expected(&cluster, "true", CURSOR_VERSION, false, "after reconcile").await;
    for id in backdated {
        assert_eq!(target_name(&cluster, id).await.unwrap(), format!("backdated {id}"));
    }
    // A second run finds nothing and reads no rows.
    let again = cluster.reconcile(&["--full"]);
    assert_eq!(
        (again["keys_repaired"].as_u64(), again["rows_read"].as_u64()),
        (Some(0), Some(0)),
        "{again}"
    );
    // status --json shows the five clauses and the last run.
    let (ok, stdout, stderr) = cluster.cli(&["status", "--json", "--coordinator", &cluster.address]);
    assert!(ok, "{stderr}");
    let status: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let task = &status["tasks"][0];
    for clause in ["coverage", "boundary", "consistency", "retention", "reinitialization"] {
        assert!(!task["contract"][clause].is_null(), "contract lacks {clause}: {stdout}");
    }
    assert_eq!(task["contract"]["coverage"]["deletes"], false);
    assert_eq!(task["last_reconcile"]["run_id"], again["run_id"]);
    // A windowed run covers recent rows only: the backdated rows (10 minutes old) are outside
    // a 1-minute window, so breaking one again goes unnoticed by it.
    cluster
        .target
        .exec("UPDATE items SET _tidemark_version = _tidemark_version + 1 WHERE id = 11")
        .await;
    let windowed = cluster.reconcile(&["--since", "1m"]);
    assert_eq!(windowed["keys_repaired"], 0, "{windowed}");
    let full = cluster.reconcile(&["--full"]);
    assert_eq!(full["keys_repaired"], 1, "{full}");
    assert_expected(&cluster, "true", CURSOR_VERSION, false, "after the last reconcile").await;
}

/// `tasks reinit`, then waits until epoch 2 has passed now and its reconciliation finished,
/// and checks every key (D = the delete log, hard target, cursor versions).
async fn reinit_and_converge(cluster: &Cluster, context: &str) {
    let (ok, stdout, stderr) = cluster.cli(&["tasks", "reinit", "items", "--coordinator", &cluster.address]);
    assert!(ok, "reinit: {stderr}");
    assert!(stdout.contains("epoch 2"), "{stdout}");
    let now = source_now(&cluster.source).await;
    cluster.wait_for_reinit(2, now, Duration::from_secs(90)).await;
    assert_expected(cluster, "true", CURSOR_VERSION, false, context).await;
}

/// B = the watermark; D = tombstone_table with an 8 s retention. With every worker gone the
/// watermark ages: status warns within 20 % of the retention, then the task pauses with
/// `reinitialization required` before any delete it has not read is purged, and nothing
/// commits while paused. `tasks reinit` then converges per key, with the deletes made during
/// the outage applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_past_retention_requires_reinitialization() {
    let mut cluster = Cluster::new("del_retention").await;
    create_fixture(&cluster.source, 3_000).await;
    let settings = TaskSettings {
        shards: 2,
        extra: "delete_policy = { kind = \"tombstone_table\", retention = \"8s\" }".into(),
        ..TaskSettings::default()
    };
    cluster.write_config(&settings);
    cluster.source_install();
    cluster.start(&settings).await;
    let first = cluster.spawn_worker("del-ret-a", 2, &[]);
    let now = source_now(&cluster.source).await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;
    cluster.workers[first].kill9();
    cluster.source.exec("DELETE FROM items WHERE id % 30 = 0").await;
    cluster
        .source
        .exec("UPDATE items SET name = name || ' outage', updated_at = clock_timestamp() WHERE id % 50 = 1")
        .await;

    let mut warned = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    let paused = loop {
        let status = cluster.task_status().await;
        warned |= status.warnings.iter().any(|w| w.contains("within 20 %"));
        if status.phase == "paused" {
            break status;
        }
        assert!(Instant::now() < deadline, "no pause: {status:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        paused.paused_reason.contains("reinitialization required"),
        "{}",
        paused.paused_reason
    );
    assert!(warned, "status warned before the retention ran out");
    let committed = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM checkpoint_history")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = committed(cluster.control.pool.clone()).await;
    cluster.spawn_worker("del-ret-b", 2, &[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        committed(cluster.control.pool.clone()).await,
        before,
        "no silent resume while paused"
    );
    assert_eq!(
        target_name(&cluster, 30).await.as_deref(),
        Some("item 30"),
        "target untouched while paused"
    );

    reinit_and_converge(&cluster, "after reinit").await;
    assert_eq!(target_name(&cluster, 30).await, None, "deleted during the outage");
}

/// B = the reconciliation run; D = reconcile. One million identical rows: the run reads no
/// row. Then 100 differences on either side — backdated updates and inserts and hard deletes
/// in the source, rows deleted from and rows added to the target — are all repaired while
/// reading under 1 % of the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_a_million_rows_reads_only_what_differs() {
    const ROWS: i64 = 1_000_000;
    let mut cluster = Cluster::new("del_million").await;
    create_fixture(&cluster.source, ROWS).await;
    let settings = TaskSettings {
        shards: 4,
        page_size: 20_000,
        extra: "delete_policy = { kind = \"reconcile\" }".into(),
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("del-million-a", 2, &[]);
    cluster.spawn_worker("del-million-b", 2, &[]);
    let now = source_now(&cluster.source).await;
    cluster.wait_for_watermark(now, Duration::from_secs(300)).await;

    // The cost of comparing content, against versions alone, on the same table.
    for compare in ["versions", "content"] {
        let started = Instant::now();
        let identical = cluster.reconcile(&["--full", "--compare", compare]);
        let identical_time = started.elapsed();
        eprintln!("1M identical rows, compare {compare}: {identical} in {identical_time:?}");
        assert_eq!(identical["rows_read"], 0, "{identical}");
        assert_eq!(identical["keys_repaired"], 0, "{identical}");
    }

    // 25 + 25 + 20 source differences, 15 + 15 target differences: 100 keys.
    cluster
        .source
        .exec(
            "UPDATE items SET name = 'drift ' || id, updated_at = updated_at - interval '2 hours' \
             WHERE id IN (SELECT 7 + 39989 * g FROM generate_series(0, 24) g);
             DELETE FROM items WHERE id IN (SELECT 13 + 39971 * g FROM generate_series(0, 24) g);
             INSERT INTO items SELECT g, 'late ' || g, 5, now() - interval '3 hours', NULL
             FROM generate_series(2000001, 2000020) g",
        )
        .await;
    cluster
        .target
        .exec(
            "DELETE FROM items WHERE id IN (SELECT 21 + 66601 * g FROM generate_series(0, 14) g);
             INSERT INTO items (id, name, qty, updated_at, deleted_at, _tidemark_version)
             SELECT g, 'phantom', 0, now(), NULL, 1 FROM generate_series(3000001, 3000015) g",
        )
        .await;
    let after = source_now(&cluster.source).await;
    cluster.wait_for_watermark(after, Duration::from_secs(60)).await;

    let started = Instant::now();
    let run = cluster.reconcile(&["--full"]);
    let run_time = started.elapsed();
    eprintln!("1M rows with 100 differences: {run} in {run_time:?}");
    assert_eq!(run["keys_repaired"], 100, "{run}");
    let rows_read = run["rows_read"].as_u64().unwrap();
    assert!(rows_read < (ROWS as u64) / 100, "read {rows_read} rows, not under 1 %");
    assert_expected(&cluster, "true", CURSOR_VERSION, false, "after reconcile").await;
}

/// B = a scheduled reconciliation run; D = reconcile. Rows removed from or altered in the
/// target behind Tidemark's back are put back by the next run of `reconcile_every`, without
/// anyone calling the CLI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_reconciliation_repairs_drift() {
    let mut cluster = Cluster::new("del_sched").await;
    create_fixture(&cluster.source, 2_000).await;
    let settings = TaskSettings {
        shards: 2,
        extra: "delete_policy = { kind = \"reconcile\" }\nreconcile_every = \"3s\"".into(),
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("del-sched-w", 2, &[]);
    let now = source_now(&cluster.source).await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;
    cluster
        .target
        .exec("DELETE FROM items WHERE id % 200 = 0; UPDATE items SET name = 'tampered', _tidemark_version = 0 WHERE id % 300 = 1")
        .await;
    let drifted = source_now(&cluster.source).await;
    let status = cluster
        .wait_for("a scheduled run after the drift", Duration::from_secs(60), |t| {
            t.last_reconcile
                .as_ref()
                .is_some_and(|r| r.reason == "schedule" && r.finished && r.requested_at_micros > drifted)
        })
        .await;
    let run = status.last_reconcile.unwrap();
    eprintln!("scheduled: {run:?}");
    assert_expected(&cluster, "true", CURSOR_VERSION, false, "after a scheduled run").await;
}

/// B = the reconciliation run; D = none. `reconcile --since 30m` compares rows whose cursor
/// time lies within 30 minutes of the source's clock, which wrote the cursor times, not the
/// coordinator's. Here the source clock, as the coordinator reads it, runs an hour behind
/// (`TIDEMARK_SOURCE_CLOCK_SQL`, a test hook), so the window starts 90 minutes before the
/// real now and covers a row written 45 minutes ago. Measured by the coordinator's own clock,
/// the window would start 30 minutes ago and miss that row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windowed_reconcile_measures_its_window_by_the_source_clock() {
    let mut cluster = Cluster::new("del_since_clock").await;
    create_fixture(&cluster.source, 3_000).await;
    let behind = "(clock_timestamp() - interval '1 hour')".to_string();
    cluster
        .start(&TaskSettings {
            shards: 2,
            coordinator_env: vec![("TIDEMARK_SOURCE_CLOCK_SQL", behind)],
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("w", 2, &[]);
    cluster
        .wait_for("snapshot done", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    // Row 900 was written 45 minutes ago (the fixture spreads rows over the last hour).
    let age: f64 =
        sqlx::query_scalar("SELECT extract(epoch from now() - updated_at)::float8 FROM items WHERE id = 900")
            .fetch_one(&cluster.source.pool)
            .await
            .unwrap();
    assert!((2_600.0..2_800.0).contains(&age), "row 900 is {age} s old");
    cluster
        .target
        .exec("UPDATE items SET name = 'drifted', _tidemark_version = _tidemark_version + 1 WHERE id = 900")
        .await;
    let run = cluster.reconcile(&["--since", "30m"]);
    assert_eq!(run["keys_repaired"], 1, "{run}");
    let name: String = sqlx::query_scalar("SELECT name FROM items WHERE id = 900")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(name, "item 900", "the drifted row was repaired to the source's");
}

/// A task on the fixture with the delete log (`source install`), one worker, snapshot done.
async fn delete_log_cluster(tag: &str, extra: &str) -> Cluster {
    let mut cluster = Cluster::new(tag).await;
    create_fixture(&cluster.source, 1_000).await;
    let settings = TaskSettings {
        shards: 2,
        extra: format!("delete_policy = {{ kind = \"tombstone_table\", retention = \"1h\" }}\n{extra}"),
        ..TaskSettings::default()
    };
    cluster.write_config(&settings);
    cluster.source_install();
    cluster.start(&settings).await;
    cluster.spawn_worker(&format!("{tag}-w"), 2, &[]);
    cluster
        .wait_for("snapshot done", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    cluster
}

/// S20: a key deleted and inserted again (in one transaction; by a transaction that began
/// before the delete; by `WITH d AS (DELETE …) INSERT …`) arrives live, though its delete-log
/// entry carries a version above the re-inserted row's. A plain delete still deletes. Then a
/// kept tombstone that wrongly covers a live key (as left by an older version, or a tie of
/// cursor times) is lifted by reconciliation, and the key is really back.
async fn re_inserted_keys_arrive(tag: &str, extra: &str, source_version: &str, soft_target: bool) {
    let cluster = delete_log_cluster(tag, extra).await;
    let row = |id: i64, name: &str| format!("INSERT INTO items VALUES ({id}, '{name} {id}', 7, now(), NULL)");
    cluster
        .source
        .exec(&format!(
            "BEGIN; DELETE FROM items WHERE id = 5; {}; COMMIT",
            row(5, "same transaction")
        ))
        .await;
    let mut older = cluster.source.pool.begin().await.unwrap();
    sqlx::query("SELECT now()").execute(&mut *older).await.unwrap();
    cluster.source.exec("DELETE FROM items WHERE id = 6").await;
    sqlx::query(sqlx::AssertSqlSafe(row(6, "older transaction")))
        .execute(&mut *older)
        .await
        .unwrap();
    older.commit().await.unwrap();
    cluster
        .source
        .exec(
            "WITH d AS (DELETE FROM items WHERE id IN (7, 8) RETURNING id) \
             INSERT INTO items SELECT id, 'cte ' || id, 2, now(), NULL FROM d",
        )
        .await;
    cluster.source.exec("DELETE FROM items WHERE id IN (9, 10)").await;
    let end = source_now(&cluster.source).await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    assert_expected(
        &cluster,
        "true",
        source_version,
        soft_target,
        &format!("{tag}: re-inserts"),
    )
    .await;
    for id in [5, 6, 7, 8] {
        assert!(target_name(&cluster, id).await.is_some(), "{tag}: key {id} is live");
    }

    // A stale kept tombstone far above the row's version hides key 11 from every upsert.
    cluster
        .target
        .exec(
            "INSERT INTO tidemark_tombstones_items (id, _tidemark_version) VALUES (11, 9000000000000000) \
             ON CONFLICT (id) DO UPDATE SET _tidemark_version = EXCLUDED._tidemark_version; \
             DELETE FROM items WHERE id = 11",
        )
        .await;
    let run = cluster.reconcile(&["--full"]);
    assert_eq!(run["keys_repaired"], 1, "{tag}: {run}");
    assert_eq!(
        target_name(&cluster, 11).await.as_deref(),
        Some("item 11"),
        "{tag}: the repair lifted the stale tombstone"
    );
    let again = cluster.reconcile(&["--full"]);
    assert_eq!(again["keys_repaired"], 0, "{tag}: nothing left to repair: {again}");
    assert_expected(
        &cluster,
        "true",
        source_version,
        soft_target,
        &format!("{tag}: after repair"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_inserted_keys_beat_their_delete_log_entries_with_cursor_versions() {
    re_inserted_keys_arrive("reins_cursor", "", CURSOR_VERSION, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_inserted_keys_beat_their_delete_log_entries_with_trigger_versions_in_a_soft_target() {
    re_inserted_keys_arrive(
        "reins_trigger",
        "version = \"trigger\"\ntarget_deletes = \"soft\"",
        "tidemark_row_version",
        true,
    )
    .await;
}

/// S21 and S26: TRUNCATE fires no row trigger. The task pauses with `reinitialization
/// required`, `tasks resume` is refused and names `tasks reinit`, and after the reinit the
/// target holds exactly what the source holds (rows inserted after the TRUNCATE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_pauses_the_task_and_reinit_converges() {
    let cluster = delete_log_cluster("truncate", "").await;
    cluster.source.exec("TRUNCATE items").await;
    cluster
        .source
        .exec(
            "INSERT INTO items SELECT g, 'after ' || g, 1, clock_timestamp(), NULL FROM generate_series(5001, 5010) g",
        )
        .await;
    let paused = cluster
        .wait_for("paused by the TRUNCATE", Duration::from_secs(30), |t| {
            t.phase == "paused"
        })
        .await;
    assert!(
        paused.paused_reason.contains("truncated") && paused.paused_reason.contains("tasks reinit items"),
        "{}",
        paused.paused_reason
    );
    let (ok, _, stderr) = cluster.cli(&["tasks", "resume", "items", "--coordinator", &cluster.address]);
    assert!(!ok, "resume after `reinitialization required` must be refused");
    assert!(
        stderr.contains("tasks reinit items"),
        "the refusal names the fix: {stderr}"
    );
    assert_eq!(cluster.task_status().await.phase, "paused");

    reinit_and_converge(&cluster, "after the TRUNCATE and reinit").await;
    assert_eq!(target_name(&cluster, 1).await, None, "truncated rows are gone");
}

/// S22: two tables whose derived names (`<table>_tidemark_deletes`, the trigger function,
/// the purge function) would be cut to the same 63 bytes. Each gets its own delete log, and
/// deletes in the other table never reach this task's target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_table_names_never_share_derived_objects() {
    const LONG: &str = "orders_archive_for_the_european_customers_of_fiscal_year_2025";
    const OTHER: &str = "orders_archive_for_the_european_customers_of_fiscal_year_2026";
    let mut cluster = Cluster::new("longnames").await;
    for table in [LONG, OTHER] {
        cluster
            .source
            .exec(&format!(
                "CREATE TABLE {table} (id bigint PRIMARY KEY, name text NOT NULL, qty integer NOT NULL,
                                       updated_at timestamptz(3) NOT NULL, deleted_at timestamptz);
                 INSERT INTO {table} SELECT g, 'item ' || g, g % 100, clock_timestamp(), NULL FROM generate_series(1, 300) g"
            ))
            .await;
    }
    let settings = |table: &str| TaskSettings {
        source_table: format!("public.{table}"),
        target_table: "public.items".into(),
        shards: 2,
        extra: "delete_policy = { kind = \"tombstone_table\", retention = \"1h\" }".into(),
        ..TaskSettings::default()
    };
    // Install for the other table first, then for this task's.
    cluster.write_config(&settings(OTHER));
    cluster.source_install();
    cluster.write_config(&settings(LONG));
    cluster.source_install();
    cluster.start(&settings(LONG)).await;
    cluster.spawn_worker("longnames-w", 2, &[]);
    cluster
        .wait_for("snapshot done", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    cluster
        .source
        .exec(&format!("DELETE FROM {OTHER} WHERE id <= 100"))
        .await;
    cluster.source.exec(&format!("DELETE FROM {LONG} WHERE id > 290")).await;
    let end = source_now(&cluster.source).await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    let expected = key_states(&cluster.source.pool, LONG, &["id"], COLUMNS, CURSOR_VERSION).await;
    let actual = key_states(&cluster.target.pool, "items", &["id"], COLUMNS, "_tidemark_version").await;
    assert_eq!(expected.len(), 290);
    assert_eq!(
        actual, expected,
        "the target is this table, per key: no delete of the other table reached it"
    );
    let derived: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT relname::text FROM pg_class WHERE relkind = 'r' AND relname LIKE 'orders_archive%' \
         AND relname NOT IN ('{LONG}', '{OTHER}') ORDER BY 1"
    )))
    .fetch_all(&cluster.source.pool)
    .await
    .unwrap();
    assert_eq!(
        derived.len(),
        4,
        "a delete log and a TRUNCATE log per table: {derived:?}"
    );
}

/// S23: drift at an equal version. A target row edited by hand, a source backfill that kept
/// the cursor, a corrupted value in the target: a versions-only run finds none of them, the
/// default content run repairs exactly those keys. Then a dead letter whose row a content
/// repair has since landed at the letter's own version, with newer values: its retry keeps
/// the newer values. Boundary: the reconciliation run; delete policy: none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_version_drift_is_found_by_content_and_a_retry_never_overwrites_it() {
    let mut cluster = Cluster::new("drift").await;
    create_fixture(&cluster.source, 2_000).await;
    cluster
        .target
        .exec(
            "CREATE TABLE items (id bigint PRIMARY KEY, name text NOT NULL, qty integer NOT NULL CHECK (qty < 10000),
                                 updated_at timestamptz(3) NOT NULL, deleted_at timestamptz,
                                 _tidemark_version bigint NOT NULL)",
        )
        .await;
    let settings = TaskSettings {
        shards: 2,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("drift-w", 2, &[]);
    cluster
        .wait_for("snapshot done", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    // Key 7 becomes a dead letter (the target's CHECK rejects it).
    cluster
        .source
        .exec("UPDATE items SET qty = 20000, updated_at = clock_timestamp() WHERE id = 7")
        .await;
    // Past the overlap (2 s) too: the writes below that keep the cursor are invisible to the
    // incremental reads from now on.
    let end = source_now(&cluster.source).await + 3_000_000;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    let letters = cluster.cli_json(&["dead-letters", "list", "--task", "items"]);
    assert_eq!(letters["dead_letters"].as_array().map(Vec::len), Some(1), "{letters}");

    cluster
        .target
        .exec("UPDATE items SET name = 'edited by hand' WHERE id = 3")
        .await;
    cluster.target.exec("UPDATE items SET qty = -1 WHERE id = 1500").await;
    // A backfill that keeps the cursor; key 7's new values pass the target's CHECK.
    cluster
        .source
        .exec("UPDATE items SET qty = qty + 1 WHERE id IN (4, 1900, 7)")
        .await;
    cluster.source.exec("UPDATE items SET qty = 5 WHERE id = 7").await;

    let versions = cluster.reconcile(&["--full", "--compare", "versions"]);
    assert_eq!(versions["compare"], "versions", "{versions}");
    // Only key 7 differs by version (the target still holds its snapshot version).
    assert_eq!(
        versions["keys_repaired"], 1,
        "versions alone are blind to the rest: {versions}"
    );
    let content = cluster.reconcile(&["--full"]);
    assert_eq!(content["compare"], "content", "{content}");
    assert_eq!(content["keys_repaired"], 4, "keys 3, 4, 1500, 1900: {content}");
    assert_expected(
        &cluster,
        "true",
        CURSOR_VERSION,
        false,
        "after the content reconciliation",
    )
    .await;

    // The letter holds key 7 at the version the target now holds, with qty 20000: older.
    cluster
        .target
        .exec("ALTER TABLE items DROP CONSTRAINT items_qty_check")
        .await;
    let retried = cluster.cli_json(&["dead-letters", "retry", "--task", "items"]);
    assert_eq!(retried["resolved"].as_u64(), Some(1), "{retried}");
    assert_expected(&cluster, "true", CURSOR_VERSION, false, "after the retry").await;
    let again = cluster.reconcile(&["--full"]);
    assert_eq!(again["keys_repaired"], 0, "{again}");
}

/// The README's grants for a delete-log task are enough, and checked: without DELETE on the
/// delete log the task is refused naming the grant; a source role holding exactly them
/// (SELECT on the table, `pg_read_all_stats`, SELECT and DELETE on the delete log, SELECT on
/// the TRUNCATE log) syncs deletes and re-inserts per key, and the watcher's every round
/// (retention purge, TRUNCATE, visibility, cursor checks) runs without an error; revoked
/// while running, the task pauses with the error. The owner (a superuser here) runs
/// `source install`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_log_task_runs_on_the_documented_grants_alone() {
    let reader = TestRole::create("delreader").await;
    let mut cluster = Cluster::new("delgrants").await;
    create_fixture(&cluster.source, 500).await;
    let owner = TaskSettings {
        shards: 2,
        extra: "delete_policy = { kind = \"tombstone_table\", retention = \"1h\" }".into(),
        ..TaskSettings::default()
    };
    cluster.write_config(&owner);
    cluster.source_install();
    let role = &reader.name;
    cluster
        .source
        .exec(&format!(
            "GRANT CONNECT ON DATABASE \"{db}\" TO \"{role}\"; GRANT USAGE ON SCHEMA public TO \"{role}\";
             GRANT SELECT ON public.items TO \"{role}\"; GRANT pg_read_all_stats TO \"{role}\";
             GRANT SELECT ON public.items_tidemark_deletes TO \"{role}\";
             GRANT SELECT ON public.items_tidemark_truncates TO \"{role}\"",
            db = cluster.source.name
        ))
        .await;
    let settings = TaskSettings {
        source_url: cluster.source.url_as(role),
        ..owner
    };
    // Without DELETE on the delete log the coordinator could not purge it: refused by name.
    let refused = cluster.refused_start(&settings);
    let grant = format!("GRANT DELETE ON \"public\".\"items_tidemark_deletes\" TO \"{role}\"");
    assert!(refused.contains(&grant), "{refused}");
    cluster
        .source
        .exec(&format!("GRANT DELETE ON public.items_tidemark_deletes TO \"{role}\""))
        .await;
    cluster.start(&settings).await;
    cluster.spawn_worker("delgrants-w", 2, &[]);
    cluster
        .wait_for("snapshot done", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    cluster.source.exec("DELETE FROM items WHERE id % 10 = 0").await;
    cluster
        .source
        .exec(
            "BEGIN; DELETE FROM items WHERE id = 11; INSERT INTO items VALUES (11, 'again 11', 1, now(), NULL); COMMIT",
        )
        .await;
    let end = source_now(&cluster.source).await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    // Several watcher rounds (poll 200 ms) have run since.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_expected(
        &cluster,
        "true",
        CURSOR_VERSION,
        false,
        "a reader role with the README's grants",
    )
    .await;
    let log = cluster.coordinator.as_ref().unwrap().log_text();
    assert!(
        !log.contains("source check failed") && !log.contains("permission denied"),
        "every watcher round ran: {}",
        log.lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(cluster.task_status().await.phase, "incremental");

    // Revoked while the task runs: the watcher's checks fail every round, and the task pauses
    // with the error instead of running unwatched.
    cluster
        .source
        .exec(&format!(
            "REVOKE DELETE ON public.items_tidemark_deletes FROM \"{role}\""
        ))
        .await;
    let paused = cluster
        .wait_for("paused: the source checks fail", Duration::from_secs(30), |t| {
            t.phase == "paused"
        })
        .await;
    assert!(
        paused
            .paused_reason
            .starts_with("source checks keep failing: source database")
            && paused
                .paused_reason
                .contains("permission denied for table items_tidemark_deletes"),
        "{}",
        paused.paused_reason
    );
}
