//! The default bucket count changes from 16 to 1 and back to 16 under live traffic, with
//! `tally rebucket`, on a single server and on a 3-primary cluster. Two consumers whose routing
//! caches refresh at very different rates (100 ms and 2 s) count throughout, and each is
//! SIGKILLed right after one of the changes. A reader opened before the first change, whose idea
//! of the default layout is therefore stale, keeps checking that it never sums less than the
//! keys writers have filled. At the end every count equals the ground truth (by key scan, through
//! `tally count` and the library's reader, none given a layout flag), both new epochs hold keys,
//! `tally verify` reports no drift, and a start with the old `--buckets` is refused.

mod cluster;
mod common;
mod library;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use cluster::RedisCluster;
use common::*;

const PARTITIONS: i32 = 6;
const GROUPS: u32 = 16;
/// A post that only gains likes, so a reader may check it never reads low.
const WATCHED: u64 = 555_000_555;

/// The store under test: a single redis-server or a cluster.
enum Store {
    Single(RedisServer),
    Cluster(RedisCluster),
}

impl Store {
    fn url(&self) -> String {
        match self {
            Store::Single(redis) => redis.url(),
            Store::Cluster(cluster) => cluster.url(),
        }
    }

    fn slot_groups(&self) -> u32 {
        match self {
            Store::Single(_) => 1,
            Store::Cluster(_) => GROUPS,
        }
    }

    /// Every counter of `post` with its value, named as its string key (without a cluster's
    /// tag), in either layout, found by scanning every primary.
    fn counters(&self, prefix: &str, post: u64) -> HashMap<String, i64> {
        match self {
            Store::Single(redis) => post_counters(&mut redis.conn(), prefix, post)
                .into_iter()
                .collect(),
            Store::Cluster(cluster) => cluster
                .post_places(prefix, post)
                .into_iter()
                .map(|place| (place.name, place.value))
                .collect(),
        }
    }

    /// The sum of `post`'s counters: what writers have applied so far.
    fn scanned(&self, prefix: &str, post: u64) -> i64 {
        self.counters(prefix, post).values().sum()
    }

    fn counts(&self, prefix: &str) -> HashMap<u64, i64> {
        match self {
            Store::Single(redis) => read_counts(&mut redis.conn(), prefix),
            Store::Cluster(cluster) => cluster.read_counts(prefix),
        }
    }

    fn wait_applied(&self, run: &Scenario, events: usize, mut check: impl FnMut()) {
        let hwms = run.hwms(events);
        let timeout = Duration::from_secs(180);
        match self {
            Store::Single(redis) => run.wait_applied(&mut redis.conn(), &hwms, timeout, check),
            Store::Cluster(cluster) => cluster.wait_applied(
                &run.prefix,
                &run.group,
                &run.topic,
                &hwms,
                GROUPS as usize,
                timeout,
                &mut check,
            ),
        }
    }
}

/// `tally rebucket --to-buckets n`; its stdout.
fn rebucket(store: &Store, run: &Scenario, n: u32) -> String {
    let out = tally_cli(&[
        "rebucket",
        "--to-buckets",
        &n.to_string(),
        "--redis",
        &store.url(),
        "--prefix",
        &run.prefix,
    ]);
    assert!(out.status.success(), "rebucket {n}: {}", output_text(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("[e2e_rebucket] {}", text.trim());
    text
}

fn rebucket_under_live_traffic(name: &str, store: Store) {
    let run = Scenario::new(name, name, PARTITIONS);
    let url = store.url();
    let mut base = run.tally_args(&url);
    base.extend(["--slot-groups", &store.slot_groups().to_string()].map(String::from));
    // Detection off: the watched post must follow the default layout, not a version of its own.
    base.extend(["--promote-above", "0"].map(String::from));
    let consumer = |name: &str, buckets: u32, refresh_ms: &str| {
        let mut args = base.clone();
        args.extend(
            [
                "--buckets",
                &buckets.to_string(),
                "--route-refresh-ms",
                refresh_ms,
            ]
            .map(String::from),
        );
        Tally::spawn_args(name, &args)
    };
    let mut fast = consumer("fast-cache", 16, "100");
    let mut slow = consumer("slow-cache", 16, "2000");

    let background = run.stream(
        Workload::new(run.seed, PARTITIONS),
        400,
        Duration::from_millis(100),
    );
    let watched = run.hot_likes(
        WATCHED,
        30,
        PARTITIONS,
        Duration::from_millis(100),
        run.seed ^ 7,
    );
    let stop = watched.stop_flag();

    // The reader is opened now, so the default layout it remembers is the one before the first
    // change; it learns of each change only from its own reads.
    let store = Arc::new(store);
    let checks = Arc::new(AtomicU64::new(0));
    let reader = {
        let (url, prefix, stop, checks, store) = (
            url.clone(),
            run.prefix.clone(),
            stop.clone(),
            checks.clone(),
            store.clone(),
        );
        let slot_groups = store.slot_groups();
        thread::spawn(move || {
            let (rt, reader) = library::reader(&url, &prefix, slot_groups, 16, Duration::ZERO);
            while !stop.load(Ordering::SeqCst) {
                let scanned = store.scanned(&prefix, WATCHED);
                let read = rt.block_on(reader.count(WATCHED)).expect("reader count");
                assert!(
                    read.likes >= scanned,
                    "reader returned {} for the watched post after a scan found {scanned}",
                    read.likes
                );
                checks.fetch_add(1, Ordering::SeqCst);
                thread::sleep(Duration::from_millis(50));
            }
        })
    };

    thread::sleep(Duration::from_secs(4));
    assert!(rebucket(&store, &run, 1).contains("16 -> 1"));
    // Killed inside the grace: its partitions are replayed by a consumer whose cache is older.
    thread::sleep(Duration::from_secs(3));
    fast.kill9();
    thread::sleep(Duration::from_secs(4));
    slow.assert_running();
    let mut fast = consumer("fast-cache-2", 1, "100");
    // A start that repeats the old count is refused, naming the count in force.
    let mut stale = base.clone();
    stale.extend(["--buckets", "16"].map(String::from));
    let stderr = refusal_line(&run_refused(&stale));
    assert!(
        stderr.contains("--buckets 16 does not match the layout record")
            && stderr.contains("written with 16, rebucketed to 1: ")
            && stderr.contains("run with --buckets 1"),
        "{stderr}"
    );
    thread::sleep(Duration::from_secs(3));
    assert!(rebucket(&store, &run, 16).contains("1 -> 16"));
    // Killed right after the switch: its partitions are replayed across it.
    thread::sleep(Duration::from_secs(6));
    slow.kill9();
    thread::sleep(Duration::from_secs(2));
    let mut slow = consumer("slow-cache-2", 16, "2000");
    thread::sleep(Duration::from_secs(4));

    let watched_likes = watched.stop();
    reader.join().expect("reader thread");
    let workload = background.stop();
    let mut truth = workload.truth.clone();
    *truth.entry(WATCHED).or_insert(0) += watched_likes as i64;
    let events = workload.events.len() + watched_likes as usize;
    store.wait_applied(&run, events, || {
        fast.assert_running();
        slow.assert_running();
    });
    assert_counts_eq(&store.counts(&run.prefix), &truth);

    // Each epoch took likes: version 0 before the first change, d1 (one bucket) between the
    // two, d2 (sixteen) after.
    let head = format!("{}:likes:{WATCHED}:", run.prefix);
    let counters = store.counters(&run.prefix, WATCHED);
    let of = |tag: &str| {
        counters
            .keys()
            .filter(|k| k[head.len()..].starts_with(tag))
            .count()
    };
    assert_eq!(of("d1:b"), 1, "the one-bucket epoch: {counters:?}");
    assert!(of("d2:b") > 8, "the second epoch spreads over 16 buckets");
    assert!(of("d3:") == 0 && of("v") == 0, "no other version");

    // Readers need no layout flag.
    let common = ["--redis", url.as_str(), "--prefix", run.prefix.as_str()];
    let out = tally_cli(&[&["count", &WATCHED.to_string(), "--json"], &common[..]].concat());
    assert!(out.status.success(), "count: {}", output_text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json[0]["likes"].as_i64(), Some(truth[&WATCHED]), "{json}");
    let (rt, reader) = library::reader(&url, &run.prefix, store.slot_groups(), 16, Duration::ZERO);
    let posts: Vec<u64> = truth.keys().copied().collect();
    for chunk in posts.chunks(1_000) {
        for count in rt.block_on(reader.counts(chunk)).expect("reader counts") {
            assert_eq!(count.likes, truth[&count.post_id], "post {}", count.post_id);
        }
    }

    // A recount of the log agrees with every stored count.
    let mut verify = vec!["verify".to_string()];
    verify.extend(base.iter().cloned());
    verify.extend(["--buckets", "16"].map(String::from));
    let verify: Vec<&str> = verify.iter().map(String::as_str).collect();
    let out = tally_cli(&verify);
    assert!(out.status.success(), "verify: {}", output_text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("; 0 drift"),
        "{}",
        output_text(&out)
    );

    // Back at the record's count, the record's wording.
    let mut stale = base.clone();
    stale.extend(["--buckets", "1"].map(String::from));
    let stderr = refusal_line(&run_refused(&stale));
    assert!(
        stderr.contains("--buckets 1 does not match the layout record")
            && stderr.contains("written with 16: run with --buckets 16"),
        "{stderr}"
    );
    assert!(rebucket(&store, &run, 16).contains("already 16"));
    eprintln!(
        "[e2e_rebucket] {events} events, watched post {} likes, {} reader checks, {} posts exact",
        truth[&WATCHED],
        checks.load(Ordering::SeqCst),
        posts.len()
    );
    assert!(checks.load(Ordering::SeqCst) > 50);
    for tally in [&mut fast, &mut slow] {
        assert!(tally.sigterm_and_wait(Duration::from_secs(30)).success());
    }
}

#[test]
fn default_bucket_count_changes_under_traffic_on_one_server() {
    rebucket_under_live_traffic("rebucket-single", Store::Single(RedisServer::start()));
}

#[test]
fn default_bucket_count_changes_under_traffic_on_a_cluster() {
    rebucket_under_live_traffic(
        "rebucket-cluster",
        Store::Cluster(RedisCluster::start(3, 0)),
    );
}
