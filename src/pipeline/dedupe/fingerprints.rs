//! Fingerprints: the flat table a dedupe window remembers keys in, eight
//! bytes an entry, with no allocation per entry.
//!
//! A key is a 128-bit hash. Its high half picks the key's *home* slot out of
//! the table's full size ([`Fingerprints::new`] fixes that size for the
//! largest window it will hold); the table starts at a sixteenth of it and
//! doubles up to it, so an entry keeps the four low bits of its full-size
//! home to find its home in the next size. The rest of the entry is
//! [`FP_BITS`] bits of the hash's low half, its distance from its home, and
//! eight bits of the caller's (a tag and a flag).
//!
//! # Invariant: Robin Hood order
//!
//! Every entry lies at its home or after it, with every slot in between
//! occupied by entries at least as far from their own homes. A lookup can
//! therefore stop at the first slot closer to its home than the probe is,
//! and a key is found exactly when an entry with its home, its four home
//! bits and its fingerprint is there: two keys are confused only when they
//! agree on [`FP_BITS`] + log2(full size) bits of their hash. Removal shifts
//! the entries after a hole back by one, which keeps the order, so the
//! table never holds tombstones.

/// Bits of the hash's low half an entry keeps.
pub(super) const FP_BITS: u32 = 44;
/// Halvings below its full size a table starts at.
const LEVELS: u32 = 4;
/// The most a table is filled before it doubles.
pub(super) const LOAD: f64 = 0.85;
/// The farthest an entry may lie from its home (8 bits).
const MAX_DISTANCE: u64 = 255;

// An entry, from the top: fingerprint (44 bits), the low home bits (4),
// distance from home (8), the caller's byte (8). Zero is an empty slot.
const IDENT_SHIFT: u32 = 16;
const DISTANCE_SHIFT: u32 = 8;
const DISTANCE_MASK: u64 = 0xff << DISTANCE_SHIFT;
const USER_MASK: u64 = 0xff;

/// A key to remember: a 128-bit hash of what it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Key(pub(super) u128);

/// What the table holds for a key: its caller's byte.
pub(super) type Byte = u8;

/// A set of keys, each with a byte of the caller's.
#[derive(Debug)]
pub(super) struct Fingerprints {
    slots: Vec<u64>,
    len: usize,
    /// Slots at the full size; a multiple of `1 << LEVELS`.
    full: usize,
    /// Halvings below the full size the table is at now.
    level: u32,
    /// Entries dropped because they would lie too far from their home.
    forgotten: u64,
}

impl Fingerprints {
    /// A table that holds up to `most` keys within [`LOAD`].
    pub(super) fn new(most: usize) -> Self {
        let unit = 1usize << LEVELS;
        let full = ((most as f64 / LOAD).ceil() as usize).div_ceil(unit).max(1) * unit;
        Fingerprints {
            slots: vec![0; full >> LEVELS],
            len: 0,
            full,
            level: LEVELS,
            forgotten: 0,
        }
    }

    /// Keys held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Bytes the slots take on the heap.
    pub(super) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * size_of::<u64>()
    }

    /// Entries the table had to drop (see [`Fingerprints::insert`]).
    pub(super) fn forgotten(&self) -> u64 {
        self.forgotten
    }

    /// The key's home at the full size, and its identity: fingerprint and
    /// the low home bits, as an entry stores them.
    fn locate(&self, key: Key) -> (usize, u64) {
        let high = (key.0 >> 64) as u64;
        let home = ((u128::from(high) * self.full as u128) >> 64) as usize;
        let mut fp = (key.0 as u64) >> (64 - FP_BITS);
        if fp == 0 {
            fp = 1;
        }
        let low = (home & ((1 << LEVELS) - 1)) as u64;
        (home, (fp << LEVELS) | low)
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() { 0 } else { i + 1 }
    }

    /// Sets the byte of `key`, adding the key when it is new; returns the
    /// byte it had.
    pub(super) fn upsert(&mut self, key: Key, byte: Byte) -> Option<Byte> {
        let (full_home, ident) = self.locate(key);
        let mut i = full_home >> self.level;
        let mut distance = 0u64;
        loop {
            let entry = self.slots[i];
            if entry == 0 || distance_of(entry) < distance {
                break;
            }
            if distance_of(entry) == distance && entry >> IDENT_SHIFT == ident {
                self.slots[i] = (entry & !USER_MASK) | u64::from(byte);
                return Some((entry & USER_MASK) as Byte);
            }
            i = self.next(i);
            distance += 1;
        }
        if self.level > 0 && (self.len + 1) as f64 > LOAD * self.slots.len() as f64 {
            self.grow();
        }
        self.insert(
            full_home >> self.level,
            (ident << IDENT_SHIFT) | u64::from(byte),
        );
        None
    }

    /// Places an entry (without its distance) from `home` on, moving richer
    /// entries along. An entry that would lie more than [`MAX_DISTANCE`]
    /// from its home is dropped and counted: at a load of at most [`LOAD`]
    /// over a uniform hash that does not happen in practice, but a table
    /// must not loop or fail on it.
    fn insert(&mut self, home: usize, entry: u64) {
        if self.len == self.slots.len() {
            self.forgotten += 1;
            return;
        }
        self.len += 1;
        let mut carried = entry;
        let mut i = home;
        let mut distance = 0u64;
        loop {
            if distance > MAX_DISTANCE {
                self.len -= 1;
                self.forgotten += 1;
                return;
            }
            let there = self.slots[i];
            if there == 0 {
                self.slots[i] = carried | (distance << DISTANCE_SHIFT);
                return;
            }
            let theirs = distance_of(there);
            if theirs < distance {
                self.slots[i] = carried | (distance << DISTANCE_SHIFT);
                carried = there & !DISTANCE_MASK;
                distance = theirs;
            }
            i = self.next(i);
            distance += 1;
        }
    }

    /// Doubles the table: each entry's home in the larger table is its
    /// home now with one more of its stored home bits.
    fn grow(&mut self) {
        let old = std::mem::replace(&mut self.slots, vec![0; self.full >> (self.level - 1)]);
        self.level -= 1;
        self.len = 0;
        let size = old.len();
        for (at, &entry) in old.iter().enumerate() {
            if entry == 0 {
                continue;
            }
            let home = (at + size - distance_of(entry) as usize) % size;
            let bit = ((entry >> IDENT_SHIFT) >> self.level) & 1;
            self.insert(home * 2 + bit as usize, entry & !DISTANCE_MASK);
        }
    }

    /// Removes every entry whose byte `keep` refuses.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(Byte) -> bool) {
        let mut i = 0;
        while i < self.slots.len() {
            let entry = self.slots[i];
            if entry != 0 && !keep((entry & USER_MASK) as Byte) {
                self.remove_at(i);
                // The slot now holds the entry that followed: look again.
                continue;
            }
            i += 1;
        }
    }

    /// Empties the slot at `i` and shifts the entries after it back by one,
    /// up to the next empty slot or entry at its home.
    fn remove_at(&mut self, i: usize) {
        let mut hole = i;
        loop {
            let after = self.next(hole);
            let entry = self.slots[after];
            if entry == 0 || distance_of(entry) == 0 {
                self.slots[hole] = 0;
                break;
            }
            self.slots[hole] = entry - (1 << DISTANCE_SHIFT);
            hole = after;
        }
        self.len -= 1;
    }

    /// Removes every entry.
    pub(super) fn clear(&mut self) {
        self.slots.fill(0);
        self.len = 0;
    }

    /// The key's home at the full size (for tests).
    #[cfg(test)]
    pub(super) fn full_home(&self, key: Key) -> usize {
        self.locate(key).0
    }

    /// Whether every entry keeps the Robin Hood order (for tests).
    #[cfg(test)]
    pub(super) fn ordered(&self) -> bool {
        let size = self.slots.len();
        (0..size).all(|i| {
            let entry = self.slots[i];
            if entry == 0 {
                return true;
            }
            // Every slot from the home up to here is occupied by an entry at
            // least as far from its home as the probe would be there.
            let d = distance_of(entry) as usize;
            (1..=d).all(|back| {
                let at = (i + size - back) % size;
                let other = self.slots[at];
                other != 0 && distance_of(other) as usize >= d - back
            })
        })
    }
}

fn distance_of(entry: u64) -> u64 {
    (entry & DISTANCE_MASK) >> DISTANCE_SHIFT
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    fn key(n: u64) -> Key {
        Key(xxhash_rust::xxh3::xxh3_128(&n.to_le_bytes()))
    }

    proptest! {
        /// Against a map: the same answers, the order kept, through growth
        /// and removal.
        #[test]
        fn the_table_answers_as_a_map_does(
            ops in prop::collection::vec((0u64..300, 0u8..4, any::<bool>()), 0..2_000),
        ) {
            let mut table = Fingerprints::new(400);
            let mut model: HashMap<u64, u8> = HashMap::new();
            for (n, byte, drop_some) in ops {
                if drop_some && n % 50 == 0 {
                    table.retain(|b| b != byte);
                    model.retain(|_, b| *b != byte);
                } else {
                    prop_assert_eq!(table.upsert(key(n), byte), model.insert(n, byte));
                }
                prop_assert_eq!(table.len(), model.len());
            }
            prop_assert!(table.ordered());
            prop_assert_eq!(table.forgotten(), 0);
        }
    }

    #[test]
    fn a_full_size_table_stays_within_its_load() {
        let most = 100_000;
        let mut table = Fingerprints::new(most);
        for n in 0..most as u64 {
            assert_eq!(table.upsert(key(n), 1), None);
        }
        assert_eq!(table.level, 0, "grown to its full size");
        assert!(table.len() as f64 <= LOAD * table.slots.len() as f64);
        assert_eq!(table.forgotten(), 0);
        assert!(table.ordered());
        for n in 0..most as u64 {
            assert_eq!(table.upsert(key(n), 2), Some(1), "key {n} found");
        }
    }
}
