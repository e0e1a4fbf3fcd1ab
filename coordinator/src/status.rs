//! `tidemark-coordinator status`: the cluster's progress as JSON or as a readable table.

use serde_json::json;
use tidemark_common::cursor::{Cursor, ShardRange, format_micros};
use tidemark_proto::v1 as pb;

fn range_text(encoded: &str) -> String {
    ShardRange::decode(encoded).map_or_else(|_| encoded.to_string(), |r| r.describe())
}

/// The documented `status --json` shape.
pub fn to_json(status: &pb::StatusResponse) -> serde_json::Value {
    let tasks: Vec<serde_json::Value> = status
        .tasks
        .iter()
        .map(|task| {
            let shards: Vec<serde_json::Value> = task
                .shards
                .iter()
                .map(|shard| {
                    let cursor: serde_json::Value =
                        serde_json::from_str(&shard.cursor).unwrap_or(serde_json::Value::Null);
                    json!({
                        "id": shard.id,
                        "range": range_text(&shard.range),
                        "owner": if shard.owner.is_empty() { serde_json::Value::Null } else { json!(shard.owner) },
                        "phase": shard.phase,
                        "state": shard.state,
                        "rows_applied": shard.rows_applied,
                        "cursor": cursor,
                    })
                })
                .collect();
            let mut value = json!({
                "name": task.name,
                "epoch": task.epoch,
                "phase": task.phase,
                "snapshot_complete": task.snapshot_complete,
                "rows_applied": task.rows_applied,
                "watermark": task.watermark_micros.map(format_micros),
                "shards": shards,
            });
            value["late_rows"] = json!({
                "count": task.late_rows,
                "p99_ms": task.late_p99_micros / 1000,
                "max_ms": task.late_max_micros / 1000,
                "overlap_ms": task.overlap_ms,
            });
            value["warnings"] = json!(task.warnings);
            value["mode"] = json!(task.mode);
            let dead_letters: std::collections::BTreeMap<&str, u64> =
                task.dead_letters.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            value["dead_letters"] = json!(dead_letters);
            if let Some(contract) = &task.contract {
                value["contract"] = json!({
                    "coverage": {
                        "inserts": contract.covers_inserts,
                        "updates": contract.covers_updates,
                        "deletes": contract.covers_deletes,
                        "how": contract.coverage,
                    },
                    "boundary": contract.boundary,
                    "consistency": contract.consistency,
                    "retention": contract.retention,
                    "reinitialization": contract.reinitialization,
                });
            }
            value["last_reconcile"] = task
                .last_reconcile
                .as_ref()
                .map_or(serde_json::Value::Null, reconcile_json);
            if !task.paused_reason.is_empty() {
                value["paused_reason"] = json!(task.paused_reason);
            }
            value["building"] = task.building.as_ref().map_or(serde_json::Value::Null, epoch_json);
            value["retained"] = json!(task.retained.iter().map(epoch_json).collect::<Vec<_>>());
            value["live_frozen"] = json!(task.live_frozen);
            value
        })
        .collect();
    json!({ "tasks": tasks })
}

/// A building or retained epoch as JSON.
pub fn epoch_json(epoch: &pb::EpochStatus) -> serde_json::Value {
    json!({
        "epoch": epoch.epoch,
        "state": epoch.state,
        "table": epoch.table,
        "snapshot_complete": epoch.snapshot_complete,
        "rows_applied": epoch.rows_applied,
        "estimated_rows": epoch.estimated_rows,
        "watermark": epoch.watermark_micros.map(format_micros),
        "validation": epoch.validation,
        "eta_seconds": epoch.eta_seconds,
        "retained_until": epoch.retained_until_micros.map(format_micros),
        "awaiting_switch": epoch.awaiting_switch,
    })
}

/// One line for a building or retained epoch.
pub fn epoch_line(epoch: &pb::EpochStatus) -> String {
    match epoch.state.as_str() {
        "building" => {
            let progress = if epoch.snapshot_complete {
                format!(
                    "snapshot done, watermark {}",
                    epoch.watermark_micros.map_or_else(|| "-".to_string(), format_micros)
                )
            } else {
                let total = if epoch.estimated_rows == 0 {
                    "~".to_string()
                } else {
                    epoch.estimated_rows.to_string()
                };
                let eta = epoch
                    .eta_seconds
                    .map_or_else(|| "-".to_string(), |s| format!("{s:.0}s"));
                format!("snapshot {}/{total} rows, ETA {eta}", epoch.rows_applied)
            };
            let waiting = if epoch.awaiting_switch {
                "; validated, waiting for `tasks switch`"
            } else {
                ""
            };
            format!(
                "epoch {} building in {}: {progress}; validation {}{waiting}",
                epoch.epoch, epoch.table, epoch.validation
            )
        }
        _ => format!(
            "epoch {} {} in {}{}",
            epoch.epoch,
            epoch.state,
            epoch.table,
            epoch.retained_until_micros.map_or_else(String::new, |t| format!(
                " until {} (`tasks rollback`)",
                format_micros(t)
            ))
        ),
    }
}

/// One reconciliation run as JSON (`status --json` and `reconcile --json`).
pub fn reconcile_json(run: &pb::ReconcileRun) -> serde_json::Value {
    json!({
        "run_id": run.run_id,
        "epoch": run.epoch,
        "reason": run.reason,
        "compare": run.compare,
        "window_since": run.since_micros.map(format_micros),
        "requested_at": format_micros(run.requested_at_micros),
        "finished": run.finished,
        "shards_done": run.shards_done,
        "shards_total": run.shards_total,
        "ranges_compared": run.ranges_compared,
        "rows_read": run.rows_read,
        "keys_repaired": run.keys_repaired,
        "extra_in_target": run.extra_in_target,
        "keys_missed": run.keys_missed,
        "duration_ms": run.duration_ms,
    })
}

/// One line: `run 7 (operator, full, content): 12 ranges compared, 40 rows read, 3 keys repaired in 1.2s`.
pub fn reconcile_line(run: &pb::ReconcileRun) -> String {
    let window = run
        .since_micros
        .map_or_else(|| "full".to_string(), |s| format!("since {}", format_micros(s)));
    let state = if run.finished {
        format!("in {:.1}s", run.duration_ms as f64 / 1000.0)
    } else {
        format!("running, {}/{} shards done", run.shards_done, run.shards_total)
    };
    let extra = if run.extra_in_target > 0 {
        format!(
            ", {} keys only in the target left alone (no delete_policy)",
            run.extra_in_target
        )
    } else {
        String::new()
    };
    format!(
        "run {} ({}, {window}, {}): {} ranges compared, {} rows read, {} keys repaired{extra} {state}",
        run.run_id, run.reason, run.compare, run.ranges_compared, run.rows_read, run.keys_repaired
    )
}

pub fn to_table(status: &pb::StatusResponse) -> String {
    let mut out = String::new();
    if status.tasks.is_empty() {
        out.push_str("no tasks\n");
    }
    for task in &status.tasks {
        out.push_str(&format!(
            "task {}  epoch {}  phase {}  rows applied {}  watermark {}\n",
            task.name,
            task.epoch,
            task.phase,
            task.rows_applied,
            task.watermark_micros.map_or_else(|| "-".to_string(), format_micros)
        ));
        if !task.paused_reason.is_empty() {
            out.push_str(&format!("  paused: {}\n", task.paused_reason));
        }
        if let Some(run) = &task.last_reconcile {
            out.push_str(&format!("  last reconcile: {}\n", reconcile_line(run)));
        }
        for epoch in task.building.iter().chain(&task.retained) {
            out.push_str(&format!("  {}\n", epoch_line(epoch)));
        }
        out.push_str(&format!(
            "  late rows {}  p99 {:.1}s  max {:.1}s  (overlap {:.1}s)\n",
            task.late_rows,
            task.late_p99_micros as f64 / 1e6,
            task.late_max_micros as f64 / 1e6,
            task.overlap_ms as f64 / 1e3
        ));
        if !task.dead_letters.is_empty() {
            let mut counts: Vec<(&String, &u64)> = task.dead_letters.iter().collect();
            counts.sort();
            let counts: Vec<String> = counts.iter().map(|(s, n)| format!("{s} {n}")).collect();
            out.push_str(&format!("  dead letters: {}\n", counts.join(", ")));
        }
        for warning in &task.warnings {
            out.push_str(&format!("  warning: {warning}\n"));
        }
        out.push_str(&format!(
            "  {:>5}  {:<44}  {:<12}  {:<8}  {:>12}  {}\n",
            "shard", "range", "owner", "phase", "rows", "cursor"
        ));
        for shard in &task.shards {
            let cursor = Cursor::decode(&shard.cursor).map_or_else(|e| e.to_string(), |c| c.describe());
            out.push_str(&format!(
                "  {:>5}  {:<44}  {:<12}  {:<8}  {:>12}  {}\n",
                shard.id,
                range_text(&shard.range),
                if shard.owner.is_empty() { "-" } else { &shard.owner },
                shard.phase,
                shard.rows_applied,
                cursor
            ));
        }
    }
    out
}

/// The `status --watch` screen: per task a snapshot progress bar (rows done / estimated total,
/// rows/s, ETA) or the watermark lag, and per worker its shards. `rates` are rows/s per task
/// measured between refreshes. Without a terminal the bar is plain text all the same.
pub fn to_watch(
    status: &pb::StatusResponse,
    rates: &std::collections::HashMap<String, f64>,
    _terminal: bool,
) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    let mut out = format!(
        "leader {}  (answered by {})\n",
        if status.leader.is_empty() {
            "none elected"
        } else {
            &status.leader
        },
        status.served_by
    );
    let mut workers: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for task in &status.tasks {
        let rate = rates.get(&task.name).copied().unwrap_or(0.0);
        out.push_str(&format!("task {}  epoch {}  {}\n", task.name, task.epoch, task.phase));
        if !task.snapshot_complete {
            let done = task.rows_applied;
            let total = task.estimated_rows.max(done);
            let fraction = if total == 0 { 0.0 } else { done as f64 / total as f64 };
            let width = 30;
            let filled = ((fraction * width as f64).round() as usize).min(width);
            let eta = if rate > 0.0 && total > done {
                format!("{:.0}s", (total - done) as f64 / rate)
            } else {
                "-".to_string()
            };
            out.push_str(&format!(
                "  snapshot [{}{}] {done}/{}{} ({:.0}%)  {:.0} rows/s  ETA {eta}\n",
                "#".repeat(filled),
                "-".repeat(width - filled),
                if task.estimated_rows == 0 { "~" } else { "" },
                total,
                fraction * 100.0,
                rate
            ));
        } else if let Some(watermark) = task.watermark_micros {
            out.push_str(&format!(
                "  watermark {}  lag {:.1}s  {:.0} rows/s\n",
                format_micros(watermark),
                (now - watermark) as f64 / 1e6,
                rate
            ));
        }
        if !task.paused_reason.is_empty() {
            out.push_str(&format!("  paused: {}\n", task.paused_reason));
        }
        for epoch in task.building.iter().chain(&task.retained) {
            out.push_str(&format!("  {}\n", epoch_line(epoch)));
        }
        for warning in &task.warnings {
            out.push_str(&format!("  warning: {warning}\n"));
        }
        for shard in &task.shards {
            let owner = if shard.owner.is_empty() {
                "(unowned)".to_string()
            } else {
                shard.owner.clone()
            };
            workers
                .entry(owner)
                .or_default()
                .push(format!("{}/{}", task.name, shard.id));
        }
    }
    out.push_str("workers\n");
    for (worker, shards) in workers {
        out.push_str(&format!("  {worker:<20} {}\n", shards.join(" ")));
    }
    out
}
