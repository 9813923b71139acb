//! What the stored data means: fences and their decisions, where a like is
//! counted (hash, bucket, slot group, routing version, key generation), and
//! how keys spread over a cluster.
//!
//! These modules fix the contract between writers and readers: a reader that
//! follows them never sums fewer keys than a writer uses.

pub mod fence;
pub mod generation;
pub mod layout;
pub mod packing;
pub mod placement;
pub mod proto;
pub mod routing;
pub mod slots;
pub mod versions;
pub mod windows;
