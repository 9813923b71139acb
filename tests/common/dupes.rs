//! A producer that delivers at least once: records with event ids, a share of them published
//! again (same id, a new offset: some right after the first copy, so in the same batch, some up
//! to `reach` records of the partition later), id-less double taps and like-like-unlike
//! sequences, with a truth that counts each like once.
//!
//! The truth is written as the records are made, from what each one stands for, never from
//! tally's rule: a repeat adds nothing to it, an id-less action adds what it changes. It holds
//! for a consumer whose window spans at least `reach` offsets of a partition, so that every
//! repeat lands within the window of its first copy.

use std::collections::{HashMap, VecDeque};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::topics::Msg;
use super::workload::{LIKE, UNLIKE, encode_like, encode_like_with_id, now_ms};

/// Event time per record: 1,500 records are 7.5 minutes, so repeats land minutes apart.
const TICK_MS: i64 = 300;

/// Records with repeats, and the truth of the likes they stand for.
pub struct Dupes {
    rng: StdRng,
    seed: u64,
    partitions: i32,
    /// How far back (records of its partition) a repeat may reach.
    reach: usize,
    clock_ms: i64,
    next_id: u64,
    posts: Vec<u64>,
    /// Per partition, the last `reach` records (value, has an id).
    recent: Vec<VecDeque<(Vec<u8>, bool)>>,
    /// Pairs liked with an id, to unlike later.
    liked: Vec<(u64, u64)>,
    /// Id-less pairs and whether the user likes the post now.
    tapping: Vec<((u64, u64), bool)>,
    /// Expected count per post: each like once.
    pub truth: HashMap<u64, i64>,
    /// Records made, repeats included.
    pub records: usize,
    /// Records that repeat an id, and id-less records that repeat an action.
    pub id_repeats: usize,
    pub action_repeats: usize,
}

impl Dupes {
    pub fn new(seed: u64, partitions: i32, reach: usize) -> Dupes {
        let mut rng = StdRng::seed_from_u64(seed);
        let posts = (0..40).map(|_| rng.random_range(1..1u64 << 50)).collect();
        Dupes {
            rng,
            seed,
            partitions,
            reach,
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
        }
    }

    /// Records that stand for a like or unlike of their own (each must count once).
    pub fn unique(&self) -> usize {
        self.records - self.id_repeats - self.action_repeats
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
                let i = self.rng.random_range(0..self.liked.len());
                let (post, user) = self.liked.swap_remove(i);
                let value = self.with_id(post, user, UNLIKE);
                self.count(post, -1);
                self.push(&mut out, self.partition_of(post, user), value, true);
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
                // A double tap: the user's next action, sent twice without an id.
                let (pair, likes) = self.tap_pair();
                let action = if likes { UNLIKE } else { LIKE };
                self.count(pair.0, if likes { -1 } else { 1 });
                let value = encode_like(pair.0, pair.1, action, self.clock_ms);
                let p = self.partition_of(pair.0, pair.1);
                self.push(&mut out, p, value.clone(), false);
                self.push(&mut out, p, value, false);
                self.action_repeats += 1;
                self.set_tap(pair, !likes);
            } else {
                // Like, like, unlike by a user who does not like the post.
                let (pair, likes) = self.tap_pair();
                if likes {
                    continue;
                }
                let p = self.partition_of(pair.0, pair.1);
                let like = encode_like(pair.0, pair.1, LIKE, self.clock_ms);
                self.push(&mut out, p, like.clone(), false);
                self.push(&mut out, p, like, false);
                let unlike = encode_like(pair.0, pair.1, UNLIKE, self.clock_ms);
                self.push(&mut out, p, unlike, false);
                self.action_repeats += 1;
            }
        }
        out
    }

    fn with_id(&mut self, post: u64, user: u64, action: i32) -> Vec<u8> {
        self.next_id += 1;
        let id = format!("outbox-{:x}-{}", self.seed & 0xffff, self.next_id);
        encode_like_with_id(post, user, action, self.clock_ms, &id)
    }

    /// A known id-less pair, or a new one.
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
