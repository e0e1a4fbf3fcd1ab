//! The guarantee under the source's own semantics (fault matrix S16–S19, S24): who the
//! open-transaction bound can see, what a naive timestamp means, session formats, and cursor
//! values no window can hold. Each case ends with the target right per key, or the task
//! refused or paused with a reason that names the fix.
//! Boundary: everything committed in the source before the watermark; delete policy: none.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tidemark_tests::{Cluster, TaskSettings, compare_table};

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
