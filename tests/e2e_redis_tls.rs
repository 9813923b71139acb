//! Redis over TLS with a private CA and mutual TLS, on one server and on a cluster whose nodes
//! talk TLS to each other too: counts are exact with `--redis-tls-ca-cert-file`,
//! `--redis-tls-cert-file` and `--redis-tls-key-file`, and a wrong CA, an expired certificate, a
//! host name the certificate does not list and a missing client certificate each stop
//! `tally run` with one line that names the problem and the setting that fixes it.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;

const PARTITIONS: i32 = 4;

/// `tally run` arguments for `run` against `url`, with `tls` flags.
fn args(run: &Scenario, url: &str, tls: &[String]) -> Vec<String> {
    let mut args = run.tally_args(url);
    args.extend(tls.iter().cloned());
    args
}

/// `tally run` is refused at start; its one line must name `problem` and `setting`.
fn assert_refused(args: &[String], problem: &str, setting: &str) {
    let out = run_refused(args);
    let line = refusal_line(&out);
    eprintln!("[tls] refused: {line}");
    assert!(line.starts_with("error: TLS to Redis at "), "{line}");
    assert!(
        line.contains(problem),
        "the line names the problem '{problem}': {line}"
    );
    assert!(
        line.contains(setting),
        "the line names the setting '{setting}': {line}"
    );
    assert!(!line.contains("is redis-server running"), "{line}");
}

#[test]
fn one_server_counts_exactly_over_mutual_tls() {
    let pki = Pki::new();
    let server = TlsRedis::start(&pki);
    let run = Scenario::new(
        "one_server_counts_exactly_over_mutual_tls",
        "tls1",
        PARTITIONS,
    );
    let mut workload = Workload::new(run.seed, PARTITIONS);
    let first = workload.grow(3_000);
    produce(&run.brokers, &run.topic, workload.messages(first));
    // By name: the certificate lists localhost, and rustls checks it.
    let mut tally = Tally::spawn_args(
        "tally",
        &args(&run, &server.url("localhost"), &pki.redis_flags()),
    );
    let mut conn = pki.redis_conn(server.port);
    let hwms = run.hwms(workload.events.len());
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &workload.truth);
    let clients: String = redis::cmd("CLIENT").arg("LIST").query(&mut conn).unwrap();
    assert!(
        clients.lines().count() >= 2,
        "tally holds TLS connections:\n{clients}"
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(30)).success());
}

#[test]
fn one_server_refusals_name_the_certificate_problem_and_the_setting() {
    let pki = Pki::new();
    let server = TlsRedis::start(&pki);
    let run = Scenario::new("one_server_refusals", "tlsr", 1);
    let mut conn = pki.redis_conn(server.port);
    let url = server.url("localhost");
    let client = pki.pair("client");
    let with_ca = |ca: &std::path::Path| {
        vec![
            "--redis-tls-ca-cert-file".to_string(),
            path(ca),
            "--redis-tls-cert-file".to_string(),
            path(&client.cert),
            "--redis-tls-key-file".to_string(),
            path(&client.key),
        ]
    };
    // A CA that did not sign the server's certificate, and none at all (the system's roots).
    let wrong_ca = args(&run, &url, &with_ca(&pki.other_ca()));
    assert_refused(
        &wrong_ca,
        "signed by no trusted CA",
        "--redis-tls-ca-cert-file",
    );
    let client_only = &pki.redis_flags()[2..];
    assert_refused(
        &args(&run, &url, client_only),
        "signed by no trusted CA",
        "--redis-tls-ca-cert-file",
    );
    // The server's certificate is fine, but tally gives none of its own.
    let ca_only = &pki.redis_flags()[..2];
    assert_refused(
        &args(&run, &url, ca_only),
        "client certificate",
        "--redis-tls-cert-file",
    );
    // The server presents an expired certificate, then one for another host.
    present(&mut conn, &pki.pair("expired"));
    assert_refused(
        &args(&run, &url, &pki.redis_flags()),
        "has expired",
        "tls-cert-file",
    );
    present(&mut conn, &pki.pair("elsewhere"));
    assert_refused(
        &args(&run, &url, &pki.redis_flags()),
        "not valid for the host name",
        "--redis",
    );
    // And with the right certificate again, the same flags start.
    present(&mut conn, &pki.pair("server"));
    let mut tally = Tally::spawn_args("tally", &args(&run, &url, &pki.redis_flags()));
    wait_for(
        "tally to write the layout record",
        Duration::from_secs(60),
        || {
            tally.assert_running();
            let exists: bool = redis::cmd("EXISTS")
                .arg(format!("{}:layout", run.prefix))
                .query(&mut conn)
                .unwrap();
            exists.then_some(())
        },
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(30)).success());
}

#[test]
fn tls_files_are_checked_at_start() {
    let pki = Pki::new();
    let run = Scenario::new("tls_files_are_checked_at_start", "tlsf", 1);
    // A CA file on a redis:// URL, a key without its certificate, a file that is not PEM.
    let plain = args(&run, "redis://127.0.0.1:1/", &pki.redis_flags()[..2]);
    let line = refusal_line(&run_refused(&plain));
    assert!(
        line.contains("--redis-tls-ca-cert-file: needs a rediss://"),
        "{line}"
    );
    let key_only = args(&run, "rediss://127.0.0.1:1/", &pki.redis_flags()[4..]);
    let line = refusal_line(&run_refused(&key_only));
    assert!(
        line.contains("--redis-tls-key-file: a client certificate and its key go together"),
        "{line}"
    );
    let not_pem = [
        "--redis-tls-ca-cert-file".to_string(),
        path(&pki.pair("server").key),
    ];
    let line = refusal_line(&run_refused(&args(&run, "rediss://127.0.0.1:1/", &not_pem)));
    assert!(
        line.contains("--redis-tls-ca-cert-file: ") && line.contains("PEM certificate"),
        "{line}"
    );
}

/// Per post, the sum of `<prefix>:likes:<post>:*` across the cluster's nodes.
fn cluster_counts(cluster: &TlsCluster, pki: &Pki, prefix: &str) -> HashMap<u64, i64> {
    let head = format!("{prefix}:likes:");
    let mut counts = HashMap::new();
    for (key, value) in cluster.scan(pki, &format!("{prefix}:likes:*")) {
        let post: u64 = key
            .strip_prefix(&head)
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        *counts.entry(post).or_insert(0) += value.parse::<i64>().unwrap();
    }
    counts
}

#[test]
fn a_cluster_over_tls_counts_exactly_and_names_certificate_problems() {
    let pki = Pki::new();
    let cluster = TlsCluster::start(&pki, 3);
    let run = Scenario::new("cluster_over_tls", "tlsc", PARTITIONS);
    let mut workload = Workload::new(run.seed, PARTITIONS);
    let first = workload.grow(3_000);
    produce(&run.brokers, &run.topic, workload.messages(first));
    let url = cluster.url("127.0.0.1");
    let mut cluster_args = args(&run, &url, &pki.redis_flags());
    cluster_args.extend(["--slot-groups".to_string(), "8".to_string()]);
    let mut tally = Tally::spawn_args("tally", &cluster_args);
    let hwms = run.hwms(workload.events.len());
    // Every partition's 8 slot-group fences at its last offset.
    let started = Instant::now();
    loop {
        tally.assert_running();
        let fences = cluster.scan(
            &pki,
            &format!("{}:fence:{}:{}:*", run.prefix, run.group, run.topic),
        );
        let behind: Vec<usize> = (0..PARTITIONS as usize)
            .filter(|&p| {
                let head = format!("{}:fence:{}:{}:{p}:", run.prefix, run.group, run.topic);
                let last = (hwms[p] - 1).to_string();
                let at_end = fences
                    .iter()
                    .filter(|(k, v)| k.starts_with(&head) && *v == last);
                hwms[p] > 0 && at_end.count() != 8
            })
            .collect();
        if behind.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "partitions behind: {behind:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_counts_eq(
        &cluster_counts(&cluster, &pki, &run.prefix),
        &workload.truth,
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(30)).success());

    // The same cluster, reached wrongly: another CA; and by a name its certificate lacks.
    let client = pki.pair("client");
    let wrong_ca = [
        "--redis-tls-ca-cert-file".to_string(),
        path(&pki.other_ca()),
        "--redis-tls-cert-file".to_string(),
        path(&client.cert),
        "--redis-tls-key-file".to_string(),
        path(&client.key),
    ];
    assert_refused(
        &args(&run, &url, &wrong_ca),
        "signed by no trusted CA",
        "--redis-tls-ca-cert-file",
    );
    let mut conns: Vec<redis::Connection> =
        cluster.ports.iter().map(|&p| pki.redis_conn(p)).collect();
    for conn in &mut conns {
        present(conn, &pki.pair("elsewhere"));
    }
    assert_refused(
        &args(&run, &url, &pki.redis_flags()),
        "not valid for the host name",
        "--redis",
    );
    for conn in &mut conns {
        present(conn, &pki.pair("expired"));
    }
    assert_refused(
        &args(&run, &url, &pki.redis_flags()),
        "has expired",
        "tls-cert-file",
    );
}
