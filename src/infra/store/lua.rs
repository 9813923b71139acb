//! Lua: the scripts tally sends, by hash.
//!
//! Invariant: a script goes by its SHA1 (`EVALSHA`), and in full once after
//! a NOSCRIPT on the same connection, so a script cache that lost it costs a
//! round trip, never an error.

use std::sync::OnceLock;

use redis::{Cmd, RedisError};

use super::Shared;
use crate::infra::retry::{RedisFailure, classify_redis};

/// A small Lua script sent by hash, and in full once after a NOSCRIPT (a
/// flushed script cache, a failover, a node that never saw it).
pub struct Lua {
    text: &'static str,
    sha: OnceLock<String>,
}

impl Lua {
    /// A script with the given source.
    pub const fn new(text: &'static str) -> Self {
        Self {
            text,
            sha: OnceLock::new(),
        }
    }

    fn command(&self, by_hash: bool, keys: &[&str], args: &[&str]) -> Cmd {
        let mut cmd = if by_hash {
            let sha = self
                .sha
                .get_or_init(|| redis::Script::new(self.text).get_hash().to_string());
            redis::cmd("EVALSHA").arg(sha.as_str()).clone()
        } else {
            redis::cmd("EVAL").arg(self.text).clone()
        };
        cmd.arg(keys.len()).arg(keys).arg(args);
        cmd
    }

    /// Runs the script once on the server owning `keys`.
    pub async fn call<T: redis::FromRedisValue>(
        &self,
        store: &Shared,
        keys: &[&str],
        args: &[&str],
    ) -> Result<T, RedisError> {
        store
            .call(|mut s| async move {
                match self.command(true, keys, args).query_async(&mut s).await {
                    Err(error) if classify_redis(&error) == RedisFailure::NoScript => {
                        self.command(false, keys, args).query_async(&mut s).await
                    }
                    other => other,
                }
            })
            .await
    }
}
