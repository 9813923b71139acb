//! Intake: ownership changes and messages entering a partition's batch.
//!
//! Invariants kept here: a partition's batch only ever holds messages of the
//! current ownership, read from the position the fences gave it; a message
//! below that position, or read while a seek is pending, is dropped; an event
//! its slot group already has is covered by the range but changes no counter.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::Message;
use rdkafka::message::BorrowedMessage;
use tracing::warn;

use crate::domain::fence::{PartitionFences, Tracker};
use crate::domain::slots::SlotGroups;
use crate::domain::versions::RouteTable;
use crate::infra::{health, metrics};
use crate::pipeline::aggregate::Batch;
use crate::pipeline::commit::Committer;
use crate::pipeline::consume::Rebalanced;
use crate::pipeline::dead_letter::{DeadLetter, DeadLetters, Pending};
use crate::pipeline::decode::Decoder;

/// A partition this consumer owns.
pub(super) struct Owned {
    /// Distinguishes this ownership from earlier ones of the same partition.
    pub(super) epoch: u64,
    /// The offset the next accepted message must be at or after; the start
    /// of the next batch's range. `None` until the first message shows it.
    pub(super) next: Option<i64>,
    /// Origin and group fences, once known (at assignment, or established by
    /// the first batch).
    pub(super) known: Option<(i64, Tracker)>,
    /// What the assignment read, when it did not give the origin.
    pub(super) assigned: Option<PartitionFences>,
    pub(super) batch: Batch,
    pub(super) letters: Vec<Pending>,
    /// Per slot group, when it last received a script.
    pub(super) advanced_at: Vec<Instant>,
    /// When Redis last confirmed the fences of this ownership.
    pub(super) verified_at: Instant,
    /// A seek the consumer has not accepted yet (librdkafka refuses seeks on a
    /// partition whose fetcher is still starting); messages are dropped until
    /// it succeeds, so nothing read from the old position enters a batch.
    pub(super) pending_seek: Option<i64>,
    /// Kafka timestamps (milliseconds): the newest event accepted, the newest
    /// in the batch in flight, and the newest applied; for the lag in seconds.
    pub(super) newest_seen_ms: i64,
    pub(super) newest_sent_ms: i64,
    pub(super) newest_applied_ms: i64,
}

impl Owned {
    /// How far behind the partition's counts are, in seconds: the age of
    /// the newest applied event while newer ones wait, 0 when caught up.
    pub(super) fn lag_seconds(&self, now_ms: i64) -> f64 {
        if self.newest_seen_ms <= self.newest_applied_ms || self.newest_applied_ms == 0 {
            return 0.0;
        }
        (now_ms - self.newest_applied_ms).max(0) as f64 / 1000.0
    }
}

/// Applies ownership changes; `true` if there were any. Borrows only what
/// it changes, so it can run while a received message still borrows the
/// consumer: the callback that queued the changes ran inside that very
/// `recv()`, and the message may belong to a partition assigned by it.
pub(super) fn apply_changes(
    owned: &mut HashMap<i32, Owned>,
    committer: &mut Committer,
    epochs: &mut u64,
    groups: usize,
    changes: Vec<Rebalanced>,
) -> bool {
    let any = !changes.is_empty();
    for change in changes {
        match change {
            Rebalanced::Assigned(assignments) => {
                metrics::rebalanced();
                for a in assignments {
                    *epochs += 1;
                    let known = a.fences.as_ref().and_then(PartitionFences::tracker);
                    owned.insert(
                        a.partition,
                        Owned {
                            epoch: *epochs,
                            next: known.as_ref().map(|(_, t)| t.resume_at()),
                            assigned: if known.is_some() { None } else { a.fences },
                            known,
                            batch: Batch::new(),
                            letters: Vec::new(),
                            advanced_at: vec![Instant::now(); groups],
                            verified_at: Instant::now(),
                            pending_seek: None,
                            newest_seen_ms: 0,
                            newest_sent_ms: 0,
                            newest_applied_ms: 0,
                        },
                    );
                }
            }
            Rebalanced::Revoked(partitions) => {
                for p in partitions {
                    owned.remove(&p);
                    committer.forget(p);
                    metrics::consumer_lag(p, 0);
                    metrics::consumer_lag_seconds(p, 0.0);
                }
            }
            Rebalanced::Lost => {
                for p in owned.keys().copied().collect::<Vec<_>>() {
                    committer.forget(p);
                    metrics::consumer_lag(p, 0);
                    metrics::consumer_lag_seconds(p, 0.0);
                }
                owned.clear();
                health::unassigned();
            }
        }
        // An assignment, even an empty one, tells readiness the consumer
        // has joined its group.
        metrics::assigned(owned.len());
        health::assigned(owned.len());
    }
    any
}

/// Adds one message to its partition's batch; `false` when it is not ours
/// or stale.
pub(super) fn accept(
    owned: &mut HashMap<i32, Owned>,
    groups: &SlotGroups,
    message: &BorrowedMessage<'_>,
    timestamp: i64,
    routes: &RouteTable,
    decoder: &Decoder,
    dead_letters: Option<&DeadLetters>,
) -> bool {
    let partition = message.partition();
    let offset = message.offset();
    let Some(state) = owned.get_mut(&partition) else {
        return false;
    };
    if state.pending_seek.is_some() || state.next.is_some_and(|next| offset < next) {
        return false;
    }
    let start = state.next.unwrap_or(offset);
    if state.batch.is_empty() && timestamp > 0 {
        // The latency breakdown samples each batch's first message.
        let waited = (crate::domain::versions::wall_ms() - timestamp).max(0) as u64;
        metrics::stage("fetch", std::time::Duration::from_millis(waited));
    }
    match decoder.event(message.payload(), timestamp) {
        Ok(like) => {
            let id = routes.counter(like.post_id, like.user_id, timestamp);
            let already_in = state.known.as_ref().is_some_and(|(_, t)| {
                offset <= t.highest() && !t.needs(groups.group_of(id.post_id, id.bucket), offset)
            });
            if already_in {
                state.batch.add_applied(start, offset);
            } else {
                state.batch.add(start, offset, id, like.delta);
            }
        }
        Err(reason) => {
            warn!(partition, offset, %reason, "Bad message skipped.");
            metrics::bad_message(reason.as_str());
            state.batch.add_bad(start, offset);
            if let Some(dead_letters) = dead_letters {
                state.letters.push(dead_letters.send(DeadLetter {
                    key: message.key().map(<[u8]>::to_vec),
                    value: message.payload().map(<[u8]>::to_vec),
                    reason,
                    partition,
                    offset,
                }));
            }
        }
    }
    state.next = Some(offset + 1);
    state.newest_seen_ms = state.newest_seen_ms.max(timestamp);
    true
}

/// Notices a consumer that owns no partition for long. A group member can
/// legitimately own nothing (more members than partitions), but a member
/// that stays empty may also be looping through a rebalance the coordinator
/// never completes; librdkafka reports that only at debug level, so the run
/// says it at warning level, first after [`IdleOwnership::FIRST`] and then at
/// doubling intervals up to [`IdleOwnership::MAX_GAP`].
#[derive(Debug, Default)]
pub(super) struct IdleOwnership {
    since: Option<Instant>,
    next_warning: Duration,
}

impl IdleOwnership {
    pub(super) const FIRST: Duration = Duration::from_secs(30);
    pub(super) const MAX_GAP: Duration = Duration::from_secs(600);

    /// Records whether the consumer owns any partition at `now`; returns how
    /// long it has owned none when a warning is due.
    pub(super) fn observe(&mut self, owns_any: bool, now: Instant) -> Option<Duration> {
        if owns_any {
            self.since = None;
            return None;
        }
        let since = *self.since.get_or_insert_with(|| {
            self.next_warning = Self::FIRST;
            now
        });
        let idle = now.saturating_duration_since(since);
        if idle < self.next_warning {
            return None;
        }
        let gap = self.next_warning.min(Self::MAX_GAP);
        self.next_warning = idle + gap;
        Some(idle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_ownership_warns_late_then_less_often_and_resets_on_assignment() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut idle = IdleOwnership::default();
        let warned: Vec<u64> = (0..=2000)
            .filter_map(|s| idle.observe(false, at(s)).map(|d| d.as_secs()))
            .collect();
        assert_eq!(warned, [30, 60, 120, 240, 480, 960, 1560]);
        assert_eq!(idle.observe(true, at(2001)), None);
        assert_eq!(idle.observe(false, at(2002)), None);
        assert_eq!(idle.observe(false, at(2031)), None);
        assert_eq!(idle.observe(false, at(2032)), Some(Duration::from_secs(30)));
    }
}
