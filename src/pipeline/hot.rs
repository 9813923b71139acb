//! Hot: noticing a post turning viral, with memory independent of the number
//! of posts, and promoting it to more buckets.
//!
//! Each consumer counts activity (likes and unlikes) per post in a
//! space-saving sketch of [`SKETCH_SIZE`] entries, fed once per closed batch.
//! Space-saving never under-counts a post it holds, and holds every post with
//! more than `total / SKETCH_SIZE` events of the window; its guaranteed count
//! (count minus error) never over-counts.
//!
//! A consumer sees only its own partitions, and a post may be spread over all
//! of them (topics keyed by user, or unkeyed). Scaling the local rate by the
//! partition count would over-count posts keyed to one partition by the same
//! factor, so consumers share their counts instead: once per second each adds
//! the guaranteed counts of its top posts to a per-second hash in Redis
//! (`<prefix>:heat:{heat}:<second>`, expiring after a minute) and reads back the
//! totals of the previous second, which every consumer has finished adding
//! to. A post whose total crosses `--promote-above` is promoted to
//! `--hot-buckets` through [`crate::domain::versions::Routes::publish`], which makes
//! concurrent promotions of the same post by several consumers harmless.
//! Detection only decides *when* a post gets more buckets; counts are exact
//! whatever it decides.

use std::collections::BTreeSet;
use std::time::Duration;

use rustc_hash::FxHashMap;
use tracing::info;

use crate::domain::routing::KeyLayout;
use crate::domain::versions::{PublishError, RouteTable, Routes, Trigger};
use crate::infra::store::Shared;

/// Posts tracked per consumer and window.
pub const SKETCH_SIZE: usize = 512;
/// Posts each consumer reports per window, at most.
pub const REPORTED: usize = 32;
/// A post is reported only when this consumer saw at least `1 / SPREAD` of the
/// promotion threshold; detection therefore assumes a hot post is spread
/// over at most this many consumers.
pub const SPREAD: u64 = 64;
/// Seconds a per-second heat hash lives.
const HEAT_TTL_SECS: i64 = 60;

/// The space-saving heavy-hitters sketch over post ids, with weighted updates.
#[derive(Debug)]
pub struct SpaceSaving {
    capacity: usize,
    /// post -> (count, error)
    entries: FxHashMap<u64, (u64, u64)>,
    /// (count, post), to find the smallest entry.
    order: BTreeSet<(u64, u64)>,
}

impl SpaceSaving {
    /// A sketch holding at most `capacity` posts.
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0);
        Self {
            capacity,
            entries: FxHashMap::default(),
            order: BTreeSet::new(),
        }
    }

    /// Adds `weight` events of `post`.
    pub fn add(&mut self, post: u64, weight: u64) {
        if let Some(entry) = self.entries.get_mut(&post) {
            self.order.remove(&(entry.0, post));
            entry.0 += weight;
            self.order.insert((entry.0, post));
            return;
        }
        let (count, error) = if self.entries.len() < self.capacity {
            (weight, 0)
        } else {
            let (min, evicted) = self.order.pop_first().expect("sketch is full");
            self.entries.remove(&evicted);
            (min + weight, min)
        };
        self.entries.insert(post, (count, error));
        self.order.insert((count, post));
    }

    /// Up to `n` posts by estimated count, largest first, each with its
    /// guaranteed count (a lower bound of its true count).
    pub fn top(&self, n: usize) -> Vec<(u64, u64)> {
        self.order
            .iter()
            .rev()
            .take(n)
            .map(|&(count, post)| (post, count - self.entries[&post].1))
            .collect()
    }

    /// The estimated count of `post` (an upper bound), 0 if not held.
    pub fn estimate(&self, post: u64) -> u64 {
        self.entries.get(&post).map_or(0, |e| e.0)
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }
}

/// When a post is promoted, and to how many buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Events per second, across all consumers, that make a post hot.
    pub promote_above: u64,
    /// Buckets a hot post gets.
    pub hot_buckets: u32,
}

/// Hot-post detection of one consumer.
#[derive(Debug)]
pub struct Detector {
    sketch: SpaceSaving,
    policy: Policy,
    /// The second being counted (seconds since the epoch).
    window: Option<u64>,
}

/// One consumer's counts of a finished second.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The second counted.
    pub window: u64,
    /// (post, guaranteed events) of the posts worth sharing.
    pub posts: Vec<(u64, u64)>,
}

impl Detector {
    /// Detection under `policy`.
    pub fn new(policy: Policy) -> Self {
        Self {
            sketch: SpaceSaving::new(SKETCH_SIZE),
            policy,
            window: None,
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Adds a closed batch's `events` of `post`.
    pub fn observe(&mut self, post: u64, events: u32) {
        self.sketch.add(post, u64::from(events));
    }

    /// At second `now_secs`: the report of the previous second if it just
    /// ended (the sketch starts afresh), `None` otherwise.
    pub fn tick(&mut self, now_secs: u64) -> Option<Report> {
        let window = *self.window.get_or_insert(now_secs);
        if now_secs <= window {
            return None;
        }
        let floor = (self.policy.promote_above / SPREAD).max(1);
        let posts = self
            .sketch
            .top(REPORTED)
            .into_iter()
            .filter(|&(_, count)| count >= floor)
            .collect();
        self.sketch.clear();
        self.window = Some(now_secs);
        Some(Report { window, posts })
    }
}

impl Policy {
    /// Shares a report and promotes what crossed the threshold in the second
    /// before it; returns the posts promoted.
    pub async fn share(
        self,
        report: Report,
        store: &Shared,
        keys: &KeyLayout,
        routes: &Routes,
        table: &RouteTable,
    ) -> Result<Vec<u64>, PublishError> {
        if report.posts.is_empty() {
            return Ok(Vec::new());
        }
        let now = keys.heat_key(report.window);
        let before = keys.heat_key(report.window - 1);
        let posts: Vec<u64> = report.posts.iter().map(|&(p, _)| p).collect();
        let totals: Vec<Option<u64>> = store
            .call(|mut s| {
                let mut pipe = redis::pipe();
                for &(post, count) in &report.posts {
                    pipe.hincr(&now, post, count).ignore();
                }
                pipe.expire(&now, HEAT_TTL_SECS).ignore();
                pipe.cmd("HMGET").arg(&before).arg(&posts);
                async move {
                    let (totals,): (Vec<Option<u64>>,) = pipe.query_async(&mut s).await?;
                    Ok(totals)
                }
            })
            .await?;
        let mut promoted = Vec::new();
        for (&post, total) in posts.iter().zip(totals) {
            let total = total.unwrap_or(0);
            let latest = table.latest(post);
            if total < self.promote_above || latest.buckets >= self.hot_buckets {
                continue;
            }
            let published = routes
                .publish(post, self.hot_buckets, latest, Trigger::Auto)
                .await?;
            if published.added {
                info!(
                    post_id = post,
                    events_per_sec = total,
                    buckets = self.hot_buckets,
                    "Hot post promoted."
                );
                crate::infra::metrics::promoted(Trigger::Auto.as_str());
                promoted.push(post);
            }
        }
        Ok(promoted)
    }
}

/// How often detection closes a window.
pub const WINDOW: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn a_heavy_post_survives_a_long_tail() {
        let mut sketch = SpaceSaving::new(16);
        for post in 0..10_000u64 {
            sketch.add(post, 1);
            if post % 10 == 0 {
                sketch.add(7_777_777, 5);
            }
        }
        let top = sketch.top(1);
        assert_eq!(top[0].0, 7_777_777);
        assert!(top[0].1 <= 5_000 && sketch.estimate(7_777_777) >= 5_000);
    }

    #[test]
    fn windows_report_once_per_second_and_start_afresh() {
        let mut detector = Detector::new(Policy {
            promote_above: 640,
            hot_buckets: 64,
        });
        assert_eq!(detector.tick(100), None);
        detector.observe(1, 500);
        detector.observe(2, 3);
        detector.observe(1, 200);
        assert_eq!(detector.tick(100), None);
        let report = detector.tick(101).unwrap();
        assert_eq!(report.window, 100);
        // Post 2 is below the floor of 640 / 64 = 10 events.
        assert_eq!(report.posts, vec![(1, 700)]);
        assert_eq!(detector.tick(102).unwrap().posts, vec![]);
    }

    proptest! {
        /// The space-saving guarantees: every held count is an upper bound
        /// and its guaranteed part a lower bound of the true count, and every
        /// post above total / capacity is held.
        #[test]
        fn space_saving_bounds_hold(updates in proptest::collection::vec((0u64..200, 1u64..20), 1..2_000), capacity in 1usize..40) {
            let mut sketch = SpaceSaving::new(capacity);
            let mut truth: HashMap<u64, u64> = HashMap::new();
            for &(post, weight) in &updates {
                sketch.add(post, weight);
                *truth.entry(post).or_default() += weight;
            }
            let total: u64 = truth.values().sum();
            for (post, guaranteed) in sketch.top(capacity) {
                prop_assert!(guaranteed <= truth[&post]);
                prop_assert!(sketch.estimate(post) >= truth[&post]);
            }
            for (&post, &count) in &truth {
                if count * capacity as u64 > total {
                    prop_assert!(sketch.estimate(post) > 0, "post {} with {} of {} dropped", post, count, total);
                }
            }
        }
    }
}
