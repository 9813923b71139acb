//! Kafka over TLS and SASL, against the Tansu broker.
//!
//! What Tansu 0.6.0 serves, and so what is tested against it:
//! - TLS: nothing. Its `--cert` and `--key` are declared in one exclusive argument group
//!   ("the argument '--cert <CERT>' cannot be used with '--key <KEY>'"), and the TLS acceptor
//!   it would build is never used. The TLS tests put a TLS terminator (socat, with the test's
//!   private CA) in front of a plaintext broker that advertises the terminator's port: the
//!   handshake, the CA, the host name and the client certificate are librdkafka's, for real.
//! - SASL (`--authentication`): SCRAM-SHA-256 and SCRAM-SHA-512 (and OAUTHBEARER); no PLAIN
//!   ("NoSharedMechanism"). Its memory storage keeps no SCRAM credentials, so every login on a
//!   memory broker fails ("unknown-user"): the refusal tests run there. A login that succeeds
//!   needs a storage engine that keeps credentials (SQLite, Tansu's `libsql` feature):
//!   `scram_logins_count_exactly` runs against such a build, with SCRAM-SHA-512 over
//!   `sasl_plaintext` and over `sasl_ssl` (behind the TLS terminator).
//!
//! A refused login or handshake stops `tally run` with one line and exit status 1.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::*;

const PARTITIONS: i32 = 3;

/// The Tansu build with SQLite storage, which keeps SCRAM credentials.
const TANSU_SQL_INSTALL: &str =
    "cargo install tansu --version 0.6.0 --features libsql --locked --root ~/.cargo/tansu-libsql";

fn tansu_sql() -> PathBuf {
    let home = std::env::var_os("HOME").expect("HOME");
    let bin = PathBuf::from(home).join(".cargo/tansu-libsql/bin/tansu");
    assert!(
        bin.is_file(),
        "{} is missing: the SCRAM test needs Tansu with SQLite storage; run: {TANSU_SQL_INSTALL}",
        bin.display()
    );
    bin
}

/// The arguments of `tally run` that reach the brokers at `client_brokers` with `security`.
fn run_args(
    run: &Scenario,
    client_brokers: &str,
    redis: &RedisServer,
    security: &[&str],
) -> Vec<String> {
    let mut args = tally_args(
        client_brokers,
        &run.topic,
        &run.group,
        &redis.url(),
        &run.prefix,
    );
    args.extend(security.iter().map(|s| s.to_string()));
    args
}

/// Produces a workload through `client_brokers` with `properties`, runs `tally run` with
/// `security` until every event is applied, and checks every count.
fn counts_exactly(
    run: &Scenario,
    client_brokers: &str,
    properties: &[(&str, &str)],
    security: &[&str],
    redis: &RedisServer,
) {
    let mut workload = Workload::new(run.seed, PARTITIONS);
    let mut positions = Vec::new();
    let through = (client_brokers, properties);
    count_more(run, &mut workload, &mut positions, through, security, redis);
}

/// Grows `workload` by 2,000 events produced through `brokers` (address, properties), adds
/// their positions to `positions`, and has a `tally run` with `security` count the whole topic
/// into `run`'s prefix, exactly.
fn count_more(
    run: &Scenario,
    workload: &mut Workload,
    positions: &mut Vec<(i32, i64)>,
    (client_brokers, properties): (&str, &[(&str, &str)]),
    security: &[&str],
    redis: &RedisServer,
) {
    let more = workload.grow(2_000);
    let messages = workload.messages(more);
    positions.extend(produce_positions_with(
        client_brokers,
        &run.topic,
        messages,
        properties,
    ));
    let ends = ends_of(positions, PARTITIONS);
    let mut tally = Tally::spawn_args("tally", &run_args(run, client_brokers, redis, security));
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &ends, Duration::from_secs(120), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &workload.truth);
    assert!(tally.sigterm_and_wait(Duration::from_secs(30)).success());
}

/// `tally run` stops at start with one line naming `what` and `setting`, and exit status 1.
fn assert_refused(args: &[String], what: &str, setting: &str) {
    let out = run_refused(args);
    let line = refusal_line(&out);
    eprintln!("[kafka] refused: {line}");
    assert!(line.contains(what), "the line names '{what}': {line}");
    assert!(line.contains(setting), "the line names '{setting}': {line}");
    assert!(!line.contains("is the broker running"), "{line}");
}

#[test]
fn tansu_cannot_serve_tls_itself() {
    let pki = Pki::new();
    let server = pki.pair("server");
    let out = Command::new(tansu_bin().expect(TANSU_INSTALL))
        .args(["broker", "--storage-engine", "memory://tansu/", "--cert"])
        .arg(&server.cert)
        .arg("--key")
        .arg(&server.key)
        .output()
        .expect("run tansu");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // When this starts to pass, Tansu serves TLS: test against its own listener instead.
    assert!(
        !out.status.success() && stderr.contains("cannot be used with"),
        "tansu broker --cert --key: {}\n{stderr}",
        out.status
    );
}

#[test]
fn ssl_with_a_private_ca_and_a_client_certificate_counts_exactly() {
    let pki = Pki::new();
    let tls_port = free_port();
    let broker = Broker::start_with(&BrokerOptions {
        advertised_port: Some(tls_port),
        ..BrokerOptions::default()
    });
    let ca = path(&pki.ca());
    let terminator = TlsTerminator::start_on(
        tls_port,
        &pki.pair("server"),
        Some(&pki.ca()),
        broker.addr(),
    );
    let redis = RedisServer::start();
    let run = Scenario::on(broker.addr(), "kafka_ssl", "ssl", PARTITIONS);
    let client = pki.pair("client");
    let (cert, key) = (path(&client.cert), path(&client.key));
    let properties = [
        ("security.protocol", "ssl"),
        ("ssl.ca.location", ca.as_str()),
        ("ssl.certificate.location", cert.as_str()),
        ("ssl.key.location", key.as_str()),
    ];
    let security = [
        "--kafka-security-protocol",
        "ssl",
        "--kafka-ssl-ca-location",
        &ca,
        "--kafka-ssl-certificate-location",
        &cert,
        "--kafka-ssl-key-location",
        &key,
    ];
    counts_exactly(&run, &terminator.addr(), &properties, &security, &redis);

    // A CA that did not sign the brokers' certificate.
    let other = path(&pki.other_ca());
    let mut wrong_ca = security;
    wrong_ca[3] = &other;
    let args = run_args(&run, &terminator.addr(), &redis, &wrong_ca);
    assert_refused(
        &args,
        "TLS handshake with Kafka at",
        "--kafka-ssl-ca-location",
    );
    // No client certificate, where the brokers ask for one.
    let args = run_args(&run, &terminator.addr(), &redis, &security[..4]);
    assert_refused(
        &args,
        "TLS handshake with Kafka at",
        "--kafka-ssl-certificate-location",
    );
}

#[test]
fn a_refused_sasl_login_is_one_line_and_exit_1() {
    let broker = Broker::start_with(&BrokerOptions {
        authentication: true,
        ..BrokerOptions::default()
    });
    let redis = RedisServer::start();
    let run = Scenario {
        seed: 0,
        brokers: broker.addr().to_string(),
        topic: unique("likes-sasl"),
        group: unique("tally-sasl"),
        prefix: unique("sasl"),
    };
    for mechanism in ["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] {
        let security = [
            "--kafka-security-protocol",
            "sasl_plaintext",
            "--kafka-sasl-mechanism",
            mechanism,
            "--kafka-sasl-username",
            "tally",
            "--kafka-sasl-password",
            "not-the-password",
        ];
        let args = run_args(&run, broker.addr(), &redis, &security);
        assert_refused(&args, "refused the SASL login", "--kafka-sasl-username");
    }
}

/// Creates SCRAM-SHA-512 user `tally` with `password`, and `topic`, on a broker without
/// authentication over `storage` (a SQLite file), and stops it.
fn scram_setup(storage: &str, password: &str, topic: &str) {
    let setup = Broker::start_with(&BrokerOptions {
        storage_engine: Some(storage.to_string()),
        binary: Some(tansu_sql()),
        ..BrokerOptions::default()
    });
    let url = format!("tcp://{}", setup.addr());
    let tansu = |args: &[&str]| {
        let out = Command::new(tansu_sql())
            .args(args)
            .output()
            .expect("run tansu");
        assert!(
            out.status.success(),
            "tansu {args:?}: {}",
            output_text(&out)
        );
    };
    tansu(&[
        "user",
        "create",
        "--broker",
        &url,
        "--mechanism",
        "scram512",
        "tally",
        password,
    ]);
    tansu(&[
        "topic",
        "create",
        topic,
        "--partitions",
        &PARTITIONS.to_string(),
        "--broker",
        &url,
    ]);
}

/// A broker over `storage` that requires a SASL login, advertising `advertised` if given.
fn scram_broker(storage: &str, advertised: Option<u16>) -> Broker {
    Broker::start_with(&BrokerOptions {
        authentication: true,
        storage_engine: Some(storage.to_string()),
        binary: Some(tansu_sql()),
        advertised_port: advertised,
    })
}

#[test]
fn scram_logins_count_exactly() {
    let dir = tempfile::tempdir().unwrap();
    // Four slashes: Tansu reads the path after `sqlite:///` as relative.
    let storage = format!("sqlite:///{}/tansu.db", dir.path().display());
    let password = "s3cret-scram";
    let topic = unique("likes-scram");
    scram_setup(&storage, password, &topic);
    let redis = RedisServer::start();
    let run = Scenario {
        seed: seed("scram_logins_count_exactly"),
        brokers: String::new(),
        topic,
        group: unique("tally-scram"),
        prefix: unique("scram"),
    };
    let sasl = |protocol: &'static str, mechanism: &'static str, password: &'static str| {
        [
            "--kafka-security-protocol",
            protocol,
            "--kafka-sasl-mechanism",
            mechanism,
            "--kafka-sasl-username",
            "tally",
            "--kafka-sasl-password",
            password,
        ]
    };
    let properties = |protocol: &'static str, mechanism: &'static str| {
        vec![
            ("security.protocol", protocol),
            ("sasl.mechanism", mechanism),
            ("sasl.username", "tally"),
            ("sasl.password", password),
        ]
    };

    // sasl_plaintext, straight to the broker.
    let broker = scram_broker(&storage, None);
    let mut workload = Workload::new(run.seed, PARTITIONS);
    let mut positions = Vec::new();
    let plain = properties("sasl_plaintext", "SCRAM-SHA-512");
    let security = sasl("sasl_plaintext", "SCRAM-SHA-512", password);
    count_more(
        &run,
        &mut workload,
        &mut positions,
        (broker.addr(), &plain),
        &security,
        &redis,
    );
    let wrong = sasl("sasl_plaintext", "SCRAM-SHA-512", "not-the-password");
    assert_refused(
        &run_args(&run, broker.addr(), &redis, &wrong),
        "refused the SASL login",
        "--kafka-sasl-username",
    );
    drop(broker);

    // sasl_ssl: the same data behind a TLS terminator with a private CA.
    let pki = Pki::new();
    let tls_port = free_port();
    let broker = scram_broker(&storage, Some(tls_port));
    let terminator = TlsTerminator::start_on(tls_port, &pki.pair("server"), None, broker.addr());
    let ca = path(&pki.ca());
    let mut props = properties("sasl_ssl", "SCRAM-SHA-512");
    props.push(("ssl.ca.location", ca.as_str()));
    let mut security = sasl("sasl_ssl", "SCRAM-SHA-512", password).to_vec();
    security.extend(["--kafka-ssl-ca-location", ca.as_str()]);
    // A new group and prefix count the whole topic: both waves.
    let second = Scenario {
        seed: run.seed,
        brokers: String::new(),
        topic: run.topic.clone(),
        group: unique("tally-scram-tls"),
        prefix: unique("scram-tls"),
    };
    let addr = terminator.addr();
    let through = (addr.as_str(), props.as_slice());
    count_more(
        &second,
        &mut workload,
        &mut positions,
        through,
        &security,
        &redis,
    );
}
