//! The layout record: the first `tally run` on a prefix writes its bucket count, slot groups,
//! topic and group beside the data; a later start with another `--buckets` or `--group` is
//! refused with one line and changes nothing; readers take the bucket count from the record;
//! data written without a record is adopted on the next start.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;

const EVENTS: usize = 20_000;
const PARTITIONS: i32 = 4;
/// Not the default: a reader that fell back to the default would under-read.
const BUCKETS: &str = "32";

/// `args` with `flag`'s value replaced (or added).
fn with(args: &[String], flag: &str, value: &str) -> Vec<String> {
    let mut out = args.to_vec();
    match out.iter().position(|a| a == flag) {
        Some(i) => out[i + 1] = value.to_string(),
        None => out.extend([flag.to_string(), value.to_string()]),
    }
    out
}

fn record(conn: &mut redis::Connection, prefix: &str) -> HashMap<String, String> {
    redis::cmd("HGETALL")
        .arg(format!("{prefix}:layout"))
        .query(conn)
        .expect("read the layout record")
}

#[test]
fn changed_layout_flags_are_refused_and_readers_need_none() {
    let run = Scenario::new("e2e_layout", "layout", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let w = run.produce_workload(run.seed, EVENTS, PARTITIONS);
    let hwms = run.hwms(EVENTS);
    let args = with(&run.tally_args(&redis.url()), "--buckets", BUCKETS);

    let mut tally = Tally::spawn_args("tally", &args);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
    let written = record(&mut conn, &run.prefix);
    assert_eq!(written.get("buckets").map(String::as_str), Some(BUCKETS));
    assert_eq!(written.get("slot_groups").map(String::as_str), Some("1"));
    assert_eq!(written.get("group"), Some(&run.group));
    assert_eq!(written.get("topic"), Some(&run.topic));
    assert_eq!(written.get("format").map(String::as_str), Some("2"));

    // Each changed flag: one line naming the flag, the stored value and the remedy; exit 1.
    let canary = format!("{}-canary", run.group);
    for (flag, value, stored, remedy) in [
        ("--buckets", "8", BUCKETS, "run with --buckets 32"),
        (
            "--group",
            canary.as_str(),
            run.group.as_str(),
            "a --prefix of its own",
        ),
    ] {
        let line = refusal_line(&run_refused(&with(&args, flag, value)));
        let expected = format!(
            "error: {flag} {value} does not match the layout record {}:layout, written with {stored}: ",
            run.prefix
        );
        assert!(
            line.starts_with(&expected) && line.contains(remedy),
            "{line}"
        );
    }
    // librdkafka settings that would skip or add events are refused before anything starts.
    for setting in [
        "auto.offset.reset=latest",
        "isolation.level=read_uncommitted",
    ] {
        let out = run_refused(&with(&args, "-X", setting));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "-X {setting}:\n{stderr}");
        let key = setting.split('=').next().unwrap();
        assert!(
            stderr.contains(&format!("--kafka-config: {key} cannot be set: ")),
            "-X {setting}:\n{stderr}"
        );
    }
    run.assert_exact(&mut conn, &w.truth);
    assert_eq!(
        record(&mut conn, &run.prefix),
        written,
        "a refused start changed the record"
    );

    // A reader given no layout flag sums the record's 32 buckets.
    let mut posts: Vec<(u64, i64)> = w.truth.iter().map(|(&p, &c)| (p, c)).collect();
    posts.sort_by_key(|&(p, c)| (std::cmp::Reverse(c.abs()), p));
    posts.truncate(50);
    let ids: Vec<String> = posts.iter().map(|(p, _)| p.to_string()).collect();
    let url = redis.url();
    let mut count = vec!["count", "--json", "--redis", &url, "--prefix", &run.prefix];
    count.extend(ids.iter().map(String::as_str));
    let out = tally_cli(&count);
    assert!(out.status.success(), "{}", output_text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for (i, &(post, likes)) in posts.iter().enumerate() {
        assert_eq!(json[i]["post_id"].as_u64(), Some(post), "{json}");
        assert_eq!(
            json[i]["likes"].as_i64(),
            Some(likes),
            "post {post}: {json}"
        );
    }

    // Data written before records existed is adopted, from the flags of that start.
    let _: () = redis::cmd("DEL")
        .arg(format!("{}:layout", run.prefix))
        .query(&mut conn)
        .unwrap();
    // A reader finds no record now and says so, in one line.
    let out = tally_cli(&["count", "1", "--redis", &url, "--prefix", &run.prefix]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "error: prefix {} has no layout record ({}:layout)",
            run.prefix, run.prefix
        )),
        "{stderr}"
    );
    // Nothing in the data says how many buckets it was written with: a start that does not
    // name the count is refused, in one line.
    let unnamed: Vec<String> = {
        let at = args.iter().position(|a| a == "--buckets").unwrap();
        [&args[..at], &args[at + 2..]].concat()
    };
    let refused = run_refused(&unnamed);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{}", output_text(&refused));
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("holds counts but no layout record")
                && l.contains("start once with --buckets")),
        "{stderr}"
    );
    assert!(record(&mut conn, &run.prefix).is_empty());
    let mut tally = Tally::spawn_args("tally-adopts", &args);
    let adopted = wait_for("the adoption", Duration::from_secs(60), || {
        tally.assert_running();
        let again = record(&mut conn, &run.prefix);
        (!again.is_empty()).then_some(again)
    });
    assert_eq!(adopted.get("buckets").map(String::as_str), Some(BUCKETS));
    wait_for("the adoption's log line", Duration::from_secs(30), || {
        tally
            .log_text()
            .contains("Adopted data written without a layout record")
            .then_some(())
    });
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
}

/// Adoption reads the data's own keys: every partition's fences of every group, and every
/// version-0 bucket. A record that lost a field is told apart from a key tally never wrote, and
/// neither refusal tells the operator to delete it. The start that adopts logs what a reader
/// will sum.
#[test]
fn adoption_checks_every_partition_and_group_and_says_what_readers_sum() {
    let run = Scenario::new("e2e_layout", "adopt", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let events = 5_000;
    let w = run.produce_workload(run.seed, events, PARTITIONS);
    let hwms = run.hwms(events);
    let args = with(&run.tally_args(&redis.url()), "--buckets", "16");
    let mut tally = Tally::spawn_args("tally", &args);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
    let key = format!("{}:layout", run.prefix);
    let url = redis.url();
    let count_one = || tally_cli(&["count", "1", "--redis", &url, "--prefix", &run.prefix]);

    // A record that lost a field: repaired by setting the field back, never by deleting it.
    let _: () = redis::cmd("HDEL")
        .arg(&key)
        .arg("buckets")
        .query(&mut conn)
        .unwrap();
    let line = refusal_line(&run_refused(&args));
    assert!(
        line.starts_with(&format!(
            "error: layout record {key} is damaged (field buckets is missing): set the field back with `HSET {key}"
        )) && !line.contains("delete"),
        "{line}"
    );
    let reader = refusal_line(&count_one());
    assert!(
        reader.contains("is damaged") && !reader.contains("delete"),
        "{reader}"
    );
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("buckets")
        .arg("16")
        .query(&mut conn)
        .unwrap();
    let written = record(&mut conn, &run.prefix);
    assert_eq!(written.len(), 6, "{written:?}");

    // A key tally never wrote: another prefix, and the key left to its owner.
    let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("someone else's")
        .query(&mut conn)
        .unwrap();
    let line = refusal_line(&run_refused(&args));
    assert!(
        line.starts_with(&format!(
            "error: {key} is not a layout record (a key of another type than a hash): something other than tally writes under --prefix {}; give tally a --prefix of its own",
            run.prefix
        )) && !line.contains("delete"),
        "{line}"
    );
    let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();

    // Without partition 0's origin the data is still seen, from the other partitions.
    let origin0 = format!("{}:origin:{}:{}:0", run.prefix, run.group, run.topic);
    let saved: String = redis::cmd("GET").arg(&origin0).query(&mut conn).unwrap();
    let _: () = redis::cmd("DEL").arg(&origin0).query(&mut conn).unwrap();
    let unnamed: Vec<String> = {
        let at = args.iter().position(|a| a == "--buckets").unwrap();
        [&args[..at], &args[at + 2..]].concat()
    };
    let line = refusal_line(&run_refused(&unnamed));
    assert!(
        line.contains("holds counts but no layout record")
            && line.contains("its version-0 buckets go up to 15"),
        "{line}"
    );
    let _: () = redis::cmd("SET")
        .arg(&origin0)
        .arg(&saved)
        .query(&mut conn)
        .unwrap();

    // Another group would leave these fences unused and count the log again.
    let canary = format!("{}-canary", run.group);
    let line = refusal_line(&run_refused(&with(&args, "--group", &canary)));
    assert_eq!(
        line,
        format!(
            "error: prefix {} has no layout record and holds the fences of group {} on topic {} (partitions 0-3), not of --group {canary} --topic {}: start once with the group and topic that wrote them to adopt the data, or give this group a --prefix of its own",
            run.prefix, run.group, run.topic, run.topic
        )
    );

    // Too few buckets: readers would never sum buckets 8..=15.
    let line = refusal_line(&run_refused(&with(&args, "--buckets", "8")));
    assert!(
        line.contains("holds version-0 buckets up to 15")
            && line.contains("which --buckets 8 leaves out")
            && line.ends_with("(at least 16)"),
        "{line}"
    );
    assert!(
        record(&mut conn, &run.prefix).is_empty(),
        "a refused adoption wrote a record"
    );
    run.assert_exact(&mut conn, &w.truth);

    // The right count adopts, and the log line says what a reader sums.
    let mut tally = Tally::spawn_args("tally-adopts", &args);
    let line = wait_for("the adoption's log line", Duration::from_secs(60), || {
        tally.assert_running();
        tally
            .log_text()
            .lines()
            .find(|l| l.contains("Adopted data written without a layout record"))
            .map(str::to_string)
    });
    let p = &run.prefix;
    assert!(
        line.contains(&format!(
            "reads=16 buckets per post, {p}:likes:<post>:0 to {p}:likes:<post>:15, plus its own versions"
        )) && line.contains(&format!(
            "found=fences of group {} on topic {} (partitions 0-3);",
            run.group, run.topic
        )) && line.contains("buckets up to 15"),
        "{line}"
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    assert_eq!(
        record(&mut conn, &run.prefix)
            .get("buckets")
            .map(String::as_str),
        Some("16")
    );
    run.assert_exact(&mut conn, &w.truth);
    let (&post, &likes) = w.truth.iter().max_by_key(|(_, c)| c.abs()).unwrap();
    let post = post.to_string();
    let out = tally_cli(&["count", "--json", "--redis", &url, "--prefix", p, &post]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json[0]["likes"].as_i64(), Some(likes), "{json}");
}
