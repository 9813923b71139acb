//! `apply.lua` against a real redis-server: every case of the fence table,
//! the writes it makes (or does not), a fence key that holds no offset, and
//! recovery from a flushed script cache.

mod common;

use common::{RedisServer, applier, runtime, script};
use proptest::prelude::*;
use redis::Commands;
use tally::domain::fence::{Decision, Reply, decide};
use tally::domain::routing::KeyLayout;
use tally::pipeline::apply::Prepared;

fn reply(decision: Decision, fence: i64) -> Reply {
    Reply { decision, fence }
}

/// A fence overwritten with what is not an offset refuses every call with the
/// key named, and nothing is written: no guess of the lost fence is safe.
#[test]
fn a_fence_that_holds_no_offset_refuses_the_call() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("t"));
    let mut conn = redis.conn();
    for stray in ["12o45", "1.5", ""] {
        let _: () = conn.set("t:fence:g:likes:0", stray).unwrap();
        let error = rt
            .block_on(applier.apply_once(&script(0, 9, -1, &[(1, 0, 5)])))
            .expect_err("a call past a broken fence");
        let text = error.to_string();
        assert!(
            text.contains(&format!(
                "t:fence:g:likes:0 holds \"{stray}\", which is not an offset"
            )) && text.contains("tally rebuild"),
            "{text}"
        );
        let counter: Option<i64> = conn.get("t:likes:1:0").unwrap();
        assert_eq!(counter, None, "{stray}: the refused call wrote");
    }
}

#[test]
fn apply_duplicate_straddle_and_gap() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("t"));
    let mut conn = redis.conn();
    let apply = |p: &Prepared| rt.block_on(applier.apply_once(p)).unwrap().unwrap();
    let count = |conn: &mut redis::Connection, post: u64, bucket: u32| -> i64 {
        conn.get::<_, Option<i64>>(format!("t:likes:{post}:{bucket}"))
            .unwrap()
            .unwrap_or(0)
    };
    let fence =
        |conn: &mut redis::Connection| -> Option<i64> { conn.get("t:fence:g:likes:0").unwrap() };

    // First batch: no fence yet, origin 0.
    assert_eq!(
        apply(&script(0, 9, -1, &[(1, 0, 5), (1, 3, -1)])),
        reply(Decision::Apply, -1)
    );
    assert_eq!((count(&mut conn, 1, 0), count(&mut conn, 1, 3)), (5, -1));
    assert_eq!(fence(&mut conn), Some(9));

    // The same batch again (a retry after a lost reply): nothing changes.
    assert_eq!(
        apply(&script(0, 9, -1, &[(1, 0, 5), (1, 3, -1)])),
        reply(Decision::Duplicate, 9)
    );
    assert_eq!(count(&mut conn, 1, 0), 5);

    // A range cut differently that straddles the fence is refused whole.
    assert_eq!(
        apply(&script(5, 14, -1, &[(1, 0, 100)])),
        reply(Decision::Straddle, 9)
    );
    assert_eq!(count(&mut conn, 1, 0), 5);
    assert_eq!(fence(&mut conn), Some(9));

    // A range past a hole (Redis lost writes) is refused: replay from the fence.
    assert_eq!(
        apply(&script(20, 29, -1, &[(1, 0, 100)])),
        reply(Decision::Gap, 9)
    );
    assert_eq!(count(&mut conn, 1, 0), 5);

    // The continuation applies; a range of only bad or cancelling events still
    // moves the fence; an empty range probes.
    assert_eq!(
        apply(&script(10, 19, -1, &[(2, 1, 1)])),
        reply(Decision::Apply, 9)
    );
    assert_eq!(apply(&script(20, 24, -1, &[])), reply(Decision::Apply, 19));
    assert_eq!(
        apply(&script(25, 24, -1, &[])),
        reply(Decision::Duplicate, 24)
    );
    assert_eq!(fence(&mut conn), Some(24));
    assert_eq!(count(&mut conn, 2, 1), 1);

    // The fence vanished (its primary lost it): it stands at origin - 1.
    let _: () = conn.del("t:fence:g:likes:0").unwrap();
    assert_eq!(
        apply(&script(25, 30, -1, &[(2, 1, 1)])),
        reply(Decision::Gap, -1)
    );
    assert_eq!(apply(&script(25, 24, -1, &[])), reply(Decision::Gap, -1));
    assert_eq!(count(&mut conn, 2, 1), 1);

    // Nothing but counters matches the read pattern.
    let keys: Vec<String> = conn.keys("t:likes:*").unwrap();
    assert!(
        keys.iter()
            .all(|k| KeyLayout::new("t").parse_counter_key(k).is_some())
    );
}

/// A key INCRBY refuses, anywhere in the batch, leaves every key and the fence as they were:
/// a script stopped half-way would keep its first increments, and each retry would add them
/// again.
#[test]
fn a_refused_key_writes_nothing() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("r"));
    let mut conn = redis.conn();
    let _: () = conn.set("r:likes:3:0", 10).unwrap();
    let _: () = conn.set("r:likes:3:1", "x").unwrap();
    let _: () = conn.hset("r:likes:3:4", "f", "1").unwrap();
    let _: () = conn.set("r:likes:3:5", i64::MAX).unwrap();
    let batch = |bad: u32| script(0, 9, -1, &[(3, 0, 2), (3, 2, 4), (3, bad, 1), (3, 3, 5)]);
    let snapshot = |conn: &mut redis::Connection| -> Vec<(String, String)> {
        let mut keys: Vec<String> = conn.keys("r:*").unwrap();
        keys.sort();
        keys.into_iter()
            .map(|k| {
                let kind: String = redis::cmd("TYPE").arg(&k).query(conn).unwrap();
                let value: String = if kind == "string" {
                    conn.get(&k).unwrap()
                } else {
                    kind
                };
                (k, value)
            })
            .collect()
    };
    let before = snapshot(&mut conn);
    for (bad, says) in [(1, "not an integer"), (4, "WRONGTYPE"), (5, "overflow")] {
        for _ in 0..3 {
            match rt.block_on(applier.apply_once(&batch(bad))).unwrap() {
                Err(tally::pipeline::apply::ApplyError::BadKey { key, error, .. }) => {
                    assert_eq!(key, format!("r:likes:3:{bad}"));
                    assert!(error.contains(says), "{error}");
                }
                other => panic!("bucket {bad}: {other:?}"),
            }
            assert_eq!(snapshot(&mut conn), before, "bucket {bad}");
        }
    }
    // Once the key is fixed the same batch applies, once.
    let _: () = conn.set("r:likes:3:1", 0).unwrap();
    assert_eq!(
        rt.block_on(applier.apply_once(&batch(1))).unwrap().unwrap(),
        reply(Decision::Apply, -1)
    );
    let values: Vec<i64> = (0..4)
        .map(|b| conn.get(format!("r:likes:3:{b}")).unwrap())
        .collect();
    assert_eq!(values, vec![12, 1, 4, 5]);
}

/// The deltas travel as runs of equal values: a key refused in the middle of a run, after
/// other runs, is named, and every key before it is restored.
#[test]
fn a_refusal_inside_a_run_restores_every_run_before_it() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("u"));
    let mut conn = redis.conn();
    // Runs, in the order batches close (by delta): -1 x 20, then 1 x 40, then 2 x 20.
    let mut deltas: Vec<(u64, u32, i64)> = (0..20).map(|p| (p, 0, -1)).collect();
    deltas.extend((20..60).map(|p| (p, 0, 1)));
    deltas.extend((60..80).map(|p| (p, 0, 2)));
    for p in (0..80u64).step_by(3) {
        let _: () = conn.set(format!("u:likes:{p}:0"), 7).unwrap();
    }
    let _: () = conn.set("u:likes:45:0", "not a number").unwrap();
    let keys: Vec<String> = (0..80u64).map(|p| format!("u:likes:{p}:0")).collect();
    let before: Vec<Option<String>> = conn.mget(&keys).unwrap();
    let batch = script(0, 9, -1, &deltas);
    match rt.block_on(applier.apply_once(&batch)).unwrap() {
        Err(tally::pipeline::apply::ApplyError::BadKey { key, .. }) => {
            assert_eq!(key, "u:likes:45:0")
        }
        other => panic!("{other:?}"),
    }
    let after: Vec<Option<String>> = conn.mget(&keys).unwrap();
    assert_eq!(after, before);
    let _: () = conn.del("u:likes:45:0").unwrap();
    rt.block_on(applier.apply_once(&batch)).unwrap().unwrap();
    let values: Vec<Option<i64>> = conn.mget(&keys).unwrap();
    for (p, value) in values.iter().enumerate() {
        let base = if p % 3 == 0 && p != 45 { 7 } else { 0 };
        let delta = deltas[p].2;
        assert_eq!(value.unwrap_or(0), base + delta, "post {p}");
    }
}

/// A call whose runs do not cover its keys is refused before anything is written.
#[test]
fn runs_that_do_not_cover_the_keys_are_refused() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let eval = |runs: &[i64]| {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(tally::pipeline::apply::APPLY_LUA)
            .arg(4)
            .arg("f")
            .arg(&["k:1", "k:2", "k:3"][..])
            .arg(&[0, 9, -1, 0][..]);
        cmd.arg(runs);
        cmd
    };
    for runs in [&[1, 2][..], &[1, 4], &[1, 2, 1], &[]] {
        let refused: redis::RedisResult<redis::Value> = eval(runs).query(&mut conn);
        let error = refused.expect_err("a call with uncovered keys").to_string();
        assert!(error.contains("runs of ARGV"), "{runs:?}: {error}");
        let keys: Vec<String> = conn.keys("*").unwrap();
        assert!(keys.is_empty(), "{runs:?} wrote {keys:?}");
    }
    let applied: Vec<i64> = eval(&[1, 2, 5, 1]).query(&mut conn).unwrap();
    assert_eq!(applied, [0, -1]);
    let values: Vec<i64> = conn.mget(&["k:1", "k:2", "k:3", "f"][..]).unwrap();
    assert_eq!(values, [1, 1, 5, 9]);
}

/// For each odd value a counter may hold, the batch ends exactly as one INCRBY of that value on
/// a key of its own ends: the same sum, or a refusal with nothing written.
#[test]
fn odd_values_end_as_incrby_ends_them() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("q"));
    let mut conn = redis.conn();
    let odd = [
        "007",
        "1e3",
        " 5",
        "5.0",
        "+5",
        "-0",
        "0x10",
        "",
        "9007199254740992",
        "9007199254740993",
        "-9007199254740993",
        "9223372036854775806",
        "-9223372036854775808",
    ];
    for (n, value) in odd.iter().enumerate() {
        let post = 100 + n as u64;
        let key = format!("q:likes:{post}:0");
        let _: () = conn.set(&key, *value).unwrap();
        let _: () = conn.set("q:plain", *value).unwrap();
        let plain: redis::RedisResult<i64> = conn.incr("q:plain", 3);
        let start = 10 * n as i64;
        let batch = script(
            start,
            start + 9,
            start - 1,
            &[(1, 0, 1), (post, 0, 3), (2, 0, 1)],
        );
        let applied = rt.block_on(applier.apply_once(&batch)).unwrap();
        let now: String = conn.get(&key).unwrap();
        match plain {
            Ok(sum) => {
                assert_eq!(
                    applied.unwrap(),
                    reply(Decision::Apply, start - 1),
                    "{value:?}"
                );
                assert_eq!(now, sum.to_string(), "{value:?}");
            }
            Err(_) => {
                assert!(applied.is_err(), "{value:?} was added to: {now}");
                assert_eq!(now, *value, "{value:?}");
                let _: () = conn.set(&key, 0).unwrap();
                rt.block_on(applier.apply_once(&batch)).unwrap().unwrap();
            }
        }
    }
    // Posts 1 and 2 took +1 from every batch, once each.
    let (one, two): (i64, i64) = (
        conn.get("q:likes:1:0").unwrap(),
        conn.get("q:likes:2:0").unwrap(),
    );
    assert_eq!((one, two), (odd.len() as i64, odd.len() as i64));
}

/// A batch of more counters than Lua's `unpack()` takes at once is applied whole.
#[test]
fn a_batch_of_many_counters_is_applied_whole() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("m"));
    let mut conn = redis.conn();
    let deltas: Vec<(u64, u32, i64)> = (0..9_001u64).map(|p| (p, 0, p as i64 - 4_500)).collect();
    for round in 0..2 {
        let batch = script(round * 10, round * 10 + 9, -1, &deltas);
        rt.block_on(applier.apply_once(&batch)).unwrap().unwrap();
    }
    let keys: Vec<String> = (0..9_001u64).map(|p| format!("m:likes:{p}:0")).collect();
    let values: Vec<i64> = redis::cmd("MGET").arg(&keys).query(&mut conn).unwrap();
    for (p, value) in values.iter().enumerate() {
        assert_eq!(*value, 2 * (p as i64 - 4_500), "post {p}");
    }
}

#[test]
fn script_is_reloaded_after_script_flush() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("f"));
    let mut conn = redis.conn();
    let first = script(0, 0, -1, &[(7, 0, 1)]);
    assert_eq!(
        rt.block_on(applier.apply_once(&first))
            .unwrap()
            .unwrap()
            .decision,
        Decision::Apply
    );
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
    let second = script(1, 1, -1, &[(7, 0, 1)]);
    assert_eq!(
        rt.block_on(applier.apply_once(&second))
            .unwrap()
            .unwrap()
            .decision,
        Decision::Apply
    );
    let value: i64 = conn.get("f:likes:7:0").unwrap();
    assert_eq!(value, 2);
}

#[test]
fn origin_is_set_once() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("o"));
    assert_eq!(rt.block_on(applier.ensure_origin(2, 40)).unwrap(), 40);
    assert_eq!(rt.block_on(applier.ensure_origin(2, 7)).unwrap(), 40);
    let fences = rt.block_on(applier.read_fences(2)).unwrap();
    assert_eq!(fences.origin, Some(40));
    assert_eq!(fences.tracker().unwrap().1.resume_at(), 40);
}

#[test]
fn lua_agrees_with_the_decision_table() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), KeyLayout::new("m"));
    let conn = std::cell::RefCell::new(redis.conn());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(300));
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
            let _: () = conn.set("m:likes:1:0", 0).unwrap();
            let got = rt
                .block_on(applier.apply_once(&script(start, last, absent, &[(1, 0, 3)])))
                .unwrap()
                .unwrap();
            let effective = fence.unwrap_or(absent);
            let want = decide(effective, start, last);
            prop_assert_eq!(got, reply(want, effective));
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
