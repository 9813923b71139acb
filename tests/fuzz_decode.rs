//! A long property run over the event decoder, in place of a coverage-guided fuzzer.
//!
//! * Arbitrary bytes never panic, and the verdict is the same every time (a bad message stays
//!   bad, so skipping it is safe).
//! * Structured messages (known and unknown fields of every wire type, repeated fields,
//!   non-minimal varints, known fields with the wrong wire type) get the verdict an independent
//!   model of proto3 decoding predicts.
//! * The same messages in Confluent Schema Registry framing (magic byte 0, a schema id, the
//!   message-index list `[0]` in either of its forms) get the same verdict, and framings of
//!   arbitrary bytes never panic.
//! * Structurally mutated messages (bits flipped, bytes cut, inserted and removed, lengths
//!   claiming up to 2^64 bytes) never panic, and decoding them all does not grow the peak RSS
//!   of the process by more than [`PEAK_GROWTH_KIB`]: nothing is allocated by a claimed length.
//!
//! `TALLY_FUZZ_CASES` sets the number of cases per property (default 20,000; CI runs the
//! default, a long run sets 1,000,000 or more).

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tally::pipeline::decode::{BadReason, Like, decode};

/// How much the peak RSS may grow over the whole run.
const PEAK_GROWTH_KIB: u64 = 32 * 1024;

fn cases() -> u32 {
    std::env::var("TALLY_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

fn runner() -> TestRunner {
    TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    })
}

/// VmHWM (peak resident set) of this process, in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM in /proc/self/status")
}

/// One field as the model writes it.
#[derive(Debug, Clone)]
enum Value {
    /// Wire type 0; `pad` extra continuation bytes make a non-minimal encoding.
    Varint { value: u64, pad: u8 },
    /// Wire type 1.
    Fixed64(u64),
    /// Wire type 2.
    Bytes(Vec<u8>),
    /// Wire type 5.
    Fixed32(u32),
}

#[derive(Debug, Clone)]
struct Field {
    number: u32,
    value: Value,
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A varint with `pad` redundant continuation bytes, never longer than 10 bytes.
fn put_padded_varint(out: &mut Vec<u8>, v: u64, pad: u8) {
    let mut minimal = Vec::new();
    put_varint(&mut minimal, v);
    let pad = usize::from(pad).min(10 - minimal.len());
    if pad > 0 {
        *minimal.last_mut().unwrap() |= 0x80;
        minimal.extend(std::iter::repeat_n(0x80, pad - 1));
        minimal.push(0);
    }
    out.extend(minimal);
}

fn encode(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in fields {
        let key = |wire: u32| u64::from(f.number << 3 | wire);
        match &f.value {
            Value::Varint { value, pad } => {
                put_varint(&mut out, key(0));
                put_padded_varint(&mut out, *value, *pad);
            }
            Value::Fixed64(v) => {
                put_varint(&mut out, key(1));
                out.extend(v.to_le_bytes());
            }
            Value::Bytes(b) => {
                put_varint(&mut out, key(2));
                put_varint(&mut out, b.len() as u64);
                out.extend(b);
            }
            Value::Fixed32(v) => {
                put_varint(&mut out, key(5));
                out.extend(v.to_le_bytes());
            }
        }
    }
    out
}

/// The verdict proto3 decoding of `LikeEvent` plus tally's validation give: known fields
/// (1 post_id, 2 user_id, 3 action, 4 event_time_ms) are varints and the last one wins;
/// 5 event_id is a string, so its bytes must be UTF-8; unknown fields are skipped; a known
/// field with another wire type is undecodable.
fn model(fields: &[Field]) -> Result<Like, BadReason> {
    let (mut post, mut user, mut action, mut time) = (0u64, 0u64, 0i32, 0i64);
    for f in fields {
        match (f.number, &f.value) {
            (1..=4, Value::Varint { value, .. }) => match f.number {
                1 => post = *value,
                2 => user = *value,
                3 => action = *value as i32,
                _ => time = *value as i64,
            },
            (1..=4, _) => return Err(BadReason::Undecodable),
            (5, Value::Bytes(b)) if std::str::from_utf8(b).is_ok() => {}
            (5, _) => return Err(BadReason::Undecodable),
            _ => {}
        }
    }
    let delta = match action {
        1 => 1,
        2 => -1,
        0 => return Err(BadReason::ActionUnspecified),
        _ => return Err(BadReason::ActionUnknown),
    };
    if post == 0 {
        return Err(BadReason::PostIdZero);
    }
    Ok(Like {
        post_id: post,
        user_id: user,
        delta,
        event_time_ms: time,
    })
}

fn value() -> impl Strategy<Value = Value> {
    let varint = prop_oneof![
        Just(0u64),
        Just(1u64),
        Just(2u64),
        Just(u64::MAX),
        Just(1u64 << 63),
        Just(u64::from(u32::MAX) + 2),
        any::<u64>(),
    ];
    prop_oneof![
        6 => (varint, prop_oneof![3 => Just(0u8), 1 => 0u8..10]).prop_map(|(value, pad)| Value::Varint { value, pad }),
        1 => any::<u64>().prop_map(Value::Fixed64),
        1 => proptest::collection::vec(any::<u8>(), 0..40).prop_map(Value::Bytes),
        1 => any::<u32>().prop_map(Value::Fixed32),
    ]
}

fn field() -> impl Strategy<Value = Field> {
    let number = prop_oneof![
        8 => 1u32..=4,
        2 => 5u32..=20,
        1 => Just((1u32 << 29) - 1),
    ];
    (number, value()).prop_map(|(number, value)| Field { number, value })
}

/// A change to valid bytes.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    Remove(usize),
    /// A length-delimited field claiming `len` bytes, inserted at a position.
    HugeLength(usize, u64),
    /// A start-group or end-group tag (wire types 3 and 4) inserted at a position.
    Group(usize, bool),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let pos = any::<usize>();
    prop_oneof![
        (pos, 0u8..8).prop_map(|(p, b)| Mutation::FlipBit(p, b)),
        pos.prop_map(Mutation::Truncate),
        (pos, any::<u8>()).prop_map(|(p, b)| Mutation::Insert(p, b)),
        pos.prop_map(Mutation::Remove),
        (
            pos,
            prop_oneof![
                Just(u64::MAX),
                Just(1u64 << 40),
                Just(1u64 << 31),
                any::<u64>()
            ]
        )
            .prop_map(|(p, l)| Mutation::HugeLength(p, l)),
        (pos, any::<bool>()).prop_map(|(p, s)| Mutation::Group(p, s)),
    ]
}

fn mutate(bytes: &mut Vec<u8>, m: &Mutation) {
    let at = |p: usize, len: usize| if len == 0 { 0 } else { p % (len + 1) };
    match *m {
        Mutation::FlipBit(p, bit) if !bytes.is_empty() => {
            let i = p % bytes.len();
            bytes[i] ^= 1 << bit;
        }
        Mutation::Truncate(p) => bytes.truncate(at(p, bytes.len())),
        Mutation::Insert(p, b) => bytes.insert(at(p, bytes.len()), b),
        Mutation::Remove(p) if !bytes.is_empty() => {
            bytes.remove(p % bytes.len());
        }
        Mutation::HugeLength(p, len) => {
            let mut field = vec![(9 << 3) | 2];
            put_varint(&mut field, len);
            let i = at(p, bytes.len());
            bytes.splice(i..i, field);
        }
        Mutation::Group(p, start) => {
            let i = at(p, bytes.len());
            bytes.insert(i, (7 << 3) | if start { 3 } else { 4 });
        }
        _ => {}
    }
}

#[test]
fn the_decoder_survives_hostile_bytes() {
    let peak_before = peak_rss_kib();

    runner()
        .run(&proptest::collection::vec(any::<u8>(), 0..4096), |bytes| {
            let verdict = decode(Some(&bytes));
            prop_assert_eq!(verdict, decode(Some(&bytes)));
            Ok(())
        })
        .unwrap();

    runner()
        .run(&proptest::collection::vec(field(), 0..12), |fields| {
            let bytes = encode(&fields);
            prop_assert_eq!(decode(Some(&bytes)), model(&fields), "bytes {:02x?}", bytes);
            Ok(())
        })
        .unwrap();

    runner()
        .run(
            &(
                proptest::collection::vec(field(), 0..12),
                any::<u32>(),
                any::<bool>(),
            ),
            |(fields, id, long_form)| {
                let mut bytes = vec![0];
                bytes.extend(id.to_be_bytes());
                bytes.extend(if long_form {
                    &[0x02, 0x00][..]
                } else {
                    &[0x00]
                });
                bytes.extend(encode(&fields));
                prop_assert_eq!(decode(Some(&bytes)), model(&fields), "bytes {:02x?}", bytes);
                Ok(())
            },
        )
        .unwrap();

    runner()
        .run(&proptest::collection::vec(any::<u8>(), 0..64), |tail| {
            let mut bytes = vec![0];
            bytes.extend(tail);
            let verdict = decode(Some(&bytes));
            prop_assert_eq!(verdict, decode(Some(&bytes)));
            Ok(())
        })
        .unwrap();

    runner()
        .run(
            &(
                proptest::collection::vec(field(), 0..12),
                proptest::collection::vec(mutation(), 1..6),
            ),
            |(fields, mutations)| {
                let mut bytes = encode(&fields);
                for m in &mutations {
                    mutate(&mut bytes, m);
                }
                let verdict = decode(Some(&bytes));
                prop_assert_eq!(verdict, decode(Some(&bytes)));
                Ok(())
            },
        )
        .unwrap();

    // Claimed lengths far beyond the message, in every position a reader might trust them.
    for len in [
        u64::MAX,
        u64::MAX / 2,
        1 << 40,
        1 << 32,
        1 << 31,
        100_000_000,
    ] {
        let mut bytes = vec![0x08, 7, 0x18, 1, (9 << 3) | 2];
        put_varint(&mut bytes, len);
        bytes.extend([1, 2, 3]);
        assert_eq!(
            decode(Some(&bytes)),
            Err(BadReason::Undecodable),
            "len {len}"
        );
    }
    assert_eq!(decode(None), Err(BadReason::Empty));

    let growth = peak_rss_kib().saturating_sub(peak_before);
    eprintln!(
        "[fuzz_decode] {} cases per property; peak RSS grew by {growth} KiB",
        cases()
    );
    assert!(
        growth <= PEAK_GROWTH_KIB,
        "peak RSS grew by {growth} KiB while decoding (bound {PEAK_GROWTH_KIB} KiB)"
    );
}
