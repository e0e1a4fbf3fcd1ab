//! The lease interface's rules, one suite run against both stores: etcd (a real etcd process)
//! and the coordinator's in-process leases (`tidemark sync`). A shard is claimed only when
//! free (one at a time or several in one call); every claim's fence token is larger than every
//! earlier claim's; a release takes effect only under the fence it was claimed with; a lease
//! that is not kept alive expires within its TTL and frees what it owned, while one kept alive
//! keeps it; and every ownership that ends, by release or expiry, is reported by the freed feed
//! (`watch_freed`), and no other. A claim under an expired lease is refused by name.

use std::time::Duration;

use tidemark_coordinator::checkpoints::ShardKey;
use tidemark_coordinator::error::CoordinatorError;
use tidemark_coordinator::leases::{Freed, Leases};
use tidemark_tests::Etcd;

const TTL: Duration = Duration::from_secs(2);

fn shard(id: u32) -> ShardKey {
    ShardKey {
        task: "items".into(),
        epoch: 1,
        shard_id: id,
    }
}

/// What the feed reports within `within`, waiting no longer once every `expected` shard came.
async fn freed_within(feed: &mut Freed, expected: &[ShardKey], within: Duration) -> Vec<ShardKey> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while !expected.iter().all(|shard| seen.contains(shard)) {
        match tokio::time::timeout_at(deadline, feed.next()).await {
            Ok(shards) => seen.extend(shards.unwrap()),
            Err(_) => break,
        }
    }
    seen
}

async fn lease_rules(leases: Leases, fence_floor: u64) {
    let mut freed = leases.watch_freed().await.unwrap();
    let a = leases.grant_worker_lease().await.unwrap();
    let b = leases.grant_worker_lease().await.unwrap();
    assert_ne!(a, b);
    assert!(leases.lease_alive(a).await.unwrap());

    let first = leases
        .try_claim(&shard(0), "a", a)
        .await
        .unwrap()
        .expect("a free shard");
    assert!(first > fence_floor, "fence {first} not above {fence_floor}");
    assert_eq!(leases.try_claim(&shard(0), "b", b).await.unwrap(), None, "a held shard");
    let other = leases
        .try_claim(&shard(1), "b", b)
        .await
        .unwrap()
        .expect("another free shard");
    assert!(other > first);
    let owners = leases.owners().await.unwrap();
    assert_eq!(owners.get(&shard(0)), Some(&("a".to_string(), first)));
    assert_eq!(owners.get(&shard(1)), Some(&("b".to_string(), other)));

    // A stale fence releases nothing; the right one frees the shard for the next claim.
    leases.release(&shard(0), first + 1000).await.unwrap();
    assert!(leases.owners().await.unwrap().contains_key(&shard(0)));
    leases.release(&shard(0), first).await.unwrap();
    assert!(!leases.owners().await.unwrap().contains_key(&shard(0)));
    let released = freed_within(&mut freed, &[shard(0)], TTL).await;
    assert_eq!(released, vec![shard(0)], "the feed after one release (and a stale one)");
    let second = leases.try_claim(&shard(0), "b", b).await.unwrap().expect("freed");
    assert!(second > other);

    // Several in one call: each free one is claimed, a held one is not, and does not stop
    // the others.
    let many = leases
        .try_claim_many(&[shard(3), shard(1), shard(4)], "a", a)
        .await
        .unwrap();
    assert_eq!(many[1], None, "shard 1 is b's: {many:?}");
    let (Some(on_3), Some(on_4)) = (many[0], many[2]) else {
        panic!("free shards not claimed: {many:?}");
    };
    assert!(on_3 > second && on_4 > second, "{many:?} not above {second}");
    let owners = leases.owners().await.unwrap();
    assert_eq!(owners.get(&shard(1)), Some(&("b".to_string(), other)));
    assert_eq!(owners.get(&shard(3)), Some(&("a".to_string(), on_3)));
    assert_eq!(owners.get(&shard(4)), Some(&("a".to_string(), on_4)));
    assert_eq!(
        leases.try_claim_many(&[shard(3), shard(4)], "b", b).await.unwrap(),
        vec![None, None],
        "held by a"
    );
    leases.release(&shard(3), on_3).await.unwrap();
    leases.release(&shard(4), on_4).await.unwrap();
    let released = freed_within(&mut freed, &[shard(3), shard(4)], TTL).await;
    assert!(
        released.contains(&shard(3)) && released.contains(&shard(4)),
        "{released:?}"
    );

    // `a` is kept alive, `b` is not: b's lease expires and takes its shards with it. `c` was
    // kept alive once (etcd: its keep-alive stream stays open) and then left to expire.
    let claimed_by_a = leases.try_claim(&shard(2), "a", a).await.unwrap().expect("free");
    let c = leases.grant_worker_lease().await.unwrap();
    assert!(leases.keep_alive(c).await.unwrap(), "c kept alive once");
    let deadline = std::time::Instant::now() + TTL * 3;
    while std::time::Instant::now() < deadline {
        assert!(leases.keep_alive(a).await.unwrap(), "a kept alive");
        tokio::time::sleep(TTL / 4).await;
    }
    assert!(!leases.lease_alive(b).await.unwrap(), "b's lease outlived its TTL");
    assert!(!leases.keep_alive(b).await.unwrap(), "an expired lease came back");
    assert!(!leases.lease_alive(c).await.unwrap(), "c's lease outlived its TTL");
    assert!(
        !leases.keep_alive(c).await.unwrap(),
        "an expired lease came back on its open stream"
    );
    assert!(
        !leases.keep_alive(c).await.unwrap(),
        "an expired lease came back on a new stream"
    );
    let owners = leases.owners().await.unwrap();
    assert!(
        !owners.contains_key(&shard(0)) && !owners.contains_key(&shard(1)),
        "{owners:?}"
    );
    assert_eq!(owners.get(&shard(2)), Some(&("a".to_string(), claimed_by_a)));
    let mut expired = freed_within(&mut freed, &[shard(0), shard(1)], TTL).await;
    expired.sort_by_key(|shard| shard.shard_id);
    assert_eq!(expired, vec![shard(0), shard(1)], "the feed after b's lease expired");
    // A claim under an expired lease is refused by name, and claims nothing.
    for claim in [vec![shard(5)], vec![shard(5), shard(6)]] {
        let refused = leases.try_claim_many(&claim, "b", b).await;
        assert!(
            matches!(refused, Err(CoordinatorError::LeaseExpired { lease_id }) if lease_id == b),
            "{refused:?}"
        );
    }
    let owners = leases.owners().await.unwrap();
    assert!(
        !owners.contains_key(&shard(5)) && !owners.contains_key(&shard(6)),
        "{owners:?}"
    );
    let third = leases
        .try_claim(&shard(0), "a", a)
        .await
        .unwrap()
        .expect("freed by expiry");
    assert!(third > claimed_by_a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_leases_keep_the_rules() {
    let etcd = Etcd::start();
    let leases = Leases::connect(std::slice::from_ref(&etcd.endpoint), "/lease-suite", TTL, None)
        .await
        .unwrap();
    lease_rules(leases, 0).await;
}

/// Started `LeaseKeepAlive` streams, as etcd counts them.
fn keep_alive_streams(etcd: &Etcd) -> f64 {
    etcd.metric(r#"grpc_server_started_total{grpc_method="LeaseKeepAlive""#)
}

/// Heartbeats reuse one keep-alive stream per lease (a new stream per heartbeat kept a
/// 1,000-worker coordinator busy enough for leases to expire), and that stream breaking when
/// etcd restarts costs no heartbeat: the next one opens a new stream and keeps the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_heartbeats_share_a_stream_per_lease_and_survive_a_restart() {
    let mut etcd = Etcd::start();
    let ttl = Duration::from_secs(6);
    let leases = Leases::connect(std::slice::from_ref(&etcd.endpoint), "/lease-streams", ttl, None)
        .await
        .unwrap();
    let held: Vec<i64> = futures::future::try_join_all((0..3).map(|_| leases.grant_worker_lease()))
        .await
        .unwrap();
    let before = keep_alive_streams(&etcd);
    for _ in 0..10 {
        for &lease in &held {
            assert!(leases.keep_alive(lease).await.unwrap());
        }
    }
    assert_eq!(keep_alive_streams(&etcd) - before, 3.0, "30 heartbeats of 3 leases");

    let fence = leases.try_claim(&shard(7), "a", held[0]).await.unwrap().expect("free");
    etcd.restart();
    let deadline = std::time::Instant::now() + ttl;
    let mut failed = 0;
    loop {
        match leases.keep_alive(held[0]).await {
            Ok(alive) => {
                assert!(alive, "the lease was lost across the restart");
                break;
            }
            Err(error) => {
                failed += 1;
                assert!(
                    std::time::Instant::now() < deadline,
                    "no heartbeat after the restart: {error}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // The stream that broke is not kept: the next heartbeats go through at once.
    for _ in 0..5 {
        assert!(
            leases.keep_alive(held[0]).await.unwrap(),
            "after {failed} failed attempt(s)"
        );
    }
    assert_eq!(
        leases.owners().await.unwrap().get(&shard(7)),
        Some(&("a".to_string(), fence))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_leases_keep_the_rules() {
    // Fences continue above the largest one the control database recorded.
    lease_rules(Leases::in_process(TTL, 5_000), 5_000).await;
}
