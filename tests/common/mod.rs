//! Shared harness for the integration tests: real services, a workload with its own ground truth,
//! and a wrapper around the `tally` binary.
//!
//! # Services
//! - Kafka: `brokers()` is the Apache Kafka node scripts/test starts and shares among all test
//!   binaries (`TALLY_TEST_BROKERS`), or one started for this test process; every test has its
//!   own topics and groups. Tests that stop, empty or reconfigure a broker start one of their own
//!   (`Broker::start_private`, `Broker::start_cluster(3)` for failovers). All of them start
//!   through `scripts/kafka/broker`. `TALLY_TEST_BROKER=tansu` runs the suite on Tansu 0.6.
//! - Redis: every test starts its own `redis-server` on a free loopback port (`RedisServer`),
//!   or `valkey-server` with `TALLY_TEST_STORE=valkey` (`Store`).
//!
//! Every child process is paired with a small watchdog shell that holds a pipe from this process
//! and SIGKILLs the child when that pipe closes, so nothing outlives a test binary, however it
//! ends (panic, timeout, SIGKILL).
//!
//! # Ground truth
//! Events are encoded by hand (`encode_like`) and the expected counts are computed here, so a
//! test never trusts the code it checks.
//!
//! # Layout
//! - `process`: children paired with a watchdog, and their log files.
//! - `kafka`: Apache Kafka nodes and clusters (and Tansu), Kafka's command-line tools.
//! - `topics`: topics, the producer, watermarks, topic readers.
//! - `workload`: the hand-made event encoding, the workload generator, count comparison.
//! - `dupes`: a producer that delivers at least once (repeated ids, double taps), with a truth
//!   that counts each like once.
//! - `redis_server`: private redis-server instances (with AOF), counters and fences.
//! - `binary`: the `tally` process under test.
//! - `metrics`: scraping and parsing its Prometheus endpoint.
//! - `scenario`: one run's names, a producer thread, and the final wait-and-compare.
//! - `tls`: a private CA and certificates (`openssl`), TLS-only redis-servers and a TLS Redis
//!   Cluster.
//! - here: ports, names, seeds and polling.

// Each test binary uses a different part of the harness.
#![allow(dead_code, unused_imports)]

mod applying;
mod binary;
mod dupes;
mod kafka;
mod metrics;
mod process;
mod redis_server;
mod scenario;
mod tls;
mod topics;
mod workload;

use std::collections::HashSet;
use std::net::{TcpListener, TcpStream};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use rand::Rng;

pub use applying::*;
pub use binary::*;
pub use dupes::*;
pub use kafka::*;
pub use metrics::*;
pub use process::file_tail;
pub use redis_server::*;
pub use scenario::*;
pub use tls::*;
pub use topics::*;
pub use workload::*;

/// A loopback port that was free a moment ago, was not handed out before by this process, and
/// lies below the kernel's ephemeral range (`ip_local_port_range`). Outside that range no client
/// socket is ever bound to it: a node killed and started again on its port would otherwise find
/// it taken by a connection that a reconnecting client made to itself (a TCP self-connect to a
/// port nothing listens on).
pub fn free_port() -> u16 {
    static GIVEN: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let given = GIVEN.get_or_init(|| Mutex::new(HashSet::new()));
    let range = listen_ports();
    let mut rng = rand::rng();
    for _ in 0..1000 {
        let port: u16 = rng.random_range(range.clone());
        if given.lock().unwrap().contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.lock().unwrap().insert(port);
            return port;
        }
    }
    panic!("no free loopback port found in {range:?}");
}

/// The ports `free_port` draws from: from 10000 up to the start of the ephemeral range, or, when
/// that range starts lower, from its end up.
pub fn listen_ports() -> std::ops::Range<u16> {
    let text =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut bounds = text
        .split_whitespace()
        .filter_map(|v| v.parse::<u16>().ok());
    let (low, high) = match (bounds.next(), bounds.next()) {
        (Some(low), Some(high)) => (low, high),
        _ => (32768, 60999),
    };
    if low >= 12000 {
        10000..low
    } else if high <= 63000 {
        high + 1..65535
    } else {
        panic!(
            "the ephemeral port range {low}-{high} leaves no room for test listeners; \
             narrow it with `sysctl -w net.ipv4.ip_local_port_range=\"32768 60999\"`"
        )
    }
}

/// `name` plus a random suffix, for topics, groups and key prefixes.
pub fn unique(name: &str) -> String {
    let n: u64 = rand::rng().random();
    format!("{name}-{:012x}", n & 0xffff_ffff_ffff)
}

/// The seed for a test's random choices: `TALLY_TEST_SEED` or a fresh one, printed so a failing
/// run can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed = match std::env::var("TALLY_TEST_SEED") {
        Ok(s) => s.parse().expect("TALLY_TEST_SEED must be a u64"),
        Err(_) => rand::rng().random(),
    };
    eprintln!("[{test}] seed {seed} (rerun with TALLY_TEST_SEED={seed})");
    seed
}

pub fn wait_for<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    try_wait_for(timeout, f)
        .unwrap_or_else(|| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// Polls `f` every 100 ms until it returns a value or `timeout` has passed.
pub fn try_wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

fn port_open(port: u16) -> bool {
    TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}
