//! Bench writes: `tally-lab bench-writes`, what one counter write costs Redis,
//! inside `apply.lua` and outside it, on keys the server's caches hold and on
//! keys they do not.
//!
//! It starts its own redis-server, sets `--counters` counter keys through the
//! library's key layout, and then measures each case as `used_cpu_user +
//! used_cpu_sys` of the server per counter written, over `--calls` calls of
//! `--keys` counters, in `--rounds` rounds that take the cases in turn (so a
//! slower minute of a shared machine falls on every case alike). The cases:
//!
//! * `apply.lua` (the script `tally run` sends, through its fence check and
//!   its runs of deltas) naming the same counters in every call: warm keys;
//! * `apply.lua` naming counters drawn at random for each call: cold keys,
//!   which is what the long tail of a batch is;
//! * the same two with a script that takes the keys and writes none of them:
//!   the cost of handing a script its key names;
//! * one `MULTI`, the `INCRBY`s and the fence's `SET`, `EXEC`: the writes of
//!   the script as a transaction;
//! * pipelined `INCR`s, 500 per pipeline (the naive consumer of `tally
//!   bench`), drawn at random from every counter and from as many counters
//!   as a call names.
//!
//! Every key exists before the first round, so no case pays for creating keys
//! (`tally-lab bench` shows that creation changes little).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};
use tally::domain::routing::{CounterId, KeyLayout};
use tally::pipeline::apply::APPLY_LUA;

use crate::bench::services::RedisSnapshot;
use crate::local::start_redis;
use crate::markdown::{command_line, header, publish, thousands, today_utc};
use crate::script_call::apply_once;

/// Settings of `tally-lab bench-writes`.
#[derive(Debug, Clone, Args)]
pub struct BenchWritesConfig {
    /// Counter keys set before the cases run (posts 1..=counters, one bucket each).
    #[arg(long, default_value_t = 1_200_000)]
    pub counters: u64,

    /// Counters per call: per script, per transaction (the default batch limit of `tally run`).
    #[arg(long, default_value_t = tally::infra::config::DEFAULT_BATCH_MAX_KEYS as u64)]
    pub keys: u64,

    /// Calls of each case per round.
    #[arg(long, default_value_t = 50)]
    pub calls: u64,

    /// Rounds over every case; the report gives the median and the range.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,

    /// Also write the table into this Markdown file, between its `writes:begin`/`writes:end` markers.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

impl BenchWritesConfig {
    fn validate(&self) -> Result<()> {
        if self.keys == 0 || self.calls == 0 || self.rounds == 0 {
            bail!("--keys, --calls and --rounds must be at least 1");
        }
        if self.counters < self.keys {
            bail!("--counters must be at least --keys");
        }
        Ok(())
    }
}

const BEGIN: &str = "<!-- writes:begin (written by `tally-lab bench-writes --out`) -->";
const END: &str = "<!-- writes:end -->";

/// The key prefix of the counters.
const PREFIX: &str = "writes";

/// `INCR`s per pipeline of the naive case: `tally-lab bench`'s poll batch.
const PIPELINE: usize = crate::bench::NAIVE_POLL_BATCH;

/// A script with `apply.lua`'s fence read and write that touches no counter;
/// it takes `apply.lua`'s arguments.
const KEYS_ONLY_LUA: &str = "local f = redis.call('GET', KEYS[1])\n\
     redis.call('SET', KEYS[1], ARGV[2])\n\
     return {0, tonumber(f or ARGV[3])}";

/// Which keys a call names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// The same counters in every call.
    Warm,
    /// Counters drawn at random from every counter, anew for each call.
    Cold,
}

/// How a call writes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    /// `EVALSHA apply.lua`.
    Script,
    /// `EVALSHA` of [`KEYS_ONLY_LUA`].
    KeysOnly,
    /// `MULTI`, `INCRBY`s, the fence's `SET`, `EXEC`.
    Transaction,
    /// `INCR`s, [`PIPELINE`] per pipeline.
    Pipelined,
}

/// The cases, in the order of the report.
const CASES: [(Write, Keys, &str); 7] = [
    (
        Write::Script,
        Keys::Warm,
        "`apply.lua`, the same counters in every call",
    ),
    (
        Write::Script,
        Keys::Cold,
        "`apply.lua`, counters drawn at random for each call",
    ),
    (
        Write::KeysOnly,
        Keys::Warm,
        "a script given the same keys, writing none",
    ),
    (
        Write::KeysOnly,
        Keys::Cold,
        "a script given keys drawn at random, writing none",
    ),
    (
        Write::Transaction,
        Keys::Cold,
        "`MULTI`, `INCRBY`s drawn at random, the fence's `SET`, `EXEC`",
    ),
    (
        Write::Pipelined,
        Keys::Cold,
        "pipelined `INCR`s drawn at random from every counter",
    ),
    (
        Write::Pipelined,
        Keys::Warm,
        "pipelined `INCR`s of the same counters in every call",
    ),
];

/// The measuring connection and what every call needs.
struct Bench {
    conn: redis::Connection,
    layout: KeyLayout,
    apply_sha: String,
    keys_only_sha: String,
    rng: SmallRng,
    counters: u64,
    keys: u64,
    /// The warm calls' posts.
    warm: Vec<u64>,
    /// Calls made so far, for a fence key of each call's own.
    made: u64,
}

impl Bench {
    /// The posts whose counters one call names.
    fn posts(&mut self, keys: Keys) -> Vec<u64> {
        match keys {
            Keys::Warm => self.warm.clone(),
            Keys::Cold => (0..self.keys)
                .map(|_| self.rng.random_range(1..=self.counters))
                .collect(),
        }
    }

    /// One call; returns the counters it wrote (or named).
    fn call(&mut self, write: Write, keys: Keys) -> Result<u64> {
        let posts = self.posts(keys);
        self.made += 1;
        let fence = format!("{PREFIX}:fence:{}", self.made);
        let name = |post: &u64| self.layout.counter_key(*post, 0);
        match write {
            Write::Script | Write::KeysOnly => {
                let sha = if write == Write::Script {
                    &self.apply_sha
                } else {
                    &self.keys_only_sha
                };
                // +1 on every counter, no window.
                let deltas = posts.iter().map(|&p| (CounterId::v0(p, 0), 1)).collect();
                apply_once(
                    &mut self.conn,
                    sha,
                    &self.layout,
                    &fence,
                    deltas,
                    Vec::new(),
                )?;
            }
            Write::Transaction => {
                let mut pipe = redis::pipe();
                pipe.atomic();
                for post in &posts {
                    pipe.cmd("INCRBY").arg(name(post)).arg(1).ignore();
                }
                pipe.cmd("SET").arg(&fence).arg(100).ignore();
                pipe.query::<()>(&mut self.conn)?;
            }
            Write::Pipelined => {
                for chunk in posts.chunks(PIPELINE) {
                    let mut pipe = redis::pipe();
                    for post in chunk {
                        pipe.cmd("INCR").arg(name(post)).ignore();
                    }
                    pipe.query::<()>(&mut self.conn)?;
                }
            }
        }
        Ok(posts.len() as u64)
    }
}

/// Runs `tally-lab bench-writes`.
pub async fn bench_writes(config: BenchWritesConfig) -> Result<()> {
    config.validate()?;
    tokio::task::spawn_blocking(move || bench_blocking(&config))
        .await
        .context("the benchmark thread failed")?
}

fn bench_blocking(config: &BenchWritesConfig) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("tally-bench-writes")
        .tempdir()
        .context("creating a scratch directory")?;
    eprintln!("bench-writes: starting redis-server");
    let (_redis, url) = start_redis(dir.path())?;
    let mut conn = redis::Client::open(url.as_str())?
        .get_connection()
        .with_context(|| format!("connecting to {url}"))?;
    let layout = KeyLayout::new(PREFIX);
    eprintln!(
        "bench-writes: setting {} counters",
        thousands(config.counters)
    );
    for start in (1..=config.counters).step_by(10_000) {
        let mut pipe = redis::pipe();
        for post in start..(start + 10_000).min(config.counters + 1) {
            pipe.cmd("SET")
                .arg(layout.counter_key(post, 0))
                .arg(0)
                .ignore();
        }
        pipe.query::<()>(&mut conn)?;
    }
    let load = |conn: &mut redis::Connection, script: &str| -> Result<String> {
        Ok(redis::cmd("SCRIPT").arg("LOAD").arg(script).query(conn)?)
    };
    let apply_sha = load(&mut conn, APPLY_LUA)?;
    let keys_only_sha = load(&mut conn, KEYS_ONLY_LUA)?;
    let mut rng = SmallRng::seed_from_u64(42);
    let warm = (0..config.keys)
        .map(|_| rng.random_range(1..=config.counters))
        .collect();
    let mut bench = Bench {
        conn,
        layout,
        apply_sha,
        keys_only_sha,
        rng,
        counters: config.counters,
        keys: config.keys,
        warm,
        made: 0,
    };
    // µs per counter, by case, one figure per round.
    let mut figures: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    for round in 1..=config.rounds {
        for (i, &(write, keys, label)) in CASES.iter().enumerate() {
            eprintln!("bench-writes: round {round} of {}: {label}", config.rounds);
            // One call first, so the warm keys are warm and the script is cached.
            bench.call(write, keys)?;
            let before = RedisSnapshot::take(&mut bench.conn)?;
            let mut written = 0;
            for _ in 0..config.calls {
                written += bench.call(write, keys)?;
            }
            let after = RedisSnapshot::take(&mut bench.conn)?;
            figures[i].push((after.cpu_secs - before.cpu_secs) * 1e6 / written.max(1) as f64);
        }
    }
    let version: String = redis::cmd("INFO").arg("server").query(&mut bench.conn)?;
    let version = version
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    let report = render(config, &version, &figures)?;
    publish("bench-writes", &report, config.out.as_deref(), BEGIN, END)?;
    Ok(())
}

/// The median of `values` (sorted in place); NaN when there are none.
pub(crate) fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn render(config: &BenchWritesConfig, version: &str, figures: &[Vec<f64>]) -> Result<String> {
    let mut out = String::new();
    header(&mut out, &command_line())?;
    writeln!(
        out,
        "Date: {}. redis-server {version} (no persistence) on the same machine, holding {} counters; \
         {} calls of {} counters per case and round, {} rounds taking the cases in turn.\n",
        today_utc(),
        thousands(config.counters),
        config.calls,
        thousands(config.keys),
        config.rounds
    )?;
    writeln!(
        out,
        "| case | Redis CPU µs per counter, median | lowest – highest round |"
    )?;
    writeln!(out, "|---|---:|---:|")?;
    let mut medians = Vec::with_capacity(figures.len());
    for (&(_, _, label), values) in CASES.iter().zip(figures) {
        let mut values = values.clone();
        let m = median(&mut values);
        medians.push(m);
        writeln!(
            out,
            "| {label} | {m:.2} | {:.2} – {:.2} |",
            values.first().copied().unwrap_or(f64::NAN),
            values.last().copied().unwrap_or(f64::NAN)
        )?;
    }
    let at = |write: Write, keys: Keys| {
        CASES
            .iter()
            .position(|&(w, k, _)| w == write && k == keys)
            .map_or(f64::NAN, |i| medians[i])
    };
    let script_cold = at(Write::Script, Keys::Cold);
    writeln!(
        out,
        "\nPer counter, medians: `apply.lua` on cold keys costs **{:.2}×** its cost on warm ones and \
         **{:.2}×** a pipelined `INCR` of a cold key; the transaction costs **{:.2}×** the script.",
        script_cold / at(Write::Script, Keys::Warm),
        script_cold / at(Write::Pipelined, Keys::Cold),
        at(Write::Transaction, Keys::Cold) / script_cold
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
