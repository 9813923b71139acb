//! Scripts: a closed batch becomes one apply script per slot group, sent
//! together; the first batch of an ownership learns the fences first.
//!
//! Invariant: a group's script claims exactly the range from one past the
//! fence this ownership knows for it to the batch's end, so the fence check
//! in `apply.lua` accepts it only as the continuation of what the group has.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::pipeline::dead_letter::{DeadLetters, Pending};

use crate::domain::fence::{PartitionFences, Reply, Tracker};
use crate::domain::slots::SlotGroups;
use crate::pipeline::aggregate::ClosedBatch;
use crate::pipeline::apply::{Applier, ApplyError, Prepared};

/// The outcome of a dispatched batch.
pub(super) enum Finished {
    /// Scripts ran; `established` is set when this batch learned the fences.
    Scripts {
        established: Option<(i64, Tracker)>,
        replies: Vec<(u32, Reply, usize)>,
    },
    /// The fences found do not continue this batch: re-read from them.
    Resync { known: (i64, Tracker) },
}

/// The reply to one dispatched batch.
pub(super) struct Done {
    pub(super) partition: i32,
    pub(super) epoch: u64,
    pub(super) start: i64,
    pub(super) last: i64,
    pub(super) messages: u64,
    pub(super) bad: u64,
    /// Likes too late for a window of theirs.
    pub(super) late: u64,
    pub(super) took: Duration,
    pub(super) result: Result<Finished, ApplyError>,
}

/// A closed batch on its way to Redis, with what its task needs.
pub(super) struct Job {
    pub(super) partition: i32,
    pub(super) epoch: u64,
    pub(super) batch: ClosedBatch,
    /// The scripts, when the fences were known at dispatch.
    pub(super) planned: Option<Vec<Prepared>>,
    /// What the assignment read, for a batch that establishes the fences.
    pub(super) assigned: Option<PartitionFences>,
    /// Dead-letter copies to confirm before any script runs.
    pub(super) letters: Vec<Pending>,
    pub(super) groups: SlotGroups,
    pub(super) applier: Applier,
    pub(super) dead_letters: Option<Arc<DeadLetters>>,
    pub(super) abandon: CancellationToken,
    pub(super) pause: Duration,
    /// Dedupe is on: a batch read before the fences were known was decided
    /// by a window that started with it, which is right only at the origin.
    pub(super) dedupe: bool,
}

impl Job {
    /// Confirms the dead letters, establishes the fences if needed, sends
    /// the scripts, and reports how it went.
    pub(super) async fn run(mut self) -> Done {
        let began = Instant::now();
        let result = self.apply().await;
        Done {
            partition: self.partition,
            epoch: self.epoch,
            start: self.batch.start,
            last: self.batch.last,
            messages: self.batch.messages,
            bad: self.batch.bad,
            late: self.batch.late,
            took: began.elapsed(),
            result,
        }
    }

    async fn apply(&mut self) -> Result<Finished, ApplyError> {
        let letters = std::mem::take(&mut self.letters);
        if let Some(dl) = &self.dead_letters
            && !letters.is_empty()
            && !dl.confirm(letters, &self.abandon).await
        {
            return Err(ApplyError::Cancelled);
        }
        let (scripts, established) = match self.planned.take() {
            Some(scripts) => (scripts, None),
            None => {
                let (known, fits) = establish(
                    &self.applier,
                    self.partition,
                    self.assigned.take(),
                    self.batch.start,
                    &self.abandon,
                )
                .await?;
                if !fits || (self.dedupe && known.0 < self.batch.start) {
                    return Ok(Finished::Resync { known });
                }
                let scripts = plan(
                    self.partition,
                    &mut self.batch,
                    &self.groups,
                    &known,
                    |_| true,
                );
                (scripts, Some(known))
            }
        };
        let replies = send(&self.applier, scripts, self.pause, &self.abandon).await?;
        Ok(Finished::Scripts {
            established,
            replies,
        })
    }
}

/// The scripts of one batch: one per slot group that has events, is due an
/// advance, or (`all`) every group.
pub(super) fn plan(
    partition: i32,
    batch: &mut ClosedBatch,
    groups: &SlotGroups,
    known: &(i64, Tracker),
    mut due: impl FnMut(u32) -> bool,
) -> Vec<Prepared> {
    let (origin, tracker) = known;
    let mut split = batch.split(groups);
    let mut scripts = Vec::new();
    for (g, share) in split.iter_mut().enumerate() {
        let g = g as u32;
        let (start, last) = tracker.claim(g, batch.last);
        if start > last + 1 || (share.is_empty() && !due(g)) {
            continue;
        }
        let share = std::mem::take(share);
        scripts.push(Prepared {
            partition,
            group: g,
            start,
            last,
            absent_fence: origin - 1,
            deltas: share.deltas,
            windows: share.windows,
        });
    }
    scripts
}

/// Sends scripts, concurrently, or one by one with a pause when testing
/// crashes between the scripts of a batch.
async fn send(
    applier: &Applier,
    scripts: Vec<Prepared>,
    pause: Duration,
    abandon: &CancellationToken,
) -> Result<Vec<(u32, Reply, usize)>, ApplyError> {
    if pause.is_zero() {
        let replies =
            futures::future::join_all(scripts.iter().map(|p| applier.apply(p, abandon))).await;
        scripts
            .iter()
            .zip(replies)
            .map(|(p, r)| r.map(|reply| (p.group, reply, p.increments())))
            .collect()
    } else {
        let mut replies = Vec::with_capacity(scripts.len());
        for p in &scripts {
            replies.push((p.group, applier.apply(p, abandon).await?, p.increments()));
            tokio::time::sleep(pause).await;
        }
        Ok(replies)
    }
}

/// First batch of an ownership without a known origin: read the fences if the
/// assignment could not, record the origin, and decide whether this batch,
/// read from `batch.start` without any filtering, can be applied.
async fn establish(
    applier: &Applier,
    partition: i32,
    assigned: Option<PartitionFences>,
    start: i64,
    abandon: &CancellationToken,
) -> Result<((i64, Tracker), bool), ApplyError> {
    let fences = match assigned {
        Some(fences) => fences,
        None => applier.fences(partition, abandon).await?,
    };
    let origin = match fences.origin {
        Some(origin) => origin,
        None => applier.origin(partition, start, abandon).await?,
    };
    let fences = PartitionFences {
        origin: Some(origin),
        ..fences
    };
    let known = fences.tracker().expect("origin is set");
    let fits = (0..applier.keys().groups().count()).all(|g| known.1.known(g) == start - 1);
    Ok((known, fits))
}
