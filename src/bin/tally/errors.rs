//! Errors: the one line (or one line per problem) `tally` prints for the
//! error that stopped a command, with what to fix.
//!
//! The library's errors say what went wrong; the hints that name flags and
//! variables to check are added here, where the flags are.

use std::fmt;

use tally::infra::config::ConfigError;
use tally::infra::security::{KafkaRefusal, TlsProblem};
use tally::infra::store::ConnectError;
use tally::ops::OpError;
use tally::pipeline::consume::TopicError;
use tally::pipeline::run::RunError;

/// Settings problems, printed one per line.
#[derive(Debug)]
pub struct Problems(pub Vec<ConfigError>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, problem) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\nerror: ")?;
            }
            write!(f, "{problem}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Problems {}

impl From<Vec<ConfigError>> for Problems {
    fn from(problems: Vec<ConfigError>) -> Self {
        Problems(problems)
    }
}

/// The text after `error: ` for `error`: its message, each cause the
/// message does not already include, and a hint where one helps.
pub fn line(error: &anyhow::Error) -> String {
    if let Some(refused) = error.chain().find_map(connect_error) {
        return redis_line(refused);
    }
    if let Some(line) = error.chain().find_map(kafka_refused_line) {
        return line;
    }
    let mut line = error.to_string();
    for cause in error.chain().skip(1) {
        let cause = cause.to_string();
        if !line.contains(&cause) {
            line.push_str(": ");
            line.push_str(&cause);
        }
    }
    if let Some(hint) = acl_hint(&line) {
        line.push_str(&hint);
    }
    line
}

/// What to grant when Redis' NOPERM reply is in `line`: the permission it
/// names, or the key pattern.
pub fn acl_hint(line: &str) -> Option<String> {
    const COMMAND: &str = "no permissions to run the '";
    if let Some(at) = line.find(COMMAND) {
        let rest = &line[at + COMMAND.len()..];
        let permission = &rest[..rest.find('\'')?];
        return Some(format!(
            " (grant +{permission} to tally's Redis user; docs/security.md lists each command's rule)"
        ));
    }
    // Redis 7.0 says "no permissions to access one of the keys", Valkey "No permissions to
    // access a key".
    let key = [
        "no permissions to access one of the keys",
        "No permissions to access a key",
    ];
    key.iter().any(|k| line.contains(k)).then(|| {
        " (tally's Redis user needs the key pattern ~<prefix>:*; docs/security.md lists each command's rule)".to_string()
    })
}

/// The start-up connection error inside `error`, wherever the library's
/// error types carry one (their messages are transparent, so the chain of
/// sources skips it).
fn connect_error<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a ConnectError> {
    let from_run = |run: &'a RunError| match run {
        RunError::Redis(connect) => Some(connect),
        _ => None,
    };
    if let Some(connect) = error.downcast_ref::<ConnectError>() {
        return Some(connect);
    }
    if let Some(run) = error.downcast_ref::<RunError>() {
        return from_run(run);
    }
    if let Some(tally::domain::layout::OpenError::Connect(connect)) =
        error.downcast_ref::<tally::domain::layout::OpenError>()
    {
        return Some(connect);
    }
    match error.downcast_ref::<OpError>()? {
        OpError::Connect(connect) => Some(connect),
        OpError::Run(run) => from_run(run),
        _ => None,
    }
}

/// A Redis that refuses the credentials or the TLS handshake says so, rather
/// than suggesting it is down.
fn redis_line(error: &ConnectError) -> String {
    if error.refused_credentials() {
        format!(
            "Redis at {} refused the credentials: {} (check the user and password in --redis, TALLY_REDIS_PASSWORD or --redis-password-file)",
            error.url, error.source
        )
    } else if let Some(problem) = error.tls_problem() {
        format!(
            "TLS to Redis at {} failed: {} ({}); {}",
            error.url,
            problem.describe(),
            error.source,
            redis_tls_fix(problem)
        )
    } else if let Some(hint) = acl_hint(&error.to_string()) {
        format!("{error}{hint}")
    } else {
        format!("{error} (is redis-server running? check --redis / TALLY_REDIS)")
    }
}

/// The setting that fixes a TLS problem with Redis.
fn redis_tls_fix(problem: TlsProblem) -> &'static str {
    match problem {
        TlsProblem::UnknownIssuer => {
            "give the CA that signs the server's certificate with --redis-tls-ca-cert-file / TALLY_REDIS_TLS_CA_CERT_FILE"
        }
        TlsProblem::Expired | TlsProblem::NotYetValid => {
            "renew the certificate in redis-server's tls-cert-file (or check this machine's clock)"
        }
        TlsProblem::NameMismatch => {
            "connect by a host name the certificate lists (--redis / TALLY_REDIS), or reissue redis-server's tls-cert-file for this name"
        }
        TlsProblem::ClientCertificate => {
            "give a client certificate the server's tls-ca-cert-file trusts with --redis-tls-cert-file and --redis-tls-key-file"
        }
        TlsProblem::NotTls => {
            "the port in --redis speaks no TLS: give redis-server's tls-port, or use redis://"
        }
    }
}

/// The line for brokers that turned tally's SASL login or TLS handshake down.
fn kafka_refused_line(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let topic = error.downcast_ref::<TopicError>().or_else(|| {
        match (
            error.downcast_ref::<RunError>(),
            error.downcast_ref::<OpError>(),
        ) {
            (Some(RunError::Topic(topic)), _) | (_, Some(OpError::Topic(topic))) => Some(topic),
            (_, Some(OpError::Run(RunError::Topic(topic)))) => Some(topic),
            _ => None,
        }
    })?;
    let TopicError::Refused { refusal, .. } = topic else {
        return None;
    };
    let fix = match refusal {
        KafkaRefusal::Credentials(_) => {
            "check --kafka-sasl-username, --kafka-sasl-mechanism and the password (TALLY_KAFKA_SASL_PASSWORD or --kafka-sasl-password-file)"
        }
        KafkaRefusal::Tls(Some(TlsProblem::ClientCertificate), _) => {
            "the brokers want a client certificate: give --kafka-ssl-certificate-location and --kafka-ssl-key-location"
        }
        KafkaRefusal::Tls(Some(TlsProblem::NotTls), _) => {
            "the port in --brokers speaks no TLS: check --brokers and --kafka-security-protocol"
        }
        KafkaRefusal::Tls(..) => {
            "give the CA that signs the brokers' certificates with --kafka-ssl-ca-location / TALLY_KAFKA_SSL_CA_LOCATION, and check the host names in --brokers"
        }
    };
    Some(format!("{topic}; {fix}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_take_a_line_each() {
        let problems = Problems(vec![
            tally::infra::config::bad("buckets", "must be between 1 and 1048576"),
            tally::infra::config::bad("topic", "is empty"),
        ]);
        let shown = line(&anyhow::Error::new(problems));
        assert_eq!(
            shown,
            "--buckets: must be between 1 and 1048576\nerror: --topic: is empty"
        );
    }

    #[test]
    fn causes_are_not_repeated() {
        let io = std::io::Error::other("disk on fire");
        let error = anyhow::Error::new(io).context("reading the file");
        assert_eq!(line(&error), "reading the file: disk on fire");
        let error = anyhow::anyhow!("reading: disk on fire").context("step");
        assert_eq!(line(&error), "step: reading: disk on fire");
    }

    #[test]
    fn an_unreachable_redis_names_the_flag() {
        let error = ConnectError {
            url: "redis://127.0.0.1:1/".into(),
            source: redis::RedisError::from(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused,
            )),
        };
        let shown = line(&anyhow::Error::new(error));
        assert!(
            shown.starts_with("cannot reach Redis at redis://127.0.0.1:1/: "),
            "{shown}"
        );
        assert!(
            shown.ends_with("(is redis-server running? check --redis / TALLY_REDIS)"),
            "{shown}"
        );
    }

    #[test]
    fn a_refused_command_names_the_permission_to_grant() {
        let error = anyhow::anyhow!(
            "partition 1: Redis refused the batch: NoPerm: this user has no permissions to run the 'config|get' command"
        );
        assert!(
            line(&error).ends_with(
                "the 'config|get' command (grant +config|get to tally's Redis user; docs/security.md lists each command's rule)"
            ),
            "{}",
            line(&error)
        );
        let keys = anyhow::anyhow!(
            "NoPerm: this user has no permissions to access one of the keys used as arguments"
        );
        assert!(line(&keys).contains("~<prefix>:*"), "{}", line(&keys));
        let valkey_keys = anyhow::anyhow!("NoPerm: No permissions to access a key");
        assert!(
            line(&valkey_keys).contains("~<prefix>:*"),
            "{}",
            line(&valkey_keys)
        );
        assert_eq!(acl_hint("cannot reach Redis"), None);
    }

    #[test]
    fn a_tls_failure_names_the_certificate_problem_and_the_setting() {
        let tls = |cert: rustls::CertificateError| ConnectError {
            url: "rediss://127.0.0.1:1/".into(),
            source: redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                rustls::Error::InvalidCertificate(cert),
            )),
        };
        for (cert, problem, setting) in [
            (
                rustls::CertificateError::UnknownIssuer,
                "signed by no trusted CA",
                "--redis-tls-ca-cert-file",
            ),
            (
                rustls::CertificateError::Expired,
                "has expired",
                "tls-cert-file",
            ),
            (
                rustls::CertificateError::NotValidForName,
                "not valid for the host name",
                "--redis",
            ),
        ] {
            let shown = line(&anyhow::Error::new(RunError::Redis(tls(cert))));
            assert!(
                shown.starts_with("TLS to Redis at rediss://127.0.0.1:1/ failed: "),
                "{shown}"
            );
            assert!(
                shown.contains(problem) && shown.contains(setting),
                "{shown}"
            );
            assert!(!shown.contains("is redis-server running"), "{shown}");
        }
    }

    #[test]
    fn a_refused_kafka_login_names_the_sasl_settings() {
        let refused = TopicError::Refused {
            brokers: "127.0.0.1:9092".into(),
            refusal: KafkaRefusal::Credentials("SASL SCRAM authentication failed".into()),
        };
        let shown = line(&anyhow::Error::new(RunError::Topic(refused)));
        assert!(
            shown.starts_with("Kafka at 127.0.0.1:9092 refused the SASL login: SASL SCRAM"),
            "{shown}"
        );
        assert!(shown.contains("--kafka-sasl-username"), "{shown}");
    }

    #[test]
    fn refused_credentials_are_named_inside_every_error_that_carries_them() {
        let refused = || ConnectError {
            url: "redis://alice:***@h:1/".into(),
            source: redis::RedisError::from((
                redis::ErrorKind::AuthenticationFailed,
                "Password authentication failed",
            )),
        };
        for error in [
            anyhow::Error::new(refused()),
            anyhow::Error::new(RunError::Redis(refused())),
            anyhow::Error::new(OpError::Connect(refused())),
            anyhow::Error::new(OpError::Run(RunError::Redis(refused()))),
        ] {
            let shown = line(&error);
            assert!(
                shown.starts_with("Redis at redis://alice:***@h:1/ refused the credentials"),
                "{shown}"
            );
        }
    }
}
