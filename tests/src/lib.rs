//! Integration harness: real PostgreSQL databases (unique names, dropped afterwards), a real
//! etcd process per test, and the real `tidemark-coordinator` / `tidemark-worker` binaries
//! talking gRPC over loopback. The oracle compares source and target per key.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub mod faults;
pub mod mariadb;
pub mod otlp;
pub mod s3;
pub mod usage;

use sqlx::Row;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tidemark_proto::v1 as pb;

pub fn pg_base_url() -> String {
    std::env::var("TIDEMARK_TEST_PG").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

pub fn unique_name(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let salt = &uuid::Uuid::new_v4().simple().to_string()[..6];
    format!("tm_{tag}_{}_{n}_{salt}", std::process::id())
}

/// A scratch directory removed on drop (kept when `TIDEMARK_KEEP_TEST_DIRS` is set).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(unique_name(tag));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("TIDEMARK_KEEP_TEST_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A database of its own for one test, dropped (with FORCE) when the test ends.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
    /// The server's URL without a database.
    base: String,
}

impl TestDb {
    pub async fn create(tag: &str) -> TestDb {
        TestDb::create_on(&pg_base_url(), tag).await
    }

    /// A database on the server at `base` (a URL without a database).
    pub async fn create_on(base: &str, tag: &str) -> TestDb {
        let name = unique_name(tag);
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{base}/postgres"))
            .await
            .expect("PostgreSQL at TIDEMARK_TEST_PG (default 127.0.0.1:5432) must be running");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        let url = format!("{base}/{name}");
        let pool = PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
        TestDb {
            name,
            url,
            pool,
            base: base.to_string(),
        }
    }

    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

impl TestDb {
    /// This database's URL for another role (same server).
    pub fn url_as(&self, role: &str) -> String {
        self.url.replacen("postgres@", &format!("{role}@"), 1)
    }
}

/// A login role of its own for one test (server-wide), dropped when the test ends: declare
/// it before the databases it has privileges in, so that they are dropped first.
pub struct TestRole {
    pub name: String,
    base: String,
}

impl TestRole {
    pub async fn create(tag: &str) -> TestRole {
        let name = unique_name(tag);
        let base = pg_base_url();
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{base}/postgres"))
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE ROLE \"{name}\" LOGIN")))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        TestRole { name, base }
    }
}

impl Drop for TestRole {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args(["-X", "-q", "-d", &format!("{}/postgres", self.base), "-c"])
            .arg(format!("DROP ROLE IF EXISTS \"{}\"", self.name))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args(["-X", "-q", "-d", &format!("{}/postgres", self.base), "-c"])
            .arg(format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A single-node etcd on free loopback ports, killed on drop.
pub struct Etcd {
    pub endpoint: String,
    child: Child,
    ports: (u16, u16),
    dir: TempDir,
}

/// Certificates for an etcd that serves only TLS and requires client certificates.
pub struct EtcdTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA that signs the clients' certificates.
    pub client_ca: PathBuf,
}

impl Etcd {
    pub fn start() -> Etcd {
        Etcd::start_with(None)
    }

    /// etcd serving `https://` only, with client certificates required.
    pub fn start_tls(tls: &EtcdTls) -> Etcd {
        Etcd::start_with(Some(tls))
    }

    /// Starts etcd on two free ports. Another process may take a port between `free_port` and
    /// etcd's bind; etcd then exits, and it is started again on new ports (three tries). Ready
    /// means its own log says it serves the client port and the port accepts connections.
    fn start_with(tls: Option<&EtcdTls>) -> Etcd {
        let mut last_log = String::new();
        for _ in 0..3 {
            match Etcd::try_start(tls, TempDir::new("etcd"), (free_port(), free_port())) {
                Ok(etcd) => return etcd,
                Err(log) => last_log = log,
            }
        }
        panic!("etcd did not start in three tries; its last log:\n{last_log}");
    }

    fn try_start(tls: Option<&EtcdTls>, dir: TempDir, ports: (u16, u16)) -> Result<Etcd, String> {
        let child = Etcd::spawn(tls, &dir.0, ports)?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        Ok(Etcd {
            endpoint: format!("{scheme}://127.0.0.1:{}", ports.0),
            child,
            ports,
            dir,
        })
    }

    /// Starts etcd in `dir` on `(client, peer)` ports and waits until it serves.
    fn spawn(tls: Option<&EtcdTls>, dir: &Path, (client, peer): (u16, u16)) -> Result<Child, String> {
        let log_path = dir.join("etcd.log");
        // A restart starts a new log, so that "serving" below is this start's.
        let _ = std::fs::rename(&log_path, dir.join("etcd.log.before"));
        let log = std::fs::File::create(&log_path).unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut command = Command::new("etcd");
        if let Some(tls) = tls {
            command
                .arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key)
                .arg("--trusted-ca-file")
                .arg(&tls.client_ca)
                .arg("--client-cert-auth");
        }
        let mut child = command
            .args(["--name", "t", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &format!("{scheme}://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("{scheme}://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("t=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd must be installed (scripts/setup.sh installs it)");
        let endpoint = format!("{scheme}://127.0.0.1:{client}");
        let deadline = Instant::now() + Duration::from_secs(20);
        // Our own etcd's log must say it serves the port: a listener there could belong to
        // another test's etcd that took the port first.
        let serving = if tls.is_some() {
            format!("serving client requests on 127.0.0.1:{client}\n")
        } else {
            format!("serving insecure client requests on 127.0.0.1:{client},")
        };
        let ours = || std::fs::read_to_string(&log_path).is_ok_and(|log| log.contains(&serving));
        while !ours() || std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                return Err(format!(
                    "etcd on {endpoint} (peer port {peer}) {}:\n{}",
                    exited.map_or("did not listen within 20 s".to_string(), |s| format!("exited ({s})")),
                    tail.join("\n")
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(child)
    }

    /// Kills etcd (SIGKILL) and starts it again on the same ports and data: leases and keys
    /// survive, every open connection and stream breaks. Plain (not TLS) etcd only.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child =
            Etcd::spawn(None, &self.dir.0, self.ports).unwrap_or_else(|log| panic!("etcd did not restart: {log}"));
    }

    /// The sum of etcd's own samples whose line starts with `selector` (a metric name with
    /// the start of its labels, e.g. `grpc_server_started_total{grpc_method="LeaseKeepAlive"`).
    pub fn metric(&self, selector: &str) -> f64 {
        use std::io::{Read, Write};
        let host = self.endpoint.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(host).unwrap();
        write!(stream, "GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).unwrap();
        text.lines()
            .filter(|line| line.starts_with(selector))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Etcd {
    pub fn signal(&self, signal: &str) {
        Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The directory holding the workspace's binaries (built by `cargo build --bins`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // A test executable lives in target/<profile>/deps; the benchmark next to the binaries.
    let beside = exe.parent().unwrap().join(name);
    if beside.exists() {
        return beside;
    }
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --bins` before the tests",
        path.display()
    );
    path
}

/// A spawned binary whose output goes to a log file; SIGKILLed on drop.
pub struct Process {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Process {
    pub fn spawn(name: &str, program: &Path, args: &[&str], env: &[(&str, &str)], dir: &Path) -> Process {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(program);
        command
            .args(args)
            .env("RUST_LOG", std::env::var("TIDEMARK_CHILD_LOG").unwrap_or("info".into()))
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().unwrap();
        Process {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, signal: &str) {
        Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
    }

    /// Waits for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the process's log contains `needle`; panics with the log after `timeout`.
    pub async fn wait_for_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log_text();
            if log.contains(needle) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for {needle:?} in {}'s log:\n{log}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let text = self.log_text();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("---- last lines of {} ----", self.name);
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// Settings of the one task a test cluster runs.
#[derive(Clone)]
pub struct TaskSettings {
    pub source_table: String,
    pub key: Vec<String>,
    pub cursor_column: String,
    pub shards: u32,
    pub page_size: u32,
    pub safety_delay: &'static str,
    pub poll_interval: &'static str,
    pub lease_ttl: &'static str,
    pub overlap: &'static str,
    pub open_transaction_bound: bool,
    /// Extra `key = value` lines for the task table.
    pub extra: String,
    /// Environment for the coordinator process.
    pub coordinator_env: Vec<(&'static str, String)>,
    pub staging_retention: &'static str,
    /// Extra `key = value` lines for the `[coordinator]` table.
    pub coordinator_extra: String,
    /// The target table; empty: the source table's name.
    pub target_table: String,
    /// The task's source URL; empty: the cluster's source database as `postgres`.
    pub source_url: String,
    /// The staging URL; empty: a `file://` directory of the cluster's.
    pub staging_url: String,
    /// The task's target URL; empty: the cluster's target database.
    pub target_url: String,
}

impl Default for TaskSettings {
    fn default() -> TaskSettings {
        TaskSettings {
            source_table: "public.items".into(),
            key: vec!["id".into()],
            cursor_column: "updated_at".into(),
            shards: 8,
            page_size: 5000,
            safety_delay: "1s",
            poll_interval: "200ms",
            lease_ttl: "4s",
            overlap: "2s",
            open_transaction_bound: true,
            extra: String::new(),
            coordinator_env: Vec::new(),
            staging_retention: "1h",
            coordinator_extra: String::new(),
            target_table: String::new(),
            source_url: String::new(),
            staging_url: String::new(),
            target_url: String::new(),
        }
    }
}

/// Source, target and control databases, etcd, a coordinator and any number of workers.
/// Fields drop in declaration order: processes first (printing their logs when a test
/// fails), then etcd and the databases, then the directory holding the logs.
pub struct Cluster {
    pub workers: Vec<Process>,
    pub coordinator: Option<Process>,
    pub etcd: Etcd,
    pub source: TestDb,
    pub target: TestDb,
    pub control: TestDb,
    pub dir: TempDir,
    pub address: String,
    pub config_path: PathBuf,
    /// Where workers reach the coordinator, when not directly (e.g. through a fault proxy).
    pub worker_address: Option<String>,
    /// The coordinator serves TLS (`tls` in `coordinator_extra`): its address is `https://`.
    pub https: bool,
    /// Environment of every coordinator, worker and CLI process (S3 credentials, say), and
    /// the harness's own status client's TLS settings (`TIDEMARK_TLS_*`).
    pub client_env: Vec<(String, String)>,
    restarts: u32,
    /// This cluster's share of the server's connections; released last.
    _slot: ClusterSlot,
}

/// How many clusters run at once on this machine, across every test process (cargo test runs
/// one process per suite, nextest one per test). Each holds about ten PostgreSQL connections
/// (coordinator, workers, the harness's pools), and the server allows 100: nine at once ran it
/// out (`too many clients`, seen as `PoolTimedOut`). A slot is an exclusive lock on one of
/// `TIDEMARK_TEST_CLUSTERS` (default 5) files in the temp directory; the kernel drops it when
/// the process ends, however it ends. Further clusters wait for a slot.
pub struct ClusterSlot(#[allow(dead_code)] Option<std::fs::File>);

/// Set by a process that holds every slot (`all_cluster_slots`) for the processes it runs:
/// their clusters are within its share, and must not wait for a slot it holds.
pub const SLOTS_HELD_BY_PARENT: &str = "TIDEMARK_TEST_SLOTS_HELD";

fn slot_files() -> Vec<std::fs::File> {
    let slots: usize = std::env::var("TIDEMARK_TEST_CLUSTERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let dir = std::env::temp_dir().join("tidemark-test-slots");
    std::fs::create_dir_all(&dir).unwrap();
    (0..slots)
        .map(|n| {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(dir.join(format!("slot-{n}")))
                .unwrap()
        })
        .collect()
}

async fn cluster_slot() -> ClusterSlot {
    if std::env::var_os(SLOTS_HELD_BY_PARENT).is_some() {
        return ClusterSlot(None);
    }
    loop {
        for file in slot_files() {
            if file.try_lock().is_ok() {
                return ClusterSlot(Some(file));
            }
        }
        // Held by other tests: wait for one to finish.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every slot, for a run that needs the machine to itself (the benchmark's smoke run, whose
/// parallel pipes, pools and `CHECKPOINT` would otherwise share the server's connections and
/// disk with the clusters beside it). Blocks until each is free, taking them in order, so
/// that two such callers cannot deadlock. The processes it runs get `SLOTS_HELD_BY_PARENT`.
pub fn all_cluster_slots() -> Vec<ClusterSlot> {
    slot_files()
        .into_iter()
        .map(|file| {
            file.lock().unwrap();
            ClusterSlot(Some(file))
        })
        .collect()
}

impl Cluster {
    /// Creates the databases and etcd; the caller fills the source before `start`.
    pub async fn new(tag: &str) -> Cluster {
        let slot = cluster_slot().await;
        Cluster::in_slot(tag, TestDb::create(&format!("{tag}_src")).await, slot).await
    }

    /// A cluster whose source database is `source` (e.g. on a private server).
    pub async fn with_source(tag: &str, source: TestDb) -> Cluster {
        Cluster::in_slot(tag, source, cluster_slot().await).await
    }

    async fn in_slot(tag: &str, source: TestDb, slot: ClusterSlot) -> Cluster {
        Cluster {
            _slot: slot,
            source,
            target: TestDb::create(&format!("{tag}_dst")).await,
            control: TestDb::create(&format!("{tag}_ctl")).await,
            etcd: Etcd::start(),
            dir: TempDir::new(tag),
            address: String::new(),
            config_path: PathBuf::new(),
            worker_address: None,
            https: false,
            client_env: Vec::new(),
            restarts: 0,
            coordinator: None,
            workers: Vec::new(),
        }
    }

    pub fn write_config(&mut self, task: &TaskSettings) -> PathBuf {
        let port = free_port();
        let scheme = if self.https { "https" } else { "http" };
        self.address = format!("{scheme}://127.0.0.1:{port}");
        let key = task.key.iter().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", ");
        let config = format!(
            r#"[coordinator]
listen = "127.0.0.1:{port}"
etcd_endpoints = ["{etcd}"]
control_db = "{control}"
staging = "{staging}"
lease_ttl = "{ttl}"
staging_retention = "{retention}"
{coordinator_extra}
[[tasks]]
name = "items"
source = "{source}"
source_table = "{source_table}"
target = "{target}"
target_table = "{target_table}"
key = [{key}]
{cursor_line}
shards = {shards}
page_size = {page_size}
safety_delay = "{safety}"
poll_interval = "{poll}"
overlap = "{overlap}"
open_transaction_bound = {bound}
{extra}
"#,
            etcd = self.etcd.endpoint,
            control = self.control.url,
            staging = if task.staging_url.is_empty() {
                format!("file://{}", self.dir.0.join("staging").display())
            } else {
                task.staging_url.clone()
            },
            ttl = task.lease_ttl,
            retention = task.staging_retention,
            coordinator_extra = task.coordinator_extra,
            source = if task.source_url.is_empty() {
                &self.source.url
            } else {
                &task.source_url
            },
            source_table = task.source_table,
            target_table = if task.target_table.is_empty() {
                &task.source_table
            } else {
                &task.target_table
            },
            target = if task.target_url.is_empty() {
                &self.target.url
            } else {
                &task.target_url
            },
            cursor_line = if task.cursor_column.is_empty() {
                String::new()
            } else {
                format!("cursor_column = {:?}", task.cursor_column)
            },
            shards = task.shards,
            page_size = task.page_size,
            safety = task.safety_delay,
            poll = task.poll_interval,
            overlap = task.overlap,
            bound = task.open_transaction_bound,
            extra = task.extra,
        );
        self.config_path = self.dir.0.join("tidemark.toml");
        std::fs::write(&self.config_path, config).unwrap();
        self.config_path.clone()
    }

    pub async fn start(&mut self, task: &TaskSettings) {
        let config = self.write_config(task);
        let env: Vec<(&str, &str)> = task.coordinator_env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        self.launch_coordinator(&config, &env).await;
    }

    /// Starts (or restarts) the coordinator on `config` and waits until it answers.
    pub async fn launch_coordinator(&mut self, config: &Path, env: &[(&str, &str)]) {
        if let Some(mut old) = self.coordinator.take() {
            old.kill9();
            let name = format!("coordinator-{}", self.restarts);
            let _ = std::fs::rename(&old.log, self.dir.0.join(format!("{name}.log")));
        }
        self.restarts += 1;
        let env: Vec<(&str, &str)> = self
            .client_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(env.iter().copied())
            .collect();
        let coordinator = Process::spawn(
            "coordinator",
            &binary("tidemark-coordinator"),
            &["serve", "--config", config.to_str().unwrap()],
            &env,
            &self.dir.0,
        );
        self.coordinator = Some(coordinator);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.try_status().await.is_some() {
                return;
            }
            if let Some(status) = self.coordinator.as_mut().unwrap().child.try_wait().unwrap() {
                panic!(
                    "coordinator exited with {status}: {}",
                    self.coordinator.as_ref().unwrap().log_text()
                );
            }
            assert!(Instant::now() < deadline, "coordinator did not answer within 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Starts the coordinator on `task` expecting it to refuse: it must exit non-zero within
    /// 60 s. Returns its log.
    pub fn refused_start(&mut self, task: &TaskSettings) -> String {
        let config = self.write_config(task);
        let env: Vec<(&str, &str)> = task.coordinator_env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut coordinator = Process::spawn(
            "refused-coordinator",
            &binary("tidemark-coordinator"),
            &["serve", "--config", config.to_str().unwrap()],
            &env,
            &self.dir.0,
        );
        let status = coordinator.wait_exit(Duration::from_secs(60));
        let log = coordinator.log_text();
        assert!(
            status.is_some_and(|s| !s.success()),
            "the coordinator was expected to refuse the task; status {status:?}, log:\n{log}"
        );
        log
    }

    pub fn spawn_worker(&mut self, id: &str, max_shards: u32, env: &[(&str, &str)]) -> usize {
        let max = max_shards.to_string();
        let worker = Process::spawn(
            id,
            &binary("tidemark-worker"),
            &[
                "--coordinator",
                self.worker_address.as_deref().unwrap_or(&self.address),
                "--id",
                id,
                "--max-shards",
                &max,
            ],
            &self
                .client_env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .chain(env.iter().copied())
                .collect::<Vec<_>>(),
            &self.dir.0,
        );
        self.workers.push(worker);
        self.workers.len() - 1
    }

    /// None when the coordinator does not answer within 10 s: a probe must not hold its
    /// caller (a fault loop that has to notice the coordinator's death) for longer.
    pub async fn try_status(&self) -> Option<pb::StatusResponse> {
        let tls = tidemark_common::tls::ClientTls::from_lookup(|name| {
            self.client_env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        });
        let call = async {
            let channel = tls.endpoint(&self.address).ok()?.connect().await.ok()?;
            let mut client = tidemark_proto::admin_client(channel);
            Some(client.status(pb::StatusRequest {}).await.ok()?.into_inner())
        };
        tokio::time::timeout(Duration::from_secs(10), call).await.ok().flatten()
    }

    /// Runs `tidemark-coordinator ARGS…` against this cluster and returns (success, stdout,
    /// stderr).
    pub fn cli(&self, args: &[&str]) -> (bool, String, String) {
        let output = Command::new(binary("tidemark-coordinator"))
            .args(args)
            .envs(self.client_env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    }

    /// A CLI command against this cluster's coordinator with `--json`: its parsed output
    /// (the command must succeed).
    pub fn cli_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["--json", "--coordinator", self.address.as_str()]);
        let (ok, stdout, stderr) = self.cli(&all);
        assert!(ok, "{args:?}: {stderr}");
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))
    }

    /// `source install` for the task in the written config.
    pub fn source_install(&self) -> String {
        let (ok, stdout, stderr) = self.cli(&[
            "source",
            "install",
            "--task",
            "items",
            "--config",
            self.config_path.to_str().unwrap(),
        ]);
        assert!(ok, "source install: {stderr}");
        stdout
    }

    /// Runs `reconcile --task items ARGS… --json` and waits for its result.
    pub fn reconcile(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec![
            "reconcile",
            "--task",
            "items",
            "--coordinator",
            self.address.as_str(),
            "--json",
        ];
        all.extend_from_slice(args);
        let (ok, stdout, stderr) = self.cli(&all);
        assert!(ok, "reconcile failed: {stderr}");
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("reconcile --json printed {stdout:?}: {e}"))
    }

    pub async fn task_status(&self) -> pb::TaskStatus {
        let status = self.try_status().await.expect("coordinator answers status");
        status.tasks.into_iter().next().expect("one task")
    }

    /// Polls status until `done` holds; panics with the last status after `timeout`.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&pb::TaskStatus) -> bool,
    ) -> pb::TaskStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status().await
                && let Some(task) = status.tasks.into_iter().next()
            {
                if done(&task) {
                    return task;
                }
                if Instant::now() > deadline {
                    panic!("timed out after {timeout:?} waiting for {what}; last status: {task:?}");
                }
            } else if Instant::now() > deadline {
                panic!("timed out after {timeout:?} waiting for {what}; coordinator not answering");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The per-key comparison of the `items` fixture (every column, version = cursor time).
    pub async fn items_diff(&self) -> Diff {
        compare(
            &self.source.pool,
            &self.target.pool,
            &["id"],
            ITEM_COLUMNS,
            "updated_at",
        )
        .await
    }

    /// Runs `sql` on the source, waits until the watermark passes it, and checks `items`
    /// per key.
    pub async fn write_and_converge(&self, sql: &str, context: &str) {
        self.source.exec(sql).await;
        let end = self.source_now_micros().await;
        self.wait_for_watermark(end, Duration::from_secs(60)).await;
        self.items_diff().await.assert_clean(context);
    }

    /// Row counts of the committed batches in commit order, after checking that their bounds
    /// chain (each starts where the previous one ended): none skipped, none read twice.
    pub async fn committed_batch_counts(&self) -> Vec<i64> {
        let batches =
            sqlx::query("SELECT row_count, lower, upper FROM batches WHERE state = 'COMMITTED' ORDER BY committed_at")
                .fetch_all(&self.control.pool)
                .await
                .unwrap();
        for pair in batches.windows(2) {
            let upper: serde_json::Value = pair[0].get(2);
            let lower: serde_json::Value = pair[1].get(1);
            assert_eq!(upper, lower, "each page starts where the previous one ended");
        }
        batches.iter().map(|b| b.get(0)).collect()
    }

    /// How many staged manifests name each data format (`pg_copy_binary+lz4`, …).
    pub fn staged_formats(&self) -> BTreeMap<String, usize> {
        fn walk(dir: &Path, formats: &mut BTreeMap<String, usize>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let name = entry.file_name().to_string_lossy().into_owned();
                if path.is_dir() {
                    walk(&path, formats);
                } else if name.starts_with("manifest-") && name.ends_with(".json") {
                    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
                    let format = manifest["data_format"].as_str().unwrap_or("?").to_string();
                    *formats.entry(format).or_default() += 1;
                }
            }
        }
        let mut formats = BTreeMap::new();
        walk(&self.dir.0.join("staging"), &mut formats);
        formats
    }

    /// Source clock now, in microseconds (the watermark is in source time).
    pub async fn source_now_micros(&self) -> i64 {
        sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
            .fetch_one(&self.source.pool)
            .await
            .unwrap()
    }

    /// Waits until every shard's committed cursor is past `t_micros`: every change that
    /// committed in the source before then is in the target.
    /// Waits until `epoch` (planned by `tasks reinit`) runs incremental with its watermark past
    /// `after_micros` and its reinit reconciliation has finished.
    pub async fn wait_for_reinit(&self, epoch: u64, after_micros: i64, timeout: Duration) -> pb::TaskStatus {
        self.wait_for(&format!("epoch {epoch} converged and reconciled"), timeout, |t| {
            t.epoch == epoch
                && t.phase == "incremental"
                && t.watermark_micros.is_some_and(|w| w > after_micros)
                && t.last_reconcile
                    .as_ref()
                    .is_some_and(|r| r.reason == "reinit" && r.finished)
        })
        .await
    }

    pub async fn wait_for_watermark(&self, t_micros: i64, timeout: Duration) -> pb::TaskStatus {
        self.wait_for(&format!("watermark past {t_micros}"), timeout, |t| {
            t.watermark_micros.is_some_and(|w| w > t_micros)
        })
        .await
    }
}

/// One key's state on one side: every column as text, and the source version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyState {
    pub row: String,
    pub version: i64,
}

/// Per-key differences between the expected target (derived from the source) and the target.
#[derive(Debug, Default)]
pub struct Diff {
    pub keys: usize,
    pub lost: Vec<String>,
    pub stale: Vec<(String, KeyState, KeyState)>,
    pub phantom: Vec<String>,
}

impl Diff {
    pub fn assert_clean(&self, context: &str) {
        assert!(
            self.lost.is_empty() && self.stale.is_empty() && self.phantom.is_empty(),
            "{context}: {} keys; {} lost (e.g. {:?}), {} stale (e.g. {:?}), {} phantom (e.g. {:?})",
            self.keys,
            self.lost.len(),
            self.lost.iter().take(3).collect::<Vec<_>>(),
            self.stale.len(),
            self.stale.iter().take(2).collect::<Vec<_>>(),
            self.phantom.len(),
            self.phantom.iter().take(3).collect::<Vec<_>>(),
        );
    }
}

pub async fn key_states(
    pool: &PgPool,
    table: &str,
    key: &[&str],
    columns: &[&str],
    version_expr: &str,
) -> BTreeMap<String, KeyState> {
    let key_expr = format!("json_build_array({})::text", key.join(", "));
    let row_expr = format!("json_build_array({})::text", columns.join(", "));
    let sql = format!("SELECT {key_expr}, {row_expr}, {version_expr} FROM {table}");
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|row| {
            (
                row.get::<String, _>(0),
                KeyState {
                    row: row.get(1),
                    version: row.get(2),
                },
            )
        })
        .collect()
}

/// Expected(Source, boundary = everything committed before the watermark, deletes = none):
/// every source key present in the target with every column equal and version = the cursor
/// time in microseconds; no other keys in the target.
pub async fn compare(source: &PgPool, target: &PgPool, key: &[&str], columns: &[&str], cursor: &str) -> Diff {
    let version = format!("(extract(epoch from {cursor}) * 1000000)::bigint");
    compare_table(source, target, "items", key, columns, &version).await
}

/// `compare` for any table, with the source version given as a SQL expression.
pub async fn compare_table(
    source: &PgPool,
    target: &PgPool,
    table: &str,
    key: &[&str],
    columns: &[&str],
    source_version: &str,
) -> Diff {
    let expected = key_states(source, table, key, columns, source_version).await;
    let actual = key_states(target, table, key, columns, "_tidemark_version").await;
    let mut diff = Diff {
        keys: expected.len(),
        ..Diff::default()
    };
    for (key, want) in &expected {
        match actual.get(key) {
            None => diff.lost.push(key.clone()),
            Some(have) if have != want => diff.stale.push((key.clone(), want.clone(), have.clone())),
            Some(_) => {}
        }
    }
    diff.phantom = actual.keys().filter(|k| !expected.contains_key(*k)).cloned().collect();
    diff
}

/// The first key column of the `items` fixture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    Bigint,
    Uuid,
    /// `'user-' || n`: text ordered by the column's collation, split at sampled quantiles.
    Text,
}

/// Columns compared per key (every column of the fixture).
pub const ITEM_COLUMNS: &[&str] = &["id", "seq", "name", "qty", "price", "payload", "note", "updated_at"];

/// Creates `items` with `rows` rows: text with tabs, newlines, backslashes, quotes and
/// non-ASCII; NULLs; numerics; jsonb; cursor times spread over the last hour with ties.
pub async fn create_items(db: &TestDb, key: KeyKind, rows: i64) {
    let id_type = match key {
        KeyKind::Bigint => "bigint PRIMARY KEY",
        KeyKind::Uuid => "uuid PRIMARY KEY DEFAULT gen_random_uuid()",
        KeyKind::Text => "text PRIMARY KEY",
    };
    db.exec(&format!(
        "CREATE TABLE items (
            id {id_type},
            seq bigint NOT NULL UNIQUE,
            name text NOT NULL,
            qty integer,
            price numeric(12,2),
            payload jsonb,
            note text,
            updated_at timestamptz(3) NOT NULL
        );
        CREATE INDEX items_cursor ON items (updated_at, id);"
    ))
    .await;
    insert_items(
        db,
        key,
        1,
        rows,
        "now() - interval '1 hour' + (g % 3600) * interval '1 second'",
    )
    .await;
}

/// Inserts rows with `seq` in `[first, first + count)`; `updated_at` is the given SQL over `g`.
pub async fn insert_items(db: &TestDb, key: KeyKind, first: i64, count: i64, updated_at: &str) {
    let id = match key {
        KeyKind::Bigint => "g",
        KeyKind::Uuid => "gen_random_uuid()",
        KeyKind::Text => "'user-' || g",
    };
    let last = first + count - 1;
    db.exec(&format!(
        "INSERT INTO items (id, seq, name, qty, price, payload, note, updated_at)
         SELECT {id}, g,
                CASE WHEN g % 997 = 0 THEN E'tab\\there\\nnew line \\\\ back ''quote'' \u{fc}n\u{ef}c\u{f6}de ' || g ELSE 'item ' || g END,
                CASE WHEN g % 7 = 0 THEN NULL ELSE (g % 1000)::int END,
                (g % 100000) / 100.0,
                CASE WHEN g % 5 = 0 THEN NULL ELSE jsonb_build_object('g', g, 'tags', jsonb_build_array('x', g % 3)) END,
                CASE WHEN g % 3 = 0 THEN NULL ELSE repeat('n', (g % 40)::int) END,
                {updated_at}
         FROM generate_series({first}, {last}) g"
    ))
    .await;
}

/// A live writer: `rounds` rounds of 250 updates (spread over every shard), 250 inserts and
/// 50 soft deletes (a flag in a data column), each statement its own transaction. Returns the
/// source time after the last commit.
pub async fn write_changes(db: &TestDb, key: KeyKind, existing_rows: i64, rounds: i64) -> i64 {
    let stride = (existing_rows / (rounds * 250)).max(1);
    for round in 0..rounds {
        let from = round * 250;
        db.exec(&format!(
            "UPDATE items SET name = name || ' ~r{round}', qty = coalesce(qty, 0) + 1, updated_at = clock_timestamp()
             WHERE seq IN (SELECT 1 + {stride} * j FROM generate_series({from}, {from} + 249) j)"
        ))
        .await;
        insert_items(db, key, existing_rows + from + 1, 250, "clock_timestamp()").await;
        db.exec(&format!(
            "UPDATE items SET note = 'deleted', updated_at = clock_timestamp()
             WHERE seq IN (SELECT 2 + {stride} * j FROM generate_series({from}, {from} + 49) j)"
        ))
        .await;
    }
    sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// The statements of a task that reads `table` into the table of the same name, with these
/// columns (name, type), keyed by `keys`, paged by an `updated_at` cursor, its version the
/// cursor time, upserting as COPY text. Other settings by struct update.
pub fn cursor_table_sql(table: &str, columns: &[(String, String)], keys: &[&str]) -> tidemark_common::pg::TableSql {
    use tidemark_common::pg::{Column, TableName, TableSql};
    TableSql {
        source: TableName::parse(table).unwrap(),
        target: TableName::parse(table).unwrap(),
        columns: columns
            .iter()
            .map(|(name, sql_type)| Column {
                name: name.clone(),
                sql_type: sql_type.clone(),
            })
            .collect(),
        key_columns: keys.iter().map(|k| k.to_string()).collect(),
        cursor_column: Some("updated_at".into()),
        version_column: None,
        deletes: None,
        filter: None,
        page_format: tidemark_common::copy_format::CopyFormat::Text,
        cursor_zone: None,
    }
}
