//! The lab around tally: what the `tally-lab` binary and the criterion benchmarks share.
//!
//! None of it is part of the service. The binary (`src/main.rs`) holds the tools: the demo,
//! the traffic producer and the benchmarks; this library holds the traffic they all send.
//!
//! # Layout
//!
//! ```text
//! generate    synthetic like traffic: Zipf popularity, a viral post, unlikes of recent likes
//! ```

pub mod generate;
