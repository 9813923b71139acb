//! The `tally` command: parses flags and hands over to the library.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use tally::config::RunConfig;
use tally::metrics::Stats;

/// Exactly-once like counting from Kafka into Redis.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Consume like events and apply them to Redis, exactly once.
    Run(Box<RunConfig>),
    /// Start a private broker, redis-server and traffic generator, and count live.
    Demo(tally::demo::DemoConfig),
    /// Produce synthetic like traffic into a topic, and the exact count every post should reach.
    Produce(Box<tally::produce::ProduceConfig>),
    /// Measure tally against a raw and a naive consumer on the same events, on private services.
    Bench(Box<tally::bench::BenchConfig>),
    /// Print tables the documentation publishes.
    #[command(subcommand)]
    Docs(Docs),
    /// Show where stored state lives.
    #[command(subcommand)]
    Inspect(Inspect),
    /// Size buckets, Redis primaries, Kafka partitions and consumers for a peak.
    Plan(Box<tally::plan::PlanArgs>),
}

#[derive(Subcommand)]
enum Docs {
    /// The stable hash's test vectors, as the README's markdown table.
    HashVectors,
}

#[derive(Subcommand)]
enum Inspect {
    /// A post's bucket keys: slot, owning primary, value, and placement against Binomial(N, 1/M).
    Post(tally::inspect::InspectPost),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo draws a table on stdout; keep its log to what needs attention.
    let default_filter = match cli.command {
        Command::Demo(_)
        | Command::Produce(_)
        | Command::Bench(_)
        | Command::Inspect(_)
        | Command::Plan(_)
        | Command::Docs(_) => "warn",
        Command::Run(_) => "info,rdkafka=warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TALLY_LOG")
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Run(config) => {
                if let Some(addr) = config.metrics_addr {
                    tally::metrics::serve(addr)?;
                }
                let shutdown = CancellationToken::new();
                tokio::spawn(on_signal(shutdown.clone()));
                tally::run::run(*config, Arc::new(Stats::default()), shutdown)
                    .await
                    .map_err(|e| e.to_string())
            }
            Command::Demo(config) => tally::demo::demo(config)
                .await
                .map_err(|e| format!("{e:#}")),
            Command::Produce(config) => tally::produce::produce(*config)
                .await
                .map_err(|e| format!("{e:#}")),
            Command::Bench(config) => tally::bench::bench(*config)
                .await
                .map_err(|e| format!("{e:#}")),
            Command::Docs(Docs::HashVectors) => {
                print!("{}", tally::routing::hash_vectors_table());
                Ok(())
            }
            Command::Inspect(Inspect::Post(args)) => tally::inspect::inspect_post(&args)
                .map(|report| print!("{report}"))
                .map_err(|e| format!("{e:#}")),
            Command::Plan(args) => tally::plan::report(&args)
                .map(|report| print!("{report}"))
                .map_err(|e| e.to_string()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Cancels `shutdown` on SIGINT or SIGTERM.
async fn on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("Signal received; shutting down.");
    shutdown.cancel();
}
