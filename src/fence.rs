//! Fence: the decision that makes applying a batch exactly-once.
//!
//! A fence is the last Kafka offset of one (group, topic, partition) whose
//! effects are in Redis. It is stored beside the counters and advanced in the
//! same atomic Lua script as the increments it covers (`apply.lua`), so counts
//! and fence can only move, or roll back, together.
//!
//! A batch claims the contiguous offset range `start..=last`: `start` is the
//! position the consumer read from (not merely its first message), so a batch
//! also vouches for offsets that held no message. The decision:
//!
//! * no fence and none expected: **apply** (first batch ever);
//! * `fence + 1 == start`: **apply**; the batch continues exactly where Redis is;
//! * `fence >= last`: **duplicate**; everything is already in, do nothing;
//! * `start <= fence < last`: **straddle**; part is in. Tally refuses the batch
//!   and resumes reading at `fence + 1`, rebuilding the delta from the events
//!   above the fence (two consumers cut different batch boundaries);
//! * `fence + 1 < start`, or no fence where one was expected: **gap**; Redis lost
//!   writes (restart from an AOF missing its last second, failover to a lagging
//!   replica). Tally refuses and replays from `fence + 1`, or from the start of
//!   the log when the fence itself is gone.
//!
//! An empty range `next..=next-1` is a probe: a caught-up consumer sends one
//! now and then, so a Redis that rolled back is noticed (as a gap) even when no
//! new event arrives to reveal it.
//!
//! Only "apply" writes, and it writes exactly offsets `fence+1..=last`, so every
//! offset is counted once however batches are cut, retried, reordered or raced
//! by a zombie. `apply.lua` implements this same table; the tests in
//! `tests/apply_script.rs` check the two agree case by case.

/// What to do with a batch covering `start..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Apply the whole batch and set the fence to `last`.
    Apply,
    /// Everything is applied already; the batch is a no-op.
    Duplicate,
    /// Part of the batch is applied: resume reading at the given offset.
    Straddle {
        /// `fence + 1`.
        resume: i64,
    },
    /// Redis is behind the batch: resume reading at `resume`
    /// (`None`: the fence is gone, replay from the start of the log).
    Gap {
        /// `fence + 1`, or `None` when there is no fence.
        resume: Option<i64>,
    },
}

/// Decides the fate of a batch covering `start..=last` against `fence`.
///
/// `expect_fence` says the consumer has seen a fence for this partition in this
/// assignment, so its absence means Redis lost it.
pub fn decide(fence: Option<i64>, start: i64, last: i64, expect_fence: bool) -> Decision {
    debug_assert!(start <= last + 1, "batch range {start}..={last}");
    match fence {
        None if expect_fence => Decision::Gap { resume: None },
        None => Decision::Apply,
        Some(f) if f >= last => Decision::Duplicate,
        Some(f) if f + 1 == start => Decision::Apply,
        Some(f) if f + 1 < start => Decision::Gap {
            resume: Some(f + 1),
        },
        Some(f) => Decision::Straddle { resume: f + 1 },
    }
}

/// Wire codes shared with `apply.lua`.
impl Decision {
    /// The code `apply.lua` returns for this decision.
    pub fn code(self) -> i64 {
        match self {
            Decision::Apply => 0,
            Decision::Duplicate => 1,
            Decision::Straddle { .. } => 2,
            Decision::Gap { .. } => 3,
        }
    }

    /// Rebuilds a decision from `apply.lua`'s reply `(code, fence)`, where
    /// `fence` is -1 when the fence key is absent.
    pub fn from_reply(code: i64, fence: i64) -> Option<Decision> {
        let fence = (fence >= 0).then_some(fence);
        match code {
            0 => Some(Decision::Apply),
            1 => Some(Decision::Duplicate),
            2 => Some(Decision::Straddle { resume: fence? + 1 }),
            3 => Some(Decision::Gap {
                resume: fence.map(|f| f + 1),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn the_decision_table() {
        assert_eq!(decide(None, 0, 9, false), Decision::Apply);
        assert_eq!(decide(None, 0, 9, true), Decision::Gap { resume: None });
        assert_eq!(decide(Some(9), 10, 19, true), Decision::Apply);
        assert_eq!(decide(Some(19), 10, 19, true), Decision::Duplicate);
        assert_eq!(decide(Some(25), 10, 19, true), Decision::Duplicate);
        assert_eq!(
            decide(Some(14), 10, 19, true),
            Decision::Straddle { resume: 15 }
        );
        assert_eq!(
            decide(Some(10), 10, 19, true),
            Decision::Straddle { resume: 11 }
        );
        assert_eq!(
            decide(Some(4), 10, 19, true),
            Decision::Gap { resume: Some(5) }
        );
        // An empty range at the consumer's position probes the fence.
        assert_eq!(decide(Some(9), 10, 9, true), Decision::Duplicate);
        assert_eq!(
            decide(Some(6), 10, 9, true),
            Decision::Gap { resume: Some(7) }
        );
        assert_eq!(decide(None, 10, 9, true), Decision::Gap { resume: None });
    }

    #[test]
    fn reply_codes_round_trip() {
        for d in [
            Decision::Apply,
            Decision::Duplicate,
            Decision::Straddle { resume: 8 },
            Decision::Gap { resume: Some(3) },
            Decision::Gap { resume: None },
        ] {
            let fence = match d {
                Decision::Straddle { resume } => resume - 1,
                Decision::Gap { resume } => resume.map_or(-1, |r| r - 1),
                _ => 0,
            };
            assert_eq!(Decision::from_reply(d.code(), fence), Some(d));
        }
        assert_eq!(Decision::from_reply(7, 0), None);
    }

    /// The store as Redis holds it: counts per key and the fence.
    #[derive(Clone, Default, Debug)]
    struct Store {
        counts: HashMap<u8, i64>,
        fence: Option<i64>,
    }

    /// A consumer that reads the log from a position and cuts batches of its own choosing.
    struct Consumer {
        next: i64,
        expect_fence: bool,
        cuts: Vec<usize>,
        turn: usize,
    }

    impl Consumer {
        /// Builds the next batch, offers it to the store, and reacts to the decision.
        fn step(&mut self, log: &[(u8, i64)], store: &mut Store) -> Option<Decision> {
            let len = log.len() as i64;
            let (start, last) = if self.next >= len {
                // Caught up: an empty range probes the fence, so a Redis that
                // rolled back is noticed even when no new event arrives.
                if self.next == 0 {
                    return None;
                }
                (self.next, self.next - 1)
            } else {
                let size = self.cuts[self.turn % self.cuts.len()] as i64;
                self.turn += 1;
                (self.next, (self.next + size - 1).min(len - 1))
            };
            let decision = decide(store.fence, start, last, self.expect_fence);
            match decision {
                Decision::Apply => {
                    for &(key, delta) in &log[start as usize..(last + 1) as usize] {
                        *store.counts.entry(key).or_default() += delta;
                    }
                    store.fence = Some(last);
                    self.next = last + 1;
                    self.expect_fence = true;
                }
                Decision::Duplicate => {
                    self.next = last + 1;
                    self.expect_fence = true;
                }
                Decision::Straddle { resume }
                | Decision::Gap {
                    resume: Some(resume),
                } => {
                    self.next = resume;
                    self.expect_fence = true;
                }
                Decision::Gap { resume: None } => {
                    self.next = 0;
                    self.expect_fence = false;
                }
            }
            Some(decision)
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        StepA,
        StepB,
        /// Redis restarts from an older snapshot: counts and fence roll back together.
        Rollback(usize),
        /// Consumer B is reassigned and resumes at the fence it reads.
        RestartAtFence,
        /// Consumer B is reassigned but could not read the fence: it resumes at
        /// Kafka's committed offset, which may be behind or (after a rollback) ahead.
        RestartAtCommitted,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => Just(Op::StepA),
            6 => Just(Op::StepB),
            1 => (0usize..8).prop_map(Op::Rollback),
            1 => Just(Op::RestartAtFence),
            1 => Just(Op::RestartAtCommitted),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Two consumers with different batch boundaries race over one
        /// partition, Redis rolls back at random, B is reassigned at random, and
        /// after every step the store holds exactly the log's prefix up to the
        /// fence; at the end it holds the whole log: every offset counted once.
        #[test]
        fn random_interleavings_count_every_offset_once(
            log in proptest::collection::vec((0u8..6, prop_oneof![Just(1i64), Just(-1i64), Just(0i64)]), 1..120),
            cuts_a in proptest::collection::vec(1usize..25, 1..6),
            cuts_b in proptest::collection::vec(1usize..25, 1..6),
            ops in proptest::collection::vec(op(), 0..80),
        ) {
            let mut store = Store::default();
            let mut snapshots = vec![store.clone()];
            let mut committed = 0i64;
            let mut a = Consumer { next: 0, expect_fence: false, cuts: cuts_a, turn: 0 };
            let mut b = Consumer { next: 0, expect_fence: false, cuts: cuts_b, turn: 0 };
            for op in ops {
                match op {
                    Op::StepA | Op::StepB => {
                        let consumer = if matches!(op, Op::StepA) { &mut a } else { &mut b };
                        let decision = consumer.step(&log, &mut store);
                        if matches!(decision, Some(Decision::Apply | Decision::Duplicate)) {
                            // Kafka commits after success; the latest commit wins.
                            committed = consumer.next;
                        }
                    }
                    Op::Rollback(back) => {
                        let i = snapshots.len().saturating_sub(1 + back);
                        // Losing the fence key entirely while Kafka holds a commit is
                        // total loss of Redis, which no fence can detect: out of model.
                        if snapshots[i].fence.is_some() || committed == 0 {
                            store = snapshots[i].clone();
                        }
                    }
                    Op::RestartAtFence => {
                        b.next = store.fence.map_or(committed, |f| f + 1);
                        b.expect_fence = store.fence.is_some();
                    }
                    Op::RestartAtCommitted => {
                        b.next = committed;
                        b.expect_fence = false;
                    }
                }
                snapshots.push(store.clone());
                let applied = store.fence.map_or(0, |f| f as usize + 1);
                let mut expected: HashMap<u8, i64> = HashMap::new();
                for &(key, delta) in &log[..applied] {
                    *expected.entry(key).or_default() += delta;
                }
                expected.retain(|_, v| *v != 0);
                let mut got = store.counts.clone();
                got.retain(|_, v| *v != 0);
                prop_assert_eq!(got, expected);
            }
            // Drain: B, the consumer that owns the partition now, reaches the end.
            for _ in 0..10_000 {
                if store.fence == Some(log.len() as i64 - 1) { break; }
                let _ = b.step(&log, &mut store);
            }
            prop_assert_eq!(store.fence, Some(log.len() as i64 - 1));
        }
    }
}
