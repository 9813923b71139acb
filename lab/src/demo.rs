//! Demo: the whole pipeline on one machine, with live figures.
//!
//! Starts a private Apache Kafka broker and a private redis-server
//! on free loopback ports, a traffic generator with a viral post, and the
//! aggregator, then prints events/s, batches/s, Redis increments per event and
//! the viral post's count next to the number of likes actually produced; what
//! librdkafka logs of a broker still starting is summed up under the table
//! ([`HeldBack`]). On Ctrl-C (or after `--duration`) it stops the generator,
//! lets the aggregator catch up, checks every post's count against the
//! generator's own tally, and shuts everything down.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use metrics_exporter_prometheus::PrometheusHandle;
use tally::domain::routing::KeyLayout;
use tally::infra::config::dedupe::{DEFAULT_WINDOW, DedupeMode, DedupeSettings};
use tally::infra::config::{
    Batching, DEFAULT_PREFIX, GroupProtocol, HotSettings, KafkaSecurity, KafkaSettings,
    RunSettings, StoreSettings, kafka_client_config,
};
use tally::infra::metrics;
use tally::pipeline::run::RunError;
use tally::read::Reader;
use tally_lab::generate::{Traffic, TrafficShape};

use crate::local::{Service, create_topic, settings_error, start_kafka, start_redis};
use crate::logs::HeldBack;

/// Settings of `tally-lab demo`.
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
    #[arg(long, default_value_t = tally::infra::config::DEFAULT_BUCKETS)]
    pub buckets: u32,
    /// Stop by itself after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    pub duration: Option<u64>,
}

/// Starts the demo's broker and topic.
fn start_broker(dir: &std::path::Path, topic: &str, partitions: u32) -> Result<(Service, String)> {
    let (service, brokers) = start_kafka(dir)?;
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

impl Produced {
    /// The net count of every post whose likes and unlikes did not cancel
    /// out: [`read_all`] leaves out posts that sum to zero, so the truth must too.
    fn net_counts(&self) -> HashMap<u64, i64> {
        self.truth
            .lock()
            .expect("truth lock")
            .iter()
            .filter(|(_, v)| **v != 0)
            .map(|(k, v)| (*k, *v))
            .collect()
    }
}

async fn generate(
    brokers: String,
    topic: String,
    config: DemoConfig,
    produced: Arc<Produced>,
) -> Result<()> {
    let producer: FutureProducer = kafka_client_config(&brokers, &[])
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
            let payload = tally::pipeline::decode::encode(
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

fn read_all(conn: &mut redis::Connection, keys: &KeyLayout) -> Result<HashMap<u64, i64>> {
    let mut counts = HashMap::new();
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:likes:*", keys.prefix()))
        .query(conn)?;
    for chunk in names.chunks(1000) {
        let values: Vec<Option<i64>> = redis::cmd("MGET").arg(chunk).query(conn)?;
        for (name, value) in chunk.iter().zip(values) {
            if let (Some(id), Some(v)) = (keys.parse_counter_key(name), value) {
                *counts.entry(id.post_id).or_default() += v;
            }
        }
    }
    counts.retain(|_, v| *v != 0);
    Ok(counts)
}

/// Runs the demo until Ctrl-C or `--duration`; `held_back` counts librdkafka's start-up
/// messages kept out of the table.
pub async fn demo(config: DemoConfig, held_back: Option<HeldBack>) -> Result<()> {
    // Listening from the start: an interrupt that arrives while the display
    // is busy reading Redis, or before it begins, waits here rather than
    // being lost (or ending the process before the check).
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for Ctrl-C")?;
    let dir = tempfile::tempdir().context("creating a scratch directory")?;
    let topic = "likes".to_string();
    let (_redis, redis_url) = start_redis(dir.path())?;
    let (_kafka, brokers) = start_broker(dir.path(), &topic, config.partitions)?;
    println!(
        "broker {brokers}, redis {redis_url}, topic {topic} ({} partitions), {} buckets per post",
        config.partitions, config.buckets
    );
    println!(
        "producing {} events/s, {} of them likes of viral post 4242; Ctrl-C to stop",
        config.rate, config.viral_rate
    );
    let mut pipeline = Pipeline::start(&config, brokers, topic, &redis_url).await?;
    pipeline.display(config.duration, &mut interrupt).await;
    if let Some(line) = held_back.and_then(|h| h.summary()) {
        println!("{line}");
    }
    let produced = pipeline.catch_up().await;
    let wrong = pipeline.check(produced)?;
    pipeline.shut_down().await?;
    if wrong != 0 {
        bail!("counts differ");
    }
    Ok(())
}

/// What `tally run` would use with its defaults, on `topic` of `brokers` in the group
/// `tally-demo`, counting into `store` with `buckets` buckets per post.
fn run_settings(
    brokers: &str,
    topic: &str,
    store: StoreSettings,
    buckets: u32,
) -> Result<RunSettings> {
    let settings = RunSettings {
        kafka: KafkaSettings {
            brokers: brokers.to_string(),
            topic: topic.to_string(),
            group: "tally-demo".into(),
            group_protocol: GroupProtocol::default(),
            group_instance_id: None,
            dead_letter_topic: None,
            security: KafkaSecurity::default(),
            extra: Vec::new(),
        },
        store,
        buckets: Some(buckets),
        hot: HotSettings::default(),
        batching: Batching::default(),
        metrics_addr: None,
        test_script_pause: Duration::ZERO,
        accept_lost_counts: false,
        dedupe_change: false,
        schema_ids: Vec::new(),
        packing: Default::default(),
        windows: None,
        dedupe: DedupeSettings {
            mode: DedupeMode::Off,
            span: DEFAULT_WINDOW,
        },
    };
    let problems = settings.problems();
    if problems.is_empty() {
        Ok(settings)
    } else {
        Err(settings_error(problems))
    }
}

/// The pipeline running in-process: the aggregator, the generator feeding
/// it, and what the display and the final check read.
struct Pipeline {
    totals: Totals,
    shutdown: CancellationToken,
    aggregator: JoinHandle<Result<(), RunError>>,
    produced: Arc<Produced>,
    generator: JoinHandle<Result<()>>,
    keys: KeyLayout,
    /// The final check reads every counter key through this.
    conn: redis::Connection,
    /// The display reads the viral post's count as a client of tally would.
    reader: Reader,
}

impl Pipeline {
    /// Starts the aggregator on `topic` and the generator feeding it, then
    /// connects to the store at `redis_url` to watch them.
    async fn start(
        config: &DemoConfig,
        brokers: String,
        topic: String,
        redis_url: &str,
    ) -> Result<Self> {
        let store = crate::local::store(redis_url, DEFAULT_PREFIX)?;
        let settings = run_settings(&brokers, &topic, store.clone(), config.buckets)?;
        let totals = Totals::install()?;
        let shutdown = CancellationToken::new();
        let aggregator = tokio::spawn(tally::pipeline::run::run(settings, shutdown.clone()));
        let produced = Arc::new(Produced::default());
        let generator = tokio::spawn(generate(brokers, topic, config.clone(), produced.clone()));
        let keys = KeyLayout::new(DEFAULT_PREFIX);
        let conn = redis::Client::open(redis_url)?.get_connection()?;
        let store = tally::domain::layout::open(&store).await?;
        let reader = Reader::new(store.store, keys.clone(), config.buckets, Duration::ZERO);
        Ok(Self {
            totals,
            shutdown,
            aggregator,
            produced,
            generator,
            keys,
            conn,
            reader,
        })
    }

    /// Prints a row of figures every second until Ctrl-C, `duration` seconds,
    /// or the aggregator or the generator ending.
    async fn display(&self, duration: Option<u64>, interrupt: &mut Signal) {
        let started = Instant::now();
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.tick().await;
        let (mut last_messages, mut last_batches) = (0, 0);
        let stop_at = duration.map(|d| started + Duration::from_secs(d));
        println!(
            "{:>6}  {:>10}  {:>9}  {:>11}  {:>14}  {:>14}  {:>8}",
            "time",
            "events/s",
            "batches/s",
            "incr/event",
            "viral in Redis",
            "viral produced",
            "lag"
        );
        loop {
            tokio::select! {
                _ = interrupt.recv() => break,
                _ = every.tick() => {}
            }
            if self.aggregator.is_finished() || self.generator.is_finished() {
                break;
            }
            let (messages, batches, increments) = self.totals.read();
            let viral = self.reader.count(4_242).await.map_or(0, |c| c.likes);
            println!(
                "{:>5}s  {:>10}  {:>9}  {:>11.4}  {:>14}  {:>14}  {:>8}",
                started.elapsed().as_secs(),
                messages - last_messages,
                batches - last_batches,
                increments as f64 / messages.max(1) as f64,
                viral,
                self.produced.viral.load(Ordering::Relaxed),
                self.produced
                    .events
                    .load(Ordering::Relaxed)
                    .saturating_sub(messages),
            );
            (last_messages, last_batches) = (messages, batches);
            if stop_at.is_some_and(|t| Instant::now() >= t) {
                break;
            }
        }
    }

    /// Stops the generator, then gives the aggregator up to 30 s to apply
    /// every event the broker acknowledged; returns how many that is.
    async fn catch_up(&mut self) -> u64 {
        println!("stopping the generator and letting the aggregator catch up...");
        self.produced.stop.store(true, Ordering::Relaxed);
        if let Ok(Err(error)) = (&mut self.generator).await {
            eprintln!("generator: {error:#}");
        }
        let target = self.produced.events.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.totals.read().0 < target
            && Instant::now() < deadline
            && !self.aggregator.is_finished()
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        target
    }

    /// Compares every post's count in Redis with the generator's truth and
    /// prints the verdict; returns how many posts differ.
    fn check(&mut self, events: u64) -> Result<usize> {
        let truth = self.produced.net_counts();
        let counts = read_all(&mut self.conn, &self.keys)?;
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
                events
            );
        } else {
            println!(
                "check: {wrong} of {} posts differ from the generator's count",
                truth.len()
            );
        }
        Ok(wrong)
    }

    /// Stops the aggregator and waits for it; fails if it failed.
    async fn shut_down(self) -> Result<()> {
        self.shutdown.cancel();
        match self.aggregator.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => bail!("aggregator: {error}"),
            Err(error) => bail!("aggregator task: {error}"),
        }
    }
}

/// The figures the display shows, read from the metrics recorder tally
/// records into: events applied, batches applied, counter increments.
struct Totals {
    handle: PrometheusHandle,
}

impl Totals {
    fn install() -> Result<Self> {
        Ok(Totals {
            handle: metrics::install()?,
        })
    }

    /// (events, batches, increments) so far.
    fn read(&self) -> (u64, u64, u64) {
        let text = self.handle.render();
        let value = |series: &str| -> u64 {
            text.lines()
                .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .map_or(0, |v| v as u64)
        };
        (
            value(metrics::EVENTS),
            value(&format!("{}{{outcome=\"applied\"}}", metrics::BATCHES)),
            value(metrics::INCREMENTS),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_come_from_the_recorder() {
        let totals = Totals::install().unwrap();
        metrics::describe(&[]);
        metrics::batch_done(true, 10, 1, 4, Duration::from_millis(1));
        assert_eq!(totals.read(), (9, 1, 4));
    }
}
