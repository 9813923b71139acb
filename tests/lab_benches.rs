//! The lab's benchmarks that call the apply script themselves (`tally-lab bench-writes`,
//! `bench-windows`, `bench-memory` and `bench-growth`) run through on a real redis-server: they send the script
//! the arguments `tally run` sends, so a change to those arguments that leaves a benchmark behind
//! fails here and not in the middle of `scripts/bench`.

mod common;

use std::process::Command;

/// Runs `tally-lab COMMAND FLAGS` (small settings, a redis-server of its own) to its end and
/// expects each of `rows` in the report it prints.
fn runs_through(command: &str, flags: &str, rows: &[&str]) {
    // Fails with the install command when redis-server is missing.
    common::Store::Redis.server_bin();
    let output = Command::new(common::lab_bin())
        .arg(command)
        .args(flags.split_whitespace())
        .output()
        .expect("start tally-lab");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "tally-lab {command} {flags} failed ({}):\n{report}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    for row in rows {
        assert!(report.contains(row), "no {row:?} in the report:\n{report}");
    }
}

#[test]
fn bench_writes_measures_every_case() {
    runs_through(
        "bench-writes",
        "--counters 2000 --keys 500 --calls 2 --rounds 1",
        &[
            "| `apply.lua`, the same counters in every call |",
            "| `apply.lua`, counters drawn at random for each call |",
            "| a script given the same keys, writing none |",
            "| pipelined `INCR`s drawn at random from every counter |",
        ],
    );
}

#[test]
fn bench_windows_measures_both_layouts() {
    runs_through(
        "bench-windows",
        "--posts 5000 --events-per-call 2000 --warm-calls 1 --calls 2 --rounds 1",
        &[
            "| counters and one window (1h) |",
            "| packed: counters and one window (1h) |",
        ],
    );
}

#[test]
fn bench_memory_measures_both_layouts() {
    runs_through(
        "bench-memory",
        "--counters 20000 --fields 64 --keys 500 --calls 2",
        &["| strings |", "| packed | 64 |"],
    );
}

#[test]
fn bench_growth_grows_every_layout() {
    runs_through(
        "bench-growth",
        "--counters 100000 --keys 1000",
        &[
            "| 100,000 | strings |",
            "| 100,000 | packed, growing |",
            "| 100,000 | packed, fixed |",
        ],
    );
}
