//! Apply: run a closed batch through `apply.lua` behind its partition's fence.
//!
//! # Why every event is counted exactly once
//!
//! Kafka gives each partition a fixed, ordered log. Tally turns a contiguous
//! range `start..=last` of that log into net deltas and hands them to one Lua
//! script that, atomically, compares the range with the partition's fence (the
//! last offset already in Redis), adds the deltas only when the range begins
//! right after the fence, and moves the fence to `last`. Because the check and
//! the writes are one atomic step, Redis never holds counts without the fence
//! that covers them, nor a fence without its counts; a restart from an AOF or a
//! failover rolls both back together.
//!
//! Everything else is a consequence. A retry after a timeout finds the fence at
//! `last` and does nothing. A zombie consumer's stale batch finds the fence at or
//! past its range and does nothing. Two consumers that cut the log differently
//! meet a straddle and the late one re-reads from `fence + 1`. A Redis that lost
//! its last second shows a fence behind the batch and the consumer replays from
//! there. Kafka's committed offset is written only after the script succeeds and
//! is never trusted over the fence: it is where to look first, and the lag signal.
//! The decision table itself is [`crate::fence`].

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd, RedisError};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::aggregate::ClosedBatch;
use crate::fence::Decision;
use crate::retry::{Backoff, RedisFailure, classify_redis};
use crate::routing::KeyLayout;

/// The script, with its header comment documenting KEYS, ARGV and replies.
pub const APPLY_LUA: &str = include_str!("apply.lua");

/// Errors that end an apply.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// Redis refused in a way no retry fixes; an operator must act.
    #[error("Redis refused the batch: {0}")]
    Fatal(#[source] RedisError),
    /// The script answered something it never answers.
    #[error("unexpected reply from apply.lua: {0}")]
    BadReply(String),
    /// Shutdown came first; the batch was not confirmed (safe: nothing is committed).
    #[error("cancelled by shutdown")]
    Cancelled,
}

/// Errors connecting at start-up.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL does not parse.
    #[error("invalid Redis URL {url}: {source}")]
    BadUrl {
        /// The URL as given, password removed.
        url: String,
        /// The parse error.
        source: RedisError,
    },
    /// Redis could not be reached or refused the script.
    #[error(
        "cannot reach Redis at {url}: {source} (is redis-server running? check --redis / TALLY_REDIS)"
    )]
    Unreachable {
        /// The URL as given, password removed.
        url: String,
        /// The connection error.
        source: RedisError,
    },
}

/// Removes a password from a URL for messages.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// A prepared script call for one batch of one partition.
#[derive(Debug)]
pub struct Prepared {
    cmd: Cmd,
    /// Partition the batch belongs to.
    pub partition: i32,
    /// First offset covered.
    pub start: i64,
    /// Last offset covered.
    pub last: i64,
    /// Number of counter increments the script performs when it applies.
    pub increments: usize,
}

/// Applies batches to one Redis server.
#[derive(Clone)]
pub struct Applier {
    conn: ConnectionManager,
    sha: String,
    keys: KeyLayout,
    group: String,
    topic: String,
}

impl Applier {
    /// Connects, checks the server answers, and loads the script.
    pub async fn connect(
        url: &str,
        keys: KeyLayout,
        group: &str,
        topic: &str,
    ) -> Result<Self, ConnectError> {
        let shown = redact_url(url);
        let client = Client::open(url).map_err(|source| ConnectError::BadUrl {
            url: shown.clone(),
            source,
        })?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(3)))
            .set_response_timeout(Some(Duration::from_secs(10)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(2));
        let unreachable = |source| ConnectError::Unreachable {
            url: shown.clone(),
            source,
        };
        let mut conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(unreachable)?;
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(APPLY_LUA)
            .query_async(&mut conn)
            .await
            .map_err(unreachable)?;
        Ok(Self {
            conn,
            sha,
            keys,
            group: group.to_string(),
            topic: topic.to_string(),
        })
    }

    /// The key layout in use.
    pub fn keys(&self) -> &KeyLayout {
        &self.keys
    }

    /// The fence key of a partition.
    pub fn fence_key(&self, partition: i32) -> String {
        self.keys.fence_key(&self.group, &self.topic, partition)
    }

    /// Builds the script call for a batch. Keys are written into one reused
    /// buffer and copied straight into the command's argument buffer.
    pub fn prepare(&self, partition: i32, batch: &ClosedBatch, expect_fence: bool) -> Prepared {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.sha)
            .arg(batch.deltas.len() + 1)
            .arg(self.fence_key(partition));
        let mut key = String::with_capacity(64);
        for (id, _) in &batch.deltas {
            self.keys.write_counter_key(&mut key, id.post_id, id.bucket);
            cmd.arg(key.as_str());
        }
        cmd.arg(batch.start)
            .arg(batch.last)
            .arg(if expect_fence { "1" } else { "0" });
        for &(_, delta) in &batch.deltas {
            cmd.arg(delta);
        }
        Prepared {
            cmd,
            partition,
            start: batch.start,
            last: batch.last,
            increments: batch.deltas.len(),
        }
    }

    /// One attempt. A missing script (restart, failover, SCRIPT FLUSH) is
    /// loaded again and the call repeated once.
    pub async fn apply_once(&self, prepared: &Prepared) -> Result<Decision, RedisError> {
        let mut conn = self.conn.clone();
        let reply: Result<(i64, i64), RedisError> = prepared.cmd.query_async(&mut conn).await;
        let (code, fence) = match reply {
            Err(error) if classify_redis(&error) == RedisFailure::NoScript => {
                crate::metrics::script_reloaded();
                redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(APPLY_LUA)
                    .query_async::<String>(&mut conn)
                    .await?;
                prepared.cmd.query_async(&mut conn).await?
            }
            other => other?,
        };
        Decision::from_reply(code, fence).ok_or_else(|| {
            RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "apply.lua reply",
                format!("code {code}, fence {fence}"),
            ))
        })
    }

    /// Applies with retries on transient errors until success, a fatal error
    /// or cancellation. Retrying is safe: the fence turns a repeat into a no-op.
    pub async fn apply(
        &self,
        prepared: &Prepared,
        cancel: &CancellationToken,
    ) -> Result<Decision, ApplyError> {
        let mut backoff = Backoff::standard();
        loop {
            match self.apply_once(prepared).await {
                Ok(decision) => return Ok(decision),
                Err(error) if error.kind() == redis::ErrorKind::UnexpectedReturnType => {
                    return Err(ApplyError::BadReply(error.to_string()));
                }
                Err(error) if classify_redis(&error) == RedisFailure::Fatal => {
                    return Err(ApplyError::Fatal(error));
                }
                Err(error) => {
                    crate::metrics::redis_retry();
                    let delay = backoff.next_delay();
                    warn!(
                        partition = prepared.partition,
                        start = prepared.start,
                        last = prepared.last,
                        %error,
                        retry_in_ms = delay.as_millis() as u64,
                        "Redis apply failed; retrying."
                    );
                    tokio::select! {
                        _ = cancel.cancelled() => return Err(ApplyError::Cancelled),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }
}

/// Reads fences synchronously; used inside the Kafka rebalance callback, which
/// cannot await. Each call opens a short-lived connection with tight timeouts.
#[derive(Debug, Clone)]
pub struct FenceReader {
    client: Client,
    keys: KeyLayout,
    group: String,
    topic: String,
}

impl FenceReader {
    /// A reader for one group and topic.
    pub fn new(url: &str, keys: KeyLayout, group: &str, topic: &str) -> Result<Self, RedisError> {
        Ok(Self {
            client: Client::open(url)?,
            keys,
            group: group.to_string(),
            topic: topic.to_string(),
        })
    }

    /// The fences of `partitions`, in order (`None` where there is none).
    pub fn read(&self, partitions: &[i32]) -> Result<Vec<Option<i64>>, RedisError> {
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let timeout = Duration::from_secs(2);
        let mut conn = self.client.get_connection_with_timeout(timeout)?;
        conn.set_read_timeout(Some(timeout))?;
        conn.set_write_timeout(Some(timeout))?;
        let mut mget = redis::cmd("MGET");
        for &p in partitions {
            mget.arg(self.keys.fence_key(&self.group, &self.topic, p));
        }
        mget.query(&mut conn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("redis://:secret@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redact_url("redis://host:6379/"), "redis://host:6379/");
    }

    #[test]
    fn the_script_documents_its_contract() {
        for needle in ["KEYS[1]", "ARGV[1]", "ARGV[2]", "ARGV[3]", "Returns"] {
            assert!(
                APPLY_LUA.contains(needle),
                "apply.lua header lacks {needle}"
            );
        }
    }
}
