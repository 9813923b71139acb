//! The two steps of `tally unfreeze-routing` on the registry
//! (`route_unfreeze.lua`), and giving one up. The order of operations and
//! why it keeps every route is in [`crate::ops::unfreeze`].

use std::time::Duration;

use redis::RedisError;
use tracing::info;

use super::Routes;
use crate::domain::versions::{FROZEN_AHEAD_MS, GRACE_MS};
use crate::infra::store::{Lua, Replicated};

static UNFREEZE: Lua = Lua::new(concat!(
    include_str!("../../../infra/acl_check.lua"),
    include_str!("../registry_clock.lua"),
    include_str!("../route_unfreeze.lua")
));

/// What the first step of an unfreeze found ([`Routes::unfreeze_begin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnfreezeBegin {
    /// Routing is final no more than [`FROZEN_AHEAD_MS`] ahead: nothing changed.
    NotFrozen {
        /// The registry clock.
        now_ms: i64,
        /// How far routing is final (milliseconds since the epoch).
        final_ms: i64,
    },
    /// `final` was lowered to `bound_ms`; publications still take effect
    /// after `undone_ms` until the unfreeze finishes.
    Begun {
        /// The registry clock, which is also the unfreeze's token.
        started_ms: i64,
        /// The final time undone.
        undone_ms: i64,
        /// What `final` was lowered to.
        bound_ms: i64,
    },
}

/// What the second step of an unfreeze did ([`Routes::unfreeze_finish`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnfreezeFinish {
    /// The record was written: routing is final up to `final_ms` only.
    Done {
        /// The registry clock.
        now_ms: i64,
        /// How far routing is final now.
        final_ms: i64,
        /// The record's bound.
        bound_ms: i64,
        /// Versions published while frozen, moved to take effect from now.
        moved: u32,
        /// What the replicas acknowledged of it.
        replicated: Replicated,
    },
    /// No unfreeze is under way (another one finished or gave up).
    NotUnderWay,
    /// Another unfreeze began meanwhile; this one leaves it be.
    Overtaken,
    /// The registry's clock has not yet gone on by the wait since the start.
    TooEarly {
        /// The registry clock.
        now_ms: i64,
        /// When the unfreeze began.
        started_ms: i64,
    },
    /// An event stamped ahead made routing final to `final_ms` meanwhile,
    /// more than [`FROZEN_AHEAD_MS`] ahead: the final time was restored,
    /// nothing else changed.
    StillAhead {
        /// The registry clock.
        now_ms: i64,
        /// The final time it reached.
        final_ms: i64,
    },
    /// A version published before the start takes effect within the time
    /// routing was made final meanwhile, so events counted since may have
    /// gone to it: the final time was restored, nothing else changed.
    VersionInside {
        /// The registry field (a post id, or `default`).
        field: String,
        /// When the version takes effect.
        effective_ms: i64,
        /// The final time.
        final_ms: i64,
    },
}

impl Routes {
    /// First step of `tally unfreeze-routing` ([`crate::ops::unfreeze`]):
    /// if routing is frozen, lowers `final` to [`GRACE_MS`] from now and
    /// marks the unfreeze under way.
    pub async fn unfreeze_begin(&self) -> Result<UnfreezeBegin, RedisError> {
        let reply: Vec<i64> = UNFREEZE
            .call(
                &self.store,
                &[&self.keys.registry_key()],
                &["begin", &FROZEN_AHEAD_MS.to_string(), &GRACE_MS.to_string()],
            )
            .await?;
        Ok(match reply[..] {
            [0, started_ms, undone_ms, bound_ms] => UnfreezeBegin::Begun {
                started_ms,
                undone_ms,
                bound_ms,
            },
            [_, now_ms, final_ms, ..] => UnfreezeBegin::NotFrozen { now_ms, final_ms },
            _ => return Err(unexpected("begin", &reply)),
        })
    }

    /// Second step: once `wait` has passed since `started_ms` by the
    /// registry's clock, records the unfreeze with `cutoffs` (per partition,
    /// the last offset that may have been counted under the frozen routing)
    /// and moves the versions published while frozen to take effect from
    /// now; or, when an event stamped ahead came meanwhile, restores the
    /// final time.
    pub async fn unfreeze_finish(
        &self,
        started_ms: i64,
        wait: Duration,
        cutoffs: &[(i32, i64)],
    ) -> Result<UnfreezeFinish, RedisError> {
        let cutoffs: Vec<String> = cutoffs.iter().map(|(p, o)| format!("{p}:{o}")).collect();
        let reply: Vec<redis::Value> = UNFREEZE
            .call(
                &self.store,
                &[&self.keys.registry_key()],
                &[
                    "finish",
                    &started_ms.to_string(),
                    &wait.as_millis().to_string(),
                    &FROZEN_AHEAD_MS.to_string(),
                    &GRACE_MS.to_string(),
                    &cutoffs.join(","),
                ],
            )
            .await?;
        let number = |i: usize| -> Result<i64, RedisError> {
            Ok(redis::from_redis_value(
                reply.get(i).cloned().unwrap_or(redis::Value::Nil),
            )?)
        };
        let finish = match number(0)? {
            0 => {
                let replicated = self.replicate("unfreeze").await?;
                let finish = UnfreezeFinish::Done {
                    now_ms: number(1)?,
                    final_ms: number(2)?,
                    bound_ms: number(3)?,
                    moved: number(4)?.try_into().unwrap_or(0),
                    replicated,
                };
                info!(
                    registry = %self.keys.registry_key(),
                    ?finish,
                    "Routing unfrozen."
                );
                finish
            }
            1 => UnfreezeFinish::NotUnderWay,
            2 => UnfreezeFinish::Overtaken,
            3 => UnfreezeFinish::TooEarly {
                now_ms: number(1)?,
                started_ms: number(2)?,
            },
            4 => UnfreezeFinish::StillAhead {
                now_ms: number(1)?,
                final_ms: number(2)?,
            },
            _ => UnfreezeFinish::VersionInside {
                field: redis::from_redis_value(reply.get(2).cloned().unwrap_or(redis::Value::Nil))?,
                effective_ms: number(3)?,
                final_ms: number(4)?,
            },
        };
        Ok(finish)
    }

    /// Gives up the unfreeze that began at `started_ms`, if it is still
    /// under way: the final time it undid is restored. Whether it was.
    pub async fn unfreeze_abort(&self, started_ms: i64) -> Result<bool, RedisError> {
        let reply: Vec<i64> = UNFREEZE
            .call(
                &self.store,
                &[&self.keys.registry_key()],
                &["abort", &started_ms.to_string()],
            )
            .await?;
        Ok(reply.first() == Some(&0))
    }
}

fn unexpected(step: &str, reply: &[i64]) -> RedisError {
    RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected reply of route_unfreeze.lua",
        format!("{step}: {reply:?}"),
    ))
}
