//! Dead letters: copies of bad messages, confirmed before their batch applies.
//!
//! Invariant: a bad message's copy is acknowledged by Kafka before the fence
//! moves past its offset, so no bad message is ever lost from view. Copies are
//! at-least-once: a batch replayed after a crash copies its bad messages again;
//! consumers of the dead-letter topic deduplicate on the source headers.
//!
//! A copy that keeps failing (a missing topic, an ACL refusal, a value over
//! the topic's size limit) is retried without end, since dropping it would
//! lose the message from view; each failure is counted, and after
//! [`crate::infra::health::DEAD_LETTER_BOUND`] of failures readiness fails
//! with the error, so it is never silent.

use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::infra::health;
use crate::infra::retry::Backoff;
use crate::pipeline::decode::BadReason;

/// Header carrying the reason a message was rejected.
pub const HEADER_REASON: &str = "tally-reason";
/// Header carrying the source topic.
pub const HEADER_TOPIC: &str = "tally-source-topic";
/// Header carrying the source partition.
pub const HEADER_PARTITION: &str = "tally-source-partition";
/// Header carrying the source offset.
pub const HEADER_OFFSET: &str = "tally-source-offset";

/// One bad message to copy.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// Original key.
    pub key: Option<Vec<u8>>,
    /// Original value.
    pub value: Option<Vec<u8>>,
    /// Why it was rejected.
    pub reason: BadReason,
    /// Source partition.
    pub partition: i32,
    /// Source offset.
    pub offset: i64,
}

/// A copy on its way.
pub struct Pending {
    letter: DeadLetter,
    delivery: Result<DeliveryFuture, String>,
}

/// Producer for the dead-letter topic.
pub struct DeadLetters {
    producer: FutureProducer,
    topic: String,
    source_topic: String,
}

impl DeadLetters {
    /// Wraps a producer.
    pub fn new(producer: FutureProducer, topic: &str, source_topic: &str) -> Self {
        Self {
            producer,
            topic: topic.to_string(),
            source_topic: source_topic.to_string(),
        }
    }

    fn start(&self, letter: &DeadLetter) -> Result<DeliveryFuture, String> {
        let partition = letter.partition.to_string();
        let offset = letter.offset.to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: HEADER_REASON,
                value: Some(letter.reason.as_str()),
            })
            .insert(Header {
                key: HEADER_TOPIC,
                value: Some(self.source_topic.as_str()),
            })
            .insert(Header {
                key: HEADER_PARTITION,
                value: Some(partition.as_str()),
            })
            .insert(Header {
                key: HEADER_OFFSET,
                value: Some(offset.as_str()),
            });
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.topic).headers(headers);
        if let Some(key) = &letter.key {
            record = record.key(key.as_slice());
        }
        if let Some(value) = &letter.value {
            record = record.payload(value.as_slice());
        }
        self.producer
            .send_result(record)
            .map_err(|(error, _)| error.to_string())
    }

    /// Starts copying a bad message.
    pub fn send(&self, letter: DeadLetter) -> Pending {
        let delivery = self.start(&letter);
        Pending { letter, delivery }
    }

    /// Waits until every copy is acknowledged, sending failures again with
    /// backoff. Returns `false` if cancelled first.
    pub async fn confirm(&self, pending: Vec<Pending>, cancel: &CancellationToken) -> bool {
        for Pending {
            letter,
            mut delivery,
        } in pending
        {
            let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
            loop {
                let sent = std::mem::replace(&mut delivery, Err(String::new()));
                let outcome = match sent {
                    Ok(future) => match future.await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err((error, _))) => Err(error.to_string()),
                        Err(_) => Err("the producer dropped the delivery".to_string()),
                    },
                    Err(error) => Err(error),
                };
                health::dead_letters(&self.topic, outcome.clone());
                let Err(error) = outcome else {
                    crate::infra::metrics::dead_lettered();
                    break;
                };
                crate::infra::metrics::dead_letter_failed();
                warn!(
                    partition = letter.partition,
                    offset = letter.offset,
                    topic = %self.topic,
                    %error,
                    "Dead-letter copy failed; retrying."
                );
                tokio::select! {
                    _ = cancel.cancelled() => return false,
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                }
                delivery = self.start(&letter);
            }
        }
        true
    }
}
