//! Read: a post's like count, summed over every key a writer may have used.
//!
//! Invariant: a read sums the base, every version listed in the post's
//! route hash or in its registry entry, and every epoch of the default
//! layout, all read *before* its counters (the registry too, so that a
//! failover that loses the route hash's copy of a version hides no keys), so by [`crate::domain::versions`] it never sums fewer keys than
//! any writer uses; a read whose two steps take longer than
//! [`READ_DEADLINE`] is started again.
//!
//! Round trips: one pipeline reads the default layout, the route hash and
//! the buckets of every default epoch of every post asked for (the epochs
//! the previous read found); a second reads the buckets of other versions,
//! for hot posts only, and of an epoch the first read had not known. On a cluster a pipeline may not span slots, so each is cut
//! into one pipeline per hash slot, sent concurrently; route hashes share
//! their post's slot groups, so a read touches at most as many slots as there
//! are slot groups. Counts of
//! different keys are read at slightly different moments: a read is not a
//! point-in-time snapshot of a post (nor of several), and a batch applying
//! while it runs may be seen in some buckets and not yet in others. Every
//! batch is applied atomically per slot group, and counts never go back
//! unless unlikes do.
//!
//! A per-process cache keeps each count for `ttl` (default 1 s); concurrent
//! misses of the same post wait for one fetch instead of each sending their own.
//!
//! Generations: a read sums the generation the pointer names (see
//! [`crate::domain::generation`]), read at most [`POINTER_TTL`] (or `ttl`, if
//! shorter) before; a reader never goes back to an older generation than one
//! it has read. A rebuild moves the pointer only to a generation at or past
//! every fence of the old one while the old one is frozen, so a post that only
//! gains likes never reads lower after the switch than before it. A pointer
//! that moved back (see [`generation::Backwards`]) is reported, once per
//! pointer value, with a metric and an ERROR line naming the remedy.

pub mod trending;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::{RedisError, Value};
use rustc_hash::FxHashMap;
use serde::Serialize;
use tokio::sync::watch;

use crate::domain::packing::{SplitCache, Splits};
use crate::domain::routing::{CounterId, KeyLayout, Place};
use crate::domain::slots::key_slot;
use crate::domain::versions::{
    DEFAULT_FIELD, Defaults, PostMeta, READ_DEADLINE, read_defaults, wall_ms,
};
use crate::domain::{generation, layout};
use crate::infra::store::Shared;

/// How long a count is served from the cache unless told otherwise (milliseconds; `tally
/// serve --cache-ttl-ms`).
pub const DEFAULT_CACHE_TTL_MS: u64 = 1_000;

/// How long a reader trusts the generation pointer it read.
pub const POINTER_TTL: Duration = Duration::from_secs(1);

/// A post's count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Count {
    /// The post.
    pub post_id: u64,
    /// Likes minus unlikes.
    pub likes: i64,
    /// When the read began (milliseconds since the epoch): the count holds
    /// every batch applied before then.
    pub as_of_ms: i64,
}

/// Why a read failed. Cloned to every reader waiting on the same fetch.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// Redis failed.
    #[error("reading counts from Redis failed: {0}")]
    Redis(#[source] Arc<RedisError>),
    /// Redis kept answering too slowly.
    #[error("reading counts from Redis failed: no answer within {0:?}")]
    Deadline(Duration),
    /// A window the prefix does not keep.
    #[error(
        "window '{asked}' is not kept under this prefix (it keeps {kept}); `tally run --windows` names them when a prefix is made"
    )]
    UnknownWindow {
        /// The window asked for.
        asked: String,
        /// The windows kept, as `1m,1h`.
        kept: String,
    },
}

impl From<RedisError> for ReadError {
    fn from(error: RedisError) -> Self {
        ReadError::Redis(Arc::new(error))
    }
}

type Pending = watch::Receiver<Option<Result<Count, ReadError>>>;

/// A one-key command: the command's name, the key and its further arguments.
#[derive(Debug, Clone)]
struct KeyCommand {
    name: &'static str,
    key: String,
    args: Vec<String>,
}

impl KeyCommand {
    /// Reads one counter: GET of its key, or HMGET of its one field when
    /// packed (HMGET, which readers' ACL already grants for the registry).
    fn counter(place: Place) -> Self {
        match place.field {
            None => Self {
                name: "GET",
                key: place.key,
                args: Vec::new(),
            },
            Some(field) => Self {
                name: "HMGET",
                key: place.key,
                args: vec![field],
            },
        }
    }
}

/// A counter read from a growing generation, addressed with the split state
/// its slot group had in the reader's view: the command at `at` read hash
/// `n` of `group`.
#[derive(Debug, Clone, Copy)]
struct Addressed {
    at: usize,
    id: CounterId,
    group: u32,
    n: u32,
    assumed: Splits,
}

/// The most times a read addresses a counter again because its hash was
/// split while it read: each time with the state read right after it.
const MAX_READDRESS: usize = 16;

/// A counter's value as [`KeyCommand::counter`] reads it: GET's reply, or
/// HMGET's one-element array; absent reads as 0.
fn counter_value(value: &Value) -> Result<i64, RedisError> {
    let value = match value {
        Value::Array(items) if items.len() == 1 => &items[0],
        other => other,
    };
    Ok(redis::from_redis_value_ref::<Option<i64>>(value)?.unwrap_or(0))
}

/// Reads counts, with a per-process cache and coalesced misses. Cheap to clone.
#[derive(Clone)]
pub struct Reader {
    inner: Arc<Inner>,
}

struct Inner {
    store: Shared,
    /// The layout under the base prefix; each generation's is derived from it.
    base: KeyLayout,
    /// The generation last read, its layout, and when.
    layout: Mutex<(u64, KeyLayout, Option<Instant>)>,
    /// The pointer that moved back last reported: (current, highest).
    reported_back: Mutex<Option<(u64, u64)>>,
    /// Version 0's bucket count, from the layout record.
    epoch0: u32,
    /// The default layout the last read found: the first round trip reads
    /// its keys, and learns whether it still holds.
    defaults: Mutex<Defaults>,
    ttl: Duration,
    cache: Mutex<FxHashMap<u64, (Count, Instant)>>,
    /// Window answers (see [`trending`]).
    windowed: Mutex<FxHashMap<trending::WindowRead, (trending::Cached, Instant)>>,
    pending: Mutex<FxHashMap<u64, Pending>>,
    fetches: AtomicU64,
    /// The split states last read of the current generation's slot groups,
    /// when its hashes grow, and the generation they are of.
    splits: Mutex<(u64, SplitCache)>,
}

/// Removes a leader's pending entries however its fetch ends, so followers
/// of a cancelled fetch retry instead of waiting forever.
struct Leading<'a> {
    pending: &'a Mutex<FxHashMap<u64, Pending>>,
    posts: Vec<u64>,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        for post in &self.posts {
            pending.remove(post);
        }
    }
}

impl Reader {
    /// A reader over `store`, caching counts for `ttl` (zero: no cache).
    /// `keys` is the layout under the base prefix (`--prefix`) and `epoch0`
    /// version 0's bucket count, both from the layout record; counts are
    /// read from the generation the pointer names.
    pub fn new(store: Shared, keys: KeyLayout, epoch0: u32, ttl: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                layout: Mutex::new((0, keys.clone(), None)),
                reported_back: Mutex::new(None),
                base: keys,
                epoch0,
                defaults: Mutex::new(Defaults::fixed(epoch0)),
                ttl,
                cache: Mutex::new(FxHashMap::default()),
                windowed: Mutex::new(FxHashMap::default()),
                pending: Mutex::new(FxHashMap::default()),
                fetches: AtomicU64::new(0),
                splits: Mutex::new((u64::MAX, SplitCache::new(1))),
            }),
        }
    }

    /// The layout of the current generation, from the pointer read at most
    /// `min(ttl, POINTER_TTL)` ago; never one older than a layout already used.
    pub async fn layout(&self) -> Result<(u64, KeyLayout), RedisError> {
        let inner = &self.inner;
        {
            let layout = inner.layout.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(at) = layout.2
                && at.elapsed() < inner.ttl.min(POINTER_TTL)
            {
                return Ok((layout.0, layout.1.clone()));
            }
        }
        let read_at = Instant::now();
        let pointer = generation::read_pointer(&inner.store, inner.base.prefix()).await?;
        self.report_backwards(&pointer);
        // A generation keeps its packing for good: it is read from the
        // layout record on the first read and when the pointer names another
        // generation, whatever layout the reader was made with.
        let known = {
            let layout = inner.layout.lock().unwrap_or_else(|e| e.into_inner());
            (layout.0 == pointer.current && layout.2.is_some()).then(|| *layout.1.packing())
        };
        // A prefix without a record yet is read as string keys (it holds
        // nothing) and looked at again on the next read.
        let (packing, recorded) = match known {
            Some(packing) => (packing, true),
            None => match layout::packing_if_recorded(
                &inner.store,
                inner.base.prefix(),
                pointer.current,
            )
            .await?
            {
                Some(packing) => (packing, true),
                None => (*inner.base.packing(), false),
            },
        };
        let mut layout = inner.layout.lock().unwrap_or_else(|e| e.into_inner());
        if pointer.current >= layout.0 || layout.2.is_none() {
            let prefix = generation::prefix_of(inner.base.prefix(), pointer.current);
            *layout = (
                pointer.current,
                inner.base.with_prefix(prefix).with_packing(packing),
                recorded.then_some(read_at),
            );
        }
        Ok((layout.0, layout.1.clone()))
    }

    /// Reports a pointer that moved back, once per value it takes.
    fn report_backwards(&self, pointer: &generation::Pointer) {
        let backwards = pointer.backwards(self.inner.base.prefix());
        let seen = backwards.as_ref().map(|b| (b.current, b.highest));
        let mut reported = self
            .inner
            .reported_back
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if *reported != seen {
            *reported = seen;
            if let Some(backwards) = &backwards {
                generation::report_backwards(backwards);
            }
        }
    }

    /// Every key a read of `post_id` sums now, and the generation's prefix.
    pub async fn summed_keys(&self, post_id: u64) -> Result<(String, Vec<String>), ReadError> {
        let (k, keys) = self.layout().await?;
        let splits = self.splits_of(k, &keys);
        let replies = self
            .query(vec![
                Self::registry_command(&keys, &[post_id]),
                Self::route_command(&keys, post_id),
            ])
            .await?;
        let (defaults, entries) = self.registry_from(&keys, &replies[0])?;
        let fields: Vec<(String, String)> =
            redis::from_redis_value_ref(&replies[1]).map_err(RedisError::from)?;
        let meta = PostMeta::from_fields(&keys.route_key(post_id), &fields, &defaults)?
            .with_entry(entries[0].as_deref());
        if !keys.is_growing() {
            return Ok((keys.prefix().to_string(), meta.keys(&keys, post_id)));
        }
        // Where each counter is now: addressed with the states read after a
        // read of them all, until none moved.
        let (mut commands, mut addressed) = (Vec::new(), Vec::new());
        for id in meta.counters(post_id) {
            Self::push_counter(&keys, &splits, id, &mut commands, &mut addressed);
        }
        self.query_counters(&keys, &splits, commands, addressed)
            .await?;
        let shown = meta
            .counters(post_id)
            .map(|id| keys.place_at(id, splits.get(keys.group_of(id))).shown())
            .collect();
        Ok((keys.prefix().to_string(), shown))
    }

    /// The default layout and the registry entries of `posts`: one HMGET.
    fn registry_command(keys: &KeyLayout, posts: &[u64]) -> KeyCommand {
        let mut args = vec![DEFAULT_FIELD.to_string()];
        args.extend(posts.iter().map(u64::to_string));
        KeyCommand {
            name: "HMGET",
            key: keys.registry_key(),
            args,
        }
    }

    fn route_command(keys: &KeyLayout, post_id: u64) -> KeyCommand {
        KeyCommand {
            name: "HGETALL",
            key: keys.route_key(post_id),
            args: Vec::new(),
        }
    }

    /// The default layout (remembered for the next read's first round trip)
    /// and the posts' registry entries, from a [`Self::registry_command`] reply.
    fn registry_from(
        &self,
        keys: &KeyLayout,
        reply: &Value,
    ) -> Result<(Defaults, Vec<Option<String>>), RedisError> {
        let mut entries: Vec<Option<String>> = redis::from_redis_value_ref(reply)?;
        let entry = if entries.is_empty() {
            None
        } else {
            entries.remove(0)
        };
        let defaults = read_defaults(&keys.registry_key(), entry.as_deref(), self.inner.epoch0)?;
        *self
            .inner
            .defaults
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = defaults.clone();
        Ok((defaults, entries))
    }

    /// Fetches sent to Redis so far (each one or two pipelines, for any number of posts).
    pub fn fetches(&self) -> u64 {
        self.inner.fetches.load(Ordering::Relaxed)
    }

    /// One post's count.
    pub async fn count(&self, post_id: u64) -> Result<Count, ReadError> {
        Ok(self.counts(&[post_id]).await?[0])
    }

    /// Counts of several posts, in the order asked (repeats allowed).
    pub async fn counts(&self, posts: &[u64]) -> Result<Vec<Count>, ReadError> {
        if let Some(counts) = self.cached(posts) {
            return Ok(counts);
        }
        let inner = &self.inner;
        let mut found: FxHashMap<u64, Count> = FxHashMap::default();
        loop {
            let mut lead = Vec::new();
            let mut follow = Vec::new();
            let mut senders = Vec::new();
            let (mut hits, mut misses) = (0, 0);
            {
                let cache = inner.cache.lock().unwrap_or_else(|e| e.into_inner());
                let mut pending = inner.pending.lock().unwrap_or_else(|e| e.into_inner());
                for &post in posts {
                    if found.contains_key(&post) {
                        continue;
                    }
                    if let Some((count, at)) = cache.get(&post)
                        && at.elapsed() < inner.ttl
                    {
                        found.insert(post, *count);
                        hits += 1;
                        continue;
                    }
                    misses += 1;
                    match pending.get(&post) {
                        Some(rx) => follow.push((post, rx.clone())),
                        None => {
                            let (tx, rx) = watch::channel(None);
                            pending.insert(post, rx);
                            senders.push((post, tx));
                            lead.push(post);
                        }
                    }
                }
            }
            crate::infra::metrics::read_cache(hits, misses);
            if !lead.is_empty() {
                let _leading = Leading {
                    pending: &inner.pending,
                    posts: lead.clone(),
                };
                let result = self.fetch(&lead).await;
                let mut cache = inner.cache.lock().unwrap_or_else(|e| e.into_inner());
                if cache.len() > 100_000 {
                    cache.retain(|_, (_, at)| at.elapsed() < inner.ttl);
                }
                for (i, (post, tx)) in senders.into_iter().enumerate() {
                    let sent = match &result {
                        Ok(counts) => {
                            if !inner.ttl.is_zero() {
                                cache.insert(post, (counts[i], Instant::now()));
                            }
                            found.insert(post, counts[i]);
                            Ok(counts[i])
                        }
                        Err(error) => Err(error.clone()),
                    };
                    let _ = tx.send(Some(sent));
                }
                result?;
            }
            for (post, mut rx) in follow {
                let outcome = rx.wait_for(Option::is_some).await.map(|v| v.clone());
                match outcome {
                    Ok(Some(Ok(count))) => {
                        found.insert(post, count);
                    }
                    Ok(Some(Err(error))) => return Err(error),
                    // The leader gave up without an answer: ask again.
                    Ok(None) | Err(_) => {}
                }
            }
            if posts.iter().all(|p| found.contains_key(p)) {
                return Ok(posts.iter().map(|p| found[p]).collect());
            }
        }
    }

    /// The counts of `posts` when the cache holds a fresh one of each: the
    /// common case, answered under one lock, with no further allocation.
    fn cached(&self, posts: &[u64]) -> Option<Vec<Count>> {
        let inner = &self.inner;
        if inner.ttl.is_zero() {
            return None;
        }
        let now = Instant::now();
        let mut counts = Vec::with_capacity(posts.len());
        {
            let cache = inner.cache.lock().unwrap_or_else(|e| e.into_inner());
            for post in posts {
                let (count, at) = cache.get(post)?;
                if now.saturating_duration_since(*at) >= inner.ttl {
                    return None;
                }
                counts.push(*count);
            }
        }
        crate::infra::metrics::read_cache(counts.len() as u64, 0);
        Some(counts)
    }

    /// Reads the counts of distinct posts from Redis, within the deadline.
    async fn fetch(&self, posts: &[u64]) -> Result<Vec<Count>, ReadError> {
        let mut last_error = None;
        for _ in 0..3 {
            self.inner.fetches.fetch_add(1, Ordering::Relaxed);
            crate::infra::metrics::read_fetch();
            match tokio::time::timeout(READ_DEADLINE, self.fetch_once(posts)).await {
                Ok(Ok(counts)) => return Ok(counts),
                Ok(Err(error)) => last_error = Some(ReadError::from(error)),
                Err(_) => last_error = Some(ReadError::Deadline(READ_DEADLINE)),
            }
        }
        Err(last_error.expect("at least one attempt"))
    }

    /// The split states of generation `k` (laid out as `keys`) last read.
    fn splits_of(&self, k: u64, keys: &KeyLayout) -> SplitCache {
        let mut splits = self.inner.splits.lock().unwrap_or_else(|e| e.into_inner());
        if splits.0 != k {
            *splits = (k, SplitCache::new(keys.groups().count()));
        }
        splits.1.clone()
    }

    /// The command reading counter `id`, pushed onto `commands`; in a
    /// growing generation, addressed with the split state last read and
    /// noted in `addressed`.
    fn push_counter(
        keys: &KeyLayout,
        splits: &SplitCache,
        id: CounterId,
        commands: &mut Vec<KeyCommand>,
        addressed: &mut Vec<Addressed>,
    ) {
        if !keys.is_growing() {
            commands.push(KeyCommand::counter(keys.place_of(id)));
            return;
        }
        let group = keys.group_of(id);
        let assumed = splits.get(group);
        let (place, n) = keys.numbered_place(id, assumed);
        addressed.push(Addressed {
            at: commands.len(),
            id,
            group,
            n,
            assumed,
        });
        commands.push(KeyCommand::counter(place));
    }

    /// Appends a read of the split state of every slot group `addressed`
    /// names, after the counter reads: Redis answers the commands of one slot
    /// in order, so each state is read after the hashes of its group.
    fn push_states(
        keys: &KeyLayout,
        addressed: &[Addressed],
        commands: &mut Vec<KeyCommand>,
    ) -> Vec<u32> {
        let mut groups: Vec<u32> = addressed.iter().map(|a| a.group).collect();
        groups.sort_unstable();
        groups.dedup();
        for &group in &groups {
            commands.push(KeyCommand {
                name: "HMGET",
                key: keys.splits_key(group),
                args: vec!["level".into(), "next".into()],
            });
        }
        groups
    }

    /// Runs `commands` (counter reads among them, as `addressed` notes) and
    /// returns their replies; in a growing generation, a counter whose hash
    /// was split since the state it was addressed with is read again where
    /// the state read after it says, until every one was read from the hash
    /// that held it (see [`crate::domain::packing`] for why this never sees
    /// a count go down).
    async fn query_counters(
        &self,
        keys: &KeyLayout,
        splits: &SplitCache,
        mut commands: Vec<KeyCommand>,
        addressed: Vec<Addressed>,
    ) -> Result<Vec<Value>, RedisError> {
        if addressed.is_empty() {
            return self.query(commands).await;
        }
        let own = commands.len();
        let groups = Self::push_states(keys, &addressed, &mut commands);
        let replies = self.query(commands).await?;
        self.settle(keys, splits, replies, addressed, own, groups)
            .await
    }

    /// The rest of [`Self::query_counters`]: `replies` holds the answers of
    /// the first `own` commands, then the states of `groups`, read after
    /// them; checks every counter against its group's state, and reads again
    /// what moved.
    async fn settle(
        &self,
        keys: &KeyLayout,
        splits: &SplitCache,
        mut replies: Vec<Value>,
        mut addressed: Vec<Addressed>,
        own: usize,
        mut groups: Vec<u32>,
    ) -> Result<Vec<Value>, RedisError> {
        for _ in 0..MAX_READDRESS {
            let states = replies.split_off(own);
            for (&group, state) in groups.iter().zip(&states) {
                let (level, next): (Option<u32>, Option<u32>) = redis::from_redis_value_ref(state)?;
                splits.set(
                    group,
                    Splits {
                        level: level.unwrap_or(0),
                        next: next.unwrap_or(0),
                    },
                );
            }
            let moved: Vec<Addressed> = addressed
                .iter()
                .filter(|a| !splits.get(a.group).holds(&a.assumed, a.n))
                .copied()
                .collect();
            if moved.is_empty() {
                return Ok(replies);
            }
            let mut again = Vec::with_capacity(moved.len());
            let mut readdressed = Vec::with_capacity(moved.len());
            for a in &moved {
                Self::push_counter(keys, splits, a.id, &mut again, &mut readdressed);
            }
            groups = Self::push_states(keys, &readdressed, &mut again);
            let mut fresh = self.query(again).await?;
            let fresh_states = fresh.split_off(fresh.len() - groups.len());
            for (a, value) in moved.iter().zip(fresh) {
                replies[a.at] = value;
            }
            for (r, a) in readdressed.iter_mut().zip(&moved) {
                r.at = a.at;
            }
            addressed = readdressed;
            replies.extend(fresh_states);
        }
        Err(RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "split state",
            format!(
                "the hashes of {} split {MAX_READDRESS} times while one read looked for a counter",
                keys.prefix()
            ),
        )))
    }

    async fn fetch_once(&self, posts: &[u64]) -> Result<Vec<Count>, RedisError> {
        let as_of_ms = wall_ms();
        let (k, keys) = self.layout().await?;
        let splits = self.splits_of(k, &keys);
        // The keys of a post without versions of its own, under the default
        // layout the last read found; read with the route hashes.
        let known = self
            .inner
            .defaults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let guess = PostMeta::from_fields("", &[], &known)?;
        let mut offsets = Vec::with_capacity(guess.versions.len());
        let mut per_post = 0;
        for &version in &guess.versions {
            offsets.push((version, per_post));
            per_post += version.1 as usize;
        }
        let mut first = vec![Self::registry_command(&keys, posts)];
        first.extend(posts.iter().map(|&p| Self::route_command(&keys, p)));
        let mut addressed = Vec::new();
        for &post in posts {
            for id in guess.counters(post) {
                Self::push_counter(&keys, &splits, id, &mut first, &mut addressed);
            }
        }
        let mut replies = self
            .query_counters(&keys, &splits, first, addressed)
            .await?;
        let values = replies.split_off(posts.len() + 1);
        let (defaults, entries) = self.registry_from(&keys, &replies[0])?;
        let mut counts = Vec::with_capacity(posts.len());
        let mut owners: Vec<usize> = Vec::new();
        let mut extra: Vec<KeyCommand> = Vec::new();
        let mut extra_addressed = Vec::new();
        for (i, (&post_id, fields)) in posts.iter().zip(&replies[1..]).enumerate() {
            let fields: Vec<(String, String)> = redis::from_redis_value_ref(fields)?;
            let entry = entries.get(i).and_then(Option::as_deref);
            let meta = PostMeta::from_fields(&keys.route_key(post_id), &fields, &defaults)?
                .with_entry(entry);
            let mut likes = meta.base;
            for &(version, buckets) in &meta.versions {
                if let Some(&(_, at)) = offsets.iter().find(|(v, _)| *v == (version, buckets)) {
                    let start = i * per_post + at;
                    for value in &values[start..start + buckets as usize] {
                        likes += counter_value(value)?;
                    }
                    continue;
                }
                for bucket in 0..buckets {
                    let id = CounterId {
                        post_id,
                        version,
                        bucket,
                    };
                    owners.push(i);
                    Self::push_counter(&keys, &splits, id, &mut extra, &mut extra_addressed);
                }
            }
            counts.push(Count {
                post_id,
                likes,
                as_of_ms,
            });
        }
        if !extra.is_empty() {
            let values = self
                .query_counters(&keys, &splits, extra, extra_addressed)
                .await?;
            for (i, value) in owners.into_iter().zip(values) {
                counts[i].likes += counter_value(&value)?;
            }
        }
        Ok(counts)
    }

    /// Runs one-key commands and returns their replies in order: one pipeline
    /// on a single server; on a cluster one pipeline per hash slot (a cluster
    /// pipeline must stay in one slot), sent concurrently.
    async fn query(&self, commands: Vec<KeyCommand>) -> Result<Vec<Value>, RedisError> {
        let pipeline = |part: &[(usize, &KeyCommand)]| {
            let mut pipe = redis::pipe();
            for (_, command) in part {
                pipe.cmd(command.name).arg(&command.key).arg(&command.args);
            }
            pipe
        };
        let indexed: Vec<(usize, &KeyCommand)> = commands.iter().enumerate().collect();
        let mut by_slot: BTreeMap<u16, Vec<(usize, &KeyCommand)>> = BTreeMap::new();
        if self.inner.base.groups().is_cluster() {
            for item in indexed {
                by_slot
                    .entry(key_slot(item.1.key.as_bytes()))
                    .or_default()
                    .push(item);
            }
        } else {
            by_slot.insert(0, indexed);
        }
        let parts: Vec<_> = by_slot.into_values().collect();
        let replies = futures::future::try_join_all(parts.iter().map(|part| {
            let pipe = pipeline(part);
            self.inner
                .store
                .call(move |mut s| async move { pipe.query_async::<Vec<Value>>(&mut s).await })
        }))
        .await?;
        let mut ordered = vec![Value::Nil; commands.len()];
        for (part, values) in parts.iter().zip(replies) {
            for ((i, _), value) in part.iter().zip(values) {
                ordered[*i] = value;
            }
        }
        Ok(ordered)
    }
}
