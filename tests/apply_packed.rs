//! `apply_packed.lua` against a real redis-server: the fence table, the
//! fields it writes, all-or-nothing when a field or a key refuses, and a
//! fence key that holds no offset.

mod common;

use std::collections::BTreeMap;

use common::{RedisServer, applier, runtime, script};
use proptest::prelude::*;
use redis::Commands;
use tally::domain::fence::{Decision, Reply, decide};
use tally::domain::packing::{Packed, Packing};
use tally::domain::routing::KeyLayout;
use tally::pipeline::aggregate::CounterId;
use tally::pipeline::apply::{ApplyError, Prepared};

/// A packed layout of `hashes` hashes under `prefix`.
fn packed(prefix: &str, hashes: u32) -> KeyLayout {
    KeyLayout::new(prefix).with_packing(Packing::Packed(Packed { hashes, fields: 64 }))
}

/// Every field of every hash under `prefix`, read without the layout's
/// parsing: hash key and field as Redis holds them (a key of another type
/// as its type).
fn fields(conn: &mut redis::Connection, prefix: &str) -> BTreeMap<(String, String), String> {
    let keys: Vec<String> = conn.keys(format!("{prefix}:packed:*")).unwrap();
    let mut all = BTreeMap::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query(conn).unwrap();
        if kind != "hash" {
            all.insert((key, kind.clone()), kind);
            continue;
        }
        let pairs: Vec<(String, String)> = conn.hgetall(&key).unwrap();
        for (field, value) in pairs {
            all.insert((key.clone(), field), value);
        }
    }
    all
}

/// The count of a counter, summing every hash's field of that name: a
/// field written to two hashes would show.
fn count(conn: &mut redis::Connection, prefix: &str, field: &str) -> i64 {
    fields(conn, prefix)
        .iter()
        .filter(|((_, f), _)| f == field)
        .map(|(_, v)| v.parse::<i64>().unwrap())
        .sum()
}

#[test]
fn apply_duplicate_straddle_and_gap_on_fields() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), packed("t", 4));
    let mut conn = redis.conn();
    let apply = |p: &Prepared| rt.block_on(applier.apply_once(p)).unwrap().unwrap();
    let reply = |decision, fence| Reply { decision, fence };
    let fence =
        |conn: &mut redis::Connection| -> Option<i64> { conn.get("t:fence:g:likes:0").unwrap() };

    let first = script(0, 9, -1, &[(1, 0, 5), (1, 3, -1), (u64::MAX, 0, 2)]);
    assert_eq!(apply(&first), reply(Decision::Apply, -1));
    assert_eq!(count(&mut conn, "t", "1"), 5);
    assert_eq!(count(&mut conn, "t", "1:3"), -1);
    // A post id past i64::MAX is its signed integer: u64::MAX is -1.
    assert_eq!(count(&mut conn, "t", "-1"), 2);
    assert_eq!(fence(&mut conn), Some(9));
    // Nothing but hashes of fields and the fence.
    let keys: Vec<String> = conn.keys("t:*").unwrap();
    assert!(
        keys.iter()
            .all(|k| k.starts_with("t:packed:") || k == "t:fence:g:likes:0"),
        "{keys:?}"
    );

    assert_eq!(apply(&first), reply(Decision::Duplicate, 9));
    assert_eq!(
        apply(&script(5, 14, -1, &[(1, 0, 100)])),
        reply(Decision::Straddle, 9)
    );
    assert_eq!(
        apply(&script(20, 29, -1, &[(1, 0, 100)])),
        reply(Decision::Gap, 9)
    );
    assert_eq!(count(&mut conn, "t", "1"), 5);
    assert_eq!(
        apply(&script(10, 19, -1, &[(1, 0, -5)])),
        reply(Decision::Apply, 9)
    );
    // A field back at 0 stays (HINCRBY keeps it); absent and 0 read alike.
    assert_eq!(count(&mut conn, "t", "1"), 0);
    assert_eq!(apply(&script(20, 24, -1, &[])), reply(Decision::Apply, 19));
    assert_eq!(fence(&mut conn), Some(24));
}

/// A field HINCRBY refuses, or a hash key of another type, anywhere in the batch, leaves every
/// field, every key and the fence as they were.
/// A fence overwritten with what is not an offset refuses the call with the
/// key named, and no field is written.
#[test]
fn a_fence_that_holds_no_offset_refuses_the_call() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), packed("f", 2));
    let mut conn = redis.conn();
    let _: () = conn.set("f:fence:g:likes:0", "nine").unwrap();
    let error = rt
        .block_on(applier.apply_once(&script(0, 9, -1, &[(1, 0, 5), (2, 0, 1)])))
        .expect_err("a call past a broken fence");
    let text = error.to_string();
    assert!(
        text.contains("f:fence:g:likes:0 holds \"nine\", which is not an offset"),
        "{text}"
    );
    assert!(fields(&mut conn, "f").is_empty(), "the refused call wrote");
}

#[test]
fn a_refused_field_or_key_writes_nothing() {
    let redis = RedisServer::start();
    let rt = runtime();
    let keys = packed("r", 3);
    let applier = applier(&rt, &redis.url(), keys.clone());
    let mut conn = redis.conn();
    // 60 counters over three hashes; one field of post 31 holds text, then
    // one hash is replaced by a string.
    let deltas: Vec<(u64, u32, i64)> = (0..60).map(|p| (p, 0, 1 + (p % 3) as i64)).collect();
    for p in (0..60u64).step_by(4) {
        let place = keys.place_of(CounterId::v0(p, 0));
        let _: () = conn.hset(&place.key, place.field.unwrap(), 7).unwrap();
    }
    let bad = keys.place_of(CounterId::v0(31, 0));
    let _: () = conn
        .hset(&bad.key, bad.field.as_ref().unwrap(), "x")
        .unwrap();
    let before = fields(&mut conn, "r");
    let batch = script(0, 9, -1, &deltas);
    for _ in 0..2 {
        match rt.block_on(applier.apply_once(&batch)).unwrap() {
            Err(ApplyError::BadKey { key, error, .. }) => {
                assert_eq!(key, format!("{} 31", bad.key));
                assert!(error.contains("not an integer"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(fields(&mut conn, "r"), before);
        let fence: Option<i64> = conn.get("r:fence:g:likes:0").unwrap();
        assert_eq!(fence, None);
    }
    // A hash key that holds a string.
    let _: () = conn.del(&bad.key).unwrap();
    let _: () = conn.set(&bad.key, "not a hash").unwrap();
    let before = fields(&mut conn, "r");
    match rt.block_on(applier.apply_once(&batch)).unwrap() {
        Err(ApplyError::BadKey { key, error, .. }) => {
            assert!(key.starts_with(&bad.key), "{key}");
            assert!(error.contains("WRONGTYPE"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fields(&mut conn, "r"), before);
    let kind: String = redis::cmd("TYPE").arg(&bad.key).query(&mut conn).unwrap();
    assert_eq!(kind, "string");
    // Fixed, the batch applies whole, once.
    let _: () = conn.del(&bad.key).unwrap();
    let after_fix = fields(&mut conn, "r");
    rt.block_on(applier.apply_once(&batch)).unwrap().unwrap();
    for &(p, _, d) in &deltas {
        let place = keys.place_of(CounterId::v0(p, 0));
        let held = after_fix
            .get(&(place.key.clone(), place.field.clone().unwrap()))
            .map_or(0, |v| v.parse::<i64>().unwrap());
        let now: i64 = conn.hget(&place.key, place.field.unwrap()).unwrap();
        assert_eq!(now, held + d, "post {p}");
    }
}

/// Many counters of random 64-bit posts, versions and buckets land in their hashes whole: every
/// field read back names its counter, and the sums equal the string layout's for the same
/// batch.
#[test]
fn a_large_batch_lands_as_on_string_keys() {
    let redis = RedisServer::start();
    let rt = runtime();
    let packed_keys = packed("p", 40);
    let packed_applier = applier(&rt, &redis.url(), packed_keys.clone());
    let strings = applier(&rt, &redis.url(), KeyLayout::new("s"));
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut deltas: BTreeMap<CounterId, i64> = BTreeMap::new();
    for i in 0..3_000u64 {
        let id = CounterId {
            post_id: next(),
            version: [0, 0, 0, 3, tally::domain::routing::epoch_version(2)][(i % 5) as usize],
            bucket: (next() % 8) as u32,
        };
        *deltas.entry(id).or_default() += (next() % 5) as i64 - 1;
    }
    let prepared = Prepared {
        partition: 0,
        group: 0,
        start: 0,
        last: 99,
        absent_fence: -1,
        windows: Vec::new(),
        deltas: deltas.iter().map(|(&id, &d)| (id, d)).collect(),
    };
    rt.block_on(packed_applier.apply_once(&prepared))
        .unwrap()
        .unwrap();
    rt.block_on(strings.apply_once(&prepared)).unwrap().unwrap();
    let target = tally::infra::store::RedisUrl::parse(&redis.url())
        .unwrap()
        .target()
        .clone();
    let read = |layout: &KeyLayout| {
        let mut all = BTreeMap::new();
        tally::domain::placement::scan_counters(&target, layout, |id, v| {
            *all.entry(id).or_insert(0) += v;
        })
        .unwrap();
        all.retain(|_, v| *v != 0);
        all
    };
    let mut want = deltas.clone();
    want.retain(|_, v| *v != 0);
    assert_eq!(read(&packed_keys), want);
    assert_eq!(read(&KeyLayout::new("s")), want);
    // 40 hashes, none empty, none past what a listpack holds here.
    let mut conn = redis.conn();
    let hashes: Vec<String> = conn.keys("p:packed:*").unwrap();
    assert_eq!(hashes.len(), 40);
    for key in hashes {
        let len: u64 = conn.hlen(&key).unwrap();
        assert!(len > 20, "{key}: {len}");
    }
}

/// Arguments that do not give whole pairs for each hash are refused before anything is written.
#[test]
fn arguments_that_do_not_cover_the_hashes_are_refused() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let eval = |args: &[&str]| {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(tally::pipeline::apply::APPLY_PACKED_LUA)
            .arg(3)
            .arg("f")
            .arg(&["h:1", "h:2"][..])
            .arg(&[0, 9, -1, 0, 0][..]);
        cmd.arg(args);
        cmd
    };
    // Each hash: its number, its count of pairs, the pairs.
    for args in [
        &["1", "1", "a", "1"][..],
        &["1", "1", "a", "1", "2", "2", "b", "1", "c"],
        &["1", "1", "a", "1", "2", "1", "b", "1", "3", "1", "c", "1"],
        &["1", "1", "a", "1", "x", "1", "b", "1"],
        &["x"],
        &[],
    ] {
        let refused: redis::RedisResult<redis::Value> = eval(args).query(&mut conn);
        let error = refused
            .expect_err("a call with uncovered hashes")
            .to_string();
        assert!(
            error.contains("whole (field, delta) pairs"),
            "{args:?}: {error}"
        );
        let keys: Vec<String> = conn.keys("*").unwrap();
        assert!(keys.is_empty(), "{args:?} wrote {keys:?}");
    }
    let applied: Vec<i64> = eval(&["1", "1", "a", "2", "2", "2", "b", "1", "c", "-1"])
        .query(&mut conn)
        .unwrap();
    assert_eq!(applied, [0, -1, 2]);
    let b: Vec<i64> = redis::cmd("HMGET")
        .arg("h:2")
        .arg(&["b", "c"][..])
        .query(&mut conn)
        .unwrap();
    assert_eq!(b, [1, -1]);
}

#[test]
fn packed_lua_agrees_with_the_decision_table() {
    let redis = RedisServer::start();
    let rt = runtime();
    let keys = packed("m", 1);
    let applier = applier(&rt, &redis.url(), keys.clone());
    let conn = std::cell::RefCell::new(redis.conn());
    let place = keys.place_of(CounterId::v0(1, 0));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(200));
    let cases = (proptest::option::of(0i64..40), 0i64..40, 0i64..20, -1i64..5);
    runner
        .run(&cases, |(fence, start, len, absent)| {
            let mut conn = conn.borrow_mut();
            let last = start + len - 1;
            let key = "m:fence:g:likes:0";
            match fence {
                Some(f) => {
                    let _: () = conn.set(key, f).unwrap();
                }
                None => {
                    let _: () = conn.del(key).unwrap();
                }
            }
            let field = place.field.as_deref().unwrap();
            let _: () = conn.hset(&place.key, field, 0).unwrap();
            let got = rt
                .block_on(applier.apply_once(&script(start, last, absent, &[(1, 0, 3)])))
                .unwrap()
                .unwrap();
            let effective = fence.unwrap_or(absent);
            let want = decide(effective, start, last);
            prop_assert_eq!(
                got,
                Reply {
                    decision: want,
                    fence: effective
                }
            );
            let after: Option<i64> = conn.get(key).unwrap();
            let counted: i64 = conn.hget(&place.key, field).unwrap();
            if want == Decision::Apply {
                prop_assert_eq!((after, counted), (Some(last), 3));
            } else {
                prop_assert_eq!((after, counted), (fence, 0));
            }
            Ok(())
        })
        .unwrap();
}
