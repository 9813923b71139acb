//! Consume: the Kafka consumer, and where each assignment learns its fence.
//!
//! Invariant: a partition is never read from a position tally invented. On every
//! assignment (not only at start-up) the rebalance callback reads the
//! partition's fence from Redis and assigns the partition at `fence + 1`, so
//! consumption resumes exactly where Redis is, whatever Kafka's committed offset
//! says. When the fence cannot be read (Redis unreachable during a rebalance),
//! the partition starts at the committed offset and the first script call
//! corrects the position: the fence check never depends on this read.
//!
//! Both group protocols hand partitions over through the same callback. Under
//! the classic one with `cooperative-sticky`, and always under the consumer
//! protocol (KIP-848, where the broker assigns), assignments and revocations
//! are incremental: a rebalance may add or take one partition at a time, each
//! addition is read at its fences like any other, and the partitions that
//! stay keep flowing. A static member (`group.instance.id`) that restarts gets
//! its partitions back without a rebalance, but through a new consumer, whose
//! assignment passes here too.
//!
//! Every partition assigned gets a queue of its own, split in the callback
//! before the partition is handed back to librdkafka, so that nothing
//! fetched for the new ownership reaches the consumer's queue (see
//! [`crate::pipeline::run`] for who reads it).
//!
//! Offsets are never auto-stored: only an applied batch stores its offset,
//! and librdkafka commits what is stored (see [`crate::pipeline::commit`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::consumer::stream_consumer::StreamPartitionQueue;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use tracing::{debug, error, info, warn};

use crate::domain::fence::PartitionFences;
use crate::infra::config::{
    GroupProtocol, KafkaSettings, kafka_client_config, with_fetch_settings,
};
use crate::infra::security::{
    KafkaAcl, KafkaRefusal, kafka_denied, kafka_refusal, kafka_refusal_in_log,
};
use crate::pipeline::apply::FenceReader;
use crate::pipeline::guard::{self, LogFit};

/// A partition handed to this consumer, with the fences found for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The partition.
    pub partition: i32,
    /// Origin and slot-group fences read from Redis; `None` when unreadable.
    pub fences: Option<PartitionFences>,
    /// Where the fences' resume offset lies in the partition's log, when
    /// both could be read.
    pub log: Option<LogFit>,
    /// The first offset the log still held (its low watermark), when read.
    pub log_start: Option<i64>,
}

/// A change of ownership, queued by the rebalance callback for the main loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rebalanced {
    /// Partitions now owned, already positioned at their fences.
    Assigned(Vec<Assignment>),
    /// Partitions no longer owned.
    Revoked(Vec<i32>),
    /// The assignment was lost in an error; nothing is owned.
    Lost,
}

/// Consumer context: positions assignments at their fences and queues the
/// changes for the main loop, which drains them after every poll.
pub struct TallyContext {
    topic: String,
    /// Replaced when the key generation changes (see [`crate::domain::generation`]).
    fences: Mutex<FenceReader>,
    queue: Mutex<Vec<Rebalanced>>,
    /// Where each partition's log ended for a `read_committed` reader (its
    /// last stable offset) at librdkafka's last statistics, at most
    /// [`STATISTICS_INTERVAL_MS`] old.
    ends: Mutex<HashMap<i32, i64>>,
    /// Set after a change is queued, so the main loop's check after every
    /// message is one atomic read rather than a lock.
    queued: AtomicBool,
    /// The last SASL or TLS refusal librdkafka reported, for the start-up check.
    refused: Mutex<Option<KafkaRefusal>>,
    /// The ACL that lets the principal use the consumer's group, named when
    /// the brokers deny it.
    group_acl: Option<KafkaAcl>,
    /// Whether the group rebalances incrementally: always under the consumer
    /// protocol (KIP-848), and under the classic one as the consumer's
    /// `partition.assignment.strategy` says ([`cooperative`]). Decided once at
    /// creation: asked of librdkafka inside the final revoke of a closing
    /// consumer, the protocol can come back as none or never come back, and
    /// the close then waits forever for an unassignment of the wrong kind.
    cooperative: bool,
    /// Asynchronous commits awaiting the coordinator's answer: per partition,
    /// the committed offset and when it was queued, oldest first.
    commits: Mutex<HashMap<i32, VecDeque<(i64, Instant)>>>,
    /// The consumer this context serves, once [`TallyContext::attach`]ed:
    /// every assigned partition then gets a queue of its own.
    consumer: OnceLock<Weak<LikeConsumer>>,
    /// Queues split at assignment and not yet taken by the main loop.
    split: Mutex<HashMap<i32, PartitionQueue>>,
}

/// One partition's own queue of fetched messages.
pub type PartitionQueue = StreamPartitionQueue<TallyContext>;

/// How often librdkafka reports its statistics: the lag gauges, and the log
/// ends that tell a partition catching up.
const STATISTICS_INTERVAL_MS: &str = "500";

/// Commits queued per partition that are still timed; an older one whose
/// answer never came is dropped rather than kept forever.
const COMMITS_TIMED: usize = 64;

impl TallyContext {
    /// A context for one topic.
    pub fn new(topic: &str, fences: FenceReader) -> Self {
        Self {
            topic: topic.to_string(),
            fences: Mutex::new(fences),
            queue: Mutex::new(Vec::new()),
            queued: AtomicBool::new(false),
            ends: Mutex::new(HashMap::new()),
            refused: Mutex::new(None),
            cooperative: false,
            group_acl: None,
            commits: Mutex::new(HashMap::new()),
            consumer: OnceLock::new(),
            split: Mutex::new(HashMap::new()),
        }
    }

    /// Splits every partition assigned from now on into a queue of its own
    /// (see [`TallyContext::take_queue`]), so that its messages can be taken
    /// off the thread that polls `consumer`.
    pub fn attach(&self, consumer: &Arc<LikeConsumer>) {
        let _ = self.consumer.set(Arc::downgrade(consumer));
    }

    /// The queue split for `partition` at its last assignment, if any. A
    /// partition whose queue was split fetches into that queue only: its
    /// messages never reach the consumer's own.
    pub fn take_queue(&self, partition: i32) -> Option<PartitionQueue> {
        self.split
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&partition)
    }

    /// Drops the queues no one took; each holds the consumer.
    pub fn drop_queues(&self) {
        self.split.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Splits the queues of `partitions` before they are assigned: the
    /// split is the application's, so the assignment's fetch start keeps
    /// it, and nothing fetched for this ownership reaches the consumer's
    /// queue.
    fn split_queues(&self, partitions: &[i32]) -> usize {
        let Some(consumer) = self.consumer.get().and_then(Weak::upgrade) else {
            return 0;
        };
        let mut split = self.split.lock().unwrap_or_else(|e| e.into_inner());
        let mut own = 0;
        for &partition in partitions {
            match consumer.split_partition_queue(&self.topic, partition) {
                Some(queue) => {
                    split.insert(partition, queue);
                    own += 1;
                }
                None => warn!(
                    partition,
                    "Cannot give the partition a queue of its own; the polling thread takes its messages."
                ),
            }
        }
        own
    }

    /// Notes that `next` was stored for `partition` now, so the answer to the
    /// commit that carries it times the `commit` stage.
    pub fn commit_queued(&self, partition: i32, next: i64) {
        let mut commits = self.commits.lock().unwrap_or_else(|e| e.into_inner());
        let queued = commits.entry(partition).or_default();
        if queued.len() == COMMITS_TIMED {
            queued.pop_front();
        }
        queued.push_back((next, Instant::now()));
    }

    /// Records the `commit` stage of each partition `offsets` acknowledges:
    /// from the queueing of that offset's commit until now. Earlier commits
    /// of the partition are settled by it (a commit covers every offset
    /// below it) and are not timed twice.
    fn commits_answered(&self, offsets: &TopicPartitionList) {
        let mut commits = self.commits.lock().unwrap_or_else(|e| e.into_inner());
        for element in offsets.elements_for_topic(&self.topic) {
            let Offset::Offset(next) = element.offset() else {
                continue;
            };
            let Some(queued) = commits.get_mut(&element.partition()) else {
                continue;
            };
            let mut answered = None;
            while let Some(&(offset, at)) = queued.front()
                && offset <= next
            {
                queued.pop_front();
                if offset == next {
                    answered = Some(at);
                }
            }
            if let Some(at) = answered {
                crate::infra::metrics::stage("commit", at.elapsed());
            }
        }
    }

    /// The context, naming `acl` when the brokers deny the consumer its group.
    pub fn with_group_acl(mut self, acl: KafkaAcl) -> Self {
        self.group_acl = Some(acl);
        self
    }

    /// The ACL the brokers' `error` says this consumer lacks, if it is a
    /// denial of its topic or its group.
    pub fn denied(&self, error: &KafkaError) -> Option<KafkaAcl> {
        use rdkafka::types::RDKafkaErrorCode as Code;
        match error.rdkafka_error_code()? {
            Code::TopicAuthorizationFailed => Some(KafkaAcl::on("Read", "topic", &self.topic)),
            Code::GroupAuthorizationFailed => self.group_acl.clone(),
            _ => None,
        }
    }

    /// Keeps the first refusal: librdkafka's log names it before its error does.
    fn refused(&self, refusal: KafkaRefusal) {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(refusal);
    }

    fn has_refused(&self) -> bool {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Reads fences with `fences` from now on: every later assignment starts
    /// at the fences of the generation it names.
    pub fn set_fences(&self, fences: FenceReader) {
        *self.fences.lock().unwrap_or_else(|e| e.into_inner()) = fences;
    }

    /// Where `partition`'s log ended at librdkafka's last statistics, if it
    /// reported the partition.
    pub fn log_end(&self, partition: i32) -> Option<i64> {
        self.ends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&partition)
            .copied()
    }

    /// Takes the ownership changes queued since the last call.
    pub fn take_changes(&self) -> Vec<Rebalanced> {
        if !self.queued.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn push(&self, change: Rebalanced) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(change);
        self.queued.store(true, Ordering::Release);
    }

    /// Reads fences with a few quick retries; gives up rather than stall the group.
    fn read_fences(&self, partitions: &[i32]) -> Option<Vec<PartitionFences>> {
        let reader = self
            .fences
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for attempt in 1..=3 {
            match reader.read_blocking(partitions) {
                Ok(fences) => return Some(fences),
                Err(error) => {
                    warn!(attempt, %error, "Cannot read fences during rebalance.");
                    std::thread::sleep(Duration::from_millis(200 * attempt));
                }
            }
        }
        None
    }

    fn on_assign(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) {
        let partitions: Vec<i32> = tpl
            .elements_for_topic(&self.topic)
            .iter()
            .map(|e| e.partition())
            .collect();
        let fences = self.read_fences(&partitions);
        let mut assignments = Vec::with_capacity(partitions.len());
        let mut resume = Vec::with_capacity(partitions.len());
        // The log may have changed since the fences were written (topic
        // recreated, retention): each resume offset is placed in its log
        // before anything is fetched. A broker that does not answer in time
        // leaves the rest to the check of fetched offsets.
        let mut watermarks = true;
        for (i, &partition) in partitions.iter().enumerate() {
            let found = fences.as_ref().map(|f| f[i].clone());
            let offset = found.as_ref().and_then(PartitionFences::resume_from);
            if let Some(offset) = offset
                && let Err(error) = tpl.set_partition_offset(&self.topic, partition, offset)
            {
                error!(partition, %error, "Cannot position partition at its fence.");
            }
            let marks = match offset {
                Some(Offset::Offset(_)) if watermarks => {
                    let marks = guard::watermarks(consumer, &self.topic, partition, LOG_TIMEOUT);
                    watermarks = marks.is_some();
                    marks
                }
                _ => None,
            };
            let log = match (offset, marks) {
                (Some(Offset::Offset(o)), Some((low, high))) => Some(guard::fit(o, low, high)),
                _ => None,
            };
            resume.push(match (offset, &found) {
                (Some(Offset::Offset(o)), _) => format!("{partition}@{o}"),
                (Some(_), _) => format!("{partition}@beginning(origin lost)"),
                (None, Some(_)) => format!("{partition}@committed"),
                (None, None) => format!("{partition}@committed(fences unreadable)"),
            });
            assignments.push(Assignment {
                partition,
                fences: found,
                log,
                log_start: marks.map(|(low, _)| low),
            });
        }
        let own_queues = self.split_queues(&partitions);
        info!(partitions = %resume.join(" "), "Partitions assigned.");
        debug!(own_queues, "Assigned partitions with a queue of their own.");
        let mut ahead = TopicPartitionList::new();
        let mut fit = TopicPartitionList::new();
        for a in &assignments {
            let list = if matches!(a.log, Some(LogFit::Ahead { .. })) {
                &mut ahead
            } else {
                &mut fit
            };
            list.add_partition(&self.topic, a.partition);
        }
        self.push(Rebalanced::Assigned(assignments));
        let result = if self.cooperative {
            consumer.incremental_assign(tpl)
        } else {
            consumer.assign(tpl)
        };
        if let Err(error) = result {
            error!(%error, "Assigning partitions failed.");
        }
        // A partition whose fence is ahead of its log is owned but not
        // fetched; one stopped by an earlier ownership fetches again.
        if ahead.count() > 0
            && let Err(error) = consumer.pause(&ahead)
        {
            warn!(%error, "Cannot pause the partitions whose fence is ahead of the log.");
        }
        if fit.count() > 0
            && let Err(error) = consumer.resume(&fit)
        {
            debug!(%error, "Cannot resume the assigned partitions.");
        }
    }

    fn on_revoke(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
        let partitions: Vec<i32> = tpl
            .elements_for_topic(&self.topic)
            .iter()
            .map(|e| e.partition())
            .collect();
        info!(?partitions, "Partitions revoked.");
        {
            let mut split = self.split.lock().unwrap_or_else(|e| e.into_inner());
            for partition in &partitions {
                split.remove(partition);
            }
        }
        self.push(Rebalanced::Revoked(partitions));
        let result = if self.cooperative {
            consumer.incremental_unassign(tpl)
        } else {
            consumer.unassign()
        };
        if let Err(error) = result {
            warn!(%error, "Unassigning partitions failed.");
        }
    }
}

impl ClientContext for TallyContext {
    /// A SASL or TLS refusal is kept for [`explain`] and logged
    /// at debug level, with the "all brokers down" that follows it: the
    /// start-up check reports it in one line. So is a denied topic or group,
    /// which reaches the consumer's queue too: [`check_group`] and the run
    /// loop stop with one line naming the ACL.
    fn error(&self, error: KafkaError, reason: &str) {
        let refusal = error
            .rdkafka_error_code()
            .and_then(|code| kafka_refusal(code, reason))
            .or_else(|| kafka_refusal_in_log(reason));
        if let Some(refusal) = &refusal {
            self.refused(refusal.clone());
        }
        let denied = error.rdkafka_error_code().is_some_and(kafka_denied);
        if refusal.is_some() || self.has_refused() || denied {
            debug!(%error, reason, "Kafka refused the connection.");
        } else {
            error!("librdkafka: {error}: {reason}");
        }
    }

    /// librdkafka's log, at its own level, except the broker-failure lines of
    /// a refused login or handshake, which the start-up check reports.
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as Level;
        let refusal = kafka_refusal_in_log(message);
        if let Some(refusal) = &refusal {
            self.refused(refusal.clone());
        }
        // A broker that closes the connection during the SASL exchange is
        // turning the login down; the line naming why follows.
        let during_login = message.contains("in state AUTH_");
        match level {
            _ if refusal.is_some() || during_login => {
                debug!(target: "librdkafka", "librdkafka: {fac} {message}")
            }
            Level::Emerg | Level::Alert | Level::Critical | Level::Error => {
                error!(target: "librdkafka", "librdkafka: {fac} {message}")
            }
            Level::Warning => warn!(target: "librdkafka", "librdkafka: {fac} {message}"),
            Level::Notice | Level::Info => {
                info!(target: "librdkafka", "librdkafka: {fac} {message}")
            }
            Level::Debug => debug!(target: "librdkafka", "librdkafka: {fac} {message}"),
        }
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): per owned
    /// partition, the offsets between the last commit, which tally makes only
    /// after a batch is applied, and the end of what the consumer may read.
    /// Under read_committed librdkafka measures that end at the last stable
    /// offset (`ls_offset`), not the high watermark (`hi_offset`): the
    /// records of a transaction still open are not lag, since no consumer
    /// can read them before the transaction ends.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let mut ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        for topic in statistics.topics.values() {
            for (&partition, p) in &topic.partitions {
                if partition >= 0 && p.desired && p.consumer_lag >= 0 {
                    crate::infra::metrics::consumer_lag(partition, p.consumer_lag);
                }
                if partition >= 0 && p.desired && p.ls_offset >= 0 {
                    ends.insert(partition, p.ls_offset);
                }
            }
        }
    }
}

impl ConsumerContext for TallyContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => self.on_assign(consumer, tpl),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => self.on_revoke(consumer, tpl),
            other => {
                error!(error = ?other, "Rebalance failed; dropping the assignment.");
                self.push(Rebalanced::Lost);
                // An incremental consumer refuses the eager unassign.
                let result = if self.cooperative {
                    consumer
                        .assignment()
                        .and_then(|owned| consumer.incremental_unassign(&owned))
                } else {
                    consumer.unassign()
                };
                if let Err(error) = result {
                    warn!(%error, "Unassigning after a failed rebalance failed.");
                }
            }
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => self.commits_answered(offsets),
            Err(error) => {
                crate::infra::metrics::commit_failed();
                debug!(%error, "Offset commit failed (the fence in Redis stays authoritative).");
            }
        }
    }
}

/// How long an assignment waits for one partition's watermarks.
const LOG_TIMEOUT: Duration = Duration::from_secs(2);

/// The consumer type tally runs.
pub type LikeConsumer = StreamConsumer<TallyContext>;

/// How often the consumer commits the offsets its applied batches stored:
/// short, so that the group's offsets and the lag they show trail the counts
/// by little.
pub const COMMIT_INTERVAL_MS: &str = "100";

/// How often a consumer of the classic protocol heartbeats (librdkafka's
/// default is 3 s). A cooperative hand-over takes two rounds, and members
/// learn of the second one, or of a member that left, from a heartbeat's
/// answer: a moved partition's counts stood still for about one interval.
/// `tally-lab bench --reread 0` (8 partitions, 20,000 events/s, scaling
/// 1 → 4 → 1): pause 3.29 / 2.99 s at 3 s, 1.01 / 0.49 s at 500 ms. A
/// group of a hundred members sends 200 heartbeats a second. `-X
/// heartbeat.interval.ms` overrides it; under the consumer protocol the
/// broker's `group.consumer.heartbeat.interval.ms` rules.
pub const CLASSIC_HEARTBEAT_INTERVAL_MS: &str = "500";

/// How often the consumer reads the topic's metadata, and so how soon
/// partitions added to the topic are assigned and counted (librdkafka's
/// default is 5 minutes, during which likes on a new partition wait unseen
/// and unreported). `-X topic.metadata.refresh.interval.ms` overrides it.
pub const METADATA_REFRESH_MS: &str = "30000";

/// Creates the consumer of `group`: nothing stored automatically, stored
/// offsets committed every [`COMMIT_INTERVAL_MS`]; `kafka`'s security and extra settings apply on top of
/// tally's defaults, but never over the group and the commit settings.
pub fn create_consumer(
    kafka: &KafkaSettings,
    group: &str,
    mut context: TallyContext,
) -> KafkaResult<LikeConsumer> {
    let mut config = kafka_client_config(&kafka.brokers, &[]);
    with_fetch_settings(&mut config)
        .set("auto.offset.reset", "earliest")
        // Aborted transactions are never counted; -X cannot change it.
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "false")
        .set("statistics.interval.ms", STATISTICS_INTERVAL_MS)
        .set("topic.metadata.refresh.interval.ms", METADATA_REFRESH_MS)
        .set("client.id", "tally");
    if kafka.group_protocol == GroupProtocol::Classic {
        // Incremental rebalancing: a consumer joining or leaving moves only
        // the partitions that change hands; the others keep flowing. The
        // consumer protocol always works so, and refuses the setting.
        config
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("heartbeat.interval.ms", CLASSIC_HEARTBEAT_INTERVAL_MS);
    }
    for (key, value) in kafka.properties() {
        config.set(key, value);
    }
    config
        .set("group.id", group)
        .set("group.protocol", kafka.group_protocol.as_str())
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", COMMIT_INTERVAL_MS)
        .set("enable.auto.offset.store", "false");
    if let Some(instance) = &kafka.group_instance_id {
        config.set("group.instance.id", instance);
    }
    context.cooperative = kafka.group_protocol == GroupProtocol::Consumer
        || cooperative(config.get("partition.assignment.strategy"));
    config.create_with_context(context)
}

/// Whether a consumer with this `partition.assignment.strategy` rebalances
/// incrementally: librdkafka's one cooperative assignor, alone (it refuses
/// to mix it with eager ones).
pub fn cooperative(strategy: Option<&str>) -> bool {
    strategy.is_some_and(|s| s.split(',').all(|name| name.trim() == "cooperative-sticky"))
}

/// Why the topic cannot be consumed.
#[derive(Debug, thiserror::Error)]
pub enum TopicError {
    /// No broker answered.
    #[error(
        "cannot reach Kafka at {brokers}: {source} (is the broker running? check --brokers / TALLY_BROKERS)"
    )]
    Unreachable {
        /// Bootstrap servers.
        brokers: String,
        /// The client error.
        source: KafkaError,
    },
    /// The brokers answered, and tally's SASL login or TLS handshake failed.
    #[error("{}", refusal_text(.brokers, .refusal))]
    Refused {
        /// Bootstrap servers.
        brokers: String,
        /// What librdkafka reported.
        refusal: KafkaRefusal,
    },
    /// The topic is absent.
    #[error("topic '{topic}' does not exist on {brokers}; create it or fix --{flag}")]
    Missing {
        /// The topic.
        topic: String,
        /// Bootstrap servers.
        brokers: String,
        /// The flag naming it.
        flag: &'static str,
    },
    /// The brokers deny the principal tally connects as an operation it needs.
    #[error(
        "Kafka at {brokers} denied {acl} to the principal tally connects as ({reason}); grant it: kafka-acls.sh --add --allow-principal User:<that principal> {grant} (docs/security.md lists the ACLs each command needs)",
        grant = .acl.grant_args()
    )]
    Denied {
        /// Bootstrap servers.
        brokers: String,
        /// The ACL missing (boxed: errors stay small).
        acl: Box<KafkaAcl>,
        /// The brokers' answer.
        reason: String,
    },
}

fn refusal_text(brokers: &str, refusal: &KafkaRefusal) -> String {
    match refusal {
        KafkaRefusal::Credentials(reason) => {
            format!("Kafka at {brokers} refused the SASL login: {reason}")
        }
        KafkaRefusal::Tls(_, reason) => {
            format!("the TLS handshake with Kafka at {brokers} failed: {reason}")
        }
    }
}

/// [`check_topic`] for the topic `consumer` reads, with a refused login or
/// handshake told apart from brokers that are not there (see [`explain`]).
pub async fn check_consumed_topic(
    consumer: &LikeConsumer,
    kafka: &KafkaSettings,
) -> Result<usize, TopicError> {
    match check_topic(consumer, &kafka.brokers, &kafka.topic, "topic") {
        Ok(partitions) => Ok(partitions),
        Err(error) => Err(explain(consumer, error).await),
    }
}

/// `error` as the brokers' refusal of tally's SASL login or TLS handshake,
/// when librdkafka reported one: "unreachable" would send the operator
/// looking for a broker that is there. librdkafka hands its errors and logs
/// to the consumer's queue, so the queue is served briefly first.
async fn explain(consumer: &LikeConsumer, error: TopicError) -> TopicError {
    let TopicError::Unreachable { brokers, source } = error else {
        return error;
    };
    // Nothing is subscribed yet: the queue holds events, not messages.
    let _ = tokio::time::timeout(Duration::from_millis(300), consumer.recv()).await;
    let context = consumer.context();
    let refused = context
        .refused
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    match refused {
        Some(refusal) => TopicError::Refused { brokers, refusal },
        None => TopicError::Unreachable { brokers, source },
    }
}

/// Checks the brokers answer and the topic exists; returns its partition count.
pub fn check_topic<C: Consumer<X>, X: ConsumerContext>(
    consumer: &C,
    brokers: &str,
    topic: &str,
    flag: &'static str,
) -> Result<usize, TopicError> {
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|source| TopicError::Unreachable {
            brokers: brokers.to_string(),
            source,
        })?;
    let missing = || TopicError::Missing {
        topic: topic.to_string(),
        brokers: brokers.to_string(),
        flag,
    };
    let found = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(missing)?;
    if let Some(error) = found.error() {
        let code = rdkafka::types::RDKafkaErrorCode::from(error);
        if kafka_denied(code) {
            // Write implies the Describe metadata needs, as Read does.
            let operation = if flag == "dead-letter-topic" {
                "Write"
            } else {
                "Read"
            };
            return Err(TopicError::Denied {
                brokers: brokers.to_string(),
                acl: Box::new(KafkaAcl::on(operation, "topic", topic)),
                reason: code.to_string(),
            });
        }
    }
    if found.error().is_some() || found.partitions().is_empty() {
        return Err(missing());
    }
    Ok(found.partitions().len())
}

/// How long the group check waits for the group's coordinator: on a new
/// cluster the first use of any group creates the offsets topic, whose
/// partitions take a few seconds to load.
const COORDINATOR_WAIT: Duration = Duration::from_secs(15);

/// Checks, before subscribing, that the brokers let the consumer use
/// `group` (the consumer's own): finds its coordinator and reads its
/// committed offsets on the topic's `partitions`. A group the principal may
/// not use stops the start with one line naming `acl`; unchecked, the
/// consumer would wait for partitions that never come. A coordinator that
/// does not answer is no reason to stop: the consumer finds it on its own
/// once it is up.
pub async fn check_group(
    consumer: &LikeConsumer,
    kafka: &KafkaSettings,
    group: &str,
    partitions: usize,
    acl: &KafkaAcl,
) -> Result<(), TopicError> {
    use rdkafka::types::RDKafkaErrorCode as Code;
    let mut tpl = TopicPartitionList::new();
    for partition in 0..partitions as i32 {
        tpl.add_partition(&kafka.topic, partition);
    }
    let deadline = Instant::now() + COORDINATOR_WAIT;
    loop {
        let asked = tokio::task::block_in_place(|| {
            consumer.committed_offsets(tpl.clone(), Duration::from_secs(2))
        });
        let Err(source) = asked else {
            return Ok(());
        };
        // A refused FindCoordinator reaches the consumer's queue, while the
        // call that needed it only times out.
        let code = match queued_denial(consumer).await {
            Some(code) => Some(code),
            None => source.rdkafka_error_code(),
        };
        match code {
            Some(code) if kafka_denied(code) => {
                let acl = match code {
                    Code::TopicAuthorizationFailed => KafkaAcl::on("Read", "topic", &kafka.topic),
                    _ => acl.clone(),
                };
                return Err(TopicError::Denied {
                    brokers: kafka.brokers.clone(),
                    acl: Box::new(acl),
                    reason: code.to_string(),
                });
            }
            Some(
                Code::NotCoordinator
                | Code::CoordinatorNotAvailable
                | Code::CoordinatorLoadInProgress
                | Code::OperationTimedOut,
            ) if Instant::now() < deadline => {
                debug!(%group, %source, "Group coordinator not ready; asking again.");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => {
                warn!(%group, %source, "Cannot read the group's committed offsets at start; going on.");
                return Ok(());
            }
        }
    }
}

/// The denial among the errors waiting in the consumer's queue, if any.
async fn queued_denial(consumer: &LikeConsumer) -> Option<rdkafka::types::RDKafkaErrorCode> {
    let mut found = None;
    // Nothing is subscribed yet: the queue holds events, not messages.
    while let Ok(Err(error)) =
        tokio::time::timeout(Duration::from_millis(200), consumer.recv()).await
    {
        if let Some(code) = error.rdkafka_error_code().filter(|&c| kafka_denied(c)) {
            found = Some(code);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::routing::KeyLayout;
    use crate::infra::config::KafkaSecurity;
    use crate::infra::store::RedisUrl;

    #[test]
    fn only_the_cooperative_assignor_alone_rebalances_incrementally() {
        assert!(cooperative(Some("cooperative-sticky")));
        assert!(cooperative(Some(" cooperative-sticky ")));
        // librdkafka's default, and eager assignors named by -X.
        assert!(!cooperative(None));
        assert!(!cooperative(Some("range,roundrobin")));
        assert!(!cooperative(Some("range")));
        assert!(!cooperative(Some("cooperative-sticky,range")));
    }

    fn created_with(protocol: GroupProtocol, extra: &[(&str, &str)]) -> bool {
        let kafka = KafkaSettings {
            brokers: "127.0.0.1:1".into(),
            topic: "likes".into(),
            group: "tally".into(),
            group_protocol: protocol,
            group_instance_id: Some("tally-0".into()),
            dead_letter_topic: None,
            security: KafkaSecurity::default(),
            extra: extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let url = RedisUrl::parse("redis://127.0.0.1:1/").unwrap();
        let fences = FenceReader::new(url.target().clone(), KeyLayout::new("t"), "tally", "likes");
        let consumer =
            create_consumer(&kafka, "tally", TallyContext::new("likes", fences)).unwrap();
        consumer.context().cooperative
    }

    #[tokio::test]
    async fn the_consumer_knows_its_protocol_from_its_strategy() {
        let classic = GroupProtocol::Classic;
        assert!(created_with(classic, &[]));
        assert!(!created_with(
            classic,
            &[("partition.assignment.strategy", "range")]
        ));
    }

    #[tokio::test]
    async fn the_consumer_protocol_is_incremental_and_accepted_by_librdkafka() {
        // librdkafka refuses to create a consumer-protocol consumer that has
        // a classic-only setting, tally's own defaults included.
        assert!(created_with(GroupProtocol::Consumer, &[]));
        assert!(created_with(
            GroupProtocol::Consumer,
            &[("group.remote.assignor", "uniform")]
        ));
    }
}
