//! Local services: a private redis-server and Tansu broker on free loopback
//! ports, for the demo and the benchmark.
//!
//! Invariant: every process started here is a child of this one and is killed
//! when its handle drops, so nothing outlives the command that started it.
//! Each runs in a process group of its own: Ctrl-C in a terminal signals the
//! whole foreground group, and the services must outlive tally's own
//! shutdown, which still reads and writes them; the handle stops them after.

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

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
    let port = free_port()?;
    let child = Command::new(program)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .process_group(0)
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
        .process_group(0)
        .spawn()
        .context("starting tansu")?;
    let mut service = Service { child };
    wait_for_port(port, "tansu", &mut service.child)?;
    Ok((service, format!("127.0.0.1:{port}")))
}

fn tansu_program() -> Result<PathBuf> {
    find_program("tansu").context(
        "tansu not found; install it with `cargo install tansu --version 0.6.0 --features dynostore --locked` (scripts/demo and scripts/bench do)",
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
