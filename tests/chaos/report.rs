//! Rows of the chaos table, the count comparison that fills them, and the consumer's resource
//! samples for the leak check.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::time::Duration;

use crate::Settings;

/// One scenario's result.
#[derive(Debug, Default)]
pub struct Row {
    pub name: &'static str,
    /// Good events produced (each must be counted exactly once).
    pub events: usize,
    /// Faults injected, in words ("6 SIGKILL").
    pub faults: String,
    /// Posts compared with the ground truth.
    pub posts: usize,
    /// Posts below / above the truth, and the events missing / counted twice over all of them.
    pub lost_posts: usize,
    pub lost_events: i64,
    pub doubled_posts: usize,
    pub doubled_events: i64,
    /// Bad messages found in the dead-letter topic (distinct source positions) and sent.
    pub bad: Option<(usize, usize)>,
    pub secs: f64,
    /// Why the scenario could not finish (a timeout, a consumer that died, a check that failed).
    pub error: Option<String>,
}

impl Row {
    pub fn new(name: &'static str) -> Row {
        Row {
            name,
            ..Row::default()
        }
    }

    /// Compares every post's count with the truth; posts at zero on both sides are skipped.
    pub fn compare(&mut self, actual: &HashMap<u64, i64>, truth: &HashMap<u64, i64>) {
        let posts: BTreeSet<u64> = actual
            .iter()
            .chain(truth.iter())
            .filter(|(_, v)| **v != 0)
            .map(|(k, _)| *k)
            .collect();
        self.posts = posts.len();
        for post in posts {
            let want = truth.get(&post).copied().unwrap_or(0);
            let got = actual.get(&post).copied().unwrap_or(0);
            if got < want {
                self.lost_posts += 1;
                self.lost_events += want - got;
            } else if got > want {
                self.doubled_posts += 1;
                self.doubled_events += got - want;
            }
        }
    }

    /// Runs `wait` (which may panic on a timeout), then compares what `read` finds with `truth`
    /// either way, so a scenario that never caught up still shows what it lost.
    pub fn settle(
        &mut self,
        wait: impl FnOnce(),
        read: impl FnOnce() -> HashMap<u64, i64>,
        truth: &HashMap<u64, i64>,
    ) {
        let waited = catch_unwind(AssertUnwindSafe(wait));
        self.compare(&read(), truth);
        if let Err(panic) = waited {
            resume_unwind(panic);
        }
    }

    pub fn clean(&self) -> bool {
        self.error.is_none()
            && self.posts > 0
            && self.lost_posts == 0
            && self.doubled_posts == 0
            && self.bad.is_none_or(|(found, sent)| found == sent)
    }

    fn lost(&self) -> String {
        match self.lost_posts {
            0 => "0".to_string(),
            n => format!("{n} ({} ev)", self.lost_events),
        }
    }

    fn doubled(&self) -> String {
        match self.doubled_posts {
            0 => "0".to_string(),
            n => format!("{n} ({} ev)", self.doubled_events),
        }
    }

    fn bad_cell(&self) -> String {
        match self.bad {
            Some((found, sent)) => format!("{found}/{sent}"),
            None => "-".to_string(),
        }
    }

    pub fn summary(&self) -> String {
        let verdict = match &self.error {
            Some(e) => format!("ERROR {e}"),
            None if self.clean() => "exact".to_string(),
            None => "DIFFERENCES".to_string(),
        };
        format!(
            "{verdict}; {} events, faults {}, {} posts, lost {}, doubled {}, bad {}, {:.0} s",
            self.events,
            self.faults,
            self.posts,
            self.lost(),
            self.doubled(),
            self.bad_cell(),
            self.secs
        )
    }
}

/// RSS (KiB) and open descriptors of a process, from /proc.
pub fn resources(pid: u32) -> Option<(u64, usize)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some((rss, fds))
}

/// First, last and largest of a series of samples.
type Span<T> = (T, T, T);

/// The steady consumer's resources, sampled after each scale-down, and the rebalances it saw.
#[derive(Debug, Default)]
pub struct Leaks {
    pub rebalances: u64,
    /// (rebalances so far, RSS KiB, open descriptors).
    pub samples: Vec<(u64, u64, usize)>,
}

impl Leaks {
    /// RSS may end at most this far above the first sample (librdkafka's fetch queues and the
    /// allocator's arenas breathe with the load; a leak grows without bound).
    pub const RSS_GROWTH_KIB: u64 = 64 * 1024;
    /// Open descriptors may end at most this many above the first sample.
    pub const FD_GROWTH: usize = 16;

    /// (first, last, max) of RSS, then of open descriptors.
    fn first_last_max(&self) -> Option<(Span<u64>, Span<usize>)> {
        let first = self.samples.first()?;
        let last = self.samples.last()?;
        let max_rss = self.samples.iter().map(|s| s.1).max()?;
        let max_fds = self.samples.iter().map(|s| s.2).max()?;
        Some(((first.1, last.1, max_rss), (first.2, last.2, max_fds)))
    }

    /// What grew past its bound.
    pub fn problems(&self) -> Vec<String> {
        let Some(((rss0, rss1, _), (fd0, fd1, _))) = self.first_last_max() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if rss1 > rss0 + Self::RSS_GROWTH_KIB {
            out.push(format!(
                "RSS grew from {} to {} MiB over {} rebalances (bound +{} MiB)",
                rss0 / 1024,
                rss1 / 1024,
                self.rebalances,
                Self::RSS_GROWTH_KIB / 1024
            ));
        }
        if fd1 > fd0 + Self::FD_GROWTH {
            out.push(format!(
                "open descriptors grew from {fd0} to {fd1} over {} rebalances (bound +{})",
                self.rebalances,
                Self::FD_GROWTH
            ));
        }
        out
    }
}

/// The table printed at the end of a run.
pub fn table(settings: &Settings, rows: &[Row], leaks: &Leaks, total: Duration) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "chaos, {} mode: {} scenarios in {:.0} s",
        settings.mode,
        rows.len(),
        total.as_secs_f64()
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| scenario | events | faults injected | posts checked | lost | doubled | bad dead-lettered | time | result |"
    );
    let _ = writeln!(out, "|---|---:|---|---:|---:|---:|---:|---:|---|");
    for r in rows {
        let result = match &r.error {
            Some(e) => format!("error: {e}"),
            None if r.clean() => "exact".to_string(),
            None => "DIFFERENCES".to_string(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} s | {} |",
            r.name,
            r.events,
            r.faults,
            r.posts,
            r.lost(),
            r.doubled(),
            r.bad_cell(),
            r.secs,
            result
        );
    }
    if let Some(((rss0, rss1, rss_max), (fd0, fd1, fd_max))) = leaks.first_last_max() {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "Steady consumer across {} rebalances ({} samples): RSS first {:.1} MiB, last {:.1} MiB, max {:.1} MiB (bound: last <= first + {} MiB); open fds first {fd0}, last {fd1}, max {fd_max} (bound: last <= first + {}).",
            leaks.rebalances,
            leaks.samples.len(),
            rss0 as f64 / 1024.0,
            rss1 as f64 / 1024.0,
            rss_max as f64 / 1024.0,
            Leaks::RSS_GROWTH_KIB / 1024,
            Leaks::FD_GROWTH
        );
        for problem in leaks.problems() {
            let _ = writeln!(out, "LEAK: {problem}");
        }
    }
    out
}
