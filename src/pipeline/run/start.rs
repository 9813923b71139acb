//! Start: what `tally run` checks before its consumer subscribes, and the
//! parts the loop is built from.
//!
//! Invariant: nothing is written and nothing fetched before the checks that
//! can refuse the start have passed: every partition's fences lie inside its
//! log, the prefix's layout record matches the settings (or is written on a
//! first start, adopting data written without one), a store that lost
//! everything under a group with committed offsets is refused unless the loss
//! is accepted, a server that would not keep a packed generation's hashes
//! compact is refused before the record names that packing, and a
//! dead-letter topic exists.

use std::sync::Arc;

use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Following, Mode, RunError};
use crate::domain::generation::GenerationWatch;
use crate::domain::layout::adopt::{self, Survey};
use crate::domain::layout::{self, LayoutError, OpenStore, Record, WriterLayout};
use crate::domain::packing::{LONGEST_FIELD, Packing, Wanted};
use crate::domain::routing::KeyLayout;
use crate::domain::versions::wall_ms;
use crate::infra::config::{DEFAULT_BUCKETS, KafkaSettings, RunSettings};
use crate::infra::store::{ConnectError, stray_detail};
use crate::pipeline::apply::Applier;
use crate::pipeline::consume::{self, LikeConsumer};
use crate::pipeline::dead_letter::DeadLetters;
use crate::pipeline::guard::{self, GuardError};

/// Checks every partition's fences against its log (see [`guard`]), once,
/// before the consumer fetches anything: the broker is asked for the
/// watermarks while nothing else of this consumer is in flight. A fence
/// ahead of its log stops the start; every assignment checks again (see
/// [`consume`]), and reports what retention deleted.
pub(super) async fn check_logs(
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
pub(super) struct FirstStart<'a> {
    pub(super) consumer: &'a LikeConsumer,
    pub(super) partitions: usize,
    /// `tally run` itself (a rebuild reads with a group of its own).
    pub(super) live: bool,
}

/// Writes the prefix's layout record on the first start (adopting what an
/// earlier version wrote without one), refuses settings that differ from it,
/// and returns it. A store with no record and no data under a group that has
/// committed offsets lost everything: refused, unless the loss is accepted.
pub(super) async fn check_layout(
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
    let limit = match packing.packed() {
        Some(packed) => tokio::task::block_in_place(|| {
            guard::check_listpack(opened.target(), packed.entries_needed(), LONGEST_FIELD)
        })?,
        None => 0,
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
pub(super) async fn follow_pointer(
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
pub(super) fn dead_letters(
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
