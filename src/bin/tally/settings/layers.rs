//! Layers: where each setting of `tally run` takes its value from.
//!
//! Invariant: for every setting, a flag beats its `TALLY_*` variable, which
//! beats the `--config` file, which beats the default. `kafka-config` merges
//! per librdkafka key in the same order (the file's table, then `-X` or
//! `TALLY_KAFKA_CONFIG` on top). A file key tally does not know is an error
//! that names the key and its line; nothing in a file is silently ignored.
//!
//! The commands that read or change stored counts without consuming (`count`,
//! `serve`, `inspect`, `gc`, `promote`, `demote`, `rebucket`) take the same
//! file and `TALLY_CONFIG` through [`ConfigArg`], and layer their flag groups
//! of `tally run`'s settings ([`super::StoreArgs`], [`super::RegistryWaitArgs`])
//! over it the same way: one file in a pod serves every command run there.

use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, FromArgMatches};
use serde::Deserialize as _;
use serde::Serialize;
use serde::de::DeserializeOwned;

use tally::infra::config::{ConfigError, bad};

use super::RunArgs;

/// Settings that are flags only: `--config` names the file, and the hidden
/// testing pause never belongs in one.
const FLAG_ONLY: &[&str] = &["config", "test-script-pause-ms"];

/// Every key a `--config` file may hold, in `--help` order.
pub fn file_keys() -> Vec<String> {
    RunArgs::augment_args(clap::Command::new("tally"))
        .get_arguments()
        .map(|arg| arg.get_id().as_str().replace('_', "-"))
        .filter(|key| !FLAG_ONLY.contains(&key.as_str()))
        .collect()
}

/// The settings of `tally run` from its parsed flags (with their variables
/// and defaults) and the `--config` file they name, if any. Secrets are not
/// read yet: see [`RunArgs::settings`].
pub fn load(matches: &ArgMatches) -> Result<RunArgs, Vec<ConfigError>> {
    let cli = RunArgs::from_arg_matches(matches).map_err(|e| vec![bad("config", e.to_string())])?;
    let Some(path) = cli.config.clone() else {
        return Ok(cli);
    };
    let text = std::fs::read_to_string(&path).map_err(|e| {
        vec![bad(
            "config",
            format!("cannot read {}: {e}", path.display()),
        )]
    })?;
    let file = parse_file(&path, &text)?;
    merge(cli, file, |id| matches.value_source(id)).map_err(|e| vec![e])
}

/// Parses a settings file, rejecting keys tally does not know.
pub fn parse_file(path: &Path, text: &str) -> Result<RunArgs, Vec<ConfigError>> {
    let located = |e: toml::de::Error| {
        let line = e
            .span()
            .map(|span| format!(":{}", text[..span.start].lines().count().max(1)))
            .unwrap_or_default();
        bad(
            "config",
            format!("{}{line}: {}", path.display(), e.message().trim()),
        )
    };
    let table: toml::Table = text.parse().map_err(|e| vec![located(e)])?;
    let known = file_keys();
    let unknown: Vec<ConfigError> = table
        .keys()
        .filter(|key| !known.contains(key))
        .map(|key| {
            let line = line_of(text, key)
                .map(|n| format!(":{n}"))
                .unwrap_or_default();
            let hint = closest(key, &known)
                .map(|k| format!(" (did you mean '{k}'?)"))
                .unwrap_or_default();
            bad(
                "config",
                format!("{}{line}: unknown setting '{key}'{hint}", path.display()),
            )
        })
        .collect();
    if !unknown.is_empty() {
        return Err(unknown);
    }
    // Flattened groups lose the position of a value of the wrong type, so
    // each key is tried alone to find the line at fault.
    for (key, value) in &table {
        let alone = toml::Table::from_iter([(key.clone(), value.clone())]);
        if let Err(e) = RunArgs::deserialize(alone) {
            let line = line_of(text, key)
                .map(|n| format!(":{n}"))
                .unwrap_or_default();
            return Err(vec![bad(
                "config",
                format!("{}{line}: {key}: {}", path.display(), e.message().trim()),
            )]);
        }
    }
    RunArgs::deserialize(table).map_err(|e| vec![located(e)])
}

/// Overlays `cli` (where a flag or a variable set the value) on `file`.
fn merge(
    cli: RunArgs,
    file: RunArgs,
    source: impl Fn(&str) -> Option<ValueSource>,
) -> Result<RunArgs, ConfigError> {
    let as_table =
        |config: &RunArgs| toml::Table::try_from(config).map_err(|e| bad("config", e.to_string()));
    let (from_cli, from_file) = (as_table(&cli)?, as_table(&file)?);
    let mut merged = toml::Table::new();
    for key in file_keys() {
        let given = matches!(
            source(&key.replace('-', "_")),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        let value = if key == "kafka-config" {
            let mut entries = from_file.get(&key).cloned();
            if given
                && let (Some(toml::Value::Table(base)), Some(toml::Value::Table(top))) =
                    (&mut entries, from_cli.get(&key))
            {
                base.extend(top.clone());
            }
            entries
        } else if given {
            from_cli.get(&key).cloned()
        } else {
            from_file.get(&key).cloned()
        };
        if let Some(value) = value {
            merged.insert(key, value);
        }
    }
    let mut config: RunArgs = merged
        .try_into()
        .map_err(|e: toml::de::Error| bad("config", e.message().to_string()))?;
    config.config = cli.config;
    config.test_script_pause_ms = cli.test_script_pause_ms;
    config.accept_lost_counts = cli.accept_lost_counts;
    config.dedupe_change = cli.dedupe_change;
    Ok(config)
}

/// The settings file of a command that reads or changes stored counts.
#[derive(Clone, Args)]
pub struct ConfigArg {
    /// TOML file with settings, the one `tally run --config` reads; this command takes the
    /// settings it shares with `tally run` (Redis, prefix, registry waits) from it, under its
    /// flags and TALLY_* variables.
    #[arg(long, env = "TALLY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

impl ConfigArg {
    /// `group`, one of `tally run`'s flag groups as parsed from `matches`,
    /// with the file's value for every flag neither given nor set by its
    /// variable.
    pub fn layer<T>(&self, group: &T, matches: &ArgMatches) -> Result<T, Vec<ConfigError>>
    where
        T: Args + Serialize + DeserializeOwned,
    {
        let from_cli = table(group)?;
        let Some(path) = &self.config else {
            return toml::Value::Table(from_cli)
                .try_into()
                .map_err(|e: toml::de::Error| vec![bad("config", e.message().to_string())]);
        };
        let text = std::fs::read_to_string(path).map_err(|e| {
            vec![bad(
                "config",
                format!("cannot read {}: {e}", path.display()),
            )]
        })?;
        let from_file = table(&parse_file(path, &text)?)?;
        let mut merged = toml::Table::new();
        for arg in T::augment_args(clap::Command::new("tally")).get_arguments() {
            let id = arg.get_id().as_str();
            let key = id.replace('_', "-");
            let given = matches!(
                matches.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            );
            let value = if given {
                from_cli.get(&key)
            } else {
                from_file.get(&key)
            };
            if let Some(value) = value {
                merged.insert(key, value.clone());
            }
        }
        toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| vec![bad("config", e.message().to_string())])
    }
}

/// Settings as a TOML table.
fn table(settings: &impl Serialize) -> Result<toml::Table, Vec<ConfigError>> {
    toml::Table::try_from(settings).map_err(|e| vec![bad("config", e.to_string())])
}

/// The line (1-based) that sets `key`, or opens a table named `key`.
fn line_of(text: &str, key: &str) -> Option<usize> {
    text.lines()
        .position(|line| {
            let line = line.trim_start();
            let bare = line.strip_prefix(key);
            let quoted = line
                .strip_prefix('"')
                .and_then(|l| l.strip_prefix(key))
                .and_then(|l| l.strip_prefix('"'));
            bare.or(quoted)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
                || line.trim_end() == format!("[{key}]")
        })
        .map(|i| i + 1)
}

/// The known key nearest to a misspelt one, when it is close enough.
fn closest<'a>(key: &str, known: &'a [String]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(key, k), k))
        .filter(|&(d, k)| d <= 2.max(k.len() / 4))
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k.as_str())
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layered(file: &str, args: &[&str]) -> Result<RunArgs, Vec<ConfigError>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tally.toml");
        std::fs::write(&path, file).unwrap();
        let command = RunArgs::augment_args(clap::Command::new("tally"))
            .mut_args(|arg| arg.env(None::<&str>));
        let path = path.to_str().unwrap();
        let matches = command
            .try_get_matches_from(["tally", "--config", path].iter().chain(args))
            .unwrap();
        load(&matches)
    }

    #[test]
    fn flags_beat_the_file_which_beats_defaults() {
        let file = "topic = \"from-file\"\nbuckets = 64\nmetrics-addr = \"9464\"\n\n\
                    [kafka-config]\n\"session.timeout.ms\" = 6000\n\"fetch.min.bytes\" = \"1\"\n";
        let config = layered(file, &["--buckets", "32", "-X", "fetch.min.bytes=9"]).unwrap();
        assert_eq!(config.topic, "from-file");
        assert_eq!(config.buckets.buckets, Some(32));
        assert_eq!(config.group, "tally");
        assert_eq!(config.metrics_addr, Some(([127, 0, 0, 1], 9464).into()));
        let mut kafka = config.kafka_config.clone();
        kafka.sort();
        assert_eq!(
            kafka,
            [
                ("fetch.min.bytes".to_string(), "9".to_string()),
                ("session.timeout.ms".to_string(), "6000".to_string())
            ]
        );
        // A flag given at its default value still wins over the file.
        assert_eq!(
            layered(file, &["--buckets", "16"]).unwrap().buckets.buckets,
            Some(16)
        );
    }

    #[test]
    fn schema_ids_come_from_the_file_as_an_array_and_a_flag_replaces_them() {
        let file = "schema-ids = [12, 13]\n";
        assert_eq!(layered(file, &[]).unwrap().schema_ids, [12, 13]);
        assert_eq!(
            layered(file, &["--schema-ids", "20"]).unwrap().schema_ids,
            [20]
        );
        assert!(layered("schema-ids = \"12\"\n", &[]).is_err());
    }

    #[test]
    fn unknown_keys_are_named_with_their_line() {
        let errors = layered("topic = \"t\"\nbukets = 3\n[kafka]\nx = 1\n", &[]).unwrap_err();
        let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[0].ends_with("tally.toml:2: unknown setting 'bukets' (did you mean 'buckets'?)"),
            "{lines:?}"
        );
        assert!(
            lines[1].contains(":3: unknown setting 'kafka'"),
            "{lines:?}"
        );
    }

    #[test]
    fn wrong_types_name_the_line() {
        let errors = layered("topic = \"t\"\nbuckets = \"many\"\n", &[]).unwrap_err();
        let line = errors[0].to_string();
        assert!(line.starts_with("--config: "), "{line}");
        assert!(line.contains("tally.toml:2:"), "{line}");
        assert!(!line.contains('\n'), "{line}");
    }

    #[test]
    fn every_flag_is_a_file_key_except_the_flag_only_ones() {
        let keys = file_keys();
        for key in [
            "brokers",
            "redis",
            "kafka-config",
            "kafka-sasl-password-file",
        ] {
            assert!(keys.contains(&key.to_string()), "{key}");
        }
        assert!(!keys.contains(&"config".to_string()));
        let printed = toml::Table::try_from(RunArgs {
            metrics_addr: Some(([0, 0, 0, 0], 1).into()),
            dead_letter_topic: Some("dlt".into()),
            ..RunArgs::default()
        })
        .unwrap();
        for key in printed.keys() {
            assert!(keys.contains(key), "serde key {key} is not a flag");
        }
    }
}
