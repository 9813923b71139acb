//! Rebuild: recount the topic into a fresh key generation while the live
//! group keeps counting, then switch everyone to it at once.
//!
//! # Why a new generation, and why the live group's fences
//!
//! Counts go wrong in ways no fence sees: Redis wiped without persistence, a
//! bug shipped, a key edited by hand. The topic still holds every like, so
//! the fix is to count it again, but never into the keys readers sum: a
//! rebuild writes generation `k` (key prefix `<prefix>:g<k>`, see
//! [`crate::domain::generation`]) through the very pipeline of `tally run`
//! ([`crate::pipeline::run::run_with`]), with the same scripts and fences. Two choices
//! make the switch simple:
//!
//! * it reads with a Kafka group of its own (`<group>-rebuild-g<k>-<start ms>`, from the
//!   earliest retained offsets or `--from-timestamp`), but writes its fences
//!   under the **live** group's name. Generation `k`'s fences are therefore
//!   exactly the fences the live group will find there after the switch, and
//!   a live consumer moving to generation `k` resumes from them as it would
//!   after any rebalance; where the rebuild and a live consumer both write
//!   for a moment, the fence keeps them from counting anything twice;
//! * before its first batch it copies the old generation's routing registry
//!   (and the route hashes readers use), so every replayed event is routed to
//!   the version it went to the first time. Routing versions published in the
//!   old generation after the copy are not carried over: counts do not depend
//!   on routing, and hot-post detection promotes again after the switch.
//!
//! The rebuild records its generation in `<prefix>:rebuild` and the origin
//! of every partition (its first offset) before it starts, so a rebuild that
//! is killed resumes from its fences when started again, and `--abort`
//! drops the unfinished generation. It warns when a partition's earliest
//! retained offset is above 0: events before it are gone, and the rebuilt
//! counts only hold what the topic still retains.
//!
//! # Cut-over
//!
//! Per partition, let `L` be the highest live fence in the current
//! generation and `R` the lowest fence in generation `k`.
//!
//! 1. Catch up until `R >= max(L, end at start) - margin` on every partition.
//! 2. Set the freeze flag `<prefix>:freeze = k` (TTL a few seconds, renewed
//!    while waiting). Live pipelines read it with the routing registry and
//!    stop dispatching new batches; their fences stop moving once the batches
//!    in flight land. Wait one refresh period so every live pipeline has
//!    seen it.
//! 3. Keep applying until `R >= L` on every partition, with `L` unchanged
//!    between two reads. Now generation `k` holds every event the old one
//!    holds (and perhaps more).
//! 4. Move the pointer to `k`, then drop the flag and the record. Readers
//!    read the pointer before the counters and sum generation `k`; live
//!    pipelines finish what is in flight, switch their keys and resume every
//!    partition from generation `k`'s fences.
//!
//! No gap: every live pipeline resumes at fences generation `k` really has,
//! and the fence makes anything applied twice a no-op. No double count: the
//! old generation is never summed again after a reader sees the pointer move,
//! and nothing is ever added to generation `k` but through its fences. No
//! going back: at step 4 generation `k` holds at least the old generation's
//! events, so a post that only gains likes never reads lower after the switch
//! than before it. If step 3 does not finish in time the flag is lifted (or
//! expires if the rebuild died) and catching up goes on; live pipelines pause
//! for about one refresh period plus a batch.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use redis::RedisError;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::domain::generation::{self, Record};
use crate::domain::layout::{self, OpenStore};
use crate::domain::packing::Wanted;
use crate::domain::routing::KeyLayout;
use crate::domain::versions::{
    CLOCK_FIELD, DEFAULT_FIELD, FINAL_FIELD, UNFREEZING_FIELD, UNFROZEN_FIELD, wall_ms,
};
use crate::infra::config::RunSettings;
use crate::infra::metrics;
use crate::infra::security::KafkaAcl;
use crate::infra::store::{Shared, Target};
use crate::ops::{OpError, gc, open_applier};
use crate::pipeline::apply::Applier;
use crate::pipeline::consume::check_topic;
use crate::pipeline::run::{Mode, RunError, run_with, writer_layout};

/// How long the cut-over may hold the live pipelines, beyond the refresh
/// period, before the freeze is lifted and catching up goes on.
const CUTOVER_LIMIT: Duration = Duration::from_secs(5);

/// How a rebuild starts and when it freezes the live pipelines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RebuildOptions {
    /// Start every partition at its first event stamped at or after this
    /// time (milliseconds since the epoch) instead of the earliest retained offset.
    pub from_timestamp: Option<i64>,
    /// Freeze the live pipelines once every partition is within this many
    /// offsets of the live fences.
    pub cutover_margin: i64,
}

/// How far a rebuild is, per partition, as offsets.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    /// Where each partition's recount began.
    pub origins: &'a [i64],
    /// The lowest fence of the new generation per partition (`-1`: none yet).
    pub rebuilt: &'a [i64],
    /// The (low, high) watermarks per partition now.
    pub marks: &'a [(i64, i64)],
}

impl Snapshot<'_> {
    /// Per partition, the offsets recounted (from its origin to the lowest
    /// fence) and those left (from there to the partition's end now). They
    /// equal events on a topic without compaction or transactions.
    pub fn offsets(&self) -> Vec<(i64, i64)> {
        self.origins
            .iter()
            .zip(self.rebuilt)
            .zip(self.marks)
            .map(|((&origin, &fence), &(_, high))| {
                ((fence + 1 - origin).max(0), (high - 1 - fence).max(0))
            })
            .collect()
    }
}

/// A finished rebuild.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rebuilt {
    /// The generation now current.
    pub generation: u64,
    /// Its key prefix.
    pub prefix: String,
    /// The generation it replaced (kept until `tally gc`).
    pub previous: u64,
}

/// What `tally rebuild --abort` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Aborted {
    /// No rebuild was unfinished.
    NothingToAbort,
    /// The unfinished generation is gone.
    Dropped {
        /// Its number.
        generation: u64,
        /// Keys deleted.
        keys: u64,
        /// The consumer groups it read with (a pattern), whose offsets stay.
        kafka_group: String,
    },
}

/// Per partition, the lowest fence of `applier`'s generation (origin - 1 for
/// a slot group without a fence), or `-1` where nothing is recorded.
async fn lowest_fences(applier: &Applier, partitions: i32) -> Result<Vec<i64>, RedisError> {
    let mut out = Vec::with_capacity(partitions as usize);
    for p in 0..partitions {
        let found = applier.read_fences(p).await?;
        out.push(match found.tracker() {
            Some((_, tracker)) => tracker.resume_at() - 1,
            None => found.fences.iter().flatten().copied().min().unwrap_or(-1),
        });
    }
    Ok(out)
}

/// Per partition, the highest fence of `applier`'s generation, or `-1`.
async fn highest_fences(applier: &Applier, partitions: i32) -> Result<Vec<i64>, RedisError> {
    let mut out = Vec::with_capacity(partitions as usize);
    for p in 0..partitions {
        let found = applier.read_fences(p).await?;
        out.push(match found.tracker() {
            Some((_, tracker)) => tracker.highest(),
            None => found.fences.iter().flatten().copied().max().unwrap_or(-1),
        });
    }
    Ok(out)
}

/// Copies the routing registry and the route hashes of its posts from one
/// generation to another; route hashes first, so readers of the new
/// generation sum every version before a writer may route to it. The `base`
/// field is left behind: the rebuild recounts everything from the log.
async fn copy_routing(
    store: &Shared,
    from: &KeyLayout,
    to: &KeyLayout,
) -> Result<usize, RedisError> {
    let registry_key = from.registry_key();
    let registry: Vec<(String, String)> = store
        .call(|mut s| async move {
            redis::cmd("HGETALL")
                .arg(&registry_key)
                .query_async(&mut s)
                .await
        })
        .await?;
    for (field, entry) in &registry {
        // The default layout's epochs, the final time and the unfreezes need
        // no route hash: they live in the registry alone. The unfreezes
        // route the replayed events as the live writers did.
        if let Ok(post) = field.parse::<u64>() {
            copy_route_hash(store, from.route_key(post), to.route_key(post)).await?;
        } else if ![
            DEFAULT_FIELD,
            FINAL_FIELD,
            CLOCK_FIELD,
            UNFROZEN_FIELD,
            UNFREEZING_FIELD,
        ]
        .contains(&field.as_str())
        {
            continue;
        }
        let registry = to.registry_key();
        store
            .call(|mut s| async move {
                redis::cmd("HSET")
                    .arg(&registry)
                    .arg(field)
                    .arg(entry)
                    .query_async::<()>(&mut s)
                    .await
            })
            .await?;
    }
    Ok(registry.len())
}

/// Copies one post's route hash, without its `base`.
async fn copy_route_hash(store: &Shared, source: String, dest: String) -> Result<(), RedisError> {
    let fields: Vec<(String, String)> = store
        .call(|mut s| async move { redis::cmd("HGETALL").arg(&source).query_async(&mut s).await })
        .await?;
    let fields: Vec<(String, String)> = fields.into_iter().filter(|(f, _)| f != "base").collect();
    if !fields.is_empty() {
        store
            .call(|mut s| async move {
                redis::cmd("HSET")
                    .arg(&dest)
                    .arg(&fields)
                    .query_async::<()>(&mut s)
                    .await
            })
            .await?;
    }
    Ok(())
}

/// The topic's partitions with their (low, high) watermarks.
fn watermarks(
    consumer: &BaseConsumer,
    topic: &str,
    partitions: i32,
) -> Result<Vec<(i64, i64)>, OpError> {
    tokio::task::block_in_place(|| {
        (0..partitions)
            .map(|p| {
                consumer
                    .fetch_watermarks(topic, p, Duration::from_secs(10))
                    .map_err(OpError::kafka(format!(
                        "reading the watermarks of {topic}/{p}"
                    )))
            })
            .collect()
    })
}

/// Where each partition starts: the earliest retained offset, or the first
/// offset stamped at or after `from_ms`.
fn start_offsets(
    consumer: &BaseConsumer,
    topic: &str,
    marks: &[(i64, i64)],
    from_ms: Option<i64>,
) -> Result<Vec<i64>, OpError> {
    let Some(from_ms) = from_ms else {
        return Ok(marks.iter().map(|&(low, _)| low).collect());
    };
    let lookup = "looking up offsets for --from-timestamp";
    let mut tpl = TopicPartitionList::new();
    for p in 0..marks.len() as i32 {
        tpl.add_partition_offset(topic, p, Offset::Offset(from_ms))
            .map_err(OpError::kafka(lookup))?;
    }
    let found =
        tokio::task::block_in_place(|| consumer.offsets_for_times(tpl, Duration::from_secs(10)))
            .map_err(OpError::kafka(lookup))?;
    (0..marks.len())
        .map(|p| {
            let element = found.find_partition(topic, p as i32).ok_or_else(|| {
                OpError::Refused(format!("partition {p} is missing from the offsets lookup"))
            })?;
            Ok(match element.offset() {
                Offset::Offset(o) => o.max(marks[p].0),
                // Nothing stamped that late: start at the end.
                _ => marks[p].1,
            })
        })
        .collect()
}

/// Recounts the topic into a new generation, then switches readers and
/// writers to it (see the module notes); `progress` sees every poll, and
/// each poll records the progress metrics (`tally_rebuild_*`).
pub async fn rebuild(
    settings: RunSettings,
    options: RebuildOptions,
    shutdown: CancellationToken,
    progress: &mut dyn FnMut(Snapshot<'_>),
) -> Result<Rebuilt, OpError> {
    metrics::rebuild_phase("starting");
    let (opened, applier, _) = open_applier(&settings).await?;
    let store = &opened.store;
    let prefix = settings.store.prefix();
    let (current, k) = prepare(&opened, prefix, &settings).await?;
    let old = layout::generation_keys(store, &opened.keys, current).await?;
    let new = layout::generation_keys(store, &opened.keys, k).await?;
    let new_applier = applier.with_keys(new.clone());
    let kafka = &settings.kafka;
    let client: BaseConsumer = kafka
        .secure_client_config()
        .create()
        .map_err(OpError::kafka("creating the Kafka client"))?;
    let partitions = check_topic(&client, &kafka.brokers, &kafka.topic, "topic")? as i32;
    let marks = watermarks(&client, &kafka.topic, partitions)?;
    let starts = start_offsets(&client, &kafka.topic, &marks, options.from_timestamp)?;
    let mut origins = Vec::with_capacity(starts.len());
    for (p, &start) in starts.iter().enumerate() {
        origins.push(new_applier.ensure_origin(p as i32, start).await?);
    }
    warn_about_retention(&marks, &origins, options.from_timestamp, k);
    let goal: Vec<i64> = marks.iter().map(|&(_, high)| high - 1).collect();
    info!(
        generation = k,
        prefix = %new.prefix(),
        current,
        partitions,
        events = goal.iter().zip(&origins).map(|(g, o)| (g + 1 - o).max(0)).sum::<i64>(),
        "Rebuilding."
    );

    let settle =
        settings.hot.route_refresh + settings.batching.flush_interval + Duration::from_millis(250);
    let stop = CancellationToken::new();
    let mut cut_over = CutOver {
        store: store.clone(),
        prefix: prefix.to_string(),
        generation: k,
        new: new_applier,
        old: applier.with_keys(old),
        client,
        brokers: kafka.brokers.clone(),
        topic: kafka.topic.clone(),
        partitions,
        goal,
        origins,
        margin: options.cutover_margin,
        settle,
        frozen_at: None,
        last_live: None,
        stable_reads: 0,
    };
    let mode = rebuild_mode(&settings, k);
    let beating = stop.child_token();
    let _beat = beating.clone().drop_guard();
    spawn_heartbeat(store.clone(), prefix.to_string(), beating);
    let mut pipeline = crate::infra::tasks::spawn(
        "rebuild-pipeline",
        run_with(rebuild_settings(&settings), mode, stop.clone()),
    );
    let outcome = cut_over.run(&mut pipeline, &shutdown, progress).await;
    if !pipeline.is_finished() || outcome.is_ok() {
        stop.cancel();
        match pipeline.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!(%error, "The rebuild pipeline stopped with an error."),
            Err(error) => warn!(%error, "The rebuild pipeline panicked."),
        }
    }
    outcome?;
    Ok(Rebuilt {
        generation: k,
        prefix: new.prefix().to_string(),
        previous: current,
    })
}

/// Says in the rebuild record that this rebuild runs, until `stop`:
/// `tally rebuild --abort` is refused meanwhile.
fn spawn_heartbeat(store: Shared, base: String, stop: CancellationToken) {
    crate::infra::tasks::spawn("rebuild-heartbeat", async move {
        let mut every = tokio::time::interval(generation::HEARTBEAT_EVERY);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = every.tick() => {
                    if let Err(error) = generation::heartbeat(&store, &base).await {
                        warn!(%error, "Recording that the rebuild runs failed; retrying.");
                    }
                }
            }
        }
    });
}

/// Finds the generation to fill, records its layout (`--layout`, or the
/// current generation's) and copies the routing registry into it once;
/// returns (the current generation, the one being rebuilt).
async fn prepare(
    opened: &OpenStore,
    prefix: &str,
    settings: &RunSettings,
) -> Result<(u64, u64), OpError> {
    let store = &opened.store;
    let pointer = generation::read_pointer(store, prefix).await?;
    // The next generation after a pointer that moved back holds live counts.
    if let Some(backwards) = pointer.backwards(prefix) {
        return Err(OpError::Refused(backwards.to_string()));
    }
    let current = pointer.current;
    let (record, began) = begin(store, prefix, current).await?;
    let k = record.generation;
    let wanted = Wanted::from_settings(&settings.packing);
    // A store that lost everything (FLUSHALL) has no record: the one the
    // recount writes is made first, its generation 0 of string keys (it
    // holds nothing), so that generation k's layout can be recorded in it.
    let stored = match layout::read_record(store, prefix).await? {
        Some(stored) => stored,
        None => {
            let writer = layout::WriterLayout {
                packing: None,
                ..writer_layout(settings)
            };
            let proposed = layout::Record::of_writer(&writer, wall_ms());
            layout::ensure_record(store, prefix, &proposed).await?.0
        }
    };
    if began {
        let packing = match wanted {
            Some(wanted) => wanted.packing(opened.keys.groups().count()),
            None => stored.packing_of(current),
        };
        layout::record_packing(store, prefix, &stored, k, packing).await?;
    } else {
        layout::check_packing(prefix, wanted.as_ref(), &stored.packing_of(k))
            .map_err(layout::LayoutError::from)?;
    }
    if !record.copied {
        let old = opened
            .keys
            .with_prefix(generation::prefix_of(prefix, current));
        let new = opened.keys.with_prefix(generation::prefix_of(prefix, k));
        let posts = copy_routing(store, &old, &new).await?;
        generation::write_record(
            store,
            prefix,
            Record {
                copied: true,
                ..record
            },
        )
        .await?;
        info!(posts, from = %old.prefix(), to = %new.prefix(), "Routing registry copied.");
    }
    Ok((current, k))
}

/// The rebuild record in force: the unfinished one, or a new one for the
/// generation after `current` (and `true`).
async fn begin(store: &Shared, prefix: &str, current: u64) -> Result<(Record, bool), RedisError> {
    if let Some(record) = generation::read_record(store, prefix).await? {
        info!(
            generation = record.generation,
            "Resuming the unfinished rebuild from its fences."
        );
        return Ok((record, false));
    }
    let record = Record {
        generation: current + 1,
        started_at_ms: wall_ms(),
        copied: false,
        alive_at_ms: wall_ms(),
    };
    generation::write_record(store, prefix, record).await?;
    Ok((record, true))
}

/// The settings of the pipeline that recounts: those of `tally run`,
/// without hot-post detection, dead letters or a metrics listener of its own
/// (what `tally rebuild --metrics-addr` serves is the rebuild's progress
/// only, [`crate::infra::metrics::REBUILD_ONLY`]). Its group is new,
/// so it reads from the earliest offsets, as every group's first start does.
fn rebuild_settings(settings: &RunSettings) -> RunSettings {
    let mut settings = settings.clone();
    settings.hot.promote_above = 0;
    settings.kafka.dead_letter_topic = None;
    settings.metrics_addr = None;
    settings
}

/// The recounting pipeline reads with a group of its own and writes the
/// live group's fences in generation `k` (see the module notes). Each
/// rebuild process has a group of its own too: it resumes from the fences,
/// never from the group's offsets, and a fresh group need not wait for the
/// member of a killed predecessor to expire (nor, on a broker that keeps an
/// expired member as the group's leader, wait for ever).
fn rebuild_mode(settings: &RunSettings, k: u64) -> Mode {
    Mode {
        kafka_group: format!("{}-{}", rebuild_groups(&settings.kafka.group, k), wall_ms()),
        fixed_generation: Some(k),
        // One ACL for every rebuild's groups, whatever the generation.
        group_acl: KafkaAcl::on_prefix(
            "Read",
            "group",
            &format!("{}-rebuild-", settings.kafka.group),
        ),
    }
}

/// The stem of the consumer groups that rebuild generation `k` of `group`.
fn rebuild_groups(group: &str, k: u64) -> String {
    format!("{group}-rebuild-g{k}")
}

/// The cut-over state machine, polled while the recounting pipeline runs.
struct CutOver {
    store: Shared,
    prefix: String,
    generation: u64,
    /// Generation `k`'s fences.
    new: Applier,
    /// The current generation's fences.
    old: Applier,
    client: BaseConsumer,
    brokers: String,
    topic: String,
    /// The topic's partitions, those it gained since the start included.
    partitions: i32,
    /// The last offset of each partition when the rebuild started (`-1` for a
    /// partition added since).
    goal: Vec<i64>,
    /// Where each partition's recount began (a partition added since the
    /// start begins at its first offset).
    origins: Vec<i64>,
    margin: i64,
    /// How long live pipelines take to see a freeze and land what is in flight.
    settle: Duration,
    frozen_at: Option<Instant>,
    last_live: Option<Vec<i64>>,
    /// Polls in a row that read the same live fences.
    stable_reads: u32,
}

/// What one poll of the cut-over decided.
enum Step {
    /// Keep polling.
    Wait,
    /// The pointer moved: done.
    Switched,
}

impl CutOver {
    /// Polls until the switch, a shutdown or the pipeline's end; a freeze
    /// left behind by an error is lifted.
    async fn run(
        &mut self,
        pipeline: &mut JoinHandle<Result<(), RunError>>,
        shutdown: &CancellationToken,
        progress: &mut dyn FnMut(Snapshot<'_>),
    ) -> Result<(), OpError> {
        let k = self.generation;
        let outcome = loop {
            let pause = if self.frozen_at.is_some() {
                generation::FROZEN_POLL
            } else {
                Duration::from_millis(500)
            };
            tokio::select! {
                _ = shutdown.cancelled() => break Err(OpError::Refused(format!(
                    "stopped before the switch; run `tally rebuild` again to resume generation {k}, or `tally rebuild --abort`"
                ))),
                joined = &mut *pipeline => {
                    let detail = match joined {
                        Ok(Ok(())) => "stopped".to_string(),
                        Ok(Err(error)) => error.to_string(),
                        Err(error) => error.to_string(),
                    };
                    return Err(OpError::Refused(format!(
                        "the rebuild pipeline ended before the switch: {detail}"
                    )));
                }
                _ = tokio::time::sleep(pause) => {}
            }
            match self.poll(progress).await {
                Ok(Step::Wait) => metrics::rebuild_phase(if self.frozen_at.is_some() {
                    "cutover"
                } else {
                    "recounting"
                }),
                Ok(Step::Switched) => {
                    metrics::rebuild_phase("switched");
                    break Ok(());
                }
                Err(error) => break Err(error),
            }
        };
        if outcome.is_err() && self.frozen_at.is_some() {
            let _ = generation::unfreeze(&self.store, &self.prefix).await;
        }
        outcome
    }

    /// Reads both generations' fences and moves the state machine one step:
    /// freeze when within the margin, switch when caught up under a freeze
    /// that held long enough, lift a freeze that took too long.
    async fn poll(&mut self, progress: &mut dyn FnMut(Snapshot<'_>)) -> Result<Step, OpError> {
        let k = self.generation;
        self.follow_growth()?;
        let rebuilt = lowest_fences(&self.new, self.partitions).await?;
        let live = highest_fences(&self.old, self.partitions).await?;
        let marks = watermarks(&self.client, &self.topic, self.partitions)?;
        let snapshot = Snapshot {
            origins: &self.origins,
            rebuilt: &rebuilt,
            marks: &marks,
        };
        for (p, (recounted, left)) in snapshot.offsets().into_iter().enumerate() {
            metrics::rebuild_offsets(p as i32, recounted, left);
        }
        progress(snapshot);
        let within = |margin: i64| caught_up(&rebuilt, &live, &self.goal, margin);
        self.stable_reads = if self.last_live.as_ref() == Some(&live) {
            self.stable_reads + 1
        } else {
            0
        };
        self.last_live = Some(live.clone());
        let Some(at) = self.frozen_at else {
            if within(self.margin) {
                generation::freeze(&self.store, &self.prefix, k).await?;
                self.frozen_at = Some(Instant::now());
                info!(
                    generation = k,
                    "Caught up with the live fences; freezing live writers for the switch."
                );
            }
            return Ok(Step::Wait);
        };
        if at.elapsed() >= self.settle && self.stable_reads >= 2 && within(0) {
            generation::switch(&self.store, &self.prefix, k).await?;
            info!(
                generation = k,
                frozen_ms = at.elapsed().as_millis() as u64,
                "Switched readers and writers to the new generation."
            );
            return Ok(Step::Switched);
        }
        if at.elapsed() > self.settle + CUTOVER_LIMIT {
            generation::unfreeze(&self.store, &self.prefix).await?;
            self.frozen_at = None;
            warn!(
                generation = k,
                "Not caught up within the cut-over limit; freeze lifted, catching up again."
            );
        } else {
            generation::freeze(&self.store, &self.prefix, k).await?;
        }
        Ok(Step::Wait)
    }
}

impl CutOver {
    /// Takes in the partitions the topic gained since the rebuild began. The
    /// recount reads them from their first offset, as live writers do once
    /// they see them, and the switch waits until the new generation holds
    /// everything the live one applied there.
    fn follow_growth(&mut self) -> Result<(), OpError> {
        let now = tokio::task::block_in_place(|| {
            check_topic(&self.client, &self.brokers, &self.topic, "topic")
        })? as i32;
        if now <= self.partitions {
            return Ok(());
        }
        info!(
            generation = self.generation,
            before = self.partitions,
            now,
            "The topic gained partitions during the rebuild; they are recounted from their start, and the switch waits for them too."
        );
        self.goal.resize(now as usize, -1);
        self.origins.resize(now as usize, 0);
        self.partitions = now;
        Ok(())
    }
}

/// Whether the new generation's lowest fences (`rebuilt`) are within
/// `margin` offsets of what it must reach on every partition: the live
/// generation's highest fence, and no less than the last offset at the start
/// (`goal`). A partition missing from either list has nothing there (`-1`).
fn caught_up(rebuilt: &[i64], live: &[i64], goal: &[i64], margin: i64) -> bool {
    let at = |list: &[i64], p: usize| list.get(p).copied().unwrap_or(-1);
    let partitions = rebuilt.len().max(live.len()).max(goal.len());
    (0..partitions).all(|p| at(rebuilt, p) >= at(live, p).max(at(goal, p)) - margin)
}

/// Says loudly what a rebuild that starts above offset 0 cannot count.
fn warn_about_retention(marks: &[(i64, i64)], origins: &[i64], from: Option<i64>, k: u64) {
    let mut lost = 0;
    for (p, (&(low, _), &origin)) in marks.iter().zip(origins).enumerate() {
        if origin > 0 {
            lost += origin;
            if from.is_none() {
                warn!(
                    partition = p,
                    earliest = low,
                    origin,
                    "Partition starts above offset 0: earlier events are gone from the topic."
                );
            }
        }
    }
    if lost == 0 {
        return;
    }
    let why = match from {
        Some(ms) => format!("--from-timestamp {ms} skips them"),
        None => "retention deleted them".to_string(),
    };
    warn!(
        generation = k,
        offsets_skipped = lost,
        "REBUILD STARTS AT THE RETENTION BOUNDARY: {lost} offsets before it are not counted ({why}). \
         Generation {k} will hold only the likes and unlikes still in the topic; \
         posts liked earlier will read lower after the switch than the live counts."
    );
}

/// `tally rebuild --abort`: drops the unfinished generation, if any.
pub async fn abort(settings: &RunSettings) -> Result<Aborted, OpError> {
    let (opened, _, _) = open_applier(settings).await?;
    let store = &opened.store;
    let prefix = settings.store.prefix().to_string();
    let Some(record) = generation::read_record(store, &prefix).await? else {
        return Ok(Aborted::NothingToAbort);
    };
    let k = record.generation;
    if record.running(wall_ms()) {
        return Err(OpError::Refused(format!(
            "the rebuild into generation {k} is running (it said so {} s ago); stop it first (Ctrl-C or SIGTERM), then abort",
            (wall_ms() - record.alive_at_ms) / 1000
        )));
    }
    if generation::read_state(store, &prefix).await?.frozen_for == Some(k) {
        generation::unfreeze(store, &prefix).await?;
    }
    let target: Target = opened.target().clone();
    let base = prefix.clone();
    let keys =
        tokio::task::spawn_blocking(move || gc::drop_generation(&target, &base, k)).await??;
    generation::drop_record(store, &prefix).await?;
    Ok(Aborted::Dropped {
        generation: k,
        keys,
        kafka_group: format!("{}-*", rebuild_groups(&settings.kafka.group, k)),
    })
}

#[cfg(test)]
mod tests {
    use super::caught_up;

    #[test]
    fn the_switch_waits_for_the_goal_and_the_live_fences() {
        // Caught up with the start's last offsets and the live fences.
        assert!(caught_up(&[99, 49], &[99, 49], &[99, 40], 0));
        // Behind the start's last offset, though live writers are quiet.
        assert!(!caught_up(&[98, 49], &[90, 49], &[99, 40], 0));
        // Within the margin.
        assert!(caught_up(&[95, 49], &[99, 49], &[99, 40], 5));
    }

    #[test]
    fn a_partition_added_since_the_start_must_be_caught_up_too() {
        // The topic grew to three partitions: the live generation applied up
        // to offset 20 of the new one, which the recount has not reached.
        assert!(!caught_up(&[99, 49, 10], &[99, 49, 20], &[99, 49, -1], 0));
        // Nothing recorded yet in the new generation for it.
        assert!(!caught_up(&[99, 49], &[99, 49, 20], &[99, 49, -1], 0));
        assert!(caught_up(&[99, 49, 20], &[99, 49, 20], &[99, 49, -1], 0));
        // An added partition nobody has written to yet holds nothing up.
        assert!(caught_up(&[99, 49, -1], &[99, 49, -1], &[99, 49, -1], 0));
    }
}
