//! Adoption: what a prefix written without a layout record holds, read from
//! its keys, so that the start that writes the record checks its flags
//! against the data instead of trusting them.
//!
//! Data that predates the record says nothing of its layout, but its keys say
//! most of it: every fence and origin names its group, topic and partition,
//! and every version-0 counter its bucket and, on a cluster, its slot group
//! (the hash tag). One SCAN of `<base>:*` on every primary finds them all, in
//! every generation, and runs only while the prefix has no record, so once
//! per prefix. A start is refused when the record it would write disagrees
//! with the keys:
//!
//! * fences of another group or topic than the start's: adopting them under
//!   its own would leave them unused and count the whole log again into the
//!   same counters;
//! * a version-0 bucket at or above the start's bucket count: readers take
//!   the count from the record and would never sum that bucket;
//! * a counter in another slot group than the start's slot groups place it:
//!   readers would look for it under another hash tag.
//!
//! What no key shows is a count larger than the highest bucket written; a
//! larger count only adds buckets nobody wrote, which read as 0.

use std::collections::{BTreeMap, BTreeSet};

use redis::RedisError;

use crate::domain::placement::scan;
use crate::domain::routing::KeyLayout;
use crate::infra::store::Target;

/// What the keys under a prefix without a layout record show.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Survey {
    /// (group, topic) → the partitions whose fences or origins it holds.
    pub fenced: BTreeMap<(String, String), BTreeSet<i32>>,
    /// Whether the prefix has a generation pointer (a rebuild ran on it).
    pub pointer: bool,
    /// Version-0 counter keys found.
    pub counters: u64,
    /// The highest version-0 bucket found, with a key that holds it.
    pub highest: Option<(u32, String)>,
    /// A counter key that the surveyed slot groups would name otherwise,
    /// with the name they give it.
    pub misplaced: Option<(String, String)>,
}

/// Why the data under a prefix cannot be adopted with a start's settings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The fences belong to another group or topic.
    #[error(
        "prefix {prefix} has no layout record and holds the fences of {found}, not of --group {group} --topic {topic}: start once with the group and topic that wrote them to adopt the data, or give this group a --prefix of its own"
    )]
    Group {
        /// The base prefix.
        prefix: String,
        /// What was found, for example `group tally on topic likes (partitions 0-3)`.
        found: String,
        /// The start's group.
        group: String,
        /// The start's topic.
        topic: String,
    },
    /// A version-0 bucket the start's count would not read.
    #[error(
        "prefix {prefix} has no layout record and holds version-0 buckets up to {highest} ({key}), which --buckets {buckets} leaves out: readers would never sum them; start once with --buckets set to the count they were written with (at least {at_least})"
    )]
    Buckets {
        /// The base prefix.
        prefix: String,
        /// The highest bucket found.
        highest: u32,
        /// A key that holds it.
        key: String,
        /// The start's bucket count.
        buckets: u32,
        /// The smallest count that covers it.
        at_least: u64,
    },
    /// A counter in another slot group than the start's slot groups place it.
    #[error(
        "prefix {prefix} has no layout record and holds the counter {key}, which --slot-groups {slot_groups} would name {expected}: readers would not find it; start once with the --slot-groups it was written with"
    )]
    SlotGroups {
        /// The base prefix.
        prefix: String,
        /// The key found.
        key: String,
        /// The start's slot-group count.
        slot_groups: u32,
        /// What the start would call it.
        expected: String,
    },
}

impl Survey {
    /// Whether the prefix holds counts tally applied: fences or origins of
    /// any group and partition, or a generation pointer.
    pub fn holds_data(&self) -> bool {
        !self.fenced.is_empty() || self.pointer
    }

    /// Adds one key found under `keys`' prefix; keys of generations
    /// (`<base>:g<k>:...`) count as the prefix's.
    pub fn add(&mut self, keys: &KeyLayout, key: &str) {
        let base = keys.prefix();
        let Some(rest) = key.strip_prefix(base).and_then(|r| r.strip_prefix(':')) else {
            return;
        };
        if rest == "generation" {
            self.pointer = true;
            return;
        }
        let (prefix, rest) = match rest.split_once(':') {
            Some((g, tail)) if is_generation(g) => (format!("{base}:{g}"), tail),
            _ => (base.to_string(), rest),
        };
        if rest.starts_with("likes:") {
            let generation = keys.with_prefix(prefix);
            if let Some(id) = generation.parse_counter_key(key)
                && id.version == 0
            {
                self.counters += 1;
                if self.highest.as_ref().is_none_or(|(b, _)| id.bucket > *b) {
                    self.highest = Some((id.bucket, key.to_string()));
                }
                let expected = generation.key_of(id);
                if expected != key && self.misplaced.is_none() {
                    self.misplaced = Some((key.to_string(), expected));
                }
            }
        } else if let Some(fenced) = rest
            .strip_prefix("fence:")
            .or_else(|| rest.strip_prefix("origin:"))
            && let Some((group, topic, partition)) = fenced_partition(fenced)
        {
            self.fenced
                .entry((group.to_string(), topic.to_string()))
                .or_default()
                .insert(partition);
        }
    }

    /// Refuses what adopting the data with `buckets` version-0 buckets under
    /// `group` and `topic`, with `keys`' slot groups, would misread.
    pub fn check(
        &self,
        keys: &KeyLayout,
        buckets: u32,
        group: &str,
        topic: &str,
    ) -> Result<(), Refusal> {
        let prefix = keys.prefix().to_string();
        let ours = (group.to_string(), topic.to_string());
        if !self.fenced.is_empty() && !self.fenced.contains_key(&ours) {
            return Err(Refusal::Group {
                prefix,
                found: self.fenced_text(),
                group: group.to_string(),
                topic: topic.to_string(),
            });
        }
        if let Some((highest, key)) = &self.highest
            && *highest >= buckets
        {
            return Err(Refusal::Buckets {
                prefix,
                highest: *highest,
                key: key.clone(),
                buckets,
                at_least: u64::from(*highest) + 1,
            });
        }
        if let Some((key, expected)) = &self.misplaced {
            return Err(Refusal::SlotGroups {
                prefix,
                key: key.clone(),
                slot_groups: keys.groups().count(),
                expected: expected.clone(),
            });
        }
        Ok(())
    }

    /// The fenced groups, topics and partitions, as people read them.
    pub fn fenced_text(&self) -> String {
        self.fenced
            .iter()
            .map(|((group, topic), partitions)| {
                format!(
                    "group {group} on topic {topic} (partitions {})",
                    ranges(partitions)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Surveys every key under `keys`' prefix, on every primary (blocking).
pub fn survey(target: &Target, keys: &KeyLayout) -> Result<Survey, RedisError> {
    let mut found = Survey::default();
    scan(target, &format!("{}:*", keys.prefix()), |_, batch| {
        for key in &batch {
            found.add(keys, key);
        }
        Ok(())
    })?;
    Ok(found)
}

fn is_generation(segment: &str) -> bool {
    segment
        .strip_prefix('g')
        .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
}

/// `<group>:<topic>:<partition>[:{tag}]`, read from the right: a topic
/// cannot hold ':', a group can.
fn fenced_partition(rest: &str) -> Option<(&str, &str, i32)> {
    let rest = match rest.rsplit_once(':') {
        Some((head, tag)) if tag.starts_with('{') && tag.ends_with('}') => head,
        _ => rest,
    };
    let (rest, partition) = rest.rsplit_once(':')?;
    let (group, topic) = rest.rsplit_once(':')?;
    let partition = partition.parse().ok()?;
    (!group.is_empty() && !topic.is_empty()).then_some((group, topic, partition))
}

/// `0-3, 7` for {0, 1, 2, 3, 7}.
fn ranges(partitions: &BTreeSet<i32>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(i32, i32)> = None;
    for &p in partitions {
        run = match run {
            Some((first, last)) if p == last + 1 => Some((first, p)),
            Some(done) => {
                out.push(range(done));
                Some((p, p))
            }
            None => Some((p, p)),
        };
    }
    out.extend(run.map(range));
    out.join(", ")
}

fn range((first, last): (i32, i32)) -> String {
    if first == last {
        first.to_string()
    } else {
        format!("{first}-{last}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::slots::SlotGroups;

    fn surveyed(keys: &KeyLayout, found: &[String]) -> Survey {
        let mut survey = Survey::default();
        for key in found {
            survey.add(keys, key);
        }
        survey
    }

    #[test]
    fn every_partition_and_group_and_generation_is_seen() {
        let keys = KeyLayout::new("t");
        let g2 = keys.with_prefix("t:g2");
        let found = [
            keys.origin_key("old:team", "likes", 3),
            g2.fence_key("tally", "likes", 11, 0),
            keys.fence_key("tally", "likes", 12, 0),
            "t:layoutish".to_string(),
            "t:likes:5:v2:b40".to_string(),
            "tother:origin:x:likes:0".to_string(),
        ];
        let survey = surveyed(&keys, &found);
        assert!(survey.holds_data());
        assert_eq!(survey.counters, 0, "a post's own version is not version 0");
        assert_eq!(
            survey.fenced_text(),
            "group old:team on topic likes (partitions 3), group tally on topic likes (partitions 11-12)"
        );
        assert!(survey.check(&keys, 1, "tally", "likes").is_ok());
        let refused = survey.check(&keys, 1, "canary", "likes").unwrap_err();
        assert!(matches!(refused, Refusal::Group { .. }), "{refused}");
        assert!(surveyed(&keys, &["t:generation".to_string()]).holds_data());
        assert!(!surveyed(&keys, &["t:likes:1:0".to_string()]).holds_data());
    }

    #[test]
    fn a_count_below_the_highest_bucket_is_refused() {
        let keys = KeyLayout::new("t");
        let found: Vec<String> = (0..16).map(|b| keys.counter_key(7, b)).collect();
        let survey = surveyed(&keys, &found);
        assert_eq!(survey.counters, 16);
        assert!(survey.check(&keys, 16, "g", "t").is_ok());
        assert!(survey.check(&keys, 64, "g", "t").is_ok());
        let refused = survey.check(&keys, 8, "g", "t").unwrap_err();
        assert_eq!(
            refused.to_string(),
            "prefix t has no layout record and holds version-0 buckets up to 15 (t:likes:7:15), which --buckets 8 leaves out: readers would never sum them; start once with --buckets set to the count they were written with (at least 16)"
        );
    }

    #[test]
    fn counters_of_other_slot_groups_are_refused() {
        let written = KeyLayout::with_groups("t", SlotGroups::cluster(16));
        let found: Vec<String> = (0..4).map(|b| written.counter_key(99, b)).collect();
        assert!(
            surveyed(&written, &found)
                .check(&written, 4, "g", "t")
                .is_ok()
        );
        let other = KeyLayout::with_groups("t", SlotGroups::cluster(128));
        let refused = surveyed(&other, &found)
            .check(&other, 4, "g", "t")
            .unwrap_err();
        assert!(matches!(refused, Refusal::SlotGroups { .. }), "{refused}");
    }

    #[test]
    fn partitions_read_as_ranges() {
        let set: BTreeSet<i32> = [0, 1, 2, 3, 7, 9, 10].into();
        assert_eq!(ranges(&set), "0-3, 7, 9-10");
    }
}
