//! Re-reading the dedupe window at a rebalance (`--reread WINDOW`, repeatable): how long a
//! partition that changes hands waits before its new owner applies it, while a group of
//! `tally run --dedupe ids` processes scales from 1 to 4 and back to 1 under load. Window 0
//! runs the same steps without dedupe: the pause a rebalance costs with nothing to re-read.
//!
//! For each window `W`, on a topic of its own (`--partitions` partitions), with a new group
//! and key prefix on a Redis emptied first:
//!
//! 1. a backlog of `W` events per partition and a quarter more, so that every window is full
//!    (a window holds `W` offsets and up to an eighth more),
//!    is produced and counted by one process started with `--dedupe ids --dedupe-window W`
//!    after the benchmark's `--tally-arg`s. Its peak RSS (`VmHWM`) once it has caught up is the
//!    memory of one process holding every partition with its window full;
//! 2. the benchmark's producer writes the workload's traffic at `--reread-rate` events/s from
//!    then on. After [`SETTLE`], three more processes join the group (1 → 4); once every
//!    partition that moved has been applied by its new owner and the four hold the topic, and
//!    [`SETTLE`] more, the three are stopped together with SIGTERM (4 → 1);
//! 3. the producer stops, the partitions are sealed, and once the last process has applied
//!    everything a sample of counts is checked against the producer's truth.
//!
//! In each step every partition a process is assigned is a move, however often it moves.
//! From the process's log line `Partitions assigned.` (its log is read every [`POLL`]) to the
//! first poll that shows its `tally_applied_offset{partition}` changed is the time to the
//! first apply; the process's `Dedupe window re-read` line gives that partition's re-read, in
//! offsets and seconds; and the processes' `tally_dedupe_reread_seconds` (count and sum,
//! before and after the step) the re-reads the histogram timed.
//!
//! A move's *pause* is what its partition's counts wait: from the last poll that saw any
//! process (the stopping ones too, until they exit) advance the partition's applied offset
//! before the new owner's first apply, to that first apply. It holds the old owner's last
//! batch and commit, the group's hand-over, and the new owner's placing, re-read and first
//! batch; with traffic on every partition, a partition that does not move is applied every
//! flush interval, which is the floor of the figure.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustc_hash::FxHashMap;

use super::services::{create_topic, peak_rss_kib, redis_conn, seal, store_label, terminate};
use super::{BenchConfig, Env, check_sample, latency, stages, tally_run};
use crate::local::free_port;
use crate::markdown::{command_line, header, thousands, today_utc};
use crate::produce::{Plan, progress_bar, send};
use tally::infra::metrics::{
    APPLIED_OFFSET, ASSIGNED_PARTITIONS, DEDUPE_REMEMBERED, DEDUPE_REREAD_SECONDS,
};
use tally_lab::generate::TrafficShape;

/// How often the processes' logs and metrics are read during a step.
const POLL: Duration = Duration::from_millis(20);
/// How long the group runs under load before and between the steps.
const SETTLE: Duration = Duration::from_secs(3);
/// The longest a step may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// The processes of the group at its largest.
const SCALED: usize = 4;

const BEGIN: &str = "<!-- reread:begin (written by `tally-lab bench --reread W --out`) -->";
const END: &str = "<!-- reread:end -->";

/// What one window size measured.
#[derive(Debug, Clone)]
pub(super) struct Measured {
    window: u64,
    partitions: u32,
    /// Events of the backlog, the seals excluded.
    backlog: u64,
    /// The single process's peak RSS once it had counted the backlog, and the
    /// events its windows remembered then.
    rss_kib: Option<u64>,
    remembered: f64,
    steps: Vec<Step>,
    /// The rate the producer reached during the steps.
    reached_rate: u64,
    /// Sampled counts: checked, wrong.
    checked: (usize, usize),
}

/// One scaling step.
#[derive(Debug, Clone)]
struct Step {
    label: &'static str,
    moves: Vec<Move>,
    /// Re-reads the processes' histogram timed during the step, and their seconds.
    timed: (f64, f64),
    /// From the step's start until every move was applied.
    secs: f64,
}

/// A partition assigned to a process during a step.
#[derive(Debug, Clone)]
struct Move {
    partition: i32,
    member: usize,
    assigned: Instant,
    /// The process's applied offset of the partition before the assignment.
    baseline: Option<f64>,
    first_apply: Option<Instant>,
    /// From the partition's last advance by any process to `first_apply`.
    paused: Option<Duration>,
    /// Seconds and offsets of its re-read, from the process's log line.
    reread: Option<(f64, i64)>,
}

impl Move {
    fn to_first_apply(&self) -> Option<f64> {
        Some(
            self.first_apply?
                .saturating_duration_since(self.assigned)
                .as_secs_f64(),
        )
    }
}

/// One `tally run` of the group; stopped when dropped.
struct Member {
    child: Child,
    pid: String,
    metrics: SocketAddr,
    log: PathBuf,
    /// Bytes of the log read so far, and a line begun but not yet ended.
    read: u64,
    partial: Vec<u8>,
    /// From the last scrape: the applied offset per partition, partitions held,
    /// and the re-read histogram's count and sum.
    applied: HashMap<i32, f64>,
    assigned: f64,
    timed: (f64, f64),
}

impl Member {
    fn start(env: &Env, topic: &str, index: usize, window: u64) -> Result<Self> {
        let log = env.dir.join(format!("{topic}-{index}.log"));
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut args = env.tally_args.clone();
        if window > 0 {
            args.extend(["--dedupe", "ids", "--dedupe-window"].map(String::from));
            args.push(window.to_string());
        }
        let child =
            env.spawn_tally_run([topic, topic, topic], metrics, &args, File::create(&log)?)?;
        Ok(Self {
            pid: child.id().to_string(),
            child,
            metrics,
            log,
            read: 0,
            partial: Vec::new(),
            applied: HashMap::new(),
            assigned: 0.0,
            timed: (0.0, 0.0),
        })
    }

    fn alive(&mut self) -> Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!("tally run exited ({status}); see {}", self.log.display());
        }
        Ok(())
    }

    /// Reads the metrics; keeps the last figures when the endpoint does not
    /// answer yet (a process starting).
    fn scrape(&mut self) {
        let Ok(text) = stages::metrics_text(self.metrics) else {
            return;
        };
        self.applied = series(&text, APPLIED_OFFSET)
            .into_iter()
            .filter_map(|(labels, v)| Some((label(&labels, "partition")?.parse().ok()?, v)))
            .collect();
        self.assigned = value(&text, ASSIGNED_PARTITIONS).unwrap_or(0.0);
        self.timed = (
            value(&text, &format!("{DEDUPE_REREAD_SECONDS}_count")).unwrap_or(0.0),
            value(&text, &format!("{DEDUPE_REREAD_SECONDS}_sum")).unwrap_or(0.0),
        );
    }

    /// The whole lines its log gained since the last call.
    fn new_lines(&mut self) -> Result<Vec<String>> {
        let mut file = File::open(&self.log)?;
        file.seek(SeekFrom::Start(self.read))?;
        self.read += file.read_to_end(&mut self.partial)? as u64;
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Ok(Vec::new());
        };
        let lines = String::from_utf8_lossy(&self.partial[..end])
            .lines()
            .map(String::from)
            .collect();
        self.partial.drain(..=end);
        Ok(lines)
    }

    /// Sends SIGTERM without waiting.
    fn sigterm(&self) {
        let _ = Command::new("kill").args(["-TERM", &self.pid]).status();
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// Every series of `name` in an exposition text: its labels and value.
fn series(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix('{')?;
            let (labels, value) = rest.split_once("} ")?;
            Some((labels.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The value of the unlabelled series `name`.
fn value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        line.strip_prefix(name)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// A label's value in a series' label list (`partition="3",...`).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key.trim() == name).then(|| value.trim().trim_matches('"'))
    })
}

/// The value of `name=` in a log line.
fn field<T: std::str::FromStr>(line: &str, name: &str) -> Option<T> {
    let prefix = format!("{name}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&prefix)?.parse().ok())
}

/// The partitions a `Partitions assigned.` line names (`partitions=0@123 5@77`).
fn assigned_in(line: &str) -> Vec<i32> {
    if !line.contains("Partitions assigned.") {
        return Vec::new();
    }
    let Some((_, list)) = line.split_once("partitions=") else {
        return Vec::new();
    };
    list.split_whitespace()
        .filter_map(|t| t.split_once('@')?.0.parse().ok())
        .collect()
}

/// Partition, seconds and offsets of a line saying a re-read ended.
fn reread_in(line: &str) -> Option<(i32, f64, i64)> {
    if !line.contains("Dedupe window re-read;") {
        return None;
    }
    Some((
        field(line, "partition")?,
        field(line, "seconds")?,
        field(line, "offsets")?,
    ))
}

/// Measures every window of `--reread`.
pub(super) fn measure(env: &Env, config: &BenchConfig) -> Result<Vec<Measured>> {
    let shape = TrafficShape {
        posts: config.posts,
        zipf_exponent: config.zipf,
        viral_share: 0.0,
        ..TrafficShape::default()
    };
    config
        .reread
        .iter()
        .map(|&window| one_window(env, config, &shape, window))
        .collect()
}

fn one_window(
    env: &Env,
    config: &BenchConfig,
    shape: &TrafficShape,
    window: u64,
) -> Result<Measured> {
    let partitions = config.partitions;
    let topic = format!("likes-reread-{window}");
    create_topic(&env.brokers, &topic, partitions)?;
    let mut conn = redis_conn(&env.redis)?;
    redis::cmd("FLUSHALL").arg("SYNC").query::<()>(&mut conn)?;
    let backlog = window * u64::from(partitions) * 5 / 4;
    let (mut truth, backlog) = if backlog > 0 {
        eprintln!("reread, window {window}: producing a backlog of {backlog} events...");
        let (truth, backlog, _) = produce(
            env,
            &topic,
            shape,
            Some(backlog),
            None,
            7,
            &AtomicBool::new(false),
        )?;
        (truth, backlog)
    } else {
        (FxHashMap::default(), 0)
    };
    let mut events = backlog + seal(&env.brokers, &topic, &mut truth)?;
    let marks = tally_run::settled_watermarks(&env.brokers, &topic, partitions, events)?;
    let fill = marks
        .iter()
        .map(|&(low, high)| high - low)
        .min()
        .unwrap_or(0);
    if fill < window as i64 {
        eprintln!(
            "reread, window {window}: the least partition holds {fill} offsets, less than the window"
        );
    }
    let mut members = vec![Member::start(env, &topic, 0, window)?];
    eprintln!("reread, window {window}: one tally run counts the backlog...");
    caught_up(&mut conn, &topic, &marks, &mut members)?;
    // The gauges are set on the flush tick.
    std::thread::sleep(Duration::from_millis(500));
    let rss_kib = peak_rss_kib(&members[0].pid);
    let remembered = stages::metrics_text(members[0].metrics)
        .ok()
        .and_then(|text| value(&text, DEDUPE_REMEMBERED))
        .unwrap_or(0.0);

    eprintln!(
        "reread, window {window}: scaling 1 → {SCALED} → 1 at {} events/s...",
        config.reread_rate
    );
    let stop = AtomicBool::new(false);
    let (load, steps) = std::thread::scope(|scope| {
        let load =
            scope.spawn(|| produce(env, &topic, shape, None, Some(config.reread_rate), 8, &stop));
        let steps = scale(env, &topic, window, partitions, &mut members);
        stop.store(true, Ordering::Relaxed);
        let load = load.join().expect("the load producer panicked");
        (load, steps)
    });
    let (load_truth, load_events, reached_rate) = load?;
    let steps = steps?;
    for (post, n) in load_truth {
        *truth.entry(post).or_insert(0) += n;
    }
    events += load_events + seal(&env.brokers, &topic, &mut truth)?;
    let marks = tally_run::settled_watermarks(&env.brokers, &topic, partitions, events)?;
    caught_up(&mut conn, &topic, &marks, &mut members)?;
    let checked = check_sample(&env.redis, &topic, &truth)?;
    Ok(Measured {
        window,
        partitions,
        backlog,
        rss_kib,
        remembered,
        steps,
        reached_rate,
        checked,
    })
}

/// Produces `shape` traffic into `topic`: `events` of it as fast as the producer goes, or at
/// `rate` until `stop`. Returns the truth, with the events acknowledged and the rate reached
/// when `rate` is given.
fn produce(
    env: &Env,
    topic: &str,
    shape: &TrafficShape,
    events: Option<u64>,
    rate: Option<u64>,
    seed: u64,
    stop: &AtomicBool,
) -> Result<(FxHashMap<u64, i64>, u64, u64)> {
    let plan = Plan {
        shape: shape.clone(),
        seed,
        events,
        duration: None,
        rate,
        marker: None,
    };
    let bar = progress_bar(events, &format!("{topic}: producing"));
    let produced = send(&env.brokers, topic, &env.producer_config, &plan, stop, &bar)?;
    if produced.failed > 0 {
        bail!(
            "{} events were not acknowledged by the broker",
            produced.failed
        );
    }
    let reached = (produced.acked as f64 / produced.elapsed.as_secs_f64().max(1e-9)) as u64;
    Ok((produced.truth, produced.acked, reached))
}

/// The two steps, 1 → [`SCALED`] → 1, with the first member already running.
fn scale(
    env: &Env,
    topic: &str,
    window: u64,
    partitions: u32,
    members: &mut Vec<Member>,
) -> Result<Vec<Step>> {
    std::thread::sleep(SETTLE);
    let before = timed(members)?;
    let began = Instant::now();
    for index in 1..SCALED {
        members.push(Member::start(env, topic, index, window)?);
    }
    let up = follow(members, &mut [], "1 → 4", partitions, before, began)?;
    std::thread::sleep(SETTLE);
    let before = timed(members)?;
    let began = Instant::now();
    for member in &members[1..] {
        member.sigterm();
    }
    // Stopping processes apply and commit their batches in flight; they are read until
    // they exit, for the last advance of each partition they give up.
    let mut stopping: Vec<Member> = members.drain(1..).collect();
    let down = follow(members, &mut stopping, "4 → 1", partitions, before, began);
    drop(stopping);
    Ok(vec![up, down?])
}

/// Each member's re-read histogram, count and sum, before a step; what their logs said
/// until then is passed over.
fn timed(members: &mut [Member]) -> Result<Vec<(f64, f64)>> {
    members
        .iter_mut()
        .map(|m| {
            m.scrape();
            m.new_lines()?;
            Ok(m.timed)
        })
        .collect()
}

/// Follows a step from `began` until every move is applied and each member holds partitions,
/// together all of them; `before` are the members' histograms at the step's start. The
/// `stopping` members are read for their applies only.
fn follow(
    members: &mut [Member],
    stopping: &mut [Member],
    label: &'static str,
    partitions: u32,
    before: Vec<(f64, f64)>,
    began: Instant,
) -> Result<Step> {
    let mut moves: Vec<Move> = Vec::new();
    // When some process last advanced each partition's applied offset.
    let mut advanced: HashMap<i32, Instant> = (0..partitions as i32).map(|p| (p, began)).collect();
    loop {
        let now = Instant::now();
        for member in stopping.iter_mut() {
            let previous = member.applied.clone();
            member.scrape();
            note_advances(&mut advanced, &previous, &member.applied, now);
        }
        for (index, member) in members.iter_mut().enumerate() {
            member.alive()?;
            let previous = member.applied.clone();
            member.scrape();
            for line in member.new_lines()? {
                for partition in assigned_in(&line) {
                    moves.push(Move {
                        partition,
                        member: index,
                        assigned: now,
                        baseline: previous.get(&partition).copied(),
                        first_apply: None,
                        paused: None,
                        reread: None,
                    });
                }
                if let Some((partition, secs, offsets)) = reread_in(&line)
                    && let Some(m) = moves
                        .iter_mut()
                        .rev()
                        .find(|m| (m.member, m.partition) == (index, partition))
                {
                    m.reread = Some((secs, offsets));
                }
            }
            for m in moves.iter_mut().filter(|m| m.member == index) {
                let applied = member.applied.get(&m.partition).copied();
                if m.first_apply.is_none() && applied.is_some() && applied != m.baseline {
                    m.first_apply = Some(now);
                    m.paused = Some(now.saturating_duration_since(advanced[&m.partition]));
                }
            }
            note_advances(&mut advanced, &previous, &member.applied, now);
        }
        let held: Vec<f64> = members.iter().map(|m| m.assigned).collect();
        let settled = held.iter().all(|&n| n > 0.0)
            && held.iter().sum::<f64>() == f64::from(partitions)
            && !moves.is_empty()
            && moves.iter().all(|m| m.first_apply.is_some());
        if settled {
            for m in &moves {
                eprintln!(
                    "  {label}: partition {} to process {}: first apply after {:.3} s, paused {:.3} s, re-read {:?}",
                    m.partition,
                    m.member,
                    m.to_first_apply().unwrap_or(f64::NAN),
                    m.paused.map_or(f64::NAN, |d| d.as_secs_f64()),
                    m.reread
                );
            }
            let after: Vec<(f64, f64)> = members.iter().map(|m| m.timed).collect();
            let delta = |f: fn(&(f64, f64)) -> f64| -> f64 {
                after
                    .iter()
                    .enumerate()
                    .map(|(i, a)| f(a) - before.get(i).map_or(0.0, f))
                    .sum()
            };
            return Ok(Step {
                label,
                moves,
                timed: (delta(|t| t.0), delta(|t| t.1)),
                secs: began.elapsed().as_secs_f64(),
            });
        }
        if began.elapsed() > STEP_TIMEOUT {
            let waiting: Vec<i32> = moves
                .iter()
                .filter(|m| m.first_apply.is_none())
                .map(|m| m.partition)
                .collect();
            bail!(
                "step {label} unfinished after {STEP_TIMEOUT:?}: processes hold {held:?} of {partitions} partitions; partitions {waiting:?} not yet applied by their new owner"
            );
        }
        std::thread::sleep(POLL.saturating_sub(now.elapsed()));
    }
}

/// Notes `now` for each partition whose applied offset moved from `previous` to `current`.
fn note_advances(
    advanced: &mut HashMap<i32, Instant>,
    previous: &HashMap<i32, f64>,
    current: &HashMap<i32, f64>,
    now: Instant,
) {
    for (partition, offset) in current {
        if previous.get(partition) != Some(offset) {
            advanced.insert(*partition, now);
        }
    }
}

/// Polls the group's fences until each has reached its partition's end in
/// `marks`, while every member lives.
fn caught_up(
    conn: &mut redis::Connection,
    topic: &str,
    marks: &[(i64, i64)],
    members: &mut [Member],
) -> Result<()> {
    super::fleet::until_fences_reach(conn, topic, marks, || {
        members.iter_mut().try_for_each(Member::alive)
    })
}

/// The median and the largest of `values`.
fn median_max(values: &mut [f64]) -> Option<(f64, f64)> {
    values.sort_by(f64::total_cmp);
    let max = *values.last()?;
    Some((latency::percentile(values, 0.5), max))
}

/// The report: the command, the machine, what was run, one row per window and step, and the
/// memory line.
pub(super) fn render(config: &BenchConfig, env: &Env, measured: &[Measured]) -> Result<String> {
    let mut out = String::new();
    header(&mut out, &command_line())?;
    let version = env
        .tally
        .command()
        .arg("--version")
        .output()
        .context("running tally --version")?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
    let partitions = measured.first().map_or(config.partitions, |m| m.partitions);
    writeln!(
        out,
        "Date: {}. Measured: {version} (`tally --version`: release and git revision), \
         each process started as `tally run --dedupe ids --dedupe-window W{}` (window 0: without \
         `--dedupe`), on Apache Kafka {} \
         (one KRaft node) and {} on the same machine; {partitions} partitions; \
         load {} events/s while the group scales.\n",
        today_utc(),
        extra_args(&env.tally_args),
        crate::local::kafka_version(),
        store_label(&env.redis)?,
        thousands(config.reread_rate),
    )?;
    writeln!(
        out,
        "| window (offsets) | step | partitions moved | pause: last apply by anyone → new owner's first, s (median / max) | assignment → first apply, s (median / max) | re-read, s (median / max) | offsets re-read (median) | re-reads in `tally_dedupe_reread_seconds` | their mean, s | step done, s |"
    )?;
    writeln!(out, "|---:|---|---:|---|---|---|---:|---:|---:|---:|")?;
    for m in measured {
        for step in &m.steps {
            let mut first: Vec<f64> = step.moves.iter().filter_map(Move::to_first_apply).collect();
            let mut paused: Vec<f64> = step
                .moves
                .iter()
                .filter_map(|m| Some(m.paused?.as_secs_f64()))
                .collect();
            let mut reread: Vec<f64> = step
                .moves
                .iter()
                .filter_map(|m| Some(m.reread?.0))
                .collect();
            let mut offsets: Vec<f64> = step
                .moves
                .iter()
                .filter_map(|m| Some(m.reread?.1 as f64))
                .collect();
            let dash = || "–".to_string();
            let pair =
                |v: Option<(f64, f64)>| v.map_or_else(dash, |(a, b)| format!("{a:.2} / {b:.2}"));
            let (count, sum) = step.timed;
            let mean = if count > 0.0 {
                format!("{:.2}", sum / count)
            } else {
                dash()
            };
            writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {count:.0} | {mean} | {:.1} |",
                window_label(m.window),
                step.label,
                step.moves.len(),
                pair(median_max(&mut paused)),
                pair(median_max(&mut first)),
                pair(median_max(&mut reread)),
                median_max(&mut offsets).map_or_else(dash, |(med, _)| thousands(med as u64)),
                step.secs,
            )?;
        }
    }
    writeln!(out)?;
    for m in measured {
        let rss = m.rss_kib.map_or_else(
            || "–".to_string(),
            |kib| format!("{:.0} MiB", kib as f64 / 1024.0),
        );
        let held = if m.window == 0 {
            "without dedupe".to_string()
        } else {
            format!(
                "with their windows full (a backlog of {} events; {} events remembered)",
                thousands(m.backlog),
                thousands(m.remembered as u64)
            )
        };
        writeln!(
            out,
            "Window {}: one process holding all {} partitions {held} had a peak RSS of {rss}; \
             the producer reached {} events/s during the steps; sampled counts {}.  ",
            window_label(m.window),
            m.partitions,
            thousands(m.reached_rate),
            match m.checked {
                (n, 0) => format!("exact ({n} posts)"),
                (n, wrong) => format!("{wrong} of {n} posts wrong"),
            },
        )?;
    }
    Ok(out)
}

/// A window's name in the table: its offsets, or that there is none.
fn window_label(window: u64) -> String {
    if window == 0 {
        "0 (no dedupe)".to_string()
    } else {
        thousands(window)
    }
}

/// The benchmark's `--tally-arg`s, as they follow the window on the command line.
fn extra_args(args: &[String]) -> String {
    args.iter().map(|a| format!(" {a}")).collect()
}

/// Writes the report between its markers of `path` (or appends them).
pub(super) fn write_between_markers(path: &std::path::Path, report: &str) -> Result<()> {
    crate::markdown::write_between(path, BEGIN, END, report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_lines_a_step_reads_are_parsed() {
        let assigned = "2026-12-04T05:51:22.366Z  INFO tally::pipeline::consume: Partitions assigned. partitions=0@400000 3@12 7@committed(fences unreadable)";
        assert_eq!(assigned_in(assigned), [0, 3, 7]);
        assert!(assigned_in("INFO x: Partitions revoked. partitions=[0, 1]").is_empty());
        let ended = "2026-12-04T05:51:24.047Z  INFO tally::pipeline::run::intake: Dedupe window re-read; deciding the records above the fences. partition=3 offsets=400000 seconds=1.681";
        assert_eq!(reread_in(ended), Some((3, 1.681, 400_000)));
        assert_eq!(reread_in(assigned), None);
    }

    #[test]
    fn series_are_read_by_label() {
        let text = "# TYPE tally_applied_offset gauge\n\
                    tally_applied_offset{partition=\"3\"} 1200\n\
                    tally_applied_offset{partition=\"12\"} 7\n\
                    tally_dedupe_reread_seconds_count 4\n\
                    tally_dedupe_reread_seconds_sum 2.5\n";
        let found = series(text, APPLIED_OFFSET);
        let applied: Vec<(Option<&str>, f64)> = found
            .iter()
            .map(|(labels, v)| (label(labels, "partition"), *v))
            .collect();
        assert_eq!(applied, [(Some("3"), 1200.0), (Some("12"), 7.0)]);
        assert_eq!(value(text, "tally_dedupe_reread_seconds_count"), Some(4.0));
        assert_eq!(value(text, "tally_dedupe_reread_seconds_sum"), Some(2.5));
    }
}
