//! Deploy assets stay true to the binary: every file under `deploy/` parses,
//! the Grafana dashboard and the alert rules name only metrics tally exports
//! (`tally::infra::metrics::ALL`), the Prometheus rule file and the PrometheusRule
//! carry the same alerts, the shipped settings file is valid, KEDA never scales
//! past the partition count, and `docker compose config` accepts
//! `docker-compose.yml` (with and without the cluster profile).

use std::path::{Path, PathBuf};
use std::process::Command;

use tally::infra::metrics::{ALL, Kind};
use yaml_rust2::{Yaml, YamlLoader};

const COMPOSE_INSTALL: &str = "apt-get update && apt-get install -y docker-compose";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn yaml(path: &Path) -> Vec<Yaml> {
    YamlLoader::load_from_str(&read(path))
        .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()))
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&read(path))
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()))
}

/// Every string under a key named `expr`, anywhere in a YAML tree.
fn yaml_exprs(node: &Yaml, out: &mut Vec<String>) {
    match node {
        Yaml::Hash(map) => {
            for (key, value) in map {
                match (key.as_str(), value.as_str()) {
                    (Some("expr"), Some(expr)) => out.push(expr.to_string()),
                    _ => yaml_exprs(value, out),
                }
            }
        }
        Yaml::Array(items) => items.iter().for_each(|item| yaml_exprs(item, out)),
        _ => {}
    }
}

/// Every string under a key named `expr`, anywhere in a JSON tree.
fn json_exprs(node: &serde_json::Value, out: &mut Vec<String>) {
    match node {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value.as_str()) {
                    ("expr", Some(expr)) => out.push(expr.to_string()),
                    _ => json_exprs(value, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|item| json_exprs(item, out)),
        _ => {}
    }
}

/// The `tally_*` names a PromQL expression mentions.
fn metric_names(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut names = Vec::new();
    let mut i = 0;
    while let Some(found) = expr[i..].find("tally_") {
        let start = i + found;
        let mut end = start;
        while end < bytes.len() && word(bytes[end]) {
            end += 1;
        }
        if start == 0 || !word(bytes[start - 1]) {
            names.push(expr[start..end].to_string());
        }
        i = end.max(start + 1);
    }
    names
}

/// Whether tally exports a series of this name (a histogram's `_bucket`,
/// `_sum` and `_count` included).
fn exported(name: &str) -> bool {
    ALL.iter().any(|&(metric, kind, _)| {
        name == metric
            || (kind == Kind::Histogram
                && ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suffix| name.strip_suffix(suffix) == Some(metric)))
    })
}

fn dashboard_exprs() -> Vec<String> {
    let mut exprs = Vec::new();
    json_exprs(
        &json(&repo().join("deploy/grafana/dashboards/tally.json")),
        &mut exprs,
    );
    exprs
}

fn alert_exprs() -> Vec<String> {
    let mut exprs = Vec::new();
    for file in [
        "deploy/prometheus/alerts.yml",
        "deploy/k8s/prometheusrule.yaml",
    ] {
        for doc in yaml(&repo().join(file)) {
            yaml_exprs(&doc, &mut exprs);
        }
    }
    exprs
}

#[test]
fn every_deploy_file_parses() {
    let mut files = Vec::new();
    files_under(&repo().join("deploy"), &mut files);
    files.push(repo().join("docker-compose.yml"));
    let mut parsed = 0;
    for path in &files {
        match path.extension().and_then(|e| e.to_str()) {
            Some("yml" | "yaml") => {
                assert!(!yaml(path).is_empty(), "{} is empty", path.display());
                parsed += 1;
            }
            Some("json") => {
                json(path);
                parsed += 1;
            }
            _ => {}
        }
    }
    assert!(parsed >= 12, "only {parsed} deploy files found");
}

#[test]
fn dashboards_and_alerts_name_only_exported_metrics() {
    let dashboard = dashboard_exprs();
    let alerts = alert_exprs();
    assert!(dashboard.len() >= 10, "dashboard queries: {dashboard:?}");
    assert!(alerts.len() >= 10, "alert expressions: {alerts:?}");
    for expr in &dashboard {
        assert!(
            !metric_names(expr).is_empty(),
            "{expr:?} names no tally metric"
        );
    }
    for expr in dashboard.iter().chain(&alerts) {
        for name in metric_names(expr) {
            assert!(
                exported(&name),
                "{expr:?} names {name}, which tally does not export (see tally::infra::metrics::ALL)"
            );
        }
    }
    let shown: Vec<String> = dashboard.iter().flat_map(|e| metric_names(e)).collect();
    for needed in [
        "tally_events_total",
        "tally_consumer_lag_messages",
        "tally_apply_seconds_bucket",
        "tally_bad_messages_total",
        "tally_scripts_total",
        "tally_promotions_total",
    ] {
        assert!(
            shown.iter().any(|n| n == needed),
            "the dashboard lacks {needed}"
        );
    }
    assert!(
        dashboard
            .iter()
            .any(|e| e.contains("outcome=\"duplicate\"")),
        "the dashboard lacks fenced duplicates"
    );
}

#[test]
fn the_prometheus_rule_carries_the_rule_file() {
    let file = &yaml(&repo().join("deploy/prometheus/alerts.yml"))[0];
    let rule = &yaml(&repo().join("deploy/k8s/prometheusrule.yaml"))[0];
    assert_eq!(rule["kind"].as_str(), Some("PrometheusRule"));
    assert_eq!(
        rule["spec"]["groups"], file["groups"],
        "deploy/k8s/prometheusrule.yaml and deploy/prometheus/alerts.yml differ"
    );
}

#[test]
fn the_shipped_settings_are_valid() {
    let map = &yaml(&repo().join("deploy/k8s/configmap.yaml"))[0];
    let text = map["data"]["tally.toml"]
        .as_str()
        .expect("the ConfigMap holds tally.toml");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tally.toml");
    std::fs::write(&file, text).unwrap();
    let mut print = Command::new(env!("CARGO_BIN_EXE_tally"));
    for (name, _) in std::env::vars().filter(|(k, _)| k.starts_with("TALLY_")) {
        print.env_remove(name);
    }
    let out = print
        .args(["config", "print", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "the ConfigMap's tally.toml: {stderr}"
    );
}

#[test]
fn keda_never_scales_past_the_partition_count() {
    let scaled = &yaml(&repo().join("deploy/k8s/keda-scaledobject.yaml"))[0];
    let max = scaled["spec"]["maxReplicaCount"]
        .as_i64()
        .expect("maxReplicaCount");
    let compose = read(&repo().join("docker-compose.yml"));
    let at = compose
        .find("--topic likes --partitions ")
        .expect("docker-compose.yml creates the likes topic");
    let partitions: i64 = compose[at + "--topic likes --partitions ".len()..]
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a partition count");
    assert_eq!(max, partitions, "maxReplicaCount must equal the partitions");
}

/// `docker compose` (the plugin) or Debian's `docker-compose`.
fn compose() -> Option<Vec<&'static str>> {
    let works = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .is_ok_and(|out| out.status.success())
    };
    if works("docker", &["compose", "version"]) {
        Some(vec!["docker", "compose"])
    } else if works("docker-compose", &["version"]) {
        Some(vec!["docker-compose"])
    } else {
        None
    }
}

#[test]
fn compose_config_succeeds() {
    let compose = compose().unwrap_or_else(|| {
        panic!("neither `docker compose` nor `docker-compose` is installed; run: {COMPOSE_INSTALL}")
    });
    for profile in [&[][..], &["--profile", "cluster"][..]] {
        let out = Command::new(compose[0])
            .args(&compose[1..])
            .args(profile)
            .args(["config", "--quiet"])
            .current_dir(repo())
            .output()
            .expect("run compose");
        assert!(
            out.status.success(),
            "{} {} config failed:\n{}",
            compose.join(" "),
            profile.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn metric_names_are_found_in_expressions() {
    assert_eq!(
        metric_names("sum(rate(tally_events_total[1m])) / on() tally_x:y"),
        ["tally_events_total", "tally_x:y"]
    );
    assert!(metric_names("up{job=\"tally\"} == 0").is_empty());
    assert!(exported("tally_apply_seconds_count"));
    assert!(!exported("tally_events_total_bucket"));
}
