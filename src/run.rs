//! Run: the pipeline of `tally run`, wiring the stages of the data path.
//!
//! consume → decode → aggregate → apply (Lua, fence) → commit.
//!
//! Invariants kept here:
//! * per partition, at most one batch is in flight and batches are applied in
//!   offset order; scripts of different partitions run concurrently, up to
//!   `--max-in-flight`;
//! * a batch covers a contiguous range that starts at the position the
//!   partition was read from, so the fence can tell a continuation from a gap;
//! * after a straddle or a gap the partition's buffer is dropped and reading
//!   restarts at the offset the fence names;
//! * a revoked partition's buffer is dropped; a batch already in flight may
//!   finish (the fence keeps it exact) but is never committed by this owner;
//! * everything is bounded: a partition whose batch is full and still waiting
//!   stops the consumer from fetching until Redis catches up.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::message::BorrowedMessage;
use rdkafka::producer::FutureProducer;
use rdkafka::topic_partition_list::Offset;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::aggregate::{Batch, ClosedBatch, Limits};
use crate::apply::{Applier, ApplyError, ConnectError, FenceReader};
use crate::commit::Committer;
use crate::config::{ConfigError, RunConfig};
use crate::consume::{self, LikeConsumer, Rebalanced, TallyContext, TopicError};
use crate::dead_letter::{DeadLetter, DeadLetters, Pending};
use crate::decode::decode;
use crate::fence::Decision;
use crate::metrics::{self, Stats};
use crate::routing::KeyLayout;

/// Why `tally run` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A flag is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Redis is unreachable or refused at start-up.
    #[error(transparent)]
    Redis(#[from] ConnectError),
    /// The brokers or a topic are unavailable at start-up.
    #[error(transparent)]
    Topic(#[from] TopicError),
    /// The Kafka client could not be created.
    #[error("cannot create the Kafka client: {0} (check -X settings)")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// A batch hit an error no retry fixes; nothing past it was committed.
    #[error("partition {partition}: {source}")]
    Apply {
        /// The partition.
        partition: i32,
        /// The error.
        source: ApplyError,
    },
    /// The consumer could not be moved back to the fence.
    #[error("partition {partition}: cannot seek to {offset:?}: {source}")]
    Seek {
        /// The partition.
        partition: i32,
        /// Where it had to go.
        offset: Offset,
        /// The client error.
        source: rdkafka::error::KafkaError,
    },
}

/// A partition this consumer owns.
struct Owned {
    /// Distinguishes this ownership from earlier ones of the same partition.
    epoch: u64,
    /// The offset the next accepted message must be at or after; the start
    /// of the next batch's range. `None` until the first message shows it.
    next: Option<i64>,
    /// Whether a fence is known to exist (its absence would mean Redis lost it).
    expect_fence: bool,
    batch: Batch,
    letters: Vec<Pending>,
    /// When Redis last confirmed the fence for this ownership.
    verified_at: Instant,
}

/// How often a caught-up partition probes its fence (see [`crate::fence`]).
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// The reply to one dispatched batch.
struct Done {
    partition: i32,
    epoch: u64,
    batch: ClosedBatch,
    increments: usize,
    took: Duration,
    result: Result<Decision, ApplyError>,
}

/// Runs the aggregator until `shutdown` is cancelled or a fatal error.
pub async fn run(
    config: RunConfig,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    config.validate()?;
    let keys = KeyLayout::new(&config.prefix);
    let applier =
        Applier::connect(&config.redis, keys.clone(), &config.group, &config.topic).await?;
    let fences =
        FenceReader::new(&config.redis, keys, &config.group, &config.topic).map_err(|source| {
            ConnectError::BadUrl {
                url: config.redis.clone(),
                source,
            }
        })?;
    let consumer = consume::create_consumer(
        &config.brokers,
        &config.group,
        &config.kafka_config,
        TallyContext::new(&config.topic, fences),
    )?;
    let partitions = consume::check_topic(&consumer, &config.brokers, &config.topic, "topic")?;
    let dead_letters = match &config.dead_letter_topic {
        Some(topic) => {
            consume::check_topic(&consumer, &config.brokers, topic, "dead-letter-topic")?;
            let producer: FutureProducer = consume::client_config(&config.brokers, &[])
                .set("enable.idempotence", "true")
                .set("linger.ms", "5")
                .create()?;
            Some(Arc::new(DeadLetters::new(producer, topic, &config.topic)))
        }
        None => None,
    };
    metrics::describe();
    consumer.subscribe(&[&config.topic])?;
    info!(
        topic = %config.topic,
        partitions,
        group = %config.group,
        buckets = config.buckets,
        prefix = %config.prefix,
        "Consuming."
    );
    let mut pipeline = Pipeline {
        limits: Limits {
            max_events: config.batch_max_events,
            max_keys: config.batch_max_keys,
        },
        flush_after: Duration::from_millis(config.flush_interval_ms),
        committer: Committer::new(&config.topic),
        config,
        consumer,
        applier,
        dead_letters,
        stats,
        owned: HashMap::new(),
        busy: HashSet::new(),
        in_flight: FuturesUnordered::new(),
        epochs: 0,
        blocked: false,
        abandon: CancellationToken::new(),
    };
    let result = pipeline.consume(&shutdown).await;
    pipeline.drain().await;
    result
}

struct Pipeline {
    config: RunConfig,
    limits: Limits,
    flush_after: Duration,
    consumer: LikeConsumer,
    applier: Applier,
    dead_letters: Option<Arc<DeadLetters>>,
    committer: Committer,
    stats: Arc<Stats>,
    owned: HashMap<i32, Owned>,
    /// Partitions with a batch in flight; outlives ownership, so a revoked
    /// partition's late batch still blocks the next one of a new ownership.
    busy: HashSet<i32>,
    in_flight: FuturesUnordered<JoinHandle<Done>>,
    epochs: u64,
    /// A full batch is waiting for its partition or for a free slot.
    blocked: bool,
    /// Cancelled when shutdown gives up waiting for in-flight batches.
    abandon: CancellationToken,
}

impl Pipeline {
    async fn consume(&mut self, shutdown: &CancellationToken) -> Result<(), RunError> {
        let tick_every = (self.flush_after / 2).max(Duration::from_millis(5));
        let mut tick = tokio::time::interval(tick_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.apply_rebalances();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                Some(joined) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    self.finish(joined)?;
                    self.dispatch_ready(false);
                }
                received = self.consumer.recv(), if !self.blocked => {
                    match received {
                        Ok(message) => {
                            let (partition, offset) = (message.partition(), message.offset());
                            let changes = self.consumer.context().take_changes();
                            if Self::apply_changes(&mut self.owned, &mut self.committer, &mut self.epochs, changes) {
                                self.blocked = false;
                            }
                            let accepted = Self::accept(&mut self.owned, &self.consumer, &message, &self.config, &self.stats, self.dead_letters.as_deref());
                            drop(message);
                            if accepted { self.after_accept(partition, offset); }
                        }
                        Err(error) => warn!(%error, "Kafka consumer error."),
                    }
                }
                _ = tick.tick() => self.dispatch_ready(false),
            }
        }
    }

    /// Applies ownership changes queued by the rebalance callback.
    fn apply_rebalances(&mut self) {
        let changes = self.consumer.context().take_changes();
        if Self::apply_changes(
            &mut self.owned,
            &mut self.committer,
            &mut self.epochs,
            changes,
        ) {
            self.blocked = false;
        }
    }

    /// Applies ownership changes; `true` if there were any. Borrows only what
    /// it changes, so it can run while a received message still borrows the
    /// consumer: the callback that queued the changes ran inside that very
    /// `recv()`, and the message may belong to a partition assigned by it.
    fn apply_changes(
        owned: &mut HashMap<i32, Owned>,
        committer: &mut Committer,
        epochs: &mut u64,
        changes: Vec<Rebalanced>,
    ) -> bool {
        let any = !changes.is_empty();
        for change in changes {
            match change {
                Rebalanced::Assigned(assignments) => {
                    for a in assignments {
                        *epochs += 1;
                        owned.insert(
                            a.partition,
                            Owned {
                                epoch: *epochs,
                                next: a.fence.map(|f| f + 1),
                                expect_fence: a.fence.is_some(),
                                batch: Batch::new(),
                                letters: Vec::new(),
                                verified_at: Instant::now(),
                            },
                        );
                    }
                }
                Rebalanced::Revoked(partitions) => {
                    for p in partitions {
                        owned.remove(&p);
                        committer.forget(p);
                    }
                }
                Rebalanced::Lost => {
                    for p in owned.keys().copied().collect::<Vec<_>>() {
                        committer.forget(p);
                    }
                    owned.clear();
                }
            }
            metrics::assigned(owned.len());
        }
        any
    }

    /// Adds one message to its partition's batch; `false` when it is not ours
    /// or stale.
    fn accept(
        owned: &mut HashMap<i32, Owned>,
        consumer: &LikeConsumer,
        message: &BorrowedMessage<'_>,
        config: &RunConfig,
        stats: &Stats,
        dead_letters: Option<&DeadLetters>,
    ) -> bool {
        // Callbacks run inside recv(): ownership may have changed; the caller
        // applies the queued changes before the next message.
        let _ = consumer;
        let partition = message.partition();
        let offset = message.offset();
        let Some(state) = owned.get_mut(&partition) else {
            return false;
        };
        if state.next.is_some_and(|next| offset < next) {
            return false;
        }
        let start = state.next.unwrap_or(offset);
        match decode(message.payload()) {
            Ok(like) => state.batch.add(start, offset, like, config.buckets),
            Err(reason) => {
                warn!(partition, offset, %reason, "Bad message skipped.");
                metrics::bad_message(stats, reason);
                state.batch.add_bad(start, offset);
                if let Some(dead_letters) = dead_letters {
                    state.letters.push(dead_letters.send(DeadLetter {
                        key: message.key().map(<[u8]>::to_vec),
                        value: message.payload().map(<[u8]>::to_vec),
                        reason,
                        partition,
                        offset,
                    }));
                }
            }
        }
        state.next = Some(offset + 1);
        true
    }

    fn after_accept(&mut self, partition: i32, _offset: i64) {
        // Ownership changes queued during recv() take effect before anything else.
        self.apply_rebalances();
        let full = self
            .owned
            .get(&partition)
            .is_some_and(|s| s.batch.is_full(&self.limits));
        if full {
            self.dispatch(partition);
            self.blocked = self
                .owned
                .get(&partition)
                .is_some_and(|s| s.batch.is_full(&self.limits));
        }
    }

    /// Dispatches every batch that is full or old enough (or any, when
    /// flushing), and probes the fence of partitions that are caught up.
    fn dispatch_ready(&mut self, flush_all: bool) {
        let ready: Vec<i32> = self
            .owned
            .iter()
            .filter(|(p, s)| {
                !self.busy.contains(p)
                    && if s.batch.is_empty() {
                        !flush_all
                            && s.next.is_some_and(|next| next > 0)
                            && s.verified_at.elapsed() >= PROBE_EVERY
                    } else {
                        flush_all
                            || s.batch.is_full(&self.limits)
                            || s.batch.age() >= self.flush_after
                    }
            })
            .map(|(&p, _)| p)
            .collect();
        for partition in ready {
            self.dispatch(partition);
        }
        self.blocked = self.owned.values().any(|s| s.batch.is_full(&self.limits));
    }

    /// Sends a partition's batch (or, when it has none, a probe of its fence)
    /// to Redis if the partition is idle and a slot is free.
    fn dispatch(&mut self, partition: i32) {
        if self.busy.contains(&partition) || self.busy.len() >= self.config.max_in_flight {
            return;
        }
        let Some(state) = self.owned.get_mut(&partition) else {
            return;
        };
        let batch = match (state.batch.take(), state.next) {
            (Some(batch), _) => batch,
            (None, Some(next)) if next > 0 => ClosedBatch {
                start: next,
                last: next - 1,
                messages: 0,
                bad: 0,
                deltas: Vec::new(),
            },
            (None, _) => return,
        };
        let letters = std::mem::take(&mut state.letters);
        let (epoch, expect_fence) = (state.epoch, state.expect_fence);
        let applier = self.applier.clone();
        let dead_letters = self.dead_letters.clone();
        let abandon = self.abandon.clone();
        self.busy.insert(partition);
        self.in_flight.push(tokio::spawn(async move {
            let began = Instant::now();
            let confirmed = match dead_letters {
                Some(dl) if !letters.is_empty() => dl.confirm(letters, &abandon).await,
                _ => true,
            };
            let prepared = applier.prepare(partition, &batch, expect_fence);
            let result = if confirmed {
                applier.apply(&prepared, &abandon).await
            } else {
                Err(ApplyError::Cancelled)
            };
            Done {
                partition,
                epoch,
                increments: prepared.increments,
                batch,
                took: began.elapsed(),
                result,
            }
        }));
    }

    /// Handles the reply to a batch.
    fn finish(&mut self, joined: Result<Done, tokio::task::JoinError>) -> Result<(), RunError> {
        let done = match joined {
            Ok(done) => done,
            Err(error) => {
                // A panicked apply task: nothing was committed for it.
                warn!(%error, "Apply task failed.");
                return Ok(());
            }
        };
        self.busy.remove(&done.partition);
        let decision = match done.result {
            Ok(decision) => decision,
            Err(ApplyError::Cancelled) => return Ok(()),
            Err(source) => {
                return Err(RunError::Apply {
                    partition: done.partition,
                    source,
                });
            }
        };
        let probe = done.batch.start > done.batch.last;
        if !probe || matches!(decision, Decision::Gap { .. }) {
            metrics::batch_done(
                &self.stats,
                decision,
                done.batch.messages,
                done.batch.bad,
                done.increments,
                done.took,
            );
        }
        let Some(state) = self.owned.get_mut(&done.partition) else {
            return Ok(());
        };
        if state.epoch != done.epoch {
            return Ok(());
        }
        state.verified_at = Instant::now();
        let partition = done.partition;
        match decision {
            Decision::Apply | Decision::Duplicate => {
                state.expect_fence = true;
                if !probe {
                    self.committer
                        .applied(&self.consumer, partition, done.batch.last);
                }
                Ok(())
            }
            Decision::Straddle { resume }
            | Decision::Gap {
                resume: Some(resume),
            } => {
                warn!(
                    partition,
                    start = done.batch.start,
                    last = done.batch.last,
                    resume,
                    ?decision,
                    "Batch does not continue the fence; re-reading from the fence."
                );
                self.resync(partition, Some(resume))
            }
            Decision::Gap { resume: None } => {
                warn!(
                    partition,
                    "Fence is gone from Redis; replaying the partition from the start of the log."
                );
                self.resync(partition, None)
            }
        }
    }

    /// Drops the partition's buffer and moves the consumer to `resume`
    /// (`None`: the start of the log).
    fn resync(&mut self, partition: i32, resume: Option<i64>) -> Result<(), RunError> {
        metrics::resynced();
        let Some(state) = self.owned.get_mut(&partition) else {
            return Ok(());
        };
        state.batch.clear();
        state.letters.clear();
        state.next = resume;
        state.expect_fence = resume.is_some();
        let offset = resume.map_or(Offset::Beginning, Offset::Offset);
        let mut last_error = None;
        for attempt in 0..5u64 {
            match self.consumer.seek(
                &self.config.topic,
                partition,
                offset,
                Duration::from_secs(5),
            ) {
                Ok(()) => return Ok(()),
                Err(error) => {
                    warn!(partition, attempt, %error, "Seek failed; retrying.");
                    last_error = Some(error);
                    std::thread::sleep(Duration::from_millis(100 * (attempt + 1)));
                }
            }
        }
        Err(RunError::Seek {
            partition,
            offset,
            source: last_error.expect("at least one attempt"),
        })
    }

    /// Shutdown: stop fetching, flush what is buffered, wait (bounded) for the
    /// scripts in flight, commit what landed.
    async fn drain(&mut self) {
        let deadline =
            tokio::time::Instant::now() + Duration::from_secs(self.config.shutdown_timeout_secs);
        self.apply_rebalances();
        self.dispatch_ready(true);
        while !self.in_flight.is_empty() {
            tokio::select! {
                Some(joined) = self.in_flight.next() => {
                    if let Err(error) = self.finish(joined) {
                        warn!(%error, "Batch failed during shutdown; it will be replayed by the next owner.");
                    }
                    self.dispatch_ready(true);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    warn!(batches = self.in_flight.len(), "Shutdown timeout: abandoning batches in flight (they are not committed and will be replayed).");
                    self.abandon.cancel();
                    while let Some(joined) = self.in_flight.next().await {
                        let _ = self.finish(joined);
                    }
                }
            }
        }
        self.committer.commit_all(&self.consumer);
        info!("Stopped.");
    }
}
