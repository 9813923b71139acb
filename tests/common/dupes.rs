//! A producer that delivers at least once: records with event ids, a share of them published
//! again (same id, a new offset: some right after the first copy, so in the same batch, some up
//! to `reach` records of the partition later), double taps and like-like-unlike sequences, with
//! a truth that counts each like once.
//!
//! A double tap is one action sent twice. What ids its copies carry is the [`Taps`] mix: none
//! (an app without ids), a fresh id on each copy (what most mobile clients do: every tap is an
//! event of its own to them), or an id on one copy only (an app upgraded between the taps, a
//! retry through another path).
//!
//! The truth is written as the records are made, from what each one stands for, never from
//! tally's rule: a relay's repeat adds nothing to it, the first copy of a tap adds what the
//! action changes and every further copy adds nothing, whatever ids they carry. It holds for a
//! consumer whose window spans at least `reach` offsets of a partition, so that every repeat
//! lands within the window of its first copy.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::scenario::Producing;
use super::topics::Msg;
use super::workload::{LIKE, UNLIKE, encode_like, encode_like_with_id, now_ms};

/// Event time per record: 1,500 records are 7.5 minutes, so repeats land minutes apart.
const TICK_MS: i64 = 300;

/// Which copies of a tap carry an event id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taps {
    /// Every way at once: some taps without ids, some with a fresh id on each copy, some with
    /// an id on one copy only.
    Mixed,
    /// Every copy of every tap carries a fresh id of its own, so every record has an id.
    FreshIds,
}

/// Records with repeats, and the truth of the likes they stand for.
pub struct Dupes {
    rng: StdRng,
    seed: u64,
    partitions: i32,
    /// How far back (records of its partition) a repeat may reach.
    reach: usize,
    taps: Taps,
    clock_ms: i64,
    next_id: u64,
    posts: Vec<u64>,
    /// Per partition, the last `reach` records (value, has an id).
    recent: Vec<VecDeque<(Vec<u8>, bool)>>,
    /// Pairs liked with an id, to unlike later.
    liked: Vec<(u64, u64)>,
    /// Tapping pairs and whether the user likes the post now.
    tapping: Vec<((u64, u64), bool)>,
    /// Expected count per post: each like once.
    pub truth: HashMap<u64, i64>,
    /// Records made, repeats included.
    pub records: usize,
    /// Records that repeat an id (a relay publishing again).
    pub id_repeats: usize,
    /// Records that repeat the user's last action on a post (a tap's second copy), whatever ids
    /// they carry.
    pub action_repeats: usize,
    /// Of those, taps whose copies each carry an id of their own.
    pub fresh_id_repeats: usize,
    /// Of those, taps with an id on one copy and none on the other.
    pub mixed_repeats: usize,
}

impl Dupes {
    /// Every kind of repeat, taps of every [`Taps::Mixed`] way.
    pub fn new(seed: u64, partitions: i32, reach: usize) -> Dupes {
        Self::with_taps(seed, partitions, reach, Taps::Mixed)
    }

    /// Every record with an id: relays' repeats, and taps with a fresh id on each copy.
    pub fn fresh_ids(seed: u64, partitions: i32, reach: usize) -> Dupes {
        Self::with_taps(seed, partitions, reach, Taps::FreshIds)
    }

    fn with_taps(seed: u64, partitions: i32, reach: usize, taps: Taps) -> Dupes {
        let mut rng = StdRng::seed_from_u64(seed);
        let posts = (0..40).map(|_| rng.random_range(1..1u64 << 50)).collect();
        Dupes {
            rng,
            seed,
            partitions,
            reach,
            taps,
            clock_ms: now_ms() - 3_600_000,
            next_id: 0,
            posts,
            recent: vec![VecDeque::new(); partitions as usize],
            liked: Vec::new(),
            tapping: Vec::new(),
            truth: HashMap::new(),
            records: 0,
            id_repeats: 0,
            action_repeats: 0,
            fresh_id_repeats: 0,
            mixed_repeats: 0,
        }
    }

    /// Records that stand for a like or unlike of their own (each must count once).
    pub fn unique(&self) -> usize {
        self.records - self.id_repeats - self.action_repeats
    }

    /// One line of what was made, for a test's output.
    pub fn summary(&self) -> String {
        format!(
            "{} records ({} unique): {} repeated ids, {} repeated actions \
             ({} with fresh ids, {} with an id on one copy)",
            self.records,
            self.unique(),
            self.id_repeats,
            self.action_repeats,
            self.fresh_id_repeats,
            self.mixed_repeats
        )
    }

    fn partition_of(&self, post: u64, user: u64) -> i32 {
        (post.wrapping_mul(31).wrapping_add(user) % self.partitions as u64) as i32
    }

    fn push(&mut self, out: &mut Vec<Msg>, partition: i32, value: Vec<u8>, id: bool) {
        self.clock_ms += TICK_MS;
        self.records += 1;
        let recent = &mut self.recent[partition as usize];
        recent.push_back((value.clone(), id));
        if recent.len() > self.reach {
            recent.pop_front();
        }
        out.push((None, value, partition));
    }

    fn count(&mut self, post: u64, delta: i64) {
        *self.truth.entry(post).or_insert(0) += delta;
    }

    /// Appends about `n` records.
    pub fn grow(&mut self, n: usize) -> Vec<Msg> {
        let mut out = Vec::with_capacity(n + 3);
        while out.len() < n {
            let roll = self.rng.random_range(0..100);
            if roll < 40 || (roll < 50 && self.liked.is_empty()) {
                let post = self.posts[self.rng.random_range(0..self.posts.len())];
                let user: u64 = self.rng.random();
                let value = self.with_id(post, user, LIKE);
                self.liked.push((post, user));
                self.count(post, 1);
                self.push(&mut out, self.partition_of(post, user), value, true);
            } else if roll < 50 {
                // The unlike of a pair liked with an id; now and then tapped twice, each copy
                // with a fresh id.
                let i = self.rng.random_range(0..self.liked.len());
                let (post, user) = self.liked.swap_remove(i);
                self.count(post, -1);
                let p = self.partition_of(post, user);
                let value = self.with_id(post, user, UNLIKE);
                self.push(&mut out, p, value, true);
                if self.rng.random_bool(0.25) {
                    let again = self.with_id(post, user, UNLIKE);
                    self.push(&mut out, p, again, true);
                    self.tap_repeated(true, true);
                }
            } else if roll < 68 {
                // A relay publishing again: one of the last records carrying an id of a
                // partition, often the very last (same batch), else up to `reach` back.
                let p = self.rng.random_range(0..self.partitions) as usize;
                let with_ids: Vec<usize> = (0..self.recent[p].len())
                    .filter(|&i| self.recent[p][i].1)
                    .collect();
                let Some(&last) = with_ids.last() else {
                    continue;
                };
                let i = if self.rng.random_bool(0.3) {
                    last
                } else {
                    with_ids[self.rng.random_range(0..with_ids.len())]
                };
                let value = self.recent[p][i].0.clone();
                self.id_repeats += 1;
                self.push(&mut out, p as i32, value, true);
            } else if roll < 85 {
                // A double tap: the user's next action, sent twice.
                let (pair, likes) = self.tap_pair();
                let action = if likes { UNLIKE } else { LIKE };
                self.count(pair.0, if likes { -1 } else { 1 });
                let ids = self.tap_ids();
                self.double_tap(&mut out, pair, action, ids);
                self.set_tap(pair, !likes);
            } else {
                // Like, like, unlike by a user who does not like the post.
                let (pair, likes) = self.tap_pair();
                if likes {
                    continue;
                }
                let ids = self.tap_ids();
                self.double_tap(&mut out, pair, LIKE, ids);
                let id = match self.taps {
                    Taps::Mixed => self.rng.random_bool(0.5),
                    Taps::FreshIds => true,
                };
                let unlike = self.tap_value(pair, UNLIKE, id);
                self.push(&mut out, self.partition_of(pair.0, pair.1), unlike, id);
            }
        }
        out
    }

    /// Whether the first and the second copy of a tap carry an id.
    fn tap_ids(&mut self) -> (bool, bool) {
        match self.taps {
            Taps::FreshIds => (true, true),
            Taps::Mixed => match self.rng.random_range(0..10) {
                0..4 => (false, false),
                4..7 => (true, true),
                7..9 => (true, false),
                _ => (false, true),
            },
        }
    }

    /// `action` on `pair` twice, each copy with an id of its own or none as `ids` says. An
    /// id-less tap sends the same bytes twice; a copy with an id is an event of its own, at its
    /// own time.
    fn double_tap(&mut self, out: &mut Vec<Msg>, pair: (u64, u64), action: i32, ids: (bool, bool)) {
        let p = self.partition_of(pair.0, pair.1);
        let first = self.tap_value(pair, action, ids.0);
        let second = match ids {
            (false, false) => first.clone(),
            (_, id) => self.tap_value(pair, action, id),
        };
        self.push(out, p, first, ids.0);
        self.push(out, p, second, ids.1);
        self.tap_repeated(ids.0, ids.1);
    }

    fn tap_value(&mut self, pair: (u64, u64), action: i32, id: bool) -> Vec<u8> {
        match id {
            true => self.with_id(pair.0, pair.1, action),
            false => encode_like(pair.0, pair.1, action, self.clock_ms),
        }
    }

    fn tap_repeated(&mut self, first_id: bool, second_id: bool) {
        self.action_repeats += 1;
        match (first_id, second_id) {
            (true, true) => self.fresh_id_repeats += 1,
            (false, false) => {}
            _ => self.mixed_repeats += 1,
        }
    }

    fn with_id(&mut self, post: u64, user: u64, action: i32) -> Vec<u8> {
        self.next_id += 1;
        let id = format!("outbox-{:x}-{}", self.seed & 0xffff, self.next_id);
        encode_like_with_id(post, user, action, self.clock_ms, &id)
    }

    /// A known tapping pair, or a new one.
    fn tap_pair(&mut self) -> ((u64, u64), bool) {
        if !self.tapping.is_empty() && self.rng.random_bool(0.6) {
            return self.tapping[self.rng.random_range(0..self.tapping.len())];
        }
        let post = self.posts[self.rng.random_range(0..self.posts.len())];
        let pair = (post, self.rng.random());
        self.tapping.push((pair, false));
        (pair, false)
    }

    fn set_tap(&mut self, pair: (u64, u64), likes: bool) {
        if let Some(entry) = self.tapping.iter_mut().find(|(p, _)| *p == pair) {
            entry.1 = likes;
        }
    }
}

/// A producer thread that keeps `Dupes` growing; `stop` returns it with everything produced.
pub type DupesStream = Producing<Dupes>;

impl Dupes {
    /// Starts producing `chunk` more records every `pause` until stopped.
    pub fn stream(self, brokers: &str, topic: &str, chunk: usize, pause: Duration) -> DupesStream {
        Producing::start(
            brokers,
            topic,
            self,
            move |d: &mut Dupes| d.grow(chunk),
            pause,
        )
    }
}
