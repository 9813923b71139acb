//! Generation: which set of keys is the live one.
//!
//! Every key tally writes lives under a *generation prefix*. Generation 0 is
//! the base prefix itself (`<prefix>`), so a deployment that never rebuilt
//! keeps the key names of docs/contract.md. Generation `k >= 1` is `<prefix>:g<k>`,
//! for everything: counters, fences, origins, route hashes, the registry and
//! the heat counters. Three small keys sit beside the generations:
//!
//! * the **pointer** `<prefix>:generation`, a hash `{current, switched_at_ms,
//!   highest}`; absent (or `current` 0) means generation 0; `highest` is the
//!   newest generation ever current (absent: `current`);
//! * the **freeze flag** `<prefix>:freeze`, holding the generation about to
//!   become current, with a TTL of a few seconds;
//! * the **rebuild record** `<prefix>:rebuild`, a hash naming the unfinished
//!   generation a rebuild is filling (`generation`, `started_at_ms`, `copied`).
//!
//! Invariant: the pointer only moves forward, and it names a generation whose
//! fences are at or past every fence of the generation it replaces (the
//! rebuild checks that under the freeze, see [`crate::ops::rebuild`]). Writers and
//! readers resolve the pointer before touching counters, and nothing keyed by
//! a generation ever names another one, so a generation's keys can be dropped
//! as a whole ([`crate::ops::gc`]).
//!
//! A pointer that moved back (a failover that lost the switch, a hand edit)
//! would split writers and readers: those running stay on the newer
//! generation, those starting would follow the older one. So the switch
//! records the generation in `highest` too, a running writer that sees the
//! pointer behind the generation it writes records that generation there
//! again (a failover that lost the switch lost `highest` with it, but not the
//! writer's memory), and `current < highest` is [`Backwards`]: writers refuse
//! to start on it, readers report it ([`Pointer::backwards`]).
//!
//! A pointer or freeze flag holding what tally never writes there is refused
//! at start; found by a running writer's follower, it is an ERROR line and
//! `tally_generation_pointer_unreadable` until it reads again, and the
//! writer goes on with the generation it last read.

use std::time::Duration;

use redis::RedisError;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::domain::routing::KeyLayout;
use crate::domain::versions::wall_ms;
use crate::infra::store::{Shared, stored_number, stray_detail};
use crate::infra::{metrics, tasks};

/// How long a freeze lasts unless the rebuild renews it.
pub const FREEZE_TTL: Duration = Duration::from_secs(3);
/// How often a frozen writer looks at the pointer again.
pub const FROZEN_POLL: Duration = Duration::from_millis(50);

/// The key prefix of generation `k` under the base prefix.
pub fn prefix_of(base: &str, k: u64) -> String {
    if k == 0 {
        base.to_string()
    } else {
        format!("{base}:g{k}")
    }
}

/// The pointer key.
pub fn pointer_key(base: &str) -> String {
    format!("{base}:generation")
}

/// The freeze flag.
pub fn freeze_key(base: &str) -> String {
    format!("{base}:freeze")
}

/// The rebuild record.
pub fn record_key(base: &str) -> String {
    format!("{base}:rebuild")
}

/// The generation a key belongs to, or `None` for the pointer, the flag, the
/// record and anything tally does not write. Generation 0 owns exactly
/// `<base>:likes:*`, `:packed:*`, `:fence:*`, `:origin:*`, `:route:*`, `:heat:*` and
/// `<base>:routes`; generation `k` owns `<base>:g<k>:*`.
pub fn generation_of(base: &str, key: &str) -> Option<u64> {
    let rest = key.strip_prefix(base)?.strip_prefix(':')?;
    if let Some(tail) = rest.strip_prefix('g')
        && let Some((digits, _)) = tail.split_once(':')
        && !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
    {
        return digits.parse().ok().filter(|&k| k > 0);
    }
    let gen0 = ["likes:", "packed:", "fence:", "origin:", "route:", "heat:"]
        .iter()
        .any(|head| rest.starts_with(head))
        || rest == "routes";
    gen0.then_some(0)
}

/// The pointer: the current generation and when it became current.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pointer {
    /// The current generation.
    pub current: u64,
    /// When the pointer last moved (milliseconds since the epoch; 0 if never).
    pub switched_at_ms: i64,
    /// The newest generation ever current, as far as the store and the
    /// running writers know; at least `current`.
    pub highest: u64,
}

impl Pointer {
    /// The pointer from its fields in `key`; a field that holds no number is
    /// a value tally never writes, refused with the key, the field and the
    /// fix, since readers and writers would otherwise take generation 0.
    fn parse(key: &str, (current, at, highest): PointerFields) -> Result<Self, RedisError> {
        fn number<T: std::str::FromStr>(
            key: &str,
            field: &str,
            raw: Option<Vec<u8>>,
        ) -> Result<Option<T>, RedisError> {
            crate::infra::store::stored_number(raw, |value| {
                format!(
                    "{key} field {field} holds {value:?}, which is not a number and not a value tally writes: set it back to the generation tally writes (generation k keeps its keys under <prefix>:g<k>:, generation 0 directly under the prefix; a rebuild's log names each switch), then start again"
                )
            })
        }
        Ok(Self::from_fields(
            number(key, "current", current)?,
            number(key, "switched_at_ms", at)?,
            number(key, "highest", highest)?,
        ))
    }

    fn from_fields(current: Option<u64>, at: Option<i64>, highest: Option<u64>) -> Self {
        let current = current.unwrap_or(0);
        Pointer {
            current,
            switched_at_ms: at.unwrap_or(0),
            highest: highest.unwrap_or(0).max(current),
        }
    }

    /// The pointer moved back under `base`: a writer must not start, a reader
    /// reports it.
    pub fn backwards(&self, base: &str) -> Option<Backwards> {
        (self.highest > self.current).then(|| Backwards {
            key: pointer_key(base),
            current: self.current,
            highest: self.highest,
        })
    }
}

/// The pointer names an older generation than one that was current before.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the generation pointer {key} names generation {current}, but generation {highest} was current before it (a Redis failover lost the switch, or the pointer was edited): consumers still running write generation {highest}, so starting on {current} would split the counts; set it forward with `HSET {key} current {highest}` (to go back to generation {current} on purpose, stop every consumer and `HSET {key} highest {current}`)"
)]
pub struct Backwards {
    /// The pointer's key.
    pub key: String,
    /// The generation it names.
    pub current: u64,
    /// The newest generation that was current.
    pub highest: u64,
}

/// Reports a pointer that moved back, as a reader sees it: a metric and an
/// ERROR line with the remedy. Readers go on reading the generation it names.
pub fn report_backwards(backwards: &Backwards) {
    metrics::generation_backwards();
    error!(
        pointer = backwards.current,
        highest = backwards.highest,
        "{backwards}"
    );
}

/// What a writer needs to know each refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    /// The current generation.
    pub current: u64,
    /// The newest generation ever current (see [`Pointer::highest`]).
    pub highest: u64,
    /// A rebuild is about to make this generation current: hold new batches.
    pub frozen_for: Option<u64>,
}

impl State {
    /// The pointer moved back under `base` (see [`Pointer::backwards`]).
    pub fn backwards(&self, base: &str) -> Option<Backwards> {
        Pointer {
            current: self.current,
            switched_at_ms: 0,
            highest: self.highest,
        }
        .backwards(base)
    }
}

/// Reads the pointer.
pub async fn read_pointer(store: &Shared, base: &str) -> Result<Pointer, RedisError> {
    let key = pointer_key(base);
    let fields: PointerFields = store
        .call(|mut s| {
            let key = key.clone();
            async move {
                redis::cmd("HMGET")
                    .arg(&key)
                    .arg("current")
                    .arg("switched_at_ms")
                    .arg("highest")
                    .query_async(&mut s)
                    .await
            }
        })
        .await?;
    Pointer::parse(&key, fields)
}

/// The pointer's fields as Redis holds them: `current`, `switched_at_ms`, `highest`.
type PointerFields = (Option<Vec<u8>>, Option<Vec<u8>>, Option<Vec<u8>>);

/// Reads the pointer synchronously (for the blocking commands).
pub fn read_pointer_blocking(
    conn: &mut dyn redis::ConnectionLike,
    base: &str,
) -> Result<Pointer, RedisError> {
    let key = pointer_key(base);
    let fields: PointerFields = redis::cmd("HMGET")
        .arg(&key)
        .arg("current")
        .arg("switched_at_ms")
        .arg("highest")
        .query(conn)?;
    Pointer::parse(&key, fields)
}

/// Records, for writers and readers started later, that generation `k` is
/// the one running writers write while the pointer names an older one.
/// Only raises `highest`; two writers racing here write the same `k`.
pub async fn record_highest(store: &Shared, base: &str, k: u64) -> Result<(), RedisError> {
    if read_pointer(store, base).await?.highest >= k {
        return Ok(());
    }
    let key = pointer_key(base);
    store
        .call(|mut s| async move {
            redis::cmd("HSET")
                .arg(&key)
                .arg("highest")
                .arg(k)
                .query_async::<()>(&mut s)
                .await
        })
        .await
}

/// Reads the freeze flag, then the pointer. A switch moves the pointer
/// before it deletes the flag, so in this order a flag seen gone means the
/// pointer read after it has moved. Read the other way round, a switch made
/// between the two reads looks like a freeze lifted with the pointer still
/// on the old generation, and a writer would go on writing it until its
/// next read, or for good if the pointer went back meanwhile.
pub async fn read_state(store: &Shared, base: &str) -> Result<State, RedisError> {
    let key = freeze_key(base);
    let raw: Option<Vec<u8>> = store
        .call(|mut s| {
            let key = key.clone();
            async move { redis::cmd("GET").arg(&key).query_async(&mut s).await }
        })
        .await?;
    let frozen: Option<u64> = stored_number(raw, |value| {
        format!(
            "{key} holds {value:?}, which is not a generation and not a value tally writes; a rebuild's switch cannot be held for: delete it if no `tally rebuild` is switching now, or set it to the generation the rebuild writes"
        )
    })?;
    let pointer = read_pointer(store, base).await?;
    Ok(State {
        current: pointer.current,
        highest: pointer.highest,
        frozen_for: frozen.filter(|&k| k > pointer.current),
    })
}

/// The layout of the current generation, from a base layout; a pointer
/// that moved back is reported.
pub async fn current_layout(store: &Shared, base: &KeyLayout) -> Result<KeyLayout, RedisError> {
    let pointer = read_pointer(store, base.prefix()).await?;
    if let Some(backwards) = pointer.backwards(base.prefix()) {
        report_backwards(&backwards);
    }
    Ok(base.with_prefix(prefix_of(base.prefix(), pointer.current)))
}

/// Sets (or renews) the freeze flag for generation `k`.
pub async fn freeze(store: &Shared, base: &str, k: u64) -> Result<(), RedisError> {
    let key = freeze_key(base);
    store
        .call(|mut s| async move {
            redis::cmd("SET")
                .arg(&key)
                .arg(k)
                .arg("PX")
                .arg(FREEZE_TTL.as_millis() as u64)
                .query_async::<()>(&mut s)
                .await
        })
        .await
}

/// Removes the freeze flag.
pub async fn unfreeze(store: &Shared, base: &str) -> Result<(), RedisError> {
    let key = freeze_key(base);
    store
        .call(|mut s| async move { redis::cmd("DEL").arg(&key).query_async::<()>(&mut s).await })
        .await
}

/// Makes generation `k` current, then lifts the freeze and drops the rebuild
/// record. The pointer moves first: a crash after it leaves a record and a
/// flag that name a generation no longer above the pointer, which readers of
/// [`read_state`] and [`read_record`] ignore.
pub async fn switch(store: &Shared, base: &str, k: u64) -> Result<(), RedisError> {
    let pointer = pointer_key(base);
    let now = wall_ms();
    store
        .call(|mut s| async move {
            redis::cmd("HSET")
                .arg(&pointer)
                .arg("current")
                .arg(k)
                .arg("switched_at_ms")
                .arg(now)
                .arg("highest")
                .arg(k)
                .query_async::<()>(&mut s)
                .await
        })
        .await?;
    unfreeze(store, base).await?;
    drop_record(store, base).await
}

/// An unfinished rebuild.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The generation being filled.
    pub generation: u64,
    /// When it started (milliseconds since the epoch).
    pub started_at_ms: i64,
    /// Whether the routing registry was copied into it.
    pub copied: bool,
    /// When the rebuild process last said it runs (milliseconds since the
    /// epoch; 0 if never): see [`heartbeat`].
    pub alive_at_ms: i64,
}

impl Record {
    /// Whether a rebuild process has said it runs within [`ALIVE_FOR`].
    pub fn running(&self, now_ms: i64) -> bool {
        now_ms - self.alive_at_ms < ALIVE_FOR.as_millis() as i64
    }
}

/// A rebuild says it runs every [`HEARTBEAT_EVERY`]; one silent for this
/// long is taken for dead.
pub const ALIVE_FOR: Duration = Duration::from_secs(10);
/// How often a running rebuild says so.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);

/// Says, in the rebuild record, that the rebuild process runs.
pub async fn heartbeat(store: &Shared, base: &str) -> Result<(), RedisError> {
    let key = record_key(base);
    let now = wall_ms();
    store
        .call(|mut s| async move {
            redis::cmd("HSET")
                .arg(&key)
                .arg("alive_at_ms")
                .arg(now)
                .query_async::<()>(&mut s)
                .await
        })
        .await
}

/// Reads the rebuild record; a record at or below the pointer is stale (its
/// switch finished) and reads as `None`.
pub async fn read_record(store: &Shared, base: &str) -> Result<Option<Record>, RedisError> {
    let key = record_key(base);
    type Fields = (Option<u64>, Option<i64>, Option<u8>, Option<i64>);
    let (generation, started, copied, alive): Fields = store
        .call(|mut s| async move {
            redis::cmd("HMGET")
                .arg(&key)
                .arg("generation")
                .arg("started_at_ms")
                .arg("copied")
                .arg("alive_at_ms")
                .query_async(&mut s)
                .await
        })
        .await?;
    let current = read_pointer(store, base).await?.current;
    Ok(generation
        .filter(|&k| k > current)
        .map(|generation| Record {
            generation,
            started_at_ms: started.unwrap_or(0),
            copied: copied == Some(1),
            alive_at_ms: alive.unwrap_or(0),
        }))
}

/// Writes the rebuild record.
pub async fn write_record(store: &Shared, base: &str, record: Record) -> Result<(), RedisError> {
    let key = record_key(base);
    store
        .call(|mut s| async move {
            redis::cmd("HSET")
                .arg(&key)
                .arg("generation")
                .arg(record.generation)
                .arg("started_at_ms")
                .arg(record.started_at_ms)
                .arg("copied")
                .arg(u8::from(record.copied))
                .arg("alive_at_ms")
                .arg(record.alive_at_ms)
                .query_async::<()>(&mut s)
                .await
        })
        .await
}

/// Drops the rebuild record.
pub async fn drop_record(store: &Shared, base: &str) -> Result<(), RedisError> {
    let key = record_key(base);
    store
        .call(|mut s| async move { redis::cmd("DEL").arg(&key).query_async::<()>(&mut s).await })
        .await
}

/// A writer's view of the pointer and the freeze flag, kept fresh by a
/// background task: every `every`, and every [`FROZEN_POLL`] while frozen,
/// so a frozen writer sees the switch within a few tens of milliseconds.
#[derive(Clone)]
pub struct GenerationWatch {
    state: watch::Receiver<State>,
}

impl GenerationWatch {
    /// Reads once, then keeps reading until `shutdown`.
    pub async fn start(
        store: Shared,
        base: String,
        every: Duration,
        shutdown: CancellationToken,
    ) -> Result<Self, RedisError> {
        let first = read_state(&store, &base).await?;
        let (send, state) = watch::channel(first);
        tasks::spawn("generation-follower", async move {
            let mut last = first;
            // The stray value last reported, until the pointer reads again.
            let mut stray: Option<String> = None;
            metrics::generation_pointer_unreadable(false);
            loop {
                let pause = if last.frozen_for.is_some() {
                    FROZEN_POLL
                } else {
                    every
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                match read_state(&store, &base).await {
                    Ok(state) => {
                        if stray.take().is_some() {
                            info!(
                                generation = state.current,
                                "The generation pointer reads again."
                            );
                        }
                        metrics::generation_pointer_unreadable(false);
                        last = state;
                        if send.send(state).is_err() {
                            return;
                        }
                    }
                    Err(error) => {
                        // Unreadable: hold nothing back; the pointer is read again soon.
                        last.frozen_for = None;
                        let _ = send.send(last);
                        match stray_detail(&error) {
                            // Not a retry that will pass: said once, and kept
                            // on the gauge (and its alert) until set right.
                            Some(detail) => {
                                metrics::generation_pointer_unreadable(true);
                                if stray.as_deref() != Some(detail) {
                                    error!(
                                        generation = last.current,
                                        "{detail}; this consumer goes on writing the generation it last read, and no rebuild can switch while the pointer is unreadable."
                                    );
                                    stray = Some(detail.to_string());
                                }
                            }
                            None => {
                                warn!(%error, "Reading the generation pointer failed; retrying.")
                            }
                        }
                    }
                }
            }
        });
        Ok(Self { state })
    }

    /// The newest state read.
    pub fn current(&self) -> State {
        *self.state.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_zero_keeps_the_base_names() {
        assert_eq!(prefix_of("tally", 0), "tally");
        assert_eq!(prefix_of("tally", 3), "tally:g3");
        for key in [
            "tally:likes:1:2",
            "tally:fence:g:likes:0",
            "tally:origin:g:likes:0",
            "tally:route:9",
            "tally:routes",
            "tally:heat:17",
        ] {
            assert_eq!(generation_of("tally", key), Some(0), "{key}");
        }
        assert_eq!(generation_of("tally", "tally:g1:likes:1:2"), Some(1));
        assert_eq!(generation_of("tally", "tally:g12:routes"), Some(12));
        for other in [
            "tally:generation",
            "tally:freeze",
            "tally:rebuild",
            "tally:g:likes:1",
            "tally:gx1:likes:1",
            "tallyx:likes:1:2",
            "other:likes:1:2",
            "tally:g0:likes:1:2",
        ] {
            assert_eq!(generation_of("tally", other), None, "{other}");
        }
        // Generation 1's keys never match generation 10's prefix, nor the reverse.
        assert_eq!(generation_of("tally", "tally:g10:likes:1:2"), Some(10));
    }
}
