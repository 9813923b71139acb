//! Store: connections to one Redis server or a Redis Cluster.
//!
//! Invariant: one multiplexed connection per server (per primary on a
//! cluster), shared by every script in flight, so a batch touching many slot
//! groups is pipelined over a handful of connections rather than paid for in
//! sequential round trips. Redirections (MOVED, ASK), TRYAGAIN during slot
//! migration and reconnects after failover are handled by the cluster client;
//! whatever still fails reaches [`crate::infra::retry`] and is retried behind the fence.
//!
//! URLs: `redis://[user:password@]host:port[/db]` (or `rediss://` for TLS) for
//! one server; `redis+cluster://[user:password@]host1:port1,host2:port2,...`
//! (or `rediss+cluster://`) for a cluster, listing any subset of its nodes.
//!
//! TLS: a [`Target`] carries the certificates of the `--redis-tls-*` files
//! (a private CA, a client certificate and key) to every connection made
//! from it, the cluster nodes found in the slot map included, so no
//! connection falls back to the system's CAs or goes without the client
//! certificate.

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use redis::aio::{
    ConnectionLike as AsyncConnectionLike, ConnectionManager, ConnectionManagerConfig,
};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ConnectionLike, Pipeline, RedisError, RedisFuture, Value};
use tracing::warn;

use crate::infra::retry::{RedisFailure, classify_redis};
use crate::infra::security::{RedisTls, TlsProblem, redact_url, tls_problem};

/// A Redis URL, parsed once: where to connect, and how to show it.
///
/// The display form has the password replaced by `***`
/// ([`crate::infra::security::redact_url`]); it is the only form that reaches
/// a log line, an error or a report.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl {
    target: Target,
    shown: String,
}

/// A Redis URL that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{shown}': {problem}")]
pub struct UrlError {
    /// The URL as given, password removed.
    pub shown: String,
    /// What is wrong with it.
    pub problem: &'static str,
}

impl RedisUrl {
    /// Parses `redis://`, `rediss://`, `redis+cluster://` or `rediss+cluster://`.
    pub fn parse(url: &str) -> Result<RedisUrl, UrlError> {
        let shown = redact_url(url);
        match Target::parse(url) {
            Ok(target) => Ok(RedisUrl { target, shown }),
            Err(problem) => Err(UrlError { shown, problem }),
        }
    }

    /// Where to connect (credentials included).
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The URL with its password masked.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// Whether the URL names a cluster.
    pub fn is_cluster(&self) -> bool {
        self.target.is_cluster()
    }

    /// Whether the connection is encrypted (`rediss`).
    pub fn uses_tls(&self) -> bool {
        self.target.nodes()[0].starts_with("rediss://")
    }

    /// This URL, reached with the certificates of `tls`.
    pub fn with_tls(mut self, tls: Option<RedisTls>) -> RedisUrl {
        self.target = self.target.with_tls(tls);
        self
    }
}

impl std::fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown)
    }
}

/// Where the counters live, and how to reach them: the nodes' URLs and the
/// TLS material beyond the URL (a private CA, a client certificate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    nodes: Nodes,
    tls: Option<Arc<RedisTls>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Nodes {
    /// One server, by URL.
    Single(String),
    /// A cluster, by the URLs of some of its nodes.
    Cluster(Vec<String>),
}

impl Target {
    /// One server at `url`.
    pub fn single(url: impl Into<String>) -> Target {
        Target {
            nodes: Nodes::Single(url.into()),
            tls: None,
        }
    }

    /// A cluster, reached through the servers at `urls`.
    pub fn cluster(urls: Vec<String>) -> Target {
        Target {
            nodes: Nodes::Cluster(urls),
            tls: None,
        }
    }

    fn parse(url: &str) -> Result<Target, &'static str> {
        for (scheme, node_scheme) in [
            ("redis+cluster://", "redis://"),
            ("rediss+cluster://", "rediss://"),
        ] {
            if let Some(rest) = url.strip_prefix(scheme) {
                let (auth, hosts) = match rest.rsplit_once('@') {
                    Some((auth, hosts)) => (format!("{auth}@"), hosts),
                    None => (String::new(), rest),
                };
                let nodes: Vec<String> = hosts
                    .trim_end_matches('/')
                    .split(',')
                    .filter(|h| !h.trim().is_empty())
                    .map(|h| format!("{node_scheme}{auth}{}", h.trim()))
                    .collect();
                if nodes.is_empty() {
                    return Err("a cluster URL needs at least one host:port");
                }
                return Ok(Target::cluster(nodes));
            }
        }
        if url.starts_with("redis://") || url.starts_with("rediss://") {
            Ok(Target::single(url))
        } else {
            Err("expected redis://host:port or redis+cluster://host1:port1,host2:port2")
        }
    }

    /// This target, reached with `tls` (certificates read from the
    /// `--redis-tls-*` files).
    pub fn with_tls(mut self, tls: Option<RedisTls>) -> Target {
        self.tls = tls.map(Arc::new);
        self
    }

    /// The TLS material beyond the URL, if any was given.
    pub fn tls(&self) -> Option<&RedisTls> {
        self.tls.as_deref()
    }

    /// Whether this is a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.nodes, Nodes::Cluster(_))
    }

    /// The URL of every node given (one for a single server).
    pub fn nodes(&self) -> &[String] {
        match &self.nodes {
            Nodes::Single(url) => std::slice::from_ref(url),
            Nodes::Cluster(nodes) => nodes,
        }
    }

    /// One server at `host_port`, reached with this target's scheme,
    /// credentials and certificates (a cluster node found in the slot map, say).
    pub fn node(&self, host_port: &str) -> Target {
        let template = &self.nodes()[0];
        let (scheme, rest) = template.split_once("://").unwrap_or(("redis", template));
        let auth = rest
            .rsplit_once('@')
            .map(|(auth, _)| format!("{auth}@"))
            .unwrap_or_default();
        Target {
            nodes: Nodes::Single(format!("{scheme}://{auth}{host_port}/")),
            tls: self.tls.clone(),
        }
    }

    /// A client for one server's URL, with this target's certificates.
    fn client(&self, url: &str) -> Result<redis::Client, RedisError> {
        match &self.tls {
            Some(tls) => redis::Client::build_with_tls(url, tls.certificates()),
            None => redis::Client::open(url),
        }
    }

    /// A cluster client builder for this target's nodes and certificates.
    fn cluster_builder(&self) -> ClusterClientBuilder {
        let builder = ClusterClientBuilder::new(self.nodes().to_vec());
        match &self.tls {
            Some(tls) => builder.certs(tls.certificates()),
            None => builder,
        }
    }
}

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
        if url.is_cluster() {
            probe_nodes(url.target()).await.map_err(failed)?;
        }
        Shared::connect_checked(url.target()).await.map_err(failed)
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

/// How many replicas must acknowledge a write before tally acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replicas {
    /// One where the primaries have replicas (the fewest any primary has,
    /// at most 1), none where they have none.
    Auto,
    /// Exactly this many (0: never wait).
    Exactly(u32),
}

impl std::str::FromStr for Replicas {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Replicas, Self::Err> {
        match s {
            "auto" => Ok(Replicas::Auto),
            n => n
                .parse()
                .map(Replicas::Exactly)
                .map_err(|_| "expected `auto` or a number of replicas"),
        }
    }
}

impl std::fmt::Display for Replicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Replicas::Auto => f.write_str("auto"),
            Replicas::Exactly(n) => write!(f, "{n}"),
        }
    }
}

/// `WAIT` after a write that must survive a failover (routing metadata):
/// how many replicas, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaWait {
    /// Replicas that must acknowledge.
    pub replicas: Replicas,
    /// How long to wait for them.
    pub timeout: Duration,
}

impl Default for ReplicaWait {
    fn default() -> Self {
        ReplicaWait {
            replicas: Replicas::Auto,
            timeout: Duration::from_millis(1000),
        }
    }
}

/// What a [`Shared::replicate`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replicated {
    /// Replicas that had to acknowledge.
    pub wanted: u32,
    /// Replicas that did, within the timeout (on a cluster, the fewest of
    /// any primary).
    pub acked: u32,
}

impl Replicated {
    /// Whether fewer replicas acknowledged than had to.
    pub fn short(&self) -> bool {
        self.acked < self.wanted
    }
}

impl Shared {
    /// Waits until `wait.replicas` replicas acknowledged every write made on
    /// the current connection (on a cluster, every primary's replicas, as
    /// the cluster client sends `WAIT` to each primary and keeps the
    /// fewest). A connection replaced since the write cannot be waited on;
    /// the write then counts as acknowledged.
    pub async fn replicate(&self, wait: ReplicaWait) -> Result<Replicated, RedisError> {
        let wanted = match wait.replicas {
            Replicas::Exactly(n) => n,
            Replicas::Auto => self.least_replicas().await?.min(1),
        };
        if wanted == 0 {
            return Ok(Replicated { wanted, acked: 0 });
        }
        let timeout_ms = wait.timeout.as_millis().max(1) as u64;
        let acked: i64 = self
            .call(|mut s| async move {
                redis::cmd("WAIT")
                    .arg(wanted)
                    .arg(timeout_ms)
                    .query_async(&mut s)
                    .await
            })
            .await?;
        Ok(Replicated {
            wanted,
            acked: acked.max(0) as u32,
        })
    }

    /// The fewest replicas connected to any primary (`INFO replication`);
    /// none, with a warning, where the user may not run INFO.
    async fn least_replicas(&self) -> Result<u32, RedisError> {
        let info: Result<Value, RedisError> = self
            .call(|mut s| async move {
                redis::cmd("INFO")
                    .arg("replication")
                    .query_async(&mut s)
                    .await
            })
            .await;
        match info {
            Ok(info) => Ok(least_connected(&info).unwrap_or(0)),
            Err(error) if error.code() == Some("NOPERM") => {
                warn!(
                    %error,
                    "Cannot count the Redis replicas, so routing versions wait for none: grant +info to tally's Redis user, or set --registry-replicas."
                );
                Ok(0)
            }
            Err(error) => Err(error),
        }
    }
}

/// The smallest `connected_slaves` in an `INFO` reply: one text, or a map
/// from each primary's address to its text on a cluster.
fn least_connected(info: &Value) -> Option<u32> {
    let text = |bytes: &[u8]| {
        String::from_utf8_lossy(bytes)
            .lines()
            .find_map(|line| line.strip_prefix("connected_slaves:")?.trim().parse().ok())
    };
    match info {
        Value::BulkString(bytes) => text(bytes),
        Value::SimpleString(s) => text(s.as_bytes()),
        Value::VerbatimString { text: s, .. } => text(s.as_bytes()),
        Value::Map(pairs) => pairs.iter().filter_map(|(_, v)| least_connected(v)).min(),
        Value::Array(items) => items.iter().filter_map(least_connected).min(),
        _ => None,
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

/// A small Lua script sent by hash, and in full once after a NOSCRIPT (a
/// flushed script cache, a failover, a node that never saw it).
pub struct Lua {
    text: &'static str,
    sha: OnceLock<String>,
}

impl Lua {
    /// A script with the given source.
    pub const fn new(text: &'static str) -> Self {
        Self {
            text,
            sha: OnceLock::new(),
        }
    }

    fn command(&self, by_hash: bool, keys: &[&str], args: &[&str]) -> Cmd {
        let mut cmd = if by_hash {
            let sha = self
                .sha
                .get_or_init(|| redis::Script::new(self.text).get_hash().to_string());
            redis::cmd("EVALSHA").arg(sha.as_str()).clone()
        } else {
            redis::cmd("EVAL").arg(self.text).clone()
        };
        cmd.arg(keys.len()).arg(keys).arg(args);
        cmd
    }

    /// Runs the script once on the server owning `keys`.
    pub async fn call<T: redis::FromRedisValue>(
        &self,
        store: &Shared,
        keys: &[&str],
        args: &[&str],
    ) -> Result<T, RedisError> {
        store
            .call(|mut s| async move {
                match self.command(true, keys, args).query_async(&mut s).await {
                    Err(error) if classify_redis(&error) == RedisFailure::NoScript => {
                        self.command(false, keys, args).query_async(&mut s).await
                    }
                    other => other,
                }
            })
            .await
    }
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

/// The server behind a store, from its `INFO server`: Redis, or Valkey (which
/// also reports the Redis version whose commands and scripting it keeps, 7.2.4
/// for every Valkey release so far).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// `Redis` or `Valkey`.
    pub kind: &'static str,
    /// The server's own release, as it reports it.
    pub version: String,
    /// The Redis release its commands and scripting match (`redis_version`).
    pub redis_version: (u32, u32, u32),
}

/// The oldest Redis release tally's scripts run on: each checks its commands
/// against the caller's ACL before its first write (`redis.acl_check_cmd`, new
/// in Redis 7.0), and without it a user missing a command would stop a script
/// half-way through its increments.
pub const OLDEST_REDIS: (u32, u32, u32) = (7, 0, 0);

impl Server {
    /// Reads the text of `INFO server`; None without a `redis_version` line.
    pub fn from_info(info: &str) -> Option<Server> {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let redis = field("redis_version")?;
        let mut parts = redis.split('.').map(|p| p.parse::<u32>().ok());
        let mut next = || parts.next().flatten().unwrap_or(0);
        let redis_version = (next(), next(), next());
        Some(match field("valkey_version") {
            Some(valkey) => Server {
                kind: "Valkey",
                version: valkey.to_string(),
                redis_version,
            },
            None => Server {
                kind: "Redis",
                version: redis.to_string(),
                redis_version,
            },
        })
    }

    /// Whether tally's scripts can run on it (see [`OLDEST_REDIS`]).
    pub fn supported(&self) -> bool {
        self.redis_version >= OLDEST_REDIS
    }
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind, self.version)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn replicas_are_counted_on_one_server_and_across_primaries() {
        use redis::Value;
        let info = |n: u32| {
            Value::BulkString(
                format!("# Replication\r\nrole:master\r\nconnected_slaves:{n}\r\n").into_bytes(),
            )
        };
        assert_eq!(super::least_connected(&info(2)), Some(2));
        let cluster = Value::Map(vec![
            (Value::BulkString(b"a:1".to_vec()), info(1)),
            (Value::BulkString(b"b:2".to_vec()), info(0)),
        ]);
        assert_eq!(super::least_connected(&cluster), Some(0));
        assert_eq!(super::least_connected(&Value::Nil), None);
        assert_eq!("auto".parse(), Ok(super::Replicas::Auto));
        assert_eq!("2".parse(), Ok(super::Replicas::Exactly(2)));
        assert!("x".parse::<super::Replicas>().is_err());
    }

    use super::*;

    fn target(url: &str) -> Target {
        RedisUrl::parse(url).unwrap().target().clone()
    }

    #[test]
    fn urls_name_a_server_or_a_cluster() {
        assert_eq!(target("redis://h:1/"), Target::single("redis://h:1/"));
        assert_eq!(
            target("redis+cluster://u:p@a:1,b:2/"),
            Target::cluster(vec!["redis://u:p@a:1".into(), "redis://u:p@b:2".into()])
        );
        assert!(
            RedisUrl::parse("rediss+cluster://a:1")
                .unwrap()
                .is_cluster()
        );
        assert!(RedisUrl::parse("rediss+cluster://a:1").unwrap().uses_tls());
        let bad = RedisUrl::parse("localhost:6379").unwrap_err();
        assert!(
            bad.to_string().starts_with("'localhost:6379': expected"),
            "{bad}"
        );
        assert!(RedisUrl::parse("redis+cluster://").is_err());
    }

    #[test]
    fn the_shown_url_hides_the_password_only() {
        let url = RedisUrl::parse("redis+cluster://u:s3cret@a:1,b:2").unwrap();
        assert_eq!(url.shown(), "redis+cluster://u:***@a:1,b:2");
        assert_eq!(format!("{url:?}"), url.shown());
        let bad = RedisUrl::parse("http://u:s3cret@a").unwrap_err();
        assert!(!bad.to_string().contains("s3cret"), "{bad}");
    }

    #[test]
    fn the_server_is_named_by_its_own_version() {
        let redis =
            Server::from_info("# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n")
                .unwrap();
        assert_eq!(redis.to_string(), "Redis 7.0.15");
        assert!(redis.supported());
        let valkey = Server::from_info(
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\n",
        )
        .unwrap();
        assert_eq!(valkey.to_string(), "Valkey 9.1.2");
        assert_eq!(valkey.redis_version, (7, 2, 4));
        assert!(valkey.supported());
        let old = Server::from_info("redis_version:6.2.14\r\n").unwrap();
        assert!(!old.supported());
        assert!(
            Server::from_info("redis_version:7.0.0\n")
                .unwrap()
                .supported()
        );
        assert_eq!(Server::from_info("# Server\r\nos:Linux\r\n"), None);
    }

    #[test]
    fn cluster_nodes_keep_the_credentials() {
        assert_eq!(
            target("redis+cluster://u:p@a:1").node("10.0.0.2:7001"),
            Target::single("redis://u:p@10.0.0.2:7001/")
        );
        assert_eq!(
            target("rediss://a:1").node("b:2"),
            Target::single("rediss://b:2/")
        );
        let tls = RedisTls::new(Some(b"ca".to_vec()), None);
        let secure = target("rediss+cluster://a:1").with_tls(Some(tls.clone()));
        assert_eq!(secure.node("b:2").tls(), Some(&tls), "nodes keep the CA");
    }
}
