//! A zombie consumer: two members share a group; one is frozen (SIGSTOP) past its session
//! timeout while events keep arriving, so the group hands its partitions to the other; then it
//! wakes up (SIGCONT) still holding batches for partitions it no longer owns. Kafka fences its
//! commits, not its Redis writes: only the Redis-side fence keeps the counts exact.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::*;

const PARTITIONS: i32 = 8;
const FIRST_WAVE: usize = 60_000;
/// Events keep arriving at about CHUNK / PAUSE from the first split to the end of the freeze.
const CHUNK: usize = 1_000;
const PAUSE: Duration = Duration::from_millis(200);

fn batches(metrics_addr: &str) -> String {
    match try_scrape_metrics(metrics_addr) {
        Ok(text) => metric_series(&text, "tally_batches_total")
            .iter()
            .map(|(labels, v)| format!("{labels} {v}"))
            .collect::<Vec<_>>()
            .join(", "),
        Err(e) => format!("unreadable ({e})"),
    }
}

#[test]
fn frozen_member_cannot_double_count_after_waking() {
    let run = Scenario::new("e2e_zombie", "zombie", PARTITIONS);
    let redis = RedisServer::start();

    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(FIRST_WAVE);
    produce(&run.brokers, &run.topic, w.messages(first));

    let base = run.tally_args(&redis.url());
    let with_metrics = |addr: &str, extra: &[&str]| {
        let mut args = base.clone();
        args.extend(
            ["--metrics-addr", addr]
                .iter()
                .chain(extra)
                .map(|s| s.to_string()),
        );
        args
    };
    let addr_a = format!("127.0.0.1:{}", free_port());
    let addr_b = format!("127.0.0.1:{}", free_port());

    let mut a = Tally::spawn_args("consumer-a", &with_metrics(&addr_a, &[]));
    wait_for(
        "consumer-a to own every partition",
        Duration::from_secs(60),
        || {
            a.assert_running();
            (assigned_partitions(&addr_a) == Some(f64::from(PARTITIONS))).then_some(())
        },
    );
    // The zombie-to-be holds its batches longer, so it is caught with work in hand.
    let slow = ["--flush-interval-ms", "1000", "--batch-max-events", "20000"];
    let mut b = Tally::spawn_args("consumer-b", &with_metrics(&addr_b, &slow));
    wait_for(
        "consumer-a and consumer-b to share the partitions",
        Duration::from_secs(90),
        || {
            a.assert_running();
            b.assert_running();
            let (na, nb) = (assigned_partitions(&addr_a)?, assigned_partitions(&addr_b)?);
            (na > 0.0 && nb > 0.0 && na + nb == f64::from(PARTITIONS)).then_some(())
        },
    );
    eprintln!(
        "[e2e_zombie] split: a={:?} b={:?}",
        assigned_partitions(&addr_a),
        assigned_partitions(&addr_b)
    );

    // Events keep arriving for the whole freeze.
    let producer = run.stream(w, CHUNK, PAUSE);

    thread::sleep(Duration::from_millis(1500));
    b.sigstop();
    let frozen = Instant::now();
    // The broker expires the frozen member after its session timeout and hands its partitions
    // to consumer-a, while consumer-b sleeps with batches in hand.
    wait_for(
        "consumer-a to own every partition again",
        Duration::from_secs(60),
        || {
            a.assert_running();
            (assigned_partitions(&addr_a) == Some(f64::from(PARTITIONS))).then_some(())
        },
    );
    eprintln!(
        "[e2e_zombie] {:.1} s into the freeze: a={:?}",
        frozen.elapsed().as_secs_f64(),
        assigned_partitions(&addr_a)
    );
    // Let the new owners move every partition past where the zombie stopped.
    thread::sleep(Duration::from_secs(3));
    b.sigcont();
    eprintln!(
        "[e2e_zombie] consumer-b was frozen {:.1} s",
        frozen.elapsed().as_secs_f64()
    );
    thread::sleep(Duration::from_secs(3));
    let w = producer.stop();
    eprintln!("[e2e_zombie] {}", w.describe());

    let hwms = run.hwms(w.events.len());
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(150), || {
        a.assert_running();
        b.assert_running();
    });
    for (name, addr) in [("a", &addr_a), ("b", &addr_b)] {
        eprintln!("[e2e_zombie] consumer-{name} batches: {}", batches(addr));
    }

    run.assert_exact(&mut conn, &w.truth);

    for t in [&mut b, &mut a] {
        let status = t.sigterm_and_wait(Duration::from_secs(20));
        assert!(
            status.success(),
            "consumer exited with {status} after SIGTERM"
        );
    }
}
