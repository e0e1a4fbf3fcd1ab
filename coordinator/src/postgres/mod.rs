//! PostgreSQL for the coordinator: inspecting a source table (`source`), `source install`
//! (`install`), the target table, ledger and epoch fence (`target`) and dead letters
//! (`dead_letters`).

pub mod dead_letters;
pub mod install;
pub mod source;
pub mod target;

use std::collections::BTreeMap;

use sqlx::postgres::PgPool;
use tidemark_common::config::TaskConfig;
use tidemark_common::cursor::{KeyDomain, KeyValue};
use tidemark_common::pg::connector::{pg_source, pg_target};
use tidemark_common::pg::{Column, TableName, TableSql};
use tidemark_common::source::SourcePool;
use tidemark_common::target::TargetPool;
use tidemark_proto::v1 as pb;

use crate::checkpoints::ControlDb;
use crate::engines::{SourceSide, TargetSide, foreign_pool};
use crate::error::CoordinatorError;
use crate::planner::{PreparedTask, SourceColumn, SourceInfo};

pub(crate) struct Postgres;

fn source_pool(source: &SourcePool) -> Result<&PgPool, CoordinatorError> {
    pg_source(source).ok_or_else(|| foreign_pool("PostgreSQL"))
}

fn target_pool(target: &TargetPool) -> Result<&PgPool, CoordinatorError> {
    pg_target(target).ok_or_else(|| foreign_pool("PostgreSQL"))
}

#[async_trait::async_trait]
impl SourceSide for Postgres {
    async fn connect_url(&self, task: &str, url: &str) -> Result<SourcePool, CoordinatorError> {
        Ok(tidemark_common::pg::connector::source_pool(
            source::connect_database(task, "source", url).await?,
        ))
    }

    async fn primary_key(&self, source: &SourcePool, table: &TableName) -> Result<Vec<String>, CoordinatorError> {
        source::primary_key(source_pool(source)?, table).await
    }

    async fn inspect(&self, config: &TaskConfig) -> Result<SourceInfo, CoordinatorError> {
        source::inspect_pg_source(config).await
    }

    async fn columns(
        &self,
        source: &SourcePool,
        task: &str,
        table: &TableName,
    ) -> Result<Option<Vec<SourceColumn>>, CoordinatorError> {
        source::introspect(source_pool(source)?, task, "source", table).await
    }

    async fn naive_cursor_zone(
        &self,
        source: &SourcePool,
        config: &TaskConfig,
        cursor: &str,
    ) -> Result<String, CoordinatorError> {
        source::naive_cursor_zone(source_pool(source)?, config, cursor).await
    }

    async fn key_domain(
        &self,
        source_info: &SourceInfo,
        config: &TaskConfig,
    ) -> Result<(KeyDomain, Option<KeyValue>), CoordinatorError> {
        source::pg_key_domain(source_pool(&source_info.pool)?, source_info, config).await
    }

    async fn estimated_rows(&self, source: &SourcePool, table: &TableName) -> Result<Option<i64>, sqlx::Error> {
        match pg_source(source) {
            Some(pool) => source::estimated_rows(pool, table).await,
            None => Ok(None),
        }
    }

    async fn prefilled_columns(
        &self,
        source: &SourcePool,
        table: &TableName,
        names: &[String],
    ) -> Result<Vec<String>, CoordinatorError> {
        sqlx::query_scalar(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = $1::regclass AND attname = ANY($2) \
             AND (atthasdef OR atthasmissing OR attnotnull OR attgenerated <> '' OR attidentity <> '') ORDER BY attnum",
        )
        .bind(table.quoted())
        .bind(names)
        .fetch_all(source_pool(source)?)
        .await
        .map_err(CoordinatorError::Source)
    }

    async fn install_trigger_version(&self, config: &TaskConfig) -> Result<String, CoordinatorError> {
        install::install_trigger_version(config).await
    }

    async fn install_delete_log(&self, config: &TaskConfig) -> Result<String, CoordinatorError> {
        install::install_delete_log(config).await
    }
}

#[async_trait::async_trait]
impl TargetSide for Postgres {
    fn lazy_pool(&self, config: &TaskConfig) -> Result<TargetPool, CoordinatorError> {
        Ok(tidemark_common::pg::connector::target_pool(target::lazy_pool(config)?))
    }

    async fn prepare(
        &self,
        config: &TaskConfig,
        sql: &TableSql,
        not_null: &[bool],
        epoch: u64,
    ) -> Result<Option<u64>, CoordinatorError> {
        target::prepare(config, sql, not_null, epoch).await
    }

    async fn build_epoch(
        &self,
        config: &TaskConfig,
        sql: &TableSql,
        not_null: &[bool],
        epoch: u64,
    ) -> Result<(Vec<String>, Vec<String>), CoordinatorError> {
        target::build_epoch(config, sql, not_null, epoch).await
    }

    async fn build_deferred(
        &self,
        config: &TaskConfig,
        statements: &[String],
    ) -> Result<Vec<String>, CoordinatorError> {
        target::build_deferred(config, statements).await
    }

    async fn swap_epoch(&self, config: &TaskConfig, to: u64) -> Result<bool, CoordinatorError> {
        target::swap_epoch(config, to).await
    }

    async fn drop_epoch_table(&self, config: &TaskConfig, epoch: u64) -> Result<(), CoordinatorError> {
        target::drop_epoch_table(config, epoch).await
    }

    async fn add_columns(
        &self,
        config: &TaskConfig,
        table: &TableName,
        columns: &[Column],
    ) -> Result<Vec<String>, CoordinatorError> {
        let statements: Vec<String> = columns
            .iter()
            .map(|c| {
                format!(
                    "ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}",
                    table.quoted(),
                    tidemark_common::pg::quote_ident(&c.name),
                    c.sql_type
                )
            })
            .collect();
        let target = source::connect_database(&config.name, "target", &config.target).await?;
        let failed = |e: sqlx::Error| CoordinatorError::task_setup(&config.name, format!("target table {table}: {e}"));
        let mut tx = target.begin().await.map_err(failed)?;
        for statement in &statements {
            sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
                .execute(&mut *tx)
                .await
                .map_err(failed)?;
        }
        tx.commit().await.map_err(failed)?;
        target.close().await;
        Ok(statements)
    }

    async fn dead_letter_counts(&self, target: &TargetPool, task: &str) -> Result<BTreeMap<String, u64>, sqlx::Error> {
        match pg_target(target) {
            Some(pool) => dead_letters::counts(pool, task).await,
            None => Ok(BTreeMap::new()),
        }
    }

    async fn list_dead_letters(
        &self,
        target: &TargetPool,
        task: &str,
        status: Option<&str>,
        limit: u32,
    ) -> Result<Vec<pb::DeadLetter>, CoordinatorError> {
        dead_letters::list(target_pool(target)?, task, status, limit).await
    }

    async fn retry_dead_letters(
        &self,
        control: &ControlDb,
        target: &TargetPool,
        task: &PreparedTask,
        keys: &[String],
    ) -> Result<pb::RetryDeadLettersResponse, CoordinatorError> {
        dead_letters::retry(control, target_pool(target)?, task, keys).await
    }

    async fn resolve_dead_letters(
        &self,
        target: &TargetPool,
        task: &str,
        keys: &[String],
        all_failed: bool,
    ) -> Result<u64, CoordinatorError> {
        dead_letters::resolve(target_pool(target)?, task, keys, all_failed).await
    }

    async fn purge_dead_letters(
        &self,
        target: &TargetPool,
        task: &str,
        older_than: std::time::Duration,
    ) -> Result<u64, CoordinatorError> {
        dead_letters::purge(target_pool(target)?, task, older_than).await
    }
}
