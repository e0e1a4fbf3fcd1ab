//! The batch protocol's target transaction on PostgreSQL: rows by COPY into a session-local
//! stage table and the versioned upsert from it (`common::write`), or straight into a fresh
//! table by COPY; the ledger, epoch fence and dead letters in the same transaction.

use sqlx::Row;
use sqlx::postgres::{PgPool, Postgres};
use tidemark_common::batch::Manifest;
use tidemark_common::dead_letters::{self, DeadLetter};
use tidemark_common::pg::accumulate::AccumulateSql;
use tidemark_common::pg::write;
use tidemark_common::pg::{self, Read, TableSql};
use tidemark_common::target::TargetPool;
use tidemark_common::transform::{AccumulateSpec, Deltas};
use tidemark_common::write::WriteError;

use super::{BatchToApply, TargetTx, check_count};
use crate::error::WorkerError;

pub(crate) struct PgTx(sqlx::Transaction<'static, Postgres>);

impl TargetTx for PgTx {
    type Pool = PgPool;

    fn pool_of(target: &TargetPool) -> Option<&PgPool> {
        tidemark_common::pg::connector::pg_target(target)
    }

    async fn ledger_hash(target: &PgPool, batch_id: &str) -> Result<Option<String>, sqlx::Error> {
        sqlx::query_scalar("SELECT content_hash FROM tidemark_ledger WHERE batch_id = $1")
            .bind(batch_id)
            .fetch_optional(target)
            .await
    }

    async fn begin_unless_applied(
        target: &PgPool,
        manifest: &Manifest,
    ) -> Result<Option<(PgTx, Option<u64>)>, WorkerError> {
        let mut tx = target.begin().await?;
        let current: Option<i64> = sqlx::query_scalar(tidemark_common::pg::TARGET_EPOCH)
            .bind(&manifest.task)
            .fetch_one(&mut *tx)
            .await?;
        if let Some(current) = current
            && current as u64 > manifest.epoch
        {
            tx.rollback().await?;
            return Err(super::stale_epoch(manifest, current));
        }
        let applied = sqlx::query("SELECT 1 FROM tidemark_ledger WHERE batch_id = $1")
            .bind(&manifest.batch_id)
            .fetch_optional(&mut *tx)
            .await?
            .is_some();
        if applied {
            tx.rollback().await?;
            return Ok(None);
        }
        Ok(Some((PgTx(tx), current.map(|epoch| epoch as u64))))
    }

    async fn verify(target: &PgPool, manifest: &Manifest) -> Result<(), WorkerError> {
        let row = sqlx::query("SELECT row_count, content_hash FROM tidemark_ledger WHERE batch_id = $1")
            .bind(&manifest.batch_id)
            .fetch_optional(target)
            .await?;
        super::check_ledger_row(manifest, row.map(|row| (row.get(0), row.get(1))))
    }

    async fn savepoint(&mut self) -> Result<(), sqlx::Error> {
        sqlx::query("SAVEPOINT tidemark_isolate").execute(&mut *self.0).await?;
        Ok(())
    }

    async fn end_savepoint(&mut self, keep: bool) -> Result<(), sqlx::Error> {
        if !keep {
            sqlx::query("ROLLBACK TO SAVEPOINT tidemark_isolate")
                .execute(&mut *self.0)
                .await?;
        }
        sqlx::query("RELEASE SAVEPOINT tidemark_isolate")
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    async fn upsert(
        &mut self,
        batch: &BatchToApply<'_>,
        data: &[u8],
        overlap: Option<(i64, i64)>,
    ) -> Result<(u64, Vec<i64>), WriteError> {
        Ok(write::upsert_rows(&mut self.0, batch.sql, batch.layout(), data, overlap, Read::Latest).await?)
    }

    async fn clear_stage(&mut self, sql: &TableSql) -> Result<(), sqlx::Error> {
        write::clear_stage(&mut self.0, sql).await
    }

    async fn accumulate(&mut self, sql: &TableSql, spec: &AccumulateSpec, deltas: &Deltas) -> Result<(), WriteError> {
        let summary = AccumulateSql { table: sql, spec };
        Ok(write::accumulate(&mut self.0, &summary, deltas).await?)
    }

    /// The snapshot's fast path: the rows go straight into the target table by COPY. It works
    /// when the target holds none of their keys (a fresh table); a key it already holds fails
    /// the primary key (and a bad row fails its column), and the savepoint falls back to the
    /// versioned upsert through the stage table.
    async fn write_fresh(&mut self, batch: &BatchToApply<'_>) -> Result<bool, WorkerError> {
        let tx = &mut self.0;
        sqlx::query("SAVEPOINT tidemark_direct").execute(&mut **tx).await?;
        let attempt = async {
            let mut copy = tx.copy_in_raw(&batch.sql.copy_into_target(batch.format)).await?;
            copy.send(batch.data.as_ref()).await?;
            copy.finish().await
        }
        .await;
        match attempt {
            Ok(copied) => {
                check_count(batch.manifest, copied)?;
                Ok(true)
            }
            Err(error) if dead_letters::row_error_class(&error).is_some() => {
                sqlx::query("ROLLBACK TO SAVEPOINT tidemark_direct")
                    .execute(&mut **tx)
                    .await?;
                Ok(false)
            }
            Err(error) => Err(error.into()),
        }
    }

    async fn check_types(&mut self, batch: &BatchToApply<'_>) -> Result<(), WorkerError> {
        let types = pg::column_types(&mut *self.0, &batch.sql.target).await?;
        crate::page_format::check_target(&types, batch.sql)
    }

    async fn insert_dead_letters(
        &mut self,
        batch: &BatchToApply<'_>,
        letters: &[DeadLetter],
    ) -> Result<(), sqlx::Error> {
        let letters = dead_letters::latest_per_key(letters);
        let keys: Vec<&str> = letters.iter().map(|(key, _)| *key).collect();
        let payloads: Vec<&[u8]> = letters.iter().map(|(_, l)| l.payload.as_slice()).collect();
        let classes: Vec<&str> = letters.iter().map(|(_, l)| l.error.class.as_str()).collect();
        let messages: Vec<&str> = letters.iter().map(|(_, l)| l.error.message.as_str()).collect();
        let manifest = batch.manifest;
        sqlx::query(
            "INSERT INTO tidemark_dead_letters AS d (task, key, shard_id, batch_id, payload, payload_layout, error_class, \
             message) SELECT $1, k, $2, $3, p, $4, c, m FROM unnest($5::text[], $6::bytea[], $7::text[], $8::text[]) \
             AS u(k, p, c, m) ON CONFLICT (task, key) DO UPDATE SET shard_id = EXCLUDED.shard_id, \
             batch_id = EXCLUDED.batch_id, payload = EXCLUDED.payload, payload_layout = EXCLUDED.payload_layout, \
             error_class = EXCLUDED.error_class, message = EXCLUDED.message, status = 'INIT', retry_count = 0, \
             claimed_by = NULL, claimed_at = NULL, updated_at = now()",
        )
        .bind(&manifest.task)
        .bind(manifest.shard_id as i32)
        .bind(&manifest.batch_id)
        .bind(batch.layout().name())
        .bind(&keys)
        .bind(&payloads)
        .bind(&classes)
        .bind(&messages)
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    async fn insert_ledger(&mut self, manifest: &Manifest, dead_letters: u64) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(
            "INSERT INTO tidemark_ledger (batch_id, task, epoch, shard_id, row_count, content_hash, fence, dead_letters) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (batch_id) DO NOTHING",
        )
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
