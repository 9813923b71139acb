//! Dedupe: records that repeat a like already in the log change no count.
//!
//! The fence counts every log record once; a producer that delivers at least
//! once (an outbox relay that restarts, an app retrying on a new producer, a
//! double tap) writes one like as several records. Each record of a
//! partition is judged, in offset order, against the records of its window
//! (below), by two rules:
//!
//! * **the id rule** ([`DedupeMode::Ids`] and on): a record with an event id
//!   is skipped ([`Skip::EventId`]) when an earlier record of the window
//!   carries the same id for the same post, user and action;
//! * **the action rule** ([`DedupeMode::IdsAndActions`]): a record the id
//!   rule did not skip is skipped ([`Skip::RepeatAction`]) when the latest
//!   record of the same (post, user) in the window that the id rule did not
//!   skip has the same action: a like after a like, an unlike after an
//!   unlike, with or without ids on either. A record the id rule skipped is
//!   a copy of an earlier one, not an action of the user's, so it never
//!   becomes the latest action.
//!
//! The window of the record at offset `o` holds the records at offsets from
//! [`DedupeSettings::window_start`]`(o)` (the start of the block
//! [`BLOCKS`] blocks before `o`'s, a block being an eighth of `span`) up to
//! `o - 1`, and none before the first offset tally counted in the partition
//! (its origin): at least `span` offsets, less than a block more. Bad
//! messages never enter it.
//!
//! # Invariant: the verdict is a function of the log
//!
//! Whether the record at `o` is skipped depends only on the records of its
//! window, and, for the action rule, on the id verdicts of those records,
//! whose windows reach one window further back. Never on what an owner
//! happened to see before. So every owner reaches the same verdict, whatever
//! the faults between them: an owner that resumes at `r` re-reads the log from
//! [`DedupeSettings::rewind`] into a fresh [`Window`] before deciding
//! anything from `r` on (see `run::intake`), and so does every re-read after
//! a refused batch or a Redis that rolled the fence back. Nothing is stored
//! outside the log, and a skipped record is an offset the batch covers
//! without a counter, so the scripts and their Redis calls do not change.
//! `tally verify` and `tally rebuild` walk the log from the origin through
//! the same [`Window`].
//!
//! Why offsets and not timestamps: a window of the last `W` seconds of
//! record time cannot be re-read exactly. Timestamps within a partition are
//! not ordered (producer clocks, retries), so a late record could reach back
//! to any offset, and no re-read of bounded length would find every record
//! it may repeat. A window of offsets is re-read exactly, by construction,
//! and bounds memory by itself. What `span` covers in time depends on the
//! rate; operators size it with `tally plan` and watch
//! `tally_dedupe_window_seconds`.
//!
//! # Memory
//!
//! The window remembers 64-bit-class fingerprints, not records: per record,
//! a fingerprint of its keyed id and one of its (post, user) with the action,
//! in one flat table ([`fingerprints`]) of eight bytes an entry, tagged with
//! the block they were last seen in. Entering a block drops the entries of
//! the block that left the window, so every entry the table holds is in the
//! window. A full window costs at most 24 bytes per remembered record (one
//! entry a record with `ids`, two with `ids-and-actions`, in a table sized
//! for nine blocks and filled to at most [`IDS_LOAD`] or
//! [`IDS_AND_ACTIONS_LOAD`], over a window at least eight blocks long), and
//! nothing is allocated per entry.
//! With `ids-and-actions` a record's id is kept beside its (post, user), at
//! the pair's home, unless the pair is held ([`Window::decide_both`]): a
//! record of a new pair costs one walk of the table.
//! Two keys are confused when their hashes agree on the fingerprint and the
//! full-size home, 44 + log2(slots) bits (in the walk from a pair's home,
//! only when they are also of one kind, pair or id): docs/design.md gives
//! the chance.

mod fingerprints;

use fingerprints::{Byte, Fingerprints, Key};

use crate::pipeline::decode::{EventId, Like};

pub use crate::infra::config::dedupe::{
    BLOCKS, DEFAULT_WINDOW, DedupeMode, DedupeSettings, MAX_WINDOW,
};

/// Why a record was skipped; a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Skip {
    /// An earlier record in the window carries the same event id.
    EventId,
    /// A record repeating the user's last action on the post.
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

/// Blocks whose entries a window holds: its own and the [`BLOCKS`] before.
const LIVE: usize = BLOCKS as usize + 1;
/// A block's tag is its number modulo this. An entry's byte holds six bits
/// of tag, then [`PAIR`] and [`LIKED`].
const TAGS: i64 = 64;
/// Set in the byte of a (post, user) entry, clear in an id's: the two kinds
/// of entry that share a home (see [`Window::decide_both`]) are told apart
/// by it in the walk from that home.
const PAIR: u8 = 0b10;
/// Set in the byte of a (post, user) entry whose last action was a like.
const LIKED: u8 = 0b01;
/// How far a byte's tag is shifted.
const TAG_SHIFT: u32 = 2;
/// The seed of (post, user) hashes, so they never meet keyed ids.
const PAIR_SEED: u64 = 0x7a11_7a11_0dd5_eed5;
/// How full a window's table may grow before it doubles, by mode. An
/// insertion walks to the end of the run of entries it lands in, and the
/// runs shorten fast as the load falls, so each mode fills its table as
/// little as the memory a remembered record may cost (24 bytes) allows: a
/// record of `ids` leaves one entry (18 bytes at 0.5), one of
/// `ids-and-actions` two (23.1 bytes at 0.78), on a table sized for
/// [`LIVE`] blocks of which [`BLOCKS`] are always remembered.
const IDS_LOAD: f64 = 0.5;
const IDS_AND_ACTIONS_LOAD: f64 = 0.78;

/// A record's keys in the window's table (see [`Window::keys`]).
#[derive(Debug, Clone, Copy)]
pub struct Keys {
    /// The id's key at a home of its own.
    id: Option<Key>,
    /// The id's key at the pair's home (with `ids-and-actions`).
    beside: Option<Key>,
    pair: Option<Key>,
    liked: bool,
}

/// What one block of the window remembers, for the gauges.
#[derive(Debug, Clone, Copy, Default)]
struct BlockStats {
    /// Records that left an entry.
    remembered: usize,
    /// The earliest Kafka timestamp among them.
    earliest_ms: Option<i64>,
}

/// One partition's window: what the records of its last blocks said.
#[derive(Debug)]
pub struct Window {
    settings: DedupeSettings,
    /// The offset the window expects next; lower ones were already seen.
    next: Option<i64>,
    /// The block of the latest offset shown.
    block: Option<i64>,
    table: Fingerprints,
    /// Per live block (by its number modulo [`LIVE`]).
    blocks: [BlockStats; LIVE],
    newest_ms: i64,
    /// Of the entries the table dropped, those [`Window::newly_forgotten`]
    /// has told.
    forgotten_told: u64,
    /// Sweeps of the table made on entering a block.
    #[cfg(test)]
    sweeps: u64,
}

impl Window {
    /// An empty window that expects records from `from` on, or from the first
    /// one it is shown when `from` is `None`.
    pub fn new(settings: DedupeSettings, from: Option<i64>) -> Self {
        let (per_record, load) = match settings.mode {
            DedupeMode::Off => (0, fingerprints::LOAD),
            DedupeMode::Ids => (1, IDS_LOAD),
            DedupeMode::IdsAndActions => (2, IDS_AND_ACTIONS_LOAD),
        };
        let offsets = settings.block_len() as usize * LIVE;
        Window {
            settings,
            next: from,
            block: None,
            table: Fingerprints::new(per_record * offsets, load),
            blocks: [BlockStats::default(); LIVE],
            newest_ms: 0,
            forgotten_told: 0,
            #[cfg(test)]
            sweeps: 0,
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
        let keys = self.keys(like, id);
        self.decide(offset, timestamp_ms, keys)
    }

    /// The record's keys in the window's table. They depend on the record
    /// and the mode alone, so keys taken before the window is restarted or
    /// grows still decide the record after it.
    pub fn keys(&self, like: &Like, id: Option<EventId>) -> Keys {
        let mode = self.settings.mode;
        let id = id.filter(|_| mode != DedupeMode::Off);
        // The pair's hash seeds the id's: computed once for both.
        let pair = (id.is_some() || mode == DedupeMode::IdsAndActions).then(|| pair_key(like));
        let liked = like.delta > 0;
        let id = id.zip(pair).map(|(id, pair)| id_key(id, pair, liked));
        let pair = pair.filter(|_| mode == DedupeMode::IdsAndActions);
        Keys {
            id,
            beside: id.zip(pair).map(|(id, pair)| beside_key(id, pair)),
            pair,
            liked,
        }
    }

    /// Asks for the table slots `keys` will be looked up in, without waiting
    /// for them. A record's lookup is a wait for memory (its slots lie
    /// anywhere in tens of megabytes), and the waits of a run of records
    /// overlap when each is asked for before the first is decided.
    pub fn prefetch(&self, keys: &Keys) {
        // An id beside its pair is looked up in the pair's walk, and at its
        // own home only for a pair already held: that line is left to wait.
        let own = keys.id.filter(|_| keys.beside.is_none());
        for key in own.iter().chain(keys.pair.iter()) {
            self.table.prefetch(*key);
        }
    }

    /// Decides the record at `offset` whose keys [`Window::keys`] gave,
    /// and remembers it. `None`: it counts.
    pub fn decide(&mut self, offset: i64, timestamp_ms: i64, keys: Keys) -> Option<Skip> {
        self.pass(offset);
        let tag = (self.block.unwrap_or(0).rem_euclid(TAGS) as u8) << TAG_SHIFT;
        if keys.id.is_some() || keys.pair.is_some() {
            self.remember(timestamp_ms);
        }
        if let (Some(id), Some(beside), Some(pair)) = (keys.id, keys.beside, keys.pair) {
            return self.decide_both(tag, id, beside, pair, keys.liked);
        }
        if let Some(id) = keys.id
            && self.table.upsert(id, tag).is_some()
        {
            return Some(Skip::EventId);
        }
        let pair = keys.pair?;
        let byte = pair_byte(tag, keys.liked);
        let last = self.table.upsert(pair, byte)?;
        repeats(last, byte).then_some(Skip::RepeatAction)
    }

    /// [`Window::decide`] for a record with an id and a pair, whose id may
    /// be held at either of two homes: its own, or *beside* its pair (at the
    /// pair's home, told apart from the pair by [`PAIR`]). One walk from the
    /// pair's home finds the pair and the id beside it; most records are of
    /// a pair the window does not hold, and for those that walk is all.
    ///
    /// Where an id goes: beside its pair when the pair is not held, at its
    /// own home when it is. An id at its own home keeps the tag of the
    /// record that put it there; a copy that finds it puts the id beside the
    /// pair as well, with the copy's tag, and every later copy finds that
    /// one first. So an id at its own home is never newer than its pair
    /// (that record set the pair's tag too, and a pair's tag only moves
    /// on), and while the pair is not held no id of it is held at its own
    /// home: one walk decides. Only copies of a pair's distinct ids add
    /// entries beside it, so no ordinary traffic crowds a pair's home.
    fn decide_both(
        &mut self,
        tag: u8,
        id: Key,
        beside: Key,
        pair: Key,
        liked: bool,
    ) -> Option<Skip> {
        let is_pair = |byte: Byte| byte & PAIR != 0;
        let walk = self.table.walk(beside, pair, |byte| !is_pair(byte));
        if let Some(at) = walk.first {
            self.table.set_byte(at, tag);
            return Some(Skip::EventId);
        }
        let byte = pair_byte(tag, liked);
        let Some(at) = walk.second else {
            self.table
                .insert_two_walked(&walk, (pair, byte), (beside, tag));
            return None;
        };
        if self.table.contains(id) {
            self.table.insert_walked(&walk, beside, tag);
            return Some(Skip::EventId);
        }
        let last = self.table.set_byte(at, byte);
        self.table.upsert(id, tag);
        repeats(last, byte).then_some(Skip::RepeatAction)
    }

    /// Marks the record at `offset` as seen without remembering anything (a
    /// bad message): it still moves the window along.
    pub fn pass(&mut self, offset: i64) {
        debug_assert!(self.expects(offset), "records are shown in offset order");
        self.next = Some(offset + 1);
        let block = offset.div_euclid(self.settings.block_len());
        match self.block {
            Some(now) if block > now => self.enter(now, block),
            None => self.block = Some(block),
            _ => {}
        }
    }

    /// Moves from block `now` to `block`: forgets every entry last seen
    /// more than [`BLOCKS`] blocks before `block`. Entries are never older
    /// than [`BLOCKS`] blocks before `now`, so a tag (the block modulo
    /// [`TAGS`]) tells their age.
    fn enter(&mut self, now: i64, block: i64) {
        let gap = block - now;
        if gap >= LIVE as i64 {
            self.table.clear();
            self.blocks = [BlockStats::default(); LIVE];
        } else {
            // The blocks that leave are those `now + 1..=block` take the
            // places of. An entry carries the block of the last record that
            // set it, which that block counted: when the leaving blocks
            // remembered nothing, the sweep would remove nothing. So a
            // window that is not yet full (a fresh one, a re-read) sweeps
            // nothing.
            let place = |b: i64| b.rem_euclid(LIVE as i64) as usize;
            let leaving = (now + 1..=block).any(|b| self.blocks[place(b)].remembered > 0);
            if leaving {
                // Which caller's bytes (tag and action) have left: decided
                // once per tag here rather than once per slot in the sweep.
                let now_tag = now.rem_euclid(TAGS);
                let mut keep = [false; 256];
                for (byte, kept) in keep.iter_mut().enumerate() {
                    let age = (now_tag - (byte >> TAG_SHIFT) as i64).rem_euclid(TAGS);
                    *kept = age + gap <= BLOCKS;
                }
                self.table.retain(|byte| keep[usize::from(byte)]);
                #[cfg(test)]
                {
                    self.sweeps += 1;
                }
            }
            for b in now + 1..=block {
                self.blocks[place(b)] = BlockStats::default();
            }
        }
        self.block = Some(block);
    }

    fn remember(&mut self, timestamp_ms: i64) {
        let block = self.block.unwrap_or(0);
        let stats = &mut self.blocks[block.rem_euclid(LIVE as i64) as usize];
        stats.remembered += 1;
        stats.earliest_ms = Some(
            stats
                .earliest_ms
                .map_or(timestamp_ms, |t| t.min(timestamp_ms)),
        );
        self.newest_ms = self.newest_ms.max(timestamp_ms);
    }

    /// Records remembered, over the blocks of the window.
    pub fn len(&self) -> usize {
        self.blocks.iter().map(|b| b.remembered).sum()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries the table had to drop, each a key no longer remembered (see
    /// [`fingerprints`]); 0 unless keys were crafted to share a home slot
    /// (event ids a client chose, say). A drop may change a verdict, and
    /// another owner, whose table went through other re-reads, may not
    /// make the same drop: `run` reports each one.
    pub fn forgotten(&self) -> u64 {
        self.table.forgotten()
    }

    /// Entries dropped since the last call (see [`Window::forgotten`]).
    pub fn newly_forgotten(&mut self) -> u64 {
        let all = self.table.forgotten();
        let new = all - self.forgotten_told;
        self.forgotten_told = all;
        new
    }

    /// Seconds of record time between the earliest record of the oldest
    /// block still remembered and the newest record seen: about how much
    /// time the window covers now.
    pub fn covers_seconds(&self) -> f64 {
        let Some(block) = self.block else {
            return 0.0;
        };
        let oldest = (block - BLOCKS..=block)
            .map(|b| self.blocks[b.rem_euclid(LIVE as i64) as usize])
            .find(|stats| stats.remembered > 0)
            .and_then(|stats| stats.earliest_ms);
        match oldest {
            Some(oldest) => (self.newest_ms - oldest).max(0) as f64 / 1000.0,
            None => 0.0,
        }
    }

    /// Bytes the window holds on the heap, as allocated: what a remembered
    /// event costs, measured by `tally-lab bench` and priced by `tally plan`.
    pub fn heap_bytes(&self) -> usize {
        self.table.heap_bytes()
    }
}

/// The key of a record's event id, bound to its post and user (by their
/// `pair` key) and its action: the id's 128-bit hash, hashed again under a
/// seed made of 64 bits of the pair's key and the action. One id on two
/// different events gives two keys unless the two seeds coincide, a chance
/// of 2⁻⁶⁴ for two pairs, far below the fingerprint's that docs/design.md
/// counts. Hashing the id's sixteen bytes under a seed costs a third of
/// hashing them together with the post, user and action (7 against 22 ns,
/// the pair's own hash included).
fn id_key(id: EventId, pair: Key, liked: bool) -> Key {
    Key(id.keyed(pair.0 as u64 ^ u64::from(liked)))
}

/// The key of an id beside its pair: the pair's home (the high half) and
/// the id's fingerprint (the low half).
fn beside_key(id: Key, pair: Key) -> Key {
    Key((pair.0 >> 64) << 64 | u128::from(id.0 as u64))
}

/// The byte of a (post, user) entry whose last action `liked` is, in the
/// block of `tag`.
fn pair_byte(tag: u8, liked: bool) -> Byte {
    tag | PAIR | u8::from(liked)
}

/// Whether a pair's action (in `byte`) repeats the last one it held.
fn repeats(last: Byte, byte: Byte) -> bool {
    last & LIKED == byte & LIKED
}

/// The key of a record's (post, user).
fn pair_key(like: &Like) -> Key {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&like.post_id.to_le_bytes());
    bytes[8..].copy_from_slice(&like.user_id.to_le_bytes());
    Key(xxhash_rust::xxh3::xxh3_128_with_seed(&bytes, PAIR_SEED))
}

/// `n` event ids whose keys, on a like of `like`'s post by its user, share
/// one home slot in `window`'s table: what a client choosing ids to crowd
/// a table would send (for tests).
#[cfg(test)]
pub(crate) fn crowding_ids(window: &Window, like: &Like, n: usize) -> Vec<EventId> {
    let pair = pair_key(like);
    let key = |k: u64| {
        let id = EventId::of(&k.to_le_bytes());
        (id, window.table.full_home(id_key(id, pair, like.delta > 0)))
    };
    let home = key(0).1;
    (0..)
        .map(key)
        .filter(|&(_, h)| h == home)
        .map(|(id, _)| id)
        .take(n)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn every_skip_reason_is_a_registered_metric_label() {
        let labels: Vec<&str> = Skip::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(labels, crate::infra::metrics::DUPLICATE_REASONS);
    }

    fn settings(mode: DedupeMode, span: u64) -> DedupeSettings {
        DedupeSettings { mode, span }
    }

    fn like(post: u64, user: u64, delta: i64) -> Like {
        Like {
            post_id: post,
            user_id: user,
            delta,
            event_time_ms: 0,
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

    /// The verdicts of consecutive records from offset 0, in both modes
    /// that skip anything: (ids, ids-and-actions).
    fn both(records: &[(Like, Option<u64>)]) -> (Vec<Option<Skip>>, Vec<Option<Skip>>) {
        let log: Vec<Record> = records
            .iter()
            .enumerate()
            .map(|(o, &(l, e))| (o as i64, Some(l), e))
            .collect();
        let run = |mode| {
            decide(settings(mode, 1_000), 0, &log)
                .into_iter()
                .map(|(_, v)| v)
                .collect()
        };
        (run(DedupeMode::Ids), run(DedupeMode::IdsAndActions))
    }

    const LIKE: i64 = 1;
    const UNLIKE: i64 = -1;
    const ID: Option<Skip> = Some(Skip::EventId);
    const ACTION: Option<Skip> = Some(Skip::RepeatAction);

    // One test per row of the table in docs/contract.md, "Which records count".

    #[test]
    fn same_id_like_like_counts_once_in_both_modes() {
        let l = like(7, 9, LIKE);
        let (ids, actions) = both(&[(l, Some(1)), (l, Some(1))]);
        assert_eq!(ids, [None, ID]);
        assert_eq!(actions, [None, ID]);
    }

    #[test]
    fn fresh_ids_like_like_counts_once_with_actions() {
        let l = like(7, 9, LIKE);
        let (ids, actions) = both(&[(l, Some(1)), (l, Some(2))]);
        assert_eq!(ids, [None, None]);
        assert_eq!(actions, [None, ACTION]);
    }

    #[test]
    fn idless_like_like_counts_once_with_actions() {
        let l = like(7, 9, LIKE);
        let (ids, actions) = both(&[(l, None), (l, None)]);
        assert_eq!(ids, [None, None]);
        assert_eq!(actions, [None, ACTION]);
    }

    #[test]
    fn mixed_like_like_counts_once_with_actions_whichever_carries_the_id() {
        let l = like(7, 9, LIKE);
        for pair in [[(l, Some(1)), (l, None)], [(l, None), (l, Some(1))]] {
            let (ids, actions) = both(&pair);
            assert_eq!(ids, [None, None]);
            assert_eq!(actions, [None, ACTION]);
        }
    }

    #[test]
    fn like_unlike_like_counts_every_change() {
        let (l, u) = (like(7, 9, LIKE), like(7, 9, UNLIKE));
        for ids_on in [true, false] {
            let e = |n| ids_on.then_some(n);
            let (ids, actions) = both(&[(l, e(1)), (u, e(2)), (l, e(3))]);
            assert_eq!(ids, [None, None, None]);
            assert_eq!(actions, [None, None, None]);
        }
    }

    #[test]
    fn a_resent_like_after_an_unlike_is_a_copy_not_an_action() {
        // The relay sends like(1) again after unlike(2): a copy, skipped by
        // its id, and the user's last action stays the unlike, so a new
        // like (3) counts and an unlike (4) after it too.
        let (l, u) = (like(7, 9, LIKE), like(7, 9, UNLIKE));
        let (ids, actions) = both(&[(l, Some(1)), (u, Some(2)), (l, Some(1)), (l, Some(3))]);
        assert_eq!(ids, [None, None, ID, None]);
        assert_eq!(actions, [None, None, ID, None]);
        let (_, actions) = both(&[(l, Some(1)), (u, Some(2)), (l, Some(1)), (u, Some(4))]);
        assert_eq!(actions, [None, None, ID, ACTION]);
    }

    #[test]
    fn unlike_first_counts_and_unlike_unlike_counts_once() {
        let u = like(7, 9, UNLIKE);
        let (ids, actions) = both(&[(u, Some(1)), (u, Some(2)), (u, None)]);
        assert_eq!(ids, [None, None, None]);
        assert_eq!(actions, [None, ACTION, ACTION]);
    }

    #[test]
    fn actions_of_another_user_or_post_are_not_repeats() {
        let (ids, actions) = both(&[
            (like(7, 9, LIKE), Some(1)),
            (like(7, 8, LIKE), Some(2)),
            (like(6, 9, LIKE), Some(3)),
        ]);
        assert_eq!(ids, [None, None, None]);
        assert_eq!(actions, [None, None, None]);
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
        assert_eq!(verdicts, [(0, None), (1, None), (2, None), (3, ID)]);
    }

    #[test]
    fn the_window_moves_a_block_at_a_time() {
        // 16 offsets, blocks of 2: the window of offset o starts at the
        // block 8 blocks before o's, so 16 to 17 offsets back.
        let s = settings(DedupeMode::Ids, 16);
        assert_eq!(s.block_len(), 2);
        assert_eq!(s.window_start(20), 4);
        assert_eq!(s.window_start(21), 4);
        assert_eq!(s.window_start(22), 6);
        let l = Some(like(7, 9, 1));
        // Offset 4 is in the window of 20 and 21, not of 22.
        for (repeat_at, expected) in [(20, ID), (21, ID), (22, None)] {
            let verdicts = decide(s, 0, &[(4, l, Some(1)), (repeat_at, l, Some(1))]);
            assert_eq!(verdicts, [(4, None), (repeat_at, expected)], "{repeat_at}");
        }
    }

    #[test]
    fn a_block_leaving_the_window_is_swept_only_when_it_left_entries() {
        // 16 offsets, blocks of 2, nine blocks live.
        let s = settings(DedupeMode::Ids, 16);
        let l = like(7, 9, 1);
        let mut window = Window::new(s, Some(0));
        let show = |window: &mut Window, o: i64| {
            window.observe(o, 0, &l, Some(id(o as u64)));
        };
        // A window filling up: no block has left yet.
        for o in 0..18 {
            show(&mut window, o);
        }
        assert_eq!(window.sweeps, 0);
        // Blocks 9 and 10 push out blocks 0 and 1, which held records.
        for o in 18..22 {
            show(&mut window, o);
        }
        assert_eq!(window.sweeps, 2);
        // Blocks 11 to 19 of bad messages push out blocks 2 to 10.
        for o in 22..40 {
            window.pass(o);
        }
        assert_eq!(window.sweeps, 11);
        assert!(window.is_empty());
        // Block 20 pushes out block 11, which remembered nothing.
        show(&mut window, 40);
        assert_eq!(window.sweeps, 11);
        // A re-read starting anywhere fills up first as well.
        let mut reread = Window::new(s, Some(1_000));
        for o in 1_000..1_018 {
            show(&mut reread, o);
        }
        assert_eq!(reread.sweeps, 0);
    }

    #[test]
    fn an_unlike_older_than_the_window_lets_a_like_count_again() {
        let (l, u) = (Some(like(7, 9, 1)), Some(like(7, 9, -1)));
        let records = [(0, l, None), (1, u, None), (30, u, None), (31, l, None)];
        let verdicts = decide(settings(DedupeMode::IdsAndActions, 16), 0, &records);
        assert_eq!(verdicts, [(0, None), (1, None), (30, None), (31, None)]);
    }

    #[test]
    fn bad_messages_move_the_window_without_entering_it() {
        let l = Some(like(7, 9, 1));
        let records = [(0, l, Some(1)), (1, None, None), (2, l, Some(1))];
        let verdicts = decide(settings(DedupeMode::Ids, 16), 0, &records);
        assert_eq!(verdicts, [(0, None), (2, ID)]);
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
    fn the_rewind_never_passes_the_origin_and_reaches_twice_as_far_for_actions() {
        let ids = settings(DedupeMode::Ids, 800);
        assert_eq!(ids.rewind(0, 1_000), 200);
        assert_eq!(ids.rewind(950, 1_000), 950);
        assert_eq!(ids.rewind(0, 50), 0);
        assert_eq!(ids.rewind(1_000, 1_000), 1_000);
        let actions = settings(DedupeMode::IdsAndActions, 800);
        assert_eq!(actions.rewind(0, 2_050), 400);
        assert_eq!(actions.rewind(0, 1_000), 0);
    }

    #[test]
    fn the_window_reports_the_time_it_covers() {
        let l = like(7, 9, 1);
        let mut window = Window::new(settings(DedupeMode::Ids, 8), Some(0));
        window.observe(0, 1_000, &l, Some(id(1)));
        window.observe(1, 4_000, &l, Some(id(2)));
        assert_eq!(window.covers_seconds(), 3.0);
        // Offset 9's window is 1..=8: 0 has left.
        window.observe(9, 7_000, &l, Some(id(3)));
        assert_eq!(window.covers_seconds(), 3.0);
        assert_eq!(window.len(), 2);
    }

    #[test]
    fn a_full_window_costs_at_most_24_bytes_a_record() {
        // Every record with an id of its own and a pair of its own: the
        // most entries a record of each mode leaves.
        let span = 80_000u64;
        for (mode, bound) in [(DedupeMode::Ids, 18.5), (DedupeMode::IdsAndActions, 24.0)] {
            let mut window = Window::new(settings(mode, span), Some(0));
            let mut most = 0.0f64;
            for offset in 0..3 * span as i64 {
                let n = offset as u64;
                let verdict = window.observe(offset, 0, &like(1 + n % 997, n, 1), Some(id(n)));
                assert_eq!(verdict, None);
                if offset >= span as i64 && offset % 997 == 0 {
                    let per = window.heap_bytes() as f64 / window.len() as f64;
                    most = most.max(per);
                }
            }
            println!(
                "{mode:?}: heap bytes per remembered record, full window of {span}: at most {most:.2}"
            );
            assert!(most <= bound, "{mode:?}: {most}");
            assert_eq!(window.forgotten(), 0);
        }
    }

    /// Two keys whose hashes agree on the full-size home and on the top 32
    /// bits of their low half (all a 32-bit fingerprint would keep), found
    /// by a birthday search over `make(n)`.
    fn narrow_collision(window: &Window, make: impl Fn(u64) -> Key) -> (u64, u64) {
        let mut seen: HashMap<(usize, u64), u64> = HashMap::new();
        for n in 0.. {
            let key = make(n);
            let narrow = (window.table.full_home(key), (key.0 as u64) >> 32);
            if let Some(&m) = seen.get(&narrow)
                && make(m).0 as u64 != key.0 as u64
            {
                return (m, n);
            }
            seen.insert(narrow, n);
        }
        unreachable!()
    }

    #[test]
    fn ids_crafted_to_share_a_slot_are_dropped_and_counted() {
        let mut window = Window::new(settings(DedupeMode::Ids, 400), Some(0));
        let l = like(7, 9, 1);
        let ids = crowding_ids(&window, &l, 300);
        for (offset, id) in ids.iter().enumerate() {
            assert_eq!(window.observe(offset as i64, 0, &l, Some(*id)), None);
        }
        let dropped = window.forgotten();
        assert!(dropped >= 300 - 256, "{dropped} dropped");
        assert_eq!(window.newly_forgotten(), dropped);
        assert_eq!(window.newly_forgotten(), 0, "told once");
    }

    #[test]
    fn likes_that_collide_in_a_32_bit_fingerprint_both_count() {
        // Two users' likes of one post, with pair keys that a 32-bit
        // fingerprint would confuse: the second would be skipped as a repeat.
        let s = settings(DedupeMode::IdsAndActions, 16);
        let mut window = Window::new(s, Some(0));
        let (a, b) = narrow_collision(&window, |user| pair_key(&like(7, user, 1)));
        assert_eq!(window.observe(0, 0, &like(7, a, 1), None), None);
        assert_eq!(
            window.observe(1, 0, &like(7, b, 1), None),
            None,
            "users {a} and {b}"
        );
        // Ids of one user's likes of one post, held beside their pair, that
        // a 32-bit fingerprint would confuse: the second like, after an
        // unlike, would be skipped as a copy of the first.
        let mut window = Window::new(s, Some(0));
        let l = like(7, 9, 1);
        let pair = pair_key(&l);
        let (a, b) = narrow_collision(&window, |n| beside_key(id_key(id(n), pair, true), pair));
        assert_eq!(window.observe(0, 0, &l, Some(id(a))), None);
        assert_eq!(
            window.observe(1, 0, &like(7, 9, -1), Some(id(1 << 40))),
            None
        );
        assert_eq!(
            window.observe(2, 0, &l, Some(id(b))),
            None,
            "ids {a} and {b} beside their pair"
        );
        // Two likes with ids a 32-bit fingerprint would confuse.
        let s = settings(DedupeMode::Ids, 16);
        let mut window = Window::new(s, Some(0));
        let l = like(7, 9, 1);
        let (a, b) = narrow_collision(&window, |n| id_key(id(n), pair_key(&l), true));
        assert_eq!(window.observe(0, 0, &l, Some(id(a))), None);
        assert_eq!(
            window.observe(1, 0, &l, Some(id(b))),
            None,
            "ids {a} and {b}"
        );
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

    /// The rule read straight off the module doc, over the whole log.
    fn by_the_rule(s: DedupeSettings, origin: i64, log: &[Record]) -> HashMap<i64, Option<Skip>> {
        let mut verdicts: HashMap<i64, Option<Skip>> = HashMap::new();
        for &(offset, like, event) in log.iter().filter(|r| r.0 >= origin) {
            let Some(l) = like else { continue };
            let start = s.window_start(offset).max(origin);
            let earlier: Vec<&Record> = log
                .iter()
                .filter(|r| r.0 >= start && r.0 < offset && r.1.is_some())
                .collect();
            let by_id = event.is_some() && earlier.iter().any(|r| r.2 == event && r.1 == Some(l));
            let verdict = if by_id {
                Some(Skip::EventId)
            } else if s.mode == DedupeMode::IdsAndActions {
                earlier
                    .iter()
                    .rev()
                    .find(|r| {
                        let x = r.1.unwrap();
                        (x.post_id, x.user_id) == (l.post_id, l.user_id)
                            && verdicts[&r.0] != Some(Skip::EventId)
                    })
                    .is_some_and(|r| r.1.unwrap().delta == l.delta)
                    .then_some(Skip::RepeatAction)
            } else {
                None
            };
            verdicts.insert(offset, verdict);
        }
        verdicts
    }

    fn mode(actions: bool) -> DedupeMode {
        if actions {
            DedupeMode::IdsAndActions
        } else {
            DedupeMode::Ids
        }
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
            let s = settings(mode(actions), span);
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

        /// The verdicts are the rule's, read by brute force over the log,
        /// and the window holds exactly the keys of its blocks: each id once,
        /// each (post, user) with a record the id rule let through once.
        #[test]
        fn verdicts_follow_the_rule(
            log in records(),
            span in 1u64..40,
            origin in 0i64..20,
            actions in any::<bool>(),
        ) {
            let s = settings(mode(actions), span);
            let expected = by_the_rule(s, origin, &log);
            let mut window = Window::new(s, Some(origin));
            for &(offset, like, event) in log.iter().filter(|r| r.0 >= origin) {
                let Some(l) = like else { window.pass(offset); continue };
                let verdict = window.observe(offset, 0, &l, event.map(id));
                prop_assert_eq!(verdict, expected[&offset], "offset {}", offset);
                // Everything of the blocks the window holds now.
                let block = s.block_len();
                let start = ((offset.div_euclid(block) - BLOCKS) * block).max(origin);
                let held: Vec<&Record> = log
                    .iter()
                    .filter(|r| r.0 >= start && r.0 <= offset && r.1.is_some())
                    .collect();
                let ids: HashSet<(u64, u64, i64, u64)> = held
                    .iter()
                    .filter_map(|r| r.2.map(|e| { let x = r.1.unwrap(); (x.post_id, x.user_id, x.delta, e) }))
                    .collect();
                let pairs: HashSet<(u64, u64)> = held
                    .iter()
                    .filter(|r| expected[&r.0] != Some(Skip::EventId))
                    .map(|r| { let x = r.1.unwrap(); (x.post_id, x.user_id) })
                    .collect();
                let keys = ids.len() + if actions { pairs.len() } else { 0 };
                // With actions an id a copy found at its own home is held
                // beside its pair as well.
                let twice = if actions { ids.len() } else { 0 };
                let len = window.table.len();
                prop_assert!(
                    (keys..=keys + twice).contains(&len),
                    "offset {}: {} entries for {} keys", offset, len, keys
                );
            }
        }
    }
}
