//! The dedupe window's price at the peak: the memory it holds, the time it
//! covers, and the re-read every assignment starts with.
//!
//! A window of `W` offsets is a flat table of fingerprints sized once for
//! its largest content: two entries per record (the keyed id and the
//! (post, user)) over `W` offsets and one block more, at most 85% full. It
//! costs what [`Window::heap_bytes`](tally::pipeline::dedupe::Window::heap_bytes)
//! counts for it: [`MEASURED_BYTES_PER_EVENT`] is that figure per record of
//! a full window of a realistic mix, measured by the test below, which fails
//! when the window's layout changes and the figure no longer holds.
//!
//! The re-read is `W` offsets and up to a block more with `--dedupe ids`;
//! `ids-and-actions` reads twice that, since the action rule needs the id
//! verdicts of the records of the window.

use serde::Serialize;

use super::{Kafka, PlanArgs};

/// Heap bytes a remembered event costs a full dedupe window: its share of
/// the fingerprint table, eight bytes an entry, two entries a record, at the
/// table's load. Measured by `the_price_of_a_remembered_event_is_measured`
/// over windows of 40,000 to 80,000 offsets; the table is sized by the window,
/// so the figure does not move with it.
pub const MEASURED_BYTES_PER_EVENT: f64 = 23.1;

/// The dedupe window of a plan.
#[derive(Debug, Clone, Serialize)]
pub struct Dedupe {
    /// Offsets per partition the window spans, as `tally run --dedupe-window`.
    pub window: u64,
    /// Heap bytes one remembered event costs.
    pub bytes_per_event: f64,
    /// Heap bytes of one partition's full window.
    pub bytes_per_partition: f64,
    /// Partitions the busiest consumer owns.
    pub partitions_per_consumer: u32,
    /// Heap bytes of the busiest consumer's windows.
    pub bytes_per_consumer: f64,
    /// Seconds of record time the window covers at the peak rate of a partition:
    /// repeats further apart than this are counted.
    pub covers_seconds: f64,
    /// Seconds one partition's window takes to re-read at assignment.
    pub reread_partition_seconds: f64,
    /// Seconds the busiest consumer takes to re-read all its windows (a
    /// restart, or an assignment of its whole share).
    pub reread_consumer_seconds: f64,
}

/// The window's price, when `--dedupe-window` asks for one.
pub fn dedupe(args: &PlanArgs, kafka: &Kafka) -> Option<Dedupe> {
    let window = args.dedupe_window?;
    let w = window as f64;
    let share = kafka.partitions.div_ceil(kafka.consumers.max(1)).max(1);
    let reread = args.reread_events.unwrap_or(args.consumer_events);
    let per_partition = w * args.dedupe_bytes;
    Some(Dedupe {
        window,
        bytes_per_event: args.dedupe_bytes,
        bytes_per_partition: per_partition,
        partitions_per_consumer: share,
        bytes_per_consumer: per_partition * f64::from(share),
        covers_seconds: w / kafka.events_per_partition,
        reread_partition_seconds: w / reread,
        reread_consumer_seconds: w * f64::from(share) / reread,
    })
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use tally::pipeline::decode::{EventId, Like};
    use tally::pipeline::dedupe::{DedupeMode, DedupeSettings, Window};

    use super::*;

    /// Heap bytes per remembered event of a full window of `span` offsets fed
    /// a realistic mix: 70% of records carry an id of their own, the rest are
    /// id-less actions of pairs drawn from a pool, so some pairs come back
    /// within the window (one entry in the queue, none more in the map) and
    /// some do not.
    fn measured(span: u64) -> f64 {
        let settings = DedupeSettings {
            mode: DedupeMode::IdsAndActions,
            span,
        };
        let mut window = Window::new(settings, Some(0));
        let mut rng = SmallRng::seed_from_u64(span);
        let pairs = span / 2;
        let mut most = 0.0f64;
        for offset in 0..2 * span as i64 {
            let id = rng.random_bool(0.7);
            let user = if id {
                rng.random()
            } else {
                rng.random_range(0..pairs)
            };
            let like = Like {
                post_id: 1 + user % 997,
                user_id: user,
                delta: if rng.random_bool(0.8) { 1 } else { -1 },
                event_time_ms: 0,
            };
            let event = id.then(|| EventId::of(&offset.to_le_bytes()));
            window.observe(offset, offset, &like, event);
            // Full from here on: the window holds every record of its span.
            if offset >= span as i64 {
                most = most.max(window.heap_bytes() as f64 / window.len() as f64);
            }
        }
        most
    }

    #[test]
    fn the_price_of_a_remembered_event_is_measured() {
        // The worst over a range of windows, in case the table's rounding
        // to its growth steps made some sizes dearer.
        let sizes: Vec<u64> = (0..=16).map(|k| 40_000 + 2_500 * k).collect();
        let each: Vec<f64> = sizes.iter().map(|&s| measured(s)).collect();
        let worst = each.iter().copied().fold(0.0, f64::max);
        println!("heap bytes per remembered event, windows of {sizes:?}: {each:.2?}");
        assert!(
            MEASURED_BYTES_PER_EVENT >= worst && MEASURED_BYTES_PER_EVENT < worst + 1.0,
            "MEASURED_BYTES_PER_EVENT is {MEASURED_BYTES_PER_EVENT}; measured {worst:.1}"
        );
    }
}
