//! Run: the pipeline of `tally run`, wiring the stages of the data path.
//!
//! consume → decode → aggregate → apply (Lua, fence) → commit.
//!
//! Invariants kept here:
//! * per partition, at most one batch is in flight and batches are applied in
//!   offset order; the scripts of one batch (one per slot group) run
//!   concurrently, and so do batches of different partitions, up to
//!   `--max-in-flight` batches;
//! * an event is added to a batch only if its slot group's fence is below it,
//!   so groups left ahead by a crash between scripts are not given it twice;
//! * a batch covers a contiguous range that starts at the position the
//!   partition was read from, so the fence can tell a continuation from a gap;
//! * offsets a read_committed consumer passes without a message (transaction
//!   markers, aborted transactions) belong to the next batch's range, or,
//!   when nothing follows them yet, to an empty range of their own, so fence
//!   and commit reach the end of a log whose last record is a marker;
//! * after any reply that moves a group's fence elsewhere than the batch's end
//!   (straddle, gap, a duplicate ahead), the partition's buffer is dropped and
//!   reading restarts at the lowest fence;
//! * a revoked partition's buffer is dropped; a batch already in flight may
//!   finish (the fence keeps it exact) but is never committed by this owner;
//! * a partition whose fence lies beyond its log's end (found at assignment,
//!   or when the consumer is sent below the fence) is paused and takes,
//!   applies and commits nothing for the rest of its ownership; the others
//!   go on;
//! * each partition's messages are taken off the polling thread by a reader
//!   of its own (see `reader`), which alone moves the consumer in that
//!   partition; this loop keeps the consumer polled for rebalances and
//!   errors, and takes the messages only of a partition whose queue could
//!   not be split;
//! * everything is bounded: a partition whose batch is full and still waiting
//!   stops its reader (or, read here, the consumer) from taking more until
//!   Redis catches up;
//! * (dedupe) a partition re-reading the log below its fences to rebuild its
//!   window holds back only itself: its records fill the window as they
//!   arrive, are never routed or batched, and every other partition is
//!   decided and applied meanwhile (see `intake`); a partition coming back
//!   within minutes takes up the window it left with and re-reads only what
//!   was applied since (see `kept`);
//! * (live mode) no batch is dispatched while the freeze flag names the next
//!   generation, and when the generation pointer moves, every batch in flight
//!   finishes before the keys change; every owned partition then restarts at
//!   its fences in the new generation (see [`crate::ops::rebuild`] for the cut-over).
//!
//! Parts: `intake` (ownership changes, and messages entering a partition's
//! batch), `kept` (the dedupe windows of partitions given up), `batches` (when a batch is sent, and what its reply does), `reader` (a partition's messages taken off the polling thread),
//! `scripts` (a closed batch planned and sent as one script per slot group),
//! `follow` (switching generations), `start` (the checks before the consumer
//! subscribes); this file runs the loop.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use rdkafka::Message;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaResult;
use rdkafka::message::BorrowedMessage;
use rdkafka::topic_partition_list::Offset;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::domain::generation::{self, GenerationWatch};
use crate::domain::layout::{self, LayoutError};
use crate::domain::versions::{Readiness, RouteTable, RouteWatch, Routes, wall_ms};
use crate::infra::config::{ConfigError, RunSettings};
use crate::infra::retry::{RedisFailure, classify_redis};
use crate::infra::security::KafkaAcl;
use crate::infra::store::ConnectError;
use crate::infra::{metrics, tasks};
use crate::pipeline::aggregate::Limits;
use crate::pipeline::apply::{Applier, ApplyError};
use crate::pipeline::commit::Committer;
use crate::pipeline::consume::{LikeConsumer, TopicError};
use crate::pipeline::dead_letter::DeadLetters;
use crate::pipeline::decode::{BadReason, Decoder};
use crate::pipeline::guard::{self, GuardError};
use crate::pipeline::hot::{Detector, Policy};

mod batches;
mod follow;
mod intake;
mod kept;
mod reader;
mod scripts;
mod start;

use intake::{IdleOwnership, Intake, Owning};
use kept::KeptWindows;
use reader::{Event, Reading, View};
use scripts::Done;
use start::start;
pub use start::writer_layout;

/// Why `tally run` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A flag is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Redis is unreachable or refused at start-up.
    #[error(transparent)]
    Redis(#[from] ConnectError),
    /// The settings differ from the prefix's layout record, or it is unusable.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The brokers or a topic are unavailable at start-up.
    #[error(transparent)]
    Topic(#[from] TopicError),
    /// The Kafka client could not be created.
    #[error("cannot create the Kafka client: {0} (check -X settings)")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// librdkafka stopped the consumer for good: it would never fetch again.
    #[error(
        "the Kafka consumer stopped for good: {reason}{}; exiting so that the supervisor restarts tally (the fences make a restart exact)",
        fatal_hint(*.code)
    )]
    KafkaFatal {
        /// librdkafka's code for the cause.
        code: rdkafka::types::RDKafkaErrorCode,
        /// librdkafka's description.
        reason: String,
    },
    /// An apply task panicked.
    #[error(
        "an apply task failed ({0}); exiting so that the supervisor restarts tally (the fences make a restart exact)"
    )]
    Crashed(String),
    /// An operation changed the log or the store under the fences.
    #[error(transparent)]
    Guard(#[from] GuardError),
    /// The generation pointer names an older generation than was current.
    #[error(transparent)]
    Generation(#[from] generation::Backwards),
    /// A batch hit an error no retry fixes; nothing past it was committed.
    #[error("partition {partition}: {source}")]
    Apply {
        /// The partition.
        partition: i32,
        /// The error.
        source: ApplyError,
    },
}

impl RunError {
    /// Whether the store stopped answering (a reset connection, a timeout,
    /// LOADING after a restart), as against refusing or holding something
    /// wrong: what a start tries again.
    pub fn lost_store(&self) -> bool {
        let transient = |e: &redis::RedisError| classify_redis(e) == RedisFailure::Transient;
        match self {
            RunError::Redis(ConnectError { source, .. }) => transient(source),
            RunError::Layout(LayoutError::Redis(source)) => transient(source),
            RunError::Guard(GuardError::Unreachable { .. }) => true,
            _ => false,
        }
    }
}

/// What to do about a fatal consumer error that a setting causes.
fn fatal_hint(code: rdkafka::types::RDKafkaErrorCode) -> &'static str {
    use rdkafka::types::RDKafkaErrorCode as Code;
    match code {
        Code::FencedInstanceId => {
            " (another consumer joined the group with this --group-instance-id and took its partitions; give each replica a name of its own)"
        }
        Code::UnreleasedInstanceId => {
            " (a member with this --group-instance-id is still in the group: another replica uses the name, or this one stopped without leaving and the broker keeps its place until group.consumer.session.timeout.ms passes)"
        }
        Code::UnsupportedVersion | Code::UnsupportedFeature => {
            " (--group-protocol consumer needs a broker with KIP-848: Apache Kafka 4.0 or later)"
        }
        _ => "",
    }
}

/// How a pipeline names its consumer group and its keys.
#[derive(Debug, Clone)]
pub struct Mode {
    /// The Kafka consumer group id. Fences are always kept under
    /// `--group`; a rebuild reads with a group of its own but writes the live
    /// group's fences in its generation.
    pub kafka_group: String,
    /// Write this generation for the whole run; `None` follows the
    /// generation pointer (and the freeze flag), as `tally run` does.
    pub fixed_generation: Option<u64>,
    /// The ACL that lets a principal use `kafka_group`, named when the
    /// brokers deny it.
    pub group_acl: KafkaAcl,
}

impl Mode {
    /// `tally run`: the group is `--group`, the keys follow the pointer.
    pub fn live(settings: &RunSettings) -> Self {
        Self {
            kafka_group: settings.kafka.group.clone(),
            fixed_generation: None,
            group_acl: KafkaAcl::on("Read", "group", &settings.kafka.group),
        }
    }
}

/// A live pipeline's generation: the one it writes, and the freeze it honours.
struct Following {
    watch: GenerationWatch,
    current: u64,
    /// Since when new batches are held for a freeze.
    frozen_since: Option<Instant>,
    /// An older generation the pointer named, once reported.
    refused_back: Option<u64>,
    /// This pipeline's generation is recorded as the pointer's `highest`.
    highest_recorded: bool,
}

impl Following {
    /// Whether new batches are held: the freeze was seen on a tick, or the
    /// watch has read it since (ticks wait while messages keep arriving).
    fn frozen(&self) -> bool {
        self.frozen_since.is_some() || self.watch.current().frozen_for.is_some()
    }
}

/// How often a caught-up partition probes its fences, and how often a slot
/// group without events gets an empty script to keep its fence recent.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Messages taken from what librdkafka already holds, one after another,
/// before the main loop looks at its other work: the loop's polling of its
/// timers and tasks is paid once per run of messages rather than per message.
pub(super) const DRAIN_AT_MOST: usize = 512;

/// How long the run waits for a partition's watermarks when a fetched offset
/// lies below its fence.
const LOG_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs the aggregator until `shutdown` is cancelled or a fatal error.
pub async fn run(settings: RunSettings, shutdown: CancellationToken) -> Result<(), RunError> {
    let mode = Mode::live(&settings);
    run_with(settings, mode, shutdown).await
}

/// Runs the pipeline in `mode` until `shutdown` is cancelled or a fatal error.
///
/// Start-up, in order: check the settings, open the store, find the
/// generation to write, read the routing registry, create the consumer and
/// check the topics and the group (that they exist and the brokers let this
/// principal use them); only then subscribe.
pub async fn run_with(
    settings: RunSettings,
    mode: Mode,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    if let Some(problem) = settings.problems().into_iter().next() {
        return Err(problem.into());
    }
    let opened = layout::open(&settings.store).await?;
    let started = start(&opened, &settings, &mode, &shutdown).await?;
    let kafka = &settings.kafka;
    guard::report_servers(&started.servers);
    metrics::describe(&BadReason::ALL.map(BadReason::as_str));
    // Checked at start above; a policy set while running is reported.
    drop(guard::spawn_compaction_watch(
        kafka.clone(),
        shutdown.child_token(),
    ));
    drop(guard::spawn_eviction_watch(
        opened.target().clone(),
        !started.record.windows.is_empty(),
        shutdown.child_token(),
    ));
    if mode.fixed_generation.is_none() {
        drop(guard::spawn_dedupe_rule_watch(
            opened.store.clone(),
            settings.store.prefix(),
            settings.dedupe,
            shutdown.child_token(),
        ));
    }
    started.consumer.subscribe(&[&kafka.topic])?;
    let (_, watch, _) = &started.routing;
    info!(
        topic = %kafka.topic,
        partitions = started.partitions,
        group = %mode.kafka_group,
        group_protocol = %kafka.group_protocol,
        fence_group = %kafka.group,
        buckets = watch.current().defaults().latest().buckets,
        prefix = %started.applier.keys().prefix(),
        layout = %started.applier.keys().packing(),
        promote_above = settings.hot.promote_above,
        routed_posts = watch.current().routed_posts(),
        "Consuming."
    );
    let mut pipeline = Pipeline::new(
        settings,
        started.consumer,
        started.applier,
        started.routing,
        started.following,
        started.dead_letters,
    );
    let result = pipeline.consume(&shutdown).await;
    pipeline.drain().await;
    result
}

/// The routing metadata `applier` writes under, and the writers' view of it,
/// kept fresh until the token returned (a child of `shutdown`) is cancelled.
async fn watch_routes(
    applier: &Applier,
    buckets: u32,
    settings: &RunSettings,
    shutdown: &CancellationToken,
) -> Result<(Routes, RouteWatch, CancellationToken), redis::RedisError> {
    let stop = shutdown.child_token();
    let routes = Routes::new(applier.store().clone(), applier.keys().clone(), buckets)
        .with_wait(settings.hot.registry_wait);
    let watch = RouteWatch::start(routes.clone(), settings.hot.route_refresh, stop.clone()).await?;
    Ok((routes, watch, stop))
}

struct Pipeline {
    settings: RunSettings,
    /// What the partitions' readers share.
    reading: Arc<Reading>,
    /// What the readers tell the loop.
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    /// Each partition's last reader, kept until the next one starts.
    readers: HashMap<i32, JoinHandle<()>>,
    limits: Limits,
    flush_after: Duration,
    consumer: Arc<LikeConsumer>,
    applier: Applier,
    routes: Routes,
    watch: RouteWatch,
    /// Stops `watch`'s refresh task when the generation changes.
    route_stop: CancellationToken,
    /// `None` when the keys are fixed for the run (a rebuild).
    following: Option<Following>,
    /// The registry view events are routed with; replaced by a newer one on
    /// every tick, and before any event it is too old for.
    table: Arc<RouteTable>,
    detector: Option<Detector>,
    /// The task sharing the last second's hot-post counts.
    sharing: Option<JoinHandle<()>>,
    dead_letters: Option<Arc<DeadLetters>>,
    /// Decodes values, checking framed ones against `--schema-ids`.
    decoder: Decoder,
    committer: Committer,
    owned: Owning,
    /// Partitions with a batch in flight; outlives ownership, so a revoked
    /// partition's late batch still blocks the next one of a new ownership.
    busy: HashSet<i32>,
    in_flight: FuturesUnordered<JoinHandle<Done>>,
    epochs: u64,
    /// Dedupe windows of partitions given up, in case they come back.
    kept: KeptWindows,
    /// A full batch is waiting for its partition or for a free slot.
    blocked: bool,
    /// Cancelled when shutdown gives up waiting for in-flight batches.
    abandon: CancellationToken,
    idle: IdleOwnership,
}

impl Pipeline {
    fn new(
        settings: RunSettings,
        consumer: Arc<LikeConsumer>,
        applier: Applier,
        (routes, watch, route_stop): (Routes, RouteWatch, CancellationToken),
        following: Option<Following>,
        dead_letters: Option<Arc<DeadLetters>>,
    ) -> Self {
        let detector = (settings.hot.promote_above > 0).then(|| {
            Detector::new(Policy {
                promote_above: settings.hot.promote_above,
                hot_buckets: settings.hot.hot_buckets,
            })
        });
        let limits = Limits {
            max_events: settings.batching.max_events,
            max_keys: settings.batching.max_keys,
        };
        let decoder = Decoder::new(&settings.schema_ids);
        let (events_to, events) = tokio::sync::mpsc::unbounded_channel();
        let reading = Arc::new(Reading {
            topic: settings.kafka.topic.clone(),
            consumer: Arc::clone(&consumer),
            decoder: decoder.clone(),
            dead_letters: dead_letters.clone(),
            limits,
            view: std::sync::RwLock::new(Arc::new(View {
                groups: applier.keys().groups().clone(),
                windows: applier.keys().windows().clone(),
                watch: watch.clone(),
            })),
            events: events_to,
        });
        Pipeline {
            reading,
            events,
            readers: HashMap::new(),
            limits,
            flush_after: settings.batching.flush_interval,
            committer: Committer::new(&settings.kafka.topic),
            decoder,
            settings,
            consumer,
            applier,
            routes,
            table: watch.current(),
            watch,
            route_stop,
            following,
            detector,
            sharing: None,
            dead_letters,
            owned: HashMap::new(),
            busy: HashSet::new(),
            in_flight: FuturesUnordered::new(),
            epochs: 0,
            kept: KeptWindows::default(),
            blocked: false,
            abandon: CancellationToken::new(),
            idle: IdleOwnership::default(),
        }
    }

    async fn consume(&mut self, shutdown: &CancellationToken) -> Result<(), RunError> {
        // A batch is sent on the first tick after it is old enough: at most
        // a quarter of the flush interval late.
        let tick_every = (self.flush_after / 4).max(Duration::from_millis(5));
        let mut tick = tokio::time::interval(tick_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Messages borrow the consumer, not the pipeline they are added to.
        let consumer = Arc::clone(&self.consumer);
        loop {
            self.apply_rebalances();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                Some(joined) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    self.finish(joined)?;
                    self.dispatch_ready(false);
                }
                // Before the consumer: under a steady stream of messages the
                // consumer is always ready, and a tick polled after it would
                // wait for a lull, leaving batches open past their age.
                _ = tick.tick() => {
                    self.stop_if_fatal()?;
                    self.follow_generation(shutdown).await?;
                    self.table = self.watch.current();
                    self.detect();
                    self.retry_seeks();
                    self.dispatch_ready(false);
                    self.report_idle();
                    self.report_lag_seconds();
                    if self.settings.dedupe.on() {
                        intake::report_windows(&self.owned);
                        self.report_rereads();
                        self.kept.trim(self.owned.len(), Instant::now());
                    }
                }
                Some(event) = self.events.recv() => self.heard(event)?,
                received = consumer.recv(), if !self.blocked => {
                    let mut read = usize::from(received.is_ok());
                    self.received(received).await?;
                    // What librdkafka already holds is taken before the other
                    // arms are polled again, up to a bound that keeps the
                    // flush ticks and finished batches timely.
                    for _ in 1..DRAIN_AT_MOST {
                        if self.blocked {
                            break;
                        }
                        match consumer.recv().now_or_never() {
                            Some(received) => {
                                read += usize::from(received.is_ok());
                                self.received(received).await?;
                            }
                            None => break,
                        }
                    }
                    metrics::messages_read(read);
                }
            }
        }
    }

    /// Takes one message, or one consumer error, from the consumer.
    async fn received(
        &mut self,
        received: KafkaResult<BorrowedMessage<'_>>,
    ) -> Result<(), RunError> {
        let message = match received {
            Ok(message) => message,
            Err(error) => {
                self.stop_if_fatal()?;
                self.stop_if_denied(&error)?;
                warn!(%error, "Kafka consumer error.");
                return Ok(());
            }
        };
        let partition = message.partition();
        let timestamp = message.timestamp().to_millis().unwrap_or(0);
        let offset = message.offset();
        // Ownership changes queued while polling take effect before the
        // message is looked at.
        self.apply_rebalances();
        // A partition with a reader of its own takes nothing from here:
        // what still reaches this queue was fetched for an earlier ownership.
        let taken_here = |owned: &Owning| {
            owned
                .get(&partition)
                .map(|slot| slot.lock())
                .filter(|state| !state.read_apart)
                .is_some_and(|state| intake::decides(&state, offset))
        };
        // Only a message that will be decided is routed: a record re-read
        // below the fences to rebuild a dedupe window, or one dropped, never
        // makes the loop wait for the routing registry.
        if taken_here(&self.owned)
            && self.table.readiness_of(partition, offset, timestamp) != Readiness::Ready
        {
            let cluster = self.applier.keys().groups().is_cluster();
            self.table = self
                .watch
                .route_for(partition, offset, timestamp, cluster)
                .await;
            self.apply_rebalances();
        }
        let intake = match self.owned.get(&partition) {
            Some(slot) => {
                let mut state = slot.lock();
                match state.read_apart {
                    true => Intake::Dropped,
                    false => {
                        let record = intake::Record::of(&message);
                        let read = intake::read(&state, &self.decoder, &record);
                        intake::accept(
                            &mut state,
                            self.applier.keys().groups(),
                            self.applier.keys().windows(),
                            &record,
                            read,
                            &self.table,
                            self.dead_letters.as_deref(),
                        )
                    }
                }
            }
            None => Intake::Dropped,
        };
        drop(message);
        match intake {
            Intake::Taken => self.after_accept(partition),
            Intake::BelowFence => self.check_log(partition),
            Intake::Dropped => {}
        }
        Ok(())
    }

    /// What a reader tells the loop.
    fn heard(&mut self, event: Event) -> Result<(), RunError> {
        self.apply_rebalances();
        match event {
            Event::Full(partition) => self.after_accept(partition),
            Event::BelowFence(partition) => self.check_log(partition),
            Event::Failed(error) => {
                self.stop_if_fatal()?;
                self.stop_if_denied(&error)?;
                warn!(%error, "Kafka consumer error.");
            }
        }
        Ok(())
    }

    /// Starts a reader for each partition assigned whose queue was split.
    fn start_readers(&mut self, assigned: Vec<i32>) {
        for partition in assigned {
            let Some(queue) = self.consumer.context().take_queue(partition) else {
                continue;
            };
            let Some(slot) = self.owned.get(&partition).cloned() else {
                continue;
            };
            let previous = self.readers.remove(&partition);
            let reader = reader::spawn(partition, slot, queue, Arc::clone(&self.reading), previous);
            self.readers.insert(partition, reader);
        }
    }

    /// Stops every reader and waits for them: nothing enters a batch after.
    async fn stop_readers(&mut self) {
        for slot in self.owned.values() {
            slot.end();
        }
        for (_, reader) in self.readers.drain() {
            let _ = reader.await;
        }
        self.consumer.context().drop_queues();
    }

    /// Sets the re-read gauges, and ends the re-reads whose consumer passed
    /// the fences without a record (see [`intake::report_rereads`]).
    fn report_rereads(&mut self) {
        let positions = if intake::rereading(&self.owned) {
            self.positions()
        } else {
            HashMap::new()
        };
        intake::report_rereads(&self.owned, &positions);
    }

    /// Sets each owned partition's lag in seconds.
    fn report_lag_seconds(&self) {
        let now = wall_ms();
        for (&partition, slot) in &self.owned {
            metrics::consumer_lag_seconds(partition, slot.lock().lag_seconds(now));
        }
    }

    /// Says so when the consumer has owned no partition for long.
    fn report_idle(&mut self) {
        if let Some(idle) = self.idle.observe(!self.owned.is_empty(), Instant::now()) {
            warn!(
                idle_secs = idle.as_secs(),
                group = %self.settings.kafka.group,
                "No partition assigned for {} s: either the group has more members than the topic has \
                 partitions, or its coordinator has not completed a rebalance (-X debug=cgrp shows \
                 librdkafka's side of it).",
                idle.as_secs()
            );
        }
    }

    /// Ends the run when the brokers deny the consumer its topic or group (an
    /// ACL removed, or `Describe` granted without `Read`): nothing would be
    /// fetched or committed until an operator grants it.
    fn stop_if_denied(&self, error: &rdkafka::error::KafkaError) -> Result<(), RunError> {
        match self.consumer.context().denied(error) {
            Some(acl) => Err(RunError::Topic(TopicError::Denied {
                brokers: self.settings.kafka.brokers.clone(),
                acl: Box::new(acl),
                reason: error.to_string(),
            })),
            None => Ok(()),
        }
    }

    /// Ends the run when librdkafka has stopped the consumer for good (a
    /// fenced static member, a protocol the broker lacks): the process would
    /// otherwise stay up, owning nothing and fetching nothing.
    fn stop_if_fatal(&self) -> Result<(), RunError> {
        match self.consumer.client().fatal_error() {
            Some((code, reason)) => Err(RunError::KafkaFatal { code, reason }),
            None => Ok(()),
        }
    }

    /// Checks a partition whose consumer fetched below the fence against its
    /// log, at most once per [`PROBE_EVERY`]: a log that ends before the
    /// fence stops the partition (paused, nothing taken or committed until it
    /// is assigned again); the others go on.
    fn check_log(&mut self, partition: i32) {
        let Some(slot) = self.owned.get(&partition).cloned() else {
            return;
        };
        let mut guard = slot.lock();
        let state = &mut *guard;
        if state
            .log_checked_at
            .is_some_and(|at| at.elapsed() < PROBE_EVERY)
        {
            return;
        }
        state.log_checked_at = Some(Instant::now());
        let Some(next) = state.next else { return };
        let topic = &self.settings.kafka.topic;
        // One bounded query, only ever after librdkafka reset a position.
        let marks = tokio::task::block_in_place(|| {
            guard::watermarks(self.consumer.as_ref(), topic, partition, LOG_TIMEOUT)
        });
        let Some((low, high)) = marks else { return };
        let guard::LogFit::Ahead { high } = guard::fit(next, low, high) else {
            debug!(
                partition,
                next,
                low,
                high,
                "Dropped a message below the partition's position; its log holds the fence."
            );
            return;
        };
        let fence = state
            .known
            .as_ref()
            .map_or(next - 1, |(_, tracker)| tracker.resume_at() - 1);
        state.fence_ahead = true;
        state.reread = None;
        state.batch.clear();
        state.letters.clear();
        guard::report_fence_ahead(partition, fence, high);
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition(topic, partition);
        if let Err(error) = self.consumer.pause(&tpl) {
            warn!(partition, %error, "Cannot pause the partition; its messages are dropped.");
        }
        drop(guard);
        metrics::fence_ahead(self.owned.values().filter(|s| s.lock().fence_ahead).count());
    }

    /// Applies ownership changes queued by the rebalance callback.
    fn apply_rebalances(&mut self) {
        let changes = self.consumer.context().take_changes();
        let groups = self.applier.keys().groups().count() as usize;
        if let Some(assigned) = intake::apply_changes(
            &mut self.owned,
            &mut self.committer,
            &mut self.epochs,
            groups,
            changes,
            self.settings.dedupe,
            &mut self.kept,
        ) {
            self.blocked = false;
            self.start_readers(assigned);
        }
    }

    /// Whether a batch the main loop fills is full: the loop then takes no
    /// message until it is sent. A reader's full batch holds back only its
    /// reader.
    fn full_here(&self, partition: i32) -> bool {
        self.owned.get(&partition).is_some_and(|slot| {
            let state = slot.lock();
            !state.read_apart && state.batch.is_full(&self.limits)
        })
    }

    fn after_accept(&mut self, partition: i32) {
        let full = self
            .owned
            .get(&partition)
            .is_some_and(|s| s.lock().batch.is_full(&self.limits));
        if full {
            self.dispatch(partition, &HashMap::new());
            self.blocked = self.full_here(partition);
        }
    }

    /// Closes a second of hot-post detection: shares its counts and promotes
    /// what crossed the threshold, in a task (one at a time; a second whose
    /// predecessor is still being shared is skipped).
    fn detect(&mut self) {
        let Some(detector) = self.detector.as_mut() else {
            return;
        };
        let Some(report) = detector.tick((wall_ms() / 1000) as u64) else {
            return;
        };
        if self
            .sharing
            .as_ref()
            .is_some_and(|task| !task.is_finished())
        {
            return;
        }
        let policy = detector.policy();
        let store = self.applier.store().clone();
        let keys = self.applier.keys().clone();
        let routes = self.routes.clone();
        let table = self.table.clone();
        let watch = self.watch.clone();
        self.sharing = Some(tasks::spawn("hot-post-sharing", async move {
            match policy.share(report, &store, &keys, &routes, &table).await {
                Ok(promoted) if !promoted.is_empty() => watch.refresh_soon(),
                Ok(_) => {}
                Err(error) => {
                    warn!(%error, "Sharing hot-post counts failed; this second is skipped.");
                }
            }
        }));
    }

    /// Tries every pending seek once; failures are retried on the next tick.
    /// A partition with a reader is sought by its reader, which is woken.
    fn retry_seeks(&mut self) {
        for (&partition, slot) in &self.owned {
            let state = &mut *slot.lock();
            let Some(resume) = state.pending_seek else {
                continue;
            };
            if state.read_apart {
                slot.poke.notify_one();
                continue;
            }
            let offset = Offset::Offset(resume);
            match self.consumer.seek(
                &self.settings.kafka.topic,
                partition,
                offset,
                Duration::from_secs(2),
            ) {
                Ok(()) => state.pending_seek = None,
                Err(error) => debug!(partition, resume, %error, "Seek not accepted yet; retrying."),
            }
        }
    }

    /// Shutdown: stop fetching, flush what is buffered, wait (bounded) for the
    /// scripts in flight, commit what landed.
    async fn drain(&mut self) {
        let deadline = tokio::time::Instant::now() + self.settings.batching.shutdown_timeout;
        self.apply_rebalances();
        self.stop_readers().await;
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
