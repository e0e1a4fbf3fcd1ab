//! The worker's side of the gRPC contract. Calls that fail because the coordinator is
//! unreachable are retried with backoff; every call is safe to repeat (registering the same
//! batch twice is a no-op and a repeated commit is recognised by the coordinator).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tidemark_common::tls::ClientTls;
use tidemark_proto::v1 as pb;
use tidemark_proto::v1::worker_service_client::WorkerServiceClient;
use tonic::transport::Channel;

use tidemark_common::telemetry::traced_request;

use crate::error::WorkerError;

/// A client of the coordinator replicas: calls go to the current one, and a call that finds
/// it unreachable or not the leader moves on to the next address.
#[derive(Clone)]
pub struct CoordinatorClient {
    replicas: Arc<Vec<(String, WorkerServiceClient<Channel>)>>,
    current: Arc<AtomicUsize>,
}

fn is_unreachable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

impl CoordinatorClient {
    /// `addresses`: one or more coordinator URLs, comma-separated.
    /// `https://` addresses use TLS as `TIDEMARK_TLS_*` configure it (see `common::tls`).
    pub fn new(addresses: &str) -> Result<CoordinatorClient, WorkerError> {
        let tls = ClientTls::from_env();
        let mut replicas = Vec::new();
        for address in addresses.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            let endpoint = tls
                .endpoint(address)
                .map_err(WorkerError::Coordinator)?
                .connect_timeout(Duration::from_secs(3))
                .timeout(Duration::from_secs(30))
                .tcp_nodelay(true);
            replicas.push((address.to_string(), WorkerServiceClient::new(endpoint.connect_lazy())));
        }
        if replicas.is_empty() {
            return Err(WorkerError::Coordinator("no coordinator address given".into()));
        }
        Ok(CoordinatorClient {
            replicas: Arc::new(replicas),
            current: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn current(&self) -> (usize, &str, WorkerServiceClient<Channel>) {
        let index = self.current.load(Ordering::SeqCst) % self.replicas.len();
        let (address, client) = &self.replicas[index];
        (index, address, client.clone())
    }

    /// Moves on from replica `index` (unless another call already did).
    fn fail_over(&self, index: usize) {
        if self.replicas.len() > 1 {
            let next = (index + 1) % self.replicas.len();
            if self
                .current
                .compare_exchange(index, next, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                tracing::warn!(from = %self.replicas[index].0, to = %self.replicas[next].0, "switching coordinator replica");
            }
        }
    }

    /// One attempt on each replica at most, starting with the current one.
    async fn once<T, F, Fut>(&self, f: F) -> Result<T, tonic::Status>
    where
        F: Fn(WorkerServiceClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut last = None;
        for _ in 0..self.replicas.len() {
            let (index, _, client) = self.current();
            match f(client).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) if is_unreachable(&status) => {
                    self.fail_over(index);
                    last = Some(status);
                }
                Err(status) => return Err(status),
            }
        }
        Err(last.expect("at least one replica"))
    }

    /// Retries while no replica answers, for at most `budget`.
    async fn call<T, F, Fut>(&self, what: &str, budget: Duration, f: F) -> Result<T, tonic::Status>
    where
        F: Fn(WorkerServiceClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let policy = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(3))
            .with_total_delay(Some(budget))
            .without_max_times();
        (|| self.once(&f))
            .retry(policy)
            .when(is_unreachable)
            .notify(|status, delay| {
                tracing::warn!(coordinator = %self.current().1, call = what, code = ?status.code(), message = status.message(), ?delay, "coordinator call failed; retrying");
            })
            .await
    }

    pub async fn register_worker(&self, worker_id: &str) -> Result<pb::RegisterWorkerResponse, tonic::Status> {
        let request = pb::RegisterWorkerRequest {
            worker_id: worker_id.to_string(),
        };
        self.call("register_worker", Duration::from_secs(3600), |mut c| {
            let request = request.clone();
            async move { c.register_worker(request).await }
        })
        .await
    }

    pub async fn heartbeat(&self, worker_id: &str, lease_id: i64) -> Result<bool, tonic::Status> {
        let request = pb::HeartbeatRequest {
            worker_id: worker_id.to_string(),
            lease_id,
        };
        Ok(self
            .once(|mut c| {
                let request = request.clone();
                async move { c.heartbeat(request).await }
            })
            .await?
            .lease_alive)
    }

    /// Up to `max_shards` shards (the coordinator may give fewer, or none when none is free).
    pub async fn acquire_shards(
        &self,
        worker_id: &str,
        lease_id: i64,
        max_shards: u32,
    ) -> Result<Vec<pb::ShardAssignment>, WorkerError> {
        let request = pb::AcquireShardRequest {
            worker_id: worker_id.to_string(),
            lease_id,
            max_shards,
        };
        Ok(self
            .once(|mut c| {
                let request = request.clone();
                async move { c.acquire_shard(request).await }
            })
            .await?
            .assignments())
    }

    pub async fn register_batch(&self, request: pb::RegisterBatchRequest) -> Result<(), WorkerError> {
        self.call("register_batch", Duration::from_secs(60), |mut c| {
            let request = traced_request(request.clone());
            async move { c.register_batch(request).await }
        })
        .await?;
        Ok(())
    }

    pub async fn commit_batch(&self, request: pb::CommitBatchRequest) -> Result<pb::CommitBatchResponse, WorkerError> {
        Ok(self
            .call("commit_batch", Duration::from_secs(60), |mut c| {
                let request = traced_request(request.clone());
                async move { c.commit_batch(request).await }
            })
            .await?)
    }

    pub async fn release_shard(&self, request: pb::ReleaseShardRequest) -> Result<(), WorkerError> {
        self.call("release_shard", Duration::from_secs(30), |mut c| {
            let request = request.clone();
            async move { c.release_shard(request).await }
        })
        .await?;
        Ok(())
    }

    /// Returns the checkpoint's new version (abandoning bumps it).
    pub async fn abandon_batch(&self, request: pb::AbandonBatchRequest) -> Result<u64, WorkerError> {
        let response = self
            .call("abandon_batch", Duration::from_secs(60), |mut c| {
                let request = traced_request(request.clone());
                async move { c.abandon_batch(request).await }
            })
            .await?;
        Ok(response.new_version)
    }

    /// Work for a caught-up shard beside reading (a reconciliation order), if any.
    pub async fn next_shard_work(&self, request: pb::ShardWorkRequest) -> Result<pb::ShardWorkResponse, WorkerError> {
        Ok(self
            .call("next_shard_work", Duration::from_secs(60), |mut c| {
                let request = request.clone();
                async move { c.next_shard_work(request).await }
            })
            .await?)
    }

    pub async fn report_reconcile(&self, request: pb::ReportReconcileRequest) -> Result<(), WorkerError> {
        self.call("report_reconcile", Duration::from_secs(60), |mut c| {
            let request = traced_request(request.clone());
            async move { c.report_reconcile(request).await }
        })
        .await?;
        Ok(())
    }
}
