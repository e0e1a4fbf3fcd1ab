//! Epochs built beside the live table (seed 000, section 1): `tasks reinit` builds epoch N+1
//! in a table of its own while epoch N keeps serving and syncing, validates it, and switches
//! by one target transaction; the old table is retained for `tasks rollback`.
//!
//! B = the watermark; D = none (no row is deleted in these tests). Every test ends with a
//! per-key comparison of the live table with the source (value, version).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::postgres::PgPoolOptions;
use tidemark_tests::{Cluster, KeyKind, TaskSettings, TempDir, TestRole, create_items};

const ROWS: i64 = 4_000;

fn settings(extra: &str) -> TaskSettings {
    TaskSettings {
        shards: 2,
        page_size: 1000,
        extra: extra.into(),
        ..TaskSettings::default()
    }
}

/// A cluster syncing `rows` items through one worker with room for two epochs' shards, its
/// watermark past the snapshot.
async fn syncing(tag: &str, rows: i64, settings: TaskSettings) -> Cluster {
    let mut cluster = Cluster::new(tag).await;
    create_items(&cluster.source, KeyKind::Bigint, rows).await;
    cluster.start(&settings).await;
    cluster.spawn_worker("a", 4, &[]);
    let now = cluster.source_now_micros().await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;
    cluster
}

async fn table_oid(cluster: &Cluster, table: &str) -> Option<i64> {
    sqlx::query_scalar::<_, Option<i64>>("SELECT to_regclass($1)::oid::bigint")
        .bind(table)
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap()
}

/// Updates a twentieth of the rows per call, moving their cursor.
async fn update_round(cluster: &Cluster, round: i64) {
    cluster
        .source
        .exec(&format!(
            "UPDATE items SET name = name || ' r{round}', updated_at = clock_timestamp() WHERE id % 20 = {}",
            round % 20
        ))
        .await;
}

/// Waits until `epoch` is live with its watermark past the source's clock now, then compares
/// every key.
async fn converged(cluster: &Cluster, epoch: u64, context: &str) {
    let now = cluster.source_now_micros().await;
    cluster
        .wait_for(&format!("epoch {epoch} live past now"), Duration::from_secs(90), |t| {
            t.epoch == epoch && t.phase == "incremental" && t.watermark_micros.is_some_and(|w| w > now)
        })
        .await;
    cluster.items_diff().await.assert_clean(context);
}

/// What one read of the live table saw.
struct Read {
    at_micros: i64,
    tables: Vec<(i64, i64, i64)>,
}

/// A reader querying the target table in a loop on a connection of its own, until `stop`.
fn spawn_reader(url: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<Read>> {
    tokio::spawn(async move {
        let pool = PgPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
        let mut reads = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            // One row per physical table the statement read: (its oid, rows, sum of keys).
            let tables: Vec<(i64, i64, i64)> =
                sqlx::query_as("SELECT tableoid::oid::bigint, count(*), sum(id)::bigint FROM items GROUP BY tableoid")
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            let at_micros = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64;
            reads.push(Read { at_micros, tables });
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        reads
    })
}

/// A reader querying the target in a loop while `tasks reinit` builds epoch 2 beside it under
/// live updates, validates it and switches: every read sees every key (none is deleted here)
/// from one table, never an empty table, and the table it reads changes once, from epoch 1's
/// to epoch 2's, after the validation finished. The live table's index, comment and grant
/// are carried over; epoch 1's table is retained beside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_sees_one_whole_table_through_a_reinit() {
    let reader_role = TestRole::create("ep_reader_role").await;
    let cluster = syncing("ep_reader", ROWS, settings("")).await;
    cluster
        .target
        .exec(&format!(
            "CREATE INDEX items_name_idx ON items (name); COMMENT ON TABLE items IS 'synced by tidemark'; \
             COMMENT ON COLUMN items.qty IS 'units'; GRANT SELECT ON items TO \"{}\"",
            reader_role.name
        ))
        .await;
    let old = table_oid(&cluster, "items").await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = spawn_reader(cluster.target.url.clone(), stop.clone());

    let reinit = cluster.cli_json(&["tasks", "reinit", "items"]);
    assert_eq!(reinit["epoch"].as_u64(), Some(2), "{reinit}");
    let building = cluster.task_status().await;
    assert_eq!(building.epoch, 1, "epoch 1 serves while epoch 2 builds");
    assert_eq!(building.building.as_ref().map(|b| b.epoch), Some(2), "{building:?}");
    let mut round = 0;
    let deadline = Instant::now() + Duration::from_secs(90);
    while cluster.task_status().await.epoch != 2 {
        assert!(
            Instant::now() < deadline,
            "no switch: {:?}",
            cluster.task_status().await
        );
        update_round(&cluster, round).await;
        round += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    update_round(&cluster, round).await;
    converged(&cluster, 2, "after the switch").await;
    stop.store(true, Ordering::Relaxed);
    let reads = reader.await.unwrap();

    let new = table_oid(&cluster, "items").await.unwrap();
    assert_ne!(new, old, "the live name is epoch 2's table");
    assert_eq!(
        table_oid(&cluster, "items__tm_e1").await,
        Some(old),
        "epoch 1 retained beside"
    );
    assert!(reads.len() > 50, "the reader ran ({} reads)", reads.len());
    let mut switched_at = None;
    for read in &reads {
        assert_eq!(
            read.tables.len(),
            1,
            "one table per read, never none: {:?}",
            read.tables
        );
        let (oid, count, sum) = read.tables[0];
        assert_eq!((count, sum), (ROWS, ROWS * (ROWS + 1) / 2), "every key in every read");
        assert!(oid == old || oid == new, "{oid}");
        if oid == new && switched_at.is_none() {
            switched_at = Some(read.at_micros);
        }
        assert!(
            switched_at.is_none() || oid == new,
            "the table changes once, never back"
        );
    }
    let switched_at = switched_at.expect("the reader saw the switch");
    let status = cluster.task_status().await;
    let validation = status.last_reconcile.expect("the validation run");
    assert_eq!((validation.epoch, validation.reason.as_str()), (2, "reinit"));
    assert!(validation.finished && validation.shards_done == 2, "{validation:?}");
    assert!(
        validation.requested_at_micros + validation.duration_ms as i64 * 1000 <= switched_at,
        "the switch came after the validation"
    );
    assert_eq!(status.retained.iter().map(|e| e.epoch).collect::<Vec<_>>(), [1]);

    let carried: (bool, Option<String>, Option<String>, bool) = sqlx::query_as(
        "SELECT EXISTS (SELECT FROM pg_indexes WHERE tablename = 'items' AND indexdef LIKE '%(name)%'), \
         obj_description('items'::regclass, 'pg_class'), col_description('items'::regclass, 4), \
         has_table_privilege($1, 'items', 'SELECT')",
    )
    .bind(&reader_role.name)
    .fetch_one(&cluster.target.pool)
    .await
    .unwrap();
    assert_eq!(
        carried,
        (true, Some("synced by tidemark".into()), Some("units".into()), true),
        "index, comments and grant carried over"
    );
}

/// A validation that finds a row the new epoch missed blocks the switch and says why: the
/// new table is changed by hand between its snapshot and its validation (a test gate holds
/// the validation back). The row is repaired, the live table stays epoch 1's, and status
/// names the cause; `tasks validate` validates again, and epoch 2 switches. Past its
/// `epoch_retention` (3 s here) epoch 1's table is dropped and a rollback is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validation_that_finds_a_missed_row_blocks_the_switch() {
    let dir = TempDir::new("ep_gate");
    let gate = dir.0.join("gate");
    std::fs::write(&gate, b"").unwrap();
    let settings = TaskSettings {
        coordinator_env: vec![("TIDEMARK_TEST_VALIDATION_GATE", gate.display().to_string())],
        ..settings("epoch_retention = \"3s\"")
    };
    let cluster = syncing("ep_block", ROWS, settings).await;
    let old = table_oid(&cluster, "items").await.unwrap();
    cluster.cli_json(&["tasks", "reinit", "items"]);
    cluster
        .wait_for("epoch 2's snapshot", Duration::from_secs(60), |t| {
            t.building
                .as_ref()
                .is_some_and(|b| b.validation.starts_with("waiting for the watermark"))
        })
        .await;
    cluster
        .target
        .exec("UPDATE items__tm_e2 SET name = 'changed by hand' WHERE id = 7")
        .await;
    std::fs::remove_file(&gate).unwrap();
    let blocked = cluster
        .wait_for("the blocked switch", Duration::from_secs(60), |t| {
            t.building.as_ref().is_some_and(|b| b.validation.starts_with("blocked"))
        })
        .await;
    let validation = &blocked.building.as_ref().unwrap().validation;
    assert!(
        validation.contains("found 1 row(s)") && validation.contains("tasks validate items"),
        "{validation}"
    );
    assert!(
        blocked.warnings.iter().any(|w| w.contains("epoch 2 cannot switch")),
        "{:?}",
        blocked.warnings
    );
    // Blocked means blocked: rounds go by, and epoch 1 stays live.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(cluster.task_status().await.epoch, 1);
    assert_eq!(table_oid(&cluster, "items").await, Some(old));
    let repaired: String = sqlx::query_scalar("SELECT name FROM items__tm_e2 WHERE id = 7")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(repaired, "item 7", "the validation repaired the row");

    let answer = cluster.cli_json(&["tasks", "validate", "items"]);
    assert!(
        answer["message"].as_str().unwrap().contains("validated again"),
        "{answer}"
    );
    converged(&cluster, 2, "after validating again").await;
    assert_ne!(table_oid(&cluster, "items").await, Some(old));
    let deadline = Instant::now() + Duration::from_secs(30);
    while table_oid(&cluster, "items__tm_e1").await.is_some() {
        assert!(Instant::now() < deadline, "epoch 1's table outlived its retention");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(cluster.task_status().await.retained.is_empty());
    let (ok, _, stderr) = cluster.cli(&["tasks", "rollback", "items", "--coordinator", &cluster.address]);
    assert!(!ok && stderr.contains("no epoch is retained"), "{stderr}");
}

/// `switch = "manual"`: the validated epoch waits for `tasks switch`; then `tasks rollback`
/// swaps epoch 1's retained table back in one transaction, epoch 1 catches up from its
/// checkpoints, and every key converges; epoch 2's table is dropped, and a second rollback
/// is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_switch_then_a_rollback_restores_the_previous_epoch() {
    let cluster = syncing("ep_rollback", ROWS, settings("switch = \"manual\"")).await;
    let old = table_oid(&cluster, "items").await.unwrap();
    let (ok, _, stderr) = cluster.cli(&["tasks", "switch", "items", "--coordinator", &cluster.address]);
    assert!(!ok && stderr.contains("has no epoch building"), "{stderr}");
    cluster.cli_json(&["tasks", "reinit", "items"]);
    let waiting = cluster
        .wait_for("the validated epoch 2", Duration::from_secs(60), |t| {
            t.building.as_ref().is_some_and(|b| b.awaiting_switch)
        })
        .await;
    assert_eq!(waiting.epoch, 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        cluster.task_status().await.epoch,
        1,
        "manual: no switch without the command"
    );
    let switched = cluster.cli_json(&["tasks", "switch", "items"]);
    assert!(
        switched["message"].as_str().unwrap().contains("epoch 2 is live"),
        "{switched}"
    );
    let new = table_oid(&cluster, "items").await.unwrap();
    assert_ne!(new, old);
    update_round(&cluster, 1).await;
    converged(&cluster, 2, "epoch 2 live").await;

    let rolled = cluster.cli_json(&["tasks", "rollback", "items"]);
    assert!(
        rolled["message"].as_str().unwrap().contains("epoch 1 is live again"),
        "{rolled}"
    );
    assert_eq!(
        table_oid(&cluster, "items").await,
        Some(old),
        "epoch 1's table is live again"
    );
    // Changes made while epoch 2 was live, and after, reach epoch 1's table from its
    // checkpoints.
    update_round(&cluster, 2).await;
    converged(&cluster, 1, "after the rollback").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while table_oid(&cluster, "items__tm_e2").await.is_some() {
        assert!(Instant::now() < deadline, "epoch 2's table was not dropped");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (ok, _, stderr) = cluster.cli(&["tasks", "rollback", "items", "--coordinator", &cluster.address]);
    assert!(!ok && stderr.contains("no epoch is retained"), "{stderr}");
}

/// A worker killed while epoch 2 builds, and the coordinator killed between the target's
/// rename and the control database's switch (crash point `swap_before_control`): the target
/// holds exactly one live table (epoch 2's) and epoch 1's beside it; the restarted coordinator
/// finishes the switch, and every key converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_during_the_build_and_the_switch_leave_one_live_table() {
    let settings = TaskSettings {
        coordinator_env: vec![("TIDEMARK_CRASH_AT", "swap_before_control:1".into())],
        page_size: 500,
        ..settings("")
    };
    let mut cluster = syncing("ep_kills", 20_000, settings).await;
    cluster.cli_json(&["tasks", "reinit", "items"]);
    cluster
        .wait_for("epoch 2 under way", Duration::from_secs(60), |t| {
            t.building.as_ref().is_some_and(|b| b.rows_applied > 0)
        })
        .await;
    cluster.workers[0].kill9();
    cluster.spawn_worker("b", 4, &[]);
    let exited = cluster.coordinator.as_mut().unwrap().wait_exit(Duration::from_secs(90));
    assert!(exited.is_some(), "the coordinator reached its crash point");
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE 'items%' ORDER BY 1",
    )
    .fetch_all(&cluster.target.pool)
    .await
    .unwrap();
    assert_eq!(tables, ["items", "items__tm_e1"], "the target switched alone");
    let config = cluster.config_path.clone();
    cluster.launch_coordinator(&config, &[]).await;
    update_round(&cluster, 3).await;
    converged(&cluster, 2, "after the restarted coordinator finished the switch").await;
    let status = cluster.task_status().await;
    assert_eq!(status.retained.iter().map(|e| e.epoch).collect::<Vec<_>>(), [1]);
    assert!(status.building.is_none());
}

/// A reader's transaction that keeps the live table open holds the switch back: the rename
/// gives up after its 2 s lock wait (other readers wait at most that long behind it), status
/// says why and the switch is tried again each round; once the transaction ends, epoch 2
/// switches, and every key converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_reader_delays_the_switch_and_status_says_why() {
    let cluster = syncing("ep_long_reader", ROWS, settings("")).await;
    let mut long = cluster.target.pool.begin().await.unwrap();
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM items")
        .fetch_one(&mut *long)
        .await
        .unwrap();
    assert_eq!(count, ROWS);
    cluster.cli_json(&["tasks", "reinit", "items"]);
    let waiting = cluster
        .wait_for("a switch held back", Duration::from_secs(60), |t| {
            t.warnings
                .iter()
                .any(|w| w.contains("the switch to epoch 2 failed and is retried"))
        })
        .await;
    assert_eq!(waiting.epoch, 1, "{:?}", waiting.warnings);
    assert!(
        waiting.warnings.iter().any(|w| w.contains("lock timeout")),
        "{:?}",
        waiting.warnings
    );
    // Another reader meanwhile: held at most by one attempt's lock wait.
    for _ in 0..3 {
        let started = Instant::now();
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM items")
            .fetch_one(&cluster.target.pool)
            .await
            .unwrap();
        assert_eq!(count, ROWS);
        assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    assert_eq!(cluster.task_status().await.epoch, 1);
    long.commit().await.unwrap();
    converged(&cluster, 2, "after the long reader ended").await;
}
