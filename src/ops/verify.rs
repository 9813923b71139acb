//! Verify: recount the topic in memory and compare it with the counts
//! readers get from the current generation.
//!
//! Invariant: a post's stored count is exactly the sum of the deltas of its
//! events from each partition's origin up to that partition's fence, because
//! counters and fences only ever move together, in one script. So `tally
//! verify` reads every (selected) partition from its origin to its fence in
//! the current generation, sums per post, reads the counts through
//! [`crate::read::Reader`], and reports every post where the two differ.
//! With `--dedupe`, each partition is walked from its origin through the
//! same window `tally run` decides repeats by (see
//! [`crate::pipeline::dedupe`]), so a skipped repeat is skipped here too.
//!
//! With live traffic the fences move while verify reads. Stop (or pause) the
//! live group for an exact answer in one pass; otherwise verify recounts up
//! to the fences read at start, reads the counts, reads the fences again, and
//! if they moved, extends the recount to the new fences and reads again,
//! until the fences read before and after the counts agree (at most
//! `--rounds` times). On a cluster a batch lands in its slot groups one
//! script at a time, so a partition whose groups disagree counts as moving.
//! `--partitions` narrows the recount; it only gives a meaningful answer
//! when the posts checked have all their events in those partitions (keyed
//! by post), since a count sums every partition.
//!
//! Windows of trending counts are recounted by the same rule as the live
//! consumer's (see [`crate::domain::windows`]), read in the same round as
//! the counts, and compared post by post and window by window, and so is
//! each window's trending list. A window whose set has expired, or expires
//! within a minute, is left out: its counts are gone by design.
//!
//! Retention deletes the oldest offsets of every long-lived topic, and the
//! counts keep their events. A partition whose origin lies below the log's
//! start is recounted from the start, and the offsets before it are reported
//! as [`Report::gone`]: what was counted from them cannot be checked, so the
//! differences found may be theirs. Offsets deleted while verify reads are
//! found the same way (the recount's consumer never resets on its own).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaErrorCode;
use rustc_hash::FxHashMap;

use crate::domain::placement::{scan_counters, scan_windows};
use crate::domain::routing::KeyLayout;
use crate::domain::versions::wall_ms;
use crate::domain::windows::{self, DEFAULT_TOP_K, Placed, Ranked, WindowSize, Windows};
use crate::infra::config::{RunSettings, with_fetch_settings};
use crate::infra::store::Target;
use crate::ops::{OpError, open_applier};
use crate::pipeline::apply::Applier;
use crate::pipeline::consume::check_topic;
use crate::pipeline::decode::Decoder;
use crate::pipeline::dedupe::{DedupeSettings, Window};
use crate::pipeline::guard;
use crate::read::{Count, Reader};

/// What to verify, besides the settings shared with `tally run`.
#[derive(Debug, Clone, Default)]
pub struct VerifyOptions {
    /// Check only these posts; when empty, every post with an event or a counter.
    pub posts: Vec<u64>,
    /// Recount only these partitions; when empty, all of them (see the module notes).
    pub partitions: Vec<i32>,
    /// How many times to re-read while the fences keep moving (at least 1).
    pub rounds: u32,
}

/// One post whose stored count differs from the recount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drift {
    /// The post.
    pub post_id: u64,
    /// The sum of its events up to the fences.
    pub expected: i64,
    /// What readers get.
    pub stored: i64,
}

/// What verify found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The generation checked.
    pub generation: u64,
    /// Its key prefix.
    pub prefix: String,
    /// Posts checked.
    pub posts: usize,
    /// Events recounted.
    pub events: u64,
    /// Partitions recounted.
    pub partitions: usize,
    /// Posts that differ, the largest difference first.
    pub drift: Vec<Drift>,
    /// Offsets up to the fences that the log no longer holds (retention
    /// deleted them), by partition and offset: the counts hold their events,
    /// and no recount can check them.
    pub gone: Vec<Gone>,
    /// Windows compared (one per size and start), and those left out as
    /// expired.
    pub windows: (usize, usize),
    /// Posts whose likes in a window differ from the recount.
    pub window_drift: Vec<WindowDrift>,
    /// Windows whose trending list differs from the recount's.
    pub top_drift: Vec<(WindowSize, i64)>,
    /// Entries the recount's dedupe windows dropped (see
    /// [`Window::forgotten`]): when not 0, the recount may judge a repeat
    /// otherwise than the live consumer did.
    pub dedupe_forgotten: u64,
    /// The prefix's dedupe rule, when it is not the one the recount judged
    /// by: the recount then reports as drift what the writers judged
    /// otherwise.
    pub other_rule: Option<OtherRule>,
}

/// A prefix's dedupe rule that is not the recount's (see
/// [`crate::pipeline::guard::rule_key`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtherRule {
    /// The key of the prefix's rule.
    pub key: String,
    /// What it holds.
    pub prefix: String,
    /// The rule the recount judged by, as the key would hold it.
    pub recount: String,
}

/// One post whose likes in one window differ from the recount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowDrift {
    /// The window's size.
    pub size: WindowSize,
    /// Its start (milliseconds since the epoch).
    pub start: i64,
    /// The post.
    pub post_id: u64,
    /// The sum of its likes in the window, by the rule.
    pub expected: i64,
    /// What the window's set holds.
    pub stored: i64,
}

/// A post's likes in one window: (size, start, post).
type Cell = (WindowSize, i64, u64);

/// Offsets `from..=to` of a partition, counted and deleted from the log since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone {
    /// The partition.
    pub partition: i32,
    /// First offset gone.
    pub from: i64,
    /// Last offset gone.
    pub to: i64,
}

/// The in-memory recount: positions reached and sums per post.
struct Recount {
    consumer: BaseConsumer,
    topic: String,
    /// Next offset to read per partition.
    next: HashMap<i32, i64>,
    sums: FxHashMap<u64, i64>,
    only: Option<BTreeSet<u64>>,
    events: u64,
    /// The rules `tally run` counts by.
    decoder: Decoder,
    /// Per partition, the dedupe window `tally run` decides repeats by,
    /// walked from the origin like the first owner's.
    dedupe: DedupeSettings,
    windows: HashMap<i32, Window>,
    /// The windows of trending counts the generation keeps, and the
    /// recount's likes in them.
    kept: Windows,
    window_sums: FxHashMap<Cell, i64>,
    /// Ranges the log no longer held when the recount reached them.
    gone: BTreeMap<i32, Vec<(i64, i64)>>,
}

impl Recount {
    /// Moves `partition`'s position to the log's start when retention
    /// deleted the offsets before it, and records them as gone.
    fn skip_deleted(&mut self, partition: i32) -> Result<(), OpError> {
        let (low, _) = self
            .consumer
            .fetch_watermarks(&self.topic, partition, Duration::from_secs(10))
            .map_err(OpError::kafka("reading the partition's watermarks"))?;
        let next = self.next[&partition];
        if next < low {
            let ranges = self.gone.entry(partition).or_default();
            match ranges.last_mut() {
                Some((_, to)) if *to + 1 == next => *to = low - 1,
                _ => ranges.push((next, low - 1)),
            }
            self.next.insert(partition, low);
        }
        Ok(())
    }

    /// Assigns `waiting`'s partitions at their positions.
    fn assign(&self, waiting: &HashMap<i32, i64>) -> Result<(), OpError> {
        let mut tpl = TopicPartitionList::new();
        for &p in waiting.keys() {
            tpl.add_partition_offset(&self.topic, p, Offset::Offset(self.next[&p]))
                .map_err(OpError::kafka("positioning the recount"))?;
        }
        self.consumer
            .assign(&tpl)
            .map_err(OpError::kafka("assigning the recount's partitions"))
    }

    /// Reads every partition on from where it stands up to `fences` (inclusive).
    fn extend(&mut self, fences: &HashMap<i32, i64>) -> Result<(), OpError> {
        let mut waiting: HashMap<i32, i64> = fences
            .iter()
            .filter(|&(p, &f)| self.next.get(p).is_some_and(|&n| n <= f))
            .map(|(&p, &f)| (p, f))
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        self.assign(&waiting)?;
        let mut heard = Instant::now();
        while !waiting.is_empty() {
            let Some(polled) = self.consumer.poll(Duration::from_millis(200)) else {
                if heard.elapsed() > Duration::from_secs(30) {
                    return Err(OpError::Refused(format!(
                        "no events for 30 s while recounting partitions {waiting:?} (partition: last fence)"
                    )));
                }
                continue;
            };
            // A position retention deleted meanwhile: librdkafka names no
            // partition, so every waiting one is placed in its log again.
            if let Err(error) = &polled
                && error.rdkafka_error_code() == Some(RDKafkaErrorCode::AutoOffsetReset)
            {
                let before: Vec<i64> = waiting.keys().map(|p| self.next[p]).collect();
                for p in waiting.keys().copied().collect::<Vec<_>>() {
                    self.skip_deleted(p)?;
                }
                if waiting.keys().map(|p| self.next[p]).eq(before) {
                    return Err(OpError::Refused(format!(
                        "the brokers reset a position of the recount ({error}) that their log start does not explain; verify again"
                    )));
                }
                waiting.retain(|p, up_to| self.next[p] <= *up_to);
                self.assign(&waiting)?;
                heard = Instant::now();
                continue;
            }
            let message = polled.map_err(OpError::kafka("reading the topic"))?;
            heard = Instant::now();
            let (p, offset) = (message.partition(), message.offset());
            let Some(&up_to) = waiting.get(&p) else {
                continue;
            };
            if offset < self.next[&p] {
                continue;
            }
            if offset <= up_to {
                self.events += 1;
                let timestamp = message.timestamp().to_millis().unwrap_or(0);
                let window = self
                    .windows
                    .entry(p)
                    .or_insert_with(|| Window::new(self.dedupe, None));
                if let Ok((like, id)) = self.decoder.identified(message.payload(), timestamp)
                    && window.observe(offset, timestamp, &like, id).is_none()
                    && self.only.as_ref().is_none_or(|o| o.contains(&like.post_id))
                {
                    *self.sums.entry(like.post_id).or_insert(0) += like.delta;
                    for &size in self.kept.sizes() {
                        if let Some(Placed::In(start)) =
                            self.kept.place(size, like.event_time_ms, timestamp)
                        {
                            *self
                                .window_sums
                                .entry((size, start, like.post_id))
                                .or_insert(0) += like.delta;
                        }
                    }
                }
                self.next.insert(p, offset + 1);
            }
            if offset >= up_to {
                waiting.remove(&p);
            }
        }
        self.consumer
            .unassign()
            .map_err(OpError::kafka("ending the recount"))?;
        Ok(())
    }
}

/// The fence each partition has applied to in `applier`'s generation, with
/// its origin; `None` for a partition never counted there, and an error
/// string when its slot groups disagree (a batch is landing).
async fn fences(
    applier: &Applier,
    partitions: &[i32],
) -> Result<Result<HashMap<i32, (i64, i64)>, String>, OpError> {
    let mut out = HashMap::new();
    for &p in partitions {
        let found = applier.read_fences(p).await?;
        if let Some((origin, tracker)) = found.tracker() {
            if tracker.resume_at() - 1 != tracker.highest() {
                return Ok(Err(format!("partition {p}'s slot groups disagree")));
            }
            out.insert(p, (origin, tracker.highest()));
        }
    }
    Ok(Ok(out))
}

/// Recounts the topic up to the fences and compares every post's count.
pub async fn verify(settings: RunSettings, options: VerifyOptions) -> Result<Report, OpError> {
    let (opened, applier, epoch0) = open_applier(&settings).await?;
    let kafka = &settings.kafka;
    let reader = Reader::new(
        opened.store.clone(),
        opened.keys.clone(),
        epoch0,
        Duration::ZERO,
    );
    let (current, layout) = reader.layout().await?;
    let applier = applier.with_keys(layout.clone());
    let rule_key = guard::rule_key(settings.store.prefix());
    let held = guard::read_rule(&opened.store, &rule_key).await?;
    let recount_rule = guard::rule_text(settings.dedupe);
    let other_rule = held
        .filter(|held| *held != recount_rule)
        .map(|prefix| OtherRule {
            key: rule_key,
            prefix,
            recount: recount_rule,
        });
    let mut config = kafka.secure_client_config();
    let consumer: BaseConsumer = with_fetch_settings(&mut config)
        .set("enable.partition.eof", "false")
        .set("enable.auto.commit", "false")
        // A position retention deleted is an error to report, never a jump
        // to either end of the log.
        .set("auto.offset.reset", "error")
        // Never joins the group nor commits; librdkafka wants a name to assign.
        .set("group.id", format!("{}-verify", kafka.group))
        .create()
        .map_err(OpError::kafka("creating the Kafka client"))?;
    let count = check_topic(&consumer, &kafka.brokers, &kafka.topic, "topic")?;
    let partitions: Vec<i32> = if options.partitions.is_empty() {
        (0..count as i32).collect()
    } else {
        options.partitions.clone()
    };
    let only = (!options.posts.is_empty()).then(|| options.posts.iter().copied().collect());
    let mut recount = Recount {
        consumer,
        topic: kafka.topic.clone(),
        next: HashMap::new(),
        sums: FxHashMap::default(),
        only,
        events: 0,
        decoder: Decoder::new(&settings.schema_ids),
        dedupe: settings.dedupe,
        windows: HashMap::new(),
        kept: layout.windows().clone(),
        window_sums: FxHashMap::default(),
        gone: BTreeMap::new(),
    };
    let rounds = options.rounds.max(1);
    let (settled, stored_windows, fences) =
        settle(&mut recount, &applier, &reader, (current, &layout), &partitions, rounds)
            .await?
            .ok_or_else(|| {
            OpError::Refused(format!(
                "the fences kept moving over {rounds} rounds; pause the live group (or stop it) and verify again"
            ))
        })?;
    let mut drift: Vec<Drift> = settled
        .iter()
        .map(|c| Drift {
            post_id: c.post_id,
            expected: recount.sums.get(&c.post_id).copied().unwrap_or(0),
            stored: c.likes,
        })
        .filter(|d| d.expected != d.stored)
        .collect();
    drift.sort_by_key(|d| (std::cmp::Reverse((d.stored - d.expected).abs()), d.post_id));
    let compared = compare_windows(&recount, &stored_windows, wall_ms());
    let top_drift = match recount.only {
        // The leaders of some posts say nothing of a window's list.
        Some(_) => Vec::new(),
        None => top_drift(&reader, &compared.expected, &compared.live).await?,
    };
    Ok(Report {
        generation: current,
        prefix: layout.prefix().to_string(),
        posts: settled.len(),
        events: recount.events,
        partitions: partitions.len(),
        drift,
        gone: gone_up_to(&recount.gone, &fences),
        windows: (compared.live.len(), compared.expired),
        window_drift: compared.drift,
        top_drift,
        dedupe_forgotten: recount.windows.values().map(Window::forgotten).sum(),
        other_rule,
    })
}

/// The recount's windows beside the stored ones.
struct Compared {
    /// The windows compared: kept, and not expiring within a minute.
    live: BTreeSet<(WindowSize, i64)>,
    /// Windows left out as expired.
    expired: usize,
    /// The recount's non-zero likes in the live windows.
    expected: BTreeMap<Cell, i64>,
    drift: Vec<WindowDrift>,
}

/// Compares the recount's windows with `stored` at `now_ms`.
fn compare_windows(recount: &Recount, stored: &BTreeMap<Cell, i64>, now_ms: i64) -> Compared {
    let kept = &recount.kept;
    let all: BTreeSet<(WindowSize, i64)> = recount
        .window_sums
        .keys()
        .chain(stored.keys())
        .map(|&(size, start, _)| (size, start))
        .collect();
    let (live, expired): (BTreeSet<_>, BTreeSet<_>) = all
        .into_iter()
        .partition(|&(size, start)| kept.expires_at(size, start) > now_ms + 60_000);
    let wanted = |post: u64| recount.only.as_ref().is_none_or(|o| o.contains(&post));
    let expected: BTreeMap<Cell, i64> = recount
        .window_sums
        .iter()
        .filter(|&(&(size, start, post), &likes)| {
            likes != 0 && live.contains(&(size, start)) && wanted(post)
        })
        .map(|(&cell, &likes)| (cell, likes))
        .collect();
    let found: BTreeMap<Cell, i64> = stored
        .iter()
        .filter(|&(&(size, start, post), &likes)| {
            likes != 0 && live.contains(&(size, start)) && wanted(post)
        })
        .map(|(&cell, &likes)| (cell, likes))
        .collect();
    let cells: BTreeSet<Cell> = expected.keys().chain(found.keys()).copied().collect();
    let drift = cells
        .into_iter()
        .filter_map(|cell| {
            let (e, f) = (
                expected.get(&cell).copied().unwrap_or(0),
                found.get(&cell).copied().unwrap_or(0),
            );
            (e != f).then_some(WindowDrift {
                size: cell.0,
                start: cell.1,
                post_id: cell.2,
                expected: e,
                stored: f,
            })
        })
        .collect();
    Compared {
        live,
        expired: expired.len(),
        expected,
        drift,
    }
}

/// The live windows whose trending list, as readers get it, differs from
/// the recount's leaders.
async fn top_drift(
    reader: &Reader,
    expected: &BTreeMap<Cell, i64>,
    live: &BTreeSet<(WindowSize, i64)>,
) -> Result<Vec<(WindowSize, i64)>, OpError> {
    let mut differ = Vec::new();
    for &(size, start) in live {
        let mut leaders: Vec<Ranked> = expected
            .range((size, start, 0)..=(size, start, u64::MAX))
            .map(|(&(_, _, post_id), &likes)| Ranked { post_id, likes })
            .filter(|r| r.likes > 0)
            .collect();
        leaders.sort_unstable_by(windows::rank_order);
        leaders.truncate(DEFAULT_TOP_K);
        let listed = reader.trending(size, Some(start), DEFAULT_TOP_K).await?;
        if listed.posts != leaders {
            differ.push((size, start));
        }
    }
    Ok(differ)
}

/// The ranges gone from the log, cut at each partition's fence (offsets
/// past it hold nothing the counts have).
fn gone_up_to(gone: &BTreeMap<i32, Vec<(i64, i64)>>, fences: &HashMap<i32, i64>) -> Vec<Gone> {
    gone.iter()
        .flat_map(|(&partition, ranges)| {
            let fence = fences.get(&partition).copied().unwrap_or(-1);
            ranges
                .iter()
                .filter(move |&&(from, _)| from <= fence)
                .map(move |&(from, to)| Gone {
                    partition,
                    from,
                    to: to.min(fence),
                })
        })
        .collect()
}

/// Extends the recount to the fences and reads the counts, until the fences
/// read before and after the counts agree; returns the counts and those
/// fences, or `None` when they kept moving for `rounds` rounds.
async fn settle(
    recount: &mut Recount,
    applier: &Applier,
    reader: &Reader,
    (current, layout): (u64, &KeyLayout),
    partitions: &[i32],
    rounds: u32,
) -> Result<Option<Settled>, OpError> {
    let mut before = fences(applier, partitions).await?;
    for _ in 0..rounds {
        let Ok(read) = before.clone() else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            before = fences(applier, partitions).await?;
            continue;
        };
        let up_to: HashMap<i32, i64> = read.iter().map(|(&p, &(_, f))| (p, f)).collect();
        tokio::task::block_in_place(|| {
            for (&p, &(origin, fence)) in &read {
                recount.next.entry(p).or_insert(origin);
                if recount.next[&p] <= fence {
                    recount.skip_deleted(p)?;
                }
            }
            recount.extend(&up_to)
        })?;
        let posts: Vec<u64> = match &recount.only {
            Some(only) => only.iter().copied().collect(),
            None => {
                let mut all: BTreeSet<u64> = recount.sums.keys().copied().collect();
                all.extend(stored_posts(applier.fence_reader().target(), layout).await?);
                all.into_iter().collect()
            }
        };
        let counts = reader.counts(&posts).await?;
        let stored_windows = match layout.windows().is_empty() {
            true => BTreeMap::new(),
            false => stored_windows(applier.fence_reader().target(), layout).await?,
        };
        let after = fences(applier, partitions).await?;
        if reader.layout().await?.0 != current {
            return Err(OpError::Refused(
                "the generation changed while verifying; run verify again".into(),
            ));
        }
        if after.as_ref().ok() == Some(&read) {
            return Ok(Some((counts, stored_windows, up_to)));
        }
        before = after;
    }
    Ok(None)
}

/// What a settled round read: the counts, the windows, and the fences.
type Settled = (Vec<Count>, BTreeMap<Cell, i64>, HashMap<i32, i64>);

/// Every post's likes in every window set of the generation of `layout`.
async fn stored_windows(
    target: &Target,
    layout: &KeyLayout,
) -> Result<BTreeMap<Cell, i64>, OpError> {
    let (target, layout) = (target.clone(), layout.clone());
    tokio::task::spawn_blocking(move || {
        let mut found = BTreeMap::new();
        scan_windows(&target, &layout, |size, start, post, likes| {
            found.insert((size, start, post), likes);
        })?;
        Ok(found)
    })
    .await?
}

/// Posts with a counter key in the generation of `layout`.
async fn stored_posts(target: &Target, layout: &KeyLayout) -> Result<BTreeSet<u64>, OpError> {
    let (target, layout) = (target.clone(), layout.clone());
    tokio::task::spawn_blocking(move || {
        let mut posts = BTreeSet::new();
        scan_counters(&target, &layout, |id, _| {
            posts.insert(id.post_id);
        })?;
        Ok(posts)
    })
    .await?
}
