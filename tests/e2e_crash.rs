//! SIGKILL the consumer at random moments, again and again, while events keep arriving.
//! Whatever a crash interrupted (a batch half sent, an offset not committed), the restarted
//! consumer must end with every post's count exactly right.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PARTITIONS: i32 = 8;
const FIRST_WAVE: usize = 100_000;
/// Events keep arriving at about CHUNK / PAUSE while the consumer crashes and restarts.
const CHUNK: usize = 1_000;
const PAUSE: Duration = Duration::from_millis(150);
const KILLS: usize = 6;

/// Offsets applied so far over every partition.
fn applied(conn: &mut redis::Connection, prefix: &str, group: &str, topic: &str) -> i64 {
    applied_offsets(conn, prefix, group, topic, PARTITIONS as usize)
        .iter()
        .sum()
}

#[test]
fn repeated_sigkill_loses_and_doubles_nothing() {
    let run = Scenario::new("e2e_crash", "crash", PARTITIONS);
    let (brokers, topic, group, prefix) = (&run.brokers, &run.topic, &run.group, &run.prefix);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0x00c0_ffee);
    let redis = RedisServer::start();

    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(FIRST_WAVE);
    produce(brokers, topic, w.messages(first));
    eprintln!("[e2e_crash] first wave of {FIRST_WAVE} produced");

    // A steady stream for the whole test, so every kill lands while batches are being applied.
    let producer = run.stream(w, CHUNK, PAUSE);

    // Small batches: more scripts in flight, so a kill lands mid-apply more often.
    let mut args = run.tally_args(&redis.url());
    args.extend(["--batch-max-events", "3000"].map(String::from));
    let mut conn = redis.conn();
    let mut tally = Tally::spawn_args("tally-1", &args);
    for kill in 1..=KILLS {
        // Kill only once this process is applying, at a random moment after that.
        let at_start = applied(&mut conn, prefix, group, topic);
        let started = Instant::now();
        wait_for(
            "the restarted consumer to apply",
            Duration::from_secs(60),
            || {
                tally.assert_running();
                (applied(&mut conn, prefix, group, topic) > at_start).then_some(())
            },
        );
        let active_after = started.elapsed();
        let pause = Duration::from_millis(rng.random_range(300..3000));
        thread::sleep(pause);
        tally.assert_running();
        let now = applied(&mut conn, prefix, group, topic);
        eprintln!(
            "[e2e_crash] kill {kill}/{KILLS}: applying {:.1} s after start, killed {:.1} s later; {now} messages behind fences",
            active_after.as_secs_f64(),
            pause.as_secs_f64()
        );
        tally.kill9();
        tally = Tally::spawn_args(&format!("tally-{}", kill + 1), &args);
    }
    let w = producer.stop();
    eprintln!("[e2e_crash] {}", w.describe());

    let hwms = run.hwms(w.events.len());
    let started = Instant::now();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(150), || {
        tally.assert_running()
    });
    eprintln!(
        "[e2e_crash] caught up {:.1} s after the producer stopped",
        started.elapsed().as_secs_f64()
    );

    run.assert_exact(&mut conn, &w.truth);

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}
