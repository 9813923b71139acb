//! Rebuild: recount the topic into a fresh key generation while the live
//! group keeps counting, then switch everyone to it at once.
//!
//! # Why a new generation, and why the live group's fences
//!
//! Counts go wrong in ways no fence sees: Redis wiped without persistence, a
//! bug shipped, a key edited by hand. The topic still holds every like, so
//! the fix is to count it again, but never into the keys readers sum: a
//! rebuild writes generation `k` (key prefix `<prefix>:g<k>`, see
//! [`crate::generation`]) through the very pipeline of `tally run`
//! ([`crate::run::run_with`]), with the same scripts and fences. Two choices
//! make the switch simple:
//!
//! * it reads with a Kafka group of its own (`<group>-rebuild-g<k>`, from the
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

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use redis::RedisError;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::apply::Applier;
use crate::config::RunConfig;
use crate::generation::{self, Record};
use crate::metrics::Stats;
use crate::routing::KeyLayout;
use crate::run::{Mode, run_with};
use crate::slots::SlotGroups;
use crate::store::{Shared, Target};
use crate::versions::wall_ms;

mod progress;

pub use progress::Progress;

/// How long the cut-over may hold the live pipelines, beyond the refresh
/// period, before the freeze is lifted and catching up goes on.
const CUTOVER_LIMIT: Duration = Duration::from_secs(5);

/// Settings of `tally rebuild` besides those it shares with `tally run`.
#[derive(Debug, Clone, Args)]
pub struct RebuildArgs {
    /// Start every partition at its first event stamped at or after this time
    /// (milliseconds since the epoch) instead of the earliest retained offset.
    #[arg(long, value_name = "MS")]
    pub from_timestamp: Option<i64>,
    /// Drop the unfinished generation (its keys and the rebuild record) and exit.
    /// Stop the rebuild first.
    #[arg(long)]
    pub abort: bool,
    /// Freeze the live pipelines once every partition is within this many
    /// offsets of the live fences.
    #[arg(long, default_value_t = 2_000, value_name = "OFFSETS")]
    pub cutover_margin: i64,
    /// Seconds between progress lines when stderr is not a terminal.
    #[arg(long, default_value_t = 5, value_name = "SECS")]
    pub progress_every_secs: u64,
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
async fn copy_routing(store: &Shared, from: &KeyLayout, to: &KeyLayout) -> Result<usize> {
    let registry_key = from.registry_key();
    let registry: Vec<(String, String)> = store
        .call(|mut s| async move {
            redis::cmd("HGETALL")
                .arg(&registry_key)
                .query_async(&mut s)
                .await
        })
        .await?;
    for (post, entry) in &registry {
        let Ok(post) = post.parse::<u64>() else {
            continue;
        };
        let (source, dest) = (from.route_key(post), to.route_key(post));
        let fields: Vec<(String, String)> = store
            .call(
                |mut s| async move { redis::cmd("HGETALL").arg(&source).query_async(&mut s).await },
            )
            .await?;
        let fields: Vec<(String, String)> =
            fields.into_iter().filter(|(f, _)| f != "base").collect();
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
        let registry = to.registry_key();
        store
            .call(|mut s| async move {
                redis::cmd("HSET")
                    .arg(&registry)
                    .arg(post)
                    .arg(entry)
                    .query_async::<()>(&mut s)
                    .await
            })
            .await?;
    }
    Ok(registry.len())
}

/// The topic's partitions with their (low, high) watermarks.
fn watermarks(consumer: &BaseConsumer, topic: &str, partitions: i32) -> Result<Vec<(i64, i64)>> {
    tokio::task::block_in_place(|| {
        (0..partitions)
            .map(|p| {
                consumer
                    .fetch_watermarks(topic, p, Duration::from_secs(10))
                    .with_context(|| format!("reading the watermarks of {topic}/{p}"))
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
) -> Result<Vec<i64>> {
    let Some(from_ms) = from_ms else {
        return Ok(marks.iter().map(|&(low, _)| low).collect());
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..marks.len() as i32 {
        tpl.add_partition_offset(topic, p, Offset::Offset(from_ms))?;
    }
    let found =
        tokio::task::block_in_place(|| consumer.offsets_for_times(tpl, Duration::from_secs(10)))
            .context("looking up offsets for --from-timestamp")?;
    (0..marks.len())
        .map(|p| {
            let element = found
                .find_partition(topic, p as i32)
                .context("a partition is missing from the offsets lookup")?;
            Ok(match element.offset() {
                Offset::Offset(o) => o.max(marks[p].0),
                // Nothing stamped that late: start at the end.
                _ => marks[p].1,
            })
        })
        .collect()
}

/// Runs `tally rebuild`; returns what to print.
pub async fn rebuild_command(
    config: RunConfig,
    args: RebuildArgs,
    shutdown: CancellationToken,
) -> Result<String> {
    let (target, base, applier) = connect_base(&config).await?;
    let store = applier.store().clone();
    let prefix = config.prefix.clone();
    if args.abort {
        return abort(&store, &target, &config).await;
    }
    let pointer = generation::read_pointer(&store, &prefix).await?;
    let mut record = match generation::read_record(&store, &prefix).await? {
        Some(record) => {
            info!(
                generation = record.generation,
                "Resuming the unfinished rebuild from its fences."
            );
            record
        }
        None => {
            let record = Record {
                generation: pointer.current + 1,
                started_at_ms: wall_ms(),
                copied: false,
            };
            generation::write_record(&store, &prefix, record).await?;
            record
        }
    };
    let k = record.generation;
    let old = base.with_prefix(generation::prefix_of(&prefix, pointer.current));
    let new = base.with_prefix(generation::prefix_of(&prefix, k));
    if !record.copied {
        let posts = copy_routing(&store, &old, &new).await?;
        record.copied = true;
        generation::write_record(&store, &prefix, record).await?;
        info!(posts, from = %old.prefix(), to = %new.prefix(), "Routing registry copied.");
    }

    let kafka: BaseConsumer =
        crate::consume::client_config(&config.brokers, &config.kafka_security())
            .create()
            .context("creating the Kafka client")?;
    let partitions =
        crate::consume::check_topic(&kafka, &config.brokers, &config.topic, "topic")? as i32;
    let marks = watermarks(&kafka, &config.topic, partitions)?;
    let starts = start_offsets(&kafka, &config.topic, &marks, args.from_timestamp)?;
    let new_applier = applier.with_keys(new.clone());
    let old_applier = applier.with_keys(old.clone());
    let mut origins = Vec::with_capacity(partitions as usize);
    for (p, &start) in starts.iter().enumerate() {
        origins.push(new_applier.ensure_origin(p as i32, start).await?);
    }
    warn_about_retention(&marks, &origins, args.from_timestamp, k);
    let goal: Vec<i64> = marks.iter().map(|&(_, high)| high - 1).collect();
    info!(
        generation = k,
        prefix = %new.prefix(),
        current = pointer.current,
        partitions,
        events = goal.iter().zip(&origins).map(|(g, o)| (g + 1 - o).max(0)).sum::<i64>(),
        "Rebuilding."
    );

    let mut pipeline_config = config.clone();
    pipeline_config.promote_above = 0;
    pipeline_config.dead_letter_topic = None;
    pipeline_config.metrics_addr = None;
    pipeline_config
        .kafka_config
        .retain(|(key, _)| key != "auto.offset.reset");
    pipeline_config
        .kafka_config
        .push(("auto.offset.reset".into(), "earliest".into()));
    let mode = Mode {
        kafka_group: format!("{}-rebuild-g{k}", config.group),
        fixed_prefix: Some(new.prefix().to_string()),
    };
    let stop = CancellationToken::new();
    let mut pipeline = tokio::spawn(run_with(
        pipeline_config,
        mode,
        Arc::new(Stats::default()),
        stop.clone(),
    ));

    let settle = Duration::from_millis(config.route_refresh_ms + config.flush_interval_ms + 250);
    let mut progress = Progress::new(
        origins.clone(),
        Duration::from_secs(args.progress_every_secs.max(1)),
    );
    let mut frozen_at: Option<Instant> = None;
    let mut last_live: Option<Vec<i64>> = None;
    let mut stable_reads = 0;
    let outcome: Result<()> = loop {
        let pause = if frozen_at.is_some() {
            generation::FROZEN_POLL
        } else {
            Duration::from_millis(500)
        };
        tokio::select! {
            _ = shutdown.cancelled() => break Err(anyhow::anyhow!(
                "stopped before the switch; run `tally rebuild` again to resume generation {k}, or `tally rebuild --abort`"
            )),
            joined = &mut pipeline => {
                let detail = match joined {
                    Ok(Ok(())) => "stopped".to_string(),
                    Ok(Err(error)) => error.to_string(),
                    Err(error) => error.to_string(),
                };
                bail!("the rebuild pipeline ended before the switch: {detail}");
            }
            _ = tokio::time::sleep(pause) => {}
        }
        let rebuilt = lowest_fences(&new_applier, partitions).await?;
        let live = highest_fences(&old_applier, partitions).await?;
        let marks = watermarks(&kafka, &config.topic, partitions)?;
        progress.update(&rebuilt, &marks);
        let targets: Vec<i64> = live.iter().zip(&goal).map(|(&l, &g)| l.max(g)).collect();
        let within = |margin: i64| rebuilt.iter().zip(&targets).all(|(&r, &t)| r >= t - margin);
        stable_reads = if last_live.as_ref() == Some(&live) {
            stable_reads + 1
        } else {
            0
        };
        last_live = Some(live);
        match frozen_at {
            None => {
                if within(args.cutover_margin) {
                    generation::freeze(&store, &prefix, k).await?;
                    frozen_at = Some(Instant::now());
                    info!(
                        generation = k,
                        "Caught up with the live fences; freezing live writers for the switch."
                    );
                }
            }
            Some(at) => {
                if at.elapsed() >= settle && stable_reads >= 2 && within(0) {
                    generation::switch(&store, &prefix, k).await?;
                    info!(
                        generation = k,
                        frozen_ms = at.elapsed().as_millis() as u64,
                        "Switched readers and writers to the new generation."
                    );
                    break Ok(());
                }
                if at.elapsed() > settle + CUTOVER_LIMIT {
                    generation::unfreeze(&store, &prefix).await?;
                    frozen_at = None;
                    warn!(
                        generation = k,
                        "Not caught up within the cut-over limit; freeze lifted, catching up again."
                    );
                } else {
                    generation::freeze(&store, &prefix, k).await?;
                }
            }
        }
    };
    if outcome.is_err() && frozen_at.is_some() {
        let _ = generation::unfreeze(&store, &prefix).await;
    }
    stop.cancel();
    match pipeline.await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => warn!(%error, "The rebuild pipeline stopped with an error."),
        Err(error) => warn!(%error, "The rebuild pipeline panicked."),
    }
    progress.finish();
    outcome?;
    Ok(format!(
        "generation {k} ({}) is current; generation {} stays until `tally gc`\n",
        new.prefix(),
        pointer.current
    ))
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

/// `tally rebuild --abort`: drops the unfinished generation.
async fn abort(store: &Shared, target: &Target, config: &RunConfig) -> Result<String> {
    let prefix = config.prefix.clone();
    let Some(record) = generation::read_record(store, &prefix).await? else {
        return Ok("no unfinished rebuild\n".into());
    };
    let k = record.generation;
    if generation::read_state(store, &prefix).await?.frozen_for == Some(k) {
        generation::unfreeze(store, &prefix).await?;
    }
    let (target, base) = (target.clone(), prefix.clone());
    let deleted =
        tokio::task::spawn_blocking(move || crate::gc::drop_generation(&target, &base, k))
            .await?
            .context("dropping the unfinished generation")?;
    generation::drop_record(store, &prefix).await?;
    Ok(format!(
        "dropped generation {k} ({deleted} keys); consumer group {}-rebuild-g{k} keeps its offsets, which nothing reads\n",
        config.group
    ))
}

/// Checks `config`, and connects to its store with the base key layout (the
/// prefix of generation 0; callers move to the current generation).
pub async fn connect_base(config: &RunConfig) -> Result<(Target, KeyLayout, Applier)> {
    config.validate()?;
    let target = Target::parse(&config.redis).map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
    let groups = if target.is_cluster() {
        SlotGroups::cluster(config.slot_groups)
    } else {
        SlotGroups::single()
    };
    let base = KeyLayout::with_groups(&config.prefix, groups);
    let applier = Applier::connect(&config.redis, base.clone(), &config.group, &config.topic)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((target, base, applier))
}
