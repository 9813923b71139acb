//! Transactional producers on Apache Kafka. tally reads with `isolation.level=read_committed`:
//! it counts the events of committed transactions and never those of aborted ones, and its lag
//! ends at the last stable offset (LSO), which a transaction still open holds back, not at the
//! high watermark.
//!
//! The transactions are run by the Python Kafka client (`tests/producers/transactional.py`), a
//! client other than tally's own; the truth is computed here from what each transaction was told
//! to do, per partition, so the counts can be checked while an open transaction hides part of
//! some partitions.
//!
//! A transaction ends with a marker: one offset in every partition it wrote to, holding no
//! event, which a read_committed consumer never receives, and which is the last record of a
//! partition until something else is written. A log written by transactions therefore ends one
//! offset (or a whole aborted transaction) past the last event tally applies. The waits here
//! are on Kafka's committed offset reaching the end of the readable log and the fence reaching
//! the offset before it, which holds only if tally commits past trailing markers.
//!
//! Without the Python client the test fails with the command that installs it
//! (`ensure_python_kafka` in scripts/lib.sh does it for scripts/test).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

const PYTHON_INSTALL: &str = "python3 -m pip install confluent-kafka==2.16.1";
const PARTITIONS: i32 = 4;
/// The partitions the transaction left open writes to; the others stay readable to the end.
const HELD: [i32; 2] = [0, 1];
/// Transactions per producer in the first phase (two producers run at once).
const FIRST_TRANSACTIONS: usize = 40;
/// The open transaction's timeout: the broker aborts it this long after it began (its cleanup
/// runs every second, see scripts/kafka/broker). Everything checked while it holds the LSO must
/// fit in it.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Commit,
    Abort,
    Open,
}

impl End {
    fn as_str(self) -> &'static str {
        match self {
            End::Commit => "commit",
            End::Abort => "abort",
            End::Open => "open",
        }
    }
}

/// A transaction to run: how it ends and its events, each with its partition.
struct Txn {
    end: End,
    messages: Vec<(i32, Vec<u8>)>,
}

/// The events of the run and their truth: per partition, the net count of every post, over the
/// committed transactions and plain records only.
struct Events {
    rng: StdRng,
    /// Committed likes, for unlikes to take back.
    liked: Vec<(u64, u64)>,
    truth: BTreeMap<i32, HashMap<u64, i64>>,
}

impl Events {
    fn new(seed: u64) -> Events {
        Events {
            rng: StdRng::seed_from_u64(seed ^ 0x7a5e),
            liked: Vec::new(),
            truth: BTreeMap::new(),
        }
    }

    /// One like or unlike on `partition`; counted in the truth when `counted`. Posts are few
    /// (200) and shared by every kind of transaction, so an aborted event that was counted
    /// shows as a wrong count of a post the truth holds.
    fn event(&mut self, partition: i32, counted: bool) -> Vec<u8> {
        let (post, user, action) = if counted && !self.liked.is_empty() && self.rng.random_bool(0.1)
        {
            let at = self.rng.random_range(0..self.liked.len());
            let (post, user) = self.liked.swap_remove(at);
            (post, user, UNLIKE)
        } else {
            let post = self.rng.random_range(1..=200);
            let user = self.rng.random_range(1..=u64::MAX);
            if counted {
                self.liked.push((post, user));
            }
            (post, user, LIKE)
        };
        if counted {
            *self
                .truth
                .entry(partition)
                .or_default()
                .entry(post)
                .or_insert(0) += if action == LIKE { 1 } else { -1 };
        }
        encode_like(post, user, action, now_ms())
    }

    /// A transaction ending with `end`, of `size` events spread over `partitions`.
    fn transaction(&mut self, end: End, partitions: &[i32], size: usize) -> Txn {
        let messages = (0..size)
            .map(|_| {
                let partition = partitions[self.rng.random_range(0..partitions.len())];
                (partition, self.event(partition, end == End::Commit))
            })
            .collect();
        Txn { end, messages }
    }

    /// A transaction of the first phase: a third aborted, 20 to 400 events over one to all
    /// partitions.
    fn random_transaction(&mut self) -> Txn {
        let end = if self.rng.random_bool(1.0 / 3.0) {
            End::Abort
        } else {
            End::Commit
        };
        let mut partitions: Vec<i32> = (0..PARTITIONS).collect();
        let keep = self.rng.random_range(1..=partitions.len());
        while partitions.len() > keep {
            let at = self.rng.random_range(0..partitions.len());
            partitions.swap_remove(at);
        }
        let size = self.rng.random_range(20..=400);
        self.transaction(end, &partitions, size)
    }

    /// `count` plain (non-transactional) events over every partition.
    fn plain(&mut self, count: usize) -> Vec<Msg> {
        (0..count)
            .map(|_| {
                let partition = self.rng.random_range(0..PARTITIONS);
                (None, self.event(partition, true), partition)
            })
            .collect()
    }
}

/// The counts `truth` (per partition) gives over every partition.
fn counts(truth: &BTreeMap<i32, HashMap<u64, i64>>) -> HashMap<u64, i64> {
    let mut sum = HashMap::new();
    for (&post, &n) in truth.values().flatten() {
        *sum.entry(post).or_insert(0) += n;
    }
    sum
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/producers/transactional.py")
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

/// `transactional.py` for `txns`, written to a file in `dir`, with its stdout piped and its
/// stderr in `dir/<id>.err`.
fn producer_command(
    dir: &Path,
    run: &Scenario,
    id: &str,
    txns: &[Txn],
    timeout: Duration,
    pause_ms: u64,
) -> Command {
    let input = dir.join(format!("{id}.jsonl"));
    let mut file = std::io::BufWriter::new(std::fs::File::create(&input).unwrap());
    for txn in txns {
        let messages: Vec<serde_json::Value> = txn
            .messages
            .iter()
            .map(|(p, v)| {
                let hex: String = v.iter().map(|b| format!("{b:02x}")).collect();
                serde_json::json!([p, hex])
            })
            .collect();
        let line = serde_json::json!({"end": txn.end.as_str(), "messages": messages});
        writeln!(file, "{line}").unwrap();
    }
    file.into_inner().unwrap().sync_all().unwrap();
    let mut cmd = Command::new("python3");
    cmd.arg(script())
        .args(["--brokers", &run.brokers, "--topic", &run.topic])
        .args(["--transactional-id", id])
        .arg("--transaction-timeout-ms")
        .arg(timeout.as_millis().to_string())
        .arg("--pause-ms")
        .arg(pause_ms.to_string())
        .arg("--input")
        .arg(&input)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join(format!("{id}.err"))).unwrap());
    cmd
}

/// One transaction's report: how it ended and where each of its events landed.
#[derive(Debug)]
struct Report {
    end: End,
    positions: Vec<(i32, i64)>,
}

/// Reads the next transaction's report from `lines`; `None` at the final summary or the end.
fn next_report(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> Option<Report> {
    let line = lines.next()?.expect("read transactional.py's output");
    let value: serde_json::Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("transactional.py printed {line:?}: {e}"));
    let end = match value["end"].as_str()? {
        "commit" => End::Commit,
        "abort" => End::Abort,
        "open" => End::Open,
        other => panic!("transactional.py reported the end {other:?}"),
    };
    let positions = value["positions"]
        .as_array()
        .expect("positions")
        .iter()
        .map(|p| (p[0].as_i64().unwrap() as i32, p[1].as_i64().unwrap()))
        .collect();
    Some(Report { end, positions })
}

/// Panics with the producer's stderr, or the install hint, unless it exited 0.
fn check_exit(dir: &Path, id: &str, mut child: Child) {
    let status = child.wait().expect("wait for transactional.py");
    let stderr = std::fs::read_to_string(dir.join(format!("{id}.err"))).unwrap_or_default();
    match status.code() {
        Some(0) => {}
        Some(2) => {
            panic!("the Python Kafka client is not installed; run: {PYTHON_INSTALL}\n{stderr}")
        }
        _ => panic!("transactional.py {id} failed ({status}):\n{stderr}"),
    }
}

/// Runs `txns` with one transactional producer, `pause_ms` apart; `done` counts the
/// transactions ended so far. Returns every transaction's report.
fn run_transactions(
    run: &Scenario,
    id: &str,
    txns: &[Txn],
    pause_ms: u64,
    done: &AtomicUsize,
) -> Vec<Report> {
    let dir = tempfile::tempdir().unwrap();
    let mut child = producer_command(dir.path(), run, id, txns, Duration::from_secs(60), pause_ms)
        .spawn()
        .unwrap_or_else(|e| panic!("python3 cannot be run ({e}); run: {PYTHON_INSTALL}"));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut reports = Vec::new();
    while let Some(report) = next_report(&mut lines) {
        reports.push(report);
        done.fetch_add(1, Ordering::SeqCst);
    }
    check_exit(dir.path(), id, child);
    assert_eq!(
        reports.len(),
        txns.len(),
        "{id}: reports of every transaction"
    );
    for (report, txn) in reports.iter().zip(txns) {
        assert_eq!(report.end, txn.end, "{id}");
        assert_eq!(report.positions.len(), txn.messages.len(), "{id}");
    }
    reports
}

/// A producer whose transaction is open: its records are in the log and it never ends it.
/// SIGKILLed on drop at the latest.
struct Hung {
    child: Child,
    report: Report,
    _dir: tempfile::TempDir,
    /// When its records were known to be written: the transaction began a little earlier.
    written_at: Instant,
}

impl Hung {
    /// Opens `txn` (whose end is `Open`) with a transaction timeout of `timeout`.
    fn open(run: &Scenario, txn: &Txn, timeout: Duration) -> Hung {
        assert_eq!(txn.end, End::Open);
        let dir = tempfile::tempdir().unwrap();
        let id = unique("txn-hung");
        let mut child =
            producer_command(dir.path(), run, &id, std::slice::from_ref(txn), timeout, 0)
                .spawn()
                .unwrap_or_else(|e| panic!("python3 cannot be run ({e}); run: {PYTHON_INSTALL}"));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let Some(report) = next_report(&mut lines) else {
            check_exit(dir.path(), &id, child);
            panic!("{id} ended without opening its transaction");
        };
        assert_eq!(report.end, End::Open);
        Hung {
            child,
            report,
            _dir: dir,
            written_at: Instant::now(),
        }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Hung {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The ends of a topic's partitions as each isolation level sees them, and the group's
/// committed offsets.
struct Log {
    topic: String,
    group: String,
    /// read_uncommitted: the high watermark.
    uncommitted: BaseConsumer,
    /// read_committed: the last stable offset.
    committed: BaseConsumer,
}

impl Log {
    fn new(run: &Scenario) -> Log {
        let client = |isolation: &str, group: &str| -> BaseConsumer {
            ClientConfig::new()
                .set("bootstrap.servers", &run.brokers)
                .set("group.id", group)
                .set("enable.auto.commit", "false")
                .set("isolation.level", isolation)
                .create()
                .expect("create consumer")
        };
        Log {
            topic: run.topic.clone(),
            group: run.group.clone(),
            uncommitted: client("read_uncommitted", &unique("txn-ends")),
            // Asks for the committed offsets of tally's group without joining it.
            committed: client("read_committed", &run.group),
        }
    }

    fn ends(&self, consumer: &BaseConsumer) -> Vec<i64> {
        (0..PARTITIONS)
            .map(|p| {
                let (_, end) = consumer
                    .fetch_watermarks(&self.topic, p, Duration::from_secs(10))
                    .unwrap_or_else(|e| panic!("end of {}/{p}: {e}", self.topic));
                end
            })
            .collect()
    }

    /// High watermarks: one past the last record, markers and open transactions included.
    fn hwm(&self) -> Vec<i64> {
        self.ends(&self.uncommitted)
    }

    /// Last stable offsets: the first offset of the oldest open transaction, else the hwm.
    fn lso(&self) -> Vec<i64> {
        self.ends(&self.committed)
    }

    /// The offsets tally's group committed (`None`: nothing yet).
    fn group_offsets(&self) -> Vec<Option<i64>> {
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition(&self.topic, p);
        }
        let found = self
            .committed
            .committed_offsets(tpl, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("committed offsets of {}: {e}", self.group));
        (0..PARTITIONS)
            .map(
                |p| match found.find_partition(&self.topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => Some(o),
                    _ => None,
                },
            )
            .collect()
    }
}

/// Waits until, on every partition, tally's group committed `ends[p]` and its fence holds
/// `ends[p] - 1`: everything readable is applied, the trailing markers included.
fn wait_caught_up(
    log: &Log,
    conn: &mut redis::Connection,
    run: &Scenario,
    ends: &[i64],
    timeout: Duration,
    mut check: impl FnMut(),
) {
    let started = Instant::now();
    let mut last = String::new();
    let caught_up = try_wait_for(timeout, || {
        check();
        let committed = log.group_offsets();
        let fences = read_fences(conn, &run.prefix, &run.group, &run.topic, ends.len());
        let behind: Vec<String> = (0..ends.len())
            .filter(|&p| {
                ends[p] > 0 && (committed[p] != Some(ends[p]) || fences[p] != Some(ends[p] - 1))
            })
            .map(|p| {
                format!(
                    "p{p}: log readable to {}, committed {:?}, fence {:?}",
                    ends[p], committed[p], fences[p]
                )
            })
            .collect();
        last = behind.join("; ");
        behind.is_empty().then_some(())
    });
    assert!(
        caught_up.is_some(),
        "not caught up within {timeout:?} (a commit that stays short of a trailing transaction \
         marker is lag that never ends): {last}"
    );
    eprintln!(
        "[e2e_transactions] committed and fenced to {ends:?} after {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// The value of `name` by partition, from a scrape of `addr`.
fn by_partition(addr: &str, name: &str) -> BTreeMap<i32, f64> {
    let text = try_scrape_metrics(addr).unwrap_or_default();
    metric_series(&text, name)
        .into_iter()
        .filter_map(|(labels, v)| {
            let p = labels
                .strip_prefix("{partition=\"")?
                .strip_suffix("\"}")?
                .parse()
                .ok()?;
            Some((p, v))
        })
        .collect()
}

/// Waits until tally's lag, in messages and in seconds, is 0 on every partition it reports, and
/// it reports the partitions of `required`. librdkafka computes the lag in messages from the
/// statistics (every second here) as the end of the readable log minus the last commit; a
/// partition is reported once this process committed on it.
fn wait_lag_zero(addr: &str, required: &[i32]) {
    let mut seen = (BTreeMap::new(), BTreeMap::new());
    let zero = try_wait_for(Duration::from_secs(15), || {
        seen = (
            by_partition(addr, "tally_consumer_lag_messages"),
            by_partition(addr, "tally_consumer_lag_seconds"),
        );
        let (messages, seconds) = &seen;
        let present = required.iter().all(|p| messages.contains_key(p));
        let zero = messages.values().chain(seconds.values()).all(|&v| v == 0.0);
        (present && zero).then_some(())
    });
    assert!(
        zero.is_some(),
        "lag in messages {:?} and in seconds {:?}: want 0 on every partition, reported for \
         {required:?} at least",
        seen.0,
        seen.1
    );
}

/// The highest offset of a counted event per partition (-1 where none).
fn last_events(reports: &[Report], plain: &[(i32, i64)]) -> Vec<i64> {
    let mut last = vec![-1; PARTITIONS as usize];
    let committed = reports
        .iter()
        .filter(|r| r.end == End::Commit)
        .flat_map(|r| &r.positions);
    for &(p, o) in committed.chain(plain) {
        last[p as usize] = last[p as usize].max(o);
    }
    last
}

#[test]
fn committed_transactions_are_counted_exactly_and_lag_ends_at_the_last_stable_offset() {
    require_python_kafka();
    let run = Scenario::new("e2e_transactions", "txn", PARTITIONS);
    let mut events = Events::new(run.seed);
    let mut pause_rng = StdRng::seed_from_u64(run.seed ^ 0x51ee);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let log = Log::new(&run);
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--metrics-addr",
            &metrics_addr,
            "-X",
            "statistics.interval.ms=1000",
        ]
        .map(String::from),
    );
    let all: Vec<i32> = (0..PARTITIONS).collect();

    // 1. Two producers at once interleave committed and aborted transactions on every
    // partition, so aborted records sit between committed ones of the other producer. tally
    // is SIGKILLed while they run and started again.
    let plans: Vec<Vec<Txn>> = (0..2)
        .map(|_| {
            (0..FIRST_TRANSACTIONS)
                .map(|_| events.random_transaction())
                .collect()
        })
        .collect();
    let total = plans.iter().map(Vec::len).sum::<usize>();
    let done = AtomicUsize::new(0);
    let mut tally = Tally::spawn_args("tally-1", &args);
    let reports: Vec<Report> = thread::scope(|scope| {
        let producers: Vec<_> = plans
            .iter()
            .enumerate()
            .map(|(i, plan)| {
                let (run, done) = (&run, &done);
                scope.spawn(move || {
                    run_transactions(run, &unique(&format!("txn-{i}")), plan, 100, done)
                })
            })
            .collect();
        wait_for(
            "tally-1 to apply while the producers run",
            Duration::from_secs(90),
            || {
                tally.assert_running();
                let applied: i64 =
                    applied_offsets(&mut conn, &run.prefix, &run.group, &run.topic, all.len())
                        .iter()
                        .sum();
                (applied > 0 && done.load(Ordering::SeqCst) >= total / 4).then_some(())
            },
        );
        thread::sleep(Duration::from_millis(pause_rng.random_range(200..1500)));
        let ended = done.load(Ordering::SeqCst);
        tally.kill9();
        eprintln!("[e2e_transactions] tally-1 SIGKILLed after {ended} of {total} transactions");
        assert!(
            ended < total,
            "the producers finished before the kill; it must land while they run"
        );
        tally = Tally::spawn_args("tally-2", &args);
        producers
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let aborted = reports.iter().filter(|r| r.end == End::Abort).count();
    eprintln!(
        "[e2e_transactions] {total} transactions ({aborted} aborted) of {} events",
        reports.iter().map(|r| r.positions.len()).sum::<usize>()
    );
    assert!(aborted > 0 && aborted < total, "both ends must occur");

    let hwm = log.hwm();
    assert_eq!(log.lso(), hwm, "no transaction is open yet");
    // Every partition ends with a marker (each transaction's last record in a partition), so
    // tally's last event is not the last offset.
    let last = last_events(&reports, &[]);
    for p in 0..PARTITIONS as usize {
        assert!(
            hwm[p] - 1 > last[p],
            "partition {p}: the log (end {}) must end past the last counted event ({})",
            hwm[p],
            last[p]
        );
    }
    wait_caught_up(&log, &mut conn, &run, &hwm, Duration::from_secs(90), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &counts(&events.truth));
    wait_lag_zero(&metrics_addr, &all);

    // 2. A producer opens a transaction on the held partitions, writes to it and is
    // SIGKILLed; until the broker aborts it, it holds their LSO at its first record. Behind
    // it, committed transactions and plain records land on every partition: readable at once
    // where nothing is open, held back on the others.
    let open = events.transaction(End::Open, &HELD, 300);
    let visible_before = events.truth.clone();
    let mut hung = Hung::open(&run, &open, OPEN_TIMEOUT);
    hung.kill9();
    let held_from: BTreeMap<i32, i64> = HELD
        .iter()
        .map(|&p| {
            let first = hung.report.positions.iter().filter(|&&(q, _)| q == p);
            (
                p,
                first
                    .map(|&(_, o)| o)
                    .min()
                    .expect("records on every held partition"),
            )
        })
        .collect();
    eprintln!(
        "[e2e_transactions] producer with an open transaction killed; it holds {held_from:?}"
    );
    let after: Vec<Txn> = (0..4)
        .map(|_| events.transaction(End::Commit, &all, 200))
        .collect();
    let after_reports =
        run_transactions(&run, &unique("txn-after"), &after, 0, &AtomicUsize::new(0));
    let plain = events.plain(2_000);
    let plain_positions = produce_positions(&run.brokers, &run.topic, plain);

    let (lso, hwm) = (log.lso(), log.hwm());
    for p in 0..PARTITIONS {
        let i = p as usize;
        match held_from.get(&p) {
            Some(&first) => {
                let open_here = open.messages.iter().filter(|(q, _)| *q == p).count() as i64;
                assert_eq!(
                    lso[i], first,
                    "p{p}: the LSO is the open transaction's first record"
                );
                assert!(
                    hwm[i] - lso[i] > open_here,
                    "p{p}: the hwm ({}) lies past the open transaction's {open_here} records \
                     and what followed them",
                    hwm[i]
                );
            }
            None => assert_eq!(lso[i], hwm[i], "p{p}: nothing open here"),
        }
    }
    // tally applies everything below the LSO: the partitions held at the marker before the
    // open transaction, the others to their end.
    wait_caught_up(&log, &mut conn, &run, &lso, OPEN_TIMEOUT, || {
        tally.assert_running()
    });
    // The counts hold the held partitions as they were before the open transaction and the
    // others to their end.
    let mut visible = visible_before;
    for p in all.iter().filter(|p| !HELD.contains(p)) {
        visible.insert(*p, events.truth.get(p).cloned().unwrap_or_default());
    }
    run.assert_exact(&mut conn, &counts(&visible));
    // Lag is 0 everywhere, although the held partitions' hwm is far ahead of what tally applied.
    wait_lag_zero(&metrics_addr, &all);
    let (status, body) = http_get(&metrics_addr, "/readyz").expect("GET /readyz");
    assert_eq!(
        status, 200,
        "ready while a transaction holds two partitions:\n{body}"
    );
    let committed = log.group_offsets();
    let behind_hwm: Vec<i64> = (0..PARTITIONS as usize)
        .map(|p| hwm[p] - committed[p].unwrap_or(0))
        .collect();
    // Everything above was seen while the transaction was open.
    assert_eq!(
        log.lso(),
        lso,
        "the broker aborted the open transaction before the checks ended ({:.1} s after its \
         records were written); they need to run while it is open",
        hung.written_at.elapsed().as_secs_f64()
    );
    eprintln!(
        "[e2e_transactions] while the transaction was open ({:.1} s): lag 0 on every partition; \
         the hwm was ahead of the commits by {behind_hwm:?}",
        hung.written_at.elapsed().as_secs_f64()
    );

    // A restart while the transaction may still be open: the fences sit below the LSO, which
    // is what the start-up check of the log sees as its end.
    tally.kill9();
    tally = Tally::spawn_args("tally-3", &args);
    wait_for(
        "tally-3 to own every partition",
        Duration::from_secs(60),
        || {
            tally.assert_running();
            (assigned_partitions(&metrics_addr) == Some(PARTITIONS as f64)).then_some(())
        },
    );
    eprintln!(
        "[e2e_transactions] tally-3 owns every partition; the transaction is {}",
        if log.lso() == lso {
            "still open"
        } else {
            "aborted already"
        }
    );

    // 3. The broker aborts the transaction once its timeout runs out; what it held becomes
    // readable, except its own records, and the held partitions end with its abort marker.
    let aborted_after = wait_for(
        "the broker to abort the killed producer's transaction",
        OPEN_TIMEOUT * 4,
        || (log.lso() == log.hwm()).then(|| hung.written_at.elapsed()),
    );
    eprintln!(
        "[e2e_transactions] the open transaction was aborted {:.1} s after its records were written",
        aborted_after.as_secs_f64()
    );
    let hwm = log.hwm();
    let mut reports = reports;
    reports.extend(after_reports);
    let last = last_events(&reports, &plain_positions);
    for &p in &HELD {
        let i = p as usize;
        assert!(
            hwm[i] - 1 > last[i],
            "p{p}: the abort marker ({}) comes after the last counted event ({})",
            hwm[i] - 1,
            last[i]
        );
    }
    wait_caught_up(&log, &mut conn, &run, &hwm, Duration::from_secs(60), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &counts(&events.truth));
    // This process committed on the held partitions only (the others had nothing new).
    wait_lag_zero(&metrics_addr, &HELD);

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}
