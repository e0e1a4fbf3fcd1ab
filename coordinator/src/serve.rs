//! Runs a coordinator replica: connects the control database and the lease store, prepares
//! the tasks, starts the leader's loops and serves gRPC until shutdown.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use tidemark_common::config::{Config, LeaseStore};
use tidemark_common::redact::redact_url;
use tidemark_proto::v1::admin_service_server::AdminServiceServer;
use tidemark_proto::v1::worker_service_server::WorkerServiceServer;

use crate::checkpoints::ControlDb;
use crate::error::CoordinatorError;
use crate::leader::{Leadership, campaign};
use crate::leases::Leases;
use crate::operations::run_operations;
use crate::planner::prepare_task;
use crate::service::{Coordinator, CoordinatorService};
use crate::watcher::watch_source;

fn is_transient(error: &CoordinatorError) -> bool {
    match error {
        CoordinatorError::ControlDb(e) => tidemark_common::pg::is_transient(e),
        CoordinatorError::Etcd(_) => true,
        _ => false,
    }
}

/// Where a replica serves gRPC.
pub enum Listen {
    /// `coordinator.listen`, bound once the tasks are prepared: a bad task fails by name
    /// even while another replica holds the port.
    Config,
    /// Already bound (`tidemark sync` binds port 0 and hands the address to its workers).
    Bound(tokio::net::TcpListener),
}

/// Runs a coordinator replica until `shutdown` completes.
pub async fn serve(
    config: Config,
    listen: Listen,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let settings = &config.coordinator;
    let retry = ExponentialBuilder::default()
        .with_max_times(8)
        .with_max_delay(Duration::from_secs(10));

    let schema = settings.control_schema.as_deref();
    let control = (|| ControlDb::connect(&settings.control_db, schema))
        .retry(retry)
        .when(is_transient)
        .notify(|error, delay| tracing::warn!(%error, ?delay, "control database unreachable; retrying"))
        .await
        .with_context(|| format!("control database {}", redact_url(&settings.control_db)))?;
    let leadership = Leadership::default();
    let address: std::net::SocketAddr = match &listen {
        Listen::Config => settings.listen.parse().context("coordinator.listen")?,
        Listen::Bound(listener) => listener.local_addr().context("listener address")?,
    };
    let advertise = settings.advertise.clone().unwrap_or_else(|| {
        let scheme = if settings.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{address}")
    });
    // In-process leases have no election: this must be the only coordinator on its control
    // state, for as long as it runs (the session holding the lock lives until it returns).
    let _sole = match settings.leases {
        LeaseStore::InProcess => Some(control.hold_sole_coordinator().await?),
        LeaseStore::Etcd => None,
    };
    // Bad tasks (missing tables, nullable keys, …) fail before anything else is contacted.
    let mut tasks = HashMap::new();
    for task in &config.tasks {
        let prepared = prepare_task(&control, task).await?;
        tokio::spawn(watch_source(control.clone(), prepared.clone(), leadership.clone()));
        tasks.insert(task.name.clone(), prepared);
    }
    let leases = match settings.leases {
        LeaseStore::InProcess => Leases::in_process(settings.lease_ttl, control.max_fence().await?),
        LeaseStore::Etcd => {
            let leases = (|| {
                Leases::connect(
                    &settings.etcd_endpoints,
                    &settings.etcd_prefix,
                    settings.lease_ttl,
                    settings.etcd_tls.as_ref(),
                )
            })
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
            leases
        }
    };

    let staging = tidemark_common::staging::Staging::open(&settings.staging)?;
    // A wrong endpoint, bucket or credentials, or a store without create-only writes, fails
    // here, named, and not on the first batch.
    staging
        .probe(Duration::from_secs(30))
        .await
        .with_context(|| format!("staging {}", redact_url(&settings.staging)))?;
    tokio::spawn(crate::janitor::collect_staging(
        control.clone(),
        staging,
        settings.staging_retention,
        leadership.clone(),
    ));
    tokio::spawn(crate::history::prune_history(
        control.clone(),
        settings.history_retention,
        leadership.clone(),
    ));
    tokio::spawn(crate::control_statistics::keep_statistics(
        control.clone(),
        leadership.clone(),
    ));
    tokio::spawn(crate::epochs::drive(control.clone(), tasks.clone(), leadership.clone()));
    tokio::spawn(campaign(leases.clone(), advertise.clone(), leadership.clone()));
    let capacity = crate::capacity::Capacity::default();
    tokio::spawn(run_operations(
        control.clone(),
        leases.clone(),
        tasks.clone(),
        leadership.clone(),
        settings.balance,
        capacity.clone(),
    ));
    tokio::spawn(crate::metrics::refresh_gauges(control.clone(), leadership.clone()));
    tokio::spawn(crate::metrics::probe_runtime_delay());
    if let Some(listen) = settings.metrics_listen {
        let (registry, refresh) = crate::metrics::registry();
        tidemark_common::metrics::serve(listen, registry, refresh)
            .await
            .with_context(|| format!("metrics endpoint {listen}"))?;
    }
    let mut targets = HashMap::new();
    for (name, task) in &tasks {
        targets.insert(name.clone(), crate::planner::lazy_target_pool(&task.config)?);
    }
    let service = CoordinatorService::new(Coordinator {
        control,
        leases,
        tasks,
        targets,
        staging_url: settings.staging.clone(),
        leadership,
        address: advertise,
        capacity,
    });
    let listener = match listen {
        Listen::Bound(listener) => listener,
        Listen::Config => tokio::net::TcpListener::bind(address)
            .await
            .with_context(|| format!("cannot listen on {address}"))?,
    };
    tracing::info!(%address, tasks = config.tasks.len(), "coordinator serving");
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = &settings.tls {
        server = server
            .tls_config(tls.config().map_err(|e| anyhow::anyhow!("[coordinator] tls: {e}"))?)
            .context("[coordinator] tls")?;
        tracing::info!(mutual = tls.client_ca.is_some(), "serving gRPC over TLS");
    }
    server
        .add_service(WorkerServiceServer::new(service.clone()))
        .add_service(AdminServiceServer::new(service))
        .serve_with_incoming_shutdown(tokio_stream_listener(listener), shutdown)
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

/// Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    tracing::info!("shutdown requested");
}
