//! Bench growth: `tally-lab bench-growth`, a prefix grown from nothing to
//! `--counters` counters with random 64-bit post ids, through the script
//! `tally run` sends (the library's [`script_call`]), as string keys, as
//! packed hashes that split as they fill (the default packed layout, see
//! [`tally::domain::packing`]) and as a fixed number of packed hashes sized
//! for the final count (what the splits cost is the difference), with every
//! server setting at its default.
//!
//! At 100,000 counters and at each tenfold step after it (and at the end),
//! each case reports:
//!
//! * bytes per counter: `used_memory` minus `used_memory` before the first
//!   write, over the counters written (the keyspace's rehashing waited out);
//! * Redis CPU µs per counter created over the step (`used_cpu_user +
//!   used_cpu_sys`), and over strings in the same run;
//! * the slowlog at 5 ms: scripts slower than 5 ms since the start, and the
//!   longest (read and emptied as it goes, before memory is read: its entries
//!   hold the calls' arguments);
//! * for the packed cases: their hashes, the fullest, and how many are not
//!   listpacks (every hash read with `HLEN` and `OBJECT ENCODING`).
//!
//! At the end of each case, `--reads` posts are read back through the
//! library's reader (what `tally count` and `tally serve` read with, cache
//! off): posts a second and Redis CPU µs a post read, beside strings and the
//! fixed hashes; every post must read the like it was given.
//!
//! Invariant: each case runs on a fresh server of its own with the same post
//! ids in the same calls, one call after another on one connection, each
//! call's offsets right after the last, so every call applies; the packed
//! calls are addressed with the split state the previous reply carried, as
//! `tally run` addresses them.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use tally::domain::packing::{
    DEFAULT_GROWING_FIELDS, DEFAULT_PACKED_FIELDS, Growing, Packed, Packing, Splits,
};
use tally::domain::routing::{CounterId, KeyLayout};
use tally::pipeline::apply::{Prepared, ScriptBody, script_call, script_text};

use crate::bench::services::RedisSnapshot;
use crate::bench_memory::{Server, config_get, server_name, servers, settled_memory, used_memory};
use crate::markdown::{command_line, header, publish, ratio, thousands, today_utc};

/// Settings of `tally-lab bench-growth`.
#[derive(Debug, Clone, Args)]
pub struct BenchGrowthConfig {
    /// Counters each case grows to, each a random 64-bit post id (bucket 0) added to once.
    #[arg(long, default_value_t = 30_000_000)]
    pub counters: u64,

    /// Counters per script call: a call of this many new counters takes Redis about 2 ms as
    /// strings and 3 ms in a fixed number of hashes, so the slowlog at 5 ms shows what splits
    /// add to it.
    #[arg(long, default_value_t = 500)]
    pub keys: u64,

    /// Fields per hash, on average, of the packed case (`tally run --packed-fields`).
    #[arg(long, default_value_t = DEFAULT_GROWING_FIELDS)]
    pub fields: u32,

    /// Posts read at the end of each case through the library's reader (what `tally count`
    /// and `tally serve` read with, its cache off), one post a read from 32 tasks; 0: none.
    #[arg(long, default_value_t = 200_000)]
    pub reads: u64,

    /// A valkey-server binary to repeat every case on, after redis-server.
    #[arg(long, value_name = "PATH")]
    pub valkey_server: Option<PathBuf>,

    /// Also write the tables into this Markdown file, between its `growth:begin`/`growth:end` markers.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

const BEGIN: &str = "<!-- growth:begin (written by `tally-lab bench-growth --out`) -->";
const END: &str = "<!-- growth:end -->";

/// The key prefix of the counters.
const PREFIX: &str = "grow";

/// The first step reported; each next one is ten times larger.
const FIRST_STEP: u64 = 100_000;

/// Scripts slower than this are counted (the slowlog's threshold, µs).
const SLOW_US: u64 = 5_000;

/// Entries the slowlog keeps; it is read and emptied every [`SLOWLOG_EVERY`] calls, so none
/// is lost.
const SLOWLOG_LEN: u64 = 1024;
const SLOWLOG_EVERY: u64 = 500;

/// Seed of the post ids: the same in every case.
const POSTS_SEED: u64 = 4242;

/// How a case keeps its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    Strings,
    /// Hashes that split as they fill.
    Growing,
    /// A fixed number of hashes, sized for the final count at 64 fields a hash.
    Fixed,
}

impl Case {
    const ALL: [Case; 3] = [Case::Strings, Case::Growing, Case::Fixed];

    fn label(self) -> &'static str {
        match self {
            Case::Strings => "strings",
            Case::Growing => "packed, growing",
            Case::Fixed => "packed, fixed",
        }
    }

    fn layout(self, config: &BenchGrowthConfig, prefix: &str) -> KeyLayout {
        let layout = KeyLayout::new(prefix);
        match self {
            Case::Strings => layout,
            Case::Growing => layout.with_packing(Packing::Growing(Growing {
                fields: config.fields,
            })),
            Case::Fixed => layout.with_packing(Packing::Packed(Packed::sized(
                config.counters,
                DEFAULT_PACKED_FIELDS,
                1,
            ))),
        }
    }
}

/// One step of one case.
#[derive(Debug, Clone, Default)]
struct Step {
    counters: u64,
    bytes_per_counter: f64,
    /// Server CPU µs per counter created since the step before.
    cpu_us: f64,
    /// Scripts slower than [`SLOW_US`] so far, and the longest, µs.
    slow: (u64, u64),
    /// Packed: the hashes.
    hashes: Option<Survey>,
}

/// What a packed case's hashes are.
#[derive(Debug, Clone, Copy, Default)]
struct Survey {
    hashes: u64,
    /// The most fields of one.
    fullest: u64,
    /// Hashes that are not listpacks.
    not_listpack: u64,
    /// Their bytes, as `MEMORY USAGE` counts them.
    bytes: u64,
}

struct CaseRun {
    case: Case,
    steps: Vec<Step>,
    reads: Option<Reads>,
}

/// The reads at the end of a case.
#[derive(Debug, Clone, Copy)]
struct Reads {
    posts: u64,
    per_sec: f64,
    /// Server CPU µs per post read.
    cpu_us: f64,
}

struct ServerRun {
    name: String,
    entries: String,
    cases: Vec<CaseRun>,
}

/// Runs `tally-lab bench-growth`.
pub async fn bench_growth(config: BenchGrowthConfig) -> Result<()> {
    if config.counters < FIRST_STEP || config.keys == 0 || config.fields == 0 {
        bail!(
            "--counters must be at least {}, --keys and --fields at least 1",
            thousands(FIRST_STEP)
        );
    }
    tokio::task::spawn_blocking(move || grow_all(&config))
        .await
        .context("the benchmark thread failed")?
}

fn grow_all(config: &BenchGrowthConfig) -> Result<()> {
    let mut runs = Vec::new();
    for server in servers(config.valkey_server.as_ref())? {
        let mut run = ServerRun {
            name: server.name.into(),
            entries: "?".into(),
            cases: Vec::new(),
        };
        for case in Case::ALL {
            let (steps, reads, name, entries) = grow(&server, case, config)?;
            run.name = name;
            run.entries = entries;
            run.cases.push(CaseRun { case, steps, reads });
        }
        runs.push(run);
    }
    let report = render(config, &runs)?;
    publish("bench-growth", &report, config.out.as_deref(), BEGIN, END)
}

/// The counters at which a case is measured: tenfold steps from [`FIRST_STEP`], and the end.
fn steps(counters: u64) -> Vec<u64> {
    let mut at: Vec<u64> = std::iter::successors(Some(FIRST_STEP), |s| s.checked_mul(10))
        .take_while(|&s| s < counters)
        .collect();
    at.push(counters);
    at
}

/// Grows one case on a fresh server; returns its steps, its reads, the server's name and its
/// `hash-max-listpack-entries`.
fn grow(
    server: &Server,
    case: Case,
    config: &BenchGrowthConfig,
) -> Result<(Vec<Step>, Option<Reads>, String, String)> {
    let dir = tempfile::Builder::new()
        .prefix("tally-bench-growth")
        .tempdir()
        .context("creating a scratch directory")?;
    eprintln!(
        "bench-growth: starting {} for {}",
        server.name,
        case.label()
    );
    let (_service, url) = server.start(dir.path())?;
    let mut conn = redis::Client::open(url.as_str())?
        .get_connection()
        .with_context(|| format!("connecting to {url}"))?;
    let info: String = redis::cmd("INFO").arg("server").query(&mut conn)?;
    let name = server_name(server.name, &info);
    let entries = config_get(&mut conn, "hash-max-listpack-entries")?;
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(SLOW_US)
        .arg("slowlog-max-len")
        .arg(SLOWLOG_LEN)
        .query::<()>(&mut conn)
        .context("setting the slowlog")?;
    let layout = case.layout(config, PREFIX);
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script_text(&layout))
        .query(&mut conn)
        .context("loading the apply script")?;
    let fence = layout.fence_key("bench", "likes", 0, 0);
    // One call under another prefix first, so that what the server keeps for any script call
    // (the buffers of the client scripts run as) is in place before memory is first read.
    let warm = case.layout(config, "warm");
    let mut warm_rng = SmallRng::seed_from_u64(!POSTS_SEED);
    let warm_call = calls_of(&mut warm_rng, 0, config.keys);
    apply(
        &mut writer(&url)?,
        &sha,
        &warm,
        &warm.fence_key("bench", "likes", 0, 0),
        &warm_call,
        Splits::default(),
    )?;
    let before = used_memory(&settled_memory(&mut conn)?, "used_memory")?;
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn)?;
    let mut rng = SmallRng::seed_from_u64(POSTS_SEED);
    let mut splits = Splits::default();
    let mut written = 0u64;
    let mut offset = 0i64;
    let mut cpu = RedisSnapshot::take(&mut conn)?.cpu_secs;
    let mut last_step = 0u64;
    let (mut calls, mut slow) = (0u64, (0u64, 0u64));
    // Every `stride`-th post of each call is kept for the reads.
    let stride = (config.counters / SAMPLED_POSTS).max(1) as usize;
    let mut sample: Vec<u64> = Vec::new();
    let started = Instant::now();
    let mut measured = Vec::new();
    for step in steps(config.counters) {
        // The writes on a connection of their own, closed before memory is read: its buffers
        // are not the counters'.
        let mut writes = writer(&url)?;
        while written < step {
            let n = config.keys.min(step - written);
            let prepared = calls_of(&mut rng, offset, n);
            sample.extend(
                prepared
                    .deltas
                    .iter()
                    .step_by(stride)
                    .map(|(id, _)| id.post_id),
            );
            splits = apply(&mut writes, &sha, &layout, &fence, &prepared, splits)?;
            offset += n as i64;
            written += n;
            calls += 1;
            if calls % SLOWLOG_EVERY == 0 {
                drain_slowlog(&mut conn, &mut slow)?;
            }
        }
        drop(writes);
        // The slowlog's entries hold the calls' arguments: emptied before memory is read.
        drain_slowlog(&mut conn, &mut slow)?;
        let now = RedisSnapshot::take(&mut conn)?.cpu_secs;
        let cpu_us = (now - cpu) * 1e6 / (written - last_step) as f64;
        cpu = now;
        last_step = written;
        let info = settled_memory(&mut conn)?;
        let after = used_memory(&info, "used_memory")?;
        let hashes = match case {
            Case::Strings => None,
            Case::Growing | Case::Fixed => Some(hash_survey(&mut conn)?),
        };
        let row = Step {
            counters: written,
            bytes_per_counter: (after as f64 - before as f64) / written as f64,
            cpu_us,
            slow,
            hashes,
        };
        eprintln!(
            "bench-growth: {name}, {}: {} counters, {:.1} bytes and {:.2} CPU µs a counter, {} scripts over 5 ms ({:.0} s)",
            case.label(),
            thousands(written),
            row.bytes_per_counter,
            row.cpu_us,
            row.slow.0,
            started.elapsed().as_secs_f64()
        );
        measured.push(row);
    }
    let reads = match config.reads {
        0 => None,
        n => Some(read_back(&url, &layout, &sample, n, &mut conn)?),
    };
    if let Some(reads) = reads {
        eprintln!(
            "bench-growth: {name}, {}: {} posts read, {:.0} a second, {:.2} CPU µs a post",
            case.label(),
            thousands(reads.posts),
            reads.per_sec,
            reads.cpu_us
        );
    }
    Ok((measured, reads, name, entries))
}

/// Posts kept of a case's writes for its reads.
const SAMPLED_POSTS: u64 = 100_000;
/// Tasks reading at once.
const READERS: usize = 32;

/// Reads `reads` posts of `posts` through the library's reader, cache off, one post a read
/// from [`READERS`] tasks; every post must read 1 (each was added to once).
fn read_back(
    url: &str,
    layout: &KeyLayout,
    posts: &[u64],
    reads: u64,
    conn: &mut redis::Connection,
) -> Result<Reads> {
    let url = tally::infra::store::RedisUrl::parse(url)?;
    let runtime = tokio::runtime::Handle::current();
    let store = runtime.block_on(tally::infra::store::Shared::open(&url))?;
    let reader = tally::read::Reader::new(store, layout.clone(), 1, std::time::Duration::ZERO);
    let cpu = RedisSnapshot::take(conn)?.cpu_secs;
    let started = Instant::now();
    let per_task = reads.div_ceil(READERS as u64);
    let tasks: Vec<_> = (0..READERS)
        .map(|t| {
            let reader = reader.clone();
            let posts: std::sync::Arc<[u64]> = posts.into();
            runtime.spawn(async move {
                for i in 0..per_task {
                    let post =
                        posts[((i * READERS as u64 + t as u64) * 7_919) as usize % posts.len()];
                    let count = reader.count(post).await?;
                    if count.likes < 1 {
                        bail!(
                            "post {post} reads {}, not the like it was given",
                            count.likes
                        );
                    }
                }
                Ok(())
            })
        })
        .collect();
    for task in tasks {
        runtime.block_on(task).context("a reading task failed")??;
    }
    let secs = started.elapsed().as_secs_f64();
    let done = per_task * READERS as u64;
    Ok(Reads {
        posts: done,
        per_sec: done as f64 / secs,
        cpu_us: (RedisSnapshot::take(conn)?.cpu_secs - cpu) * 1e6 / done as f64,
    })
}

/// A connection for a step's writes.
fn writer(url: &str) -> Result<redis::Connection> {
    redis::Client::open(url)?
        .get_connection()
        .with_context(|| format!("connecting to {url}"))
}

/// A call of `n` new counters, each a random post id added to once, at the offsets after
/// `offset`.
fn calls_of(rng: &mut SmallRng, offset: i64, n: u64) -> Prepared {
    Prepared {
        partition: 0,
        group: 0,
        start: offset + 1,
        last: offset + n as i64,
        absent_fence: 0,
        deltas: (0..n)
            .map(|_| (CounterId::v0(rng.random(), 0), 1))
            .collect(),
        windows: Vec::new(),
    }
}

/// One call, addressed with `splits`; again with the state a refusal carries, until it
/// applies. Returns the split state the reply carried.
fn apply(
    conn: &mut redis::Connection,
    sha: &str,
    layout: &KeyLayout,
    fence: &str,
    prepared: &Prepared,
    mut splits: Splits,
) -> Result<Splits> {
    loop {
        let reply: Vec<redis::Value> =
            script_call(ScriptBody::ByHash(sha), layout, fence, prepared, splits)
                .query(conn)
                .context("calling the apply script")?;
        let state = |i: usize| -> Result<u32> { Ok(redis::from_redis_value_ref(&reply[i])?) };
        match reply.first() {
            Some(redis::Value::Int(code @ (0 | 5))) => {
                if reply.len() == 5 {
                    splits = Splits {
                        level: state(3)?,
                        next: state(4)?,
                    };
                }
                if *code == 0 {
                    return Ok(splits);
                }
            }
            _ => bail!("the script did not apply: {reply:?}"),
        }
    }
}

/// Every hash of the prefix: hashes, the most fields of one, hashes that are not listpacks, and
/// their bytes as `MEMORY USAGE` counts them (key, value and the keyspace's entry).
fn hash_survey(conn: &mut redis::Connection) -> Result<Survey> {
    let (mut hashes, mut fullest, mut not_listpack, mut hash_bytes) = (0u64, 0u64, 0u64, 0u64);
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{PREFIX}:packed:*"))
            .arg("COUNT")
            .arg(10_000)
            .query(conn)?;
        let mut pipe = redis::pipe();
        for key in &keys {
            pipe.cmd("HLEN")
                .arg(key)
                .cmd("OBJECT")
                .arg("ENCODING")
                .arg(key)
                .cmd("MEMORY")
                .arg("USAGE")
                .arg(key)
                .arg("SAMPLES")
                .arg(0);
        }
        let replies: Vec<(u64, String, u64)> = pipe.query(conn)?;
        for (len, encoding, bytes) in replies {
            hash_bytes += bytes;
            hashes += 1;
            fullest = fullest.max(len);
            not_listpack += u64::from(encoding != "listpack");
        }
        if next == 0 {
            return Ok(Survey {
                hashes,
                fullest,
                not_listpack,
                bytes: hash_bytes,
            });
        }
        cursor = next;
    }
}

/// Adds the scripts the slowlog holds to `slow` (count, longest µs), and empties it.
fn drain_slowlog(conn: &mut redis::Connection, slow: &mut (u64, u64)) -> Result<()> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(SLOWLOG_LEN)
        .query(conn)?;
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(conn)?;
    slow.0 += entries.len() as u64;
    for entry in &entries {
        if let redis::Value::Array(fields) = entry
            && let Some(us) = fields.get(2)
        {
            slow.1 = slow.1.max(redis::from_redis_value_ref(us)?);
        }
    }
    Ok(())
}

fn render(config: &BenchGrowthConfig, runs: &[ServerRun]) -> Result<String> {
    let mut out = String::new();
    header(&mut out, &command_line())?;
    writeln!(
        out,
        "Date: {}. One prefix grown to {} counters, each a random 64-bit post id added to once, \
         in calls of {} counters of the script `tally run` sends, on a fresh server per case \
         with its default settings; packed, growing: hashes that split as they fill, {} fields a \
         hash on average; packed, fixed: as many hashes as the final count needs at 64 fields a \
         hash, made up front (`--packed-counters`). Bytes per counter: `used_memory` minus before \
         the first write (after one call under another prefix, so that the buffers any script call \
         leaves are in both), over the counters, the writing connection closed first; of which in \
         its hashes: `MEMORY USAGE` of every hash, over the counters. CPU: `used_cpu_user + used_cpu_sys` of the server per counter created over \
         the step. Slowlog: scripts over 5 ms since the start.\n",
        today_utc(),
        thousands(config.counters),
        thousands(config.keys),
        config.fields,
    )?;
    for run in runs {
        writeln!(
            out,
            "{} (`hash-max-listpack-entries` {}):\n",
            run.name, run.entries
        )?;
        writeln!(
            out,
            "| counters | layout | bytes a counter | × strings | of which in its hashes | CPU µs a counter created | × strings | hashes | fullest hash | not listpack | scripts over 5 ms (longest, ms) |"
        )?;
        writeln!(
            out,
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        )?;
        let Some(strings) = run.cases.iter().find(|c| c.case == Case::Strings) else {
            continue;
        };
        for (i, s) in strings.steps.iter().enumerate() {
            for case in &run.cases {
                let Some(m) = case.steps.get(i) else {
                    continue;
                };
                let (hashes, fullest, not_listpack, in_hashes) = match m.hashes {
                    Some(h) => (
                        thousands(h.hashes),
                        h.fullest.to_string(),
                        h.not_listpack.to_string(),
                        format!("{:.1}", h.bytes as f64 / m.counters as f64),
                    ),
                    None => ("–".into(), "–".into(), "–".into(), "–".into()),
                };
                writeln!(
                    out,
                    "| {} | {} | {:.1} | {} | {in_hashes} | {:.2} | {} | {hashes} | {fullest} | {not_listpack} | {} ({:.1}) |",
                    thousands(m.counters),
                    case.case.label(),
                    m.bytes_per_counter,
                    ratio(m.bytes_per_counter, s.bytes_per_counter),
                    m.cpu_us,
                    ratio(m.cpu_us, s.cpu_us),
                    m.slow.0,
                    m.slow.1 as f64 / 1000.0,
                )?;
            }
        }
        writeln!(out)?;
        let fixed = run
            .cases
            .iter()
            .find(|c| c.case == Case::Fixed)
            .and_then(|c| c.reads);
        let strings_reads = strings.reads;
        if run.cases.iter().any(|c| c.reads.is_some()) {
            writeln!(
                out,
                "Reads at {}, one post a read from {READERS} tasks through the library's reader (cache off):\n",
                thousands(strings.steps.last().map_or(0, |s| s.counters))
            )?;
            writeln!(
                out,
                "| layout | posts read | posts a second | Redis CPU µs a post read | × strings | × packed, fixed |"
            )?;
            writeln!(out, "|---|---:|---:|---:|---:|---:|")?;
            for case in &run.cases {
                let Some(r) = case.reads else { continue };
                writeln!(
                    out,
                    "| {} | {} | {} | {:.2} | {} | {} |",
                    case.case.label(),
                    thousands(r.posts),
                    thousands(r.per_sec as u64),
                    r.cpu_us,
                    strings_reads.map_or("–".into(), |s| ratio(r.cpu_us, s.cpu_us)),
                    fixed.map_or("–".into(), |f| ratio(r.cpu_us, f.cpu_us)),
                )?;
            }
            writeln!(out)?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_tenfold_and_end_at_the_total() {
        assert_eq!(steps(100_000), [100_000]);
        assert_eq!(steps(250_000), [100_000, 250_000]);
        assert_eq!(
            steps(30_000_000),
            [100_000, 1_000_000, 10_000_000, 30_000_000]
        );
    }
}
