//! Collects staging objects nobody needs: those of committed and abandoned batches, and those
//! no registered batch references (torn writes, batches staged by an owner that died before
//! registering, manifests of other owners). Only objects older than `staging_retention` are
//! touched, so a batch being staged right now is never collected under its writer.

use std::collections::HashMap;
use std::time::Duration;

use tidemark_common::staging::Staging;

use crate::batches::BatchState;
use crate::checkpoints::ControlDb;
use crate::error::CoordinatorError;
use crate::leader::Leadership;

pub async fn collect_staging(control: ControlDb, staging: Staging, retention: Duration, leadership: Leadership) {
    let interval = retention.clamp(Duration::from_secs(1), Duration::from_secs(60));
    loop {
        tokio::time::sleep(interval).await;
        if !leadership.is_leader() {
            continue;
        }
        match collect_once(&control, &staging, retention).await {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, "staging objects collected"),
            Err(error) => tracing::warn!(%error, "staging collection failed; retrying"),
        }
    }
}

/// One pass; returns how many objects were deleted.
pub async fn collect_once(
    control: &ControlDb,
    staging: &Staging,
    retention: Duration,
) -> Result<usize, CoordinatorError> {
    let objects = staging
        .list()
        .await
        .map_err(|e| CoordinatorError::InvalidRequest(e.to_string()))?;
    let old: Vec<_> = objects.into_iter().filter(|o| o.age >= retention).collect();
    if old.is_empty() {
        return Ok(0);
    }
    let ids: Vec<String> = old.iter().filter_map(|o| o.batch_id.clone()).collect();
    let rows: Vec<(String, String, String, String)> = match control.lite() {
        Some(lite) => lite.batches_among(&ids).await?,
        None => {
            sqlx::query_as("SELECT batch_id, state, manifest_path, content_hash FROM batches WHERE batch_id = ANY($1)")
                .bind(&ids)
                .fetch_all(control.pool())
                .await?
        }
    };
    // For each STAGED batch, the objects it still needs: its registered manifest and data.
    let mut keep: HashMap<String, (String, String)> = HashMap::new();
    for (batch_id, state, manifest, hash) in rows {
        if BatchState::parse(&state) == Some(BatchState::Staged) {
            keep.insert(
                batch_id,
                (manifest, format!("data-{}.", hash.trim_start_matches("sha256:"))),
            );
        }
    }
    let mut deleted = 0;
    for object in old {
        let needed = object
            .batch_id
            .as_ref()
            .and_then(|id| keep.get(id))
            .is_some_and(|(manifest, data)| object.path == *manifest || object.path.contains(&format!("/{data}")));
        if !needed {
            staging
                .delete(&object.path)
                .await
                .map_err(|e| CoordinatorError::InvalidRequest(e.to_string()))?;
            deleted += 1;
        }
    }
    Ok(deleted)
}
