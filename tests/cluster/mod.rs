//! A private Redis Cluster on loopback for the cluster tests: primaries and
//! replicas started from the store under test (`TALLY_TEST_STORE`: redis-server or
//! valkey-server), joined with `redis-cli --cluster`.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::common::{listen_ports, packed_as_key, redis_tool, scan_keys, store_server};

/// One node of the cluster.
pub struct Node {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// A running cluster; every node is killed on drop.
pub struct RedisCluster {
    pub nodes: Vec<Node>,
    _dir: TempDir,
}

/// A port whose cluster bus port (port + 10000) is free too, both below the ephemeral range (see
/// `free_port`), so a restarted node finds its ports unclaimed.
fn cluster_port(taken: &[u16]) -> u16 {
    let ports = listen_ports();
    assert!(
        ports.end - ports.start > 12_000,
        "the listening ports {ports:?} leave no room for a cluster bus at port + 10000"
    );
    loop {
        let port = ports.start + (rand::random::<u16>() % (ports.end - ports.start - 10_000));
        if taken.contains(&port) {
            continue;
        }
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            return port;
        }
    }
}

fn conn(port: u16) -> redis::Connection {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn
}

fn try_conn(port: u16) -> Option<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let conn = client
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    Some(conn)
}

impl Node {
    fn start(&mut self) {
        let log = std::fs::File::create(self.dir.join("stdout.log")).unwrap();
        let child = Command::new(store_server())
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--daemonize", "no"])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args([
                "--cluster-node-timeout",
                "2000",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(mut c) = try_conn(self.port)
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        panic!("cluster node {} did not start", self.port);
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// SIGSTOP: the node keeps its connections but answers nothing, as a
    /// replica stuck on a slow disk or a lost network would.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`Node::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, which: &str) {
        let child = self.child.as_ref().expect("a running node");
        let status = Command::new("kill")
            .arg(which)
            .arg(child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {which} {}", child.id());
    }
}

impl RedisCluster {
    /// `primaries` primaries with `replicas` replicas each.
    pub fn start(primaries: usize, replicas: usize) -> RedisCluster {
        let dir = tempfile::Builder::new()
            .prefix("cluster-")
            .tempdir()
            .unwrap();
        let mut ports = Vec::new();
        let mut nodes = Vec::new();
        for _ in 0..primaries * (1 + replicas) {
            let port = cluster_port(&ports);
            ports.push(port);
            let node_dir = dir.path().join(port.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            let mut node = Node {
                port,
                dir: node_dir,
                child: None,
            };
            node.start();
            nodes.push(node);
        }
        let mut create = Command::new(redis_tool("redis-cli"));
        create.arg("--cluster").arg("create");
        for p in &ports {
            create.arg(format!("127.0.0.1:{p}"));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster { nodes, _dir: dir };
        cluster.wait_ok();
        eprintln!("[cluster] {} nodes up: {ports:?}", ports.len());
        cluster
    }

    /// `redis+cluster://` URL naming every node.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// Waits until every live node reports `cluster_state:ok` and agrees there are no failing slots.
    pub fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ok = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                try_conn(n.port)
                    .and_then(|mut c| {
                        redis::cmd("CLUSTER")
                            .arg("INFO")
                            .query::<String>(&mut c)
                            .ok()
                    })
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "cluster not ok within 60 s");
            thread::sleep(Duration::from_millis(200));
        }
    }

    /// Ports of the nodes that are primaries now, with their node ids.
    pub fn primaries(&self) -> Vec<(u16, String)> {
        let live = self
            .nodes
            .iter()
            .find(|n| n.child.is_some())
            .expect("a live node");
        let text: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut conn(live.port))
            .unwrap();
        text.lines()
            .filter(|l| l.contains("master") && !l.contains("fail"))
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let id = f.next()?.to_string();
                let addr = f.next()?;
                let port = addr.split(['@', ':']).nth(1)?.parse().ok()?;
                Some((port, id))
            })
            .collect()
    }

    /// Waits until the nodes have settled into `replicas` replicas per primary: each primary
    /// counts that many replicas online (from a replica's first acknowledgement, after its sync),
    /// and each replica's link is up. Right after `--cluster create` a replica can still call
    /// itself a primary for a while.
    pub fn wait_replicas_linked(&self, replicas: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let primaries = self.nodes.len() / (1 + replicas);
        loop {
            let infos: Vec<String> = self
                .nodes
                .iter()
                .filter(|n| n.child.is_some())
                .map(|n| {
                    redis::cmd("INFO")
                        .arg("replication")
                        .query(&mut conn(n.port))
                        .unwrap()
                })
                .collect();
            let settled_primaries = infos
                .iter()
                .filter(|i| {
                    i.contains("role:master") && i.matches("state=online").count() >= replicas
                })
                .count();
            let linked = infos
                .iter()
                .filter(|i| i.contains("role:slave") && i.contains("master_link_status:up"))
                .count();
            if settled_primaries == primaries && linked == primaries * replicas {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replication not settled within 60 s: {settled_primaries} of {primaries} primaries, {linked} replicas linked"
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Ports of the nodes that are replicas now, by their own account (`INFO replication`).
    pub fn replicas(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .filter(|n| {
                redis::cmd("INFO")
                    .arg("replication")
                    .query::<String>(&mut conn(n.port))
                    .is_ok_and(|info| info.contains("role:slave"))
            })
            .map(|n| n.port)
            .collect()
    }

    pub fn node_mut(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("known node")
    }

    /// Restarts a killed node on its port and directory (reloading its AOF).
    pub fn restart(&mut self, port: u16) {
        self.node_mut(port).start();
    }

    /// SCRIPT FLUSH on every primary.
    pub fn script_flush_all(&self) {
        for (port, _) in self.primaries() {
            let _: () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query(&mut conn(port))
                .unwrap();
        }
    }

    /// Moves `slots` slots from one primary to another with `redis-cli --cluster reshard`.
    pub fn reshard(&self, from: &str, to: &str, slots: u32) {
        let any = self.primaries()[0].0;
        let out = Command::new(redis_tool("redis-cli"))
            .args(["--cluster", "reshard", &format!("127.0.0.1:{any}")])
            .args(["--cluster-from", from, "--cluster-to", to])
            .args([
                "--cluster-slots",
                &slots.to_string(),
                "--cluster-yes",
                "--cluster-pipeline",
                "100",
            ])
            .output()
            .expect("redis-cli --cluster reshard");
        assert!(
            out.status.success(),
            "reshard failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .rev()
                .take(10)
                .collect::<Vec<_>>()
                .join("\n"),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `CLUSTER MIGRATESLOTS SLOTSRANGE <first> <last> ... NODE <id> [SLOTSRANGE ... NODE ...]`
    /// sent to `source` (Valkey 9's atomic slot migration), one `SLOTSRANGE ... NODE` group per
    /// target: the server's answer as is, so a store without the command can be seen refusing
    /// it. The migrations run on after the `OK`; see [`RedisCluster::slot_migrations`].
    pub fn migrate_slots(
        &self,
        source: u16,
        moves: &[(Vec<(u16, u16)>, String)],
    ) -> redis::RedisResult<String> {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("MIGRATESLOTS");
        for (ranges, to) in moves {
            cmd.arg("SLOTSRANGE");
            for (first, last) in ranges {
                cmd.arg(first).arg(last);
            }
            cmd.arg("NODE").arg(to);
        }
        cmd.query(&mut conn(source))
    }

    /// `CLUSTER GETSLOTMIGRATIONS` on `port`: each import or export job the node knows, as
    /// field → text (`operation`, `slot_ranges`, `source_node`, `target_node`, `state`, ...).
    pub fn slot_migrations(&self, port: u16) -> Vec<HashMap<String, String>> {
        let jobs: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
            .arg("GETSLOTMIGRATIONS")
            .query(&mut conn(port))
            .unwrap();
        jobs.iter()
            .map(|fields| {
                fields
                    .chunks(2)
                    .filter_map(|kv| Some((text(&kv[0])?, text(kv.get(1)?)?)))
                    .collect()
            })
            .collect()
    }

    /// The owner (node id) of every assigned slot, as `CLUSTER SHARDS` on `port` reports it.
    pub fn shard_owners(&self, port: u16) -> HashMap<u16, String> {
        let shards: Vec<redis::Value> = redis::cmd("CLUSTER")
            .arg("SHARDS")
            .query(&mut conn(port))
            .unwrap();
        let mut owners = HashMap::new();
        for shard in &shards {
            let fields = pairs(shard);
            let primary = fields
                .get("nodes")
                .and_then(|nodes| match nodes {
                    redis::Value::Array(nodes) => nodes.iter().map(pairs).find(|n| {
                        n.get("role").and_then(|v| text(v)).as_deref() == Some("master")
                            && n.get("health").and_then(|v| text(v)).as_deref() == Some("online")
                    }),
                    _ => None,
                })
                .and_then(|node| node.get("id").and_then(|v| text(v)));
            let (Some(primary), Some(redis::Value::Array(slots))) = (primary, fields.get("slots"))
            else {
                continue;
            };
            let bounds: Vec<u16> = slots
                .iter()
                .map(|s| text(s).and_then(|s| s.parse().ok()).expect("a slot number"))
                .collect();
            for range in bounds.chunks(2) {
                for slot in range[0]..=range[1] {
                    owners.insert(slot, primary.clone());
                }
            }
        }
        owners
    }

    /// The hash slot of every key matching `pattern`, by the server (`CLUSTER KEYSLOT`), with
    /// the port of the primary holding it and how many such keys it holds there.
    pub fn key_slots(&self, pattern: &str) -> BTreeMap<u16, (u16, usize)> {
        let mut slots = BTreeMap::new();
        for (port, _) in self.primaries() {
            let mut c = conn(port);
            let keys = scan_keys(&mut c, pattern);
            if keys.is_empty() {
                continue;
            }
            let mut pipe = redis::pipe();
            for key in &keys {
                pipe.cmd("CLUSTER").arg("KEYSLOT").arg(key);
            }
            let found: Vec<u16> = pipe.query(&mut c).unwrap();
            for slot in found {
                slots.entry(slot).or_insert((port, 0)).1 += 1;
            }
        }
        slots
    }

    /// `CLUSTER COUNTKEYSINSLOT` on `port`.
    pub fn keys_in_slot(&self, port: u16, slot: u16) -> usize {
        redis::cmd("CLUSTER")
            .arg("COUNTKEYSINSLOT")
            .arg(slot)
            .query(&mut conn(port))
            .unwrap()
    }

    /// `CONFIG SET <name> <value>` on one node.
    pub fn config_set(&self, port: u16, name: &str, value: &str) {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut conn(port))
            .unwrap();
    }

    /// Every key matching `pattern` on every primary, with its string value.
    pub fn scan(&self, pattern: &str) -> HashMap<String, String> {
        let mut all = HashMap::new();
        for (port, _) in self.primaries() {
            let mut c = conn(port);
            for key in scan_keys(&mut c, pattern) {
                let value: Option<String> = match redis::cmd("GET").arg(&key).query(&mut c) {
                    Ok(value) => value,
                    // The key's slot moved away between SCAN and GET; its new owner has it.
                    Err(e) if matches!(e.code(), Some("MOVED" | "ASK")) => continue,
                    Err(e) => panic!("GET {key} on {port}: {e}"),
                };
                if let Some(value) = value {
                    all.insert(key, value);
                }
            }
        }
        all
    }

    /// Where every counter of `post` under `prefix` is, across the cluster: (primary's port,
    /// key, field when packed, value, the counter named as its string key).
    pub fn post_places(&self, prefix: &str, post: u64) -> Vec<Place> {
        let mut all = Vec::new();
        for (port, _) in self.primaries() {
            let mut c = conn(port);
            for key in scan_keys(&mut c, &format!("{prefix}:likes:{post}:*")) {
                match redis::cmd("GET").arg(&key).query::<Option<i64>>(&mut c) {
                    Ok(Some(value)) => all.push(Place {
                        port,
                        name: strip_tag(&key),
                        key,
                        field: None,
                        value,
                    }),
                    Ok(None) => {}
                    Err(e) if matches!(e.code(), Some("MOVED" | "ASK")) => {}
                    Err(e) => panic!("GET {key} on {port}: {e}"),
                }
            }
            for key in scan_keys(&mut c, &format!("{prefix}:packed:*")) {
                let fields: Vec<(String, i64)> = match redis::cmd("HGETALL").arg(&key).query(&mut c)
                {
                    Ok(fields) => fields,
                    Err(e) if matches!(e.code(), Some("MOVED" | "ASK")) => continue,
                    Err(e) => panic!("HGETALL {key} on {port}: {e}"),
                };
                for (field, value) in fields {
                    if let Some((of, name)) = packed_as_key(prefix, &field)
                        && of == post
                    {
                        all.push(Place {
                            port,
                            key: key.clone(),
                            field: Some(field),
                            value,
                            name,
                        });
                    }
                }
            }
        }
        all
    }

    /// Per post, the sum of `<prefix>:likes:<post>:*` across the cluster.
    pub fn read_counts(&self, prefix: &str) -> HashMap<u64, i64> {
        let head = format!("{prefix}:likes:");
        let mut counts = HashMap::new();
        for (key, value) in self.scan(&format!("{prefix}:likes:*")) {
            let post: u64 = key
                .strip_prefix(&head)
                .unwrap()
                .split(':')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            *counts.entry(post).or_insert(0) += value.parse::<i64>().unwrap();
        }
        // The packed layout: fields `<post as i64>[:...]` of `<prefix>:packed:<n>:{tag}`.
        for (port, _) in self.primaries() {
            let mut c = conn(port);
            for key in scan_keys(&mut c, &format!("{prefix}:packed:*")) {
                let fields: Vec<(String, String)> =
                    match redis::cmd("HGETALL").arg(&key).query(&mut c) {
                        Ok(fields) => fields,
                        Err(e) if matches!(e.code(), Some("MOVED" | "ASK")) => continue,
                        Err(e) => panic!("HGETALL {key} on {port}: {e}"),
                    };
                for (field, value) in fields {
                    let post = field.split(':').next().unwrap().parse::<i64>().unwrap() as u64;
                    *counts.entry(post).or_insert(0) += value.parse::<i64>().unwrap();
                }
            }
        }
        counts
    }

    /// Waits until, for every partition with messages, all `groups` fences hold its last offset.
    pub fn wait_applied(
        &self,
        prefix: &str,
        group: &str,
        topic: &str,
        hwms: &[i64],
        groups: usize,
        timeout: Duration,
        mut check: impl FnMut(),
    ) {
        let started = Instant::now();
        loop {
            let fences = self.scan(&format!("{prefix}:fence:{group}:{topic}:*"));
            let mut behind = Vec::new();
            for (p, &hwm) in hwms.iter().enumerate() {
                if hwm == 0 {
                    continue;
                }
                let head = format!("{prefix}:fence:{group}:{topic}:{p}:");
                let at_end = fences
                    .iter()
                    .filter(|(k, v)| k.starts_with(&head) && v.parse::<i64>().ok() == Some(hwm - 1))
                    .count();
                if at_end != groups {
                    behind.push(format!("p{p}: {at_end}/{groups} groups at {}", hwm - 1));
                }
            }
            if behind.is_empty() {
                eprintln!(
                    "[cluster] applied after {:.1} s",
                    started.elapsed().as_secs_f64()
                );
                return;
            }
            check();
            assert!(
                started.elapsed() < timeout,
                "not applied within {timeout:?}: {}",
                behind.join(", ")
            );
            thread::sleep(Duration::from_millis(300));
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        if thread::panicking() {
            self._dir.disable_cleanup(true);
            eprintln!(
                "[cluster] nodes' files kept in {}",
                self._dir.path().display()
            );
        }
        for node in &mut self.nodes {
            if thread::panicking() {
                eprintln!(
                    "[cluster] node {} log tail:\n{}",
                    node.port,
                    crate::common::file_tail(&node.dir.join("stdout.log"), 15)
                );
            }
            node.kill();
        }
    }
}

/// A simple or bulk string, or an integer, as text.
fn text(value: &redis::Value) -> Option<String> {
    match value {
        redis::Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        redis::Value::SimpleString(s) => Some(s.clone()),
        redis::Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A reply's field → value pairs: a RESP2 flat array or a RESP3 map.
fn pairs(value: &redis::Value) -> HashMap<String, &redis::Value> {
    match value {
        redis::Value::Array(items) => items
            .chunks(2)
            .filter_map(|kv| Some((text(&kv[0])?, kv.get(1)?)))
            .collect(),
        redis::Value::Map(items) => items
            .iter()
            .filter_map(|(k, v)| Some((text(k)?, v)))
            .collect(),
        _ => HashMap::new(),
    }
}

/// One counter found on a cluster (see [`RedisCluster::post_places`]).
#[derive(Debug, Clone)]
pub struct Place {
    /// The primary holding it.
    pub port: u16,
    /// Its key: the string key, or the hash.
    pub key: String,
    /// Its field, when packed.
    pub field: Option<String>,
    /// Its value.
    pub value: i64,
    /// The counter named as its string key, without the slot group's tag.
    pub name: String,
}

/// A string counter key without its trailing `:{tag}`.
fn strip_tag(key: &str) -> String {
    match key.rfind(":{") {
        Some(at) if key.ends_with('}') => key[..at].to_string(),
        _ => key.to_string(),
    }
}
