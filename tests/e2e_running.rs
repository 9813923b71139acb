//! What tally refuses or reports once it runs, and the settings every command shares:
//! - a generation pointer that moved back: a running writer records the generation it writes,
//!   a new `tally run` is refused in one line, readers report it (log line and metric);
//! - a layout record of a newer format is refused in one line; the format before epochs is
//!   read and raised;
//! - a background task that panics ends the process with one line and exit 1;
//! - `tally_consumer_lag_seconds` ages while a partition's first batch cannot land;
//! - `--config` and `TALLY_CONFIG` reach every command that touches Redis;
//! - the Kubernetes example's settings start a second replica after `tally rebucket`.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// `tally <args>` with `env`, none of the caller's `TALLY_*` variables, waited for at most
/// `timeout` (killed then, and the test fails).
fn tally_with_env(args: &[String], env: &[(&str, &str)], timeout: Duration) -> Output {
    let mut command = Command::new(tally_bin());
    for (name, _) in std::env::vars().filter(|(k, _)| k.starts_with("TALLY_")) {
        command.env_remove(name);
    }
    let mut child = command
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tally");
    let deadline = Instant::now() + timeout;
    while child.try_wait().expect("poll tally").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("reap tally");
            panic!(
                "tally {args:?} did not end within {timeout:?}:\n{}",
                output_text(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().expect("reap tally")
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn hget(conn: &mut redis::Connection, key: &str, field: &str) -> Option<String> {
    redis::cmd("HGET").arg(key).arg(field).query(conn).unwrap()
}

#[test]
fn a_pointer_that_moved_back_refuses_writers_and_readers_report_it() {
    let run = Scenario::new("e2e_running_back", "back", 2);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let pointer = format!("{}:generation", run.prefix);
    // A rebuild made generation 1 current.
    let _: () = redis::cmd("HSET")
        .arg(&pointer)
        .arg(&[("current", "1"), ("highest", "1"), ("switched_at_ms", "1")])
        .query(&mut conn)
        .unwrap();
    let mut args = run.tally_args(&redis.url());
    args.extend(strings(&["--buckets", "1", "--route-refresh-ms", "200"]));
    let w = run.produce_workload(run.seed, 2_000, 2);
    let hwms = run.hwms(2_000);
    let mut writer = Tally::spawn_args("writer", &args);
    let g1 = format!("{}:g1", run.prefix);
    wait_applied_while(
        &mut conn,
        &g1,
        &run.group,
        &run.topic,
        &hwms,
        Duration::from_secs(120),
        || writer.assert_running(),
    );

    // A failover loses the switch: the pointer names generation 0 again, `highest` is gone.
    let _: () = redis::cmd("DEL").arg(&pointer).query(&mut conn).unwrap();
    wait_for(
        "the running writer to record the generation it writes",
        Duration::from_secs(30),
        || (hget(&mut conn, &pointer, "highest").as_deref() == Some("1")).then_some(()),
    );
    writer.assert_running();
    assert!(
        writer
            .log_text()
            .contains("The generation pointer went back"),
        "{}",
        writer.log_tail(20)
    );

    // A second writer (a restart, a scale-up) is refused in one line naming the remedy.
    let line = error_line(&run_refused(&args));
    assert!(
        line.contains("names generation 0, but generation 1 was current")
            && line.contains(&format!("HSET {pointer} current 1")),
        "{line}"
    );

    // A reader reads on, and reports it with the remedy.
    let post = w.truth.keys().next().unwrap().to_string();
    let url = redis.url();
    let count = strings(&["count", &post, "--redis", &url, "--prefix", &run.prefix]);
    let out = tally_with_env(&count, &[], Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        stderr.contains("ERROR") && stderr.contains(&format!("HSET {pointer} current 1")),
        "{stderr}"
    );
    let listen = format!("127.0.0.1:{}", free_port());
    let serve_args = [
        "--listen",
        &listen,
        "--redis",
        &url,
        "--prefix",
        &run.prefix,
    ];
    let serve = Tally::spawn_command("serve", "serve", &serve_args);
    let reported = wait_for(
        "serve to report the pointer",
        Duration::from_secs(30),
        || {
            let _ = http_get(&listen, &format!("/v1/posts/{post}/likes"));
            let text = try_scrape_metrics(&listen).ok()?;
            metric_value(&text, "tally_generation_backwards_total").filter(|&v| v >= 1.0)
        },
    );
    assert_eq!(reported, 1.0);
    drop(serve);

    // The remedy: the pointer names generation 1 again; readers are quiet, writers start.
    let _: () = redis::cmd("HSET")
        .arg(&pointer)
        .arg("current")
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let out = tally_with_env(&count, &[], Duration::from_secs(30));
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(out.stderr.is_empty(), "{}", output_text(&out));
    assert!(writer.sigterm_and_wait(Duration::from_secs(20)).success());
    assert_counts_eq(&read_counts(&mut conn, &g1), &w.truth);
}

#[test]
fn a_layout_record_of_a_newer_format_is_refused_and_the_older_one_raised() {
    let run = Scenario::new("e2e_running_format", "format", 1);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let key = format!("{}:layout", run.prefix);
    let record = |format: &str| {
        [
            ("format", format.to_string()),
            ("buckets", "1".to_string()),
            ("slot_groups", "1".to_string()),
            ("topic", run.topic.clone()),
            ("group", run.group.clone()),
            ("created_at_ms", "1".to_string()),
        ]
    };
    // One past the newest format this build knows.
    let newer = (tally::domain::layout::FORMAT + 1).to_string();
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg(&record(&newer))
        .query(&mut conn)
        .unwrap();
    let args = run.tally_args(&redis.url());
    let line = error_line(&run_refused(&args));
    assert!(
        line.contains(&format!(
            "layout record {key} has format {newer}, newer than this tally knows"
        )),
        "{line}"
    );
    let url = redis.url();
    let count = strings(&["count", "1", "--redis", &url, "--prefix", &run.prefix]);
    let out = tally_with_env(&count, &[], Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("has format {newer}, newer than")),
        "{}",
        output_text(&out)
    );
    assert_eq!(hget(&mut conn, &key, "format"), Some(newer.clone()));

    // Format 1 (before epochs) is read, and raised to 2 by a writer's start.
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg(&record("1"))
        .query(&mut conn)
        .unwrap();
    let mut tally = Tally::spawn_args("tally", &args);
    wait_for(
        "the record's format raised",
        Duration::from_secs(60),
        || {
            tally.assert_running();
            (hget(&mut conn, &key, "format").as_deref() == Some("2")).then_some(())
        },
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
}

#[test]
fn a_panicking_background_task_ends_the_process_in_one_line() {
    let run = Scenario::new("e2e_running_panic", "panic", 1);
    let redis = RedisServer::start();
    for task in ["generation-follower", "registry-follower"] {
        let mut args = vec!["run".to_string()];
        args.extend(run.tally_args(&redis.url()));
        let out = tally_with_env(
            &args,
            &[("TALLY_TEST_PANIC_TASK", task)],
            Duration::from_secs(60),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{task}:\n{stderr}");
        let last = error_line(&out);
        assert!(
            last.starts_with(&format!("error: background task {task} panicked at src/"))
                && last.contains("injected failure"),
            "{last}"
        );
        // The one line is all: no panic report of its own, no backtrace note.
        assert_eq!(stderr.matches("panicked").count(), 1, "{stderr}");
        assert!(!stderr.contains("RUST_BACKTRACE"), "{stderr}");
    }
}

#[test]
fn lag_in_seconds_ages_while_the_first_batch_cannot_land() {
    let run = Scenario::new("e2e_running_lag", "lag", 1);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(["--metrics-addr".to_string(), metrics.clone()]);
    let mut tally = Tally::spawn_args("tally", &args);
    wait_for("the partition assigned", Duration::from_secs(60), || {
        tally.assert_running();
        assigned_partitions(&metrics).filter(|&n| n == 1.0)
    });
    // Redis holds every write: the partition's first batch cannot land.
    let _: () = redis::cmd("CLIENT")
        .arg(&["PAUSE", "60000", "WRITE"])
        .query(&mut conn)
        .unwrap();
    let w = run.produce_workload(run.seed, 200, 1);
    let lag = || {
        let text = try_scrape_metrics(&metrics).ok()?;
        metric_value(&text, "tally_consumer_lag_seconds{partition=\"0\"}")
    };
    let aged = wait_for(
        "the lag in seconds to reach 3 s",
        Duration::from_secs(30),
        || lag().filter(|&s| s >= 3.0),
    );
    assert!(aged < 60.0, "{aged}");
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query(&mut conn)
        .unwrap();
    run.wait_applied(&mut conn, &run.hwms(200), Duration::from_secs(60), || {
        tally.assert_running()
    });
    wait_for(
        "the lag in seconds back to 0",
        Duration::from_secs(30),
        || lag().filter(|&s| s == 0.0),
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
}

#[test]
fn every_command_that_touches_redis_reads_the_config_file() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let prefix = unique("config");
    write_layout_record(&mut conn, &prefix, 4);
    for (bucket, likes) in [(0, 5), (3, 2)] {
        let _: () = redis::cmd("SET")
            .arg(format!("{prefix}:likes:42:{bucket}"))
            .arg(likes)
            .query(&mut conn)
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tally.toml");
    // The file `tally run` reads, with its own settings too: the others take what they need.
    std::fs::write(
        &file,
        format!(
            "brokers = \"kafka:9092\"\nbuckets = 4\nredis = \"{}\"\nprefix = \"{prefix}\"\nregistry-wait-ms = 100\n",
            redis.url()
        ),
    )
    .unwrap();
    let path = file.to_str().unwrap();
    let by_flag = [("--config", path)];
    let by_env = [("TALLY_CONFIG", path)];
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let out = tally_with_env(&strings(args), env, Duration::from_secs(60));
        assert!(
            out.status.success(),
            "tally {args:?}:\n{}",
            output_text(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let likes = |json: &str| -> i64 {
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        value[0]["likes"].as_i64().unwrap()
    };
    assert_eq!(
        likes(&run(&["count", "42", "--json", "--config", path], &[])),
        7
    );
    assert_eq!(likes(&run(&["count", "42", "--json"], &by_env)), 7);
    assert!(run(&["inspect", "post", "42"], &by_env).contains(&format!("{prefix}:likes:42:3")));
    let [(flag, file)] = by_flag;
    run(&["promote", "42", "--to-buckets", "8", flag, file], &[]);
    run(&["demote", "42"], &by_env);
    run(&["rebucket", "--to-buckets", "2"], &by_env);
    assert!(run(&["gc"], &by_env).contains("generation 0 is current"));
    // A flag still beats the file.
    let out = tally_with_env(
        &strings(&["count", "42", "--config", path, "--prefix", "elsewhere"]),
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("prefix elsewhere has no layout record"),
        "{}",
        output_text(&out)
    );
    let listen = format!("127.0.0.1:{}", free_port());
    let mut serve =
        Tally::spawn_command("serve", "serve", &["--listen", &listen, "--config", path]);
    let body = wait_for("serve to answer", Duration::from_secs(30), || {
        serve.assert_running();
        http_get(&listen, "/v1/posts/42/likes")
            .ok()
            .filter(|(status, _)| *status == 200)
    });
    let value: serde_json::Value = serde_json::from_str(&body.1).unwrap();
    assert_eq!(value["likes"].as_i64(), Some(7), "{value}");
}

#[test]
fn the_kubernetes_settings_start_a_replica_after_a_rebucket() {
    let run = Scenario::new("e2e_running_scale", "scale", 2);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let dead = unique("likes-dead");
    create_topic(&dead, 1);
    let example = repo().join("deploy/k8s/tally.toml");
    let config = example.to_str().unwrap();
    // The pod's settings: the example's file, with the addresses and names of this test (the
    // Deployment sets TALLY_* variables, which beat the file as flags do).
    let mut args = vec!["--config".to_string(), config.to_string()];
    args.extend(run.tally_args(&redis.url()));
    args.extend(["--dead-letter-topic".to_string(), dead]);
    let w = Workload::generate(run.seed, 4_000, 2);
    produce(&run.brokers, &run.topic, w.messages(0..2_000));
    let mut first = Tally::spawn_args("pod-0", &args);
    run.wait_applied(
        &mut conn,
        &run.hwms(2_000),
        Duration::from_secs(120),
        || first.assert_running(),
    );

    let url = redis.url();
    let rebucket = strings(&[
        "rebucket",
        "--to-buckets",
        "4",
        "--config",
        config,
        "--redis",
        &url,
        "--prefix",
        &run.prefix,
    ]);
    let out = tally_with_env(&rebucket, &[], Duration::from_secs(60));
    assert!(out.status.success(), "{}", output_text(&out));

    // KEDA scales up: a new pod with the same settings joins.
    let mut second = Tally::spawn_args("pod-1", &args);
    wait_for("the new pod to consume", Duration::from_secs(60), || {
        second.assert_running();
        second.log_text().contains("Consuming.").then_some(())
    });
    produce(&run.brokers, &run.topic, w.messages(2_000..4_000));
    run.wait_applied(
        &mut conn,
        &run.hwms(4_000),
        Duration::from_secs(120),
        || {
            first.assert_running();
            second.assert_running();
        },
    );
    assert!(second.sigterm_and_wait(Duration::from_secs(20)).success());
    assert!(first.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
}
