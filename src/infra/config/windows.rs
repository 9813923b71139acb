//! `--windows`, `--window-lateness` and `--window-retention`: the windows of
//! trending counts a new prefix keeps. Declared and checked here, with the
//! other settings; what they mean is [`crate::domain::windows`].
//!
//! Invariant: a [`WindowSettings`] exists only checked: sizes sorted without
//! repeats, each from one second to 366 days, at most [`MAX_WINDOWS`], and a
//! retention no shorter than the lateness.

use std::fmt;

/// The most window sizes one prefix keeps.
pub const MAX_WINDOWS: usize = 8;
/// The smallest window size: one second.
pub const MIN_SIZE_MS: u64 = 1_000;
/// The largest window size: 366 days.
pub const MAX_SIZE_MS: u64 = 366 * 86_400_000;
/// How late a like may come for its window unless told otherwise.
pub const DEFAULT_LATENESS_MS: u64 = 5 * 60_000;
/// How long a window's set is kept after its end unless told otherwise.
pub const DEFAULT_RETENTION_MS: u64 = 86_400_000;

/// The units durations are written in, largest first.
const UNITS: [(u64, char); 4] = [
    (86_400_000, 'd'),
    (3_600_000, 'h'),
    (60_000, 'm'),
    (1_000, 's'),
];

/// A duration in milliseconds, written with the largest unit that divides it.
#[derive(Debug, Clone, Copy)]
pub struct Millis(pub u64);

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match UNITS
            .into_iter()
            .find(|&(unit, _)| self.0.is_multiple_of(unit))
        {
            _ if self.0 == 0 => f.write_str("0s"),
            Some((unit, letter)) => write!(f, "{}{letter}", self.0 / unit),
            None => write!(f, "{}ms", self.0),
        }
    }
}

/// Parses `<number><s|m|h|d>` into milliseconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let bad = || {
        format!(
            "'{text}' is not a duration: write a number and a unit, s, m, h or d (30s, 5m, 1h, 1d)"
        )
    };
    let letter = text.chars().last().ok_or_else(bad)?;
    let unit = UNITS
        .into_iter()
        .find(|&(_, l)| l == letter)
        .map(|(unit, _)| unit)
        .ok_or_else(bad)?;
    let number: u64 = text[..text.len() - 1].parse().map_err(|_| bad())?;
    number.checked_mul(unit).ok_or_else(bad)
}

/// The windows a writer keeps, checked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WindowSettings {
    sizes_ms: Vec<u64>,
    lateness_ms: u64,
    retention_ms: u64,
}

impl WindowSettings {
    /// `sizes_ms` (sorted here, without repeats) with these rules; an error
    /// names the first thing wrong.
    pub fn new(
        mut sizes_ms: Vec<u64>,
        lateness_ms: u64,
        retention_ms: u64,
    ) -> Result<WindowSettings, String> {
        sizes_ms.sort_unstable();
        sizes_ms.dedup();
        if let Some(&size) = sizes_ms
            .iter()
            .find(|s| !(MIN_SIZE_MS..=MAX_SIZE_MS).contains(s))
        {
            return Err(format!(
                "window {} must be between 1s and 366d",
                Millis(size)
            ));
        }
        if sizes_ms.len() > MAX_WINDOWS {
            return Err(format!(
                "{} windows named; at most {MAX_WINDOWS}",
                sizes_ms.len()
            ));
        }
        if retention_ms < lateness_ms {
            return Err(format!(
                "the retention ({}) is shorter than the lateness ({}): a like allowed in a window would land after its set expired",
                Millis(retention_ms),
                Millis(lateness_ms)
            ));
        }
        Ok(WindowSettings {
            sizes_ms,
            lateness_ms,
            retention_ms,
        })
    }

    /// The sizes in milliseconds, smallest first.
    pub fn sizes_ms(&self) -> &[u64] {
        &self.sizes_ms
    }

    /// How long after a window's end a like still counts in it.
    pub fn lateness_ms(&self) -> u64 {
        self.lateness_ms
    }

    /// How long after a window's end its set is kept.
    pub fn retention_ms(&self) -> u64 {
        self.retention_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_once() {
        let ok = WindowSettings::new(vec![3_600_000, 60_000, 3_600_000], 0, 0).unwrap();
        assert_eq!(ok.sizes_ms(), [60_000, 3_600_000]);
        let error = WindowSettings::new(vec![3_600_000], 600_000, 60_000).unwrap_err();
        assert!(error.contains("retention (1m)"), "{error}");
        assert!(WindowSettings::new((1..=9).map(|m| m * 60_000).collect(), 0, 0).is_err());
        assert!(WindowSettings::new(vec![999], 0, 0).is_err());
        assert_eq!(parse_duration("90s"), Ok(90_000));
        assert!(parse_duration("1w").is_err());
        assert_eq!(Millis(1_500).to_string(), "1500ms");
    }
}
