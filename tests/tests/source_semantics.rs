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
