//! The packed layout against a real broker and redis-server, ground truth computed here:
//!
//! * `tally rebuild --layout packed` moves a live prefix of string keys to fields of small
//!   hashes under traffic, the live consumer following; every count exact, readers and
//!   `tally verify` agree; a writer naming the old layout is refused; and `tally rebuild
//!   --layout strings` moves it back, exact again;
//! * a server whose hash-max-listpack-entries is too low for the hashes is refused at start in
//!   one line naming the setting;
//! * hashes filled past the server's limit (more counters than the prefix was sized for) are a
//!   metric above its limit and an ERROR line, while every count stays exact.

mod common;

use std::time::Duration;

use common::*;

/// `tally_args` without a layout of the environment's: these tests name their own.
fn args(run: &Scenario, url: &str, extra: &[&str]) -> Vec<String> {
    let mut args = run.tally_args(url);
    let layout = test_layout();
    if !layout.is_empty() {
        args.truncate(args.len() - layout.len());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn rebuild(args: &[String], name: &str) -> Tally {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut rebuild = Tally::spawn_command(name, "rebuild", &refs);
    let status = wait_for("the rebuild to exit", Duration::from_secs(240), || {
        rebuild.try_status()
    });
    assert!(status.success(), "{name} failed:\n{}", rebuild.log_tail(40));
    rebuild
}

/// Keys of each kind under a generation's prefix: (string counters, packed hashes).
fn kinds(conn: &mut redis::Connection, prefix: &str) -> (usize, usize) {
    (
        scan_keys(conn, &format!("{prefix}:likes:*")).len(),
        scan_keys(conn, &format!("{prefix}:packed:*")).len(),
    )
}

#[test]
fn rebuild_moves_a_live_prefix_to_packed_and_back_exactly() {
    const PARTITIONS: i32 = 4;
    const BACKLOG: usize = 30_000;
    let run = Scenario::new("e2e_packed_move", "pkm", PARTITIONS);
    let redis = RedisServer::start();
    let url = redis.url();
    let mut conn = redis.conn();
    let tuning = ["--buckets", "2", "--route-refresh-ms", "200"];

    let mut workload = Workload::new(run.seed, PARTITIONS);
    let backlog = workload.grow(BACKLOG);
    produce(&run.brokers, &run.topic, workload.messages(backlog));
    let live_args = args(&run, &url, &tuning);
    let mut live = Tally::spawn_args("live", &live_args);
    run.wait_applied(
        &mut conn,
        &run.hwms(BACKLOG),
        Duration::from_secs(120),
        || live.assert_running(),
    );
    let (strings, hashes) = kinds(&mut conn, &run.prefix);
    assert!(strings > 0 && hashes == 0, "{strings} {hashes}");

    // Under traffic: to packed, sized for a few thousand counters.
    let background = run.stream(workload, 100, Duration::from_millis(50));
    let packed = [
        &tuning[..],
        &["--layout", "packed", "--packed-counters", "4000"],
    ]
    .concat();
    let to_packed = rebuild(&args(&run, &url, &packed), "to-packed");
    assert_eq!(current_generation(&mut conn, &run.prefix), 1);
    let g1 = format!("{}:g1", run.prefix);
    assert!(
        to_packed.log_text().contains("Generation layout recorded."),
        "{}",
        to_packed.log_tail(20)
    );
    let layout: Option<String> = redis::cmd("HGET")
        .arg(format!("{}:layout", run.prefix))
        .arg("layout.g1")
        .query(&mut conn)
        .unwrap();
    assert_eq!(layout.as_deref(), Some("packed:63:64"));

    // A writer that names the layout the prefix left is refused, in one line.
    let refused = run_refused(&args(
        &run,
        &url,
        &[&tuning[..], &["--layout", "strings"]].concat(),
    ));
    let line = refusal_line(&refused);
    assert!(
        line.contains("--layout strings") && line.contains("tally rebuild --layout strings"),
        "{line}"
    );

    let workload = background.stop();
    let total = workload.events.len();
    wait_applied_while(
        &mut conn,
        &g1,
        &run.group,
        &run.topic,
        &run.hwms(total),
        Duration::from_secs(120),
        || live.assert_running(),
    );
    let (strings, hashes) = kinds(&mut conn, &g1);
    assert!(
        strings == 0 && hashes > 0,
        "g1: {strings} string keys, {hashes} hashes"
    );
    assert_counts_eq(&read_counts(&mut conn, &g1), &workload.truth);
    assert!(
        live.log_text().contains("Switched to generation."),
        "{}",
        live.log_tail(30)
    );

    // Readers sum the fields, and verify finds the packed counts equal to the log's.
    let mut some: Vec<(u64, i64)> = workload.truth.iter().map(|(&p, &c)| (p, c)).collect();
    some.sort_unstable();
    for &(post, likes) in some.iter().step_by(some.len() / 5 + 1) {
        let out = tally_cli(&[
            "count",
            &post.to_string(),
            "--redis",
            &url,
            "--prefix",
            &run.prefix,
        ]);
        assert!(out.status.success(), "{}", output_text(&out));
        let shown = output_text(&out);
        let row = [post.to_string(), likes.to_string()];
        assert!(
            shown
                .lines()
                .any(|l| l.split_whitespace().eq(row.iter().map(String::as_str))),
            "post {post} should read {likes}: {shown}"
        );
    }
    let verify: Vec<String> = ["verify".to_string()]
        .into_iter()
        .chain(args(&run, &url, &tuning))
        .collect();
    let refs: Vec<&str> = verify.iter().map(String::as_str).collect();
    let out = tally_cli(&refs);
    assert!(out.status.success(), "verify: {}", output_text(&out));

    // And back to a string key per counter.
    let back = [&tuning[..], &["--layout", "strings"]].concat();
    rebuild(&args(&run, &url, &back), "to-strings");
    assert_eq!(current_generation(&mut conn, &run.prefix), 2);
    let g2 = format!("{}:g2", run.prefix);
    let (strings, hashes) = kinds(&mut conn, &g2);
    assert!(strings > 0 && hashes == 0, "g2: {strings} {hashes}");
    assert_counts_eq(&read_counts(&mut conn, &g2), &workload.truth);
    let status = live.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success());
}

#[test]
fn a_server_that_would_not_keep_the_hashes_compact_is_refused() {
    let run = Scenario::new("e2e_packed_limit", "pkl", 1);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("hash-max-listpack-entries")
        .arg(100)
        .query(&mut conn)
        .unwrap();
    let out = run_refused(&args(&run, &redis.url(), &["--layout", "packed"]));
    let line = error_line(&out);
    assert!(
        line.contains("hash-max-listpack-entries 100")
            && line.contains("need at least 125")
            && line.contains("CONFIG SET"),
        "{line}"
    );
    // Nothing counted: the refusal comes before the first batch.
    assert!(scan_keys(&mut conn, &format!("{}:packed:*", run.prefix)).is_empty());
    // Fewer fields per hash fit the same server (24 on average: the fullest near 83).
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("hash-max-listpack-value")
        .arg(32)
        .query(&mut conn)
        .unwrap();
    let out = run_refused(&args(
        &run,
        &redis.url(),
        &["--layout", "packed", "--packed-fields", "24"],
    ));
    let line = error_line(&out);
    assert!(
        line.contains("hash-max-listpack-value 32") && line.contains("need at least 41"),
        "{line}"
    );
}

#[test]
fn hashes_filled_past_the_limit_are_reported_and_counts_stay_exact() {
    const PARTITIONS: i32 = 2;
    const EVENTS: usize = 6_000;
    let run = Scenario::new("e2e_packed_overfull", "pko", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    // 8 fields per hash need 31 entries; the server keeps 32, and the prefix is sized for 64
    // counters while the workload holds thousands.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("hash-max-listpack-entries")
        .arg(32)
        .query(&mut conn)
        .unwrap();
    let mut workload = Workload::new(run.seed, PARTITIONS);
    let range = workload.grow(EVENTS);
    produce(&run.brokers, &run.topic, workload.messages(range));
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut tally = Tally::spawn_args(
        "overfull",
        &args(
            &run,
            &redis.url(),
            &[
                "--layout",
                "packed",
                "--packed-counters",
                "64",
                "--packed-fields",
                "8",
                "--metrics-addr",
                &addr,
            ],
        ),
    );
    run.wait_applied(
        &mut conn,
        &run.hwms(EVENTS),
        Duration::from_secs(120),
        || tally.assert_running(),
    );
    run.assert_exact(&mut conn, &workload.truth);
    let text = scrape_metrics(&addr);
    let fill = metric_value(&text, "tally_packed_hash_fill_max").unwrap();
    let limit = metric_value(&text, "tally_packed_hash_fill_limit").unwrap();
    assert_eq!(limit, 32.0, "{text}");
    assert!(fill > limit, "fill {fill}, limit {limit}");
    let log = tally.log_text();
    assert!(
        log.contains("A packed hash holds more fields than the server keeps compact"),
        "{}",
        tally.log_tail(30)
    );
    let encoding: String = redis::cmd("OBJECT")
        .arg("ENCODING")
        .arg(format!("{}:packed:0", run.prefix))
        .query(&mut conn)
        .unwrap();
    assert_eq!(encoding, "hashtable");
}
