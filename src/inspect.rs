//! Inspect: where a post's bucket keys live, and whether placement luck
//! overloads a primary.
//!
//! For each bucket key of every routing version of a post: its hash slot, the primary that owns the
//! slot now, and its value. Per primary: how many buckets it holds against
//! the Binomial(N, 1/M) expectation (mean N/M, σ = sqrt(N·(1/M)·(1−1/M))),
//! flagging primaries above mean + 2σ for the newest version (the maths and the slot map are in
//! [`crate::placement`]). A single server is one primary that holds everything.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use crate::placement::{SlotMap, binomial};
use crate::routing::{CounterId, KeyLayout};
use crate::slots::{SlotGroups, key_slot};
use crate::store::{Target, connect_blocking};
use crate::versions::PostMeta;

/// Settings of `tally inspect post`.
#[derive(Debug, Clone, Args)]
pub struct InspectPost {
    /// The post to inspect.
    pub post_id: u64,
    /// Buckets per post (as `tally run --buckets`).
    #[arg(long, env = "TALLY_BUCKETS", default_value_t = crate::config::DEFAULT_BUCKETS)]
    pub buckets: u32,
    /// Redis URL (as `tally run --redis`).
    #[arg(long, env = "TALLY_REDIS", default_value = "redis://127.0.0.1:6379/")]
    pub redis: String,
    /// Key prefix (as `tally run --prefix`).
    #[arg(long, env = "TALLY_PREFIX", default_value = crate::config::DEFAULT_PREFIX)]
    pub prefix: String,
    /// Slot groups on a cluster (as `tally run --slot-groups`).
    #[arg(long, env = "TALLY_SLOT_GROUPS", default_value_t = crate::config::DEFAULT_SLOT_GROUPS)]
    pub slot_groups: u32,
}

/// Renders the report for one post.
pub fn inspect_post(args: &InspectPost) -> Result<String> {
    let target = Target::parse(&args.redis).map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
    let groups = if target.is_cluster() {
        SlotGroups::cluster(args.slot_groups)
    } else {
        SlotGroups::single()
    };
    let keys = KeyLayout::with_groups(&args.prefix, groups);
    let map = SlotMap::read(&target).context("reading the slot map")?;
    let mut conn = connect_blocking(&target, Duration::from_secs(3)).with_context(|| {
        format!(
            "cannot reach Redis at {}",
            crate::apply::redact_url(&args.redis)
        )
    })?;
    let current = crate::generation::read_pointer_blocking(conn.as_mut(), &args.prefix)?;
    let keys = keys.with_prefix(crate::generation::prefix_of(&args.prefix, current));
    let fields: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.route_key(args.post_id))
        .query(conn.as_mut())?;
    let meta = PostMeta::from_fields(&fields, args.buckets);
    let mut out = String::new();
    let mut total = meta.base;
    writeln!(
        out,
        "post {} — {} over {} primaries (mode {}, current version {})",
        args.post_id,
        meta.versions
            .iter()
            .map(|(v, n)| format!("version {v}: {n} buckets"))
            .collect::<Vec<_>>()
            .join(", "),
        map.primary_count(),
        meta.mode.as_deref().unwrap_or("default"),
        meta.current.unwrap_or(0),
    )?;
    writeln!(
        out,
        "{:>7}  {:>6}  {:>5}  {:<21}  {:>10}  key",
        "version", "bucket", "slot", "primary", "value"
    )?;
    // Placement is judged for the newest version, the one taking new likes.
    let mut per_primary = vec![0u32; map.primary_count()];
    for &(version, buckets) in &meta.versions {
        per_primary.iter_mut().for_each(|n| *n = 0);
        for bucket in 0..buckets {
            let key = keys.key_of(CounterId {
                post_id: args.post_id,
                version,
                bucket,
            });
            let slot = key_slot(key.as_bytes());
            let owner = map.owner_of(slot);
            if let Some(primary) = owner {
                per_primary[primary] += 1;
            }
            let owner = owner.map_or("(unassigned)", |p| map.primaries()[p].as_str());
            let value: Option<i64> = redis::cmd("GET").arg(&key).query(conn.as_mut())?;
            total += value.unwrap_or(0);
            writeln!(
                out,
                "{version:>7}  {bucket:>6}  {slot:>5}  {owner:<21}  {:>10}  {key}",
                value.unwrap_or(0)
            )?;
        }
    }
    if meta.base != 0 {
        writeln!(out, "base {}", meta.base)?;
    }
    writeln!(out, "count {total}")?;
    let &(version, buckets) = meta.versions.last().expect("version 0 at least");
    let (mean, sigma) = binomial(buckets, map.primary_count());
    writeln!(
        out,
        "version {version} per primary (Binomial mean {mean:.2}, σ {sigma:.2}, flag above {:.2}):",
        mean + 2.0 * sigma
    )?;
    for (primary, n) in map.primaries().iter().zip(per_primary) {
        let flag = if f64::from(n) > mean + 2.0 * sigma {
            "  <- above mean + 2σ"
        } else {
            ""
        };
        writeln!(out, "  {primary:<21} {n:>4}{flag}")?;
    }
    Ok(out)
}
