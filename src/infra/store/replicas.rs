//! Replicas: how many must acknowledge a write before tally acts on it,
//! and the `WAIT` that counts them.
//!
//! Invariant: what [`Shared::replicate`] reports never overstates: on a
//! cluster `WAIT` reaches every primary and the fewest acknowledgements
//! count, and `auto` asks for no more replicas than the primary with the
//! fewest has.

use std::time::Duration;

use redis::{RedisError, Value};
use tracing::warn;

use super::Shared;

/// How many replicas must acknowledge a write before tally acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replicas {
    /// One where the primaries have replicas (the fewest any primary has,
    /// at most 1), none where they have none.
    Auto,
    /// Exactly this many (0: never wait).
    Exactly(u32),
}

impl std::str::FromStr for Replicas {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Replicas, Self::Err> {
        match s {
            "auto" => Ok(Replicas::Auto),
            n => n
                .parse()
                .map(Replicas::Exactly)
                .map_err(|_| "expected `auto` or a number of replicas"),
        }
    }
}

impl std::fmt::Display for Replicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Replicas::Auto => f.write_str("auto"),
            Replicas::Exactly(n) => write!(f, "{n}"),
        }
    }
}

/// `WAIT` after a write that must survive a failover (routing metadata):
/// how many replicas, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaWait {
    /// Replicas that must acknowledge.
    pub replicas: Replicas,
    /// How long to wait for them.
    pub timeout: Duration,
}

impl Default for ReplicaWait {
    fn default() -> Self {
        ReplicaWait {
            replicas: Replicas::Auto,
            timeout: Duration::from_millis(1000),
        }
    }
}

/// What a [`Shared::replicate`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replicated {
    /// Replicas that had to acknowledge.
    pub wanted: u32,
    /// Replicas that did, within the timeout (on a cluster, the fewest of
    /// any primary).
    pub acked: u32,
}

impl Replicated {
    /// Whether fewer replicas acknowledged than had to.
    pub fn short(&self) -> bool {
        self.acked < self.wanted
    }
}

impl Shared {
    /// Waits until `wait.replicas` replicas acknowledged every write made on
    /// the current connection (on a cluster, every primary's replicas, as
    /// the cluster client sends `WAIT` to each primary and keeps the
    /// fewest). A connection replaced since the write cannot be waited on;
    /// the write then counts as acknowledged.
    pub async fn replicate(&self, wait: ReplicaWait) -> Result<Replicated, RedisError> {
        let wanted = match wait.replicas {
            Replicas::Exactly(n) => n,
            Replicas::Auto => self.least_replicas().await?.min(1),
        };
        if wanted == 0 {
            return Ok(Replicated { wanted, acked: 0 });
        }
        let timeout_ms = wait.timeout.as_millis().max(1) as u64;
        let acked: i64 = self
            .call(|mut s| async move {
                redis::cmd("WAIT")
                    .arg(wanted)
                    .arg(timeout_ms)
                    .query_async(&mut s)
                    .await
            })
            .await?;
        Ok(Replicated {
            wanted,
            acked: acked.max(0) as u32,
        })
    }

    /// The fewest replicas connected to any primary (`INFO replication`);
    /// none, with a warning, where the user may not run INFO.
    async fn least_replicas(&self) -> Result<u32, RedisError> {
        let info: Result<Value, RedisError> = self
            .call(|mut s| async move {
                redis::cmd("INFO")
                    .arg("replication")
                    .query_async(&mut s)
                    .await
            })
            .await;
        match info {
            Ok(info) => Ok(least_connected(&info).unwrap_or(0)),
            Err(error) if error.code() == Some("NOPERM") => {
                warn!(
                    %error,
                    "Cannot count the Redis replicas, so routing versions wait for none: grant +info to tally's Redis user, or set --registry-replicas."
                );
                Ok(0)
            }
            Err(error) => Err(error),
        }
    }
}

/// The smallest `connected_slaves` in an `INFO` reply: one text, or a map
/// from each primary's address to its text on a cluster.
fn least_connected(info: &Value) -> Option<u32> {
    let text = |bytes: &[u8]| {
        String::from_utf8_lossy(bytes)
            .lines()
            .find_map(|line| line.strip_prefix("connected_slaves:")?.trim().parse().ok())
    };
    match info {
        Value::BulkString(bytes) => text(bytes),
        Value::SimpleString(s) => text(s.as_bytes()),
        Value::VerbatimString { text: s, .. } => text(s.as_bytes()),
        Value::Map(pairs) => pairs.iter().filter_map(|(_, v)| least_connected(v)).min(),
        Value::Array(items) => items.iter().filter_map(least_connected).min(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn replicas_are_counted_on_one_server_and_across_primaries() {
        use redis::Value;
        let info = |n: u32| {
            Value::BulkString(
                format!("# Replication\r\nrole:master\r\nconnected_slaves:{n}\r\n").into_bytes(),
            )
        };
        assert_eq!(super::least_connected(&info(2)), Some(2));
        let cluster = Value::Map(vec![
            (Value::BulkString(b"a:1".to_vec()), info(1)),
            (Value::BulkString(b"b:2".to_vec()), info(0)),
        ]);
        assert_eq!(super::least_connected(&cluster), Some(0));
        assert_eq!(super::least_connected(&Value::Nil), None);
        assert_eq!("auto".parse(), Ok(super::Replicas::Auto));
        assert_eq!("2".parse(), Ok(super::Replicas::Exactly(2)));
        assert!("x".parse::<super::Replicas>().is_err());
    }
}
