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
    epoch: u64,
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
    if target_epoch.is_none() {
        // The live epoch's fence: a newer epoch's batches go to its own table from now on.
        sqlx::query("INSERT INTO tidemark_epochs (task, epoch) VALUES ($1, $2) ON CONFLICT (task) DO NOTHING")
            .bind(task)
            .bind(epoch as i64)
            .execute(&target)
            .await
            .map_err(|e| setup(format!("recording the task's epoch in the target: {e}")))?;
    }
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

/// `tasks reinit`: epoch `epoch`'s table beside the live one (`sql.target` names it), created
/// afresh with the source's columns (or the summary's) and the task's tombstones. The live
/// table's secondary indexes as they are now are carried over: unique ones at once (they
/// decide which rows the table takes), the others returned to be built after the snapshot's
/// load (faster than maintaining them row by row). Returns the statements run and those
/// deferred.
pub(crate) async fn build_epoch(
    config: &TaskConfig,
    sql: &TableSql,
    not_null: &[bool],
    epoch: u64,
) -> Result<(Vec<String>, Vec<String>), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let live = tidemark_common::pg::TableName::parse(&config.target_table).map_err(&setup)?;
    let target = connect_database(task, "target", &config.target).await?;
    let result = async {
        // A table of this name is a leftover of a reinit that failed before its epoch was
        // recorded: nothing reads it.
        let drop = format!("DROP TABLE IF EXISTS {}", sql.target.quoted());
        sqlx::query(sqlx::AssertSqlSafe(drop.clone()))
            .execute(&target)
            .await
            .map_err(|e| setup(format!("{drop}: {e}")))?;
        ensure_target(&target, config, sql, not_null).await?;
        let mut statements = vec![format!("CREATE TABLE {}", sql.target.quoted())];
        let mut deferred = Vec::new();
        let indexes: Vec<(String, String)> = sqlx::query_as(
            "SELECT ic.relname::text, pg_get_indexdef(i.indexrelid) FROM pg_index i \
             JOIN pg_class c ON c.oid = i.indrelid JOIN pg_class ic ON ic.oid = i.indexrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2 \
             AND NOT i.indisprimary ORDER BY i.indexrelid",
        )
        .bind(&live.schema)
        .bind(&live.name)
        .fetch_all(&target)
        .await
        .map_err(|e| setup(format!("reading the indexes of {live}: {e}")))?;
        for (name, definition) in indexes {
            let name = pg::derived_name("", &name, &format!("__tm_e{epoch}"));
            let Some((statement, unique)) = index_on(&definition, &name, &sql.target) else {
                continue;
            };
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
                Err(error) => tracing::warn!(task, %definition, %error, "index of the live table not carried over"),
            }
        }
        Ok((statements, deferred))
    }
    .await;
    target.close().await;
    result
}

/// Builds the indexes deferred to after a new epoch's snapshot (each idempotent); returns the
/// ones that could not be built, with why (an index on a column the epoch no longer has).
pub(crate) async fn build_deferred(
    config: &TaskConfig,
    statements: &[String],
) -> Result<Vec<String>, CoordinatorError> {
    let task = config.name.as_str();
    let target = connect_database(task, "target", &config.target).await?;
    let mut failed = Vec::new();
    for statement in statements {
        if let Err(error) = sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
            .execute(&target)
            .await
        {
            failed.push(format!("{statement}: {error}"));
        }
    }
    target.close().await;
    Ok(failed)
}

/// `CREATE [UNIQUE] INDEX old ON [ONLY] table USING …` (as `pg_get_indexdef` prints it) as
/// the same index named `name` on `table`, and whether it is unique.
fn index_on(definition: &str, name: &str, table: &tidemark_common::pg::TableName) -> Option<(String, bool)> {
    let unique = definition.starts_with("CREATE UNIQUE INDEX ");
    if !unique && !definition.starts_with("CREATE INDEX ") {
        return None;
    }
    let using = definition.find(" USING ")?;
    Some((
        format!(
            "CREATE {}INDEX IF NOT EXISTS {} ON {}{}",
            if unique { "UNIQUE " } else { "" },
            pg::quote_ident(name),
            table.quoted(),
            &definition[using..]
        ),
        unique,
    ))
}

/// Makes epoch `to`'s table the task's live table in one transaction, under the task's epoch
/// lock (which every batch holds shared, so no batch of either epoch is between its fence check
/// and its commit): the live table takes its epoch's name beside (retained), `to`'s table takes
/// the live name with the privileges and comments the outgoing table carried, and the fence
/// moves to `to`. Readers see one table or the other, never neither. False when the fence
/// already held `to` (a swap finished before a restart).
pub(crate) async fn swap_epoch(config: &TaskConfig, to: u64) -> Result<bool, CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let live = tidemark_common::pg::TableName::parse(&config.target_table).map_err(&setup)?;
    let target = connect_database(task, "target", &config.target).await?;
    let failed = |e: sqlx::Error| setup(format!("switching {live} to epoch {to}: {e}"));
    let result = async {
        let mut tx = target.begin().await.map_err(failed)?;
        sqlx::query(pg::LOCK_TARGET_EPOCH)
            .bind(task)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        let from: Option<i64> = sqlx::query_scalar(pg::TARGET_EPOCH_NOW)
            .bind(task)
            .fetch_optional(&mut *tx)
            .await
            .map_err(failed)?;
        let from = from.ok_or_else(|| setup(format!("the target has no epoch for task {task}")))? as u64;
        if from == to {
            return Ok(false);
        }
        let incoming = live.epoch_table(to);
        let outgoing = live.epoch_table(from);
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(incoming.quoted())
            .fetch_one(&mut *tx)
            .await
            .map_err(failed)?;
        if !exists {
            return Err(setup(format!(
                "epoch {to}'s table {incoming} is missing in the target: it cannot become {live}"
            )));
        }
        // A query running on the live table holds the renames back, and every query after
        // them would queue behind: wait a little, then give up and try again next round.
        let statements = [
            format!(
                "SET LOCAL lock_timeout = '{}ms'",
                crate::epochs::SWAP_LOCK_WAIT.as_millis()
            ),
            format!(
                "ALTER TABLE {} RENAME TO {}",
                live.quoted(),
                pg::quote_ident(&outgoing.name)
            ),
            format!(
                "ALTER TABLE {} RENAME TO {}",
                incoming.quoted(),
                pg::quote_ident(&live.name)
            ),
        ];
        for statement in statements {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await
                .map_err(failed)?;
        }
        // What readers and writers were granted on the live table, and its comments, stay
        // with the live name (PostgreSQL keeps them with the renamed table).
        let carried: Vec<String> = sqlx::query_scalar(CARRY_OVER)
            .bind(outgoing.quoted())
            .bind(live.quoted())
            .fetch_all(&mut *tx)
            .await
            .map_err(failed)?;
        for statement in carried {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await
                .map_err(failed)?;
        }
        sqlx::query("UPDATE tidemark_epochs SET epoch = $2 WHERE task = $1")
            .bind(task)
            .bind(to as i64)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        if to > from && config.accumulate_spec().map_err(&setup)?.is_some() {
            // The new epoch counted every row itself: an older epoch's letter retried into its
            // totals would count twice.
            sqlx::query(
                "DELETE FROM tidemark_dead_letters WHERE task = $1 AND batch_id IN \
                 (SELECT batch_id FROM tidemark_ledger WHERE task = $1 AND epoch < $2)",
            )
            .bind(task)
            .bind(to as i64)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        }
        tx.commit().await.map_err(failed)?;
        Ok(true)
    }
    .await;
    target.close().await;
    result
}

/// The statements that give the table `$2` the table privileges (but its owner's) and the
/// table and column comments that `$1` carries.
const CARRY_OVER: &str = "\
    SELECT format('GRANT %s ON %s TO %s', a.privilege_type, $2, \
                  CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END) \
    FROM pg_class c, aclexplode(c.relacl) a WHERE c.oid = $1::regclass AND a.grantee <> c.relowner \
    UNION ALL \
    SELECT format('COMMENT ON TABLE %s IS %L', $2, d.description) \
    FROM pg_description d WHERE d.objoid = $1::regclass AND d.classoid = 'pg_class'::regclass AND d.objsubid = 0 \
    UNION ALL \
    SELECT format('COMMENT ON COLUMN %s.%I IS %L', $2, a.attname, d.description) \
    FROM pg_description d JOIN pg_attribute a ON a.attrelid = d.objoid AND a.attnum = d.objsubid \
    JOIN pg_attribute n ON n.attrelid = $2::regclass AND n.attname = a.attname AND NOT n.attisdropped \
    WHERE d.objoid = $1::regclass AND d.classoid = 'pg_class'::regclass AND d.objsubid > 0";

/// Drops a retained or abandoned epoch's table.
pub(crate) async fn drop_epoch_table(config: &TaskConfig, epoch: u64) -> Result<(), CoordinatorError> {
    let task = config.name.as_str();
    let setup = |message: String| CoordinatorError::task_setup(task, message);
    let table = tidemark_common::pg::TableName::parse(&config.target_table)
        .map_err(&setup)?
        .epoch_table(epoch);
    let target = connect_database(task, "target", &config.target).await?;
    let drop = format!("DROP TABLE IF EXISTS {}", table.quoted());
    let result = sqlx::query(sqlx::AssertSqlSafe(drop.clone())).execute(&target).await;
    target.close().await;
    result.map_err(|e| setup(format!("{drop}: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_index_is_recreated_on_the_epoch_table() {
        let table = tidemark_common::pg::TableName::parse("app.items__tm_e2").unwrap();
        assert_eq!(
            index_on(
                "CREATE UNIQUE INDEX items_name_key ON app.items USING btree (name)",
                "k",
                &table
            ),
            Some((
                "CREATE UNIQUE INDEX IF NOT EXISTS \"k\" ON \"app\".\"items__tm_e2\" USING btree (name)".into(),
                true
            ))
        );
        assert_eq!(
            index_on(
                "CREATE INDEX \"odd ON name\" ON ONLY app.items USING btree (qty) WHERE (qty > 0)",
                "i",
                &table
            ),
            Some((
                "CREATE INDEX IF NOT EXISTS \"i\" ON \"app\".\"items__tm_e2\" USING btree (qty) WHERE (qty > 0)".into(),
                false
            ))
        );
        assert_eq!(index_on("CREATE TABLE x", "x", &table), None);
    }
}
