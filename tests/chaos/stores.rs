//! Faults of Redis: a server killed and restarted from its AOF, a cluster resharded and failed
//! over, and scripts flushed away under the consumer.

use std::thread;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::cluster::RedisCluster;
use crate::common::*;
use crate::report::{Leaks, Row};
use crate::steps::*;
use crate::{PARTITIONS, Settings};

/// Scenario 4: redis-server (AOF, everysec) is SIGKILLed and restarted, several times; every
/// other restart first cuts the AOF's tail, as a machine that went down before its last second
/// reached the disk would.
pub fn redis_restarts(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let run = scenario("chaos_redis", "redis");
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0xa0f);
    let mut redis = RedisServer::start_with_aof();
    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(s.first_wave);
    produce(&run.brokers, &run.topic, w.messages(first));
    let args = args_with(
        &run.tally_args(&redis.url()),
        None,
        &["--batch-max-events", "5000"],
    );
    let mut tally = Tally::spawn_args("consumer", &args);
    let producer = run.stream(w, s.chunk, s.pause);
    let mut cut_total = 0;
    for restart in 1..=s.redis_restarts {
        thread::sleep(Duration::from_millis(rng.random_range(1_000..3_000)));
        tally.assert_running();
        redis.kill();
        if restart % 2 == 0 {
            cut_total += redis.truncate_aof_tail(rng.random_range(16_000..512_000));
        }
        thread::sleep(Duration::from_millis(rng.random_range(200..1_500)));
        redis.restart();
        row.faults = format!(
            "{restart} SIGKILL+restart ({} KiB AOF cut)",
            cut_total / 1024
        );
    }
    let w = producer.stop();
    row.events = w.events.len();
    let hwms = run.hwms(w.events.len());
    settle_single(row, &run, &redis, &w.truth, &hwms, &mut [&mut tally]);
    stop_all(&mut [&mut tally]);
}

/// Scenario 7: SCRIPT FLUSH on the server every 0.3–1.5 s while batches are applied.
pub fn script_flush(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let run = scenario("chaos_flush", "flush");
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0xf105);
    let redis = RedisServer::start();
    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(s.first_wave);
    produce(&run.brokers, &run.topic, w.messages(first));
    let args = args_with(
        &run.tally_args(&redis.url()),
        None,
        &["--batch-max-events", "2000"],
    );
    let mut tally = Tally::spawn_args("consumer", &args);
    let producer = run.stream(w, s.chunk, s.pause);
    let mut conn = redis.conn();
    for flush in 1..=s.flushes {
        thread::sleep(Duration::from_millis(rng.random_range(300..1_500)));
        tally.assert_running();
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut conn)
            .expect("SCRIPT FLUSH");
        row.faults = format!("{flush} SCRIPT FLUSH");
    }
    let w = producer.stop();
    row.events = w.events.len();
    let hwms = run.hwms(w.events.len());
    settle_single(row, &run, &redis, &w.truth, &hwms, &mut [&mut tally]);
    stop_all(&mut [&mut tally]);
}

/// Slot groups the cluster scenario spreads counters over.
const GROUPS: usize = 16;

/// Scenario 5: a cluster of 3 primaries with a replica each; per round, 1,000 slots move between
/// primaries, every primary's scripts are flushed, and a primary is SIGKILLed (its replica takes
/// over) and comes back as a replica.
pub fn cluster(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let mut cluster = RedisCluster::start(3, 1);
    let run = scenario("chaos_cluster", "cluster");
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0xc105);
    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(s.first_wave);
    produce(&run.brokers, &run.topic, w.messages(first));
    let args = args_with(
        &run.tally_args(&cluster.url()),
        None,
        &["--slot-groups", &GROUPS.to_string()],
    );
    let mut tally = Tally::spawn_args("consumer", &args);
    let producer = run.stream(w, s.chunk, s.pause);
    let (mut moved, mut flushes, mut failovers) = (0, 0, 0);
    for round in 0..s.cluster_rounds {
        thread::sleep(Duration::from_millis(rng.random_range(1_500..3_000)));
        tally.assert_running();
        let primaries = cluster.primaries();
        let from = round % primaries.len();
        let to = (from + 1) % primaries.len();
        cluster.reshard(&primaries[from].1, &primaries[to].1, 1_000);
        moved += 1_000;
        cluster.script_flush_all();
        flushes += 1;
        let (victim, _) = cluster.primaries()[rng.random_range(0..3)].clone();
        cluster.node_mut(victim).kill();
        thread::sleep(Duration::from_secs(5));
        cluster.restart(victim);
        cluster.wait_ok();
        failovers += 1;
        row.faults = format!("{moved} slots moved, {flushes} flush, {failovers} failover");
    }
    thread::sleep(Duration::from_secs(2));
    let w = producer.stop();
    row.events = w.events.len();
    let hwms = run.hwms(w.events.len());
    row.settle(
        || {
            cluster.wait_applied(
                &run.prefix,
                &run.group,
                &run.topic,
                &hwms,
                GROUPS,
                Duration::from_secs(180),
                || tally.assert_running(),
            )
        },
        || cluster.read_counts(&run.prefix),
        &w.truth,
    );
    assert!(
        !tally.log_text().contains("CROSSSLOT"),
        "CROSSSLOT in the consumer's log"
    );
    stop_all(&mut [&mut tally]);
}
