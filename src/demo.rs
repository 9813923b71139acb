//! Demo: the whole pipeline on one machine, with live figures.
//!
//! Starts a private Kafka-compatible broker (Tansu) and a private redis-server
//! on free loopback ports, a traffic generator with a viral post, and the
//! aggregator, then prints events/s, batches/s, Redis increments per event and
//! the viral post's count next to the number of likes actually produced. On
//! Ctrl-C (or after `--duration`) it stops the generator, lets the aggregator
//! catch up, checks every post's count against the generator's own tally, and
//! shuts everything down.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;

use crate::config::RunConfig;
use crate::generate::{Traffic, TrafficShape};
use crate::local::{Service, create_topic, start_redis, start_tansu};
use crate::metrics::Stats;
use crate::routing::KeyLayout;

/// Settings of `tally demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoConfig {
    /// Events produced per second in total.
    #[arg(long, default_value_t = 20_000)]
    pub rate: u64,
    /// Of which, likes per second for the one viral post.
    #[arg(long, default_value_t = 3_000)]
    pub viral_rate: u64,
    /// Partitions of the demo topic.
    #[arg(long, default_value_t = 8)]
    pub partitions: u32,
    /// Buckets per post.
    #[arg(long, default_value_t = 16)]
    pub buckets: u32,
    /// Stop by itself after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    pub duration: Option<u64>,
}

/// Starts the demo's broker and topic.
fn start_kafka(dir: &std::path::Path, topic: &str, partitions: u32) -> Result<(Service, String)> {
    let (service, brokers) = start_tansu(dir)?;
    create_topic(&brokers, topic, partitions)?;
    Ok((service, brokers))
}

/// What the generator has produced, acknowledged by the broker.
#[derive(Default)]
struct Produced {
    events: AtomicU64,
    viral: AtomicI64,
    truth: std::sync::Mutex<HashMap<u64, i64>>,
    stop: AtomicBool,
}

async fn generate(
    brokers: String,
    topic: String,
    config: DemoConfig,
    produced: Arc<Produced>,
) -> Result<()> {
    let producer: FutureProducer = crate::consume::client_config(&brokers, &[])
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("batch.num.messages", "10000")
        .create()
        .context("creating the demo producer")?;
    let shape = TrafficShape {
        viral_share: (config.viral_rate as f64 / config.rate.max(1) as f64).min(1.0),
        ..TrafficShape::default()
    };
    let mut traffic = Traffic::new(shape, 42);
    let tick = Duration::from_millis(10);
    let per_tick = (config.rate / 100).max(1);
    let mut interval = tokio::time::interval(tick);
    let started = Instant::now();
    while !produced.stop.load(Ordering::Relaxed) {
        interval.tick().await;
        let mut deliveries = Vec::with_capacity(per_tick as usize);
        let mut chunk: HashMap<u64, i64> = HashMap::new();
        for _ in 0..per_tick {
            let e = traffic.next_event();
            let payload = crate::decode::encode(
                e.post_id,
                e.user_id,
                e.action,
                started.elapsed().as_millis() as i64,
            );
            let key = e.user_id.to_be_bytes();
            let mut record = FutureRecord::to(&topic).key(&key[..]).payload(&payload);
            loop {
                match producer.send_result(record) {
                    Ok(delivery) => break deliveries.push(delivery),
                    Err((_, unsent)) => {
                        // Local queue full: let librdkafka drain it.
                        record = unsent;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
            *chunk.entry(e.post_id).or_default() += e.delta();
        }
        let results = futures::future::join_all(deliveries).await;
        if results.iter().any(|r| !matches!(r, Ok(Ok(_)))) {
            bail!("the demo broker refused events");
        }
        produced.events.fetch_add(per_tick, Ordering::Relaxed);
        produced.viral.fetch_add(
            chunk.get(&traffic.viral_post()).copied().unwrap_or(0),
            Ordering::Relaxed,
        );
        let mut truth = produced.truth.lock().expect("truth lock");
        for (post, delta) in chunk {
            *truth.entry(post).or_default() += delta;
        }
    }
    Ok(())
}

fn read_post(conn: &mut redis::Connection, keys: &KeyLayout, post: u64, buckets: u32) -> i64 {
    let names: Vec<String> = (0..buckets).map(|b| keys.counter_key(post, b)).collect();
    let values: Vec<Option<i64>> = redis::cmd("MGET")
        .arg(&names)
        .query(conn)
        .unwrap_or_default();
    values.into_iter().flatten().sum()
}

fn read_all(conn: &mut redis::Connection, keys: &KeyLayout) -> Result<HashMap<u64, i64>> {
    let mut counts = HashMap::new();
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:likes:*", keys.prefix()))
        .query(conn)?;
    for chunk in names.chunks(1000) {
        let values: Vec<Option<i64>> = redis::cmd("MGET").arg(chunk).query(conn)?;
        for (name, value) in chunk.iter().zip(values) {
            if let (Some((post, _)), Some(v)) = (keys.parse_counter_key(name), value) {
                *counts.entry(post).or_default() += v;
            }
        }
    }
    counts.retain(|_, v| *v != 0);
    Ok(counts)
}

/// Runs the demo until Ctrl-C or `--duration`.
pub async fn demo(config: DemoConfig) -> Result<()> {
    let dir = tempfile::tempdir().context("creating a scratch directory")?;
    let topic = "likes".to_string();
    let (_redis, redis_url) = start_redis(dir.path())?;
    let (_kafka, brokers) = start_kafka(dir.path(), &topic, config.partitions)?;
    println!(
        "broker {brokers}, redis {redis_url}, topic {topic} ({} partitions), {} buckets per post",
        config.partitions, config.buckets
    );
    println!(
        "producing {} events/s, {} of them likes of viral post 4242; Ctrl-C to stop",
        config.rate, config.viral_rate
    );

    let run_config = RunConfig {
        brokers: brokers.clone(),
        topic: topic.clone(),
        group: "tally-demo".into(),
        redis: redis_url.clone(),
        slot_groups: crate::config::DEFAULT_SLOT_GROUPS,
        test_script_pause_ms: 0,
        buckets: config.buckets,
        prefix: "tally".into(),
        dead_letter_topic: None,
        batch_max_events: 100_000,
        batch_max_keys: 10_000,
        flush_interval_ms: 100,
        max_in_flight: 8,
        shutdown_timeout_secs: 10,
        metrics_addr: None,
        kafka_config: Vec::new(),
    };
    let stats = Arc::new(Stats::default());
    let shutdown = CancellationToken::new();
    let aggregator = tokio::spawn(crate::run::run(run_config, stats.clone(), shutdown.clone()));
    let produced = Arc::new(Produced::default());
    let generator = tokio::spawn(generate(brokers, topic, config.clone(), produced.clone()));

    let keys = KeyLayout::new("tally");
    let mut conn = redis::Client::open(redis_url.as_str())?.get_connection()?;
    let started = Instant::now();
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.tick().await;
    let (mut last_messages, mut last_batches) = (0, 0);
    let stop_at = config.duration.map(|d| started + Duration::from_secs(d));
    println!(
        "{:>6}  {:>10}  {:>9}  {:>11}  {:>14}  {:>14}  {:>8}",
        "time", "events/s", "batches/s", "incr/event", "viral in Redis", "viral produced", "lag"
    );
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = every.tick() => {}
        }
        if aggregator.is_finished() || generator.is_finished() {
            break;
        }
        let messages = Stats::get(&stats.messages);
        let batches = Stats::get(&stats.batches);
        let increments = Stats::get(&stats.increments);
        let viral = read_post(&mut conn, &keys, 4_242, config.buckets);
        println!(
            "{:>5}s  {:>10}  {:>9}  {:>11.4}  {:>14}  {:>14}  {:>8}",
            started.elapsed().as_secs(),
            messages - last_messages,
            batches - last_batches,
            increments as f64 / messages.max(1) as f64,
            viral,
            produced.viral.load(Ordering::Relaxed),
            produced
                .events
                .load(Ordering::Relaxed)
                .saturating_sub(messages),
        );
        (last_messages, last_batches) = (messages, batches);
        if stop_at.is_some_and(|t| Instant::now() >= t) {
            break;
        }
    }

    println!("stopping the generator and letting the aggregator catch up...");
    produced.stop.store(true, Ordering::Relaxed);
    if let Ok(Err(error)) = generator.await {
        eprintln!("generator: {error:#}");
    }
    let target = produced.events.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(30);
    while Stats::get(&stats.messages) < target
        && Instant::now() < deadline
        && !aggregator.is_finished()
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let truth: HashMap<u64, i64> = produced
        .truth
        .lock()
        .expect("truth lock")
        .iter()
        .filter(|(_, v)| **v != 0)
        .map(|(k, v)| (*k, *v))
        .collect();
    let counts = read_all(&mut conn, &keys)?;
    let wrong = truth
        .iter()
        .filter(|(post, want)| counts.get(post) != Some(want))
        .count()
        + counts
            .keys()
            .filter(|post| !truth.contains_key(post))
            .count();
    if wrong == 0 {
        println!(
            "check: all {} posts match the generator's own count exactly ({} events)",
            truth.len(),
            target
        );
    } else {
        println!(
            "check: {wrong} of {} posts differ from the generator's count",
            truth.len()
        );
    }
    shutdown.cancel();
    match aggregator.await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => bail!("aggregator: {error}"),
        Err(error) => bail!("aggregator task: {error}"),
    }
    if wrong != 0 {
        bail!("counts differ");
    }
    Ok(())
}
