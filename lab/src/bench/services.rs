//! Services of the benchmark: the local broker and redis-server (see
//! [`crate::local`]), the store's version, and the figures read from Redis
//! and /proc.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rustc_hash::FxHashMap;
use tally::domain::proto::Action;

pub use crate::local::{create_topic, start_kafka, start_redis};

/// Command calls and CPU time of a Redis server at one moment.
#[derive(Debug, Clone, Default)]
pub(crate) struct RedisSnapshot {
    calls: FxHashMap<String, u64>,
    /// `used_cpu_sys + used_cpu_user`, seconds.
    pub cpu_secs: f64,
    /// Keys in the database (`DBSIZE`).
    pub keys: u64,
}

impl RedisSnapshot {
    pub(crate) fn take(conn: &mut redis::Connection) -> Result<Self> {
        let info: String = redis::cmd("INFO").arg("commandstats").query(conn)?;
        let cpu: String = redis::cmd("INFO").arg("cpu").query(conn)?;
        let mut snapshot = RedisSnapshot {
            keys: redis::cmd("DBSIZE").query(conn)?,
            ..RedisSnapshot::default()
        };
        for line in info.lines() {
            // cmdstat_incrby:calls=12,usec=...
            if let Some((name, rest)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
                && let Some(calls) = rest
                    .split(',')
                    .find_map(|f| f.strip_prefix("calls="))
                    .and_then(|c| c.parse().ok())
                && name != "info"
            {
                snapshot.calls.insert(name.to_string(), calls);
            }
        }
        for line in cpu.lines() {
            if let Some((name, value)) = line.split_once(':')
                && (name == "used_cpu_sys" || name == "used_cpu_user")
            {
                snapshot.cpu_secs += value.trim().parse::<f64>().unwrap_or(0.0);
            }
        }
        Ok(snapshot)
    }

    /// Calls per command since `before`, largest first (ties by name).
    pub(crate) fn delta(&self, before: &RedisSnapshot) -> Vec<(String, u64)> {
        let mut calls: Vec<(String, u64)> = self
            .calls
            .iter()
            .map(|(name, &n)| {
                (
                    name.clone(),
                    n - before.calls.get(name).copied().unwrap_or(0),
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        calls.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        calls
    }
}

pub(super) fn redis_conn(url: &str) -> Result<redis::Connection> {
    redis::Client::open(url)?
        .get_connection()
        .with_context(|| format!("connecting to {url}"))
}

/// The version the server at `url` reports: Valkey's own (`valkey_version`),
/// else Redis's.
pub(super) fn store_version(url: &str) -> Result<String> {
    let mut conn = redis_conn(url)?;
    let server: String = redis::cmd("INFO").arg("server").query(&mut conn)?;
    let field = |name: &str| {
        server
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
    };
    Ok(field("valkey_version:")
        .or_else(|| field("redis_version:"))
        .unwrap_or_else(|| "?".into()))
}

/// The server behind `url` with its version: `redis-server 7.0.15`, `valkey-server 9.1.2`.
pub(crate) fn store_label(url: &str) -> Result<String> {
    let mut conn = redis_conn(url)?;
    let server: String = redis::cmd("INFO").arg("server").query(&mut conn)?;
    let name = if server.contains("valkey_version:") {
        "valkey-server"
    } else {
        "redis-server"
    };
    Ok(format!("{name} {}", store_version(url)?))
}

/// Peak resident set of a process in KiB (`VmHWM`), `"self"` for this one.
pub fn peak_rss_kib(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU time (user + system, all threads) a process has used, in seconds;
/// `"self"` for this one. Reads `/proc/PID/stat` (USER_HZ is 100 on Linux).
pub fn cpu_secs(pid: &str) -> Option<f64> {
    cpu_of_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Ticks every core has spent busy, and ticks in all.
pub type Ticks = (u64, u64);

/// The machine's [`Ticks`] so far (the first line of `/proc/stat`: user,
/// nice, system, irq, softirq and steal are busy; idle and iowait are not).
pub fn machine_ticks() -> Option<Ticks> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let tick = |i: usize| fields.get(i).copied().unwrap_or(0);
    let busy = tick(0) + tick(1) + tick(2) + tick(5) + tick(6) + tick(7);
    Some((busy, busy + tick(3) + tick(4)))
}

/// The share of the machine's cores busy between two [`machine_ticks`].
pub fn busy_share(before: Option<Ticks>, after: Option<Ticks>) -> Option<f64> {
    let ((busy0, all0), (busy1, all1)) = (before?, after?);
    (all1 > all0).then(|| busy1.saturating_sub(busy0) as f64 / (all1 - all0) as f64)
}

/// The thread of process `pid` that has used the most CPU, as its name and
/// its CPU seconds (user + system, `/proc/PID/task/*/stat`).
pub fn busiest_thread(pid: &str) -> Option<(String, f64)> {
    let mut busiest: Option<(String, f64)> = None;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let Ok(entry) = entry else { continue };
        let path = entry.path().join("stat");
        let Ok(stat) = std::fs::read_to_string(&path) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let Some(cpu) = cpu_of_stat(&stat) else {
            continue;
        };
        if busiest.as_ref().is_none_or(|(_, most)| cpu > *most) {
            busiest = Some((name, cpu));
        }
    }
    busiest
}

/// User + system CPU seconds of a `stat` line of `/proc`.
fn cpu_of_stat(stat: &str) -> Option<f64> {
    // Fields after the command name, which may contain spaces: state is the 3rd field.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((ticks(11)? + ticks(12)?) as f64 / 100.0)
}

/// The partitions' `[low, high)` offsets of a topic.
pub(super) fn watermarks(brokers: &str, topic: &str, partitions: u32) -> Result<Vec<(i64, i64)>> {
    let consumer: BaseConsumer = tally::infra::config::kafka_client_config(brokers, &[])
        .set("group.id", "tally-bench-watermarks")
        .create()?;
    (0..partitions as i32)
        .map(|p| Ok(consumer.fetch_watermarks(topic, p, Duration::from_secs(10))?))
        .collect()
}

/// Stops a child the way an operator would (SIGTERM), then for sure.
pub(super) fn terminate(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The post the seals of [`seal`] like, far from generated ids and the marker.
const SEAL_POST: u64 = 1 << 41;

/// Ends every partition of `topic` with one like of [`SEAL_POST`] in a record
/// batch of its own, and adds them to `truth`; returns how many were sent.
///
/// The seals mark where a run's backlog ends. On a broker that reports a
/// partition's high watermark as the first offset of its last record batch
/// plus one (Tansu 0.6 does), a log produced in large batches would end, by
/// its watermarks, up to a whole batch before its last message; a
/// one-message batch at the end keeps the watermark exact there too.
pub(super) fn seal(brokers: &str, topic: &str, truth: &mut FxHashMap<u64, i64>) -> Result<u64> {
    let producer: BaseProducer = tally::infra::config::kafka_client_config(brokers, &[])
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("batch.num.messages", "1")
        .create()?;
    let metadata = producer
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let partitions = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map_or(0, |t| t.partitions().len() as u32);
    let now_ms = tally::domain::versions::wall_ms();
    for partition in 0..partitions as i32 {
        let value = tally::pipeline::decode::encode(SEAL_POST, 1, Action::Like, now_ms);
        producer
            .send(
                BaseRecord::<(), _>::to(topic)
                    .payload(&value)
                    .partition(partition),
            )
            .map_err(|(error, _)| error)?;
    }
    producer.flush(Duration::from_secs(30))?;
    *truth.entry(SEAL_POST).or_insert(0) += i64::from(partitions);
    Ok(u64::from(partitions))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_share_is_busy_ticks_over_all_ticks_between_two_readings() {
        assert_eq!(busy_share(Some((10, 100)), Some((60, 200))), Some(0.5));
        assert_eq!(busy_share(Some((10, 100)), Some((10, 100))), None);
        assert_eq!(busy_share(None, Some((10, 100))), None);
        let (busy, all) = machine_ticks().expect("/proc/stat is readable on Linux");
        assert!(busy <= all && all > 0, "busy {busy} of {all} ticks");
    }
}
