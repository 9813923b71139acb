//! One consumer, a 200k-event backlog with unlikes and a viral post: every post's count must
//! equal the ground truth exactly, and SIGTERM must end the process cleanly.

mod common;

use std::time::{Duration, Instant};

use common::*;

const EVENTS: usize = 200_000;
const PARTITIONS: i32 = 8;

#[test]
fn one_consumer_counts_200k_events_exactly() {
    let run = Scenario::new("e2e_exact", "exact", PARTITIONS);
    let redis = RedisServer::start();

    let w = Workload::generate(run.seed, EVENTS, PARTITIONS);
    eprintln!("[e2e_exact] {}", w.describe());
    let started = Instant::now();
    let per_partition = produce(&run.brokers, &run.topic, w.messages(0..w.events.len()));
    eprintln!(
        "[e2e_exact] produced in {:.1} s: {per_partition:?}",
        started.elapsed().as_secs_f64()
    );
    let hwms = run.hwms(EVENTS);

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(["--metrics-addr".to_string(), metrics_addr.clone()]);
    let mut tally = Tally::spawn_args("tally", &args);

    let started = Instant::now();
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(150), || {
        tally.assert_running()
    });
    eprintln!(
        "[e2e_exact] applied {EVENTS} events in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let counts = read_counts(&mut conn, &run.prefix);
    assert_counts_eq(&counts, &w.truth);
    let total: i64 = counts.values().sum();
    assert_eq!(total, w.likes as i64 - w.unlikes as i64);

    // Every batch's offset commit is timed when the coordinator answers it: the `commit` stage
    // of tally_stage_seconds has a sample for at most every batch, and at least one.
    let deadline = Instant::now() + Duration::from_secs(15);
    let (commits, scripts) = loop {
        let text = scrape_metrics(&metrics_addr);
        let stage = |name: &str| {
            metric_value(
                &text,
                &format!("tally_stage_seconds_count{{stage=\"{name}\"}}"),
            )
            .unwrap_or(0.0)
        };
        let (commits, scripts) = (stage("commit"), stage("script"));
        if commits > 0.0 || Instant::now() > deadline {
            eprintln!(
                "[e2e_exact] metrics:\n{}",
                text.lines()
                    .filter(|l| l.starts_with("tally_"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            break (commits, scripts);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        commits > 0.0 && commits <= scripts,
        "the commit stage timed {commits} commits for {scripts} scripts"
    );

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(
        status.success(),
        "tally exited with {status} after SIGTERM; log tail:\n{}",
        tally.log_tail(40)
    );
}
