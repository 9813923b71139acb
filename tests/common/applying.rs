//! What the script tests share: a batch's share to apply, a runtime to apply it on, and an
//! applier of group "g"'s fences of topic "likes" under a key layout.

use tally::domain::routing::{CounterId, KeyLayout};
use tally::pipeline::apply::{Applier, Prepared};

/// Partition 0, slot group 0: `(post, bucket, delta)` of version 0 over `start..=last`.
pub fn script(start: i64, last: i64, absent_fence: i64, deltas: &[(u64, u32, i64)]) -> Prepared {
    Prepared {
        partition: 0,
        group: 0,
        start,
        last,
        absent_fence,
        windows: Vec::new(),
        deltas: deltas
            .iter()
            .map(|&(post_id, bucket, d)| (CounterId::v0(post_id, bucket), d))
            .collect(),
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// An applier of group "g"'s fences of topic "likes" under `keys`.
pub fn applier(rt: &tokio::runtime::Runtime, url: &str, keys: KeyLayout) -> Applier {
    let url = tally::infra::store::RedisUrl::parse(url).unwrap();
    let store = rt
        .block_on(tally::infra::store::Shared::open(&url))
        .unwrap();
    Applier::new(store, url.target().clone(), keys, "g", "likes")
}
