//! GC: removing generations no reader sums any more.
//!
//! Invariant: `tally gc` deletes only keys of generations *below* the current
//! one (see [`crate::domain::generation::generation_of`] for which keys those are),
//! and only once the pointer has pointed past them for longer than the
//! grace period: a reader that resolved the old pointer finishes its read
//! within [`crate::domain::versions::READ_DEADLINE`] and trusts a pointer for at most
//! [`crate::read::POINTER_TTL`], so after a grace of minutes nobody sums them.
//! The current generation, an unfinished one above it, the pointer, the
//! freeze flag and the rebuild record are never touched.
//!
//! Keys are found with SCAN and removed with single-key UNLINKs, on the one
//! server or on every primary of a cluster in turn (SCAN walks one node).

use std::time::Duration;

use redis::RedisError;

use crate::domain::generation::{self, generation_of};
use crate::domain::layout;
use crate::domain::placement::scan;
use crate::domain::versions::wall_ms;
use crate::infra::config::StoreSettings;
use crate::infra::store::Target;
use crate::ops::OpError;

/// Deletes every key under `base` whose generation `doomed` selects; returns
/// how many were deleted. `pattern` narrows the scan (`<base>:*` for all).
pub fn delete_generations(
    target: &Target,
    base: &str,
    pattern: &str,
    doomed: impl Fn(u64) -> bool,
) -> Result<u64, RedisError> {
    let mut deleted = 0;
    scan(target, pattern, |conn, keys| {
        let mut pipe = redis::pipe();
        let mut any = false;
        for key in keys
            .iter()
            .filter(|k| generation_of(base, k).is_some_and(&doomed))
        {
            pipe.cmd("UNLINK").arg(key);
            any = true;
        }
        if any {
            let removed: Vec<u64> = pipe.query(conn)?;
            deleted += removed.iter().sum::<u64>();
        }
        Ok(())
    })?;
    Ok(deleted)
}

/// Deletes every key of generation `k` (an unfinished or abandoned one).
pub fn drop_generation(target: &Target, base: &str, k: u64) -> Result<u64, RedisError> {
    assert!(k > 0, "generation 0 is never dropped whole");
    let pattern = format!("{}:*", generation::prefix_of(base, k));
    delete_generations(target, base, &pattern, |g| g == k)
}

/// What `tally gc` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collected {
    /// Generation 0 is current: there is nothing older.
    NothingOlder,
    /// The current generation is younger than the grace period: nothing removed.
    TooRecent {
        /// The current generation.
        current: u64,
        /// How long it has been current.
        age: Duration,
    },
    /// Keys of older generations removed.
    Removed {
        /// The current generation.
        current: u64,
        /// How long it has been current.
        age: Duration,
        /// Keys deleted.
        deleted: u64,
    },
}

/// Removes every generation below the current one, once the current one has
/// been current for `grace`.
pub async fn gc(settings: &StoreSettings, grace: Duration) -> Result<Collected, OpError> {
    let opened = layout::open(settings).await?;
    let base = settings.prefix().to_string();
    let pointer = generation::read_pointer(&opened.store, &base).await?;
    if pointer.current == 0 {
        return Ok(Collected::NothingOlder);
    }
    let age = Duration::from_millis((wall_ms() - pointer.switched_at_ms).max(0) as u64);
    let current = pointer.current;
    if age < grace {
        return Ok(Collected::TooRecent { current, age });
    }
    let target = opened.target().clone();
    let pattern = format!("{base}:*");
    let deleted = tokio::task::spawn_blocking(move || {
        delete_generations(&target, &base, &pattern, |g| g < current)
    })
    .await??;
    Ok(Collected::Removed {
        current,
        age,
        deleted,
    })
}
