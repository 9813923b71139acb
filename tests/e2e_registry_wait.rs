//! Routing versions wait for Redis replicas before they are published, on a
//! real cluster with one replica per primary: a reservation that no replica
//! acknowledged in time is not published (a failover could hand its number
//! out again for other buckets), the refusal names the setting, and
//! `--registry-replicas` decides how many replicas it takes. On a lone server
//! `auto` waits for none, and a number it cannot meet is refused.

mod cluster;
mod common;

use std::time::{Duration, Instant};

use cluster::RedisCluster;
use common::*;

fn registry_entry(
    conn: &mut impl redis::ConnectionLike,
    prefix: &str,
    post: u64,
) -> Option<String> {
    redis::cmd("HGET")
        .arg(format!("{prefix}:routes"))
        .arg(post)
        .query(conn)
        .unwrap()
}

/// `tally promote` of `post`, waiting at most `wait_ms` for the replicas.
fn promote_waiting(
    url: &str,
    prefix: &str,
    post: u64,
    wait_ms: u64,
    extra: &[&str],
) -> std::process::Output {
    let (post, wait_ms) = (post.to_string(), wait_ms.to_string());
    let args = [
        &["promote", post.as_str(), "--to-buckets", "32"][..],
        &[
            "--redis",
            url,
            "--prefix",
            prefix,
            "--registry-wait-ms",
            wait_ms.as_str(),
        ],
        extra,
    ]
    .concat();
    tally_cli(&args)
}

/// `tally promote` of `post`, waiting at most half a second for the replicas.
fn promote(url: &str, prefix: &str, post: u64, extra: &[&str]) -> std::process::Output {
    promote_waiting(url, prefix, post, 500, extra)
}

#[test]
fn a_promotion_no_replica_acknowledged_is_not_published() {
    let cluster = RedisCluster::start(3, 1);
    let url = cluster.url();
    let prefix = format!("wait-{}", rand::random::<u32>());
    let mut conn = redis::cluster::ClusterClient::new(vec![format!(
        "redis://127.0.0.1:{}/",
        cluster.nodes[0].port
    )])
    .unwrap()
    .get_connection()
    .unwrap();
    write_layout_record_with(&mut conn, &prefix, 16, 128);
    cluster.wait_replicas_linked(1);

    // A primary counts a replica that just finished its sync only from its first
    // acknowledgement, up to a second later: the healthy case gives it that long.
    let healthy = promote_waiting(&url, &prefix, 7, 5_000, &[]);
    assert!(
        healthy.status.success(),
        "promote with replicas up: {healthy:?}"
    );
    assert!(registry_entry(&mut conn, &prefix, 7).is_some());

    let replicas = cluster.replicas();
    assert_eq!(replicas.len(), 3, "one replica per primary");
    for node in cluster.nodes.iter().filter(|n| replicas.contains(&n.port)) {
        node.pause();
    }
    let started = Instant::now();
    let stuck = promote(&url, &prefix, 8, &[]);
    let took = started.elapsed();
    let line = error_line(&stuck);
    assert!(
        !stuck.status.success(),
        "promote with every replica stopped: {stuck:?}"
    );
    assert!(
        line.contains("0 of 1 Redis replicas acknowledged") && line.contains("--registry-replicas"),
        "{line}"
    );
    assert!(
        registry_entry(&mut conn, &prefix, 8).is_none(),
        "an unacknowledged reservation was published"
    );
    assert!(took < Duration::from_secs(20), "the refusal took {took:?}");

    // The operator's choice: publish without waiting.
    let unwaited = promote(&url, &prefix, 8, &["--registry-replicas", "0"]);
    assert!(
        unwaited.status.success(),
        "--registry-replicas 0: {unwaited:?}"
    );
    assert!(registry_entry(&mut conn, &prefix, 8).is_some());
    for node in cluster.nodes.iter().filter(|n| replicas.contains(&n.port)) {
        node.resume();
    }
}

#[test]
fn a_lone_server_waits_for_no_replica_unless_told_to() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let prefix = format!("wait-{}", rand::random::<u32>());
    write_layout_record(&mut conn, &prefix, 16);
    let url = redis.url();
    let auto = promote(&url, &prefix, 7, &[]);
    assert!(auto.status.success(), "auto on a lone server: {auto:?}");
    let one = promote(&url, &prefix, 9, &["--registry-replicas", "1"]);
    let line = error_line(&one);
    assert!(
        !one.status.success() && line.contains("0 of 1 Redis replicas acknowledged"),
        "{one:?}"
    );
    assert!(registry_entry(&mut conn, &prefix, 9).is_none());
    let bad = promote(&url, &prefix, 9, &["--registry-replicas", "some"]);
    assert!(
        error_line(&bad).contains("--registry-replicas: expected `auto` or a number"),
        "{bad:?}"
    );
}
