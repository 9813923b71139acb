//! Topics and records: creating topics, producing as like producers do (idempotent, batched,
//! compressed), end offsets and reading a topic back.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
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

use super::kafka::{brokers, on_tansu, tansu_bin};
use super::{unique, wait_for};

/// A topic setting that lets producers stamp records with any time. Since Kafka 3.6 a broker
/// refuses records stamped more than an hour ahead of its clock by default
/// (`log.message.timestamp.after.max.ms`); tests of producers with wrong clocks lift that limit,
/// as a topic created before that default, or configured so, has none.
pub const ANY_PRODUCER_CLOCK: (&str, &str) =
    ("message.timestamp.after.max.ms", "9223372036854775807");

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

/// `create_topic` on the given brokers, replicated as the brokers' default says (3 on the
/// failover cluster, 1 elsewhere).
pub fn create_topic_on(brokers: &str, name: &str, partitions: i32) {
    create_topic_with(brokers, name, partitions, &[]);
}

/// `create_topic_on` with topic settings (`retention.ms`, `segment.ms`, ...).
pub fn create_topic_with(brokers: &str, name: &str, partitions: i32, configs: &[(&str, &str)]) {
    if on_tansu() {
        let tansu = tansu_bin().expect("tansu");
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
        create_topic_admin(brokers, name, partitions, configs);
    }
    wait_for_topic(brokers, name, partitions);
}

/// Deletes `name` and waits until metadata no longer lists it.
pub fn delete_topic(brokers: &str, name: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("create admin client");
    let res = futures::executor::block_on(admin.delete_topics(&[name], &AdminOptions::new()))
        .expect("delete_topics");
    for r in res {
        r.unwrap_or_else(|(t, e)| panic!("delete topic {t}: {e}"));
    }
    let consumer = base_consumer(brokers, None);
    wait_for(
        &format!("topic {name} gone from metadata"),
        Duration::from_secs(60),
        || {
            let md = consumer
                .fetch_metadata(Some(name), Duration::from_secs(5))
                .ok()?;
            let gone = md
                .topics()
                .iter()
                .all(|t| t.name() != name || t.error().is_some());
            gone.then_some(())
        },
    );
}

fn create_topic_admin(brokers: &str, name: &str, partitions: i32, configs: &[(&str, &str)]) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("create admin client");
    // -1: the broker's default.replication.factor.
    let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(-1));
    for (k, v) in configs {
        topic = topic.set(k, v);
    }
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
/// On Tansu 0.6 (memory storage) the listed value is only a lower bound: it answers
/// ListOffsets(latest) with the base offset of the last record batch plus one, so there the tail
/// is read to find the real end (docs/testing.md, appendix).
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
    if !on_tansu() {
        return ends;
    }
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
/// Produced as like producers do: idempotent, `acks=all`, lz4-compressed record batches of up to
/// 10,000 messages gathered for 5 ms. Partitions are spread over a few producers running in
/// parallel (`TALLY_TEST_PRODUCERS`, default 4); the order within a partition is kept. On Tansu
/// 0.6 every batch holds one message: it answers a fetch from inside a multi-message batch with
/// the next batch (docs/testing.md, appendix).
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
    let batch = if on_tansu() { "1" } else { "10000" };
    let mut config = ClientConfig::new();
    for (key, value) in properties {
        config.set(*key, *value);
    }
    let producer: FutureProducer = config
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("batch.num.messages", batch)
        .set("compression.type", "lz4")
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
