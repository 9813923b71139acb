//! The tools around the service: the local demo and the services it and
//! the benchmarks start, the traffic producer, the benchmarks of the
//! consumer and of the read API (and the Markdown they write), and the
//! capacity planner. None of them is part of the production consumer.

pub mod bench;
pub mod bench_reads;
pub mod bench_writes;
pub mod demo;
pub mod local;
pub mod markdown;
pub mod plan;
pub mod produce;
