//! Security: TLS and SASL towards Kafka, AUTH and TLS towards Redis.
//!
//! Invariant: a secret (a SASL password, a Redis password, a TLS private
//! key) is read once at start-up, from the environment or a file, and leaves
//! the process only towards the broker or Redis. Every place that shows a
//! setting (log lines, errors, `tally config print`, `Debug`) goes through
//! [`redact_url`] or [`is_secret_key`], so no secret is ever printed.
//!
//! A refused handshake is named, not guessed at: [`tls_problem`] tells an
//! unknown issuer from an expired certificate, a name mismatch and a missing
//! client certificate, and [`kafka_refusal`] tells a broker that turned the
//! SASL login or the TLS handshake down from one that is not there. A broker
//! that let tally in but denies it a topic or a group names the ACL to add
//! ([`KafkaAcl`], [`kafka_denied`]).
//!
//! Kafka settings map onto librdkafka properties: `security.protocol`,
//! `sasl.mechanism`, `sasl.username`, `sasl.password`, `ssl.ca.location`,
//! `ssl.certificate.location`, `ssl.key.location`. PLAIN is built into
//! librdkafka; TLS and SCRAM need its OpenSSL support, which tally is built
//! with (the `ssl` feature of rdkafka) and checks at start-up.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

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

/// Whether a librdkafka property holds a secret (`sasl.password`,
/// `ssl.key.password`, `sasl.oauthbearer.client.secret`, ...).
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.contains("password") || key.contains("secret")
}

/// A secret file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds nothing but line ends.
    #[error("{} is empty", .0.display())]
    Empty(PathBuf),
}

/// Reads a secret from a file: the whole content, without the trailing newline
/// most editors and `kubectl create secret --from-file` leave.
pub fn read_secret_file(path: &Path) -> Result<String, SecretError> {
    let text = std::fs::read_to_string(path).map_err(|source| SecretError::Unreadable {
        path: path.to_path_buf(),
        source,
    })?;
    let secret = text.trim_end_matches(['\r', '\n']);
    if secret.is_empty() {
        return Err(SecretError::Empty(path.to_path_buf()));
    }
    Ok(secret.to_string())
}

/// The user-info part of a Redis URL (`user:password` in
/// `redis://user:password@host`), and where it ends.
fn user_info(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://")? + 3;
    let at = url[start..].rfind('@')? + start;
    Some((start, at))
}

/// The URL with its password (if any) replaced by `***`; the user name stays.
/// A URL typed without its `://` (`user:password@host`,
/// `redis:/user:password@host`) is read from its start, so that the error
/// that refuses it masks the password all the same.
pub fn redact_url(url: &str) -> String {
    let typed_without_scheme = || url.rfind('@').map(|at| (0, at));
    match user_info(url).or_else(typed_without_scheme) {
        Some((start, at)) => match url[start..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &url[..start], &url[at..]),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// Whether a Redis URL carries a password.
pub fn url_has_password(url: &str) -> bool {
    user_info(url).is_some_and(|(start, at)| url[start..at].contains(':'))
}

/// Puts `password` into a Redis URL (percent-encoded), keeping its user name:
/// `redis://alice@host` becomes `redis://alice:<password>@host`, and
/// `redis://host` becomes `redis://:<password>@host` (the default user).
pub fn with_password(url: &str, password: &str) -> Result<String, &'static str> {
    if url_has_password(url) {
        return Err("the URL already holds a password; give it in one place only");
    }
    let encoded = percent_encode(password);
    Ok(match user_info(url) {
        Some((start, at)) => format!(
            "{}{}:{encoded}{}",
            &url[..start],
            &url[start..at],
            &url[at..]
        ),
        None => {
            let start = url.find("://").ok_or("not a URL")? + 3;
            format!("{}:{encoded}@{}", &url[..start], &url[start..])
        }
    })
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
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

/// The TLS material for Redis beyond the system's roots: a private CA, and a
/// client certificate with its key for mutual TLS; PEM, read once.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTls {
    root_cert: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("root_cert", &self.root_cert.as_ref().map(|_| "<pem>"))
            .field("client", &self.client.as_ref().map(|_| "<pem, key ***>"))
            .finish()
    }
}

impl RedisTls {
    /// From PEM bytes: the CAs to trust instead of the system's, and a
    /// client certificate with its private key.
    pub fn new(root_cert: Option<Vec<u8>>, client: Option<(Vec<u8>, Vec<u8>)>) -> RedisTls {
        RedisTls { root_cert, client }
    }

    /// The certificates in the form the Redis client takes.
    pub fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.root_cert.clone(),
        }
    }
}

/// What is wrong with a PEM file of certificates: `None` when it holds at
/// least one certificate and nothing that fails to parse.
pub fn pem_certificates_problem(pem: &[u8]) -> Option<String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut found = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        if let Err(error) = cert {
            return Some(format!("not a PEM certificate: {error}"));
        }
        found += 1;
    }
    (found == 0).then(|| "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_string())
}

/// What is wrong with a PEM private key file, if anything.
pub fn pem_key_problem(pem: &[u8]) -> Option<String> {
    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject;
    PrivateKeyDer::from_pem_slice(pem)
        .err()
        .map(|error| format!("holds no PEM private key: {error}"))
}

/// Why a TLS handshake failed, as this side of it can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsProblem {
    /// The server's certificate is signed by no CA this side trusts.
    UnknownIssuer,
    /// The server's certificate has expired.
    Expired,
    /// The server's certificate is not valid yet.
    NotYetValid,
    /// The server's certificate does not name the host connected to.
    NameMismatch,
    /// The server wants a client certificate, or refused the one given.
    ClientCertificate,
    /// The other end does not speak TLS.
    NotTls,
}

impl TlsProblem {
    /// What the problem is, in words.
    pub fn describe(self) -> &'static str {
        match self {
            TlsProblem::UnknownIssuer => "the server's certificate is signed by no trusted CA",
            TlsProblem::Expired => "the server's certificate has expired",
            TlsProblem::NotYetValid => "the server's certificate is not valid yet",
            TlsProblem::NameMismatch => {
                "the server's certificate is not valid for the host name connected to"
            }
            TlsProblem::ClientCertificate => "the server asks for a client certificate it trusts",
            TlsProblem::NotTls => "the server does not speak TLS on that port",
        }
    }

    /// The problem a rustls error names, if it names one.
    fn of_rustls(error: &rustls::Error) -> Option<TlsProblem> {
        use rustls::{AlertDescription as Alert, CertificateError as Cert};
        match error {
            rustls::Error::InvalidCertificate(cert) => match cert {
                Cert::UnknownIssuer | Cert::BadSignature => Some(TlsProblem::UnknownIssuer),
                Cert::Expired | Cert::ExpiredContext { .. } => Some(TlsProblem::Expired),
                Cert::NotValidYet | Cert::NotValidYetContext { .. } => {
                    Some(TlsProblem::NotYetValid)
                }
                Cert::NotValidForName | Cert::NotValidForNameContext { .. } => {
                    Some(TlsProblem::NameMismatch)
                }
                _ => None,
            },
            rustls::Error::AlertReceived(
                Alert::CertificateRequired
                | Alert::BadCertificate
                | Alert::UnknownCA
                | Alert::CertificateUnknown
                | Alert::HandshakeFailure,
            ) => Some(TlsProblem::ClientCertificate),
            rustls::Error::InvalidMessage(_) => Some(TlsProblem::NotTls),
            _ => None,
        }
    }

    /// The problem an error message names, for errors that reach tally as
    /// text only (the cluster client's, librdkafka's).
    fn of_text(text: &str) -> Option<TlsProblem> {
        const WORDS: &[(&str, TlsProblem)] = &[
            ("UnknownIssuer", TlsProblem::UnknownIssuer),
            (
                "unable to get local issuer certificate",
                TlsProblem::UnknownIssuer,
            ),
            ("self-signed certificate", TlsProblem::UnknownIssuer),
            ("certificate expired", TlsProblem::Expired),
            ("certificate has expired", TlsProblem::Expired),
            ("Expired", TlsProblem::Expired),
            ("not valid yet", TlsProblem::NotYetValid),
            ("NotValidYet", TlsProblem::NotYetValid),
            ("certificate not valid for name", TlsProblem::NameMismatch),
            ("NotValidForName", TlsProblem::NameMismatch),
            ("Hostname mismatch", TlsProblem::NameMismatch),
            ("CertificateRequired", TlsProblem::ClientCertificate),
            ("BadCertificate", TlsProblem::ClientCertificate),
            (
                "client SSL authentication might be required",
                TlsProblem::ClientCertificate,
            ),
            ("alert certificate required", TlsProblem::ClientCertificate),
            // Apache Kafka's answer to a client without a certificate it trusts.
            ("alert bad certificate", TlsProblem::ClientCertificate),
            ("received corrupt message", TlsProblem::NotTls),
        ];
        WORDS
            .iter()
            .find(|(word, _)| text.contains(word))
            .map(|&(_, problem)| problem)
    }
}

/// The TLS problem behind `error`: a rustls error anywhere in its chain of
/// sources (also inside an `io::Error`), or failing that, words in its text.
pub fn tls_problem(error: &(dyn std::error::Error + 'static)) -> Option<TlsProblem> {
    let mut next = Some(error);
    while let Some(current) = next {
        let inner = current
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        if let Some(found) = current
            .downcast_ref::<rustls::Error>()
            .or(inner)
            .and_then(TlsProblem::of_rustls)
        {
            return Some(found);
        }
        next = current.source();
    }
    TlsProblem::of_text(&error.to_string())
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
    fn tls_problems_are_named_from_rustls_errors_and_from_text() {
        use rustls::CertificateError as Cert;
        let wrapped = |cert: Cert| {
            let io = std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                rustls::Error::InvalidCertificate(cert),
            );
            tls_problem(&redis::RedisError::from(io))
        };
        assert_eq!(
            wrapped(Cert::UnknownIssuer),
            Some(TlsProblem::UnknownIssuer)
        );
        assert_eq!(wrapped(Cert::Expired), Some(TlsProblem::Expired));
        assert_eq!(
            wrapped(Cert::NotValidForName),
            Some(TlsProblem::NameMismatch)
        );
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(tls_problem(&redis::RedisError::from(refused)), None);
        assert_eq!(
            TlsProblem::of_text("Failed to verify broker certificate: certificate has expired"),
            Some(TlsProblem::Expired)
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
    fn pem_files_are_checked() {
        assert!(pem_certificates_problem(b"not pem").is_some());
        assert!(pem_key_problem(b"").is_some());
    }

    #[test]
    fn passwords_are_redacted_and_user_names_kept() {
        assert_eq!(
            redact_url("redis://alice:s3cret@h:6379/0"),
            "redis://alice:***@h:6379/0"
        );
        assert_eq!(redact_url("rediss://:pw@h"), "rediss://:***@h");
        assert_eq!(redact_url("redis://h:1/"), "redis://h:1/");
        assert_eq!(redact_url("redis://alice@h:1/"), "redis://alice@h:1/");
        assert_eq!(
            redact_url("redis+cluster://u:p@a:1,b:2"),
            "redis+cluster://u:***@a:1,b:2"
        );
        assert_eq!(redact_url("alice:s3cret@h:6379"), "alice:***@h:6379");
        assert_eq!(redact_url("redis:/alice:s3cret@h"), "redis:***@h");
        assert!(is_secret_key("sasl.password"));
        assert!(is_secret_key("ssl.key.password"));
        assert!(is_secret_key("sasl.oauthbearer.client.secret"));
        assert!(!is_secret_key("sasl.username"));
    }

    #[test]
    fn a_password_joins_the_url_encoded() {
        assert_eq!(
            with_password("redis://alice@h:6379/", "p@ss:w/rd").unwrap(),
            "redis://alice:p%40ss%3Aw%2Frd@h:6379/"
        );
        assert_eq!(
            with_password("rediss://h:6379", "pw").unwrap(),
            "rediss://:pw@h:6379"
        );
        assert_eq!(
            with_password("redis+cluster://bob@a:1,b:2", "pw").unwrap(),
            "redis+cluster://bob:pw@a:1,b:2"
        );
        assert!(with_password("redis://a:b@h", "pw").is_err());
        let url = with_password("redis://alice@h:1/", "x y").unwrap();
        let info = redis::IntoConnectionInfo::into_connection_info(url.as_str()).unwrap();
        assert_eq!(info.redis_settings().password(), Some("x y"));
        assert_eq!(info.redis_settings().username(), Some("alice"));
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

    #[test]
    fn secret_files_lose_their_trailing_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        std::fs::write(&path, "hunter2\n").unwrap();
        assert_eq!(read_secret_file(&path).unwrap(), "hunter2");
        std::fs::write(&path, "\n").unwrap();
        assert!(read_secret_file(&path).is_err());
        assert!(read_secret_file(&dir.path().join("missing")).is_err());
    }
}
