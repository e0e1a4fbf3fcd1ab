//! A MySQL or MariaDB target, as the coordinator prepares it: the ledger, epoch and
//! dead-letter tables, the task's table (created from the source's columns in their mapped
//! types, or checked), the task's epoch in the target, and `tasks reinit`'s epoch fence.

use sqlx::mysql::MySqlPool;
use tidemark_common::config::TaskConfig;
use tidemark_common::mysql::target::{self as sql, AccumulateMySql};
use tidemark_common::mysql::{self, types};
use tidemark_common::pg::{TableName, TableSql, VERSION_COLUMN};

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
    let swaps: i64 = sqlx::query_scalar(sql::HAS_SWAPPING)
        .fetch_one(target)
        .await
        .map_err(|e| setup(format!("target: {e}")))?;
    if swaps == 0 {
        sqlx::query(sql::ADD_SWAPPING)
            .execute(target)
            .await
            .map_err(|e| setup(format!("adding the swap mark to tidemark_epochs in the target: {e}")))?;
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

/// `tasks reinit`: epoch `epoch`'s table beside the live one (`table.target` names it),
/// created afresh with the source's columns in their mapped types (or the summary's). The
/// live table's secondary indexes as they are now are carried over: unique ones at once, the
/// others returned to be built after the snapshot's load. Returns the statements run and
/// those deferred.
pub async fn build_epoch(
    config: &TaskConfig,
    table: &TableSql,
    not_null: &[bool],
) -> Result<(Vec<String>, Vec<String>), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let live = TableName::parse(&config.target_table).map_err(&setup)?;
    let target = pool(config)?;
    let result = async {
        // A table of this name is a leftover of a reinit that failed before its epoch was
        // recorded: nothing reads it.
        let drop = format!("DROP TABLE IF EXISTS {}", sql::quoted_table(&table.target));
        sqlx::query(sqlx::AssertSqlSafe(drop.clone()))
            .execute(&target)
            .await
            .map_err(|e| setup(format!("{drop}: {e}")))?;
        ensure(&target, config, table, not_null).await?;
        let mut statements = vec![format!("CREATE TABLE {}", sql::quoted_table(&table.target))];
        let mut deferred = Vec::new();
        let rows: Vec<(String, bool, String)> = sqlx::query_as(
            "SELECT CAST(index_name AS CHAR), non_unique = 0, \
             CAST(GROUP_CONCAT(CONCAT('`', REPLACE(column_name, '`', '``'), '`', \
                  IF(sub_part IS NULL, '', CONCAT('(', sub_part, ')'))) ORDER BY seq_in_index SEPARATOR ', ') AS CHAR) \
             FROM information_schema.statistics WHERE table_schema = ? AND table_name = ? AND index_name <> 'PRIMARY' \
             GROUP BY index_name, non_unique ORDER BY index_name",
        )
        .bind(&live.schema)
        .bind(&live.name)
        .fetch_all(&target)
        .await
        .map_err(|e| setup(format!("reading the indexes of {live}: {e}")))?;
        for (name, unique, columns) in rows {
            let statement = format!(
                "ALTER TABLE {} ADD {}INDEX {} ({columns})",
                sql::quoted_table(&table.target),
                if unique { "UNIQUE " } else { "" },
                mysql::quote_ident(&name)
            );
            if !unique {
                deferred.push(statement);
                continue;
            }
            // An index on a column the new epoch no longer has is left behind, said so.
            match sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
                .execute(&target)
                .await
            {
                Ok(_) => statements.push(statement),
                Err(error) => tracing::warn!(task, index = %name, %error, "index of the live table not carried over"),
            }
        }
        Ok((statements, deferred))
    }
    .await;
    target.close().await;
    result
}

/// Builds the indexes deferred to after a new epoch's snapshot; one already there (a round
/// cut short) counts as built. Returns the ones that could not be built, with why.
pub async fn build_deferred(config: &TaskConfig, statements: &[String]) -> Result<Vec<String>, CoordinatorError> {
    let target = pool(config)?;
    let mut failed = Vec::new();
    for statement in statements {
        match sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
            .execute(&target)
            .await
        {
            Ok(_) => {}
            // ER_DUP_KEYNAME
            Err(sqlx::Error::Database(db))
                if db
                    .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                    .is_some_and(|e| e.number() == 1061) => {}
            Err(error) => failed.push(format!("{statement}: {error}")),
        }
    }
    target.close().await;
    Ok(failed)
}

/// Makes epoch `to`'s table the task's live table. MySQL's RENAME TABLE commits implicitly, so
/// the fence row cannot stay locked across it; instead a first transaction marks the row
/// (`swapping`) under its exclusive lock, which waits for every batch holding it shared; from
/// then on each batch refuses itself. One RENAME TABLE swaps both names atomically (readers
/// see one table or the other), then the fence moves to `to` and the mark is cleared. A swap
/// cut short is finished by the next call: the rename is done unless `to`'s table still has
/// its epoch name. False when the fence already held `to`.
pub async fn swap_epoch(config: &TaskConfig, to: u64) -> Result<bool, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let live = TableName::parse(&config.target_table).map_err(&setup)?;
    let target = pool(config)?;
    let failed = |e: sqlx::Error| setup(format!("switching {live} to epoch {to}: {e}"));
    let result = async {
        let mut tx = target.begin().await.map_err(failed)?;
        let row: Option<(i64, Option<i64>)> =
            sqlx::query_as("SELECT epoch, swapping FROM tidemark_epochs WHERE task = ? FOR UPDATE")
                .bind(task)
                .fetch_optional(&mut *tx)
                .await
                .map_err(failed)?;
        let (from, swapping) = row.ok_or_else(|| setup(format!("the target has no epoch for task {task}")))?;
        let from = from as u64;
        match swapping {
            None if from == to => {
                tx.rollback().await.map_err(failed)?;
                return Ok(false);
            }
            Some(other) if other as u64 != to => {
                return Err(setup(format!(
                    "the target is switching task {task} to epoch {other}, not {to}: `tidemark-coordinator \
                     status` shows which epoch the control database makes live"
                )));
            }
            _ => {}
        }
        sqlx::query(sql::SWAP_BEGIN)
            .bind(to as i64)
            .bind(task)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        tx.commit().await.map_err(failed)?;
        let incoming = live.epoch_table(to);
        let outgoing = live.epoch_table(from);
        let exists = |table: TableName| {
            let target = &target;
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = ?",
                )
                .bind(&table.schema)
                .bind(&table.name)
                .fetch_one(target)
                .await
                .map(|n| n > 0)
            }
        };
        if exists(incoming.clone()).await.map_err(failed)? {
            let rename = format!(
                "RENAME TABLE {} TO {}, {} TO {}",
                sql::quoted_table(&live),
                sql::quoted_table(&outgoing),
                sql::quoted_table(&incoming),
                sql::quoted_table(&live)
            );
            // A query running on the live table holds the rename back, and every query after
            // it would queue behind: wait a little, then give up and try again next round.
            let mut conn = target.acquire().await.map_err(failed)?;
            let wait = crate::epochs::SWAP_LOCK_WAIT.as_secs();
            sqlx::query(sqlx::AssertSqlSafe(format!("SET SESSION lock_wait_timeout = {wait}")))
                .execute(&mut *conn)
                .await
                .map_err(failed)?;
            let renamed = sqlx::query(sqlx::AssertSqlSafe(rename)).execute(&mut *conn).await;
            // The session does not go back to the pool with the short timeout.
            conn.close().await.map_err(failed)?;
            renamed.map_err(failed)?;
            // Privileges are granted by name in MySQL: they stay with the live name. The
            // table's comment is the table's own: carried over.
            let comment: Option<String> = sqlx::query_scalar(
                "SELECT CAST(table_comment AS CHAR) FROM information_schema.tables WHERE table_schema = ? \
                 AND table_name = ?",
            )
            .bind(&outgoing.schema)
            .bind(&outgoing.name)
            .fetch_optional(&target)
            .await
            .map_err(failed)?;
            if let Some(comment) = comment.filter(|c| !c.is_empty()) {
                let statement = format!(
                    "ALTER TABLE {} COMMENT = {}",
                    sql::quoted_table(&live),
                    mysql::quote_literal(&comment)
                );
                sqlx::query(sqlx::AssertSqlSafe(statement))
                    .execute(&target)
                    .await
                    .map_err(failed)?;
            }
        } else if !exists(outgoing.clone()).await.map_err(failed)? {
            return Err(setup(format!(
                "epoch {to}'s table {incoming} is missing in the target: it cannot become {live}"
            )));
        }
        tidemark_common::crash::point("swap_mid_target");
        if to > from && config.accumulate_spec().map_err(&setup)?.is_some() {
            // The new epoch counted every row itself: an older epoch's letter retried into its
            // totals would count twice.
            sqlx::query(
                "DELETE FROM tidemark_dead_letters WHERE task = ? AND batch_id IN \
                 (SELECT batch_id FROM tidemark_ledger WHERE task = ? AND epoch < ?)",
            )
            .bind(task)
            .bind(task)
            .bind(to as i64)
            .execute(&target)
            .await
            .map_err(failed)?;
        }
        sqlx::query(sql::SWAP_END)
            .bind(to as i64)
            .bind(task)
            .execute(&target)
            .await
            .map_err(failed)?;
        Ok(true)
    }
    .await;
    target.close().await;
    result
}

/// Drops a retained or abandoned epoch's table.
pub async fn drop_epoch_table(config: &TaskConfig, epoch: u64) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let table = TableName::parse(&config.target_table)
        .map_err(&setup)?
        .epoch_table(epoch);
    let target = pool(config)?;
    let drop = format!("DROP TABLE IF EXISTS {}", sql::quoted_table(&table));
    let result = sqlx::query(sqlx::AssertSqlSafe(drop.clone())).execute(&target).await;
    target.close().await;
    result.map_err(|e| setup(format!("{drop}: {e}")))?;
    Ok(())
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
