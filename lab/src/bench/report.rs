//! The report: one Markdown table per workload, the machine and the exact
//! command, written between two markers of a file so the prose around it stays.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;

use super::hotkeys::HotKeys;
use super::services::store_version;
use super::tally_run::HOT_KEY_SECS;
use super::{BenchConfig, Env, Measured, Outcome, Variants};
use crate::markdown::{header, ratio, shell_line, thousands, today_utc};
use tally::infra::config::{DEFAULT_BUCKETS, DEFAULT_HOT_BUCKETS, DEFAULT_PROMOTE_ABOVE};

/// What bounds both consumers' backlog rates: each one's busiest thread
/// and the share of a core it used (a share near 100 % is a thread that
/// cannot go faster), and how busy the machine's cores were (near 100 %,
/// every process shares cores that cannot do more).
fn busiest(tally: &Measured, raw: &Measured) -> String {
    let mut out = String::new();
    if let (Some((tally_name, tally_share)), Some((raw_name, raw_share))) =
        (&tally.busiest_thread, &raw.busiest_thread)
    {
        out = format!(
            "; busiest thread while reading the backlog: tally's `{tally_name}` at {} of a core, \
             raw's `{raw_name}` at {}",
            percent(*tally_share),
            percent(*raw_share)
        );
    }
    if let (Some(tally_busy), Some(raw_busy)) = (tally.machine_busy, raw.machine_busy) {
        out += &format!(
            "; the machine's cores busy (every process) {} during tally's pass, {} during raw's",
            percent(tally_busy),
            percent(raw_busy)
        );
    }
    out
}

/// A share as a whole percentage.
fn percent(share: f64) -> String {
    format!("{:.0} %", share * 100.0)
}

fn row(out: &mut String, label: &str, m: &Measured, note: &str) -> std::fmt::Result {
    let dash = || "–".to_string();
    let calls = m.calls_per_event().map_or_else(dash, |c| format!("{c:.4}"));
    let writes = m
        .writes_per_event()
        .map_or_else(dash, |w| format!("{w:.3}"));
    let cpu = m.cpu_per_million().map_or_else(dash, |c| format!("{c:.2}"));
    let consumer = m
        .consumer_cpu_per_million()
        .map_or_else(dash, |c| format!("{c:.2}"));
    let broker = m
        .broker_cpu_per_million()
        .map_or_else(dash, |c| format!("{c:.2}"));
    let latency = m.latency.map_or_else(dash, |l| {
        format!(
            "{:.0} / {:.0} ms at {} events/s",
            l.p50_ms,
            l.p99_ms,
            thousands(l.reached_rate)
        )
    });
    let rss = m
        .rss_kib
        .map_or_else(dash, |k| format!("{:.0} MiB", k as f64 / 1024.0));
    let checked = m.checked.map_or_else(dash, |(n, wrong)| {
        if wrong == 0 {
            format!("{n} of {n} exact")
        } else {
            format!("**{wrong} of {n} wrong**")
        }
    });
    writeln!(
        out,
        "| {label}{note} | {} | {consumer} | {broker} | {calls} | {writes} | {cpu} | {latency} | {rss} | {checked} |",
        thousands(m.rate() as u64)
    )
}

/// librdkafka settings as `key=value, ...`.
fn key_values(settings: &[(String, String)]) -> String {
    let pairs: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.join(", ")
}

/// The report: what was run where, then one section per workload.
pub(super) fn render(config: &BenchConfig, env: &Env, outcomes: &[Outcome]) -> Result<String> {
    let redis_version = store_version(&env.redis)?;
    let mut out = String::new();
    setup(&mut out, config, &redis_version)?;
    if let Some((_, version)) = &env.valkey {
        writeln!(
            out,
            "The rows marked \"on Valkey\" read the same backlog into valkey-server {version} (no persistence), \
             started beside redis-server on the same machine."
        )?;
    }
    if config.streams_peer.is_none() {
        writeln!(out, "{}", super::streams::NOT_MEASURED)?;
    }
    for o in outcomes {
        workload(&mut out, config, o)?;
    }
    Ok(out)
}

/// The command line as a reader would repeat it.
fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // scripts/bench adds `--out docs/benchmarks.md` in front of its own arguments.
    match args.as_slice() {
        [bench, out, path, rest @ ..]
            if bench == "bench" && out == "--out" && path == "docs/benchmarks.md" =>
        {
            shell_line("scripts/bench", rest)
        }
        _ => shell_line("tally-lab", &args),
    }
}

/// The command, the machine, the client settings, the date and the services.
fn setup(out: &mut String, config: &BenchConfig, redis_version: &str) -> std::fmt::Result {
    header(out, &command_line())?;
    if !config.kafka_config.is_empty() {
        writeln!(
            out,
            "Every consumer (raw, naive and tally) was given `{}`.  ",
            key_values(&config.kafka_config)
        )?;
    }
    if let Some(cpus) = &config.cpus {
        writeln!(
            out,
            "Every measured consumer ran under `taskset -c {cpus}`; the broker, the stores and the producers had every core.  "
        )?;
    }
    if !config.producer_config.is_empty() {
        writeln!(
            out,
            "The workloads were produced with `{}` on top of the generator's defaults.  ",
            key_values(&config.producer_config)
        )?;
    }
    writeln!(
        out,
        "Date: {}. Services on the same machine: Apache Kafka {} (one KRaft node), redis-server {redis_version} \
         (no persistence), {} partitions per topic; tally's defaults: {} bucket(s) per post on a new prefix, \
         posts above {} events/s promoted to {} buckets.",
        today_utc(),
        crate::local::kafka_version(),
        config.partitions,
        DEFAULT_BUCKETS,
        DEFAULT_PROMOTE_ABOVE,
        DEFAULT_HOT_BUCKETS
    )
}

/// One workload's section: its backlog, the table, tally against the others,
/// and tally's own details.
fn workload(out: &mut String, config: &BenchConfig, o: &Outcome) -> std::fmt::Result {
    writeln!(out, "\n### {}\n", o.title)?;
    writeln!(
        out,
        "{} events in the backlog, produced at {} events/s (one idempotent producer thread).\n",
        thousands(o.events),
        thousands(o.produce_rate as u64)
    )?;
    table(out, config, o)?;
    comparison(out, o)?;
    tally_details(out, config, o)?;
    super::streams::report(out, config, o)?;
    super::kill::table(out, &config.tally_args, &o.killed)
}

/// The table of the four consumers.
fn table(out: &mut String, config: &BenchConfig, o: &Outcome) -> std::fmt::Result {
    writeln!(
        out,
        "| consumer | events/s | consumer CPU s / 1M events | broker CPU s / 1M events | Redis calls / event | counter writes / event | Redis CPU s / 1M events | produce→visible p50 / p99 | peak RSS | sampled counts |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---|---:|---|")?;
    row(out, "raw: receive + decode", &o.raw, "")?;
    let capped = |m: &Measured| {
        if m.complete {
            String::new()
        } else {
            format!(
                " (first {} events, {} s cap)",
                thousands(m.events),
                config.naive_max_secs
            )
        }
    };
    row(out, "naive: INCR per event", &o.naive, &capped(&o.naive))?;
    let label = "naive, pipelined per poll batch";
    row(out, label, &o.pipelined, &capped(&o.pipelined))?;
    let label_tally = if config.tally_args.is_empty() {
        "tally run (defaults)".to_string()
    } else {
        format!("tally run ({})", config.tally_args.join(" "))
    };
    row(out, &label_tally, &o.tally, "")?;
    if let Some(streams) = &o.streams {
        row(out, super::streams::LABEL, &streams.measured, "")?;
    }
    if let Some(variants) = &o.variants {
        for (pass, measured) in variants.defaults.iter().enumerate() {
            let label = format!(
                "{label_tally}, backlog only, beside the variants, pass {}",
                pass + 1
            );
            row(out, &label, measured, "")?;
        }
        for (args, passes) in &variants.runs {
            for (pass, measured) in passes.iter().enumerate() {
                let label = format!("tally run ({args}), backlog only, pass {}", pass + 1);
                row(out, &label, measured, "")?;
            }
        }
    }
    let (naive, tally) = &o.present;
    let label = "naive, pipelined per poll batch, counters present";
    row(out, label, naive, &capped(naive))?;
    let label = format!("{label_tally}, counters present, backlog only");
    row(out, &label, tally, "")?;
    if let Some((version, naive, tally)) = &o.valkey {
        let label = format!("naive, pipelined per poll batch, on Valkey {version}");
        row(out, &label, naive, &capped(naive))?;
        let label = format!("{label_tally}, on Valkey {version}, backlog only");
        row(out, &label, tally, "")?;
    }
    Ok(())
}

/// tally's reading rate against the raw consumer's: both timed from the
/// first message read to the last, so neither holds tally's start nor its
/// last scripts.
fn reading(tally: &Measured, raw: &Measured) -> String {
    match tally.reading_rate() {
        Some(rate) => format!(
            ", reading alone **{}** ({} messages/s, its first message read to its last, as the raw consumer is timed; \
             the events/s run from its assignment to its last script)",
            ratio(rate, raw.rate()),
            thousands(rate as u64),
        ),
        None => String::new(),
    }
}

/// Each variant against the naive pipelined consumer and against the
/// defaults' backlog passes beside it ([`Variants`]).
fn variant_ratios(
    out: &mut String,
    variants: &Variants,
    versus: &dyn Fn(&Measured, &Measured) -> String,
    pipelined: &Measured,
) -> std::fmt::Result {
    for (args, passes) in &variants.runs {
        writeln!(
            out,
            "tally ({args}) / naive pipelined, first pass: {}.  ",
            versus(&passes[0], pipelined)
        )?;
    }
    let [d1, d2] = &variants.defaults;
    for (args, passes) in &variants.runs {
        let [v1, v2] = passes;
        let mean = |f: fn(&Measured) -> Option<f64>, a: &Measured, b: &Measured| {
            Some((f(a)? + f(b)?) / 2.0)
        };
        let extra = match (
            mean(Measured::calls_per_event, v1, v2),
            mean(Measured::calls_per_event, d1, d2),
        ) {
            (Some(a), Some(b)) => format!("{:+.4}", a - b),
            _ => "–".into(),
        };
        let cpu = match (
            mean(Measured::consumer_cpu_per_million, v1, v2),
            mean(Measured::consumer_cpu_per_million, d1, d2),
        ) {
            (Some(a), Some(b)) => ratio(a, b),
            _ => "–".into(),
        };
        let busy = [d1, v1, v2, d2]
            .map(|m| m.machine_busy.map_or_else(|| "–".into(), percent))
            .join(", ");
        writeln!(
            out,
            "tally ({args}) / tally (defaults), on the same backlog, two passes each (defaults, variants, variants in reverse, defaults): \
             events/s **{}** (pass 1 {}, pass 2 {}), Redis calls per event {extra}, consumer CPU per event **{cpu}**; \
             the machine's cores busy (every process) {busy} (defaults pass 1, variant pass 1, variant pass 2, defaults pass 2).  ",
            ratio(variants.rate_ratio(passes), 1.0),
            ratio(v1.rate(), d1.rate()),
            ratio(v2.rate(), d2.rate()),
        )?;
    }
    Ok(())
}

/// tally's figures as multiples of the raw and the naive consumers'.
fn comparison(out: &mut String, o: &Outcome) -> std::fmt::Result {
    let versus = |tally: &Measured, naive: &Measured| {
        let fewer = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => ratio(a, b),
            _ => "–".into(),
        };
        format!(
            "events/s **{}**, Redis calls per event **{}** fewer, counter writes per event **{}** fewer, Redis CPU per event **{}** less",
            ratio(tally.rate(), naive.rate()),
            fewer(naive.calls_per_event(), tally.calls_per_event()),
            fewer(naive.writes_per_event(), tally.writes_per_event()),
            fewer(naive.cpu_per_million(), tally.cpu_per_million()),
        )
    };
    writeln!(
        out,
        "\ntally / raw: events/s **{}**{}{}.  \ntally / naive: {}.  \ntally / naive pipelined: {}.  ",
        ratio(o.tally.rate(), o.raw.rate()),
        reading(&o.tally, &o.raw),
        busiest(&o.tally, &o.raw),
        versus(&o.tally, &o.naive),
        versus(&o.tally, &o.pipelined),
    )?;
    if let Some(variants) = &o.variants {
        variant_ratios(out, variants, &versus, &o.pipelined)?;
    }
    if let Some((version, naive, tally)) = &o.valkey {
        writeln!(
            out,
            "On Valkey {version}, tally / naive pipelined: {}.  ",
            versus(tally, naive)
        )?;
    }
    let (naive, tally) = &o.present;
    writeln!(
        out,
        "Counters present, tally / naive pipelined: {}.  ",
        versus(tally, naive)
    )?;
    let created = |m: &Measured| {
        m.keys_created_per_event()
            .map_or_else(|| "–".into(), |k| format!("{k:.4}"))
    };
    writeln!(
        out,
        "Keys created per event while reading the backlog (`DBSIZE` after, less before): naive pipelined {}, tally {}; \
         with the counters present {} and {}.",
        created(&o.pipelined),
        created(&o.tally),
        created(naive),
        created(tally)
    )
}

/// tally's Redis calls by command and how its latency was measured, when known.
fn tally_details(out: &mut String, config: &BenchConfig, o: &Outcome) -> std::fmt::Result {
    if let Some((calls, _)) = &o.tally.redis {
        let parts: Vec<String> = calls
            .iter()
            .take(4)
            .map(|(name, n)| format!("{name} {:.4}", *n as f64 / o.tally.events.max(1) as f64))
            .collect();
        writeln!(
            out,
            "tally's Redis calls per event, by command (script-internal calls included): {}.",
            parts.join(", ")
        )?;
    }
    if let Some(l) = o.tally.latency {
        writeln!(
            out,
            "Latency: {} marker likes over {} s while producing at a target of {} events/s \
             ({} × the lower of tally's Zipf backlog rate and the producer's Zipf backlog rate).",
            l.samples,
            config.latency_secs,
            thousands(l.target_rate),
            config.latency_load
        )?;
        let slowest: Vec<String> = l
            .slowest
            .iter()
            .filter(|(_, ms)| ms.is_finite())
            .map(|(at, ms)| format!("{ms:.0} ms sent at {at:.2} s"))
            .collect();
        writeln!(
            out,
            "Slowest marker likes (sent at: seconds after the first marker): {}.",
            slowest.join(", ")
        )?;
        if let Some(busy) = l.busy {
            writeln!(
                out,
                "The machine's cores were busy (every process: producer, broker, store, tally) \
                 {} of the phase.",
                percent(busy)
            )?;
        }
    }
    if !o.tally.stages.is_empty() {
        let parts: Vec<String> = o
            .tally
            .stages
            .iter()
            .map(|f| format!("{} {:.0} / {:.0} ms", f.stage, f.p50_ms, f.p99_ms))
            .collect();
        writeln!(
            out,
            "Where the time goes (tally_stage_seconds during the latency phase, one sample per batch, p50 / p99): {}.",
            parts.join(", ")
        )?;
    }
    hot_keys(out, o)?;
    if let Some(latency) = o.tally.latency {
        let rate = latency.target_rate;
        super::scale::table(out, &o.shape, rate, &o.tally, config.partitions, &o.fleet)?;
    }
    Ok(())
}

/// The busiest key and primary of the viral workload, naive against tally.
fn hot_keys(out: &mut String, o: &Outcome) -> std::fmt::Result {
    let (Some(hot), Some(latency)) = (&o.tally.hot, o.tally.latency) else {
        return Ok(());
    };
    let rate = latency.reached_rate as f64;
    let naive = HotKeys::naive(rate, o.shape.viral_share);
    writeln!(
        out,
        "\nWrites at {} events/s, the latency phase's rate ({} s of it for tally, every command Redis ran listed by `MONITOR`; \
         a 3-primary cluster's share computed from each key's slot under tally's slot groups):\n",
        thousands(rate as u64),
        HOT_KEY_SECS
    )?;
    writeln!(
        out,
        "| writer | busiest key, writes/s | busiest of 3 primaries, writes/s | counter writes/s in all |"
    )?;
    writeln!(out, "|---|---:|---:|---:|")?;
    let line = |label: &str, h: &HotKeys| {
        format!(
            "| {label} | {} | {} | {} |",
            thousands(h.key_rate.round() as u64),
            thousands(h.busiest_primary().round() as u64),
            thousands(h.total_rate.round() as u64)
        )
    };
    writeln!(
        out,
        "{}",
        line(
            "naive, either (one write per event, computed: the viral post's share on one key)",
            &naive
        )
    )?;
    writeln!(
        out,
        "{}",
        line(
            &format!("tally run (measured; busiest key `{}`)", hot.key),
            hot
        )
    )?;
    writeln!(
        out,
        "\ntally / naive: busiest key **{}** fewer writes, busiest primary **{}** fewer.",
        ratio(naive.key_rate, hot.key_rate),
        ratio(naive.busiest_primary(), hot.busiest_primary())
    )
}

const BEGIN: &str = "<!-- bench:begin (written by `tally-lab bench --out`) -->";
const END: &str = "<!-- bench:end -->";

/// Replaces the text between the markers of `path` (or appends them).
pub(super) fn write_between_markers(path: &Path, report: &str) -> Result<()> {
    crate::markdown::write_between(path, BEGIN, END, report)
}

#[cfg(test)]
mod tests {
    use super::super::latency::percentile;
    use super::*;

    #[test]
    fn figures_format_as_documented() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(ratio(3.0, 2.0), "1.50×");
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.5), 3.0);
        assert_eq!(today_utc().len(), 10);
    }

    #[test]
    fn busy_share_is_busy_ticks_over_all_ticks_between_two_readings() {
        use super::super::services::busy_share;
        assert_eq!(busy_share(Some((100, 400)), Some((250, 600))), Some(0.75));
        assert_eq!(busy_share(Some((100, 400)), Some((100, 400))), None);
        assert_eq!(busy_share(None, Some((250, 600))), None);
        assert_eq!(percent(0.975), "98 %");
    }

    #[test]
    fn report_replaces_only_its_block() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.md");
        std::fs::write(
            &path,
            format!("# Title\n\n{BEGIN}\nold\n{END}\n\n## Analysis\n"),
        )
        .unwrap();
        write_between_markers(&path, "new\n").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            format!("# Title\n\n{BEGIN}\nnew\n{END}\n\n## Analysis\n")
        );
    }
}
