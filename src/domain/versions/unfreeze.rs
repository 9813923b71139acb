//! Unfreezes: the registry's record of routing made final far ahead and
//! brought back to its clock (`tally unfreeze-routing`), and the rule that
//! keeps the routes of the events counted before.
//!
//! Two registry fields hold it (`route_unfreeze.lua` writes both):
//!
//! * `unfreezing` = `undone:bound:started_ms` while an unfreeze is under
//!   way: `final` was lowered to `bound`, and publications still take effect
//!   after `undone`, the final time being undone;
//! * `unfrozen`, one record per finished unfreeze, oldest first, joined by
//!   `|`: `bound/p:o,p:o,.../owner=k:buckets:effective_ms,...`, the bound, the
//!   last offset of every partition counted under the frozen routing (its
//!   *cutoff*), and the versions that took effect after the bound then
//!   (`owner` a post id, or `default` for an epoch), with their times of
//!   then: the unfreeze moved them to the clock.
//!
//! # The rule
//!
//! An event of partition `p` at offset `o`, stamped `t`, is routed by the
//! first record with `t > bound` and `o <= cutoff(p)`, if there is one, as
//! routing stood when that record was written: among the versions effective
//! at or before its bound (none is ever added or moved there) and the ones
//! it lists with their times of then. Every other event is routed by the
//! registry as it is. The argument that both agree with every route taken
//! before is in [`crate::ops::unfreeze`].

use redis::RedisError;
use rustc_hash::FxHashMap;

use super::{UNFREEZING_FIELD, UNFROZEN_FIELD, Version};
use crate::domain::routing::{DEFAULT_EPOCHS, epoch_version};

/// One finished unfreeze.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Unfreeze {
    /// Events stamped after this time, at or below their partition's cutoff,
    /// keep the routes they had (milliseconds since the epoch).
    pub bound_ms: i64,
    /// (partition, last offset counted under the frozen routing), by partition.
    pub cutoffs: Vec<(i32, i64)>,
    /// Versions of posts that took effect after the bound then, with their
    /// times of then.
    pub posts: FxHashMap<u64, Vec<Version>>,
    /// Epochs of the default layout that did (version numbers as
    /// [`epoch_version`] gives them).
    pub defaults: Vec<Version>,
}

impl Unfreeze {
    /// Whether this record fixes the route of the event at `offset` of
    /// `partition` stamped `timestamp_ms`.
    pub fn covers(&self, partition: i32, offset: i64, timestamp_ms: i64) -> bool {
        timestamp_ms > self.bound_ms
            && self
                .cutoffs
                .binary_search_by_key(&partition, |&(p, _)| p)
                .is_ok_and(|i| offset <= self.cutoffs[i].1)
    }

    /// Parses one record (`bound/cutoffs/versions`).
    fn parse(record: &str) -> Option<Self> {
        let mut parts = record.split('/');
        let bound_ms = parts.next()?.parse().ok()?;
        let cutoffs_text = parts.next()?;
        let versions_text = parts.next()?;
        if parts.next().is_some() {
            return None;
        }
        let mut cutoffs = items(cutoffs_text)
            .map(|item| {
                let (p, o) = item.split_once(':')?;
                Some((p.parse().ok()?, o.parse().ok()?))
            })
            .collect::<Option<Vec<(i32, i64)>>>()?;
        cutoffs.sort_unstable();
        let mut unfreeze = Unfreeze {
            bound_ms,
            cutoffs,
            ..Unfreeze::default()
        };
        for item in items(versions_text) {
            let (owner, entry) = item.split_once('=')?;
            let v = super::parse_entry(entry)?;
            let [v] = v[..] else { return None };
            if v.effective_ms <= bound_ms {
                return None;
            }
            if owner == "default" {
                if v.version == 0 || v.version >= DEFAULT_EPOCHS {
                    return None;
                }
                unfreeze.defaults.push(Version {
                    version: epoch_version(v.version),
                    ..v
                });
            } else if v.version > 0 {
                unfreeze
                    .posts
                    .entry(owner.parse().ok()?)
                    .or_default()
                    .push(v);
            } else {
                return None;
            }
        }
        Some(unfreeze)
    }

    /// The record as the registry holds it.
    pub fn to_field(&self) -> String {
        let cutoffs: Vec<String> = self
            .cutoffs
            .iter()
            .map(|(p, o)| format!("{p}:{o}"))
            .collect();
        let mut versions: Vec<String> = self
            .defaults
            .iter()
            .map(|v| {
                format!(
                    "default={}:{}:{}",
                    v.version - DEFAULT_EPOCHS,
                    v.buckets,
                    v.effective_ms
                )
            })
            .collect();
        let mut posts: Vec<_> = self.posts.iter().collect();
        posts.sort_unstable_by_key(|(post, _)| **post);
        for (post, list) in posts {
            for v in list {
                versions.push(format!(
                    "{post}={}:{}:{}",
                    v.version, v.buckets, v.effective_ms
                ));
            }
        }
        format!(
            "{}/{}/{}",
            self.bound_ms,
            cutoffs.join(","),
            versions.join(",")
        )
    }
}

/// Comma-separated items; none for an empty text.
fn items(text: &str) -> impl Iterator<Item = &str> {
    text.split(',').filter(|item| !item.is_empty())
}

/// Every finished unfreeze of a registry, oldest first.
pub type Unfreezes = Box<[Unfreeze]>;

/// The registry's `unfrozen` field (`None`: never unfrozen). Unreadable is
/// an error for writers: routing an event by a guess could count it in a
/// slot group a replay does not look in.
pub fn parse_unfrozen(registry: &str, field: Option<&str>) -> Result<Unfreezes, RedisError> {
    let Some(field) = field else {
        return Ok(Box::default());
    };
    field
        .split('|')
        .map(Unfreeze::parse)
        .collect::<Option<Unfreezes>>()
        .ok_or_else(|| unreadable(registry, UNFROZEN_FIELD, field))
}

/// An unfreeze under way: the registry's `unfreezing` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unfreezing {
    /// The final time being undone: publications take effect after it until
    /// the unfreeze finishes.
    pub undone_ms: i64,
    /// What `final` was lowered to.
    pub bound_ms: i64,
    /// The registry clock when it began.
    pub started_ms: i64,
}

/// The registry's `unfreezing` field, if present.
pub fn parse_unfreezing(
    registry: &str,
    field: Option<&str>,
) -> Result<Option<Unfreezing>, RedisError> {
    let Some(field) = field else {
        return Ok(None);
    };
    let numbers: Option<Vec<i64>> = field.split(':').map(|n| n.parse().ok()).collect();
    match numbers.as_deref() {
        Some(&[undone_ms, bound_ms, started_ms]) => Ok(Some(Unfreezing {
            undone_ms,
            bound_ms,
            started_ms,
        })),
        _ => Err(unreadable(registry, UNFREEZING_FIELD, field)),
    }
}

fn unreadable(registry: &str, field: &str, value: &str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unreadable routing registry",
        format!("field {field} of {registry} is {value:?}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::versions::{Defaults, GRACE_MS, RouteTable};
    use proptest::prelude::*;

    fn v(version: u32, buckets: u32, effective_ms: i64) -> Version {
        Version {
            version,
            buckets,
            effective_ms,
        }
    }

    fn entry(versions: &[Version]) -> String {
        versions
            .iter()
            .map(|v| format!("{}:{}:{}", v.version, v.buckets, v.effective_ms))
            .collect::<Vec<_>>()
            .join(";")
    }

    proptest! {
        /// The rule keeps every route the frozen registry gave: a registry frozen up to
        /// `frozen`, with versions and epochs published before the freeze (at or before the
        /// bound) and while it held (after it), is unfrozen, the latter moved to the clock and
        /// more published since. Every event at or below the cutoff is routed as the frozen
        /// table routed it; every event stamped at or before the bound too; and an event above
        /// the cutoff stamped after the last version goes to that version.
        #[test]
        fn events_keep_the_routes_the_frozen_registry_gave(
            before in 0usize..3,
            during in 0usize..3,
            epochs_before in 0usize..2,
            epochs_during in 0usize..2,
            since in 0usize..3,
            stamps in proptest::collection::vec((0i64..2_000_000, 0i64..200), 1..60),
        ) {
            let (bound, frozen, now) = (100_000i64, 1_000_000i64, 100_000i64 + 7_000);
            let cutoff = 99i64;
            // A post's versions and the default epochs: before (at or below the bound), while
            // frozen (after `frozen`), and after the unfreeze.
            let list = |first: u32, before: usize, during: usize, since: usize| {
                let mut frozen_list = vec![v(0, 4, 0)];
                let mut k = first;
                for i in 0..before {
                    frozen_list.push(v(k, 8 + i as u32, 1_000 * (i as i64 + 1)));
                    k += 1;
                }
                let mut moved_then = Vec::new();
                for i in 0..during {
                    let p = v(k, 16 + i as u32, frozen + 1 + i as i64);
                    frozen_list.push(p);
                    moved_then.push(p);
                    k += 1;
                }
                let mut unfrozen_list: Vec<Version> = frozen_list[..1 + before].to_vec();
                let mut at = now + GRACE_MS;
                for p in &moved_then {
                    unfrozen_list.push(Version { effective_ms: at, ..*p });
                    at += 1;
                }
                for i in 0..since {
                    unfrozen_list.push(v(k, 2 + i as u32, at + 1_000 * (i as i64 + 1)));
                    k += 1;
                }
                (frozen_list, unfrozen_list, moved_then)
            };
            let (post_frozen, post_now, post_moved) = list(1, before, during, since);
            let (epochs_frozen, epochs_now, epochs_moved) =
                list(1, epochs_before, epochs_during, 0);
            let defaults = |epochs: &[Version]| Defaults::parse(Some(&entry(epochs)), 4).unwrap();
            let frozen_table = RouteTable::new(defaults(&epochs_frozen), now, [(1, post_frozen)])
                .with_final(frozen);
            let record = Unfreeze {
                bound_ms: bound,
                cutoffs: vec![(0, cutoff)],
                posts: [(1, post_moved)].into_iter().filter(|(_, m)| !m.is_empty()).collect(),
                defaults: epochs_moved
                    .iter()
                    .map(|e| Version { version: epoch_version(e.version), ..*e })
                    .collect(),
            };
            let record = parse_unfrozen("t:routes", Some(&record.to_field())).unwrap();
            let table = RouteTable::new(defaults(&epochs_now), now + 1, [(1, post_now.clone())])
                .with_final(now + GRACE_MS)
                .with_unfreezes(record, None);
            for (t, offset) in stamps {
                for post in [1, 2] {
                    let routed = table.route_of(0, offset, post, t);
                    if offset <= cutoff && t <= frozen || t <= bound {
                        prop_assert_eq!(routed, frozen_table.route(post, t), "post {} t {} offset {}", post, t, offset);
                    }
                    if offset > cutoff {
                        prop_assert_eq!(routed, table.route(post, t));
                    }
                }
            }
            if since > 0 {
                let newest = *post_now.last().unwrap();
                prop_assert_eq!(table.route_of(0, cutoff + 1, 1, newest.effective_ms), newest);
                prop_assert_eq!(table.route_of(1, 0, 1, newest.effective_ms), newest);
            }
        }
    }

    #[test]
    fn records_parse_and_print_back() {
        let field = "1000/0:41,2:-1,1:40/default=1:4:9000,7=1:64:9001,7=2:8:9002";
        let parsed = parse_unfrozen("t:routes", Some(field)).unwrap();
        assert_eq!(parsed.len(), 1);
        let u = &parsed[0];
        assert_eq!(u.cutoffs, vec![(0, 41), (1, 40), (2, -1)]);
        assert_eq!(u.defaults[0].version, epoch_version(1));
        assert_eq!(u.posts[&7].len(), 2);
        assert!(u.covers(0, 41, 1001));
        assert!(!u.covers(0, 42, 1001), "above the cutoff");
        assert!(!u.covers(0, 41, 1000), "at the bound");
        assert!(!u.covers(2, 0, 5000));
        assert!(!u.covers(3, 0, 5000), "a partition added since");
        let again = parse_unfrozen("t:routes", Some(&u.to_field())).unwrap();
        assert_eq!(&again[0], u);
        let two = parse_unfrozen("t:routes", Some("1000/0:1/|2000/0:5/")).unwrap();
        assert_eq!(two.len(), 2);
    }

    #[test]
    fn unreadable_records_are_errors() {
        for bad in [
            "",
            "x/0:1/",
            "1000/0:1",
            "1000/0-1/",
            "1000/0:1/7=1:64:900",
            "1000/0:1/7=0:4:2000",
            "1000/0:1/default=0:4:2000",
        ] {
            assert!(parse_unfrozen("t:routes", Some(bad)).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_unfreezing("t:routes", Some("9:2:1")).unwrap(),
            Some(Unfreezing {
                undone_ms: 9,
                bound_ms: 2,
                started_ms: 1
            })
        );
        assert!(parse_unfreezing("t:routes", Some("9:2")).is_err());
    }
}
