//! The worker's loop: register a lease, keep it alive, acquire shards up to a limit and run
//! each one's pipeline, release them when they end; on a stop request, finish the batches in
//! flight and release everything. Runs as its own process (`tidemark-worker`) or beside the
//! coordinator in `tidemark sync`.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use tidemark_proto::v1 as pb;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::client::CoordinatorClient;
use crate::error::WorkerError;
use crate::pipeline::ShardRun;
use crate::resources::ResourceCache;

/// What one worker is.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Coordinator replica addresses, comma-separated.
    pub coordinator: String,
    pub id: String,
    /// Most shards worked on at once.
    pub max_shards: u32,
}

/// Keeps the peak RSS independent of the run's length. glibc gives threads that allocate
/// their own malloc arena, up to 8 per core, and the staging store's blocking I/O threads
/// come and go all run long. Freed page buffers then sit fragmented in many arenas. Two arenas
/// and a fixed mmap threshold (below) keep it flat; `MALLOC_ARENA_MAX` and
/// `MALLOC_MMAP_THRESHOLD_` in the environment still override them.
pub fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; it runs before any other thread
        // exists.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // A page's buffers (a few MiB each) are mapped and unmapped whole. glibc would raise
        // its threshold after the first free and then carve them from the heap, where freed
        // pages fragment and stay resident: peak RSS would grow with the run's length.
        // SAFETY: as above.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        }
    }
}

/// A worker name: host name, process id and a random suffix.
pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "worker".into());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
    format!("{}-{}-{suffix}", host.trim(), std::process::id())
}

/// What a shard loop reports when it ends.
struct ShardEnded {
    /// Always sent: the release is fenced, so it is a no-op for a shard that moved on.
    release: pb::ReleaseShardRequest,
    result: Result<(), WorkerError>,
}

/// Works until `stop` turns true, then finishes the batches in flight, releases its shards
/// and returns.
pub async fn run(options: &WorkerOptions, stop_rx: watch::Receiver<bool>) -> Result<(), WorkerError> {
    let client = CoordinatorClient::new(&options.coordinator)?;
    let resources = ResourceCache::default();
    let worker_id = options.id.clone();

    while !*stop_rx.borrow() {
        let registration = client
            .register_worker(&worker_id)
            .await
            .map_err(|s| WorkerError::Coordinator(s.message().to_string()))?;
        let lease_id = registration.lease_id;
        tracing::info!(worker = %worker_id, lease_id, coordinator = %options.coordinator, "registered");
        let lease_lost = watch::channel(false);
        let heartbeat = tokio::spawn(keep_lease(
            client.clone(),
            worker_id.clone(),
            lease_id,
            Duration::from_millis(registration.heartbeat_interval_ms.max(100)),
            Duration::from_millis(registration.lease_ttl_ms),
            lease_lost.0,
        ));
        run_lease(
            options,
            &worker_id,
            lease_id,
            &client,
            &resources,
            stop_rx.clone(),
            lease_lost.1,
        )
        .await;
        heartbeat.abort();
    }
    tracing::info!(worker = %worker_id, "worker stopped");
    Ok(())
}

/// Heartbeats until the lease is reported expired or cannot be renewed within its TTL.
async fn keep_lease(
    client: CoordinatorClient,
    worker_id: String,
    lease_id: i64,
    interval: Duration,
    ttl: Duration,
    lost: watch::Sender<bool>,
) {
    let mut last_renewed = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(interval).await;
        match client.heartbeat(&worker_id, lease_id).await {
            Ok(true) => last_renewed = tokio::time::Instant::now(),
            Ok(false) => {
                tracing::warn!(lease_id, "lease expired; dropping all shards");
                let _ = lost.send(true);
                return;
            }
            Err(status) => {
                tracing::warn!(lease_id, code = ?status.code(), message = status.message(), "heartbeat failed");
                if last_renewed.elapsed() > ttl {
                    tracing::warn!(lease_id, "lease not renewed within its TTL; dropping all shards");
                    let _ = lost.send(true);
                    return;
                }
            }
        }
    }
}

/// Works shards under one lease until it is lost or a stop is requested.
async fn run_lease(
    options: &WorkerOptions,
    worker_id: &str,
    lease_id: i64,
    client: &CoordinatorClient,
    resources: &ResourceCache,
    stop: watch::Receiver<bool>,
    mut lease_lost: watch::Receiver<bool>,
) {
    let mut shards: JoinSet<ShardEnded> = JoinSet::new();
    // The first acquire goes at once and asks for as many shards as there is room for; after
    // a claim, the next one too (up to `max_shards`); after an empty answer or an error, a
    // second later.
    let mut idle_delay = Duration::ZERO;
    loop {
        if *stop.borrow() {
            // Let every shard finish its batch in flight, then release them.
            while let Some(ended) = shards.join_next().await {
                if let Ok(ended) = ended {
                    finish_shard(client, ended).await;
                }
            }
            return;
        }
        let can_take = shards.len() < options.max_shards as usize;
        tokio::select! {
            _ = lease_lost.changed() => {
                shards.abort_all();
                while shards.join_next().await.is_some() {}
                return;
            }
            Some(ended) = shards.join_next(), if !shards.is_empty() => {
                if let Ok(ended) = ended {
                    let failed = ended.result.is_err();
                    if !finish_shard(client, ended).await {
                        // The shard's ownership lives under this worker's lease, which the
                        // heartbeats keep alive: give the whole lease up (it expires within its
                        // TTL) rather than hold a shard nobody works on.
                        tracing::warn!(lease_id, "a shard could not be released; giving up the lease");
                        shards.abort_all();
                        while shards.join_next().await.is_some() {}
                        return;
                    }
                    if failed {
                        idle_delay = Duration::from_secs(1);
                    }
                }
            }
            _ = tokio::time::sleep(idle_delay), if can_take => {
                let room = options.max_shards - shards.len() as u32;
                match client.acquire_shards(worker_id, lease_id, room).await {
                    Ok(assignments) if !assignments.is_empty() => {
                        idle_delay = Duration::ZERO;
                        for assignment in assignments {
                            spawn_shard(&mut shards, worker_id, client, resources, options.max_shards, assignment, stop.clone()).await;
                        }
                    }
                    Ok(_) => idle_delay = Duration::from_secs(1),
                    Err(WorkerError::Fenced(message)) => {
                        tracing::warn!(%message, "lease refused; registering again");
                        shards.abort_all();
                        while shards.join_next().await.is_some() {}
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "acquire failed");
                        idle_delay = Duration::from_secs(1);
                    }
                }
            }
        }
    }
}

async fn spawn_shard(
    shards: &mut JoinSet<ShardEnded>,
    worker_id: &str,
    client: &CoordinatorClient,
    resources: &ResourceCache,
    max_shards: u32,
    assignment: pb::ShardAssignment,
    stop: watch::Receiver<bool>,
) {
    let release = pb::ReleaseShardRequest {
        worker_id: worker_id.to_string(),
        task: assignment.task.as_ref().map(|t| t.name.clone()).unwrap_or_default(),
        epoch: assignment.epoch,
        shard_id: assignment.shard_id,
        fence_token: assignment.fence_token,
        pause_reason: String::new(),
        failure: String::new(),
    };
    let prepared = match assignment.task.as_ref() {
        Some(spec) => match resources.for_task(spec, max_shards).await {
            Ok(task_resources) => ShardRun::from_assignment(worker_id, &assignment, task_resources),
            Err(error) => Err(error),
        },
        None => Err(WorkerError::Assignment("assignment without task".into())),
    };
    let client = client.clone();
    shards.spawn(async move {
        let mut run = match prepared {
            Ok(run) => run,
            Err(error) => {
                return ShardEnded {
                    release,
                    result: Err(error),
                };
            }
        };
        tracing::info!(task = %run.task.name, shard = run.shard_id, fence = run.fence, cursor = %run.cursor.describe(), "working on shard");
        // A panic in the loop must not leave the shard owned by a worker that no longer works
        // on it: it becomes an error, and the shard is released.
        let result = match AssertUnwindSafe(run.run(&client, assignment.pending, stop)).catch_unwind().await {
            Ok(result) => result,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown panic");
                Err(WorkerError::Data(format!("shard loop panicked: {message}")))
            }
        };
        // Release even when fenced or paused: the release is itself fenced (etcd compares the
        // key's create revision, the control database the fence and owner), so it is a no-op
        // for a shard that moved on, and it frees a paused task's shard for after its resume.
        ShardEnded { release, result }
    });
}

/// Logs how a shard ended and releases it; false when the release failed.
async fn finish_shard(client: &CoordinatorClient, ended: ShardEnded) -> bool {
    let release = &ended.release;
    match &ended.result {
        Ok(()) => tracing::info!(task = %release.task, shard = release.shard_id, "shard stopped"),
        Err(WorkerError::Fenced(reason)) => {
            crate::metrics::count(&crate::metrics::METRICS.shards_lost, &release.task, 1);
            tracing::warn!(task = %release.task, shard = release.shard_id, %reason, "shard lost; releasing it")
        }
        Err(error) => {
            tracing::warn!(task = %release.task, shard = release.shard_id, %error, "shard ended with an error; releasing it")
        }
    }
    let mut release = release.clone();
    match &ended.result {
        Err(error @ WorkerError::TargetRejects(_)) => release.pause_reason = error.to_string(),
        Err(error) if error.is_persistent() => release.failure = error.to_string(),
        _ => {}
    }
    match client.release_shard(release.clone()).await {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(task = %release.task, shard = release.shard_id, %error, "release failed");
            false
        }
    }
}
