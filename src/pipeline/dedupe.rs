//! Dedupe: records that repeat a like already in the log change no count.
//!
//! The fence counts every log record once; a producer that delivers at least
//! once (an outbox relay that restarts, an app retrying on a new producer, a
//! double tap) writes one like as several records. Within a window of the
//! last `span` offsets of a partition, with [`DedupeMode::Ids`]:
//!
//! * a record with an event id is skipped ([`Skip::EventId`]) when an earlier
//!   record of the window carries the same id for the same post, user and
//!   action;
//!
//! and with [`DedupeMode::IdsAndActions`] also:
//!
//! * a record without an id is skipped ([`Skip::RepeatAction`]) when the
//!   latest id-less record of the same (post, user) in the window has the same
//!   action: a like after a like, an unlike after an unlike.
//!
//! The window of the record at offset `o` holds the records at offsets
//! `max(origin, o - span) ..= o - 1`, where `origin` is the first offset
//! tally counted in the partition. Every record updates the window, skipped
//! or not, and bad messages never enter it.
//!
//! # Invariant: the verdict is a function of the log
//!
//! Whether the record at `o` is skipped depends only on the records of its
//! window, never on what an owner happened to see before. So every owner
//! reaches the same verdict, whatever the faults between them: an owner that
//! starts at fence `f` re-reads the log from `max(origin, f + 1 - span)` into
//! a fresh [`Window`] before deciding anything above `f` (see
//! `run::intake`), and so does every re-read after a refused batch or a
//! Redis that rolled the fence back. The state therefore always agrees with
//! the fence: it is derived from the records at or below it, re-read, and
//! the records decided since. Nothing is stored outside the log, and a
//! skipped record is an offset the batch covers without a counter, so the
//! scripts and their Redis calls do not change. `tally verify` and `tally
//! rebuild` walk the log from the origin through the same [`Window`].
//!
//! Why offsets and not timestamps: a window of the last `W` seconds of
//! record time cannot be re-read exactly. Timestamps within a partition are
//! not ordered (producer clocks, retries), so a late record could reach back
//! to any offset, and no re-read of bounded length would find every record
//! it may repeat. A window of offsets is re-read exactly, by construction, and
//! bounds memory by itself: at most `span` ids and `span` (post, user) pairs
//! per partition, besides the record just decided. What `span` covers in time depends on the rate; operators
//! size it with `tally plan` and watch `tally_dedupe_window_seconds`.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::pipeline::decode::{EventId, Like};

pub use crate::infra::config::dedupe::{DEFAULT_WINDOW, DedupeMode, DedupeSettings, MAX_WINDOW};

/// Why a record was skipped; a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Skip {
    /// An earlier record in the window carries the same event id.
    EventId,
    /// An id-less record repeating the user's last action on the post.
    RepeatAction,
}

impl Skip {
    /// Every reason, for pre-registering metrics.
    pub const ALL: [Skip; 2] = [Skip::EventId, Skip::RepeatAction];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::EventId => "event_id",
            Skip::RepeatAction => "repeat_action",
        }
    }
}

/// One partition's window: what the last `span` offsets said.
#[derive(Debug)]
pub struct Window {
    mode: DedupeMode,
    span: i64,
    /// The offset the window expects next; lower ones were already seen.
    next: Option<i64>,
    /// Keyed event id → the newest offset that carried it.
    ids: FxHashMap<u128, i64>,
    /// (post, user) → the newest offset of an id-less record, and its delta.
    actions: FxHashMap<(u64, u64), (i64, i64)>,
    /// Both maps' entries in offset order, so they leave the window in order.
    id_order: VecDeque<(i64, u128)>,
    action_order: VecDeque<(i64, u64, u64)>,
    /// Kafka timestamps of the oldest entry still remembered and of the
    /// newest record, for the time the window covers.
    newest_ms: i64,
    oldest: VecDeque<(i64, i64)>,
}

impl Window {
    /// An empty window that expects records from `from` on, or from the first
    /// one it is shown when `from` is `None`.
    pub fn new(settings: DedupeSettings, from: Option<i64>) -> Self {
        Window {
            mode: settings.mode,
            span: settings.span as i64,
            next: from,
            ids: FxHashMap::default(),
            actions: FxHashMap::default(),
            id_order: VecDeque::new(),
            action_order: VecDeque::new(),
            newest_ms: 0,
            oldest: VecDeque::new(),
        }
    }

    /// Whether the record at `offset` has yet to be shown to the window;
    /// records are shown once each, in offset order.
    pub fn expects(&self, offset: i64) -> bool {
        self.next.is_none_or(|next| offset >= next)
    }

    /// The first offset this window still expects (where it was started,
    /// until it is shown a record).
    pub fn next(&self) -> Option<i64> {
        self.next
    }

    /// Decides the record at `offset` and remembers it. `None`: it counts.
    pub fn observe(
        &mut self,
        offset: i64,
        timestamp_ms: i64,
        like: &Like,
        id: Option<EventId>,
    ) -> Option<Skip> {
        debug_assert!(self.expects(offset), "records are shown in offset order");
        self.next = Some(offset + 1);
        self.expire(offset);
        let (remembered, verdict) = match id {
            _ if self.mode == DedupeMode::Off => (false, None),
            Some(id) => {
                let key = id.keyed(like);
                let seen = self.ids.insert(key, offset).is_some();
                self.id_order.push_back((offset, key));
                (true, seen.then_some(Skip::EventId))
            }
            None if self.mode == DedupeMode::IdsAndActions => {
                let pair = (like.post_id, like.user_id);
                let last = self.actions.insert(pair, (offset, like.delta));
                self.action_order.push_back((offset, pair.0, pair.1));
                let repeat = last.is_some_and(|(_, delta)| delta == like.delta);
                (true, repeat.then_some(Skip::RepeatAction))
            }
            None => (false, None),
        };
        if remembered {
            self.oldest.push_back((offset, timestamp_ms));
        }
        self.newest_ms = self.newest_ms.max(timestamp_ms);
        verdict
    }

    /// Marks the record at `offset` as seen without remembering anything (a
    /// bad message): it still moves the window along.
    pub fn pass(&mut self, offset: i64) {
        self.next = Some(offset + 1);
    }

    /// Forgets every entry older than the window of `offset`.
    fn expire(&mut self, offset: i64) {
        let from = offset - self.span;
        while let Some(&(o, key)) = self.id_order.front() {
            if o >= from {
                break;
            }
            self.id_order.pop_front();
            if self.ids.get(&key) == Some(&o) {
                self.ids.remove(&key);
            }
        }
        while let Some(&(o, post, user)) = self.action_order.front() {
            if o >= from {
                break;
            }
            self.action_order.pop_front();
            if self
                .actions
                .get(&(post, user))
                .is_some_and(|&(at, _)| at == o)
            {
                self.actions.remove(&(post, user));
            }
        }
        while self.oldest.front().is_some_and(|&(o, _)| o < from) {
            self.oldest.pop_front();
        }
    }

    /// Records remembered (ids and id-less pairs).
    pub fn len(&self) -> usize {
        self.id_order.len() + self.action_order.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Seconds of record time between the oldest remembered record and the
    /// newest record seen: how much time the window covers now.
    pub fn covers_seconds(&self) -> f64 {
        match self.oldest.front() {
            Some(&(_, oldest)) => (self.newest_ms - oldest).max(0) as f64 / 1000.0,
            None => 0.0,
        }
    }

    /// Bytes the window holds on the heap, as allocated (capacity, not
    /// length): what a remembered event costs, measured by `tally-lab bench`.
    pub fn heap_bytes(&self) -> usize {
        // hashbrown: one control byte per bucket besides the entry.
        let map = |cap: usize, entry: usize| cap * (entry + 1);
        map(self.ids.capacity(), size_of::<(u128, i64)>())
            + map(
                self.actions.capacity(),
                size_of::<((u64, u64), (i64, i64))>(),
            )
            + self.id_order.capacity() * size_of::<(i64, u128)>()
            + self.action_order.capacity() * size_of::<(i64, u64, u64)>()
            + self.oldest.capacity() * size_of::<(i64, i64)>()
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn every_skip_reason_is_a_registered_metric_label() {
        let labels: Vec<&str> = Skip::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(labels, crate::infra::metrics::DUPLICATE_REASONS);
    }
    use super::*;
    use proptest::prelude::*;

    fn settings(mode: DedupeMode, span: u64) -> DedupeSettings {
        DedupeSettings { mode, span }
    }

    fn like(post: u64, user: u64, delta: i64) -> Like {
        Like {
            post_id: post,
            user_id: user,
            delta,
        }
    }

    /// Records of one partition: (offset, like, id); `None` like is a bad message.
    type Record = (i64, Option<Like>, Option<u64>);

    fn id(n: u64) -> EventId {
        EventId::of(&n.to_le_bytes())
    }

    /// Runs `records` through a window that starts at `from`, returning each
    /// decided offset's verdict.
    fn decide(s: DedupeSettings, from: i64, records: &[Record]) -> Vec<(i64, Option<Skip>)> {
        let mut window = Window::new(s, Some(from));
        let mut out = Vec::new();
        for &(offset, like, event) in records {
            if !window.expects(offset) {
                continue;
            }
            match like {
                Some(like) => {
                    out.push((offset, window.observe(offset, 0, &like, event.map(id))));
                }
                None => window.pass(offset),
            }
        }
        out
    }

    #[test]
    fn a_repeated_id_is_skipped_within_the_window_only() {
        let l = Some(like(7, 9, 1));
        let records = [
            (0, l, Some(1)),
            (1, l, Some(1)),
            (3, l, Some(2)),
            (5, l, Some(1)),
        ];
        let verdicts = decide(settings(DedupeMode::Ids, 3), 0, &records);
        // Offset 5's window is 2..=4: the id seen at 0 and 1 has left it.
        assert_eq!(
            verdicts,
            [(0, None), (1, Some(Skip::EventId)), (3, None), (5, None)]
        );
    }

    #[test]
    fn an_id_names_one_event_of_one_post_user_and_action() {
        let records = [
            (0, Some(like(7, 9, 1)), Some(1)),
            (1, Some(like(8, 9, 1)), Some(1)),
            (2, Some(like(7, 9, -1)), Some(1)),
            (3, Some(like(7, 9, 1)), Some(1)),
        ];
        let verdicts = decide(settings(DedupeMode::Ids, 100), 0, &records);
        assert_eq!(
            verdicts,
            [(0, None), (1, None), (2, None), (3, Some(Skip::EventId))]
        );
    }

    #[test]
    fn repeated_actions_are_skipped_only_when_asked_and_only_without_ids() {
        let (l, u) = (Some(like(7, 9, 1)), Some(like(7, 9, -1)));
        let records = [
            (0, l, None),
            (1, l, None),
            (2, u, None),
            (3, u, None),
            (4, l, Some(5)),
            (5, l, Some(6)),
            (6, l, None),
        ];
        let ids = decide(settings(DedupeMode::Ids, 100), 0, &records);
        assert!(ids.iter().all(|(_, v)| v.is_none()));
        let actions = decide(settings(DedupeMode::IdsAndActions, 100), 0, &records);
        let skipped: Vec<i64> = actions
            .iter()
            .filter(|(_, v)| *v == Some(Skip::RepeatAction))
            .map(|(o, _)| *o)
            .collect();
        // Id'd records are judged by their ids alone, and never move the
        // last id-less action: 6 follows the id-less unlike at 3.
        assert_eq!(skipped, [1, 3]);
    }

    #[test]
    fn an_unlike_older_than_the_window_lets_a_like_count_again() {
        let (l, u) = (Some(like(7, 9, 1)), Some(like(7, 9, -1)));
        let records = [(0, l, None), (1, u, None), (5, u, None), (6, l, None)];
        let verdicts = decide(settings(DedupeMode::IdsAndActions, 2), 0, &records);
        assert_eq!(verdicts, [(0, None), (1, None), (5, None), (6, None)]);
    }

    #[test]
    fn bad_messages_move_the_window_without_entering_it() {
        let l = Some(like(7, 9, 1));
        let records = [(0, l, Some(1)), (1, None, None), (2, l, Some(1))];
        let verdicts = decide(settings(DedupeMode::Ids, 2), 0, &records);
        assert_eq!(verdicts, [(0, None), (2, Some(Skip::EventId))]);
    }

    #[test]
    fn off_skips_nothing_and_remembers_nothing() {
        let l = like(7, 9, 1);
        let mut window = Window::new(settings(DedupeMode::Off, 10), None);
        for o in 0..5 {
            assert_eq!(window.observe(o, 0, &l, Some(id(1))), None);
        }
        assert!(window.is_empty());
    }

    #[test]
    fn the_rewind_never_passes_the_origin() {
        let s = settings(DedupeMode::Ids, 100);
        assert_eq!(s.rewind(0, 1_000), 900);
        assert_eq!(s.rewind(950, 1_000), 950);
        assert_eq!(s.rewind(0, 50), 0);
        assert_eq!(s.rewind(1_000, 1_000), 1_000);
    }

    #[test]
    fn the_window_reports_the_time_it_covers() {
        let l = like(7, 9, 1);
        let mut window = Window::new(settings(DedupeMode::Ids, 2), Some(0));
        window.observe(0, 1_000, &l, Some(id(1)));
        window.observe(1, 4_000, &l, Some(id(2)));
        assert_eq!(window.covers_seconds(), 3.0);
        window.observe(2, 6_000, &l, Some(id(3)));
        window.observe(3, 7_000, &l, Some(id(4)));
        // Offset 3's window is 1..=2; 0 has left.
        assert_eq!(window.covers_seconds(), 3.0);
        assert_eq!(window.len(), 3);
    }

    fn records() -> impl Strategy<Value = Vec<Record>> {
        // Few posts, users and ids, so repeats are common; some offsets hold
        // no record (markers) and some a bad message.
        let record = (0u8..10, 1u64..3, 0u64..3, any::<bool>(), 0u64..6).prop_map(
            |(kind, post, user, like_it, event)| match kind {
                0 => None,
                1 => Some((None, None)),
                _ => Some((
                    Some(like(post, user, if like_it { 1 } else { -1 })),
                    (event > 1).then_some(event),
                )),
            },
        );
        prop::collection::vec(record, 0..200).prop_map(|slots| {
            slots
                .into_iter()
                .enumerate()
                .filter_map(|(o, r)| r.map(|(l, e)| (o as i64, l, e)))
                .collect()
        })
    }

    proptest! {
        /// An owner that starts anywhere, re-reading from where `rewind`
        /// says, reaches the verdicts of one that read the whole log from
        /// the origin: the state agrees with any fence.
        #[test]
        fn every_owner_reaches_the_same_verdicts(
            log in records(),
            span in 1u64..40,
            origin in 0i64..30,
            cuts in prop::collection::vec(0i64..230, 0..6),
            actions in any::<bool>(),
        ) {
            let mode = if actions { DedupeMode::IdsAndActions } else { DedupeMode::Ids };
            let s = settings(mode, span);
            let log: Vec<Record> = log.into_iter().filter(|r| r.0 >= origin).collect();
            let whole = decide(s, origin, &log);
            let mut cuts = cuts;
            cuts.sort_unstable();
            for resume in cuts.into_iter().map(|c| c.max(origin)) {
                let from = s.rewind(origin, resume);
                let mut window = Window::new(s, Some(from));
                for &(offset, like, event) in log.iter().filter(|r| r.0 >= from) {
                    let verdict = match like {
                        Some(like) => window.observe(offset, 0, &like, event.map(id)),
                        None => { window.pass(offset); None }
                    };
                    if offset >= resume && like.is_some() {
                        let expected = whole.iter().find(|(o, _)| *o == offset).unwrap().1;
                        prop_assert_eq!(verdict, expected, "offset {} resumed at {}", offset, resume);
                    }
                }
            }
        }

        /// Memory never exceeds the window: at most `span` entries of each
        /// kind, and the record just decided.
        #[test]
        fn the_window_holds_at_most_span_entries(log in records(), span in 1u64..40) {
            let mut window = Window::new(settings(DedupeMode::IdsAndActions, span), Some(0));
            for &(offset, like, event) in &log {
                if let Some(like) = like {
                    window.observe(offset, 0, &like, event.map(id));
                }
                prop_assert!(window.id_order.len() <= span as usize + 1);
                prop_assert!(window.action_order.len() <= span as usize + 1);
                prop_assert!(window.ids.len() <= window.id_order.len());
                prop_assert!(window.actions.len() <= window.action_order.len());
            }
        }

        /// With whole-log knowledge, the skipped records are exactly the
        /// repeats a brute-force reading of the rule finds.
        #[test]
        fn verdicts_follow_the_rule(log in records(), span in 1u64..40) {
            let s = settings(DedupeMode::IdsAndActions, span);
            let verdicts = decide(s, 0, &log);
            for (offset, verdict) in verdicts {
                let (_, Some(l), e) = *log.iter().find(|r| r.0 == offset).unwrap() else { unreachable!() };
                let mut earlier = log.iter().filter(|r| r.0 < offset && r.0 >= offset - span as i64);
                let expected = match e {
                    Some(e) => earlier
                        .filter(|r| r.2 == Some(e) && r.1 == Some(l))
                        .count()
                        .gt(&0)
                        .then_some(Skip::EventId),
                    None => earlier
                        .rfind(|r| r.2.is_none() && r.1.is_some_and(|x| (x.post_id, x.user_id) == (l.post_id, l.user_id)))
                        .is_some_and(|r| r.1.unwrap().delta == l.delta)
                        .then_some(Skip::RepeatAction),
                };
                prop_assert_eq!(verdict, expected, "offset {}", offset);
            }
        }
    }
}
