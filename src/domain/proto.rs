//! The event contract, generated from `proto/tally/v1/like_event.proto`.
//!
//! One `LikeEvent` is one Kafka message value. The file is a public contract:
//! producers in other languages compile the same `.proto`.

#![allow(missing_docs)]

include!(concat!(env!("OUT_DIR"), "/tally.v1.rs"));
