//! What the running writers' watches share: a recheck every period until
//! shutdown, and a finding that is logged when it first appears (or becomes
//! another problem) and when it clears, never at every recheck.
//!
//! Invariant: a problem a watch finds is an ERROR line once per distinct
//! problem and stays on its gauge for as long as it lasts; a watch that
//! cannot read what it checks changes neither.

use tokio::time::{Interval, interval};
use tokio_util::sync::CancellationToken;

/// Ticks every `period`, the first tick a full period from now.
pub(super) async fn rechecks(period: std::time::Duration) -> Interval {
    let mut every = interval(period);
    every.tick().await;
    every
}

/// Waits for the next tick; false once `shutdown` is cancelled.
pub(super) async fn next_tick(every: &mut Interval, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = every.tick() => true,
    }
}

/// The last problem a watch reported, if it still lasts.
#[derive(Debug)]
pub(super) struct Finding<P> {
    reported: Option<P>,
}

/// What one recheck changed.
#[derive(Debug, PartialEq)]
pub(super) enum Change<'a, P> {
    /// A problem not reported before (none was, or another one was).
    Appeared(&'a P),
    /// The reported problem is gone.
    Cleared,
    /// Nothing to log.
    Same,
}

impl<P: PartialEq> Finding<P> {
    pub(super) fn new() -> Self {
        Self { reported: None }
    }

    /// Notes this recheck's problem (`None`: none found).
    pub(super) fn update(&mut self, now: Option<P>) -> Change<'_, P> {
        match now {
            Some(problem) if self.reported.as_ref() != Some(&problem) => {
                Change::Appeared(self.reported.insert(problem))
            }
            Some(_) => Change::Same,
            None if self.reported.take().is_some() => Change::Cleared,
            None => Change::Same,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_is_news_once_until_it_changes_or_clears() {
        let mut finding = Finding::new();
        assert_eq!(finding.update(None), Change::Same);
        assert_eq!(finding.update(Some("a")), Change::Appeared(&"a"));
        assert_eq!(finding.update(Some("a")), Change::Same);
        assert_eq!(finding.update(Some("b")), Change::Appeared(&"b"));
        assert_eq!(finding.update(None), Change::Cleared);
        assert_eq!(finding.update(None), Change::Same);
        assert_eq!(finding.update(Some("b")), Change::Appeared(&"b"));
    }

    #[tokio::test]
    async fn rechecks_wait_a_period_and_stop_at_shutdown() {
        let period = std::time::Duration::from_millis(50);
        let start = tokio::time::Instant::now();
        let shutdown = CancellationToken::new();
        let mut every = rechecks(period).await;
        assert!(next_tick(&mut every, &shutdown).await);
        assert!(start.elapsed() >= period, "{:?}", start.elapsed());
        shutdown.cancel();
        assert!(!next_tick(&mut every, &shutdown).await);
    }
}
