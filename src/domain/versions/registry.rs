//! Registry: the Redis side of routing versions. Reading the registry
//! (with its clock), publishing a post's versions and the default layout's
//! epochs in the order the parent module proves safe, making routing final
//! for an event stamped ahead (and undoing that, in `steps`), and the
//! writers' background view of it all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::RedisError;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::unfreeze::{parse_unfreezing, parse_unfrozen};
use super::{
    CLOCK_FIELD, DEFAULT_FIELD, Defaults, FINAL_FIELD, GRACE_MS, Readiness, RouteTable,
    UNFREEZING_FIELD, UNFROZEN_FIELD, Version, parse_entry, read_defaults,
};
use crate::domain::routing::{DEFAULT_EPOCHS, KeyLayout};
use crate::infra::store::{Lua, ReplicaWait, Replicated, Shared};

mod steps;

pub use steps::{UnfreezeBegin, UnfreezeFinish};

// Every script starts with the ACL check (acl_check.lua); those that read the
// registry's clock then with its definition.
static FETCH: Lua = Lua::new(concat!(
    include_str!("../../infra/acl_check.lua"),
    include_str!("registry_clock.lua"),
    include_str!("route_fetch.lua")
));
static RESERVE: Lua = Lua::new(concat!(
    include_str!("../../infra/acl_check.lua"),
    include_str!("route_reserve.lua")
));
static PUBLISH: Lua = Lua::new(concat!(
    include_str!("../../infra/acl_check.lua"),
    include_str!("registry_clock.lua"),
    include_str!("route_publish.lua")
));
static REBUCKET: Lua = Lua::new(concat!(
    include_str!("../../infra/acl_check.lua"),
    include_str!("registry_clock.lua"),
    include_str!("route_default.lua")
));

/// Raising the final time further than this ahead of the registry clock is logged.
const FINAL_WARN_MS: i64 = 60_000;

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

/// Why [`Routes::publish`] published nothing.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A Redis call failed.
    #[error(transparent)]
    Redis(#[from] RedisError),
    /// The reserved version reached fewer replicas than required in time;
    /// it was not published, so no writer uses it.
    #[error(
        "{} of {} Redis replicas acknowledged the reserved routing version within {timeout_ms} ms; nothing was published (check replication, or set --registry-replicas)",
        .replicated.acked, .replicated.wanted
    )]
    NotReplicated {
        /// What the WAIT saw.
        replicated: Replicated,
        /// How long it waited.
        timeout_ms: u64,
    },
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

/// The result of [`Routes::rebucket`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rebucketed {
    /// Whether a new epoch was added (not when the newest already has the count).
    pub added: bool,
    /// The default layout after the call.
    pub defaults: Defaults,
    /// The registry clock when it was read (milliseconds since the epoch).
    pub now_ms: i64,
    /// What the replicas acknowledged of a new epoch.
    pub replicated: Option<Replicated>,
}

/// Routing metadata in Redis: reading the registry and publishing versions.
#[derive(Clone)]
pub struct Routes {
    store: Shared,
    keys: KeyLayout,
    epoch0: u32,
    wait: ReplicaWait,
}

impl Routes {
    /// Routing metadata under `keys`' prefix, on `store`; `epoch0` is version
    /// 0's bucket count, from the layout record.
    pub fn new(store: Shared, keys: KeyLayout, epoch0: u32) -> Self {
        Self {
            store,
            keys,
            epoch0,
            wait: ReplicaWait::default(),
        }
    }

    /// The same metadata, published only once `wait`'s replicas hold it.
    pub fn with_wait(self, wait: ReplicaWait) -> Self {
        Self { wait, ..self }
    }

    /// Waits for the replicas after `step`; a shortfall is logged and counted.
    async fn replicate(&self, step: &'static str) -> Result<Replicated, RedisError> {
        let replicated = self.store.replicate(self.wait).await?;
        if replicated.short() {
            crate::infra::metrics::registry_unreplicated(step);
            warn!(
                step,
                acked = replicated.acked,
                wanted = replicated.wanted,
                timeout_ms = self.wait.timeout.as_millis() as u64,
                "Routing metadata reached fewer Redis replicas than required in time; a failover now may lose it."
            );
        }
        Ok(replicated)
    }

    /// The same metadata under another generation's keys.
    pub fn with_keys(&self, keys: KeyLayout) -> Self {
        Self {
            keys,
            ..self.clone()
        }
    }

    /// Reads the registry and the registry server's clock.
    pub async fn fetch(&self) -> Result<RouteTable, RedisError> {
        self.fetch_raising(None).await
    }

    /// Makes routing final for events stamped up to `timestamp_ms` and
    /// [`GRACE_MS`] beyond (no version published from now on takes effect at
    /// or before that), and
    /// reads the registry in the same step: the table returned routes such
    /// an event for good. The event is the one at `offset` of `partition`;
    /// when an unfreeze record already fixes its route, nothing is raised.
    pub async fn finalize(
        &self,
        partition: i32,
        offset: i64,
        timestamp_ms: i64,
    ) -> Result<RouteTable, RedisError> {
        // With headroom: a producer whose clock runs a little fast then costs
        // one raise per GRACE_MS, not one per event.
        let table = self
            .fetch_raising(Some(Raise {
                to_ms: timestamp_ms.saturating_add(GRACE_MS),
                partition,
                offset,
                timestamp_ms,
            }))
            .await?;
        let ahead_ms = table.final_ms - table.fetched_ms;
        if ahead_ms > FINAL_WARN_MS {
            warn!(
                timestamp_ms,
                ahead_secs = ahead_ms / 1000,
                "Event stamped ahead of the registry clock: routing is now final up to its time, and routing versions published before then take effect only after it."
            );
        }
        Ok(table)
    }

    async fn fetch_raising(&self, raise: Option<Raise>) -> Result<RouteTable, RedisError> {
        let registry = self.keys.registry_key();
        let args: Vec<String> = raise
            .map(|r| {
                [r.to_ms, r.partition.into(), r.offset, r.timestamp_ms]
                    .map(|n| n.to_string())
                    .to_vec()
            })
            .unwrap_or_default();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // The table's final time routes for a while after this instant,
        // which precedes the registry's answer (see FINAL_TRUST).
        let sent = Instant::now();
        let reply: Vec<redis::Value> = FETCH.call(&self.store, &[&registry], &args).await?;
        let mut items = reply.into_iter();
        let now: i64 = redis::from_redis_value(items.next().unwrap_or(redis::Value::Nil))?;
        let rest: Vec<String> = items
            .map(redis::from_redis_value::<String>)
            .collect::<Result<_, _>>()?;
        let mut posts = Vec::with_capacity(rest.len() / 2);
        let mut defaults = None;
        let mut final_ms = 0;
        let mut unreadable = 0;
        let (mut unfrozen, mut unfreezing) = (None, None);
        for pair in rest.chunks_exact(2) {
            if pair[0] == DEFAULT_FIELD {
                defaults = Some(self.defaults_of(Some(&pair[1]))?);
                continue;
            }
            if pair[0] == FINAL_FIELD {
                final_ms = pair[1].parse().unwrap_or_else(|_| {
                    warn!(field = %pair[0], value = %pair[1], "Unreadable routing registry field ignored.");
                    unreadable += 1;
                    0
                });
                continue;
            }
            if pair[0] == UNFROZEN_FIELD {
                unfrozen = Some(pair[1].as_str());
                continue;
            }
            if pair[0] == UNFREEZING_FIELD {
                unfreezing = Some(pair[1].as_str());
                continue;
            }
            if pair[0] == CLOCK_FIELD {
                continue;
            }
            match (pair[0].parse::<u64>(), parse_entry(&pair[1])) {
                (Ok(post), Some(versions)) => posts.push((post, versions)),
                _ => {
                    warn!(field = %pair[0], value = %pair[1], "Unreadable routing registry entry ignored: the post's likes route, and its readers sum, by the defaults alone.");
                    unreadable += 1;
                }
            }
        }
        crate::infra::metrics::routing_unreadable(unreadable);
        let defaults = defaults.unwrap_or_else(|| Defaults::fixed(self.epoch0));
        let unfrozen = parse_unfrozen(&registry, unfrozen)?;
        let unfreezing = parse_unfreezing(&registry, unfreezing)?;
        crate::infra::metrics::routing_unfreezes(unfrozen.len());
        let table = RouteTable::new(defaults, now, posts)
            .with_final(final_ms)
            .sent_at(sent)
            .with_unfreezes(unfrozen, unfreezing)
            .with_unreadable(unreadable);
        crate::infra::metrics::routing_final_ahead(table.frozen_until_ms() - now);
        Ok(table)
    }

    fn defaults_of(&self, entry: Option<&str>) -> Result<Defaults, RedisError> {
        read_defaults(&self.keys.registry_key(), entry, self.epoch0)
    }

    /// Publishes a version of `post_id` with `buckets` buckets, in the order
    /// the module doc proves safe. `latest` is the newest version the caller
    /// knows of ([`RouteTable::latest`]); with [`Trigger::Auto`] nothing is
    /// added unless the post's newest bucket count is below `buckets`.
    pub async fn publish(
        &self,
        post_id: u64,
        buckets: u32,
        latest: Version,
        trigger: Trigger,
    ) -> Result<Published, PublishError> {
        let route = self.keys.route_key(post_id);
        // A default epoch is not one of the post's own version numbers.
        let own_latest = if latest.version > DEFAULT_EPOCHS {
            0
        } else {
            latest.version
        };
        let (version, v0): (u32, u32) = RESERVE
            .call(
                &self.store,
                &[&route],
                &[
                    &buckets.to_string(),
                    &self.epoch0.to_string(),
                    &own_latest.to_string(),
                ],
            )
            .await?;
        // A reservation a failover loses could be handed out again for other
        // buckets: publish only what the replicas hold.
        let reserved = self.replicate("reserve").await?;
        if reserved.short() {
            return Err(PublishError::NotReplicated {
                replicated: reserved,
                timeout_ms: self.wait.timeout.as_millis() as u64,
            });
        }
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
                    &latest.buckets.to_string(),
                ],
            )
            .await?;
        let versions = parse_entry(&entry).unwrap_or_default();
        let added = added == 1;
        if added {
            self.replicate("publish").await?;
        }
        let mode = if buckets > v0 { "hot" } else { "cold" };
        mark_route(&self.store, route, version, added.then_some(mode)).await?;
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

    /// Publishes a new epoch of the default layout with `buckets` buckets,
    /// effective [`GRACE_MS`] from now by the registry's clock.
    pub async fn rebucket(&self, buckets: u32) -> Result<Rebucketed, RedisError> {
        let (added, now_ms, entry): (i64, i64, String) = REBUCKET
            .call(
                &self.store,
                &[&self.keys.registry_key()],
                &[
                    DEFAULT_FIELD,
                    &self.epoch0.to_string(),
                    &buckets.to_string(),
                    &GRACE_MS.to_string(),
                ],
            )
            .await?;
        let defaults = self.defaults_of(Some(&entry))?;
        let added = added == 1;
        let replicated = if added {
            Some(self.replicate("rebucket").await?)
        } else {
            None
        };
        if added {
            let newest = defaults.latest();
            info!(
                buckets,
                epoch = newest.version - DEFAULT_EPOCHS,
                effective_ms = newest.effective_ms,
                "Default bucket count changed."
            );
        }
        Ok(Rebucketed {
            added,
            defaults,
            now_ms,
            replicated,
        })
    }
}

/// An event stamped ahead, and the time to make routing final to for it.
#[derive(Debug, Clone, Copy)]
struct Raise {
    to_ms: i64,
    partition: i32,
    offset: i64,
    timestamp_ms: i64,
}

/// Step (3) of a publication: marks the published `version` current in the
/// route hash, with its `mode`; without one (not published) drops the
/// reservation, which no writer ever used.
async fn mark_route(
    store: &Shared,
    route: String,
    version: u32,
    mode: Option<&'static str>,
) -> Result<(), RedisError> {
    store
        .call(|mut s| async move {
            match mode {
                Some(mode) => {
                    redis::pipe()
                        .hset(&route, "version", version)
                        .hset(&route, "mode", mode)
                        .query_async::<()>(&mut s)
                        .await
                }
                None => {
                    redis::cmd("HDEL")
                        .arg(&route)
                        .arg(format!("v{version}"))
                        .query_async::<()>(&mut s)
                        .await
                }
            }
        })
        .await
}

/// A writer's registry view, kept fresh by a background task.
#[derive(Clone)]
pub struct RouteWatch {
    table: watch::Receiver<Arc<RouteTable>>,
    wake: Arc<Notify>,
    routes: Routes,
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
        let mut unfreezes = first.unfreezes().len();
        let (send, table) = watch::channel(Arc::new(first));
        let wake = Arc::new(Notify::new());
        let woken = wake.clone();
        let watched = routes.clone();
        crate::infra::tasks::spawn("registry-follower", async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                    _ = woken.notified() => {}
                }
                match routes.fetch().await {
                    Ok(table) => {
                        crate::infra::metrics::routed_posts(table.routed_posts());
                        if let Some(newest) =
                            table.unfreezes()[unfreezes.min(table.unfreezes().len())..].last()
                        {
                            info!(
                                unfreezes = table.unfreezes().len(),
                                bound_ms = newest.bound_ms,
                                final_ms = table.final_ms(),
                                "Routing was unfrozen: new routing versions take effect from the registry clock again; events counted under the frozen routing keep their routes."
                            );
                        }
                        unfreezes = table.unfreezes().len();
                        if send.send(Arc::new(table)).is_err() {
                            return;
                        }
                    }
                    Err(error) => warn!(%error, "Reading the routing registry failed; retrying."),
                }
            }
        });
        Ok(Self {
            table,
            wake,
            routes: watched,
        })
    }

    /// The newest table.
    pub fn current(&self) -> Arc<RouteTable> {
        self.table.borrow().clone()
    }

    /// Asks for a read now instead of at the next interval.
    pub fn refresh_soon(&self) {
        self.wake.notify_one();
    }

    /// The table to route the event at `offset` of `partition` stamped
    /// `timestamp_ms` with. An event
    /// stamped ahead of this table's reach is never waited for: on a
    /// cluster the registry is made final up to its time first (see the
    /// module doc); on a single server, where a batch applies all or nothing
    /// under one fence, it is routed with the newest table as it is.
    pub async fn route_for(
        &mut self,
        partition: i32,
        offset: i64,
        timestamp_ms: i64,
        cluster: bool,
    ) -> Arc<RouteTable> {
        let table = self.current();
        if table.readiness_of(partition, offset, timestamp_ms) == Readiness::Ready {
            return table;
        }
        crate::infra::metrics::future_event();
        if !cluster {
            return table;
        }
        loop {
            match self.routes.finalize(partition, offset, timestamp_ms).await {
                Ok(table) => return Arc::new(table),
                Err(error) => {
                    warn!(timestamp_ms, %error, "Making routing final for an event stamped ahead failed; retrying.");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}
