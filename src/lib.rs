//! # tally
//!
//! Counts likes at internet scale: consumes like/unlike events from Kafka,
//! sums them per (post, bucket) and applies each batch to Redis exactly once,
//! behind a per-partition fence checked and advanced in the same Lua script.
//!
//! # Layout
//!
//! The data path, one module per stage:
//!
//! * [`consume`]: the Kafka group consumer; every assignment starts at the
//!   partition's fence in Redis.
//! * [`decode`]: message bytes to a validated like, or a bad-message reason.
//! * [`aggregate`]: per-partition batches of net deltas per (post, bucket).
//! * [`apply`] (with `apply.lua`): runs a batch behind its fence; states the
//!   exactly-once argument.
//! * [`commit`]: Kafka offset commits, only after the script succeeded.
//!
//! Around it:
//!
//! * [`fence`]: the pure apply / duplicate / straddle / gap decision.
//! * [`routing`]: the stable hash, buckets and the Redis key layout.
//! * [`versions`]: per-post routing versions (promotion, demotion) and the
//!   order of operations that keeps writers and readers consistent.
//! * [`hot`]: hot-post detection (a heavy-hitters sketch, shared per second).
//! * [`generation`]: which key prefix is live (the pointer, the freeze flag,
//!   the rebuild record); [`rebuild`]: recounting the topic into a new
//!   generation and the cut-over to it; [`verify`]: recounting in memory and
//!   comparing; [`gc`]: removing old generations after a grace period.
//! * [`read`] and [`serve`]: the read path (a cached, coalescing `Reader`)
//!   and its HTTP front; [`promote`]: routing changes by hand.
//! * [`slots`]: Redis Cluster hash slots and the slot groups scripts are split by.
//! * [`placement`]: who owns each slot, and Binomial(N, 1/M) buckets per primary.
//! * [`store`]: connections to one Redis server or a cluster.
//! * [`dead_letter`]: copies of bad messages, confirmed before their batch applies.
//! * [`run`]: the pipeline loop wiring the stages, with shutdown and backpressure.
//! * [`config`], [`metrics`], [`retry`]: settings (flags, variables and a
//!   file), metric names, backoff and error classification.
//! * [`security`]: TLS and SASL for Kafka, AUTH and TLS for Redis; secrets redacted.
//! * [`health`], [`http`]: readiness state and its checks; the listener
//!   serving `/metrics`, `/healthz` and `/readyz`.
//! * [`proto`]: the generated `LikeEvent` type.
//! * [`generate`], [`demo`]: synthetic traffic and the one-command local demo.
//! * [`inspect`]: where a post's bucket keys live, per slot and primary.
//! * [`plan`]: `tally plan`, buckets, primaries, partitions and consumers for a peak.
//! * [`local`]: private redis-server and Tansu processes for the demo and the benchmark.
//! * [`produce`]: `tally produce`, generated traffic into a topic, with its exact truth.
//! * [`bench`]: `tally bench`, tally against a raw consumer and a naive one, same events.

pub mod aggregate;
pub mod apply;
pub mod bench;
pub mod commit;
pub mod config;
pub mod consume;
pub mod dead_letter;
pub mod decode;
pub mod demo;
pub mod fence;
pub mod gc;
pub mod generate;
pub mod generation;
pub mod health;
pub mod hot;
pub mod http;
pub mod inspect;
pub mod local;
pub mod metrics;
pub mod placement;
pub mod plan;
pub mod produce;
pub mod promote;
pub mod proto;
pub mod read;
pub mod rebuild;
pub mod retry;
pub mod routing;
pub mod run;
pub mod security;
pub mod serve;
pub mod slots;
pub mod store;
pub mod verify;
pub mod versions;
