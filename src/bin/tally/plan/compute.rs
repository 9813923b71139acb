//! Builds a [`Plan`] from its settings.

use super::model::{
    batched_buckets_needed, batched_busiest_second, batched_writes_per_bucket,
    batches_per_partition, busiest_bucket_seconds, busiest_primary_loads, hot_post_slots,
    keys_needed, percentile, slot_group_shares,
};
use super::{
    HotPost, Kafka, MonteCarlo, Plan, PlanArgs, Redis, SCRIPT_CALLS, Sizing, Spread, validate,
};
use tally::domain::placement::{SlotMap, binomial, busiest, busiest_rule};
use tally::domain::routing::KeyLayout;
use tally::domain::slots::SlotGroups;
use tally::infra::config::{ConfigError, DEFAULT_BATCH_MAX_EVENTS, DEFAULT_BATCH_MAX_KEYS};

/// Likes simulated for the per-like bucket check: fewer one-second windows for hotter posts.
const SIMULATED_LIKES: f64 = 2_000_000.0;
/// Above this many likes/s, one simulated second costs too long; the rule of thumb stands in.
const MAX_SIMULATED_RATE: f64 = 20_000_000.0;

/// Peak load the plan spreads over primaries.
struct Load {
    /// Increments/s of every post but the hot one.
    other: f64,
    /// Distinct counters in one partition batch.
    counters_per_batch: f64,
    /// Batches/s across all partitions.
    batches: f64,
    /// The hot post's buckets and batched writes/s per bucket.
    buckets: u32,
    per_bucket: f64,
}

impl Load {
    /// The load at the peak, from the Kafka side and the hot post's buckets.
    fn at_peak(args: &PlanArgs, kafka: &Kafka, hot_post: &HotPost) -> Self {
        let ratio = args.increments_per_event;
        Load {
            other: (args.peak_events - args.hot_events) * ratio,
            counters_per_batch: kafka.events_per_partition / kafka.batches_per_partition * ratio,
            batches: kafka.batches_per_s,
            buckets: hot_post.buckets,
            per_bucket: hot_post.writes_per_bucket,
        }
    }

    /// Script overhead calls/s: one script per slot group a batch touches,
    /// G·(1 − (1 − 1/G)^c) groups for c counters.
    fn script_calls(&self, groups: u32) -> f64 {
        let g = f64::from(groups);
        let counters = self.counters_per_batch.max(1.0) + f64::from(self.buckets);
        let touched = g * -(counters * (-1.0 / g).ln_1p()).exp_m1();
        self.batches * touched * SCRIPT_CALLS
    }

    fn hot(&self) -> f64 {
        self.per_bucket * f64::from(self.buckets)
    }
}

/// Makes the plan; `live` is a slot map read from Redis, if any.
pub fn plan(args: &PlanArgs, live: Option<SlotMap>) -> Result<Plan, ConfigError> {
    validate(args)?;
    let kafka = kafka(args);
    let hot_post = hot_post(args, kafka.batches_per_s);
    let load = Load::at_peak(args, &kafka, &hot_post);
    let redis = match live {
        Some(map) => place(args, &load, map, "live", &mut Placements::default()),
        None => even_split(args, &load),
    };
    let warnings = super::warn::warnings(args, &kafka, &hot_post, &redis);
    let dedupe = super::dedupe::dedupe(args, &kafka);
    let layouts = super::layout::layouts(args, &redis);
    let windows = super::windows::windows(args)?;
    Ok(Plan {
        inputs: args.clone(),
        kafka,
        hot_post,
        redis,
        dedupe,
        layouts,
        windows,
        warnings,
    })
}

/// The share of a consumer's or a primary's capacity the peak may use: all
/// but the headroom.
fn usable(args: &PlanArgs) -> f64 {
    1.0 - args.headroom_pct / 100.0
}

/// Consumers for the peak, their partitions, and the batches those close.
fn kafka(args: &PlanArgs) -> Kafka {
    let peak = args.peak_events;
    let consumers_needed = keys_needed(peak, args.consumer_events * usable(args));
    let consumers = args.consumers.unwrap_or(consumers_needed);
    let partitions = args
        .partitions
        .unwrap_or(consumers.saturating_mul(args.partitions_per_consumer));
    let per_partition = peak / f64::from(partitions);
    let closes = batches_per_partition(
        per_partition,
        args.flush_interval_ms,
        args.increments_per_event,
        DEFAULT_BATCH_MAX_EVENTS,
        DEFAULT_BATCH_MAX_KEYS,
    );
    Kafka {
        consumers_needed,
        consumers,
        consumer_busy_pct: 100.0 * peak / (f64::from(consumers) * args.consumer_events),
        partitions,
        events_per_partition: per_partition,
        batches_per_partition: closes,
        batches_per_s: closes * f64::from(partitions),
    }
}

/// The hot post's buckets, one increment per like and batched over `batches`
/// batches/s, and the buckets planned.
fn hot_post(args: &PlanArgs, batches: f64) -> HotPost {
    let hot = args.hot_events;
    let per_like = keys_needed(hot, args.safe_key_rate);
    let needed = batched_buckets_needed(hot, batches, args.safe_key_rate, args.key_cap, per_like);
    let buckets = args.buckets.unwrap_or(needed);
    HotPost {
        events_per_s: hot,
        per_event: per_like_sizing(hot, per_like, args.seed),
        batched: batched_sizing(hot, needed, batches),
        buckets,
        writes_per_bucket: batched_writes_per_bucket(hot, buckets, batches),
        reads_per_uncached_view: buckets,
    }
}

/// Redis on an even split of the slots: the primaries given, or else the
/// fewest whose p99 busiest load stays within the headroom, counting up from
/// one server if it carries the load, else from what the mean load needs.
/// Counters occupy one slot per slot group, so primaries beyond the groups
/// would spread nothing further.
fn even_split(args: &PlanArgs, load: &Load) -> Redis {
    let target = args.primary_capacity * usable(args);
    let single = load.other + load.hot() + load.script_calls(1);
    let cluster = load.other + load.hot() + load.script_calls(args.store.slot_groups);
    let most = args.store.slot_groups.max(2);
    let mut m = match args.primaries {
        Some(m) => m,
        None if single <= target => 1,
        None => keys_needed(cluster, target).clamp(2, most),
    };
    let mut placements = Placements::default();
    loop {
        let map = SlotMap::even(m as usize);
        let redis = place(args, load, map, "even split", &mut placements);
        if args.primaries.is_some() || redis.busiest_primary.p99_ops <= target || m >= most {
            return redis;
        }
        m += 1;
    }
}

fn per_like_sizing(hot: f64, buckets: u32, seed: u64) -> Sizing {
    let n = f64::from(buckets);
    let (typical, worst, from) = if hot <= MAX_SIMULATED_RATE {
        let seconds = (SIMULATED_LIKES / hot).clamp(1.0, 200.0) as u32;
        let busiest = busiest_bucket_seconds(hot.round() as u64, buckets, seconds, seed);
        let typical = busiest.iter().map(|&b| f64::from(b)).sum::<f64>() / f64::from(seconds);
        let worst = busiest.iter().copied().max().map(f64::from);
        (typical, worst, format!("simulated, {seconds} s"))
    } else {
        let (mean, sigma) = (hot / n, (hot / n * (1.0 - 1.0 / n)).sqrt());
        let rule = busiest(mean, sigma, buckets as usize);
        (rule, None, "mean + sqrt(2 ln N)·σ".into())
    };
    Sizing {
        buckets,
        writes_per_s: hot,
        writes_per_bucket: hot / n,
        busiest_bucket_second: typical,
        busiest_bucket_worst_second: worst,
        busiest_from: from,
    }
}

fn batched_sizing(hot: f64, buckets: u32, batches: f64) -> Sizing {
    let per_bucket = batched_writes_per_bucket(hot, buckets, batches);
    Sizing {
        buckets,
        writes_per_s: per_bucket * f64::from(buckets),
        writes_per_bucket: per_bucket,
        busiest_bucket_second: batched_busiest_second(hot, buckets, batches),
        busiest_bucket_worst_second: None,
        busiest_from: "mean + sqrt(2 ln N)·σ".into(),
    }
}

/// A key layout's slot groups and the slots of the hot post's keys in each
/// trial, built once per layout however many primary counts are tried.
type Layout = (SlotGroups, Vec<Vec<(u16, u32)>>);

#[derive(Default)]
struct Placements {
    single: Option<Layout>,
    cluster: Option<Layout>,
}

fn place(
    args: &PlanArgs,
    load: &Load,
    map: SlotMap,
    source: &str,
    placements: &mut Placements,
) -> Redis {
    let m = map.primary_count();
    let cached = if m > 1 {
        &mut placements.cluster
    } else {
        &mut placements.single
    };
    let (groups, slots) = cached.get_or_insert_with(|| {
        let groups = if m > 1 {
            SlotGroups::cluster(args.store.slot_groups)
        } else {
            SlotGroups::single()
        };
        let layout = KeyLayout::with_groups(&args.store.prefix, groups.clone());
        let slots = hot_post_slots(&layout, load.buckets, args.trials, args.seed);
        (groups, slots)
    });
    let script_calls = load.script_calls(groups.count());
    let background = load.other + script_calls;
    let shares = slot_group_shares(&map, groups);
    let (loads, most) = busiest_primary_loads(&map, &shares, background, load.per_bucket, slots);
    let ops = background + load.hot();
    let (mean, sigma) = binomial(load.buckets, m);
    let rule = busiest_rule(load.buckets, m);
    let p99 = percentile(&loads, 99.0);
    Redis {
        primaries: m as u32,
        slot_map: source.into(),
        slot_groups: groups.count(),
        ops_per_s: ops,
        increments_per_s: load.other + load.hot(),
        script_calls_per_s: script_calls,
        mean_ops_per_primary: ops / m as f64,
        largest_share_pct: 100.0 * shares.iter().copied().fold(0.0, f64::max),
        buckets_per_primary: Spread {
            mean,
            sigma,
            busiest_rule: rule,
            busiest_rule_ops: background / m as f64 + rule * load.per_bucket,
        },
        busiest_primary: MonteCarlo {
            posts: args.trials,
            p50_ops: percentile(&loads, 50.0),
            p99_ops: p99,
            max_ops: loads.last().copied().unwrap_or_default(),
            p99_hot_buckets: percentile(&most, 99.0),
            p99_pct_capacity: 100.0 * p99 / args.primary_capacity,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::super::MEASURED_BYTES_PER_EVENT;
    use super::*;
    use crate::settings::parse_flags;

    /// The plan for a `tally plan` command line (flags only).
    fn plan_of(flags: &str) -> Plan {
        let flags: Vec<&str> = flags.split_whitespace().collect();
        plan(&parse_flags::<PlanArgs>(&flags).unwrap(), None).unwrap()
    }

    fn warns(plan: &Plan, words: &str) -> bool {
        plan.warnings.iter().any(|w| w.contains(words))
    }

    #[test]
    fn the_viral_reel_needs_twenty_keys_per_like_and_one_batched() {
        let plan = plan_of("--peak-events 120000 --hot-events 14000");
        let hot = &plan.hot_post;
        assert_eq!(hot.per_event.buckets, 20);
        assert_eq!(hot.per_event.writes_per_bucket, 700.0);
        // 2 consumers, 4 partitions, 10 batches/s each: a bucket gets 40 writes/s at most.
        assert_eq!((plan.kafka.consumers, plan.kafka.partitions), (2, 4));
        assert_eq!(plan.kafka.batches_per_s, 40.0);
        assert_eq!(hot.batched.buckets, 1);
        assert!(hot.batched.writes_per_s <= 40.0 && hot.batched.writes_per_s > 39.0);
        assert_eq!(plan.redis.primaries, 1);
        assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
    }

    #[test]
    fn a_posts_share_sizes_its_keys_at_the_cap_and_a_quarter_of_it() {
        let keys = |safe: &str| {
            let flags = format!("--peak-events 20000 --hot-events 1651 --safe-key-rate {safe}");
            plan_of(&flags).hot_post.per_event.buckets
        };
        assert_eq!((keys("1000"), keys("250")), (2, 7));
    }

    #[test]
    fn the_busiest_primary_sits_above_the_mean_and_within_capacity() {
        let plan = plan_of("--peak-events 3000000 --hot-events 200000 --trials 500");
        let (redis, mc) = (&plan.redis, &plan.redis.busiest_primary);
        assert!(redis.primaries > 1);
        assert!(mc.p50_ops >= redis.mean_ops_per_primary, "{redis:?}");
        assert!(mc.p50_ops <= mc.p99_ops && mc.p99_ops <= mc.max_ops);
        assert!(mc.p99_ops <= 70_000.0, "the headroom holds: {}", mc.p99_ops);
        assert!((mc.p99_pct_capacity - mc.p99_ops / 1_000.0).abs() < 1e-9);
        let fewer =
            plan_of("--peak-events 3000000 --hot-events 200000 --trials 500 --primaries 20");
        assert!(fewer.redis.busiest_primary.p99_ops > mc.p99_ops);
        assert!(warns(&fewer, "busiest of 20 primaries"));
    }

    #[test]
    fn too_few_buckets_and_too_many_reads_are_flagged() {
        let app = "--peak-events 10000000 --hot-events 800000 --trials 100";
        let few = plan_of(&format!("{app} --buckets 100"));
        assert!(few.hot_post.writes_per_bucket > 700.0);
        assert!(warns(&few, "too few for the hot post"));
        let many = plan_of(app);
        assert!(many.hot_post.buckets > 64);
        assert!(warns(&many, "key reads per uncached count"));
        // 18,000 likes/s over 20 keys: the unluckiest key crosses a 1,000/s cap.
        let skewed = plan_of("--hot-events 18000 --safe-key-rate 900");
        assert_eq!(skewed.hot_post.per_event.buckets, 20);
        assert!(warns(&skewed, "too few for the skew"));
    }

    #[test]
    fn bad_settings_name_their_flag() {
        let error = |flags: &[&str]| plan(&parse_flags(flags).unwrap(), None).unwrap_err().flag;
        assert_eq!(error(&["--hot-events", "300000"]), "hot-events");
        assert_eq!(error(&["--slot-groups", "100"]), "slot-groups");
        assert_eq!(error(&["--dedupe-window", "0"]), "dedupe-window");
        assert_eq!(error(&["--dedupe-window", "100000001"]), "dedupe-window");
        assert_eq!(error(&["--reread-events", "0"]), "reread-events");
    }

    #[test]
    fn the_dedupe_window_is_priced_only_when_asked() {
        assert!(
            plan_of("--peak-events 120000 --hot-events 14000")
                .dedupe
                .is_none()
        );
        // 4 partitions of 30,000 events/s, 2 each for 2 consumers.
        let flags = "--peak-events 120000 --hot-events 14000 --dedupe-window 1000000";
        let d = plan_of(flags).dedupe.expect("priced");
        assert_eq!(d.bytes_per_event, MEASURED_BYTES_PER_EVENT);
        assert_eq!(d.bytes_per_partition, 1e6 * MEASURED_BYTES_PER_EVENT);
        assert_eq!(d.partitions_per_consumer, 2);
        assert_eq!(d.bytes_per_consumer, 2.0 * d.bytes_per_partition);
        assert!((d.covers_seconds - 1e6 / 30_000.0).abs() < 1e-9);
        // Re-read at the consumer's measured rate unless told otherwise.
        assert!((d.reread_partition_seconds - 1e6 / 145_000.0).abs() < 1e-9);
        assert!((d.reread_consumer_seconds - 2e6 / 145_000.0).abs() < 1e-9);
        let faster = plan_of(&format!(
            "{flags} --reread-events 500000 --dedupe-bytes 100"
        ));
        let f = faster.dedupe.expect("priced");
        assert_eq!(
            (f.reread_partition_seconds, f.bytes_per_partition),
            (2.0, 1e8)
        );
        // An uneven share: 5 partitions over 2 consumers, so one owns 3.
        let uneven = plan_of(&format!("{flags} --partitions 5"));
        assert_eq!(uneven.dedupe.expect("priced").partitions_per_consumer, 3);
        let table = super::super::table::render(&plan_of(flags));
        assert!(
            table.contains("Dedupe window (1,000,000 offsets a partition)"),
            "{table}"
        );
        assert!(table.contains("23 MB"), "{table}");
    }

    #[test]
    fn docs_show_what_the_planner_prints_now() {
        let doc = include_str!("../../../../docs/sizing.md");
        for flags in [
            "--peak-events 120000 --hot-events 14000",
            "--peak-events 10000000 --hot-events 800000",
            "--peak-events 10000000 --hot-events 800000 --flush-interval-ms 300",
        ] {
            let printed = format!(
                "$ tally plan {flags}\n{}",
                super::super::table::render(&plan_of(flags))
            );
            assert!(
                doc.contains(&printed),
                "docs/sizing.md is stale for `tally plan {flags}`"
            );
        }
        // The dedupe example shows its own section only.
        let table = super::super::table::render(&plan_of(
            "--peak-events 120000 --hot-events 14000 --dedupe-window 1000000",
        ));
        let at = table.find("Dedupe window").expect("a dedupe section");
        let section = &table[at..table.find("\nWarnings").expect("warnings")];
        assert!(
            doc.contains(section),
            "docs/sizing.md is stale for the dedupe window:\n{section}"
        );
        // So does the windows example.
        let table = super::super::table::render(&plan_of(
            "--peak-events 120000 --hot-events 14000 --window-posts 1h=2000000 --window-posts 1d=10000000",
        ));
        let at = table.find("Windows (").expect("a windows section");
        let section = &table[at..table.find("\nWarnings").expect("warnings")];
        assert!(
            doc.contains(section),
            "docs/sizing.md is stale for the windows:\n{section}"
        );
        // So does the layouts example.
        let table = super::super::table::render(&plan_of(
            "--peak-events 120000 --hot-events 14000 --counters 1000000000 --memory-budget-gb 64",
        ));
        let at = table.find("Counters (").expect("a counters section");
        let section = &table[at..table.find("\nWarnings").expect("warnings")];
        assert!(
            doc.contains(section),
            "docs/sizing.md is stale for the layouts:\n{section}"
        );
    }
}
