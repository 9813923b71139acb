//! The window section of the apply scripts against a real redis-server, on
//! both layouts: window deltas land with the counters behind the fence, once;
//! a post brought to zero leaves its window's counts; both keys of a window
//! expire at its end plus the retention; the leaders hold exactly the posts
//! at the floor or above, through a rising floor and unlikes below it; and a
//! window key of another type, a count in it that is not a number, or a
//! window section whose runs do not add up refuses the whole call and leaves
//! nothing written.

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

/// Every post of every window's counts, as (key, post) → likes, read without
/// tally's parsing of fields; and, for each window, a check that its leaders
/// hold exactly the posts whose count is at least its floor, with their counts.
fn sets(conn: &mut redis::Connection) -> BTreeMap<(String, u64), i64> {
    let keys: Vec<String> = conn.keys("t:win:*").unwrap();
    let mut all = BTreeMap::new();
    for key in keys {
        let fields: Vec<(Vec<u8>, i64)> = conn.hgetall(&key).unwrap();
        let mut floor = 1;
        let mut counts = BTreeMap::new();
        for (field, count) in fields {
            if field == b"floor" {
                floor = count;
                continue;
            }
            let post = u64::from_be_bytes(field.try_into().expect("8-byte fields"));
            assert_ne!(count, 0, "{key} keeps post {post} at 0");
            counts.insert(post, count);
            all.insert((key.clone(), post), count);
        }
        let leaders = key.replacen(":win:", ":top:", 1);
        let kept: Vec<(Vec<u8>, i64)> = conn.zrange_withscores(&leaders, 0, -1).unwrap();
        let kept: BTreeMap<u64, i64> = kept
            .into_iter()
            .map(|(m, s)| (u64::from_be_bytes(m.try_into().expect("8-byte members")), s))
            .collect();
        let above: BTreeMap<u64, i64> = counts.into_iter().filter(|&(_, c)| c >= floor).collect();
        assert_eq!(
            kept, above,
            "{leaders}: not the posts of {key} at its floor {floor} or above"
        );
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
        let posts: i64 = conn.hlen(format!("t:win:1h:{hour}")).unwrap();
        assert_eq!(posts, 1, "{name}: a post at 0 stays in its window's counts");
        let leaders: i64 = conn.zcard(format!("t:top:1h:{hour}")).unwrap();
        assert_eq!(leaders, 1, "{name}: a post at 0 stays among the leaders");
        // Both keys of a window expire at its end plus the retention.
        for key in [minute(hour), format!("t:top:1m:{hour}")] {
            let expiry: i64 = redis::cmd("PEXPIRETIME")
                .arg(&key)
                .query(&mut conn)
                .unwrap();
            assert_eq!(expiry, hour + 60_000 + 86_400_000, "{name}: {key}");
        }
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
        let leaders: i64 = conn.exists(format!("t:top:1h:{old}")).unwrap();
        assert_eq!(leaders, 0, "{name}: an expired window's leaders stay");
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
    for ((name, keys), kind) in layouts()
        .into_iter()
        .flat_map(|l| [(l.clone(), "win"), (l, "top")])
    {
        let (_redis, rt, applier, mut conn) = server(&keys);
        let hour = now_ms() / HOUR * HOUR;
        let stray = format!("t:{kind}:1h:{hour}");
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

/// Every key under the prefix, with what it holds, as redis-cli would show it.
fn snapshot(conn: &mut redis::Connection) -> BTreeMap<String, String> {
    let mut all = BTreeMap::new();
    let keys: Vec<String> = conn.keys("t:*").unwrap();
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query(conn).unwrap();
        let value = match kind.as_str() {
            "string" => format!("{:?}", conn.get::<_, Vec<u8>>(&key).unwrap()),
            "hash" => {
                let fields: BTreeMap<Vec<u8>, Vec<u8>> = conn.hgetall(&key).unwrap();
                format!("{fields:?}")
            }
            "zset" => {
                let members: Vec<(Vec<u8>, f64)> = conn.zrange_withscores(&key, 0, -1).unwrap();
                format!("{members:?}")
            }
            other => panic!("{key} is a {other}"),
        };
        all.insert(key, value);
    }
    all
}

/// A post's field in a window's counts, or the window's floor, holding what
/// is not a count (a value tally never writes, among them numbers written
/// in forms HINCRBY does not read, and a count at the 64-bit limit) refuses the whole call before anything stays written: no counter
/// and no window count of the posts before it stays added, and the fence
/// stays, so a retry cannot add them twice.
#[test]
fn a_window_count_that_is_not_a_number_refuses_the_call_and_keeps_nothing() {
    let strays = [
        ("post", "many", "integer"),
        ("post", "1e3", "integer"),
        ("post", "0x10", "integer"),
        ("post", " 12", "integer"),
        ("post", "007", "integer"),
        ("post", "-0", "integer"),
        ("post", "1.5", "integer"),
        ("post", "9223372036854775807", "overflow"),
        ("floor", "many", "integer"),
    ];
    for (name, keys) in layouts() {
        for (stray, value, says) in strays {
            let (_redis, rt, applier, mut conn) = server(&keys);
            let hour = now_ms() / HOUR * HOUR;
            let first = with_windows(
                script(0, 4, -1, &[(7, 0, 1), (8, 0, 2), (9, 0, 1)]),
                &[
                    (0, hour, 7, 1),
                    (1, hour, 7, 1),
                    (1, hour, 8, 2),
                    (1, hour, 9, 1),
                ],
            );
            let reply = rt.block_on(applier.apply_once(&first)).unwrap().unwrap();
            assert_eq!(reply.decision, Decision::Apply, "{name}");
            let counts = format!("t:win:1h:{hour}");
            let field = match stray {
                "post" => 8u64.to_be_bytes().to_vec(),
                _ => b"floor".to_vec(),
            };
            let _: () = conn.hset(&counts, &field, value).unwrap();
            let before = snapshot(&mut conn);
            // Post 7 comes before post 8 in the call, in a run of its own
            // delta: its window writes (and every counter) would stand if
            // the call stopped at post 8.
            let second = with_windows(
                script(5, 9, -1, &[(7, 0, 1), (8, 0, 1), (9, 0, 1)]),
                &[
                    (0, hour, 7, 1),
                    (1, hour, 7, 2),
                    (1, hour, 8, 1),
                    (1, hour, 9, 3),
                ],
            );
            for attempt in 0..2 {
                let refused = rt.block_on(applier.apply_once(&second)).unwrap();
                match refused {
                    Err(ApplyError::BadKey { key, error, .. }) => {
                        assert!(key.starts_with(&counts), "{name}, {stray}: {key}");
                        assert!(error.contains(says), "{name}, {stray} {value:?}: {error}");
                        if stray == "post" {
                            assert!(key.contains("post 8"), "{name}: {key}");
                        }
                    }
                    other => panic!("{name}, {stray} {value:?}, attempt {attempt}: {other:?}"),
                }
                assert_eq!(
                    snapshot(&mut conn),
                    before,
                    "{name}, {stray} {value:?}: the refused call left writes behind"
                );
            }
        }
    }
}

/// A count of 15 digits and a negative count stay exact, and a post named
/// twice in one window of a call gets both its deltas.
#[test]
fn large_and_negative_counts_stay_exact_and_a_post_named_twice_gets_both_deltas() {
    for (name, keys) in layouts() {
        let (_redis, rt, applier, mut conn) = server(&keys);
        let hour = now_ms() / HOUR * HOUR;
        let counts = format!("t:win:1h:{hour}");
        let _: () = conn
            .hset(&counts, &7u64.to_be_bytes()[..], "123456789012345")
            .unwrap();
        let _: () = conn.hset(&counts, &8u64.to_be_bytes()[..], "-40").unwrap();
        let call = with_windows(
            script(0, 0, -1, &[(7, 0, 1)]),
            &[
                (1, hour, 7, 1),
                (1, hour, 8, -2),
                (1, hour, 9, 1),
                (1, hour, 9, 2),
            ],
        );
        assert!(call.windows.windows(2).any(|w| w[0].0 == w[1].0));
        let reply = rt.block_on(applier.apply_once(&call)).unwrap().unwrap();
        assert_eq!(reply.decision, Decision::Apply, "{name}");
        let read = |conn: &mut redis::Connection, post: u64| -> String {
            conn.hget(&counts, &post.to_be_bytes()[..]).unwrap()
        };
        assert_eq!(read(&mut conn, 7), "123456789012346", "{name}");
        assert_eq!(read(&mut conn, 8), "-42", "{name}");
        assert_eq!(read(&mut conn, 9), "3", "{name}");
        sets(&mut conn);
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
    for (counts, leaders) in keys.window_keys(size, 0) {
        assert_eq!(
            key_slot(counts.as_bytes()),
            key_slot(leaders.as_bytes()),
            "{leaders}"
        );
    }
    assert_eq!(keys.window_keys(size, 0).len(), 16);
}

/// Past `LEADERS_CAP` leaders the floor rises to the `LEADERS_KEEP`-th count
/// and the posts below it leave the leaders but keep their counts; unlikes
/// take leaders below the floor and out, likes bring a post back in when it
/// reaches it. `sets` checks the leaders against the counts after each call.
#[test]
fn the_floor_rises_past_the_cap_and_the_leaders_follow_every_count() {
    use tally::domain::windows::{LEADERS_CAP, LEADERS_KEEP};
    for (name, keys) in layouts() {
        let (_redis, rt, applier, mut conn) = server(&keys);
        let hour = now_ms() / HOUR * HOUR;
        // Post p gets p likes (two posts per count, so that ties straddle the floor).
        let posts = LEADERS_CAP as u64 + 100;
        let cells: Vec<(u8, i64, u64, i64)> = (1..=posts)
            .map(|p| (1, hour, p, p.div_ceil(2) as i64))
            .collect();
        let first = with_windows(script(0, 0, -1, &[(1, 0, 1)]), &cells);
        let reply = rt.block_on(applier.apply_once(&first)).unwrap().unwrap();
        assert_eq!(reply.decision, Decision::Apply, "{name}");
        let counts = sets(&mut conn);
        assert_eq!(
            counts.len() as u64,
            posts,
            "{name}: every post keeps its count"
        );
        let key = format!("t:win:1h:{hour}");
        let floor: i64 = conn.hget(&key, "floor").unwrap();
        // The LEADERS_KEEP-th count from the top, of posts counting 1, 1, 2, 2, ...
        let kept = (posts - LEADERS_KEEP as u64 + 1).div_ceil(2) as i64;
        assert_eq!(floor, kept, "{name}");
        let leaders: usize = conn.zcard(format!("t:top:1h:{hour}")).unwrap();
        assert!(
            (LEADERS_KEEP..=LEADERS_KEEP + 1).contains(&leaders),
            "{name}: {leaders} leaders"
        );
        // Unlikes take the top 10 posts below the floor; likes bring post 1 up to it.
        let mut cells: Vec<(u8, i64, u64, i64)> = (posts - 9..=posts)
            .map(|p| (1, hour, p, -(p.div_ceil(2) as i64)))
            .collect();
        cells.push((1, hour, 1, floor - 1));
        let second = with_windows(script(1, 1, -1, &[(1, 0, 1)]), &cells);
        let reply = rt.block_on(applier.apply_once(&second)).unwrap().unwrap();
        assert_eq!(reply.decision, Decision::Apply, "{name}");
        let counts = sets(&mut conn);
        assert_eq!(counts.get(&(key.clone(), 1)), Some(&floor), "{name}");
        assert_eq!(
            counts.get(&(key.clone(), posts)),
            None,
            "{name}: a post at 0 kept"
        );
        let leaders: usize = conn.zcard(format!("t:top:1h:{hour}")).unwrap();
        assert!(leaders < LEADERS_KEEP, "{name}: {leaders} leaders");
    }
}

/// A window section whose runs do not add up to its arguments (a run naming
/// more members than follow, fewer runs than it counts, a count that is not
/// a number, members left over) is refused before the first write.
#[test]
fn a_window_section_that_does_not_add_up_is_refused_and_writes_nothing() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let member = |post: u64| post.to_be_bytes().to_vec();
    let far = (now_ms() + HOUR).to_string().into_bytes();
    let arg = |s: &str| s.as_bytes().to_vec();
    let sections: [Vec<Vec<u8>>; 4] = [
        vec![
            far.clone(),
            arg("1"),
            arg("1"),
            arg("3"),
            member(7),
            member(8),
        ],
        vec![far.clone(), arg("2"), arg("1"), arg("1"), member(7)],
        vec![far.clone(), arg("1"), arg("1"), arg("x"), member(7)],
        vec![
            far.clone(),
            arg("1"),
            arg("1"),
            arg("1"),
            member(7),
            member(8),
        ],
    ];
    for section in sections {
        let mut call = redis::cmd("EVAL");
        call.arg(tally::pipeline::apply::APPLY_LUA)
            .arg(4)
            .arg("t:fence")
            .arg("t:likes:7:0")
            .arg("t:win:1h:0")
            .arg("t:top:1h:0")
            .arg(0)
            .arg(0)
            .arg(-1)
            .arg(1)
            .arg(1)
            .arg(1);
        for a in &section {
            call.arg(&a[..]);
        }
        let refused: redis::RedisResult<redis::Value> = call.query(&mut conn);
        let error = refused.expect_err("a section that does not add up must be refused");
        assert!(
            error
                .to_string()
                .contains("the window section is not whole"),
            "{error}"
        );
        assert!(
            snapshot(&mut conn).is_empty(),
            "nothing may be written: {section:?}"
        );
    }
}
