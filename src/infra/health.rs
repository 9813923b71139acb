//! Health: what `/healthz` and `/readyz` answer for `tally run`.
//!
//! Invariant: `/healthz` is 200 whenever the process serves HTTP at all.
//! `/readyz` is 200 only while all of these hold: the consumer has joined its
//! group and holds an assignment (an empty one counts: a group may have more
//! consumers than partitions), the latest Redis check and the latest broker
//! check both succeeded no longer than [`STALE_AFTER`] ago, no dead-letter
//! copy has been failing for longer than [`DEAD_LETTER_BOUND`], and shutdown
//! has not begun. The checks run in the background ([`spawn_probes`]); the
//! pipeline reports its assignments ([`assigned`], [`unassigned`]); answering
//! a probe never waits on Redis or Kafka.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::infra::store::{Store, Target};

/// How often the background checks run.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);
/// A check older than this no longer counts as a success.
pub const STALE_AFTER: Duration = Duration::from_secs(20);
/// How long dead-letter copies may keep failing before readiness fails.
pub const DEAD_LETTER_BOUND: Duration = Duration::from_secs(60);
/// How long one check may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(4);

/// The latest outcome of one check.
struct Check {
    name: &'static str,
    state: Mutex<(Option<Instant>, Option<String>)>,
}

impl Check {
    const fn new(name: &'static str) -> Check {
        Check {
            name,
            state: Mutex::new((None, None)),
        }
    }

    fn record(&self, result: Result<(), String>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let was_failing = state.1.is_some();
        match result {
            Ok(()) => {
                if was_failing {
                    info!(check = self.name, "Readiness check passes again.");
                }
                *state = (Some(Instant::now()), None);
            }
            Err(error) => {
                if !was_failing {
                    warn!(check = self.name, %error, "Readiness check failed.");
                }
                state.1 = Some(error);
            }
        }
    }

    /// `Ok` with a description, or `Err` with why it does not count.
    fn status(&self) -> Result<String, String> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match &*state {
            (_, Some(error)) => Err(error.clone()),
            (None, None) => Err("not checked yet".into()),
            (Some(at), None) if at.elapsed() > STALE_AFTER => Err(format!(
                "last success {:.0} s ago",
                at.elapsed().as_secs_f64()
            )),
            (Some(at), None) => Ok(format!("ok {:.1} s ago", at.elapsed().as_secs_f64())),
        }
    }
}

/// Readiness of this process; one per process, like the metrics recorder.
struct Readiness {
    /// Partitions assigned, or -1 before the first assignment.
    partitions: AtomicI64,
    stopping: AtomicBool,
    redis: Check,
    broker: Check,
    /// Since when dead-letter copies fail, with the latest error and topic.
    dead_letters: Mutex<Option<(Instant, String)>>,
}

static STATE: Readiness = Readiness {
    partitions: AtomicI64::new(-1),
    stopping: AtomicBool::new(false),
    redis: Check::new("redis"),
    broker: Check::new("broker"),
    dead_letters: Mutex::new(None),
};

/// Records a dead-letter copy to `topic`: a success clears the failure.
pub fn dead_letters(topic: &str, outcome: Result<(), String>) {
    let mut failing = STATE.dead_letters.lock().unwrap_or_else(|e| e.into_inner());
    match outcome {
        Ok(()) => *failing = None,
        Err(error) => {
            let since = failing.as_ref().map_or_else(Instant::now, |(at, _)| *at);
            *failing = Some((since, format!("copies to {topic} fail: {error}")));
        }
    }
}

/// The consumer holds `partitions` partitions after a rebalance (zero is a
/// valid assignment).
pub fn assigned(partitions: usize) {
    STATE.partitions.store(partitions as i64, Ordering::Relaxed);
}

/// The consumer lost its assignment (an error, not a rebalance); not ready
/// until the next one.
pub fn unassigned() {
    STATE.partitions.store(-1, Ordering::Relaxed);
}

/// Records a Redis check (a PING).
fn redis_checked(result: Result<(), String>) {
    STATE.redis.record(result);
}

/// Records a broker check (a metadata request).
fn broker_checked(result: Result<(), String>) {
    STATE.broker.record(result);
}

/// Shutdown has begun: no longer ready.
pub fn stopping() {
    STATE.stopping.store(true, Ordering::Relaxed);
}

/// Readiness now, and a line per condition saying why.
pub fn report() -> (bool, String) {
    let mut ready = true;
    let mut text = String::new();
    let mut line = |name: &str, status: Result<String, String>| {
        let (mark, detail) = match status {
            Ok(detail) => ("ok", detail),
            Err(detail) => {
                ready = false;
                ("FAIL", detail)
            }
        };
        let _ = writeln!(text, "{mark} {name}: {detail}");
    };
    line(
        "partitions",
        match STATE.partitions.load(Ordering::Relaxed) {
            n if n < 0 => Err("no assignment from the consumer group yet".into()),
            0 => Ok("none assigned (none to own)".into()),
            n => Ok(format!("{n} assigned")),
        },
    );
    line("redis", STATE.redis.status());
    line("broker", STATE.broker.status());
    let failing = STATE
        .dead_letters
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if let Some((since, error)) = failing {
        let secs = since.elapsed().as_secs();
        let status = format!("{error} (for {secs} s)");
        line(
            "dead letters",
            if since.elapsed() > DEAD_LETTER_BOUND {
                Err(status)
            } else {
                Ok(status)
            },
        );
    }
    if STATE.stopping.load(Ordering::Relaxed) {
        line("shutdown", Err("stopping".into()));
    }
    (ready, text)
}

/// Checks the store at `target` and the `topic` through a client built
/// from `kafka` every [`PROBE_EVERY`] until `shutdown`, when readiness ends.
pub fn spawn_probes(
    target: Target,
    kafka: ClientConfig,
    topic: String,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let broker: Result<Arc<BaseConsumer>, String> = kafka
        .create()
        .map(Arc::new)
        .map_err(|e| format!("cannot create a Kafka client: {e}"));
    crate::infra::tasks::spawn("health-probes", async move {
        let mut store: Option<Store> = None;
        let mut every = tokio::time::interval(PROBE_EVERY);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => {
                    stopping();
                    return;
                }
                _ = every.tick() => {}
            }
            redis_checked(ping(&target, &mut store).await);
            let kafka = match &broker {
                Ok(consumer) => topic_ready(consumer.clone(), topic.clone()).await,
                Err(problem) => Err(problem.clone()),
            };
            broker_checked(kafka);
            crate::infra::metrics::ready(report().0);
        }
    })
}

/// PINGs Redis, connecting first when there is no connection.
async fn ping(target: &Target, store: &mut Option<Store>) -> Result<(), String> {
    let attempt = async {
        if store.is_none() {
            *store = Some(Store::connect(target).await.map_err(|e| e.to_string())?);
        }
        let connection = store.as_mut().expect("connected above");
        redis::cmd("PING")
            .query_async::<String>(connection)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    };
    let result = match tokio::time::timeout(CHECK_TIMEOUT, attempt).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
    };
    if result.is_err() {
        *store = None;
    }
    result
}

/// Asks the brokers for the topic's metadata.
async fn topic_ready(consumer: Arc<BaseConsumer>, topic: String) -> Result<(), String> {
    tokio::task::spawn_blocking(move || {
        let metadata = consumer
            .fetch_metadata(Some(&topic), CHECK_TIMEOUT)
            .map_err(|e| e.to_string())?;
        match metadata.topics().iter().find(|t| t.name() == topic) {
            Some(t) if t.error().is_none() && !t.partitions().is_empty() => Ok(()),
            _ => Err(format!("topic '{topic}' not found")),
        }
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test touches the process-wide state, so nothing races it.
    #[test]
    fn ready_only_when_every_condition_holds() {
        let (ready, text) = report();
        assert!(!ready, "{text}");
        assert!(text.contains("FAIL partitions"), "{text}");
        assigned(0);
        redis_checked(Ok(()));
        broker_checked(Err("broker down".into()));
        let (ready, text) = report();
        assert!(!ready);
        assert!(text.contains("FAIL broker: broker down"), "{text}");
        assert!(text.contains("ok partitions: none assigned"), "{text}");
        broker_checked(Ok(()));
        assert!(report().0, "{}", report().1);
        assigned(3);
        assert!(report().1.contains("ok partitions: 3 assigned"));
        unassigned();
        assert!(!report().0);
        assigned(1);
        stopping();
        assert!(!report().0);
    }
}
