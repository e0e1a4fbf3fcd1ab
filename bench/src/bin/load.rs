//! `cargo run --release -p tidemark-bench --bin load -- --workers 1000 --shards 10000`
//!
//! The coordinator under a large worker pool (issue 20). One real coordinator, etcd and
//! control database; a source table with enough keys for `--shards` integer ranges; and
//! `--workers` simulated workers in this process, each on its own gRPC connection, running the
//! real protocol: register, heartbeat, acquire (every 50 ms while shards come, every second
//! when none is free), and per held shard one batch per `--batch-interval`: RegisterBatch,
//! CommitBatch (the checkpoint CAS), NextShardWork. Only the source reads and target writes
//! are skipped. Halfway through, `--vanish` of the workers stop at once without releasing
//! anything; the harness times until every shard they held is owned again, then lets them
//! commit once more as zombies with their old fences (each such commit must be refused).
//!
//! Prints RPC latencies (p50/p99/max), commits per second, coordinator CPU and RSS, etcd's
//! requests per second, keys and CPU, the control database's rows and size, `status`
//! latency and the reacquisition time.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use sqlx::Row;
use tidemark_common::cursor::Cursor;
use tidemark_proto::v1 as pb;
use tidemark_proto::v1::worker_service_client::WorkerServiceClient;
use tidemark_tests::usage::{box_ticks, process_usage};
use tidemark_tests::{Cluster, KeyKind, TaskSettings, create_items};
use tokio::sync::Mutex;
use tonic::transport::Channel;

#[derive(Parser, Clone)]
#[command(about = "Tidemark's coordinator under many simulated workers over real gRPC")]
struct Args {
    #[arg(long, default_value_t = 100)]
    workers: usize,
    #[arg(long, default_value_t = 1000)]
    shards: u32,
    /// Shards one worker holds at most (the worker's `--max-shards`). 0: a quarter more than
    /// an even share, so that the survivors have room for a vanished worker's shards.
    #[arg(long, default_value_t = 0)]
    max_shards: usize,
    /// Ask for one shard per acquire, as workers before multi-shard acquires did (by default
    /// a worker asks for as many as it has room for).
    #[arg(long)]
    one_shard_acquires: bool,
    /// Pause between one shard's batches (its commit and its next registration).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    batch_interval: Duration,
    /// Measured time, after every shard is owned or the workers hold all they may.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: Duration,
    #[arg(long, default_value = "10s")]
    lease_ttl: String,
    /// Share of the workers that vanish halfway through (no release, no heartbeat).
    #[arg(long, default_value_t = 0.1)]
    vanish: f64,
    /// Control history already there when the run starts: this many committed batches and as
    /// many checkpoint-history rows, their commit times spread evenly over the 14 days
    /// before, so that half are past the default `history_retention` of 7 days and the
    /// coordinator's first pruning pass (30 s after its start) deletes them during the run.
    #[arg(long, default_value_t = 0)]
    history: u64,
    /// After the measured run, kill -9 the leader with a standby replica running (started
    /// with the leader, on the same etcd and control database; the workers reach both
    /// through one proxy, switched to the standby at the kill, as a worker given both
    /// addresses moves on), and time until commits come back, and back to their rate.
    #[arg(long)]
    failover: bool,
}

/// A call retried while the coordinator is unavailable (no leader, or not reachable), as a
/// real worker retries it: every call is safe to repeat. Gives up after 120 s.
async fn retried<T, F, Fut>(shared: &Shared, mut call: F) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match call().await {
            Err(status) if status.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                shared.counters.unavailable.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            other => return other,
        }
    }
}

/// Fills the control database with `rows` committed batches and history rows shaped as the
/// protocol writes them (a real shard's cursor; ids, hashes and manifest paths of the real
/// lengths), 100,000 rows per statement.
async fn prefill_history(control: &sqlx::PgPool, rows: u64) {
    let chunk = 100_000u64;
    let mut from = 0u64;
    while from < rows {
        let to = (from + chunk).min(rows);
        sqlx::query(
            "WITH c AS (SELECT task, epoch, shard_id, cursor FROM checkpoints ORDER BY shard_id LIMIT 1), \
             g AS (SELECT n, md5('prefill-' || n) AS id, \
                   now() - make_interval(secs => 14 * 86400.0 * (1 - n::float8 / $3)) AS at \
                   FROM generate_series($1::bigint, $2::bigint - 1) n), \
             b AS (INSERT INTO batches (batch_id, task, epoch, shard_id, lower, upper, row_count, byte_size, \
                     content_hash, manifest_path, fence, state, staged_at, committed_at) \
                   SELECT g.id, c.task, c.epoch, c.shard_id, c.cursor, c.cursor, 5000, 412000, \
                     'sha256:' || encode(sha256(g.id::bytea), 'hex'), \
                     c.task || '/epoch-' || c.epoch || '/shard-' || c.shard_id || '/' || g.id || '/manifest-' \
                       || encode(sha256(g.id::bytea), 'hex') || '-fence-12.json', \
                     12, 'COMMITTED', g.at, g.at FROM g, c) \
             INSERT INTO checkpoint_history (task, epoch, shard_id, version, fence, cursor, batch_id, row_count, committed_at) \
             SELECT c.task, c.epoch, c.shard_id, g.n, 12, c.cursor, g.id, 5000, g.at FROM g, c",
        )
        .bind(from as i64)
        .bind(to as i64)
        .bind(rows as f64)
        .execute(control)
        .await
        .unwrap();
        from = to;
    }
}

/// The control database's size and its history tables' rows and sizes.
async fn control_size(control: &sqlx::PgPool) -> String {
    let row = sqlx::query(
        "SELECT pg_database_size(current_database()), (SELECT count(*) FROM checkpoints), \
         (SELECT count(*) FROM checkpoint_history), pg_total_relation_size('checkpoint_history'), \
         (SELECT count(*) FROM batches), pg_total_relation_size('batches')",
    )
    .fetch_one(control)
    .await
    .unwrap();
    let mib = |i: usize| row.get::<i64, _>(i) as f64 / 1048576.0;
    format!(
        "{:.1} MiB; checkpoints {}, checkpoint_history {} ({:.1} MiB), batches {} ({:.1} MiB)",
        mib(0),
        row.get::<i64, _>(1),
        row.get::<i64, _>(2),
        mib(3),
        row.get::<i64, _>(4),
        mib(5)
    )
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = number.parse().map_err(|_| format!("bad duration {text:?}"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" | "" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("bad duration {text:?}: use ms, s or m")),
    }
}

/// Latencies per RPC: (when the call ended, microseconds it took).
#[derive(Default)]
struct Latencies(Mutex<HashMap<&'static str, Vec<(Instant, u32)>>>);

impl Latencies {
    async fn record(&self, rpc: &'static str, started: Instant) {
        let micros = started.elapsed().as_micros().min(u32::MAX as u128) as u32;
        self.0
            .lock()
            .await
            .entry(rpc)
            .or_default()
            .push((Instant::now(), micros));
    }
}

/// The seconds of the measured time (from `start`) whose slowest calls were slowest: (second,
/// calls ended in it, their p99 and max), the `worst` of them by max, in time order.
fn slowest_seconds(calls: &[(Instant, u32)], start: Instant, worst: usize) -> Vec<(u64, usize, f64, f64)> {
    let mut by_second: std::collections::BTreeMap<u64, Vec<u32>> = std::collections::BTreeMap::new();
    for (at, micros) in calls {
        by_second
            .entry(at.saturating_duration_since(start).as_secs())
            .or_default()
            .push(*micros);
    }
    let mut seconds: Vec<(u64, usize, f64, f64)> = by_second
        .into_iter()
        .map(|(second, mut values)| {
            values.sort_unstable();
            (
                second,
                values.len(),
                percentile(&values, 0.99),
                percentile(&values, 1.0),
            )
        })
        .collect();
    seconds.sort_by(|a, b| b.3.total_cmp(&a.3));
    seconds.truncate(worst);
    seconds.sort_by_key(|s| s.0);
    seconds
}

#[derive(Default)]
struct Counters {
    commits: AtomicU64,
    errors: AtomicU64,
    /// RegisterWorker calls that failed and were tried again.
    register_retries: AtomicU64,
    zombie_accepted: AtomicU64,
    zombie_refused: AtomicU64,
    /// Commits, measured or not (the failover is timed after the measured run).
    all_commits: AtomicU64,
    /// Calls answered `Unavailable` and tried again.
    unavailable: AtomicU64,
}

/// A shard: (task, epoch, shard id). Shard ids repeat across tasks (more than 4,096 shards are
/// spread over several).
type ShardRef = (String, u64, u32);

/// Who holds which shard since when, as the simulated workers saw their acquisitions.
type Owners = Mutex<HashMap<ShardRef, (usize, Instant)>>;

struct Shared {
    latencies: Latencies,
    counters: Counters,
    /// Refused calls by RPC, status code and message (digits masked, so that one reason
    /// counts as one line whatever its shard or version).
    refusals: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
    owners: Owners,
    measuring: AtomicBool,
}

impl Shared {
    fn refuse(&self, rpc: &str, status: &tonic::Status) {
        let message: String = status
            .message()
            .chars()
            .map(|c| if c.is_ascii_digit() { '#' } else { c })
            .take(100)
            .collect();
        let reason = format!("{rpc}: {:?}: {message}", status.code());
        *self.refusals.lock().unwrap().entry(reason).or_default() += 1;
    }

    fn refused(&self) -> u64 {
        self.refusals.lock().unwrap().values().sum()
    }

    /// The refusals since `since` (a copy of the map taken earlier), most frequent first.
    fn refusals_since(&self, since: &std::collections::BTreeMap<String, u64>) -> String {
        let mut lines: Vec<(u64, String)> = self
            .refusals
            .lock()
            .unwrap()
            .iter()
            .map(|(reason, n)| (n - since.get(reason).copied().unwrap_or(0), reason.clone()))
            .filter(|(n, _)| *n > 0)
            .collect();
        lines.sort_by(|a, b| b.cmp(a));
        lines.iter().map(|(n, reason)| format!("\n  {n} × {reason}")).collect()
    }
}

struct Held {
    assignment: pb::ShardAssignment,
    cursor: String,
    version: u64,
}

async fn worker(
    number: usize,
    address: String,
    args: Args,
    shared: Arc<Shared>,
    vanish: tokio::sync::watch::Receiver<bool>,
    vanishes: bool,
    mut wake: tokio::sync::watch::Receiver<bool>,
) {
    let channel = Channel::from_shared(address).unwrap().connect_lazy();
    let mut client = WorkerServiceClient::new(channel);
    let worker_id = format!("sim-{number}");
    let started = Instant::now();
    // Retried as a real worker does: a thousand connecting at once get some resets.
    let mut tries = 0;
    let registration = loop {
        tries += 1;
        match client
            .register_worker(pb::RegisterWorkerRequest {
                worker_id: worker_id.clone(),
            })
            .await
        {
            Ok(r) => break r.into_inner(),
            Err(_) if tries < 10 => {
                shared.counters.register_retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200 * tries)).await;
            }
            Err(status) => {
                eprintln!("{worker_id}: register failed {tries} times: {status}");
                shared.counters.errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    };
    shared.latencies.record("register_worker", started).await;
    let lease_id = registration.lease_id;
    let heartbeat = {
        let mut client = client.clone();
        let shared = shared.clone();
        let worker_id = worker_id.clone();
        let interval = Duration::from_millis(registration.heartbeat_interval_ms.max(100));
        let vanish = vanish.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                if vanishes && *vanish.borrow() {
                    return;
                }
                let started = Instant::now();
                let request = pb::HeartbeatRequest {
                    worker_id: worker_id.clone(),
                    lease_id,
                };
                match client.heartbeat(request).await {
                    Ok(r) if r.get_ref().lease_alive => shared.latencies.record("heartbeat", started).await,
                    Ok(_) => {
                        eprintln!("{worker_id}: lease lost");
                        return;
                    }
                    Err(status) => {
                        if shared.counters.errors.fetch_add(1, Ordering::Relaxed) < 5 {
                            eprintln!(
                                "{worker_id}: heartbeat failed: {:?} {}",
                                status.code(),
                                status.message()
                            );
                        }
                    }
                }
            }
        })
    };
    let mut shards: tokio::task::JoinSet<Option<Held>> = tokio::task::JoinSet::new();
    let mut idle = Duration::from_millis(50);
    loop {
        if vanishes && *vanish.borrow() {
            break;
        }
        if shards.len() < args.max_shards {
            tokio::time::sleep(idle).await;
            let started = Instant::now();
            let room = if args.one_shard_acquires {
                1
            } else {
                args.max_shards - shards.len()
            };
            match client
                .acquire_shard(pb::AcquireShardRequest {
                    worker_id: worker_id.clone(),
                    lease_id,
                    max_shards: room as u32,
                })
                .await
            {
                Ok(response) => {
                    shared.latencies.record("acquire_shard", started).await;
                    let assignments = response.into_inner().assignments();
                    idle = if assignments.is_empty() {
                        Duration::from_secs(1)
                    } else {
                        Duration::from_millis(50)
                    };
                    for assignment in assignments {
                        shared
                            .owners
                            .lock()
                            .await
                            .insert(shard_ref(&assignment), (number, Instant::now()));
                        shards.spawn(run_shard(
                            client.clone(),
                            worker_id.clone(),
                            assignment,
                            args.batch_interval,
                            shared.clone(),
                            if vanishes { Some(vanish.clone()) } else { None },
                        ));
                    }
                }
                Err(status) => {
                    if shared.counters.errors.fetch_add(1, Ordering::Relaxed) < 5 {
                        eprintln!("{worker_id}: acquire failed: {:?} {}", status.code(), status.message());
                    }
                    idle = Duration::from_secs(1);
                }
            }
        } else if shards.join_next().await.is_none() {
            break;
        }
        while let Some(ended) = shards.try_join_next() {
            let _ = ended;
        }
    }
    if !vanishes {
        return;
    }
    // Vanished: no heartbeat, no release. Once live workers own its shards again, every
    // shard it held tries one more commit with its old fence, as a paused process would on
    // waking. (Before anyone else claims the shard the old fence is still the shard's
    // newest, and its commit would be accepted: fencing orders owners, it does not time them.)
    heartbeat.abort();
    let mut held = Vec::new();
    while let Some(ended) = shards.join_next().await {
        if let Ok(Some(h)) = ended {
            held.push(h);
        }
    }
    let _ = wake.wait_for(|woken| *woken).await;
    for h in held {
        let (register, commit) = batch(&worker_id, &h.assignment, &h.cursor, h.version);
        let accepted = client.register_batch(register).await.is_ok() && client.commit_batch(commit).await.is_ok();
        let counter = if accepted {
            &shared.counters.zombie_accepted
        } else {
            &shared.counters.zombie_refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

fn shard_ref(assignment: &pb::ShardAssignment) -> ShardRef {
    let task = assignment.task.as_ref().map(|t| t.name.clone()).unwrap_or_default();
    (task, assignment.epoch, assignment.shard_id)
}

/// One batch's RegisterBatch and CommitBatch from `cursor` at `version`: the next position
/// is an incremental cursor a little before now, as a caught-up shard commits.
fn batch(
    worker_id: &str,
    assignment: &pb::ShardAssignment,
    cursor: &str,
    version: u64,
) -> (pb::RegisterBatchRequest, pb::CommitBatchRequest) {
    let task = assignment.task.as_ref().map(|t| t.name.clone()).unwrap_or_default();
    let now = chrono::Utc::now().timestamp_micros() - 2_000_000;
    let upper = Cursor::incremental_at(assignment.epoch, now).encode();
    let batch_id = uuid::Uuid::new_v4().simple().to_string();
    let register = pb::RegisterBatchRequest {
        worker_id: worker_id.to_string(),
        task: task.clone(),
        epoch: assignment.epoch,
        shard_id: assignment.shard_id,
        fence_token: assignment.fence_token,
        batch_id: batch_id.clone(),
        lower: cursor.to_string(),
        upper: upper.clone(),
        row_count: 1000,
        byte_size: 100_000,
        content_hash: format!("sha256:{batch_id}{batch_id}"),
        manifest_path: format!("load/{task}/{}/{batch_id}.manifest.json", assignment.shard_id),
    };
    let commit = pb::CommitBatchRequest {
        worker_id: worker_id.to_string(),
        task,
        epoch: assignment.epoch,
        shard_id: assignment.shard_id,
        fence_token: assignment.fence_token,
        expected_version: version,
        batch_id,
        lower: cursor.to_string(),
        upper,
        row_count: 1000,
        empty: false,
        replayed: false,
        late_row_lateness_micros: Vec::new(),
    };
    (register, commit)
}

/// A fraction in [0, 1) fixed per shard, spread evenly over the shards (a hash of its task and
/// id).
fn phase(task: &str, shard_id: u32) -> f64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (task, shard_id).hash(&mut hasher);
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// One held shard: a pending batch first (committed as replayed), then a batch per interval
/// until the coordinator refuses or asks for the shard back. Returns the shard as last held
/// when its worker vanished.
async fn run_shard(
    mut client: WorkerServiceClient<Channel>,
    worker_id: String,
    assignment: pb::ShardAssignment,
    interval: Duration,
    shared: Arc<Shared>,
    vanish: Option<tokio::sync::watch::Receiver<bool>>,
) -> Option<Held> {
    let mut cursor = assignment.cursor.clone();
    let mut version = assignment.checkpoint_version;
    let task = assignment.task.as_ref().map(|t| t.name.clone()).unwrap_or_default();
    if let Some(pending) = &assignment.pending {
        let commit = pb::CommitBatchRequest {
            worker_id: worker_id.clone(),
            task: task.clone(),
            epoch: assignment.epoch,
            shard_id: assignment.shard_id,
            fence_token: assignment.fence_token,
            expected_version: version,
            batch_id: pending.batch_id.clone(),
            lower: cursor.clone(),
            upper: pending.upper.clone(),
            row_count: pending.row_count,
            empty: false,
            replayed: true,
            late_row_lateness_micros: Vec::new(),
        };
        match client.commit_batch(commit).await {
            Ok(r) => {
                version = r.get_ref().new_version;
                cursor = pending.upper.clone();
            }
            Err(status) => {
                shared.refuse("commit_batch (replay)", &status);
                return None;
            }
        }
    }
    // A pool in its steady state holds shards at every phase of their interval: each shard's
    // first batch comes at its own fraction of it, not all one interval after the ramp's
    // acquires (which bunched a 120 s interval's commits into the ramp's 20–50 s).
    let mut wait = interval.mul_f64(phase(&task, assignment.shard_id));
    loop {
        tokio::time::sleep(wait).await;
        wait = interval;
        if vanish.as_ref().is_some_and(|v| *v.borrow()) {
            return Some(Held {
                assignment,
                cursor,
                version,
            });
        }
        let (register, commit) = batch(&worker_id, &assignment, &cursor, version);
        let next = commit.upper.clone();
        let started = Instant::now();
        if let Err(status) = retried(&shared, || {
            let (mut client, register) = (client.clone(), register.clone());
            async move { client.register_batch(register).await }
        })
        .await
        {
            shared.refuse("register_batch", &status);
            return None;
        }
        shared.latencies.record("register_batch", started).await;
        let started = Instant::now();
        let response = match retried(&shared, || {
            let (mut client, commit) = (client.clone(), commit.clone());
            async move { client.commit_batch(commit).await }
        })
        .await
        {
            Ok(r) => r.into_inner(),
            Err(status) => {
                shared.refuse("commit_batch", &status);
                return None;
            }
        };
        shared.latencies.record("commit_batch", started).await;
        shared.counters.all_commits.fetch_add(1, Ordering::Relaxed);
        if shared.measuring.load(Ordering::Relaxed) {
            shared.counters.commits.fetch_add(1, Ordering::Relaxed);
        }
        version = response.new_version;
        cursor = next;
        // As a worker does: the commit's answer stands for the poll when it says so.
        let release = if response.shard_work {
            response.release
        } else {
            let started = Instant::now();
            let work = client
                .next_shard_work(pb::ShardWorkRequest {
                    worker_id: worker_id.clone(),
                    task: task.clone(),
                    epoch: assignment.epoch,
                    shard_id: assignment.shard_id,
                    fence_token: assignment.fence_token,
                })
                .await;
            shared.latencies.record("next_shard_work", started).await;
            response.release || work.is_ok_and(|w| w.get_ref().release)
        };
        if release {
            let _ = client
                .release_shard(pb::ReleaseShardRequest {
                    worker_id: worker_id.clone(),
                    task: task.clone(),
                    epoch: assignment.epoch,
                    shard_id: assignment.shard_id,
                    fence_token: assignment.fence_token,
                    pause_reason: String::new(),
                    failure: String::new(),
                })
                .await;
            return None;
        }
    }
}

/// The server's `pg_stat_wal`: records, bytes, writes, syncs, write and sync milliseconds
/// (the times do not move unless `track_wal_io_timing` is on).
async fn wal_stats(pool: &sqlx::PgPool) -> [f64; 6] {
    let row: (f64, f64, f64, f64, f64, f64) = sqlx::query_as(
        "SELECT wal_records::float8, wal_bytes::float8, wal_write::float8, wal_sync::float8, \
         wal_write_time, wal_sync_time FROM pg_stat_wal",
    )
    .fetch_one(pool)
    .await
    .unwrap_or_default();
    [row.0, row.1, row.2, row.3, row.4, row.5]
}

/// The text of an HTTP `/metrics` endpoint at `host:port` (empty when it does not answer).
async fn scrape(host: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut text = String::new();
    if let Ok(mut stream) = tokio::net::TcpStream::connect(host).await {
        let request = format!("GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n");
        if stream.write_all(request.as_bytes()).await.is_ok() {
            let _ = stream.read_to_string(&mut text).await;
        }
    }
    text
}

/// The sum of every sample of metric `name` (all label sets) in scraped `text`.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split([' ', '{']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The value of one series, named with its labels as the scrape writes them
/// (`name{call="commit_batch"}`); 0 when it is not there.
fn labelled_sum(text: &str, series: &str) -> f64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
        .sum()
}

/// A histogram's cumulative buckets, `(le, count)` in order, from a scrape; `labels` are
/// the series' own (`call="commit_batch"`), or empty. prometheus-client writes `le` first:
/// `name_bucket{le="0.001",call="commit_batch"} 3`.
fn buckets(text: &str, name: &str, labels: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    let tail = if labels.is_empty() {
        "}".to_string()
    } else {
        format!(",{labels}}}")
    };
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(&prefix)?;
            let (le, rest) = rest.split_once('"')?;
            let count = rest.strip_prefix(tail.as_str())?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The upper bound of the bucket that holds the `q` quantile of what was observed between
/// two scrapes; `None` when nothing was.
fn bucket_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let count = |buckets: &[(f64, f64)], le: f64| buckets.iter().find(|(l, _)| *l == le).map_or(0.0, |(_, c)| *c);
    let total = after.last().map(|(le, c)| c - count(before, *le))?;
    if total <= 0.0 {
        return None;
    }
    after
        .iter()
        .find(|(le, c)| c - count(before, *le) >= q * total)
        .map(|(le, _)| *le)
}

/// etcd's own metrics: (gRPC requests handled, keys, CPU seconds, raft proposals applied,
/// applies slower than 100 ms).
async fn etcd_metrics(endpoint: &str) -> (f64, f64, f64, f64, f64) {
    let text = scrape(endpoint.trim_start_matches("http://")).await;
    (
        metric_sum(&text, "grpc_server_handled_total"),
        metric_sum(&text, "etcd_debugging_mvcc_keys_total"),
        metric_sum(&text, "process_cpu_seconds_total"),
        metric_sum(&text, "etcd_server_proposals_applied_total"),
        metric_sum(&text, "etcd_server_slow_apply_total"),
    )
}

/// How late this process's runtime ran a task whose 50 ms sleep ended, in microseconds, until
/// `until`: the harness's own share of the latencies it measures on its side.
async fn runtime_delay_until(until: Instant) -> Vec<u32> {
    const PERIOD: Duration = Duration::from_millis(50);
    let mut late = Vec::new();
    while Instant::now() < until {
        let asked = Instant::now();
        tokio::time::sleep(PERIOD).await;
        late.push(asked.elapsed().saturating_sub(PERIOD).as_micros() as u32);
    }
    late
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index] as f64 / 1000.0
}

#[tokio::main]
async fn main() {
    let mut args = Args::parse();
    if args.max_shards == 0 {
        args.max_shards = (args.shards as usize * 5).div_ceil(args.workers * 4).max(1);
    }
    let mut cluster = Cluster::new("load").await;
    // Enough keys for every shard to own a range of its own.
    create_items(&cluster.source, KeyKind::Bigint, i64::from(args.shards) * 2).await;
    // A task has at most 4,096 shards: more are spread over tasks on the same source table,
    // each into a target table of its own.
    let tasks = args.shards.div_ceil(4096);
    let per_task = args.shards.div_ceil(tasks);
    let extra: String = (1..tasks)
        .map(|n| {
            format!(
                "\n[[tasks]]\nname = \"items{n}\"\nsource = \"{source}\"\nsource_table = \"public.items\"\n\
                 target = \"{target}\"\ntarget_table = \"public.items{n}\"\nkey = [\"id\"]\n\
                 cursor_column = \"updated_at\"\nshards = {shards}\n",
                source = cluster.source.url,
                target = cluster.target.url,
                shards = (args.shards - n * per_task).min(per_task),
            )
        })
        .collect();
    let coordinator_metrics = format!("127.0.0.1:{}", tidemark_tests::free_port());
    let settings = TaskSettings {
        shards: per_task,
        lease_ttl: Box::leak(args.lease_ttl.clone().into_boxed_str()),
        extra,
        coordinator_extra: format!("metrics_listen = \"{coordinator_metrics}\""),
        ..TaskSettings::default()
    };
    let planning = Instant::now();
    cluster.start(&settings).await;
    println!(
        "coordinator up with {} shards in {:.1} s; {} workers, at most {} shards each, a batch per {:?} per shard",
        args.shards,
        planning.elapsed().as_secs_f64(),
        args.workers,
        args.max_shards,
        args.batch_interval
    );
    if args.history > 0 {
        let filling = Instant::now();
        prefill_history(&cluster.control.pool, args.history).await;
        println!(
            "history: {} batches and as many checkpoint-history rows written in {:.1} s; control database {}",
            args.history,
            filling.elapsed().as_secs_f64(),
            control_size(&cluster.control.pool).await
        );
        // Started again, so that its first pruning pass (30 s after its start) comes during
        // the run and not during the filling.
        let config = cluster.write_config(&settings);
        cluster.launch_coordinator(&config, &[]).await;
    }
    // The standby replica and the proxy in front of both (with --failover).
    let standby = if args.failover {
        let config = cluster.dir.0.join("tidemark.toml");
        let text = std::fs::read_to_string(&config).unwrap();
        let leader_listen = cluster.address.trim_start_matches("http://").to_string();
        let standby_listen = format!("127.0.0.1:{}", tidemark_tests::free_port());
        let text: String = text
            .replace(
                &format!("listen = \"{leader_listen}\""),
                &format!("listen = \"{standby_listen}\""),
            )
            .lines()
            .filter(|l| !l.starts_with("metrics_listen"))
            .map(|l| format!("{l}\n"))
            .collect();
        let standby_config = cluster.dir.0.join("standby.toml");
        std::fs::write(&standby_config, text).unwrap();
        let process = tidemark_tests::Process::spawn(
            "coordinator-standby",
            &tidemark_tests::binary("tidemark-coordinator"),
            &["serve", "--config", standby_config.to_str().unwrap()],
            &[],
            &cluster.dir.0,
        );
        process
            .wait_for_log("coordinator serving", Duration::from_secs(60))
            .await;
        let proxy = tidemark_tests::faults::FaultProxy::start(leader_listen.parse().unwrap()).await;
        println!(
            "failover: standby replica on {standby_listen}; workers reach the leader through {}",
            proxy.address
        );
        Some((process, standby_listen, proxy))
    } else {
        None
    };
    let worker_address = standby
        .as_ref()
        .map_or(cluster.address.clone(), |(_, _, proxy)| proxy.address.clone());
    let coordinator_pid = cluster.coordinator.as_ref().unwrap().child.id();
    let shared = Arc::new(Shared {
        latencies: Latencies::default(),
        counters: Counters::default(),
        refusals: Default::default(),
        owners: Mutex::new(HashMap::new()),
        measuring: AtomicBool::new(false),
    });
    let (vanish_tx, vanish_rx) = tokio::sync::watch::channel(false);
    let (wake_tx, wake_rx) = tokio::sync::watch::channel(false);
    let vanishing = ((args.workers as f64) * args.vanish).round() as usize;
    let mut workers = tokio::task::JoinSet::new();
    let ramp = Instant::now();
    for number in 0..args.workers {
        workers.spawn(worker(
            number,
            worker_address.clone(),
            args.clone(),
            shared.clone(),
            vanish_rx.clone(),
            number < vanishing,
            wake_rx.clone(),
        ));
    }
    // Ramp: until every shard is owned or every worker holds its maximum.
    let capacity = (args.workers * args.max_shards).min(args.shards as usize);
    loop {
        let owned = shared.owners.lock().await.len();
        if owned >= capacity {
            break;
        }
        if ramp.elapsed() > Duration::from_secs(600) {
            println!("ramp: only {owned} of {capacity} shards owned after 600 s");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let owned = shared.owners.lock().await.len();
    println!(
        "ramp: {owned} of {capacity} shards owned after {:.1} s",
        ramp.elapsed().as_secs_f64()
    );
    shared.latencies.0.lock().await.clear();
    let (cpu0, _, _) = process_usage(coordinator_pid);
    let (harness0, _, _) = process_usage(std::process::id());
    let box0 = box_ticks();
    let wal0 = wal_stats(&cluster.control.pool).await;
    let (etcd_requests0, _, etcd_cpu0, etcd_applied0, etcd_slow0) = etcd_metrics(&cluster.etcd.endpoint).await;
    let metrics0 = scrape(&coordinator_metrics).await;
    shared.measuring.store(true, Ordering::Relaxed);
    let measure = Instant::now();
    let measure_wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let harness_delay = tokio::spawn(runtime_delay_until(measure + args.duration));
    tokio::time::sleep(args.duration / 2).await;
    // Vanish: the shards those workers hold must be owned again by live ones.
    let orphans: Vec<ShardRef> = shared
        .owners
        .lock()
        .await
        .iter()
        .filter(|(_, (owner, _))| *owner < vanishing)
        .map(|(shard, _)| shard.clone())
        .collect();
    let vanished_at = Instant::now();
    vanish_tx.send(true).unwrap();
    tokio::time::sleep(args.duration / 2).await;
    let seconds = measure.elapsed().as_secs_f64();
    let (cpu1, rss, rss_peak) = process_usage(coordinator_pid);
    let (harness1, _, _) = process_usage(std::process::id());
    let box1 = box_ticks();
    let wal1 = wal_stats(&cluster.control.pool).await;
    let (etcd_requests1, etcd_keys, etcd_cpu1, etcd_applied1, etcd_slow1) = etcd_metrics(&cluster.etcd.endpoint).await;
    let metrics1 = scrape(&coordinator_metrics).await;
    shared.measuring.store(false, Ordering::Relaxed);
    let mut harness_delay = harness_delay.await.unwrap();
    harness_delay.sort_unstable();
    let latencies = std::mem::take(&mut *shared.latencies.0.lock().await);
    // Reacquisition, waited for past the measured time if need be.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut reacquired = loop {
        let owners = shared.owners.lock().await;
        let reacquired: Vec<Duration> = orphans
            .iter()
            .filter_map(|shard| {
                let (owner, at) = owners.get(shard)?;
                (*owner >= vanishing && *at > vanished_at).then(|| at.duration_since(vanished_at))
            })
            .collect();
        drop(owners);
        if reacquired.len() == orphans.len() || Instant::now() > deadline {
            break reacquired;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    reacquired.sort();
    // The commits outside the window from the vanishing until a second after the last of
    // their shards was owned again, and inside it: steady state and failover, apart.
    if let (Some(commits), Some(last)) = (latencies.get("commit_batch"), reacquired.last()) {
        let window_end = vanished_at + *last + Duration::from_secs(1);
        let (mut inside, mut outside): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
        for (at, micros) in commits {
            if *at >= vanished_at && *at <= window_end {
                inside.push(*micros);
            } else {
                outside.push(*micros);
            }
        }
        inside.sort_unstable();
        outside.sort_unstable();
        for (name, values) in [("outside", &outside), ("inside", &inside)] {
            println!(
                "commit_batch {name} the reacquisition (the vanishing until 1 s after the last shard was owned again): \
                 {} commits, p50 {:.1} p99 {:.1} max {:.1} ms",
                values.len(),
                percentile(values, 0.5),
                percentile(values, 0.99),
                percentile(values, 1.0)
            );
        }
    }
    wake_tx.send(true).unwrap();
    let channel = Channel::from_shared(cluster.address.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut admin = tidemark_proto::admin_client(channel);
    let mut status_ms = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        admin.status(pb::StatusRequest {}).await.unwrap();
        status_ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    status_ms.sort_by(f64::total_cmp);
    let commits = shared.counters.commits.load(Ordering::Relaxed);
    println!(
        "\n== {} workers, {} shards, {:.0} s measured ==",
        args.workers, args.shards, seconds
    );
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>9}",
        "rpc (ms)", "count", "p50", "p99", "max"
    );
    let mut names: Vec<_> = latencies.keys().copied().collect();
    names.sort();
    for name in names {
        let mut values: Vec<u32> = latencies[name].iter().map(|(_, micros)| *micros).collect();
        values.sort_unstable();
        println!(
            "{:<16} {:>9} {:>9.1} {:>9.1} {:>9.1}",
            name,
            values.len(),
            percentile(&values, 0.5),
            percentile(&values, 0.99),
            percentile(&values, 1.0)
        );
    }
    let vanish_second = vanished_at.duration_since(measure).as_secs();
    for call in ["commit_batch", "heartbeat", "acquire_shard"] {
        let Some(calls) = latencies.get(call) else { continue };
        let seconds: Vec<String> = slowest_seconds(calls, measure, 6)
            .iter()
            .map(|(second, n, p99, max)| format!("{second} s: {n} calls, p99 {p99:.0} max {max:.0}"))
            .collect();
        println!(
            "{call}'s slowest seconds (ms; the workers vanished at {vanish_second} s; second 0 began at \
             {:.3} s after the Unix epoch, to compare with the logs): {}",
            measure_wall.as_secs_f64(),
            seconds.join("; ")
        );
    }
    println!(
        "commits: {commits} in {seconds:.0} s = {:.0}/s; refused {}; RPC errors {}; RegisterWorker retried {} times",
        commits as f64 / seconds,
        shared.refused(),
        shared.counters.errors.load(Ordering::Relaxed),
        shared.counters.register_retries.load(Ordering::Relaxed)
    );
    let refusals = shared.refusals_since(&Default::default());
    if !refusals.is_empty() {
        println!("refused, by reason:{refusals}");
    }
    println!(
        "coordinator: {:.2} CPU cores over the measured time; RSS {rss:.0} MiB (peak {rss_peak:.0} MiB)",
        (cpu1 - cpu0) / seconds
    );
    println!(
        "box: {:.2} of {} cores busy (the harness's own simulated workers {:.2})",
        (box1 - box0) / 100.0 / seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        (harness1 - harness0) / seconds
    );
    let inside = |name: &str, labels: &str, q: f64| {
        let (before, after) = (buckets(&metrics0, name, labels), buckets(&metrics1, name, labels));
        bucket_quantile(&before, &after, q).map_or("-".to_string(), |s| format!("{:.1}", s * 1000.0))
    };
    let moved = |series: &str| labelled_sum(&metrics1, series) - labelled_sum(&metrics0, series);
    for call in ["acquire_shard", "register_batch", "commit_batch", "next_shard_work"] {
        let series = |suffix: &str| format!("tidemark_control_group_size_{suffix}{{call=\"{call}\"}}");
        let (groups, calls) = (moved(&series("count")), moved(&series("sum")));
        let labels = format!("call=\"{call}\"");
        println!(
            "{call} groups: {groups:.0} control statements for {calls:.0} calls, {:.1} per statement; \
             a group's statement p50 {} p99 {} ms (bucket upper bounds, with its wait for a connection)",
            calls / groups.max(1.0),
            inside("tidemark_control_group_seconds", &labels, 0.5),
            inside("tidemark_control_group_seconds", &labels, 0.99),
        );
    }
    println!(
        "in the coordinator (ms, bucket upper bounds): commit p50 {} p99 {}, of which its wait for the groups \
         before its own p50 {} p99 {}",
        inside("tidemark_commit_seconds", "", 0.5),
        inside("tidemark_commit_seconds", "", 0.99),
        inside("tidemark_control_group_wait_seconds", "call=\"commit_batch\"", 0.5),
        inside("tidemark_control_group_wait_seconds", "call=\"commit_batch\"", 0.99),
    );
    for scan in ["claim_queue", "freed", "gauges", "operations"] {
        let count = moved(&format!("tidemark_shard_scan_seconds_count{{scan=\"{scan}\"}}"));
        let labels = format!("scan=\"{scan}\"");
        println!(
            "shard reads `{scan}`: {count:.0}, p50 {} p99 {} ms (bucket upper bounds)",
            inside("tidemark_shard_scan_seconds", &labels, 0.5),
            inside("tidemark_shard_scan_seconds", &labels, 0.99),
        );
    }
    println!(
        "the coordinator's runtime ran woken tasks late by (ms, bucket upper bounds): p50 {} p99 {}",
        inside("tidemark_runtime_delay_seconds", "", 0.5),
        inside("tidemark_runtime_delay_seconds", "", 0.99),
    );
    println!(
        "the harness's own runtime ran woken tasks late by (ms): p50 {:.1} p99 {:.1} max {:.1} \
         (part of every latency above, which the harness measures on its side)",
        percentile(&harness_delay, 0.5),
        percentile(&harness_delay, 0.99),
        percentile(&harness_delay, 1.0),
    );
    println!(
        "etcd: {:.0} requests/s, {:.0} keys, {:.2} CPU cores, {:.0} raft proposals applied, {:.0} applies over 100 ms",
        (etcd_requests1 - etcd_requests0) / seconds,
        etcd_keys,
        (etcd_cpu1 - etcd_cpu0) / seconds,
        etcd_applied1 - etcd_applied0,
        etcd_slow1 - etcd_slow0
    );
    println!("control database: {}", control_size(&cluster.control.pool).await);
    let wal = |i: usize| (wal1[i] - wal0[i]) / seconds;
    println!(
        "WAL (the whole server): {:.0} records/s, {:.2} MiB/s, {:.0} writes/s, {:.0} syncs/s{}",
        wal(0),
        wal(1) / 1048576.0,
        wal(2),
        wal(3),
        if wal1[5] > wal0[5] {
            format!(
                ", {:.2} ms per sync",
                (wal1[5] - wal0[5]) / (wal1[3] - wal0[3]).max(1.0)
            )
        } else {
            String::new()
        }
    );
    for line in cluster.coordinator.as_ref().unwrap().log_text().lines() {
        if line.contains("control history pruned") {
            println!("coordinator: {}", line.trim());
        }
    }
    println!(
        "status: p50 {:.1} ms, max {:.1} ms",
        status_ms[status_ms.len() / 2],
        status_ms[status_ms.len() - 1]
    );
    let last = |v: &[Duration], p: f64| {
        v.get(((v.len() as f64 - 1.0) * p).round() as usize)
            .map_or(f64::NAN, |d| d.as_secs_f64())
    };
    println!(
        "vanished: {vanishing} workers holding {} shards; reacquired {} (p50 {:.1} s, max {:.1} s after they stopped; lease TTL {})",
        orphans.len(),
        reacquired.len(),
        last(&reacquired, 0.5),
        last(&reacquired, 1.0),
        args.lease_ttl
    );
    // The zombies wake two TTLs after they vanished; let them try.
    let deadline = Instant::now() + Duration::from_secs(60);
    while shared.counters.zombie_accepted.load(Ordering::Relaxed)
        + shared.counters.zombie_refused.load(Ordering::Relaxed)
        < orphans.len() as u64
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "zombie commits with old fences: {} refused, {} accepted",
        shared.counters.zombie_refused.load(Ordering::Relaxed),
        shared.counters.zombie_accepted.load(Ordering::Relaxed)
    );
    if let Some((standby, standby_listen, proxy)) = standby {
        fail_over(&mut cluster, &shared, standby, &standby_listen, &proxy).await;
    }
    workers.shutdown().await;
}

/// Kills the leader (-9) under the load still running, sends new connections to the
/// standby, and times: the standby's election, the first commit after the kill, and the
/// first second whose commits reach 80 % of the rate before.
async fn fail_over(
    cluster: &mut Cluster,
    shared: &Shared,
    standby: tidemark_tests::Process,
    standby_listen: &str,
    proxy: &tidemark_tests::faults::FaultProxy,
) {
    let commits = || shared.counters.all_commits.load(Ordering::Relaxed);
    let refused = || shared.refused();
    let before = commits();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let rate = (commits() - before) as f64 / 10.0;
    let (refused0, unavailable0) = (refused(), shared.counters.unavailable.load(Ordering::Relaxed));
    let refusals0 = shared.refusals.lock().unwrap().clone();
    let killed = Instant::now();
    cluster.coordinator.as_mut().unwrap().kill9();
    proxy.set_upstream(standby_listen.parse().unwrap());
    let at_kill = commits();
    let mut first_commit = None;
    let mut elected = None;
    let mut restored = None;
    let mut window = (Instant::now(), at_kill);
    while killed.elapsed() < Duration::from_secs(180) && restored.is_none() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = commits();
        if first_commit.is_none() && now > at_kill {
            first_commit = Some(killed.elapsed());
        }
        if elected.is_none() && standby.log_text().contains("elected leader") {
            elected = Some(killed.elapsed());
        }
        if window.0.elapsed() >= Duration::from_secs(1) {
            let per_second = (now - window.1) as f64 / window.0.elapsed().as_secs_f64();
            if first_commit.is_some() && per_second >= 0.8 * rate {
                restored = Some(killed.elapsed());
            }
            window = (Instant::now(), now);
        }
    }
    let seconds = |d: Option<Duration>| d.map_or("never (180 s)".to_string(), |d| format!("{:.1} s", d.as_secs_f64()));
    println!(
        "failover: {rate:.0} commits/s before the kill; standby elected after {}, first commit after {}, \
         80 % of the rate after {}; {} calls answered Unavailable and retried, {} batches refused meanwhile{}",
        seconds(elected),
        seconds(first_commit),
        seconds(restored),
        shared.counters.unavailable.load(Ordering::Relaxed) - unavailable0,
        refused() - refused0,
        shared.refusals_since(&refusals0)
    );
    drop(standby);
}
