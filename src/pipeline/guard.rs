//! Guard: what ordinary operations do to a deployment that no fence can see.
//!
//! The fences make every fault the suite injects harmless, but they describe
//! a log and a store, and both can change under them without a fault:
//!
//! * an eviction policy of `allkeys-*` may drop a fence (the replay from the
//!   origin doubles counts) or a counter (counts are lost);
//! * a store that lost everything (no layout record, no origin, no pointer)
//!   while the consumer group has committed offsets looks like a first start,
//!   and would count from those offsets as if nothing came before them;
//! * a log that is not the one the fences were built on: a topic deleted and
//!   recreated, moved to another cluster, or a broker that came back empty
//!   leaves a fence above the high watermark, and every new message below it
//!   would be dropped as already applied;
//! * retention that deleted offsets before tally applied them: their events
//!   are gone from the log and can no longer be counted;
//! * a packed generation on a server that keeps fewer fields (or shorter
//!   ones) in a compact hash than the generation was sized for: every hash
//!   turns into a hashtable, several times the memory the layout was chosen
//!   to save. Refused at start; a hash found past the limit later is an
//!   ERROR line and `tally_packed_hash_fill_max` above
//!   `tally_packed_hash_fill_limit` (see `apply`).
//!
//! Invariant: none of these passes silently. The first three and the last stop the
//! process before anything is written, with one line naming the fix; the
//! last is logged with the range lost and counted in
//! `tally_offsets_skipped_total{reason="retention"}`.
//!
//! * a replica started with another `--dedupe` mode or window than the
//!   prefix's other writers: it would count the repeats they skip, on
//!   whichever partitions it owns. Refused at start unless it says
//!   `--dedupe-change`; a rule changed under a running writer is an ERROR
//!   line and `tally_dedupe_rule_mismatch` (see `dedupe_rule`).
//!
//! The eviction policy can be changed under a running consumer too (`CONFIG
//! SET`): it is read again every few seconds, and a policy the start would
//! refuse is an ERROR line and `tally_eviction_policy_unsafe`.
//!
//! The log can change under a running consumer too, so the last two are
//! checked again at every assignment (see `consume`), and a fetched offset
//! below the fence is checked against the log (see `run`): a fence ahead of
//! its log found while running stops that partition only, with an ERROR
//! line and `tally_fence_ahead_partitions`; the other partitions go on.

use std::time::Duration;

mod compaction;
mod dedupe_rule;
mod watch;

pub use compaction::{COMPACTION_RECHECK, check_compaction, spawn_compaction_watch};
pub use dedupe_rule::{
    RULE_RECHECK, check_dedupe_rule, read_rule, rule_key, rule_text, spawn_dedupe_rule_watch,
};

use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use redis::RedisError;
use tracing::{info, warn};

use crate::domain::placement::scan_nodes;
use crate::infra::retry::{RedisFailure, classify_redis};
use crate::infra::security::redact_url;
use crate::infra::store::{Server, Target, connect_blocking};

/// How long a watermark or committed-offset query may take.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(10);

/// A refusal: the deployment would double, drop or stall counts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuardError {
    /// One of tally's keys holds a value tally does not write there (the
    /// detail names the key, the value and the fix).
    #[error("{0}")]
    StrayValue(String),
    /// A start-up check lost its connection (a restart, a failover): the
    /// start is tried again rather than the check passed unread.
    #[error("cannot reach Redis at {node} for the start-up checks: {error}")]
    Unreachable {
        /// The node.
        node: String,
        /// What the connection answered.
        error: String,
    },
    /// The consumed topic is compacted: Kafka drops likes that share a key.
    #[error(
        "topic {topic} has cleanup.policy={policy}: Kafka's log cleaner keeps only the newest record of each key, so likes that share a key are deleted before a lagging consumer, a replay or a rebuild reads them; set cleanup.policy=delete (kafka-configs --alter --entity-type topics --entity-name {topic} --add-config cleanup.policy=delete), then start again"
    )]
    CompactedTopic {
        /// The topic.
        topic: String,
        /// Its cleanup.policy.
        policy: String,
    },
    /// A check could not be made for a reason the operator must fix.
    #[error("{0}")]
    Unreadable(String),
    /// Redis may evict tally's keys.
    #[error(
        "Redis at {node} has maxmemory-policy {policy}: it may evict a fence (the replay then counts events twice) or a counter (its likes are lost); set maxmemory-policy noeviction (or a volatile-* policy) in its configuration and with CONFIG SET, then start again"
    )]
    Eviction {
        /// The node.
        node: String,
        /// Its policy.
        policy: String,
    },
    /// Redis may evict a trending window's keys, which carry an expiry.
    #[error(
        "Redis at {node} has maxmemory-policy {policy}, and this prefix keeps trending windows, whose keys carry an expiry: under memory pressure it may evict a window's counts or leaders before the window ends, and their likes leave the window for good; set maxmemory-policy noeviction in its configuration and with CONFIG SET, then start again"
    )]
    WindowEviction {
        /// The node.
        node: String,
        /// Its policy.
        policy: String,
    },
    /// A packed generation on a server that would not keep its hashes compact.
    #[error(
        "Redis at {node} has {setting} {value}, and this prefix's packed hashes need at least {needed}: its hashes would become hashtables, several times the memory; set {setting} {needed} (or more) in its configuration and with CONFIG SET, then start again"
    )]
    Listpack {
        /// The node.
        node: String,
        /// The setting.
        setting: &'static str,
        /// Its value.
        value: u64,
        /// What the layout needs.
        needed: u64,
    },
    /// A start whose dedupe rule is not the prefix's.
    #[error(
        "the writers of this prefix judge repeats by {theirs} ({key}), and this process by {ours}: a replica with another rule counts repeats the others skip on the partitions it owns; start it with {theirs}, or pass --dedupe-change (once) to judge every record from now on by {ours}, then restart the other replicas with it"
    )]
    DedupeRule {
        /// The key of the prefix's rule.
        key: String,
        /// The prefix's rule, as flags.
        theirs: String,
        /// This process's rule, as flags.
        ours: String,
    },
    /// The store's server lacks what tally's scripts call.
    #[error(
        "Redis at {node} is {server}: tally's scripts check their commands against the caller's ACL before writing (redis.acl_check_cmd), which needs Redis 7.0 or later; upgrade it to Redis 7.0 or later, or to Valkey"
    )]
    OldServer {
        /// The node.
        node: String,
        /// What it runs, e.g. `Redis 6.2.14`.
        server: String,
    },
    /// The store holds nothing while the group says it counted.
    #[error(
        "Redis holds nothing under --prefix {prefix} (no layout record, no fences), but group {group} has committed offsets on {topic} ({committed}): --redis or --prefix names another store than before, or the store lost its data. Recount everything with `tally rebuild`, or accept the loss and count from the committed offsets with `tally run --accept-lost-counts` (once)"
    )]
    LostStore {
        /// The base prefix.
        prefix: String,
        /// The consumer group.
        group: String,
        /// The topic.
        topic: String,
        /// `partition@offset` of the committed offsets, shortened.
        committed: String,
    },
    /// A fence lies beyond the end of its partition's log.
    #[error(
        "topic {topic} partition {partition} ends at offset {high} but its fence says offset {fence} was applied: the log is not the one these counts were made from (topic recreated, moved, or a broker that came back empty). If it holds only new events, `tally reset-fences` counts it from its start on top of the stored counts; if it holds the old events again, run `tally reset-fences` and then `tally rebuild`"
    )]
    FenceAhead {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// The last offset the fences say was applied.
        fence: i64,
        /// The partition's high watermark (the next offset to be written).
        high: i64,
    },
}

/// Where a partition's resume offset lies in its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFit {
    /// Within the log, or at its end.
    Fits,
    /// Below the low watermark: offsets `from..=to` were deleted unapplied.
    Trimmed {
        /// First offset lost.
        from: i64,
        /// Last offset lost.
        to: i64,
    },
    /// Beyond the high watermark: the fence is ahead of the log.
    Ahead {
        /// The high watermark (the next offset the log will write).
        high: i64,
    },
}

/// Where `resume` (the next offset to apply) lies in a log spanning
/// `low..high` (high: the next offset to be written).
pub fn fit(resume: i64, low: i64, high: i64) -> LogFit {
    if resume > high {
        LogFit::Ahead { high }
    } else if resume < low {
        LogFit::Trimmed {
            from: resume,
            to: low - 1,
        }
    } else {
        LogFit::Fits
    }
}

/// Checks a partition's resume offset against its log (at start, before the
/// consumer fetches anything; see `run`): refuses a fence ahead of it.
/// Offsets retention deleted are reported by the assignment that follows
/// (see [`report_trimmed`]), once per ownership. A log whose watermarks
/// cannot be read is passed: the assignment checks again.
pub fn check_log<C: Consumer<X>, X: ConsumerContext>(
    consumer: &C,
    topic: &str,
    partition: i32,
    resume: i64,
) -> Result<(), GuardError> {
    let Some((low, high)) = watermarks(consumer, topic, partition, KAFKA_TIMEOUT) else {
        return Ok(());
    };
    match fit(resume, low, high) {
        LogFit::Fits | LogFit::Trimmed { .. } => Ok(()),
        LogFit::Ahead { .. } => Err(GuardError::FenceAhead {
            topic: topic.to_string(),
            partition,
            fence: resume - 1,
            high,
        }),
    }
}

/// A partition's low and high watermarks as the brokers give them now
/// (under read_committed the high one is the last stable offset); `None`,
/// logged, when they cannot be read within `timeout`.
pub fn watermarks<C: Consumer<X>, X: ConsumerContext>(
    consumer: &C,
    topic: &str,
    partition: i32,
    timeout: Duration,
) -> Option<(i64, i64)> {
    match consumer.fetch_watermarks(topic, partition, timeout) {
        Ok(marks) => Some(marks),
        Err(error) => {
            warn!(partition, %error, "Cannot read the partition's watermarks; its fence is not checked against the log this time.");
            None
        }
    }
}

/// Reports offsets `from..=to` of `partition` that retention deleted before
/// tally applied them: their events can no longer be counted.
pub fn report_trimmed(partition: i32, from: i64, to: i64) {
    warn!(
        partition,
        from,
        to,
        "Offsets deleted by retention before tally applied them: their events are not counted."
    );
    crate::infra::metrics::offsets_skipped("retention", (to - from + 1) as u64);
}

/// Reports offsets `from..=to` of `partition`, below its fences, that its
/// dedupe window was to re-read and that retention had deleted: a repeat of
/// one of their records arriving now is not recognized, and counts.
pub fn report_dedupe_history_lost(partition: i32, from: i64, to: i64) {
    warn!(
        partition,
        from,
        to,
        "Offsets the dedupe window was to re-read were deleted by retention: repeats of their records are not recognized. Keep the topic's retention above the window's span (--dedupe-window offsets)."
    );
    crate::infra::metrics::dedupe_history_lost((to - from + 1) as u64);
}

/// Reports a partition stopped because its fence lies beyond its log's end
/// (`high`: the next offset the log will write).
pub fn report_fence_ahead(partition: i32, fence: i64, high: i64) {
    tracing::error!(
        partition,
        fence,
        high,
        "The partition's log ends before its fence: the log is not the one these counts were made from (topic recreated, moved, or a broker that came back empty). This partition is stopped; the others go on. Stop tally, then run `tally reset-fences` (and `tally rebuild` if the log holds the old events again)."
    );
}

/// Reads the server and version of every primary and refuses one older than
/// tally's scripts need. Where `INFO server` cannot be read, says what tally
/// requires and goes on. Returns each distinct server with a node running
/// it, for [`report_servers`]: a refusal stays the only line a refused start
/// prints, so the servers are named once every guard passed.
pub fn check_server(target: &Target) -> Result<Vec<(Server, String)>, GuardError> {
    let nodes = match scan_nodes(target) {
        Ok(nodes) => nodes,
        Err(error) => {
            lost_connection(&shown(target), &error)?;
            server_unchecked(&shown(target), &error.to_string());
            return Ok(Vec::new());
        }
    };
    let mut seen: Vec<(Server, String)> = Vec::new();
    for node in nodes {
        let name = shown(&node);
        let info = connect_blocking(&node, Duration::from_secs(5)).and_then(|mut conn| {
            redis::cmd("INFO")
                .arg("server")
                .query::<String>(conn.as_mut())
        });
        let server = match info.as_deref().map(Server::from_info) {
            Ok(Some(server)) => server,
            Ok(None) => {
                server_unchecked(&name, "INFO server names no redis_version");
                continue;
            }
            Err(error) => {
                lost_connection(&name, error)?;
                server_unchecked(&name, &error.to_string());
                continue;
            }
        };
        if !server.supported() {
            return Err(GuardError::OldServer {
                node: name,
                server: server.to_string(),
            });
        }
        if !seen.iter().any(|(s, _)| *s == server) {
            seen.push((server, name));
        }
    }
    Ok(seen)
}

/// Logs the servers [`check_server`] found: the first line the start-up
/// guards log once they all passed.
pub fn report_servers(servers: &[(Server, String)]) {
    for (server, node) in servers {
        let (major, minor, patch) = server.redis_version;
        info!(
            store = server.kind,
            version = %server.version,
            redis_version = %format_args!("{major}.{minor}.{patch}"),
            %node,
            "Start-up checks passed."
        );
    }
}

fn server_unchecked(node: &str, error: &str) {
    warn!(
        %node,
        %error,
        "Cannot read the store's version: tally requires Redis 7.0 or later, or Valkey."
    );
}

/// Refuses a store whose eviction policy may drop tally's keys, on every
/// primary: `allkeys-*` always, and `volatile-*` too when the prefix keeps
/// trending windows (`windows`), the only keys tally gives an expiry. Where
/// the policy cannot be read (CONFIG refused, as managed services do), says
/// what tally requires and goes on.
pub fn check_eviction(target: &Target, windows: bool) -> Result<(), GuardError> {
    for (name, policy) in eviction_policies(target) {
        match policy {
            Ok(policy) => eviction_refusal(name, policy, windows)?,
            Err(error) => {
                lost_connection(&name, &error)?;
                unchecked(&name, &error);
            }
        }
    }
    Ok(())
}

/// Every primary's `maxmemory-policy`, or why it could not be read.
fn eviction_policies(target: &Target) -> Vec<(String, Result<String, RedisError>)> {
    let nodes = match scan_nodes(target) {
        Ok(nodes) => nodes,
        Err(error) => return vec![(shown(target), Err(error))],
    };
    nodes
        .into_iter()
        .map(|node| {
            let policy = connect_blocking(&node, Duration::from_secs(5)).and_then(|mut conn| {
                let (_, policy): (String, String) = redis::cmd("CONFIG")
                    .arg("GET")
                    .arg("maxmemory-policy")
                    .query(conn.as_mut())?;
                Ok(policy)
            });
            (shown(&node), policy)
        })
        .collect()
}

/// The refusal a node's `policy` earns: `allkeys-*` always, `volatile-*`
/// where trending windows keep keys with an expiry.
fn eviction_refusal(node: String, policy: String, windows: bool) -> Result<(), GuardError> {
    if policy.starts_with("allkeys-") {
        return Err(GuardError::Eviction { node, policy });
    }
    if windows && policy.starts_with("volatile-") {
        return Err(GuardError::WindowEviction { node, policy });
    }
    Ok(())
}

/// How often a running consumer reads every primary's eviction policy again.
pub const EVICTION_RECHECK: Duration = Duration::from_secs(10);

/// Reads the eviction policy of every primary again every
/// [`EVICTION_RECHECK`] until `shutdown`: a policy set under a running
/// consumer (`CONFIG SET`) that [`check_eviction`] would refuse is reported
/// with an ERROR line when it is first seen, and by
/// `tally_eviction_policy_unsafe` (and its alert) for as long as it lasts.
/// A policy that cannot be read was warned about at start and is passed.
pub fn spawn_eviction_watch(
    target: Target,
    windows: bool,
    shutdown: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    crate::infra::metrics::eviction_policy_unsafe(false);
    crate::infra::tasks::spawn("eviction-watch", async move {
        let mut every = watch::rechecks(EVICTION_RECHECK).await;
        let mut finding = watch::Finding::new();
        while watch::next_tick(&mut every, &shutdown).await {
            let target = target.clone();
            let Ok(policies) =
                tokio::task::spawn_blocking(move || eviction_policies(&target)).await
            else {
                continue;
            };
            let refusal = policies
                .into_iter()
                .filter_map(|(node, policy)| policy.ok().map(|p| (node, p)))
                .find_map(|(node, policy)| eviction_refusal(node, policy, windows).err());
            crate::infra::metrics::eviction_policy_unsafe(refusal.is_some());
            match finding.update(refusal.map(|refusal| refusal.to_string())) {
                watch::Change::Appeared(problem) => {
                    tracing::error!(%problem, "The store's eviction policy changed under a running tally: keys tally needs may be evicted.");
                }
                watch::Change::Cleared => {
                    info!("The store's eviction policy keeps tally's keys again.");
                }
                watch::Change::Same => {}
            }
        }
    })
}

/// Refuses a server that would not keep a packed generation's hashes as
/// listpacks: fewer entries than `entries` or shorter values than `value`,
/// on any primary. Returns the lowest entry limit found (0 when none could
/// be read: CONFIG refused, as managed services do, which is a warning).
pub fn check_listpack(target: &Target, entries: u64, value: u64) -> Result<u64, GuardError> {
    let nodes = match scan_nodes(target) {
        Ok(nodes) => nodes,
        Err(error) => {
            lost_connection(&shown(target), &error)?;
            unread_listpack(&shown(target), entries, &error);
            return Ok(0);
        }
    };
    let mut lowest = u64::MAX;
    for node in nodes {
        let name = shown(&node);
        let limits = connect_blocking(&node, Duration::from_secs(5)).and_then(|mut conn| {
            let mut read = |setting: &str| -> Result<u64, RedisError> {
                let (_, value): (String, u64) = redis::cmd("CONFIG")
                    .arg("GET")
                    .arg(setting)
                    .query(conn.as_mut())?;
                Ok(value)
            };
            Ok((
                read("hash-max-listpack-entries")?,
                read("hash-max-listpack-value")?,
            ))
        });
        match limits {
            Ok((found, _)) if found < entries => {
                return Err(GuardError::Listpack {
                    node: name,
                    setting: "hash-max-listpack-entries",
                    value: found,
                    needed: entries,
                });
            }
            Ok((_, found)) if found < value => {
                return Err(GuardError::Listpack {
                    node: name,
                    setting: "hash-max-listpack-value",
                    value: found,
                    needed: value,
                });
            }
            Ok((found, _)) => lowest = lowest.min(found),
            Err(error) => {
                lost_connection(&name, &error)?;
                unread_listpack(&name, entries, &error);
            }
        }
    }
    Ok(if lowest == u64::MAX { 0 } else { lowest })
}

fn unread_listpack(node: &str, entries: u64, error: &RedisError) {
    warn!(
        %node,
        %error,
        "Cannot read hash-max-listpack-entries: this prefix's packed hashes need at least {entries} (and hash-max-listpack-value of at least 64) to stay compact; check it with your provider.",
    );
}

/// A target's URLs without their passwords.
fn shown(target: &Target) -> String {
    target
        .nodes()
        .iter()
        .map(|url| redact_url(url))
        .collect::<Vec<_>>()
        .join(",")
}

/// Passes an error the server answered (a managed service refusing CONFIG,
/// say), which the caller reports as a check it could not make; refuses
/// one of the connection (reset, refused, timed out, LOADING), which says
/// nothing about the server and must not pass the check unread.
fn lost_connection(node: &str, error: &RedisError) -> Result<(), GuardError> {
    match classify_redis(error) {
        RedisFailure::Fatal | RedisFailure::NoScript => Ok(()),
        RedisFailure::Transient => Err(GuardError::Unreachable {
            node: node.to_string(),
            error: error.to_string(),
        }),
    }
}

fn unchecked(node: &str, error: &RedisError) {
    warn!(
        %node,
        %error,
        "Cannot read maxmemory-policy: tally requires noeviction or a volatile-* policy (an allkeys-* policy may evict fences and double counts, or counters and lose them); check it with your provider."
    );
}

/// The group's committed offsets on `partitions` of `topic`, as
/// `partition@offset` (at most five shown); empty when it has none.
pub fn committed<C: Consumer<X>, X: ConsumerContext>(
    consumer: &C,
    topic: &str,
    partitions: usize,
) -> Result<Vec<String>, rdkafka::error::KafkaError> {
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        tpl.add_partition(topic, p);
    }
    // A group's coordinator may not be ready yet: on a new cluster the first
    // lookup creates the offsets topic, and a coordinator that just moved is
    // still loading. Those answers pass; anything else is the caller's error.
    let deadline = std::time::Instant::now() + COORDINATOR_WAIT;
    let found = loop {
        match consumer.committed_offsets(tpl.clone(), KAFKA_TIMEOUT) {
            Ok(found) => break found,
            Err(error) if coordinator_not_ready(&error) && std::time::Instant::now() < deadline => {
                warn!(%error, "The group coordinator is not ready; asking again.");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(error) => return Err(error),
        }
    };
    Ok(found
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) if o > 0 => Some(format!("{}@{o}", e.partition())),
            _ => None,
        })
        .collect())
}

/// How long [`committed`] waits for a group coordinator that is not ready.
const COORDINATOR_WAIT: Duration = Duration::from_secs(60);

/// Whether `error` says the group's coordinator is being elected, moved or
/// loaded: an answer that passes on its own.
fn coordinator_not_ready(error: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        error.rdkafka_error_code(),
        Some(
            Code::NotCoordinator | Code::CoordinatorNotAvailable | Code::CoordinatorLoadInProgress
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_offsets_are_placed_in_the_log() {
        assert_eq!(fit(10, 0, 20), LogFit::Fits);
        assert_eq!(fit(20, 0, 20), LogFit::Fits, "caught up");
        assert_eq!(fit(0, 0, 0), LogFit::Fits, "empty log, first start");
        assert_eq!(fit(21, 0, 20), LogFit::Ahead { high: 20 });
        assert_eq!(
            fit(5, 0, 0),
            LogFit::Ahead { high: 0 },
            "a log that came back empty"
        );
        assert_eq!(fit(3, 8, 20), LogFit::Trimmed { from: 3, to: 7 });
        assert_eq!(fit(8, 8, 20), LogFit::Fits);
    }

    #[test]
    fn a_check_cut_off_is_not_passed_unread() {
        let cut = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(
            lost_connection("redis://h:1/", &cut),
            Err(GuardError::Unreachable { .. })
        ));
        let loading = redis::parse_redis_value(b"-LOADING Redis is loading\r\n")
            .unwrap()
            .extract_error()
            .unwrap_err();
        assert!(lost_connection("redis://h:1/", &loading).is_err());
        // A managed service that refuses CONFIG: the check is reported as not made.
        let refused = redis::parse_redis_value(b"-NOPERM no permissions to run 'config|get'\r\n")
            .unwrap()
            .extract_error()
            .unwrap_err();
        assert_eq!(lost_connection("redis://h:1/", &refused), Ok(()));
    }

    #[test]
    fn refusals_are_one_line_naming_the_fix() {
        let ahead = GuardError::FenceAhead {
            topic: "likes".into(),
            partition: 3,
            fence: 999,
            high: 12,
        }
        .to_string();
        assert!(ahead.contains("partition 3 ends at offset 12") && ahead.contains("offset 999"));
        assert!(ahead.contains("tally reset-fences") && !ahead.contains('\n'));
        let eviction = GuardError::Eviction {
            node: "127.0.0.1:6379".into(),
            policy: "allkeys-lru".into(),
        }
        .to_string();
        assert!(eviction.contains("allkeys-lru") && eviction.contains("noeviction"));
    }

    #[test]
    fn an_old_server_is_refused_in_one_line() {
        let old = GuardError::OldServer {
            node: "127.0.0.1:6379".into(),
            server: "Redis 6.2.14".into(),
        }
        .to_string();
        assert!(old.contains("Redis 6.2.14") && old.contains("Redis 7.0 or later"));
        assert!(!old.contains('\n'));
    }
}
