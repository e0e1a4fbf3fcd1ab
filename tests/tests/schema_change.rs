//! A schema change in the middle of an epoch (fault matrix S13). A source column changes its
//! type while the shards run. The workers refuse every page read after the change, so nothing
//! read under the new type reaches the target, and the coordinator pauses the task with
//! `schema changed … reinitialization required` (its running check, or its start-up check).
//! `tasks reinit` builds the new epoch beside the live table with the source's columns (the
//! new type, the new column), validates it, switches, and it converges per key; the old table
//! is retained beside.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tidemark_tests::{Cluster, ITEM_COLUMNS, KeyKind, TaskSettings, TestDb, compare, create_items, free_port};

async fn quantities(db: &TestDb) -> BTreeMap<i64, Option<String>> {
    sqlx::query_as::<_, (i64, Option<String>)>("SELECT id, qty::text FROM items WHERE id % 10 = 0")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_type_change_pauses_the_task_and_reinit_converges() {
    let mut cluster = Cluster::new("schema").await;
    create_items(&cluster.source, KeyKind::Bigint, 3_000).await;
    // The coordinator's running check is off at first: the workers alone must keep the
    // changed rows out.
    let settings = TaskSettings {
        shards: 2,
        coordinator_env: vec![("TIDEMARK_TEST_NO_SCHEMA_WATCH", "1".into())],
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("a", 2, &[]);
    cluster.spawn_worker("b", 2, &[]);
    let now = cluster.source_now_micros().await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;
    let before = quantities(&cluster.target).await;
    assert_eq!(before.len(), 300);

    // Values the old type cannot hold: read as text into the old target column, each would
    // be a dead letter (numeric_value_out_of_range) if the change went unnoticed.
    cluster
        .source
        .exec("ALTER TABLE items ALTER COLUMN qty TYPE bigint; ALTER TABLE items ADD COLUMN color text DEFAULT 'red'")
        .await;
    cluster
        .source
        .exec(
            "UPDATE items SET qty = 5000000000 + id, color = 'blue', updated_at = clock_timestamp() WHERE id % 10 = 0",
        )
        .await;
    let changed = cluster.source_now_micros().await;
    // The rows are readable once the safety delay has passed; the shards read them and refuse
    // the pages.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cluster.workers.iter().any(|w| w.log_text().contains("page refused")) {
        assert!(Instant::now() < deadline, "no worker refused a page after the change");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let status = cluster.task_status().await;
    assert_ne!(status.phase, "paused", "the running check was off");
    assert!(
        status.watermark_micros.is_none_or(|w| w < changed),
        "the watermark did not pass the refused rows"
    );
    assert_eq!(
        quantities(&cluster.target).await,
        before,
        "nothing read under the new type reached the target"
    );
    let letters: i64 = sqlx::query_scalar("SELECT count(*) FROM tidemark_dead_letters")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(letters, 0, "no row was dead-lettered for the change");

    // A coordinator with its checks on (here: restarted) pauses the task by name.
    let config = cluster.config_path.clone();
    cluster.launch_coordinator(&config, &[]).await;
    let paused = cluster
        .wait_for("the schema pause", Duration::from_secs(60), |t| t.phase == "paused")
        .await;
    assert!(
        paused
            .paused_reason
            .starts_with("schema changed: source columns of public.items")
            && paused.paused_reason.ends_with("reinitialization required"),
        "{}",
        paused.paused_reason
    );
    assert_eq!(quantities(&cluster.target).await, before);

    // The restarted coordinator leads once the killed one's etcd lease has expired.
    let deadline = Instant::now() + Duration::from_secs(30);
    let reinit = loop {
        let (ok, stdout, stderr) =
            cluster.cli(&["tasks", "reinit", "items", "--json", "--coordinator", &cluster.address]);
        if ok {
            break serde_json::from_str::<serde_json::Value>(&stdout).unwrap();
        }
        assert!(
            stderr.contains("not the leader") && Instant::now() < deadline,
            "reinit: {stderr}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(reinit["epoch"].as_u64(), Some(2), "{reinit}");
    assert_eq!(
        reinit["target_changes"],
        serde_json::json!(["CREATE TABLE \"public\".\"items__tm_e2\""]),
        "{reinit}"
    );
    let now = cluster.source_now_micros().await;
    cluster
        .wait_for("epoch 2 past the change", Duration::from_secs(90), |t| {
            t.epoch == 2 && t.phase != "paused" && t.watermark_micros.is_some_and(|w| w > now)
        })
        .await;
    cluster.items_diff().await.assert_clean("after reinit");
    let after = quantities(&cluster.target).await;
    assert!(
        after
            .iter()
            .all(|(id, qty)| qty.as_deref() == Some((5_000_000_000 + id).to_string().as_str())),
        "the new values arrived"
    );
    // The added column, per key: 'blue' for the updated rows, the default elsewhere.
    let colors = |db: &TestDb| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (i64, Option<String>)>("SELECT id, color FROM items")
                .fetch_all(&pool)
                .await
                .unwrap()
                .into_iter()
                .collect::<BTreeMap<i64, Option<String>>>()
        }
    };
    let (source, target) = (colors(&cluster.source).await, colors(&cluster.target).await);
    assert_eq!(source.len(), 3_000);
    assert_eq!(target, source, "the added column holds the source's values");
    assert_eq!(source.get(&10).cloned().flatten().as_deref(), Some("blue"));
    let qty_type: String = sqlx::query_scalar("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = 'items'::regclass AND attname = 'qty'")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(qty_type, "bigint");
    // The replaced epoch's table is retained beside, with its old type, for a rollback.
    let old_type: String = sqlx::query_scalar("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = 'items__tm_e1'::regclass AND attname = 'qty'")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(old_type, "integer");
}

/// A cluster syncing `rows` items with `schema_changes = "evolve"` (two shards, a worker per
/// name), its watermark past the snapshot.
async fn evolving(
    tag: &str,
    rows: i64,
    coordinator_env: Vec<(&'static str, String)>,
    coordinator_extra: String,
    workers: &[&str],
) -> Cluster {
    let mut cluster = Cluster::new(tag).await;
    create_items(&cluster.source, KeyKind::Bigint, rows).await;
    let settings = TaskSettings {
        shards: 2,
        extra: "schema_changes = \"evolve\"".into(),
        coordinator_env,
        coordinator_extra,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    for name in workers {
        cluster.spawn_worker(name, 2, &[]);
    }
    let now = cluster.source_now_micros().await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;
    cluster
}

/// `schema_changes = "evolve"`: a column added without a value for the existing rows joins the
/// live epoch and the target without a re-snapshot. The column is added in the transaction
/// that fills it for some rows, and more rows get it after; the coordinator's check is held
/// back (a test gate) until the shards have read all of them without the column they do not
/// know yet and the watermark has passed them. Then the epoch evolves, the shards read again
/// from the watermark confirmed before the change, and every key converges: the column's
/// values, every other column, the version. The epoch stays 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_column_evolves_the_live_epoch_and_converges_per_key() {
    let dir = tidemark_tests::TempDir::new("evolve-gate");
    let gate = dir.0.join("gate");
    let env = vec![("TIDEMARK_TEST_SCHEMA_WATCH_GATE", gate.display().to_string())];
    let metrics = format!("127.0.0.1:{}", free_port());
    let extra = format!("metrics_listen = \"{metrics}\"");
    let cluster = evolving("evolve", 3_000, env, extra, &["a", "b"]).await;
    // The check has confirmed the columns at least once by now (it runs every 500 ms).
    tokio::time::sleep(Duration::from_secs(1)).await;
    std::fs::write(&gate, b"").unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;

    cluster
        .source
        .exec(
            "BEGIN; ALTER TABLE items ADD COLUMN color text; \
             UPDATE items SET color = 'c' || id, qty = coalesce(qty, 0) + 1, updated_at = clock_timestamp() \
             WHERE id % 7 = 0; SELECT pg_sleep(2); COMMIT",
        )
        .await;
    cluster
        .source
        .exec("UPDATE items SET color = 'late' || id, updated_at = clock_timestamp() WHERE id % 11 = 0")
        .await;
    let changed = cluster.source_now_micros().await;
    // Past the changed rows by more than the overlap: an ordinary cycle would not read them
    // again.
    cluster
        .wait_for_watermark(changed + 4_000_000, Duration::from_secs(60))
        .await;
    let colored = |db: &TestDb| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM information_schema.columns WHERE table_name = 'items' AND column_name = 'color'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        colored(&cluster.target).await,
        0,
        "the change is not seen yet, so the target lacks the column"
    );
    std::fs::remove_file(&gate).unwrap();
    let evolved = cluster.source_now_micros().await;
    let status = cluster
        .wait_for("the watermark past the evolution", Duration::from_secs(90), |t| {
            t.phase == "paused" || t.watermark_micros.is_some_and(|w| w > evolved)
        })
        .await;
    assert_ne!(status.phase, "paused", "{}", status.paused_reason);
    assert_eq!(status.epoch, 1, "evolved in place, not a new epoch");
    let mut columns = ITEM_COLUMNS.to_vec();
    columns.push("color");
    let diff = compare(
        &cluster.source.pool,
        &cluster.target.pool,
        &["id"],
        &columns,
        "updated_at",
    )
    .await;
    diff.assert_clean("after the column was added");
    let colored: i64 = sqlx::query_scalar("SELECT count(*) FROM items WHERE color IS NOT NULL")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(
        colored,
        (1..=3000).filter(|id| id % 7 == 0 || id % 11 == 0).count() as i64
    );
    let log = cluster.coordinator.as_ref().unwrap().log_text();
    assert!(log.contains("source columns added: the epoch evolved"), "{log}");
    let scraped = tidemark_tests::otlp::scrape(&metrics).await;
    assert_eq!(
        tidemark_tests::otlp::sample(&scraped, "tidemark_schema_evolutions_total", "task=\"items\""),
        Some(1.0),
        "{scraped}"
    );
}

/// A column added with a default changed every existing row without moving its cursor:
/// `evolve` cannot carry that over, and the task pauses by name; nothing of the change reaches
/// the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_added_with_a_default_pauses_by_name_under_evolve() {
    let cluster = evolving("evolve_default", 1_000, Vec::new(), String::new(), &["a"]).await;
    cluster
        .source
        .exec("ALTER TABLE items ADD COLUMN flag integer DEFAULT 7")
        .await;
    let paused = cluster
        .wait_for("the pause", Duration::from_secs(60), |t| t.phase == "paused")
        .await;
    assert!(
        paused
            .paused_reason
            .starts_with("schema changed: source columns of public.items")
            && paused
                .paused_reason
                .contains("column(s) flag of public.items were added with a value for the rows already there"),
        "{}",
        paused.paused_reason
    );
    let has_flag: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM information_schema.columns WHERE table_name = 'items' AND column_name = 'flag')",
    )
    .fetch_one(&cluster.target.pool)
    .await
    .unwrap();
    assert!(!has_flag, "the target was not changed");
}

/// A leader that never confirmed a watermark under the epoch (here: the first coordinator's
/// check is off while the column is added and the rows are read without it; then a
/// restarted coordinator with its check on leads) cannot know where the change began: it
/// evolves the epoch and reads again from the epoch's incremental start, and every key
/// converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_evolves_from_the_epochs_incremental_start() {
    let env = vec![("TIDEMARK_TEST_NO_SCHEMA_WATCH", "1".into())];
    let mut cluster = evolving("evolve_leader", 2_000, env, String::new(), &["a"]).await;
    cluster
        .source
        .exec(
            "ALTER TABLE items ADD COLUMN color text; \
             UPDATE items SET color = 'c' || id, updated_at = clock_timestamp() WHERE id % 7 = 0",
        )
        .await;
    let changed = cluster.source_now_micros().await;
    cluster
        .wait_for_watermark(changed + 4_000_000, Duration::from_secs(60))
        .await;
    let config = cluster.config_path.clone();
    cluster.launch_coordinator(&config, &[]).await;
    // Until the new leader's first check evolves the epoch, the shards keep committing pages
    // read without the column: the watermark passes any point taken before the evolution.
    let coordinator = cluster.coordinator.as_ref().unwrap();
    coordinator
        .wait_for_log("reading again from the epoch's start", Duration::from_secs(60))
        .await;
    coordinator
        .wait_for_log("the epoch evolved", Duration::from_secs(30))
        .await;
    let end = cluster.source_now_micros().await;
    let status = cluster
        .wait_for("the watermark past the evolution", Duration::from_secs(90), |t| {
            t.phase == "paused" || t.watermark_micros.is_some_and(|w| w > end)
        })
        .await;
    assert_ne!(status.phase, "paused", "{}", status.paused_reason);
    assert_eq!(status.epoch, 1);
    let mut columns = ITEM_COLUMNS.to_vec();
    columns.push("color");
    compare(
        &cluster.source.pool,
        &cluster.target.pool,
        &["id"],
        &columns,
        "updated_at",
    )
    .await
    .assert_clean("after a new leader evolved the epoch");
}
