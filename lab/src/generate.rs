//! Generate: synthetic like traffic for the demo, the producer and the benchmarks.
//!
//! Posts are drawn from a Zipf distribution (a few posts get most likes), one
//! viral post takes a fixed share of all events, and a fraction of events are
//! unlikes of a like seen recently, so counts behave like real ones. Users take
//! turns: each like is by the next user, so no user likes a post twice within
//! `users` likes, and a like after a like (which `tally run --dedupe
//! ids-and-actions` rightly counts once) never comes up. The generator keeps
//! its own ground truth of what it produced.

use std::collections::VecDeque;

use rand::Rng;
use rand::rngs::SmallRng;
use rand_distr::{Distribution, Zipf};

use tally::domain::proto::Action;

/// Shape of the traffic.
#[derive(Debug, Clone)]
pub struct TrafficShape {
    /// Number of ordinary posts (ids 1..=posts).
    pub posts: u64,
    /// Zipf exponent of post popularity.
    pub zipf_exponent: f64,
    /// Number of distinct users; they like in turns.
    pub users: u64,
    /// Fraction of events that undo a recent like.
    pub unlike_ratio: f64,
    /// The viral post's id.
    pub viral_post: u64,
    /// Fraction of events that go to the viral post.
    pub viral_share: f64,
}

impl Default for TrafficShape {
    fn default() -> Self {
        Self {
            posts: 100_000,
            zipf_exponent: 1.1,
            users: 10_000_000,
            unlike_ratio: 0.1,
            viral_post: 4_242,
            viral_share: 0.15,
        }
    }
}

/// One generated event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generated {
    /// The post.
    pub post_id: u64,
    /// The user.
    pub user_id: u64,
    /// Like or unlike.
    pub action: Action,
}

impl Generated {
    /// +1 or -1.
    pub fn delta(&self) -> i64 {
        if self.action == Action::Like { 1 } else { -1 }
    }
}

/// A deterministic event source for a given seed.
pub struct Traffic {
    shape: TrafficShape,
    zipf: Zipf<f64>,
    rng: SmallRng,
    recent_likes: VecDeque<(u64, u64)>,
    /// Likes made so far, from a seeded start: picks the next user.
    turn: u64,
}

impl Traffic {
    /// A generator with its own seed.
    pub fn new(shape: TrafficShape, seed: u64) -> Self {
        use rand::SeedableRng;
        let zipf = Zipf::new(shape.posts as f64, shape.zipf_exponent).expect("valid Zipf shape");
        let mut rng = SmallRng::seed_from_u64(seed);
        let turn = rng.random_range(0..shape.users.max(1));
        Self {
            shape,
            zipf,
            rng,
            recent_likes: VecDeque::with_capacity(4096),
            turn,
        }
    }

    /// The next event.
    pub fn next_event(&mut self) -> Generated {
        if self.rng.random_bool(self.shape.unlike_ratio) {
            let len = self.recent_likes.len();
            if len > 0 {
                let i = self.rng.random_range(0..len);
                let (post_id, user_id) = self
                    .recent_likes
                    .swap_remove_back(i)
                    .expect("index in range");
                return Generated {
                    post_id,
                    user_id,
                    action: Action::Unlike,
                };
            }
        }
        let post_id = if self.rng.random_bool(self.shape.viral_share) {
            self.shape.viral_post
        } else {
            let p = self.zipf.sample(&mut self.rng) as u64;
            // Keep the viral id for the viral stream only.
            if p == self.shape.viral_post {
                p + self.shape.posts
            } else {
                p
            }
        };
        let user_id = self.turn % self.shape.users.max(1) + 1;
        self.turn += 1;
        if self.recent_likes.len() == self.recent_likes.capacity() {
            self.recent_likes.pop_front();
        }
        self.recent_likes.push_back((post_id, user_id));
        Generated {
            post_id,
            user_id,
            action: Action::Like,
        }
    }

    /// The viral post's id.
    pub fn viral_post(&self) -> u64 {
        self.shape.viral_post
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn traffic_is_skewed_has_unlikes_and_never_goes_negative() {
        let mut traffic = Traffic::new(
            TrafficShape {
                posts: 1000,
                viral_share: 0.3,
                ..TrafficShape::default()
            },
            7,
        );
        let mut counts: HashMap<u64, i64> = HashMap::new();
        let mut unlikes = 0;
        for _ in 0..100_000 {
            let e = traffic.next_event();
            *counts.entry(e.post_id).or_default() += e.delta();
            unlikes += i64::from(e.action == Action::Unlike);
        }
        let viral = counts[&traffic.viral_post()];
        let top_other = counts
            .iter()
            .filter(|(p, _)| **p != traffic.viral_post())
            .map(|(_, c)| *c)
            .max()
            .unwrap();
        assert!(viral > top_other, "viral {viral} vs {top_other}");
        assert!((5_000..15_000).contains(&unlikes), "{unlikes} unlikes");
        assert!(counts.values().all(|&c| c >= 0));
    }

    #[test]
    fn no_user_likes_a_post_twice_within_a_turn_of_the_users() {
        let mut traffic = Traffic::new(
            TrafficShape {
                posts: 50,
                viral_share: 0.3,
                users: 200_000,
                ..TrafficShape::default()
            },
            3,
        );
        let mut liked = std::collections::HashSet::new();
        for _ in 0..150_000 {
            let e = traffic.next_event();
            if e.action == Action::Like {
                assert!(liked.insert((e.post_id, e.user_id)), "{e:?} liked twice");
            }
        }
    }

    #[test]
    fn same_seed_same_stream() {
        let mut a = Traffic::new(TrafficShape::default(), 1);
        let mut b = Traffic::new(TrafficShape::default(), 1);
        for _ in 0..1000 {
            assert_eq!(a.next_event(), b.next_event());
        }
    }
}
