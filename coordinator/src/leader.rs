//! Leader election among coordinator replicas through etcd. The leader holds the key
//! `<prefix>/leader` (its address) under its own lease and keeps the lease alive; when it dies
//! the key expires with the lease and a follower creates it. Only the leader serves workers and
//! changes state (register, commit, operations, purges, schedules); followers answer reads and
//! tell writers `not the leader`, naming the leader, so clients with several addresses fail
//! over. Correctness never depends on this: every checkpoint change is fenced in the control
//! database, so even two replicas that both believe they lead cannot move a shard twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::sync::RwLock;

use crate::error::CoordinatorError;
use crate::leases::{EtcdLeases, Leases, Store};

#[derive(Clone, Default)]
pub struct Leadership {
    leading: Arc<AtomicBool>,
    leader: Arc<RwLock<Option<String>>>,
    /// How many times this replica became the leader: what it knew of the control state
    /// before may have been changed by another leader since.
    terms: Arc<AtomicU64>,
}

impl Leadership {
    pub fn is_leader(&self) -> bool {
        self.leading.load(Ordering::SeqCst)
    }

    /// How many times this replica became the leader.
    pub fn terms(&self) -> u64 {
        self.terms.load(Ordering::SeqCst)
    }

    pub async fn leader_address(&self) -> Option<String> {
        self.leader.read().await.clone()
    }

    /// Ok on the leader; `NotLeader` (naming the leader when known) elsewhere.
    pub async fn require(&self) -> Result<(), CoordinatorError> {
        if self.is_leader() {
            return Ok(());
        }
        Err(CoordinatorError::NotLeader {
            leader: self.leader_address().await,
        })
    }

    async fn set(&self, leading: bool, leader: Option<String>) {
        let was = self.leading.swap(leading, Ordering::SeqCst);
        if leading && !was {
            self.terms.fetch_add(1, Ordering::SeqCst);
        }
        *self.leader.write().await = leader.clone();
        if leading && !was {
            tracing::info!("elected leader");
        } else if !leading && was {
            tracing::warn!(leader = ?leader, "no longer the leader");
        }
    }
}

/// Campaigns for leadership forever; `me` is this replica's address as clients reach it.
/// With in-process leases there is no other replica: this one leads at once.
pub async fn campaign(leases: Leases, me: String, state: Leadership) {
    let etcd = match leases.store() {
        Store::Etcd(etcd) => etcd.as_ref().clone(),
        Store::Local(_) => {
            state.set(true, Some(me)).await;
            return;
        }
    };
    let key = format!("{}/leader", etcd.prefix());
    let ttl = leases.ttl();
    loop {
        if let Err(error) = lead_once(&etcd, &key, &me, ttl, &state).await {
            tracing::warn!(%error, "leader election: etcd error; retrying");
            state.set(false, state.leader_address().await).await;
        }
        tokio::time::sleep(ttl / 4).await;
    }
}

/// Tries to take the leader key; while held, keeps its lease alive until etcd says it expired.
async fn lead_once(
    leases: &EtcdLeases,
    key: &str,
    me: &str,
    ttl: Duration,
    state: &Leadership,
) -> Result<(), CoordinatorError> {
    let mut client = leases.client();
    let lease = client.lease_grant(ttl.as_secs().max(1) as i64, None).await?.id();
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key, me, Some(PutOptions::new().with_lease(lease)))])
        .or_else([TxnOp::get(key, None)]);
    let response = client.txn(txn).await?;
    if !response.succeeded() {
        let _ = client.lease_revoke(lease).await;
        let current = client
            .get(key, None)
            .await?
            .kvs()
            .first()
            .and_then(|kv| kv.value_str().ok().map(str::to_string));
        state.set(false, current).await;
        return Ok(());
    }
    state.set(true, Some(me.to_string())).await;
    // While etcd cannot be reached no other replica can be elected either, so the leader keeps
    // serving (commits are fenced in the control database regardless) and steps down only when
    // etcd answers that its lease is gone.
    loop {
        tokio::time::sleep(ttl / 3).await;
        let alive = async {
            let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            Ok::<bool, etcd_client::Error>(stream.message().await?.is_some_and(|r| r.ttl() > 0))
        }
        .await;
        match alive {
            Ok(true) => {}
            Ok(false) => break,
            Err(error) => tracing::warn!(%error, "leader lease renewal failed; still leading until etcd answers"),
        }
    }
    state.set(false, None).await;
    Ok(())
}
