//! Bench memory: `tally-lab bench-memory`, what a counter costs Redis in
//! memory and in CPU per write, kept as a string key of its own (the default
//! layout) or as a field of a small hash (the packed layout, see
//! [`tally::domain::packing`]), for random 64-bit post ids.
//!
//! For each server (redis-server, and `--valkey-server` when given) and each
//! case (strings; packed at each `--fields`), it starts a fresh server,
//! writes `--counters` counters of value 1 through the library's key layout
//! (`SET` per string key, `HSET` per field, pipelined), and measures:
//!
//! * memory: `used_memory` after the writes minus `used_memory` before them,
//!   over the counters (the writing connection closed first, so its buffers
//!   are not counted, and any rehashing the server reports waited out);
//! * whether the hashes stayed listpacks: `OBJECT ENCODING` of 20 of them;
//! * CPU: `used_cpu_user + used_cpu_sys` of the server over `--calls` calls of
//!   the script `tally run` sends for that layout (the very `EVALSHA` of
//!   [`script_call`]), each adding 1 to `--keys` distinct counters drawn at
//!   random from those written, per counter written, after one warm-up call.
//!
//! Invariant: every case runs on a fresh server of its own, stopped before the
//! next starts, so no case's memory or caches count in another's; memory is
//! `used_memory` after minus before, over the counters.
//!
//! A packed case first sets `hash-max-listpack-entries` to the larger of 128
//! (what redis.conf ships) and what its packing needs
//! ([`Packed::entries_needed`]); `hash-max-listpack-value` stays at the
//! server's default.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use tally::domain::packing::{MAX_PACKED_FIELDS, Packed, Packing};
use tally::domain::routing::{CounterId, KeyLayout};
use tally::pipeline::apply::script_text;

use crate::bench::services::RedisSnapshot;
use crate::local::{Service, start_redis, start_store};
use crate::markdown::{command_line, header, publish, ratio, thousands, today_utc};
use crate::script_call::apply_once;

/// Settings of `tally-lab bench-memory`.
#[derive(Debug, Clone, Args)]
pub struct BenchMemoryConfig {
    /// Counters written in each case, each a random 64-bit post id (bucket 0) set to 1.
    #[arg(long, default_value_t = 10_000_000)]
    pub counters: u64,

    /// Fields per hash of the packed cases, a comma list: one case each.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128")]
    pub fields: Vec<u32>,

    /// Counters per script call (the default batch limit of `tally run`).
    #[arg(long, default_value_t = tally::infra::config::DEFAULT_BATCH_MAX_KEYS as u64)]
    pub keys: u64,

    /// Script calls per CPU measurement, after one warm-up call.
    #[arg(long, default_value_t = 40)]
    pub calls: u64,

    /// A valkey-server binary to repeat every case on, after redis-server.
    #[arg(long, value_name = "PATH")]
    pub valkey_server: Option<PathBuf>,

    /// Also write the tables into this Markdown file, between its `memory:begin`/`memory:end` markers.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

impl BenchMemoryConfig {
    fn validate(&self) -> Result<()> {
        if self.counters == 0 || self.keys == 0 || self.calls == 0 {
            bail!("--counters, --keys and --calls must be at least 1");
        }
        if self.counters < self.keys {
            bail!("--counters must be at least --keys");
        }
        if let Some(&bad) = self
            .fields
            .iter()
            .find(|&&f| f == 0 || f > MAX_PACKED_FIELDS)
        {
            bail!("--fields {bad}: fields per hash must be 1 to {MAX_PACKED_FIELDS}");
        }
        if let Some(path) = &self.valkey_server
            && !path.is_file()
        {
            bail!("--valkey-server {}: no such file", path.display());
        }
        Ok(())
    }
}

const BEGIN: &str = "<!-- memory:begin (written by `tally-lab bench-memory --out`) -->";
const END: &str = "<!-- memory:end -->";

/// The key prefix of the counters.
const PREFIX: &str = "mem";

/// Writes per pipeline while filling a server.
const CHUNK: usize = 10_000;

/// Hashes whose encoding is read after the writes.
const SAMPLED_HASHES: usize = 20;

/// The `hash-max-listpack-entries` redis.conf ships, below which a packed case never goes.
const SHIPPED_LISTPACK_ENTRIES: u64 = 128;

/// How much more CPU per write than strings the verdict accepts.
const CPU_ALLOWANCE: f64 = 2.5;

/// Seed of the post ids.
const POSTS_SEED: u64 = 42;

/// Seed of the counters the script calls name: the same draws in every case.
const CALLS_SEED: u64 = 7;

/// How a case keeps its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    /// A string key per counter.
    Strings,
    /// Fields of hashes, this many per hash.
    Packed(u32),
}

impl Case {
    /// The key layout of the case, its hashes sized for `counters`.
    fn layout(self, counters: u64) -> KeyLayout {
        let layout = KeyLayout::new(PREFIX);
        match self {
            Case::Strings => layout,
            Case::Packed(fields) => {
                layout.with_packing(Packing::Packed(Packed::sized(counters, fields, 1)))
            }
        }
    }

    fn label(self) -> String {
        match self {
            Case::Strings => "strings".into(),
            Case::Packed(fields) => format!("{fields} fields"),
        }
    }
}

/// What one case measured.
#[derive(Debug, Clone)]
struct Measured {
    case: Case,
    /// Hashes of the packed layout.
    hashes: Option<u32>,
    /// `hash-max-listpack-entries` as the server started and as the case set it.
    entries: Option<(u64, u64)>,
    /// `used_memory` after minus before, over the counters.
    bytes_per_counter: f64,
    /// Server CPU µs per counter the script calls wrote.
    cpu_us: f64,
    /// Of the hashes sampled, (listpack, sampled).
    listpack: Option<(usize, usize)>,
    /// `used_memory_peak` after the writes.
    peak: u64,
}

/// One server's cases.
struct ServerRun {
    /// "redis-server 7.0.15".
    name: String,
    /// The server's `hash-max-listpack-value`.
    listpack_value: String,
    cases: Vec<Measured>,
}

/// A server binary to run every case on.
pub(crate) struct Server {
    /// `redis-server` or `valkey-server`.
    pub(crate) name: &'static str,
    /// The binary; `None` for the redis-server on PATH.
    pub(crate) program: Option<PathBuf>,
}

/// The redis-server on PATH, then `valkey` when given.
pub(crate) fn servers(valkey: Option<&PathBuf>) -> Result<Vec<Server>> {
    let mut servers = vec![Server {
        name: "redis-server",
        program: None,
    }];
    if let Some(path) = valkey {
        if !path.is_file() {
            bail!("--valkey-server {}: no such file", path.display());
        }
        servers.push(Server {
            name: "valkey-server",
            program: Some(path.clone()),
        });
    }
    Ok(servers)
}

impl Server {
    pub(crate) fn start(&self, dir: &Path) -> Result<(Service, String)> {
        match &self.program {
            None => start_redis(dir),
            Some(program) => start_store(program, dir),
        }
    }
}

/// Runs `tally-lab bench-memory`.
pub async fn bench_memory(config: BenchMemoryConfig) -> Result<()> {
    config.validate()?;
    tokio::task::spawn_blocking(move || bench_blocking(&config))
        .await
        .context("the benchmark thread failed")?
}

fn bench_blocking(config: &BenchMemoryConfig) -> Result<()> {
    let mut rng = SmallRng::seed_from_u64(POSTS_SEED);
    let posts: Vec<u64> = (0..config.counters).map(|_| rng.random()).collect();
    let servers = servers(config.valkey_server.as_ref())?;
    let cases: Vec<Case> = std::iter::once(Case::Strings)
        .chain(config.fields.iter().map(|&f| Case::Packed(f)))
        .collect();
    let mut runs = Vec::with_capacity(servers.len());
    for server in &servers {
        let mut run = ServerRun {
            name: server.name.into(),
            listpack_value: "?".into(),
            cases: Vec::with_capacity(cases.len()),
        };
        for &case in &cases {
            let (measured, name, listpack_value) = measure(server, case, config, &posts)?;
            eprintln!(
                "bench-memory: {name}, {}: {:.1} bytes and {:.2} CPU µs per counter, used_memory_peak {}",
                case.label(),
                measured.bytes_per_counter,
                measured.cpu_us,
                mib(measured.peak)
            );
            run.name = name;
            run.listpack_value = listpack_value;
            run.cases.push(measured);
        }
        runs.push(run);
    }
    let report = render(config, &runs)?;
    publish("bench-memory", &report, config.out.as_deref(), BEGIN, END)?;
    Ok(())
}

/// One case on a fresh server; returns what it measured, the server's name and version, and
/// its `hash-max-listpack-value`.
fn measure(
    server: &Server,
    case: Case,
    config: &BenchMemoryConfig,
    posts: &[u64],
) -> Result<(Measured, String, String)> {
    let dir = tempfile::Builder::new()
        .prefix("tally-bench-memory")
        .tempdir()
        .context("creating a scratch directory")?;
    eprintln!(
        "bench-memory: starting {} for {}",
        server.name,
        case.label()
    );
    // Dropped at the end of this function, before the next case's server starts.
    let (_service, url) = server.start(dir.path())?;
    let client = redis::Client::open(url.as_str())?;
    let mut conn = client
        .get_connection()
        .with_context(|| format!("connecting to {url}"))?;
    let info: String = redis::cmd("INFO").arg("server").query(&mut conn)?;
    let name = server_name(server.name, &info);
    let listpack_value = config_get(&mut conn, "hash-max-listpack-value")?;
    let layout = case.layout(config.counters);
    let packed = layout.packing().packed().copied();
    let entries = match packed {
        None => None,
        Some(packed) => {
            let before: u64 = config_get(&mut conn, "hash-max-listpack-entries")?
                .parse()
                .context("reading hash-max-listpack-entries")?;
            let wanted = packed.entries_needed().max(SHIPPED_LISTPACK_ENTRIES);
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("hash-max-listpack-entries")
                .arg(wanted)
                .query::<()>(&mut conn)
                .context("setting hash-max-listpack-entries")?;
            Some((before, wanted))
        }
    };
    let before = used_memory(&settled_memory(&mut conn)?, "used_memory")?;

    // The writes, on a connection of their own, closed before memory is read again.
    {
        let mut writer = client
            .get_connection()
            .with_context(|| format!("connecting to {url}"))?;
        let total = posts.len() as u64;
        let mut shown = 0;
        for (i, chunk) in posts.chunks(CHUNK).enumerate() {
            let mut pipe = redis::pipe();
            for &post in chunk {
                let place = layout.place_of(CounterId::v0(post, 0));
                match &place.field {
                    None => pipe.cmd("SET").arg(&place.key).arg(1).ignore(),
                    Some(field) => pipe.cmd("HSET").arg(&place.key).arg(field).arg(1).ignore(),
                };
            }
            pipe.query::<()>(&mut writer)
                .with_context(|| format!("writing counters to {}", server.name))?;
            let written = ((i * CHUNK + chunk.len()) as u64).min(total);
            let tenth = written * 10 / total;
            if tenth > shown {
                shown = tenth;
                eprintln!(
                    "bench-memory: {}, {}: {} of {} counters written",
                    server.name,
                    case.label(),
                    thousands(written),
                    thousands(total)
                );
            }
        }
    }
    // Let the server free the writer's client and its buffers.
    std::thread::sleep(Duration::from_millis(500));
    let memory = settled_memory(&mut conn)?;
    let after = used_memory(&memory, "used_memory")?;
    let peak = used_memory(&memory, "used_memory_peak")?;
    let bytes_per_counter = (after as f64 - before as f64) / posts.len() as f64;

    let listpack = match packed {
        None => None,
        Some(_) => Some(sample_encodings(&mut conn, &layout, posts)?),
    };

    // CPU per counter written by the script `tally run` sends.
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script_text(&layout))
        .query(&mut conn)
        .context("loading the apply script")?;
    let mut rng = SmallRng::seed_from_u64(CALLS_SEED);
    let mut call = |conn: &mut redis::Connection, n: u64| -> Result<u64> {
        let drawn = rand::seq::index::sample(&mut rng, posts.len(), config.keys as usize);
        let deltas: Vec<_> = drawn
            .iter()
            .map(|i| (CounterId::v0(posts[i], 0), 1))
            .collect();
        let counters = deltas.len() as u64;
        let fence = format!("{PREFIX}:fence:{n}");
        apply_once(conn, &sha, &layout, &fence, deltas, Vec::new())?;
        Ok(counters)
    };
    call(&mut conn, 0)?;
    let cpu_before = RedisSnapshot::take(&mut conn)?;
    let mut written = 0;
    for n in 1..=config.calls {
        written += call(&mut conn, n)?;
    }
    let cpu_after = RedisSnapshot::take(&mut conn)?;
    let cpu_us = (cpu_after.cpu_secs - cpu_before.cpu_secs) * 1e6 / written.max(1) as f64;

    let measured = Measured {
        case,
        hashes: packed.map(|p| p.hashes),
        entries,
        bytes_per_counter,
        cpu_us,
        listpack,
        peak,
    };
    Ok((measured, name, listpack_value))
}

/// Of up to [`SAMPLED_HASHES`] distinct hashes holding counters of `posts`, how many are
/// listpacks: (listpack, sampled).
fn sample_encodings(
    conn: &mut redis::Connection,
    layout: &KeyLayout,
    posts: &[u64],
) -> Result<(usize, usize)> {
    let mut rng = SmallRng::seed_from_u64(CALLS_SEED + 1);
    let mut keys: Vec<String> = Vec::with_capacity(SAMPLED_HASHES);
    for _ in 0..SAMPLED_HASHES * 20 {
        if keys.len() == SAMPLED_HASHES {
            break;
        }
        let post = posts[rng.random_range(0..posts.len())];
        let key = layout.key_of(CounterId::v0(post, 0));
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    let mut listpack = 0;
    for key in &keys {
        let encoding: String = redis::cmd("OBJECT")
            .arg("ENCODING")
            .arg(key)
            .query(conn)
            .with_context(|| format!("reading the encoding of {key}"))?;
        if encoding == "listpack" {
            listpack += 1;
        }
    }
    Ok((listpack, keys.len()))
}

/// `CONFIG GET name`'s value.
pub(crate) fn config_get(conn: &mut redis::Connection, name: &str) -> Result<String> {
    let reply: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query(conn)
        .with_context(|| format!("reading {name}"))?;
    reply
        .get(1)
        .cloned()
        .with_context(|| format!("the server has no {name}"))
}

/// `INFO memory` once the server reports no rehashing of its keyspace (servers that report
/// it: `mem_overhead_db_hashtable_rehashing`), waiting up to 60 s: a table being rehashed
/// holds its old and new arrays at once.
pub(crate) fn settled_memory(conn: &mut redis::Connection) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let memory: String = redis::cmd("INFO")
            .arg("memory")
            .query(conn)
            .context("reading INFO memory")?;
        let rehashing = info_field(&memory, "mem_overhead_db_hashtable_rehashing")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        if rehashing == 0 || Instant::now() > deadline {
            return Ok(memory);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of `name` in INFO text (`name:value` lines).
pub(crate) fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        line.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

/// A byte count of INFO memory, `used_memory` or `used_memory_peak`.
pub(crate) fn used_memory(info: &str, name: &str) -> Result<u64> {
    info_field(info, name)
        .with_context(|| format!("INFO memory has no {name}"))?
        .parse()
        .with_context(|| format!("INFO memory's {name} is not a byte count"))
}

/// "redis-server 7.0.15", or "valkey-server 9.1.2 (redis_version 7.2.4)".
pub(crate) fn server_name(binary: &str, info: &str) -> String {
    let redis = info_field(info, "redis_version").unwrap_or("?");
    match info_field(info, "valkey_version") {
        Some(valkey) => format!("{binary} {valkey} (redis_version {redis})"),
        None => format!("{binary} {redis}"),
    }
}

/// Bytes as MiB, "12.3 MiB".
pub(crate) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The last line of a server's table: the packed case cheapest in memory among those within
/// [`CPU_ALLOWANCE`] times the CPU of strings.
fn verdict(cases: &[Measured]) -> String {
    let Some(strings) = cases.iter().find(|m| m.case == Case::Strings) else {
        return "No strings case to compare with.".into();
    };
    let best = cases
        .iter()
        .filter_map(|m| match m.case {
            Case::Packed(fields) if m.cpu_us <= CPU_ALLOWANCE * strings.cpu_us => Some((fields, m)),
            _ => None,
        })
        .min_by(|a, b| a.1.bytes_per_counter.total_cmp(&b.1.bytes_per_counter));
    match best {
        Some((fields, m)) => format!(
            "Cheapest in memory within {CPU_ALLOWANCE}× the CPU of strings: **{fields} fields per hash**, \
             {:.1} bytes per counter ({} strings) at {} the CPU per write of strings.",
            m.bytes_per_counter,
            ratio(m.bytes_per_counter, strings.bytes_per_counter),
            ratio(m.cpu_us, strings.cpu_us)
        ),
        None => format!("No packed case stays within {CPU_ALLOWANCE}× the CPU of strings."),
    }
}

fn render(config: &BenchMemoryConfig, runs: &[ServerRun]) -> Result<String> {
    let mut out = String::new();
    header(&mut out, &command_line())?;
    writeln!(
        out,
        "Date: {}. {} counters, each a random 64-bit post id set to 1 through the layout \
         (`SET`, or `HSET` of its field), on a fresh server (no persistence) per case; bytes per \
         counter: `used_memory` after the writes minus before, over the counters. CPU: \
         `used_cpu_user + used_cpu_sys` of the server over {} calls of the script `tally run` \
         sends for the layout, each adding 1 to {} distinct counters drawn at random, after one \
         warm-up call.\n",
        today_utc(),
        thousands(config.counters),
        config.calls,
        thousands(config.keys),
    )?;
    for run in runs {
        writeln!(out, "{}:\n", run.name)?;
        writeln!(
            out,
            "| layout | fields per hash | hashes | bytes per counter | × strings | \
             Redis CPU µs per counter write | × strings | hashes still listpack (of {SAMPLED_HASHES} sampled) |"
        )?;
        writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
        let strings = run.cases.iter().find(|m| m.case == Case::Strings);
        for m in &run.cases {
            let (layout, fields) = match m.case {
                Case::Strings => ("strings", "–".to_string()),
                Case::Packed(fields) => ("packed", fields.to_string()),
            };
            let hashes = m
                .hashes
                .map_or_else(|| "–".into(), |h| thousands(u64::from(h)));
            let listpack = m
                .listpack
                .map_or_else(|| "–".into(), |(l, n)| format!("{l} of {n}"));
            let (memory_ratio, cpu_ratio) = strings.map_or_else(
                || ("–".into(), "–".into()),
                |s| {
                    (
                        ratio(m.bytes_per_counter, s.bytes_per_counter),
                        ratio(m.cpu_us, s.cpu_us),
                    )
                },
            );
            writeln!(
                out,
                "| {layout} | {fields} | {hashes} | {:.1} | {memory_ratio} | {:.2} | {cpu_ratio} | {listpack} |",
                m.bytes_per_counter, m.cpu_us
            )?;
        }
        let set: Vec<String> = run
            .cases
            .iter()
            .filter_map(|m| match (m.case, m.entries) {
                (Case::Packed(fields), Some((_, set))) => Some(format!("{set} for {fields}")),
                _ => None,
            })
            .collect();
        if let Some((default, _)) = run.cases.iter().find_map(|m| m.entries) {
            writeln!(
                out,
                "\n`hash-max-listpack-entries` set per packed case to the larger of {SHIPPED_LISTPACK_ENTRIES} \
                 and what its packing needs: {} fields per hash (the server started with {default}); \
                 `hash-max-listpack-value` left at the server's {}.",
                set.join(", "),
                run.listpack_value
            )?;
        }
        let peaks: Vec<String> = run
            .cases
            .iter()
            .map(|m| format!("{} {}", m.case.label(), mib(m.peak)))
            .collect();
        writeln!(out, "`used_memory_peak`: {}.", peaks.join(", "))?;
        writeln!(out, "\n{}\n", verdict(&run.cases))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(case: Case, bytes: f64, cpu: f64) -> Measured {
        Measured {
            case,
            hashes: None,
            entries: None,
            bytes_per_counter: bytes,
            cpu_us: cpu,
            listpack: None,
            peak: 0,
        }
    }

    #[test]
    fn info_fields_are_read_by_their_whole_name() {
        let info = "# Memory\r\nused_memory:1016136\r\nused_memory_human:992.32K\r\n\
                    used_memory_peak:1040696\r\n";
        assert_eq!(used_memory(info, "used_memory").unwrap(), 1_016_136);
        assert_eq!(used_memory(info, "used_memory_peak").unwrap(), 1_040_696);
        assert!(used_memory(info, "used_memory_rss").is_err());
        assert!(used_memory("used_memory:lots\r\n", "used_memory").is_err());
        let server = "redis_version:7.2.4\r\nvalkey_version:9.1.2\r\n";
        assert_eq!(
            server_name("valkey-server", server),
            "valkey-server 9.1.2 (redis_version 7.2.4)"
        );
        assert_eq!(
            server_name("redis-server", "redis_version:7.0.15\r\n"),
            "redis-server 7.0.15"
        );
    }

    #[test]
    fn the_verdict_takes_the_smallest_within_the_cpu_allowance() {
        let cases = [
            case(Case::Strings, 70.0, 0.40),
            case(Case::Packed(16), 30.0, 0.50),
            case(Case::Packed(64), 20.0, 0.90),
            // Smallest, but past 2.5× the CPU of strings.
            case(Case::Packed(128), 18.0, 1.20),
        ];
        let line = verdict(&cases);
        assert!(line.contains("**64 fields per hash**"), "{line}");
        assert!(line.contains("20.0 bytes"), "{line}");
        assert!(line.contains("0.29×"), "{line}");
        assert!(line.contains("2.25×"), "{line}");
        let line = verdict(&[case(Case::Strings, 70.0, 0.4), cases[3].clone()]);
        assert!(line.starts_with("No packed case"), "{line}");
    }

    #[test]
    fn fields_are_checked() {
        let mut config = BenchMemoryConfig {
            counters: 1000,
            fields: vec![16, 64],
            keys: 100,
            calls: 1,
            valkey_server: None,
            out: None,
        };
        assert!(config.validate().is_ok());
        config.fields = vec![0];
        assert!(config.validate().is_err());
        config.fields = vec![MAX_PACKED_FIELDS + 1];
        assert!(config.validate().is_err());
    }
}
