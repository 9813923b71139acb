//! A producer that delivers at least once: records repeated by event id, id-less double taps and
//! like-like-unlike sequences, while consumers are SIGKILLed and the group rebalances.

use std::thread;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::*;
use crate::report::{Leaks, Row};
use crate::steps::*;
use crate::{PARTITIONS, Settings};

/// Offsets per partition the window spans; every repeat lands closer than this.
const WINDOW: usize = 4_000;
/// How far back (records of its partition) a repeat may reach: 1,500 records of a partition are
/// several producer chunks, so a record and its repeat often straddle a kill or a rebalance.
const REACH: usize = 1_500;

/// Scenario 11: the producer sends records with event ids and a share of them again (same id,
/// a new offset; some in the same batch, some up to `REACH` records of the partition later),
/// plus id-less double taps and like-like-unlike sequences. Two consumers run with
/// `--dedupe ids-and-actions`; some are SIGKILLed, and a third joins and leaves, so every
/// partition's window is rebuilt by new owners while repeats keep arriving. The truth counts
/// each like once; `tally verify` must agree under the same rule and, without it, find the
/// repeats as drift.
pub fn duplicates(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let run = scenario("chaos_duplicates", "dupes");
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0xd0b1e);
    let redis = RedisServer::start();
    let mut dupes = Dupes::new(run.seed, PARTITIONS, REACH);
    produce(&run.brokers, &run.topic, dupes.grow(s.first_wave));
    let window = WINDOW.to_string();
    let dedupe = [
        "--dedupe",
        "ids-and-actions",
        "--dedupe-window",
        window.as_str(),
        // Small batches: a record and its repeat often fall in different batches.
        "--batch-max-events",
        "1000",
    ];
    let args = args_with(&run.tally_args(&redis.url()), None, &dedupe);
    let mut started = 0;
    let mut spawn = || {
        started += 1;
        Tally::spawn_args(&format!("consumer-{started}"), &args)
    };
    let mut tallies = [spawn(), spawn()];
    let producer = dupes.stream(&run.brokers, &run.topic, s.chunk, s.pause);

    // Half the kills of `kills`: each one makes the next owner re-read the windows below its
    // fences, which is what this scenario is about; more would only repeat it.
    let kills = (s.kills / 2).max(1);
    let joins_after = (kills / 2).max(1);
    let mut joined = false;
    let faults = |kill: usize, joined: bool| match joined {
        true => format!("{kill} SIGKILL, 1 join+leave"),
        false => format!("{kill} SIGKILL"),
    };
    for kill in 1..=kills {
        thread::sleep(Duration::from_millis(rng.random_range(1_000..=4_000)));
        for t in tallies.iter_mut() {
            t.assert_running();
        }
        let victim = rng.random_range(0..tallies.len());
        tallies[victim].kill9();
        tallies[victim] = spawn();
        if kill == joins_after {
            // A third member: partitions move to it and back, and each new owner rebuilds
            // their windows while the other members keep theirs.
            let addr = metrics_addr();
            let mut extra = Tally::spawn_args("joiner", &args_with(&args, Some(&addr), &[]));
            wait_for(
                "the joining consumer to own partitions",
                Duration::from_secs(90),
                || {
                    extra.assert_running();
                    assigned(&addr).filter(|n| *n > 0)
                },
            );
            thread::sleep(Duration::from_secs(2));
            stop_all(&mut [&mut extra]);
            joined = true;
        }
        row.faults = faults(kill, joined);
    }
    let dupes = producer.stop();
    row.events = dupes.unique();
    row.faults = format!(
        "{}; {} records: {} repeated ids, {} repeated actions",
        faults(kills, joined),
        dupes.records,
        dupes.id_repeats,
        dupes.action_repeats
    );
    let hwms = run.hwms(dupes.records);
    let mut refs: Vec<&mut Tally> = tallies.iter_mut().collect();
    settle_single(row, &run, &redis, &dupes.truth, &hwms, &mut refs);
    stop_all(&mut refs);

    // verify walks the log from the origin by the same rule; without it, the repeats are drift,
    // so the truth above is not one that counting every record would also meet.
    let same = verify(&args, "ids-and-actions");
    assert!(same.contains("; 0 drift"), "verify, same rule: {same}");
    let off = verify(&args, "off");
    assert!(!off.contains("; 0 drift"), "verify, dedupe off: {off}");
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
