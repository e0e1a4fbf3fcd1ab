//! The chaos runner (fault matrix S01–S07, S09): a sync of N rows with a concurrent writer,
//! while workers are killed and restarted, every crash point is hit, a worker is frozen past
//! its lease (a zombie), etcd stops, the target PostgreSQL crashes and restarts, the
//! worker ↔ coordinator network is blackholed, and the coordinator is killed (once right
//! after committing a checkpoint, before replying). Then the oracle: per key, and the batch
//! protocol's invariants from the control database.
//!
//! Knobs (environment): CHAOS_ROWS (200000), CHAOS_WORKERS (4), CHAOS_SHARDS (16),
//! CHAOS_OPS (writer row changes per second, 500), CHAOS_SECONDS (fault phase, 90),
//! CHAOS_ZOMBIES (zombie episodes, 3), CHAOS_SEED (random). The full-scale command is in
//! CHAOS.md.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use sqlx::Row;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tidemark_common::cursor::{Cursor, Position};
use tidemark_tests::faults::{FaultProxy, PrivatePg, Rng};
use tidemark_tests::s3::{S3_ENV, S3Server};
use tidemark_tests::{Cluster, ITEM_COLUMNS, KeyKind, TaskSettings, compare_table, create_items};

const WORKER_CRASH_POINTS: &[&str] = &[
    "after_read",
    "mid_data",
    "after_data",
    "after_stage",
    "after_register",
    "in_apply",
    "after_apply",
    "after_commit",
];

#[derive(Clone, Copy)]
struct Knobs {
    rows: i64,
    workers: usize,
    shards: u32,
    ops_per_second: u64,
    fault_seconds: u64,
    zombies: u64,
    seed: u64,
}

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

impl Knobs {
    fn from_env() -> Knobs {
        let time_seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Knobs {
            rows: knob("CHAOS_ROWS", 200_000) as i64,
            workers: knob("CHAOS_WORKERS", 4) as usize,
            shards: knob("CHAOS_SHARDS", 16) as u32,
            ops_per_second: knob("CHAOS_OPS", 500),
            fault_seconds: knob("CHAOS_SECONDS", 90),
            zombies: knob("CHAOS_ZOMBIES", 3),
            seed: knob("CHAOS_SEED", time_seed % 1_000_000),
        }
    }
}

/// One live worker slot.
struct Slot {
    index: usize,
    id: String,
    armed: Option<(String, Instant)>,
}

#[derive(Default)]
struct Tally {
    kills: u32,
    crash_points: BTreeMap<String, u32>,
    coordinator_restarts: u32,
    resume_times: Vec<Duration>,
}

/// Writes ~`ops_per_second` row changes per second (updates, inserts, soft deletes) until
/// stopped; returns the source time after its last commit and the number of changes.
async fn writer(
    source: PgPool,
    existing: i64,
    ops_per_second: u64,
    seed: u64,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (i64, u64) {
    let mut rng = Rng::new(seed ^ 0x5eed);
    let per_tick = (ops_per_second / 10).max(5) as i64;
    let mut next_seq = existing + 1_000_000;
    let mut changes = 0u64;
    while !*stop.borrow() {
        let updates: Vec<String> = (0..per_tick * 2 / 5)
            .map(|_| rng.range(1, existing as u64 + 1).to_string())
            .collect();
        let deletes: Vec<String> = (0..per_tick / 5)
            .map(|_| rng.range(1, existing as u64 + 1).to_string())
            .collect();
        let inserts = per_tick - updates.len() as i64 - deletes.len() as i64;
        let statements = [
            format!(
                "UPDATE items SET name = 'chaos ' || clock_timestamp(), qty = coalesce(qty, 0) + 1, updated_at = clock_timestamp() WHERE seq IN ({})",
                updates.join(",")
            ),
            format!(
                "UPDATE items SET note = 'deleted', updated_at = clock_timestamp() WHERE seq IN ({})",
                deletes.join(",")
            ),
            format!(
                "INSERT INTO items (id, seq, name, qty, price, payload, note, updated_at) \
                 SELECT g, g, 'inserted ' || g, 1, 1.5, NULL, NULL, clock_timestamp() FROM generate_series({next_seq}, {}) g",
                next_seq + inserts - 1
            ),
        ];
        next_seq += inserts;
        for statement in statements {
            if sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                .execute(&source)
                .await
                .is_ok()
            {
                changes += 1;
            }
        }
        changes += per_tick as u64 - 3;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let end: i64 = sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&source)
        .await
        .unwrap();
    (end, changes)
}

/// Room for twice a worker's share, so that the others can take over a lost worker's shards.
static MAX_SHARDS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(8);

fn spawn_slot(cluster: &mut Cluster, number: usize, generation: u32, crash: Option<(&str, u64)>) -> Slot {
    spawn_slot_with(cluster, number, generation, crash, "TIDEMARK_CRASH_AT")
}

fn spawn_slot_with(
    cluster: &mut Cluster,
    number: usize,
    generation: u32,
    point: Option<(&str, u64)>,
    variable: &'static str,
) -> Slot {
    let id = format!("w{number}-g{generation}");
    let env_value = point.map(|(point, n)| format!("{point}:{n}"));
    let env: Vec<(&str, &str)> = env_value.iter().map(|v| (variable, v.as_str())).collect();
    let max_shards = MAX_SHARDS.load(std::sync::atomic::Ordering::SeqCst);
    let index = cluster.spawn_worker(&id, max_shards, &env);
    Slot {
        index,
        id,
        armed: point.map(|(point, _)| (point.to_string(), Instant::now())),
    }
}

/// Whether a process is stopped (SIGSTOP): state `T` in /proc/PID/stat.
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// Counts the coordinator's crash point when its log says it was reached.
fn count_coordinator_crash(cluster: &Cluster, tally: &mut Tally) {
    let log = cluster.coordinator.as_ref().unwrap().log_text();
    if log.contains("crash point commit_before_reply reached") {
        *tally.crash_points.entry("commit_before_reply".into()).or_default() += 1;
    }
}

/// One zombie episode: a worker frozen between applying a batch and committing it.
struct Zombie {
    slot: usize,
    id: String,
    stopped_at: Option<Instant>,
    shards: Vec<u32>,
    started: Instant,
}

async fn owned_shards(cluster: &Cluster, worker: &str) -> Vec<u32> {
    match cluster.try_status().await.and_then(|s| s.tasks.into_iter().next()) {
        Some(task) => task.shards.iter().filter(|s| s.owner == worker).map(|s| s.id).collect(),
        None => Vec::new(),
    }
}

/// A cursor's progress as a comparable tuple: snapshot (phase 0, key) then incremental
/// (phase 1, watermark).
fn progress(cursor: &Cursor) -> (u8, i64) {
    match &cursor.position {
        Position::Snapshot { after_key } => (
            0,
            after_key
                .as_ref()
                .and_then(|k| k[0].value.parse().ok())
                .unwrap_or(i64::MIN),
        ),
        Position::Incremental { floor_micros, .. } => (1, *floor_micros),
        Position::Append { after_key } => (
            2,
            after_key
                .as_ref()
                .and_then(|k| k[0].value.parse().ok())
                .unwrap_or(i64::MIN),
        ),
    }
}

/// Invariants from the control database and the target ledger; returns the breaches.
async fn check_invariants(control: &PgPool, target: &PgPool) -> Vec<String> {
    let mut breaches = Vec::new();
    // Workers still run overlap re-reads while this reads, so the order matters: a batch is
    // registered, then applied (ledger), then committed. Committed batches are read before
    // the ledger, the registry after it; read otherwise, a batch moving on in between looks
    // like a breach.
    let committed_not_applied: Vec<String> =
        sqlx::query_scalar("SELECT batch_id FROM batches WHERE state = 'COMMITTED' AND row_count > 0")
            .fetch_all(control)
            .await
            .unwrap();
    let ledger = sqlx::query("SELECT batch_id, content_hash FROM tidemark_ledger")
        .fetch_all(target)
        .await
        .unwrap();
    let registry: HashMap<String, String> = sqlx::query("SELECT batch_id, content_hash FROM batches")
        .fetch_all(control)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for row in &ledger {
        let (batch_id, hash): (String, String) = (row.get(0), row.get(1));
        match registry.get(&batch_id) {
            None => breaches.push(format!("ledger batch {batch_id} was never registered")),
            Some(registered) if *registered != hash => breaches.push(format!(
                "batch {batch_id} applied with content {hash}, registered {registered}"
            )),
            Some(_) => {}
        }
    }
    let applied: HashSet<String> = ledger.iter().map(|r| r.get::<String, _>(0)).collect();
    for batch_id in committed_not_applied.iter().filter(|id| !applied.contains(*id)) {
        breaches.push(format!("committed batch {batch_id} is not in the target ledger"));
    }
    let history = sqlx::query("SELECT shard_id, version, fence, cursor FROM checkpoint_history ORDER BY shard_id, id")
        .fetch_all(control)
        .await
        .unwrap();
    for pair in history.windows(2) {
        let shard: i32 = pair[0].get(0);
        if shard != pair[1].get::<i32, _>(0) {
            continue;
        }
        let (v0, v1): (i64, i64) = (pair[0].get(1), pair[1].get(1));
        let (f0, f1): (i64, i64) = (pair[0].get(2), pair[1].get(2));
        let c0 = Cursor::decode(&pair[0].get::<serde_json::Value, _>(3).to_string()).unwrap();
        let c1 = Cursor::decode(&pair[1].get::<serde_json::Value, _>(3).to_string()).unwrap();
        if v1 <= v0 {
            breaches.push(format!("shard {shard}: checkpoint version {v0} then {v1}"));
        }
        if f1 < f0 {
            breaches.push(format!(
                "shard {shard}: fence {f0} then {f1} (a fenced-out owner committed)"
            ));
        }
        if progress(&c1) < progress(&c0) {
            breaches.push(format!(
                "shard {shard}: cursor went back from {} to {}",
                c0.describe(),
                c1.describe()
            ));
        }
    }
    breaches
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index].as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos() {
    let knobs = Knobs::from_env();
    let staging = std::env::var("CHAOS_STAGING").unwrap_or_else(|_| "both".into());
    if matches!(staging.as_str(), "file" | "both") {
        run_chaos(&knobs, None).await;
    }
    if matches!(staging.as_str(), "s3" | "both") {
        // The same faults with S3 staging (a moto server), shorter: staging on object storage
        // must hold every rule a disk does.
        let s3 = S3Server::start();
        let short = Knobs {
            rows: knobs.rows / 2,
            fault_seconds: knob("CHAOS_S3_SECONDS", 40),
            ..knobs
        };
        run_chaos(&short, Some(&s3)).await;
    }
}

/// One chaos run (see the module); `s3`: staging in that server's bucket instead of a
/// `file://` directory.
async fn run_chaos(knobs: &Knobs, s3: Option<&S3Server>) {
    MAX_SHARDS.store(
        (knobs.shards * 2 / knobs.workers as u32).max(2),
        std::sync::atomic::Ordering::SeqCst,
    );
    let started = Instant::now();
    let mut rng = Rng::new(knobs.seed);
    eprintln!(
        "chaos: seed {} rows {} workers {} shards {} ops/s {} faults {}s",
        knobs.seed, knobs.rows, knobs.workers, knobs.shards, knobs.ops_per_second, knobs.fault_seconds
    );
    let mut cluster = Cluster::new(if s3.is_some() { "chaos_s3" } else { "chaos" }).await;
    if s3.is_some() {
        cluster.client_env = S3_ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    }
    // The target runs on a private server so that it can be crashed (-m immediate).
    let private = PrivatePg::start();
    let target_url = match &private {
        Some(pg) => pg.create_database("chaos_target").await,
        None => {
            eprintln!("chaos: no private PostgreSQL (not root?); the target-restart fault is skipped");
            cluster.target.url.clone()
        }
    };
    let target = PgPoolOptions::new()
        .max_connections(2)
        .connect(&target_url)
        .await
        .unwrap();
    create_items(&cluster.source, KeyKind::Bigint, knobs.rows).await;
    let settings = TaskSettings {
        shards: knobs.shards,
        page_size: 2000,
        overlap: "3s",
        staging_retention: "20s",
        staging_url: s3.map(|s3| s3.staging_url("chaos")).unwrap_or_default(),
        ..TaskSettings::default()
    };
    let config = cluster.write_config(&settings);
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace(&cluster.target.url, &target_url)).unwrap();
    cluster.launch_coordinator(&config, &[]).await;
    let upstream: SocketAddr = cluster.address.trim_start_matches("http://").parse().unwrap();
    let proxy = FaultProxy::start(upstream).await;
    cluster.worker_address = Some(proxy.address.clone());

    let mut generation = 0u32;
    let mut slots: Vec<Slot> = (0..knobs.workers)
        .map(|n| spawn_slot(&mut cluster, n, 0, None))
        .collect();
    let (stop_writer, stop_rx) = tokio::sync::watch::channel(false);
    let writer_task = tokio::spawn(writer(
        cluster.source.pool.clone(),
        knobs.rows,
        knobs.ops_per_second,
        knobs.seed,
        stop_rx,
    ));

    let mut tally = Tally::default();
    // Crash points still to be hit come first; a point whose worker was killed before it
    // fired goes back to the front.
    let mut point_queue: std::collections::VecDeque<&str> = WORKER_CRASH_POINTS.iter().copied().collect();
    let mut rotation = 0usize;
    let mut pending_resumes: Vec<(Instant, String, Vec<u32>)> = Vec::new();
    let fault_window = Duration::from_secs(knobs.fault_seconds);
    let at = |fraction: f64| fault_window.mul_f64(fraction);
    let mut events_done: HashSet<&str> = HashSet::new();
    let mut zombie: Option<Zombie> = None;
    let mut zombie_ids: Vec<String> = Vec::new();
    let mut zombies_woken = 0u64;
    // Whether the running coordinator carries a crash point that has not fired yet.
    let mut coordinator_armed = false;
    let mut etcd_stopped: Option<Instant> = None;
    let mut partitioned: Option<Instant> = None;
    let mut next_kill = Instant::now() + Duration::from_secs(rng.range(2, 6));
    let fault_start = Instant::now();

    while fault_start.elapsed() < fault_window {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let elapsed = fault_start.elapsed();

        // Workers that died at their crash point: count the point, restart them disarmed.
        for (slot_number, slot) in slots.iter_mut().enumerate() {
            if let Some(_status) = cluster.workers[slot.index].child.try_wait().unwrap() {
                let log = cluster.workers[slot.index].log_text();
                for point in WORKER_CRASH_POINTS {
                    if log.contains(&format!("crash point {point} reached")) {
                        *tally.crash_points.entry(point.to_string()).or_default() += 1;
                    }
                }
                generation += 1;
                *slot = spawn_slot(&mut cluster, slot_number, generation, None);
            }
        }
        // The coordinator died at its crash point: start it again.
        if let Some(status) = cluster.coordinator.as_mut().unwrap().child.try_wait().unwrap() {
            count_coordinator_crash(&cluster, &mut tally);
            eprintln!("chaos: coordinator exited ({status}); restarting");
            cluster.launch_coordinator(&config, &[]).await;
            coordinator_armed = false;
            tally.coordinator_restarts += 1;
        }

        // kill -9 a random worker every 2–5 s (not the zombie, not one armed with a crash
        // point that may still fire) and restart it armed with the next crash point.
        if Instant::now() >= next_kill {
            next_kill = Instant::now() + Duration::from_secs(rng.range(2, 6));
            let candidates: Vec<usize> = (0..slots.len())
                .filter(|&n| {
                    slots[n]
                        .armed
                        .as_ref()
                        .is_none_or(|(_, since)| since.elapsed() > Duration::from_secs(20))
                })
                .filter(|&n| zombie.as_ref().is_none_or(|z| z.slot != n))
                .collect();
            if !candidates.is_empty() {
                let n = candidates[rng.range(0, candidates.len() as u64) as usize];
                if let Some((point, _)) = &slots[n].armed
                    && let Some(point) = WORKER_CRASH_POINTS.iter().find(|p| **p == point.as_str())
                    && !tally.crash_points.contains_key(*point)
                {
                    point_queue.push_front(point);
                }
                let victim = slots[n].id.clone();
                let shards = owned_shards(&cluster, &victim).await;
                cluster.workers[slots[n].index].kill9();
                tally.kills += 1;
                if !shards.is_empty() {
                    pending_resumes.push((Instant::now(), victim, shards));
                }
                let point = point_queue.pop_front().unwrap_or_else(|| {
                    rotation += 1;
                    WORKER_CRASH_POINTS[rotation % WORKER_CRASH_POINTS.len()]
                });
                generation += 1;
                slots[n] = spawn_slot(&mut cluster, n, generation, Some((point, rng.range(1, 3))));
            }
        }

        // Time from kill to every one of the victim's shards owned again.
        if !pending_resumes.is_empty()
            && let Some(task) = cluster.try_status().await.and_then(|s| s.tasks.into_iter().next())
        {
            pending_resumes.retain(|(killed_at, victim, shards)| {
                let resumed = shards.iter().all(|id| {
                    task.shards
                        .iter()
                        .any(|s| s.id == *id && !s.owner.is_empty() && s.owner != *victim)
                });
                if resumed {
                    tally.resume_times.push(killed_at.elapsed());
                }
                !resumed
            });
        }

        // Zombies: a worker freezes itself (SIGSTOP) after applying a batch and before
        // committing it; once its shards have moved to other workers it is woken (SIGCONT)
        // and its commit, under the old fence, must be refused.
        if elapsed >= at(0.05)
            && zombie.is_none()
            && (zombie_ids.len() as u64) < knobs.zombies
            && etcd_stopped.is_none()
            && partitioned.is_none()
        {
            let candidates: Vec<usize> = (0..slots.len()).filter(|&n| slots[n].armed.is_none()).collect();
            if !candidates.is_empty() {
                let n = candidates[rng.range(0, candidates.len() as u64) as usize];
                cluster.workers[slots[n].index].kill9();
                generation += 1;
                // Alternate: frozen after the target commit (before the checkpoint commit), or
                // inside the target transaction, holding row locks.
                let stop_point = if zombie_ids.len().is_multiple_of(2) {
                    "before_commit"
                } else {
                    "in_apply"
                };
                slots[n] = spawn_slot_with(
                    &mut cluster,
                    n,
                    generation,
                    Some((stop_point, rng.range(1, 4))),
                    "TIDEMARK_STOP_AT",
                );
                slots[n].armed = Some(("zombie".into(), Instant::now() + Duration::from_secs(3600)));
                zombie_ids.push(slots[n].id.clone());
                zombie = Some(Zombie {
                    slot: n,
                    id: slots[n].id.clone(),
                    stopped_at: None,
                    shards: Vec::new(),
                    started: Instant::now(),
                });
            }
        }
        if let Some(z) = zombie.as_mut() {
            let pid = cluster.workers[slots[z.slot].index].child.id();
            if z.stopped_at.is_none() && is_stopped(pid) {
                z.stopped_at = Some(Instant::now());
                z.shards = owned_shards(&cluster, &z.id).await;
                eprintln!("chaos: {} froze (owning {:?})", z.id, z.shards);
            }
            let moved = match (
                z.stopped_at,
                cluster.try_status().await.and_then(|s| s.tasks.into_iter().next()),
            ) {
                (Some(_), Some(task)) => z.shards.iter().all(|id| {
                    task.shards
                        .iter()
                        .any(|s| s.id == *id && !s.owner.is_empty() && s.owner != z.id)
                }),
                _ => false,
            };
            let frozen_for = z.stopped_at.map(|t| t.elapsed()).unwrap_or_default();
            if (moved && frozen_for > Duration::from_secs(5)) || frozen_for > Duration::from_secs(30) {
                cluster.workers[slots[z.slot].index].signal("CONT");
                eprintln!(
                    "chaos: SIGCONT {} after {:.1}s frozen (shards moved: {moved})",
                    z.id,
                    frozen_for.as_secs_f64()
                );
                if moved {
                    zombies_woken += 1;
                }
                slots[z.slot].armed = None;
                zombie = None;
            } else if z.stopped_at.is_none() && z.started.elapsed() > Duration::from_secs(30) {
                // It never reached a commit (e.g. killed at a crash point meanwhile).
                zombie_ids.pop();
                slots[z.slot].armed = None;
                zombie = None;
            }
        }

        // etcd stops for 20 s (SIGSTOP), then continues.
        if elapsed >= at(0.25) && events_done.insert("etcd") {
            cluster.etcd.signal("STOP");
            etcd_stopped = Some(Instant::now());
            eprintln!("chaos: etcd stopped");
        }
        if let Some(since) = etcd_stopped
            && since.elapsed() >= Duration::from_secs(20).min(fault_window / 5)
        {
            cluster.etcd.signal("CONT");
            etcd_stopped = None;
            eprintln!("chaos: etcd continued");
        }

        // The target PostgreSQL crashes and restarts.
        if elapsed >= at(0.50)
            && events_done.insert("target-restart")
            && let Some(pg) = &private
        {
            let restarted = pg.restart_immediate();
            eprintln!("chaos: target PostgreSQL restarted -m immediate: {restarted}");
            assert!(restarted, "the private target server came back");
        }

        // Blackhole worker ↔ coordinator traffic for longer than the lease TTL, then heal.
        if elapsed >= at(0.60) && events_done.insert("partition") {
            proxy.set_blackhole(true);
            partitioned = Some(Instant::now());
            eprintln!("chaos: partition");
        }
        if let Some(since) = partitioned
            && since.elapsed() >= Duration::from_secs(7)
        {
            proxy.set_blackhole(false);
            partitioned = None;
            eprintln!("chaos: healed");
        }

        // The coordinator is killed; its successor crashes once right after a commit,
        // before the reply (the worker's retry must be recognised), and is restarted.
        if elapsed >= at(0.75) && events_done.insert("coordinator") {
            let crash = format!("commit_before_reply:{}", rng.range(5, 30));
            eprintln!("chaos: restarting the coordinator ({crash})");
            cluster
                .launch_coordinator(&config, &[("TIDEMARK_CRASH_AT", crash.as_str())])
                .await;
            coordinator_armed = true;
            tally.coordinator_restarts += 1;
        }
    }

    // Heal everything, stop the writer, and let the sync converge.
    if let Some(z) = zombie.take() {
        cluster.workers[slots[z.slot].index].signal("CONT");
    }
    if etcd_stopped.take().is_some() {
        cluster.etcd.signal("CONT");
    }
    proxy.set_blackhole(false);
    let _ = stop_writer.send(true);
    // Bounded, so that a writer stuck in a statement fails by name instead of holding the
    // test until its harness timeout.
    let (writes_end, changes) = tokio::time::timeout(Duration::from_secs(60), writer_task)
        .await
        .expect("the writer stops within 60 s of being told to")
        .unwrap();
    for (slot_number, slot) in slots.iter_mut().enumerate() {
        if cluster.workers[slot.index].child.try_wait().unwrap().is_some() || slot.armed.is_some() {
            cluster.workers[slot.index].kill9();
            generation += 1;
            *slot = spawn_slot(&mut cluster, slot_number, generation, None);
        }
    }
    // A coordinator that died, or one still armed with a crash point that has not fired
    // (the fault window can end first, most often under load): nothing restarts it during
    // convergence, so it is replaced now by one without a crash point.
    let exited = cluster
        .coordinator
        .as_mut()
        .unwrap()
        .child
        .try_wait()
        .unwrap()
        .is_some();
    if exited || coordinator_armed {
        count_coordinator_crash(&cluster, &mut tally);
        eprintln!(
            "chaos: after the fault window, the coordinator (exited: {exited}, armed: {coordinator_armed}) is started without a crash point"
        );
        cluster.launch_coordinator(&config, &[]).await;
        tally.coordinator_restarts += 1;
    }
    cluster.wait_for_watermark(writes_end, Duration::from_secs(600)).await;

    // The oracle: per key (value, version, soft-delete flag), then the protocol's invariants.
    let version = "(extract(epoch from updated_at) * 1000000)::bigint";
    let diff = compare_table(&cluster.source.pool, &target, "items", &["id"], ITEM_COLUMNS, version).await;
    let breaches = check_invariants(&cluster.control.pool, &target).await;
    let counts = sqlx::query(
        "SELECT count(*) FILTER (WHERE state = 'COMMITTED'), count(*) FILTER (WHERE replayed), \
         count(*) FILTER (WHERE state = 'ABANDONED') FROM batches",
    )
    .fetch_one(&cluster.control.pool)
    .await
    .unwrap();
    let mut coordinator_logs = String::new();
    for entry in std::fs::read_dir(&cluster.dir.0).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("coordinator") && name.ends_with(".log") {
            coordinator_logs.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
        }
    }
    let zombie_refused = coordinator_logs
        .lines()
        .filter(|l| {
            l.contains("commit refused")
                && l.contains("fenced")
                && zombie_ids
                    .iter()
                    .any(|id| l.contains(&format!("worker={id} ")) || l.ends_with(&format!("worker={id}")))
        })
        .count();
    let all_refused_fenced = coordinator_logs
        .lines()
        .filter(|l| l.contains("commit refused") && l.contains("fenced"))
        .count();
    let mut resume = tally.resume_times.clone();
    resume.sort();

    println!(
        "== chaos summary (seed {}, staging {}) ==",
        knobs.seed,
        if s3.is_some() { "s3" } else { "file" }
    );
    println!(
        "rows {} + {} writer changes; workers {}; shards {}; wall {:.0}s",
        knobs.rows,
        changes,
        knobs.workers,
        knobs.shards,
        started.elapsed().as_secs_f64()
    );
    println!(
        "kills (kill -9): {}; coordinator restarts: {}",
        tally.kills, tally.coordinator_restarts
    );
    println!("crash points hit: {:?}", tally.crash_points);
    println!(
        "batches committed {}, replayed from staging {}, abandoned {}",
        counts.get::<i64, _>(0),
        counts.get::<i64, _>(1),
        counts.get::<i64, _>(2)
    );
    println!(
        "zombie episodes {} (woken after their shards moved: {zombies_woken}): commits refused {zombie_refused} \
         (all fenced refusals {all_refused_fenced}); accepted from a fenced-out owner: {}",
        zombie_ids.len(),
        breaches.iter().filter(|b| b.contains("fenced-out")).count()
    );
    println!(
        "kill -> shards owned again: p50 {:.1}s p99 {:.1}s ({} samples)",
        percentile(&resume, 0.5),
        percentile(&resume, 0.99),
        resume.len()
    );
    println!(
        "keys compared {}: lost {}, stale {}, resurrected 0, phantom {}",
        diff.keys,
        diff.lost.len(),
        diff.stale.len(),
        diff.phantom.len()
    );
    println!("invariant breaches: {}", breaches.len());
    for breach in breaches.iter().take(20) {
        println!("  {breach}");
    }

    diff.assert_clean("chaos");
    assert!(breaches.is_empty(), "{breaches:?}");
    assert!(tally.kills > 0 && tally.coordinator_restarts >= 1);
    // A woken zombie either has its stale commit refused (counted above) or learns from its
    // first heartbeat that its lease is gone and drops the shard first; both are correct.
    // What may never happen — a commit accepted under an old fence — is an invariant breach.
    if knobs.fault_seconds >= 60 {
        let missing: Vec<&&str> = WORKER_CRASH_POINTS
            .iter()
            .filter(|p| !tally.crash_points.contains_key(**p))
            .collect();
        assert!(missing.is_empty(), "crash points never hit: {missing:?}");
    }
    // Keep the private server alive until the oracle is done.
    drop(private);
}
