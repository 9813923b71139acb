//! Store: connections to one Redis server or a Redis Cluster.
//!
//! Invariant: one multiplexed connection per server (per primary on a
//! cluster), shared by every script in flight, so a batch touching many slot
//! groups is pipelined over a handful of connections rather than paid for in
//! sequential round trips. Redirections (MOVED, ASK), TRYAGAIN during slot
//! migration and reconnects after failover are handled by the cluster client;
//! whatever still fails reaches [`crate::infra::retry`] and is retried behind the fence.
//!
//! Parts: `url` (the Redis URL parsed once, and the target it names, TLS
//! material included), `replicas` (how many replicas a write waits for),
//! `lua` (scripts sent by hash), `server` (which server and release
//! answers); this file holds the connections.

mod lua;
mod replicas;
mod server;
mod url;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{
    ConnectionLike as AsyncConnectionLike, ConnectionManager, ConnectionManagerConfig,
};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ConnectionLike, Pipeline, RedisError, RedisFuture, Value};
use tracing::warn;

use crate::infra::security::{TlsProblem, tls_problem};
use url::Nodes;

pub use lua::Lua;
pub use replicas::{ReplicaWait, Replicas, Replicated};
pub use server::{OLDEST_REDIS, Server};
pub use url::{RedisUrl, Target, UrlError};

/// An async connection to the store; cheap to clone (shared multiplexed connections).
#[derive(Clone)]
pub enum Store {
    /// One server; reconnects by itself.
    Single(ConnectionManager),
    /// A cluster; one connection per node, slot map kept fresh.
    Cluster(ClusterConnection),
}

impl Store {
    /// Connects to the target.
    pub async fn connect(target: &Target) -> Result<Store, RedisError> {
        match &target.nodes {
            Nodes::Single(url) => {
                let client = target.client(url)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(3)))
                    .set_response_timeout(Some(Duration::from_secs(10)))
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_secs(2));
                Ok(Store::Single(
                    ConnectionManager::new_with_config(client, config).await?,
                ))
            }
            Nodes::Cluster(_) => {
                let client = target
                    .cluster_builder()
                    .connection_timeout(Duration::from_secs(3))
                    .response_timeout(Duration::from_secs(10))
                    .retries(3)
                    .min_retry_wait(50)
                    .max_retry_wait(2_000)
                    .build()?;
                Ok(Store::Cluster(client.get_async_connection().await?))
            }
        }
    }
}

impl AsyncConnectionLike for Store {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Store::Single(c) => c.req_packed_command(cmd),
            Store::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Store::Single(c) => c.req_packed_commands(cmd, offset, count),
            Store::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Store::Single(c) => c.get_db(),
            Store::Cluster(c) => c.get_db(),
        }
    }
}

/// What every [`stray_value`] error says first.
const STRAY_VALUE: &str = "a key of tally's holds a value tally does not write";

/// An error no retry fixes: one of tally's keys holds a value tally never
/// writes there (a foreign writer, a typo in redis-cli, a restore of
/// something else), which tally will not guess its way past. `detail` names
/// the key, its value and the fix.
pub fn stray_value(detail: String) -> RedisError {
    RedisError::from((redis::ErrorKind::UnexpectedReturnType, STRAY_VALUE, detail))
}

/// The number one of tally's keys (or fields) holds, `None` when absent;
/// anything else is a [`stray_value`] error whose detail `explain` writes
/// from the value found.
pub fn stored_number<T: std::str::FromStr>(
    raw: Option<Vec<u8>>,
    explain: impl FnOnce(&str) -> String,
) -> Result<Option<T>, RedisError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    std::str::from_utf8(&raw)
        .ok()
        .and_then(|text| text.parse().ok())
        .map(Some)
        .ok_or_else(|| stray_value(explain(&String::from_utf8_lossy(&raw))))
}

/// The detail of a [`stray_value`] error; `None` for any other error.
pub fn stray_detail(error: &RedisError) -> Option<&str> {
    if error.kind() == redis::ErrorKind::UnexpectedReturnType
        && error.to_string().starts_with(STRAY_VALUE)
    {
        error.detail()
    } else {
        None
    }
}

/// How long a start waits for a server that is loading its dataset.
pub const LOADING_WAIT: Duration = Duration::from_secs(60);

/// Redis could not be reached, or refused the connection, at start-up.
#[derive(Debug, thiserror::Error)]
#[error("cannot reach Redis at {url}: {source}")]
pub struct ConnectError {
    /// The URL, password masked.
    pub url: String,
    /// What the connection or its first PING answered.
    #[source]
    pub source: RedisError,
}

impl ConnectError {
    /// Whether Redis turned the connection down for its credentials.
    pub fn refused_credentials(&self) -> bool {
        self.source.kind() == redis::ErrorKind::AuthenticationFailed
            || matches!(self.source.code(), Some("NOAUTH" | "WRONGPASS"))
    }

    /// What went wrong in the TLS handshake, if that is what failed.
    pub fn tls_problem(&self) -> Option<TlsProblem> {
        tls_problem(&self.source)
    }
}

/// A store connection shared by every task, rebuilt when a cluster stops
/// answering. After a primary dies, the cluster client can keep timing out
/// on every node for a long while (its topology refresh waits on the dead
/// node); a fresh connection reads the new topology from a live node at once.
#[derive(Clone)]
pub struct Shared {
    inner: Arc<SharedInner>,
}

struct SharedInner {
    target: Target,
    current: Mutex<(u64, Store)>,
    rebuilding: tokio::sync::Mutex<()>,
}

impl Shared {
    /// Connects to the target.
    pub async fn connect(target: &Target) -> Result<Shared, RedisError> {
        let store = Store::connect(target).await?;
        Ok(Shared {
            inner: Arc::new(SharedInner {
                target: target.clone(),
                current: Mutex::new((0, store)),
                rebuilding: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// Connects and checks that the store answers a PING.
    pub async fn connect_checked(target: &Target) -> Result<Shared, RedisError> {
        let store = Shared::connect(target).await?;
        store
            .call(|mut s| async move { redis::cmd("PING").query_async::<String>(&mut s).await })
            .await?;
        Ok(store)
    }

    /// Connects to `url` and checks the store answers a PING. On a cluster,
    /// the nodes given are tried one by one first, so that a node nobody can
    /// reach (a wrong certificate, say) is reported once, as its own error.
    pub async fn open(url: &RedisUrl) -> Result<Shared, ConnectError> {
        let failed = |source| ConnectError {
            url: url.shown().to_string(),
            source,
        };
        // A server that is loading its dataset (a restart from its AOF or
        // RDB) answers LOADING until it is done, and one going down for a
        // restart drops the connection it had accepted: both waited for, not
        // refused. A connection refused (nothing listens: a wrong port) fails
        // at once, and so does a dropped one over TLS, where a handshake the
        // server rejects looks the same.
        let restarting = |error: &RedisError| {
            error.code() == Some("LOADING")
                || (error.is_connection_dropped()
                    && !error.is_connection_refusal()
                    && !url.uses_tls())
        };
        let waited_since = std::time::Instant::now();
        let mut told = false;
        loop {
            let connected = match url.is_cluster() {
                true => probe_nodes(url.target()).await,
                false => Ok(()),
            };
            let connected = match connected {
                Ok(()) => Shared::connect_checked(url.target()).await,
                Err(error) => Err(error),
            };
            match connected {
                Err(error) if restarting(&error) && waited_since.elapsed() < LOADING_WAIT => {
                    if !told {
                        tracing::warn!(url = %url.shown(), %error, "Redis is loading its dataset or restarting; waiting for it.");
                        told = true;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                other => return other.map_err(failed),
            }
        }
    }

    /// The current connection and its generation.
    pub fn get(&self) -> (u64, Store) {
        let current = self.inner.current.lock().unwrap_or_else(|e| e.into_inner());
        (current.0, current.1.clone())
    }

    /// Runs `call` on the current connection; a cluster connection that failed
    /// with a timeout or a broken connection is replaced before the error is
    /// returned, so the caller's retry uses a fresh one.
    pub async fn call<T, F, Fut>(&self, call: F) -> Result<T, RedisError>
    where
        F: FnOnce(Store) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let (generation, store) = self.get();
        let result = call(store).await;
        if let Err(error) = &result
            && self.inner.target.is_cluster()
            && (error.is_timeout() || error.is_io_error() || error.is_connection_dropped())
        {
            self.rebuild(generation).await;
        }
        result
    }

    async fn rebuild(&self, failed: u64) {
        let _one_at_a_time = self.inner.rebuilding.lock().await;
        if self.get().0 != failed {
            return;
        }
        match Store::connect(&self.inner.target).await {
            Ok(store) => {
                *self.inner.current.lock().unwrap_or_else(|e| e.into_inner()) = (failed + 1, store);
                warn!(
                    generation = failed + 1,
                    "Cluster connection rebuilt after errors."
                );
            }
            Err(error) => warn!(%error, "Rebuilding the cluster connection failed; will retry."),
        }
    }
}

/// PINGs the nodes of a cluster target one by one until one answers; the
/// first node's error when none does.
async fn probe_nodes(target: &Target) -> Result<(), RedisError> {
    let mut first_error = None;
    for url in target.nodes() {
        let ping = async {
            let mut conn = target
                .client(url)?
                .get_multiplexed_async_connection()
                .await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await
        };
        let answer = tokio::time::timeout(Duration::from_secs(3), ping)
            .await
            .unwrap_or_else(|_| {
                Err(RedisError::from(std::io::Error::from(
                    std::io::ErrorKind::TimedOut,
                )))
            });
        match answer {
            Ok(_) => return Ok(()),
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// A blocking connection, for the Kafka rebalance callback (which cannot await).
pub fn connect_blocking(
    target: &Target,
    timeout: Duration,
) -> Result<Box<dyn ConnectionLike>, RedisError> {
    match &target.nodes {
        Nodes::Single(url) => {
            let conn = target.client(url)?.get_connection_with_timeout(timeout)?;
            conn.set_read_timeout(Some(timeout))?;
            conn.set_write_timeout(Some(timeout))?;
            Ok(Box::new(conn))
        }
        Nodes::Cluster(_) => {
            let client = target
                .cluster_builder()
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(3)
                .build()?;
            Ok(Box::new(client.get_connection()?))
        }
    }
}
