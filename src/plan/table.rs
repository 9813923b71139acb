//! The plan as an aligned table for a terminal.

use std::fmt::Write as _;

use super::Plan;

/// A whole number with thousands separators: 14000.4 → "14,000".
pub fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if value < -0.5 { format!("-{out}") } else { out }
}

const LABEL: usize = 34;

fn row(out: &mut String, label: &str, value: &str, note: &str) {
    let line = format!("  {label:<LABEL$}{value:>12}  {note}");
    out.push_str(line.trim_end());
    out.push('\n');
}

fn pair(out: &mut String, label: &str, per_like: &str, batched: &str) {
    let _ = writeln!(out, "  {label:<LABEL$}{per_like:>12}  {batched:>12}");
}

/// Renders the plan.
pub fn render(plan: &Plan) -> String {
    let (args, kafka, hot, redis) = (&plan.inputs, &plan.kafka, &plan.hot_post, &plan.redis);
    let n = thousands;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tally plan: {} events/s at the peak, {} on the hottest post\n\nKafka",
        n(args.peak_events),
        n(args.hot_events)
    );
    let needed = format!(
        "{} needed at {} events/s each with {:.0}% free; {:.0}% busy",
        kafka.consumers_needed,
        n(args.consumer_events),
        args.headroom_pct,
        kafka.consumer_busy_pct
    );
    row(&mut out, "consumers", &n(kafka.consumers.into()), &needed);
    let each = format!(
        "{} events/s and {:.1} batches/s each",
        n(kafka.events_per_partition),
        kafka.batches_per_partition
    );
    row(&mut out, "partitions", &n(kafka.partitions.into()), &each);
    let most = "the most writes/s one bucket can get";
    row(
        &mut out,
        "batches/s, all partitions",
        &n(kafka.batches_per_s),
        most,
    );

    let _ = writeln!(out, "\nHot post{:>40}  {:>12}", "per like", "batched");
    let (a, b) = (&hot.per_event, &hot.batched);
    pair(
        &mut out,
        "buckets needed",
        &n(a.buckets.into()),
        &n(b.buckets.into()),
    );
    pair(
        &mut out,
        "writes/s, all buckets",
        &n(a.writes_per_s),
        &n(b.writes_per_s),
    );
    pair(
        &mut out,
        "writes/s per bucket",
        &n(a.writes_per_bucket),
        &n(b.writes_per_bucket),
    );
    let (x, y) = (n(a.busiest_bucket_second), n(b.busiest_bucket_second));
    pair(&mut out, "busiest bucket, typical second", &x, &y);
    let worst = a.busiest_bucket_worst_second.map_or("–".into(), n);
    pair(&mut out, "busiest bucket, worst second", &worst, "–");
    let _ = writeln!(
        out,
        "  (per like: {}; batched: {})",
        a.busiest_from, b.busiest_from
    );
    let planned = format!(
        "{} writes/s each; keys read per uncached count: {}",
        n(hot.writes_per_bucket),
        hot.reads_per_uncached_view
    );
    row(
        &mut out,
        "buckets planned",
        &n(hot.buckets.into()),
        &planned,
    );

    let _ = writeln!(
        out,
        "\nRedis (slot map: {}; slot groups: {})",
        redis.slot_map, redis.slot_groups
    );
    row(&mut out, "primaries", &n(redis.primaries.into()), "");
    let parts = format!(
        "{} increments + {} script calls",
        n(redis.increments_per_s),
        n(redis.script_calls_per_s)
    );
    row(&mut out, "calls/s at the peak", &n(redis.ops_per_s), &parts);
    let share = format!("largest key share {:.1}%", redis.largest_share_pct);
    row(
        &mut out,
        "calls/s per primary, even",
        &n(redis.mean_ops_per_primary),
        &share,
    );
    let s = &redis.buckets_per_primary;
    let spread = format!(
        "mean {:.2}, σ {:.2}, mean + sqrt(2 ln M)·σ = {:.2} buckets",
        s.mean, s.sigma, s.busiest_rule
    );
    row(&mut out, "hot buckets per primary", "", &spread);
    let rule = "calls/s on the busiest primary by that rule";
    row(&mut out, "", &n(s.busiest_rule_ops), rule);
    let mc = &redis.busiest_primary;
    let label = format!("busiest primary, {} random posts", n(mc.posts.into()));
    let _ = writeln!(out, "  {label}");
    row(&mut out, "  p50", &n(mc.p50_ops), "calls/s");
    let pct = format!(
        "calls/s, {:.0}% of {} per primary",
        mc.p99_pct_capacity,
        n(args.primary_capacity)
    );
    row(&mut out, "  p99", &n(mc.p99_ops), &pct);
    row(&mut out, "  worst", &n(mc.max_ops), "calls/s");
    let keys = "of the hot post's buckets on its fullest primary";
    row(
        &mut out,
        "  p99 hot buckets",
        &n(mc.p99_hot_buckets.into()),
        keys,
    );

    let _ = writeln!(out, "\nWarnings");
    if plan.warnings.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for warning in &plan.warnings {
        let _ = writeln!(out, "  - {warning}");
    }
    out
}
