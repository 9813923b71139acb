//! The operations on stored counts: `tally rebuild`, `verify`, `gc`,
//! `promote`, `demote`, `rebucket`, `unfreeze-routing` and `reset-fences`.
//! Each runs the library's operation and prints what it returned.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{ArgMatches, Args};
use tally::ops::gc::Collected;
use tally::ops::promote::{Change, Direction};
use tally::ops::rebuild::{Aborted, RebuildOptions};
use tally::ops::verify::{Report, VerifyOptions};

use crate::errors::Problems;
use crate::progress::Progress;
use crate::settings::layers::ConfigArg;
use crate::settings::{RegistryWaitArgs, RunArgs, StoreArgs, run_settings};
use crate::signal::shutdown_on_signal;

/// Settings of `tally promote` and `tally demote`.
#[derive(Clone, Args)]
pub struct RouteArgs {
    /// The post.
    pub post_id: u64,
    /// Buckets of the new version (promote: default 64; demote: default the prefix's
    /// current default bucket count).
    #[arg(long, value_name = "N")]
    pub to_buckets: Option<u32>,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The settings file it shares with `tally run`.
    #[command(flatten)]
    pub config: ConfigArg,
    /// Replicas the version waits for.
    #[command(flatten)]
    pub wait: RegistryWaitArgs,
}

/// Settings of `tally rebucket`.
#[derive(Clone, Args)]
pub struct RebucketArgs {
    /// The new default bucket count. Events stamped from 5 s after the change go to new
    /// keys with this many buckets; earlier ones keep theirs, and reads sum both.
    #[arg(long, value_name = "N")]
    pub to_buckets: u32,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The settings file it shares with `tally run`.
    #[command(flatten)]
    pub config: ConfigArg,
    /// Replicas the new epoch waits for.
    #[command(flatten)]
    pub wait: RegistryWaitArgs,
}

/// Settings of `tally gc`.
#[derive(Clone, Args)]
pub struct GcArgs {
    /// Remove older generations only once the current one has been current
    /// this long (seconds).
    #[arg(long, default_value_t = 3_600)]
    pub grace_secs: u64,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The settings file it shares with `tally run`.
    #[command(flatten)]
    pub config: ConfigArg,
}

/// Settings of `tally rebuild`: its own, and those it shares with `tally run`.
#[derive(Args)]
pub struct RebuildCommand {
    /// Start every partition at its first event stamped at or after this time
    /// (milliseconds since the epoch) instead of the earliest retained offset.
    #[arg(long, value_name = "MS")]
    pub from_timestamp: Option<i64>,
    /// Drop the unfinished generation (its keys and the rebuild record) and exit.
    /// Stop the rebuild first.
    #[arg(long)]
    pub abort: bool,
    /// Freeze the live pipelines once every partition is within this many
    /// offsets of the live fences.
    #[arg(long, default_value_t = 2_000, value_name = "OFFSETS")]
    pub cutover_margin: i64,
    /// Seconds between progress lines when stderr is not a terminal.
    #[arg(long, default_value_t = 5, value_name = "SECS")]
    pub progress_every_secs: u64,
    #[command(flatten)]
    run: RunArgs,
}

/// Settings of `tally verify`: its own, and those it shares with `tally run`.
#[derive(Args)]
#[command(after_help = VERIFY_EXIT_CODES)]
pub struct VerifyCommand {
    /// Check only these posts (comma separated); by default every post with
    /// an event or a counter.
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    pub posts: Vec<u64>,
    /// Recount only these partitions (comma separated); see docs/rebuild.md.
    #[arg(long, value_delimiter = ',', value_name = "PARTITIONS")]
    pub partitions: Vec<i32>,
    /// How many times to re-read while the fences keep moving.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    #[command(flatten)]
    run: RunArgs,
}

/// Settings of `tally reset-fences`: its own, and those it shares with `tally run`.
#[derive(Args)]
pub struct ResetFencesCommand {
    /// Reset without asking (otherwise the topic's name is asked for on a terminal).
    #[arg(long)]
    pub yes: bool,
    #[command(flatten)]
    run: RunArgs,
}

/// Settings of `tally unfreeze-routing`: those it shares with `tally run`.
#[derive(Args)]
#[command(after_help = UNFREEZE_HELP)]
pub struct UnfreezeCommand {
    #[command(flatten)]
    run: RunArgs,
}

/// What `tally unfreeze-routing` does, refuses and needs (its `--help`).
const UNFREEZE_HELP: &str = "\
On a Redis Cluster, an event stamped ahead of the clock makes routing final up to its time, so
that replays route it as it was counted; routing versions published before then take effect
only after it. One event stamped in 2099 holds `tally promote`, `demote` and `rebucket` (and
hot-post promotion) until 2099 (alert TallyRoutingFrozen). Fixing the producer's clock does
not undo that; this command does, while `tally run` counts:

  1. lowers the final time to 5 s from now, marked as under way;
  2. waits 7 s, until every writer has stopped routing by the old final time, then reads the
     end offset of every partition of the topic;
  3. records, per partition, the offsets up to there: the events among them stamped after the
     new final time keep the routes they were counted by, in `tally run`, in replays and in
     `tally rebuild`. Versions published while frozen take effect 5 s from now.

It refuses, and changes nothing, when routing is not frozen (final no more than 600 s ahead),
while a rebuild is under way, and when an event stamped more than 600 s ahead arrives during
the wait: a producer's clock is still wrong; fix it first (or set the topic's
message.timestamp.type=LogAppendTime). Give it the settings `tally run` uses (the brokers
for the end offsets; the layout is checked as at a start). See docs/operations.md#tallyroutingfrozen.";

/// `tally unfreeze-routing`.
pub async fn unfreeze_routing(matches: &ArgMatches, _command: &UnfreezeCommand) -> Result<()> {
    use tally::domain::versions::utc_text;
    let settings = run_settings(matches)?;
    let unfrozen = tally::ops::unfreeze::unfreeze(&settings, shutdown_on_signal(), &mut |begun| {
        println!(
            "routing is frozen until {}; unfreezing (waiting {} s for every writer)",
            utc_text(begun.undone_ms),
            begun.wait.as_secs()
        );
    })
    .await?;
    let cutoffs: Vec<String> = unfrozen
        .cutoffs
        .iter()
        .map(|(p, o)| format!("{p}:{o}"))
        .collect();
    println!(
        "generation {} ({}): routing is final up to {} (was {}); events stamped after {} at or below offsets {} keep their routes",
        unfrozen.generation,
        unfrozen.prefix,
        utc_text(unfrozen.final_ms),
        utc_text(unfrozen.undone_ms),
        utc_text(unfrozen.bound_ms),
        cutoffs.join(","),
    );
    println!(
        "{} versions published while frozen take effect in {:.1} s; a version published now takes effect in {:.1} s",
        unfrozen.moved,
        tally::domain::versions::GRACE_MS as f64 / 1000.0,
        unfrozen.versions_in_ms() as f64 / 1000.0
    );
    if unfrozen.replicated.short() {
        eprintln!(
            "warning: {} of {} Redis replicas acknowledged the unfreeze in time; a failover now may lose it",
            unfrozen.replicated.acked, unfrozen.replicated.wanted
        );
    }
    Ok(())
}

/// `tally reset-fences`.
pub async fn reset_fences(matches: &ArgMatches, command: &ResetFencesCommand) -> Result<()> {
    use std::io::{BufRead, IsTerminal};
    let settings = run_settings(matches)?;
    let plan = tally::ops::reset::plan(&settings).await?;
    let topic = &settings.kafka.topic;
    println!(
        "group {} on topic {topic}, generation {} ({}):",
        settings.kafka.group, plan.generation, plan.prefix
    );
    println!(
        "{:>9}  {:>14}  {:>12}  {:>12}  after the reset",
        "partition", "fence", "log start", "log end"
    );
    for p in &plan.partitions {
        println!(
            "{:>9}  {:>14}  {:>12}  {:>12}  counted from {}{}",
            p.partition,
            p.fence.map_or("-".to_string(), |f| f.to_string()),
            p.low,
            p.high,
            p.low,
            if p.ahead() {
                " (its fence is ahead of the log)"
            } else {
                ""
            }
        );
    }
    println!(
        "Every partition's log is counted again from its start, on top of the stored counts. Stop every `tally run` of the group first."
    );
    if !command.yes {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            bail!("refused: pass --yes to reset (standard input is not a terminal to confirm on)");
        }
        println!("Type the topic's name to reset its fences:");
        let mut answer = String::new();
        stdin.lock().read_line(&mut answer)?;
        if answer.trim() != topic {
            bail!("refused: the answer was not {topic}; nothing changed");
        }
    }
    let written = tally::ops::reset::reset(&settings, &plan).await?;
    println!(
        "reset {} partitions ({written} keys); start `tally run` again",
        plan.partitions.len()
    );
    Ok(())
}

/// `tally rebuild` (or `--abort`).
pub async fn rebuild(matches: &ArgMatches, command: &RebuildCommand) -> Result<()> {
    let settings = run_settings(matches)?;
    if command.abort {
        match tally::ops::rebuild::abort(&settings).await? {
            Aborted::NothingToAbort => println!("no unfinished rebuild"),
            Aborted::Dropped {
                generation,
                keys,
                kafka_group,
            } => println!(
                "dropped generation {generation} ({keys} keys); consumer groups {kafka_group} keep offsets nothing reads"
            ),
        }
        return Ok(());
    }
    let options = RebuildOptions {
        from_timestamp: command.from_timestamp,
        cutover_margin: command.cutover_margin,
    };
    let every = Duration::from_secs(command.progress_every_secs.max(1));
    let shutdown = shutdown_on_signal();
    if let Some(addr) = settings.metrics_addr {
        serve_progress(addr, &settings, shutdown.clone()).await?;
    }
    let mut progress: Option<Progress> = None;
    let outcome = tally::ops::rebuild::rebuild(settings, options, shutdown, &mut |at| {
        progress
            .get_or_insert_with(|| Progress::new(at.origins.to_vec(), every))
            .update(at.origins, at.rebuilt, at.marks)
    })
    .await;
    if let Some(progress) = &progress {
        progress.finish();
    }
    let rebuilt = outcome?;
    println!(
        "generation {} ({}) is current; generation {} stays until `tally gc`",
        rebuilt.generation, rebuilt.prefix, rebuilt.previous
    );
    Ok(())
}

/// Serves the rebuild's progress (`tally_rebuild_*`, and nothing of the pipeline that recounts)
/// on `/metrics`, with `/healthz` and `/readyz` as `tally run` serves them. An address that
/// cannot be listened on is a warning, not a refusal: a rebuild started inside a `tally run`
/// pod inherits its TALLY_METRICS_ADDR, whose port that process holds.
async fn serve_progress(
    addr: std::net::SocketAddr,
    settings: &tally::infra::config::RunSettings,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<()> {
    let metrics = tally::infra::metrics::install_only(&tally::infra::metrics::REBUILD_ONLY)?;
    match tally::infra::http::serve_probes(addr, metrics, shutdown.clone()).await {
        Ok(_) => {
            tally::infra::health::spawn_probes(
                settings.store.url().target().clone(),
                settings.kafka.client_config(),
                settings.kafka.topic.clone(),
                shutdown,
            );
        }
        Err(error) => tracing::warn!(
            %error,
            "No /metrics for this rebuild (give another --metrics-addr); rebuilding without it."
        ),
    }
    Ok(())
}

/// What `tally verify`'s exit code says (its `--help` shows this).
const VERIFY_EXIT_CODES: &str = "\
Exit codes:
  0  every post checked equals the recount of its events from each partition's origin to its fence
  1  posts differ from that recount, or verify could not run
  3  retention deleted offsets the counts hold: they are named, and the posts are checked against
     the events that remain (a difference may come from the deleted ones)";

/// `tally verify`'s exit code when retention deleted offsets it had to recount.
pub const VERIFY_INCOMPLETE: u8 = 3;

/// `tally verify` could not recount every offset the counts hold.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Incomplete(String);

/// `tally verify`: the drift table and a summary; fails when any post
/// drifted, and with [`Incomplete`] when part of the topic is gone.
pub async fn verify(matches: &ArgMatches, command: &VerifyCommand) -> Result<()> {
    let settings = run_settings(matches)?;
    let options = VerifyOptions {
        posts: command.posts.clone(),
        partitions: command.partitions.clone(),
        rounds: command.rounds,
    };
    let report = tally::ops::verify::verify(settings, options).await?;
    print!("{}", verify_text(&report));
    if !report.gone.is_empty() {
        let ranges: Vec<String> = report
            .gone
            .iter()
            .map(|g| format!("partition {} offsets {}..={}", g.partition, g.from, g.to))
            .collect();
        return Err(Incomplete(format!(
            "retention deleted offsets the counts hold, which cannot be verified: {}; {} posts differ from the events that remain",
            ranges.join(", "),
            report.drift.len()
        ))
        .into());
    }
    match (
        report.drift.len(),
        report.window_drift.len(),
        report.top_drift.len(),
    ) {
        (0, 0, 0) => Ok(()),
        (n, 0, 0) => bail!("{n} posts differ from the topic"),
        (n, w, t) => bail!(
            "{n} posts, {w} counts of a post in a window and {t} trending lists differ from the topic"
        ),
    }
}

/// The ranges gone from the log, the drift table (when there is drift) and
/// a summary line.
fn verify_text(report: &Report) -> String {
    let mut text = String::new();
    for g in &report.gone {
        let _ = writeln!(
            text,
            "partition {}: offsets {}..={} were counted and are gone from the log (retention); their events cannot be recounted",
            g.partition, g.from, g.to
        );
    }
    if !report.drift.is_empty() {
        if !report.gone.is_empty() {
            let _ = writeln!(
                text,
                "differences from the events that remain (the deleted ones may account for them):"
            );
        }
        let _ = writeln!(
            text,
            "{:>20}  {:>14}  {:>14}  {:>12}",
            "post", "expected", "stored", "difference"
        );
        for d in &report.drift {
            let _ = writeln!(
                text,
                "{:>20}  {:>14}  {:>14}  {:>+12}",
                d.post_id,
                d.expected,
                d.stored,
                d.stored - d.expected
            );
        }
    }
    if !report.window_drift.is_empty() {
        let _ = writeln!(
            text,
            "{:>6}  {:>14}  {:>20}  {:>14}  {:>14}",
            "window", "start (ms)", "post", "expected", "stored"
        );
        for d in &report.window_drift {
            let _ = writeln!(
                text,
                "{:>6}  {:>14}  {:>20}  {:>14}  {:>14}",
                d.size.to_string(),
                d.start,
                d.post_id,
                d.expected,
                d.stored
            );
        }
    }
    for (size, start) in &report.top_drift {
        let _ = writeln!(
            text,
            "window {size} from {start}: the trending list differs from the recount's leaders"
        );
    }
    let (compared, expired) = report.windows;
    if compared + expired > 0 {
        let _ = writeln!(
            text,
            "{compared} windows checked ({expired} expired, left out); {} counts of a post in a window and {} trending lists drift",
            report.window_drift.len(),
            report.top_drift.len()
        );
    }
    let _ = writeln!(
        text,
        "generation {} ({}): {} posts checked against {} events of {} partitions; {} drift",
        report.generation,
        report.prefix,
        report.posts,
        report.events,
        report.partitions,
        report.drift.len()
    );
    if let Some(other) = &report.other_rule {
        let _ = writeln!(
            text,
            "the prefix's writers judge repeats by '{}' ({}), this recount by '{}': repeats they judged otherwise are reported as drift; give verify the prefix's --dedupe and --dedupe-window to check what they counted",
            other.prefix, other.key, other.recount
        );
    }
    if report.dedupe_forgotten > 0 {
        let _ = writeln!(
            text,
            "the recount's dedupe windows dropped {} entries (keys crafted to share a slot, see tally_dedupe_forgotten_entries_total): repeats of the records they held may be judged otherwise than the live consumer judged them",
            report.dedupe_forgotten
        );
    }
    if !report.gone.is_empty() {
        let offsets: i64 = report.gone.iter().map(|g| g.to - g.from + 1).sum();
        let _ = writeln!(
            text,
            "{offsets} offsets counted earlier are gone from the log and were not verified"
        );
    }
    text
}

/// `tally gc`.
pub async fn gc(args: &GcArgs, matches: &ArgMatches) -> Result<()> {
    let store = args.config.layer(&args.store, matches).map_err(Problems)?;
    let store = store.settings().map_err(Problems)?;
    let grace = Duration::from_secs(args.grace_secs);
    match tally::ops::gc::gc(&store, grace).await? {
        Collected::NothingOlder => println!("generation 0 is current; nothing to remove"),
        Collected::TooRecent { current, age } => println!(
            "generation {current} became current {} s ago; older generations stay until the grace of {} s has passed",
            age.as_secs(),
            args.grace_secs
        ),
        Collected::Removed {
            current,
            age,
            deleted,
        } => println!(
            "removed {deleted} keys of generations below {current} (current for {} s)",
            age.as_secs()
        ),
    }
    Ok(())
}

/// `tally promote` and `tally demote`.
pub async fn route(args: &RouteArgs, direction: Direction, matches: &ArgMatches) -> Result<()> {
    let store = args.config.layer(&args.store, matches).map_err(Problems)?;
    let store = store.settings().map_err(Problems)?;
    let wait = args.config.layer(&args.wait, matches).map_err(Problems)?;
    let change = Change {
        post_id: args.post_id,
        direction,
        to_buckets: args.to_buckets,
        wait: wait.settings().map_err(|p| Problems(vec![p]))?,
    };
    let routed = tally::ops::promote::change_route(&store, change).await?;
    println!(
        "post {}: version {} with {} buckets, for events stamped from {} ms (in {:.1} s)",
        routed.post_id,
        routed.version,
        routed.buckets,
        routed.effective_ms,
        routed.effective_in_ms as f64 / 1000.0
    );
    Ok(())
}

/// `tally rebucket`.
pub async fn rebucket(args: &RebucketArgs, matches: &ArgMatches) -> Result<()> {
    let store = args.config.layer(&args.store, matches).map_err(Problems)?;
    let store = store.settings().map_err(Problems)?;
    let wait = args.config.layer(&args.wait, matches).map_err(Problems)?;
    let wait = wait.settings().map_err(|p| Problems(vec![p]))?;
    let change = tally::ops::promote::rebucket(&store, args.to_buckets, wait).await?;
    let newest = change.newest;
    if !change.added {
        println!(
            "the default bucket count is already {}; nothing changed",
            newest.buckets
        );
        return Ok(());
    }
    println!(
        "default bucket count {} -> {}, for events stamped from {} ms (in {:.1} s); {} epochs are summed by every read",
        change.from_buckets,
        newest.buckets,
        newest.effective_ms,
        change.effective_in_ms as f64 / 1000.0,
        change.epochs.len()
    );
    println!(
        "running consumers switch by themselves; start new ones with --buckets {} (another value is refused)",
        newest.buckets
    );
    Ok(())
}
