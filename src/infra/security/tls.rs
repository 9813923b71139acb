//! TLS: the certificates tally presents to Redis and trusts it with, and
//! why a handshake failed.
//!
//! Invariant: a handshake that failed is named, not guessed at
//! ([`tls_problem`]): an unknown issuer, an expired certificate, a name
//! mismatch and a missing client certificate are told apart, and the
//! private key never reaches a `Debug` form.

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
    pub(super) fn of_text(text: &str) -> Option<TlsProblem> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn pem_files_are_checked() {
        assert!(pem_certificates_problem(b"not pem").is_some());
        assert!(pem_key_problem(b"").is_some());
    }
}
