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
//! Parts: `kafka` (the protocols and mechanisms towards the brokers, what
//! this build of librdkafka speaks, and the brokers' refusals and denials),
//! `redis_url` (the one parser of Redis URLs, where a password is found,
//! masked and joined), `tls` (certificates for Redis, and why a handshake
//! failed), `secrets` (secret files, and which settings hold secrets).

mod kafka;
mod redis_url;
mod secrets;
mod tls;

pub use kafka::{
    KafkaAcl, KafkaRefusal, MissingFeature, SaslMechanism, SecurityProtocol, UnknownName,
    check_kafka_support, kafka_builtin_features, kafka_denied, kafka_refusal, kafka_refusal_in_log,
};
pub use redis_url::{Scheme, UrlParts, redact_url, url_has_password, with_password};
pub use secrets::{SecretError, is_secret_key, read_secret_file};
pub use tls::{RedisTls, TlsProblem, pem_certificates_problem, pem_key_problem, tls_problem};
