//! The latency breakdown: where a marker like's time goes between its
//! produce and its count, read from `tally run`'s own `tally_stage_seconds`
//! histogram (scraped from its `/metrics` before and after the latency phase)
//! so the bench and a production dashboard measure the same thing.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tally::infra::metrics::STAGES;

/// The histogram's cumulative buckets, per stage: `(le, count)`, `le`
/// ascending, `+Inf` last.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Stages(Vec<(String, Vec<(f64, u64)>)>);

/// One stage's share of the latency phase.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct StageFigure {
    /// One of [`STAGES`].
    pub stage: String,
    /// Median, milliseconds (interpolated within its bucket).
    pub p50_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
    /// Batches sampled.
    pub samples: u64,
}

/// The stage histograms `addr` serves.
pub(super) fn scrape(addr: SocketAddr) -> Result<Stages> {
    Ok(parse(&metrics_text(addr)?))
}

/// The value of the unlabelled counter `name` that `addr` serves.
pub(super) fn counter(addr: SocketAddr, name: &str) -> Result<f64> {
    let text = metrics_text(addr)?;
    text.lines()
        .find_map(|line| {
            line.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .with_context(|| format!("{addr}/metrics has no {name}"))
}

/// `GET /metrics` from `addr`, as text.
pub(super) fn metrics_text(addr: SocketAddr) -> Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .with_context(|| format!("connecting to tally's metrics at {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("no HTTP answer from {addr}");
    };
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "{addr}/metrics answered {}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(body.to_string())
}

/// The `tally_stage_seconds_bucket` series of an exposition text.
pub(super) fn parse(text: &str) -> Stages {
    let mut stages: Vec<(String, Vec<(f64, u64)>)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("tally_stage_seconds_bucket{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels.split(',').find_map(|pair| {
                let (key, value) = pair.split_once('=')?;
                (key.trim() == name).then(|| value.trim_matches('"').to_string())
            })
        };
        let (Some(stage), Some(le)) = (label("stage"), label("le")) else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::NAN)
        };
        let count = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        match stages.iter_mut().find(|(s, _)| *s == stage) {
            Some((_, buckets)) => buckets.push((le, count)),
            None => stages.push((stage, vec![(le, count)])),
        }
    }
    for (_, buckets) in &mut stages {
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Stages(stages)
}

impl Stages {
    /// Each stage's percentiles over what was recorded since `before`, in the
    /// order of [`STAGES`]; a stage without samples is left out.
    pub(super) fn since(&self, before: &Stages) -> Vec<StageFigure> {
        let mut figures: Vec<StageFigure> = self
            .0
            .iter()
            .filter_map(|(stage, buckets)| {
                let earlier = before.0.iter().find(|(s, _)| s == stage).map(|(_, b)| b);
                let delta: Vec<(f64, u64)> = buckets
                    .iter()
                    .map(|&(le, n)| {
                        let old = earlier
                            .and_then(|b| b.iter().find(|(l, _)| *l == le))
                            .map_or(0, |&(_, n)| n);
                        (le, n.saturating_sub(old))
                    })
                    .collect();
                let samples = delta.last().map_or(0, |&(_, n)| n);
                (samples > 0).then(|| StageFigure {
                    stage: stage.clone(),
                    p50_ms: quantile(&delta, 0.5) * 1e3,
                    p99_ms: quantile(&delta, 0.99) * 1e3,
                    samples,
                })
            })
            .collect();
        let rank = |stage: &str| {
            STAGES
                .iter()
                .position(|s| *s == stage)
                .unwrap_or(STAGES.len())
        };
        figures.sort_by_key(|f| rank(&f.stage));
        figures
    }
}

/// The `q` quantile of cumulative buckets, interpolated linearly within the
/// bucket it falls in (as Prometheus' `histogram_quantile` does); the
/// highest finite bound when it falls in `+Inf`.
fn quantile(buckets: &[(f64, u64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0, |&(_, n)| n) as f64;
    let rank = q * total;
    let mut lower = (0.0, 0u64);
    for &(le, n) in buckets {
        if n as f64 >= rank {
            if le.is_infinite() {
                return lower.0;
            }
            let inside = (n - lower.1) as f64;
            let share = if inside > 0.0 {
                (rank - lower.1 as f64) / inside
            } else {
                1.0
            };
            return lower.0 + (le - lower.0) * share;
        }
        lower = (le, n);
    }
    lower.0
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# TYPE tally_stage_seconds histogram
tally_stage_seconds_bucket{stage="fetch",le="0.1"} 10
tally_stage_seconds_bucket{stage="fetch",le="0.2"} 10
tally_stage_seconds_bucket{stage="fetch",le="+Inf"} 10
"#;
    const AFTER: &str = r#"tally_stage_seconds_bucket{stage="fetch",le="0.1"} 60
tally_stage_seconds_bucket{stage="fetch",le="0.2"} 110
tally_stage_seconds_bucket{stage="fetch",le="+Inf"} 110
tally_stage_seconds_bucket{stage="script",le="0.1"} 0
tally_stage_seconds_bucket{stage="script",le="+Inf"} 0
tally_stage_sum{stage="fetch"} 3.0
"#;

    #[test]
    fn the_phase_is_the_difference_and_quantiles_interpolate() {
        let figures = parse(AFTER).since(&parse(BEFORE));
        // 100 samples in the phase: 50 at or below 0.1 s, 50 in (0.1, 0.2].
        assert_eq!(figures.len(), 1, "a stage without samples is left out");
        let fetch = &figures[0];
        assert_eq!((fetch.stage.as_str(), fetch.samples), ("fetch", 100));
        assert!((fetch.p50_ms - 100.0).abs() < 1e-9, "{}", fetch.p50_ms);
        assert!((fetch.p99_ms - 198.0).abs() < 1e-9, "{}", fetch.p99_ms);
    }
}
