//! URLs: a Redis URL parsed once, and the [`Target`] it names.
//!
//! `redis://[user:password@]host:port[/db]` (or `rediss://` for TLS) for one
//! server; `redis+cluster://[user:password@]host1:port1,host2:port2,...` (or
//! `rediss+cluster://`) for a cluster, listing any subset of its nodes.
//!
//! Invariant: a URL is split once, by the one parser of Redis URLs
//! ([`UrlParts`]), into the target to connect to and a display form with the
//! password masked, the only form that reaches a log line, an error or a
//! report.
//!
//! TLS: a [`Target`] carries the certificates of the `--redis-tls-*` files
//! (a private CA, a client certificate and key) to every connection made
//! from it, the cluster nodes found in the slot map included, so no
//! connection falls back to the system's CAs or goes without the client
//! certificate.

use std::sync::Arc;

use redis::RedisError;
use redis::cluster::ClusterClientBuilder;

use crate::infra::security::{RedisTls, Scheme, UrlParts};

/// A Redis URL, parsed once: where to connect, and how to show it.
///
/// The display form has the password replaced by `***`
/// ([`UrlParts::redacted`]); it is the only form that reaches a log line, an
/// error or a report.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl {
    target: Target,
    scheme: Scheme,
    shown: String,
}

/// A Redis URL that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{shown}': {problem}")]
pub struct UrlError {
    /// The URL as given, password removed.
    pub shown: String,
    /// What is wrong with it.
    pub problem: &'static str,
}

impl RedisUrl {
    /// Parses `redis://`, `rediss://`, `redis+cluster://` or `rediss+cluster://`.
    pub fn parse(url: &str) -> Result<RedisUrl, UrlError> {
        let parts = UrlParts::parse(url);
        let shown = parts.redacted();
        let Some(scheme) = parts.redis_scheme() else {
            let problem = "expected redis://host:port or redis+cluster://host1:port1,host2:port2";
            return Err(UrlError { shown, problem });
        };
        match Target::of(&parts, scheme) {
            Ok(target) => Ok(RedisUrl {
                target,
                scheme,
                shown,
            }),
            Err(problem) => Err(UrlError { shown, problem }),
        }
    }

    /// Where to connect (credentials included).
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The URL with its password masked.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// Whether the URL names a cluster.
    pub fn is_cluster(&self) -> bool {
        self.target.is_cluster()
    }

    /// Whether the connection is encrypted (`rediss`).
    pub fn uses_tls(&self) -> bool {
        self.scheme.tls
    }

    /// This URL, reached with the certificates of `tls`.
    pub fn with_tls(mut self, tls: Option<RedisTls>) -> RedisUrl {
        self.target = self.target.with_tls(tls);
        self
    }
}

impl std::fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown)
    }
}

/// Where the counters live, and how to reach them: the nodes' URLs and the
/// TLS material beyond the URL (a private CA, a client certificate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub(super) nodes: Nodes,
    tls: Option<Arc<RedisTls>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Nodes {
    /// One server, by URL.
    Single(String),
    /// A cluster, by the URLs of some of its nodes.
    Cluster(Vec<String>),
}

impl Target {
    /// One server at `url`.
    pub fn single(url: impl Into<String>) -> Target {
        Target {
            nodes: Nodes::Single(url.into()),
            tls: None,
        }
    }

    /// A cluster, reached through the servers at `urls`.
    pub fn cluster(urls: Vec<String>) -> Target {
        Target {
            nodes: Nodes::Cluster(urls),
            tls: None,
        }
    }

    /// The target a parsed URL with a Redis `scheme` names: the URL itself
    /// for one server; for a cluster, one URL per host, each with the
    /// cluster URL's credentials and path (a trailing `/` dropped).
    fn of(parts: &UrlParts<'_>, scheme: Scheme) -> Result<Target, &'static str> {
        if !scheme.cluster {
            return Ok(Target::single(parts.to_url()));
        }
        let path = parts.path.trim_end_matches('/');
        let nodes: Vec<String> = parts
            .hosts
            .iter()
            .map(|host| host.trim())
            .filter(|host| !host.is_empty())
            .map(|host| parts.node(scheme.single(), host, path))
            .collect();
        if nodes.is_empty() {
            return Err("a cluster URL needs at least one host:port");
        }
        Ok(Target::cluster(nodes))
    }

    /// This target, reached with `tls` (certificates read from the
    /// `--redis-tls-*` files).
    pub fn with_tls(mut self, tls: Option<RedisTls>) -> Target {
        self.tls = tls.map(Arc::new);
        self
    }

    /// The TLS material beyond the URL, if any was given.
    pub fn tls(&self) -> Option<&RedisTls> {
        self.tls.as_deref()
    }

    /// Whether this is a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.nodes, Nodes::Cluster(_))
    }

    /// The URL of every node given (one for a single server).
    pub fn nodes(&self) -> &[String] {
        match &self.nodes {
            Nodes::Single(url) => std::slice::from_ref(url),
            Nodes::Cluster(nodes) => nodes,
        }
    }

    /// One server at `host_port`, reached with this target's scheme,
    /// credentials and certificates (a cluster node found in the slot map, say).
    pub fn node(&self, host_port: &str) -> Target {
        let template = UrlParts::parse(&self.nodes()[0]);
        let scheme = template.scheme.unwrap_or("redis");
        Target {
            nodes: Nodes::Single(template.node(scheme, host_port, "/")),
            tls: self.tls.clone(),
        }
    }

    /// A client for one server's URL, with this target's certificates.
    pub(super) fn client(&self, url: &str) -> Result<redis::Client, RedisError> {
        match &self.tls {
            Some(tls) => redis::Client::build_with_tls(url, tls.certificates()),
            None => redis::Client::open(url),
        }
    }

    /// A cluster client builder for this target's nodes and certificates.
    pub(super) fn cluster_builder(&self) -> ClusterClientBuilder {
        let builder = ClusterClientBuilder::new(self.nodes().to_vec());
        match &self.tls {
            Some(tls) => builder.certs(tls.certificates()),
            None => builder,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(url: &str) -> Target {
        RedisUrl::parse(url).unwrap().target().clone()
    }

    #[test]
    fn urls_name_a_server_or_a_cluster() {
        assert_eq!(target("redis://h:1/"), Target::single("redis://h:1/"));
        assert_eq!(
            target("redis+cluster://u:p@a:1,b:2/"),
            Target::cluster(vec!["redis://u:p@a:1".into(), "redis://u:p@b:2".into()])
        );
        assert_eq!(
            target("rediss+cluster://a:1,b:2/0"),
            Target::cluster(vec!["rediss://a:1/0".into(), "rediss://b:2/0".into()]),
            "every node takes the path"
        );
        assert!(
            RedisUrl::parse("rediss+cluster://a:1")
                .unwrap()
                .is_cluster()
        );
        assert!(RedisUrl::parse("rediss+cluster://a:1").unwrap().uses_tls());
        let bad = RedisUrl::parse("localhost:6379").unwrap_err();
        assert!(
            bad.to_string().starts_with("'localhost:6379': expected"),
            "{bad}"
        );
        assert!(RedisUrl::parse("redis+cluster://").is_err());
    }

    #[test]
    fn the_shown_url_hides_the_password_only() {
        let url = RedisUrl::parse("redis+cluster://u:s3cret@a:1,b:2").unwrap();
        assert_eq!(url.shown(), "redis+cluster://u:***@a:1,b:2");
        assert_eq!(format!("{url:?}"), url.shown());
        let bad = RedisUrl::parse("http://u:s3cret@a").unwrap_err();
        assert!(!bad.to_string().contains("s3cret"), "{bad}");
    }

    #[test]
    fn cluster_nodes_keep_the_credentials() {
        assert_eq!(
            target("redis+cluster://u:p@a:1").node("10.0.0.2:7001"),
            Target::single("redis://u:p@10.0.0.2:7001/")
        );
        assert_eq!(
            target("rediss://a:1").node("b:2"),
            Target::single("rediss://b:2/")
        );
        let tls = RedisTls::new(Some(b"ca".to_vec()), None);
        let secure = target("rediss+cluster://a:1").with_tls(Some(tls.clone()));
        assert_eq!(secure.node("b:2").tls(), Some(&tls), "nodes keep the CA");
    }
}
