//! Redis URLs: the one parser of their parts, and the places a password
//! is found, masked and joined.
//!
//! Invariant: every reading of a Redis URL goes through [`UrlParts::parse`],
//! which takes any text, so a URL refused later still has its password
//! masked ([`redact_url`]); a password is joined percent-encoded, and only
//! to a URL that holds none ([`with_password`]).

/// What a Redis scheme asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheme {
    /// `rediss`: every connection is encrypted.
    pub tls: bool,
    /// `+cluster`: the hosts are nodes of one cluster.
    pub cluster: bool,
}

impl Scheme {
    /// The Redis scheme called `name` (`redis`, `rediss`, `redis+cluster` or
    /// `rediss+cluster`), if it is one.
    pub fn named(name: &str) -> Option<Scheme> {
        let (tls, cluster) = match name {
            "redis" => (false, false),
            "rediss" => (true, false),
            "redis+cluster" => (false, true),
            "rediss+cluster" => (true, true),
            _ => return None,
        };
        Some(Scheme { tls, cluster })
    }

    /// The scheme of one server's URL: `rediss` or `redis`.
    pub fn single(self) -> &'static str {
        if self.tls { "rediss" } else { "redis" }
    }
}

/// A Redis URL split into its parts:
/// `scheme://[user[:password]@]host[,host...][/db][?query]`.
///
/// Every reading of a URL goes through [`UrlParts::parse`]: the connection
/// targets, the redacted display form and the joining of a password. Nothing
/// is decoded or dropped, so [`UrlParts::to_url`] spells the URL as it was
/// typed. The user information runs to the last `@`, so a password may hold
/// an `@`, a `/` or a `:` unencoded.
#[derive(Clone, PartialEq, Eq)]
pub struct UrlParts<'a> {
    /// What precedes `://`; `None` for a URL typed without it, which is
    /// read from its start so that its password is still found.
    pub scheme: Option<&'a str>,
    /// The user name, when the URL has user information (empty in
    /// `redis://:password@host`).
    pub user: Option<&'a str>,
    /// The password, as typed (percent-encoded, if it was).
    pub password: Option<&'a str>,
    /// The hosts, as typed between the commas: one for a single server.
    pub hosts: Vec<&'a str>,
    /// What follows the hosts: `/db`, a query, or nothing.
    pub path: &'a str,
}

impl<'a> UrlParts<'a> {
    /// Splits `url`; any text splits, so that a URL refused later still has
    /// its password found and masked.
    pub fn parse(url: &'a str) -> UrlParts<'a> {
        // A `://` with an `@` before it and none after it is not a scheme's:
        // `user:password@host` was typed, and the `://` is further on.
        let (scheme, rest) = match url.split_once("://") {
            Some((scheme, rest)) if !scheme.contains('@') || rest.contains('@') => {
                (Some(scheme), rest)
            }
            _ => (None, url),
        };
        let (user, password, location) = match rest.rsplit_once('@') {
            Some((info, location)) => match info.split_once(':') {
                Some((user, password)) => (Some(user), Some(password), location),
                None => (Some(info), None, location),
            },
            None => (None, None, rest),
        };
        let end = location.find(['/', '?', '#']).unwrap_or(location.len());
        let (hosts, path) = location.split_at(end);
        UrlParts {
            scheme,
            user,
            password,
            hosts: hosts.split(',').collect(),
            path,
        }
    }

    /// The Redis scheme, if the URL has one.
    pub fn redis_scheme(&self) -> Option<Scheme> {
        self.scheme.and_then(Scheme::named)
    }

    /// The URL these parts spell.
    pub fn to_url(&self) -> String {
        let mut url = String::new();
        if let Some(scheme) = self.scheme {
            url.push_str(scheme);
            url.push_str("://");
        }
        if let Some(user) = self.user {
            url.push_str(user);
            if let Some(password) = self.password {
                url.push(':');
                url.push_str(password);
            }
            url.push('@');
        }
        url.push_str(&self.hosts.join(","));
        url.push_str(self.path);
        url
    }

    /// The URL with its password, if any, replaced by `***`.
    pub fn redacted(&self) -> String {
        match self.password {
            Some(_) => UrlParts {
                password: Some("***"),
                ..self.clone()
            }
            .to_url(),
            None => self.to_url(),
        }
    }

    /// The URL of the one server at `host`, with this URL's credentials,
    /// under `scheme` (`redis` or `rediss`) and followed by `path`.
    pub fn node(&self, scheme: &'a str, host: &'a str, path: &'a str) -> String {
        UrlParts {
            scheme: Some(scheme),
            hosts: vec![host],
            path,
            ..self.clone()
        }
        .to_url()
    }
}

impl std::fmt::Debug for UrlParts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UrlParts")
            .field("scheme", &self.scheme)
            .field("user", &self.user)
            .field("password", &self.password.map(|_| "***"))
            .field("hosts", &self.hosts)
            .field("path", &self.path)
            .finish()
    }
}

/// The URL with its password (if any) replaced by `***`; the user name stays.
/// A URL typed without its `://` (`user:password@host`,
/// `redis:/user:password@host`) is read from its start, so that the error
/// that refuses it masks the password all the same.
pub fn redact_url(url: &str) -> String {
    UrlParts::parse(url).redacted()
}

/// Whether a Redis URL carries a password.
pub fn url_has_password(url: &str) -> bool {
    let parts = UrlParts::parse(url);
    parts.scheme.is_some() && parts.password.is_some()
}

/// Puts `password` into a Redis URL (percent-encoded), keeping its user name:
/// `redis://alice@host` becomes `redis://alice:<password>@host`, and
/// `redis://host` becomes `redis://:<password>@host` (the default user).
pub fn with_password(url: &str, password: &str) -> Result<String, &'static str> {
    let parts = UrlParts::parse(url);
    if parts.scheme.is_none() {
        return Err("not a URL");
    }
    if parts.password.is_some() {
        return Err("the URL already holds a password; give it in one place only");
    }
    let encoded = percent_encode(password);
    Ok(UrlParts {
        user: Some(parts.user.unwrap_or("")),
        password: Some(&encoded),
        ..parts
    }
    .to_url())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_url_splits_into_its_hosts() {
        let url = "redis+cluster://u:p@a:1,b:2, c:3/";
        let parts = UrlParts::parse(url);
        assert_eq!(parts.scheme, Some("redis+cluster"));
        assert_eq!((parts.user, parts.password), (Some("u"), Some("p")));
        assert_eq!(parts.hosts, ["a:1", "b:2", " c:3"]);
        assert_eq!(parts.path, "/");
        assert_eq!(
            parts.redis_scheme(),
            Some(Scheme {
                tls: false,
                cluster: true
            })
        );
        assert_eq!(parts.to_url(), url, "the URL is spelt as typed");
    }

    #[test]
    fn a_password_may_hold_an_at_sign() {
        let parts = UrlParts::parse("redis://alice:p@ss:w/rd@h:6379/0");
        assert_eq!(parts.user, Some("alice"));
        assert_eq!(parts.password, Some("p@ss:w/rd"));
        assert_eq!((parts.hosts, parts.path), (vec!["h:6379"], "/0"));
        let cluster = UrlParts::parse("rediss+cluster://:p@w@a:1,b:2");
        assert_eq!((cluster.user, cluster.password), (Some(""), Some("p@w")));
        assert_eq!(cluster.hosts, ["a:1", "b:2"]);
    }

    #[test]
    fn rediss_asks_for_tls() {
        let parts = UrlParts::parse("rediss://h:6380");
        assert_eq!(
            parts.redis_scheme(),
            Some(Scheme {
                tls: true,
                cluster: false
            })
        );
        assert_eq!(parts.redis_scheme().map(Scheme::single), Some("rediss"));
        assert_eq!(
            Scheme::named("rediss+cluster").map(Scheme::single),
            Some("rediss")
        );
        assert_eq!(Scheme::named("http"), None);
    }

    #[test]
    fn a_url_without_credentials_has_no_user() {
        let parts = UrlParts::parse("redis://127.0.0.1:6379");
        assert_eq!((parts.user, parts.password), (None, None));
        assert_eq!((parts.hosts, parts.path), (vec!["127.0.0.1:6379"], ""));
        let named = UrlParts::parse("redis://alice@h");
        assert_eq!((named.user, named.password), (Some("alice"), None));
    }

    #[test]
    fn the_database_and_query_follow_the_hosts() {
        let parts = UrlParts::parse("redis://:pw@h:1/3?protocol=resp3");
        assert_eq!(parts.hosts, ["h:1"]);
        assert_eq!(parts.path, "/3?protocol=resp3");
        assert_eq!(
            UrlParts::parse("redis://h:1?protocol=resp3").path,
            "?protocol=resp3"
        );
        assert_eq!(
            parts.node("redis", "b:2", "/"),
            "redis://:pw@b:2/",
            "a node keeps the credentials"
        );
    }

    #[test]
    fn a_url_typed_without_a_scheme_is_read_from_its_start() {
        let parts = UrlParts::parse("alice:s3cret@h:6379");
        assert_eq!(parts.scheme, None);
        assert_eq!(
            (parts.user, parts.password),
            (Some("alice"), Some("s3cret"))
        );
        let slash = UrlParts::parse("redis:/alice:s3cret@h");
        assert_eq!((slash.scheme, slash.user), (None, Some("redis")));
        assert!(!format!("{parts:?}").contains("s3cret"));
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
}
