//! Connection pools and the staging store, one set per task, shared by that task's shards.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};
use tidemark_common::pg::connect_options;
use tidemark_common::source::{SourceEngine, SourcePool};
use tidemark_common::staging::Staging;
use tidemark_common::target::TargetPool;
use tidemark_proto::v1 as pb;
use tokio::sync::Mutex;

use crate::error::WorkerError;

#[derive(Clone)]
pub struct TaskResources {
    pub source: SourcePool,
    pub target: TargetPool,
    pub staging: Staging,
}

#[derive(Default, Clone)]
pub struct ResourceCache {
    tasks: Arc<Mutex<HashMap<String, TaskResources>>>,
}

impl ResourceCache {
    /// Pools connect lazily, so an unreachable database shows as an error on first use and
    /// the shard is retried, rather than failing here.
    pub async fn for_task(&self, spec: &pb::TaskSpec, max_shards: u32) -> Result<TaskResources, WorkerError> {
        let mut tasks = self.tasks.lock().await;
        if let Some(resources) = tasks.get(&spec.name) {
            return Ok(resources.clone());
        }
        // Sessions never hold locks or idle transactions longer than half a lease, so a
        // stopped zombie cannot block the shard's next owner.
        let guard_ms = (spec.lease_ttl_ms / 2).max(1000).to_string();
        let pool = |url: &str| -> Result<PgPool, WorkerError> {
            let options = connect_options(url, "tidemark-worker")
                .map_err(WorkerError::Assignment)?
                .options([
                    ("lock_timeout", guard_ms.as_str()),
                    ("idle_in_transaction_session_timeout", guard_ms.as_str()),
                ]);
            Ok(PgPoolOptions::new()
                .max_connections(max_shards + 1)
                .acquire_timeout(Duration::from_secs(10))
                .connect_lazy_with(options))
        };
        let resources = TaskResources {
            source: match SourceEngine::of_url(&spec.source_url).map_err(WorkerError::Assignment)? {
                SourceEngine::Postgres => SourcePool::Postgres(pool(&spec.source_url)?),
                SourceEngine::MySql => SourcePool::MySql(
                    tidemark_common::mysql::pool(&spec.source_url, max_shards + 1).map_err(WorkerError::Assignment)?,
                ),
            },
            target: match SourceEngine::of_url(&spec.target_url).map_err(WorkerError::Assignment)? {
                SourceEngine::Postgres => TargetPool::Postgres(pool(&spec.target_url)?),
                SourceEngine::MySql => TargetPool::MySql(
                    tidemark_common::mysql::target_pool(&spec.target_url, max_shards + 1, spec.lease_ttl_ms / 2000)
                        .map_err(WorkerError::Assignment)?,
                ),
            },
            staging: Staging::open(&spec.staging_url)?,
        };
        tasks.insert(spec.name.clone(), resources.clone());
        Ok(resources)
    }
}
