//! Promote: `tally promote` and `tally demote`, routing changes by hand.
//!
//! Both publish a new routing version through
//! [`crate::domain::versions::Routes::publish`], the same path hot-post detection
//! takes, so they are safe while `tally run` counts: writers switch to the
//! new version for events stamped [`crate::domain::versions::GRACE_MS`] after it, and
//! readers sum it from the moment it is reserved.

use crate::domain::generation;
use crate::domain::layout;
use crate::domain::versions::{Published, Routes, Trigger};
use crate::infra::config::StoreSettings;
use crate::ops::OpError;

/// Buckets a post is promoted to when no count is given.
pub const DEFAULT_PROMOTED_BUCKETS: u32 = 64;

/// Whether the post gets more or fewer buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// More buckets.
    Promote,
    /// Fewer buckets.
    Demote,
}

/// A routing change asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// The post.
    pub post_id: u64,
    /// More or fewer buckets.
    pub direction: Direction,
    /// Buckets of the new version; by default [`DEFAULT_PROMOTED_BUCKETS`]
    /// for a promotion and version 0's count (the layout record's) for a
    /// demotion.
    pub to_buckets: Option<u32>,
}

/// The version a change published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routed {
    /// The post.
    pub post_id: u64,
    /// The new version.
    pub version: u32,
    /// Its buckets.
    pub buckets: u32,
    /// Events stamped from this time (milliseconds since the epoch) go to it.
    pub effective_ms: i64,
    /// How long until then, from the registry's clock.
    pub effective_in_ms: i64,
}

/// Publishes a new routing version for one post, in the generation writers
/// use now.
pub async fn change_route(settings: &StoreSettings, change: Change) -> Result<Routed, OpError> {
    let Change {
        post_id, direction, ..
    } = change;
    let (opened, record) = layout::open_for_reading(settings).await?;
    let default_buckets = record.buckets;
    let buckets = match (direction, change.to_buckets) {
        (_, Some(n)) => n,
        (Direction::Promote, None) => DEFAULT_PROMOTED_BUCKETS,
        (Direction::Demote, None) => default_buckets,
    };
    if buckets == 0 || buckets > 1 << 16 {
        return Err(OpError::Refused(
            "--to-buckets must be between 1 and 65536".into(),
        ));
    }
    let keys = generation::current_layout(&opened.store, &opened.keys).await?;
    let routes = Routes::new(opened.store, keys, default_buckets);
    let table = routes.fetch().await?;
    let latest = table.latest(post_id);
    let refused = match direction {
        Direction::Promote if buckets <= latest.buckets => Some("promote to more, or demote"),
        Direction::Demote if buckets >= latest.buckets => Some("demote to fewer"),
        _ => None,
    };
    if let Some(hint) = refused {
        return Err(OpError::Refused(format!(
            "post {post_id} already has {} buckets (version {}); {hint}",
            latest.buckets, latest.version
        )));
    }
    let Published { added, versions } = routes
        .publish(post_id, buckets, latest.version, Trigger::Manual)
        .await?;
    if !added {
        return Err(OpError::Refused(format!(
            "post {post_id} changed while publishing (another promotion won); run `tally inspect post {post_id}`"
        )));
    }
    let newest = versions.last().expect("a published version");
    Ok(Routed {
        post_id,
        version: newest.version,
        buckets: newest.buckets,
        effective_ms: newest.effective_ms,
        effective_in_ms: (newest.effective_ms - table.now_ms()).max(0),
    })
}
