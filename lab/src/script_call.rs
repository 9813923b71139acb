//! One call of the apply script as the lab's Redis benchmarks make it (`bench-memory`,
//! `bench-writes`, `bench-windows`): a batch of partition 0 claiming offsets 1..=100 over a fence
//! that is absent, under a fence key of the call's own, so every call applies. The call is built
//! by the library's `script_call`, so a benchmark sends what `tally run` sends.

use anyhow::{Context, Result, bail};
use tally::domain::packing::Splits;
use tally::domain::routing::{CounterId, KeyLayout};
use tally::pipeline::aggregate::WindowCell;
use tally::pipeline::apply::{Prepared, ScriptBody, script_call};

/// Calls the script loaded as `sha` with `deltas` and `windows` under the fence key `fence`;
/// fails unless it applied. A growing packed layout's call is addressed with one hash first,
/// and again with the split state the script answers until it applies.
pub fn apply_once(
    conn: &mut redis::Connection,
    sha: &str,
    layout: &KeyLayout,
    fence: &str,
    deltas: Vec<(CounterId, i64)>,
    windows: Vec<(WindowCell, i64)>,
) -> Result<()> {
    let prepared = Prepared {
        partition: 0,
        group: 0,
        start: 1,
        last: 100,
        absent_fence: 0,
        deltas,
        windows,
    };
    let mut splits = Splits::default();
    loop {
        let reply: Vec<redis::Value> =
            script_call(ScriptBody::ByHash(sha), layout, fence, &prepared, splits)
                .query(conn)
                .context("calling the apply script")?;
        match reply.as_slice() {
            [redis::Value::Int(0), ..] => return Ok(()),
            [redis::Value::Int(5), _, _, level, next] => {
                splits = Splits {
                    level: redis::from_redis_value_ref(level)?,
                    next: redis::from_redis_value_ref(next)?,
                };
            }
            _ => bail!("the script did not apply: {reply:?}"),
        }
    }
}
