//! Intake: ownership changes and messages entering a partition's batch.
//!
//! Invariants kept here: a partition's batch only ever holds messages of the
//! current ownership, read from the position the fences gave it; a message
//! below that position, or read while a seek is pending, is dropped, and one
//! below it with no seek pending is handed back to be checked against the
//! log (only a log that ends before the fence sends the consumer there); an
//! event its slot group already has is covered by the range but changes no
//! counter. A partition whose fence is ahead of its log takes nothing until
//! it is assigned again; offsets retention deleted before the fence reached
//! them are reported once per ownership, at its assignment, and so are those
//! below the fences that a dedupe window was to re-read.
//!
//! With dedupe on, a partition's window is rebuilt whenever it starts at its
//! fences (assignment, resync, a new generation): the consumer is placed
//! below the fences, and the records it reads there only fill the window, so
//! every record above the fences is decided as any other owner decides it
//! (see [`crate::pipeline::dedupe`]); a repeat is covered by the range but
//! changes no counter.
//!
//! The re-read is the partition's own: it holds back what is above that
//! partition's fences and nothing else. Re-read records are not routed (they
//! change no counter), take no place in a batch and never block the
//! consumer, so every other partition goes on taking, batching and applying
//! meanwhile. What they do share is librdkafka's one queue of prefetched
//! messages: another partition's records wait behind the re-read records
//! queued before them, and since librdkafka stops fetching every partition
//! while that queue holds `queued.min.messages` (100,000), behind about that
//! many at most, never behind the rest of the re-read. A re-read ends when
//! the window reaches the fences, or when the consumer's position passes them
//! without a record (transaction markers); its length is timed.
//!
//! A partition whose queue was split at its assignment is taken by a reader
//! of its own (see `reader`); the main loop and the reader share its state
//! under one lock, and every position the consumer is sent to is sent by the
//! reader, so no message it took before a seek is taken after it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::kept::KeptWindows;
use crate::domain::fence::{PartitionFences, Tracker};
use crate::domain::slots::SlotGroups;
use crate::domain::versions::RouteTable;
use crate::domain::windows::{Placed, Windows};
use crate::infra::{health, metrics};
use crate::pipeline::aggregate::{Batch, WindowCell};
use crate::pipeline::commit::Committer;
use crate::pipeline::consume::Rebalanced;
use crate::pipeline::dead_letter::{DeadLetter, DeadLetters, Pending};
use crate::pipeline::decode::{BadReason, Decoder, EventId, Like};
use crate::pipeline::dedupe::{DedupeSettings, Keys, Window};
use crate::pipeline::guard::{self, LogFit};

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
    /// Kafka timestamps (milliseconds) of the oldest message in the buffer,
    /// and of the oldest sent but not yet applied (the batch in flight, or
    /// a buffer dropped to be read again): for the lag in seconds.
    pub(super) oldest_buffered_ms: Option<i64>,
    pub(super) oldest_sent_ms: Option<i64>,
    /// The fence lies beyond the log's end: the partition is paused and
    /// takes nothing for this ownership.
    pub(super) fence_ahead: bool,
    /// When a fetched offset below the fence last sent this partition's log
    /// to be checked.
    pub(super) log_checked_at: Option<Instant>,
    /// The dedupe window, when dedupe is on.
    pub(super) window: Option<Window>,
    /// The re-read rebuilding the window below the fences, while it runs.
    pub(super) reread: Option<Reread>,
    /// A reader of its own takes this partition's messages from its queue.
    pub(super) read_apart: bool,
    /// The reader has still to place the consumer at the position the
    /// assignment gave (the group's committed offset, or the log's start):
    /// messages are dropped until it has.
    pub(super) placing: bool,
    /// The consumer's position as the reader last read it, with every
    /// message below it taken: for a reader's partition, what
    /// `Pipeline::positions` reads for the others.
    pub(super) position: Option<i64>,
}

/// An owned partition's state, shared by the main loop and its reader.
pub(super) struct Slot {
    state: Mutex<Owned>,
    /// Wakes the reader: a seek is asked for, or its batch has room again.
    pub(super) poke: Notify,
    /// Cancelled when the ownership ends: its reader stops.
    stop: CancellationToken,
    /// Set with `stop`: what the reader checks between two messages, a load
    /// where the token's own check takes a lock.
    ended: AtomicBool,
}

impl Slot {
    fn new(state: Owned) -> Self {
        Self {
            state: Mutex::new(state),
            poke: Notify::new(),
            stop: CancellationToken::new(),
            ended: AtomicBool::new(false),
        }
    }

    /// Ends the ownership: its reader stops.
    pub(super) fn end(&self) {
        self.ended.store(true, Ordering::Release);
        self.stop.cancel();
    }

    /// Whether the ownership has ended.
    pub(super) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Completes when the ownership ends.
    pub(super) async fn stopped(&self) {
        self.stop.cancelled().await
    }

    /// The partition's state; a panic while it was held ends the process
    /// anyway, so a poisoned lock is taken as it is.
    pub(super) fn lock(&self) -> MutexGuard<'_, Owned> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The partitions this consumer owns.
pub(super) type Owning = HashMap<i32, Arc<Slot>>;

/// A re-read of the log below a partition's fences, which rebuilds its
/// dedupe window before anything above them is decided.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reread {
    /// When the window was restarted.
    began: Instant,
    /// The first offset re-read.
    from: i64,
    /// The fences' resume offset, where the re-read ends.
    resume: i64,
}

/// What became of a fetched message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Intake {
    /// Added to its partition's batch.
    Taken,
    /// Not ours, stale, or its partition is stopped.
    Dropped,
    /// Below the partition's next offset with no seek pending: the consumer
    /// was sent below the fence without being asked (see [`accept`]); the
    /// log is to be checked. The message is dropped.
    BelowFence,
}

impl Owned {
    /// The consumer's position in this partition with every message below
    /// it taken: its reader's reading, or else the consumer's `positions`.
    pub(super) fn position_in(&self, partition: i32, positions: &HashMap<i32, i64>) -> Option<i64> {
        match self.read_apart {
            true => self.position,
            false => positions.get(&partition).copied(),
        }
    }

    /// How far behind the partition's counts are, in seconds: the age of
    /// the oldest message fetched and not yet applied, 0 when none waits. A
    /// partition whose first batch never lands ages like any other.
    pub(super) fn lag_seconds(&self, now_ms: i64) -> f64 {
        let oldest = match (self.oldest_sent_ms, self.oldest_buffered_ms) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => match a.or(b) {
                Some(oldest) => oldest,
                None => return 0.0,
            },
        };
        (now_ms - oldest).max(0) as f64 / 1000.0
    }

    /// A message stamped `timestamp` entered the buffer.
    pub(super) fn buffered(&mut self, timestamp: i64) {
        if timestamp > 0 {
            self.oldest_buffered_ms = Some(
                self.oldest_buffered_ms
                    .map_or(timestamp, |t| t.min(timestamp)),
            );
        }
    }

    /// Whether a message would be looked at: not while the partition is
    /// stopped, or while the consumer is on its way to another position.
    pub(super) fn settled(&self) -> bool {
        !self.fence_ahead && self.pending_seek.is_none() && !self.placing
    }

    /// Sends the consumer to `offset`: what was read from the old position
    /// is dropped until the seek lands.
    pub(super) fn seek_to(&mut self, offset: i64) {
        self.pending_seek = Some(offset);
        self.position = None;
    }

    /// The buffer was sent as a batch, or dropped to be read again: its
    /// messages wait until a batch is applied.
    pub(super) fn buffer_sent(&mut self) {
        if let Some(buffered) = self.oldest_buffered_ms.take() {
            self.oldest_sent_ms = Some(self.oldest_sent_ms.map_or(buffered, |t| t.min(buffered)));
        }
    }
}

/// Applies ownership changes; returns the partitions assigned, or `None`
/// when there was no change. Borrows only what it changes, so it can run
/// while a received message still borrows the consumer: the callback that
/// queued the changes ran inside that very `recv()`, and the message may
/// belong to a partition assigned by it. A revoked partition's reader is
/// told to stop, and its dedupe window is kept in `kept` in case the
/// partition comes back.
pub(super) fn apply_changes(
    owned: &mut Owning,
    committer: &mut Committer,
    epochs: &mut u64,
    groups: usize,
    changes: Vec<Rebalanced>,
    dedupe: DedupeSettings,
    kept: &mut KeptWindows,
) -> Option<Vec<i32>> {
    if changes.is_empty() {
        return None;
    }
    let mut assigned = Vec::new();
    for change in changes {
        match change {
            Rebalanced::Assigned(assignments) => {
                metrics::rebalanced();
                for a in assignments {
                    *epochs += 1;
                    let known = a.fences.as_ref().and_then(PartitionFences::tracker);
                    let fence_ahead = match (a.log, &known) {
                        (Some(LogFit::Trimmed { from, to }), _) => {
                            guard::report_trimmed(a.partition, from, to);
                            false
                        }
                        (Some(LogFit::Ahead { high }), Some((_, tracker))) => {
                            guard::report_fence_ahead(a.partition, tracker.resume_at() - 1, high);
                            true
                        }
                        _ => false,
                    };
                    let mut state = Owned {
                        epoch: *epochs,
                        next: known.as_ref().map(|(_, t)| t.resume_at()),
                        assigned: if known.is_some() { None } else { a.fences },
                        known,
                        batch: Batch::new(),
                        letters: Vec::new(),
                        advanced_at: vec![Instant::now(); groups],
                        verified_at: Instant::now(),
                        pending_seek: None,
                        oldest_buffered_ms: None,
                        oldest_sent_ms: None,
                        fence_ahead,
                        log_checked_at: None,
                        window: None,
                        reread: None,
                        read_apart: false,
                        placing: false,
                        position: None,
                    };
                    if !resume_kept_window(a.partition, &mut state, kept, dedupe) {
                        restart_window(a.partition, &mut state, dedupe);
                    }
                    // Retention may have deleted part of what the window re-reads.
                    if let (Some(reread), Some(start)) = (state.reread, a.log_start)
                        && reread.from < start
                    {
                        guard::report_dedupe_history_lost(
                            a.partition,
                            reread.from,
                            start.min(reread.resume) - 1,
                        );
                    }
                    if let Some(previous) = owned.insert(a.partition, Arc::new(Slot::new(state))) {
                        previous.end();
                    }
                    assigned.push(a.partition);
                }
            }
            Rebalanced::Revoked(partitions) => {
                for p in partitions {
                    if let Some(slot) = owned.remove(&p) {
                        slot.end();
                        let mut state = slot.lock();
                        if let (Some(window), Some((origin, _))) =
                            (state.window.take(), state.known.as_ref())
                        {
                            kept.keep(p, *origin, window, owned.len());
                        }
                    }
                    committer.forget(p);
                    metrics::consumer_lag(p, 0);
                    metrics::consumer_lag_seconds(p, 0.0);
                    metrics::dedupe_window(p, 0.0);
                    metrics::dedupe_reread(p, Duration::ZERO, 0);
                }
            }
            Rebalanced::Lost => {
                for p in owned.keys().copied().collect::<Vec<_>>() {
                    committer.forget(p);
                    metrics::consumer_lag(p, 0);
                    metrics::consumer_lag_seconds(p, 0.0);
                    metrics::dedupe_reread(p, Duration::ZERO, 0);
                }
                for (_, slot) in owned.drain() {
                    slot.end();
                }
                assigned.clear();
                health::unassigned();
            }
        }
        kept.owning(owned.len());
        // An assignment, even an empty one, tells readiness the consumer
        // has joined its group.
        metrics::assigned(owned.len());
        metrics::fence_ahead(owned.values().filter(|s| s.lock().fence_ahead).count());
        health::assigned(owned.len());
    }
    // A partition revoked after its assignment, in the same changes, is not
    // read.
    assigned.retain(|p| owned.contains_key(p));
    Some(assigned)
}

/// A message decoded ahead of its turn, with its dedupe window's memory
/// already asked for (see [`read`]).
pub(super) struct Read {
    decoded: Result<(Like, Option<EventId>), BadReason>,
    keys: Option<Keys>,
}

/// What intake reads of a message, whichever queue handed it out.
#[derive(Clone, Copy)]
pub(super) struct Record<'m> {
    pub(super) partition: i32,
    pub(super) offset: i64,
    /// The message's timestamp in milliseconds, 0 when it has none.
    pub(super) timestamp: i64,
    pub(super) key: Option<&'m [u8]>,
    pub(super) payload: Option<&'m [u8]>,
}

impl<'m> Record<'m> {
    /// The parts of a message handed out by a poll of the consumer.
    pub(super) fn of(message: &'m impl rdkafka::Message) -> Record<'m> {
        Record {
            partition: message.partition(),
            offset: message.offset(),
            timestamp: message.timestamp().to_millis().unwrap_or(0),
            key: message.key(),
            payload: message.payload(),
        }
    }
}

/// Decodes a message and asks for the slots of its partition's dedupe window
/// it will be decided by, without waiting for them: a reader reads a run of
/// messages this way before it takes the first, so their waits for memory
/// overlap. Nothing of the partition's state changes: what the message does
/// is decided by [`accept`], in offset order.
pub(super) fn read(state: &Owned, decoder: &Decoder, message: &Record<'_>) -> Read {
    // Only a dedupe window reads the event's id.
    let decoded = match state.window {
        Some(_) => decoder.identified(message.payload, message.timestamp),
        None => decoder
            .event(message.payload, message.timestamp)
            .map(|like| (like, None)),
    };
    let keys = match (&decoded, state.window.as_ref()) {
        (Ok((like, id)), Some(window)) => {
            let keys = window.keys(like, *id);
            window.prefetch(&keys);
            Some(keys)
        }
        _ => None,
    };
    Read { decoded, keys }
}

/// Adds one message, read by [`read`], to its partition's batch.
///
/// A message below the partition's next offset arrives only after a seek
/// (dropped while it is pending; librdkafka discards what was fetched
/// before it) or after librdkafka reset a position the log does not hold:
/// the fence's position lay beyond the log's end, and the reset went back to
/// its start. The second is handed back as [`Intake::BelowFence`].
#[allow(clippy::too_many_arguments)]
pub(super) fn accept(
    state: &mut Owned,
    groups: &SlotGroups,
    windows: &Windows,
    message: &Record<'_>,
    read: Read,
    routes: &RouteTable,
    dead_letters: Option<&DeadLetters>,
) -> Intake {
    let Record {
        partition,
        offset,
        timestamp,
        ..
    } = *message;
    if !state.settled() {
        return Intake::Dropped;
    }
    if state.next.is_some_and(|next| offset < next) {
        // Below the fences, the re-read that rebuilds the dedupe window.
        if let Some(window) = state.window.as_mut().filter(|w| w.expects(offset)) {
            match read.decoded {
                Ok((like, id)) => {
                    let keys = read.keys.unwrap_or_else(|| window.keys(&like, id));
                    window.decide(offset, timestamp, keys);
                }
                Err(_) => window.pass(offset),
            }
            reread_reached(partition, state, offset + 1);
            return Intake::Dropped;
        }
        return Intake::BelowFence;
    }
    // The first record above the fences: the window has seen all below.
    reread_reached(partition, state, offset);
    let start = state.next.unwrap_or(offset);
    if state.batch.is_empty() && timestamp > 0 {
        // The latency breakdown samples each batch's first message.
        let waited = (crate::domain::versions::wall_ms() - timestamp).max(0) as u64;
        metrics::stage("fetch", std::time::Duration::from_millis(waited));
    }
    match read.decoded {
        Ok((like, event_id)) => {
            let keys = state
                .window
                .as_ref()
                .filter(|w| w.expects(offset))
                .map(|w| read.keys.unwrap_or_else(|| w.keys(&like, event_id)));
            let id = routes.counter_of(partition, offset, like.post_id, like.user_id, timestamp);
            let skip = match (keys, state.window.as_mut()) {
                (Some(keys), Some(window)) => window.decide(offset, timestamp, keys),
                _ => None,
            };
            if let Some(reason) = skip {
                // Offsets an earlier owner applied were counted there.
                if state
                    .known
                    .as_ref()
                    .is_none_or(|(_, t)| offset > t.highest())
                {
                    metrics::duplicates_skipped(reason.as_str(), 1);
                }
                state.batch.add_applied(start, offset);
                state.next = Some(offset + 1);
                state.buffered(timestamp);
                return Intake::Taken;
            }
            let already_in = |group: u32| {
                state
                    .known
                    .as_ref()
                    .is_some_and(|(_, t)| offset <= t.highest() && !t.needs(group, offset))
            };
            let windowed = !windows.is_empty() && !already_in(groups.group_of(like.post_id, 0));
            if already_in(groups.group_of(id.post_id, id.bucket)) {
                state.batch.add_applied(start, offset);
            } else {
                state.batch.add(start, offset, id, like.delta);
            }
            if windowed {
                add_windows(&mut state.batch, windows, &like, timestamp);
            }
        }
        Err(reason) => {
            warn!(partition, offset, %reason, "Bad message skipped.");
            metrics::bad_message(reason.as_str());
            if let Some(window) = state.window.as_mut().filter(|w| w.expects(offset)) {
                window.pass(offset);
            }
            state.batch.add_bad(start, offset);
            if let Some(dead_letters) = dead_letters {
                state.letters.push(dead_letters.send(DeadLetter {
                    key: message.key.map(<[u8]>::to_vec),
                    value: message.payload.map(<[u8]>::to_vec),
                    reason,
                    partition,
                    offset,
                }));
            }
        }
    }
    state.next = Some(offset + 1);
    state.buffered(timestamp);
    Intake::Taken
}

/// Adds a like to its post's count in each window it is not too late for.
fn add_windows(batch: &mut Batch, windows: &Windows, like: &Like, timestamp: i64) {
    for (i, &size) in windows.sizes().iter().enumerate() {
        match windows.place(size, like.event_time_ms, timestamp) {
            Some(Placed::In(start)) => batch.add_window(
                WindowCell {
                    size: i as u8,
                    start,
                    post_id: like.post_id,
                },
                like.delta,
            ),
            Some(Placed::Late(_)) | None => batch.add_late(),
        }
    }
}

/// Gives a partition that starts at its fences a fresh dedupe window, and
/// places the consumer where the window is re-read from. Without known
/// fences the window starts where reading does; the first batch then
/// re-reads (see `scripts`) unless that is the origin.
pub(super) fn restart_window(partition: i32, state: &mut Owned, dedupe: DedupeSettings) {
    state.reread = None;
    if !dedupe.on() {
        state.window = None;
        return;
    }
    let Some((origin, tracker)) = &state.known else {
        state.window = Some(Window::new(dedupe, state.next));
        return;
    };
    let resume = tracker.resume_at();
    let from = dedupe.rewind(*origin, resume);
    state.window = Some(Window::new(dedupe, Some(from)));
    if from < resume {
        info!(
            partition,
            from, resume, "Re-reading the dedupe window below the fences."
        );
        state.seek_to(from);
        // A partition stopped with its fence ahead of its log reads nothing.
        if !state.fence_ahead {
            state.reread = Some(Reread {
                began: Instant::now(),
                from,
                resume,
            });
        }
    }
}

/// Gives a partition assigned at its fences the window this consumer kept
/// from an earlier ownership, if it can be used (see `kept`), and places the
/// consumer where the window has yet to see the log: only the offsets other
/// owners applied since are re-read. `false` when there is none to use.
fn resume_kept_window(
    partition: i32,
    state: &mut Owned,
    kept: &mut KeptWindows,
    dedupe: DedupeSettings,
) -> bool {
    let Some((origin, tracker)) = &state.known else {
        return false;
    };
    if !dedupe.on() || state.fence_ahead {
        return false;
    }
    let resume = tracker.resume_at();
    let from = dedupe.rewind(*origin, resume);
    let Some(window) = kept.take(partition, *origin, from, resume) else {
        return false;
    };
    let seen = window.next().unwrap_or(resume);
    state.reread = None;
    state.window = Some(window);
    info!(
        partition,
        from = seen,
        resume,
        "Dedupe window kept from an earlier ownership; re-reading only the offsets applied since."
    );
    if seen < resume {
        state.seek_to(seen);
        state.reread = Some(Reread {
            began: Instant::now(),
            from: seen,
            resume,
        });
    }
    true
}

/// Ends the partition's re-read if `reached`, the offset up to which the
/// window has seen the log, is at its fences: the next record above them can
/// be decided. Times it, and says so once.
fn reread_reached(partition: i32, state: &mut Owned, reached: i64) {
    let Some(reread) = state.reread.filter(|r| reached >= r.resume) else {
        return;
    };
    state.reread = None;
    let took = reread.began.elapsed();
    metrics::dedupe_reread_done(partition, took);
    info!(
        partition,
        offsets = reread.resume - reread.from,
        seconds = (took.as_secs_f64() * 1000.0).round() / 1000.0,
        "Dedupe window re-read; deciding the records above the fences."
    );
}

/// Sets each owned partition's re-read gauges: the running re-read's age and
/// the offsets it has left. A re-read whose consumer `positions` (or, for a
/// partition with a reader, the position its reader read) show past the
/// fences ends here: the records below them were all seen, and what lay
/// between the last one and the fences held no record (transaction markers),
/// so no record would end it in [`accept`].
pub(super) fn report_rereads(owned: &Owning, positions: &HashMap<i32, i64>) {
    for (&partition, slot) in owned {
        let state = &mut *slot.lock();
        // A position read before a pending seek lands is the old one.
        if state.pending_seek.is_none()
            && let Some(position) = state.position_in(partition, positions)
        {
            reread_reached(partition, state, position);
        }
        let (age, remaining) = match (&state.reread, &state.window) {
            (Some(reread), Some(window)) => (
                reread.began.elapsed(),
                reread.resume - window.next().unwrap_or(reread.from),
            ),
            _ => (Duration::ZERO, 0),
        };
        metrics::dedupe_reread(partition, age, remaining);
    }
}

/// Whether a message at `offset` would be decided (taken into a batch)
/// rather than dropped or used only to rebuild a window: only such a message
/// needs routing.
pub(super) fn decides(state: &Owned, offset: i64) -> bool {
    state.settled() && state.next.is_none_or(|next| offset >= next)
}

/// Whether an owned partition the main loop reads re-reads below its fences
/// from a position the consumer has taken.
pub(super) fn rereading(owned: &Owning) -> bool {
    owned.values().any(|slot| {
        let s = slot.lock();
        !s.read_apart && s.reread.is_some() && s.pending_seek.is_none()
    })
}

/// Sets the dedupe gauges: the time each window covers, and the events all
/// of them remember; and reports the entries a window dropped since.
pub(super) fn report_windows(owned: &Owning) {
    let mut remembered = 0;
    for (&partition, slot) in owned {
        let mut state = slot.lock();
        if let Some(window) = &mut state.window {
            remembered += window.len();
            metrics::dedupe_window(partition, window.covers_seconds());
            let forgotten = window.newly_forgotten();
            if forgotten > 0 {
                metrics::dedupe_forgotten(forgotten);
                warn!(
                    partition,
                    entries = forgotten,
                    "The dedupe window dropped entries: keys of this partition's records crowd one \
                     slot of its table, which only keys crafted to collide do (event ids a client \
                     chose). Repeats of the records they held are not recognized and count; find \
                     the producer whose ids repeat one pattern"
                );
            }
        }
    }
    metrics::dedupe_remembered(remembered);
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
    use crate::pipeline::consume::Assignment;
    use crate::pipeline::dedupe::DedupeMode;

    const DEDUPE: DedupeSettings = DedupeSettings {
        mode: DedupeMode::Ids,
        span: 400,
    };

    /// Partition 4 assigned with its fence at 999, counted from `origin`.
    fn assigned(origin: i64) -> Owning {
        let mut owned = HashMap::new();
        assign(&mut owned, &mut KeptWindows::default(), origin, 999);
        owned
    }

    /// Assigns partition 4 with its fence at `fence`, counted from `origin`.
    fn assign(owned: &mut Owning, kept: &mut KeptWindows, origin: i64, fence: i64) {
        let fences = PartitionFences {
            origin: Some(origin),
            fences: vec![Some(fence)],
        };
        let assignment = Assignment {
            partition: 4,
            fences: Some(fences),
            log: None,
            log_start: None,
        };
        let changes = vec![Rebalanced::Assigned(vec![assignment])];
        let committer = &mut Committer::new("t");
        apply_changes(owned, committer, &mut 0, 1, changes, DEDUPE, kept);
    }

    fn revoke(owned: &mut Owning, kept: &mut KeptWindows) {
        let changes = vec![Rebalanced::Revoked(vec![4])];
        let committer = &mut Committer::new("t");
        apply_changes(owned, committer, &mut 0, 1, changes, DEDUPE, kept);
    }

    /// Partition 4 owned and given up after its window saw the log up to 999.
    fn given_up_at_its_fence(kept: &mut KeptWindows) -> Owning {
        let mut owned = assigned(0);
        {
            let mut state = owned[&4].lock();
            let window = state.window.as_mut().unwrap();
            for offset in window.next().unwrap()..1_000 {
                window.pass(offset);
            }
        }
        kept.owning(1);
        revoke(&mut owned, kept);
        owned
    }

    #[test]
    fn entries_a_window_drops_are_reported_once_each() {
        let owned = assigned(0);
        let dropped = {
            let mut state = owned[&4].lock();
            let window = state.window.as_mut().unwrap();
            let like = Like {
                post_id: 7,
                user_id: 9,
                delta: 1,
                event_time_ms: 0,
            };
            let ids = crate::pipeline::dedupe::crowding_ids(window, &like, 300);
            for (offset, id) in (window.next().unwrap()..).zip(ids) {
                window.observe(offset, 0, &like, Some(id));
            }
            window.forgotten()
        };
        assert!(dropped > 0);
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        for _ in 0..2 {
            ::metrics::with_local_recorder(&recorder, || report_windows(&owned));
            let text = handle.render();
            let series = format!("{} {dropped}", metrics::DEDUPE_FORGOTTEN);
            assert!(text.contains(&series), "no {series}: {text}");
        }
    }

    #[test]
    fn a_partition_coming_back_rereads_only_what_was_applied_since_it_left() {
        let kept = &mut KeptWindows::default();
        let mut owned = given_up_at_its_fence(kept);
        assert!(owned.is_empty());
        // Another owner applied up to 1,099 meanwhile.
        assign(&mut owned, kept, 0, 1_099);
        let state = owned[&4].lock();
        assert_eq!(state.window.as_ref().unwrap().next(), Some(1_000));
        assert_eq!(state.pending_seek, Some(1_000));
        assert!(
            state
                .reread
                .is_some_and(|r| (r.from, r.resume) == (1_000, 1_100))
        );
    }

    #[test]
    fn a_kept_window_past_the_fences_or_of_another_origin_gives_way_to_a_fresh_one() {
        // The fence went back below what the window saw (a batch dropped at
        // the revocation was never applied): the whole window is re-read.
        let kept = &mut KeptWindows::default();
        let mut owned = given_up_at_its_fence(kept);
        assign(&mut owned, kept, 0, 949);
        let from = DEDUPE.rewind(0, 950);
        let state = owned[&4].lock();
        assert_eq!(state.window.as_ref().unwrap().next(), Some(from));
        assert!(state.reread.is_some_and(|r| r.from == from));
        drop(state);

        let kept = &mut KeptWindows::default();
        let mut owned = given_up_at_its_fence(kept);
        assign(&mut owned, kept, 10, 1_099);
        let from = DEDUPE.rewind(10, 1_100);
        assert!(owned[&4].lock().reread.is_some_and(|r| r.from == from));
    }

    #[test]
    fn an_assignment_rereads_the_window_below_the_fences_until_the_position_passes_them() {
        let owned = assigned(0);
        let state = owned[&4].lock();
        let from = DEDUPE.rewind(0, 1_000);
        assert!(from < 1_000);
        assert_eq!(state.pending_seek, Some(from));
        assert!(
            state
                .reread
                .is_some_and(|r| (r.from, r.resume) == (from, 1_000))
        );
        drop(state);
        // Before the seek lands, the position is the old one and ends nothing.
        report_rereads(&owned, &HashMap::from([(4, 1_000)]));
        assert!(owned[&4].lock().reread.is_some());
        assert!(!rereading(&owned));
        owned[&4].lock().pending_seek = None;
        assert!(rereading(&owned));
        report_rereads(&owned, &HashMap::from([(4, 999)]));
        assert!(owned[&4].lock().reread.is_some());
        // Past the last record below the fences, only markers: the re-read is over.
        report_rereads(&owned, &HashMap::from([(4, 1_000)]));
        assert!(owned[&4].lock().reread.is_none());
        assert!(!rereading(&owned));
    }

    #[test]
    fn only_what_is_decided_is_routed() {
        let owned = assigned(0);
        // A seek is pending: whatever arrives is dropped.
        assert!(!decides(&owned[&4].lock(), 1_000));
        owned[&4].lock().pending_seek = None;
        assert!(!decides(&owned[&4].lock(), 999), "a re-read record");
        assert!(decides(&owned[&4].lock(), 1_000));
    }

    #[test]
    fn a_partition_at_its_origin_rereads_nothing() {
        let owned = assigned(1_000);
        assert_eq!(owned[&4].lock().pending_seek, None);
        assert!(owned[&4].lock().reread.is_none());
    }

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
