//! Kafka: the protocols and SASL mechanisms tally speaks to the brokers,
//! whether this build of librdkafka speaks them, and what the brokers'
//! refusals and denials name.
//!
//! Kafka settings map onto librdkafka properties: `security.protocol`,
//! `sasl.mechanism`, `sasl.username`, `sasl.password`, `ssl.ca.location`,
//! `ssl.certificate.location`, `ssl.key.location`. PLAIN is built into
//! librdkafka; TLS and SCRAM need its OpenSSL support, which tally is built
//! with (the `ssl` feature of rdkafka) and checks at start-up.
//!
//! Invariant: a protocol or mechanism this build cannot speak is refused at
//! start-up ([`check_kafka_support`]), and a broker's refusal is told apart
//! from a broker that is not there, so neither reads as an outage.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::tls::TlsProblem;

/// How tally talks to the brokers (librdkafka's `security.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SecurityProtocol {
    /// No TLS, no SASL.
    #[serde(rename = "plaintext")]
    Plaintext,
    /// TLS, no SASL.
    #[serde(rename = "ssl")]
    Ssl,
    /// SASL without TLS.
    #[serde(rename = "sasl_plaintext")]
    SaslPlaintext,
    /// SASL over TLS.
    #[serde(rename = "sasl_ssl")]
    SaslSsl,
}

impl SecurityProtocol {
    /// Every protocol, in the order `--help` lists them.
    pub const ALL: [SecurityProtocol; 4] = [
        SecurityProtocol::Plaintext,
        SecurityProtocol::Ssl,
        SecurityProtocol::SaslPlaintext,
        SecurityProtocol::SaslSsl,
    ];

    /// The librdkafka value.
    pub fn as_str(self) -> &'static str {
        match self {
            SecurityProtocol::Plaintext => "plaintext",
            SecurityProtocol::Ssl => "ssl",
            SecurityProtocol::SaslPlaintext => "sasl_plaintext",
            SecurityProtocol::SaslSsl => "sasl_ssl",
        }
    }

    /// Whether SASL authenticates the connection.
    pub fn uses_sasl(self) -> bool {
        matches!(
            self,
            SecurityProtocol::SaslPlaintext | SecurityProtocol::SaslSsl
        )
    }

    /// Whether the connection is encrypted.
    pub fn uses_tls(self) -> bool {
        matches!(self, SecurityProtocol::Ssl | SecurityProtocol::SaslSsl)
    }
}

/// SASL mechanisms tally supports (librdkafka's `sasl.mechanism`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SaslMechanism {
    /// Username and password in the clear (use with `sasl_ssl`).
    #[serde(rename = "PLAIN")]
    Plain,
    /// Salted challenge-response with SHA-256.
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    /// Salted challenge-response with SHA-512.
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    /// Every mechanism, in the order `--help` lists them.
    pub const ALL: [SaslMechanism; 3] = [
        SaslMechanism::Plain,
        SaslMechanism::ScramSha256,
        SaslMechanism::ScramSha512,
    ];

    /// The librdkafka value.
    pub fn as_str(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// A protocol or mechanism name that is not one of the known ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown value '{given}'; expected one of {expected}")]
pub struct UnknownName {
    /// What was given.
    pub given: String,
    /// The names accepted, comma separated.
    pub expected: String,
}

/// The value of `ALL` whose name is `given`, ignoring case when `fold` is set.
fn by_name<T: Copy>(
    all: &[T],
    name: impl Fn(T) -> &'static str,
    given: &str,
    fold: bool,
) -> Result<T, UnknownName> {
    all.iter()
        .copied()
        .find(|&v| {
            if fold {
                name(v).eq_ignore_ascii_case(given)
            } else {
                name(v) == given
            }
        })
        .ok_or_else(|| UnknownName {
            given: given.to_string(),
            expected: all.iter().map(|&v| name(v)).collect::<Vec<_>>().join(", "),
        })
}

impl FromStr for SecurityProtocol {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        by_name(&SecurityProtocol::ALL, SecurityProtocol::as_str, s, false)
    }
}

impl FromStr for SaslMechanism {
    type Err = UnknownName;

    /// Case does not matter: `scram-sha-512` is `SCRAM-SHA-512`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        by_name(&SaslMechanism::ALL, SaslMechanism::as_str, s, true)
    }
}

/// The features librdkafka was built with (`builtin.features`).
pub fn kafka_builtin_features() -> Vec<String> {
    rdkafka::ClientConfig::new()
        .create_native_config()
        .and_then(|native| native.get("builtin.features"))
        .map(|features| features.split(',').map(str::to_string).collect())
        .unwrap_or_default()
}

/// A protocol or mechanism this build of librdkafka cannot speak.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "this build of librdkafka lacks '{missing}' (it has: {has}); rebuild tally with rdkafka's `ssl` feature"
)]
pub struct MissingFeature {
    /// The feature needed.
    pub missing: &'static str,
    /// The features it has, comma separated.
    pub has: String,
}

/// Checks this build's librdkafka supports the protocol and mechanism asked for.
pub fn check_kafka_support(
    protocol: SecurityProtocol,
    mechanism: Option<SaslMechanism>,
) -> Result<(), MissingFeature> {
    let features = kafka_builtin_features();
    let has = |f: &str| features.iter().any(|x| x == f);
    let mut needed = Vec::new();
    if protocol.uses_tls() {
        needed.push("ssl");
    }
    if protocol.uses_sasl() {
        needed.push("sasl");
    }
    match mechanism {
        Some(SaslMechanism::Plain) => needed.push("sasl_plain"),
        Some(SaslMechanism::ScramSha256 | SaslMechanism::ScramSha512) => needed.push("sasl_scram"),
        None => {}
    }
    match needed.into_iter().find(|f| !has(f)) {
        Some(missing) => Err(MissingFeature {
            missing,
            has: features.join(","),
        }),
        None => Ok(()),
    }
}

/// Why the brokers turned tally down, as librdkafka reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KafkaRefusal {
    /// The SASL login failed: user, password or mechanism.
    Credentials(String),
    /// The TLS handshake failed.
    Tls(Option<TlsProblem>, String),
}

/// The refusal a librdkafka error names, if it is one: an authentication
/// failure, or a failed TLS handshake.
pub fn kafka_refusal(code: rdkafka::types::RDKafkaErrorCode, reason: &str) -> Option<KafkaRefusal> {
    use rdkafka::types::RDKafkaErrorCode as Code;
    match code {
        Code::Authentication
        | Code::SaslAuthenticationFailed
        | Code::UnsupportedSASLMechanism
        | Code::IllegalSASLState => Some(KafkaRefusal::Credentials(reason.to_string())),
        Code::SSL => Some(KafkaRefusal::Tls(
            TlsProblem::of_text(reason),
            reason.to_string(),
        )),
        _ => None,
    }
}

/// The refusal a librdkafka log line reports, if it reports one. Log lines
/// arrive from librdkafka's threads at once, while errors wait for a poll:
/// a start-up check that blocks on metadata sees only the log.
pub fn kafka_refusal_in_log(message: &str) -> Option<KafkaRefusal> {
    // "[thrd:...]: ssl://host:port/bootstrap: <reason>": the reason follows
    // the broker's name.
    let reason = || {
        let body = match message.strip_prefix("[thrd:") {
            Some(rest) => rest.split_once("]: ").map_or(rest, |(_, body)| body),
            None => message,
        };
        let broker = body.find("://").map_or(0, |at| at + 3);
        let reason = body[broker..]
            .split_once(": ")
            .map_or(&body[broker..], |(_, reason)| reason);
        reason.to_string()
    };
    let login = ["SASL authentication error", "mechanism handshake failed"];
    let handshake = [
        "SSL handshake failed",
        "Failed to verify broker certificate",
        "in state SSL_HANDSHAKE",
        "SSL routines::",
    ];
    if login.iter().any(|marker| message.contains(marker)) {
        return Some(KafkaRefusal::Credentials(reason()));
    }
    if handshake.iter().any(|marker| message.contains(marker)) && !message.contains("Connect to ") {
        let reason = reason();
        return Some(KafkaRefusal::Tls(TlsProblem::of_text(&reason), reason));
    }
    None
}

/// A Kafka ACL the brokers did not grant the principal tally connects as:
/// what a denial names, so the operator can add exactly it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaAcl {
    /// The operation to allow: `Read` or `Write` (each implies `Describe`).
    pub operation: &'static str,
    /// `topic` or `group`.
    pub resource: &'static str,
    /// The resource's name, or with `prefixed` the start of every name it covers.
    pub name: String,
    /// Whether the ACL covers every name starting with `name`.
    pub prefixed: bool,
}

impl KafkaAcl {
    /// `operation` on the `resource` named `name`.
    pub fn on(operation: &'static str, resource: &'static str, name: &str) -> Self {
        Self {
            operation,
            resource,
            name: name.to_string(),
            prefixed: false,
        }
    }

    /// `operation` on every `resource` whose name starts with `prefix`.
    pub fn on_prefix(operation: &'static str, resource: &'static str, prefix: &str) -> Self {
        Self {
            prefixed: true,
            ..Self::on(operation, resource, prefix)
        }
    }

    /// The arguments of `kafka-acls.sh --add` that grant it.
    pub fn grant_args(&self) -> String {
        let pattern = if self.prefixed {
            " --resource-pattern-type prefixed"
        } else {
            ""
        };
        format!(
            "--operation {} --{} {}{pattern}",
            self.operation, self.resource, self.name
        )
    }
}

impl std::fmt::Display for KafkaAcl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.prefixed {
            write!(
                f,
                "{} on {}s prefixed '{}'",
                self.operation, self.resource, self.name
            )
        } else {
            write!(f, "{} on {} '{}'", self.operation, self.resource, self.name)
        }
    }
}

/// Whether `code` is the brokers' refusal of an operation on a topic or a
/// consumer group: an ACL missing, which no retry fixes.
pub fn kafka_denied(code: rdkafka::types::RDKafkaErrorCode) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        code,
        Code::TopicAuthorizationFailed | Code::GroupAuthorizationFailed
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_acl_is_named_with_the_arguments_that_grant_it() {
        let topic = KafkaAcl::on("Read", "topic", "likes");
        assert_eq!(topic.to_string(), "Read on topic 'likes'");
        assert_eq!(topic.grant_args(), "--operation Read --topic likes");
        let groups = KafkaAcl::on_prefix("Read", "group", "tally-rebuild-");
        assert_eq!(
            groups.to_string(),
            "Read on groups prefixed 'tally-rebuild-'"
        );
        assert_eq!(
            groups.grant_args(),
            "--operation Read --group tally-rebuild- --resource-pattern-type prefixed"
        );
    }

    #[test]
    fn kafka_refusals_are_told_from_other_errors() {
        use rdkafka::types::RDKafkaErrorCode as Code;
        assert!(matches!(
            kafka_refusal(Code::Authentication, "SASL SCRAM authentication failed"),
            Some(KafkaRefusal::Credentials(_))
        ));
        assert_eq!(
            kafka_refusal(
                Code::SSL,
                "Failed to verify broker certificate: unable to get local issuer certificate"
            ),
            Some(KafkaRefusal::Tls(
                Some(TlsProblem::UnknownIssuer),
                "Failed to verify broker certificate: unable to get local issuer certificate"
                    .into()
            ))
        );
        assert_eq!(
            kafka_refusal(Code::AllBrokersDown, "1/1 brokers are down"),
            None
        );
        let line = "[thrd:sasl_plaintext://h:1/bootstrap]: sasl_plaintext://h:1/bootstrap: \
                    SASL authentication error: SASL SCRAM authentication failed: broker \
                    responded with unknown-user (after 5ms)";
        assert!(matches!(
            kafka_refusal_in_log(line),
            Some(KafkaRefusal::Credentials(reason)) if reason.starts_with("SASL authentication error")
        ));
        assert_eq!(
            kafka_refusal_in_log("Connect to ipv4#127.0.0.1:1 failed"),
            None
        );
        let line = "[thrd:ssl://h:1/bootstrap]: ssl://h:1/bootstrap: Receive failed: \
                    error:0A000412:SSL routines::sslv3 alert bad certificate: SSL alert number 42 \
                    (after 1ms in state APIVERSION_QUERY)";
        assert!(matches!(
            kafka_refusal_in_log(line),
            Some(KafkaRefusal::Tls(Some(TlsProblem::ClientCertificate), _))
        ));
    }

    #[test]
    fn this_build_speaks_tls_plain_and_scram() {
        for mechanism in [
            SaslMechanism::Plain,
            SaslMechanism::ScramSha256,
            SaslMechanism::ScramSha512,
        ] {
            check_kafka_support(SecurityProtocol::SaslSsl, Some(mechanism)).unwrap();
        }
        check_kafka_support(SecurityProtocol::Ssl, None).unwrap();
    }
}
