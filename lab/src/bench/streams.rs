//! Kafka Streams under test: the peer in `scripts/streams-peer` (`tally.peer.LikeCounts`, a
//! Kafka Streams application with `processing.guarantee=exactly_once_v2` that sums each post's
//! likes minus unlikes in a RocksDB store and writes every updated count to an output topic),
//! run as a child JVM on the same broker, topic and machine as tally, with Kafka's defaults.
//!
//! Its progress is read from the broker alone ([`super::group_watch`]). Kafka Streams commits the
//! offsets of its consumer group (the application id) in the transactions that carry its writes:
//! the input offsets with the records sent to the repartition topic `ID-deltas-repartition`, the
//! repartition offsets with the counts. It has caught up when the group's committed offsets are
//! at the end, read `read_committed`, of both topics, seen twice a commit interval apart; the
//! counts of the last events are then committed. A count is visible when a `read_committed` consumer of the output
//! topic sees it, and a post's count is its last record there.
//!
//! On each workload it runs twice. The backlog pass reads the backlog alone on a new
//! application id, timed from the first committed input offsets to caught up (the JVM's start,
//! the group join and the task set-up before them are not counted, as tally's group join is
//! not); then every post's count in the output topic is compared with the truth. After tally's
//! latency phase, the SIGKILL test ([`killed_and_restarted`], with the steps of [`super::kill`])
//! reads the topic on another new application id, kills the JVM half-way and starts it again;
//! that instance, caught up and checked, then runs the latency phase ([`super::latency`]) at
//! tally's rate, timed from the broker's acknowledgement of each marker like to its count in the
//! output topic (the one partition that holds the marker post, as the Java client's murmur2
//! partitioner places it: [`super::peer_records`]).

use std::fmt::{self, Write as _};
use std::fs::File;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rdkafka::ClientContext;
use rdkafka::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rustc_hash::{FxHashMap, FxHashSet};

use super::group_watch::GroupWatch;
use super::kill::{Exactness, Killed, SESSION_TIMEOUT_MS, Victim, marks_of, sigkill};
use super::latency::{MARKER_POST, OutputWatch, Probe, timed_phase};
use super::peer_records::{long, partition_of};
use super::services::{cpu_secs, create_topic, peak_rss_kib, terminate, watermarks};
use super::{BenchConfig, Env, Measured, Outcome};
use crate::markdown::{ratio, thousands};
use tally_lab::generate::TrafficShape;

/// The built peer: the directory `ensure_streams_peer` fills, whose `lib/` holds its jars.
#[derive(Debug, Clone)]
pub(super) struct Peer {
    home: PathBuf,
}

impl Peer {
    /// The peer built into `home`.
    pub fn new(home: &Path) -> Peer {
        Peer {
            home: home.to_path_buf(),
        }
    }

    /// Why `home` is not a built peer, if it is not.
    pub fn problem(home: &Path) -> Option<String> {
        let jar = home.join("lib").join("streams-peer.jar");
        (!jar.is_file()).then(|| {
            format!(
                "{} not found; build the peer with `source scripts/lib.sh && ensure_streams_peer`",
                jar.display()
            )
        })
    }
}

/// One Kafka Streams application: its id, its topics and its state directory.
pub(super) struct App {
    /// `application.id`: the consumer group, and the prefix of its internal topics.
    pub id: String,
    input: String,
    output: String,
    partitions: u32,
    state: PathBuf,
    log: PathBuf,
    /// The consumer's `session.timeout.ms`, when not Kafka's default.
    session_timeout_ms: Option<u64>,
}

impl App {
    /// A new application `id` reading `input`, with its output topic created.
    pub fn create(
        env: &Env,
        id: &str,
        input: &str,
        partitions: u32,
        session_timeout_ms: Option<u64>,
    ) -> Result<App> {
        let output = format!("{id}-counts");
        create_topic(&env.brokers, &output, partitions)?;
        Ok(App {
            id: id.to_string(),
            input: input.to_string(),
            output,
            partitions,
            state: env.dir.join(format!("{id}-state")),
            log: env.dir.join(format!("{id}.log")),
            session_timeout_ms,
        })
    }

    /// Follows this application's consumer group: the input, then the repartition topic.
    pub fn watch(&self, brokers: &str) -> Result<GroupWatch> {
        let repartition = format!("{}-deltas-repartition", self.id);
        GroupWatch::new(
            brokers,
            &self.id,
            vec![
                (self.input.clone(), self.partitions),
                (repartition, self.partitions),
            ],
        )
    }

    /// Every post's count in the output topic, compared with `truth`.
    pub fn check(&self, brokers: &str, truth: &FxHashMap<u64, i64>) -> Result<Exactness> {
        let counts = read_counts(brokers, &self.output, self.partitions)?;
        let mut exact = Exactness::compare(truth, |post| counts.get(&post).copied().unwrap_or(0));
        for (post, &count) in &counts {
            if !truth.contains_key(post) {
                exact.add(count, 0);
            }
        }
        if exact.wrong > 0 {
            tracing::warn!(app = %self.id, wrong = exact.wrong, "Counts differ from the truth.");
        }
        Ok(exact)
    }
}

/// A running `LikeCounts` JVM; dropped while running (on an error path), it is killed.
pub(super) struct Running {
    pub child: Child,
    /// Its process id, as `/proc` names it.
    pub pid: String,
    /// When it was started.
    pub started: Instant,
    /// When it printed its `RUNNING` line, once it has.
    running: Arc<Mutex<Option<Instant>>>,
}

impl Running {
    /// Starts `app` on the benchmark's broker; its log (stderr) goes to `app.log`.
    pub fn start(peer: &Peer, env: &Env, app: &App) -> Result<Running> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&app.log)
            .with_context(|| format!("creating {}", app.log.display()))?;
        let mut command = Command::new("java");
        command
            .arg("-cp")
            .arg(peer.home.join("lib").join("*"))
            .arg("tally.peer.LikeCounts")
            .args(["--bootstrap", &env.brokers])
            .args(["--input", &app.input, "--output", &app.output])
            .args(["--application-id", &app.id])
            .arg("--state-dir")
            .arg(&app.state);
        if let Some(ms) = app.session_timeout_ms {
            command.args(["--session-timeout-ms", &ms.to_string()]);
        }
        let started = Instant::now();
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .context("starting java for the Kafka Streams peer (it needs a JDK 17 on PATH)")?;
        let stdout = child.stdout.take().context("the peer's stdout")?;
        let running = Arc::new(Mutex::new(None));
        let seen = running.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("RUNNING ") {
                    let mut running = seen.lock().unwrap_or_else(|e| e.into_inner());
                    running.get_or_insert_with(Instant::now);
                }
            }
        });
        let pid = child.id().to_string();
        Ok(Running {
            child,
            pid,
            started,
            running,
        })
    }

    /// From its start to its `RUNNING` line, if it has printed it.
    pub fn until_running(&self) -> Option<Duration> {
        let running = *self.running.lock().unwrap_or_else(|e| e.into_inner());
        running.map(|at| at - self.started)
    }

    /// Stops it as an operator would (SIGTERM: the open transaction commits).
    pub fn stop(mut self) {
        terminate(&mut self.child);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What Kafka Streams did on one workload.
pub(super) struct Figures {
    /// The backlog pass, with the latency phase's figures added.
    pub measured: Measured,
    /// The backlog pass's start.
    pub start: Start,
    /// Every post after the latency phase, on the instance restarted by the SIGKILL test.
    pub after_latency: Exactness,
}

/// The backlog pass: a new application reads the backlog of `topic` (which must hold no more
/// than `truth` counts), timed from its first committed offsets to caught up; every post's
/// count is then compared with the truth.
pub(super) fn measure_backlog(
    peer: &Peer,
    env: &Env,
    topic: &str,
    name: &str,
    partitions: u32,
    truth: &FxHashMap<u64, i64>,
) -> Result<(Measured, Start)> {
    let app = App::create(env, &format!("{name}-streams"), topic, partitions, None)?;
    let marks = watermarks(&env.brokers, topic, partitions)?;
    let total: u64 = marks.iter().map(|&(low, high)| (high - low) as u64).sum();
    let watch = app.watch(&env.brokers)?;
    let mut run = Running::start(peer, env, &app)?;
    let pids = [run.pid.as_str(), env.broker_pid.as_str()];
    let (first, t1) = watch
        .until_caught_up(&marks, &mut run.child, "the Kafka Streams peer", &pids)
        .with_context(|| format!("see {}", app.log.display()))?;
    let (consumer_after, broker_after) = (cpu_secs(&run.pid), cpu_secs(&env.broker_pid));
    let first = first.context("the Kafka Streams peer committed nothing before catching up")?;
    let (t0, a0) = (first.at, first.committed);
    let (consumer_before, broker_before) = (first.cpu[0], first.cpu[1]);
    let events = total - a0;
    let mut measured = Measured {
        events,
        secs: (t1 - t0).as_secs_f64(),
        complete: true,
        rss_kib: peak_rss_kib(&run.pid),
        consumer_cpu: consumer_before
            .zip(consumer_after)
            .map(|(b, a)| (a - b, events)),
        broker_cpu: broker_before.zip(broker_after).map(|(b, a)| a - b),
        ..Measured::default()
    };
    let start = Start {
        running_secs: run.until_running().map(|d| d.as_secs_f64()),
        first_commit_secs: (t0 - run.started).as_secs_f64(),
        cpu_secs: consumer_before.unwrap_or(0.0),
    };
    measured.checked = Some(app.check(&env.brokers, truth)?.checked());
    run.stop();
    Ok((measured, start))
}

/// The backlog pass's start, which its figures leave out.
#[derive(Debug, Clone, Copy)]
pub(super) struct Start {
    /// From the JVM's start to its `RUNNING` line.
    pub running_secs: Option<f64>,
    /// From the JVM's start to its first committed input offsets.
    pub first_commit_secs: f64,
    /// CPU seconds the JVM had used by then.
    pub cpu_secs: f64,
}

/// The Kafka Streams peer on a new application, killed half-way and started again on the same
/// application id and state directory; returns the application and the restarted instance,
/// caught up.
fn killed_and_restarted(
    peer: &Peer,
    env: &Env,
    topic: &str,
    name: &str,
    partitions: u32,
    truth: &FxHashMap<u64, i64>,
) -> Result<(Killed, App, Running)> {
    let id = format!("{name}-streams-kill");
    let app = App::create(env, &id, topic, partitions, Some(SESSION_TIMEOUT_MS))?;
    let (marks, total) = marks_of(env, topic, partitions)?;
    let watch = app.watch(&env.brokers)?;
    let what = "the Kafka Streams peer";
    let mut first = Running::start(peer, env, &app)?;
    let at = watch.until_half(&marks, &mut first.child, what)?;
    let resumed = sigkill(&mut first.child, &watch, &marks)?;
    let restarted = Instant::now();
    let mut second = Running::start(peer, env, &app)?;
    watch.until_caught_up(&marks, &mut second.child, what, &[])?;
    let restart_secs = restarted.elapsed().as_secs_f64();
    let exact = app.check(&env.brokers, truth)?;
    Ok((
        Killed {
            victim: Victim::Streams,
            total,
            at,
            written: None,
            resumed,
            restart_secs,
            exact,
        },
        app,
        second,
    ))
}

/// After tally's latency phase: the SIGKILL test, then the latency phase at `rate` on the
/// instance it restarted, and every post checked once more.
#[allow(clippy::too_many_arguments)]
pub(super) fn killed_then_timed(
    peer: &Peer,
    env: &Env,
    topic: &str,
    name: &str,
    partitions: u32,
    truth: &mut FxHashMap<u64, i64>,
    shape: &TrafficShape,
    (rate, secs): (u64, u64),
    (measured, start): (Measured, Start),
) -> Result<(Figures, Killed)> {
    let (killed, app, run) = killed_and_restarted(peer, env, topic, name, partitions, truth)?;
    let base = truth.get(&MARKER_POST).copied().unwrap_or(0);
    let watch = OutputWatch::new(&env.brokers, &app.output, partitions, base)?;
    eprintln!("{name}: Kafka Streams, latency phase...");
    let latency = timed_phase(env, topic, shape, rate, secs, truth, Probe::Output(watch))?;
    let mut run = run;
    let marks = watermarks(&env.brokers, topic, partitions)?;
    app.watch(&env.brokers)?
        .until_caught_up(&marks, &mut run.child, "the Kafka Streams peer", &[])
        .with_context(|| format!("see {}", app.log.display()))?;
    let after_latency = app.check(&env.brokers, truth)?;
    run.stop();
    let measured = Measured {
        latency: Some(latency),
        ..measured
    };
    Ok((
        Figures {
            measured,
            start,
            after_latency,
        },
        killed,
    ))
}

/// The report's line when `--streams-peer` was not given.
pub(super) const NOT_MEASURED: &str = "Kafka Streams was not measured: its row and SIGKILL test need \
     `--streams-peer DIR` (or `STREAMS_PEER_HOME`), the peer that `source scripts/lib.sh && ensure_streams_peer` \
     builds from scripts/streams-peer with a JDK 17 and Maven; scripts/bench passes it when it can build it.";

/// The label of Kafka Streams' row in a workload's table.
pub(super) const LABEL: &str = "Kafka Streams, exactly_once_v2 (every post checked)";

/// tally against Kafka Streams, and how Kafka Streams' figures were taken.
pub(super) fn report(out: &mut String, config: &BenchConfig, o: &Outcome) -> fmt::Result {
    let Some(figures) = &o.streams else {
        return Ok(());
    };
    let (tally, streams) = (&o.tally, &figures.measured);
    let per_cpu_second = |m: &Measured| m.consumer_cpu_per_million().map(|c| 1e6 / c);
    let both = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => ratio(a, b),
        _ => "–".into(),
    };
    let p99 = |m: &Measured| m.latency.map(|l| l.p99_ms);
    let ms = |v: Option<f64>| v.map_or_else(|| "–".into(), |v| format!("{v:.0} ms"));
    writeln!(
        out,
        "\ntally / Kafka Streams: events/s **{}**, events per consumer CPU-second **{}**, broker CPU per \
         event **{}** less, produce→visible p99 **{}** lower ({} against {}).  ",
        ratio(tally.rate(), streams.rate()),
        both(per_cpu_second(tally), per_cpu_second(streams)),
        both(
            streams.broker_cpu_per_million(),
            tally.broker_cpu_per_million()
        ),
        both(p99(streams), p99(tally)),
        ms(p99(tally)),
        ms(p99(streams)),
    )?;
    let untouched = if config.kafka_config.is_empty() {
        ""
    } else {
        " (the `-X` settings are librdkafka's and do not reach it)"
    };
    let behind = match streams.latency {
        Some(l) if l.target_rate as f64 > streams.rate() => {
            ", a rate above its own on the backlog, so it fell behind during the phase"
        }
        _ => "",
    };
    let latency = streams.latency.map_or_else(String::new, |l| {
        format!(
            "{} marker likes at tally's rate of {} events/s{behind}; ",
            l.samples,
            thousands(l.target_rate)
        )
    });
    let start = &figures.start;
    writeln!(
        out,
        "Kafka Streams {} (scripts/streams-peer: exactly_once_v2, one stream thread, a 100 ms commit interval, \
         Kafka's defaults otherwise{untouched}) ran as a JVM on the same machine. It printed RUNNING {} after \
         its start and first committed input offsets at {:.1} s, having used {:.1} CPU s; its events/s and both \
         CPU columns run from there to no `read_committed` lag of its group on the input and on its repartition \
         topic. Its broker CPU includes the repartition, changelog and output writes and the transactions. Its \
         latency phase ({latency}each like read from the output topic, `read_committed`) ran on the instance \
         restarted by the SIGKILL test below, once that had caught up; every post after it: {}.",
        crate::local::kafka_version(),
        start
            .running_secs
            .map_or_else(|| "?".into(), |s| format!("{s:.1} s")),
        start.first_commit_secs,
        start.cpu_secs,
        figures.after_latency.describe()
    )
}

/// Every post's count in `output`: the last record of each, read `read_committed` to the end.
fn read_counts(brokers: &str, output: &str, partitions: u32) -> Result<FxHashMap<u64, i64>> {
    let consumer: BaseConsumer<EofExpected> =
        tally::infra::config::kafka_client_config(brokers, &[])
            .set("group.id", "tally-bench-output")
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true")
            .set("isolation.level", "read_committed")
            .create_with_context(EofExpected)?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        tpl.add_partition_offset(output, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut counts = FxHashMap::default();
    let mut done = FxHashSet::default();
    let mut misplaced = 0u64;
    let deadline = Instant::now() + Duration::from_secs(600);
    while done.len() < partitions as usize {
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(message)) => {
                let (Some(post), Some(count)) = (
                    message.key().and_then(long),
                    message.payload().and_then(long),
                ) else {
                    bail!(
                        "{output}/{}@{}: not an 8-byte key and value",
                        message.partition(),
                        message.offset()
                    );
                };
                let post = post as u64;
                if partition_of(post, partitions) != message.partition() {
                    misplaced += 1;
                }
                counts.insert(post, count);
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                done.insert(p);
            }
            Some(Err(error)) => return Err(error).context("reading the output topic"),
            None => {}
        }
        if Instant::now() > deadline {
            bail!("{output} was not read to its end within 600 s");
        }
    }
    if misplaced > 0 {
        tracing::warn!(
            misplaced,
            output,
            "Records are not on the partition murmur2 gives their key: the latency probe would miss the marker."
        );
    }
    Ok(counts)
}

/// A consumer context that does not log the end of a partition: [`read_counts`] waits for it.
struct EofExpected;

impl ClientContext for EofExpected {
    fn error(&self, error: KafkaError, reason: &str) {
        let eof = matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        );
        if !eof {
            tracing::error!("librdkafka: {error}: {reason}");
        }
    }
}

impl ConsumerContext for EofExpected {}
