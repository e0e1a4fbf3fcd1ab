//! The coordinator's command line (`tidemark-coordinator …`, also `tidemark coordinator …`):
//! `serve` runs a replica, the rest are the operator's admin commands over gRPC.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use tidemark_common::config::Config;
use tidemark_common::telemetry::{self, LogFormat};

use crate::admin_cli;
use crate::admin_cli::EpochAction;

#[derive(Parser)]
#[command(
    name = "tidemark-coordinator",
    version,
    about = "Tidemark coordinator: shard planning, leases, fenced checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// `human` (default) or `json` log lines on stderr; filter with RUST_LOG.
    #[arg(long, global = true, default_value = "human", env = "TIDEMARK_LOG_FORMAT")]
    log_format: LogFormat,
}

/// Where the admin commands reach the coordinator: one or more replica addresses.
#[derive(clap::Args, Clone)]
struct Target {
    /// Coordinator replica URLs, comma-separated (e.g. http://a:7400,http://b:7400).
    /// `https://` uses TLS: TIDEMARK_TLS_CA names the CA certificate (PEM) to trust,
    /// TIDEMARK_TLS_CERT and TIDEMARK_TLS_KEY the operator's own certificate and key.
    #[arg(long, env = "TIDEMARK_COORDINATOR")]
    coordinator: String,
}

#[derive(Subcommand)]
enum Command {
    /// Run the coordinator with a config file.
    Serve {
        #[arg(long, env = "TIDEMARK_CONFIG")]
        config: PathBuf,
    },
    /// Show tasks, shards and watermarks.
    Status {
        #[command(flatten)]
        target: Target,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Refresh in place (plain lines when the output is not a terminal).
        #[arg(long, conflicts_with = "json")]
        watch: bool,
        /// Refresh interval for --watch.
        #[arg(long, default_value = "2s")]
        interval: String,
    },
    /// List, pause, resume or reinitialize tasks.
    Tasks {
        #[command(subcommand)]
        action: TaskAction,
    },
    /// List, split, merge and move shards (safe while tasks run).
    Shards {
        #[command(subcommand)]
        action: ShardAction,
    },
    /// List and drain workers.
    Workers {
        #[command(subcommand)]
        action: WorkerAction,
    },
    /// List, retry and resolve rows that went to a task's dead letters.
    DeadLetters {
        #[command(subcommand)]
        action: DeadLetterAction,
    },
    /// Prepare a task's source table.
    Source {
        #[command(subcommand)]
        action: SourceAction,
    },
    /// Move a control state between stores.
    Control {
        #[command(subcommand)]
        action: ControlAction,
    },
    /// Compare source and target per key range (hashes of key, version and content computed
    /// inside each database) and repair what differs through the batch protocol; waits for the
    /// result.
    Reconcile {
        #[arg(long)]
        task: String,
        /// Only rows whose cursor time lies within this window of now (e.g. `2h`).
        #[arg(long, conflicts_with = "full")]
        since: Option<String>,
        /// The whole table (the default).
        #[arg(long)]
        full: bool,
        /// Return once the run is started instead of waiting for it.
        #[arg(long)]
        no_wait: bool,
        /// `content` (the version and every column) or `versions` (cheaper, blind to drift
        /// at an equal version); default: the task's `reconcile_compare`.
        #[arg(long, value_parser = ["content", "versions"])]
        compare: Option<String>,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum TaskAction {
    /// Every task with its phase, epoch and watermark.
    List {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Stop a task: no shard of it can be acquired and no batch of it commits.
    Pause {
        task: String,
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value = "paused by operator")]
        reason: String,
        #[arg(long)]
        json: bool,
    },
    /// Resume a paused task after its cause was fixed.
    Resume {
        task: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Build a fresh baseline (a new epoch) beside the live table: a full snapshot into a
    /// table of its own, incremental changes, a validation, then the switch. Readers keep the
    /// live table meanwhile.
    Reinit {
        task: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Make the validated new epoch live now (`switch = "manual"`): one target transaction
    /// renames the tables.
    Switch {
        task: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Validate the new epoch again, after a validation that found rows it had missed.
    Validate {
        task: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Bring the previous epoch's retained table back as the live one (within
    /// `epoch_retention` of the switch).
    Rollback {
        task: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ShardAction {
    /// Shards of the current epochs: range, owner, phase, rows, fence, pending operation.
    List {
        #[arg(long)]
        task: Option<String>,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Split a shard in two at a value of the first key column (default: its median key).
    Split {
        #[arg(long)]
        task: String,
        #[arg(long)]
        shard: u32,
        #[arg(long)]
        at: Option<String>,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Merge two adjacent shards into one.
    Merge {
        #[arg(long)]
        task: String,
        first: u32,
        second: u32,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Hand a shard to another worker (its batch in flight finishes first).
    Move {
        #[arg(long)]
        task: String,
        #[arg(long)]
        shard: u32,
        #[arg(long)]
        to: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum WorkerAction {
    /// Registered workers, their liveness and shards.
    List {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Take every shard away from a worker and give it none until it registers again.
    Drain {
        worker: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum DeadLetterAction {
    /// The task's dead letters: key, status, retries, error and payload.
    List {
        #[arg(long)]
        task: String,
        /// Only INIT, RETRY, PROCESSING, RESOLVED or FAILED.
        #[arg(long)]
        status: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Re-apply INIT and RETRY letters (transform included): each row is claimed by one
    /// retrier, applied and marked RESOLVED in one transaction; after the task's
    /// `max_retries` failures it becomes FAILED.
    Retry {
        #[arg(long)]
        task: String,
        /// Only this key (repeatable); default: every INIT and RETRY letter.
        #[arg(long = "key")]
        keys: Vec<String>,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Delete RESOLVED letters resolved longer ago than `--older-than` (e.g. `30d`). Letters
    /// in any other status are kept: their rows are not in the target.
    Purge {
        #[arg(long)]
        task: String,
        #[arg(long)]
        older_than: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Mark letters RESOLVED by hand (you dealt with them).
    Resolve {
        #[arg(long)]
        task: String,
        #[arg(long = "key", required_unless_present = "all_failed")]
        keys: Vec<String>,
        /// Every FAILED letter of the task.
        #[arg(long)]
        all_failed: bool,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum SourceAction {
    /// Install what the task's configuration needs on its source: the trigger-maintained
    /// `tidemark_row_version` column (`version = "trigger"`) and the trigger-fed delete log
    /// (`delete_policy = { kind = "tombstone_table" }`).
    Install {
        #[arg(long)]
        task: String,
        #[arg(long, env = "TIDEMARK_CONFIG")]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
enum ControlAction {
    /// Copy the embedded store's records (e.g. a `tidemark sync`'s `.tidemark/<name>.control.db`)
    /// into an empty PostgreSQL control database, so that a cluster continues from its
    /// checkpoints. Stop the sync first.
    Copy {
        /// The embedded store: `sqlite://PATH`.
        #[arg(long)]
        from: String,
        /// The PostgreSQL control database (`control_db`); created and migrated when missing.
        #[arg(long)]
        to: String,
        /// The schema there (`control_schema`); default: the role's search path.
        #[arg(long)]
        schema: Option<String>,
    },
}

/// Parses `args` (the first is the program name, shown in help as `bin_name`) and runs.
pub fn main(bin_name: &str, args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let matches = Cli::command().bin_name(bin_name.to_string()).get_matches_from(args);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    // Only `serve` exports traces (its endpoint comes from the config, read in `serve`).
    let serving = matches!(cli.command, Command::Serve { .. });
    let endpoint = match &cli.command {
        Command::Serve { config } => Config::load(config).ok().and_then(|c| c.coordinator.otlp_endpoint),
        _ => Some(String::new()),
    };
    let telemetry = {
        let _guard = runtime.enter();
        telemetry::init("tidemark-coordinator", cli.log_format, endpoint)
    };
    let result = runtime.block_on(async {
        let result = run(cli.command).await;
        if serving {
            telemetry.shutdown().await;
        }
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", format!("{error:#}").replace('\n', " "));
            ExitCode::from(2)
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    use admin_cli::Operation;
    use tidemark_proto::v1 as pb;
    match command {
        Command::Serve { config } => serve(config).await,
        Command::Status {
            target,
            json,
            watch,
            interval,
        } => {
            if watch {
                let interval = tidemark_common::duration::parse_duration(&interval)
                    .map_err(|e| anyhow::anyhow!("--interval: {e}"))?;
                admin_cli::watch_status(&target.coordinator, interval).await
            } else {
                admin_cli::show_status(&target.coordinator, json).await
            }
        }
        Command::Tasks { action } => match action {
            TaskAction::List { target, json } => admin_cli::tasks_list(&target.coordinator, json).await,
            TaskAction::Pause {
                task,
                target,
                reason,
                json,
            } => admin_cli::task_pause(&target.coordinator, task, reason, json).await,
            TaskAction::Resume { task, target, json } => admin_cli::task_resume(&target.coordinator, task, json).await,
            TaskAction::Reinit { task, target, json } => admin_cli::task_reinit(&target.coordinator, task, json).await,
            TaskAction::Switch { task, target, json } => {
                admin_cli::task_epoch(&target.coordinator, EpochAction::Switch, task, json).await
            }
            TaskAction::Validate { task, target, json } => {
                admin_cli::task_epoch(&target.coordinator, EpochAction::Validate, task, json).await
            }
            TaskAction::Rollback { task, target, json } => {
                admin_cli::task_epoch(&target.coordinator, EpochAction::Rollback, task, json).await
            }
        },
        Command::Shards { action } => match action {
            ShardAction::List { task, target, json } => admin_cli::shards_list(&target.coordinator, task, json).await,
            ShardAction::Split {
                task,
                shard,
                at,
                target,
                json,
            } => {
                let request = pb::SplitShardRequest {
                    task,
                    shard_id: shard,
                    at: at.unwrap_or_default(),
                };
                admin_cli::operation(&target.coordinator, Operation::Split(request), json).await
            }
            ShardAction::Merge {
                task,
                first,
                second,
                target,
                json,
            } => {
                let request = pb::MergeShardsRequest {
                    task,
                    shard_a: first,
                    shard_b: second,
                };
                admin_cli::operation(&target.coordinator, Operation::Merge(request), json).await
            }
            ShardAction::Move {
                task,
                shard,
                to,
                target,
                json,
            } => {
                let request = pb::MoveShardRequest {
                    task,
                    shard_id: shard,
                    worker: to,
                };
                admin_cli::operation(&target.coordinator, Operation::Move(request), json).await
            }
        },
        Command::Workers { action } => match action {
            WorkerAction::List { target, json } => admin_cli::workers_list(&target.coordinator, json).await,
            WorkerAction::Drain { worker, target, json } => {
                let request = pb::DrainWorkerRequest { worker };
                admin_cli::operation(&target.coordinator, Operation::Drain(request), json).await
            }
        },
        Command::DeadLetters { action } => match action {
            DeadLetterAction::List {
                task,
                status,
                limit,
                target,
                json,
            } => admin_cli::dead_letters_list(&target.coordinator, task, status, limit, json).await,
            DeadLetterAction::Retry {
                task,
                keys,
                target,
                json,
            } => admin_cli::dead_letters_retry(&target.coordinator, task, keys, json).await,
            DeadLetterAction::Resolve {
                task,
                keys,
                all_failed,
                target,
                json,
            } => admin_cli::dead_letters_resolve(&target.coordinator, task, keys, all_failed, json).await,
            DeadLetterAction::Purge {
                task,
                older_than,
                target,
                json,
            } => admin_cli::dead_letters_purge(&target.coordinator, task, older_than, json).await,
        },
        Command::Source {
            action: SourceAction::Install { task, config },
        } => {
            let config = Config::load(&config)?;
            let task = config
                .tasks
                .iter()
                .find(|t| t.name == task)
                .ok_or_else(|| anyhow::anyhow!("no task named {task:?} in the config"))?;
            for line in crate::source_install::install(task).await? {
                println!("{line}");
            }
            Ok(())
        }
        Command::Control {
            action: ControlAction::Copy { from, to, schema },
        } => {
            let copied = crate::control_copy::copy(&from, &to, schema.as_deref()).await?;
            let rows: Vec<String> = copied.iter().map(|(table, n)| format!("{table} {n}")).collect();
            println!(
                "copied the control state into {}: {}",
                tidemark_common::redact::redact_url(&to),
                rows.join(", ")
            );
            Ok(())
        }
        Command::Reconcile {
            task,
            since,
            full: _,
            no_wait,
            compare,
            target,
            json,
        } => admin_cli::reconcile(&target.coordinator, task, since, compare, no_wait, json).await,
    }
}

async fn serve(config_path: PathBuf) -> anyhow::Result<()> {
    let config = Config::load(&config_path)?;
    crate::serve::serve(config, crate::serve::Listen::Config, crate::serve::shutdown_signal()).await
}
