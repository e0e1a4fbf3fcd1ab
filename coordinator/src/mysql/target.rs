//! A MySQL or MariaDB target, as the coordinator prepares it: the ledger, epoch and
//! dead-letter tables, the task's table (created from the source's columns in their mapped
//! types, or checked), the task's epoch in the target, and `tasks reinit`'s epoch fence.

use sqlx::mysql::MySqlPool;
use tidemark_common::config::TaskConfig;
use tidemark_common::mysql::target::{self as sql, AccumulateMySql};
use tidemark_common::mysql::{self, types};
use tidemark_common::pg::{TableSql, VERSION_COLUMN};

use crate::error::CoordinatorError;

/// A pool on a MySQL target (the coordinator's few statements).
pub fn pool(config: &TaskConfig) -> Result<MySqlPool, CoordinatorError> {
    mysql::target_pool(&config.target, 2, 30)
        .map_err(|e| CoordinatorError::task_setup(&config.name, format!("target URL: {e}")))
}

/// Creates what the task needs in the target and returns the task's epoch there (before
/// this call recorded `epoch` for a task that had none).
pub async fn prepare(
    config: &TaskConfig,
    table: &TableSql,
    not_null: &[bool],
    epoch: u64,
) -> Result<Option<u64>, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let reconciles = config.reconcile_every.is_some()
        || matches!(
            config.delete_policy,
            Some(tidemark_common::config::DeletePolicy::Reconcile {})
        );
    let key_type = table.key_types()[0].clone();
    if reconciles && (table.key_columns.len() != 1 || !crate::planner::is_integer_type(&key_type)) {
        return Err(setup(format!(
            "reconciliation into a MySQL/MariaDB target needs a single integer key (buckets split at integer \
             thresholds compare alike on both engines; text collations do not); ({}) is {key_type}",
            table.key_columns.join(", ")
        )));
    }
    let target = pool(config)?;
    let result = async {
        ensure(&target, config, table, not_null).await?;
        let current: Option<i64> = sqlx::query_scalar(sql::TARGET_EPOCH_NOW)
            .bind(task)
            .fetch_optional(&target)
            .await
            .map_err(|e| setup(format!("reading the task's epoch in the target: {e}")))?;
        if current.is_none_or(|current| current as u64 <= epoch) {
            // Every batch locks this row; `tasks reinit` raises it under an exclusive lock.
            sqlx::query(sql::SEED_TARGET_EPOCH)
                .bind(task)
                .bind(epoch as i64)
                .execute(&target)
                .await
                .map_err(|e| setup(format!("recording the task's epoch in the target: {e}")))?;
        }
        Ok(current.map(|c| c as u64))
    }
    .await;
    target.close().await;
    result
}

async fn ensure(
    target: &MySqlPool,
    config: &TaskConfig,
    table: &TableSql,
    not_null: &[bool],
) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    for (name, ddl) in sql::CONTROL_DDL {
        sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
            .execute(target)
            .await
            .map_err(|e| setup(format!("creating {name} in the target: {e}")))?;
    }
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(target)
        .await
        .map_err(|e| setup(format!("target: {e}")))?;
    let collation = sql::exact_collation(&version);
    let existing = types::columns(target, &table.target.schema, &table.target.name)
        .await
        .map_err(|e| setup(format!("target table {}: {e}", table.target)))?;
    if let Some(spec) = config.accumulate_spec().map_err(&setup)? {
        let summary = AccumulateMySql { table, spec: &spec };
        match existing {
            None => create(target, task, table, summary.create_target_table(collation)).await?,
            Some(existing) => {
                if let Some(missing) = summary
                    .required_columns()
                    .into_iter()
                    .find(|name| !existing.iter().any(|c| &c.name == name))
                {
                    return Err(setup(format!(
                        "summary table {} has no column {missing:?}",
                        table.target
                    )));
                }
                let unique = mysql::inspect::key_is_unique(target, &table.target, &spec.group_by)
                    .await
                    .map_err(|e| setup(format!("summary table {}: {e}", table.target)))?;
                if !unique {
                    return Err(setup(format!(
                        "summary table {}: no unique index or primary key covers exactly group_by ({})",
                        table.target,
                        spec.group_by.join(", ")
                    )));
                }
            }
        }
        return Ok(());
    }
    match existing {
        None => {
            create(
                target,
                task,
                table,
                sql::create_target_table(table, not_null, collation),
            )
            .await?
        }
        Some(existing) => {
            let has = |name: &str| existing.iter().any(|c| c.name == name);
            if !has(VERSION_COLUMN) {
                return Err(setup(format!(
                    "target table {} exists but has no {VERSION_COLUMN} column; drop it or let Tidemark create it",
                    table.target
                )));
            }
            if let Some(missing) = table.columns.iter().find(|c| !has(&c.name)) {
                return Err(setup(format!(
                    "target table {} has no column {:?}",
                    table.target, missing.name
                )));
            }
            let unique = mysql::inspect::key_is_unique(target, &table.target, &table.key_columns)
                .await
                .map_err(|e| setup(format!("target table {}: {e}", table.target)))?;
            if !unique {
                return Err(setup(format!(
                    "target table {}: no primary key or unique index covers exactly the key ({}); the upsert needs one",
                    table.target,
                    table.key_columns.join(", ")
                )));
            }
        }
    }
    if let Some(deletes) = &table.deletes {
        let preparing = |e: sqlx::Error| setup(format!("preparing deletes in the target {}: {e}", table.target));
        sqlx::query(sqlx::AssertSqlSafe(sql::create_tombstone_table(
            table,
            &deletes.tombstones,
            collation,
        )))
        .execute(target)
        .await
        .map_err(preparing)?;
        let columns = types::columns(target, &table.target.schema, &table.target.name)
            .await
            .map_err(preparing)?
            .unwrap_or_default();
        if deletes.target_soft && !columns.iter().any(|c| c.name == tidemark_common::pg::DELETED_COLUMN) {
            sqlx::query(sqlx::AssertSqlSafe(sql::add_soft_delete_column(table)))
                .execute(target)
                .await
                .map_err(preparing)?;
        }
    }
    Ok(())
}

async fn create(target: &MySqlPool, task: &str, table: &TableSql, ddl: String) -> Result<(), CoordinatorError> {
    sqlx::query(sqlx::AssertSqlSafe(ddl))
        .execute(target)
        .await
        .map_err(|e| CoordinatorError::task_setup(task, format!("creating target table {}: {e}", table.target)))?;
    tracing::info!(task, table = %table.target, "created target table in MySQL/MariaDB");
    Ok(())
}

/// `tasks reinit` on a MySQL target: a source column the table lacks is added with
/// `alter_target` (nullable, in its mapped type: the new epoch's snapshot fills it), else
/// refused by name; a column of another type is kept as it is (values it cannot hold become
/// dead letters). Then the task's epoch is raised under the row's exclusive lock, so no batch
/// of the old epoch commits after it; an accumulate task's totals and dead letters are
/// emptied in the same transaction. Returns the statements that altered the table.
pub async fn reinit(
    config: &TaskConfig,
    table: &TableSql,
    not_null: &[bool],
    epoch: u64,
    alter_target: bool,
) -> Result<Vec<String>, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let failed =
        |e: sqlx::Error| CoordinatorError::task_setup(task, format!("raising epoch {epoch} in the target: {e}"));
    let target = pool(config)?;
    let result = async {
        let mut changes = Vec::new();
        let existing = types::columns(&target, &table.target.schema, &table.target.name)
            .await
            .map_err(|e| setup(format!("target table {}: {e}", table.target)))?;
        if let Some(existing) = existing
            && config.accumulate_spec().map_err(&setup)?.is_none()
        {
            let missing: Vec<&tidemark_common::pg::Column> = table
                .columns
                .iter()
                .filter(|c| !existing.iter().any(|e| e.name == c.name))
                .collect();
            if !missing.is_empty() && !alter_target {
                let names: Vec<&str> = missing.iter().map(|c| c.name.as_str()).collect();
                return Err(setup(format!(
                    "target table {} has no column {}; add the columns, or run `tidemark-coordinator tasks reinit \
                     {task} --alter-target`",
                    table.target,
                    names.join(", ")
                )));
            }
            for column in missing {
                let statement = format!(
                    "ALTER TABLE {} ADD COLUMN {} {}",
                    sql::quoted_table(&table.target),
                    mysql::quote_ident(&column.name),
                    sql::column_type(&column.sql_type, false)
                );
                sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
                    .execute(&target)
                    .await
                    .map_err(|e| setup(format!("{statement}: {e}")))?;
                tracing::warn!(task, %statement, "target table altered to the source's columns");
                changes.push(statement);
            }
        }
        ensure(&target, config, table, not_null).await?;
        let mut tx = target.begin().await.map_err(failed)?;
        sqlx::query("SELECT epoch FROM tidemark_epochs WHERE task = ? FOR UPDATE")
            .bind(task)
            .fetch_optional(&mut *tx)
            .await
            .map_err(failed)?;
        sqlx::query(sql::RAISE_TARGET_EPOCH)
            .bind(task)
            .bind(epoch as i64)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        if let Some(spec) = config
            .accumulate_spec()
            .map_err(|e| CoordinatorError::task_setup(task, e))?
        {
            let summary = AccumulateMySql { table, spec: &spec };
            sqlx::query(sqlx::AssertSqlSafe(summary.reset_totals()))
                .execute(&mut *tx)
                .await
                .map_err(failed)?;
            sqlx::query("DELETE FROM tidemark_dead_letters WHERE task = ?")
                .bind(task)
                .execute(&mut *tx)
                .await
                .map_err(failed)?;
            tracing::warn!(task, epoch, table = %table.target, "accumulate totals reset for the new epoch");
        }
        tx.commit().await.map_err(failed)?;
        Ok(changes)
    }
    .await;
    target.close().await;
    result
}

/// Dead letters per status on a MySQL target.
pub async fn dead_letter_counts(
    target: &MySqlPool,
    task: &str,
) -> Result<std::collections::BTreeMap<String, u64>, sqlx::Error> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, CAST(COUNT(*) AS SIGNED) FROM tidemark_dead_letters WHERE task = ? GROUP BY status",
    )
    .bind(task)
    .fetch_all(target)
    .await?;
    Ok(rows.into_iter().map(|(status, count)| (status, count as u64)).collect())
}
