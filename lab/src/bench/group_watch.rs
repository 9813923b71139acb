//! Following a consumer group through the offsets it has committed, read from the broker alone:
//! tally's, a naive consumer's, or a Kafka Streams application's.
//!
//! A group has caught up when its committed offsets are at the end, read `read_committed`, of
//! every topic it reads, seen twice a commit interval apart. A followed consumer that exits, or
//! that commits nothing new for [`STALL`], ends the watch with an error.

use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::services::cpu_secs;

/// How often Kafka Streams commits under exactly_once_v2 (its default, which the peer keeps).
pub(super) const COMMIT_INTERVAL: Duration = Duration::from_millis(100);

/// How long a followed consumer may commit nothing new before the benchmark gives up.
const STALL: Duration = Duration::from_secs(180);

/// Watches a consumer's committed progress: fails when its process has exited, or when
/// nothing more was committed for [`STALL`].
struct Stall<'a> {
    what: &'a str,
    total: u64,
    last: u64,
    last_progress: Instant,
}

impl<'a> Stall<'a> {
    fn new(what: &'a str, total: u64) -> Self {
        Stall {
            what,
            total,
            last: u64::MAX,
            last_progress: Instant::now(),
        }
    }

    fn check(&mut self, done: u64, child: &mut Child) -> Result<()> {
        let (what, total) = (self.what, self.total);
        if done != self.last {
            (self.last_progress, self.last) = (Instant::now(), done);
        }
        if let Ok(Some(status)) = child.try_wait() {
            bail!("{what} exited ({status}) at {done} of {total} events");
        }
        if self.last_progress.elapsed() > STALL {
            bail!(
                "{what} committed nothing for {} s at {done} of {total} events",
                STALL.as_secs()
            );
        }
        Ok(())
    }
}

/// When a followed group's committed input offsets were first seen to move.
pub(super) struct First {
    pub at: Instant,
    /// Input events committed then.
    pub committed: u64,
    /// CPU seconds each process asked for had used then.
    pub cpu: Vec<Option<f64>>,
}

/// Follows a consumer group through the offsets it has committed: tally's, a naive
/// consumer's, or a Kafka Streams application's.
pub(super) struct GroupWatch {
    /// Reads the group's committed offsets, never the pending ones of an open transaction.
    offsets: BaseConsumer,
    /// Reads each partition's end as a `read_committed` consumer sees it.
    ends: BaseConsumer,
    /// The input topic, then any topic the group also reads (Kafka Streams' repartition topic).
    topics: Vec<(String, u32)>,
}

impl GroupWatch {
    /// A watch on `group`'s offsets of `topics` (the first is the input).
    pub fn new(brokers: &str, group: &str, topics: Vec<(String, u32)>) -> Result<Self> {
        let config = |group: &str, isolation: &str| {
            tally::infra::config::kafka_client_config(brokers, &[])
                .set("group.id", group)
                .set("enable.auto.commit", "false")
                .set("isolation.level", isolation)
                .create::<BaseConsumer>()
        };
        Ok(Self {
            offsets: config(group, "read_uncommitted")?,
            ends: config("tally-bench-watermarks", "read_committed")?,
            topics,
        })
    }

    /// The group's committed offset of each partition of `topic` (`None`: nothing committed).
    fn committed(&self, topic: &str, partitions: u32) -> Result<Vec<Option<i64>>> {
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions as i32 {
            tpl.add_partition(topic, p);
        }
        let got = self
            .offsets
            .committed_offsets(tpl, Duration::from_secs(10))?;
        Ok((0..partitions as i32)
            .map(|p| match got.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(offset)) => Some(offset),
                _ => None,
            })
            .collect())
    }

    /// Input events the group has committed, given the input's `[low, high)` marks.
    pub fn progress(&self, marks: &[(i64, i64)]) -> Result<u64> {
        let (topic, partitions) = &self.topics[0];
        Ok(self
            .committed(topic, *partitions)?
            .iter()
            .zip(marks)
            .map(|(offset, &(low, high))| {
                offset.map_or(0, |offset| (offset.min(high) - low).max(0) as u64)
            })
            .sum())
    }

    /// Whether the group's committed offsets are at the end of every topic it reads.
    pub fn at_end(&self) -> Result<bool> {
        for (topic, partitions) in &self.topics {
            let committed = self.committed(topic, *partitions)?;
            for (p, offset) in committed.iter().enumerate() {
                let Ok((low, high)) =
                    self.ends
                        .fetch_watermarks(topic, p as i32, Duration::from_secs(10))
                else {
                    return Ok(false);
                };
                if offset.unwrap_or(low) < high {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Polls until the group is at the end of every topic, seen twice a commit interval apart.
    /// Returns the moment the input's committed offsets were first seen to move, with the CPU
    /// seconds each of `pids` had used then, and when the group was first seen at the end.
    pub fn until_caught_up(
        &self,
        marks: &[(i64, i64)],
        child: &mut Child,
        what: &str,
        pids: &[&str],
    ) -> Result<(Option<First>, Instant)> {
        let total: u64 = marks.iter().map(|&(low, high)| (high - low) as u64).sum();
        let mut first: Option<First> = None;
        let mut watch = Stall::new(what, total);
        loop {
            let done = self.progress(marks)?;
            let now = Instant::now();
            if first.is_none() && done > 0 {
                first = Some(First {
                    at: now,
                    committed: done,
                    cpu: pids.iter().map(|pid| cpu_secs(pid)).collect(),
                });
            }
            if done >= total && self.at_end()? {
                std::thread::sleep(COMMIT_INTERVAL + Duration::from_millis(50));
                if self.at_end()? {
                    return Ok((first, now));
                }
            }
            watch.check(done, child)?;
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls until the group has committed at least half of the input; returns what it had.
    pub fn until_half(&self, marks: &[(i64, i64)], child: &mut Child, what: &str) -> Result<u64> {
        let total: u64 = marks.iter().map(|&(low, high)| (high - low) as u64).sum();
        let mut watch = Stall::new(what, total);
        loop {
            let done = self.progress(marks)?;
            if done * 2 >= total {
                return Ok(done);
            }
            watch.check(done, child)?;
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
