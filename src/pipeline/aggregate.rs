//! Aggregate: sum one partition's likes per (post, bucket) into a batch.
//!
//! Invariant: a batch covers a contiguous offset range `start..=last` of one
//! partition and holds the net delta of every good event in that range that
//! its slot group still needs; bad events, and events their group already has,
//! are part of the range too (they are "applied" as nothing).
//! Nothing is allocated per event: deltas go into a hash map that is reused
//! from batch to batch.
//!
//! With windows of trending counts (see [`crate::domain::windows`]) a batch
//! also sums each post's net likes per window, for the slot group of the
//! post's bucket 0, which applies them; a like its window group already has
//! is not added there, whatever its counter's group needs.

use std::time::Instant;

use rustc_hash::FxHashMap;

pub use crate::domain::routing::CounterId;
use crate::domain::slots::SlotGroups;

/// Size limits that close a batch.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Close after this many messages (good and bad).
    pub max_events: u64,
    /// Close after this many distinct (post, bucket) counters.
    pub max_keys: usize,
}

/// The open batch of one partition.
#[derive(Debug)]
pub struct Batch {
    start: Option<i64>,
    last: i64,
    messages: u64,
    bad: u64,
    /// Net delta and number of events per counter.
    deltas: FxHashMap<CounterId, (i64, u32)>,
    /// Net delta per post and window.
    windows: FxHashMap<WindowCell, i64>,
    /// Likes too late for a window of theirs.
    late: u64,
    opened_at: Option<Instant>,
}

/// One post in one window: the window size's index among the prefix's
/// sizes, and the window's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WindowCell {
    /// The index of the window's size.
    pub size: u8,
    /// The window's start (milliseconds since the epoch).
    pub start: i64,
    /// The post.
    pub post_id: u64,
}

impl Default for Batch {
    fn default() -> Self {
        Self::new()
    }
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self {
            start: None,
            last: -1,
            messages: 0,
            bad: 0,
            deltas: FxHashMap::default(),
            windows: FxHashMap::default(),
            late: 0,
            opened_at: None,
        }
    }

    /// Whether the batch covers no message yet.
    pub fn is_empty(&self) -> bool {
        self.messages == 0
    }

    /// Opens the range at `start` on the first message (the consumer's position,
    /// which may be below the message's own offset).
    fn open(&mut self, start: i64, offset: i64) {
        if self.messages == 0 {
            self.start = Some(start.min(offset));
            self.opened_at = Some(Instant::now());
        }
        self.messages += 1;
        self.last = offset;
    }

    /// Adds a good event's delta at `offset`; `start` is where the consumer's
    /// range began.
    pub fn add(&mut self, start: i64, offset: i64, id: CounterId, delta: i64) {
        self.open(start, offset);
        let entry = self.deltas.entry(id).or_insert((0, 0));
        entry.0 += delta;
        entry.1 += 1;
    }

    /// Adds a like's delta to its post's count in one window; the like was
    /// added (or covered) first, at its offset.
    pub fn add_window(&mut self, cell: WindowCell, delta: i64) {
        *self.windows.entry(cell).or_insert(0) += delta;
    }

    /// Notes a like too late for a window of its.
    pub fn add_late(&mut self) {
        self.late += 1;
    }

    /// Covers an event its slot group already has (after a straddle or a
    /// crash between scripts): it extends the range and changes no counter.
    pub fn add_applied(&mut self, start: i64, offset: i64) {
        self.open(start, offset);
    }

    /// Adds a bad message at `offset`: it extends the range and changes no counter.
    pub fn add_bad(&mut self, start: i64, offset: i64) {
        self.open(start, offset);
        self.bad += 1;
    }

    /// Whether a size limit is reached.
    pub fn is_full(&self, limits: &Limits) -> bool {
        self.messages >= limits.max_events
            || self.deltas.len() + self.windows.len() >= limits.max_keys
    }

    /// Messages that can still be added before a size limit is reached, when
    /// each adds at most `keys_per_message` distinct counters and window
    /// cells; 0 when the batch is full.
    pub fn room(&self, limits: &Limits, keys_per_message: usize) -> usize {
        let messages = limits.max_events.saturating_sub(self.messages);
        let keys = limits
            .max_keys
            .saturating_sub(self.deltas.len() + self.windows.len())
            / keys_per_message.max(1);
        usize::try_from(messages).unwrap_or(usize::MAX).min(keys)
    }

    /// How long the batch has been open.
    pub fn age(&self) -> std::time::Duration {
        self.opened_at
            .map_or(std::time::Duration::ZERO, |t| t.elapsed())
    }

    /// Closes the batch, leaving this one empty (its map's memory is kept).
    pub fn take(&mut self) -> Option<ClosedBatch> {
        self.take_observed(|_, _| {})
    }

    /// Closes the batch like [`Batch::take`], first telling `observe` how many
    /// events each counter saw (likes and unlikes alike; a post may be told
    /// once per bucket). Hot-post detection counts activity this way, once
    /// per batch instead of once per event.
    pub fn take_observed(&mut self, mut observe: impl FnMut(u64, u32)) -> Option<ClosedBatch> {
        let start = self.start.take()?;
        let mut deltas: Vec<(CounterId, i64)> = self
            .deltas
            .drain()
            .filter_map(|(id, (delta, events))| {
                observe(id.post_id, events);
                (delta != 0).then_some((id, delta))
            })
            .collect();
        // By delta, then counter: the script takes equal deltas as one run
        // (most are +1), and a stable order makes scripts reproducible.
        deltas.sort_unstable_by_key(|&(id, delta)| (delta, id));
        let mut windows: Vec<(WindowCell, i64)> = self
            .windows
            .drain()
            .filter(|&(_, delta)| delta != 0)
            .collect();
        // By window, so that each window's set is one run of its members;
        // then by delta, so that the script takes equal deltas as one run.
        windows.sort_unstable_by_key(|&(cell, delta)| (cell.size, cell.start, delta, cell.post_id));
        let closed = ClosedBatch {
            start,
            last: self.last,
            messages: self.messages,
            bad: self.bad,
            late: self.late,
            deltas,
            windows,
        };
        self.messages = 0;
        self.bad = 0;
        self.late = 0;
        self.last = -1;
        self.opened_at = None;
        Some(closed)
    }

    /// Drops everything buffered (after a seek or a revoke).
    pub fn clear(&mut self) {
        let _ = self.take();
    }
}

impl ClosedBatch {
    /// An empty range at `next`: a probe of the fences.
    pub fn probe(next: i64) -> Self {
        Self {
            start: next,
            last: next - 1,
            messages: 0,
            bad: 0,
            late: 0,
            deltas: Vec::new(),
            windows: Vec::new(),
        }
    }

    /// The offsets `start..=last`, which the consumer passed without
    /// receiving a message: transaction markers and the records of aborted
    /// transactions, which a read_committed consumer never sees. Applied as
    /// nothing, the range lets the fences and the commit reach a log that
    /// ends with a marker; otherwise the partition would look behind forever.
    pub fn passed(start: i64, last: i64) -> Self {
        Self {
            start,
            last,
            messages: 0,
            bad: 0,
            late: 0,
            deltas: Vec::new(),
            windows: Vec::new(),
        }
    }

    /// Whether this is a probe.
    pub fn is_probe(&self) -> bool {
        self.start > self.last
    }

    /// Whether the range holds no message: a probe or a passed range.
    pub fn is_empty(&self) -> bool {
        self.messages == 0
    }

    /// Splits the deltas by slot group (index = group): each counter to its
    /// own group, each post's window deltas to the group of its bucket 0.
    pub fn split(&mut self, groups: &SlotGroups) -> Vec<Share> {
        let mut split = vec![Share::default(); groups.count() as usize];
        for (id, delta) in self.deltas.drain(..) {
            split[groups.group_of(id.post_id, id.bucket) as usize]
                .deltas
                .push((id, delta));
        }
        for (cell, delta) in self.windows.drain(..) {
            split[groups.group_of(cell.post_id, 0) as usize]
                .windows
                .push((cell, delta));
        }
        split
    }
}

/// One slot group's share of a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Share {
    /// Net deltas of the group's counters.
    pub deltas: Vec<(CounterId, i64)>,
    /// Net deltas of the posts whose windows the group keeps, in window order.
    pub windows: Vec<(WindowCell, i64)>,
}

impl Share {
    /// Whether the share changes nothing.
    pub fn is_empty(&self) -> bool {
        self.deltas.is_empty() && self.windows.is_empty()
    }
}

/// A closed batch, ready to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClosedBatch {
    /// First offset covered.
    pub start: i64,
    /// Last offset covered.
    pub last: i64,
    /// Messages in the range (good and bad).
    pub messages: u64,
    /// Bad messages in the range.
    pub bad: u64,
    /// Likes too late for a window of theirs (counted for each window).
    pub late: u64,
    /// Non-zero net deltas, sorted by delta, then counter.
    pub deltas: Vec<(CounterId, i64)>,
    /// Non-zero net deltas per post and window, sorted by window, then
    /// delta, then post.
    pub windows: Vec<(WindowCell, i64)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn id(post_id: u64, bucket: u32) -> CounterId {
        CounterId::v0(post_id, bucket)
    }

    #[test]
    fn a_passed_range_claims_offsets_and_holds_no_message() {
        let passed = ClosedBatch::passed(10, 12);
        assert_eq!((passed.start, passed.last), (10, 12));
        assert!(passed.is_empty() && !passed.is_probe());
        assert!(passed.deltas.is_empty());
        let probe = ClosedBatch::probe(10);
        assert!(probe.is_empty() && probe.is_probe());
    }

    #[test]
    fn likes_and_unlikes_net_out_and_zeros_are_dropped() {
        let mut batch = Batch::new();
        batch.add(10, 10, id(1, 7), 1);
        batch.add(10, 11, id(1, 7), -1);
        batch.add(10, 12, id(2, 7), 1);
        batch.add(10, 13, id(2, 0), 1);
        let closed = batch.take().unwrap();
        assert_eq!((closed.start, closed.last, closed.messages), (10, 13, 4));
        let total: i64 = closed.deltas.iter().map(|&(_, d)| d).sum();
        assert_eq!(total, 2);
        assert!(
            closed
                .deltas
                .iter()
                .all(|&(id, d)| id.post_id == 2 && d != 0)
        );
        assert!(batch.is_empty());
        assert!(batch.take().is_none());
    }

    #[test]
    fn a_batch_of_only_bad_messages_still_covers_its_range() {
        let mut batch = Batch::new();
        batch.add_bad(5, 7);
        batch.add_bad(5, 8);
        let closed = batch.take().unwrap();
        assert_eq!((closed.start, closed.last, closed.bad), (5, 8, 2));
        assert!(closed.deltas.is_empty());
    }

    /// The default message limit sits above what the default counter limit holds on the
    /// benchmark's Zipf traffic, so a partition catching up closes its batch on counters, the
    /// limit that bounds the script's time in Redis.
    #[test]
    fn a_full_batch_of_zipf_traffic_closes_on_its_counters() {
        use rand::rngs::SmallRng;
        use rand::{Rng as _, SeedableRng as _};
        use rand_distr::{Distribution as _, Zipf};

        use crate::domain::routing::bucket_of;
        use crate::infra::config::{
            DEFAULT_BATCH_MAX_EVENTS, DEFAULT_BATCH_MAX_KEYS, DEFAULT_BUCKETS,
        };
        let limits = Limits {
            max_events: DEFAULT_BATCH_MAX_EVENTS,
            max_keys: DEFAULT_BATCH_MAX_KEYS,
        };
        // Traffic of the benchmark's shape (tally-lab's generator): Zipf s = 1.1 over
        // 1,000,000 posts, 10,000,000 users, and a tenth of the events undoing the like
        // before, which adds no counter.
        let posts = Zipf::new(1_000_000.0, 1.1).unwrap();
        let mut rng = SmallRng::seed_from_u64(7);
        let mut batch = Batch::new();
        let (mut offset, mut last) = (0, (1, 1));
        while !batch.is_full(&limits) {
            let (post, user, delta) = if rng.random_bool(0.1) {
                (last.0, last.1, -1)
            } else {
                last = (
                    posts.sample(&mut rng) as u64,
                    rng.random_range(1..=10_000_000),
                );
                (last.0, last.1, 1)
            };
            batch.add(0, offset, id(post, bucket_of(user, DEFAULT_BUCKETS)), delta);
            offset += 1;
        }
        let (messages, counters) = (offset as u64, batch.deltas.len());
        assert!(
            messages < DEFAULT_BATCH_MAX_EVENTS,
            "the batch closed on its {messages} messages with {counters} of {DEFAULT_BATCH_MAX_KEYS} counters"
        );
    }

    #[test]
    fn limits_close_batches() {
        let limits = Limits {
            max_events: 3,
            max_keys: 2,
        };
        let mut batch = Batch::new();
        batch.add(0, 0, id(1, 1), 1);
        assert!(!batch.is_full(&limits));
        batch.add(0, 1, id(2, 1), 1);
        assert!(batch.is_full(&limits));
    }

    proptest! {
        /// A reader takes `room` messages (at least one) at a time: the
        /// batch fills at the last of them or not at all.
        #[test]
        fn a_batch_fills_only_at_the_last_message_its_room_allows(
            max_events in 1u64..50,
            max_keys in 1usize..60,
            windows in 0usize..3,
            posts in proptest::collection::vec((0u64..12, 0u32..3), 1..300),
        ) {
            let limits = Limits { max_events, max_keys };
            let per_message = 1 + windows;
            let mut batch = Batch::new();
            let mut posts = posts.into_iter();
            let mut offset = 0;
            while !batch.is_full(&limits) {
                let room = batch.room(&limits, per_message).max(1);
                for _ in 0..room {
                    prop_assert!(!batch.is_full(&limits), "full before the run's end");
                    let Some((post, bucket)) = posts.next() else {
                        return Ok(());
                    };
                    batch.add(0, offset, id(post, bucket), 1);
                    for size in 0..windows {
                        let cell = WindowCell { size: size as u8, start: 0, post_id: post };
                        batch.add_window(cell, 1);
                    }
                    offset += 1;
                }
            }
            prop_assert_eq!(batch.room(&limits, per_message), 0);
        }

        #[test]
        fn batch_sums_equal_a_naive_sum(events in proptest::collection::vec((1u64..20, any::<u64>(), any::<bool>()), 1..300), buckets in 1u32..64) {
            let mut batch = Batch::new();
            let mut naive: BTreeMap<(u64, u32), i64> = BTreeMap::new();
            for (i, &(post, user, up)) in events.iter().enumerate() {
                let delta = if up { 1 } else { -1 };
                batch.add(0, i as i64, id(post, crate::domain::routing::bucket_of(user, buckets)), delta);
                *naive.entry((post, crate::domain::routing::bucket_of(user, buckets))).or_default() += delta;
            }
            naive.retain(|_, d| *d != 0);
            let closed = batch.take().unwrap();
            let got: BTreeMap<(u64, u32), i64> = closed.deltas.iter().map(|&(id, d)| ((id.post_id, id.bucket), d)).collect();
            prop_assert_eq!(got, naive);
            prop_assert_eq!(closed.last, events.len() as i64 - 1);
        }

        #[test]
        fn splitting_by_group_keeps_every_delta(events in proptest::collection::vec((1u64..50, 0u32..16, -3i64..4), 1..200)) {
            let groups = SlotGroups::cluster(8);
            let mut batch = Batch::new();
            for (i, &(post, bucket, delta)) in events.iter().enumerate() {
                batch.add(0, i as i64, id(post, bucket), delta);
            }
            let mut closed = batch.take().unwrap();
            let before = closed.deltas.clone();
            let split = closed.split(&groups);
            let groups = &groups;
            let mut after: Vec<_> = split.iter().enumerate().flat_map(|(g, part)| {
                part.deltas.iter().map(move |&(id, d)| { assert_eq!(groups.group_of(id.post_id, id.bucket), g as u32); (id, d) })
            }).collect();
            after.sort_unstable_by_key(|&(id, d)| (d, id));
            prop_assert_eq!(after, before);
        }
    }
}
