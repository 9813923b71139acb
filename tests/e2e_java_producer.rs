//! Input from the reference Java producer, `examples/java-producer`: kafka-clients with the
//! `LikeEvent` classes protoc generates from `proto/`, the client docs/contract.md points
//! producer teams to. It produces the same kind of events twice, as plain protobuf and in Schema
//! Registry framing, each run to posts of its own, and one `tally run` counts both.
//!
//! The test writes the events (post, user, like or unlike, time) to a file the producer reads,
//! and computes the truth from that file itself. The producer reports where each event landed;
//! the test reads every message back and checks it byte for byte against its own encoding of
//! the event (the key is the user id, 8 bytes big-endian; the value the protobuf, framed with
//! the schema id big-endian and the message-index list `[0]`), that each user's events stay on
//! one partition in the order sent, that a viral post reaches every partition, and that the
//! producer batched. tally then runs with `--schema-ids` set to the producer's id, so a framing
//! written wrong is a bad message, and must count every post exactly with no bad message.
//!
//! Without java or the built jar the test fails with the command that builds it
//! (`ensure_java_producer` in scripts/lib.sh does it for scripts/test).

mod common;

use std::collections::{BTreeSet, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::Message as _;

const JAVA_PRODUCER_BUILD: &str = "(source scripts/lib.sh && ensure_java_producer)";
const PARTITIONS: i32 = 4;
const PER_RUN: usize = 20_000;
/// Four bytes that differ (00 01 86 a3), so an id written in the wrong byte order is another id.
const SCHEMA_ID: u32 = 100_003;

/// One like or unlike, as the events file holds it.
#[derive(Debug, Clone, Copy)]
struct Event {
    post: u64,
    user: u64,
    action: i32,
    time_ms: i64,
}

/// Key and value of each message on the topic, by (partition, offset).
type OnTopic = HashMap<(i32, i64), (Option<Vec<u8>>, Vec<u8>)>;

/// What the producer printed, and where each event landed.
struct Produced {
    positions: Vec<(i32, i64)>,
    report: serde_json::Value,
}

fn java_producer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/java-producer")
}

/// The newest modification time of the files under `path`.
fn newest(path: &Path) -> SystemTime {
    let meta = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if !meta.is_dir() {
        return meta.modified().unwrap();
    }
    std::fs::read_dir(path)
        .unwrap()
        .map(|entry| newest(&entry.unwrap().path()))
        .max()
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// The producer's jar; fails the test, with the command that builds it, when java cannot run or
/// the jar is missing or older than what it is built from (its POM, its sources, the contract).
fn require_java_producer() -> PathBuf {
    match Command::new("java").arg("-version").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "java -version failed ({}); install a JDK 17 and Maven, then run: {JAVA_PRODUCER_BUILD}",
            out.status
        ),
        Err(e) => panic!(
            "java cannot be run ({e}); install a JDK 17 and Maven, then run: {JAVA_PRODUCER_BUILD}"
        ),
    }
    let dir = java_producer_dir();
    let jar = dir.join("target/like-producer.jar");
    let Ok(built) = std::fs::metadata(&jar).and_then(|m| m.modified()) else {
        panic!(
            "the Java producer is not built ({} is missing); run: {JAVA_PRODUCER_BUILD}",
            jar.display()
        );
    };
    for source in [
        dir.join("pom.xml"),
        dir.join("src"),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("proto"),
    ] {
        assert!(
            newest(&source) <= built,
            "{} is older than {}; rebuild it: {JAVA_PRODUCER_BUILD}",
            jar.display(),
            source.display()
        );
    }
    jar
}

/// `count` likes and unlikes of posts in `base + 1 ..= base + 300`, about a fifth of them of the
/// viral post `base + 1`, by users anywhere in the u64 range (0 and u64::MAX among them), with
/// about 12% unlikes of an earlier like; and the count each post must end with.
fn events(rng: &mut StdRng, base: u64, count: usize) -> (Vec<Event>, HashMap<u64, i64>) {
    let t = now_ms();
    let mut out: Vec<Event> = Vec::with_capacity(count);
    let mut liked: Vec<(u64, u64)> = Vec::new();
    for i in 0..count {
        let (post, user, action) = if i < 2 {
            (base + 2, [0, u64::MAX][i], LIKE)
        } else if !liked.is_empty() && rng.random_bool(0.12) {
            let (post, user) = liked.swap_remove(rng.random_range(0..liked.len()));
            (post, user, UNLIKE)
        } else {
            let post = if rng.random_bool(0.2) {
                base + 1
            } else {
                base + rng.random_range(2..=300)
            };
            (post, rng.random(), LIKE)
        };
        if action == LIKE {
            liked.push((post, user));
        }
        out.push(Event {
            post,
            user,
            action,
            time_ms: t + i as i64,
        });
    }
    let mut truth = HashMap::new();
    for e in &out {
        *truth.entry(e.post).or_insert(0) += if e.action == LIKE { 1 } else { -1 };
    }
    (out, truth)
}

/// The message value the producer must write for `event`: the protobuf, framed under
/// `schema_id` when given.
fn expected_value(event: &Event, schema_id: Option<u32>) -> Vec<u8> {
    let protobuf = encode_like(event.post, event.user, event.action, event.time_ms);
    match schema_id {
        None => protobuf,
        Some(id) => {
            let mut out = vec![0];
            out.extend(id.to_be_bytes());
            out.push(0); // the message-index list [0], short form
            out.extend(protobuf);
            out
        }
    }
}

/// Runs the Java producer on `events`, framed under `schema_id` when given.
fn java_produce(
    jar: &Path,
    brokers: &str,
    topic: &str,
    events: &[Event],
    schema_id: Option<u32>,
) -> Produced {
    let dir = tempfile::tempdir().unwrap();
    let (input, positions) = (dir.path().join("events.txt"), dir.path().join("positions"));
    let mut file = std::io::BufWriter::new(std::fs::File::create(&input).unwrap());
    writeln!(file, "# post_id user_id action event_time_ms").unwrap();
    for e in events {
        let action = if e.action == LIKE { "like" } else { "unlike" };
        writeln!(file, "{} {} {action} {}", e.post, e.user, e.time_ms).unwrap();
    }
    file.into_inner().unwrap().sync_all().unwrap();

    let mut cmd = Command::new("java");
    cmd.args(["-Xmx512m", "-jar"])
        .arg(jar)
        .args(["--bootstrap", brokers, "--topic", topic, "--events"])
        .arg(&input)
        .arg("--positions")
        .arg(&positions);
    if let Some(id) = schema_id {
        cmd.args(["--schema-registry-framing", "--schema-id", &id.to_string()]);
    }
    let started = Instant::now();
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("java cannot be run ({e}); run: {JAVA_PRODUCER_BUILD}"));
    assert!(
        out.status.success(),
        "the Java producer failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "the Java producer prints one JSON object ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    eprintln!(
        "[e2e_java_producer] {} events in {:.1} s: {report}",
        events.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(report["sent"], events.len(), "{report}");
    assert_eq!(report["delivered"], events.len(), "{report}");

    let mut at = vec![(-1, -1); events.len()];
    for line in std::fs::read_to_string(&positions).unwrap().lines() {
        let fields: Vec<i64> = line.split('\t').map(|f| f.parse().unwrap()).collect();
        at[fields[0] as usize] = (fields[1] as i32, fields[2]);
    }
    assert!(
        at.iter().all(|&(p, o)| p >= 0 && o >= 0),
        "a position is missing"
    );
    Produced {
        positions: at,
        report,
    }
}

/// The settings the reference producer documents, as its report states them, and batching.
fn assert_produced_as_documented(report: &serde_json::Value) {
    let config = &report["config"];
    for (key, want) in [
        ("enable.idempotence", "true"),
        ("acks", "all"),
        ("max.in.flight.requests.per.connection", "5"),
        ("compression.type", "zstd"),
    ] {
        assert_eq!(config[key], want, "{key} in {report}");
    }
    let linger: u64 = config["linger.ms"].as_str().unwrap().parse().unwrap();
    assert!(linger > 0, "linger.ms {linger}: no time to fill a batch");
    // Many events to a request: the batches real producers send, not one event at a time.
    let per_request = report["records_per_request_avg"].as_f64().unwrap_or(0.0);
    assert!(
        per_request >= 20.0,
        "{per_request} events per produce request; the test needs batches of many: {report}"
    );
    assert_eq!(report["record_retry_total"], 0.0, "{report}");
    assert_eq!(report["record_error_total"], 0.0, "{report}");
}

/// Every event is on the topic where the producer said, byte for byte as the contract has it;
/// each user's events share a partition, in the order sent; the viral post is on every partition.
fn assert_on_topic(
    messages: &OnTopic,
    events: &[Event],
    produced: &Produced,
    schema_id: Option<u32>,
    viral: u64,
) {
    let mut wrong = Vec::new();
    let mut last_of_user: HashMap<u64, (i32, i64)> = HashMap::new();
    let mut viral_partitions = BTreeSet::new();
    for (i, (event, &pos)) in events.iter().zip(&produced.positions).enumerate() {
        let Some((key, value)) = messages.get(&pos) else {
            wrong.push(format!("event {i}: nothing at {pos:?}"));
            continue;
        };
        if key.as_deref() != Some(&event.user.to_be_bytes()[..]) {
            wrong.push(format!(
                "event {i} at {pos:?}: key {key:02x?}, user {}",
                event.user
            ));
        }
        let want = expected_value(event, schema_id);
        if *value != want {
            wrong.push(format!(
                "event {i} at {pos:?}: value {value:02x?}, want {want:02x?}"
            ));
        }
        if let Some(last) = last_of_user.insert(event.user, pos) {
            assert!(
                last.0 == pos.0 && last.1 < pos.1,
                "user {}: an event at {last:?}, the next one sent at {pos:?}",
                event.user
            );
        }
        if event.post == viral {
            viral_partitions.insert(pos.0);
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} events differ on the topic, the first: {:#?}",
        wrong.len(),
        events.len(),
        &wrong[..wrong.len().min(5)]
    );
    assert_eq!(
        viral_partitions.len(),
        PARTITIONS as usize,
        "the viral post {viral} reached partitions {viral_partitions:?} only"
    );
}

#[test]
fn likes_from_the_java_producer_are_counted_exactly_plain_and_framed() {
    let jar = require_java_producer();
    let run = Scenario::new("e2e_java_producer", "java", PARTITIONS);
    let mut rng = StdRng::seed_from_u64(run.seed);
    let redis = RedisServer::start();

    // Each form to posts of its own, so a form that is not counted shows by name.
    let forms: [(&str, Option<u32>); 2] = [("plain", None), ("framed", Some(SCHEMA_ID))];
    let mut runs = Vec::new();
    for (i, (form, schema_id)) in forms.into_iter().enumerate() {
        let base = (i as u64 + 1) * 1_000_000_000;
        let (events, truth) = events(&mut rng, base, PER_RUN);
        let produced = java_produce(&jar, &run.brokers, &run.topic, &events, schema_id);
        assert_produced_as_documented(&produced.report);
        runs.push((form, schema_id, base, events, truth, produced));
    }
    let hwms = run.hwms(PER_RUN * forms.len());

    let messages: OnTopic = read_topic(&run.brokers, &run.topic, Duration::from_secs(60))
        .into_iter()
        .map(|m| {
            let key = m.key().map(<[u8]>::to_vec);
            let value = m.payload().unwrap_or_default().to_vec();
            ((m.partition(), m.offset()), (key, value))
        })
        .collect();
    assert_eq!(messages.len(), PER_RUN * forms.len(), "messages read back");
    for (form, schema_id, base, events, _, produced) in &runs {
        assert_on_topic(&messages, events, produced, *schema_id, base + 1);
        eprintln!("[e2e_java_producer] {form}: every event on the topic as the contract has it");
    }

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--schema-ids",
            &SCHEMA_ID.to_string(),
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

    let counts = read_counts(&mut conn, &run.prefix);
    let mut wrong = Vec::new();
    for (form, _, base, _, truth, _) in &runs {
        let range = base + 1..=base + 300;
        let (want, got): (i64, i64) = (
            truth.values().sum(),
            counts
                .iter()
                .filter(|(post, _)| range.contains(post))
                .map(|(_, n)| n)
                .sum(),
        );
        eprintln!("[e2e_java_producer] {form}: expected a total of {want}, counted {got}");
        let differs = truth
            .iter()
            .any(|(post, n)| counts.get(post).copied().unwrap_or(0) != *n)
            || counts
                .iter()
                .any(|(post, n)| range.contains(post) && *n != 0 && !truth.contains_key(post));
        if differs {
            wrong.push(*form);
        }
    }
    assert!(wrong.is_empty(), "counts differ for the {wrong:?} events");
    let truth: HashMap<u64, i64> = runs.iter().flat_map(|r| r.4.clone()).collect();
    run.assert_exact(&mut conn, &truth);
    let bad = metric_sum(&scrape_metrics(&metrics_addr), "tally_bad_messages_total");
    assert_eq!(bad, 0.0, "bad messages among the Java producer's events");

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}
