//! Routing: which Redis key a like lands in.
//!
//! Invariant: the mapping `user_id -> bucket` is a pure function of the user id
//! and the bucket count, fixed forever. A user's like and later unlike of a post
//! therefore hit the same bucket, so every bucket stays a meaningful partial sum.
//!
//! The stable hash is **XXH64 with seed 0 over the user id encoded as 8
//! little-endian bytes**; `bucket = hash % buckets`. It is part of the public
//! contract: the test vectors below are published in docs/design.md and must never
//! change. A new scheme would need a new key version, never a silent swap.

use std::fmt::Write as _;

use xxhash_rust::xxh64::xxh64;

use std::sync::Arc;

use crate::domain::packing::{Packing, Splits, field_hash};
use crate::domain::slots::SlotGroups;
use crate::domain::windows::{WindowSize, Windows};

/// Seed of the stable hash. Part of the public contract.
pub const STABLE_HASH_SEED: u64 = 0;

/// The stable hash of a user id: XXH64(seed 0) of its 8 little-endian bytes.
pub fn stable_hash(user_id: u64) -> u64 {
    xxh64(&user_id.to_le_bytes(), STABLE_HASH_SEED)
}

/// The bucket a user's likes of any post land in, for a post split `buckets` ways.
///
/// `buckets` must be at least 1 (validated at start-up).
pub fn bucket_of(user_id: u64, buckets: u32) -> u32 {
    debug_assert!(buckets > 0);
    (stable_hash(user_id) % u64::from(buckets)) as u32
}

/// The user ids whose hashes docs/design.md publishes.
pub const PUBLISHED_USERS: [u64; 10] = [
    0,
    1,
    2,
    42,
    101,
    1000,
    123_456_789,
    1 << 32,
    1 << 63,
    u64::MAX,
];

/// Version numbers from here up name the later epochs of the default layout:
/// `DEFAULT_EPOCHS + e` is epoch `e` (e >= 1), published by `tally rebucket`
/// for every post at once. Epoch 0 is version 0. A post's own versions are
/// numbered from 1 by its route hash and stay far below.
pub const DEFAULT_EPOCHS: u32 = 1 << 31;

/// The version number of epoch `epoch` of the default layout.
pub fn epoch_version(epoch: u32) -> u32 {
    if epoch == 0 {
        0
    } else {
        DEFAULT_EPOCHS + epoch
    }
}

/// How people name a version number: `version 3`, or `default epoch 1`.
pub fn version_name(version: u32) -> String {
    if version > DEFAULT_EPOCHS {
        format!("default epoch {}", version - DEFAULT_EPOCHS)
    } else {
        format!("version {version}")
    }
}

/// One counter: a bucket of one routing version of a post.
///
/// Version 0 is the default layout every post starts with; versions 1 and up
/// are created by promotion and demotion (see [`crate::domain::versions`]),
/// and versions from [`DEFAULT_EPOCHS`] up by a change of the default bucket
/// count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterId {
    /// The post.
    pub post_id: u64,
    /// The routing version whose buckets the like went to.
    pub version: u32,
    /// The bucket of that version the user hashes to.
    pub bucket: u32,
}

impl CounterId {
    /// A bucket of the default layout (version 0).
    pub fn v0(post_id: u64, bucket: u32) -> Self {
        Self {
            post_id,
            version: 0,
            bucket,
        }
    }
}

/// Names every Redis key tally writes, under one prefix.
///
/// Counter keys are `<prefix>:likes:<post_id>:<bucket>` for version 0,
/// `<prefix>:likes:<post_id>:v<version>:b<bucket>` for a post's own versions
/// and `<prefix>:likes:<post_id>:d<epoch>:b<bucket>` for a later epoch of the
/// default layout,
/// followed on a cluster by `:{<tag>}`, the computed hash tag of the key's
/// slot group (see [`crate::domain::slots`]). The sum of all keys matching
/// `<prefix>:likes:<post_id>:*` (plus the optional base of the post's routing
/// metadata) is the post's count, and nothing else ever matches that pattern.
/// Fences live under `<prefix>:fence:`, origins under `<prefix>:origin:`,
/// routing metadata under `<prefix>:route:`.
///
/// A packed generation (see [`crate::domain::packing`]) keeps the same
/// counters as fields of `<prefix>:packed:<n>[:{<tag>}]` instead, the field
/// being the string key's tail after `likes:` with the post id written as a
/// signed integer.
///
/// Windows of trending counts (see [`crate::domain::windows`]) are hashes
/// of counts `<prefix>:win:<size>:<start>[:{<tag>}]`, each beside a sorted
/// set of its leaders `<prefix>:top:<size>:<start>[:{<tag>}]`.
#[derive(Debug, Clone)]
pub struct KeyLayout {
    prefix: String,
    groups: SlotGroups,
    packing: Packing,
    windows: Arc<Windows>,
}

/// Where one counter is kept: a string key, or a field of a hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The key.
    pub key: String,
    /// The field of the hash `key`, when the generation is packed.
    pub field: Option<String>,
}

impl Place {
    /// The key, and the field when there is one: `tally:packed:7 42`.
    pub fn shown(&self) -> String {
        match &self.field {
            Some(field) => format!("{} {field}", self.key),
            None => self.key.clone(),
        }
    }
}

impl KeyLayout {
    /// The single-server layout rooted at `prefix` (for example `tally`).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self::with_groups(prefix, SlotGroups::single())
    }

    /// A layout with the given slot groups.
    pub fn with_groups(prefix: impl Into<String>, groups: SlotGroups) -> Self {
        Self {
            prefix: prefix.into(),
            groups,
            packing: Packing::Strings,
            windows: Arc::new(Windows::none()),
        }
    }

    /// The same layout under another prefix (a key generation, see
    /// [`crate::domain::generation`]), with the same packing.
    pub fn with_prefix(&self, prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            ..self.clone()
        }
    }

    /// The same layout keeping its counters as `packing` says.
    pub fn with_packing(&self, packing: Packing) -> Self {
        Self {
            packing,
            ..self.clone()
        }
    }

    /// How the counters are kept.
    pub fn packing(&self) -> &Packing {
        &self.packing
    }

    /// The same layout keeping `windows` too.
    pub fn with_windows(&self, windows: Windows) -> Self {
        Self {
            windows: Arc::new(windows),
            ..self.clone()
        }
    }

    /// The windows of trending counts kept beside the counters.
    pub fn windows(&self) -> &Windows {
        &self.windows
    }

    /// Writes the key of the counts of window `start` of `size` in slot
    /// group `group` into `out`, replacing its contents.
    pub fn write_window_key(&self, out: &mut String, size: WindowSize, start: i64, group: u32) {
        out.clear();
        let _ = write!(out, "{}:win:{size}:{start}", self.prefix);
        self.write_tag(out, group);
    }

    /// Writes the key of the leaders of window `start` of `size` in slot
    /// group `group` into `out`, replacing its contents.
    pub fn write_leaders_key(&self, out: &mut String, size: WindowSize, start: i64, group: u32) {
        out.clear();
        let _ = write!(out, "{}:top:{size}:{start}", self.prefix);
        self.write_tag(out, group);
    }

    /// The counts of window `start` of `size` that hold `post_id`.
    pub fn window_key(&self, size: WindowSize, start: i64, post_id: u64) -> String {
        let mut key = String::new();
        self.write_window_key(&mut key, size, start, self.groups.group_of(post_id, 0));
        key
    }

    /// The counts and the leaders of window `start` of `size`, one pair per
    /// slot group.
    pub fn window_keys(&self, size: WindowSize, start: i64) -> Vec<(String, String)> {
        (0..self.groups.count())
            .map(|g| {
                let (mut counts, mut leaders) = (String::new(), String::new());
                self.write_window_key(&mut counts, size, start, g);
                self.write_leaders_key(&mut leaders, size, start, g);
                (counts, leaders)
            })
            .collect()
    }

    /// The glob pattern matching every window's counts.
    pub fn windows_pattern(&self) -> String {
        format!("{}:win:*", self.prefix)
    }

    /// The size and start of a window set's key; `None` for any other key.
    pub fn parse_window_key(&self, key: &str) -> Option<(WindowSize, i64)> {
        let rest = key
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(":win:")?;
        let rest = match rest.find(":{") {
            Some(at) => &rest[..at],
            None => rest,
        };
        let (size, start) = rest.split_once(':')?;
        Some((size.parse().ok()?, start.parse().ok()?))
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The slot groups keys are spread over.
    pub fn groups(&self) -> &SlotGroups {
        &self.groups
    }

    fn write_tag(&self, out: &mut String, group: u32) {
        if let Some(tag) = self.groups.tag(group) {
            let _ = write!(out, ":{{{tag}}}");
        }
    }

    /// Writes the key of a counter into `out`, replacing its contents: its
    /// string key, or the hash holding its field when packed. `splits` is the
    /// split state of the counter's slot group when its hashes grow (see
    /// [`crate::domain::packing`]), and ignored otherwise.
    ///
    /// Lets the hot path reuse one buffer instead of allocating a key per entry.
    pub fn write_counter_key(&self, out: &mut String, id: CounterId, splits: Splits) {
        match &self.packing {
            Packing::Strings => {
                out.clear();
                let _ = write!(out, "{}:likes:", self.prefix);
                write_tail(out, id, false);
                self.write_tag(out, self.groups.group_of(id.post_id, id.bucket));
            }
            _ => {
                let n = self.hash_number(id, splits, &mut String::with_capacity(32));
                self.write_hash_key(out, n, self.groups.group_of(id.post_id, id.bucket));
            }
        }
    }

    /// The number of the hash a packed counter's field lives in, within its
    /// slot group, under `splits` when the hashes grow; `field` is a buffer
    /// the field may be written into. 0 for string keys.
    pub fn hash_number(&self, id: CounterId, splits: Splits, field: &mut String) -> u32 {
        match &self.packing {
            Packing::Strings => 0,
            Packing::Packed(packed) => packed.hash_of(id.post_id, id.version, id.bucket),
            Packing::Growing(_) => {
                self.write_field(field, id);
                splits.address(field_hash(field.as_bytes()))
            }
        }
    }

    /// Writes the key of hash `n` of slot group `group` (packed layouts)
    /// into `out`, replacing its contents.
    pub fn write_hash_key(&self, out: &mut String, n: u32, group: u32) {
        out.clear();
        let _ = write!(out, "{}:packed:{n}", self.prefix);
        self.write_tag(out, group);
    }

    /// The key a growing generation keeps the split state of slot group
    /// `group` in: a hash with `level`, `next` and `fields`, in the group's
    /// slot (see [`crate::domain::packing`]).
    pub fn splits_key(&self, group: u32) -> String {
        let mut key = format!("{}:packstate", self.prefix);
        self.write_tag(&mut key, group);
        key
    }

    /// The slot group of a counter.
    pub fn group_of(&self, id: CounterId) -> u32 {
        self.groups.group_of(id.post_id, id.bucket)
    }

    /// Writes the field of a counter into `out`, replacing its contents; the
    /// field names the counter within its hash (packed layout only).
    pub fn write_field(&self, out: &mut String, id: CounterId) {
        out.clear();
        write_tail(out, id, true);
    }

    /// The key of a counter: its string key, or the hash holding it, under
    /// `splits` when the hashes grow.
    pub fn key_at(&self, id: CounterId, splits: Splits) -> String {
        let mut key = String::new();
        self.write_counter_key(&mut key, id, splits);
        key
    }

    /// The key of a counter in a layout whose places never move (string keys,
    /// or a fixed number of hashes); in a growing one, its key before any
    /// split, which [`KeyLayout::key_at`] corrects.
    pub fn key_of(&self, id: CounterId) -> String {
        self.key_at(id, Splits::default())
    }

    /// Where a counter is kept, under `splits` when the hashes grow.
    pub fn place_at(&self, id: CounterId, splits: Splits) -> Place {
        self.numbered_place(id, splits).0
    }

    /// Where a counter is kept, under `splits` when the hashes grow, and the
    /// number of its hash (0 for string keys); its field is written once.
    pub fn numbered_place(&self, id: CounterId, splits: Splits) -> (Place, u32) {
        if !self.packing.is_packed() {
            let place = Place {
                key: self.key_at(id, splits),
                field: None,
            };
            return (place, 0);
        }
        let mut field = String::with_capacity(32);
        let n = self.hash_number(id, splits, &mut field);
        // A fixed packing numbers its hashes without writing the field.
        if field.is_empty() {
            self.write_field(&mut field, id);
        }
        let mut key = String::with_capacity(64);
        self.write_hash_key(&mut key, n, self.group_of(id));
        (
            Place {
                key,
                field: Some(field),
            },
            n,
        )
    }

    /// Where a counter is kept in a layout whose places never move; see
    /// [`KeyLayout::key_of`].
    pub fn place_of(&self, id: CounterId) -> Place {
        self.place_at(id, Splits::default())
    }

    /// Whether counters are fields of hashes.
    pub fn is_packed(&self) -> bool {
        self.packing.is_packed()
    }

    /// Whether a packed generation's hashes split as they fill.
    pub fn is_growing(&self) -> bool {
        self.packing.growing().is_some()
    }

    /// The glob pattern matching every key that holds counters: the string
    /// keys, or the hashes of a packed generation.
    pub fn counters_pattern(&self) -> String {
        match self.packing {
            Packing::Strings => format!("{}:likes:*", self.prefix),
            Packing::Packed(_) | Packing::Growing(_) => format!("{}:packed:*", self.prefix),
        }
    }

    /// Parses a field of a packed hash back into its counter.
    pub fn parse_field(&self, field: &str) -> Option<CounterId> {
        parse_tail(field, true)
    }

    /// The key of a version-0 counter (post, bucket).
    pub fn counter_key(&self, post_id: u64, bucket: u32) -> String {
        self.key_of(CounterId::v0(post_id, bucket))
    }

    /// The routing metadata of a post: a hash read by readers (see
    /// [`crate::domain::versions`]). Deliberately outside `<prefix>:likes:`.
    /// On a cluster it shares the slot of the post's bucket 0, so a reader's
    /// commands fall into as many slots as there are slot groups.
    pub fn route_key(&self, post_id: u64) -> String {
        let mut key = format!("{}:route:{}", self.prefix, post_id);
        self.write_tag(&mut key, self.groups.group_of(post_id, 0));
        key
    }

    /// The registry of every post with routing metadata, read by writers.
    pub fn registry_key(&self) -> String {
        format!("{}:routes", self.prefix)
    }

    /// The shared per-second activity counters hot-post detection sums across
    /// consumers.
    /// Every second's hash shares one slot (tag `{heat}`), so a consumer adds
    /// to one second and reads the one before in a single pipeline.
    pub fn heat_key(&self, window: u64) -> String {
        format!("{}:heat:{{heat}}:{}", self.prefix, window)
    }

    /// The glob pattern matching every bucket of a post.
    pub fn post_pattern(&self, post_id: u64) -> String {
        format!("{}:likes:{}:*", self.prefix, post_id)
    }

    /// The fence key of one (consumer group, topic, partition, slot group): it
    /// holds the last applied Kafka offset as a decimal integer.
    pub fn fence_key(&self, group: &str, topic: &str, partition: i32, slot_group: u32) -> String {
        let mut key = format!("{}:fence:{}:{}:{}", self.prefix, group, topic, partition);
        self.write_tag(&mut key, slot_group);
        key
    }

    /// The origin key of one (consumer group, topic, partition): the first
    /// offset tally counted for it. Lives in slot group 0.
    pub fn origin_key(&self, group: &str, topic: &str, partition: i32) -> String {
        let mut key = format!("{}:origin:{}:{}:{}", self.prefix, group, topic, partition);
        self.write_tag(&mut key, 0);
        key
    }

    /// Parses a string counter key back into its counter; `None` for any
    /// other key.
    pub fn parse_counter_key(&self, key: &str) -> Option<CounterId> {
        let rest = key
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(":likes:")?;
        let (tail, tag) = match rest.find(":{") {
            Some(at) => (&rest[..at], Some(&rest[at + 1..])),
            None => (rest, None),
        };
        let tag_ok = tag.is_none_or(|tag| {
            tag.len() > 2 && tag.starts_with('{') && tag.ends_with('}') && !tag.contains(':')
        });
        if !tag_ok {
            return None;
        }
        parse_tail(tail, false)
    }
}

/// Writes `<post>` for bucket 0 of version 0, `<post>:<bucket>` for another
/// bucket of it, `<post>:v<version>:b<bucket>` for a post's own version and
/// `<post>:d<epoch>:b<bucket>` for a later epoch of the default layout; the
/// post as a signed integer when `signed` (fields) and as it is otherwise,
/// where a string key always names the bucket.
fn write_tail(out: &mut String, id: CounterId, signed: bool) {
    let _ = if signed {
        write!(out, "{}", id.post_id as i64)
    } else {
        write!(out, "{}", id.post_id)
    };
    if id.version == 0 {
        if !signed || id.bucket != 0 {
            let _ = write!(out, ":{}", id.bucket);
        }
    } else if id.version > DEFAULT_EPOCHS {
        let _ = write!(out, ":d{}:b{}", id.version - DEFAULT_EPOCHS, id.bucket);
    } else {
        let _ = write!(out, ":v{}:b{}", id.version, id.bucket);
    }
}

/// Reads what [`write_tail`] writes back, refusing anything it never writes.
fn parse_tail(tail: &str, signed: bool) -> Option<CounterId> {
    let mut parts = tail.split(':');
    let post = parts.next()?;
    let post_id = if signed {
        post.parse::<i64>()
            .ok()
            .filter(|_| !post.starts_with('+'))? as u64
    } else {
        post.parse().ok().filter(|_| !post.starts_with('+'))?
    };
    let Some(first) = parts.next() else {
        // Only a field leaves bucket 0 of version 0 unnamed.
        return signed.then_some(CounterId::v0(post_id, 0));
    };
    let numbered = |digits: &str| {
        digits
            .parse::<u32>()
            .ok()
            .filter(|&n| n > 0 && !digits.starts_with('+'))
    };
    let version = if let Some(own) = first.strip_prefix('v') {
        Some(numbered(own).filter(|&v| v <= DEFAULT_EPOCHS)?)
    } else if let Some(epoch) = first.strip_prefix('d') {
        Some(numbered(epoch).filter(|&e| e < u32::MAX - DEFAULT_EPOCHS)? + DEFAULT_EPOCHS)
    } else {
        None
    };
    let (version, bucket) = match version {
        Some(version) => (version, parts.next()?.strip_prefix('b')?.parse().ok()?),
        None => (0, first.parse().ok()?),
    };
    // A field names bucket 0 of version 0 by the post alone.
    if parts.next().is_some() || (signed && version == 0 && bucket == 0) {
        return None;
    }
    Some(CounterId {
        post_id,
        version,
        bucket,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Published test vectors: (user_id, XXH64 seed 0 of its LE bytes, bucket of 16, bucket of 1024).
    /// Cross-checked against the reference implementation (Python `xxhash.xxh64_intdigest`).
    pub(crate) const VECTORS: &[(u64, u64, u32, u32)] = &[
        (0, 0x34c9_6acd_cadb_1bbb, 11, 955),
        (1, 0x9f29_cb17_a2a4_9995, 5, 405),
        (2, 0xeac7_3e40_44e8_2db0, 0, 432),
        (42, 0xb556_806f_b6d1_4353, 3, 851),
        (101, 0x7dce_3177_b95c_194c, 12, 332),
        (1000, 0xe53f_2d22_876c_9a49, 9, 585),
        (123_456_789, 0xcb7c_2941_b198_004d, 13, 77),
        (4_294_967_296, 0xca60_84df_268e_a2a9, 9, 681),
        (9_223_372_036_854_775_808, 0x3f42_5eac_f015_44e0, 0, 224),
        (u64::MAX, 0x85d1_36ad_b773_c6c9, 9, 713),
    ];

    #[test]
    fn hash_matches_published_vectors() {
        for &(user, hash, b16, b1024) in VECTORS {
            assert_eq!(stable_hash(user), hash, "user {user}");
            assert_eq!(bucket_of(user, 16), b16, "user {user}");
            assert_eq!(bucket_of(user, 1024), b1024, "user {user}");
        }
    }

    #[test]
    fn key_layout_is_the_documented_one() {
        let keys = KeyLayout::new("tally");
        assert_eq!(keys.counter_key(101, 3), "tally:likes:101:3");
        assert_eq!(keys.post_pattern(101), "tally:likes:101:*");
        assert_eq!(keys.fence_key("g", "likes", 7, 0), "tally:fence:g:likes:7");
        assert_eq!(keys.origin_key("g", "likes", 7), "tally:origin:g:likes:7");
        let cluster = KeyLayout::with_groups("tally", SlotGroups::cluster(16));
        let key = cluster.counter_key(101, 3);
        assert!(key.starts_with("tally:likes:101:3:{"), "{key}");
        assert_eq!(cluster.parse_counter_key(&key), Some(CounterId::v0(101, 3)));
        let slot = crate::domain::slots::key_slot(key.as_bytes());
        let group = cluster.groups().group_of(101, 3);
        let fence = cluster.fence_key("g", "likes", 7, group);
        assert_eq!(crate::domain::slots::key_slot(fence.as_bytes()), slot);
        assert_eq!(
            keys.parse_counter_key("tally:likes:101:3"),
            Some(CounterId::v0(101, 3))
        );
        let hot = CounterId {
            post_id: 101,
            version: 3,
            bucket: 17,
        };
        assert_eq!(keys.key_of(hot), "tally:likes:101:v3:b17");
        assert_eq!(keys.parse_counter_key("tally:likes:101:v3:b17"), Some(hot));
        let tagged = cluster.key_of(hot);
        assert!(tagged.starts_with("tally:likes:101:v3:b17:{"), "{tagged}");
        assert_eq!(cluster.parse_counter_key(&tagged), Some(hot));
        assert_eq!(keys.parse_counter_key("tally:likes:101:v0:b1"), None);
        let epoch = CounterId {
            post_id: 101,
            version: epoch_version(2),
            bucket: 0,
        };
        assert_eq!(keys.key_of(epoch), "tally:likes:101:d2:b0");
        assert_eq!(keys.parse_counter_key("tally:likes:101:d2:b0"), Some(epoch));
        assert_eq!(keys.parse_counter_key("tally:likes:101:d0:b0"), None);
        assert_eq!(keys.parse_counter_key("tally:route:101"), None);
        assert_eq!(keys.parse_counter_key("tally:fence:g:likes:7"), None);
        // Packed: bucket 0 of version 0 is the post alone, as a signed integer.
        let packed = keys.with_packing(crate::domain::packing::Packing::Packed(
            crate::domain::packing::Packed {
                hashes: 10,
                fields: 64,
            },
        ));
        let place = packed.place_of(CounterId::v0(u64::MAX, 0));
        assert_eq!(place.field.as_deref(), Some("-1"));
        assert_eq!(packed.parse_field("-1"), Some(CounterId::v0(u64::MAX, 0)));
        assert_eq!(packed.parse_field("101:3"), Some(CounterId::v0(101, 3)));
        assert_eq!(packed.parse_field("101:v3:b17"), Some(hot));
        for bad in ["101:0", "+101", "x", "101:v0:b1", "101:3:4", ""] {
            assert_eq!(packed.parse_field(bad), None, "{bad}");
        }
        assert!(place.key.starts_with("tally:packed:"), "{}", place.key);
        assert_eq!(keys.parse_counter_key("other:likes:1:2"), None);
    }

    proptest! {
        #[test]
        fn buckets_stay_in_range_and_are_deterministic(user: u64, buckets in 1u32..100_000) {
            let b = bucket_of(user, buckets);
            prop_assert!(b < buckets);
            prop_assert_eq!(b, bucket_of(user, buckets));
        }

        #[test]
        fn counter_keys_round_trip(
            post_id: u64,
            version in prop_oneof![0u32..1000, DEFAULT_EPOCHS + 1..DEFAULT_EPOCHS + 1000],
            bucket: u32,
            cluster: bool,
        ) {
            let keys = if cluster {
                KeyLayout::with_groups("p:x", SlotGroups::cluster(64))
            } else {
                KeyLayout::new("p:x")
            };
            let id = CounterId { post_id, version, bucket };
            prop_assert_eq!(keys.parse_counter_key(&keys.key_of(id)), Some(id));
            let head = format!("p:x:likes:{post_id}:");
            prop_assert!(keys.key_of(id).starts_with(&head));
        }

        #[test]
        fn packed_fields_round_trip(
            post_id: u64,
            version in prop_oneof![0u32..1000, DEFAULT_EPOCHS + 1..DEFAULT_EPOCHS + 1000],
            bucket in 0u32..1 << 20,
            cluster: bool,
        ) {
            use crate::domain::packing::{Packed, Packing};
            let base = if cluster {
                KeyLayout::with_groups("p", SlotGroups::cluster(64))
            } else {
                KeyLayout::new("p")
            };
            let keys = base.with_packing(Packing::Packed(Packed { hashes: 1000, fields: 64 }));
            let id = CounterId { post_id, version, bucket };
            let place = keys.place_of(id);
            let field = place.field.clone().unwrap();
            prop_assert_eq!(keys.parse_field(&field), Some(id));
            prop_assert!(field.len() as u64 <= crate::domain::packing::LONGEST_FIELD);
            prop_assert!(place.key.starts_with("p:packed:"));
            prop_assert_eq!(keys.parse_counter_key(&place.key), None);
            // The hash sits in the slot group the string key would.
            if cluster {
                let slot = |k: &str| crate::domain::slots::key_slot(k.as_bytes());
                prop_assert_eq!(slot(&place.key), slot(&base.key_of(id)));
            }
        }

        #[test]
        fn fences_never_match_the_read_pattern(group in "[a-z:]{1,8}", topic in "[a-z]{1,8}", partition in 0i32..1000) {
            let keys = KeyLayout::new("tally");
            prop_assert_eq!(keys.parse_counter_key(&keys.fence_key(&group, &topic, partition, 0)), None);
            prop_assert_eq!(keys.parse_counter_key(&keys.origin_key(&group, &topic, partition)), None);
        }
    }
}
