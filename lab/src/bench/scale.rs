//! Cost against scale: Redis writes, scripts and CPU per event for 1, 2 and
//! 4 consumers over 8 and 32 partitions, at the latency phase's rate.
//!
//! The rows this machine can run are measured ([`super::fleet`]): as many
//! `tally run` processes as the row names, in one consumer group, on a topic
//! of their own. The others (more processes than cores) are simulated, and
//! the table says so and why. The simulation replays the workload's own
//! generator (`tally_lab::generate::Traffic`, same shape) through tally's
//! batching rule: events spread over partitions by their user, as the
//! producers key them; one batch per partition per flush interval; one
//! counter write per distinct (post, bucket) in a batch, with one bucket per
//! post and 64 for a post above the promotion threshold. A consumer batches
//! each of its partitions on its own, so the count of consumers changes how
//! the partitions are shared out, not what one batch holds: per event, the
//! writes and scripts depend on the partitions and the rate alone. A
//! simulated row's consumer CPU per event is that of the measured row with the
//! most processes on as many partitions, and its Redis CPU is that row's Redis
//! CPU per counter write times the simulated writes (without a measured row,
//! the set-up run's figures). The table also sets the simulated writes beside
//! the measured ones, which shows how far the simulation can be trusted.

use std::fmt::Write as _;

use rustc_hash::{FxHashMap, FxHashSet};

use super::Measured;
use super::fleet::{self, CONSUMERS, PARTITIONS, Row};
use tally::domain::routing::{bucket_of, stable_hash};
use tally::infra::config::{
    DEFAULT_BUCKETS, DEFAULT_FLUSH_INTERVAL_MS, DEFAULT_HOT_BUCKETS, DEFAULT_PROMOTE_ABOVE,
};
use tally_lab::generate::{Traffic, TrafficShape};

/// Seconds of traffic each simulated row replays.
const SIMULATED_SECS: u64 = 10;

/// Writes and scripts per event for `partitions` at `rate` events/s.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PerEvent {
    writes: f64,
    scripts: f64,
}

/// Replays `SIMULATED_SECS` of `shape` at `rate` through per-partition batches.
fn simulate(shape: &TrafficShape, rate: u64, partitions: u32) -> PerEvent {
    let events = rate * SIMULATED_SECS;
    let per_window = (rate * DEFAULT_FLUSH_INTERVAL_MS / 1000).max(1);
    let mut traffic = Traffic::new(shape.clone(), 42);
    let sample: Vec<(u64, u64)> = (0..events)
        .map(|_| {
            let e = traffic.next_event();
            (e.post_id, e.user_id)
        })
        .collect();
    let mut per_post: FxHashMap<u64, u64> = FxHashMap::default();
    for &(post, _) in &sample {
        *per_post.entry(post).or_default() += 1;
    }
    let hot_above = DEFAULT_PROMOTE_ABOVE * SIMULATED_SECS;
    let (mut writes, mut scripts) = (0u64, 0u64);
    for window in sample.chunks(per_window as usize) {
        let mut batches: Vec<FxHashSet<(u64, u32)>> =
            vec![FxHashSet::default(); partitions as usize];
        for &(post, user) in window {
            let buckets = if per_post[&post] > hot_above {
                DEFAULT_HOT_BUCKETS
            } else {
                DEFAULT_BUCKETS
            };
            let partition = (stable_hash(user) % u64::from(partitions)) as usize;
            batches[partition].insert((post, bucket_of(user, buckets)));
        }
        for batch in batches.iter().filter(|b| !b.is_empty()) {
            writes += batch.len() as u64;
            scripts += 1;
        }
    }
    PerEvent {
        writes: writes as f64 / events as f64,
        scripts: scripts as f64 / events as f64,
    }
}

/// The table, from the workload's `shape`, the `rate` of its latency phase,
/// the rows measured at that rate (`fleet`) and tally's set-up run (one
/// consumer, `measured_partitions`), whose figures stand in for rows of
/// partitions `fleet` did not measure.
pub(super) fn table(
    out: &mut String,
    shape: &TrafficShape,
    rate: u64,
    tally: &Measured,
    measured_partitions: u32,
    fleet: &[Row],
) -> std::fmt::Result {
    let setup = match (
        tally.writes_per_event(),
        tally.cpu_per_million(),
        tally.consumer_cpu_per_million(),
    ) {
        (Some(writes), Some(redis_cpu), Some(consumer_cpu)) => {
            Some((consumer_cpu, redis_cpu / writes.max(1e-9)))
        }
        _ => None,
    };
    if fleet.is_empty() && setup.is_none() {
        return Ok(());
    }
    let cores = fleet::cores();
    let secs = fleet.first().map_or(0, |row| row.secs);
    let basis_text = if fleet.is_empty() {
        format!(
            "the set-up run above (1 consumer on {measured_partitions} partitions): its consumer CPU per event and its Redis CPU per counter write"
        )
    } else {
        "the measured row with the most processes on as many partitions: its consumer CPU per event and its Redis CPU per counter write".to_string()
    };
    writeln!(
        out,
        "\nCost against scale at {} events/s (the latency phase's rate, {} ms batches). A measured row ran that many `tally run` \
         processes in one consumer group for {secs} s on an empty topic of its own, every process holding partitions; \
         a simulated row replays {SIMULATED_SECS} s of the same generator through tally's batching for its writes and scripts, \
         with the CPU figures of {basis_text}.\n",
        crate::markdown::thousands(rate),
        DEFAULT_FLUSH_INTERVAL_MS,
    )?;
    writeln!(
        out,
        "| consumers | partitions | consumer CPU s / 1M events | Redis writes / event | scripts / s | Redis CPU s / 1M events | source |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---|")?;
    let mut against = Vec::new();
    for partitions in PARTITIONS {
        let simulated = simulate(shape, rate, partitions);
        let basis = fleet
            .iter()
            .filter(|row| row.partitions == partitions)
            .max_by_key(|row| row.consumers);
        if let Some(basis) = basis {
            against.push(format!(
                "{partitions} partitions {:.3} simulated, {:.3} measured ({} processes)",
                simulated.writes,
                basis.writes_per_event(),
                basis.consumers
            ));
        }
        for consumers in CONSUMERS {
            let measured = fleet
                .iter()
                .find(|row| row.partitions == partitions && row.consumers == consumers);
            if let Some(row) = measured {
                writeln!(
                    out,
                    "| {consumers} | {partitions} | {:.2} | {:.3} | {:.0} | {:.2} | {} |",
                    row.consumer_cpu_per_million(),
                    row.writes_per_event(),
                    row.scripts_per_sec(),
                    row.redis_cpu_per_million(),
                    measured_source(row)
                )?;
                continue;
            }
            let (consumer_cpu, per_write, from) = match (basis, setup) {
                (Some(row), _) => (
                    row.consumer_cpu_per_million(),
                    row.redis_cpu_per_million_writes(),
                    format!("CPU of the measured {}-process row", row.consumers),
                ),
                (None, Some((consumer_cpu, per_write))) => {
                    (consumer_cpu, per_write, "CPU of the set-up run".to_string())
                }
                (None, None) => continue,
            };
            let from = format!("{from}, Redis at {per_write:.2} µs per counter write");
            let why = if consumers > cores {
                format!("{consumers} processes, {cores} cores")
            } else {
                "not run".to_string()
            };
            writeln!(
                out,
                "| {consumers} | {partitions} | {consumer_cpu:.2} | {:.3} | {:.0} | {:.2} | simulated ({why}; {from}) |",
                simulated.writes,
                simulated.scripts * rate as f64,
                simulated.writes * per_write,
            )?;
        }
    }
    if !against.is_empty() {
        writeln!(
            out,
            "\nRedis writes / event, simulated against measured: {}.",
            against.join("; ")
        )?;
    }
    Ok(())
}

/// The source column of a measured row: its processes, the partitions each
/// held, the rate reached and the sampled counts.
fn measured_source(row: &Row) -> String {
    let held = |held: &[u32]| {
        held.iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" + ")
    };
    let (start, end) = (held(&row.held.0), held(&row.held.1));
    let partitions = if start == end {
        format!("{start} partitions")
    } else {
        format!("{start} partitions, {end} at the end")
    };
    let rebalances = if row.rebalances > 0 {
        format!(", {} rebalances during the phase", row.rebalances)
    } else {
        String::new()
    };
    let (checked, wrong) = row.checked;
    let counts = if wrong == 0 {
        format!("{checked} of {checked} sampled counts exact")
    } else {
        format!("{wrong} of {checked} sampled counts WRONG")
    };
    format!(
        "measured: {} process{} ({partitions}{rebalances}), {} events/s reached, {counts}",
        row.consumers,
        if row.consumers == 1 { "" } else { "es" },
        crate::markdown::thousands(row.reached_rate)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_partitions_at_one_rate_mean_smaller_batches_and_more_writes() {
        let shape = TrafficShape {
            posts: 10_000,
            ..TrafficShape::default()
        };
        let few = simulate(&shape, 5_000, 8);
        let many = simulate(&shape, 5_000, 32);
        assert!(many.writes > few.writes, "{few:?} {many:?}");
        assert!(many.scripts > few.scripts, "{few:?} {many:?}");
        // At most one script per partition per window, at most one write per event.
        assert!(few.scripts <= 8.0 / 500.0 + 1e-9, "{few:?}");
        assert!(few.writes <= 1.0, "{few:?}");
    }

    #[test]
    fn measured_rows_say_so_and_the_rest_are_simulated_with_a_reason() {
        let shape = TrafficShape {
            posts: 10_000,
            ..TrafficShape::default()
        };
        let row = |consumers: u32| Row {
            consumers,
            partitions: 8,
            secs: 10,
            held: (
                vec![8 / consumers; consumers as usize],
                vec![8 / consumers; consumers as usize],
            ),
            events: 1_000_000,
            reached_rate: 100_000,
            produce_secs: 10.0,
            writes: 400_000,
            scripts: 650,
            consumer_cpu: 2.0,
            redis_cpu: 0.8,
            checked: (1100, 0),
            ..Row::default()
        };
        let mut out = String::new();
        table(
            &mut out,
            &shape,
            5_000,
            &Measured::default(),
            8,
            &[row(1), row(2)],
        )
        .unwrap();
        let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("| ")).collect();
        // The 32-partition rows have neither a measured row nor a set-up run to stand on.
        assert_eq!(lines.len(), 1 + 3, "{out}");
        assert!(lines[1].ends_with("| measured: 1 process (8 partitions), 100,000 events/s reached, 1100 of 1100 sampled counts exact |"), "{out}");
        assert!(
            lines[2].contains("| 0.400 | 65 | 0.80 | measured: 2 processes (4 + 4 partitions)"),
            "{out}"
        );
        if fleet::cores() < 4 {
            assert!(lines[3].contains("simulated (4 processes,"), "{out}");
        }
    }
}
