//! Poison rows in upsert mode (fault matrix S14): values the target's column types reject go
//! to the dead letters in the transaction that applies the rest of their batch; every other
//! key equals the source, and the shard keeps moving.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::Row;
use tidemark_tests::{Cluster, TaskSettings, TestDb};

/// Id → the class its poison should be dead-lettered with.
fn poison() -> BTreeMap<String, &'static str> {
    let mut ids = BTreeMap::new();
    for k in 0..12 {
        ids.insert((100 + 1600 * k).to_string(), "string_data_right_truncation");
    }
    for k in 0..11 {
        ids.insert((300 + 1600 * k).to_string(), "numeric_value_out_of_range");
        ids.insert((500 + 1600 * k).to_string(), "untranslatable_character");
    }
    // Inserted during the incremental phase.
    ids.insert("30001".into(), "string_data_right_truncation");
    ids.insert("30002".into(), "numeric_value_out_of_range");
    ids.insert("30003".into(), "untranslatable_character");
    ids
}

/// id, name, amount, doc (as jsonb text) and version of every row, keyed by id.
async fn rows(db: &TestDb, query: &str) -> BTreeMap<String, (String, String, String, i64)> {
    sqlx::query(sqlx::AssertSqlSafe(query.to_string()))
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2), row.get(3), row.get(4))))
        .collect()
}

const SOURCE_ROWS: &str = "SELECT id::text, name, amount::text, doc::jsonb::text, \
     (extract(epoch from updated_at) * 1000000)::bigint FROM items WHERE NOT (id::text = ANY($POISON))";
const TARGET_ROWS: &str = "SELECT id::text, name::text, amount::text, doc::text, _tidemark_version FROM items";

async fn assert_target_equals_source_except_poison(cluster: &Cluster, poison: &[String], context: &str) {
    let list = format!(
        "ARRAY[{}]",
        poison.iter().map(|k| format!("'{k}'")).collect::<Vec<_>>().join(",")
    );
    let source = rows(&cluster.source, &SOURCE_ROWS.replace("$POISON", &list)).await;
    let target = rows(&cluster.target, TARGET_ROWS).await;
    let wrong: Vec<String> = source
        .keys()
        .chain(target.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|key| source.get(*key) != target.get(*key))
        .take(20)
        .map(|key| format!("{key}: target {:?}, source {:?}", target.get(key), source.get(key)))
        .collect();
    assert!(wrong.is_empty(), "{context}: keys differ: {wrong:?}");
    assert!(source.len() > 20_000, "{context}: {} rows compared", source.len());
}

async fn letters(db: &TestDb) -> BTreeMap<String, (String, String)> {
    sqlx::query("SELECT key, error_class, status FROM tidemark_dead_letters WHERE task = 'items'")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_go_to_dead_letters_and_the_rest_converges() {
    let mut cluster = Cluster::new("poison").await;
    cluster
        .source
        .exec(
            "CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamptz(3) NOT NULL DEFAULT clock_timestamp(),
                name text NOT NULL, amount numeric(12,2) NOT NULL, doc json NOT NULL);
             INSERT INTO items (id, name, amount, doc)
             SELECT g, 'item-' || g, (g % 1000) + 0.25, json_build_object('n', g)
             FROM generate_series(1, 20000) g;
             UPDATE items SET name = repeat('x', 40) WHERE id % 1600 = 100 AND id < 19200;
             UPDATE items SET amount = 123456789.5 WHERE id % 1600 = 300 AND id < 17900;
             UPDATE items SET doc = '{\"a\": \"nul \\u0000 here\"}' WHERE id % 1600 = 500 AND id < 17900;",
        )
        .await;
    // The target's types are narrower than the source's: 16 characters, 8 digits, jsonb
    // (which cannot hold \u0000).
    cluster
        .target
        .exec(
            "CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamptz(3) NOT NULL,
                name varchar(16) NOT NULL, amount numeric(8,2) NOT NULL, doc jsonb NOT NULL,
                _tidemark_version bigint NOT NULL)",
        )
        .await;
    let settings = TaskSettings {
        shards: 4,
        page_size: 1000,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("a", 4, &[]);
    cluster.spawn_worker("b", 4, &[]);
    let snapshot_poison: Vec<String> = poison()
        .into_keys()
        .filter(|k| k.parse::<i64>().unwrap() < 30_000)
        .collect();
    assert_eq!(snapshot_poison.len(), 34);
    cluster
        .wait_for("the snapshot", Duration::from_secs(180), |t| t.snapshot_complete)
        .await;

    // Changes after the poison: updates, good inserts and three more poison rows.
    cluster
        .source
        .exec(
            "UPDATE items SET name = 'upd-' || id, updated_at = clock_timestamp() WHERE id % 10 = 3;
             INSERT INTO items (id, name, amount, doc)
             SELECT g, 'new-' || g, 1.5, json_build_object('n', g) FROM generate_series(30010, 30509) g;
             INSERT INTO items (id, name, amount, doc) VALUES
               (30001, repeat('y', 17), 1, '{}'),
               (30002, 'overflow', 1000000, '{}'),
               (30003, 'nul', 1, '[\"\\u0000\"]');",
        )
        .await;
    let now = cluster.source_now_micros().await;
    let status = cluster.wait_for_watermark(now, Duration::from_secs(120)).await;
    assert_eq!(
        status.phase, "incremental",
        "the shards keep moving past their poison rows"
    );

    let poison = poison();
    let poison_keys: Vec<String> = poison.keys().cloned().collect();
    assert_eq!(poison_keys.len(), 37);
    assert_target_equals_source_except_poison(&cluster, &poison_keys, "after the changes").await;
    let found = letters(&cluster.target).await;
    let expected: BTreeMap<String, (String, String)> = poison
        .iter()
        .map(|(k, class)| (k.clone(), (class.to_string(), "INIT".to_string())))
        .collect();
    assert_eq!(found, expected, "dead letters are exactly the 37 poison rows");
    assert_eq!(cluster.task_status().await.dead_letters.get("INIT").copied(), Some(37));

    // The operator widens the name column and retries those rows: they land, and equal the
    // source; the others fail again and wait.
    cluster
        .target
        .exec("ALTER TABLE items ALTER COLUMN name TYPE text")
        .await;
    let oversize: Vec<&String> = poison
        .iter()
        .filter(|(_, class)| **class == "string_data_right_truncation")
        .map(|(k, _)| k)
        .collect();
    let mut args = vec!["dead-letters", "retry", "--task", "items", "--json"];
    for key in &oversize {
        args.extend(["--key", key.as_str()]);
    }
    args.extend(["--coordinator", cluster.address.as_str()]);
    let (ok, stdout, stderr) = cluster.cli(&args);
    assert!(ok, "{stderr}");
    let result: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(result["resolved"].as_u64(), Some(oversize.len() as u64), "{result}");
    let still_poison: Vec<String> = poison_keys.iter().filter(|k| !oversize.contains(k)).cloned().collect();
    assert_target_equals_source_except_poison(&cluster, &still_poison, "after the retry").await;
    let found = letters(&cluster.target).await;
    for (key, (class, status)) in &found {
        let expected_status = if oversize.contains(&key) { "RESOLVED" } else { "INIT" };
        assert_eq!(
            (status.as_str(), class.as_str()),
            (expected_status, poison[key]),
            "key {key}"
        );
    }
}
