//! Run settings: everything `tally run` needs beyond the store and the
//! brokers, namely the bucket count, hot-post detection, batch limits and
//! concurrency, and the one-off decisions of a start.
//!
//! Invariant: [`RunSettings::problems`] names every setting out of its
//! range and every combination the parts cannot check alone (the shutdown
//! wait against the consumer's session timeout), together with the Kafka
//! settings' own problems, before anything starts.

use std::net::SocketAddr;
use std::time::Duration;

use super::kafka::KafkaSettings;
use super::store::StoreSettings;
use super::{ConfigError, GroupProtocol, bad, dedupe, packing};
use crate::infra::store::ReplicaWait;

/// Default number of buckets per post on a new prefix: one key per cold post;
/// hot posts are promoted to [`DEFAULT_HOT_BUCKETS`].
pub const DEFAULT_BUCKETS: u32 = 1;
/// Default events per second across all consumers above which a post is promoted.
pub const DEFAULT_PROMOTE_ABOVE: u64 = 300;
/// Default buckets of a promoted post.
pub const DEFAULT_HOT_BUCKETS: u32 = 64;
/// Default interval between reads of the routing registry (milliseconds).
pub const DEFAULT_ROUTE_REFRESH_MS: u64 = 1_000;
/// How long a routing version waits for its replicas, in milliseconds.
pub const DEFAULT_REGISTRY_WAIT_MS: u64 = 1_000;
/// Default age at which a partition's batch closes (milliseconds).
pub const DEFAULT_FLUSH_INTERVAL_MS: u64 = 100;
/// Default messages after which a partition's batch closes. Set above what
/// [`DEFAULT_BATCH_MAX_KEYS`] counters hold on skewed traffic (about 190,000
/// Zipf events), so a partition catching up closes on its counters, which bound
/// the script's time in Redis, rather than on a message count, which does not.
pub const DEFAULT_BATCH_MAX_EVENTS: u64 = 400_000;
/// Default distinct (post, bucket) counters after which a partition's batch closes.
pub const DEFAULT_BATCH_MAX_KEYS: usize = 40_000;
/// Default scripts in flight to Redis at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 8;
/// Default wait for in-flight batches at shutdown (seconds).
pub const DEFAULT_SHUTDOWN_TIMEOUT_SECS: u64 = 10;

/// The largest Schema Registry id: ids are positive signed 32-bit integers.
pub const MAX_SCHEMA_ID: u32 = i32::MAX as u32;

/// Hot-post detection and routing refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotSettings {
    /// Events per second across all consumers above which a post is
    /// promoted (0 turns detection off).
    pub promote_above: u64,
    /// Buckets a hot post is promoted to.
    pub hot_buckets: u32,
    /// How often the routing registry is read again.
    pub route_refresh: Duration,
    /// The replicas a promotion waits for.
    pub registry_wait: ReplicaWait,
}

impl Default for HotSettings {
    fn default() -> Self {
        HotSettings {
            promote_above: DEFAULT_PROMOTE_ABOVE,
            hot_buckets: DEFAULT_HOT_BUCKETS,
            route_refresh: Duration::from_millis(DEFAULT_ROUTE_REFRESH_MS),
            registry_wait: ReplicaWait::default(),
        }
    }
}

/// When batches close, and how many are in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Messages after which a partition's batch closes.
    pub max_events: u64,
    /// Distinct (post, bucket) counters after which a partition's batch closes.
    pub max_keys: usize,
    /// Age at which a partition's batch closes.
    pub flush_interval: Duration,
    /// Scripts in flight to Redis at once, across partitions.
    pub max_in_flight: usize,
    /// How long shutdown waits for batches in flight.
    pub shutdown_timeout: Duration,
}

impl Default for Batching {
    fn default() -> Self {
        Batching {
            max_events: DEFAULT_BATCH_MAX_EVENTS,
            max_keys: DEFAULT_BATCH_MAX_KEYS,
            flush_interval: Duration::from_millis(DEFAULT_FLUSH_INTERVAL_MS),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            shutdown_timeout: Duration::from_secs(DEFAULT_SHUTDOWN_TIMEOUT_SECS),
        }
    }
}

/// Everything `tally run` needs.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// Where the events come from.
    pub kafka: KafkaSettings,
    /// Where the counts go.
    pub store: StoreSettings,
    /// Buckets per post: version 0's on a new prefix, the newest default epoch's on one
    /// that exists (see [`crate::domain::versions`]). `None` takes the prefix's count from
    /// its layout record, and [`DEFAULT_BUCKETS`] on a new prefix.
    pub buckets: Option<u32>,
    /// Hot-post detection.
    pub hot: HotSettings,
    /// Batch limits and concurrency.
    pub batching: Batching,
    /// Where `/metrics`, `/healthz` and `/readyz` are served, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// Testing only: send a batch's scripts one by one with this pause
    /// between them, so a crash can land between two scripts.
    pub test_script_pause: Duration,
    /// Count from the group's committed offsets over a store that holds
    /// nothing (see [`crate::pipeline::guard`]); a one-off decision, never
    /// read from a file or the environment.
    pub accept_lost_counts: bool,
    /// Make this start's dedupe rule the prefix's (see
    /// [`crate::pipeline::guard`]); a one-off decision like
    /// `accept_lost_counts`.
    pub dedupe_change: bool,
    /// The Schema Registry ids a framed value may carry; empty accepts any
    /// (see [`crate::pipeline::decode`]).
    pub schema_ids: Vec<u32>,
    /// Which repeated records change no count, within how many offsets (see
    /// [`crate::pipeline::dedupe`]).
    pub dedupe: dedupe::DedupeSettings,
    /// How a new prefix, or the generation a rebuild makes, keeps its
    /// counters (see [`crate::domain::packing`]).
    pub packing: packing::PackingSettings,
    /// The windows of trending counts a new prefix keeps (`--windows`,
    /// `--window-lateness`, `--window-retention`); `None` keeps the
    /// prefix's.
    pub windows: Option<super::windows::WindowSettings>,
}

impl RunSettings {
    /// Every problem with the settings that their parts could not see alone.
    pub fn problems(&self) -> Vec<ConfigError> {
        let mut problems = Vec::new();
        let mut check = |ok: bool, flag: &'static str, problem: &str| {
            if !ok {
                problems.push(bad(flag, problem));
            }
        };
        check(
            self.buckets.is_none_or(|b| b != 0 && b <= 1 << 20),
            "buckets",
            "must be between 1 and 1048576",
        );
        // Under the consumer protocol the broker's group.consumer.session.timeout.ms
        // (45 s unless changed) is out of reach; docs/operations.md asks for the same.
        check(
            self.kafka.group_protocol == GroupProtocol::Consumer
                || self
                    .kafka
                    .session_timeout_ms()
                    .is_some_and(|ms| self.batching.shutdown_timeout.as_millis() < u128::from(ms)),
            "shutdown-timeout-secs",
            "must be below the consumer's session.timeout.ms (45 s unless set with -X): a \
             stopping consumer finishes its batches and leaves before the group could expire it",
        );
        check(
            self.hot.hot_buckets != 0 && self.hot.hot_buckets <= 1 << 16,
            "hot-buckets",
            "must be between 1 and 65536",
        );
        check(
            (10..=2_000).contains(&self.hot.route_refresh.as_millis()),
            "route-refresh-ms",
            "must be between 10 and 2000",
        );
        check(
            self.batching.max_events != 0,
            "batch-max-events",
            "must be at least 1",
        );
        check(
            self.batching.max_keys != 0 && self.batching.max_keys <= 100_000,
            "batch-max-keys",
            "must be between 1 and 100000",
        );
        check(
            !self.batching.flush_interval.is_zero(),
            "flush-interval-ms",
            "must be at least 1",
        );
        check(
            self.batching.max_in_flight != 0,
            "max-in-flight",
            "must be at least 1",
        );
        check(
            self.schema_ids
                .iter()
                .all(|&id| (1..=MAX_SCHEMA_ID).contains(&id)),
            "schema-ids",
            "each id must be between 1 and 2147483647 (Schema Registry ids are positive 32-bit integers)",
        );
        check(
            self.packing
                .fields
                .is_none_or(|f| (1..=packing::MAX_PACKED_FIELDS).contains(&f)),
            "packed-fields",
            "must be between 1 and 4096",
        );
        check(
            self.packing.counters != Some(0),
            "packed-counters",
            "must be at least 1",
        );
        check(
            (1..=dedupe::MAX_WINDOW).contains(&self.dedupe.span),
            "dedupe-window",
            "must be between 1 and 100000000 offsets",
        );
        problems.extend(self.kafka.problems());
        problems
    }
}
