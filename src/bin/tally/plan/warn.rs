//! What a plan should warn about, in words that name the flag to change.

use super::table::thousands;
use super::{HotPost, Kafka, PlanArgs, Redis, keys_needed};

/// Every problem the plan shows, most urgent first.
pub fn warnings(args: &PlanArgs, kafka: &Kafka, hot: &HotPost, redis: &Redis) -> Vec<String> {
    let mut out = Vec::new();
    kafka_warnings(&mut out, args, kafka);
    bucket_warnings(&mut out, args, kafka, hot);
    redis_warnings(&mut out, args, redis);
    out
}

/// Too few consumers for the peak, or too few partitions for the consumers.
fn kafka_warnings(out: &mut Vec<String>, args: &PlanArgs, kafka: &Kafka) {
    if kafka.consumers < kafka.consumers_needed {
        out.push(format!(
            "{} consumers run {:.0}% busy at the peak; {} keep {:.0}% free (--consumers).",
            kafka.consumers, kafka.consumer_busy_pct, kafka.consumers_needed, args.headroom_pct
        ));
    }
    if kafka.partitions < kafka.consumers {
        out.push(format!(
            "{} partitions leave {} of {} consumers idle (--partitions).",
            kafka.partitions,
            kafka.consumers - kafka.partitions,
            kafka.consumers
        ));
    }
}

/// The hot post's buckets: too few for its writes, batched or not, or so many
/// that an uncached count reads too many keys.
fn bucket_warnings(out: &mut Vec<String>, args: &PlanArgs, kafka: &Kafka, hot: &HotPost) {
    if hot.buckets < hot.batched.buckets {
        out.push(format!(
            "{} buckets are too few for the hot post: each takes {} writes/s, above {}/s per key; \
             it needs {} (--buckets).",
            hot.buckets,
            thousands(hot.writes_per_bucket),
            thousands(args.safe_key_rate),
            hot.batched.buckets
        ));
    }
    if let Some(worst) = hot.per_event.busiest_bucket_worst_second
        && worst > args.key_cap
    {
        out.push(format!(
            "Without batching, {} buckets are too few for the skew: the busiest took {} likes in \
             one simulated second, above the {}/s cap (--safe-key-rate).",
            hot.per_event.buckets,
            thousands(worst),
            thousands(args.key_cap)
        ));
    }
    if hot.buckets > args.max_read_keys {
        let mut text = format!(
            "{} buckets cost {} key reads per uncached count, above --max-read-keys {}; \
             keep the count cached.",
            hot.buckets, hot.buckets, args.max_read_keys
        );
        // Batches this old keep a single bucket within the safe rate.
        let ms = (1000.0 * f64::from(kafka.partitions) / args.safe_key_rate).ceil();
        if ms > args.flush_interval_ms as f64 {
            text += &format!(
                " Batches of {ms:.0} ms or more (--flush-interval-ms) would need one bucket."
            );
        }
        out.push(text);
    }
}

/// The primaries: the busiest past the headroom, keys spread unevenly over
/// them, more planned than the mean needs, or more than can hold counters.
fn redis_warnings(out: &mut Vec<String>, args: &PlanArgs, redis: &Redis) {
    let free = 100.0 - args.headroom_pct;
    let p99 = redis.busiest_primary.p99_pct_capacity;
    if p99 > free {
        out.push(format!(
            "In 1% of placements the busiest of {} primaries runs at {:.0}% of capacity, \
             above the {:.0}% the headroom allows (--primaries, --slot-groups).",
            redis.primaries, p99, free
        ));
    }
    let even = 100.0 / f64::from(redis.primaries);
    if redis.slot_groups > 1 && redis.largest_share_pct > 1.2 * even {
        out.push(format!(
            "{} slot groups over {} primaries: one primary owns {:.1}% of the keys against an even \
             {:.1}%. A primary count that divides the groups spreads evenly; more groups spread \
             finer at one more script per group in every batch.",
            redis.slot_groups, redis.primaries, redis.largest_share_pct, even
        ));
    }
    let for_mean = keys_needed(redis.ops_per_s, args.primary_capacity * free / 100.0);
    if args.primaries.is_none()
        && !args.live
        && redis.slot_groups > 1
        && f64::from(redis.primaries) > 1.1 * f64::from(for_mean)
    {
        out.push(format!(
            "A slot group carries {} calls/s and a primary owns whole groups, so {} primaries are \
             planned where {} would carry the mean. More --slot-groups spread finer but add a \
             script per group to every batch; a longer --flush-interval-ms means fewer of both.",
            thousands(redis.ops_per_s / f64::from(redis.slot_groups)),
            redis.primaries,
            for_mean
        ));
    }
    if redis.primaries > redis.slot_groups && redis.slot_groups > 1 {
        out.push(format!(
            "Only {} of {} primaries can hold counters: keys occupy one slot per slot group.",
            redis.slot_groups, redis.primaries
        ));
    }
}
