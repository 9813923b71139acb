//! Both consumer group protocols on Apache Kafka: `classic` (cooperative-sticky, members agree on
//! the assignment) and `consumer` (KIP-848, the broker assigns and moves partitions one at a
//! time).
//!
//! Under each: one consumer scales to four under live traffic and back to one, and the first is
//! SIGKILLed in the middle of the rebalance the three newcomers start, with batches in hand;
//! every count ends exact, every partition is applied to its end, the broker reports the group
//! under the protocol asked for, and every assignment a member received started at the
//! partition's fence. Then a static member (`--group-instance-id`) restarts without the other
//! member seeing a rebalance, reads its fences again on the way in, and a second process with
//! the same name is stopped by the broker while the fences keep the counts exact. Settings of
//! the protocol not chosen are refused at start, and a broker without KIP-848 stops a
//! `consumer` start with one line.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::*;

/// Members of the group, with their metrics endpoint.
struct Member {
    tally: Tally,
    metrics: String,
}

impl Member {
    fn start(name: &str, base: &[String], extra: &[&str]) -> Member {
        let metrics = format!("127.0.0.1:{}", free_port());
        let mut args = base.to_vec();
        args.extend(["--metrics-addr", &metrics].map(String::from));
        args.extend(extra.iter().map(|s| s.to_string()));
        Member {
            tally: Tally::spawn_args(name, &args),
            metrics,
        }
    }

    /// Partitions owned; 0 while the endpoint does not answer yet.
    fn owned(&mut self) -> f64 {
        self.tally.assert_running();
        assigned_partitions(&self.metrics).unwrap_or(0.0)
    }

    fn rebalances(&self) -> f64 {
        let text = scrape_metrics(&self.metrics);
        metric_value(&text, "tally_rebalances_total").unwrap_or(0.0)
    }

    /// Partitions it has applied at least one batch of.
    fn applied_partitions(&self) -> usize {
        try_scrape_metrics(&self.metrics)
            .map(|text| metric_series(&text, "tally_applied_offset").len())
            .unwrap_or(0)
    }

    fn stop(&mut self) {
        let status = self.tally.sigterm_and_wait(Duration::from_secs(30));
        assert!(
            status.success(),
            "exit {status}:\n{}",
            self.tally.log_tail(30)
        );
    }
}

/// `tally run` arguments for `run` under `protocol`. The harness's session and heartbeat timing
/// are classic-protocol settings, which tally refuses under `consumer`: there the test broker's
/// group.consumer.* settings (scripts/kafka/broker) give the same 6 s and 1 s.
fn args_under(run: &Scenario, redis_url: &str, protocol: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut given = run.tally_args(redis_url).into_iter().peekable();
    while let Some(arg) = given.next() {
        let classic_only = given.peek().is_some_and(|value| {
            value.starts_with("session.timeout.ms=") || value.starts_with("heartbeat.interval.ms=")
        });
        if arg == "-X" && classic_only && protocol == "consumer" {
            given.next();
            continue;
        }
        args.push(arg);
    }
    args.extend(["--group-protocol".to_string(), protocol.to_string()]);
    args
}

/// The group's type as the broker reports it: `Classic` or `Consumer`.
fn group_type(brokers: &str, group: &str) -> String {
    let listing = kafka_tool(
        "org.apache.kafka.tools.GroupsCommand",
        &["--bootstrap-server", brokers, "--list"],
    );
    listing
        .lines()
        .find_map(|line| {
            let mut columns = line.split_whitespace();
            (columns.next() == Some(group)).then(|| columns.next().unwrap_or("").to_string())
        })
        .unwrap_or_else(|| panic!("group {group} not listed:\n{listing}"))
}

/// Every partition of every assignment a log reports, as `partition@start`.
fn assignments(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("Partitions assigned."))
        .flat_map(|l| {
            l.split("partitions=")
                .nth(1)
                .unwrap_or("")
                .split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Checks that every partition `member` was given started at a fence read at that assignment
/// (`p@offset`), not at Kafka's committed offset.
fn assert_started_at_fences(name: &str, log: &str) -> usize {
    let entries = assignments(log);
    for entry in &entries {
        let (partition, start) = entry.split_once('@').unwrap_or((entry, ""));
        assert!(
            partition.parse::<i32>().is_ok() && start.parse::<i64>().is_ok(),
            "{name} started {entry} elsewhere than at its fence; assignments: {entries:?}"
        );
    }
    entries.len()
}

fn skip_on_tansu(protocol: &str) -> bool {
    let skip = protocol == "consumer" && on_tansu();
    if skip {
        eprintln!("[e2e_protocols] skipped: Tansu 0.6 has no KIP-848 group coordinator");
    }
    skip
}

const PARTITIONS: i32 = 8;

fn scale_with_a_kill_mid_rebalance(protocol: &str) {
    if skip_on_tansu(protocol) {
        return;
    }
    let test = format!("e2e_protocols/{protocol}/scale");
    let run = Scenario::new(&test, &format!("scale-{protocol}"), PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let base = args_under(&run, &redis.url(), protocol);
    let started = Instant::now();
    let stamp = || format!("{:.1} s", started.elapsed().as_secs_f64());

    let mut first = Member::start("first", &base, &[]);
    let producer = run.stream(
        Workload::new(run.seed, PARTITIONS),
        1_000,
        Duration::from_millis(100),
    );
    wait_for(
        "first to own every partition",
        Duration::from_secs(60),
        || (first.owned() == f64::from(PARTITIONS)).then_some(()),
    );
    // Every partition has a fence before anyone else joins, so every later assignment has one
    // to start at.
    wait_for(
        "first to apply a batch of every partition",
        Duration::from_secs(30),
        || (first.applied_partitions() == PARTITIONS as usize).then_some(()),
    );
    if !on_tansu() {
        let kind = group_type(&run.brokers, &run.group);
        let expected = if protocol == "consumer" {
            "Consumer"
        } else {
            "Classic"
        };
        assert_eq!(kind, expected, "the broker's type of group {}", run.group);
    }

    // Scale 1 → 4, and kill the first member as soon as it starts giving partitions up, before
    // the newcomers own their share: its batches in flight land while others take over.
    let mut joiners: Vec<Member> = ["second", "third", "fourth"]
        .iter()
        .map(|name| Member::start(name, &base, &[]))
        .collect();
    eprintln!("[e2e_protocols] {} three members joining", stamp());
    // The newcomers are read before the first member and the kill follows at once: under the
    // consumer protocol a whole rebalance can settle within one 100 ms poll, so the state the
    // assertion below judges must be the one seen just before the kill.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (held, kept) = loop {
        let held: Vec<f64> = joiners.iter_mut().map(Member::owned).collect();
        let kept = first.owned();
        if kept < f64::from(PARTITIONS) {
            first.tally.kill9();
            break (held, kept);
        }
        assert!(
            Instant::now() < deadline,
            "timed out after 60 s waiting for the first member to give up partitions"
        );
        thread::sleep(Duration::from_millis(5));
    };
    eprintln!(
        "[e2e_protocols] {} first killed owning {kept} partitions; the newcomers owned {held:?}",
        stamp()
    );
    assert!(
        held.iter().sum::<f64>() + kept < f64::from(PARTITIONS) || held.contains(&0.0),
        "the assignment had settled before the kill: first {kept}, newcomers {held:?}"
    );

    // The group notices the death after the session timeout; the first member comes back as
    // the fourth of four.
    wait_for(
        "the three newcomers to own every partition",
        Duration::from_secs(60),
        || {
            let owned: Vec<f64> = joiners.iter_mut().map(Member::owned).collect();
            (owned.iter().sum::<f64>() == f64::from(PARTITIONS) && !owned.contains(&0.0))
                .then_some(())
        },
    );
    eprintln!("[e2e_protocols] {} three members own everything", stamp());
    let mut back = Member::start("first-again", &base, &[]);
    wait_for("four members sharing", Duration::from_secs(60), || {
        let mut owned: Vec<f64> = joiners.iter_mut().map(Member::owned).collect();
        owned.push(back.owned());
        (owned.iter().sum::<f64>() == f64::from(PARTITIONS) && !owned.contains(&0.0)).then_some(())
    });
    eprintln!("[e2e_protocols] {} four members share", stamp());
    thread::sleep(Duration::from_secs(2));

    // Scale 4 → 1: the newcomers leave together.
    for member in &mut joiners {
        member.tally.sigterm();
    }
    for member in &mut joiners {
        let status = member.tally.wait_exit(Duration::from_secs(30));
        assert!(
            status.success(),
            "exit {status}:\n{}",
            member.tally.log_tail(30)
        );
    }
    wait_for(
        "the last member to own every partition",
        Duration::from_secs(60),
        || (back.owned() == f64::from(PARTITIONS)).then_some(()),
    );
    eprintln!("[e2e_protocols] {} one member owns everything", stamp());
    thread::sleep(Duration::from_secs(1));

    let workload = producer.stop();
    let hwms = run.hwms(workload.events.len());
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        back.tally.assert_running()
    });
    run.assert_exact(&mut conn, &workload.truth);

    let mut given = 0;
    for member in joiners.iter().chain([&back]) {
        given += assert_started_at_fences(
            &member.tally.log_path().display().to_string(),
            &member.tally.log_text(),
        );
    }
    eprintln!(
        "[e2e_protocols] {protocol}: {} events exact in {}; {given} partition assignments after \
         the first, each at its fence; the last member saw {} rebalances",
        workload.events.len(),
        stamp(),
        back.rebalances()
    );
    assert!(
        given >= PARTITIONS as usize,
        "only {given} partitions assigned to later members"
    );
    back.stop();
}

fn static_member_restarts_without_a_rebalance(protocol: &str) {
    const STATIC_PARTITIONS: i32 = 4;
    if skip_on_tansu(protocol) {
        return;
    }
    let test = format!("e2e_protocols/{protocol}/static");
    let run = Scenario::new(&test, &format!("static-{protocol}"), STATIC_PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let base = args_under(&run, &redis.url(), protocol);
    let name = |member: &str| format!("{}-{member}", run.prefix);
    let (a_name, b_name) = (name("a"), name("b"));

    let mut a = Member::start("a", &base, &["--group-instance-id", &a_name]);
    wait_for("a to own every partition", Duration::from_secs(60), || {
        (a.owned() == f64::from(STATIC_PARTITIONS)).then_some(())
    });
    let producer = run.stream(
        Workload::new(run.seed, STATIC_PARTITIONS),
        500,
        Duration::from_millis(100),
    );
    let mut b = Member::start("b", &base, &["--group-instance-id", &b_name]);
    wait_for("a and b to share", Duration::from_secs(60), || {
        let (na, nb) = (a.owned(), b.owned());
        (na > 0.0 && nb > 0.0 && na + nb == f64::from(STATIC_PARTITIONS)).then_some(())
    });
    // A cooperative rebalance ends in a second round; let it end.
    thread::sleep(Duration::from_secs(3));
    let (a_owned, b_owned, a_rebalances) = (a.owned(), b.owned(), a.rebalances());

    // A rolling restart of b: same name, back within the session timeout.
    b.tally.restart();
    let restarted = Instant::now();
    wait_for(
        "b to own its partitions again",
        Duration::from_secs(30),
        || (b.owned() == b_owned).then_some(()),
    );
    eprintln!(
        "[e2e_protocols] {protocol}: b owns its {b_owned} partitions again {:.1} s after its start",
        restarted.elapsed().as_secs_f64()
    );
    // Past the 6 s session timeout: a member the broker had given up on would be gone by now,
    // and its partitions moved.
    while restarted.elapsed() < Duration::from_secs(8) {
        assert_eq!(
            a.owned(),
            a_owned,
            "a's partitions changed during b's restart"
        );
        thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        a.rebalances(),
        a_rebalances,
        "a saw a rebalance when b restarted:\n{}",
        a.tally.log_tail(20)
    );
    let fresh = assert_started_at_fences("b after its restart", &b.tally.log_text());
    assert_eq!(fresh, b_owned as usize, "b's assignments after its restart");

    // A second process under b's name: the broker stops one of the two (the old one under the
    // classic protocol, the newcomer under KIP-848), and whichever wrote last, the fences hold.
    let mut twin = Member::start("b-twin", &base, &["--group-instance-id", &b_name]);
    let fenced = wait_for(
        "one of the two b's to stop",
        Duration::from_secs(60),
        || {
            if twin.tally.try_status().is_some() {
                Some("b-twin")
            } else if b.tally.try_status().is_some() {
                Some("b")
            } else {
                None
            }
        },
    );
    eprintln!("[e2e_protocols] {protocol}: {fenced} was stopped");
    let (stopped, survivor) = if fenced == "b" {
        (&mut b, &mut twin)
    } else {
        (&mut twin, &mut b)
    };
    let stopped = &stopped.tally;
    let log = stopped.log_text();
    let last = log
        .lines()
        .rfind(|l| l.starts_with("error: "))
        .unwrap_or("");
    assert!(
        last.contains("stopped for good") && last.contains("--group-instance-id"),
        "{fenced} did not stop with a line naming --group-instance-id:\n{}",
        stopped.log_tail(20)
    );
    eprintln!("[e2e_protocols] {protocol}: {fenced}: {last}");
    let expected = if protocol == "consumer" {
        "b-twin"
    } else {
        "b"
    };
    assert_eq!(fenced, expected, "the member the broker stopped");
    thread::sleep(Duration::from_secs(2));

    let workload = producer.stop();
    let hwms = run.hwms(workload.events.len());
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(90), || {
        a.tally.assert_running();
        survivor.tally.assert_running();
    });
    run.assert_exact(&mut conn, &workload.truth);
    eprintln!(
        "[e2e_protocols] {protocol}: {} events exact",
        workload.events.len()
    );
    survivor.stop();
    a.stop();
}

#[test]
fn classic_protocol_scaling_with_a_kill_mid_rebalance_stays_exact() {
    scale_with_a_kill_mid_rebalance("classic");
}

#[test]
fn consumer_protocol_scaling_with_a_kill_mid_rebalance_stays_exact() {
    scale_with_a_kill_mid_rebalance("consumer");
}

#[test]
fn classic_protocol_static_member_restarts_without_a_rebalance() {
    static_member_restarts_without_a_rebalance("classic");
}

#[test]
fn consumer_protocol_static_member_restarts_without_a_rebalance() {
    static_member_restarts_without_a_rebalance("consumer");
}

#[test]
fn settings_of_the_other_protocol_are_refused_at_start() {
    let args = |protocol: &str, extra: &[&str]| -> Vec<String> {
        ["--brokers", "127.0.0.1:1", "--group-protocol", protocol]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let out = run_refused(&args(
        "consumer",
        &[
            "-X",
            "session.timeout.ms=6000",
            "-X",
            "partition.assignment.strategy=range",
        ],
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines,
        [
            "error: --kafka-config: session.timeout.ms does not apply to --group-protocol \
             consumer: under --group-protocol consumer the broker sets it: \
             group.consumer.session.timeout.ms (or the group's consumer.session.timeout.ms)",
            "error: --kafka-config: partition.assignment.strategy does not apply to \
             --group-protocol consumer: under --group-protocol consumer the broker assigns \
             partitions; choose its assignor with -X group.remote.assignor=uniform|range",
        ]
    );
    let line = refusal_line(&run_refused(&args(
        "classic",
        &["-X", "group.remote.assignor=uniform"],
    )));
    assert!(
        line.starts_with(
            "error: --kafka-config: group.remote.assignor does not apply to --group-protocol classic"
        ),
        "{line}"
    );
    let line = refusal_line(&run_refused(&args(
        "classic",
        &["-X", "group.protocol=consumer"],
    )));
    assert!(line.contains("--group-protocol"), "{line}");
}

#[test]
fn consumer_protocol_on_a_broker_without_it_stops_with_one_line() {
    if skip_on_tansu("consumer") {
        return;
    }
    let broker = Broker::start_with(&BrokerOptions {
        settings: vec!["group.coordinator.rebalance.protocols=classic".to_string()],
        ..BrokerOptions::default()
    });
    let run = Scenario::on(broker.addr(), "e2e_protocols/without", "without", 2);
    let redis = RedisServer::start();
    let out = run_refused(&args_under(&run, &redis.url(), "consumer"));
    let line = error_line(&out);
    assert!(
        line.contains("stopped for good") && line.contains("KIP-848"),
        "{line}"
    );
}
