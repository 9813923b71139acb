//! Config: the settings of the service as typed values, and their checks.
//!
//! Invariant: settings are checked when they are built, and every problem is
//! reported at once, one [`ConfigError`] per problem naming the setting to
//! fix, never discovered mid-stream. A setting has one name: the flag
//! (`--slot-groups`), its `TALLY_*` variable and its key in a settings file
//! are all derived from it.
//!
//! [`StoreSettings`] says where the counts are and is shared by every command
//! that touches Redis; [`RunSettings`] embeds it with everything else `tally
//! run` needs. The Redis URL is parsed once, here, into a target and a
//! redacted display form ([`RedisUrl`]), and secrets are read once, here,
//! from their values or files.

pub mod dedupe;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use rdkafka::ClientConfig;
use serde::{Deserialize, Serialize};

use crate::infra::security::{
    RedisTls, SaslMechanism, SecurityProtocol, check_kafka_support, pem_certificates_problem,
    pem_key_problem, read_secret_file, url_has_password, with_password,
};
use crate::infra::store::{RedisUrl, ReplicaWait};

/// Default Kafka bootstrap servers.
pub const DEFAULT_BROKERS: &str = "127.0.0.1:9092";
/// Default topic of like events.
pub const DEFAULT_TOPIC: &str = "likes";
/// Default consumer group.
pub const DEFAULT_GROUP: &str = "tally";
/// Default Redis URL.
pub const DEFAULT_REDIS: &str = "redis://127.0.0.1:6379/";
/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "tally";
/// Default number of slot groups on a cluster.
pub const DEFAULT_SLOT_GROUPS: u32 = 128;
/// Default number of buckets per post on a new prefix: one key per cold post;
/// hot posts are promoted to [`DEFAULT_HOT_BUCKETS`].
pub const DEFAULT_BUCKETS: u32 = 1;
/// Default events per second across all consumers above which a post is promoted.
pub const DEFAULT_PROMOTE_ABOVE: u64 = 300;
/// Default buckets of a promoted post.
pub const DEFAULT_HOT_BUCKETS: u32 = 64;
/// Default interval between reads of the routing registry (milliseconds).
pub const DEFAULT_ROUTE_REFRESH_MS: u64 = 1_000;
/// How long a routing version waits for its replicas, in milliseconds.
pub const DEFAULT_REGISTRY_WAIT_MS: u64 = 1_000;
/// Default age at which a partition's batch closes (milliseconds).
pub const DEFAULT_FLUSH_INTERVAL_MS: u64 = 100;
/// Default messages after which a partition's batch closes. Set above what
/// [`DEFAULT_BATCH_MAX_KEYS`] counters hold on skewed traffic (about 190,000
/// Zipf events), so a partition catching up closes on its counters, which bound
/// the script's time in Redis, rather than on a message count, which does not.
pub const DEFAULT_BATCH_MAX_EVENTS: u64 = 400_000;
/// Default distinct (post, bucket) counters after which a partition's batch closes.
pub const DEFAULT_BATCH_MAX_KEYS: usize = 40_000;
/// Default scripts in flight to Redis at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 8;
/// Default wait for in-flight batches at shutdown (seconds).
pub const DEFAULT_SHUTDOWN_TIMEOUT_SECS: u64 = 10;

/// The largest Schema Registry id: ids are positive signed 32-bit integers.
pub const MAX_SCHEMA_ID: u32 = i32::MAX as u32;

/// librdkafka's own default `session.timeout.ms`.
const KAFKA_SESSION_TIMEOUT_MS: u64 = 45_000;

/// How the consumer group assigns partitions (librdkafka's `group.protocol`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupProtocol {
    /// The members agree on an assignment through a leader; tally asks for
    /// the incremental `cooperative-sticky` assignor.
    #[default]
    #[serde(rename = "classic")]
    Classic,
    /// KIP-848: the broker assigns partitions and moves them incrementally;
    /// session and heartbeat timing are the broker's settings.
    #[serde(rename = "consumer")]
    Consumer,
}

impl GroupProtocol {
    /// Every protocol, in the order `--help` lists them.
    pub const ALL: [GroupProtocol; 2] = [GroupProtocol::Classic, GroupProtocol::Consumer];

    /// The librdkafka value.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupProtocol::Classic => "classic",
            GroupProtocol::Consumer => "consumer",
        }
    }

    /// librdkafka settings that only the other protocol reads, each with the
    /// setting to use instead. librdkafka refuses the classic ones under
    /// `consumer` with an error naming neither the flag nor the broker's
    /// setting, and would ignore the other one under `classic`.
    fn foreign_keys(self) -> &'static [(&'static str, &'static str)] {
        match self {
            GroupProtocol::Classic => &[(
                "group.remote.assignor",
                "it names the broker's assignor under --group-protocol consumer; the classic protocol assigns with partition.assignment.strategy",
            )],
            GroupProtocol::Consumer => &[
                (
                    "partition.assignment.strategy",
                    "under --group-protocol consumer the broker assigns partitions; choose its assignor with -X group.remote.assignor=uniform|range",
                ),
                (
                    "session.timeout.ms",
                    "under --group-protocol consumer the broker sets it: group.consumer.session.timeout.ms (or the group's consumer.session.timeout.ms)",
                ),
                (
                    "heartbeat.interval.ms",
                    "under --group-protocol consumer the broker sets it: group.consumer.heartbeat.interval.ms (or the group's consumer.heartbeat.interval.ms)",
                ),
                (
                    "group.protocol.type",
                    "it belongs to the classic protocol; under --group-protocol consumer the broker owns the group's type",
                ),
            ],
        }
    }
}

impl std::fmt::Display for GroupProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for GroupProtocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GroupProtocol::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown group protocol '{s}'; expected classic or consumer"))
    }
}

/// A problem with one setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag}: {problem}")]
pub struct ConfigError {
    /// The setting at fault, as its flag is spelt without `--`.
    pub flag: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

/// A [`ConfigError`] for `flag`.
pub fn bad(flag: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        problem: problem.into(),
    }
}

/// Where a password comes from: given as a value, or read from a file.
#[derive(Clone, PartialEq, Eq)]
pub enum Password {
    /// The password itself (from a flag or a variable).
    Value(String),
    /// A file holding it, read once when the settings are built.
    File(PathBuf),
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Password::Value(_) => f.write_str("Value(***)"),
            Password::File(path) => f.debug_tuple("File").field(path).finish(),
        }
    }
}

impl Password {
    /// The password of a value setting and a file setting, at most one of
    /// which may be given.
    pub fn from_sources(
        value: Option<String>,
        file: Option<PathBuf>,
        file_flag: &'static str,
    ) -> Result<Option<Password>, ConfigError> {
        match (value, file) {
            (Some(_), Some(_)) => Err(bad(file_flag, "give the password or its file, not both")),
            (Some(value), None) => Ok(Some(Password::Value(value))),
            (None, Some(path)) => Ok(Some(Password::File(path))),
            (None, None) => Ok(None),
        }
    }

    /// The password: the value, or the file's content without its trailing newline.
    fn read(&self, file_flag: &'static str) -> Result<String, ConfigError> {
        match self {
            Password::Value(value) => Ok(value.clone()),
            Password::File(path) => {
                read_secret_file(path).map_err(|problem| bad(file_flag, problem.to_string()))
            }
        }
    }
}

/// Where the counts are: the settings every command touching Redis shares.
#[derive(Debug, Clone)]
pub struct StoreSettings {
    url: RedisUrl,
    password: Option<Password>,
    prefix: String,
    slot_groups: u32,
}

impl StoreSettings {
    /// Parses the URL (with the password, if given apart from it, joined to
    /// it) and checks the prefix and the slot groups. `password` comes from
    /// `--redis-password` or `--redis-password-file`.
    pub fn new(
        url: &str,
        password: Option<Password>,
        prefix: &str,
        slot_groups: u32,
    ) -> Result<StoreSettings, Vec<ConfigError>> {
        let mut problems = Vec::new();
        let parsed = match RedisUrl::parse(url) {
            Err(error) => Err(bad("redis", error.to_string())),
            Ok(parsed) => match &password {
                None => Ok(parsed),
                Some(_) if url_has_password(url) => Err(bad(
                    "redis-password",
                    "--redis already holds a password; give it in one place only",
                )),
                Some(password) => {
                    let flag = match password {
                        Password::Value(_) => "redis-password",
                        Password::File(_) => "redis-password-file",
                    };
                    password.read(flag).and_then(|secret| {
                        let joined = with_password(url, &secret).map_err(|p| bad(flag, p))?;
                        RedisUrl::parse(&joined).map_err(|e| bad("redis", e.to_string()))
                    })
                }
            },
        };
        let url = parsed.map_err(|problem| problems.push(problem)).ok();
        if prefix.is_empty() || prefix.contains(|c: char| c.is_whitespace() || "*?[]{}".contains(c))
        {
            problems.push(bad(
                "prefix",
                "must be non-empty, without spaces, glob characters or braces",
            ));
        }
        if !(slot_groups.is_power_of_two() && slot_groups <= 16_384) {
            problems.push(bad(
                "slot-groups",
                "must be a power of two between 1 and 16384",
            ));
        }
        match url {
            Some(url) if problems.is_empty() => Ok(StoreSettings {
                url,
                password,
                prefix: prefix.to_string(),
                slot_groups,
            }),
            _ => Err(problems),
        }
    }

    /// The URL, credentials included; show it with [`RedisUrl::shown`].
    pub fn url(&self) -> &RedisUrl {
        &self.url
    }

    /// Where the password came from, if it was given apart from the URL.
    pub fn password(&self) -> Option<&Password> {
        self.password.as_ref()
    }

    /// The base key prefix (generation 0's).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Slot groups on a cluster (a single server has one).
    pub fn slot_groups(&self) -> u32 {
        self.slot_groups
    }

    /// These settings with the TLS files of `files` read, checked and
    /// attached to the URL; every problem at once, each naming its flag.
    pub fn with_tls(self, files: &RedisTlsFiles) -> Result<StoreSettings, Vec<ConfigError>> {
        if files == &RedisTlsFiles::default() {
            return Ok(self);
        }
        let mut problems = Vec::new();
        if !self.url.uses_tls() {
            problems.push(bad(
                files.first_flag(),
                "needs a rediss:// (or rediss+cluster://) URL in --redis",
            ));
        }
        if files.cert.is_some() != files.key.is_some() {
            problems.push(bad(
                "redis-tls-key-file",
                "a client certificate and its key go together: give --redis-tls-cert-file and --redis-tls-key-file",
            ));
        }
        let mut read =
            |path: &Option<PathBuf>, flag: &'static str, check: fn(&[u8]) -> Option<String>| {
                let path = path.as_ref()?;
                match std::fs::read(path) {
                    Ok(pem) => match check(&pem) {
                        None => Some(pem),
                        Some(problem) => {
                            problems.push(bad(flag, format!("{}: {problem}", path.display())));
                            None
                        }
                    },
                    Err(error) => {
                        problems.push(bad(
                            flag,
                            format!("cannot read {}: {error}", path.display()),
                        ));
                        None
                    }
                }
            };
        let root = read(
            &files.ca_cert,
            "redis-tls-ca-cert-file",
            pem_certificates_problem,
        );
        let cert = read(&files.cert, "redis-tls-cert-file", pem_certificates_problem);
        let key = read(&files.key, "redis-tls-key-file", pem_key_problem);
        if !problems.is_empty() {
            return Err(problems);
        }
        let tls = RedisTls::new(root, cert.zip(key));
        Ok(StoreSettings {
            url: self.url.with_tls(Some(tls)),
            ..self
        })
    }
}

/// The files of the `--redis-tls-*` settings: the CAs that sign the Redis
/// servers' certificates (instead of the system's), and a client
/// certificate and key for servers that ask for one (`tls-auth-clients`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTlsFiles {
    /// `--redis-tls-ca-cert-file`: PEM, one or more CA certificates.
    pub ca_cert: Option<PathBuf>,
    /// `--redis-tls-cert-file`: PEM client certificate.
    pub cert: Option<PathBuf>,
    /// `--redis-tls-key-file`: PEM private key of that certificate.
    pub key: Option<PathBuf>,
}

impl RedisTlsFiles {
    /// The flag of the first file given.
    fn first_flag(&self) -> &'static str {
        if self.ca_cert.is_some() {
            "redis-tls-ca-cert-file"
        } else if self.cert.is_some() {
            "redis-tls-cert-file"
        } else {
            "redis-tls-key-file"
        }
    }
}

/// TLS and SASL towards the brokers, secrets read.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KafkaSecurity {
    /// `security.protocol`.
    pub protocol: Option<SecurityProtocol>,
    /// `sasl.mechanism`.
    pub mechanism: Option<SaslMechanism>,
    /// `sasl.username`.
    pub username: Option<String>,
    /// `sasl.password`.
    password: Option<String>,
    /// `ssl.ca.location`.
    pub ca_location: Option<PathBuf>,
    /// `ssl.certificate.location`.
    pub certificate_location: Option<PathBuf>,
    /// `ssl.key.location`.
    pub key_location: Option<PathBuf>,
}

impl std::fmt::Debug for KafkaSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSecurity")
            .field("protocol", &self.protocol)
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("ca_location", &self.ca_location)
            .field("certificate_location", &self.certificate_location)
            .field("key_location", &self.key_location)
            .finish()
    }
}

/// What the Kafka security settings are built from.
#[derive(Debug, Clone, Default)]
pub struct KafkaSecurityInput {
    /// `--kafka-security-protocol`.
    pub protocol: Option<SecurityProtocol>,
    /// `--kafka-sasl-mechanism`.
    pub mechanism: Option<SaslMechanism>,
    /// `--kafka-sasl-username`.
    pub username: Option<String>,
    /// `--kafka-sasl-password` or `--kafka-sasl-password-file`.
    pub password: Option<Password>,
    /// `--kafka-ssl-ca-location`.
    pub ca_location: Option<PathBuf>,
    /// `--kafka-ssl-certificate-location`.
    pub certificate_location: Option<PathBuf>,
    /// `--kafka-ssl-key-location`.
    pub key_location: Option<PathBuf>,
}

impl KafkaSecurity {
    /// Checks the combination and reads the password.
    pub fn new(input: KafkaSecurityInput) -> Result<KafkaSecurity, Vec<ConfigError>> {
        let protocol = input.protocol;
        let password_flag = match input.password {
            Some(Password::File(_)) => "kafka-sasl-password-file",
            _ => "kafka-sasl-password",
        };
        let mut problems = sasl_problems(&input, password_flag);
        problems.extend(tls_problems(&input));
        if let Some(protocol) = protocol
            && let Err(problem) = check_kafka_support(protocol, input.mechanism)
        {
            problems.push(bad("kafka-security-protocol", problem.to_string()));
        }
        let password = match &input.password {
            Some(password) if problems.is_empty() => match password.read(password_flag) {
                Ok(secret) => Some(secret),
                Err(problem) => {
                    problems.push(problem);
                    None
                }
            },
            _ => None,
        };
        if !problems.is_empty() {
            return Err(problems);
        }
        Ok(KafkaSecurity {
            protocol,
            mechanism: input.mechanism,
            username: input.username,
            password,
            ca_location: input.ca_location,
            certificate_location: input.certificate_location,
            key_location: input.key_location,
        })
    }

    /// The librdkafka properties these settings set.
    pub fn properties(&self) -> Vec<(String, String)> {
        let path = |p: &PathBuf| p.display().to_string();
        [
            (
                "security.protocol",
                self.protocol.map(|p| p.as_str().to_string()),
            ),
            (
                "sasl.mechanism",
                self.mechanism.map(|m| m.as_str().to_string()),
            ),
            ("sasl.username", self.username.clone()),
            ("sasl.password", self.password.clone()),
            ("ssl.ca.location", self.ca_location.as_ref().map(path)),
            (
                "ssl.certificate.location",
                self.certificate_location.as_ref().map(path),
            ),
            ("ssl.key.location", self.key_location.as_ref().map(path)),
        ]
        .into_iter()
        .filter_map(|(key, value)| Some((key.to_string(), value?)))
        .collect()
    }
}

/// What is wrong with the SASL settings for the protocol asked for.
fn sasl_problems(input: &KafkaSecurityInput, password_flag: &'static str) -> Vec<ConfigError> {
    let mut problems = Vec::new();
    let sasl = input.protocol.is_some_and(SecurityProtocol::uses_sasl);
    if sasl {
        if input.mechanism.is_none() {
            problems.push(bad(
                "kafka-sasl-mechanism",
                "is required with a sasl_* protocol: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
            ));
        }
        if input.username.is_none() {
            problems.push(bad(
                "kafka-sasl-username",
                "is required with a sasl_* protocol",
            ));
        }
        if input.password.is_none() {
            problems.push(bad(
                "kafka-sasl-password",
                "is required with a sasl_* protocol (TALLY_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file)",
            ));
        }
    } else {
        for (set, flag) in [
            (input.mechanism.is_some(), "kafka-sasl-mechanism"),
            (input.username.is_some(), "kafka-sasl-username"),
            (input.password.is_some(), password_flag),
        ] {
            if set {
                problems.push(bad(
                    flag,
                    "needs --kafka-security-protocol sasl_ssl or sasl_plaintext",
                ));
            }
        }
    }
    problems
}

/// What is wrong with the TLS files for the protocol asked for.
fn tls_problems(input: &KafkaSecurityInput) -> Vec<ConfigError> {
    let mut problems = Vec::new();
    let tls = input.protocol.is_some_and(SecurityProtocol::uses_tls);
    for (path, flag) in [
        (&input.ca_location, "kafka-ssl-ca-location"),
        (
            &input.certificate_location,
            "kafka-ssl-certificate-location",
        ),
        (&input.key_location, "kafka-ssl-key-location"),
    ] {
        let Some(path) = path else { continue };
        if !tls {
            problems.push(bad(flag, "needs --kafka-security-protocol ssl or sasl_ssl"));
        } else if !path.is_file() {
            problems.push(bad(flag, format!("{} is not a file", path.display())));
        }
    }
    if input.certificate_location.is_some() != input.key_location.is_some() {
        problems.push(bad(
            "kafka-ssl-key-location",
            "a client certificate and its key go together",
        ));
    }
    problems
}

/// librdkafka settings tally owns, with why `-X` may not change them
/// (`isolation.level` may only be given its one safe value).
const RESERVED_KAFKA_KEYS: &[(&str, &str)] = &[
    (
        "enable.auto.commit",
        "tally commits only the offsets it stored after Redis had the batch",
    ),
    (
        "auto.commit.interval.ms",
        "tally commits its stored offsets every 100 ms, so lag trails the counts by little",
    ),
    (
        "enable.auto.offset.store",
        "tally stores offsets itself, only after Redis has the batch",
    ),
    ("group.id", "give the group with --group"),
    ("group.protocol", "give the protocol with --group-protocol"),
    (
        "group.instance.id",
        "give it with --group-instance-id, which checks it",
    ),
    ("bootstrap.servers", "give the brokers with --brokers"),
    (
        "auto.offset.reset",
        "the fences in Redis decide where each partition starts, and a group's first start reads from the earliest offset",
    ),
    (
        "isolation.level",
        "it must stay read_committed: read_uncommitted would count the events of aborted transactions",
    ),
];

/// librdkafka keys the security settings own; `-X` may set them only when the
/// dedicated setting is unset.
const SECURITY_KAFKA_KEYS: &[(&str, &str)] = &[
    ("security.protocol", "kafka-security-protocol"),
    ("sasl.mechanism", "kafka-sasl-mechanism"),
    ("sasl.mechanisms", "kafka-sasl-mechanism"),
    ("sasl.username", "kafka-sasl-username"),
    ("sasl.password", "kafka-sasl-password"),
    ("ssl.ca.location", "kafka-ssl-ca-location"),
    ("ssl.certificate.location", "kafka-ssl-certificate-location"),
    ("ssl.key.location", "kafka-ssl-key-location"),
];

/// Where the events come from.
#[derive(Debug, Clone)]
pub struct KafkaSettings {
    /// Bootstrap servers, comma separated.
    pub brokers: String,
    /// Topic of like events.
    pub topic: String,
    /// Consumer group, and the name the fences are kept under.
    pub group: String,
    /// How the group assigns partitions.
    pub group_protocol: GroupProtocol,
    /// Static membership: the member's `group.instance.id`, kept across
    /// restarts, so a restart within the session timeout gets its partitions
    /// back without a rebalance.
    pub group_instance_id: Option<String>,
    /// Topic that receives copies of malformed messages.
    pub dead_letter_topic: Option<String>,
    /// TLS and SASL.
    pub security: KafkaSecurity,
    /// Extra librdkafka settings (`-X key=value`), in the order given.
    pub extra: Vec<(String, String)>,
}

impl KafkaSettings {
    /// Every librdkafka property tally's clients get beyond the ones it owns:
    /// the security settings, then the extra ones.
    pub fn properties(&self) -> Vec<(String, String)> {
        let mut properties = self.security.properties();
        properties.extend(self.extra.iter().cloned());
        properties
    }

    /// A client configuration with the brokers and [`Self::properties`].
    pub fn client_config(&self) -> ClientConfig {
        kafka_client_config(&self.brokers, &self.properties())
    }

    /// A client configuration with the brokers and the security settings
    /// only (for clients the extra consumer settings do not suit).
    pub fn secure_client_config(&self) -> ClientConfig {
        kafka_client_config(&self.brokers, &self.security.properties())
    }

    /// The consumer's `session.timeout.ms`: as set with `-X`, or librdkafka's
    /// default (the classic protocol's; under `consumer` the broker sets it).
    pub fn session_timeout_ms(&self) -> Option<u64> {
        self.extra
            .iter()
            .rev()
            .find(|(k, _)| k == "session.timeout.ms")
            .map_or(Some(KAFKA_SESSION_TIMEOUT_MS), |(_, v)| {
                v.parse::<u64>().ok()
            })
    }

    fn problems(&self) -> Vec<ConfigError> {
        let mut problems = Vec::new();
        if self.brokers.trim().is_empty() {
            problems.push(bad("brokers", "is empty; give host:port of a Kafka broker"));
        }
        if self.topic.trim().is_empty() {
            problems.push(bad("topic", "is empty"));
        }
        if self.group.trim().is_empty() {
            problems.push(bad("group", "is empty"));
        }
        if self.dead_letter_topic.as_deref() == Some(self.topic.as_str()) {
            problems.push(bad("dead-letter-topic", "must differ from --topic"));
        }
        if let Some(id) = &self.group_instance_id
            && let Some(problem) = instance_id_problem(id)
        {
            problems.push(bad("group-instance-id", problem));
        }
        for (key, value) in &self.extra {
            let reserved = RESERVED_KAFKA_KEYS.iter().find(|(k, _)| k == key);
            if let Some((_, why)) = reserved
                && !(key == "isolation.level" && value == "read_committed")
            {
                problems.push(bad("kafka-config", format!("{key} cannot be set: {why}")));
            }
            let foreign = self.group_protocol.foreign_keys().iter();
            if let Some((_, instead)) = foreign.into_iter().find(|(k, _)| k == key) {
                problems.push(bad(
                    "kafka-config",
                    format!(
                        "{key} does not apply to --group-protocol {}: {instead}",
                        self.group_protocol
                    ),
                ));
            }
        }
        let dedicated = self.security.properties();
        for (key, flag) in SECURITY_KAFKA_KEYS {
            let owned = dedicated
                .iter()
                .any(|(k, _)| k == key || (*key == "sasl.mechanisms" && k == "sasl.mechanism"));
            if owned && self.extra.iter().any(|(k, _)| k == key) {
                problems.push(bad(
                    "kafka-config",
                    format!("{key} is also set by --{flag}; keep one"),
                ));
            }
        }
        problems
    }
}

/// What the broker would refuse in a `group.instance.id`: Kafka takes up to
/// 249 ASCII letters, digits, `.`, `_` and `-`.
fn instance_id_problem(id: &str) -> Option<&'static str> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || ".-_".contains(c);
    if id.is_empty() || id.len() > 249 || !id.chars().all(allowed) {
        Some("must be 1 to 249 ASCII letters, digits, '.', '_' or '-' (the broker refuses others)")
    } else {
        None
    }
}

/// Base librdkafka settings: the brokers, then `properties` in order.
pub fn kafka_client_config(brokers: &str, properties: &[(String, String)]) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (key, value) in properties {
        config.set(key, value);
    }
    config
}

/// Hot-post detection and routing refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotSettings {
    /// Events per second across all consumers above which a post is
    /// promoted (0 turns detection off).
    pub promote_above: u64,
    /// Buckets a hot post is promoted to.
    pub hot_buckets: u32,
    /// How often the routing registry is read again.
    pub route_refresh: Duration,
    /// The replicas a promotion waits for.
    pub registry_wait: ReplicaWait,
}

impl Default for HotSettings {
    fn default() -> Self {
        HotSettings {
            promote_above: DEFAULT_PROMOTE_ABOVE,
            hot_buckets: DEFAULT_HOT_BUCKETS,
            route_refresh: Duration::from_millis(DEFAULT_ROUTE_REFRESH_MS),
            registry_wait: ReplicaWait::default(),
        }
    }
}

/// When batches close, and how many are in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Messages after which a partition's batch closes.
    pub max_events: u64,
    /// Distinct (post, bucket) counters after which a partition's batch closes.
    pub max_keys: usize,
    /// Age at which a partition's batch closes.
    pub flush_interval: Duration,
    /// Scripts in flight to Redis at once, across partitions.
    pub max_in_flight: usize,
    /// How long shutdown waits for batches in flight.
    pub shutdown_timeout: Duration,
}

impl Default for Batching {
    fn default() -> Self {
        Batching {
            max_events: DEFAULT_BATCH_MAX_EVENTS,
            max_keys: DEFAULT_BATCH_MAX_KEYS,
            flush_interval: Duration::from_millis(DEFAULT_FLUSH_INTERVAL_MS),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            shutdown_timeout: Duration::from_secs(DEFAULT_SHUTDOWN_TIMEOUT_SECS),
        }
    }
}

/// Everything `tally run` needs.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// Where the events come from.
    pub kafka: KafkaSettings,
    /// Where the counts go.
    pub store: StoreSettings,
    /// Buckets per post: version 0's on a new prefix, the newest default epoch's on one
    /// that exists (see [`crate::domain::versions`]). `None` takes the prefix's count from
    /// its layout record, and [`DEFAULT_BUCKETS`] on a new prefix.
    pub buckets: Option<u32>,
    /// Hot-post detection.
    pub hot: HotSettings,
    /// Batch limits and concurrency.
    pub batching: Batching,
    /// Where `/metrics`, `/healthz` and `/readyz` are served, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// Testing only: send a batch's scripts one by one with this pause
    /// between them, so a crash can land between two scripts.
    pub test_script_pause: Duration,
    /// Count from the group's committed offsets over a store that holds
    /// nothing (see [`crate::pipeline::guard`]); a one-off decision, never
    /// read from a file or the environment.
    pub accept_lost_counts: bool,
    /// The Schema Registry ids a framed value may carry; empty accepts any
    /// (see [`crate::pipeline::decode`]).
    pub schema_ids: Vec<u32>,
    /// Which repeated records change no count, within how many offsets (see
    /// [`crate::pipeline::dedupe`]).
    pub dedupe: dedupe::DedupeSettings,
}

impl RunSettings {
    /// Every problem with the settings that their parts could not see alone.
    pub fn problems(&self) -> Vec<ConfigError> {
        let mut problems = Vec::new();
        let mut check = |ok: bool, flag: &'static str, problem: &str| {
            if !ok {
                problems.push(bad(flag, problem));
            }
        };
        check(
            self.buckets.is_none_or(|b| b != 0 && b <= 1 << 20),
            "buckets",
            "must be between 1 and 1048576",
        );
        // Under the consumer protocol the broker's group.consumer.session.timeout.ms
        // (45 s unless changed) is out of reach; docs/operations.md asks for the same.
        check(
            self.kafka.group_protocol == GroupProtocol::Consumer
                || self
                    .kafka
                    .session_timeout_ms()
                    .is_some_and(|ms| self.batching.shutdown_timeout.as_millis() < u128::from(ms)),
            "shutdown-timeout-secs",
            "must be below the consumer's session.timeout.ms (45 s unless set with -X): a \
             stopping consumer finishes its batches and leaves before the group could expire it",
        );
        check(
            self.hot.hot_buckets != 0 && self.hot.hot_buckets <= 1 << 16,
            "hot-buckets",
            "must be between 1 and 65536",
        );
        check(
            (10..=2_000).contains(&self.hot.route_refresh.as_millis()),
            "route-refresh-ms",
            "must be between 10 and 2000",
        );
        check(
            self.batching.max_events != 0,
            "batch-max-events",
            "must be at least 1",
        );
        check(
            self.batching.max_keys != 0 && self.batching.max_keys <= 100_000,
            "batch-max-keys",
            "must be between 1 and 100000",
        );
        check(
            !self.batching.flush_interval.is_zero(),
            "flush-interval-ms",
            "must be at least 1",
        );
        check(
            self.batching.max_in_flight != 0,
            "max-in-flight",
            "must be at least 1",
        );
        check(
            self.schema_ids
                .iter()
                .all(|&id| (1..=MAX_SCHEMA_ID).contains(&id)),
            "schema-ids",
            "each id must be between 1 and 2147483647 (Schema Registry ids are positive 32-bit integers)",
        );
        check(
            (1..=dedupe::MAX_WINDOW).contains(&self.dedupe.span),
            "dedupe-window",
            "must be between 1 and 100000000 offsets",
        );
        problems.extend(self.kafka.problems());
        problems
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn store(url: &str, password: Option<Password>) -> Result<StoreSettings, Vec<ConfigError>> {
        StoreSettings::new(url, password, DEFAULT_PREFIX, DEFAULT_SLOT_GROUPS)
    }

    #[test]
    fn store_problems_name_their_setting() {
        let flags = |r: Result<StoreSettings, Vec<ConfigError>>| -> Vec<&'static str> {
            r.unwrap_err().iter().map(|p| p.flag).collect()
        };
        assert_eq!(flags(store("localhost:6379", None)), ["redis"]);
        assert_eq!(
            flags(StoreSettings::new("redis://h/", None, "a b", 3)),
            ["prefix", "slot-groups"]
        );
        assert_eq!(
            flags(store("redis://a:b@h/", Some(Password::Value("c".into())))),
            ["redis-password"]
        );
        let missing = Some(Password::File("/nonexistent/pw".into()));
        assert_eq!(flags(store("redis://h/", missing)), ["redis-password-file"]);
        assert!(
            Password::from_sources(Some("a".into()), Some("f".into()), "redis-password-file")
                .is_err()
        );
    }

    #[test]
    fn a_password_file_is_read_once_and_joined_to_the_url() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("redis");
        std::fs::write(&path, "r3dis\n").unwrap();
        let settings = store("redis://alice@127.0.0.1:6379/", Some(Password::File(path))).unwrap();
        assert_eq!(
            settings.url().target().nodes(),
            ["redis://alice:r3dis@127.0.0.1:6379/"]
        );
        assert_eq!(settings.url().shown(), "redis://alice:***@127.0.0.1:6379/");
        assert!(!format!("{settings:?}").contains("r3dis"));
    }

    #[test]
    fn sasl_settings_become_librdkafka_properties() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kafka");
        std::fs::write(&path, "k4fka\n").unwrap();
        let security = KafkaSecurity::new(KafkaSecurityInput {
            protocol: Some(SecurityProtocol::SaslSsl),
            mechanism: Some(SaslMechanism::ScramSha512),
            username: Some("tally".into()),
            password: Some(Password::File(path)),
            ..KafkaSecurityInput::default()
        })
        .unwrap();
        let properties = security.properties();
        for (key, value) in [
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "tally"),
            ("sasl.password", "k4fka"),
        ] {
            assert!(
                properties.contains(&(key.to_string(), value.to_string())),
                "{key}"
            );
        }
        assert!(!format!("{security:?}").contains("k4fka"));
    }

    #[test]
    fn settings_that_break_exactly_once_are_refused_with_the_reason() {
        let kafka = |extra: &[(&str, &str)]| KafkaSettings {
            brokers: DEFAULT_BROKERS.into(),
            topic: DEFAULT_TOPIC.into(),
            group: DEFAULT_GROUP.into(),
            group_protocol: GroupProtocol::Classic,
            group_instance_id: None,
            dead_letter_topic: None,
            security: KafkaSecurity::default(),
            extra: extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        for (key, value, why) in [
            (
                "isolation.level",
                "read_uncommitted",
                "aborted transactions",
            ),
            ("auto.offset.reset", "latest", "the fences in Redis decide"),
            (
                "auto.offset.reset",
                "earliest",
                "the fences in Redis decide",
            ),
            (
                "enable.auto.commit",
                "false",
                "stored after Redis had the batch",
            ),
            ("auto.commit.interval.ms", "5000", "every 100 ms"),
            (
                "enable.auto.offset.store",
                "true",
                "only after Redis has the batch",
            ),
        ] {
            let problems = kafka(&[(key, value)]).problems();
            assert_eq!(problems.len(), 1, "{key}={value}");
            let line = problems[0].to_string();
            assert!(
                line.starts_with(&format!("--kafka-config: {key} cannot be set: "))
                    && line.contains(why),
                "{line}"
            );
        }
        assert!(
            kafka(&[("isolation.level", "read_committed")])
                .problems()
                .is_empty()
        );
        assert!(kafka(&[("fetch.min.bytes", "1")]).problems().is_empty());
    }

    fn under(
        protocol: GroupProtocol,
        instance: Option<&str>,
        extra: &[(&str, &str)],
    ) -> Vec<String> {
        KafkaSettings {
            brokers: DEFAULT_BROKERS.into(),
            topic: DEFAULT_TOPIC.into(),
            group: DEFAULT_GROUP.into(),
            group_protocol: protocol,
            group_instance_id: instance.map(str::to_string),
            dead_letter_topic: None,
            security: KafkaSecurity::default(),
            extra: extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
        .problems()
        .iter()
        .map(ToString::to_string)
        .collect()
    }

    #[test]
    fn settings_of_the_other_group_protocol_are_refused_one_line_each() {
        let classic_only = [
            (
                "partition.assignment.strategy",
                "range",
                "group.remote.assignor",
            ),
            (
                "session.timeout.ms",
                "6000",
                "group.consumer.session.timeout.ms",
            ),
            (
                "heartbeat.interval.ms",
                "1000",
                "group.consumer.heartbeat.interval.ms",
            ),
            ("group.protocol.type", "consumer", "owns the group's type"),
        ];
        let extra: Vec<(&str, &str)> = classic_only.iter().map(|&(k, v, _)| (k, v)).collect();
        let lines = under(GroupProtocol::Consumer, None, &extra);
        assert_eq!(lines.len(), classic_only.len(), "{lines:#?}");
        for ((key, _, instead), line) in classic_only.iter().zip(&lines) {
            assert!(
                line.starts_with(&format!(
                    "--kafka-config: {key} does not apply to --group-protocol consumer: "
                )) && line.contains(instead),
                "{line}"
            );
        }
        assert!(under(GroupProtocol::Classic, None, &extra).is_empty());

        let remote = [("group.remote.assignor", "uniform")];
        assert!(under(GroupProtocol::Consumer, None, &remote).is_empty());
        let lines = under(GroupProtocol::Classic, None, &remote);
        assert_eq!(lines.len(), 1, "{lines:#?}");
        assert!(
            lines[0].starts_with(
                "--kafka-config: group.remote.assignor does not apply to --group-protocol classic: "
            ),
            "{}",
            lines[0]
        );
    }

    #[test]
    fn the_protocol_and_the_instance_id_have_flags_of_their_own() {
        for (key, flag) in [
            ("group.protocol", "--group-protocol"),
            ("group.instance.id", "--group-instance-id"),
        ] {
            let lines = under(GroupProtocol::Classic, None, &[(key, "x")]);
            assert_eq!(lines.len(), 1, "{lines:#?}");
            assert!(
                lines[0].starts_with(&format!("--kafka-config: {key} cannot be set: "))
                    && lines[0].contains(flag),
                "{}",
                lines[0]
            );
        }
        for protocol in GroupProtocol::ALL {
            assert!(under(protocol, Some("tally-0"), &[]).is_empty());
            assert!(under(protocol, Some("pod.name_2-b"), &[]).is_empty());
            for bad in ["", "tally 0", "tally/0", &"x".repeat(250)] {
                let lines = under(protocol, Some(bad), &[]);
                assert_eq!(lines.len(), 1, "{bad:?}: {lines:#?}");
                assert!(
                    lines[0].starts_with("--group-instance-id: "),
                    "{}",
                    lines[0]
                );
            }
        }
    }

    #[test]
    fn group_protocols_are_named_as_librdkafka_names_them() {
        for protocol in GroupProtocol::ALL {
            assert_eq!(protocol.as_str().parse(), Ok(protocol));
        }
        assert_eq!(GroupProtocol::default(), GroupProtocol::Classic);
        assert!("Consumer".parse::<GroupProtocol>().is_err());
    }

    #[test]
    fn security_problems_come_together() {
        let flags: Vec<&str> = KafkaSecurity::new(KafkaSecurityInput {
            protocol: Some(SecurityProtocol::SaslPlaintext),
            ca_location: Some("/nonexistent/ca.pem".into()),
            ..KafkaSecurityInput::default()
        })
        .unwrap_err()
        .iter()
        .map(|p| p.flag)
        .collect();
        assert_eq!(
            flags,
            [
                "kafka-sasl-mechanism",
                "kafka-sasl-username",
                "kafka-sasl-password",
                "kafka-ssl-ca-location"
            ]
        );
        let plain = KafkaSecurity::new(KafkaSecurityInput {
            username: Some("u".into()),
            ..KafkaSecurityInput::default()
        })
        .unwrap_err();
        assert_eq!(plain[0].flag, "kafka-sasl-username");
    }
}
