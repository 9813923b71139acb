//! Services of the benchmark: private redis-server and Tansu processes on free
//! loopback ports, child processes of this binary, and the figures read from
//! Redis and /proc. Every process started here is killed when its handle drops.

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rustc_hash::FxHashMap;

/// A child process, killed when dropped.
pub struct Service {
    child: Child,
}

impl Service {
    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free TCP port on the loopback interface.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_for_port(port: u16, what: &str, child: &mut Child) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            bail!("{what} exited ({status}) before listening on port {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("{what} did not listen on port {port} within 30 s")
}

/// Starts a private redis-server (no persistence) in `dir`; returns it and its URL.
pub fn start_redis(dir: &Path) -> Result<(Service, String)> {
    let program = crate::demo::find_program("redis-server")
        .context("redis-server not found; install it with `apt-get install -y redis-server` (scripts/bench does)")?;
    let port = free_port()?;
    let child = Command::new(program)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    let mut service = Service { child };
    wait_for_port(port, "redis-server", &mut service.child)?;
    Ok((service, format!("redis://127.0.0.1:{port}/")))
}

/// Starts a private Tansu broker with in-memory storage, logging into `dir`;
/// returns it and its bootstrap address.
pub fn start_tansu(dir: &Path) -> Result<(Service, String)> {
    let program = tansu_program()?;
    let port = free_port()?;
    let url = format!("tcp://127.0.0.1:{port}");
    let log = File::create(dir.join("tansu.log")).context("creating the broker log")?;
    let child = Command::new(program)
        .args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
        ])
        .args(["--storage-engine", "memory://tansu/"])
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting tansu")?;
    let mut service = Service { child };
    wait_for_port(port, "tansu", &mut service.child)?;
    Ok((service, format!("127.0.0.1:{port}")))
}

fn tansu_program() -> Result<PathBuf> {
    crate::demo::find_program("tansu").context(
        "tansu not found; install it with `cargo install tansu --version 0.6.0 --features dynostore --locked` (scripts/bench does)",
    )
}

/// Creates `topic` with `partitions` partitions on a Tansu broker.
pub fn create_topic(brokers: &str, topic: &str, partitions: u32) -> Result<()> {
    let status = Command::new(tansu_program()?)
        .args([
            "topic",
            "create",
            topic,
            "--partitions",
            &partitions.to_string(),
        ])
        .args(["--broker", &format!("tcp://{brokers}")])
        .stdout(Stdio::null())
        .status()
        .context("running tansu topic create")?;
    if !status.success() {
        bail!("tansu could not create topic {topic} on {brokers}");
    }
    Ok(())
}

/// A command for this same binary, with no `TALLY_*` setting inherited, so
/// children run with defaults and the flags given here only.
pub(super) fn self_command() -> Result<Command> {
    let mut command = Command::new(std::env::current_exe().context("locating the tally binary")?);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TALLY_") {
            command.env_remove(name);
        }
    }
    Ok(command)
}

/// Command calls and CPU time of a Redis server at one moment.
#[derive(Debug, Clone, Default)]
pub(super) struct RedisSnapshot {
    calls: FxHashMap<String, u64>,
    /// `used_cpu_sys + used_cpu_user`, seconds.
    pub cpu_secs: f64,
}

impl RedisSnapshot {
    pub(super) fn take(conn: &mut redis::Connection) -> Result<Self> {
        let info: String = redis::cmd("INFO").arg("commandstats").query(conn)?;
        let cpu: String = redis::cmd("INFO").arg("cpu").query(conn)?;
        let mut snapshot = RedisSnapshot::default();
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

    /// Calls per command since `before`, largest first.
    pub(super) fn delta(&self, before: &RedisSnapshot) -> Vec<(String, u64)> {
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
        calls.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        calls
    }
}

pub(super) fn redis_conn(url: &str) -> Result<redis::Connection> {
    redis::Client::open(url)?
        .get_connection()
        .with_context(|| format!("connecting to {url}"))
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
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may contain spaces: state is the 3rd field.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((ticks(11)? + ticks(12)?) as f64 / 100.0)
}

/// The partitions' `[low, high)` offsets of a topic.
pub(super) fn watermarks(brokers: &str, topic: &str, partitions: u32) -> Result<Vec<(i64, i64)>> {
    let consumer: BaseConsumer = crate::consume::client_config(brokers, &[])
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
