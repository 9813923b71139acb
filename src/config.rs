//! Config: every setting of `tally run`, its default, and its validation.
//!
//! Invariant: [`RunConfig`] is the one source of settings: its fields are the
//! flags, the `TALLY_*` variables and the keys of a `--config` file alike
//! ([`layers`] says which wins). A configuration with no
//! [`RunConfig::problems`] can be run; anything wrong is reported at start-up,
//! one line per problem naming the flag to fix, never discovered mid-stream.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, FromArgMatches};
use serde::{Deserialize, Serialize};

use crate::security::{SaslMechanism, SecurityProtocol};

mod layers;
mod secrets;
mod show;

pub use layers::{load, parse_file};
pub use show::{print, settings_table};

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

/// Settings of `tally run`: each is a flag, a `TALLY_*` variable and a key of
/// the `--config` file (flag > variable > file > default; see [`load`]).
#[derive(Clone, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct RunConfig {
    /// TOML file with settings (keys are the flag names without `--`).
    #[arg(long, env = "TALLY_CONFIG", value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// Kafka bootstrap servers, comma separated (host:port,...).
    #[arg(long, env = "TALLY_BROKERS", default_value = "127.0.0.1:9092", help_heading = KAFKA)]
    pub brokers: String,

    /// Topic of like events to consume.
    #[arg(long, env = "TALLY_TOPIC", default_value = "likes", help_heading = KAFKA)]
    pub topic: String,

    /// Kafka consumer group; fences are kept per group, so two groups count independently.
    #[arg(long, env = "TALLY_GROUP", default_value = DEFAULT_GROUP, help_heading = KAFKA)]
    pub group: String,

    /// Topic that receives copies of malformed messages (with the reason in a header).
    #[arg(long, env = "TALLY_DEAD_LETTER_TOPIC", help_heading = KAFKA)]
    pub dead_letter_topic: Option<String>,

    /// Redis URL: redis://[user:password@]host:port[/db] for one server, or
    /// redis+cluster://[user:password@]host1:port1,host2:port2 for a cluster (rediss for TLS).
    #[arg(long, env = "TALLY_REDIS", default_value = "redis://127.0.0.1:6379/", help_heading = REDIS)]
    pub redis: String,

    /// Redis password, joined to the user named in --redis (prefer the variable or the file).
    #[arg(long, env = "TALLY_REDIS_PASSWORD", hide_env_values = true, help_heading = REDIS)]
    pub redis_password: Option<String>,

    /// File holding the Redis password.
    #[arg(long, env = "TALLY_REDIS_PASSWORD_FILE", value_name = "FILE", help_heading = REDIS)]
    pub redis_password_file: Option<PathBuf>,

    /// On a cluster, the number of slot groups counters are spread over (a power of two;
    /// each batch sends at most one script per group). Fixed for the life of the data.
    #[arg(long, env = "TALLY_SLOT_GROUPS", default_value_t = DEFAULT_SLOT_GROUPS, help_heading = REDIS)]
    pub slot_groups: u32,

    /// Buckets per post (N): bucket = xxh64(user_id) % N. Changing it moves users between buckets.
    #[arg(long, env = "TALLY_BUCKETS", default_value_t = DEFAULT_BUCKETS, help_heading = REDIS)]
    pub buckets: u32,

    /// Promote a post to --hot-buckets when its events across all consumers
    /// exceed this many per second (0 turns detection off; `tally promote` still works).
    #[arg(long, env = "TALLY_PROMOTE_ABOVE", default_value_t = 300, help_heading = HOT)]
    pub promote_above: u64,

    /// Buckets a hot post is promoted to (a new routing version; old keys stay summed).
    #[arg(long, env = "TALLY_HOT_BUCKETS", default_value_t = 64, help_heading = HOT)]
    pub hot_buckets: u32,

    /// How often the routing registry is read again (milliseconds); at most 2000, so
    /// new versions are known well before they take effect.
    #[arg(long, env = "TALLY_ROUTE_REFRESH_MS", default_value_t = 1_000, help_heading = HOT)]
    pub route_refresh_ms: u64,

    /// Prefix of every Redis key tally writes.
    #[arg(long, env = "TALLY_PREFIX", default_value = DEFAULT_PREFIX, help_heading = REDIS)]
    pub prefix: String,

    /// Close a partition's batch after this many messages.
    #[arg(long, env = "TALLY_BATCH_MAX_EVENTS", default_value_t = DEFAULT_BATCH_MAX_EVENTS, help_heading = BATCHING)]
    pub batch_max_events: u64,

    /// Close a partition's batch after this many distinct (post, bucket) counters.
    #[arg(long, env = "TALLY_BATCH_MAX_KEYS", default_value_t = DEFAULT_BATCH_MAX_KEYS, help_heading = BATCHING)]
    pub batch_max_keys: usize,

    /// Close a partition's batch when it is this old (milliseconds).
    #[arg(long, env = "TALLY_FLUSH_INTERVAL_MS", default_value_t = DEFAULT_FLUSH_INTERVAL_MS, help_heading = BATCHING)]
    pub flush_interval_ms: u64,

    /// Scripts in flight to Redis at once, across partitions (one per partition at most).
    #[arg(long, env = "TALLY_MAX_IN_FLIGHT", default_value_t = 8, help_heading = BATCHING)]
    pub max_in_flight: usize,

    /// On SIGTERM/SIGINT, how long to wait for in-flight batches before exiting (seconds).
    #[arg(long, env = "TALLY_SHUTDOWN_TIMEOUT_SECS", default_value_t = 10, help_heading = BATCHING)]
    pub shutdown_timeout_secs: u64,

    /// Serve /metrics, /healthz and /readyz on this address; a bare port listens on
    /// 127.0.0.1 only (give 0.0.0.0:PORT to serve other hosts).
    #[arg(long, env = "TALLY_METRICS_ADDR", value_name = "ADDR", value_parser = parse_http_addr)]
    #[serde(deserialize_with = "http_addr")]
    pub metrics_addr: Option<SocketAddr>,

    /// Kafka security.protocol.
    #[arg(long, env = "TALLY_KAFKA_SECURITY_PROTOCOL", value_enum, help_heading = SECURITY)]
    pub kafka_security_protocol: Option<SecurityProtocol>,

    /// Kafka sasl.mechanism (with a sasl_* protocol).
    #[arg(long, env = "TALLY_KAFKA_SASL_MECHANISM", value_enum, ignore_case = true, help_heading = SECURITY)]
    pub kafka_sasl_mechanism: Option<SaslMechanism>,

    /// Kafka sasl.username.
    #[arg(long, env = "TALLY_KAFKA_SASL_USERNAME", help_heading = SECURITY)]
    pub kafka_sasl_username: Option<String>,

    /// Kafka sasl.password (prefer the variable or the file: flags show in `ps`).
    #[arg(long, env = "TALLY_KAFKA_SASL_PASSWORD", hide_env_values = true, help_heading = SECURITY)]
    pub kafka_sasl_password: Option<String>,

    /// File holding the Kafka SASL password.
    #[arg(long, env = "TALLY_KAFKA_SASL_PASSWORD_FILE", value_name = "FILE", help_heading = SECURITY)]
    pub kafka_sasl_password_file: Option<PathBuf>,

    /// PEM file of the CAs that sign the brokers' certificates (ssl.ca.location).
    #[arg(long, env = "TALLY_KAFKA_SSL_CA_LOCATION", value_name = "FILE", help_heading = SECURITY)]
    pub kafka_ssl_ca_location: Option<PathBuf>,

    /// PEM client certificate for mutual TLS (ssl.certificate.location).
    #[arg(long, env = "TALLY_KAFKA_SSL_CERTIFICATE_LOCATION", value_name = "FILE", help_heading = SECURITY)]
    pub kafka_ssl_certificate_location: Option<PathBuf>,

    /// PEM private key of that certificate (ssl.key.location).
    #[arg(long, env = "TALLY_KAFKA_SSL_KEY_LOCATION", value_name = "FILE", help_heading = SECURITY)]
    pub kafka_ssl_key_location: Option<PathBuf>,

    /// Testing only: send the scripts of a batch one by one with this pause
    /// between them (milliseconds), so a crash can land between two scripts.
    #[arg(
        long,
        env = "TALLY_TEST_SCRIPT_PAUSE_MS",
        default_value_t = 0,
        hide = true
    )]
    #[serde(skip)]
    pub test_script_pause_ms: u64,

    /// Extra librdkafka setting, repeatable: -X session.timeout.ms=6000. In the
    /// file, a [kafka-config] table.
    #[arg(short = 'X', long = "kafka-config", env = "TALLY_KAFKA_CONFIG", value_name = "KEY=VALUE", value_delimiter = ',', value_parser = parse_key_value, help_heading = KAFKA)]
    #[serde(with = "kafka_table")]
    pub kafka_config: Vec<(String, String)>,
}

const KAFKA: &str = "Kafka";
const REDIS: &str = "Redis";
const BATCHING: &str = "Batching";
const HOT: &str = "Hot posts";
const SECURITY: &str = "Security";

impl Default for RunConfig {
    /// Every setting at its default, whatever the environment holds.
    fn default() -> Self {
        let command = RunConfig::augment_args(clap::Command::new("tally"))
            .mut_args(|arg| arg.env(None::<&str>));
        let matches = command
            .try_get_matches_from(["tally"])
            .expect("the defaults parse");
        RunConfig::from_arg_matches(&matches).expect("the defaults parse")
    }
}

/// Parses `--metrics-addr`: `HOST:PORT`, or a bare `PORT` (or `:PORT`) on loopback.
pub fn parse_http_addr(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    let port = s.strip_prefix(':').unwrap_or(s);
    if let Ok(port) = port.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.parse()
        .map_err(|_| format!("expected IP:PORT or a port, got '{s}'"))
}

fn http_addr<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    Option::<String>::deserialize(d)?
        .map(|s| parse_http_addr(&s).map_err(serde::de::Error::custom))
        .transpose()
}

/// `kafka-config` as a TOML table of librdkafka keys; values may be strings,
/// numbers or booleans.
mod kafka_table {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Scalar {
        Text(String),
        Integer(i64),
        Float(f64),
        Bool(bool),
    }

    pub fn serialize<S: Serializer>(v: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
        let map: BTreeMap<&str, &str> = v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        map.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, String)>, D::Error> {
        let map = BTreeMap::<String, Scalar>::deserialize(d)?;
        Ok(map
            .into_iter()
            .map(|(k, v)| {
                let v = match v {
                    Scalar::Text(s) => s,
                    Scalar::Integer(i) => i.to_string(),
                    Scalar::Float(f) => f.to_string(),
                    Scalar::Bool(b) => b.to_string(),
                };
                (k, v)
            })
            .collect())
    }
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
        match self.problems().into_iter().next() {
            Some(problem) => Err(problem),
            None => Ok(()),
        }
    }

    /// Every problem with the settings, one per line, each naming its flag.
    pub fn problems(&self) -> Vec<ConfigError> {
        let mut problems = Vec::new();
        let mut check = |ok: bool, flag: &'static str, problem: &str| {
            if !ok {
                problems.push(bad(flag, problem));
            }
        };
        check(
            !self.brokers.trim().is_empty(),
            "brokers",
            "is empty; give host:port of a Kafka broker",
        );
        check(!self.topic.trim().is_empty(), "topic", "is empty");
        check(!self.group.trim().is_empty(), "group", "is empty");
        check(
            self.slot_groups.is_power_of_two() && self.slot_groups <= 16_384,
            "slot-groups",
            "must be a power of two between 1 and 16384",
        );
        check(
            self.buckets != 0 && self.buckets <= 1 << 20,
            "buckets",
            "must be between 1 and 1048576",
        );
        let session_ms = self
            .kafka_config
            .iter()
            .rev()
            .find(|(k, _)| k == "session.timeout.ms")
            .map_or(Some(45_000), |(_, v)| v.parse::<u64>().ok());
        check(
            session_ms.is_some_and(|ms| self.shutdown_timeout_secs * 1000 < ms),
            "shutdown-timeout-secs",
            "must be below the consumer's session.timeout.ms (45 s unless set with -X): a \
             stopping consumer finishes its batches and leaves before the group could expire it",
        );
        check(
            self.hot_buckets != 0 && self.hot_buckets <= 1 << 16,
            "hot-buckets",
            "must be between 1 and 65536",
        );
        check(
            (10..=2_000).contains(&self.route_refresh_ms),
            "route-refresh-ms",
            "must be between 10 and 2000",
        );
        check(
            !self.prefix.is_empty()
                && !self
                    .prefix
                    .contains(|c: char| c.is_whitespace() || "*?[]{}".contains(c)),
            "prefix",
            "must be non-empty, without spaces, glob characters or braces",
        );
        check(
            self.dead_letter_topic.as_deref() != Some(self.topic.as_str()),
            "dead-letter-topic",
            "must differ from --topic",
        );
        check(
            self.batch_max_events != 0,
            "batch-max-events",
            "must be at least 1",
        );
        check(
            self.batch_max_keys != 0 && self.batch_max_keys <= 100_000,
            "batch-max-keys",
            "must be between 1 and 100000",
        );
        check(
            self.flush_interval_ms != 0,
            "flush-interval-ms",
            "must be at least 1",
        );
        check(
            self.max_in_flight != 0,
            "max-in-flight",
            "must be at least 1",
        );
        if let Err(problem) = crate::store::Target::parse(&self.redis) {
            let shown = crate::security::redact_url(&self.redis);
            problems.push(bad("redis", format!("'{shown}': {problem}")));
        }
        for (key, _) in &self.kafka_config {
            if RESERVED_KAFKA_KEYS.contains(&key.as_str()) {
                problems.push(bad(
                    "kafka-config",
                    format!("{key} is managed by tally; use the dedicated flag or leave it"),
                ));
            }
        }
        problems.extend(self.security_problems());
        problems
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

    #[test]
    fn every_setting_has_its_variable() {
        let command = RunConfig::augment_args(clap::Command::new("tally"));
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            assert_eq!(
                env,
                Some(format!("TALLY_{}", id.to_uppercase())),
                "--{id} lacks its TALLY_* variable"
            );
        }
    }

    #[test]
    fn shutdown_must_end_within_the_session_timeout() {
        let problems = parse(&["-X", "session.timeout.ms=6000"]).problems();
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].flag, "shutdown-timeout-secs");
        let fine = parse(&[
            "--shutdown-timeout-secs",
            "5",
            "-X",
            "session.timeout.ms=6000",
        ]);
        assert!(fine.problems().is_empty());
        assert!(
            parse(&[]).problems().is_empty(),
            "defaults: 10 s within 45 s"
        );
    }

    #[test]
    fn sasl_settings_become_librdkafka_properties() {
        let config = parse(&[
            "--kafka-security-protocol",
            "sasl_ssl",
            "--kafka-sasl-mechanism",
            "scram-sha-512",
            "--kafka-sasl-username",
            "tally",
            "--kafka-sasl-password",
            "pw",
            "--shutdown-timeout-secs",
            "5",
            "-X",
            "session.timeout.ms=6000",
        ]);
        assert!(config.problems().is_empty(), "{:?}", config.problems());
        let settings = config.kafka_settings();
        for (key, value) in [
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "tally"),
            ("sasl.password", "pw"),
            ("session.timeout.ms", "6000"),
        ] {
            assert!(
                settings.contains(&(key.to_string(), value.to_string())),
                "{key}"
            );
        }
        assert!(
            !config
                .kafka_security()
                .iter()
                .any(|(k, _)| k == "session.timeout.ms")
        );
    }

    #[test]
    fn every_problem_gets_its_own_line() {
        let config = parse(&[
            "--buckets",
            "0",
            "--kafka-security-protocol",
            "sasl_plaintext",
            "--kafka-ssl-ca-location",
            "/nonexistent/ca.pem",
            "--redis",
            "redis://a:b@h/",
            "--redis-password",
            "c",
            "-X",
            "security.protocol=ssl",
        ]);
        let flags: Vec<&str> = config.problems().iter().map(|p| p.flag).collect();
        assert_eq!(
            flags,
            [
                "buckets",
                "kafka-sasl-mechanism",
                "kafka-sasl-username",
                "kafka-sasl-password",
                "kafka-ssl-ca-location",
                "kafka-config",
                "redis-password"
            ]
        );
        let plain = parse(&["--kafka-sasl-username", "u"]);
        assert_eq!(plain.problems()[0].flag, "kafka-sasl-username");
    }

    #[test]
    fn password_files_are_read_once_and_joined_to_the_url() {
        let dir = tempfile::tempdir().unwrap();
        let (redis_pw, kafka_pw) = (dir.path().join("redis"), dir.path().join("kafka"));
        std::fs::write(&redis_pw, "r3dis\n").unwrap();
        std::fs::write(&kafka_pw, "k4fka\n").unwrap();
        let config = parse(&[
            "--redis",
            "redis://alice@127.0.0.1:6379/",
            "--redis-password-file",
            redis_pw.to_str().unwrap(),
            "--kafka-security-protocol",
            "sasl_ssl",
            "--kafka-sasl-mechanism",
            "PLAIN",
            "--kafka-sasl-username",
            "tally",
            "--kafka-sasl-password-file",
            kafka_pw.to_str().unwrap(),
        ]);
        assert!(config.problems().is_empty(), "{:?}", config.problems());
        let config = config.resolve_secrets().unwrap();
        assert_eq!(config.redis, "redis://alice:r3dis@127.0.0.1:6379/");
        assert!(
            config
                .kafka_security()
                .contains(&("sasl.password".into(), "k4fka".into()))
        );
        let missing = parse(&["--redis-password-file", "/nonexistent/pw"]);
        assert_eq!(
            missing.resolve_secrets().unwrap_err().flag,
            "redis-password-file"
        );
    }

    #[test]
    fn a_bare_metrics_port_listens_on_loopback() {
        let config = parse(&["--metrics-addr", "9464"]);
        assert_eq!(config.metrics_addr, Some(([127, 0, 0, 1], 9464).into()));
        assert_eq!(parse_http_addr(":1").unwrap(), ([127, 0, 0, 1], 1).into());
        assert_eq!(
            parse_http_addr("0.0.0.0:2").unwrap(),
            ([0, 0, 0, 0], 2).into()
        );
        assert!(parse_http_addr("localhost").is_err());
    }
}
