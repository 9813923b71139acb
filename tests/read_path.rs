//! The read path against a real redis-server: sums over every version and the base, one fetch
//! for many posts, coalesced concurrent misses, the cache's TTL, and the HTTP front's answers
//! (counts, bad ids, too many ids, unknown paths and methods), all as JSON.

mod common;
mod library;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use tally::domain::routing::{CounterId, KeyLayout};
use tally::read::Reader;

const DEFAULT_BUCKETS: u32 = 4;

/// Writes counters by hand: post 1 in the default layout, post 2 with three versions and a base.
/// Returns the expected counts.
fn seed_counts(conn: &mut redis::Connection, prefix: &str) -> Vec<(u64, i64)> {
    let keys = KeyLayout::new(prefix);
    // What the first `tally run` on the prefix writes: version 0 has 4 buckets.
    write_layout_record(conn, prefix, 4);
    let set = |conn: &mut redis::Connection, id: CounterId, value: i64| {
        let _: () = redis::cmd("SET")
            .arg(keys.key_of(id))
            .arg(value)
            .query(conn)
            .unwrap();
    };
    set(conn, CounterId::v0(1, 0), 5);
    set(conn, CounterId::v0(1, 3), 7);
    set(conn, CounterId::v0(2, 1), 11);
    for (version, bucket, value) in [(1, 0, 100), (1, 31, 200), (3, 1, -4)] {
        let id = CounterId {
            post_id: 2,
            version,
            bucket,
        };
        set(conn, id, value);
    }
    // A key of a version the route hash does not list is not part of the count.
    set(
        conn,
        CounterId {
            post_id: 2,
            version: 9,
            bucket: 0,
        },
        1_000_000,
    );
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}:route:2"))
        .arg(&["v0", "4", "v1", "32", "v3", "2", "base", "30"])
        .query(conn)
        .unwrap();
    vec![(1, 12), (2, 11 + 300 - 4 + 30), (3, 0)]
}

fn reader(url: &str, prefix: &str, ttl: Duration) -> (tokio::runtime::Runtime, Reader) {
    library::reader(url, prefix, 1, DEFAULT_BUCKETS, ttl)
}

#[test]
fn reader_sums_every_version_coalesces_misses_and_caches() {
    let redis = RedisServer::start();
    let prefix = unique("read");
    let mut conn = redis.conn();
    let expected = seed_counts(&mut conn, &prefix);
    let (rt, reader) = reader(&redis.url(), &prefix, Duration::from_millis(500));

    let posts: Vec<u64> = expected.iter().map(|&(p, _)| p).collect();
    let counts = rt.block_on(reader.counts(&posts)).unwrap();
    let got: Vec<(u64, i64)> = counts.iter().map(|c| (c.post_id, c.likes)).collect();
    assert_eq!(got, expected);
    assert_eq!(reader.fetches(), 1, "three posts take one fetch");

    // Cached: no fetch, even after the counters move.
    let _: () = redis::cmd("INCRBY")
        .arg(KeyLayout::new(&prefix).counter_key(1, 0))
        .arg(100)
        .query(&mut conn)
        .unwrap();
    assert_eq!(rt.block_on(reader.count(1)).unwrap().likes, 12);
    assert_eq!(reader.fetches(), 1);
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(rt.block_on(reader.count(1)).unwrap().likes, 112);
    assert_eq!(reader.fetches(), 2, "an expired entry is fetched again");

    // Fifty concurrent misses of one post: one fetch.
    std::thread::sleep(Duration::from_millis(600));
    let before = reader.fetches();
    let results = rt.block_on(async {
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let reader = reader.clone();
                tokio::spawn(async move { reader.count(2).await })
            })
            .collect();
        futures::future::join_all(tasks).await
    });
    for result in results {
        assert_eq!(result.unwrap().unwrap().likes, 337);
    }
    assert_eq!(reader.fetches() - before, 1, "concurrent misses coalesce");

    // Repeated ids are answered in the order asked.
    let counts = rt.block_on(reader.counts(&[3, 1, 3])).unwrap();
    let got: Vec<u64> = counts.iter().map(|c| c.post_id).collect();
    assert_eq!(got, vec![3, 1, 3]);
}

/// One HTTP/1.1 request; returns the status code and the body.
fn http(addr: &str, method: &str, path: &str) -> (u16, serde_json::Value) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status: u16 = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"));
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{method} {path}: not JSON:\n{head}"
    );
    let body = serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {body:?}"));
    (status, body)
}

#[test]
fn http_answers_counts_and_errors_as_json() {
    let redis = RedisServer::start();
    let prefix = unique("serve");
    let mut conn = redis.conn();
    let expected = seed_counts(&mut conn, &prefix);
    let addr = format!("127.0.0.1:{}", free_port());
    let mut server = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args([
            "serve",
            "--listen",
            &addr,
            "--redis",
            &redis.url(),
            "--prefix",
            &prefix,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("tally serve to listen", Duration::from_secs(20), || {
        TcpStream::connect(&addr).ok()
    });

    let (status, body) = http(&addr, "GET", "/v1/posts/2/likes");
    assert_eq!(status, 200);
    assert_eq!(body["post_id"], 2);
    assert_eq!(body["likes"], expected[1].1);
    assert!(body["as_of_ms"].as_i64().unwrap() > 1_700_000_000_000);

    let (status, body) = http(&addr, "GET", "/v1/likes?post_id=1&post_id=2&post_id=3");
    assert_eq!(status, 200);
    let got: Vec<(u64, i64)> = body["likes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["post_id"].as_u64().unwrap(), c["likes"].as_i64().unwrap()))
        .collect();
    assert_eq!(got, expected);

    let max = (0..1000)
        .map(|i| format!("post_id={i}"))
        .collect::<Vec<_>>()
        .join("&");
    assert_eq!(http(&addr, "GET", &format!("/v1/likes?{max}")).0, 200);
    for (path, want) in [
        ("/v1/posts/abc/likes", 400),
        ("/v1/posts/-1/likes", 400),
        ("/v1/posts/18446744073709551616/likes", 400),
        ("/v1/likes", 400),
        ("/v1/likes?post_id=", 400),
        ("/v1/likes?post=1", 400),
        (&format!("/v1/likes?{max}&post_id=1"), 400),
        ("/v1/nothing", 404),
        ("/", 404),
    ] {
        let (status, body) = http(&addr, "GET", path);
        assert_eq!(status, want, "{path}: {body}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
    let (status, body) = http(&addr, "POST", "/v1/posts/1/likes");
    assert_eq!(status, 405, "{body}");
    assert!(body["error"].is_string());
    let (status, _) = http(&addr, "GET", "/v1/posts/18446744073709551615/likes");
    assert_eq!(status, 200, "u64::MAX is a valid id");

    // /metrics: every answer by route and status, its latency, the cache and Redis fetches.
    let (status, text) = http_get(&addr, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200);
    let requests = |route: &str, status: u16| {
        metric_value(
            &text,
            &format!("tally_read_requests_total{{route=\"{route}\",status=\"{status}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(requests("/v1/posts/{id}/likes", 200), 2.0, "{text}");
    assert_eq!(requests("/v1/posts/{id}/likes", 400), 3.0, "{text}");
    assert_eq!(requests("/v1/likes", 200), 2.0, "{text}");
    assert_eq!(requests("other", 404), 2.0, "{text}");
    assert!(text.contains("tally_read_request_seconds_bucket{route=\"/v1/likes\""));
    assert!(metric_value(&text, "tally_read_cache_misses_total").unwrap_or(0.0) >= 1000.0);
    assert!(metric_value(&text, "tally_read_fetches_total").unwrap_or(0.0) >= 3.0);

    // Redis gone: 503 with a JSON error, and the server keeps running.
    drop(redis);
    let (status, body) = http(&addr, "GET", "/v1/posts/123456789/likes");
    assert_eq!(status, 503, "{body}");
    assert!(server.try_wait().unwrap().is_none(), "tally serve exited");
    server.kill().unwrap();
    let _ = server.wait();
}
