//! Crashes and fencing: a worker killed mid-snapshot, a pending batch replayed from staging,
//! a zombie's commit refused, and thousands of rows sharing one millisecond split over pages
//! with a crash between them. Boundary: everything committed before the watermark; deletes:
//! none.

use std::time::Duration;

use sqlx::Row;
use tidemark_common::cursor::{Cursor, KeyValue, Position};
use tidemark_proto::v1 as pb;
use tidemark_proto::v1::worker_service_client::WorkerServiceClient;
use tidemark_tests::s3::{S3_ENV, S3Server};
use tidemark_tests::{Cluster, KeyKind, TaskSettings, create_items, insert_items};

/// Every committed batch is in the target ledger exactly once with the registered content,
/// and per shard the checkpoint history never goes backwards.
async fn assert_batch_protocol_held(cluster: &Cluster) {
    let committed = sqlx::query("SELECT batch_id, row_count, content_hash FROM batches WHERE state = 'COMMITTED'")
        .fetch_all(&cluster.control.pool)
        .await
        .unwrap();
    assert!(!committed.is_empty());
    for row in &committed {
        let batch_id: String = row.get(0);
        let ledger = sqlx::query("SELECT row_count, content_hash FROM tidemark_ledger WHERE batch_id = $1")
            .bind(&batch_id)
            .fetch_optional(&cluster.target.pool)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("committed batch {batch_id} is not in the target ledger"));
        assert_eq!(ledger.get::<i64, _>(0), row.get::<i64, _>(1), "row count of {batch_id}");
        assert_eq!(
            ledger.get::<String, _>(1),
            row.get::<String, _>(2),
            "content of {batch_id}"
        );
    }
    let history = sqlx::query("SELECT shard_id, version, fence FROM checkpoint_history ORDER BY shard_id, id")
        .fetch_all(&cluster.control.pool)
        .await
        .unwrap();
    for pair in history.windows(2) {
        if pair[0].get::<i32, _>(0) != pair[1].get::<i32, _>(0) {
            continue;
        }
        let shard: i32 = pair[0].get(0);
        assert!(
            pair[1].get::<i64, _>(1) > pair[0].get::<i64, _>(1),
            "version went backwards on shard {shard}"
        );
        assert!(
            pair[1].get::<i64, _>(2) >= pair[0].get::<i64, _>(2),
            "fence went backwards on shard {shard}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_mid_snapshot_and_pending_batch_replayed() {
    let rows = 200_000;
    let mut cluster = Cluster::new("kill").await;
    create_items(&cluster.source, KeyKind::Bigint, rows).await;
    let settings = TaskSettings {
        page_size: 1000,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    // This worker aborts right after registering its third batch: staged and registered,
    // never applied or committed. Whoever takes the shard must replay exactly that batch.
    let crasher = cluster.spawn_worker("crasher", 4, &[("TIDEMARK_CRASH_AT", "after_register:3")]);
    let victim = cluster.spawn_worker("victim", 4, &[]);
    let exit = cluster.workers[crasher]
        .wait_exit(Duration::from_secs(60))
        .expect("crasher reached its crash point");
    assert!(!exit.success(), "the crash point aborts the process");

    // kill -9 the other worker in the middle of the snapshot.
    let status = cluster
        .wait_for("20k rows applied", Duration::from_secs(60), |t| {
            t.rows_applied >= 20_000
        })
        .await;
    cluster.workers[victim].kill9();
    assert!(!status.snapshot_complete, "the kill must land mid-snapshot: {status:?}");
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM batches WHERE state = 'STAGED'")
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();
    assert!(pending >= 1, "the crasher left a registered, uncommitted batch");

    cluster.spawn_worker("rescuer", 8, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(180), |t| t.snapshot_complete)
        .await;
    cluster.items_diff().await.assert_clean("after the kills");

    // The crasher's batch was re-applied from staging by the new owner and committed once.
    let replayed = sqlx::query("SELECT batch_id, fence FROM batches WHERE replayed AND state = 'COMMITTED'")
        .fetch_all(&cluster.control.pool)
        .await
        .unwrap();
    assert!(!replayed.is_empty(), "a pending batch was replayed");
    for row in &replayed {
        let batch_id: String = row.get(0);
        let registered_fence: i64 = row.get(1);
        let committed_fence: i64 = sqlx::query_scalar("SELECT fence FROM checkpoint_history WHERE batch_id = $1")
            .bind(&batch_id)
            .fetch_one(&cluster.control.pool)
            .await
            .unwrap();
        assert!(
            committed_fence > registered_fence,
            "replayed batch {batch_id} was committed by a later owner"
        );
    }
    let rescuer_log = cluster.workers.last().unwrap().log_text();
    let victim_log = cluster.workers[victim].log_text();
    assert!(
        rescuer_log.contains("replayed pending batch from staging")
            || victim_log.contains("replayed pending batch from staging"),
        "a worker logged the replay"
    );
    assert_batch_protocol_held(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_staged_but_never_registered_is_restaged_by_the_next_owner() {
    let mut cluster = Cluster::new("torn").await;
    create_items(&cluster.source, KeyKind::Bigint, 5000).await;
    let settings = TaskSettings {
        shards: 1,
        page_size: 1000,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    // Data object and manifest are written, then the worker dies before registering.
    let first = cluster.spawn_worker("first", 1, &[("TIDEMARK_CRASH_AT", "after_stage:2")]);
    let exit = cluster.workers[first]
        .wait_exit(Duration::from_secs(60))
        .expect("crash after staging");
    assert!(!exit.success());
    let registered: i64 = sqlx::query_scalar("SELECT count(*) FROM batches")
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();
    assert_eq!(registered, 1, "only the first page was registered");

    // The next owner reads the same bounds (same batch id) and must stage its own manifest.
    cluster.spawn_worker("second", 1, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    cluster
        .items_diff()
        .await
        .assert_clean("after a crash between staging and registering");
    assert_batch_protocol_held(&cluster).await;
}

async fn worker_client(cluster: &Cluster) -> WorkerServiceClient<tonic::transport::Channel> {
    WorkerServiceClient::connect(cluster.address.clone()).await.unwrap()
}

/// Registers a worker over gRPC and acquires one shard for it.
async fn register(
    client: &mut WorkerServiceClient<tonic::transport::Channel>,
    worker_id: &str,
) -> pb::RegisterWorkerResponse {
    client
        .register_worker(pb::RegisterWorkerRequest {
            worker_id: worker_id.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Every shard one acquire answers with, at most `max_shards`.
async fn acquire(
    client: &mut WorkerServiceClient<tonic::transport::Channel>,
    worker_id: &str,
    lease_id: i64,
    max_shards: u32,
) -> Result<Vec<pb::ShardAssignment>, tonic::Status> {
    let response = client
        .acquire_shard(pb::AcquireShardRequest {
            worker_id: worker_id.into(),
            lease_id,
            max_shards,
        })
        .await?
        .into_inner();
    assert!(
        response.assignment.is_some() || response.more.is_empty(),
        "more shards without a first"
    );
    Ok(response.assignments())
}

async fn register_and_acquire(
    client: &mut WorkerServiceClient<tonic::transport::Channel>,
    worker_id: &str,
) -> Option<pb::ShardAssignment> {
    let lease_id = register(client, worker_id).await.lease_id;
    acquire(client, worker_id, lease_id, 1)
        .await
        .unwrap()
        .into_iter()
        .next()
}

/// A snapshot cursor of `epoch` just after bigint key `key`.
fn after_key(epoch: u64, key: i64) -> Cursor {
    Cursor::new(
        epoch,
        Position::Snapshot {
            after_key: Some(vec![KeyValue {
                sql_type: "bigint".into(),
                value: key.to_string(),
            }]),
        },
    )
}

async fn checkpoint_row(cluster: &Cluster, shard_id: u32) -> (serde_json::Value, i64, i64) {
    let row = sqlx::query("SELECT cursor, version, fence FROM checkpoints WHERE shard_id = $1")
        .bind(shard_id as i32)
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// A one-shard task over `rows` items, no worker running, and a client of the worker API.
async fn one_shard_task(tag: &str, rows: i64) -> (Cluster, WorkerServiceClient<tonic::transport::Channel>) {
    sharded_task(tag, rows, 1).await
}

/// A task of `shards` shards over `rows` items, no worker running, and a client of the
/// worker API.
async fn sharded_task(tag: &str, rows: i64, shards: u32) -> (Cluster, WorkerServiceClient<tonic::transport::Channel>) {
    let mut cluster = Cluster::new(tag).await;
    create_items(&cluster.source, KeyKind::Bigint, rows).await;
    cluster
        .start(&TaskSettings {
            shards,
            ..TaskSettings::default()
        })
        .await;
    let client = worker_client(&cluster).await;
    (cluster, client)
}

/// The owner and fence the control database records for shard `shard_id`.
async fn owner_and_fence(cluster: &Cluster, shard_id: u32) -> (Option<String>, i64) {
    sqlx::query_as("SELECT owner, fence FROM checkpoints WHERE shard_id = $1")
        .bind(shard_id as i32)
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap()
}

/// `owner` releases the shard of `assignment`, asking for a pause when `pause_reason` is set.
fn release_request(owner: &str, assignment: &pb::ShardAssignment, pause_reason: &str) -> pb::ReleaseShardRequest {
    pb::ReleaseShardRequest {
        worker_id: owner.into(),
        task: "items".into(),
        epoch: assignment.epoch,
        shard_id: assignment.shard_id,
        fence_token: assignment.fence_token,
        pause_reason: pause_reason.into(),
        failure: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_with_a_stale_fence_is_refused() {
    let (cluster, mut client) = one_shard_task("fence", 1000).await;

    // A first owner takes the shard, then loses it to a second owner.
    let zombie = register_and_acquire(&mut client, "zombie").await.expect("a free shard");
    client
        .release_shard(release_request("zombie", &zombie, ""))
        .await
        .unwrap();
    let owner = register_and_acquire(&mut client, "owner")
        .await
        .expect("the released shard");
    assert_eq!(owner.shard_id, zombie.shard_id);
    assert!(
        owner.fence_token > zombie.fence_token,
        "fence tokens increase per ownership"
    );
    let before = checkpoint_row(&cluster, owner.shard_id).await;

    let upper = after_key(zombie.epoch, 500);
    let commit = |fence_token: u64, expected_version: u64| pb::CommitBatchRequest {
        worker_id: "zombie".into(),
        task: "items".into(),
        epoch: zombie.epoch,
        shard_id: zombie.shard_id,
        fence_token,
        expected_version,
        batch_id: "empty-advance".into(),
        lower: zombie.cursor.clone(),
        upper: upper.encode(),
        row_count: 0,
        empty: true,
        replayed: false,
        late_row_lateness_micros: vec![],
    };
    let refused = client
        .commit_batch(commit(zombie.fence_token, zombie.checkpoint_version))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("fenced"), "{}", refused.message());
    let refused_register = client
        .register_batch(pb::RegisterBatchRequest {
            worker_id: "zombie".into(),
            task: "items".into(),
            epoch: zombie.epoch,
            shard_id: zombie.shard_id,
            fence_token: zombie.fence_token,
            batch_id: "b".into(),
            lower: zombie.cursor.clone(),
            upper: upper.encode(),
            row_count: 1,
            byte_size: 1,
            content_hash: "sha256:00".into(),
            manifest_path: "x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused_register.code(), tonic::Code::FailedPrecondition);
    // A zombie's release asking for a pause is a no-op: the shard is not its own any more.
    client
        .release_shard(release_request(
            "zombie",
            &zombie,
            "target rejects rows: a zombie's batch",
        ))
        .await
        .unwrap();
    assert_eq!(
        cluster.task_status().await.paused_reason,
        "",
        "a stale fence cannot pause the task"
    );
    assert_eq!(
        checkpoint_row(&cluster, owner.shard_id).await,
        before,
        "the checkpoint did not move"
    );

    // The current owner's commit goes through; repeating it with the old version is refused.
    let accepted = client
        .commit_batch(commit(owner.fence_token, owner.checkpoint_version))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(accepted.new_version, owner.checkpoint_version + 1);
    let (cursor, version, fence) = checkpoint_row(&cluster, owner.shard_id).await;
    assert_eq!(Cursor::decode(&cursor.to_string()).unwrap(), upper);
    assert_eq!(
        (version, fence),
        (owner.checkpoint_version as i64 + 1, owner.fence_token as i64)
    );
    let conflict = client
        .commit_batch(commit(owner.fence_token, owner.checkpoint_version))
        .await
        .unwrap_err();
    assert_eq!(conflict.code(), tonic::Code::Aborted, "{conflict:?}");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM checkpoint_history")
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();
    assert_eq!(count, 0, "empty advances leave no batch history");
}

/// A worker that stops on a target problem asks for a pause when it releases its shard
/// (`pause_reason`). The request counts only from the shard's current owner, and only if it
/// acquired the shard after the task's last resume: a batch that failed before the operator
/// fixed the target and resumed must not pause the task again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_request_counts_only_from_an_owner_that_acquired_after_the_last_resume() {
    let (cluster, mut client) = one_shard_task("pausereq", 100).await;
    let before_fix = register_and_acquire(&mut client, "before-fix")
        .await
        .expect("the shard");
    // The operator pauses, fixes the target and resumes while the owner still holds the shard.
    cluster.cli_json(&["tasks", "pause", "items", "--reason", "fixing the target"]);
    cluster.cli_json(&["tasks", "resume", "items"]);
    client
        .release_shard(release_request(
            "before-fix",
            &before_fix,
            "target rejects rows: before the fix",
        ))
        .await
        .unwrap();
    assert_eq!(
        cluster.task_status().await.paused_reason,
        "",
        "a failure from before the resume"
    );

    let after_fix = register_and_acquire(&mut client, "after-fix")
        .await
        .expect("the released shard");
    client
        .release_shard(release_request(
            "after-fix",
            &after_fix,
            "target rejects rows: after the fix",
        ))
        .await
        .unwrap();
    let reason = cluster.task_status().await.paused_reason;
    assert!(
        reason.starts_with("target rejects rows: after the fix") && reason.contains("tasks resume items"),
        "{reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_thousand_rows_in_one_millisecond_survive_a_crash_between_pages() {
    let mut cluster = Cluster::new("tie").await;
    create_items(&cluster.source, KeyKind::Bigint, 0).await;
    cluster
        .start(&TaskSettings {
            shards: 1,
            page_size: 1000,
            // No overlap re-read: the batches below must be exactly the four pages.
            overlap: "0s",
            ..TaskSettings::default()
        })
        .await;
    // Aborts right after its second committed page.
    let first = cluster.spawn_worker("first", 1, &[("TIDEMARK_CRASH_AT", "after_commit:2")]);
    cluster
        .wait_for("snapshot of the empty table", Duration::from_secs(60), |t| {
            t.snapshot_complete
        })
        .await;

    // One transaction, one now(): 4,000 rows share one millisecond.
    insert_items(&cluster.source, KeyKind::Bigint, 1, 4000, "now()").await;
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT updated_at) FROM items")
        .fetch_one(&cluster.source.pool)
        .await
        .unwrap();
    assert_eq!(distinct, 1);

    let exit = cluster.workers[first]
        .wait_exit(Duration::from_secs(60))
        .expect("the first worker crashes after page 2");
    assert!(!exit.success());
    let (cursor, _, _) = checkpoint_row(&cluster, 0).await;
    let cursor = Cursor::decode(&cursor.to_string()).unwrap();
    match &cursor.position {
        Position::Incremental {
            after_key: Some(key), ..
        } => assert_eq!(key[0].value, "2000", "two pages of 1,000 committed"),
        other => panic!("expected a mid-millisecond cursor, got {other:?}"),
    }

    cluster.spawn_worker("second", 1, &[]);
    let end = cluster.source_now_micros().await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    let diff = cluster.items_diff().await;
    diff.assert_clean("4,000 rows sharing one millisecond");
    assert_eq!(diff.keys, 4000);

    // None skipped, none read twice: four batches of 1,000 whose bounds chain.
    let counts = cluster.committed_batch_counts().await;
    assert_eq!(counts, vec![1000, 1000, 1000, 1000]);
    let ledger_rows: i64 = sqlx::query_scalar("SELECT sum(row_count)::bigint FROM tidemark_ledger")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(ledger_rows, 4000);
    assert_batch_protocol_held(&cluster).await;
}

/// What is done to the staged objects of the batch a crashed worker left behind.
#[derive(Clone, Copy, Debug)]
enum Tamper {
    None,
    FlipDataByte,
    TruncateData,
    DeleteManifest,
    DeleteData,
}

/// Where a test's staged objects are: the cluster's `file://` directory, or a prefix in a
/// bucket of a test S3 server. Paths are relative to the staging root.
enum StagedObjects<'a> {
    Dir(std::path::PathBuf),
    S3 { server: &'a S3Server, prefix: String },
}

impl StagedObjects<'_> {
    async fn read(&self, path: &str) -> Vec<u8> {
        match self {
            StagedObjects::Dir(dir) => std::fs::read(dir.join(path)).unwrap(),
            StagedObjects::S3 { server, prefix } => server.get_object(&format!("{prefix}/{path}")).await,
        }
    }

    async fn write(&self, path: &str, bytes: &[u8]) {
        match self {
            StagedObjects::Dir(dir) => std::fs::write(dir.join(path), bytes).unwrap(),
            StagedObjects::S3 { server, prefix } => server.put_object(&format!("{prefix}/{path}"), bytes).await,
        }
    }

    async fn delete(&self, path: &str) {
        match self {
            StagedObjects::Dir(dir) => std::fs::remove_file(dir.join(path)).unwrap(),
            StagedObjects::S3 { server, prefix } => server.delete_object(&format!("{prefix}/{path}")).await,
        }
    }

    async fn list(&self) -> Vec<String> {
        match self {
            StagedObjects::Dir(dir) => walk(dir).iter().map(|p| p.display().to_string()).collect(),
            StagedObjects::S3 { server, prefix } => server.keys(prefix).await,
        }
    }
}

/// A worker crashes at `point` on its second batch; the staged objects it left are tampered
/// with; the next owner must still converge, per key, without applying a torn batch. With
/// `s3`, the staging store is a prefix of that server's bucket.
async fn crash_and_tamper(tag: &str, point: &str, tamper: Tamper, s3: Option<&S3Server>) {
    let mut cluster = Cluster::new(tag).await;
    create_items(&cluster.source, KeyKind::Bigint, 3000).await;
    let (staged, staging_url, env) = match s3 {
        None => (
            StagedObjects::Dir(cluster.dir.0.join("staging")),
            String::new(),
            Vec::new(),
        ),
        Some(server) => (
            StagedObjects::S3 {
                server,
                prefix: tag.to_string(),
            },
            server.staging_url(tag),
            S3_ENV.to_vec(),
        ),
    };
    cluster
        .start(&TaskSettings {
            shards: 1,
            page_size: 1000,
            overlap: "0s",
            staging_retention: "1s",
            staging_url,
            coordinator_env: env.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            ..TaskSettings::default()
        })
        .await;
    let crash_at = format!("{point}:2");
    let mut first_env = env.clone();
    first_env.push(("TIDEMARK_CRASH_AT", crash_at.as_str()));
    let first = cluster.spawn_worker("first", 1, &first_env);
    let exit = cluster.workers[first]
        .wait_exit(Duration::from_secs(60))
        .expect("the crash point was reached");
    assert!(!exit.success(), "{tag}: killed");

    let registered: Option<String> = sqlx::query_scalar("SELECT manifest_path FROM batches WHERE state = 'STAGED'")
        .fetch_optional(&cluster.control.pool)
        .await
        .unwrap();
    if let Some(manifest_path) = &registered {
        let manifest: serde_json::Value = serde_json::from_slice(&staged.read(manifest_path).await).unwrap();
        let data_path = manifest["data_path"].as_str().unwrap();
        match tamper {
            Tamper::None => {}
            Tamper::FlipDataByte => {
                let mut bytes = staged.read(data_path).await;
                bytes[10] ^= 0x20;
                staged.write(data_path, &bytes).await;
            }
            Tamper::TruncateData => {
                let bytes = staged.read(data_path).await;
                staged.write(data_path, &bytes[..bytes.len() / 3]).await;
            }
            Tamper::DeleteManifest => staged.delete(manifest_path).await,
            Tamper::DeleteData => staged.delete(data_path).await,
        }
    }
    cluster.spawn_worker("second", 1, &env);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    cluster
        .items_diff()
        .await
        .assert_clean(&format!("{tag}: crash at {point}, {tamper:?}"));
    assert_batch_protocol_held(&cluster).await;
    // The target never received a row the source does not have at that version, and every
    // ledger entry is a committed batch.
    let ledger: Vec<String> = sqlx::query_scalar("SELECT batch_id FROM tidemark_ledger")
        .fetch_all(&cluster.target.pool)
        .await
        .unwrap();
    for batch_id in ledger {
        let state: String = sqlx::query_scalar("SELECT state FROM batches WHERE batch_id = $1")
            .bind(&batch_id)
            .fetch_one(&cluster.control.pool)
            .await
            .unwrap();
        assert_eq!(state, "COMMITTED", "{tag}: ledger batch {batch_id} is {state}");
    }
    // Every batch is committed or abandoned now, so the janitor collects every staged object,
    // torn ones included.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = staged.list().await;
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{tag}: staging objects not collected: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Files below `dir`.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return files;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torn_and_tampered_staging_never_reaches_the_target() {
    tokio::join!(
        crash_and_tamper("torn_mid", "mid_data", Tamper::None, None),
        crash_and_tamper("torn_data", "after_data", Tamper::None, None),
        crash_and_tamper("torn_flip", "after_register", Tamper::FlipDataByte, None),
        crash_and_tamper("torn_trunc", "after_register", Tamper::TruncateData, None),
        crash_and_tamper("torn_manifest", "after_register", Tamper::DeleteManifest, None),
    );
    tokio::join!(
        crash_and_tamper("torn_inapply", "in_apply", Tamper::None, None),
        crash_and_tamper("torn_applied", "after_apply", Tamper::DeleteData, None),
        crash_and_tamper("torn_commit", "after_commit", Tamper::None, None),
    );
}

/// The same crashes and tampering on S3 staging (a moto server): a torn write (a crash
/// mid-upload leaves a prefix at the final key), a flipped byte, a truncated or deleted
/// object, a deleted manifest. Every key converges, no torn batch reaches the target, and
/// the janitor's S3 listing collects every object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torn_and_tampered_s3_staging_never_reaches_the_target() {
    let s3 = S3Server::start();
    let s3 = Some(&s3);
    tokio::join!(
        crash_and_tamper("s3torn_mid", "mid_data", Tamper::None, s3),
        crash_and_tamper("s3torn_flip", "after_register", Tamper::FlipDataByte, s3),
        crash_and_tamper("s3torn_trunc", "after_register", Tamper::TruncateData, s3),
        crash_and_tamper("s3torn_manifest", "after_register", Tamper::DeleteManifest, s3),
    );
    tokio::join!(
        crash_and_tamper("s3torn_applied", "after_apply", Tamper::DeleteData, s3),
        crash_and_tamper("s3torn_commit", "after_commit", Tamper::None, s3),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_worker_and_releases_its_shards_at_once() {
    let mut cluster = Cluster::new("drain").await;
    create_items(&cluster.source, KeyKind::Bigint, 20_000).await;
    // A long lease: shards freed within it were released, not expired.
    cluster
        .start(&TaskSettings {
            shards: 4,
            lease_ttl: "60s",
            ..TaskSettings::default()
        })
        .await;
    let first = cluster.spawn_worker("first", 4, &[]);
    cluster
        .wait_for("all shards owned", Duration::from_secs(60), |t| {
            t.shards.iter().all(|s| s.owner == "first")
        })
        .await;
    cluster.workers[first].signal("TERM");
    let exit = cluster.workers[first]
        .wait_exit(Duration::from_secs(30))
        .expect("the worker exits after SIGTERM");
    assert!(exit.success(), "a drained worker exits 0: {exit}");
    let status = cluster.task_status().await;
    assert!(
        status.shards.iter().all(|s| s.owner.is_empty()),
        "released, well within the 60 s lease: {status:?}"
    );

    cluster.spawn_worker("second", 4, &[]);
    cluster
        .write_and_converge(
            "UPDATE items SET name = 'after drain', updated_at = clock_timestamp() WHERE id % 100 = 0",
            "after a drain and a new worker",
        )
        .await;
}

/// One commit group, seven commits of seven shards in one control transaction: each is
/// checked against its own shard and answered on its own, exactly as alone. The valid
/// ones move their checkpoint (with history, late rows, and the other staged batch of the
/// same position abandoned); the fenced one, the stale version, the unregistered batch and
/// the unknown shard change nothing. The same group again is answered as retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_group_answers_each_commit_on_its_own() {
    use tidemark_coordinator::checkpoints::{CommitBatch, ControlDb, ShardKey};
    use tidemark_coordinator::error::CoordinatorError;

    let (cluster, mut client) = sharded_task("group", 600, 6).await;
    let mut owned = Vec::new();
    for n in 0..6 {
        let assignment = register_and_acquire(&mut client, &format!("w{n}"))
            .await
            .expect("a free shard");
        owned.push(assignment);
    }
    owned.sort_by_key(|a| a.shard_id);
    let [a, b, c, d, e, f] = &owned[..] else {
        panic!("six shards")
    };
    let upper_of = |assignment: &pb::ShardAssignment, key: i64| after_key(assignment.epoch, key);
    let register = |assignment: &pb::ShardAssignment, batch_id: &str, upper: &Cursor| pb::RegisterBatchRequest {
        worker_id: format!("w{}", assignment.shard_id),
        task: "items".into(),
        epoch: assignment.epoch,
        shard_id: assignment.shard_id,
        fence_token: assignment.fence_token,
        batch_id: batch_id.into(),
        lower: assignment.cursor.clone(),
        upper: upper.encode(),
        row_count: 10,
        byte_size: 100,
        content_hash: format!("sha256:{batch_id}"),
        manifest_path: format!("{batch_id}.manifest"),
    };
    let (a_upper, e_upper, f_upper) = (upper_of(a, 10), upper_of(e, 20), upper_of(f, 30));
    for request in [
        register(a, "a-1", &a_upper),
        register(f, "f-1", &f_upper),
        // Read from the same position as f-1: it can never commit once f-1 has.
        register(f, "f-2", &upper_of(f, 31)),
    ] {
        client.register_batch(request).await.unwrap();
    }
    let commit = |assignment: &pb::ShardAssignment, batch_id: &str, upper: &Cursor, empty: bool| CommitBatch {
        shard: ShardKey {
            task: "items".into(),
            epoch: assignment.epoch,
            shard_id: assignment.shard_id,
        },
        fence: assignment.fence_token,
        expected_version: assignment.checkpoint_version,
        batch_id: batch_id.into(),
        lower: Cursor::decode(&assignment.cursor).unwrap(),
        upper: upper.clone(),
        row_count: if empty { 0 } else { 10 },
        empty,
        replayed: false,
        late_row_lateness_micros: Vec::new(),
    };
    let mut fenced = commit(b, "b-1", &upper_of(b, 1), true);
    fenced.fence += 1;
    let mut stale = commit(c, "c-1", &upper_of(c, 1), true);
    stale.expected_version += 5;
    let mut unknown = commit(a, "x-1", &upper_of(a, 1), true);
    unknown.shard.shard_id = 99;
    let mut with_late_rows = commit(f, "f-1", &f_upper, false);
    with_late_rows.late_row_lateness_micros = vec![5_000, 7_000];
    let group = vec![
        commit(a, "a-1", &a_upper, false),
        fenced,
        stale,
        commit(d, "d-never-registered", &upper_of(d, 1), false),
        commit(e, "e-empty", &e_upper, true),
        with_late_rows,
        unknown,
    ];
    let before: Vec<_> = checkpoint_rows(&cluster, &owned).await;
    let control = ControlDb::connect(&cluster.control.url, None).await.unwrap();
    // A reconciliation waits for every shard: each commit that moves its shard answers with
    // it (the owner need not poll), a repeated one with nothing.
    let run = control
        .start_reconcile(
            "items",
            "test",
            Some(5),
            tidemark_common::config::ReconcileCompare::Versions,
        )
        .await
        .unwrap();
    let outcomes = control.commit_batches(&group).await.expect("the group's transaction");
    assert_eq!(outcomes.len(), 7);
    let ok = |i: usize| match &outcomes[i] {
        Ok(committed) => committed.clone(),
        Err(error) => panic!("commit {i} refused: {error}"),
    };
    assert_eq!((ok(0).new_version, ok(0).repeated), (a.checkpoint_version + 1, false));
    assert!(
        matches!(&outcomes[1], Err(CoordinatorError::Fenced { current, given, .. }) if *current == b.fence_token && *given == b.fence_token + 1),
        "{:?}",
        outcomes[1]
    );
    assert!(
        matches!(&outcomes[2], Err(CoordinatorError::CheckpointConflict { message, .. }) if message.contains("expected version")),
        "{:?}",
        outcomes[2]
    );
    assert!(
        matches!(&outcomes[3], Err(CoordinatorError::Batch { batch_id, .. }) if batch_id == "d-never-registered"),
        "{:?}",
        outcomes[3]
    );
    assert_eq!(ok(4).new_version, e.checkpoint_version + 1);
    assert_eq!(ok(5).new_version, f.checkpoint_version + 1);
    for i in [0, 4, 5] {
        let work = ok(i).work.expect("a moved shard's work");
        assert!(!work.release, "commit {i}");
        let order = work.reconcile.expect("the pending reconciliation");
        assert_eq!(
            (order.run_id, order.since_micros, order.versions_only),
            (run, Some(5), true),
            "commit {i}"
        );
    }
    assert!(
        matches!(&outcomes[6], Err(CoordinatorError::InvalidRequest(message)) if message.contains("no shard 99")),
        "{:?}",
        outcomes[6]
    );

    // Per shard: the cursor and version moved exactly for a, e and f.
    let after = checkpoint_rows(&cluster, &owned).await;
    for (i, assignment) in owned.iter().enumerate() {
        let (cursor, version, fence) = &after[i];
        let moved_to = match assignment.shard_id {
            id if id == a.shard_id => Some(&a_upper),
            id if id == e.shard_id => Some(&e_upper),
            id if id == f.shard_id => Some(&f_upper),
            _ => None,
        };
        match moved_to {
            Some(upper) => {
                assert_eq!(
                    &Cursor::decode(&cursor.to_string()).unwrap(),
                    upper,
                    "shard {}",
                    assignment.shard_id
                );
                assert_eq!(*version, before[i].1 + 1, "shard {}", assignment.shard_id);
            }
            None => assert_eq!(&after[i], &before[i], "shard {} must not move", assignment.shard_id),
        }
        assert_eq!(*fence, assignment.fence_token as i64);
    }
    let states: Vec<(String, String)> = sqlx::query_as("SELECT batch_id, state FROM batches ORDER BY batch_id")
        .fetch_all(&cluster.control.pool)
        .await
        .unwrap();
    assert_eq!(
        states,
        vec![
            ("a-1".to_string(), "COMMITTED".to_string()),
            ("f-1".to_string(), "COMMITTED".to_string()),
            ("f-2".to_string(), "ABANDONED".to_string()),
        ]
    );
    let history: Vec<(i32, i64, String, i64)> =
        sqlx::query_as("SELECT shard_id, version, batch_id, row_count FROM checkpoint_history ORDER BY shard_id")
            .fetch_all(&cluster.control.pool)
            .await
            .unwrap();
    assert_eq!(
        history,
        vec![
            (
                a.shard_id as i32,
                a.checkpoint_version as i64 + 1,
                "a-1".to_string(),
                10
            ),
            (
                f.shard_id as i32,
                f.checkpoint_version as i64 + 1,
                "f-1".to_string(),
                10
            ),
        ],
        "one history row per commit with rows, none for the empty advance"
    );
    let late: Vec<(i32, String, i64)> =
        sqlx::query_as("SELECT shard_id, batch_id, lateness_micros FROM late_rows ORDER BY lateness_micros")
            .fetch_all(&cluster.control.pool)
            .await
            .unwrap();
    assert_eq!(
        late,
        vec![
            (f.shard_id as i32, "f-1".to_string(), 5_000),
            (f.shard_id as i32, "f-1".to_string(), 7_000)
        ]
    );

    // The same group again, as if every reply had been lost: the commits with rows are
    // recognised as retries, the empty advance's version moved on, nothing changes.
    let again = control.commit_batches(&group).await.expect("the group's transaction");
    for i in [0, 5] {
        let committed = again[i].as_ref().expect("a retry of a commit that succeeded");
        assert!(committed.repeated, "commit {i}");
        assert_eq!(committed.new_version, ok(i).new_version);
        assert!(
            committed.work.is_none(),
            "a repeated commit leaves the poll to the owner"
        );
    }
    assert!(
        matches!(&again[4], Err(CoordinatorError::CheckpointConflict { .. })),
        "{:?}",
        again[4]
    );
    assert_eq!(
        checkpoint_rows(&cluster, &owned).await,
        after,
        "a repeated group changes nothing"
    );
}

/// One registration group, six registrations of six shards in one statement, and one
/// shard-work poll group: each is checked against its own shard and answered on its own,
/// exactly as alone. Only the valid new batch is stored; the same id and content again is
/// the same batch; the fenced one, the wrong lower bound, other content under a known id and
/// the unknown shard are refused by name and store nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_group_answers_each_registration_on_its_own() {
    use tidemark_coordinator::checkpoints::{ControlDb, RegisterBatch, ShardKey};
    use tidemark_coordinator::error::CoordinatorError;

    let (cluster, mut client) = sharded_task("reggroup", 600, 5).await;
    let mut owned = Vec::new();
    for n in 0..5 {
        owned.push(
            register_and_acquire(&mut client, &format!("w{n}"))
                .await
                .expect("a free shard"),
        );
    }
    owned.sort_by_key(|a| a.shard_id);
    let [a, b, c, d, e] = &owned[..] else {
        panic!("five shards")
    };
    let shard = |assignment: &pb::ShardAssignment| ShardKey {
        task: "items".into(),
        epoch: assignment.epoch,
        shard_id: assignment.shard_id,
    };
    let register = |assignment: &pb::ShardAssignment, batch_id: &str, hash: &str| RegisterBatch {
        shard: shard(assignment),
        fence: assignment.fence_token,
        batch_id: batch_id.into(),
        lower: Cursor::decode(&assignment.cursor).unwrap(),
        upper: after_key(assignment.epoch, 10 + assignment.shard_id as i64),
        row_count: 10,
        byte_size: 100,
        content_hash: hash.into(),
        manifest_path: format!("{batch_id}.manifest"),
    };
    let control = ControlDb::connect(&cluster.control.url, None).await.unwrap();
    // Registered before, alone.
    let before = control
        .register_batches(&[register(d, "d-1", "sha256:d"), register(e, "e-1", "sha256:e")])
        .await
        .expect("the statement");
    assert!(before.iter().all(Result::is_ok), "{before:?}");

    let mut fenced = register(b, "b-1", "sha256:b");
    fenced.fence += 1;
    let mut wrong_lower = register(c, "c-1", "sha256:c");
    wrong_lower.lower = after_key(c.epoch, 1);
    let mut unknown = register(a, "x-1", "sha256:x");
    unknown.shard.shard_id = 99;
    let group = vec![
        register(a, "a-1", "sha256:a"),
        fenced,
        wrong_lower,
        register(d, "d-1", "sha256:d"),
        register(e, "e-1", "sha256:other"),
        unknown,
    ];
    let answers = control.register_batches(&group).await.expect("the statement");
    assert_eq!(answers.len(), 6);
    assert!(answers[0].is_ok(), "{:?}", answers[0]);
    assert!(
        matches!(&answers[1], Err(CoordinatorError::Fenced { current, given, .. }) if *current == b.fence_token && *given == b.fence_token + 1),
        "{:?}",
        answers[1]
    );
    assert!(
        matches!(&answers[2], Err(CoordinatorError::CheckpointConflict { message, .. }) if message.contains("is not the committed cursor")),
        "{:?}",
        answers[2]
    );
    assert!(
        answers[3].is_ok(),
        "the same id and content is the same batch: {:?}",
        answers[3]
    );
    assert!(
        matches!(&answers[4], Err(CoordinatorError::Batch { batch_id, message }) if batch_id == "e-1" && message.contains("sha256:e")),
        "{:?}",
        answers[4]
    );
    assert!(
        matches!(&answers[5], Err(CoordinatorError::InvalidRequest(message)) if message.contains("no shard 99")),
        "{:?}",
        answers[5]
    );
    let stored: Vec<(String, i32, String, String)> =
        sqlx::query_as("SELECT batch_id, shard_id, content_hash, state FROM batches ORDER BY batch_id")
            .fetch_all(&cluster.control.pool)
            .await
            .unwrap();
    let staged = |assignment: &pb::ShardAssignment, id: &str, hash: &str| {
        (
            id.to_string(),
            assignment.shard_id as i32,
            hash.to_string(),
            "STAGED".to_string(),
        )
    };
    assert_eq!(
        stored,
        vec![
            staged(a, "a-1", "sha256:a"),
            staged(d, "d-1", "sha256:d"),
            staged(e, "e-1", "sha256:e"),
        ]
    );

    // Shard-work polls, grouped: the shard asked to move gives itself up, the others have
    // nothing to do, and a shard that is not there neither.
    sqlx::query("UPDATE checkpoints SET release_requested = true WHERE shard_id = $1")
        .bind(c.shard_id as i32)
        .execute(&cluster.control.pool)
        .await
        .unwrap();
    let mut polled: Vec<ShardKey> = owned.iter().map(shard).collect();
    polled.push(ShardKey {
        shard_id: 99,
        ..shard(a)
    });
    let works = control.shard_works(&polled).await.expect("the query");
    let released: Vec<u32> = polled
        .iter()
        .zip(&works)
        .filter(|(_, work)| work.release)
        .map(|(shard, _)| shard.shard_id)
        .collect();
    assert_eq!(released, vec![c.shard_id]);
    assert!(works.iter().all(|w| w.reconcile.is_none()), "{works:?}");
}

/// Each shard's (cursor, version, fence), in the order of `owned`.
async fn checkpoint_rows(cluster: &Cluster, owned: &[pb::ShardAssignment]) -> Vec<(serde_json::Value, i64, i64)> {
    let mut rows = Vec::new();
    for assignment in owned {
        rows.push(checkpoint_row(cluster, assignment.shard_id).await);
    }
    rows
}

/// A registration is one statement now (issue 20); its answers are those of the checks:
/// the same id and content again is the same batch, other content under the id is refused,
/// a lower bound that is not the committed cursor is a conflict, and nothing of a refused
/// registration is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_again_is_the_same_batch_and_other_content_is_refused() {
    let (cluster, mut client) = one_shard_task("register", 100).await;
    let owner = register_and_acquire(&mut client, "owner").await.expect("a free shard");
    let upper = after_key(owner.epoch, 50);
    let register = |batch_id: &str, hash: &str, lower: &str| pb::RegisterBatchRequest {
        worker_id: "owner".into(),
        task: "items".into(),
        epoch: owner.epoch,
        shard_id: owner.shard_id,
        fence_token: owner.fence_token,
        batch_id: batch_id.into(),
        lower: lower.into(),
        upper: upper.encode(),
        row_count: 50,
        byte_size: 500,
        content_hash: hash.into(),
        manifest_path: format!("{batch_id}.manifest"),
    };
    let batches = || async {
        sqlx::query_as::<_, (String, String, String)>("SELECT batch_id, content_hash, state FROM batches ORDER BY 1")
            .fetch_all(&cluster.control.pool)
            .await
            .unwrap()
    };
    client
        .register_batch(register("b1", "sha256:aa", &owner.cursor))
        .await
        .unwrap();
    client
        .register_batch(register("b1", "sha256:aa", &owner.cursor))
        .await
        .expect("the same batch again (a retry whose answer was lost)");
    let other = client
        .register_batch(register("b1", "sha256:bb", &owner.cursor))
        .await
        .unwrap_err();
    assert_eq!(other.code(), tonic::Code::Aborted, "{other:?}");
    assert!(
        other
            .message()
            .contains("already registered (STAGED) with content sha256:aa"),
        "{}",
        other.message()
    );
    let conflict = client
        .register_batch(register("b2", "sha256:cc", &upper.encode()))
        .await
        .unwrap_err();
    assert_eq!(conflict.code(), tonic::Code::Aborted, "{conflict:?}");
    assert!(
        conflict.message().contains("is not the committed cursor"),
        "{}",
        conflict.message()
    );
    let mut stale = register("b3", "sha256:dd", &owner.cursor);
    stale.fence_token += 1;
    let fenced = client.register_batch(stale).await.unwrap_err();
    assert_eq!(fenced.code(), tonic::Code::FailedPrecondition, "{fenced:?}");
    let mut unknown = register("b4", "sha256:ee", &owner.cursor);
    unknown.shard_id = 99;
    let missing = client.register_batch(unknown).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::InvalidArgument, "{missing:?}");
    assert_eq!(
        batches().await,
        vec![("b1".to_string(), "sha256:aa".to_string(), "STAGED".to_string())],
        "only the accepted registration is stored, once, with its first content"
    );
}

/// A coordinator starting while a worker's apply transaction is open on the target (a
/// frozen worker holds it until its lease and connection go) must not wait on its locks.
/// The target migration's `ALTER TABLE tidemark_ledger ADD COLUMN IF NOT EXISTS` took
/// ACCESS EXCLUSIVE even when the column existed, so it queued behind that transaction,
/// and every other worker's apply queued behind it (the chaos test's coordinator restart
/// once hung 60 s on it). The migration now alters only a ledger that lacks the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_starts_while_a_target_transaction_holds_the_ledger() {
    let mut cluster = Cluster::new("ledger_lock").await;
    create_items(&cluster.source, KeyKind::Bigint, 100).await;
    let settings = TaskSettings {
        shards: 1,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    let mut apply = cluster.target.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO tidemark_ledger (batch_id, task, epoch, shard_id, row_count, content_hash, fence) \
         VALUES ('held-open', 'items', 1, 0, 0, 'x', 1)",
    )
    .execute(&mut *apply)
    .await
    .unwrap();
    let restarted = tokio::time::timeout(Duration::from_secs(20), cluster.start(&settings)).await;
    apply.rollback().await.unwrap();
    assert!(
        restarted.is_ok(),
        "the coordinator's start waited on a target transaction's lock on tidemark_ledger"
    );
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM tidemark_ledger WHERE batch_id = 'held-open'")
        .fetch_one(&cluster.target.pool)
        .await
        .unwrap();
    assert_eq!(held, 0, "the held transaction rolled back");
}

/// The claims of one acquire burst are recorded in one statement (issue 20); each is answered
/// on its own: a larger fence records its owner and brings the shard's pending batch and its
/// epoch, a fence that does not increase and an unknown shard change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_group_answers_each_claim_on_its_own() {
    use tidemark_coordinator::checkpoints::{Claim, ControlDb, ShardKey};

    let (cluster, mut client) = sharded_task("claims", 300, 3).await;
    let a = register_and_acquire(&mut client, "w-a").await.expect("a free shard");
    let upper = after_key(a.epoch, 10);
    client
        .register_batch(pb::RegisterBatchRequest {
            worker_id: "w-a".into(),
            task: "items".into(),
            epoch: a.epoch,
            shard_id: a.shard_id,
            fence_token: a.fence_token,
            batch_id: "a-1".into(),
            lower: a.cursor.clone(),
            upper: upper.encode(),
            row_count: 10,
            byte_size: 100,
            content_hash: "sha256:a-1".into(),
            manifest_path: "a-1.manifest".into(),
        })
        .await
        .unwrap();
    let (b, c) = match a.shard_id {
        0 => (1, 2),
        1 => (0, 2),
        _ => (0, 1),
    };
    let (_, _, b_fence) = checkpoint_row(&cluster, b).await;
    let (_, _, c_fence) = checkpoint_row(&cluster, c).await;
    let claim = |shard_id: u32, fence: u64, owner: &str| Claim {
        shard: ShardKey {
            task: "items".into(),
            epoch: a.epoch,
            shard_id,
        },
        fence,
        owner: owner.into(),
    };
    let group = vec![
        claim(c, c_fence as u64 + 7, "w-c"),
        claim(99, 1_000_000, "w-x"),
        claim(a.shard_id, a.fence_token + 1_000, "w-a2"),
        claim(b, b_fence as u64, "w-b"),
    ];
    let before_b = checkpoint_row(&cluster, b).await;
    let control = ControlDb::connect(&cluster.control.url, None).await.unwrap();
    let answers = control.claim_shards(&group).await.expect("the group's statement");
    assert_eq!(answers.len(), 4);

    let claimed_c = answers[0].as_ref().expect("c claimed");
    assert_eq!(claimed_c.record.key.shard_id, c);
    assert_eq!(claimed_c.record.fence, c_fence as u64 + 7);
    assert!(claimed_c.pending.is_none());
    assert_eq!(claimed_c.epoch.as_ref().map(|e| e.epoch), Some(a.epoch));

    assert!(answers[1].is_none(), "an unknown shard is not claimed");

    let claimed_a = answers[2].as_ref().expect("a claimed again");
    assert_eq!(claimed_a.record.fence, a.fence_token + 1_000);
    assert_eq!(claimed_a.record.cursor.encode(), a.cursor);
    assert_eq!(claimed_a.record.version, a.checkpoint_version);
    let pending = claimed_a.pending.as_ref().expect("a-1 is pending");
    assert_eq!(
        (pending.batch_id.as_str(), pending.upper.encode(), pending.row_count),
        ("a-1", upper.encode(), 10)
    );
    assert_eq!(pending.lower.encode(), a.cursor);

    assert!(answers[3].is_none(), "a fence that does not increase claims nothing");
    assert_eq!(checkpoint_row(&cluster, b).await, before_b);

    let owners: Vec<(i32, Option<String>, i64)> =
        sqlx::query_as("SELECT shard_id, owner, fence FROM checkpoints ORDER BY shard_id")
            .fetch_all(&cluster.control.pool)
            .await
            .unwrap();
    let owner_of = |shard_id: u32| owners.iter().find(|o| o.0 == shard_id as i32).cloned().unwrap();
    assert_eq!(owner_of(c), (c as i32, Some("w-c".into()), c_fence + 7));
    assert_eq!(
        owner_of(a.shard_id),
        (a.shard_id as i32, Some("w-a2".into()), (a.fence_token + 1_000) as i64)
    );
}

/// One acquire claims several shards (one etcd transaction, one grouped control write), at
/// most what the worker asks for and its share of the shards waiting: those waiting divided
/// by the workers the leader heard from, rounded up. A worker that asks for none by number
/// (one that predates the field) gets one. Each shard is claimed once, and the control
/// database records each claim's owner and fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_acquire_claims_up_to_the_workers_share() {
    let (cluster, mut client) = sharded_task("many", 800, 8).await;
    let mut leases = std::collections::HashMap::new();
    for worker in ["w-a", "w-b"] {
        leases.insert(worker, register(&mut client, worker).await.lease_id);
    }
    let mut take = async |worker: &'static str, max_shards: u32| {
        acquire(&mut client, worker, leases[worker], max_shards).await.unwrap()
    };
    let a = take("w-a", 8).await;
    assert_eq!(a.len(), 4, "8 waiting, 2 workers: a share of 4");
    let b = take("w-b", 2).await;
    assert_eq!(b.len(), 2, "asked for 2");
    let old = take("w-b", 0).await;
    assert_eq!(old.len(), 1, "a worker that names no number gets one");
    let last = take("w-a", 8).await;
    assert_eq!(last.len(), 1, "one left");
    assert!(take("w-a", 8).await.is_empty(), "none left");

    let mut held: Vec<(&str, &pb::ShardAssignment)> = Vec::new();
    held.extend(a.iter().chain(&last).map(|s| ("w-a", s)));
    held.extend(b.iter().chain(&old).map(|s| ("w-b", s)));
    let mut ids: Vec<u32> = held.iter().map(|(_, s)| s.shard_id).collect();
    ids.sort();
    assert_eq!(ids, (0..8).collect::<Vec<u32>>(), "each shard claimed once");
    for (worker, assignment) in held {
        let (owner, fence) = owner_and_fence(&cluster, assignment.shard_id).await;
        assert_eq!(
            (owner.as_deref(), fence),
            (Some(worker), assignment.fence_token as i64),
            "shard {}",
            assignment.shard_id
        );
        assert!(assignment.fence_token > 0 && assignment.task.is_some());
    }
}

/// An acquire under an expired lease is refused by name (the claim itself checks the lease,
/// in etcd), and the shards it took from the claim queue go to the next worker at once, not
/// at the queue's correcting read a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_under_an_expired_lease_is_refused_and_claims_nothing() {
    let (cluster, mut client) = sharded_task("expired", 200, 2).await;
    let gone = register(&mut client, "w-gone").await;
    // Never kept alive: expired one TTL later (etcd checks expiry every 500 ms).
    tokio::time::sleep(Duration::from_millis(gone.lease_ttl_ms + 1_500)).await;
    let refused = acquire(&mut client, "w-gone", gone.lease_id, 2)
        .await
        .expect_err("an expired lease claims nothing");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("lease"), "{refused:?}");

    let live = register(&mut client, "w-live").await;
    let started = std::time::Instant::now();
    let taken = acquire(&mut client, "w-live", live.lease_id, 2).await.unwrap();
    assert_eq!(taken.len(), 2, "both shards, in the first acquire after the refusal");
    assert!(started.elapsed() < Duration::from_secs(5));
    for assignment in &taken {
        let (owner, fence) = owner_and_fence(&cluster, assignment.shard_id).await;
        assert_eq!(
            (owner.as_deref(), fence),
            (Some("w-live"), assignment.fence_token as i64)
        );
    }
}
