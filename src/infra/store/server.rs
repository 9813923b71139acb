//! Server: which server answers, Redis or Valkey, and which release, from
//! its `INFO server`.
//!
//! Invariant: a server is judged by the Redis release whose commands and
//! scripting it keeps (`redis_version`), not by its own name or version, so
//! Valkey is held to the same [`OLDEST_REDIS`] as Redis.

/// The server behind a store, from its `INFO server`: Redis, or Valkey (which
/// also reports the Redis version whose commands and scripting it keeps, 7.2.4
/// for every Valkey release so far).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// `Redis` or `Valkey`.
    pub kind: &'static str,
    /// The server's own release, as it reports it.
    pub version: String,
    /// The Redis release its commands and scripting match (`redis_version`).
    pub redis_version: (u32, u32, u32),
}

/// The oldest Redis release tally's scripts run on: each checks its commands
/// against the caller's ACL before its first write (`redis.acl_check_cmd`, new
/// in Redis 7.0), and without it a user missing a command would stop a script
/// half-way through its increments.
pub const OLDEST_REDIS: (u32, u32, u32) = (7, 0, 0);

impl Server {
    /// Reads the text of `INFO server`; None without a `redis_version` line.
    pub fn from_info(info: &str) -> Option<Server> {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let redis = field("redis_version")?;
        let mut parts = redis.split('.').map(|p| p.parse::<u32>().ok());
        let mut next = || parts.next().flatten().unwrap_or(0);
        let redis_version = (next(), next(), next());
        Some(match field("valkey_version") {
            Some(valkey) => Server {
                kind: "Valkey",
                version: valkey.to_string(),
                redis_version,
            },
            None => Server {
                kind: "Redis",
                version: redis.to_string(),
                redis_version,
            },
        })
    }

    /// Whether tally's scripts can run on it (see [`OLDEST_REDIS`]).
    pub fn supported(&self) -> bool {
        self.redis_version >= OLDEST_REDIS
    }
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind, self.version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_is_named_by_its_own_version() {
        let redis =
            Server::from_info("# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n")
                .unwrap();
        assert_eq!(redis.to_string(), "Redis 7.0.15");
        assert!(redis.supported());
        let valkey = Server::from_info(
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\n",
        )
        .unwrap();
        assert_eq!(valkey.to_string(), "Valkey 9.1.2");
        assert_eq!(valkey.redis_version, (7, 2, 4));
        assert!(valkey.supported());
        let old = Server::from_info("redis_version:6.2.14\r\n").unwrap();
        assert!(!old.supported());
        assert!(
            Server::from_info("redis_version:7.0.0\n")
                .unwrap()
                .supported()
        );
        assert_eq!(Server::from_info("# Server\r\nos:Linux\r\n"), None);
    }
}
