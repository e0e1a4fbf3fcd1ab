//! The control-store interface's rules, one suite run against both stores: the PostgreSQL
//! control database (a real server, a database of its own per test) and the embedded SQLite
//! store (a file in a scratch directory, no network). Every rule the coordinator relies on is
//! asserted on the records it answers: an epoch is written once; a claim records only a larger
//! fence; a batch is registered once with its content, and only by the current owner from its
//! committed cursor; the commit CAS refuses a stale fence, a stale version, a wrong lower bound,
//! a batch that is not staged with those bounds, a paused task, a replaced epoch and a retired
//! shard, and answers a retried commit with the version it already made; committing a batch
//! abandons the other batches staged from the same position; a new owner gets the staged batch
//! that starts at the committed cursor; reconciliation runs finish with their last part; and
//! one coordinator at a time holds the state.

use tidemark_common::config::ReconcileCompare;
use tidemark_common::cursor::{Cursor, KeyValue, Position, ShardRange};
use tidemark_coordinator::checkpoints::{Claim, CommitBatch, ControlDb, EpochPlan, RegisterBatch, ShardKey};
use tidemark_coordinator::error::CoordinatorError;
use tidemark_coordinator::reconcile_runs::ShardReconcile;
use tidemark_tests::{TempDir, TestDb};

/// A store of one kind, kept alive (its database or directory) for the test.
struct Store {
    control: ControlDb,
    url: String,
    _db: Option<TestDb>,
    _dir: Option<TempDir>,
}

async fn postgres(tag: &str) -> Store {
    let db = TestDb::create(tag).await;
    let url = db.url.clone();
    Store {
        control: ControlDb::connect(&url, None).await.unwrap(),
        url,
        _db: Some(db),
        _dir: None,
    }
}

async fn sqlite(tag: &str) -> Store {
    let dir = TempDir::new(tag);
    let url = format!("sqlite://{}", dir.0.join("state/control.db").display());
    Store {
        control: ControlDb::connect(&url, None).await.unwrap(),
        url,
        _db: None,
        _dir: Some(dir),
    }
}

/// Runs a rule against both stores, as two tests.
macro_rules! both_stores {
    ($($rule:ident),* $(,)?) => {
        mod on_postgres {
            $(#[tokio::test]
            async fn $rule() {
                super::$rule(super::postgres(stringify!($rule)).await).await;
            })*
        }
        mod on_sqlite {
            $(#[tokio::test]
            async fn $rule() {
                super::$rule(super::sqlite(stringify!($rule)).await).await;
            })*
        }
    };
}

both_stores!(
    epochs_are_written_once_and_claims_only_raise_fences,
    registration_is_once_by_the_owner_from_its_cursor,
    the_commit_cas_refuses_what_is_not_current,
    a_new_owner_gets_the_staged_batch_at_its_cursor,
    pauses_failures_and_epoch_switches_stop_commits,
    reconciliation_runs_finish_with_their_last_part,
    shard_operations_and_workers,
    building_epochs_and_progress,
    one_coordinator_at_a_time,
);

const TASK: &str = "items";

fn key(value: i64) -> Option<Vec<KeyValue>> {
    Some(vec![KeyValue {
        sql_type: "bigint".into(),
        value: value.to_string(),
    }])
}

fn after(epoch: u64, value: i64) -> Cursor {
    Cursor::new(epoch, Position::Snapshot { after_key: key(value) })
}

fn range(lo: Option<i64>, hi: Option<i64>) -> String {
    let bound = |v: Option<i64>| {
        v.map(|v| KeyValue {
            sql_type: "bigint".into(),
            value: v.to_string(),
        })
    };
    ShardRange {
        lo: bound(lo),
        hi: bound(hi),
    }
    .encode()
}

fn plan(epoch: u64) -> EpochPlan {
    EpochPlan {
        task: TASK.into(),
        epoch,
        schema_id: format!("schema-{epoch}"),
        columns: serde_json::json!([["id", "bigint"], ["name", "text"]]),
        h0_time_micros: 1_700_000_000_000_000,
        h0_max_key: Some(serde_json::json!([{"sql_type": "bigint", "value": "300"}])),
        incremental_start: Cursor::incremental_at(epoch, 1_700_000_000_000_000),
        ranges: vec![
            range(None, Some(100)),
            range(Some(100), Some(200)),
            range(Some(200), None),
        ],
        estimated_rows: Some(300),
        cursor_zone: Some("Europe/Berlin".into()),
        source_table_id: None,
    }
}

fn shard(epoch: u64, id: u32) -> ShardKey {
    ShardKey {
        task: TASK.into(),
        epoch,
        shard_id: id,
    }
}

async fn claim(
    control: &ControlDb,
    shard: &ShardKey,
    fence: u64,
    owner: &str,
) -> Option<tidemark_coordinator::checkpoints::Claimed> {
    control
        .claim_shards(&[Claim {
            shard: shard.clone(),
            fence,
            owner: owner.into(),
        }])
        .await
        .unwrap()
        .pop()
        .unwrap()
}

fn batch(shard: &ShardKey, fence: u64, id: &str, lower: Cursor, upper: Cursor, hash: &str) -> RegisterBatch {
    RegisterBatch {
        shard: shard.clone(),
        fence,
        batch_id: id.into(),
        lower,
        upper,
        row_count: 10,
        byte_size: 1000,
        content_hash: hash.into(),
        manifest_path: format!("{id}/manifest.json"),
    }
}

async fn register(control: &ControlDb, batch: RegisterBatch) -> Result<(), CoordinatorError> {
    control.register_batches(&[batch]).await.unwrap().pop().unwrap()
}

fn commit(shard: &ShardKey, fence: u64, version: u64, id: &str, lower: Cursor, upper: Cursor) -> CommitBatch {
    CommitBatch {
        shard: shard.clone(),
        fence,
        expected_version: version,
        batch_id: id.into(),
        lower,
        upper,
        row_count: 10,
        empty: false,
        replayed: false,
        late_row_lateness_micros: Vec::new(),
    }
}

async fn commit_one(
    control: &ControlDb,
    commit: CommitBatch,
) -> Result<tidemark_coordinator::checkpoints::Committed, CoordinatorError> {
    control.commit_batches(&[commit]).await.unwrap().pop().unwrap()
}

/// The shard's committed cursor and rows as `status` shows them.
async fn shard_status(control: &ControlDb, id: u32) -> (Cursor, u64) {
    let tasks = control.status().await.unwrap();
    let shard = tasks
        .iter()
        .find(|t| t.name == TASK)
        .unwrap()
        .shards
        .iter()
        .find(|s| s.shard_id == id)
        .unwrap_or_else(|| panic!("shard {id} in status"))
        .clone();
    (shard.cursor, shard.rows_applied)
}

async fn epochs_are_written_once_and_claims_only_raise_fences(store: Store) {
    let control = &store.control;
    assert!(
        control.create_epoch(&plan(1)).await.unwrap(),
        "the first plan is written"
    );
    let mut other = plan(1);
    other.schema_id = "another".into();
    assert!(
        !control.create_epoch(&other).await.unwrap(),
        "a second plan of the epoch loses"
    );
    let epoch = control.current_epoch(TASK).await.unwrap().expect("the live epoch");
    assert_eq!(epoch.epoch, 1);
    assert_eq!(epoch.schema_id, "schema-1", "the first plan stands");
    assert_eq!(epoch.columns, plan(1).columns);
    assert_eq!(epoch.h0_max_key, plan(1).h0_max_key);
    assert_eq!(epoch.incremental_start, plan(1).incremental_start);
    assert_eq!(epoch.cursor_zone.as_deref(), Some("Europe/Berlin"));
    assert_eq!(control.estimated_rows(TASK, 1).await.unwrap(), Some(300));
    assert_eq!(
        control
            .epoch_columns(TASK, 1)
            .await
            .unwrap()
            .unwrap()
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>(),
        ["id", "name"]
    );
    assert!(control.epoch_columns(TASK, 9).await.unwrap().is_none());

    let candidates = control.shard_candidates(&[TASK.into()]).await.unwrap();
    let mut ids: Vec<u32> = candidates.iter().map(|c| c.shard.shard_id).collect();
    ids.sort();
    assert_eq!(ids, [0, 1, 2]);
    assert!(control.shard_candidates(&["other".into()]).await.unwrap().is_empty());
    let among = control
        .shard_candidates_among(&[TASK.into()], &[shard(1, 2)])
        .await
        .unwrap();
    assert_eq!(among.iter().map(|c| c.shard.clone()).collect::<Vec<_>>(), [shard(1, 2)]);

    let claimed = claim(control, &shard(1, 0), 5, "w1")
        .await
        .expect("a larger fence claims");
    assert_eq!(claimed.record.fence, 5);
    assert_eq!(claimed.record.version, 0);
    assert_eq!(claimed.record.cursor, Cursor::snapshot_start(1));
    assert_eq!(
        ShardRange::decode(&claimed.record.range).unwrap(),
        ShardRange::decode(&range(None, Some(100))).unwrap()
    );
    assert!(claimed.pending.is_none());
    assert_eq!(claimed.epoch.expect("its epoch runs").schema_id, "schema-1");
    assert!(
        claim(control, &shard(1, 0), 5, "w2").await.is_none(),
        "an equal fence does not claim"
    );
    assert!(
        claim(control, &shard(1, 0), 4, "w2").await.is_none(),
        "a smaller fence does not claim"
    );
    assert!(claim(control, &shard(1, 7), 9, "w2").await.is_none(), "no such shard");
    // A group answers each claim on its own, in order.
    let answers = control
        .claim_shards(&[
            Claim {
                shard: shard(1, 1),
                fence: 6,
                owner: "w2".into(),
            },
            Claim {
                shard: shard(1, 0),
                fence: 3,
                owner: "w2".into(),
            },
        ])
        .await
        .unwrap();
    assert_eq!(answers.iter().map(Option::is_some).collect::<Vec<_>>(), [true, false]);
    assert_eq!(control.max_fence().await.unwrap(), 6);
}

async fn registration_is_once_by_the_owner_from_its_cursor(store: Store) {
    let control = &store.control;
    control.create_epoch(&plan(1)).await.unwrap();
    let s = shard(1, 0);
    claim(control, &s, 5, "w1").await.unwrap();
    let b = || batch(&s, 5, "b1", Cursor::snapshot_start(1), after(1, 10), "sha256:aa");
    register(control, b())
        .await
        .expect("the owner registers from its cursor");
    register(control, b())
        .await
        .expect("the same batch again (a lost answer) is the same batch");
    let other_content = RegisterBatch {
        content_hash: "sha256:bb".into(),
        ..b()
    };
    match register(control, other_content).await {
        Err(CoordinatorError::Batch { batch_id, message }) => {
            assert_eq!(batch_id, "b1");
            assert!(
                message.contains("already registered (STAGED) with content sha256:aa"),
                "{message}"
            );
        }
        other => panic!("other content under a registered id: {other:?}"),
    }
    match register(
        control,
        batch(&s, 4, "b2", Cursor::snapshot_start(1), after(1, 10), "sha256:cc"),
    )
    .await
    {
        Err(CoordinatorError::Fenced { current, given, .. }) => assert_eq!((current, given), (5, 4)),
        other => panic!("a stale fence: {other:?}"),
    }
    match register(control, batch(&s, 5, "b3", after(1, 10), after(1, 20), "sha256:dd")).await {
        Err(CoordinatorError::CheckpointConflict { message, .. }) => {
            assert!(message.contains("is not the committed cursor"), "{message}")
        }
        other => panic!("a lower bound that is not the cursor: {other:?}"),
    }
    match register(
        control,
        batch(&shard(1, 9), 5, "b4", Cursor::snapshot_start(1), after(1, 10), "x"),
    )
    .await
    {
        Err(CoordinatorError::InvalidRequest(message)) => assert!(message.contains("no shard 9"), "{message}"),
        other => panic!("no such shard: {other:?}"),
    }
    // A group: each answered on its own, in order.
    let t = shard(1, 1);
    claim(control, &t, 6, "w1").await.unwrap();
    let answers = control
        .register_batches(&[
            batch(&t, 6, "c1", Cursor::snapshot_start(1), after(1, 150), "sha256:c1"),
            batch(&s, 1, "c2", Cursor::snapshot_start(1), after(1, 10), "sha256:c2"),
        ])
        .await
        .unwrap();
    assert!(answers[0].is_ok(), "{:?}", answers[0]);
    assert!(
        matches!(answers[1], Err(CoordinatorError::Fenced { .. })),
        "{:?}",
        answers[1]
    );
}

async fn the_commit_cas_refuses_what_is_not_current(store: Store) {
    let control = &store.control;
    control.create_epoch(&plan(1)).await.unwrap();
    let s = shard(1, 0);
    claim(control, &s, 5, "w1").await.unwrap();
    let start = Cursor::snapshot_start(1);
    register(control, batch(&s, 5, "b1", start.clone(), after(1, 10), "sha256:b1"))
        .await
        .unwrap();
    // Another batch read from the same position (a retry under a new id): abandoned when b1 commits.
    register(
        control,
        batch(&s, 5, "b1-again", start.clone(), after(1, 10), "sha256:b1"),
    )
    .await
    .unwrap();

    match commit_one(control, commit(&s, 4, 0, "b1", start.clone(), after(1, 10))).await {
        Err(CoordinatorError::Fenced {
            current: 5, given: 4, ..
        }) => {}
        other => panic!("a stale fence: {other:?}"),
    }
    match commit_one(control, commit(&s, 5, 1, "b1", start.clone(), after(1, 10))).await {
        Err(CoordinatorError::CheckpointConflict { message, .. }) => {
            assert!(message.contains("expected version 1, found 0"), "{message}")
        }
        other => panic!("a stale version: {other:?}"),
    }
    match commit_one(control, commit(&s, 5, 0, "b1", after(1, 5), after(1, 10))).await {
        Err(CoordinatorError::CheckpointConflict { message, .. }) => {
            assert!(message.contains("is not the committed cursor"), "{message}")
        }
        other => panic!("a wrong lower bound: {other:?}"),
    }
    match commit_one(control, commit(&s, 5, 0, "b1", start.clone(), after(1, 11))).await {
        Err(CoordinatorError::Batch { message, .. }) => {
            assert!(message.contains("is not a staged batch with these bounds"), "{message}")
        }
        other => panic!("other upper bounds than staged: {other:?}"),
    }
    assert_eq!(
        shard_status(control, 0).await,
        (start.clone(), 0),
        "nothing refused moved the checkpoint"
    );

    let mut first = commit(&s, 5, 0, "b1", start.clone(), after(1, 10));
    first.late_row_lateness_micros = vec![1_000, 3_000];
    let committed = commit_one(control, first).await.expect("the current owner's commit");
    assert_eq!(committed.new_version, 1);
    assert!(!committed.repeated);
    assert!(!committed.release_requested);
    let work = committed.work.expect("what the owner does next");
    assert!(!work.release && work.reconcile.is_none());
    assert_eq!(shard_status(control, 0).await, (after(1, 10), 10));
    let late = control.lateness(TASK, 1).await.unwrap();
    assert_eq!((late.count, late.p99_micros, late.max_micros), (2, 3_000, 3_000));

    let retried = commit_one(control, commit(&s, 5, 0, "b1", start.clone(), after(1, 10)))
        .await
        .expect("a retried commit whose answer was lost");
    assert_eq!((retried.new_version, retried.repeated), (1, true));
    assert_eq!(
        shard_status(control, 0).await,
        (after(1, 10), 10),
        "a retry counts its rows once"
    );

    // The registry says which state each batch ended in (it shows in a conflicting re-register).
    let state_of = |id: &'static str| {
        let probe = RegisterBatch {
            content_hash: "sha256:probe".into(),
            ..batch(&s, 5, id, after(1, 10), after(1, 20), "")
        };
        async move {
            match register(control, probe).await {
                Err(CoordinatorError::Batch { message, .. }) => message,
                other => panic!("{id}: {other:?}"),
            }
        }
    };
    assert!(state_of("b1").await.contains("(COMMITTED)"));
    assert!(
        state_of("b1-again").await.contains("(ABANDONED)"),
        "read from a committed position"
    );
    match commit_one(control, commit(&s, 5, 1, "b1-again", start.clone(), after(1, 10))).await {
        Err(CoordinatorError::CheckpointConflict { message, .. }) => {
            assert!(message.contains("is not the committed cursor"), "{message}")
        }
        other => panic!("a batch from a position already committed: {other:?}"),
    }
    // An empty commit moves the cursor without a batch.
    let mut empty = commit(
        &s,
        5,
        1,
        "none",
        after(1, 10),
        Cursor::incremental_at(1, 1_700_000_000_000_000),
    );
    empty.empty = true;
    empty.row_count = 0;
    assert_eq!(commit_one(control, empty).await.unwrap().new_version, 2);
    assert_eq!(
        shard_status(control, 0).await,
        (Cursor::incremental_at(1, 1_700_000_000_000_000), 10)
    );
    // The staged batch nobody will commit was abandoned: a new owner is not handed it.
    let next = claim(control, &s, 7, "w2").await.unwrap();
    assert!(next.pending.is_none());
    assert_eq!(next.record.version, 2);

    // A group: each commit is judged on its own.
    let t = shard(1, 1);
    claim(control, &t, 8, "w2").await.unwrap();
    register(control, batch(&t, 8, "t1", start.clone(), after(1, 150), "sha256:t1"))
        .await
        .unwrap();
    let outcomes = control
        .commit_batches(&[
            commit(&t, 8, 0, "t1", start.clone(), after(1, 150)),
            commit(&s, 5, 2, "x", after(1, 10), after(1, 20)),
        ])
        .await
        .unwrap();
    assert_eq!(outcomes[0].as_ref().unwrap().new_version, 1);
    assert!(
        matches!(outcomes[1], Err(CoordinatorError::Fenced { .. })),
        "{:?}",
        outcomes[1]
    );
    assert_eq!(shard_status(control, 1).await, (after(1, 150), 10));
}

async fn a_new_owner_gets_the_staged_batch_at_its_cursor(store: Store) {
    let control = &store.control;
    control.create_epoch(&plan(1)).await.unwrap();
    let s = shard(1, 2);
    claim(control, &s, 5, "w1").await.unwrap();
    let start = Cursor::snapshot_start(1);
    register(control, batch(&s, 5, "b1", start.clone(), after(1, 250), "sha256:b1"))
        .await
        .unwrap();
    // The owner dies before its commit; the next owner replays what was staged.
    let claimed = claim(control, &s, 9, "w2").await.unwrap();
    let pending = claimed.pending.expect("the staged batch at the committed cursor");
    assert_eq!(pending.batch_id, "b1");
    assert_eq!(pending.lower, start);
    assert_eq!(pending.upper, after(1, 250));
    assert_eq!(pending.row_count, 10);
    assert_eq!(pending.content_hash, "sha256:b1");
    assert_eq!(pending.manifest_path, "b1/manifest.json");
    match commit_one(control, commit(&s, 5, 0, "b1", start.clone(), after(1, 250))).await {
        Err(CoordinatorError::Fenced {
            current: 9, given: 5, ..
        }) => {}
        other => panic!("the zombie's commit: {other:?}"),
    }
    let mut replay = commit(&s, 9, 0, "b1", start.clone(), after(1, 250));
    replay.replayed = true;
    assert_eq!(commit_one(control, replay).await.unwrap().new_version, 1);
    // An abandoned batch is not handed over; the version moves, so a re-read gets a new id.
    register(control, batch(&s, 9, "b2", after(1, 250), after(1, 290), "sha256:b2"))
        .await
        .unwrap();
    assert_eq!(control.abandon_batch(&s, 9, "b2").await.unwrap(), 2);
    assert!(matches!(
        control.abandon_batch(&s, 8, "b2").await,
        Err(CoordinatorError::Fenced { .. })
    ));
    assert!(claim(control, &s, 10, "w3").await.unwrap().pending.is_none());
    // Releasing under an old fence changes nothing; the owner's release frees the row.
    control.release(&s, 9, "w2").await.unwrap();
    control.release(&s, 10, "w3").await.unwrap();
}

async fn pauses_failures_and_epoch_switches_stop_commits(store: Store) {
    let control = &store.control;
    control.create_epoch(&plan(1)).await.unwrap();
    let s = shard(1, 0);
    claim(control, &s, 5, "w1").await.unwrap();
    let start = Cursor::snapshot_start(1);
    register(control, batch(&s, 5, "b1", start.clone(), after(1, 10), "sha256:b1"))
        .await
        .unwrap();

    assert_eq!(control.record_failure(&s, 5, "w1", "target refused").await.unwrap(), 1);
    assert_eq!(control.record_failure(&s, 5, "w1", "target refused").await.unwrap(), 2);
    assert_eq!(control.record_failure(&s, 5, "w1", "another").await.unwrap(), 1);
    assert_eq!(
        control.record_failure(&s, 4, "w1", "stale").await.unwrap(),
        0,
        "not the owner"
    );

    assert!(control.pause_task(TASK, "operator").await.unwrap());
    assert!(
        !control.pause_task(TASK, "second").await.unwrap(),
        "the first reason stays"
    );
    assert_eq!(control.paused_reason(TASK).await.unwrap().as_deref(), Some("operator"));
    assert!(
        control.shard_candidates(&[TASK.into()]).await.unwrap().is_empty(),
        "a paused task's shards"
    );
    match commit_one(control, commit(&s, 5, 0, "b1", start.clone(), after(1, 10))).await {
        Err(CoordinatorError::Paused { reason, .. }) => assert_eq!(reason, "operator"),
        other => panic!("a paused task's commit: {other:?}"),
    }
    assert!(control.resume_task(TASK).await.unwrap());
    assert_eq!(control.paused_reason(TASK).await.unwrap(), None);
    // A failure from before the resume does not pause again; one acquired after it does.
    assert!(!control.pause_for_owner(&s, 5, "w1", "stale failure").await.unwrap());
    claim(control, &s, 6, "w1").await.unwrap();
    assert!(
        control
            .pause_for_owner(&s, 6, "w1", "target refused most rows")
            .await
            .unwrap()
    );
    assert!(control.resume_task(TASK).await.unwrap());

    assert_eq!(control.record_source_clock(TASK, 100).await.unwrap(), None);
    assert_eq!(control.record_source_clock(TASK, 50).await.unwrap(), Some(100));
    assert_eq!(
        control.record_source_clock(TASK, 200).await.unwrap(),
        Some(100),
        "the highest reading"
    );
    assert_eq!(control.record_source_clock(TASK, 10).await.unwrap(), Some(200));
    control
        .set_source_hold(TASK, Some("a prepared transaction"))
        .await
        .unwrap();
    let status = control.status().await.unwrap();
    assert_eq!(status[0].source_hold.as_deref(), Some("a prepared transaction"));
    control.set_source_hold(TASK, None).await.unwrap();
    assert_eq!(control.status().await.unwrap()[0].source_hold, None);

    assert!(control.pause_epoch(TASK, 1, "reinitialization required").await.unwrap());
    assert!(!control.pause_epoch(TASK, 2, "not this epoch").await.unwrap());
    // `tasks reinit` in place: epoch 2 replaces 1, clears the pause, abandons 1's batches.
    assert!(control.switch_epoch(&plan(2)).await.unwrap());
    assert!(!control.switch_epoch(&plan(2)).await.unwrap(), "another reinit won");
    assert_eq!(control.paused_reason(TASK).await.unwrap(), None);
    match commit_one(control, commit(&s, 6, 0, "b1", start.clone(), after(1, 10))).await {
        Err(CoordinatorError::EpochSuperseded {
            epoch: 1, current: 2, ..
        }) => {}
        other => panic!("a replaced epoch's commit: {other:?}"),
    }
    assert_eq!(control.current_epoch(TASK).await.unwrap().unwrap().epoch, 2);
    let candidates = control.shard_candidates(&[TASK.into()]).await.unwrap();
    assert!(candidates.iter().all(|c| c.shard.epoch == 2) && candidates.len() == 3);
    let claimed = claim(control, &s, 7, "w1")
        .await
        .expect("a claim of the old epoch's row records");
    assert!(claimed.epoch.is_none(), "…but its epoch no longer runs");
    assert!(claimed.pending.is_none(), "its staged batch was abandoned");

    // evolve: new columns, shards above the re-read point read again from it.
    let s2 = shard(2, 0);
    claim(control, &s2, 8, "w1").await.unwrap();
    let mut move_to = commit(
        &s2,
        8,
        0,
        "e",
        Cursor::snapshot_start(2),
        Cursor::incremental_at(2, 5_000),
    );
    move_to.empty = true;
    commit_one(control, move_to).await.unwrap();
    let columns = serde_json::json!([["id", "bigint"], ["name", "text"], ["added", "int"]]);
    assert!(
        control
            .evolve_epoch(TASK, 2, "schema-2", "schema-3", &columns, 4_000)
            .await
            .unwrap()
    );
    assert!(
        !control
            .evolve_epoch(TASK, 2, "schema-2", "schema-4", &columns, 4_000)
            .await
            .unwrap()
    );
    let epoch = control.current_epoch(TASK).await.unwrap().unwrap();
    assert_eq!((epoch.schema_id.as_str(), &epoch.columns), ("schema-3", &columns));
    assert_eq!(shard_status(control, 0).await.0, Cursor::incremental_at(2, 4_000));
    let floor = control.epoch_floor(TASK, &epoch).await.unwrap();
    assert_eq!(floor, Some(4_000), "the re-read point is below the epoch's start");
}

async fn reconciliation_runs_finish_with_their_last_part(store: Store) {
    let control = &store.control;
    control.create_epoch(&plan(1)).await.unwrap();
    assert!(control.last_reconcile(TASK).await.unwrap().is_none());
    assert!(control.seconds_since_last_reconcile(TASK).await.unwrap().is_none());
    let run = control
        .start_reconcile(TASK, "operator", Some(1_000), ReconcileCompare::Versions)
        .await
        .unwrap();
    assert!(matches!(
        control
            .start_reconcile("nope", "operator", None, ReconcileCompare::Content)
            .await,
        Err(CoordinatorError::UnknownTask(_))
    ));
    let shards: Vec<ShardKey> = (0..3).map(|i| shard(1, i)).collect();
    for (i, s) in shards.iter().enumerate() {
        claim(control, s, 10 + i as u64, "w1").await.unwrap();
    }
    let works = control.shard_works(&shards).await.unwrap();
    for work in &works {
        let order = work.reconcile.as_ref().expect("a part of the run for each shard");
        assert_eq!(
            (order.run_id, order.since_micros, order.versions_only),
            (run, Some(1_000), true)
        );
        assert!(!work.release);
    }
    let result = ShardReconcile {
        ranges_compared: 4,
        rows_read: 100,
        keys_repaired: 2,
        extra_in_target: 1,
        duration_ms: 7,
        keys_missed: 1,
    };
    assert!(matches!(
        control.report_reconcile(&shards[0], 9, run, &result).await,
        Err(CoordinatorError::Fenced { .. })
    ));
    for (i, s) in shards.iter().enumerate().take(2) {
        control.report_reconcile(s, 10 + i as u64, run, &result).await.unwrap();
    }
    let partial = control.reconcile_run(run).await.unwrap().unwrap();
    assert_eq!(
        (partial.shards_total, partial.shards_done, partial.finished),
        (3, 2, false)
    );
    assert!(
        control.shard_works(&shards[..1]).await.unwrap()[0].reconcile.is_none(),
        "done"
    );
    control.report_reconcile(&shards[2], 12, run, &result).await.unwrap();
    let done = control.last_reconcile(TASK).await.unwrap().unwrap();
    assert_eq!(done.run_id, run);
    assert!(done.finished);
    assert_eq!(done.compare, "versions");
    assert_eq!(
        (
            done.ranges_compared,
            done.rows_read,
            done.keys_repaired,
            done.extra_in_target,
            done.keys_missed
        ),
        (12, 300, 6, 3, 3)
    );
    assert!(control.seconds_since_last_reconcile(TASK).await.unwrap().unwrap() >= 0.0);
}

async fn shard_operations_and_workers(store: Store) {
    let control = &store.control;
    control.create_epoch(&plan(1)).await.unwrap();
    control.register_worker_row("w1", 41).await.unwrap();
    control.register_worker_row("w2", 42).await.unwrap();
    control.register_worker_row("w1", 43).await.unwrap();
    control.workers_seen(&["w1".into(), "w2".into()]).await.unwrap();
    control.drain_worker("w2").await.unwrap();
    assert!(control.drain_worker("w9").await.is_err(), "an unknown worker");
    let workers = control.list_workers().await.unwrap();
    let seen: Vec<(&str, i64, bool)> = workers
        .iter()
        .map(|w| (w.id.as_str(), w.lease_id, w.draining))
        .collect();
    assert_eq!(seen, [("w1", 43, false), ("w2", 42, true)]);
    assert!(workers.iter().all(|w| (0.0..60.0).contains(&w.seconds_since_seen)));
    assert!(control.worker_draining("w2").await.unwrap());
    assert!(!control.worker_draining("w9").await.unwrap());

    let shards = control.list_shards(Some(TASK)).await.unwrap();
    assert_eq!(shards.len(), 3);
    assert_eq!(
        shards[1].range,
        ShardRange::decode(&range(Some(100), Some(200))).unwrap()
    );
    assert_eq!(shards[1].phase, "SNAPSHOT");
    assert!(control.list_shards(Some("other")).await.unwrap().is_empty());
    let s = shard(1, 1);
    claim(control, &s, 5, "w1").await.unwrap();
    control.request_release(std::slice::from_ref(&s)).await.unwrap();
    assert!(
        control.shard_works(std::slice::from_ref(&s)).await.unwrap()[0].release,
        "asked back"
    );
    let running = control.running_shards().await.unwrap();
    let one = running.iter().find(|r| r.key == s).expect("a running shard");
    assert!(one.releasing && !one.incremental);
    assert!(one.held < std::time::Duration::from_secs(60));
}

async fn building_epochs_and_progress(store: Store) {
    let control = &store.control;
    control.create_epoch(&plan(1)).await.unwrap();
    assert_eq!(control.next_epoch(TASK).await.unwrap(), 2);
    let lifecycle = control.lifecycle(TASK).await.unwrap().unwrap();
    assert_eq!((lifecycle.live, lifecycle.building.is_none()), (1, true));
    assert!(
        control
            .begin_building(&plan(2), true, &["CREATE INDEX x".into()])
            .await
            .unwrap()
    );
    assert!(
        !control.begin_building(&plan(2), false, &[]).await.unwrap(),
        "another reinit won"
    );
    let lifecycle = control.lifecycle(TASK).await.unwrap().unwrap();
    assert!(lifecycle.live_frozen, "the live epoch's reads broke");
    let building = lifecycle.building.expect("epoch 2 builds");
    assert_eq!(
        (building.epoch, building.validated, building.switch_requested),
        (2, false, false)
    );
    // The frozen live epoch's shards are not handed out; the building one's are.
    let candidates = control.shard_candidates(&[TASK.into()]).await.unwrap();
    assert!(candidates.iter().all(|c| c.shard.epoch == 2) && candidates.len() == 3);
    assert_eq!(control.watched_epoch(TASK).await.unwrap().unwrap().epoch, 2);
    assert_eq!(control.current_epoch(TASK).await.unwrap().unwrap().epoch, 1);
    assert_eq!(control.epoch_progress(TASK, 2).await.unwrap(), (false, None));
    assert_eq!(
        control.epoch_watermark(TASK, 2).await.unwrap(),
        None,
        "shards in their snapshot"
    );
    assert_eq!(control.epoch_watermark(TASK, 9).await.unwrap(), None, "no shards");
    for id in 0..3 {
        let s = shard(2, id);
        claim(control, &s, 20 + id as u64, "w1").await.unwrap();
        let mut done = commit(
            &s,
            20 + id as u64,
            0,
            "e",
            Cursor::snapshot_start(2),
            Cursor::incremental_at(2, 1_000 + id as i64),
        );
        done.empty = true;
        commit_one(control, done).await.unwrap();
        if id == 0 {
            assert_eq!(
                control.epoch_watermark(TASK, 2).await.unwrap(),
                None,
                "two shards still in their snapshot"
            );
        }
    }
    assert_eq!(control.epoch_progress(TASK, 2).await.unwrap(), (true, Some(1_000)));
    assert_eq!(control.epoch_watermark(TASK, 2).await.unwrap(), Some(1_000));
    // A third reinit abandons the building epoch.
    assert!(control.begin_building(&plan(3), false, &[]).await.unwrap());
    let lifecycle = control.lifecycle(TASK).await.unwrap().unwrap();
    assert_eq!(lifecycle.building.unwrap().epoch, 3);
    assert_eq!(lifecycle.abandoned, [2]);
    match commit_one(
        control,
        commit(&shard(2, 0), 20, 1, "x", Cursor::incremental_at(2, 1_000), after(2, 1)),
    )
    .await
    {
        Err(CoordinatorError::EpochSuperseded { epoch: 2, .. }) => {}
        other => panic!("an abandoned epoch's commit: {other:?}"),
    }
}

async fn one_coordinator_at_a_time(store: Store) {
    let first = store
        .control
        .hold_sole_coordinator()
        .await
        .expect("the first holds the state");
    let second = ControlDb::connect(&store.url, None).await.unwrap();
    let refused = second.hold_sole_coordinator().await.err().expect("a second is refused");
    assert!(refused.to_string().contains("stop it first"), "{refused}");
    drop(first);
    // The lock goes with its holder (for PostgreSQL, when the detached session closes).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match second.hold_sole_coordinator().await {
            Ok(_) => break,
            Err(error) if std::time::Instant::now() < deadline => {
                let _ = error;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(error) => panic!("the state stays held after its holder left: {error}"),
        }
    }
}

/// `rounds` register-and-commit cycles of shard `s` (owned under fence 5), from key position
/// `first` on.
async fn cycles(control: &ControlDb, s: &ShardKey, first: i64, rounds: i64) {
    for n in first..first + rounds {
        let id = format!("plan-{n}");
        let (lower, upper) = (after(1, n), after(1, n + 1));
        let lower = if n == 0 { Cursor::snapshot_start(1) } else { lower };
        register(control, batch(s, 5, &id, lower.clone(), upper.clone(), "sha256:ab"))
            .await
            .unwrap();
        commit_one(control, commit(s, 5, n as u64, &id, lower, upper))
            .await
            .unwrap();
    }
}

/// (inserts, sequential scans, rows read by them, index entries read) of `batches`, once the
/// counters include `inserts` rows (another session's counters reach the statistics within
/// about 10 s of its last statement).
async fn batches_reads(db: &TestDb, inserts: i64) -> (i64, i64, i64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (seen, scans, rows, entries): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT t.n_tup_ins, t.seq_scan, t.seq_tup_read, \
             (SELECT sum(i.idx_tup_read)::bigint FROM pg_stat_user_indexes i WHERE i.relid = t.relid) \
             FROM pg_stat_user_tables t WHERE t.relname = 'batches'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if seen >= inserts {
            return (scans, rows, entries);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "batches counters at {seen} inserts, not {inserts}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// PostgreSQL only. A connection keeps a generic plan for each statement it ran five times;
/// made while `batches` was small, the registration's plan read the whole table, and growth
/// alone never replaces it. After the coordinator refreshes the statistics of the tables
/// that outgrew them (`control_statistics`), registrations and commits read `batches` by
/// key: no sequential scan, and a few index entries per batch, not the 20,000 rows nor the
/// 10,000 staged entries of other shards.
#[tokio::test]
async fn registrations_and_commits_read_batches_by_key_after_the_table_grew() {
    let store = postgres("plans_follow_growth").await;
    let (control, db) = (&store.control, store._db.as_ref().unwrap());
    control.create_epoch(&plan(1)).await.unwrap();
    let s = shard(1, 0);
    claim(control, &s, 5, "w1").await.unwrap();
    // Run sequentially, the cycles use one pooled connection: its plans are made now.
    cycles(control, &s, 0, 8).await;
    db.exec(
        "INSERT INTO batches (batch_id, task, epoch, shard_id, lower, upper, row_count, byte_size, content_hash, \
         manifest_path, fence, state) \
         SELECT md5(n::text), 'items', CASE WHEN n % 3 = 0 THEN 7 ELSE 1 END, 2, '{}', '{}', 1, 1, 'h', 'm', 1, \
         CASE WHEN n % 3 = 0 THEN 'STAGED' ELSE 'COMMITTED' END FROM generate_series(1, 30000) n",
    )
    .await;
    let analyzed = tidemark_coordinator::control_statistics::refresh(control)
        .await
        .unwrap();
    assert!(analyzed.contains(&"batches".to_string()), "{analyzed:?}");
    assert!(
        tidemark_coordinator::control_statistics::refresh(control)
            .await
            .unwrap()
            .is_empty(),
        "a second refresh finds nothing outgrown"
    );
    let before = batches_reads(db, 30_008).await;
    cycles(control, &s, 8, 6).await;
    let after = batches_reads(db, 30_014).await;
    let (scans, rows, entries) = (after.0 - before.0, after.1 - before.1, after.2 - before.2);
    assert_eq!((scans, rows), (0, 0), "sequential scans of batches in 6 cycles");
    assert!(entries <= 6 * 10, "{entries} index entries read in 6 cycles");
}

/// Every control statement is planned once per session, not on each execution: at 1,000
/// workers PostgreSQL spent 29 % of its CPU planning the group statements anew (a custom plan
/// looks cheaper to it for an array parameter). Eight registrations and commits, run one
/// after the other, make generic plans only.
#[tokio::test]
async fn control_statements_are_planned_once_per_session() {
    let store = postgres("generic_plans").await;
    let control = &store.control;
    control.create_epoch(&plan(1)).await.unwrap();
    let s = shard(1, 0);
    claim(control, &s, 5, "w1").await.unwrap();
    cycles(control, &s, 0, 8).await;
    // The session asked here is one the cycles ran on (the pool opens a session only when
    // none is idle).
    let pool = control.postgres_pool().unwrap();
    let (custom, generic, statements): (i64, i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(custom_plans), 0)::bigint, coalesce(sum(generic_plans), 0)::bigint, count(*) \
         FROM pg_prepared_statements",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(statements >= 3, "{statements} prepared statements");
    assert_eq!(custom, 0, "custom plans made; generic plans: {generic}");
    assert!(generic >= 8, "{generic} executions of generic plans");
}
