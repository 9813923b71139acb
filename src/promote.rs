//! Promote: `tally promote` and `tally demote`, routing changes by hand.
//!
//! Both publish a new routing version through
//! [`crate::versions::Routes::publish`], the same path hot-post detection
//! takes, so they are safe while `tally run` counts: writers switch to the
//! new version for events stamped [`crate::versions::GRACE_MS`] after it, and
//! readers sum it from the moment it is reserved.

use anyhow::{Result, bail};
use clap::Args;

use crate::read::StoreArgs;
use crate::versions::{Published, Trigger};

/// Settings of `tally promote` and `tally demote`.
#[derive(Debug, Clone, Args)]
pub struct RouteArgs {
    /// The post.
    pub post_id: u64,
    /// Buckets of the new version (promote: default 64; demote: default --default-buckets).
    #[arg(long = "buckets", value_name = "N")]
    pub to_buckets: Option<u32>,
    /// Buckets of a post without routing metadata (what `tally run --buckets` says).
    #[arg(long, env = "TALLY_BUCKETS", default_value_t = crate::config::DEFAULT_BUCKETS)]
    pub default_buckets: u32,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
}

/// Whether the post gets more or fewer buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// More buckets.
    Promote,
    /// Fewer buckets.
    Demote,
}

/// Runs `tally promote` or `tally demote`; returns what to print.
pub async fn route_command(args: &RouteArgs, direction: Direction) -> Result<String> {
    let buckets = match (direction, args.to_buckets) {
        (_, Some(n)) => n,
        (Direction::Promote, None) => 64,
        (Direction::Demote, None) => args.default_buckets,
    };
    if buckets == 0 || buckets > 1 << 16 {
        bail!("--buckets must be between 1 and 65536");
    }
    let (store, base, _) = args.store.connect(args.default_buckets).await?;
    // Routing changes go to the generation writers use now.
    let keys = crate::generation::current_layout(&store, &base).await?;
    let routes = crate::versions::Routes::new(store, keys, args.default_buckets);
    let table = routes.fetch().await?;
    let latest = table.latest(args.post_id);
    match direction {
        Direction::Promote if buckets <= latest.buckets => bail!(
            "post {} already has {} buckets (version {}); promote to more, or demote",
            args.post_id,
            latest.buckets,
            latest.version
        ),
        Direction::Demote if buckets >= latest.buckets => bail!(
            "post {} has {} buckets (version {}); demote to fewer",
            args.post_id,
            latest.buckets,
            latest.version
        ),
        _ => {}
    }
    let Published { added, versions } = routes
        .publish(args.post_id, buckets, latest.version, Trigger::Manual)
        .await?;
    if !added {
        bail!(
            "post {} changed while publishing (another promotion won); run `tally inspect post {}`",
            args.post_id,
            args.post_id
        );
    }
    let newest = versions.last().expect("a published version");
    Ok(format!(
        "post {}: version {} with {} buckets, for events stamped from {} ms (in {:.1} s)\n",
        args.post_id,
        newest.version,
        newest.buckets,
        newest.effective_ms,
        (newest.effective_ms - table.now_ms()).max(0) as f64 / 1000.0
    ))
}
