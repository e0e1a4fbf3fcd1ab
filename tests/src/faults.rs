//! Fault injection for the chaos suite: a TCP proxy that can blackhole traffic, a private
//! PostgreSQL server that can be restarted with `-m immediate`, and a small seeded RNG so a
//! run can be repeated.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::{TempDir, free_port};

/// A loopback TCP proxy. While blackholed, bytes in both directions are dropped and new
/// connections are held without being connected upstream: the peers see a silent network.
pub struct FaultProxy {
    pub address: String,
    blackhole: Arc<AtomicBool>,
    upstream: Arc<std::sync::Mutex<SocketAddr>>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let blackhole = Arc::new(AtomicBool::new(false));
        let flag = blackhole.clone();
        let upstream = Arc::new(std::sync::Mutex::new(upstream));
        let target = upstream.clone();
        let task = tokio::spawn(async move {
            loop {
                // A failed accept (a connection reset before it was accepted, a descriptor
                // limit) must not end the proxy: every later connect would be refused.
                let client = match listener.accept().await {
                    Ok((client, _)) => client,
                    Err(error) => {
                        eprintln!("fault proxy: accept failed: {error}; accepting again");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let flag = flag.clone();
                let upstream = *target.lock().unwrap();
                tokio::spawn(async move {
                    while flag.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::spawn(pump(client_read, server_write, flag.clone()));
                    tokio::spawn(pump(server_read, client_write, flag));
                });
            }
        });
        FaultProxy {
            address,
            blackhole,
            upstream,
            task,
        }
    }

    /// Connections accepted from now on go to `upstream` (those open stay where they are).
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap() = upstream;
    }

    pub fn set_blackhole(&self, on: bool) {
        self.blackhole.store(on, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    blackhole: Arc<AtomicBool>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if blackhole.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

/// A PostgreSQL server of the test's own (initdb in a scratch directory, run as the
/// `postgres` OS user), so that it can be crashed and restarted without touching the
/// machine's shared server. Stopped on drop.
pub struct PrivatePg {
    pub port: u16,
    pub url: String,
    bin: PathBuf,
    data: PathBuf,
    /// `-c name=value` options of the postmaster.
    settings: String,
    _dir: TempDir,
}

fn postgres_bin_dir() -> Option<PathBuf> {
    let output = Command::new("pg_config").arg("--bindir").output().ok()?;
    let dir = PathBuf::from(String::from_utf8(output.stdout).ok()?.trim());
    if dir.join("initdb").exists() {
        return Some(dir);
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|e| e.path())
        .collect();
    versions.sort();
    versions
        .into_iter()
        .rev()
        .map(|v| v.join("bin"))
        .find(|b| b.join("initdb").exists())
}

/// A scratch directory owned by the `postgres` OS user, and the data directory inside it.
fn postgres_owned_dir() -> Option<(TempDir, PathBuf)> {
    let dir = TempDir::new("pg");
    let chown = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(&dir.0)
        .status()
        .ok()?;
    if !chown.success() {
        return None;
    }
    let _ = Command::new("chmod").args(["755"]).arg(&dir.0).status();
    let data = dir.0.join("data");
    Some((dir, data))
}

fn as_postgres(bin: &Path, tool: &str, args: &[&str]) -> std::process::ExitStatus {
    Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(bin.join(tool))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
}

impl PrivatePg {
    /// None where a private server cannot be run here (no initdb, not root).
    pub fn start() -> Option<PrivatePg> {
        PrivatePg::start_with(&[])
    }

    /// A server started with postmaster settings such as `max_prepared_transactions=8`.
    pub fn start_with(settings: &[&str]) -> Option<PrivatePg> {
        let bin = postgres_bin_dir()?;
        let (dir, data) = postgres_owned_dir()?;
        let data_text = data.to_str()?.to_string();
        if !as_postgres(
            &bin,
            "initdb",
            &["-D", &data_text, "-A", "trust", "-U", "postgres", "--no-sync"],
        )
        .success()
        {
            return None;
        }
        PrivatePg::run(bin, dir, data, settings)
    }

    /// A hot standby of this server: a base backup that streams its WAL (`pg_basebackup -R`).
    pub fn start_standby(&self) -> Option<PrivatePg> {
        let (dir, data) = postgres_owned_dir()?;
        let port = self.port.to_string();
        let data_text = data.to_str()?.to_string();
        let backup = as_postgres(
            &self.bin,
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                &data_text,
                "-R",
                "-X",
                "stream",
                // A fast checkpoint: with the default spread one the backup waits ~90 s.
                "-c",
                "fast",
            ],
        );
        if !backup.success() {
            return None;
        }
        let settings: Vec<&str> = self.settings.split(" -c ").filter(|s| !s.is_empty()).collect();
        PrivatePg::run(self.bin.clone(), dir, data, &settings)
    }

    fn run(bin: PathBuf, dir: TempDir, data: PathBuf, settings: &[&str]) -> Option<PrivatePg> {
        let port = free_port();
        let pg = PrivatePg {
            port,
            url: format!("postgres://postgres@127.0.0.1:{port}"),
            bin,
            data,
            settings: settings.iter().map(|s| format!(" -c {s}")).collect(),
            _dir: dir,
        };
        pg.ctl(&["start"]).then_some(pg)
    }

    fn ctl(&self, action: &[&str]) -> bool {
        let data = self.data.to_str().unwrap();
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off{}",
            self.port, data, self.settings
        );
        let log = format!("{data}/server.log");
        let mut args = vec!["-D", data, "-o", &options, "-l", &log, "-w", "-t", "60"];
        args.extend_from_slice(action);
        as_postgres(&self.bin, "pg_ctl", &args).success()
    }

    /// A crash of the server: every connection dies, uncommitted work is lost.
    pub fn restart_immediate(&self) -> bool {
        self.ctl(&["-m", "immediate", "restart"])
    }

    pub async fn create_database(&self, name: &str) -> String {
        let admin = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{}/postgres", self.url))
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        format!("{}/{name}", self.url)
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.ctl(&["-m", "immediate", "stop"]);
    }
}

/// xorshift64*: enough randomness for fault schedules, repeatable from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[low, high)`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.next_u64() % (high - low).max(1)
    }
}
