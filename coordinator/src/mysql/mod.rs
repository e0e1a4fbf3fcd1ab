//! MySQL and MariaDB for the coordinator: inspecting a source table (`source`), `source install`
//! (`install`), the target table, ledger and epoch fence (`target`) and dead letters
//! (`dead_letters`).

pub mod dead_letters;
pub mod install;
pub mod source;
pub mod target;

use std::collections::BTreeMap;

use sqlx::mysql::MySqlPool;
use tidemark_common::config::TaskConfig;
use tidemark_common::cursor::{KeyDomain, KeyValue};
use tidemark_common::mysql::connector::{mysql_source, mysql_target};
use tidemark_common::pg::{Column, TableName, TableSql};
use tidemark_common::source::SourcePool;
use tidemark_common::target::TargetPool;
use tidemark_proto::v1 as pb;

use crate::checkpoints::ControlDb;
use crate::engines::{SourceSide, TargetSide, foreign_pool};
use crate::error::CoordinatorError;
use crate::planner::{PreparedTask, SourceColumn, SourceInfo};

pub(crate) struct MySql;

fn source_pool(source: &SourcePool) -> Result<&MySqlPool, CoordinatorError> {
    mysql_source(source).ok_or_else(|| foreign_pool("MySQL/MariaDB"))
}

fn target_pool(target: &TargetPool) -> Result<&MySqlPool, CoordinatorError> {
    mysql_target(target).ok_or_else(|| foreign_pool("MySQL/MariaDB"))
}

#[async_trait::async_trait]
impl SourceSide for MySql {
    async fn connect_url(&self, task: &str, url: &str) -> Result<SourcePool, CoordinatorError> {
        Ok(tidemark_common::mysql::connector::source_pool(source::connect_mysql(
            task, url,
        )?))
    }

    async fn primary_key(&self, source: &SourcePool, table: &TableName) -> Result<Vec<String>, CoordinatorError> {
        source::primary_key(source_pool(source)?, table).await
    }

    async fn inspect(&self, config: &TaskConfig) -> Result<SourceInfo, CoordinatorError> {
        source::inspect_mysql_source(config).await
    }

    async fn columns(
        &self,
        source: &SourcePool,
        _task: &str,
        table: &TableName,
    ) -> Result<Option<Vec<SourceColumn>>, CoordinatorError> {
        source::introspect_mysql(source_pool(source)?, table).await
    }

    async fn naive_cursor_zone(
        &self,
        source: &SourcePool,
        config: &TaskConfig,
        cursor: &str,
    ) -> Result<String, CoordinatorError> {
        source::mysql_cursor_zone(source_pool(source)?, config, cursor).await
    }

    async fn key_domain(
        &self,
        source_info: &SourceInfo,
        config: &TaskConfig,
    ) -> Result<(KeyDomain, Option<KeyValue>), CoordinatorError> {
        source::mysql_key_domain(source_pool(&source_info.pool)?, source_info, config).await
    }

    async fn estimated_rows(&self, source: &SourcePool, table: &TableName) -> Result<Option<i64>, sqlx::Error> {
        match mysql_source(source) {
            Some(pool) => tidemark_common::mysql::inspect::estimated_rows(pool, table).await,
            None => Ok(None),
        }
    }

    async fn prefilled_columns(
        &self,
        source: &SourcePool,
        table: &TableName,
        names: &[String],
    ) -> Result<Vec<String>, CoordinatorError> {
        // MariaDB shows a nullable column without a default as the text `NULL`.
        let filled: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(COLUMN_NAME AS CHAR) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? \
             AND ((COLUMN_DEFAULT IS NOT NULL AND COLUMN_DEFAULT <> 'NULL') OR EXTRA <> '' OR IS_NULLABLE = 'NO') \
             ORDER BY ORDINAL_POSITION",
        )
        .bind(&table.schema)
        .bind(&table.name)
        .fetch_all(source_pool(source)?)
        .await
        .map_err(CoordinatorError::Source)?;
        Ok(filled.into_iter().filter(|name| names.contains(name)).collect())
    }

    async fn install_trigger_version(&self, config: &TaskConfig) -> Result<String, CoordinatorError> {
        install::install_trigger_version(config).await
    }

    async fn install_delete_log(&self, config: &TaskConfig) -> Result<String, CoordinatorError> {
        install::install_delete_log(config).await
    }
}

#[async_trait::async_trait]
impl TargetSide for MySql {
    fn lazy_pool(&self, config: &TaskConfig) -> Result<TargetPool, CoordinatorError> {
        Ok(tidemark_common::mysql::connector::target_pool(target::pool(config)?))
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
        _epoch: u64,
    ) -> Result<(Vec<String>, Vec<String>), CoordinatorError> {
        target::build_epoch(config, sql, not_null).await
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
            .map(|c| tidemark_common::mysql::target::add_column(table, c))
            .collect();
        let target = target::pool(config)?;
        for statement in &statements {
            // MySQL's DDL commits as it goes; each statement is idempotent.
            sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
                .execute(&target)
                .await
                .map_err(|e| CoordinatorError::task_setup(&config.name, format!("target table {table}: {e}")))?;
        }
        target.close().await;
        Ok(statements)
    }

    async fn dead_letter_counts(&self, target: &TargetPool, task: &str) -> Result<BTreeMap<String, u64>, sqlx::Error> {
        match mysql_target(target) {
            Some(pool) => target::dead_letter_counts(pool, task).await,
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
        _control: &ControlDb,
        target: &TargetPool,
        task: &PreparedTask,
        keys: &[String],
    ) -> Result<pb::RetryDeadLettersResponse, CoordinatorError> {
        dead_letters::retry(target_pool(target)?, task, keys).await
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
