//! Operations: a running `tally` answers `/healthz`, `/readyz` and `/metrics`
//! while it counts into a Redis that requires an ACL user (password from a
//! file), readiness follows Redis going away, and a wrong password stops the
//! process with exactly one clear line and exit code 1, without the secret; a
//! member that owns no partition says so.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const PARTITIONS: i32 = 2;
const EVENTS: usize = 2_000;

/// GET `path` until `accept` takes the answer.
fn wait_http(
    tally: &mut Tally,
    addr: &str,
    path: &str,
    what: &str,
    accept: impl Fn(u16, &str) -> bool,
) -> String {
    wait_for(what, Duration::from_secs(60), || {
        tally.assert_running();
        match http_get(addr, path) {
            Ok((status, body)) if accept(status, &body) => Some(body),
            _ => None,
        }
    })
}

#[test]
fn endpoints_answer_while_counting_into_an_acl_redis() {
    let run = Scenario::new("e2e_ops", "ops", PARTITIONS);
    let mut redis = RedisServer::start_with_acl("alice", "s3cret-pw");
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("redis-password");
    std::fs::write(&password_file, "s3cret-pw\n").unwrap();

    let http = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&format!("redis://alice@127.0.0.1:{}/", redis.port()));
    args.extend([
        "--redis-password-file".to_string(),
        password_file.display().to_string(),
        "--metrics-addr".to_string(),
        http.clone(),
    ]);
    let mut tally = Tally::spawn_args("tally", &args);

    let alive = wait_http(&mut tally, &http, "/healthz", "/healthz 200", |s, _| {
        s == 200
    });
    assert_eq!(alive, "ok\n");
    let ready = wait_http(&mut tally, &http, "/readyz", "/readyz 200", |s, _| s == 200);
    for line in ["ok partitions: 2 assigned", "ok redis:", "ok broker:"] {
        assert!(ready.contains(line), "/readyz lacks {line:?}:\n{ready}");
    }
    assert_eq!(http_get(&http, "/nothing-here").unwrap().0, 404);

    let w = run.produce_workload(run.seed, EVENTS, PARTITIONS);
    let hwms = run.hwms(EVENTS);
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(60), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &w.truth);

    // Every metric tally run exports is there, except the per-partition gauges,
    // which appear once a partition reports them (and those of `tally serve` and
    // `tally rebuild`).
    let text = scrape_metrics(&http);
    let per_partition = [
        tally::infra::metrics::CONSUMER_LAG,
        tally::infra::metrics::CONSUMER_LAG_SECONDS,
        tally::infra::metrics::APPLIED_OFFSET,
        // Reported only with --dedupe on.
        tally::infra::metrics::DEDUPE_WINDOW_SECONDS,
        tally::infra::metrics::DEDUPE_REREAD_AGE,
        tally::infra::metrics::DEDUPE_REREAD_REMAINING,
    ];
    for &(name, _, _) in tally::infra::metrics::ALL {
        if per_partition.contains(&name)
            || tally::infra::metrics::SERVE_ONLY.contains(&name)
            || tally::infra::metrics::REBUILD_ONLY.contains(&name)
        {
            continue;
        }
        let shown = text.lines().any(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{', '_']))
        });
        assert!(shown, "/metrics lacks {name}:\n{text}");
    }
    assert_eq!(
        metric_value(&text, tally::infra::metrics::EVENTS),
        Some(EVENTS as f64)
    );
    assert!(text.contains("# HELP tally_events_total"), "{text}");
    // Every applied message was read; a message fetched again after a seek
    // is read twice, so the count may be higher, never lower.
    let read = metric_value(&text, tally::infra::metrics::MESSAGES_READ).unwrap_or(0.0);
    assert!(read >= EVENTS as f64, "read {read} of {EVENTS} messages");

    // Readiness follows Redis; liveness does not.
    redis.kill();
    let not_ready = wait_http(&mut tally, &http, "/readyz", "/readyz 503", |s, _| s == 503);
    assert!(not_ready.contains("FAIL redis"), "{not_ready}");
    assert_eq!(http_get(&http, "/healthz").unwrap().0, 200);
    assert!(
        !tally.log_text().contains("s3cret-pw"),
        "the password reached the log"
    );
}

#[test]
fn a_wrong_redis_password_is_one_line_and_exit_code_1() {
    let redis = RedisServer::start_with_acl("alice", "s3cret-pw");
    let output = Command::new(tally_bin())
        .args(["run", "--brokers", "127.0.0.1:9", "--redis"])
        .arg(format!(
            "redis://alice:not-the-pw@127.0.0.1:{}/",
            redis.port()
        ))
        .env_remove("TALLY_LOG")
        .env_remove("RUST_LOG")
        .output()
        .expect("run tally");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(output.status.code(), Some(1), "stderr:\n{stderr}");
    assert_eq!(lines.len(), 1, "expected one line, got:\n{stderr}");
    assert!(
        lines[0].starts_with("error: Redis at redis://")
            && lines[0].contains("refused the credentials"),
        "{}",
        lines[0]
    );
    assert!(!stderr.contains("not-the-pw"), "the password was printed");
    assert!(output.stdout.is_empty());
}

#[test]
fn a_member_left_without_partitions_says_so() {
    // One partition, two members: one of them owns nothing and must say so after 30 s.
    let run = Scenario::new("e2e_ops_idle", "idle", 1);
    let redis = RedisServer::start();
    let args = run.tally_args(&redis.url());
    let mut owner = Tally::spawn_args("owner", &args);
    wait_for(
        "the first member to own the partition",
        Duration::from_secs(60),
        || {
            owner.assert_running();
            owner
                .log_text()
                .contains("Partitions assigned. partitions=0@")
                .then_some(())
        },
    );
    let mut idle = Tally::spawn_args("idle", &args);
    let warning = "No partition assigned for 30 s";
    wait_for(
        "a warning from the member without partitions",
        Duration::from_secs(90),
        || {
            owner.assert_running();
            idle.assert_running();
            [&owner, &idle]
                .iter()
                .any(|t| t.log_text().contains(warning))
                .then_some(())
        },
    );
    let line = [&owner, &idle]
        .iter()
        .flat_map(|t| t.log_text().lines().map(str::to_owned).collect::<Vec<_>>())
        .find(|l| l.contains(warning))
        .unwrap();
    assert!(
        line.contains("more members than the topic has partitions")
            && line.contains("idle_secs=30"),
        "{line}"
    );
    for t in [&mut owner, &mut idle] {
        assert!(t.sigterm_and_wait(Duration::from_secs(20)).success());
    }
}
