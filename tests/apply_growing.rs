//! A packed generation whose hashes grow, against a real redis-server (or
//! valkey-server with `TALLY_TEST_STORE=valkey`): the Lua hash that splits a
//! hash places each field where the library addresses it, the hashes split as
//! they fill and keep every count, a call addressed with an old split state
//! is refused whole, and a reader never sees a count go down while fields
//! move.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use common::{RedisServer, applier, runtime, script};
use redis::Commands;
use tally::domain::packing::{Growing, Packing, Splits, field_hash};
use tally::domain::routing::KeyLayout;
use tally::pipeline::apply::{APPLY_PACKED_LUA, Prepared};

/// A growing packed layout under `prefix`, `fields` a hash on average.
fn growing(prefix: &str, fields: u32) -> KeyLayout {
    KeyLayout::new(prefix).with_packing(Packing::Growing(Growing { fields }))
}

/// Every (hash number, field, value) under `prefix`.
fn stored(conn: &mut redis::Connection, prefix: &str) -> Vec<(u32, String, i64)> {
    let keys: Vec<String> = conn.keys(format!("{prefix}:packed:*")).unwrap();
    let mut all = Vec::new();
    for key in keys {
        let n: u32 = key.rsplit(':').next().unwrap().parse().unwrap();
        let pairs: Vec<(String, i64)> = conn.hgetall(&key).unwrap();
        all.extend(pairs.into_iter().map(|(f, v)| (n, f, v)));
    }
    all
}

/// The split state stored for slot group 0.
fn state(conn: &mut redis::Connection, prefix: &str) -> (Splits, u64) {
    let (level, next, fields): (Option<u32>, Option<u32>, Option<u64>) = redis::cmd("HMGET")
        .arg(format!("{prefix}:packstate"))
        .arg("level")
        .arg("next")
        .arg("fields")
        .query(conn)
        .unwrap();
    (
        Splits {
            level: level.unwrap_or(0),
            next: next.unwrap_or(0),
        },
        fields.unwrap_or(0),
    )
}

/// A small deterministic generator, so that a failure replays.
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn the_lua_hash_is_the_library_hash() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let body = concat!(
        include_str!("../src/pipeline/field_hash.lua"),
        "\nlocal out = {}\nfor i = 1, #ARGV do out[i] = tostring(field_hash(ARGV[i])) end\nreturn out"
    );
    let mut draws = Draws(0x5eed);
    let mut fields: Vec<String> = vec![
        String::new(),
        "0".into(),
        "42".into(),
        "-1".into(),
        "-9223372036854775808".into(),
        "9223372036854775807:v4294967295:b1048575".into(),
        "42:3".into(),
        "42:d2:b0".into(),
        "\u{ff}\u{1}".into(),
    ];
    fields.extend((0..2_000).map(|_| (draws.next() as i64).to_string()));
    fields.extend((0..500).map(|i| format!("{}:v{}:b{}", draws.next() % 1_000_000, i, i % 64)));
    let lua: Vec<String> = redis::cmd("EVAL")
        .arg(body)
        .arg(0)
        .arg(&fields)
        .query(&mut conn)
        .unwrap();
    for (field, from_lua) in fields.iter().zip(&lua) {
        assert_eq!(
            from_lua.parse::<u64>().unwrap(),
            u64::from(field_hash(field.as_bytes())),
            "field {field:?}"
        );
    }
    // The vectors docs/design.md publishes: a change of the hash would put
    // every counter of a growing prefix in the wrong hash.
    for (field, hash) in tally::domain::packing::FIELD_HASH_VECTORS {
        assert_eq!(field_hash(field.as_bytes()), hash, "{field:?}");
    }
    assert!(APPLY_PACKED_LUA.contains("local function field_hash(field)"));
}

#[test]
fn hashes_split_as_they_fill_and_keep_every_count() {
    let redis = RedisServer::start();
    let rt = runtime();
    let keys = growing("g", 4);
    let applier = applier(&rt, &redis.url(), keys.clone());
    let mut conn = redis.conn();
    let mut draws = Draws(0xfeed);
    let mut expected: HashMap<String, i64> = HashMap::new();
    let mut field = String::new();
    let mut offset = 0;
    for _ in 0..400 {
        let deltas: Vec<(u64, u32, i64)> = (0..25)
            .map(|_| {
                // Counts that only rise, so that a field is new exactly once.
                let post = draws.next() % 3_000;
                (
                    post,
                    (draws.next() % 3) as u32,
                    1 + (draws.next() % 3) as i64,
                )
            })
            .collect();
        // One delta a counter a call, as a batch nets them.
        let mut net: BTreeMap<(u64, u32), i64> = BTreeMap::new();
        for &(post, bucket, delta) in &deltas {
            *net.entry((post, bucket)).or_default() += delta;
        }
        let deltas: Vec<(u64, u32, i64)> = net
            .into_iter()
            .filter(|(_, d)| *d != 0)
            .map(|((p, b), d)| (p, b, d))
            .collect();
        for &(post, bucket, delta) in &deltas {
            keys.write_field(
                &mut field,
                tally::pipeline::aggregate::CounterId::v0(post, bucket),
            );
            *expected.entry(field.clone()).or_default() += delta;
        }
        let prepared = script(offset, offset + 9, -1, &deltas);
        rt.block_on(applier.apply_once(&prepared)).unwrap().unwrap();
        offset += 10;
    }
    let (splits, counted) = state(&mut conn, "g");
    let all = stored(&mut conn, "g");
    // Every counter once, with its count, in the hash its hash names.
    let mut found: HashMap<String, i64> = HashMap::new();
    for (n, field, value) in &all {
        assert_eq!(
            splits.address(field_hash(field.as_bytes())),
            *n,
            "field {field} in the wrong hash under {splits:?}"
        );
        assert!(
            found.insert(field.clone(), *value).is_none(),
            "{field} twice"
        );
    }
    for (field, count) in &expected {
        assert_eq!(found.get(field).copied().unwrap_or(0), *count, "{field}");
    }
    assert_eq!(found.len(), expected.len());
    // The group grew to about 4 fields a hash, and knows how many it holds.
    assert_eq!(counted, expected.len() as u64);
    let hashes = splits.hashes();
    assert!(
        hashes >= counted / 4 && hashes <= counted / 4 + 1,
        "{hashes} hashes for {counted} counters"
    );
    assert!(splits.level >= 8, "{splits:?}");
    // The fence moved with every call.
    let fence: i64 = conn.get("g:fence:g:likes:0").unwrap();
    assert_eq!(fence, offset - 1);
}

#[test]
fn a_call_addressed_before_a_split_writes_where_the_split_state_says() {
    let redis = RedisServer::start();
    let rt = runtime();
    let keys = growing("s", 2);
    let mut conn = redis.conn();
    // Another partition's applier fills the group until it has split.
    let other = applier(&rt, &redis.url(), keys.clone());
    let fill: Vec<(u64, u32, i64)> = (1..=64).map(|p| (p, 0, 1)).collect();
    let mut from_other = script(0, 9, -1, &fill);
    from_other.partition = 1;
    rt.block_on(other.apply_once(&from_other)).unwrap().unwrap();
    let (after, _) = state(&mut conn, "s");
    assert!(after.hashes() > 1, "{after:?}");
    // A call addressed as if the group still had one hash names hash 0 for every field: the
    // script writes each where the state says now, in one call.
    let mine = script(0, 4, -1, &[(1, 0, 10), (2, 0, 10), (900, 0, 1)]);
    let reply: Vec<redis::Value> = tally::pipeline::apply::script_call(
        tally::pipeline::apply::ScriptBody::Full,
        &keys,
        "s:fence:g:likes:0",
        &mine,
        Splits::default(),
    )
    .query(&mut conn)
    .unwrap();
    let code: i64 = redis::from_redis_value_ref(&reply[0]).unwrap();
    assert_eq!(code, 0, "{reply:?}");
    let (now, _) = state(&mut conn, "s");
    let all = stored(&mut conn, "s");
    let mut seen = HashMap::new();
    for (n, field, value) in &all {
        assert_eq!(
            now.address(field_hash(field.as_bytes())),
            *n,
            "{field} in hash {n} under {now:?}"
        );
        assert!(
            seen.insert(field.clone(), *value).is_none(),
            "{field} twice"
        );
    }
    assert_eq!((seen["1"], seen["2"], seen["900"]), (11, 11, 1));
    let fence: Option<i64> = conn.get("s:fence:g:likes:0").unwrap();
    assert_eq!(fence, Some(4));
    // A counter that refuses its write, in a hash split since: everything is taken back from
    // where it was written.
    let _: () = conn
        .hset(
            format!("s:packed:{}", now.address(field_hash(b"7"))),
            "7",
            "x",
        )
        .unwrap();
    let before = stored_raw(&mut conn, "s");
    let refused = script(5, 9, -1, &[(3, 0, 5), (7, 0, 1), (901, 0, 2)]);
    let reply: Vec<redis::Value> = tally::pipeline::apply::script_call(
        tally::pipeline::apply::ScriptBody::Full,
        &keys,
        "s:fence:g:likes:0",
        &refused,
        Splits::default(),
    )
    .query(&mut conn)
    .unwrap();
    let code: i64 = redis::from_redis_value_ref(&reply[0]).unwrap();
    assert_eq!(code, 4, "{reply:?}");
    assert_eq!(
        stored_raw(&mut conn, "s"),
        before,
        "a refused call kept a write"
    );
}

/// Every (key, field, value) under `prefix`, values as text.
fn stored_raw(conn: &mut redis::Connection, prefix: &str) -> BTreeMap<(String, String), String> {
    let keys: Vec<String> = conn.keys(format!("{prefix}:packed:*")).unwrap();
    let mut all = BTreeMap::new();
    for key in keys {
        let pairs: Vec<(String, String)> = conn.hgetall(&key).unwrap();
        all.extend(pairs.into_iter().map(|(f, v)| ((key.clone(), f), v)));
    }
    all
}

#[test]
fn a_split_state_that_is_not_tallys_refuses_the_call() {
    let redis = RedisServer::start();
    let rt = runtime();
    let applier = applier(&rt, &redis.url(), growing("b", 4));
    let mut conn = redis.conn();
    let _: () = conn.hset("b:packstate", "level", "two").unwrap();
    let error = rt
        .block_on(applier.apply_once(&script(0, 9, -1, &[(1, 0, 5)])))
        .expect_err("a call past a broken split state");
    assert!(
        error
            .to_string()
            .contains("b:packstate holds level \"two\""),
        "{error}"
    );
    assert!(stored(&mut conn, "b").is_empty(), "the refused call wrote");
}

/// Counts only rise here (every delta is +1), so a read lower than one
/// before it is a field the reader missed while it moved.
#[test]
fn a_reader_never_sees_a_count_go_down_while_hashes_split() {
    let redis = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let keys = growing("r", 2);
    let applier = applier(&rt, &redis.url(), keys.clone());
    let url = tally::infra::store::RedisUrl::parse(&redis.url()).unwrap();
    let store = rt
        .block_on(tally::infra::store::Shared::open(&url))
        .unwrap();
    let reader = tally::read::Reader::new(store, keys, 1, Duration::ZERO);
    let watched: Vec<u64> = (1..=40).collect();
    let writes = rt.spawn(async move {
        let mut draws = Draws(0xc0ffee);
        for call in 0..600i64 {
            // The watched posts, and new posts that make the group split.
            let mut deltas: Vec<(u64, u32, i64)> = (1..=40).map(|p| (p, 0, 1)).collect();
            deltas.extend((0..20).map(|_| (1_000 + draws.next() % 1_000_000, 0, 1)));
            deltas.sort_unstable();
            deltas.dedup_by_key(|d| d.0);
            let prepared: Prepared = script(call * 10, call * 10 + 9, -1, &deltas);
            applier.apply(&prepared, &Default::default()).await.unwrap();
        }
    });
    let mut highest = vec![0i64; watched.len()];
    let mut reads = 0;
    let mut splits_seen = std::collections::BTreeSet::new();
    let mut conn = redis.conn();
    while !writes.is_finished() {
        let counts = rt.block_on(reader.counts(&watched)).unwrap();
        for (i, count) in counts.iter().enumerate() {
            assert!(
                count.likes >= highest[i],
                "post {} read {} after {}",
                watched[i],
                count.likes,
                highest[i]
            );
            highest[i] = count.likes;
        }
        splits_seen.insert(state(&mut conn, "r").0);
        reads += 1;
    }
    rt.block_on(writes).unwrap();
    let counts = rt.block_on(reader.counts(&watched)).unwrap();
    assert!(counts.iter().all(|c| c.likes == 600), "{counts:?}");
    assert!(reads > 20, "{reads} reads");
    assert!(
        splits_seen.len() > 20,
        "{} split states seen",
        splits_seen.len()
    );
}

/// A first call far larger than its group's one hash would turn that hash into a hashtable for
/// good; the script splits the group to make room first, and every hash stays a listpack.
#[test]
fn a_call_larger_than_its_group_splits_it_first_and_every_hash_stays_compact() {
    let redis = RedisServer::start();
    let rt = runtime();
    let keys = growing("c", 40);
    let applier = applier(&rt, &redis.url(), keys);
    let mut conn = redis.conn();
    let mut draws = Draws(0xbead);
    let deltas: Vec<(u64, u32, i64)> = (0..5_000).map(|_| (draws.next(), 0, 1)).collect();
    rt.block_on(applier.apply_once(&script(0, 9, -1, &deltas)))
        .unwrap()
        .unwrap();
    let all = stored(&mut conn, "c");
    assert_eq!(all.len(), 5_000);
    let (splits, counted) = state(&mut conn, "c");
    assert_eq!(counted, 5_000);
    assert!(splits.hashes() >= 125, "{splits:?}");
    let numbers: std::collections::BTreeSet<u32> = all.iter().map(|(n, _, _)| *n).collect();
    for n in numbers {
        let key = format!("c:packed:{n}");
        let encoding: String = redis::cmd("OBJECT")
            .arg("ENCODING")
            .arg(&key)
            .query(&mut conn)
            .unwrap();
        let len: u64 = conn.hlen(&key).unwrap();
        assert_eq!(encoding, "listpack", "{key} holds {len} fields");
        assert!(len <= 125, "{key} holds {len} fields");
    }
}
