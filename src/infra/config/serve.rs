//! Serve limits: what `tally serve` allows one request.
//!
//! Invariant: every limit is bounded, so one request can neither ask for an
//! unbounded number of posts, send an unbounded body, run forever nor queue
//! behind an unbounded number of others.

use std::time::Duration;

use super::{ConfigError, bad};

/// Default of `--max-ids`: post ids one batch read may ask for.
pub const DEFAULT_SERVE_MAX_IDS: usize = 1_000;
/// Default of `--max-body-bytes`: the largest request body `tally serve` reads.
pub const DEFAULT_SERVE_MAX_BODY_BYTES: usize = 1_024;
/// Default of `--request-timeout-ms`.
pub const DEFAULT_SERVE_REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Default of `--max-concurrent-requests`.
pub const DEFAULT_SERVE_MAX_CONCURRENT: usize = 256;

/// The limits `tally serve` puts on every request (see
/// [`crate::infra::http::limited`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeLimits {
    /// Post ids one `/v1/likes` request may ask for.
    pub max_ids: usize,
    /// The largest request body read; a longer one is answered 413.
    pub max_body_bytes: usize,
    /// How long a request may take before it is answered 503.
    pub request_timeout: Duration,
    /// Requests handled at once; one more is answered 503 at once.
    pub max_concurrent: usize,
}

impl ServeLimits {
    /// Checks the limits; every problem at once.
    pub fn new(
        max_ids: usize,
        max_body_bytes: usize,
        request_timeout: Duration,
        max_concurrent: usize,
    ) -> Result<ServeLimits, Vec<ConfigError>> {
        let mut problems = Vec::new();
        if !(1..=100_000).contains(&max_ids) {
            problems.push(bad("max-ids", "must be between 1 and 100000"));
        }
        if max_body_bytes > 1 << 20 {
            problems.push(bad("max-body-bytes", "must be at most 1048576"));
        }
        if !(1..=600_000).contains(&request_timeout.as_millis()) {
            problems.push(bad("request-timeout-ms", "must be between 1 and 600000"));
        }
        if !(1..=100_000).contains(&max_concurrent) {
            problems.push(bad(
                "max-concurrent-requests",
                "must be between 1 and 100000",
            ));
        }
        if problems.is_empty() {
            Ok(ServeLimits {
                max_ids,
                max_body_bytes,
                request_timeout,
                max_concurrent,
            })
        } else {
            Err(problems)
        }
    }
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_ids: DEFAULT_SERVE_MAX_IDS,
            max_body_bytes: DEFAULT_SERVE_MAX_BODY_BYTES,
            request_timeout: Duration::from_millis(DEFAULT_SERVE_REQUEST_TIMEOUT_MS),
            max_concurrent: DEFAULT_SERVE_MAX_CONCURRENT,
        }
    }
}
