//! `tidemark sync`: the coordinator and its workers in one process, over real gRPC on
//! loopback, with in-process leases and the control state in the embedded store (a SQLite file
//! in the state directory) or a PostgreSQL schema (`--control`).
//! The protocol is the cluster's, unchanged: fences, ledger, CAS and staging are the same, so a
//! killed run resumes from its checkpoints when the same command runs again.
//!
//! Exit codes: 0 done (`--once` caught up, or `--follow` stopped by Ctrl-C/SIGTERM after
//! draining); 1 a task paused (its reason printed); 2 a problem with what was asked (one line
//! naming the flag, the table or the column); 130 `--once` interrupted.

mod plan;
mod progress;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tidemark_common::telemetry::{self, LogFormat};
use tidemark_coordinator::admin_cli::fetch_status;
use tidemark_coordinator::serve::Listen;
use tidemark_proto::v1 as pb;
use tidemark_worker::runner::{WorkerOptions, tune_malloc};
use tokio::sync::{oneshot, watch};

use plan::{Plan, Usage};
use progress::{Progress, Style, thousands};

#[derive(clap::Args)]
pub struct SyncArgs {
    /// Source database URL (`postgres://…`, `mysql://…`, `mariadb://…`).
    #[arg(long, env = "TIDEMARK_SOURCE", required_unless_present = "config")]
    source: Option<String>,
    /// Source table, `schema.table` (MySQL: `database.table`).
    #[arg(long, required_unless_present = "config")]
    table: Option<String>,
    /// Target database URL.
    #[arg(long, env = "TIDEMARK_TARGET", required_unless_present = "config")]
    target: Option<String>,
    /// Target table; default: the source table's name.
    #[arg(long)]
    target_table: Option<String>,
    /// Key columns, comma-separated; default: the source table's primary key.
    #[arg(long, value_delimiter = ',')]
    key: Vec<String>,
    /// The NOT NULL timestamp column every change sets (upsert mode); default: the one named
    /// like an update time (`updated_at`, …), or the only NOT NULL timestamp column.
    #[arg(long)]
    cursor: Option<String>,
    /// `upsert` (snapshot, then changes by cursor) or `append` (rows are only added; by key).
    /// `accumulate` needs a task in a --config file.
    #[arg(long, default_value = "upsert", value_parser = ["upsert", "append", "accumulate"])]
    mode: String,
    /// Snapshot and catch up to the source's clock at start, then exit (the default).
    #[arg(long, conflicts_with = "follow")]
    once: bool,
    /// Keep syncing until Ctrl-C or SIGTERM, then finish the batches in flight and exit.
    #[arg(long)]
    follow: bool,
    /// Workers in this process.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Shards to split the table into (default 8).
    #[arg(long)]
    shards: Option<u32>,
    /// Task name; default: the table's name.
    #[arg(long)]
    name: Option<String>,
    /// Where the control state lives: default the embedded store, `<state>/<name>.control.db`;
    /// `target` (a PostgreSQL target's database) or `postgres://…`: the schema
    /// `tidemark_<name>` there; `sqlite://FILE`: that file.
    #[arg(long, env = "TIDEMARK_CONTROL")]
    control: Option<String>,
    /// Directory for the control state and the staging store (batches before they are
    /// applied).
    #[arg(long, default_value = ".tidemark")]
    state: PathBuf,
    /// Run a config file's tasks instead (its [coordinator] keeps control_db and staging; etcd
    /// and TLS settings are ignored).
    #[arg(long, conflicts_with_all = ["source", "table", "target", "target_table", "key", "cursor", "name", "shards", "control"])]
    config: Option<PathBuf>,
    /// Progress as JSON lines.
    #[arg(long)]
    json: bool,
    /// Log at `info` (default `warn`; RUST_LOG overrides both).
    #[arg(long)]
    verbose: bool,
}

/// How a sync ended, other than done.
enum Ended {
    Usage(String),
    Paused(String),
    Interrupted,
    Failed(String),
}

impl From<Usage> for Ended {
    fn from(usage: Usage) -> Ended {
        Ended::Usage(usage.0)
    }
}

pub fn main(args: SyncArgs) -> ExitCode {
    tune_malloc();
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let telemetry = {
        let _guard = runtime.enter();
        let filter = if args.verbose {
            "info,sqlx=warn,h2=warn,tower=warn,hyper=warn"
        } else {
            "warn,sqlx=error"
        };
        telemetry::init_with_filter("tidemark", LogFormat::Human, Some(String::new()), filter)
    };
    let result = runtime.block_on(run(args));
    drop(telemetry);
    // The coordinator's and workers' loops still running end with the runtime.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Ended::Usage(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
        Err(Ended::Paused(message)) => {
            eprintln!("paused: {message}");
            ExitCode::from(1)
        }
        Err(Ended::Failed(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
        Err(Ended::Interrupted) => {
            eprintln!("interrupted: run the same command again to resume from the checkpoints");
            ExitCode::from(130)
        }
    }
}

async fn plan(args: &SyncArgs) -> Result<Plan, Ended> {
    if let Some(path) = &args.config {
        return Ok(plan::from_config_file(path)?);
    }
    let (Some(source), Some(table)) = (&args.source, &args.table) else {
        return Ok(plan::from_flags(args, None)?);
    };
    plan::check_url("--source", source)?;
    if let Some(target) = &args.target {
        plan::check_url("--target", target)?;
    }
    let found = tidemark_coordinator::discover::discover(source, table)
        .await
        .map_err(|e| Ended::Usage(e.to_string()))?;
    Ok(plan::from_flags(args, found.as_ref())?)
}

/// Is every task done for `--once`: snapshot complete and the watermark past the source's
/// clock at start (append mode, which has no watermark: snapshot complete).
fn caught_up(status: &pb::StatusResponse, start_micros: &std::collections::HashMap<String, i64>) -> bool {
    status.tasks.iter().all(|task| {
        task.snapshot_complete
            && match (task.watermark_micros, start_micros.get(&task.name)) {
                (Some(watermark), Some(start)) => watermark >= *start,
                (None, _) => task.mode == "append",
                (Some(_), None) => true,
            }
    })
}

async fn run(args: SyncArgs) -> Result<(), Ended> {
    if args.workers == 0 {
        return Err(Ended::Usage("--workers must be at least 1".into()));
    }
    let Plan { config, notes } = plan(&args).await?;
    for note in &notes {
        eprintln!("tidemark: {note}");
    }
    let follow = args.follow;
    let started = Instant::now();
    // The point `--once` catches up to, on each source's own clock.
    let mut start_micros = std::collections::HashMap::new();
    for task in &config.tasks {
        let now = tidemark_coordinator::planner::source_now_micros(task)
            .await
            .map_err(|e| Ended::Usage(format!("task {}: source: {e}", task.name)))?;
        start_micros.insert(task.name.clone(), now);
    }
    let shards: u32 = config.tasks.iter().map(|t| t.shards).sum();
    let max_shards = shards.div_ceil(args.workers).max(1);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Ended::Failed(format!("cannot listen on loopback: {e}")))?;
    let address = format!(
        "http://{}",
        listener.local_addr().map_err(|e| Ended::Failed(e.to_string()))?
    );
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let mut coordinator = tokio::spawn(tidemark_coordinator::serve::serve(
        config.clone(),
        Listen::Bound(listener),
        async {
            let _ = shutdown_rx.await;
        },
    ));

    // Serving once `status` answers; a task that cannot start (no such column, no grant, …)
    // ends the coordinator first, with the reason.
    loop {
        tokio::select! {
            ended = &mut coordinator => return Err(Ended::Usage(coordinator_ended(ended))),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                if fetch_status(&address).await.is_ok() {
                    break;
                }
            }
        }
    }

    let planned = started.elapsed();
    eprintln!("tidemark: admin commands reach this sync at --coordinator {address} (e.g. `tidemark status`)");
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut workers = Vec::new();
    for n in 0..args.workers {
        let options = WorkerOptions {
            coordinator: address.clone(),
            id: format!("sync-{}-{n}", std::process::id()),
            max_shards,
        };
        let stop = stop_rx.clone();
        workers.push(tokio::spawn(async move {
            tidemark_worker::runner::run(&options, stop).await
        }));
    }

    let style = if args.json {
        Style::Json
    } else if std::io::stdout().is_terminal() {
        Style::Terminal
    } else {
        Style::Plain
    };
    let mut progress = Progress::new(style);
    let mut interrupted = false;
    let mut last = None;
    let mut reported: Option<Instant> = None;
    let poll = if follow {
        Duration::from_secs(1)
    } else {
        Duration::from_millis(200)
    };
    let (signal_tx, mut signalled) = oneshot::channel::<()>();
    tokio::spawn(async move {
        tidemark_coordinator::serve::shutdown_signal().await;
        let _ = signal_tx.send(());
    });
    let outcome: Result<(), Ended> = loop {
        tokio::select! {
            _ = &mut signalled => {
                interrupted = true;
                break Ok(());
            }
            ended = &mut coordinator => break Err(Ended::Failed(coordinator_ended(ended))),
            // `--once` checks five times a second (its end is seen within 200 ms);
            // `--follow`, which has no end to see, once a second. Reports once a second.
            _ = tokio::time::sleep(poll) => {
                let Ok(status) = fetch_status(&address).await else { continue };
                if reported.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                    // The lag shown is against this host's clock (the source's is read once,
                    // for the end point).
                    progress.report(&status, now_micros());
                    reported = Some(Instant::now());
                }
                if let Some(task) = status.tasks.iter().find(|t| !t.paused_reason.is_empty()) {
                    break Err(Ended::Paused(format!("task {}: {}", task.name, task.paused_reason)));
                }
                let done = !follow && caught_up(&status, &start_micros);
                last = Some(status);
                if done {
                    break Ok(());
                }
            }
        }
    };

    let synced = started.elapsed();
    // Drain: every worker finishes its batch in flight and releases its shards.
    let _ = stop_tx.send(true);
    if interrupted {
        eprintln!("tidemark: stopping: finishing the batches in flight");
    }
    for worker in workers {
        match tokio::time::timeout(Duration::from_secs(60), worker).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => eprintln!("tidemark: a worker ended with: {error}"),
            Ok(Err(error)) => eprintln!("tidemark: a worker failed: {error}"),
            Err(_) => eprintln!("tidemark: a worker did not stop within 60 s"),
        }
    }
    if let Ok(status) = fetch_status(&address).await {
        last = Some(status);
    }
    let _ = shutdown_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), coordinator).await;
    outcome?;
    if interrupted && !follow {
        return Err(Ended::Interrupted);
    }
    if let Some(status) = last {
        for task in &status.tasks {
            let caught = match task.watermark_micros {
                Some(watermark) => format!(", caught up to {} on the source's clock", format_micros(watermark)),
                None => String::new(),
            };
            println!(
                "{}: {} rows applied{caught}; {:.1}s ({:.1}s to plan, {:.1}s to sync, {:.1}s to stop)",
                task.name,
                thousands(task.rows_applied),
                started.elapsed().as_secs_f64(),
                planned.as_secs_f64(),
                (synced - planned).as_secs_f64(),
                (started.elapsed() - synced).as_secs_f64(),
            );
        }
    }
    Ok(())
}

/// Why the coordinator's task ended, in one line.
fn coordinator_ended(ended: Result<anyhow::Result<()>, tokio::task::JoinError>) -> String {
    match ended {
        Ok(Ok(())) => "the coordinator stopped".to_string(),
        Ok(Err(error)) => format!("{error:#}").replace('\n', " "),
        Err(error) => error.to_string(),
    }
}

fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// Microseconds since the epoch as UTC time.
fn format_micros(micros: i64) -> String {
    chrono::DateTime::from_timestamp_micros(micros)
        .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_else(|| micros.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micros_print_as_utc() {
        assert_eq!(format_micros(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_micros(1_796_212_800_000_000), "2026-12-02 12:00:00 UTC");
    }
}
