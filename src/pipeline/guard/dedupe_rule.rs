//! The dedupe rule of a prefix: the `--dedupe` mode and `--dedupe-window`
//! its live writers judge repeats by, kept in the string `<prefix>:dedupe`
//! (`off`, or the mode and the window: `ids-and-actions 1000000`).
//!
//! Invariant: the owners of a prefix's partitions judge by one rule. A
//! verdict is a function of the log and the rule (see
//! [`crate::pipeline::dedupe`]), so a replica started with another mode or
//! window would count a repeat that the others skip, on whichever partitions
//! it happens to own. The first start of `tally run` on a prefix writes its
//! rule; a later start with another one is refused in one line naming both,
//! unless it passes `--dedupe-change`, which makes its rule the prefix's from
//! then on. A running writer reads the rule again every [`RULE_RECHECK`]:
//! one that is no longer its own (a replica started with `--dedupe-change`)
//! is an ERROR line and `tally_dedupe_rule_mismatch` until it is restarted
//! with the new rule. A rebuild recounts under the rule it is given, into a
//! generation of its own, and neither reads nor writes the prefix's.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::GuardError;
use super::watch::{Change, Finding, next_tick, rechecks};
use crate::infra::config::dedupe::{DEFAULT_WINDOW, DedupeMode, DedupeSettings, MAX_WINDOW};
use crate::infra::retry::{RedisFailure, classify_redis};
use crate::infra::store::Shared;

/// How often a running writer reads its prefix's rule again.
pub const RULE_RECHECK: Duration = Duration::from_secs(10);

/// The key of the rule of the prefix `base`.
pub fn rule_key(base: &str) -> String {
    format!("{base}:dedupe")
}

/// The rule as the key holds it.
pub fn rule_text(rule: DedupeSettings) -> String {
    match rule.mode {
        DedupeMode::Off => DedupeMode::Off.to_string(),
        mode => format!("{mode} {}", rule.span),
    }
}

/// The rule a key's value names; `None` for what tally never writes there.
fn parse_rule(text: &str) -> Option<DedupeSettings> {
    let mut words = text.split(' ');
    let mode: DedupeMode = words.next()?.parse().ok()?;
    let span = match (mode, words.next()) {
        (DedupeMode::Off, None) => DEFAULT_WINDOW,
        (DedupeMode::Off, Some(_)) | (_, None) => return None,
        (_, Some(span)) => span.parse().ok().filter(|s| (1..=MAX_WINDOW).contains(s))?,
    };
    words
        .next()
        .is_none()
        .then_some(DedupeSettings { mode, span })
}

/// Whether two rules reach the same verdicts: the window says nothing when
/// the mode is off.
fn same_rule(a: DedupeSettings, b: DedupeSettings) -> bool {
    a.mode == b.mode && (a.mode == DedupeMode::Off || a.span == b.span)
}

/// The flags that ask for `rule`.
fn flags(rule: DedupeSettings) -> String {
    match rule.mode {
        DedupeMode::Off => "--dedupe off".to_string(),
        mode => format!("--dedupe {mode} --dedupe-window {}", rule.span),
    }
}

/// What a writer judging by `ours` makes of the value `held` of `key`:
/// `Ok(true)` when it is the same rule.
fn compare(key: &str, held: &str, ours: DedupeSettings) -> Result<bool, GuardError> {
    match parse_rule(held) {
        Some(theirs) => Ok(same_rule(theirs, ours)),
        None => Err(GuardError::StrayValue(format!(
            "{key} holds '{held}', which is not a dedupe rule tally writes (off, or a mode and its window: 'ids 1000000'); set it to the rule the prefix's writers run ('{}' for this process) or delete it, then start again",
            rule_text(ours)
        ))),
    }
}

/// Checks the rule of the prefix `base` at a start of `tally run` judging by
/// `ours`, writing it when the prefix has none, or when `change` says this
/// start changes it. `node` names the store in a lost connection's error.
pub async fn check_dedupe_rule(
    store: &Shared,
    node: &str,
    base: &str,
    ours: DedupeSettings,
    change: bool,
) -> Result<(), GuardError> {
    let key = rule_key(base);
    let text = rule_text(ours);
    // A lost connection starts the checks again; what no retry fixes (a
    // key of another type, a command the ACL denies) is refused.
    let unreachable = |error: redis::RedisError| match (error.code(), classify_redis(&error)) {
        (Some("WRONGTYPE"), _) => GuardError::StrayValue(format!(
            "{key} is a key of another type than a string, where tally keeps the prefix's dedupe rule; delete it, then start again"
        )),
        (_, RedisFailure::Transient) => GuardError::Unreachable {
            node: node.to_string(),
            error: error.to_string(),
        },
        _ => GuardError::Unreadable(format!(
            "cannot read or write {key}, where tally keeps the prefix's dedupe rule ({error}); give the Redis user the rule `tally docs acl` lists for tally run, then start again"
        )),
    };
    // Written when absent, in the call that reads it: two first starts agree.
    let held = set_rule(store, &key, &text, true)
        .await
        .map_err(unreachable)?;
    let Some(held) = held else {
        info!(key = %key, rule = %text, "Dedupe rule of the prefix written");
        return Ok(());
    };
    if compare(&key, &held, ours)? {
        return Ok(());
    }
    let theirs = parse_rule(&held).map_or_else(|| held.clone(), flags);
    if !change {
        return Err(GuardError::DedupeRule {
            key,
            theirs,
            ours: flags(ours),
        });
    }
    set_rule(store, &key, &text, false)
        .await
        .map_err(unreachable)?;
    warn!(
        key = %key,
        was = %theirs,
        now = %flags(ours),
        "Dedupe rule of the prefix changed (--dedupe-change): records from here on are judged by the new rule; replicas still on the old one report tally_dedupe_rule_mismatch until they are restarted with it"
    );
    Ok(())
}

/// What the rule's `key` holds.
pub async fn read_rule(store: &Shared, key: &str) -> Result<Option<String>, redis::RedisError> {
    let get = redis::cmd("GET").arg(key).clone();
    store
        .call(|mut s| async move { get.query_async(&mut s).await })
        .await
}

/// Sets `key` to the rule `text`, only where it has none when
/// `only_if_absent`; returns what it held.
async fn set_rule(
    store: &Shared,
    key: &str,
    text: &str,
    only_if_absent: bool,
) -> Result<Option<String>, redis::RedisError> {
    let mut set = redis::cmd("SET");
    set.arg(key).arg(text);
    if only_if_absent {
        set.arg("NX");
    }
    set.arg("GET");
    store
        .call(|mut s| async move { set.query_async(&mut s).await })
        .await
}

/// Reads the rule of the prefix `base` again every [`RULE_RECHECK`] until
/// `shutdown`: a rule that is not `ours` is an ERROR line when first seen,
/// and `tally_dedupe_rule_mismatch` for as long as it lasts. A read that
/// fails is passed over (the writer's own calls report the store).
pub fn spawn_dedupe_rule_watch(
    store: Shared,
    base: &str,
    ours: DedupeSettings,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let key = rule_key(base);
    crate::infra::metrics::dedupe_rule_mismatch(false);
    crate::infra::tasks::spawn("dedupe-rule-watch", async move {
        let mut every = rechecks(RULE_RECHECK).await;
        let mut finding = Finding::new();
        while next_tick(&mut every, &shutdown).await {
            let Ok(held) = read_rule(&store, &key).await else {
                continue;
            };
            // A key deleted under the writers holds no other rule; the next
            // start writes it again.
            let other = held.filter(|h| !matches!(compare(&key, h, ours), Ok(true)));
            crate::infra::metrics::dedupe_rule_mismatch(other.is_some());
            match finding.update(other) {
                Change::Appeared(held) => {
                    let theirs = parse_rule(held).map_or_else(|| held.clone(), flags);
                    error!(
                        key = %key,
                        prefix_rule = %theirs,
                        this_process = %flags(ours),
                        "The prefix's dedupe rule is no longer the one this process judges repeats by: the partitions it owns count repeats the others skip (or skip what they count); restart it with the prefix's rule"
                    );
                }
                Change::Cleared => {
                    info!(key = %key, "The prefix's dedupe rule is this process's again.");
                }
                Change::Same => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(mode: DedupeMode, span: u64) -> DedupeSettings {
        DedupeSettings { mode, span }
    }

    #[test]
    fn every_rule_reads_back_as_written() {
        for mode in DedupeMode::ALL {
            for span in [1, 4_000, DEFAULT_WINDOW, MAX_WINDOW] {
                let written = rule(mode, span);
                let read = parse_rule(&rule_text(written)).expect("a rule tally writes");
                assert!(same_rule(read, written), "{written:?} read as {read:?}");
            }
        }
    }

    #[test]
    fn a_window_matters_only_when_the_mode_looks_for_repeats() {
        let off = |span| rule(DedupeMode::Off, span);
        let ids = |span| rule(DedupeMode::Ids, span);
        assert!(same_rule(off(5), off(9)));
        assert!(!same_rule(ids(5), ids(9)));
        assert!(!same_rule(ids(5), rule(DedupeMode::IdsAndActions, 5)));
        assert!(!same_rule(off(5), ids(5)));
    }

    #[test]
    fn values_tally_never_writes_are_stray() {
        for held in [
            "",
            "on",
            "ids",
            "off 100",
            "ids 0",
            "ids 100000001",
            "ids 10 10",
            "ids  10",
            "IDS 10",
        ] {
            assert!(parse_rule(held).is_none(), "'{held}' read as a rule");
            let refused = compare("p:dedupe", held, rule(DedupeMode::Ids, 10));
            assert!(
                matches!(&refused, Err(GuardError::StrayValue(text)) if text.contains("p:dedupe")),
                "'{held}': {refused:?}"
            );
        }
    }
}
