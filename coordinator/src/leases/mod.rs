//! Shard ownership: who works on which shard, under which fence token.
//!
//! Each worker holds one lease (TTL = `lease_ttl`) that the coordinator keeps alive on its
//! heartbeats. Owning a shard means an ownership entry attached to that lease; when the worker
//! stops heartbeating the lease expires, the entries vanish and the shards are free. A fence
//! token is larger than every token handed out before it, so a later owner always outranks an
//! earlier one; the control database records it and compares it on every checkpoint change.
//!
//! Two stores keep these: etcd (`etcd`, the cluster: several coordinator replicas and worker
//! processes) and the process's memory (`local`, `tidemark sync`: one coordinator and its
//! workers in one process). Both pass the same suite (`tests/tests/leases.rs`).

mod etcd;
mod local;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tidemark_common::tls::ClientTls;

use crate::checkpoints::ShardKey;
use crate::error::CoordinatorError;

use etcd::EtcdFreed;
pub(crate) use etcd::EtcdLeases;
use local::LocalLeases;
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(Clone)]
pub struct Leases {
    store: Store,
    ttl: Duration,
}

#[derive(Clone)]
pub(crate) enum Store {
    Etcd(Box<EtcdLeases>),
    Local(Arc<LocalLeases>),
}

impl Leases {
    /// Leases in etcd. `tls`: for `https://` endpoints (`etcd_tls`).
    pub async fn connect(
        endpoints: &[String],
        prefix: &str,
        ttl: Duration,
        tls: Option<&ClientTls>,
    ) -> Result<Leases, CoordinatorError> {
        let etcd = EtcdLeases::connect(endpoints, prefix, tls).await?;
        Ok(Leases {
            store: Store::Etcd(Box::new(etcd)),
            ttl,
        })
    }

    /// Leases in this process's memory, for a coordinator that is the only one and whose
    /// workers run beside it (`tidemark sync`). `fence_floor`: the largest fence token ever
    /// recorded (the control database's), so tokens stay monotonic across restarts.
    pub fn in_process(ttl: Duration, fence_floor: u64) -> Leases {
        Leases {
            store: Store::Local(Arc::new(LocalLeases::new(ttl, fence_floor))),
            ttl,
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// A fresh lease for a worker.
    pub async fn grant_worker_lease(&self) -> Result<i64, CoordinatorError> {
        match &self.store {
            Store::Etcd(etcd) => etcd.grant(self.ttl).await,
            Store::Local(local) => Ok(local.grant()),
        }
    }

    /// Refreshes a worker's lease once; false when it has already expired.
    pub async fn keep_alive(&self, lease_id: i64) -> Result<bool, CoordinatorError> {
        match &self.store {
            Store::Etcd(etcd) => etcd.keep_alive(lease_id, self.ttl).await,
            Store::Local(local) => Ok(local.keep_alive(lease_id)),
        }
    }

    pub async fn lease_alive(&self, lease_id: i64) -> Result<bool, CoordinatorError> {
        match &self.store {
            Store::Etcd(etcd) => etcd.lease_alive(lease_id).await,
            Store::Local(local) => Ok(local.alive(lease_id)),
        }
    }

    /// Takes the shard if no one holds it; returns the fence token on success.
    pub async fn try_claim(
        &self,
        shard: &ShardKey,
        worker_id: &str,
        lease_id: i64,
    ) -> Result<Option<u64>, CoordinatorError> {
        match &self.store {
            Store::Etcd(etcd) => etcd.try_claim(shard, worker_id, lease_id).await,
            Store::Local(local) => Ok(local.try_claim(shard, worker_id, lease_id)),
        }
    }

    /// Takes each of `shards` no one holds, all in one round trip; the fence token of each
    /// claimed one, in order. `LeaseExpired` when `lease_id` is gone, and nothing is claimed.
    pub async fn try_claim_many(
        &self,
        shards: &[ShardKey],
        worker_id: &str,
        lease_id: i64,
    ) -> Result<Vec<Option<u64>>, CoordinatorError> {
        match &self.store {
            Store::Etcd(etcd) => etcd.try_claim_many(shards, worker_id, lease_id).await,
            Store::Local(local) if !local.alive(lease_id) => Err(CoordinatorError::LeaseExpired { lease_id }),
            Store::Local(local) => Ok(shards
                .iter()
                .map(|shard| local.try_claim(shard, worker_id, lease_id))
                .collect()),
        }
    }

    /// Gives the shard up if it is still held under `fence`.
    pub async fn release(&self, shard: &ShardKey, fence: u64) -> Result<(), CoordinatorError> {
        match &self.store {
            Store::Etcd(etcd) => etcd.release(shard, fence).await,
            Store::Local(local) => {
                local.release(shard, fence);
                Ok(())
            }
        }
    }

    /// Current owners: shard → (worker id, fence token).
    pub async fn owners(&self) -> Result<HashMap<ShardKey, (String, u64)>, CoordinatorError> {
        match &self.store {
            Store::Etcd(etcd) => etcd.owners().await,
            Store::Local(local) => Ok(local.owners()),
        }
    }

    /// Every ownership that ends from now on, as it ends: released, or expired with its
    /// worker's lease. The claim queue offers such a shard at once instead of at its next
    /// read of every shard.
    pub async fn watch_freed(&self) -> Result<Freed, CoordinatorError> {
        Ok(Freed(match &self.store {
            Store::Etcd(etcd) => Feed::Etcd(Box::new(etcd.watch_freed().await?)),
            Store::Local(local) => Feed::Local(local.watch_freed()),
        }))
    }
}

/// Ownerships as they end ([`Leases::watch_freed`]).
pub struct Freed(Feed);

enum Feed {
    Etcd(Box<EtcdFreed>),
    Local(UnboundedReceiver<ShardKey>),
}

impl Freed {
    /// The next shards whose ownership ended. An error when the feed broke (etcd restarted,
    /// the watch was cancelled): ends may have been missed, and the caller reads everything.
    pub async fn next(&mut self) -> Result<Vec<ShardKey>, CoordinatorError> {
        match &mut self.0 {
            Feed::Etcd(etcd) => etcd.next().await,
            Feed::Local(local) => {
                let first = local
                    .recv()
                    .await
                    .ok_or_else(|| CoordinatorError::InvalidRequest("the in-process lease store is gone".into()))?;
                let mut freed = vec![first];
                while let Ok(shard) = local.try_recv() {
                    freed.push(shard);
                }
                Ok(freed)
            }
        }
    }
}
