//! Trending: a post's likes in one window, and the posts with the most.
//!
//! Invariant: a window read sums nothing. Each post has one field in one
//! group's counts per window (see [`crate::domain::windows`]), so its value
//! is its count, and the trending list merges each slot group's top posts,
//! read from its leaders when they decide it and from its counts otherwise,
//! which is exact. The window asked for is one the prefix keeps (its layout record
//! names them), picked by its size and an instant: the reader's clock unless
//! the request names one. Answers are cached for the reader's `ttl`, like
//! counts.

use std::time::Instant;

use redis::RedisError;
use serde::Serialize;

use super::{ReadError, Reader};
use crate::domain::versions::wall_ms;
use crate::domain::windows::{self, Ranked, WindowSize, Windows};

/// Cached window answers past which expired ones are dropped.
const CACHE_PRUNE_AT: usize = 10_000;

/// A post's likes in one window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WindowCount {
    /// The post.
    pub post_id: u64,
    /// Net likes in the window.
    pub likes: i64,
    /// The window.
    #[serde(flatten)]
    pub window: Window,
    /// When the read began (milliseconds since the epoch).
    pub as_of_ms: i64,
}

/// One window of one size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Window {
    /// Its size, as `1h`.
    #[serde(serialize_with = "shown")]
    pub window: WindowSize,
    /// Its first instant (milliseconds since the epoch).
    pub start_ms: i64,
    /// The instant after its last.
    pub end_ms: i64,
}

fn shown<S: serde::Serializer>(size: &WindowSize, out: S) -> Result<S::Ok, S::Error> {
    out.collect_str(size)
}

/// The posts with the most likes in one window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Trending {
    /// The window.
    #[serde(flatten)]
    pub window: Window,
    /// The posts, most likes first; equal counts, the larger post id first.
    pub posts: Vec<Ranked>,
    /// When the read began (milliseconds since the epoch).
    pub as_of_ms: i64,
}

/// A cached window answer's key: (size, start, post or limit).
pub(super) type WindowRead = (u64, i64, u64);

/// A cached window answer.
#[derive(Debug, Clone)]
pub(super) enum Cached {
    Count(WindowCount),
    Trending(Trending),
}

impl Reader {
    /// The windows the prefix keeps.
    pub fn windows(&self) -> &Windows {
        self.inner.base.windows()
    }

    /// The size named `name`, if the prefix keeps it.
    pub fn window_size(&self, name: &str) -> Result<WindowSize, ReadError> {
        let kept = self.windows();
        let unknown = || ReadError::UnknownWindow {
            asked: name.to_string(),
            kept: match kept.is_empty() {
                true => "none".to_string(),
                false => kept.sizes_field(),
            },
        };
        let size: WindowSize = name.parse().map_err(|_| unknown())?;
        kept.index_of(size).map(|_| size).ok_or_else(unknown)
    }

    /// The window of `size` holding `at_ms` (the reader's clock when `None`).
    fn window_at(size: WindowSize, at_ms: Option<i64>) -> Window {
        let start_ms = size.start_of(at_ms.unwrap_or_else(wall_ms));
        Window {
            window: size,
            start_ms,
            end_ms: start_ms.saturating_add(size.ms() as i64),
        }
    }

    fn window_cached(&self, key: WindowRead) -> Option<Cached> {
        let cache = self
            .inner
            .windowed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let hit = cache
            .get(&key)
            .filter(|(_, at)| at.elapsed() < self.inner.ttl)
            .map(|(answer, _)| answer.clone());
        crate::infra::metrics::read_cache(u64::from(hit.is_some()), u64::from(hit.is_none()));
        hit
    }

    fn window_keep(&self, key: WindowRead, answer: Cached) {
        if self.inner.ttl.is_zero() {
            return;
        }
        let mut cache = self
            .inner
            .windowed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if cache.len() >= CACHE_PRUNE_AT {
            let ttl = self.inner.ttl;
            cache.retain(|_, (_, at)| at.elapsed() < ttl);
        }
        cache.insert(key, (answer, Instant::now()));
    }

    /// A post's likes in the window of `size` holding `at_ms`.
    pub async fn window_likes(
        &self,
        post_id: u64,
        size: WindowSize,
        at_ms: Option<i64>,
    ) -> Result<WindowCount, ReadError> {
        let window = Self::window_at(size, at_ms);
        let key = (size.ms(), window.start_ms, post_id);
        if let Some(Cached::Count(count)) = self.window_cached(key) {
            return Ok(count);
        }
        let as_of_ms = wall_ms();
        let (_, keys) = self.layout().await?;
        let counts = keys.window_key(size, window.start_ms, post_id);
        crate::infra::metrics::read_fetch();
        let likes: Option<i64> = self
            .inner
            .store
            .call(|mut s| async move {
                redis::cmd("HGET")
                    .arg(&counts)
                    .arg(&windows::member(post_id)[..])
                    .query_async(&mut s)
                    .await
            })
            .await?;
        let count = WindowCount {
            post_id,
            likes: likes.unwrap_or(0),
            window,
            as_of_ms,
        };
        self.window_keep(key, Cached::Count(count));
        Ok(count)
    }

    /// The `limit` posts with the most likes in the window of `size`
    /// holding `at_ms`; posts with no net like are left out.
    pub async fn trending(
        &self,
        size: WindowSize,
        at_ms: Option<i64>,
        limit: usize,
    ) -> Result<Trending, ReadError> {
        let window = Self::window_at(size, at_ms);
        let key = (size.ms(), window.start_ms, u64::MAX - limit as u64);
        if let Some(Cached::Trending(trending)) = self.window_cached(key) {
            return Ok(trending);
        }
        let as_of_ms = wall_ms();
        let (_, keys) = self.layout().await?;
        crate::infra::metrics::read_fetch();
        let store = &self.inner.store;
        let lists = futures::future::try_join_all(
            keys.window_keys(size, window.start_ms)
                .into_iter()
                .map(|(counts, leaders)| group_top(store, counts, leaders, limit)),
        )
        .await?;
        let trending = Trending {
            window,
            posts: windows::merge_top(lists, limit),
            as_of_ms,
        };
        self.window_keep(key, Cached::Trending(trending.clone()));
        Ok(trending)
    }
}

/// One slot group's `limit` first posts with a positive count, in the
/// trending order. The leaders decide them when they hold `limit` posts, or
/// when the floor is still 1 (every post with a like is a leader); the
/// leaders are read first, so a floor raised in between only sends the read
/// to the counts. Otherwise the group's counts are read whole and sorted.
async fn group_top(
    store: &crate::infra::store::Shared,
    counts: String,
    leaders: String,
    limit: usize,
) -> Result<Vec<Ranked>, RedisError> {
    let top: Vec<(Vec<u8>, f64)> = store
        .call(|mut s| {
            let leaders = leaders.clone();
            async move {
                redis::cmd("ZREVRANGEBYSCORE")
                    .arg(&leaders)
                    .arg("+inf")
                    .arg("(0")
                    .arg("WITHSCORES")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(limit)
                    .query_async(&mut s)
                    .await
            }
        })
        .await?;
    let ranked = |(member, likes): (Vec<u8>, i64)| {
        Some(Ranked {
            post_id: windows::post_of(&member)?,
            likes,
        })
    };
    let top: Vec<(Vec<u8>, i64)> = top.into_iter().map(|(m, s)| (m, s as i64)).collect();
    if top.len() < limit {
        let floor: Option<i64> = store
            .call(|mut s| {
                let counts = counts.clone();
                async move {
                    redis::cmd("HGET")
                        .arg(&counts)
                        .arg(windows::FLOOR_FIELD)
                        .query_async(&mut s)
                        .await
                }
            })
            .await?;
        if floor.unwrap_or(1) > 1 {
            let all = every_count(store, counts).await?;
            return Ok(windows::merge_top(
                [all.into_iter().filter_map(ranked).collect()],
                limit,
            ));
        }
    }
    Ok(top.into_iter().filter_map(ranked).collect())
}

/// Every (field, count) of a window's counts, the floor left out.
async fn every_count(
    store: &crate::infra::store::Shared,
    counts: String,
) -> Result<Vec<(Vec<u8>, i64)>, RedisError> {
    let mut all = Vec::new();
    let mut cursor = 0u64;
    loop {
        crate::infra::metrics::read_fetch();
        let (next, page): (u64, Vec<(Vec<u8>, i64)>) = store
            .call(|mut s| {
                let counts = counts.clone();
                async move {
                    redis::cmd("HSCAN")
                        .arg(&counts)
                        .arg(cursor)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut s)
                        .await
                }
            })
            .await?;
        all.extend(
            page.into_iter()
                .filter(|(field, _)| field != windows::FLOOR_FIELD.as_bytes()),
        );
        if next == 0 {
            return Ok(all);
        }
        cursor = next;
    }
}
