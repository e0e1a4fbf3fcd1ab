//! The worker's side of the gRPC contract. Calls that fail because the coordinator is
//! unreachable are retried with backoff; every call is safe to repeat (registering the same
//! batch twice is a no-op and a repeated commit is recognised by the coordinator).

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tidemark_proto::v1 as pb;
use tidemark_proto::v1::worker_service_client::WorkerServiceClient;
use tonic::transport::{Channel, Endpoint};

use crate::error::WorkerError;

#[derive(Clone)]
pub struct CoordinatorClient {
    inner: WorkerServiceClient<Channel>,
    address: String,
}

fn is_unreachable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

impl CoordinatorClient {
    pub fn new(address: &str) -> Result<CoordinatorClient, WorkerError> {
        let endpoint = Endpoint::from_shared(address.to_string())
            .map_err(|e| WorkerError::Coordinator(format!("coordinator address {address:?}: {e}")))?
            .connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(30))
            .tcp_nodelay(true);
        Ok(CoordinatorClient {
            inner: WorkerServiceClient::new(endpoint.connect_lazy()),
            address: address.to_string(),
        })
    }

    /// Retries while the coordinator is unreachable, for at most `budget`.
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
        (|| f(self.inner.clone()))
            .retry(policy)
            .when(is_unreachable)
            .notify(|status, delay| {
                tracing::warn!(coordinator = %self.address, call = what, code = ?status.code(), message = status.message(), ?delay, "coordinator call failed; retrying");
            })
            .await
            .map(tonic::Response::into_inner)
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
        let mut client = self.inner.clone();
        Ok(client.heartbeat(request).await?.into_inner().lease_alive)
    }

    pub async fn acquire_shard(
        &self,
        worker_id: &str,
        lease_id: i64,
    ) -> Result<Option<pb::ShardAssignment>, WorkerError> {
        let request = pb::AcquireShardRequest {
            worker_id: worker_id.to_string(),
            lease_id,
        };
        let mut client = self.inner.clone();
        Ok(client.acquire_shard(request).await?.into_inner().assignment)
    }

    pub async fn register_batch(&self, request: pb::RegisterBatchRequest) -> Result<(), WorkerError> {
        self.call("register_batch", Duration::from_secs(60), |mut c| {
            let request = request.clone();
            async move { c.register_batch(request).await }
        })
        .await?;
        Ok(())
    }

    pub async fn commit_batch(&self, request: pb::CommitBatchRequest) -> Result<pb::CommitBatchResponse, WorkerError> {
        Ok(self
            .call("commit_batch", Duration::from_secs(60), |mut c| {
                let request = request.clone();
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
                let request = request.clone();
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
            let request = request.clone();
            async move { c.report_reconcile(request).await }
        })
        .await?;
        Ok(())
    }
}
