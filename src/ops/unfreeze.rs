//! Unfreeze: `tally unfreeze-routing`, which brings routing made final far
//! ahead (an event stamped in 2099 on a cluster, see
//! [`crate::domain::versions`]) back to the registry clock, so that
//! promotions and `tally rebucket` take effect within seconds again.
//!
//! # Invariant: every event keeps the route it was counted by
//!
//! Lowering `final` alone would let a version published now take effect
//! before 2099 and change the route of the events stamped up to then that
//! were already counted. A replay (a re-read after a crash, a Redis that
//! rolled a slot group's fence back, a rebuild) would then look for such an
//! event in another slot group than the one that counted it, and count it
//! twice or not at all; and a writer that still holds a table with the old
//! `final` would route new events as before while the others follow the
//! new version. So the unfreeze records which events keep the frozen
//! routing: per partition, every offset up to a *cutoff*, for the events
//! stamped after a *bound*; all others follow the registry as it is
//! ([`crate::domain::versions::unfreeze`] states the rule). It takes two
//! scripts around a wait:
//!
//! 1. **Begin**: if routing is final more than [`FROZEN_AHEAD_MS`] ahead,
//!    `final` is lowered to the bound, [`GRACE_MS`] from now, and the
//!    unfreeze is marked under way; until it finishes, publications still
//!    take effect after the time undone.
//! 2. **Wait** [`UNFREEZE_WAIT`] ([`FINAL_TRUST`] and a margin), then read
//!    every partition's high watermark: the cutoff is one below it.
//! 3. **Finish**: if `final` was raised past [`FROZEN_AHEAD_MS`] meanwhile,
//!    an event stamped ahead still arrives: the undone time is restored and
//!    the command refuses. Otherwise it writes the record (bound, cutoffs,
//!    and the versions published while frozen with their times of then),
//!    moves those versions to take effect [`GRACE_MS`] from now, and drops
//!    the mark.
//!
//! Why no route changes, for an event stamped `t` at offset `o`:
//!
//! * **`t` at or before the bound.** No version is ever added or moved to
//!   take effect at or before the bound (both scripts keep `final` at or
//!   above it), so every table routes it as before.
//! * **`t` after the bound, routed before the finish.** A table routed it
//!   by a `final` time at or after `t`. One read before the begin does so
//!   only for [`FINAL_TRUST`] after its read was sent, so the event was
//!   fetched before the watermarks were read: `o` is at or below the
//!   cutoff, and the record routes it by the versions of then, which is its
//!   frozen route. One read after the begin has a `final` beyond the bound
//!   only if an event made routing final so far meanwhile; the finish
//!   refuses when that reaches beyond [`FROZEN_AHEAD_MS`], or when a
//!   version it would move took effect by then (`route_unfreeze.lua`), so
//!   for such an event the versions of then and the registry after the
//!   finish agree. (An event routed within 0.5 s of its table's read, not
//!   by `final`, is reached by no version moved or published later.)
//! * **Routed after the finish.** Every table read after it holds the
//!   record; a table read before it routes `t` beyond its read only by its
//!   `final`, which is the lowered one (or, before the begin, no longer
//!   trusted), and otherwise reads the registry again.
//!
//! Readers sum every version a post or the default layout ever had, moved
//! or not, and a version moved takes effect [`GRACE_MS`] after the finish,
//! as a new one does, so a reader never sums fewer keys than a writer uses.
//! A rebuild copies the record with the registry and routes every event as
//! the live writers did; `tally verify` sums per post and needs no routes.
//!
//! What it assumes: a writer's monotonic clock counts a pause of its process
//! (SIGSTOP, a stall) as time passed, as Linux's `CLOCK_MONOTONIC` does
//! (a whole machine suspended is not counted: its writers resume with stale
//! tables, as any zombie does, but trust them longer); and every writer runs
//! a build that knows the record (an older one ignores it, with a warning on
//! every read of the registry).
//!
//! On a single server nothing makes routing final, so there is nothing to
//! undo. A command stopped between the steps leaves the mark: routing stays
//! frozen, `tally_routing_final_ahead_seconds` still says so, and the next
//! run starts over.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio_util::sync::CancellationToken;

use crate::domain::generation;
use crate::domain::versions::{
    FINAL_TRUST, FROZEN_AHEAD_MS, GRACE_MS, Routes, UnfreezeBegin, UnfreezeFinish, utc_text,
};
use crate::infra::config::RunSettings;
use crate::infra::store::Replicated;
use crate::ops::{OpError, open_applier};
use crate::pipeline::consume::check_topic;

/// How long the unfreeze waits between its two steps: every table read
/// before it began has stopped routing by the old final time by then.
pub const UNFREEZE_WAIT: Duration = FINAL_TRUST.saturating_add(Duration::from_secs(2));

/// Why `tally unfreeze-routing` changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Routing is not frozen.
    #[error(
        "routing is not frozen: it is final up to {} ({} s ahead of the registry clock; frozen means more than {} s); nothing to undo",
        utc_text(*final_ms),
        (final_ms - now_ms).max(0) / 1000,
        FROZEN_AHEAD_MS / 1000
    )]
    NotFrozen {
        /// The registry clock.
        now_ms: i64,
        /// How far routing is final.
        final_ms: i64,
    },
    /// A rebuild copied the registry and routes by its copy.
    #[error(
        "a rebuild into generation {generation} is under way and copied the routing registry when it began; unfreeze after its switch, or after `tally rebuild --abort`"
    )]
    RebuildUnderWay {
        /// The generation being rebuilt.
        generation: u64,
    },
    /// An event stamped ahead arrived while unfreezing.
    #[error(
        "an event stamped ahead made routing final up to {} while unfreezing: a producer still stamps events ahead; fix its clock (or set message.timestamp.type=LogAppendTime on the topic), then run `tally unfreeze-routing` again; routing stays frozen until {}",
        utc_text(*final_ms),
        utc_text(*undone_ms)
    )]
    StillAhead {
        /// The final time reached meanwhile.
        final_ms: i64,
        /// The final time still in force.
        undone_ms: i64,
    },
    /// A version published before the unfreeze began may route events
    /// counted meanwhile.
    #[error(
        "routing version of registry field {field} takes effect at {} and routing was made final up to {} while unfreezing: events stamped ahead still arrive; run `tally unfreeze-routing` again once they stop",
        utc_text(*effective_ms),
        utc_text(*final_ms)
    )]
    VersionInside {
        /// The registry field (a post id, or `default`).
        field: String,
        /// When it takes effect.
        effective_ms: i64,
        /// The final time.
        final_ms: i64,
    },
    /// Another unfreeze began while this one waited, or ended it.
    #[error(
        "another `tally unfreeze-routing` began or ended this one while it waited; let the other finish, or run it again"
    )]
    Overtaken,
    /// The registry's clock went on less than the wait (a failover to a
    /// replica whose clock lags).
    #[error(
        "the registry clock went on {} ms of the {} ms waited since the unfreeze began (a failover?); nothing changed; run `tally unfreeze-routing` again",
        .went_ms, .waited_ms
    )]
    ClockBehind {
        /// How far it went.
        went_ms: i64,
        /// How long the command waited.
        waited_ms: i64,
    },
    /// Stopped by a signal while waiting.
    #[error("stopped while waiting; routing stays frozen (nothing changed)")]
    Stopped,
}

/// What the first step found, for the caller to say while the wait runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Begun {
    /// The final time being undone.
    pub undone_ms: i64,
    /// The bound.
    pub bound_ms: i64,
    /// How long the wait is.
    pub wait: Duration,
}

/// What `tally unfreeze-routing` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unfrozen {
    /// The generation whose registry was unfrozen.
    pub generation: u64,
    /// Its key prefix.
    pub prefix: String,
    /// The final time undone.
    pub undone_ms: i64,
    /// Events stamped after this keep their routes up to the cutoffs.
    pub bound_ms: i64,
    /// How far routing is final now.
    pub final_ms: i64,
    /// The registry clock at the finish.
    pub now_ms: i64,
    /// Per partition, the last offset counted under the frozen routing.
    pub cutoffs: Vec<(i32, i64)>,
    /// Versions published while frozen, moved to take effect from now.
    pub moved: u32,
    /// What the replicas acknowledged of the record.
    pub replicated: Replicated,
}

impl Unfrozen {
    /// How long until a version published now takes effect.
    pub fn versions_in_ms(&self) -> i64 {
        (self.final_ms + 1 - self.now_ms).max(GRACE_MS)
    }
}

/// Unfreezes the routing of the settings' prefix, in the generation writers
/// use now; `begun` hears of the first step before the wait.
pub async fn unfreeze(
    settings: &RunSettings,
    shutdown: CancellationToken,
    begun: &mut dyn FnMut(&Begun),
) -> Result<Unfrozen, OpError> {
    let (opened, _, epoch0) = open_applier(settings).await?;
    let base = settings.store.prefix();
    if let Some(rebuild) = generation::read_record(&opened.store, base).await? {
        return Err(Refusal::RebuildUnderWay {
            generation: rebuild.generation,
        }
        .into());
    }
    let pointer = generation::read_pointer(&opened.store, base).await?;
    let keys = generation::current_layout(&opened.store, &opened.keys).await?;
    let routes =
        Routes::new(opened.store, keys.clone(), epoch0).with_wait(settings.hot.registry_wait);
    let kafka = &settings.kafka;
    let consumer: BaseConsumer = kafka
        .secure_client_config()
        .set("group.id", format!("{}-unfreeze", kafka.group))
        .set("enable.auto.commit", "false")
        .create()
        .map_err(OpError::kafka("creating the Kafka client"))?;
    let partitions = check_topic(&consumer, &kafka.brokers, &kafka.topic, "topic")?;

    let (started_ms, undone_ms, bound_ms) = match routes.unfreeze_begin().await? {
        UnfreezeBegin::NotFrozen { now_ms, final_ms } => {
            return Err(Refusal::NotFrozen { now_ms, final_ms }.into());
        }
        UnfreezeBegin::Begun {
            started_ms,
            undone_ms,
            bound_ms,
        } => (started_ms, undone_ms, bound_ms),
    };
    begun(&Begun {
        undone_ms,
        bound_ms,
        wait: UNFREEZE_WAIT,
    });
    let cutoffs = tokio::select! {
        _ = shutdown.cancelled() => None,
        cutoffs = async {
            tokio::time::sleep(UNFREEZE_WAIT).await;
            // Read after the wait: every event routed by a table read before
            // the begin was fetched before now.
            let mut cutoffs = Vec::with_capacity(partitions);
            for p in 0..partitions as i32 {
                let (_, high) = tokio::task::block_in_place(|| {
                    consumer.fetch_watermarks(&kafka.topic, p, Duration::from_secs(10))
                })
                .map_err(OpError::kafka(format!("reading partition {p}'s watermarks")))?;
                cutoffs.push((p, high - 1));
            }
            Ok::<_, OpError>(cutoffs)
        } => Some(cutoffs),
    };
    let cutoffs = match cutoffs {
        Some(Ok(cutoffs)) => cutoffs,
        stopped_or_failed => {
            routes.unfreeze_abort(started_ms).await?;
            return Err(match stopped_or_failed {
                Some(Err(error)) => error,
                _ => Refusal::Stopped.into(),
            });
        }
    };
    match routes
        .unfreeze_finish(started_ms, UNFREEZE_WAIT, &cutoffs)
        .await?
    {
        UnfreezeFinish::Done {
            now_ms,
            final_ms,
            bound_ms,
            moved,
            replicated,
        } => Ok(Unfrozen {
            generation: pointer.current,
            prefix: keys.prefix().to_string(),
            undone_ms,
            bound_ms,
            final_ms,
            now_ms,
            cutoffs,
            moved,
            replicated,
        }),
        UnfreezeFinish::NotUnderWay | UnfreezeFinish::Overtaken => Err(Refusal::Overtaken.into()),
        UnfreezeFinish::TooEarly { now_ms, started_ms } => {
            routes.unfreeze_abort(started_ms).await?;
            Err(Refusal::ClockBehind {
                went_ms: now_ms - started_ms,
                waited_ms: UNFREEZE_WAIT.as_millis() as i64,
            }
            .into())
        }
        UnfreezeFinish::StillAhead { final_ms, .. } => Err(Refusal::StillAhead {
            final_ms,
            undone_ms: undone_ms.max(final_ms),
        }
        .into()),
        UnfreezeFinish::VersionInside {
            field,
            effective_ms,
            final_ms,
        } => Err(Refusal::VersionInside {
            field,
            effective_ms,
            final_ms,
        }
        .into()),
    }
}
