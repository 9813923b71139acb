//! Plan: the buckets, Redis primaries, Kafka partitions and consumers a peak
//! needs, and how close the unluckiest primary comes to its limit.
//!
//! From a peak rate for the whole app and for its hottest post, it computes:
//! * Kafka: consumers = ceil(peak ÷ (events/s per consumer × (1 − headroom))),
//!   and partitions = consumers × partitions per consumer, so the group can
//!   grow without repartitioning.
//! * The hot post's buckets, two ways. A writer that sends one increment per
//!   like needs ceil(hot ÷ safe rate) keys; one-second windows of random users
//!   routed by `bucket_of` show how far its busiest key climbs above the
//!   average, against the key cap. tally sends one `INCRBY` per
//!   (post, bucket) per partition batch, so a bucket is written at most
//!   W = partitions × batches/s times a second whatever its likes: with
//!   λ = hot ÷ (N·W) likes per bucket per batch, a share 1 − e^(−λ) of batches
//!   touch it. The plan takes the smallest N whose writes per bucket stay under
//!   the safe rate, and whose busiest bucket-second stays under the key cap.
//! * Redis: calls/s = increments of every other post (events × increments per
//!   event) + the hot post's batched writes + 3 calls per script (`EVALSHA`,
//!   the fence's `GET` and `SET`), one script per slot group a batch touches.
//!   Other posts' calls spread over primaries in proportion to the slot groups
//!   each owns. The hot post's keys are placed by CRC16 of their real names for
//!   many random post ids; the busiest primary of each placement gives the p50,
//!   p99 and worst load, beside the Binomial(N, 1/M) rule of thumb. Without a
//!   primary count or a live cluster, the plan takes the fewest primaries whose
//!   p99 stays within the headroom.
//!
//! Assumptions: likes are keyed by user or not keyed, so every partition sees
//! every bucket of a hot post; the hot post's likers are many distinct users,
//! which the stable hash spreads like random draws; batches close on age
//! unless `tally run`'s default size limits close them sooner (both counted);
//! a primary's capacity is one figure in calls/s, whatever the command.
//!
//! Invariant: every figure comes from the inputs and tally's own routing
//! (`bucket_of`, `KeyLayout`, `key_slot`) with a fixed seed, so one command
//! line always prints the same plan.

mod compute;
mod dedupe;
mod layout;
mod model;
mod table;
mod warn;
mod windows;

use clap::Args;
use serde::Serialize;

use crate::settings::StoreArgs;
use tally::domain::placement::SlotMap;
use tally::infra::config::dedupe::MAX_WINDOW;
use tally::infra::config::{ConfigError, DEFAULT_FLUSH_INTERVAL_MS};

pub use compute::plan;
pub use dedupe::{Dedupe, MEASURED_BYTES_PER_EVENT};
pub use layout::{
    Layouts, MEASURED_PACKED_BYTES, MEASURED_PACKED_CPU_RATIO, MEASURED_STRING_BYTES,
};
pub use model::keys_needed;

/// Events/s of one `tally run` consumer planned for: its rate on Apache Kafka (145,882 Zipf and
/// 140,586 viral on 2 cores) before readers stopped idling between fetches; docs/benchmarks.md
/// now measures 920,000–1,080,000, so this plans with room to spare.
pub const MEASURED_CONSUMER_EVENTS: f64 = 145_000.0;
/// Counter increments per event of `tally run` on Zipf traffic in docs/benchmarks.md.
pub const MEASURED_INCREMENTS_PER_EVENT: f64 = 0.42;
/// Redis calls a script makes besides its increments: `EVALSHA`, the fence's `GET` and `SET`.
pub const SCRIPT_CALLS: f64 = 3.0;

/// Settings of `tally plan`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct PlanArgs {
    /// Peak like events per second across the whole app (events/s).
    #[arg(long, default_value_t = 200_000.0)]
    pub peak_events: f64,
    /// Peak like events per second of the hottest post (events/s).
    #[arg(long, default_value_t = 14_000.0)]
    pub hot_events: f64,
    /// Writes one counter key may take, leaving room for uneven seconds (writes/s per key).
    #[arg(long, default_value_t = 700.0)]
    pub safe_key_rate: f64,
    /// Writes past which one key's partition refuses more (writes/s per key).
    #[arg(long, default_value_t = 1_000.0)]
    pub key_cap: f64,
    /// Calls one Redis primary serves (ops/s per primary).
    #[arg(long, default_value_t = 100_000.0)]
    pub primary_capacity: f64,
    /// Share of consumer and primary capacity left free at the peak (percent).
    #[arg(long, default_value_t = 30.0)]
    pub headroom_pct: f64,
    /// Age at which a partition's batch closes, as `tally run --flush-interval-ms` (ms).
    #[arg(long, default_value_t = DEFAULT_FLUSH_INTERVAL_MS)]
    pub flush_interval_ms: u64,
    /// Events one consumer handles (events/s per consumer; measured in docs/benchmarks.md).
    #[arg(long, default_value_t = MEASURED_CONSUMER_EVENTS)]
    pub consumer_events: f64,
    /// Consumers to run [default: enough for the peak, with headroom].
    #[arg(long)]
    pub consumers: Option<u32>,
    /// Kafka partitions [default: consumers × --partitions-per-consumer].
    #[arg(long)]
    pub partitions: Option<u32>,
    /// Partitions per consumer, so the group can grow without adding partitions.
    #[arg(long, default_value_t = 2)]
    pub partitions_per_consumer: u32,
    /// Redis primaries [default: the fewest whose p99 busiest load leaves the headroom free].
    #[arg(long, conflicts_with = "live")]
    pub primaries: Option<u32>,
    /// Buckets per post, as `tally run --buckets` [default: what the hot post needs].
    #[arg(long)]
    pub buckets: Option<u32>,
    /// Counter increments per event of the other posts (measured on Zipf traffic in
    /// docs/benchmarks.md; 1 means no aggregation).
    #[arg(long, default_value_t = MEASURED_INCREMENTS_PER_EVENT)]
    pub increments_per_event: f64,
    /// Keys one uncached count may read; a count reads every bucket of its post (keys).
    #[arg(long, default_value_t = 64)]
    pub max_read_keys: u32,
    /// Random post ids the Monte-Carlo places.
    #[arg(long, default_value_t = 2_000)]
    pub trials: u32,
    /// Seed of the simulations.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Price a dedupe window of this many offsets a partition, as `tally run --dedupe-window`
    /// [default: none priced].
    #[arg(long)]
    pub dedupe_window: Option<u64>,
    /// Heap bytes one event the dedupe window remembers costs (bytes; measured for a full window
    /// of a realistic mix).
    #[arg(long, default_value_t = MEASURED_BYTES_PER_EVENT)]
    pub dedupe_bytes: f64,
    /// Records a consumer re-reads a partition's dedupe window at, on assignment (records/s)
    /// [default: --consumer-events, which also writes to Redis, so an upper bound on the time].
    #[arg(long)]
    pub reread_events: Option<f64>,
    /// Price the counters' memory and write CPU in both layouts (a string key per counter,
    /// or `--layout packed`) for this many counters: one per post, plus one per bucket of a
    /// hot post [default: priced per million counters; neither layout needs a count up front].
    #[arg(long)]
    pub counters: Option<f64>,
    /// Redis memory the counters may take, before replicas (GB); with --counters, says
    /// which layout fits.
    #[arg(long, requires = "counters")]
    pub memory_budget_gb: Option<f64>,
    /// Redis memory one counter kept as a string key costs (bytes; measured with 10M random
    /// post ids on redis-server 7.0.15 in docs/benchmarks.md; 72.2 on Valkey).
    #[arg(long, default_value_t = MEASURED_STRING_BYTES)]
    pub string_bytes: f64,
    /// Redis memory one counter kept packed costs, in hashes that split as they fill (bytes;
    /// the most measured at any size from 100,000 to 30 million counters on redis-server
    /// 7.0.15; 14.6 on Valkey).
    #[arg(long, default_value_t = MEASURED_PACKED_BYTES)]
    pub packed_bytes: f64,
    /// Redis CPU of one packed counter write over one string key write (measured beside
    /// --string-bytes on Redis; 3.26 on Valkey, whose scripted HINCRBY costs more).
    #[arg(long, default_value_t = MEASURED_PACKED_CPU_RATIO)]
    pub packed_cpu_ratio: f64,
    /// Price the windows of trending counts: the distinct posts liked in one window of a size,
    /// as SIZE=POSTS (1d=10000000), once per size kept [default: none priced].
    #[arg(long, value_name = "SIZE=POSTS")]
    pub window_posts: Vec<String>,
    /// How long a window's keys outlive it, as `tally run --window-retention`.
    #[arg(long, default_value = "1d")]
    pub window_retention: String,
    /// Redis memory one post in one window's counts costs (bytes; one hash of 1,000,000 posts on
    /// redis-server 7.0.15; 53 on Valkey 9.1.2). Each window's leaders add at most 4,000 posts.
    #[arg(long, default_value_t = windows::MEASURED_MEMBER_BYTES)]
    pub window_member_bytes: f64,
    /// Take the slot map of the live server or cluster --redis names
    /// (redis+cluster://host:port,...) instead of an even split.
    #[arg(long)]
    #[serde(skip)]
    pub live: bool,
    /// The store planned for: its prefix and slot groups as `tally run` has them,
    /// and, with --live, where its slot map is read.
    #[command(flatten)]
    #[serde(serialize_with = "store_inputs")]
    pub store: StoreArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    #[serde(skip)]
    pub json: bool,
}

/// A plan: the inputs, what each side needs, and what to worry about.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// The settings the plan was made from.
    pub inputs: PlanArgs,
    /// Consumers and partitions.
    pub kafka: Kafka,
    /// The hottest post's buckets.
    pub hot_post: HotPost,
    /// Primaries and their load.
    pub redis: Redis,
    /// The dedupe window's price, with `--dedupe-window`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedupe: Option<Dedupe>,
    /// Both layouts' price, with `--counters`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layouts: Option<Layouts>,
    /// The windows' price, with `--window-posts`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub windows: Option<windows::Windows>,
    /// Problems found, in words.
    pub warnings: Vec<String>,
}

/// The Kafka side of a plan.
#[derive(Debug, Clone, Serialize)]
pub struct Kafka {
    /// Consumers the peak needs with headroom.
    pub consumers_needed: u32,
    /// Consumers planned (given or needed).
    pub consumers: u32,
    /// Each consumer's load at the peak, as % of its measured rate.
    pub consumer_busy_pct: f64,
    /// Partitions planned.
    pub partitions: u32,
    /// Events/s per partition at the peak.
    pub events_per_partition: f64,
    /// Batches each partition closes per second.
    pub batches_per_partition: f64,
    /// Batches per second across all partitions: the most writes any one bucket gets.
    pub batches_per_s: f64,
}

/// The hot post's buckets under one way of writing.
#[derive(Debug, Clone, Serialize)]
pub struct Sizing {
    /// Buckets needed.
    pub buckets: u32,
    /// Writes/s to all its buckets together.
    pub writes_per_s: f64,
    /// Writes/s per bucket.
    pub writes_per_bucket: f64,
    /// The busiest bucket's writes in a typical second.
    pub busiest_bucket_second: f64,
    /// The busiest bucket's writes in the worst second seen, when simulated.
    pub busiest_bucket_worst_second: Option<f64>,
    /// How the busiest second was found.
    pub busiest_from: String,
}

/// The hot post's buckets.
#[derive(Debug, Clone, Serialize)]
pub struct HotPost {
    /// Likes/s at the peak.
    pub events_per_s: f64,
    /// One increment per like, as a writer without batching sends.
    pub per_event: Sizing,
    /// One `INCRBY` per bucket per partition batch, as `tally run` sends.
    pub batched: Sizing,
    /// Buckets planned (given or needed when batched).
    pub buckets: u32,
    /// Batched writes/s per bucket with the planned buckets.
    pub writes_per_bucket: f64,
    /// Keys one uncached count reads.
    pub reads_per_uncached_view: u32,
}

/// The Redis side of a plan.
#[derive(Debug, Clone, Serialize)]
pub struct Redis {
    /// Primaries planned, given or read live.
    pub primaries: u32,
    /// "live" or "even split".
    pub slot_map: String,
    /// Slot groups keys are spread over (1 on a single server).
    pub slot_groups: u32,
    /// Calls/s at the peak across all primaries.
    pub ops_per_s: f64,
    /// Counter increments/s within that.
    pub increments_per_s: f64,
    /// Script overhead calls/s within that.
    pub script_calls_per_s: f64,
    /// Calls/s per primary if spread perfectly.
    pub mean_ops_per_primary: f64,
    /// The largest share of all posts' keys one primary owns (%).
    pub largest_share_pct: f64,
    /// Binomial(N, 1/M) buckets of the hot post per primary.
    pub buckets_per_primary: Spread,
    /// The Monte-Carlo over real key placement.
    pub busiest_primary: MonteCarlo,
}

/// Buckets of one post per primary under random placement.
#[derive(Debug, Clone, Serialize)]
pub struct Spread {
    /// N/M.
    pub mean: f64,
    /// sqrt(N·(1/M)·(1−1/M)).
    pub sigma: f64,
    /// mean + sqrt(2 ln M)·σ.
    pub busiest_rule: f64,
    /// The rule as calls/s: the other posts' mean share plus that many buckets.
    pub busiest_rule_ops: f64,
}

/// The busiest primary over many random placements of the hot post.
#[derive(Debug, Clone, Serialize)]
pub struct MonteCarlo {
    /// Random post ids placed.
    pub posts: u32,
    /// Median busiest load (calls/s).
    pub p50_ops: f64,
    /// 99th percentile busiest load (calls/s).
    pub p99_ops: f64,
    /// Worst busiest load seen (calls/s).
    pub max_ops: f64,
    /// 99th percentile of the hot post's keys on its fullest primary.
    pub p99_hot_buckets: u32,
    /// p99 as % of one primary's capacity.
    pub p99_pct_capacity: f64,
}

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A setting is out of range.
    #[error(transparent)]
    Input(#[from] ConfigError),
    /// The live slot map could not be read.
    #[error("reading the slot map: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Makes the plan and renders it: a table, or JSON with `--json`.
pub fn report(args: &PlanArgs) -> Result<String, PlanError> {
    let live = if args.live {
        let store = args.store.settings().map_err(|mut p| p.remove(0))?;
        Some(SlotMap::read(store.url().target())?)
    } else {
        None
    };
    let plan = plan(args, live)?;
    Ok(if args.json {
        let mut json = serde_json::to_value(&plan).expect("a plan serialises");
        round_floats(&mut json);
        serde_json::to_string_pretty(&json).expect("a plan serialises") + "\n"
    } else {
        table::render(&plan)
    })
}

/// Rounds every fractional number to two decimals, for readable JSON.
fn round_floats(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Number(number) if number.is_f64() => {
            let rounded = (number.as_f64().unwrap_or_default() * 100.0).round() / 100.0;
            if let Some(tidy) = serde_json::Number::from_f64(rounded) {
                *number = tidy;
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(round_floats),
        serde_json::Value::Object(fields) => fields.values_mut().for_each(round_floats),
        _ => {}
    }
}

fn bad(flag: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        problem: problem.into(),
    }
}

fn validate(args: &PlanArgs) -> Result<(), ConfigError> {
    let check = |failed: bool, flag: &'static str, problem: &str| match failed {
        true => Err(bad(flag, problem)),
        false => Ok(()),
    };
    for (flag, value) in [
        ("peak-events", args.peak_events),
        ("hot-events", args.hot_events),
        ("safe-key-rate", args.safe_key_rate),
        ("primary-capacity", args.primary_capacity),
        ("consumer-events", args.consumer_events),
        ("increments-per-event", args.increments_per_event),
        ("dedupe-bytes", args.dedupe_bytes),
        ("reread-events", args.reread_events.unwrap_or(1.0)),
    ] {
        check(
            !(value.is_finite() && value > 0.0),
            flag,
            "must be a positive number",
        )?;
    }
    let (hot, safe) = (args.hot_events, args.safe_key_rate);
    check(
        hot > args.peak_events,
        "hot-events",
        "cannot exceed --peak-events",
    )?;
    check(
        args.key_cap < safe,
        "key-cap",
        "cannot be below --safe-key-rate",
    )?;
    let headroom = !(0.0..100.0).contains(&args.headroom_pct);
    check(headroom, "headroom-pct", "must be at least 0 and below 100")?;
    check(
        args.increments_per_event > 1.0,
        "increments-per-event",
        "must be at most 1",
    )?;
    let one = "must be at least 1";
    check(args.flush_interval_ms == 0, "flush-interval-ms", one)?;
    check(args.consumers == Some(0), "consumers", one)?;
    check(args.partitions == Some(0), "partitions", one)?;
    check(
        args.partitions_per_consumer == 0,
        "partitions-per-consumer",
        one,
    )?;
    check(args.max_read_keys == 0, "max-read-keys", one)?;
    let primaries = args.primaries.is_some_and(|m| m == 0 || m > 16_384);
    check(primaries, "primaries", "must be between 1 and 16384")?;
    let buckets = args.buckets.is_some_and(|n| n == 0 || n > 1 << 20);
    check(buckets, "buckets", "must be between 1 and 1048576")?;
    let groups = !args.store.slot_groups.is_power_of_two() || args.store.slot_groups > 16_384;
    check(groups, "slot-groups", "must be a power of two up to 16384")?;
    let window = args
        .dedupe_window
        .is_some_and(|w| !(1..=MAX_WINDOW).contains(&w));
    check(window, "dedupe-window", "must be between 1 and 100000000")?;
    let trials = !(100..=1_000_000).contains(&args.trials);
    check(trials, "trials", "must be between 100 and 1000000")
}

/// The store's inputs in a plan's JSON: its prefix and slot groups, never its URL.
fn store_inputs<S: serde::Serializer>(store: &StoreArgs, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap as _;
    let mut map = s.serialize_map(Some(2))?;
    map.serialize_entry("prefix", &store.prefix)?;
    map.serialize_entry("slot_groups", &store.slot_groups)?;
    map.end()
}
