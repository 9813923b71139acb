//! Decode: Kafka message bytes to a validated like or a bad-message reason.
//!
//! Invariant: decoding is deterministic. The same bytes always give the same
//! verdict, so a bad message is bad forever: redelivery cannot fix it, and the
//! caller may count it, dead-letter it and move on without stalling the partition.
//! Decoding allocates nothing: `LikeEvent` has only scalar fields.

use prost::Message as _;

use crate::domain::proto::{Action, LikeEvent};

/// A like or unlike that passed validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Like {
    /// The post liked or unliked; never 0.
    pub post_id: u64,
    /// The user who acted; picks the bucket.
    pub user_id: u64,
    /// +1 for a like, -1 for an unlike.
    pub delta: i64,
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
    pub const ALL: [BadReason; 6] = [
        BadReason::Empty,
        BadReason::Undecodable,
        BadReason::PostIdZero,
        BadReason::ActionUnspecified,
        BadReason::ActionUnknown,
        BadReason::TimestampOutOfRange,
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
        }
    }
}

impl std::fmt::Display for BadReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Decodes and validates one message value.
pub fn decode(payload: Option<&[u8]>) -> Result<Like, BadReason> {
    let bytes = payload.ok_or(BadReason::Empty)?;
    let event = LikeEvent::decode(bytes).map_err(|_| BadReason::Undecodable)?;
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
    })
}

/// Encodes a like event; used by the traffic generator and tests.
pub fn encode(post_id: u64, user_id: u64, action: Action, event_time_ms: i64) -> Vec<u8> {
    LikeEvent {
        post_id,
        user_id,
        action: action as i32,
        event_time_ms,
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
                delta: 1
            })
        );
        assert_eq!(
            decode(Some(&unlike)),
            Ok(Like {
                post_id: 7,
                user_id: 9,
                delta: -1
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
        };
        assert_eq!(
            decode(Some(&unknown.encode_to_vec())),
            Err(BadReason::ActionUnknown)
        );
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
                delta: -1
            })
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(Some(&bytes));
        }

        #[test]
        fn valid_events_round_trip(post in 1u64.., user: u64, like: bool, t: i64) {
            let action = if like { Action::Like } else { Action::Unlike };
            let got = decode(Some(&encode(post, user, action, t))).unwrap();
            prop_assert_eq!(got, Like { post_id: post, user_id: user, delta: if like { 1 } else { -1 } });
        }
    }
}
