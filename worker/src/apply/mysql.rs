//! The batch protocol's target transaction on MySQL and MariaDB: a batch's COPY text rows
//! rendered as literals of the mapped column types and written in large multi-row upserts
//! (`common::mysql::target`); the ledger, epoch fence and dead letters in the same InnoDB
//! transaction; savepoints for the bisection of bad rows, as on PostgreSQL.

use sqlx::Row;
use sqlx::mysql::{MySql, MySqlPool};
use tidemark_common::batch::Manifest;
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::copy_text;
use tidemark_common::dead_letters::DeadLetter;
use tidemark_common::mysql::target::{self as sql, AccumulateMySql};
use tidemark_common::pg::{Read, TableSql};
use tidemark_common::target::TargetPool;
use tidemark_common::transform::{AccumulateSpec, Deltas};
use tidemark_common::write::WriteError;

use super::{BatchToApply, TargetTx};
use crate::error::WorkerError;

/// Rows (or delta groups) per statement when a statement carries one per row.
const ROWS_PER_STATEMENT: usize = 2000;

pub(crate) struct MySqlTx(sqlx::Transaction<'static, MySql>);

impl MySqlTx {
    async fn run(&mut self, statement: String) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    /// The lateness (`high − cursor time`) of the overlap's rows the target lacks at their
    /// version, asked before the rows are written.
    async fn late_rows(
        &mut self,
        batch: &BatchToApply<'_>,
        rows: &[&[u8]],
        floor: i64,
        high: i64,
    ) -> Result<Vec<i64>, sqlx::Error> {
        let candidates = sql::overlap_rows(batch.sql, rows, floor);
        let mut late = Vec::new();
        for chunk in candidates.chunks(ROWS_PER_STATEMENT) {
            let query = sql::late_rows_query(batch.sql, chunk, high);
            let found: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(query))
                .fetch_all(&mut *self.0)
                .await?;
            late.extend(found);
        }
        Ok(late)
    }
}

impl TargetTx for MySqlTx {
    type Pool = MySqlPool;

    fn pool_of(target: &TargetPool) -> Option<&MySqlPool> {
        tidemark_common::mysql::connector::mysql_target(target)
    }

    async fn ledger_hash(target: &MySqlPool, batch_id: &str) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT content_hash FROM tidemark_ledger WHERE batch_id = ?")
            .bind(batch_id)
            .fetch_optional(target)
            .await
    }

    async fn begin_unless_applied(
        target: &MySqlPool,
        manifest: &Manifest,
    ) -> Result<Option<(MySqlTx, Option<u64>)>, WorkerError> {
        let mut tx = target.begin().await?;
        let row: Option<(i64, Option<i64>)> = sqlx::query_as(sql::TARGET_EPOCH)
            .bind(&manifest.task)
            .fetch_optional(&mut *tx)
            .await?;
        if let Some((_, Some(to))) = row {
            tx.rollback().await?;
            return Err(WorkerError::Switching(format!(
                "task {} is switching to epoch {to} in the target; batch {} waits for it",
                manifest.task, manifest.batch_id
            )));
        }
        let current = row.map(|(epoch, _)| epoch);
        if let Some(current) = current
            && current as u64 > manifest.epoch
        {
            tx.rollback().await?;
            return Err(super::stale_epoch(manifest, current));
        }
        let applied = sqlx::query(sql::LEDGER_HAS)
            .bind(&manifest.batch_id)
            .fetch_optional(&mut *tx)
            .await?
            .is_some();
        if applied {
            tx.rollback().await?;
            return Ok(None);
        }
        Ok(Some((MySqlTx(tx), current.map(|epoch| epoch as u64))))
    }

    async fn verify(target: &MySqlPool, manifest: &Manifest) -> Result<(), WorkerError> {
        let row = sqlx::query(sql::LEDGER_ROW)
            .bind(&manifest.batch_id)
            .fetch_optional(target)
            .await?;
        super::check_ledger_row(manifest, row.map(|row| (row.get(0), row.get(1))))
    }

    async fn savepoint(&mut self) -> Result<(), sqlx::Error> {
        self.run("SAVEPOINT tidemark_isolate".into()).await
    }

    async fn end_savepoint(&mut self, keep: bool) -> Result<(), sqlx::Error> {
        if !keep {
            self.run("ROLLBACK TO SAVEPOINT tidemark_isolate".into()).await?;
        }
        self.run("RELEASE SAVEPOINT tidemark_isolate".into()).await
    }

    async fn upsert(
        &mut self,
        batch: &BatchToApply<'_>,
        data: &[u8],
        overlap: Option<(i64, i64)>,
    ) -> Result<(u64, Vec<i64>), WriteError> {
        if batch.format != CopyFormat::Text {
            return Err(WriteError::Database(sqlx::Error::Protocol(format!(
                "batch {}: a MySQL target takes COPY text batches only",
                batch.manifest.batch_id
            ))));
        }
        let rows: Vec<&[u8]> = copy_text::rows(data).collect();
        let late = match overlap {
            Some((floor, high)) => self.late_rows(batch, &rows, floor, high).await?,
            None => Vec::new(),
        };
        let mut statements = Vec::new();
        if batch.manifest.repair {
            statements = sql::repair_statements(batch.sql, &rows).map_err(|(_, error)| WriteError::Row(error))?;
        }
        statements.extend(
            sql::upsert_statements(batch.sql, batch.manifest.target_layout, &rows, Read::Latest)
                .map_err(|(_, error)| WriteError::Row(error))?,
        );
        for statement in statements {
            self.run(statement).await?;
        }
        Ok((rows.len() as u64, late))
    }

    async fn clear_stage(&mut self, _sql: &TableSql) -> Result<(), sqlx::Error> {
        Ok(())
    }

    async fn accumulate(&mut self, sql: &TableSql, spec: &AccumulateSpec, deltas: &Deltas) -> Result<(), WriteError> {
        let summary = AccumulateMySql { table: sql, spec };
        let entries = deltas.entries();
        for chunk in entries.chunks(ROWS_PER_STATEMENT) {
            let statement = summary.accumulate(chunk).map_err(WriteError::Row)?;
            self.run(statement).await?;
        }
        Ok(())
    }

    async fn write_fresh(&mut self, _batch: &BatchToApply<'_>) -> Result<bool, WorkerError> {
        // The upsert is already one multi-row statement per few MiB: nothing faster to try.
        Ok(false)
    }

    async fn check_types(&mut self, _batch: &BatchToApply<'_>) -> Result<(), WorkerError> {
        Ok(())
    }

    async fn insert_dead_letters(
        &mut self,
        batch: &BatchToApply<'_>,
        letters: &[DeadLetter],
    ) -> Result<(), sqlx::Error> {
        let manifest = batch.manifest;
        let layout = batch.layout().name();
        let entries = tidemark_common::dead_letters::latest_per_key(letters);
        for chunk in entries.chunks(500) {
            let mut query = sqlx::QueryBuilder::<MySql>::new(
                "INSERT INTO tidemark_dead_letters (task, `key`, shard_id, batch_id, payload, payload_layout, \
                 error_class, message) ",
            );
            query.push_values(chunk, |mut row, (key, letter)| {
                row.push_bind(&manifest.task)
                    .push_bind(*key)
                    .push_bind(manifest.shard_id as i32)
                    .push_bind(&manifest.batch_id)
                    .push_bind(letter.payload.as_slice())
                    .push_bind(&layout)
                    .push_bind(&letter.error.class)
                    .push_bind(&letter.error.message);
            });
            query.push(
                " ON DUPLICATE KEY UPDATE shard_id = VALUES(shard_id), batch_id = VALUES(batch_id), \
                 payload = VALUES(payload), payload_layout = VALUES(payload_layout), error_class = VALUES(error_class), \
                 message = VALUES(message), status = 'INIT', retry_count = 0, claimed_by = NULL, claimed_at = NULL, \
                 updated_at = CURRENT_TIMESTAMP(6)",
            );
            query.build().execute(&mut *self.0).await?;
        }
        Ok(())
    }

    async fn insert_ledger(&mut self, manifest: &Manifest, dead_letters: u64) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(sql::LEDGER_INSERT)
            .bind(&manifest.batch_id)
            .bind(&manifest.task)
            .bind(manifest.epoch as i64)
            .bind(manifest.shard_id as i32)
            .bind(manifest.row_count as i64)
            .bind(&manifest.content_hash)
            .bind(manifest.fence_token as i64)
            .bind(dead_letters as i64)
            .execute(&mut *self.0)
            .await?
            .rows_affected())
    }

    async fn commit(self) -> Result<(), sqlx::Error> {
        self.0.commit().await
    }

    async fn rollback(self) -> Result<(), sqlx::Error> {
        self.0.rollback().await
    }
}
