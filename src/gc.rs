//! GC: removing generations no reader sums any more.
//!
//! Invariant: `tally gc` deletes only keys of generations *below* the current
//! one (see [`crate::generation::generation_of`] for which keys those are),
//! and only once the pointer has pointed past them for longer than the
//! grace period: a reader that resolved the old pointer finishes its read
//! within [`crate::versions::READ_DEADLINE`] and trusts a pointer for at most
//! [`crate::read::POINTER_TTL`], so after a grace of minutes nobody sums them.
//! The current generation, an unfinished one above it, the pointer, the
//! freeze flag and the rebuild record are never touched.
//!
//! Keys are found with SCAN and removed with single-key UNLINKs, on the one
//! server or on every primary of a cluster in turn (SCAN walks one node).

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use redis::{ConnectionLike, RedisError};

use crate::generation::{self, generation_of};
use crate::placement::SlotMap;
use crate::read::StoreArgs;
use crate::store::{Target, connect_blocking};
use crate::versions::wall_ms;

/// Settings of `tally gc`.
#[derive(Debug, Clone, Args)]
pub struct GcArgs {
    /// Remove older generations only once the current one has been current
    /// this long (seconds).
    #[arg(long, default_value_t = 3_600)]
    pub grace_secs: u64,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
}

/// The URL of one node of a cluster, with the credentials of `template`.
fn node_url(template: &str, host_port: &str) -> String {
    let (scheme, rest) = template.split_once("://").unwrap_or(("redis", template));
    let auth = rest
        .rsplit_once('@')
        .map(|(auth, _)| format!("{auth}@"))
        .unwrap_or_default();
    format!("{scheme}://{auth}{host_port}/")
}

/// The servers to scan: the one server, or every primary of a cluster.
pub fn scan_nodes(target: &Target) -> Result<Vec<Target>, RedisError> {
    match target {
        Target::Single(_) => Ok(vec![target.clone()]),
        Target::Cluster(nodes) => {
            let map = SlotMap::read(target)?;
            Ok(map
                .primaries()
                .iter()
                .map(|primary| Target::Single(node_url(&nodes[0], primary)))
                .collect())
        }
    }
}

/// Calls `each` with every batch of keys matching `pattern`, node by node,
/// with a connection to the node that holds them.
pub fn scan(
    target: &Target,
    pattern: &str,
    mut each: impl FnMut(&mut dyn ConnectionLike, Vec<String>) -> Result<(), RedisError>,
) -> Result<(), RedisError> {
    for node in scan_nodes(target)? {
        let mut conn = connect_blocking(&node, Duration::from_secs(5))?;
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1_000)
                .query(conn.as_mut())?;
            if !keys.is_empty() {
                each(conn.as_mut(), keys)?;
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
    }
    Ok(())
}

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

/// Runs `tally gc`; returns what to print.
pub async fn gc_command(args: &GcArgs) -> Result<String> {
    let (store, keys, _) = args.store.connect(crate::config::DEFAULT_BUCKETS).await?;
    let base = keys.prefix().to_string();
    let pointer = generation::read_pointer(&store, &base).await?;
    if pointer.current == 0 {
        return Ok("generation 0 is current; nothing to remove\n".into());
    }
    let age_secs = (wall_ms() - pointer.switched_at_ms).max(0) as u64 / 1_000;
    if age_secs < args.grace_secs {
        return Ok(format!(
            "generation {} became current {age_secs} s ago; older generations stay until the grace of {} s has passed\n",
            pointer.current, args.grace_secs
        ));
    }
    let target = Target::parse(&args.store.redis).map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
    let current = pointer.current;
    let pattern = format!("{base}:*");
    let deleted = tokio::task::spawn_blocking(move || {
        delete_generations(&target, &base, &pattern, |g| g < current)
    })
    .await?
    .context("removing old generations")?;
    Ok(format!(
        "removed {deleted} keys of generations below {current} (current for {age_secs} s)\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_node_urls_keep_the_credentials() {
        assert_eq!(
            node_url("redis://u:p@a:1", "10.0.0.2:7001"),
            "redis://u:p@10.0.0.2:7001/"
        );
        assert_eq!(node_url("rediss://a:1", "b:2"), "rediss://b:2/");
    }
}
