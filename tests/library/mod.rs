//! The library's read path as the tests use it: a [`Reader`] opened the way
//! every tally command opens its store. Kept apart from `tests/common`, which
//! never depends on the code under test.

use std::time::Duration;

use tally::infra::config::StoreSettings;
use tally::read::Reader;
use tokio::runtime::Runtime;

/// A reader of the counts under `prefix` at `url`, with `slot_groups` slot
/// groups on a cluster, `buckets` for a post without routing metadata and a
/// cache of `ttl`; with the runtime to drive it.
pub fn reader(
    url: &str,
    prefix: &str,
    slot_groups: u32,
    buckets: u32,
    ttl: Duration,
) -> (Runtime, Reader) {
    let rt = Runtime::new().expect("a runtime");
    let settings = StoreSettings::new(url, None, prefix, slot_groups).expect("store settings");
    let opened = rt
        .block_on(tally::domain::layout::open(&settings))
        .expect("open the reader's store");
    let reader = Reader::new(opened.store, opened.keys, buckets, ttl);
    (rt, reader)
}
