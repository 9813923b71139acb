//! tally under test: `tally run` with its defaults as a child process, followed
//! through its fences in Redis, then timed end to end with a marker post.
//!
//! Progress is read from the fences alone (the last offset applied per
//! partition), so the figures need nothing from tally's own counters: the
//! backlog is consumed when every fence has reached its partition's high
//! watermark. One figure beside them comes from tally: the rate it read the
//! backlog at (`tally_messages_read_total`), from its first message to its
//! last, as the raw consumer is timed. The latency is from the broker's
//! acknowledgement of a marker like to the moment a `GET` of the marker's
//! counter key (polled every millisecond) shows it; the marker's likes all
//! come from one user, so they share one partition, arrive in order and land
//! in one key. The phase and its probe are shared with Kafka Streams
//! ([`super::latency`]).

use std::fs::File;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use rustc_hash::FxHashMap;

use super::latency::{Latency, MARKER_POST, MARKER_USER, Probe, timed_phase};
use super::services::{
    RedisSnapshot, Ticks, busiest_thread, busy_share, cpu_secs, machine_ticks, peak_rss_kib,
    redis_conn, terminate, watermarks,
};
use super::{Env, Measured, check_sample, hotkeys, stages};
use crate::local::free_port;
use tally::domain::routing::{KeyLayout, bucket_of};
use tally::infra::config::DEFAULT_BUCKETS;
use tally_lab::generate::TrafficShape;

/// Follows a `tally run` child through its fences in Redis.
struct FenceWatch {
    conn: redis::Connection,
    mget: redis::Cmd,
    /// Commands this watch sent, to subtract from the server's figures.
    sent: u64,
}

impl FenceWatch {
    fn new(url: &str, prefix: &str, group: &str, topic: &str, partitions: u32) -> Result<Self> {
        let keys = KeyLayout::new(prefix);
        let mut mget = redis::cmd("MGET");
        for p in 0..partitions as i32 {
            mget.arg(keys.fence_key(group, topic, p, 0));
        }
        Ok(Self {
            conn: redis_conn(url)?,
            mget,
            sent: 0,
        })
    }

    /// Messages applied so far, given each partition's `[low, high)`.
    fn applied(&mut self, marks: &[(i64, i64)]) -> Result<u64> {
        self.sent += 1;
        let fences: Vec<Option<i64>> = self.mget.query(&mut self.conn)?;
        Ok(fences
            .iter()
            .zip(marks)
            .map(|(fence, &(low, high))| {
                fence.map_or(0, |f| ((f + 1).min(high) - low).max(0) as u64)
            })
            .sum())
    }

    /// Polls until every partition's fence reaches its high watermark, and
    /// the messages `tally` says it read (when its metrics are given).
    fn until_caught_up(
        &mut self,
        marks: &[(i64, i64)],
        child: &mut Child,
        log: Option<&Path>,
        metrics: Option<SocketAddr>,
    ) -> Result<Pass> {
        let total: u64 = marks.iter().map(|&(low, high)| (high - low) as u64).sum();
        // When consuming started, the messages applied then, and the
        // machine's ticks then.
        let mut first: Option<(Instant, u64, Option<Ticks>)> = None;
        let mut reads = metrics.map(Reads::new);
        let (mut last_progress, mut last_applied) = (Instant::now(), u64::MAX);
        loop {
            let applied = self.applied(marks)?;
            let now = Instant::now();
            if let Some(reads) = reads.as_mut() {
                reads.sample(now, total);
            }
            if first.is_none() {
                let assigned = log.is_some_and(|log| {
                    std::fs::read_to_string(log).is_ok_and(|t| t.contains("Partitions assigned"))
                });
                if assigned || applied > 0 {
                    first = Some((now, applied, machine_ticks()));
                }
            }
            if applied >= total {
                let (started, applied_then, ticks) = first.unwrap_or((now, applied, None));
                return Ok(Pass {
                    started,
                    applied_then,
                    done: now,
                    machine_busy: busy_share(ticks, machine_ticks()),
                    reading: reads.and_then(|reads| reads.figures(total)),
                });
            }
            if applied != last_applied {
                (last_progress, last_applied) = (now, applied);
            }
            if let Ok(Some(status)) = child.try_wait() {
                bail!("tally run exited ({status}) at {applied} of {total} events");
            }
            if last_progress.elapsed() > Duration::from_secs(120) {
                bail!("tally run made no progress for 120 s at {applied} of {total} events");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One pass of `tally run` over a backlog, as [`FenceWatch::until_caught_up`] saw it.
struct Pass {
    /// When consuming started: tally's log saying its partitions were
    /// assigned, or else the first fence seen.
    started: Instant,
    /// Messages applied at `started`.
    applied_then: u64,
    /// When every fence reached its high watermark.
    done: Instant,
    /// The share of the machine's cores busy from `started` to `done`.
    machine_busy: Option<f64>,
    /// Messages read from the first to the backlog's last, and the seconds between.
    reading: Option<(u64, f64)>,
}

/// tally's `tally_messages_read_total` over a pass: when it first rose above
/// zero and when it reached the backlog's size, read as often as the fences.
struct Reads {
    metrics: SocketAddr,
    first: Option<(Instant, u64)>,
    last: Option<Instant>,
}

impl Reads {
    fn new(metrics: SocketAddr) -> Self {
        Self {
            metrics,
            first: None,
            last: None,
        }
    }

    /// Reads the counter once; a child not serving yet is no sample.
    fn sample(&mut self, now: Instant, total: u64) {
        if self.last.is_some() {
            return;
        }
        let Ok(read) = stages::counter(self.metrics, "tally_messages_read_total") else {
            return;
        };
        let read = read as u64;
        if read > 0 && self.first.is_none() {
            self.first = Some((now, read));
        }
        if read >= total {
            self.last = Some(now);
        }
    }

    /// Messages read after the first sample that saw any, and the seconds
    /// from it to the sample that saw them all; `None` if either is missing
    /// or they are the same sample.
    fn figures(self, total: u64) -> Option<(u64, f64)> {
        let ((t0, read0), t1) = (self.first?, self.last?);
        (t1 > t0).then(|| (total.saturating_sub(read0), (t1 - t0).as_secs_f64()))
    }
}

/// Runs `tally run` (defaults) on the backlog of `topic`, then through a
/// fixed-rate latency phase of `shape` traffic; checks a sample of counts.
pub(super) fn measure(
    env: &Env,
    topic: &str,
    name: &str,
    partitions: u32,
    truth: &mut FxHashMap<u64, i64>,
    shape: &TrafficShape,
    latency: &LatencyPlan,
) -> Result<Measured> {
    let mut conn = redis_conn(&env.redis)?;
    redis::cmd("FLUSHALL").arg("SYNC").query::<()>(&mut conn)?;
    let (group, prefix) = (format!("{name}-tally"), format!("{name}-tally"));
    let marks = watermarks(&env.brokers, topic, partitions)?;
    let total: u64 = marks.iter().map(|&(low, high)| (high - low) as u64).sum();
    let watch = FenceWatch::new(&env.redis, &prefix, &group, topic, partitions)?;
    let before = Usage::take(&mut conn, &env.broker_pid)?;
    let log_path = env.dir.join(format!("{name}-tally.log"));
    let mut tally = TallyRun::start(
        env,
        topic,
        (&group, &prefix),
        &env.tally_args,
        &log_path,
        watch,
    )?;
    let pass = tally
        .until_caught_up(&marks, Some(&log_path))
        .map_err(|error| error.context(format!("see {}", log_path.display())))?;
    let after = Usage::take(&mut conn, &env.broker_pid)?;
    let mut measured = tally.backlog_figures(&before, &after, total, pass);
    let rate = latency
        .rate
        .unwrap_or_else(|| latency.rate_for(measured.rate()));
    let stages_before = stages::scrape(tally.metrics);
    let phase = latency_phase(env, topic, &prefix, shape, rate, latency.secs, truth);
    let figures = tally.or_stop(phase)?;
    measured.latency = Some(figures);
    let stages_after = stages::scrape(tally.metrics);
    let breakdown = stages_before.and_then(|before| Ok(stages_after?.since(&before)));
    measured.stages = tally.or_stop(breakdown)?;
    let mut events = total + figures.events;
    if shape.viral_share > 0.0 {
        let monitor = tally.or_stop(hotkeys::Monitor::start(&env.redis))?;
        let phase = latency_phase(env, topic, &prefix, shape, rate, HOT_KEY_SECS, truth);
        let hot = monitor.finish(&prefix);
        events += tally.or_stop(phase)?.events;
        measured.hot = Some(tally.or_stop(hot)?);
    }
    let marks = settled_watermarks(&env.brokers, topic, partitions, events)?;
    tally.until_caught_up(&marks, None)?;
    measured.rss_kib = peak_rss_kib(&tally.pid).or(measured.rss_kib);
    measured.checked = Some(check_sample(&env.redis, &prefix, truth)?);
    terminate(&mut tally.child);
    Ok(measured)
}

/// A `tally run` measured on the backlog alone, under its own group and prefix.
pub(super) struct Variant<'a> {
    /// Its group and prefix.
    pub name: String,
    /// Its arguments, instead of the benchmark's `--tally-arg`s.
    pub args: &'a [String],
    /// Whether its prefix's counters exist before it starts ([`super::present`]).
    pub present: bool,
}

/// Runs `tally run` with `variant`'s arguments on the backlog of `topic`
/// (which must hold no more than `truth` counts); checks a sample of counts.
pub(super) fn measure_backlog(
    env: &Env,
    topic: &str,
    variant: &Variant,
    partitions: u32,
    truth: &FxHashMap<u64, i64>,
) -> Result<Measured> {
    let mut conn = redis_conn(&env.redis)?;
    redis::cmd("FLUSHALL").arg("SYNC").query::<()>(&mut conn)?;
    let name = &variant.name;
    if variant.present {
        let buckets = buckets_of(variant.args);
        let windows = windows_of(variant.args)?;
        super::present::record(&env.redis, name, topic, name, buckets, windows)?;
        super::present::seed(&mut conn, name, truth, buckets)?;
    }
    let marks = watermarks(&env.brokers, topic, partitions)?;
    let total: u64 = marks.iter().map(|&(low, high)| (high - low) as u64).sum();
    let watch = FenceWatch::new(&env.redis, name, name, topic, partitions)?;
    let before = Usage::take(&mut conn, &env.broker_pid)?;
    let log_path = env.dir.join(format!("{name}.log"));
    let mut tally = TallyRun::start(env, topic, (name, name), variant.args, &log_path, watch)?;
    let pass = tally
        .until_caught_up(&marks, Some(&log_path))
        .map_err(|error| error.context(format!("see {}", log_path.display())))?;
    let after = Usage::take(&mut conn, &env.broker_pid)?;
    let mut measured = tally.backlog_figures(&before, &after, total, pass);
    measured.checked = Some(check_sample(&env.redis, name, truth)?);
    terminate(&mut tally.child);
    Ok(measured)
}

/// What Redis and the broker have used so far.
struct Usage {
    redis: RedisSnapshot,
    broker_cpu: Option<f64>,
}

impl Usage {
    /// Redis's figures, then the broker's CPU seconds.
    fn take(conn: &mut redis::Connection, broker_pid: &str) -> Result<Self> {
        Ok(Self {
            redis: RedisSnapshot::take(conn)?,
            broker_cpu: cpu_secs(broker_pid),
        })
    }
}

/// The measured `tally run` child and the watch on its fences.
struct TallyRun {
    child: Child,
    /// The child's process id, as `/proc` names it.
    pid: String,
    watch: FenceWatch,
    /// Where the child serves `/metrics`.
    metrics: SocketAddr,
}

impl TallyRun {
    /// Starts `tally run` on `topic` with the benchmark's settings and `args`, logging to `log_path`.
    fn start(
        env: &Env,
        topic: &str,
        (group, prefix): (&str, &str),
        args: &[String],
        log_path: &Path,
        watch: FenceWatch,
    ) -> Result<Self> {
        let log = File::create(log_path)?;
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let child = env.spawn_tally_run([topic, group, prefix], metrics, args, log)?;
        let pid = child.id().to_string();
        Ok(Self {
            child,
            pid,
            watch,
            metrics,
        })
    }

    /// [`FenceWatch::until_caught_up`] on this child, stopping it on failure.
    /// With `log`, a pass over a backlog: also follows the messages the
    /// child reads.
    fn until_caught_up(&mut self, marks: &[(i64, i64)], log: Option<&Path>) -> Result<Pass> {
        let metrics = log.is_some().then_some(self.metrics);
        let caught_up = self
            .watch
            .until_caught_up(marks, &mut self.child, log, metrics);
        self.or_stop(caught_up)
    }

    /// `result`, stopping the child first if it failed: a [`Child`] dropped
    /// on the way out would keep running.
    fn or_stop<T>(&mut self, result: Result<T>) -> Result<T> {
        if result.is_err() {
            terminate(&mut self.child);
        }
        result
    }

    /// The backlog's figures: the events applied from the start of consuming
    /// (`pass`, as [`FenceWatch::until_caught_up`] returns it) to the
    /// last, and what Redis, the broker and the child used meanwhile, less
    /// the watch's own `MGET`s.
    fn backlog_figures(&self, before: &Usage, after: &Usage, total: u64, pass: Pass) -> Measured {
        let (t0, a0, t1) = (pass.started, pass.applied_then, pass.done);
        let mut calls = after.redis.delta(&before.redis);
        for (command, n) in &mut calls {
            if command == "mget" {
                *n = n.saturating_sub(self.watch.sent);
            }
        }
        Measured {
            events: total - a0,
            secs: (t1 - t0).as_secs_f64(),
            complete: true,
            redis: Some((calls, after.redis.cpu_secs - before.redis.cpu_secs)),
            rss_kib: peak_rss_kib(&self.pid),
            consumer_cpu: cpu_secs(&self.pid).map(|cpu| (cpu, total)),
            broker_cpu: before.broker_cpu.zip(after.broker_cpu).map(|(b, a)| a - b),
            latency: None,
            stages: Vec::new(),
            hot: None,
            writes: stages::counter(self.metrics, "tally_increments_total")
                .ok()
                .map(|n| n as u64),
            keys_created: Some(after.redis.keys.saturating_sub(before.redis.keys)),
            checked: None,
            // Its CPU from the process's start: the start-up before the
            // assignment costs the main thread a few milliseconds.
            busiest_thread: busiest_thread(&self.pid)
                .map(|(name, cpu)| (name, cpu / (t1 - t0).as_secs_f64().max(1e-9))),
            machine_busy: pass.machine_busy,
            reading: pass.reading,
        }
    }
}

/// How the latency phase runs.
#[derive(Debug, Clone, Copy)]
pub(super) struct LatencyPlan {
    /// Events/s; `None`: `load` times the maximum rate ([`LatencyPlan::rate_for`]).
    pub rate: Option<u64>,
    /// Fraction of the maximum rate, when `rate` is `None`.
    pub load: f64,
    /// Length of the phase.
    pub secs: u64,
    /// The rate the producer wrote the backlog at, when known.
    pub producer_rate: Option<f64>,
}

impl LatencyPlan {
    /// `load` times the maximum rate this machine carries end to end: tally
    /// reads no faster than its backlog rate, and the one producer thread,
    /// on the same cores, writes no faster than it wrote the backlog.
    pub fn rate_for(&self, tally_rate: f64) -> u64 {
        let ceiling = self
            .producer_rate
            .map_or(tally_rate, |producer| producer.min(tally_rate));
        ((ceiling * self.load) as u64).max(1)
    }
}

/// The buckets per post the measured `tally run` writes: its `--buckets` argument, if given.
fn buckets(env: &Env) -> u32 {
    buckets_of(&env.tally_args)
}

/// The value of `--<flag>` in `args` (as `--flag value` or `--flag=value`).
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.strip_prefix(flag) {
            Some("") => return args.next().map(String::as_str),
            Some(rest) if rest.starts_with('=') => return Some(&rest[1..]),
            _ => {}
        }
    }
    None
}

/// The windows of trending counts a `tally run` with `args` keeps: its
/// `--windows`, `--window-lateness` and `--window-retention`, none without.
fn windows_of(args: &[String]) -> Result<tally::domain::windows::Windows> {
    use tally::domain::windows::{
        DEFAULT_LATENESS_MS, DEFAULT_RETENTION_MS, Windows, parse_duration,
    };
    let Some(sizes) = flag_value(args, "--windows") else {
        return Ok(Windows::none());
    };
    let duration = |flag: &str, default: u64| -> Result<u64> {
        Ok(match flag_value(args, flag) {
            Some(text) => parse_duration(text)?,
            None => default,
        })
    };
    Ok(Windows::new(
        Windows::parse_sizes(sizes)?,
        duration("--window-lateness", DEFAULT_LATENESS_MS)?,
        duration("--window-retention", DEFAULT_RETENTION_MS)?,
    )?)
}

/// The buckets per post of a `tally run` with `args`.
fn buckets_of(args: &[String]) -> u32 {
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let value = match arg.strip_prefix("--buckets") {
            Some("") => args.next().map(String::as_str),
            Some(rest) => rest.strip_prefix('='),
            None => None,
        };
        if let Some(n) = value.and_then(|v| v.parse().ok()) {
            return n;
        }
    }
    DEFAULT_BUCKETS
}

/// The topic's watermarks once they hold `messages` messages, every one the
/// broker acknowledged: catching up to marks read too early would check counts
/// before the last events are applied.
pub(super) fn settled_watermarks(
    brokers: &str,
    topic: &str,
    partitions: u32,
    messages: u64,
) -> Result<Vec<(i64, i64)>> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(30);
    let mut behind = false;
    loop {
        let marks = watermarks(brokers, topic, partitions)?;
        let held: u64 = marks.iter().map(|&(low, high)| (high - low) as u64).sum();
        if held >= messages {
            if behind {
                eprintln!(
                    "{topic}: the watermarks reached the {messages} acknowledged messages after {} ms",
                    started.elapsed().as_millis()
                );
            }
            return Ok(marks);
        }
        if !behind {
            behind = true;
            eprintln!(
                "{topic}: the watermarks hold {held} messages, {messages} were acknowledged; waiting"
            );
        }
        if Instant::now() > deadline {
            bail!("{topic} holds {held} messages by its watermarks; {messages} were acknowledged");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Length of the phase whose writes `MONITOR` counts, at the latency phase's rate.
pub(super) const HOT_KEY_SECS: u64 = 5;

/// Produces at `rate` for `secs` with a marker post, and returns the marker's
/// produce-to-visible latency, read from tally's counter key.
fn latency_phase(
    env: &Env,
    topic: &str,
    prefix: &str,
    shape: &TrafficShape,
    rate: u64,
    secs: u64,
    truth: &mut FxHashMap<u64, i64>,
) -> Result<Latency> {
    let key = KeyLayout::new(prefix).counter_key(MARKER_POST, bucket_of(MARKER_USER, buckets(env)));
    let probe = Probe::Get {
        url: env.redis.clone(),
        key,
    };
    timed_phase(env, topic, shape, rate, secs, truth, probe)
}
