//! The worker's command line (`tidemark-worker`, also `tidemark worker`).

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser};
use tidemark_common::telemetry::{self, LogFormat};
use tokio::sync::watch;

use crate::error::WorkerError;
use crate::runner::{WorkerOptions, default_worker_id, tune_malloc};

#[derive(Parser)]
#[command(
    name = "tidemark-worker",
    version,
    about = "Tidemark worker: pulls shards from the coordinator and syncs them"
)]
struct Cli {
    /// Coordinator replica gRPC addresses, comma-separated, e.g. http://a:7400,http://b:7400.
    /// `https://` addresses use TLS: TIDEMARK_TLS_CA names the CA certificate (PEM) to trust,
    /// TIDEMARK_TLS_CERT and TIDEMARK_TLS_KEY this worker's own certificate and key.
    #[arg(long, env = "TIDEMARK_COORDINATOR")]
    coordinator: String,
    /// Worker name; defaults to host name, process id and a random suffix.
    #[arg(long, env = "TIDEMARK_WORKER_ID")]
    id: Option<String>,
    /// Most shards this worker works on at once.
    #[arg(long, default_value_t = 4, env = "TIDEMARK_MAX_SHARDS")]
    max_shards: u32,
    /// `human` (default) or `json` log lines on stderr; filter with RUST_LOG.
    #[arg(long, default_value = "human", env = "TIDEMARK_LOG_FORMAT")]
    log_format: LogFormat,
    /// Serve Prometheus metrics on this address (`GET /metrics`), e.g. 0.0.0.0:9464.
    #[arg(long, env = "TIDEMARK_METRICS_LISTEN")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// OTLP/gRPC collector for traces; default: OTEL_EXPORTER_OTLP_ENDPOINT; unset: off.
    #[arg(long)]
    otlp_endpoint: Option<String>,
}

/// Parses `args` (the first is the program name, shown in help as `bin_name`) and runs until
/// Ctrl-C or SIGTERM, then drains.
pub fn main(bin_name: &str, args: impl IntoIterator<Item = OsString>) -> ExitCode {
    tune_malloc();
    let matches = Cli::command().bin_name(bin_name.to_string()).get_matches_from(args);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let telemetry = {
        let _guard = runtime.enter();
        telemetry::init("tidemark-worker", cli.log_format, cli.otlp_endpoint.clone())
    };
    if cli.max_shards == 0 {
        eprintln!("error: --max-shards must be at least 1");
        return ExitCode::from(2);
    }
    let worker_id = cli.id.clone().unwrap_or_else(default_worker_id);
    let result = runtime.block_on(async {
        if let Some(listen) = cli.metrics_listen {
            let (registry, refresh) = crate::metrics::registry();
            tidemark_common::metrics::serve(listen, registry, refresh)
                .await
                .map_err(|e| WorkerError::Coordinator(format!("metrics endpoint {listen}: {e}")))?;
        }
        let options = WorkerOptions {
            coordinator: cli.coordinator.clone(),
            id: worker_id,
            max_shards: cli.max_shards,
        };
        let (stop_tx, stop_rx) = watch::channel(false);
        tokio::spawn(async move {
            stop_signal().await;
            tracing::info!("stop requested: finishing batches in flight, then releasing shards");
            let _ = stop_tx.send(true);
        });
        let result = crate::runner::run(&options, stop_rx).await;
        telemetry.shutdown().await;
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}

/// Ctrl-C or SIGTERM.
async fn stop_signal() {
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}
