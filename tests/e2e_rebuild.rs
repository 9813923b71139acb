//! Rebuild and verify against a real broker and redis-server, with ground truth computed here:
//!
//! * a rebuild while live traffic flows, SIGKILLed half-way and started again; after the switch
//!   every count is exact, the live consumer kept counting through it with a short pause, and a
//!   reader polling a likes-only hot post never saw it go down, nor below the old generation's
//!   value once the pointer had moved;
//! * FLUSHALL, then a rebuild restores every count, and `tally run` carries on in the new
//!   generation; a later rebuild, whose abort is refused while it runs, killed and aborted,
//!   leaves no key behind;
//! * `tally verify` reports exactly the post whose bucket was corrupted, and nothing otherwise;
//! * `--from-timestamp` counts exactly the events stamped after it and says how many it skipped;
//!   meanwhile `--metrics-addr` serves its progress alone, which moves and ends at the totals.

mod common;
mod library;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

const HOT: u64 = 424_242_424;
const HOT_PER_ROUND: usize = 20;

/// Waits for a spawned command to exit and returns whether it succeeded.
fn wait_exit(tally: &mut Tally, timeout: Duration) -> bool {
    let status = wait_for("the command to exit", timeout, || tally.try_status());
    status.success()
}

/// Runs `tally rebuild` with `args` to the end into generation 1, which the pointer then names;
/// returns the finished process (for its log) and generation 1's prefix.
fn rebuild_into_g1(conn: &mut redis::Connection, prefix: &str, args: &[&str]) -> (Tally, String) {
    let mut rebuild = Tally::spawn_command("rebuild", "rebuild", args);
    assert!(
        wait_exit(&mut rebuild, Duration::from_secs(180)),
        "rebuild failed:\n{}",
        rebuild.log_tail(40)
    );
    assert_eq!(current_generation(conn, prefix), 1);
    (rebuild, format!("{prefix}:g1"))
}

/// Scrapes a rebuild's /metrics at `addr` until it exits: per scrape with progress in it, the
/// offsets recounted and left over every partition, and the phase. Also checks that nothing of
/// the recounting pipeline is exported, and that every partition has its series.
fn watch_rebuild_progress(rebuild: &mut Tally, addr: &str) -> Vec<(f64, f64, String)> {
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while rebuild.try_status().is_none() && Instant::now() < deadline {
        if let Ok(text) = try_scrape_metrics(addr) {
            let recounted = metric_series(&text, "tally_rebuild_recounted_offsets");
            let left = metric_series(&text, "tally_rebuild_remaining_offsets");
            let phase = metric_series(&text, "tally_rebuild_phase")
                .into_iter()
                .find(|(_, v)| *v == 1.0)
                .map(|(labels, _)| labels.trim_matches(['{', '}']).replace("phase=", ""))
                .map(|p| p.trim_matches('"').to_string());
            assert!(
                metric_series(&text, "tally_events_total").is_empty()
                    && metric_series(&text, "tally_consumer_lag_seconds").is_empty(),
                "the rebuild exports its pipeline's metrics:\n{text}"
            );
            if !recounted.is_empty() {
                assert_eq!(recounted.len(), Small::PARTITIONS as usize, "{text}");
                assert_eq!(left.len(), Small::PARTITIONS as usize, "{text}");
                let sum = |series: &[(String, f64)]| series.iter().map(|(_, v)| v).sum::<f64>();
                seen.push((sum(&recounted), sum(&left), phase.unwrap_or_default()));
            }
        }
        thread::sleep(Duration::from_millis(50));
    }
    seen
}

/// The number after `field=` on the last log line holding `needle`.
fn logged_field(log: &str, needle: &str, field: &str) -> Option<u64> {
    let line = log.lines().rev().find(|l| l.contains(needle))?;
    let at = line.find(&format!("{field}="))? + field.len() + 1;
    line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

#[test]
fn rebuild_under_live_traffic_switches_without_gap_or_going_back() {
    const PARTITIONS: i32 = 4;
    const BACKLOG: usize = 40_000;
    let run = Scenario::new("e2e_rebuild_live", "rbl", PARTITIONS);
    let redis = RedisServer::start();
    let url = redis.url();
    let mut conn = redis.conn();
    let tuning = ["--buckets", "4", "--route-refresh-ms", "200"].map(String::from);

    let mut workload = Workload::new(run.seed, PARTITIONS);
    let backlog = workload.grow(BACKLOG);
    produce(&run.brokers, &run.topic, workload.messages(backlog));
    let mut live_args = run.tally_args(&url);
    live_args.extend(tuning.clone());
    live_args.extend(["--promote-above", "0"].map(String::from));
    let mut live = Tally::spawn_args("live", &live_args);
    let hwms = run.hwms(BACKLOG);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        live.assert_running()
    });

    // Live traffic from here on: background events, and likes of the hot post only.
    let background = run.stream(workload, 100, Duration::from_millis(100));
    let hot_producer = run.hot_likes(
        HOT,
        HOT_PER_ROUND,
        PARTITIONS,
        Duration::from_millis(100),
        run.seed ^ 0x407,
    );
    let stop = hot_producer.stop_flag();

    // A reader polls the hot post through the library, noting the pointer it saw before each read.
    let samples: Arc<Mutex<Vec<(u64, i64)>>> = Arc::default();
    let reader = {
        let (url, prefix, stop, samples) = (
            url.clone(),
            run.prefix.clone(),
            stop.clone(),
            samples.clone(),
        );
        let mut conn = redis.conn();
        thread::spawn(move || {
            let (rt, reader) = library::reader(&url, &prefix, 1, 4, Duration::ZERO);
            let mut last = i64::MIN;
            while !stop.load(Ordering::SeqCst) {
                let generation = current_generation(&mut conn, &prefix);
                let likes = rt.block_on(reader.count(HOT)).expect("reader count").likes;
                assert!(
                    likes >= last,
                    "the hot post went down from {last} to {likes} (pointer {generation})"
                );
                last = likes;
                samples.lock().unwrap().push((generation, likes));
                thread::sleep(Duration::from_millis(5));
            }
        })
    };

    // The rebuild, killed when it has done about a third of the backlog.
    let mut rebuild_args = run.tally_args(&url);
    rebuild_args.extend(tuning.clone());
    // Small batches, one at a time, each held a little: slow enough to kill it half-way.
    rebuild_args.extend(
        [
            "--batch-max-events",
            "300",
            "--max-in-flight",
            "1",
            "--test-script-pause-ms",
            "25",
        ]
        .map(String::from),
    );
    let rebuild_refs: Vec<&str> = rebuild_args.iter().map(String::as_str).collect();
    let g1 = format!("{}:g1", run.prefix);
    let mut first = Tally::spawn_command("rebuild-1", "rebuild", &rebuild_refs);
    let started = Instant::now();
    wait_for(
        "the rebuild to get a third of the way",
        Duration::from_secs(120),
        || {
            first.assert_running();
            let done = run.applied_under(&mut conn, &g1, PARTITIONS as usize);
            (done >= BACKLOG as i64 / 3).then_some(done)
        },
    );
    first.kill9();
    let done = run.applied_under(&mut conn, &g1, PARTITIONS as usize);
    eprintln!(
        "[e2e_rebuild] rebuild killed after {:.1} s with {done} offsets applied",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        current_generation(&mut conn, &run.prefix),
        0,
        "killed before the switch"
    );
    assert!(
        done < BACKLOG as i64,
        "the rebuild finished before it could be killed"
    );
    thread::sleep(Duration::from_secs(1));
    live.assert_running();

    let mut second = Tally::spawn_command("rebuild-2", "rebuild", &rebuild_refs);
    assert!(
        wait_exit(&mut second, Duration::from_secs(240)),
        "the resumed rebuild failed:\n{}",
        second.log_tail(40)
    );
    assert_eq!(current_generation(&mut conn, &run.prefix), 1);
    let second_log = second.log_text();
    assert!(
        second_log.contains("Resuming the unfinished rebuild"),
        "{second_log}"
    );
    // The old generation no longer moves: its hot-post count is its value at the switch.
    let old_final = read_counts(&mut conn, &run.prefix)
        .get(&HOT)
        .copied()
        .unwrap_or(0);

    // Traffic goes on for a while in generation 1, then stops; everything must be exact.
    thread::sleep(Duration::from_secs(3));
    let hot_total = hot_producer.stop() as i64;
    reader.join().expect("reader thread");
    let workload = background.stop();
    let mut truth: HashMap<u64, i64> = workload.truth.clone();
    *truth.entry(HOT).or_insert(0) += hot_total;
    let hwms = run.hwms(workload.events.len() + hot_total as usize);
    wait_applied_while(
        &mut conn,
        &g1,
        &run.group,
        &run.topic,
        &hwms,
        Duration::from_secs(120),
        || live.assert_running(),
    );
    assert_counts_eq(&read_counts(&mut conn, &g1), &truth);

    let samples = samples.lock().unwrap().clone();
    let after: Vec<i64> = samples
        .iter()
        .filter(|(g, _)| *g == 1)
        .map(|&(_, v)| v)
        .collect();
    eprintln!(
        "[e2e_rebuild] {} reads, {} after the switch; old generation ended at {old_final}, hot post {}",
        samples.len(),
        after.len(),
        truth[&HOT]
    );
    assert!(samples.iter().any(|(g, _)| *g == 0) && !after.is_empty());
    assert!(
        after.iter().all(|&v| v >= old_final),
        "a read after the switch was below the old generation's {old_final}: {:?}",
        after.iter().min()
    );

    // The live consumer switched once, paused briefly, and kept counting.
    let live_log = live.log_text();
    let paused = logged_field(&live_log, "Switched to generation.", "paused_ms")
        .unwrap_or_else(|| panic!("no switch in the live log:\n{}", live.log_tail(40)));
    eprintln!("[e2e_rebuild] live consumer paused {paused} ms for the switch");
    assert!(
        live_log.contains("Freeze: holding new batches"),
        "{live_log}"
    );
    assert!(paused < 5_000, "the live pause was {paused} ms");

    // Readers agree, verify finds no drift, and gc drops generation 0 only after its grace.
    let common = ["--redis", url.as_str(), "--prefix", run.prefix.as_str()];
    let out = tally_cli(&[&["count", &HOT.to_string(), "--show-keys"], &common[..]].concat());
    assert!(out.status.success(), "{}", output_text(&out));
    let shown = output_text(&out);
    assert!(shown.contains(&truth[&HOT].to_string()) && shown.contains(&format!("prefix {g1}")));
    let verify_args: Vec<&str> = ["verify"]
        .into_iter()
        .chain(rebuild_refs.iter().copied())
        .collect();
    let out = tally_cli(&verify_args);
    assert!(out.status.success(), "verify: {}", output_text(&out));
    let out = tally_cli(&[&["gc", "--grace-secs", "3600"], &common[..4]].concat());
    assert!(
        out.status.success() && output_text(&out).contains("stay until"),
        "{}",
        output_text(&out)
    );
    assert!(!read_counts(&mut conn, &run.prefix).is_empty());
    let out = tally_cli(&[&["gc", "--grace-secs", "0"], &common[..4]].concat());
    assert!(out.status.success(), "{}", output_text(&out));
    eprintln!("[e2e_rebuild] gc: {}", output_text(&out).trim());
    assert!(read_counts(&mut conn, &run.prefix).is_empty());
    assert_counts_eq(&read_counts(&mut conn, &g1), &truth);
    let status = live.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success());
}

/// A three-partition scenario against its own redis-server.
struct Small {
    run: Scenario,
    redis: RedisServer,
    conn: redis::Connection,
    args: Vec<String>,
}

impl Small {
    const PARTITIONS: i32 = 3;

    fn new(name: &str, short: &str) -> Small {
        let run = Scenario::new(name, short, Self::PARTITIONS);
        let redis = RedisServer::start();
        let conn = redis.conn();
        let args = run.tally_args(&redis.url());
        Small {
            run,
            redis,
            conn,
            args,
        }
    }

    /// Starts `tally run` and waits until it has applied all `messages` of the topic.
    fn count_all(&mut self, messages: usize) -> Tally {
        let mut live = Tally::spawn_args("live", &self.args);
        let hwms = self.run.hwms(messages);
        self.run
            .wait_applied(&mut self.conn, &hwms, Duration::from_secs(120), || {
                live.assert_running()
            });
        live
    }
}

#[test]
fn flushall_then_rebuild_restores_every_count() {
    const PARTITIONS: i32 = Small::PARTITIONS;
    let mut small = Small::new("e2e_rebuild_flush", "rbf");
    let mut workload = Workload::new(small.run.seed, PARTITIONS);
    let first = workload.grow(8_000);
    produce(
        &small.run.brokers,
        &small.run.topic,
        workload.messages(first),
    );
    let mut live = small.count_all(8_000);
    assert!(live.sigterm_and_wait(Duration::from_secs(20)).success());
    let Small {
        run,
        redis,
        mut conn,
        args,
    } = small;
    let url = redis.url();

    let _: () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
    assert!(read_counts(&mut conn, &run.prefix).is_empty());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (rebuild, g1) = rebuild_into_g1(&mut conn, &run.prefix, &refs);
    assert_counts_eq(&read_counts(&mut conn, &g1), &workload.truth);

    // The library's reader follows the pointer.
    let (rt, reader) = library::reader(&url, &run.prefix, 1, 16, Duration::from_secs(1));
    let posts: Vec<u64> = workload.truth.keys().copied().collect();
    for count in rt.block_on(reader.counts(&posts)).unwrap() {
        assert_eq!(count.likes, workload.truth[&count.post_id]);
    }
    assert!(
        rebuild.log_text().contains("Rebuild progress"),
        "{}",
        rebuild.log_tail(20)
    );
    let out = tally_cli(&[&["rebuild", "--abort"], &refs[..]].concat());
    assert!(
        output_text(&out).contains("no unfinished rebuild"),
        "{}",
        output_text(&out)
    );

    // A second rebuild, stopped early and aborted, leaves generation 1 as it was.
    let slow: Vec<&str> = refs
        .iter()
        .copied()
        .chain(["--batch-max-events", "100", "--test-script-pause-ms", "200"])
        .collect();
    let mut doomed = Tally::spawn_command("rebuild-aborted", "rebuild", &slow);
    let g2 = format!("{}:g2", run.prefix);
    wait_for(
        "the second rebuild to apply",
        Duration::from_secs(60),
        || {
            doomed.assert_running();
            (applied_offsets(&mut conn, &g2, &run.group, &run.topic, PARTITIONS as usize)
                .iter()
                .sum::<i64>()
                > 0)
            .then_some(())
        },
    );
    // Not while it runs: the abort would delete keys under a live writer.
    let out = tally_cli(&[&["rebuild", "--abort"], &refs[..]].concat());
    assert!(
        !out.status.success() && output_text(&out).contains("is running"),
        "{}",
        output_text(&out)
    );
    doomed.kill9();
    // Once it has been silent for ten seconds, it is taken for dead.
    let out = wait_for("the abort", Duration::from_secs(30), || {
        let out = tally_cli(&[&["rebuild", "--abort"], &refs[..]].concat());
        out.status.success().then_some(out)
    });
    assert!(
        output_text(&out).contains("dropped generation 2"),
        "{}",
        output_text(&out)
    );
    let left: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{g2}:*"))
        .query(&mut conn)
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
    let record: bool = redis::cmd("EXISTS")
        .arg(format!("{}:rebuild", run.prefix))
        .query(&mut conn)
        .unwrap();
    assert!(!record);
    assert_eq!(current_generation(&mut conn, &run.prefix), 1);
    assert_counts_eq(&read_counts(&mut conn, &g1), &workload.truth);

    // `tally run` starts in generation 1 and carries on from its fences.
    let mut live = Tally::spawn_args("live-2", &args);
    let more = workload.grow(2_000);
    produce(&run.brokers, &run.topic, workload.messages(more));
    let hwms = run.hwms(10_000);
    wait_applied_while(
        &mut conn,
        &g1,
        &run.group,
        &run.topic,
        &hwms,
        Duration::from_secs(120),
        || live.assert_running(),
    );
    assert_counts_eq(&read_counts(&mut conn, &g1), &workload.truth);
    assert!(read_counts(&mut conn, &run.prefix).is_empty());
}

#[test]
fn verify_reports_exactly_the_corrupted_post() {
    let mut small = Small::new("e2e_verify", "vfy");
    let workload = Workload::generate(small.run.seed, 6_000, Small::PARTITIONS);
    produce(
        &small.run.brokers,
        &small.run.topic,
        workload.messages(0..workload.events.len()),
    );
    let mut live = small.count_all(6_000);
    let Small {
        run,
        redis: _redis,
        mut conn,
        args,
    } = small;
    let verify: Vec<&str> = ["verify"]
        .into_iter()
        .chain(args.iter().map(String::as_str))
        .collect();

    let clean = tally_cli(&verify);
    assert!(clean.status.success(), "verify: {}", output_text(&clean));
    assert!(
        output_text(&clean).contains("; 0 drift"),
        "{}",
        output_text(&clean)
    );

    // Corrupt one bucket of one post (not the viral one).
    let victim = *workload
        .truth
        .iter()
        .filter(|&(&p, &n)| p != workload.viral_post && n > 0)
        .map(|(p, _)| p)
        .min()
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:likes:{victim}:*", run.prefix))
        .query(&mut conn)
        .unwrap();
    let _: i64 = redis::cmd("INCRBY")
        .arg(&keys[0])
        .arg(7)
        .query(&mut conn)
        .unwrap();
    let drift = tally_cli(&verify);
    let report = output_text(&drift);
    eprintln!("[e2e_verify] {report}");
    assert!(
        !drift.status.success(),
        "verify must fail on drift: {report}"
    );
    let stdout = String::from_utf8_lossy(&drift.stdout).into_owned();
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    let expected = workload.truth[&victim];
    assert_eq!(rows.len(), 1, "{report}");
    let cells: Vec<&str> = rows[0].split_whitespace().collect();
    let want = [
        victim.to_string(),
        expected.to_string(),
        (expected + 7).to_string(),
        "+7".to_string(),
    ];
    assert_eq!(
        cells,
        want.iter().map(String::as_str).collect::<Vec<_>>(),
        "{report}"
    );
    assert!(report.contains("; 1 drift"), "{report}");

    // Narrowed to other posts, nothing drifts.
    let other = workload.viral_post.to_string();
    let narrowed: Vec<&str> = verify
        .iter()
        .copied()
        .chain(["--posts", other.as_str()])
        .collect();
    let out = tally_cli(&narrowed);
    assert!(out.status.success(), "{}", output_text(&out));
    live.assert_running();
}

#[test]
fn rebuild_from_timestamp_counts_only_the_events_stamped_after_it() {
    let mut small = Small::new("e2e_rebuild_from", "rbt");
    let run = &small.run;
    let mut workload = Workload::new(run.seed, Small::PARTITIONS);
    let before = workload.grow(3_000);
    produce(&run.brokers, &run.topic, workload.messages(before));
    let earlier = workload.truth.clone();
    // Kafka stamps each message when the producer sends it; leave a clear gap around `from`.
    thread::sleep(Duration::from_millis(1_500));
    let from = now_ms();
    thread::sleep(Duration::from_millis(1_500));
    let after = workload.grow(3_000);
    produce(&run.brokers, &run.topic, workload.messages(after));
    let mut later = workload.truth.clone();
    for (post, count) in &earlier {
        *later.entry(*post).or_insert(0) -= count;
    }

    let mut live = small.count_all(6_000);
    assert!(live.sigterm_and_wait(Duration::from_secs(20)).success());
    let Small {
        run,
        mut conn,
        args,
        ..
    } = small;
    assert_counts_eq(&read_counts(&mut conn, &run.prefix), &workload.truth);

    let from_arg = from.to_string();
    let refs: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .chain(["--from-timestamp", &from_arg])
        .collect();
    // Slowed down (small batches, one at a time, each held a little) so that /metrics shows it
    // move, and freezing late so that the recount is seen before the cut-over.
    let metrics = format!("127.0.0.1:{}", free_port());
    let watched: Vec<&str> = refs
        .iter()
        .copied()
        .chain(["--metrics-addr", &metrics, "--cutover-margin", "100"])
        .chain(["--batch-max-events", "100", "--max-in-flight", "1"])
        .chain(["--test-script-pause-ms", "40"])
        .collect();
    let mut rebuild = Tally::spawn_command("rebuild", "rebuild", &watched);
    let mut progress = watch_rebuild_progress(&mut rebuild, &metrics);
    progress.dedup();
    assert!(
        wait_exit(&mut rebuild, Duration::from_secs(120)),
        "rebuild failed:\n{}",
        rebuild.log_tail(40)
    );
    assert_eq!(current_generation(&mut conn, &run.prefix), 1);
    let g1 = format!("{}:g1", run.prefix);
    assert_counts_eq(&read_counts(&mut conn, &g1), &later);
    eprintln!("[e2e_rebuild] progress scraped (recounted, left, phase): {progress:?}");
    let totals: Vec<(f64, f64)> = progress.iter().map(|&(r, l, _)| (r, l)).collect();
    assert!(
        totals
            .windows(2)
            .all(|w| w[1].0 >= w[0].0 && w[1].1 <= w[0].1),
        "recounted only grows and left only shrinks: {totals:?}"
    );
    let distinct: std::collections::BTreeSet<u64> = totals.iter().map(|t| t.0 as u64).collect();
    assert!(distinct.len() >= 2, "the progress never moved: {totals:?}");
    assert_eq!(
        totals.last().copied(),
        Some((3_000.0, 0.0)),
        "the recount ends at the events stamped after --from-timestamp, none left"
    );
    for phase in ["recounting", "cutover"] {
        assert!(
            progress.iter().any(|(_, _, p)| p == phase),
            "phase {phase} never seen: {progress:?}"
        );
    }
    let log = rebuild.log_text();
    assert!(
        log.contains(&format!("--from-timestamp {from} skips them")),
        "{}",
        rebuild.log_tail(20)
    );
    assert_eq!(
        logged_field(
            &log,
            "REBUILD STARTS AT THE RETENTION BOUNDARY",
            "offsets_skipped"
        ),
        Some(3_000),
        "{}",
        rebuild.log_tail(20)
    );
}
