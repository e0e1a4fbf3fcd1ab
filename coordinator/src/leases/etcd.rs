//! Leases and shard ownership in etcd. An ownership is a key attached to the worker's etcd
//! lease; its fence token is the key's create revision: cluster-wide monotonic.

use std::collections::HashMap;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};
use tidemark_common::tls::ClientTls;

use crate::checkpoints::ShardKey;
use crate::error::CoordinatorError;

#[derive(Clone)]
pub(crate) struct EtcdLeases {
    client: Client,
    prefix: String,
}

impl EtcdLeases {
    pub(crate) async fn connect(
        endpoints: &[String],
        prefix: &str,
        tls: Option<&ClientTls>,
    ) -> Result<EtcdLeases, CoordinatorError> {
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
        Ok(EtcdLeases {
            client,
            prefix: prefix.trim_end_matches('/').to_string(),
        })
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

    pub(crate) async fn grant(&self, ttl: Duration) -> Result<i64, CoordinatorError> {
        let ttl_secs = ttl.as_secs().max(1) as i64;
        let response = self.client.clone().lease_grant(ttl_secs, None).await?;
        Ok(response.id())
    }

    /// False when the lease has expired (etcd answers "lease not found").
    pub(crate) async fn keep_alive(&self, lease_id: i64) -> Result<bool, CoordinatorError> {
        let renewed = async {
            let (mut keeper, mut stream) = self.client.clone().lease_keep_alive(lease_id).await?;
            keeper.keep_alive().await?;
            Ok::<_, etcd_client::Error>(stream.message().await?.is_some_and(|response| response.ttl() > 0))
        };
        match renewed.await {
            Ok(alive) => Ok(alive),
            Err(etcd_client::Error::LeaseKeepAliveError(message)) if message.contains("lease not found") => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    pub(crate) async fn lease_alive(&self, lease_id: i64) -> Result<bool, CoordinatorError> {
        let response = self.client.clone().lease_time_to_live(lease_id, None).await?;
        Ok(response.ttl() > 0)
    }

    /// Creates the ownership key if no one holds it; the fence token is its revision.
    pub(crate) async fn try_claim(
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
    pub(crate) async fn release(&self, shard: &ShardKey, fence: u64) -> Result<(), CoordinatorError> {
        let key = self.owner_key(shard);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, fence as i64)])
            .and_then([TxnOp::delete(key, None)]);
        self.client.clone().txn(txn).await?;
        Ok(())
    }

    pub(crate) async fn owners(&self) -> Result<HashMap<ShardKey, (String, u64)>, CoordinatorError> {
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
