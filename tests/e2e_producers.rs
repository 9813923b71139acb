//! Input from the producer examples docs/contract.md's producer guide points teams to:
//! `examples/java-producer`, the reference (kafka-clients, with the `LikeEvent` classes protoc
//! generates from `proto/` in its Maven build), `examples/python-producer` (confluent-kafka, with
//! the code protoc generates from `proto/`) and `examples/go-producer` (franz-go, with the code
//! `buf generate` makes from `proto/`). Each produces the same kind of events twice, as
//! plain protobuf and in Schema Registry framing, each run to posts of its own, then sends the
//! first events of the plain run again from a new producer, as an outbox relay that restarts
//! does: same event ids, same keys. One `tally run --dedupe ids` counts it all.
//!
//! The test writes the events (post, user, like or unlike, time, event id) to a file the
//! producer reads, and computes the truth from that file itself. The producer reports where each
//! event landed; the test reads every message back and checks it byte for byte against its own
//! encoding of the event (the key is the user id, 8 bytes big-endian; the value the protobuf
//! with the event id, framed with the schema id big-endian and the message-index list `[0]`),
//! that each user's events stay on one partition in the order sent, that a resent event lands in
//! its original's partition, that a viral post reaches every partition, and that the producer
//! batched. tally then runs with `--schema-ids` set to the producer's id, so a framing written
//! wrong is a bad message, and must count every post exactly, skip every resent event as a
//! repeated id, and see no bad message.
//!
//! Without the tools or the built producers the tests fail with the command that sets them up
//! (`ensure_java_producer`, `ensure_python_producer` and `ensure_go_producer` in scripts/lib.sh
//! do it for scripts/test).

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
const PYTHON_PRODUCER_SETUP: &str = "(source scripts/lib.sh && ensure_python_producer)";
const GO_PRODUCER_BUILD: &str = "(source scripts/lib.sh && ensure_buf && ensure_go_producer)";
const PARTITIONS: i32 = 4;
const PER_RUN: usize = 20_000;
/// Events of the plain run sent again by a new producer.
const RESENT: usize = 1_000;
/// Four bytes that differ (00 01 86 a3), so an id written in the wrong byte order is another id.
const SCHEMA_ID: u32 = 100_003;

/// One like or unlike, as the events file holds it.
#[derive(Debug, Clone)]
struct Event {
    post: u64,
    user: u64,
    action: i32,
    time_ms: i64,
    id: String,
}

/// Key and value of each message on the topic, by (partition, offset).
type OnTopic = HashMap<(i32, i64), (Option<Vec<u8>>, Vec<u8>)>;

/// What the producer printed, and where each event landed.
struct Produced {
    positions: Vec<(i32, i64)>,
    report: serde_json::Value,
}

/// A producer example and how to run it.
enum Example {
    Java { jar: PathBuf },
    Python { script: PathBuf },
    Go { binary: PathBuf },
}

impl Example {
    fn name(&self) -> &'static str {
        match self {
            Example::Java { .. } => "java",
            Example::Python { .. } => "python",
            Example::Go { .. } => "go",
        }
    }

    fn setup(&self) -> &'static str {
        match self {
            Example::Java { .. } => JAVA_PRODUCER_BUILD,
            Example::Python { .. } => PYTHON_PRODUCER_SETUP,
            Example::Go { .. } => GO_PRODUCER_BUILD,
        }
    }

    fn command(&self) -> Command {
        match self {
            Example::Java { jar } => {
                let mut cmd = Command::new("java");
                cmd.arg("-jar").arg(jar);
                cmd
            }
            Example::Python { script } => {
                let mut cmd = Command::new("python3");
                cmd.arg(script);
                cmd
            }
            Example::Go { binary } => Command::new(binary),
        }
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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

/// Fails the test with `setup` unless `built` exists and is newer than each of `sources`.
fn assert_built(built: &Path, sources: &[PathBuf], setup: &str) {
    let Ok(at) = std::fs::metadata(built).and_then(|m| m.modified()) else {
        panic!("{} is missing; run: {setup}", built.display());
    };
    for source in sources {
        assert!(
            newest(source) <= at,
            "{} is older than {}; run: {setup}",
            built.display(),
            source.display()
        );
    }
}

/// The Python example; fails the test, with the command that sets it up, when python3 lacks
/// confluent-kafka or protobuf, or the generated `LikeEvent` code is missing or older than the
/// contract.
/// The Java example's jar; fails the test, with the command that builds it, when java cannot
/// run or the jar is missing or older than its POM, its sources or the contract.
fn require_java_producer() -> Example {
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
    let dir = repo().join("examples/java-producer");
    let jar = dir.join("target/like-producer.jar");
    assert_built(
        &jar,
        &[dir.join("pom.xml"), dir.join("src"), repo().join("proto")],
        JAVA_PRODUCER_BUILD,
    );
    Example::Java { jar }
}

fn require_python_producer() -> Example {
    let out = Command::new("python3")
        .args(["-c", "import confluent_kafka, google.protobuf"])
        .output()
        .unwrap_or_else(|e| {
            panic!("python3 cannot be run ({e}); install python3 and pip, then run: {PYTHON_PRODUCER_SETUP}")
        });
    assert!(
        out.status.success(),
        "python3 lacks confluent-kafka or protobuf ({}); run: {PYTHON_PRODUCER_SETUP}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let dir = repo().join("examples/python-producer");
    assert_built(
        &dir.join("gen/tally/v1/like_event_pb2.py"),
        &[repo().join("proto")],
        PYTHON_PRODUCER_SETUP,
    );
    Example::Python {
        script: dir.join("like_producer.py"),
    }
}

/// The Go example's binary, built by `ensure_go_producer` into the cache directory; fails the
/// test, with the command that builds it, when it is missing or older than its sources or the
/// contract.
fn require_go_producer() -> Example {
    let home = std::env::var_os("HOME").expect("HOME is set");
    let binary = PathBuf::from(home).join(".cache/tally/go-producer/like-producer");
    assert_built(
        &binary,
        &[repo().join("examples/go-producer"), repo().join("proto")],
        GO_PRODUCER_BUILD,
    );
    Example::Go { binary }
}

/// `count` likes and unlikes of posts in `base + 1 ..= base + 300`, about a fifth of them of the
/// viral post `base + 1`, by users anywhere in the u64 range (0 and u64::MAX among them), with
/// about 12% unlikes of an earlier like, each with an event id of its own; and the count each
/// post must end with.
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
            id: format!("{:016x}-{i}", rng.random::<u64>()),
        });
    }
    let mut truth = HashMap::new();
    for e in &out {
        *truth.entry(e.post).or_insert(0) += if e.action == LIKE { 1 } else { -1 };
    }
    (out, truth)
}

/// The message value the producer must write for `event`: the protobuf with its event id,
/// framed under `schema_id` when given.
fn expected_value(event: &Event, schema_id: Option<u32>) -> Vec<u8> {
    let protobuf = encode_like_with_id(
        event.post,
        event.user,
        event.action,
        event.time_ms,
        &event.id,
    );
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

/// Runs `example` on `events`, framed under `schema_id` when given.
fn produce(
    example: &Example,
    brokers: &str,
    topic: &str,
    events: &[Event],
    schema_id: Option<u32>,
) -> Produced {
    let name = example.name();
    let dir = tempfile::tempdir().unwrap();
    let (input, positions) = (dir.path().join("events.txt"), dir.path().join("positions"));
    let mut file = std::io::BufWriter::new(std::fs::File::create(&input).unwrap());
    writeln!(file, "# post_id user_id action event_time_ms event_id").unwrap();
    for e in events {
        let action = if e.action == LIKE { "like" } else { "unlike" };
        writeln!(
            file,
            "{} {} {action} {} {}",
            e.post, e.user, e.time_ms, e.id
        )
        .unwrap();
    }
    file.into_inner().unwrap().sync_all().unwrap();

    let mut cmd = example.command();
    cmd.args(["--bootstrap", brokers, "--topic", topic, "--events"])
        .arg(&input)
        .arg("--positions")
        .arg(&positions);
    if let Some(id) = schema_id {
        cmd.args(["--schema-registry-framing", "--schema-id", &id.to_string()]);
    }
    let started = Instant::now();
    let out = cmd.output().unwrap_or_else(|e| {
        panic!(
            "the {name} producer cannot be run ({e}); run: {}",
            example.setup()
        )
    });
    assert!(
        out.status.success(),
        "the {name} producer failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "the {name} producer prints one JSON object ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    eprintln!(
        "[e2e_producers] {name}: {} events in {:.1} s: {report}",
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

/// The settings the producer guide asks for, as the report states them, and batching.
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
    // Many events to a batch: the batches real producers send, not one event at a time.
    // kafka-clients reports records per produce request, which holds one batch a partition.
    let per_batch = report["records_per_batch_avg"]
        .as_f64()
        .or_else(|| report["records_per_request_avg"].as_f64())
        .unwrap_or(0.0);
    assert!(
        per_batch >= 20.0,
        "{per_batch} events per batch; the test needs batches of many: {report}"
    );
    // Clients that count their retries and failed records must have none.
    for key in ["record_retry_total", "record_error_total"] {
        if !report[key].is_null() {
            assert_eq!(report[key], 0.0, "{key} in {report}");
        }
    }
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

/// Produces plain, framed and resent events with `example`, checks them on the topic, and checks
/// tally counts each post exactly and skips every resent event.
fn counted_exactly(example: &Example, test: &str) {
    let name = example.name();
    let run = Scenario::new(test, name, PARTITIONS);
    let mut rng = StdRng::seed_from_u64(run.seed);
    let redis = RedisServer::start();

    // Each form to posts of its own, so a form that is not counted shows by name.
    let forms: [(&str, Option<u32>); 2] = [("plain", None), ("framed", Some(SCHEMA_ID))];
    let mut runs = Vec::new();
    for (i, (form, schema_id)) in forms.into_iter().enumerate() {
        let base = (i as u64 + 1) * 1_000_000_000;
        let (events, truth) = events(&mut rng, base, PER_RUN);
        let produced = produce(example, &run.brokers, &run.topic, &events, schema_id);
        assert_produced_as_documented(&produced.report);
        runs.push((form, schema_id, base, events, truth, produced));
    }
    // A relay that restarts sends again what it had sent: a new producer, so Kafka's idempotence
    // does not know the records; the event ids do.
    let resent_events = runs[0].3[..RESENT].to_vec();
    let resent = produce(example, &run.brokers, &run.topic, &resent_events, None);
    let hwms = run.hwms(PER_RUN * forms.len() + RESENT);

    let messages: OnTopic = read_topic(&run.brokers, &run.topic, Duration::from_secs(60))
        .into_iter()
        .map(|m| {
            let key = m.key().map(<[u8]>::to_vec);
            let value = m.payload().unwrap_or_default().to_vec();
            ((m.partition(), m.offset()), (key, value))
        })
        .collect();
    assert_eq!(
        messages.len(),
        PER_RUN * forms.len() + RESENT,
        "messages read back"
    );
    for (form, schema_id, base, events, _, produced) in &runs {
        assert_on_topic(&messages, events, produced, *schema_id, base + 1);
        eprintln!("[e2e_producers] {name} {form}: every event on the topic as the contract has it");
    }
    let original = &runs[0].5.positions;
    for (i, (event, &pos)) in resent_events.iter().zip(&resent.positions).enumerate() {
        let (key, value) = &messages[&pos];
        assert_eq!(
            key.as_deref(),
            Some(&event.user.to_be_bytes()[..]),
            "resent {i}"
        );
        assert_eq!(*value, expected_value(event, None), "resent {i} at {pos:?}");
        assert_eq!(
            pos.0, original[i].0,
            "resent event {i} at {pos:?}, its original at {:?}: a repeat must land in its original's partition",
            original[i]
        );
    }

    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--schema-ids",
            &SCHEMA_ID.to_string(),
            "--dedupe",
            "ids",
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
        eprintln!("[e2e_producers] {name} {form}: expected a total of {want}, counted {got}");
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
    let metrics = scrape_metrics(&metrics_addr);
    let bad = metric_sum(&metrics, "tally_bad_messages_total");
    assert_eq!(bad, 0.0, "bad messages among the {name} producer's events");
    let skipped = metric_value(
        &metrics,
        "tally_duplicates_skipped_total{reason=\"event_id\"}",
    );
    assert_eq!(
        skipped,
        Some(RESENT as f64),
        "resent events skipped as repeated ids"
    );
    eprintln!("[e2e_producers] {name}: {RESENT} resent events skipped by their ids");

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}

#[test]
fn likes_from_the_java_producer_are_counted_exactly_plain_and_framed() {
    counted_exactly(&require_java_producer(), "e2e_producers_java");
}

#[test]
fn likes_from_the_python_producer_are_counted_exactly_plain_and_framed() {
    counted_exactly(&require_python_producer(), "e2e_producers_python");
}

#[test]
fn likes_from_the_go_producer_are_counted_exactly_plain_and_framed() {
    counted_exactly(&require_go_producer(), "e2e_producers_go");
}
