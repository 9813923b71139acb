//! Layout: a prefix's keys on the store the settings name, opened once.
//!
//! Invariant: every command that touches Redis derives the slot groups and
//! the key layout from its [`StoreSettings`] here and nowhere else, so the
//! writers, the readers and the operations of one deployment name the same
//! keys for the same settings: one slot group on a single server, the
//! configured number on a cluster.

use crate::domain::routing::KeyLayout;
use crate::domain::slots::SlotGroups;
use crate::infra::config::StoreSettings;
use crate::infra::store::{ConnectError, RedisUrl, Shared, Target};

/// A store opened from its settings.
#[derive(Clone)]
pub struct OpenStore {
    /// The shared connection.
    pub store: Shared,
    /// The URL it was opened with (credentials included; show `url.shown()`).
    pub url: RedisUrl,
    /// The key layout under the base prefix (generation 0); a generation's
    /// layout is derived from it with [`KeyLayout::with_prefix`].
    pub keys: KeyLayout,
}

impl OpenStore {
    /// Where to open further connections (blocking ones, scans).
    pub fn target(&self) -> &Target {
        self.url.target()
    }
}

/// The slot groups scripts are split by under `settings`.
pub fn slot_groups(settings: &StoreSettings) -> SlotGroups {
    if settings.url().is_cluster() {
        SlotGroups::cluster(settings.slot_groups())
    } else {
        SlotGroups::single()
    }
}

/// The base key layout under `settings`, without connecting.
pub fn base_keys(settings: &StoreSettings) -> KeyLayout {
    KeyLayout::with_groups(settings.prefix(), slot_groups(settings))
}

/// Connects, checks the store answers, and derives the key layout.
pub async fn open(settings: &StoreSettings) -> Result<OpenStore, ConnectError> {
    let store = Shared::open(settings.url()).await?;
    Ok(OpenStore {
        store,
        url: settings.url().clone(),
        keys: base_keys(settings),
    })
}
