//! Snapshot then incremental, PostgreSQL → PostgreSQL, with real etcd and binaries.
//! Boundary: everything committed in the source before the watermark; delete policy: none
//! (the writer does not delete). The oracle compares every column and the version per key.

use std::collections::BTreeSet;
use std::time::Duration;

use tidemark_tests::{Cluster, KeyKind, TaskSettings, binary, create_items, write_changes};

async fn snapshot_then_incremental(tag: &str, key: KeyKind, rows: i64) {
    let mut cluster = Cluster::new(tag).await;
    create_items(&cluster.source, key, rows).await;
    let settings = TaskSettings::default();
    cluster.start(&settings).await;
    for i in 0..3 {
        cluster.spawn_worker(&format!("{tag}-w{i}"), 3, &[]);
    }

    let status = cluster
        .wait_for("snapshot complete", Duration::from_secs(300), |t| t.snapshot_complete)
        .await;
    assert_eq!(status.shards.len(), 8);
    let owners: BTreeSet<&str> = status.shards.iter().map(|s| s.owner.as_str()).collect();
    assert_eq!(
        owners.len(),
        3,
        "8 shards over 3 workers with at most 3 each: {owners:?}"
    );
    cluster.items_diff().await.assert_clean("after the snapshot");

    // 5,000 updates and 5,000 inserts while the workers run.
    let writes_end = write_changes(&cluster.source, key, rows, 20).await;
    cluster.wait_for_watermark(writes_end, Duration::from_secs(120)).await;
    let diff = cluster.items_diff().await;
    diff.assert_clean("after 5k updates and 5k inserts");
    assert_eq!(diff.keys, rows as usize + 5_000);

    // The operator's view: `status --json` has the documented shape.
    let output = std::process::Command::new(binary("tidemark-coordinator"))
        .args(["status", "--coordinator", &cluster.address, "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let task = &json["tasks"][0];
    assert_eq!(task["name"], "items");
    assert_eq!(task["phase"], "incremental");
    assert_eq!(task["snapshot_complete"], true);
    assert_eq!(task["epoch"], 1);
    assert!(task["rows_applied"].as_u64().unwrap() >= rows as u64 + 10_000);
    let watermark = task["watermark"].as_str().unwrap();
    assert!(
        watermark.ends_with('Z') && watermark.len() == "2026-01-01T00:00:00.000Z".len(),
        "{watermark}"
    );
    let shard = &task["shards"][0];
    for field in ["id", "range", "owner", "phase", "state", "rows_applied", "cursor"] {
        assert!(shard.get(field).is_some(), "shard field {field} missing: {shard}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bigint_key_snapshot_then_incremental_with_three_workers() {
    snapshot_then_incremental("bigint", KeyKind::Bigint, 200_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_key_with_prefix_shards() {
    snapshot_then_incremental("uuid", KeyKind::Uuid, 200_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_key_with_sampled_shards() {
    snapshot_then_incremental("text", KeyKind::Text, 50_000).await;
}
