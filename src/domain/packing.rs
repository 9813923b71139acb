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
//! `hash-max-listpack-entries` fields (128 unless configured). The number of
//! hashes is fixed when the generation is created, from the counters it is
//! sized for and the fields wanted per hash; writers refuse a server whose
//! limit is below [`Packed::entries_needed`], and report any hash they see
//! filled past the limit.

use std::fmt;

use xxhash_rust::xxh64::xxh64;

pub use crate::infra::config::packing::{
    DEFAULT_PACKED_COUNTERS, DEFAULT_PACKED_FIELDS, MAX_PACKED_FIELDS,
};
use crate::infra::config::packing::{LayoutName, PackingSettings};

/// Seed of the hash that picks a counter's hash key. Part of the packed
/// layout's contract.
pub const PACK_SEED: u64 = 0x7061_636b; // "pack"

/// How a generation keeps its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Packing {
    /// A string key per counter, added to with INCRBY (the default).
    #[default]
    Strings,
    /// Fields of small hashes, added to with HINCRBY.
    Packed(Packed),
}

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
        }
    }
}

/// A packing as the layout record writes it could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a packing (strings, or packed:<hashes>:<fields>)")]
pub struct BadPacking(pub String);

impl std::str::FromStr for Packing {
    type Err = BadPacking;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "strings" {
            return Ok(Packing::Strings);
        }
        let bad = || BadPacking(text.to_string());
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
    /// Hashes sized for `counters` at `fields` per hash.
    Packed {
        /// Counters to size for.
        counters: u64,
        /// Fields per hash.
        fields: u32,
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
            Wanted::Packed { counters, fields } => {
                Packing::Packed(Packed::sized(counters, fields, groups))
            }
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
            Packing::Packed(_) => "packed",
        }
    }

    /// The packed shape, if packed.
    pub fn packed(&self) -> Option<&Packed> {
        match self {
            Packing::Strings => None,
            Packing::Packed(p) => Some(p),
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
