//! The `tally` command: parses flags and hands over to the library.

use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
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
    /// Show the settings `tally run` would use.
    #[command(subcommand)]
    Config(ConfigCommand),
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
    /// Print posts' like counts, summed over every bucket and version.
    Count(tally::read::CountArgs),
    /// Serve counts over HTTP: GET /v1/posts/{id}/likes and /v1/likes?post_id=..
    Serve(tally::serve::ServeArgs),
    /// Give a post more buckets now (a new routing version; safe while tally runs).
    Promote(tally::promote::RouteArgs),
    /// Give a post fewer buckets (a new routing version; old keys stay summed).
    Demote(tally::promote::RouteArgs),
    /// Size buckets, Redis primaries, Kafka partitions and consumers for a peak.
    Plan(Box<tally::plan::PlanArgs>),
    /// Recount the topic into a new key generation and switch to it when caught up.
    Rebuild(Box<RebuildCommand>),
    /// Recount the topic in memory and compare with the stored counts; exits 1 on drift.
    Verify(Box<VerifyCommand>),
    /// Remove key generations older than the current one, after a grace period.
    Gc(tally::gc::GcArgs),
}

#[derive(clap::Args)]
struct RebuildCommand {
    #[command(flatten)]
    rebuild: tally::rebuild::RebuildArgs,
    #[command(flatten)]
    run: RunConfig,
}

#[derive(clap::Args)]
struct VerifyCommand {
    #[command(flatten)]
    verify: tally::verify::VerifyArgs,
    #[command(flatten)]
    run: RunConfig,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print the effective settings (flags > TALLY_* variables > --config file > defaults)
    /// as a file --config accepts, secrets masked; problems go to stderr.
    Print(Box<RunConfig>),
}

#[derive(Subcommand)]
enum Docs {
    /// The stable hash's test vectors, as the README's markdown table.
    HashVectors,
    /// Every setting of `tally run`, as the README's markdown table.
    Config,
}

#[derive(Subcommand)]
enum Inspect {
    /// A post's bucket keys: slot, owning primary, value, and placement against Binomial(N, 1/M).
    Post(tally::inspect::InspectPost),
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The settings of `run` and `config print` also come from variables and a file.
    let run_matches = match matches.subcommand() {
        Some(("run", m)) => Some(m),
        Some(("config", m)) => m.subcommand_matches("print"),
        Some(("rebuild", m)) | Some(("verify", m)) => Some(m),
        _ => None,
    };
    // The demo draws a table on stdout; keep its log to what needs attention.
    let default_filter = match cli.command {
        Command::Demo(_)
        | Command::Produce(_)
        | Command::Bench(_)
        | Command::Inspect(_)
        | Command::Docs(_)
        | Command::Count(_)
        | Command::Promote(_)
        | Command::Demote(_)
        | Command::Config(_)
        | Command::Plan(_)
        | Command::Verify(_)
        | Command::Gc(_) => "warn",
        Command::Run(_) | Command::Serve(_) | Command::Rebuild(_) => "info,rdkafka=warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TALLY_LOG")
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // Redis TLS (rediss://) uses rustls with the ring provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Run(_) => {
                let config = settings(run_matches.expect("run has settings"))?;
                let shutdown = CancellationToken::new();
                tokio::spawn(on_signal(shutdown.clone()));
                if let Some(addr) = config.metrics_addr {
                    let metrics = tally::metrics::install()?;
                    tally::http::serve(addr, metrics).await?;
                    tally::health::spawn_probes(&config, shutdown.clone());
                }
                tally::run::run(config, Arc::new(Stats::default()), shutdown)
                    .await
                    .map_err(|e| tally::security::error_line(&e))
            }
            Command::Config(ConfigCommand::Print(_)) => {
                let loaded = tally::config::load(run_matches.expect("print has settings"));
                let config = loaded.map_err(|problems| lines(&problems))?;
                print!("{}", tally::config::print(&config));
                match config.problems() {
                    problems if problems.is_empty() => Ok(()),
                    problems => Err(lines(&problems)),
                }
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
            Command::Docs(Docs::Config) => {
                print!("{}", tally::config::settings_table());
                Ok(())
            }
            Command::Inspect(Inspect::Post(args)) => tally::inspect::inspect_post(&args)
                .map(|report| print!("{report}"))
                .map_err(|e| format!("{e:#}")),
            Command::Count(args) => tally::read::count_command(&args)
                .await
                .map(|out| print!("{out}"))
                .map_err(|e| format!("{e:#}")),
            Command::Serve(args) => {
                let shutdown = CancellationToken::new();
                tokio::spawn(on_signal(shutdown.clone()));
                tally::serve::serve(args, shutdown)
                    .await
                    .map_err(|e| format!("{e:#}"))
            }
            Command::Promote(args) => {
                tally::promote::route_command(&args, tally::promote::Direction::Promote)
                    .await
                    .map(|out| print!("{out}"))
                    .map_err(|e| format!("{e:#}"))
            }
            Command::Demote(args) => {
                tally::promote::route_command(&args, tally::promote::Direction::Demote)
                    .await
                    .map(|out| print!("{out}"))
                    .map_err(|e| format!("{e:#}"))
            }
            Command::Plan(args) => tally::plan::report(&args)
                .map(|report| print!("{report}"))
                .map_err(|e| e.to_string()),
            Command::Rebuild(command) => {
                let config = settings(run_matches.expect("rebuild has settings"))?;
                let shutdown = CancellationToken::new();
                tokio::spawn(on_signal(shutdown.clone()));
                tally::rebuild::rebuild_command(config, command.rebuild, shutdown)
                    .await
                    .map(|out| print!("{out}"))
                    .map_err(|e| format!("{e:#}"))
            }
            Command::Verify(command) => {
                let config = settings(run_matches.expect("verify has settings"))?;
                let report = tally::verify::verify_command(config, command.verify)
                    .await
                    .map_err(|e| format!("{e:#}"))?;
                print!("{}", report.text);
                match report.drifted {
                    0 => Ok(()),
                    n => Err(format!("{n} posts differ from the topic")),
                }
            }
            Command::Gc(args) => tally::gc::gc_command(&args)
                .await
                .map(|out| print!("{out}"))
                .map_err(|e| format!("{e:#}")),
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

/// The settings of `tally run`: flags, variables and file, checked, with
/// their secrets read.
fn settings(matches: &clap::ArgMatches) -> Result<RunConfig, String> {
    let config = tally::config::load(matches).map_err(|problems| lines(&problems))?;
    let problems = config.problems();
    if !problems.is_empty() {
        return Err(lines(&problems));
    }
    config
        .resolve_secrets()
        .map_err(|problem| problem.to_string())
}

/// One problem per line; `main` prefixes the first with "error: ".
fn lines<T: ToString>(problems: &[T]) -> String {
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    lines.join("\nerror: ")
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
