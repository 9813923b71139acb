//! Faults on the Kafka side: a frozen broker, a broker that comes back empty, producers whose
//! clocks are wrong, and hostile messages mixed into real traffic.

use std::collections::{BTreeSet, HashMap};
use std::thread;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::common::*;
use crate::report::{Leaks, Row};
use crate::steps::*;
use crate::{PARTITIONS, Settings};

/// Scenario 6: a private broker (never the shared one) is SIGSTOPped for 30 s while the
/// consumer and the producer are talking to it, then SIGCONTed.
///
/// The freeze is longer than the consumer's session timeout (6 s): when the broker wakes up it
/// expires the member it has not heard from, and the consumer joins the group again, with
/// fetches, commits and heartbeats timed out and retried in between.
pub fn broker_stop(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let broker = Broker::start_private();
    let run = Scenario::on(broker.addr(), "chaos_broker", "broker", PARTITIONS);
    let redis = RedisServer::start();
    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(s.first_wave);
    produce(&run.brokers, &run.topic, w.messages(first));
    let args = run.tally_args(&redis.url());
    let mut tally = Tally::spawn_args("consumer", &args);
    let producer = run.stream(w, s.chunk, s.pause);
    for stop in 1..=s.broker_stops {
        thread::sleep(Duration::from_secs(4));
        tally.assert_running();
        broker.sigstop();
        thread::sleep(s.broker_stop_for);
        broker.sigcont();
        row.faults = format!(
            "{stop} broker SIGSTOP {} s (session 6 s)",
            s.broker_stop_for.as_secs()
        );
        thread::sleep(Duration::from_secs(4));
    }
    let w = producer.stop();
    row.events = w.events.len();
    let hwms = run.hwms(w.events.len());
    settle_single(row, &run, &redis, &w.truth, &hwms, &mut [&mut tally]);
    stop_all(&mut [&mut tally]);
}

/// Scenario 9: the broker comes back empty (its data lost, as `docker compose down` with the
/// Kafka volume removed does) while Redis keeps its fences. The consumer must refuse to start,
/// naming the fence beyond the new log's end; after `tally reset-fences --yes` it counts the
/// new log on top of the stored counts, so the truth is both waves together.
pub fn broker_empty(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let redis = RedisServer::start();
    let old = Broker::start_private();
    let run = Scenario::on(old.addr(), "chaos_empty", "empty", PARTITIONS);
    let mut first = Workload::new(run.seed, PARTITIONS);
    let wave = first.grow(s.first_wave);
    produce(&run.brokers, &run.topic, first.messages(wave));
    let mut tally = Tally::spawn_args("consumer", &run.tally_args(&redis.url()));
    let hwms = run.hwms(first.events.len());
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(180), || {
        tally.assert_running()
    });
    stop_all(&mut [&mut tally]);
    drop(old);

    let new = Broker::start_private();
    create_topic_on(new.addr(), &run.topic, PARTITIONS);
    let moved = run.moved_to(new.addr());
    let args = moved.tally_args(&redis.url());
    let mut second = Workload::new(moved.seed ^ 0xe3e3, PARTITIONS);
    let wave = second.grow(s.first_wave / 10);
    produce(&moved.brokers, &moved.topic, second.messages(wave));
    let line = error_line(&run_refused(&args));
    assert!(line.contains("but its fence says offset"), "{line}");
    let mut reset = vec!["reset-fences".to_string(), "--yes".to_string()];
    reset.extend(args.iter().cloned());
    let reset: Vec<&str> = reset.iter().map(String::as_str).collect();
    let out = tally_cli(&reset);
    assert!(out.status.success(), "reset-fences: {}", output_text(&out));
    let mut tally = Tally::spawn_args("consumer-2", &args);
    let producer = moved.stream(second, s.chunk, s.pause);
    thread::sleep(Duration::from_secs(3));
    tally.kill9();
    let mut tally = Tally::spawn_args("consumer-3", &args);
    let second = producer.stop();
    row.faults = "broker back empty: refused, reset-fences, 1 SIGKILL".to_string();
    row.events = first.events.len() + second.events.len();
    let mut truth = first.truth.clone();
    for (&post, &n) in &second.truth {
        *truth.entry(post).or_insert(0) += n;
    }
    let hwms = moved.hwms(second.events.len());
    settle_single(row, &moved, &redis, &truth, &hwms, &mut [&mut tally]);
    stop_all(&mut [&mut tally]);
}

/// Scenario 10: producers whose clocks are wrong. Among real traffic, likes stamped a day ahead
/// (counted: nothing waits for them) and a thousand years ahead (dead-lettered as
/// `timestamp_out_of_range`, so not in the truth), with consumers SIGKILLed in between.
pub fn wrong_clocks(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let run = Scenario::with_topic(
        &brokers(),
        "chaos_clocks",
        "clocks",
        PARTITIONS,
        &[ANY_PRODUCER_CLOCK],
    );
    let redis = RedisServer::start();
    let args = run.tally_args(&redis.url());
    let mut tallies = [
        Tally::spawn_args("consumer-a", &args),
        Tally::spawn_args("consumer-b", &args),
    ];
    let producer = run.stream(Workload::new(run.seed, PARTITIONS), s.chunk, s.pause);
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0xc10c);
    let day = 86_400_000;
    let mut ahead = HashMap::new();
    let mut stamped = 0;
    for round in 0..4 {
        thread::sleep(Duration::from_secs(2));
        for _ in 0..5 {
            let post = 910_000_000 + rng.random_range(0..20u64);
            let partition = rng.random_range(0..PARTITIONS);
            let value = encode_like(post, rng.random(), LIKE, now_ms());
            let far = rng.random_bool(0.5);
            let stamp = if far { 1_000 * 365 * day } else { day };
            produce_stamped(
                &run.brokers,
                &run.topic,
                partition,
                &value,
                now_ms() + stamp,
            );
            if !far {
                *ahead.entry(post).or_insert(0) += 1;
            }
            stamped += 1;
        }
        let victim = round % tallies.len();
        tallies[victim].kill9();
        tallies[victim] = Tally::spawn_args(&format!("consumer-{round}"), &args);
    }
    let w = producer.stop();
    row.faults = format!("{stamped} likes a day or 1000 years ahead, 4 SIGKILL");
    row.events = w.events.len() + ahead.values().sum::<i64>() as usize;
    let mut truth = w.truth.clone();
    for (&post, &n) in &ahead {
        *truth.entry(post).or_insert(0) += n;
    }
    let hwms = run.hwms(w.events.len() + stamped);
    let mut refs: Vec<&mut Tally> = tallies.iter_mut().collect();
    settle_single(row, &run, &redis, &truth, &hwms, &mut refs);
    stop_all(&mut refs);
}

/// One message to produce: key, value (`None` is a null value), partition.
type RawMsg = (Option<Vec<u8>>, Option<Vec<u8>>, i32);

/// Produces every message to its partition, one message per record batch (see
/// `produce_positions`), and returns the (partition, offset) of each, in input order.
fn produce_raw(brokers: &str, topic: &str, messages: &[RawMsg]) -> Vec<(i32, i64)> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("batch.num.messages", "1")
        .set("message.timeout.ms", "300000")
        .create()
        .expect("create producer");
    futures::executor::block_on(async {
        let mut pending = FuturesUnordered::new();
        for (i, (key, value, partition)) in messages.iter().enumerate() {
            let mut record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(topic).partition(*partition);
            if let Some(k) = key {
                record = record.key(k.as_slice());
            }
            if let Some(v) = value {
                record = record.payload(v.as_slice());
            }
            let delivery = producer
                .send_result(record)
                .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
            pending.push(async move { (i, delivery.await) });
        }
        let mut positions = vec![(0, 0); messages.len()];
        while let Some((i, result)) = pending.next().await {
            match result {
                Ok(Ok(d)) => positions[i] = (d.partition, d.offset),
                Ok(Err((e, _))) => panic!("delivery to {topic} failed: {e}"),
                Err(_) => panic!("delivery to {topic} canceled"),
            }
        }
        positions
    })
}

/// An unknown length-delimited field (number 9) holding `len` bytes.
fn unknown_bytes_field(out: &mut Vec<u8>, len: usize) {
    put_varint(out, (9 << 3) | 2);
    put_varint(out, len as u64);
    out.extend(std::iter::repeat_n(0xab, len));
}

/// A value close to the broker's default limit on message size (1,000,000 bytes in librdkafka,
/// 1,048,588 in Kafka), leaving room for the dead-letter copy's headers.
const NEAR_LIMIT: usize = 990_000;

/// A bad message of kind `kind`: (label, value). Every one must be dead-lettered.
fn bad_message(kind: usize, rng: &mut StdRng) -> (&'static str, Option<Vec<u8>>) {
    let post = rng.random_range(1..1_000_000u64);
    let user = rng.random_range(1u64 << 63..=u64::MAX);
    let t = now_ms();
    match kind % 11 {
        0 => {
            // Random bytes behind a tag with wire type 6 or 7, which no encoder writes.
            let mut v = vec![(rng.random_range(1u8..16) << 3) | rng.random_range(6u8..8)];
            let mut tail = vec![0u8; rng.random_range(0..200)];
            rng.fill_bytes(&mut tail);
            v.extend(tail);
            ("random bytes", Some(v))
        }
        1 => {
            // Cut inside the 10-byte varint of user_id.
            let mut v = vec![1 << 3];
            put_varint(&mut v, post);
            v.push(2 << 3);
            let user_at = v.len();
            put_varint(&mut v, user);
            v.truncate(user_at + rng.random_range(1..9));
            ("truncated protobuf", Some(v))
        }
        2 => {
            // post_id written as a length-delimited field.
            let mut v = vec![0x0a, 8];
            v.extend(post.to_le_bytes());
            v.extend(encode_like(0, user, LIKE, t));
            ("post_id with wire type 2", Some(v))
        }
        3 => {
            // action written as fixed32.
            let mut v = encode_like(post, user, 0, t);
            v.extend([0x1d, 1, 0, 0, 0]);
            ("action with wire type 5", Some(v))
        }
        4 => {
            let action = [3, 9, -1, i32::MAX, i32::MIN][rng.random_range(0..5)];
            ("unknown action", Some(encode_like(post, user, action, t)))
        }
        5 => ("post_id 0", Some(encode_like(0, user, LIKE, t))),
        6 => (
            "post_id 0 written",
            Some(encode_like_explicit(0, user, UNLIKE, t)),
        ),
        7 => ("empty value", Some(Vec::new())),
        8 => ("null value", None),
        9 => (
            "overlong varint",
            Some(
                vec![0x08]
                    .into_iter()
                    .chain([0xff; 10])
                    .chain([0x7f])
                    .collect(),
            ),
        ),
        _ => ("action 0", Some(encode_like(post, user, 0, t))),
    }
}

/// A good message that looks odd: (post it counts for, value).
fn odd_good_message(kind: usize, rng: &mut StdRng) -> (u64, Vec<u8>) {
    let post = rng.random_range(1..1_000_000u64);
    let user = rng.random_range(1..=u64::MAX);
    let t = now_ms();
    match kind % 3 {
        0 => (u64::MAX, encode_like(u64::MAX, user, LIKE, t)),
        1 => {
            // Unknown fields of every wire type around the known ones.
            let mut v = Vec::new();
            unknown_bytes_field(&mut v, rng.random_range(0..64));
            v.extend([(15 << 3) | 1, 1, 2, 3, 4, 5, 6, 7, 8]);
            v.extend(encode_like(post, user, LIKE, t));
            v.extend([(12 << 3) | 5, 9, 9, 9, 9, 13 << 3, 0x96, 0x01]);
            (post, v)
        }
        _ => {
            // post_id written twice: the last one counts.
            let mut v = Vec::new();
            put_varint(&mut v, 1 << 3);
            put_varint(&mut v, rng.random_range(1..u64::MAX));
            v.extend(encode_like(post, user, LIKE, t));
            (post, v)
        }
    }
}

fn random_key(rng: &mut StdRng) -> Option<Vec<u8>> {
    match rng.random_range(0..3) {
        0 => None,
        1 => Some(Vec::new()),
        _ => Some(format!("k{}", rng.random::<u32>()).into_bytes()),
    }
}

/// Scenario 8: bad messages of every kind the contract names, plus good messages that look
/// odd (post_id u64::MAX, unknown fields, a repeated field, a value near the size limit), mixed
/// into a stream of real events. Good events are counted exactly; every bad one is counted in
/// `tally_bad_messages_total` and found in the dead-letter topic.
pub fn hostile(s: &Settings, row: &mut Row, _: &mut Leaks) {
    let run = scenario("chaos_hostile", "hostile");
    let mut rng = StdRng::seed_from_u64(run.seed ^ 0xbad);
    let dlt = unique("likes-hostile-dlq");
    create_topic_on(&run.brokers, &dlt, 4);
    let redis = RedisServer::start();
    let mut w = Workload::new(run.seed, PARTITIONS);
    let first = w.grow(s.first_wave);
    produce(&run.brokers, &run.topic, w.messages(first));
    let addr = metrics_addr();
    let args = args_with(
        &run.tally_args(&redis.url()),
        Some(&addr),
        &["--dead-letter-topic", &dlt],
    );
    let mut tally = Tally::spawn_args("consumer", &args);
    let producer = run.stream(w, s.chunk, s.pause);

    // (message, Some(label) when bad, post it counts for when good).
    let near_limit = (s.hostile / 200).max(2);
    let mut messages: Vec<(RawMsg, Option<&'static str>, Option<u64>)> = Vec::new();
    for i in 0..s.hostile {
        let (label, value) = bad_message(i, &mut rng);
        let msg = (random_key(&mut rng), value, rng.random_range(0..PARTITIONS));
        messages.push((msg, Some(label), None));
    }
    for i in 0..s.hostile / 4 {
        let (post, value) = odd_good_message(i, &mut rng);
        let msg = (
            random_key(&mut rng),
            Some(value),
            rng.random_range(0..PARTITIONS),
        );
        messages.push((msg, None, Some(post)));
    }
    for i in 0..near_limit {
        let partition = rng.random_range(0..PARTITIONS);
        if i % 2 == 0 {
            let mut v = vec![0x07];
            v.resize(NEAR_LIMIT, 0x5a);
            messages.push((
                (None, Some(v), partition),
                Some("near the size limit"),
                None,
            ));
        } else {
            let post = rng.random_range(1..1_000_000u64);
            let mut v = encode_like(post, rng.random(), LIKE, now_ms());
            unknown_bytes_field(&mut v, NEAR_LIMIT - 32);
            messages.push(((random_key(&mut rng), Some(v), partition), None, Some(post)));
        }
    }
    // Shuffle, then send in slices while the real traffic flows.
    for i in (1..messages.len()).rev() {
        messages.swap(i, rng.random_range(0..=i));
    }
    let mut bad_at = BTreeSet::new();
    let mut extra_truth: HashMap<u64, i64> = HashMap::new();
    let slice = messages.len().div_ceil(10);
    for part in messages.chunks(slice) {
        let raw: Vec<RawMsg> = part.iter().map(|(m, _, _)| m.clone()).collect();
        let positions = produce_raw(&run.brokers, &run.topic, &raw);
        for ((_, bad, good), pos) in part.iter().zip(positions) {
            if bad.is_some() {
                bad_at.insert(pos);
            }
            if let Some(post) = good {
                *extra_truth.entry(*post).or_default() += 1;
            }
        }
        thread::sleep(Duration::from_millis(300));
        tally.assert_running();
    }
    let good_odd: usize = extra_truth.values().sum::<i64>() as usize;
    row.faults = format!("{} bad + {good_odd} odd but valid", bad_at.len());
    let w = producer.stop();
    let mut truth = w.truth.clone();
    for (post, n) in &extra_truth {
        *truth.entry(*post).or_default() += n;
    }
    row.events = w.events.len() + good_odd;
    let hwms = run.hwms(w.events.len() + messages.len());
    settle_single(row, &run, &redis, &truth, &hwms, &mut [&mut tally]);

    // Every bad message is counted once (no crash here, so nothing was replayed) ...
    let counted = metric_sum(&scrape_metrics(&addr), "tally_bad_messages_total") as usize;
    // ... and copied to the dead-letter topic, with its source position; no good one is.
    let mut found = BTreeSet::new();
    for _ in 0..10 {
        for m in read_topic(&run.brokers, &dlt, Duration::from_secs(30)) {
            let pos = (
                header_str(&m, "tally-source-partition").and_then(|p| p.parse().ok()),
                header_str(&m, "tally-source-offset").and_then(|o| o.parse().ok()),
            );
            let (Some(p), Some(o)) = pos else {
                panic!("a dead letter without its source position");
            };
            assert!(
                bad_at.contains(&(p, o)),
                "good message {p}/{o} was dead-lettered"
            );
            found.insert((p, o));
        }
        if found.len() == bad_at.len() {
            break;
        }
        thread::sleep(Duration::from_secs(1));
    }
    row.bad = Some((found.len(), bad_at.len()));
    assert_eq!(
        counted,
        bad_at.len(),
        "tally_bad_messages_total says {counted}, {} bad messages were sent",
        bad_at.len()
    );
    stop_all(&mut [&mut tally]);
}
