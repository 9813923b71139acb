//! Slots: Redis Cluster hash slots and tally's slot groups.
//!
//! Invariant: every key one script touches lies in one hash slot. On a
//! cluster, tally places each counter key in one of `G` slot groups by
//! appending a computed hash tag (`{<tag>}`) chosen so that group `g`'s keys
//! all hash to one slot `s(g)`. A script then covers one group: its counters
//! and the group's own fence, so it never meets CROSSSLOT.
//!
//! The choice of groups over raw slots, and its costs:
//! * A post is never tagged as a whole: bucket `b` of post `P` goes to group
//!   `(xxh64(P) + b) mod G`, so a post's buckets occupy consecutive groups, and
//!   consecutive groups sit on slots spread over the whole slot range (a
//!   stride permutation), hence on different primaries.
//! * Scripts per batch are bounded by `G` instead of by the number of distinct
//!   slots (up to 16,384), so each script carries many keys: Redis spends
//!   ~2 µs per increment but tens of µs per script call.
//! * Fence keys: `G` per partition (128 groups × 64 partitions = 8,192 small
//!   keys). Slot migration moves whole groups; data occupies only `G` slots,
//!   so `G` should be several times the number of primaries (default 128).
//! * A single server is the case `G = 1` with no tag at all.

use std::sync::Arc;

use xxhash_rust::xxh64::xxh64;

/// Number of hash slots in a Redis Cluster.
pub const SLOTS: u16 = 16_384;

/// CRC16/XMODEM, the checksum Redis Cluster hashes keys with.
pub fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash slot of a key, honouring `{hash tags}` as Redis does.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % SLOTS
}

/// How counter keys are spread over slot groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotGroups {
    /// Hash tag of each group; empty for a single server. Shared, so the
    /// layout is cheap to clone into every batch's task.
    tags: Arc<[String]>,
}

impl SlotGroups {
    /// One group and no tags: the layout for a single Redis server.
    pub fn single() -> Self {
        Self {
            tags: Arc::from([]),
        }
    }

    /// `count` groups for a cluster; `count` must be a power of two ≤ 16,384.
    pub fn cluster(count: u32) -> Self {
        assert!(
            count.is_power_of_two() && count <= u32::from(SLOTS),
            "slot groups: {count}"
        );
        let spacing = u32::from(SLOTS) / count;
        // An odd stride permutes the groups, so neighbouring groups get far-apart slots.
        let stride = (count / 2 + count / 8) | 1;
        let targets: Vec<u16> = (0..count)
            .map(|g| ((g.wrapping_mul(stride) % count) * spacing) as u16)
            .collect();
        let mut tag_of_slot: Vec<Option<String>> = vec![None; SLOTS as usize];
        let mut missing = targets.len();
        let mut n: u64 = 0;
        while missing > 0 {
            let candidate = n.to_string();
            let slot = crc16(candidate.as_bytes()) % SLOTS;
            if tag_of_slot[slot as usize].is_none() {
                if targets.contains(&slot) {
                    missing -= 1;
                }
                tag_of_slot[slot as usize] = Some(candidate);
            }
            n += 1;
        }
        let tags = targets
            .iter()
            .map(|&s| {
                tag_of_slot[s as usize]
                    .clone()
                    .expect("every target slot found")
            })
            .collect();
        Self { tags }
    }

    /// Number of groups (1 for a single server).
    pub fn count(&self) -> u32 {
        self.tags.len().max(1) as u32
    }

    /// Whether keys carry hash tags (cluster layout).
    pub fn is_cluster(&self) -> bool {
        !self.tags.is_empty()
    }

    /// The group of bucket `bucket` of post `post_id`.
    pub fn group_of(&self, post_id: u64, bucket: u32) -> u32 {
        if self.tags.is_empty() {
            return 0;
        }
        let base = xxh64(&post_id.to_le_bytes(), 0);
        (base.wrapping_add(u64::from(bucket)) % self.tags.len() as u64) as u32
    }

    /// The hash tag of a group (`None` on a single server).
    pub fn tag(&self, group: u32) -> Option<&str> {
        self.tags.get(group as usize).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn slots_match_redis() {
        // Values from the Redis Cluster specification and TESTBED measurements.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"post:101:likes:3"), 5587);
        assert_eq!(key_slot(b"post:101:likes:4"), 9524);
        assert_eq!(key_slot(b"{post:101}:likes:3"), 819);
        assert_eq!(key_slot(b"{}x"), key_slot(b"{}x"));
        assert_eq!(key_slot(b"a{}b{c}"), crc16(b"a{}b{c}") % SLOTS);
    }

    #[test]
    fn each_group_is_one_distinct_slot_spread_over_the_range() {
        let groups = SlotGroups::cluster(128);
        let slots: Vec<u16> = (0..128)
            .map(|g| key_slot(format!("x{{{}}}", groups.tag(g).unwrap()).as_bytes()))
            .collect();
        assert_eq!(slots.iter().collect::<HashSet<_>>().len(), 128);
        // Consecutive groups land far apart, so a post's buckets spread over primaries.
        for pair in slots.windows(2) {
            assert!(pair[0].abs_diff(pair[1]) >= 1024, "{pair:?}");
        }
    }

    #[test]
    fn a_posts_buckets_use_distinct_groups() {
        let groups = SlotGroups::cluster(128);
        let used: HashSet<u32> = (0..64).map(|b| groups.group_of(101, b)).collect();
        assert_eq!(used.len(), 64);
        assert_eq!(SlotGroups::single().group_of(101, 5), 0);
    }
}
