//! The chaos suite: tally under generated traffic while faults are injected at random, each
//! scenario checked post by post against the workload's own ground truth.
//!
//! 1. `kills`: SIGKILL of a random consumer every 1–5 s;
//! 2. `scaling`: 1 → 4 → 1 consumers, again and again; the steady consumer's RSS and open
//!    descriptors are sampled after every cycle (the leak check);
//! 3. `zombie`: a consumer SIGSTOPped past its session timeout, then SIGCONTed;
//! 4. `redis-restart`: redis-server SIGKILLed and restarted from its AOF (everysec), some
//!    restarts with the AOF's tail cut off;
//! 5. `cluster`: Redis Cluster slot migration, SCRIPT FLUSH and a primary failover under load;
//! 6. `broker-stop`: the broker SIGSTOPped for 30 s (a private node), then SIGCONTed;
//! 7. `script-flush`: SCRIPT FLUSH again and again mid-run;
//! 8. `hostile`: malformed and edge-case messages mixed into real traffic;
//! 9. `broker-empty`: the broker comes back empty while Redis keeps its fences: refused, then
//!    counted again from the new log's start after `tally reset-fences`;
//! 10. `wrong-clocks`: likes stamped a day and a thousand years ahead among real traffic, with
//!     consumers SIGKILLed in between;
//! 11. `duplicates`: a producer that delivers at least once (repeated event ids, some in the same
//!     batch and some later, id-less double taps, like-like-unlike) under `--dedupe
//!     ids-and-actions`, with consumers SIGKILLed and a rebalance; the truth counts each like once.
//!
//! `TALLY_CHAOS_MODE=quick|long` picks the sizes (default quick); `TALLY_CHAOS_ONLY=a,b` runs
//! only the named scenarios; `TALLY_CHAOS_WORKERS=N` runs N at once (default 2). One table row
//! per scenario is printed at the end; the test fails on any difference, any scenario error, or
//! resources growing past the stated bounds.
//! `scripts/test` runs the quick mode with every other test; `scripts/chaos` runs the suite alone,
//! in either mode, and prints its table.

mod cluster;
mod common;

#[path = "chaos/duplicates.rs"]
mod duplicates;
#[path = "chaos/input.rs"]
mod input;
#[path = "chaos/processes.rs"]
mod processes;
#[path = "chaos/report.rs"]
mod report;
#[path = "chaos/stores.rs"]
mod stores;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use report::{Leaks, Row};

/// Partitions of every scenario's topic.
pub(crate) const PARTITIONS: i32 = 8;

/// The sizes of one run.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    mode: &'static str,
    /// Events produced before the consumers start.
    first_wave: usize,
    /// Events produced per chunk while faults are injected, and the pause after each chunk.
    chunk: usize,
    pause: Duration,
    /// Scenario 1: SIGKILLs.
    kills: usize,
    /// Scenario 2: 1 → 4 → 1 cycles at least, and rebalances the steady consumer must see.
    scale_cycles: usize,
    leak_rebalances: u64,
    /// Scenario 3: freezes.
    zombies: usize,
    /// Scenario 4: redis-server restarts.
    redis_restarts: usize,
    /// Scenario 5: rounds of reshard + SCRIPT FLUSH + failover.
    cluster_rounds: usize,
    /// Scenario 6: broker freezes, and how long each lasts.
    broker_stops: usize,
    broker_stop_for: Duration,
    /// Scenario 7: SCRIPT FLUSHes.
    flushes: usize,
    /// Scenario 8: hostile messages.
    hostile: usize,
}

impl Settings {
    fn from_env() -> Settings {
        let mode = std::env::var("TALLY_CHAOS_MODE").unwrap_or_else(|_| "quick".to_string());
        match mode.as_str() {
            "quick" => Settings {
                mode: "quick",
                first_wave: 20_000,
                chunk: 500,
                pause: Duration::from_millis(200),
                kills: 6,
                scale_cycles: 2,
                leak_rebalances: 0,
                zombies: 1,
                redis_restarts: 3,
                cluster_rounds: 1,
                broker_stops: 1,
                broker_stop_for: Duration::from_secs(30),
                flushes: 8,
                hostile: 600,
            },
            "long" => Settings {
                mode: "long",
                first_wave: 100_000,
                chunk: 1_000,
                pause: Duration::from_millis(200),
                kills: 24,
                scale_cycles: 6,
                leak_rebalances: 100,
                zombies: 3,
                redis_restarts: 10,
                cluster_rounds: 3,
                broker_stops: 2,
                broker_stop_for: Duration::from_secs(30),
                flushes: 40,
                hostile: 5_000,
            },
            other => panic!("TALLY_CHAOS_MODE must be quick or long, not {other:?}"),
        }
    }
}

type ScenarioFn = fn(&Settings, &mut Row, &mut Leaks);

const SCENARIOS: [(&str, ScenarioFn); 11] = [
    ("kills", processes::random_kills),
    ("scaling", processes::scaling),
    ("zombie", processes::zombie),
    ("redis-restart", stores::redis_restarts),
    ("cluster", stores::cluster),
    ("broker-stop", input::broker_stop),
    ("script-flush", stores::script_flush),
    ("hostile", input::hostile),
    ("broker-empty", input::broker_empty),
    ("wrong-clocks", input::wrong_clocks),
    ("duplicates", duplicates::duplicates),
];

/// Scenarios that run at once (`TALLY_CHAOS_WORKERS`, default 2). Each has its topics, group,
/// prefix and Redis of its own; most of a scenario's time is spent waiting for a session to
/// expire, a broker to come back or a consumer to catch up, so two share the machine well.
fn workers() -> usize {
    match std::env::var("TALLY_CHAOS_WORKERS") {
        Ok(v) => v
            .parse()
            .ok()
            .filter(|n| *n >= 1)
            .unwrap_or_else(|| panic!("TALLY_CHAOS_WORKERS must be a number from 1, not {v:?}")),
        Err(_) => 2,
    }
}

/// Runs one scenario, its panic turned into the row's error.
fn run_scenario(settings: &Settings, name: &'static str, scenario: ScenarioFn) -> (Row, Leaks) {
    eprintln!("[chaos] ===== {name} =====");
    let mut row = Row::new(name);
    let mut leaks = Leaks::default();
    let t = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        scenario(settings, &mut row, &mut leaks)
    }));
    row.secs = t.elapsed().as_secs_f64();
    if let Err(panic) = outcome {
        let text = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".to_string());
        row.error = Some(text.lines().next().unwrap_or_default().to_string());
    }
    eprintln!("[chaos] {name}: {}", row.summary());
    (row, leaks)
}

#[test]
fn chaos() {
    let settings = Settings::from_env();
    let only: Option<Vec<String>> = std::env::var("TALLY_CHAOS_ONLY")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let workers = workers();
    eprintln!(
        "[chaos] mode {}, {workers} at once: {settings:?}",
        settings.mode
    );
    let started = Instant::now();
    let chosen: Vec<(usize, &'static str, ScenarioFn)> = SCENARIOS
        .into_iter()
        .enumerate()
        .filter(|(_, (name, _))| only.as_ref().is_none_or(|o| o.iter().any(|n| n == name)))
        .map(|(i, (name, f))| (i, name, f))
        .collect();
    let queue = Mutex::new(chosen.into_iter());
    let done = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let next = queue.lock().unwrap().next();
                    let Some((i, name, scenario)) = next else {
                        break;
                    };
                    let result = run_scenario(&settings, name, scenario);
                    done.lock().unwrap().push((i, result));
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap();
    done.sort_by_key(|(i, _)| *i);
    let mut rows = Vec::new();
    let mut leaks = Leaks::default();
    for (_, (row, sampled)) in done {
        // Only the scaling scenario samples its steady consumer.
        if sampled.rebalances > 0 || !sampled.samples.is_empty() {
            leaks = sampled;
        }
        rows.push(row);
    }
    let table = report::table(&settings, &rows, &leaks, started.elapsed());
    println!("\n{table}");
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| !r.clean())
        .map(|r| format!("{}: {}", r.name, r.summary()))
        .collect();
    let leak_problems = leaks.problems();
    assert!(
        failed.is_empty() && leak_problems.is_empty(),
        "chaos found differences:\n{}\n{}",
        failed.join("\n"),
        leak_problems.join("\n")
    );
}

/// Shared steps of the scenarios.
mod steps {
    use std::collections::HashMap;
    use std::time::Duration;

    use crate::common::*;
    use crate::report::Row;

    /// How long a frozen consumer must sleep before the broker expires it: the session timeout
    /// (6 s in `tally_args`), plus a heartbeat and a margin.
    pub const SESSION_EXPIRY: Duration = Duration::from_secs(8);

    /// `tally run` arguments plus a metrics address and `extra`.
    pub fn args_with(base: &[String], metrics: Option<&str>, extra: &[&str]) -> Vec<String> {
        let mut args = base.to_vec();
        if let Some(addr) = metrics {
            args.extend(["--metrics-addr".to_string(), addr.to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// A scenario with topics, group and prefix of its own on the shared broker.
    pub fn scenario(test: &str, short: &str) -> Scenario {
        Scenario::new(test, short, crate::PARTITIONS)
    }

    pub fn metrics_addr() -> String {
        format!("127.0.0.1:{}", free_port())
    }

    /// Partitions a consumer owns, from its metrics.
    pub fn assigned(addr: &str) -> Option<u32> {
        assigned_partitions(addr).map(|v| v as u32)
    }

    /// Rebalances a consumer took part in, from its metrics.
    pub fn rebalances(addr: &str) -> Option<u64> {
        let text = try_scrape_metrics(addr).ok()?;
        Some(metric_sum(&text, "tally_rebalances_total") as u64)
    }

    /// Waits until every fence on a single server is at the end of the topic, then compares.
    pub fn settle_single(
        row: &mut Row,
        run: &Scenario,
        redis: &RedisServer,
        truth: &HashMap<u64, i64>,
        hwms: &[i64],
        tallies: &mut [&mut Tally],
    ) {
        let mut conn = redis.conn();
        row.settle(
            || {
                run.wait_applied(&mut conn, hwms, Duration::from_secs(180), || {
                    for t in tallies.iter_mut() {
                        t.assert_running();
                    }
                })
            },
            || read_counts(&mut redis.conn(), &run.prefix),
            truth,
        );
    }

    /// SIGTERM every consumer; each must exit 0 within 30 s.
    pub fn stop_all(tallies: &mut [&mut Tally]) {
        for t in tallies.iter_mut() {
            let status = t.sigterm_and_wait(Duration::from_secs(30));
            assert!(
                status.success(),
                "a consumer exited with {status} after SIGTERM:\n{}",
                t.log_tail(20)
            );
        }
    }
}
