//! Staging on an S3-compatible store (issue 18): a real `moto_server` per test, which
//! honours create-only writes (`If-None-Match: *`) like AWS S3. Boundary: everything
//! committed in the source before the watermark; delete policy: none.

use std::time::Duration;

use tidemark_tests::s3::{S3_ENV, S3Server};
use tidemark_tests::{Cluster, KeyKind, TaskSettings, create_items, write_changes};

fn s3_env() -> Vec<(&'static str, String)> {
    S3_ENV.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

/// Snapshot then incremental through S3 staging, two workers: every key converges, and the
/// batches are objects in the bucket (a data object and a manifest each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_converges_with_s3_staging() {
    let s3 = S3Server::start();
    let mut cluster = Cluster::new("s3sync").await;
    create_items(&cluster.source, KeyKind::Bigint, 40_000).await;
    let settings = TaskSettings {
        shards: 4,
        staging_url: s3.staging_url("tidemark/staging"),
        coordinator_env: s3_env(),
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    for i in 0..2 {
        cluster.spawn_worker(&format!("s3sync-w{i}"), 4, &S3_ENV);
    }
    cluster
        .wait_for("snapshot complete", Duration::from_secs(120), |t| t.snapshot_complete)
        .await;
    cluster.items_diff().await.assert_clean("after the snapshot through S3");
    let end = write_changes(&cluster.source, KeyKind::Bigint, 40_000, 8).await;
    cluster.wait_for_watermark(end, Duration::from_secs(120)).await;
    let diff = cluster.items_diff().await;
    diff.assert_clean("after the changes through S3");
    assert_eq!(diff.keys, 42_000);
    let keys = s3.keys("tidemark/staging").await;
    let manifests = keys.iter().filter(|k| k.contains("/manifest-")).count();
    let data = keys.iter().filter(|k| k.contains("/data-")).count();
    assert!(
        manifests > 0 && data >= manifests / 2,
        "staged in the bucket: {manifests} manifests, {data} data objects"
    );
    assert!(
        !keys.iter().any(|k| k.contains("_tidemark/probe-")),
        "the start probe cleans up: {keys:?}"
    );
}

/// A staging store that cannot work is a named error when the coordinator starts, not a
/// hang or a failure on the first batch: an endpoint nobody answers on, a bucket that does
/// not exist, and credentials put in the URL (which travels to every worker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misconfigured_s3_store_is_refused_at_start() {
    let s3 = S3Server::start();
    let mut cluster = Cluster::new("s3bad").await;
    create_items(&cluster.source, KeyKind::Bigint, 100).await;
    let closed = tidemark_tests::free_port();
    let cases = [
        (
            format!(
                "s3://{}/p?endpoint=http://127.0.0.1:{closed}&allow_http=true&virtual_hosted_style_request=false",
                s3.bucket
            ),
            "error sending request",
        ),
        (
            format!(
                "s3://no-such-bucket-{closed}/p?endpoint={}&allow_http=true&virtual_hosted_style_request=false",
                s3.endpoint
            ),
            "404 Not Found",
        ),
        (
            format!("{}&access_key_id=AKIA", s3.staging_url("p")),
            "access_key_id must not be in the staging URL",
        ),
    ];
    // SeaweedFS creates a bucket on its first write, so there a missing bucket is no error.
    let seaweedfs = std::env::var("TIDEMARK_TEST_S3").is_ok_and(|b| b == "seaweedfs");
    for (url, expected) in cases {
        if seaweedfs && expected == "404 Not Found" {
            continue;
        }
        let settings = TaskSettings {
            staging_url: url.clone(),
            coordinator_env: s3_env(),
            ..TaskSettings::default()
        };
        let started = std::time::Instant::now();
        let log = cluster.refused_start(&settings);
        assert!(log.contains(expected), "{url}: the refusal names {expected:?}: {log}");
        assert!(
            started.elapsed() < Duration::from_secs(45),
            "{url}: refused within the probe's timeout"
        );
    }
}

/// Create-only writes on S3: the same manifest path written again with other bytes (another
/// owner's, a zombie's) is refused and leaves the first manifest as it was; the same bytes
/// again (a retried PUT) are success. The staging code itself, against a real server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_never_replaces_a_staged_manifest_on_s3() {
    use tidemark_common::batch::{Manifest, content_hash};
    use tidemark_common::staging::{Staging, StagingError};
    let s3 = S3Server::start();
    let staging = Staging::from_store(std::sync::Arc::new(s3.store()), "create-only");
    staging.probe(Duration::from_secs(30)).await.unwrap();
    let data = bytes::Bytes::from_static(b"1\tone\n2\ttwo\n");
    let mut first = Manifest {
        format_version: tidemark_common::batch::MANIFEST_FORMAT_VERSION,
        batch_id: "b1".into(),
        task: "items".into(),
        epoch: 1,
        shard_id: 0,
        lower: "{}".into(),
        upper: "{}".into(),
        row_count: 2,
        byte_size: data.len() as u64,
        content_hash: content_hash(&data),
        schema_id: "schema2-x".into(),
        fence_token: 7,
        data_path: String::new(),
        data_format: "pg_copy_text".into(),
        repair: false,
        target_layout: false,
    };
    let mut again = first.clone();
    let path = staging.write_batch(&mut first, data.clone()).await.unwrap();
    assert_eq!(
        staging.write_batch(&mut again, data.clone()).await.unwrap(),
        path,
        "the same bytes: success"
    );
    let mut other = Manifest {
        row_count: 3,
        ..again.clone()
    };
    match staging.write_batch(&mut other, data.clone()).await {
        Err(StagingError::Conflict { path: refused }) => assert_eq!(refused, path),
        result => panic!("a different manifest at {path} must be refused: {result:?}"),
    }
    let (kept, read) = staging.read_batch(&path).await.unwrap();
    assert_eq!(
        (kept.row_count, read),
        (2, data),
        "the first manifest and its data stay"
    );
}
