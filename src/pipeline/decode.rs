//! Decode: Kafka message bytes to a validated like or a bad-message reason.
//!
//! Invariant: decoding is deterministic. The same bytes always give the same
//! verdict, so a bad message is bad forever: redelivery cannot fix it, and the
//! caller may count it, dead-letter it and move on without stalling the partition.
//! Decoding allocates nothing per value: each is decoded into a per-thread
//! event whose `event_id` keeps its capacity, and the id is hashed at once
//! into an [`EventId`] so that what follows stays of fixed size.
//!
//! # Two forms of a value
//! - Plain protobuf: the bytes of one `LikeEvent`.
//! - Confluent Schema Registry framing, as its serializers write it: a magic
//!   byte 0, the schema id as 4 bytes big-endian, the message-index list, then
//!   the protobuf. The list says which message of the registered schema
//!   follows: zig-zag varints, a count and that many indexes, with the common
//!   list `[0]` written as the single byte 0. `LikeEvent` is the first message
//!   of `like_event.proto`, so `[0]` (written either way) is the only list
//!   accepted.
//!
//! Telling the two apart is unambiguous: a protobuf message starts with a tag,
//! `field_number << 3 | wire_type`, and field numbers start at 1, so its first
//! byte is never 0 (a leading 0 is field number 0, which no protobuf decoder
//! accepts). An empty value is plain protobuf: a `LikeEvent` of defaults.
//!
//! A [`Decoder`] may check the schema id against a list of allowed ids
//! (`--schema-ids`); without one every id is accepted.

use prost::Message as _;

use crate::domain::proto::{Action, LikeEvent};

thread_local! {
    /// The event each value is decoded into, cleared first: the `event_id`
    /// string keeps its capacity from one value to the next.
    static SCRATCH: std::cell::RefCell<LikeEvent> = std::cell::RefCell::new(LikeEvent::default());
}

/// The magic byte that opens a Schema Registry framed value.
pub const MAGIC_BYTE: u8 = 0;

/// A like or unlike that passed validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Like {
    /// The post liked or unliked; never 0.
    pub post_id: u64,
    /// The user who acted; picks the bucket.
    pub user_id: u64,
    /// +1 for a like, -1 for an unlike.
    pub delta: i64,
    /// The producer's clock (`event_time_ms`), 0 when it sent none: which
    /// window of trending counts the like falls in (see
    /// [`crate::domain::windows`]).
    pub event_time_ms: i64,
}

/// A record's `event_id`, hashed (XXH3-128 of its bytes): what the dedupe
/// window compares (see [`crate::pipeline::dedupe`]). An empty id is none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventId(pub u128);

impl EventId {
    /// The id of `bytes`.
    pub fn of(bytes: &[u8]) -> EventId {
        EventId(xxhash_rust::xxh3::xxh3_128(bytes))
    }

    /// The id bound to the event it names, given a 64-bit hash of what
    /// else names the event (its post, user and action): one id with
    /// another post, user or action names another event, so a producer that
    /// reuses ids across events loses none of them.
    pub fn keyed(self, event_seed: u64) -> u128 {
        xxhash_rust::xxh3::xxh3_128_with_seed(&self.0.to_le_bytes(), event_seed)
    }
}

/// Why a message was rejected. Each reason is a metric label and a
/// dead-letter header value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BadReason {
    /// The message had no value at all (a tombstone).
    Empty,
    /// The bytes are not a valid protobuf `LikeEvent`.
    Undecodable,
    /// `post_id` is 0, which no post has.
    PostIdZero,
    /// `action` is `ACTION_UNSPECIFIED`.
    ActionUnspecified,
    /// `action` is a number the schema does not define.
    ActionUnknown,
    /// The Kafka timestamp lies past [`MAX_TIMESTAMP_MS`]: no real clock
    /// (a producer stamping microseconds lands in the year 55,000).
    TimestampOutOfRange,
    /// The value starts with the Schema Registry magic byte but ends inside
    /// the framing (the schema id or the message-index list).
    FramingTruncated,
    /// The framed schema id is not one of the allowed `--schema-ids`.
    SchemaIdUnknown,
    /// The message-index list is malformed or names a message other than
    /// `LikeEvent`, the first message of the schema.
    MessageIndexInvalid,
}

/// 2100-01-01T00:00:00Z. An event stamped later is dead-lettered by this
/// fixed rule, the same on every replay and in every rebuild, instead of
/// making routing final for centuries (see [`crate::domain::versions`]).
pub const MAX_TIMESTAMP_MS: i64 = 4_102_444_800_000;

/// Checks the Kafka timestamp an event is routed by.
pub fn check_timestamp(timestamp_ms: i64) -> Result<(), BadReason> {
    if timestamp_ms > MAX_TIMESTAMP_MS {
        return Err(BadReason::TimestampOutOfRange);
    }
    Ok(())
}

impl BadReason {
    /// Every reason, for pre-registering metrics.
    pub const ALL: [BadReason; 9] = [
        BadReason::Empty,
        BadReason::Undecodable,
        BadReason::PostIdZero,
        BadReason::ActionUnspecified,
        BadReason::ActionUnknown,
        BadReason::TimestampOutOfRange,
        BadReason::FramingTruncated,
        BadReason::SchemaIdUnknown,
        BadReason::MessageIndexInvalid,
    ];

    /// The stable name used in metrics, logs and dead-letter headers.
    pub fn as_str(self) -> &'static str {
        match self {
            BadReason::Empty => "empty",
            BadReason::Undecodable => "undecodable",
            BadReason::PostIdZero => "post_id_zero",
            BadReason::ActionUnspecified => "action_unspecified",
            BadReason::ActionUnknown => "action_unknown",
            BadReason::TimestampOutOfRange => "timestamp_out_of_range",
            BadReason::FramingTruncated => "framing_truncated",
            BadReason::SchemaIdUnknown => "schema_id_unknown",
            BadReason::MessageIndexInvalid => "message_index_invalid",
        }
    }
}

impl std::fmt::Display for BadReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Decodes and validates one message value, plain or framed, accepting any
/// schema id.
pub fn decode(payload: Option<&[u8]>) -> Result<Like, BadReason> {
    Decoder::ANY_SCHEMA.decode(payload)
}

/// Decodes message values, checking framed ones against the allowed schema ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decoder {
    /// Allowed schema ids; empty accepts any.
    schema_ids: Vec<u32>,
}

impl Decoder {
    /// A decoder that accepts every schema id.
    pub const ANY_SCHEMA: Decoder = Decoder {
        schema_ids: Vec::new(),
    };

    /// A decoder that accepts framed values with one of `schema_ids` only, or
    /// any id when the list is empty. Plain values carry no id and are
    /// accepted either way.
    pub fn new(schema_ids: &[u32]) -> Decoder {
        Decoder {
            schema_ids: schema_ids.to_vec(),
        }
    }

    /// Decodes and validates one message: its value, and the Kafka timestamp
    /// it is routed by. What `tally run` counts and what `tally verify`
    /// recounts, by the same rules.
    pub fn event(&self, payload: Option<&[u8]>, timestamp_ms: i64) -> Result<Like, BadReason> {
        let (like, _) = self.decode_event(payload, false)?;
        check_timestamp(timestamp_ms)?;
        Ok(like)
    }

    /// [`Decoder::event`], with the event's id when it carries one. Only
    /// dedupe reads the id: [`Decoder::event`] leaves it unhashed.
    pub fn identified(
        &self,
        payload: Option<&[u8]>,
        timestamp_ms: i64,
    ) -> Result<(Like, Option<EventId>), BadReason> {
        let event = self.decode_event(payload, true)?;
        check_timestamp(timestamp_ms)?;
        Ok(event)
    }

    /// Decodes and validates one message value.
    pub fn decode(&self, payload: Option<&[u8]>) -> Result<Like, BadReason> {
        self.decode_event(payload, false).map(|(like, _)| like)
    }

    /// The event, and its id when `with_id` and it carries one.
    fn decode_event(
        &self,
        payload: Option<&[u8]>,
        with_id: bool,
    ) -> Result<(Like, Option<EventId>), BadReason> {
        let bytes = payload.ok_or(BadReason::Empty)?;
        let protobuf = match bytes.split_first() {
            Some((&MAGIC_BYTE, framed)) => self.unframe(framed)?,
            _ => bytes,
        };
        SCRATCH.with_borrow_mut(|event| {
            event.clear();
            event.merge(protobuf).map_err(|_| BadReason::Undecodable)?;
            let id = (with_id && !event.event_id.is_empty())
                .then(|| EventId::of(event.event_id.as_bytes()));
            Ok((validate(event)?, id))
        })
    }

    /// The protobuf after the magic byte, the schema id and the message-index
    /// list, once they are checked.
    fn unframe<'a>(&self, framed: &'a [u8]) -> Result<&'a [u8], BadReason> {
        let (id, mut rest) = framed
            .split_first_chunk::<4>()
            .ok_or(BadReason::FramingTruncated)?;
        let id = u32::from_be_bytes(*id);
        if !self.schema_ids.is_empty() && !self.schema_ids.contains(&id) {
            return Err(BadReason::SchemaIdUnknown);
        }
        // `[0]` is written as the count 0, or as the count 1 and the index 0;
        // any other list names another message (or a nested one).
        match read_zigzag(&mut rest)? {
            0 => {}
            1 if read_zigzag(&mut rest)? == 0 => {}
            _ => return Err(BadReason::MessageIndexInvalid),
        }
        Ok(rest)
    }
}

/// Reads one zig-zag varint of the message-index list.
fn read_zigzag(bytes: &mut &[u8]) -> Result<i64, BadReason> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = bytes.split_first().ok_or(BadReason::FramingTruncated)?;
        *bytes = rest;
        if shift == 63 && byte > 1 {
            return Err(BadReason::MessageIndexInvalid);
        }
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok((value >> 1) as i64 ^ -((value & 1) as i64));
        }
    }
    Err(BadReason::MessageIndexInvalid)
}

/// The like a decoded event is, or why it is none.
fn validate(event: &LikeEvent) -> Result<Like, BadReason> {
    let delta = match Action::try_from(event.action) {
        Ok(Action::Like) => 1,
        Ok(Action::Unlike) => -1,
        Ok(Action::Unspecified) => return Err(BadReason::ActionUnspecified),
        Err(_) => return Err(BadReason::ActionUnknown),
    };
    if event.post_id == 0 {
        return Err(BadReason::PostIdZero);
    }
    Ok(Like {
        post_id: event.post_id,
        user_id: event.user_id,
        delta,
        event_time_ms: event.event_time_ms,
    })
}

/// Encodes a like event; used by the traffic generator and tests.
pub fn encode(post_id: u64, user_id: u64, action: Action, event_time_ms: i64) -> Vec<u8> {
    encode_with_id(post_id, user_id, action, event_time_ms, "")
}

/// As [`encode`], with the producer's `event_id` (empty: none).
pub fn encode_with_id(
    post_id: u64,
    user_id: u64,
    action: Action,
    event_time_ms: i64,
    event_id: &str,
) -> Vec<u8> {
    LikeEvent {
        post_id,
        user_id,
        action: action as i32,
        event_time_ms,
        event_id: event_id.to_string(),
    }
    .encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn likes_and_unlikes_decode_to_signed_deltas() {
        let like = encode(7, 9, Action::Like, 1);
        let unlike = encode(7, 9, Action::Unlike, 2);
        assert_eq!(
            decode(Some(&like)),
            Ok(Like {
                post_id: 7,
                user_id: 9,
                delta: 1,
                event_time_ms: 1,
            })
        );
        assert_eq!(
            decode(Some(&unlike)),
            Ok(Like {
                post_id: 7,
                user_id: 9,
                delta: -1,
                event_time_ms: 2,
            })
        );
    }

    #[test]
    fn each_kind_of_bad_message_has_its_reason() {
        assert_eq!(decode(None), Err(BadReason::Empty));
        // An empty value decodes to all defaults: post 0 is caught.
        assert_eq!(decode(Some(&[])), Err(BadReason::ActionUnspecified));
        assert_eq!(
            decode(Some(&[0xff, 0xff, 0xff])),
            Err(BadReason::Undecodable)
        );
        assert_eq!(
            decode(Some(&encode(0, 1, Action::Like, 0))),
            Err(BadReason::PostIdZero)
        );
        assert_eq!(
            decode(Some(&encode(5, 1, Action::Unspecified, 0))),
            Err(BadReason::ActionUnspecified)
        );
        let unknown = LikeEvent {
            post_id: 5,
            user_id: 1,
            action: 9,
            event_time_ms: 0,
            event_id: String::new(),
        };
        assert_eq!(
            decode(Some(&unknown.encode_to_vec())),
            Err(BadReason::ActionUnknown)
        );
    }

    #[test]
    fn an_event_id_is_read_when_present_and_changes_nothing_else() {
        let with_id = LikeEvent {
            post_id: 7,
            user_id: 9,
            action: Action::Like as i32,
            event_time_ms: 1,
            event_id: "outbox-42".to_string(),
        }
        .encode_to_vec();
        let plain = encode(7, 9, Action::Like, 1);
        let d = Decoder::ANY_SCHEMA;
        let (like, id) = d.identified(Some(&with_id), 1).unwrap();
        assert_eq!(Ok(like), d.event(Some(&plain), 1));
        assert_eq!(id, Some(EventId::of(b"outbox-42")));
        assert_eq!(d.identified(Some(&plain), 1).unwrap().1, None);
        // Framed values carry it too.
        let framed = [&[0u8, 0, 0, 0, 12, 0][..], &with_id].concat();
        assert_eq!(d.identified(Some(&framed), 1).unwrap().1, id);
    }

    #[test]
    fn hand_encoded_bytes_match_the_schema() {
        // field 1 varint 101, field 2 varint 7, field 3 varint 2 (UNLIKE)
        let bytes = [0x08, 101, 0x10, 7, 0x18, 2];
        assert_eq!(
            decode(Some(&bytes)),
            Ok(Like {
                post_id: 101,
                user_id: 7,
                delta: -1,
                event_time_ms: 0,
            })
        );
    }

    /// A Schema Registry framed value: magic byte, id, message indexes as
    /// raw bytes, protobuf.
    fn framed(id: u32, indexes: &[u8], protobuf: &[u8]) -> Vec<u8> {
        let mut out = vec![MAGIC_BYTE];
        out.extend(id.to_be_bytes());
        out.extend(indexes);
        out.extend(protobuf);
        out
    }

    const LIKE_7_9: Like = Like {
        post_id: 7,
        user_id: 9,
        delta: 1,
        event_time_ms: 1,
    };

    #[test]
    fn framed_values_decode_like_plain_ones() {
        let event = encode(7, 9, Action::Like, 1);
        // `[0]` in its short form, and as the count 1 (zig-zag 2) and the index 0.
        for indexes in [&[0x00][..], &[0x02, 0x00]] {
            assert_eq!(decode(Some(&framed(12, indexes, &event))), Ok(LIKE_7_9));
        }
        // An empty protobuf after the framing is a `LikeEvent` of defaults.
        assert_eq!(
            decode(Some(&framed(12, &[0], &[]))),
            Err(BadReason::ActionUnspecified)
        );
        // The protobuf after the framing gets the same checks as a plain one.
        let post_zero = encode(0, 9, Action::Like, 1);
        assert_eq!(
            decode(Some(&framed(12, &[0], &post_zero))),
            Err(BadReason::PostIdZero)
        );
        assert_eq!(
            decode(Some(&framed(12, &[0], &[0xff, 0xff]))),
            Err(BadReason::Undecodable)
        );
    }

    #[test]
    fn a_truncated_framing_is_its_own_reason() {
        let whole = framed(12, &[0x02, 0x00], &encode(7, 9, Action::Like, 1));
        // Cut inside the schema id or the message-index list.
        for len in 1..7 {
            assert_eq!(
                decode(Some(&whole[..len])),
                Err(BadReason::FramingTruncated),
                "{:02x?}",
                &whole[..len]
            );
        }
        // A varint that never ends.
        assert_eq!(
            decode(Some(&framed(12, &[0x82, 0x80], &[]))),
            Err(BadReason::FramingTruncated)
        );
    }

    #[test]
    fn only_the_message_index_list_of_like_event_is_accepted() {
        let event = encode(7, 9, Action::Like, 1);
        for indexes in [
            &[0x02, 0x02][..],   // [1]: the second message of the schema
            &[0x04, 0x00, 0x00], // [0, 0]: a message nested in the first
            &[0x01],             // the count -1
            &[0x02, 0x01],       // [-1]
            &[0x06],             // a count of 3 with nothing after it
            &[0xff; 10],         // a varint longer than 64 bits
        ] {
            assert_eq!(
                decode(Some(&framed(12, indexes, &event))),
                Err(BadReason::MessageIndexInvalid),
                "{indexes:02x?}"
            );
        }
        // A count written with a redundant continuation byte is still 0.
        assert_eq!(
            decode(Some(&framed(12, &[0x80, 0x00], &event))),
            Ok(LIKE_7_9)
        );
    }

    #[test]
    fn schema_ids_are_checked_only_when_given() {
        let event = encode(7, 9, Action::Like, 1);
        let checked = Decoder::new(&[12, 13]);
        assert_eq!(
            checked.decode(Some(&framed(13, &[0], &event))),
            Ok(LIKE_7_9)
        );
        assert_eq!(
            checked.decode(Some(&framed(14, &[0], &event))),
            Err(BadReason::SchemaIdUnknown)
        );
        // A truncated id cannot be checked.
        assert_eq!(
            checked.decode(Some(&[MAGIC_BYTE, 0, 0])),
            Err(BadReason::FramingTruncated)
        );
        // Plain values carry no id.
        assert_eq!(checked.decode(Some(&event)), Ok(LIKE_7_9));
        for any in [Decoder::ANY_SCHEMA, Decoder::new(&[]), Decoder::default()] {
            assert_eq!(
                any.decode(Some(&framed(u32::MAX, &[0], &event))),
                Ok(LIKE_7_9)
            );
        }
    }

    #[test]
    fn every_reason_is_listed_once_with_a_distinct_name() {
        let names: std::collections::HashSet<&str> =
            BadReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), BadReason::ALL.len());
        assert!(names.contains("framing_truncated"));
        assert!(names.contains("schema_id_unknown"));
        assert!(names.contains("message_index_invalid"));
        assert!(names.contains("timestamp_out_of_range"));
    }

    proptest! {
        #[test]
        fn framed_and_plain_values_get_the_same_verdict(
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            id: u32,
            long_form: bool,
        ) {
            let indexes: &[u8] = if long_form { &[0x02, 0x00] } else { &[0x00] };
            let plain = decode(Some(&bytes));
            // A plain value starting with 0 is itself framed; its verdict differs.
            prop_assume!(bytes.first() != Some(&MAGIC_BYTE));
            prop_assert_eq!(decode(Some(&framed(id, indexes, &bytes))), plain);
        }

        #[test]
        fn a_checked_id_decides_alone(id: u32, allowed in proptest::collection::vec(any::<u32>(), 1..4)) {
            let event = encode(7, 9, Action::Like, 1);
            let verdict = Decoder::new(&allowed).decode(Some(&framed(id, &[0], &event)));
            if allowed.contains(&id) {
                prop_assert_eq!(verdict, Ok(LIKE_7_9));
            } else {
                prop_assert_eq!(verdict, Err(BadReason::SchemaIdUnknown));
            }
        }

        #[test]
        fn arbitrary_framed_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut value = vec![MAGIC_BYTE];
            value.extend(&bytes);
            prop_assert_eq!(decode(Some(&value)), decode(Some(&value)));
            let _ = Decoder::new(&[1]).decode(Some(&value));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(Some(&bytes));
        }

        #[test]
        fn valid_events_round_trip(post in 1u64.., user: u64, like: bool, t: i64) {
            let action = if like { Action::Like } else { Action::Unlike };
            let got = decode(Some(&encode(post, user, action, t))).unwrap();
            prop_assert_eq!(got, Like { post_id: post, user_id: user, delta: if like { 1 } else { -1 }, event_time_ms: t });
        }
    }
}
