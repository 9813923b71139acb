//! Show: the effective settings as a `--config` file (`tally config print`),
//! docs/settings.md's table (`tally docs config`), and `Debug`.
//!
//! Invariant: every view of a configuration goes through [`redacted`], which
//! masks passwords (in Redis URLs, the password settings, and `kafka-config`
//! keys that hold secrets), so no view can leak one.

use std::fmt::{self, Write as _};

use clap::Args;

use tally::infra::security::{is_secret_key, redact_url};

use super::RunArgs;
use super::layers::file_keys;

const MASK: &str = "***";

/// The configuration as a TOML table with every secret masked.
pub fn redacted(config: &RunArgs) -> toml::Table {
    let mut table = toml::Table::try_from(config).expect("settings serialize to TOML");
    for (key, value) in table.iter_mut() {
        match (key.as_str(), value) {
            ("redis", toml::Value::String(url)) => *url = redact_url(url),
            ("redis-password" | "kafka-sasl-password", value) => {
                *value = toml::Value::String(MASK.into())
            }
            ("kafka-config", toml::Value::Table(entries)) => {
                for (k, v) in entries.iter_mut() {
                    if is_secret_key(k) {
                        *v = toml::Value::String(MASK.into());
                    }
                }
            }
            _ => {}
        }
    }
    table
}

/// The effective settings as a file `--config` accepts; unset settings are
/// listed as comments and secrets are masked.
pub fn print(config: &RunArgs) -> String {
    let table = redacted(config);
    let mut out = String::from(
        "# tally run: effective settings (flag > TALLY_* variable > --config file > default).\n\
         # Secrets are masked.\n",
    );
    for key in file_keys() {
        match table.get(&key) {
            Some(toml::Value::Table(_)) => {}
            Some(value) => {
                let _ = writeln!(out, "{key} = {value}");
            }
            None => {
                let _ = writeln!(out, "# {key} is unset");
            }
        }
    }
    for (key, value) in &table {
        if let toml::Value::Table(entries) = value {
            let _ = writeln!(out, "\n[{key}]");
            for (k, v) in entries {
                let _ = writeln!(out, "{} = {v}", toml::Value::String(k.clone()));
            }
        }
    }
    out
}

impl fmt::Debug for RunArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(redacted(self)).finish()
    }
}

/// The table of every setting of `tally run` in docs/settings.md: flag (the file key is
/// the flag without `--`), variable, default and meaning.
pub fn settings_table() -> String {
    let command = RunArgs::augment_args(clap::Command::new("tally"));
    let mut table = String::from("| flag | variable | default | meaning |\n|---|---|---|---|\n");
    for arg in command.get_arguments().filter(|a| !a.is_hide_set()) {
        let Some(long) = arg.get_long() else { continue };
        let flag = match arg.get_short() {
            Some(short) => format!("`-{short}`, `--{long}`"),
            None => format!("`--{long}`"),
        };
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let default = if defaults.is_empty() {
            String::new()
        } else {
            format!("`{}`", defaults.join(","))
        };
        let mut meaning = arg.get_help().map(ToString::to_string).unwrap_or_default();
        let values: Vec<String> = arg
            .get_possible_values()
            .iter()
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        // A switch (`--accept-lost-counts`) takes no value: clap still lists
        // true and false as its possible values, which would read as one.
        let switch = !arg.get_action().takes_values();
        if switch {
            let _ = write!(meaning, "; a switch, given without a value");
        } else if !values.is_empty() {
            let _ = write!(meaning, "; one of {}", values.join(", "));
        }
        let _ = writeln!(
            table,
            "| {flag} | {env} | {default} | {} |",
            meaning.replace('|', "\\|")
        );
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret_config() -> RunArgs {
        RunArgs {
            store: super::super::StoreArgs {
                redis: "redis://alice:hunter2@h:6379/".into(),
                redis_password: Some("hunter3".into()),
                ..Default::default()
            },
            kafka_sasl_password: Some("hunter4".into()),
            kafka_config: vec![
                ("ssl.key.password".into(), "hunter5".into()),
                ("session.timeout.ms".into(), "6000".into()),
            ],
            ..RunArgs::default()
        }
    }

    #[test]
    fn no_view_shows_a_secret() {
        let config = secret_config();
        for shown in [
            print(&config),
            format!("{config:?}"),
            format!("{config:#?}"),
        ] {
            assert!(!shown.contains("hunter"), "{shown}");
            assert!(shown.contains("redis://alice:***@h:6379/"), "{shown}");
            assert!(shown.contains("6000"), "{shown}");
        }
    }

    #[test]
    fn print_is_a_file_that_loads_back() {
        let config = RunArgs {
            dead_letter_topic: Some("dlt".into()),
            metrics_addr: Some(([0, 0, 0, 0], 9464).into()),
            kafka_config: vec![("session.timeout.ms".into(), "6000".into())],
            ..RunArgs::default()
        };
        let text = print(&config);
        assert!(text.contains("# kafka-sasl-username is unset"), "{text}");
        let back = super::super::layers::parse_file("x.toml".as_ref(), &text).unwrap();
        assert_eq!(print(&back), text);
    }

    #[test]
    fn the_settings_document_lists_every_setting() {
        let table = settings_table();
        assert!(table.contains("| `--brokers` | `TALLY_BROKERS` | `127.0.0.1:9092` |"));
        assert!(!table.contains("test-script-pause"));
        assert!(
            include_str!("../../../../docs/settings.md").contains(&table),
            "docs/settings.md's table is stale; regenerate it with `tally docs config`"
        );
    }
}
