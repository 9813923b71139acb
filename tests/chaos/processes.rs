//! Faults of the consumers themselves: SIGKILL, scaling up and down, and a frozen zombie.

use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::*;
use crate::report::{Leaks, Row, resources};
use crate::steps::*;
use crate::{PARTITIONS, Settings};

/// A scenario with a first wave produced, and a single redis-server.
fn start(name: &str, s: &Settings) -> (Scenario, Workload, RedisServer) {
    let run = scenario(&format!("chaos_{name}"), name);
    let redis = RedisServer::start();
    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(s.first_wave);
    produce(&run.brokers, &run.topic, w.messages(first));
    (run, w, redis)
}

/// Scenario 1: two consumers; every 1–5 s a random live one is SIGKILLed and started again at
/// the next tick, while the broker may still count the dead member in the group.
pub fn random_kills(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let (run, w, redis) = start("kills", s);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0x6b11);
    // Small batches: more scripts in flight, so kills land mid-apply.
    let args = args_with(
        &run.tally_args(&redis.url()),
        None,
        &["--batch-max-events", "3000"],
    );
    let producer = run.stream(w, s.chunk, s.pause);
    let mut started = 0;
    let spawn = |started: &mut usize| {
        *started += 1;
        Tally::spawn_args(&format!("consumer-{started}"), &args)
    };
    let mut slots: Vec<Option<Tally>> = (0..2).map(|_| Some(spawn(&mut started))).collect();
    let mut kills = 0;
    while kills < s.kills {
        thread::sleep(Duration::from_millis(rng.random_range(1_000..=5_000)));
        for slot in slots.iter_mut() {
            match slot {
                Some(t) => t.assert_running(),
                None => *slot = Some(spawn(&mut started)),
            }
        }
        let live: Vec<usize> = (0..slots.len()).filter(|&i| slots[i].is_some()).collect();
        if live.is_empty() {
            continue;
        }
        let victim = live[rng.random_range(0..live.len())];
        slots[victim].take().expect("live").kill9();
        kills += 1;
        row.faults = format!("{kills} SIGKILL");
    }
    for slot in slots.iter_mut() {
        if slot.is_none() {
            *slot = Some(spawn(&mut started));
        }
    }
    thread::sleep(Duration::from_secs(2));
    let w = producer.stop();
    row.events = w.events.len();
    let hwms = run.hwms(w.events.len());
    let mut tallies: Vec<&mut Tally> = slots.iter_mut().filter_map(|t| t.as_mut()).collect();
    settle_single(row, &run, &redis, &w.truth, &hwms, &mut tallies);
    stop_all(&mut tallies);
}

/// Scenario 2: one steady consumer; three more join and leave (SIGTERM), again and again. After
/// every scale-down the steady consumer's RSS and open descriptors are sampled.
pub fn scaling(s: &Settings, row: &mut Row, leaks: &mut Leaks) {
    let (run, w, redis) = start("scaling", s);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0x5ca1e);
    let base = run.tally_args(&redis.url());
    let steady_addr = metrics_addr();
    let mut steady = Tally::spawn_args("steady", &args_with(&base, Some(&steady_addr), &[]));
    let owns_all = |t: &mut Tally, addr: &str| {
        t.assert_running();
        (assigned(addr) == Some(PARTITIONS as u32)).then_some(())
    };
    wait_for(
        "the steady consumer to own every partition",
        Duration::from_secs(60),
        || owns_all(&mut steady, &steady_addr),
    );
    let producer = run.stream(w, s.chunk, s.pause);
    let max_cycles = s.scale_cycles.max(60);
    let mut cycles = 0;
    loop {
        let addrs: Vec<String> = (0..3).map(|_| metrics_addr()).collect();
        let mut extra: Vec<Tally> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| {
                Tally::spawn_args(
                    &format!("extra-{cycles}-{i}"),
                    &args_with(&base, Some(a), &[]),
                )
            })
            .collect();
        wait_for(
            "four consumers to share the partitions",
            Duration::from_secs(90),
            || {
                steady.assert_running();
                let mut total = assigned(&steady_addr)?;
                if total == 0 {
                    return None;
                }
                for (t, a) in extra.iter_mut().zip(&addrs) {
                    t.assert_running();
                    let n = assigned(a)?;
                    if n == 0 {
                        return None;
                    }
                    total += n;
                }
                (total == PARTITIONS as u32).then_some(())
            },
        );
        thread::sleep(Duration::from_millis(rng.random_range(500..2_000)));
        // The three leave together, in the middle of the rebalance their SIGTERMs start.
        for t in extra.iter_mut() {
            t.sigterm();
        }
        for t in extra.iter_mut() {
            let status = t.wait_exit(Duration::from_secs(30));
            assert!(status.success(), "an extra consumer exited with {status}");
        }
        wait_for(
            "the steady consumer to own every partition again",
            Duration::from_secs(90),
            || owns_all(&mut steady, &steady_addr),
        );
        cycles += 1;
        leaks.rebalances = rebalances(&steady_addr).unwrap_or(0);
        if let Some((rss, fds)) = resources(steady.pid()) {
            leaks.samples.push((leaks.rebalances, rss, fds));
            eprintln!(
                "[chaos] scaling cycle {cycles}: {} rebalances, RSS {} KiB, {fds} fds",
                leaks.rebalances, rss
            );
        }
        row.faults = format!("{cycles}x 1-4-1, {} rebalances", leaks.rebalances);
        if (cycles >= s.scale_cycles && leaks.rebalances >= s.leak_rebalances)
            || cycles >= max_cycles
        {
            break;
        }
    }
    let w = producer.stop();
    row.events = w.events.len();
    let hwms = run.hwms(w.events.len());
    settle_single(row, &run, &redis, &w.truth, &hwms, &mut [&mut steady]);
    stop_all(&mut [&mut steady]);
}

/// Scenario 3: one of two consumers is frozen past its session timeout while events keep
/// arriving; a newcomer joins so live members own everything; then the zombie wakes up holding
/// batches for partitions it no longer owns.
pub fn zombie(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let (run, w, redis) = start("zombie", s);
    let base = run.tally_args(&redis.url());
    // Consumers hold their batches longer, so the frozen one is caught with work in hand.
    let slow = ["--flush-interval-ms", "1000", "--batch-max-events", "20000"];
    let mut members: Vec<(Tally, String)> = Vec::new();
    let join = |members: &mut Vec<(Tally, String)>| {
        let addr = metrics_addr();
        let name = format!("consumer-{}", members.len() + 1);
        members.push((
            Tally::spawn_args(&name, &args_with(&base, Some(&addr), &slow)),
            addr,
        ));
    };
    join(&mut members);
    join(&mut members);
    let share = |members: &mut [(Tally, String)], frozen: Option<usize>| {
        let mut total = 0;
        for (i, (t, addr)) in members.iter_mut().enumerate() {
            if Some(i) == frozen {
                continue;
            }
            t.assert_running();
            total += assigned(addr)?;
        }
        (total == PARTITIONS as u32).then_some(())
    };
    wait_for(
        "live consumers to own every partition",
        Duration::from_secs(90),
        || share(&mut members, None),
    );
    let producer = run.stream(w, s.chunk, s.pause);
    for round in 0..s.zombies {
        thread::sleep(Duration::from_millis(1_500));
        // The victim is a member that owns partitions now.
        let victim = (0..members.len())
            .find(|&i| assigned(&members[i].1).is_some_and(|n| n > 0))
            .expect("a member with partitions");
        members[victim].0.sigstop();
        let frozen = Instant::now();
        thread::sleep(SESSION_EXPIRY);
        join(&mut members);
        let newest = members.len() - 1;
        wait_for(
            "the live members to own every partition",
            Duration::from_secs(90),
            || {
                assigned(&members[newest].1).filter(|n| *n > 0)?;
                share(&mut members, Some(victim))
            },
        );
        // Let the new owners move past where the zombie stopped.
        thread::sleep(Duration::from_secs(3));
        members[victim].0.sigcont();
        eprintln!(
            "[chaos] zombie round {}: consumer frozen {:.1} s",
            round + 1,
            frozen.elapsed().as_secs_f64()
        );
        row.faults = format!("{} SIGSTOP+SIGCONT", round + 1);
        thread::sleep(Duration::from_secs(3));
    }
    let w = producer.stop();
    row.events = w.events.len();
    let hwms = run.hwms(w.events.len());
    let mut tallies: Vec<&mut Tally> = members.iter_mut().map(|(t, _)| t).collect();
    settle_single(row, &run, &redis, &w.truth, &hwms, &mut tallies);
    stop_all(&mut tallies);
}
