//! A PostgreSQL target as the coordinator prepares it: the target table (created with the
//! source's types or checked), the ledger, dead letters, tombstones, an accumulate task's
//! summary table, and the epoch fence raised before a switch.

use sqlx::postgres::PgPool;
use tidemark_common::config::TaskConfig;
use tidemark_common::pg::{self, DeleteSql, TableSql, VERSION_COLUMN};

use crate::error::CoordinatorError;
use crate::postgres::source::{connect_database, introspect, key_is_unique};

pub(crate) const LEDGER_DDL: &str = include_str!("../../../migrations/target/ledger.sql");
pub(crate) const DEAD_LETTERS_DDL: &str = include_str!("../../../migrations/target/dead_letters.sql");

/// An accumulate task's summary table: created when missing, else it must have the group and
/// aggregate columns.
pub(crate) async fn ensure_summary_table(
    target: &PgPool,
    task: &str,
    sql: &TableSql,
    spec: &tidemark_common::transform::AccumulateSpec,
) -> Result<(), CoordinatorError> {
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let summary = tidemark_common::pg::accumulate::AccumulateSql { table: sql, spec };
    match introspect(target, task, "target", &sql.target).await? {
        None => {
            sqlx::query(sqlx::AssertSqlSafe(summary.create_target_table()))
                .execute(target)
                .await
                .map_err(|e| setup(format!("creating summary table {}: {e}", sql.target)))?;
            tracing::info!(task, table = %sql.target, "created summary table");
        }
        Some(existing) => {
            if let Some(missing) = summary
                .required_columns()
                .into_iter()
                .find(|name| !existing.iter().any(|c| &c.column.name == name))
            {
                return Err(setup(format!("summary table {} has no column {missing:?}", sql.target)));
            }
            if !key_is_unique(target, &sql.target, &spec.group_by).await? {
                return Err(setup(format!(
                    "summary table {}: no unique index or primary key covers exactly group_by ({})",
                    sql.target,
                    spec.group_by.join(", ")
                )));
            }
        }
    }
    Ok(())
}

/// Raises the task's epoch in the target, before the control database switches to it: from
/// then on every batch of an older epoch is refused in the target (see `pg::TARGET_EPOCH`).
/// An accumulate task's totals are emptied in the same transaction, with its dead letters:
/// the new epoch counts every row again, so totals never double. (Readers see the totals
/// rebuilt from zero; building beside the live table is issue 17's epoch switch.)
pub(crate) async fn fence_target_epoch(
    target: &PgPool,
    config: &TaskConfig,
    sql: &TableSql,
    epoch: u64,
) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let failed =
        |e: sqlx::Error| CoordinatorError::task_setup(task, format!("raising epoch {epoch} in the target: {e}"));
    let mut tx = target.begin().await.map_err(failed)?;
    sqlx::query(pg::LOCK_TARGET_EPOCH)
        .bind(task)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    sqlx::query(pg::RAISE_TARGET_EPOCH)
        .bind(task)
        .bind(epoch as i64)
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    if let Some(spec) = config
        .accumulate_spec()
        .map_err(|e| CoordinatorError::task_setup(task, e))?
    {
        let summary = pg::accumulate::AccumulateSql {
            table: sql,
            spec: &spec,
        };
        sqlx::query(sqlx::AssertSqlSafe(summary.reset_totals()))
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        sqlx::query(tidemark_common::dead_letters::DELETE_TASK_LETTERS)
            .bind(task)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        tracing::warn!(task, epoch, table = %sql.target, "accumulate totals reset for the new epoch");
    }
    tx.commit().await.map_err(failed)
}

/// Creates the target table and the ledger when missing; an existing target table must carry
/// the version column and every source column.
pub(crate) async fn ensure_target(
    target: &PgPool,
    config: &TaskConfig,
    sql: &TableSql,
    not_null: &[bool],
) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    for (ddl, table) in [
        (LEDGER_DDL, pg::LEDGER_TABLE),
        (DEAD_LETTERS_DDL, tidemark_common::dead_letters::TABLE),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
            .execute(target)
            .await
            .map_err(|e| setup(format!("creating {table}: {e}")))?;
    }
    if let Some(spec) = config.accumulate_spec().map_err(&setup)? {
        return ensure_summary_table(target, task, sql, &spec).await;
    }
    match introspect(target, task, "target", &sql.target).await? {
        None => {
            let ddl = sql.create_target_table(not_null);
            sqlx::query(sqlx::AssertSqlSafe(ddl))
                .execute(target)
                .await
                .map_err(|e| setup(format!("creating target table {}: {e}", sql.target)))?;
            tracing::info!(task, table = %sql.target, "created target table");
        }
        Some(existing) => {
            let has = |name: &str| existing.iter().any(|c| c.column.name == name);
            if !has(VERSION_COLUMN) {
                return Err(setup(format!(
                    "target table {} exists but has no {VERSION_COLUMN} column; drop it or let Tidemark create it",
                    sql.target
                )));
            }
            if let Some(missing) = sql.columns.iter().find(|c| !has(&c.name)) {
                return Err(setup(format!(
                    "target table {} has no column {:?}",
                    sql.target, missing.name
                )));
            }
        }
    }
    if let Some(deletes) = &sql.deletes {
        let mut statements = vec![deletes.create_tombstone_table(sql)];
        if deletes.target_soft {
            statements.push(DeleteSql::add_soft_delete_column(sql));
        }
        for statement in statements {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(target)
                .await
                .map_err(|e| setup(format!("preparing deletes in the target {}: {e}", sql.target)))?;
        }
    }
    Ok(())
}

/// Prepares the target (see [`ensure_target`]) and returns the task's epoch the target holds.
pub(crate) async fn prepare(
    config: &TaskConfig,
    sql: &TableSql,
    not_null: &[bool],
) -> Result<Option<u64>, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let target = connect_database(task, "target", &config.target).await?;
    ensure_target(&target, config, sql, not_null).await?;
    let target_epoch: Option<i64> = sqlx::query_scalar(pg::TARGET_EPOCH_NOW)
        .bind(task)
        .fetch_optional(&target)
        .await
        .map_err(|e| setup(format!("reading the task's epoch in the target: {e}")))?;
    target.close().await;
    Ok(target_epoch.map(|e| e as u64))
}

/// A pool on the target that connects on first use.
pub(crate) fn lazy_pool(config: &TaskConfig) -> Result<PgPool, CoordinatorError> {
    let options = pg::connect_options(&config.target, "tidemark-coordinator")
        .map_err(|e| CoordinatorError::task_setup(&config.name, format!("target URL: {e}")))?;
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(std::time::Duration::from_secs(5))
        .connect_lazy_with(options))
}

/// `tasks reinit` on the target: checks it against the source's columns (with
/// `alter_target`, first changes it to hold them), then raises the epoch fence. Returns the
/// statements applied and the differences left.
pub(crate) async fn reinit(
    config: &TaskConfig,
    sql: &TableSql,
    not_null: &[bool],
    epoch: u64,
    alter_target: bool,
) -> Result<(Vec<String>, Vec<String>), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let mut applied = Vec::new();
    let mut differences = Vec::new();
    let target = connect_database(task, "target", &config.target).await?;
    // An accumulate task's target is its summary table, not a copy of the source's columns.
    if config.accumulate_spec().map_err(&setup)?.is_none()
        && let Some(existing) = introspect(&target, task, "target", &sql.target).await?
    {
        let existing: Vec<pg::Column> = existing.into_iter().map(|c| c.column).collect();
        let changes = crate::planner::target_changes(&sql.target, &sql.columns, &existing);
        if alter_target && !changes.is_empty() {
            let altering = |e: sqlx::Error| setup(format!("altering target table {}: {e}", sql.target));
            let mut tx = target.begin().await.map_err(altering)?;
            for change in &changes {
                sqlx::query(sqlx::AssertSqlSafe(change.statement.clone()))
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| setup(format!("{}: {e}", change.statement)))?;
            }
            tx.commit().await.map_err(altering)?;
            tracing::warn!(task, table = %sql.target, changes = changes.len(), "target table altered to the source's columns");
            applied = changes.into_iter().map(|c| c.statement).collect();
        } else {
            let missing: Vec<&str> = changes
                .iter()
                .filter(|c| c.statement.contains(" ADD COLUMN "))
                .map(|c| c.difference.as_str())
                .collect();
            if !missing.is_empty() {
                return Err(setup(format!(
                    "target table {}: {}; add the columns, or run `tidemark-coordinator tasks reinit {task} --alter-target`",
                    sql.target,
                    missing.join("; ")
                )));
            }
            differences = changes.into_iter().map(|c| c.difference).collect();
        }
    }
    ensure_target(&target, config, sql, not_null).await?;
    fence_target_epoch(&target, config, sql, epoch).await?;
    target.close().await;
    Ok((applied, differences))
}
