//! CI's smoke run of the benchmark (`tidemark-bench`, see BENCHMARKS.md): 200k rows, checking
//! that it runs end to end and computes its ratio against the raw COPY pipe. No pass/fail on
//! speed: this machine's load during CI says nothing about the engine.

use std::process::Command;

use tidemark_tests::{SLOTS_HELD_BY_PARENT, all_cluster_slots, binary};

#[test]
fn benchmark_runs_and_computes_its_ratio() {
    // The benchmark runs 8 pipes, a coordinator and 2 workers on the server the test clusters
    // share, and checkpoints it before each path: alone, it neither starves their pools of
    // connections nor stalls their commits.
    let _machine = all_cluster_slots();
    let output = Command::new(binary("tidemark-bench"))
        .args(["--rows", "200000", "--updates", "20000", "--json"])
        .env("RUST_LOG", "warn")
        .env(SLOTS_HELD_BY_PARENT, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "benchmark failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json = stdout.lines().last().unwrap();
    let result: serde_json::Value = serde_json::from_str(json).unwrap();
    eprintln!("{stdout}");
    assert_eq!(result["rows"], 200_000);
    let ratio = result["ratio"].as_f64().unwrap();
    assert!(ratio.is_finite() && ratio > 0.0, "{result}");
    // The raw limit is also measured as one pipe per shard, and the ratio to the faster.
    assert_eq!(result["streams"], 8, "{result}");
    assert!(result["streams_seconds"].as_f64().unwrap() > 0.0, "{result}");
    let faster = result["ratio_to_faster_raw"].as_f64().unwrap();
    // The faster of the two takes at most the one pipe's time.
    assert!(faster > 0.0 && faster <= ratio * (1.0 + 1e-9), "{result}");
    assert_eq!(
        result["peers"],
        serde_json::json!([]),
        "peers run only when asked: {result}"
    );
    assert_eq!(result["updates"], 20_000);
    assert_eq!(result["steps"].as_array().unwrap().len(), 6);
    assert_eq!(result["update_steps"].as_array().unwrap().len(), 6);
    // The benchmark's target is created from the source's columns: the same types, so every
    // batch goes as binary COPY.
    let formats = result["staged_formats"].as_object().unwrap();
    assert_eq!(
        formats.keys().collect::<Vec<_>>(),
        vec!["pg_copy_binary+lz4"],
        "{result}"
    );
}
