//! One end-to-end run's names and plumbing: a seed, fresh topic, group and key
//! prefix on the test process's broker, producer threads that keep events arriving
//! while faults are injected, and the final wait-and-compare against the
//! workload's own ground truth.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// The names and broker of one test run.
pub struct Scenario {
    pub seed: u64,
    pub brokers: String,
    pub topic: String,
    pub group: String,
    pub prefix: String,
}

/// A failing test shows the end of the broker's log, when the broker is this process's own.
impl Drop for Scenario {
    fn drop(&mut self) {
        if thread::panicking()
            && let Some(tail) = process_broker_log_tail(&self.brokers, 20)
        {
            eprintln!("[harness] broker {} log tail:\n{tail}", self.brokers);
        }
    }
}

impl Scenario {
    /// Seed for `test`, fresh `likes-<short>` topic with `partitions`, `tally-<short>` group and
    /// `<short>` key prefix.
    pub fn new(test: &str, short: &str, partitions: i32) -> Scenario {
        Self::on(&brokers(), test, short, partitions)
    }

    /// `new`, on the given brokers.
    pub fn on(brokers: &str, test: &str, short: &str, partitions: i32) -> Scenario {
        Self::with_topic(brokers, test, short, partitions, &[])
    }

    /// `on`, with topic settings (`max.message.bytes`, `retention.ms`, ...).
    pub fn with_topic(
        brokers: &str,
        test: &str,
        short: &str,
        partitions: i32,
        configs: &[(&str, &str)],
    ) -> Scenario {
        let seed = seed(test);
        let brokers = brokers.to_string();
        let topic = unique(&format!("likes-{short}"));
        create_topic_with(&brokers, &topic, partitions, configs);
        Scenario {
            seed,
            brokers,
            topic,
            group: unique(&format!("tally-{short}")),
            prefix: unique(short),
        }
    }

    /// The same seed, topic, group and prefix on another broker.
    pub fn moved_to(&self, brokers: &str) -> Scenario {
        Scenario {
            seed: self.seed,
            brokers: brokers.to_string(),
            topic: self.topic.clone(),
            group: self.group.clone(),
            prefix: self.prefix.clone(),
        }
    }

    /// The usual `tally run` arguments for this run against `redis_url`.
    pub fn tally_args(&self, redis_url: &str) -> Vec<String> {
        tally_args(
            &self.brokers,
            &self.topic,
            &self.group,
            redis_url,
            &self.prefix,
        )
    }

    /// The end offsets of the topic, checked to add up to `messages`.
    pub fn hwms(&self, messages: usize) -> Vec<i64> {
        let hwms = high_watermarks(&self.brokers, &self.topic);
        assert_eq!(hwms.iter().sum::<i64>(), messages as i64, "hwms {hwms:?}");
        hwms
    }

    /// `events` likes generated from `seed` over `partitions` partitions, produced to the
    /// topic whole.
    pub fn produce_workload(&self, seed: u64, events: usize, partitions: i32) -> Workload {
        let workload = Workload::generate(seed, events, partitions);
        produce(
            &self.brokers,
            &self.topic,
            workload.messages(0..workload.events.len()),
        );
        workload
    }

    /// `tally run` with `args`, once it has applied every partition up to `hwms` (within a
    /// minute, the process checked to be running at every poll).
    pub fn spawn_applied(
        &self,
        conn: &mut redis::Connection,
        args: &[String],
        hwms: &[i64],
    ) -> Tally {
        let mut tally = Tally::spawn_args("tally", args);
        self.wait_applied(conn, hwms, Duration::from_secs(60), || {
            tally.assert_running()
        });
        tally
    }

    /// Waits until every partition's fence holds its last offset, calling `check` on each poll.
    pub fn wait_applied(
        &self,
        conn: &mut redis::Connection,
        hwms: &[i64],
        timeout: Duration,
        mut check: impl FnMut(),
    ) {
        wait_applied_while(
            conn,
            &self.prefix,
            &self.group,
            &self.topic,
            hwms,
            timeout,
            &mut check,
        )
    }

    /// Every post's count in Redis equals `truth`.
    pub fn assert_exact(
        &self,
        conn: &mut redis::Connection,
        truth: &std::collections::HashMap<u64, i64>,
    ) {
        assert_counts_eq(&read_counts(conn, &self.prefix), truth);
    }

    /// Offsets applied under `prefix` (a rebuild's generation, say) over `partitions`
    /// partitions of this scenario's topic and group.
    pub fn applied_under(
        &self,
        conn: &mut redis::Connection,
        prefix: &str,
        partitions: usize,
    ) -> i64 {
        applied_offsets(conn, prefix, &self.group, &self.topic, partitions)
            .iter()
            .sum()
    }

    /// Starts producing `chunk` more events of `workload` every `pause` until stopped.
    pub fn stream(&self, workload: Workload, chunk: usize, pause: Duration) -> Stream {
        let grow = move |w: &mut Workload| {
            let range = w.grow(chunk);
            w.messages(range)
        };
        Stream::start(&self.brokers, &self.topic, workload, grow, pause)
    }

    /// Starts producing `per_round` likes of `post` every `pause` until stopped (see `HotLikes`).
    pub fn hot_likes(
        &self,
        post: u64,
        per_round: usize,
        partitions: i32,
        pause: Duration,
        seed: u64,
    ) -> HotLikes {
        HotLikes::start(
            &self.brokers,
            &self.topic,
            post,
            per_round,
            partitions,
            pause,
            seed,
        )
    }
}

/// A producer thread that keeps a source of records growing; `stop` returns the source with
/// everything it produced.
pub struct Producing<T> {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<T>,
}

/// A producer thread that keeps a workload growing.
pub type Stream = Producing<Workload>;

impl<T: Send + 'static> Producing<T> {
    /// Produces what `next` takes from `source`, sleeps `pause`, and repeats; once stopped it
    /// produces one last time, so records still arrive after whatever fault came last.
    pub fn start(
        brokers: &str,
        topic: &str,
        mut source: T,
        mut next: impl FnMut(&mut T) -> Vec<Msg> + Send + 'static,
        pause: Duration,
    ) -> Producing<T> {
        let stop = Arc::new(AtomicBool::new(false));
        let (brokers, topic, flag) = (brokers.to_string(), topic.to_string(), stop.clone());
        let handle = thread::spawn(move || {
            let mut last = false;
            while !last {
                last = flag.load(Ordering::SeqCst);
                produce(&brokers, &topic, next(&mut source));
                thread::sleep(pause);
            }
            source
        });
        Producing { stop, handle }
    }

    /// Stops producing and returns the source with everything produced.
    pub fn stop(self) -> T {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.join().expect("producer thread")
    }
}

/// A producer thread of likes of one post only, which makes it hot: each round, `per_round`
/// likes by random users (from `seed`), message `i` to partition `i % partitions`, then a pause.
/// Its count only grows, so a reader may check it never goes down.
pub struct HotLikes {
    stop: Arc<AtomicBool>,
    likes: Arc<AtomicU64>,
    handle: JoinHandle<()>,
}

impl HotLikes {
    pub fn start(
        brokers: &str,
        topic: &str,
        post: u64,
        per_round: usize,
        partitions: i32,
        pause: Duration,
        seed: u64,
    ) -> HotLikes {
        let stop = Arc::new(AtomicBool::new(false));
        let likes = Arc::new(AtomicU64::new(0));
        let (brokers, topic, flag, produced) = (
            brokers.to_string(),
            topic.to_string(),
            stop.clone(),
            likes.clone(),
        );
        let mut rng = StdRng::seed_from_u64(seed);
        let handle = thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                let messages: Vec<Msg> = (0..per_round)
                    .map(|i| {
                        let user: u64 = rng.random();
                        let value = encode_like(post, user, LIKE, now_ms());
                        (None, value, (i as i32) % partitions)
                    })
                    .collect();
                produce(&brokers, &topic, messages);
                produced.fetch_add(per_round as u64, Ordering::SeqCst);
                thread::sleep(pause);
            }
        });
        HotLikes {
            stop,
            likes,
            handle,
        }
    }

    /// The flag `stop` raises, for other threads (e.g. a reader) to end with the producer.
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// Stops producing (raising the stop flag) and returns how many likes were produced.
    pub fn stop(self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.handle.join().expect("hot-post producer thread");
        self.likes.load(Ordering::SeqCst)
    }
}
