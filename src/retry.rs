//! Retry: capped exponential backoff and the one place errors are classified.
//!
//! Invariant: only errors that leave the outcome unknown-but-safe are retried.
//! Every Redis write tally makes is fenced, so repeating it after a timeout,
//! a reset connection or a failover can never count anything twice.

use std::time::Duration;

use redis::{ErrorKind, RedisError};

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

/// Classifies a Redis error.
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
            | "ASK",
        ) => RedisFailure::Transient,
        Some(_) => RedisFailure::Fatal,
        None => match error.kind() {
            ErrorKind::Parse | ErrorKind::ClusterConnectionNotFound => RedisFailure::Transient,
            _ => RedisFailure::Fatal,
        },
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

    #[test]
    fn io_errors_are_transient_and_wrongtype_is_fatal() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(classify_redis(&io), RedisFailure::Transient);
    }
}
