//! Security: TLS and SASL towards Kafka, AUTH and TLS towards Redis.
//!
//! Invariant: a secret (a SASL password, a Redis password) is read once at
//! start-up, from the environment or a file, and leaves the process only
//! towards the broker or Redis. Every place that shows a setting (log lines,
//! errors, `tally config print`, `Debug`) goes through [`redact_url`] or
//! [`is_secret_key`], so no secret is ever printed.
//!
//! Kafka settings map onto librdkafka properties: `security.protocol`,
//! `sasl.mechanism`, `sasl.username`, `sasl.password`, `ssl.ca.location`,
//! `ssl.certificate.location`, `ssl.key.location`. PLAIN is built into
//! librdkafka; TLS and SCRAM need its OpenSSL support, which tally is built
//! with (the `ssl` feature of rdkafka) and checks at start-up.

use std::path::Path;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// How tally talks to the brokers (librdkafka's `security.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum SecurityProtocol {
    /// No TLS, no SASL.
    #[value(name = "plaintext")]
    #[serde(rename = "plaintext")]
    Plaintext,
    /// TLS, no SASL.
    #[value(name = "ssl")]
    #[serde(rename = "ssl")]
    Ssl,
    /// SASL without TLS.
    #[value(name = "sasl_plaintext")]
    #[serde(rename = "sasl_plaintext")]
    SaslPlaintext,
    /// SASL over TLS.
    #[value(name = "sasl_ssl")]
    #[serde(rename = "sasl_ssl")]
    SaslSsl,
}

impl SecurityProtocol {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum SaslMechanism {
    /// Username and password in the clear (use with `sasl_ssl`).
    #[value(name = "PLAIN")]
    #[serde(rename = "PLAIN")]
    Plain,
    /// Salted challenge-response with SHA-256.
    #[value(name = "SCRAM-SHA-256")]
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    /// Salted challenge-response with SHA-512.
    #[value(name = "SCRAM-SHA-512")]
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    /// The librdkafka value.
    pub fn as_str(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// Whether a librdkafka property holds a secret (`sasl.password`,
/// `ssl.key.password`, `sasl.oauthbearer.client.secret`, ...).
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.contains("password") || key.contains("secret")
}

/// Reads a secret from a file: the whole content, without the trailing newline
/// most editors and `kubectl create secret --from-file` leave.
pub fn read_secret_file(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let secret = text.trim_end_matches(['\r', '\n']);
    if secret.is_empty() {
        return Err(format!("{} is empty", path.display()));
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
pub fn redact_url(url: &str) -> String {
    match user_info(url) {
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
pub fn with_password(url: &str, password: &str) -> Result<String, String> {
    if url_has_password(url) {
        return Err("the URL already holds a password; give it in one place only".into());
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

/// The line `tally run` prints for the error that stopped it: a Redis that
/// refuses the credentials says so, rather than suggesting it is down.
pub fn error_line(error: &crate::run::RunError) -> String {
    use crate::apply::ConnectError;
    use crate::run::RunError;
    match error {
        RunError::Redis(ConnectError::Unreachable { url, source }) if refused(source) => format!(
            "Redis at {url} refused the credentials: {source} (check the user and password in --redis, TALLY_REDIS_PASSWORD or --redis-password-file)"
        ),
        other => other.to_string(),
    }
}

/// Whether Redis turned the connection down for its credentials.
fn refused(error: &redis::RedisError) -> bool {
    error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(error.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// The features librdkafka was built with (`builtin.features`).
pub fn kafka_builtin_features() -> Vec<String> {
    rdkafka::ClientConfig::new()
        .create_native_config()
        .and_then(|native| native.get("builtin.features"))
        .map(|features| features.split(',').map(str::to_string).collect())
        .unwrap_or_default()
}

/// Checks this build's librdkafka supports the protocol and mechanism asked for.
pub fn check_kafka_support(
    protocol: SecurityProtocol,
    mechanism: Option<SaslMechanism>,
) -> Result<(), String> {
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
    match needed.iter().find(|f| !has(f)) {
        Some(missing) => Err(format!(
            "this build of librdkafka lacks '{missing}' (it has: {}); rebuild tally with rdkafka's `ssl` feature",
            features.join(",")
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
