//! The counters' price in each layout: Redis memory for the counters a
//! deployment holds, and the Redis CPU their writes take at the peak.
//!
//! A string key per counter costs its key, its value and Redis's per-key
//! entry; a counter packed as a field of a small hash costs its field and
//! value inside the hash's listpack, and an HINCRBY scans that listpack.
//! Both figures are per counter and per write, measured by `tally-lab
//! bench-memory` (docs/benchmarks.md, "Memory per counter"), and given here
//! as the defaults of `--string-bytes`, `--packed-bytes` and
//! `--packed-cpu-ratio`.
//!
//! Invariant: the verdict follows from the inputs alone: the cheaper layout
//! in memory that fits the budget, unless only the other fits.

use serde::Serialize;

use super::{PlanArgs, Redis};

/// Redis memory a counter kept as a string key costs (bytes; 10M random post
/// ids on redis-server 7.0.15, docs/benchmarks.md; 72.2 on Valkey 9.1.2).
pub const MEASURED_STRING_BYTES: f64 = 99.3;
/// Redis memory a counter kept as a field of a packed hash costs in hashes
/// that split as they fill, the default (bytes; the most of any step of
/// `tally-lab bench-growth` from 100,000 to 30 million random post ids on
/// redis-server 7.0.15, docs/benchmarks.md; 14.6 on Valkey 9.1.2).
pub const MEASURED_PACKED_BYTES: f64 = 16.0;
/// Redis CPU of a counter write into a packed hash of the default size over
/// that of a string key, inside the apply script (the run after the script's
/// fill report became one HLEN a call; 3.26 on Valkey 9.1.2).
pub const MEASURED_PACKED_CPU_RATIO: f64 = 1.66;

/// One layout's price.
#[derive(Debug, Clone, Serialize)]
pub struct Price {
    /// `strings` or `packed`.
    pub layout: &'static str,
    /// Bytes a counter costs.
    pub bytes_per_counter: f64,
    /// Bytes for every counter, before replicas.
    pub memory_bytes: f64,
    /// Counter writes' share of the Redis calls/s at the peak, in string
    /// writes' worth: packed writes cost `--packed-cpu-ratio` each.
    pub write_load_ops: f64,
    /// Whether the memory fits `--memory-budget-gb` (true without one).
    pub fits: bool,
}

/// Both layouts' price and the one to take.
#[derive(Debug, Clone, Serialize)]
pub struct Layouts {
    /// Counters priced: `--counters`, or a million when it is not given.
    pub counters: f64,
    /// Whether the price is per million counters, no count given: both
    /// layouts keep their price a counter as the site grows.
    pub per_million: bool,
    /// The budget, if one was given (bytes).
    pub budget_bytes: Option<f64>,
    /// A string key per counter.
    pub strings: Price,
    /// Fields of small hashes.
    pub packed: Price,
    /// The layout to start with, and why.
    pub verdict: String,
}

/// Both layouts priced: for `--counters`, or per million counters when no
/// count is given (neither layout needs one: packed hashes split as they
/// fill, so a counter costs the same at any size).
pub fn layouts(args: &PlanArgs, redis: &Redis) -> Option<Layouts> {
    let per_million = args.counters.is_none();
    let counters = args.counters.unwrap_or(1e6);
    let budget = args.memory_budget_gb.map(|gb| gb * 1e9);
    let price = |layout, bytes_per_counter: f64, cpu: f64| {
        let memory = counters * bytes_per_counter;
        Price {
            layout,
            bytes_per_counter,
            memory_bytes: memory,
            write_load_ops: redis.increments_per_s * cpu,
            fits: budget.is_none_or(|b| memory <= b),
        }
    };
    let strings = price("strings", args.string_bytes, 1.0);
    let packed = price("packed", args.packed_bytes, args.packed_cpu_ratio);
    let verdict = match (strings.fits, packed.fits) {
        _ if per_million => format!(
            "no count needed: packed keeps counters in {:.0}% of the memory of string keys at any size, for {:.1}× the write CPU (give --counters N and --memory-budget-gb B to choose for a size)",
            100.0 * packed.memory_bytes / strings.memory_bytes,
            args.packed_cpu_ratio
        ),
        (true, _) if budget.is_some() => format!(
            "strings: the counters fit the budget as string keys, the cheaper write (packed would save {:.0}% of the memory for {:.1}× the write CPU)",
            100.0 * (1.0 - packed.memory_bytes / strings.memory_bytes),
            args.packed_cpu_ratio
        ),
        (true, _) => format!(
            "strings unless memory is the bill: packed keeps the counters in {:.0}% of the memory for {:.1}× the write CPU (give --memory-budget-gb to decide)",
            100.0 * packed.memory_bytes / strings.memory_bytes,
            args.packed_cpu_ratio
        ),
        (false, true) => {
            "packed (`tally run --layout packed`, whose hashes split as the counters grow): only packed hashes fit the budget"
                .to_string()
        }
        (false, false) => {
            "neither layout fits the budget: add memory, or primaries (a cluster splits the counters)"
                .to_string()
        }
    };
    Some(Layouts {
        counters,
        per_million,
        budget_bytes: budget,
        strings,
        packed,
        verdict,
    })
}

#[cfg(test)]
mod tests {
    use super::super::compute::plan;
    use super::*;
    use crate::settings::parse_flags;

    fn plan_of(flags: &str) -> super::super::Plan {
        let flags: Vec<&str> = flags.split_whitespace().collect();
        plan(&parse_flags::<PlanArgs>(&flags).unwrap(), None).unwrap()
    }

    #[test]
    fn the_verdict_follows_the_budget() {
        let per_million = plan_of("").layouts.unwrap();
        assert!(per_million.per_million && per_million.counters == 1e6);
        assert!(
            per_million.verdict.starts_with("no count needed"),
            "{}",
            per_million.verdict
        );
        let billion = plan_of("--counters 1000000000").layouts.unwrap();
        assert!((billion.strings.memory_bytes - MEASURED_STRING_BYTES * 1e9).abs() < 1e6);
        assert!((billion.packed.memory_bytes - MEASURED_PACKED_BYTES * 1e9).abs() < 1e6);
        assert!(
            billion.verdict.starts_with("strings unless"),
            "{}",
            billion.verdict
        );
        let tight = plan_of("--counters 1000000000 --memory-budget-gb 32")
            .layouts
            .unwrap();
        assert!(!tight.strings.fits && tight.packed.fits);
        assert!(tight.verdict.starts_with("packed"), "{}", tight.verdict);
        let roomy = plan_of("--counters 1000000000 --memory-budget-gb 120")
            .layouts
            .unwrap();
        assert!(roomy.verdict.starts_with("strings:"), "{}", roomy.verdict);
        let none = plan_of("--counters 1000000000 --memory-budget-gb 5")
            .layouts
            .unwrap();
        assert!(none.verdict.starts_with("neither"), "{}", none.verdict);
        assert!(
            (tight.packed.write_load_ops
                - MEASURED_PACKED_CPU_RATIO * tight.strings.write_load_ops)
                .abs()
                < 1e-6
        );
    }
}
