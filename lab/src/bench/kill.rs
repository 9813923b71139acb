//! Exact after SIGKILL, measured: each consumer that keeps counts (the pipelined naive one,
//! `tally run` and the Kafka Streams peer) reads the topic on a new consumer group and key
//! prefix (for Kafka Streams, a new application id and output topic), is killed with SIGKILL
//! once its group's committed offsets cover half of the topic, and is started again on the same
//! group, prefix and state. Once it has caught up, every post of the truth is read back (tally
//! and the naive consumer with `tally::read::Reader`, Kafka Streams from its output topic to the
//! end) and compared with the truth.
//!
//! Each killed consumer has a `session.timeout.ms` of [`SESSION_TIMEOUT_MS`], so its restart
//! waits that long for the group to expire the dead member, rather than the 45 s default.
//!
//! Here are the test's steps ([`sigkill`], [`marks_of`]), its runs of `tally run` and of the
//! naive consumer, and the table of all three; the Kafka Streams peer's run is in streams.rs,
//! with the rest of the peer.

use std::fmt::{self, Write as _};
use std::fs::File;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustc_hash::FxHashMap;

use super::group_watch::GroupWatch;
use super::services::{RedisSnapshot, redis_conn, terminate, watermarks};
use super::{Baseline, Env};
use crate::local::free_port;
use crate::markdown::thousands;
use tally::read::Reader;

/// `session.timeout.ms` of every consumer the test kills: above tally's 10 s shutdown timeout,
/// which tally requires.
pub(super) const SESSION_TIMEOUT_MS: u64 = 12_000;

/// Which consumer a SIGKILL test ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Victim {
    NaivePipelined,
    Tally,
    Streams,
}

/// How the counts of every post compare with the truth.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Exactness {
    /// Posts compared.
    pub posts: usize,
    /// Posts whose count differs.
    pub wrong: usize,
    /// How far the counts above the truth are above it, summed. A like counted twice adds one to
    /// its post's count and an unlike counted twice takes one away, so on one post they cancel.
    pub over: i64,
    /// How far the counts below the truth are below it, summed.
    pub under: i64,
}

impl Exactness {
    /// Every post of `truth` against `got`.
    pub fn compare(truth: &FxHashMap<u64, i64>, got: impl Fn(u64) -> i64) -> Self {
        let mut exact = Exactness::default();
        for (&post, &want) in truth {
            exact.add(got(post), want);
        }
        exact
    }

    /// One more post, counted `got` where the truth is `want`.
    pub fn add(&mut self, got: i64, want: i64) {
        self.posts += 1;
        if got != want {
            self.wrong += 1;
            if got > want {
                self.over += got - want;
            } else {
                self.under += want - got;
            }
        }
    }

    /// As the table's counts column takes it: (checked, wrong).
    pub fn checked(&self) -> (usize, usize) {
        (self.posts, self.wrong)
    }

    /// "exact (N posts)" or "N of M posts wrong (+X / −Y in their counts)".
    pub fn describe(&self) -> String {
        let posts = thousands(self.posts as u64);
        if self.wrong == 0 {
            format!("exact ({posts} posts)")
        } else {
            format!(
                "**{} of {posts} posts wrong (+{} / −{} in their counts)**",
                thousands(self.wrong as u64),
                thousands(self.over as u64),
                thousands(self.under as u64)
            )
        }
    }
}

/// What one SIGKILL test found.
#[derive(Debug, Clone, Copy)]
pub(super) struct Killed {
    pub victim: Victim,
    /// Events in the topic it read.
    pub total: u64,
    /// Events its group had committed when it was killed.
    pub at: u64,
    /// Events it had written to Redis by then, where its writes tell (one `INCR` or `DECR` each).
    pub written: Option<u64>,
    /// Events its group had committed when it was started again.
    pub resumed: u64,
    /// From its restart to caught up (or, for the naive consumer, to its exit at the end).
    pub restart_secs: f64,
    /// Every post, once caught up after the restart.
    pub exact: Exactness,
}

/// A child killed if it is dropped still running (on an error path).
struct Spawned(Child);

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Kills `child` with SIGKILL and reaps it; returns the events `watch`'s group has committed
/// half a second later, when any offset commit it had already sent has landed.
pub(super) fn sigkill(child: &mut Child, watch: &GroupWatch, marks: &[(i64, i64)]) -> Result<u64> {
    child.kill().context("killing the consumer")?;
    child.wait()?;
    std::thread::sleep(Duration::from_millis(500));
    watch.progress(marks)
}

/// The topic's `[low, high)` marks and the events they hold.
pub(super) fn marks_of(env: &Env, topic: &str, partitions: u32) -> Result<(Vec<(i64, i64)>, u64)> {
    let marks = watermarks(&env.brokers, topic, partitions)?;
    let total = marks.iter().map(|&(low, high)| (high - low) as u64).sum();
    Ok((marks, total))
}

/// `tally run` with the benchmark's arguments, killed half-way and started again on the
/// same group and prefix.
pub(super) fn tally(
    env: &Env,
    topic: &str,
    name: &str,
    partitions: u32,
    truth: &FxHashMap<u64, i64>,
) -> Result<Killed> {
    let mut conn = redis_conn(&env.redis)?;
    redis::cmd("FLUSHALL").arg("SYNC").query::<()>(&mut conn)?;
    let id = format!("{name}-tally-kill");
    let log = env.dir.join(format!("{id}.log"));
    let (marks, total) = marks_of(env, topic, partitions)?;
    let watch = GroupWatch::new(&env.brokers, &id, vec![(topic.to_string(), partitions)])?;
    let see = || format!("see {}", log.display());
    let mut first = Spawned(start_tally(env, topic, &id, &log)?);
    let at = watch
        .until_half(&marks, &mut first.0, "tally run")
        .with_context(see)?;
    let resumed = sigkill(&mut first.0, &watch, &marks)?;
    let restarted = Instant::now();
    let mut second = Spawned(start_tally(env, topic, &id, &log)?);
    watch
        .until_caught_up(&marks, &mut second.0, "tally run", &[])
        .with_context(see)?;
    let restart_secs = restarted.elapsed().as_secs_f64();
    let exact = redis_exactness(&env.redis, &id, truth)?;
    terminate(&mut second.0);
    Ok(Killed {
        victim: Victim::Tally,
        total,
        at,
        written: None,
        resumed,
        restart_secs,
        exact,
    })
}

/// Starts `tally run` on `topic` with group and prefix `id`, appending its log to `log`.
fn start_tally(env: &Env, topic: &str, id: &str, log: &Path) -> Result<Child> {
    let log = File::options().create(true).append(true).open(log)?;
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let mut command = env.tally.command();
    command
        .arg("run")
        .args(["--brokers", &env.brokers, "--topic", topic, "--group", id])
        .args(["--redis", &env.redis, "--prefix", id])
        .args(["--metrics-addr", &metrics])
        .args(&env.kafka_args);
    // Under --group-protocol consumer the broker sets the session timeout, and tally refuses it.
    if !env.tally_args.iter().any(|a| a.contains("group-protocol")) {
        command.args(["-X", &format!("session.timeout.ms={SESSION_TIMEOUT_MS}")]);
    }
    command
        .args(&env.tally_args)
        .env("TALLY_LOG", "info,rdkafka=warn")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting tally run")
}

/// The pipelined naive consumer, killed half-way and started again on the same group and
/// prefix, for the events its group had not committed.
pub(super) fn naive(
    env: &Env,
    topic: &str,
    name: &str,
    partitions: u32,
    truth: &FxHashMap<u64, i64>,
) -> Result<Killed> {
    let mut conn = redis_conn(&env.redis)?;
    redis::cmd("FLUSHALL").arg("SYNC").query::<()>(&mut conn)?;
    let id = format!("{name}-naive-kill");
    let (marks, total) = marks_of(env, topic, partitions)?;
    let watch = GroupWatch::new(&env.brokers, &id, vec![(topic.to_string(), partitions)])?;
    let what = "the pipelined naive consumer";
    let log = env.dir.join(format!("{id}.log"));
    let before = RedisSnapshot::take(&mut conn)?;
    let mut first = Spawned(start_naive(env, topic, &id, total, &log)?);
    let at = watch.until_half(&marks, &mut first.0, what)?;
    let resumed = sigkill(&mut first.0, &watch, &marks)?;
    let written = RedisSnapshot::take(&mut conn)?
        .delta(&before)
        .iter()
        .filter(|(command, _)| command == "incr" || command == "decr")
        .map(|(_, n)| n)
        .sum();
    let restarted = Instant::now();
    let mut second = Spawned(start_naive(env, topic, &id, total - resumed, &log)?);
    let deadline = Duration::from_secs(1800);
    loop {
        if let Some(status) = second.0.try_wait()? {
            if !status.success() {
                bail!(
                    "{what} exited ({status}) after its restart; see {}",
                    log.display()
                );
            }
            break;
        }
        if restarted.elapsed() > deadline {
            bail!(
                "{what} did not finish within {} s of its restart",
                deadline.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let restart_secs = restarted.elapsed().as_secs_f64();
    Ok(Killed {
        victim: Victim::NaivePipelined,
        total,
        at,
        written: Some(written),
        resumed,
        restart_secs,
        exact: redis_exactness(&env.redis, &id, truth)?,
    })
}

/// Starts the pipelined naive consumer on `topic` with group and prefix `id`, to stop after
/// `events` messages, appending its log to `log`.
fn start_naive(env: &Env, topic: &str, id: &str, events: u64, log: &Path) -> Result<Child> {
    let log = File::options().create(true).append(true).open(log)?;
    crate::binaries::lab_command()?
        .arg("bench-baseline")
        .args(["--baseline", Baseline::NaivePipelined.name()])
        .args(["--brokers", &env.brokers, "--topic", topic, "--group", id])
        .args(["--redis", &env.redis, "--prefix", id])
        .args(["--events", &events.to_string()])
        .args(["--naive-max-secs", "86400"])
        .args(&env.kafka_args)
        .args(["-X", &format!("session.timeout.ms={SESSION_TIMEOUT_MS}")])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting the pipelined naive consumer")
}

/// The SIGKILL tests of one workload as a table, after a paragraph saying how they ran.
pub(super) fn table(out: &mut String, tally_args: &[String], killed: &[Killed]) -> fmt::Result {
    let Some(first) = killed.first() else {
        return Ok(());
    };
    writeln!(
        out,
        "\nExact after SIGKILL: each consumer read the topic as it stood after tally's latency phase \
         ({} events) on a new consumer group and key prefix (Kafka Streams: a new application id, output \
         topic and state directory), was killed with SIGKILL once its group had committed half of it, and \
         was started again on the same ones, with `session.timeout.ms` at {} s so that the group lets go \
         of the dead member sooner than the default 45 s. Once it had caught up, every post's count was \
         compared with the truth. \"Written when killed\" is the naive consumer's `INCR` and `DECR` calls by \
         then (`INFO commandstats`); \"committed at the restart\" is read half a second after the kill, once \
         the offset commits already sent have landed: a consumer without a fence counts again what it had \
         written beyond that. A wrong post's count is off by the likes counted twice less the unlikes counted \
         twice; the last column sums how far the counts above the truth and those below it are off.\n",
        thousands(first.total),
        SESSION_TIMEOUT_MS / 1000
    )?;
    writeln!(
        out,
        "| consumer | committed when killed | written when killed | committed at the restart | restart to caught up | every post after the restart |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---|")?;
    for k in killed {
        let label = match k.victim {
            Victim::NaivePipelined => "naive, pipelined per poll batch".to_string(),
            Victim::Tally if tally_args.is_empty() => "tally run (defaults)".to_string(),
            Victim::Tally => format!("tally run ({})", tally_args.join(" ")),
            Victim::Streams => "Kafka Streams, exactly_once_v2".to_string(),
        };
        let to = match k.victim {
            Victim::NaivePipelined => " (to its exit at the end)",
            _ => "",
        };
        let written = k.written.map_or_else(|| "–".into(), thousands);
        writeln!(
            out,
            "| {label} | {} of {} ({:.0}%) | {written} | {} | {:.1} s{to} | {} |",
            thousands(k.at),
            thousands(k.total),
            k.at as f64 * 100.0 / k.total.max(1) as f64,
            thousands(k.resumed),
            k.restart_secs,
            k.exact.describe()
        )?;
    }
    Ok(())
}

/// Every post of `truth` read back under `prefix` the way users read counts, against it.
fn redis_exactness(url: &str, prefix: &str, truth: &FxHashMap<u64, i64>) -> Result<Exactness> {
    let mut posts: Vec<(u64, i64)> = truth.iter().map(|(&p, &c)| (p, c)).collect();
    posts.sort_unstable();
    let ids: Vec<u64> = posts.iter().map(|&(post, _)| post).collect();
    let counts = tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current().block_on(async {
            let settings = crate::local::store(url, prefix)?;
            let (opened, record) = tally::domain::layout::open_for_reading(&settings).await?;
            let reader = Reader::new(opened.store, opened.keys, record.buckets, Duration::ZERO);
            let mut counts = Vec::with_capacity(ids.len());
            for chunk in ids.chunks(2000) {
                counts.extend(reader.counts(chunk).await?.into_iter().map(|c| c.likes));
            }
            anyhow::Ok(counts)
        })
    })?;
    let mut exact = Exactness::default();
    for (&(post, want), &got) in posts.iter().zip(&counts) {
        if got != want && exact.wrong < 3 {
            tracing::warn!(post, want, got, prefix, "Count differs from the truth.");
        }
        exact.add(got, want);
    }
    Ok(exact)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactness_sums_what_is_over_and_under() {
        let truth: FxHashMap<u64, i64> = [(1, 5), (2, 3), (3, -1), (4, 0)].into_iter().collect();
        let got: FxHashMap<u64, i64> = [(1, 5), (2, 4), (3, -2)].into_iter().collect();
        let exact = Exactness::compare(&truth, |p| got.get(&p).copied().unwrap_or(0));
        assert_eq!(
            exact,
            Exactness {
                posts: 4,
                wrong: 2,
                over: 1,
                under: 1
            }
        );
        assert_eq!(
            exact.describe(),
            "**2 of 4 posts wrong (+1 / −1 in their counts)**"
        );
        let right = Exactness::compare(&truth, |p| truth[&p]);
        assert_eq!(right.describe(), "exact (4 posts)");
        assert_eq!(right.checked(), (4, 0));
    }
}
