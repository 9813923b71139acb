//! Commit: tell Kafka how far Redis is, after Redis has it.
//!
//! Invariant: an offset is committed only after the script covering it
//! succeeded, and the committed value is `last + 1` (the next offset to read,
//! as Kafka defines it). The consumer stores that offset once the script
//! answered, and librdkafka commits what is stored every
//! [`COMMIT_INTERVAL_MS`](crate::pipeline::consume::COMMIT_INTERVAL_MS), when
//! a partition is revoked, and at close; nothing is ever stored before its
//! script succeeded, so nothing else can be committed. (Stored offsets rather
//! than a manual asynchronous commit: only the consumer's own commits report
//! back to its commit callback, which times the `commit` stage.) `last` may be a transaction marker: a range the
//! consumer passed without a message is applied as nothing and committed
//! like any other, so a partition whose log ends with a marker is committed
//! to its end. Commits are a hint and the lag signal: a lost or late commit
//! only means a new owner re-reads a little and the fence discards it.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tracing::{debug, warn};

use crate::pipeline::consume::LikeConsumer;

/// Tracks applied positions and commits them.
#[derive(Debug, Default)]
pub struct Committer {
    topic: String,
    applied: HashMap<i32, i64>,
}

impl Committer {
    /// A committer for one topic.
    pub fn new(topic: &str) -> Self {
        Self {
            topic: topic.to_string(),
            applied: HashMap::new(),
        }
    }

    /// Records that everything through `last` of `partition` is in Redis and
    /// stores `last + 1` for the consumer's next commit, unless it is stored
    /// already.
    pub fn applied(&mut self, consumer: &LikeConsumer, partition: i32, last: i64) {
        let next = last + 1;
        // A probe confirms the same offset every second; it is stored once.
        if self.applied.insert(partition, next) == Some(next) {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        if tpl
            .add_partition_offset(&self.topic, partition, Offset::Offset(next))
            .is_err()
        {
            return;
        }
        // Refused for a partition this consumer no longer owns: its new owner
        // commits it.
        match consumer.store_offsets(&tpl) {
            Ok(()) => consumer.context().commit_queued(partition, next),
            Err(error) => debug!(partition, next, %error, "Offset not stored for commit."),
        }
    }

    /// Forgets a partition this consumer no longer owns.
    pub fn forget(&mut self, partition: i32) {
        self.applied.remove(&partition);
    }

    /// Commits every known position synchronously (at shutdown).
    pub fn commit_all(&self, consumer: &LikeConsumer) {
        if self.applied.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for (&partition, &next) in &self.applied {
            let _ = tpl.add_partition_offset(&self.topic, partition, Offset::Offset(next));
        }
        if let Err(error) = consumer.commit(&tpl, CommitMode::Sync) {
            crate::infra::metrics::commit_failed();
            warn!(%error, "Final offset commit failed; the next owner resumes from the fences.");
        }
        // Give librdkafka a moment to flush an async commit still queued.
        std::thread::sleep(Duration::from_millis(10));
    }
}
