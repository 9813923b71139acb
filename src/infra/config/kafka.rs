//! Kafka settings: where the events come from, and the librdkafka settings
//! tally owns.
//!
//! Invariant: no `-X` setting can undo what exactly-once rests on. Offsets
//! are stored and committed by tally only after Redis has the batch, the
//! fences decide where a partition starts, and only committed transactions
//! are read; a setting of the group protocol not in use, or one a dedicated
//! flag already sets, is refused by name rather than passed to librdkafka.

use rdkafka::ClientConfig;
use serde::{Deserialize, Serialize};

use super::kafka_security::KafkaSecurity;
use super::{ConfigError, bad};

/// Default Kafka bootstrap servers.
pub const DEFAULT_BROKERS: &str = "127.0.0.1:9092";
/// Default topic of like events.
pub const DEFAULT_TOPIC: &str = "likes";
/// Default consumer group.
pub const DEFAULT_GROUP: &str = "tally";

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

    pub(super) fn problems(&self) -> Vec<ConfigError> {
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

/// How every client that reads the topic fetches, set before any `-X`
/// setting (which may change them). The benchmark's baseline consumers take
/// them too, so the consume ceiling they measure is the one tally reads under.
///
/// - `fetch.wait.max.ms`: an idle fetch waits at most this long. Apache Kafka
///   answers as soon as data arrives, so there it only sets how often an idle
///   consumer asks. A broker that holds every fetch for the whole wait,
///   whatever `fetch.min.bytes` says (Tansu 0.6 does), adds up to twice this
///   to produce-to-visible latency: measured there with 8 partitions, p50/p99
///   of 160/216 ms at 100 ms, 48/64 ms at 25 ms and 25/33 ms at 10 ms.
/// - `fetch.queue.backoff.ms`: once a partition's prefetched messages pass
///   `queued.min.messages` (100,000), librdkafka waits this long before
///   fetching it again; its default, 1,000 ms, leaves a consumer that drains
///   its queue in a fraction of that idle for the rest. Reading a 3,000,000
///   event backlog of 8 partitions on Apache Kafka 4.1.1 on 2 cores, a
///   consumer that only decodes took 13.3 s at the default, 1.9–2.1 s at
///   10 ms and 4.2 s at 0 ms (twice the CPU, spinning); `tally run` took
///   19.4 s at the default and 3.0–3.8 s at 10 ms, with the same CPU and a
///   peak RSS of 105 and 140 MiB. It only applies while a consumer is behind.
pub const FETCH_SETTINGS: [(&str, &str); 2] = [
    ("fetch.wait.max.ms", "20"),
    ("fetch.queue.backoff.ms", "10"),
];

/// Sets [`FETCH_SETTINGS`] on `config`.
pub fn with_fetch_settings(config: &mut ClientConfig) -> &mut ClientConfig {
    for (key, value) in FETCH_SETTINGS {
        config.set(key, value);
    }
    config
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
