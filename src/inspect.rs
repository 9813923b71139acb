//! Inspect: where a post's bucket keys live, and whether placement luck
//! overloads a primary.
//!
//! For each bucket key of every routing version of a post: its hash slot, the primary that owns the
//! slot now, and its value. Per primary: how many buckets it holds against
//! the Binomial(N, 1/M) expectation (mean N/M, σ = sqrt(N·(1/M)·(1−1/M))),
//! flagging primaries above mean + 2σ (for the newest version, the one
//! taking new likes). A single server is one primary that
//! holds everything.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;

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
    #[arg(long, env = "TALLY_SLOT_GROUPS", default_value_t = 128)]
    pub slot_groups: u32,
}

/// Per primary: buckets held, expected mean, standard deviation.
pub fn binomial(buckets: u32, primaries: usize) -> (f64, f64) {
    let n = f64::from(buckets);
    let p = 1.0 / primaries.max(1) as f64;
    (n * p, (n * p * (1.0 - p)).sqrt())
}

/// Owner of each slot range: (first, last, "host:port").
fn slot_owners(target: &Target) -> Result<Vec<(u16, u16, String)>> {
    match target {
        Target::Single(url) => {
            let host = url
                .split("://")
                .nth(1)
                .unwrap_or(url)
                .rsplit('@')
                .next()
                .unwrap_or(url);
            Ok(vec![(
                0,
                crate::slots::SLOTS - 1,
                host.trim_end_matches('/')
                    .split('/')
                    .next()
                    .unwrap_or(host)
                    .to_string(),
            )])
        }
        Target::Cluster(nodes) => {
            for node in nodes {
                let Ok(client) = redis::Client::open(node.as_str()) else {
                    continue;
                };
                let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(2))
                else {
                    continue;
                };
                let slots: Vec<redis::Value> =
                    redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn)?;
                let mut owners = Vec::new();
                for range in slots {
                    let redis::Value::Array(fields) = range else {
                        continue;
                    };
                    let (Some(start), Some(end), Some(redis::Value::Array(primary))) =
                        (fields.first(), fields.get(1), fields.get(2))
                    else {
                        continue;
                    };
                    let start: i64 = redis::from_redis_value_ref(start)?;
                    let end: i64 = redis::from_redis_value_ref(end)?;
                    let host: String = redis::from_redis_value_ref(&primary[0])?;
                    let port: i64 = redis::from_redis_value_ref(&primary[1])?;
                    owners.push((start as u16, end as u16, format!("{host}:{port}")));
                }
                return Ok(owners);
            }
            bail!("no cluster node answered")
        }
    }
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
    let owners = slot_owners(&target).context("reading the slot map")?;
    let mut conn = connect_blocking(&target, Duration::from_secs(3)).with_context(|| {
        format!(
            "cannot reach Redis at {}",
            crate::apply::redact_url(&args.redis)
        )
    })?;
    let primaries: std::collections::BTreeSet<&str> =
        owners.iter().map(|(_, _, o)| o.as_str()).collect();
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
        primaries.len(),
        meta.mode.as_deref().unwrap_or("default"),
        meta.current.unwrap_or(0),
    )?;
    writeln!(
        out,
        "{:>7}  {:>6}  {:>5}  {:<21}  {:>10}  key",
        "version", "bucket", "slot", "primary", "value"
    )?;
    let mut newest: BTreeMap<&str, u32> = BTreeMap::new();
    for &(version, buckets) in &meta.versions {
        let is_newest = Some(&(version, buckets)) == meta.versions.last();
        newest = primaries.iter().map(|p| (*p, 0)).collect();
        for bucket in 0..buckets {
            let key = keys.key_of(CounterId {
                post_id: args.post_id,
                version,
                bucket,
            });
            let slot = key_slot(key.as_bytes());
            let owner = owners
                .iter()
                .find(|(s, e, _)| (*s..=*e).contains(&slot))
                .map_or("(unassigned)", |(_, _, o)| o.as_str());
            if let Some(n) = newest.get_mut(owner)
                && is_newest
            {
                *n += 1;
            }
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
    let (mean, sigma) = binomial(buckets, primaries.len());
    writeln!(
        out,
        "version {version} per primary (Binomial mean {mean:.2}, σ {sigma:.2}, flag above {:.2}):",
        mean + 2.0 * sigma
    )?;
    for (primary, n) in newest {
        let flag = if f64::from(n) > mean + 2.0 * sigma {
            "  <- above mean + 2σ"
        } else {
            ""
        };
        writeln!(out, "  {primary:<21} {n:>4}{flag}")?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_figures() {
        let (mean, sigma) = binomial(64, 16);
        assert!((mean - 4.0).abs() < 1e-9);
        assert!((sigma - (64.0f64 * (1.0 / 16.0) * (15.0 / 16.0)).sqrt()).abs() < 1e-9);
        assert_eq!(binomial(16, 1), (16.0, 0.0));
    }
}
