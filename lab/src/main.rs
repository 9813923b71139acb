//! `tally-lab`: the tools around tally, built apart from the service's binary and image.
//!
//! Each command starts what it needs on this machine; the benchmarks start the `tally`
//! binary as child processes (`--tally-bin`, by default the `tally` beside this binary, where
//! cargo builds both).
//!
//! # Layout
//!
//! ```text
//! demo          the whole pipeline on one machine, in-process, with live figures and a final check
//! produce       synthetic like traffic into a topic, and the exact count every post should reach
//! bench         `tally run` against a raw and two naive consumers (and, with --streams-peer,
//!               Kafka Streams) on one backlog, per workload; its baseline consumers run as
//!               `tally-lab bench-baseline` children
//! bench_reads   `tally serve` under wrk, against direct MGETs of the same keys
//! bench_writes  what one counter write costs Redis: in apply.lua, in a transaction, pipelined
//! bench_windows what a window of trending counts costs Redis per post, beside the counters
//! bench_memory  what a counter costs Redis in memory and CPU per write, as a string or packed
//! bench_growth  one prefix grown to tens of millions of counters, strings beside packed hashes
//!               that split as they fill: bytes, CPU and the slowlog at each tenfold step
//! local         the private Apache Kafka node and redis-server the demo and the benchmarks start
//! binaries      the `tally` binary and this one, as child processes with no TALLY_* inherited
//! markdown      the reports' blocks in docs/benchmarks.md: command line, machine, date
//! logs          log lines on stderr: colour only on a terminal; the demo's start-up held back
//! ```
//!
//! The traffic itself comes from the lab's library, [`tally_lab::generate`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use binaries::Tally;

/// The allocator `tally` runs with (see its main.rs), so the raw and naive consumers the
/// benchmarks measure it against allocate as it does.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod bench;
mod bench_growth;
mod bench_memory;
mod bench_reads;
mod bench_windows;
mod bench_writes;
mod binaries;
mod demo;
mod local;
mod logs;
mod markdown;
mod produce;
mod script_call;

/// The demo, the traffic producer and the benchmarks of tally.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// The `tally` binary the benchmarks start (`tally run`, `tally serve`); default: the
    /// `tally` beside this binary.
    #[arg(long, global = true, value_name = "PATH")]
    tally_bin: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Start a private broker, redis-server and traffic generator, and count live.
    Demo(demo::DemoConfig),
    /// Produce synthetic like traffic into a topic, and the exact count every post should reach.
    Produce(Box<produce::ProduceConfig>),
    /// Measure tally against a raw and a naive consumer on the same events, on private services.
    Bench(Box<bench::BenchConfig>),
    /// Measure `tally serve` with wrk against direct MGETs of the same keys, on a private redis-server.
    BenchReads(Box<bench_reads::BenchReadsConfig>),
    /// Measure what one counter write costs Redis: in apply.lua, in a transaction, pipelined.
    BenchWrites(Box<bench_writes::BenchWritesConfig>),
    /// Measure what windows of trending counts cost Redis per post, beside the lifetime counters.
    BenchWindows(Box<bench_windows::BenchWindowsConfig>),
    /// Measure what a counter costs Redis in memory and CPU per write, as strings and packed in hashes.
    BenchMemory(Box<bench_memory::BenchMemoryConfig>),
    /// Grow one prefix to tens of millions of counters, as strings and as packed hashes that
    /// split as they fill: bytes, CPU and the slowlog at each tenfold step.
    BenchGrowth(Box<bench_growth::BenchGrowthConfig>),
    /// One baseline consumer of `tally-lab bench`, run as its child process.
    #[command(hide = true)]
    BenchBaseline(Box<bench::BaselineArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let held_back = logs::init(matches!(cli.command, Command::Demo(_)));
    // The demo runs the pipeline in this process: a panic of one of its background tasks ends
    // the command, as it ends `tally run`.
    tally::infra::tasks::install_panic_hook();
    let result = tokio::runtime::Runtime::new()
        .map_err(|e| anyhow::anyhow!("cannot start the async runtime: {e}"))
        .and_then(|runtime| {
            runtime.block_on(async {
                tokio::select! {
                    result = dispatch(cli.command, cli.tally_bin, held_back) => result,
                    failure = tally::infra::tasks::failed() => Err(failure.into()),
                }
            })
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one command; `tally_bin` is `--tally-bin`, looked for only by the commands that
/// start `tally`; `held_back`, the demo's start-up messages of librdkafka.
async fn dispatch(
    command: Command,
    tally_bin: Option<PathBuf>,
    held_back: Option<logs::HeldBack>,
) -> anyhow::Result<()> {
    match command {
        Command::Demo(config) => demo::demo(config, held_back).await,
        Command::Produce(config) => produce::produce(*config).await,
        Command::Bench(config) => bench::bench(*config, Tally::locate(tally_bin)?).await,
        Command::BenchReads(config) => {
            bench_reads::bench_reads(*config, Tally::locate(tally_bin)?).await
        }
        Command::BenchWrites(config) => bench_writes::bench_writes(*config).await,
        Command::BenchWindows(config) => bench_windows::bench_windows(*config).await,
        Command::BenchMemory(config) => bench_memory::bench_memory(*config).await,
        Command::BenchGrowth(config) => bench_growth::bench_growth(*config).await,
        Command::BenchBaseline(args) => bench::baseline(*args).await,
    }
}
