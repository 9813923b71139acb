//! The baselines tally is measured against, each run as a child process of
//! this binary (`tally-lab bench-baseline --baseline KIND ...`) so that its memory is its own.
//!
//! All of them use a fresh consumer group, read the topic from the start,
//! decode every message with [`tally::pipeline::decode::decode`] and never auto-commit.
//! The naive ones write `<prefix>:likes:<post>:<bucket>` (the same key layout
//! and buckets as tally) with one `INCR` or `DECR` per event, and commit each
//! partition's next offset after each poll batch. They have no fence: a crash
//! between the writes and the commit counts a batch twice.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use futures::FutureExt as _;
use rdkafka::Message as _;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rustc_hash::FxHashMap;

use super::services::{
    RedisSnapshot, busiest_thread, busy_share, cpu_secs, machine_ticks, peak_rss_kib, redis_conn,
};
use super::{BaselineArgs, Env, Measured, check_sample};
use tally::domain::routing::{CounterId, KeyLayout, bucket_of};
use tally::infra::config::{
    DEFAULT_BUCKETS, StoreSettings, kafka_client_config, with_fetch_settings,
};

/// Messages a naive consumer handles per poll: the Java client's `max.poll.records` default.
pub const NAIVE_POLL_BATCH: usize = 500;

/// Which baseline consumer a child process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Baseline {
    /// Receive and decode only; writes nothing, not even offsets.
    Raw,
    /// One INCR per event, each awaited before the next (one round trip per event).
    Naive,
    /// One INCR per event, sent as one pipeline per poll batch.
    NaivePipelined,
}

impl Baseline {
    /// The name used on the command line and in group and key prefixes.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Raw => "raw",
            Baseline::Naive => "naive",
            Baseline::NaivePipelined => "naive-pipelined",
        }
    }
}

/// Records the layout the naive consumers write, so tally's reader can
/// check their counts as it checks tally's.
async fn record_layout(store: &StoreSettings, config: &BaselineArgs) -> Result<()> {
    let none = tally::domain::windows::Windows::none();
    super::present::write_record(store, &config.topic, &config.group, DEFAULT_BUCKETS, none).await
}

/// Runs one baseline until it has handled `--events` messages (or, for the
/// naive ones, `--naive-max-secs` have passed since its first message) and
/// prints `events= secs= rss_kib= cpu_secs=` on stdout, and `machine_busy=`
/// (the share of the machine's cores busy from its first message on) when
/// `/proc/stat` gave it.
pub(super) async fn run(config: &BaselineArgs) -> Result<()> {
    let kind = config.baseline;
    let store = crate::local::store(&config.redis, &config.prefix)?;
    // tally's fetch settings, then the -X ones, as `tally run` takes them.
    let mut client = kafka_client_config(&config.brokers, &[]);
    with_fetch_settings(&mut client);
    for (key, value) in &config.kafka_config {
        client.set(key, value);
    }
    let consumer: StreamConsumer = client
        .set("group.id", &config.group)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?;
    consumer.subscribe(&[&config.topic])?;
    let mut redis = match kind {
        Baseline::Raw => None,
        _ => Some(
            redis::Client::open(store.url().target().nodes()[0].as_str())?
                .get_multiplexed_async_connection()
                .await?,
        ),
    };
    if kind != Baseline::Raw {
        record_layout(&store, config).await?;
    }
    let keys = KeyLayout::new(store.prefix());
    let cap = Duration::from_secs(config.naive_max_secs);
    let mut handled = 0u64;
    let mut first: Option<Instant> = None;
    let mut ticks_at_first = None;
    let mut key = String::with_capacity(64);
    let mut next_offsets: FxHashMap<i32, i64> = FxHashMap::default();
    while handled < config.events {
        let message = consumer.recv().await?;
        let began = *first.get_or_insert_with(|| {
            ticks_at_first = machine_ticks();
            Instant::now()
        });
        if kind != Baseline::Raw && began.elapsed() >= cap {
            break;
        }
        let mut pipe = redis::pipe();
        let mut batch = Some(message);
        let mut in_batch = 0;
        while let Some(message) = batch.take() {
            if let (Ok(like), Some(conn)) = (
                tally::pipeline::decode::decode(message.payload()),
                &mut redis,
            ) {
                let bucket = bucket_of(like.user_id, DEFAULT_BUCKETS);
                keys.write_counter_key(
                    &mut key,
                    CounterId::v0(like.post_id, bucket),
                    Default::default(),
                );
                let mut incr = redis::cmd(if like.delta > 0 { "INCR" } else { "DECR" });
                incr.arg(key.as_str());
                if kind == Baseline::Naive {
                    incr.query_async::<i64>(conn).await?;
                } else {
                    pipe.add_command(incr).ignore();
                }
            }
            next_offsets.insert(message.partition(), message.offset() + 1);
            handled += 1;
            in_batch += 1;
            if kind != Baseline::Raw && in_batch < NAIVE_POLL_BATCH && handled < config.events {
                // Whatever the client has already fetched belongs to this poll batch.
                batch = consumer.recv().now_or_never().and_then(Result::ok);
            }
        }
        if let Some(conn) = redis.as_mut() {
            if kind == Baseline::NaivePipelined {
                pipe.query_async::<()>(conn).await?;
            }
            let mut tpl = TopicPartitionList::new();
            for (&partition, &next) in &next_offsets {
                tpl.add_partition_offset(&config.topic, partition, Offset::Offset(next))?;
            }
            consumer.commit(&tpl, CommitMode::Async)?;
        }
    }
    let secs = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let busy = busy_share(ticks_at_first, machine_ticks())
        .map_or_else(String::new, |busy| format!(" machine_busy={busy:.4}"));
    let rss = peak_rss_kib("self").unwrap_or(0);
    let cpu = cpu_secs("self").unwrap_or(0.0);
    let (thread, thread_cpu) = busiest_thread("self").unwrap_or_default();
    println!(
        "events={handled} secs={secs:.6} rss_kib={rss} cpu_secs={cpu:.2}{busy} busiest_cpu_secs={thread_cpu:.2} busiest_thread={}",
        thread.replace(char::is_whitespace, "_")
    );
    Ok(())
}

/// Runs a baseline child on the whole backlog of `topic` and parses its figures;
/// with `present`, into a prefix whose counters exist ([`super::present`]).
pub(super) fn measure(
    kind: Baseline,
    env: &Env,
    topic: &str,
    name: &str,
    truth: &FxHashMap<u64, i64>,
    total: u64,
    present: bool,
) -> Result<Measured> {
    let mut conn = redis_conn(&env.redis)?;
    redis::cmd("FLUSHALL").arg("SYNC").query::<()>(&mut conn)?;
    let prefix = if present {
        format!("{name}-{}-present", kind.name())
    } else {
        format!("{name}-{}", kind.name())
    };
    if present {
        super::present::seed(&mut conn, &prefix, truth, DEFAULT_BUCKETS)?;
    }
    let before = RedisSnapshot::take(&mut conn)?;
    let broker_before = cpu_secs(&env.broker_pid);
    let output = crate::binaries::lab_command_on(env.cpus.as_deref())?
        .arg("bench-baseline")
        .args(["--baseline", kind.name()])
        .args([
            "--brokers",
            &env.brokers,
            "--topic",
            topic,
            "--group",
            &prefix,
        ])
        .args(["--redis", &env.redis, "--prefix", &prefix])
        .args(["--events", &total.to_string()])
        .args(["--naive-max-secs", &env.naive_max_secs.to_string()])
        .args(&env.kafka_args)
        .output()
        .context("running a baseline consumer")?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "the {} consumer failed ({}): {text}{}",
            kind.name(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let field = |name: &str| -> Option<f64> {
        text.split_whitespace()
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
    };
    let events = field("events").context("baseline output lacks events=")? as u64;
    let after = RedisSnapshot::take(&mut conn)?;
    let broker_after = cpu_secs(&env.broker_pid);
    let writes = kind != Baseline::Raw;
    let complete = events == total;
    Ok(Measured {
        events,
        secs: field("secs").unwrap_or(0.0),
        complete,
        redis: writes.then(|| (after.delta(&before), after.cpu_secs - before.cpu_secs)),
        rss_kib: field("rss_kib").map(|v| v as u64),
        consumer_cpu: field("cpu_secs").map(|cpu| (cpu, events)),
        broker_cpu: broker_before.zip(broker_after).map(|(b, a)| a - b),
        latency: None,
        stages: Vec::new(),
        hot: None,
        writes: writes.then_some(events),
        keys_created: writes.then(|| after.keys.saturating_sub(before.keys)),
        busiest_thread: text
            .split_whitespace()
            .find_map(|f| f.strip_prefix("busiest_thread="))
            .zip(field("busiest_cpu_secs"))
            .map(|(name, cpu)| {
                (
                    name.to_string(),
                    cpu / field("secs").unwrap_or(0.0).max(1e-9),
                )
            }),
        checked: if writes && complete {
            Some(check_sample(&env.redis, &prefix, truth)?)
        } else {
            None
        },
        machine_busy: field("machine_busy"),
        reading: None,
    })
}
