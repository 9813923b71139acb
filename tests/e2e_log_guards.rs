//! The log changing under the fences, on a real broker and redis-server, each case reported
//! with a metric and a log line, and nothing counted twice or dropped unsaid:
//!
//! * a topic deleted and recreated under a running tally: the partition whose fence now lies
//!   beyond its log's end is stopped, `tally_fence_ahead_partitions` says so, an ERROR line names
//!   it, and the other partition counts the new log exactly;
//! * retention that deleted offsets while tally was stopped: the assignment reports the exact
//!   range of every partition (WARN line, `tally_offsets_skipped_total{reason="retention"}`),
//!   counts hold everything else, and `tally verify` names what it cannot recount;
//! * `tally verify` on a topic whose oldest offsets retention deleted after they were counted:
//!   it recounts from the log's start, names the ranges gone, and exits 3;
//! * retention that deleted what a dedupe window re-reads at an assignment: the range is
//!   reported for every partition (WARN line, `tally_dedupe_history_lost_offsets_total`), and
//!   what remains is counted exactly;
//! * a compacted topic (`cleanup.policy=compact`), whose cleaner would delete likes that share
//!   a key: refused at start with nothing written, and reported when set under a running
//!   consumer (ERROR line, `tally_topic_compacted`);
//! * partitions added to the topic under a running tally: each is counted from its first
//!   offset, likes produced to it before the consumer saw it included.
//!
//! Retention is made to act at once by setting the topic's `retention.ms` to 100 ms (the test
//! broker checks every 2 s) and back to unlimited once the log's start has moved.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use redis::Commands;

/// Sets `topic`'s `retention.ms` (every other topic setting goes back to the broker's default).
fn set_retention_ms(brokers: &str, topic: &str, ms: &str) {
    set_topic_config(brokers, topic, "retention.ms", ms);
}

/// Sets one setting of `topic` (every other goes back to the broker's default).
fn set_topic_config(brokers: &str, topic: &str, name: &str, value: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("create admin client");
    let config = AlterConfig::new(ResourceSpecifier::Topic(topic)).set(name, value);
    let results = futures::executor::block_on(admin.alter_configs(&[config], &AdminOptions::new()))
        .expect("alter_configs");
    for result in results {
        result.unwrap_or_else(|e| panic!("set {name} of {topic}: {e:?}"));
    }
}

/// The first offset every partition of `topic` still holds.
fn low_watermarks(brokers: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("create consumer");
    (0..partitions)
        .map(|p| {
            consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("watermarks of {topic}/{p}: {e}"))
                .0
        })
        .collect()
}

/// Lets retention delete everything `topic` holds now (`hwms`), then keeps the rest for good.
fn delete_by_retention(brokers: &str, topic: &str, hwms: &[i64]) {
    set_retention_ms(brokers, topic, "100");
    wait_for(
        "retention to delete the log",
        Duration::from_secs(60),
        || (low_watermarks(brokers, topic, hwms.len() as i32) == hwms).then_some(()),
    );
    set_retention_ms(brokers, topic, "-1");
    // One more retention check (every 2 s) with the new setting before anything new arrives.
    std::thread::sleep(Duration::from_secs(3));
}

fn merged(a: &HashMap<u64, i64>, b: &HashMap<u64, i64>) -> HashMap<u64, i64> {
    let mut out = a.clone();
    for (&post, &n) in b {
        *out.entry(post).or_insert(0) += n;
    }
    out
}

/// `workload`'s messages, all to `partition`.
fn all_to(workload: &Workload, partition: i32) -> Vec<Msg> {
    workload
        .messages(0..workload.events.len())
        .into_iter()
        .map(|(key, value, _)| (key, value, partition))
        .collect()
}

/// Lines of a log that hold every one of `parts`.
fn lines_with(log: &str, parts: &[&str]) -> Vec<String> {
    log.lines()
        .filter(|l| parts.iter().all(|p| l.contains(p)))
        .map(String::from)
        .collect()
}

/// `tally verify` with `args` (those of `tally run`).
fn verify(args: &[String]) -> std::process::Output {
    let mut all = vec!["verify"];
    all.extend(args.iter().map(String::as_str));
    tally_cli(&all)
}

#[test]
fn a_topic_recreated_under_a_running_tally_stops_only_the_partition_ahead() {
    let run = Scenario::new("e2e_log_guards_recreated", "recreated", 2);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(["--metrics-addr", &metrics].map(String::from));
    // The old log: events in partition 0 only, so partition 1 has no fence yet.
    let first = Workload::generate(run.seed, 2_000, 1);
    produce(&run.brokers, &run.topic, all_to(&first, 0));
    let mut tally = Tally::spawn_args("tally", &args);
    let old_end = first.events.len() as i64;
    run.wait_applied(&mut conn, &[old_end, 0], Duration::from_secs(60), || {
        tally.assert_running()
    });

    // The topic is replaced under the running consumer; the new log of partition 0 ends far
    // below its fence, and partition 1 starts from nothing.
    delete_topic(&run.brokers, &run.topic);
    create_topic_with(&run.brokers, &run.topic, 2, &[]);
    let second = Workload::generate(run.seed ^ 0x5ec0, 600, 1);
    let replaced = Workload::generate(run.seed ^ 0x7e0, 300, 1);
    produce(&run.brokers, &run.topic, all_to(&second, 1));
    produce(&run.brokers, &run.topic, all_to(&replaced, 0));
    let ends = run.hwms(second.events.len() + replaced.events.len());
    assert_eq!(
        ends,
        [replaced.events.len() as i64, second.events.len() as i64]
    );

    wait_for(
        "tally_fence_ahead_partitions 1",
        Duration::from_secs(60),
        || {
            tally.assert_running();
            let text = try_scrape_metrics(&metrics).ok()?;
            (metric_value(&text, "tally_fence_ahead_partitions") == Some(1.0)).then_some(())
        },
    );
    run.wait_applied(&mut conn, &[0, ends[1]], Duration::from_secs(60), || {
        tally.assert_running()
    });
    // Long enough for anything of the stopped partition to land, were it taken.
    std::thread::sleep(Duration::from_secs(3));
    tally.assert_running();
    let fences = read_fences(&mut conn, &run.prefix, &run.group, &run.topic, 2);
    assert_eq!(
        fences,
        [Some(old_end - 1), Some(ends[1] - 1)],
        "partition 0 stays at its fence; partition 1 counted its new log"
    );
    run.assert_exact(&mut conn, &merged(&first.truth, &second.truth));
    let log = tally.log_text();
    let stopped = lines_with(
        &log,
        &[
            "ERROR",
            "partition=0",
            "log ends before its fence",
            "reset-fences",
        ],
    );
    assert!(
        !stopped.is_empty(),
        "no ERROR line names partition 0:\n{}",
        tally.log_tail(40)
    );
    assert!(
        lines_with(&log, &["partition=1", "log ends before its fence"]).is_empty(),
        "partition 1 was never stopped"
    );
    eprintln!("[e2e_log_guards] {}", stopped[0]);
    let text = scrape_metrics(&metrics);
    assert_eq!(
        metric_value(&text, "tally_fence_ahead_partitions"),
        Some(1.0)
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
}

#[test]
fn offsets_retention_deleted_while_tally_was_stopped_are_reported_at_assignment() {
    const PARTITIONS: i32 = 2;
    let run = Scenario::new("e2e_log_guards_retention", "retained", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let args = run.tally_args(&redis.url());

    let first = run.produce_workload(run.seed, 1_500, PARTITIONS);
    let counted = run.hwms(first.events.len());
    let mut tally = run.spawn_applied(&mut conn, &args, &counted);
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());

    // While tally is stopped, a second wave arrives and retention deletes it unread.
    let second = run.produce_workload(run.seed ^ 0x2d, 1_000, PARTITIONS);
    let deleted = run.hwms(first.events.len() + second.events.len());
    delete_by_retention(&run.brokers, &run.topic, &deleted);
    let third = run.produce_workload(run.seed ^ 0x3d, 800, PARTITIONS);
    let total = first.events.len() + second.events.len() + third.events.len();
    let ends = run.hwms(total);

    // A port picked now: one picked before the first start could be another test's by now.
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = args.clone();
    args.extend(["--metrics-addr", &metrics].map(String::from));
    let mut tally = run.spawn_applied(&mut conn, &args, &ends);
    run.assert_exact(&mut conn, &merged(&first.truth, &third.truth));
    let skipped: i64 = (0..PARTITIONS as usize)
        .map(|p| deleted[p] - counted[p])
        .sum();
    assert_eq!(skipped, second.events.len() as i64);
    let text = scrape_metrics(&metrics);
    assert_eq!(
        metric_value(&text, "tally_offsets_skipped_total{reason=\"retention\"}"),
        Some(skipped as f64)
    );
    let log = tally.log_text();
    for p in 0..PARTITIONS as usize {
        let (from, to) = (counted[p], deleted[p] - 1);
        let lines = lines_with(
            &log,
            &[
                "WARN",
                &format!("partition={p} from={from} to={to}"),
                "Offsets deleted by retention",
            ],
        );
        assert_eq!(
            lines.len(),
            1,
            "one WARN line names partition {p}'s range {from}..={to}:\n{}",
            tally.log_tail(40)
        );
    }
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());

    // verify names what it cannot recount: everything before the log's start, which holds the
    // range skipped.
    let out = verify(&run.tally_args(&redis.url()));
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(3), "{text}");
    for (p, end) in deleted.iter().enumerate() {
        let named = format!(
            "partition {p}: offsets 0..={} were counted and are gone from the log",
            end - 1
        );
        assert!(text.contains(&named), "{named:?} not in:\n{text}");
    }
}

#[test]
fn retention_inside_the_dedupe_window_is_reported_at_assignment() {
    const PARTITIONS: i32 = 2;
    let run = Scenario::new("e2e_log_guards_history", "history", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut args = run.tally_args(&redis.url());
    args.extend(["--dedupe", "ids", "--dedupe-window", "100000"].map(String::from));
    let first = run.produce_workload(run.seed, 1_500, PARTITIONS);
    let counted = run.hwms(first.events.len());
    let mut tally = run.spawn_applied(&mut conn, &args, &counted);
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());

    // Counted, then deleted: the window of the next start would re-read all of it.
    delete_by_retention(&run.brokers, &run.topic, &counted);
    let second = run.produce_workload(run.seed ^ 0x4e, 800, PARTITIONS);
    let ends = run.hwms(first.events.len() + second.events.len());
    // A port picked now: one picked before the first start could be another test's by now.
    let metrics = format!("127.0.0.1:{}", free_port());
    args.extend(["--metrics-addr", &metrics].map(String::from));
    let mut tally = run.spawn_applied(&mut conn, &args, &ends);
    run.assert_exact(&mut conn, &merged(&first.truth, &second.truth));
    let text = scrape_metrics(&metrics);
    assert_eq!(
        metric_value(&text, "tally_dedupe_history_lost_offsets_total"),
        Some(first.events.len() as f64),
        "the window of every partition reached back to offset 0"
    );
    let log = tally.log_text();
    for (p, end) in counted.iter().enumerate() {
        let lines = lines_with(
            &log,
            &[
                "WARN",
                &format!("partition={p} from=0 to={}", end - 1),
                "dedupe window was to re-read were deleted by retention",
            ],
        );
        assert_eq!(lines.len(), 1, "partition {p}:\n{}", tally.log_tail(40));
    }
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
}

#[test]
fn verify_recounts_from_the_log_start_and_names_what_retention_deleted() {
    const PARTITIONS: i32 = 2;
    let run = Scenario::new("e2e_log_guards_verify", "vtrim", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let args = run.tally_args(&redis.url());
    let first = run.produce_workload(run.seed, 1_200, PARTITIONS);
    let counted = run.hwms(first.events.len());
    let mut tally = run.spawn_applied(&mut conn, &args, &counted);
    // Counted, then deleted by retention: the counts keep events no log holds.
    delete_by_retention(&run.brokers, &run.topic, &counted);
    let second = run.produce_workload(run.seed ^ 0x77, 900, PARTITIONS);
    let ends = run.hwms(first.events.len() + second.events.len());
    run.wait_applied(&mut conn, &ends, Duration::from_secs(60), || {
        tally.assert_running()
    });
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    let truth = merged(&first.truth, &second.truth);
    run.assert_exact(&mut conn, &truth);

    let out = verify(&args);
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(3), "{text}");
    for (p, end) in counted.iter().enumerate() {
        let named = format!(
            "partition {p}: offsets 0..={} were counted and are gone from the log",
            end - 1
        );
        assert!(text.contains(&named), "{named:?} not in:\n{text}");
    }
    // The posts checked against what remains differ exactly where the deleted events count.
    let differ = first.truth.values().filter(|&&n| n != 0).count();
    let summary = format!(
        "posts checked against {} events of {PARTITIONS} partitions; {differ} drift",
        second.events.len()
    );
    assert!(text.contains(&summary), "{summary:?} not in:\n{text}");
    assert!(
        text.contains(&format!(
            "{} offsets counted earlier are gone from the log and were not verified",
            first.events.len()
        )),
        "{text}"
    );
    assert!(
        text.contains("error: retention deleted offsets the counts hold"),
        "{text}"
    );
}

/// A topic set to `cleanup.policy=compact` is refused at start in one line, before anything is
/// written; set so under a running consumer, it is an ERROR line and `tally_topic_compacted` 1
/// until it is set back. Every count is exact.
#[test]
fn a_compacted_topic_is_refused_at_start_and_reported_while_running() {
    const PARTITIONS: i32 = 2;
    let run = Scenario::new("e2e_log_guards_compact", "compacted", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let w = run.produce_workload(run.seed, 1_500, PARTITIONS);

    set_topic_config(&run.brokers, &run.topic, "cleanup.policy", "compact");
    let line = refusal_line(&run_refused(&run.tally_args(&redis.url())));
    assert!(
        line.contains(&format!("topic {} has cleanup.policy=compact", run.topic))
            && line.contains("cleanup.policy=delete"),
        "{line}"
    );
    let written: Vec<String> = conn.keys(format!("{}*", run.prefix)).unwrap();
    assert!(written.is_empty(), "the refused start wrote {written:?}");

    set_topic_config(&run.brokers, &run.topic, "cleanup.policy", "delete");
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(["--metrics-addr", &metrics].map(String::from));
    let mut tally = run.spawn_applied(&mut conn, &args, &run.hwms(w.events.len()));
    let compacted = || metric_value(&scrape_metrics(&metrics), "tally_topic_compacted");
    assert_eq!(compacted(), Some(0.0));
    set_topic_config(&run.brokers, &run.topic, "cleanup.policy", "compact");
    wait_for(
        "the compacted topic reported",
        Duration::from_secs(40),
        || {
            tally.assert_running();
            (compacted() == Some(1.0)).then_some(())
        },
    );
    let errors = lines_with(
        &tally.log_text(),
        &[
            "ERROR",
            "cleanup.policy changed under a running tally",
            "cleanup.policy=compact",
        ],
    );
    assert_eq!(errors.len(), 1, "{}", tally.log_tail(20));
    set_topic_config(&run.brokers, &run.topic, "cleanup.policy", "delete");
    wait_for(
        "the topic seen deleting again",
        Duration::from_secs(40),
        || (compacted() == Some(0.0)).then_some(()),
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &w.truth);
}

/// Partitions added to the topic under a running consumer (`kafka-topics --alter
/// --partitions`) are assigned at the next metadata refresh (tally's default: 30 s) and
/// counted from their first offset: likes produced to them before the consumer saw them count
/// too, exactly once.
#[test]
fn partitions_added_under_a_running_tally_are_counted_from_their_start() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
    use rdkafka::client::DefaultClientContext;
    let run = Scenario::new("e2e_log_guards_grown", "grown", 2);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let first = run.produce_workload(run.seed, 1_500, 2);
    // tally's own metadata refresh (30 s) finds the new partitions.
    let args = run.tally_args(&redis.url());
    let mut tally = run.spawn_applied(&mut conn, &args, &run.hwms(first.events.len()));

    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &run.brokers)
        .create()
        .expect("create admin client");
    let grown = futures::executor::block_on(
        admin.create_partitions(&[NewPartitions::new(&run.topic, 4)], &AdminOptions::new()),
    )
    .expect("create_partitions");
    for result in grown {
        result.unwrap_or_else(|e| panic!("grow {}: {e:?}", run.topic));
    }
    let second = run.produce_workload(run.seed ^ 0x4a7, 2_000, 4);
    let hwms = run.hwms(first.events.len() + second.events.len());
    assert_eq!(hwms.len(), 4, "{hwms:?}");
    assert!(
        hwms[2] > 0 && hwms[3] > 0,
        "new partitions hold likes: {hwms:?}"
    );
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(90), || {
        tally.assert_running()
    });
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    run.assert_exact(&mut conn, &merged(&first.truth, &second.truth));
}
