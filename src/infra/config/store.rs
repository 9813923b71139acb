//! Store settings: where the counts are. The Redis URL, with a password
//! given apart from it joined in; the key prefix; the slot groups; and the
//! `--redis-tls-*` files.
//!
//! Invariant: a [`StoreSettings`] holds a URL that parsed, a prefix no glob
//! character can widen and a power-of-two count of slot groups. Its password
//! and TLS files are read once, when it is built, and a password is given in
//! one place only: in the URL or apart from it.

use std::path::PathBuf;

use super::{ConfigError, Password, bad};
use crate::infra::security::{
    RedisTls, pem_certificates_problem, pem_key_problem, url_has_password, with_password,
};
use crate::infra::store::RedisUrl;

/// Default Redis URL.
pub const DEFAULT_REDIS: &str = "redis://127.0.0.1:6379/";
/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "tally";
/// Default number of slot groups on a cluster.
pub const DEFAULT_SLOT_GROUPS: u32 = 128;

/// Where the counts are: the settings every command touching Redis shares.
#[derive(Debug, Clone)]
pub struct StoreSettings {
    url: RedisUrl,
    password: Option<Password>,
    prefix: String,
    slot_groups: u32,
}

impl StoreSettings {
    /// Parses the URL (with the password, if given apart from it, joined to
    /// it) and checks the prefix and the slot groups. `password` comes from
    /// `--redis-password` or `--redis-password-file`.
    pub fn new(
        url: &str,
        password: Option<Password>,
        prefix: &str,
        slot_groups: u32,
    ) -> Result<StoreSettings, Vec<ConfigError>> {
        let mut problems = Vec::new();
        let parsed = match RedisUrl::parse(url) {
            Err(error) => Err(bad("redis", error.to_string())),
            Ok(parsed) => match &password {
                None => Ok(parsed),
                Some(_) if url_has_password(url) => Err(bad(
                    "redis-password",
                    "--redis already holds a password; give it in one place only",
                )),
                Some(password) => {
                    let flag = match password {
                        Password::Value(_) => "redis-password",
                        Password::File(_) => "redis-password-file",
                    };
                    password.read(flag).and_then(|secret| {
                        let joined = with_password(url, &secret).map_err(|p| bad(flag, p))?;
                        RedisUrl::parse(&joined).map_err(|e| bad("redis", e.to_string()))
                    })
                }
            },
        };
        let url = parsed.map_err(|problem| problems.push(problem)).ok();
        if prefix.is_empty() || prefix.contains(|c: char| c.is_whitespace() || "*?[]{}".contains(c))
        {
            problems.push(bad(
                "prefix",
                "must be non-empty, without spaces, glob characters or braces",
            ));
        }
        if !(slot_groups.is_power_of_two() && slot_groups <= 16_384) {
            problems.push(bad(
                "slot-groups",
                "must be a power of two between 1 and 16384",
            ));
        }
        match url {
            Some(url) if problems.is_empty() => Ok(StoreSettings {
                url,
                password,
                prefix: prefix.to_string(),
                slot_groups,
            }),
            _ => Err(problems),
        }
    }

    /// The URL, credentials included; show it with [`RedisUrl::shown`].
    pub fn url(&self) -> &RedisUrl {
        &self.url
    }

    /// Where the password came from, if it was given apart from the URL.
    pub fn password(&self) -> Option<&Password> {
        self.password.as_ref()
    }

    /// The base key prefix (generation 0's).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Slot groups on a cluster (a single server has one).
    pub fn slot_groups(&self) -> u32 {
        self.slot_groups
    }

    /// These settings with the TLS files of `files` read, checked and
    /// attached to the URL; every problem at once, each naming its flag.
    pub fn with_tls(self, files: &RedisTlsFiles) -> Result<StoreSettings, Vec<ConfigError>> {
        if files == &RedisTlsFiles::default() {
            return Ok(self);
        }
        let mut problems = Vec::new();
        if !self.url.uses_tls() {
            problems.push(bad(
                files.first_flag(),
                "needs a rediss:// (or rediss+cluster://) URL in --redis",
            ));
        }
        if files.cert.is_some() != files.key.is_some() {
            problems.push(bad(
                "redis-tls-key-file",
                "a client certificate and its key go together: give --redis-tls-cert-file and --redis-tls-key-file",
            ));
        }
        let mut read =
            |path: &Option<PathBuf>, flag: &'static str, check: fn(&[u8]) -> Option<String>| {
                let path = path.as_ref()?;
                match std::fs::read(path) {
                    Ok(pem) => match check(&pem) {
                        None => Some(pem),
                        Some(problem) => {
                            problems.push(bad(flag, format!("{}: {problem}", path.display())));
                            None
                        }
                    },
                    Err(error) => {
                        problems.push(bad(
                            flag,
                            format!("cannot read {}: {error}", path.display()),
                        ));
                        None
                    }
                }
            };
        let root = read(
            &files.ca_cert,
            "redis-tls-ca-cert-file",
            pem_certificates_problem,
        );
        let cert = read(&files.cert, "redis-tls-cert-file", pem_certificates_problem);
        let key = read(&files.key, "redis-tls-key-file", pem_key_problem);
        if !problems.is_empty() {
            return Err(problems);
        }
        let tls = RedisTls::new(root, cert.zip(key));
        Ok(StoreSettings {
            url: self.url.with_tls(Some(tls)),
            ..self
        })
    }
}

/// The files of the `--redis-tls-*` settings: the CAs that sign the Redis
/// servers' certificates (instead of the system's), and a client
/// certificate and key for servers that ask for one (`tls-auth-clients`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTlsFiles {
    /// `--redis-tls-ca-cert-file`: PEM, one or more CA certificates.
    pub ca_cert: Option<PathBuf>,
    /// `--redis-tls-cert-file`: PEM client certificate.
    pub cert: Option<PathBuf>,
    /// `--redis-tls-key-file`: PEM private key of that certificate.
    pub key: Option<PathBuf>,
}

impl RedisTlsFiles {
    /// The flag of the first file given.
    fn first_flag(&self) -> &'static str {
        if self.ca_cert.is_some() {
            "redis-tls-ca-cert-file"
        } else if self.cert.is_some() {
            "redis-tls-cert-file"
        } else {
            "redis-tls-key-file"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(url: &str, password: Option<Password>) -> Result<StoreSettings, Vec<ConfigError>> {
        StoreSettings::new(url, password, DEFAULT_PREFIX, DEFAULT_SLOT_GROUPS)
    }

    #[test]
    fn store_problems_name_their_setting() {
        let flags = |r: Result<StoreSettings, Vec<ConfigError>>| -> Vec<&'static str> {
            r.unwrap_err().iter().map(|p| p.flag).collect()
        };
        assert_eq!(flags(store("localhost:6379", None)), ["redis"]);
        assert_eq!(
            flags(StoreSettings::new("redis://h/", None, "a b", 3)),
            ["prefix", "slot-groups"]
        );
        assert_eq!(
            flags(store("redis://a:b@h/", Some(Password::Value("c".into())))),
            ["redis-password"]
        );
        let missing = Some(Password::File("/nonexistent/pw".into()));
        assert_eq!(flags(store("redis://h/", missing)), ["redis-password-file"]);
        assert!(
            Password::from_sources(Some("a".into()), Some("f".into()), "redis-password-file")
                .is_err()
        );
    }

    #[test]
    fn a_password_file_is_read_once_and_joined_to_the_url() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("redis");
        std::fs::write(&path, "r3dis\n").unwrap();
        let settings = store("redis://alice@127.0.0.1:6379/", Some(Password::File(path))).unwrap();
        assert_eq!(
            settings.url().target().nodes(),
            ["redis://alice:r3dis@127.0.0.1:6379/"]
        );
        assert_eq!(settings.url().shown(), "redis://alice:***@127.0.0.1:6379/");
        assert!(!format!("{settings:?}").contains("r3dis"));
    }
}
