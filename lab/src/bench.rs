//! Bench: `tally-lab bench`, tally against its ceiling and the obvious alternative,
//! on the same events, in one run.
//!
//! For each workload (Zipf popularity; Zipf plus a viral reel) it starts its
//! own Apache Kafka broker and redis-server on free loopback ports, produces the
//! events once into a topic, and then lets these consumers read that same
//! backlog from the start, each in its own process, group and key prefix:
//!
//! * **raw**: a consumer group that receives and decodes, and writes nothing
//!   (not even offsets): the broker's and the client's ceiling;
//! * **naive**: one `INCR`/`DECR` per event on tally's key layout, each
//!   awaited before the next, offsets committed after each poll batch (up to
//!   [`NAIVE_POLL_BATCH`] messages already fetched, the Java client's
//!   `max.poll.records` default): what most teams write first;
//! * **naive, pipelined**: the same commands sent as one pipeline per poll
//!   batch, the first optimisation such a team makes. Neither naive consumer
//!   has a fence, so neither is exactly-once across a crash;
//! * **tally**: `tally run` with its defaults, as a user starts it;
//! * **Kafka Streams** (with `--streams-peer`): the exactly_once_v2 application
//!   of scripts/streams-peer as a child JVM, on Kafka's defaults ([`streams`]).
//!
//! The pipelined naive consumer and tally read the backlog once more, each into
//! a prefix whose counters exist before they start ([`present`]), so the cost
//! of counting is seen apart from the cost of creating keys. Every pass but
//! tally's with the defaults reads the backlog alone; that one goes on to the
//! latency phase, which adds to the topic.
//!
//! It reports events/s (from the first event handled, or for tally from its
//! partition assignment, to the last, so the group join is excluded; the
//! naive consumers stop after `--naive-max-secs`), CPU per event of the
//! consumer and of the broker (`/proc/PID/stat`), Redis calls per event
//! (`INFO commandstats` delta; calls made inside Lua scripts count too, and the
//! benchmark's own polling is subtracted), Redis CPU seconds per million
//! events (`INFO cpu` delta), peak RSS of the consumer process (`VmHWM`), and
//! for tally the produce-to-visible latency of a marker post while new events
//! arrive at a fixed rate, and on the viral workload the writes per second of
//! the busiest key and primary ([`hotkeys`]), and at that same rate the cost
//! against scale: 1 and 2 `tally run` processes in one group, each row on a
//! topic of its own ([`fleet`]), beside simulated rows for what the machine's
//! cores cannot run ([`scale`]). Counts of a sample of posts are checked against the
//! producer's truth. Broker, Redis, producer and consumers share the machine's
//! cores, so the report names the machine; the CPU columns show who is busy.
//!
//! Last, each consumer that keeps counts (the pipelined naive one, tally and
//! Kafka Streams) reads the whole topic once more, is killed with SIGKILL
//! half-way and restarted, and every post's count is compared with the truth
//! ([`kill`]).
//!
//! With `--reread WINDOW` (repeatable; `--reread-only` skips the workloads), a
//! group of `tally run --dedupe ids` processes is scaled 1 → 4 → 1 under load,
//! and each partition that changes hands is timed: how long its counts pause,
//! from its assignment to its first apply, and the re-read of its dedupe
//! window ([`reread`]); window 0 scales the group without dedupe. The table
//! has a block of its own.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use rustc_hash::FxHashMap;

use crate::binaries::Tally;
use crate::local;
use crate::markdown::thousands;
use crate::produce::{Plan, parse_key_value, progress_bar, send};
use latency::Latency;
use report::{render, write_between_markers};
use services::{start_kafka, start_redis};
use tally::read::Reader;
use tally_lab::generate::TrafficShape;
use tally_run::LatencyPlan;

mod baseline;
mod fleet;
mod group_watch;
mod hotkeys;
mod kill;
mod latency;
mod peer_records;
mod present;
mod report;
mod reread;
mod scale;
pub(crate) mod services;
mod stages;
mod streams;
mod tally_run;

pub use baseline::{Baseline, NAIVE_POLL_BATCH};
use services::{create_topic, seal};

/// Settings of `tally-lab bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchConfig {
    /// Events in each workload's backlog (every consumer reads all of them).
    #[arg(long, default_value_t = 5_000_000)]
    pub events: u64,

    /// Posts of both workloads (ids 1..=posts).
    #[arg(long, default_value_t = 1_000_000)]
    pub posts: u64,

    /// Zipf exponent s of post popularity.
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,

    /// Likes per second of the viral reel during the latency phase; sets its share of the traffic.
    #[arg(long, default_value_t = 9_000)]
    pub viral_rate: u64,

    /// Partitions of each workload's topic.
    #[arg(long, default_value_t = 8)]
    pub partitions: u32,

    /// Stop the naive consumer after this many seconds; its figures cover what it read.
    #[arg(long, default_value_t = 30)]
    pub naive_max_secs: u64,

    /// Length of tally's fixed-rate latency phase, in seconds.
    #[arg(long, default_value_t = 20)]
    pub latency_secs: u64,

    /// Rate of the latency phase, as a fraction of the maximum rate: the lower of tally's
    /// measured Zipf rate and the rate the producer wrote the Zipf backlog at.
    #[arg(long, default_value_t = 0.5)]
    pub latency_load: f64,

    /// librdkafka setting for every consumer measured, raw, naive and tally alike; repeatable:
    /// -X fetch.wait.max.ms=10. The report lists them.
    #[arg(short = 'X', long = "kafka-config", value_parser = parse_key_value)]
    pub kafka_config: Vec<(String, String)>,

    /// librdkafka setting for the producers that write the workloads, repeatable:
    /// -P linger.ms=50. Larger record batches raise what a broker can hand a consumer per fetch.
    #[arg(short = 'P', long = "producer-config", value_parser = parse_key_value)]
    pub producer_config: Vec<(String, String)>,

    /// Argument for the measured `tally run`, repeatable: --tally-arg=--buckets=1. Without any,
    /// tally runs with its defaults; the report names the arguments.
    #[arg(long = "tally-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub tally_args: Vec<String>,

    /// Another `tally run` to measure on each backlog, as its arguments in one string;
    /// repeatable: --variant "--buckets 16". The defaults and every variant read the backlog
    /// twice, in the order defaults, variants, variants in reverse, defaults; their rows show
    /// the backlog's figures (no latency phase), and a variant's ratio to the defaults takes
    /// both passes of each, so each setting's effect sits beside the defaults.
    #[arg(long = "variant", value_name = "ARGS", allow_hyphen_values = true)]
    pub variants: Vec<String>,

    /// A valkey-server binary: the pipelined naive consumer and `tally run` with the defaults
    /// read each backlog once more into a Valkey server it starts, so both stores' Redis CPU
    /// rows sit side by side (scripts/bench fetches Valkey and passes it).
    #[arg(long, env = "TALLY_VALKEY_SERVER", value_name = "PATH")]
    pub valkey_server: Option<PathBuf>,

    /// The Kafka Streams peer, built (`ensure_streams_peer` in scripts/lib.sh builds
    /// scripts/streams-peer and sets STREAMS_PEER_HOME): it counts each workload too, with
    /// exactly_once_v2, for a row beside tally's and a SIGKILL test of its own.
    #[arg(long, env = "STREAMS_PEER_HOME", value_name = "DIR")]
    pub streams_peer: Option<PathBuf>,

    /// Measure the re-read of the dedupe window at a rebalance with a window of this many
    /// offsets, repeatable (--reread 100000 --reread 1000000): a group of `tally run --dedupe
    /// ids --dedupe-window W` processes scales 1 → 4 → 1 under load on a topic of its own, and
    /// a table gives each moved partition's pause, its time from assignment to first apply
    /// and its re-read. Window 0 scales the group without dedupe. Not measured unless given.
    #[arg(long = "reread", value_name = "WINDOW")]
    pub reread: Vec<u64>,

    /// Events per second produced while the group of `--reread` scales.
    #[arg(long, default_value_t = 20_000)]
    pub reread_rate: u64,

    /// Measure `--reread` alone, without the workloads and their table.
    #[arg(long, requires = "reread")]
    pub reread_only: bool,

    /// Scale the group of `--reread` on the Valkey server of `--valkey-server` instead of
    /// redis-server.
    #[arg(long, requires_all = ["reread", "valkey_server"])]
    pub reread_on_valkey: bool,

    /// Also write the table into this Markdown file, between its `bench:begin`/`bench:end` markers
    /// (and the `--reread` table between `reread:begin`/`reread:end`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Keeps every measured consumer (the baselines and each `tally run`) on these CPUs,
    /// a `taskset -c` list such as `0` or `0,1`; the broker, the stores and the producers
    /// keep every core. For the table of events/s against cores.
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<String>,
}

impl BenchConfig {
    fn validate(&self) -> Result<(), String> {
        let bad = |flag: &str, problem: &str| Err(format!("--{flag}: {problem}"));
        if self.events < 1000 {
            return bad("events", "must be at least 1000");
        }
        if self.posts == 0 || !(self.zipf.is_finite() && self.zipf > 0.0) {
            return bad("posts", "--posts and --zipf must be positive");
        }
        if self.partitions == 0 {
            return bad("partitions", "must be at least 1");
        }
        if !(self.latency_load > 0.0 && self.latency_load <= 1.0) {
            return bad("latency-load", "must be above 0 and at most 1");
        }
        if self.latency_secs == 0 || self.naive_max_secs == 0 {
            return bad(
                "latency-secs",
                "--latency-secs and --naive-max-secs must be at least 1",
            );
        }
        let most = tally::pipeline::dedupe::MAX_WINDOW;
        if self
            .reread
            .iter()
            .any(|&w| w != 0 && !(1000..=most).contains(&w))
        {
            return bad(
                "reread",
                &format!("a window is 1000 to {most} offsets, or 0 for none"),
            );
        }
        if let Some(cpus) = &self.cpus {
            let runs = std::process::Command::new("taskset")
                .args(["-c", cpus, "true"])
                .status();
            if !runs.is_ok_and(|s| s.success()) {
                return bad(
                    "cpus",
                    &format!(
                        "`taskset -c {cpus} true` failed: give CPUs this machine has (taskset comes with util-linux: apt-get install util-linux)"
                    ),
                );
            }
        }
        if self.reread_rate == 0 {
            return bad("reread-rate", "must be at least 1");
        }
        if let Some(problem) = self
            .streams_peer
            .as_deref()
            .and_then(streams::Peer::problem)
        {
            return bad("streams-peer", &problem);
        }
        Ok(())
    }
}

/// The services and settings shared by every phase.
struct Env {
    brokers: String,
    redis: String,
    naive_max_secs: u64,
    dir: PathBuf,
    broker_pid: String,
    /// `-X key=value` arguments for every consumer.
    kafka_args: Vec<String>,
    /// librdkafka settings of the producers that write each workload.
    producer_config: Vec<(String, String)>,
    /// Extra arguments of the measured `tally run`.
    tally_args: Vec<String>,
    /// The `tally` binary measured.
    tally: Tally,
    /// The Valkey server the second store's rows use, and its version.
    valkey: Option<(String, String)>,
    /// The CPUs every measured consumer is kept on (`--cpus`).
    cpus: Option<String>,
}

impl Env {
    /// The same services and settings, with the consumers writing to the store at `url`.
    fn on_store(&self, url: &str) -> Env {
        Env {
            brokers: self.brokers.clone(),
            redis: url.to_string(),
            naive_max_secs: self.naive_max_secs,
            dir: self.dir.clone(),
            broker_pid: self.broker_pid.clone(),
            kafka_args: self.kafka_args.clone(),
            producer_config: self.producer_config.clone(),
            tally_args: self.tally_args.clone(),
            tally: self.tally.clone(),
            valkey: None,
            cpus: self.cpus.clone(),
        }
    }

    /// Starts `tally run` on `topic` with this run's services and Kafka settings, under
    /// `group` and `prefix`, serving metrics on `metrics`, with `args` added; its log goes
    /// to `log`.
    fn spawn_tally_run(
        &self,
        names: [&str; 3],
        metrics: std::net::SocketAddr,
        args: &[String],
        log: std::fs::File,
    ) -> Result<std::process::Child> {
        let [topic, group, prefix] = names;
        self.tally
            .command_on(self.cpus.as_deref())
            .arg("run")
            .args([
                "--brokers",
                &self.brokers,
                "--topic",
                topic,
                "--group",
                group,
            ])
            .args(["--redis", &self.redis, "--prefix", prefix])
            .args(["--metrics-addr", &metrics.to_string()])
            .args(&self.kafka_args)
            .args(args)
            .env("TALLY_LOG", "info,rdkafka=warn")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting tally run")
    }
}

/// What one consumer achieved on one workload.
#[derive(Debug, Clone, Default)]
struct Measured {
    events: u64,
    secs: f64,
    complete: bool,
    redis: Option<(Vec<(String, u64)>, f64)>,
    rss_kib: Option<u64>,
    /// CPU seconds of the consumer process, and events it handled meanwhile.
    consumer_cpu: Option<(f64, u64)>,
    /// CPU seconds the broker used during the phase.
    broker_cpu: Option<f64>,
    latency: Option<Latency>,
    /// Where the latency phase's time went, by stage (tally only).
    stages: Vec<stages::StageFigure>,
    checked: Option<(usize, usize)>,
    /// Writes to the busiest key and primary, for a workload with a viral post (tally only).
    hot: Option<hotkeys::HotKeys>,
    /// Counter writes made while reading the backlog (tally's `tally_increments_total`;
    /// the naive consumers write one per event).
    writes: Option<u64>,
    /// Keys Redis gained while the backlog was read: the counters created.
    keys_created: Option<u64>,
    /// The consumer's busiest thread while it read the backlog: its name
    /// and the share of one core it used.
    busiest_thread: Option<(String, f64)>,
    /// The share of the machine's cores busy (every process, not only the
    /// consumer) over the span its events/s are timed on: the raw and naive
    /// consumers' first message to their last, tally's assignment to its
    /// last script.
    machine_busy: Option<f64>,
    /// tally only: messages it read from its first message to the backlog's
    /// last, and the seconds between (`tally_messages_read_total`), timed as
    /// the raw consumer is.
    reading: Option<(u64, f64)>,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.events as f64 / self.secs.max(1e-9)
    }

    /// Messages per second while reading, when known.
    fn reading_rate(&self) -> Option<f64> {
        let (messages, secs) = self.reading?;
        Some(messages as f64 / secs.max(1e-9))
    }

    fn calls_per_event(&self) -> Option<f64> {
        let (calls, _) = self.redis.as_ref()?;
        Some(calls.iter().map(|(_, n)| n).sum::<u64>() as f64 / self.events.max(1) as f64)
    }

    fn writes_per_event(&self) -> Option<f64> {
        Some(self.writes? as f64 / self.events.max(1) as f64)
    }

    fn consumer_cpu_per_million(&self) -> Option<f64> {
        let (cpu, events) = self.consumer_cpu?;
        Some(cpu * 1e6 / events.max(1) as f64)
    }

    fn broker_cpu_per_million(&self) -> Option<f64> {
        Some(self.broker_cpu? * 1e6 / self.events.max(1) as f64)
    }

    fn keys_created_per_event(&self) -> Option<f64> {
        Some(self.keys_created? as f64 / self.events.max(1) as f64)
    }

    fn cpu_per_million(&self) -> Option<f64> {
        let (_, cpu) = self.redis.as_ref()?;
        Some(cpu * 1e6 / self.events.max(1) as f64)
    }
}

/// The `--variant` runs of one workload, each against the defaults measured
/// beside it. Backlog passes run in the order: the defaults, every variant,
/// every variant again in reverse, the defaults again; so each variant's two
/// passes sit as near the defaults' two as each other's, and a slow stretch
/// of the machine weighs on both sides of a ratio alike.
struct Variants {
    /// `tally run` with the measured arguments: the first pass and the last.
    defaults: [Measured; 2],
    /// Each variant's arguments and its two passes.
    runs: Vec<(String, [Measured; 2])>,
}

impl Variants {
    /// A run's events/s against the defaults': both passes of each side.
    fn rate_ratio(&self, passes: &[Measured; 2]) -> f64 {
        let sum = |m: &[Measured; 2]| m[0].rate() + m[1].rate();
        sum(passes) / sum(&self.defaults).max(1e-9)
    }
}

/// Everything measured on one workload.
struct Outcome {
    title: String,
    events: u64,
    produce_rate: f64,
    raw: Measured,
    naive: Measured,
    pipelined: Measured,
    tally: Measured,
    /// `--variant` runs and the defaults beside them, when any was asked for.
    variants: Option<Variants>,
    /// The pipelined naive consumer and `tally run` on the backlog again, each
    /// into a prefix whose counters exist ([`present`]).
    present: (Measured, Measured),
    /// On the second store (`--valkey-server`): its version, then the pipelined
    /// naive consumer and `tally run` with the defaults on the backlog.
    valkey: Option<(String, Measured, Measured)>,
    /// The workload's traffic.
    shape: TrafficShape,
    /// `tally run` processes in one group at the latency phase's rate ([`fleet`]).
    fleet: Vec<fleet::Row>,
    /// The Kafka Streams peer (`--streams-peer`): its row and checks.
    streams: Option<streams::Figures>,
    /// The SIGKILL tests ([`kill`]): the pipelined naive consumer, tally, Kafka Streams.
    killed: Vec<kill::Killed>,
}

/// Settings of one baseline consumer, a child process of `tally-lab bench`
/// (the hidden command `tally-lab bench-baseline`).
#[derive(Clone, Args)]
pub struct BaselineArgs {
    /// Which baseline to run.
    #[arg(long, value_enum)]
    pub baseline: Baseline,
    /// Bootstrap servers.
    #[arg(long)]
    pub brokers: String,
    /// Topic to read.
    #[arg(long)]
    pub topic: String,
    /// Consumer group.
    #[arg(long)]
    pub group: String,
    /// Messages to handle before printing the figures.
    #[arg(long)]
    pub events: u64,
    /// Stop a naive consumer after this many seconds.
    #[arg(long)]
    pub naive_max_secs: u64,
    /// librdkafka setting, repeatable.
    #[arg(short = 'X', long = "kafka-config", value_parser = parse_key_value)]
    pub kafka_config: Vec<(String, String)>,
    /// The redis-server the naive consumers write to.
    #[arg(long)]
    pub redis: String,
    /// Key prefix of the naive consumers' counters.
    #[arg(long)]
    pub prefix: String,
}

/// Runs one baseline child.
pub async fn baseline(args: BaselineArgs) -> Result<()> {
    baseline::run(&args).await
}

/// Runs `tally-lab bench` on the `tally` binary `tally` names.
pub async fn bench(config: BenchConfig, tally: Tally) -> Result<()> {
    config.validate().map_err(anyhow::Error::msg)?;
    let dir = tempfile::Builder::new().prefix("tally-bench").tempdir()?;
    local::clean_up_on_signal(dir.path().to_path_buf())?;
    tokio::task::spawn_blocking(move || bench_blocking(config, tally, dir))
        .await
        .context("the benchmark thread failed")?
}

fn bench_blocking(config: BenchConfig, tally: Tally, dir: tempfile::TempDir) -> Result<()> {
    let (_redis, redis) = start_redis(dir.path())?;
    let (_valkey, valkey) = match &config.valkey_server {
        Some(program) => {
            let (service, url) = local::start_store_in(program, dir.path(), "valkey")?;
            let version = services::store_version(&url)?;
            (Some(service), Some((url, version)))
        }
        None => (None, None),
    };
    let (kafka, brokers) = start_kafka(dir.path())?;
    let env = Env {
        brokers,
        redis,
        naive_max_secs: config.naive_max_secs,
        dir: dir.path().to_path_buf(),
        broker_pid: kafka.pid().to_string(),
        kafka_args: config
            .kafka_config
            .iter()
            .flat_map(|(k, v)| ["-X".to_string(), format!("{k}={v}")])
            .collect(),
        producer_config: config.producer_config.clone(),
        tally_args: config.tally_args.clone(),
        tally,
        valkey,
        cpus: config.cpus.clone(),
    };
    eprintln!(
        "broker {}, redis {}, logs in {}",
        env.brokers,
        env.redis,
        env.dir.display()
    );
    if !config.reread_only {
        workloads(&env, &config)?;
    }
    if !config.reread.is_empty() {
        let store = match (&env.valkey, config.reread_on_valkey) {
            (Some((url, _)), true) => env.on_store(url),
            _ => env.on_store(&env.redis),
        };
        let measured = reread::measure(&store, &config)?;
        let report = reread::render(&config, &store, &measured)?;
        println!("{report}");
        if let Some(path) = &config.out {
            reread::write_between_markers(path, &report)?;
            eprintln!("re-read table written to {}", path.display());
        }
    }
    Ok(())
}

/// The two workloads, measured and reported.
fn workloads(env: &Env, config: &BenchConfig) -> Result<()> {
    let shape = TrafficShape {
        posts: config.posts,
        zipf_exponent: config.zipf,
        viral_share: 0.0,
        ..TrafficShape::default()
    };
    let latency = LatencyPlan {
        rate: None,
        load: config.latency_load,
        secs: config.latency_secs,
        producer_rate: None,
    };
    let title = format!(
        "Zipf: s = {} over {} posts",
        config.zipf,
        thousands(config.posts)
    );
    let zipf = workload(env, config, "zipf", title, &shape, &latency)?;
    // The viral reel gets `viral_rate` likes/s at the latency phase's rate,
    // which both workloads share.
    let rate = zipf.tally.latency.map_or(1, |l| l.target_rate).max(1);
    let viral_share = (config.viral_rate as f64 / rate as f64).min(0.5);
    let shape = TrafficShape {
        viral_share,
        ..shape
    };
    let title = format!(
        "Viral reel: the same Zipf traffic plus post {} taking {:.1}% of events ({} likes/s at {} events/s)",
        shape.viral_post,
        viral_share * 100.0,
        thousands((viral_share * rate as f64).round() as u64),
        thousands(rate)
    );
    let latency = LatencyPlan {
        rate: Some(rate),
        ..latency
    };
    let viral = workload(env, config, "viral", title, &shape, &latency)?;
    let report = render(config, env, &[zipf, viral])?;
    println!("{report}");
    if let Some(path) = &config.out {
        write_between_markers(path, &report)?;
        eprintln!("table written to {}", path.display());
    }
    Ok(())
}

fn workload(
    env: &Env,
    config: &BenchConfig,
    name: &str,
    title: String,
    shape: &TrafficShape,
    latency: &LatencyPlan,
) -> Result<Outcome> {
    let topic = format!("likes-{name}");
    create_topic(&env.brokers, &topic, config.partitions)?;
    let plan = Plan {
        shape: shape.clone(),
        seed: 42,
        events: Some(config.events),
        duration: None,
        rate: None,
        marker: None,
    };
    let bar = progress_bar(Some(config.events), &format!("{name}: producing"));
    let produced = send(
        &env.brokers,
        &topic,
        &env.producer_config,
        &plan,
        &AtomicBool::new(false),
        &bar,
    )?;
    if produced.failed > 0 {
        bail!(
            "{} events were not acknowledged by the broker",
            produced.failed
        );
    }
    let produce_rate = produced.acked as f64 / produced.elapsed.as_secs_f64().max(1e-9);
    eprintln!(
        "{name}: {} events produced at {produce_rate:.0}/s",
        produced.acked
    );
    let mut truth = produced.truth;
    let backlog = produced.acked + seal(&env.brokers, &topic, &mut truth)?;
    let measure = |kind: Baseline, present: bool| {
        let counters = if present { ", counters present" } else { "" };
        eprintln!("{name}: {} consumer{counters}...", kind.name());
        baseline::measure(kind, env, &topic, name, &truth, backlog, present)
    };
    let raw = measure(Baseline::Raw, false)?;
    let naive = measure(Baseline::Naive, false)?;
    let pipelined = measure(Baseline::NaivePipelined, false)?;
    let pipelined_present = measure(Baseline::NaivePipelined, true)?;
    // The backlog-only runs go first, while the topic holds the backlog alone.
    let variants = match config.variants.is_empty() {
        true => None,
        false => {
            let pass = |label: String, args: &[String]| {
                let shown = match args.is_empty() {
                    true => "with the measured arguments".to_string(),
                    false => args.join(" "),
                };
                eprintln!("{name}: tally run {shown}, backlog pass {label}...");
                let run = tally_run::Variant {
                    name: format!("{name}-{label}"),
                    args,
                    present: false,
                };
                tally_run::measure_backlog(env, &topic, &run, config.partitions, &truth)
            };
            let args: Vec<Vec<String>> = config
                .variants
                .iter()
                .map(|a| a.split_whitespace().map(String::from).collect())
                .collect();
            let first = pass("d1".into(), &env.tally_args)?;
            let mut firsts = Vec::new();
            for (i, a) in args.iter().enumerate() {
                firsts.push(pass(format!("v{i}-1"), a)?);
            }
            let mut seconds = Vec::new();
            for (i, a) in args.iter().enumerate().rev() {
                seconds.push(pass(format!("v{i}-2"), a)?);
            }
            seconds.reverse();
            let last = pass("d2".into(), &env.tally_args)?;
            let runs = args
                .iter()
                .zip(firsts.into_iter().zip(seconds))
                .map(|(a, (one, two))| (a.join(" "), [one, two]))
                .collect();
            Some(Variants {
                defaults: [first, last],
                runs,
            })
        }
    };
    let valkey = match &env.valkey {
        Some((url, version)) => {
            let on_valkey = env.on_store(url);
            eprintln!("{name}: naive, pipelined, on Valkey {version}...");
            let naive = baseline::measure(
                Baseline::NaivePipelined,
                &on_valkey,
                &topic,
                &format!("{name}-valkey"),
                &truth,
                backlog,
                false,
            )?;
            eprintln!("{name}: tally run, on Valkey {version}...");
            let run = tally_run::Variant {
                name: format!("{name}-valkey"),
                args: &env.tally_args,
                present: false,
            };
            let tally =
                tally_run::measure_backlog(&on_valkey, &topic, &run, config.partitions, &truth)?;
            Some((version.clone(), naive, tally))
        }
        None => None,
    };
    eprintln!("{name}: tally run, counters present...");
    let run = tally_run::Variant {
        name: format!("{name}-present"),
        args: &env.tally_args,
        present: true,
    };
    let tally_present = tally_run::measure_backlog(env, &topic, &run, config.partitions, &truth)?;
    let peer = config.streams_peer.as_deref().map(streams::Peer::new);
    let streams_backlog = match &peer {
        Some(peer) => {
            eprintln!("{name}: Kafka Streams...");
            let partitions = config.partitions;
            Some(streams::measure_backlog(
                peer, env, &topic, name, partitions, &truth,
            )?)
        }
        None => None,
    };
    eprintln!("{name}: tally run...");
    let tally = tally_run::measure(
        env,
        &topic,
        name,
        config.partitions,
        &mut truth,
        shape,
        &LatencyPlan {
            producer_rate: Some(produce_rate),
            ..*latency
        },
    )?;
    let fleet = match tally.latency {
        Some(l) => fleet::measure(env, name, shape, l.target_rate, config.latency_secs)?,
        None => Vec::new(),
    };
    eprintln!("{name}: SIGKILL half-way, naive pipelined...");
    let mut killed = vec![kill::naive(env, &topic, name, config.partitions, &truth)?];
    eprintln!("{name}: SIGKILL half-way, tally run...");
    killed.push(kill::tally(env, &topic, name, config.partitions, &truth)?);
    let streams = match (&peer, streams_backlog) {
        (Some(peer), Some(backlog)) => {
            eprintln!("{name}: SIGKILL half-way, Kafka Streams...");
            let rate = tally.latency.map_or(1, |l| l.target_rate);
            let (figures, streams_killed) = streams::killed_then_timed(
                peer,
                env,
                &topic,
                name,
                config.partitions,
                &mut truth,
                shape,
                (rate, config.latency_secs),
                backlog,
            )?;
            killed.push(streams_killed);
            Some(figures)
        }
        _ => None,
    };
    Ok(Outcome {
        title,
        events: produced.acked,
        produce_rate,
        raw,
        naive,
        pipelined,
        tally,
        variants,
        present: (pipelined_present, tally_present),
        valkey,
        shape: shape.clone(),
        fleet,
        streams,
        killed,
    })
}

/// Compares a sample of posts (the 100 largest, the viral post among them, the
/// marker post, and an even spread of the rest) with the truth, read the way
/// users read counts (`read::Reader`: the base buckets plus every routing
/// version of a promoted post); returns (checked, wrong).
fn check_sample(
    redis_url: &str,
    prefix: &str,
    truth: &FxHashMap<u64, i64>,
) -> Result<(usize, usize)> {
    let mut posts: Vec<(u64, i64)> = truth.iter().map(|(&p, &c)| (p, c)).collect();
    posts.sort_unstable_by_key(|&(p, c)| (std::cmp::Reverse(c), p));
    let step = (posts.len() / 1000).max(1);
    let mut sample: Vec<(u64, i64)> = posts.iter().take(100).copied().collect();
    sample.extend(posts.iter().skip(100).step_by(step).copied());
    if let Some(&count) = truth.get(&latency::MARKER_POST) {
        sample.push((latency::MARKER_POST, count));
    }
    let ids: Vec<u64> = sample.iter().map(|&(post, _)| post).collect();
    let counts = tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current().block_on(async {
            let settings = crate::local::store(redis_url, prefix)?;
            let (opened, record) = tally::domain::layout::open_for_reading(&settings).await?;
            let reader = Reader::new(opened.store, opened.keys, record.buckets, Duration::ZERO);
            let mut counts = Vec::with_capacity(ids.len());
            for chunk in ids.chunks(500) {
                counts.extend(reader.counts(chunk).await?);
            }
            anyhow::Ok(counts)
        })
    })?;
    let mut wrong = 0;
    for (&(post, want), count) in sample.iter().zip(&counts) {
        let got = count.likes;
        if got != want {
            wrong += 1;
            if wrong <= 3 {
                tracing::warn!(post, want, got, prefix, "Count differs from the truth.");
            }
        }
    }
    Ok((sample.len(), wrong))
}
