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
//! agree on [`FP_BITS`] + log2(full size) bits of their hash. Removal
//! ([`Fingerprints::retain`]) moves the entries kept back towards their
//! homes in one pass, which keeps the order, so the table never holds
//! tombstones.

/// Bits of the hash's low half an entry keeps.
pub(super) const FP_BITS: u32 = 44;
/// Halvings below its full size a table starts at.
const LEVELS: u32 = 4;
/// The most a table may be filled before it doubles, when its owner asks
/// for no less ([`Fingerprints::new`]).
pub(super) const LOAD: f64 = 0.85;
/// Slots of one 64-byte cache line.
const SLOTS_A_LINE: usize = 64 / size_of::<u64>();
/// The farthest an entry may lie from its home (8 bits).
const MAX_DISTANCE: u64 = 255;

// An entry, from the top: fingerprint (44 bits), the low home bits (4),
// distance from home (8), the caller's byte (8). Zero is an empty slot.
const IDENT_SHIFT: u32 = 16;
const DISTANCE_SHIFT: u32 = 8;
const DISTANCE_MASK: u64 = 0xff << DISTANCE_SHIFT;
const USER_MASK: u64 = 0xff;

/// The slots of a table: an anonymous mapping the kernel is asked to back
/// with huge pages. Lookups land anywhere in tables of tens of megabytes per
/// partition, and with 4 KiB pages nearly every one also misses the TLB; a
/// 2 MiB page covers 262,144 slots.
///
/// The mapping reserves address space for the table's full size when the
/// table is made, and memory is faulted in only for the slots in use: a
/// table that doubles takes the next slots of the same mapping, so what a
/// window has ever touched is its largest size, not the sum of the sizes
/// it went through: half as much, for a window that stops growing where a
/// new one would have been made. (Faulting fresh pages in is the kernel
/// zeroing them; in a profile of a backlog applied with `ids-and-actions`
/// it took 4–5 % of tally's CPU, and how fast it goes depends on the host,
/// see docs/benchmarks.md.)
///
/// A huge page needs a whole aligned 2 MiB of the mapping, so a table of at
/// least that size is mapped with 2 MiB more address space than it needs
/// and starts at the first aligned address in it; the margin is never
/// touched, so it takes no memory. Slots in use are faulted in for writing
/// at once: left to the lookups, a page's first read maps the shared zero
/// page and its first write replaces it, a second fault that flushes the
/// page from every core's TLB. Where the kernel has no huge pages the
/// advice is ignored and the table works the same.
#[derive(Debug)]
struct Slots {
    map: memmap2::MmapMut,
    /// Where the slots start in the mapping, in bytes.
    start: usize,
    /// Slots in use.
    len: usize,
}

/// A huge page on x86_64 and aarch64 with 4 KiB base pages.
const HUGE_PAGE: usize = 2 << 20;

impl Slots {
    /// `len` zeroed slots, in a mapping with room for `most`.
    fn reserve(most: usize, len: usize) -> Slots {
        let bytes = most.max(len).max(1) * size_of::<u64>();
        let margin = if bytes >= HUGE_PAGE { HUGE_PAGE } else { 0 };
        let map = memmap2::MmapMut::map_anon(bytes + margin).unwrap_or_else(|error| {
            panic!("cannot map {bytes} bytes for a dedupe window: {error}")
        });
        let start = match margin {
            0 => 0,
            _ => (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE,
        };
        #[cfg(target_os = "linux")]
        let _ = map.advise_range(memmap2::Advice::HugePage, start, bytes);
        let mut slots = Slots { map, start, len: 0 };
        slots.extend(len);
        slots
    }

    /// Takes the slots up to `len` into use; the new ones are zero, as the
    /// mapping was made.
    fn extend(&mut self, len: usize) {
        let most = (self.map.len() - self.start) / size_of::<u64>();
        assert!(len <= most, "a table of {most} slots cannot take {len}");
        #[cfg(target_os = "linux")]
        if len > self.len {
            let from = self.start + self.len * size_of::<u64>();
            let bytes = (len - self.len) * size_of::<u64>();
            let _ = self
                .map
                .advise_range(memmap2::Advice::PopulateWrite, from, bytes);
        }
        self.len = len;
    }
}

impl std::ops::Deref for Slots {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        let bytes = &self.map[self.start..self.start + self.len * size_of::<u64>()];
        bytemuck::cast_slice(bytes)
    }
}

impl std::ops::DerefMut for Slots {
    fn deref_mut(&mut self) -> &mut [u64] {
        let bytes = &mut self.map[self.start..self.start + self.len * size_of::<u64>()];
        bytemuck::cast_slice_mut(bytes)
    }
}

/// What [`Fingerprints::walk`] found of two keys of one home.
#[derive(Debug, Clone, Copy)]
pub(super) struct Walk {
    /// The slot holding the first key, when held.
    pub(super) first: Option<usize>,
    /// The slot holding the second key, when held.
    pub(super) second: Option<usize>,
    /// Where the walk stopped: where a key of that home not held belongs.
    stop: usize,
    /// How far `stop` lies from the home.
    distance: u64,
    full_home: usize,
}

/// A key to remember: a 128-bit hash of what it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Key(pub(super) u128);

/// What the table holds for a key: its caller's byte.
pub(super) type Byte = u8;

/// A set of keys, each with a byte of the caller's.
#[derive(Debug)]
pub(super) struct Fingerprints {
    slots: Slots,
    len: usize,
    /// Slots at the full size; a multiple of `1 << LEVELS`.
    full: usize,
    /// Halvings below the full size the table is at now.
    level: u32,
    /// The most the table is filled before it doubles, at most [`LOAD`].
    load: f64,
    /// Entries beyond which an insertion doubles the table first: `load`
    /// of its size now.
    grow_at: usize,
    /// Entries dropped because they would lie too far from their home.
    forgotten: u64,
}

impl Fingerprints {
    /// A table that holds up to `most` keys filled to at most `load` (taken
    /// down to [`LOAD`] when above it). An insertion walks to the end of the
    /// run of entries it lands in, and those runs shorten fast as the load
    /// falls: about twenty slots at 0.85, two or three at 0.5.
    pub(super) fn new(most: usize, load: f64) -> Self {
        let load = load.min(LOAD);
        let unit = 1usize << LEVELS;
        let full = ((most as f64 / load).ceil() as usize).div_ceil(unit).max(1) * unit;
        Fingerprints {
            slots: Slots::reserve(full, full >> LEVELS),
            len: 0,
            full,
            level: LEVELS,
            load,
            grow_at: grow_at(load, full >> LEVELS),
            forgotten: 0,
        }
    }

    /// Keys held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Bytes the slots take in memory.
    pub(super) fn heap_bytes(&self) -> usize {
        self.slots.len() * size_of::<u64>()
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

    /// Asks for the cache line of the key's home slot, and the line after
    /// it, without waiting for them: the lookups of a run of records, asked
    /// for together before any is made, wait for memory side by side instead
    /// of one after the other. A lookup or an insertion walks the run of
    /// entries from the home on, about ten slots at a load of 0.78, so it
    /// mostly reads into the next line: asked for as well, that line took
    /// the table's functions from 178 to 151 ns a record over a backlog
    /// applied with `ids-and-actions` (a third line made it slower). A hint
    /// only; where the target has no prefetch it does nothing.
    pub(super) fn prefetch(&self, key: Key) {
        let home = self.locate(key).0 >> self.level;
        #[cfg(target_arch = "x86_64")]
        {
            safe_arch::prefetch_t0(&self.slots[home]);
            safe_arch::prefetch_t0(&self.slots[(home + SLOTS_A_LINE).min(self.slots.len() - 1)]);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = home;
    }

    /// Sets the byte of `key`, adding the key when it is new; returns the
    /// byte it had.
    pub(super) fn upsert(&mut self, key: Key, byte: Byte) -> Option<Byte> {
        let (full_home, ident) = self.locate(key);
        let slots: &mut [u64] = &mut self.slots;
        let size = slots.len();
        let mut i = full_home >> self.level;
        let mut distance = 0u64;
        loop {
            let entry = slots[i];
            if entry == 0 || distance_of(entry) < distance {
                break;
            }
            if distance_of(entry) == distance && entry >> IDENT_SHIFT == ident {
                slots[i] = (entry & !USER_MASK) | u64::from(byte);
                return Some((entry & USER_MASK) as Byte);
            }
            i = if i + 1 == size { 0 } else { i + 1 };
            distance += 1;
        }
        let entry = (ident << IDENT_SHIFT) | u64::from(byte);
        if self.level > 0 && self.len + 1 > self.grow_at {
            self.grow();
            self.insert(full_home >> self.level, 0, entry);
        } else {
            // The probe stopped where the key belongs.
            self.insert_where_probe_stopped(i, distance, entry);
        }
        None
    }

    /// Whether `key` is held, without changing anything.
    pub(super) fn contains(&self, key: Key) -> bool {
        self.walk(key, key, |_| true).first.is_some()
    }

    /// Looks `first` and `second`, two keys with one home, up in one walk
    /// from that home, changing nothing; the walk ends early when it finds
    /// `first`. An entry is taken for `first` only
    /// when its byte passes `first_byte`, and for `second` only when it does
    /// not: two keys of one home that the caller tells apart by their byte
    /// are never confused, whatever their fingerprints.
    pub(super) fn walk(&self, first: Key, second: Key, first_byte: impl Fn(Byte) -> bool) -> Walk {
        let (full_home, first_ident) = self.locate(first);
        let (second_home, second_ident) = self.locate(second);
        debug_assert_eq!(full_home, second_home, "the two keys share a home");
        let size = self.slots.len();
        let mut walk = Walk {
            first: None,
            second: None,
            stop: full_home >> self.level,
            distance: 0,
            full_home,
        };
        loop {
            let entry = self.slots[walk.stop];
            if entry == 0 || distance_of(entry) < walk.distance {
                return walk;
            }
            if distance_of(entry) == walk.distance {
                let ident = entry >> IDENT_SHIFT;
                let is_first = first_byte((entry & USER_MASK) as Byte);
                if ident == first_ident && is_first {
                    walk.first = Some(walk.stop);
                    return walk;
                } else if ident == second_ident && !is_first {
                    walk.second = Some(walk.stop);
                }
            }
            walk.stop = if walk.stop + 1 == size {
                0
            } else {
                walk.stop + 1
            };
            walk.distance += 1;
        }
    }

    /// Sets the byte of the entry a [`Walk`] found at `at`; returns the byte
    /// it had.
    pub(super) fn set_byte(&mut self, at: usize, byte: Byte) -> Byte {
        let entry = self.slots[at];
        self.slots[at] = (entry & !USER_MASK) | u64::from(byte);
        (entry & USER_MASK) as Byte
    }

    /// Adds `key`, which `walk` looked up and did not find, where the walk
    /// stopped; nothing may have changed the table since.
    pub(super) fn insert_walked(&mut self, walk: &Walk, key: Key, byte: Byte) {
        let (full_home, ident) = self.locate(key);
        debug_assert_eq!(full_home, walk.full_home, "the key the walk was for");
        let entry = (ident << IDENT_SHIFT) | u64::from(byte);
        if self.level > 0 && self.len + 1 > self.grow_at {
            self.grow();
            self.insert(full_home >> self.level, 0, entry);
        } else {
            self.insert_where_probe_stopped(walk.stop, walk.distance, entry);
        }
    }

    /// Adds two keys of the walk's home, neither held, where the walk
    /// stopped: the first there, the second in the slot after it, where a
    /// lookup of it stops once the first is in place (the entry moved on
    /// from that slot is one slot farther from its home, still less far
    /// than the second). Nothing may have changed the table since the walk.
    pub(super) fn insert_two_walked(
        &mut self,
        walk: &Walk,
        (first, first_byte): (Key, Byte),
        (second, second_byte): (Key, Byte),
    ) {
        if self.level > 0 && self.len + 2 > self.grow_at {
            self.upsert(first, first_byte);
            self.upsert(second, second_byte);
            return;
        }
        self.insert_walked(walk, first, first_byte);
        let (_, ident) = self.locate(first);
        let placed = self.slots[walk.stop];
        if placed >> IDENT_SHIFT != ident || distance_of(placed) != walk.distance {
            // The first was dropped (too far from its home): no shortcut.
            self.upsert(second, second_byte);
            return;
        }
        let next = Walk {
            stop: if walk.stop + 1 == self.slots.len() {
                0
            } else {
                walk.stop + 1
            },
            distance: walk.distance + 1,
            ..*walk
        };
        self.insert_walked(&next, second, second_byte);
    }

    /// [`Fingerprints::insert`] at the slot where a lookup of the entry's key
    /// stopped: an empty one, or one holding a richer entry. There, Robin
    /// Hood insertion comes to moving every entry from `at` to the end of
    /// its run one slot on, one slot farther from its home (of two entries
    /// with one home it may keep either in front, which no lookup tells
    /// apart): one copy, not a swap decided at every slot. A run that wraps
    /// round the table's end, or holds an entry that would pass
    /// [`MAX_DISTANCE`], goes the way of every other insertion.
    fn insert_where_probe_stopped(&mut self, at: usize, distance: u64, entry: u64) {
        let slots: &mut [u64] = &mut self.slots;
        let mut end = at;
        while end < slots.len() && slots[end] != 0 && distance_of(slots[end]) < MAX_DISTANCE {
            end += 1;
        }
        if distance > MAX_DISTANCE || end == slots.len() || slots[end] != 0 {
            return self.insert(at, distance, entry);
        }
        slots.copy_within(at..end, at + 1);
        for moved in &mut slots[at + 1..=end] {
            *moved += 1 << DISTANCE_SHIFT;
        }
        slots[at] = entry | (distance << DISTANCE_SHIFT);
        self.len += 1;
    }

    /// Places an entry (without its distance) `distance` slots past its home,
    /// at `at`, moving richer entries along. An entry that would lie more
    /// than [`MAX_DISTANCE`] from its home is dropped and counted: at a load
    /// of at most [`LOAD`] over a uniform hash that does not happen in
    /// practice, but a table must not loop or fail on it.
    fn insert(&mut self, at: usize, distance: u64, entry: u64) {
        let slots: &mut [u64] = &mut self.slots;
        let size = slots.len();
        if self.len == size {
            self.forgotten += 1;
            return;
        }
        self.len += 1;
        let mut carried = entry;
        let mut i = at;
        let mut distance = distance;
        loop {
            if distance > MAX_DISTANCE {
                self.len -= 1;
                self.forgotten += 1;
                return;
            }
            let there = slots[i];
            if there == 0 {
                slots[i] = carried | (distance << DISTANCE_SHIFT);
                return;
            }
            let theirs = distance_of(there);
            if theirs < distance {
                slots[i] = carried | (distance << DISTANCE_SHIFT);
                carried = there & !DISTANCE_MASK;
                distance = theirs;
            }
            i = if i + 1 == size { 0 } else { i + 1 };
            distance += 1;
        }
    }

    /// Doubles the table in place: each entry's home in the larger table
    /// is its home now with one more of its stored home bits, so twice its
    /// home or one past it.
    ///
    /// The entries are moved from the last slot down. An entry whose home is
    /// farther from slot 0 than [`MAX_DISTANCE`] has its new home past its
    /// slot now, among slots already moved, so its insertion never reads an
    /// entry not yet moved; the entries before the first empty slot at or
    /// after `2 * (MAX_DISTANCE + 1)` (those homed near slot 0 and those
    /// wrapped round from the end) are taken out first and put back last.
    /// Entries moved from the end that wrap round land within
    /// [`MAX_DISTANCE`] of slot 0, short of that empty slot.
    fn grow(&mut self) {
        let size = self.slots.len();
        self.slots.extend(size * 2);
        self.level -= 1;
        self.grow_at = grow_at(self.load, size * 2);
        // An entry lies at most MAX_DISTANCE past its home, wrapping round
        // at most once: one subtraction, not a division, finds its home.
        let home_of = |at: usize, entry: u64| {
            let home = at + size - distance_of(entry) as usize;
            if home >= size { home - size } else { home }
        };
        let slots: &mut [u64] = &mut self.slots;
        let mut end = (2 * (MAX_DISTANCE as usize + 1)).min(size);
        while end < size && slots[end] != 0 {
            end += 1;
        }
        let mut early = Vec::new();
        for (at, slot) in slots[..end].iter_mut().enumerate() {
            if *slot != 0 {
                early.push((home_of(at, *slot), std::mem::take(slot)));
            }
        }
        self.len = 0;
        for at in (end..size).rev() {
            let entry = std::mem::take(&mut self.slots[at]);
            if entry == 0 {
                continue;
            }
            let home = home_of(at, entry);
            debug_assert!(home > at - home, "moved from the end down: {home} at {at}");
            self.place(home, entry);
        }
        for (home, entry) in early {
            self.place(home, entry);
        }
    }

    /// Inserts an entry of the table before it doubled, whose home was
    /// `home` there, at its home in the doubled table.
    fn place(&mut self, home: usize, entry: u64) {
        let bit = ((entry >> IDENT_SHIFT) >> self.level) & 1;
        self.insert(home * 2 + bit as usize, 0, entry & !DISTANCE_MASK);
    }

    /// Removes every entry whose byte `keep` refuses, in one pass: each
    /// cluster (a run of occupied slots) is walked from its first slot, and
    /// every entry kept moves back to the first free slot at or after its
    /// home. Entries of a cluster lie in the order of their homes (the Robin
    /// Hood order), so the moved ones keep that order, and no slot is
    /// visited more than twice however many entries leave.
    ///
    /// The pass goes a cache line at a time. A line with no entry to remove
    /// and no hole left before it by a removal stays as it is, and is
    /// passed over after one test of its eight bytes, with no branch per
    /// slot; only the other lines are walked slot by slot. A window's sweep
    /// removes one block's entries in nine, so at its loads about half the
    /// lines (`ids-and-actions`) to two thirds (`ids`) are passed over.
    pub(super) fn retain(&mut self, keep: impl Fn(Byte) -> bool) {
        let slots: &mut [u64] = &mut self.slots;
        let size = slots.len();
        // A cluster never wraps past an empty slot: start after one.
        let Some(start) = slots.iter().position(|&e| e == 0) else {
            return;
        };
        let leaves = |entry: u64| (entry != 0) & !keep((entry & USER_MASK) as Byte);
        let mut removed = 0;
        // Positions are counted from `start` on without wrapping, so that a
        // cluster running over the table's end stays in order. Every slot
        // before `free` is settled; `free == at` when no hole waits behind
        // the slot at `at`.
        let end = start + size;
        let mut free = start + 1;
        let mut at = start + 1;
        while at < end {
            let first = if at >= size { at - size } else { at };
            // The slots from `at` up to the line's end, short of the table's
            // end and of the pass's.
            let line = SLOTS_A_LINE.min(end - at).min(size - first);
            let slots_of_line = &slots[first..first + line];
            if free == at
                && line == SLOTS_A_LINE
                && !slots_of_line.iter().fold(false, |any, &e| any | leaves(e))
            {
                at += line;
                free = at;
                continue;
            }
            for i in first..first + line {
                let entry = slots[i];
                if entry == 0 {
                    free = at + 1;
                } else if leaves(entry) {
                    slots[i] = 0;
                    removed += 1;
                } else {
                    let home = at - distance_of(entry) as usize;
                    let to = home.max(free);
                    free = to + 1;
                    if to != at {
                        slots[i] = 0;
                        let j = if to >= size { to - size } else { to };
                        let distance = (to - home) as u64;
                        slots[j] = (entry & !DISTANCE_MASK) | (distance << DISTANCE_SHIFT);
                    }
                }
                at += 1;
            }
        }
        self.len -= removed;
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

/// The entries a table of `size` slots holds at `load`.
fn grow_at(load: f64, size: usize) -> usize {
    (load * size as f64) as usize
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
            let mut table = Fingerprints::new(400, LOAD);
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

    /// Keys of one home, told apart by the low bit of their byte, through
    /// the walk and the insertions after it: the answers of a map, the order
    /// kept, through growth and removal.
    #[test]
    fn two_keys_of_one_home_walked_answer_as_a_map_does() {
        let config = proptest::test_runner::Config::with_cases(64);
        let mut runner = proptest::test_runner::TestRunner::new(config);
        let ops = prop::collection::vec((0u64..60, 0u64..4, 0u8..3, 0u8..40), 0..3_000);
        runner
            .run(&ops, |ops| {
                let mut table = Fingerprints::new(2_000, LOAD);
                // A home's keys: its high half, and a low half per key.
                let key = |home: u64, n: u64| {
                    Key(key(home).0 >> 64 << 64 | u128::from(key(1 << 40 | n).0 as u64))
                };
                let mut model: HashMap<(u64, u64), u8> = HashMap::new();
                for (step, (home, n, which, tag)) in ops.into_iter().enumerate() {
                    if step % 64 == 0 {
                        prop_assert!(table.ordered());
                    }
                    if tag == 0 {
                        let gone = (home % 8) as u8;
                        table.retain(|b| b >> 2 != gone);
                        model.retain(|_, b| *b >> 2 != gone);
                        continue;
                    }
                    // Even keys are of the first kind (byte bit clear), odd
                    // ones of the second (bit set); a walk pairs one of each.
                    let n = 2 * n;
                    let (first, second) = (key(home, n), key(home, n + 1));
                    let (first_byte, second_byte) = (tag << 2, tag << 2 | 1);
                    let walk = table.walk(first, second, |b| b & 1 == 0);
                    let held = |k| model.get(&(home, k)).copied();
                    let first_held = held(n);
                    prop_assert_eq!(walk.first.is_some(), first_held.is_some());
                    if walk.first.is_none() {
                        prop_assert_eq!(walk.second.is_some(), held(n + 1).is_some());
                    }
                    match (walk.first, walk.second, which) {
                        (Some(at), _, _) => {
                            prop_assert_eq!(Some(table.set_byte(at, first_byte)), first_held);
                            model.insert((home, n), first_byte);
                        }
                        (None, Some(at), 0) => {
                            table.set_byte(at, second_byte);
                            model.insert((home, n + 1), second_byte);
                        }
                        (None, Some(_), _) => {
                            table.insert_walked(&walk, first, first_byte);
                            model.insert((home, n), first_byte);
                        }
                        (None, None, _) => {
                            table.insert_two_walked(
                                &walk,
                                (second, second_byte),
                                (first, first_byte),
                            );
                            model.insert((home, n + 1), second_byte);
                            model.insert((home, n), first_byte);
                        }
                    }
                }
                prop_assert!(table.ordered());
                prop_assert_eq!(table.forgotten(), 0);
                // Every key the model holds is found with its byte.
                for (&(home, n), &byte) in &model {
                    let k = key(home, n);
                    let walk = table.walk(k, k, |b| b & 1 == byte & 1);
                    prop_assert!(walk.first.is_some(), "key {} of home {}", n, home);
                    prop_assert_eq!(table.set_byte(walk.first.unwrap(), byte), byte);
                }
                Ok(())
            })
            .unwrap();
    }

    /// One key held as each kind is two entries, each found only as its own.
    #[test]
    fn a_walk_tells_the_two_kinds_of_one_key_apart() {
        let mut table = Fingerprints::new(100, LOAD);
        let k = key(5);
        let first = |b: Byte| b & 1 == 0;
        let walk = table.walk(k, k, first);
        table.insert_walked(&walk, k, 1);
        let walk = table.walk(k, k, first);
        assert_eq!(walk.first, None, "held as the second kind only");
        let second = walk.second.expect("found as the second kind");
        table.insert_walked(&walk, k, 2);
        let walk = table.walk(k, k, first);
        let at = walk.first.expect("found as the first kind");
        assert_ne!(at, second);
        assert_eq!(table.set_byte(at, 4), 2);
        assert_eq!(table.set_byte(second, 3), 1);
        assert_eq!(table.len(), 2);
    }

    /// Tables large enough that doubling moves most entries from the end
    /// down (a few hundred slots are taken out and put back in any table),
    /// with removals between the doublings, over many key sets so that
    /// clusters at the first slots and clusters wrapping round the end occur.
    #[test]
    fn a_table_doubled_in_place_answers_as_a_map_does() {
        let most = 12_000;
        for set in 0..40u64 {
            let key = |n: u64| key(set << 32 | n);
            let mut table = Fingerprints::new(most, LOAD);
            let mut model: HashMap<u64, u8> = HashMap::new();
            for n in 0..(most as u64 * 3 / 2) {
                let byte = (n % 5) as u8;
                let level = table.level;
                assert_eq!(table.upsert(key(n), byte), model.insert(n, byte));
                if table.level != level {
                    assert!(
                        table.ordered(),
                        "Robin Hood order after doubling, set {set}"
                    );
                }
                if n % 1_800 == 1_799 {
                    let gone = ((n / 1_800) % 5) as u8;
                    table.retain(|b| b != gone);
                    model.retain(|_, b| *b != gone);
                }
            }
            assert!(table.level <= 1, "doubled at least three times");
            assert_eq!(table.len(), model.len());
            assert_eq!(table.forgotten(), 0);
            let mut kept: Vec<(u64, u8)> = model.into_iter().collect();
            kept.sort_unstable();
            for (n, byte) in kept {
                assert_eq!(table.upsert(key(n), 9), Some(byte), "key {n} of set {set}");
            }
        }
    }

    /// A cluster that wraps round the table's end when it doubles: the
    /// entries wrapped to its first slots must not be read as moved.
    #[test]
    fn a_cluster_wrapped_round_the_end_survives_doubling() {
        let most = 12_000;
        let mut table = Fingerprints::new(most, LOAD);
        let size = table.slots.len();
        let last = |n: &u64| table.full_home(key(*n)) >> LEVELS >= size - 4;
        let wrapped: Vec<u64> = (1_000_000..).filter(last).take(16).collect();
        for &n in &wrapped {
            assert_eq!(table.upsert(key(n), 1), None);
        }
        assert!(
            table.slots[..8].iter().all(|&e| e != 0),
            "wrapped round to slot 0"
        );
        let mut n = 0;
        while table.level == LEVELS {
            table.upsert(key(n), 2);
            n += 1;
        }
        assert!(table.ordered());
        assert_eq!(table.len(), n as usize + wrapped.len());
        for &w in &wrapped {
            assert_eq!(table.upsert(key(w), 3), Some(1), "wrapped key {w}");
        }
        for m in 0..n {
            assert_eq!(table.upsert(key(m), 3), Some(2), "key {m}");
        }
    }

    #[test]
    fn a_full_size_table_stays_within_its_load() {
        let most = 100_000;
        let mut table = Fingerprints::new(most, LOAD);
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
