//! Inspect: where a post's bucket keys live, and whether placement luck
//! overloads a primary.
//!
//! For each bucket key of a post: its hash slot, the primary that owns the
//! slot now, and its value. Per primary: how many buckets it holds against
//! the Binomial(N, 1/M) expectation (mean N/M, σ = sqrt(N·(1/M)·(1−1/M))),
//! flagging primaries above mean + 2σ (the maths and the slot map are in
//! [`crate::placement`]). A single server is one primary that holds everything.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use crate::placement::{SlotMap, binomial};
use crate::routing::KeyLayout;
use crate::slots::{SlotGroups, key_slot};
use crate::store::{Target, connect_blocking};

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
    let mut per_primary = vec![0u32; map.primary_count()];
    let mut out = String::new();
    let mut total = 0i64;
    writeln!(
        out,
        "post {} — {} buckets over {} primaries",
        args.post_id,
        args.buckets,
        map.primary_count()
    )?;
    writeln!(
        out,
        "{:>6}  {:>5}  {:<21}  {:>10}  key",
        "bucket", "slot", "primary", "value"
    )?;
    for bucket in 0..args.buckets {
        let key = keys.counter_key(args.post_id, bucket);
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
            "{bucket:>6}  {slot:>5}  {owner:<21}  {:>10}  {key}",
            value.unwrap_or(0)
        )?;
    }
    let (mean, sigma) = binomial(args.buckets, map.primary_count());
    writeln!(out, "count {total}")?;
    writeln!(
        out,
        "per primary (Binomial mean {mean:.2}, σ {sigma:.2}, flag above {:.2}):",
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
