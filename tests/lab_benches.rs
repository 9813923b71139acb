//! The lab's benchmarks that call the apply script themselves (`tally-lab bench-writes`,
//! `bench-windows` and `bench-memory`) run through on a real redis-server: they send the script
//! the arguments `tally run` sends, so a change to those arguments that leaves a benchmark behind
//! fails here and not in the middle of `scripts/bench`.

mod common;

use std::process::Command;

/// Runs `tally-lab ARGS` to its end; returns what it printed on stdout.
fn lab(args: &[&str]) -> String {
    let output = Command::new(common::lab_bin())
        .args(args)
        .output()
        .expect("start tally-lab");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "tally-lab {} failed ({}):\n{stdout}\n{}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn bench_writes_measures_every_case() {
    // Fails with the install command when redis-server is missing.
    common::Store::Redis.server_bin();
    let report = lab(&[
        "bench-writes",
        "--counters",
        "2000",
        "--keys",
        "500",
        "--calls",
        "2",
        "--rounds",
        "1",
    ]);
    for case in [
        "`apply.lua`, the same counters in every call",
        "`apply.lua`, counters drawn at random for each call",
        "a script given the same keys, writing none",
        "pipelined `INCR`s drawn at random from every counter",
    ] {
        assert!(report.contains(case), "no row for {case}:\n{report}");
    }
}

#[test]
fn bench_windows_measures_every_case() {
    // Fails with the install command when redis-server is missing.
    common::Store::Redis.server_bin();
    let report = lab(&[
        "bench-windows",
        "--posts",
        "5000",
        "--events-per-call",
        "2000",
        "--warm-calls",
        "1",
        "--calls",
        "2",
        "--rounds",
        "1",
    ]);
    assert!(
        report.contains("counters") && report.contains("packed"),
        "no table of both layouts:\n{report}"
    );
}

#[test]
fn bench_memory_measures_both_layouts() {
    // Fails with the install command when redis-server is missing.
    common::Store::Redis.server_bin();
    let report = lab(&[
        "bench-memory",
        "--counters",
        "20000",
        "--fields",
        "64",
        "--keys",
        "500",
        "--calls",
        "2",
    ]);
    assert!(
        report.contains("| strings |") && report.contains("| packed | 64 |"),
        "no rows for both layouts:\n{report}"
    );
}
