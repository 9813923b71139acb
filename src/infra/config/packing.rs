//! `--layout`, `--packed-counters` and `--packed-fields`: how a new prefix,
//! or the generation `tally rebuild` makes, keeps its counters. Declared
//! here, with the other settings, and applied by [`crate::domain::packing`].

use serde::{Deserialize, Serialize};

/// Fields per hash a packed generation of a fixed number of hashes
/// (`--packed-counters`) is sized for unless told otherwise: Redis keeps a
/// hash of up to `hash-max-listpack-entries` (128 unless configured) fields
/// as a listpack, and hashes sized for 64 stay under it until the generation
/// holds twice the counters it was sized for.
pub const DEFAULT_PACKED_FIELDS: u32 = 64;
/// The most fields per hash a generation may be sized for.
pub const MAX_PACKED_FIELDS: u32 = 4096;

/// A layout's name in flags and files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayoutName {
    /// A string key per counter (INCRBY).
    #[default]
    #[serde(rename = "strings")]
    Strings,
    /// Counters as fields of small hashes (HINCRBY).
    #[serde(rename = "packed")]
    Packed,
}

impl LayoutName {
    /// Every layout, in the order `--help` lists them.
    pub const ALL: [LayoutName; 2] = [LayoutName::Strings, LayoutName::Packed];

    /// The name in flags and files.
    pub fn as_str(self) -> &'static str {
        match self {
            LayoutName::Strings => "strings",
            LayoutName::Packed => "packed",
        }
    }
}

impl std::str::FromStr for LayoutName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LayoutName::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown layout '{s}'; expected strings or packed"))
    }
}

/// The packing a writer asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PackingSettings {
    /// `--layout`; `None` keeps the one the prefix has (strings on a new one).
    pub layout: Option<LayoutName>,
    /// `--packed-counters`: counters a packed generation with a fixed number
    /// of hashes is sized for; `None` (the default) for hashes that split as
    /// they fill.
    pub counters: Option<u64>,
    /// `--packed-fields`: fields per hash; `None` for the default of the kind.
    pub fields: Option<u32>,
}
