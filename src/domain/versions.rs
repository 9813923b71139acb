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
//! # Events stamped ahead: routing made final, never waited for
//!
//! A writer holding a registry read from time `F` can route events stamped
//! before `F + AHEAD_MS` (invariant 1). An event stamped later, a producer
//! whose clock runs fast, would have to wait until the registry clock
//! reaches its time: a day for a clock a day fast, with its partition (and
//! the group's poll loop) stalled meanwhile. Instead:
//!
//! * On a single server nothing waits: every event of a batch lands under
//!   one fence in one script, so a batch is applied whole or not at all, and
//!   a replay, whatever routes it takes, never finds part of it applied.
//! * On a cluster the writer makes routing **final** up to the event's time:
//!   one script raises the registry's field `final` to it and reads the
//!   registry in the same step. Publications take effect after `final` as
//!   well as after `now + GRACE_MS` (route_publish.lua, route_default.lua),
//!   so no version published from then on covers the event, and the table
//!   read with the raise holds every version that does. The event's route
//!   is thereby fixed for good: on every replay and in a rebuild of the same
//!   registry it routes the same way. The price is that versions published
//!   before that time take effect only after it; how far ahead `final` lies
//!   is the gauge `tally_routing_final_ahead_seconds`, and a raise of more
//!   than a minute is logged.
//! * Events stamped past 2100 are no clock at all (a producer stamping
//!   microseconds reaches the year 55,000): they are dead-lettered as
//!   `timestamp_out_of_range`, a rule of the event alone, before routing
//!   ([`crate::pipeline::decode::MAX_TIMESTAMP_MS`]).
//!
//! Such an event may write a version sooner than `GRACE_MS - AHEAD_MS`
//! after its publication, so a reader whose two steps straddle the
//! publication can miss that one like for the length of one read; counts
//! are never wrong, and the next read has it.
//!
//! A table may route by its `final` time for [`FINAL_TRUST`] after the read
//! was sent, not longer; later, an event stamped past its read goes through
//! the registry again. That bound is what lets `tally unfreeze-routing`
//! bring `final` back to the clock (see [`crate::ops::unfreeze`] for the
//! argument): the events counted under the frozen routing keep their routes
//! by the rule of [`unfreeze`], which [`RouteTable::route_of`] applies.
//!
//! # Demotion
//!
//! A demotion is a version with fewer buckets; the old version's keys stay
//! summed. They are not folded into the base: an event stamped before the
//! demotion can still arrive later (a lagging partition, a replay of the
//! topic), and it is routed to the old version by invariant 1; nothing short
//! of every partition's fence passing the demotion time proves an old
//! version closed, and a cluster has no transaction spanning its slots.
//!
//! # Changing the default bucket count
//!
//! `tally rebucket` changes the bucket count of every post that has no
//! version of its own, without re-routing a single key. The default layout
//! has epochs, kept in the registry's field `default` in the entry format
//! above (`0:16:0;1:1:T1;...`, epoch numbers in place of versions). Epoch 0
//! is version 0, with the layout record's bucket count; epoch `e >= 1` has
//! keys of its own (`d<e>`, version number [`DEFAULT_EPOCHS`]` + e`). An
//! epoch is published as one registry write, with `effective_ms = registry
//! clock + GRACE_MS`, the same way as a post's version.
//!
//! The route of an event of a post stamped `t`: the post's own newest version
//! effective at or before `t`, if it has one; otherwise the newest epoch
//! effective at or before `t`. A hot post keeps its own buckets through a
//! change of the default. Both lists only grow and every item is effective
//! only after its publication plus the grace, so invariant 1 holds for the
//! pair as it holds for one list: an addition changes the route of events
//! stamped after its effective time only, which no writer routes before
//! reading it. Replays and rebuilds route every event as the first pass
//! did, and since an epoch's bucket `b` lies in the same slot group as
//! version 0's bucket `b`, the fences that cover an event do not depend on
//! its epoch.
//!
//! Invariant 2 needs no reservation step here: readers read the `default`
//! field itself, in the first round trip of every read, so a read that began
//! before a publication ends (within [`READ_DEADLINE`]) before the first
//! write to the new epoch can land, `GRACE_MS - AHEAD_MS` after it. Readers
//! sum every epoch for every post; old epochs are never folded, for the
//! reason demotions are not. Slot groups cannot change this way: a fence
//! covers a fixed set of slot groups, so another count is a rebuild into a
//! new prefix.
//!
//! # Failovers
//!
//! The argument above holds for one primary. Redis replicates
//! asynchronously, so a failover may lose the last writes to the registry
//! and the route hashes. Three guards keep a lost write from moving an
//! event's route or hiding a key:
//!
//! * The registry's clock never goes back (`registry_clock.lua` keeps the
//!   highest time handed out in the field `clock`), so a replica promoted with
//!   a slower clock cannot publish a version effective before one already
//!   read.
//! * Each step waits for `--registry-replicas` replicas (`WAIT`, see
//!   [`crate::infra::store::Shared::replicate`]): a reservation the replicas
//!   did not take in time is not published, since a failover could hand its
//!   number out again; a publication or epoch they did not take is counted
//!   (`tally_registry_unreplicated_total`), logged and alerted on.
//! * Readers take a post's versions from its registry entry as well as from
//!   its route hash, so losing one of the two hides no version that writers
//!   used.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::RedisError;
use rustc_hash::FxHashMap;

use crate::domain::routing::{
    CounterId, DEFAULT_EPOCHS, KeyLayout, Place, bucket_of, epoch_version,
};

mod registry;
pub mod unfreeze;

pub use registry::{
    PublishError, Published, Rebucketed, RouteWatch, Routes, Trigger, UnfreezeBegin, UnfreezeFinish,
};
use unfreeze::{Unfreezes, Unfreezing};

/// A new version routes events stamped this long after its publication.
pub const GRACE_MS: i64 = 5_000;
/// Writers hold an event stamped further than this ahead of the registry clock.
pub const AHEAD_MS: i64 = 500;
/// A read of a post's route hash and counters must finish within this.
pub const READ_DEADLINE: Duration = Duration::from_secs(2);

/// The registry field that holds the default layout's epochs.
pub const DEFAULT_FIELD: &str = "default";
/// The registry field up to which routing is final (milliseconds since the epoch).
pub const FINAL_FIELD: &str = "final";
/// The registry field holding the highest clock it has answered with.
pub const CLOCK_FIELD: &str = "clock";
/// The registry field of an unfreeze under way (see [`unfreeze`]).
pub const UNFREEZING_FIELD: &str = "unfreezing";
/// The registry field recording every finished unfreeze (see [`unfreeze`]).
pub const UNFROZEN_FIELD: &str = "unfrozen";
/// How long after its read was sent a table may route events stamped past
/// the read by the registry's `final` time.
pub const FINAL_TRUST: Duration = Duration::from_secs(5);
/// Routing final further ahead of the registry clock than this is frozen:
/// `tally promote`, `demote` and `rebucket` refuse, and the alert
/// `TallyRoutingFrozen` fires.
pub const FROZEN_AHEAD_MS: i64 = 600_000;

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

/// The epochs of the default layout, oldest first: what a post without
/// versions of its own is routed by. Epoch `e` carries version number
/// [`epoch_version`]`(e)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Defaults(Box<[Version]>);

impl Defaults {
    /// Epoch 0 alone: `buckets` for every event.
    pub fn fixed(buckets: u32) -> Self {
        Self(Box::new([Version {
            version: 0,
            buckets,
            effective_ms: 0,
        }]))
    }

    /// The registry's `default` field (`None`: never changed), given epoch
    /// 0's bucket count from the layout record. `None` for an entry that
    /// does not start at epoch 0 with that count.
    pub fn parse(entry: Option<&str>, epoch0: u32) -> Option<Self> {
        let Some(entry) = entry else {
            return Some(Self::fixed(epoch0));
        };
        let epochs = parse_entry(entry)?;
        let first = epochs[0];
        if first.version != 0
            || first.buckets != epoch0
            || epochs.iter().any(|e| e.version >= DEFAULT_EPOCHS)
        {
            return None;
        }
        Some(Self(
            epochs
                .into_iter()
                .map(|e| Version {
                    version: epoch_version(e.version),
                    ..e
                })
                .collect(),
        ))
    }

    /// The epoch an event stamped `timestamp_ms` goes to.
    pub fn at(&self, timestamp_ms: i64) -> Version {
        *self
            .0
            .iter()
            .rev()
            .find(|e| e.effective_ms <= timestamp_ms)
            .unwrap_or(&self.0[0])
    }

    /// The newest epoch.
    pub fn latest(&self) -> Version {
        self.0[self.0.len() - 1]
    }

    /// Every epoch, oldest first.
    pub fn epochs(&self) -> &[Version] {
        &self.0
    }

    /// Epoch 0's bucket count (the layout record's).
    pub fn epoch0(&self) -> u32 {
        self.0[0].buckets
    }
}

/// The default layout from the `default` field of `registry` (`entry`). An
/// entry that cannot be read is an error for writers and readers alike:
/// routing or summing by a guess could miss keys.
pub fn read_defaults(
    registry: &str,
    entry: Option<&str>,
    epoch0: u32,
) -> Result<Defaults, RedisError> {
    Defaults::parse(entry, epoch0).ok_or_else(|| {
        RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "unreadable default layout",
            format!(
                "field {DEFAULT_FIELD} of {registry} is {entry:?}; it must start with epoch 0 at the layout record's {epoch0} buckets"
            ),
        ))
    })
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
    defaults: Defaults,
    posts: FxHashMap<u64, Box<[Version]>>,
    /// Registry clock at the read (milliseconds since the epoch).
    fetched_ms: i64,
    fetched_at: Instant,
    /// Routing is final for events stamped up to this time (the registry's
    /// `final` field; see the module doc).
    final_ms: i64,
    /// Until when `final_ms` may route (the read's sending plus [`FINAL_TRUST`]).
    final_trusted_until: Instant,
    /// Every finished unfreeze, oldest first.
    unfreezes: Unfreezes,
    /// An unfreeze under way.
    unfreezing: Option<Unfreezing>,
    /// Fields of the registry this read could not parse.
    unreadable: usize,
}

impl RouteTable {
    /// A table read at registry time `fetched_ms`.
    pub fn new(
        defaults: Defaults,
        fetched_ms: i64,
        posts: impl IntoIterator<Item = (u64, Vec<Version>)>,
    ) -> Self {
        Self {
            defaults,
            posts: posts
                .into_iter()
                .map(|(post, versions)| (post, versions.into_boxed_slice()))
                .collect(),
            fetched_ms,
            fetched_at: Instant::now(),
            final_ms: 0,
            final_trusted_until: Instant::now() + FINAL_TRUST,
            unfreezes: Box::default(),
            unfreezing: None,
            unreadable: 0,
        }
    }

    /// The same table, read from a registry with `fields` fields it could
    /// not parse (their posts route by the defaults).
    pub fn with_unreadable(self, fields: usize) -> Self {
        Self {
            unreadable: fields,
            ..self
        }
    }

    /// Fields of the registry this table was read from that it could not
    /// parse: each a post whose versions are unknown, so its likes route,
    /// and its readers sum, by the defaults alone.
    pub fn unreadable(&self) -> usize {
        self.unreadable
    }

    /// The same table, final for events stamped up to `final_ms`.
    pub fn with_final(self, final_ms: i64) -> Self {
        Self { final_ms, ..self }
    }

    /// The same table, read by a call sent at `sent`: its final time routes
    /// until [`FINAL_TRUST`] after that.
    pub fn sent_at(self, sent: Instant) -> Self {
        Self {
            final_trusted_until: sent + FINAL_TRUST,
            ..self
        }
    }

    /// The same table with the registry's unfreezes: finished, and under way.
    pub fn with_unfreezes(self, unfreezes: Unfreezes, unfreezing: Option<Unfreezing>) -> Self {
        Self {
            unfreezes,
            unfreezing,
            ..self
        }
    }

    /// Up to when routing is final (0: never raised).
    pub fn final_ms(&self) -> i64 {
        self.final_ms
    }

    /// The time after which a version published now would take effect, at
    /// the earliest: the final time, or the one an unfreeze under way undoes.
    pub fn frozen_until_ms(&self) -> i64 {
        self.unfreezing
            .map_or(self.final_ms, |u| u.undone_ms.max(self.final_ms))
    }

    /// Whether routing is frozen: a version published now would take effect
    /// more than [`FROZEN_AHEAD_MS`] from now.
    pub fn frozen(&self) -> bool {
        self.frozen_until_ms() - self.now_ms() > FROZEN_AHEAD_MS
    }

    /// Finished unfreezes, oldest first.
    pub fn unfreezes(&self) -> &[unfreeze::Unfreeze] {
        &self.unfreezes
    }

    /// The event at `offset` of `partition` stamped `timestamp_ms` goes to
    /// this version of `post_id`: by the unfreeze record that fixes its
    /// route, if one does (see [`unfreeze`]), otherwise as [`Self::route`].
    pub fn route_of(
        &self,
        partition: i32,
        offset: i64,
        post_id: u64,
        timestamp_ms: i64,
    ) -> Version {
        match self
            .unfreezes
            .iter()
            .find(|u| u.covers(partition, offset, timestamp_ms))
        {
            Some(u) => self.route_as_unfrozen(u, post_id, timestamp_ms),
            None => self.route(post_id, timestamp_ms),
        }
    }

    /// The route by the registry as it stood when `u` was written: what took
    /// effect at or before its bound has not changed since, and what took
    /// effect after it then is listed in `u` with its time of then.
    fn route_as_unfrozen(
        &self,
        u: &unfreeze::Unfreeze,
        post_id: u64,
        timestamp_ms: i64,
    ) -> Version {
        let then = |now: &[Version], moved: &[Version]| {
            now.iter()
                .filter(|v| v.effective_ms <= u.bound_ms)
                .chain(moved)
                .filter(|v| v.effective_ms <= timestamp_ms)
                .max_by_key(|v| v.effective_ms)
                .copied()
        };
        let own = self.posts.get(&post_id).map_or(&[][..], |v| &v[..]);
        let moved = u.posts.get(&post_id).map_or(&[][..], Vec::as_slice);
        then(own, moved)
            .filter(|v| v.version > 0)
            .or_else(|| then(self.defaults.epochs(), &u.defaults))
            .unwrap_or(self.defaults.epochs()[0])
    }

    /// The counter a like of `post_id` by `user_id` at `offset` of
    /// `partition`, stamped `timestamp_ms`, lands in.
    pub fn counter_of(
        &self,
        partition: i32,
        offset: i64,
        post_id: u64,
        user_id: u64,
        timestamp_ms: i64,
    ) -> CounterId {
        let v = self.route_of(partition, offset, post_id, timestamp_ms);
        CounterId {
            post_id,
            version: v.version,
            bucket: bucket_of(user_id, v.buckets),
        }
    }

    /// Whether the event at `offset` of `partition` stamped `timestamp_ms`
    /// can be routed with this table: always when an unfreeze record fixes
    /// its route, otherwise as [`Self::readiness`] says.
    pub fn readiness_of(&self, partition: i32, offset: i64, timestamp_ms: i64) -> Readiness {
        if self
            .unfreezes
            .iter()
            .any(|u| u.covers(partition, offset, timestamp_ms))
        {
            return Readiness::Ready;
        }
        self.readiness(timestamp_ms)
    }

    /// The version an event of `post_id` stamped `timestamp_ms` goes to: the
    /// post's own newest version by then, or else the default layout's epoch.
    pub fn route(&self, post_id: u64, timestamp_ms: i64) -> Version {
        self.posts
            .get(&post_id)
            .and_then(|versions| {
                versions
                    .iter()
                    .rev()
                    .find(|v| v.version > 0 && v.effective_ms <= timestamp_ms)
            })
            .copied()
            .unwrap_or_else(|| self.defaults.at(timestamp_ms))
    }

    /// The default layout's epochs.
    pub fn defaults(&self) -> &Defaults {
        &self.defaults
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

    /// The newest version of a post (the newest default epoch when it has
    /// no version of its own).
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
        if timestamp_ms <= self.final_ms && Instant::now() < self.final_trusted_until {
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
    /// Reads a route hash's fields (`HGETALL`) and adds the default layout's
    /// later epochs; epoch 0 stands for version 0 when the hash has no `v0`
    /// (a post never routed). A `base` that holds no integer is refused with
    /// the hash `key` named: it is part of the count, and a count read
    /// without it would be wrong.
    pub fn from_fields(
        key: &str,
        fields: &[(String, String)],
        defaults: &Defaults,
    ) -> Result<Self, RedisError> {
        let mut meta = PostMeta::default();
        // A field tally writes that holds what tally never writes there: the
        // post's buckets (or where they start) cannot be known, so its count
        // is not read rather than read short.
        let stray = |field: &str, value: &str, what: &str| {
            crate::infra::store::stray_value(format!(
                "{key} field {field} holds {value:?}, which is not {what} and not a value tally writes; the post's count cannot be read: set it back from a backup, or recount with `tally rebuild`"
            ))
        };
        for (field, value) in fields {
            match field.as_str() {
                "base" => meta.base = value.parse().map_err(|_| stray(field, value, "a count"))?,
                "version" => {
                    meta.current = Some(
                        value
                            .parse()
                            .map_err(|_| stray(field, value, "a version"))?,
                    )
                }
                "mode" => meta.mode = Some(value.clone()),
                _ => {
                    if let Some(version) = field.strip_prefix('v').and_then(|v| v.parse().ok()) {
                        match value.parse::<u32>() {
                            Ok(buckets) if buckets > 0 => meta.versions.push((version, buckets)),
                            _ => return Err(stray(field, value, "a number of buckets")),
                        }
                    }
                }
            }
        }
        meta.versions.retain(|&(v, _)| v <= DEFAULT_EPOCHS);
        if !meta.versions.iter().any(|&(v, _)| v == 0) {
            meta.versions.push((0, defaults.epoch0()));
        }
        meta.versions.extend(
            defaults.epochs()[1..]
                .iter()
                .map(|e| (e.version, e.buckets)),
        );
        meta.versions.sort_unstable();
        Ok(meta)
    }

    /// Adds the versions of the post's registry entry (`entry`, as the
    /// writers read it) that the route hash lacks: a failover may lose the
    /// hash's copy of a version while the registry kept its own.
    pub fn with_entry(mut self, entry: Option<&str>) -> Self {
        for v in entry.and_then(parse_entry).unwrap_or_default() {
            if v.version > 0 && !self.versions.iter().any(|&(k, _)| k == v.version) {
                self.versions.push((v.version, v.buckets));
            }
        }
        self.versions.sort_unstable();
        self
    }

    /// Every counter key of the post, as [`Place::shown`] names it.
    pub fn keys(&self, layout: &KeyLayout, post_id: u64) -> Vec<String> {
        self.places(layout, post_id)
            .iter()
            .map(Place::shown)
            .collect()
    }

    /// Where every counter of the post is kept, in a layout whose places
    /// never move (a growing one's are addressed by its split states, see
    /// [`crate::read`]).
    pub fn places(&self, layout: &KeyLayout, post_id: u64) -> Vec<Place> {
        self.counters(post_id)
            .map(|id| layout.place_of(id))
            .collect()
    }

    /// Every counter of the post, version by version.
    pub fn counters(&self, post_id: u64) -> impl Iterator<Item = CounterId> + '_ {
        self.versions.iter().flat_map(move |&(version, buckets)| {
            (0..buckets).map(move |bucket| CounterId {
                post_id,
                version,
                bucket,
            })
        })
    }
}

/// Milliseconds since the epoch by this machine's clock.
pub fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// `ms` since the epoch as a UTC time, `2099-01-01T00:00:05Z`.
pub fn utc_text(ms: i64) -> String {
    let (days, secs) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000) / 1000);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
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
        let table = RouteTable::new(
            Defaults::fixed(16),
            10_000,
            [(7, vec![v(0, 16, 0), v(1, 64, 5_000)])],
        );
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
        let table = RouteTable::new(Defaults::fixed(16), 100_000, []);
        assert_eq!(table.readiness(100_000), Readiness::Ready);
        assert_eq!(table.readiness(100_000 + GRACE_MS), Readiness::Refresh);
        match table.readiness(100_000 + AHEAD_MS + 1_000) {
            Readiness::Wait(wait) => assert!(wait <= Duration::from_millis(1_000), "{wait:?}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_final_registry_routes_events_stamped_up_to_its_time() {
        let table = RouteTable::new(Defaults::fixed(16), 100_000, []);
        assert_eq!(table.readiness(100_000 + 86_400_000), Readiness::Refresh);
        let finalized = table.with_final(100_000 + 86_400_000);
        assert_eq!(finalized.readiness(100_000 + 86_400_000), Readiness::Ready);
        assert_eq!(
            finalized.readiness(100_000 + 86_400_001),
            Readiness::Refresh
        );
    }

    #[test]
    fn a_final_time_routes_only_for_a_while_after_its_read() {
        let day = 86_400_000;
        let sent = Instant::now() - FINAL_TRUST - Duration::from_millis(10);
        let stale = RouteTable::new(Defaults::fixed(16), 100_000, [])
            .with_final(100_000 + day)
            .sent_at(sent);
        assert_eq!(stale.readiness(100_000 + day), Readiness::Refresh);
        assert_eq!(stale.readiness(100_000), Readiness::Ready);
        // Publications still take effect after it: that is the registry's, not the table's.
        assert!(stale.frozen());
    }

    #[test]
    fn times_print_as_utc() {
        assert_eq!(utc_text(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_text(4_083_955_205_000), "2099-06-01T00:00:05Z");
        assert_eq!(utc_text(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc_text(-1_000), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn a_base_that_is_not_a_count_is_refused_with_its_key() {
        let fields = vec![
            ("v0".to_string(), "4".to_string()),
            ("base".to_string(), "ten".to_string()),
        ];
        let error = PostMeta::from_fields("t:route:5", &fields, &Defaults::fixed(4)).unwrap_err();
        let detail = crate::infra::store::stray_detail(&error).expect("a stray value");
        assert!(
            detail.starts_with("t:route:5 field base holds \"ten\""),
            "{detail}"
        );
        for (field, value) in [("v1", "eight"), ("v1", "0"), ("version", "x")] {
            let fields = [(field.to_string(), value.to_string())];
            let error = PostMeta::from_fields("t:route:5", &fields, &Defaults::fixed(4))
                .expect_err("a version field holding no number");
            let detail = crate::infra::store::stray_detail(&error).expect("a stray value");
            assert!(
                detail.starts_with(&format!("t:route:5 field {field} holds {value:?}")),
                "{detail}"
            );
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
        let meta = PostMeta::from_fields("t:route:5", &fields, &Defaults::fixed(4)).unwrap();
        assert_eq!(meta.versions, vec![(0, 16), (1, 8), (2, 64)]);
        assert_eq!((meta.base, meta.current), (-3, Some(2)));
        assert_eq!(meta.keys(&KeyLayout::new("t"), 5).len(), 88);
        let cold = PostMeta::from_fields("t:route:5", &[], &Defaults::fixed(4)).unwrap();
        assert_eq!(cold.versions, vec![(0, 4)]);
        // A version the route hash lost is still summed from the registry.
        let lost = PostMeta::from_fields("t:route:5", &[], &Defaults::fixed(4))
            .unwrap()
            .with_entry(Some("0:4:0;1:64:900"));
        assert_eq!(lost.versions, vec![(0, 4), (1, 64)]);
        assert_eq!(
            meta.clone().with_entry(Some("0:16:0;2:64:9")).versions,
            meta.versions
        );
        // Every epoch of the default layout is summed, for every post.
        let defaults = Defaults::parse(Some("0:4:0;1:1:100;2:8:200"), 4).unwrap();
        let rebucketed = PostMeta::from_fields("t:route:5", &fields, &defaults).unwrap();
        assert_eq!(
            rebucketed.versions,
            vec![
                (0, 16),
                (1, 8),
                (2, 64),
                (epoch_version(1), 1),
                (epoch_version(2), 8)
            ]
        );
        let keys = PostMeta::from_fields("t:route:5", &[], &defaults)
            .unwrap()
            .keys(&KeyLayout::new("t"), 5);
        assert_eq!(keys.len(), 13);
        assert!(keys.contains(&"t:likes:5:d1:b0".to_string()), "{keys:?}");
    }

    #[test]
    fn default_epochs_route_posts_without_versions_of_their_own() {
        let defaults = Defaults::parse(Some("0:16:0;1:1:5000;2:16:9000"), 16).unwrap();
        let hot = vec![v(0, 16, 0), v(1, 64, 7_000)];
        let table = RouteTable::new(defaults, 10_000, [(7, hot)]);
        assert_eq!(table.route(8, 4_999), v(0, 16, 0));
        assert_eq!(table.route(8, 5_000), v(epoch_version(1), 1, 5_000));
        assert_eq!(table.route(8, 9_000), v(epoch_version(2), 16, 9_000));
        // A promoted post follows the default until its own version, then
        // keeps its own buckets through later changes of the default.
        assert_eq!(table.route(7, 6_000).version, epoch_version(1));
        assert_eq!(table.route(7, 7_000).version, 1);
        assert_eq!(table.route(7, 9_500).version, 1);
        assert_eq!(table.latest(8).buckets, 16);
        let id = table.counter(8, 42, 6_000);
        assert_eq!((id.version, id.bucket), (epoch_version(1), 0));
    }

    #[test]
    fn default_entries_must_start_at_the_records_count() {
        assert_eq!(Defaults::parse(None, 16), Some(Defaults::fixed(16)));
        assert_eq!(Defaults::parse(Some("0:8:0;1:1:5"), 16), None);
        assert_eq!(Defaults::parse(Some("1:8:0"), 8), None);
        assert_eq!(Defaults::parse(Some("garbage"), 8), None);
        let parsed = Defaults::parse(Some("0:8:0;1:1:5"), 8).unwrap();
        assert_eq!(parsed.latest(), v(epoch_version(1), 1, 5));
        assert_eq!(parsed.epoch0(), 8);
    }

    proptest! {
        /// Invariant 1 in small: two writers whose registry reads differ
        /// (one older, one newer) route every event they may both route
        /// the same way.
        #[test]
        fn stale_and_fresh_reads_agree_where_both_may_route(
            publish_at in proptest::collection::vec(0i64..60_000, 0..6),
            rebucket_at in proptest::collection::vec(0i64..60_000, 0..4),
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
            // And epochs of the default layout, published the same way.
            let mut rebucket_at = rebucket_at;
            rebucket_at.sort_unstable();
            let mut epochs = vec![v(0, 16, 0)];
            for (e, &at) in rebucket_at.iter().enumerate() {
                let effective = (at + GRACE_MS).max(epochs.last().unwrap().effective_ms + 1);
                epochs.push(v(e as u32 + 1, [1, 16, 4, 32][e % 4], effective));
            }
            let read_at = |clock: i64| {
                let known: Vec<Version> = history.iter().enumerate()
                    .filter(|&(i, _)| i == 0 || publish_at[i - 1] <= clock)
                    .map(|(_, v)| *v)
                    .collect();
                let entry: Vec<String> = epochs.iter().enumerate()
                    .filter(|&(e, _)| e == 0 || rebucket_at[e - 1] <= clock)
                    .map(|(_, e)| format!("{}:{}:{}", e.version, e.buckets, e.effective_ms))
                    .collect();
                let defaults = Defaults::parse(Some(&entry.join(";")), 16).unwrap();
                RouteTable::new(defaults, clock, [(1, known)])
            };
            let stale = read_at(stale_read);
            let fresh = read_at(stale_read + fresh_delay);
            for ts in stamps {
                if stale.readiness(ts) != Readiness::Refresh && fresh.readiness(ts) != Readiness::Refresh {
                    prop_assert_eq!(stale.route(1, ts), fresh.route(1, ts));
                    prop_assert_eq!(stale.route(2, ts), fresh.route(2, ts));
                }
            }
        }
    }
}
