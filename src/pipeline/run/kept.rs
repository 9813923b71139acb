//! Kept windows: the dedupe windows of partitions this consumer gave up, kept
//! for a while in case they come back (a group that scaled out scaling in, a
//! member that left and returned), so that a partition coming back re-reads
//! only the offsets its other owners applied meanwhile, not its whole window.
//!
//! Invariant kept here: a kept window is handed back only when it equals,
//! after the re-read of the offsets between, the window a fresh re-read
//! would build. It has seen the log of its partition, counted from the same
//! origin, in offset order up to its `next()`; a window's verdicts are a
//! function of the log (see [`crate::pipeline::dedupe`]), so reading on from
//! there to the new resume offset reaches the same state, as long as
//!
//! * the origin is the one it was built from (a rebuild or a reset starts
//!   another),
//! * its `next()` is not above the resume offset: a window that judged
//!   records its owner never applied (a batch dropped at the revocation, a
//!   fence rolled back since) would find those records in itself when they
//!   come again, and
//! * its `next()` is not below where a fresh window would start: re-reading
//!   from further back than that would be longer than starting afresh.
//!
//! Anything else gets a fresh window and the whole re-read. Kept windows
//! never outnumber, with the owned ones, the most partitions this consumer
//! has owned at once, so keeping them never raises its memory above that
//! peak; each is dropped after [`KEEP_FOR`].

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::infra::metrics;
use crate::pipeline::dedupe::Window;

/// How long the window of a partition given up is kept.
pub(super) const KEEP_FOR: Duration = Duration::from_secs(600);

/// A partition's window, with the origin it was built from.
#[derive(Debug)]
struct Kept {
    origin: i64,
    window: Window,
    since: Instant,
}

/// The windows of partitions given up, by partition.
#[derive(Debug, Default)]
pub(super) struct KeptWindows {
    kept: HashMap<i32, Kept>,
    /// The most partitions owned at once.
    most_owned: usize,
}

impl KeptWindows {
    /// Notes that `owned` partitions are owned now.
    pub(super) fn owning(&mut self, owned: usize) {
        self.most_owned = self.most_owned.max(owned);
        self.trim(owned, Instant::now());
    }

    /// Keeps the window of `partition`, given up while `owned` others are
    /// still owned; `origin` is the one the window was built from.
    pub(super) fn keep(&mut self, partition: i32, origin: i64, window: Window, owned: usize) {
        if window.next().is_none() {
            return;
        }
        let since = Instant::now();
        self.kept.insert(
            partition,
            Kept {
                origin,
                window,
                since,
            },
        );
        self.trim(owned, since);
    }

    /// Takes back the window of `partition`, if one is kept that a consumer
    /// resuming at `resume` and re-reading from `from` (for `origin`) can
    /// use; the one kept is dropped either way.
    pub(super) fn take(
        &mut self,
        partition: i32,
        origin: i64,
        from: i64,
        resume: i64,
    ) -> Option<Window> {
        let kept = self.kept.remove(&partition)?;
        metrics::dedupe_windows_kept(self.kept.len());
        let next = kept.window.next()?;
        let fits = kept.origin == origin
            && (from..=resume).contains(&next)
            && kept.since.elapsed() < KEEP_FOR;
        fits.then_some(kept.window)
    }

    /// Drops the windows kept for [`KEEP_FOR`], and the oldest ones while
    /// kept and `owned` windows outnumber the most partitions owned at once.
    pub(super) fn trim(&mut self, owned: usize, now: Instant) {
        self.kept
            .retain(|_, k| now.saturating_duration_since(k.since) < KEEP_FOR);
        while !self.kept.is_empty() && self.kept.len() + owned > self.most_owned {
            let oldest = self
                .kept
                .iter()
                .min_by_key(|(_, k)| k.since)
                .map(|(&p, _)| p);
            if let Some(p) = oldest {
                self.kept.remove(&p);
            }
        }
        metrics::dedupe_windows_kept(self.kept.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::dedupe::{DedupeMode, DedupeSettings};

    const DEDUPE: DedupeSettings = DedupeSettings {
        mode: DedupeMode::Ids,
        span: 400,
    };

    /// A window that has seen the log up to `next - 1`.
    fn window_to(next: i64) -> Window {
        let mut window = Window::new(DEDUPE, Some(next - 10));
        for offset in next - 10..next {
            window.pass(offset);
        }
        window
    }

    #[test]
    fn a_window_comes_back_when_it_has_seen_no_more_than_the_fences_and_no_less_than_a_fresh_one_would()
     {
        let mut kept = KeptWindows::default();
        kept.owning(2);
        kept.keep(3, 0, window_to(900), 1);
        let window = kept.take(3, 0, 500, 1_000).expect("kept");
        assert_eq!(window.next(), Some(900));
        assert!(kept.take(3, 0, 500, 1_000).is_none(), "taken once");

        // Resuming exactly where it stopped reads nothing more.
        kept.keep(3, 0, window_to(1_000), 1);
        assert!(kept.take(3, 0, 500, 1_000).is_some());
    }

    #[test]
    fn a_window_that_judged_records_above_the_fences_is_not_used() {
        let mut kept = KeptWindows::default();
        kept.owning(2);
        kept.keep(3, 0, window_to(1_200), 1);
        assert!(kept.take(3, 0, 500, 1_000).is_none());
    }

    #[test]
    fn a_window_of_another_origin_or_further_back_than_a_fresh_one_is_not_used() {
        let mut kept = KeptWindows::default();
        kept.owning(2);
        kept.keep(3, 0, window_to(900), 1);
        assert!(kept.take(3, 100, 500, 1_000).is_none(), "another origin");
        kept.keep(3, 0, window_to(400), 1);
        assert!(kept.take(3, 0, 500, 1_000).is_none(), "behind a fresh one");
    }

    #[test]
    fn kept_and_owned_windows_never_outnumber_the_most_owned_at_once() {
        let mut kept = KeptWindows::default();
        kept.owning(3);
        kept.keep(1, 0, window_to(900), 2);
        kept.keep(2, 0, window_to(900), 1);
        kept.keep(3, 0, window_to(900), 0);
        assert_eq!(kept.kept.len(), 3);
        // Two partitions assigned: the oldest kept window goes.
        kept.owning(2);
        assert_eq!(kept.kept.len(), 1);
        assert!(kept.take(3, 0, 500, 1_000).is_some());
        kept.keep(1, 0, window_to(900), 2);
        kept.trim(2, Instant::now() + KEEP_FOR);
        assert!(kept.kept.is_empty(), "dropped after KEEP_FOR");
    }
}
