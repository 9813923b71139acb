//! What ordinary operations do under the fences, on a real broker and redis-server: each case
//! is refused with one line naming the fix and writes nothing, and the fix, once applied, ends
//! in exact counts.
//!
//! * a counter key holding a value INCRBY refuses: every restart is refused with the key named,
//!   no increment is kept from the refused scripts, and once the key is fixed every count is
//!   exact;
//! * `maxmemory-policy allkeys-lru`: refused before anything is written; `volatile-lru` too on a
//!   prefix with trending windows, whose keys expire (before anything is counted); set under a
//!   running tally, reported within seconds (ERROR line, `tally_eviction_policy_unsafe`);
//! * Redis that lost everything while the group has committed offsets: refused, and with
//!   `--accept-lost-counts` counted from those offsets;
//! * a broker that came back empty: the fences lie beyond the new log's end; refused, and
//!   `tally reset-fences --yes` counts the new log on top of the stored counts;
//! * a fence, an origin or the generation pointer holding what is not a number: refused with
//!   the key and the fix, and counting goes on exactly once it is restored;
//! * a group whose committed offsets trail fences that are at the log's end (the last batch
//!   applied just before its owner died): the next owner commits the fences within seconds,
//!   though nothing new arrives, so the lag it shows is the lag there is.
//!
//! * a replica started with another `--dedupe` rule than the prefix's writers: refused with
//!   both rules and the fix; `--dedupe-change` makes its rule the prefix's, and a writer still
//!   on the old rule reports it within seconds (ERROR line, `tally_dedupe_rule_mismatch`).
//!
//! Each test has topics, a group and a key prefix of its own on the shared broker; the broker
//! that comes back empty is a private one.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use redis::Commands;

const PARTITIONS: i32 = 4;

/// Counts `workload` with one `tally run` and stops it.
fn count_all(run: &Scenario, conn: &mut redis::Connection, args: &[String], events: usize) {
    let mut tally = Tally::spawn_args("tally", args);
    run.wait_applied(conn, &run.hwms(events), Duration::from_secs(120), || {
        tally.assert_running()
    });
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
}

/// Every key under `prefix` with its value: a string's value, a hash's fields and values in
/// order, or the type of any other key.
fn snapshot(conn: &mut redis::Connection, prefix: &str) -> HashMap<String, String> {
    scan_keys(conn, &format!("{prefix}:*"))
        .into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(conn).unwrap();
            let value = match kind.as_str() {
                "string" => redis::cmd("GET").arg(&key).query(conn).unwrap(),
                "hash" => {
                    let mut fields: Vec<(String, String)> =
                        redis::cmd("HGETALL").arg(&key).query(conn).unwrap();
                    // The routing registry's clock moves with time (at most once a second,
                    // whenever a start reads it), not with what a batch writes.
                    if key.ends_with(":routes") {
                        fields.retain(|(field, _)| field != "clock");
                    }
                    fields.sort();
                    format!("{fields:?}")
                }
                _ => kind,
            };
            (key, value)
        })
        .collect()
}

/// `commands.0` on a string counter key, `commands.1` on a packed counter's hash and field.
fn on_place(place: &tally::domain::routing::Place, commands: (&str, &str)) -> redis::Cmd {
    let mut cmd = match &place.field {
        None => redis::cmd(commands.0),
        Some(_) => redis::cmd(commands.1),
    };
    cmd.arg(&place.key);
    if let Some(field) = &place.field {
        cmd.arg(field);
    }
    cmd
}

fn merged(a: &HashMap<u64, i64>, b: &HashMap<u64, i64>) -> HashMap<u64, i64> {
    let mut out = a.clone();
    for (&post, &n) in b {
        *out.entry(post).or_insert(0) += n;
    }
    out
}

#[test]
fn a_key_incrby_refuses_stops_the_partition_without_writing() {
    let run = Scenario::new("e2e_guards_key", "badkey", 1);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut args = run.tally_args(&redis.url());
    // No hot-post detection: its heat keys would change between the refused starts.
    args.extend(["--promote-above", "0"].map(String::from));
    let first = run.produce_workload(run.seed, 3_000, 1);
    count_all(&run, &mut conn, &args, first.events.len());

    // A like of a post no wave holds opens the second wave, and its key is broken by hand, as a
    // foreign writer or a typo in redis-cli would. Its key takes +1 in any batch that holds it
    // (a key taken from the wave itself may net to zero in a batch, and a zero is not written),
    // and every batch a start sends first holds it.
    let second = Workload::generate(run.seed ^ 0xbad, 3_000, 1);
    let lone_post = (1u64 << 63) | (run.seed >> 1);
    let lone_user = run.seed | 1;
    let bucket =
        tally::domain::routing::bucket_of(lone_user, tally::infra::config::DEFAULT_BUCKETS);
    // Its string key, or its field when the prefix is packed.
    let keys = tally::domain::routing::KeyLayout::new(&run.prefix)
        .with_packing(test_packing().unwrap_or_default());
    // Hashes that grow have split while the first wave was counted: the field's hash is
    // where the split state says now (tally is stopped, so it stays there).
    let (level, next): (Option<u32>, Option<u32>) = redis::cmd("HMGET")
        .arg(keys.splits_key(0))
        .arg("level")
        .arg("next")
        .query(&mut conn)
        .unwrap();
    let splits = tally::domain::packing::Splits {
        level: level.unwrap_or(0),
        next: next.unwrap_or(0),
    };
    let place = keys.place_at(
        tally::domain::routing::CounterId::v0(lone_post, bucket),
        splits,
    );
    let broken = place.shown();
    let _: () = on_place(&place, ("SET", "HSET"))
        .arg("x")
        .query(&mut conn)
        .unwrap();
    let lone = encode_like(lone_post, lone_user, LIKE, now_ms());
    produce(
        &run.brokers,
        &run.topic,
        std::iter::once((None, lone, 0)).chain(second.messages(0..second.events.len())),
    );
    let mut last = None;
    let mut named = place.clone();
    for attempt in 1..=3 {
        let line = error_line(&run_refused(&args));
        // The place the refusal names: the broken one, or, in hashes that grow, where a split
        // that made room for the wave has moved the same field since.
        let shown = line
            .split_once("counter key ")
            .and_then(|(_, rest)| rest.split_once(" holds a value Redis cannot add to"))
            .map(|(shown, _)| shown.to_string())
            .unwrap_or_else(|| panic!("attempt {attempt}: {line}"));
        named = match shown.split_once(' ') {
            Some((key, field)) => tally::domain::routing::Place {
                key: key.into(),
                field: Some(field.into()),
            },
            None => tally::domain::routing::Place {
                key: shown.clone(),
                field: None,
            },
        };
        assert_eq!(named.field, place.field, "attempt {attempt}: {line}");
        if !keys.is_growing() {
            assert_eq!(shown, broken, "attempt {attempt}: {line}");
        }
        let held: Option<String> = on_place(&named, ("GET", "HGET")).query(&mut conn).unwrap();
        assert_eq!(held.as_deref(), Some("x"), "attempt {attempt}: {line}");
        assert!(
            line.contains("nothing was written"),
            "attempt {attempt}: {line}"
        );
        // Nothing of the refused batch is kept, whichever start sends it.
        let now = snapshot(&mut conn, &run.prefix);
        if let Some(before) = &last {
            assert_eq!(&now, before, "attempt {attempt} changed keys");
        }
        last = Some(now);
    }
    let _: () = on_place(&named, ("DEL", "HDEL")).query(&mut conn).unwrap();
    let total = first.events.len() + 1 + second.events.len();
    count_all(&run, &mut conn, &args, total);
    let mut truth = merged(&first.truth, &second.truth);
    *truth.entry(lone_post).or_insert(0) += 1;
    run.assert_exact(&mut conn, &truth);
}

/// Sets the server's `maxmemory-policy`, as an operator's `CONFIG SET` would.
fn policy(conn: &mut redis::Connection, p: &str) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(p)
        .query(conn)
        .unwrap();
}

#[test]
fn an_eviction_policy_that_may_drop_keys_is_refused() {
    let run = Scenario::new("e2e_guards_eviction", "evict", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let w = run.produce_workload(run.seed, 2_000, PARTITIONS);
    policy(&mut conn, "allkeys-lru");
    let args = run.tally_args(&redis.url());
    let line = refusal_line(&run_refused(&args));
    assert!(
        line.contains("has maxmemory-policy allkeys-lru") && line.contains("noeviction"),
        "{line}"
    );
    assert!(
        snapshot(&mut conn, &run.prefix).is_empty(),
        "nothing written"
    );
    policy(&mut conn, "volatile-lru");
    count_all(&run, &mut conn, &args, w.events.len());
    run.assert_exact(&mut conn, &w.truth);

    // Trending windows are the keys tally gives an expiry: volatile-* may evict them too.
    let windowed = Scenario::new("e2e_guards_eviction_windows", "evictwin", PARTITIONS);
    produce(
        &windowed.brokers,
        &windowed.topic,
        w.messages(0..w.events.len()),
    );
    let mut args = windowed.tally_args(&redis.url());
    args.extend(["--windows", "1h"].map(String::from));
    let line = refusal_line(&run_refused(&args));
    assert!(
        line.contains("has maxmemory-policy volatile-lru, and this prefix keeps trending windows")
            && line.contains("noeviction"),
        "{line}"
    );
    let counted: Vec<String> = conn.keys(format!("{}:likes:*", windowed.prefix)).unwrap();
    let windows: Vec<String> = conn.keys(format!("{}:win:*", windowed.prefix)).unwrap();
    assert!(
        counted.is_empty() && windows.is_empty(),
        "the refused start counted: {counted:?} {windows:?}"
    );
    policy(&mut conn, "noeviction");
    count_all(&windowed, &mut conn, &args, w.events.len());
    windowed.assert_exact(&mut conn, &w.truth);
}

/// A client of the scenario's group, and the list of its topic's partitions, each at `offset`
/// when one is given.
fn group_client(
    run: &Scenario,
    partitions: i32,
    offset: Option<i64>,
) -> (BaseConsumer, TopicPartitionList) {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &run.brokers)
        .set("group.id", &run.group)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        match offset {
            Some(offset) => tpl
                .add_partition_offset(&run.topic, p, Offset::Offset(offset))
                .unwrap(),
            None => {
                tpl.add_partition(&run.topic, p);
            }
        }
    }
    (consumer, tpl)
}

/// The group's committed offsets, per partition (0 where none).
fn committed(run: &Scenario, partitions: i32) -> Vec<i64> {
    let (consumer, tpl) = group_client(run, partitions, None);
    let found = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .unwrap();
    (0..partitions)
        .map(
            |p| match found.find_partition(&run.topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => 0,
            },
        )
        .collect()
}

/// Sets the group's committed offsets of every partition to `offset`, as a member that died
/// before committing its last batch leaves them. The group must have no member.
fn commit_back(run: &Scenario, partitions: i32, offset: i64) {
    let (consumer, tpl) = group_client(run, partitions, Some(offset));
    consumer.commit(&tpl, CommitMode::Sync).unwrap();
}

#[test]
fn commits_that_trail_fences_at_the_log_end_catch_up_without_new_events() {
    let run = Scenario::new("e2e_guards_trail", "trail", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let args = run.tally_args(&redis.url());
    let w = run.produce_workload(run.seed, 2_000, PARTITIONS);
    count_all(&run, &mut conn, &args, w.events.len());
    let hwms = run.hwms(w.events.len());
    commit_back(&run, PARTITIONS, 0);
    assert_eq!(committed(&run, PARTITIONS), vec![0; PARTITIONS as usize]);

    // The fences are at every log's end: nothing is left to read, and the commits follow them.
    let mut tally = Tally::spawn_args("tally", &args);
    wait_for("the group's commits", Duration::from_secs(30), || {
        tally.assert_running();
        (committed(&run, PARTITIONS) == hwms).then_some(())
    });
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
}

#[test]
fn a_store_that_lost_everything_is_refused_until_the_loss_is_accepted() {
    let run = Scenario::new("e2e_guards_lost", "lost", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let args = run.tally_args(&redis.url());
    let first = run.produce_workload(run.seed, 3_000, PARTITIONS);
    count_all(&run, &mut conn, &args, first.events.len());
    let hwms = run.hwms(first.events.len());
    wait_for("the group's commits", Duration::from_secs(30), || {
        (committed(&run, PARTITIONS) == hwms).then_some(())
    });

    let _: () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
    let second = run.produce_workload(run.seed ^ 0x1057, 1_000, PARTITIONS);
    let line = refusal_line(&run_refused(&args));
    assert!(
        line.contains(&format!(
            "group {} has committed offsets on {}",
            run.group, run.topic
        )) && line.contains("tally rebuild")
            && line.contains("--accept-lost-counts"),
        "{line}"
    );
    assert!(
        snapshot(&mut conn, &run.prefix).is_empty(),
        "nothing written"
    );

    // Accepted once: the second wave is counted, the first is gone for good; later starts
    // need no flag.
    let mut accepted = args.clone();
    accepted.push("--accept-lost-counts".into());
    let total = first.events.len() + second.events.len();
    count_all(&run, &mut conn, &accepted, total);
    run.assert_exact(&mut conn, &second.truth);
    count_all(&run, &mut conn, &args, total);
    run.assert_exact(&mut conn, &second.truth);
}

#[test]
fn a_broker_that_came_back_empty_is_refused_until_the_fences_are_reset() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let old = Broker::start_private();
    let run = Scenario::on(old.addr(), "e2e_guards_empty", "empty", PARTITIONS);
    let args = run.tally_args(&redis.url());
    let first = run.produce_workload(run.seed, 4_000, PARTITIONS);
    count_all(&run, &mut conn, &args, first.events.len());
    drop(old);

    // The same topic on a broker that holds nothing: its log is shorter than the fences.
    let new = Broker::start_private();
    create_topic_on(new.addr(), &run.topic, PARTITIONS);
    let second = Workload::generate(run.seed ^ 0xe3, 400, PARTITIONS);
    produce(
        new.addr(),
        &run.topic,
        second.messages(0..second.events.len()),
    );
    let moved = run.moved_to(new.addr());
    let args = moved.tally_args(&redis.url());
    let before = snapshot(&mut conn, &moved.prefix);
    let line = error_line(&run_refused(&args));
    assert!(
        line.contains(&format!("topic {} partition ", moved.topic))
            && line.contains("but its fence says offset")
            && line.contains("tally reset-fences"),
        "{line}"
    );
    assert_eq!(
        snapshot(&mut conn, &moved.prefix),
        before,
        "nothing written"
    );

    let mut reset = vec!["reset-fences".to_string(), "--yes".to_string()];
    reset.extend(args.iter().cloned());
    let reset: Vec<&str> = reset.iter().map(String::as_str).collect();
    let out = tally_cli(&reset);
    assert!(out.status.success(), "reset-fences: {}", output_text(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("its fence is ahead of the log"), "{text}");
    let refused = tally_cli(
        &reset[..1]
            .iter()
            .chain(&reset[2..])
            .copied()
            .collect::<Vec<_>>(),
    );
    assert!(
        !refused.status.success() && output_text(&refused).contains("pass --yes"),
        "without --yes and without a terminal: {}",
        output_text(&refused)
    );

    count_all(&moved, &mut conn, &args, second.events.len());
    moved.assert_exact(&mut conn, &merged(&first.truth, &second.truth));
}

/// Produces 2,000 likes, starts `tally run` serving metrics and waits until every one is
/// applied: a consumer running and caught up, its metrics address, and the likes it counted.
fn caught_up_with_metrics(
    run: &Scenario,
    redis: &RedisServer,
    conn: &mut redis::Connection,
) -> (Tally, String, Workload) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(["--metrics-addr", &metrics].map(String::from));
    let w = run.produce_workload(run.seed, 2_000, PARTITIONS);
    let mut tally = Tally::spawn_args("tally", &args);
    run.wait_applied(
        conn,
        &run.hwms(w.events.len()),
        Duration::from_secs(60),
        || tally.assert_running(),
    );
    (tally, metrics, w)
}

/// A policy that may evict tally's keys, set under a running tally with `CONFIG SET`, is
/// reported within seconds (ERROR line, `tally_eviction_policy_unsafe`), and no longer once it
/// is set back; counting goes on exactly.
#[test]
fn an_eviction_policy_set_while_running_is_reported() {
    let run = Scenario::new("e2e_guards_evict_live", "evictlive", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let (mut tally, metrics, w) = caught_up_with_metrics(&run, &redis, &mut conn);
    let unsafe_now = || metric_value(&scrape_metrics(&metrics), "tally_eviction_policy_unsafe");
    assert_eq!(unsafe_now(), Some(0.0));
    policy(&mut conn, "allkeys-lru");
    wait_for(
        "the unsafe policy reported",
        Duration::from_secs(30),
        || {
            tally.assert_running();
            (unsafe_now() == Some(1.0)).then_some(())
        },
    );
    let log = tally.log_text();
    assert!(
        log.lines().any(|l| l.contains("ERROR")
            && l.contains("eviction policy changed under a running tally")
            && l.contains("allkeys-lru")),
        "{}",
        tally.log_tail(20)
    );
    policy(&mut conn, "noeviction");
    wait_for(
        "the safe policy seen again",
        Duration::from_secs(30),
        || (unsafe_now() == Some(0.0)).then_some(()),
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
}

/// A fence or an origin overwritten with what is not an offset (a foreign writer, a typo in
/// redis-cli), or a generation pointer that names no generation, is refused at start with the
/// key, its value and the fix, and nothing is written; the key restored, counting goes on
/// exactly.
#[test]
fn a_fence_origin_or_pointer_that_holds_no_number_is_refused_with_its_key() {
    let run = Scenario::new("e2e_guards_stray", "strayfence", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let args = run.tally_args(&redis.url());
    let first = run.produce_workload(run.seed, 2_000, PARTITIONS);
    count_all(&run, &mut conn, &args, first.events.len());
    let second = run.produce_workload(run.seed ^ 0x57a7, 1_000, PARTITIONS);
    let fence = fence_key(&run.prefix, &run.group, &run.topic, 1);
    let origin = format!("{}:origin:{}:{}:2", run.prefix, run.group, run.topic);
    for key in [fence, origin] {
        let kept: String = conn.get(&key).unwrap();
        let _: () = conn.set(&key, "12o45").unwrap();
        let before = snapshot(&mut conn, &run.prefix);
        let line = refusal_line(&run_refused(&args));
        assert!(
            line.contains(&format!("{key} holds \"12o45\", which is not an offset"))
                && line.contains("tally rebuild"),
            "{line}"
        );
        assert_eq!(
            snapshot(&mut conn, &run.prefix),
            before,
            "{key}: the refused start wrote"
        );
        let _: () = conn.set(&key, kept).unwrap();
    }
    // The generation pointer readers and writers follow: without a rebuild it is absent.
    let pointer = format!("{}:generation", run.prefix);
    let absent: bool = !conn.exists::<_, bool>(&pointer).unwrap();
    assert!(absent, "no rebuild ran, so no pointer");
    let _: () = conn.hset(&pointer, "current", "two").unwrap();
    let before = snapshot(&mut conn, &run.prefix);
    let line = refusal_line(&run_refused(&args));
    assert!(
        line.contains(&format!(
            "{pointer} field current holds \"two\", which is not a number"
        )),
        "{line}"
    );
    assert_eq!(
        snapshot(&mut conn, &run.prefix),
        before,
        "the pointer: the refused start wrote"
    );
    let _: () = conn.del(&pointer).unwrap();
    count_all(
        &run,
        &mut conn,
        &args,
        first.events.len() + second.events.len(),
    );
    run.assert_exact(&mut conn, &merged(&first.truth, &second.truth));
}

/// The generation pointer overwritten under a running consumer with what tally never writes
/// there: the consumer says so once (ERROR line naming the key and the value) and holds
/// `tally_generation_pointer_unreadable` at 1 while it goes on counting the generation it
/// read; set back, the gauge returns to 0. Every count is exact.
#[test]
fn a_generation_pointer_overwritten_while_running_is_reported() {
    let run = Scenario::new("e2e_guards_pointer_live", "pointerlive", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let (mut tally, metrics, first) = caught_up_with_metrics(&run, &redis, &mut conn);
    let unreadable = || {
        metric_value(
            &scrape_metrics(&metrics),
            "tally_generation_pointer_unreadable",
        )
    };
    assert_eq!(unreadable(), Some(0.0));
    let pointer = format!("{}:generation", run.prefix);
    let _: () = conn.hset(&pointer, "current", "two").unwrap();
    wait_for(
        "the unreadable pointer reported",
        Duration::from_secs(30),
        || {
            tally.assert_running();
            (unreadable() == Some(1.0)).then_some(())
        },
    );
    let said = format!("{pointer} field current holds \"two\", which is not a number");
    let errors = |log: &str| {
        log.lines()
            .filter(|l| l.contains("ERROR") && l.contains(&said))
            .count()
    };
    // Counting goes on meanwhile, into the generation it read.
    let second = run.produce_workload(run.seed ^ 0x9e7, 1_000, PARTITIONS);
    run.wait_applied(
        &mut conn,
        &run.hwms(first.events.len() + second.events.len()),
        Duration::from_secs(60),
        || tally.assert_running(),
    );
    assert_eq!(
        errors(&tally.log_text()),
        1,
        "said once: {}",
        tally.log_tail(20)
    );
    let _: () = conn.del(&pointer).unwrap();
    wait_for("the pointer read again", Duration::from_secs(30), || {
        (unreadable() == Some(0.0)).then_some(())
    });
    assert!(
        tally
            .log_text()
            .contains("The generation pointer reads again."),
        "{}",
        tally.log_tail(20)
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &merged(&first.truth, &second.truth));
}

/// Redis at maxmemory under noeviction refuses every script's first write: no key is at fault,
/// so no partition is stopped and nothing is half-written. tally retries each batch (a WARN
/// line naming maxmemory, `tally_redis_retries_total`) and counts everything exactly once Redis
/// has room again.
#[test]
fn a_redis_out_of_memory_is_waited_out_without_stopping_a_partition() {
    let run = Scenario::new("e2e_guards_oom", "oom", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let (mut tally, metrics, first) = caught_up_with_metrics(&run, &redis, &mut conn);
    let retries =
        || metric_value(&scrape_metrics(&metrics), "tally_redis_retries_total").unwrap_or(0.0);
    let retried_before = retries();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query(&mut conn)
        .unwrap();
    let before = snapshot(&mut conn, &run.prefix);
    let second = run.produce_workload(run.seed ^ 0x00f, 1_000, PARTITIONS);
    let full = "Redis is at maxmemory and refuses writes";
    wait_for(
        "the batches waiting for room",
        Duration::from_secs(30),
        || {
            tally.assert_running();
            (tally.log_text().contains(full) && retries() >= retried_before + 3.0).then_some(())
        },
    );
    assert_eq!(
        snapshot(&mut conn, &run.prefix),
        before,
        "a refused write kept something"
    );
    let log = tally.log_text();
    assert!(
        !log.contains("refused its increment"),
        "no key is at fault: {}",
        tally.log_tail(20)
    );
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query(&mut conn)
        .unwrap();
    run.wait_applied(
        &mut conn,
        &run.hwms(first.events.len() + second.events.len()),
        Duration::from_secs(60),
        || tally.assert_running(),
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &merged(&first.truth, &second.truth));
}

/// A dead-letter copy that can never succeed (here: larger than tally's producer may send) is
/// retried without end and holds its partition back, but never silently: each failure is
/// counted, and after a minute `/readyz` fails with the error. The other partitions go on.
#[test]
fn a_dead_letter_copy_that_keeps_failing_fails_readiness() {
    // The topic takes the 1.5 MB message that tally's dead-letter producer may not send.
    let run = Scenario::with_topic(
        &brokers(),
        "e2e_guards_dlq",
        "dlqfail",
        PARTITIONS,
        &[("max.message.bytes", "8388608")],
    );
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let dlq = format!("{}-dlq", run.topic);
    create_topic_on(&run.brokers, &dlq, 1);
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(["--dead-letter-topic", &dlq, "--metrics-addr", &metrics].map(String::from));
    let w = run.produce_workload(run.seed, 2_000, PARTITIONS);
    // Not a LikeEvent (field 1 with wire type 7), and larger than a producer sends by default.
    produce_stamped(
        &run.brokers,
        &run.topic,
        0,
        &vec![0x0f; 1_500_000],
        now_ms(),
    );
    let mut tally = Tally::spawn_args("tally", &args);
    let hwms = run.hwms(w.events.len() + 1);
    // Every partition but the one holding the bad message is applied to its end.
    wait_for("the other partitions", Duration::from_secs(60), || {
        tally.assert_running();
        let fences = read_fences(
            &mut conn,
            &run.prefix,
            &run.group,
            &run.topic,
            PARTITIONS as usize,
        );
        (1..PARTITIONS as usize)
            .all(|p| fences[p] == Some(hwms[p] - 1))
            .then_some(())
    });
    let mut last = String::new();
    let body = wait_for("readiness to fail", Duration::from_secs(120), || {
        tally.assert_running();
        let (status, body) = http_get(&metrics, "/readyz").ok()?;
        last = body.clone();
        (status == 503 && body.contains("FAIL dead letters")).then_some(body)
    });
    eprintln!("[e2e_guards] /readyz before: {last}");
    assert!(
        body.contains(&format!("copies to {dlq} fail")) && body.contains("too large"),
        "{body}"
    );
    let text = scrape_metrics(&metrics);
    assert!(metric_value(&text, "tally_dead_letter_failures_total").unwrap_or(0.0) >= 3.0);
    // The gauge follows within one probe interval.
    wait_for("tally_ready 0", Duration::from_secs(15), || {
        let text = scrape_metrics(&metrics);
        (metric_value(&text, "tally_ready") == Some(0.0)).then_some(())
    });
    let fences = read_fences(
        &mut conn,
        &run.prefix,
        &run.group,
        &run.topic,
        PARTITIONS as usize,
    );
    assert!(
        fences[0] < Some(hwms[0] - 1),
        "the held partition's fence never passes the bad message"
    );
    tally.kill9();
}

/// A replica started with another `--dedupe` rule than the prefix's writers would count the
/// repeats they skip on the partitions it owns: refused, naming both rules and the fix, and
/// the rule stays. `--dedupe-change` makes its rule the prefix's; the writer still running the
/// old one reports it within seconds (ERROR line, `tally_dedupe_rule_mismatch`) until the rule
/// is its own again, and `tally verify` under the old rule says the prefix's is another. A
/// value tally never writes in the rule's key is refused with the key.
#[test]
fn a_replica_with_another_dedupe_rule_is_refused_until_the_change_is_said() {
    let run = Scenario::new("e2e_guards_rule", "rule", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let (mut tally, metrics, w) = caught_up_with_metrics(&run, &redis, &mut conn);
    let key = format!("{}:dedupe", run.prefix);
    let rule = |conn: &mut redis::Connection| -> Option<String> { conn.get(&key).unwrap() };
    assert_eq!(
        rule(&mut conn).as_deref(),
        Some("off"),
        "the first start wrote its rule"
    );
    let mismatch = || metric_value(&scrape_metrics(&metrics), "tally_dedupe_rule_mismatch");
    assert_eq!(mismatch(), Some(0.0));

    let mut ids = run.tally_args(&redis.url());
    ids.extend(["--dedupe", "ids", "--dedupe-window", "4000"].map(String::from));
    let line = refusal_line(&run_refused(&ids));
    assert!(
        line.contains(&format!("judge repeats by --dedupe off ({key})"))
            && line.contains("this process by --dedupe ids --dedupe-window 4000")
            && line.contains("--dedupe-change"),
        "{line}"
    );
    assert_eq!(
        rule(&mut conn).as_deref(),
        Some("off"),
        "a refused start changes nothing"
    );

    ids.push("--dedupe-change".into());
    let mut changed = Tally::spawn_args("tally-ids", &ids);
    wait_for("the rule changed", Duration::from_secs(60), || {
        changed.assert_running();
        (rule(&mut conn).as_deref() == Some("ids 4000")).then_some(())
    });
    wait_for("the old rule reported", Duration::from_secs(30), || {
        tally.assert_running();
        (mismatch() == Some(1.0)).then_some(())
    });
    assert!(
        tally.log_text().lines().any(|l| l.contains("ERROR")
            && l.contains("dedupe rule is no longer the one this process judges repeats by")
            && l.contains("--dedupe ids --dedupe-window 4000")),
        "{}",
        tally.log_tail(20)
    );
    assert!(changed.sigterm_and_wait(Duration::from_secs(20)).success());
    // A recount under another rule than the prefix's says so.
    let mut verify = vec!["verify".to_string()];
    verify.extend(run.tally_args(&redis.url()));
    let verify: Vec<&str> = verify.iter().map(String::as_str).collect();
    let said = output_text(&tally_cli(&verify));
    assert!(
        said.contains(&format!(
            "the prefix's writers judge repeats by 'ids 4000' ({key}), this recount by 'off'"
        )),
        "{said}"
    );
    let _: () = conn.set(&key, "off").unwrap();
    wait_for("the rule its own again", Duration::from_secs(30), || {
        (mismatch() == Some(0.0)).then_some(())
    });

    let _: () = conn.set(&key, "sometimes").unwrap();
    let line = refusal_line(&run_refused(&run.tally_args(&redis.url())));
    assert!(
        line.contains(&format!("{key} holds 'sometimes'")) && line.contains("'off'"),
        "{line}"
    );
    let _: () = conn.set(&key, "off").unwrap();
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
}
