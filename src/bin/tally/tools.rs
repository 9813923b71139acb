//! The tools around the service: the local demo and the services it and
//! the benchmark start, the traffic producer, the benchmark and the
//! capacity planner. None of them is part of the production consumer.

pub mod bench;
pub mod demo;
pub mod local;
pub mod plan;
pub mod produce;
