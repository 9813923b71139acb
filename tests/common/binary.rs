//! The `tally` binary under test, as a child process the test can signal.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::process::{Guarded, file_tail, log_dir, signal};

/// A running `tally run ...`; its output goes to a log file whose tail is printed when a test
/// fails. Killed on drop.
pub struct Tally {
    name: String,
    /// The command and arguments it was started with, for [`Tally::restart`].
    command: (String, Vec<String>),
    proc: Option<Guarded>,
    status: Option<ExitStatus>,
    log: PathBuf,
    dir: Option<TempDir>,
    /// When SIGTERM was sent.
    terminated: Option<Instant>,
}

/// The arguments every test passes to `tally run`: addresses, names, and quick rebalances.
/// A new group reads the backlog from the earliest offset: tally's own start, which `-X` cannot
/// change.
/// `TALLY_TEST_KAFKA_DEBUG=cgrp,...` adds librdkafka debug contexts, logged at debug level.
/// `TALLY_TEST_LAYOUT=packed` counts into the packed layout (fields of small hashes) instead
/// of a string key per counter; [`super::read_counts`] reads either.
pub fn tally_args(
    brokers: &str,
    topic: &str,
    group: &str,
    redis_url: &str,
    prefix: &str,
) -> Vec<String> {
    [
        "--brokers",
        brokers,
        "--topic",
        topic,
        "--group",
        group,
        "--redis",
        redis_url,
        "--prefix",
        prefix,
        "--shutdown-timeout-secs",
        "5",
        "-X",
        "session.timeout.ms=6000",
        "-X",
        "heartbeat.interval.ms=1000",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(test_layout())
    .chain(
        std::env::var("TALLY_TEST_KAFKA_DEBUG")
            .ok()
            .into_iter()
            .flat_map(|d| ["-X".to_string(), format!("debug={d}")]),
    )
    .collect()
}

/// `--layout packed` when `TALLY_TEST_LAYOUT=packed`: hashes that grow, a few fields a hash
/// on average, so that a test's few thousand posts make its hashes split hundreds of times
/// while it runs; with `packed-fixed`, a fixed number of hashes sized small, so that a test's
/// posts fill several. Nothing otherwise; any other value stops the test.
pub fn test_layout() -> Vec<String> {
    let flags: &[&str] = match std::env::var("TALLY_TEST_LAYOUT").as_deref() {
        Ok("packed") => &["--layout", "packed", "--packed-fields", TEST_GROWING_FIELDS],
        Ok("packed-fixed") => &[
            "--layout",
            "packed",
            "--packed-counters",
            TEST_PACKED_COUNTERS,
        ],
        _ => &[],
    };
    test_packing();
    flags.iter().map(|f| f.to_string()).collect()
}

/// The counters a test's packed prefix of a fixed number of hashes is sized for.
const TEST_PACKED_COUNTERS: &str = "20000";
/// The fields a hash of a test's growing packed prefix holds on average.
const TEST_GROWING_FIELDS: &str = "8";

/// The packing of a test's prefix on one server: `None` for string keys, or the packing
/// [`test_layout`] asks for.
pub fn test_packing() -> Option<tally::domain::packing::Packing> {
    use tally::domain::packing::{DEFAULT_PACKED_FIELDS, Growing, Packed, Packing};
    match std::env::var("TALLY_TEST_LAYOUT").as_deref() {
        Err(_) | Ok("") | Ok("strings") => None,
        Ok("packed") => Some(Packing::Growing(Growing {
            fields: TEST_GROWING_FIELDS.parse().expect("a number"),
        })),
        Ok("packed-fixed") => Some(Packing::Packed(Packed::sized(
            TEST_PACKED_COUNTERS.parse().expect("a number"),
            DEFAULT_PACKED_FIELDS,
            1,
        ))),
        Ok(other) => panic!("TALLY_TEST_LAYOUT={other}: expected strings, packed or packed-fixed"),
    }
}

/// The `tally` binary the end-to-end tests run: `TALLY_TEST_BIN`, or the one cargo built.
pub fn tally_bin() -> PathBuf {
    std::env::var_os("TALLY_TEST_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tally")))
}

/// `tally <args>` as cargo built it, waited for: a one-shot command such as `count`, `promote`,
/// `verify` or `gc`.
pub fn tally_cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(args)
        .output()
        .expect("run tally")
}

/// `tally run <args>`, which must end by itself within 30 s (a refusal at start): its output.
pub fn run_refused(args: &[String]) -> Output {
    let mut child = Command::new(tally_bin())
        .arg("run")
        .args(args)
        .env_remove("TALLY_LOG")
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start tally run");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("poll tally").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("reap tally");
            panic!(
                "tally run {args:?} was not refused; it ran for 30 s:\n{}",
                output_text(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().expect("reap tally")
}

/// The one line a refused `tally run` printed, after checking it exited with 1.
pub fn refusal_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(out.status.code(), Some(1), "{}", output_text(out));
    assert_eq!(lines.len(), 1, "expected one line:\n{stderr}");
    lines[0].to_string()
}

/// The error line a `tally run` that stopped on its own printed last (after its log), after
/// checking it exited with 1.
pub fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(out));
    let last = stderr.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    assert!(last.starts_with("error: "), "no error line last:\n{stderr}");
    last.to_string()
}

/// A finished command's stdout followed by its stderr, for assertions and failure messages.
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

impl Tally {
    pub fn spawn(args: &[&str]) -> Tally {
        Self::spawn_named("tally", args)
    }

    /// Like `spawn`, with owned arguments.
    pub fn spawn_args(name: &str, args: &[String]) -> Tally {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::spawn_named(name, &args)
    }

    /// `name` labels progress lines and log tails (e.g. "consumer-a").
    pub fn spawn_named(name: &str, args: &[&str]) -> Tally {
        Self::spawn_command(name, "run", args)
    }

    /// `tally <command> args...`, e.g. a `rebuild` the test may SIGKILL.
    pub fn spawn_command(name: &str, command: &str, args: &[&str]) -> Tally {
        let dir = log_dir("tally-");
        let log = dir.path().join(format!("{name}.log"));
        let file = File::create(&log).expect("create tally log");
        let mut cmd = Command::new(tally_bin());
        cmd.arg(command)
            .args(args)
            .current_dir(dir.path())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        if std::env::var_os("TALLY_TEST_KAFKA_DEBUG").is_some()
            && std::env::var_os("TALLY_LOG").is_none()
        {
            cmd.env("TALLY_LOG", "info,librdkafka=debug");
        }
        let proc = Guarded::spawn(&mut cmd).expect("spawn tally");
        eprintln!(
            "[harness] {name} started (pid {}): {}",
            proc.pid(),
            args.join(" ")
        );
        Tally {
            name: name.to_string(),
            command: (
                command.to_string(),
                args.iter().map(|a| a.to_string()).collect(),
            ),
            proc: Some(proc),
            status: None,
            log,
            dir: Some(dir),
            terminated: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.proc.as_ref().expect("process already gone").pid()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn log_tail(&self, lines: usize) -> String {
        file_tail(&self.log, lines)
    }

    pub fn log_text(&self) -> String {
        file_tail(&self.log, usize::MAX)
    }

    /// Exit status if the process has exited.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none()
            && let Some(p) = self.proc.as_mut()
            && let Ok(Some(status)) = p.child.try_wait()
        {
            p.release_watchdog();
            self.status = Some(status);
        }
        self.status
    }

    /// Panics with the log tail if the process has exited.
    pub fn assert_running(&mut self) {
        if let Some(status) = self.try_status() {
            panic!(
                "{} exited unexpectedly ({status}); log tail:\n{}",
                self.name,
                self.log_tail(40)
            );
        }
    }

    /// SIGTERM (it must exit 0 within 30 s), then the same command again under the same name.
    pub fn restart(&mut self) {
        let status = self.sigterm_and_wait(Duration::from_secs(30));
        assert!(status.success(), "{} exited with {status}", self.name);
        let (command, args) = self.command.clone();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        *self = Tally::spawn_command(&self.name, &command, &args);
    }

    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
        eprintln!("[harness] {} killed with SIGKILL", self.name);
    }

    pub fn sigstop(&self) {
        signal(self.pid(), "STOP");
        eprintln!("[harness] {} stopped (SIGSTOP)", self.name);
    }

    pub fn sigcont(&self) {
        signal(self.pid(), "CONT");
        eprintln!("[harness] {} continued (SIGCONT)", self.name);
    }

    /// SIGTERM, then wait up to `timeout` for the exit; panics with the log tail on timeout.
    pub fn sigterm_and_wait(&mut self, timeout: Duration) -> ExitStatus {
        self.sigterm();
        self.wait_exit(timeout)
    }

    /// SIGTERM without waiting; panics when it had exited already.
    pub fn sigterm(&mut self) {
        if let Some(status) = self.try_status() {
            panic!(
                "{} had already exited ({status}) before SIGTERM; log tail:\n{}",
                self.name,
                self.log_tail(40)
            );
        }
        self.wait_catches_sigterm();
        self.terminated = Some(Instant::now());
        signal(self.pid(), "TERM");
    }

    /// Waits (at most 10 s) until the process has a handler for SIGTERM (`SigCgt` in
    /// /proc/PID/status), so a signal sent right after the start meets tally's shutdown rather
    /// than the default action of a process still reading its flags.
    fn wait_catches_sigterm(&mut self) {
        const SIGTERM_BIT: u64 = 1 << (15 - 1);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && self.try_status().is_none() {
            let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()));
            let caught = status.ok().and_then(|text| {
                let mask = text.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
                u64::from_str_radix(mask.trim(), 16).ok()
            });
            if caught.is_some_and(|mask| mask & SIGTERM_BIT != 0) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits up to `timeout` for the exit that a [`Tally::sigterm`] asked for; panics with the
    /// log tail on timeout.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let start = self.terminated.unwrap_or_else(Instant::now);
        loop {
            if let Some(status) = self.try_status() {
                eprintln!(
                    "[harness] {} exited with {status} {:.1} s after SIGTERM",
                    self.name,
                    start.elapsed().as_secs_f64()
                );
                return status;
            }
            if start.elapsed() > timeout {
                let tail = self.log_tail(40);
                self.kill9();
                panic!(
                    "{} did not exit within {timeout:?} of SIGTERM; log tail:\n{tail}",
                    self.name
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
        if thread::panicking() {
            eprintln!(
                "[harness] {} log tail ({}):\n{}",
                self.name,
                self.log.display(),
                self.log_tail(40)
            );
            // keep the whole log for a post-mortem
            if let Some(dir) = self.dir.take() {
                let _ = dir.keep();
            }
        }
    }
}

/// The lab's binary, `tally-lab`, beside the `tally` cargo built for these tests: it belongs to
/// another package of the workspace, whose binaries cargo builds for its own tests only
/// (scripts/test builds it before the tests run).
pub fn lab_bin() -> PathBuf {
    let tally = Path::new(env!("CARGO_BIN_EXE_tally"));
    let lab = tally.with_file_name("tally-lab");
    let release = tally.parent().is_some_and(|dir| dir.ends_with("release"));
    assert!(
        lab.is_file(),
        "{} is missing: build it first with `cargo build -p tally-lab{}`",
        lab.display(),
        if release { " --release" } else { "" }
    );
    lab
}
