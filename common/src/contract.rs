//! The source contract of a task: seed 001's five clauses (coverage, boundary, consistency,
//! retention, reinitialization), derived from the task's configuration. `status --json`
//! shows it under `contract`; a task whose configuration cannot deliver a clause it claims
//! (`[tasks.contract]`) fails to start with a message naming the clause.

use serde::Serialize;

use crate::config::{DeletePolicy, TaskConfig, TaskMode, VersionConfig};
use crate::duration::format_duration;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Coverage {
    pub inserts: bool,
    pub updates: bool,
    pub deletes: bool,
    /// How each kind of change is captured.
    pub how: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Contract {
    pub coverage: Coverage,
    pub boundary: String,
    pub consistency: String,
    pub retention: String,
    pub reinitialization: String,
}

/// The contract the configuration delivers.
pub fn derive(task: &TaskConfig) -> Contract {
    let cursor = task.cursor_column.as_deref().unwrap_or("");
    let version = match &task.version {
        VersionConfig::Cursor => format!("the cursor time of {cursor} (weakest: a backdated write loses)"),
        VersionConfig::Column(column) => format!("the integer column {column}"),
        VersionConfig::Trigger => "tidemark_row_version, fed by a trigger from one sequence".to_string(),
    };
    let deletes = match &task.delete_policy {
        None => "deletes are not captured".to_string(),
        Some(DeletePolicy::Soft { column }) => {
            format!("deletes are rows marked in {column} (the writer must also bump {cursor})")
        }
        Some(DeletePolicy::TombstoneTable { .. }) => {
            "deletes are read from the trigger-fed delete log in the same window as the rows".to_string()
        }
        Some(DeletePolicy::Reconcile {}) => {
            "deletes are found by reconciliation only (the source records none)".to_string()
        }
    };
    let (coverage, boundary) = match task.mode {
        TaskMode::Append | TaskMode::Accumulate => (
            Coverage {
                inserts: true,
                updates: false,
                deletes: false,
                how: format!(
                    "inserts only, read by key {} above the last committed key; updates and deletes are not seen",
                    task.key.join(", ")
                ),
            },
            format!(
                "a cursor is the last key read; a batch holds keys above it up to the page size, and {}; the \
                 snapshot stops at the largest key at planning (H0); a key below a committed cursor pauses the task \
                 with `id regression`",
                if task.open_transaction_bound {
                    "a read stops at the largest key no open source transaction can still add a key below"
                } else {
                    "a read goes to the largest key (open_transaction_bound = false: a lower key committed later is \
                     missed)"
                }
            ),
        ),
        TaskMode::Upsert => (
            Coverage {
                inserts: true,
                updates: true,
                deletes: task.delete_policy.is_some(),
                how: format!(
                    "inserts and updates by ({cursor}, {}); versions are {version}; {deletes}",
                    task.key.join(", ")
                ),
            },
            format!(
                "a cursor (t, key) means every row with ({cursor}, key) at or below it is in the target; each cycle \
                 reads [watermark - overlap ({}), high) with high = min(source now - safety_delay ({}), {}); the \
                 watermark moves to high when the cycle is done and never goes back; changes outside the window \
                 are caught by reconciliation only",
                format_duration(task.overlap),
                format_duration(task.safety_delay),
                if task.open_transaction_bound {
                    "start of the oldest transaction open on the source, checked to see every writer; a prepared \
                     transaction holds the watermark until it ends"
                } else {
                    "unbounded: open transactions are not consulted (open_transaction_bound = false), so the late-commit \
                     guarantee is reduced to the overlap window"
                }
            ),
        ),
    };
    let retention = match (&task.delete_policy, task.mode) {
        (Some(DeletePolicy::TombstoneTable { retention }), _) => format!(
            "{}: the delete log keeps entries that long; a checkpoint older than the oldest kept entry pauses the \
             task with `reinitialization required`, and status warns within 20 % of it",
            format_duration(*retention)
        ),
        (Some(DeletePolicy::Soft { .. }), _) => {
            "unbounded while soft-deleted rows stay in the source table".to_string()
        }
        _ => "unbounded: the table itself is the change feed (rows are re-read from their cursor)".to_string(),
    };
    Contract {
        coverage,
        boundary,
        consistency: "per page: each page is one statement's consistent read; pages of one table are not one \
                      snapshot, and related tables are read independently (convergent, not transactional)"
            .to_string(),
        retention,
        reinitialization: format!(
            "`tidemark-coordinator tasks reinit {}`: a new epoch is built beside the live table from a fresh \
             snapshot, validated, and switched in one transaction",
            task.name
        ),
    }
}

/// Checks the operator's claims against what the configuration delivers; the error names
/// the clause.
pub fn check_claims(task: &TaskConfig) -> Result<(), String> {
    let claims = &task.contract;
    let delivered = derive(task);
    for kind in &claims.coverage {
        let (covered, needs) = match kind.as_str() {
            "inserts" => (delivered.coverage.inserts, ""),
            "updates" => (delivered.coverage.updates, "mode = \"upsert\""),
            "deletes" => (
                delivered.coverage.deletes,
                "a delete_policy (soft, tombstone_table or reconcile)",
            ),
            other => {
                return Err(format!(
                    "contract clause coverage: unknown change kind {other:?} (use inserts, updates, deletes)"
                ));
            }
        };
        if !covered {
            return Err(format!(
                "contract clause coverage claims {kind}, but the configuration does not capture them: it needs {needs}"
            ));
        }
    }
    if kind_is_column_version_with_log(task) {
        return Err(
            "contract clause coverage: a delete log cannot order a delete against a later re-insert with a business \
             version column; use version = \"trigger\" or \"cursor\""
                .to_string(),
        );
    }
    if let Some(claimed) = claims.retention
        && let Some(DeletePolicy::TombstoneTable { retention }) = &task.delete_policy
        && claimed > *retention
    {
        return Err(format!(
            "contract clause retention claims {}, but the delete log keeps entries for {}",
            format_duration(claimed),
            format_duration(*retention)
        ));
    }
    match claims.consistency.as_deref() {
        None | Some("page") => {}
        Some("table") | Some("snapshot") | Some("transactional") => {
            return Err(
                "contract clause consistency claims a single snapshot, but pages are read by separate statements \
                 (per-page consistency)"
                    .to_string(),
            );
        }
        Some(other) => {
            return Err(format!(
                "contract clause consistency: unknown value {other:?} (use \"page\")"
            ));
        }
    }
    Ok(())
}

fn kind_is_column_version_with_log(task: &TaskConfig) -> bool {
    matches!(task.delete_policy, Some(DeletePolicy::TombstoneTable { .. }))
        && matches!(task.version, VersionConfig::Column(_))
}
