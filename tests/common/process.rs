//! Child processes that cannot outlive the test process, and log files for them.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use tempfile::TempDir;

/// A child process plus a watchdog that SIGKILLs it once this process's end of a pipe closes.
pub(crate) struct Guarded {
    pub(crate) child: Child,
    watchdog: Child,
}

impl Guarded {
    pub(crate) fn spawn(cmd: &mut Command) -> std::io::Result<Guarded> {
        let mut child = cmd.stdin(Stdio::null()).spawn()?;
        // `read` returns on EOF, i.e. when this process (the only writer) is gone.
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!("read _ ; kill -9 {} 2>/dev/null", child.id()))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match watchdog {
            Ok(watchdog) => Ok(Guarded { child, watchdog }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL and reap the child. The watchdog goes first so it can never signal a reused pid.
    pub(crate) fn kill(&mut self) {
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Reaps the watchdog after the child exited by itself.
    pub(crate) fn release_watchdog(&mut self) {
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} {pid} failed: {status}");
}

/// A directory for logs of this test binary's children, under cargo's per-target tmp dir.
pub(crate) fn log_dir(prefix: &str) -> TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&base).expect("create CARGO_TARGET_TMPDIR");
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .expect("create log dir")
}

/// The last `lines` lines of a text file (empty if it cannot be read).
pub fn file_tail(path: &Path, lines: usize) -> String {
    let mut text = String::new();
    if let Ok(mut f) = File::open(path) {
        let mut bytes = Vec::new();
        let _ = f.read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    let all: Vec<&str> = text.lines().collect();
    let start = all.len().saturating_sub(lines);
    all[start..].join("\n")
}
