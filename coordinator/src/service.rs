//! gRPC handlers. Each checks its input and hands off to the component that owns the state:
//! `leases` (etcd) for liveness and ownership, `checkpoints` (control database) for progress.

use std::collections::HashMap;
use std::sync::Arc;

use tidemark_proto::v1 as pb;
use tidemark_proto::v1::admin_service_server::AdminService;
use tidemark_proto::v1::worker_service_server::WorkerService;
use tonic::{Request, Response, Status};

use tidemark_common::config::{DeletePolicy, ReconcileCompare, TargetDeletes};
use tidemark_common::contract::{self, Contract};

use crate::checkpoints::ShardStatusRow;
use crate::checkpoints::{
    Claim, Claimed, CommitBatch, ControlDb, EpochRecord, RegisterBatch, ShardKey, parse_request_cursor,
};
use crate::claim_queue::ClaimQueue;
use crate::engines;
use crate::error::CoordinatorError;
use crate::groups::{Claims, Commits, Groups, Registrations, ShardWorkPolls};
use crate::leader::Leadership;
use crate::leases::Leases;
use crate::metrics::{METRICS, count};
use crate::operations::{request_merge, request_move, request_split};
use crate::planner::PreparedTask;
use crate::planner::{delete_spec, epoch_columns, reinit_task, source_now_micros};
use crate::reconcile_runs::ShardReconcile;
use crate::workers_seen::WorkersSeen;
use tidemark_common::target::TargetPool;
use tidemark_common::telemetry::join_trace;
use tracing::Instrument;

pub struct Coordinator {
    pub control: ControlDb,
    pub leases: Leases,
    pub tasks: HashMap<String, PreparedTask>,
    /// Each task's target, connected on first use (dead-letter counts and handling).
    pub targets: HashMap<String, TargetPool>,
    pub staging_url: String,
    pub leadership: Leadership,
    /// This replica's address, as clients reach it.
    pub address: String,
    /// Which shards wait for a worker (see `capacity`).
    pub capacity: crate::capacity::Capacity,
}

#[derive(Clone)]
pub struct CoordinatorService {
    inner: Arc<Coordinator>,
    claims: Arc<ClaimQueue>,
    seen: Arc<WorkersSeen>,
    claims_recorded: Arc<Groups<Claims>>,
    commits: Arc<Groups<Commits>>,
    registrations: Arc<Groups<Registrations>>,
    shard_work_polls: Arc<Groups<ShardWorkPolls>>,
}

impl CoordinatorService {
    pub fn new(coordinator: Coordinator) -> CoordinatorService {
        let claims = Arc::new(ClaimQueue::default());
        claims.follow(coordinator.leases.clone());
        CoordinatorService {
            inner: Arc::new(coordinator),
            claims,
            seen: Arc::new(WorkersSeen::default()),
            claims_recorded: Arc::default(),
            commits: Arc::default(),
            registrations: Arc::default(),
            shard_work_polls: Arc::default(),
        }
    }

    fn task(&self, name: &str) -> Result<&PreparedTask, CoordinatorError> {
        self.inner
            .tasks
            .get(name)
            .ok_or_else(|| CoordinatorError::UnknownTask(name.to_string()))
    }

    fn target_pool(&self, name: &str) -> Result<&TargetPool, CoordinatorError> {
        self.task(name)?;
        self.inner
            .targets
            .get(name)
            .ok_or_else(|| CoordinatorError::UnknownTask(name.to_string()))
    }

    /// The task's target pool and its engine's coordinator side.
    fn target(&self, name: &str) -> Result<(&'static dyn engines::TargetSide, &TargetPool), CoordinatorError> {
        let task = self.task(name)?;
        Ok((engines::target_side(&task.config)?, self.target_pool(name)?))
    }

    /// Dead letters per status, or a warning when the target does not answer in time.
    async fn dead_letter_counts(&self, task: &str) -> Result<HashMap<String, u64>, String> {
        let Ok((side, target)) = self.target(task) else {
            return Ok(HashMap::new());
        };
        let counts = side.dead_letter_counts(target, task);
        match tokio::time::timeout(std::time::Duration::from_secs(3), counts).await {
            Ok(Ok(counts)) => Ok(counts.into_iter().collect()),
            Ok(Err(error)) => Err(format!("dead letters unknown: the target did not answer ({error})")),
            Err(_) => Err("dead letters unknown: the target did not answer within 3s".to_string()),
        }
    }

    /// A shard whose runs keep ending with the same error that retrying cannot fix (a column
    /// missing in the target, a value no window can hold) pauses its task with that error at
    /// `max_batch_failures`, instead of being retried silently forever.
    async fn count_failure(&self, shard: &ShardKey, request: &pb::ReleaseShardRequest) -> Result<(), CoordinatorError> {
        let control = &self.inner.control;
        let repeats = control
            .record_failure(shard, request.fence_token, &request.worker_id, &request.failure)
            .await?;
        let limit = self.task(&shard.task)?.config.max_batch_failures;
        tracing::warn!(task = %shard.task, shard = shard.shard_id, repeats, limit, failure = %request.failure,
            "shard stopped on an error retrying cannot fix");
        if limit == 0 || repeats < limit {
            return Ok(());
        }
        let reason = format!(
            "batch keeps failing: shard {} stopped {repeats} times in a row with: {}; fix the cause, then \
             `tidemark-coordinator tasks resume {}`",
            shard.shard_id, request.failure, shard.task
        );
        if control
            .pause_for_owner(shard, request.fence_token, &request.worker_id, &reason)
            .await?
        {
            tracing::error!(task = %shard.task, shard = shard.shard_id, %reason, "task paused");
        }
        Ok(())
    }

    fn task_spec(&self, task: &PreparedTask, epoch: &EpochRecord) -> Result<pb::TaskSpec, CoordinatorError> {
        let config = &task.config;
        let (delete_source, delete_column) = delete_spec(config);
        let columns = epoch_columns(&config.name, epoch)?;
        Ok(pb::TaskSpec {
            name: config.name.clone(),
            source_url: config.source.clone(),
            source_table: config.source_table.clone(),
            target_url: config.target.clone(),
            target_table: config.target_table.clone(),
            key_columns: config.key.clone(),
            cursor_column: config.cursor_column.clone().unwrap_or_default(),
            page_size: config.page_size,
            safety_delay_ms: config.safety_delay.as_millis() as u64,
            poll_interval_ms: config.poll_interval.as_millis() as u64,
            columns: columns
                .iter()
                .map(|c| pb::Column {
                    name: c.name.clone(),
                    sql_type: c.sql_type.clone(),
                })
                .collect(),
            schema_id: epoch.schema_id.clone(),
            staging_url: self.inner.staging_url.clone(),
            lease_ttl_ms: self.inner.leases.ttl().as_millis() as u64,
            mode: config.mode.as_str().into(),
            version_column: task.version_column.clone().unwrap_or_default(),
            overlap_ms: config.overlap.as_millis() as u64,
            open_transaction_bound: config.open_transaction_bound,
            delete_source: delete_source.to_string(),
            delete_column: delete_column.to_string(),
            target_soft_deletes: config.target_deletes == TargetDeletes::Soft,
            filter: config.filter.clone().unwrap_or_default(),
            max_dead_letter_ratio: config.max_dead_letter_ratio,
            cursor_time_zone: epoch.cursor_zone.clone().unwrap_or_default(),
            accumulate: match config
                .accumulate_spec()
                .map_err(|e| CoordinatorError::task_setup(&config.name, e))?
            {
                Some(spec) => serde_json::to_string(&spec).expect("spec serializes"),
                None => String::new(),
            },
        })
    }

    /// Claims up to `want` shards for `worker_id` (at least one, at most [`MOST_CLAIMS`]) and
    /// its share of those waiting: the shards the queue holds for it, divided by the workers
    /// heard from within a lease TTL, rounded up. The share keeps the first of several workers
    /// that start together from taking every shard; taking several in one call turns a burst
    /// of one-shard acquires (a vanished worker's shards, a cluster's start) into one etcd
    /// transaction and one grouped control write per call.
    async fn acquire(
        &self,
        worker_id: &str,
        lease_id: i64,
        want: u32,
    ) -> Result<Vec<pb::ShardAssignment>, CoordinatorError> {
        let coordinator = &self.inner;
        // Changes this process reported that can make shards claimable, and terms as leader
        // (another leader may have changed anything meanwhile): both only grow.
        let changes = coordinator.control.candidates_generation() + coordinator.leadership.terms();
        if !self.claims.may_have(worker_id, changes) {
            return Ok(Vec::new());
        }
        // The claim checks the lease (`LeaseExpired`); an acquire that finds nothing to claim
        // does not, and the worker hears of its expired lease from its next heartbeat.
        // Paused tasks are filtered in the control database, which every replica shares.
        let active: Vec<String> = coordinator.tasks.keys().cloned().collect();
        if coordinator.control.worker_draining(worker_id).await? {
            return Ok(Vec::new());
        }
        let want = (want.max(1) as usize).min(MOST_CLAIMS);
        let mut assigned = Vec::new();
        let mut target = None;
        loop {
            let mut shards = Vec::new();
            while assigned.len() + shards.len() < target.unwrap_or(1) {
                let next = self
                    .claims
                    .next(worker_id, changes, &active, &coordinator.control, &coordinator.leases)
                    .await;
                match next {
                    Ok(Some(shard)) => shards.push(shard),
                    Ok(None) => break,
                    Err(error) if shards.is_empty() && assigned.is_empty() => return Err(error),
                    Err(_) => break,
                }
                if target.is_none() {
                    // Decided once, after the first take has read what waits.
                    let waiting = 1 + self.claims.waiting(worker_id);
                    let live = self.seen.live(coordinator.leases.ttl());
                    target = Some(want.min(waiting.div_ceil(live)));
                }
            }
            if shards.is_empty() {
                break;
            }
            let fences = match coordinator.leases.try_claim_many(&shards, worker_id, lease_id).await {
                Ok(fences) => fences,
                Err(error @ CoordinatorError::LeaseExpired { .. }) => {
                    // Nothing was claimed: offer them to the next acquire.
                    self.claims.unclaimed(shards);
                    return Err(error);
                }
                Err(error) => {
                    // Taken from the queue but not claimed: read them again at the next acquire.
                    self.claims.invalidate();
                    if assigned.is_empty() {
                        return Err(error);
                    }
                    break;
                }
            };
            // Owned meanwhile (`None`): their end will be reported. The rest are recorded
            // together (`claims_recorded` groups concurrent calls in one transaction).
            let claimed: Vec<(ShardKey, u64)> = shards
                .into_iter()
                .zip(fences)
                .filter_map(|(shard, fence)| Some((shard, fence?)))
                .collect();
            let recorded = futures::future::join_all(
                claimed
                    .iter()
                    .map(|(shard, fence)| self.assign(shard, *fence, worker_id)),
            )
            .await;
            let mut failed = None;
            for ((shard, fence), result) in claimed.iter().zip(recorded) {
                match result {
                    Ok(Some(assignment)) => assigned.push(assignment),
                    Ok(None) => {}
                    Err(error) => {
                        // The worker will never hear of this claim: give it back at once
                        // rather than leave the shard owned by nobody who works on it.
                        if let Err(release_error) = coordinator.leases.release(shard, *fence).await {
                            tracing::warn!(task = %shard.task, shard = shard.shard_id, %release_error, "could not release a failed claim; it expires with the lease");
                        }
                        failed.get_or_insert(error);
                    }
                }
            }
            if let Some(error) = failed {
                if assigned.is_empty() {
                    return Err(error);
                }
                break;
            }
            if assigned.len() >= target.unwrap_or(1) {
                break;
            }
        }
        if !assigned.is_empty() {
            coordinator.capacity.claimed();
        }
        Ok(assigned)
    }

    /// Records a claimed shard's new owner in the control database and builds the
    /// assignment. `None` when the fence did not increase (the claim is given back).
    async fn assign(
        &self,
        shard: &ShardKey,
        fence: u64,
        worker_id: &str,
    ) -> Result<Option<pb::ShardAssignment>, CoordinatorError> {
        let coordinator = &self.inner;
        let claim = Claim {
            shard: shard.clone(),
            fence,
            owner: worker_id.to_string(),
        };
        let Some(Claimed { record, pending, epoch }) = self.claims_recorded.call(&coordinator.control, claim).await?
        else {
            // Cannot happen while fences come from etcd revisions; give the key back.
            tracing::error!(task = %shard.task, shard = shard.shard_id, fence, "fence did not increase; releasing");
            coordinator.leases.release(shard, fence).await?;
            return Ok(None);
        };
        let task = self.task(&shard.task)?;
        // The shard's epoch as the control database has it now (`tasks reinit` plans new
        // ones; an evolution changes its columns).
        let epoch = epoch.ok_or_else(|| CoordinatorError::EpochSuperseded {
            task: shard.task.clone(),
            epoch: shard.epoch,
            current: 0,
        })?;
        tracing::info!(
            task = %shard.task, shard = shard.shard_id, worker = worker_id, fence,
            cursor = %record.cursor.describe(), pending = pending.is_some(), "shard acquired"
        );
        count(&METRICS.leases_acquired, &[("task", &shard.task)], 1);
        Ok(Some(pb::ShardAssignment {
            task: Some(self.task_spec(task, &epoch)?),
            epoch: shard.epoch,
            shard_id: shard.shard_id,
            range: record.range,
            cursor: record.cursor.encode(),
            checkpoint_version: record.version,
            fence_token: record.fence,
            pending: pending.map(|p| pb::PendingBatch {
                batch_id: p.batch_id,
                manifest_path: p.manifest_path,
                lower: p.lower.encode(),
                upper: p.upper.encode(),
                row_count: p.row_count,
                content_hash: p.content_hash,
            }),
            snapshot_max_key: epoch.h0_max_key.as_ref().map(|v| v.to_string()).unwrap_or_default(),
            incremental_start: epoch.incremental_start.encode(),
        }))
    }
}

/// The most shards one acquire claims: one etcd transaction of a compare-and-put each (etcd
/// allows 128 operations in one by default).
const MOST_CLAIMS: usize = 32;

fn shard_key(task: &str, epoch: u64, shard_id: u32) -> ShardKey {
    ShardKey {
        task: task.to_string(),
        epoch,
        shard_id,
    }
}

impl CoordinatorService {
    async fn register_batch_in(
        &self,
        request: pb::RegisterBatchRequest,
    ) -> Result<Response<pb::RegisterBatchResponse>, Status> {
        let task = request.task.clone();
        let result = self.register_batch_checked(request).await;
        if let Err(error) = &result {
            count(
                &METRICS.commits_refused,
                &[("task", &task), ("reason", refusal(error))],
                1,
            );
        }
        Ok(Response::new(result?))
    }

    async fn register_batch_checked(
        &self,
        request: pb::RegisterBatchRequest,
    ) -> Result<pb::RegisterBatchResponse, CoordinatorError> {
        self.inner.leadership.require().await?;
        self.task(&request.task)?;
        let shard = shard_key(&request.task, request.epoch, request.shard_id);
        let lower = parse_request_cursor(&request.lower)?;
        let upper = parse_request_cursor(&request.upper)?;
        self.registrations
            .call(
                &self.inner.control,
                RegisterBatch {
                    shard,
                    fence: request.fence_token,
                    batch_id: request.batch_id,
                    lower,
                    upper,
                    row_count: request.row_count,
                    byte_size: request.byte_size,
                    content_hash: request.content_hash,
                    manifest_path: request.manifest_path,
                },
            )
            .await?;
        Ok(pb::RegisterBatchResponse {})
    }

    async fn commit_batch_in(
        &self,
        mut request: pb::CommitBatchRequest,
    ) -> Result<Response<pb::CommitBatchResponse>, Status> {
        self.inner.leadership.require().await?;
        self.task(&request.task)?;
        let shard = shard_key(&request.task, request.epoch, request.shard_id);
        let lower = parse_request_cursor(&request.lower)?;
        let upper = parse_request_cursor(&request.upper)?;
        let watermark = upper.incremental_time();
        let arrived = std::time::Instant::now();
        let result = self
            .commits
            .call(
                &self.inner.control,
                CommitBatch {
                    shard: shard.clone(),
                    fence: request.fence_token,
                    expected_version: request.expected_version,
                    batch_id: request.batch_id.clone(),
                    lower,
                    upper,
                    row_count: request.row_count,
                    empty: request.empty,
                    replayed: request.replayed,
                    late_row_lateness_micros: std::mem::take(&mut request.late_row_lateness_micros),
                },
            )
            .await;
        METRICS.commit_seconds.observe(arrived.elapsed().as_secs_f64());
        match result {
            Ok(committed) => {
                if let Some(micros) = watermark {
                    crate::metrics::record_watermark(&shard, micros);
                }
                if !committed.repeated && !request.empty {
                    let task = request.task.as_str();
                    count(&METRICS.rows_applied, &[("task", task)], request.row_count);
                    count(&METRICS.batches, &[("task", task)], 1);
                    if request.replayed {
                        count(&METRICS.replays, &[("task", task)], 1);
                    }
                }
                tidemark_common::crash::point("commit_before_reply");
                let shard_work = committed.work.is_some();
                let work = committed.work.unwrap_or_default();
                Ok(Response::new(pb::CommitBatchResponse {
                    new_version: committed.new_version,
                    release: committed.release_requested || work.release,
                    shard_work,
                    reconcile: work.reconcile,
                }))
            }
            Err(error) => {
                tracing::warn!(task = %shard.task, shard = shard.shard_id, worker = %request.worker_id, %error, "commit refused");
                count(
                    &METRICS.commits_refused,
                    &[("task", &request.task), ("reason", refusal(&error))],
                    1,
                );
                Err(error.into())
            }
        }
    }
}

#[tonic::async_trait]
impl WorkerService for CoordinatorService {
    async fn register_worker(
        &self,
        request: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        if request.worker_id.is_empty() {
            return Err(CoordinatorError::InvalidRequest("worker_id is empty".into()).into());
        }
        let lease_id = self.inner.leases.grant_worker_lease().await?;
        self.inner
            .control
            .register_worker_row(&request.worker_id, lease_id)
            .await?;
        let ttl = self.inner.leases.ttl();
        self.seen.noted(&request.worker_id);
        tracing::info!(worker = %request.worker_id, lease_id, "worker registered");
        Ok(Response::new(pb::RegisterWorkerResponse {
            lease_id,
            heartbeat_interval_ms: (ttl.as_millis() / 3) as u64,
            lease_ttl_ms: ttl.as_millis() as u64,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        // Any replica renews a lease, leader or not: leases live in etcd (or, in process, in
        // the one coordinator there is). A worker that moved on to a follower while the
        // leader is being replaced keeps its lease, and its shards, through the election
        // (an election takes up to a lease TTL, as long as the worker's lease lasts).
        let request = request.into_inner();
        let lease_alive = self.inner.leases.keep_alive(request.lease_id).await?;
        if !lease_alive {
            count(&METRICS.leases_lost, &[], 1);
            tracing::warn!(worker = %request.worker_id, lease_id = request.lease_id, "heartbeat for an expired lease");
        } else if self.inner.leadership.is_leader() {
            self.seen.heard(&request.worker_id, &self.inner.control).await;
        }
        Ok(Response::new(pb::HeartbeatResponse { lease_alive }))
    }

    async fn acquire_shard(
        &self,
        request: Request<pb::AcquireShardRequest>,
    ) -> Result<Response<pb::AcquireShardResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let mut assigned = self
            .acquire(&request.worker_id, request.lease_id, request.max_shards)
            .await?
            .into_iter();
        Ok(Response::new(pb::AcquireShardResponse {
            assignment: assigned.next(),
            more: assigned.collect(),
        }))
    }

    async fn register_batch(
        &self,
        request: Request<pb::RegisterBatchRequest>,
    ) -> Result<Response<pb::RegisterBatchResponse>, Status> {
        let span = tracing::info_span!(
            "coordinator.register_batch",
            task = %request.get_ref().task,
            shard = request.get_ref().shard_id,
            batch_id = %request.get_ref().batch_id,
        );
        join_trace(request.metadata(), &span);
        self.register_batch_in(request.into_inner()).instrument(span).await
    }

    async fn commit_batch(
        &self,
        request: Request<pb::CommitBatchRequest>,
    ) -> Result<Response<pb::CommitBatchResponse>, Status> {
        let span = tracing::info_span!(
            "coordinator.commit_batch",
            task = %request.get_ref().task,
            shard = request.get_ref().shard_id,
            batch_id = %request.get_ref().batch_id,
            rows = request.get_ref().row_count,
        );
        join_trace(request.metadata(), &span);
        self.commit_batch_in(request.into_inner()).instrument(span).await
    }
    async fn abandon_batch(
        &self,
        request: Request<pb::AbandonBatchRequest>,
    ) -> Result<Response<pb::AbandonBatchResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        self.task(&request.task)?;
        let shard = shard_key(&request.task, request.epoch, request.shard_id);
        let new_version = self
            .inner
            .control
            .abandon_batch(&shard, request.fence_token, &request.batch_id)
            .await?;
        tracing::warn!(
            task = %shard.task, shard = shard.shard_id, batch_id = %request.batch_id, reason = %request.reason,
            "staged batch abandoned"
        );
        Ok(Response::new(pb::AbandonBatchResponse { new_version }))
    }

    async fn next_shard_work(
        &self,
        request: Request<pb::ShardWorkRequest>,
    ) -> Result<Response<pb::ShardWorkResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let shard = shard_key(&request.task, request.epoch, request.shard_id);
        let work = self.shard_work_polls.call(&self.inner.control, shard).await?;
        Ok(Response::new(pb::ShardWorkResponse {
            reconcile: work.reconcile,
            release: work.release,
        }))
    }

    async fn report_reconcile(
        &self,
        request: Request<pb::ReportReconcileRequest>,
    ) -> Result<Response<pb::ReportReconcileResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let shard = shard_key(&request.task, request.epoch, request.shard_id);
        let result = ShardReconcile {
            ranges_compared: request.ranges_compared,
            rows_read: request.rows_read,
            keys_repaired: request.keys_repaired,
            extra_in_target: request.extra_in_target,
            duration_ms: request.duration_ms,
            keys_missed: request.keys_missed,
        };
        self.inner
            .control
            .report_reconcile(&shard, request.fence_token, request.run_id, &result)
            .await?;
        let task = [("task", shard.task.as_str())];
        count(&METRICS.reconcile_ranges, &task, result.ranges_compared);
        count(&METRICS.reconcile_rows_read, &task, result.rows_read);
        count(&METRICS.reconcile_keys_repaired, &task, result.keys_repaired);
        tracing::info!(
            task = %shard.task, shard = shard.shard_id, run_id = request.run_id, ranges = result.ranges_compared,
            rows_read = result.rows_read, repaired = result.keys_repaired, ms = result.duration_ms,
            "shard reconciled"
        );
        Ok(Response::new(pb::ReportReconcileResponse {}))
    }

    async fn release_shard(
        &self,
        request: Request<pb::ReleaseShardRequest>,
    ) -> Result<Response<pb::ReleaseShardResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let shard = shard_key(&request.task, request.epoch, request.shard_id);
        self.claims.releasing(&shard);
        self.inner.leases.release(&shard, request.fence_token).await?;
        if !request.failure.is_empty() {
            self.count_failure(&shard, &request).await?;
        }
        if !request.pause_reason.is_empty() {
            let reason = format!(
                "{}; fix the target, then `tidemark-coordinator tasks resume {}`",
                request.pause_reason, shard.task
            );
            let control = &self.inner.control;
            if control
                .pause_for_owner(&shard, request.fence_token, &request.worker_id, &reason)
                .await?
            {
                tracing::error!(task = %shard.task, shard = shard.shard_id, %reason, "task paused");
            } else {
                tracing::warn!(task = %shard.task, shard = shard.shard_id, reason = %request.pause_reason,
                    "pause request ignored: the task is paused already, was resumed since the shard was acquired, or the shard moved on");
            }
        }
        self.inner
            .control
            .release(&shard, request.fence_token, &request.worker_id)
            .await?;
        self.claims.released(shard.clone());
        tracing::info!(task = %shard.task, shard = shard.shard_id, worker = %request.worker_id, "shard released");
        Ok(Response::new(pb::ReleaseShardResponse {}))
    }
}

#[tonic::async_trait]
impl AdminService for CoordinatorService {
    async fn status(&self, _request: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let rows = self.inner.control.status().await?;
        let owners = self.inner.leases.owners().await?;
        let mut tasks = Vec::with_capacity(rows.len());
        for task in rows {
            let lateness = self.inner.control.lateness(&task.name, task.epoch).await?;
            let overlap = self
                .inner
                .tasks
                .get(&task.name)
                .map(|t| t.config.overlap)
                .unwrap_or_default();
            let mut warnings = Vec::new();
            if lateness.max_micros > (overlap.as_micros() as i64) / 2 {
                warnings.push(format!(
                    "late rows arrived up to {:.1}s late, more than half the overlap ({:.1}s): raise `overlap`",
                    lateness.max_micros as f64 / 1e6,
                    overlap.as_secs_f64()
                ));
            }
            let config = self.inner.tasks.get(&task.name).map(|t| &t.config);
            warnings.extend(task.source_hold.clone());
            if config.is_some_and(|c| !c.open_transaction_bound) {
                warnings.push(format!(
                    "open_transaction_bound = false: the late-commit guarantee is reduced to the overlap window ({:.1}s); \
                     a transaction committing later than that after its rows' cursor time is missed until a reconciliation",
                    overlap.as_secs_f64()
                ));
            }
            if let Some(DeletePolicy::TombstoneTable { retention }) = config.and_then(|c| c.delete_policy.as_ref()) {
                warnings.extend(retention_warning(&task.shards, *retention));
            }
            let dead_letters = match self.dead_letter_counts(&task.name).await {
                Ok(counts) => counts,
                Err(warning) => {
                    warnings.push(warning);
                    HashMap::new()
                }
            };
            let open_letters: u64 = ["INIT", "RETRY", "PROCESSING", "FAILED"]
                .iter()
                .filter_map(|s| dead_letters.get(*s))
                .sum();
            if open_letters > 0 {
                warnings.push(format!(
                    "{open_letters} dead letters not resolved: see `tidemark-coordinator dead-letters list --task {}`",
                    task.name
                ));
            }
            let last_reconcile = self.inner.control.last_reconcile(&task.name).await?;
            let estimated_rows = self
                .inner
                .control
                .estimated_rows(&task.name, task.epoch)
                .await?
                .unwrap_or(0);
            let snapshot_complete = task.shards.iter().all(|s| s.cursor.is_incremental());
            let watermark_micros = if snapshot_complete {
                task.shards.iter().filter_map(|s| s.cursor.incremental_time()).min()
            } else {
                None
            };
            let phase = if task.paused_reason.is_some() {
                "paused"
            } else if snapshot_complete {
                "incremental"
            } else {
                "snapshot"
            };
            let shards: Vec<pb::ShardStatus> = task
                .shards
                .iter()
                .map(|shard| {
                    let owner = owners.get(&shard_key(&task.name, task.epoch, shard.shard_id));
                    pb::ShardStatus {
                        id: shard.shard_id,
                        range: shard.range.clone(),
                        owner: owner.map(|(worker, _)| worker.clone()).unwrap_or_default(),
                        phase: shard.phase.to_lowercase(),
                        state: if task.paused_reason.is_some() {
                            "paused".into()
                        } else if owner.is_some() {
                            "owned".into()
                        } else {
                            "unowned".into()
                        },
                        rows_applied: shard.rows_applied,
                        cursor: shard.cursor.encode(),
                    }
                })
                .collect();
            let epochs = match self.inner.tasks.get(&task.name) {
                Some(prepared) => crate::epochs::status(&self.inner.control, prepared).await?,
                None => crate::epochs::EpochsView::default(),
            };
            warnings.extend(epochs.warnings);
            let ttl = self.inner.leases.ttl();
            let waiting = self
                .inner
                .capacity
                .waiting(&task.name, crate::capacity::waiting_after(ttl));
            if !waiting.is_empty() {
                let shards: Vec<String> = waiting.iter().map(|k| format!("{}/{}", k.epoch, k.shard_id)).collect();
                warnings.push(format!(
                    "{} shard(s) (epoch/shard {}) have had no worker for over {:.0}s: the workers' capacity \
                     (--max-shards each) is below the running epochs' shards, and their data lags; they take turns \
                     with caught-up shards (held {:.0}s at least): start workers or raise --max-shards",
                    waiting.len(),
                    shards.join(", "),
                    crate::capacity::waiting_after(ttl).as_secs_f64(),
                    crate::capacity::turn(ttl).as_secs_f64()
                ));
            }
            tasks.push(pb::TaskStatus {
                building: epochs.building,
                retained: epochs.retained,
                live_frozen: epochs.live_frozen,
                name: task.name,
                epoch: task.epoch,
                phase: phase.into(),
                snapshot_complete,
                rows_applied: task.shards.iter().map(|s| s.rows_applied).sum(),
                watermark_micros,
                shards,
                paused_reason: task.paused_reason.unwrap_or_default(),
                late_rows: lateness.count,
                late_p99_micros: lateness.p99_micros,
                late_max_micros: lateness.max_micros,
                warnings,
                overlap_ms: overlap.as_millis() as u64,
                contract: config.map(|c| contract_proto(&contract::derive(c))),
                last_reconcile,
                estimated_rows,
                dead_letters,
                mode: config.map(|c| c.mode.as_str().to_string()).unwrap_or_default(),
            });
        }
        Ok(Response::new(pb::StatusResponse {
            tasks,
            leader: self.inner.leadership.leader_address().await.unwrap_or_default(),
            served_by: self.inner.address.clone(),
        }))
    }

    async fn pause_task(&self, request: Request<pb::TaskRequest>) -> Result<Response<pb::TaskResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        self.task(&request.task)?;
        let reason = if request.reason.is_empty() {
            "paused by operator".to_string()
        } else {
            request.reason
        };
        if self.inner.control.pause_task(&request.task, &reason).await? {
            tracing::warn!(task = %request.task, %reason, "task paused");
        }
        Ok(Response::new(pb::TaskResponse {}))
    }

    async fn reconcile(&self, request: Request<pb::ReconcileRequest>) -> Result<Response<pb::ReconcileRun>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        if self.task(&request.task)?.config.mode.appends() {
            return Err(CoordinatorError::InvalidRequest(format!(
                "task {} is {}: it reads inserts by key and has no versions to reconcile",
                request.task,
                self.task(&request.task)?.config.mode.as_str()
            ))
            .into());
        }
        let since_micros = match request.window_ms {
            Some(ms) => Some(source_now_micros(&self.task(&request.task)?.config).await? - (ms as i64) * 1000),
            None => None,
        };
        let compare = if request.compare.is_empty() {
            self.task(&request.task)?.config.reconcile_compare
        } else {
            ReconcileCompare::parse(&request.compare).map_err(CoordinatorError::InvalidRequest)?
        };
        let config = &self.task(&request.task)?.config;
        if compare == ReconcileCompare::Content && !tidemark_common::config::hash_content(config) {
            let epoch = self
                .inner
                .control
                .current_epoch(&request.task)
                .await?
                .ok_or_else(|| CoordinatorError::UnknownTask(request.task.clone()))?;
            crate::planner::portable_content_columns(&epoch_columns(&request.task, &epoch)?).map_err(|e| {
                CoordinatorError::InvalidRequest(format!("task {}: content comparison: {e}", request.task))
            })?;
        }
        let run_id = self
            .inner
            .control
            .start_reconcile(&request.task, "operator", since_micros, compare)
            .await?;
        tracing::info!(task = %request.task, run_id, ?since_micros, "reconciliation requested");
        let run = self.inner.control.reconcile_run(run_id).await?;
        run.map(Response::new)
            .ok_or_else(|| Status::internal("reconciliation run vanished"))
    }

    async fn reconcile_status(
        &self,
        request: Request<pb::ReconcileStatusRequest>,
    ) -> Result<Response<pb::ReconcileRun>, Status> {
        let run_id = request.into_inner().run_id;
        self.inner
            .control
            .reconcile_run(run_id)
            .await?
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no reconciliation run {run_id}")))
    }

    async fn reinit_task(&self, request: Request<pb::TaskRequest>) -> Result<Response<pb::ReinitResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let task = self.task(&request.task)?;
        let reinit = reinit_task(&self.inner.control, &task.config).await?;
        // The validation (a full reconciliation of the new table) starts once the new epoch's
        // snapshot is done and its watermark passed it (see `epochs`).
        Ok(Response::new(pb::ReinitResponse {
            epoch: reinit.epoch,
            reconcile_run_id: 0,
            target_changes: reinit.target_changes,
            target_differences: Vec::new(),
        }))
    }

    async fn switch_task(&self, request: Request<pb::TaskRequest>) -> Result<Response<pb::EpochResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let message = crate::epochs::switch(&self.inner.control, self.task(&request.task)?).await?;
        Ok(Response::new(pb::EpochResponse { message }))
    }

    async fn validate_task(&self, request: Request<pb::TaskRequest>) -> Result<Response<pb::EpochResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let message = crate::epochs::validate(&self.inner.control, self.task(&request.task)?).await?;
        Ok(Response::new(pb::EpochResponse { message }))
    }

    async fn rollback_task(&self, request: Request<pb::TaskRequest>) -> Result<Response<pb::EpochResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let message = crate::epochs::rollback(&self.inner.control, self.task(&request.task)?).await?;
        Ok(Response::new(pb::EpochResponse { message }))
    }

    async fn list_shards(&self, request: Request<pb::ListShardsRequest>) -> Result<Response<pb::ShardList>, Status> {
        let request = request.into_inner();
        let task = Some(request.task.as_str()).filter(|t| !t.is_empty());
        if let Some(task) = task {
            self.task(task)?;
        }
        let owners = self.inner.leases.owners().await?;
        let shards = self
            .inner
            .control
            .list_shards(task)
            .await?
            .into_iter()
            .map(|shard| pb::ShardInfo {
                owner: owners.get(&shard.key).map(|(w, _)| w.clone()).unwrap_or_default(),
                task: shard.key.task.clone(),
                epoch: shard.key.epoch,
                shard_id: shard.key.shard_id,
                range: shard.range.encode(),
                phase: shard.phase.to_lowercase(),
                cursor: shard.cursor.encode(),
                rows_applied: shard.rows_applied,
                fence: shard.fence,
                pending_op: shard.pending_op.map(|op| op.describe()).unwrap_or_default(),
                reserved_for: shard.reserved_for.unwrap_or_default(),
            })
            .collect();
        Ok(Response::new(pb::ShardList { shards }))
    }

    async fn split_shard(
        &self,
        request: Request<pb::SplitShardRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        let task = self.task(&request.task)?;
        let at = Some(request.at).filter(|a| !a.is_empty());
        let message = request_split(&self.inner.control, task, request.shard_id, at).await?;
        tracing::info!(task = %request.task, %message, "operator request");
        Ok(Response::new(pb::OperationResponse { message }))
    }

    async fn merge_shards(
        &self,
        request: Request<pb::MergeShardsRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        self.task(&request.task)?;
        let message = request_merge(&self.inner.control, &request.task, request.shard_a, request.shard_b).await?;
        tracing::info!(task = %request.task, %message, "operator request");
        Ok(Response::new(pb::OperationResponse { message }))
    }

    async fn move_shard(
        &self,
        request: Request<pb::MoveShardRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        self.task(&request.task)?;
        let message = request_move(&self.inner.control, &request.task, request.shard_id, &request.worker).await?;
        tracing::info!(task = %request.task, %message, "operator request");
        Ok(Response::new(pb::OperationResponse { message }))
    }

    async fn list_workers(
        &self,
        _request: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::WorkerList>, Status> {
        let owners = self.inner.leases.owners().await?;
        let ttl = self.inner.leases.ttl().as_secs_f64();
        let workers = self
            .inner
            .control
            .list_workers()
            .await?
            .into_iter()
            .map(|w| {
                let mut shards: Vec<String> = owners
                    .iter()
                    .filter(|(_, (owner, _))| owner == &w.id)
                    .map(|(shard, _)| format!("{}/{}", shard.task, shard.shard_id))
                    .collect();
                shards.sort();
                pb::WorkerInfo {
                    alive: w.seconds_since_seen < ttl,
                    id: w.id,
                    lease_id: w.lease_id,
                    draining: w.draining,
                    seconds_since_seen: w.seconds_since_seen,
                    shards,
                }
            })
            .collect();
        Ok(Response::new(pb::WorkerList { workers }))
    }

    async fn drain_worker(
        &self,
        request: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        self.inner.leadership.require().await?;
        let worker = request.into_inner().worker;
        self.inner.control.drain_worker(&worker).await?;
        tracing::info!(%worker, "worker draining");
        Ok(Response::new(pb::OperationResponse {
            message: format!("worker {worker} is draining: it takes no new shard and gives back the ones it has"),
        }))
    }

    async fn list_dead_letters(
        &self,
        request: Request<pb::ListDeadLettersRequest>,
    ) -> Result<Response<pb::DeadLetterList>, Status> {
        let request = request.into_inner();
        let status = Some(request.status.to_uppercase()).filter(|s| !s.is_empty());
        let limit = if request.limit == 0 { 100 } else { request.limit };
        let (side, target) = self.target(&request.task)?;
        let letters = side
            .list_dead_letters(target, &request.task, status.as_deref(), limit)
            .await?;
        Ok(Response::new(pb::DeadLetterList { letters }))
    }

    async fn retry_dead_letters(
        &self,
        request: Request<pb::RetryDeadLettersRequest>,
    ) -> Result<Response<pb::RetryDeadLettersResponse>, Status> {
        let request = request.into_inner();
        let task = self.task(&request.task)?;
        let (side, target) = self.target(&request.task)?;
        let response = side
            .retry_dead_letters(&self.inner.control, target, task, &request.keys)
            .await?;
        Ok(Response::new(response))
    }

    async fn resolve_dead_letters(
        &self,
        request: Request<pb::ResolveDeadLettersRequest>,
    ) -> Result<Response<pb::ResolveDeadLettersResponse>, Status> {
        let request = request.into_inner();
        let (side, target) = self.target(&request.task)?;
        let resolved = side
            .resolve_dead_letters(target, &request.task, &request.keys, request.all_failed)
            .await?;
        tracing::info!(task = %request.task, resolved, "dead letters resolved by the operator");
        Ok(Response::new(pb::ResolveDeadLettersResponse { resolved }))
    }

    async fn purge_dead_letters(
        &self,
        request: Request<pb::PurgeDeadLettersRequest>,
    ) -> Result<Response<pb::PurgeDeadLettersResponse>, Status> {
        let request = request.into_inner();
        let older_than = std::time::Duration::from_millis(request.older_than_ms);
        let (side, target) = self.target(&request.task)?;
        let purged = side.purge_dead_letters(target, &request.task, older_than).await?;
        tracing::info!(task = %request.task, purged, "resolved dead letters purged by the operator");
        Ok(Response::new(pb::PurgeDeadLettersResponse { purged }))
    }

    async fn resume_task(&self, request: Request<pb::TaskRequest>) -> Result<Response<pb::TaskResponse>, Status> {
        self.inner.leadership.require().await?;
        let request = request.into_inner();
        self.task(&request.task)?;
        if let Some(reason) = self.inner.control.paused_reason(&request.task).await?
            && crate::watcher::requires_reinitialization(&reason)
        {
            // Resuming would carry the old epoch on past what it can no longer see.
            return Err(CoordinatorError::task_setup(
                &request.task,
                format!(
                    "cannot resume a task paused for `reinitialization required` ({reason}); run \
                     `tidemark-coordinator tasks reinit {}`",
                    request.task
                ),
            )
            .into());
        }
        self.inner.control.resume_task(&request.task).await?;
        self.claims.invalidate();
        tracing::info!(task = %request.task, "task resumed");
        Ok(Response::new(pb::TaskResponse {}))
    }
}

fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Warns once a shard's watermark is older than 80 % of the delete log's retention: past it,
/// the purge would remove deletes the shard has not read, and the task pauses with
/// `reinitialization required`.
fn retention_warning(shards: &[ShardStatusRow], retention: std::time::Duration) -> Option<String> {
    let now = now_micros();
    let oldest = shards.iter().filter_map(|s| s.cursor.incremental_time()).min()?;
    let age = now - oldest;
    let limit = retention.as_micros() as i64;
    (age * 5 > limit * 4).then(|| {
        format!(
            "the watermark is {:.0}s old, within 20 % of the delete log's retention ({:.0}s): past it the task \
             pauses with `reinitialization required`",
            age as f64 / 1e6,
            limit as f64 / 1e6
        )
    })
}

fn contract_proto(contract: &Contract) -> pb::Contract {
    pb::Contract {
        covers_inserts: contract.coverage.inserts,
        covers_updates: contract.coverage.updates,
        covers_deletes: contract.coverage.deletes,
        coverage: contract.coverage.how.clone(),
        boundary: contract.boundary.clone(),
        consistency: contract.consistency.clone(),
        retention: contract.retention.clone(),
        reinitialization: contract.reinitialization.clone(),
    }
}

/// A refusal's reason as a metric label.
fn refusal(error: &CoordinatorError) -> &'static str {
    match error {
        CoordinatorError::Fenced { .. } => "fenced",
        CoordinatorError::Paused { .. } => "paused",
        CoordinatorError::CheckpointConflict { .. } => "conflict",
        CoordinatorError::EpochSuperseded { .. } | CoordinatorError::ShardRetired { .. } => "superseded",
        CoordinatorError::NotLeader { .. } => "not_leader",
        _ => "other",
    }
}
