//! `tidemark-coordinator source install --task T`: prepares a task's source table for the
//! contract its configuration claims: the trigger-maintained version column (`version =
//! "trigger"`) and the trigger-fed delete log (`delete_policy = { kind = "tombstone_table" }`)
//! with its purge function. Each engine installs them its own way (`postgres/install.rs`,
//! `mysql/install.rs`); every step is idempotent.

use tidemark_common::config::{DeletePolicy, TaskConfig, VersionConfig};

use crate::engines;
use crate::error::CoordinatorError;

/// Installs what the task's configuration needs; returns one line per installed part.
pub async fn install(config: &TaskConfig) -> Result<Vec<String>, CoordinatorError> {
    let source = engines::source_side(config)?;
    let mut done = Vec::new();
    if config.version == VersionConfig::Trigger {
        done.push(source.install_trigger_version(config).await?);
    }
    if let Some(DeletePolicy::TombstoneTable { .. }) = &config.delete_policy {
        done.push(source.install_delete_log(config).await?);
    }
    if done.is_empty() {
        return Err(CoordinatorError::task_setup(
            &config.name,
            "nothing to install: neither version = \"trigger\" nor delete_policy tombstone_table is configured",
        ));
    }
    Ok(done)
}
