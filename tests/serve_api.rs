//! The read API facing the network: `tally serve`'s request limits, each with its own setting,
//! hold against a real server (a batch over `--max-ids`, a body over `--max-body-bytes`, a client
//! that never sends the body it announced, more requests than `--max-concurrent-requests`), and a
//! schemathesis fuzz run of every route against docs/openapi.yaml finds no 500, no hang and no
//! answer outside the description.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SCHEMATHESIS_INSTALL: &str = "python3 -m pip install schemathesis==4.32.5";

/// A `tally serve` on a free port over a prefix with a layout record and a few counts.
struct Served {
    addr: String,
    child: Child,
    _redis: RedisServer,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(extra: &[&str]) -> Served {
    let redis = RedisServer::start();
    let prefix = unique("api");
    let mut conn = redis.conn();
    write_layout_record(&mut conn, &prefix, 4);
    // Windows of one minute, one hour and one day, with post 1 in the current hour.
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}:layout"))
        .arg(&[
            ("format", "4"),
            ("windows", "1m,1h,1d"),
            ("window_lateness_ms", "300000"),
            ("window_retention_ms", "86400000"),
        ])
        .query(&mut conn)
        .unwrap();
    let hour = now_ms() / 3_600_000 * 3_600_000;
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}:win:1h:{hour}"))
        .arg(&1u64.to_be_bytes()[..])
        .arg(3)
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(format!("{prefix}:top:1h:{hour}"))
        .arg(3)
        .arg(&1u64.to_be_bytes()[..])
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}:likes:1:0"))
        .arg(5)
        .query(&mut conn)
        .unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let child = Command::new(tally_bin())
        .args(["serve", "--listen", &addr, "--redis", &redis.url()])
        .args(["--prefix", &prefix])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tally serve");
    wait_for("tally serve to listen", Duration::from_secs(20), || {
        TcpStream::connect(&addr).ok()
    });
    Served {
        addr,
        child,
        _redis: redis,
    }
}

/// Sends `request` as is and reads the answer: status and body, and how long it took.
fn raw(addr: &str, request: &str) -> (u16, String, Duration) {
    let began = Instant::now();
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    stream.write_all(request.as_bytes()).expect("send");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until the head and the announced body are in (the connection may stay open).
    loop {
        let n = stream
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("no answer to {request:?} within 15 s: {e}"));
        answer.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&answer).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse::<usize>().unwrap())
            });
            if n == 0 || length.is_some_and(|len| body.len() >= len) {
                let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
                return (status, body.to_string(), began.elapsed());
            }
        }
        assert!(n > 0, "connection closed before an answer: {text:?}");
    }
}

fn get(addr: &str, path: &str) -> (u16, String) {
    let (status, body, _) = raw(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"),
    );
    (status, body)
}

/// A request that announces a body and never sends it: it holds its connection (and a slot)
/// until the server gives up on it.
fn stalled(addr: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET /v1/posts/1/likes HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 10\r\n\r\n"
    )
    .unwrap();
    stream
}

#[test]
fn a_batch_over_max_ids_is_refused() {
    let served = serve(&["--max-ids", "3"]);
    assert_eq!(
        get(&served.addr, "/v1/likes?post_id=1&post_id=2&post_id=3").0,
        200
    );
    let (status, body) = get(
        &served.addr,
        "/v1/likes?post_id=1&post_id=2&post_id=3&post_id=4",
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("at most 3 post ids"), "{body}");
}

#[test]
fn a_body_over_max_body_bytes_is_refused() {
    let served = serve(&["--max-body-bytes", "16"]);
    let addr = &served.addr;
    let with_body = |body: &str| {
        raw(
            addr,
            &format!(
                "GET /v1/posts/1/likes HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        )
    };
    assert_eq!(with_body("short").0, 200);
    let (status, body, _) = with_body(&"x".repeat(17));
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("limited to 16 bytes"), "{body}");
    // A chunked body announces no length: it is cut at the limit all the same.
    let chunk = "y".repeat(40);
    let (status, body, _) = raw(
        addr,
        &format!(
            "GET /v1/posts/1/likes HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
            chunk.len()
        ),
    );
    assert_eq!(status, 413, "{body}");
}

#[test]
fn a_request_that_does_not_finish_is_answered_at_the_timeout() {
    let served = serve(&["--request-timeout-ms", "500"]);
    let mut stream = stalled(&served.addr);
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let began = Instant::now();
    let mut answer = [0u8; 512];
    let n = stream.read(&mut answer).expect("an answer within 10 s");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("no answer within 500 ms"), "{answer}");
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "{:?}",
        began.elapsed()
    );
}

#[test]
fn requests_over_max_concurrent_are_refused_at_once() {
    let served = serve(&[
        "--max-concurrent-requests",
        "2",
        "--request-timeout-ms",
        "3000",
    ]);
    let held: Vec<TcpStream> = (0..2).map(|_| stalled(&served.addr)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let (status, body, took) = raw(
        &served.addr,
        &format!(
            "GET /healthz HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            served.addr
        ),
    );
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("more than 2 requests at once"), "{body}");
    assert!(took < Duration::from_secs(1), "refused only after {took:?}");
    drop(held);
    wait_for("a free slot again", Duration::from_secs(10), || {
        (get(&served.addr, "/healthz").0 == 200).then_some(())
    });
}

#[test]
fn bad_limits_are_one_line_each() {
    let out = tally_cli(&[
        "serve",
        "--max-ids",
        "0",
        "--request-timeout-ms",
        "0",
        "--redis",
        "redis://127.0.0.1:1/",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines,
        [
            "error: --max-ids: must be between 1 and 100000",
            "error: --request-timeout-ms: must be between 1 and 600000"
        ]
    );
}

/// The schemathesis command line, or a panic naming how to install it.
fn schemathesis() -> Command {
    let found = Command::new("schemathesis")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "schemathesis is not installed; run: {SCHEMATHESIS_INSTALL} (scripts/test does)"
    );
    Command::new("schemathesis")
}

#[test]
fn a_fuzz_run_against_the_published_description_finds_no_fault() {
    let mut st = schemathesis();
    let served = serve(&["--request-timeout-ms", "2000"]);
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/openapi.yaml");
    let report = tempfile::tempdir().unwrap();
    let out = st
        .current_dir(report.path())
        .args(["run", spec.to_str().unwrap()])
        .args(["--url", &format!("http://{}", served.addr)])
        .args([
            "--checks",
            "all",
            "--max-examples",
            "200",
            "--request-timeout",
            "10",
            "--max-response-time",
            "5",
        ])
        .args(["--phases", "examples,coverage,fuzzing", "--seed", "1"])
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .expect("run schemathesis");
    let text = output_text(&out);
    assert!(out.status.success(), "schemathesis found faults:\n{text}");
    assert!(!text.contains("500 Internal"), "{text}");
}

/// The window reads answer from the window's counts and leaders, and a window the prefix does not keep is a
/// 400 naming the ones it keeps.
#[test]
fn window_reads_answer_from_the_windows_set() {
    let served = serve(&[]);
    let (status, body) = get(&served.addr, "/v1/trending?window=1h&limit=5");
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        answer["posts"],
        serde_json::json!([{"post_id": 1, "likes": 3}])
    );
    assert_eq!(answer["window"], "1h");
    let (status, body) = get(&served.addr, "/v1/posts/1/likes?window=1h");
    assert_eq!(status, 200, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["likes"], 3);
    let (status, body) = get(&served.addr, "/v1/posts/1/likes?window=1m");
    assert_eq!(
        (status, body.contains("\"likes\":0")),
        (200, true),
        "{body}"
    );
    let (status, body) = get(&served.addr, "/v1/trending?window=2h");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("it keeps 1m,1h,1d"), "{body}");
    let (status, body) = get(&served.addr, "/v1/trending");
    assert_eq!(status, 400, "{body}");
    let (status, body) = get(&served.addr, "/v1/trending?window=1h&limit=0");
    assert_eq!(status, 400, "{body}");
}
