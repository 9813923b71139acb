//! The data path of `tally run`: consume → decode → aggregate → apply (Lua,
//! fence) → commit, wired by [`run`].
//!
//! Every stage keeps its own invariant and states it in its module doc; the
//! argument that every event is counted exactly once is in [`apply`].

pub mod aggregate;
pub mod apply;
pub mod commit;
pub mod consume;
pub mod dead_letter;
pub mod decode;
pub mod dedupe;
pub mod guard;
pub mod hot;
pub mod run;
