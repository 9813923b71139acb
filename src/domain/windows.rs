//! Windows: likes per tumbling window of event time, and the trending list
//! read from them.
//!
//! Invariant: which window a like counts in, and whether it comes too late
//! to count there, is decided by the record alone (its event time and its
//! Kafka timestamp, both in the log), never by a clock of the consumer; so
//! the live consumer, a restarted one, `tally rebuild` and `tally verify`
//! reach the same window counts from the same log. Window writes go through
//! the fenced script with the lifetime counters, so they are applied once.
//!
//! # The rule
//!
//! * A like's time is its `event_time_ms`, or its record's timestamp when the
//!   event carries none (0). An event time after its record's timestamp (a
//!   producer clock running ahead) is taken as the record's timestamp, so
//!   no window opens in the future of the log.
//! * Window `w` of size `s` covers `[w, w + s)`, with `w` a multiple of `s`
//!   since the Unix epoch: every window of a size starts at the same instants
//!   everywhere (`1d` at midnight UTC).
//! * A like is **late** for a window when its record was written at or after
//!   the window's end plus `lateness`. A late like still counts in the
//!   lifetime count, only not in that window, and is a metric.
//! * A window's keys expire at its end plus `retention` by Redis's clock; a
//!   write to an expired window keeps nothing.
//!
//! # Keys, and why the top-K read is exact
//!
//! Per (size, start, slot group), two keys, followed on a cluster by the
//! hash tag of the group: the **counts**, a hash `<prefix>:win:<size>:<start>`
//! whose fields are posts (8 bytes, big-endian) and values their net likes
//! in the window; and the **leaders**, a sorted set `<prefix>:top:<size>:<start>`
//! holding exactly the posts whose count is at least the window's **floor**
//! (the counts' field [`FLOOR_FIELD`], 1 when absent), scored with their
//! counts. A post is written to the group of its bucket 0 whatever buckets
//! its likes went to: a batch sums each post's likes of a window before
//! writing, so a hot post costs one write per batch and window, and needs no
//! buckets here. The script of that group carries the window deltas, behind
//! that group's fence, and keeps the leaders to that definition: when they
//! pass [`LEADERS_CAP`] posts the floor rises to the count of the
//! [`LEADERS_KEEP`]-th and the posts below it leave them. Every count stays
//! in the hash, so a post that climbs later re-enters when it reaches the
//! floor; only the leaders are a sorted set, whose writes walk a skiplist.
//!
//! The `K` highest of one group, ordered by likes and then by the larger
//! post id (Redis's reverse order of equal scores of 8-byte big-endian
//! members), are the leaders' `K` highest when the leaders hold at least `K`
//! posts (every other post counts less than the floor, so less than each of
//! them), and all the leaders when the floor is 1 (every post with a like
//! is one). Otherwise, after unlikes took more than `LEADERS_KEEP - K`
//! posts below a raised floor, the read sorts the group's counts itself.
//! Each post is in exactly one group per window, so the `K` highest of the
//! window are among the union of each group's `K` highest: a post missing
//! from its own group's list has `K` posts ahead of it there, hence in the
//! union too. Memory is bounded by the distinct posts of a window (one hash
//! field each) and its expiry, and `tally plan` prices it.

use std::fmt;
use std::str::FromStr;

pub use crate::infra::config::windows::{
    DEFAULT_LATENESS_MS, DEFAULT_RETENTION_MS, MAX_SIZE_MS, MAX_WINDOWS, MIN_SIZE_MS, Millis,
    WindowSettings, parse_duration as parse_millis,
};

/// Posts a trending read returns unless told otherwise.
pub const DEFAULT_TOP_K: usize = 100;
/// The most posts one trending read returns.
pub const MAX_TOP_K: usize = 1_000;

/// The field of a window's counts that holds its leaders' floor; never a
/// post (those are 8 bytes).
pub const FLOOR_FIELD: &str = "floor";

/// The size past which a window's leaders are cut back (windows.lua's
/// `LEADERS_CAP`).
pub const LEADERS_CAP: usize = 4_000;

/// How many leaders a cut keeps at least (windows.lua's `LEADERS_KEEP`):
/// twice [`MAX_TOP_K`], so that unlikes must take a thousand of them below
/// the floor before a read of the longest list sorts the counts itself.
pub const LEADERS_KEEP: usize = 2 * MAX_TOP_K;

/// The length of a window, written `30s`, `5m`, `1h` or `1d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WindowSize(u64);

impl WindowSize {
    /// The size in milliseconds.
    pub fn ms(self) -> u64 {
        self.0
    }

    /// The start of the window of this size holding `time_ms`.
    pub fn start_of(self, time_ms: i64) -> i64 {
        time_ms
            .div_euclid(self.0 as i64)
            .saturating_mul(self.0 as i64)
    }
}

impl fmt::Display for WindowSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Millis(self.0).fmt(f)
    }
}

/// A duration or a window that cannot be used, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadWindow(String);

/// Parses `<number><s|m|h|d>` into milliseconds.
pub fn parse_duration(text: &str) -> Result<u64, BadWindow> {
    parse_millis(text).map_err(BadWindow)
}

impl FromStr for WindowSize {
    type Err = BadWindow;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let ms = parse_duration(text)?;
        if !(MIN_SIZE_MS..=MAX_SIZE_MS).contains(&ms) {
            return Err(BadWindow(format!(
                "window '{text}' must be between 1s and 366d"
            )));
        }
        Ok(WindowSize(ms))
    }
}

/// The windows a prefix keeps, and the two rules that bound them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Windows {
    sizes: Vec<WindowSize>,
    /// How long after a window's end a like still counts in it.
    pub lateness_ms: u64,
    /// How long after a window's end its set is kept.
    pub retention_ms: u64,
}

/// Where one like lands for one window size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// In the window starting here.
    In(i64),
    /// Too late for its window, which started here.
    Late(i64),
}

impl Windows {
    /// No window: lifetime counts only.
    pub fn none() -> Windows {
        Windows::default()
    }

    /// `sizes` (sorted, without repeats) with these rules, checked as
    /// [`WindowSettings`] checks them; an error names the first thing wrong.
    pub fn new(
        sizes: Vec<WindowSize>,
        lateness_ms: u64,
        retention_ms: u64,
    ) -> Result<Windows, BadWindow> {
        let sizes = sizes.iter().map(|s| s.ms()).collect();
        WindowSettings::new(sizes, lateness_ms, retention_ms)
            .map(|settings| Windows::from_settings(&settings))
            .map_err(BadWindow)
    }

    /// The windows `settings` name (checked when they were made).
    pub fn from_settings(settings: &WindowSettings) -> Windows {
        Windows {
            sizes: settings
                .sizes_ms()
                .iter()
                .map(|&ms| WindowSize(ms))
                .collect(),
            lateness_ms: settings.lateness_ms(),
            retention_ms: settings.retention_ms(),
        }
    }

    /// Whether no window is kept.
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// The sizes, smallest first.
    pub fn sizes(&self) -> &[WindowSize] {
        &self.sizes
    }

    /// The index of `size` among the sizes.
    pub fn index_of(&self, size: WindowSize) -> Option<usize> {
        self.sizes.iter().position(|&s| s == size)
    }

    /// Where a like with `event_ms` (0: none) in a record stamped
    /// `record_ms` (≤ 0: none) lands in windows of `size`; `None` when the
    /// like has no time at all.
    pub fn place(&self, size: WindowSize, event_ms: i64, record_ms: i64) -> Option<Placed> {
        let time = like_time(event_ms, record_ms)?;
        let start = size.start_of(time);
        let closes = start
            .saturating_add(size.ms() as i64)
            .saturating_add(self.lateness_ms as i64);
        Some(match record_ms > 0 && record_ms >= closes {
            true => Placed::Late(start),
            false => Placed::In(start),
        })
    }

    /// When the set of the window of `size` starting at `start` expires
    /// (milliseconds since the epoch).
    pub fn expires_at(&self, size: WindowSize, start: i64) -> i64 {
        start
            .saturating_add(size.ms() as i64)
            .saturating_add(self.retention_ms as i64)
    }

    /// The sizes as the layout record keeps them: `1m,1h`.
    pub fn sizes_field(&self) -> String {
        self.sizes
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The sizes of a `--windows` flag or a record's field: comma-separated
    /// durations, empty for none.
    pub fn parse_sizes(text: &str) -> Result<Vec<WindowSize>, BadWindow> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::parse)
            .collect()
    }
}

/// The time a like counts at: its event time, never after its record's
/// timestamp; the record's timestamp when the event has none.
pub fn like_time(event_ms: i64, record_ms: i64) -> Option<i64> {
    match (event_ms > 0, record_ms > 0) {
        (true, true) => Some(event_ms.min(record_ms)),
        (true, false) => Some(event_ms),
        (false, true) => Some(record_ms),
        (false, false) => None,
    }
}

/// A post's field in a window's counts, and its member in the leaders.
pub fn member(post_id: u64) -> [u8; 8] {
    post_id.to_be_bytes()
}

/// The post a member names; `None` for a member tally did not write.
pub fn post_of(member: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = member.try_into().ok()?;
    Some(u64::from_be_bytes(bytes)).filter(|&post| post != 0)
}

/// One post of a trending list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Ranked {
    /// The post.
    pub post_id: u64,
    /// Its net likes in the window.
    pub likes: i64,
}

/// The trending order: more likes first, then the larger post id.
pub fn rank_order(a: &Ranked, b: &Ranked) -> std::cmp::Ordering {
    b.likes.cmp(&a.likes).then(b.post_id.cmp(&a.post_id))
}

/// The `limit` first posts of the union of per-group lists, each one
/// group's leaders in [`rank_order`]; exact when every post is in one
/// group's set only (see the module doc). Posts with no net like are left out.
pub fn merge_top(lists: impl IntoIterator<Item = Vec<Ranked>>, limit: usize) -> Vec<Ranked> {
    let mut all: Vec<Ranked> = lists
        .into_iter()
        .flatten()
        .filter(|r| r.likes > 0)
        .collect();
    all.sort_unstable_by(rank_order);
    all.truncate(limit);
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn size(text: &str) -> WindowSize {
        text.parse().unwrap()
    }

    #[test]
    fn sizes_parse_and_print_in_their_largest_unit() {
        assert_eq!(size("60m").ms(), 3_600_000);
        assert_eq!(size("60m").to_string(), "1h");
        assert_eq!(size("90s").to_string(), "90s");
        assert_eq!(size("1d").to_string(), "1d");
        for bad in ["", "h", "1", "1w", "-1h", "0s", "367d", "1.5h"] {
            assert!(bad.parse::<WindowSize>().is_err(), "{bad}");
        }
        let sizes = Windows::parse_sizes("1h, 1m,1h").unwrap();
        let windows = Windows::new(sizes, 0, 0).unwrap();
        assert_eq!(windows.sizes_field(), "1m,1h");
        assert!(Windows::parse_sizes("").unwrap().is_empty());
    }

    #[test]
    fn windows_start_at_multiples_of_their_size_since_the_epoch() {
        let day = size("1d");
        // 2026-12-04T23:59:59.999Z and the next millisecond.
        let before_midnight = 1_796_428_799_999;
        assert_eq!(day.start_of(before_midnight), 1_796_342_400_000);
        assert_eq!(day.start_of(before_midnight + 1), 1_796_428_800_000);
        assert_eq!(size("1h").start_of(-1), -3_600_000);
    }

    #[test]
    fn lateness_is_judged_by_the_record_timestamp_not_a_clock() {
        let minute = size("1m");
        let windows = Windows::new(vec![minute], 10_000, 60_000).unwrap();
        // Event at 30 s, window [0, 60 s): closes for good at 70 s.
        assert_eq!(windows.place(minute, 30_000, 69_999), Some(Placed::In(0)));
        assert_eq!(windows.place(minute, 30_000, 70_000), Some(Placed::Late(0)));
        // No event time: the record's own window, never late.
        assert_eq!(windows.place(minute, 0, 125_000), Some(Placed::In(120_000)));
        // A clock ahead of the log is held to the record's time.
        assert_eq!(
            windows.place(minute, 999_000, 125_000),
            Some(Placed::In(120_000))
        );
        assert_eq!(windows.place(minute, 0, -1), None);
        assert_eq!(windows.expires_at(minute, 120_000), 240_000);
    }

    #[test]
    fn a_retention_shorter_than_the_lateness_is_refused() {
        let error = Windows::new(vec![size("1h")], 600_000, 60_000).unwrap_err();
        assert!(error.to_string().contains("retention (1m)"), "{error}");
        let many = (1..=9).map(|m| size(&format!("{m}m"))).collect();
        assert!(Windows::new(many, 0, 0).is_err());
    }

    #[test]
    fn members_name_posts_and_sort_as_their_ids() {
        assert_eq!(post_of(&member(42)), Some(42));
        assert!(member(255) < member(256));
        assert_eq!(post_of(b"42"), None);
        assert_eq!(post_of(&[0; 8]), None);
    }

    proptest! {
        /// Posts spread over groups, each in one; the merge of each group's
        /// leaders equals the leaders of everything, ties included.
        #[test]
        fn the_merge_of_group_leaders_is_the_global_top(
            likes in proptest::collection::btree_map(1u64..200, -3i64..6, 0..120),
            groups in 1u64..9,
            limit in 1usize..30,
        ) {
            let mut lists = vec![Vec::new(); groups as usize];
            for (&post_id, &likes) in &likes {
                lists[(post_id % groups) as usize].push(Ranked { post_id, likes });
            }
            for list in &mut lists {
                list.retain(|r| r.likes > 0);
                list.sort_unstable_by(rank_order);
                list.truncate(limit);
            }
            let mut truth: Vec<Ranked> = likes
                .iter()
                .filter(|&(_, &l)| l > 0)
                .map(|(&post_id, &likes)| Ranked { post_id, likes })
                .collect();
            truth.sort_by(|a, b| b.likes.cmp(&a.likes).then(b.post_id.cmp(&a.post_id)));
            truth.truncate(limit);
            prop_assert_eq!(merge_top(lists, limit), truth);
        }
    }
}
