//! Metrics: every name tally exports, in one place ([`ALL`]).
//!
//! Invariant: metrics are recorded per batch, never per event in the hot loop,
//! and no label carries a post or user id (unbounded cardinality; a partition
//! number is bounded by the topic). Dashboards and alerts may only name
//! metrics listed in [`ALL`] (a test holds `deploy/` to it). Label values
//! are given by the callers as `&'static str`, from their own closed sets.

use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit, counter,
    describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use metrics_exporter_prometheus::{
    BuildError, Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

/// Good events aggregated.
pub const EVENTS: &str = "tally_events_total";
/// Messages taken from the log, applied or not.
pub const MESSAGES_READ: &str = "tally_messages_read_total";
/// Bad messages skipped, by `reason`.
pub const BAD_MESSAGES: &str = "tally_bad_messages_total";
/// Messages copied to the dead-letter topic.
pub const DEAD_LETTERS: &str = "tally_dead_letters_total";
/// Batches finished, by `outcome`: `applied` (every script landed or was
/// already in) or `resync` (a fence disagreed; the partition re-reads).
pub const BATCHES: &str = "tally_batches_total";
/// Lua script replies, by `outcome` (applied, duplicate, straddle, gap,
/// refused: a counter key refused its increment and nothing was written).
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
/// `manual` from `tally promote` and `tally demote`).
pub const PROMOTIONS: &str = "tally_promotions_total";
/// Count reads answered from the read cache.
pub const READ_CACHE_HITS: &str = "tally_read_cache_hits_total";
/// Count reads that had to sum the buckets in Redis.
pub const READ_CACHE_MISSES: &str = "tally_read_cache_misses_total";
/// Times the generation pointer named an older generation than the one written.
pub const GENERATION_BACKWARDS: &str = "tally_generation_backwards_total";
/// HTTP requests `tally serve` answered, by `route` and `status`.
pub const READ_REQUESTS: &str = "tally_read_requests_total";
/// Time `tally serve` took to answer, by `route`.
pub const READ_SECONDS: &str = "tally_read_request_seconds";
/// Fetches the read path sent to Redis (each one or two pipelines).
pub const READ_FETCHES: &str = "tally_read_fetches_total";
/// The metrics only `tally serve` records (its HTTP answers, by route).
pub const SERVE_ONLY: [&str; 2] = [READ_REQUESTS, READ_SECONDS];
/// Offsets between a partition's last commit and its last stable offset
/// (the end of what a read_committed consumer may read), by `partition`.
pub const CONSUMER_LAG: &str = "tally_consumer_lag_messages";
/// Age of the newest applied event while newer ones wait (0 when caught
/// up), by `partition`.
pub const CONSUMER_LAG_SECONDS: &str = "tally_consumer_lag_seconds";
/// Dead-letter copies that failed and are retried.
pub const DEAD_LETTER_FAILURES: &str = "tally_dead_letter_failures_total";
/// 1 while `/readyz` answers 200, 0 otherwise.
pub const READY: &str = "tally_ready";
/// Last Kafka offset applied to Redis (the fence), by `partition`.
pub const APPLIED_OFFSET: &str = "tally_applied_offset";
/// Consumer group rebalances this consumer took part in.
pub const REBALANCES: &str = "tally_rebalances_total";
/// Routing metadata writes fewer replicas acknowledged than required, by
/// `step` (`reserve`: the promotion was dropped; `publish`, `rebucket`:
/// in force, but a failover may lose it).
pub const REGISTRY_UNREPLICATED: &str = "tally_registry_unreplicated_total";
/// Where the time from a like's produce to its count goes, by `stage`
/// (one of [`STAGES`]), measured once per batch on its first message.
pub const STAGE_SECONDS: &str = "tally_stage_seconds";
/// The `stage` labels of [`STAGE_SECONDS`]: `fetch` (from the message's
/// timestamp to its receipt by the consumer), `batch` (from its receipt until
/// its batch is sent to Redis), `script` (from sending until Redis answered,
/// retries included), `commit` (from queueing the batch's offset commit, once
/// the script answered, until the group coordinator acknowledged it, as the
/// consumer's commit callback reports). The count is visible before `commit`
/// starts: the commit stage is how far the group's offsets trail the counts.
pub const STAGES: [&str; 4] = ["fetch", "batch", "script", "commit"];
/// The `step` labels of [`REGISTRY_UNREPLICATED`].
pub const REGISTRY_STEPS: [&str; 4] = ["reserve", "publish", "rebucket", "unfreeze"];

/// Offsets never applied because they left the log first, by `reason`
/// (`retention`: deleted before tally applied them).
pub const OFFSETS_SKIPPED: &str = "tally_offsets_skipped_total";

/// Owned partitions stopped because their fence lies beyond the end of
/// their log (a topic recreated or replaced while tally ran).
pub const FENCE_AHEAD: &str = "tally_fence_ahead_partitions";

/// Records skipped as repeats of a like (see [`crate::pipeline::dedupe`]),
/// by `reason`: `event_id` or `repeat_action`.
pub const DUPLICATES_SKIPPED: &str = "tally_duplicates_skipped_total";
/// Likes too late for a window of trending counts.
pub const WINDOW_LATE: &str = "tally_window_late_likes_total";
/// Per partition, the seconds of record time the dedupe window covers.
pub const DEDUPE_WINDOW_SECONDS: &str = "tally_dedupe_window_seconds";
/// The reasons of [`DUPLICATES_SKIPPED`], as the dedupe stage labels them.
pub const DUPLICATE_REASONS: [&str; 2] = ["event_id", "repeat_action"];
/// Events the dedupe windows of this consumer remember, over its partitions.
pub const DEDUPE_REMEMBERED: &str = "tally_dedupe_remembered_events";
/// Seconds a partition's dedupe window took to be re-read from the log, from
/// its restart (assignment, resync, a new generation) until the first record
/// above the fences could be decided.
pub const DEDUPE_REREAD_SECONDS: &str = "tally_dedupe_reread_seconds";
/// Dedupe windows of partitions given up, kept in case they come back.
pub const DEDUPE_WINDOWS_KEPT: &str = "tally_dedupe_windows_kept";
/// 1 while a primary's eviction policy may evict keys tally needs.
pub const EVICTION_POLICY_UNSAFE: &str = "tally_eviction_policy_unsafe";
/// 1 while the consumed topic's cleanup.policy compacts it.
pub const TOPIC_COMPACTED: &str = "tally_topic_compacted";
/// 1 while the generation pointer holds what tally never writes there.
pub const GENERATION_POINTER_UNREADABLE: &str = "tally_generation_pointer_unreadable";
/// Offsets a dedupe window should have re-read that retention had deleted.
pub const DEDUPE_HISTORY_LOST: &str = "tally_dedupe_history_lost_offsets_total";
/// Entries dedupe windows dropped: records whose repeats are no longer
/// recognized, and whose verdicts another owner may not share.
pub const DEDUPE_FORGOTTEN: &str = "tally_dedupe_forgotten_entries_total";
/// 1 while the prefix's dedupe rule is not the one this writer judges by.
pub const DEDUPE_RULE_MISMATCH: &str = "tally_dedupe_rule_mismatch";
/// Per partition, the age of the re-read running now (0 when none runs).
pub const DEDUPE_REREAD_AGE: &str = "tally_dedupe_reread_age_seconds";
/// Per partition, the offsets the running re-read has left below the fences
/// (0 when none runs).
pub const DEDUPE_REREAD_REMAINING: &str = "tally_dedupe_reread_remaining_offsets";

/// The most fields this consumer has seen in one hash of a packed
/// generation (0 on string keys).
pub const PACKED_FILL_MAX: &str = "tally_packed_hash_fill_max";
/// The server's `hash-max-listpack-entries`, read at start (0 on string
/// keys): a hash with more fields has left the compact encoding.
pub const PACKED_FILL_LIMIT: &str = "tally_packed_hash_fill_limit";
/// Calls of a growing packed generation refused because they would have
/// filled a hash past the server's limit, sent again once the script split
/// the group to make room.
pub const PACKED_RESPLITS: &str = "tally_packed_resplits_total";

/// Posts with routing metadata in this consumer's view of the registry.
pub const ROUTED_POSTS: &str = "tally_routed_posts";
/// Events stamped ahead of what the registry view covers, routed without
/// waiting (on a cluster, after making routing final up to them).
pub const FUTURE_EVENTS: &str = "tally_future_events_total";
/// How far ahead of the registry clock routing is final (seconds; 0 when not).
pub const ROUTING_FINAL_AHEAD: &str = "tally_routing_final_ahead_seconds";
/// Unfreezes (`tally unfreeze-routing`) in this consumer's view of the registry.
pub const ROUTING_UNFREEZES: &str = "tally_routing_unfreezes";
/// Fields of the routing registry the last read could not parse.
pub const ROUTING_UNREADABLE: &str = "tally_routing_unreadable_fields";

/// Offsets a rebuild has recounted, by `partition`: from the partition's
/// origin to the new generation's lowest fence.
pub const REBUILD_RECOUNTED: &str = "tally_rebuild_recounted_offsets";
/// Offsets a rebuild has still to recount, by `partition`: from the new
/// generation's lowest fence to the partition's end now.
pub const REBUILD_REMAINING: &str = "tally_rebuild_remaining_offsets";
/// 1 for the phase a rebuild is in and 0 for the others, by `phase` (one of
/// [`REBUILD_PHASES`]).
pub const REBUILD_PHASE: &str = "tally_rebuild_phase";
/// The `phase` labels of [`REBUILD_PHASE`]: `starting` (finding the
/// generation, copying the routing registry, reading the origins),
/// `recounting`, `cutover` (live writers frozen until the new generation
/// holds what they applied) and `switched` (the pointer moved; the process
/// exits).
pub const REBUILD_PHASES: [&str; 4] = ["starting", "recounting", "cutover", "switched"];
/// What `tally rebuild --metrics-addr` exports: its progress, and nothing of
/// the pipeline that recounts, whose lag (days behind, by design) and event
/// rates would read as a live consumer's on dashboards and alerts.
pub const REBUILD_ONLY: [&str; 3] = [REBUILD_RECOUNTED, REBUILD_REMAINING, REBUILD_PHASE];

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution, exported as `_bucket`, `_sum` and `_count` series.
    Histogram,
}

/// Every metric tally exports: name, kind and help text (the `# HELP` line).
pub const ALL: &[(&str, Kind, &str)] = &[
    (EVENTS, Kind::Counter, "Good like events applied."),
    (
        MESSAGES_READ,
        Kind::Counter,
        "Messages taken from the log: every message a batch covers, and those re-read to rebuild a dedupe window or dropped as read before a seek. Its rate against tally_events_total's tells a consumer held by its reading from one held by its store.",
    ),
    (
        BAD_MESSAGES,
        Kind::Counter,
        "Bad messages skipped, by reason (BadReason: empty, undecodable, post_id_zero, action_unknown and the others docs/contract.md lists).",
    ),
    (
        DEAD_LETTERS,
        Kind::Counter,
        "Bad messages copied to the dead-letter topic.",
    ),
    (
        BATCHES,
        Kind::Counter,
        "Batches finished, by outcome (applied, resync).",
    ),
    (
        SCRIPTS,
        Kind::Counter,
        "Lua script replies, by outcome (applied, duplicate, straddle, gap; refused: a counter key refused its increment and nothing was written).",
    ),
    (SCRIPT_KEYS, Kind::Histogram, "Counter keys per script."),
    (
        INCREMENTS,
        Kind::Counter,
        "Counter increments made by applied batches.",
    ),
    (
        APPLY_SECONDS,
        Kind::Histogram,
        "Batch apply latency in seconds, retries included.",
    ),
    (BATCH_MESSAGES, Kind::Histogram, "Messages per batch."),
    (
        STAGE_SECONDS,
        Kind::Histogram,
        "Where produce-to-visible time goes, per batch's first message, by stage (fetch, batch, script; commit: the offset commit after the count is visible).",
    ),
    (REDIS_RETRIES, Kind::Counter, "Redis errors retried."),
    (
        SCRIPT_RELOADS,
        Kind::Counter,
        "Lua script reloads after NOSCRIPT.",
    ),
    (
        RESYNCS,
        Kind::Counter,
        "Seeks back to a fence after a straddle or a gap.",
    ),
    (
        ASSIGNED_PARTITIONS,
        Kind::Gauge,
        "Partitions assigned to this consumer.",
    ),
    (
        COMMIT_FAILURES,
        Kind::Counter,
        "Failed Kafka offset commits (harmless: the fence is the truth).",
    ),
    (
        PROMOTIONS,
        Kind::Counter,
        "Routing versions published, by trigger (auto, manual).",
    ),
    (
        READ_CACHE_HITS,
        Kind::Counter,
        "Count reads answered from the read cache.",
    ),
    (
        READ_CACHE_MISSES,
        Kind::Counter,
        "Count reads that summed the buckets in Redis.",
    ),
    (
        CONSUMER_LAG,
        Kind::Gauge,
        "Messages not yet applied, by partition.",
    ),
    (
        GENERATION_BACKWARDS,
        Kind::Counter,
        "Times the generation pointer named an older generation than the one written (not followed).",
    ),
    (
        READ_REQUESTS,
        Kind::Counter,
        "HTTP requests tally serve answered, by route and status.",
    ),
    (
        READ_SECONDS,
        Kind::Histogram,
        "Seconds tally serve took to answer, by route.",
    ),
    (
        READ_FETCHES,
        Kind::Counter,
        "Fetches the read path sent to Redis (each one or two pipelines, for any number of posts).",
    ),
    (
        CONSUMER_LAG_SECONDS,
        Kind::Gauge,
        "Age of the oldest message fetched and not yet applied, from its Kafka timestamp (0 when none waits), by partition.",
    ),
    (
        REGISTRY_UNREPLICATED,
        Kind::Counter,
        "Routing metadata writes fewer Redis replicas acknowledged than --registry-replicas asks, by step.",
    ),
    (
        DEAD_LETTER_FAILURES,
        Kind::Counter,
        "Dead-letter copies that failed and are retried; each holds its batch back.",
    ),
    (
        READY,
        Kind::Gauge,
        "1 while /readyz answers 200, 0 otherwise.",
    ),
    (
        APPLIED_OFFSET,
        Kind::Gauge,
        "Last Kafka offset applied to Redis, by partition.",
    ),
    (
        REBALANCES,
        Kind::Counter,
        "Consumer group rebalances this consumer took part in.",
    ),
    (
        OFFSETS_SKIPPED,
        Kind::Counter,
        "Offsets never applied because they left the log first, by reason (retention: deleted before tally applied them).",
    ),
    (
        FENCE_AHEAD,
        Kind::Gauge,
        "Owned partitions stopped because their fence lies beyond the end of their log (topic recreated or replaced while tally ran); the others go on.",
    ),
    (
        DUPLICATES_SKIPPED,
        Kind::Counter,
        "Records that changed no count because they repeat a like within the dedupe window, by reason (event_id: an earlier record carries its event id; repeat_action: a like after a like, or an unlike after an unlike, of the same user and post, with or without event ids).",
    ),
    (
        WINDOW_LATE,
        Kind::Counter,
        "Likes that count in the lifetime count but not in a window of trending counts, once for each window: their record was written after the window's end plus --window-lateness (or has no time at all).",
    ),
    (
        DEDUPE_WINDOW_SECONDS,
        Kind::Gauge,
        "Per partition, the seconds of record time between the oldest event the dedupe window remembers and the newest record: how far apart two records may be and still be found as duplicates now.",
    ),
    (
        DEDUPE_REMEMBERED,
        Kind::Gauge,
        "Events the dedupe windows of this consumer remember, over its partitions (at most --dedupe-window per partition).",
    ),
    (
        DEDUPE_REREAD_SECONDS,
        Kind::Histogram,
        "Seconds a partition's dedupe window took to be re-read from the log below its fences, from the partition's assignment (or resync, or new generation) until its first record above them could be decided; nothing above them is applied meanwhile.",
    ),
    (
        EVICTION_POLICY_UNSAFE,
        Kind::Gauge,
        "1 while a primary's maxmemory-policy, read again every 10 s, may evict keys tally needs (allkeys-*, or volatile-* on a prefix with trending windows), set under the running process; 0 otherwise.",
    ),
    (
        TOPIC_COMPACTED,
        Kind::Gauge,
        "1 while the consumed topic's cleanup.policy, read again every 10 s, includes compact (set under the running process): Kafka's log cleaner may delete likes that share a key before they are counted. 0 otherwise.",
    ),
    (
        GENERATION_POINTER_UNREADABLE,
        Kind::Gauge,
        "1 while a running writer reads a generation pointer (or freeze flag) holding a value tally never writes there; it goes on writing the generation it last read, and no rebuild can switch. 0 otherwise.",
    ),
    (
        DEDUPE_HISTORY_LOST,
        Kind::Counter,
        "Offsets below a partition's fences that its dedupe window should have re-read at an assignment and that retention had deleted: a repeat of a record among them is not recognized and counts.",
    ),
    (
        DEDUPE_RULE_MISMATCH,
        Kind::Gauge,
        "1 while the prefix's dedupe rule (--dedupe and --dedupe-window, read again every 10 s) is not the one this writer judges repeats by: another replica started with --dedupe-change, and the partitions this one owns count repeats the others skip (or skip what they count) until it is restarted with the new rule. 0 otherwise.",
    ),
    (
        DEDUPE_FORGOTTEN,
        Kind::Counter,
        "Entries a dedupe window's table dropped because they would lie too far from their home slot, which only keys crafted to share one slot cause: a repeat of the record one held is not recognized and counts, and another owner of the partition may decide it otherwise.",
    ),
    (
        DEDUPE_WINDOWS_KEPT,
        Kind::Gauge,
        "Dedupe windows of partitions this consumer gave up, kept for 10 minutes so that a partition coming back re-reads only the offsets applied since; with the owned ones never more than the most partitions it owned at once.",
    ),
    (
        DEDUPE_REREAD_AGE,
        Kind::Gauge,
        "Per partition, seconds since the dedupe window's re-read that is running now began (0 when none runs).",
    ),
    (
        DEDUPE_REREAD_REMAINING,
        Kind::Gauge,
        "Per partition, offsets the running re-read of the dedupe window has left below the fences (0 when none runs).",
    ),
    (
        PACKED_FILL_MAX,
        Kind::Gauge,
        "The most fields this consumer has seen in one hash of a packed generation after a script (0 on string keys); above tally_packed_hash_fill_limit the hash has become a hashtable and costs several times the memory.",
    ),
    (
        PACKED_FILL_LIMIT,
        Kind::Gauge,
        "The server's hash-max-listpack-entries, read at start (0 on string keys).",
    ),
    (
        PACKED_RESPLITS,
        Kind::Counter,
        "Script calls of a packed generation whose hashes grow that would have filled a hash past the server's limit: refused with nothing counted once the script split the group to make room, and sent again addressed anew.",
    ),
    (
        ROUTED_POSTS,
        Kind::Gauge,
        "Posts with routing metadata in this consumer's view of the registry.",
    ),
    (
        FUTURE_EVENTS,
        Kind::Counter,
        "Events stamped ahead of the registry clock, routed without waiting (on a cluster, after making routing final up to them).",
    ),
    (
        ROUTING_FINAL_AHEAD,
        Kind::Gauge,
        "How far ahead of the registry clock routing is final, in seconds: new routing versions take effect only after it.",
    ),
    (
        ROUTING_UNFREEZES,
        Kind::Gauge,
        "Unfreezes recorded in this consumer's view of the routing registry: times tally unfreeze-routing brought routing made final far ahead back to the clock.",
    ),
    (
        ROUTING_UNREADABLE,
        Kind::Gauge,
        "Fields of the routing registry the last read could not parse (a value tally did not write): each post among them routes, and is read, by the defaults alone, so its count reads without its hot buckets.",
    ),
    (
        REBUILD_RECOUNTED,
        Kind::Gauge,
        "tally rebuild: offsets recounted into the new generation, by partition (from its origin to the new generation's lowest fence).",
    ),
    (
        REBUILD_REMAINING,
        Kind::Gauge,
        "tally rebuild: offsets left to recount, by partition (from the new generation's lowest fence to the partition's end now).",
    ),
    (
        REBUILD_PHASE,
        Kind::Gauge,
        "tally rebuild: 1 for the phase it is in, by phase (starting, recounting, cutover, switched).",
    ),
];

/// Script outcomes, the values of [`SCRIPTS`]' `outcome` label.
pub const SCRIPT_OUTCOMES: [&str; 5] = ["applied", "duplicate", "straddle", "gap", "refused"];
/// Routing triggers, the values of [`PROMOTIONS`]' `trigger` label.
pub const TRIGGERS: [&str; 2] = ["auto", "manual"];

/// Describes every metric and registers every unlabelled (or fixed-label)
/// series at zero, so dashboards see them before the first event;
/// `bad_reasons` are the values of [`BAD_MESSAGES`]' `reason` label.
pub fn describe(bad_reasons: &[&'static str]) {
    for &(name, kind, help) in ALL {
        match kind {
            Kind::Counter => describe_counter!(name, help),
            Kind::Gauge => describe_gauge!(name, help),
            Kind::Histogram => describe_histogram!(name, help),
        }
    }
    for &reason in bad_reasons {
        counter!(BAD_MESSAGES, "reason" => reason).absolute(0);
    }
    for outcome in SCRIPT_OUTCOMES {
        counter!(SCRIPTS, "outcome" => outcome).absolute(0);
    }
    for outcome in ["applied", "resync"] {
        counter!(BATCHES, "outcome" => outcome).absolute(0);
    }
    for name in [
        EVENTS,
        MESSAGES_READ,
        DEAD_LETTERS,
        INCREMENTS,
        REDIS_RETRIES,
        SCRIPT_RELOADS,
        RESYNCS,
        COMMIT_FAILURES,
        GENERATION_BACKWARDS,
        FUTURE_EVENTS,
        DEAD_LETTER_FAILURES,
        READ_CACHE_HITS,
        READ_CACHE_MISSES,
        READ_FETCHES,
        REBALANCES,
    ] {
        counter!(name).absolute(0);
    }
    for trigger in TRIGGERS {
        counter!(PROMOTIONS, "trigger" => trigger).absolute(0);
    }
    for step in REGISTRY_STEPS {
        counter!(REGISTRY_UNREPLICATED, "step" => step).absolute(0);
    }
    counter!(OFFSETS_SKIPPED, "reason" => "retention").absolute(0);
    counter!(DEDUPE_HISTORY_LOST).absolute(0);
    counter!(DEDUPE_FORGOTTEN).absolute(0);
    gauge!(DEDUPE_RULE_MISMATCH).set(0.0);
    gauge!(EVICTION_POLICY_UNSAFE).set(0.0);
    for reason in DUPLICATE_REASONS {
        counter!(DUPLICATES_SKIPPED, "reason" => reason).absolute(0);
    }
    gauge!(DEDUPE_REMEMBERED).set(0.0);
    gauge!(DEDUPE_WINDOWS_KEPT).set(0.0);
    counter!(WINDOW_LATE).absolute(0);
    // Registered so that its series exist before the first re-read ends.
    let _ = histogram!(DEDUPE_REREAD_SECONDS);
    gauge!(ROUTED_POSTS).set(0.0);
    // Both may be known before the exporter is described (the limit is read
    // at start): registered with what is known.
    let known = |value: &std::sync::atomic::AtomicU64| {
        value.load(std::sync::atomic::Ordering::Relaxed) as f64
    };
    gauge!(PACKED_FILL_MAX).set(known(&PACKED_FILL));
    gauge!(PACKED_FILL_LIMIT).set(known(&PACKED_LIMIT));
    counter!(PACKED_RESPLITS).absolute(0);
    gauge!(FENCE_AHEAD).set(0.0);
    gauge!(ROUTING_FINAL_AHEAD).set(0.0);
    gauge!(ROUTING_UNFREEZES).set(0.0);
    gauge!(ROUTING_UNREADABLE).set(0.0);
    gauge!(READY).set(0.0);
    gauge!(ASSIGNED_PARTITIONS).set(0.0);
}

/// Records a bad message.
pub fn bad_message(reason: &'static str) {
    counter!(BAD_MESSAGES, "reason" => reason).increment(1);
}

/// Records records skipped as repeats of a like, by reason.
pub fn duplicates_skipped(reason: &'static str, records: u64) {
    counter!(DUPLICATES_SKIPPED, "reason" => reason).increment(records);
}

/// Records the time a partition's dedupe window covers.
pub fn dedupe_window(partition: i32, seconds: f64) {
    gauge!(DEDUPE_WINDOW_SECONDS, "partition" => partition.to_string()).set(seconds);
}

/// Records how many events the dedupe windows remember.
pub fn dedupe_remembered(events: usize) {
    gauge!(DEDUPE_REMEMBERED).set(events as f64);
}

/// Records how many windows of partitions given up are kept.
pub fn dedupe_windows_kept(windows: usize) {
    gauge!(DEDUPE_WINDOWS_KEPT).set(windows as f64);
}

/// Records a partition's running re-read: its age and the offsets it has
/// left; zero and zero when none runs.
pub fn dedupe_reread(partition: i32, age: Duration, remaining: i64) {
    let partition = partition.to_string();
    gauge!(DEDUPE_REREAD_AGE, "partition" => partition.clone()).set(age.as_secs_f64());
    gauge!(DEDUPE_REREAD_REMAINING, "partition" => partition).set(remaining.max(0) as f64);
}

/// Records whether a primary's eviction policy may evict tally's keys now.
pub fn eviction_policy_unsafe(unsafe_now: bool) {
    gauge!(EVICTION_POLICY_UNSAFE).set(if unsafe_now { 1.0 } else { 0.0 });
}

/// Records whether the consumed topic's cleanup.policy compacts it.
pub fn topic_compacted(compacted: bool) {
    gauge!(TOPIC_COMPACTED).set(if compacted { 1.0 } else { 0.0 });
}

/// Records whether the generation pointer holds a value tally never writes.
pub fn generation_pointer_unreadable(unreadable: bool) {
    gauge!(GENERATION_POINTER_UNREADABLE).set(if unreadable { 1.0 } else { 0.0 });
}

/// Records offsets a dedupe window could not re-read: retention deleted them.
pub fn dedupe_history_lost(offsets: u64) {
    counter!(DEDUPE_HISTORY_LOST).increment(offsets);
}

/// Records whether the prefix's dedupe rule is another than this writer's.
pub fn dedupe_rule_mismatch(mismatch: bool) {
    gauge!(DEDUPE_RULE_MISMATCH).set(if mismatch { 1.0 } else { 0.0 });
}

/// Records entries a dedupe window dropped.
pub fn dedupe_forgotten(entries: u64) {
    counter!(DEDUPE_FORGOTTEN).increment(entries);
}

/// Records a re-read that reached the fences after `took`.
pub fn dedupe_reread_done(partition: i32, took: Duration) {
    histogram!(DEDUPE_REREAD_SECONDS).record(took.as_secs_f64());
    dedupe_reread(partition, Duration::ZERO, 0);
}

/// Records a dead-lettered message.
pub fn dead_lettered() {
    counter!(DEAD_LETTERS).increment(1);
}

/// Records `messages` taken from the log in one run (never one call per
/// message: the readers share this counter).
pub fn messages_read(messages: usize) {
    counter!(MESSAGES_READ).increment(messages as u64);
}

/// Records one script's reply (`outcome`: one of [`SCRIPT_OUTCOMES`]).
pub fn script_done(outcome: &'static str, keys: usize) {
    counter!(SCRIPTS, "outcome" => outcome).increment(1);
    histogram!(SCRIPT_KEYS).record(keys as f64);
}

/// Records a finished batch: `increments` counters written by its applied
/// scripts; `applied` when the partition carries on, `false` on a resync.
pub fn batch_done(applied: bool, messages: u64, bad: u64, increments: usize, took: Duration) {
    counter!(BATCHES, "outcome" => if applied { "applied" } else { "resync" }).increment(1);
    histogram!(APPLY_SECONDS).record(took.as_secs_f64());
    histogram!(BATCH_MESSAGES).record(messages as f64);
    counter!(INCREMENTS).increment(increments as u64);
    if applied {
        counter!(EVENTS).increment(messages - bad);
    }
}

/// Records the likes of an applied batch too late for a window of theirs.
pub fn window_late(likes: u64) {
    if likes > 0 {
        counter!(WINDOW_LATE).increment(likes);
    }
}

/// Records a Redis retry.
pub fn redis_retry() {
    counter!(REDIS_RETRIES).increment(1);
}

/// The fullest packed hash seen so far by this process.
static PACKED_FILL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// The server's limit of fields in a compact hash (0: not known).
static PACKED_LIMIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Records the fields of the hash one packed script sampled (one per
/// script, not per event); the gauge keeps the most seen. `true` when this is a new most
/// and above the server's limit: a hash has left the compact encoding.
pub fn packed_fill(fields: u64) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let before = PACKED_FILL.fetch_max(fields, Relaxed);
    if fields <= before {
        return false;
    }
    gauge!(PACKED_FILL_MAX).set(fields as f64);
    let limit = PACKED_LIMIT.load(Relaxed);
    limit > 0 && fields > limit
}

/// Records the server's limit of fields in a compact hash.
pub fn packed_fill_limit(entries: u64) {
    PACKED_LIMIT.store(entries, std::sync::atomic::Ordering::Relaxed);
    gauge!(PACKED_FILL_LIMIT).set(entries as f64);
}

/// Records a call refused for a split state that moved on, sent again.
pub fn packed_resplit() {
    counter!(PACKED_RESPLITS).increment(1);
}

/// Records a script that refused a counter key and wrote nothing.
pub fn script_refused() {
    counter!(SCRIPTS, "outcome" => "refused").increment(1);
}

/// Records offsets that left the log before they were applied.
pub fn offsets_skipped(reason: &'static str, offsets: u64) {
    counter!(OFFSETS_SKIPPED, "reason" => reason).increment(offsets);
}

/// Records how many owned partitions are stopped with their fence ahead of their log.
pub fn fence_ahead(partitions: usize) {
    gauge!(FENCE_AHEAD).set(partitions as f64);
}

/// Records the phase a rebuild is in (one of [`REBUILD_PHASES`]).
pub fn rebuild_phase(phase: &'static str) {
    for each in REBUILD_PHASES {
        gauge!(REBUILD_PHASE, "phase" => each).set(if each == phase { 1.0 } else { 0.0 });
    }
}

/// Records a rebuild's offsets recounted and left on one partition.
pub fn rebuild_offsets(partition: i32, recounted: i64, remaining: i64) {
    let partition = partition.to_string();
    gauge!(REBUILD_RECOUNTED, "partition" => partition.clone()).set(recounted as f64);
    gauge!(REBUILD_REMAINING, "partition" => partition).set(remaining as f64);
}

/// Records how far ahead of the registry clock routing is final.
pub fn routing_final_ahead(ms: i64) {
    gauge!(ROUTING_FINAL_AHEAD).set(ms.max(0) as f64 / 1000.0);
}

/// Records how many fields of the registry the last read could not parse.
pub fn routing_unreadable(fields: usize) {
    gauge!(ROUTING_UNREADABLE).set(fields as f64);
}

/// Records how many unfreezes the registry holds.
pub fn routing_unfreezes(records: usize) {
    gauge!(ROUTING_UNFREEZES).set(records as f64);
}

/// Describes every metric and registers the read path's series at zero:
/// what `tally serve` exports.
pub fn describe_reads() {
    for &(name, kind, help) in ALL {
        match kind {
            Kind::Counter => describe_counter!(name, help),
            Kind::Gauge => describe_gauge!(name, help),
            Kind::Histogram => describe_histogram!(name, help),
        }
    }
    for name in [READ_CACHE_HITS, READ_CACHE_MISSES, READ_FETCHES] {
        counter!(name).absolute(0);
    }
}

/// Records a generation pointer that went back.
pub fn generation_backwards() {
    counter!(GENERATION_BACKWARDS).increment(1);
}

/// Records one answered HTTP request of the read path.
pub fn read_request(route: &'static str, status: u16, took: Duration) {
    // The statuses the read API answers, named without an allocation per request.
    let status: std::borrow::Cow<'static, str> = match status {
        200 => "200".into(),
        400 => "400".into(),
        404 => "404".into(),
        503 => "503".into(),
        other => other.to_string().into(),
    };
    counter!(READ_REQUESTS, "route" => route, "status" => status).increment(1);
    histogram!(READ_SECONDS, "route" => route).record(took.as_secs_f64());
}

/// Records a fetch of the read path.
pub fn read_fetch() {
    counter!(READ_FETCHES).increment(1);
}

/// Records a partition's lag in seconds.
pub fn consumer_lag_seconds(partition: i32, seconds: f64) {
    gauge!(CONSUMER_LAG_SECONDS, "partition" => partition.to_string()).set(seconds);
}

/// Records the time one batch's first message spent in `stage` (one of [`STAGES`]).
pub fn stage(stage: &'static str, took: Duration) {
    histogram!(STAGE_SECONDS, "stage" => stage).record(took.as_secs_f64());
}

/// Records a routing metadata write too few replicas acknowledged.
pub fn registry_unreplicated(step: &'static str) {
    counter!(REGISTRY_UNREPLICATED, "step" => step).increment(1);
}

/// Records a failed dead-letter copy.
pub fn dead_letter_failed() {
    counter!(DEAD_LETTER_FAILURES).increment(1);
}

/// Records readiness.
pub fn ready(ready: bool) {
    gauge!(READY).set(if ready { 1.0 } else { 0.0 });
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

/// Records a partition's lag (last stable offset minus the next offset to apply).
pub fn consumer_lag(partition: i32, messages: i64) {
    gauge!(CONSUMER_LAG, "partition" => partition.to_string()).set(messages.max(0) as f64);
}

/// Records the last offset applied for a partition.
pub fn applied_offset(partition: i32, offset: i64) {
    gauge!(APPLIED_OFFSET, "partition" => partition.to_string()).set(offset as f64);
}

/// Records a rebalance this consumer took part in.
pub fn rebalanced() {
    counter!(REBALANCES).increment(1);
}

/// Records a failed offset commit.
pub fn commit_failed() {
    counter!(COMMIT_FAILURES).increment(1);
}

/// Records a published routing version (`trigger`: one of [`TRIGGERS`]).
pub fn promoted(trigger: &'static str) {
    counter!(PROMOTIONS, "trigger" => trigger).increment(1);
}

/// Records the number of posts with routing metadata.
pub fn routed_posts(posts: usize) {
    gauge!(ROUTED_POSTS).set(posts as f64);
}

/// Records an event stamped ahead of the registry view, routed without waiting.
pub fn future_event() {
    counter!(FUTURE_EVENTS).increment(1);
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

/// Installs the Prometheus recorder (histogram buckets chosen per metric)
/// and returns the handle that renders `/metrics`.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    builder()?.install_recorder()
}

/// Installs the Prometheus recorder for the metrics named in `names` only:
/// whatever else the process records is dropped (`tally rebuild`, whose
/// recounting pipeline records everything `tally run` does).
pub fn install_only(names: &'static [&'static str]) -> Result<PrometheusHandle, BuildError> {
    let inner = builder()?.build_recorder();
    let handle = inner.handle();
    metrics::set_global_recorder(Only { names, inner }).map_err(|refused| {
        BuildError::FailedToSetGlobalRecorder(metrics::SetRecorderError(refused.0.inner))
    })?;
    Ok(handle)
}

/// The builder with each histogram's buckets.
fn builder() -> Result<PrometheusBuilder, BuildError> {
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in [
        (
            APPLY_SECONDS,
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
            ][..],
        ),
        (BATCH_MESSAGES, &[1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6][..]),
        (
            STAGE_SECONDS,
            &[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 10.0,
            ][..],
        ),
        (
            READ_SECONDS,
            &[
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.0,
            ][..],
        ),
        (SCRIPT_KEYS, &[0.0, 1.0, 10.0, 100.0, 1e3, 1e4][..]),
        (
            DEDUPE_REREAD_SECONDS,
            &[
                0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
            ][..],
        ),
    ] {
        builder = builder.set_buckets_for_metric(Matcher::Full(name.to_string()), buckets)?;
    }
    Ok(builder)
}

/// A recorder that passes on the metrics in `names` and drops the rest.
struct Only {
    names: &'static [&'static str],
    inner: PrometheusRecorder,
}

impl Only {
    fn keeps(&self, name: &str) -> bool {
        self.names.contains(&name)
    }
}

impl metrics::Recorder for Only {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        if self.keeps(key.as_str()) {
            self.inner.describe_counter(key, unit, description);
        }
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        if self.keeps(key.as_str()) {
            self.inner.describe_gauge(key, unit, description);
        }
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        if self.keeps(key.as_str()) {
            self.inner.describe_histogram(key, unit, description);
        }
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if self.keeps(key.name()) {
            self.inner.register_counter(key, metadata)
        } else {
            Counter::noop()
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if self.keeps(key.name()) {
            self.inner.register_gauge(key, metadata)
        } else {
            Gauge::noop()
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        if self.keeps(key.name()) {
            self.inner.register_histogram(key, metadata)
        } else {
            Histogram::noop()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rebuild_recorder_passes_on_its_progress_only() {
        let inner = builder().unwrap().build_recorder();
        let handle = inner.handle();
        let only = Only {
            names: &REBUILD_ONLY,
            inner,
        };
        metrics::with_local_recorder(&only, || {
            describe(&[]);
            batch_done(true, 10, 0, 3, Duration::from_millis(1));
            consumer_lag(0, 5);
            rebuild_phase("recounting");
            rebuild_offsets(0, 7, 3);
        });
        let text = handle.render();
        assert!(
            text.contains("tally_rebuild_recounted_offsets{partition=\"0\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("tally_rebuild_phase{phase=\"recounting\"} 1"),
            "{text}"
        );
        for name in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.split(['{', ' ']).next())
        {
            assert!(REBUILD_ONLY.contains(&name), "{name} passed: {text}");
        }
    }

    #[test]
    fn the_reread_series_are_served_before_the_first_reread_ends() {
        let recorder = builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || describe(&[]));
        let text = handle.render();
        assert!(
            text.contains("tally_dedupe_reread_seconds_count 0"),
            "{text}"
        );
        metrics::with_local_recorder(&recorder, || {
            dedupe_reread(3, Duration::from_secs(7), 1_000);
            dedupe_reread_done(3, Duration::from_millis(1_500));
        });
        let text = handle.render();
        for series in [
            "tally_dedupe_reread_seconds_bucket{le=\"2.5\"} 1",
            "tally_dedupe_reread_seconds_count 1",
            "tally_dedupe_reread_age_seconds{partition=\"3\"} 0",
            "tally_dedupe_reread_remaining_offsets{partition=\"3\"} 0",
        ] {
            assert!(text.contains(series), "no {series}: {text}");
        }
    }

    #[test]
    fn names_follow_prometheus_conventions() {
        let mut seen = std::collections::HashSet::new();
        for &(name, kind, help) in ALL {
            assert!(seen.insert(name), "{name} listed twice");
            assert!(name.starts_with("tally_"), "{name}");
            assert!(!help.is_empty(), "{name}");
            assert_eq!(
                kind == Kind::Counter,
                name.ends_with("_total"),
                "{name}: counters, and only counters, end in _total"
            );
        }
    }
}
