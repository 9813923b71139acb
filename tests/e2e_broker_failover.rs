//! Broker failover: a 3-node KRaft cluster (every node a broker and a controller) loses first the
//! node that leads most of the topic's partitions, then the active controller, each SIGKILLed
//! while a producer keeps sending and `tally run` keeps counting. Each killed node is started
//! again, and the partitions are fully replicated again, before the next kill, so two nodes
//! always run and `min.insync.replicas` 2 keeps taking writes. Every count must end exact, every
//! partition applied to its end. tally's lag gauges, `/readyz` and the fences in Redis are sampled
//! four times a second throughout, so the run also shows what a failover looks like from outside:
//! how long partitions stood still, how far the lag rose, what readiness said.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::*;
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use tally::infra::metrics::{
    ASSIGNED_PARTITIONS, CONSUMER_LAG, CONSUMER_LAG_SECONDS, READY, REBALANCES, STAGE_SECONDS,
};

const PARTITIONS: i32 = 6;
const NODES: u32 = 3;
/// Events are sent at about CHUNK / PAUSE without waiting for earlier acknowledgements, as a
/// service producing likes does: what a leaderless partition cannot take waits in the producer's
/// queue and arrives when a new leader is elected.
const CHUNK: usize = 300;
const PAUSE: Duration = Duration::from_millis(100);
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// Long enough for a node to be fenced (broker.session.timeout.ms, 9 s) and a new leader to
/// take over; longer than that and the run is stuck.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(60);

/// Acknowledgements per partition, counted by librdkafka's delivery callback.
struct Acks {
    delivered: Arc<Vec<AtomicU64>>,
    failures: Arc<Mutex<Vec<String>>>,
}

impl ClientContext for Acks {}

impl ProducerContext for Acks {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(m) => {
                self.delivered[m.partition() as usize].fetch_add(1, Ordering::SeqCst);
            }
            Err((e, m)) => self
                .failures
                .lock()
                .unwrap()
                .push(format!("partition {}: {e}", m.partition())),
        }
    }
}

/// A producer thread sending a growing workload through one idempotent `acks=all` producer.
struct Feed {
    stop: Arc<AtomicBool>,
    delivered: Arc<Vec<AtomicU64>>,
    handle: JoinHandle<Workload>,
}

impl Feed {
    fn start(brokers: &str, topic: &str, mut workload: Workload) -> Feed {
        let stop = Arc::new(AtomicBool::new(false));
        let delivered: Arc<Vec<AtomicU64>> =
            Arc::new((0..PARTITIONS).map(|_| AtomicU64::new(0)).collect());
        let failures = Arc::new(Mutex::new(Vec::new()));
        let acks = Acks {
            delivered: delivered.clone(),
            failures: failures.clone(),
        };
        let producer: ThreadedProducer<Acks> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            .set("compression.type", "lz4")
            .set("queue.buffering.max.messages", "200000")
            // Events for a partition without a leader are retried until one is elected, never
            // given up: the truth counts every event sent.
            .set("message.timeout.ms", "300000")
            .create_with_context(acks)
            .expect("create producer");
        let (topic, flag) = (topic.to_string(), stop.clone());
        let handle = thread::spawn(move || {
            let mut last = false;
            while !last {
                last = flag.load(Ordering::SeqCst);
                let range = workload.grow(CHUNK);
                for (partition, value) in &workload.events[range] {
                    let mut record = BaseRecord::<(), _>::to(&topic)
                        .payload(value)
                        .partition(*partition);
                    loop {
                        match producer.send(record) {
                            Ok(()) => break,
                            Err((
                                KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull),
                                r,
                            )) => {
                                record = r;
                                thread::sleep(Duration::from_millis(10));
                            }
                            Err((e, _)) => panic!("produce to {topic}: {e}"),
                        }
                    }
                }
                thread::sleep(PAUSE);
            }
            producer
                .flush(Duration::from_secs(300))
                .expect("every event acknowledged within 300 s");
            let failures = failures.lock().unwrap();
            assert!(
                failures.is_empty(),
                "{} deliveries failed, first: {:?}",
                failures.len(),
                failures.first()
            );
            workload
        });
        Feed {
            stop,
            delivered,
            handle,
        }
    }

    /// Stops sending, waits for every acknowledgement and returns the workload sent.
    fn stop(self) -> Workload {
        self.stop.store(true, Ordering::SeqCst);
        let w = self.handle.join().expect("producer thread");
        let acked: u64 = self
            .delivered
            .iter()
            .map(|d| d.load(Ordering::SeqCst))
            .sum();
        assert_eq!(acked, w.events.len() as u64, "acknowledged events");
        w
    }
}

/// What the sampler saw at one moment.
struct Sample {
    /// Seconds since the producer started.
    at: f64,
    /// Offsets applied per partition (fence + 1).
    applied: Vec<i64>,
    /// Events the brokers acknowledged per partition.
    delivered: Vec<u64>,
    /// `tally_consumer_lag_messages` per partition (None: no series).
    lag: Vec<Option<f64>>,
    /// The largest `tally_consumer_lag_seconds` of any partition.
    lag_seconds: Option<f64>,
    ready: Option<f64>,
    /// Batches whose first message reached the consumer more than SLOW seconds after it was
    /// produced (from the `fetch` stage of `tally_stage_seconds`).
    slow_fetches: Option<f64>,
    rebalances: Option<f64>,
    assigned: Option<f64>,
    /// The status of `/readyz` and its failing lines, or why it did not answer.
    readyz: Result<(u16, String), String>,
}

impl Sample {
    fn max_lag(&self) -> Option<f64> {
        self.lag.iter().flatten().copied().reduce(f64::max)
    }
}

/// Series of `name` by partition label.
fn by_partition(text: &str, name: &str) -> Vec<Option<f64>> {
    let mut out = vec![None; PARTITIONS as usize];
    for (labels, v) in metric_series(text, name) {
        let p = labels
            .strip_prefix("{partition=\"")
            .and_then(|l| l.strip_suffix("\"}"))
            .and_then(|p| p.parse::<usize>().ok());
        if let Some(p) = p.filter(|&p| p < out.len()) {
            out[p] = Some(v);
        }
    }
    out
}

/// The bucket bound of the `fetch` stage above which a like waited visibly long.
const SLOW: &str = "2.5";

fn slow_fetches(text: &str) -> Option<f64> {
    let all = metric_value(text, &format!("{STAGE_SECONDS}_count{{stage=\"fetch\"}}"))?;
    let quick = metric_value(
        text,
        &format!("{STAGE_SECONDS}_bucket{{stage=\"fetch\",le=\"{SLOW}\"}}"),
    )?;
    Some(all - quick)
}

struct Sampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Vec<Sample>>,
}

impl Sampler {
    fn start(
        run: &Scenario,
        redis_url: &str,
        metrics_addr: &str,
        feed: &Feed,
        start: Instant,
    ) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let (prefix, group, topic) = (run.prefix.clone(), run.group.clone(), run.topic.clone());
        let (addr, delivered, flag) = (
            metrics_addr.to_string(),
            feed.delivered.clone(),
            stop.clone(),
        );
        let mut conn = redis::Client::open(redis_url)
            .expect("redis url")
            .get_connection()
            .expect("connect to redis");
        let handle = thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::SeqCst) {
                let at = start.elapsed().as_secs_f64();
                let applied =
                    applied_offsets(&mut conn, &prefix, &group, &topic, PARTITIONS as usize);
                let delivered = delivered.iter().map(|d| d.load(Ordering::SeqCst)).collect();
                let text = try_scrape_metrics(&addr).unwrap_or_default();
                let readyz = http_get(&addr, "/readyz")
                    .map(|(status, body)| {
                        let failing: Vec<&str> =
                            body.lines().filter(|l| l.starts_with("FAIL")).collect();
                        (status, failing.join("; "))
                    })
                    .map_err(|e| e.to_string());
                samples.push(Sample {
                    at,
                    applied,
                    delivered,
                    lag: by_partition(&text, CONSUMER_LAG),
                    lag_seconds: by_partition(&text, CONSUMER_LAG_SECONDS)
                        .into_iter()
                        .flatten()
                        .reduce(f64::max),
                    ready: metric_value(&text, READY),
                    slow_fetches: slow_fetches(&text),
                    rebalances: metric_value(&text, REBALANCES),
                    assigned: metric_value(&text, ASSIGNED_PARTITIONS),
                    readyz,
                });
                thread::sleep(SAMPLE_EVERY);
            }
            samples
        });
        Sampler { stop, handle }
    }

    fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.join().expect("sampler thread")
    }
}

/// One partition as the brokers' metadata shows it.
#[derive(Debug)]
struct PartitionView {
    id: i32,
    leader: i32,
    replicas: usize,
    in_sync: usize,
}

/// Every partition of `topic` (or of every topic, internal ones included), as the brokers'
/// metadata says now.
fn partitions(client: &BaseConsumer, topic: Option<&str>) -> Option<Vec<PartitionView>> {
    let md = client.fetch_metadata(topic, Duration::from_secs(5)).ok()?;
    let mut out = Vec::new();
    for t in md.topics() {
        if t.error().is_some() {
            return None;
        }
        out.extend(t.partitions().iter().map(|p| PartitionView {
            id: p.id(),
            leader: p.leader(),
            replicas: p.replicas().len(),
            in_sync: p.isr().len(),
        }));
    }
    Some(out)
}

/// The leader of each partition of `topic`, by partition.
fn leaders(client: &BaseConsumer, topic: &str) -> Option<Vec<i32>> {
    let mut view = partitions(client, Some(topic))?;
    view.sort_by_key(|p| p.id);
    (view.len() == PARTITIONS as usize).then(|| view.iter().map(|p| p.leader).collect())
}

/// Waits until no partition of `topic` is led by `node` nor without a leader.
fn wait_leaders_moved(client: &BaseConsumer, topic: &str, node: u32) -> Vec<i32> {
    wait_for(
        &format!("every partition led by a node other than {node}"),
        FAILOVER_TIMEOUT,
        || leaders(client, topic).filter(|l| l.iter().all(|&n| n >= 0 && n != node as i32)),
    )
}

/// Waits until every partition of every topic has all its replicas in sync again, so the next
/// kill leaves `min.insync.replicas` in sync.
fn wait_fully_replicated(client: &BaseConsumer) {
    wait_for(
        "every partition of every topic fully in sync",
        Duration::from_secs(90),
        || {
            let view = partitions(client, None)?;
            let synced = view
                .iter()
                .all(|p| p.leader >= 0 && p.in_sync == p.replicas);
            (!view.is_empty() && synced).then_some(())
        },
    );
}

/// Waits until every partition has applied beyond what it had applied at `before`.
fn wait_every_partition_advanced(conn: &mut redis::Connection, run: &Scenario, tally: &mut Tally) {
    let before = applied_offsets(
        conn,
        &run.prefix,
        &run.group,
        &run.topic,
        PARTITIONS as usize,
    );
    wait_for(
        "every partition to apply new events",
        FAILOVER_TIMEOUT,
        || {
            tally.assert_running();
            let now = applied_offsets(
                conn,
                &run.prefix,
                &run.group,
                &run.topic,
                PARTITIONS as usize,
            );
            now.iter().zip(&before).all(|(n, b)| n > b).then_some(())
        },
    );
}

/// The longest time `value` stood still within `from..to`, in seconds (stretches cut at the
/// window's edges).
fn longest_flat(samples: &[Sample], from: f64, to: f64, value: impl Fn(&Sample) -> i64) -> f64 {
    let mut longest = 0.0f64;
    let mut flat: Option<(f64, i64)> = None;
    for s in samples.iter().filter(|s| s.at <= to) {
        let v = value(s);
        match flat {
            Some((since, current)) if current == v => {
                longest = longest.max(s.at - since.max(from));
            }
            _ => flat = Some((s.at, v)),
        }
    }
    longest
}

/// What one stretch of the run looked like.
struct Window {
    name: &'static str,
    from: f64,
    to: f64,
}

/// What the samples of one window show.
#[derive(Debug)]
struct Seen {
    /// The longest time a partition applied nothing, in seconds.
    stalled: f64,
    /// The longest time a partition got no acknowledgement, in seconds.
    unacked: f64,
    /// The highest `tally_consumer_lag_messages` of any partition.
    lag: f64,
    /// The highest `tally_consumer_lag_seconds` of any partition.
    lag_seconds: f64,
    /// Batches whose first message waited more than SLOW seconds.
    slow_fetches: f64,
    rebalances: f64,
    /// The fewest partitions the consumer owned.
    fewest_assigned: f64,
    /// Each distinct `/readyz` answer (status and failing lines) with its first time.
    readiness: Vec<(f64, String)>,
}

/// The growth of a counter over the window.
fn growth(inside: &[&Sample], counter: impl Fn(&Sample) -> Option<f64>) -> f64 {
    let values: Vec<f64> = inside.iter().filter_map(|s| counter(s)).collect();
    match (values.first(), values.last()) {
        (Some(a), Some(b)) => b - a,
        _ => 0.0,
    }
}

fn seen(samples: &[Sample], w: &Window) -> Seen {
    let inside: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at >= w.from && s.at <= w.to)
        .collect();
    let mut readiness: Vec<(f64, String)> = Vec::new();
    for s in &inside {
        let answer = match &s.readyz {
            Ok((status, failing)) if failing.is_empty() => format!("{status}"),
            Ok((status, failing)) => format!("{status} {failing}"),
            Err(e) => format!("no answer: {e}"),
        };
        let answer = format!("{answer} (tally_ready {:?})", s.ready);
        if readiness.last().is_none_or(|(_, last)| *last != answer) {
            readiness.push((s.at, answer));
        }
    }
    let seen = Seen {
        stalled: (0..PARTITIONS as usize)
            .map(|p| longest_flat(samples, w.from, w.to, |s| s.applied[p]))
            .fold(0.0, f64::max),
        unacked: (0..PARTITIONS as usize)
            .map(|p| longest_flat(samples, w.from, w.to, |s| s.delivered[p] as i64))
            .fold(0.0, f64::max),
        lag: inside
            .iter()
            .filter_map(|s| s.max_lag())
            .fold(0.0, f64::max),
        lag_seconds: inside
            .iter()
            .filter_map(|s| s.lag_seconds)
            .fold(0.0, f64::max),
        slow_fetches: growth(&inside, |s| s.slow_fetches),
        rebalances: growth(&inside, |s| s.rebalances),
        fewest_assigned: inside
            .iter()
            .filter_map(|s| s.assigned)
            .fold(f64::from(PARTITIONS), f64::min),
        readiness,
    };
    eprintln!(
        "[e2e_broker_failover] {} ({:.1}..{:.1} s): a partition applied nothing for up to \
         {:.1} s and got no acknowledgement for up to {:.1} s; max {CONSUMER_LAG} {}, max \
         {CONSUMER_LAG_SECONDS} {:.1}; {} batches fetched after more than {SLOW} s; {} \
         rebalances, at least {} partitions owned; /readyz: {:?}",
        w.name,
        w.from,
        w.to,
        seen.stalled,
        seen.unacked,
        seen.lag,
        seen.lag_seconds,
        seen.slow_fetches,
        seen.rebalances,
        seen.fewest_assigned,
        seen.readiness
    );
    seen
}

#[test]
fn counts_stay_exact_through_leader_and_controller_failover() {
    let mut cluster = Broker::start_cluster(NODES);
    let brokers = cluster.addr().to_string();
    let run = Scenario::with_topic(
        &brokers,
        "e2e_broker_failover",
        "failover",
        PARTITIONS,
        &[("min.insync.replicas", "2")],
    );
    let meta: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("create metadata client");
    let view = partitions(&meta, Some(&run.topic)).expect("topic metadata");
    assert!(
        view.iter().all(|p| p.replicas == NODES as usize),
        "every partition replicated {NODES} times: {view:?}"
    );
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    // librdkafka's own session timeout (45 s) in place of the harness's quick 6 s: a consumer
    // deployed with its defaults rides out the 9 s a dead broker takes to be fenced without
    // leaving its group, and a rebalance is not what this test measures.
    args.extend(
        [
            "--metrics-addr",
            &metrics_addr,
            "-X",
            "session.timeout.ms=45000",
            "-X",
            "heartbeat.interval.ms=3000",
        ]
        .map(String::from),
    );
    let mut tally = Tally::spawn_args("tally", &args);

    let start = Instant::now();
    let at = || start.elapsed().as_secs_f64();
    let feed = Feed::start(&brokers, &run.topic, Workload::new(run.seed, PARTITIONS));
    let sampler = Sampler::start(&run, &redis.url(), &metrics_addr, &feed, start);
    wait_every_partition_advanced(&mut conn, &run, &mut tally);
    let steady = at();
    // A stretch of normal running to compare the failovers with.
    thread::sleep(Duration::from_secs(6));

    let leaders_before = leaders(&meta, &run.topic).expect("leaders");
    let controller_before = cluster.active_controller();
    let first = (1..=NODES)
        .max_by_key(|&n| {
            let led = leaders_before.iter().filter(|&&l| l == n as i32).count();
            // Among nodes leading as many partitions, prefer one that is not the controller, so
            // the two kills hit two roles on two nodes.
            (led, n != controller_before, std::cmp::Reverse(n))
        })
        .unwrap();
    eprintln!(
        "[e2e_broker_failover] leaders by partition {leaders_before:?}, active controller {controller_before}; \
         killing node {first}"
    );
    let kill_leader = at();
    cluster.kill_node(first);
    let moved = wait_leaders_moved(&meta, &run.topic, first);
    let leaders_moved = at();
    wait_every_partition_advanced(&mut conn, &run, &mut tally);
    let leader_recovered = at();
    eprintln!(
        "[e2e_broker_failover] node {first} down: new leaders {moved:?} seen after {:.1} s, every \
         partition applying again after {:.1} s",
        leaders_moved - kill_leader,
        leader_recovered - kill_leader
    );
    // Let the lag drain before the node comes back.
    thread::sleep(Duration::from_secs(5));
    cluster.restart_node(first);
    wait_fully_replicated(&meta);
    let first_back = at();

    let controller = cluster.active_controller();
    if controller == first {
        eprintln!(
            "[e2e_broker_failover] node {first} is the active controller again; killing it once more"
        );
    }
    let kill_controller = at();
    cluster.kill_node(controller);
    let new_controller = wait_for("a new active controller", FAILOVER_TIMEOUT, || {
        Some(cluster.active_controller()).filter(|&c| c != controller)
    });
    let controller_elected = at();
    wait_leaders_moved(&meta, &run.topic, controller);
    wait_every_partition_advanced(&mut conn, &run, &mut tally);
    let controller_recovered = at();
    eprintln!(
        "[e2e_broker_failover] controller {controller} down: node {new_controller} leads the quorum \
         after {:.1} s, every partition applying again after {:.1} s",
        controller_elected - kill_controller,
        controller_recovered - kill_controller
    );
    thread::sleep(Duration::from_secs(5));
    cluster.restart_node(controller);
    wait_fully_replicated(&meta);
    let second_back = at();
    thread::sleep(Duration::from_secs(3));

    let w = feed.stop();
    eprintln!("[e2e_broker_failover] {}", w.describe());
    let hwms = run.hwms(w.events.len());
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &w.truth);

    // The lag gauge comes from librdkafka's statistics (every 5 s): wait for the first ones
    // taken after the end was applied.
    let settled = try_wait_for(Duration::from_secs(30), || {
        let text = try_scrape_metrics(&metrics_addr).ok()?;
        let lag = by_partition(&text, CONSUMER_LAG);
        lag.iter().all(|l| *l == Some(0.0)).then_some(())
    });
    let caught_up = at();
    thread::sleep(Duration::from_secs(1));
    let samples = sampler.stop();
    let end_text = scrape_metrics(&metrics_addr);
    assert!(
        settled.is_some(),
        "{CONSUMER_LAG} not 0 on every partition 30 s after everything was applied: {:?}",
        by_partition(&end_text, CONSUMER_LAG)
    );

    let windows = [
        Window {
            name: "steady",
            from: steady,
            to: kill_leader,
        },
        Window {
            name: "leader killed",
            from: kill_leader,
            to: first_back,
        },
        Window {
            name: "controller killed",
            from: kill_controller,
            to: second_back,
        },
        Window {
            name: "end",
            from: second_back,
            to: caught_up,
        },
    ];
    let found: Vec<Seen> = windows.iter().map(|w| seen(&samples, w)).collect();
    let unanswered: Vec<String> = samples
        .iter()
        .filter(|s| s.at >= steady)
        .filter_map(|s| {
            s.readyz
                .as_ref()
                .err()
                .map(|e| format!("{:.1} s: {e}", s.at))
        })
        .collect();
    assert!(
        unanswered.is_empty(),
        "/readyz did not answer: {unanswered:?}"
    );
    for (w, seen) in windows.iter().zip(&found).skip(1).take(2) {
        // Nothing reaches the log while a dead replica is still in sync (acks=all), so the
        // failover shows only once the backlog arrives: as likes that waited seconds before
        // the consumer got them.
        assert!(
            seen.slow_fetches > 0.0,
            "{w}: no batch in tally_stage_seconds{{stage=\"fetch\"}} above {SLOW} s: {seen:?}",
            w = w.name
        );
        // The lag gauge measures the oldest message fetched and not yet applied: the backlog
        // that arrives after the pause drains within a sample or two, so it may show little.
        eprintln!(
            "[e2e_broker_failover] {w}: {CONSUMER_LAG_SECONDS} peaked at {:.1} s",
            seen.lag_seconds,
            w = w.name
        );
        // With librdkafka's default session timeout the consumer keeps its partitions while
        // the dead node is fenced and its partitions move.
        assert!(
            seen.rebalances == 0.0 && seen.fewest_assigned == f64::from(PARTITIONS),
            "{w}: the consumer lost partitions: {seen:?}",
            w = w.name
        );
    }
    let end = by_partition(&end_text, CONSUMER_LAG_SECONDS);
    assert!(
        end.iter().all(|l| *l == Some(0.0)),
        "{CONSUMER_LAG_SECONDS} at the end: {end:?}"
    );
    let (status, failing) = http_get(&metrics_addr, "/readyz").expect("GET /readyz");
    assert_eq!(status, 200, "/readyz at the end: {failing}");

    let status = tally.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "tally exited with {status} after SIGTERM");
}
