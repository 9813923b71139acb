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
    let w = Workload::generate(run.seed, EVENTS, PARTITIONS);
    produce(&run.brokers, &run.topic, w.messages(0..w.events.len()));
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
