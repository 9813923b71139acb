//! Redis side: the store a run of the suite uses (`TALLY_TEST_STORE`), private server
//! instances of it, and readers for counters and fences.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::free_port;
use super::process::{Guarded, file_tail, log_dir};

pub const REDIS_INSTALL: &str = "apt-get update && apt-get install -y redis-server";
pub const VALKEY_INSTALL: &str = "bash -c 'source scripts/lib.sh && ensure_valkey'";

/// The server every test of a run starts: `TALLY_TEST_STORE=redis` (Debian's redis-server, the
/// default) or `valkey` (valkey-server 9.1.2, which scripts/lib.sh's `ensure_valkey` puts in
/// `~/.cache/tally/valkey-9.1.2`, or `TALLY_VALKEY_HOME`). redis-cli is Redis's for both: it
/// speaks to Valkey as to Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    Redis,
    Valkey,
}

impl Store {
    pub fn current() -> Store {
        match std::env::var("TALLY_TEST_STORE").as_deref() {
            Err(_) | Ok("") | Ok("redis") => Store::Redis,
            Ok("valkey") => Store::Valkey,
            Ok(other) => panic!("TALLY_TEST_STORE={other:?}: use redis or valkey"),
        }
    }

    /// The server program, for log lines and messages.
    pub fn server_name(self) -> &'static str {
        match self {
            Store::Redis => "redis-server",
            Store::Valkey => "valkey-server",
        }
    }

    pub fn server_bin(self) -> PathBuf {
        match self {
            Store::Redis => redis_tool("redis-server"),
            Store::Valkey => valkey_tool("valkey-server"),
        }
    }
}

/// The server program of the store this run uses (see [`Store`]).
pub fn store_server() -> PathBuf {
    Store::current().server_bin()
}

/// `name` from Valkey's install directory (`TALLY_VALKEY_HOME`, else
/// `~/.cache/tally/valkey-9.1.2`), else from PATH.
fn valkey_tool(name: &str) -> PathBuf {
    let home = std::env::var_os("TALLY_VALKEY_HOME")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tally/valkey-9.1.2"))
        });
    let path = std::env::var_os("PATH").unwrap_or_default();
    home.into_iter()
        .chain(std::env::split_paths(&path))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{name} is not installed (TALLY_TEST_STORE=valkey); run: {VALKEY_INSTALL}")
        })
}

/// A private `redis-server` on a free loopback port; killed on drop.
pub struct RedisServer {
    port: u16,
    aof: bool,
    /// An ACL user and password every connection must give (the default user is off).
    acl: Option<(String, String)>,
    dir: TempDir,
    proc: Option<Guarded>,
    starts: u32,
}

fn redis_server_bin() -> PathBuf {
    store_server()
}

/// Path of a program installed with redis-server (`redis-cli`, ...): the first on PATH, else in
/// /usr/bin or /usr/local/bin.
pub fn redis_tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is not installed; run: {REDIS_INSTALL}"))
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_inner(false)
    }

    /// With `appendonly yes` and `appendfsync everysec`, so `restart` reloads the AOF.
    pub fn start_with_aof() -> RedisServer {
        Self::start_inner(true)
    }

    /// With the default user off and one ACL user allowed everything; `url()` carries its
    /// credentials.
    pub fn start_with_acl(user: &str, password: &str) -> RedisServer {
        Self::start_full(false, Some((user.to_string(), password.to_string())))
    }

    fn start_inner(aof: bool) -> RedisServer {
        Self::start_full(aof, None)
    }

    fn start_full(aof: bool, acl: Option<(String, String)>) -> RedisServer {
        let bin = redis_server_bin();
        let dir = log_dir("redis-");
        let mut server = RedisServer {
            port: 0,
            aof,
            acl,
            dir,
            proc: None,
            starts: 0,
        };
        for _ in 0..5 {
            server.port = free_port();
            if server.launch(&bin) {
                return server;
            }
        }
        panic!("could not start redis-server:\n{}", server.log_tail(20));
    }

    /// Starts redis-server on `self.port` and waits until it answers PING with loading done.
    /// Returns false when the process exited (e.g. the port was taken).
    fn launch(&mut self, bin: &Path) -> bool {
        self.starts += 1;
        let out = File::create(self.dir.path().join(format!("stdout-{}.log", self.starts)))
            .expect("create redis stdout log");
        let mut cmd = Command::new(bin);
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"));
        if self.aof {
            cmd.args(["--appendonly", "yes", "--appendfsync", "everysec"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        if let Some((user, password)) = &self.acl {
            cmd.args(["--user", "default", "off", "--user", user, "on"])
                .arg(format!(">{password}"))
                .args(["~*", "&*", "+@all"]);
        }
        let mut proc = Guarded::spawn(cmd.stdout(out.try_clone().unwrap()).stderr(out))
            .expect("spawn redis-server");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(_)) = proc.child.try_wait() {
                proc.release_watchdog();
                return false;
            }
            if self.ready() {
                self.proc = Some(proc);
                return true;
            }
            if Instant::now() > deadline {
                panic!(
                    "redis-server on {} not ready within 60 s:\n{}",
                    self.port,
                    self.log_tail(20)
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn ready(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
            return false;
        };
        let pong: redis::RedisResult<String> = redis::cmd("PING").query(&mut conn);
        if pong.as_deref() != Ok("PONG") {
            return false;
        }
        let info: redis::RedisResult<String> =
            redis::cmd("INFO").arg("persistence").query(&mut conn);
        matches!(info, Ok(text) if text.lines().any(|l| l.trim() == "loading:0"))
    }

    pub fn url(&self) -> String {
        match &self.acl {
            Some((user, password)) => format!("redis://{user}:{password}@127.0.0.1:{}/", self.port),
            None => format!("redis://127.0.0.1:{}/", self.port),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// SIGKILL, then wait until the process is gone.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Starts again on the same port and directory (reloading the AOF, if enabled).
    pub fn restart(&mut self) {
        self.kill();
        let bin = redis_server_bin();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.launch(&bin) {
            assert!(
                Instant::now() < deadline,
                "redis-server could not restart on port {}:\n{}",
                self.port,
                self.log_tail(20)
            );
            thread::sleep(Duration::from_millis(200));
        }
    }

    /// Cuts up to `bytes` off the end of the newest incremental AOF file, as if the machine had
    /// gone down before its last writes reached the disk, then does what the store needs after
    /// an unclean stop ([`repair_after_unclean_stop`]). Call between `kill` and `restart`.
    /// Returns the number of bytes cut.
    pub fn truncate_aof_tail(&self, bytes: u64) -> u64 {
        assert!(
            self.proc.is_none(),
            "truncate the AOF only while the server is down"
        );
        let cut = cut_aof_tail(self.dir.path(), bytes);
        repair_after_unclean_stop(self.dir.path());
        cut
    }

    pub fn conn(&self) -> redis::Connection {
        let client = redis::Client::open(self.url()).expect("redis url");
        let conn = client
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connect to redis on {}: {e}", self.port));
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("set read timeout");
        conn
    }

    pub fn log_tail(&self, lines: usize) -> String {
        file_tail(&self.dir.path().join("redis.log"), lines)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if thread::panicking() && self.proc.is_some() {
            eprintln!(
                "[harness] redis-server :{} log tail:\n{}",
                self.port,
                self.log_tail(15)
            );
        }
        self.kill();
    }
}

/// The AOF directory under a server's `--dir`, and its manifest.
fn aof_manifest(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir.join("appendonlydir"))
        .expect("read appendonlydir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "manifest"))
        .expect("AOF manifest")
}

/// Cuts up to `bytes` off the end of the newest incremental AOF file of the server whose
/// `--dir` is `dir` (stopped); returns the number of bytes cut.
pub fn cut_aof_tail(dir: &Path, bytes: u64) -> u64 {
    let manifest = aof_manifest(dir);
    let text = std::fs::read_to_string(&manifest).expect("read AOF manifest");
    let incr = text
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let field = |k: &str| fields.iter().position(|f| *f == k).map(|i| fields[i + 1]);
            (field("type") == Some("i")).then(|| field("file").map(str::to_string))?
        })
        .next_back()
        .expect("an incremental AOF file in the manifest");
    let path = manifest.parent().unwrap().join(incr);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open incremental AOF");
    let len = file.metadata().expect("AOF metadata").len();
    let cut = bytes.min(len);
    file.set_len(len - cut).expect("truncate AOF");
    cut
}

/// What an operator runs after an unclean stop of the store under test, before it starts
/// again (docs/design.md and docs/operations.md say the same):
/// - Redis 7.0 loads a torn last transaction by dropping it in memory, but leaves its first
///   commands in the file; the next writes are appended after them, and a later restart runs
///   that torn head together with the next transaction: increments without their fence,
///   counted again when the batch is replayed. `redis-check-aof --fix` on the manifest cuts
///   the torn transaction off first.
/// - Valkey 9 drops the torn transaction and cuts it off the file itself while loading
///   (`aof-load-truncated yes`, the default), so nothing is run. Its checker could not help
///   anyway: valkey-check-aof 9.1.2, like redis-check-aof 7.0, reads the `VALKEY080` RDB base
///   file as commands and refuses the manifest.
pub fn repair_after_unclean_stop(dir: &Path) {
    match Store::current() {
        Store::Valkey => {}
        Store::Redis => {
            let manifest = aof_manifest(dir);
            let mut fix = Command::new(redis_tool("redis-check-aof"))
                .arg("--fix")
                .arg(&manifest)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("run redis-check-aof: {e}; install it with: {REDIS_INSTALL}")
                });
            use std::io::Write as _;
            let _ = fix.stdin.take().expect("stdin").write_all(b"y\n");
            let out = fix.wait_with_output().expect("redis-check-aof");
            assert!(
                out.status.success(),
                "redis-check-aof --fix failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// Writes the layout record the first `tally run` on a single server would write for `prefix`,
/// with `buckets` buckets: for tests that write counters by hand.
pub fn write_layout_record(conn: &mut impl redis::ConnectionLike, prefix: &str, buckets: u32) {
    write_layout_record_with(conn, prefix, buckets, 1);
}

/// [`write_layout_record`] with `slot_groups` slot groups, as on a cluster.
pub fn write_layout_record_with(
    conn: &mut impl redis::ConnectionLike,
    prefix: &str,
    buckets: u32,
    slot_groups: u32,
) {
    let buckets = buckets.to_string();
    let slot_groups = slot_groups.to_string();
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}:layout"))
        .arg(&[
            ("format", "1"),
            ("buckets", buckets.as_str()),
            ("slot_groups", slot_groups.as_str()),
            ("topic", "likes"),
            ("group", "tally"),
            ("created_at_ms", "0"),
        ])
        .query(conn)
        .unwrap();
}

/// Sums every counter per post: the string keys (`<prefix>:likes:<post_id>:...`) and the
/// fields of packed hashes (`<prefix>:packed:<n>`, field `<post as i64>[:...]`), whichever
/// the prefix holds. Parsed here, apart from the code under test.
pub fn read_counts(conn: &mut redis::Connection, prefix: &str) -> HashMap<u64, i64> {
    let mut counts = read_string_counts(conn, prefix);
    let hashes = scan_keys(conn, &format!("{prefix}:packed:*"));
    // A run told to pack must leave no string counter behind.
    if super::binary::test_layout().iter().any(|a| a == "packed") {
        assert!(
            counts.is_empty(),
            "TALLY_TEST_LAYOUT=packed, yet {prefix} holds string counter keys"
        );
    }
    for key in hashes {
        let fields: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(&key)
            .query(conn)
            .expect("HGETALL");
        for (field, value) in fields {
            let post = parse_packed_field(&field)
                .unwrap_or_else(|| panic!("unexpected field {field:?} of {key}"));
            let value: i64 = value
                .parse()
                .unwrap_or_else(|_| panic!("field {field:?} of {key} holds {value:?}"));
            *counts.entry(post).or_insert(0) += value;
        }
    }
    counts
}

/// A packed field named as the string key that would hold the same counter:
/// `<prefix>:likes:<post>:<bucket or version and bucket>`, and its post.
pub fn packed_as_key(prefix: &str, field: &str) -> Option<(u64, String)> {
    let post = parse_packed_field(field)?;
    let tail = match field.split_once(':') {
        Some((_, rest)) => rest.to_string(),
        None => "0".to_string(),
    };
    Some((post, format!("{prefix}:likes:{post}:{tail}")))
}

/// Every counter of `post` under `prefix` with its value, named as its string key (a packed
/// field by [`packed_as_key`]): what writers have applied to it so far, in either layout.
pub fn post_counters(
    conn: &mut redis::Connection,
    prefix: &str,
    post: u64,
) -> std::collections::BTreeMap<String, i64> {
    let mut all = std::collections::BTreeMap::new();
    for key in scan_keys(conn, &format!("{prefix}:likes:{post}:*")) {
        let value: Option<i64> = redis::cmd("GET").arg(&key).query(conn).expect("GET");
        if let Some(value) = value {
            all.insert(key, value);
        }
    }
    for key in scan_keys(conn, &format!("{prefix}:packed:*")) {
        let fields: Vec<(String, i64)> = redis::cmd("HGETALL")
            .arg(&key)
            .query(conn)
            .expect("HGETALL");
        for (field, value) in fields {
            if let Some((of, name)) = packed_as_key(prefix, &field)
                && of == post
            {
                all.insert(name, value);
            }
        }
    }
    all
}

/// The post of a packed field: its first part is the post id's bits as a signed integer.
fn parse_packed_field(field: &str) -> Option<u64> {
    let (post, rest) = match field.split_once(':') {
        Some((post, rest)) => (post, Some(rest)),
        None => (field, None),
    };
    let post = post.parse::<i64>().ok()? as u64;
    match rest {
        None => Some(post),
        Some(rest) => parse_counter_key(&format!("{post}:{rest}")),
    }
}

/// Sums every string counter key per post.
fn read_string_counts(conn: &mut redis::Connection, prefix: &str) -> HashMap<u64, i64> {
    let pattern = format!("{prefix}:likes:*");
    let head = format!("{prefix}:likes:");
    let keys = scan_keys(conn, &pattern);
    let mut counts = HashMap::new();
    for chunk in keys.chunks(500) {
        let values: Vec<Option<String>> = redis::cmd("MGET").arg(chunk).query(conn).expect("MGET");
        for (key, value) in chunk.iter().zip(values) {
            let post = parse_counter_key(key.strip_prefix(&head).unwrap())
                .unwrap_or_else(|| panic!("unexpected counter key {key:?}"));
            let Some(value) = value else { continue };
            let value: i64 = value
                .parse()
                .unwrap_or_else(|_| panic!("counter {key:?} holds {value:?}, not an integer"));
            *counts.entry(post).or_insert(0) += value;
        }
    }
    counts
}

/// Every key matching `pattern`, by SCAN, sorted and without repeats.
pub fn scan_keys(conn: &mut redis::Connection, pattern: &str) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query(conn)
            .expect("SCAN");
        keys.extend(batch);
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    keys.sort();
    keys.dedup();
    keys
}

/// The post of a counter key's tail: `<post>:<bucket>` or `<post>:v<version>:b<bucket>`, either
/// optionally followed by a cluster hash tag `:{<tag>}`.
fn parse_counter_key(tail: &str) -> Option<u64> {
    let mut parts: Vec<&str> = tail.split(':').collect();
    if parts
        .last()
        .is_some_and(|t| t.starts_with('{') && t.ends_with('}'))
    {
        parts.pop();
    }
    match parts.as_slice() {
        [post, bucket] => {
            bucket.parse::<u32>().ok()?;
            post.parse().ok()
        }
        [post, version, bucket] => {
            // `v<k>`: a post's own version; `d<e>`: an epoch of the default layout.
            let number = version
                .strip_prefix('v')
                .or_else(|| version.strip_prefix('d'))?;
            number.parse::<u32>().ok()?;
            bucket.strip_prefix('b')?.parse::<u32>().ok()?;
            post.parse().ok()
        }
        _ => None,
    }
}

/// The generation readers sum (`<prefix>:generation`'s `current`; 0 before any rebuild).
pub fn current_generation(conn: &mut redis::Connection, prefix: &str) -> u64 {
    let current: Option<u64> = redis::cmd("HGET")
        .arg(format!("{prefix}:generation"))
        .arg("current")
        .query(conn)
        .unwrap();
    current.unwrap_or(0)
}

pub fn fence_key(prefix: &str, group: &str, topic: &str, partition: usize) -> String {
    format!("{prefix}:fence:{group}:{topic}:{partition}")
}

/// Current fences of partitions `0..n` (None where the key is missing).
pub fn read_fences(
    conn: &mut redis::Connection,
    prefix: &str,
    group: &str,
    topic: &str,
    n: usize,
) -> Vec<Option<i64>> {
    let keys: Vec<String> = (0..n).map(|p| fence_key(prefix, group, topic, p)).collect();
    let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query(conn).expect("MGET");
    values
        .into_iter()
        .zip(&keys)
        .map(|(v, k)| {
            v.map(|s| {
                s.parse()
                    .unwrap_or_else(|_| panic!("fence {k} holds {s:?}, not a decimal offset"))
            })
        })
        .collect()
}

/// Offsets applied so far in partitions `0..n`: each fence + 1, 0 where the key is missing.
pub fn applied_offsets(
    conn: &mut redis::Connection,
    prefix: &str,
    group: &str,
    topic: &str,
    n: usize,
) -> Vec<i64> {
    read_fences(conn, prefix, group, topic, n)
        .into_iter()
        .map(|f| f.map_or(0, |f| f + 1))
        .collect()
}

/// Waits until the fence of every partition with messages holds its last offset (`hwm - 1`).
pub fn wait_applied(
    conn: &mut redis::Connection,
    prefix: &str,
    group: &str,
    topic: &str,
    hwms: &[i64],
    timeout: Duration,
) {
    wait_applied_while(conn, prefix, group, topic, hwms, timeout, || {});
}

/// `wait_applied`, calling `check` on every poll (e.g. to fail fast when a consumer died).
pub fn wait_applied_while(
    conn: &mut redis::Connection,
    prefix: &str,
    group: &str,
    topic: &str,
    hwms: &[i64],
    timeout: Duration,
    mut check: impl FnMut(),
) {
    let start = Instant::now();
    let mut last_report = Instant::now();
    loop {
        let fences = read_fences(conn, prefix, group, topic, hwms.len());
        let mut behind = Vec::new();
        for (p, (&hwm, fence)) in hwms.iter().zip(&fences).enumerate() {
            if hwm == 0 {
                continue;
            }
            let want = hwm - 1;
            match fence {
                Some(f) if *f == want => {}
                Some(f) if *f > want => panic!(
                    "fence of partition {p} is {f}, beyond the last offset {want} (hwm {hwm})"
                ),
                other => behind.push((p, want, *other)),
            }
        }
        if behind.is_empty() {
            eprintln!(
                "[harness] all {} partitions applied after {:.1} s",
                hwms.len(),
                start.elapsed().as_secs_f64()
            );
            return;
        }
        let describe = |behind: &[(usize, i64, Option<i64>)]| {
            behind
                .iter()
                .map(|(p, want, got)| match got {
                    Some(g) => format!("p{p}: fence {g} / last {want} (lag {})", want - g),
                    None => format!("p{p}: no fence / last {want}"),
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        check();
        if start.elapsed() > timeout {
            panic!(
                "not applied within {timeout:?}; {} partitions behind: {}",
                behind.len(),
                describe(&behind)
            );
        }
        if last_report.elapsed() > Duration::from_secs(5) {
            eprintln!("[harness] waiting for fences: {}", describe(&behind));
            last_report = Instant::now();
        }
        thread::sleep(Duration::from_millis(200));
    }
}
