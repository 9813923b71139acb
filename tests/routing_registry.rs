//! The routing registry against a real redis-server, where a failover would bite: its clock
//! never goes back below what it answered before, publications take effect after it, and a
//! reader sums a version the registry lists even when the post's route hash lost it. And the
//! two steps of an unfreeze: what they keep, move and refuse. A field tally did not write is
//! counted, not silently skipped.

mod common;
mod library;

use std::time::Duration;

use common::*;
use tally::domain::routing::{CounterId, KeyLayout};
use tally::domain::versions::{
    FROZEN_AHEAD_MS, GRACE_MS, Routes, Trigger, UnfreezeBegin, UnfreezeFinish, wall_ms,
};
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

/// A registry field tally did not write (a post's versions, or the final time) is counted in
/// the table it was read into, beside every readable entry: the metric and the alert on it
/// report a post whose hot buckets readers would no longer sum.
#[test]
fn an_unreadable_registry_field_is_counted_and_the_rest_is_read() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let prefix = unique("stray");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let routes = routes(&rt, &redis.url(), &prefix);
    let registry = format!("{prefix}:routes");
    let hset = |conn: &mut redis::Connection, field: &str, value: &str| {
        let _: () = redis::cmd("HSET")
            .arg(&registry)
            .arg(field)
            .arg(value)
            .query(conn)
            .unwrap();
    };
    hset(&mut conn, "5", "0:4:0;1:32:1000");
    let table = rt.block_on(routes.fetch()).unwrap();
    assert_eq!(table.unreadable(), 0);
    hset(&mut conn, "6", "thirty-two");
    hset(&mut conn, "final", "soon");
    let table = rt.block_on(routes.fetch()).unwrap();
    assert_eq!(table.unreadable(), 2);
    let hot = table.counter_of(0, 0, 5, 7, 2_000);
    assert_eq!(hot.version, 1, "the readable entry still routes");
}

/// 2099-06-01.
const YEAR_2099_MS: i64 = 4_083_955_200_000;

/// A registry frozen by an event stamped in 2099 (partition 0, offset 10), with a version and
/// an epoch published while frozen, is unfrozen: the 2099 event keeps the version it was routed
/// to, the versions published while frozen take effect within seconds, a replay of the event
/// makes nothing final, and a new event stamped in 2099 freezes routing again.
#[test]
fn an_unfreeze_keeps_the_routes_of_events_counted_and_moves_the_rest_to_the_clock() {
    let redis = RedisServer::start();
    let prefix = unique("unfreeze");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let routes = routes(&rt, &redis.url(), &prefix);
    let begin = || rt.block_on(routes.unfreeze_begin()).unwrap();
    assert!(
        matches!(begin(), UnfreezeBegin::NotFrozen { .. }),
        "nothing to undo"
    );
    let fetch = || rt.block_on(routes.fetch()).unwrap();
    let publish = |post: u64, buckets: u32| {
        let latest = fetch().latest(post);
        rt.block_on(routes.publish(post, buckets, latest, Trigger::Manual))
            .unwrap()
            .versions
    };
    publish(7, 16);
    // Stamped in 2099: routing is final up to it, by one script.
    let frozen = rt.block_on(routes.finalize(0, 10, YEAR_2099_MS)).unwrap();
    assert!(frozen.frozen());
    let counted = frozen.route_of(0, 10, 7, YEAR_2099_MS);
    assert_eq!((counted.version, counted.buckets), (1, 16));
    // Published while frozen: they take effect after 2099.
    let v2 = *publish(7, 64).last().unwrap();
    assert!(v2.effective_ms > YEAR_2099_MS);
    rt.block_on(routes.rebucket(8)).unwrap();

    let UnfreezeBegin::Begun {
        started_ms,
        undone_ms,
        bound_ms,
    } = begin()
    else {
        panic!("routing is frozen")
    };
    assert_eq!(undone_ms, YEAR_2099_MS + GRACE_MS);
    assert!(bound_ms <= wall_ms() + GRACE_MS + 1_000);
    // While under way, publications still take effect after the time undone.
    let v1_of_8 = *publish(8, 32).last().unwrap();
    assert!(v1_of_8.effective_ms > undone_ms);
    assert!(fetch().frozen(), "still frozen until it finishes");
    let finish = rt
        .block_on(routes.unfreeze_finish(started_ms, Duration::ZERO, &[(0, 10), (1, 4)]))
        .unwrap();
    let UnfreezeFinish::Done {
        moved, final_ms, ..
    } = finish
    else {
        panic!("{finish:?}")
    };
    assert_eq!(moved, 3, "post 7's v2, post 8's v1 and epoch 1");
    assert!(final_ms < wall_ms() + FROZEN_AHEAD_MS);

    let table = fetch();
    assert!(!table.frozen());
    assert_eq!(table.unfreezes().len(), 1);
    // The counted event keeps its route; a later one goes to the version published while frozen,
    // which now takes effect within seconds, as do the others.
    assert_eq!(table.route_of(0, 10, 7, YEAR_2099_MS), counted);
    let newest = table.route_of(0, 11, 7, YEAR_2099_MS);
    assert_eq!((newest.version, newest.buckets), (2, 64));
    assert!(newest.effective_ms < wall_ms() + 2 * GRACE_MS);
    assert_eq!(table.latest(8).buckets, 32);
    assert!(table.latest(8).effective_ms < wall_ms() + 2 * GRACE_MS);
    assert_eq!(table.defaults().latest().buckets, 8);
    assert!(table.defaults().latest().effective_ms < wall_ms() + 2 * GRACE_MS);
    // A replay of the counted event (from a table that lacks the record) raises nothing.
    let replayed = rt.block_on(routes.finalize(0, 10, YEAR_2099_MS)).unwrap();
    assert!(!replayed.frozen());
    assert_eq!(replayed.route_of(0, 10, 7, YEAR_2099_MS), counted);

    // A new event stamped ahead while an unfreeze waits: it refuses and restores the time.
    let again = rt.block_on(routes.finalize(1, 5, YEAR_2099_MS)).unwrap();
    assert!(again.frozen(), "a new event in 2099 freezes routing again");
    let UnfreezeBegin::Begun { started_ms, .. } = begin() else {
        panic!("frozen again")
    };
    rt.block_on(routes.finalize(2, 5, YEAR_2099_MS + 1))
        .unwrap();
    let finish = rt
        .block_on(routes.unfreeze_finish(started_ms, Duration::ZERO, &[]))
        .unwrap();
    assert!(
        matches!(finish, UnfreezeFinish::StillAhead { .. }),
        "{finish:?}"
    );
    let table = fetch();
    assert!(table.frozen() && table.final_ms() >= YEAR_2099_MS + GRACE_MS);
    assert_eq!(table.unfreezes().len(), 1, "nothing recorded");
    // Given up between the steps: routing stays frozen as before.
    let UnfreezeBegin::Begun {
        started_ms,
        undone_ms,
        ..
    } = begin()
    else {
        panic!("still frozen")
    };
    assert!(rt.block_on(routes.unfreeze_abort(started_ms)).unwrap());
    assert_eq!(fetch().final_ms(), undone_ms);
}
