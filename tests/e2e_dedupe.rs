//! Producers that deliver at least once: records repeated by id (an outbox relay publishing
//! again, some in the same batch, some minutes of event time later), double taps (without ids,
//! with a fresh id on each copy, with an id on one copy only) and like-like-unlike sequences,
//! with SIGKILLs and a rebalance between a record and its repeat. With `--dedupe
//! ids-and-actions`, every post's count must equal a truth that counts each like once, and
//! `tally verify` must agree with the store under the same rule:
//!
//! * every kind of repeat at once, through kills and a rebalance;
//! * every tap with a fresh event id of its own (what most mobile clients send), through three
//!   SIGKILLs of consumers while batches land;
//! * the same traffic recounted by `tally rebuild` under the same rule, SIGKILLed a third of
//!   the way and resumed while live traffic goes on: every count after the cut-over is exact.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::*;

const PARTITIONS: i32 = 4;
/// Offsets per partition the window spans; every repeat lands closer than this.
const WINDOW: usize = 4_000;
/// How far back (records of its partition) a repeat may reach.
const REACH: usize = 1_500;
/// Fresh-id records produced before the consumers start: about a window of every partition,
/// which the traffic after it takes past the window, so windows slide as well as restart.
const FRESH_BACKLOG: usize = 16_000;

fn dedupe_args(run: &Scenario, redis: &RedisServer) -> Vec<String> {
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--dedupe",
            "ids-and-actions",
            "--dedupe-window",
            &WINDOW.to_string(),
            // Small batches: a record and its repeat often straddle a batch, a kill or a
            // rebalance.
            "--batch-max-events",
            "300",
            "--flush-interval-ms",
            "30",
        ]
        .map(String::from),
    );
    args
}

/// `tally verify` with `args` (those of `tally run`), deciding repeats by `mode`.
fn verify(args: &[String], mode: &str) -> String {
    let mut all = vec!["verify".to_string()];
    all.extend(args.iter().cloned());
    let at = all
        .iter()
        .position(|a| a == "--dedupe")
        .expect("--dedupe given");
    all[at + 1] = mode.to_string();
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    output_text(&tally_cli(&refs))
}

/// Records skipped for `reason`, from a scrape of `/metrics`.
fn skipped(text: &str, reason: &str) -> f64 {
    metric_value(
        text,
        &format!("tally_duplicates_skipped_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

#[test]
fn repeats_count_once_through_kills_and_a_rebalance() {
    let run = Scenario::new("e2e_dedupe", "dedupe", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut dupes = Dupes::new(run.seed, PARTITIONS, REACH);
    let args = dedupe_args(&run, &redis);
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut with_metrics = args.clone();
    with_metrics.extend(["--metrics-addr".to_string(), metrics.clone()]);
    let started = Instant::now();

    let mut a = Tally::spawn_args("tally-a", &with_metrics);
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    thread::sleep(Duration::from_secs(3));
    // A kill while batches land: the next owner re-reads the window below its fences.
    a.kill9();
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    a = Tally::spawn_args("tally-a2", &with_metrics);
    thread::sleep(Duration::from_secs(2));
    // A second member: partitions move, and each new owner rebuilds their windows.
    let mut b = Tally::spawn_args("tally-b", &args);
    produce(&run.brokers, &run.topic, dupes.grow(8_000));
    thread::sleep(Duration::from_secs(4));
    b.kill9();
    produce(&run.brokers, &run.topic, dupes.grow(6_000));

    let hwms = run.hwms(dupes.records);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(180), || {
        a.assert_running()
    });
    eprintln!(
        "[e2e_dedupe] {} applied in {:.1} s",
        dupes.summary(),
        started.elapsed().as_secs_f64()
    );
    run.assert_exact(&mut conn, &dupes.truth);

    let text = scrape_metrics(&metrics);
    let (ids, actions) = (skipped(&text, "event_id"), skipped(&text, "repeat_action"));
    eprintln!(
        "[e2e_dedupe] after its restart tally-a skipped {ids} repeated ids, {actions} repeated actions"
    );
    assert!(ids > 0.0 && actions > 0.0, "{text}");

    // verify walks the log from the origin by the same rule; without it, the repeats are
    // drift.
    let same = verify(&args, "ids-and-actions");
    assert!(same.contains("; 0 drift"), "{same}");
    let off = verify(&args, "off");
    assert!(!off.contains("; 0 drift"), "{off}");

    let status = a.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "{}", a.log_tail(30));
}

/// Every partition holds more offsets than a window, so records leave windows as well as
/// enter them.
fn assert_windows_slide(hwms: &[i64]) {
    assert!(
        hwms.iter().all(|&end| end > WINDOW as i64),
        "partitions shorter than a window ({WINDOW}): {hwms:?}"
    );
}

/// Every tap carries a fresh event id of its own, as most mobile clients send them: to the id
/// rule the two copies of a double tap are two events, and only the action rule can tell the
/// second repeats the first. Three consumers are SIGKILLed while batches land, so new owners
/// re-read the windows below their fences and must reach the same verdicts.
#[test]
fn fresh_ids_per_tap_count_once_through_three_kills() {
    let run = Scenario::new("e2e_dedupe_fresh", "dfresh", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let args = dedupe_args(&run, &redis);
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut with_metrics = args.clone();
    with_metrics.extend(["--metrics-addr".to_string(), metrics.clone()]);
    let started = Instant::now();

    let mut dupes = Dupes::fresh_ids(run.seed, PARTITIONS, REACH);
    produce(&run.brokers, &run.topic, dupes.grow(FRESH_BACKLOG));
    let mut consumers = [
        Tally::spawn_args("tally-1", &args),
        Tally::spawn_args("tally-2", &args),
    ];
    let producer = dupes.stream(&run.brokers, &run.topic, 400, Duration::from_millis(100));
    // The producer never pauses for long, so every kill cuts batches in flight. The member
    // started after the second kill serves /metrics and lives to the end.
    for (kill, victim) in [0, 1, 0].into_iter().enumerate() {
        thread::sleep(Duration::from_secs(3));
        consumers.iter_mut().for_each(Tally::assert_running);
        consumers[victim].kill9();
        let name = format!("tally-{}", kill + 3);
        consumers[victim] = match kill {
            1 => Tally::spawn_args(&name, &with_metrics),
            _ => Tally::spawn_args(&name, &args),
        };
    }
    thread::sleep(Duration::from_secs(4));
    let dupes = producer.stop();

    let hwms = run.hwms(dupes.records);
    assert_windows_slide(&hwms);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(180), || {
        consumers.iter_mut().for_each(Tally::assert_running)
    });
    eprintln!(
        "[e2e_dedupe] fresh ids: {} applied in {:.1} s",
        dupes.summary(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        dupes.fresh_id_repeats > 0 && dupes.fresh_id_repeats == dupes.action_repeats,
        "{}",
        dupes.summary()
    );
    run.assert_exact(&mut conn, &dupes.truth);

    let text = scrape_metrics(&metrics);
    let (ids, actions) = (skipped(&text, "event_id"), skipped(&text, "repeat_action"));
    eprintln!(
        "[e2e_dedupe] fresh ids: tally-4 skipped {ids} repeated ids, {actions} repeated actions"
    );
    assert!(actions > 0.0, "{text}");

    let same = verify(&args, "ids-and-actions");
    assert!(same.contains("; 0 drift"), "{same}");
    for mut c in consumers {
        let status = c.sigterm_and_wait(Duration::from_secs(20));
        assert!(status.success(), "{}", c.log_tail(30));
    }
}

/// `tally rebuild` with the same rule recounts fresh-id taps once: traffic through two kills of
/// the live consumer, then a rebuild under live traffic, SIGKILLed a third of the way and
/// started again (it re-reads its windows below its fences). After the cut-over every count
/// equals the truth, and `tally verify` agrees.
#[test]
fn a_rebuild_counts_fresh_id_taps_once() {
    let run = Scenario::new("e2e_dedupe_rebuild", "drb", PARTITIONS);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut args = dedupe_args(&run, &redis);
    args.extend(["--route-refresh-ms", "200"].map(String::from));
    let mut rebuild_args = args.clone();
    // One batch at a time, each held a little: slow enough to kill the rebuild part-way.
    rebuild_args.extend(["--max-in-flight", "1", "--test-script-pause-ms", "25"].map(String::from));
    let rebuild_args: Vec<&str> = rebuild_args.iter().map(String::as_str).collect();

    let mut dupes = Dupes::fresh_ids(run.seed, PARTITIONS, REACH);
    produce(&run.brokers, &run.topic, dupes.grow(FRESH_BACKLOG));
    let mut live = Tally::spawn_args("live-1", &args);
    let producer = dupes.stream(&run.brokers, &run.topic, 400, Duration::from_millis(100));
    for n in 2..=3 {
        thread::sleep(Duration::from_secs(3));
        live.assert_running();
        live.kill9();
        live = Tally::spawn_args(&format!("live-{n}"), &args);
    }
    thread::sleep(Duration::from_secs(3));
    let dupes = producer.stop();
    let backlog = dupes.records as i64;
    let hwms = run.hwms(dupes.records);
    assert_windows_slide(&hwms);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(180), || {
        live.assert_running()
    });
    eprintln!("[e2e_dedupe] before the rebuild: {}", dupes.summary());

    // Live traffic goes on through the rebuild and its cut-over.
    let producer = dupes.stream(&run.brokers, &run.topic, 100, Duration::from_millis(100));
    let g1 = format!("{}:g1", run.prefix);
    let mut first = Tally::spawn_command("rebuild-1", "rebuild", &rebuild_args);
    let done = wait_for(
        "the rebuild to get a third of the way",
        Duration::from_secs(120),
        || {
            first.assert_running();
            let done = run.applied_under(&mut conn, &g1, PARTITIONS as usize);
            (done >= backlog / 3).then_some(done)
        },
    );
    first.kill9();
    eprintln!("[e2e_dedupe] rebuild killed with {done} of {backlog} offsets recounted");
    assert!(
        done < backlog,
        "the rebuild finished before it could be killed"
    );
    assert_eq!(current_generation(&mut conn, &run.prefix), 0);

    let mut second = Tally::spawn_command("rebuild-2", "rebuild", &rebuild_args);
    let status = second.wait_exit(Duration::from_secs(240));
    assert!(status.success(), "{}", second.log_tail(40));
    assert_eq!(current_generation(&mut conn, &run.prefix), 1);
    let log = second.log_text();
    assert!(log.contains("Resuming the unfinished rebuild"), "{log}");
    assert!(
        log.contains("Re-reading the dedupe window below the fences."),
        "{log}"
    );

    // A little traffic in generation 1, then everything must be exact there.
    thread::sleep(Duration::from_secs(2));
    let dupes = producer.stop();
    let hwms = run.hwms(dupes.records);
    wait_applied_while(
        &mut conn,
        &g1,
        &run.group,
        &run.topic,
        &hwms,
        Duration::from_secs(120),
        || live.assert_running(),
    );
    eprintln!("[e2e_dedupe] after the cut-over: {}", dupes.summary());
    let same = verify(&args, "ids-and-actions");
    assert!(same.contains("; 0 drift"), "{same}");
    assert_counts_eq(&read_counts(&mut conn, &g1), &dupes.truth);
    let status = live.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "{}", live.log_tail(30));
}
