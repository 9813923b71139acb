//! Apply: run each slot group's share of a batch through `apply.lua` behind
//! that group's fence.
//!
//! # Why every event is counted exactly once
//!
//! Kafka gives each partition a fixed, ordered log. Tally turns a contiguous
//! range of that log into net deltas per counter, splits them by slot group
//! (one group on a single server, `G` on a cluster; see [`crate::domain::slots`]), and
//! hands each group's share to one Lua script that, atomically, compares the
//! claimed range with the group's fence (the last offset already applied for
//! that group), adds the deltas only when the range begins right after the
//! fence, and moves the fence to the end of the range. Check and writes are one
//! atomic step in one slot, so Redis never holds counts without the fence that
//! covers them, nor a fence without its counts; a restart from an AOF or a
//! failover to a lagging replica rolls both back together.
//!
//! Everything else is a consequence. A retry after a timeout finds the fence at
//! the end of its range and does nothing. A zombie consumer's stale batch finds
//! the fence at or past its range and does nothing. Two consumers that cut the
//! log differently meet a straddle and the late one re-reads. A consumer killed
//! between the scripts of one batch leaves some groups ahead of others; the
//! next owner reads every group's fence, starts reading at the lowest, and
//! gives each group only the events above its own fence.
//!
//! # Knowing every group a partition has written
//!
//! The slot groups are a fixed, numbered set, so there is nothing to discover:
//! on assignment the consumer reads the fence of every group. A group whose
//! fence key is absent, because it never received a script or because its
//! primary lost the key, stands at the partition's *origin* minus one, the
//! origin being the first offset tally ever counted for the partition, written
//! once before the first batch. So a primary that loses recent writes can only
//! move fences back, never forward, and the consumer replays from the lowest
//! one. Groups without events are advanced with empty scripts now and then, so
//! the lowest fence, and thus the replay after a restart, stays recent.
//!
//! Kafka's committed offset is written only after every script of a batch
//! succeeded and is never trusted over the fences: it is where to look when
//! the fences cannot be read, and the lag signal. The decision table and the
//! consumer's bookkeeping are [`crate::domain::fence`].

use std::time::Duration;

use redis::{Cmd, RedisError};
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::domain::fence::{Decision, PartitionFences, Reply};
use crate::domain::packing::{SplitCache, Splits};
use crate::domain::routing::{CounterId, KeyLayout};
use crate::domain::windows;
use crate::infra::retry::{GaveUp, RedisFailure, classify_redis, retry_redis};
use crate::infra::store::{Shared, Target, connect_blocking};
use crate::pipeline::aggregate::WindowCell;

/// The script, with its header comment documenting KEYS, ARGV and replies,
/// after the functions it calls: the ACL check (acl_check.lua), the fence
/// check (apply_fence.lua) and the window section (windows.lua).
pub const APPLY_LUA: &str = concat!(
    include_str!("../infra/acl_check.lua"),
    include_str!("apply_fence.lua"),
    include_str!("windows.lua"),
    include_str!("apply.lua")
);

/// The script of a packed generation (see [`crate::domain::packing`]): the
/// same fence and decisions, its counters fields of hashes, which split as
/// they fill when the generation's hashes grow (field_hash.lua places a
/// field as [`crate::domain::packing::field_hash`] does).
pub const APPLY_PACKED_LUA: &str = concat!(
    include_str!("../infra/acl_check.lua"),
    include_str!("apply_fence.lua"),
    include_str!("windows.lua"),
    include_str!("field_hash.lua"),
    include_str!("apply_packed.lua")
);

/// The script a generation kept as `keys` says is applied with.
pub fn script_text(keys: &KeyLayout) -> &'static str {
    match keys.is_packed() {
        true => APPLY_PACKED_LUA,
        false => APPLY_LUA,
    }
}

/// A refusal that comes from the server's state and not from a key: at
/// `maxmemory` (OOM), unable to persist (MISCONF), demoted to a replica
/// (READONLY), Redis refuses a script's first write, and no write after it,
/// so nothing was written. Returned as the error the call would have
/// failed with, which is retried; `None` for a key's own refusal (a value
/// that is not an integer, another type, an overflow).
fn server_refusal(error: &str) -> Option<RedisError> {
    let reply = redis::parse_redis_value(format!("-{error}\r\n").as_bytes()).ok()?;
    let refused = reply.extract_error().err()?;
    (classify_redis(&refused) == RedisFailure::Transient).then_some(refused)
}

/// The script's code for a counter key INCRBY refused (beyond the decision table).
const REFUSED: i64 = 4;
/// The packed script's code for a call addressed with a split state older
/// than a hash it names: nothing written, address again.
const RESPLIT: i64 = 5;
/// The resplit answers one call takes before it is an error: each comes
/// with the state stored, so only splits made by other calls in between
/// bring another.
const MAX_RESPLITS: usize = 1000;

/// Errors that end an apply.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// Redis refused in a way no retry fixes; an operator must act.
    #[error("Redis refused the batch: {0}")]
    Fatal(#[source] RedisError),
    /// The script answered something it never answers.
    #[error("unexpected reply from apply.lua: {0}")]
    BadReply(String),
    /// A counter key holds a value INCRBY refuses; nothing of the batch was written.
    #[error(
        "counter key {key} holds a value Redis cannot add to ({error}); this batch (offsets {start}..={last}) was not applied and nothing was written: fix or delete the key (GET/TYPE it, HGET the field of a packed hash; a value tally did not write), then restart"
    )]
    BadKey {
        /// The key, followed by the field when packed.
        key: String,
        /// Redis's error.
        error: String,
        /// First offset of the refused range.
        start: i64,
        /// Last offset of the refused range.
        last: i64,
    },
    /// Shutdown came first; the batch was not confirmed (safe: nothing is committed).
    #[error("cancelled by shutdown")]
    Cancelled,
}

impl From<GaveUp> for ApplyError {
    fn from(gave_up: GaveUp) -> Self {
        match gave_up {
            GaveUp::Fatal(error) => ApplyError::Fatal(error),
            GaveUp::Cancelled => ApplyError::Cancelled,
        }
    }
}

/// One slot group's share of a batch, ready to send.
#[derive(Debug)]
pub struct Prepared {
    /// Partition the batch belongs to.
    pub partition: i32,
    /// The slot group.
    pub group: u32,
    /// First offset claimed.
    pub start: i64,
    /// Last offset claimed.
    pub last: i64,
    /// Fence assumed when the group's fence key is absent (origin - 1).
    pub absent_fence: i64,
    /// Net deltas of the group's counters.
    pub deltas: Vec<(CounterId, i64)>,
    /// Net deltas of the posts whose windows the group keeps, in window order.
    pub windows: Vec<(WindowCell, i64)>,
}

impl Prepared {
    /// Number of writes the script performs when it applies: counter
    /// increments and window increments.
    pub fn increments(&self) -> usize {
        self.deltas.len() + self.windows.len()
    }

    /// The window deltas, one run per window set.
    fn window_sets(&self) -> impl Iterator<Item = &[(WindowCell, i64)]> {
        self.windows
            .chunk_by(|a, b| (a.0.size, a.0.start) == (b.0.size, b.0.start))
    }
}

/// How many counter keys a call names: one per counter, or one per hash
/// when packed.
fn counter_keys(keys: &KeyLayout, prepared: &Prepared, splits: Splits) -> usize {
    match keys.is_packed() {
        false => prepared.deltas.len(),
        true => hash_order(keys, prepared, splits)
            .chunk_by(|a, b| a.0 == b.0)
            .count(),
    }
}

/// The number of the hash each counter of a packed call lives in, with
/// the counter's index, in hash order.
fn hash_order(keys: &KeyLayout, prepared: &Prepared, splits: Splits) -> Vec<(u32, usize)> {
    let mut field = String::with_capacity(32);
    let mut order: Vec<(u32, usize)> = prepared
        .deltas
        .iter()
        .enumerate()
        .map(|(i, (id, _))| (keys.hash_number(*id, splits, &mut field), i))
        .collect();
    order.sort_unstable();
    order
}

/// Writes the key of the counts (or, with `leaders`, of the leaders) of the
/// window a run of window deltas goes to.
fn write_set_key(
    out: &mut String,
    keys: &KeyLayout,
    group: u32,
    set: &[(WindowCell, i64)],
    leaders: bool,
) {
    let cell = set[0].0;
    let size = keys.windows().sizes()[usize::from(cell.size)];
    match leaders {
        false => keys.write_window_key(out, size, cell.start, group),
        true => keys.write_leaders_key(out, size, cell.start, group),
    }
}

/// Names each window's counts and leaders, in the order of its deltas.
fn window_key_arguments(cmd: &mut Cmd, key: &mut String, keys: &KeyLayout, prepared: &Prepared) {
    for set in prepared.window_sets() {
        for leaders in [false, true] {
            write_set_key(key, keys, prepared.group, set, leaders);
            cmd.arg(key.as_str());
        }
    }
}

/// The window section's arguments: for each set, its expiry and its
/// members in runs of one delta (`delta`, `n`, then the `n` members). Any
/// order is right; a set sorted by delta (as batches close) makes the
/// fewest runs, and most window deltas of a batch are +1.
fn window_arguments(cmd: &mut Cmd, keys: &KeyLayout, prepared: &Prepared) {
    let rules = keys.windows();
    for set in prepared.window_sets() {
        let cell = set[0].0;
        let size = rules.sizes()[usize::from(cell.size)];
        let runs = set.chunk_by(|a, b| a.1 == b.1);
        cmd.arg(rules.expires_at(size, cell.start))
            .arg(runs.clone().count());
        for run in runs {
            cmd.arg(run[0].1).arg(run.len());
            for &(cell, _) in run {
                cmd.arg(&windows::member(cell.post_id)[..]);
            }
        }
    }
}

/// How a script call names its script.
#[derive(Debug, Clone, Copy)]
pub enum ScriptBody<'a> {
    /// `EVALSHA` with this hash, the normal case.
    ByHash(&'a str),
    /// `EVAL` with the full text, after a NOSCRIPT (it also caches the script
    /// on that server).
    Full,
}

/// The call of `apply.lua` for one slot group's share of a batch. Keys are
/// written into one reused buffer and copied straight into the command's
/// argument buffer.
///
/// `splits` is the split state of the group the caller last saw, when the
/// generation's hashes grow (ignored otherwise): the script refuses the call
/// when a hash it names was split since (see [`Applier::apply_once`]).
pub fn script_call(
    body: ScriptBody<'_>,
    keys: &KeyLayout,
    fence_key: &str,
    prepared: &Prepared,
    splits: Splits,
) -> Cmd {
    let mut cmd = match body {
        ScriptBody::ByHash(sha) => {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(sha);
            cmd
        }
        ScriptBody::Full => {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(script_text(keys));
            cmd
        }
    };
    if keys.is_packed() {
        packed_arguments(&mut cmd, keys, fence_key, prepared, splits);
        return cmd;
    }
    let sets = prepared.window_sets().count();
    cmd.arg(prepared.deltas.len() + 1 + 2 * sets).arg(fence_key);
    let mut key = String::with_capacity(64);
    for (id, _) in &prepared.deltas {
        keys.write_counter_key(&mut key, *id, Splits::default());
        cmd.arg(key.as_str());
    }
    window_key_arguments(&mut cmd, &mut key, keys, prepared);
    cmd.arg(prepared.start)
        .arg(prepared.last)
        .arg(prepared.absent_fence)
        .arg(sets);
    for (delta, n) in runs(&prepared.deltas) {
        cmd.arg(delta).arg(n);
    }
    window_arguments(&mut cmd, keys, prepared);
    cmd
}

/// The arguments of `apply_packed.lua`: the hashes in the order of their
/// number, each with its number and its (field, delta) pairs; for a growing
/// generation, after the split state they were addressed with.
fn packed_arguments(
    cmd: &mut Cmd,
    keys: &KeyLayout,
    fence_key: &str,
    prepared: &Prepared,
    splits: Splits,
) {
    let order = hash_order(keys, prepared, splits);
    let hashes = order.chunk_by(|a, b| a.0 == b.0).count();
    let sets = prepared.window_sets().count();
    let growing = keys.packing().growing();
    let state = usize::from(growing.is_some());
    cmd.arg(hashes + 1 + state + 2 * sets).arg(fence_key);
    if growing.is_some() {
        cmd.arg(keys.splits_key(prepared.group));
    }
    let mut key = String::with_capacity(64);
    for run in order.chunk_by(|a, b| a.0 == b.0) {
        keys.write_hash_key(&mut key, run[0].0, prepared.group);
        cmd.arg(key.as_str());
    }
    window_key_arguments(cmd, &mut key, keys, prepared);
    cmd.arg(prepared.start)
        .arg(prepared.last)
        .arg(prepared.absent_fence)
        .arg(sets);
    match growing {
        Some(growing) => {
            // The key of hash n is the stem, n, and the tail (the group's tag).
            keys.write_hash_key(&mut key, 0, prepared.group);
            let stem_end = keys.prefix().len() + ":packed:".len();
            cmd.arg(growing.fields)
                .arg(splits.level)
                .arg(splits.next)
                .arg(&key[..stem_end])
                .arg(&key[stem_end + 1..]);
        }
        None => {
            cmd.arg(0);
        }
    }
    let mut field = String::with_capacity(32);
    for run in order.chunk_by(|a, b| a.0 == b.0) {
        cmd.arg(run[0].0).arg(run.len());
        for &(_, i) in run {
            let (id, delta) = prepared.deltas[i];
            keys.write_field(&mut field, id);
            cmd.arg(field.as_str()).arg(delta);
        }
    }
    window_arguments(cmd, keys, prepared);
}

/// The deltas as the script takes them: `(delta, n)` for each run of `n`
/// consecutive counters with the same delta. Any order is right; deltas
/// sorted by value (as batches close) make the fewest runs.
pub fn runs(deltas: &[(CounterId, i64)]) -> impl Iterator<Item = (i64, usize)> + '_ {
    deltas
        .chunk_by(|a, b| a.1 == b.1)
        .map(|run| (run[0].1, run.len()))
}

/// Applies batches to a Redis server or cluster.
#[derive(Clone)]
pub struct Applier {
    store: Shared,
    sha: String,
    fences: FenceReader,
    splits: SplitCache,
}

impl Applier {
    /// An applier for `group`'s fences of `topic` under `keys`. The script is
    /// sent by hash and loaded on first use on each server (and again after a
    /// flush or failover).
    pub fn new(store: Shared, target: Target, keys: KeyLayout, group: &str, topic: &str) -> Self {
        Self {
            store,
            sha: redis::Script::new(script_text(&keys))
                .get_hash()
                .to_string(),
            splits: SplitCache::new(keys.groups().count()),
            fences: FenceReader::new(target, keys, group, topic),
        }
    }

    /// The same applier writing under another key layout (a new generation).
    pub fn with_keys(&self, keys: KeyLayout) -> Self {
        Self {
            sha: redis::Script::new(script_text(&keys))
                .get_hash()
                .to_string(),
            splits: SplitCache::new(keys.groups().count()),
            fences: self.fences.with_keys(keys),
            ..self.clone()
        }
    }

    /// The reader of this applier's fences.
    pub fn fence_reader(&self) -> &FenceReader {
        &self.fences
    }

    /// The shared store connection.
    pub fn store(&self) -> &Shared {
        &self.store
    }

    /// The key layout in use.
    pub fn keys(&self) -> &KeyLayout {
        &self.fences.keys
    }

    /// Records `proposed` as the partition's origin unless one exists, and
    /// returns the origin in force.
    pub async fn ensure_origin(&self, partition: i32, proposed: i64) -> Result<i64, RedisError> {
        let key = self.fences.origin_key(partition);
        self.store
            .call(|mut store| async move {
                let _: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg(proposed)
                    .arg("NX")
                    .query_async(&mut store)
                    .await?;
                redis::cmd("GET").arg(&key).query_async(&mut store).await
            })
            .await
    }

    fn command(&self, prepared: &Prepared, body: ScriptBody<'_>, splits: Splits) -> Cmd {
        let fence_key = self.fences.fence_key(prepared.partition, prepared.group);
        script_call(body, self.keys(), &fence_key, prepared, splits)
    }

    /// The split states this applier last saw (growing generations).
    pub fn splits(&self) -> &SplitCache {
        &self.splits
    }

    /// One call of the script; a missing script is sent in full once. A
    /// growing generation's call that would fill a hash past the server's
    /// limit is refused whole by the script once it has split the group to
    /// make room, with the state stored: the call is addressed again with it
    /// and sent again, nothing counted in between (see
    /// [`crate::domain::packing`]).
    async fn call(&self, prepared: &Prepared) -> Result<Vec<redis::Value>, RedisError> {
        let group = prepared.group;
        for _ in 0..MAX_RESPLITS {
            let splits = self.splits.get(group);
            let reply: Vec<redis::Value> = self
                .store
                .call(|mut store| async move {
                    let by_hash = self.command(prepared, ScriptBody::ByHash(&self.sha), splits);
                    match by_hash.query_async(&mut store).await {
                        Err(error) if classify_redis(&error) == RedisFailure::NoScript => {
                            crate::infra::metrics::script_reloaded();
                            let full = self.command(prepared, ScriptBody::Full, splits);
                            full.query_async(&mut store).await
                        }
                        other => other,
                    }
                })
                .await?;
            // The split state of a growing generation's replies: after the
            // fence and the fill.
            let number = |i: usize| {
                reply
                    .get(i)
                    .and_then(|v| redis::from_redis_value_ref::<u32>(v).ok())
            };
            let state = number(3)
                .zip(number(4))
                .map(|(level, next)| Splits { level, next });
            let code = reply
                .first()
                .and_then(|v| redis::from_redis_value_ref::<i64>(v).ok());
            if let Some(state) = state {
                self.splits.set(group, state);
            }
            if code == Some(RESPLIT) && state.is_some() {
                crate::infra::metrics::packed_resplit();
                continue;
            }
            return Ok(reply);
        }
        Err(RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "apply_packed.lua reply",
            format!("{MAX_RESPLITS} calls in a row were refused for a split state that moved on"),
        )))
    }

    /// One attempt; a missing script is sent in full once. `Ok(Err(..))`
    /// when the script refused a counter key and wrote nothing.
    pub async fn apply_once(
        &self,
        prepared: &Prepared,
    ) -> Result<Result<Reply, ApplyError>, RedisError> {
        let reply = self.call(prepared).await?;
        let unexpected = || {
            RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "apply.lua reply",
                format!("{reply:?}"),
            ))
        };
        let number = |i: usize| -> Result<i64, RedisError> {
            reply
                .get(i)
                .and_then(|v| redis::from_redis_value_ref(v).ok())
                .ok_or_else(unexpected)
        };
        let (code, fence) = (number(0)?, number(1)?);
        let text = |i: usize| {
            reply
                .get(i)
                .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
        };
        if code == REFUSED {
            let index = usize::try_from(number(2)? - 2).map_err(|_| unexpected())?;
            let error = text(3).unwrap_or_default();
            if let Some(refused) = server_refusal(&error) {
                return Err(refused);
            }
            // Each window's counts and leaders are the last keys of the call.
            let sets = prepared.window_sets().count();
            // The growing layout's split state comes before the hashes.
            let state = usize::from(self.keys().is_growing());
            let index = index.checked_sub(state).ok_or_else(unexpected)?;
            let counters = counter_keys(self.keys(), prepared, self.splits.get(prepared.group));
            if sets > 0 && index >= counters {
                let set = prepared
                    .window_sets()
                    .nth((index - counters) / 2)
                    .ok_or_else(unexpected)?;
                let leaders = (index - counters) % 2 == 1;
                let mut key = String::new();
                write_set_key(&mut key, self.keys(), prepared.group, set, leaders);
                // A post's count in it: the member is the post, 8 bytes big-endian.
                if let Some(member) = reply
                    .get(4)
                    .and_then(|v| redis::from_redis_value_ref::<Vec<u8>>(v).ok())
                {
                    let post = <[u8; 8]>::try_from(member.as_slice())
                        .map(u64::from_be_bytes)
                        .map_err(|_| unexpected())?;
                    key.push_str(&format!(" (the field of post {post})"));
                }
                return Ok(Err(ApplyError::BadKey {
                    key,
                    error,
                    start: prepared.start,
                    last: prepared.last,
                }));
            }
            let key = match text(4) {
                // Packed: the reply names the field and the hash it was
                // written to (after a split, not always a key of the call).
                Some(field) => format!("{} {field}", text(5).ok_or_else(unexpected)?),
                None => {
                    let (id, _) = prepared.deltas.get(index).ok_or_else(unexpected)?;
                    self.keys().key_of(*id)
                }
            };
            return Ok(Err(ApplyError::BadKey {
                key,
                error,
                start: prepared.start,
                last: prepared.last,
            }));
        }
        let decision = Decision::from_code(code).ok_or_else(unexpected)?;
        if let Some(fill) = reply
            .get(2)
            .and_then(|v| redis::from_redis_value_ref::<u64>(v).ok())
            && decision == Decision::Apply
            && crate::infra::metrics::packed_fill(fill)
        {
            error!(
                fields = fill,
                partition = prepared.partition,
                "A packed hash holds more fields than the server keeps compact (hash-max-listpack-entries): a prefix of a fixed number of hashes holds more counters than it was sized for (or a growing one's splits fall behind its writes), and its hashes cost several times the memory; move it to hashes that split as they fill with `tally rebuild --layout packed`."
            );
        }
        Ok(Ok(Reply { decision, fence }))
    }

    /// Applies with retries on transient errors until success, a fatal error
    /// or cancellation. Retrying is safe: the fence turns a repeat into a no-op.
    pub async fn apply(
        &self,
        prepared: &Prepared,
        cancel: &CancellationToken,
    ) -> Result<Reply, ApplyError> {
        let what = format!(
            "apply partition {} group {} offsets {}..={}",
            prepared.partition, prepared.group, prepared.start, prepared.last
        );
        let outcome = retry_redis(&what, cancel, || self.apply_once(prepared))
            .await
            .map_err(|gave_up| match gave_up {
                GaveUp::Fatal(error) if error.kind() == redis::ErrorKind::UnexpectedReturnType => {
                    ApplyError::BadReply(error.to_string())
                }
                other => other.into(),
            })?;
        if let Err(ApplyError::BadKey { key, error, .. }) = &outcome {
            crate::infra::metrics::script_refused();
            error!(partition = prepared.partition, %key, %error, "A counter key refused its increment; the batch was not applied.");
        }
        outcome
    }

    /// Reads a partition's origin and every slot group's fence.
    pub async fn read_fences(&self, partition: i32) -> Result<PartitionFences, RedisError> {
        self.fences.read(&self.store, partition).await
    }

    /// Records the origin, retrying like [`Applier::apply`].
    pub async fn origin(
        &self,
        partition: i32,
        proposed: i64,
        cancel: &CancellationToken,
    ) -> Result<i64, ApplyError> {
        let what = format!("record origin of partition {partition}");
        Ok(retry_redis(&what, cancel, || self.ensure_origin(partition, proposed)).await?)
    }

    /// Reads a partition's fences, retrying like [`Applier::apply`].
    pub async fn fences(
        &self,
        partition: i32,
        cancel: &CancellationToken,
    ) -> Result<PartitionFences, ApplyError> {
        let what = format!("read fences of partition {partition}");
        Ok(retry_redis(&what, cancel, || self.read_fences(partition)).await?)
    }
}

/// Reads the origin and the slot-group fences of a group's partitions: on
/// the shared connection, or synchronously inside the Kafka rebalance
/// callback, which cannot await (each such read opens a short-lived
/// connection with tight timeouts).
#[derive(Debug, Clone)]
pub struct FenceReader {
    target: Target,
    keys: KeyLayout,
    group: String,
    topic: String,
}

impl FenceReader {
    /// A reader of `group`'s fences of `topic` under `keys`.
    pub fn new(target: Target, keys: KeyLayout, group: &str, topic: &str) -> Self {
        Self {
            target,
            keys,
            group: group.to_string(),
            topic: topic.to_string(),
        }
    }

    /// The same reader under another key layout (a new generation).
    pub fn with_keys(&self, keys: KeyLayout) -> Self {
        Self {
            keys,
            ..self.clone()
        }
    }

    /// The store the blocking reads connect to.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The origin key of a partition.
    pub fn origin_key(&self, partition: i32) -> String {
        self.keys.origin_key(&self.group, &self.topic, partition)
    }

    /// The fence key of a partition's slot group.
    pub fn fence_key(&self, partition: i32, slot_group: u32) -> String {
        self.keys
            .fence_key(&self.group, &self.topic, partition, slot_group)
    }

    /// The fence keys of every slot group of a partition, in group order.
    fn fence_keys(&self, partition: i32) -> Vec<String> {
        (0..self.keys.groups().count())
            .map(|g| self.fence_key(partition, g))
            .collect()
    }

    /// Reads one partition on the shared connection, every key at once.
    pub async fn read(
        &self,
        store: &Shared,
        partition: i32,
    ) -> Result<PartitionFences, RedisError> {
        let origin_key = self.origin_key(partition);
        let fence_keys = self.fence_keys(partition);
        store
            .call(|store| async move {
                let mut conn = store.clone();
                let raw: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(&origin_key)
                    .query_async(&mut conn)
                    .await?;
                let origin = stored_offset(&origin_key, raw)?;
                let reads = fence_keys.into_iter().map(|key| {
                    let mut conn = store.clone();
                    async move {
                        let raw = redis::cmd("GET")
                            .arg(&key)
                            .query_async::<Option<Vec<u8>>>(&mut conn)
                            .await?;
                        stored_offset(&key, raw)
                    }
                });
                let fences = futures::future::try_join_all(reads).await?;
                Ok(PartitionFences { origin, fences })
            })
            .await
    }

    /// Reads each partition in order, synchronously.
    pub fn read_blocking(&self, partitions: &[i32]) -> Result<Vec<PartitionFences>, RedisError> {
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = connect_blocking(&self.target, Duration::from_secs(2))?;
        let mut all = Vec::with_capacity(partitions.len());
        for &p in partitions {
            let origin_key = self.origin_key(p);
            let origin = stored_offset(
                &origin_key,
                redis::cmd("GET").arg(&origin_key).query(conn.as_mut())?,
            )?;
            let mut fences = Vec::with_capacity(self.keys.groups().count() as usize);
            for key in self.fence_keys(p) {
                let raw = redis::cmd("GET").arg(&key).query(conn.as_mut())?;
                fences.push(stored_offset(&key, raw)?);
            }
            all.push(PartitionFences { origin, fences });
        }
        Ok(all)
    }
}

/// The offset a fence or origin key holds, `None` when absent. A value that
/// is not an integer is a write tally never makes (a foreign writer, a typo
/// in redis-cli, a restore of something else): what the fence said is lost,
/// and no guess of it is safe, so it is an error no retry fixes, whose
/// detail names the key, its value and the fix.
fn stored_offset(key: &str, raw: Option<Vec<u8>>) -> Result<Option<i64>, RedisError> {
    crate::infra::store::stored_number(raw, |value| {
        format!(
            "{key} holds {value:?}, which is not an offset and not a value tally writes; the position it kept is lost: restore the key from a backup of this store, or recount the prefix with `tally rebuild`"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_that_refuses_writes_is_retried_and_a_bad_key_is_not() {
        for line in [
            "OOM command not allowed when used memory > 'maxmemory'.",
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            "READONLY You can't write against a read only replica.",
        ] {
            let refused = server_refusal(line).expect(line);
            assert_eq!(classify_redis(&refused), RedisFailure::Transient, "{line}");
        }
        for line in [
            "ERR value is not an integer or out of range",
            "ERR increment or decrement would overflow",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "",
        ] {
            assert!(server_refusal(line).is_none(), "{line}");
        }
    }

    #[test]
    fn runs_cover_every_delta_in_order() {
        let id = |post| CounterId::v0(post, 0);
        let deltas = [(id(1), 1), (id(2), 1), (id(3), -1), (id(4), 1), (id(5), 2)];
        let runs: Vec<_> = runs(&deltas).collect();
        assert_eq!(runs, [(1, 2), (-1, 1), (1, 1), (2, 1)]);
        let expanded: Vec<i64> = runs
            .iter()
            .flat_map(|&(d, n)| std::iter::repeat_n(d, n))
            .collect();
        assert_eq!(expanded, deltas.map(|(_, d)| d));
        assert_eq!(super::runs(&[]).count(), 0);
    }

    #[test]
    fn the_window_section_keeps_the_leaders_the_readers_expect() {
        let lua = include_str!("windows.lua");
        let constants = format!(
            "local LEADERS_CAP, LEADERS_KEEP = {}, {}",
            windows::LEADERS_CAP,
            windows::LEADERS_KEEP
        );
        assert!(
            lua.contains(&constants),
            "windows.lua must say: {constants}"
        );
        let floor = format!("HGET', counts, '{}'", windows::FLOOR_FIELD);
        assert!(
            lua.contains(&floor),
            "windows.lua must read the floor from {floor}"
        );
    }

    #[test]
    fn the_script_documents_its_contract() {
        let own = include_str!("apply.lua");
        assert!(own.starts_with("-- apply.lua"));
        assert!(APPLY_LUA.starts_with("-- acl_check.lua") && APPLY_LUA.ends_with(own));
        let packed = include_str!("apply_packed.lua");
        assert!(
            APPLY_PACKED_LUA.starts_with("-- acl_check.lua") && APPLY_PACKED_LUA.ends_with(packed)
        );
        for needle in ["KEYS[1]", "ARGV[1]", "ARGV[2]", "ARGV[3]", "Returns"] {
            assert!(
                APPLY_LUA.contains(needle),
                "apply.lua header lacks {needle}"
            );
        }
    }
}
