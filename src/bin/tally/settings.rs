//! Settings: every flag of the commands that count or read, with its
//! `TALLY_*` variable and its key in a `--config` file, and their conversion
//! into the library's settings.
//!
//! Invariant: each flag is declared once. [`StoreArgs`] (where the counts
//! are) is flattened by every command that touches Redis, [`BucketsArg`] by
//! every command that needs version 0's bucket count, and [`RunArgs`] (all of
//! `tally run`) embeds both; the layers (flag > variable > file > default,
//! see [`layers`]) apply to `RunArgs` as a whole. Values are parsed once,
//! into [`RunSettings`] or [`StoreSettings`], which report every problem at
//! once, each naming its flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{ArgMatches, Args, FromArgMatches};
use serde::{Deserialize, Serialize};
use tally::domain::windows::{self, WindowSettings, Windows};
use tally::infra::config::packing::{LayoutName, PackingSettings};
use tally::infra::config::{
    self as lib, Batching, ConfigError, GroupProtocol, HotSettings, KafkaSecurity,
    KafkaSecurityInput, KafkaSettings, Password, RedisTlsFiles, RunSettings, StoreSettings,
};
use tally::infra::security::{SaslMechanism, SecurityProtocol};
use tally::infra::store::ReplicaWait;
use tally::pipeline::dedupe::{DEFAULT_WINDOW, DedupeMode, DedupeSettings};

use crate::errors::Problems;

pub mod layers;
pub mod show;

pub use layers::load;

const KAFKA: &str = "Kafka";
const REDIS: &str = "Redis";
const BATCHING: &str = "Batching";
const HOT: &str = "Hot posts";
const DEDUPE: &str = "Duplicates";
const SECURITY: &str = "Security";
const WINDOWS: &str = "Trending";

/// Where the counts are: the flags every command touching Redis shares.
#[derive(Clone, Args, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", default)]
#[command(next_help_heading = REDIS)]
pub struct StoreArgs {
    /// Redis URL: redis://[user:password@]host:port[/db] for one server, or
    /// redis+cluster://[user:password@]host1:port1,host2:port2 for a cluster (rediss for TLS).
    #[arg(long, env = "TALLY_REDIS", default_value = lib::DEFAULT_REDIS)]
    pub redis: String,

    /// Redis password, joined to the user named in --redis (prefer the variable or the file).
    #[arg(long, env = "TALLY_REDIS_PASSWORD", hide_env_values = true)]
    pub redis_password: Option<String>,

    /// File holding the Redis password.
    #[arg(long, env = "TALLY_REDIS_PASSWORD_FILE", value_name = "FILE")]
    pub redis_password_file: Option<PathBuf>,

    /// PEM file of the CAs that sign the Redis servers' certificates, trusted instead of the
    /// system's (with rediss://; redis-server's tls-ca-cert-file).
    #[arg(long, env = "TALLY_REDIS_TLS_CA_CERT_FILE", value_name = "FILE")]
    pub redis_tls_ca_cert_file: Option<PathBuf>,

    /// PEM client certificate, for servers that ask for one (tls-auth-clients yes).
    #[arg(long, env = "TALLY_REDIS_TLS_CERT_FILE", value_name = "FILE")]
    pub redis_tls_cert_file: Option<PathBuf>,

    /// PEM private key of --redis-tls-cert-file.
    #[arg(long, env = "TALLY_REDIS_TLS_KEY_FILE", value_name = "FILE")]
    pub redis_tls_key_file: Option<PathBuf>,

    /// Prefix of every Redis key tally writes.
    #[arg(long, env = "TALLY_PREFIX", default_value = lib::DEFAULT_PREFIX)]
    pub prefix: String,

    /// On a cluster, the number of slot groups counters are spread over (a power of two;
    /// each batch sends at most one script per group). Fixed for the life of the data.
    #[arg(long, env = "TALLY_SLOT_GROUPS", default_value_t = lib::DEFAULT_SLOT_GROUPS)]
    pub slot_groups: u32,
}

impl Default for StoreArgs {
    fn default() -> Self {
        defaults()
    }
}

impl std::fmt::Debug for StoreArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreArgs")
            .field("redis", &tally::infra::security::redact_url(&self.redis))
            .field(
                "redis_password",
                &self.redis_password.as_ref().map(|_| "***"),
            )
            .field("redis_password_file", &self.redis_password_file)
            .field("redis_tls_ca_cert_file", &self.redis_tls_ca_cert_file)
            .field("redis_tls_cert_file", &self.redis_tls_cert_file)
            .field("redis_tls_key_file", &self.redis_tls_key_file)
            .field("prefix", &self.prefix)
            .field("slot_groups", &self.slot_groups)
            .finish()
    }
}

impl StoreArgs {
    /// The store settings these flags name, the password and TLS files read.
    pub fn settings(&self) -> Result<StoreSettings, Vec<ConfigError>> {
        let password = Password::from_sources(
            self.redis_password.clone(),
            self.redis_password_file.clone(),
            "redis-password-file",
        )
        .map_err(|problem| vec![problem])?;
        StoreSettings::new(&self.redis, password, &self.prefix, self.slot_groups)?.with_tls(
            &RedisTlsFiles {
                ca_cert: self.redis_tls_ca_cert_file.clone(),
                cert: self.redis_tls_cert_file.clone(),
                key: self.redis_tls_key_file.clone(),
            },
        )
    }
}

/// Version 0's bucket count, for the commands that write (readers take it
/// from the prefix's layout record).
#[derive(Clone, Copy, Args, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", default)]
#[command(next_help_heading = REDIS)]
pub struct BucketsArg {
    /// Buckets per post (N): bucket = xxh64(user_id) % N. Unset: the prefix's current count
    /// from its layout record, and 1 on a new prefix (hot posts are promoted to
    /// --hot-buckets). The first `tally run` on a prefix writes it into the record; a later
    /// start that sets it must name the current count, which only `tally rebucket` changes.
    #[arg(long, env = "TALLY_BUCKETS")]
    pub buckets: Option<u32>,
}

impl Default for BucketsArg {
    fn default() -> Self {
        defaults()
    }
}

/// How routing metadata waits for Redis replicas: the flags of every command
/// that publishes it (`tally run`'s hot-post detection, promote, demote,
/// rebucket).
#[derive(Clone, Args, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", default)]
#[command(next_help_heading = HOT)]
pub struct RegistryWaitArgs {
    /// Redis replicas that must acknowledge a routing version (WAIT) before it is published:
    /// `auto` (one where the primaries have replicas, none where they have none) or a number.
    #[arg(long, env = "TALLY_REGISTRY_REPLICAS", default_value = "auto")]
    pub registry_replicas: String,

    /// How long a routing version waits for --registry-replicas (milliseconds).
    #[arg(long, env = "TALLY_REGISTRY_WAIT_MS", default_value_t = lib::DEFAULT_REGISTRY_WAIT_MS)]
    pub registry_wait_ms: u64,
}

impl Default for RegistryWaitArgs {
    fn default() -> Self {
        defaults()
    }
}

impl RegistryWaitArgs {
    /// The wait these flags name.
    pub fn settings(&self) -> Result<ReplicaWait, ConfigError> {
        let replicas = self
            .registry_replicas
            .parse()
            .map_err(|problem: &str| lib::bad("registry-replicas", problem))?;
        Ok(ReplicaWait {
            replicas,
            timeout: Duration::from_millis(self.registry_wait_ms.max(1)),
        })
    }
}

/// The settings of `tally run`: each is a flag, a `TALLY_*` variable and a
/// key of the `--config` file (flag > variable > file > default; see [`load`]).
#[derive(Clone, Args, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", default)]
pub struct RunArgs {
    /// TOML file with settings (keys are the flag names without `--`).
    #[arg(long, env = "TALLY_CONFIG", value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// Kafka bootstrap servers, comma separated (host:port,...).
    #[arg(long, env = "TALLY_BROKERS", default_value = lib::DEFAULT_BROKERS, help_heading = KAFKA)]
    pub brokers: String,

    /// Topic of like events to consume.
    #[arg(long, env = "TALLY_TOPIC", default_value = lib::DEFAULT_TOPIC, help_heading = KAFKA)]
    pub topic: String,

    /// Kafka consumer group; fences are kept per group, so two groups count independently.
    #[arg(long, env = "TALLY_GROUP", default_value = lib::DEFAULT_GROUP, help_heading = KAFKA)]
    pub group: String,

    /// How the group assigns partitions: `classic` (members agree, with the cooperative-sticky
    /// assignor) or `consumer` (KIP-848: the broker assigns; needs Apache Kafka 4.0 or later,
    /// and takes session and heartbeat timing from the broker's group.consumer.* settings).
    #[arg(long, env = "TALLY_GROUP_PROTOCOL", default_value = "classic", value_parser = group_protocol_parser(), help_heading = KAFKA)]
    pub group_protocol: GroupProtocol,

    /// Static membership (group.instance.id): a name of this replica's own, kept across its
    /// restarts (a StatefulSet pod's name), so a restart within the session timeout gets its
    /// partitions back without a rebalance. Two live consumers with one name: one is fenced
    /// and exits.
    #[arg(long, env = "TALLY_GROUP_INSTANCE_ID", value_name = "NAME", help_heading = KAFKA)]
    pub group_instance_id: Option<String>,

    /// Topic that receives copies of malformed messages (with the reason in a header).
    #[arg(long, env = "TALLY_DEAD_LETTER_TOPIC", help_heading = KAFKA)]
    pub dead_letter_topic: Option<String>,

    /// Schema Registry ids a framed value may carry, comma separated (12,13); a framed
    /// value with another id is dead-lettered as schema_id_unknown. Unset: any id. Plain
    /// protobuf values carry no id and are always accepted.
    #[arg(long, env = "TALLY_SCHEMA_IDS", value_name = "ID,...", value_delimiter = ',', help_heading = KAFKA)]
    pub schema_ids: Vec<u32>,

    /// Records that repeat a like change no count: `ids` skips a record whose event_id an
    /// earlier record of the same post, user and action carries within --dedupe-window;
    /// `ids-and-actions` also skips a record that repeats the user's last action on the post
    /// (a like after a like, an unlike after an unlike), with or without ids; `off` counts
    /// every record. A replay and `tally verify` need the same mode and window.
    #[arg(long, env = "TALLY_DEDUPE", default_value = "off", value_parser = dedupe_parser(), help_heading = DEDUPE)]
    pub dedupe: DedupeMode,

    /// The dedupe window, in offsets of a partition: a record is compared with the records
    /// of at least this many offsets before it (up to an eighth more: the window moves in
    /// eighths). Each assignment re-reads the window below the fence (twice that with
    /// ids-and-actions), and each partition remembers its records in about 18 bytes each
    /// with ids, 23 with ids-and-actions (docs/design.md sizes it).
    #[arg(long, env = "TALLY_DEDUPE_WINDOW", value_name = "OFFSETS", default_value_t = DEFAULT_WINDOW, help_heading = DEDUPE)]
    pub dedupe_window: u64,

    /// Where the counts are.
    #[command(flatten)]
    #[serde(flatten)]
    pub store: StoreArgs,

    /// Version 0's buckets.
    #[command(flatten)]
    #[serde(flatten)]
    pub buckets: BucketsArg,

    /// How a new prefix keeps its counters (the first `tally run` writes it into the layout
    /// record; `tally rebuild --layout` moves a prefix to the other one): `strings`, a key
    /// per counter (INCRBY), or `packed`, fields of small hashes (HINCRBY): a fifth to a
    /// seventh of the memory for about twice the Redis CPU per write, three times on Valkey
    /// (docs/design.md). Unset: the prefix's, and strings on a new one.
    #[arg(long, env = "TALLY_LAYOUT", value_parser = layout_parser(), help_heading = REDIS)]
    pub layout: Option<LayoutName>,

    /// Fixes the number of hashes of a new packed prefix, sized for N counters (the layout
    /// of earlier releases): past about twice N, hashes outgrow Redis's compact encoding.
    /// Unset (the default), a packed prefix's hashes split as they fill, at any size.
    #[arg(long, env = "TALLY_PACKED_COUNTERS", value_name = "N", help_heading = REDIS)]
    pub packed_counters: Option<u64>,

    /// Fields per hash of a new packed prefix: on average when its hashes split as they fill
    /// (default 40, the fullest hold about twice that), or the size of each of a fixed number
    /// of hashes (default 64). Redis must keep the fullest in a listpack
    /// (hash-max-listpack-entries, 128 unless set), or `tally run` refuses to start.
    #[arg(long, env = "TALLY_PACKED_FIELDS", value_name = "N", help_heading = REDIS)]
    pub packed_fields: Option<u32>,

    /// Windows of trending counts a new prefix keeps, comma-separated (for example
    /// 1m,1h,1d): likes per post per tumbling window of event time, and the posts with the
    /// most, written with the lifetime counts by the same fenced script. The first
    /// `tally run` writes them into the layout record; a later start that sets them must
    /// name the prefix's. Unset: the prefix's, none on a new one.
    #[arg(long, env = "TALLY_WINDOWS", value_name = "SIZES", help_heading = WINDOWS)]
    pub windows: Option<String>,

    /// How long after a window's end a like still counts in it, judged by its record's
    /// Kafka timestamp (never a clock of the consumer, so a replay decides alike). A later
    /// like counts in the lifetime count only, and in tally_window_late_likes_total.
    #[arg(long, env = "TALLY_WINDOW_LATENESS", value_name = "DURATION", default_value = "5m", help_heading = WINDOWS)]
    pub window_lateness: String,

    /// How long after a window's end Redis keeps its counts (the sets expire then); at
    /// least --window-lateness.
    #[arg(long, env = "TALLY_WINDOW_RETENTION", value_name = "DURATION", default_value = "1d", help_heading = WINDOWS)]
    pub window_retention: String,

    /// Promote a post to --hot-buckets when its events across all consumers
    /// exceed this many per second (0 turns detection off; `tally promote` still works).
    #[arg(long, env = "TALLY_PROMOTE_ABOVE", default_value_t = lib::DEFAULT_PROMOTE_ABOVE, help_heading = HOT)]
    pub promote_above: u64,

    /// Buckets a hot post is promoted to (a new routing version; old keys stay summed).
    #[arg(long, env = "TALLY_HOT_BUCKETS", default_value_t = lib::DEFAULT_HOT_BUCKETS, help_heading = HOT)]
    pub hot_buckets: u32,

    /// How often the routing registry is read again (milliseconds); at most 2000, so
    /// new versions are known well before they take effect.
    #[arg(long, env = "TALLY_ROUTE_REFRESH_MS", default_value_t = lib::DEFAULT_ROUTE_REFRESH_MS, help_heading = HOT)]
    pub route_refresh_ms: u64,

    /// Replicas routing versions wait for.
    #[command(flatten)]
    #[serde(flatten)]
    pub registry_wait: RegistryWaitArgs,

    /// Close a partition's batch after this many messages. Bounds the offsets one batch
    /// covers when its posts are few; on ordinary traffic a partition that is catching up
    /// reaches --batch-max-keys first.
    #[arg(long, env = "TALLY_BATCH_MAX_EVENTS", default_value_t = lib::DEFAULT_BATCH_MAX_EVENTS, help_heading = BATCHING)]
    pub batch_max_events: u64,

    /// Close a partition's batch after this many distinct (post, bucket) counters. Only a
    /// partition that is catching up fills one; its script then holds Redis for 1-2 µs
    /// per counter (40-80 ms at 40,000), which other clients wait behind.
    #[arg(long, env = "TALLY_BATCH_MAX_KEYS", default_value_t = lib::DEFAULT_BATCH_MAX_KEYS, help_heading = BATCHING)]
    pub batch_max_keys: usize,

    /// Close a partition's batch when it is this old (milliseconds).
    #[arg(long, env = "TALLY_FLUSH_INTERVAL_MS", default_value_t = lib::DEFAULT_FLUSH_INTERVAL_MS, help_heading = BATCHING)]
    pub flush_interval_ms: u64,

    /// Scripts in flight to Redis at once, across partitions (one per partition at most).
    #[arg(long, env = "TALLY_MAX_IN_FLIGHT", default_value_t = lib::DEFAULT_MAX_IN_FLIGHT, help_heading = BATCHING)]
    pub max_in_flight: usize,

    /// On SIGTERM/SIGINT, how long to wait for in-flight batches before exiting (seconds).
    #[arg(long, env = "TALLY_SHUTDOWN_TIMEOUT_SECS", default_value_t = lib::DEFAULT_SHUTDOWN_TIMEOUT_SECS, help_heading = BATCHING)]
    pub shutdown_timeout_secs: u64,

    /// Serve /metrics, /healthz and /readyz on this address; a bare port listens on
    /// 127.0.0.1 only (give 0.0.0.0:PORT to serve other hosts).
    #[arg(long, env = "TALLY_METRICS_ADDR", value_name = "ADDR", value_parser = parse_http_addr)]
    #[serde(deserialize_with = "http_addr")]
    pub metrics_addr: Option<SocketAddr>,

    /// Kafka security.protocol.
    #[arg(long, env = "TALLY_KAFKA_SECURITY_PROTOCOL", value_parser = protocol_parser(), help_heading = SECURITY)]
    pub kafka_security_protocol: Option<SecurityProtocol>,

    /// Kafka sasl.mechanism (with a sasl_* protocol).
    #[arg(long, env = "TALLY_KAFKA_SASL_MECHANISM", value_parser = mechanism_parser(), ignore_case = true, help_heading = SECURITY)]
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

    /// Redis lost everything (no layout record, no fences) while the group has committed
    /// offsets: count from those offsets anyway, accepting that every earlier like is lost.
    /// For this one start; the alternative is `tally rebuild`.
    #[arg(long, help_heading = REDIS)]
    #[serde(skip)]
    pub accept_lost_counts: bool,

    /// This start changes the prefix's dedupe rule to its --dedupe and --dedupe-window:
    /// records from now on are judged by them. Without it, a start whose rule is not the
    /// one the prefix's writers judge by is refused. For this one start; restart the other
    /// replicas with the new rule (until then they report tally_dedupe_rule_mismatch).
    #[arg(long, help_heading = DEDUPE)]
    #[serde(skip)]
    pub dedupe_change: bool,

    /// Extra librdkafka setting, repeatable: -X fetch.max.bytes=10485760. In the
    /// file, a [kafka-config] table. Commits, offset storage, auto.offset.reset and
    /// isolation.level stay tally's; settings of the other --group-protocol are refused.
    #[arg(short = 'X', long = "kafka-config", env = "TALLY_KAFKA_CONFIG", value_name = "KEY=VALUE", value_delimiter = ',', value_parser = parse_key_value, help_heading = KAFKA)]
    #[serde(with = "kafka_table")]
    pub kafka_config: Vec<(String, String)>,
}

impl Default for RunArgs {
    /// Every setting at its default, whatever the environment holds.
    fn default() -> Self {
        defaults()
    }
}

/// A flag group with every flag at its default, whatever the environment holds.
fn defaults<T: Args + FromArgMatches>() -> T {
    let command =
        T::augment_args(clap::Command::new("tally")).mut_args(|arg| arg.env(None::<&str>));
    let matches = command
        .try_get_matches_from(["tally"])
        .expect("the defaults parse");
    T::from_arg_matches(&matches).expect("the defaults parse")
}

impl RunArgs {
    /// The settings these flags name, secrets read; every problem at once.
    pub fn settings(&self) -> Result<RunSettings, Vec<ConfigError>> {
        let mut problems = Vec::new();
        // A part that does not parse stands at its default, so the checks
        // across parts still report what else is wrong.
        let store = self.store.settings().unwrap_or_else(|p| {
            problems.extend(p);
            StoreArgs::default().settings().expect("the defaults parse")
        });
        let registry_wait = self.registry_wait.settings().unwrap_or_else(|p| {
            problems.push(p);
            ReplicaWait::default()
        });
        let security = self.kafka_security().unwrap_or_else(|p| {
            problems.extend(p);
            KafkaSecurity::default()
        });
        let settings = RunSettings {
            kafka: KafkaSettings {
                brokers: self.brokers.clone(),
                topic: self.topic.clone(),
                group: self.group.clone(),
                group_protocol: self.group_protocol,
                group_instance_id: self.group_instance_id.clone(),
                dead_letter_topic: self.dead_letter_topic.clone(),
                security,
                extra: self.kafka_config.clone(),
            },
            store,
            buckets: self.buckets.buckets,
            hot: HotSettings {
                promote_above: self.promote_above,
                hot_buckets: self.hot_buckets,
                route_refresh: Duration::from_millis(self.route_refresh_ms),
                registry_wait,
            },
            batching: Batching {
                max_events: self.batch_max_events,
                max_keys: self.batch_max_keys,
                flush_interval: Duration::from_millis(self.flush_interval_ms),
                max_in_flight: self.max_in_flight,
                shutdown_timeout: Duration::from_secs(self.shutdown_timeout_secs),
            },
            metrics_addr: self.metrics_addr,
            test_script_pause: Duration::from_millis(self.test_script_pause_ms),
            accept_lost_counts: self.accept_lost_counts,
            dedupe_change: self.dedupe_change,
            schema_ids: self.schema_ids.clone(),
            dedupe: DedupeSettings {
                mode: self.dedupe,
                span: self.dedupe_window,
            },
            packing: PackingSettings {
                layout: self.layout,
                counters: self.packed_counters,
                fields: self.packed_fields,
            },
            windows: self.windows_settings().unwrap_or_else(|p| {
                problems.push(p);
                None
            }),
        };
        problems.extend(settings.problems());
        if problems.is_empty() {
            Ok(settings)
        } else {
            Err(problems)
        }
    }

    /// The windows `--windows` names with their rules; `None` without it.
    fn windows_settings(&self) -> Result<Option<WindowSettings>, ConfigError> {
        let Some(sizes) = &self.windows else {
            return Ok(None);
        };
        let sizes = Windows::parse_sizes(sizes).map_err(|e| lib::bad("windows", e.to_string()))?;
        let lateness = windows::parse_duration(&self.window_lateness)
            .map_err(|e| lib::bad("window-lateness", e.to_string()))?;
        let retention = windows::parse_duration(&self.window_retention)
            .map_err(|e| lib::bad("window-retention", e.to_string()))?;
        let sizes = sizes.iter().map(|s| s.ms()).collect();
        WindowSettings::new(sizes, lateness, retention)
            .map(Some)
            .map_err(|e| lib::bad("windows", e))
    }

    fn kafka_security(&self) -> Result<KafkaSecurity, Vec<ConfigError>> {
        let password = Password::from_sources(
            self.kafka_sasl_password.clone(),
            self.kafka_sasl_password_file.clone(),
            "kafka-sasl-password-file",
        )
        .map_err(|problem| vec![problem])?;
        KafkaSecurity::new(KafkaSecurityInput {
            protocol: self.kafka_security_protocol,
            mechanism: self.kafka_sasl_mechanism,
            username: self.kafka_sasl_username.clone(),
            password,
            ca_location: self.kafka_ssl_ca_location.clone(),
            certificate_location: self.kafka_ssl_certificate_location.clone(),
            key_location: self.kafka_ssl_key_location.clone(),
        })
    }
}

/// The settings `matches` name with their variables and file, checked,
/// secrets read.
pub fn run_settings(matches: &ArgMatches) -> anyhow::Result<RunSettings> {
    let args = load(matches).map_err(Problems)?;
    Ok(args.settings().map_err(Problems)?)
}

/// `--group-protocol`'s values.
fn group_protocol_parser() -> impl TypedValueParser<Value = GroupProtocol> {
    PossibleValuesParser::new(GroupProtocol::ALL.map(GroupProtocol::as_str))
        .map(|name| name.parse().expect("a listed protocol"))
}

/// `--layout`'s values.
fn layout_parser() -> impl TypedValueParser<Value = LayoutName> {
    PossibleValuesParser::new(LayoutName::ALL.map(LayoutName::as_str))
        .map(|name| name.parse().expect("a listed layout"))
}

/// `--dedupe`'s values.
fn dedupe_parser() -> impl TypedValueParser<Value = DedupeMode> {
    PossibleValuesParser::new(DedupeMode::ALL.map(DedupeMode::as_str))
        .map(|name| name.parse().expect("a listed mode"))
}

/// `--kafka-security-protocol`'s values.
fn protocol_parser() -> impl TypedValueParser<Value = SecurityProtocol> {
    PossibleValuesParser::new(SecurityProtocol::ALL.map(SecurityProtocol::as_str))
        .map(|name| name.parse().expect("a listed protocol"))
}

/// `--kafka-sasl-mechanism`'s values.
fn mechanism_parser() -> impl TypedValueParser<Value = SaslMechanism> {
    PossibleValuesParser::new(SaslMechanism::ALL.map(SaslMechanism::as_str))
        .map(|name| name.parse().expect("a listed mechanism"))
}

/// Parses an HTTP listen address: `HOST:PORT`, or a bare `PORT` (or `:PORT`)
/// on loopback.
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

/// Parses a repeatable `KEY=VALUE` flag.
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("expected key=value, got '{s}'")),
    }
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

/// Parses `args` (without the program name) as one flattened flag group; for tests.
#[cfg(test)]
pub fn parse_flags<T: clap::Args + clap::FromArgMatches>(args: &[&str]) -> Result<T, clap::Error> {
    let command = T::augment_args(clap::Command::new("tally"));
    let matches =
        command.try_get_matches_from(std::iter::once("tally").chain(args.iter().copied()))?;
    T::from_arg_matches(&matches)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> RunArgs {
        parse_flags(args).unwrap()
    }

    fn flags(args: &[&str]) -> Vec<&'static str> {
        match parse(args).settings() {
            Ok(_) => Vec::new(),
            Err(problems) => problems.iter().map(|p| p.flag).collect(),
        }
    }

    #[test]
    fn defaults_are_valid() {
        let args = parse(&[]);
        assert_eq!(args.buckets.buckets, None);
        assert_eq!(args.store.prefix, "tally");
        let settings = args.settings().unwrap();
        assert_eq!(settings.store.url().shown(), "redis://127.0.0.1:6379/");
    }

    #[test]
    fn passthrough_and_problems_name_the_flag() {
        let args = parse(&["-X", "session.timeout.ms=6000", "-X", "fetch.min.bytes=1"]);
        assert_eq!(args.kafka_config.len(), 2);
        assert_eq!(flags(&["--buckets", "0"]), ["buckets"]);
        assert_eq!(flags(&["--redis", "localhost:6379"]), ["redis"]);
        assert_eq!(flags(&["-X", "enable.auto.commit=true"]), ["kafka-config"]);
        assert!(parse_flags::<RunArgs>(&["-X", "nonsense"]).is_err());
    }

    #[test]
    fn every_setting_has_its_variable() {
        let command = RunArgs::augment_args(clap::Command::new("tally"));
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            // A decision for one start must not linger in a variable.
            if id == "accept_lost_counts" || id == "dedupe_change" {
                assert_eq!(env, None, "--{id} is a flag only");
                continue;
            }
            assert_eq!(
                env,
                Some(format!("TALLY_{}", id.to_uppercase())),
                "--{id} lacks its TALLY_* variable"
            );
        }
    }

    #[test]
    fn shutdown_must_end_within_the_session_timeout() {
        assert_eq!(
            flags(&["-X", "session.timeout.ms=6000"]),
            ["shutdown-timeout-secs"]
        );
        let fine = &[
            "--shutdown-timeout-secs",
            "5",
            "-X",
            "session.timeout.ms=6000",
        ];
        assert!(flags(fine).is_empty());
        assert!(flags(&[]).is_empty(), "defaults: 10 s within 45 s");
    }

    #[test]
    fn the_group_protocol_decides_which_kafka_settings_apply() {
        let consumer = ["--group-protocol", "consumer"];
        let settings = parse(&consumer).settings().unwrap();
        assert_eq!(settings.kafka.group_protocol, GroupProtocol::Consumer);
        assert_eq!(
            parse(&[]).settings().unwrap().kafka.group_protocol,
            GroupProtocol::Classic
        );
        let with = |extra: &[&str]| {
            let args: Vec<&str> = consumer.iter().chain(extra).copied().collect();
            flags(&args)
        };
        assert_eq!(
            with(&[
                "-X",
                "session.timeout.ms=6000",
                "-X",
                "heartbeat.interval.ms=1000"
            ]),
            ["kafka-config", "kafka-config"]
        );
        // The broker's session timeout is out of tally's reach.
        assert!(with(&["--shutdown-timeout-secs", "60"]).is_empty());
        assert_eq!(
            flags(&["--shutdown-timeout-secs", "60"]),
            ["shutdown-timeout-secs"]
        );
        assert_eq!(
            flags(&["-X", "group.remote.assignor=uniform"]),
            ["kafka-config"]
        );
        assert!(parse_flags::<RunArgs>(&["--group-protocol", "eager"]).is_err());
    }

    #[test]
    fn a_static_member_names_itself_once() {
        let settings = parse(&["--group-instance-id", "tally-0"])
            .settings()
            .unwrap();
        assert_eq!(settings.kafka.group_instance_id.as_deref(), Some("tally-0"));
        assert_eq!(
            flags(&["--group-instance-id", "tally 0"]),
            ["group-instance-id"]
        );
        assert_eq!(
            flags(&["-X", "group.instance.id=tally-0"]),
            ["kafka-config"]
        );
    }

    #[test]
    fn sasl_settings_become_librdkafka_properties() {
        let settings = parse(&[
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
        ])
        .settings()
        .unwrap();
        let properties = settings.kafka.properties();
        for (key, value) in [
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "tally"),
            ("sasl.password", "pw"),
            ("session.timeout.ms", "6000"),
        ] {
            assert!(
                properties.contains(&(key.to_string(), value.to_string())),
                "{key}"
            );
        }
        assert!(
            !settings
                .kafka
                .security
                .properties()
                .iter()
                .any(|(k, _)| k == "session.timeout.ms")
        );
    }

    #[test]
    fn every_problem_gets_its_own_line() {
        let problems = flags(&[
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
            "enable.auto.commit=true",
        ]);
        assert_eq!(
            problems,
            [
                "redis-password",
                "kafka-sasl-mechanism",
                "kafka-sasl-username",
                "kafka-sasl-password",
                "kafka-ssl-ca-location",
                "buckets",
                "kafka-config",
            ]
        );
        let problems = flags(&[
            "--buckets",
            "0",
            "-X",
            "enable.auto.commit=true",
            "--kafka-security-protocol",
            "ssl",
            "-X",
            "security.protocol=ssl",
        ]);
        assert_eq!(problems, ["buckets", "kafka-config", "kafka-config"]);
        assert_eq!(
            flags(&["--kafka-sasl-username", "u"]),
            ["kafka-sasl-username"]
        );
    }

    #[test]
    fn password_files_are_read_once_and_joined_to_the_url() {
        let dir = tempfile::tempdir().unwrap();
        let (redis_pw, kafka_pw) = (dir.path().join("redis"), dir.path().join("kafka"));
        std::fs::write(&redis_pw, "r3dis\n").unwrap();
        std::fs::write(&kafka_pw, "k4fka\n").unwrap();
        let settings = parse(&[
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
        ])
        .settings()
        .unwrap();
        assert_eq!(
            settings.store.url().target().nodes(),
            ["redis://alice:r3dis@127.0.0.1:6379/"]
        );
        assert!(
            settings
                .kafka
                .security
                .properties()
                .contains(&("sasl.password".into(), "k4fka".into()))
        );
        assert_eq!(
            flags(&["--redis-password-file", "/nonexistent/pw"]),
            ["redis-password-file"]
        );
    }

    #[test]
    fn schema_ids_are_a_list_of_positive_ids() {
        assert!(parse(&[]).settings().unwrap().schema_ids.is_empty());
        let settings = parse(&["--schema-ids", "12,13", "--schema-ids", "20"])
            .settings()
            .unwrap();
        assert_eq!(settings.schema_ids, [12, 13, 20]);
        assert_eq!(flags(&["--schema-ids", "0"]), ["schema-ids"]);
        assert_eq!(flags(&["--schema-ids", "2147483648"]), ["schema-ids"]);
        assert!(flags(&["--schema-ids", "2147483647"]).is_empty());
        assert!(parse_flags::<RunArgs>(&["--schema-ids", "twelve"]).is_err());
        assert!(parse_flags::<RunArgs>(&["--schema-ids", "-1"]).is_err());
    }

    #[test]
    fn a_bare_metrics_port_listens_on_loopback() {
        let args = parse(&["--metrics-addr", "9464"]);
        assert_eq!(args.metrics_addr, Some(([127, 0, 0, 1], 9464).into()));
        assert_eq!(parse_http_addr(":1").unwrap(), ([127, 0, 0, 1], 1).into());
        assert_eq!(
            parse_http_addr("0.0.0.0:2").unwrap(),
            ([0, 0, 0, 0], 2).into()
        );
        assert!(parse_http_addr("localhost").is_err());
    }
}
