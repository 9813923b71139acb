//! Producers that deliver at least once: records repeated by id (an outbox relay publishing
//! again, some in the same batch, some minutes of event time later), id-less double taps and
//! like-like-unlike sequences, with SIGKILLs and a rebalance between a record and its repeat.
//! With `--dedupe ids-and-actions`, every post's count must equal a truth that counts each like
//! once, and `tally verify` must agree with the store under the same rule.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::*;

const PARTITIONS: i32 = 4;
/// Offsets per partition the window spans; every repeat lands closer than this.
const WINDOW: usize = 4_000;
/// How far back (records of its partition) a repeat may reach.
const REACH: usize = 1_500;

fn dedupe_args(run: &Scenario, redis: &RedisServer) -> Vec<String> {
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--dedupe",
            "ids-and-actions",
            "--dedupe-window",
            &WINDOW.to_string(),
            // Small batches: a record and its repeat often straddle a batch, a kill or a
            // rebalance.
            "--batch-max-events",
            "300",
            "--flush-interval-ms",
            "30",
        ]
        .map(String::from),
    );
    args
}

/// `tally verify` with `args` (those of `tally run`), deciding repeats by `mode`.
fn verify(args: &[String], mode: &str) -> String {
    let mut all = vec!["verify".to_string()];
    all.extend(args.iter().cloned());
    let at = all
        .iter()
        .position(|a| a == "--dedupe")
        .expect("--dedupe given");
    all[at + 1] = mode.to_string();
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    output_text(&tally_cli(&refs))
}

#[test]
fn repeats_count_once_through_kills_and_a_rebalance() {
    let run = Scenario::new("e2e_dedupe", "dedupe", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut dupes = Dupes::new(run.seed, PARTITIONS, REACH);
    let args = dedupe_args(&run, &redis);
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut with_metrics = args.clone();
    with_metrics.extend(["--metrics-addr".to_string(), metrics.clone()]);
    let started = Instant::now();

    let mut a = Tally::spawn_args("tally-a", &with_metrics);
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    thread::sleep(Duration::from_secs(3));
    // A kill while batches land: the next owner re-reads the window below its fences.
    a.kill9();
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    a = Tally::spawn_args("tally-a2", &with_metrics);
    thread::sleep(Duration::from_secs(2));
    // A second member: partitions move, and each new owner rebuilds their windows.
    let mut b = Tally::spawn_args("tally-b", &args);
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    thread::sleep(Duration::from_secs(4));
    b.kill9();
    produce(&run.brokers, &run.topic, dupes.grow(6_000));

    let hwms = run.hwms(dupes.records);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(180), || {
        a.assert_running()
    });
    eprintln!(
        "[e2e_dedupe] {} records ({} repeated ids, {} repeated actions) applied in {:.1} s",
        dupes.records,
        dupes.id_repeats,
        dupes.action_repeats,
        started.elapsed().as_secs_f64()
    );
    run.assert_exact(&mut conn, &dupes.truth);

    let text = scrape_metrics(&metrics);
    let skipped = |reason: &str| {
        metric_value(
            &text,
            &format!("tally_duplicates_skipped_total{{reason=\"{reason}\"}}"),
        )
        .unwrap_or(0.0)
    };
    eprintln!(
        "[e2e_dedupe] after its restart tally-a skipped {} repeated ids, {} repeated actions",
        skipped("event_id"),
        skipped("repeat_action")
    );
    assert!(
        skipped("event_id") > 0.0 && skipped("repeat_action") > 0.0,
        "{text}"
    );

    // verify walks the log from the origin by the same rule; without it, the repeats are
    // drift.
    let same = verify(&args, "ids-and-actions");
    assert!(same.contains("; 0 drift"), "{same}");
    let off = verify(&args, "off");
    assert!(!off.contains("; 0 drift"), "{off}");

    let status = a.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "{}", a.log_tail(30));
}
