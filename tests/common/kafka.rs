//! Kafka brokers: Apache Kafka nodes started through `scripts/kafka/broker` (the script every
//! broker of the project starts from), single or as a 3-node KRaft cluster, and Tansu 0.6 as an
//! optional second broker (`TALLY_TEST_BROKER=tansu`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::process::{Guarded, file_tail, log_dir, signal};
use super::{free_port, port_open};

/// How the suite gets Apache Kafka's jars when they are missing.
pub const KAFKA_INSTALL: &str = "(source scripts/lib.sh && ensure_kafka)";

pub const TANSU_INSTALL: &str = "cargo install tansu --version 0.6.0 --features dynostore --locked";

/// The script that starts one Apache Kafka node.
pub fn broker_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/kafka/broker")
}

/// The directory holding Apache Kafka's `lib/`: `TALLY_KAFKA_HOME`, else the cache
/// `ensure_kafka` fills for the version scripts/kafka/pom.xml pins.
pub fn kafka_home() -> PathBuf {
    if let Some(home) = std::env::var_os("TALLY_KAFKA_HOME") {
        return PathBuf::from(home);
    }
    let pom = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/kafka/pom.xml"),
    )
    .expect("read scripts/kafka/pom.xml");
    let version = pom
        .split("<kafka.version>")
        .nth(1)
        .and_then(|s| s.split('<').next())
        .expect("kafka.version in scripts/kafka/pom.xml");
    let home = std::env::var_os("HOME").expect("HOME");
    Path::new(&home).join(format!(".cache/tally/kafka-{version}"))
}

/// The Kafka home directory; panics with the command that fetches the jars when they are missing.
pub fn require_kafka() -> PathBuf {
    let home = kafka_home();
    let lib = home.join("lib");
    let present = std::fs::read_dir(&lib)
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("kafka_2.13-"))
        })
        .unwrap_or(false);
    assert!(
        present,
        "Apache Kafka's jars are not in {}; fetch them with: {KAFKA_INSTALL}",
        lib.display()
    );
    home
}

/// Runs one of Apache Kafka's command-line tools (`org.apache.kafka.tools.AclCommand`,
/// `...MetadataQuorumCommand`, ...) with `args`; returns its standard output, panicking with
/// both outputs when it fails.
pub fn kafka_tool(class: &str, args: &[&str]) -> String {
    let lib = require_kafka().join("lib/*");
    let out = Command::new("java")
        .args(["-Xmx256m", "-XX:TieredStopAtLevel=1", "-cp"])
        .arg(lib)
        .arg(class)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run java");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{class} {args:?} failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// True when the suite runs on Tansu (`TALLY_TEST_BROKER=tansu`) instead of Apache Kafka.
pub fn on_tansu() -> bool {
    std::env::var("TALLY_TEST_BROKER").is_ok_and(|b| b == "tansu")
}

/// Path of the `tansu` binary: `~/.cargo/bin/tansu`, else the first one on PATH.
pub fn tansu_bin() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("HOME") {
        let p = Path::new(&home).join(".cargo/bin/tansu");
        if p.is_file() {
            return Some(p);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("tansu"))
        .find(|p| p.is_file())
}

/// One node of a broker this test process started.
struct Node {
    id: u32,
    port: u16,
    controller_port: u16,
    dir: PathBuf,
    proc: Option<Guarded>,
    /// The script's arguments, for a restart on the same storage.
    args: Vec<String>,
}

impl Node {
    fn log(&self) -> PathBuf {
        self.dir.join("broker.log")
    }

    fn start(&mut self) {
        let stdout = File::create(self.dir.join("stdout.log")).expect("create node stdout");
        let mut cmd = Command::new(broker_script());
        cmd.args(&self.args)
            .env("TALLY_KAFKA_HOME", kafka_home())
            .stdout(stdout.try_clone().unwrap())
            .stderr(stdout);
        // A restart appends to the log: "started" must be counted past what is there.
        let before = std::fs::read_to_string(self.log())
            .map(|l| l.matches("Kafka Server started").count())
            .unwrap_or(0);
        self.proc = Some(Guarded::spawn(&mut cmd).expect("spawn scripts/kafka/broker"));
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let started = std::fs::read_to_string(self.log())
                .map(|l| l.matches("Kafka Server started").count())
                .unwrap_or(0);
            if started > before {
                return;
            }
            let proc = self.proc.as_mut().unwrap();
            if let Ok(Some(status)) = proc.child.try_wait() {
                proc.release_watchdog();
                panic!(
                    "Kafka node {} exited ({status}) before it started:\n{}\n{}",
                    self.id,
                    file_tail(&self.dir.join("stdout.log"), 20),
                    file_tail(&self.log(), 20)
                );
            }
            assert!(
                Instant::now() < deadline,
                "Kafka node {} did not start within 120 s:\n{}",
                self.id,
                file_tail(&self.log(), 30)
            );
            thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A broker this test process started, one node or a KRaft cluster; stopped on drop.
pub struct Broker {
    addr: String,
    nodes: Vec<Node>,
    tansu: Option<(Guarded, PathBuf)>,
    _dir: TempDir,
}

impl Drop for Broker {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "[harness] broker {} log tail:\n{}",
                self.addr,
                self.log_tail(20)
            );
        }
    }
}

/// How a private broker starts, beyond the defaults of scripts/kafka/broker.
#[derive(Debug, Clone, Default)]
pub struct BrokerOptions {
    /// Broker settings added after the script's own (later lines win): listeners, SASL,
    /// authorizer, retention.
    pub settings: Vec<String>,
    /// Arguments for the storage format (`--add-scram ...`).
    pub format_args: Vec<String>,
    /// Extra JVM arguments (`-Djava.security.auth.login.config=...`).
    pub jvm_args: Vec<String>,
    /// The client port; a free one when unset. Known before the start, so `settings` can name
    /// it in listeners.
    pub port: Option<u16>,
    /// The controller port; a free one when unset. Known before the start, like `port`, for
    /// `settings` that replace `listeners`.
    pub controller_port: Option<u16>,
}

impl Broker {
    /// A private single-node broker on free loopback ports, for a test that stops, signals,
    /// empties or reconfigures it (the shared broker must never be paused under other tests).
    pub fn start_private() -> Broker {
        if on_tansu() {
            return start_tansu();
        }
        Self::start_nodes(1, &BrokerOptions::default())
    }

    /// A private single node started with `options`.
    pub fn start_with(options: &BrokerOptions) -> Broker {
        Self::start_nodes(1, options)
    }

    /// A private KRaft cluster of `nodes` combined broker-controllers; with 3 or more, topics
    /// and internal topics are replicated 3 times with `min.insync.replicas` 2.
    pub fn start_cluster(nodes: u32) -> Broker {
        Self::start_nodes(nodes, &BrokerOptions::default())
    }

    fn start_nodes(count: u32, options: &BrokerOptions) -> Broker {
        require_kafka();
        let dir = log_dir("kafka-");
        let cluster_id = String::from_utf8(
            Command::new(broker_script())
                .arg("--new-cluster-id")
                .output()
                .expect("run scripts/kafka/broker --new-cluster-id")
                .stdout,
        )
        .unwrap()
        .trim()
        .to_string();
        let ports: Vec<(u16, u16)> = (0..count)
            .map(|i| {
                let port = match (i, options.port) {
                    (0, Some(p)) => p,
                    _ => free_port(),
                };
                let controller_port = match (i, options.controller_port) {
                    (0, Some(c)) => c,
                    _ => free_port(),
                };
                (port, controller_port)
            })
            .collect();
        let voters = ports
            .iter()
            .enumerate()
            .map(|(i, (_, c))| format!("{}@127.0.0.1:{c}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let mut nodes: Vec<Node> = ports
            .iter()
            .enumerate()
            .map(|(i, &(port, controller_port))| {
                let id = i as u32 + 1;
                let node_dir = dir.path().join(format!("node{id}"));
                std::fs::create_dir_all(&node_dir).unwrap();
                let mut args: Vec<String> = vec![
                    "--dir".into(),
                    node_dir.display().to_string(),
                    "--port".into(),
                    port.to_string(),
                    "--controller-port".into(),
                    controller_port.to_string(),
                    "--node-id".into(),
                    id.to_string(),
                    "--voters".into(),
                    voters.clone(),
                    "--cluster-id".into(),
                    cluster_id.clone(),
                ];
                for s in &options.settings {
                    args.extend(["--set".into(), s.clone()]);
                }
                for a in &options.format_args {
                    args.extend(["--format-arg".into(), a.clone()]);
                }
                for a in &options.jvm_args {
                    args.extend(["--jvm-arg".into(), a.clone()]);
                }
                Node {
                    id,
                    port,
                    controller_port,
                    dir: node_dir,
                    proc: None,
                    args,
                }
            })
            .collect();
        // A quorum of more than one voter forms only once most of them run: start them all,
        // then wait for each.
        thread::scope(|s| {
            for node in nodes.iter_mut() {
                s.spawn(move || node.start());
            }
        });
        let addr = ports
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        eprintln!(
            "[harness] private Apache Kafka ({count} node(s)) on {addr}, logs in {}",
            dir.path().display()
        );
        Broker {
            addr,
            nodes,
            tansu: None,
            _dir: dir,
        }
    }

    /// Its bootstrap addresses, `127.0.0.1:PORT[,...]`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The client address of node `id` (1-based).
    pub fn node_addr(&self, id: u32) -> String {
        format!("127.0.0.1:{}", self.node(id).port)
    }

    /// The controller port of node `id`.
    pub fn controller_port(&self, id: u32) -> u16 {
        self.node(id).controller_port
    }

    fn node(&self, id: u32) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    /// The process id of the first node (of the Tansu broker, on Tansu).
    pub fn pid(&self) -> u32 {
        if let Some((proc, _)) = &self.tansu {
            return proc.pid();
        }
        self.node_pid(1)
    }

    /// The process id of node `id`.
    pub fn node_pid(&self, id: u32) -> u32 {
        self.node(id).proc.as_ref().expect("node running").pid()
    }

    /// SIGKILLs node `id`.
    pub fn kill_node(&mut self, id: u32) {
        if let Some(mut proc) = self.node_mut(id).proc.take() {
            proc.kill();
        }
        eprintln!("[harness] Kafka node {id} killed (SIGKILL)");
    }

    /// Starts node `id` again on its storage and ports, after [`Broker::kill_node`].
    pub fn restart_node(&mut self, id: u32) {
        self.node_mut(id).start();
        eprintln!("[harness] Kafka node {id} started again");
    }

    /// The node that leads the KRaft quorum, the active controller.
    pub fn active_controller(&self) -> u32 {
        let running = self
            .nodes
            .iter()
            .find(|n| n.proc.is_some())
            .expect("a running node");
        let out = kafka_tool(
            "org.apache.kafka.tools.MetadataQuorumCommand",
            &[
                "--bootstrap-server",
                &format!("127.0.0.1:{}", running.port),
                "describe",
                "--status",
            ],
        );
        out.lines()
            .find_map(|l| l.trim().strip_prefix("LeaderId:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no LeaderId in:\n{out}"))
    }

    /// The last `lines` lines of its log (of every node, for a cluster).
    pub fn log_tail(&self, lines: usize) -> String {
        if let Some((_, log)) = &self.tansu {
            return file_tail(log, lines);
        }
        self.nodes
            .iter()
            .map(|n| format!("-- node {} --\n{}", n.id, file_tail(&n.log(), lines)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn pids(&self) -> Vec<u32> {
        if let Some((proc, _)) = &self.tansu {
            return vec![proc.pid()];
        }
        self.nodes
            .iter()
            .filter_map(|n| n.proc.as_ref().map(|p| p.pid()))
            .collect()
    }

    /// Freezes the broker (SIGSTOP to every node): connections stay open and nothing answers.
    pub fn sigstop(&self) {
        for pid in self.pids() {
            signal(pid, "STOP");
        }
        eprintln!("[harness] broker {} stopped (SIGSTOP)", self.addr);
    }

    /// Wakes the broker (SIGCONT).
    pub fn sigcont(&self) {
        for pid in self.pids() {
            signal(pid, "CONT");
        }
        eprintln!("[harness] broker {} continued (SIGCONT)", self.addr);
    }
}

/// Bootstrap servers for the tests: `TALLY_TEST_BROKERS` (the broker scripts/test shares among
/// all test binaries), else a private broker started once for this test process.
pub fn brokers() -> String {
    if let Ok(b) = std::env::var("TALLY_TEST_BROKERS")
        && !b.trim().is_empty()
        && !on_tansu()
    {
        return b;
    }
    PROCESS_BROKER
        .get_or_init(Broker::start_private)
        .addr
        .clone()
}

static PROCESS_BROKER: OnceLock<Broker> = OnceLock::new();

/// The last `lines` lines of the log of this process's broker, when `brokers` is that broker.
pub fn process_broker_log_tail(brokers: &str, lines: usize) -> Option<String> {
    PROCESS_BROKER
        .get()
        .filter(|b| b.addr == brokers)
        .map(|b| b.log_tail(lines))
}

/// A private Tansu broker with memory storage.
fn start_tansu() -> Broker {
    let tansu = tansu_bin().unwrap_or_else(|| {
        panic!("TALLY_TEST_BROKER=tansu, but tansu is not installed; run: {TANSU_INSTALL}")
    });
    let dir = log_dir("tansu-");
    let port = free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let log_path = dir.path().join("tansu.log");
    let log = File::create(&log_path).expect("create tansu log");
    let filter = std::env::var("TALLY_TEST_TANSU_LOG")
        .unwrap_or_else(|_| "warn,tansu_broker::coordinator=info".to_string());
    let proc = Guarded::spawn(
        Command::new(tansu)
            .args(["broker", "--listener-url", &url])
            .args(["--advertised-listener-url", &url])
            .args(["--storage-engine", "memory://tansu/"])
            .env("RUST_LOG", filter)
            .stdout(log.try_clone().unwrap())
            .stderr(log),
    )
    .expect("spawn tansu broker");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !port_open(port) {
        assert!(
            Instant::now() < deadline,
            "tansu did not accept connections on {port} within 30 s:\n{}",
            file_tail(&log_path, 20)
        );
        thread::sleep(Duration::from_millis(100));
    }
    eprintln!("[harness] private Tansu broker on 127.0.0.1:{port}");
    Broker {
        addr: format!("127.0.0.1:{port}"),
        nodes: Vec::new(),
        tansu: Some((proc, log_path)),
        _dir: dir,
    }
}
