//! Batches: when a partition's batch is sent, and what the reply to it does
//! to the partition.
//!
//! Invariants kept here:
//! * per partition, at most one batch is in flight, and it is sent only when
//!   no seek is pending and no freeze holds; the scripts of one batch run
//!   concurrently, and so do batches of different partitions, up to
//!   `--max-in-flight`;
//! * an empty batch sends, as a range of their own, only the offsets below a
//!   position under which every message is in a batch already (the
//!   consumer's, or the partition's reader's): offsets that held no message;
//! * a batch's end is stored for the commit only when every slot group's
//!   fence continues it, and only by the ownership that read it; any other
//!   reply drops the partition's buffer and sends the consumer to the lowest
//!   fence;
//! * a batch of a partition catching up stays open for up to ten flush
//!   intervals, so that its counters merge more events.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::topic_partition_list::Offset;
use tracing::{debug, info, warn};

use super::intake::{self, Owned};
use super::scripts::{Done, Finished, Job, plan};
use super::{Following, PROBE_EVERY, Pipeline, RunError};
use crate::domain::fence::Decision;
use crate::infra::metrics;
use crate::pipeline::aggregate::ClosedBatch;
use crate::pipeline::apply::ApplyError;

/// A partition whose log holds this many messages past what the consumer has
/// read is catching up: its batches are sent when full, or at
/// [`BEHIND_FLUSH_FACTOR`] times the flush interval. Far above what a
/// partition keeps up with between two fetches, far below a backlog.
const BEHIND_BY: i64 = 10_000;

/// How many flush intervals a batch of a partition catching up may stay open.
const BEHIND_FLUSH_FACTOR: u32 = 10;

/// Says which slot groups' fences do not continue a batch.
fn warn_discontinued(
    (partition, start, last): (i32, i64, i64),
    replies: &[(u32, crate::domain::fence::Reply, usize)],
    resume: i64,
) {
    let found: Vec<String> = replies
        .iter()
        .filter(|(_, r, _)| r.fence != last && r.decision != Decision::Apply)
        .map(|(g, r, _)| format!("{g}:{:?}@{}", r.decision, r.fence))
        .collect();
    warn!(partition, start, last, resume, groups = %found.join(" "), "Fences do not continue this batch; re-reading from the lowest.");
}

/// Whether a batch `age` old is sent, for a partition whose next offset to
/// read is `next` and whose log ends where `end` says: at `flush_after`, or at
/// [`BEHIND_FLUSH_FACTOR`] times it while the log holds [`BEHIND_BY`] or more
/// unread messages. An unknown end or position counts as caught up.
fn sends_at(
    age: Duration,
    flush_after: Duration,
    next: Option<i64>,
    end: impl FnOnce() -> Option<i64>,
) -> bool {
    if age < flush_after {
        return false;
    }
    if age >= flush_after * BEHIND_FLUSH_FACTOR {
        return true;
    }
    match (next, end()) {
        (Some(next), Some(end)) => end - next < BEHIND_BY,
        _ => true,
    }
}

impl Pipeline {
    /// Dispatches every batch that is full or old enough (or any, when
    /// flushing), and probes the fences of partitions that are caught up.
    pub(super) fn dispatch_ready(&mut self, flush_all: bool) {
        let mut ready = Vec::new();
        let mut probing = false;
        for (&p, slot) in &self.owned {
            let s = slot.lock();
            let due = !self.busy.contains(&p)
                && !s.fence_ahead
                && if s.batch.is_empty() {
                    !flush_all && s.known.is_some() && s.verified_at.elapsed() >= PROBE_EVERY
                } else {
                    flush_all || s.batch.is_full(&self.limits) || self.old_enough(p, &s)
                };
            if due {
                probing |= s.batch.is_empty() && !s.read_apart;
                ready.push(p);
            }
        }
        let positions = if probing {
            self.positions()
        } else {
            HashMap::new()
        };
        for partition in ready {
            self.dispatch(partition, &positions);
        }
        self.blocked = self.owned.keys().any(|&p| self.full_here(p));
    }

    /// Whether a partition's batch is old enough to send: at the flush
    /// interval, or, while the log held at least [`BEHIND_BY`] more messages
    /// than the consumer has read at librdkafka's last statistics (half a
    /// second old at most, so a partition that caught up since looks caught
    /// up; unknown before the first, which counts as caught up),
    /// at [`BEHIND_FLUSH_FACTOR`] times it. A
    /// partition catching up then sends batches that its limits close: at a
    /// backlog's pace a 100 ms batch holds a fraction of its counters' events,
    /// and each of those batches writes every counter again.
    pub(super) fn old_enough(&self, partition: i32, state: &Owned) -> bool {
        let age = state.batch.age();
        // The log's end is read only for a batch past the flush interval.
        age >= self.flush_after
            && sends_at(age, self.flush_after, state.next, || {
                self.consumer.context().log_end(partition)
            })
    }

    /// The consumer's position in each owned partition: one past the last
    /// record it handed over or passed (transaction markers, records of
    /// aborted transactions). Kept by librdkafka for the records this loop
    /// has received, so offsets below it that no batch holds held no message.
    pub(super) fn positions(&self) -> HashMap<i32, i64> {
        match self.consumer.position() {
            Ok(list) => list
                .elements_for_topic(&self.settings.kafka.topic)
                .iter()
                .filter_map(|e| match e.offset() {
                    Offset::Offset(o) => Some((e.partition(), o)),
                    _ => None,
                })
                .collect(),
            Err(error) => {
                debug!(%error, "Cannot read the consumer's positions; probing only.");
                HashMap::new()
            }
        }
    }

    /// Sends a partition's batch to Redis if the partition is idle, a slot is
    /// free and no freeze holds. A partition without one sends the offsets up
    /// to `position` that it passed without a message, or else a probe of its
    /// fences.
    pub(super) fn dispatch(&mut self, partition: i32, positions: &HashMap<i32, i64>) {
        if self.busy.contains(&partition)
            || self.busy.len() >= self.settings.batching.max_in_flight
            || self.following.as_ref().is_some_and(Following::frozen)
        {
            return;
        }
        let Some(slot) = self.owned.get(&partition).cloned() else {
            return;
        };
        let state = &mut *slot.lock();
        let position = state.position_in(partition, positions);
        if state.pending_seek.is_some() || state.fence_ahead {
            return;
        }
        if !state.batch.is_empty() {
            metrics::stage("batch", state.batch.age());
        }
        let taken = match self.detector.as_mut() {
            Some(detector) => state
                .batch
                .take_observed(|post, events| detector.observe(post, events)),
            None => state.batch.take(),
        };
        let mut batch = match (taken, state.next) {
            (Some(batch), _) => batch,
            (None, Some(next)) if state.known.is_some() => match position {
                // Every message below the position entered a batch or was
                // dropped as stale (a seek resets the position), and the
                // batch is empty: the offsets from `next` on held markers or
                // aborted records. A log that ends with a marker would
                // otherwise keep fence and commit short of its end for good.
                Some(end) if end > next => {
                    state.next = Some(end);
                    ClosedBatch::passed(next, end - 1)
                }
                _ => ClosedBatch::probe(next),
            },
            (None, _) => return,
        };
        let groups = self.applier.keys().groups().clone();
        let single = groups.count() == 1;
        // Scripts are planned here when the fences are known; otherwise the
        // task establishes them first.
        let planned = state.known.as_ref().map(|known| {
            // A range without messages moves every group's fence.
            let empty = batch.is_empty();
            let advanced_at = &mut state.advanced_at;
            plan(partition, &mut batch, &groups, known, |g| {
                let due = single || empty || advanced_at[g as usize].elapsed() >= PROBE_EVERY;
                if due {
                    advanced_at[g as usize] = Instant::now();
                }
                due
            })
        });
        state.buffer_sent();
        // A reader waiting for room takes messages again.
        slot.poke.notify_one();
        let job = Job {
            partition,
            epoch: state.epoch,
            batch,
            planned,
            assigned: state.assigned.take(),
            letters: std::mem::take(&mut state.letters),
            groups,
            applier: self.applier.clone(),
            dead_letters: self.dead_letters.clone(),
            abandon: self.abandon.clone(),
            pause: self.settings.test_script_pause,
            dedupe: self.settings.dedupe.on(),
        };
        self.busy.insert(partition);
        self.in_flight.push(tokio::spawn(job.run()));
    }

    /// Handles the reply to a batch.
    pub(super) fn finish(
        &mut self,
        joined: Result<Done, tokio::task::JoinError>,
    ) -> Result<(), RunError> {
        let done = match joined {
            Ok(done) => done,
            // A panicked apply task would leave its partition busy for good;
            // crash-only instead: nothing was committed for it, and the fences
            // make a restart exact.
            Err(error) => return Err(RunError::Crashed(error.to_string())),
        };
        self.busy.remove(&done.partition);
        // A revocation queued while this batch was in flight takes effect
        // first, so a partition handed to another member is never committed.
        self.apply_rebalances();
        let partition = done.partition;
        let finished = match done.result {
            Ok(finished) => finished,
            Err(ApplyError::Cancelled) => return Ok(()),
            Err(source) => return Err(RunError::Apply { partition, source }),
        };
        let probe = done.start > done.last;
        // Probes and passed ranges are not batches of the metrics.
        let carried = done.messages > 0;
        if carried {
            metrics::stage("script", done.took);
        }
        // A partition stopped meanwhile (its log ends before its fence) is
        // not committed on the log that replaced the one it was read from.
        let slot = self.owned.get(&partition).cloned();
        let mut guard = slot.as_ref().map(|slot| slot.lock());
        let current = guard
            .as_deref_mut()
            .filter(|s| s.epoch == done.epoch && !s.fence_ahead);
        let (established, replies) = match finished {
            Finished::Resync { known } => {
                metrics::batch_done(false, done.messages, done.bad, 0, done.took);
                let Some(state) = current else { return Ok(()) };
                let resume = known.1.resume_at();
                state.known = Some(known);
                info!(
                    partition,
                    resume,
                    "Fences found ahead of or behind this read; re-reading from the lowest."
                );
                drop(guard);
                return self.resync(partition, resume);
            }
            Finished::Scripts {
                established,
                replies,
            } => (established, replies),
        };
        let increments: usize = replies
            .iter()
            .filter(|(_, r, _)| r.decision == Decision::Apply)
            .map(|&(_, _, keys)| keys)
            .sum();
        for &(_, reply, keys) in &replies {
            metrics::script_done(reply.decision.as_str(), keys);
        }
        let Some(state) = current else {
            metrics::batch_done(true, done.messages, done.bad, increments, done.took);
            metrics::window_late(done.late);
            return Ok(());
        };
        state.verified_at = Instant::now();
        if let Some(known) = established {
            state.known = Some(known);
        }
        let tracker = &mut state.known.as_mut().expect("fences known after a batch").1;
        let mut continues = true;
        for &(group, reply, _) in &replies {
            continues &= tracker.record(group, done.last, reply);
        }
        if carried || !continues {
            metrics::batch_done(continues, done.messages, done.bad, increments, done.took);
        }
        if continues {
            metrics::window_late(done.late);
        }
        if continues {
            // A probe that continues confirms every offset below the fences:
            // it is stored too, so that a partition assigned with its fences
            // at its log's end, whose last batch applied just before its
            // previous owner died, does not show that batch as lag for as
            // long as nothing new arrives.
            self.committer.applied(&self.consumer, partition, done.last);
            if !probe {
                metrics::applied_offset(partition, done.last);
                // The batch covered every offset before the buffer's.
                state.oldest_sent_ms = None;
            }
            return Ok(());
        }
        let resume = tracker.resume_at();
        drop(guard);
        warn_discontinued((partition, done.start, done.last), &replies, resume);
        self.resync(partition, resume)
    }

    /// Drops the partition's buffer and moves the consumer to `resume`.
    pub(super) fn resync(&mut self, partition: i32, resume: i64) -> Result<(), RunError> {
        metrics::resynced();
        let Some(slot) = self.owned.get(&partition) else {
            return Ok(());
        };
        {
            let state = &mut *slot.lock();
            state.batch.clear();
            state.letters.clear();
            state.buffer_sent();
            state.next = Some(resume);
            state.seek_to(resume);
            intake::restart_window(partition, state, self.settings.dedupe);
        }
        self.retry_seeks();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLUSH: Duration = Duration::from_millis(100);

    fn sends(age_ms: u64, next: Option<i64>, end: Option<i64>) -> bool {
        sends_at(Duration::from_millis(age_ms), FLUSH, next, || end)
    }

    #[test]
    fn a_caught_up_partition_sends_at_the_flush_interval() {
        assert!(!sends(99, Some(500), Some(600)));
        assert!(sends(100, Some(500), Some(600)));
        // Just under the catching-up distance.
        assert!(sends(100, Some(0), Some(BEHIND_BY - 1)));
    }

    #[test]
    fn a_partition_catching_up_sends_at_ten_flush_intervals() {
        assert!(!sends(100, Some(0), Some(BEHIND_BY)));
        assert!(!sends(999, Some(0), Some(1_000_000)));
        assert!(sends(1_000, Some(0), Some(1_000_000)));
    }

    #[test]
    fn an_unknown_end_or_position_counts_as_caught_up() {
        assert!(sends(100, Some(0), None));
        assert!(sends(100, None, Some(1_000_000)));
    }
}
