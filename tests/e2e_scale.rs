//! Scaling one consumer group 1 → 3 → 1 under live traffic: counts stay exact, and the partitions
//! the first consumer keeps throughout (cooperative-sticky assignment) keep being applied while
//! the others move, as its own `tally_applied_offset` metric shows.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

const PARTITIONS: i32 = 6;

/// Samples of one consumer's applied offsets: (time since start, partition, offset).
type Samples = Vec<(Duration, i32, f64)>;

fn sample_applied(
    addr: String,
    stop: Arc<AtomicBool>,
    started: Instant,
) -> thread::JoinHandle<Samples> {
    thread::spawn(move || {
        let mut samples = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            if let Ok(text) = try_scrape_metrics(&addr) {
                for (labels, value) in metric_series(&text, "tally_applied_offset") {
                    if let Some(p) = labels
                        .split("partition=\"")
                        .nth(1)
                        .and_then(|rest| rest.split('"').next())
                        .and_then(|p| p.parse().ok())
                    {
                        samples.push((started.elapsed(), p, value));
                    }
                }
            }
            thread::sleep(Duration::from_millis(200));
        }
        samples
    })
}

/// The longest time `partition`'s applied offset stood still within `window`.
fn longest_stall(samples: &Samples, partition: i32, window: (Duration, Duration)) -> Duration {
    let mut last_change: Option<(Duration, f64)> = None;
    let mut longest = Duration::ZERO;
    for &(at, p, offset) in samples {
        if p != partition || at < window.0 || at > window.1 {
            continue;
        }
        match last_change {
            Some((since, value)) if offset == value => longest = longest.max(at - since),
            _ => last_change = Some((at, offset)),
        }
    }
    longest
}

#[test]
fn scaling_one_to_three_to_one_keeps_counts_exact_and_kept_partitions_flowing() {
    let run = Scenario::new("e2e_scale", "scale", PARTITIONS);
    let redis = RedisServer::start();
    let started = Instant::now();
    let consumer = |name: &str| {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut args = run.tally_args(&redis.url());
        args.extend(["--metrics-addr".to_string(), addr.clone()]);
        (Tally::spawn_args(name, &args), addr)
    };
    let (mut first, first_metrics) = consumer("first");
    let producer = run.stream(
        Workload::new(run.seed, PARTITIONS),
        120,
        Duration::from_millis(100),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_applied(first_metrics.clone(), stop.clone(), started);
    thread::sleep(Duration::from_secs(6));

    let scale_up = started.elapsed();
    let (mut second, _) = consumer("second");
    let (mut third, _) = consumer("third");
    let mut conn = redis.conn();
    wait_for(
        "three consumers sharing the partitions",
        Duration::from_secs(60),
        || {
            first.assert_running();
            let text = scrape_metrics(&first_metrics);
            (metric_value(&text, "tally_assigned_partitions") == Some(2.0)).then_some(())
        },
    );
    thread::sleep(Duration::from_secs(6));

    for t in [&mut second, &mut third] {
        let status = t.sigterm_and_wait(Duration::from_secs(30));
        assert!(status.success(), "exit {status}:\n{}", t.log_tail(20));
    }
    wait_for(
        "one consumer owning everything again",
        Duration::from_secs(60),
        || {
            first.assert_running();
            let text = scrape_metrics(&first_metrics);
            (metric_value(&text, "tally_assigned_partitions") == Some(PARTITIONS as f64))
                .then_some(())
        },
    );
    thread::sleep(Duration::from_secs(4));
    let settled = started.elapsed();

    let workload = producer.stop();
    let hwms = run.hwms(workload.events.len());
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        first.assert_running()
    });
    run.assert_exact(&mut conn, &workload.truth);
    stop.store(true, Ordering::SeqCst);
    let samples = sampler.join().unwrap();

    // The partitions the first consumer never gave up.
    let log = first.log_text();
    let mut revoked = BTreeSet::new();
    for line in log.lines().filter(|l| l.contains("Partitions revoked.")) {
        let list = line.split("partitions=[").nth(1).unwrap_or("");
        for p in list.trim_end_matches(']').split(',') {
            if let Ok(p) = p.trim().trim_end_matches(']').parse::<i32>() {
                revoked.insert(p);
            }
        }
    }
    let kept: Vec<i32> = (0..PARTITIONS).filter(|p| !revoked.contains(p)).collect();
    let text = scrape_metrics(&first_metrics);
    let rebalances = metric_value(&text, "tally_rebalances_total").unwrap_or(0.0);
    let mut stalls = BTreeMap::new();
    for &p in &kept {
        stalls.insert(p, longest_stall(&samples, p, (scale_up, settled)));
    }
    eprintln!(
        "[e2e_scale] {} events exact; {rebalances} rebalances; first consumer gave up {revoked:?} \
         and kept {kept:?}; longest stall of a kept partition during the scaling: {stalls:?}",
        workload.events.len()
    );
    assert!(rebalances >= 2.0, "rebalances counted: {rebalances}");
    assert!(
        !kept.is_empty() && kept.len() < PARTITIONS as usize,
        "cooperative-sticky keeps some partitions and moves others; revoked {revoked:?}"
    );
    for (p, stall) in stalls {
        assert!(
            stall < Duration::from_secs(3),
            "partition {p}, never revoked, stood still for {stall:?} during the rebalances"
        );
    }
    let status = first.sigterm_and_wait(Duration::from_secs(30));
    assert!(status.success());
}
