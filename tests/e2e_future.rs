//! Producers whose clocks are wrong: among live traffic, one like stamped a day ahead and one
//! stamped a thousand years ahead, on a single server and on a 3-primary cluster. Nothing
//! waits for either: every other event is counted within seconds. The day-ahead like is
//! counted (on a cluster after routing was made final up to its time, which the gauge shows);
//! the thousand-year one is dead-lettered as `timestamp_out_of_range`, the fixed rule for
//! timestamps past 2100. On the cluster a rebuild from the topic gives the same counts, and a
//! generation pointer set back by hand afterwards (a failover that lost the switch) is not
//! followed: the live writer keeps writing the newer generation.

mod cluster;
mod common;

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use cluster::RedisCluster;
use common::*;

const PARTITIONS: i32 = 4;
const GROUPS: usize = 16;
const DAY_MS: i64 = 86_400_000;

/// Produces the two wrongly stamped likes in the middle of a stream of ordinary traffic and
/// returns the truth, with the dead-letter topic's name and the offset of the thousand-year one.
fn traffic(run: &Scenario) -> (Workload, HashMap<u64, i64>, i64) {
    let stream = run.stream(
        Workload::new(run.seed, PARTITIONS),
        500,
        Duration::from_millis(100),
    );
    thread::sleep(Duration::from_secs(3));
    let (day_post, ages_post) = (900_000_001, 900_000_002);
    let now = now_ms();
    produce_stamped(
        &run.brokers,
        &run.topic,
        0,
        &encode_like(day_post, 7, LIKE, now),
        now + DAY_MS,
    );
    let ages = produce_stamped(
        &run.brokers,
        &run.topic,
        1,
        &encode_like(ages_post, 7, LIKE, now),
        now + 1_000 * 365 * DAY_MS,
    );
    thread::sleep(Duration::from_secs(3));
    let workload = stream.stop();
    let mut truth = workload.truth.clone();
    truth.insert(day_post, 1);
    (workload, truth, ages)
}

fn dead_letter_topic(run: &Scenario) -> String {
    let topic = format!("{}-dlq", run.topic);
    create_topic_on(&run.brokers, &topic, 1);
    topic
}

/// The dead-letter topic holds exactly the thousand-year like, with its reason.
fn assert_dead_lettered(run: &Scenario, dlq: &str, offset: i64) {
    let letters = read_topic(&run.brokers, dlq, Duration::from_secs(30));
    assert_eq!(letters.len(), 1, "one dead letter");
    let letter = &letters[0];
    assert_eq!(
        header_str(letter, "tally-reason").as_deref(),
        Some("timestamp_out_of_range")
    );
    assert_eq!(
        header_str(letter, "tally-source-offset").as_deref(),
        Some(offset.to_string().as_str())
    );
}

fn args(run: &Scenario, url: &str, dlq: &str, metrics: &str, extra: &[&str]) -> Vec<String> {
    let mut args = run.tally_args(url);
    args.extend(
        ["--dead-letter-topic", dlq, "--metrics-addr", metrics]
            .iter()
            .chain(extra)
            .map(|s| s.to_string()),
    );
    args
}

#[test]
fn wrong_clocks_stall_nothing_on_one_server() {
    let run = Scenario::with_topic(
        &brokers(),
        "e2e_future_single",
        "future1",
        PARTITIONS,
        &[ANY_PRODUCER_CLOCK],
    );
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let dlq = dead_letter_topic(&run);
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut tally = Tally::spawn_args("tally", &args(&run, &redis.url(), &dlq, &metrics, &[]));
    let (workload, truth, ages) = traffic(&run);
    let produced = Instant::now();
    run.wait_applied(
        &mut conn,
        &run.hwms(workload.events.len() + 2),
        Duration::from_secs(30),
        || tally.assert_running(),
    );
    eprintln!(
        "[e2e_future] applied {:.1} s after the last event",
        produced.elapsed().as_secs_f64()
    );
    run.assert_exact(&mut conn, &truth);
    assert_dead_lettered(&run, &dlq, ages);
    let text = scrape_metrics(&metrics);
    assert!(metric_value(&text, "tally_future_events_total").unwrap_or(0.0) >= 1.0);
    assert_eq!(
        metric_value(&text, "tally_routing_final_ahead_seconds"),
        Some(0.0),
        "a single server never makes routing final"
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
}

#[test]
fn wrong_clocks_stall_nothing_on_a_cluster_and_a_rebuild_agrees() {
    let cluster = RedisCluster::start(3, 0);
    let run = Scenario::with_topic(
        &brokers(),
        "e2e_future_cluster",
        "future3",
        PARTITIONS,
        &[ANY_PRODUCER_CLOCK],
    );
    let dlq = dead_letter_topic(&run);
    let metrics = format!("127.0.0.1:{}", free_port());
    let groups = GROUPS.to_string();
    let extra = ["--slot-groups", groups.as_str()];
    let live = args(&run, &cluster.url(), &dlq, &metrics, &extra);
    let mut tally = Tally::spawn_args("tally", &live);
    let (workload, truth, ages) = traffic(&run);
    let produced = Instant::now();
    let hwms = run.hwms(workload.events.len() + 2);
    cluster.wait_applied(
        &run.prefix,
        &run.group,
        &run.topic,
        &hwms,
        GROUPS,
        Duration::from_secs(30),
        || tally.assert_running(),
    );
    eprintln!(
        "[e2e_future] applied {:.1} s after the last event",
        produced.elapsed().as_secs_f64()
    );
    assert_counts_eq(&cluster.read_counts(&run.prefix), &truth);
    assert_dead_lettered(&run, &dlq, ages);
    let ahead = metric_value(
        &scrape_metrics(&metrics),
        "tally_routing_final_ahead_seconds",
    )
    .expect("the final-time gauge");
    assert!(
        ahead > 0.9 * (DAY_MS / 1000) as f64,
        "routing is final a day ahead: {ahead} s"
    );
    assert!(
        tally
            .log_text()
            .contains("routing is now final up to its time"),
        "the raise is logged"
    );

    // A recount of the whole topic, with the registry copied, routes every event the same way.
    let mut rebuild_args: Vec<String> = run.tally_args(&cluster.url());
    rebuild_args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = rebuild_args.iter().map(String::as_str).collect();
    let mut rebuild = Tally::spawn_command("rebuild", "rebuild", &refs);
    let status = wait_for("the rebuild to finish", Duration::from_secs(240), || {
        tally.assert_running();
        rebuild.try_status()
    });
    assert!(status.success(), "rebuild:\n{}", rebuild.log_tail(40));
    let g1 = format!("{}:g1", run.prefix);
    assert_counts_eq(&cluster.read_counts(&g1), &truth);

    // A failover that lost the switch: the pointer names generation 0 again. The live writer
    // does not follow it back; it keeps writing generation 1, which readers read.
    let node = format!("redis://127.0.0.1:{}/", cluster.primaries()[0].0);
    let mut conn = redis::cluster::ClusterClient::new(vec![node])
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(format!("{}:generation", run.prefix))
        .arg("current")
        .arg(0)
        .query(&mut conn)
        .unwrap();
    thread::sleep(Duration::from_secs(3));
    let more = Workload::generate(run.seed ^ 0x9, 400, PARTITIONS);
    produce(
        &run.brokers,
        &run.topic,
        more.messages(0..more.events.len()),
    );
    let hwms = run.hwms(workload.events.len() + 2 + more.events.len());
    cluster.wait_applied(
        &g1,
        &run.group,
        &run.topic,
        &hwms,
        GROUPS,
        Duration::from_secs(60),
        || tally.assert_running(),
    );
    let mut both = truth.clone();
    for (&post, &n) in &more.truth {
        *both.entry(post).or_insert(0) += n;
    }
    assert_counts_eq(&cluster.read_counts(&g1), &both);
    assert_counts_eq(&cluster.read_counts(&run.prefix), &truth);
    assert!(
        tally
            .log_text()
            .contains("The generation pointer went back"),
        "the refusal is logged"
    );
    let text = scrape_metrics(&metrics);
    assert!(metric_value(&text, "tally_generation_backwards_total").unwrap_or(0.0) >= 1.0);
    assert!(tally.sigterm_and_wait(Duration::from_secs(30)).success());
}
