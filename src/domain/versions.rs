//! Versions: per-post routing metadata, and the order of operations that
//! lets a post change its bucket count while writers and readers run.
//!
//! Every post starts in version 0 with the `--buckets` default. Promotion
//! (more buckets) and demotion (fewer) never re-route existing keys: each
//! creates a new version with keys of its own, and a post's count is its
//! base plus the sum of every version's buckets. Two records per post:
//!
//! * the **route hash** `<prefix>:route:<post>` (fields `v<k>` = bucket
//!   count, plus `next`, `version`, `mode`, `base`) is what readers read;
//! * the **registry** `<prefix>:routes` (one field per routed post, value
//!   `k:buckets:effective_ms;...`) is what writers read, every
//!   `--route-refresh-ms`, together with the registry server's clock.
//!
//! # Invariant 1: one event, one counter, whoever applies it
//!
//! An event is routed by its Kafka timestamp: to the latest version whose
//! `effective_ms` is at or before it. Entries only grow, so the route of an
//! event is a pure function of the event and the registry. A version is
//! published with `effective_ms = registry clock + GRACE_MS`, so a registry
//! read at clock `F` holds every version that can route an event stamped
//! before `F + GRACE_MS`; a writer holding an older read waits for a newer
//! one before routing a later event. Two consumers with caches of different
//! ages therefore route every event the same way, and a replay after a crash
//! or a rebalance routes it as the first try did. That matters on a cluster,
//! where a batch's slot groups apply independently and a replay must know
//! which group already holds each event.
//!
//! # Invariant 2: readers never sum fewer keys than a writer uses
//!
//! Publishing runs in this order: (1) reserve version `k` in the route hash,
//! (2) append it to the registry, (3) mark it current in the route hash. A
//! writer learns of `k` only from the registry, after (1), and field `v<k>`
//! is never removed once published; so a reader that reads the route hash
//! after (1) sums version `k`. A reader that read it just before (1) and its
//! counters later could miss `k` only if a write to `k` landed in between;
//! such a write needs an event stamped at or after `effective_ms`, and
//! writers hold events stamped more than `AHEAD_MS` past the registry clock,
//! so the first write to `k` lands at least `GRACE_MS - AHEAD_MS` after (2).
//! Readers give up and start again when their two steps take longer than
//! [`READ_DEADLINE`], which is well inside that window.
//!
//! # Demotion
//!
//! A demotion is a version with fewer buckets; the old version's keys stay
//! summed. They are not folded into the base: an event stamped before the
//! demotion can still arrive later (a lagging partition, a replay of the
//! topic), and it is routed to the old version by invariant 1; nothing short
//! of every partition's fence passing the demotion time proves an old
//! version closed, and a cluster has no transaction spanning its slots.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::RedisError;
use rustc_hash::FxHashMap;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::domain::routing::{CounterId, KeyLayout, bucket_of};
use crate::infra::store::{Lua, Shared};

/// A new version routes events stamped this long after its publication.
pub const GRACE_MS: i64 = 5_000;
/// Writers hold an event stamped further than this ahead of the registry clock.
pub const AHEAD_MS: i64 = 500;
/// A read of a post's route hash and counters must finish within this.
pub const READ_DEADLINE: Duration = Duration::from_secs(2);

static FETCH: Lua = Lua::new(include_str!("route_fetch.lua"));
static RESERVE: Lua = Lua::new(include_str!("route_reserve.lua"));
static PUBLISH: Lua = Lua::new(include_str!("route_publish.lua"));

/// One routing version of a post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version {
    /// Version number; 0 is the default layout.
    pub version: u32,
    /// Buckets of this version.
    pub buckets: u32,
    /// Events stamped at or after this (milliseconds since the epoch, registry
    /// clock) are routed here, until the next version's time.
    pub effective_ms: i64,
}

/// Parses a registry entry (`k:buckets:effective_ms;...`, oldest first).
pub fn parse_entry(entry: &str) -> Option<Vec<Version>> {
    let versions = entry
        .split(';')
        .map(|item| {
            let mut parts = item.split(':');
            let version = parts.next()?.parse().ok()?;
            let buckets = parts.next()?.parse().ok().filter(|&b| b > 0)?;
            let effective_ms = parts.next()?.parse().ok()?;
            parts.next().is_none().then_some(Version {
                version,
                buckets,
                effective_ms,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    let ordered = versions
        .windows(2)
        .all(|w| w[0].version < w[1].version && w[0].effective_ms < w[1].effective_ms);
    (ordered && !versions.is_empty()).then_some(versions)
}

/// What a writer must do before routing an event with a given timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Route it now.
    Ready,
    /// The registry read is too old for this timestamp: read it again.
    Refresh,
    /// The event is stamped ahead of the registry clock: wait this long.
    Wait(Duration),
}

/// A writer's view of the registry: the routed posts, and when it was read.
#[derive(Debug, Clone)]
pub struct RouteTable {
    default_buckets: u32,
    posts: FxHashMap<u64, Box<[Version]>>,
    /// Registry clock at the read (milliseconds since the epoch).
    fetched_ms: i64,
    fetched_at: Instant,
}

impl RouteTable {
    /// A table read at registry time `fetched_ms`.
    pub fn new(
        default_buckets: u32,
        fetched_ms: i64,
        posts: impl IntoIterator<Item = (u64, Vec<Version>)>,
    ) -> Self {
        Self {
            default_buckets,
            posts: posts
                .into_iter()
                .map(|(post, versions)| (post, versions.into_boxed_slice()))
                .collect(),
            fetched_ms,
            fetched_at: Instant::now(),
        }
    }

    /// The version an event of `post_id` stamped `timestamp_ms` goes to.
    pub fn route(&self, post_id: u64, timestamp_ms: i64) -> Version {
        match self.posts.get(&post_id) {
            Some(versions) => *versions
                .iter()
                .rev()
                .find(|v| v.effective_ms <= timestamp_ms)
                .unwrap_or(&versions[0]),
            None => Version {
                version: 0,
                buckets: self.default_buckets,
                effective_ms: 0,
            },
        }
    }

    /// The counter a like of `post_id` by `user_id`, stamped `timestamp_ms`, lands in.
    pub fn counter(&self, post_id: u64, user_id: u64, timestamp_ms: i64) -> CounterId {
        let v = self.route(post_id, timestamp_ms);
        CounterId {
            post_id,
            version: v.version,
            bucket: bucket_of(user_id, v.buckets),
        }
    }

    /// The newest version of a post (version 0 when it has no metadata).
    pub fn latest(&self, post_id: u64) -> Version {
        self.route(post_id, i64::MAX)
    }

    /// Posts with routing metadata.
    pub fn routed_posts(&self) -> usize {
        self.posts.len()
    }

    /// The registry clock now, estimated from the read and the time since.
    pub fn now_ms(&self) -> i64 {
        self.fetched_ms + self.fetched_at.elapsed().as_millis() as i64
    }

    /// Whether an event stamped `timestamp_ms` can be routed with this table.
    pub fn readiness(&self, timestamp_ms: i64) -> Readiness {
        // The common case, an event stamped before the read, costs no clock call.
        if timestamp_ms < self.fetched_ms + AHEAD_MS {
            return Readiness::Ready;
        }
        if timestamp_ms >= self.fetched_ms + GRACE_MS {
            return Readiness::Refresh;
        }
        let ahead = timestamp_ms - self.now_ms() - AHEAD_MS;
        if ahead > 0 {
            return Readiness::Wait(Duration::from_millis(ahead as u64));
        }
        Readiness::Ready
    }
}

/// The routing metadata readers use: every version's bucket count, and the base.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PostMeta {
    /// (version, buckets) of every version a writer may use, ascending.
    pub versions: Vec<(u32, u32)>,
    /// Added to the sum of the counters.
    pub base: i64,
    /// The newest published version, if any was.
    pub current: Option<u32>,
    /// `hot` or `cold`, set by the last publication.
    pub mode: Option<String>,
}

impl PostMeta {
    /// Reads a route hash's fields (`HGETALL`); `default_buckets` stands for
    /// version 0 when the hash has no `v0` (a post never routed).
    pub fn from_fields(fields: &[(String, String)], default_buckets: u32) -> Self {
        let mut meta = PostMeta::default();
        for (field, value) in fields {
            match field.as_str() {
                "base" => meta.base = value.parse().unwrap_or(0),
                "version" => meta.current = value.parse().ok(),
                "mode" => meta.mode = Some(value.clone()),
                _ => {
                    if let Some(version) = field.strip_prefix('v').and_then(|v| v.parse().ok())
                        && let Ok(buckets) = value.parse::<u32>()
                        && buckets > 0
                    {
                        meta.versions.push((version, buckets));
                    }
                }
            }
        }
        if !meta.versions.iter().any(|&(v, _)| v == 0) {
            meta.versions.push((0, default_buckets));
        }
        meta.versions.sort_unstable();
        meta
    }

    /// Every counter key of the post.
    pub fn keys(&self, layout: &KeyLayout, post_id: u64) -> Vec<String> {
        self.versions
            .iter()
            .flat_map(|&(version, buckets)| {
                (0..buckets).map(move |bucket| CounterId {
                    post_id,
                    version,
                    bucket,
                })
            })
            .map(|id| layout.key_of(id))
            .collect()
    }
}

/// Why a publication was made; a label of the promotions metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Hot-post detection inside `tally run`.
    Auto,
    /// `tally promote` or `tally demote`.
    Manual,
}

impl Trigger {
    /// The name metrics use (`tally_promotions_total{trigger}`).
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Auto => "auto",
            Trigger::Manual => "manual",
        }
    }
}

/// The result of [`Routes::publish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// Whether a new version was added (automatic promotion skips a post
    /// already promoted far enough).
    pub added: bool,
    /// The post's versions after the call.
    pub versions: Vec<Version>,
}

/// Routing metadata in Redis: reading the registry and publishing versions.
#[derive(Clone)]
pub struct Routes {
    store: Shared,
    keys: KeyLayout,
    default_buckets: u32,
}

impl Routes {
    /// Routing metadata under `keys`' prefix, on `store`.
    pub fn new(store: Shared, keys: KeyLayout, default_buckets: u32) -> Self {
        Self {
            store,
            keys,
            default_buckets,
        }
    }

    /// Reads the registry and the registry server's clock.
    pub async fn fetch(&self) -> Result<RouteTable, RedisError> {
        let registry = self.keys.registry_key();
        let reply: Vec<redis::Value> = FETCH.call(&self.store, &[&registry], &[]).await?;
        let mut items = reply.into_iter();
        let now: i64 = redis::from_redis_value(items.next().unwrap_or(redis::Value::Nil))?;
        let rest: Vec<String> = items
            .map(redis::from_redis_value::<String>)
            .collect::<Result<_, _>>()?;
        let mut posts = Vec::with_capacity(rest.len() / 2);
        for pair in rest.chunks_exact(2) {
            match (pair[0].parse::<u64>(), parse_entry(&pair[1])) {
                (Ok(post), Some(versions)) => posts.push((post, versions)),
                _ => warn!(field = %pair[0], "Unreadable routing registry entry ignored."),
            }
        }
        Ok(RouteTable::new(self.default_buckets, now, posts))
    }

    /// Reads one post's route hash (what readers sum).
    pub async fn meta(&self, post_id: u64) -> Result<PostMeta, RedisError> {
        let key = self.keys.route_key(post_id);
        let fields: Vec<(String, String)> = self
            .store
            .call(|mut s| async move { redis::cmd("HGETALL").arg(&key).query_async(&mut s).await })
            .await?;
        Ok(PostMeta::from_fields(&fields, self.default_buckets))
    }

    /// Publishes a version of `post_id` with `buckets` buckets, in the order
    /// the module doc proves safe. `latest` is the newest version the caller
    /// knows of; with [`Trigger::Auto`] nothing is added unless the post's
    /// newest bucket count is below `buckets`.
    pub async fn publish(
        &self,
        post_id: u64,
        buckets: u32,
        latest: u32,
        trigger: Trigger,
    ) -> Result<Published, RedisError> {
        let route = self.keys.route_key(post_id);
        let (version, v0): (u32, u32) = RESERVE
            .call(
                &self.store,
                &[&route],
                &[
                    &buckets.to_string(),
                    &self.default_buckets.to_string(),
                    &latest.to_string(),
                ],
            )
            .await?;
        let only_if_below = if trigger == Trigger::Auto { "1" } else { "0" };
        let (added, entry): (i64, String) = PUBLISH
            .call(
                &self.store,
                &[&self.keys.registry_key()],
                &[
                    &post_id.to_string(),
                    &version.to_string(),
                    &buckets.to_string(),
                    &GRACE_MS.to_string(),
                    &v0.to_string(),
                    only_if_below,
                ],
            )
            .await?;
        let versions = parse_entry(&entry).unwrap_or_default();
        let added = added == 1;
        let route_for = route.clone();
        self.store
            .call(|mut s| async move {
                if added {
                    let mode = if buckets > v0 { "hot" } else { "cold" };
                    redis::pipe()
                        .hset(&route_for, "version", version)
                        .hset(&route_for, "mode", mode)
                        .query_async::<()>(&mut s)
                        .await
                } else {
                    // Never published, so never used by a writer: safe to drop.
                    redis::cmd("HDEL")
                        .arg(&route_for)
                        .arg(format!("v{version}"))
                        .query_async::<()>(&mut s)
                        .await
                }
            })
            .await?;
        if added {
            let effective = versions.last().map_or(0, |v| v.effective_ms);
            info!(
                post_id,
                version,
                buckets,
                effective_ms = effective,
                trigger = ?trigger,
                "Routing version published."
            );
        }
        Ok(Published { added, versions })
    }
}

/// Milliseconds since the epoch by this machine's clock.
pub fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A writer's registry view, kept fresh by a background task.
#[derive(Clone)]
pub struct RouteWatch {
    table: watch::Receiver<Arc<RouteTable>>,
    wake: Arc<Notify>,
}

impl RouteWatch {
    /// Reads the registry once (so the first events can be routed), then
    /// re-reads it every `every` until `shutdown`.
    pub async fn start(
        routes: Routes,
        every: Duration,
        shutdown: CancellationToken,
    ) -> Result<Self, RedisError> {
        let first = routes.fetch().await?;
        let (send, table) = watch::channel(Arc::new(first));
        let wake = Arc::new(Notify::new());
        let woken = wake.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                    _ = woken.notified() => {}
                }
                match routes.fetch().await {
                    Ok(table) => {
                        crate::infra::metrics::routed_posts(table.routed_posts());
                        if send.send(Arc::new(table)).is_err() {
                            return;
                        }
                    }
                    Err(error) => warn!(%error, "Reading the routing registry failed; retrying."),
                }
            }
        });
        Ok(Self { table, wake })
    }

    /// The newest table.
    pub fn current(&self) -> Arc<RouteTable> {
        self.table.borrow().clone()
    }

    /// Asks for a read now instead of at the next interval.
    pub fn refresh_soon(&self) {
        self.wake.notify_one();
    }

    /// Waits until an event stamped `timestamp_ms` can be routed, and
    /// returns the table to route it with.
    pub async fn ready_for(&mut self, timestamp_ms: i64) -> Arc<RouteTable> {
        let mut warned = false;
        loop {
            let table = self.current();
            match table.readiness(timestamp_ms) {
                Readiness::Ready => return table,
                Readiness::Refresh => {
                    self.refresh_soon();
                    let _ = tokio::time::timeout(Duration::from_millis(200), self.table.changed())
                        .await;
                }
                Readiness::Wait(wait) => {
                    if !warned && wait > Duration::from_secs(1) {
                        warn!(
                            timestamp_ms,
                            wait_ms = wait.as_millis() as u64,
                            "Event stamped ahead of the clock; holding it until its time."
                        );
                        warned = true;
                    }
                    crate::infra::metrics::route_wait();
                    tokio::time::sleep(wait.min(Duration::from_millis(500))).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v(version: u32, buckets: u32, effective_ms: i64) -> Version {
        Version {
            version,
            buckets,
            effective_ms,
        }
    }

    #[test]
    fn entries_parse_and_reject_disorder() {
        assert_eq!(
            parse_entry("0:16:0;1:64:1000;3:4:2000"),
            Some(vec![v(0, 16, 0), v(1, 64, 1000), v(3, 4, 2000)])
        );
        assert_eq!(parse_entry("0:16:0;1:64:1000;1:8:2000"), None);
        assert_eq!(parse_entry("0:16:0;2:64:1000;3:8:900"), None);
        assert_eq!(parse_entry("0:0:0"), None);
        assert_eq!(parse_entry(""), None);
        assert_eq!(parse_entry("0:16"), None);
    }

    #[test]
    fn events_route_by_timestamp() {
        let table = RouteTable::new(16, 10_000, [(7, vec![v(0, 16, 0), v(1, 64, 5_000)])]);
        assert_eq!(table.route(7, 4_999).version, 0);
        assert_eq!(table.route(7, 5_000).version, 1);
        assert_eq!(table.route(7, -1).version, 0);
        assert_eq!(table.route(8, 9_000), v(0, 16, 0));
        assert_eq!(table.latest(7).buckets, 64);
        let id = table.counter(7, 42, 6_000);
        assert_eq!((id.version, id.bucket), (1, bucket_of(42, 64)));
    }

    #[test]
    fn old_reads_refresh_and_future_events_wait() {
        let table = RouteTable::new(16, 100_000, []);
        assert_eq!(table.readiness(100_000), Readiness::Ready);
        assert_eq!(table.readiness(100_000 + GRACE_MS), Readiness::Refresh);
        match table.readiness(100_000 + AHEAD_MS + 1_000) {
            Readiness::Wait(wait) => assert!(wait <= Duration::from_millis(1_000), "{wait:?}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn route_hash_fields_become_every_version() {
        let fields: Vec<(String, String)> = [
            ("v0", "16"),
            ("next", "2"),
            ("v2", "64"),
            ("v1", "8"),
            ("base", "-3"),
            ("version", "2"),
            ("mode", "hot"),
        ]
        .iter()
        .map(|&(a, b)| (a.to_string(), b.to_string()))
        .collect();
        let meta = PostMeta::from_fields(&fields, 4);
        assert_eq!(meta.versions, vec![(0, 16), (1, 8), (2, 64)]);
        assert_eq!((meta.base, meta.current), (-3, Some(2)));
        assert_eq!(meta.keys(&KeyLayout::new("t"), 5).len(), 88);
        let cold = PostMeta::from_fields(&[], 4);
        assert_eq!(cold.versions, vec![(0, 4)]);
    }

    proptest! {
        /// Invariant 1 in small: two writers whose registry reads differ
        /// (one older, one newer) route every event they may both route
        /// the same way.
        #[test]
        fn stale_and_fresh_reads_agree_where_both_may_route(
            publish_at in proptest::collection::vec(0i64..60_000, 0..6),
            stale_read in 0i64..60_000,
            fresh_delay in 0i64..30_000,
            stamps in proptest::collection::vec(0i64..120_000, 1..50),
        ) {
            // Registry history: versions published at the given registry times.
            let mut publish_at = publish_at;
            publish_at.sort_unstable();
            let mut history = vec![v(0, 16, 0)];
            for (i, &at) in publish_at.iter().enumerate() {
                let effective = (at + GRACE_MS).max(history.last().unwrap().effective_ms + 1);
                history.push(Version { version: i as u32 + 1, buckets: 2 + i as u32, effective_ms: effective });
            }
            let read_at = |clock: i64| {
                let known: Vec<Version> = history.iter().enumerate()
                    .filter(|&(i, _)| i == 0 || publish_at[i - 1] <= clock)
                    .map(|(_, v)| *v)
                    .collect();
                RouteTable::new(16, clock, [(1, known)])
            };
            let stale = read_at(stale_read);
            let fresh = read_at(stale_read + fresh_delay);
            for ts in stamps {
                if stale.readiness(ts) != Readiness::Refresh && fresh.readiness(ts) != Readiness::Refresh {
                    prop_assert_eq!(stale.route(1, ts), fresh.route(1, ts));
                }
            }
        }
    }
}
