//! Producers whose clocks are wrong: among live traffic, one like stamped a day ahead and one
//! stamped a thousand years ahead, on a single server and on a 3-primary cluster. Nothing
//! waits for either: every other event is counted within seconds. The day-ahead like is
//! counted (on a cluster after routing was made final up to its time, which the gauge shows);
//! the thousand-year one is dead-lettered as `timestamp_out_of_range`, the fixed rule for
//! timestamps past 2100. On the cluster a rebuild from the topic gives the same counts, and a
//! generation pointer set back by hand afterwards (a failover that lost the switch) is not
//! followed: the live writer keeps writing the newer generation.
//!
//! A like stamped in 2099 on a cluster freezes routing until 2099: `tally promote` and
//! `tally rebucket` refuse. `tally unfreeze-routing`, run while two consumers (one refreshing its
//! routing every 100 ms, one every 2 s) count live traffic, lets a promotion take effect within
//! seconds; a consumer SIGKILLed after it replays across it, every count is exact, and a rebuild
//! replays the 2099 like by the routing it was counted with, without freezing routing again.

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
    let more = run.produce_workload(run.seed ^ 0x9, 400, PARTITIONS);
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

/// 2099-06-01, in the last year before timestamps are dead-lettered.
const YEAR_2099_MS: i64 = 4_083_955_200_000;

/// The registry's `final` time under `prefix`, read from the cluster.
fn final_time(cluster: &RedisCluster, prefix: &str) -> i64 {
    let node = format!("redis://127.0.0.1:{}/", cluster.primaries()[0].0);
    let mut conn = redis::cluster::ClusterClient::new(vec![node])
        .unwrap()
        .get_connection()
        .unwrap();
    let value: Option<i64> = redis::cmd("HGET")
        .arg(format!("{prefix}:routes"))
        .arg("final")
        .query(&mut conn)
        .unwrap();
    value.unwrap_or(0)
}

/// `tally <command> <args>` against the run's store; the finished command's output.
fn one_shot(command: &str, args: &[&str], store: &[String]) -> std::process::Output {
    let mut all: Vec<&str> = vec![command];
    all.extend(args);
    all.extend(store.iter().map(String::as_str));
    tally_cli(&all)
}

#[test]
fn an_unfreeze_under_traffic_lets_routing_change_and_keeps_every_count() {
    const HOT: u64 = 900_000_010;
    const STAMPED_2099: u64 = 900_000_011;
    let cluster = RedisCluster::start(3, 0);
    let run = Scenario::with_topic(
        &brokers(),
        "e2e_future_unfreeze",
        "unfreeze",
        PARTITIONS,
        &[ANY_PRODUCER_CLOCK],
    );
    let dlq = dead_letter_topic(&run);
    let groups = GROUPS.to_string();
    // Detection off: the hot post changes routing only when the test promotes it.
    let extra = ["--slot-groups", groups.as_str(), "--promote-above", "0"];
    let consumer = |name: &str, refresh_ms: &str, metrics: &str| {
        let mut extra = extra.to_vec();
        extra.extend(["--route-refresh-ms", refresh_ms]);
        Tally::spawn_args(name, &args(&run, &cluster.url(), &dlq, metrics, &extra))
    };
    let (fast_metrics, slow_metrics) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let mut fast = consumer("fast-cache", "100", &fast_metrics);
    let mut slow = consumer("slow-cache", "2000", &slow_metrics);
    let store: Vec<String> = ["--redis", &cluster.url(), "--prefix", &run.prefix]
        .map(String::from)
        .to_vec();
    let mut full: Vec<String> = run.tally_args(&cluster.url());
    full.extend(extra.iter().map(|s| s.to_string()));
    let full: Vec<&str> = full.iter().map(String::as_str).collect();
    let hot_post = HOT.to_string();

    let background = run.stream(
        Workload::new(run.seed, PARTITIONS),
        200,
        Duration::from_millis(100),
    );
    let hot = run.hot_likes(
        HOT,
        20,
        PARTITIONS,
        Duration::from_millis(100),
        run.seed ^ 3,
    );
    thread::sleep(Duration::from_secs(2));
    let now = now_ms();
    produce_stamped(
        &run.brokers,
        &run.topic,
        2,
        &encode_like(STAMPED_2099, 7, LIKE, now),
        YEAR_2099_MS,
    );
    wait_for("routing to freeze", Duration::from_secs(20), || {
        fast.assert_running();
        let ahead = metric_value(
            &scrape_metrics(&fast_metrics),
            "tally_routing_final_ahead_seconds",
        )?;
        (ahead > 50.0 * 365.0 * 86_400.0).then_some(())
    });

    // Frozen: a routing change would take effect only in 2099, so it is refused.
    for (command, change) in [
        ("promote", vec![hot_post.as_str(), "--to-buckets", "8"]),
        ("rebucket", vec!["--to-buckets", "4"]),
    ] {
        let out = one_shot(command, &change, &store);
        let said = output_text(&out);
        assert!(!out.status.success(), "{command} while frozen: {said}");
        assert!(
            said.contains("routing is frozen until 2099-06-01")
                && said.contains("tally unfreeze-routing"),
            "{command} while frozen: {said}"
        );
    }

    // The unfreeze, while both consumers count and the producers go on.
    let began = Instant::now();
    let out = tally_cli(&[&["unfreeze-routing"][..], &full].concat());
    let said = output_text(&out);
    assert!(out.status.success(), "unfreeze-routing: {said}");
    assert!(
        said.contains("routing is frozen until 2099-06-01"),
        "{said}"
    );
    eprintln!(
        "[e2e_future] unfroze in {:.1} s: {}",
        began.elapsed().as_secs_f64(),
        said.trim()
    );
    // A promotion takes effect within seconds, and the hot post's new keys fill.
    let out = one_shot("promote", &[hot_post.as_str(), "--to-buckets", "8"], &store);
    let said = output_text(&out);
    assert!(out.status.success(), "promote after the unfreeze: {said}");
    let effective_in: f64 = said
        .split("(in ")
        .nth(1)
        .and_then(|rest| rest.split(" s)").next())
        .and_then(|secs| secs.parse().ok())
        .unwrap_or_else(|| panic!("no effective time in: {said}"));
    assert!(
        effective_in < 10.0,
        "the promotion takes effect in {effective_in} s"
    );
    // Not frozen any more: a second unfreeze has nothing to undo.
    let again = tally_cli(&[&["unfreeze-routing"][..], &full].concat());
    assert!(
        error_line(&again).contains("routing is not frozen"),
        "{}",
        output_text(&again)
    );

    let promoted = format!("{}:likes:{HOT}:v1:*", run.prefix);
    wait_for(
        "the promoted version's keys",
        Duration::from_secs(20),
        || {
            fast.assert_running();
            slow.assert_running();
            (cluster.scan(&promoted).len() > 1).then_some(())
        },
    );
    // A consumer killed now: its partitions are replayed, across the unfreeze and the promotion,
    // by the other one.
    slow.kill9();
    thread::sleep(Duration::from_secs(2));

    let workload = background.stop();
    let hot_likes = hot.stop();
    let mut truth = workload.truth.clone();
    *truth.entry(HOT).or_insert(0) += hot_likes as i64;
    truth.insert(STAMPED_2099, 1);
    let hwms = run.hwms(workload.events.len() + hot_likes as usize + 1);
    cluster.wait_applied(
        &run.prefix,
        &run.group,
        &run.topic,
        &hwms,
        GROUPS,
        Duration::from_secs(30),
        || fast.assert_running(),
    );
    assert_counts_eq(&cluster.read_counts(&run.prefix), &truth);
    let text = scrape_metrics(&fast_metrics);
    assert_eq!(metric_value(&text, "tally_routing_unfreezes"), Some(1.0));
    let ahead = metric_value(&text, "tally_routing_final_ahead_seconds").unwrap();
    assert!(
        ahead < 600.0,
        "routing is final {ahead} s ahead after the unfreeze"
    );
    assert!(
        fast.log_text().contains("Routing was unfrozen"),
        "the unfreeze is logged"
    );

    // A recount of the whole topic routes the 2099 like as it was counted: by the unfreeze's
    // record, without making routing final up to 2099 in the new generation.
    let mut rebuild = Tally::spawn_command("rebuild", "rebuild", &full);
    let status = wait_for("the rebuild to finish", Duration::from_secs(120), || {
        fast.assert_running();
        rebuild.try_status()
    });
    assert!(status.success(), "rebuild:\n{}", rebuild.log_tail(40));
    let g1 = format!("{}:g1", run.prefix);
    assert_counts_eq(&cluster.read_counts(&g1), &truth);
    let final_g1 = final_time(&cluster, &g1);
    assert!(
        final_g1 < now_ms() + 600_000,
        "the rebuild froze routing again: final {final_g1}"
    );
    assert!(fast.sigterm_and_wait(Duration::from_secs(30)).success());
}
