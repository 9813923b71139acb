//! Micro-benchmarks of tally's CPU work per event, one core, no I/O.
//!
//! * `decode+aggregate`: [`tally::pipeline::decode::decode`] of real encoded events plus
//!   [`tally::pipeline::aggregate::Batch::add`], closing batches at the default limits
//!   ([`DEFAULT_BATCH_MAX_EVENTS`] events or [`DEFAULT_BATCH_MAX_KEYS`] counters), as the
//!   consumer does per partition.
//!   Throughput is events.
//! * `script call`: building the `EVALSHA` call of one closed batch with
//!   [`tally::pipeline::apply::script_call`], the function the applier sends
//!   every script with, and packing it into the bytes sent to Redis.
//!   Throughput is counter increments.
//! * `dedupe window`: [`tally::pipeline::dedupe::Window::observe`] over eight
//!   full windows of the default size (one per partition, records dealt to
//!   them in turn, every record with an event id of its own), in both modes:
//!   what dedupe adds to a record once its windows are full.
//!   Throughput is records.
//! * `hot sketch`: [`tally::pipeline::hot::SpaceSaving::add`] of every counter
//!   of the closed batches, as hot-post detection observes each batch when it
//!   closes, into a sketch of [`SKETCH_SIZE`] posts cleared once per 200,000
//!   events (the second it counts). Throughput is counters.
//!
//! Events come from [`tally_lab::generate::Traffic`] with the benchmark's Zipf
//! shape (s = 1.1 over 1,000,000 posts), so hash-map sizes and key lengths are
//! the real ones.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tally::domain::routing::{KeyLayout, bucket_of};
use tally::infra::config::{DEFAULT_BATCH_MAX_EVENTS, DEFAULT_BATCH_MAX_KEYS, DEFAULT_BUCKETS};
use tally::pipeline::aggregate::{Batch, ClosedBatch, CounterId, Limits};
use tally::pipeline::apply::{Prepared, ScriptBody, script_call};
use tally::pipeline::decode::{EventId, Like};
use tally::pipeline::dedupe::{DEFAULT_WINDOW, DedupeMode, DedupeSettings, Window};
use tally::pipeline::hot::{SKETCH_SIZE, SpaceSaving};
use tally_lab::generate::{Traffic, TrafficShape};

const EVENTS: usize = 200_000;
const LIMITS: Limits = Limits {
    max_events: DEFAULT_BATCH_MAX_EVENTS,
    max_keys: DEFAULT_BATCH_MAX_KEYS,
};

fn encoded_events() -> Vec<Vec<u8>> {
    let shape = TrafficShape {
        posts: 1_000_000,
        viral_share: 0.0,
        ..TrafficShape::default()
    };
    let mut traffic = Traffic::new(shape, 42);
    (0..EVENTS)
        .map(|i| {
            let e = traffic.next_event();
            tally::pipeline::decode::encode(
                e.post_id,
                e.user_id,
                e.action,
                1_700_000_000_000 + i as i64,
            )
        })
        .collect()
}

/// Aggregates `payloads` as one partition from offset 0; returns closed batches.
fn aggregate(payloads: &[Vec<u8>], batch: &mut Batch, closed: &mut Vec<ClosedBatch>) {
    for (offset, payload) in payloads.iter().enumerate() {
        let offset = offset as i64;
        match tally::pipeline::decode::decode(Some(payload)) {
            Ok(like) => {
                let id = CounterId::v0(like.post_id, bucket_of(like.user_id, DEFAULT_BUCKETS));
                batch.add(offset, offset, id, like.delta)
            }
            Err(_) => batch.add_bad(offset, offset),
        }
        if batch.is_full(&LIMITS) {
            closed.extend(batch.take());
        }
    }
    closed.extend(batch.take());
}

/// One slot group's share of `batch`, as the consumer prepares it.
fn prepared(batch: &ClosedBatch) -> Prepared {
    Prepared {
        partition: 3,
        group: 0,
        start: batch.start,
        last: batch.last,
        absent_fence: -1,
        windows: Vec::new(),
        deltas: batch.deltas.clone(),
    }
}

/// The script call of one batch.
fn call(keys: &KeyLayout, fence_key: &str, prepared: &Prepared) -> redis::Cmd {
    script_call(
        ScriptBody::ByHash("0123456789abcdef0123456789abcdef01234567"),
        keys,
        fence_key,
        prepared,
        Default::default(),
    )
}

fn bench(c: &mut Criterion) {
    let payloads = encoded_events();

    let mut group = c.benchmark_group("decode+aggregate");
    group.throughput(Throughput::Elements(EVENTS as u64));
    let mut batch = Batch::new();
    let mut closed = Vec::new();
    group.bench_function(
        format!("zipf 1.1, 1M posts, {DEFAULT_BUCKETS} bucket(s)"),
        |b| {
            b.iter(|| {
                closed.clear();
                aggregate(black_box(&payloads), &mut batch, &mut closed);
                black_box(closed.len())
            })
        },
    );
    group.bench_function("decode only", |b| {
        b.iter(|| {
            payloads
                .iter()
                .filter(|p| tally::pipeline::decode::decode(Some(black_box(p))).is_ok())
                .count()
        })
    });
    group.finish();

    // One full batch, as the consumer sends it.
    closed.clear();
    aggregate(&payloads, &mut Batch::new(), &mut closed);
    let full = closed
        .iter()
        .max_by_key(|b| b.deltas.len())
        .expect("at least one batch");
    let keys = KeyLayout::new("tally");
    let fence_key = keys.fence_key("tally", "likes", 3, 0);
    let full = &prepared(full);
    let mut group = c.benchmark_group("script call");
    group.throughput(Throughput::Elements(full.deltas.len() as u64));
    group.bench_function(format!("build, {} counters", full.deltas.len()), |b| {
        b.iter(|| call(&keys, &fence_key, black_box(full)))
    });
    group.bench_function(
        format!("build + pack, {} counters", full.deltas.len()),
        |b| b.iter(|| call(&keys, &fence_key, black_box(full)).get_packed_command()),
    );
    group.finish();
}

/// Partitions of the dedupe benchmark, as in `tally-lab bench`.
const PARTITIONS: usize = 8;

/// Eight windows, each shown `offsets` records of its own from offset 0.
struct Windows {
    windows: Vec<Window>,
    /// Records shown so far, over all windows.
    shown: u64,
}

impl Windows {
    fn new(mode: DedupeMode) -> Self {
        let settings = DedupeSettings {
            mode,
            span: DEFAULT_WINDOW,
        };
        Windows {
            windows: (0..PARTITIONS)
                .map(|_| Window::new(settings, Some(0)))
                .collect(),
            shown: 0,
        }
    }

    /// Shows the windows `likes`, dealt to them in turn, each with a fresh id
    /// and a user of its own (so no record repeats another); returns the
    /// records skipped.
    fn show(&mut self, likes: &[Like]) -> usize {
        let mut skipped = 0;
        for like in likes {
            let n = self.shown;
            self.shown += 1;
            let partition = (n % PARTITIONS as u64) as usize;
            let offset = (n / PARTITIONS as u64) as i64;
            let id = EventId::of(&n.to_le_bytes());
            let like = Like {
                user_id: n,
                ..*like
            };
            let window = &mut self.windows[partition];
            skipped += usize::from(window.observe(offset, offset, &like, Some(id)).is_some());
        }
        skipped
    }
}

fn dedupe(c: &mut Criterion, payloads: &[Vec<u8>]) {
    let likes: Vec<Like> = payloads
        .iter()
        .filter_map(|p| tally::pipeline::decode::decode(Some(p)).ok())
        .collect();
    let mut group = c.benchmark_group("dedupe window");
    group.throughput(Throughput::Elements(likes.len() as u64));
    for mode in [DedupeMode::Ids, DedupeMode::IdsAndActions] {
        let mut windows = Windows::new(mode);
        // Full windows first: a window and a block more of every partition.
        let fill = (DEFAULT_WINDOW + DEFAULT_WINDOW / 8) as usize * PARTITIONS;
        for _ in 0..fill.div_ceil(likes.len()) {
            windows.show(&likes);
        }
        group.bench_function(
            format!("{mode}, {PARTITIONS} full windows of {DEFAULT_WINDOW} offsets"),
            |b| b.iter(|| windows.show(black_box(&likes))),
        );
    }
    group.finish();
}

fn hot(c: &mut Criterion, payloads: &[Vec<u8>]) {
    let (mut batch, mut closed) = (Batch::new(), Vec::new());
    aggregate(payloads, &mut batch, &mut closed);
    let counters: Vec<(u64, u32)> = closed
        .iter()
        .flat_map(|b| b.deltas.iter().map(|(id, _)| (id.post_id, 1)))
        .collect();
    let mut group = c.benchmark_group("hot sketch");
    group.throughput(Throughput::Elements(counters.len() as u64));
    let mut sketch = SpaceSaving::new(SKETCH_SIZE);
    group.bench_function(
        format!("{} counters into {SKETCH_SIZE} posts", counters.len()),
        |b| {
            b.iter(|| {
                sketch.clear();
                for &(post, events) in black_box(&counters) {
                    sketch.add(post, u64::from(events));
                }
            })
        },
    );
    group.finish();
}

fn all(c: &mut Criterion) {
    bench(c);
    let payloads = encoded_events();
    dedupe(c, &payloads);
    hot(c, &payloads);
}

criterion_group!(benches, all);
criterion_main!(benches);
