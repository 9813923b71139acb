//! The lab's log lines in a file are plain text: colour codes are for a terminal only.

use std::fs::File;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `tally-lab produce` to a port nothing listens on, with rdkafka's trace lines asked for: the
/// first, as it creates its client, is logged at once; the command is stopped then (it would
/// wait ten seconds for the broker before giving up).
#[test]
fn log_lines_in_a_file_carry_no_colour_codes() {
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        listener.local_addr().expect("its address").port()
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    let log = dir.path().join("stderr.log");
    let mut command = Command::new(env!("CARGO_BIN_EXE_tally-lab"));
    command
        .args([
            "produce",
            "--brokers",
            &format!("127.0.0.1:{port}"),
            "--events",
            "1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&log).expect("create the log file"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TALLY_") {
            command.env_remove(name);
        }
    }
    // Without NO_COLOR, which turns colour off wherever it goes.
    command
        .env_remove("NO_COLOR")
        .env("TALLY_LOG", "rdkafka=trace");
    let mut child = command.spawn().expect("start tally-lab produce");

    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = std::fs::read_to_string(&log).expect("read the log file");
        let ended = child.try_wait().expect("wait for tally-lab").is_some();
        if text.contains("librdkafka client") || ended || Instant::now() >= deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        text.contains("TRACE") && text.contains("librdkafka client"),
        "no log line to look at:\n{text}"
    );
    assert!(!text.contains("\x1b["), "colour codes in a file:\n{text:?}");
}
