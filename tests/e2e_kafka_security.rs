//! Kafka over TLS and SASL, with ACLs, against Apache Kafka.
//!
//! One private KRaft node serves the test process, with a listener per way tally can log in
//! (the CA and certificates are the test's own, from `openssl`; the broker reads them as PEM):
//! - `SCRAM`: SASL_SSL with SCRAM-SHA-512, the users created when the storage is formatted;
//! - `SASLPLAIN`: SASL_SSL with PLAIN, the users in the listener's JAAS configuration;
//! - `MTLS`: SSL asking every client for a certificate the CA signed, the principal taken
//!   from the certificate's subject (`CN=tally` is `User:tally`);
//! - `PLAINTEXT` on loopback, with the controller's: the broker's own connections and the test's
//!   setup (topics, ACLs), as `User:ANONYMOUS`.
//!
//! KRaft's StandardAuthorizer checks every request, nothing is allowed without an ACL, and only
//! `User:ANONYMOUS` (the broker itself) and `User:admin` (the producer) are super users. tally's
//! principal gets exactly the ACLs docs/security.md prescribes, through the commands written
//! there, and:
//! - under each listener, a full count is exact, and the bad messages mixed in are copied to the
//!   dead-letter topic (its `Write` ACL at work);
//! - each ACL missing (the topic's, the group's, the dead-letter topic's; `Describe` granted
//!   without `Read` on the topic or the group) stops `tally run` with exit status 1 and one line
//!   naming the ACL to add;
//! - `tally rebuild` under a principal of its own, with the ACLs docs/security.md prescribes for
//!   it, recounts exactly, and is refused in one line without its group ACL;
//! - a wrong password, an unknown mechanism, a CA that did not sign the broker's certificate and
//!   a missing client certificate are each refused in one line.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::thread;
use std::time::Duration;

use common::*;
use tempfile::TempDir;

const PARTITIONS: i32 = 3;
const EVENTS: usize = 2_000;
/// A message that does not decode: counted as bad and copied to the dead-letter topic.
const BAD: &[u8] = b"not a protobuf: {\"post\": 1}";
const ACL_COMMAND: &str = "org.apache.kafka.tools.AclCommand";

/// How a client reaches the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listener {
    Scram,
    Plain,
    Mtls,
}

/// The private broker with its listeners, CA and credentials.
struct Secured {
    broker: Broker,
    pki: Pki,
    scram: u16,
    plain: u16,
    mtls: u16,
    /// Password files, the broker's PEM keystore.
    dir: TempDir,
}

/// The SASL users: the producer and super user, tally, and the principal that rebuilds.
const USERS: [&str; 3] = ["admin", "tally", "tally-rebuild"];

fn secured() -> &'static Secured {
    static SECURED: OnceLock<Secured> = OnceLock::new();
    SECURED.get_or_init(Secured::start)
}

impl Secured {
    fn start() -> Secured {
        let pki = Pki::new();
        pki.issue("admin", "admin", "DNS:admin", "1");
        let dir = tempfile::tempdir().expect("temp dir");
        let server = pki.pair("server");
        // A PEM keystore: the private key (PKCS#8), then the certificate.
        let keystore = dir.path().join("server-keystore.pem");
        let mut pem = std::fs::read(&server.key).unwrap();
        pem.extend(std::fs::read(&server.cert).unwrap());
        std::fs::write(&keystore, pem).unwrap();
        for user in USERS {
            std::fs::write(dir.path().join(format!("{user}.password")), unique(user)).unwrap();
        }
        let password = |user: &str| {
            std::fs::read_to_string(dir.path().join(format!("{user}.password"))).unwrap()
        };
        let [port, controller, scram, plain, mtls] = [(); 5].map(|_| free_port());
        let plain_users: String = USERS
            .iter()
            .map(|u| format!(" user_{u}=\"{}\"", password(u)))
            .collect();
        let settings = vec![
            format!(
                "listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},\
                 SCRAM://127.0.0.1:{scram},SASLPLAIN://127.0.0.1:{plain},MTLS://127.0.0.1:{mtls}"
            ),
            format!(
                "advertised.listeners=PLAINTEXT://127.0.0.1:{port},SCRAM://127.0.0.1:{scram},\
                 SASLPLAIN://127.0.0.1:{plain},MTLS://127.0.0.1:{mtls}"
            ),
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,\
             SCRAM:SASL_SSL,SASLPLAIN:SASL_SSL,MTLS:SSL"
                .to_string(),
            "ssl.keystore.type=PEM".to_string(),
            format!("ssl.keystore.location={}", path(&keystore)),
            "ssl.truststore.type=PEM".to_string(),
            format!("ssl.truststore.location={}", path(&pki.ca())),
            "listener.name.mtls.ssl.client.auth=required".to_string(),
            // CN=tally is User:tally, the principal SASL's user tally has.
            "ssl.principal.mapping.rules=RULE:^CN=([^,]+)$/$1/,DEFAULT".to_string(),
            "listener.name.scram.sasl.enabled.mechanisms=SCRAM-SHA-512".to_string(),
            "listener.name.scram.scram-sha-512.sasl.jaas.config=\
             org.apache.kafka.common.security.scram.ScramLoginModule required;"
                .to_string(),
            "listener.name.saslplain.sasl.enabled.mechanisms=PLAIN".to_string(),
            format!(
                "listener.name.saslplain.plain.sasl.jaas.config=\
                 org.apache.kafka.common.security.plain.PlainLoginModule required{plain_users};"
            ),
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer"
                .to_string(),
            "allow.everyone.if.no.acl.found=false".to_string(),
            "super.users=User:ANONYMOUS;User:admin".to_string(),
        ];
        let format_args = USERS
            .iter()
            .flat_map(|u| {
                [
                    "--add-scram".to_string(),
                    format!("SCRAM-SHA-512=[name={u},password={}]", password(u)),
                ]
            })
            .collect();
        let broker = Broker::start_with(&BrokerOptions {
            settings,
            format_args,
            port: Some(port),
            controller_port: Some(controller),
            ..BrokerOptions::default()
        });
        eprintln!("[kafka] SCRAM on {scram}, PLAIN on {plain}, mutual TLS on {mtls}");
        Secured {
            broker,
            pki,
            scram,
            plain,
            mtls,
            dir,
        }
    }

    fn addr(&self, listener: Listener) -> String {
        let port = match listener {
            Listener::Scram => self.scram,
            Listener::Plain => self.plain,
            Listener::Mtls => self.mtls,
        };
        format!("127.0.0.1:{port}")
    }

    fn password_file(&self, user: &str) -> PathBuf {
        self.dir.path().join(format!("{user}.password"))
    }

    /// The certificate and key `user` presents on the mutual-TLS listener.
    fn certificate(&self, user: &str) -> Pair {
        match user {
            "tally" => self.pki.pair("client"),
            "admin" => self.pki.pair("admin"),
            other => panic!("no certificate for {other}"),
        }
    }

    /// librdkafka properties that log `user` in on `listener` (the producer's).
    fn client_properties(&self, listener: Listener, user: &str) -> Vec<(String, String)> {
        let mut properties = vec![("ssl.ca.location".to_string(), path(&self.pki.ca()))];
        let sasl = |mechanism: &str| {
            [
                ("security.protocol", "sasl_ssl".to_string()),
                ("sasl.mechanism", mechanism.to_string()),
                ("sasl.username", user.to_string()),
                (
                    "sasl.password",
                    std::fs::read_to_string(self.password_file(user)).unwrap(),
                ),
            ]
        };
        let more: Vec<(&str, String)> = match listener {
            Listener::Scram => sasl("SCRAM-SHA-512").to_vec(),
            Listener::Plain => sasl("PLAIN").to_vec(),
            Listener::Mtls => {
                let pair = self.certificate(user);
                vec![
                    ("security.protocol", "ssl".to_string()),
                    ("ssl.certificate.location", path(&pair.cert)),
                    ("ssl.key.location", path(&pair.key)),
                ]
            }
        };
        properties.extend(more.into_iter().map(|(k, v)| (k.to_string(), v)));
        properties
    }

    /// tally's flags that log `user` in on `listener`, the password from a file.
    fn tally_flags(&self, listener: Listener, user: &str) -> Vec<String> {
        let mut flags = vec!["--kafka-ssl-ca-location".to_string(), path(&self.pki.ca())];
        let sasl = |mechanism: &str| {
            [
                "--kafka-security-protocol",
                "sasl_ssl",
                "--kafka-sasl-mechanism",
                mechanism,
                "--kafka-sasl-username",
                user,
                "--kafka-sasl-password-file",
                &path(&self.password_file(user)),
            ]
            .map(String::from)
        };
        match listener {
            Listener::Scram => flags.extend(sasl("SCRAM-SHA-512")),
            Listener::Plain => flags.extend(sasl("PLAIN")),
            Listener::Mtls => {
                let pair = self.certificate(user);
                flags.extend([
                    "--kafka-security-protocol".to_string(),
                    "ssl".to_string(),
                    "--kafka-ssl-certificate-location".to_string(),
                    path(&pair.cert),
                    "--kafka-ssl-key-location".to_string(),
                    path(&pair.key),
                ]);
            }
        }
        flags
    }

    /// `kafka-acls.sh --add <args>` over the setup listener.
    fn add_acl(&self, args: &[&str]) {
        let mut all = vec!["--bootstrap-server", self.broker.addr(), "--add"];
        all.extend(args);
        kafka_tool(ACL_COMMAND, &all);
        // The broker applies an ACL from the metadata log a moment after the controller
        // commits it.
        thread::sleep(Duration::from_millis(300));
    }

    /// tally's ACLs as docs/security.md writes them: `Read` on the topic and the group,
    /// `DescribeConfigs` on the topic, `Write` on the dead-letter topic.
    fn grant_tally(&self, topic: &str, group: &str, dead_letter_topic: Option<&str>) {
        self.add_acl(&[
            "--allow-principal",
            "User:tally",
            "--operation",
            "Read",
            "--topic",
            topic,
            "--group",
            group,
        ]);
        self.add_acl(&[
            "--allow-principal",
            "User:tally",
            "--operation",
            "DescribeConfigs",
            "--topic",
            topic,
        ]);
        if let Some(dead) = dead_letter_topic {
            self.add_acl(&[
                "--allow-principal",
                "User:tally",
                "--operation",
                "Write",
                "--topic",
                dead,
            ]);
        }
    }

    /// `tally run`'s arguments for `run` through `listener` as `user`.
    fn run_args(&self, run: &Scenario, redis: &RedisServer, listener: Listener) -> Vec<String> {
        let mut args = tally_args(
            &self.addr(listener),
            &run.topic,
            &run.group,
            &redis.url(),
            &run.prefix,
        );
        args.extend(self.tally_flags(listener, "tally"));
        args
    }

    /// Produces `messages` to `topic` as `admin` through `listener`; their positions.
    fn produce(&self, listener: Listener, topic: &str, messages: Vec<Msg>) -> Vec<(i32, i64)> {
        let properties = self.client_properties(listener, "admin");
        let properties: Vec<(&str, &str)> = properties
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        produce_positions_with(&self.addr(listener), topic, messages, &properties)
    }
}

/// A scenario on the secured broker: its topic created through the setup listener.
fn scenario(test: &str, short: &str) -> Scenario {
    Scenario::on(secured().broker.addr(), test, short, PARTITIONS)
}

/// Through `listener`, as tally's principal with the prescribed ACLs: a workload with a bad
/// message at the end of every partition is counted exactly, and each bad message is in the
/// dead-letter topic.
fn counts_exactly_through(listener: Listener, test: &str, short: &str) {
    let k = secured();
    let run = scenario(test, short);
    let dead = unique(&format!("likes-{short}-dead"));
    create_topic_with(k.broker.addr(), &dead, 1, &[]);
    k.grant_tally(&run.topic, &run.group, Some(&dead));
    let redis = RedisServer::start();
    let mut workload = Workload::new(run.seed, PARTITIONS);
    let events = workload.grow(EVENTS);
    let mut messages = workload.messages(events);
    messages.extend((0..PARTITIONS).map(|p| (None, BAD.to_vec(), p)));
    let ends = ends_of(&k.produce(listener, &run.topic, messages), PARTITIONS);

    let mut args = k.run_args(&run, &redis, listener);
    args.extend(["--dead-letter-topic".to_string(), dead.clone()]);
    let mut tally = Tally::spawn_args(short, &args);
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &ends, Duration::from_secs(120), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &workload.truth);
    // A partition's fence passes its bad message only once the copy is delivered.
    let letters = read_topic(k.broker.addr(), &dead, Duration::from_secs(30));
    assert_eq!(letters.len(), PARTITIONS as usize, "dead letters in {dead}");
    for letter in &letters {
        assert_eq!(rdkafka::Message::payload(letter), Some(BAD));
    }
    assert!(tally.sigterm_and_wait(Duration::from_secs(30)).success());
    eprintln!(
        "[{short}] {} events and {PARTITIONS} bad messages counted exactly through {listener:?}",
        EVENTS
    );
}

#[test]
fn scram_sha_512_over_tls_counts_exactly() {
    counts_exactly_through(Listener::Scram, "kafka_scram", "scram");
}

#[test]
fn plain_over_tls_counts_exactly() {
    counts_exactly_through(Listener::Plain, "kafka_plain", "plain");
}

#[test]
fn mutual_tls_counts_exactly_as_the_certificates_principal() {
    counts_exactly_through(Listener::Mtls, "kafka_mtls", "mtls");
}

/// Checks that `line` names `acl` (`Read on topic 'likes'`) and the arguments that grant it.
fn assert_names_acl(line: &str, acl: &str, grant: &str) {
    eprintln!("[kafka] {line}");
    assert!(
        line.contains(&format!("denied {acl} to the principal")),
        "the line names {acl}: {line}"
    );
    assert!(line.contains(grant), "the line names `{grant}`: {line}");
}

#[test]
fn each_missing_acl_stops_tally_with_one_line_naming_it() {
    let k = secured();
    let listener = Listener::Scram;
    let redis = RedisServer::start();
    let run = scenario("kafka_acl_missing", "acl");
    let args = |topic: &str, group: &str, dead: Option<&str>| {
        let named = Scenario {
            seed: run.seed,
            brokers: run.brokers.clone(),
            topic: topic.to_string(),
            group: group.to_string(),
            // A fresh prefix each time: every start is a first start.
            prefix: unique("acl"),
        };
        let mut args = k.run_args(&named, &redis, listener);
        if let Some(dead) = dead {
            args.extend(["--dead-letter-topic".to_string(), dead.to_string()]);
        }
        args
    };
    // A second topic and group with `Describe` only, and a dead-letter topic without `Write`.
    let (topic, group) = (run.topic.as_str(), run.group.as_str());
    let described_topic = unique("likes-acl-described");
    create_topic_with(k.broker.addr(), &described_topic, PARTITIONS, &[]);
    let described_group = unique("tally-acl-described");
    let dead = unique("likes-acl-dead");
    create_topic_with(k.broker.addr(), &dead, 1, &[]);
    k.add_acl(&[
        "--allow-principal",
        "User:tally",
        "--operation",
        "Describe",
        "--topic",
        &described_topic,
        "--group",
        &described_group,
    ]);

    // Nothing on the topic: its metadata is refused at start.
    let line = refusal_line(&run_refused(&args(topic, group, None)));
    assert_names_acl(
        &line,
        &format!("Read on topic '{topic}'"),
        &format!("--operation Read --topic {topic}"),
    );

    // The topic readable, nothing on the group: its coordinator is refused at start.
    k.add_acl(&[
        "--allow-principal",
        "User:tally",
        "--operation",
        "Read",
        "--topic",
        topic,
    ]);
    let line = refusal_line(&run_refused(&args(topic, group, None)));
    assert_names_acl(
        &line,
        &format!("Read on group '{group}'"),
        &format!("--operation Read --group {group}"),
    );

    // The group only described: the start passes, joining it is refused.
    let out = run_refused(&args(topic, &described_group, None));
    assert_names_acl(
        &error_line(&out),
        &format!("Read on group '{described_group}'"),
        &format!("--operation Read --group {described_group}"),
    );

    // The group readable, the topic only described: the start passes, fetching is refused.
    k.add_acl(&[
        "--allow-principal",
        "User:tally",
        "--operation",
        "Read",
        "--group",
        group,
    ]);
    let out = run_refused(&args(&described_topic, group, None));
    assert_names_acl(
        &error_line(&out),
        &format!("Read on topic '{described_topic}'"),
        &format!("--operation Read --topic {described_topic}"),
    );

    // Everything but `Write` on the dead-letter topic.
    let line = refusal_line(&run_refused(&args(topic, group, Some(&dead))));
    assert_names_acl(
        &line,
        &format!("Write on topic '{dead}'"),
        &format!("--operation Write --topic {dead}"),
    );
}

/// Runs `tally rebuild` with `args` until it exits, within `timeout`; its exit status and log.
fn rebuild(args: &[String], timeout: Duration) -> (std::process::ExitStatus, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut rebuild = Tally::spawn_command("rebuild", "rebuild", &args);
    let status = wait_for("tally rebuild to exit", timeout, || rebuild.try_status());
    (status, rebuild.log_text())
}

#[test]
fn rebuild_under_its_own_principal_counts_exactly() {
    let k = secured();
    let listener = Listener::Scram;
    let run = scenario("kafka_rebuild", "rbacl");
    k.grant_tally(&run.topic, &run.group, None);
    let redis = RedisServer::start();
    let mut workload = Workload::new(run.seed, PARTITIONS);
    let events = workload.grow(EVENTS);
    let ends = ends_of(
        &k.produce(listener, &run.topic, workload.messages(events)),
        PARTITIONS,
    );
    let mut tally = Tally::spawn_args("tally", &k.run_args(&run, &redis, listener));
    let mut conn = redis.conn();
    run.wait_applied(&mut conn, &ends, Duration::from_secs(120), || {
        tally.assert_running()
    });
    run.assert_exact(&mut conn, &workload.truth);
    assert!(tally.sigterm_and_wait(Duration::from_secs(30)).success());

    let mut args = tally_args(
        &k.addr(listener),
        &run.topic,
        &run.group,
        &redis.url(),
        &run.prefix,
    );
    args.extend(k.tally_flags(listener, "tally-rebuild"));
    // Read on the topic, but no group yet.
    k.add_acl(&[
        "--allow-principal",
        "User:tally-rebuild",
        "--operation",
        "Read",
        "--topic",
        &run.topic,
    ]);
    let (status, log) = rebuild(&args, Duration::from_secs(60));
    assert_eq!(status.code(), Some(1), "{log}");
    let last = log.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    assert!(last.starts_with("error: "), "{log}");
    let stem = format!("{}-rebuild-", run.group);
    assert_names_acl(
        last,
        &format!("Read on groups prefixed '{stem}'"),
        &format!("--operation Read --group {stem} --resource-pattern-type prefixed"),
    );

    // The rebuild's ACLs as docs/security.md writes them.
    k.add_acl(&[
        "--allow-principal",
        "User:tally-rebuild",
        "--operation",
        "Read",
        "--group",
        &stem,
        "--resource-pattern-type",
        "prefixed",
    ]);
    let (status, log) = rebuild(&args, Duration::from_secs(180));
    assert!(status.success(), "tally rebuild failed:\n{log}");
    let current: Option<u64> = redis::cmd("HGET")
        .arg(format!("{}:generation", run.prefix))
        .arg("current")
        .query(&mut conn)
        .unwrap();
    assert_eq!(current, Some(1), "the pointer names the rebuilt generation");
    assert_counts_eq(
        &read_counts(&mut conn, &format!("{}:g1", run.prefix)),
        &workload.truth,
    );
}

#[test]
fn refused_logins_and_handshakes_are_one_line_and_exit_1() {
    let k = secured();
    let redis = RedisServer::start();
    let run = scenario("kafka_refused", "refused");
    k.grant_tally(&run.topic, &run.group, None);
    let wrong = k.dir.path().join("wrong.password");
    std::fs::write(&wrong, "not-the-password").unwrap();
    let refused = |listener: Listener, change: &dyn Fn(&mut Vec<String>), what: &str, fix: &str| {
        let mut args = k.run_args(&run, &redis, listener);
        change(&mut args);
        let line = refusal_line(&run_refused(&args));
        eprintln!("[kafka] {listener:?}: {line}");
        assert!(line.contains(what), "the line says '{what}': {line}");
        assert!(line.contains(fix), "the line names '{fix}': {line}");
        assert!(!line.contains("is the broker running"), "{line}");
    };
    let replace = |flag: &'static str, value: String| {
        move |args: &mut Vec<String>| {
            let at = args.iter().position(|a| a == flag).expect(flag) + 1;
            args[at] = value.clone();
        }
    };
    let wrong_password = replace("--kafka-sasl-password-file", path(&wrong));
    for listener in [Listener::Scram, Listener::Plain] {
        refused(
            listener,
            &wrong_password,
            "refused the SASL login",
            "--kafka-sasl-username",
        );
    }
    // The SCRAM listener offers SCRAM-SHA-512 only.
    refused(
        Listener::Scram,
        &replace("--kafka-sasl-mechanism", "SCRAM-SHA-256".to_string()),
        "refused the SASL login",
        "--kafka-sasl-mechanism",
    );
    refused(
        Listener::Mtls,
        &replace("--kafka-ssl-ca-location", path(&k.pki.other_ca())),
        "TLS handshake with Kafka at",
        "--kafka-ssl-ca-location",
    );
    let no_certificate = |args: &mut Vec<String>| {
        let at = args
            .iter()
            .position(|a| a == "--kafka-ssl-certificate-location")
            .unwrap();
        args.drain(at..at + 4);
    };
    refused(
        Listener::Mtls,
        &no_certificate,
        "TLS handshake with Kafka at",
        "--kafka-ssl-certificate-location",
    );
}
