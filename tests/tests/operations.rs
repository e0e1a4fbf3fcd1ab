//! Operating the cluster while a task runs (issue 6): split, merge, move and drain under a live
//! writer; coordinator failover; SIGTERM mid-batch. Boundary of every test: everything
//! committed in the source before the final watermark; delete policy: none.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sqlx::Row;
use tidemark_proto::v1 as pb;
use tidemark_proto::v1::worker_service_client::WorkerServiceClient;
use tidemark_tests::{Cluster, KeyKind, Process, TaskSettings, binary, create_items, free_port, write_changes};

fn shards_json(cluster: &Cluster) -> serde_json::Value {
    let (ok, stdout, stderr) = cluster.cli(&[
        "shards",
        "list",
        "--task",
        "items",
        "--json",
        "--coordinator",
        &cluster.address,
    ]);
    assert!(ok, "shards list: {stderr}");
    serde_json::from_str(&stdout).unwrap()
}

fn cli_ok(cluster: &Cluster, args: &[&str]) -> String {
    let mut all = args.to_vec();
    all.extend_from_slice(&["--coordinator", &cluster.address]);
    let (ok, stdout, stderr) = cluster.cli(&all);
    assert!(ok, "{args:?}: {stderr}");
    stdout
}

/// Waits until `shards list` satisfies `done`.
async fn wait_shards(
    cluster: &Cluster,
    what: &str,
    done: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = shards_json(cluster);
        let shards = list["shards"].as_array().unwrap().clone();
        if done(&shards) {
            return shards;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {list}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every batch in the target's ledger is the batch the control database registered under
/// that id (same row count and content): no id was ever applied with other content.
async fn assert_ledger_matches_registry(cluster: &Cluster) {
    let registry: HashMap<String, (i64, String)> = sqlx::query("SELECT batch_id, row_count, content_hash FROM batches")
        .fetch_all(&cluster.control.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    let ledger = sqlx::query("SELECT batch_id, row_count, content_hash FROM tidemark_ledger")
        .fetch_all(&cluster.target.pool)
        .await
        .unwrap();
    assert!(!ledger.is_empty());
    for row in ledger {
        let id: String = row.get(0);
        let applied: (i64, String) = (row.get(1), row.get(2));
        assert_eq!(
            registry.get(&id),
            Some(&applied),
            "ledger batch {id} differs from its registration"
        );
    }
}

/// Per shard, the fences recorded with each commit never go down, and every claim raised it.
async fn assert_fences_increase(cluster: &Cluster) {
    let rows = sqlx::query("SELECT shard_id, fence FROM checkpoint_history ORDER BY id")
        .fetch_all(&cluster.control.pool)
        .await
        .unwrap();
    let mut last: HashMap<i32, i64> = HashMap::new();
    for row in rows {
        let (shard, fence): (i32, i64) = (row.get(0), row.get(1));
        if let Some(previous) = last.insert(shard, fence) {
            assert!(
                fence >= previous,
                "shard {shard}: fence went from {previous} down to {fence}"
            );
        }
    }
}

/// 200k rows, three workers, a live writer. Split a shard (at its median), merge two adjacent
/// shards, move one to a named worker and drain a worker, all while the sync runs: per-key
/// equality at the end, and no batch id applied with other content than registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_merge_move_and_drain_while_syncing() {
    let mut cluster = Cluster::new("ops_live").await;
    create_items(&cluster.source, KeyKind::Bigint, 200_000).await;
    cluster
        .start(&TaskSettings {
            shards: 8,
            page_size: 2000,
            ..TaskSettings::default()
        })
        .await;
    for id in ["ops-a", "ops-b", "ops-c"] {
        cluster.spawn_worker(id, 8, &[]);
    }
    let cluster = &cluster;
    let operations = async {
        // Split shard 0 at its median key: two children replace it.
        let out = cli_ok(cluster, &["shards", "split", "--task", "items", "--shard", "0"]);
        assert!(out.contains("split at"), "{out}");
        let split_at = Instant::now();
        let shards = wait_shards(cluster, "the split", |s| {
            s.iter().all(|x| x["shard"] != 0) && s.len() == 9
        })
        .await;
        let ids: Vec<u64> = shards.iter().map(|s| s["shard"].as_u64().unwrap()).collect();
        assert!(ids.contains(&8) && ids.contains(&9), "children get new ids: {ids:?}");
        // The children are offered as the split is done, not at the claim queue's correcting
        // read of every shard (every 60 s or longer).
        let shards = wait_shards(cluster, "the children's owners", |s| {
            s.iter()
                .filter(|x| x["shard"] == 8 || x["shard"] == 9)
                .all(|x| !x["owner"].is_null())
        })
        .await;
        let owners: Vec<(&serde_json::Value, &serde_json::Value)> =
            shards.iter().map(|s| (&s["shard"], &s["owner"])).collect();
        assert!(
            split_at.elapsed() < Duration::from_secs(20),
            "the split's children were owned {:?} after the split was asked: {owners:?}",
            split_at.elapsed()
        );

        // Merge shards 4 and 5 (adjacent); the action's result as JSON.
        let merged = cluster.cli_json(&["shards", "merge", "--task", "items", "4", "5"]);
        assert!(merged["message"].as_str().is_some_and(|m| !m.is_empty()), "{merged}");
        wait_shards(cluster, "the merge", |s| {
            s.iter().all(|x| x["shard"] != 4 && x["shard"] != 5) && s.len() == 8
        })
        .await;

        // Move shard 2 to ops-c.
        cli_ok(
            cluster,
            &["shards", "move", "--task", "items", "--shard", "2", "--to", "ops-c"],
        );
        wait_shards(cluster, "the move", |s| {
            s.iter().any(|x| x["shard"] == 2 && x["owner"] == "ops-c")
        })
        .await;

        // Drain ops-a: it ends with no shard.
        cli_ok(cluster, &["workers", "drain", "ops-a"]);
        wait_shards(cluster, "the drain", |s| {
            s.iter().all(|x| x["owner"] != "ops-a") && s.iter().all(|x| !x["owner"].is_null())
        })
        .await;
        let (ok, workers, _) = cluster.cli(&["workers", "list", "--json", "--coordinator", &cluster.address]);
        assert!(ok);
        let workers: serde_json::Value = serde_json::from_str(&workers).unwrap();
        let a = workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["id"] == "ops-a")
            .unwrap();
        assert_eq!(a["draining"], true);
        assert_eq!(a["shards"].as_array().unwrap().len(), 0, "{workers}");
    };
    let ((), end) = tokio::join!(operations, write_changes(&cluster.source, KeyKind::Bigint, 200_000, 20));
    cluster.wait_for_watermark(end, Duration::from_secs(120)).await;
    cluster
        .items_diff()
        .await
        .assert_clean("after split, merge, move and drain");
    assert_ledger_matches_registry(cluster).await;
    assert_fences_increase(cluster).await;
    let (ok, tasks, _) = cluster.cli(&["tasks", "list", "--coordinator", &cluster.address]);
    assert!(ok && tasks.contains("items"), "{tasks}");
}

/// Two coordinators on one etcd and control database; workers know both. Kill -9 the leader
/// mid-snapshot: the follower is elected within about a lease TTL, workers follow it, the sync
/// completes per key, and fence tokens per shard only increase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_mid_sync_follower_takes_over() {
    let mut cluster = Cluster::new("ops_ha").await;
    create_items(&cluster.source, KeyKind::Bigint, 200_000).await;
    let settings = TaskSettings {
        shards: 8,
        page_size: 2000,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    let first_address = cluster.address.clone();
    // The second replica: the same config on another port.
    let port = free_port();
    let second_address = format!("http://127.0.0.1:{port}");
    let config = std::fs::read_to_string(&cluster.config_path).unwrap();
    let first_port = first_address.rsplit(':').next().unwrap();
    let second_config = cluster.dir.0.join("tidemark-2.toml");
    std::fs::write(
        &second_config,
        config.replace(&format!("127.0.0.1:{first_port}\""), &format!("127.0.0.1:{port}\"")),
    )
    .unwrap();
    let second = Process::spawn(
        "coordinator-b",
        &binary("tidemark-coordinator"),
        &["serve", "--config", second_config.to_str().unwrap()],
        &[],
        &cluster.dir.0,
    );
    cluster.worker_address = Some(format!("{first_address},{second_address}"));
    cluster.spawn_worker("ha-a", 8, &[]);
    cluster.spawn_worker("ha-b", 8, &[]);
    let status = cluster
        .wait_for("a leader and progress", Duration::from_secs(60), |t| {
            t.rows_applied > 20_000
        })
        .await;
    let leader = cluster.try_status().await.unwrap().leader;
    assert_eq!(leader, first_address, "the first replica leads ({status:?})");

    // A worker of the test's own, registered with the leader.
    let mut probe = WorkerServiceClient::connect(first_address.clone()).await.unwrap();
    let lease_id = probe
        .register_worker(pb::RegisterWorkerRequest {
            worker_id: "ha-probe".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .lease_id;

    cluster.coordinator.as_mut().unwrap().kill9();
    let killed = Instant::now();
    // Before the follower is elected (that takes up to a lease TTL), it already renews a
    // worker's lease: a worker that moved on to it keeps its lease through the election.
    let mut follower = WorkerServiceClient::connect(second_address.clone()).await.unwrap();
    let heartbeat = follower
        .heartbeat(pb::HeartbeatRequest {
            worker_id: "ha-probe".into(),
            lease_id,
        })
        .await;
    let before_election = killed.elapsed();
    assert!(
        heartbeat.as_ref().is_ok_and(|r| r.get_ref().lease_alive),
        "the follower renews a worker's lease {before_election:?} after the leader died: {heartbeat:?}"
    );
    // Nor does it report the lease it renewed as lost (it did, in a log line and in
    // `tidemark_leases_lost`, for every heartbeat a follower served). The line is written
    // before the answer is sent.
    let called_expired = second.log_text().matches("heartbeat for an expired lease").count();
    assert_eq!(called_expired, 0, "the follower called leases it renewed expired");
    cluster.address = second_address.clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = cluster.try_status().await
            && status.leader == second_address
        {
            break;
        }
        assert!(Instant::now() < deadline, "no new leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elected = killed.elapsed();
    eprintln!("new leader after {elected:?} (lease TTL 4 s)");
    assert!(elected < Duration::from_secs(10), "elected after {elected:?}");

    let end = write_changes(&cluster.source, KeyKind::Bigint, 200_000, 4).await;
    cluster.wait_for_watermark(end, Duration::from_secs(120)).await;
    cluster.items_diff().await.assert_clean("after leader failover");
    // The workers' leases live in etcd: the follower kept them alive while it was not yet
    // the leader, so that no worker lost its lease (and with it all its shards) to the
    // election.
    for worker in &cluster.workers {
        let log = worker.log_text();
        assert!(
            !log.contains("lease expired"),
            "{} lost its lease in the failover",
            worker.name
        );
    }
    assert_fences_increase(&cluster).await;
    assert_ledger_matches_registry(&cluster).await;
}

/// SIGTERM a worker mid-snapshot: it finishes or abandons its batch, releases its shards and
/// exits 0; the other worker picks them up within one poll of its acquire loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_batch_hands_shards_over_within_a_poll() {
    let mut cluster = Cluster::new("ops_term").await;
    create_items(&cluster.source, KeyKind::Bigint, 100_000).await;
    cluster
        .start(&TaskSettings {
            shards: 4,
            page_size: 500,
            lease_ttl: "60s",
            ..TaskSettings::default()
        })
        .await;
    let first = cluster.spawn_worker("term-a", 4, &[]);
    cluster
        .wait_for("all shards owned by term-a", Duration::from_secs(60), |t| {
            t.shards.iter().all(|s| s.owner == "term-a") && t.rows_applied > 0
        })
        .await;
    cluster.spawn_worker("term-b", 4, &[]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.workers[first].signal("TERM");
    let exit = cluster.workers[first]
        .wait_exit(Duration::from_secs(30))
        .expect("the worker exits after SIGTERM");
    assert!(exit.success(), "exit 0: {exit}");
    let exited = Instant::now();
    cluster
        .wait_for("term-b owns every shard", Duration::from_secs(10), |t| {
            t.shards.iter().all(|s| s.owner == "term-b")
        })
        .await;
    let handed_over = exited.elapsed();
    eprintln!("shards picked up {handed_over:?} after the exit");
    // term-b's acquire loop polls every second when idle and every 50 ms after a success.
    assert!(handed_over < Duration::from_secs(3), "{handed_over:?}");
    let end = write_changes(&cluster.source, KeyKind::Bigint, 100_000, 2).await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    cluster.items_diff().await.assert_clean("after SIGTERM mid-batch");
}

/// `balance = true`: a worker that joins a cluster whose shards are all owned gets its share
/// by graceful moves, and the sync stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balance_evens_shards_when_a_worker_joins() {
    let mut cluster = Cluster::new("ops_balance").await;
    create_items(&cluster.source, KeyKind::Bigint, 20_000).await;
    cluster
        .start(&TaskSettings {
            shards: 8,
            coordinator_extra: "balance = true".into(),
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("bal-a", 8, &[]);
    cluster
        .wait_for("bal-a owns every shard", Duration::from_secs(60), |t| {
            t.shards.iter().all(|s| s.owner == "bal-a")
        })
        .await;
    cluster.spawn_worker("bal-b", 8, &[]);
    let status = cluster
        .wait_for("shards evened out", Duration::from_secs(60), |t| {
            let b = t.shards.iter().filter(|s| s.owner == "bal-b").count();
            let a = t.shards.iter().filter(|s| s.owner == "bal-a").count();
            a + b == 8 && a.abs_diff(b) <= 1
        })
        .await;
    eprintln!(
        "balanced: {:?}",
        status.shards.iter().map(|s| &s.owner).collect::<Vec<_>>()
    );
    cluster
        .write_and_converge(
            "UPDATE items SET name = 'after balance', updated_at = clock_timestamp() WHERE id % 50 = 0",
            "after balancing",
        )
        .await;
}

/// Capacity short of the shards (issue 20): one worker that holds 2 of 3 shards. The third
/// waits; status warns and names it, and `tidemark_shards_unassigned` counts it. Caught-up
/// shards then give it turns (each held at least 3 lease TTLs), so every shard's data keeps
/// arriving: the watermark passes writes made after the snapshot, per key. A second worker
/// with room ends the wait and the warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_shards_are_reported_and_take_turns() {
    let mut cluster = Cluster::new("capacity").await;
    create_items(&cluster.source, KeyKind::Bigint, 3_000).await;
    let metrics = format!("127.0.0.1:{}", free_port());
    cluster
        .start(&TaskSettings {
            shards: 3,
            coordinator_extra: format!("metrics_listen = \"{metrics}\""),
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("a", 2, &[]);
    let warned = cluster
        .wait_for("the capacity warning", Duration::from_secs(60), |t| {
            t.warnings.iter().any(|w| w.contains("have had no worker"))
        })
        .await;
    let warning = warned
        .warnings
        .iter()
        .find(|w| w.contains("have had no worker"))
        .unwrap();
    assert!(
        warning.starts_with("1 shard(s)") && warning.contains("--max-shards"),
        "{warning}"
    );
    let text = tidemark_tests::otlp::scrape(&metrics).await;
    assert!(
        text.contains("tidemark_shards_unassigned{task=\"items\"} 1.0"),
        "{text}"
    );

    // Turns: every shard's snapshot completes and later writes arrive, with one worker.
    let counts = |text: &str| {
        let of = |name, labels| tidemark_tests::otlp::sample(text, name, labels).unwrap_or(0.0);
        (
            of("tidemark_leases_acquired_total", "task=\"items\""),
            of("tidemark_shard_scan_seconds_count", "scan=\"claim_queue\""),
        )
    };
    let (acquired_before, reads_before) = counts(&text);
    write_changes(&cluster.source, KeyKind::Bigint, 3_000, 2).await;
    let now = cluster.source_now_micros().await;
    cluster.wait_for_watermark(now, Duration::from_secs(120)).await;
    cluster
        .items_diff()
        .await
        .assert_clean("one worker, three shards taking turns");
    // A released shard is checked on its own: releases for turns do not make the coordinator
    // read every shard again (at 50,000 shards each such read took about a second).
    let deadline = Instant::now() + Duration::from_secs(90);
    let (turns, reads) = loop {
        let (acquired, reads) = counts(&tidemark_tests::otlp::scrape(&metrics).await);
        let (turns, reads) = (acquired - acquired_before, reads - reads_before);
        if turns >= 3.0 {
            break (turns, reads);
        }
        assert!(Instant::now() < deadline, "{turns} shards acquired for turns in 90 s");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        reads < turns,
        "{reads} reads of every shard for {turns} turns: a release should not cost one"
    );

    cluster.spawn_worker("b", 4, &[]);
    cluster
        .wait_for("no shard waiting", Duration::from_secs(60), |t| {
            !t.warnings.iter().any(|w| w.contains("have had no worker")) && t.shards.iter().all(|s| !s.owner.is_empty())
        })
        .await;
    // The gauge follows on the leader's next operations round (status asks etcd directly).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = tidemark_tests::otlp::scrape(&metrics).await;
        if text.contains("tidemark_shards_unassigned{task=\"items\"} 0.0") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
