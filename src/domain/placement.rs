//! Placement: which primary owns each hash slot, and how unevenly a post's
//! buckets fall on primaries.
//!
//! Keys reach primaries through CRC16 slots, so a post's N bucket keys land on
//! M primaries like N balls thrown into M bins: the buckets one primary holds
//! follow Binomial(N, 1/M), with mean N/M and σ = sqrt(N·(1/M)·(1−1/M)). The
//! busiest of M primaries typically sits near mean + sqrt(2 ln M)·σ, well
//! above the mean when N is not much larger than M. `tally inspect` compares a
//! real post against these figures and `tally plan` sizes a cluster with them;
//! both take slot ownership from here, read live from a cluster or laid out
//! the way `redis-cli --cluster create` splits the slots.

use std::time::Duration;

use redis::{ConnectionLike, RedisError, Value};

use crate::domain::routing::{CounterId, KeyLayout};
use crate::domain::slots::SLOTS;

use crate::infra::security::UrlParts;
use crate::infra::store::{Target, connect_blocking};

/// Buckets per primary under random placement: (mean N/M, σ) of Binomial(N, 1/M).
pub fn binomial(buckets: u32, primaries: usize) -> (f64, f64) {
    let n = f64::from(buckets);
    let p = 1.0 / primaries.max(1) as f64;
    (n * p, (n * p * (1.0 - p)).sqrt())
}

/// The rule of thumb for the largest of `bins` draws with this mean and σ:
/// mean + sqrt(2 ln bins)·σ.
pub fn busiest(mean: f64, sigma: f64, bins: usize) -> f64 {
    mean + (2.0 * (bins.max(1) as f64).ln()).sqrt() * sigma
}

/// The busiest of M primaries under random placement, in buckets.
pub fn busiest_rule(buckets: u32, primaries: usize) -> f64 {
    let (mean, sigma) = binomial(buckets, primaries);
    busiest(mean, sigma, primaries)
}

/// The owner of every hash slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotMap {
    primaries: Vec<String>,
    /// Index into `primaries` per slot; `None` while a slot is unassigned.
    owner: Vec<Option<usize>>,
}

impl SlotMap {
    /// One server that owns every slot.
    pub fn single(name: impl Into<String>) -> Self {
        Self {
            primaries: vec![name.into()],
            owner: vec![Some(0); usize::from(SLOTS)],
        }
    }

    /// `primaries` contiguous ranges, split the way `redis-cli --cluster create` does.
    pub fn even(primaries: usize) -> Self {
        let count = primaries.clamp(1, usize::from(SLOTS));
        let per = f64::from(SLOTS) / count as f64;
        let mut owner = vec![None; usize::from(SLOTS)];
        let (mut first, mut cursor) = (0usize, 0.0f64);
        for primary in 0..count {
            let mut last = (cursor + per - 1.0).round() as usize;
            if primary == count - 1 || last >= usize::from(SLOTS) {
                last = usize::from(SLOTS) - 1;
            }
            last = last.max(first);
            owner[first..=last].fill(Some(primary));
            first = last + 1;
            cursor += per;
        }
        Self {
            primaries: (1..=count).map(|i| format!("primary-{i}")).collect(),
            owner,
        }
    }

    /// From `(first slot, last slot, primary)` ranges, as CLUSTER SLOTS reports them.
    pub fn from_ranges(ranges: &[(u16, u16, String)]) -> Self {
        let mut primaries: Vec<String> = ranges.iter().map(|(_, _, p)| p.clone()).collect();
        primaries.sort();
        primaries.dedup();
        let mut owner = vec![None; usize::from(SLOTS)];
        for (first, last, name) in ranges {
            let last = usize::from(*last).min(usize::from(SLOTS) - 1);
            owner[usize::from(*first)..=last].fill(primaries.binary_search(name).ok());
        }
        Self { primaries, owner }
    }

    /// Reads the live map: CLUSTER SLOTS from any node of a cluster; a single
    /// server owns every slot.
    pub fn read(target: &Target) -> Result<Self, RedisError> {
        match target.is_cluster() {
            false => Ok(Self::single(host_of(&target.nodes()[0]))),
            true => {
                let mut conn = connect_blocking(target, Duration::from_secs(3))?;
                let reply: Vec<Value> = redis::cmd("CLUSTER").arg("SLOTS").query(conn.as_mut())?;
                let mut ranges = Vec::new();
                for range in reply {
                    let Value::Array(fields) = range else {
                        continue;
                    };
                    let (Some(first), Some(last), Some(Value::Array(primary))) =
                        (fields.first(), fields.get(1), fields.get(2))
                    else {
                        continue;
                    };
                    let first: u16 = redis::from_redis_value_ref(first)?;
                    let last: u16 = redis::from_redis_value_ref(last)?;
                    let host: String = redis::from_redis_value_ref(&primary[0])?;
                    let port: u16 = redis::from_redis_value_ref(&primary[1])?;
                    ranges.push((first, last, format!("{host}:{port}")));
                }
                Ok(Self::from_ranges(&ranges))
            }
        }
    }

    /// Number of primaries that own at least one slot.
    pub fn primary_count(&self) -> usize {
        self.primaries.len()
    }

    /// Names of the primaries (`host:port` when read live).
    pub fn primaries(&self) -> &[String] {
        &self.primaries
    }

    /// Index of the primary that owns `slot`, if any.
    pub fn owner_of(&self, slot: u16) -> Option<usize> {
        self.owner.get(usize::from(slot)).copied().flatten()
    }
}

/// `host:port` of a single-server URL, without scheme, credentials or database.
fn host_of(url: &str) -> String {
    UrlParts::parse(url).hosts.join(",")
}

/// The servers to scan: the one server, or every primary of a cluster.
pub fn scan_nodes(target: &Target) -> Result<Vec<Target>, RedisError> {
    match target.is_cluster() {
        false => Ok(vec![target.clone()]),
        true => {
            let map = SlotMap::read(target)?;
            Ok(map
                .primaries()
                .iter()
                .map(|primary| target.node(primary))
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

/// Calls `each` with every counter of the generation `layout` names and
/// its value, node by node: each string key (a GET each), or every field of
/// the packed hashes (an HGETALL each). A field that names no counter or
/// holds no integer is an error naming it.
pub fn scan_counters(
    target: &Target,
    layout: &KeyLayout,
    mut each: impl FnMut(CounterId, i64),
) -> Result<(), RedisError> {
    let bad = |key: &str, what: &str| {
        RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "not a counter",
            format!("{key}{what}"),
        ))
    };
    scan(target, &layout.counters_pattern(), |conn, keys| {
        for key in keys {
            if layout.is_packed() {
                let fields: Vec<(String, String)> = redis::cmd("HGETALL").arg(&key).query(conn)?;
                for (field, value) in fields {
                    let id = layout
                        .parse_field(&field)
                        .ok_or_else(|| bad(&key, &format!(" field {field}")))?;
                    let value = value
                        .parse()
                        .map_err(|_| bad(&key, &format!(" field {field}: {value}")))?;
                    each(id, value);
                }
            } else if let Some(id) = layout.parse_counter_key(&key) {
                let value: Option<i64> = redis::cmd("GET").arg(&key).query(conn)?;
                each(id, value.unwrap_or(0));
            }
        }
        Ok(())
    })
}

/// Calls `each` with every post's likes in every window under `layout`'s
/// prefix, node by node (an HGETALL of each window's counts); a field that
/// names no post, other than the leaders' floor, is an error naming it.
pub fn scan_windows(
    target: &Target,
    layout: &KeyLayout,
    mut each: impl FnMut(crate::domain::windows::WindowSize, i64, u64, i64),
) -> Result<(), RedisError> {
    scan(target, &layout.windows_pattern(), |conn, keys| {
        for key in keys {
            let Some((size, start)) = layout.parse_window_key(&key) else {
                continue;
            };
            let members: Vec<(Vec<u8>, i64)> = redis::cmd("HGETALL").arg(&key).query(conn)?;
            for (member, likes) in members {
                if member == crate::domain::windows::FLOOR_FIELD.as_bytes() {
                    continue;
                }
                let post = crate::domain::windows::post_of(&member).ok_or_else(|| {
                    RedisError::from((
                        redis::ErrorKind::UnexpectedReturnType,
                        "not a window member",
                        format!("{key} member {member:?}"),
                    ))
                })?;
                each(size, start, post, likes);
            }
        }
        Ok(())
    })
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
        // M = 10: sqrt(2 ln 10) ≈ 2.15.
        let (mean, sigma) = binomial(100, 10);
        assert!((busiest_rule(100, 10) - mean - 2.146 * sigma).abs() < 0.01);
    }

    #[test]
    fn even_map_matches_cluster_create() {
        // redis-cli --cluster create with three primaries: 0-5460, 5461-10922, 10923-16383.
        let map = SlotMap::even(3);
        assert_eq!(map.primary_count(), 3);
        assert_eq!(
            [0, 5460, 5461, 10922, 10923, 16383].map(|s| map.owner_of(s)),
            [Some(0), Some(0), Some(1), Some(1), Some(2), Some(2)]
        );
        let map = SlotMap::from_ranges(&[(0, 99, "b:1".into()), (100, 16383, "a:1".into())]);
        assert_eq!(map.primaries(), ["a:1", "b:1"]);
        assert_eq!((map.owner_of(5), map.owner_of(100)), (Some(1), Some(0)));
        assert_eq!(host_of("redis://u:p@h:6379/0"), "h:6379");
    }
}
