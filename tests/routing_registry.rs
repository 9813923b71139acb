//! The routing registry against a real redis-server, where a failover would bite: its clock
//! never goes back below what it answered before, publications take effect after it, and a
//! reader sums a version the registry lists even when the post's route hash lost it.

mod common;
mod library;

use std::time::Duration;

use common::*;
use tally::domain::routing::{CounterId, KeyLayout};
use tally::domain::versions::{GRACE_MS, Routes, Trigger, wall_ms};
use tally::infra::store::{RedisUrl, Shared};

fn routes(rt: &tokio::runtime::Runtime, url: &str, prefix: &str) -> Routes {
    let url = RedisUrl::parse(url).unwrap();
    let store = rt.block_on(Shared::open(&url)).unwrap();
    Routes::new(store, KeyLayout::new(prefix), 4)
}

/// A replica promoted with a clock a minute behind the old primary's: the registry answers
/// with the time it already handed out, and a version published now takes effect after it.
#[test]
fn the_registry_clock_never_goes_back() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let prefix = unique("clock");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let routes = routes(&rt, &redis.url(), &prefix);
    let ahead = wall_ms() + 60_000;
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}:routes"))
        .arg("clock")
        .arg(ahead)
        .query(&mut conn)
        .unwrap();
    let table = rt.block_on(routes.fetch()).unwrap();
    assert!(
        table.now_ms() >= ahead,
        "the registry answered {} after handing out {ahead}",
        table.now_ms()
    );
    let latest = table.latest(7);
    let published = rt
        .block_on(routes.publish(7, 32, latest, Trigger::Manual))
        .unwrap();
    let effective = published.versions.last().unwrap().effective_ms;
    assert!(
        effective >= ahead + GRACE_MS,
        "a version published at the registry's time {ahead} takes effect at {effective}"
    );
    // The field itself is not a post: the writers' table holds no routed post for it.
    assert_eq!(rt.block_on(routes.fetch()).unwrap().routed_posts(), 1);
}

/// The route hash lost its copy of version 1 (a failover that kept the registry's write but not
/// the hash's): readers still sum the version's keys.
#[test]
fn readers_take_versions_from_the_registry_too() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let prefix = unique("lost");
    write_layout_record(&mut conn, &prefix, 4);
    let keys = KeyLayout::new(&prefix);
    let set = |conn: &mut redis::Connection, id: CounterId, value: i64| {
        let _: () = redis::cmd("SET")
            .arg(keys.key_of(id))
            .arg(value)
            .query(conn)
            .unwrap();
    };
    set(&mut conn, CounterId::v0(5, 2), 3);
    let hot = CounterId {
        post_id: 5,
        version: 1,
        bucket: 17,
    };
    set(&mut conn, hot, 40);
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}:routes"))
        .arg("5")
        .arg("0:4:0;1:32:1000")
        .query(&mut conn)
        .unwrap();
    let (rt, reader) = library::reader(&redis.url(), &prefix, 1, 4, Duration::ZERO);
    assert_eq!(rt.block_on(reader.count(5)).unwrap().likes, 43);
    let (_, summed) = rt.block_on(reader.summed_keys(5)).unwrap();
    assert!(summed.contains(&keys.key_of(hot)), "{summed:?}");
}
