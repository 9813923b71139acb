//! `tally count` and `tally top`: posts' counts, and the posts with the most
//! likes in a window, as a table or JSON, through the same [`Reader`]
//! `tally serve` uses (without its cache).

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

/// Settings of `tally top`.
#[derive(Clone, Args)]
pub struct TopArgs {
    /// The window's size, one the prefix keeps (`tally run --windows`), as 1m, 1h, 1d.
    #[arg(long)]
    pub window: String,
    /// Posts to list.
    #[arg(long, default_value_t = tally::domain::windows::DEFAULT_TOP_K)]
    pub limit: usize,
    /// An instant in the window (milliseconds since the epoch); unset: now.
    #[arg(long, value_name = "MS")]
    pub at: Option<i64>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The settings file it shares with `tally run`.
    #[command(flatten)]
    pub config: ConfigArg,
}

/// Runs `tally top`.
pub async fn top(args: &TopArgs, matches: &ArgMatches) -> anyhow::Result<()> {
    use tally::domain::windows::MAX_TOP_K;
    if !(1..=MAX_TOP_K).contains(&args.limit) {
        anyhow::bail!("--limit {} must be between 1 and {MAX_TOP_K}", args.limit);
    }
    let store = args.config.layer(&args.store, matches).map_err(Problems)?;
    let store = store.settings().map_err(Problems)?;
    let (opened, record) = tally::domain::layout::open_for_reading(&store).await?;
    let reader = Reader::new(opened.store, opened.keys, record.buckets, Duration::ZERO);
    let size = reader.window_size(&args.window)?;
    let list = reader.trending(size, args.at, args.limit).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    let mut out = format!(
        "window {} from {} to {} (ms since the epoch)\n{:>5}  {:>20}  {:>14}\n",
        list.window.window, list.window.start_ms, list.window.end_ms, "rank", "post", "likes"
    );
    for (rank, post) in list.posts.iter().enumerate() {
        writeln!(
            out,
            "{:>5}  {:>20}  {:>14}",
            rank + 1,
            post.post_id,
            post.likes
        )?;
    }
    print!("{out}");
    Ok(())
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
