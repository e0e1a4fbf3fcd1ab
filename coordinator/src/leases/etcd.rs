//! Leases and shard ownership in etcd. An ownership is a key attached to the worker's etcd
//! lease; its fence token is the key's create revision: cluster-wide monotonic.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions,
    Txn, TxnOp, TxnOpResponse, WatchFilterType, WatchOptions, WatchStream,
};
use tidemark_common::tls::ClientTls;

use crate::checkpoints::ShardKey;
use crate::error::CoordinatorError;

#[derive(Clone)]
pub(crate) struct EtcdLeases {
    client: Client,
    prefix: String,
    keepers: Arc<Keepers>,
}

/// How long one keep-alive waits for etcd's answer before the stream is given up.
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// One open keep-alive stream per lease, reused by every heartbeat of that lease. Opening a
/// stream per heartbeat cost an HTTP/2 stream set-up and tear-down on both sides each time:
/// with 1,000 workers that alone kept the box busy and leases expired (BENCHMARKS.md, issue
/// 20). A stream unused for three of its lease's TTLs (a worker that vanished) is dropped.
#[derive(Default)]
struct Keepers {
    streams: Mutex<HashMap<i64, Arc<Keeper>>>,
    swept_at: Mutex<Option<Instant>>,
}

struct Keeper {
    used: Mutex<Instant>,
    stream: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
}

/// What one keep-alive on an open stream came to.
enum Renewal {
    Alive,
    Expired,
}

impl Keepers {
    fn keeper(&self, lease_id: i64) -> Arc<Keeper> {
        let mut streams = self.streams.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        streams
            .entry(lease_id)
            .or_insert_with(|| {
                Arc::new(Keeper {
                    used: Mutex::new(Instant::now()),
                    stream: tokio::sync::Mutex::new(None),
                })
            })
            .clone()
    }

    fn forget(&self, lease_id: i64) {
        self.streams
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&lease_id);
    }

    /// Drops the streams of leases nobody kept alive for `idle`, at most once per `idle`.
    fn sweep(&self, idle: Duration) {
        let now = Instant::now();
        {
            let mut swept_at = self.swept_at.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if swept_at.is_some_and(|at| now.duration_since(at) < idle) {
                return;
            }
            *swept_at = Some(now);
        }
        self.streams
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|_, keeper| now.duration_since(*keeper.used.lock().unwrap_or_else(|p| p.into_inner())) < idle);
    }
}

fn lease_not_found(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::LeaseKeepAliveError(message) if message.contains("lease not found"))
        || matches!(error, etcd_client::Error::GRpcStatus(status) if status.message().contains("lease not found"))
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
            keepers: Arc::default(),
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

    /// False when the lease has expired (etcd answers with TTL 0 or "lease not found").
    /// `ttl`: the lease's TTL, to know when an unused stream may be dropped.
    pub(crate) async fn keep_alive(&self, lease_id: i64, ttl: Duration) -> Result<bool, CoordinatorError> {
        self.keepers.sweep(ttl * 3);
        let keeper = self.keepers.keeper(lease_id);
        *keeper.used.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Instant::now();
        let mut stream = keeper.stream.lock().await;
        // A stream that served before may have broken since (etcd restarted, the connection
        // was reset): on an error it is reopened once before the error counts.
        let reused = stream.is_some();
        let mut outcome = self.renew_on(&mut stream, lease_id).await;
        if reused && outcome.is_err() {
            outcome = self.renew_on(&mut stream, lease_id).await;
        }
        match outcome {
            Ok(Renewal::Alive) => Ok(true),
            Ok(Renewal::Expired) => {
                drop(stream);
                self.keepers.forget(lease_id);
                Ok(false)
            }
            Err(error) => Err(error.into()),
        }
    }

    /// One keep-alive on the lease's stream, opening it when there is none. Any error or a
    /// late answer drops the stream, so that no answer is ever read for the wrong request.
    /// etcd's "lease not found" is an answer: the lease expired.
    async fn renew_on(
        &self,
        stream: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
        lease_id: i64,
    ) -> Result<Renewal, etcd_client::Error> {
        let renewed = async {
            if stream.is_none() {
                *stream = Some(self.client.clone().lease_keep_alive(lease_id).await?);
            }
            let (keeper, responses) = stream.as_mut().expect("opened above");
            keeper.keep_alive().await?;
            match responses.message().await? {
                Some(response) if response.ttl() > 0 => Ok(Renewal::Alive),
                Some(_) => Ok(Renewal::Expired),
                None => Err(etcd_client::Error::LeaseKeepAliveError(
                    "etcd closed the keep-alive stream".into(),
                )),
            }
        };
        let outcome = match tokio::time::timeout(KEEP_ALIVE_TIMEOUT, renewed).await {
            Ok(Err(error)) if lease_not_found(&error) => Ok(Renewal::Expired),
            Ok(outcome) => outcome,
            Err(_) => Err(etcd_client::Error::LeaseKeepAliveError(format!(
                "no keep-alive answer within {KEEP_ALIVE_TIMEOUT:?}"
            ))),
        };
        if !matches!(outcome, Ok(Renewal::Alive)) {
            *stream = None;
        }
        outcome
    }

    pub(crate) async fn lease_alive(&self, lease_id: i64) -> Result<bool, CoordinatorError> {
        let response = self.client.clone().lease_time_to_live(lease_id, None).await?;
        Ok(response.ttl() > 0)
    }

    /// Creates `shard`'s ownership key under `lease_id` if the key does not exist.
    fn claim_txn(&self, shard: &ShardKey, worker_id: &str, lease_id: i64) -> Txn {
        let key = self.owner_key(shard);
        Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, worker_id, Some(PutOptions::new().with_lease(lease_id)))])
    }

    /// Creates the ownership key if no one holds it; the fence token is its revision. An
    /// expired lease is `LeaseExpired`: etcd refuses a put under a lease it does not have, so
    /// the claim itself checks the lease (a separate `lease_alive` waited, like every lease
    /// call, for etcd to apply everything committed before it).
    pub(crate) async fn try_claim(
        &self,
        shard: &ShardKey,
        worker_id: &str,
        lease_id: i64,
    ) -> Result<Option<u64>, CoordinatorError> {
        let response = self
            .client
            .clone()
            .txn(self.claim_txn(shard, worker_id, lease_id))
            .await
            .map_err(|error| claim_error(error, lease_id))?;
        if !response.succeeded() {
            return Ok(None);
        }
        let revision = response
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| CoordinatorError::InvalidRequest("etcd txn response without header".into()))?;
        Ok(Some(revision as u64))
    }

    /// Creates the ownership keys no one holds, in one transaction of one compare-and-put
    /// per shard (one raft write for all): the fence token of each is the transaction's
    /// revision, strictly greater than any earlier owner's of the same shard. `None` for a
    /// shard someone holds.
    pub(crate) async fn try_claim_many(
        &self,
        shards: &[ShardKey],
        worker_id: &str,
        lease_id: i64,
    ) -> Result<Vec<Option<u64>>, CoordinatorError> {
        if let [shard] = shards {
            return Ok(vec![self.try_claim(shard, worker_id, lease_id).await?]);
        }
        let claims: Vec<TxnOp> = shards
            .iter()
            .map(|shard| TxnOp::txn(self.claim_txn(shard, worker_id, lease_id)))
            .collect();
        let response = self
            .client
            .clone()
            .txn(Txn::new().and_then(claims))
            .await
            .map_err(|error| claim_error(error, lease_id))?;
        let revision = response
            .header()
            .map(|h| h.revision() as u64)
            .ok_or_else(|| CoordinatorError::InvalidRequest("etcd txn response without header".into()))?;
        let claimed: Vec<Option<u64>> = response
            .op_responses()
            .into_iter()
            .map(|op| match op {
                TxnOpResponse::Txn(inner) if inner.succeeded() => Some(revision),
                _ => None,
            })
            .collect();
        if claimed.len() != shards.len() {
            return Err(CoordinatorError::InvalidRequest(format!(
                "etcd answered {} of {} claims",
                claimed.len(),
                shards.len()
            )));
        }
        Ok(claimed)
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

    /// The shard an ownership key names, or `None` for a key that is not one.
    fn shard_of(&self, key: &str) -> Option<ShardKey> {
        shard_under(&self.owners_prefix(), key)
    }

    pub(crate) async fn owners(&self) -> Result<HashMap<ShardKey, (String, u64)>, CoordinatorError> {
        let response = self
            .client
            .clone()
            .get(self.owners_prefix(), Some(GetOptions::new().with_prefix()))
            .await?;
        let prefix = self.owners_prefix();
        Ok(crate::off_runtime::run(move || {
            let mut owners = HashMap::new();
            for kv in response.kvs() {
                let Some(shard) = kv.key_str().ok().and_then(|key| shard_under(&prefix, key)) else {
                    continue;
                };
                let worker = kv.value_str().unwrap_or_default().to_string();
                owners.insert(shard, (worker, kv.create_revision() as u64));
            }
            owners
        })
        .await)
    }

    /// A watch on the ownership keys' deletions: a release, or the expiry of the lease
    /// they were attached to.
    pub(crate) async fn watch_freed(&self) -> Result<EtcdFreed, CoordinatorError> {
        let options = WatchOptions::new().with_prefix().with_filters([WatchFilterType::NoPut]);
        let stream = self.client.clone().watch(self.owners_prefix(), Some(options)).await?;
        Ok(EtcdFreed {
            leases: self.clone(),
            stream,
        })
    }
}

pub(crate) struct EtcdFreed {
    leases: EtcdLeases,
    stream: WatchStream,
}

impl EtcdFreed {
    /// The shards freed by the next deletions etcd reports; an error when the watch ended
    /// (etcd restarted, the watch was compacted or cancelled): deletions may have been missed.
    pub(crate) async fn next(&mut self) -> Result<Vec<ShardKey>, CoordinatorError> {
        loop {
            let response = self.stream.message().await?.ok_or_else(|| {
                CoordinatorError::Etcd(etcd_client::Error::WatchError("etcd closed the watch".into()))
            })?;
            if response.canceled() {
                return Err(CoordinatorError::Etcd(etcd_client::Error::WatchError(format!(
                    "etcd cancelled the watch: {}",
                    response.cancel_reason()
                ))));
            }
            let freed: Vec<ShardKey> = response
                .events()
                .iter()
                .filter(|event| event.event_type() == EventType::Delete)
                .filter_map(|event| self.leases.shard_of(event.kv()?.key_str().ok()?))
                .collect();
            if !freed.is_empty() {
                return Ok(freed);
            }
        }
    }
}

/// The shard whose ownership key is `key`, under the owners' `prefix`.
fn shard_under(prefix: &str, key: &str) -> Option<ShardKey> {
    let rest = key.strip_prefix(prefix)?;
    let parts: Vec<&str> = rest.split('/').collect();
    let [task, epoch, shard_id] = parts.as_slice() else {
        return None;
    };
    Some(ShardKey {
        task: task.to_string(),
        epoch: epoch.parse().ok()?,
        shard_id: shard_id.parse().ok()?,
    })
}

/// A claim's error: etcd's refusal of a put under a lease it does not have is the worker's
/// expired lease.
fn claim_error(error: etcd_client::Error, lease_id: i64) -> CoordinatorError {
    match &error {
        etcd_client::Error::GRpcStatus(status)
            if status.code() == tonic::Code::NotFound && status.message().contains("lease not found") =>
        {
            CoordinatorError::LeaseExpired { lease_id }
        }
        _ => error.into(),
    }
}
