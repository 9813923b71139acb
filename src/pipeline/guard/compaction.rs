//! Compaction: the consumed topic must keep every record until retention
//! deletes it.
//!
//! Invariant: tally never starts on a topic whose `cleanup.policy` includes
//! `compact`, and a running consumer reports one set under it. Kafka's log
//! cleaner keeps only the newest record of each key: likes that share a key
//! (a post's, a user's) would vanish before a lagging consumer, a replay or
//! a rebuild reads them, and the counts would depend on when the cleaner ran.
//! A policy that cannot be read (DescribeConfigs denied) is warned about and
//! passed, as the store's eviction policy is.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::GuardError;
use super::watch::{Change, Finding, next_tick, rechecks};
use crate::infra::config::KafkaSettings;

/// How often a running consumer reads its topic's `cleanup.policy` again.
pub const COMPACTION_RECHECK: Duration = Duration::from_secs(10);

/// The refusal a topic's `policy` earns.
fn compaction_refusal(topic: &str, policy: &str) -> Result<(), GuardError> {
    match policy.split(',').any(|p| p.trim() == "compact") {
        true => Err(GuardError::CompactedTopic {
            topic: topic.to_string(),
            policy: policy.to_string(),
        }),
        false => Ok(()),
    }
}

/// Reads `cleanup.policy` of `topic`; why it could not, as text.
async fn cleanup_policy(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
) -> Result<String, String> {
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let results = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &options)
        .await
        .map_err(|e| e.to_string())?;
    let resource = results
        .into_iter()
        .next()
        .ok_or("the brokers answered for no topic")?
        .map_err(|code| code.to_string())?;
    // Absent, the broker's default applies: log.cleanup.policy, delete
    // unless a broker was configured otherwise, which its topics then show.
    Ok(resource
        .get("cleanup.policy")
        .and_then(|entry| entry.value.clone())
        .unwrap_or_else(|| "delete".to_string()))
}

fn admin(kafka: &KafkaSettings) -> Result<AdminClient<DefaultClientContext>, GuardError> {
    kafka
        .secure_client_config()
        .create()
        .map_err(|e| GuardError::Unreadable(format!("cannot create a Kafka admin client: {e}")))
}

fn unread(topic: &str, why: &str) {
    warn!(
        %topic,
        error = %why,
        "Cannot read the topic's cleanup.policy: tally requires delete (a compacted topic drops likes that share a key); grant DescribeConfigs on the topic, or check it with kafka-configs."
    );
}

/// Refuses a consumed topic with a compacting `cleanup.policy`.
pub async fn check_compaction(kafka: &KafkaSettings) -> Result<(), GuardError> {
    match cleanup_policy(&admin(kafka)?, &kafka.topic).await {
        Ok(policy) => compaction_refusal(&kafka.topic, &policy),
        Err(why) => {
            unread(&kafka.topic, &why);
            Ok(())
        }
    }
}

/// Reads the topic's `cleanup.policy` again every [`COMPACTION_RECHECK`]
/// until `shutdown`: one [`check_compaction`] would refuse, set under a
/// running consumer, is an ERROR line when first seen and
/// `tally_topic_compacted` (and its alert) for as long as it lasts.
pub fn spawn_compaction_watch(
    kafka: KafkaSettings,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    crate::infra::metrics::topic_compacted(false);
    crate::infra::tasks::spawn("compaction-watch", async move {
        let Ok(admin) = admin(&kafka) else {
            return;
        };
        let mut every = rechecks(COMPACTION_RECHECK).await;
        let mut finding = Finding::new();
        while next_tick(&mut every, &shutdown).await {
            let Ok(policy) = cleanup_policy(&admin, &kafka.topic).await else {
                continue;
            };
            let refusal = compaction_refusal(&kafka.topic, &policy).err();
            crate::infra::metrics::topic_compacted(refusal.is_some());
            match finding.update(refusal.map(|refusal| refusal.to_string())) {
                Change::Appeared(problem) => {
                    error!(%problem, "The consumed topic's cleanup.policy changed under a running tally: Kafka may delete likes before they are counted.");
                }
                Change::Cleared => {
                    info!(topic = %kafka.topic, %policy, "The consumed topic keeps every record again.");
                }
                Change::Same => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_compacting_policy_is_refused() {
        for policy in ["compact", "delete,compact", "compact, delete"] {
            let refusal = compaction_refusal("likes", policy).unwrap_err().to_string();
            assert!(
                refusal.contains("cleanup.policy")
                    && refusal.contains("likes")
                    && refusal.contains("kafka-configs")
                    && !refusal.contains('\n'),
                "{refusal}"
            );
        }
        for policy in ["delete", ""] {
            assert_eq!(compaction_refusal("likes", policy), Ok(()), "{policy}");
        }
    }
}
