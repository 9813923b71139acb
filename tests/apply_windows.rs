//! The window section of the apply scripts against a real redis-server, on
//! both layouts: window deltas land with the counters behind the fence, once;
//! a member brought to zero leaves its set; a set expires at its window's end
//! plus the retention; and a window key of another type refuses the whole
//! call before anything is written.

mod common;

use std::collections::BTreeMap;

use common::{RedisServer, applier, runtime, script};
use redis::Commands;
use tally::domain::fence::Decision;
use tally::domain::packing::{Packed, Packing};
use tally::domain::routing::KeyLayout;
use tally::domain::windows::{WindowSize, Windows};
use tally::pipeline::aggregate::WindowCell;
use tally::pipeline::apply::{ApplyError, Prepared};

const HOUR: i64 = 3_600_000;

/// Windows of one minute and one hour, a day kept after their end.
fn windows() -> Windows {
    let sizes = Windows::parse_sizes("1m,1h").unwrap();
    Windows::new(sizes, 60_000, 86_400_000).unwrap()
}

fn layouts() -> [(&'static str, KeyLayout); 2] {
    let strings = KeyLayout::new("t").with_windows(windows());
    let packed = strings.with_packing(Packing::Packed(Packed {
        hashes: 4,
        fields: 64,
    }));
    [("strings", strings), ("packed", packed)]
}

/// `script` with window deltas `(size index, start, post, delta)`, in window order.
fn with_windows(mut prepared: Prepared, cells: &[(u8, i64, u64, i64)]) -> Prepared {
    prepared.windows = cells
        .iter()
        .map(|&(size, start, post_id, delta)| {
            (
                WindowCell {
                    size,
                    start,
                    post_id,
                },
                delta,
            )
        })
        .collect();
    prepared.windows.sort_unstable();
    prepared
}

/// Every member of every window set, as (key, post) → likes, read without
/// tally's parsing of members.
fn sets(conn: &mut redis::Connection) -> BTreeMap<(String, u64), i64> {
    let keys: Vec<String> = conn.keys("t:win:*").unwrap();
    let mut all = BTreeMap::new();
    for key in keys {
        let members: Vec<(Vec<u8>, i64)> = conn.zrange_withscores(&key, 0, -1).unwrap();
        for (member, score) in members {
            let post = u64::from_be_bytes(member.try_into().expect("8-byte members"));
            all.insert((key.clone(), post), score);
        }
    }
    all
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A fresh redis-server, a runtime, an applier under `keys` and a connection.
fn server(
    keys: &KeyLayout,
) -> (
    RedisServer,
    tokio::runtime::Runtime,
    tally::pipeline::apply::Applier,
    redis::Connection,
) {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), keys.clone());
    let conn = redis.conn();
    (redis, rt, applier, conn)
}

#[test]
fn window_deltas_land_once_with_the_counters() {
    for (name, keys) in layouts() {
        let (_redis, rt, applier, mut conn) = server(&keys);
        let hour = now_ms() / HOUR * HOUR;
        let first = with_windows(
            script(0, 9, -1, &[(7, 0, 3), (8, 0, 1)]),
            &[
                (0, hour, 7, 2),
                (0, hour + 60_000, 7, 1),
                (1, hour, 7, 3),
                (1, hour, 8, 1),
            ],
        );
        let reply = rt.block_on(applier.apply_once(&first)).unwrap().unwrap();
        assert_eq!(reply.decision, Decision::Apply, "{name}");
        // The same range again is a duplicate: nothing is added twice.
        let again = rt.block_on(applier.apply_once(&first)).unwrap().unwrap();
        assert_eq!(again.decision, Decision::Duplicate, "{name}");
        let minute = |start: i64| format!("t:win:1m:{start}");
        let expected = BTreeMap::from([
            ((minute(hour), 7), 2),
            ((minute(hour + 60_000), 7), 1),
            ((format!("t:win:1h:{hour}"), 7), 3),
            ((format!("t:win:1h:{hour}"), 8), 1),
        ]);
        assert_eq!(sets(&mut conn), expected, "{name}");
        // An unlike that brings a post's window to zero takes it out of the set.
        let undone = with_windows(script(10, 10, -1, &[(8, 0, -1)]), &[(1, hour, 8, -1)]);
        let reply = rt.block_on(applier.apply_once(&undone)).unwrap().unwrap();
        assert_eq!(reply.decision, Decision::Apply, "{name}");
        let members: i64 = conn.zcard(format!("t:win:1h:{hour}")).unwrap();
        assert_eq!(members, 1, "{name}: a member at 0 stays in its set");
        // Each set expires at its window's end plus the retention.
        let expiry: i64 = redis::cmd("PEXPIRETIME")
            .arg(minute(hour))
            .query(&mut conn)
            .unwrap();
        assert_eq!(expiry, hour + 60_000 + 86_400_000, "{name}");
    }
}

#[test]
fn a_window_already_expired_keeps_nothing_and_the_counters_still_count() {
    for (name, keys) in layouts() {
        let (_redis, rt, applier, mut conn) = server(&keys);
        // Two days ago: past its end plus a day's retention.
        let old = (now_ms() - 48 * HOUR) / HOUR * HOUR;
        let prepared = with_windows(script(0, 0, -1, &[(7, 0, 1)]), &[(1, old, 7, 1)]);
        let reply = rt.block_on(applier.apply_once(&prepared)).unwrap().unwrap();
        assert_eq!(reply.decision, Decision::Apply, "{name}");
        assert!(sets(&mut conn).is_empty(), "{name}");
        let place = keys.place_of(tally::domain::routing::CounterId::v0(7, 0));
        let count: Option<i64> = match &place.field {
            Some(field) => conn.hget(&place.key, field).unwrap(),
            None => conn.get(&place.key).unwrap(),
        };
        assert_eq!(count, Some(1), "{name}");
    }
}

#[test]
fn a_window_key_of_another_type_refuses_the_call_and_writes_nothing() {
    for (name, keys) in layouts() {
        let (_redis, rt, applier, mut conn) = server(&keys);
        let hour = now_ms() / HOUR * HOUR;
        let stray = format!("t:win:1h:{hour}");
        let _: () = conn.set(&stray, "not a set").unwrap();
        let prepared = with_windows(
            script(0, 4, -1, &[(7, 0, 1), (8, 0, 2)]),
            &[(0, hour, 7, 1), (1, hour, 7, 1), (1, hour, 8, 2)],
        );
        let refused = rt.block_on(applier.apply_once(&prepared)).unwrap();
        match refused {
            Err(ApplyError::BadKey { key, error, .. }) => {
                assert_eq!(key, stray, "{name}");
                assert!(error.contains("WRONGTYPE"), "{name}: {error}");
            }
            other => panic!("{name}: {other:?}"),
        }
        let mut all: Vec<String> = conn.keys("t:*").unwrap();
        all.sort();
        assert_eq!(
            all,
            std::slice::from_ref(&stray),
            "{name}: the refused call wrote"
        );
        let value: String = conn.get(&stray).unwrap();
        assert_eq!(value, "not a set");
    }
}

/// Window keys carry the slot group's tag on a cluster, the group of the post's bucket 0.
#[test]
fn window_keys_share_the_slot_of_their_posts_first_bucket() {
    use tally::domain::slots::{SlotGroups, key_slot};
    let keys = KeyLayout::with_groups("t", SlotGroups::cluster(16)).with_windows(windows());
    let size: WindowSize = "1h".parse().unwrap();
    for post in 1..200u64 {
        let set = keys.window_key(size, 0, post);
        let counter = keys.counter_key(post, 0);
        assert_eq!(
            key_slot(set.as_bytes()),
            key_slot(counter.as_bytes()),
            "{set}"
        );
    }
    assert_eq!(keys.window_keys(size, 0).len(), 16);
}
