//! Inspect: where a post's bucket keys live, and whether placement luck
//! overloads a primary.
//!
//! For each bucket key of every routing version of a post: its hash slot, the primary that owns the
//! slot now, and its value. Per primary: how many buckets it holds against
//! the Binomial(N, 1/M) expectation (mean N/M, σ = sqrt(N·(1/M)·(1−1/M))),
//! flagging primaries above mean + 2σ for the newest version (the maths and the slot map are in
//! [`tally::domain::placement`]). A single server is one primary that holds everything.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use redis::ConnectionLike;
use tally::domain::layout::{OpenStore, Record};
use tally::domain::placement::{SlotMap, binomial};
use tally::domain::routing::{CounterId, DEFAULT_EPOCHS, KeyLayout, version_name};
use tally::domain::slots::key_slot;
use tally::domain::versions::{DEFAULT_FIELD, PostMeta, read_defaults};
use tally::infra::config::StoreSettings;
use tally::infra::store::connect_blocking;

use crate::errors::Problems;
use crate::settings::StoreArgs;
use crate::settings::layers::ConfigArg;

/// `tally inspect ...`.
#[derive(Subcommand)]
pub enum Inspect {
    /// A post's bucket keys: slot, owning primary, value, and placement against Binomial(N, 1/M).
    Post(InspectPost),
}

/// Settings of `tally inspect post`.
#[derive(Clone, Args)]
pub struct InspectPost {
    /// The post to inspect.
    pub post_id: u64,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The settings file it shares with `tally run`.
    #[command(flatten)]
    pub config: ConfigArg,
}

/// Runs `tally inspect`.
pub async fn inspect(inspect: Inspect, matches: &clap::ArgMatches) -> Result<()> {
    let Inspect::Post(args) = inspect;
    let matches = matches.subcommand_matches("post").unwrap_or(matches);
    let store = args.config.layer(&args.store, matches).map_err(Problems)?;
    let settings = store.settings().map_err(Problems)?;
    let (opened, record) = tally::domain::layout::open_for_reading(&settings).await?;
    let report = tokio::task::block_in_place(|| inspect_post(&args, &opened, &settings, &record))?;
    print!("{report}");
    Ok(())
}

/// Renders the report for one post.
fn inspect_post(
    args: &InspectPost,
    opened: &OpenStore,
    settings: &StoreSettings,
    record: &Record,
) -> Result<String> {
    let target = settings.url().target();
    let map = SlotMap::read(target).context("reading the slot map")?;
    let mut conn = connect_blocking(target, Duration::from_secs(3))
        .with_context(|| format!("cannot reach Redis at {}", settings.url().shown()))?;
    let pointer =
        tally::domain::generation::read_pointer_blocking(conn.as_mut(), settings.prefix())?;
    if let Some(backwards) = pointer.backwards(settings.prefix()) {
        tally::domain::generation::report_backwards(&backwards);
    }
    let current = pointer.current;
    let keys = record.generation_keys(&opened.keys, current);
    let fields: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.route_key(args.post_id))
        .query(conn.as_mut())?;
    let entry: Option<String> = redis::cmd("HGET")
        .arg(keys.registry_key())
        .arg(DEFAULT_FIELD)
        .query(conn.as_mut())?;
    let defaults = read_defaults(&keys.registry_key(), entry.as_deref(), record.buckets)?;
    let meta = PostMeta::from_fields(&keys.route_key(args.post_id), &fields, &defaults)?;
    let mut out = String::new();
    writeln!(
        out,
        "post {} — {} over {} primaries (mode {}, current version {})",
        args.post_id,
        meta.versions
            .iter()
            .map(|&(v, n)| {
                let s = if n == 1 { "" } else { "s" };
                format!("{}: {n} bucket{s}", version_name(v))
            })
            .collect::<Vec<_>>()
            .join(", "),
        map.primary_count(),
        meta.mode.as_deref().unwrap_or("default"),
        meta.current.unwrap_or(0),
    )?;
    let per_primary = key_table(&mut out, conn.as_mut(), &map, &keys, args.post_id, &meta)?;
    placement_table(&mut out, &map, &meta, &per_primary)?;
    Ok(out)
}

/// One line per bucket key of every version, then the count; returns the
/// buckets per primary of the newest version, the one taking new likes.
fn key_table(
    out: &mut String,
    conn: &mut dyn ConnectionLike,
    map: &SlotMap,
    keys: &KeyLayout,
    post_id: u64,
    meta: &PostMeta,
) -> Result<Vec<u32>> {
    writeln!(
        out,
        "{:>7}  {:>6}  {:>5}  {:<21}  {:>10}  key",
        "version", "bucket", "slot", "primary", "value"
    )?;
    let mut total = meta.base;
    let mut per_primary = vec![0u32; map.primary_count()];
    for &(version, buckets) in &meta.versions {
        per_primary.iter_mut().for_each(|n| *n = 0);
        for bucket in 0..buckets {
            let id = CounterId {
                post_id,
                version,
                bucket,
            };
            // A growing generation's hashes: where the group's split state
            // says now.
            let splits = match keys.is_growing() {
                true => {
                    let (level, next): (Option<u32>, Option<u32>) = redis::cmd("HMGET")
                        .arg(keys.splits_key(keys.group_of(id)))
                        .arg("level")
                        .arg("next")
                        .query(conn)?;
                    tally::domain::packing::Splits {
                        level: level.unwrap_or(0),
                        next: next.unwrap_or(0),
                    }
                }
                false => Default::default(),
            };
            let place = keys.place_at(id, splits);
            let key = place.shown();
            let slot = key_slot(place.key.as_bytes());
            let owner = map.owner_of(slot);
            if let Some(primary) = owner {
                per_primary[primary] += 1;
            }
            let owner = owner.map_or("(unassigned)", |p| map.primaries()[p].as_str());
            let value: Option<i64> = match &place.field {
                None => redis::cmd("GET").arg(&place.key).query(conn)?,
                Some(field) => redis::cmd("HGET").arg(&place.key).arg(field).query(conn)?,
            };
            total += value.unwrap_or(0);
            let version = match version.checked_sub(DEFAULT_EPOCHS) {
                Some(epoch) if epoch > 0 => format!("d{epoch}"),
                _ => version.to_string(),
            };
            writeln!(
                out,
                "{version:>7}  {bucket:>6}  {slot:>5}  {owner:<21}  {:>10}  {key}",
                value.unwrap_or(0)
            )?;
        }
    }
    if meta.base != 0 {
        writeln!(out, "base {}", meta.base)?;
    }
    writeln!(out, "count {total}")?;
    Ok(per_primary)
}

/// The newest version's buckets per primary against Binomial(N, 1/M).
fn placement_table(
    out: &mut String,
    map: &SlotMap,
    meta: &PostMeta,
    per_primary: &[u32],
) -> Result<()> {
    let &(version, buckets) = meta.versions.last().expect("version 0 at least");
    let (mean, sigma) = binomial(buckets, map.primary_count());
    writeln!(
        out,
        "version {version} per primary (Binomial mean {mean:.2}, σ {sigma:.2}, flag above {:.2}):",
        mean + 2.0 * sigma
    )?;
    for (primary, &n) in map.primaries().iter().zip(per_primary) {
        let flag = if f64::from(n) > mean + 2.0 * sigma {
            "  <- above mean + 2σ"
        } else {
            ""
        };
        writeln!(out, "  {primary:<21} {n:>4}{flag}")?;
    }
    Ok(())
}
