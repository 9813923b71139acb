//! tally on a real Redis Cluster: exact counts with a viral post spread over
//! every primary, through slot migration, SCRIPT FLUSH, primary failover, a
//! primary restarted from an AOF that lost its last writes, and consumers
//! killed between the scripts of one batch; and a rebuild under live traffic,
//! verify and gc, each across every primary. A restart with another
//! `--slot-groups` is refused by the layout record, and `inspect` needs no
//! layout flag.

mod cluster;
mod common;
mod library;

use std::collections::HashSet;
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
    let pattern = format!("{prefix}:likes:{post}:*");
    let mut holders = HashSet::new();
    for (port, _) in cluster.primaries() {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
        let mut conn = client.get_connection().unwrap();
        let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(&mut conn).unwrap();
        if !keys.is_empty() {
            holders.insert(port);
        }
    }
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
    let keys: Vec<String> = cluster
        .scan(&format!("{g1}:likes:{victim}:*"))
        .into_keys()
        .collect();
    assert!(!keys.is_empty(), "no keys for post {victim} in {g1}");
    let seed = format!("redis://127.0.0.1:{}/", cluster.primaries()[0].0);
    let mut conn = redis::cluster::ClusterClient::new(vec![seed])
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("INCRBY")
        .arg(&keys[0])
        .arg(5)
        .query(&mut conn)
        .unwrap();
    let drift = tally_cli(&verify);
    let report = output_text(&drift);
    assert!(
        !drift.status.success(),
        "verify must fail on drift: {report}"
    );
    assert!(report.contains("; 1 drift"), "{report}");
    assert!(report.contains(&format!("{victim} ")), "{report}");
    let _: () = redis::cmd("DECRBY")
        .arg(&keys[0])
        .arg(5)
        .query(&mut conn)
        .unwrap();

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
