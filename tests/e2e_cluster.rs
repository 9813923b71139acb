//! tally on a real Redis Cluster: exact counts with a viral post spread over
//! every primary, through slot migration (`MIGRATE`, and on Valkey 9 the atomic
//! `CLUSTER MIGRATESLOTS` with a kill), SCRIPT FLUSH, primary failover, a
//! primary restarted from an AOF that lost its last writes, and consumers
//! killed between the scripts of one batch; and a rebuild under live traffic,
//! verify and gc, each across every primary. A restart with another
//! `--slot-groups` is refused by the layout record, and `inspect` needs no
//! layout flag.

mod cluster;
mod common;
mod library;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::Command;
use std::thread;
use std::time::Duration;

use cluster::RedisCluster;
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PARTITIONS: i32 = 8;
const GROUPS: usize = 16;

/// A scenario with a first wave of `events` already produced.
fn setup(name: &str, events: usize) -> (Scenario, Workload) {
    let run = Scenario::new(name, name, PARTITIONS);
    let mut workload = Workload::new(run.seed, PARTITIONS);
    let first = workload.grow(events);
    produce(&run.brokers, &run.topic, workload.messages(first));
    (run, workload)
}

fn args(run: &Scenario, cluster: &RedisCluster, extra: &[&str]) -> Vec<String> {
    let mut args = run.tally_args(&cluster.url());
    args.extend(["--slot-groups", &GROUPS.to_string()].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn finish(run: &Scenario, cluster: &RedisCluster, workload: &Workload, tallies: &mut [&mut Tally]) {
    let hwms = run.hwms(workload.events.len());
    cluster.wait_applied(
        &run.prefix,
        &run.group,
        &run.topic,
        &hwms,
        GROUPS,
        Duration::from_secs(180),
        || {
            for t in tallies.iter_mut() {
                t.assert_running();
            }
        },
    );
    let counts = cluster.read_counts(&run.prefix);
    assert_counts_eq(&counts, &workload.truth);
    assert_reader_exact(run, cluster, workload);
    for t in tallies.iter_mut() {
        assert!(
            !t.log_text().contains("CROSSSLOT"),
            "CROSSSLOT in log:\n{}",
            t.log_tail(30)
        );
        let status = t.sigterm_and_wait(Duration::from_secs(30));
        assert!(status.success(), "exit {status}:\n{}", t.log_tail(30));
    }
}

/// The library's reader, on the cluster, returns every post's truth: its pipelines cross slots
/// and nodes without a CROSSSLOT, and hot posts' versions are summed.
fn assert_reader_exact(run: &Scenario, cluster: &RedisCluster, workload: &Workload) {
    let (rt, reader) = library::reader(
        &cluster.url(),
        &run.prefix,
        GROUPS as u32,
        16,
        Duration::ZERO,
    );
    let posts: Vec<u64> = workload.truth.keys().copied().collect();
    for chunk in posts.chunks(1_000) {
        for count in rt
            .block_on(reader.counts(chunk))
            .expect("reader on the cluster")
        {
            assert_eq!(
                count.likes, workload.truth[&count.post_id],
                "reader count of post {}",
                count.post_id
            );
        }
    }
    eprintln!("[e2e_cluster] reader agrees on {} posts", posts.len());
}

#[test]
fn three_primaries_with_reshard_and_script_flush_count_exactly() {
    let cluster = RedisCluster::start(3, 0);
    let (run, workload) = setup("cluster-basic", 200_000);
    let viral_post = workload.viral_post;
    let mut tally = Tally::spawn_args("tally", &args(&run, &cluster, &[]));
    let producer = run.stream(workload, 2_000, Duration::from_millis(100));
    thread::sleep(Duration::from_secs(4));

    // The viral post starts on one key (the default of one bucket) and, once promoted, its
    // buckets are spread over every primary.
    wait_for(
        "the viral post's buckets to span all 3 primaries",
        Duration::from_secs(30),
        || {
            tally.assert_running();
            (primaries_holding(&cluster, &run.prefix, viral_post) == 3).then_some(())
        },
    );

    cluster.script_flush_all();
    eprintln!("[e2e_cluster] SCRIPT FLUSH on every primary");
    let primaries = cluster.primaries();
    cluster.reshard(&primaries[0].1, &primaries[1].1, 3_000);
    eprintln!("[e2e_cluster] 3000 slots moved");
    thread::sleep(Duration::from_secs(2));
    cluster.script_flush_all();
    let workload = producer.stop();
    eprintln!("[e2e_cluster] {}", workload.describe());
    finish(&run, &cluster, &workload, &mut [&mut tally]);

    // The ops view agrees: every bucket found on a primary, summing to the truth.
    let out = tally_cli(&[
        "inspect",
        "post",
        &viral_post.to_string(),
        "--redis",
        &cluster.url(),
        "--prefix",
        &run.prefix,
    ]);
    let report = String::from_utf8_lossy(&out.stdout);
    eprintln!("[e2e_cluster] inspect:\n{report}");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(report.contains("version 0: 1 bucket,"), "{report}");
    assert!(report.contains("over 3 primaries"), "{report}");
    assert!(
        report.contains(&format!("count {}", workload.truth[&viral_post])),
        "{report}"
    );
    assert!(!report.contains("(unassigned)"), "{report}");

    // Another slot-group count would put counters under other fences: refused, nothing changes.
    let mut changed = run.tally_args(&cluster.url());
    changed.extend(["--slot-groups", "32"].map(String::from));
    let out = Command::new(tally_bin())
        .arg("run")
        .args(&changed)
        .env_remove("TALLY_LOG")
        .output()
        .expect("run tally");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "error: --slot-groups 32 does not match the layout record {}:layout, written with {GROUPS}: ",
            run.prefix
        )),
        "{stderr}"
    );
    assert_counts_eq(&cluster.read_counts(&run.prefix), &workload.truth);
}

#[test]
fn primary_failover_and_aof_rollback_count_exactly() {
    let mut cluster = RedisCluster::start(3, 1);
    let (run, workload) = setup("cluster-failover", 60_000);
    let mut tally = Tally::spawn_args("tally", &args(&run, &cluster, &[]));
    let producer = run.stream(workload, 2_000, Duration::from_millis(100));
    thread::sleep(Duration::from_secs(4));

    // A primary dies; its replica takes over after the node timeout.
    let (victim, _) = cluster.primaries()[0].clone();
    cluster.node_mut(victim).kill();
    eprintln!("[e2e_cluster] primary {victim} killed");
    thread::sleep(Duration::from_secs(5));
    cluster.restart(victim);
    cluster.wait_ok();
    eprintln!("[e2e_cluster] failover done; {victim} back as a replica");
    thread::sleep(Duration::from_secs(3));

    // Another primary dies and comes back from its AOF before anyone fails it
    // over, having lost up to a second of acknowledged writes.
    let (victim, _) = cluster.primaries()[1].clone();
    cluster.node_mut(victim).kill();
    cluster.restart(victim);
    cluster.wait_ok();
    eprintln!("[e2e_cluster] primary {victim} restarted from its AOF");
    thread::sleep(Duration::from_secs(3));

    let workload = producer.stop();
    eprintln!("[e2e_cluster] {}", workload.describe());
    finish(&run, &cluster, &workload, &mut [&mut tally]);
}

/// Number of primaries holding at least one bucket of `post`.
fn primaries_holding(cluster: &RedisCluster, prefix: &str, post: u64) -> usize {
    let holders: HashSet<u16> = cluster
        .post_places(prefix, post)
        .into_iter()
        .map(|place| place.port)
        .collect();
    holders.len()
}

#[test]
fn killed_between_the_scripts_of_a_batch_counts_exactly() {
    let cluster = RedisCluster::start(3, 0);
    let (run, workload) = setup("cluster-kill", 40_000);
    // Scripts go one by one with a pause between them, so kills land mid-batch.
    let extra = ["--test-script-pause-ms", "15", "--batch-max-events", "2000"];
    let mut rng = StdRng::seed_from_u64(run.seed);
    let producer = run.stream(workload, 1_000, Duration::from_millis(100));
    let mut tally = Tally::spawn_args("tally-1", &args(&run, &cluster, &extra));
    for kill in 1..=5 {
        thread::sleep(Duration::from_millis(rng.random_range(2_000..4_000)));
        tally.assert_running();
        tally.kill9();
        eprintln!("[e2e_cluster] kill {kill}");
        tally = Tally::spawn_args(
            &format!("tally-{}", kill + 1),
            &args(&run, &cluster, &extra),
        );
    }
    let workload = producer.stop();
    finish(&run, &cluster, &workload, &mut [&mut tally]);
}

#[test]
fn rebuild_verify_and_gc_on_a_cluster() {
    let cluster = RedisCluster::start(3, 0);
    let url = cluster.url();
    let (run, workload) = setup("cluster-rebuild", 30_000);
    let live_args = args(&run, &cluster, &[]);
    let mut live = Tally::spawn_args("live", &live_args);
    let producer = run.stream(workload, 1_000, Duration::from_millis(100));
    thread::sleep(Duration::from_secs(3));

    // A rebuild under live traffic: generation 1 is written slot group by slot group, on every
    // primary, and the live consumer follows the pointer to it.
    let refs: Vec<&str> = live_args.iter().map(String::as_str).collect();
    let mut rebuild = Tally::spawn_command("rebuild", "rebuild", &refs);
    let status = wait_for("the rebuild to finish", Duration::from_secs(240), || {
        live.assert_running();
        rebuild.try_status()
    });
    assert!(
        status.success(),
        "rebuild failed:\n{}",
        rebuild.log_tail(40)
    );
    thread::sleep(Duration::from_secs(2));
    let workload = producer.stop();
    eprintln!("[e2e_cluster] {}", workload.describe());
    let g1 = format!("{}:g1", run.prefix);
    let hwms = run.hwms(workload.events.len());
    cluster.wait_applied(
        &g1,
        &run.group,
        &run.topic,
        &hwms,
        GROUPS,
        Duration::from_secs(180),
        || live.assert_running(),
    );
    assert_counts_eq(&cluster.read_counts(&g1), &workload.truth);
    assert_reader_exact(&run, &cluster, &workload);

    // verify recounts the topic and agrees; a bucket changed by hand is reported.
    let verify: Vec<&str> = ["verify"].into_iter().chain(refs.iter().copied()).collect();
    let out = tally_cli(&verify);
    assert!(out.status.success(), "verify: {}", output_text(&out));
    let victim = workload.viral_post;
    let places = cluster.post_places(&g1, victim);
    assert!(!places.is_empty(), "no counters of post {victim} in {g1}");
    // Adds to one of its counters by hand, in whichever layout it is kept.
    let add = |conn: &mut redis::cluster::ClusterConnection, by: i64| {
        let place = &places[0];
        let _: () = match &place.field {
            None => redis::cmd("INCRBY").arg(&place.key).arg(by).query(conn),
            Some(field) => redis::cmd("HINCRBY")
                .arg(&place.key)
                .arg(field)
                .arg(by)
                .query(conn),
        }
        .unwrap();
    };
    let seed = format!("redis://127.0.0.1:{}/", cluster.primaries()[0].0);
    let mut conn = redis::cluster::ClusterClient::new(vec![seed])
        .unwrap()
        .get_connection()
        .unwrap();
    add(&mut conn, 5);
    let drift = tally_cli(&verify);
    let report = output_text(&drift);
    assert!(
        !drift.status.success(),
        "verify must fail on drift: {report}"
    );
    assert!(report.contains("; 1 drift"), "{report}");
    assert!(report.contains(&format!("{victim} ")), "{report}");
    add(&mut conn, -5);

    // gc removes generation 0 from every primary and leaves generation 1 whole.
    assert!(!cluster.read_counts(&run.prefix).is_empty());
    let groups = GROUPS.to_string();
    let out = tally_cli(&[
        "gc",
        "--grace-secs",
        "0",
        "--redis",
        &url,
        "--prefix",
        &run.prefix,
        "--slot-groups",
        &groups,
    ]);
    assert!(out.status.success(), "gc: {}", output_text(&out));
    eprintln!("[e2e_cluster] gc: {}", output_text(&out).trim());
    assert!(cluster.read_counts(&run.prefix).is_empty());
    assert_counts_eq(&cluster.read_counts(&g1), &workload.truth);
    let status = live.sigterm_and_wait(Duration::from_secs(30));
    assert!(status.success(), "exit {status}:\n{}", live.log_tail(30));
}

/// Valkey 9's atomic slot migration (`CLUSTER MIGRATESLOTS`) under live traffic. Every slot
/// holding one of tally's keys (counters and fences of each slot group, origins, the layout
/// record, the routing registry, heat) moves from two primaries to the third while tally counts;
/// tally is SIGKILLed while those migrations run and started again at once. Then the third
/// primary sends each slot on to the primary it did not come from, in one command with two
/// targets, under the restarted consumer. Every count is exact, and CLUSTER SHARDS on every
/// primary names each slot's new owner, which holds its keys. No primary imports and exports at
/// once: Valkey 9.1.2 can abort then (docs/operations.md). Redis 7.0 has no atomic migration
/// (only `MIGRATE`, tested above): there the test checks that the server refuses the command.
#[test]
fn atomic_slot_migration_with_a_kill_counts_exactly() {
    let cluster = RedisCluster::start(3, 0);
    let mut primaries = cluster.primaries();
    primaries.sort();
    if Store::current() == Store::Redis {
        // A slot the first primary owns, so a server that knew the command would start moving it.
        let (source, id) = &primaries[0];
        let slot = cluster
            .shard_owners(*source)
            .into_iter()
            .filter(|(_, owner)| owner == id)
            .map(|(slot, _)| slot)
            .min()
            .expect("a slot on the first primary");
        let refused = cluster
            .migrate_slots(*source, &[(vec![(slot, slot)], primaries[1].1.clone())])
            .expect_err(
                "redis-server accepted CLUSTER MIGRATESLOTS: run this test's Valkey path on it",
            );
        let text = refused.to_string();
        assert!(
            text.contains("unknown subcommand") && text.contains("MIGRATESLOTS"),
            "{text}"
        );
        eprintln!(
            "[e2e_cluster] atomic slot migration NOT tested: redis-server refuses CLUSTER MIGRATESLOTS ({text}); it is Valkey 9's, run with TALLY_TEST_STORE=valkey"
        );
        return;
    }

    let (run, workload) = setup("cluster-atomic", 40_000);
    let tally_args = args(&run, &cluster, &[]);
    let mut first = Tally::spawn_args("tally-1", &tally_args);
    let producer = run.stream(workload, 1_000, Duration::from_millis(100));
    let fences = format!("{}:fence:{}:{}:*", run.prefix, run.group, run.topic);
    wait_for(
        "a fence in every slot group of every partition",
        Duration::from_secs(60),
        || {
            first.assert_running();
            (cluster.scan(&fences).len() == PARTITIONS as usize * GROUPS).then_some(())
        },
    );
    // Hot-post detection shares each second's heat under a hash tag of its own.
    let heat = format!("{}:heat:*", run.prefix);
    wait_for("the heat of hot posts", Duration::from_secs(60), || {
        first.assert_running();
        (!cluster.key_slots(&heat).is_empty()).then_some(())
    });

    // First move, to the third primary: the snapshots take about 3 s, long enough to kill
    // tally in the middle.
    let hub = primaries[2].0;
    let origin = cluster.key_slots(&format!("{}:*", run.prefix));
    let moves = start_moves(
        &cluster,
        &origin,
        |_, owner| (owner != hub).then_some(hub),
        Duration::from_secs(3),
    );
    thread::sleep(Duration::from_millis(700));
    first.kill9();
    let states = moves.states(&cluster);
    assert!(
        !states.is_empty() && states.iter().all(|s| !finished(s)),
        "tally was to be killed while every migration ran: {states:?}"
    );
    eprintln!("[e2e_cluster] tally SIGKILLed while the migrations were {states:?}");
    let mut second = Tally::spawn_args("tally-2", &tally_args);
    moves.wait_done(&cluster, || second.assert_running());

    // Second move, from the third primary to the other two, under the restarted consumer.
    let applied = |cluster: &RedisCluster| -> i64 {
        cluster
            .scan(&fences)
            .values()
            .map(|v| v.parse::<i64>().unwrap())
            .sum()
    };
    let before = applied(&cluster);
    wait_for(
        "the restarted tally to apply new events",
        Duration::from_secs(60),
        || {
            second.assert_running();
            (applied(&cluster) > before).then_some(())
        },
    );
    // Every slot tally writes went to the third primary: none came into use since.
    let now = cluster.key_slots(&format!("{}:*", run.prefix));
    let stray: Vec<_> = now.iter().filter(|(_, (port, _))| *port != hub).collect();
    assert!(
        stray.is_empty(),
        "slots tally wrote after the first move: {stray:?}"
    );
    let (a, b) = (primaries[0].0, primaries[1].0);
    let moves = start_moves(
        &cluster,
        &now,
        |slot, owner| match origin.get(&slot).map(|&(port, _)| port) {
            _ if owner != hub => None,
            Some(port) if port == a => Some(b),
            Some(port) if port == b => Some(a),
            _ => Some(if slot % 2 == 0 { a } else { b }),
        },
        Duration::from_millis(1_500),
    );
    moves.wait_done(&cluster, || second.assert_running());
    thread::sleep(Duration::from_secs(2));

    let workload = producer.stop();
    eprintln!("[e2e_cluster] {}", workload.describe());
    // What tally saw of the moves: the cluster client follows MOVED by itself; tally's own
    // retries ("retrying") would show an error it had to classify.
    for t in [&first, &second] {
        let log = t.log_text();
        let warnings: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
        eprintln!(
            "[e2e_cluster] {}: {} warnings, {} retried by tally{}",
            t.log_path().display(),
            warnings.len(),
            warnings.iter().filter(|l| l.contains("retrying")).count(),
            warnings
                .iter()
                .take(3)
                .map(|l| format!("\n  {l}"))
                .collect::<String>()
        );
    }
    finish(&run, &cluster, &workload, &mut [&mut second]);
}

/// Atomic migrations started by [`start_moves`]: slot → (source port, target port, target id),
/// and the export jobs' names on each source.
struct Moves {
    slots: BTreeMap<u16, (u16, u16, String)>,
    jobs: Vec<(u16, HashSet<String>)>,
}

/// Whether a migration job's state is final.
fn finished(state: &str) -> bool {
    matches!(state, "success" | "failed" | "cancelled")
}

/// Moves each slot of `found` (slot → (owner port, keys), from [`RedisCluster::key_slots`])
/// whose `target(slot, owner)` is another primary: one `CLUSTER MIGRATESLOTS` per source, with a
/// `SLOTSRANGE` group per target and a range per run of neighbouring slots. Each source's
/// snapshot is stretched to about `snapshot` with `rdb-key-save-delay` (a pause per key in the
/// fork that writes it), as slots holding many more keys would take.
fn start_moves(
    cluster: &RedisCluster,
    found: &BTreeMap<u16, (u16, usize)>,
    target: impl Fn(u16, u16) -> Option<u16>,
    snapshot: Duration,
) -> Moves {
    let ids: HashMap<u16, String> = cluster.primaries().into_iter().collect();
    // Per source: the ranges for each target, and how many keys the source holds in them.
    type Ranges = BTreeMap<u16, Vec<(u16, u16)>>;
    let mut by_source: BTreeMap<u16, (Ranges, usize)> = BTreeMap::new();
    let mut slots = BTreeMap::new();
    for (&slot, &(owner, keys)) in found {
        let Some(to) = target(slot, owner).filter(|&to| to != owner) else {
            continue;
        };
        slots.insert(slot, (owner, to, ids[&to].clone()));
        let (targets, total) = by_source.entry(owner).or_default();
        *total += keys;
        let ranges = targets.entry(to).or_default();
        match ranges.last_mut() {
            Some((_, last)) if *last + 1 == slot => *last = slot,
            _ => ranges.push((slot, slot)),
        }
    }
    let mut jobs = Vec::new();
    for (&source, (targets, keys)) in &by_source {
        let delay_us = (snapshot.as_micros() as usize / (*keys).max(1)).clamp(10, 50_000);
        cluster.config_set(source, "rdb-key-save-delay", &delay_us.to_string());
        let known: HashSet<String> = export_jobs(cluster, source)
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        let groups: Vec<(Vec<(u16, u16)>, String)> = targets
            .iter()
            .map(|(to, ranges)| (ranges.clone(), ids[to].clone()))
            .collect();
        let reply = cluster
            .migrate_slots(source, &groups)
            .unwrap_or_else(|e| panic!("CLUSTER MIGRATESLOTS on {source}: {e}"));
        assert_eq!(reply, "OK");
        let started: HashSet<String> = export_jobs(cluster, source)
            .into_iter()
            .map(|(name, _)| name)
            .filter(|name| !known.contains(name))
            .collect();
        assert_eq!(
            started.len(),
            targets.len(),
            "export jobs started on {source}"
        );
        for (to, ranges) in targets {
            eprintln!(
                "[e2e_cluster] MIGRATESLOTS from {source} to {to}: {} slots in {} ranges ({keys} keys on the source, {delay_us} µs a key)",
                ranges
                    .iter()
                    .map(|(f, l)| usize::from(l - f) + 1)
                    .sum::<usize>(),
                ranges.len(),
            );
        }
        jobs.push((source, started));
    }
    Moves { slots, jobs }
}

/// (name, state) of each export job `port` knows.
fn export_jobs(cluster: &RedisCluster, port: u16) -> Vec<(String, String)> {
    cluster
        .slot_migrations(port)
        .into_iter()
        .filter(|job| job.get("operation").map(String::as_str) == Some("EXPORT"))
        .map(|job| (job["name"].clone(), job["state"].clone()))
        .collect()
}

impl Moves {
    /// The state of each of these jobs.
    fn states(&self, cluster: &RedisCluster) -> Vec<String> {
        let mut states = Vec::new();
        for (source, names) in &self.jobs {
            for (name, state) in export_jobs(cluster, *source) {
                if names.contains(&name) {
                    states.push(state);
                }
            }
        }
        states
    }

    /// Waits until every job succeeded, then until CLUSTER SHARDS on every primary names each
    /// slot's target as its owner, the target holds the slot's keys and the source none.
    fn wait_done(&self, cluster: &RedisCluster, mut check: impl FnMut()) {
        let states = wait_for("the migrations to finish", Duration::from_secs(60), || {
            check();
            let states = self.states(cluster);
            states.iter().all(|s| finished(s)).then_some(states)
        });
        assert!(
            states.iter().all(|s| s == "success"),
            "migrations ended {states:?}"
        );
        for (source, _) in &self.jobs {
            cluster.config_set(*source, "rdb-key-save-delay", "0");
        }
        let ports: Vec<u16> = cluster.primaries().into_iter().map(|(p, _)| p).collect();
        let misplaced = |cluster: &RedisCluster| -> Vec<String> {
            let mut wrong = Vec::new();
            for &port in &ports {
                let owners = cluster.shard_owners(port);
                for (slot, (_, _, to)) in &self.slots {
                    if owners.get(slot) != Some(to) {
                        wrong.push(format!("{port} sees slot {slot} on {:?}", owners.get(slot)));
                    }
                }
            }
            for (slot, (from, to, _)) in &self.slots {
                let (left, arrived) = (
                    cluster.keys_in_slot(*from, *slot),
                    cluster.keys_in_slot(*to, *slot),
                );
                if left != 0 || arrived == 0 {
                    wrong.push(format!(
                        "slot {slot}: {left} keys left on {from}, {arrived} on {to}"
                    ));
                }
            }
            wrong
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            check();
            let wrong = misplaced(cluster);
            if wrong.is_empty() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "slots not moved: {}",
                wrong.join("; ")
            );
            thread::sleep(Duration::from_millis(200));
        }
        eprintln!(
            "[e2e_cluster] {} slots moved: CLUSTER SHARDS on every primary names their targets",
            self.slots.len()
        );
    }
}
