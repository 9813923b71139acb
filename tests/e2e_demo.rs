//! `tally-lab demo` stopped the way a person stops it: Ctrl-C in a terminal, which sends SIGINT
//! to the whole foreground process group. The demo's private broker and redis-server must survive
//! that signal, so that the demo can let the aggregator catch up, check every count against the
//! generator's own and exit 0.
//!
//! `tally-lab bench` stopped with SIGTERM (or Ctrl-C) mid-run: nothing it started may outlive
//! it, and its scratch directory (the broker's log, gigabytes after a run) goes with them.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

#[test]
fn ctrl_c_stops_the_demo_after_its_final_check() {
    common::require_kafka();
    // The demo in a process group of its own, as a shell puts a foreground job.
    let mut demo = Command::new(common::lab_bin());
    demo.args([
        "demo",
        "--rate",
        "2000",
        "--viral-rate",
        "300",
        "--partitions",
        "2",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0);
    for (name, _) in std::env::vars().filter(|(k, _)| k.starts_with("TALLY_")) {
        demo.env_remove(name);
    }
    let mut child = demo.spawn().expect("start tally-lab demo");
    let group = child.id();
    let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
    let (lines_tx, lines) = mpsc::channel();
    let reader = thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let stderr = child.stderr.take().expect("piped stderr");
    let errors = thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut text).ok();
        text
    });

    // Wait for three rows of the live table: the pipeline is counting.
    let mut seen = Vec::new();
    let rows = loop {
        match lines.recv_timeout(Duration::from_secs(90)) {
            Ok(line) => {
                seen.push(line.clone());
                if seen
                    .iter()
                    .filter(|l| l.trim_start().starts_with(char::is_numeric))
                    .count()
                    >= 3
                {
                    break seen.len();
                }
            }
            Err(_) => {
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{group}")])
                    .status();
                let _ = child.wait();
                panic!(
                    "the demo printed no table within 90 s:\n{}\nstderr:\n{}",
                    seen.join("\n"),
                    errors.join().unwrap_or_default()
                );
            }
        }
    };
    assert!(rows > 0);
    let status = Command::new("kill")
        .args(["-INT", "--", &format!("-{group}")])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -INT -{group} failed");

    let (exit_tx, exit) = mpsc::channel();
    let waiter = thread::spawn(move || {
        let _ = exit_tx.send(child.wait());
    });
    let status = match exit.recv_timeout(Duration::from_secs(90)) {
        Ok(status) => status.expect("wait for the demo"),
        Err(_) => {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{group}")])
                .status();
            panic!("the demo did not exit within 90 s of Ctrl-C");
        }
    };
    waiter.join().unwrap();
    reader.join().unwrap();
    seen.extend(lines.try_iter());
    let stderr = errors.join().unwrap();
    let out = seen.join("\n");
    assert!(
        status.success(),
        "the demo exited with {status} after Ctrl-C\nstdout:\n{out}\nstderr:\n{stderr}"
    );
    assert!(
        out.contains("check: all ") && out.contains("match the generator's own count exactly"),
        "no final check after Ctrl-C\nstdout:\n{out}\nstderr:\n{stderr}"
    );
    let noisy = stderr
        .lines()
        .filter(|l| l.contains("Connection refused"))
        .count();
    assert_eq!(noisy, 0, "the services died under the demo:\n{stderr}");
}

#[test]
fn a_signal_stops_the_bench_with_everything_it_started() {
    common::require_kafka();
    let tally = Path::new(env!("CARGO_BIN_EXE_tally"));
    let mut bench = Command::new(common::lab_bin());
    bench
        .arg("--tally-bin")
        .arg(tally)
        .args(["bench", "--events", "2000000", "--partitions", "2"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    for (name, _) in std::env::vars().filter(|(k, _)| k.starts_with("TALLY_")) {
        bench.env_remove(name);
    }
    let mut child = bench.spawn().expect("start tally-lab bench");
    let group = child.id();
    let stderr = BufReader::new(child.stderr.take().expect("piped stderr"));
    let (lines_tx, lines) = mpsc::channel();
    let reader = thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let kill_group = || {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{group}")])
            .status();
    };
    // "broker 127.0.0.1:P, redis redis://..., logs in DIR": both services run.
    let mut seen = Vec::new();
    let dir = loop {
        match lines.recv_timeout(Duration::from_secs(120)) {
            Ok(line) => {
                seen.push(line.clone());
                if let Some((_, dir)) = line.split_once(", logs in ") {
                    break PathBuf::from(dir.trim());
                }
            }
            Err(_) => {
                kill_group();
                panic!(
                    "the bench started no services within 120 s:\n{}",
                    seen.join("\n")
                );
            }
        }
    };
    assert!(dir.is_dir(), "{} named but missing", dir.display());
    let started = descendants(group);
    assert!(
        started.len() >= 2,
        "the bench has no broker and redis-server under it (processes {started:?})"
    );
    // Give the producer time to write into the broker's log.
    thread::sleep(Duration::from_secs(3));
    let status = Command::new("kill")
        .args(["-TERM", &group.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -TERM {group} failed");
    let (exit_tx, exit) = mpsc::channel();
    thread::spawn(move || {
        let _ = exit_tx.send(child.wait());
    });
    let status = match exit.recv_timeout(Duration::from_secs(30)) {
        Ok(status) => status.expect("wait for the bench"),
        Err(_) => {
            kill_group();
            panic!("the bench did not exit within 30 s of SIGTERM");
        }
    };
    // The reader ends when the last holder of the bench's stderr does: not joined, since a
    // service left running would hold it open.
    drop(reader);
    thread::sleep(Duration::from_millis(200));
    seen.extend(lines.try_iter());
    let said = seen.join("\n");
    assert_eq!(
        status.code(),
        Some(130),
        "exit after SIGTERM: {status}\n{said}"
    );
    let left: Vec<u32> = started.into_iter().filter(|&pid| alive(pid)).collect();
    for pid in &left {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    assert!(
        left.is_empty(),
        "processes {left:?} outlived the bench that started them\n{said}"
    );
    assert!(
        !dir.exists(),
        "{} outlived the bench that made it\n{said}",
        dir.display()
    );
}

/// Every process below `root`, from each process's parent in `/proc/PID/stat`.
fn descendants(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let (_, rest) = stat.rsplit_once(')')?;
            let parent = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, parent))
        })
        .collect();
    let mut found = vec![root];
    let mut next = 0;
    while next < found.len() {
        let parent = found[next];
        found.extend(
            parents
                .iter()
                .filter(|&&(_, p)| p == parent)
                .map(|&(c, _)| c),
        );
        next += 1;
    }
    found.remove(0);
    found
}

/// Whether `pid` runs (a zombie waiting for its parent does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}
