//! No secret in any output: tally is given its passwords in every way the CLI takes them (in the
//! Redis URL, as flags, as `TALLY_*` variables, in password files, in a `--config` file, as
//! librdkafka settings), each way with a secret of its own, and runs with every log at debug
//! level and librdkafka's debug contexts on (`-X debug=all`). Nothing it prints — log lines,
//! `/metrics` and `/readyz` of `tally run` and `tally serve`, `tally config print`, and the error
//! of a wrong password, an unreachable host and a malformed URL — holds any of them.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use rand::Rng;

const PARTITIONS: i32 = 2;
const EVENTS: usize = 200;
const USER: &str = "alice";

/// A secret no output could hold by chance.
fn secret(way: &str) -> String {
    format!("{way}Secret{:016x}", rand::rng().random::<u64>())
}

/// One way of giving a password: extra arguments, variables and a settings file.
#[derive(Default, Clone)]
struct Given {
    way: &'static str,
    secret: String,
    /// `--redis` (or `TALLY_REDIS`, or the file's `redis`) is left to the way when it sets it.
    sets_url: bool,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Lines of a `--config` file.
    file: Vec<String>,
}

impl Given {
    /// Arguments and variables for a command, the settings file written in `dir` when there is
    /// one (only `run`'s family of commands reads it: `with_file`).
    fn command(&self, dir: &Path, args: &[String], with_file: bool) -> Command {
        let mut cmd = Command::new(tally_bin());
        cmd.args(args).args(&self.args);
        if with_file && !self.file.is_empty() {
            let path = dir.join(format!("{}.toml", self.way));
            std::fs::write(&path, self.file.join("\n") + "\n").unwrap();
            cmd.arg("--config").arg(path);
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd.env("TALLY_LOG", "debug,librdkafka=debug")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null());
        cmd
    }
}

fn file_holding(dir: &Path, name: &str, secret: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    path
}

/// Every way of giving the Redis password, against a server at `port`.
fn redis_ways(dir: &Path, port: u16) -> Vec<Given> {
    let at = format!("127.0.0.1:{port}/");
    let bare = format!("redis://{USER}@{at}");
    let mut ways = Vec::new();
    let mut way = |name: &'static str, make: &dyn Fn(&str) -> Given| {
        let s = secret(name);
        let mut given = make(&s);
        given.way = name;
        given.secret = s;
        ways.push(given);
    };
    way("url", &|s| Given {
        sets_url: true,
        args: vec!["--redis".into(), format!("redis://{USER}:{s}@{at}")],
        ..Given::default()
    });
    way("urlvar", &|s| Given {
        sets_url: true,
        env: vec![("TALLY_REDIS".into(), format!("redis://{USER}:{s}@{at}"))],
        ..Given::default()
    });
    way("flag", &|s| Given {
        args: vec!["--redis-password".into(), s.into()],
        ..Given::default()
    });
    way("var", &|s| Given {
        env: vec![("TALLY_REDIS_PASSWORD".into(), s.into())],
        ..Given::default()
    });
    way("file", &|s| Given {
        args: vec![
            "--redis-password-file".into(),
            file_holding(dir, "redis-pw", s).display().to_string(),
        ],
        ..Given::default()
    });
    way("settings", &|s| Given {
        file: vec![format!("redis-password = \"{s}\"")],
        ..Given::default()
    });
    way("settingsurl", &|s| Given {
        sets_url: true,
        file: vec![format!("redis = \"redis://{USER}:{s}@{at}\"")],
        ..Given::default()
    });
    for given in &mut ways {
        if !given.sets_url && given.file.is_empty() {
            given.args.extend(["--redis".into(), bare.clone()]);
        } else if !given.sets_url {
            given.file.push(format!("redis = \"{bare}\""));
        }
    }
    ways
}

/// Every way of giving the Kafka SASL password.
fn kafka_ways(dir: &Path) -> Vec<Given> {
    let sasl = |extra: Vec<String>| {
        let mut args: Vec<String> = [
            "--kafka-security-protocol",
            "sasl_plaintext",
            "--kafka-sasl-mechanism",
            "PLAIN",
            "--kafka-sasl-username",
            "tally",
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra);
        args
    };
    let mut ways = Vec::new();
    let mut way = |name: &'static str, make: &dyn Fn(&str) -> Given| {
        let s = secret(name);
        let mut given = make(&s);
        given.way = name;
        given.secret = s;
        ways.push(given);
    };
    way("kflag", &|s| Given {
        args: sasl(vec!["--kafka-sasl-password".into(), s.into()]),
        ..Given::default()
    });
    way("kvar", &|s| Given {
        args: sasl(vec![]),
        env: vec![("TALLY_KAFKA_SASL_PASSWORD".into(), s.into())],
        ..Given::default()
    });
    way("kfile", &|s| Given {
        args: sasl(vec![
            "--kafka-sasl-password-file".into(),
            file_holding(dir, "kafka-pw", s).display().to_string(),
        ]),
        ..Given::default()
    });
    way("ksettings", &|s| Given {
        args: sasl(vec![]),
        file: vec![format!("kafka-sasl-password = \"{s}\"")],
        ..Given::default()
    });
    // Through librdkafka's own keys, the whole SASL setup with them.
    let x = |s: &str| {
        [
            "security.protocol=sasl_plaintext".to_string(),
            "sasl.mechanism=PLAIN".to_string(),
            "sasl.username=tally".to_string(),
            format!("sasl.password={s}"),
        ]
    };
    way("kx", &|s| Given {
        args: x(s)
            .into_iter()
            .flat_map(|kv| ["-X".to_string(), kv])
            .collect(),
        ..Given::default()
    });
    way("kxvar", &|s| Given {
        env: vec![("TALLY_KAFKA_CONFIG".into(), x(s).join(","))],
        ..Given::default()
    });
    way("kxsettings", &|s| Given {
        file: std::iter::once("[kafka-config]".to_string())
            .chain(x(s).iter().map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                format!("\"{k}\" = \"{v}\"")
            }))
            .collect(),
        ..Given::default()
    });
    ways
}

/// Everything a finished command printed.
fn printed(out: &Output) -> String {
    output_text(out)
}

/// `cmd` to its end (at most 60 s); its output goes through files, which a debug log cannot
/// fill as it would a pipe nobody reads yet.
fn finish(mut cmd: Command) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = cmd
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("start tally");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Output {
        status,
        stdout: std::fs::read(out).unwrap(),
        stderr: std::fs::read(err).unwrap(),
    }
}

/// Collects what was printed, and checks no secret is in any of it.
#[derive(Default)]
struct Outputs {
    seen: Vec<(String, String)>,
}

impl Outputs {
    fn add(&mut self, what: String, text: String) {
        assert!(!text.trim().is_empty(), "{what} printed nothing");
        self.seen.push((what, text));
    }

    fn assert_free_of(&self, secrets: &[String]) {
        let mut hits = Vec::new();
        for (what, text) in &self.seen {
            for secret in secrets {
                for line in text.lines().filter(|l| l.contains(secret.as_str())) {
                    hits.push(format!("{what}: {line}"));
                }
            }
        }
        assert!(
            hits.is_empty(),
            "{} lines hold a secret:\n{}",
            hits.len(),
            hits.join("\n")
        );
        eprintln!(
            "[e2e_secrets] {} outputs, {} lines, no secret",
            self.seen.len(),
            self.seen
                .iter()
                .map(|(_, t)| t.lines().count())
                .sum::<usize>()
        );
    }
}

#[test]
fn no_redis_password_reaches_any_output() {
    let run = Scenario::new("e2e_secrets", "secrets", PARTITIONS);
    let w = Workload::generate(run.seed, EVENTS, PARTITIONS);
    produce(&run.brokers, &run.topic, w.messages(0..EVENTS));
    let hwms = run.hwms(EVENTS);
    let redis = RedisServer::start_with_acl(USER, "harness-pw");
    let mut conn = redis.conn();
    let dir = tempfile::tempdir().unwrap();
    let ways = redis_ways(dir.path(), redis.port());
    for given in &ways {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(USER)
            .arg(format!(">{}", given.secret))
            .query(&mut conn)
            .unwrap();
    }
    let mut outputs = Outputs::default();
    for given in &ways {
        let prefix = format!("{}-{}", run.prefix, given.way);
        let group = format!("{}-{}", run.group, given.way);
        let mut base = tally_args(&run.brokers, &run.topic, &group, "", &prefix);
        // The URL comes from the way; the harness's empty one is dropped.
        let at = base.iter().position(|a| a == "--redis").unwrap();
        base.drain(at..at + 2);
        base.extend(["-X".into(), "debug=all".into()]);

        // tally run, its probes and its log.
        let http = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["run".to_string()];
        args.extend(base.clone());
        args.extend(["--metrics-addr".into(), http.clone()]);
        let log = dir.path().join(format!("run-{}.log", given.way));
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd = given.command(dir.path(), &args, true);
        let mut child = cmd
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        wait_applied_while(
            &mut conn,
            &prefix,
            &group,
            &run.topic,
            &hwms,
            Duration::from_secs(60),
            || {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "tally run ({}) exited {status}:\n{}",
                        given.way,
                        std::fs::read_to_string(&log).unwrap()
                    );
                }
            },
        );
        outputs.add(format!("{} /metrics", given.way), scrape_metrics(&http));
        let ready = wait_for("/readyz", Duration::from_secs(30), || {
            http_get(&http, "/readyz").ok().filter(|(s, _)| *s == 200)
        });
        outputs.add(format!("{} /readyz", given.way), ready.1);
        let term = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(term.success());
        assert!(child.wait().unwrap().success());
        outputs.add(
            format!("{} run log", given.way),
            std::fs::read_to_string(&log).unwrap(),
        );

        // tally config print.
        let mut args = vec!["config".to_string(), "print".to_string()];
        args.extend(base.clone());
        let out = finish(given.command(dir.path(), &args, true));
        assert!(out.status.success(), "{}", printed(&out));
        outputs.add(format!("{} config print", given.way), printed(&out));

        // The errors: a wrong password, an unreachable host, a malformed URL.
        let real = format!("127.0.0.1:{}/", redis.port());
        for (what, there, scheme) in [
            ("wrong password", real.clone(), "redis://"),
            ("unreachable host", "127.0.0.1:1/".to_string(), "redis://"),
            ("malformed URL", real.clone(), "redis:/"),
            ("malformed port", "127.0.0.1:port/".to_string(), "redis://"),
        ] {
            let mut wrong = given.clone();
            let bad_secret = if what == "wrong password" {
                format!("{}x", given.secret)
            } else {
                given.secret.clone()
            };
            let swap = |text: &str| {
                text.replace(&given.secret, &bad_secret)
                    .replace(&real, &there)
                    .replace("redis://", scheme)
            };
            wrong.args = wrong.args.iter().map(|a| swap(a)).collect();
            wrong.env = wrong
                .env
                .iter()
                .map(|(k, v)| (k.clone(), swap(v)))
                .collect();
            wrong.file = wrong.file.iter().map(|l| swap(l)).collect();
            if given.way == "file" {
                file_holding(dir.path(), "redis-pw", &bad_secret);
            }
            let mut args = vec!["run".to_string()];
            args.extend(base.clone());
            let out = finish(wrong.command(dir.path(), &args, true));
            assert_eq!(
                out.status.code(),
                Some(1),
                "{} run, {what}: {}",
                given.way,
                printed(&out)
            );
            outputs.add(format!("{} run, {what}", given.way), printed(&out));
            if given.file.is_empty() {
                let count = vec![
                    "count".to_string(),
                    "1".into(),
                    "--prefix".into(),
                    prefix.clone(),
                ];
                let out = finish(wrong.command(dir.path(), &count, false));
                assert_eq!(
                    out.status.code(),
                    Some(1),
                    "{} count, {what}: {}",
                    given.way,
                    printed(&out)
                );
                outputs.add(format!("{} count, {what}", given.way), printed(&out));
            }
            if given.way == "file" {
                file_holding(dir.path(), "redis-pw", &given.secret);
            }
        }

        // The readers take the store flags only (no settings file).
        if given.file.is_empty() {
            let count = vec![
                "count".to_string(),
                "1".into(),
                "2".into(),
                "--prefix".into(),
                prefix.clone(),
            ];
            let out = finish(given.command(dir.path(), &count, false));
            assert!(out.status.success(), "{}", printed(&out));
            outputs.add(format!("{} count", given.way), printed(&out));
            serve_outputs(given, dir.path(), &prefix, &mut outputs);
        }
    }
    let secrets: Vec<String> = ways.iter().map(|g| g.secret.clone()).collect();
    outputs.assert_free_of(&secrets);
}

/// `tally serve` with the password given that way: its answers, `/metrics` and its log.
fn serve_outputs(given: &Given, dir: &Path, prefix: &str, outputs: &mut Outputs) {
    let listen = format!("127.0.0.1:{}", free_port());
    let log = dir.join(format!("serve-{}.log", given.way));
    let file = std::fs::File::create(&log).unwrap();
    let args = vec![
        "serve".to_string(),
        "--listen".into(),
        listen.clone(),
        "--prefix".into(),
        prefix.into(),
    ];
    let mut child = given
        .command(dir, &args, false)
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .unwrap();
    let (_, body) = wait_for("tally serve", Duration::from_secs(20), || {
        http_get(&listen, "/v1/likes?post_id=1&post_id=2").ok()
    });
    outputs.add(format!("{} serve answer", given.way), body);
    outputs.add(
        format!("{} serve /metrics", given.way),
        scrape_metrics(&listen),
    );
    let _ = child.kill();
    let _ = child.wait();
    outputs.add(
        format!("{} serve log", given.way),
        std::fs::read_to_string(&log).unwrap(),
    );
}

#[test]
fn no_kafka_password_reaches_any_output() {
    let run = Scenario::new("e2e_secrets_kafka", "ksecrets", PARTITIONS);
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let ways = kafka_ways(dir.path());
    // Each failing start waits out librdkafka's metadata timeout, so the ways run side by side,
    // each in a thread of its own; their outputs are gathered in the ways' order.
    let printed_by_way: Vec<Vec<(String, String)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ways
            .iter()
            .map(|given| scope.spawn(|| kafka_way_outputs(given, &run, &redis, dir.path())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut outputs = Outputs::default();
    for (what, text) in printed_by_way.into_iter().flatten() {
        outputs.add(what, text);
    }
    let secrets: Vec<String> = ways.iter().map(|g| g.secret.clone()).collect();
    outputs.assert_free_of(&secrets);
}

/// What `tally run` (against the test broker, which speaks no SASL, and against no broker) and
/// `tally config print` printed, given the Kafka password `given`'s way.
fn kafka_way_outputs(
    given: &Given,
    run: &Scenario,
    redis: &RedisServer,
    dir: &Path,
) -> Vec<(String, String)> {
    let mut seen = Vec::new();
    // The test broker speaks no SASL: every start fails in the handshake, after librdkafka
    // has logged everything it does with the password. Then a broker that is not there.
    for (command, brokers) in [
        ("run", run.brokers.as_str()),
        ("run", "127.0.0.1:1"),
        ("config print", run.brokers.as_str()),
    ] {
        let mut args: Vec<String> = command.split(' ').map(String::from).collect();
        args.extend(tally_args(
            brokers,
            &run.topic,
            &run.group,
            &redis.url(),
            &run.prefix,
        ));
        args.extend(["-X".into(), "debug=all".into()]);
        let mut given = given.clone();
        // A flag beats its variable: TALLY_KAFKA_CONFIG takes the other -X settings too.
        if let Some((_, value)) = given
            .env
            .iter_mut()
            .find(|(k, _)| k == "TALLY_KAFKA_CONFIG")
        {
            let mut kept = Vec::new();
            let mut rest = args.into_iter();
            while let Some(arg) = rest.next() {
                if arg == "-X" {
                    value.push(',');
                    value.push_str(&rest.next().unwrap());
                } else {
                    kept.push(arg);
                }
            }
            args = kept;
        }
        let out = finish(given.command(dir, &args, true));
        let want = if command == "run" { Some(1) } else { Some(0) };
        assert_eq!(
            out.status.code(),
            want,
            "{} {command}: {}",
            given.way,
            printed(&out)
        );
        seen.push((
            format!("{} {command} on {brokers}", given.way),
            printed(&out),
        ));
    }
    seen
}
