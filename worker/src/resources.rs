//! Connection pools and the staging store, one set per task, shared by that task's shards.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tidemark_common::source::SourcePool;
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
        let guard = Duration::from_millis(spec.lease_ttl_ms / 2);
        let max = max_shards + 1;
        let resources = TaskResources {
            source: SourcePool::connect_lazy(&spec.source_url, "tidemark-worker", max, guard)
                .map_err(WorkerError::Assignment)?,
            target: TargetPool::connect_lazy(&spec.target_url, "tidemark-worker", max, guard)
                .map_err(WorkerError::Assignment)?,
            staging: Staging::open(&spec.staging_url)?,
        };
        tasks.insert(spec.name.clone(), resources.clone());
        Ok(resources)
    }
}
