//! `tally count`: posts' counts as a table or JSON, through the same
//! [`Reader`] `tally serve` uses (without its cache).

use std::fmt::Write as _;
use std::time::Duration;

use clap::{ArgMatches, Args};
use tally::read::Reader;

use crate::errors::Problems;
use crate::settings::StoreArgs;
use crate::settings::layers::ConfigArg;

/// Settings of `tally count`.
#[derive(Clone, Args)]
pub struct CountArgs {
    /// Posts to count.
    #[arg(required = true)]
    pub post_ids: Vec<u64>,
    /// Print JSON (one object per post, in a list) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also print the current generation's key prefix and every key summed.
    #[arg(long)]
    pub show_keys: bool,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The settings file it shares with `tally run`.
    #[command(flatten)]
    pub config: ConfigArg,
}

/// Runs `tally count`.
pub async fn count(args: &CountArgs, matches: &ArgMatches) -> anyhow::Result<()> {
    let store = args.config.layer(&args.store, matches).map_err(Problems)?;
    let store = store.settings().map_err(Problems)?;
    let (opened, record) = tally::domain::layout::open_for_reading(&store).await?;
    let reader = Reader::new(opened.store, opened.keys, record.buckets, Duration::ZERO);
    let counts = reader.counts(&args.post_ids).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&counts)?);
        return Ok(());
    }
    let mut out = format!("{:>20}  {:>14}\n", "post", "likes");
    for count in &counts {
        writeln!(out, "{:>20}  {:>14}", count.post_id, count.likes)?;
    }
    if args.show_keys {
        let (generation, _) = reader.layout().await?;
        for count in &counts {
            let (prefix, keys) = reader.summed_keys(count.post_id).await?;
            writeln!(
                out,
                "\npost {}: generation {generation}, prefix {prefix}, {} keys summed (plus the route hash's base):",
                count.post_id,
                keys.len()
            )?;
            for key in keys {
                writeln!(out, "  {key}")?;
            }
        }
    }
    print!("{out}");
    Ok(())
}
