//! How the kernel scheduled `tally serve` over a load run, read from /proc
//! before and after it: the time its threads were ready to run but waited
//! for a core, the timeslices they ran in, and the times they were taken off
//! a core while they could still run.
//!
//! The figures test one explanation of a high p99: that a request waits
//! because the serve's worker thread sits on a run queue behind the load
//! generator's threads. A run whose p99 jumps while the run-queue wait per
//! request stays flat needs another explanation.
//!
//! Beside them, the machine's pressure stall counts (`/proc/pressure/cpu`,
//! `memory` and `io`, the "some" line): how long at least one task of the
//! whole machine was stalled on a core, on memory reclaim, or on I/O during
//! the run. A tail that comes with the serve's own wait flat but the
//! machine stalled on memory or I/O points at what else the machine was
//! doing (the page cache a stopped broker leaves behind, written back and
//! reclaimed), not at the serve.
//!
//! `/proc/PID/schedstat` and the process's `status` describe only its first
//! thread, so every figure is summed over `/proc/PID/task/*`. A thread that
//! exits during the run takes its counts with it; the tokio workers, which
//! serve the requests, live as long as the process.

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustc_hash::FxHashMap;

/// One thread's counters, as the kernel keeps them since the thread started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counters {
    /// Nanoseconds runnable on a run queue, waiting for a core.
    wait_ns: u64,
    /// Timeslices run: the times the thread was put on a core.
    slices: u64,
    /// Times the thread was taken off a core while it could still run.
    involuntary: u64,
}

/// The serve's threads' counters at one instant.
pub(super) struct Snapshot {
    at: Instant,
    threads: FxHashMap<u32, Counters>,
    stall: Stall,
}

/// The machine's pressure stall totals, microseconds: the time at least one
/// task waited for a core, for memory, for I/O. Zero where the kernel keeps
/// no pressure counts (built without CONFIG_PSI).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Stall {
    pub cpu_us: u64,
    pub memory_us: u64,
    pub io_us: u64,
}

impl Stall {
    fn read() -> Stall {
        let some = |resource: &str| {
            std::fs::read_to_string(format!("/proc/pressure/{resource}"))
                .ok()
                .and_then(|text| parse_pressure(&text, "total"))
                .unwrap_or(0)
        };
        Stall {
            cpu_us: some("cpu"),
            memory_us: some("memory"),
            io_us: some("io"),
        }
    }

    fn since(&self, before: &Stall) -> Stall {
        Stall {
            cpu_us: self.cpu_us.saturating_sub(before.cpu_us),
            memory_us: self.memory_us.saturating_sub(before.memory_us),
            io_us: self.io_us.saturating_sub(before.io_us),
        }
    }
}

/// How the machine settled before the runs: its I/O and memory pressure
/// (the "some" avg10, per cent) when the wait began and when it ended.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Settled {
    pub waited: Duration,
    pub io_before: f64,
    pub memory_before: f64,
    pub io_after: f64,
    pub memory_after: f64,
}

/// I/O or memory pressure (avg10, per cent) under which the machine counts
/// as quiet.
pub(super) const QUIET_PERCENT: f64 = 1.0;

/// Waits, up to `limit`, until the machine's I/O and memory pressure both
/// fall under [`QUIET_PERCENT`]: a process that stopped just before (a
/// broker whose page cache is written back and reclaimed) stalls whatever
/// runs next. Without pressure counts it returns at once.
pub(super) fn settle(limit: Duration) -> Settled {
    let avg10 = |resource: &str| {
        std::fs::read_to_string(format!("/proc/pressure/{resource}"))
            .ok()
            .and_then(|text| parse_pressure(&text, "avg10"))
    };
    let started = Instant::now();
    let (io_before, memory_before) = (avg10("io"), avg10("memory"));
    let (mut io, mut memory) = (io_before, memory_before);
    while started.elapsed() < limit
        && (io.unwrap_or(0.0) >= QUIET_PERCENT || memory.unwrap_or(0.0) >= QUIET_PERCENT)
    {
        std::thread::sleep(Duration::from_millis(500));
        (io, memory) = (avg10("io"), avg10("memory"));
    }
    Settled {
        waited: started.elapsed(),
        io_before: io_before.unwrap_or(0.0),
        memory_before: memory_before.unwrap_or(0.0),
        io_after: io.unwrap_or(0.0),
        memory_after: memory.unwrap_or(0.0),
    }
}

/// One field of a pressure file's "some" line: `total` (microseconds) or
/// `avg10` (per cent).
fn parse_pressure<T: std::str::FromStr>(text: &str, field: &str) -> Option<T> {
    text.lines()
        .find_map(|l| l.strip_prefix("some "))?
        .split_whitespace()
        .find_map(|f| f.strip_prefix(field)?.strip_prefix('='))?
        .parse()
        .ok()
}

impl Snapshot {
    /// Reads every thread of process `pid`.
    pub(super) fn take(pid: u32) -> Result<Snapshot> {
        let dir = format!("/proc/{pid}/task");
        let mut threads = FxHashMap::default();
        for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))? {
            let name = entry?.file_name();
            let Some(tid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(counters) = read_thread(&dir, tid)? {
                threads.insert(tid, counters);
            }
        }
        if threads.is_empty() {
            bail!("{dir} lists no threads");
        }
        Ok(Snapshot {
            at: Instant::now(),
            threads,
            stall: Stall::read(),
        })
    }

    /// What the threads did between `before` and this snapshot. A thread
    /// started in between counts from zero.
    pub(super) fn since(&self, before: &Snapshot) -> Sched {
        let mut sched = Sched {
            wall: self.at.saturating_duration_since(before.at),
            stall: self.stall.since(&before.stall),
            ..Sched::default()
        };
        for (tid, now) in &self.threads {
            let then = before.threads.get(tid).copied().unwrap_or_default();
            sched.wait_ns += now.wait_ns.saturating_sub(then.wait_ns);
            sched.slices += now.slices.saturating_sub(then.slices);
            sched.involuntary += now.involuntary.saturating_sub(then.involuntary);
        }
        sched
    }
}

/// Linux's "no such process": what reading a file of a thread that is
/// exiting returns, where one already gone is not found.
const ESRCH: i32 = 3;

/// One thread's counters, or `None` when it exited while it was being read.
fn read_thread(dir: &str, tid: u32) -> Result<Option<Counters>> {
    let read = |file: &str| {
        let path = format!("{dir}/{tid}/{file}");
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(ESRCH) => {
                Ok(None)
            }
            Err(e) => Err(e).with_context(|| format!("reading {path}")),
        }
    };
    let (Some(schedstat), Some(status)) = (read("schedstat")?, read("status")?) else {
        return Ok(None);
    };
    let (wait_ns, slices) = parse_schedstat(&schedstat).with_context(|| {
        format!("{dir}/{tid}/schedstat is not three numbers: {schedstat:?} (a kernel without CONFIG_SCHED_INFO?)")
    })?;
    let involuntary = parse_involuntary(&status)
        .with_context(|| format!("{dir}/{tid}/status has no nonvoluntary_ctxt_switches"))?;
    Ok(Some(Counters {
        wait_ns,
        slices,
        involuntary,
    }))
}

/// A `schedstat` line, "on-CPU ns, run-queue wait ns, timeslices", as
/// (wait ns, timeslices).
fn parse_schedstat(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace().map(|f| f.parse::<u64>().ok());
    let (_on_cpu, wait, slices) = (fields.next()??, fields.next()??, fields.next()??);
    fields.next().is_none().then_some((wait, slices))
}

/// The `nonvoluntary_ctxt_switches` count of a `status` file.
fn parse_involuntary(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))?
        .trim()
        .parse()
        .ok()
}

/// How the serve was scheduled over one run, summed over its threads.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Sched {
    /// Nanoseconds the threads were runnable but waiting for a core.
    pub wait_ns: u64,
    /// Timeslices the threads ran.
    pub slices: u64,
    /// Involuntary context switches of the threads.
    pub involuntary: u64,
    /// The run's wall time, from one snapshot to the other.
    pub wall: Duration,
    /// How long the machine was stalled meanwhile.
    pub stall: Stall,
}

impl Sched {
    /// Run-queue wait per request, nanoseconds.
    pub(super) fn wait_per_request_ns(&self, requests: u64) -> f64 {
        self.wait_ns as f64 / requests.max(1) as f64
    }

    /// Run-queue wait as a share of the wall time; summed over threads, it
    /// can pass 1.
    pub(super) fn wait_share(&self) -> f64 {
        self.wait_ns as f64 / (self.wall.as_nanos().max(1) as f64)
    }

    /// Mean run-queue wait before a timeslice, nanoseconds.
    pub(super) fn wait_per_slice_ns(&self) -> f64 {
        self.wait_ns as f64 / self.slices.max(1) as f64
    }

    /// Involuntary context switches per 1,000 requests.
    pub(super) fn involuntary_per_1000(&self, requests: u64) -> f64 {
        self.involuntary as f64 * 1_000.0 / requests.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_totals_are_read_from_the_some_line() {
        let text = "some avg10=18.73 avg60=9.04 avg300=5.81 total=6174453422\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=12\n";
        assert_eq!(parse_pressure::<u64>(text, "total"), Some(6_174_453_422));
        assert_eq!(parse_pressure::<f64>(text, "avg10"), Some(18.73));
        assert_eq!(
            parse_pressure::<u64>("full avg10=0.00 total=12\n", "total"),
            None
        );
    }

    #[test]
    fn schedstat_is_read() {
        assert_eq!(
            parse_schedstat("8411702954 3318957 1234\n"),
            Some((3_318_957, 1_234))
        );
        assert_eq!(parse_schedstat("0 0 0"), Some((0, 0)));
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("1 2"), None);
        assert_eq!(parse_schedstat("1 2 3 4"), None);
        assert_eq!(parse_schedstat("1 -2 3"), None);
        assert_eq!(parse_schedstat("1 2 x"), None);
    }

    #[test]
    fn involuntary_switches_are_read_from_status() {
        let status = "Name:\ttokio-runtime-w\nState:\tS (sleeping)\nTgid:\t4242\n\
                      voluntary_ctxt_switches:\t150321\n\
                      nonvoluntary_ctxt_switches:\t2087\n";
        assert_eq!(parse_involuntary(status), Some(2_087));
        assert_eq!(parse_involuntary("voluntary_ctxt_switches:\t5\n"), None);
        assert_eq!(
            parse_involuntary("nonvoluntary_ctxt_switches:\tmany\n"),
            None
        );
    }

    #[test]
    fn a_run_is_the_difference_summed_over_threads() {
        let counters = |wait_ns, slices, involuntary| Counters {
            wait_ns,
            slices,
            involuntary,
        };
        let at = Instant::now();
        let before = Snapshot {
            at,
            threads: [(1, counters(100, 10, 1)), (2, counters(1_000, 20, 2))]
                .into_iter()
                .collect(),
            stall: Stall {
                cpu_us: 10,
                memory_us: 20,
                io_us: 30,
            },
        };
        // Thread 1 exited with its counts, thread 3 started during the run.
        let after = Snapshot {
            at: at + Duration::from_secs(2),
            threads: [(2, counters(3_000, 30, 5)), (3, counters(500, 5, 1))]
                .into_iter()
                .collect(),
            stall: Stall {
                cpu_us: 15,
                memory_us: 20,
                io_us: 130,
            },
        };
        let sched = after.since(&before);
        assert_eq!(
            (sched.wait_ns, sched.slices, sched.involuntary),
            (2_500, 15, 4)
        );
        assert_eq!(sched.wall, Duration::from_secs(2));
        assert_eq!(
            sched.stall,
            Stall {
                cpu_us: 5,
                memory_us: 0,
                io_us: 100
            }
        );
        assert_eq!(sched.wait_per_request_ns(10), 250.0);
        assert_eq!(sched.wait_per_slice_ns(), 2_500.0 / 15.0);
        assert_eq!(sched.wait_share(), 2_500.0 / 2e9);
        assert_eq!(sched.involuntary_per_1000(2_000), 2.0);
    }

    /// Threads that start and exit while the snapshots list and read them
    /// are skipped, never an error.
    #[test]
    fn threads_exiting_while_read_are_skipped() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let churn = {
            let done = done.clone();
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    let short: Vec<_> = (0..8).map(|_| std::thread::spawn(|| ())).collect();
                    short.into_iter().for_each(|t| t.join().unwrap());
                }
            })
        };
        let taken = (0..2_000).map(|_| Snapshot::take(std::process::id()));
        let failed: Vec<String> = taken
            .filter_map(|s| s.err())
            .map(|e| format!("{e:#}"))
            .collect();
        done.store(true, Ordering::Relaxed);
        churn.join().unwrap();
        assert!(
            failed.is_empty(),
            "{} snapshots failed, first: {}",
            failed.len(),
            failed[0]
        );
    }

    #[test]
    fn this_process_can_be_read() {
        let snapshot = Snapshot::take(std::process::id()).unwrap();
        assert!(snapshot.threads.values().any(|c| c.slices > 0));
    }
}
