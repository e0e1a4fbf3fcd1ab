//! MariaDB as a target: MariaDB → MariaDB and PostgreSQL → MariaDB in upsert, append and
//! accumulate modes, with the batch protocol unchanged (staging, register, one InnoDB
//! transaction with the ledger row, verify, CAS). Each source and target is written by a
//! production-like account (the grants the README lists). Boundary: everything committed
//! before the watermark; deletes: none (the deletes suite in `deletes.rs` runs on MariaDB too). Every
//! comparison is per key: each column rendered as text by each side's own functions, and the
//! version.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use sqlx::Row;
use tidemark_common::copy_format::CopyFormat;
use tidemark_common::mysql::target as mysql_target;
use tidemark_common::pg::{Column, Read, TableName, TableSql};
use tidemark_tests::mariadb::{ITEMS_TABLE, MariaDb, MariaUser, items_insert, reader_source, writer_target};
use tidemark_tests::{Cluster, KeyKind, TaskSettings, create_items};

async fn mariadb_now(db: &MariaDb) -> i64 {
    sqlx::query_scalar("SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS SIGNED)")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// A key's columns as one text and its version.
type Rendered = (String, i64);

/// The same rendering on both sides (both are MariaDB): the target's `updated_at` holds the
/// source `TIMESTAMP`'s UTC time, both sessions are in UTC.
async fn mariadb_rows(db: &MariaDb, version: &str) -> BTreeMap<i64, Rendered> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id, CONCAT_WS('|', IF(flag, 't', 'f'), CAST(amount AS CHAR), CAST(big AS CHAR), \
         IFNULL(DATE_FORMAT(happened, '%Y-%m-%d %H:%i:%s.%f'), 'NULL'), IFNULL(note, 'NULL'), IFNULL(latin, 'NULL'), \
         IFNULL(LOWER(HEX(raw)), 'NULL'), kind, IFNULL(doc, 'NULL'), DATE_FORMAT(updated_at, '%Y-%m-%d %H:%i:%s.%f')), \
         CAST({version} AS SIGNED) FROM items"
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|row| (row.get(0), (row.get(1), row.get(2))))
    .collect()
}

/// `key, row text, version` rows as a map from the key, on either engine.
async fn keyed<DB, K>(pool: &sqlx::Pool<DB>, sql: &'static str) -> BTreeMap<K, Rendered>
where
    DB: sqlx::Database,
    K: Ord + Send + Unpin,
    (K, String, i64): for<'r> sqlx::FromRow<'r, DB::Row>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::query_as::<DB, (K, String, i64)>(sql)
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(key, row, version)| (key, (row, version)))
        .collect()
}

fn differences<K: Ord + std::fmt::Debug + Clone, V: PartialEq + std::fmt::Debug>(
    expected: &BTreeMap<K, V>,
    actual: &BTreeMap<K, V>,
) -> Option<String> {
    let missing: Vec<&K> = expected.keys().filter(|k| !actual.contains_key(k)).collect();
    let phantom: Vec<&K> = actual.keys().filter(|k| !expected.contains_key(k)).collect();
    let wrong: Vec<(&K, &V, &V)> = expected
        .iter()
        .filter_map(|(k, e)| actual.get(k).filter(|a| *a != e).map(|a| (k, e, a)))
        .collect();
    if missing.is_empty() && phantom.is_empty() && wrong.is_empty() {
        return None;
    }
    Some(format!(
        "{} missing (e.g. {:?}), {} phantom (e.g. {:?}), {} differ (e.g. {:?})",
        missing.len(),
        missing.iter().take(3).collect::<Vec<_>>(),
        phantom.len(),
        phantom.iter().take(3).collect::<Vec<_>>(),
        wrong.len(),
        wrong.iter().take(2).collect::<Vec<_>>()
    ))
}

async fn assert_mariadb_converged(source: &MariaDb, target: &MariaDb, context: &str) {
    let expected = mariadb_rows(source, "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated_at)").await;
    let actual = mariadb_rows(target, "_tidemark_version").await;
    assert!(expected.len() >= 1000, "{context}: {} source rows", expected.len());
    if let Some(diff) = differences(&expected, &actual) {
        panic!("{context}: {diff}");
    }
}

/// MariaDB → MariaDB, upsert: a table of many types, snapshot then incremental, a writer
/// that commits late, two workers; every key equal in every column and version. The target
/// table is created by Tidemark in the mapped types (`BIGINT UNSIGNED` as `DECIMAL(20,0)`,
/// `ENUM` as text, `TIMESTAMP` as its UTC `DATETIME`), the ledger row of every batch is in
/// the target, and a second look finds nothing left to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_to_mariadb_upserts_per_key() {
    let (source, reader) = reader_source("mt_src").await;
    let (target, writer) = writer_target("mt_dst").await;
    source.exec(ITEMS_TABLE).await;
    source.exec(&items_insert(1, 12_000)).await;
    source
        .exec("SET SESSION sql_mode = ''; UPDATE items SET happened = '0000-00-00 00:00:00' WHERE id = 78")
        .await;
    let mut cluster = Cluster::new("mt_sync").await;
    cluster
        .start(&TaskSettings {
            source_url: source.url_as(&reader.name, &reader.password),
            target_url: target.url_as(&writer.name, &writer.password),
            source_table: "items".into(),
            target_table: "items".into(),
            shards: 4,
            page_size: 1500,
            overlap: "1s",
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("a", 2, &[]);
    cluster.spawn_worker("b", 2, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(180), |t| t.snapshot_complete)
        .await;
    assert_mariadb_converged(&source, &target, "after the snapshot").await;

    let mut late = source.pool.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut *late).await.unwrap();
    sqlx::raw_sql("UPDATE items SET note = 'committed late' WHERE id = 5")
        .execute(&mut *late)
        .await
        .unwrap();
    source
        .exec("UPDATE items SET amount = amount + 1, note = CONCAT(note, ' u') WHERE id BETWEEN 10 AND 20000 AND id % 10 = 0")
        .await;
    source.exec(&items_insert(12_001, 13_000)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    sqlx::raw_sql("COMMIT").execute(&mut *late).await.unwrap();
    drop(late);
    let end = mariadb_now(&source).await;
    cluster.wait_for_watermark(end, Duration::from_secs(120)).await;
    assert_mariadb_converged(&source, &target, "after updates, inserts and a late commit").await;
    let note: String = sqlx::query_scalar("SELECT note FROM items WHERE id = 5")
        .fetch_one(&target.pool)
        .await
        .unwrap();
    assert_eq!(note, "committed late");

    let types: BTreeMap<String, String> = sqlx::query_as(
        "SELECT CAST(column_name AS CHAR), CAST(column_type AS CHAR) FROM information_schema.columns \
         WHERE table_schema = DATABASE() AND table_name = 'items'",
    )
    .fetch_all(&target.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(types["big"], "decimal(20,0)");
    assert_eq!(types["flag"], "tinyint(1)");
    assert_eq!(types["updated_at"], "datetime(6)");
    assert_eq!(types["_tidemark_version"], "bigint(20)");
    let (batches, rows): (i64, i64) =
        sqlx::query_as("SELECT CAST(COUNT(*) AS SIGNED), CAST(SUM(row_count) AS SIGNED) FROM tidemark_ledger")
            .fetch_one(&target.pool)
            .await
            .unwrap();
    assert!(batches >= 8 && rows >= 13_000, "ledger: {batches} batches, {rows} rows");
}

/// PostgreSQL → MariaDB, upsert: text keys that differ only in case, accents or a trailing
/// space stay distinct keys (the target table compares bytes without padding); booleans,
/// numerics, instants, bytes, JSON and an array arrive per key; values MariaDB refuses
/// (an infinite instant, a numeric NaN, a text longer than the column an operator made
/// narrower) become dead letters naming their keys, in the target, while the rest of their
/// batches commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_to_mariadb_keeps_text_keys_apart_and_dead_letters_what_it_refuses() {
    let (target, writer) = writer_target("pm_dst").await;
    let mut cluster = Cluster::new("pm_sync").await;
    cluster
        .source
        .exec(
            "CREATE TABLE codes (code text PRIMARY KEY, flag boolean NOT NULL, amount numeric(12,2), \
             at timestamptz, raw bytea, doc jsonb, tags integer[], note text NOT NULL, \
             updated_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        )
        .await;
    cluster
        .source
        .exec(
            "INSERT INTO codes (code, flag, amount, at, raw, doc, tags, note) \
             SELECT (ARRAY['a', 'A', 'é', 'e'])[1 + i % 4] || (i / 8)::text || (ARRAY['', ' '])[1 + (i / 4) % 2], \
             i % 3 = 0, i * 1.25, timestamptz '2024-01-01 00:00:00+00' + i * interval '1 minute 0.5 second', \
             decode(md5(i::text), 'hex'), jsonb_build_object('i', i, 's', 'x\"y'), ARRAY[i, i + 1], \
             'note ' || i || ' 🦀 it''s \\ ' || repeat('z', i % 3) FROM generate_series(1, 5000) i",
        )
        .await;
    // An operator's narrower column: longer notes are refused by the target.
    target
        .exec(
            "CREATE TABLE codes (code VARCHAR(768) NOT NULL PRIMARY KEY, flag TINYINT(1) NOT NULL, \
             amount DECIMAL(12,2), at DATETIME(6), raw LONGBLOB, doc JSON, tags LONGTEXT, note VARCHAR(40) NOT NULL, \
             updated_at DATETIME(6) NOT NULL, _tidemark_version BIGINT NOT NULL) \
             DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin",
        )
        .await;
    cluster
        .source
        .exec(
            "UPDATE codes SET at = 'infinity' WHERE code = 'a12'; UPDATE codes SET note = repeat('long', 20) \
             WHERE code = 'A20'",
        )
        .await;
    cluster
        .start(&TaskSettings {
            target_url: target.url_as(&writer.name, &writer.password),
            source_table: "public.codes".into(),
            target_table: "codes".into(),
            key: vec!["code".into()],
            shards: 3,
            page_size: 700,
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("a", 3, &[]);
    cluster
        .wait_for("snapshot complete", Duration::from_secs(180), |t| t.snapshot_complete)
        .await;
    cluster
        .source
        .exec(
            "UPDATE codes SET note = note || ' v2', flag = NOT flag, updated_at = clock_timestamp() \
             WHERE length(code) % 2 = 0; UPDATE codes SET amount = 'NaN', updated_at = clock_timestamp() \
             WHERE code = 'e30'",
        )
        .await;
    let end: i64 = sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&cluster.source.pool)
        .await
        .unwrap();
    cluster.wait_for_watermark(end, Duration::from_secs(120)).await;

    let letters: BTreeMap<String, String> =
        sqlx::query_as("SELECT `key`, error_class FROM tidemark_dead_letters WHERE task = 'items'")
            .fetch_all(&target.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let bad = ["a12", "A20", "e30"];
    assert_eq!(
        letters.keys().map(String::as_str).collect::<Vec<_>>(),
        {
            let mut keys = bad.to_vec();
            keys.sort();
            keys
        },
        "dead letters: {letters:?}"
    );
    let mut expected: BTreeMap<String, Rendered> = sqlx::query(
        "SELECT code, concat_ws('|', CASE WHEN flag THEN 't' ELSE 'f' END, coalesce(amount::text, 'NULL'), \
         coalesce(to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US'), 'NULL'), coalesce(encode(raw, 'hex'), 'NULL'), \
         coalesce(doc::text, 'NULL'), coalesce(tags::text, 'NULL'), note, \
         to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')), \
         (extract(epoch from updated_at) * 1000000)::bigint FROM codes",
    )
    .fetch_all(&cluster.source.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|row| (row.get(0), (row.get(1), row.get(2))))
    .collect();
    let actual: BTreeMap<String, Rendered> = sqlx::query(
        "SELECT code, CONCAT_WS('|', IF(flag, 't', 'f'), IFNULL(CAST(amount AS CHAR), 'NULL'), \
         IFNULL(DATE_FORMAT(at, '%Y-%m-%d %H:%i:%s.%f'), 'NULL'), IFNULL(LOWER(HEX(raw)), 'NULL'), \
         IFNULL(doc COLLATE utf8mb4_nopad_bin, 'NULL'), IFNULL(tags, 'NULL'), note, DATE_FORMAT(updated_at, '%Y-%m-%d %H:%i:%s.%f')), _tidemark_version FROM codes",
    )
    .fetch_all(&target.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|row| (row.get(0), (row.get(1), row.get(2))))
    .collect();
    // A dead letter's key keeps the version before its refused change, or is absent (its
    // first version was refused): compared apart.
    for key in ["a12", "A20"] {
        expected.remove(key);
        assert!(!actual.contains_key(key), "{key} was refused from the start");
    }
    let e30 = expected.remove("e30").unwrap();
    let held = actual.get("e30").expect("e30 stays at its last accepted version");
    assert!(held.1 < e30.1 && !held.0.contains("NaN"), "{held:?} vs {e30:?}");
    let mut actual = actual;
    actual.remove("e30");
    assert_eq!(expected.len(), 4997);
    if let Some(diff) = differences(&expected, &actual) {
        panic!("per key: {diff}");
    }
    for (a, b) in [("a1", "A1"), ("a1", "a1 "), ("é1", "e1")] {
        assert!(
            actual.contains_key(a) && actual.contains_key(b),
            "{a:?} and {b:?} are distinct keys"
        );
    }
}

/// MariaDB → MariaDB, accumulate (seed 003's job: `app_count = app_count + VALUES(app_count)`
/// per exploded app name): a worker killed inside the apply transaction, then a second one;
/// every count exact and unchanged by later rounds of replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_003_accumulates_into_mariadb_counting_each_row_once() {
    let (source, reader) = reader_source("ma_src").await;
    let (target, writer) = writer_target("ma_dst").await;
    source
        .exec("CREATE TABLE events (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, type INT NOT NULL, event TEXT)")
        .await;
    let insert = |from: i64, to: i64| {
        format!(
            "INSERT INTO events (type, event) SELECT IF(seq % 10 = 0, 3, 5), \
             JSON_OBJECT('apps', JSON_ARRAY(JSON_OBJECT('name', CONCAT('app-', seq % 13)), \
                                            JSON_OBJECT('name', CONCAT('app-', seq % 7)))) FROM seq_{from}_to_{to}"
        )
    };
    source.exec(&insert(1, 8000)).await;
    let mut cluster = Cluster::new("ma_sync").await;
    let base = TaskSettings {
        source_url: source.url_as(&reader.name, &reader.password),
        target_url: target.url_as(&writer.name, &writer.password),
        source_table: "events".into(),
        cursor_column: String::new(),
        page_size: 1000,
        shards: 2,
        ..TaskSettings::default()
    };
    cluster
        .start(&TaskSettings {
            target_table: "app_stat".into(),
            extra: "mode = \"accumulate\"\nfilter = \"type = 5\"\n\
                    transform = { explode = \"$.apps[*].name\", from = \"event\", as = \"app_name\" }\n\
                    group_by = [\"app_name\"]\naggregates = { app_count = \"count\" }"
                .into(),
            ..base.clone()
        })
        .await;
    let crasher = cluster.spawn_worker("in-apply", 4, &[("TIDEMARK_CRASH_AT", "in_apply:3")]);
    assert!(
        cluster.workers[crasher].wait_exit(Duration::from_secs(60)).is_some(),
        "crashed in apply"
    );
    cluster.spawn_worker("b", 4, &[]);
    source.exec(&insert(8001, 9000)).await;
    let expected: BTreeMap<String, i64> = sqlx::query_as(
        "SELECT jt.name, COUNT(*) FROM events, JSON_TABLE(event, '$.apps[*]' COLUMNS (name VARCHAR(50) PATH '$.name')) jt \
         WHERE type = 5 GROUP BY jt.name",
    )
    .fetch_all(&source.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(expected.len(), 13);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let counts: BTreeMap<String, i64> = sqlx::query_as("SELECT app_name, CAST(app_count AS SIGNED) FROM app_stat")
            .fetch_all(&target.pool)
            .await
            .unwrap_or_default()
            .into_iter()
            .collect();
        if counts == expected {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let again: BTreeMap<String, i64> =
                sqlx::query_as("SELECT app_name, CAST(app_count AS SIGNED) FROM app_stat")
                    .fetch_all(&target.pool)
                    .await
                    .unwrap()
                    .into_iter()
                    .collect();
            assert_eq!(again, expected, "counts changed after they were exact");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "per app, expected {expected:?}, target {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// PostgreSQL → MariaDB, append: rows paged by key alone arrive per key while more are
/// inserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_appends_into_mariadb_per_key() {
    let (target, writer) = writer_target("pa_dst").await;
    let mut cluster = Cluster::new("pa_sync").await;
    cluster
        .source
        .exec(
            "CREATE TABLE events (id bigserial PRIMARY KEY, payload text NOT NULL); \
             INSERT INTO events (payload) SELECT 'event ' || i FROM generate_series(1, 6000) i",
        )
        .await;
    cluster
        .start(&TaskSettings {
            target_url: target.url_as(&writer.name, &writer.password),
            source_table: "public.events".into(),
            target_table: "events".into(),
            cursor_column: String::new(),
            extra: "mode = \"append\"".into(),
            shards: 2,
            page_size: 800,
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("a", 2, &[]);
    cluster
        .source
        .exec("INSERT INTO events (payload) SELECT 'later ' || i FROM generate_series(1, 2000) i")
        .await;
    let expected: BTreeMap<i64, String> = sqlx::query_as("SELECT id, payload FROM events")
        .fetch_all(&cluster.source.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let actual: BTreeMap<i64, String> = sqlx::query_as("SELECT id, payload FROM events")
            .fetch_all(&target.pool)
            .await
            .unwrap_or_default()
            .into_iter()
            .collect();
        match differences(&expected, &actual) {
            None => break,
            Some(diff) => assert!(Instant::now() < deadline, "append: {diff}"),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The versioned upsert on MariaDB itself, under concurrency: four sessions write every
/// version 1..=40 of the same 500 keys in shuffled orders, each version a multi-row statement
/// in its own transaction. Whatever the interleaving, each key ends at version 40 with
/// version 40's value: an older version never overwrites a newer one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_versioned_upsert_holds_under_concurrent_writers_on_mariadb() {
    let target = MariaDb::create("mt_guard").await;
    let sql = TableSql {
        source: TableName::parse("src.items").unwrap(),
        target: TableName {
            schema: target.name.clone(),
            name: "items".into(),
        },
        columns: ["id", "name", "qty"]
            .iter()
            .zip(["bigint", "text", "integer"])
            .map(|(n, t)| Column {
                name: n.to_string(),
                sql_type: t.to_string(),
            })
            .collect(),
        key_columns: vec!["id".into()],
        cursor_column: None,
        version_column: Some("qty".into()),
        deletes: None,
        filter: None,
        page_format: CopyFormat::Text,
        cursor_zone: None,
    };
    target
        .exec(&mysql_target::create_target_table(
            &sql,
            &[true, true, true],
            "utf8mb4_nopad_bin",
        ))
        .await;
    let mut writers = Vec::new();
    for writer in 0..4u64 {
        let url = target.url.clone();
        let sql = sql.clone();
        writers.push(tokio::spawn(async move {
            let pool = tidemark_common::mysql::target_pool(&url, 1, 10).unwrap();
            let mut versions: Vec<i64> = (1..=40).collect();
            // A fixed shuffle per writer (no two alike).
            let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ writer;
            for i in (1..versions.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                versions.swap(i, (state % (i as u64 + 1)) as usize);
            }
            for version in versions {
                let lines: Vec<String> = (1..=500)
                    .map(|id| format!("{id}\tname {id} v{version} by {writer}\t{version}\t{version}"))
                    .collect();
                let rows: Vec<&[u8]> = lines.iter().map(|l| l.as_bytes()).collect();
                let mut tx = pool.begin().await.unwrap();
                for statement in mysql_target::upsert_statements(&sql, true, &rows, Read::Latest).unwrap() {
                    loop {
                        match sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone()))
                            .execute(&mut *tx)
                            .await
                        {
                            Ok(_) => break,
                            // A deadlock rolls the transaction back: the next version retries.
                            Err(e) if tidemark_common::mysql::is_transient(&e) => {
                                tx = pool.begin().await.unwrap();
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                tx.commit().await.unwrap();
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let rows: Vec<(i64, String, i32, i64)> =
        sqlx::query_as("SELECT id, name, qty, _tidemark_version FROM items ORDER BY id")
            .fetch_all(&target.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 500);
    for (id, name, qty, version) in rows {
        assert_eq!((qty, version), (40, 40), "key {id}");
        assert!(name.starts_with(&format!("name {id} v40 by ")), "key {id}: {name}");
    }
}

/// A content reconciliation into a MySQL target covers the column types both engines hash
/// alike; a task that configures one over a column of another type (here jsonb) is refused
/// at start, naming the column, before anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_target_refuses_content_reconciliation_by_name() {
    let (target, writer) = writer_target("mt_refuse").await;
    let mut cluster = Cluster::new("mt_refuse").await;
    create_items(&cluster.source, KeyKind::Bigint, 10).await;
    let log = cluster.refused_start(&TaskSettings {
        target_url: target.url_as(&writer.name, &writer.password),
        target_table: "items".into(),
        extra: "delete_policy = { kind = \"reconcile\" }\nreconcile_compare = \"content\"".into(),
        ..TaskSettings::default()
    });
    assert!(
        log.contains("reconcile_compare = \"content\": column \"payload\" (jsonb) has no content hash both engines")
            && log.contains("reconcile_compare = \"versions\""),
        "{log}"
    );
}

/// PostgreSQL → MariaDB, reconciliation (versions; D = reconcile): 40 hard deletes in the
/// source, 10 rows deleted and 10 set to an older version in the target, and 5 backdated
/// source updates that incremental cannot see (their version is below the target's) are all
/// found by the hash both engines compute alike and repaired: per key, name and version.
/// A second run reads no row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_repairs_drift_in_a_mariadb_target() {
    let (target, writer) = writer_target("mr_dst").await;
    let mut cluster = Cluster::new("mr_sync").await;
    cluster
        .source
        .exec(
            "CREATE TABLE items (id bigint PRIMARY KEY, name text NOT NULL, updated_at timestamptz NOT NULL); \
             INSERT INTO items SELECT i, 'item ' || i, now() - interval '1 hour' + i * interval '1 ms' \
             FROM generate_series(1, 6000) i",
        )
        .await;
    cluster
        .start(&TaskSettings {
            target_url: target.url_as(&writer.name, &writer.password),
            target_table: "items".into(),
            shards: 3,
            page_size: 1000,
            extra: "delete_policy = { kind = \"reconcile\" }\nreconcile_compare = \"versions\"".into(),
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("a", 3, &[]);
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&cluster.source.pool)
        .await
        .unwrap();
    cluster.wait_for_watermark(now, Duration::from_secs(120)).await;
    cluster
        .source
        .exec(
            "DELETE FROM items WHERE id BETWEEN 3001 AND 3040; \
             UPDATE items SET name = 'backdated ' || id, updated_at = updated_at - interval '10 minutes' \
             WHERE id IN (11, 1234, 2500, 3999, 4321)",
        )
        .await;
    target
        .exec(
            "DELETE FROM items WHERE id BETWEEN 1001 AND 1010; \
             UPDATE items SET name = 'stale', _tidemark_version = 1 WHERE id BETWEEN 2001 AND 2010",
        )
        .await;
    let end: i64 = sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&cluster.source.pool)
        .await
        .unwrap();
    cluster.wait_for_watermark(end, Duration::from_secs(60)).await;
    let backdated: String = sqlx::query_scalar("SELECT name FROM items WHERE id = 1234")
        .fetch_one(&target.pool)
        .await
        .unwrap();
    assert_eq!(backdated, "item 1234", "incremental cannot see a backdated update");
    let run = cluster.reconcile(&["--full"]);
    assert!(run["finished"].as_bool().unwrap(), "{run}");
    assert_eq!(run["keys_repaired"].as_u64().unwrap(), 65, "{run}");
    let expected: BTreeMap<i64, Rendered> = keyed(
        &cluster.source.pool,
        "SELECT id, name, (extract(epoch from updated_at) * 1000000)::bigint FROM items",
    )
    .await;
    let actual: BTreeMap<i64, Rendered> = keyed(&target.pool, "SELECT id, name, _tidemark_version FROM items").await;
    assert_eq!(expected.len(), 5960);
    if let Some(diff) = differences(&expected, &actual) {
        panic!("after the reconciliation: {diff}");
    }
    let again = cluster.reconcile(&["--full"]);
    assert_eq!(
        (again["keys_repaired"].as_u64(), again["rows_read"].as_u64()),
        (Some(0), Some(0)),
        "{again}"
    );
}

/// The dead-letter commands on a MariaDB target: names too long for an operator's narrower
/// column are dead letters (`list` shows their COPY lines); the operator widens the column,
/// and `retry` writes them, each in one transaction with its RESOLVED status, except the one
/// still too long, which goes to RETRY with its error; `resolve` and `purge` act on exactly
/// the named and the RESOLVED letters. Per key, the target then equals the source but for
/// the key still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_retried_resolved_and_purged_in_a_mariadb_target() {
    let (target, writer) = writer_target("md_dst").await;
    let mut cluster = Cluster::new("md_sync").await;
    cluster
        .source
        .exec(
            "CREATE TABLE items (id bigint PRIMARY KEY, name text NOT NULL, updated_at timestamptz NOT NULL); \
             INSERT INTO items SELECT i, CASE WHEN i % 500 = 0 THEN repeat('long', 8) || i ELSE 'item ' || i END, \
             now() - interval '1 hour' + i * interval '1 ms' FROM generate_series(1, 3000) i; \
             UPDATE items SET name = repeat('x', 100) WHERE id = 1500",
        )
        .await;
    target
        .exec(
            "CREATE TABLE items (id BIGINT NOT NULL PRIMARY KEY, name VARCHAR(20) NOT NULL, updated_at DATETIME(6) NOT NULL, \
             _tidemark_version BIGINT NOT NULL) DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_nopad_bin",
        )
        .await;
    cluster
        .start(&TaskSettings {
            target_url: target.url_as(&writer.name, &writer.password),
            target_table: "items".into(),
            shards: 2,
            page_size: 500,
            ..TaskSettings::default()
        })
        .await;
    cluster.spawn_worker("a", 2, &[]);
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(&cluster.source.pool)
        .await
        .unwrap();
    cluster.wait_for_watermark(now, Duration::from_secs(120)).await;
    let bad: Vec<String> = (1..=6).map(|i| (i * 500).to_string()).collect();
    let listed = cluster.cli_json(&["dead-letters", "list", "--task", "items"]);
    let keys: Vec<&str> = listed["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    let mut sorted_bad: Vec<&str> = bad.iter().map(String::as_str).collect();
    sorted_bad.sort();
    assert_eq!(keys, sorted_bad, "{listed}");
    let first = &listed["dead_letters"][0];
    assert_eq!(
        first["error_class"].as_str(),
        Some("string_data_right_truncation"),
        "{first}"
    );
    assert!(first["payload"].as_str().unwrap().starts_with("1000\tlong"), "{first}");

    target.exec("ALTER TABLE items MODIFY name VARCHAR(60) NOT NULL").await;
    let result = cluster.cli_json(&["dead-letters", "retry", "--task", "items"]);
    assert_eq!(
        (result["resolved"].as_u64(), result["retry"].as_u64()),
        (Some(5), Some(1)),
        "{result}"
    );
    let statuses: BTreeMap<String, (String, i32)> =
        sqlx::query_as("SELECT `key`, status, retry_count FROM tidemark_dead_letters WHERE task = 'items'")
            .fetch_all(&target.pool)
            .await
            .unwrap()
            .into_iter()
            .map(|(k, s, c): (String, String, i32)| (k, (s, c)))
            .collect();
    for key in &bad {
        let expected = if key == "1500" { ("RETRY", 1) } else { ("RESOLVED", 0) };
        assert_eq!(
            (statuses[key].0.as_str(), statuses[key].1),
            expected,
            "key {key}: {statuses:?}"
        );
    }
    let expected: BTreeMap<i64, Rendered> = keyed(
        &cluster.source.pool,
        "SELECT id, name, (extract(epoch from updated_at) * 1000000)::bigint FROM items WHERE id <> 1500",
    )
    .await;
    let actual: BTreeMap<i64, Rendered> = keyed(&target.pool, "SELECT id, name, _tidemark_version FROM items").await;
    if let Some(diff) = differences(&expected, &actual) {
        panic!("after the retry: {diff}");
    }

    let kept = cluster.cli_json(&["dead-letters", "purge", "--task", "items", "--older-than", "1h"]);
    assert_eq!(kept["purged"].as_u64(), Some(0), "{kept}");
    let purged = cluster.cli_json(&["dead-letters", "purge", "--task", "items", "--older-than", "0s"]);
    assert_eq!(purged["purged"].as_u64(), Some(5), "{purged}");
    let resolved = cluster.cli_json(&["dead-letters", "resolve", "--task", "items", "--key", "1500"]);
    assert_eq!(resolved["resolved"].as_u64(), Some(1), "{resolved}");
    let left: Vec<(String, String)> =
        sqlx::query_as("SELECT `key`, status FROM tidemark_dead_letters WHERE task = 'items'")
            .fetch_all(&target.pool)
            .await
            .unwrap();
    assert_eq!(left, vec![("1500".to_string(), "RESOLVED".to_string())]);
}

/// PostgreSQL `items (id, name, updated_at)` with `rows` rows syncing into a MariaDB target
/// on the writer account (two shards, one worker), its watermark past the snapshot.
async fn pg_items_into_mariadb(cluster: &mut Cluster, target: &MariaDb, writer: &MariaUser, rows: i64, extra: &str) {
    let settings = TaskSettings {
        extra: extra.into(),
        ..TaskSettings::default()
    };
    pg_items_into_mariadb_with(cluster, target, writer, rows, settings, 2).await;
}

/// [`pg_items_into_mariadb`] with more settings (the target, table, shards and page size are
/// its own) and a worker of `max_shards`.
async fn pg_items_into_mariadb_with(
    cluster: &mut Cluster,
    target: &MariaDb,
    writer: &MariaUser,
    rows: i64,
    settings: TaskSettings,
    max_shards: u32,
) {
    cluster
        .source
        .exec(&format!(
            "CREATE TABLE items (id bigint PRIMARY KEY, name text NOT NULL, updated_at timestamptz NOT NULL); \
             INSERT INTO items SELECT i, 'item ' || i, now() - interval '1 hour' + i * interval '1 ms' \
             FROM generate_series(1, {rows}) i"
        ))
        .await;
    cluster
        .start(&TaskSettings {
            target_url: target.url_as(&writer.name, &writer.password),
            target_table: "items".into(),
            shards: 2,
            page_size: 500,
            ..settings
        })
        .await;
    cluster.spawn_worker("a", max_shards, &[]);
    let now = cluster.source_now_micros().await;
    cluster.wait_for_watermark(now, Duration::from_secs(60)).await;
}

/// `tasks reinit` on a MariaDB target after the source gained a column: epoch 2 builds in a
/// table beside the live one with the column in its mapped type (the README's grants: ALTER
/// and DROP for the table beside and the rename), is validated, and one RENAME TABLE makes it
/// live; every key carries the new column's value and version, and epoch 1's table is
/// retained beside; the live table's index and comment are on the new one. A reader querying
/// the table in a loop meanwhile sees every key in every read, never an error or an empty
/// table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reinit_builds_a_new_source_column_beside_in_a_mariadb_target() {
    let (target, writer) = writer_target("mi_dst").await;
    let mut cluster = Cluster::new("mi_sync").await;
    pg_items_into_mariadb(&mut cluster, &target, &writer, 2000, "").await;
    target
        .exec("CREATE INDEX items_name ON items (name(40)); ALTER TABLE items COMMENT = 'synced by tidemark'")
        .await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let url = target.url.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(1)
                .connect(&url)
                .await
                .unwrap();
            let mut reads = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let read: (i64, i64) =
                    sqlx::query_as("SELECT CAST(COUNT(*) AS SIGNED), CAST(COALESCE(SUM(id), 0) AS SIGNED) FROM items")
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                reads.push(read);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            reads
        })
    };
    cluster
        .source
        .exec(
            "ALTER TABLE items ADD COLUMN color text DEFAULT 'red'; \
             UPDATE items SET color = 'blue', updated_at = clock_timestamp() WHERE id % 10 = 0",
        )
        .await;
    let reinit = cluster.cli_json(&["tasks", "reinit", "items"]);
    assert_eq!(reinit["epoch"].as_u64(), Some(2), "{reinit}");
    assert_eq!(
        reinit["target_changes"],
        serde_json::json!([
            format!("CREATE TABLE `{}`.`items__tm_e2`", target.name),
            format!(
                "after the snapshot: ALTER TABLE `{}`.`items__tm_e2` ADD INDEX `items_name` (`name`(40))",
                target.name
            )
        ]),
        "{reinit}"
    );
    let now = cluster.source_now_micros().await;
    cluster
        .wait_for("epoch 2 live past the change", Duration::from_secs(90), |t| {
            t.epoch == 2 && t.phase != "paused" && t.watermark_micros.is_some_and(|w| w > now)
        })
        .await;
    let expected: BTreeMap<i64, Rendered> = keyed(&cluster.source.pool, "SELECT id, name || '|' || coalesce(color, 'NULL'), (extract(epoch from updated_at) * 1000000)::bigint FROM items").await;
    let actual: BTreeMap<i64, Rendered> = keyed(
        &target.pool,
        "SELECT id, CONCAT(name, '|', IFNULL(color, 'NULL')), _tidemark_version FROM items",
    )
    .await;
    assert_eq!(expected.len(), 2000);
    assert_eq!(expected[&10].0, "item 10|blue");
    if let Some(diff) = differences(&expected, &actual) {
        panic!("after reinit: {diff}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads = reader.await.unwrap();
    assert!(reads.len() > 20, "the reader ran ({} reads)", reads.len());
    assert!(
        reads.iter().all(|read| *read == (2000, 2000 * 2001 / 2)),
        "every key in every read"
    );
    let retained: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(column_name AS CHAR) FROM information_schema.columns WHERE table_schema = ? \
         AND table_name = 'items__tm_e1' ORDER BY ordinal_position",
    )
    .bind(&target.name)
    .fetch_all(&target.pool)
    .await
    .unwrap();
    assert!(
        !retained.is_empty() && !retained.iter().any(|c| c == "color"),
        "{retained:?}"
    );
    let (index, comment): (i64, String) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM information_schema.statistics WHERE table_schema = ? AND table_name = 'items' \
         AND index_name = 'items_name'), (SELECT CAST(table_comment AS CHAR) FROM information_schema.tables \
         WHERE table_schema = ? AND table_name = 'items')",
    )
    .bind(&target.name)
    .bind(&target.name)
    .fetch_one(&target.pool)
    .await
    .unwrap();
    assert_eq!(
        (index, comment.as_str()),
        (1, "synced by tidemark"),
        "index and comment carried over"
    );
}

/// The items of a PostgreSQL source against a MariaDB target, per key (name and version).
async fn assert_items_in_mariadb(cluster: &Cluster, target: &MariaDb, context: &str) {
    let now = cluster.source_now_micros().await;
    cluster.wait_for_watermark(now, Duration::from_secs(90)).await;
    let expected: BTreeMap<i64, Rendered> = keyed(
        &cluster.source.pool,
        "SELECT id, name, (extract(epoch from updated_at) * 1000000)::bigint FROM items",
    )
    .await;
    let actual: BTreeMap<i64, Rendered> = keyed(&target.pool, "SELECT id, name, _tidemark_version FROM items").await;
    if let Some(diff) = differences(&expected, &actual) {
        panic!("{context}: {diff}");
    }
}

/// A MariaDB switch cut short: the coordinator is killed after its RENAME TABLE and before
/// the fence row moves (crash point `swap_mid_target`), so batches of both epochs refuse
/// themselves on the swap mark; the restarted coordinator finishes the switch. Then `tasks
/// rollback` swaps epoch 1's table back. Per key after each, with writes in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_switch_cut_short_is_finished_then_rolled_back() {
    let (target, writer) = writer_target("mc_dst").await;
    let mut cluster = Cluster::new("mc_sync").await;
    let settings = TaskSettings {
        coordinator_env: vec![("TIDEMARK_CRASH_AT", "swap_mid_target:1".into())],
        ..TaskSettings::default()
    };
    pg_items_into_mariadb_with(&mut cluster, &target, &writer, 2000, settings, 4).await;
    let update = |round: i64| {
        format!("UPDATE items SET name = name || ' r{round}', updated_at = clock_timestamp() WHERE id % 10 = {round}")
    };
    cluster.cli_json(&["tasks", "reinit", "items"]);
    let exited = cluster.coordinator.as_mut().unwrap().wait_exit(Duration::from_secs(90));
    assert!(exited.is_some(), "the coordinator reached its crash point");
    let fence: (i64, Option<i64>) = sqlx::query_as("SELECT epoch, swapping FROM tidemark_epochs WHERE task = 'items'")
        .fetch_one(&target.pool)
        .await
        .unwrap();
    assert_eq!(fence, (1, Some(2)), "renamed, the fence not moved yet");
    cluster.source.exec(&update(1)).await;
    let config = cluster.config_path.clone();
    cluster.launch_coordinator(&config, &[]).await;
    cluster
        .wait_for("epoch 2 live", Duration::from_secs(60), |t| t.epoch == 2)
        .await;
    assert_items_in_mariadb(&cluster, &target, "after the switch was finished").await;

    let rolled = cluster.cli_json(&["tasks", "rollback", "items"]);
    assert!(
        rolled["message"].as_str().unwrap().contains("epoch 1 is live again"),
        "{rolled}"
    );
    cluster.source.exec(&update(2)).await;
    assert_items_in_mariadb(&cluster, &target, "after the rollback").await;
    let fence: (i64, Option<i64>) = sqlx::query_as("SELECT epoch, swapping FROM tidemark_epochs WHERE task = 'items'")
        .fetch_one(&target.pool)
        .await
        .unwrap();
    assert_eq!(fence, (1, None));
}

/// The remaining cells of the pair × mode matrix: MariaDB → MariaDB in append mode (an
/// AUTO_INCREMENT table paged by key alone, rows inserted while it runs) and PostgreSQL →
/// MariaDB in accumulate mode (seed 003's job from a PostgreSQL events table): per key, and
/// per app exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_appends_into_mariadb_and_postgres_accumulates_into_mariadb() {
    let (source, reader) = reader_source("mx_src").await;
    let (target, writer) = writer_target("mx_dst").await;
    source
        .exec(
            "CREATE TABLE events (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, payload VARCHAR(50) NOT NULL); \
             INSERT INTO events (payload) SELECT CONCAT('event ', seq) FROM seq_1_to_5000",
        )
        .await;
    let mut append = Cluster::new("mx_append").await;
    append
        .start(&TaskSettings {
            source_url: source.url_as(&reader.name, &reader.password),
            target_url: target.url_as(&writer.name, &writer.password),
            source_table: "events".into(),
            target_table: "events".into(),
            cursor_column: String::new(),
            extra: "mode = \"append\"".into(),
            shards: 2,
            page_size: 700,
            ..TaskSettings::default()
        })
        .await;
    append.spawn_worker("a", 2, &[]);
    source
        .exec("INSERT INTO events (payload) SELECT CONCAT('later ', seq) FROM seq_1_to_2000")
        .await;
    let expected: BTreeMap<i64, String> = sqlx::query_as("SELECT id, payload FROM events")
        .fetch_all(&source.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let actual: BTreeMap<i64, String> = sqlx::query_as("SELECT id, payload FROM events")
            .fetch_all(&target.pool)
            .await
            .unwrap_or_default()
            .into_iter()
            .collect();
        match differences(&expected, &actual) {
            None => break,
            Some(diff) => assert!(Instant::now() < deadline, "append: {diff}"),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    drop(append);

    let mut accumulate = Cluster::new("mx_acc").await;
    accumulate
        .source
        .exec(
            "CREATE TABLE app_events (id bigint PRIMARY KEY, type integer NOT NULL, event text NOT NULL); \
             INSERT INTO app_events SELECT i, CASE WHEN i % 10 = 0 THEN 3 ELSE 5 END, \
             json_build_object('apps', json_build_array(json_build_object('name', 'app-' || i % 13), \
                                                        json_build_object('name', 'app-' || i % 7)))::text \
             FROM generate_series(1, 6000) i",
        )
        .await;
    accumulate
        .start(&TaskSettings {
            target_url: target.url_as(&writer.name, &writer.password),
            source_table: "public.app_events".into(),
            target_table: "app_stat".into(),
            cursor_column: String::new(),
            page_size: 1000,
            shards: 2,
            extra: "mode = \"accumulate\"\nfilter = \"type = 5\"\n\
                    transform = { explode = \"$.apps[*].name\", from = \"event\", as = \"app_name\" }\n\
                    group_by = [\"app_name\"]\naggregates = { app_count = \"count\" }"
                .into(),
            ..TaskSettings::default()
        })
        .await;
    accumulate.spawn_worker("a", 2, &[]);
    let expected: BTreeMap<String, i64> = sqlx::query_as(
        "SELECT app ->> 'name', count(*) FROM app_events, json_array_elements(event::json -> 'apps') app \
         WHERE type = 5 GROUP BY 1",
    )
    .fetch_all(&accumulate.source.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(expected.len(), 13);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let counts: BTreeMap<String, i64> = sqlx::query_as("SELECT app_name, CAST(app_count AS SIGNED) FROM app_stat")
            .fetch_all(&target.pool)
            .await
            .unwrap_or_default()
            .into_iter()
            .collect();
        if counts == expected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "per app, expected {expected:?}, target {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `schema_changes = "evolve"` into a MariaDB target whose writer lacks ALTER: the column the
/// source gained cannot be added there, so the task pauses and says what to grant (nothing
/// silent, no re-snapshot needed); after the grant, `tasks resume` evolves the epoch and the
/// column's values arrive per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evolve_the_target_account_cannot_alter_pauses_until_granted() {
    let (target, writer) = writer_target("ev_dst").await;
    for host in ["%", "localhost"] {
        target
            .exec(&format!(
                "REVOKE ALTER ON `{}`.* FROM '{}'@'{host}'",
                target.name, writer.name
            ))
            .await;
    }
    let mut cluster = Cluster::new("ev_grant").await;
    pg_items_into_mariadb(&mut cluster, &target, &writer, 1000, "schema_changes = \"evolve\"").await;
    cluster
        .source
        .exec(
            "ALTER TABLE items ADD COLUMN color text; \
             UPDATE items SET color = 'c' || id, updated_at = clock_timestamp() WHERE id % 9 = 0",
        )
        .await;
    let paused = cluster
        .wait_for("the pause", Duration::from_secs(60), |t| t.phase == "paused")
        .await;
    assert!(
        paused
            .paused_reason
            .contains("column(s) color of public.items could not be added to the target table")
            && paused.paused_reason.contains("needs ALTER")
            && paused.paused_reason.contains("tasks resume items")
            && !paused.paused_reason.contains("reinitialization required"),
        "{}",
        paused.paused_reason
    );
    target
        .exec(&format!("GRANT ALTER ON `{}`.* TO '{}'@'%'", target.name, writer.name))
        .await;
    let (ok, _, stderr) = cluster.cli(&["tasks", "resume", "items", "--coordinator", &cluster.address]);
    assert!(ok, "resume: {stderr}");
    let end = cluster.source_now_micros().await;
    let status = cluster
        .wait_for("the watermark past the evolution", Duration::from_secs(90), |t| {
            t.phase == "paused" || t.watermark_micros.is_some_and(|w| w > end)
        })
        .await;
    assert_ne!(status.phase, "paused", "{}", status.paused_reason);
    let expected: BTreeMap<i64, String> = sqlx::query_as("SELECT id, color FROM items WHERE color IS NOT NULL")
        .fetch_all(&cluster.source.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(expected.len(), 111);
    let actual: BTreeMap<i64, String> = sqlx::query_as("SELECT id, color FROM items WHERE color IS NOT NULL")
        .fetch_all(&target.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(actual, expected, "the added column per key after the grant");
}
