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
//!
//! Format 3 adds the packing of each generation (see
//! [`crate::domain::packing`]): `layout` for generation 0 and `layout.g<k>`
//! for generation `k`, absent meaning a string key per counter. Only a record
//! with a packed generation is written as format 3 (raised to it before the
//! first packed key is written): a build of format 2 reads a prefix of
//! string keys as well as ever, and refuses one it would find empty.
//!
//! Format 4 adds the windows of trending counts (see
//! [`crate::domain::windows`]): `windows`, `window_lateness_ms` and
//! `window_retention_ms`. Only a record with windows is written as format 4,
//! when the prefix is made: a build of format 3 would count lifetime likes
//! into it and leave its windows short, so it refuses the prefix instead.
//! The windows of a prefix never change: a window added later would hold a
//! part of its likes.
//!
//! Format 5 adds packed generations whose hashes split as they fill
//! (`growing:<fields>`, see [`crate::domain::packing`]): their counters are
//! placed by a split state a build of format 4 does not read, so a record
//! with such a generation is written as format 5 (raised to it before the
//! first of its keys is written), and a build of format 4 refuses the prefix
//! instead of looking for its counters in the wrong hashes.

pub mod adopt;

use redis::RedisError;

use std::collections::BTreeMap;

use crate::domain::generation;
use crate::domain::packing::{Packing, Wanted};
use crate::domain::routing::KeyLayout;
use crate::domain::slots::SlotGroups;
use crate::domain::versions::{DEFAULT_FIELD, Defaults, read_defaults};
use crate::domain::windows::{WindowSize, Windows};
use crate::infra::config::{DEFAULT_BUCKETS, StoreSettings};
use crate::infra::store::Lua;
use crate::infra::store::{ConnectError, RedisUrl, Shared, Target};

/// The newest format of the record this build writes and reads: a record
/// with a packed generation whose hashes split as they fill.
pub const FORMAT: u32 = 5;
/// The format of a record with windows and no growing generation.
pub const WINDOWS_FORMAT: u32 = 4;
/// The format of a record with a packed generation and no windows.
pub const PACKED_FORMAT: u32 = 3;
/// The format of a record whose generations all keep string keys.
pub const STRINGS_FORMAT: u32 = 2;
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
    opened.keys = opened
        .keys
        .with_packing(record.packing_of(0))
        .with_windows(record.windows.clone());
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
    /// How a new prefix keeps its counters (`--layout`); `None` takes the
    /// record's.
    pub packing: Option<Wanted>,
    /// The windows a new prefix keeps (`--windows`); `None` takes the
    /// record's, and none on a new prefix.
    pub windows: Option<Windows>,
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
    /// The generations that keep their counters packed; every other one
    /// keeps a string key per counter.
    pub packed: BTreeMap<u64, Packing>,
    /// The windows of trending counts every generation keeps.
    pub windows: Windows,
}

/// The record field holding generation `k`'s packing.
pub fn packing_field(k: u64) -> String {
    match k {
        0 => "layout".to_string(),
        k => format!("layout.g{k}"),
    }
}

impl Record {
    /// How generation `k` keeps its counters.
    pub fn packing_of(&self, k: u64) -> Packing {
        self.packed.get(&k).copied().unwrap_or_default()
    }

    /// The key layout of generation `k` under `base`, the base layout.
    pub fn generation_keys(&self, base: &KeyLayout, k: u64) -> KeyLayout {
        base.with_prefix(generation::prefix_of(base.prefix(), k))
            .with_packing(self.packing_of(k))
            .with_windows(self.windows.clone())
    }

    /// The record `writer` would write on a new prefix at `created_at_ms`
    /// (with no `--buckets`, [`DEFAULT_BUCKETS`]).
    pub fn of_writer(writer: &WriterLayout, created_at_ms: i64) -> Record {
        let packing = writer
            .packing
            .unwrap_or_default()
            .packing(writer.slot_groups);
        let packed: BTreeMap<u64, Packing> = match packing {
            Packing::Strings => BTreeMap::new(),
            packed => BTreeMap::from([(0, packed)]),
        };
        let windows = writer.windows.clone().unwrap_or_default();
        Record {
            format: format_for(&packed, &windows),
            buckets: writer.buckets.unwrap_or(DEFAULT_BUCKETS),
            slot_groups: writer.slot_groups,
            topic: writer.topic.clone(),
            group: writer.group.clone(),
            created_at_ms,
            packed,
            windows,
        }
    }

    fn fields(&self) -> Vec<(String, String)> {
        let mut fields: Vec<(String, String)> = [
            ("format", self.format.to_string()),
            ("buckets", self.buckets.to_string()),
            ("slot_groups", self.slot_groups.to_string()),
            ("topic", self.topic.clone()),
            ("group", self.group.clone()),
            ("created_at_ms", self.created_at_ms.to_string()),
        ]
        .into_iter()
        .map(|(f, v)| (f.to_string(), v))
        .collect();
        fields.extend(
            self.packed
                .iter()
                .map(|(&k, packing)| (packing_field(k), packing.to_string())),
        );
        if !self.windows.is_empty() {
            fields.extend([
                ("windows".to_string(), self.windows.sizes_field()),
                (
                    "window_lateness_ms".to_string(),
                    self.windows.lateness_ms.to_string(),
                ),
                (
                    "window_retention_ms".to_string(),
                    self.windows.retention_ms.to_string(),
                ),
            ]);
        }
        fields
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
        let mut packed = BTreeMap::new();
        for (field, value) in fields {
            let k = match field.as_str() {
                "layout" => 0,
                other => match other.strip_prefix("layout.g").map(str::parse::<u64>) {
                    Some(Ok(k)) if k > 0 => k,
                    Some(_) => return Err(damaged(&format!("field {other} names no generation"))),
                    None => continue,
                },
            };
            let packing: Packing = value
                .parse()
                .map_err(|e: crate::domain::packing::BadPacking| damaged(&e.to_string()))?;
            if packing != Packing::Strings {
                packed.insert(k, packing);
            }
        }
        if format < PACKED_FORMAT && !packed.is_empty() {
            return Err(damaged(
                "it names a packed generation but its format is older than 3",
            ));
        }
        if format < FORMAT && packed.values().any(|p| p.growing().is_some()) {
            return Err(damaged(
                "it names a packed generation whose hashes grow but its format is older than 5",
            ));
        }
        let windows = match fields.iter().find(|(f, _)| f == "windows") {
            None => Windows::none(),
            Some((_, sizes)) => {
                let sizes: Vec<WindowSize> =
                    Windows::parse_sizes(sizes).map_err(|e| damaged(&format!("windows: {e}")))?;
                let rule = |name: &str| -> Result<u64, LayoutError> {
                    number(name)?
                        .try_into()
                        .map_err(|_| damaged(&format!("field {name} is negative")))
                };
                Windows::new(
                    sizes,
                    rule("window_lateness_ms")?,
                    rule("window_retention_ms")?,
                )
                .map_err(|e| damaged(&format!("windows: {e}")))?
            }
        };
        if format < WINDOWS_FORMAT && !windows.is_empty() {
            return Err(damaged("it names windows but its format is older than 4"));
        }
        Ok(Record {
            format,
            buckets: buckets as u32,
            slot_groups: slot_groups as u32,
            topic: get("topic")?.to_string(),
            group: get("group")?.to_string(),
            created_at_ms: number("created_at_ms")?,
            packed,
            windows,
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

/// How generation `k` of `base` keeps its counters, as its record says
/// (string keys when it names no packing); `None` while the prefix has no
/// record, when nothing has been written under it yet. A value that cannot be
/// read is an error, never a guess.
pub async fn packing_if_recorded(
    store: &Shared,
    base: &str,
    k: u64,
) -> Result<Option<Packing>, RedisError> {
    let key = record_key(base);
    let field = packing_field(k);
    let (format, value): (Option<String>, Option<String>) = store
        .call(|mut s| {
            let (key, field) = (key.clone(), field.clone());
            async move {
                redis::cmd("HMGET")
                    .arg(key)
                    .arg("format")
                    .arg(field)
                    .query_async(&mut s)
                    .await
            }
        })
        .await?;
    let unreadable = |e: crate::domain::packing::BadPacking| {
        RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "layout record",
            format!("{key} field {field}: {e}"),
        ))
    };
    match (format, value) {
        (None, _) => Ok(None),
        (Some(_), None) => Ok(Some(Packing::Strings)),
        (Some(_), Some(text)) => text.parse().map(Some).map_err(unreadable),
    }
}

/// How generation `k` of `base` keeps its counters, as its record says; a
/// prefix without a record keeps string keys.
pub async fn read_packing(store: &Shared, base: &str, k: u64) -> Result<Packing, RedisError> {
    Ok(packing_if_recorded(store, base, k)
        .await?
        .unwrap_or_default())
}

/// The key layout of generation `k` under `base` (the base layout), with
/// the packing and the windows its record gives it (string keys and no
/// windows while the prefix has no record).
pub async fn generation_keys(
    store: &Shared,
    base: &KeyLayout,
    k: u64,
) -> Result<KeyLayout, LayoutError> {
    Ok(match read_record(store, base.prefix()).await? {
        Some(record) => record.generation_keys(base, k),
        None => base
            .with_prefix(generation::prefix_of(base.prefix(), k))
            .with_packing(Packing::Strings),
    })
}

/// The format a record with these packed generations and windows is
/// written with: the oldest whose builds read all of it.
pub fn format_for(packed: &BTreeMap<u64, Packing>, windows: &Windows) -> u32 {
    if packed.values().any(|p| p.growing().is_some()) {
        return FORMAT;
    }
    match (packed.is_empty(), windows.is_empty()) {
        (_, false) => WINDOWS_FORMAT,
        (false, true) => PACKED_FORMAT,
        (true, true) => STRINGS_FORMAT,
    }
}

/// Raises the record of `base` to [`STRINGS_FORMAT`] if `record`, just read,
/// has an older format: before anything of the newer meaning (a default
/// epoch) is written, so that a build of the older format refuses the
/// prefix. One HSET (the commands need no script): only a build newer than
/// this one could have raised it further in between.
pub async fn adopt_format(store: &Shared, base: &str, record: &Record) -> Result<(), LayoutError> {
    raise_format(store, base, record, STRINGS_FORMAT).await
}

/// Records that generation `k` of `base` keeps its counters as `packing`,
/// raising the record's format to what that needs, before the first of them
/// is written; `record` is the record as read. A generation of string keys
/// needs no field; one left by an aborted rebuild of the same number is set
/// to `strings` (HSET, which every writer's ACL holds).
pub async fn record_packing(
    store: &Shared,
    base: &str,
    record: &Record,
    k: u64,
    packing: Packing,
) -> Result<(), LayoutError> {
    let key = record_key(base);
    let field = packing_field(k);
    if packing == Packing::Strings {
        let stale: Option<String> = store
            .call(|mut s| {
                let (key, field) = (key.clone(), field.clone());
                async move {
                    redis::cmd("HGET")
                        .arg(key)
                        .arg(field)
                        .query_async(&mut s)
                        .await
                }
            })
            .await?;
        if stale.is_none_or(|v| v == "strings") {
            return Ok(());
        }
    }
    let needed = match packing.growing() {
        Some(_) => FORMAT,
        None => PACKED_FORMAT,
    };
    raise_format(store, base, record, needed).await?;
    store
        .call(|mut s| {
            let (key, field) = (key.clone(), field.clone());
            let value = packing.to_string();
            async move {
                redis::cmd("HSET")
                    .arg(key)
                    .arg(field)
                    .arg(value)
                    .query_async::<()>(&mut s)
                    .await
            }
        })
        .await?;
    tracing::info!(%key, generation = k, layout = %packing, "Generation layout recorded.");
    Ok(())
}

async fn raise_format(
    store: &Shared,
    base: &str,
    record: &Record,
    format: u32,
) -> Result<(), LayoutError> {
    if record.format < format {
        let key = record_key(base);
        store
            .call(|mut s| {
                let key = key.clone();
                async move {
                    redis::cmd("HSET")
                        .arg(&key)
                        .arg("format")
                        .arg(format)
                        .query_async::<()>(&mut s)
                        .await
                }
            })
            .await?;
        tracing::info!(%key, format, "Layout record raised to the format its data needs.");
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
    // An existing record is raised no further than a prefix of string keys
    // needs: a writer's packing is for a new prefix only.
    let args: Vec<String> = [OLDEST_FORMAT, proposed.format.min(STRINGS_FORMAT)]
        .iter()
        .map(u32::to_string)
        .chain(proposed.fields().into_iter().flat_map(|(f, v)| [f, v]))
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

/// Compares a writer's layout with the record in force, the bucket count
/// writers use now and the packing of generation `written`, the one it
/// writes. A writer that names no bucket count or layout takes the current
/// ones.
pub async fn check_writer(
    opened: &OpenStore,
    writer: &WriterLayout,
    stored: &Record,
    written: u64,
) -> Result<(), LayoutError> {
    let defaults = current_defaults(&opened.store, &opened.keys, stored).await?;
    let buckets_now = defaults.latest().buckets;
    let proposed = Record {
        buckets: writer.buckets.unwrap_or(buckets_now),
        ..Record::of_writer(writer, stored.created_at_ms)
    };
    compare(opened.keys.prefix(), &proposed, stored, buckets_now)?;
    check_packing(
        opened.keys.prefix(),
        writer.packing.as_ref(),
        &stored.packing_of(written),
    )?;
    check_windows(
        opened.keys.prefix(),
        writer.windows.as_ref(),
        &stored.windows,
    )?;
    Ok(())
}

/// A writer that names windows (`--windows`, with its lateness and
/// retention) must name the prefix's: a window added later would hold a part
/// of its likes, and another lateness would judge the log differently.
pub fn check_windows(base: &str, wanted: Option<&Windows>, now: &Windows) -> Result<(), Mismatch> {
    let Some(wanted) = wanted.filter(|w| *w != now) else {
        return Ok(());
    };
    let shown = |w: &Windows| match w.is_empty() {
        true => "no windows".to_string(),
        false => format!(
            "{} (lateness {}, retention {})",
            w.sizes_field(),
            crate::domain::windows::Millis(w.lateness_ms),
            crate::domain::windows::Millis(w.retention_ms)
        ),
    };
    Err(Mismatch {
        flag: "windows",
        given: shown(wanted),
        stored: shown(now),
        key: record_key(base),
        remedy: "run without --windows, --window-lateness and --window-retention to keep the prefix's; other windows are counted from the start of the log into a new --prefix under a new --group".to_string(),
    })
}

/// A writer that names a layout (`--layout`) must name the one the current
/// generation keeps: the hashes of a packed generation are sized when it is
/// made, and a generation never changes its layout.
pub fn check_packing(base: &str, wanted: Option<&Wanted>, now: &Packing) -> Result<(), Mismatch> {
    let Some(wanted) = wanted else {
        return Ok(());
    };
    if wanted.name() == now.name() {
        return Ok(());
    }
    Err(Mismatch {
        flag: "layout",
        given: wanted.name().to_string(),
        stored: now.to_string(),
        key: record_key(base),
        remedy: format!(
            "run without --layout (or with --layout {}); `tally rebuild --layout {}` moves the prefix to the other layout while tally runs",
            now.name(),
            wanted.name()
        ),
    })
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
            format: STRINGS_FORMAT,
            buckets: 16,
            slot_groups: 128,
            topic: "likes".into(),
            group: "tally".into(),
            created_at_ms: 1,
            packed: BTreeMap::new(),
            windows: Windows::none(),
        }
    }

    #[test]
    fn a_writer_without_buckets_proposes_the_default() {
        let writer = WriterLayout {
            buckets: None,
            slot_groups: 128,
            topic: "likes".into(),
            group: "tally".into(),
            packing: None,
            windows: None,
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

    /// A record's fields with its format replaced by `format`.
    fn at_format(fields: Vec<(String, String)>, format: u32) -> Vec<(String, String)> {
        fields
            .into_iter()
            .map(|(f, v)| match f.as_str() {
                "format" => (f, format.to_string()),
                _ => (f, v),
            })
            .collect()
    }

    #[test]
    fn growing_generations_need_format_5() {
        use crate::domain::packing::Growing;
        let writer = WriterLayout {
            buckets: None,
            slot_groups: 1,
            topic: "likes".into(),
            group: "tally".into(),
            packing: Some(Wanted::Packed {
                counters: None,
                fields: None,
            }),
            windows: None,
        };
        let record = Record::of_writer(&writer, 1);
        assert_eq!(record.format, FORMAT);
        let shape = Packing::Growing(Growing { fields: 40 });
        assert_eq!(record.packing_of(0), shape);
        let fields = record.fields();
        assert!(fields.contains(&("layout".into(), "growing:40".into())));
        assert_eq!(
            Record::from_fields("t:layout", &fields)
                .unwrap()
                .packing_of(0),
            shape
        );
        // Written as format 4, a build of format 4 would misplace its counters.
        let damaged =
            Record::from_fields("t:layout", &at_format(fields, WINDOWS_FORMAT)).unwrap_err();
        assert!(damaged.to_string().contains("older than 5"), "{damaged}");
    }

    #[test]
    fn packed_generations_are_recorded_and_named_by_writers() {
        use crate::domain::packing::Packed;
        let writer = WriterLayout {
            buckets: None,
            slot_groups: 1,
            topic: "likes".into(),
            group: "tally".into(),
            packing: Some(Wanted::Packed {
                counters: Some(1_000_000),
                fields: Some(64),
            }),
            windows: None,
        };
        let packed = Record::of_writer(&writer, 1);
        assert_eq!(packed.format, PACKED_FORMAT);
        let shape = Packing::Packed(Packed {
            hashes: 15_625,
            fields: 64,
        });
        assert_eq!(packed.packing_of(0), shape);
        assert_eq!(packed.packing_of(1), Packing::Strings);
        let mut fields: Vec<(String, String)> = packed.fields();
        assert!(fields.contains(&("layout".into(), "packed:15625:64".into())));
        fields.push(("layout.g2".into(), "strings".into()));
        fields.push(("layout.g3".into(), "packed:7:64".into()));
        let read = Record::from_fields("t:layout", &fields).unwrap();
        assert_eq!(read.packing_of(0), shape);
        assert_eq!(read.packing_of(2), Packing::Strings);
        assert!(read.packing_of(3) != Packing::Strings);
        let keys = read.generation_keys(&KeyLayout::new("t"), 3);
        assert_eq!((keys.prefix(), keys.is_packed()), ("t:g3", true));
        // A packed generation in a record of the format before packing is damage.
        let older: Vec<(String, String)> = fields
            .iter()
            .map(|(f, v)| match f.as_str() {
                "format" => (f.clone(), STRINGS_FORMAT.to_string()),
                _ => (f.clone(), v.clone()),
            })
            .collect();
        assert!(matches!(
            Record::from_fields("t:layout", &older),
            Err(LayoutError::Corrupt { .. })
        ));
        let mut junk = fields.clone();
        junk.push(("layout.g0".into(), "strings".into()));
        assert!(Record::from_fields("t:layout", &junk).is_err());
        // A writer that names the other layout is refused with the way to move.
        let wrong = check_packing("t", Some(&Wanted::Strings), &shape).unwrap_err();
        assert_eq!(wrong.flag, "layout");
        assert!(
            wrong.to_string().contains("tally rebuild --layout strings"),
            "{wrong}"
        );
        assert!(check_packing("t", None, &shape).is_ok());
        assert!(check_packing("t", Some(&Wanted::Strings), &Packing::Strings).is_ok());
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

    #[test]
    fn windows_are_recorded_at_format_4_and_writers_must_name_them() {
        let sizes = Windows::parse_sizes("1h,1d").unwrap();
        let windows = Windows::new(sizes, 300_000, 86_400_000).unwrap();
        let writer = WriterLayout {
            buckets: None,
            slot_groups: 1,
            topic: "likes".into(),
            group: "tally".into(),
            packing: None,
            windows: Some(windows.clone()),
        };
        let record = Record::of_writer(&writer, 1);
        assert_eq!(record.format, WINDOWS_FORMAT);
        let read = Record::from_fields("t:layout", &record.fields()).unwrap();
        assert_eq!(read.windows, windows);
        let damaged = Record::from_fields("t:layout", &at_format(record.fields(), PACKED_FORMAT))
            .unwrap_err();
        assert!(damaged.to_string().contains("older than 4"), "{damaged}");
        assert!(check_windows("t", None, &windows).is_ok());
        assert!(check_windows("t", Some(&windows), &windows).is_ok());
        let hourly =
            Windows::new(Windows::parse_sizes("1h").unwrap(), 300_000, 86_400_000).unwrap();
        let refused = check_windows("t", Some(&hourly), &windows).unwrap_err();
        assert_eq!(refused.flag, "windows");
        assert!(
            refused
                .to_string()
                .contains("written with 1h,1d (lateness 5m, retention 1d)"),
            "{refused}"
        );
        let none = check_windows("t", Some(&Windows::none()), &windows).unwrap_err();
        assert!(none.to_string().contains("--windows no windows"), "{none}");
    }
}
