//! Start: what `tally run` checks before its consumer subscribes, and the
//! parts the loop is built from.
//!
//! Invariant: nothing is written and nothing fetched before the checks that
//! can refuse the start have passed: every partition's fences lie inside its
//! log, the prefix's layout record matches the settings (or is written on a
//! first start, adopting data written without one), a store that lost
//! everything under a group with committed offsets is refused unless the loss
//! is accepted, a server that would not keep a packed generation's hashes
//! compact is refused before the record names that packing, the consumed
//! topic is not compacted, and a dead-letter topic exists. A check whose
//! connection the store cut (a restart, a failover) is never passed as
//! unreadable: the start begins its checks again, and what the failed pass
//! started is stopped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Following, Mode, RunError, watch_routes};
use crate::domain::generation::{self, GenerationWatch};
use crate::domain::layout::adopt::{self, Survey};
use crate::domain::layout::{self, LayoutError, OpenStore, Record, WriterLayout};
use crate::domain::packing::{LONGEST_FIELD, Packing, Wanted};
use crate::domain::routing::KeyLayout;
use crate::domain::versions::{RouteWatch, Routes, wall_ms};
use crate::infra::config::{DEFAULT_BUCKETS, KafkaSettings, RunSettings};
use crate::infra::retry::Backoff;
use crate::infra::store::{ConnectError, Server, stray_detail};
use crate::pipeline::apply::Applier;
use crate::pipeline::consume::{self, LikeConsumer, TallyContext};
use crate::pipeline::dead_letter::DeadLetters;
use crate::pipeline::guard::{self, GuardError};

/// How long a start goes on trying after the store stopped answering
/// part-way through its checks (a restart, a failover): longer than a
/// server takes to load a large dataset.
pub const START_WAIT: Duration = Duration::from_secs(60);

/// What a start has checked and built, for the loop.
pub(super) struct Started {
    pub(super) servers: Vec<(Server, String)>,
    pub(super) following: Option<Following>,
    pub(super) applier: Applier,
    pub(super) consumer: Arc<LikeConsumer>,
    pub(super) partitions: usize,
    pub(super) dead_letters: Option<Arc<DeadLetters>>,
    pub(super) record: Record,
    pub(super) routing: (Routes, RouteWatch, CancellationToken),
}

/// Runs the start-up checks until they pass or refuse. The store was
/// reached once (`opened`); when it stops answering part-way through (a
/// connection reset, LOADING after a restart), the whole start is tried
/// again, from its first check, for up to [`START_WAIT`]: a check is never
/// passed unread, and a half-made start leaves nothing running.
pub(super) async fn start(
    opened: &OpenStore,
    settings: &RunSettings,
    mode: &Mode,
    shutdown: &CancellationToken,
) -> Result<Started, RunError> {
    let since = Instant::now();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let attempt = shutdown.child_token();
        match start_once(opened, settings, mode, &attempt).await {
            Ok(started) => return Ok(started),
            Err(error) if error.lost_store() && since.elapsed() < START_WAIT => {
                attempt.cancel();
                let delay = backoff.next_delay();
                warn!(
                    %error,
                    retry_in_ms = delay.as_millis() as u64,
                    "Redis stopped answering during the start-up checks; starting them again."
                );
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(error),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(error) => {
                attempt.cancel();
                return Err(error);
            }
        }
    }
}

/// One pass of the start-up checks, in order: the servers, the generation
/// pointer, the consumer and its topics and group, the dead-letter topic,
/// the layout record, the dedupe rule, every fence against its log, the
/// routing registry.
/// Tasks it starts stop with `attempt`.
async fn start_once(
    opened: &OpenStore,
    settings: &RunSettings,
    mode: &Mode,
    attempt: &CancellationToken,
) -> Result<Started, RunError> {
    let target = opened.target();
    let servers = tokio::task::block_in_place(|| guard::check_server(target))?;
    tokio::task::block_in_place(|| guard::check_eviction(target, false))?;
    let unreadable = |source: redis::RedisError| match stray_detail(&source) {
        Some(detail) => RunError::Guard(GuardError::StrayValue(detail.to_string())),
        None => RunError::Redis(ConnectError {
            url: opened.url.shown().to_string(),
            source,
        }),
    };
    let following = follow_pointer(opened, settings, mode, attempt)
        .await
        .map_err(unreadable)?;
    // A pointer that moved back is not followed by the writers still running.
    if let Some(backwards) = following
        .as_ref()
        .and_then(|f| f.watch.current().backwards(settings.store.prefix()))
    {
        return Err(backwards.into());
    }
    let written = match (mode.fixed_generation, &following) {
        (Some(k), _) => k,
        (None, Some(f)) => f.current,
        (None, None) => unreachable!("a live pipeline follows the pointer"),
    };
    let prefix = generation::prefix_of(settings.store.prefix(), written);
    let kafka = &settings.kafka;
    // The generation's packing is known once its record is read: until then
    // the applier only reads fences, which every packing keeps alike.
    let mut applier = Applier::new(
        opened.store.clone(),
        target.clone(),
        opened.keys.with_prefix(prefix),
        &kafka.group,
        &kafka.topic,
    );
    let context = TallyContext::new(&kafka.topic, applier.fence_reader().clone())
        .with_group_acl(mode.group_acl.clone());
    let consumer = Arc::new(consume::create_consumer(kafka, &mode.kafka_group, context)?);
    consumer.context().attach(&consumer);
    let partitions = consume::check_consumed_topic(&consumer, kafka).await?;
    guard::check_compaction(kafka).await?;
    consume::check_group(
        &consumer,
        kafka,
        &mode.kafka_group,
        partitions,
        &mode.group_acl,
    )
    .await?;
    // Before anything is written: a dead-letter topic tally may not write is
    // refused like the consumed topic.
    let dead_letters = dead_letters(&consumer, kafka)?;
    let first_start = FirstStart {
        consumer: &consumer,
        partitions,
        live: mode.fixed_generation.is_none(),
    };
    let record = check_layout(opened, settings, first_start, written).await?;
    // The live writers of a prefix judge repeats by one rule; a rebuild
    // recounts under its own, into a generation of its own.
    if mode.fixed_generation.is_none() {
        guard::check_dedupe_rule(
            &opened.store,
            opened.url.shown(),
            settings.store.prefix(),
            settings.dedupe,
            settings.dedupe_change,
        )
        .await?;
    }
    applier = applier.with_keys(record.generation_keys(&opened.keys, written));
    consumer
        .context()
        .set_fences(applier.fence_reader().clone());
    check_logs(
        &consumer,
        &applier,
        (&kafka.topic, partitions),
        opened.url.shown(),
    )
    .await?;
    let routing = watch_routes(&applier, record.buckets, settings, attempt)
        .await
        .map_err(unreadable)?;
    Ok(Started {
        servers,
        following,
        applier,
        consumer,
        partitions,
        dead_letters,
        record,
        routing,
    })
}

/// Checks every partition's fences against its log (see [`guard`]), once,
/// before the consumer fetches anything: the broker is asked for the
/// watermarks while nothing else of this consumer is in flight. A fence
/// ahead of its log stops the start; every assignment checks again (see
/// [`consume`]), and reports what retention deleted.
async fn check_logs(
    consumer: &LikeConsumer,
    applier: &Applier,
    (topic, partitions): (&str, usize),
    redis_shown: &str,
) -> Result<(), RunError> {
    for partition in 0..partitions as i32 {
        let fences =
            applier
                .read_fences(partition)
                .await
                .map_err(|source| match stray_detail(&source) {
                    Some(detail) => RunError::Guard(GuardError::StrayValue(detail.to_string())),
                    None => RunError::Redis(ConnectError {
                        url: redis_shown.to_string(),
                        source,
                    }),
                })?;
        if let Some((_, tracker)) = fences.tracker() {
            let resume = tracker.resume_at();
            tokio::task::block_in_place(|| guard::check_log(consumer, topic, partition, resume))?;
        }
    }
    Ok(())
}

/// What the layout check needs to tell a first start from a store that lost
/// everything.
struct FirstStart<'a> {
    pub(super) consumer: &'a LikeConsumer,
    pub(super) partitions: usize,
    /// `tally run` itself (a rebuild reads with a group of its own).
    pub(super) live: bool,
}

/// Writes the prefix's layout record on the first start (adopting what an
/// earlier version wrote without one), refuses settings that differ from it,
/// and returns it. A store with no record and no data under a group that has
/// committed offsets lost everything: refused, unless the loss is accepted.
async fn check_layout(
    opened: &OpenStore,
    settings: &RunSettings,
    first: FirstStart<'_>,
    generation: u64,
) -> Result<Record, RunError> {
    let base = settings.store.prefix();
    let kafka = &settings.kafka;
    let existing = layout::read_record(&opened.store, base).await?;
    let unrecorded = existing.is_none();
    // The packing the written generation will have, checked against the
    // server before the record names it.
    let writer = writer_layout(settings);
    let packing = match &existing {
        Some(record) => record.packing_of(generation),
        None => Record::of_writer(&writer, 0).packing_of(0),
    };
    check_listpack(opened, &packing)?;
    // Only while the prefix has no record: one SCAN of the prefix, once. A
    // rebuild recounts from the log into a generation of its own, so there is
    // nothing for it to adopt (and its own keys must not read as such).
    let survey = match unrecorded && first.live {
        true => tokio::task::block_in_place(|| adopt::survey(opened.target(), &opened.keys))
            .map_err(LayoutError::from)?,
        false => Survey::default(),
    };
    let data = survey.holds_data();
    if data && settings.buckets.is_none() {
        return Err(LayoutError::AdoptWithoutBuckets {
            prefix: base.to_string(),
            key: layout::record_key(base),
            seen: survey
                .highest
                .as_ref()
                .map(|(b, _)| format!("; its version-0 buckets go up to {b}"))
                .unwrap_or_default(),
        }
        .into());
    }
    if unrecorded {
        let buckets = settings.buckets.unwrap_or(DEFAULT_BUCKETS);
        survey
            .check(&opened.keys, buckets, &kafka.group, &kafka.topic)
            .map_err(LayoutError::from)?;
    }
    if unrecorded && !data && first.live {
        let committed = tokio::task::block_in_place(|| {
            guard::committed(first.consumer, &kafka.topic, first.partitions)
        })?;
        if !committed.is_empty() {
            let shown = committed
                .iter()
                .take(5)
                .cloned()
                .collect::<Vec<_>>()
                .join(" ");
            if !settings.accept_lost_counts {
                return Err(GuardError::LostStore {
                    prefix: base.to_string(),
                    group: kafka.group.clone(),
                    topic: kafka.topic.clone(),
                    committed: shown,
                }
                .into());
            }
            warn!(
                committed = %shown,
                "Redis holds nothing for this prefix: counting from the group's committed offsets, as --accept-lost-counts says; every like before them is lost."
            );
        }
    }
    let proposed = Record::of_writer(&writer, wall_ms());
    // Windows are the keys tally gives an expiry, which volatile-* may evict:
    // checked before the record that names them is written.
    let keeps_windows =
        existing.as_ref().is_some_and(|r| !r.windows.is_empty()) || !proposed.windows.is_empty();
    if keeps_windows {
        tokio::task::block_in_place(|| guard::check_eviction(opened.target(), true))?;
    }
    let (record, written) = layout::ensure_record(&opened.store, base, &proposed).await?;
    if written {
        if data {
            warn!(
                key = %layout::record_key(base),
                buckets = record.buckets,
                slot_groups = record.slot_groups,
                group = %record.group,
                topic = %record.topic,
                found = %adoption_found(&survey),
                reads = %adoption_reads(&opened.keys, &record),
                "Adopted data written without a layout record: the record now holds this start's settings; every later start must repeat them."
            );
        } else {
            info!(
                key = %layout::record_key(base),
                buckets = record.buckets,
                slot_groups = record.slot_groups,
                "Layout record written."
            );
        }
    }
    layout::check_writer(opened, &writer, &record, generation).await?;
    Ok(record)
}

/// Refuses a server that would not keep the hashes of `packing` compact
/// (see [`guard::check_listpack`]) and records its limit; nothing for
/// string keys.
fn check_listpack(opened: &OpenStore, packing: &Packing) -> Result<(), GuardError> {
    let limit = match packing.is_packed() {
        true => tokio::task::block_in_place(|| {
            guard::check_listpack(opened.target(), packing.entries_needed(), LONGEST_FIELD)
        })?,
        false => 0,
    };
    crate::infra::metrics::packed_fill_limit(limit);
    Ok(())
}

/// The layout a writer with `settings` uses, as its prefix's record holds it.
pub fn writer_layout(settings: &RunSettings) -> WriterLayout {
    WriterLayout {
        buckets: settings.buckets,
        slot_groups: layout::slot_groups(&settings.store).count(),
        topic: settings.kafka.topic.clone(),
        group: settings.kafka.group.clone(),
        packing: Wanted::from_settings(&settings.packing),
        windows: settings
            .windows
            .as_ref()
            .map(crate::domain::windows::Windows::from_settings),
    }
}

/// What an adoption found under the prefix, for its log line.
fn adoption_found(survey: &Survey) -> String {
    let counters = match &survey.highest {
        Some((b, _)) => format!("{} version-0 counters, buckets up to {b}", survey.counters),
        None => "no version-0 counters".to_string(),
    };
    format!("fences of {}; {counters}", survey.fenced_text())
}

/// What a reader sums for each post after an adoption: the record's
/// version-0 buckets, then any versions of the post's own.
fn adoption_reads(keys: &KeyLayout, record: &Record) -> String {
    let last = record.buckets - 1;
    let tag = match keys.groups().tag(0) {
        Some(_) => ":{<tag>}",
        None => "",
    };
    let key = |b: u32| format!("{}:likes:<post>:{b}{tag}", keys.prefix());
    match last {
        0 => format!(
            "{} per post, plus its own versions (`tally inspect post <id>` lists them)",
            key(0)
        ),
        _ => format!(
            "{} buckets per post, {} to {}, plus its own versions (`tally inspect post <id>` lists them)",
            record.buckets,
            key(0),
            key(last)
        ),
    }
}

/// A live pipeline's view of the generation pointer; `None` for a pipeline
/// whose keys are fixed for the run.
async fn follow_pointer(
    opened: &OpenStore,
    settings: &RunSettings,
    mode: &Mode,
    shutdown: &CancellationToken,
) -> Result<Option<Following>, redis::RedisError> {
    if mode.fixed_generation.is_some() {
        return Ok(None);
    }
    let watch = GenerationWatch::start(
        opened.store.clone(),
        settings.store.prefix().to_string(),
        settings.hot.route_refresh,
        shutdown.child_token(),
    )
    .await?;
    Ok(Some(Following {
        current: watch.current().current,
        watch,
        frozen_since: None,
        refused_back: None,
        highest_recorded: false,
    }))
}

/// The dead-letter producer, after checking its topic exists.
fn dead_letters(
    consumer: &LikeConsumer,
    kafka: &KafkaSettings,
) -> Result<Option<Arc<DeadLetters>>, RunError> {
    let Some(topic) = &kafka.dead_letter_topic else {
        return Ok(None);
    };
    consume::check_topic(consumer, &kafka.brokers, topic, "dead-letter-topic")?;
    let producer: FutureProducer = kafka
        .secure_client_config()
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()?;
    Ok(Some(Arc::new(DeadLetters::new(
        producer,
        topic,
        &kafka.topic,
    ))))
}
