use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use clap::{Parser, Subcommand};
use tidemark_common::config::Config;
use tidemark_common::redact::redact_url;
use tidemark_coordinator::checkpoints::ControlDb;
use tidemark_coordinator::error::CoordinatorError;
use tidemark_coordinator::leases::Leases;
use tidemark_coordinator::planner::prepare_task;
use tidemark_coordinator::service::{Coordinator, CoordinatorService};
use tidemark_coordinator::status;
use tidemark_coordinator::watcher::watch_source;
use tidemark_proto::v1::admin_service_client::AdminServiceClient;
use tidemark_proto::v1::admin_service_server::AdminServiceServer;
use tidemark_proto::v1::worker_service_server::WorkerServiceServer;

#[derive(Parser)]
#[command(
    name = "tidemark-coordinator",
    version,
    about = "Tidemark coordinator: shard planning, leases, fenced checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
        #[arg(long, env = "TIDEMARK_COORDINATOR")]
        coordinator: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Pause or resume a task.
    Tasks {
        #[command(subcommand)]
        action: TaskAction,
    },
    /// Prepare a task's source table.
    Source {
        #[command(subcommand)]
        action: SourceAction,
    },
    /// Compare source and target per key range (hashes of key and version computed inside each
    /// database) and repair what differs through the batch protocol; waits for the result.
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
        #[arg(long, env = "TIDEMARK_COORDINATOR")]
        coordinator: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum TaskAction {
    /// Stop a task: no shard of it can be acquired and no batch of it commits.
    Pause {
        task: String,
        #[arg(long, env = "TIDEMARK_COORDINATOR")]
        coordinator: String,
        #[arg(long, default_value = "paused by operator")]
        reason: String,
    },
    /// Resume a paused task after its cause was fixed.
    Resume {
        task: String,
        #[arg(long, env = "TIDEMARK_COORDINATOR")]
        coordinator: String,
    },
    /// Start a fresh baseline (a new epoch: full snapshot, then a full reconciliation) for a
    /// task that needs reinitialization.
    Reinit {
        task: String,
        #[arg(long, env = "TIDEMARK_COORDINATOR")]
        coordinator: String,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    tidemark_common::telemetry::init_logging();
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve { config } => serve(config).await,
            Command::Status { coordinator, json } => show_status(coordinator, json).await,
            Command::Tasks { action } => task_action(action).await,
            Command::Source {
                action: SourceAction::Install { task, config },
            } => {
                let config = Config::load(&config)?;
                let task = config
                    .tasks
                    .iter()
                    .find(|t| t.name == task)
                    .ok_or_else(|| anyhow::anyhow!("no task named {task:?} in the config"))?;
                for line in tidemark_coordinator::source_install::install(task).await? {
                    println!("{line}");
                }
                Ok(())
            }
            Command::Reconcile {
                task,
                since,
                full: _,
                no_wait,
                coordinator,
                json,
            } => reconcile(coordinator, task, since, no_wait, json).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", format!("{error:#}").replace('\n', " "));
            ExitCode::from(2)
        }
    }
}

fn is_transient(error: &CoordinatorError) -> bool {
    match error {
        CoordinatorError::ControlDb(e) => tidemark_common::pg::is_transient(e),
        CoordinatorError::Etcd(_) => true,
        _ => false,
    }
}

async fn serve(config_path: PathBuf) -> anyhow::Result<()> {
    let config = Config::load(&config_path)?;
    let settings = &config.coordinator;
    let retry = ExponentialBuilder::default()
        .with_max_times(8)
        .with_max_delay(Duration::from_secs(10));

    let control = (|| ControlDb::connect(&settings.control_db))
        .retry(retry)
        .when(is_transient)
        .notify(|error, delay| tracing::warn!(%error, ?delay, "control database unreachable; retrying"))
        .await
        .with_context(|| format!("control database {}", redact_url(&settings.control_db)))?;
    // Bad tasks (missing tables, nullable keys, …) fail before anything else is contacted.
    let mut tasks = std::collections::HashMap::new();
    for task in &config.tasks {
        let prepared = prepare_task(&control, task).await?;
        tokio::spawn(watch_source(control.clone(), prepared.clone()));
        tasks.insert(task.name.clone(), prepared);
    }
    let leases = (|| Leases::connect(&settings.etcd_endpoints, &settings.etcd_prefix, settings.lease_ttl))
        .retry(retry)
        .when(is_transient)
        .notify(|error, delay| tracing::warn!(%error, ?delay, "etcd unreachable; retrying"))
        .await
        .with_context(|| format!("etcd {}", settings.etcd_endpoints.join(",")))?;
    // Probe etcd once so that a wrong endpoint fails here, not on the first worker.
    (|| leases.owners())
        .retry(retry)
        .when(is_transient)
        .notify(|error, delay| tracing::warn!(%error, ?delay, "etcd not answering; retrying"))
        .await
        .with_context(|| format!("etcd {}", settings.etcd_endpoints.join(",")))?;

    let staging = tidemark_common::staging::Staging::open(&settings.staging)?;
    tokio::spawn(tidemark_coordinator::janitor::collect_staging(
        control.clone(),
        staging,
        settings.staging_retention,
    ));
    let service = CoordinatorService::new(Coordinator {
        control,
        leases,
        tasks,
        staging_url: settings.staging.clone(),
    });
    let address: std::net::SocketAddr = settings.listen.parse().expect("validated in config");
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))?;
    tracing::info!(%address, tasks = config.tasks.len(), "coordinator serving");
    tonic::transport::Server::builder()
        .add_service(WorkerServiceServer::new(service.clone()))
        .add_service(AdminServiceServer::new(service))
        .serve_with_incoming_shutdown(tokio_stream_listener(listener), shutdown_signal())
        .await?;
    tracing::info!("coordinator stopped");
    Ok(())
}

fn tokio_stream_listener(
    listener: tokio::net::TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| {
            let _ = stream.set_nodelay(true);
            stream
        });
        Some((accepted, listener))
    })
}

async fn shutdown_signal() {
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    tracing::info!("shutdown requested");
}

async fn admin_client(coordinator: &str) -> anyhow::Result<AdminServiceClient<tonic::transport::Channel>> {
    AdminServiceClient::connect(coordinator.to_string())
        .await
        .with_context(|| format!("cannot reach coordinator {coordinator}"))
}

async fn reconcile(
    coordinator: String,
    task: String,
    since: Option<String>,
    no_wait: bool,
    json: bool,
) -> anyhow::Result<()> {
    let window_ms = since
        .map(|text| tidemark_common::duration::parse_duration(&text).map(|d| d.as_millis() as u64))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--since: {e}"))?;
    let mut client = admin_client(&coordinator).await?;
    let status_error = |s: tonic::Status| anyhow::anyhow!("{}", s.message());
    let mut run = client
        .reconcile(tidemark_proto::v1::ReconcileRequest { task, window_ms })
        .await
        .map_err(status_error)?
        .into_inner();
    if !json {
        eprintln!("reconciliation run {} started", run.run_id);
    }
    while !no_wait && !run.finished {
        tokio::time::sleep(Duration::from_millis(500)).await;
        run = client
            .reconcile_status(tidemark_proto::v1::ReconcileStatusRequest { run_id: run.run_id })
            .await
            .map_err(status_error)?
            .into_inner();
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&status::reconcile_json(&run))?);
    } else {
        println!("{}", status::reconcile_line(&run));
    }
    Ok(())
}

async fn task_action(action: TaskAction) -> anyhow::Result<()> {
    if let TaskAction::Reinit { task, coordinator } = action {
        let response = admin_client(&coordinator)
            .await?
            .reinit_task(tidemark_proto::v1::TaskRequest {
                task: task.clone(),
                reason: String::new(),
            })
            .await
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?
            .into_inner();
        println!(
            "task {task} reinitialized: epoch {} snapshots the table again; reconciliation run {} removes keys deleted meanwhile",
            response.epoch, response.reconcile_run_id
        );
        return Ok(());
    }
    let (coordinator, request, resume) = match action {
        TaskAction::Pause {
            task,
            coordinator,
            reason,
        } => (coordinator, tidemark_proto::v1::TaskRequest { task, reason }, false),
        TaskAction::Resume { task, coordinator } => (
            coordinator,
            tidemark_proto::v1::TaskRequest {
                task,
                reason: String::new(),
            },
            true,
        ),
        TaskAction::Reinit { .. } => unreachable!("handled above"),
    };
    let mut client = AdminServiceClient::connect(coordinator.clone())
        .await
        .with_context(|| format!("cannot reach coordinator {coordinator}"))?;
    let task = request.task.clone();
    let result = if resume {
        client.resume_task(request).await
    } else {
        client.pause_task(request).await
    };
    result.map_err(|s| anyhow::anyhow!("{}", s.message()))?;
    println!("task {task} {}", if resume { "resumed" } else { "paused" });
    Ok(())
}

async fn show_status(coordinator: String, json: bool) -> anyhow::Result<()> {
    let mut client = AdminServiceClient::connect(coordinator.clone())
        .await
        .with_context(|| format!("cannot reach coordinator {coordinator}"))?;
    let status = client
        .status(tidemark_proto::v1::StatusRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
        .into_inner();
    if json {
        println!("{}", serde_json::to_string_pretty(&status::to_json(&status))?);
    } else {
        print!("{}", status::to_table(&status));
    }
    Ok(())
}
