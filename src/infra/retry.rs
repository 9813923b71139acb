//! Retry: capped exponential backoff and the one place errors are classified.
//!
//! Invariant: only errors that leave the outcome unknown-but-safe are retried.
//! Every Redis write tally makes is fenced, so repeating it after a timeout,
//! a reset connection or a failover can never count anything twice.

use std::time::Duration;

use std::future::Future;

use redis::{ErrorKind, RedisError};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Capped exponential backoff with jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `first`, doubles up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Self { next: first, max }
    }

    /// The default for talking to Redis and Kafka: 50 ms up to 5 s.
    pub fn standard() -> Self {
        Self::new(Duration::from_millis(50), Duration::from_secs(5))
    }

    /// The delay before the next attempt (with up to 25% jitter).
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        let jitter = base.mul_f64(rand::random::<f64>() * 0.25);
        base + jitter
    }

    /// Starts over after a success.
    pub fn reset(&mut self, first: Duration) {
        self.next = first;
    }
}

/// Whether a Redis error is worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisFailure {
    /// Connection trouble, timeouts, loading, failover, cluster reconfiguration.
    Transient,
    /// The script is not loaded on this server (restart, failover, SCRIPT FLUSH).
    NoScript,
    /// Data or configuration an operator must fix (WRONGTYPE, bad script, ACL).
    Fatal,
}

/// Classifies a Redis error. `OOM` (a server at `maxmemory` under
/// `noeviction`) and `MISCONF` (a server that cannot persist) refuse a
/// call's first write, and so the whole call: transient, as nothing was
/// written and the call passes once the server is put right.
pub fn classify_redis(error: &RedisError) -> RedisFailure {
    if error.kind() == ErrorKind::Server(redis::ServerErrorKind::NoScript) {
        return RedisFailure::NoScript;
    }
    if error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
    {
        return RedisFailure::Transient;
    }
    match error.code() {
        Some(
            "LOADING" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "READONLY" | "BUSY" | "MOVED"
            | "ASK" | "OOM" | "MISCONF",
        ) => RedisFailure::Transient,
        Some(_) => RedisFailure::Fatal,
        None => match error.kind() {
            ErrorKind::Parse | ErrorKind::ClusterConnectionNotFound => RedisFailure::Transient,
            _ => RedisFailure::Fatal,
        },
    }
}

/// Why [`retry_redis`] gave up.
#[derive(Debug)]
pub enum GaveUp {
    /// An error no retry fixes.
    Fatal(RedisError),
    /// Cancelled while waiting to retry.
    Cancelled,
}

/// Runs `attempt` until it succeeds, fails fatally, or `cancel` fires while
/// waiting out the backoff after a transient error. `what` names the
/// operation in the warning each retry logs.
pub async fn retry_redis<T, F, Fut>(
    what: &str,
    cancel: &CancellationToken,
    mut attempt: F,
) -> Result<T, GaveUp>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, RedisError>>,
{
    let mut backoff = Backoff::standard();
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) if classify_redis(&error) == RedisFailure::Fatal => {
                return Err(GaveUp::Fatal(error));
            }
            Err(error) => {
                crate::infra::metrics::redis_retry();
                let delay = backoff.next_delay();
                let retry_in_ms = delay.as_millis() as u64;
                match error.code() {
                    Some("OOM") => warn!(
                        operation = what,
                        %error,
                        retry_in_ms,
                        "Redis is at maxmemory and refuses writes (noeviction): nothing of this call was written, and it is retried until Redis has room; raise maxmemory or free memory on the server."
                    ),
                    _ => {
                        warn!(operation = what, %error, retry_in_ms, "Redis call failed; retrying.")
                    }
                }
                tokio::select! {
                    _ = cancel.cancelled() => return Err(GaveUp::Cancelled),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let delays: Vec<_> = (0..4).map(|_| backoff.next_delay()).collect();
        let floors = [100, 200, 350, 350];
        for (delay, floor) in delays.iter().zip(floors) {
            assert!(delay.as_millis() >= floor && delay.as_millis() <= floor * 5 / 4 + 1);
        }
    }

    fn server_error(line: &str) -> RedisError {
        let value = redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap();
        value.extract_error().unwrap_err()
    }

    #[test]
    fn io_errors_are_transient_and_wrongtype_is_fatal() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(classify_redis(&io), RedisFailure::Transient);
        for line in [
            "LOADING Redis is loading",
            "TRYAGAIN x",
            "CLUSTERDOWN down",
            "READONLY replica",
            "MOVED 5 h:1",
            "OOM command not allowed when used memory > 'maxmemory'.",
        ] {
            assert_eq!(
                classify_redis(&server_error(line)),
                RedisFailure::Transient,
                "{line}"
            );
        }
        assert_eq!(
            classify_redis(&server_error("NOSCRIPT No matching script")),
            RedisFailure::NoScript
        );
        for line in [
            "WRONGTYPE Operation against a key",
            "ERR value is not an integer",
            "NOPERM no",
        ] {
            assert_eq!(
                classify_redis(&server_error(line)),
                RedisFailure::Fatal,
                "{line}"
            );
        }
    }
}
