//! Verify: recount the topic in memory and compare it with the counts
//! readers get from the current generation.
//!
//! Invariant: a post's stored count is exactly the sum of the deltas of its
//! events from each partition's origin up to that partition's fence, because
//! counters and fences only ever move together, in one script. So `tally
//! verify` reads every (selected) partition from its origin to its fence in
//! the current generation, sums per post, reads the counts through
//! [`crate::read::Reader`], and reports every post where the two differ.
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

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rustc_hash::FxHashMap;

use crate::apply::Applier;
use crate::config::RunConfig;
use crate::decode::decode;
use crate::read::Reader;
use crate::routing::KeyLayout;
use crate::store::Target;

/// Settings of `tally verify` besides those it shares with `tally run`.
#[derive(Debug, Clone, Args)]
pub struct VerifyArgs {
    /// Check only these posts (comma separated); by default every post with
    /// an event or a counter.
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    pub posts: Vec<u64>,
    /// Recount only these partitions (comma separated); see the module notes.
    #[arg(long, value_delimiter = ',', value_name = "PARTITIONS")]
    pub partitions: Vec<i32>,
    /// How many times to re-read while the fences keep moving.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
}

/// What verify found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The table and a summary, to print.
    pub text: String,
    /// Posts whose stored count differs from the recount.
    pub drifted: usize,
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
}

impl Recount {
    /// Reads every partition on from where it stands up to `fences` (inclusive).
    fn extend(&mut self, fences: &HashMap<i32, i64>) -> Result<()> {
        let behind: Vec<(i32, i64)> = fences
            .iter()
            .filter(|&(p, &f)| self.next.get(p).is_some_and(|&n| n <= f))
            .map(|(&p, &f)| (p, f))
            .collect();
        if behind.is_empty() {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        for &(p, _) in &behind {
            tpl.add_partition_offset(&self.topic, p, Offset::Offset(self.next[&p]))?;
        }
        self.consumer.assign(&tpl)?;
        let mut waiting: HashMap<i32, i64> = behind.into_iter().collect();
        let mut heard = Instant::now();
        while !waiting.is_empty() {
            let Some(polled) = self.consumer.poll(Duration::from_millis(200)) else {
                if heard.elapsed() > Duration::from_secs(30) {
                    bail!(
                        "no events for 30 s while recounting partitions {waiting:?} (partition: last fence)"
                    );
                }
                continue;
            };
            let message = polled.context("reading the topic")?;
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
                if let Ok(like) = decode(message.payload())
                    && self.only.as_ref().is_none_or(|o| o.contains(&like.post_id))
                {
                    *self.sums.entry(like.post_id).or_insert(0) += like.delta;
                }
                self.next.insert(p, offset + 1);
            }
            if offset >= up_to {
                waiting.remove(&p);
            }
        }
        self.consumer.unassign()?;
        Ok(())
    }
}

/// The fence each partition has applied to in `applier`'s generation, with
/// its origin; `None` for a partition never counted there, and an error
/// string when its slot groups disagree (a batch is landing).
async fn fences(
    applier: &Applier,
    partitions: &[i32],
) -> Result<Result<HashMap<i32, (i64, i64)>, String>> {
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

/// Runs `tally verify`.
pub async fn verify_command(config: RunConfig, args: VerifyArgs) -> Result<Report> {
    let (target, base, applier) = crate::rebuild::connect_base(&config).await?;
    let store = applier.store().clone();
    let reader = Reader::new(store.clone(), base.clone(), config.buckets, Duration::ZERO);
    let (current, layout) = reader.layout().await?;
    let applier = applier.with_keys(layout.clone());

    let consumer: BaseConsumer =
        crate::consume::client_config(&config.brokers, &config.kafka_security())
            .set("enable.partition.eof", "false")
            .set("enable.auto.commit", "false")
            // Never joins the group nor commits; librdkafka wants a name to assign.
            .set("group.id", format!("{}-verify", config.group))
            .create()
            .context("creating the Kafka client")?;
    let count = crate::consume::check_topic(&consumer, &config.brokers, &config.topic, "topic")?;
    let partitions: Vec<i32> = if args.partitions.is_empty() {
        (0..count as i32).collect()
    } else {
        args.partitions.clone()
    };
    let only = (!args.posts.is_empty()).then(|| args.posts.iter().copied().collect());
    let mut recount = Recount {
        consumer,
        topic: config.topic.clone(),
        next: HashMap::new(),
        sums: FxHashMap::default(),
        only,
        events: 0,
    };

    let mut before = fences(&applier, &partitions).await?;
    let mut settled = None;
    for _ in 0..args.rounds.max(1) {
        let Ok(read) = before.clone() else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            before = fences(&applier, &partitions).await?;
            continue;
        };
        for (&p, &(origin, _)) in &read {
            recount.next.entry(p).or_insert(origin);
        }
        let up_to: HashMap<i32, i64> = read.iter().map(|(&p, &(_, f))| (p, f)).collect();
        tokio::task::block_in_place(|| recount.extend(&up_to))?;
        let posts: Vec<u64> = match &recount.only {
            Some(only) => only.iter().copied().collect(),
            None => {
                let mut all: BTreeSet<u64> = recount.sums.keys().copied().collect();
                all.extend(stored_posts(&target, &layout).await?);
                all.into_iter().collect()
            }
        };
        let counts = reader.counts(&posts).await?;
        let after = fences(&applier, &partitions).await?;
        if reader.layout().await?.0 != current {
            bail!("the generation changed while verifying; run verify again");
        }
        if after.as_ref().ok() == Some(&read) {
            settled = Some(counts);
            break;
        }
        before = after;
    }
    let Some(counts) = settled else {
        bail!(
            "the fences kept moving over {} rounds; pause the live group (or stop it) and verify again",
            args.rounds
        );
    };
    let mut drift: Vec<(u64, i64, i64)> = counts
        .iter()
        .map(|c| {
            let expected = recount.sums.get(&c.post_id).copied().unwrap_or(0);
            (c.post_id, expected, c.likes)
        })
        .filter(|&(_, expected, stored)| expected != stored)
        .collect();
    drift.sort_by_key(|&(post, e, s)| (std::cmp::Reverse((s - e).abs()), post));
    let mut text = String::new();
    if !drift.is_empty() {
        let _ = writeln!(
            text,
            "{:>20}  {:>14}  {:>14}  {:>12}",
            "post", "expected", "stored", "difference"
        );
        for &(post, expected, stored) in &drift {
            let _ = writeln!(
                text,
                "{post:>20}  {expected:>14}  {stored:>14}  {:>+12}",
                stored - expected
            );
        }
    }
    let _ = writeln!(
        text,
        "generation {current} ({}): {} posts checked against {} events of {} partitions; {} drift",
        layout.prefix(),
        counts.len(),
        recount.events,
        partitions.len(),
        drift.len()
    );
    Ok(Report {
        text,
        drifted: drift.len(),
    })
}

/// Posts with a counter key in the generation of `layout`.
async fn stored_posts(target: &Target, layout: &KeyLayout) -> Result<BTreeSet<u64>> {
    let (target, layout) = (target.clone(), layout.clone());
    tokio::task::spawn_blocking(move || {
        let mut posts = BTreeSet::new();
        let pattern = format!("{}:likes:*", layout.prefix());
        crate::gc::scan(&target, &pattern, |_, keys| {
            posts.extend(
                keys.iter()
                    .filter_map(|k| layout.parse_counter_key(k))
                    .map(|id| id.post_id),
            );
            Ok(())
        })?;
        Ok(posts)
    })
    .await?
}
