//! Secrets: the security settings as librdkafka properties and an
//! authenticated Redis URL, and their checks.
//!
//! Invariant: passwords enter the configuration here, once, at start-up (from
//! the environment, a flag or a file); everything that shows a configuration
//! redacts them (see [`crate::security`]).

use std::path::PathBuf;

use super::{ConfigError, RunConfig, bad};
use crate::security::SecurityProtocol;

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

impl RunConfig {
    /// The librdkafka properties of the security settings. Secrets from files
    /// are in once [`RunConfig::resolve_secrets`] ran ([`load`] runs it).
    pub fn kafka_security(&self) -> Vec<(String, String)> {
        let path = |p: &PathBuf| p.display().to_string();
        [
            (
                "security.protocol",
                self.kafka_security_protocol.map(|p| p.as_str().to_string()),
            ),
            (
                "sasl.mechanism",
                self.kafka_sasl_mechanism.map(|m| m.as_str().to_string()),
            ),
            ("sasl.username", self.kafka_sasl_username.clone()),
            ("sasl.password", self.kafka_sasl_password.clone()),
            (
                "ssl.ca.location",
                self.kafka_ssl_ca_location.as_ref().map(path),
            ),
            (
                "ssl.certificate.location",
                self.kafka_ssl_certificate_location.as_ref().map(path),
            ),
            (
                "ssl.key.location",
                self.kafka_ssl_key_location.as_ref().map(path),
            ),
        ]
        .into_iter()
        .filter_map(|(key, value)| Some((key.to_string(), value?)))
        .collect()
    }

    /// Every librdkafka property tally's clients get beyond the ones it owns:
    /// the security settings, then `-X`.
    pub fn kafka_settings(&self) -> Vec<(String, String)> {
        let mut settings = self.kafka_security();
        settings.extend(self.kafka_config.iter().cloned());
        settings
    }

    /// Reads the password files and puts the Redis password into the Redis
    /// URL, so every connection authenticates. Run once, after [`Self::problems`].
    pub fn resolve_secrets(mut self) -> Result<RunConfig, ConfigError> {
        if let Some(path) = &self.kafka_sasl_password_file {
            let secret = crate::security::read_secret_file(path)
                .map_err(|problem| bad("kafka-sasl-password-file", problem))?;
            self.kafka_sasl_password = Some(secret);
        }
        if let Some(path) = &self.redis_password_file {
            let secret = crate::security::read_secret_file(path)
                .map_err(|problem| bad("redis-password-file", problem))?;
            self.redis_password = Some(secret);
        }
        if let Some(password) = self.redis_password.take() {
            self.redis = crate::security::with_password(&self.redis, &password)
                .map_err(|problem| bad("redis-password", problem))?;
            self.redis_password_file = None;
        }
        Ok(self)
    }

    pub(super) fn security_problems(&self) -> Vec<ConfigError> {
        use crate::security::{check_kafka_support, url_has_password};
        let mut problems = Vec::new();
        let protocol = self.kafka_security_protocol;
        let sasl = protocol.is_some_and(SecurityProtocol::uses_sasl);
        let tls = protocol.is_some_and(SecurityProtocol::uses_tls);
        if sasl {
            if self.kafka_sasl_mechanism.is_none() {
                problems.push(bad(
                    "kafka-sasl-mechanism",
                    "is required with a sasl_* protocol: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
                ));
            }
            if self.kafka_sasl_username.is_none() {
                problems.push(bad(
                    "kafka-sasl-username",
                    "is required with a sasl_* protocol",
                ));
            }
            if self.kafka_sasl_password.is_none() && self.kafka_sasl_password_file.is_none() {
                problems.push(bad(
                    "kafka-sasl-password",
                    "is required with a sasl_* protocol (TALLY_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file)",
                ));
            }
        } else {
            for (set, flag) in [
                (self.kafka_sasl_mechanism.is_some(), "kafka-sasl-mechanism"),
                (self.kafka_sasl_username.is_some(), "kafka-sasl-username"),
                (self.kafka_sasl_password.is_some(), "kafka-sasl-password"),
                (
                    self.kafka_sasl_password_file.is_some(),
                    "kafka-sasl-password-file",
                ),
            ] {
                if set {
                    problems.push(bad(
                        flag,
                        "needs --kafka-security-protocol sasl_ssl or sasl_plaintext",
                    ));
                }
            }
        }
        if self.kafka_sasl_password.is_some() && self.kafka_sasl_password_file.is_some() {
            problems.push(bad(
                "kafka-sasl-password-file",
                "give the password or its file, not both",
            ));
        }
        for (path, flag) in [
            (&self.kafka_ssl_ca_location, "kafka-ssl-ca-location"),
            (
                &self.kafka_ssl_certificate_location,
                "kafka-ssl-certificate-location",
            ),
            (&self.kafka_ssl_key_location, "kafka-ssl-key-location"),
        ] {
            let Some(path) = path else { continue };
            if !tls {
                problems.push(bad(flag, "needs --kafka-security-protocol ssl or sasl_ssl"));
            } else if !path.is_file() {
                problems.push(bad(flag, format!("{} is not a file", path.display())));
            }
        }
        if self.kafka_ssl_certificate_location.is_some() != self.kafka_ssl_key_location.is_some() {
            problems.push(bad(
                "kafka-ssl-key-location",
                "a client certificate and its key go together",
            ));
        }
        for (key, flag) in SECURITY_KAFKA_KEYS {
            let dedicated = self
                .kafka_security()
                .iter()
                .any(|(k, _)| k == key || (*key == "sasl.mechanisms" && k == "sasl.mechanism"));
            if dedicated && self.kafka_config.iter().any(|(k, _)| k == key) {
                problems.push(bad(
                    "kafka-config",
                    format!("{key} is also set by --{flag}; keep one"),
                ));
            }
        }
        if let Some(protocol) = protocol
            && let Err(problem) = check_kafka_support(protocol, self.kafka_sasl_mechanism)
        {
            problems.push(bad("kafka-security-protocol", problem));
        }
        if self.redis_password.is_some() && self.redis_password_file.is_some() {
            problems.push(bad(
                "redis-password-file",
                "give the password or its file, not both",
            ));
        }
        if (self.redis_password.is_some() || self.redis_password_file.is_some())
            && url_has_password(&self.redis)
        {
            problems.push(bad(
                "redis-password",
                "--redis already holds a password; give it in one place only",
            ));
        }
        problems
    }
}
