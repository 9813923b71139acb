//! ACL: the Redis permissions each command needs, as docs/security.md
//! publishes them (`tally docs acl`) and tests/e2e_redis_acl.rs grants them.
//!
//! Invariant: this table is the one statement of what tally sends to Redis.
//! Every command it lists needs every permission of its rule (the test takes
//! each one away and watches the command fail with Redis' NOPERM naming it,
//! or warn naming it for the few published as warnings), and no command needs
//! a key outside `~<prefix>:*`. Commands that Lua
//! scripts call are checked against the same rule as the script itself, so
//! they are listed beside `evalsha` and `eval`.

use std::fmt::Write as _;

/// One command's rule: what it cannot work without, and what only a check or
/// a side task of it needs (refused: a warning naming the permission, and the
/// command goes on without that part).
pub struct Rule {
    /// The command, as typed after `tally`.
    pub command: &'static str,
    /// Permissions it fails without.
    pub needs: &'static [&'static str],
    /// Permissions whose refusal is logged as a warning.
    pub warns: &'static [&'static str],
}

/// Every command that talks to Redis, with its rule.
pub const RULES: &[Rule] = &[
    Rule {
        command: "run",
        needs: &[
            "ping", "get", "set", "exists", "hget", "hmget", "hgetall", "hset", "incrby", "decrby",
            "del", "time", "evalsha", "eval", "scan",
        ],
        warns: &["config|get", "hsetnx", "hincrby", "expire", "info"],
    },
    Rule {
        command: "count",
        needs: &["ping", "get", "hmget", "hgetall"],
        warns: &[],
    },
    Rule {
        command: "serve",
        needs: &["ping", "get", "hmget", "hgetall"],
        warns: &[],
    },
    Rule {
        command: "top",
        needs: &[
            "ping",
            "hget",
            "hmget",
            "hgetall",
            "hscan",
            "zrevrangebyscore",
        ],
        warns: &[],
    },
    Rule {
        command: "inspect",
        needs: &["ping", "get", "hget", "hmget", "hgetall"],
        warns: &[],
    },
    Rule {
        command: "promote",
        needs: &[
            "ping", "hget", "hmget", "hgetall", "hset", "hsetnx", "hincrby", "time", "evalsha",
            "eval",
        ],
        warns: &[],
    },
    Rule {
        command: "demote",
        needs: &[
            "ping", "hget", "hmget", "hgetall", "hset", "hsetnx", "hincrby", "time", "evalsha",
            "eval",
        ],
        warns: &[],
    },
    Rule {
        command: "rebucket",
        needs: &[
            "ping", "hget", "hmget", "hgetall", "hset", "time", "evalsha", "eval",
        ],
        warns: &[],
    },
    Rule {
        command: "unfreeze-routing",
        needs: &[
            "ping", "hget", "hmget", "hgetall", "hset", "hdel", "time", "evalsha", "eval",
        ],
        warns: &[],
    },
    Rule {
        command: "verify",
        needs: &["ping", "get", "hget", "hmget", "hgetall", "scan"],
        warns: &[],
    },
    Rule {
        command: "rebuild",
        needs: &[
            "ping", "get", "set", "del", "exists", "hget", "hmget", "hgetall", "hset", "incrby",
            "decrby", "time", "evalsha", "eval",
        ],
        warns: &["config|get"],
    },
    Rule {
        command: "gc",
        needs: &["ping", "hmget", "scan", "unlink"],
        warns: &[],
    },
    Rule {
        command: "reset-fences",
        needs: &["ping", "get", "set", "del", "hget", "hmget", "hgetall"],
        warns: &[],
    },
];

/// What a cluster adds to every rule: the client and `tally inspect` read
/// the slot map.
pub const CLUSTER: &[&str] = &["cluster|slots"];

/// What the packed layout adds to the rules of the commands that write
/// counters: its apply script adds with HINCRBY, undoes with HDEL and
/// reports the fullest hash with HLEN (a growing generation's splits move
/// fields with HGETALL, HSET and HDEL, and its split state is read with
/// HMGET, which every writer's rule holds).
pub const PACKED: &[&str] = &["hincrby", "hdel", "hlen"];

/// What windows of trending counts add to the rules of the commands that
/// write counters: the apply script checks each window key's type, adds to
/// the counts with HINCRBY (HDEL at 0), reads the floor with HGET (HSET when
/// it rises), keeps the leaders with ZADD, ZREM, ZCARD, ZREVRANGE and
/// ZREMRANGEBYSCORE, and sets the expiry with PEXPIREAT.
pub const WINDOWS: &[&str] = &[
    "hincrby",
    "hdel",
    "zadd",
    "zrem",
    "zcard",
    "zrevrange",
    "zremrangebyscore",
    "pexpireat",
    "type",
];

/// What windows add to `tally serve`'s rule: a post's likes in a window
/// (HGET), the trending list (ZREVRANGEBYSCORE, HGET of the floor, and HSCAN
/// of the counts when the leaders cannot decide it).
pub const WINDOW_READS: &[&str] = &["hget", "zrevrangebyscore", "hscan"];

/// What each permission is for.
const USES: &[(&str, &str)] = &[
    (
        "ping",
        "the connection check at start and the readiness probe",
    ),
    (
        "get",
        "counters, fences, the freeze flag and the prefix's dedupe rule",
    ),
    (
        "set",
        "fences (in the apply script, and when they are reset), the freeze flag and the prefix's dedupe rule",
    ),
    (
        "del",
        "a counter the apply script created before a refusal; fences that are reset; the freeze flag",
    ),
    (
        "exists",
        "the layout record and the generation pointer (is this a store that lost everything?)",
    ),
    (
        "hget",
        "routing registry entries and the generation pointer; a window's floor, in the apply script, and a post's likes in one window (windows)",
    ),
    (
        "hmget",
        "the generation pointer, routing versions of many posts, hot-post windows; a packed slot group's split state, in the apply script and by readers (packed layout)",
    ),
    (
        "hgetall",
        "the layout record, a post's route hash, the registry; a packed hash the apply script splits (packed layout)",
    ),
    (
        "hset",
        "the layout record, routing versions, the generation and rebuild records; a window's floor when it rises, in the apply script (windows); the fields a split moves, and the split state (packed layout)",
    ),
    (
        "hdel",
        "the mark of an unfreeze under way in the routing registry, once it finishes; a packed counter the apply script's undo brings back to 0, and the fields a split moves away (packed layout); a post whose likes in a window come back to 0 (windows)",
    ),
    (
        "hsetnx",
        "version 0 of a post's route hash, once (refused, `run` promotes no hot post)",
    ),
    (
        "hincrby",
        "hot-post windows; a post's next routing version (refused, `run` promotes no hot post); packed counters, in the apply script (packed layout: refused, nothing is written); a post's likes in a window, in the apply script (windows: refused, nothing is written)",
    ),
    (
        "hlen",
        "the fullest packed hash an apply script wrote, and a hash a call would fill past the server's limit (packed layout)",
    ),
    (
        "expire",
        "hot-post windows, which expire after a few seconds (refused, `run` promotes no hot post)",
    ),
    ("incrby", "counters, in the apply script"),
    (
        "decrby",
        "the apply script's undo when Redis refuses one counter of a batch",
    ),
    ("time", "the registry's clock, in the routing scripts"),
    ("evalsha", "every Lua script, sent by hash"),
    (
        "eval",
        "a script's full text after NOSCRIPT (a restarted server, a failover)",
    ),
    (
        "scan",
        "finding a generation's keys (`verify`, `gc`, `rebuild --abort`); what a prefix without a layout record holds, before `run` adopts its data (a rebuild of a prefix that has never had a record needs it too)",
    ),
    (
        "unlink",
        "removing old generations' keys (`gc`; `rebuild --abort` needs it too)",
    ),
    (
        "config|get",
        "reading maxmemory-policy (refused, tally warns and goes on unchecked)",
    ),
    (
        "info",
        "naming the server and its version at start (refused, tally warns and goes on unchecked); counting the primaries' replicas, which routing versions wait for with `--registry-replicas auto` (refused, they wait for none, with a warning; `promote`, `demote` and `rebucket` do the same)",
    ),
    ("cluster|slots", "the slot map of a cluster"),
    ("zadd", "a window's leaders, in the apply script (windows)"),
    (
        "zrem",
        "a post that falls below a window's floor leaves its leaders, in the apply script (windows)",
    ),
    (
        "zcard",
        "how many leaders a window has, in the apply script (windows)",
    ),
    (
        "zrevrange",
        "the count a window's floor rises to, in the apply script (windows)",
    ),
    (
        "zremrangebyscore",
        "the leaders below a risen floor leave, in the apply script (windows)",
    ),
    (
        "pexpireat",
        "a window's expiry, in the apply script (windows)",
    ),
    (
        "type",
        "a window key's type, checked before the apply script's first write (windows)",
    ),
    (
        "hscan",
        "a window's counts, read whole when its leaders cannot decide the trending list",
    ),
    ("zrevrangebyscore", "the trending list of a window"),
];

/// The rule `command` needs, as `ACL SETUSER` arguments after the key pattern.
pub fn rule_text(rule: &Rule) -> String {
    let mut text = String::from("-@all");
    for permission in rule.needs.iter().chain(rule.warns) {
        let _ = write!(text, " +{permission}");
    }
    text
}

/// Text for a markdown table cell (a `|` would end the cell).
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// docs/security.md's tables, printed by `tally docs acl`.
pub fn table() -> String {
    let mut out = String::from("| command | rule | refused, a warning |\n|---|---|---|\n");
    for rule in RULES {
        let warns: Vec<String> = rule
            .warns
            .iter()
            .map(|p| format!("`+{}`", cell(p)))
            .collect();
        let _ = writeln!(
            out,
            "| `tally {}` | `~<prefix>:* resetchannels {}` | {} |",
            rule.command,
            cell(&rule_text(rule)),
            warns.join(" ")
        );
    }
    out.push_str("\n| permission | commands | what for |\n|---|---|---|\n");
    for &(permission, what) in USES {
        let users: Vec<&str> = RULES
            .iter()
            .filter(|r| r.needs.contains(&permission) || r.warns.contains(&permission))
            .map(|r| r.command)
            .collect();
        let mut users = if CLUSTER.contains(&permission) {
            "all, on a cluster".to_string()
        } else {
            users.join(", ")
        };
        let additions = [
            (PACKED, "run and rebuild with --layout packed"),
            (WINDOWS, "run and rebuild with --windows"),
            (WINDOW_READS, "serve with windows"),
        ];
        for (added, whose) in additions {
            if added.contains(&permission) {
                users = match users.is_empty() {
                    true => whose.to_string(),
                    false => format!("{users}; {whose}"),
                };
            }
        }
        let _ = writeln!(out, "| `+{}` | {users} | {what} |", cell(permission));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_permission_is_explained_once() {
        for rule in RULES {
            for permission in rule
                .needs
                .iter()
                .chain(rule.warns)
                .chain(CLUSTER)
                .chain(PACKED)
                .chain(WINDOWS)
                .chain(WINDOW_READS)
            {
                let explained = USES.iter().filter(|(p, _)| p == permission).count();
                assert_eq!(explained, 1, "+{permission} of `tally {}`", rule.command);
            }
        }
        for (permission, _) in USES {
            let used = RULES
                .iter()
                .any(|r| r.needs.contains(permission) || r.warns.contains(permission));
            assert!(
                used || [CLUSTER, PACKED, WINDOWS, WINDOW_READS]
                    .iter()
                    .any(|added| added.contains(permission)),
                "+{permission} is unused"
            );
        }
    }

    #[test]
    fn the_security_document_publishes_the_rules() {
        let security = include_str!("../../../docs/security.md");
        assert!(
            security.contains(&table()),
            "docs/security.md's ACL tables are stale; regenerate them with `tally docs acl`"
        );
    }
}
