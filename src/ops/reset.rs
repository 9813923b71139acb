//! Reset: `tally reset-fences`, for a log that is no longer the one the
//! fences were built on (a topic deleted and recreated, a broker that came
//! back empty; see [`crate::pipeline::guard`]).
//!
//! It deletes the group's fences of every partition of the topic in the
//! current generation and sets each partition's origin to its low
//! watermark, so the next owner counts the log from its start, on top of
//! the counts already stored. That is exact when the log holds only events
//! never counted; when it holds the old events again, a `tally rebuild`
//! after the reset recounts everything into a new generation. Every
//! partition is reset, not only those whose fence is ahead: in a recreated
//! topic a partition that already has more events than its old fence would
//! otherwise skip the new ones below it. Run it with every `tally run` of
//! the group stopped.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use redis::RedisError;

use crate::domain::generation;
use crate::infra::config::RunSettings;
use crate::infra::store::Shared;
use crate::ops::{OpError, open_applier};
use crate::pipeline::consume::check_topic;

/// One partition before the reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionReset {
    /// The partition.
    pub partition: i32,
    /// The highest slot-group fence stored, if any.
    pub fence: Option<i64>,
    /// The log's low watermark: the new origin.
    pub low: i64,
    /// The log's high watermark.
    pub high: i64,
}

impl PartitionReset {
    /// Whether the fence lies beyond the end of the log.
    pub fn ahead(&self) -> bool {
        self.fence.is_some_and(|f| f >= self.high)
    }
}

/// What a reset of the settings' group and topic would change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The generation whose fences are reset.
    pub generation: u64,
    /// Its key prefix.
    pub prefix: String,
    /// Every partition of the topic.
    pub partitions: Vec<PartitionReset>,
}

/// Reads the fences and the log of every partition; changes nothing.
pub async fn plan(settings: &RunSettings) -> Result<Plan, OpError> {
    let (opened, applier, _) = open_applier(settings).await?;
    let base = settings.store.prefix();
    if let Some(rebuild) = generation::read_record(&opened.store, base).await? {
        return Err(OpError::Refused(format!(
            "a rebuild into generation {} is under way; finish it or run `tally rebuild --abort` first",
            rebuild.generation
        )));
    }
    let pointer = generation::read_pointer(&opened.store, base).await?;
    let keys = opened
        .keys
        .with_prefix(generation::prefix_of(base, pointer.current));
    let applier = applier.with_keys(keys.clone());
    let kafka = &settings.kafka;
    let consumer: BaseConsumer = kafka
        .secure_client_config()
        .set("group.id", format!("{}-reset", kafka.group))
        .set("enable.auto.commit", "false")
        .create()
        .map_err(OpError::kafka("creating the Kafka client"))?;
    let count = check_topic(&consumer, &kafka.brokers, &kafka.topic, "topic")?;
    let mut partitions = Vec::with_capacity(count);
    for p in 0..count as i32 {
        let fences = applier.read_fences(p).await?;
        let (low, high) = tokio::task::block_in_place(|| {
            consumer.fetch_watermarks(&kafka.topic, p, Duration::from_secs(10))
        })
        .map_err(OpError::kafka(format!(
            "reading partition {p}'s watermarks"
        )))?;
        partitions.push(PartitionReset {
            partition: p,
            fence: fences.fences.iter().flatten().copied().max(),
            low,
            high,
        });
    }
    Ok(Plan {
        generation: pointer.current,
        prefix: keys.prefix().to_string(),
        partitions,
    })
}

/// Carries out `plan`: per partition, every slot group's fence deleted and
/// the origin set to the low watermark. Returns the keys written.
pub async fn reset(settings: &RunSettings, plan: &Plan) -> Result<usize, OpError> {
    let (opened, applier, _) = open_applier(settings).await?;
    let keys = opened.keys.with_prefix(plan.prefix.clone());
    let applier = applier.with_keys(keys.clone());
    let fences = applier.fence_reader();
    let groups = keys.groups().count();
    let mut written = 0;
    for p in &plan.partitions {
        for group in 0..groups {
            del(&opened.store, fences.fence_key(p.partition, group)).await?;
            written += 1;
        }
        set(
            &opened.store,
            fences.origin_key(p.partition),
            p.low.to_string(),
        )
        .await?;
        written += 1;
    }
    Ok(written)
}

// One key per call: on a cluster the keys lie in different slots.
async fn del(store: &Shared, key: String) -> Result<(), RedisError> {
    store
        .call(|mut s| {
            let key = key.clone();
            async move { redis::cmd("DEL").arg(&key).query_async::<()>(&mut s).await }
        })
        .await
}

async fn set(store: &Shared, key: String, value: String) -> Result<(), RedisError> {
    store
        .call(|mut s| {
            let (key, value) = (key.clone(), value.clone());
            async move {
                redis::cmd("SET")
                    .arg(&key)
                    .arg(&value)
                    .query_async::<()>(&mut s)
                    .await
            }
        })
        .await
}
