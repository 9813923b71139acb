//! `tally run`, `tally config print` and `tally docs`: the service itself,
//! its settings, and the tables the documentation publishes.

use std::fmt::Write as _;
use std::io::Write as _;

use clap::{ArgMatches, Subcommand};

use crate::errors::Problems;
use crate::settings::{self, RunArgs, run_settings};
use crate::signal::shutdown_on_signal;

/// `tally config ...`.
#[derive(Subcommand)]
pub enum ConfigCommand {
    /// Print the effective settings (flags > TALLY_* variables > --config file > defaults)
    /// as a file --config accepts, secrets masked; problems go to stderr.
    Print(Box<RunArgs>),
}

/// `tally docs ...`.
#[derive(Subcommand)]
pub enum Docs {
    /// The stable hash's test vectors, as docs/design.md's markdown table.
    HashVectors,
    /// Every setting of `tally run`, as docs/settings.md's markdown table.
    Config,
    /// Every metric tally exports, as docs/operations.md's markdown table.
    Metrics,
    /// The Redis ACL rule of every command, as docs/security.md's markdown tables.
    Acl,
    /// A completion script for a shell, from the command line's definition: e.g.
    /// `tally docs completions bash > /usr/share/bash-completion/completions/tally`.
    Completions {
        /// The shell to complete in.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The manual page tally(1), in roff: e.g. `tally docs man | man -l -`.
    Man {
        /// Write tally.1 and a page for each command (tally-run.1, ...) into this directory
        /// instead of tally.1 to stdout.
        #[arg(long, value_name = "DIR")]
        out_dir: Option<std::path::PathBuf>,
    },
}

/// `tally run`: serves the probes when asked, then counts until a signal.
pub async fn run(matches: &ArgMatches) -> anyhow::Result<()> {
    let settings = run_settings(matches)?;
    let shutdown = shutdown_on_signal();
    if let Some(addr) = settings.metrics_addr {
        let metrics = tally::infra::metrics::install()?;
        tally::infra::http::serve_probes(addr, metrics, shutdown.clone())
            .await
            .map_err(|e| anyhow::anyhow!("{e} (fix --metrics-addr)"))?;
        tally::infra::health::spawn_probes(
            settings.store.url().target().clone(),
            settings.kafka.client_config(),
            settings.kafka.topic.clone(),
            shutdown.clone(),
        );
    }
    tally::pipeline::run::run(settings, shutdown).await?;
    Ok(())
}

/// `tally config print`: the effective settings on stdout, problems after them.
pub fn print_config(matches: &ArgMatches) -> anyhow::Result<()> {
    let args = settings::load(matches).map_err(Problems)?;
    print!("{}", settings::show::print(&args));
    args.settings().map_err(Problems)?;
    Ok(())
}

/// `tally docs ...`, where `cli` is the command line's definition that the
/// completions and manual pages are rendered from.
pub fn docs(docs: Docs, cli: clap::Command) -> anyhow::Result<()> {
    match docs {
        Docs::HashVectors => print!("{}", hash_vectors_table()),
        Docs::Config => print!("{}", settings::show::settings_table()),
        Docs::Metrics => print!("{}", metrics_table()),
        Docs::Acl => print!("{}", crate::acl::table()),
        Docs::Completions { shell } => std::io::stdout().write_all(&completions(shell, cli))?,
        Docs::Man { out_dir: None } => std::io::stdout().write_all(&man_page(cli)?)?,
        Docs::Man { out_dir: Some(dir) } => clap_mangen::generate_to(cli, &dir).map_err(|e| {
            anyhow::anyhow!("cannot write the manual pages to {}: {e}", dir.display())
        })?,
    }
    Ok(())
}

/// The completion script of `shell` for every command and flag of `cli`.
pub fn completions(shell: clap_complete::Shell, mut cli: clap::Command) -> Vec<u8> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cli, "tally", &mut script);
    script
}

/// tally(1) from `cli`: the commands, the global flags, the version.
pub fn man_page(cli: clap::Command) -> std::io::Result<Vec<u8>> {
    let mut page = Vec::new();
    clap_mangen::Man::new(cli).render(&mut page)?;
    Ok(page)
}

/// docs/operations.md's table of metrics, printed by `tally docs metrics`.
fn metrics_table() -> String {
    use tally::infra::metrics::{ALL, Kind};
    let mut table = String::from("| metric | kind | meaning |\n|---|---|---|\n");
    for &(name, kind, help) in ALL {
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        let _ = writeln!(table, "| `{name}` | {kind} | {help} |");
    }
    table
}

/// docs/design.md's table of stable-hash test vectors, printed by `tally docs hash-vectors`.
fn hash_vectors_table() -> String {
    let mut table =
        String::from("| user_id | XXH64 | bucket, N=16 | bucket, N=1024 |\n|---:|---|---:|---:|\n");
    for user in tally::domain::routing::PUBLISHED_USERS {
        let _ = writeln!(
            table,
            "| {user} | `{:#018x}` | {} | {} |",
            tally::domain::routing::stable_hash(user),
            tally::domain::routing::bucket_of(user, 16),
            tally::domain::routing::bucket_of(user, 1024)
        );
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_design_document_publishes_the_generated_table() {
        let design = include_str!("../../../docs/design.md");
        assert!(
            design.contains(&hash_vectors_table()),
            "docs/design.md's hash table is stale; regenerate it with `tally docs hash-vectors`"
        );
    }

    #[test]
    fn the_operations_document_lists_every_metric() {
        let operations = include_str!("../../../docs/operations.md");
        assert!(
            operations.contains(&metrics_table()),
            "docs/operations.md's metrics table is stale; regenerate it with `tally docs metrics`"
        );
    }
}
