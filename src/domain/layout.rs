//! Layout: a prefix's keys on the store the settings name, opened once, and
//! the record that says how the prefix was written.
//!
//! Invariant: every command that touches Redis derives the slot groups and
//! the key layout from its [`StoreSettings`] here and nowhere else, so the
//! writers, the readers and the operations of one deployment name the same
//! keys for the same settings: one slot group on a single server, the
//! configured number on a cluster.
//!
//! # The layout record
//!
//! Where an event lands depends on version 0's bucket count and on the slot
//! groups, and which fences cover it on the consumer group and the topic.
//! Those are flags, and a writer restarted with another value would resume
//! from fences built under the old mapping: on a cluster an event already
//! applied to its old slot group is applied again in its new one, or one is
//! skipped, and a renamed group recounts the whole log into the same
//! counters. So the first `tally run` on a prefix writes them down beside
//! the data, in the hash `<prefix>:layout` (see [`Record`]), with one atomic
//! script, and every later writer compares its settings with the record and
//! refuses to start on a mismatch, naming the flag, the stored value and the
//! remedy ([`Mismatch`]). Readers take the bucket count from the record.
//! The record's bucket count is version 0's for good; `tally rebucket`
//! changes the count of later events as a new epoch of the default layout
//! (see [`crate::domain::versions`]), and a writer's `--buckets` must then
//! name the newest epoch's count.
//! Data written before the record existed is adopted on the first start: the
//! record is written from the flags of that start, which is logged; that
//! start must name `--buckets`, since the count cannot be read from the data,
//! and is refused where the keys show the flags are wrong ([`adopt`]).
//!
//! A record that cannot be read is never deleted to get past it: without it
//! the next start would adopt the data under whatever flags it is given. So a
//! record tally wrote and that lost or broke a field ([`LayoutError::Corrupt`])
//! is told apart from a key tally never wrote ([`LayoutError::Foreign`]), and
//! each refusal names its own repair.
//!
//! # Its format
//!
//! The record's `format` says what the data under the prefix means, not only
//! which fields the record has: any change of meaning bumps it, and a build
//! refuses a record newer than it knows, in one line ([`LayoutError::Format`]),
//! since it would read the data by rules it does not know. Format 1 described
//! version 0's buckets alone; format 2 adds the epochs of the default layout
//! (`tally rebucket`, the registry's `default` field), which every reader must
//! sum: a build of format 1 would count only the first epoch. This build
//! reads format 1 as format 2 (a prefix without epochs means the same under
//! both) and raises the record to 2 on a writer's start and before an epoch
//! is added ([`adopt_format`]), so a build that does not know epochs refuses
//! the prefix instead of under-reading it.

pub mod adopt;

use redis::RedisError;

use crate::domain::generation;
use crate::domain::routing::KeyLayout;
use crate::domain::slots::SlotGroups;
use crate::domain::versions::{DEFAULT_FIELD, Defaults, read_defaults};
use crate::infra::config::{DEFAULT_BUCKETS, StoreSettings};
use crate::infra::store::Lua;
use crate::infra::store::{ConnectError, RedisUrl, Shared, Target};

/// The format of the record this build writes and reads.
pub const FORMAT: u32 = 2;
/// The oldest format this build reads, and raises to [`FORMAT`].
pub const OLDEST_FORMAT: u32 = 1;

static WRITE_RECORD: Lua = Lua::new(concat!(
    include_str!("../infra/acl_check.lua"),
    include_str!("layout_record.lua")
));

/// A store opened from its settings.
#[derive(Clone)]
pub struct OpenStore {
    /// The shared connection.
    pub store: Shared,
    /// The URL it was opened with (credentials included; show `url.shown()`).
    pub url: RedisUrl,
    /// The key layout under the base prefix (generation 0); a generation's
    /// layout is derived from it with [`KeyLayout::with_prefix`].
    pub keys: KeyLayout,
}

impl OpenStore {
    /// Where to open further connections (blocking ones, scans).
    pub fn target(&self) -> &Target {
        self.url.target()
    }
}

/// The slot groups scripts are split by under `settings`.
pub fn slot_groups(settings: &StoreSettings) -> SlotGroups {
    if settings.url().is_cluster() {
        SlotGroups::cluster(settings.slot_groups())
    } else {
        SlotGroups::single()
    }
}

/// The base key layout under `settings`, without connecting.
pub fn base_keys(settings: &StoreSettings) -> KeyLayout {
    KeyLayout::with_groups(settings.prefix(), slot_groups(settings))
}

/// Connects, checks the store answers, and derives the key layout.
pub async fn open(settings: &StoreSettings) -> Result<OpenStore, ConnectError> {
    let store = Shared::open(settings.url()).await?;
    Ok(OpenStore {
        store,
        url: settings.url().clone(),
        keys: base_keys(settings),
    })
}

/// Why a reader could not open a prefix.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Redis is unreachable or refused.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The prefix's record is missing or unusable.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// Opens the store for a reader: the slot groups come from the prefix's
/// layout record, as does version 0's bucket count (in the record
/// returned), so a reader needs no layout settings.
pub async fn open_for_reading(settings: &StoreSettings) -> Result<(OpenStore, Record), OpenError> {
    let mut opened = open(settings).await?;
    let base = settings.prefix();
    let record = read_record(&opened.store, base)
        .await?
        .ok_or_else(|| LayoutError::NoRecord {
            prefix: base.to_string(),
            key: record_key(base),
        })?;
    if settings.url().is_cluster() {
        opened.keys = KeyLayout::with_groups(base, SlotGroups::cluster(record.slot_groups));
    }
    Ok((opened, record))
}

/// The record key of a base prefix.
pub fn record_key(base: &str) -> String {
    format!("{base}:layout")
}

/// What a writer's settings say of its prefix's layout: the values its
/// record holds, with the bucket count left open when no `--buckets` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterLayout {
    /// Buckets per post (`--buckets`): version 0's on a new prefix, the
    /// newest default epoch's on one that exists; `None` takes the record's.
    pub buckets: Option<u32>,
    /// Slot groups scripts are split by (1 on a single server; see
    /// [`slot_groups`]).
    pub slot_groups: u32,
    /// The topic counted.
    pub topic: String,
    /// The consumer group whose fences the prefix holds.
    pub group: String,
}

/// How a prefix was written: what every writer must repeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The record's format.
    pub format: u32,
    /// Buckets per post of routing version 0.
    pub buckets: u32,
    /// Slot groups scripts are split by (1 on a single server).
    pub slot_groups: u32,
    /// The topic counted.
    pub topic: String,
    /// The consumer group whose fences the prefix holds.
    pub group: String,
    /// When the record was written (milliseconds since the epoch).
    pub created_at_ms: i64,
}

impl Record {
    /// The record `writer` would write on a new prefix at `created_at_ms`
    /// (with no `--buckets`, [`DEFAULT_BUCKETS`]).
    pub fn of_writer(writer: &WriterLayout, created_at_ms: i64) -> Record {
        Record {
            format: FORMAT,
            buckets: writer.buckets.unwrap_or(DEFAULT_BUCKETS),
            slot_groups: writer.slot_groups,
            topic: writer.topic.clone(),
            group: writer.group.clone(),
            created_at_ms,
        }
    }

    fn fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("format", self.format.to_string()),
            ("buckets", self.buckets.to_string()),
            ("slot_groups", self.slot_groups.to_string()),
            ("topic", self.topic.clone()),
            ("group", self.group.clone()),
            ("created_at_ms", self.created_at_ms.to_string()),
        ]
    }

    fn from_fields(key: &str, fields: &[(String, String)]) -> Result<Record, LayoutError> {
        // A hash with none of the record's fields is another program's, not
        // a record that lost some: its repair is another prefix, not an HSET.
        if !fields
            .iter()
            .any(|(f, _)| RECORD_FIELDS.contains(&f.as_str()))
        {
            return Err(foreign(key, "a hash without any field of a layout record"));
        }
        let get = |name: &str| -> Result<&str, LayoutError> {
            fields
                .iter()
                .find(|(f, _)| f == name)
                .map(|(_, v)| v.as_str())
                .ok_or_else(|| LayoutError::Corrupt {
                    key: key.to_string(),
                    problem: format!("field {name} is missing"),
                })
        };
        let number = |name: &str| -> Result<i64, LayoutError> {
            get(name)?.parse().map_err(|_| LayoutError::Corrupt {
                key: key.to_string(),
                problem: format!("field {name} is not a number"),
            })
        };
        let format = number("format")?;
        if format > i64::from(FORMAT) {
            return Err(LayoutError::Format {
                key: key.to_string(),
                found: format.try_into().unwrap_or(u32::MAX),
            });
        }
        if format < i64::from(OLDEST_FORMAT) {
            return Err(LayoutError::Corrupt {
                key: key.to_string(),
                problem: format!("format {format} was never written"),
            });
        }
        let format = format as u32;
        let buckets = number("buckets")?;
        let slot_groups = number("slot_groups")?;
        let damaged = |problem: &str| LayoutError::Corrupt {
            key: key.to_string(),
            problem: problem.to_string(),
        };
        if !(1..=1 << 20).contains(&buckets) {
            return Err(damaged("buckets is out of range"));
        }
        if !(1..=16_384).contains(&slot_groups) || !(slot_groups as u32).is_power_of_two() {
            return Err(damaged("slot_groups is not a power of two up to 16384"));
        }
        Ok(Record {
            format,
            buckets: buckets as u32,
            slot_groups: slot_groups as u32,
            topic: get("topic")?.to_string(),
            group: get("group")?.to_string(),
            created_at_ms: number("created_at_ms")?,
        })
    }
}

/// A writer's settings that differ from the record of its prefix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag} {given} does not match the layout record {key}, written with {stored}: {remedy}")]
pub struct Mismatch {
    /// The flag at fault.
    pub flag: &'static str,
    /// Its value now.
    pub given: String,
    /// The value the prefix was written with.
    pub stored: String,
    /// The record's key.
    pub key: String,
    /// What to do.
    pub remedy: String,
}

/// Why the layout record cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// Reading or writing it failed.
    #[error("reading the layout record: {0}")]
    Redis(#[from] RedisError),
    /// The settings differ from it.
    #[error(transparent)]
    Mismatch(#[from] Mismatch),
    /// It has a format newer than this build knows.
    #[error(
        "layout record {key} has format {found}, newer than this tally knows (format {FORMAT}): a newer tally wrote data this one would misread; run a release that knows format {found}"
    )]
    Format {
        /// The record's key.
        key: String,
        /// The format found.
        found: u32,
    },
    /// A reader found no record: nothing was counted under the prefix, or
    /// its data predates records and no writer has started on it since.
    #[error(
        "prefix {prefix} has no layout record ({key}): nothing has been counted under it (check --prefix and --redis), or its data predates the record and one start of `tally run` on it adopts it"
    )]
    NoRecord {
        /// The base prefix.
        prefix: String,
        /// The record's key.
        key: String,
    },
    /// Data written before records existed, and no `--buckets` to say with
    /// how many buckets it was written.
    #[error(
        "prefix {prefix} holds counts but no layout record ({key}){seen}: start once with --buckets set to the count they were written with (releases before the record defaulted to 16) to adopt them"
    )]
    AdoptWithoutBuckets {
        /// The base prefix.
        prefix: String,
        /// The record's key.
        key: String,
        /// What the keys show of the count, if anything (`; its version-0
        /// buckets go up to 15`).
        seen: String,
    },
    /// A record tally wrote, with a field missing or broken.
    #[error(
        "layout record {key} is damaged ({problem}): set the field back with `HSET {key} <field> <value>` to what the prefix's writers run with, or restore the record from a backup; keep the key, since a start without it would adopt the data under whatever flags it is given"
    )]
    Corrupt {
        /// The record's key.
        key: String,
        /// What is wrong.
        problem: String,
    },
    /// The key holds something tally never wrote.
    #[error(
        "{key} is not a layout record ({what}): something other than tally writes under --prefix {prefix}; give tally a --prefix of its own and leave the key to its owner"
    )]
    Foreign {
        /// The record's key.
        key: String,
        /// The base prefix.
        prefix: String,
        /// What the key holds.
        what: String,
    },
    /// The keys of data written without a record contradict a start's settings.
    #[error(transparent)]
    Adopt(#[from] adopt::Refusal),
}

/// The fields of a record.
const RECORD_FIELDS: [&str; 6] = [
    "format",
    "buckets",
    "slot_groups",
    "topic",
    "group",
    "created_at_ms",
];

fn foreign(key: &str, what: &str) -> LayoutError {
    LayoutError::Foreign {
        key: key.to_string(),
        prefix: key.strip_suffix(":layout").unwrap_or(key).to_string(),
        what: what.to_string(),
    }
}

/// The record of `base`, if the prefix has one.
pub async fn read_record(store: &Shared, base: &str) -> Result<Option<Record>, LayoutError> {
    let key = record_key(base);
    let fields: Vec<(String, String)> = store
        .call(|mut s| {
            let key = key.clone();
            async move { redis::cmd("HGETALL").arg(&key).query_async(&mut s).await }
        })
        .await
        .map_err(|e| match e.code() {
            Some("WRONGTYPE") => foreign(&key, "a key of another type than a hash"),
            _ => LayoutError::Redis(e),
        })?;
    if fields.is_empty() {
        return Ok(None);
    }
    Record::from_fields(&key, &fields).map(Some)
}

/// Writes `proposed` as the record of `base` unless one exists, and raises
/// an existing record of an older format this build reads to [`FORMAT`];
/// returns the record in force and whether this call wrote it.
pub async fn ensure_record(
    store: &Shared,
    base: &str,
    proposed: &Record,
) -> Result<(Record, bool), LayoutError> {
    let (record, outcome) = write_record(store, base, proposed).await?;
    Ok((record, outcome == "1"))
}

/// Raises the record of `base` to [`FORMAT`] if `record`, just read, has an
/// older format: before anything of the newer meaning (a default epoch) is
/// written, so that a build of the older format refuses the prefix. One
/// HSET (the commands need no script): only a build newer than this one
/// could have raised it further in between.
pub async fn adopt_format(store: &Shared, base: &str, record: &Record) -> Result<(), LayoutError> {
    if record.format < FORMAT {
        let key = record_key(base);
        store
            .call(|mut s| {
                let key = key.clone();
                async move {
                    redis::cmd("HSET")
                        .arg(&key)
                        .arg("format")
                        .arg(FORMAT)
                        .query_async::<()>(&mut s)
                        .await
                }
            })
            .await?;
        tracing::info!(%key, format = FORMAT, "Layout record raised to this build's format.");
    }
    Ok(())
}

/// Runs layout_record.lua: the record in force, and "1" (written), "2"
/// (raised to `proposed`'s format) or "0".
async fn write_record(
    store: &Shared,
    base: &str,
    proposed: &Record,
) -> Result<(Record, String), LayoutError> {
    let key = record_key(base);
    let args: Vec<String> = std::iter::once(OLDEST_FORMAT.to_string())
        .chain(
            proposed
                .fields()
                .into_iter()
                .flat_map(|(f, v)| [f.to_string(), v]),
        )
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let reply: Vec<String> = WRITE_RECORD.call(store, &[&key], &args).await?;
    let outcome = reply.first().cloned().unwrap_or_default();
    if outcome == "2" {
        tracing::info!(%key, format = proposed.format, "Layout record raised to this build's format.");
    }
    let fields: Vec<(String, String)> = reply[1.min(reply.len())..]
        .chunks(2)
        .filter(|pair| pair.len() == 2)
        .map(|pair| (pair[0].clone(), pair[1].clone()))
        .collect();
    Ok((Record::from_fields(&key, &fields)?, outcome))
}

/// The default layout writers of the prefix use now: the current
/// generation's, starting from the record's bucket count.
pub async fn current_defaults(
    store: &Shared,
    base: &KeyLayout,
    record: &Record,
) -> Result<Defaults, RedisError> {
    let registry = generation::current_layout(store, base)
        .await?
        .registry_key();
    let entry: Option<String> = store
        .call(|mut s| {
            let registry = registry.clone();
            async move {
                redis::cmd("HGET")
                    .arg(&registry)
                    .arg(DEFAULT_FIELD)
                    .query_async(&mut s)
                    .await
            }
        })
        .await?;
    read_defaults(&registry, entry.as_deref(), record.buckets)
}

/// Compares a writer's layout with the record in force and the bucket
/// count writers use now. A writer that names no bucket count takes the
/// current one.
pub async fn check_writer(
    opened: &OpenStore,
    writer: &WriterLayout,
    stored: &Record,
) -> Result<(), LayoutError> {
    let defaults = current_defaults(&opened.store, &opened.keys, stored).await?;
    let buckets_now = defaults.latest().buckets;
    let proposed = Record {
        buckets: writer.buckets.unwrap_or(buckets_now),
        ..Record::of_writer(writer, stored.created_at_ms)
    };
    compare(opened.keys.prefix(), &proposed, stored, buckets_now)?;
    Ok(())
}

/// The first difference between a writer's settings (`proposed`) and the
/// record in force (with `buckets_now`, the newest default epoch's count),
/// with what to do about it.
pub fn compare(
    base: &str,
    proposed: &Record,
    stored: &Record,
    buckets_now: u32,
) -> Result<(), Mismatch> {
    let (group, topic) = (&stored.group, &stored.topic);
    let (buckets_shown, buckets_remedy) = if buckets_now == stored.buckets {
        (
            stored.buckets.to_string(),
            format!(
                "run with --buckets {buckets_now} (another count for new events is `tally rebucket --to-buckets N`, made while tally runs)"
            ),
        )
    } else {
        (
            format!("{}, rebucketed to {buckets_now}", stored.buckets),
            format!(
                "`tally rebucket` set the default to {buckets_now}: run with --buckets {buckets_now}"
            ),
        )
    };
    // (flag, given, expected, shown as stored, remedy)
    let checks = [
        (
            "group",
            proposed.group.clone(),
            group.clone(),
            group.clone(),
            format!(
                "the prefix holds the fences of group {group}; run with --group {group}, or give this group a --prefix of its own (a canary counts into its own prefix)"
            ),
        ),
        (
            "topic",
            proposed.topic.clone(),
            topic.clone(),
            topic.clone(),
            format!("run with --topic {topic}, or count this topic into a --prefix of its own"),
        ),
        (
            "buckets",
            proposed.buckets.to_string(),
            buckets_now.to_string(),
            buckets_shown,
            buckets_remedy,
        ),
        (
            "slot-groups",
            proposed.slot_groups.to_string(),
            stored.slot_groups.to_string(),
            stored.slot_groups.to_string(),
            format!(
                "run with --slot-groups {} (each fence covers fixed slot groups: another count means counting the topic afresh into a new --prefix under a new --group, then moving readers to it)",
                stored.slot_groups
            ),
        ),
    ];
    match checks
        .into_iter()
        .find(|(_, given, expected, _, _)| given != expected)
    {
        Some((flag, given, _, stored, remedy)) => Err(Mismatch {
            flag,
            given,
            stored,
            key: record_key(base),
            remedy,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record {
            format: FORMAT,
            buckets: 16,
            slot_groups: 128,
            topic: "likes".into(),
            group: "tally".into(),
            created_at_ms: 1,
        }
    }

    #[test]
    fn a_writer_without_buckets_proposes_the_default() {
        let writer = WriterLayout {
            buckets: None,
            slot_groups: 128,
            topic: "likes".into(),
            group: "tally".into(),
        };
        let proposed = Record::of_writer(&writer, 1);
        assert_eq!(
            proposed,
            Record {
                buckets: DEFAULT_BUCKETS,
                ..record()
            }
        );
        let named = WriterLayout {
            buckets: Some(16),
            ..writer
        };
        assert_eq!(Record::of_writer(&named, 1), record());
    }

    #[test]
    fn every_layout_setting_is_compared() {
        let stored = record();
        assert_eq!(compare("t", &record(), &stored, 16), Ok(()));
        let cases = [
            (
                "buckets",
                Record {
                    buckets: 8,
                    ..record()
                },
            ),
            (
                "slot-groups",
                Record {
                    slot_groups: 64,
                    ..record()
                },
            ),
            (
                "group",
                Record {
                    group: "canary".into(),
                    ..record()
                },
            ),
            (
                "topic",
                Record {
                    topic: "other".into(),
                    ..record()
                },
            ),
        ];
        for (flag, proposed) in cases {
            let err = compare("t", &proposed, &stored, 16).unwrap_err();
            assert_eq!(err.flag, flag);
            let line = err.to_string();
            assert!(line.contains("t:layout") && !line.contains('\n'), "{line}");
        }
        // The creation time is not a setting.
        assert!(
            compare(
                "t",
                &Record {
                    created_at_ms: 9,
                    ..record()
                },
                &stored,
                16
            )
            .is_ok()
        );
        // After `tally rebucket`, writers name the newest count.
        let rebucketed = compare("t", &record(), &stored, 1).unwrap_err();
        assert_eq!(
            (rebucketed.flag, rebucketed.stored.as_str()),
            ("buckets", "16, rebucketed to 1")
        );
        assert!(rebucketed.remedy.contains("--buckets 1"), "{rebucketed}");
        let one = Record {
            buckets: 1,
            ..record()
        };
        assert_eq!(compare("t", &one, &stored, 1), Ok(()));
    }

    #[test]
    fn records_read_back_and_damage_is_named() {
        let fields: Vec<(String, String)> = record()
            .fields()
            .into_iter()
            .map(|(f, v)| (f.to_string(), v))
            .collect();
        assert_eq!(Record::from_fields("t:layout", &fields).unwrap(), record());
        let newer: Vec<(String, String)> = fields
            .iter()
            .map(|(f, v)| {
                (
                    f.clone(),
                    if f == "format" { "9".into() } else { v.clone() },
                )
            })
            .collect();
        assert!(matches!(
            Record::from_fields("t:layout", &newer),
            Err(LayoutError::Format { found: 9, .. })
        ));
        // The format before epochs reads as this one; format 0 was never written.
        let with_format = |format: &str| -> Vec<(String, String)> {
            fields
                .iter()
                .map(|(f, v)| {
                    let v = if f == "format" {
                        format.into()
                    } else {
                        v.clone()
                    };
                    (f.clone(), v)
                })
                .collect()
        };
        assert_eq!(
            Record::from_fields("t:layout", &with_format("1")).unwrap(),
            Record {
                format: 1,
                ..record()
            }
        );
        assert!(matches!(
            Record::from_fields("t:layout", &with_format("0")),
            Err(LayoutError::Corrupt { .. })
        ));
        let line = Record::from_fields("t:layout", &with_format(&(FORMAT + 1).to_string()))
            .unwrap_err()
            .to_string();
        assert!(
            line.contains("newer than this tally knows") && !line.contains('\n'),
            "{line}"
        );
        let damaged = Record::from_fields("t:layout", &fields[1..])
            .unwrap_err()
            .to_string();
        assert!(
            damaged.starts_with("layout record t:layout is damaged (field format is missing): set the field back with `HSET t:layout")
                && !damaged.contains("delete"),
            "{damaged}"
        );
        // Another program's hash is not a damaged record: its repair is another prefix.
        let other = [("owner".to_string(), "billing".to_string())];
        let foreign = Record::from_fields("t:layout", &other)
            .unwrap_err()
            .to_string();
        assert!(
            foreign.starts_with("t:layout is not a layout record (a hash without any field of a layout record): something other than tally writes under --prefix t; give tally a --prefix of its own"),
            "{foreign}"
        );
    }
}
