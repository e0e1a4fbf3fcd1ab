//! The guarantee under the source's own semantics (fault matrix S16–S19, S24): who the
//! open-transaction bound can see, what a naive timestamp means, session formats, and cursor
//! values no window can hold. Each case ends with the target right per key, or the task
//! refused or paused with a reason that names the fix.
//! Boundary: everything committed in the source before the watermark; delete policy: none.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tidemark_tests::faults::PrivatePg;
use tidemark_tests::{Cluster, KeyKind, TaskSettings, TestDb, TestRole, compare_table, create_items, insert_items};

/// A pool whose sessions render values one way, whatever the database's defaults: the
/// oracle must not depend on the settings under test.
async fn pinned_pool(url: &str) -> PgPool {
    let options = PgConnectOptions::from_str(url).unwrap().options([
        ("DateStyle", "ISO, MDY"),
        ("IntervalStyle", "postgres"),
        ("extra_float_digits", "3"),
        ("bytea_output", "hex"),
        ("TimeZone", "UTC"),
    ]);
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap()
}

const TYPED_COLUMNS: &[&str] = &["id", "d", "iv", "b", "f", "ts", "updated_at"];

/// Rows whose text form depends on the session: intervals with mixed signs (which
/// `sql_standard` writes ambiguously), dates (`SQL, DMY` swaps day and month), bytea
/// (`escape`), floats that need 17 digits, naive timestamps.
fn typed_rows(first: i64, count: i64) -> String {
    format!(
        "INSERT INTO typed (id, d, iv, b, f, ts, updated_at)
         SELECT g, date '2026-02-01' + (g % 40)::int,
                interval '-1 day' * (g % 5) - interval '2 hours' + interval '7 minutes' * (g % 3)
                    + interval '1 month' * (g % 4 - 2),
                decode(lpad(to_hex(g), 8, '0') || '005c27', 'hex'),
                0.1 * g + 0.2,
                timestamp '2026-03-04 05:06:07.891234' + g * interval '1 second',
                clock_timestamp()
         FROM generate_series({first}, {}) g",
        first + count - 1
    )
}

/// S19: a source database with `DateStyle = 'SQL, DMY'`, `IntervalStyle = sql_standard`,
/// `bytea_output = escape` and `extra_float_digits = 0`, a target with other settings again,
/// pages read and applied as COPY text: every value arrives equal per key, in the snapshot
/// and incrementally, and a full reconciliation finds nothing to repair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_formats_of_the_source_and_target_databases_change_no_value() {
    let mut cluster = Cluster::new("sessions").await;
    for (db, settings) in [
        (
            &cluster.source,
            [
                "DateStyle = 'SQL, DMY'",
                "IntervalStyle = 'sql_standard'",
                "bytea_output = 'escape'",
                "extra_float_digits = 0",
            ],
        ),
        (
            &cluster.target,
            [
                "DateStyle = 'German, DMY'",
                "IntervalStyle = 'postgres_verbose'",
                "bytea_output = 'escape'",
                "extra_float_digits = -3",
            ],
        ),
    ] {
        for setting in settings {
            db.exec(&format!("ALTER DATABASE \"{}\" SET {setting}", db.name)).await;
        }
    }
    cluster
        .source
        .exec(
            "CREATE TABLE typed (id bigint PRIMARY KEY, d date, iv interval, b bytea, f float8, ts timestamp(6),
                                 updated_at timestamptz(6) NOT NULL)",
        )
        .await;
    cluster.source.exec(&typed_rows(1, 500)).await;
    let settings = TaskSettings {
        source_table: "public.typed".into(),
        shards: 2,
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("sessions-w", 2, &[("TIDEMARK_COPY_FORMAT", "text")]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    cluster.source.exec(&typed_rows(501, 500)).await;
    cluster
        .source
        .exec("UPDATE typed SET iv = iv - interval '3 days 4 hours', f = f / 3, updated_at = clock_timestamp() WHERE id % 3 = 0")
        .await;
    let end = cluster.source_now_micros().await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;

    let (source, target) = (
        pinned_pool(&cluster.source.url).await,
        pinned_pool(&cluster.target.url).await,
    );
    let version = "(extract(epoch from updated_at) * 1000000)::bigint";
    let diff = compare_table(&source, &target, "typed", &["id"], TYPED_COLUMNS, version).await;
    assert_eq!(diff.keys, 1000);
    diff.assert_clean("text pages between databases with other session formats");
    let formats = cluster.staged_formats();
    assert!(
        formats.keys().all(|f| f.starts_with("pg_copy_text")) && !formats.is_empty(),
        "the pages were COPY text: {formats:?}"
    );
    let run = cluster.reconcile(&["--full"]);
    assert_eq!(run["keys_repaired"], 0, "equal values hash equal on both sides: {run}");
}

async fn source_micros(pool: &PgPool, expression: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT (extract(epoch from {expression}) * 1000000)::bigint"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Inserts `count` rows above `first` into `items`, one transaction each, 400 ms apart: other
/// commits while a late transaction stays open. Returns the lowest watermark seen meanwhile.
async fn commit_others_while_open(cluster: &Cluster, first: i64, count: i64) -> i64 {
    let mut lowest = i64::MAX;
    for n in 0..count {
        insert_items(&cluster.source, KeyKind::Bigint, first + n, 1, "clock_timestamp()").await;
        if let Some(watermark) = cluster.task_status().await.watermark_micros {
            lowest = lowest.min(watermark);
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    lowest
}

/// The late row every visibility test writes: its cursor time is its transaction's start.
const LATE_ROW: &str = "INSERT INTO items (id, seq, name, qty, price, payload, note, updated_at) \
     VALUES (1000001, 1000001, 'late', 1, 1, NULL, NULL, now())";

/// S16: the task's source role has SELECT only. The coordinator refuses the task and names
/// the grant; with `pg_read_all_stats` granted, a transaction another role holds open for
/// 8 s (overlap 1 s) holds the watermark and its row arrives; when the grant is revoked the
/// running task pauses and names it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_role_that_cannot_see_other_roles_transactions_is_refused_then_paused() {
    let reader = TestRole::create("reader").await;
    let writer = TestRole::create("writer").await;
    let mut cluster = Cluster::new("blind").await;
    create_items(&cluster.source, KeyKind::Bigint, 200).await;
    cluster
        .source
        .exec(&format!(
            "GRANT CONNECT ON DATABASE \"{db}\" TO \"{r}\", \"{w}\"; GRANT USAGE ON SCHEMA public TO \"{r}\", \"{w}\";
             GRANT SELECT ON items TO \"{r}\"; GRANT SELECT, INSERT, UPDATE ON items TO \"{w}\"",
            db = cluster.source.name,
            r = reader.name,
            w = writer.name
        ))
        .await;
    let settings = TaskSettings {
        shards: 2,
        overlap: "1s",
        source_url: cluster.source.url_as(&reader.name),
        ..TaskSettings::default()
    };
    let grant = format!("GRANT pg_read_all_stats TO {}", reader.name);
    let refused = cluster.refused_start(&settings);
    assert!(
        refused.contains("open transactions not visible") && refused.contains(&grant),
        "the refusal names the grant: {refused}"
    );

    cluster
        .source
        .exec(&format!("GRANT pg_read_all_stats TO \"{}\"", reader.name))
        .await;
    cluster.start(&settings).await;
    cluster.spawn_worker("blind-w", 2, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    let writer_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&cluster.source.url_as(&writer.name))
        .await
        .unwrap();
    let mut late = writer_pool.begin().await.unwrap();
    sqlx::query(LATE_ROW).execute(&mut *late).await.unwrap();
    let started: i64 = sqlx::query_scalar("SELECT (extract(epoch from now()) * 1000000)::bigint")
        .fetch_one(&mut *late)
        .await
        .unwrap();
    let lowest = commit_others_while_open(&cluster, 2_000_000, 20).await;
    late.commit().await.unwrap();
    let committed = cluster.source_now_micros().await;
    cluster.wait_for_watermark(committed, Duration::from_secs(60)).await;
    assert!(
        lowest <= started,
        "the watermark waited for the other role's transaction"
    );
    cluster
        .items_diff()
        .await
        .assert_clean("the late row of another role arrived");

    cluster
        .source
        .exec(&format!("REVOKE pg_read_all_stats FROM \"{}\"", reader.name))
        .await;
    let paused = cluster
        .wait_for("paused for the revoked grant", Duration::from_secs(30), |t| {
            t.phase == "paused"
        })
        .await;
    assert!(
        paused.paused_reason.starts_with("open transactions not visible") && paused.paused_reason.contains(&grant),
        "{}",
        paused.paused_reason
    );
    writer_pool.close().await;
}

/// S17: a prepared transaction has no session and no start time. While one is open the
/// watermark stays where it was and `status` names it; its row, prepared 8 s before its
/// COMMIT PREPARED (overlap 1 s), arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_holds_the_watermark_until_it_commits() {
    let Some(server) = PrivatePg::start_with(&["max_prepared_transactions=8"]) else {
        panic!("a private PostgreSQL server is needed (initdb, run as root)");
    };
    let mut cluster = Cluster::with_source("prepared", TestDb::create_on(&server.url, "prepared_src").await).await;
    create_items(&cluster.source, KeyKind::Bigint, 200).await;
    let settings = TaskSettings {
        shards: 2,
        overlap: "1s",
        ..TaskSettings::default()
    };
    cluster.start(&settings).await;
    cluster.spawn_worker("prepared-w", 2, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    let mut conn = cluster.source.pool.acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; {LATE_ROW}; PREPARE TRANSACTION 'tm_late'"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let prepared = source_micros(&cluster.source.pool, "clock_timestamp()").await;
    let lowest = commit_others_while_open(&cluster, 2_000_000, 20).await;
    let held = cluster.task_status().await;
    assert!(
        held.warnings
            .iter()
            .any(|w| w.contains("prepared transaction 'tm_late'")),
        "status names the prepared transaction: {:?}",
        held.warnings
    );
    sqlx::query("COMMIT PREPARED 'tm_late'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let committed = cluster.source_now_micros().await;
    cluster.wait_for_watermark(committed, Duration::from_secs(60)).await;
    assert!(
        lowest <= prepared,
        "the watermark stayed while the transaction was prepared"
    );
    cluster
        .items_diff()
        .await
        .assert_clean("the prepared transaction's row arrived");
    let released = cluster.task_status().await;
    assert!(
        !released.warnings.iter().any(|w| w.contains("prepared transaction")),
        "{:?}",
        released.warnings
    );
}

/// S17: a hot standby cannot see its primary's transactions, and a logical-replication
/// subscriber's rows carry the publisher's times: both are refused by name. With the bound
/// turned off on purpose the standby task starts, and `status` says the late-commit guarantee
/// is reduced to the overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_standby_or_a_subscriber_source_is_refused_by_name() {
    let Some(primary) = PrivatePg::start_with(&["wal_level=logical"]) else {
        panic!("a private PostgreSQL server is needed (initdb, run as root)");
    };
    let mut cluster = Cluster::with_source("standby", TestDb::create_on(&primary.url, "standby_src").await).await;
    create_items(&cluster.source, KeyKind::Bigint, 100).await;
    let standby = primary.start_standby().expect("pg_basebackup of the private server");
    let standby_url = format!("{}/{}", standby.url, cluster.source.name);
    let replicated = async {
        loop {
            if let Ok(pool) = PgPoolOptions::new().max_connections(1).connect(&standby_url).await
                && sqlx::query_scalar::<_, i64>("SELECT count(*) FROM items")
                    .fetch_one(&pool)
                    .await
                    .ok()
                    == Some(100)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), replicated)
        .await
        .expect("the standby replays the table");
    let on_standby = TaskSettings {
        shards: 2,
        source_url: standby_url.clone(),
        ..TaskSettings::default()
    };
    let refused = cluster.refused_start(&on_standby);
    assert!(
        refused.contains("open transactions not visible") && refused.contains("hot standby"),
        "{refused}"
    );

    // A subscriber: the source table is fed by a subscription to another database.
    let publisher = TestDb::create_on(&primary.url, "publisher").await;
    create_items(&publisher, KeyKind::Bigint, 0).await;
    publisher.exec("CREATE PUBLICATION tm_pub FOR TABLE items").await;
    publisher
        .exec("SELECT pg_create_logical_replication_slot('tm_slot', 'pgoutput')")
        .await;
    cluster
        .source
        .exec(&format!(
            "CREATE SUBSCRIPTION tm_sub CONNECTION 'host=127.0.0.1 port={} dbname={} user=postgres' PUBLICATION tm_pub \
             WITH (create_slot = false, slot_name = 'tm_slot', copy_data = false)",
            primary.port, publisher.name
        ))
        .await;
    let refused = cluster.refused_start(&TaskSettings {
        shards: 2,
        ..TaskSettings::default()
    });
    assert!(
        refused.contains("open transactions not visible") && refused.contains("subscription tm_sub"),
        "{refused}"
    );
    cluster.source.exec("DROP SUBSCRIPTION tm_sub").await;

    let unbounded = TaskSettings {
        open_transaction_bound: false,
        ..on_standby
    };
    cluster.start(&unbounded).await;
    cluster.spawn_worker("standby-w", 2, &[]);
    let status = cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    assert!(
        status
            .warnings
            .iter()
            .any(|w| w.contains("late-commit guarantee is reduced to the overlap window")),
        "{:?}",
        status.warnings
    );
    let boundary = status.contract.map(|c| c.boundary).unwrap_or_default();
    assert!(boundary.contains("reduced to the overlap window"), "{boundary}");
    cluster
        .items_diff()
        .await
        .assert_clean("a standby source with the bound off");
    drop(standby);
}

/// `events`: a naive cursor (`timestamp(3)`) written by sessions whose TimeZone is `zone`.
async fn create_events(cluster: &Cluster, zone: &str, rows: i64) -> PgPool {
    cluster
        .source
        .exec(
            "CREATE TABLE events (id bigint PRIMARY KEY, name text NOT NULL, updated_at timestamp(3) NOT NULL);
               CREATE INDEX events_cursor ON events (updated_at, id)",
        )
        .await;
    let writer = local_writer(&cluster.source.url, zone).await;
    write_events(&writer, 1, rows).await;
    writer
}

/// A pool whose sessions write `now()` in `zone`, as an application's would.
async fn local_writer(url: &str, zone: &str) -> PgPool {
    let set = format!("SET TimeZone = '{zone}'");
    PgPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let set = set.clone();
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(set)).execute(conn).await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .unwrap()
}

/// Inserts events written at `now()` of the writer's session.
async fn write_events(writer: &PgPool, first: i64, count: i64) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO events SELECT g, 'event ' || g, now() FROM generate_series({first}, {}) g",
        first + count - 1
    )))
    .execute(writer)
    .await
    .unwrap();
}

fn events_settings(extra: &str) -> TaskSettings {
    TaskSettings {
        source_table: "public.events".into(),
        shards: 2,
        extra: extra.to_string(),
        ..TaskSettings::default()
    }
}

/// S18: an application writes `now()` into a `timestamp without time zone` cursor under the
/// database's TimeZone (Asia/Kolkata, UTC+5:30). The task learns the zone from the database's
/// settings and every change arrives, versioned by the instant it names; the watermark is the
/// source clock's instant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naive_cursors_written_in_local_time_are_read_in_their_zone() {
    let mut cluster = Cluster::new("naive").await;
    cluster
        .source
        .exec(&format!(
            "ALTER DATABASE \"{}\" SET TimeZone = 'Asia/Kolkata'",
            cluster.source.name
        ))
        .await;
    let writer = create_events(&cluster, "Asia/Kolkata", 300).await;
    cluster.start(&events_settings("")).await;
    cluster.spawn_worker("naive-w", 2, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    for round in 0..5 {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "UPDATE events SET name = name || ' r{round}', updated_at = now() WHERE id % 7 = {round}"
        )))
        .execute(&writer)
        .await
        .unwrap();
        write_events(&writer, 1000 + round * 10, 10).await;
    }
    let end = cluster.source_now_micros().await;
    let status = cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    let version = "(extract(epoch from updated_at AT TIME ZONE 'Asia/Kolkata') * 1000000)::bigint";
    let diff = compare_table(
        &cluster.source.pool,
        &cluster.target.pool,
        "events",
        &["id"],
        &["id", "name", "updated_at"],
        version,
    )
    .await;
    assert_eq!(diff.keys, 350);
    diff.assert_clean("naive local times read in their zone");
    let watermark = status.watermark_micros.unwrap();
    assert!(
        watermark <= end + 5_000_000,
        "the watermark is an instant of the source clock, not 5.5 h ahead: {watermark} vs {end}"
    );
}

/// S18: a configured zone other than the writers' pauses the task by name: read as UTC,
/// Kolkata's local times lie hours ahead of the source clock; read as Kolkata, Bogota's
/// (UTC−5) arrive hours below the watermark. A zone whose clocks go back for daylight saving
/// time is refused unless the overlap covers the repeated hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_cursor_zone_pauses_by_name_and_a_daylight_saving_zone_needs_the_overlap() {
    async fn wrong_zone(tag: &str, writers: &str, configured: &str) -> String {
        let mut cluster = Cluster::new(tag).await;
        let writer = create_events(&cluster, writers, 100).await;
        cluster
            .start(&events_settings(&format!("cursor_time_zone = \"{configured}\"")))
            .await;
        cluster.spawn_worker(&format!("{tag}-w"), 2, &[]);
        cluster
            .wait_for("snapshot complete", Duration::from_secs(60), |t| {
                t.snapshot_complete || t.phase == "paused"
            })
            .await;
        let mut id = 5000;
        let paused = loop {
            let status = cluster.task_status().await;
            if status.phase == "paused" {
                break status;
            }
            write_events(&writer, id, 1).await;
            id += 1;
            assert!(id < 5100, "{tag}: no pause: {status:?}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        paused.paused_reason
    }
    let (ahead, below) = tokio::join!(
        wrong_zone("zone_ahead", "Asia/Kolkata", "UTC"),
        wrong_zone("zone_below", "America/Bogota", "Asia/Kolkata"),
    );
    assert!(
        ahead.starts_with("cursor values ahead of the source clock") && ahead.contains("cursor_time_zone"),
        "{ahead}"
    );
    assert!(
        below.starts_with("rows written below the watermark") && below.contains("cursor_time_zone"),
        "{below}"
    );

    let mut cluster = Cluster::new("zone_dst").await;
    create_events(&cluster, "Europe/Berlin", 10).await;
    let refused = cluster.refused_start(&events_settings("cursor_time_zone = \"Europe/Berlin\""));
    assert!(
        refused.contains("daylight saving time") && refused.contains("set overlap to at least 1h"),
        "{refused}"
    );
    cluster
        .start(&TaskSettings {
            overlap: "1h",
            ..events_settings("cursor_time_zone = \"Europe/Berlin\"")
        })
        .await;
}

/// S24: cursor values no window can hold. `'infinity'` and `'-infinity'` pause the task and
/// name the key; after the rows get real times and the task is resumed, every key converges.
/// A key or cursor column that loses its NOT NULL is a schema change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infinite_cursor_values_and_a_dropped_not_null_pause_by_name() {
    let mut cluster = Cluster::new("infinite").await;
    create_items(&cluster.source, KeyKind::Bigint, 300).await;
    cluster
        .start(&TaskSettings {
            shards: 2,
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("infinite-w", 2, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    for (id, value) in [(5, "infinity"), (6, "-infinity")] {
        cluster
            .source
            .exec(&format!(
                "UPDATE items SET name = 'odd', updated_at = '{value}' WHERE id = {id}"
            ))
            .await;
        let paused = cluster
            .wait_for("paused for an infinite cursor", Duration::from_secs(30), |t| {
                t.phase == "paused"
            })
            .await;
        assert!(
            paused.paused_reason.starts_with("impossible cursor value")
                && paused.paused_reason.contains(&format!("key ({id})"))
                && paused.paused_reason.contains(&format!("'{value}'")),
            "{}",
            paused.paused_reason
        );
        cluster
            .source
            .exec(&format!(
                "UPDATE items SET updated_at = clock_timestamp() WHERE id = {id}"
            ))
            .await;
        let resumed = cluster.cli_json(&["tasks", "resume", "items"]);
        assert_eq!(resumed["paused"], false, "{resumed}");
    }
    let end = cluster.source_now_micros().await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    cluster
        .items_diff()
        .await
        .assert_clean("after the infinite times were fixed");

    cluster
        .source
        .exec("ALTER TABLE items ALTER COLUMN updated_at DROP NOT NULL")
        .await;
    let paused = cluster
        .wait_for("paused for the dropped NOT NULL", Duration::from_secs(30), |t| {
            t.phase == "paused"
        })
        .await;
    assert!(
        paused.paused_reason.starts_with("schema changed")
            && paused.paused_reason.contains("reinitialization required"),
        "{}",
        paused.paused_reason
    );
}

/// S24: a batch that fails the same way every time (the target lost a column: not a row's
/// fault, so no dead letter) pauses its task with that error after `max_batch_failures`
/// runs, instead of being retried forever; after the fix and a resume, every key converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_failing_the_same_way_pauses_its_task_with_the_error() {
    let mut cluster = Cluster::new("failing").await;
    create_items(&cluster.source, KeyKind::Bigint, 300).await;
    cluster
        .start(&TaskSettings {
            shards: 1,
            extra: "max_batch_failures = 3".into(),
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("failing-w", 1, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(60), |t| t.snapshot_complete)
        .await;
    cluster.target.exec("ALTER TABLE items DROP COLUMN note").await;
    cluster
        .source
        .exec("UPDATE items SET note = 'changed', updated_at = clock_timestamp() WHERE id <= 10")
        .await;
    let paused = cluster
        .wait_for("paused after repeated failures", Duration::from_secs(60), |t| {
            t.phase == "paused"
        })
        .await;
    assert!(
        paused.paused_reason.starts_with("batch keeps failing")
            && paused.paused_reason.contains("3 times in a row")
            && paused.paused_reason.contains("note"),
        "{}",
        paused.paused_reason
    );
    cluster.target.exec("ALTER TABLE items ADD COLUMN note text").await;
    cluster.cli_json(&["tasks", "resume", "items"]);
    // The re-added column is empty: the keys the snapshot wrote lost their notes, and only a
    // reconciliation (content) brings them back.
    let end = cluster.source_now_micros().await;
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    let run = cluster.reconcile(&["--full"]);
    assert!(run["keys_repaired"].as_u64().unwrap() > 0, "{run}");
    cluster.items_diff().await.assert_clean("after the column came back");
}

/// DDL holding the source table past the session's `lock_timeout` refuses a page's COPY before
/// it starts. The error is retried, and the pooled session it ran on must not answer the next
/// statements with the replies of earlier ones (sqlx leaves such a session one reply behind:
/// `no rows returned`, an empty list, or another statement's rows). The session is closed;
/// the next statements on the pool get their own answers, the next page its rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_refused_by_a_lock_timeout_leaves_no_session_out_of_step() {
    use tidemark_common::copy_format::CopyFormat;
    use tidemark_common::pg::TableName;
    use tidemark_common::pg::connector::PgSource;
    use tidemark_common::source::{PageRequest, Source};

    let db = TestDb::create("copy_lock").await;
    db.exec("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a'), (2, 'b'), (3, 'c')")
        .await;
    // One session, so every statement below runs where the refused COPY ran.
    let pool = tidemark_common::pg::guarded_pool(&db.url, "copy-lock-test", 1, Duration::from_secs(1)).unwrap();
    let source = PgSource { pool: pool.clone() };
    let table = TableName::parse("t").unwrap();
    let page = || PageRequest {
        format: CopyFormat::Text,
        field_types: &[],
    };
    let statement = "COPY (SELECT id, v FROM t ORDER BY id) TO STDOUT";
    // The session exists and has prepared statements before the refusal.
    assert!(source.now_micros().await.unwrap() > 0);

    let mut ddl = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *ddl)
        .await
        .unwrap();
    let refused = source.read_copy(statement, &table, page()).await.unwrap_err();
    assert!(
        matches!(&refused, sqlx::Error::Database(e) if e.code().as_deref() == Some("55P03")),
        "{refused}"
    );
    ddl.commit().await.unwrap();

    let row: (i32, String) = sqlx::query_as("SELECT id, v FROM t WHERE id = 2")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(row, (2, "b".to_string()));
    let ids: Vec<i32> = sqlx::query_scalar("SELECT id FROM t WHERE id >= 2 ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids, vec![2, 3]);
    let page = source.read_copy(statement, &table, page()).await.unwrap();
    assert_eq!(&page.data[..], b"1\ta\n2\tb\n3\tc\n");
    let columns: Vec<String> = page.types.unwrap().into_iter().map(|(name, _, _)| name).collect();
    assert_eq!(columns, vec!["id".to_string(), "v".to_string()]);
    pool.close().await;
}

/// S24's probe runs every poll interval for each task. It must read an index on the cursor
/// even while the table has no statistics (a bulk load just ended, autovacuum is off): a
/// filter for the infinite values under `LIMIT 1` was planned as a sequential scan expected
/// to stop early, and read the whole table each round, because no row matches. It still finds
/// `'-infinity'` and `'infinity'` by key, and the newest finite time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_infinite_cursor_probe_reads_an_index_without_statistics() {
    use tidemark_common::pg::connector::PgSource;
    use tidemark_common::source::Source;

    let db = TestDb::create("extremes").await;
    create_items(&db, KeyKind::Bigint, 50_000).await;
    let reltuples: f32 = sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE oid = 'items'::regclass")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(reltuples, -1.0, "the table has no statistics yet");
    let columns = [("id", "bigint"), ("updated_at", "timestamp(3) with time zone")];
    let columns: Vec<(String, String)> = columns.iter().map(|(n, t)| (n.to_string(), t.to_string())).collect();
    let sql = tidemark_tests::cursor_table_sql("public.items", &columns, &["id"]);
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (FORMAT JSON) {}",
        sql.cursor_extremes()
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let plan = plan.to_string();
    assert!(!plan.contains("Seq Scan"), "{plan}");
    assert!(plan.contains("items_cursor"), "{plan}");

    let source = PgSource { pool: db.pool.clone() };
    let newest: i64 = sqlx::query_scalar("SELECT (extract(epoch from max(updated_at)) * 1000000)::bigint FROM items")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(source.cursor_extremes(&sql).await.unwrap(), Some((None, Some(newest))));
    db.exec("UPDATE items SET updated_at = '-infinity' WHERE id = 5").await;
    assert_eq!(
        source.cursor_extremes(&sql).await.unwrap(),
        Some((Some(vec!["5".to_string(), "-infinity".to_string()]), Some(newest)))
    );
    db.exec("UPDATE items SET updated_at = 'infinity' WHERE id = 6").await;
    let (infinite, _) = source.cursor_extremes(&sql).await.unwrap().unwrap();
    assert_eq!(infinite, Some(vec!["6".to_string(), "infinity".to_string()]));
    db.exec("UPDATE items SET updated_at = now() WHERE id IN (5, 6)").await;
    let (infinite, after) = source.cursor_extremes(&sql).await.unwrap().unwrap();
    assert_eq!(infinite, None);
    assert!(after.unwrap() > newest);
}
