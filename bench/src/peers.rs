//! The tools a data team would otherwise pick for this job, run on the same table in the
//! same run as Tidemark: sling (`--mode incremental --primary-key id --update-key
//! updated_at`) and dlt (`sql_table`, pyarrow backend, merge on `id`). `bench/peers.sh`
//! installs them at pinned versions into a venv of the benchmark's own. Each run is timed
//! from its process's start to its exit, and each target is checked against the source.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use tidemark_tests::{TempDir, TestDb};

#[derive(Clone, Copy, Debug)]
pub(crate) enum Peer {
    Sling,
    Dlt,
}

impl Peer {
    pub(crate) const ALL: [Peer; 2] = [Peer::Sling, Peer::Dlt];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Peer::Sling => "sling 1.4.11",
            Peer::Dlt => "dlt 1.31.0",
        }
    }

    pub(crate) fn tag(self) -> &'static str {
        match self {
            Peer::Sling => "sling",
            Peer::Dlt => "dlt",
        }
    }
}

pub(crate) struct Peers {
    sling: PathBuf,
    python: PathBuf,
    /// Each peer's own state between its runs (dlt's pipelines directory), and their logs.
    dir: TempDir,
}

impl Peers {
    /// Installs the peers if they are not yet (a venv under `target/`, from PyPI).
    pub(crate) fn install() -> Peers {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers.sh");
        let output = Command::new(&script)
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
        assert!(output.status.success(), "{} failed", script.display());
        let text = String::from_utf8_lossy(&output.stdout);
        let path = |name: &str| -> PathBuf {
            text.lines()
                .find_map(|line| line.strip_prefix(name).map(|rest| PathBuf::from(rest.trim())))
                .unwrap_or_else(|| panic!("{} printed no {name} line: {text}", script.display()))
        };
        Peers {
            sling: path("sling "),
            python: path("python "),
            dir: TempDir::new("bench_peers"),
        }
    }

    /// One run of `peer` from `source` into `target`, its state kept from its earlier runs
    /// into the same target (so that a second run is an incremental one); its seconds.
    pub(crate) fn run(&self, peer: Peer, source: &TestDb, target: &TestDb) -> f64 {
        let mut command = match peer {
            Peer::Sling => {
                // TLS as Tidemark's and dlt's drivers negotiate it with this server (`prefer`);
                // sling's driver takes no `prefer`, and `require` is its default.
                let mut command = Command::new(&self.sling);
                command
                    .args([
                        "run",
                        "--src-conn",
                        "TIDEMARK_BENCH_SRC",
                        "--src-stream",
                        "public.bench_items",
                    ])
                    .args(["--tgt-conn", "TIDEMARK_BENCH_TGT", "--tgt-object", "public.bench_items"])
                    .args([
                        "--mode",
                        "incremental",
                        "--primary-key",
                        "id",
                        "--update-key",
                        "updated_at",
                    ])
                    .env("TIDEMARK_BENCH_SRC", format!("{}?sslmode=require", source.url))
                    .env("TIDEMARK_BENCH_TGT", format!("{}?sslmode=require", target.url))
                    .env("SLING_DISABLE_TELEMETRY", "true");
                command
            }
            Peer::Dlt => {
                let mut command = Command::new(&self.python);
                // SQLAlchemy names its driver in the scheme; dlt's destination wants a password
                // even where the server trusts the connection.
                command
                    .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("peers_dlt.py"))
                    .arg(source.url.replacen("postgres://", "postgresql+psycopg2://", 1))
                    .arg(
                        target
                            .url
                            .replacen("postgres://postgres@", "postgresql://postgres:unused@", 1),
                    )
                    .env("DLT_PIPELINES_DIR", self.dir.0.join("dlt"))
                    .env("RUNTIME__DLTHUB_TELEMETRY", "false")
                    .env("RUNTIME__LOG_LEVEL", "WARNING");
                command
            }
        };
        let log = self.dir.0.join(format!("{}.log", peer.tag()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        command
            .current_dir(&self.dir.0)
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        let started = Instant::now();
        let status = command.status().unwrap_or_else(|e| panic!("{}: {e}", peer.name()));
        let secs = started.elapsed().as_secs_f64();
        assert!(
            status.success(),
            "{} failed ({status}):\n{}",
            peer.name(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        secs
    }
}
