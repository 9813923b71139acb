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
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use super::*;

/// How long [`Scenario::wait_applied`] waits before it makes the group rebalance.
const REJOIN_AFTER: Duration = Duration::from_secs(60);

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
        let seed = seed(test);
        let brokers = brokers.to_string();
        let topic = unique(&format!("likes-{short}"));
        create_topic_on(&brokers, &topic, partitions);
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

    /// Waits until every partition's fence holds its last offset, calling `check` on each poll.
    ///
    /// Partitions still behind after a minute get one rejoin of the group (see
    /// [`Scenario::rejoin`]) before the rest of `timeout` is waited.
    pub fn wait_applied(
        &self,
        conn: &mut redis::Connection,
        hwms: &[i64],
        timeout: Duration,
        mut check: impl FnMut(),
    ) {
        let first = timeout.min(REJOIN_AFTER);
        let wait = |conn: &mut redis::Connection, limit: Duration, check: &mut dyn FnMut()| {
            wait_applied_while(
                conn,
                &self.prefix,
                &self.group,
                &self.topic,
                hwms,
                limit,
                check,
            )
        };
        if timeout <= first {
            return wait(conn, timeout, &mut check);
        }
        let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait(conn, first, &mut check)
        }));
        if waited.is_ok() {
            return;
        }
        self.rejoin();
        wait(conn, timeout - first, &mut check);
    }

    /// Waits for `f` like [`wait_for`]; if the group has not settled within `timeout`, it gets
    /// one rejoin (see [`Scenario::rejoin`]) and `timeout` more.
    pub fn wait_settled<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut f: impl FnMut() -> Option<T>,
    ) -> T {
        if let Some(v) = try_wait_for(timeout, &mut f) {
            return v;
        }
        self.rejoin();
        wait_for(what, timeout, f)
    }

    /// Makes the group rebalance: a consumer of no use joins it and leaves again, without
    /// fetching or committing anything. Tansu 0.6 can leave a partition with no owner after
    /// members of a cooperative group die, and complete no further rebalance until a member
    /// joins (docs/testing.md).
    pub fn rejoin(&self) {
        eprintln!(
            "[harness] partitions still behind: a member joins and leaves group {} so it rebalances",
            self.group
        );
        let member: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("session.timeout.ms", "6000")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .create()
            .expect("create the rejoining member");
        member.subscribe(&[&self.topic]).expect("subscribe");
        let until = std::time::Instant::now() + Duration::from_secs(8);
        while std::time::Instant::now() < until {
            // Fetched messages are dropped: this member never commits, so the group's owners
            // read them again.
            let _ = member.poll(Duration::from_millis(100));
        }
        member.unsubscribe();
    }

    /// Every post's count in Redis equals `truth`.
    pub fn assert_exact(
        &self,
        conn: &mut redis::Connection,
        truth: &std::collections::HashMap<u64, i64>,
    ) {
        assert_counts_eq(&read_counts(conn, &self.prefix), truth);
    }

    /// Starts producing `chunk` more events of `workload` every `pause` until stopped.
    pub fn stream(&self, workload: Workload, chunk: usize, pause: Duration) -> Stream {
        Stream::start(&self.brokers, &self.topic, workload, chunk, pause)
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

/// A producer thread that keeps a workload growing; `stop` returns the workload.
pub struct Stream {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Workload>,
}

impl Stream {
    /// Produces `chunk` events, sleeps `pause`, and repeats; once stopped it produces one last
    /// chunk, so events still arrive after whatever fault came last.
    pub fn start(
        brokers: &str,
        topic: &str,
        mut workload: Workload,
        chunk: usize,
        pause: Duration,
    ) -> Stream {
        let stop = Arc::new(AtomicBool::new(false));
        let (brokers, topic, flag) = (brokers.to_string(), topic.to_string(), stop.clone());
        let handle = thread::spawn(move || {
            let mut last = false;
            while !last {
                last = flag.load(Ordering::SeqCst);
                let range = workload.grow(chunk);
                produce(&brokers, &topic, workload.messages(range));
                thread::sleep(pause);
            }
            workload
        });
        Stream { stop, handle }
    }

    /// Stops producing and returns the workload with everything produced.
    pub fn stop(self) -> Workload {
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
