//! The Markdown report of `tally-lab bench-reads`: what ran where, the table
//! of served against direct reads, how the serve was scheduled in each run,
//! the `--repeat` runs of the hot post, and the Redis calls behind it all.

use std::fmt::Write as _;

use anyhow::Result;

use super::clients::Load;
use super::sched::{QUIET_PERCENT, Sched};
use super::{BenchReadsConfig, Repeat, Run};
use crate::markdown::{command_line, header, thousands, today_utc};

/// The report: what ran where, the tables, and the calls behind them.
pub(super) fn render(config: &BenchReadsConfig, run: &Run) -> Result<String> {
    let mut out = String::new();
    let (t, c, secs) = (config.threads, config.connections, config.secs);
    header(&mut out, &command_line())?;
    writeln!(
        out,
        "Date: {}. redis-server {} (no persistence) on the same machine; `tally serve` with its \
         defaults: cache TTL {} ms, at most {} requests at once, one tokio worker per core.  ",
        today_utc(),
        run.redis_version,
        thousands(tally::read::DEFAULT_CACHE_TTL_MS),
        tally::infra::config::DEFAULT_SERVE_MAX_CONCURRENT,
    )?;
    writeln!(
        out,
        "Load: `wrk -t{t} -c{c} -d{secs}s --latency`; direct: `redis-benchmark -c {c} --threads {t} \
         --csv MGET <keys>` for about {secs} s, in the same run. Before the runs, {} answers \
         (every post, one by one and in batches) equalled the totals written.\n",
        thousands(run.checked as u64)
    )?;
    let settled = &run.settled;
    writeln!(
        out,
        "Before the first run the benchmark waited {:.1} s for the machine's I/O and memory \
         pressure (`/proc/pressure/*`, \"some\" avg10) to fall under {} %: they were {:.1} % and \
         {:.1} % when it began, {:.1} % and {:.1} % when it ended.\n",
        settled.waited.as_secs_f64(),
        QUIET_PERCENT,
        settled.io_before,
        settled.memory_before,
        settled.io_after,
        settled.memory_after,
    )?;
    served_table(&mut out, run)?;
    sched_table(&mut out, run)?;
    repeats(&mut out, run)?;
    calls(&mut out, run)?;
    Ok(out)
}

fn ms(load: &Load) -> String {
    format!("{:.2} / {:.2} ms", load.p50_ms, load.p99_ms)
}

/// Nanoseconds in microseconds, with two decimals below 10 µs.
fn us(ns: f64) -> String {
    if ns < 10_000.0 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{} µs", thousands((ns / 1e3).round() as u64))
    }
}

fn served_table(out: &mut String, run: &Run) -> std::fmt::Result {
    writeln!(
        out,
        "| case | served req/s | served p50 / p99 | Redis calls / request | direct `MGET` of | direct req/s | direct p50 / p99 | served / direct |"
    )?;
    writeln!(out, "|---|---:|---|---:|---|---:|---|---:|")?;
    for case in &run.cases {
        let (direct, keys) = &case.direct;
        let served = &case.served.load;
        let calls: u64 = case.served.calls.iter().map(|(_, n)| n).sum();
        writeln!(
            out,
            "| {} | {} | {} | {:.5} | {keys} | {} | {} | **{:.2}×** |",
            case.label,
            thousands(served.rate as u64),
            ms(served),
            calls as f64 / served.requests.max(1) as f64,
            thousands(direct.rate as u64),
            ms(direct),
            served.rate / direct.rate.max(f64::MIN_POSITIVE),
        )?;
    }
    Ok(())
}

fn sched_table(out: &mut String, run: &Run) -> std::fmt::Result {
    writeln!(
        out,
        "\nHow the kernel scheduled `tally serve` during each wrk run, summed over its threads \
         (`/proc/PID/task/*/schedstat` and `status`, read before and after): **run-queue wait** \
         is time a thread could run but waited for a core, per request and as a share of the \
         run's wall time (summed over threads, so it can pass 100 %); **per timeslice** is that \
         wait divided by the times a thread was put on a core; **involuntary switches** are the \
         times a thread was taken off a core while it could still run. If a high p99 comes from \
         the serve waiting for a core, its run shows a higher wait here. **Machine stall** is the \
         time at least one task of the whole machine was stalled waiting for a core, for memory \
         (reclaim) or for I/O during the run (`/proc/pressure/*`, the \"some\" totals).\n"
    )?;
    writeln!(
        out,
        "| case | served p99 | run-queue wait / request | run-queue wait / wall time | wait / timeslice | involuntary switches / 1,000 requests | machine stall: CPU / memory / I/O |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|")?;
    for case in &run.cases {
        let (load, sched) = (&case.served.load, &case.served.sched);
        writeln!(
            out,
            "| {} | {:.2} ms | {} | {:.1} % | {} | {:.1} | {} |",
            case.label,
            load.p99_ms,
            us(sched.wait_per_request_ns(load.requests)),
            sched.wait_share() * 100.0,
            us(sched.wait_per_slice_ns()),
            sched.involuntary_per_1000(load.requests),
            stall(sched),
        )?;
    }
    Ok(())
}

/// The `--repeat` runs of case (a), when there are more than one.
fn repeats(out: &mut String, run: &Run) -> std::fmt::Result {
    if run.repeats.len() < 2 {
        return Ok(());
    }
    writeln!(
        out,
        "\nCase (a), cache on, run {} times in a row (the tables above show run 1):\n",
        run.repeats.len()
    )?;
    writeln!(
        out,
        "| run | served req/s | served p99 | run-queue wait / request | machine stall: CPU / memory / I/O |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|")?;
    for (i, Repeat { load, sched }) in run.repeats.iter().enumerate() {
        writeln!(
            out,
            "| {} | {} | {:.2} ms | {} | {} |",
            i + 1,
            thousands(load.rate as u64),
            load.p99_ms,
            us(sched.wait_per_request_ns(load.requests)),
            stall(sched),
        )?;
    }
    Ok(())
}

/// The machine's stall times over a run, in milliseconds.
fn stall(sched: &Sched) -> String {
    let ms = |us: u64| format!("{:.0}", us as f64 / 1e3);
    format!(
        "{} / {} / {} ms",
        ms(sched.stall.cpu_us),
        ms(sched.stall.memory_us),
        ms(sched.stall.io_us)
    )
}

fn calls(out: &mut String, run: &Run) -> std::fmt::Result {
    writeln!(
        out,
        "\nRedis calls during each wrk run, by command (requests wrk made in brackets):\n"
    )?;
    for case in &run.cases {
        let parts: Vec<String> = case
            .served
            .calls
            .iter()
            .map(|(name, n)| format!("{name} {}", thousands(*n)))
            .collect();
        let parts = if parts.is_empty() {
            "none".to_string()
        } else {
            parts.join(", ")
        };
        writeln!(
            out,
            "- {} ({} requests): {parts}",
            case.label,
            thousands(case.served.load.requests)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::sched::{Settled, Stall};
    use super::super::{Case, Served};
    use super::*;

    fn config() -> BenchReadsConfig {
        BenchReadsConfig {
            secs: 10,
            connections: 32,
            threads: 2,
            buckets: 16,
            posts: 1_000,
            zipf: 1.1,
            batch: 100,
            repeat: 1,
            out: None,
        }
    }

    fn load(rate: f64, p99_ms: f64) -> Load {
        Load {
            requests: (rate * 10.0) as u64,
            rate,
            p50_ms: 0.4,
            p99_ms,
        }
    }

    fn sched(wait_ms: u64) -> Sched {
        Sched {
            wait_ns: wait_ms * 1_000_000,
            slices: 100_000,
            involuntary: 2_000,
            wall: Duration::from_secs(10),
            stall: Stall {
                cpu_us: 1_500_000,
                memory_us: 0,
                io_us: wait_ms * 10,
            },
        }
    }

    fn run(repeats: Vec<Repeat>) -> Run {
        let Repeat { load, sched } = repeats[0];
        Run {
            cases: vec![Case {
                label: "(a) one hot post, 16 buckets".into(),
                served: Served {
                    load,
                    calls: vec![("get".into(), 160)],
                    sched,
                },
                direct: (self::load(61_500.0, 1.14), "its 16 keys".into()),
            }],
            repeats,
            checked: 1_011,
            settled: Settled {
                waited: Duration::from_millis(12_500),
                io_before: 41.5,
                memory_before: 0.0,
                io_after: 0.9,
                memory_after: 0.0,
            },
            redis_version: "7.0.15".into(),
        }
    }

    /// Every row of every table has as many cells as its header.
    fn tables_are_whole(report: &str) {
        let mut columns = None;
        for line in report.lines() {
            if !line.starts_with('|') {
                columns = None;
                continue;
            }
            let cells = line.matches('|').count();
            assert_eq!(*columns.get_or_insert(cells), cells, "{line}");
        }
    }

    #[test]
    fn each_case_shows_its_scheduling() {
        let once = Repeat {
            load: load(70_000.0, 1.36),
            sched: sched(3_500),
        };
        let report = render(&config(), &run(vec![once])).unwrap();
        tables_are_whole(&report);
        // 3.5 s of wait over 700,000 requests and 10 s; 100,000 slices; 2,000 switches.
        assert!(report.contains(
            "| (a) one hot post, 16 buckets | 1.36 ms | 5.00 µs | 35.0 % | 35 µs | 2.9 | 1500 / 0 / 35 ms |"
        ));
        assert!(!report.contains("run 1 of"), "{report}");
        assert!(!report.contains("| run |"), "{report}");
    }

    #[test]
    fn repeats_are_listed_in_order() {
        let repeat = |rate, p99_ms, wait_ms| Repeat {
            load: load(rate, p99_ms),
            sched: sched(wait_ms),
        };
        let repeats = vec![
            repeat(70_000.0, 1.36, 3_500),
            repeat(60_000.0, 10.4, 21_000),
        ];
        let report = render(&config(), &run(repeats)).unwrap();
        tables_are_whole(&report);
        assert!(report.contains("run 2 times in a row"));
        assert!(
            report
                .contains("| 1 | 70,000 | 1.36 ms | 5.00 µs | 1500 / 0 / 35 ms |\n| 2 | 60,000 | 10.40 ms | 35 µs | 1500 / 0 / 210 ms |")
        );
    }
}
