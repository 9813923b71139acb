//! Produce: `tally-lab produce`, synthetic like traffic into a Kafka topic, with
//! the exact count every post should end up with.
//!
//! What it guarantees:
//! * the truth (`--truth FILE`, and [`Summary::truth`]) is built from the
//!   delivery reports only: each acknowledged message's own payload is decoded
//!   with [`tally::pipeline::decode::decode`] and added to its post. An event that was
//!   never acknowledged is not in the truth, so a clean run of `tally run`
//!   must reproduce it exactly;
//! * the producer is idempotent (`enable.idempotence=true`): librdkafka's
//!   retries never write an event twice and never reorder a partition;
//! * every message is keyed by its `user_id` as 8 big-endian bytes, which
//!   spreads a viral post over every partition (see docs/contract.md's event contract);
//! * every event carries an `event_id` of its own (this run's start time and
//!   a sequence number), as docs/contract.md asks of producers, so a consumer
//!   deduplicating by id (`tally run --dedupe ids`) counts every one;
//! * the same `--seed` and shape give the same event sequence (the traffic
//!   itself is [`tally_lab::generate::Traffic`]);
//! * a target `--rate` is held on average over the run, never exceeded by more
//!   than about one millisecond's worth of events.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rdkafka::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Message};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ProducerContext};
use rustc_hash::FxHashMap;

use tally::domain::proto::Action;
use tally_lab::generate::{Generated, Traffic, TrafficShape};

/// Settings of `tally-lab produce`.
#[derive(Debug, Clone, Args)]
pub struct ProduceConfig {
    /// Kafka bootstrap servers, comma separated (host:port,...).
    #[arg(long, env = "TALLY_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,

    /// Topic to write like events to; it must exist.
    #[arg(long, env = "TALLY_TOPIC", default_value = "likes")]
    pub topic: String,

    /// Number of ordinary posts (ids 1..=posts); popularity follows Zipf(--zipf).
    #[arg(long, default_value_t = 1_000_000)]
    pub posts: u64,

    /// Zipf exponent s of post popularity; larger is more skewed.
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,

    /// Number of distinct users (ids 1..=users); each like is by the next user in turn.
    #[arg(long, default_value_t = 10_000_000)]
    pub users: u64,

    /// Fraction of events that undo a recent like (0 to below 1).
    #[arg(long, default_value_t = 0.1)]
    pub unlike_ratio: f64,

    /// Likes per second going to one viral post; needs --rate (its share is viral-rate / rate).
    #[arg(long)]
    pub viral_rate: Option<u64>,

    /// Id of the viral post.
    #[arg(long, default_value_t = TrafficShape::default().viral_post)]
    pub viral_post: u64,

    /// Stop after this many events (with --duration-secs, whichever comes first; neither: Ctrl-C).
    #[arg(long)]
    pub events: Option<u64>,

    /// Stop after this many seconds.
    #[arg(long)]
    pub duration_secs: Option<u64>,

    /// Target events per second (default: as fast as the broker takes them).
    #[arg(long)]
    pub rate: Option<u64>,

    /// Write the expected count of every post, from acknowledged events, as CSV `post_id,count`.
    #[arg(long)]
    pub truth: Option<PathBuf>,

    /// Seed of the generator; the same seed and shape give the same events.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Extra librdkafka producer setting, repeatable: -X linger.ms=20.
    #[arg(short = 'X', long = "kafka-config", value_parser = parse_key_value)]
    pub kafka_config: Vec<(String, String)>,
}

/// A librdkafka setting given as `key=value` (`-X`, `-P`).
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("expected key=value, got '{s}'")),
    }
}

impl ProduceConfig {
    /// Checks every setting; the first problem is returned as one line naming the flag.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |flag: &str, problem: &str| Err(format!("--{flag}: {problem}"));
        if self.brokers.trim().is_empty() {
            return bad("brokers", "is empty; give host:port of a Kafka broker");
        }
        if self.topic.trim().is_empty() {
            return bad("topic", "is empty");
        }
        if self.posts == 0 {
            return bad("posts", "must be at least 1");
        }
        if !(self.zipf.is_finite() && self.zipf > 0.0) {
            return bad("zipf", "must be a positive number");
        }
        if self.users == 0 {
            return bad("users", "must be at least 1");
        }
        if !(0.0..1.0).contains(&self.unlike_ratio) {
            return bad("unlike-ratio", "must be at least 0 and below 1");
        }
        if self.rate == Some(0) {
            return bad("rate", "must be at least 1 (leave it out for no limit)");
        }
        if self.events == Some(0) || self.duration_secs == Some(0) {
            return bad("events", "--events and --duration-secs must be at least 1");
        }
        if self.viral_post == 0 {
            return bad("viral-post", "must not be 0 (no post has id 0)");
        }
        match (self.viral_rate, self.rate) {
            (Some(_), None) => bad(
                "viral-rate",
                "needs --rate (its share is viral-rate / rate)",
            ),
            (Some(v), Some(r)) if v > r => bad("viral-rate", "cannot exceed --rate"),
            _ => Ok(()),
        }
    }

    /// The traffic shape these flags describe.
    pub fn shape(&self) -> TrafficShape {
        let viral_share = match (self.viral_rate, self.rate) {
            (Some(v), Some(r)) => v as f64 / r as f64,
            _ => 0.0,
        };
        TrafficShape {
            posts: self.posts,
            zipf_exponent: self.zipf,
            users: self.users,
            unlike_ratio: self.unlike_ratio,
            viral_post: self.viral_post,
            viral_share,
        }
    }
}

/// A post that gets one like (always from the same user, so always the same
/// partition and bucket) every `every` events; the benchmark times these.
#[derive(Debug, Clone, Copy)]
pub struct Marker {
    /// The marker post's id; keep it apart from the generated ids.
    pub post_id: u64,
    /// The marker user's id.
    pub user_id: u64,
    /// One marker like per this many events.
    pub every: u64,
}

/// What to send: the traffic, when to stop and how fast.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The traffic shape.
    pub shape: TrafficShape,
    /// Generator seed.
    pub seed: u64,
    /// Stop after this many events.
    pub events: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Target events per second; `None` is as fast as possible.
    pub rate: Option<u64>,
    /// Optional latency marker.
    pub marker: Option<Marker>,
}

/// The outcome of a run.
#[derive(Debug, Default)]
pub struct Summary {
    /// Events handed to the producer.
    pub sent: u64,
    /// Events the broker acknowledged.
    pub acked: u64,
    /// Events whose delivery failed.
    pub failed: u64,
    /// From the first send to the last acknowledgement.
    pub elapsed: Duration,
    /// Net count per post, from acknowledged events only.
    pub truth: FxHashMap<u64, i64>,
    /// When each marker like was acknowledged, in partition (hence count) order.
    pub marker_acks: Vec<Instant>,
    /// When each marker like was handed to the producer, in the same order.
    pub marker_sends: Vec<Instant>,
}

/// Delivery-report state, shared with librdkafka's callback.
struct Acks {
    truth: Mutex<FxHashMap<u64, i64>>,
    acked: AtomicU64,
    failed: AtomicU64,
    marker_post: Option<u64>,
    marker_acks: Mutex<Vec<Instant>>,
}

impl Acks {
    /// The outcome of `sent` events over `elapsed`, taking the truth and the
    /// marker times out of the shared state.
    fn summary(&self, sent: u64, elapsed: Duration, marker_sends: Vec<Instant>) -> Summary {
        Summary {
            sent,
            acked: self.acked.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            elapsed,
            truth: std::mem::take(&mut *self.truth.lock().unwrap_or_else(|e| e.into_inner())),
            marker_acks: std::mem::take(
                &mut *self.marker_acks.lock().unwrap_or_else(|e| e.into_inner()),
            ),
            marker_sends,
        }
    }
}

impl ClientContext for Acks {}

impl ProducerContext for Acks {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(message) => {
                self.acked.fetch_add(1, Ordering::Relaxed);
                // Our own payloads always decode; the truth is what the broker holds.
                if let Ok(like) = tally::pipeline::decode::decode(message.payload()) {
                    if Some(like.post_id) == self.marker_post {
                        let mut acks = self.marker_acks.lock().unwrap_or_else(|e| e.into_inner());
                        acks.push(Instant::now());
                    }
                    let mut truth = self.truth.lock().unwrap_or_else(|e| e.into_inner());
                    *truth.entry(like.post_id).or_insert(0) += like.delta;
                }
            }
            Err((error, _)) => {
                if self.failed.fetch_add(1, Ordering::Relaxed) < 5 {
                    tracing::warn!(%error, "Delivery failed; the event is not in the truth.");
                }
            }
        }
    }
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress_bar(total: Option<u64>, what: &str) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let (bar, template) = match total {
        Some(n) => (
            ProgressBar::with_draw_target(Some(n), target),
            "{prefix} [{bar:30}] {human_pos}/{human_len} {per_sec} eta {eta} {msg}",
        ),
        None => (
            ProgressBar::with_draw_target(None, target),
            "{prefix} {spinner} {human_pos} {per_sec} {elapsed} {msg}",
        ),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what.to_string());
    bar
}

/// Sends `plan` to `topic`, blocking the calling thread until every event is
/// acknowledged or failed; `stop` ends it early (the events sent still count).
pub fn send(
    brokers: &str,
    topic: &str,
    extra: &[(String, String)],
    plan: &Plan,
    stop: &AtomicBool,
    bar: &ProgressBar,
) -> Result<Summary> {
    let producer = producer(brokers, extra, plan.marker.map(|m| m.post_id))?;
    let partitions = check_topic(&producer, brokers, topic)?;
    let warmed = match plan.marker {
        Some(_) => warm_up(&producer, brokers, topic, partitions)?,
        None => 0,
    };
    let (sent, started, marker_sends) = send_events(&producer, brokers, topic, plan, stop, bar)?;
    let sent = sent + warmed;
    await_acks(&producer, sent, bar);
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    let summary = producer.context().summary(sent, elapsed, marker_sends);
    if summary.acked + summary.failed < sent {
        bail!(
            "{} of {sent} events still unacknowledged after 120 s; is the broker at {brokers} alive?",
            sent - summary.acked - summary.failed
        );
    }
    Ok(summary)
}

/// An idempotent producer for `brokers` with `extra` settings on top, whose
/// delivery reports build the truth and time `marker_post`'s likes.
fn producer(
    brokers: &str,
    extra: &[(String, String)],
    marker_post: Option<u64>,
) -> Result<BaseProducer<Acks>> {
    let acks = Acks {
        truth: Mutex::new(FxHashMap::default()),
        acked: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        marker_post,
        marker_acks: Mutex::new(Vec::new()),
    };
    let mut config = tally::infra::config::kafka_client_config(brokers, &[]);
    config
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "500000");
    for (key, value) in extra {
        config.set(key, value);
    }
    config
        .create_with_context(acks)
        .with_context(|| format!("creating a Kafka producer for {brokers}"))
}

/// The post of the likes [`warm_up`] sends, far from generated ids and from the marker's.
const WARM_UP_POST: u64 = 1 << 41;

/// Sends one like to each of the `partitions` of `topic` and waits for them all, so that a
/// timed plan's first marker does not wait for the producer's own start: its connection to
/// every partition leader and, being idempotent, its producer id. (Markers sent in the first
/// fifth of a second of a phase were seen taking 600–700 ms, waiting in the producer.)
/// Each like has a user of its own, so no dedupe rule skips one, and the delivery reports put
/// them in the truth like any other event. Returns how many were sent.
fn warm_up(
    producer: &BaseProducer<Acks>,
    brokers: &str,
    topic: &str,
    partitions: i32,
) -> Result<u64> {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    for partition in 0..partitions {
        let user = rand::random::<u64>();
        let id = format!("warm-up-{user:x}");
        let payload =
            tally::pipeline::decode::encode_with_id(WARM_UP_POST, user, Action::Like, now_ms, &id);
        let key = user.to_be_bytes();
        let record = BaseRecord::to(topic)
            .partition(partition)
            .key(&key[..])
            .payload(&payload[..]);
        producer
            .send(record)
            .map_err(|(error, _)| error)
            .with_context(|| format!("cannot produce to {topic} on {brokers}"))?;
    }
    let sent = partitions as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while in_doubt(producer, sent) > 0 {
        if Instant::now() > deadline {
            bail!(
                "the producer's warm-up likes were not acknowledged within 60 s; is the broker at {brokers} alive?"
            );
        }
        producer.poll(Duration::from_millis(5));
    }
    Ok(sent)
}

/// Fails unless the broker answers and `topic` exists there with partitions; returns how many.
fn check_topic(producer: &BaseProducer<Acks>, brokers: &str, topic: &str) -> Result<i32> {
    let metadata = producer
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .with_context(|| {
            format!("cannot reach Kafka at {brokers} (is the broker running? check --brokers / TALLY_BROKERS)")
        })?;
    let partitions = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map_or(0, |t| t.partitions().len());
    if partitions == 0 {
        bail!("topic '{topic}' does not exist on {brokers}; create it or fix --topic");
    }
    Ok(partitions as i32)
}

/// Hands `plan`'s events to the producer, held to its rate, until it ends or
/// `stop` is set; returns how many were sent, when sending began, and when
/// each marker like was handed over.
fn send_events(
    producer: &BaseProducer<Acks>,
    brokers: &str,
    topic: &str,
    plan: &Plan,
    stop: &AtomicBool,
    bar: &ProgressBar,
) -> Result<(u64, Instant, Vec<Instant>)> {
    let mut traffic = Traffic::new(plan.shape.clone(), plan.seed);
    let mut marker_sends = Vec::new();
    let started = Instant::now();
    // Event ids are unique across runs as well: this run's start, then a sequence.
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut id = String::new();
    let mut sent: u64 = 0;
    while !stop.load(Ordering::Relaxed)
        && plan.events.is_none_or(|n| sent < n)
        && plan.duration.is_none_or(|d| started.elapsed() < d)
    {
        if let Some(rate) = plan.rate {
            let due = (started.elapsed().as_secs_f64() * rate as f64) as u64;
            if sent >= due {
                producer.poll(Duration::from_millis(1));
                continue;
            }
        }
        let event = match plan.marker {
            Some(m) if sent % m.every == m.every - 1 => {
                marker_sends.push(Instant::now());
                Generated {
                    post_id: m.post_id,
                    user_id: m.user_id,
                    action: Action::Like,
                }
            }
            _ => traffic.next_event(),
        };
        id.clear();
        write!(id, "{run:x}-{sent:x}").expect("writing to a String cannot fail");
        enqueue(producer, brokers, topic, &event, &id)?;
        sent += 1;
        if sent.is_multiple_of(1024) {
            producer.poll(Duration::ZERO);
            bar.set_position(sent);
        }
    }
    Ok((sent, started, marker_sends))
}

/// Queues one event with its `event_id`, stamped now and keyed by its user,
/// waiting while the local queue is full.
fn enqueue(
    producer: &BaseProducer<Acks>,
    brokers: &str,
    topic: &str,
    event: &Generated,
    event_id: &str,
) -> Result<()> {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let payload = tally::pipeline::decode::encode_with_id(
        event.post_id,
        event.user_id,
        event.action,
        now_ms,
        event_id,
    );
    let key = event.user_id.to_be_bytes();
    let mut record = BaseRecord::to(topic).key(&key[..]).payload(&payload[..]);
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), unsent)) => {
                // The local queue is full: serve delivery reports until it drains.
                record = unsent;
                producer.poll(Duration::from_millis(5));
            }
            Err((error, _)) => bail!("cannot produce to {topic} on {brokers}: {error}"),
        }
    }
}

/// Flushes until every one of the `sent` events is acknowledged or failed,
/// for at most 120 s.
fn await_acks(producer: &BaseProducer<Acks>, sent: u64, bar: &ProgressBar) {
    bar.set_position(sent);
    bar.set_message("waiting for acknowledgements");
    let deadline = Instant::now() + Duration::from_secs(120);
    while in_doubt(producer, sent) > 0 && Instant::now() < deadline {
        let _ = producer.flush(Duration::from_millis(200));
    }
}

/// Events sent whose delivery has not been reported yet.
fn in_doubt(producer: &BaseProducer<Acks>, sent: u64) -> u64 {
    let acks = producer.context();
    sent.saturating_sub(acks.acked.load(Ordering::Relaxed) + acks.failed.load(Ordering::Relaxed))
}

/// Writes the truth as CSV `post_id,count`, one line per post seen, sorted by post.
pub fn write_truth(path: &std::path::Path, truth: &FxHashMap<u64, i64>) -> Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = BufWriter::new(file);
    let mut posts: Vec<(u64, i64)> = truth.iter().map(|(&p, &c)| (p, c)).collect();
    posts.sort_unstable();
    writeln!(out, "post_id,count")?;
    for (post, count) in posts {
        writeln!(out, "{post},{count}")?;
    }
    out.flush()
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Runs `tally-lab produce`: sends until --events, --duration-secs or Ctrl-C,
/// writes the truth file, and prints one summary line.
pub async fn produce(config: ProduceConfig) -> Result<()> {
    config.validate().map_err(anyhow::Error::msg)?;
    let plan = Plan {
        shape: config.shape(),
        seed: config.seed,
        events: config.events,
        duration: config.duration_secs.map(Duration::from_secs),
        rate: config.rate,
        marker: None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let on_ctrl_c = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            on_ctrl_c.store(true, Ordering::Relaxed);
        }
    });
    let bar = progress_bar(config.events, "producing");
    let worker = config.clone();
    let summary = tokio::task::spawn_blocking(move || {
        send(
            &worker.brokers,
            &worker.topic,
            &worker.kafka_config,
            &plan,
            &stop,
            &bar,
        )
    })
    .await
    .context("the producer thread failed")??;
    let secs = summary.elapsed.as_secs_f64().max(1e-9);
    let mut line = format!(
        "produced {} events to {} in {secs:.1} s ({:.0} events/s): {} acknowledged, {} failed",
        summary.sent,
        config.topic,
        summary.acked as f64 / secs,
        summary.acked,
        summary.failed
    );
    if let Some(path) = &config.truth {
        write_truth(path, &summary.truth)?;
        line.push_str(&format!(
            "; truth for {} posts in {}",
            summary.truth.len(),
            path.display()
        ));
    }
    println!("{line}");
    if summary.failed > 0 {
        bail!(
            "{} deliveries failed: they are not in the truth, and a failed delivery may still have reached the log",
            summary.failed
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        config: ProduceConfig,
    }

    fn parse(args: &[&str]) -> ProduceConfig {
        let line = std::iter::once("produce").chain(args.iter().copied());
        Flags::try_parse_from(line).unwrap().config
    }

    #[test]
    fn defaults_are_valid_and_problems_name_the_flag() {
        parse(&[]).validate().unwrap();
        let err = parse(&["--viral-rate", "9000"]).validate().unwrap_err();
        assert!(err.starts_with("--viral-rate"), "{err}");
        let err = parse(&["--rate", "100", "--viral-rate", "200"])
            .validate()
            .unwrap_err();
        assert!(err.starts_with("--viral-rate"), "{err}");
        let err = parse(&["--unlike-ratio", "1"]).validate().unwrap_err();
        assert!(err.starts_with("--unlike-ratio"), "{err}");
        let shape = parse(&["--rate", "100000", "--viral-rate", "9000"]).shape();
        assert!((shape.viral_share - 0.09).abs() < 1e-12);
    }

    #[test]
    fn truth_file_is_sorted_csv() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("truth.csv");
        let truth: FxHashMap<u64, i64> = [(7, 2), (3, -1), (5, 0)].into_iter().collect();
        write_truth(&path, &truth).unwrap();
        let text = std::fs::read_to_string(path).unwrap();
        assert_eq!(text, "post_id,count\n3,-1\n5,0\n7,2\n");
    }
}
