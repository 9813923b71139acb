//! # tally
//!
//! Counts likes at internet scale: consumes like/unlike events from Kafka,
//! sums them per (post, bucket) and applies each batch to Redis exactly once,
//! behind a per-partition fence checked and advanced in the same Lua script.
//!
//! This crate is the service. It prints nothing and parses no command line:
//! the `tally` binary (`src/bin/tally/`) turns flags into the settings of
//! [`infra::config`] and the results of these modules into text.
//!
//! # Layout
//!
//! ```text
//! pipeline/   the data path of `tally run`, one module per stage
//!   run         the loop wiring the stages (start, intake, reader, batches, scripts, follow)
//!   consume     the group consumer; every assignment starts at its fences, in a
//!               queue of its own
//!   decode      message bytes to a validated like, or a bad-message reason
//!   dedupe      which records repeat a like (the id and action rules), judged
//!               against a window of the partition's log; fingerprints: its table
//!   aggregate   per-partition batches of net deltas per (post, bucket), and per
//!               (post, window)
//!   apply       a batch behind its fence (apply.lua; apply_packed.lua for packed
//!               counters; apply_fence.lua, the fence check both start with;
//!               windows.lua, the window section of both); the exactly-once argument;
//!               the one reader of fences
//!   commit      Kafka offsets, only after the script succeeded
//!   dead_letter copies of bad messages, confirmed before their batch applies
//!   hot         hot-post detection and automatic promotion
//!   guard       refusals and reports for what operations do to the log and the store
//! domain/     what the stored data means
//!   fence       the pure apply / duplicate / straddle / gap decision
//!   routing     the stable hash, buckets and the Redis key layout
//!   packing     a generation's counters as string keys or as fields of small hashes
//!   windows     trending windows: which window a like counts in, and the exact
//!               merge of each slot group's leaders
//!   slots       Redis Cluster hash slots and slot groups
//!   versions    routing versions of posts and epochs of the default layout;
//!               registry: their Redis side (route_*.lua, registry_clock.lua);
//!               unfreeze: the record that keeps routes when routing is unfrozen
//!   generation  which key prefix is live: pointer, freeze flag, rebuild record
//!   layout      a prefix's keys on the store the settings name, opened once;
//!               adopt: what the keys of data without a record show
//!   placement   slot owners, Binomial(N, 1/M) buckets per primary, scans
//!   proto       the generated LikeEvent
//! infra/      what the service runs on
//!   config      the settings (StoreSettings, RunSettings, ServeLimits) and their checks
//!               (store, kafka, kafka_security, run, serve, dedupe, packing)
//!   store       the parsed Redis URL and its TLS files, connections to one server or a cluster
//!               (url, replicas, lua, server)
//!   retry       backoff and the retryable / fatal split of Redis errors
//!   metrics     every metric name, recorded per batch
//!   health      readiness state and its background checks
//!   http        the axum listener for /metrics, /healthz and /readyz;
//!               the read API's request limits
//!   security    TLS and SASL settings, certificate and login refusals named; secrets
//!               redacted; acl_check.lua, the ACL check every writing script starts with
//!               (kafka, redis_url, tls, secrets)
//! ops/        operations on stored counts, returning data
//!   rebuild     recount the topic into a new generation and cut over
//!   verify      recount in memory and compare
//!   gc          remove old generations after a grace period
//!   promote     routing changes by hand
//!   reset       fences of a replaced log, counted again from its start
//!   unfreeze    routing made final far ahead brought back, every route kept
//! read        the read path: the cached, coalescing Reader; trending: window reads
//! ```
//!
//! Layers only import downwards: `infra` imports nothing above it, `domain`
//! builds on `infra`, the `pipeline` on both, and `ops` and `read` on all
//! three.

pub mod domain;
pub mod infra;
pub mod ops;
pub mod pipeline;
pub mod read;
