//! Counters present: passes of the pipelined naive consumer and of `tally run`
//! over a prefix whose counter keys exist before the first event is read, as
//! in a deployment that has been counting its posts for a while.
//!
//! On a new prefix each post's first write creates its key, and every consumer
//! creates the same keys however it batches; these passes show what the
//! creations cost, by counting without them. Before such a pass the benchmark
//! sets each post's version-0 counters to `0` (and, for tally, writes the
//! layout record its first start would write): counts stay exact.

use anyhow::Result;
use rustc_hash::FxHashMap;

use tally::domain::layout::{Record, ensure_record, format_for, open};
use tally::domain::routing::{CounterId, KeyLayout};
use tally::domain::windows::Windows;
use tally::infra::config::StoreSettings;

/// Keys set per pipeline while seeding.
const SEED_CHUNK: usize = 10_000;

/// Sets every version-0 counter of every post of `truth` under `prefix` to
/// `0`, for `buckets` buckets per post.
pub(super) fn seed(
    conn: &mut redis::Connection,
    prefix: &str,
    truth: &FxHashMap<u64, i64>,
    buckets: u32,
) -> Result<()> {
    let layout = KeyLayout::new(prefix);
    let mut posts: Vec<u64> = truth.keys().copied().collect();
    posts.sort_unstable();
    let mut key = String::with_capacity(64);
    for chunk in posts.chunks(SEED_CHUNK) {
        let mut pipe = redis::pipe();
        for &post in chunk {
            for bucket in 0..buckets {
                layout.write_counter_key(&mut key, CounterId::v0(post, bucket), Default::default());
                pipe.cmd("SET").arg(key.as_str()).arg(0).ignore();
            }
        }
        pipe.query::<()>(conn)?;
    }
    Ok(())
}

/// Writes the layout record that a first `tally run` with `buckets`, `topic`
/// and `group` would write under `prefix`, so that its start finds its own
/// record beside the seeded keys instead of data to adopt.
pub(super) fn record(
    redis_url: &str,
    prefix: &str,
    topic: &str,
    group: &str,
    buckets: u32,
    windows: Windows,
) -> Result<()> {
    tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current().block_on(async {
            let settings = crate::local::store(redis_url, prefix)?;
            write_record(&settings, topic, group, buckets, windows).await
        })
    })
}

/// Writes the layout record of a writer with `buckets` and `windows` on a
/// single server, unless the prefix has one.
pub(super) async fn write_record(
    store: &StoreSettings,
    topic: &str,
    group: &str,
    buckets: u32,
    windows: Windows,
) -> Result<()> {
    let opened = open(store).await?;
    let proposed = Record {
        format: format_for(&Default::default(), &windows),
        buckets,
        slot_groups: 1,
        topic: topic.to_string(),
        group: group.to_string(),
        created_at_ms: tally::domain::versions::wall_ms(),
        packed: Default::default(),
        windows,
    };
    ensure_record(&opened.store, store.prefix(), &proposed).await?;
    Ok(())
}
