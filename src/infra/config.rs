//! Config: the settings of the service as typed values, and their checks.
//!
//! Invariant: settings are checked when they are built, and every problem is
//! reported at once, one [`ConfigError`] per problem naming the setting to
//! fix, never discovered mid-stream. A setting has one name: the flag
//! (`--slot-groups`), its `TALLY_*` variable and its key in a settings file
//! are all derived from it.
//!
//! [`StoreSettings`] says where the counts are and is shared by every command
//! that touches Redis; [`RunSettings`] embeds it with everything else `tally
//! run` needs. The Redis URL is parsed once, here, into a target and a
//! redacted display form ([`RedisUrl`](crate::infra::store::RedisUrl)), and
//! secrets are read once, here, from their values or files.
//!
//! Parts: `store` (where the counts are, and the Redis TLS files), `kafka`
//! (where the events come from, and the librdkafka settings tally owns),
//! `kafka_security` (TLS and SASL towards the brokers), `run` (the rest of
//! what `tally run` needs), `serve` (the limits of the read API), `dedupe`
//! (which repeats of a like are skipped), `packing` (how a new prefix keeps
//! its counters); this file holds what they share:
//! the problem a setting has, and where a password comes from.

pub mod dedupe;
mod kafka;
mod kafka_security;
pub mod packing;
mod run;
mod serve;
mod store;
pub mod windows;

use std::path::PathBuf;

use crate::infra::security::read_secret_file;

pub use kafka::{
    DEFAULT_BROKERS, DEFAULT_GROUP, DEFAULT_TOPIC, GroupProtocol, KafkaSettings,
    kafka_client_config, with_fetch_settings,
};
pub use kafka_security::{KafkaSecurity, KafkaSecurityInput};
pub use run::{
    Batching, DEFAULT_BATCH_MAX_EVENTS, DEFAULT_BATCH_MAX_KEYS, DEFAULT_BUCKETS,
    DEFAULT_FLUSH_INTERVAL_MS, DEFAULT_HOT_BUCKETS, DEFAULT_MAX_IN_FLIGHT, DEFAULT_PROMOTE_ABOVE,
    DEFAULT_REGISTRY_WAIT_MS, DEFAULT_ROUTE_REFRESH_MS, DEFAULT_SHUTDOWN_TIMEOUT_SECS, HotSettings,
    MAX_SCHEMA_ID, RunSettings,
};
pub use serve::{
    DEFAULT_SERVE_MAX_BODY_BYTES, DEFAULT_SERVE_MAX_CONCURRENT, DEFAULT_SERVE_MAX_IDS,
    DEFAULT_SERVE_REQUEST_TIMEOUT_MS, ServeLimits,
};
pub use store::{DEFAULT_PREFIX, DEFAULT_REDIS, DEFAULT_SLOT_GROUPS, RedisTlsFiles, StoreSettings};

/// A problem with one setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag}: {problem}")]
pub struct ConfigError {
    /// The setting at fault, as its flag is spelt without `--`.
    pub flag: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

/// A [`ConfigError`] for `flag`.
pub fn bad(flag: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        problem: problem.into(),
    }
}

/// Where a password comes from: given as a value, or read from a file.
#[derive(Clone, PartialEq, Eq)]
pub enum Password {
    /// The password itself (from a flag or a variable).
    Value(String),
    /// A file holding it, read once when the settings are built.
    File(PathBuf),
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Password::Value(_) => f.write_str("Value(***)"),
            Password::File(path) => f.debug_tuple("File").field(path).finish(),
        }
    }
}

impl Password {
    /// The password of a value setting and a file setting, at most one of
    /// which may be given.
    pub fn from_sources(
        value: Option<String>,
        file: Option<PathBuf>,
        file_flag: &'static str,
    ) -> Result<Option<Password>, ConfigError> {
        match (value, file) {
            (Some(_), Some(_)) => Err(bad(file_flag, "give the password or its file, not both")),
            (Some(value), None) => Ok(Some(Password::Value(value))),
            (None, Some(path)) => Ok(Some(Password::File(path))),
            (None, None) => Ok(None),
        }
    }

    /// The password: the value, or the file's content without its trailing newline.
    fn read(&self, file_flag: &'static str) -> Result<String, ConfigError> {
        match self {
            Password::Value(value) => Ok(value.clone()),
            Password::File(path) => {
                read_secret_file(path).map_err(|problem| bad(file_flag, problem.to_string()))
            }
        }
    }
}
