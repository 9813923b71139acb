//! Local services: a private redis-server and Apache Kafka node on free loopback
//! ports, for the demo and the benchmarks, and the store settings for such a redis-server.
//!
//! Invariant: every process started here is a child of this one and is killed
//! when its handle drops, so nothing outlives the command that started it.
//! Each runs in a process group of its own: Ctrl-C in a terminal signals the
//! whole foreground group, and the services must outlive tally's own
//! shutdown, which still reads and writes them; the handle stops them after.
//! A command that cannot drop its handles when a signal ends it (the
//! benchmarks, which run on a blocking thread) kills its children and removes
//! their directory itself ([`clean_up_on_signal`]).

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tally::infra::config::{ConfigError, DEFAULT_SLOT_GROUPS, StoreSettings};

/// Finds a program on PATH or in ~/.cargo/bin.
pub fn find_program(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

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

/// Waits, on the runtime, for SIGINT, SIGTERM or SIGHUP; then kills every child of this process
/// (a child that leads a process group of its own with its whole group: the broker's JVM is
/// its script's child), removes `dir` with what the services wrote there, and exits with 130.
/// Without it an interrupted benchmark would leave its broker and stores running and their
/// logs, often gigabytes, on the disk.
pub fn clean_up_on_signal(dir: PathBuf) -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    let mut terminate = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let mut hangup = signal(SignalKind::hangup()).context("listening for SIGHUP")?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
            _ = hangup.recv() => "SIGHUP",
        };
        eprintln!(
            "{name}: stopping every process this command started and removing {}",
            dir.display()
        );
        kill_children();
        // The kernel closes a killed process's files at once, but its children may take a
        // moment to be reaped; a second pass removes what a late writer added.
        for _ in 0..2 {
            let _ = std::fs::remove_dir_all(&dir);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        std::process::exit(130);
    });
    Ok(())
}

/// SIGKILLs every child of this process, each group leader with its group.
fn kill_children() {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((parent, group)) = parent_and_group(&stat) else {
            continue;
        };
        if parent != me {
            continue;
        }
        let target = if group == pid {
            format!("-{pid}")
        } else {
            pid.to_string()
        };
        let _ = Command::new("kill")
            .args(["-KILL", "--", &target])
            .stderr(Stdio::null())
            .status();
    }
}

/// The parent and process group in a `/proc/PID/stat` line (`pid (comm) state ppid pgrp ...`;
/// the command name may hold spaces and parentheses, so the fields are counted from its end).
fn parent_and_group(stat: &str) -> Option<(u32, u32)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(1);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
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
    let program = find_program("redis-server")
        .context("redis-server not found; install it with `apt-get install -y redis-server` (scripts/demo and scripts/bench do)")?;
    start_store(&program, dir)
}

/// Starts `program` (a redis-server or valkey-server binary) on a free loopback port without
/// persistence, its files in `dir`; returns it and its URL once it accepts connections.
pub fn start_store(program: &Path, dir: &Path) -> Result<(Service, String)> {
    let port = free_port()?;
    let child = Command::new(program)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let mut service = Service { child };
    let name = program
        .file_name()
        .map_or_else(|| "the store".into(), |n| n.to_string_lossy().into_owned());
    wait_for_port(port, &name, &mut service.child)?;
    Ok((service, format!("redis://127.0.0.1:{port}/")))
}

/// Starts `program` as [`start_store`] does, its files in the directory
/// `name` made inside `dir`: a second store beside the redis-server of
/// [`start_redis`].
pub fn start_store_in(program: &Path, dir: &Path, name: &str) -> Result<(Service, String)> {
    let own = dir.join(name);
    std::fs::create_dir_all(&own).with_context(|| format!("creating {}", own.display()))?;
    start_store(program, &own)
}

/// The script that starts an Apache Kafka node: `TALLY_KAFKA_BROKER_SCRIPT`, else
/// `scripts/kafka/broker` of the checkout this binary was built from (the demo and the
/// benchmarks run from a checkout; scripts/demo and scripts/bench fetch the broker first).
fn broker_script() -> PathBuf {
    std::env::var_os("TALLY_KAFKA_BROKER_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka/broker"))
}

/// The Apache Kafka version scripts/kafka/pom.xml pins, the one [`start_kafka`] runs.
pub fn kafka_version() -> &'static str {
    const POM: &str = include_str!("../../scripts/kafka/pom.xml");
    POM.split("<kafka.version>")
        .nth(1)
        .and_then(|rest| rest.split('<').next())
        .unwrap_or("4.x")
}

/// Starts a private Apache Kafka node (KRaft, broker and controller in one process) with its
/// storage and log in `dir/kafka`, through `scripts/kafka/broker`; returns it and its bootstrap
/// address once it has logged that it started.
pub fn start_kafka(dir: &Path) -> Result<(Service, String)> {
    let script = broker_script();
    if !script.is_file() {
        bail!(
            "{} not found; run from a checkout of tally (scripts/demo, scripts/bench) or set TALLY_KAFKA_BROKER_SCRIPT",
            script.display()
        );
    }
    let home = dir.join("kafka");
    std::fs::create_dir_all(&home).context("creating the broker's directory")?;
    let (port, controller_port) = (free_port()?, free_port()?);
    let out = File::create(home.join("stdout.log")).context("creating the broker log")?;
    let child = Command::new(&script)
        .arg("--dir")
        .arg(&home)
        .args(["--port", &port.to_string()])
        .args(["--controller-port", &controller_port.to_string()])
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {}", script.display()))?;
    let mut service = Service { child };
    let log = home.join("broker.log");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let started =
            std::fs::read_to_string(&log).is_ok_and(|text| text.contains("Kafka Server started"));
        if started {
            return Ok((service, format!("127.0.0.1:{port}")));
        }
        if let Ok(Some(status)) = service.child.try_wait() {
            let said = std::fs::read_to_string(home.join("stdout.log")).unwrap_or_default();
            bail!("the Kafka broker exited ({status}) before it started:\n{said}");
        }
        if Instant::now() > deadline {
            bail!(
                "the Kafka broker did not start within 120 s; see {}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Creates `topic` with `partitions` partitions and waits until the broker's metadata lists
/// every partition with a leader.
pub fn create_topic(brokers: &str, topic: &str, partitions: u32) -> Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let admin: AdminClient<DefaultClientContext> =
        tally::infra::config::kafka_client_config(brokers, &[]).create()?;
    let new = NewTopic::new(topic, partitions as i32, TopicReplication::Fixed(1));
    let results = futures::executor::block_on(admin.create_topics(&[new], &AdminOptions::new()))?;
    for result in results {
        if let Err((name, code)) = result {
            bail!("could not create topic {name} on {brokers}: {code}");
        }
    }
    let consumer: BaseConsumer =
        tally::infra::config::kafka_client_config(brokers, &[]).create()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .ok()
            .and_then(|md| {
                let t = md.topics().iter().find(|t| t.name() == topic)?;
                Some(
                    t.error().is_none()
                        && t.partitions().len() == partitions as usize
                        && t.partitions().iter().all(|p| p.leader() >= 0),
                )
            })
            .unwrap_or(false);
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("topic {topic} did not get leaders for its {partitions} partitions within 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The settings of a store at `redis_url` (a redis-server this process started, so no
/// password and no TLS) under `prefix`.
pub fn store(redis_url: &str, prefix: &str) -> Result<StoreSettings> {
    StoreSettings::new(redis_url, None, prefix, DEFAULT_SLOT_GROUPS).map_err(settings_error)
}

/// Settings the library refused, as one error naming each.
pub fn settings_error(problems: Vec<ConfigError>) -> anyhow::Error {
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    anyhow::anyhow!("{}", lines.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_its_parent_and_group_whatever_the_command_name() {
        let stat = "4242 (java (kafka) x) S 100 4242 4242 0 -1 4194560 2 0 0 0";
        assert_eq!(parent_and_group(stat), Some((100, 4242)));
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        let (parent, _) = parent_and_group(&own).unwrap();
        assert_eq!(parent, std::os::unix::process::parent_id());
    }
}
