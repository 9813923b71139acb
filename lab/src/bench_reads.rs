//! Bench reads: `tally-lab bench-reads`, the read path of `tally serve` under
//! load, next to reading the same counter keys from Redis directly.
//!
//! It starts its own redis-server on a free loopback port, writes a layout
//! record and counter keys with known values through the library's key
//! layout, starts `tally serve` (the `--tally-bin` binary) with its defaults on a free
//! port, checks that every answer equals the written totals, and then loads
//! it with wrk, one case at a time:
//!
//! * **one hot post**: every request asks for the same post;
//! * **Zipf**: each request asks for one of `--posts` posts, drawn from a
//!   Zipf distribution by a generated wrk Lua script;
//! * **batch**: every request asks `/v1/likes` for the `--batch` most
//!   popular posts;
//! * **one hot post, cache off**: a second `tally serve` with
//!   `--cache-ttl-ms 0`, for what the cache is worth.
//!
//! Each case reports requests/s and p50 / p99 latency (wrk `--latency`), and
//! the Redis calls per request (`INFO commandstats` delta over the run,
//! divided by the requests wrk made). The baseline is redis-benchmark
//! sending `MGET` of the keys a read of the same posts sums, from as many
//! connections and threads, in the same run; the report gives served / direct.
//!
//! Beside each case, how the kernel scheduled `tally serve` during its wrk
//! run ([`sched`]): whether a high p99 comes with its threads waiting for a
//! core. `--repeat N` runs the hot-post case N times in a row and lists each
//! run's rate, p99 and run-queue wait, so an outlier can be set beside its
//! scheduling.

mod clients;
mod report;
mod sched;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use rustc_hash::FxHashMap;
use tally::domain::layout::{self, Record};
use tally::infra::config::DEFAULT_SERVE_MAX_IDS;
use tally::read::Reader;

use crate::bench::services::RedisSnapshot;
use crate::binaries::Tally;
use crate::local::{free_port, start_redis};
use crate::markdown::{publish, thousands};
use clients::{Clients, Load, Programs};
use sched::{Sched, Settled, Snapshot};

/// The longest wait for a quiet machine before the runs ([`sched::settle`]).
const SETTLE_AT_MOST: Duration = Duration::from_secs(60);

/// Settings of `tally-lab bench-reads`.
#[derive(Debug, Clone, Args)]
pub struct BenchReadsConfig {
    /// Seconds of each wrk and redis-benchmark run.
    #[arg(long, default_value_t = 10)]
    pub secs: u64,

    /// Connections of wrk and of redis-benchmark.
    #[arg(long, default_value_t = 32)]
    pub connections: u32,

    /// Threads of wrk and of redis-benchmark.
    #[arg(long, default_value_t = 2)]
    pub threads: u32,

    /// Buckets per post (the layout record's bucket count).
    #[arg(long, default_value_t = 16)]
    pub buckets: u32,

    /// Posts of the Zipf case (ids 1..=posts).
    #[arg(long, default_value_t = 1_000)]
    pub posts: u64,

    /// Zipf exponent s of the posts' popularity.
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,

    /// Posts per request of the batch case (the most popular ones).
    #[arg(long, default_value_t = 100)]
    pub batch: usize,

    /// Runs of the hot-post case (a), cache on, one after another; the report lists each
    /// run's req/s, p99 and run-queue wait per request, and its tables show the first.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,

    /// Also write the report into this Markdown file, between its `reads:begin`/`reads:end` markers.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

impl BenchReadsConfig {
    fn validate(&self) -> Result<()> {
        if self.secs == 0 || self.connections == 0 || self.threads == 0 {
            bail!("--secs, --connections and --threads must be at least 1");
        }
        if self.repeat == 0 {
            bail!("--repeat must be at least 1");
        }
        if self.connections < self.threads {
            bail!("--connections must be at least --threads (wrk gives each thread a connection)");
        }
        if self.buckets == 0 || self.posts == 0 || !(self.zipf.is_finite() && self.zipf > 0.0) {
            bail!("--buckets, --posts and --zipf must be positive");
        }
        if self.batch == 0 || self.batch as u64 > self.posts || self.batch > DEFAULT_SERVE_MAX_IDS {
            bail!(
                "--batch must be between 1 and --posts, and at most {DEFAULT_SERVE_MAX_IDS} (tally serve's --max-ids)"
            );
        }
        Ok(())
    }

    fn clients(&self) -> Clients {
        Clients {
            threads: self.threads,
            connections: self.connections,
            secs: self.secs,
        }
    }
}

/// The post of the hot case, apart from the Zipf posts' ids.
const HOT_POST: u64 = 1 << 40;

/// The key prefix the counts are written under.
const PREFIX: &str = "reads";

const BEGIN: &str = "<!-- reads:begin (written by `tally-lab bench-reads --out`) -->";
const END: &str = "<!-- reads:end -->";

/// A progress line on stderr.
fn progress(message: &str) {
    eprintln!("bench-reads: {message}");
}

/// The value written to one bucket: known, and different for every bucket.
fn bucket_value(post: u64, bucket: u32) -> i64 {
    if post == HOT_POST {
        1_000_000 + i64::from(bucket)
    } else {
        (post % 1_000) as i64 * 100 + i64::from(bucket) + 1
    }
}

/// One wrk run against `tally serve`.
struct Served {
    load: Load,
    /// Redis calls by command during the run.
    calls: Vec<(String, u64)>,
    /// How the serve's threads were scheduled during the run.
    sched: Sched,
}

/// One run of the hot-post case, as `--repeat` lists it.
#[derive(Clone, Copy)]
struct Repeat {
    load: Load,
    sched: Sched,
}

/// One measured case.
struct Case {
    label: String,
    served: Served,
    /// The direct baseline and the keys its `MGET` reads.
    direct: (Load, String),
}

/// The store the reads are served from, and the keys of the baseline.
struct Seeded {
    redis_url: String,
    redis_port: u16,
    truth: FxHashMap<u64, i64>,
    /// The keys a read of the hot post sums.
    hot_keys: Vec<String>,
    /// The keys a read of the batch's posts sums.
    batch_keys: Vec<String>,
}

/// What the runs measured.
struct Run {
    cases: Vec<Case>,
    /// Every run of the hot-post case, cache on, in order; the first is also
    /// the case's row.
    repeats: Vec<Repeat>,
    /// Answers compared with the written totals before the runs.
    checked: usize,
    /// How the machine settled before the runs.
    settled: Settled,
    redis_version: String,
}

/// Runs `tally-lab bench-reads` on the `tally` binary `tally` names.
pub async fn bench_reads(config: BenchReadsConfig, tally: Tally) -> Result<()> {
    config.validate()?;
    let programs = Programs::find()?;
    let dir = tempfile::Builder::new()
        .prefix("tally-bench-reads")
        .tempdir()
        .context("creating a scratch directory")?;
    progress("starting redis-server");
    let (_redis, redis_url) = start_redis(dir.path())?;
    progress("writing the layout record and the counters");
    let seeded = seed(&redis_url, &config).await?;
    let run = {
        let config = config.clone();
        let dir = dir.path().to_path_buf();
        tokio::task::spawn_blocking(move || measure(&config, &programs, &tally, &seeded, &dir))
    };
    let run = run.await.context("the measuring thread failed")??;
    let report = report::render(&config, &run)?;
    publish("bench-reads", &report, config.out.as_deref(), BEGIN, END)?;
    Ok(())
}

/// Writes the layout record and every counter through the library's key
/// layout, and returns the totals and the keys reads of them sum.
async fn seed(redis_url: &str, config: &BenchReadsConfig) -> Result<Seeded> {
    let settings = crate::local::store(redis_url, PREFIX)?;
    let opened = layout::open(&settings).await?;
    let proposed = Record {
        format: layout::STRINGS_FORMAT,
        buckets: config.buckets,
        slot_groups: layout::slot_groups(&settings).count(),
        topic: "likes".into(),
        group: "tally-bench-reads".into(),
        created_at_ms: tally::domain::versions::wall_ms(),
        packed: Default::default(),
        windows: Default::default(),
    };
    let (record, _) = layout::ensure_record(&opened.store, PREFIX, &proposed).await?;
    let mut truth = FxHashMap::default();
    let posts: Vec<u64> = (1..=config.posts).chain([HOT_POST]).collect();
    for chunk in posts.chunks(500) {
        let mut pipe = redis::pipe();
        for &post in chunk {
            for bucket in 0..record.buckets {
                let value = bucket_value(post, bucket);
                let key = opened.keys.counter_key(post, bucket);
                pipe.cmd("SET").arg(key).arg(value).ignore();
                *truth.entry(post).or_insert(0) += value;
            }
        }
        opened
            .store
            .call(|mut s| async move { pipe.query_async::<()>(&mut s).await })
            .await?;
    }
    let reader = Reader::new(
        opened.store,
        opened.keys.clone(),
        record.buckets,
        Duration::ZERO,
    );
    let sums = |post| summed_keys(&reader, &opened.keys, post, record.buckets);
    let hot_keys = sums(HOT_POST).await?;
    let mut batch_keys = Vec::new();
    for post in 1..=config.batch as u64 {
        batch_keys.extend(sums(post).await?);
    }
    Ok(Seeded {
        redis_port: port_of(redis_url)?,
        redis_url: redis_url.to_string(),
        truth,
        hot_keys,
        batch_keys,
    })
}

/// The keys a read of `post` sums, which must be the keys written.
async fn summed_keys(
    reader: &Reader,
    keys: &tally::domain::routing::KeyLayout,
    post: u64,
    buckets: u32,
) -> Result<Vec<String>> {
    let (_, summed) = reader.summed_keys(post).await?;
    let written: Vec<String> = (0..buckets).map(|b| keys.counter_key(post, b)).collect();
    if summed != written {
        bail!("a read of post {post} sums {summed:?}, not the keys written ({written:?})");
    }
    Ok(summed)
}

/// The port of `redis://127.0.0.1:PORT/`.
fn port_of(url: &str) -> Result<u16> {
    url.trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in {url}"))
}

/// A `tally serve` child, killed when dropped.
struct Serve {
    child: Child,
    addr: String,
    log: PathBuf,
}

impl Serve {
    /// Starts `tally serve` with its defaults (and `extra` flags) on a free
    /// port, logging into `dir`, and waits until it answers `/healthz`.
    fn start(
        tally: &Tally,
        redis_url: &str,
        dir: &Path,
        name: &str,
        extra: &[&str],
    ) -> Result<Serve> {
        let mut command = tally.command();
        let addr = format!("127.0.0.1:{}", free_port()?);
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).context("creating the serve log")?;
        let child = command
            .args([
                "serve", "--listen", &addr, "--redis", redis_url, "--prefix", PREFIX,
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .process_group(0)
            .spawn()
            .context("starting tally serve")?;
        let mut serve = Serve { child, addr, log };
        serve.wait_ready()?;
        Ok(serve)
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok((200, _)) = self.get("/healthz") {
                return Ok(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let last = log.lines().last().unwrap_or("no output");
                bail!("tally serve exited ({status}) before answering: {last}");
            }
            if Instant::now() > deadline {
                bail!(
                    "tally serve did not answer /healthz on {} within 30 s",
                    self.addr
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// One GET on a connection of its own: the status and the JSON body.
    fn get(&self, path: &str) -> Result<(u16, serde_json::Value)> {
        let mut stream = TcpStream::connect(&self.addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        )?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        let (head, body) = raw
            .split_once("\r\n\r\n")
            .context("an answer without headers")?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .context("an answer without a status")?;
        let body = serde_json::from_str(body).with_context(|| {
            format!("GET {path} answered {status} with a body that is not JSON")
        })?;
        Ok((status, body))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `/v1/likes?post_id=..` for `posts`.
fn batch_path(posts: impl IntoIterator<Item = u64>) -> String {
    let ids: Vec<String> = posts.into_iter().map(|p| format!("post_id={p}")).collect();
    format!("/v1/likes?{}", ids.join("&"))
}

/// Compares every count `serve` answers with the written totals: the hot
/// post and the first posts one by one, every post through the batch route;
/// returns how many answers were compared.
fn verify(serve: &Serve, seeded: &Seeded, config: &BenchReadsConfig) -> Result<usize> {
    let expect = |post: u64, status: u16, answer: &serde_json::Value| -> Result<()> {
        let want = seeded.truth[&post];
        let got = (answer["post_id"].as_u64(), answer["likes"].as_i64());
        if status != 200 || got != (Some(post), Some(want)) {
            bail!(
                "tally serve answered {status} {answer} for post {post}, which holds {want} likes"
            );
        }
        Ok(())
    };
    let mut checked = 0;
    for post in [HOT_POST].into_iter().chain(1..=config.posts.min(10)) {
        let (status, answer) = serve.get(&format!("/v1/posts/{post}/likes"))?;
        expect(post, status, &answer)?;
        checked += 1;
    }
    let posts: Vec<u64> = (1..=config.posts).collect();
    for chunk in posts.chunks(config.batch) {
        let (status, body) = serve.get(&batch_path(chunk.iter().copied()))?;
        let answers = body["likes"].as_array().cloned().unwrap_or_default();
        if answers.len() != chunk.len() {
            bail!(
                "tally serve answered {status} {body} for {} posts",
                chunk.len()
            );
        }
        for (&post, answer) in chunk.iter().zip(&answers) {
            expect(post, status, answer)?;
            checked += 1;
        }
    }
    Ok(checked)
}

/// One wrk run on `path` of `serve` (or the paths `script` asks for), the
/// Redis calls made while it ran, and how the serve was scheduled.
fn served(
    programs: &Programs,
    config: &BenchReadsConfig,
    conn: &mut redis::Connection,
    serve: &Serve,
    path: &str,
    script: Option<&Path>,
) -> Result<Served> {
    let pid = serve.child.id();
    let redis_before = RedisSnapshot::take(conn)?;
    let sched_before = Snapshot::take(pid)?;
    let load = clients::wrk(programs, config.clients(), &serve.url(path), script)?;
    let sched = Snapshot::take(pid)?.since(&sched_before);
    let calls = RedisSnapshot::take(conn)?.delta(&redis_before);
    Ok(Served { load, calls, sched })
}

/// The cases, the baselines, and the check before them.
fn measure(
    config: &BenchReadsConfig,
    programs: &Programs,
    tally: &Tally,
    seeded: &Seeded,
    dir: &Path,
) -> Result<Run> {
    let mut conn = redis::Client::open(seeded.redis_url.as_str())?
        .get_connection()
        .context("connecting to the benchmark's redis-server")?;
    let server: String = redis::cmd("INFO").arg("server").query(&mut conn)?;
    let redis_version = server
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    progress("starting tally serve");
    let serve = Serve::start(tally, &seeded.redis_url, dir, "serve", &[])?;
    let checked = verify(&serve, seeded, config)?;
    progress(&format!("{checked} answers equal the written totals"));
    progress("waiting for the machine's I/O and memory pressure to settle");
    let settled = sched::settle(SETTLE_AT_MOST);
    let (mut cases, repeats) = cached_cases(config, programs, seeded, &serve, &mut conn, dir)?;
    drop(serve);
    progress("starting tally serve --cache-ttl-ms 0");
    let serve = Serve::start(
        tally,
        &seeded.redis_url,
        dir,
        "serve-uncached",
        &["--cache-ttl-ms", "0"],
    )?;
    verify(&serve, seeded, config)?;
    progress(&format!(
        "(a) one hot post, cache off: wrk for {} s",
        config.secs
    ));
    let path = format!("/v1/posts/{HOT_POST}/likes");
    let uncached = served(programs, config, &mut conn, &serve, &path, None)?;
    let direct = cases[0].direct.0;
    cases.insert(
        1,
        Case {
            label: "(a) the same, cache off (`--cache-ttl-ms 0`)".into(),
            served: uncached,
            direct: (direct, "as (a)".into()),
        },
    );
    Ok(Run {
        cases,
        repeats,
        checked,
        settled,
        redis_version,
    })
}

/// The cases served with the cache on: hot post, Zipf, batch; and every
/// `--repeat` run of the hot post, the first of which is its case.
fn cached_cases(
    config: &BenchReadsConfig,
    programs: &Programs,
    seeded: &Seeded,
    serve: &Serve,
    conn: &mut redis::Connection,
    dir: &Path,
) -> Result<(Vec<Case>, Vec<Repeat>)> {
    let clients = config.clients();
    let secs = config.secs;
    let runs = hot_runs(config, programs, serve, conn)?;
    let repeats = runs
        .iter()
        .map(|run| Repeat {
            load: run.load,
            sched: run.sched,
        })
        .collect();
    let first = runs.into_iter().next().context("no run of the hot post")?;
    progress("(a) one hot post: redis-benchmark");
    let direct = clients::mget(programs, clients, seeded.redis_port, &seeded.hot_keys)?;
    let hot = Case {
        label: format!("(a) one hot post, {} buckets", config.buckets),
        served: first,
        direct: (direct, format!("its {} keys", seeded.hot_keys.len())),
    };
    progress(&format!(
        "(b) {} posts, Zipf: wrk for {secs} s",
        config.posts
    ));
    let ids: Vec<u64> = (1..=config.posts).collect();
    let weights: Vec<f64> = ids.iter().map(|&k| (k as f64).powf(-config.zipf)).collect();
    let script = dir.join("zipf.lua");
    std::fs::write(&script, clients::weighted_paths_script(&ids, &weights, 42))
        .context("writing the wrk script")?;
    let zipf = served(programs, config, conn, serve, "/", Some(&script))?;
    let zipf = Case {
        label: format!(
            "(b) {} posts, Zipf s = {}, one per request",
            thousands(config.posts),
            config.zipf
        ),
        served: zipf,
        direct: (direct, "one post's keys, as (a)".into()),
    };
    progress(&format!(
        "(c) batch of {}: wrk for {secs} s, then redis-benchmark",
        config.batch
    ));
    let batch = served(
        programs,
        config,
        conn,
        serve,
        &batch_path(1..=config.batch as u64),
        None,
    )?;
    let direct = clients::mget(programs, clients, seeded.redis_port, &seeded.batch_keys)?;
    let batch = Case {
        label: format!(
            "(c) batch: the {} most popular posts per request",
            config.batch
        ),
        served: batch,
        direct: (
            direct,
            format!("their {} keys", thousands(seeded.batch_keys.len() as u64)),
        ),
    };
    Ok((vec![hot, zipf, batch], repeats))
}

/// The `--repeat` runs of the hot post, one after another, each reported as
/// it ends.
fn hot_runs(
    config: &BenchReadsConfig,
    programs: &Programs,
    serve: &Serve,
    conn: &mut redis::Connection,
) -> Result<Vec<Served>> {
    let path = format!("/v1/posts/{HOT_POST}/likes");
    let mut runs = Vec::new();
    for run in 1..=config.repeat {
        let of = if config.repeat > 1 {
            format!(" (run {run} of {})", config.repeat)
        } else {
            String::new()
        };
        progress(&format!("(a) one hot post{of}: wrk for {} s", config.secs));
        let hot = served(programs, config, conn, serve, &path, None)?;
        progress(&format!(
            "(a){of}: {} req/s, p99 {:.2} ms, run-queue wait {:.2} µs per request",
            thousands(hot.load.rate as u64),
            hot.load.p99_ms,
            hot.sched.wait_per_request_ns(hot.load.requests) / 1e3,
        ));
        runs.push(hot);
    }
    Ok(runs)
}
