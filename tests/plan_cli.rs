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
