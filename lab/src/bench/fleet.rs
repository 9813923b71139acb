//! Cost against scale, measured: 1 and 2 `tally run` processes in one
//! consumer group, at the latency phase's rate, on a topic of their own.
//!
//! Each row gets a new, empty topic (8 or 32 partitions), a new consumer group
//! and a new key prefix, on a Redis emptied first. Its processes start with
//! the benchmark's `--tally-arg`s and are left to join the group until every
//! one of them holds partitions and together they hold the topic's (their
//! `tally_assigned_partitions` gauges). Then the benchmark's own producer
//! writes the workload's traffic into that topic at the fixed rate for the
//! phase's length, the partitions are sealed ([`super::services::seal`]), and
//! the phase ends when every fence has reached its partition's end. Nothing
//! but this phase's events is ever in the topic, so no backlog is re-read and
//! the figures are those of consumers keeping up with live traffic.
//!
//! Over the phase (from just before the first event is produced until the
//! consumers have applied the last): counter writes are the sum of each
//! process's `tally_increments_total` delta, scripts the sum of its
//! `tally_scripts_total` delta (every outcome), consumer CPU the sum of each
//! process's user + system time (`/proc/PID/stat`), Redis CPU the `INFO cpu`
//! delta. Scripts per second are over the producer's time. Once caught up, a
//! sample of counts is checked against the producer's truth for this topic.
//!
//! A row runs as many processes as it names, so only counts the machine's
//! cores can hold are measured ([`measured_consumers`]); the rest of the table
//! is simulated ([`super::scale`]).

use std::fs::File;
use std::net::SocketAddr;
use std::process::Child;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::services::{RedisSnapshot, cpu_secs, create_topic, redis_conn, seal, terminate};
use super::{Env, check_sample, stages, tally_run};
use crate::local::free_port;
use crate::produce::{Plan, progress_bar, send};
use tally::domain::routing::KeyLayout;
use tally::infra::metrics::{ASSIGNED_PARTITIONS, INCREMENTS, REBALANCES, SCRIPTS};
use tally_lab::generate::TrafficShape;

/// The partitions and consumer counts of the table.
pub(super) const PARTITIONS: [u32; 2] = [8, 32];
pub(super) const CONSUMERS: [u32; 3] = [1, 2, 4];

/// Longest phase of a row, in seconds; a shorter `--latency-secs` shortens it.
pub(super) const MAX_SECS: u64 = 10;

/// One measured row of the table.
#[derive(Debug, Clone, Default)]
pub(super) struct Row {
    pub consumers: u32,
    pub partitions: u32,
    /// Seconds of traffic asked of the producer.
    pub secs: u64,
    /// Partitions each process held at the start of the phase, and at its end.
    pub held: (Vec<u32>, Vec<u32>),
    /// Rebalances the processes took part in during the phase.
    pub rebalances: u64,
    /// Events the broker acknowledged, the seals included.
    pub events: u64,
    /// The rate the producer reached, events/s.
    pub reached_rate: u64,
    /// Seconds the producer ran.
    pub produce_secs: f64,
    /// Counter writes, scripts, consumer CPU seconds (all processes) and
    /// Redis CPU seconds over the phase.
    pub writes: u64,
    pub scripts: u64,
    pub consumer_cpu: f64,
    pub redis_cpu: f64,
    /// Sampled counts: checked, wrong.
    pub checked: (usize, usize),
}

impl Row {
    pub(super) fn writes_per_event(&self) -> f64 {
        self.writes as f64 / self.events.max(1) as f64
    }

    pub(super) fn scripts_per_sec(&self) -> f64 {
        self.scripts as f64 / self.produce_secs.max(1e-9)
    }

    pub(super) fn consumer_cpu_per_million(&self) -> f64 {
        self.consumer_cpu * 1e6 / self.events.max(1) as f64
    }

    pub(super) fn redis_cpu_per_million(&self) -> f64 {
        self.redis_cpu * 1e6 / self.events.max(1) as f64
    }

    /// Redis CPU seconds per million counter writes.
    pub(super) fn redis_cpu_per_million_writes(&self) -> f64 {
        self.redis_cpu * 1e6 / self.writes.max(1) as f64
    }
}

/// The consumer counts of the table this machine runs as processes: no more
/// than it has cores (the broker, Redis and the producer share them too).
pub(super) fn measured_consumers() -> Vec<u32> {
    let cores = cores();
    CONSUMERS.into_iter().filter(|&c| c <= cores).collect()
}

/// The machine's cores, as the process may use them.
pub(super) fn cores() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
}

/// Measures every row [`measured_consumers`] allows, on each of [`PARTITIONS`],
/// producing `shape` traffic at `rate` for `secs` (at most [`MAX_SECS`]).
pub(super) fn measure(
    env: &Env,
    name: &str,
    shape: &TrafficShape,
    rate: u64,
    secs: u64,
) -> Result<Vec<Row>> {
    let secs = secs.clamp(1, MAX_SECS);
    let mut rows = Vec::new();
    for partitions in PARTITIONS {
        for consumers in measured_consumers() {
            eprintln!(
                "{name}: {consumers} tally run process(es) on {partitions} partitions at {rate} events/s..."
            );
            let topic = format!("likes-{name}-scale-{partitions}p-{consumers}c");
            rows.push(row(env, &topic, consumers, partitions, shape, rate, secs)?);
        }
    }
    Ok(rows)
}

fn row(
    env: &Env,
    topic: &str,
    consumers: u32,
    partitions: u32,
    shape: &TrafficShape,
    rate: u64,
    secs: u64,
) -> Result<Row> {
    create_topic(&env.brokers, topic, partitions)?;
    let mut conn = redis_conn(&env.redis)?;
    redis::cmd("FLUSHALL").arg("SYNC").query::<()>(&mut conn)?;
    // The group and the prefix are named after the topic: all three are new.
    let mut members = (0..consumers)
        .map(|i| Member::start(env, topic, i))
        .collect::<Result<Vec<_>>>()?;
    let held_before = until_assigned(&mut members, partitions)?;
    let before = members
        .iter()
        .map(Member::scrape)
        .collect::<Result<Vec<_>>>()?;
    let redis_before = RedisSnapshot::take(&mut conn)?;
    let plan = Plan {
        shape: shape.clone(),
        seed: 11,
        events: None,
        duration: Some(Duration::from_secs(secs)),
        rate: Some(rate),
        marker: None,
    };
    let bar = progress_bar(Some(rate * secs), &format!("{topic}: producing"));
    let produced = send(
        &env.brokers,
        topic,
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
    let mut truth = produced.truth;
    let events = produced.acked + seal(&env.brokers, topic, &mut truth)?;
    let marks = tally_run::settled_watermarks(&env.brokers, topic, partitions, events)?;
    until_fences_reach(&mut conn, topic, &marks, || {
        members.iter_mut().try_for_each(Member::alive)
    })?;
    let redis_after = RedisSnapshot::take(&mut conn)?;
    let after = members
        .iter()
        .map(Member::scrape)
        .collect::<Result<Vec<_>>>()?;
    let checked = check_sample(&env.redis, topic, &truth)?;
    let delta = |f: fn(&Scrape) -> f64| -> f64 {
        after.iter().zip(&before).map(|(a, b)| f(a) - f(b)).sum()
    };
    let row = Row {
        consumers,
        partitions,
        secs,
        held: (
            held_before,
            after.iter().map(|s| s.assigned as u32).collect(),
        ),
        rebalances: delta(|s| s.rebalances) as u64,
        events,
        reached_rate: (produced.acked as f64 / produced.elapsed.as_secs_f64().max(1e-9)) as u64,
        produce_secs: produced.elapsed.as_secs_f64(),
        writes: delta(|s| s.increments) as u64,
        scripts: delta(|s| s.scripts) as u64,
        consumer_cpu: delta(|s| s.cpu),
        redis_cpu: redis_after.cpu_secs - redis_before.cpu_secs,
        checked,
    };
    drop(members);
    Ok(row)
}

/// One `tally run` process of a row; stopped when dropped.
struct Member {
    child: Child,
    /// Its process id, as `/proc` names it.
    pid: String,
    /// Where it serves `/metrics`.
    metrics: SocketAddr,
    log: std::path::PathBuf,
}

impl Member {
    /// Starts process `index` of the group and prefix named `topic`.
    fn start(env: &Env, topic: &str, index: u32) -> Result<Self> {
        let log = env.dir.join(format!("{topic}-{index}.log"));
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let child = env.spawn_tally_run(
            [topic, topic, topic],
            metrics,
            &env.tally_args,
            File::create(&log)?,
        )?;
        Ok(Self {
            pid: child.id().to_string(),
            child,
            metrics,
            log,
        })
    }

    /// Fails if the process has exited.
    fn alive(&mut self) -> Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!("tally run exited ({status}); see {}", self.log.display());
        }
        Ok(())
    }

    fn scrape(&self) -> Result<Scrape> {
        let text = stages::metrics_text(self.metrics)?;
        Ok(Scrape {
            cpu: cpu_secs(&self.pid).context("reading the CPU time of tally run")?,
            increments: total(&text, INCREMENTS).unwrap_or(0.0),
            scripts: total(&text, SCRIPTS).unwrap_or(0.0),
            assigned: total(&text, ASSIGNED_PARTITIONS).unwrap_or(0.0),
            rebalances: total(&text, REBALANCES).unwrap_or(0.0),
        })
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// What one process reports at one moment.
#[derive(Debug, Clone, Copy)]
struct Scrape {
    cpu: f64,
    increments: f64,
    scripts: f64,
    assigned: f64,
    rebalances: f64,
}

/// The sum of every series of the metric `name` (whatever its labels) in an
/// exposition text; `None` if it has none.
fn total(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = if let Some(rest) = rest.strip_prefix('{') {
            rest.split_once("} ").map(|(_, v)| v)
        } else {
            rest.strip_prefix(' ')
        };
        if let Some(v) = value.and_then(|v| v.trim().parse::<f64>().ok()) {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

/// Waits until every process holds partitions and together they hold all
/// `partitions`; returns what each holds.
fn until_assigned(members: &mut [Member], partitions: u32) -> Result<Vec<u32>> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut held = Vec::with_capacity(members.len());
        for member in members.iter_mut() {
            member.alive()?;
            let text = stages::metrics_text(member.metrics).ok();
            let n = text.and_then(|t| total(&t, ASSIGNED_PARTITIONS));
            held.push(n.unwrap_or(0.0) as u32);
        }
        if held.iter().all(|&n| n > 0) && held.iter().sum::<u32>() == partitions {
            return Ok(held);
        }
        if Instant::now() > deadline {
            bail!(
                "after 120 s the {} tally run process(es) hold {held:?} of {partitions} partitions",
                members.len()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Polls the group's fences (partition `p` of `topic` at `marks[p]`) until
/// each has reached its partition's end, calling `alive` between polls so
/// that a member that died ends the wait; gives up after 120 s without
/// progress.
pub(super) fn until_fences_reach(
    conn: &mut redis::Connection,
    topic: &str,
    marks: &[(i64, i64)],
    mut alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    let keys = KeyLayout::new(topic);
    let mut mget = redis::cmd("MGET");
    for p in 0..marks.len() as i32 {
        mget.arg(keys.fence_key(topic, topic, p, 0));
    }
    let (mut last, mut progressed) = (Vec::new(), Instant::now());
    loop {
        let fences: Vec<Option<i64>> = mget.query(conn)?;
        let behind = fences
            .iter()
            .zip(marks)
            .any(|(fence, &(_, high))| fence.map_or(high > 0, |f| f + 1 < high));
        if !behind {
            return Ok(());
        }
        if fences != last {
            (last, progressed) = (fences, Instant::now());
        }
        alive()?;
        if progressed.elapsed() > Duration::from_secs(120) {
            bail!("the fences of {topic} made no progress for 120 s: {last:?} of {marks:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metric_is_summed_over_its_labels() {
        let text = "# TYPE tally_scripts_total counter\n\
                    tally_scripts_total{outcome=\"applied\"} 40\n\
                    tally_scripts_total{outcome=\"gap\"} 2\n\
                    tally_scripts_total_other 7\n\
                    tally_assigned_partitions 4\n";
        assert_eq!(total(text, SCRIPTS), Some(42.0));
        assert_eq!(total(text, ASSIGNED_PARTITIONS), Some(4.0));
        assert_eq!(total(text, INCREMENTS), None);
    }

    #[test]
    fn one_and_two_consumers_are_measured_on_two_cores_or_more() {
        let measured = measured_consumers();
        assert!(measured.contains(&1));
        assert!(measured.iter().all(|&c| c <= cores()));
    }
}
