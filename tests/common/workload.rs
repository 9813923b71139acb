//! The event encoding, by hand, and a workload generator with its own ground truth.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::topics::Msg;

/// Action values of `tally.v1.Action`.
pub const LIKE: i32 = 1;
pub const UNLIKE: i32 = 2;

/// A protobuf varint (base 128, least significant group first).
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_field(out: &mut Vec<u8>, field: u32, v: u64) {
    put_varint(out, u64::from(field) << 3); // wire type 0: varint
    put_varint(out, v);
}

/// `tally.v1.LikeEvent` as proto3 encoders write it (fields holding zero are left out).
pub fn encode_like(post_id: u64, user_id: u64, action: i32, time_ms: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity(32);
    if post_id != 0 {
        put_field(&mut out, 1, post_id);
    }
    if user_id != 0 {
        put_field(&mut out, 2, user_id);
    }
    if action != 0 {
        // enums are int32, sign-extended to 64 bits on the wire
        put_field(&mut out, 3, i64::from(action) as u64);
    }
    if time_ms != 0 {
        put_field(&mut out, 4, time_ms as u64);
    }
    out
}

/// `encode_like` with field 5, `event_id` (a string: wire type 2, its length, its bytes),
/// written after the others as proto3 encoders do; an empty id is left out.
pub fn encode_like_with_id(
    post_id: u64,
    user_id: u64,
    action: i32,
    time_ms: i64,
    event_id: &str,
) -> Vec<u8> {
    let mut out = encode_like(post_id, user_id, action, time_ms);
    if !event_id.is_empty() {
        put_varint(&mut out, (5 << 3) | 2);
        put_varint(&mut out, event_id.len() as u64);
        out.extend_from_slice(event_id.as_bytes());
    }
    out
}

/// Like `encode_like`, but every field is written even when it holds zero (also valid proto3).
pub fn encode_like_explicit(post_id: u64, user_id: u64, action: i32, time_ms: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity(40);
    put_field(&mut out, 1, post_id);
    put_field(&mut out, 2, user_id);
    put_field(&mut out, 3, i64::from(action) as u64);
    put_field(&mut out, 4, time_ms as u64);
    out
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn mix64(mut x: u64) -> u64 {
    // splitmix64 finaliser
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Likes and unlikes with a realistic shape: post popularity follows a Zipf-like law, one viral
/// post gets about a fifth of all events, and about 12% of events are unlikes of a (post, user)
/// pair that liked before. A user's like and unlike of a post go to the same partition, in order.
pub struct Workload {
    /// (partition, encoded LikeEvent), in production order.
    pub events: Vec<(i32, Vec<u8>)>,
    /// Expected count per post: LIKE = +1, UNLIKE = -1.
    pub truth: HashMap<u64, i64>,
    /// The post that gets about 20% of the events.
    pub viral_post: u64,
    pub likes: u64,
    pub unlikes: u64,
    partitions: i32,
    rng: StdRng,
    posts: Vec<u64>,
    cumulative: Vec<f64>,
    liked: Vec<(u64, u64)>,
    clock_ms: i64,
}

impl Workload {
    pub const POSTS: usize = 3000;
    pub const VIRAL_SHARE: f64 = 0.2;
    pub const UNLIKE_SHARE: f64 = 0.12;

    pub fn new(seed: u64, partitions: i32) -> Workload {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut posts = Vec::with_capacity(Self::POSTS);
        let mut seen = HashSet::new();
        while posts.len() < Self::POSTS {
            // Small ids and ids across the whole u64 range (above i64::MAX too).
            let id: u64 = if posts.len() % 2 == 0 {
                rng.random_range(1..1_000_000)
            } else {
                rng.random_range(1u64 << 40..=u64::MAX)
            };
            if seen.insert(id) {
                posts.push(id);
            }
        }
        let viral_post = loop {
            let id = rng.random_range(1..1_000_000_000u64);
            if !seen.contains(&id) {
                break id;
            }
        };
        let mut cumulative = Vec::with_capacity(Self::POSTS);
        let mut acc = 0.0;
        for rank in 0..Self::POSTS {
            acc += 1.0 / ((rank + 1) as f64).powf(1.1);
            cumulative.push(acc);
        }
        Workload {
            events: Vec::new(),
            truth: HashMap::new(),
            viral_post,
            likes: 0,
            unlikes: 0,
            partitions,
            rng,
            posts,
            cumulative,
            liked: Vec::new(),
            clock_ms: now_ms(),
        }
    }

    pub fn generate(seed: u64, events: usize, partitions: i32) -> Workload {
        let mut w = Workload::new(seed, partitions);
        w.grow(events);
        w
    }

    fn pick_post(&mut self) -> u64 {
        if self.rng.random_bool(Self::VIRAL_SHARE) {
            return self.viral_post;
        }
        let total = *self.cumulative.last().unwrap();
        let x = self.rng.random_range(0.0..total);
        let rank = self.cumulative.partition_point(|&c| c <= x);
        self.posts[rank.min(self.posts.len() - 1)]
    }

    pub fn partition_of(&self, post_id: u64, user_id: u64) -> i32 {
        (mix64(post_id ^ mix64(user_id)) % self.partitions as u64) as i32
    }

    /// Appends `n` events; returns the index range of the new ones in `events`.
    pub fn grow(&mut self, n: usize) -> std::ops::Range<usize> {
        let start = self.events.len();
        for _ in 0..n {
            self.clock_ms += 1;
            let unlike = !self.liked.is_empty() && self.rng.random_bool(Self::UNLIKE_SHARE);
            let (post, user, action) = if unlike {
                let i = self.rng.random_range(0..self.liked.len());
                let (post, user) = self.liked.swap_remove(i);
                (post, user, UNLIKE)
            } else {
                let post = self.pick_post();
                let user = self.rng.random_range(1..=u64::MAX);
                self.liked.push((post, user));
                (post, user, LIKE)
            };
            let delta = if action == LIKE { 1 } else { -1 };
            if action == LIKE {
                self.likes += 1;
            } else {
                self.unlikes += 1;
            }
            *self.truth.entry(post).or_insert(0) += delta;
            let partition = self.partition_of(post, user);
            self.events
                .push((partition, encode_like(post, user, action, self.clock_ms)));
        }
        start..self.events.len()
    }

    /// Messages (no key) for `produce`, for the events in `range`.
    pub fn messages(&self, range: std::ops::Range<usize>) -> Vec<Msg> {
        self.events[range]
            .iter()
            .map(|(p, v)| (None, v.clone(), *p))
            .collect()
    }

    pub fn describe(&self) -> String {
        let viral = self.truth.get(&self.viral_post).copied().unwrap_or(0);
        format!(
            "{} events ({} likes, {} unlikes) over {} posts; viral post {} at {}",
            self.events.len(),
            self.likes,
            self.unlikes,
            self.truth.len(),
            self.viral_post,
            viral
        )
    }
}

/// Panics with a readable diff unless `actual` equals `truth` for every post. Posts whose count
/// is zero are ignored on both sides (a like followed by its unlike may leave a key holding 0).
pub fn assert_counts_eq(actual: &HashMap<u64, i64>, truth: &HashMap<u64, i64>) {
    let nonzero = |m: &HashMap<u64, i64>| -> BTreeMap<u64, i64> {
        m.iter()
            .filter(|(_, v)| **v != 0)
            .map(|(k, v)| (*k, *v))
            .collect()
    };
    let a = nonzero(actual);
    let t = nonzero(truth);
    if a == t {
        return;
    }
    let mut diffs = Vec::new();
    for (post, want) in &t {
        let got = a.get(post).copied().unwrap_or(0);
        if got != *want {
            diffs.push((*post, *want, got));
        }
    }
    for (post, got) in &a {
        if !t.contains_key(post) {
            diffs.push((*post, 0, *got));
        }
    }
    diffs.sort_by_key(|(_, want, got)| std::cmp::Reverse((got - want).abs()));
    let sum_a: i64 = a.values().sum();
    let sum_t: i64 = t.values().sum();
    let mut msg = format!(
        "counts differ for {} posts (expected total {sum_t}, got {sum_a}, {} posts expected, {} found); largest differences:\n",
        diffs.len(),
        t.len(),
        a.len()
    );
    for (post, want, got) in diffs.iter().take(25) {
        let _ = writeln!(
            msg,
            "  post {post}: expected {want}, got {got} ({:+})",
            got - want
        );
    }
    panic!("{msg}");
}
