//! Producers that deliver at least once: records repeated by id (an outbox relay publishing
//! again, some in the same batch, some minutes of event time later), id-less double taps and
//! like-like-unlike sequences, with SIGKILLs and a rebalance between a record and its repeat.
//! With `--dedupe ids-and-actions`, every post's count must equal a truth that counts each like
//! once, and `tally verify` must agree with the store under the same rule.

mod common;

use std::collections::{HashMap, VecDeque};
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::*;

const PARTITIONS: i32 = 4;
/// Offsets per partition the window spans; every repeat lands closer than this.
const WINDOW: usize = 4_000;
/// How far back (records of its partition) a repeat may reach.
const REACH: usize = 1_500;
/// Event time per record: `REACH` records are 7.5 minutes.
const TICK_MS: i64 = 300;

/// Records with repeats, and the truth of the likes they stand for.
struct Dupes {
    rng: StdRng,
    seed: u64,
    clock_ms: i64,
    next_id: u64,
    posts: Vec<u64>,
    /// Per partition, the last `REACH` records (value, has an id).
    recent: Vec<VecDeque<(Vec<u8>, bool)>>,
    /// Pairs liked with an id, to unlike later.
    liked: Vec<(u64, u64)>,
    /// Id-less pairs and whether the user likes the post now.
    tapping: Vec<((u64, u64), bool)>,
    truth: HashMap<u64, i64>,
    records: usize,
    id_repeats: usize,
    action_repeats: usize,
}

impl Dupes {
    fn new(seed: u64) -> Dupes {
        let mut rng = StdRng::seed_from_u64(seed);
        let posts = (0..40).map(|_| rng.random_range(1..1u64 << 50)).collect();
        Dupes {
            rng,
            seed,
            clock_ms: now_ms() - 3_600_000,
            next_id: 0,
            posts,
            recent: vec![VecDeque::new(); PARTITIONS as usize],
            liked: Vec::new(),
            tapping: Vec::new(),
            truth: HashMap::new(),
            records: 0,
            id_repeats: 0,
            action_repeats: 0,
        }
    }

    fn partition_of(post: u64, user: u64) -> i32 {
        (post.wrapping_mul(31).wrapping_add(user) % PARTITIONS as u64) as i32
    }

    fn push(&mut self, out: &mut Vec<Msg>, partition: i32, value: Vec<u8>, id: bool) {
        self.clock_ms += TICK_MS;
        self.records += 1;
        let recent = &mut self.recent[partition as usize];
        recent.push_back((value.clone(), id));
        if recent.len() > REACH {
            recent.pop_front();
        }
        out.push((None, value, partition));
    }

    fn count(&mut self, post: u64, delta: i64) {
        *self.truth.entry(post).or_insert(0) += delta;
    }

    /// Appends about `n` records.
    fn grow(&mut self, n: usize) -> Vec<Msg> {
        let mut out = Vec::with_capacity(n + 3);
        while out.len() < n {
            let roll = self.rng.random_range(0..100);
            if roll < 40 || (roll < 50 && self.liked.is_empty()) {
                let post = self.posts[self.rng.random_range(0..self.posts.len())];
                let user: u64 = self.rng.random();
                let value = self.with_id(post, user, LIKE);
                self.liked.push((post, user));
                self.count(post, 1);
                self.push(&mut out, Self::partition_of(post, user), value, true);
            } else if roll < 50 {
                let i = self.rng.random_range(0..self.liked.len());
                let (post, user) = self.liked.swap_remove(i);
                let value = self.with_id(post, user, UNLIKE);
                self.count(post, -1);
                self.push(&mut out, Self::partition_of(post, user), value, true);
            } else if roll < 68 {
                // A relay publishing again: one of the last records carrying an id of a
                // partition, often the very last (same batch), else up to `REACH` back.
                let p = self.rng.random_range(0..PARTITIONS) as usize;
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
                let p = Self::partition_of(pair.0, pair.1);
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
                let p = Self::partition_of(pair.0, pair.1);
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

fn dedupe_args(run: &Scenario, redis: &RedisServer) -> Vec<String> {
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--dedupe",
            "ids-and-actions",
            "--dedupe-window",
            &WINDOW.to_string(),
            // Small batches: a record and its repeat often straddle a batch, a kill or a
            // rebalance.
            "--batch-max-events",
            "300",
            "--flush-interval-ms",
            "30",
        ]
        .map(String::from),
    );
    args
}

/// `tally verify` with `args` (those of `tally run`), deciding repeats by `mode`.
fn verify(args: &[String], mode: &str) -> String {
    let mut all = vec!["verify".to_string()];
    all.extend(args.iter().cloned());
    let at = all
        .iter()
        .position(|a| a == "--dedupe")
        .expect("--dedupe given");
    all[at + 1] = mode.to_string();
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    output_text(&tally_cli(&refs))
}

#[test]
fn repeats_count_once_through_kills_and_a_rebalance() {
    let run = Scenario::new("e2e_dedupe", "dedupe", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut dupes = Dupes::new(run.seed);
    let args = dedupe_args(&run, &redis);
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut with_metrics = args.clone();
    with_metrics.extend(["--metrics-addr".to_string(), metrics.clone()]);
    let started = Instant::now();

    let mut a = Tally::spawn_args("tally-a", &with_metrics);
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    thread::sleep(Duration::from_secs(3));
    // A kill while batches land: the next owner re-reads the window below its fences.
    a.kill9();
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    a = Tally::spawn_args("tally-a2", &with_metrics);
    thread::sleep(Duration::from_secs(2));
    // A second member: partitions move, and each new owner rebuilds their windows.
    let mut b = Tally::spawn_args("tally-b", &args);
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    thread::sleep(Duration::from_secs(4));
    b.kill9();
    produce(&run.brokers, &run.topic, dupes.grow(6_000));

    let hwms = run.hwms(dupes.records);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(180), || {
        a.assert_running()
    });
    eprintln!(
        "[e2e_dedupe] {} records ({} repeated ids, {} repeated actions) applied in {:.1} s",
        dupes.records,
        dupes.id_repeats,
        dupes.action_repeats,
        started.elapsed().as_secs_f64()
    );
    run.assert_exact(&mut conn, &dupes.truth);

    let text = scrape_metrics(&metrics);
    let skipped = |reason: &str| {
        metric_value(
            &text,
            &format!("tally_duplicates_skipped_total{{reason=\"{reason}\"}}"),
        )
        .unwrap_or(0.0)
    };
    eprintln!(
        "[e2e_dedupe] after its restart tally-a skipped {} repeated ids, {} repeated actions",
        skipped("event_id"),
        skipped("repeat_action")
    );
    assert!(
        skipped("event_id") > 0.0 && skipped("repeat_action") > 0.0,
        "{text}"
    );

    // verify walks the log from the origin by the same rule; without it, the repeats are
    // drift.
    let same = verify(&args, "ids-and-actions");
    assert!(same.contains("; 0 drift"), "{same}");
    let off = verify(&args, "off");
    assert!(!off.contains("; 0 drift"), "{off}");

    let status = a.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "{}", a.log_tail(30));
}
