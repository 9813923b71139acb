//! Input from real producers: a client other than tally's own, the Python Kafka client
//! (confluent-kafka, run as `tests/producers/produce.py`), writes the events.
//!
//! * Compression: batches compressed with each of gzip, snappy, lz4 and zstd, many messages to a
//!   batch, are all counted exactly (against a truth computed here).
//! * Schema Registry framing: values framed by hand as Confluent's serializers frame them
//!   (magic byte 0, schema id, message-index list) are counted like plain ones, and framings
//!   that are cut short or name another message are dead-lettered with their reason.
//! * Producers that deliver at least once: likes the Python client encodes itself, event ids
//!   (`LikeEvent` field 5) included, and publishes partly again (right behind the first copy and
//!   later), beside id-less double taps, are counted once with `--dedupe ids-and-actions`.
//!
//! Tansu 0.6 answers a fetch from an offset inside a multi-message batch with the next batch,
//! skipping the rest of the one holding the offset (see `produce_positions`). So each test reads
//! with a fresh group, from offset 0, in one `tally run` that is never restarted: every fetch
//! starts at a batch boundary and no event depends on a resume inside a batch.
//!
//! Without the Python client these tests fail with the command that installs it
//! (`ensure_python_kafka` in scripts/lib.sh does it for scripts/test).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PYTHON_INSTALL: &str = "python3 -m pip install confluent-kafka==2.16.1";
const CODECS: [&str; 4] = ["gzip", "snappy", "lz4", "zstd"];
const PARTITIONS: i32 = 4;
const PER_CODEC: usize = 20_000;

/// What `produce.py` reports: deliveries, and the record batches librdkafka sent.
#[derive(Debug)]
struct Produced {
    positions: Vec<(i32, i64)>,
    batches: u64,
    batched_messages: u64,
    largest_batch: u64,
    client: String,
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/producers/produce.py")
}

/// Fails the test, with the install command, unless `python3` imports confluent_kafka.
fn require_python_kafka() {
    let out = Command::new("python3")
        .args(["-c", "import confluent_kafka"])
        .output();
    match out {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "the Python Kafka client is not installed ({}); run: {PYTHON_INSTALL}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
                .trim()
        ),
        Err(e) => panic!(
            "python3 cannot be run ({e}); install python3 and pip, then run: {PYTHON_INSTALL}"
        ),
    }
}

/// Produces `messages` in order with the Python client and `compression`.
fn python_produce(brokers: &str, topic: &str, compression: &str, messages: &[Msg]) -> Produced {
    let dir = tempfile::tempdir().unwrap();
    let (input, positions) = (
        dir.path().join("input.tsv"),
        dir.path().join("positions.tsv"),
    );
    let mut file = std::io::BufWriter::new(std::fs::File::create(&input).unwrap());
    for (key, value, partition) in messages {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let key = key.as_deref().map(hex).unwrap_or_default();
        writeln!(file, "{partition}\t{key}\t{}", hex(value)).unwrap();
    }
    file.into_inner().unwrap().sync_all().unwrap();
    let out = Command::new("python3")
        .arg(script())
        .args([
            "--brokers",
            brokers,
            "--topic",
            topic,
            "--compression",
            compression,
        ])
        .arg("--input")
        .arg(&input)
        .arg("--positions")
        .arg(&positions)
        .output()
        .unwrap_or_else(|e| panic!("python3 cannot be run ({e}); run: {PYTHON_INSTALL}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(2) => {
            panic!("the Python Kafka client is not installed; run: {PYTHON_INSTALL}\n{stderr}")
        }
        _ => panic!(
            "produce.py --compression {compression} failed ({}):\n{stderr}",
            out.status
        ),
    }
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("produce.py prints one JSON object");
    let number = |key: &str| {
        report[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {report}"))
    };
    assert_eq!(number("delivered"), messages.len() as u64, "{report}");
    let mut at = vec![(-1, -1); messages.len()];
    for line in std::fs::read_to_string(&positions).unwrap().lines() {
        let fields: Vec<i64> = line.split('\t').map(|f| f.parse().unwrap()).collect();
        at[fields[0] as usize] = (fields[1] as i32, fields[2]);
    }
    Produced {
        positions: at,
        batches: number("batches"),
        batched_messages: number("batched_messages"),
        largest_batch: number("largest_batch"),
        client: report["client"].as_str().unwrap_or_default().to_string(),
    }
}

/// `count` likes and unlikes of posts in `base + 1 ..= base + 300` (few posts, so batches
/// compress well), with their truth.
fn events(rng: &mut StdRng, base: u64, count: usize) -> (Vec<Msg>, HashMap<u64, i64>) {
    let mut messages = Vec::with_capacity(count);
    let mut truth = HashMap::new();
    let mut liked: Vec<(u64, u64)> = Vec::new();
    let t = now_ms();
    for i in 0..count {
        let (post, user, action) = if !liked.is_empty() && rng.random_bool(0.12) {
            let (post, user) = liked.swap_remove(rng.random_range(0..liked.len()));
            (post, user, UNLIKE)
        } else {
            let post = base + rng.random_range(1..=300);
            let user = rng.random_range(1..=u64::MAX);
            liked.push((post, user));
            (post, user, LIKE)
        };
        *truth.entry(post).or_insert(0) += if action == LIKE { 1 } else { -1 };
        let partition = rng.random_range(0..PARTITIONS);
        messages.push((
            None,
            encode_like(post, user, action, t + i as i64),
            partition,
        ));
    }
    (messages, truth)
}

#[test]
fn batches_compressed_with_every_codec_are_counted_exactly() {
    require_python_kafka();
    let run = Scenario::new("e2e_codecs", "codecs", PARTITIONS);
    let mut rng = StdRng::seed_from_u64(run.seed);
    let redis = RedisServer::start();

    // Each codec's events go to posts of their own, so a codec that is not read shows by name.
    let mut truths: Vec<(&str, u64, HashMap<u64, i64>)> = Vec::new();
    for (i, codec) in CODECS.iter().enumerate() {
        let base = (i as u64 + 1) * 1_000_000_000;
        let (messages, truth) = events(&mut rng, base, PER_CODEC);
        let produced = python_produce(&run.brokers, &run.topic, codec, &messages);
        eprintln!(
            "[e2e_codecs] {codec}: {PER_CODEC} events in {} record batches ({} messages, at most {} \
             in one) by {}",
            produced.batches, produced.batched_messages, produced.largest_batch, produced.client
        );
        // Many messages to a batch: the compressed batches real producers send.
        assert_eq!(produced.batched_messages, PER_CODEC as u64, "{produced:?}");
        assert!(
            produced.batches * 20 <= PER_CODEC as u64,
            "{codec}: {} batches for {PER_CODEC} messages; the test needs batches of many",
            produced.batches
        );
        truths.push((codec, base, truth));
    }
    let hwms = run.hwms(PER_CODEC * CODECS.len());

    let mut tally = Tally::spawn_args("tally", &run.tally_args(&redis.url()));
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });

    let counts = read_counts(&mut conn, &run.prefix);
    let mut wrong = Vec::new();
    for (codec, base, truth) in &truths {
        let range = base + 1..=base + 300;
        let mine: HashMap<u64, i64> = counts
            .iter()
            .filter(|(post, _)| range.contains(post))
            .map(|(&post, &n)| (post, n))
            .collect();
        let (want, got): (i64, i64) = (truth.values().sum(), mine.values().sum());
        eprintln!("[e2e_codecs] {codec}: expected a total of {want}, counted {got}");
        let differs = truth
            .iter()
            .any(|(post, n)| mine.get(post).copied().unwrap_or(0) != *n)
            || mine
                .iter()
                .any(|(post, n)| *n != 0 && !truth.contains_key(post));
        if differs {
            wrong.push(*codec);
        }
    }
    assert!(
        wrong.is_empty(),
        "counts differ for the events compressed with {wrong:?}"
    );
    let truth: HashMap<u64, i64> = truths.iter().flat_map(|(_, _, t)| t.clone()).collect();
    run.assert_exact(&mut conn, &truth);

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}

/// `protobuf` framed as a Confluent Schema Registry serializer frames it; `indexes` is the
/// message-index list as bytes (`[0]` is the single byte 0).
fn framed(schema_id: u32, indexes: &[u8], protobuf: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend(schema_id.to_be_bytes());
    out.extend(indexes);
    out.extend(protobuf);
    out
}

#[test]
fn framed_values_are_counted_and_bad_framings_dead_lettered() {
    require_python_kafka();
    let run = Scenario::new("e2e_codecs", "framed", PARTITIONS);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0xf4a3);
    let dlt = unique("likes-framed-dlq");
    create_topic(&dlt, 1);
    let redis = RedisServer::start();

    // Plain and framed events alike (ids 12 and 13, both forms of the list [0]), and bad
    // framings among them; every partition ends with a bad one.
    let (good, truth) = events(&mut rng, 0, 6_000);
    let mut messages: Vec<(Msg, Option<&'static str>)> = Vec::new();
    for (i, (key, value, partition)) in good.into_iter().enumerate() {
        let value = match i % 3 {
            0 => value,
            1 => framed(12, &[0x00], &value),
            _ => framed(13, &[0x02, 0x00], &value),
        };
        messages.push(((key, value, partition), None));
    }
    let like = encode_like(7, 9, LIKE, now_ms());
    let bad: [(&str, Vec<u8>); 6] = [
        ("framing_truncated", vec![0]),
        ("framing_truncated", vec![0, 0, 0, 12]),
        ("framing_truncated", framed(12, &[0x02], &[])),
        ("message_index_invalid", framed(12, &[0x02, 0x02], &like)),
        (
            "message_index_invalid",
            framed(12, &[0x04, 0x00, 0x00], &like),
        ),
        ("undecodable", framed(12, &[0x00], &[0xff, 0xff, 0xff])),
    ];
    let mut expected_reasons: BTreeMap<&str, usize> = BTreeMap::new();
    let mut tail = Vec::new();
    for i in 0..120 {
        let (reason, value) = bad[i % bad.len()].clone();
        let key = Some(format!("bad-{i}").into_bytes());
        *expected_reasons.entry(reason).or_insert(0) += 1;
        if i < PARTITIONS as usize {
            tail.push(((key, value, i as i32), Some(reason)));
        } else {
            let at = rng.random_range(0..=messages.len());
            let partition = rng.random_range(0..PARTITIONS);
            messages.insert(at, ((key, value, partition), Some(reason)));
        }
    }
    messages.extend(tail);

    let plain: Vec<Msg> = messages.iter().map(|(m, _)| m.clone()).collect();
    let produced = python_produce(&run.brokers, &run.topic, "lz4", &plain);
    eprintln!(
        "[e2e_codecs] framed: {} messages in {} lz4 batches by {}",
        plain.len(),
        produced.batches,
        produced.client
    );
    let mut expected: BTreeMap<(i32, i64), &str> = BTreeMap::new();
    for ((_, reason), pos) in messages.iter().zip(&produced.positions) {
        if let Some(reason) = reason {
            expected.insert(*pos, reason);
        }
    }
    let hwms = run.hwms(plain.len());
    for (p, &hwm) in hwms.iter().enumerate() {
        assert!(
            expected.contains_key(&(p as i32, hwm - 1)),
            "partition {p} should end with a bad message"
        );
    }

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(["--dead-letter-topic", &dlt, "--metrics-addr", &metrics_addr].map(String::from));
    let mut tally = Tally::spawn_args("tally", &args);
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &truth);

    // Each reason counted as often as it was sent.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut text = scrape_metrics(&metrics_addr);
    while metric_sum(&text, "tally_bad_messages_total") < expected.len() as f64
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(200));
        text = scrape_metrics(&metrics_addr);
    }
    for (reason, count) in &expected_reasons {
        let series = format!("tally_bad_messages_total{{reason=\"{reason}\"}}");
        assert_eq!(
            metric_value(&text, &series),
            Some(*count as f64),
            "{series}: {:?}",
            metric_series(&text, "tally_bad_messages_total")
        );
    }

    // Every bad message is dead-lettered with its reason (copies after a retry allowed).
    let mut found: BTreeMap<(i32, i64), String> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while found.len() < expected.len() && Instant::now() < deadline {
        for m in read_topic(&run.brokers, &dlt, Duration::from_secs(20)) {
            let number = |name: &str| {
                header_str(&m, name)
                    .and_then(|v| v.parse::<i64>().ok())
                    .unwrap_or_else(|| panic!("dead letter without {name}"))
            };
            let pos = (
                number("tally-source-partition") as i32,
                number("tally-source-offset"),
            );
            let reason = header_str(&m, "tally-reason").unwrap_or_default();
            let want = expected
                .get(&pos)
                .unwrap_or_else(|| panic!("dead letter for {pos:?}, which was a good message"));
            assert_eq!(reason, *want, "tally-reason of the dead letter of {pos:?}");
            found.insert(pos, reason);
        }
    }
    assert_eq!(
        found.len(),
        expected.len(),
        "dead letters for {} of {} bad messages",
        found.len(),
        expected.len()
    );

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}

#[test]
fn framed_values_with_unknown_schema_ids_are_dead_lettered_when_ids_are_checked() {
    require_python_kafka();
    let run = Scenario::new("e2e_codecs", "schema-ids", PARTITIONS);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0x5c4e);
    let dlt = unique("likes-schema-ids-dlq");
    create_topic(&dlt, 1);
    let redis = RedisServer::start();

    // Ids 12 and 13 are allowed; 14 and 99 are not. Plain values carry no id and count. Each
    // kind has posts of its own.
    let mut truth: HashMap<u64, i64> = HashMap::new();
    let mut messages: Vec<Msg> = Vec::new();
    let mut unknown = 0;
    for (i, id) in [None, Some(12), Some(13), Some(14), Some(99)]
        .into_iter()
        .enumerate()
    {
        let (events, events_truth) = events(&mut rng, i as u64 * 1_000_000_000, 1_000);
        if matches!(id, Some(14 | 99)) {
            unknown += events.len();
        } else {
            truth.extend(events_truth);
        }
        for (key, value, partition) in events {
            let value = id.map_or(value.clone(), |id| framed(id, &[0x00], &value));
            let at = rng.random_range(0..=messages.len());
            messages.insert(at, (key, value, partition));
        }
    }
    python_produce(&run.brokers, &run.topic, "zstd", &messages);
    let hwms = run.hwms(messages.len());

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--schema-ids",
            "12,13",
            "--dead-letter-topic",
            &dlt,
            "--metrics-addr",
            &metrics_addr,
        ]
        .map(String::from),
    );
    let mut tally = Tally::spawn_args("tally", &args);
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &truth);
    let series = "tally_bad_messages_total{reason=\"schema_id_unknown\"}";
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut text = scrape_metrics(&metrics_addr);
    while metric_value(&text, series) != Some(unknown as f64) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        text = scrape_metrics(&metrics_addr);
    }
    assert_eq!(
        metric_value(&text, series),
        Some(unknown as f64),
        "{:?}",
        metric_series(&text, "tally_bad_messages_total")
    );
    // Each dead-lettered with its reason (copies after a retry allowed).
    let mut found = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while found.len() < unknown && Instant::now() < deadline {
        for m in read_topic(&run.brokers, &dlt, Duration::from_secs(20)) {
            let reason = header_str(&m, "tally-reason").unwrap_or_default();
            assert_eq!(reason, "schema_id_unknown", "the only reason in this run");
            let source = (
                header_str(&m, "tally-source-partition"),
                header_str(&m, "tally-source-offset"),
            );
            found.insert(source);
        }
    }
    assert_eq!(found.len(), unknown, "dead letters of unknown schema ids");

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}

/// One like for `produce.py --events`: partition, post, user, action, time (ms) and event id
/// (empty for none).
type Like = (i32, u64, u64, i32, i64, String);

/// Likes as a producer that delivers at least once makes them, before the Python client
/// publishes some of the id'd ones again: likes and unlikes with event ids, id-less double taps
/// and like-like-unlike sequences, each by a (post, user) pair of its own on posts in
/// `base + 1 ..= base + 200`. Returns the likes, the truth (each like once) and how many id-less
/// records repeat their pair's last action.
fn likes_with_repeats(
    rng: &mut StdRng,
    base: u64,
    count: usize,
) -> (Vec<Like>, HashMap<u64, i64>, u64) {
    let mut likes: Vec<Like> = Vec::with_capacity(count + 2);
    let mut truth = HashMap::new();
    let mut liked: Vec<(i32, u64, u64)> = Vec::new();
    let mut repeats = 0;
    let t = now_ms();
    while likes.len() < count {
        let post = base + rng.random_range(1..=200);
        let (user, partition) = (
            rng.random_range(1..=u64::MAX),
            rng.random_range(0..PARTITIONS),
        );
        let id = format!("py-{:x}-{}", base, likes.len());
        let at = t + likes.len() as i64;
        let roll = rng.random_range(0..100);
        if roll < 55 {
            likes.push((partition, post, user, LIKE, at, id));
            liked.push((partition, post, user));
            *truth.entry(post).or_insert(0) += 1;
        } else if roll < 65 && !liked.is_empty() {
            let (p, post, user) = liked.swap_remove(rng.random_range(0..liked.len()));
            likes.push((p, post, user, UNLIKE, at, id));
            *truth.entry(post).or_insert(0) -= 1;
        } else if roll < 85 {
            // A double tap: one like, sent twice without an id.
            for _ in 0..2 {
                likes.push((partition, post, user, LIKE, at, String::new()));
            }
            *truth.entry(post).or_insert(0) += 1;
            repeats += 1;
        } else {
            // Like, like, unlike: the user ends where they began.
            for action in [LIKE, LIKE, UNLIKE] {
                likes.push((partition, post, user, action, at, String::new()));
            }
            repeats += 1;
        }
    }
    (likes, truth, repeats)
}

/// Has `produce.py --events` encode and produce `likes` in order with `compression`, publishing
/// a `resend` share of the id'd ones again; returns its report.
fn python_produce_likes(
    brokers: &str,
    topic: &str,
    compression: &str,
    likes: &[Like],
    resend: f64,
    seed: u64,
) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("likes.tsv");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&input).unwrap());
    for (partition, post, user, action, at, id) in likes {
        writeln!(file, "{partition}\t{post}\t{user}\t{action}\t{at}\t{id}").unwrap();
    }
    file.into_inner().unwrap().sync_all().unwrap();
    let out = Command::new("python3")
        .arg(script())
        .args(["--brokers", brokers, "--topic", topic])
        .args(["--compression", compression, "--events"])
        .args(["--resend", &resend.to_string(), "--seed", &seed.to_string()])
        .arg("--input")
        .arg(&input)
        .output()
        .unwrap_or_else(|e| panic!("python3 cannot be run ({e}); run: {PYTHON_INSTALL}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(2) => {
            panic!("the Python Kafka client is not installed; run: {PYTHON_INSTALL}\n{stderr}")
        }
        _ => panic!("produce.py --events failed ({}):\n{stderr}", out.status),
    }
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("produce.py prints one JSON object");
    assert_eq!(report["delivered"], likes.len() as u64, "{report}");
    report
}

#[test]
fn likes_the_python_client_publishes_again_are_counted_once() {
    require_python_kafka();
    let run = Scenario::new("e2e_codecs", "resend", PARTITIONS);
    let mut rng = StdRng::seed_from_u64(run.seed);
    let redis = RedisServer::start();
    let (likes, truth, action_repeats) = likes_with_repeats(&mut rng, 5_000_000_000, 20_000);
    let report = python_produce_likes(&run.brokers, &run.topic, "zstd", &likes, 0.25, run.seed);
    let number = |key: &str| {
        report[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {report}"))
    };
    let (resent, later) = (number("resent"), number("resent_later"));
    eprintln!(
        "[e2e_codecs] {} likes, {resent} published again ({later} later, the rest right behind \
         the first copy), {action_repeats} id-less repeats, in {} record batches by {}",
        likes.len(),
        number("batches"),
        report["client"]
    );
    assert!(later > 0 && resent > later, "{report}");
    let hwms = run.hwms(likes.len() + resent as usize);

    // The default window (1,000,000 offsets a partition) spans the whole topic: every copy is
    // a repeat the rule must find.
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(["--dedupe", "ids-and-actions", "--metrics-addr", &metrics].map(String::from));
    let mut tally = Tally::spawn_args("tally", &args);
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &truth);

    // One run, never restarted, decides every record once: each copy is skipped once, by its
    // reason.
    let text = scrape_metrics(&metrics);
    let skipped = |reason: &str| {
        let series = format!("tally_duplicates_skipped_total{{reason=\"{reason}\"}}");
        metric_value(&text, &series).unwrap_or(0.0) as u64
    };
    assert_eq!(
        (skipped("event_id"), skipped("repeat_action")),
        (resent, action_repeats),
        "(skipped ids, skipped actions) against (copies sent, id-less repeats made)"
    );

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}
