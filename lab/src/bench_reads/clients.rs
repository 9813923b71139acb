//! The load generators of `tally-lab bench-reads`, run as child processes: wrk
//! against `tally serve`, redis-benchmark against redis-server; their output
//! parsed into [`Load`], and the Redis call counts the runs are divided by.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::local::find_program;

/// What one load run measured.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Load {
    /// Requests answered.
    pub requests: u64,
    /// Requests answered per second.
    pub rate: f64,
    /// Median latency, milliseconds.
    pub p50_ms: f64,
    /// 99th percentile latency, milliseconds.
    pub p99_ms: f64,
}

/// The two programs, found on PATH.
pub(super) struct Programs {
    wrk: PathBuf,
    redis_benchmark: PathBuf,
}

impl Programs {
    /// Finds wrk and redis-benchmark, or names the package to install.
    pub(super) fn find() -> Result<Programs> {
        let wrk = find_program("wrk").context(
            "wrk not found; install it with `apt-get install -y wrk` (scripts/bench does)",
        )?;
        let redis_benchmark = find_program("redis-benchmark").context(
            "redis-benchmark not found; install it with `apt-get install -y redis-tools`",
        )?;
        Ok(Programs {
            wrk,
            redis_benchmark,
        })
    }
}

/// How the clients load their server: the same for wrk and redis-benchmark.
#[derive(Debug, Clone, Copy)]
pub(super) struct Clients {
    pub threads: u32,
    pub connections: u32,
    pub secs: u64,
}

/// Runs wrk on `url` (with the Lua `script`, if any) and parses what it printed.
pub(super) fn wrk(
    programs: &Programs,
    clients: Clients,
    url: &str,
    script: Option<&Path>,
) -> Result<Load> {
    let mut command = Command::new(&programs.wrk);
    command
        .arg(format!("-t{}", clients.threads))
        .arg(format!("-c{}", clients.connections))
        .arg(format!("-d{}s", clients.secs))
        .arg("--latency");
    if let Some(script) = script {
        command.arg("-s").arg(script);
    }
    let output = command.arg(url).output().context("running wrk")?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "wrk failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    parse_wrk(&text).with_context(|| format!("cannot read wrk's output:\n{text}"))
}

/// The figures of wrk's `--latency` report; refuses a run with errors or
/// answers other than 2xx.
fn parse_wrk(text: &str) -> Result<Load> {
    let mut load = Load::default();
    for line in text.lines().map(str::trim) {
        if let Some(rate) = line.strip_prefix("Requests/sec:") {
            load.rate = rate.trim().parse()?;
        } else if let Some(p50) = line.strip_prefix("50%") {
            load.p50_ms = duration_ms(p50.trim())?;
        } else if let Some(p99) = line.strip_prefix("99%") {
            load.p99_ms = duration_ms(p99.trim())?;
        } else if let Some((n, _)) = line.split_once(" requests in ") {
            load.requests = n.trim().parse()?;
        } else if line.starts_with("Non-2xx or 3xx responses:")
            || line.starts_with("Socket errors:")
        {
            bail!("the load run had failures: {line}");
        }
    }
    if load.requests == 0 || load.rate == 0.0 {
        bail!("no requests were answered");
    }
    Ok(load)
}

/// "190.00us", "2.50ms", "1.02s" in milliseconds.
fn duration_ms(text: &str) -> Result<f64> {
    let (number, scale) = if let Some(n) = text.strip_suffix("us") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1000.0)
    } else {
        bail!("not a duration: {text}")
    };
    Ok(number.parse::<f64>()? * scale)
}

/// Runs `MGET keys` from redis-benchmark for about `clients.secs` seconds: a
/// short run first finds the rate, which sets the request count of the
/// measured one.
pub(super) fn mget(
    programs: &Programs,
    clients: Clients,
    port: u16,
    keys: &[String],
) -> Result<Load> {
    let probe = redis_benchmark(programs, clients, port, keys, 5_000)?;
    let requests = ((probe.rate * clients.secs as f64) as u64).max(10_000);
    redis_benchmark(programs, clients, port, keys, requests)
}

fn redis_benchmark(
    programs: &Programs,
    clients: Clients,
    port: u16,
    keys: &[String],
    requests: u64,
) -> Result<Load> {
    let output = Command::new(&programs.redis_benchmark)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", &clients.connections.to_string()])
        .args(["--threads", &clients.threads.to_string()])
        .args(["-n", &requests.to_string(), "--csv", "MGET"])
        .args(keys)
        .output()
        .context("running redis-benchmark")?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "redis-benchmark failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let mut load = parse_csv(&text).with_context(|| {
        format!(
            "cannot read redis-benchmark's output: {}",
            text.chars().take(300).collect::<String>()
        )
    })?;
    load.requests = requests;
    Ok(load)
}

/// The row of redis-benchmark's `--csv` output: the command, then rps,
/// avg, min, p50, p95, p99 and max latency (ms), each quoted.
fn parse_csv(text: &str) -> Result<Load> {
    let row = text
        .lines()
        .find(|l| !l.starts_with("\"test\"") && l.starts_with('"'))
        .context("no result row")?;
    let fields: Vec<&str> = row.rsplitn(8, "\",\"").collect();
    let field = |i: usize| -> Result<f64> {
        let raw = fields.get(i).context("too few fields")?;
        Ok(raw.trim_matches('"').parse()?)
    };
    // Reversed: max, p99, p95, p50, min, avg, rps, then the command.
    Ok(Load {
        requests: 0,
        rate: field(6)?,
        p50_ms: field(3)?,
        p99_ms: field(1)?,
    })
}

/// A wrk script asking for one post per request, post `ids[i]` with
/// probability `weights[i] / sum(weights)`: a cumulative table searched
/// with a uniform draw, and every request formatted once, in `init`.
pub(super) fn weighted_paths_script(ids: &[u64], weights: &[f64], seed: u64) -> String {
    let total: f64 = weights.iter().sum();
    let mut out = String::from(
        "-- Generated by `tally-lab bench-reads`: one post per request, drawn by weight.\n",
    );
    out.push_str("local ids = {");
    for id in ids {
        let _ = write!(out, "{id},");
    }
    out.push_str("}\nlocal cdf = {");
    let mut running = 0.0;
    for w in weights {
        running += w / total;
        let _ = write!(out, "{running:.9},");
    }
    let _ = write!(
        out,
        r#"}}
cdf[#cdf] = 1.0
local requests = {{}}
local thread_seed = {seed}
function setup(thread)
  thread:set("seed", thread_seed)
  thread_seed = thread_seed + 1
end
function init(args)
  math.randomseed(seed or {seed})
  for i, id in ipairs(ids) do
    requests[i] = wrk.format("GET", "/v1/posts/" .. id .. "/likes")
  end
end
function request()
  local u = math.random()
  local lo, hi = 1, #cdf
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] < u then lo = mid + 1 else hi = mid end
  end
  return requests[lo]
end
"#
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_output_is_read() {
        let text = "Running 10s test @ http://127.0.0.1:1/v1/posts/1/likes
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   420.11us    1.01ms  30.00ms   95.00%
  Latency Distribution
     50%  190.00us
     75%  300.00us
     90%  600.00us
     99%    2.50ms
  1450000 requests in 10.00s, 200.00MB read
Requests/sec: 145000.12
Transfer/sec:     20.00MB
";
        let load = parse_wrk(text).unwrap();
        assert_eq!(load.requests, 1_450_000);
        assert!((load.rate - 145_000.12).abs() < 1e-6);
        assert!((load.p50_ms - 0.19).abs() < 1e-9);
        assert!((load.p99_ms - 2.5).abs() < 1e-9);
        let failed = format!("{text}  Non-2xx or 3xx responses: 12\n");
        assert!(parse_wrk(&failed).is_err());
        assert_eq!(duration_ms("1.50s").unwrap(), 1500.0);
    }

    #[test]
    fn redis_benchmark_csv_is_read() {
        let text = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"
\"MGET t:likes:1:0 t:likes:1:1\",\"157000.50\",\"0.190\",\"0.024\",\"0.183\",\"0.399\",\"0.719\",\"6.359\"
";
        let load = parse_csv(text).unwrap();
        assert!((load.rate - 157_000.5).abs() < 1e-6);
        assert!((load.p50_ms - 0.183).abs() < 1e-9);
        assert!((load.p99_ms - 0.719).abs() < 1e-9);
    }

    #[test]
    fn script_lists_every_post_with_a_closed_cdf() {
        let script = weighted_paths_script(&[7, 9], &[3.0, 1.0], 42);
        assert!(script.contains("local ids = {7,9,}"));
        assert!(script.contains("local cdf = {0.750000000,1.000000000,}"));
        assert!(script.contains("math.randomseed(seed or 42)"));
    }
}
