//! Progress of a rebuild: per partition and in total, events done and left,
//! rate and ETA. Bars on a terminal, a log line every few seconds otherwise.
//!
//! "Done" counts offsets from a partition's origin to the rebuild's lowest
//! fence, "left" those from there to the partition's end now; both are
//! offsets, which equal events on a topic without compaction or transactions.

use std::collections::VecDeque;
use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::info;

/// The rate is measured over this window.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Bars, or periodic log lines.
pub struct Progress {
    origins: Vec<i64>,
    bars: Option<(MultiProgress, ProgressBar, Vec<ProgressBar>)>,
    every: Duration,
    logged_at: Option<Instant>,
    samples: VecDeque<(Instant, i64)>,
}

fn bar(multi: &MultiProgress, label: String) -> ProgressBar {
    let bar = multi.add(ProgressBar::new(0));
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>8} [{bar:30}] {human_pos}/{human_len} {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(label);
    bar
}

impl Progress {
    /// Progress of partitions starting at `origins`, drawn on stderr when it
    /// is a terminal, logged every `every` otherwise.
    pub fn new(origins: Vec<i64>, every: Duration) -> Self {
        let bars = std::io::stderr().is_terminal().then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let total = bar(&multi, "total".into());
            let parts = (0..origins.len())
                .map(|p| bar(&multi, format!("p{p}")))
                .collect();
            (multi, total, parts)
        });
        Self {
            origins,
            bars,
            every,
            logged_at: None,
            samples: VecDeque::new(),
        }
    }

    /// Shows the rebuild at `fences` (lowest per partition) against the
    /// partitions' (low, high) watermarks. `origins` lists more partitions
    /// than before when the topic grew; those get bars of their own.
    pub fn update(&mut self, origins: &[i64], fences: &[i64], marks: &[(i64, i64)]) {
        if origins.len() > self.origins.len() {
            if let Some((multi, _, parts)) = &mut self.bars {
                for p in parts.len()..origins.len() {
                    parts.push(bar(multi, format!("p{p}")));
                }
            }
            self.origins = origins.to_vec();
        }
        let per: Vec<(i64, i64)> = self
            .origins
            .iter()
            .zip(fences)
            .zip(marks)
            .map(|((&origin, &fence), &(_, high))| {
                ((fence + 1 - origin).max(0), (high - 1 - fence).max(0))
            })
            .collect();
        let done: i64 = per.iter().map(|&(d, _)| d).sum();
        let left: i64 = per.iter().map(|&(_, l)| l).sum();
        let now = Instant::now();
        self.samples.push_back((now, done));
        while self
            .samples
            .front()
            .is_some_and(|&(at, _)| now - at > RATE_WINDOW)
        {
            self.samples.pop_front();
        }
        let rate = match self.samples.front() {
            Some(&(at, then)) if now > at => (done - then) as f64 / (now - at).as_secs_f64(),
            _ => 0.0,
        };
        let eta = (rate > 0.0).then(|| Duration::from_secs_f64(left as f64 / rate));
        let eta_text = eta.map_or("-".to_string(), |d| format!("{} s", d.as_secs()));
        if let Some((_, total, parts)) = &self.bars {
            total.set_length((done + left) as u64);
            total.set_position(done as u64);
            total.set_message(format!("{rate:.0} events/s, eta {eta_text}"));
            for (bar, &(d, l)) in parts.iter().zip(&per) {
                bar.set_length((d + l) as u64);
                bar.set_position(d as u64);
            }
            return;
        }
        if self.logged_at.is_some_and(|at| at.elapsed() < self.every) {
            return;
        }
        self.logged_at = Some(now);
        let partitions: Vec<String> = per
            .iter()
            .enumerate()
            .map(|(p, (d, l))| format!("p{p}={d}/{l}"))
            .collect();
        info!(
            done,
            left,
            rate = rate.round() as i64,
            eta_secs = eta.map(|d| d.as_secs()),
            partitions = %partitions.join(" "),
            "Rebuild progress (events done/left)."
        );
    }

    /// Removes the bars.
    pub fn finish(&self) {
        if let Some((multi, total, parts)) = &self.bars {
            total.finish();
            for bar in parts {
                bar.finish();
            }
            let _ = multi.clear();
        }
    }
}
