//! Bench windows: `tally-lab bench-windows`, what a window of trending counts
//! costs Redis per post, beside what the post's lifetime counter costs, in the
//! calls `tally run` sends.
//!
//! It starts its own redis-server (and, with `--valkey-server`, a
//! valkey-server), draws batches of Zipf traffic from the lab's generator,
//! nets each batch per post as a batch closes (zeros dropped, sorted by
//! delta), and sends every batch once per case through the library's own
//! [`script_call`], each case under a key prefix of its own:
//!
//! * the lifetime counters alone (one counter per post, no window);
//! * one hourly window alone (its counts and its leaders), no counter;
//! * the counters and the hourly window in one call, as `tally run
//!   --windows=1h` sends them;
//! * the counters and three windows (1m, 1h, 1d) in one call;
//! * the same four in the packed layout (`--layout packed`, its hashes sized
//!   for `--posts` counters at the default fields per hash), whose counters
//!   are hash fields written with `HINCRBY` as a window's counts are.
//!
//! A case's ratio is against the counters alone of its own layout.
//!
//! Each case's cost is `used_cpu_user + used_cpu_sys` of the server around
//! its calls, per post of the batch. The cases take turns call by call, in an
//! order that rotates, so a slower second of a shared machine falls on every
//! case alike; `--warm-calls` batches go first unmeasured, so the windows
//! already hold the posts of a busy hour.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Args;
use rustc_hash::FxHashMap;
use tally::domain::packing::{DEFAULT_PACKED_FIELDS, Packed, Packing};
use tally::domain::routing::{CounterId, KeyLayout};
use tally::domain::windows::Windows;
use tally::infra::config::windows::{DEFAULT_LATENESS_MS, DEFAULT_RETENTION_MS, WindowSettings};
use tally::pipeline::aggregate::WindowCell;
use tally::pipeline::apply::script_text;
use tally_lab::generate::{Traffic, TrafficShape};

use crate::bench::services::{RedisSnapshot, store_label};
use crate::bench_writes::median;
use crate::local::{start_redis, start_store_in};
use crate::markdown::{command_line, header, publish, thousands, today_utc};
use crate::script_call::apply_once;

/// Settings of `tally-lab bench-windows`.
#[derive(Debug, Clone, Args)]
pub struct BenchWindowsConfig {
    /// Posts of the Zipf traffic (ids 1..=posts).
    #[arg(long, default_value_t = 1_000_000)]
    pub posts: u64,

    /// Zipf exponent of the posts' popularity.
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,

    /// Events netted into one batch: one call of each case.
    #[arg(long, default_value_t = 30_000)]
    pub events_per_call: u64,

    /// Batches sent to every case before measuring, so the windows hold a busy hour's posts.
    #[arg(long, default_value_t = 10)]
    pub warm_calls: u64,

    /// Measured batches per round.
    #[arg(long, default_value_t = 20)]
    pub calls: u64,

    /// Rounds; the report gives the median and the range of the rounds' figures.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,

    /// A valkey-server binary: every case runs on it too, for rows beside redis-server's.
    #[arg(long, env = "TALLY_VALKEY_SERVER", value_name = "PATH")]
    pub valkey_server: Option<PathBuf>,

    /// Also write the table into this Markdown file, between its `windows:begin`/`windows:end` markers.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

impl BenchWindowsConfig {
    fn validate(&self) -> Result<()> {
        if self.events_per_call == 0 || self.calls == 0 || self.rounds == 0 {
            bail!("--events-per-call, --calls and --rounds must be at least 1");
        }
        if self.posts == 0 || self.zipf <= 0.0 {
            bail!("--posts must be at least 1 and --zipf above 0");
        }
        Ok(())
    }
}

const BEGIN: &str = "<!-- windows:begin (written by `tally-lab bench-windows --out`) -->";
const END: &str = "<!-- windows:end -->";

/// What one call holds: the posts' counters or not, and the windows it keeps.
struct Shape {
    label: &'static str,
    counters: bool,
    windows: &'static [u64],
}

const HOUR: u64 = 3_600_000;

/// The shapes, in the order of the report within a layout; the first is what
/// the layout's others are divided by.
const SHAPES: [Shape; 4] = [
    Shape {
        label: "lifetime counters alone",
        counters: true,
        windows: &[],
    },
    Shape {
        label: "one window (1h) alone",
        counters: false,
        windows: &[HOUR],
    },
    Shape {
        label: "counters and one window (1h)",
        counters: true,
        windows: &[HOUR],
    },
    Shape {
        label: "counters and three windows (1m, 1h, 1d)",
        counters: true,
        windows: &[60_000, HOUR, 24 * HOUR],
    },
];

/// One case: a shape, its counters as string keys or packed.
#[derive(Clone, Copy)]
struct Case {
    packed: bool,
    /// The index of its shape in [`SHAPES`].
    shape: usize,
}

impl Case {
    fn shape(&self) -> &'static Shape {
        &SHAPES[self.shape]
    }

    fn label(&self) -> String {
        match self.packed {
            true => format!("packed: {}", self.shape().label),
            false => self.shape().label.to_string(),
        }
    }
}

/// Every shape in the string layout, then every shape packed: the order of
/// the report.
const CASES: [Case; 2 * SHAPES.len()] = {
    let mut cases = [Case {
        packed: false,
        shape: 0,
    }; 2 * SHAPES.len()];
    let mut i = 0;
    while i < cases.len() {
        cases[i] = Case {
            packed: i >= SHAPES.len(),
            shape: i % SHAPES.len(),
        };
        i += 1;
    }
    cases
};

/// The index of the case a case's ratio is taken against: the counters
/// alone of its layout.
fn base_of(case: &Case) -> usize {
    CASES
        .iter()
        .position(|c| c.packed == case.packed && c.shape().counters && c.shape().windows.is_empty())
        .expect("each layout has a case of counters alone")
}

/// One batch netted per post: `(post, delta)`, zeros dropped, sorted by delta then post.
fn net(events: impl Iterator<Item = (u64, i64)>) -> Vec<(u64, i64)> {
    let mut sums: FxHashMap<u64, i64> = FxHashMap::default();
    for (post, delta) in events {
        *sums.entry(post).or_default() += delta;
    }
    let mut cells: Vec<(u64, i64)> = sums.into_iter().filter(|&(_, d)| d != 0).collect();
    cells.sort_unstable_by_key(|&(post, delta)| (delta, post));
    cells
}

/// What one case sends: its layout and its script's hash on the server.
struct Sender {
    layout: KeyLayout,
    sha: String,
    /// Calls made so far: each call has a fence key of its own.
    made: u64,
}

impl Sender {
    fn new(conn: &mut redis::Connection, case: &Case, index: usize, posts: u64) -> Result<Self> {
        let settings = WindowSettings::new(
            case.shape().windows.to_vec(),
            DEFAULT_LATENESS_MS,
            DEFAULT_RETENTION_MS,
        )
        .map_err(anyhow::Error::msg)?;
        let mut layout =
            KeyLayout::new(format!("bw{index}")).with_windows(Windows::from_settings(&settings));
        if case.packed {
            let packed = Packed::sized(posts, DEFAULT_PACKED_FIELDS, 1);
            layout = layout.with_packing(Packing::Packed(packed));
        }
        let sha = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(script_text(&layout))
            .query(conn)?;
        Ok(Sender {
            layout,
            sha,
            made: 0,
        })
    }

    /// Sends one batch as `tally run` would, for a call at `now_ms`.
    fn send(
        &mut self,
        conn: &mut redis::Connection,
        case: &Case,
        cells: &[(u64, i64)],
        now_ms: i64,
    ) -> Result<()> {
        self.made += 1;
        let deltas = match case.shape().counters {
            true => cells
                .iter()
                .map(|&(post, delta)| (CounterId::v0(post, 0), delta))
                .collect(),
            false => Vec::new(),
        };
        let mut windows = Vec::with_capacity(cells.len() * case.shape().windows.len());
        for (i, size) in self.layout.windows().sizes().iter().enumerate() {
            let start = size.start_of(now_ms);
            let size = u8::try_from(i).expect("at most eight windows");
            windows.extend(cells.iter().map(|&(post_id, delta)| {
                let cell = WindowCell {
                    size,
                    start,
                    post_id,
                };
                (cell, delta)
            }));
        }
        let fence = format!("{}:fence:{}", self.layout.prefix(), self.made);
        apply_once(conn, &self.sha, &self.layout, &fence, deltas, windows)?;
        Ok(())
    }
}

/// Milliseconds since the epoch.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// One store's figures: its label, then µs of server CPU per post by case, one per round.
struct Measured {
    store: String,
    figures: Vec<Vec<f64>>,
    posts_per_call: f64,
}

/// Runs `tally-lab bench-windows`.
pub async fn bench_windows(config: BenchWindowsConfig) -> Result<()> {
    config.validate()?;
    tokio::task::spawn_blocking(move || bench_blocking(&config))
        .await
        .context("the benchmark thread failed")?
}

fn bench_blocking(config: &BenchWindowsConfig) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("tally-bench-windows")
        .tempdir()
        .context("creating a scratch directory")?;
    eprintln!("bench-windows: starting redis-server");
    let (_redis, redis_url) = start_redis(dir.path())?;
    let mut stores = vec![redis_url];
    let _valkey = match &config.valkey_server {
        Some(program) => {
            eprintln!("bench-windows: starting {}", program.display());
            let (service, url) = start_store_in(program, dir.path(), "valkey")?;
            stores.push(url);
            Some(service)
        }
        None => None,
    };
    let mut measured = Vec::with_capacity(stores.len());
    for url in &stores {
        measured.push(measure(config, url)?);
    }
    let report = render(config, &measured)?;
    publish("bench-windows", &report, config.out.as_deref(), BEGIN, END)?;
    Ok(())
}

/// Every case on the store at `url`, on the same batches.
fn measure(config: &BenchWindowsConfig, url: &str) -> Result<Measured> {
    let store = store_label(url)?;
    let mut conn = redis::Client::open(url)?
        .get_connection()
        .with_context(|| format!("connecting to {url}"))?;
    let mut senders = CASES
        .iter()
        .enumerate()
        .map(|(i, case)| Sender::new(&mut conn, case, i, config.posts))
        .collect::<Result<Vec<_>>>()?;
    let shape = TrafficShape {
        posts: config.posts,
        zipf_exponent: config.zipf,
        viral_share: 0.0,
        ..TrafficShape::default()
    };
    let mut traffic = Traffic::new(shape, 7);
    let mut batch = || {
        net((0..config.events_per_call).map(|_| {
            let event = traffic.next_event();
            (event.post_id, event.delta())
        }))
    };
    eprintln!(
        "bench-windows: {store}: {} warm-up batches",
        config.warm_calls
    );
    for _ in 0..config.warm_calls {
        let cells = batch();
        let now = now_ms();
        for (case, sender) in CASES.iter().zip(&mut senders) {
            sender.send(&mut conn, case, &cells, now)?;
        }
    }
    let mut figures: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    let (mut posts_sent, mut calls_sent) = (0u64, 0u64);
    for round in 1..=config.rounds {
        eprintln!("bench-windows: {store}: round {round} of {}", config.rounds);
        let mut cpu = vec![0.0; CASES.len()];
        let mut posts = 0u64;
        for call in 0..config.calls {
            let cells = batch();
            posts += cells.len() as u64;
            let now = now_ms();
            for turn in 0..CASES.len() {
                let i = (turn + call as usize) % CASES.len();
                let before = RedisSnapshot::take(&mut conn)?;
                senders[i].send(&mut conn, &CASES[i], &cells, now)?;
                let after = RedisSnapshot::take(&mut conn)?;
                cpu[i] += after.cpu_secs - before.cpu_secs;
            }
        }
        for (figure, spent) in figures.iter_mut().zip(cpu) {
            figure.push(spent * 1e6 / posts.max(1) as f64);
        }
        posts_sent += posts;
        calls_sent += config.calls;
    }
    Ok(Measured {
        store,
        figures,
        posts_per_call: posts_sent as f64 / calls_sent.max(1) as f64,
    })
}

fn render(config: &BenchWindowsConfig, measured: &[Measured]) -> Result<String> {
    let mut out = String::new();
    header(&mut out, &command_line())?;
    writeln!(
        out,
        "Date: {}. Zipf (s = {}) over {} posts; batches of {} events netted per post (about {} posts \
         a call), {} unmeasured first, then {} rounds of {} calls of every case, the cases taking \
         turns call by call; the packed cases' hashes are sized for {} counters at {} fields a hash. \
         Server CPU per post of the batch; ratios are against the counters alone of the same \
         layout on the same store.\n",
        today_utc(),
        config.zipf,
        thousands(config.posts),
        thousands(config.events_per_call),
        thousands(measured.first().map_or(0.0, |m| m.posts_per_call).round() as u64),
        config.warm_calls,
        config.rounds,
        config.calls,
        thousands(config.posts),
        DEFAULT_PACKED_FIELDS,
    )?;
    writeln!(
        out,
        "| store | case | server CPU µs per post, median | lowest – highest round | ÷ counters alone |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|")?;
    for m in measured {
        let medians: Vec<f64> = m.figures.iter().map(|f| median(&mut f.clone())).collect();
        for ((case, values), &med) in CASES.iter().zip(&m.figures).zip(&medians) {
            let mut values = values.clone();
            values.sort_by(f64::total_cmp);
            writeln!(
                out,
                "| {} | {} | {med:.2} | {:.2} – {:.2} | {:.2}× |",
                m.store,
                case.label(),
                values.first().copied().unwrap_or(f64::NAN),
                values.last().copied().unwrap_or(f64::NAN),
                med / medians[base_of(case)]
            )?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_case_is_divided_by_the_counters_alone_of_its_own_layout() {
        for case in &CASES {
            let base = &CASES[base_of(case)];
            assert_eq!(base.packed, case.packed, "{}", case.label());
            let shape = base.shape();
            assert!(
                shape.counters && shape.windows.is_empty(),
                "{}",
                case.label()
            );
        }
        assert_ne!(base_of(&CASES[0]), base_of(&CASES[CASES.len() - 1]));
    }

    #[test]
    fn a_batch_is_netted_per_post_without_zeros_and_sorted_by_delta() {
        let events = [(5, 1), (3, 1), (5, 1), (9, -1), (3, -1), (7, 1), (9, -1)];
        assert_eq!(net(events.into_iter()), vec![(9, -2), (7, 1), (5, 2)]);
    }
}
