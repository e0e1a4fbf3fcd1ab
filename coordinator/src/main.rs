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
use tidemark_coordinator::planner::{install_trigger_version, prepare_task};
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
}

#[derive(Subcommand)]
enum SourceAction {
    /// Add the trigger-maintained `tidemark_row_version` column (for `version = "trigger"`).
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
                println!("{}", install_trigger_version(task).await?);
                Ok(())
            }
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

async fn task_action(action: TaskAction) -> anyhow::Result<()> {
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
