//! Bad input stops the coordinator at start with a non-zero exit and one line that names the
//! problem: unknown config keys, missing tables, nullable cursor or key columns, keys that
//! are not unique.

use std::time::Duration;

use tidemark_tests::{Cluster, KeyKind, Process, TaskSettings, binary, create_items};

/// Runs `serve` on the cluster's config and returns its error line.
fn serve_error(cluster: &Cluster, name: &str) -> String {
    let mut process = Process::spawn(
        name,
        &binary("tidemark-coordinator"),
        &["serve", "--config", cluster.config_path.to_str().unwrap()],
        &[],
        &cluster.dir.0,
    );
    let status = process
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("{name}: coordinator kept running on bad input"));
    assert!(!status.success(), "{name}: exit status {status}");
    let log = process.log_text();
    let error_lines: Vec<&str> = log.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(error_lines.len(), 1, "{name}: one error line expected, got:\n{log}");
    assert!(!log.contains("panicked"), "{name}: no panic for bad input:\n{log}");
    error_lines[0].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_config_and_bad_tables_are_named() {
    let mut cluster = Cluster::new("badcfg").await;
    create_items(&cluster.source, KeyKind::Bigint, 10).await;

    // An unknown key, named with its line.
    let config = cluster.write_config(&TaskSettings::default());
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("shards = 8", "shardz = 8")).unwrap();
    let error = serve_error(&cluster, "unknown-key");
    assert!(
        error.contains("unknown field `shardz`") && error.contains("line 17"),
        "{error}"
    );

    // A missing environment variable in `${…}`.
    std::fs::write(
        &config,
        text.replace("lease_ttl = \"4s\"", "lease_ttl = \"${TIDEMARK_TEST_UNSET_TTL}\""),
    )
    .unwrap();
    let error = serve_error(&cluster, "missing-env");
    assert!(error.contains("TIDEMARK_TEST_UNSET_TTL"), "{error}");

    // A source table that does not exist.
    cluster.write_config(&TaskSettings {
        source_table: "public.nope".into(),
        ..TaskSettings::default()
    });
    let error = serve_error(&cluster, "missing-table");
    assert!(
        error.contains("task items: source table public.nope does not exist"),
        "{error}"
    );

    // A nullable cursor column.
    cluster
        .source
        .exec("CREATE TABLE loose (id bigint PRIMARY KEY, name text NOT NULL, updated_at timestamptz)")
        .await;
    cluster.write_config(&TaskSettings {
        source_table: "public.loose".into(),
        ..TaskSettings::default()
    });
    let error = serve_error(&cluster, "nullable-cursor");
    assert!(
        error.contains("cursor_column \"updated_at\"") && error.contains("nullable"),
        "{error}"
    );

    // A key that is not unique, and a cursor column that is not a timestamp.
    cluster.write_config(&TaskSettings {
        key: vec!["qty".into()],
        ..TaskSettings::default()
    });
    let error = serve_error(&cluster, "nullable-key");
    assert!(
        error.contains("key column \"qty\"") && error.contains("nullable"),
        "{error}"
    );
    cluster.write_config(&TaskSettings {
        key: vec!["seq".into(), "name".into()],
        ..TaskSettings::default()
    });
    let error = serve_error(&cluster, "non-unique-key");
    assert!(
        error.contains("key (seq, name) of public.items is not unique"),
        "{error}"
    );
    cluster.write_config(&TaskSettings {
        cursor_column: "name".into(),
        ..TaskSettings::default()
    });
    let error = serve_error(&cluster, "text-cursor");
    assert!(error.contains("cursor_column \"name\" has type text"), "{error}");

    // Accumulate tasks: a transform reading a column that does not exist, a JSON path that
    // does not parse, and a summary table whose group_by is not unique.
    cluster
        .source
        .exec("CREATE TABLE events (id bigint PRIMARY KEY, event text)")
        .await;
    let accumulate = |transform: &str| TaskSettings {
        source_table: "public.events".into(),
        target_table: "public.app_stat".into(),
        cursor_column: String::new(),
        extra: format!(
            "mode = \"accumulate\"\ntransform = {transform}\ngroup_by = [\"app\"]\naggregates = {{ n = \"count\" }}"
        ),
        ..TaskSettings::default()
    };
    cluster.write_config(&accumulate(
        r#"{ explode = "$.apps[*]", from = "payload", as = "app" }"#,
    ));
    let error = serve_error(&cluster, "accumulate-missing-column");
    assert!(
        error.contains("transform.from \"payload\" does not exist in public.events"),
        "{error}"
    );
    cluster.write_config(&accumulate(r#"{ explode = "apps[*]", from = "event", as = "app" }"#));
    let error = serve_error(&cluster, "accumulate-bad-path");
    assert!(
        error.contains("transform.explode") && error.contains("must start with $"),
        "{error}"
    );
    // Nothing was planned for a task that failed validation.
    let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks")
        .fetch_one(&cluster.control.pool)
        .await
        .unwrap();
    assert_eq!(tasks, 0);

    // A target-side problem is found after planning (the plan is kept for the next start).
    cluster
        .target
        .exec("CREATE TABLE app_stat (app text NOT NULL, n bigint NOT NULL)")
        .await;
    cluster.write_config(&accumulate(r#"{ explode = "$.apps[*]", from = "event", as = "app" }"#));
    let error = serve_error(&cluster, "accumulate-not-unique");
    assert!(
        error.contains("summary table public.app_stat: no unique index or primary key covers exactly group_by (app)"),
        "{error}"
    );
}
