//! Epochs, checkpoints, claims and the commit CAS on the embedded store. The checks are the
//! PostgreSQL store's own (`crate::checkpoints::{checked_lock, judge, admit_registration}`);
//! only the statements differ. Groups are done shard by shard inside one write transaction.

use std::collections::HashSet;

use sqlx::{Row, SqliteConnection};
use tidemark_common::cursor::Cursor;

use crate::batches::Staged;
use crate::checkpoints::{
    CheckpointRow, Claim, Claimed, CommitBatch, Committed, EpochPlan, EpochRecord, Judged, Lateness, LockedCheckpoint,
    PendingBatchRecord, RegisterBatch, ShardKey, ShardRecord, ShardStatusRow, TaskState, TaskStatusRow,
    admit_registration, checked_lock, judge, judge_existing,
};
use crate::error::CoordinatorError;

use super::{
    EPOCH_COLUMNS, SqliteControl, batches, cursor_text, decode_cursor, epoch_from, json_text, now_micros, parse_json,
    runs,
};

/// The shard's checkpoint row with what the owner checks need (`checked_lock`).
pub(super) async fn checkpoint_row(
    conn: &mut SqliteConnection,
    shard: &ShardKey,
) -> Result<Option<CheckpointRow>, CoordinatorError> {
    let row = sqlx::query(
        "SELECT c.cursor, c.version, c.fence, c.last_batch_id, t.paused_reason, t.current_epoch, c.retired, \
         c.release_requested, EXISTS (SELECT 1 FROM running_epochs r WHERE r.task = c.task AND r.epoch = c.epoch) \
         FROM checkpoints c JOIN tasks t ON t.name = c.task WHERE c.task = $1 AND c.epoch = $2 AND c.shard_id = $3",
    )
    .bind(&shard.task)
    .bind(shard.epoch as i64)
    .bind(shard.shard_id as i64)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|row| {
        Ok(CheckpointRow {
            cursor: decode_cursor(&row.get::<String, _>(0))?,
            version: row.get::<i64, _>(1) as u64,
            fence: row.get::<i64, _>(2) as u64,
            last_batch_id: row.get(3),
            paused_reason: row.get(4),
            current_epoch: row.get::<i64, _>(5) as u64,
            retired: row.get(6),
            release_requested: row.get(7),
            running: row.get(8),
        })
    })
    .transpose()
}

/// The shard's checkpoint, checked for a change by the owner holding `fence` (the caller's
/// write transaction keeps it as read).
pub(super) async fn lock_checkpoint(
    conn: &mut SqliteConnection,
    shard: &ShardKey,
    fence: u64,
) -> Result<LockedCheckpoint, CoordinatorError> {
    checked_lock(checkpoint_row(conn, shard).await?, shard, fence)
}

impl SqliteControl {
    pub async fn epoch_where(&self, task: &str, condition: &str) -> Result<Option<EpochRecord>, CoordinatorError> {
        let query = format!(
            "SELECT {EPOCH_COLUMNS} FROM tasks t JOIN epochs e ON e.task = t.name AND {condition} WHERE t.name = $1"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(task)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|row| epoch_from(&row, 0)).transpose()
    }

    pub async fn estimated_rows(&self, task: &str, epoch: u64) -> Result<Option<u64>, CoordinatorError> {
        Ok(
            sqlx::query_scalar::<_, Option<i64>>("SELECT estimated_rows FROM epochs WHERE task = $1 AND epoch = $2")
                .bind(task)
                .bind(epoch as i64)
                .fetch_optional(&self.pool)
                .await?
                .flatten()
                .map(|n| n.max(0) as u64),
        )
    }

    pub async fn create_epoch(&self, plan: &EpochPlan) -> Result<bool, CoordinatorError> {
        let mut tx = self.write().await?;
        let inserted = sqlx::query(
            "INSERT INTO tasks (name, current_epoch, created_at) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING",
        )
        .bind(&plan.task)
        .bind(plan.epoch as i64)
        .bind(now_micros())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if inserted == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        insert_epoch(&mut tx, plan).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub async fn switch_epoch(&self, plan: &EpochPlan) -> Result<bool, CoordinatorError> {
        let mut tx = self.write().await?;
        let current: i64 = sqlx::query_scalar("SELECT current_epoch FROM tasks WHERE name = $1")
            .bind(&plan.task)
            .fetch_one(&mut *tx)
            .await?;
        if current as u64 >= plan.epoch {
            tx.rollback().await?;
            return Ok(false);
        }
        insert_epoch(&mut tx, plan).await?;
        batches::abandon(
            &mut tx,
            Staged::EpochsBefore {
                task: &plan.task,
                epoch: plan.epoch,
            },
        )
        .await?;
        sqlx::query(
            "UPDATE tasks SET current_epoch = $2, paused_reason = NULL, max_source_clock_micros = NULL WHERE name = $1",
        )
        .bind(&plan.task)
        .bind(plan.epoch as i64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// See `ControlDb::epoch_watermark`.
    pub async fn epoch_watermark(&self, task: &str, epoch: u64) -> Result<Option<i64>, CoordinatorError> {
        let (shards, incremental, floor): (i64, i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE cursor ->> '$.kind' = 'incremental'), \
             min(cursor ->> '$.floor_micros') FILTER (WHERE cursor ->> '$.kind' = 'incremental') \
             FROM checkpoints WHERE task = $1 AND epoch = $2 AND NOT retired",
        )
        .bind(task)
        .bind(epoch as i64)
        .fetch_one(&self.pool)
        .await?;
        Ok(floor.filter(|_| shards > 0 && incremental == shards))
    }

    /// The committed cursors of the epoch's live (not retired) shards.
    pub async fn epoch_cursors(&self, task: &str, epoch: u64) -> Result<Vec<Cursor>, CoordinatorError> {
        let rows: Vec<String> =
            sqlx::query_scalar("SELECT cursor FROM checkpoints WHERE task = $1 AND epoch = $2 AND NOT retired")
                .bind(task)
                .bind(epoch as i64)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(|text| decode_cursor(text)).collect()
    }

    pub async fn evolve_epoch(
        &self,
        task: &str,
        epoch: u64,
        old_schema_id: &str,
        schema_id: &str,
        columns: &serde_json::Value,
        reread_from_micros: i64,
    ) -> Result<bool, CoordinatorError> {
        let mut tx = self.write().await?;
        let changed = sqlx::query(
            "UPDATE epochs SET schema_id = $4, columns = $5 WHERE task = $1 AND epoch = $2 AND schema_id = $3",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(old_schema_id)
        .bind(schema_id)
        .bind(json_text(columns))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        let shards: Vec<(i64, String)> =
            sqlx::query_as("SELECT shard_id, cursor FROM checkpoints WHERE task = $1 AND epoch = $2 ORDER BY shard_id")
                .bind(task)
                .bind(epoch as i64)
                .fetch_all(&mut *tx)
                .await?;
        for (shard_id, cursor) in shards {
            let cursor = decode_cursor(&cursor)?;
            let reread = cursor
                .incremental_time()
                .is_some_and(|floor| floor > reread_from_micros)
                .then(|| Cursor::incremental_at(epoch, reread_from_micros));
            sqlx::query(
                "UPDATE checkpoints SET cursor = COALESCE($4, cursor), version = version + 1, updated_at = $5 \
                 WHERE task = $1 AND epoch = $2 AND shard_id = $3",
            )
            .bind(task)
            .bind(epoch as i64)
            .bind(shard_id)
            .bind(reread.as_ref().map(cursor_text))
            .bind(now_micros())
            .execute(&mut *tx)
            .await?;
        }
        batches::abandon(&mut tx, Staged::Epoch { task, epoch }).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub async fn pause_epoch(&self, task: &str, epoch: u64, reason: &str) -> Result<bool, CoordinatorError> {
        let updated = sqlx::query(
            "UPDATE tasks SET paused_reason = $3 WHERE name = $1 AND paused_reason IS NULL \
             AND coalesce(building_epoch, current_epoch) = $2",
        )
        .bind(task)
        .bind(epoch as i64)
        .bind(reason)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(updated == 1)
    }

    pub async fn pause_task(&self, task: &str, reason: &str) -> Result<bool, CoordinatorError> {
        let updated = sqlx::query("UPDATE tasks SET paused_reason = $2 WHERE name = $1 AND paused_reason IS NULL")
            .bind(task)
            .bind(reason)
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(updated == 1)
    }

    pub async fn resume_task(&self, task: &str) -> Result<bool, CoordinatorError> {
        let mut tx = self.write().await?;
        let updated = sqlx::query(
            "UPDATE tasks SET paused_reason = NULL, max_source_clock_micros = NULL, resumed_at = $2 WHERE name = $1",
        )
        .bind(task)
        .bind(now_micros())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query("UPDATE checkpoints SET failures = 0, last_failure = NULL WHERE task = $1 AND failures > 0")
            .bind(task)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(updated == 1)
    }

    pub async fn set_source_hold(&self, task: &str, hold: Option<&str>) -> Result<(), CoordinatorError> {
        sqlx::query("UPDATE tasks SET source_hold = $2 WHERE name = $1 AND source_hold IS NOT $2")
            .bind(task)
            .bind(hold)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn paused_reason(&self, task: &str) -> Result<Option<String>, CoordinatorError> {
        Ok(
            sqlx::query_scalar::<_, Option<String>>("SELECT paused_reason FROM tasks WHERE name = $1")
                .bind(task)
                .fetch_optional(&self.pool)
                .await?
                .flatten(),
        )
    }

    pub async fn record_source_clock(&self, task: &str, now: i64) -> Result<Option<i64>, CoordinatorError> {
        let mut tx = self.write().await?;
        let previous: Option<Option<i64>> =
            sqlx::query_scalar("SELECT max_source_clock_micros FROM tasks WHERE name = $1")
                .bind(task)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(previous) = previous else {
            tx.rollback().await?;
            return Ok(None);
        };
        sqlx::query("UPDATE tasks SET max_source_clock_micros = $2 WHERE name = $1")
            .bind(task)
            .bind(previous.map_or(now, |p| p.max(now)))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(previous)
    }

    pub async fn lateness(&self, task: &str, epoch: u64) -> Result<Lateness, CoordinatorError> {
        let (count, max): (i64, i64) = sqlx::query_as(
            "SELECT count(*), coalesce(max(lateness_micros), 0) FROM late_rows WHERE task = $1 AND epoch = $2",
        )
        .bind(task)
        .bind(epoch as i64)
        .fetch_one(&self.pool)
        .await?;
        // percentile_disc(0.99): the first value whose cumulative share reaches 0.99.
        let p99 = if count == 0 {
            0
        } else {
            let rank = ((count as f64) * 0.99).ceil() as i64 - 1;
            sqlx::query_scalar(
                "SELECT lateness_micros FROM late_rows WHERE task = $1 AND epoch = $2 \
                 ORDER BY lateness_micros LIMIT 1 OFFSET $3",
            )
            .bind(task)
            .bind(epoch as i64)
            .bind(rank.max(0))
            .fetch_one(&self.pool)
            .await?
        };
        Ok(Lateness {
            count: count as u64,
            p99_micros: p99,
            max_micros: max,
        })
    }

    pub async fn candidates(
        &self,
        tasks: &[String],
        among: Option<&[ShardKey]>,
    ) -> Result<Vec<crate::checkpoints::Candidate>, CoordinatorError> {
        let among_join = if among.is_some() {
            "JOIN json_each($3) f ON c.task = f.value ->> 0 AND c.epoch = f.value ->> 1 \
             AND c.shard_id = f.value ->> 2 "
        } else {
            ""
        };
        let sql = format!(
            "SELECT c.task, c.epoch, c.shard_id, CASE WHEN c.reserved_until >= $2 THEN c.reserved_for END \
             FROM checkpoints c {among_join}\
             JOIN running_epochs r ON r.task = c.task AND r.epoch = c.epoch JOIN tasks t ON t.name = c.task \
             WHERE t.paused_reason IS NULL AND c.task IN (SELECT value FROM json_each($1)) AND NOT c.retired \
             AND c.pending_op IS NULL ORDER BY c.updated_at, c.task, c.shard_id"
        );
        // `among_join` is one of two constants.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(serde_json::json!(tasks).to_string())
            .bind(now_micros());
        if let Some(shards) = among {
            let triples: Vec<serde_json::Value> = shards
                .iter()
                .map(|s| serde_json::json!([s.task, s.epoch, s.shard_id]))
                .collect();
            query = query.bind(serde_json::Value::Array(triples).to_string());
        }
        let rows = query.fetch_all(&self.pool).await?;
        Ok(rows
            .into_iter()
            .map(|row| crate::checkpoints::Candidate {
                shard: super::shard_of(&row, 0),
                reserved_for: row.get(3),
            })
            .collect())
    }

    pub async fn claim_shards(&self, group: &[Claim]) -> Result<Vec<Option<Claimed>>, CoordinatorError> {
        let mut tx = self.write().await?;
        let now = now_micros();
        let mut answers = Vec::with_capacity(group.len());
        for claim in group {
            let shard = &claim.shard;
            let row = sqlx::query(
                "UPDATE checkpoints SET fence = $4, owner = $5, updated_at = $6, acquired_at = $6, \
                 release_requested = (pending_op IS NOT NULL), reserved_for = NULL, reserved_until = NULL \
                 WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence < $4 AND NOT retired \
                 RETURNING range, cursor, version, fence",
            )
            .bind(&shard.task)
            .bind(shard.epoch as i64)
            .bind(shard.shard_id as i64)
            .bind(claim.fence as i64)
            .bind(&claim.owner)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(row) = row else {
                answers.push(None);
                continue;
            };
            let cursor_stored: String = row.get(1);
            let pending = sqlx::query(
                "SELECT batch_id, manifest_path, lower, upper, row_count, content_hash FROM batches \
                 WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND state = 'STAGED' AND lower = $4 \
                 ORDER BY staged_at LIMIT 1",
            )
            .bind(&shard.task)
            .bind(shard.epoch as i64)
            .bind(shard.shard_id as i64)
            .bind(&cursor_stored)
            .fetch_optional(&mut *tx)
            .await?
            .map(|p| -> Result<_, CoordinatorError> {
                Ok(PendingBatchRecord {
                    batch_id: p.get(0),
                    manifest_path: p.get(1),
                    lower: decode_cursor(&p.get::<String, _>(2))?,
                    upper: decode_cursor(&p.get::<String, _>(3))?,
                    row_count: p.get::<i64, _>(4) as u64,
                    content_hash: p.get(5),
                })
            })
            .transpose()?;
            let epoch = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT {EPOCH_COLUMNS} FROM epochs e WHERE e.task = $1 AND e.epoch = $2 \
                 AND EXISTS (SELECT 1 FROM running_epochs r WHERE r.task = e.task AND r.epoch = e.epoch)"
            )))
            .bind(&shard.task)
            .bind(shard.epoch as i64)
            .fetch_optional(&mut *tx)
            .await?
            .map(|e| epoch_from(&e, 0))
            .transpose()?;
            answers.push(Some(Claimed {
                record: ShardRecord {
                    key: shard.clone(),
                    range: json_text(&parse_json(&row.get::<String, _>(0), "range")?),
                    cursor: decode_cursor(&cursor_stored)?,
                    version: row.get::<i64, _>(2) as u64,
                    fence: row.get::<i64, _>(3) as u64,
                },
                pending,
                epoch,
            }));
        }
        tx.commit().await?;
        Ok(answers)
    }

    pub async fn register_batches(
        &self,
        group: &[RegisterBatch],
    ) -> Result<Vec<Result<(), CoordinatorError>>, CoordinatorError> {
        let mut tx = self.write().await?;
        let mut answers = Vec::with_capacity(group.len());
        for batch in group {
            let row = checkpoint_row(&mut tx, &batch.shard).await?;
            if let Err(refused) = admit_registration(batch, row) {
                answers.push(Err(refused));
                continue;
            }
            let inserted = batches::register(
                &mut tx,
                &batch.shard,
                &batch.batch_id,
                &cursor_text(&batch.lower),
                &cursor_text(&batch.upper),
                batch.row_count as i64,
                batch.byte_size as i64,
                &batch.content_hash,
                &batch.manifest_path,
                batch.fence,
            )
            .await?;
            if inserted {
                answers.push(Ok(()));
                continue;
            }
            let existing = batches::existing(&mut tx, &batch.batch_id).await?;
            answers.push(match existing {
                Some(existing) => judge_existing(batch, existing),
                None => Err(CoordinatorError::Batch {
                    batch_id: batch.batch_id.clone(),
                    message: "could not be registered: its checkpoint allows it, yet it was neither inserted nor found"
                        .into(),
                }),
            });
        }
        tx.commit().await?;
        Ok(answers)
    }

    pub async fn commit_batches(
        &self,
        group: &[CommitBatch],
    ) -> Result<Vec<Result<Committed, CoordinatorError>>, CoordinatorError> {
        debug_assert!(
            group.iter().map(|c| &c.shard).collect::<HashSet<_>>().len() == group.len(),
            "a commit group holds distinct shards"
        );
        let mut tx = self.write().await?;
        let now = now_micros();
        let mut outcomes: Vec<Result<Judged, CoordinatorError>> = Vec::with_capacity(group.len());
        for commit in group {
            let row = checkpoint_row(&mut tx, &commit.shard).await?;
            outcomes.push(checked_lock(row, &commit.shard, commit.fence).and_then(|locked| judge(commit, locked)));
        }
        let mut moved = Vec::new();
        for (commit, outcome) in group.iter().zip(outcomes.iter_mut()) {
            let Ok(Judged::Proceed { version, .. }) = outcome else {
                continue;
            };
            let version = *version + 1;
            let upper = cursor_text(&commit.upper);
            if !commit.empty
                && !batches::commit(&mut tx, &commit.shard, &commit.batch_id, &upper, commit.replayed).await?
            {
                *outcome = Err(CoordinatorError::Batch {
                    batch_id: commit.batch_id.clone(),
                    message: "is not a staged batch with these bounds".into(),
                });
                continue;
            }
            move_checkpoint(&mut tx, commit, &upper, version, now).await?;
            moved.push(commit.shard.clone());
        }
        // What each moved shard's owner would ask next (`NextShardWork`), answered here.
        let works = runs::shard_works_on(&mut tx, &moved).await?;
        tx.commit().await?;
        let mut works = works.into_iter();
        Ok(outcomes
            .into_iter()
            .map(|judged| {
                Ok(match judged? {
                    Judged::Repeated(committed) => committed,
                    Judged::Proceed {
                        version,
                        release_requested,
                    } => Committed {
                        new_version: version + 1,
                        release_requested,
                        repeated: false,
                        work: works.next(),
                    },
                })
            })
            .collect())
    }

    pub async fn abandon_batch(&self, shard: &ShardKey, fence: u64, batch_id: &str) -> Result<u64, CoordinatorError> {
        let mut tx = self.write().await?;
        lock_checkpoint(&mut tx, shard, fence).await?;
        batches::abandon(&mut tx, Staged::Batch { batch_id, shard }).await?;
        let version: i64 = sqlx::query_scalar(
            "UPDATE checkpoints SET version = version + 1, updated_at = $4 \
             WHERE task = $1 AND epoch = $2 AND shard_id = $3 RETURNING version",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .bind(now_micros())
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(version as u64)
    }

    pub async fn record_failure(
        &self,
        shard: &ShardKey,
        fence: u64,
        owner: &str,
        failure: &str,
    ) -> Result<u32, CoordinatorError> {
        let count: Option<i64> = sqlx::query_scalar(
            "UPDATE checkpoints SET failures = CASE WHEN last_failure = $6 THEN failures + 1 ELSE 1 END, \
             last_failure = $6 WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence = $4 AND owner = $5 \
             RETURNING failures",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .bind(fence as i64)
        .bind(owner)
        .bind(failure)
        .fetch_optional(&self.pool)
        .await?;
        Ok(count.unwrap_or(0).max(0) as u32)
    }

    pub async fn pause_for_owner(
        &self,
        shard: &ShardKey,
        fence: u64,
        owner: &str,
        reason: &str,
    ) -> Result<bool, CoordinatorError> {
        let paused = sqlx::query(
            "UPDATE tasks SET paused_reason = $6 WHERE name = $1 AND paused_reason IS NULL AND EXISTS ( \
               SELECT 1 FROM checkpoints c WHERE c.task = $1 AND c.epoch = $2 AND c.shard_id = $3 AND c.fence = $4 \
               AND c.owner = $5 AND (tasks.resumed_at IS NULL OR c.acquired_at >= tasks.resumed_at))",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .bind(fence as i64)
        .bind(owner)
        .bind(reason)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(paused == 1)
    }

    pub async fn epoch_columns(&self, task: &str, epoch: i64) -> Result<Option<serde_json::Value>, CoordinatorError> {
        let columns: Option<String> = sqlx::query_scalar("SELECT columns FROM epochs WHERE task = $1 AND epoch = $2")
            .bind(task)
            .bind(epoch)
            .fetch_optional(&self.pool)
            .await?;
        columns.map(|text| parse_json(&text, "columns")).transpose()
    }

    pub async fn release(&self, shard: &ShardKey, fence: u64, owner: &str) -> Result<(), CoordinatorError> {
        sqlx::query(
            "UPDATE checkpoints SET owner = NULL WHERE task = $1 AND epoch = $2 AND shard_id = $3 AND fence = $4 \
             AND owner = $5",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .bind(fence as i64)
        .bind(owner)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn task_states(&self) -> Result<Vec<TaskState>, CoordinatorError> {
        let rows = sqlx::query("SELECT name, current_epoch, paused_reason FROM tasks ORDER BY name")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(|row| TaskState {
                name: row.get(0),
                epoch: row.get::<i64, _>(1) as u64,
                paused_reason: row.get(2),
            })
            .collect())
    }

    pub async fn status(&self) -> Result<Vec<TaskStatusRow>, CoordinatorError> {
        let rows = sqlx::query(
            "SELECT t.name, t.current_epoch, t.paused_reason, c.shard_id, c.range, c.phase, c.cursor, c.rows_applied, \
             t.source_hold FROM tasks t JOIN checkpoints c ON c.task = t.name AND c.epoch = t.current_epoch \
             WHERE NOT c.retired ORDER BY t.name, c.shard_id",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut tasks: Vec<TaskStatusRow> = Vec::new();
        for row in rows {
            let name: String = row.get(0);
            if tasks.last().is_none_or(|t| t.name != name) {
                tasks.push(TaskStatusRow {
                    name: name.clone(),
                    epoch: row.get::<i64, _>(1) as u64,
                    paused_reason: row.get(2),
                    source_hold: row.get(8),
                    shards: Vec::new(),
                });
            }
            let task = tasks.last_mut().expect("pushed above");
            task.shards.push(ShardStatusRow {
                shard_id: row.get::<i64, _>(3) as u32,
                range: json_text(&parse_json(&row.get::<String, _>(4), "range")?),
                phase: row.get(5),
                cursor: decode_cursor(&row.get::<String, _>(6))?,
                rows_applied: row.get::<i64, _>(7) as u64,
            });
        }
        Ok(tasks)
    }
}

/// The epoch's row and its shards, each starting its snapshot.
pub(super) async fn insert_epoch(conn: &mut SqliteConnection, plan: &EpochPlan) -> Result<(), CoordinatorError> {
    let now = now_micros();
    sqlx::query(
        "INSERT INTO epochs (task, epoch, schema_id, columns, h0_time_micros, h0_max_key, incremental_start, \
         estimated_rows, cursor_zone, source_table_id, started_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    )
    .bind(&plan.task)
    .bind(plan.epoch as i64)
    .bind(&plan.schema_id)
    .bind(json_text(&plan.columns))
    .bind(plan.h0_time_micros)
    .bind(plan.h0_max_key.as_ref().map(json_text))
    .bind(cursor_text(&plan.incremental_start))
    .bind(plan.estimated_rows)
    .bind(&plan.cursor_zone)
    .bind(&plan.source_table_id)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    let start = cursor_text(&Cursor::snapshot_start(plan.epoch));
    for (shard_id, range) in plan.ranges.iter().enumerate() {
        insert_shard(
            conn,
            &plan.task,
            plan.epoch,
            shard_id as i64,
            range,
            "SNAPSHOT",
            &start,
            now,
        )
        .await?;
    }
    Ok(())
}

/// A new shard row; `range` is the encoded range (JSON).
#[allow(clippy::too_many_arguments)]
pub(super) async fn insert_shard(
    conn: &mut SqliteConnection,
    task: &str,
    epoch: u64,
    shard_id: i64,
    range: &str,
    phase: &str,
    cursor: &str,
    now: i64,
) -> Result<(), CoordinatorError> {
    sqlx::query(
        "INSERT INTO checkpoints (task, epoch, shard_id, range, phase, cursor, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(task)
    .bind(epoch as i64)
    .bind(shard_id)
    .bind(json_text(&parse_json(range, "range")?))
    .bind(phase)
    .bind(cursor)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Moves one checkpoint past its commit, records its history row (when it had rows) and its
/// late rows.
async fn move_checkpoint(
    conn: &mut SqliteConnection,
    commit: &CommitBatch,
    upper: &str,
    version: u64,
    now: i64,
) -> Result<(), CoordinatorError> {
    let shard = &commit.shard;
    let phase = if commit.upper.is_incremental() {
        "INCREMENTAL"
    } else {
        "SNAPSHOT"
    };
    let moved = sqlx::query(
        "UPDATE checkpoints SET cursor = $4, version = $5, phase = $6, \
         last_batch_id = CASE WHEN $7 THEN last_batch_id ELSE $8 END, rows_applied = rows_applied + $9, \
         updated_at = $10, failures = 0, last_failure = NULL WHERE task = $1 AND epoch = $2 AND shard_id = $3",
    )
    .bind(&shard.task)
    .bind(shard.epoch as i64)
    .bind(shard.shard_id as i64)
    .bind(upper)
    .bind(version as i64)
    .bind(phase)
    .bind(commit.empty)
    .bind(&commit.batch_id)
    .bind(commit.row_count as i64)
    .bind(now)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if moved != 1 {
        // The transaction holds the write lock: this cannot happen short of a bug.
        return Err(CoordinatorError::InvalidRequest(format!(
            "checkpoint of shard {} of {} did not move",
            shard.shard_id, shard.task
        )));
    }
    if !commit.empty {
        sqlx::query(
            "INSERT INTO checkpoint_history (task, epoch, shard_id, version, fence, cursor, batch_id, row_count, \
             committed_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .bind(version as i64)
        .bind(commit.fence as i64)
        .bind(upper)
        .bind(&commit.batch_id)
        .bind(commit.row_count as i64)
        .bind(now)
        .execute(&mut *conn)
        .await?;
    }
    for lateness in &commit.late_row_lateness_micros {
        sqlx::query(
            "INSERT INTO late_rows (task, epoch, shard_id, batch_id, lateness_micros, found_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&shard.task)
        .bind(shard.epoch as i64)
        .bind(shard.shard_id as i64)
        .bind(&commit.batch_id)
        .bind(lateness)
        .bind(now)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}
