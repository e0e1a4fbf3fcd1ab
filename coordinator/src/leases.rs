//! Shard ownership in etcd.
//!
//! Each worker holds one etcd lease (TTL = `lease_ttl`) that the coordinator keeps alive on
//! its heartbeats. Owning a shard means an ownership key attached to that lease; when the
//! worker stops heartbeating the lease expires, the keys vanish and the shards are free.
//! The fence token of an ownership is the key's create revision: cluster-wide monotonic, so a
//! later owner always holds a larger token than any earlier one.

use std::collections::HashMap;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};
use tidemark_common::tls::ClientTls;

use crate::checkpoints::ShardKey;
use crate::error::CoordinatorError;

#[derive(Clone)]
pub struct Leases {
    client: Client,
    prefix: String,
    ttl: Duration,
}

impl Leases {
    /// `tls`: for `https://` endpoints (`etcd_tls`).
    pub async fn connect(
        endpoints: &[String],
        prefix: &str,
        ttl: Duration,
        tls: Option<&ClientTls>,
    ) -> Result<Leases, CoordinatorError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(5));
        if let Some(tls) = tls {
            let config = tls
                .config("etcd_tls.ca", "etcd_tls.cert", "etcd_tls.key")
                .map_err(CoordinatorError::InvalidRequest)?;
            options = options.with_tls(config);
        }
        let client = Client::connect(endpoints, Some(options)).await?;
        Ok(Leases {
            client,
            prefix: prefix.trim_end_matches('/').to_string(),
            ttl,
        })
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    fn owner_key(&self, shard: &ShardKey) -> String {
        format!(
            "{}/owners/{}/{}/{}",
            self.prefix, shard.task, shard.epoch, shard.shard_id
        )
    }

    fn owners_prefix(&self) -> String {
        format!("{}/owners/", self.prefix)
    }

    /// A fresh lease for a worker.
    pub async fn grant_worker_lease(&self) -> Result<i64, CoordinatorError> {
        let ttl_secs = self.ttl.as_secs().max(1) as i64;
        let response = self.client.clone().lease_grant(ttl_secs, None).await?;
        Ok(response.id())
    }

    /// Refreshes a worker's lease once; false when it has already expired.
    pub async fn keep_alive(&self, lease_id: i64) -> Result<bool, CoordinatorError> {
        let (mut keeper, mut stream) = self.client.clone().lease_keep_alive(lease_id).await?;
        keeper.keep_alive().await?;
        match stream.message().await? {
            Some(response) => Ok(response.ttl() > 0),
            None => Ok(false),
        }
    }

    pub async fn lease_alive(&self, lease_id: i64) -> Result<bool, CoordinatorError> {
        let response = self.client.clone().lease_time_to_live(lease_id, None).await?;
        Ok(response.ttl() > 0)
    }

    /// Creates the ownership key if no one holds it; returns the fence token on success.
    pub async fn try_claim(
        &self,
        shard: &ShardKey,
        worker_id: &str,
        lease_id: i64,
    ) -> Result<Option<u64>, CoordinatorError> {
        let key = self.owner_key(shard);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, worker_id, Some(PutOptions::new().with_lease(lease_id)))]);
        let response = self.client.clone().txn(txn).await?;
        if !response.succeeded() {
            return Ok(None);
        }
        let revision = response
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| CoordinatorError::InvalidRequest("etcd txn response without header".into()))?;
        Ok(Some(revision as u64))
    }

    /// Deletes the ownership key if it is still the one created under `fence`.
    pub async fn release(&self, shard: &ShardKey, fence: u64) -> Result<(), CoordinatorError> {
        let key = self.owner_key(shard);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, fence as i64)])
            .and_then([TxnOp::delete(key, None)]);
        self.client.clone().txn(txn).await?;
        Ok(())
    }

    /// Current owners: shard → (worker id, fence token).
    pub async fn owners(&self) -> Result<HashMap<ShardKey, (String, u64)>, CoordinatorError> {
        let prefix = self.owners_prefix();
        let response = self
            .client
            .clone()
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await?;
        let mut owners = HashMap::new();
        for kv in response.kvs() {
            let Ok(key) = kv.key_str() else { continue };
            let parts: Vec<&str> = key[prefix.len()..].split('/').collect();
            let [task, epoch, shard_id] = parts.as_slice() else {
                continue;
            };
            let (Ok(epoch), Ok(shard_id)) = (epoch.parse(), shard_id.parse()) else {
                continue;
            };
            let worker = kv.value_str().unwrap_or_default().to_string();
            owners.insert(
                ShardKey {
                    task: task.to_string(),
                    epoch,
                    shard_id,
                },
                (worker, kv.create_revision() as u64),
            );
        }
        Ok(owners)
    }
}
