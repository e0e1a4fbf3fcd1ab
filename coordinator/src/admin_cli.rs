//! The operator's commands (`status`, `tasks`, `shards`, `workers`, `reconcile`): thin gRPC
//! clients of the admin service. `--coordinator` takes one or more replica addresses,
//! comma-separated; reads are answered by any replica, and a change that reaches a follower
//! (`not the leader`) or an unreachable replica moves on to the next address.

use std::future::Future;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use serde_json::json;
use tidemark_common::cursor::{ShardRange, format_micros};
use tidemark_proto::v1 as pb;
use tidemark_proto::v1::admin_service_client::AdminServiceClient;
use tonic::transport::Channel;

use crate::status;

/// Calls the first replica that answers (and, for changes, the leader).
pub async fn admin<T, F, Fut>(addresses: &str, f: F) -> anyhow::Result<T>
where
    F: Fn(AdminServiceClient<Channel>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let mut last = None;
    let tls = tidemark_common::tls::ClientTls::from_env();
    for address in addresses.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let endpoint = match tls.endpoint(address) {
            Ok(endpoint) => endpoint.connect_timeout(Duration::from_secs(3)),
            Err(error) => {
                last = Some(anyhow!("{error}"));
                continue;
            }
        };
        match endpoint.connect().await {
            Err(error) => last = Some(anyhow!("cannot reach coordinator {address}: {}", with_causes(&error))),
            Ok(channel) => match f(tidemark_proto::admin_client(channel)).await {
                Ok(response) => return Ok(response.into_inner()),
                // A connection problem (the replica is down, TLS refused, plaintext against TLS)
                // rather than the coordinator's answer: try the next replica.
                Err(status)
                    if std::error::Error::source(&status).is_some()
                        || matches!(
                            status.code(),
                            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
                        ) =>
                {
                    let hint = if address.starts_with("http://") && status.message().contains("h2 protocol") {
                        " (a coordinator serving TLS needs an https:// address)"
                    } else {
                        ""
                    };
                    last = Some(anyhow!("coordinator {address}: {}{hint}", with_causes(&status)));
                }
                Err(status) => return Err(anyhow!("{}", status.message())),
            },
        }
    }
    Err(last.unwrap_or_else(|| anyhow!("no coordinator address given")))
}

/// An error with its causes (a TLS refusal hides under "transport error").
fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = match error.downcast_ref::<tonic::Status>() {
        Some(status) => status.message().to_string(),
        None => error.to_string(),
    };
    let mut cause = error.source();
    while let Some(inner) = cause {
        let line = inner.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        cause = inner.source();
    }
    text
}

/// The coordinator's `status`.
pub async fn fetch_status(addresses: &str) -> anyhow::Result<pb::StatusResponse> {
    admin(addresses, |mut c| async move { c.status(pb::StatusRequest {}).await }).await
}

pub async fn show_status(addresses: &str, json: bool) -> anyhow::Result<()> {
    let status = fetch_status(addresses).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&status::to_json(&status))?);
    } else {
        print!("{}", status::to_table(&status));
    }
    Ok(())
}

/// `status --watch`: refreshes in place on a terminal; plain, timestamped blocks otherwise.
pub async fn watch_status(addresses: &str, interval: Duration) -> anyhow::Result<()> {
    let terminal = std::io::stdout().is_terminal();
    let mut previous: Option<(Instant, std::collections::HashMap<String, u64>)> = None;
    loop {
        let text = match fetch_status(addresses).await {
            Ok(status) => {
                let now = Instant::now();
                let rates: std::collections::HashMap<String, f64> = match &previous {
                    Some((then, rows)) => status
                        .tasks
                        .iter()
                        .map(|t| {
                            let before = rows.get(&t.name).copied().unwrap_or(t.rows_applied);
                            let seconds = now.duration_since(*then).as_secs_f64().max(0.001);
                            (t.name.clone(), t.rows_applied.saturating_sub(before) as f64 / seconds)
                        })
                        .collect(),
                    None => Default::default(),
                };
                previous = Some((
                    now,
                    status.tasks.iter().map(|t| (t.name.clone(), t.rows_applied)).collect(),
                ));
                status::to_watch(&status, &rates, terminal)
            }
            Err(error) => format!("coordinator unreachable: {error}\n"),
        };
        if terminal {
            print!("\x1b[2J\x1b[H{text}");
        } else {
            println!("--- {}", format_micros(now_micros()));
            print!("{text}");
        }
        use std::io::Write;
        std::io::stdout().flush()?;
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

pub async fn tasks_list(addresses: &str, json: bool) -> anyhow::Result<()> {
    let status = fetch_status(addresses).await?;
    if json {
        let tasks: Vec<serde_json::Value> = status
            .tasks
            .iter()
            .map(|t| {
                json!({
                    "name": t.name, "epoch": t.epoch, "phase": t.phase, "shards": t.shards.len(),
                    "rows_applied": t.rows_applied, "watermark": t.watermark_micros.map(format_micros),
                    "paused_reason": (!t.paused_reason.is_empty()).then(|| t.paused_reason.clone()),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "tasks": tasks }))?);
        return Ok(());
    }
    println!(
        "{:<20} {:>5} {:<12} {:>6} {:>12}  watermark",
        "task", "epoch", "phase", "shards", "rows"
    );
    for t in &status.tasks {
        println!(
            "{:<20} {:>5} {:<12} {:>6} {:>12}  {}{}",
            t.name,
            t.epoch,
            t.phase,
            t.shards.len(),
            t.rows_applied,
            t.watermark_micros.map_or_else(|| "-".to_string(), format_micros),
            if t.paused_reason.is_empty() {
                String::new()
            } else {
                format!("  (paused: {})", t.paused_reason)
            }
        );
    }
    Ok(())
}

/// Prints an action's result: one line, or (`json`) one JSON object.
fn report(json: bool, value: serde_json::Value, line: String) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(&value)?);
    } else {
        println!("{line}");
    }
    Ok(())
}

/// `tasks pause`: no shard of the task is handed out or committed until it is resumed.
pub async fn task_pause(addresses: &str, task: String, reason: String, json: bool) -> anyhow::Result<()> {
    let request = pb::TaskRequest {
        task: task.clone(),
        reason: reason.clone(),
        ..Default::default()
    };
    admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.pause_task(request).await }
    })
    .await?;
    report(
        json,
        json!({ "task": task, "paused": true, "reason": reason }),
        format!("task {task} paused"),
    )
}

/// `tasks resume`.
pub async fn task_resume(addresses: &str, task: String, json: bool) -> anyhow::Result<()> {
    let request = pb::TaskRequest {
        task: task.clone(),
        ..Default::default()
    };
    admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.resume_task(request).await }
    })
    .await?;
    report(
        json,
        json!({ "task": task, "paused": false }),
        format!("task {task} resumed"),
    )
}

/// `tasks reinit`: a new epoch building beside the live table.
pub async fn task_reinit(addresses: &str, task: String, json: bool) -> anyhow::Result<()> {
    let request = pb::TaskRequest {
        task: task.clone(),
        ..Default::default()
    };
    let response = admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.reinit_task(request).await }
    })
    .await?;
    let mut line = format!(
        "task {task} reinitialized: epoch {} builds beside the live table (snapshot, changes, validation), then \
         switches; `tidemark-coordinator status` shows its progress",
        response.epoch
    );
    for change in &response.target_changes {
        line.push_str(&format!("\ntarget: {change}"));
    }
    report(
        json,
        json!({ "task": task, "epoch": response.epoch, "target_changes": response.target_changes }),
        line,
    )
}

/// The epoch commands after `tasks reinit`.
#[derive(Debug, Clone, Copy)]
pub enum EpochAction {
    Switch,
    Validate,
    Rollback,
}

/// `tasks switch`, `tasks validate`, `tasks rollback`.
pub async fn task_epoch(addresses: &str, action: EpochAction, task: String, json: bool) -> anyhow::Result<()> {
    let request = pb::TaskRequest {
        task: task.clone(),
        ..Default::default()
    };
    let response = admin(addresses, |mut c| {
        let request = request.clone();
        async move {
            match action {
                EpochAction::Switch => c.switch_task(request).await,
                EpochAction::Validate => c.validate_task(request).await,
                EpochAction::Rollback => c.rollback_task(request).await,
            }
        }
    })
    .await?;
    report(
        json,
        json!({ "task": task, "message": response.message }),
        response.message,
    )
}

pub async fn shards_list(addresses: &str, task: Option<String>, json: bool) -> anyhow::Result<()> {
    let request = pb::ListShardsRequest {
        task: task.unwrap_or_default(),
    };
    let list = admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.list_shards(request).await }
    })
    .await?;
    let range_text = |r: &str| ShardRange::decode(r).map_or_else(|_| r.to_string(), |r| r.describe());
    if json {
        let shards: Vec<serde_json::Value> = list
            .shards
            .iter()
            .map(|s| {
                json!({
                    "task": s.task, "epoch": s.epoch, "shard": s.shard_id, "range": range_text(&s.range),
                    "owner": (!s.owner.is_empty()).then(|| s.owner.clone()), "phase": s.phase,
                    "rows_applied": s.rows_applied, "fence": s.fence,
                    "cursor": serde_json::from_str::<serde_json::Value>(&s.cursor).unwrap_or_default(),
                    "pending_op": (!s.pending_op.is_empty()).then(|| s.pending_op.clone()),
                    "reserved_for": (!s.reserved_for.is_empty()).then(|| s.reserved_for.clone()),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "shards": shards }))?);
        return Ok(());
    }
    println!(
        "{:<16} {:>5} {:<40} {:<14} {:<12} {:>10} {:>8}  pending",
        "task", "shard", "range", "owner", "phase", "rows", "fence"
    );
    for s in &list.shards {
        println!(
            "{:<16} {:>5} {:<40} {:<14} {:<12} {:>10} {:>8}  {}{}",
            s.task,
            s.shard_id,
            range_text(&s.range),
            if s.owner.is_empty() { "-" } else { &s.owner },
            s.phase,
            s.rows_applied,
            s.fence,
            s.pending_op,
            if s.reserved_for.is_empty() {
                String::new()
            } else {
                format!(" (reserved for {})", s.reserved_for)
            }
        );
    }
    Ok(())
}

pub async fn operation(addresses: &str, request: Operation, json: bool) -> anyhow::Result<()> {
    let response = match request {
        Operation::Split(r) => {
            admin(addresses, |mut c| {
                let r = r.clone();
                async move { c.split_shard(r).await }
            })
            .await?
        }
        Operation::Merge(r) => {
            admin(addresses, |mut c| {
                let r = r.clone();
                async move { c.merge_shards(r).await }
            })
            .await?
        }
        Operation::Move(r) => {
            admin(addresses, |mut c| {
                let r = r.clone();
                async move { c.move_shard(r).await }
            })
            .await?
        }
        Operation::Drain(r) => {
            admin(addresses, |mut c| {
                let r = r.clone();
                async move { c.drain_worker(r).await }
            })
            .await?
        }
    };
    report(json, json!({ "message": response.message }), response.message.clone())
}

pub enum Operation {
    Split(pb::SplitShardRequest),
    Merge(pb::MergeShardsRequest),
    Move(pb::MoveShardRequest),
    Drain(pb::DrainWorkerRequest),
}

pub async fn workers_list(addresses: &str, json: bool) -> anyhow::Result<()> {
    let list = admin(addresses, |mut c| async move {
        c.list_workers(pb::ListWorkersRequest {}).await
    })
    .await?;
    if json {
        let workers: Vec<serde_json::Value> = list
            .workers
            .iter()
            .map(|w| {
                json!({
                    "id": w.id, "lease_id": w.lease_id, "alive": w.alive, "draining": w.draining,
                    "seconds_since_seen": w.seconds_since_seen, "shards": w.shards,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "workers": workers }))?);
        return Ok(());
    }
    println!(
        "{:<20} {:<6} {:<9} {:>9}  shards",
        "worker", "alive", "draining", "seen"
    );
    for w in &list.workers {
        println!(
            "{:<20} {:<6} {:<9} {:>8.1}s  {}",
            w.id,
            if w.alive { "yes" } else { "no" },
            if w.draining { "yes" } else { "no" },
            w.seconds_since_seen,
            w.shards.join(" ")
        );
    }
    Ok(())
}

pub async fn reconcile(
    addresses: &str,
    task: String,
    since: Option<String>,
    compare: Option<String>,
    no_wait: bool,
    json: bool,
) -> anyhow::Result<()> {
    let window_ms = since
        .map(|text| tidemark_common::duration::parse_duration(&text).map(|d| d.as_millis() as u64))
        .transpose()
        .map_err(|e| anyhow!("--since: {e}"))?;
    let request = pb::ReconcileRequest {
        task,
        window_ms,
        compare: compare.unwrap_or_default(),
    };
    let mut run = admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.reconcile(request).await }
    })
    .await?;
    if !json {
        eprintln!("reconciliation run {} started", run.run_id);
    }
    while !no_wait && !run.finished {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let run_id = run.run_id;
        run = admin(addresses, |mut c| async move {
            c.reconcile_status(pb::ReconcileStatusRequest { run_id }).await
        })
        .await?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&status::reconcile_json(&run))?);
    } else {
        println!("{}", status::reconcile_line(&run));
    }
    Ok(())
}

/// `dead-letters list`: a table (payload cut to 60 characters) or every field as JSON.
pub async fn dead_letters_list(
    addresses: &str,
    task: String,
    status: Option<String>,
    limit: u32,
    json: bool,
) -> anyhow::Result<()> {
    let request = pb::ListDeadLettersRequest {
        task,
        status: status.unwrap_or_default(),
        limit,
    };
    let list = admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.list_dead_letters(request).await }
    })
    .await?;
    if json {
        let letters: Vec<serde_json::Value> = list
            .letters
            .iter()
            .map(|l| {
                json!({
                    "task": l.task, "key": l.key, "shard": l.shard_id, "batch_id": l.batch_id,
                    "payload": l.payload, "error_class": l.error_class, "message": l.message,
                    "status": l.status, "retry_count": l.retry_count,
                    "created_at": l.created_at, "updated_at": l.updated_at,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "dead_letters": letters }))?);
        return Ok(());
    }
    println!(
        "{:<20} {:<10} {:>7}  {:<30} message / payload",
        "key", "status", "retries", "error"
    );
    for l in &list.letters {
        let payload: String = l.payload.chars().take(60).collect();
        println!(
            "{:<20} {:<10} {:>7}  {:<30} {}\n{:<71}{payload}",
            l.key, l.status, l.retry_count, l.error_class, l.message, ""
        );
    }
    Ok(())
}

/// `dead-letters retry`: one line with what happened to the claimed rows (or JSON).
pub async fn dead_letters_retry(addresses: &str, task: String, keys: Vec<String>, json: bool) -> anyhow::Result<()> {
    let request = pb::RetryDeadLettersRequest { task, keys };
    let result = admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.retry_dead_letters(request).await }
    })
    .await?;
    if json {
        println!(
            "{}",
            json!({
                "resolved": result.resolved, "retry": result.retry,
                "failed": result.failed, "skipped": result.skipped,
            })
        );
    } else {
        println!(
            "resolved {}, failed again {} (will retry), failed for good {}, skipped {} (claimed by another run or not retryable)",
            result.resolved, result.retry, result.failed, result.skipped
        );
    }
    Ok(())
}

/// `dead-letters purge`: deletes RESOLVED letters resolved longer ago than `older_than`.
pub async fn dead_letters_purge(addresses: &str, task: String, older_than: String, json: bool) -> anyhow::Result<()> {
    let age = tidemark_common::duration::parse_duration(&older_than).map_err(|e| anyhow!("--older-than: {e}"))?;
    let request = pb::PurgeDeadLettersRequest {
        task: task.clone(),
        older_than_ms: age.as_millis() as u64,
    };
    let result = admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.purge_dead_letters(request).await }
    })
    .await?;
    report(
        json,
        json!({ "task": task, "purged": result.purged }),
        format!(
            "{} RESOLVED dead letters of task {task} resolved over {older_than} ago purged",
            result.purged
        ),
    )
}

/// `dead-letters resolve`: marks letters RESOLVED by hand.
pub async fn dead_letters_resolve(
    addresses: &str,
    task: String,
    keys: Vec<String>,
    all_failed: bool,
    json: bool,
) -> anyhow::Result<()> {
    let request = pb::ResolveDeadLettersRequest { task, keys, all_failed };
    let result = admin(addresses, |mut c| {
        let request = request.clone();
        async move { c.resolve_dead_letters(request).await }
    })
    .await?;
    report(
        json,
        json!({ "resolved": result.resolved }),
        format!("{} dead letters marked RESOLVED", result.resolved),
    )
}
