//! The command line: every command, its one-line help, and its log filter.

use clap::{Parser, Subcommand, ValueEnum};

use crate::{inspect, ops, plan, reads, run, serve, settings};

/// The release, from Cargo.toml, and the git revision it was built from
/// (build.rs; "unknown" outside a git checkout).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("TALLY_GIT_REVISION"),
    ")"
);

/// Exactly-once like counting from Kafka into Redis.
#[derive(Parser)]
#[command(version = VERSION, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// How log lines are written to stderr: text for people, json (one object a line) for a
    /// log shipper.
    #[arg(
        long,
        global = true,
        env = "TALLY_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,
    /// Testing only: the background task of this name panics when it first
    /// runs, so that supervision can be seen to end the process.
    #[arg(long, env = "TALLY_TEST_PANIC_TASK", hide = true)]
    pub test_panic_task: Option<String>,
}

#[derive(Subcommand)]
pub enum Command {
    /// Consume like events and apply them to Redis, exactly once.
    Run(Box<settings::RunArgs>),
    /// Show the settings `tally run` would use.
    #[command(subcommand)]
    Config(run::ConfigCommand),
    /// Print tables the documentation publishes.
    #[command(subcommand)]
    Docs(run::Docs),
    /// Show where stored state lives.
    #[command(subcommand)]
    Inspect(inspect::Inspect),
    /// Print posts' like counts, summed over every bucket and version.
    Count(reads::CountArgs),
    /// Print the posts with the most likes in a window of trending counts (tally run --windows).
    Top(reads::TopArgs),
    /// Serve counts over HTTP: GET /v1/posts/{id}/likes, /v1/likes?post_id=.. and /v1/trending?window=..
    Serve(serve::ServeArgs),
    /// Give a post more buckets now (a new routing version; safe while tally runs).
    Promote(ops::RouteArgs),
    /// Give a post fewer buckets (a new routing version; old keys stay summed).
    Demote(ops::RouteArgs),
    /// Change the default bucket count for new events of every post (safe while tally runs).
    Rebucket(ops::RebucketArgs),
    /// Undo routing frozen by an event stamped far ahead, so routing changes take effect again (safe while tally runs).
    UnfreezeRouting(Box<ops::UnfreezeCommand>),
    /// Size buckets, Redis primaries, Kafka partitions and consumers for a peak.
    Plan(Box<plan::PlanArgs>),
    /// Recount the topic into a new key generation and switch to it when caught up.
    Rebuild(Box<ops::RebuildCommand>),
    /// Recount the topic in memory and compare with the stored counts; exits 1 on drift, 3 when retention deleted part of it.
    Verify(Box<ops::VerifyCommand>),
    /// Remove key generations older than the current one, after a grace period.
    Gc(ops::GcArgs),
    /// Count a replaced log (topic recreated, broker back empty) from its start: resets its fences.
    ResetFences(Box<ops::ResetFencesCommand>),
}

impl Command {
    /// The log filter unless TALLY_LOG says otherwise: services log what
    /// they do, one-shot commands only what needs attention.
    pub fn log_filter(&self) -> &'static str {
        match self {
            Command::Run(_) | Command::Serve(_) | Command::Rebuild(_) => "info,rdkafka=warn",
            _ => "warn",
        }
    }
}

/// The format of log lines (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event, coloured on a terminal.
    Text,
    /// One JSON object per line: timestamp, level, target, message and the event's fields.
    Json,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::Cli;
    use crate::run::{completions, man_page};

    #[test]
    fn completions_render_for_every_shell() {
        use clap::ValueEnum as _;
        for &shell in clap_complete::Shell::value_variants() {
            let script = String::from_utf8(completions(shell, Cli::command())).unwrap();
            for word in ["tally", "rebucket", "log-format"] {
                assert!(script.contains(word), "{shell} completions lack {word}");
            }
        }
    }

    #[test]
    fn the_manual_page_renders() {
        let page = String::from_utf8(man_page(Cli::command()).unwrap()).unwrap();
        assert!(page.starts_with(".ie \\n(.g .ds Aq"), "not roff:\n{page}");
        assert!(page.contains(".TH tally 1"), "{page}");
        for word in ["rebucket", "log\\-format", env!("CARGO_PKG_VERSION")] {
            assert!(page.contains(word), "the page lacks {word}");
        }
        let dir = tempfile::tempdir().unwrap();
        clap_mangen::generate_to(Cli::command(), dir.path()).unwrap();
        for page in ["tally.1", "tally-run.1", "tally-docs-man.1"] {
            assert!(dir.path().join(page).exists(), "no {page}");
        }
    }
}
