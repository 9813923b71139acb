//! Hot posts under live traffic: two consumers whose routing caches refresh at very different
//! rates (100 ms and 2 s) count a post that turns hot; it is promoted automatically, then demoted
//! and promoted again by hand, and one consumer is SIGKILLed after that. Meanwhile a reader keeps
//! checking that it never sums less than the keys a writer has already filled, and at the end
//! every post's count (by key scan and through the library's reader) equals the ground truth.

mod common;
mod library;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

const PARTITIONS: i32 = 6;
const HOT: u64 = 777_000_777;
/// Likes of the hot post per round, spread over every partition.
const HOT_PER_ROUND: usize = 60;
const ROUND: Duration = Duration::from_millis(100);

/// The sum of every counter of `post`, found by SCAN: what writers have applied so far, and
/// the counters, named as their string keys.
fn scanned_sum(conn: &mut redis::Connection, prefix: &str, post: u64) -> (i64, Vec<String>) {
    let counters = post_counters(conn, prefix, post);
    (counters.values().sum(), counters.into_keys().collect())
}

#[test]
fn promotion_and_manual_routing_changes_keep_counts_exact() {
    let run = Scenario::new("e2e_hot", "hot", PARTITIONS);
    let redis = RedisServer::start();
    let url = redis.url();

    let consumer = |name: &str, refresh_ms: &str| {
        let mut args = run.tally_args(&url);
        let metrics = format!("127.0.0.1:{}", free_port());
        args.extend(
            [
                "--buckets",
                "4",
                "--promote-above",
                "50",
                "--hot-buckets",
                "32",
                "--route-refresh-ms",
                refresh_ms,
                "--metrics-addr",
                &metrics,
            ]
            .map(String::from),
        );
        (Tally::spawn_args(name, &args), metrics)
    };
    let (mut first, _) = consumer("fast-cache", "100");
    let (mut slow, slow_metrics) = consumer("slow-cache", "2000");

    // Background traffic with its own truth, plus likes-only traffic of the hot post.
    let background = run.stream(
        Workload::new(run.seed, PARTITIONS),
        150,
        Duration::from_millis(100),
    );
    let hot_producer = run.hot_likes(HOT, HOT_PER_ROUND, PARTITIONS, ROUND, run.seed ^ 0x5eed);
    let stop = hot_producer.stop_flag();

    // The reader's view must never be below what a key scan found just before it: the hot post
    // only gains likes, so a smaller read would mean keys a writer used were left out.
    let reader_checks = Arc::new(AtomicU64::new(0));
    let reader = {
        let (url, prefix, stop, checks) = (
            url.clone(),
            run.prefix.clone(),
            stop.clone(),
            reader_checks.clone(),
        );
        let mut conn = redis.conn();
        thread::spawn(move || {
            let (rt, reader) = library::reader(&url, &prefix, 1, 4, Duration::ZERO);
            while !stop.load(Ordering::SeqCst) {
                let (scanned, _) = scanned_sum(&mut conn, &prefix, HOT);
                let read = rt.block_on(reader.count(HOT)).expect("reader count");
                assert!(
                    read.likes >= scanned,
                    "reader returned {} for the hot post after a scan found {scanned}",
                    read.likes
                );
                checks.fetch_add(1, Ordering::SeqCst);
                thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let route_key = format!("{}:route:{HOT}", run.prefix);
    let mut conn = redis.conn();
    // Any version may be the automatic one: when both consumers promote the post at once, each
    // reserves a number and only one is published (the other's `v<k>` field is dropped again).
    // The route hash's `version` field names a version only once it has been published.
    let promoted_at = Instant::now();
    let auto_version: u32 = wait_for("automatic promotion", Duration::from_secs(60), || {
        first.assert_running();
        slow.assert_running();
        let current: Option<u32> = redis::cmd("HGET")
            .arg(&route_key)
            .arg("version")
            .query(&mut conn)
            .unwrap();
        current
    });
    eprintln!(
        "[e2e_hot] promoted to version {auto_version} after {:.1} s",
        promoted_at.elapsed().as_secs_f64()
    );

    // Writers move to the promoted version only for events stamped 5 s after publication.
    thread::sleep(Duration::from_secs(7));
    let common = ["--redis", url.as_str(), "--prefix", run.prefix.as_str()];
    let hot = HOT.to_string();
    let demoted = tally_cli(&[&["demote", &hot, "--to-buckets", "2"], &common[..4]].concat());
    assert!(demoted.status.success(), "demote: {demoted:?}");
    let refused = tally_cli(&[&["promote", &hot, "--to-buckets", "2"], &common[..4]].concat());
    assert!(
        !refused.status.success(),
        "promoting to 2 buckets again must be refused"
    );
    thread::sleep(Duration::from_secs(7));
    let promoted = tally_cli(&[&["promote", &hot, "--to-buckets", "48"], &common[..4]].concat());
    assert!(promoted.status.success(), "promote: {promoted:?}");
    thread::sleep(Duration::from_secs(2));
    // A crash while writers are about to switch: its partitions are replayed by the other
    // consumer, whose cache is much younger or older.
    first.kill9();
    thread::sleep(Duration::from_secs(8));
    let (mut fast, fast_metrics) = consumer("fast-cache-2", "100");
    thread::sleep(Duration::from_secs(4));

    let hot_likes = hot_producer.stop();
    reader.join().expect("reader thread");
    let workload = background.stop();
    let mut truth: HashMap<u64, i64> = workload.truth.clone();
    *truth.entry(HOT).or_insert(0) += hot_likes as i64;
    let total: i64 = workload.events.len() as i64 + hot_likes as i64;
    let hwms = run.hwms(total as usize);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        fast.assert_running();
        slow.assert_running();
    });
    run.assert_exact(&mut conn, &truth);

    // Every version was written to: v0 before the promotion, then 32, 2 and 48 buckets. Version
    // numbers may skip: a consumer whose cache had not seen the promotion yet, or that promoted
    // at the same moment as the other, reserves a number, is refused by the registry, and gives
    // the number back.
    let fields: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(&route_key)
        .query(&mut conn)
        .unwrap();
    let mut versions: Vec<(u32, u32)> = fields
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix('v')?.parse().ok()?, v.parse().ok()?)))
        .collect();
    versions.sort_unstable();
    let buckets: Vec<u32> = versions.iter().map(|&(_, n)| n).collect();
    // The demoted post is still hot, so detection may promote it again (to 32) before the
    // manual promotion to 48; after that, 48 >= 32 leaves it alone.
    assert!(
        buckets.starts_with(&[4, 32, 2])
            && buckets.last() == Some(&48)
            && buckets[3..buckets.len() - 1].iter().all(|&n| n == 32)
            && buckets.len() <= 5,
        "route hash {fields:?}"
    );
    let (_, keys) = scanned_sum(&mut conn, &run.prefix, HOT);
    // A version superseded within its grace (detection re-promoting the demoted post at once)
    // may route no event at all; the first promotion and the last version always take likes.
    let last = versions.len() - 1;
    for (i, &(version, n)) in versions.iter().enumerate().skip(1) {
        let written = keys
            .iter()
            .filter(|k| k.contains(&format!(":v{version}:b")))
            .count();
        let must_write = version == auto_version || i == last;
        assert!(
            (written > 0 || !must_write) && written <= n as usize,
            "version {version} ({n} buckets) has {written} keys among {keys:?}"
        );
    }
    assert!(
        keys.iter()
            .filter(|k| k.contains(&format!(":v{auto_version}:b")))
            .count()
            > 20,
        "the first promotion should spread over most of its 32 buckets: {keys:?}"
    );

    // The CLI and the library reader agree with the truth.
    let out = tally_cli(&[&["count", &hot, "--json"], &common[..]].concat());
    assert!(out.status.success(), "count: {out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json[0]["likes"].as_i64(), Some(truth[&HOT]), "{json}");
    let (rt, reader) = library::reader(&url, &run.prefix, 1, 4, Duration::from_secs(1));
    let posts: Vec<u64> = truth.keys().copied().collect();
    let counts = rt.block_on(reader.counts(&posts)).unwrap();
    for count in counts {
        assert_eq!(count.likes, truth[&count.post_id], "post {}", count.post_id);
    }
    eprintln!(
        "[e2e_hot] {} events, hot post {} likes, {} reader checks, {} posts exact",
        total,
        truth[&HOT],
        reader_checks.load(Ordering::SeqCst),
        posts.len()
    );
    assert!(reader_checks.load(Ordering::SeqCst) > 50);

    let promotions: f64 = [fast_metrics, slow_metrics]
        .iter()
        .filter_map(|addr| try_scrape_metrics(addr).ok())
        .map(|text| metric_value(&text, "tally_promotions_total{trigger=\"auto\"}").unwrap_or(0.0))
        .sum();
    eprintln!("[e2e_hot] automatic promotions reported by live consumers: {promotions}");
    let logs = [first.log_text(), slow.log_text(), fast.log_text()].concat();
    assert!(
        logs.contains("Hot post promoted.") && logs.contains(&format!("post_id={HOT}")),
        "no consumer logged the promotion"
    );
    let inspect = tally_cli(&[&["inspect", "post", &hot], &common[..]].concat());
    assert!(inspect.status.success(), "inspect: {inspect:?}");
    let text = String::from_utf8_lossy(&inspect.stdout);
    let newest = versions.last().unwrap().0;
    assert!(
        text.contains(&format!("version {newest}: 48 buckets")),
        "inspect output:\n{text}"
    );
}
