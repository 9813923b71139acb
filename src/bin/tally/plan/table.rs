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

const LABEL: usize = 30;
const WIDTH: usize = 100;

fn row(out: &mut String, label: &str, value: &str, note: &str) {
    let line = format!("  {label:<LABEL$}{value:>12}  {note}");
    out.push_str(line.trim_end());
    out.push('\n');
}

/// `text` as a list item wrapped at [`WIDTH`], continuation lines indented.
fn item(out: &mut String, text: &str) {
    let mut line = String::from("  -");
    for word in text.split_whitespace() {
        if line.chars().count() + 1 + word.chars().count() > WIDTH {
            out.push_str(&line);
            out.push('\n');
            line = String::from("   ");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
}

/// Renders the plan: a heading, then Kafka, the hot post, Redis and the warnings.
pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    heading(&mut out, plan);
    kafka(&mut out, plan);
    hot_post(&mut out, plan);
    redis(&mut out, plan);
    busiest_primary(&mut out, plan);
    layouts(&mut out, plan);
    dedupe(&mut out, plan);
    windows(&mut out, plan);
    warnings(&mut out, &plan.warnings);
    out
}

/// The peak rates the plan is for.
fn heading(out: &mut String, plan: &Plan) {
    let _ = writeln!(
        out,
        "tally plan: {} events/s at the peak, {} on the hottest post",
        thousands(plan.inputs.peak_events),
        thousands(plan.inputs.hot_events)
    );
}

/// Consumers, partitions and the batches they close.
fn kafka(out: &mut String, plan: &Plan) {
    let (args, kafka) = (&plan.inputs, &plan.kafka);
    let n = thousands;
    let _ = writeln!(out, "\nKafka");
    let needed = format!(
        "{} needed ({} events/s each, {:.0}% free); {:.0}% busy",
        kafka.consumers_needed,
        n(args.consumer_events),
        args.headroom_pct,
        kafka.consumer_busy_pct
    );
    row(out, "consumers", &n(kafka.consumers.into()), &needed);
    let each = format!(
        "{} events/s and {:.1} batches/s each",
        n(kafka.events_per_partition),
        kafka.batches_per_partition
    );
    row(out, "partitions", &n(kafka.partitions.into()), &each);
    let most = "the most writes/s one bucket can get";
    row(
        out,
        "batches/s, all partitions",
        &n(kafka.batches_per_s),
        most,
    );
}

/// The hot post's buckets per like beside batched, then the buckets planned.
fn hot_post(out: &mut String, plan: &Plan) {
    let hot = &plan.hot_post;
    let n = thousands;
    let _ = writeln!(out, "\nHot post{:>36}  {:>12}", "per like", "batched");
    let (a, b) = (&hot.per_event, &hot.batched);
    let mut pair = |label: &str, x: String, y: String| row(out, label, &x, &format!("{y:>12}"));
    pair("buckets needed", n(a.buckets.into()), n(b.buckets.into()));
    pair(
        "writes/s, all buckets",
        n(a.writes_per_s),
        n(b.writes_per_s),
    );
    pair(
        "writes/s per bucket",
        n(a.writes_per_bucket),
        n(b.writes_per_bucket),
    );
    let (x, y) = (n(a.busiest_bucket_second), n(b.busiest_bucket_second));
    pair("busiest bucket, usual second", x, y);
    let worst = a.busiest_bucket_worst_second.map_or("–".into(), n);
    pair("busiest bucket, worst second", worst, "–".into());
    let _ = writeln!(
        out,
        "  (per like: {}; batched: {})",
        a.busiest_from, b.busiest_from
    );
    let planned = format!("{} writes/s each", n(hot.writes_per_bucket));
    row(out, "buckets planned", &n(hot.buckets.into()), &planned);
    let reads = n(hot.reads_per_uncached_view.into());
    row(out, "keys read per uncached count", &reads, "");
}

/// Primaries, the calls they serve, and the rule of thumb for the hot post's
/// buckets on each.
fn redis(out: &mut String, plan: &Plan) {
    let redis = &plan.redis;
    let n = thousands;
    let _ = writeln!(
        out,
        "\nRedis (slot map: {}; slot groups: {})",
        redis.slot_map, redis.slot_groups
    );
    row(out, "primaries", &n(redis.primaries.into()), "");
    let parts = format!(
        "{} increments + {} script calls",
        n(redis.increments_per_s),
        n(redis.script_calls_per_s)
    );
    row(out, "calls/s at the peak", &n(redis.ops_per_s), &parts);
    let share = format!("largest key share {:.1}%", redis.largest_share_pct);
    row(
        out,
        "calls/s per primary if even",
        &n(redis.mean_ops_per_primary),
        &share,
    );
    let s = &redis.buckets_per_primary;
    let mean = format!("{:.2}", s.mean);
    row(
        out,
        "hot buckets per primary",
        &mean,
        &format!("N/M, σ {:.2}", s.sigma),
    );
    let rule = format!("{:.2}", s.busiest_rule);
    let ops = format!("buckets, {} calls/s on that primary", n(s.busiest_rule_ops));
    row(out, "  busiest, mean + √(2 ln M)·σ", &rule, &ops);
}

/// The busiest primary over the random placements of the hot post's keys.
fn busiest_primary(out: &mut String, plan: &Plan) {
    let mc = &plan.redis.busiest_primary;
    let n = thousands;
    let posts = n(mc.posts.into());
    let _ = writeln!(
        out,
        "  over {posts} random posts (CRC16 slots of their real keys):"
    );
    let keys = n(mc.p99_hot_buckets.into());
    row(out, "  fullest primary, p99", &keys, "hot buckets");
    row(out, "  busiest primary, p50", &n(mc.p50_ops), "calls/s");
    let cap = n(plan.inputs.primary_capacity);
    let pct = format!("calls/s, {:.0}% of {cap}", mc.p99_pct_capacity);
    row(out, "  busiest primary, p99", &n(mc.p99_ops), &pct);
    row(out, "  busiest primary, worst", &n(mc.max_ops), "calls/s");
}

/// Bytes in decimal units, as memory is priced: 1.6e8 → "160 MB".
pub fn bytes(value: f64) -> String {
    let units = [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")];
    match units.iter().find(|(size, _)| value >= *size) {
        Some((size, unit)) if value / size < 10.0 => format!("{:.1} {unit}", value / size),
        Some((size, unit)) => format!("{:.0} {unit}", value / size),
        None => format!("{value:.0} B"),
    }
}

/// A duration in the largest unit that keeps it above one: 1,020 → "17 min".
pub fn duration(seconds: f64) -> String {
    let units = [(86_400.0, "d"), (3_600.0, "h"), (60.0, "min")];
    match units.iter().find(|(size, _)| seconds >= *size) {
        Some((size, unit)) if seconds / size < 10.0 => format!("{:.1} {unit}", seconds / size),
        Some((size, unit)) => format!("{:.0} {unit}", seconds / size),
        None if seconds < 10.0 => format!("{seconds:.1} s"),
        None => format!("{seconds:.0} s"),
    }
}

/// The dedupe window's memory, reach and re-read, when one is priced.
fn dedupe(out: &mut String, plan: &Plan) {
    let Some(d) = &plan.dedupe else {
        return;
    };
    let (args, kafka) = (&plan.inputs, &plan.kafka);
    let n = thousands;
    let _ = writeln!(
        out,
        "\nDedupe window ({} offsets a partition)",
        n(d.window as f64)
    );
    let at = format!(
        "at the peak, {} events/s a partition",
        n(kafka.events_per_partition)
    );
    row(out, "covers", &duration(d.covers_seconds), &at);
    let each = format!("{:.0} bytes a remembered event", d.bytes_per_event);
    row(
        out,
        "memory a partition",
        &bytes(d.bytes_per_partition),
        &each,
    );
    let share = format!("{} partitions", d.partitions_per_consumer);
    row(
        out,
        "memory a consumer",
        &bytes(d.bytes_per_consumer),
        &share,
    );
    let reread = n(args.reread_events.unwrap_or(args.consumer_events));
    let rate = format!("a partition, at {reread} records/s (ids; twice with ids-and-actions)");
    let (one, all) = (d.reread_partition_seconds, d.reread_consumer_seconds);
    row(out, "re-read at assignment", &duration(one), &rate);
    let whole = format!("a consumer's {} partitions", d.partitions_per_consumer);
    row(out, "", &duration(all), &whole);
}

/// Both layouts' memory and write load, and the one to take, when priced.
fn layouts(out: &mut String, plan: &Plan) {
    let Some(l) = &plan.layouts else {
        return;
    };
    let n = thousands;
    let budget = match l.budget_bytes {
        Some(b) => format!(", within {}", bytes(b)),
        None => String::new(),
    };
    match l.per_million {
        true => {
            let _ = writeln!(
                out,
                "\nCounters (a million of them; --counters N prices yours)"
            );
        }
        false => {
            let _ = writeln!(out, "\nCounters ({}{budget})", n(l.counters));
        }
    }
    for price in [&l.strings, &l.packed] {
        let fits = match (l.budget_bytes, price.fits) {
            (None, _) => "",
            (Some(_), true) => ", fits",
            (Some(_), false) => ", over budget",
        };
        let note = format!(
            "{:.1} B a counter; writes {} calls/s' worth{fits}",
            price.bytes_per_counter,
            n(price.write_load_ops)
        );
        row(out, price.layout, &bytes(price.memory_bytes), &note);
    }
    item(out, &l.verdict);
}

/// The windows' memory, size by size, when priced.
fn windows(out: &mut String, plan: &Plan) {
    let Some(w) = &plan.windows else {
        return;
    };
    let n = thousands;
    let _ = writeln!(
        out,
        "\nWindows ({:.0} B a post in a window, up to 4,000 leaders at {:.0} B; kept {} past their window)",
        w.member_bytes,
        super::windows::LEADER_BYTES,
        w.retention
    );
    for size in &w.sizes {
        let note = format!(
            "{} posts a window, {} windows alive",
            n(size.posts),
            size.sets_alive
        );
        row(out, &size.window, &bytes(size.memory_bytes), &note);
    }
    row(out, "total", &bytes(w.memory_bytes), "before replicas");
}

/// The warnings as a list, or "none".
fn warnings(out: &mut String, warnings: &[String]) {
    let _ = writeln!(out, "\nWarnings");
    if warnings.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for warning in warnings {
        item(out, warning);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_warnings_read_well() {
        assert_eq!(thousands(14_000.4), "14,000");
        assert_eq!(thousands(999.6), "1,000");
        assert_eq!(thousands(10_000_000.0), "10,000,000");
        assert_eq!(thousands(-1_234.0), "-1,234");
        assert_eq!(bytes(1.6e8), "160 MB");
        assert_eq!(bytes(2.5e9), "2.5 GB");
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(duration(1_020.0), "17 min");
        assert_eq!(duration(4.0 * 86_400.0), "4.0 d");
        assert_eq!(duration(6.9), "6.9 s");
        let mut out = String::new();
        item(&mut out, &"word ".repeat(60));
        assert!(out.lines().count() > 2);
        assert!(out.lines().all(|l| l.chars().count() <= WIDTH), "{out}");
        assert_eq!(out.split_whitespace().filter(|w| *w == "word").count(), 60);
    }
}
