//! Operations on stored counts: rebuild a generation from the topic, verify
//! counts against it, remove old generations, change a post's routing,
//! undo routing made final far ahead, reset the fences of a log that was
//! replaced.
//!
//! Each returns what it did as data; the CLI decides how to show it.

pub mod gc;
pub mod promote;
pub mod rebuild;
pub mod reset;
pub mod unfreeze;
pub mod verify;

use rdkafka::error::KafkaError;
use redis::RedisError;

use crate::domain::layout::{self, LayoutError, OpenStore};
use crate::infra::config::{ConfigError, RunSettings};
use crate::infra::store::ConnectError;
use crate::pipeline::apply::Applier;
use crate::pipeline::consume::TopicError;
use crate::pipeline::run::{RunError, writer_layout};
use crate::read::ReadError;

/// Why an operation stopped.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// A setting is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Redis is unreachable or refused at start-up.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A Redis call failed.
    #[error("Redis: {0}")]
    Redis(#[from] RedisError),
    /// The brokers or a topic are unavailable.
    #[error(transparent)]
    Topic(#[from] TopicError),
    /// A Kafka call failed; `doing` says which.
    #[error("{doing}: {source}")]
    Kafka {
        /// What was being done.
        doing: String,
        /// The client's error.
        source: KafkaError,
    },
    /// The settings differ from the prefix's layout record, or it is unusable.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Reading counts failed.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// A pipeline the operation runs stopped with an error.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Publishing a routing version failed, or too few replicas held it.
    #[error(transparent)]
    Publish(#[from] crate::domain::versions::PublishError),
    /// `tally unfreeze-routing` changed nothing; the text says why.
    #[error(transparent)]
    Unfreeze(#[from] unfreeze::Refusal),
    /// A blocking task of the operation panicked.
    #[error("a worker task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The operation cannot go on; the text says why and what to do.
    #[error("{0}")]
    Refused(String),
}

impl From<layout::OpenError> for OpError {
    fn from(error: layout::OpenError) -> Self {
        match error {
            layout::OpenError::Connect(e) => OpError::Connect(e),
            layout::OpenError::Layout(e) => OpError::Layout(e),
        }
    }
}

impl OpError {
    /// A Kafka error while `doing` something.
    pub fn kafka(doing: impl Into<String>) -> impl FnOnce(KafkaError) -> OpError {
        let doing = doing.into();
        move |source| OpError::Kafka { doing, source }
    }
}

/// Checks `settings` and opens their store, with an applier of the live
/// group's fences under the base key layout (generation 0; callers move it
/// to the generation they work on), and version 0's bucket count (the
/// record's, or the settings' for a prefix not written yet).
async fn open_applier(settings: &RunSettings) -> Result<(OpenStore, Applier, u32), OpError> {
    if let Some(problem) = settings.problems().into_iter().next() {
        return Err(problem.into());
    }
    let opened = layout::open(&settings.store).await?;
    let writer = writer_layout(settings);
    let proposed = layout::Record::of_writer(&writer, 0);
    let mut opened = opened;
    let epoch0 = match layout::read_record(&opened.store, settings.store.prefix()).await? {
        Some(record) => {
            // The layout flags name a new generation's packing: a rebuild
            // checks them against the generation it fills.
            let writer = layout::WriterLayout {
                packing: None,
                ..writer
            };
            layout::check_writer(&opened, &writer, &record, 0).await?;
            opened.keys = opened
                .keys
                .with_packing(record.packing_of(0))
                .with_windows(record.windows.clone());
            record.buckets
        }
        None => proposed.buckets,
    };
    let applier = Applier::new(
        opened.store.clone(),
        opened.target().clone(),
        opened.keys.clone(),
        &settings.kafka.group,
        &settings.kafka.topic,
    );
    Ok((opened, applier, epoch0))
}
