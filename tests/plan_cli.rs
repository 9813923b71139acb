//! `tally plan --json` as a user runs it: the binary's output parses and holds together.

use std::process::Command;

use serde_json::Value;

fn plan_json(flags: &[&str]) -> Value {
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["plan", "--json"])
        .args(flags)
        .output()
        .expect("tally runs");
    assert!(output.status.success(), "{output:?}");
    serde_json::from_slice(&output.stdout).expect("tally plan --json prints JSON")
}

#[test]
fn plan_json_parses_and_is_consistent() {
    let plan = plan_json(&["--peak-events", "120000", "--hot-events", "14000"]);
    let number = |path: &str| {
        plan.pointer(path)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("{path} missing from {plan:#}"))
    };
    assert_eq!(number("/inputs/hot_events"), 14_000.0);
    assert_eq!(number("/hot_post/per_event/buckets"), 20.0);
    let batches = number("/kafka/batches_per_s");
    assert_eq!(batches, number("/kafka/partitions") * 10.0);
    assert!(number("/hot_post/batched/writes_per_bucket") <= batches);
    let (p50, p99) = (
        number("/redis/busiest_primary/p50_ops"),
        number("/redis/busiest_primary/p99_ops"),
    );
    assert!(p50 <= p99 && p99 <= number("/redis/busiest_primary/max_ops"));
    let pct = number("/redis/busiest_primary/p99_pct_capacity");
    assert!((pct - p99 / 1_000.0).abs() < 0.01, "{pct} vs {p99}");
    assert!(plan["warnings"].as_array().is_some_and(Vec::is_empty));
}

#[test]
fn plan_refuses_a_hot_post_above_the_peak() {
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["plan", "--peak-events", "1000", "--hot-events", "2000"])
        .output()
        .expect("tally runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--hot-events"), "{stderr}");
}

#[test]
fn plan_prices_a_dedupe_window_at_the_peak() {
    let flags = [
        "--peak-events",
        "120000",
        "--hot-events",
        "14000",
        "--partitions",
        "6",
        "--dedupe-window",
        "2000000",
        "--reread-events",
        "400000",
    ];
    let plan = plan_json(&flags);
    let number = |path: &str| {
        plan.pointer(path)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("{path} missing from {plan:#}"))
    };
    // 120,000 events/s over 6 partitions: 20,000 a partition, 3 partitions for each of the
    // 2 consumers.
    assert_eq!(number("/kafka/events_per_partition"), 20_000.0);
    assert_eq!(number("/dedupe/window"), 2_000_000.0);
    assert_eq!(number("/dedupe/covers_seconds"), 100.0);
    assert_eq!(number("/dedupe/reread_partition_seconds"), 5.0);
    assert_eq!(number("/dedupe/partitions_per_consumer"), 3.0);
    assert_eq!(number("/dedupe/reread_consumer_seconds"), 15.0);
    let per_event = number("/dedupe/bytes_per_event");
    assert!(per_event > 0.0, "{plan:#}");
    assert_eq!(number("/dedupe/bytes_per_partition"), 2e6 * per_event);
    assert_eq!(number("/dedupe/bytes_per_consumer"), 6e6 * per_event);

    let without = plan_json(&flags[..6]);
    assert!(without.get("dedupe").is_none(), "{without:#}");

    let table = Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("plan")
        .args(flags)
        .output()
        .expect("tally runs");
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("Dedupe window (2,000,000 offsets a partition)"),
        "{text}"
    );
    assert!(text.contains("a consumer's 3 partitions"), "{text}");
}
