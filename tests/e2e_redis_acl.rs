//! Least privilege in Redis: every command that talks to Redis runs under the ACL rule
//! docs/security.md publishes (read from `tally docs acl`, the one place the rules live), with its
//! keys limited to `~<prefix>:*`; and under that rule less any one permission, it fails with an
//! error that names the permission, from Redis' NOPERM reply. A last pass runs the whole suite
//! as one user allowed every command but only the prefix's keys, so tally never touches a key
//! outside its prefix; the counts stay exact throughout.

mod cluster;
mod common;

use std::collections::HashMap;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use cluster::RedisCluster;
use common::*;

const PARTITIONS: i32 = 2;
const EVENTS: usize = 1_500;
/// One command's published rule: every permission, and those whose refusal is a warning only.
struct Rule {
    all: Vec<String>,
    warns: Vec<String>,
}

/// Every command's rule, from `tally docs acl`.
fn published_rules() -> HashMap<String, Rule> {
    let out = tally_cli(&["docs", "acl"]);
    assert!(out.status.success(), "{}", output_text(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut rules = HashMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("| `tally ") else {
            continue;
        };
        let (command, rest) = rest.split_once("` | `").expect("a rule row");
        let (rule, warns) = rest
            .strip_prefix("~<prefix>:* resetchannels -@all ")
            .and_then(|r| r.split_once("` |"))
            .unwrap_or_else(|| panic!("unexpected rule row: {line}"));
        let permissions = |text: &str| -> Vec<String> {
            text.split_whitespace()
                .filter(|token| *token != "|")
                .map(|token| {
                    let token = token.trim_matches('`').replace("\\|", "|");
                    token.strip_prefix('+').expect("+permission").to_string()
                })
                .collect()
        };
        let rule = Rule {
            all: permissions(rule),
            warns: permissions(warns),
        };
        assert!(rule.warns.iter().all(|p| rule.all.contains(p)), "{line}");
        rules.insert(command.to_string(), rule);
    }
    rules
}

/// Where the counts go: one redis-server, or a cluster of three primaries.
enum Store {
    Single(RedisServer),
    Cluster(RedisCluster),
}

/// The store, an admin connection to each of its nodes, and a fresh ACL user per attempt
/// (a cluster's nodes each keep their own users).
struct Lab {
    store: Store,
    admins: Vec<redis::Connection>,
    users: u32,
}

fn admin(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .unwrap()
        .get_connection()
        .unwrap()
}

impl Lab {
    fn start(store: Store) -> Lab {
        let admins = Lab::ports_of(&store).into_iter().map(admin).collect();
        Lab {
            store,
            admins,
            users: 0,
        }
    }

    fn ports_of(store: &Store) -> Vec<u16> {
        match store {
            Store::Single(redis) => vec![redis.port()],
            Store::Cluster(cluster) => cluster.nodes.iter().map(|n| n.port).collect(),
        }
    }

    /// Every post's count under `prefix`.
    fn counts(&mut self, prefix: &str) -> HashMap<u64, i64> {
        match &self.store {
            Store::Single(_) => read_counts(&mut self.admins[0], prefix),
            Store::Cluster(cluster) => cluster.read_counts(prefix),
        }
    }

    /// A new user allowed exactly `rule` on the keys of `prefix`; its URL. Scripts are
    /// flushed, so the first call of each sends its full text (EVAL) as after a restart.
    fn user(&mut self, prefix: &str, rule: &[&str]) -> String {
        self.users += 1;
        let name = format!("tally{}", self.users);
        let mut setuser = redis::cmd("ACL");
        setuser
            .arg("SETUSER")
            .arg(&name)
            .arg("reset")
            .arg("on")
            .arg(">pw")
            .arg(format!("~{prefix}:*"))
            .arg("resetchannels");
        for permission in rule {
            setuser.arg(permission);
        }
        for admin in &mut self.admins {
            let _: () = setuser.query(admin).expect("ACL SETUSER");
            let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(admin).unwrap();
        }
        match &self.store {
            Store::Single(redis) => format!("redis://{name}:pw@127.0.0.1:{}/", redis.port()),
            Store::Cluster(cluster) => cluster
                .url()
                .replace("redis+cluster://", &format!("redis+cluster://{name}:pw@")),
        }
    }
}

/// `tally <args>`, which must end within `timeout`: its output.
fn finish(args: &[String], timeout: Duration) -> Output {
    let mut child = Command::new(tally_bin())
        .args(args)
        .env_remove("TALLY_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tally");
    let deadline = Instant::now() + timeout;
    while child.try_wait().expect("poll tally").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("reap tally");
            panic!(
                "tally {args:?} did not end within {timeout:?}:\n{}",
                output_text(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().expect("reap tally")
}

/// Runs a command to its end against a store URL and a prefix: `Ok` with its output when it
/// worked, `Err` with what it said when it failed.
type Runner = Box<dyn Fn(&Ctx, &str, &str) -> Result<String, String>>;

/// How one command of the suite is run, against a store URL and a prefix.
struct Step {
    name: &'static str,
    run: Runner,
}

/// What the steps share: the topic, its events, the store's nodes.
struct Ctx {
    run: Scenario,
    workload: Workload,
    /// Every node of the store (every primary, on a cluster).
    ports: Vec<u16>,
    /// Slot groups, each with a fence per partition (1 on a single server).
    groups: usize,
    /// Arguments every command of `run`'s family takes here (`--slot-groups` on a cluster).
    extra: Vec<String>,
    /// Likes of [`HOT_POST`] produced while `tally run` ran, on top of the workload.
    hot_likes: std::cell::Cell<i64>,
}

/// The post whose likes keep coming while `tally run` runs, so that hot-post detection
/// promotes it.
const HOT_POST: u64 = 999_999;

impl Ctx {
    /// Every post's count once every event in the topic is counted.
    fn truth(&self) -> HashMap<u64, i64> {
        let mut truth = self.workload.truth.clone();
        *truth.entry(HOT_POST).or_insert(0) += self.hot_likes.get();
        truth
    }

    /// Whether every fence of `group` under `prefix` holds the last offset of its partition.
    fn applied(&self, prefix: &str, group: &str, hwms: &[i64]) -> bool {
        let topic = &self.run.topic;
        let mut at_end = vec![0; hwms.len()];
        for &port in &self.ports {
            let mut conn = admin(port);
            for key in scan_keys(&mut conn, &format!("{prefix}:fence:{group}:{topic}:*")) {
                let rest = &key[format!("{prefix}:fence:{group}:{topic}:").len()..];
                let partition: usize = rest.split(':').next().unwrap().parse().unwrap();
                let value: Option<i64> = redis::cmd("GET").arg(&key).query(&mut conn).unwrap();
                if value == Some(hwms[partition] - 1) {
                    at_end[partition] += 1;
                }
            }
        }
        hwms.iter()
            .zip(at_end)
            .all(|(&hwm, n)| hwm == 0 || n == self.groups)
    }
}

fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A one-shot command's result: its output when it exited 0.
fn outcome(out: &Output) -> Result<String, String> {
    if out.status.success() {
        Ok(output_text(out))
    } else {
        Err(output_text(out))
    }
}

fn kafka_args(ctx: &Ctx, url: &str, prefix: &str, group: &str) -> Vec<String> {
    let mut args = tally_args(&ctx.run.brokers, &ctx.run.topic, group, url, prefix);
    args.extend(owned(&["--buckets", "32"]));
    args.extend(ctx.extra.clone());
    args
}

/// `tally run` on `prefix` (its own group) until every event is applied; an error when it stops
/// by itself first.
fn count_everything(ctx: &Ctx, url: &str, prefix: &str) -> Result<String, String> {
    let group = format!("{prefix}-group");
    let mut args = tally_args(&ctx.run.brokers, &ctx.run.topic, &group, url, prefix);
    args.extend(owned(&["--promote-above", "1", "--hot-buckets", "24"]));
    args.extend(ctx.extra.clone());
    // Promotion needs a post above the threshold in two windows in a row: keep one coming.
    let hot = ctx
        .run
        .hot_likes(HOT_POST, 10, PARTITIONS, Duration::from_millis(100), 7);
    let mut tally = Tally::spawn_args("tally-run", &args);
    let detected = wait_for("hot-post detection", Duration::from_secs(30), || {
        let log = tally.log_text();
        if log.contains("Hot post promoted.") || log.contains("Sharing hot-post counts failed") {
            return Some(true);
        }
        tally.try_status().map(|_| false)
    });
    ctx.hot_likes.set(ctx.hot_likes.get() + hot.stop() as i64);
    let hwms = high_watermarks(&ctx.run.brokers, &ctx.run.topic);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = tally.try_status() {
            return Err(format!("exited {status}:\n{}", tally.log_text()));
        }
        if ctx.applied(prefix, &group, &hwms) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "tally run did not apply everything within 60 s nor stop:\n{}",
            tally.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        detected,
        "tally run stopped by itself, yet applied everything"
    );
    assert!(tally.sigterm_and_wait(Duration::from_secs(20)).success());
    Ok(tally.log_text())
}

/// `tally serve` answers a batch read; an error when it stops at start or answers otherwise.
fn serve_a_read(_: &Ctx, url: &str, prefix: &str) -> Result<String, String> {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut serve = Tally::spawn_command(
        "tally-serve",
        "serve",
        &["--listen", &listen, "--redis", url, "--prefix", prefix],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        if let Some(status) = serve.try_status() {
            return Err(format!("exited {status}:\n{}", serve.log_text()));
        }
        if let Ok(answer) = http_get(&listen, "/v1/likes?post_id=1&post_id=2&post_id=3") {
            break answer;
        }
        assert!(Instant::now() < deadline, "tally serve never listened");
        std::thread::sleep(Duration::from_millis(100));
    };
    serve.kill9();
    match answer {
        (200, body) => Ok(body),
        (status, body) => Err(format!("{status} {body}")),
    }
}

/// Routing under `prefix` made final a year ahead, as an event stamped then would on a cluster,
/// written as the admin on whichever node holds the registry.
fn freeze_routing(ctx: &Ctx, prefix: &str) {
    let ahead = now_ms() + 365 * 86_400_000;
    let written = ctx.ports.iter().any(|&port| {
        redis::cmd("HSET")
            .arg(format!("{prefix}:routes"))
            .arg("final")
            .arg(ahead)
            .query::<()>(&mut admin(port))
            .is_ok()
    });
    assert!(written, "no node took the registry's final time");
}

fn steps() -> Vec<Step> {
    let one_shot =
        |name: &'static str, make: fn(&Ctx, &str, &str) -> Vec<String>, secs: u64| Step {
            name,
            run: Box::new(move |ctx, url, prefix| {
                outcome(&finish(&make(ctx, url, prefix), Duration::from_secs(secs)))
            }),
        };
    vec![
        Step {
            name: "run",
            run: Box::new(count_everything),
        },
        one_shot(
            "count",
            |_, url, prefix| {
                owned(&[
                    "count",
                    "1",
                    "2",
                    "3",
                    "--show-keys",
                    "--redis",
                    url,
                    "--prefix",
                    prefix,
                ])
            },
            30,
        ),
        Step {
            name: "serve",
            run: Box::new(serve_a_read),
        },
        one_shot(
            "inspect",
            |_, url, prefix| owned(&["inspect", "post", "1", "--redis", url, "--prefix", prefix]),
            30,
        ),
        one_shot(
            "promote",
            |_, url, prefix| {
                owned(&[
                    "promote",
                    "7",
                    "--to-buckets",
                    "40",
                    "--redis",
                    url,
                    "--prefix",
                    prefix,
                ])
            },
            30,
        ),
        one_shot(
            "demote",
            |_, url, prefix| owned(&["demote", "7", "--redis", url, "--prefix", prefix]),
            30,
        ),
        one_shot(
            "rebucket",
            |_, url, prefix| {
                owned(&[
                    "rebucket",
                    "--to-buckets",
                    "32",
                    "--redis",
                    url,
                    "--prefix",
                    prefix,
                ])
            },
            30,
        ),
        Step {
            name: "unfreeze-routing",
            run: Box::new(|ctx, url, prefix| {
                freeze_routing(ctx, prefix);
                let mut args = owned(&["unfreeze-routing"]);
                args.extend(kafka_args(ctx, url, prefix, &format!("{prefix}-group")));
                outcome(&finish(&args, Duration::from_secs(60)))
            }),
        },
        one_shot(
            "verify",
            |ctx, url, prefix| {
                let mut args = owned(&["verify"]);
                args.extend(kafka_args(ctx, url, prefix, &format!("{prefix}-group")));
                args
            },
            90,
        ),
        one_shot(
            "rebuild",
            |ctx, url, prefix| {
                let mut args = owned(&["rebuild"]);
                args.extend(kafka_args(ctx, url, prefix, &format!("{prefix}-group")));
                args
            },
            120,
        ),
        one_shot(
            "gc",
            |_, url, prefix| {
                owned(&[
                    "gc",
                    "--grace-secs",
                    "0",
                    "--redis",
                    url,
                    "--prefix",
                    prefix,
                ])
            },
            30,
        ),
        one_shot(
            "reset-fences",
            |ctx, url, prefix| {
                let mut args = owned(&["reset-fences", "--yes"]);
                args.extend(kafka_args(ctx, url, prefix, &format!("{prefix}-group")));
                args
            },
            90,
        ),
    ]
}

/// Runs the whole suite on `prefix`, each command under the URL `url_for` gives it; before each
/// command, `before` may try it otherwise.
fn suite(
    lab: &mut Lab,
    ctx: &Ctx,
    prefix: &str,
    url_for: &mut dyn FnMut(&mut Lab, &str) -> String,
    before: &mut dyn FnMut(&mut Lab, &Step),
) {
    for step in steps() {
        before(lab, &step);
        let url = url_for(lab, step.name);
        match (step.run)(ctx, &url, prefix) {
            Ok(_) => eprintln!("[e2e_redis_acl] tally {} works under its rule", step.name),
            Err(said) => panic!("tally {} failed under its rule:\n{said}", step.name),
        }
        if step.name == "run" {
            assert_exact(lab, prefix, &ctx.truth());
        }
    }
}

fn assert_exact(lab: &mut Lab, prefix: &str, truth: &HashMap<u64, i64>) {
    assert_counts_eq(&lab.counts(prefix), truth);
}

/// Slot groups on the cluster.
const CLUSTER_GROUPS: usize = 8;

fn setup(store: Store) -> (Lab, Ctx) {
    let run = Scenario::new("e2e_redis_acl", "acl", PARTITIONS);
    let workload = Workload::generate(run.seed, EVENTS, PARTITIONS);
    produce(&run.brokers, &run.topic, workload.messages(0..EVENTS));
    let (groups, extra) = match store {
        Store::Single(_) => (1, Vec::new()),
        Store::Cluster(_) => (
            CLUSTER_GROUPS,
            owned(&["--slot-groups", &CLUSTER_GROUPS.to_string()]),
        ),
    };
    let lab = Lab::start(store);
    let ports = Lab::ports_of(&lab.store);
    (
        lab,
        Ctx {
            run,
            workload,
            ports,
            groups,
            extra,
            hot_likes: std::cell::Cell::new(0),
        },
    )
}

#[test]
fn every_command_works_under_its_rule_and_fails_without_any_one_permission() {
    let (mut lab, ctx) = setup(Store::Single(RedisServer::start()));
    let rules = published_rules();
    for step in steps() {
        assert!(
            rules.contains_key(step.name),
            "no rule for tally {}",
            step.name
        );
    }
    let prefix = ctx.run.prefix.clone();
    let rule_of =
        |name: &str| -> Vec<String> { rules[name].all.iter().map(|p| format!("+{p}")).collect() };
    let mut attempt = 0;
    suite(
        &mut lab,
        &ctx,
        &prefix,
        &mut |lab, name| {
            let rule = rule_of(name);
            let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
            lab.user(&prefix, &rule)
        },
        &mut |lab, step| {
            for missing in &rules[step.name].all {
                attempt += 1;
                // `run` starts from nothing each time: its own prefix (and group).
                let on = if step.name == "run" {
                    format!("{prefix}-without-{attempt}")
                } else {
                    prefix.clone()
                };
                let rule: Vec<String> = rules[step.name]
                    .all
                    .iter()
                    .filter(|p| *p != missing)
                    .map(|p| format!("+{p}"))
                    .collect();
                let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
                let url = lab.user(&on, &rule);
                let named = format!("'{missing}'");
                match (step.run)(&ctx, &url, &on) {
                    Err(said) => {
                        assert!(
                            !rules[step.name].warns.contains(missing),
                            "tally {} stopped without +{missing}, published as a warning only:\n{said}",
                            step.name
                        );
                        assert!(
                            said.contains(&named) && said.contains("no permissions"),
                            "tally {} without +{missing} failed without naming it:\n{said}",
                            step.name
                        );
                        // A command's last line says what to grant (a served read answers
                        // with Redis' reply alone).
                        if let Some(line) = said.lines().rfind(|l| l.starts_with("error: ")) {
                            assert!(
                                line.contains(&format!("grant +{missing}")),
                                "the error line does not say what to grant:\n{line}"
                            );
                        }
                    }
                    Ok(said) => {
                        assert!(
                            rules[step.name].warns.contains(missing)
                                && said
                                    .lines()
                                    .any(|l| l.contains("WARN") && l.contains(&named)),
                            "tally {} worked without +{missing}:\n{said}",
                            step.name
                        );
                    }
                }
                eprintln!(
                    "[e2e_redis_acl] tally {} refused without +{missing}",
                    step.name
                );
            }
        },
    );
}

#[test]
fn a_user_limited_to_the_prefix_runs_every_command() {
    let (mut lab, ctx) = setup(Store::Single(RedisServer::start()));
    // A key outside the prefix that a stray command would read or write.
    let _: () = redis::cmd("SET")
        .arg("outside")
        .arg("1")
        .query(&mut lab.admins[0])
        .unwrap();
    let prefix = ctx.run.prefix.clone();
    let url = lab.user(&prefix, &["+@all"]);
    suite(
        &mut lab,
        &ctx,
        &prefix,
        &mut |_, _| url.clone(),
        &mut |_, _| {},
    );
    let log: Vec<String> = redis::cmd("ACL")
        .arg("LOG")
        .query(&mut lab.admins[0])
        .map(|entries: Vec<redis::Value>| entries.iter().map(|e| format!("{e:?}")).collect())
        .unwrap();
    assert!(log.is_empty(), "Redis refused tally something: {log:?}");
}

/// The permissions `tally docs acl` publishes for those who use them as `users` says (the
/// table's second column holds it).
fn published_addition(users: &str) -> Vec<String> {
    let out = tally_cli(&["docs", "acl"]);
    let text = String::from_utf8(out.stdout).unwrap();
    let added: Vec<String> = text
        .lines()
        .filter(|l| l.contains(users))
        .map(|l| {
            let cell = l.split("` |").next().unwrap();
            cell.trim_start_matches("| `+").replace("\\|", "|")
        })
        .collect();
    assert!(
        !added.is_empty(),
        "no addition for {users:?} published:\n{text}"
    );
    added
}

/// What a cluster adds to every rule, from `tally docs acl`.
fn published_cluster_addition() -> Vec<String> {
    published_addition("| all, on a cluster |")
}

#[test]
fn on_a_cluster_every_command_needs_its_rule_and_the_cluster_addition() {
    let (mut lab, ctx) = setup(Store::Cluster(RedisCluster::start(3, 0)));
    let rules = published_rules();
    let added = published_cluster_addition();
    let prefix = ctx.run.prefix.clone();
    let rule_of = |name: &str, with_cluster: bool| -> Vec<String> {
        let extra = if with_cluster {
            added.clone()
        } else {
            Vec::new()
        };
        rules[name]
            .all
            .iter()
            .chain(&extra)
            .map(|p| format!("+{p}"))
            .collect()
    };
    suite(
        &mut lab,
        &ctx,
        &prefix,
        &mut |lab, name| {
            let rule = rule_of(name, true);
            let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
            lab.user(&prefix, &rule)
        },
        &mut |lab, step| {
            let rule = rule_of(step.name, false);
            let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
            // `run` starts from nothing each time: its own prefix (and group).
            let on = if step.name == "run" {
                format!("{prefix}-without-cluster")
            } else {
                prefix.clone()
            };
            let url = lab.user(&on, &rule);
            match (step.run)(&ctx, &url, &on) {
                Err(said) => {
                    for permission in &added {
                        assert!(
                            said.contains(&format!("'{permission}'")),
                            "tally {} on a cluster without +{permission} failed without naming it:\n{said}",
                            step.name
                        );
                    }
                }
                Ok(said) => panic!(
                    "tally {} worked on a cluster without {added:?}:\n{said}",
                    step.name
                ),
            }
            eprintln!(
                "[e2e_redis_acl] tally {} on a cluster refused without {added:?}",
                step.name
            );
        },
    );
}

/// What the packed layout adds to the rules of the commands that write counters, from `tally
/// docs acl`.
/// `tally run <flags>` counts every event under `run`'s rule and the addition `tally docs acl`
/// publishes for `whose`, and without any one permission of the addition stops with an error
/// that names it, having counted nothing; what it wrote matches `written`. Returns the lab and
/// the prefix counted into.
fn run_needs_its_addition(flags: &[&str], whose: &str, written: &str) -> (Lab, String) {
    let (mut lab, mut ctx) = setup(Store::Single(RedisServer::start()));
    ctx.extra.extend(owned(flags));
    let rules = published_rules();
    let added = published_addition(whose);
    let shown = flags.join(" ");
    let rule = |without: Option<&str>| -> Vec<String> {
        let mut rule: Vec<String> = rules["run"].all.clone();
        for p in &added {
            if !rule.contains(p) {
                rule.push(p.clone());
            }
        }
        rule.retain(|p| Some(p.as_str()) != without);
        rule.iter().map(|p| format!("+{p}")).collect()
    };
    for permission in &added {
        let on = format!("{}-without-{}", ctx.run.prefix, permission);
        let rule = rule(Some(permission));
        let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
        let url = lab.user(&on, &rule);
        match count_everything(&ctx, &url, &on) {
            Err(said) => assert!(
                said.contains(&format!("'{permission}'")),
                "tally run {shown} without +{permission} failed without naming it:\n{said}"
            ),
            Ok(said) => panic!("tally run {shown} worked without +{permission}:\n{said}"),
        }
        assert!(
            lab.counts(&on).values().all(|&c| c == 0),
            "counted without +{permission}"
        );
        eprintln!("[e2e_redis_acl] tally run {shown} refused without +{permission}");
    }
    let prefix = ctx.run.prefix.clone();
    let rule = rule(None);
    let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
    let url = lab.user(&prefix, &rule);
    count_everything(&ctx, &url, &prefix)
        .unwrap_or_else(|e| panic!("tally run {shown} under its rule: {e}"));
    let keys = scan_keys(&mut lab.admins[0], &format!("{prefix}:{written}"));
    assert!(!keys.is_empty(), "nothing under {prefix}:{written}");
    assert_exact(&mut lab, &prefix, &ctx.truth());
    (lab, prefix)
}

/// `tally run --layout packed` needs the packed addition.
#[test]
fn the_packed_layout_needs_its_addition() {
    run_needs_its_addition(
        &["--layout", "packed"],
        "run and rebuild with --layout packed",
        "packed:*",
    );
}

/// `tally run --windows` needs the windows' addition; then `tally top` lists a window under its
/// published rule and fails without any one permission of it, naming the one missing. The
/// window's floor is raised past every count first (its leaders emptied, as the script would),
/// so that the list is read from the counts and that read's permissions are checked too.
#[test]
fn windows_need_their_addition() {
    let (mut lab, prefix) = run_needs_its_addition(
        &["--windows", "1h"],
        "run and rebuild with --windows",
        "win:*",
    );
    let rules = published_rules();
    // The window the likes went to (`<prefix>:win:<size>:<start>`), not the clock's: the hour
    // may have turned since.
    let key = scan_keys(&mut lab.admins[0], &format!("{prefix}:win:*"))
        .into_iter()
        .next()
        .expect("a window set");
    let start = key.rsplit(':').next().unwrap().to_string();
    let leaders = key.replacen(":win:", ":top:", 1);
    let () = redis::pipe()
        .cmd("HSET")
        .arg(&key)
        .arg("floor")
        .arg(1_000_000_000)
        .ignore()
        .cmd("DEL")
        .arg(&leaders)
        .ignore()
        .query(&mut lab.admins[0])
        .expect("raise the floor");
    let top = |lab: &mut Lab, rule: &[String]| -> Result<String, String> {
        let rule: Vec<String> = rule.iter().map(|p| format!("+{p}")).collect();
        let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
        let url = lab.user(&prefix, &rule);
        outcome(&finish(
            &owned(&[
                "top", "--window", "1h", "--at", &start, "--json", "--redis", &url, "--prefix",
                &prefix,
            ]),
            Duration::from_secs(30),
        ))
    };
    let all = &rules["top"].all;
    for missing in all {
        let rule: Vec<String> = all.iter().filter(|p| *p != missing).cloned().collect();
        match top(&mut lab, &rule) {
            Err(said) => assert!(
                said.contains(&format!("'{missing}'")),
                "tally top without +{missing} failed without naming it:\n{said}"
            ),
            Ok(said) => panic!("tally top worked without +{missing}:\n{said}"),
        }
        eprintln!("[e2e_redis_acl] tally top refused without +{missing}");
    }
    let said = top(&mut lab, all).unwrap_or_else(|e| panic!("tally top under its rule: {e}"));
    assert!(
        said.contains("\"post_id\""),
        "tally top listed no post:\n{said}"
    );
}
