//! Packing: whether a generation keeps each counter in a string key of its
//! own or as a field of a small hash.
//!
//! Invariant: the place of a counter (key, and field when packed) is a pure
//! function of the counter and of the packing recorded for its generation,
//! so every writer and reader of that generation names the same place. The
//! packing never changes for a generation: moving to another one is a
//! rebuild into a new generation.
//!
//! # The packed layout
//!
//! Counters are fields of hashes `<prefix>:packed:<n>` (plus the slot group's
//! hash tag on a cluster). `n` is XXH64, seed [`PACK_SEED`], of the counter's
//! post id, version and bucket (16 little-endian bytes), modulo the number of
//! hashes per slot group, so random post ids fill the hashes as evenly as
//! sequential ones, and a hot post's buckets spread over many hashes. The
//! field is the counter key's tail after `likes:`, with the post id written
//! as the signed 64-bit integer of the same bits: `-8446744073709551616`,
//! `42:3`, `42:v2:b7`. Redis keeps a field that reads as an integer in 9
//! bytes of its listpack, where 20 digits of text would take 21.
//!
//! A hash is cheap only while Redis keeps it as a listpack: up to
//! `hash-max-listpack-entries` fields (128 unless configured). A generation
//! made with a fixed number of hashes ([`Packed`], sized for a number of
//! counters when it is made) keeps it; a *growing* one ([`Growing`], the
//! default) splits its hashes as they fill, below.
//!
//! # Growing hashes: linear hashing per slot group
//!
//! Each slot group of a growing generation holds `2^level + next` hashes,
//! numbered from 0, and a *split state* `(level, next)` kept in the hash
//! `<prefix>:packstate` of the group's slot (fields `level`, `next`, and
//! `fields`, the counters the group holds; absent means `(0, 0)`, one hash).
//! A counter's field is placed by [`field_hash`] of its field, `h`: its hash
//! is `h mod 2^level`, or `h mod 2^(level+1)` when that is below `next`
//! ([`Splits::address`]). When the group holds more than `fields` counters a
//! hash on average, the apply script splits hash `next`: every field whose
//! `h mod 2^(level+1)` is `next + 2^level` moves to that new hash, and `next`
//! advances (at `2^level` the level rises and `next` starts again at 0). One
//! split moves one hash's fields, a few dozen, and a call makes the splits
//! the counters it created need (and a few more while the group is behind),
//! so splits spread over the calls that fill the group, in proportion to
//! their writes.
//!
//! **Why no count is lost or doubled.** A field lives in exactly one hash at
//! every moment: the split that moves it runs in the same script, in the same
//! slot, as the split state it advances, and every write reads that state
//! first. A writer's call names the split state it addressed its fields with;
//! the script finds each hash the call names that was split since (its level
//! under the stored state is not the one the caller assumed) and writes the
//! fields named under it where the stored state says, computing their
//! [`field_hash`] itself. A write therefore always lands where the stored
//! state says, an undo takes it back from there (the state does not change
//! until every write is done), and the fence's argument (apply.lua) is
//! untouched: the split is one more write of a script that either runs whole
//! or not at all. Every reply carries the state, so a writer's state is at
//! most a few concurrent calls old, and the script hashes only the fields of
//! the few hashes split in between.
//!
//! **Why a reader never sees a count go down because a field moved.** A
//! reader addresses a field with a split state it read a moment ago, reads
//! the hash, and reads the split state again after it, on the same
//! connection, in the same slot: Redis runs the two in order. Levels only
//! rise, so if the hash's level in the later state is the one the reader
//! assumed, the hash was not split between the reader's two reads of the
//! state, and the field was where the reader looked ([`Splits::holds`]).
//! Otherwise the reader addresses the field again with the newer state and
//! reads once more. A store that went back in time (a restart from an AOF, a
//! failover) took its split state back with its fields, and the same check
//! sends the reader to the older place.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use xxhash_rust::xxh64::xxh64;

pub use crate::infra::config::packing::{DEFAULT_PACKED_FIELDS, MAX_PACKED_FIELDS};
use crate::infra::config::packing::{LayoutName, PackingSettings};

/// Seed of the hash that picks a counter's hash key. Part of the packed
/// layout's contract.
pub const PACK_SEED: u64 = 0x7061_636b; // "pack"

/// Counters per hash a growing generation keeps on average unless told
/// otherwise. Hashes about to split hold up to twice the average, so 40
/// keeps the fullest near 80 fields and far below Redis's default
/// `hash-max-listpack-entries` of 128, for about 15 bytes a counter.
pub const DEFAULT_GROWING_FIELDS: u32 = 40;

/// The most levels a slot group's hashes grow to: 2^30 hashes a group, the
/// most whose numbers a [`field_hash`] below 2^31 - 1 reaches.
pub const MAX_LEVEL: u32 = 30;

/// How a generation keeps its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Packing {
    /// A string key per counter, added to with INCRBY (the default).
    #[default]
    Strings,
    /// Fields of small hashes, added to with HINCRBY, in a number of hashes
    /// fixed when the generation was made.
    Packed(Packed),
    /// Fields of small hashes that split as they fill.
    Growing(Growing),
}

/// The shape of a growing packed generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growing {
    /// Counters per hash on average: a slot group's next hash splits when
    /// the group holds more than this many a hash.
    pub fields: u32,
}

impl Growing {
    /// The `hash-max-listpack-entries` a server needs so that no hash leaves
    /// the listpack encoding: the hashes next in line to split hold twice the
    /// average, plus five standard deviations of their spread.
    pub fn entries_needed(&self) -> u64 {
        let fullest = 2.0 * f64::from(self.fields);
        (fullest + 5.0 * fullest.sqrt()).ceil() as u64
    }
}

/// Where a growing slot group stands in its splits: `2^level + next` hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, PartialOrd, Ord)]
pub struct Splits {
    /// Hashes below `next` have been split at this level.
    pub level: u32,
    /// The next hash to split.
    pub next: u32,
}

impl Splits {
    /// The hashes of the group.
    pub fn hashes(&self) -> u64 {
        (1u64 << self.level) + u64::from(self.next)
    }

    /// The hash a field of hash `h` ([`field_hash`]) lives in.
    pub fn address(&self, h: u32) -> u32 {
        let low = u64::from(h) % (1u64 << self.level);
        if low < u64::from(self.next) {
            (u64::from(h) % (1u64 << (self.level + 1))) as u32
        } else {
            low as u32
        }
    }

    /// The level of hash `n`: how many low bits of a field's hash its
    /// number fixes; `None` when the group has no such hash.
    pub fn level_of(&self, n: u32) -> Option<u32> {
        let n = u64::from(n);
        if n >= self.hashes() {
            None
        } else if n < u64::from(self.next) || n >= 1u64 << self.level {
            Some(self.level + 1)
        } else {
            Some(self.level)
        }
    }

    /// Whether hash `n`, addressed under `assumed`, still holds what it
    /// held then: it exists and was not split since.
    pub fn holds(&self, assumed: &Splits, n: u32) -> bool {
        assumed.level_of(n).is_some() && self.level_of(n) == assumed.level_of(n)
    }

    /// The state after one more split.
    pub fn split_once(&self) -> Splits {
        if u64::from(self.next) + 1 == 1u64 << self.level {
            Splits {
                level: self.level + 1,
                next: 0,
            }
        } else {
            Splits {
                level: self.level,
                next: self.next + 1,
            }
        }
    }

    /// The state packed into one number, for a cache cell.
    pub fn to_bits(self) -> u64 {
        (u64::from(self.level) << 32) | u64::from(self.next)
    }

    /// The state a cache cell holds.
    pub fn from_bits(bits: u64) -> Splits {
        Splits {
            level: (bits >> 32) as u32,
            next: bits as u32,
        }
    }
}

/// The split states last seen of each slot group of one growing
/// generation, shared by the tasks that address its fields. A state seen
/// late only costs the script a few fields it hashes itself.
#[derive(Debug, Clone)]
pub struct SplitCache(Arc<[AtomicU64]>);

impl SplitCache {
    /// A cache for `groups` slot groups, each at one hash.
    pub fn new(groups: u32) -> SplitCache {
        SplitCache((0..groups.max(1)).map(|_| AtomicU64::new(0)).collect())
    }

    /// The state last seen of `group`.
    pub fn get(&self, group: u32) -> Splits {
        self.0
            .get(group as usize)
            .map_or_else(Splits::default, |cell| {
                Splits::from_bits(cell.load(Ordering::Relaxed))
            })
    }

    /// Records the state of `group` a reply carried.
    pub fn set(&self, group: u32, splits: Splits) {
        if let Some(cell) = self.0.get(group as usize) {
            cell.store(splits.to_bits(), Ordering::Relaxed);
        }
    }
}

/// Fields and their [`field_hash`], as docs/design.md publishes them.
pub const FIELD_HASH_VECTORS: [(&str, u32); 5] = [
    ("", 0),
    ("42", 52_000_206),
    ("-1", 45_000_184),
    ("42:v2:b7", 676_428_624),
    ("9223372036854775807", 1_123_251_681),
];

/// The hash of a packed field that places it in a growing generation: the
/// field's bytes read as a number in base 1,000,003, modulo the prime
/// 2^31 - 1. Part of the layout's contract; `field_hash.lua` computes the
/// same when a script splits a hash, in arithmetic Lua's doubles hold
/// exactly (tests hold the two to the same vectors). Random, sequential and
/// bucketed fields spread over the low bits that pick a hash as evenly as a
/// random draw would (docs/design.md).
pub fn field_hash(field: &[u8]) -> u32 {
    let h = field.iter().fold(0u64, |h, &byte| {
        (h * FIELD_HASH_BASE + u64::from(byte)) % FIELD_HASH_MODULUS
    });
    h as u32
}

/// The base [`field_hash`] reads a field's bytes in.
const FIELD_HASH_BASE: u64 = 1_000_003;
/// The prime [`field_hash`] reduces by: 2^31 - 1.
const FIELD_HASH_MODULUS: u64 = (1 << 31) - 1;

/// The shape of a packed generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packed {
    /// Hashes per slot group.
    pub hashes: u32,
    /// Fields per hash the hashes were sized for.
    pub fields: u32,
}

impl Packed {
    /// Hashes enough for `counters` counters at `fields` per hash over
    /// `groups` slot groups (at least one per group).
    pub fn sized(counters: u64, fields: u32, groups: u32) -> Packed {
        let per_group = counters.div_ceil(u64::from(fields.max(1)) * u64::from(groups.max(1)));
        Packed {
            hashes: per_group.clamp(1, u64::from(u32::MAX)) as u32,
            fields,
        }
    }

    /// The hash (within its slot group) a counter's field lives in.
    pub fn hash_of(&self, post_id: u64, version: u32, bucket: u32) -> u32 {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&post_id.to_le_bytes());
        bytes[8..12].copy_from_slice(&version.to_le_bytes());
        bytes[12..].copy_from_slice(&bucket.to_le_bytes());
        (xxh64(&bytes, PACK_SEED) % u64::from(self.hashes)) as u32
    }

    /// The `hash-max-listpack-entries` a server needs so that no hash of a
    /// generation filled to its size leaves the listpack encoding: the
    /// fields per hash plus eight standard deviations of their spread (the
    /// fill of a hash is close to Poisson).
    pub fn entries_needed(&self) -> u64 {
        let fields = f64::from(self.fields);
        (fields + 8.0 * fields.sqrt()).ceil() as u64
    }
}

/// The longest field the packed layout writes, in bytes: a post id of 20
/// characters, a version and a bucket. `hash-max-listpack-value` must be at
/// least this.
pub const LONGEST_FIELD: u64 = "-9223372036854775808:d4294967295:b1048576".len() as u64;

impl fmt::Display for Packing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Packing::Strings => f.write_str("strings"),
            Packing::Packed(p) => write!(f, "packed:{}:{}", p.hashes, p.fields),
            Packing::Growing(g) => write!(f, "growing:{}", g.fields),
        }
    }
}

/// A packing as the layout record writes it could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a packing (strings, packed:<hashes>:<fields> or growing:<fields>)")]
pub struct BadPacking(pub String);

impl std::str::FromStr for Packing {
    type Err = BadPacking;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "strings" {
            return Ok(Packing::Strings);
        }
        let bad = || BadPacking(text.to_string());
        if let Some(fields) = text.strip_prefix("growing:") {
            let fields: u32 = fields.parse().map_err(|_| bad())?;
            if fields == 0 || fields > MAX_PACKED_FIELDS {
                return Err(bad());
            }
            return Ok(Packing::Growing(Growing { fields }));
        }
        let rest = text.strip_prefix("packed:").ok_or_else(bad)?;
        let (hashes, fields) = rest.split_once(':').ok_or_else(bad)?;
        let hashes: u32 = hashes.parse().map_err(|_| bad())?;
        let fields: u32 = fields.parse().map_err(|_| bad())?;
        if hashes == 0 || fields == 0 || fields > MAX_PACKED_FIELDS {
            return Err(bad());
        }
        Ok(Packing::Packed(Packed { hashes, fields }))
    }
}

/// What a writer asks of a new generation's packing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wanted {
    /// A string key per counter.
    #[default]
    Strings,
    /// Hashes sized for `counters` at `fields` per hash, or, without
    /// `counters`, hashes that split as they fill, `fields` a hash on average.
    Packed {
        /// Counters to size for; `None` for hashes that grow.
        counters: Option<u64>,
        /// Fields per hash; `None` for the default of the kind.
        fields: Option<u32>,
    },
}

impl Wanted {
    /// What `settings` ask for; `None` when they name no layout.
    pub fn from_settings(settings: &PackingSettings) -> Option<Wanted> {
        settings.layout.map(|layout| match layout {
            LayoutName::Strings => Wanted::Strings,
            LayoutName::Packed => Wanted::Packed {
                counters: settings.counters,
                fields: settings.fields,
            },
        })
    }

    /// The packing this asks for over `groups` slot groups.
    pub fn packing(&self, groups: u32) -> Packing {
        match *self {
            Wanted::Strings => Packing::Strings,
            Wanted::Packed {
                counters: Some(counters),
                fields,
            } => Packing::Packed(Packed::sized(
                counters,
                fields.unwrap_or(DEFAULT_PACKED_FIELDS),
                groups,
            )),
            Wanted::Packed {
                counters: None,
                fields,
            } => Packing::Growing(Growing {
                fields: fields.unwrap_or(DEFAULT_GROWING_FIELDS),
            }),
        }
    }

    /// The name of the layout asked for, as the `--layout` flag takes it.
    pub fn name(&self) -> &'static str {
        match self {
            Wanted::Strings => "strings",
            Wanted::Packed { .. } => "packed",
        }
    }
}

impl Packing {
    /// The name of the layout, as the `--layout` flag takes it.
    pub fn name(&self) -> &'static str {
        match self {
            Packing::Strings => "strings",
            Packing::Packed(_) | Packing::Growing(_) => "packed",
        }
    }

    /// Whether counters are fields of hashes, fixed or growing.
    pub fn is_packed(&self) -> bool {
        !matches!(self, Packing::Strings)
    }

    /// The growing shape, if its hashes split as they fill.
    pub fn growing(&self) -> Option<&Growing> {
        match self {
            Packing::Growing(g) => Some(g),
            _ => None,
        }
    }

    /// The `hash-max-listpack-entries` the server needs; 0 for string keys.
    pub fn entries_needed(&self) -> u64 {
        match self {
            Packing::Strings => 0,
            Packing::Packed(p) => p.entries_needed(),
            Packing::Growing(g) => g.entries_needed(),
        }
    }

    /// The fixed packed shape, if packed with a fixed number of hashes.
    pub fn packed(&self) -> Option<&Packed> {
        match self {
            Packing::Packed(p) => Some(p),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packings_read_back_and_bad_ones_are_refused() {
        for packing in [
            Packing::Strings,
            Packing::Packed(Packed {
                hashes: 156_250,
                fields: 64,
            }),
        ] {
            assert_eq!(packing.to_string().parse::<Packing>(), Ok(packing));
        }
        for bad in [
            "",
            "packed",
            "packed:0:64",
            "packed:10:0",
            "packed:10",
            "packed:1:99999",
            "Strings",
        ] {
            assert!(bad.parse::<Packing>().is_err(), "{bad}");
        }
    }

    #[test]
    fn sizing_rounds_up_and_spreads_over_groups() {
        let p = Packed::sized(10_000_000, 64, 1);
        assert_eq!(p.hashes, 156_250);
        assert_eq!(Packed::sized(10_000_000, 64, 16).hashes, 9766);
        assert_eq!(Packed::sized(1, 64, 128).hashes, 1);
        assert!(u64::from(p.hashes) * u64::from(p.fields) >= 10_000_000);
        // Redis's default limit holds the default size.
        assert_eq!(
            Packed {
                hashes: 1,
                fields: DEFAULT_PACKED_FIELDS
            }
            .entries_needed(),
            128
        );
        const { assert!(LONGEST_FIELD <= 64, "the default hash-max-listpack-value") };
    }

    #[test]
    fn random_sequential_and_bucketed_fields_spread_evenly() {
        // 4,096 hashes at level 12, about 98 fields each: the spread of a
        // random draw is sqrt(98), about 10.
        let spread = |fields: &mut dyn Iterator<Item = String>| {
            let splits = Splits { level: 12, next: 0 };
            let mut fill = vec![0u32; 4096];
            for field in fields {
                fill[splits.address(field_hash(field.as_bytes())) as usize] += 1;
            }
            let mean = fill.iter().map(|&f| f64::from(f)).sum::<f64>() / 4096.0;
            let var = fill
                .iter()
                .map(|&f| (f64::from(f) - mean).powi(2))
                .sum::<f64>()
                / 4096.0;
            (var.sqrt(), *fill.iter().max().unwrap())
        };
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let random = spread(&mut (0..400_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as i64).to_string()
        }));
        let sequential = spread(&mut (1..=400_000u64).map(|p| p.to_string()));
        let bucketed =
            spread(&mut (1..=6_250u64).flat_map(|p| (0..64).map(move |b| format!("{p}:v3:b{b}"))));
        for (name, (deviation, fullest)) in [
            ("random", random),
            ("sequential", sequential),
            ("bucketed", bucketed),
        ] {
            assert!(deviation < 12.0, "{name}: {deviation}");
            assert!(fullest < 150, "{name}: {fullest}");
        }
        // Lua's doubles hold every step exactly: the largest is below 2^53.
        const { assert!((FIELD_HASH_MODULUS - 1) * FIELD_HASH_BASE + 255 < 1 << 53) };
    }

    #[test]
    fn random_ids_fill_the_hashes_evenly() {
        // 64 fields per hash on average; a few hundred hashes stay within
        // the limit the writer asks the server for.
        let p = Packed {
            hashes: 500,
            fields: 64,
        };
        let mut fill = vec![0u64; 500];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..32_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            fill[p.hash_of(x, 0, 0) as usize] += 1;
        }
        let (low, high) = (fill.iter().min().unwrap(), fill.iter().max().unwrap());
        assert!(*high <= p.entries_needed(), "fullest hash {high}");
        assert!(*low >= 24, "emptiest hash {low}");
        // Sequential ids too.
        let mut fill = vec![0u64; 500];
        for post in 0..32_000 {
            fill[p.hash_of(post, 0, 0) as usize] += 1;
        }
        assert!(*fill.iter().max().unwrap() <= p.entries_needed());
        // A hot post's buckets do not share one hash.
        let spread: std::collections::HashSet<u32> = (0..64).map(|b| p.hash_of(7, 3, b)).collect();
        assert!(spread.len() > 50, "{}", spread.len());
    }
}
