//! The `tally` command: parses flags, picks a log filter, hands the command
//! to the module of its group, and prints the error that stopped it, or the
//! panic of a background task (see [`tally::infra::tasks`]), which ends the
//! command as well.

use std::process::ExitCode;

use clap::{ArgMatches, CommandFactory, FromArgMatches};

use cli::{Cli, Command};

mod acl;
mod cli;
mod errors;
mod inspect;
mod logs;
mod ops;
mod plan;
mod progress;
mod reads;
mod run;
mod serve;
mod settings;
mod signal;

/// jemalloc, for Rust's allocations and, through its unprefixed `malloc` and `free`, for
/// librdkafka's. librdkafka allocates each fetched message on its fetch thread and the readers
/// free it on theirs; glibc's allocator takes an arena lock for every such free, and on a
/// backlog of 3,000,000 events its `malloc`, `free` and the futex waits behind them were about a
/// sixth of the process's CPU. jemalloc's thread caches take frees from any thread.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    logs::init(cli.log_format, cli.command.log_filter());
    tracing::debug!(
        version = env!("CARGO_PKG_VERSION"),
        revision = env!("TALLY_GIT_REVISION"),
        "Starting."
    );
    // Redis TLS (rediss://) uses rustls with the ring provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    tally::infra::tasks::install_panic_hook();
    if let Some(task) = &cli.test_panic_task {
        tally::infra::tasks::inject_panic(task);
    }
    let result = tokio::runtime::Runtime::new()
        .map_err(|e| anyhow::anyhow!("cannot start the async runtime: {e}"))
        .and_then(|runtime| {
            runtime.block_on(async {
                tokio::select! {
                    result = dispatch(cli.command, &matches) => result,
                    failure = tally::infra::tasks::failed() => Err(failure.into()),
                }
            })
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", errors::line(&error));
            if error.is::<ops::Incomplete>() {
                ExitCode::from(ops::VERIFY_INCOMPLETE)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Runs one command. `matches` are the parsed flags, which every command
/// that touches Redis layers with variables and a file.
async fn dispatch(command: Command, matches: &ArgMatches) -> anyhow::Result<()> {
    let (_, sub) = matches.subcommand().expect("clap requires a subcommand");
    match command {
        Command::Run(_) => run::run(sub).await,
        Command::Config(run::ConfigCommand::Print(_)) => {
            run::print_config(sub.subcommand_matches("print").expect("print has settings"))
        }
        Command::Docs(docs) => run::docs(docs, Cli::command()),
        Command::Inspect(inspect) => inspect::inspect(inspect, sub).await,
        Command::Count(args) => reads::count(&args, sub).await,
        Command::Top(args) => reads::top(&args, sub).await,
        Command::Serve(args) => serve::serve(args, sub).await,
        Command::Promote(args) => {
            ops::route(&args, tally::ops::promote::Direction::Promote, sub).await
        }
        Command::Demote(args) => {
            ops::route(&args, tally::ops::promote::Direction::Demote, sub).await
        }
        Command::Rebucket(args) => ops::rebucket(&args, sub).await,
        Command::UnfreezeRouting(command) => ops::unfreeze_routing(sub, &command).await,
        Command::Plan(args) => {
            print!("{}", plan::report(&args)?);
            Ok(())
        }
        Command::Rebuild(command) => ops::rebuild(sub, &command).await,
        Command::Verify(command) => ops::verify(sub, &command).await,
        Command::Gc(args) => ops::gc(&args, sub).await,
        Command::ResetFences(command) => ops::reset_fences(sub, &command).await,
    }
}
