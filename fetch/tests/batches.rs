//! `Batches` against librdkafka's mock cluster: every message of a split
//! partition queue comes out once, in offset order, with its key, value and
//! timestamp, and no call hands out more than it was asked for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Offset, Timestamp, TopicPartitionList};
use tally_fetch::{AT_MOST, Batches};

const TOPIC: &str = "batches";
const MESSAGES: i64 = 1_000;

#[test]
fn a_split_queue_is_taken_whole_in_order_and_in_bounded_calls() {
    let cluster = MockCluster::new(1).expect("a mock cluster");
    cluster.create_topic(TOPIC, 2, 1).expect("a topic");
    let brokers = cluster.bootstrap_servers();

    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("a producer");
    for n in 0..MESSAGES {
        let value = format!("value {n}");
        let key = format!("key {n}");
        let record = BaseRecord::to(TOPIC)
            .partition(1)
            .key(&key)
            .payload(&value)
            .timestamp(1_700_000_000_000 + n);
        producer.send(record).map_err(|(e, _)| e).expect("queued");
    }
    producer.flush(Duration::from_secs(10)).expect("flushed");

    let consumer: Arc<BaseConsumer> = Arc::new(
        ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", "batches")
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer"),
    );
    let queue = consumer
        .split_partition_queue(TOPIC, 1)
        .expect("a split queue");
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(TOPIC, 1, Offset::Beginning)
        .expect("an offset");
    consumer.assign(&assignment).expect("assigned");
    let batches = Batches::new(consumer.clone(), TOPIC, 1).expect("a second handle");

    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut asked = 1;
    while (seen.len() as i64) < MESSAGES {
        assert!(
            Instant::now() < deadline,
            "only {} of {MESSAGES} messages came",
            seen.len()
        );
        // The consumer's own queue serves its events (the assignment).
        let _ = consumer.poll(Duration::ZERO);
        let mut taken = Vec::new();
        let count = batches.take(asked, &mut taken);
        assert_eq!(count, taken.len());
        assert!(count <= asked, "asked for {asked}, handed {count}");
        if count == 0 {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        for message in taken {
            let message = message.expect("no error on a healthy partition");
            let n = message.offset();
            assert_eq!(message.partition(), 1);
            assert_eq!(message.payload(), Some(format!("value {n}").as_bytes()));
            assert_eq!(message.key(), Some(format!("key {n}").as_bytes()));
            assert_eq!(
                message.timestamp(),
                Timestamp::CreateTime(1_700_000_000_000 + n)
            );
            seen.push(n);
        }
        // Sizes from 1 past the cap, so short and capped calls both occur.
        asked = asked % (AT_MOST + 8) + 1;
    }
    assert_eq!(seen, (0..MESSAGES).collect::<Vec<_>>());
    assert_eq!(batches.take(0, &mut Vec::new()), 0);
    drop(queue);
}
