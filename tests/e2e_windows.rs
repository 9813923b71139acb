//! Windows of trending counts end to end, on Apache Kafka and a real Redis: likes stamped
//! across a UTC midnight, out of order, late, without an event time and with a clock ahead of
//! the log, counted by `tally run --windows 1m,1h,1d` through SIGKILLs and a Redis restart
//! from its AOF, and on a Redis Cluster with a hot post's buckets in several slot groups. Every window of every
//! post, the lifetime counts and the trending lists equal a ground truth this test computes
//! from the records it wrote, by its own reading of the rule in docs/contract.md.

mod cluster;
mod common;

use std::collections::{BTreeMap, HashMap};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use futures::stream::{FuturesUnordered, StreamExt};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};

const PARTITIONS: i32 = 4;
const EVENTS: usize = 24_000;
const POSTS: u64 = 150;
const KILLS: usize = 3;
const MINUTE: i64 = 60_000;
const HOUR: i64 = 3_600_000;
const DAY: i64 = 86_400_000;
const LATENESS: i64 = 30_000;
const SIZES: [i64; 3] = [MINUTE, HOUR, DAY];

/// One record: partition, post, user, +1/-1, event time (0: none), record timestamp.
#[derive(Clone, Copy)]
struct Record {
    partition: i32,
    post: u64,
    user: u64,
    delta: i64,
    event_ms: i64,
    record_ms: i64,
}

impl Record {
    /// The like's time, as the contract states it: its event time, held to its record's
    /// timestamp, or the timestamp when it has none (every record here has one).
    fn time(&self) -> i64 {
        if self.event_ms > 0 {
            self.event_ms.min(self.record_ms)
        } else {
            self.record_ms
        }
    }
}

/// Records stamped over three hours around a UTC midnight at least two hours past (so every
/// timestamp lies in the past), with the shapes of time a real producer sends.
fn records(seed: u64) -> Vec<Record> {
    let mut rng = StdRng::seed_from_u64(seed);
    let midnight = (now_ms() - 2 * HOUR) / DAY * DAY;
    let first = midnight - 90 * MINUTE;
    let step = 3 * HOUR / EVENTS as i64;
    let mut liked: Vec<(u64, u64)> = Vec::new();
    (0..EVENTS)
        .map(|i| {
            let record_ms = first + i as i64 * step;
            let (post, user, delta) = if !liked.is_empty() && rng.random_bool(0.15) {
                let (post, user) = liked.swap_remove(rng.random_range(0..liked.len()));
                (post, user, -1)
            } else {
                // Skewed over few posts, so windows hold equal counts (ties) and one post leads.
                let post = 1 + (rng.random_range(0.0f64..1.0).powi(3) * POSTS as f64) as u64;
                let user = rng.random::<u64>() | 1;
                liked.push((post, user));
                (post, user, 1)
            };
            let shape = rng.random_range(0..100);
            let event_ms = match shape {
                0..80 => record_ms - rng.random_range(0..20_000),
                80..88 => record_ms - rng.random_range(20_000..180_000),
                88..92 => record_ms - 2 * HOUR,
                92..96 => 0,
                _ => record_ms + rng.random_range(1..300_000),
            };
            let partition =
                ((post.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ user) % PARTITIONS as u64) as i32;
            Record {
                partition,
                post,
                user,
                delta,
                event_ms,
                record_ms,
            }
        })
        .collect()
}

/// The windows every record counts in, as the contract states the rule: the like's time is its
/// event time, held to its record's timestamp, or the timestamp when it has none; it misses a
/// window whose end plus the lateness its record's timestamp has reached.
fn truth(records: &[Record]) -> BTreeMap<(i64, i64, u64), i64> {
    let mut windows = BTreeMap::new();
    for r in records {
        let time = r.time();
        for size in SIZES {
            let start = time - time.rem_euclid(size);
            if r.record_ms < start + size + LATENESS {
                *windows.entry((size, start, r.post)).or_insert(0) += r.delta;
            }
        }
    }
    windows.retain(|_, likes| *likes != 0);
    windows
}

fn size_name(size: i64) -> &'static str {
    match size {
        MINUTE => "1m",
        HOUR => "1h",
        DAY => "1d",
        _ => unreachable!(),
    }
}

/// Every window count in Redis, read without tally's code: hashes
/// `<prefix>:win:<size>:<start>[:{tag}]`, fields 8-byte big-endian post ids.
fn stored(conn: &mut redis::Connection, prefix: &str) -> BTreeMap<(i64, i64, u64), i64> {
    let mut all = BTreeMap::new();
    stored_into(conn, prefix, &mut all);
    all
}

/// [`stored`] over the keys one connection's server holds, into `all`.
fn stored_into(
    conn: &mut redis::Connection,
    prefix: &str,
    all: &mut BTreeMap<(i64, i64, u64), i64>,
) {
    for key in scan_keys(conn, &format!("{prefix}:win:*")) {
        let rest = key.strip_prefix(&format!("{prefix}:win:")).unwrap();
        let mut parts = rest.split(':');
        let size = match parts.next().unwrap() {
            "1m" => MINUTE,
            "1h" => HOUR,
            "1d" => DAY,
            other => panic!("{key}: window {other}"),
        };
        let start: i64 = parts.next().unwrap().parse().unwrap();
        let members: Vec<(Vec<u8>, i64)> = redis::cmd("HGETALL").arg(&key).query(conn).unwrap();
        for (member, likes) in members {
            if member == b"floor" {
                continue;
            }
            let post = u64::from_be_bytes(member.try_into().expect("8-byte member"));
            assert!(likes != 0, "{key} keeps post {post} at 0");
            assert!(
                all.insert((size, start, post), likes).is_none(),
                "post {post} in two sets of one window"
            );
        }
    }
}

/// Produces `records` with their own timestamps, in order per partition.
fn produce_records(brokers: &str, topic: &str, records: &[Record]) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .expect("create producer");
    futures::executor::block_on(async {
        let mut pending = FuturesUnordered::new();
        for r in records {
            let action = if r.delta > 0 { LIKE } else { UNLIKE };
            let value = encode_like(r.post, r.user, action, r.event_ms);
            let producer = &producer;
            pending.push(async move {
                let record = FutureRecord::<(), _>::to(topic)
                    .payload(&value)
                    .partition(r.partition)
                    .timestamp(r.record_ms);
                producer
                    .send(record, Duration::from_secs(60))
                    .await
                    .map_err(|(e, _)| e)
            });
            if pending.len() >= 2_000 {
                pending.next().await.unwrap().expect("delivery");
            }
        }
        while let Some(result) = pending.next().await {
            result.expect("delivery");
        }
    });
}

/// The trending list of every window, as `tally top` prints it, equals the leaders of
/// `expected`, ties broken by the larger post id.
fn assert_trending(url: &str, prefix: &str, expected: &BTreeMap<(i64, i64, u64), i64>) {
    let mut tied = 0;
    let windows: std::collections::BTreeSet<(i64, i64)> = expected
        .keys()
        .map(|&(size, start, _)| (size, start))
        .collect();
    for (size, start) in windows {
        let mut leaders: Vec<(i64, u64)> = expected
            .iter()
            .filter(|((s, w, _), likes)| (*s, *w) == (size, start) && **likes > 0)
            .map(|(&(_, _, post), &likes)| (likes, post))
            .collect();
        leaders.sort_unstable_by(|a, b| b.cmp(a));
        leaders.truncate(10);
        tied += leaders.windows(2).filter(|w| w[0].0 == w[1].0).count();
        let out = tally_cli(&[
            "top",
            "--redis",
            url,
            "--prefix",
            prefix,
            "--window",
            size_name(size),
            "--at",
            &(start + 1).to_string(),
            "--limit",
            "10",
            "--json",
        ]);
        assert!(out.status.success(), "{}", output_text(&out));
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let listed: Vec<(i64, u64)> = answer["posts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["likes"].as_i64().unwrap(), p["post_id"].as_u64().unwrap()))
            .collect();
        assert_eq!(listed, leaders, "top 10 of {} at {start}", size_name(size));
        assert_eq!(answer["start_ms"].as_i64(), Some(start));
    }
    assert!(tied > 0, "no list had equal counts to order");
}

/// The arguments of a windowed `tally run`.
fn windowed(mut args: Vec<String>) -> Vec<String> {
    args.extend(
        [
            "--windows",
            "1m,1h,1d",
            "--window-lateness",
            "30s",
            "--window-retention",
            "3d",
        ]
        .map(String::from),
    );
    args
}

#[test]
fn windows_are_exact_across_midnight_late_likes_and_kills() {
    let run = Scenario::new("e2e_windows", "windows", PARTITIONS);
    let (brokers, topic, prefix) = (&run.brokers, &run.topic, &run.prefix);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0x7e4d);
    let mut redis = RedisServer::start_with_aof();
    let records = records(run.seed);
    let expected = truth(&records);

    let mut args = windowed(run.tally_args(&redis.url()));
    args.extend(["--batch-max-events", "2000"].map(String::from));
    let half = EVENTS / 2;
    produce_records(brokers, topic, &records[..half]);
    let rest = records[half..].to_vec();
    let producer = {
        let (brokers, topic) = (brokers.clone(), topic.clone());
        thread::spawn(move || {
            for chunk in rest.chunks(1_000) {
                produce_records(&brokers, &topic, chunk);
                thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let mut conn = redis.conn();
    let mut tally = Tally::spawn_args("tally-1", &args);
    for kill in 1..=KILLS {
        let at_start = run.applied_under(&mut conn, prefix, PARTITIONS as usize);
        // Progress, or nothing left to apply: on a slow machine the producer may be done and
        // every offset applied before this consumer is assigned.
        wait_for("the consumer to apply", Duration::from_secs(60), || {
            tally.assert_running();
            let applied = run.applied_under(&mut conn, prefix, PARTITIONS as usize);
            (applied > at_start || applied >= EVENTS as i64).then_some(())
        });
        thread::sleep(Duration::from_millis(rng.random_range(200..1500)));
        tally.kill9();
        eprintln!("[e2e_windows] kill {kill}/{KILLS}");
        tally = Tally::spawn_args(&format!("tally-{}", kill + 1), &args);
    }
    // Redis killed and started again from its AOF, while the last consumer starts (it waits
    // for a server loading its dataset) or applies.
    redis.restart();
    eprintln!("[e2e_windows] redis-server restarted from its AOF");
    let mut conn = redis.conn();
    producer.join().unwrap();
    let hwms = run.hwms(EVENTS);
    let started = Instant::now();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });
    eprintln!(
        "[e2e_windows] caught up in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Lifetime counts take every like, late or not.
    let mut lifetime: HashMap<u64, i64> = HashMap::new();
    for r in &records {
        *lifetime.entry(r.post).or_insert(0) += r.delta;
    }
    run.assert_exact(&mut conn, &lifetime);

    let got = stored(&mut conn, prefix);
    let late = records
        .iter()
        .filter(|r| r.event_ms > 0 && r.event_ms < r.record_ms - 20_000)
        .count();
    eprintln!(
        "[e2e_windows] {} window counts expected, {} stored; {late} records stamped out of order",
        expected.len(),
        got.len()
    );
    let differ: Vec<_> = expected
        .iter()
        .filter(|(k, v)| got.get(k) != Some(v))
        .map(|(k, v)| (*k, *v, got.get(k).copied()))
        .chain(
            got.iter()
                .filter(|(k, _)| !expected.contains_key(k))
                .map(|(k, v)| (*k, 0, Some(*v))),
        )
        .take(10)
        .collect();
    assert!(
        differ.is_empty(),
        "(size, start, post), expected, stored: {differ:?}"
    );
    let days: std::collections::BTreeSet<i64> = got
        .keys()
        .filter(|(size, _, _)| *size == DAY)
        .map(|&(_, start, _)| start)
        .collect();
    assert_eq!(days.len(), 2, "the likes straddle a midnight: {days:?}");

    // Each window's counts expire at its end plus the retention.
    let (size, start, post) = *got.keys().next().unwrap();
    let key = scan_keys(
        &mut conn,
        &format!("{prefix}:win:{}:{start}*", size_name(size)),
    );
    let expiry: i64 = redis::cmd("PEXPIRETIME")
        .arg(&key[0])
        .query(&mut conn)
        .unwrap();
    assert_eq!(expiry, start + size + 3 * DAY, "{} (post {post})", key[0]);

    assert_trending(&redis.url(), prefix, &expected);

    // With every window's floor raised past its counts (and its leaders emptied, as the script
    // leaves them then), the leaders decide nothing and each list is read from the counts.
    for key in scan_keys(&mut conn, &format!("{prefix}:win:*")) {
        let () = redis::pipe()
            .cmd("HSET")
            .arg(&key)
            .arg("floor")
            .arg(1_000_000_000)
            .ignore()
            .cmd("DEL")
            .arg(key.replacen(":win:", ":top:", 1))
            .ignore()
            .query(&mut conn)
            .unwrap();
    }
    assert_trending(&redis.url(), prefix, &expected);

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}

/// A start that names other windows than the prefix keeps is refused in one line naming the
/// flag, before anything is counted.
#[test]
fn a_start_with_other_windows_is_refused() {
    let run = Scenario::new("e2e_windows", "windows-flag", 1);
    let redis = RedisServer::start();
    produce_records(
        &run.brokers,
        &run.topic,
        &[Record {
            partition: 0,
            post: 7,
            user: 9,
            delta: 1,
            event_ms: 0,
            record_ms: now_ms(),
        }],
    );
    let mut args = run.tally_args(&redis.url());
    args.extend(["--windows", "1h"].map(String::from));
    let mut tally = Tally::spawn_args("tally-windows", &args);
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &run.hwms(1), Duration::from_secs(60), || {
        tally.assert_running()
    });
    tally.sigterm_and_wait(Duration::from_secs(20));
    let mut other = run.tally_args(&redis.url());
    other.extend(["--windows", "1h,1d"].map(String::from));
    let refused = run_refused(&other);
    let line = refusal_line(&refused);
    assert!(
        line.contains("--windows 1h,1d") && line.contains("written with 1h"),
        "{line}"
    );
    // Without the flag a writer takes the prefix's windows.
    let mut same = Tally::spawn_args("tally-same", &run.tally_args(&redis.url()));
    thread::sleep(Duration::from_secs(2));
    same.assert_running();
    same.sigterm_and_wait(Duration::from_secs(20));
}

/// `tally verify` recounts every window and trending list and agrees with the live consumer,
/// finds a window count changed behind tally's back, and `tally rebuild` rebuilds the windows
/// exactly into a new generation.
#[test]
fn verify_and_rebuild_reach_the_live_windows() {
    let run = Scenario::new("e2e_windows", "windows-verify", 2);
    let redis = RedisServer::start();
    let records: Vec<Record> = records(run.seed)
        .into_iter()
        .take(8_000)
        .map(|r| Record {
            partition: r.partition % 2,
            ..r
        })
        .collect();
    let expected = truth(&records);
    produce_records(&run.brokers, &run.topic, &records);
    let args = windowed(run.tally_args(&redis.url()));
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut watched = args.clone();
    watched.extend(["--metrics-addr".to_string(), metrics.clone()]);
    let mut tally = Tally::spawn_args("tally-verify", &watched);
    let mut conn = redis.conn();
    run.wait_applied(
        &mut conn,
        &run.hwms(records.len()),
        Duration::from_secs(90),
        || tally.assert_running(),
    );
    // Every like too late for a window is counted once for that window, by the rule.
    let late: usize = records
        .iter()
        .map(|r| {
            let time = r.time();
            SIZES
                .iter()
                .filter(|&&size| r.record_ms >= time - time.rem_euclid(size) + size + LATENESS)
                .count()
        })
        .sum();
    // The metric counts a batch's late likes after its script returns, so it
    // may trail the fences the wait above read: give it a few seconds to
    // catch up, then require the exact figure (a count past it fails too).
    let deadline = Instant::now() + Duration::from_secs(10);
    let reported = loop {
        let reported = metric_value(&scrape_metrics(&metrics), "tally_window_late_likes_total");
        if reported >= Some(late as f64) || Instant::now() > deadline {
            break reported;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(reported, Some(late as f64));
    assert!(late > 0, "no late like in the workload");
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    assert_eq!(stored(&mut conn, &run.prefix), expected);

    let verify = || {
        let mut all = vec!["verify".to_string()];
        all.extend(args.iter().cloned());
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        tally_cli(&refs)
    };
    let out = verify();
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("0 counts of a post in a window and 0 trending lists drift"),
        "{text}"
    );

    // One post's likes in one hour, raised behind tally's back.
    let (&(_, start, post), _) = expected
        .iter()
        .find(|((size, _, _), likes)| *size == HOUR && **likes > 0)
        .unwrap();
    let key = scan_keys(&mut conn, &format!("{}:win:1h:{start}*", run.prefix)).remove(0);
    let leaders = key.replacen(":win:", ":top:", 1);
    let () = redis::pipe()
        .cmd("HINCRBY")
        .arg(&key)
        .arg(&post.to_be_bytes()[..])
        .arg(1_000)
        .ignore()
        .cmd("ZINCRBY")
        .arg(&leaders)
        .arg(1_000)
        .arg(&post.to_be_bytes()[..])
        .ignore()
        .query(&mut conn)
        .unwrap();
    let out = verify();
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&post.to_string()) && text.contains("trending list differs"),
        "{text}"
    );

    let mut rebuild = Tally::spawn_command(
        "rebuild",
        "rebuild",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let status = rebuild.wait_exit(Duration::from_secs(180));
    assert!(
        status.success(),
        "rebuild failed:\n{}",
        rebuild.log_tail(40)
    );
    let rebuilt = format!("{}:g1", run.prefix);
    assert_eq!(stored(&mut conn, &rebuilt), expected);
    let out = verify();
    assert!(out.status.success(), "{}", output_text(&out));
}

/// On a cluster of three primaries with 16 slot groups and 8 buckets a post, every post's
/// buckets lie in several groups, yet it keeps one member per window, in the set of its bucket
/// 0's group, and the trending lists merged over the groups equal the truth's leaders.
#[test]
fn on_a_cluster_a_post_spread_over_groups_keeps_whole_windows_and_an_exact_merge() {
    const GROUPS: &str = "16";
    let cluster = cluster::RedisCluster::start(3, 0);
    let run = Scenario::new("e2e_windows", "windows-cluster", PARTITIONS);
    let records: Vec<Record> = records(run.seed).into_iter().take(16_000).collect();
    let expected = truth(&records);
    produce_records(&run.brokers, &run.topic, &records);
    let mut args = windowed(run.tally_args(&cluster.url()));
    args.extend(["--slot-groups", GROUPS, "--buckets", "8"].map(String::from));
    let mut tally = Tally::spawn_args("tally-cluster", &args);
    let hwms = run.hwms(records.len());
    cluster.wait_applied(
        &run.prefix,
        &run.group,
        &run.topic,
        &hwms,
        16,
        Duration::from_secs(180),
        || tally.assert_running(),
    );
    // Post 1, which takes about a fifth of the likes, has counters in several groups.
    let places = cluster.post_places(&run.prefix, 1);
    let tags: std::collections::BTreeSet<&str> = places
        .iter()
        .filter_map(|p| p.key.rsplit_once(":{").map(|(_, tag)| tag))
        .collect();
    assert!(
        tags.len() > 1,
        "post 1's buckets are in one slot group: {tags:?}"
    );
    let mut got = BTreeMap::new();
    for (port, _) in cluster.primaries() {
        let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .unwrap()
            .get_connection()
            .unwrap();
        stored_into(&mut conn, &run.prefix, &mut got);
    }
    assert_eq!(got, expected);
    assert_trending(&cluster.url(), &run.prefix, &expected);
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
}
