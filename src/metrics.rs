//! Metrics: every name tally exports, in one place.
//!
//! Invariant: metrics are recorded per batch, never per event in the hot loop,
//! and no label carries a post or user id (unbounded cardinality). The same
//! figures are kept in [`Stats`] for the live demo display.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::{counter, gauge, histogram};

use crate::decode::BadReason;
use crate::fence::Decision;

/// Good events aggregated.
pub const EVENTS: &str = "tally_events_total";
/// Bad messages skipped, by `reason`.
pub const BAD_MESSAGES: &str = "tally_bad_messages_total";
/// Messages copied to the dead-letter topic.
pub const DEAD_LETTERS: &str = "tally_dead_letters_total";
/// Batches finished, by `outcome`: `applied` (every script landed or was
/// already in) or `resync` (a fence disagreed; the partition re-reads).
pub const BATCHES: &str = "tally_batches_total";
/// Lua script replies, by `outcome` (applied, duplicate, straddle, gap).
pub const SCRIPTS: &str = "tally_scripts_total";
/// Counter keys per script.
pub const SCRIPT_KEYS: &str = "tally_script_keys";
/// Counter increments performed by applied batches.
pub const INCREMENTS: &str = "tally_increments_total";
/// Time from sending a batch's script to its reply, retries included.
pub const APPLY_SECONDS: &str = "tally_apply_seconds";
/// Messages per closed batch.
pub const BATCH_MESSAGES: &str = "tally_batch_messages";
/// Redis errors that were retried.
pub const REDIS_RETRIES: &str = "tally_redis_retries_total";
/// Times the Lua script had to be loaded again (NOSCRIPT).
pub const SCRIPT_RELOADS: &str = "tally_script_reloads_total";
/// Seeks back to a fence after a straddle or a gap.
pub const RESYNCS: &str = "tally_resyncs_total";
/// Partitions currently assigned to this consumer.
pub const ASSIGNED_PARTITIONS: &str = "tally_assigned_partitions";
/// Kafka offset commits that failed (harmless: the fence is the truth).
pub const COMMIT_FAILURES: &str = "tally_commit_failures_total";

/// Routing versions published, by `trigger` (`auto` from hot-post detection,
/// `manual` from `tally promote` and `tally demote` when they run inside a
/// process that exports metrics).
pub const PROMOTIONS: &str = "tally_promotions_total";
/// Posts with routing metadata in this consumer's view of the registry.
pub const ROUTED_POSTS: &str = "tally_routed_posts";
/// Pauses taken before routing an event stamped ahead of the registry clock,
/// or while the registry view was too old for it.
pub const ROUTE_WAITS: &str = "tally_route_waits_total";
/// Counts served from the reader's cache.
pub const READ_CACHE_HITS: &str = "tally_read_cache_hits_total";
/// Counts the reader had to fetch (a miss that joined another's fetch included).
pub const READ_CACHE_MISSES: &str = "tally_read_cache_misses_total";

/// Registers every series at zero so dashboards see them before the first event.
pub fn describe() {
    for reason in BadReason::ALL {
        counter!(BAD_MESSAGES, "reason" => reason.as_str()).absolute(0);
    }
    for outcome in ["applied", "duplicate", "straddle", "gap"] {
        counter!(SCRIPTS, "outcome" => outcome).absolute(0);
    }
    for outcome in ["applied", "resync"] {
        counter!(BATCHES, "outcome" => outcome).absolute(0);
    }
    for name in [
        EVENTS,
        DEAD_LETTERS,
        INCREMENTS,
        REDIS_RETRIES,
        SCRIPT_RELOADS,
        RESYNCS,
        COMMIT_FAILURES,
        ROUTE_WAITS,
        READ_CACHE_HITS,
        READ_CACHE_MISSES,
    ] {
        counter!(name).absolute(0);
    }
    for trigger in ["auto", "manual"] {
        counter!(PROMOTIONS, "trigger" => trigger).absolute(0);
    }
    gauge!(ROUTED_POSTS).set(0.0);
    gauge!(ASSIGNED_PARTITIONS).set(0.0);
}

/// Live totals for the demo display; updated per batch.
#[derive(Debug, Default)]
pub struct Stats {
    /// Messages consumed (good and bad) in applied batches.
    pub messages: AtomicU64,
    /// Batches whose script reported applied or duplicate.
    pub batches: AtomicU64,
    /// Counter increments sent to Redis by applied batches.
    pub increments: AtomicU64,
    /// Bad messages seen.
    pub bad: AtomicU64,
}

impl Stats {
    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Records a bad message.
pub fn bad_message(stats: &Stats, reason: BadReason) {
    stats.bad.fetch_add(1, Ordering::Relaxed);
    counter!(BAD_MESSAGES, "reason" => reason.as_str()).increment(1);
}

/// Records a dead-lettered message.
pub fn dead_lettered() {
    counter!(DEAD_LETTERS).increment(1);
}

/// Records one script's reply.
pub fn script_done(decision: Decision, keys: usize) {
    let outcome = match decision {
        Decision::Apply => "applied",
        Decision::Duplicate => "duplicate",
        Decision::Straddle => "straddle",
        Decision::Gap => "gap",
    };
    counter!(SCRIPTS, "outcome" => outcome).increment(1);
    histogram!(SCRIPT_KEYS).record(keys as f64);
}

/// Records a finished batch: `increments` counters written by its applied
/// scripts; `applied` when the partition carries on, `false` on a resync.
pub fn batch_done(
    stats: &Stats,
    applied: bool,
    messages: u64,
    bad: u64,
    increments: usize,
    took: Duration,
) {
    counter!(BATCHES, "outcome" => if applied { "applied" } else { "resync" }).increment(1);
    histogram!(APPLY_SECONDS).record(took.as_secs_f64());
    histogram!(BATCH_MESSAGES).record(messages as f64);
    counter!(INCREMENTS).increment(increments as u64);
    stats
        .increments
        .fetch_add(increments as u64, Ordering::Relaxed);
    if applied {
        counter!(EVENTS).increment(messages - bad);
        stats.messages.fetch_add(messages, Ordering::Relaxed);
        stats.batches.fetch_add(1, Ordering::Relaxed);
    }
}

/// Records a Redis retry.
pub fn redis_retry() {
    counter!(REDIS_RETRIES).increment(1);
}

/// Records a NOSCRIPT reload.
pub fn script_reloaded() {
    counter!(SCRIPT_RELOADS).increment(1);
}

/// Records a seek back to the fence.
pub fn resynced() {
    counter!(RESYNCS).increment(1);
}

/// Records the number of assigned partitions.
pub fn assigned(partitions: usize) {
    gauge!(ASSIGNED_PARTITIONS).set(partitions as f64);
}

/// Records a failed offset commit.
pub fn commit_failed() {
    counter!(COMMIT_FAILURES).increment(1);
}

/// Records a published routing version.
pub fn promoted(trigger: crate::versions::Trigger) {
    let trigger = match trigger {
        crate::versions::Trigger::Auto => "auto",
        crate::versions::Trigger::Manual => "manual",
    };
    counter!(PROMOTIONS, "trigger" => trigger).increment(1);
}

/// Records the number of posts with routing metadata.
pub fn routed_posts(posts: usize) {
    gauge!(ROUTED_POSTS).set(posts as f64);
}

/// Records a pause before routing an event.
pub fn route_wait() {
    counter!(ROUTE_WAITS).increment(1);
}

/// Records reads served from the cache (`hit`) or fetched.
pub fn read_cache(hits: u64, misses: u64) {
    if hits > 0 {
        counter!(READ_CACHE_HITS).increment(hits);
    }
    if misses > 0 {
        counter!(READ_CACHE_MISSES).increment(misses);
    }
}

/// Serves Prometheus metrics at `http://<addr>/metrics`.
pub fn serve(addr: std::net::SocketAddr) -> Result<(), String> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(APPLY_SECONDS.to_string()),
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
            ],
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(BATCH_MESSAGES.to_string()),
                &[1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6],
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(SCRIPT_KEYS.to_string()),
                &[0.0, 1.0, 10.0, 100.0, 1e3, 1e4],
            )
        })
        .and_then(|b| b.install())
        .map_err(|e| format!("cannot serve metrics on {addr}: {e} (fix --metrics-addr)"))
}
