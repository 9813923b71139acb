//! Malformed messages mixed into the stream (1%, of every kind the contract names): the good
//! events are counted exactly, every bad one is counted in `tally_bad_messages_total` and copied
//! to the dead-letter topic with its source position, and no partition stalls on one (each
//! partition even ends with a bad message, so its fence must pass over it).

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const PARTITIONS: i32 = 8;
const GOOD: usize = 49_500;
const BAD: usize = 500;

/// What was sent as a bad message, to compare with its dead letter.
struct BadSent {
    kind: &'static str,
    key: Option<Vec<u8>>,
    value: Vec<u8>,
}

/// One malformed value of each kind, with a label for messages.
fn bad_value(kind: usize, rng: &mut StdRng) -> (&'static str, Vec<u8>) {
    let post = rng.random_range(1..1_000_000u64);
    let user = rng.random_range(1..=u64::MAX);
    let t = now_ms();
    match kind % 12 {
        0 => ("text", b"not a protobuf: {\"post\": 1}".to_vec()),
        1 => ("truncated varint", vec![0x08, 0xff, 0xff]),
        2 => ("wire type 7", vec![0x0f, 0x01]),
        3 => ("length past the end", vec![0x2a, 0x10, 0x01]),
        4 => ("overlong varint", vec![0xff; 11]),
        5 => ("post_id 0", encode_like(0, user, LIKE, t)),
        6 => (
            "post_id 0 written",
            encode_like_explicit(0, user, UNLIKE, t),
        ),
        7 => ("action 0", encode_like(post, user, 0, t)),
        8 => ("action 0 written", encode_like_explicit(post, user, 0, t)),
        9 => ("action 9", encode_like(post, user, 9, t)),
        10 => ("action -1", encode_like(post, user, -1, t)),
        _ => ("empty value", Vec::new()),
    }
}

#[test]
fn bad_messages_are_counted_dead_lettered_and_skipped() {
    let run = Scenario::new("e2e_bad_input", "bad", PARTITIONS);
    let (brokers, topic) = (&run.brokers, &run.topic);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0xbad);
    let dlt = unique("likes-bad-dlq");
    create_topic(&dlt, 4);
    let redis = RedisServer::start();

    let w = Workload::generate(run.seed, GOOD, PARTITIONS);
    eprintln!("[e2e_bad_input] {}", w.describe());

    // Good messages, with bad ones at random places; the last message of every partition is bad.
    let mut messages: Vec<(Msg, Option<&'static str>)> = w
        .messages(0..w.events.len())
        .into_iter()
        .map(|m| (m, None))
        .collect();
    let interior = BAD - PARTITIONS as usize;
    let mut bad = Vec::with_capacity(BAD);
    for i in 0..BAD {
        let (label, value) = bad_value(i, &mut rng);
        let key = (i % 3 != 0).then(|| format!("bad-{i}").into_bytes());
        let partition = if i < interior {
            rng.random_range(0..PARTITIONS)
        } else {
            (i - interior) as i32
        };
        bad.push(((key, value, partition), Some(label)));
    }
    let tail = bad.split_off(interior);
    for m in bad {
        let at = rng.random_range(0..=messages.len());
        messages.insert(at, m);
    }
    let mut tail = tail;
    tail.shuffle(&mut rng);
    messages.extend(tail);

    let positions = produce_positions(
        brokers,
        topic,
        messages.iter().map(|(m, _)| m.clone()).collect::<Vec<_>>(),
    );
    // (partition, offset) -> (kind, key, value) of every bad message.
    let mut expected: BTreeMap<(i32, i64), BadSent> = BTreeMap::new();
    for ((m, kind), pos) in messages.iter().zip(&positions) {
        if let Some(kind) = kind {
            let (key, value) = (m.0.clone(), m.1.clone());
            expected.insert(*pos, BadSent { kind, key, value });
        }
    }
    assert_eq!(expected.len(), BAD);
    let hwms = run.hwms(GOOD + BAD);
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
    run.assert_exact(&mut conn, &w.truth);

    // Every bad message counted once (the run had no crash, so no batch was replayed).
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        text = scrape_metrics(&metrics_addr);
        if metric_sum(&text, "tally_bad_messages_total") >= BAD as f64 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let by_reason = metric_series(&text, "tally_bad_messages_total");
    eprintln!("[e2e_bad_input] tally_bad_messages_total: {by_reason:?}");
    assert_eq!(
        metric_sum(&text, "tally_bad_messages_total"),
        BAD as f64,
        "sum of tally_bad_messages_total over reasons: {by_reason:?}"
    );

    // Every bad message is in the dead-letter topic with its source position (duplicates allowed).
    let mut found: HashMap<(i32, i64), Vec<String>> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        found.clear();
        for m in read_topic(brokers, &dlt, Duration::from_secs(20)) {
            let source_topic = header_str(&m, "tally-source-topic");
            let partition = header_str(&m, "tally-source-partition");
            let offset = header_str(&m, "tally-source-offset");
            let reason = header_str(&m, "tally-reason").unwrap_or_default();
            assert_eq!(
                source_topic.as_deref(),
                Some(topic.as_str()),
                "tally-source-topic"
            );
            let pos = (
                partition
                    .and_then(|p| p.parse().ok())
                    .expect("tally-source-partition"),
                offset
                    .and_then(|o| o.parse().ok())
                    .expect("tally-source-offset"),
            );
            let BadSent { kind, key, value } = expected
                .get(&pos)
                .unwrap_or_else(|| panic!("dead letter for {pos:?}, which was a good message"));
            assert!(
                !reason.is_empty(),
                "dead letter {pos:?} ({kind}) has no tally-reason"
            );
            use rdkafka::Message;
            assert_eq!(
                m.key().map(<[u8]>::to_vec),
                *key,
                "key of dead letter {pos:?} ({kind})"
            );
            assert_eq!(
                m.payload().unwrap_or_default(),
                value.as_slice(),
                "value of dead letter {pos:?} ({kind})"
            );
            found.entry(pos).or_default().push(reason);
        }
        if found.len() == expected.len() || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let missing: Vec<String> = expected
        .iter()
        .filter(|(pos, _)| !found.contains_key(pos))
        .map(|((p, o), sent)| format!("{p}/{o} ({})", sent.kind))
        .collect();
    let reasons: HashSet<&String> = found.values().flatten().collect();
    eprintln!(
        "[e2e_bad_input] dead letters for {} of {BAD} bad messages; reasons seen: {reasons:?}",
        found.len()
    );
    assert!(
        missing.is_empty(),
        "{} bad messages missing from the dead-letter topic: {}",
        missing.len(),
        missing.join(", ")
    );

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}
