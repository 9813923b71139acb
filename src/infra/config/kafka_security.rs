//! Kafka security settings: TLS and SASL towards the brokers.
//!
//! Invariant: a [`KafkaSecurity`] is a combination the brokers can accept
//! and this build of librdkafka can speak: SASL settings only with a
//! `sasl_*` protocol and all of them there, TLS files only with TLS and each
//! one a file. Its password is read once, when it is built, and its `Debug`
//! form hides it.

use std::path::PathBuf;

use super::{ConfigError, Password, bad};
use crate::infra::security::{SaslMechanism, SecurityProtocol, check_kafka_support};

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

#[cfg(test)]
mod tests {
    use super::*;

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
