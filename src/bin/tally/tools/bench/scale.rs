//! Cost against scale: Redis writes, scripts and CPU per event for 1, 2 and
//! 4 consumers over 8 and 32 partitions, at the latency phase's rate.
//!
//! One machine runs one consumer on 8 partitions; the other rows are
//! simulated, and the table says so. The simulation replays the workload's
//! own generator (`tally::generate::Traffic`, same shape) through tally's
//! batching rule: events spread over partitions by their user, as the
//! producers key them; one batch per partition per flush interval; one
//! counter write per distinct (post, bucket) in a batch, with one bucket per
//! post and 64 for a post above the promotion threshold. A consumer batches
//! each of its partitions on its own, so the count of consumers changes how
//! the partitions are shared out, not what one batch holds: per event, the
//! writes and scripts depend on the partitions and the rate alone. Redis CPU
//! is estimated from the measured row's Redis CPU per counter write, and
//! consumer CPU per event is the measured figure, whose work per event (decode,
//! aggregate, build the script) does not depend on how many consumers share
//! the topic.

use std::fmt::Write as _;

use rustc_hash::{FxHashMap, FxHashSet};

use super::Measured;
use tally::domain::routing::{bucket_of, stable_hash};
use tally::generate::{Traffic, TrafficShape};
use tally::infra::config::{
    DEFAULT_BUCKETS, DEFAULT_FLUSH_INTERVAL_MS, DEFAULT_HOT_BUCKETS, DEFAULT_PROMOTE_ABOVE,
};

/// Seconds of traffic each simulated row replays.
const SIMULATED_SECS: u64 = 10;
/// The partitions and consumer counts of the table.
const PARTITIONS: [u32; 2] = [8, 32];
const CONSUMERS: [u32; 3] = [1, 2, 4];

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

/// The table, from the workload's `shape`, the `rate` of its latency phase and
/// tally's measured row (one consumer, `measured_partitions`).
pub(super) fn table(
    out: &mut String,
    shape: &TrafficShape,
    rate: u64,
    tally: &Measured,
    measured_partitions: u32,
) -> std::fmt::Result {
    let (Some(writes), Some(redis_cpu), Some(consumer_cpu)) = (
        tally.writes_per_event(),
        tally.cpu_per_million(),
        tally.consumer_cpu_per_million(),
    ) else {
        return Ok(());
    };
    let per_write = redis_cpu / writes.max(1e-9);
    writeln!(
        out,
        "\nCost against scale at {} events/s (the latency phase's rate, {} ms batches): the set-up run above is 1 consumer on \
         {measured_partitions} partitions; every row is simulated from {SIMULATED_SECS} s \
         of the same generator, with Redis CPU at the measured {:.2} µs per counter write.\n",
        super::report::thousands(rate),
        DEFAULT_FLUSH_INTERVAL_MS,
        per_write
    )?;
    writeln!(
        out,
        "| consumers | partitions | consumer CPU s / 1M events | Redis writes / event | scripts / s | Redis CPU s / 1M events | source |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---|")?;
    for partitions in PARTITIONS {
        let simulated = simulate(shape, rate, partitions);
        for consumers in CONSUMERS {
            let source = if consumers == 1 && partitions == measured_partitions {
                "simulated; the set-up run above"
            } else {
                "simulated"
            };
            writeln!(
                out,
                "| {consumers} | {partitions} | {consumer_cpu:.2} | {:.3} | {:.0} | {:.2} | {source} |",
                simulated.writes,
                simulated.scripts * rate as f64,
                simulated.writes * per_write,
            )?;
        }
    }
    Ok(())
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
}
