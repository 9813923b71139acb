//! The windows' price: Redis memory for the counts and leaders of trending
//! counts.
//!
//! A window's counts hold every post liked in it (the trending list stays
//! exact only so), its leaders at most `LEADERS_CAP` of them, and both live
//! from the window's start to its end plus the retention, so
//! `1 + ⌈retention / size⌉` windows of a size are alive at once. A post in
//! the counts costs `--window-member-bytes`, measured on one hash of
//! 1,000,000 posts; a leader [`LEADER_BYTES`], measured on one sorted set of
//! 1,000,000 (docs/design.md, "Windows of trending counts").
//!
//! Invariant: the price follows from the inputs alone, size by size.

use serde::Serialize;
use tally::domain::windows::{LEADERS_CAP, Millis, WindowSize, parse_duration};
use tally::infra::config::{ConfigError, bad};

use super::PlanArgs;

/// Redis memory one post in one window's counts costs (bytes; one hash of
/// 1,000,000 posts on redis-server 7.0.15; 53 on Valkey 9.1.2).
pub const MEASURED_MEMBER_BYTES: f64 = 64.0;

/// Redis memory one post among a window's leaders costs (bytes; one sorted
/// set of 1,000,000 posts on redis-server 7.0.15; 80 on Valkey 9.1.2).
pub const LEADER_BYTES: f64 = 126.0;

/// One window size's price.
#[derive(Debug, Clone, Serialize)]
pub struct WindowPrice {
    /// The size, as `1h`.
    pub window: String,
    /// Distinct posts liked in one window of it.
    pub posts: f64,
    /// Sets of it alive at once.
    pub sets_alive: u64,
    /// Their memory, before replicas.
    pub memory_bytes: f64,
}

/// Every size's price and their total.
#[derive(Debug, Clone, Serialize)]
pub struct Windows {
    /// How long sets outlive their window.
    pub retention: String,
    /// Bytes a member costs.
    pub member_bytes: f64,
    /// The sizes, as given.
    pub sizes: Vec<WindowPrice>,
    /// Their sum.
    pub memory_bytes: f64,
}

/// `SIZE=POSTS`, as `--window-posts 1d=10000000` gives it.
fn size_and_posts(text: &str) -> Result<(WindowSize, f64), ConfigError> {
    let bad = || {
        bad(
            "window-posts",
            format!("'{text}' is not SIZE=POSTS, as 1h=2000000"),
        )
    };
    let (size, posts) = text.split_once('=').ok_or_else(bad)?;
    let size: WindowSize = size.parse().map_err(|_| bad())?;
    let posts: f64 = posts.parse().map_err(|_| bad())?;
    if !(posts.is_finite() && posts >= 0.0) {
        return Err(bad());
    }
    Ok((size, posts))
}

/// The windows priced, when `--window-posts` asks.
pub fn windows(args: &PlanArgs) -> Result<Option<Windows>, ConfigError> {
    if args.window_posts.is_empty() {
        return Ok(None);
    }
    let retention = parse_duration(&args.window_retention)
        .map_err(|e| bad("window-retention", e.to_string()))?;
    let mut sizes = Vec::new();
    for given in &args.window_posts {
        let (size, posts) = size_and_posts(given)?;
        let sets_alive = 1 + retention.div_ceil(size.ms());
        sizes.push(WindowPrice {
            window: size.to_string(),
            posts,
            sets_alive,
            memory_bytes: sets_alive as f64
                * (posts * args.window_member_bytes + posts.min(LEADERS_CAP as f64) * LEADER_BYTES),
        });
    }
    Ok(Some(Windows {
        retention: Millis(retention).to_string(),
        member_bytes: args.window_member_bytes,
        memory_bytes: sizes.iter().map(|s| s.memory_bytes).sum(),
        sizes,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::parse_flags;

    #[test]
    fn a_day_of_ten_million_posts_keeps_two_sets() {
        let args = parse_flags::<PlanArgs>(&[
            "--window-posts",
            "1d=10000000",
            "--window-posts",
            "1h=2000000",
        ])
        .unwrap();
        let priced = windows(&args).unwrap().unwrap();
        let day = &priced.sizes[0];
        assert_eq!(day.sets_alive, 2);
        let leaders = LEADERS_CAP as f64 * LEADER_BYTES;
        assert!((day.memory_bytes - 2.0 * (1e7 * MEASURED_MEMBER_BYTES + leaders)).abs() < 1.0);
        assert_eq!(priced.sizes[1].sets_alive, 25);
        assert_eq!(priced.retention, "1d");
        let wrong = parse_flags::<PlanArgs>(&["--window-posts", "1d:10"]).unwrap();
        assert!(
            windows(&wrong)
                .unwrap_err()
                .to_string()
                .contains("SIZE=POSTS")
        );
        assert!(
            windows(&parse_flags::<PlanArgs>(&[]).unwrap())
                .unwrap()
                .is_none()
        );
    }
}
