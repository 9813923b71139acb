//! `apply.lua` against a real redis-server: every case of the fence table,
//! the writes it makes (or does not), and recovery from a flushed script cache.

mod common;

use common::RedisServer;
use proptest::prelude::*;
use redis::Commands;
use tally::aggregate::{ClosedBatch, CounterId};
use tally::apply::Applier;
use tally::fence::{Decision, decide};
use tally::routing::KeyLayout;

fn batch(start: i64, last: i64, deltas: &[(u64, u32, i64)]) -> ClosedBatch {
    ClosedBatch {
        start,
        last,
        messages: (last - start + 1).max(0) as u64,
        bad: 0,
        deltas: deltas
            .iter()
            .map(|&(post_id, bucket, d)| (CounterId { post_id, bucket }, d))
            .collect(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn apply_duplicate_straddle_and_gap() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = rt
        .block_on(Applier::connect(
            &redis.url(),
            KeyLayout::new("t"),
            "g",
            "likes",
        ))
        .unwrap();
    let mut conn = redis.conn();
    let apply = |b: &ClosedBatch, expect: bool| {
        let prepared = applier.prepare(0, b, expect);
        rt.block_on(applier.apply_once(&prepared)).unwrap()
    };
    let count = |conn: &mut redis::Connection, post: u64, bucket: u32| -> i64 {
        conn.get::<_, Option<i64>>(format!("t:likes:{post}:{bucket}"))
            .unwrap()
            .unwrap_or(0)
    };
    let fence =
        |conn: &mut redis::Connection| -> Option<i64> { conn.get("t:fence:g:likes:0").unwrap() };

    // First batch: no fence yet.
    assert_eq!(
        apply(&batch(0, 9, &[(1, 0, 5), (1, 3, -1)]), false),
        Decision::Apply
    );
    assert_eq!((count(&mut conn, 1, 0), count(&mut conn, 1, 3)), (5, -1));
    assert_eq!(fence(&mut conn), Some(9));

    // The same batch again (a retry after a lost reply): nothing changes.
    assert_eq!(
        apply(&batch(0, 9, &[(1, 0, 5), (1, 3, -1)]), true),
        Decision::Duplicate
    );
    assert_eq!(count(&mut conn, 1, 0), 5);

    // A batch cut differently that straddles the fence is refused whole.
    assert_eq!(
        apply(&batch(5, 14, &[(1, 0, 100)]), true),
        Decision::Straddle { resume: 10 }
    );
    assert_eq!(count(&mut conn, 1, 0), 5);
    assert_eq!(fence(&mut conn), Some(9));

    // A batch past a hole (Redis lost writes) is refused: replay from the fence.
    assert_eq!(
        apply(&batch(20, 29, &[(1, 0, 100)]), true),
        Decision::Gap { resume: Some(10) }
    );
    assert_eq!(count(&mut conn, 1, 0), 5);

    // The continuation applies; a batch of only bad or cancelling events still
    // moves the fence.
    assert_eq!(apply(&batch(10, 19, &[(2, 1, 1)]), true), Decision::Apply);
    assert_eq!(apply(&batch(20, 24, &[]), true), Decision::Apply);
    assert_eq!(fence(&mut conn), Some(24));
    assert_eq!(count(&mut conn, 2, 1), 1);

    // The fence vanished (Redis restarted empty) while the consumer knew it.
    let _: () = conn.del("t:fence:g:likes:0").unwrap();
    assert_eq!(
        apply(&batch(25, 30, &[(2, 1, 1)]), true),
        Decision::Gap { resume: None }
    );
    assert_eq!(count(&mut conn, 2, 1), 1);

    // Nothing but counters matches the read pattern.
    let keys: Vec<String> = conn.keys("t:likes:*").unwrap();
    assert!(
        keys.iter()
            .all(|k| KeyLayout::new("t").parse_counter_key(k).is_some())
    );
}

#[test]
fn script_is_reloaded_after_script_flush() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = rt
        .block_on(Applier::connect(
            &redis.url(),
            KeyLayout::new("f"),
            "g",
            "likes",
        ))
        .unwrap();
    let mut conn = redis.conn();
    let first = applier.prepare(3, &batch(0, 0, &[(7, 0, 1)]), false);
    assert_eq!(
        rt.block_on(applier.apply_once(&first)).unwrap(),
        Decision::Apply
    );
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
    let second = applier.prepare(3, &batch(1, 1, &[(7, 0, 1)]), true);
    assert_eq!(
        rt.block_on(applier.apply_once(&second)).unwrap(),
        Decision::Apply
    );
    let value: i64 = conn.get("f:likes:7:0").unwrap();
    assert_eq!(value, 2);
}

#[test]
fn lua_agrees_with_the_decision_table() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = rt
        .block_on(Applier::connect(
            &redis.url(),
            KeyLayout::new("m"),
            "g",
            "likes",
        ))
        .unwrap();
    let conn = std::cell::RefCell::new(redis.conn());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(300));
    let cases = (
        proptest::option::of(0i64..40),
        0i64..40,
        0i64..20,
        any::<bool>(),
    );
    runner
        .run(&cases, |(fence, start, len, expect)| {
            let mut conn = conn.borrow_mut();
            let last = start + len;
            let key = "m:fence:g:likes:1";
            match fence {
                Some(f) => {
                    let _: () = conn.set(key, f).unwrap();
                }
                None => {
                    let _: () = conn.del(key).unwrap();
                }
            }
            let _: () = conn.set("m:likes:1:0", 0).unwrap();
            let prepared = applier.prepare(1, &batch(start, last, &[(1, 0, 3)]), expect);
            let got = rt.block_on(applier.apply_once(&prepared)).unwrap();
            let want = decide(fence, start, last, expect);
            prop_assert_eq!(got, want);
            let after: Option<i64> = conn.get(key).unwrap();
            let counted: i64 = conn.get("m:likes:1:0").unwrap();
            if want == Decision::Apply {
                prop_assert_eq!((after, counted), (Some(last), 3));
            } else {
                prop_assert_eq!((after, counted), (fence, 0));
            }
            Ok(())
        })
        .unwrap();
}
