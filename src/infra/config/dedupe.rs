//! `--dedupe` and `--dedupe-window`: which repeats of a like the consumer
//! skips, and how far back it looks. Declared here, with the other settings,
//! and applied by [`crate::pipeline::dedupe`].

use serde::{Deserialize, Serialize};

/// Which records the window looks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DedupeMode {
    /// Every record counts.
    #[default]
    #[serde(rename = "off")]
    Off,
    /// Records that repeat an event id are skipped.
    #[serde(rename = "ids")]
    Ids,
    /// As `ids`, and id-less records that repeat the user's last action on
    /// the post are skipped.
    #[serde(rename = "ids-and-actions")]
    IdsAndActions,
}

impl DedupeMode {
    /// Every mode, in the order `--help` lists them.
    pub const ALL: [DedupeMode; 3] = [DedupeMode::Off, DedupeMode::Ids, DedupeMode::IdsAndActions];

    /// The name of the mode in flags and files.
    pub fn as_str(self) -> &'static str {
        match self {
            DedupeMode::Off => "off",
            DedupeMode::Ids => "ids",
            DedupeMode::IdsAndActions => "ids-and-actions",
        }
    }
}

impl std::fmt::Display for DedupeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DedupeMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DedupeMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                format!("unknown dedupe mode '{s}'; expected off, ids or ids-and-actions")
            })
    }
}

/// Default of `--dedupe-window`: offsets per partition.
pub const DEFAULT_WINDOW: u64 = 1_000_000;
/// The largest `--dedupe-window`: about 2.3 GB per partition at 23 bytes a
/// remembered event (`ids-and-actions`), more than any consumer should hold.
pub const MAX_WINDOW: u64 = 100_000_000;
/// Blocks a window of `--dedupe-window` offsets is cut into: the window
/// moves a block at a time, so it spans at least `--dedupe-window` offsets
/// and less than a block more.
pub const BLOCKS: i64 = 8;

/// `--dedupe` and `--dedupe-window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DedupeSettings {
    /// Which records are looked for.
    pub mode: DedupeMode,
    /// The window, in offsets of a partition.
    pub span: u64,
}

impl Default for DedupeSettings {
    fn default() -> Self {
        Self {
            mode: DedupeMode::Off,
            span: DEFAULT_WINDOW,
        }
    }
}

impl DedupeSettings {
    /// Whether any record may be skipped.
    pub fn on(&self) -> bool {
        self.mode != DedupeMode::Off
    }

    /// Offsets per block of the window.
    pub fn block_len(&self) -> i64 {
        (self.span.max(1) as i64 + BLOCKS - 1) / BLOCKS
    }

    /// The first offset of the window the record at `offset` is judged by:
    /// the start of the block [`BLOCKS`] blocks before its own.
    pub fn window_start(&self, offset: i64) -> i64 {
        let block = self.block_len();
        (offset.div_euclid(block) - BLOCKS) * block
    }

    /// Where an owner resuming at `resume` re-reads from, so that every
    /// record from `resume` on is judged as a reading from the origin judges
    /// it: never below the origin, since nothing before it was ever decided.
    /// The id rule needs the window of `resume`; the action rule of
    /// `ids-and-actions` also needs the id verdicts of the records in that
    /// window, whose own windows reach one window further back.
    pub fn rewind(&self, origin: i64, resume: i64) -> i64 {
        let start = self.window_start(resume);
        let from = match self.mode {
            DedupeMode::IdsAndActions => self.window_start(start),
            DedupeMode::Ids | DedupeMode::Off => start,
        };
        from.max(origin).min(resume)
    }
}
