//! Config: every setting of `tally run`, its default, and its validation.
//!
//! Invariant: a configuration that passes [`RunConfig::validate`] can be run;
//! anything wrong is reported at start-up in one line naming the flag to fix,
//! never discovered mid-stream.

use std::net::SocketAddr;

use clap::Args;

/// Default number of buckets per post.
pub const DEFAULT_BUCKETS: u32 = 16;
/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "tally";
/// Default consumer group.
pub const DEFAULT_GROUP: &str = "tally";
/// Default number of slot groups on a cluster.
pub const DEFAULT_SLOT_GROUPS: u32 = 128;
/// Default age at which a partition's batch closes (milliseconds).
pub const DEFAULT_FLUSH_INTERVAL_MS: u64 = 100;
/// Default messages after which a partition's batch closes.
pub const DEFAULT_BATCH_MAX_EVENTS: u64 = 100_000;
/// Default distinct (post, bucket) counters after which a partition's batch closes.
pub const DEFAULT_BATCH_MAX_KEYS: usize = 10_000;

/// Settings of `tally run`. Each flag can also be set as `TALLY_<FLAG>` in the
/// environment (for example `TALLY_BROKERS`).
#[derive(Debug, Clone, Args)]
pub struct RunConfig {
    /// Kafka bootstrap servers, comma separated (host:port,...).
    #[arg(long, env = "TALLY_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,

    /// Topic of like events to consume.
    #[arg(long, env = "TALLY_TOPIC", default_value = "likes")]
    pub topic: String,

    /// Kafka consumer group; fences are kept per group, so two groups count independently.
    #[arg(long, env = "TALLY_GROUP", default_value = DEFAULT_GROUP)]
    pub group: String,

    /// Redis URL: redis://[user:password@]host:port[/db] for one server, or
    /// redis+cluster://[user:password@]host1:port1,host2:port2 for a cluster (rediss for TLS).
    #[arg(long, env = "TALLY_REDIS", default_value = "redis://127.0.0.1:6379/")]
    pub redis: String,

    /// On a cluster, the number of slot groups counters are spread over (a power of two;
    /// each batch sends at most one script per group). Fixed for the life of the data.
    #[arg(long, env = "TALLY_SLOT_GROUPS", default_value_t = DEFAULT_SLOT_GROUPS)]
    pub slot_groups: u32,

    /// Buckets per post (N): bucket = xxh64(user_id) % N. Changing it moves users between buckets.
    #[arg(long, env = "TALLY_BUCKETS", default_value_t = DEFAULT_BUCKETS)]
    pub buckets: u32,

    /// Prefix of every Redis key tally writes.
    #[arg(long, env = "TALLY_PREFIX", default_value = DEFAULT_PREFIX)]
    pub prefix: String,

    /// Topic that receives copies of malformed messages (with the reason in a header).
    #[arg(long, env = "TALLY_DEAD_LETTER_TOPIC")]
    pub dead_letter_topic: Option<String>,

    /// Close a partition's batch after this many messages.
    #[arg(long, env = "TALLY_BATCH_MAX_EVENTS", default_value_t = DEFAULT_BATCH_MAX_EVENTS)]
    pub batch_max_events: u64,

    /// Close a partition's batch after this many distinct (post, bucket) counters.
    #[arg(long, env = "TALLY_BATCH_MAX_KEYS", default_value_t = DEFAULT_BATCH_MAX_KEYS)]
    pub batch_max_keys: usize,

    /// Close a partition's batch when it is this old (milliseconds).
    #[arg(long, env = "TALLY_FLUSH_INTERVAL_MS", default_value_t = DEFAULT_FLUSH_INTERVAL_MS)]
    pub flush_interval_ms: u64,

    /// Scripts in flight to Redis at once, across partitions (one per partition at most).
    #[arg(long, env = "TALLY_MAX_IN_FLIGHT", default_value_t = 8)]
    pub max_in_flight: usize,

    /// On SIGTERM/SIGINT, how long to wait for in-flight batches before exiting (seconds).
    #[arg(long, env = "TALLY_SHUTDOWN_TIMEOUT_SECS", default_value_t = 10)]
    pub shutdown_timeout_secs: u64,

    /// Serve Prometheus metrics on this address (for example 0.0.0.0:9464).
    #[arg(long, env = "TALLY_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,

    /// Testing only: send the scripts of a batch one by one with this pause
    /// between them (milliseconds), so a crash can land between two scripts.
    #[arg(
        long,
        env = "TALLY_TEST_SCRIPT_PAUSE_MS",
        default_value_t = 0,
        hide = true
    )]
    pub test_script_pause_ms: u64,

    /// Extra librdkafka setting, repeatable: -X session.timeout.ms=6000.
    #[arg(short = 'X', long = "kafka-config", env = "TALLY_KAFKA_CONFIG", value_delimiter = ',', value_parser = parse_key_value)]
    pub kafka_config: Vec<(String, String)>,
}

fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("expected key=value, got '{s}'")),
    }
}

/// A configuration problem, naming the flag to fix.
#[derive(Debug, thiserror::Error)]
#[error("--{flag}: {problem}")]
pub struct ConfigError {
    /// The flag at fault.
    pub flag: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

fn bad(flag: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        problem: problem.into(),
    }
}

/// librdkafka settings tally owns; overriding them would break exactly-once.
const RESERVED_KAFKA_KEYS: &[&str] = &[
    "enable.auto.commit",
    "enable.auto.offset.store",
    "group.id",
    "bootstrap.servers",
];

impl RunConfig {
    /// Checks every setting; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.brokers.trim().is_empty() {
            return Err(bad("brokers", "is empty; give host:port of a Kafka broker"));
        }
        if self.topic.trim().is_empty() {
            return Err(bad("topic", "is empty"));
        }
        if self.group.trim().is_empty() {
            return Err(bad("group", "is empty"));
        }
        if let Err(problem) = crate::store::Target::parse(&self.redis) {
            let shown = crate::apply::redact_url(&self.redis);
            return Err(bad("redis", format!("'{shown}': {problem}")));
        }
        if !self.slot_groups.is_power_of_two() || self.slot_groups > 16_384 {
            return Err(bad(
                "slot-groups",
                "must be a power of two between 1 and 16384",
            ));
        }
        if self.buckets == 0 || self.buckets > 1 << 20 {
            return Err(bad("buckets", "must be between 1 and 1048576"));
        }
        if self.prefix.is_empty()
            || self
                .prefix
                .contains(|c: char| c.is_whitespace() || "*?[]{}".contains(c))
        {
            return Err(bad(
                "prefix",
                "must be non-empty, without spaces, glob characters or braces",
            ));
        }
        if self.dead_letter_topic.as_deref() == Some(self.topic.as_str()) {
            return Err(bad("dead-letter-topic", "must differ from --topic"));
        }
        if self.batch_max_events == 0 {
            return Err(bad("batch-max-events", "must be at least 1"));
        }
        if self.batch_max_keys == 0 || self.batch_max_keys > 100_000 {
            return Err(bad("batch-max-keys", "must be between 1 and 100000"));
        }
        if self.flush_interval_ms == 0 {
            return Err(bad("flush-interval-ms", "must be at least 1"));
        }
        if self.max_in_flight == 0 {
            return Err(bad("max-in-flight", "must be at least 1"));
        }
        if let Some((key, _)) = self
            .kafka_config
            .iter()
            .find(|(k, _)| RESERVED_KAFKA_KEYS.contains(&k.as_str()))
        {
            return Err(bad(
                "kafka-config",
                format!("{key} is managed by tally; use the dedicated flag or leave it"),
            ));
        }
        Ok(())
    }
}

/// Parses `args` (without the program name) as one flattened flag group; for tests.
#[cfg(test)]
pub(crate) fn parse_flags<T: clap::Args + clap::FromArgMatches>(
    args: &[&str],
) -> Result<T, clap::Error> {
    let command = T::augment_args(clap::Command::new("tally"));
    let matches =
        command.try_get_matches_from(std::iter::once("tally").chain(args.iter().copied()))?;
    T::from_arg_matches(&matches)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> RunConfig {
        parse_flags(args).unwrap()
    }

    #[test]
    fn defaults_are_valid() {
        let config = parse(&[]);
        assert_eq!(config.buckets, 16);
        assert_eq!(config.prefix, "tally");
        config.validate().unwrap();
    }

    #[test]
    fn passthrough_and_problems_name_the_flag() {
        let config = parse(&["-X", "session.timeout.ms=6000", "-X", "fetch.min.bytes=1"]);
        assert_eq!(config.kafka_config.len(), 2);
        let err = parse(&["--buckets", "0"]).validate().unwrap_err();
        assert_eq!(err.flag, "buckets");
        let err = parse(&["--redis", "localhost:6379"])
            .validate()
            .unwrap_err();
        assert_eq!(err.flag, "redis");
        let err = parse(&["-X", "enable.auto.commit=true"])
            .validate()
            .unwrap_err();
        assert_eq!(err.flag, "kafka-config");
        assert!(parse_flags::<RunConfig>(&["-X", "nonsense"]).is_err());
    }
}
