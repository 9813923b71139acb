//! A partition re-reading a long history never holds another back. With `--dedupe ids`, every
//! owner rebuilds a partition's dedupe window from the log below its fences before it decides
//! anything above them. After a restart, partition 0 re-reads 800,000 records, partition 1 only
//! a thousand; partition 1's events produced since must be applied while
//! partition 0's re-read is still running. Its end is read from tally's log line, and its length
//! from `tally_dedupe_reread_seconds`. Every count must stay exact.

mod common;

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use common::*;

/// Records of partition 0 before the restart: its re-read.
const LONG: usize = 800_000;
/// Records of partition 1 before the restart.
const SHORT: usize = 1_000;
/// Records produced to each partition while no consumer runs.
const NEW: usize = 2_000;
/// Offsets per partition the window spans: partition 0's whole history.
const WINDOW: usize = 1_000_000;
const POSTS: u64 = 50;

/// `n` likes with event ids for `partition`, numbered from `first`, added to `truth`.
fn likes(partition: i32, first: usize, n: usize, truth: &mut HashMap<u64, i64>) -> Vec<Msg> {
    let now = now_ms();
    (first..first + n)
        .map(|i| {
            let post = 1 + i as u64 % POSTS;
            *truth.entry(post).or_insert(0) += 1;
            let user = (i as u64 + 1) * 2 + partition as u64;
            let value = encode_like_with_id(post, user, LIKE, now, &format!("{partition}-{i}"));
            (None, value, partition)
        })
        .collect()
}

/// The line tally logs when `partition`'s re-read ended, if it has.
fn reread_end(log: &str, partition: i32) -> Option<String> {
    let field = format!("partition={partition} ");
    log.lines()
        .find(|l| l.contains("Dedupe window re-read;") && l.contains(&field))
        .map(str::to_string)
}

/// The value of `name=` in a log line.
fn field(line: &str, name: &str) -> f64 {
    let prefix = format!("{name}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&prefix)?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

#[test]
fn a_short_partition_applies_while_a_long_one_rereads() {
    let run = Scenario::new("e2e_dedupe_reread", "reread", 2);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--dedupe",
            "ids",
            "--dedupe-window",
            &WINDOW.to_string(),
            // A batch is sent 20 ms after its first event rather than 100 ms: partition 1's
            // first apply then follows its events closely, whichever build runs.
            "--flush-interval-ms",
            "20",
            "--metrics-addr",
            &metrics,
        ]
        .map(String::from),
    );
    let mut truth = HashMap::new();
    let mut history = likes(0, 0, LONG, &mut truth);
    history.extend(likes(1, 0, SHORT, &mut truth));
    produce(&run.brokers, &run.topic, history);

    let mut a = Tally::spawn_args("tally-a", &args);
    let hwms = run.hwms(LONG + SHORT);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(300), || {
        a.assert_running()
    });
    let status = a.sigterm_and_wait(Duration::from_secs(30));
    assert!(status.success(), "{}", a.log_tail(30));

    // Events that arrive while no consumer runs: above both partitions' fences.
    let mut new = likes(0, LONG, NEW, &mut truth);
    new.extend(likes(1, SHORT, NEW, &mut truth));
    produce(&run.brokers, &run.topic, new);
    let hwms = run.hwms(LONG + SHORT + 2 * NEW);
    let short_fence = SHORT as i64 - 1;

    let started = Instant::now();
    let mut b = Tally::spawn_args("tally-b", &args);
    // Partition 1's first apply since the restart: its fence moves past where tally-a left it.
    // The log is read after the fence, so a re-read of partition 0 that has not ended in the
    // log had not ended when the fence was read either.
    // Polled every 10 ms: the re-read must outlast the apply by more than that.
    let (applied_after, log) = loop {
        b.assert_running();
        let fences = read_fences(&mut conn, &run.prefix, &run.group, &run.topic, 2);
        if fences[1].is_some_and(|f| f > short_fence) {
            break (started.elapsed(), b.log_text());
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "partition 1 applied nothing within 120 s of the restart; fences {fences:?}"
        );
        thread::sleep(Duration::from_millis(10));
    };
    let scraped = scrape_metrics(&metrics);
    let gauge = |name: &str| {
        metric_value(&scraped, &format!("{name}{{partition=\"0\"}}")).unwrap_or(f64::NAN)
    };
    eprintln!(
        "[e2e_dedupe_reread] partition 1 applied {:.2} s after tally-b started; partition 0 then \
         re-read for {:.2} s with {} offsets left",
        applied_after.as_secs_f64(),
        gauge("tally_dedupe_reread_age_seconds"),
        gauge("tally_dedupe_reread_remaining_offsets"),
    );
    assert!(
        reread_end(&log, 1).is_some(),
        "partition 1 applied before its own re-read ended:\n{log}"
    );
    assert!(
        reread_end(&log, 0).is_none(),
        "partition 1's first apply waited for partition 0's re-read to end:\n{log}"
    );

    let end = wait_for(
        "partition 0's re-read to end",
        Duration::from_secs(120),
        || {
            b.assert_running();
            reread_end(&b.log_text(), 0)
        },
    );
    let ended_after = started.elapsed();
    eprintln!(
        "[e2e_dedupe_reread] partition 0's re-read ended {:.2} s after tally-b started: {end}",
        ended_after.as_secs_f64()
    );
    assert_eq!(field(&end, "offsets"), LONG as f64, "{end}");
    let short = reread_end(&b.log_text(), 1).unwrap();
    assert_eq!(field(&short, "offsets"), SHORT as f64, "{short}");
    assert!(
        field(&end, "seconds") > field(&short, "seconds"),
        "{end}\n{short}"
    );

    run.wait_applied(&mut conn, &hwms, Duration::from_secs(180), || {
        b.assert_running()
    });
    run.assert_exact(&mut conn, &truth);

    // Both re-reads are timed, and no gauge shows one running once they ended (the gauges are
    // set on the flush tick).
    thread::sleep(Duration::from_secs(1));
    let text = scrape_metrics(&metrics);
    let value = |name: &str| metric_value(&text, name).unwrap_or(f64::NAN);
    assert_eq!(value("tally_dedupe_reread_seconds_count"), 2.0, "{text}");
    let timed = value("tally_dedupe_reread_seconds_sum");
    assert!(timed >= field(&end, "seconds"), "{timed} s timed:\n{text}");
    for partition in 0..2 {
        for name in [
            "tally_dedupe_reread_age_seconds",
            "tally_dedupe_reread_remaining_offsets",
        ] {
            let series = format!("{name}{{partition=\"{partition}\"}}");
            assert_eq!(metric_value(&text, &series), Some(0.0), "{series}:\n{text}");
        }
    }
    let status = b.sigterm_and_wait(Duration::from_secs(20));
    assert!(status.success(), "{}", b.log_tail(30));
}

/// Copies of the likes `likes(partition, first, n, ..)` made: the same ids, posts and users.
fn copies(partition: i32, first: usize, n: usize) -> Vec<Msg> {
    likes(partition, first, n, &mut HashMap::new())
}

/// The partition whose window `log` says was taken up from an earlier ownership, and the
/// offset its re-read started at.
fn kept_window(log: &str) -> Option<(i32, i64)> {
    let line = log
        .lines()
        .find(|l| l.contains("Dedupe window kept from an earlier ownership"))?;
    Some((field(line, "partition") as i32, field(line, "from") as i64))
}

#[test]
fn a_partition_coming_back_rereads_only_what_was_applied_since_it_left() {
    const FIRST: usize = 20_000;
    const SECOND: usize = 5_000;
    const THIRD: usize = 3_000;
    const COPIED: usize = 1_000;
    let run = Scenario::new("e2e_dedupe_reread", "kept", 2);
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut args = run.tally_args(&redis.url());
    args.extend(
        [
            "--dedupe",
            "ids",
            "--dedupe-window",
            "100000",
            "--flush-interval-ms",
            "20",
        ]
        .map(String::from),
    );
    let mut truth = HashMap::new();
    let mut produced = 0;
    let send = |messages: Vec<Msg>, produced: &mut usize| {
        *produced += messages.len();
        produce(&run.brokers, &run.topic, messages);
    };

    // tally-a counts the first likes alone, from the origin: nothing to re-read.
    let mut first = likes(0, 0, FIRST, &mut truth);
    first.extend(likes(1, 0, FIRST, &mut truth));
    send(first, &mut produced);
    let mut a = Tally::spawn_args("tally-a", &args);
    let hwms = run.hwms(produced);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        a.assert_running()
    });

    // tally-b joins and takes one partition, re-reading its window whole.
    let mut b = Tally::spawn_args("tally-b", &args);
    let moved = wait_for(
        "tally-b to re-read a partition",
        Duration::from_secs(60),
        || {
            b.assert_running();
            a.assert_running();
            let log = b.log_text();
            (0..2).find(|&p| reread_end(&log, p).is_some())
        },
    );
    let stayed = 1 - moved;
    let line = reread_end(&b.log_text(), moved).unwrap();
    assert_eq!(field(&line, "offsets"), FIRST as f64, "{line}");

    // New likes and copies of the first ones, counted by both.
    let mut second = Vec::new();
    for p in 0..2 {
        second.extend(likes(p, FIRST, SECOND, &mut truth));
        second.extend(copies(p, 0, COPIED));
    }
    send(second, &mut produced);
    let hwms = run.hwms(produced);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        a.assert_running();
        b.assert_running();
    });
    run.assert_exact(&mut conn, &truth);

    // tally-b leaves: tally-a takes its partition back with the window it left with, and
    // re-reads only what tally-b applied.
    let status = b.sigterm_and_wait(Duration::from_secs(30));
    assert!(status.success(), "{}", b.log_tail(30));
    let (partition, from) = wait_for(
        "tally-a to take up its kept window",
        Duration::from_secs(60),
        || {
            a.assert_running();
            kept_window(&a.log_text())
        },
    );
    assert_eq!(partition, moved);
    assert_eq!(from, FIRST as i64, "the window had seen the first likes");
    let line = wait_for("tally-a's re-read to end", Duration::from_secs(60), || {
        a.assert_running();
        reread_end(&a.log_text(), moved)
    });
    assert_eq!(field(&line, "offsets"), (SECOND + COPIED) as f64, "{line}");
    assert!(
        reread_end(&a.log_text(), stayed).is_none(),
        "the partition that stayed re-read:\n{}",
        a.log_tail(40)
    );

    // Copies of both earlier rounds and new likes: only the new ones count.
    let mut third = Vec::new();
    for p in 0..2 {
        third.extend(likes(p, FIRST + SECOND, THIRD, &mut truth));
        third.extend(copies(p, FIRST - COPIED, COPIED));
        third.extend(copies(p, FIRST, COPIED));
    }
    send(third, &mut produced);
    let hwms = run.hwms(produced);
    run.wait_applied(&mut conn, &hwms, Duration::from_secs(120), || {
        a.assert_running()
    });
    run.assert_exact(&mut conn, &truth);
    let status = a.sigterm_and_wait(Duration::from_secs(30));
    assert!(status.success(), "{}", a.log_tail(30));
}
