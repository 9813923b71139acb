//! The latency phase: events produced at a fixed rate with a marker post among them, each
//! marker like timed from the moment it is handed to the producer to the moment its count is
//! visible, for tally and for the Kafka Streams peer alike. (Timed from the broker's
//! acknowledgement instead, a like could look visible before it was produced: on a machine
//! with no core to spare the producer thread serves its delivery reports late, and in some runs
//! half the markers were seen counted before their acknowledgement was.)
//!
//! The marker's likes all come from one user ([`MARKER_USER`]), so they share one partition
//! and arrive in order. A [`Probe`] notes when each becomes visible: for tally, a `GET` of the
//! marker's counter key every millisecond; for Kafka Streams, the marker post's records in its
//! output topic, read `read_committed` from the one partition that holds them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rdkafka::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rustc_hash::FxHashMap;

use super::Env;
use super::peer_records::{long, partition_of};
use super::services::{busy_share, machine_ticks, redis_conn, seal};
use crate::produce::{Marker, Plan, Summary, progress_bar, send};
use tally_lab::generate::TrafficShape;

/// Produce-to-visible latency of the marker post.
#[derive(Debug, Clone, Copy)]
pub(super) struct Latency {
    /// Median, milliseconds.
    pub p50_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
    /// The rate asked of the producer.
    pub target_rate: u64,
    /// The rate the broker acknowledged.
    pub reached_rate: u64,
    /// Marker likes timed.
    pub samples: usize,
    /// Events the broker acknowledged during the phase, its seals included.
    pub events: u64,
    /// The slowest marker likes, slowest first: when each was sent, in seconds after the first
    /// marker, and its produce-to-visible time in milliseconds. With the phase's samples these
    /// say whether a p99 comes from one stall or from a spread.
    pub slowest: [(f64, f64); SLOWEST],
    /// The share of the machine's cores busy (every process: the producer, the broker, the
    /// store and tally) while the phase produced. Near 1, the tail is the machine's queue for
    /// a core more than anything of tally's.
    pub busy: Option<f64>,
}

/// How many of the slowest marker likes a [`Latency`] keeps.
pub(super) const SLOWEST: usize = 3;

/// Marker post of the latency phase, far from generated ids.
pub(super) const MARKER_POST: u64 = 1 << 40;
/// Marker likes per second: enough samples for a p99 in a short phase.
const MARKERS_PER_SEC: u64 = 50;

/// The user of every marker like.
pub(super) const MARKER_USER: u64 = 1;

/// How long the latency probe waits, once the phase has ended, for the last marker likes: a
/// consumer slower than the phase's rate catches up on what it fell behind.
pub(super) const PATIENCE: Duration = Duration::from_secs(180);

/// Where the latency phase sees the marker post's count.
pub(super) enum Probe {
    /// tally: a `GET` of the marker's counter key, every millisecond.
    Get { url: String, key: String },
    /// Kafka Streams: the marker's records in its output topic, read `read_committed`.
    Output(OutputWatch),
}

impl Probe {
    /// How long the probe waits, once the phase has ended, for the last marker likes.
    fn patience(&self) -> Duration {
        match self {
            Probe::Get { .. } => Duration::from_secs(30),
            Probe::Output(_) => PATIENCE,
        }
    }

    /// Notes when each marker like becomes visible, until `stop` and `want` of them are seen.
    fn watch(self, stop: Arc<AtomicBool>, want: Arc<AtomicU64>) -> Result<(Vec<Instant>, u64)> {
        match self {
            Probe::Get { url, key } => watch_marker(&url, key, stop, want),
            Probe::Output(watch) => watch.run(&stop, &want),
        }
    }
}

/// Times the marker post: one GET a millisecond, noting when each new like shows up.
fn watch_marker(
    url: &str,
    key: String,
    stop: Arc<AtomicBool>,
    want: Arc<AtomicU64>,
) -> Result<(Vec<Instant>, u64)> {
    let mut conn = redis_conn(url)?;
    let (mut seen, mut gets) = (Vec::new(), 0u64);
    let deadline_after_stop = Duration::from_secs(30);
    let mut stopped_at: Option<Instant> = None;
    loop {
        gets += 1;
        let count: Option<i64> = redis::cmd("GET").arg(&key).query(&mut conn)?;
        let now = Instant::now();
        while (seen.len() as i64) < count.unwrap_or(0) {
            seen.push(now);
        }
        if stop.load(Ordering::Relaxed) {
            let since = *stopped_at.get_or_insert(now);
            if seen.len() as u64 >= want.load(Ordering::Relaxed)
                || since.elapsed() > deadline_after_stop
            {
                return Ok((seen, gets));
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The latency phase's view of the output topic: the marker post's records, read
/// `read_committed` from the one partition that holds them, from its end onwards.
pub(super) struct OutputWatch {
    consumer: BaseConsumer,
    /// The marker's count before the phase.
    base: i64,
}

impl OutputWatch {
    /// A watch on the marker's partition of `output`, whose count is `base` now.
    pub fn new(brokers: &str, output: &str, partitions: u32, base: i64) -> Result<Self> {
        let consumer: BaseConsumer = tally::infra::config::kafka_client_config(brokers, &[])
            .set("group.id", "tally-bench-marker")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "10")
            .create()?;
        let partition = partition_of(MARKER_POST, partitions);
        let (_, end) = consumer.fetch_watermarks(output, partition, Duration::from_secs(10))?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(output, partition, Offset::Offset(end))?;
        consumer.assign(&tpl)?;
        Ok(Self { consumer, base })
    }

    /// Notes when each marker like shows in the output, until `stop` and `want` of them are
    /// seen (or [`PATIENCE`] has passed since `stop`); returns the times and the polls made.
    pub fn run(self, stop: &AtomicBool, want: &AtomicU64) -> Result<(Vec<Instant>, u64)> {
        let key = MARKER_POST.to_be_bytes();
        let (mut seen, mut polls) = (Vec::new(), 0u64);
        let mut stopped_at: Option<Instant> = None;
        loop {
            polls += 1;
            match self.consumer.poll(Duration::from_millis(10)) {
                Some(Ok(message)) if message.key() == Some(&key[..]) => {
                    let now = Instant::now();
                    let count = message.payload().and_then(long).unwrap_or(0) - self.base;
                    while (seen.len() as i64) < count {
                        seen.push(now);
                    }
                }
                Some(Ok(_)) | None => {}
                Some(Err(error)) => return Err(error).context("reading the output topic"),
            }
            if stop.load(Ordering::Relaxed) {
                let since = *stopped_at.get_or_insert_with(Instant::now);
                if seen.len() as u64 >= want.load(Ordering::Relaxed) || since.elapsed() > PATIENCE {
                    return Ok((seen, polls));
                }
            }
        }
    }
}

/// Produces at `rate` for `secs` with a marker post, and returns the marker's
/// produce-to-visible latency, as `probe` sees it.
pub(super) fn timed_phase(
    env: &Env,
    topic: &str,
    shape: &TrafficShape,
    rate: u64,
    secs: u64,
    truth: &mut FxHashMap<u64, i64>,
    probe: Probe,
) -> Result<Latency> {
    let marker = Marker {
        post_id: MARKER_POST,
        user_id: MARKER_USER,
        every: (rate / MARKERS_PER_SEC).max(1),
    };
    let patience = probe.patience();
    let (stop, want) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(u64::MAX)),
    );
    let watcher = {
        let (stop, want) = (stop.clone(), want.clone());
        std::thread::spawn(move || probe.watch(stop, want))
    };
    let plan = Plan {
        shape: shape.clone(),
        seed: 7,
        events: None,
        duration: Some(Duration::from_secs(secs)),
        rate: Some(rate),
        marker: Some(marker),
    };
    let bar = progress_bar(Some(rate * secs), "latency phase");
    let ticks = machine_ticks();
    let produced = send(
        &env.brokers,
        topic,
        &env.producer_config,
        &plan,
        &AtomicBool::new(false),
        &bar,
    );
    let busy = busy_share(ticks, machine_ticks());
    if let Ok(summary) = &produced {
        want.store(summary.marker_acks.len() as u64, Ordering::Relaxed);
    }
    stop.store(true, Ordering::Relaxed);
    let (visible, _gets) = watcher
        .join()
        .map_err(|_| anyhow::anyhow!("marker watcher panicked"))??;
    let summary: Summary = produced?;
    for (post, delta) in &summary.truth {
        *truth.entry(*post).or_insert(0) += delta;
    }
    let sealed = seal(&env.brokers, topic, truth)?;
    if summary.marker_sends.len() != summary.marker_acks.len() {
        bail!(
            "{} of {} marker likes were acknowledged: with one lost, a marker's count cannot be paired with its send",
            summary.marker_acks.len(),
            summary.marker_sends.len()
        );
    }
    let mut ms: Vec<f64> = summary
        .marker_sends
        .iter()
        .zip(&visible)
        .map(|(sent, seen)| seen.saturating_duration_since(*sent).as_secs_f64() * 1e3)
        .collect();
    if ms.len() < summary.marker_acks.len() {
        bail!(
            "only {} of {} marker likes became visible within {} s of the end",
            ms.len(),
            summary.marker_acks.len(),
            patience.as_secs()
        );
    }
    let first = summary.marker_sends.first().copied();
    let mut timed: Vec<(f64, f64)> = summary
        .marker_sends
        .iter()
        .zip(&ms)
        .map(|(sent, &ms)| {
            let at = first.map_or(0.0, |first| sent.duration_since(first).as_secs_f64());
            (at, ms)
        })
        .collect();
    timed.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut slowest = [(f64::NAN, f64::NAN); SLOWEST];
    for (slot, marker) in slowest.iter_mut().zip(timed) {
        *slot = marker;
    }
    ms.sort_by(f64::total_cmp);
    let reached = (summary.acked as f64 / summary.elapsed.as_secs_f64().max(1e-9)) as u64;
    Ok(Latency {
        p50_ms: percentile(&ms, 0.5),
        p99_ms: percentile(&ms, 0.99),
        target_rate: rate,
        reached_rate: reached,
        samples: ms.len(),
        events: summary.acked + sealed,
        slowest,
        busy,
    })
}

pub(super) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}
