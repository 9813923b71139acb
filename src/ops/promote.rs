//! Promote: `tally promote`, `tally demote` and `tally rebucket`, routing
//! changes by hand.
//!
//! The first two publish a new routing version of one post through
//! [`crate::domain::versions::Routes::publish`], the same path hot-post detection
//! takes; the third a new epoch of the default layout through
//! [`crate::domain::versions::Routes::rebucket`]. All are safe while `tally run`
//! counts: writers switch for events stamped
//! [`crate::domain::versions::GRACE_MS`] after the change, and readers sum the
//! new keys from the moment it is made. While routing is frozen (final more
//! than [`crate::domain::versions::FROZEN_AHEAD_MS`] ahead) all three refuse,
//! naming `tally unfreeze-routing`: a change would take effect only then.

use crate::domain::generation;
use crate::domain::layout;
use crate::domain::routing::version_name;
use crate::domain::versions::{
    Published, Rebucketed, RouteTable, Routes, Trigger, Version, utc_text,
};
use crate::infra::config::StoreSettings;
use crate::infra::store::{ReplicaWait, Replicated};
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
    /// for a promotion and the default layout's current count for a
    /// demotion.
    pub to_buckets: Option<u32>,
    /// The replicas the version must reach before it is published.
    pub wait: ReplicaWait,
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
    let keys = generation::current_layout(&opened.store, &opened.keys).await?;
    let routes = Routes::new(opened.store, keys, record.buckets).with_wait(change.wait);
    let table = routes.fetch().await?;
    refuse_frozen(&table)?;
    let buckets = match (direction, change.to_buckets) {
        (_, Some(n)) => n,
        (Direction::Promote, None) => DEFAULT_PROMOTED_BUCKETS,
        (Direction::Demote, None) => table.defaults().latest().buckets,
    };
    if buckets == 0 || buckets > 1 << 16 {
        return Err(OpError::Refused(
            "--to-buckets must be between 1 and 65536".into(),
        ));
    }
    let latest = table.latest(post_id);
    let refused = match direction {
        Direction::Promote if buckets <= latest.buckets => Some("promote to more, or demote"),
        Direction::Demote if buckets >= latest.buckets => Some("demote to fewer"),
        _ => None,
    };
    if let Some(hint) = refused {
        return Err(OpError::Refused(format!(
            "post {post_id} already has {} buckets ({}); {hint}",
            latest.buckets,
            version_name(latest.version)
        )));
    }
    let Published { added, versions } = routes
        .publish(post_id, buckets, latest, Trigger::Manual)
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

/// Refuses a change that would take effect only once routing made final
/// far ahead is reached: it would change nothing for years, and an
/// automatic promotion could not replace it.
fn refuse_frozen(table: &RouteTable) -> Result<(), OpError> {
    if !table.frozen() {
        return Ok(());
    }
    Err(OpError::Refused(format!(
        "routing is frozen until {} (an event stamped ahead made it final; alert TallyRoutingFrozen): a change now would take effect only then; fix the producer's clock, then run `tally unfreeze-routing`",
        utc_text(table.frozen_until_ms())
    )))
}

/// The default layout after `tally rebucket`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultChange {
    /// Whether a new epoch was published (not when the count was already in force).
    pub added: bool,
    /// The bucket count before.
    pub from_buckets: u32,
    /// The newest epoch now.
    pub newest: Version,
    /// How long until it routes events, from the registry's clock.
    pub effective_in_ms: i64,
    /// Every epoch, oldest first.
    pub epochs: Vec<Version>,
    /// What the replicas acknowledged of the new epoch.
    pub replicated: Option<Replicated>,
}

/// Publishes a new default bucket count for every post without a version
/// of its own, in the generation writers use now.
pub async fn rebucket(
    settings: &StoreSettings,
    to_buckets: u32,
    wait: ReplicaWait,
) -> Result<DefaultChange, OpError> {
    if to_buckets == 0 || to_buckets > 1 << 20 {
        return Err(OpError::Refused(
            "--to-buckets must be between 1 and 1048576".into(),
        ));
    }
    let (opened, record) = layout::open_for_reading(settings).await?;
    if let Some(rebuild) = generation::read_record(&opened.store, settings.prefix()).await? {
        return Err(OpError::Refused(format!(
            "a rebuild into generation {} is under way and copied the routing registry when it began; change the default bucket count after its switch, or after `tally rebuild --abort`",
            rebuild.generation
        )));
    }
    // Epochs are format 2's: a build of format 1 must refuse the prefix
    // before it holds one.
    layout::adopt_format(&opened.store, settings.prefix(), &record).await?;
    let keys = generation::current_layout(&opened.store, &opened.keys).await?;
    let routes = Routes::new(opened.store, keys, record.buckets).with_wait(wait);
    let table = routes.fetch().await?;
    refuse_frozen(&table)?;
    let from_buckets = table.defaults().latest().buckets;
    let Rebucketed {
        added,
        defaults,
        now_ms,
        replicated,
    } = routes.rebucket(to_buckets).await?;
    let newest = defaults.latest();
    Ok(DefaultChange {
        added,
        from_buckets,
        newest,
        effective_in_ms: (newest.effective_ms - now_ms).max(0),
        epochs: defaults.epochs().to_vec(),
        replicated,
    })
}
