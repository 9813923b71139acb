//! Kafka side: the Tansu broker, topics, an idempotent producer, and readers.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rdkafka::ClientConfig;
use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedMessage;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use tempfile::TempDir;

use super::process::{Guarded, file_tail, log_dir, signal};
use super::{free_port, port_open, unique, wait_for};

pub const TANSU_INSTALL: &str = "cargo install tansu --version 0.6.0 --features dynostore --locked";

/// Path of the `tansu` binary: `~/.cargo/bin/tansu`, else the first one on PATH.
pub fn tansu_bin() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("HOME") {
        let p = Path::new(&home).join(".cargo/bin/tansu");
        if p.is_file() {
            return Some(p);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("tansu"))
        .find(|p| p.is_file())
}

fn require_tansu() -> PathBuf {
    tansu_bin().unwrap_or_else(|| {
        panic!(
            "the tansu broker is not installed (not in ~/.cargo/bin or PATH); run: {TANSU_INSTALL}"
        )
    })
}

/// A Tansu broker this test process started; killed on drop.
pub struct Broker {
    addr: String,
    proc: Guarded,
    log: PathBuf,
    _logs: TempDir,
}

impl Drop for Broker {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "[harness] broker {} log tail:\n{}",
                self.addr,
                self.log_tail(20)
            );
        }
    }
}

/// How a private broker starts, beyond the defaults of [`Broker::start_private`].
#[derive(Debug, Clone, Default)]
pub struct BrokerOptions {
    /// `--authentication`: every client must log in with SASL first.
    pub authentication: bool,
    /// The port the broker tells clients to connect to (a TLS terminator in front of it),
    /// instead of its own.
    pub advertised_port: Option<u16>,
    /// `--storage-engine`; `memory://tansu/` when unset.
    pub storage_engine: Option<String>,
    /// Another tansu binary (one built with more storage engines).
    pub binary: Option<PathBuf>,
}

impl Broker {
    /// A private Tansu broker on a free loopback port, for a test that stops or signals it
    /// (the process's broker must never be paused under other tests).
    pub fn start_private() -> Broker {
        start_private_broker(&BrokerOptions::default())
    }

    /// A private broker started with `options`.
    pub fn start_with(options: &BrokerOptions) -> Broker {
        start_private_broker(options)
    }

    /// Its bootstrap address, `127.0.0.1:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        file_tail(&self.log, lines)
    }

    /// Freezes the broker (SIGSTOP): connections stay open and nothing answers.
    pub fn sigstop(&self) {
        signal(self.pid(), "STOP");
        eprintln!("[harness] broker {} stopped (SIGSTOP)", self.addr);
    }

    /// Wakes the broker (SIGCONT).
    pub fn sigcont(&self) {
        signal(self.pid(), "CONT");
        eprintln!("[harness] broker {} continued (SIGCONT)", self.addr);
    }
}

/// Bootstrap servers for the tests: `TALLY_TEST_BROKERS` (another broker, e.g. an Apache Kafka
/// cluster), or a private Tansu broker started once for this test process.
///
/// `scripts/test` leaves `TALLY_TEST_BROKERS` unset, so every test binary gets a new broker.
/// Tansu's memory storage keeps the sequence numbers of every idempotent producer it has ever
/// seen in one document and rewrites all of it on each idempotent produce: a broker shared by the
/// whole suite slows down with every producer the earlier binaries created (docs/testing.md).
pub fn brokers() -> String {
    if let Ok(b) = std::env::var("TALLY_TEST_BROKERS")
        && !b.trim().is_empty()
    {
        return b;
    }
    PROCESS_BROKER
        .get_or_init(|| start_private_broker(&BrokerOptions::default()))
        .addr
        .clone()
}

static PROCESS_BROKER: OnceLock<Broker> = OnceLock::new();

/// The last `lines` lines of the log of this process's broker, when `brokers` is that broker.
pub fn process_broker_log_tail(brokers: &str, lines: usize) -> Option<String> {
    PROCESS_BROKER
        .get()
        .filter(|b| b.addr == brokers)
        .map(|b| b.log_tail(lines))
}

fn start_private_broker(options: &BrokerOptions) -> Broker {
    let tansu = options.binary.clone().unwrap_or_else(require_tansu);
    let logs = log_dir("tansu-");
    for attempt in 1..=3 {
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let advertised = format!(
            "tcp://127.0.0.1:{}",
            options.advertised_port.unwrap_or(port)
        );
        let log_path = logs.path().join(format!("tansu-{attempt}.log"));
        let log = File::create(&log_path).expect("create tansu log");
        let mut cmd = Command::new(&tansu);
        cmd.arg("broker")
            .arg("--listener-url")
            .arg(&url)
            .arg("--advertised-listener-url")
            .arg(&advertised)
            .arg("--storage-engine")
            .arg(
                options
                    .storage_engine
                    .as_deref()
                    .unwrap_or("memory://tansu/"),
            );
        if options.authentication {
            cmd.arg("--authentication");
        }
        let mut proc = Guarded::spawn(
            cmd.env("RUST_LOG", tansu_log_filter())
                .stdout(log.try_clone().unwrap())
                .stderr(log),
        )
        .expect("spawn tansu broker");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if port_open(port) {
                eprintln!(
                    "[harness] private Tansu broker on 127.0.0.1:{port}, log {}",
                    log_path.display()
                );
                return Broker {
                    addr: format!("127.0.0.1:{port}"),
                    proc,
                    log: log_path,
                    _logs: logs,
                };
            }
            if let Ok(Some(status)) = proc.child.try_wait() {
                eprintln!(
                    "[harness] tansu exited ({status}) on port {port}:\n{}",
                    file_tail(&log_path, 20)
                );
                proc.release_watchdog();
                break;
            }
            if Instant::now() > deadline {
                panic!(
                    "tansu did not accept connections on {port} within 30 s:\n{}",
                    file_tail(&log_path, 20)
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
    panic!("could not start a Tansu broker");
}

/// Log filter for the Tansu broker: `TALLY_TEST_TANSU_LOG`, or warnings plus the group
/// coordinator's membership changes.
fn tansu_log_filter() -> String {
    std::env::var("TALLY_TEST_TANSU_LOG")
        .unwrap_or_else(|_| "warn,tansu_broker::coordinator=info".to_string())
}

fn base_consumer(brokers: &str, group: Option<&str>) -> BaseConsumer {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", brokers)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("auto.offset.reset", "earliest");
    if let Some(g) = group {
        cfg.set("group.id", g);
    }
    cfg.create().expect("create consumer")
}

/// Creates `name` with `partitions` partitions and waits until metadata shows all of them.
pub fn create_topic(name: &str, partitions: i32) {
    create_topic_on(&brokers(), name, partitions);
}

/// `create_topic` on the given brokers.
pub fn create_topic_on(brokers: &str, name: &str, partitions: i32) {
    let brokers = brokers.to_string();
    if let Some(tansu) = tansu_bin() {
        let first = brokers.split(',').next().unwrap().trim();
        let out = Command::new(tansu)
            .args(["topic", "create", name, "--partitions"])
            .arg(partitions.to_string())
            .arg("--broker")
            .arg(format!("tcp://{first}"))
            .stdin(Stdio::null())
            .output()
            .expect("run tansu topic create");
        assert!(
            out.status.success(),
            "tansu topic create {name} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    } else {
        create_topic_admin(&brokers, name, partitions);
    }
    wait_for_topic(&brokers, name, partitions);
}

fn create_topic_admin(brokers: &str, name: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("create admin client");
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let res = futures::executor::block_on(admin.create_topics(&[topic], &AdminOptions::new()))
        .expect("create_topics");
    for r in res {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
    }
}

fn wait_for_topic(brokers: &str, name: &str, partitions: i32) {
    let consumer = base_consumer(brokers, None);
    wait_for(
        &format!("topic {name} with {partitions} partitions in metadata"),
        Duration::from_secs(60),
        || {
            let md = consumer
                .fetch_metadata(Some(name), Duration::from_secs(5))
                .ok()?;
            let t = md.topics().iter().find(|t| t.name() == name)?;
            let ready = t.error().is_none()
                && t.partitions().len() == partitions as usize
                && t.partitions()
                    .iter()
                    .all(|p| p.error().is_none() && p.leader() >= 0);
            ready.then_some(())
        },
    );
}

/// Next offset (high watermark) of every partition of `topic`, indexed by partition, for a topic
/// nobody is producing to at the moment.
///
/// Tansu 0.6 (memory storage) answers ListOffsets(latest) with the base offset of the last record
/// batch plus one, not the last offset plus one, so the listed value is only a lower bound: the
/// tail from there on is read to find the real end.
pub fn high_watermarks(brokers: &str, topic: &str) -> Vec<i64> {
    let consumer = base_consumer(brokers, Some(&unique("harness-tail")));
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("fetch metadata");
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .unwrap_or_else(|| panic!("topic {topic} not in metadata"));
    let n = t.partitions().len() as i32;
    let mut ends: Vec<i64> = (0..n)
        .map(|p| {
            let (_, high) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("watermarks of {topic}/{p}: {e}"));
            high
        })
        .collect();
    let mut tpl = TopicPartitionList::new();
    for (p, &listed) in ends.iter().enumerate() {
        tpl.add_partition_offset(topic, p as i32, Offset::Offset((listed - 1).max(0)))
            .expect("add partition");
    }
    consumer.assign(&tpl).expect("assign");
    let idle = Duration::from_millis(1500);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last_message = Instant::now();
    while last_message.elapsed() < idle && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                let end = &mut ends[m.partition() as usize];
                *end = (*end).max(m.offset() + 1);
                last_message = Instant::now();
            }
            Some(Err(e)) => eprintln!("[harness] reading the tail of {topic}: {e}"),
            None => {}
        }
    }
    ends
}

/// Next offset of every partition (`0..partitions`) after messages at `positions`.
pub fn ends_of(positions: &[(i32, i64)], partitions: i32) -> Vec<i64> {
    let mut ends = vec![0; partitions as usize];
    for &(p, o) in positions {
        ends[p as usize] = ends[p as usize].max(o + 1);
    }
    ends
}

/// One message to produce: key, value, partition.
pub type Msg = (Option<Vec<u8>>, Vec<u8>, i32);

/// Produces every message to its explicit partition with an idempotent producer, waits for every
/// delivery and returns the number of messages per partition.
pub fn produce(
    brokers: &str,
    topic: &str,
    messages: impl IntoIterator<Item = Msg>,
) -> BTreeMap<i32, u64> {
    let mut counts = BTreeMap::new();
    for (partition, _) in produce_positions(brokers, topic, messages) {
        *counts.entry(partition).or_insert(0) += 1;
    }
    counts
}

/// Produces one message to `partition` with the Kafka timestamp `timestamp_ms` (a producer
/// whose clock is off), up to 8 MB large; returns its offset.
pub fn produce_stamped(
    brokers: &str,
    topic: &str,
    partition: i32,
    value: &[u8],
    timestamp_ms: i64,
) -> i64 {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.max.bytes", "8388608")
        .create()
        .expect("create producer");
    let record = FutureRecord::<(), _>::to(topic)
        .payload(value)
        .partition(partition)
        .timestamp(timestamp_ms);
    match futures::executor::block_on(producer.send(record, Duration::from_secs(30))) {
        Ok(delivery) => delivery.offset,
        Err((e, _)) => panic!("delivery to {topic} failed: {e}"),
    }
}

/// Like `produce`, but returns the (partition, offset) of every message, in input order.
///
/// Every record batch holds exactly one message (`batch.num.messages=1`): Tansu 0.6 answers a
/// fetch from an offset inside a multi-message batch with the *next* batch, silently skipping the
/// rest of the one holding the offset, which would turn every resume position of the consumer
/// (a fence + 1) inside a batch into lost events. One message per batch makes every offset a
/// batch start. Partitions are spread over a few producers running in parallel to make up for
/// the smaller batches; the order within a partition is kept.
pub fn produce_positions(
    brokers: &str,
    topic: &str,
    messages: impl IntoIterator<Item = Msg>,
) -> Vec<(i32, i64)> {
    produce_positions_with(brokers, topic, messages, &[])
}

/// `produce_positions` with extra librdkafka properties (TLS, SASL) for every producer.
pub fn produce_positions_with(
    brokers: &str,
    topic: &str,
    messages: impl IntoIterator<Item = Msg>,
    properties: &[(&str, &str)],
) -> Vec<(i32, i64)> {
    let producers = std::env::var("TALLY_TEST_PRODUCERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4usize)
        .max(1);
    let mut lanes: Vec<Vec<(usize, Msg)>> = (0..producers).map(|_| Vec::new()).collect();
    let mut total = 0;
    for (i, m) in messages.into_iter().enumerate() {
        lanes[m.2.rem_euclid(producers as i32) as usize].push((i, m));
        total = i + 1;
    }
    let mut positions = vec![(-1, -1); total];
    let results: Vec<Vec<(usize, (i32, i64))>> = thread::scope(|scope| {
        let handles: Vec<_> = lanes
            .into_iter()
            .filter(|lane| !lane.is_empty())
            .map(|lane| scope.spawn(move || produce_lane(brokers, topic, lane, properties)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    for (i, pos) in results.into_iter().flatten() {
        positions[i] = pos;
    }
    positions
}

fn produce_lane(
    brokers: &str,
    topic: &str,
    lane: Vec<(usize, Msg)>,
    properties: &[(&str, &str)],
) -> Vec<(usize, (i32, i64))> {
    let batch = std::env::var("TALLY_TEST_BATCH_MESSAGES").unwrap_or_else(|_| "1".to_string());
    let mut config = ClientConfig::new();
    for (key, value) in properties {
        config.set(*key, *value);
    }
    let producer: FutureProducer = config
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("batch.num.messages", &batch)
        .set("queue.buffering.max.messages", "100000")
        .set("message.timeout.ms", "300000")
        .create()
        .expect("create producer");
    let mut out = Vec::with_capacity(lane.len());
    futures::executor::block_on(async {
        let mut pending = FuturesUnordered::new();
        for (i, (key, value, partition)) in lane {
            let mut rec = FutureRecord::to(topic).payload(&value).partition(partition);
            if let Some(k) = &key {
                rec = rec.key(k);
            }
            loop {
                match producer.send_result(rec) {
                    Ok(fut) => {
                        pending.push(async move { (i, fut.await) });
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        rec = r;
                        match pending.next().await {
                            Some((i, res)) => out.push((i, delivered(topic, res))),
                            None => thread::sleep(Duration::from_millis(10)),
                        }
                    }
                    Err((e, _)) => panic!("produce to {topic}: {e}"),
                }
            }
            while pending.len() >= 10_000 {
                let (i, res) = pending.next().await.unwrap();
                out.push((i, delivered(topic, res)));
            }
        }
        while let Some((i, res)) = pending.next().await {
            out.push((i, delivered(topic, res)));
        }
    });
    out
}

type DeliveryOutcome = Result<
    rdkafka::producer::future_producer::OwnedDeliveryResult,
    futures::channel::oneshot::Canceled,
>;

fn delivered(topic: &str, res: DeliveryOutcome) -> (i32, i64) {
    match res {
        Ok(Ok(delivery)) => (delivery.partition, delivery.offset),
        Ok(Err((e, _))) => panic!("delivery to {topic} failed: {e}"),
        Err(_) => panic!("delivery to {topic} canceled"),
    }
}

/// Reads `topic` from the beginning with a fresh group until every partition's high watermark
/// (taken at call time) is reached, or `timeout` passes.
pub fn read_topic(brokers: &str, topic: &str, timeout: Duration) -> Vec<OwnedMessage> {
    let hwms = high_watermarks(brokers, topic);
    let group = unique("harness-reader");
    let consumer = base_consumer(brokers, Some(&group));
    let mut tpl = TopicPartitionList::new();
    for p in 0..hwms.len() as i32 {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("add partition");
    }
    consumer.assign(&tpl).expect("assign");
    let mut next: Vec<i64> = vec![0; hwms.len()];
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    while next.iter().zip(&hwms).any(|(n, h)| n < h) && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                next[m.partition() as usize] = m.offset() + 1;
                out.push(m.detach());
            }
            Some(Err(e)) => eprintln!("[harness] reading {topic}: {e}"),
            None => {}
        }
    }
    out
}

/// Value of header `name` of a message as a UTF-8 string.
pub fn header_str(m: &OwnedMessage, name: &str) -> Option<String> {
    use rdkafka::message::Headers;
    let headers = m.headers()?;
    headers
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}
