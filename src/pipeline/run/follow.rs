//! Following the generation pointer in a live pipeline.
//!
//! Invariant: a live pipeline writes one generation at a time. While the
//! freeze flag names the next generation it dispatches nothing new (the flag
//! expires by itself, so a dead rebuild cannot hold it for long); when the
//! pointer moves it lets every batch in flight finish where it started, then
//! points its applier, its rebalance fence reader and its routing registry at
//! the new generation and restarts every owned partition at that
//! generation's fences. Nothing it buffered is carried over: the new fences
//! alone say what is left to apply, and a write racing another writer of the
//! same generation (the rebuild finishing its last batch) is settled by them.
//!
//! The pointer only moves forward. One that names an older generation (a
//! failover lost the switch) is not followed: readers never go back either,
//! so writers going back would write counts no reader reads. It is logged and
//! counted (`tally_generation_backwards_total`), the pipeline keeps writing
//! the generation it has, and records that generation as the pointer's
//! `highest`, so that a writer started later refuses to start on the older
//! one and readers report it (see [`generation::Backwards`]).

use std::time::{Duration, Instant};

use futures::StreamExt;
use rdkafka::consumer::Consumer;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::reader::View;
use super::{Pipeline, RunError, intake};
use crate::domain::versions::RouteWatch;
use crate::domain::{generation, layout};
use crate::pipeline::apply::ApplyError;

impl Pipeline {
    /// Applies what the generation watch last read: a freeze starts or ends,
    /// or the pointer moved.
    pub(super) async fn follow_generation(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<(), RunError> {
        let Some(following) = self.following.as_mut() else {
            return Ok(());
        };
        let state = following.watch.current();
        if state.current < following.current {
            if following.refused_back != Some(state.current) {
                following.refused_back = Some(state.current);
                following.highest_recorded = false;
                crate::infra::metrics::generation_backwards();
                error!(
                    pointer = state.current,
                    writing = following.current,
                    "The generation pointer went back (a failover lost the switch?); still writing the newer generation, and later starts are refused until the pointer names it again: HSET <prefix>:generation current N."
                );
            }
            if !following.highest_recorded && state.highest < following.current {
                let base = self.settings.store.prefix();
                match generation::record_highest(self.applier.store(), base, following.current)
                    .await
                {
                    Ok(()) => following.highest_recorded = true,
                    Err(error) => {
                        warn!(%error, "Recording the generation written beside the pointer failed; retrying.");
                    }
                }
            }
            return Ok(());
        }
        if state.current != following.current {
            return self.switch_generation(state.current, shutdown).await;
        }
        match (state.frozen_for, following.frozen_since) {
            (Some(next), None) => {
                following.frozen_since = Some(Instant::now());
                info!(
                    generation = following.current,
                    next, "Freeze: holding new batches until the generation switch."
                );
            }
            (None, Some(since)) => {
                following.frozen_since = None;
                info!(
                    paused_ms = since.elapsed().as_millis() as u64,
                    "Freeze lifted without a switch; dispatching again."
                );
            }
            _ => {}
        }
        Ok(())
    }

    /// Moves every owned partition to generation `k`: lands the batches in
    /// flight, points the keys at `k`, then restarts each partition at its
    /// fences there.
    async fn switch_generation(
        &mut self,
        k: u64,
        shutdown: &CancellationToken,
    ) -> Result<(), RunError> {
        let following = self.following.as_ref().expect("following a pointer");
        let began = following.frozen_since.unwrap_or_else(Instant::now);
        let from = following.current;
        // Batches in flight land where they started; the new generation's
        // fences decide what is applied there again.
        while let Some(joined) = self.in_flight.next().await {
            self.finish(joined)?;
        }
        self.apply_rebalances();
        if !self.write_generation(k, shutdown).await {
            return Ok(());
        }
        let partitions: Vec<i32> = self.owned.keys().copied().collect();
        for &partition in &partitions {
            if !self.restart_in(partition, k).await? {
                return Ok(());
            }
        }
        self.retry_seeks();
        self.blocked = false;
        let following = self.following.as_mut().expect("following a pointer");
        following.current = k;
        following.frozen_since = None;
        info!(
            from,
            generation = k,
            partitions = partitions.len(),
            paused_ms = began.elapsed().as_millis() as u64,
            "Switched to generation."
        );
        Ok(())
    }

    /// Points the applier, the rebalance fence reader and the routing
    /// registry at generation `k`; `false` when shutdown came first.
    async fn write_generation(&mut self, k: u64, shutdown: &CancellationToken) -> bool {
        let base = self.settings.store.prefix();
        // A generation keeps the packing its rebuild recorded before writing it.
        let packing = loop {
            match layout::read_packing(self.applier.store(), base, k).await {
                Ok(packing) => break packing,
                Err(error) => {
                    warn!(%error, generation = k, "Reading the new generation's layout failed; retrying.");
                    if shutdown.is_cancelled() {
                        return false;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        let keys = self
            .applier
            .keys()
            .with_prefix(generation::prefix_of(base, k))
            .with_packing(packing);
        self.applier = self.applier.with_keys(keys.clone());
        self.consumer
            .context()
            .set_fences(self.applier.fence_reader().clone());
        self.route_stop.cancel();
        self.route_stop = shutdown.child_token();
        self.routes = self.routes.with_keys(keys);
        let every = self.settings.hot.route_refresh;
        self.watch = loop {
            match RouteWatch::start(self.routes.clone(), every, self.route_stop.clone()).await {
                Ok(watch) => break watch,
                Err(error) => {
                    warn!(%error, generation = k, "Reading the new generation's registry failed; retrying.");
                    if shutdown.is_cancelled() {
                        return false;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        self.table = self.watch.current();
        self.reading.set_view(View {
            groups: self.applier.keys().groups().clone(),
            windows: self.applier.keys().windows().clone(),
            watch: self.watch.clone(),
        });
        true
    }

    /// Restarts one owned partition at its fences in generation `k`;
    /// `false` when shutdown came first.
    async fn restart_in(&mut self, partition: i32, k: u64) -> Result<bool, RunError> {
        let found = match self.applier.fences(partition, &self.abandon).await {
            Ok(found) => found,
            Err(ApplyError::Cancelled) => return Ok(false),
            Err(source) => return Err(RunError::Apply { partition, source }),
        };
        self.epochs += 1;
        let Some(slot) = self.owned.get(&partition).cloned() else {
            return Ok(true);
        };
        let state = &mut *slot.lock();
        let before = state
            .known
            .as_ref()
            .map(|(_, t)| t.resume_at())
            .or(state.next);
        state.epoch = self.epochs;
        state.batch.clear();
        state.letters.clear();
        state.buffer_sent();
        state.verified_at = Instant::now();
        state.advanced_at.fill(Instant::now());
        match found.tracker() {
            Some(known) => {
                let resume = known.1.resume_at();
                state.known = Some(known);
                state.assigned = None;
                state.next = Some(resume);
                state.seek_to(resume);
            }
            None => {
                // The new generation never counted this partition: start
                // it where this consumer was, which becomes its origin.
                warn!(
                    partition,
                    generation = k,
                    "No origin in the new generation; counting from the current position."
                );
                state.known = None;
                state.assigned = Some(found);
                state.next = before;
                match before {
                    Some(before) => state.seek_to(before),
                    // A reader places its consumer where the group left it.
                    None => state.placing = state.read_apart,
                }
            }
        }
        intake::restart_window(partition, state, self.settings.dedupe);
        Ok(true)
    }
}
