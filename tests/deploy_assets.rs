//! Deploy assets stay true to the binary: every file under `deploy/` parses,
//! the Grafana dashboard and the alert rules name only metrics tally exports
//! (`tally::infra::metrics::ALL`), the Prometheus rule files and the PrometheusRule
//! carry the same alerts, each with a `for:`, a runbook link and promtool unit
//! tests that fire and that stay quiet (run here with promtool), the dashboard
//! filters by namespace, job and instance and its read and rebuild rows show
//! what `tally serve` and `tally rebuild` export, the rules keep namespaces and jobs
//! apart and name no job, every runbook_url is absolute from one base, the
//! shipped settings file is valid, `kubectl kustomize` renders the base alone
//! and with each combination of the optional components (Strimzi, KEDA, the
//! Prometheus Operator), in one namespace (Strimzi's resources in the Kafka
//! cluster's), with what KEDA and Kubernetes need (no
//! replicas, hashed ConfigMaps, the Kafka cluster, topic and group written
//! once, required secrets, the read path, the replay tools and a running
//! rebuild's scrape, the SASL
//! component; the Strimzi component's topics, its principal's ACLs on the
//! base's names and the Secrets Strimzi writes mounted where tally's settings
//! point), KEDA never scales past the partition count, and `docker
//! compose config` accepts `docker-compose.yml` (with and without the cluster
//! profile, whose Redis nodes keep their data on volumes and whose tally
//! replicas wait for the cluster). The release has one version, Cargo.toml's: the Dockerfile's
//! labels and the kustomization's image tag repeat it, the image is the
//! stripped `dist` build with the OCI labels, and `tally --version` prints it
//! with the git revision; `--log-format json` writes lines a log shipper parses.

use std::path::{Path, PathBuf};
use std::process::Command;

use tally::infra::metrics::{ALL, Kind};
use yaml_rust2::{Yaml, YamlLoader};

const COMPOSE_INSTALL: &str = "apt-get update && apt-get install -y docker-compose";
const PROMTOOL_INSTALL: &str =
    "apt-get update && apt-get install -y --no-install-recommends prometheus";

/// The Prometheus rule files: tally's alerts, and those on Kubernetes objects
/// that only the PrometheusRule carries.
const RULE_FILES: [&str; 2] = [
    "deploy/prometheus/alerts.yml",
    "deploy/prometheus/kubernetes-alerts.yml",
];

/// The PrometheusRule, in the Prometheus Operator's component.
const PROMETHEUS_RULE: &str = "deploy/components/prometheus-operator/prometheusrule.yaml";

/// The optional kustomize components, each needing CRDs a bare cluster lacks, with the kinds
/// it adds. Strimzi's comes first, as its comment asks: KEDA's trigger copies the brokers it
/// rewrites.
const COMPONENTS: [(&str, &[&str]); 3] = [
    ("deploy/components/strimzi", &["KafkaTopic", "KafkaUser"]),
    ("deploy/components/keda", &["ScaledObject"]),
    (
        "deploy/components/prometheus-operator",
        &["ServiceMonitor", "PodMonitor", "PrometheusRule"],
    ),
];

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
    for file in RULE_FILES.iter().chain(&[PROMETHEUS_RULE]) {
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
        "tally_messages_read_total",
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

/// Each dashboard panel's title and the `tally_*` names its queries show.
fn dashboard_panels() -> Vec<(String, Vec<String>)> {
    let dashboard = json(&repo().join("deploy/grafana/dashboards/tally.json"));
    let panels = dashboard["panels"].as_array().expect("panels");
    panels
        .iter()
        .map(|panel| {
            let mut exprs = Vec::new();
            json_exprs(panel, &mut exprs);
            let title = panel["title"].as_str().unwrap_or_default().to_string();
            (title, exprs.iter().flat_map(|e| metric_names(e)).collect())
        })
        .collect()
}

#[test]
fn the_dashboard_filters_by_variables_and_adapts_its_windows() {
    let dashboard = json(&repo().join("deploy/grafana/dashboards/tally.json"));
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    for needed in ["datasource", "namespace", "job", "instance"] {
        assert!(
            variables.contains(&needed),
            "the dashboard lacks the ${needed} variable"
        );
    }
    for expr in dashboard_exprs() {
        let windows = expr.matches('[').count();
        assert_eq!(
            windows,
            expr.matches("[$__rate_interval]").count(),
            "{expr:?}: use [$__rate_interval], not a fixed window"
        );
        let selectors = metric_names(&expr).len();
        for filter in [
            "namespace=~\"$namespace\"",
            "job=~\"$job\"",
            "instance=~\"$instance\"",
        ] {
            assert_eq!(
                expr.matches(filter).count(),
                selectors,
                "{expr:?}: every metric is filtered by {filter}"
            );
        }
    }
}

#[test]
fn the_dashboard_shows_dead_letters_progress_and_rebalances_apart() {
    let panels = dashboard_panels();
    let showing = |metric: &str| {
        panels
            .iter()
            .filter(|(_, names)| names.iter().any(|n| n == metric))
            .collect::<Vec<_>>()
    };
    for metric in [
        "tally_dead_letters_total",
        "tally_applied_offset",
        "tally_rebalances_total",
        "tally_redis_retries_total",
    ] {
        assert!(!showing(metric).is_empty(), "no panel shows {metric}");
    }
    for (title, names) in showing("tally_rebalances_total") {
        assert!(
            names.iter().all(|n| n == "tally_rebalances_total"),
            "panel {title:?} mixes rebalances with {names:?}: they get a panel of their own"
        );
    }
}

/// The dashboard's rows: each row's title with the expressions of the panels under it.
fn dashboard_rows() -> Vec<(String, Vec<String>)> {
    let dashboard = json(&repo().join("deploy/grafana/dashboards/tally.json"));
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"].as_str() == Some("row") {
            rows.push((panel["title"].as_str().unwrap().to_string(), Vec::new()));
        } else if let Some((_, exprs)) = rows.last_mut() {
            json_exprs(panel, exprs);
        }
    }
    rows
}

/// The read path's row shows requests/s, p99 latency, the cache's hit ratio and the fetches
/// to Redis, from metrics `tally serve` exports; the rebuild's row shows what `tally rebuild`
/// exports; the variables list every service's targets.
#[test]
fn the_dashboard_rows_show_what_serve_and_rebuild_export() {
    use tally::infra::metrics::{
        READ_CACHE_HITS, READ_CACHE_MISSES, READ_FETCHES, REBUILD_ONLY, SERVE_ONLY,
    };
    // SERVE_ONLY and what describe_reads registers.
    let serve: Vec<&str> = SERVE_ONLY
        .into_iter()
        .chain([READ_CACHE_HITS, READ_CACHE_MISSES, READ_FETCHES])
        .collect();
    let base = |name: &str| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(name)
            .to_string()
    };
    let rows = dashboard_rows();
    let row = |service: &str| {
        rows.iter()
            .find(|(title, _)| title.contains(service))
            .map(|(_, exprs)| exprs.clone())
            .unwrap_or_else(|| panic!("no row for {service}: {rows:?}"))
    };
    let reads = row("tally serve");
    for expr in &reads {
        for name in metric_names(expr) {
            assert!(
                serve.contains(&base(&name).as_str()),
                "the serve row shows {name}, which tally serve does not export"
            );
        }
    }
    let shows = |exprs: &[String], what: &str, found: &dyn Fn(&str) -> bool| {
        assert!(
            exprs.iter().any(|e| found(e)),
            "the row lacks {what}: {exprs:?}"
        );
    };
    shows(&reads, "requests/s", &|e| {
        e.contains("rate(tally_read_requests_total{")
    });
    shows(&reads, "p99 latency", &|e| {
        e.starts_with("histogram_quantile(0.99") && e.contains("tally_read_request_seconds_bucket")
    });
    shows(&reads, "the cache hit ratio", &|e| {
        e.contains(READ_CACHE_HITS) && e.contains(READ_CACHE_MISSES) && e.contains(" / ")
    });
    shows(&reads, "fetches to Redis", &|e| e.contains(READ_FETCHES));
    let rebuild = row("tally rebuild");
    let shown: Vec<String> = rebuild.iter().flat_map(|e| metric_names(e)).collect();
    for name in REBUILD_ONLY {
        assert!(
            shown.iter().any(|n| n == name),
            "the rebuild row lacks {name}"
        );
    }
    assert!(
        shown.iter().all(|n| REBUILD_ONLY.contains(&n.as_str())),
        "{shown:?}"
    );

    // `tally serve` exports no consumer's series: the variables must list its targets too.
    let dashboard = json(&repo().join("deploy/grafana/dashboards/tally.json"));
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        let Some(query) = variable["query"]["query"].as_str() else {
            continue;
        };
        let names = metric_names(query);
        assert!(
            names.iter().all(|n| n == READ_FETCHES),
            "${}'s values come from {names:?}, not from {READ_FETCHES}, which tally run and tally serve both export",
            variable["name"]
        );
    }
}

#[test]
fn the_prometheus_rule_carries_the_rule_files() {
    let rule = &yaml(&repo().join(PROMETHEUS_RULE))[0];
    assert_eq!(rule["kind"].as_str(), Some("PrometheusRule"));
    let mut groups = Vec::new();
    for file in RULE_FILES {
        let doc = &yaml(&repo().join(file))[0];
        groups.extend(doc["groups"].as_vec().expect("groups").iter().cloned());
    }
    assert_eq!(
        rule["spec"]["groups"],
        Yaml::Array(groups),
        "{PROMETHEUS_RULE} differs from the groups of {RULE_FILES:?}"
    );
    assert!(
        rule["metadata"]["labels"]["release"].as_str().is_some(),
        "the PrometheusRule lacks the `release` label kube-prometheus-stack selects rules by"
    );
}

/// Every alerting rule of the rule files.
fn alert_rules() -> Vec<Yaml> {
    let mut rules = Vec::new();
    for file in RULE_FILES {
        let doc = &yaml(&repo().join(file))[0];
        for group in doc["groups"].as_vec().expect("groups") {
            for rule in group["rules"].as_vec().expect("rules") {
                if rule["alert"].as_str().is_some() {
                    rules.push(rule.clone());
                }
            }
        }
    }
    rules
}

fn alert_name(rule: &Yaml) -> &str {
    rule["alert"].as_str().expect("alert")
}

#[test]
fn every_failure_has_an_alert() {
    let names: Vec<String> = alert_rules()
        .iter()
        .map(|r| alert_name(r).to_string())
        .collect();
    for needed in [
        "TallyLagGrowing",
        "TallyNoProgress",
        "TallyCountsStale",
        "TallyServeErrors",
        "TallyOffsetsSkipped",
        "TallyFenceAhead",
        "TallyPackedHashesOverfull",
        "TallyBadMessages",
        "TallyDeadLettersStuck",
        "TallyApplyErrors",
        "TallyApplySlow",
        "TallyResyncs",
        "TallyDedupeRereadSlow",
        "TallyZombieSuspected",
        "TallyRebalanceStorm",
        "TallyNoPartitionsAssigned",
        "TallyDown",
        "TallyTargetMissing",
        "TallyPodsNotReady",
    ] {
        assert!(
            names.iter().any(|n| n == needed),
            "no alert {needed} in {RULE_FILES:?}"
        );
    }
}

/// The runbooks' base URL, written once: tally-runbooks in deploy/kustomization.yaml.
fn runbook_base() -> String {
    let kustomization = &yaml(&repo().join("deploy/kustomization.yaml"))[0];
    let generator = kustomization["configMapGenerator"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|g| g["name"].as_str() == Some("tally-runbooks"))
        .expect("a tally-runbooks ConfigMap generator");
    let base = generator["literals"]
        .as_vec()
        .unwrap()
        .iter()
        .find_map(|l| l.as_str()?.strip_prefix("base="))
        .expect("tally-runbooks has base=");
    assert!(
        base.starts_with("https://") && !base.contains('#'),
        "the runbook base {base:?} is an absolute URL without an anchor"
    );
    base.to_string()
}

#[test]
fn every_alert_waits_and_links_its_runbook() {
    let base = runbook_base();
    for rule in alert_rules() {
        let name = alert_name(&rule);
        assert!(
            rule["for"].as_str().is_some_and(|f| !f.is_empty()),
            "{name} has no `for:`: one evaluation is not enough to page"
        );
        assert!(
            matches!(
                rule["labels"]["severity"].as_str(),
                Some("warning" | "critical")
            ),
            "{name}: severity must be warning or critical"
        );
        let runbook = format!("{base}#{}", name.to_lowercase());
        assert_eq!(
            rule["annotations"]["runbook_url"].as_str(),
            Some(runbook.as_str()),
            "{name}'s runbook_url"
        );
        for annotation in ["summary", "description"] {
            assert!(
                rule["annotations"][annotation].as_str().is_some(),
                "{name} has no {annotation}"
            );
        }
    }
}

/// Each `by (...)` list of a PromQL expression, and whether an aggregation has none.
fn groupings(expr: &str) -> (Vec<Vec<String>>, bool) {
    let mut lists = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("by (") {
        let after = &rest[at + 4..];
        let end = after.find(')').expect("a closed by (...)");
        lists.push(
            after[..end]
                .split(',')
                .map(|l| l.trim().to_string())
                .collect(),
        );
        rest = &after[end..];
    }
    let bare = ["sum(", "max(", "min(", "avg(", "count(", "group("]
        .iter()
        .any(|op| {
            expr.match_indices(op).any(|(i, _)| {
                i == 0
                    || !expr.as_bytes()[i - 1].is_ascii_alphanumeric()
                        && expr.as_bytes()[i - 1] != b'_'
            })
        });
    (lists, bare)
}

/// Staging and production in one Prometheus: an aggregation over both would let one hide the
/// other, and a job name in a rule breaks as soon as a ServiceMonitor or scrape config names
/// the job otherwise.
#[test]
fn rules_keep_namespaces_and_jobs_apart_and_name_no_job() {
    for rule in alert_rules() {
        let name = alert_name(&rule);
        let expr = rule["expr"].as_str().expect("expr");
        assert!(
            !expr.contains("job=") && !expr.contains("job =~") && !expr.contains("job=~"),
            "{name} names a job: {expr}"
        );
        let (lists, bare) = groupings(expr);
        assert!(
            !bare,
            "{name} aggregates without `by (namespace, job)`: {expr}"
        );
        for list in lists {
            for needed in ["namespace", "job"] {
                assert!(
                    list.iter().any(|l| l == needed),
                    "{name} aggregates by {list:?}, without {needed}: {expr}"
                );
            }
        }
    }
    assert_eq!(
        groupings("sum by (namespace, job) (rate(x[5m])) / sum(y) unless max_over_time(z[1d])"),
        (vec![vec!["namespace".to_string(), "job".to_string()]], true)
    );
}

/// The promtool unit-test files, `deploy/prometheus/tests/*.yml`.
fn promtool_tests() -> Vec<PathBuf> {
    let mut files = Vec::new();
    files_under(&repo().join("deploy/prometheus/tests"), &mut files);
    files.retain(|f| f.extension().is_some_and(|e| e == "yml"));
    files.sort();
    files
}

#[test]
fn every_alert_has_unit_tests_that_fire_and_that_stay_quiet() {
    let mut fires = std::collections::BTreeSet::new();
    let mut quiet = std::collections::BTreeSet::new();
    for file in promtool_tests() {
        let doc = &yaml(&file)[0];
        for rule_file in doc["rule_files"].as_vec().expect("rule_files") {
            let path = file.parent().unwrap().join(rule_file.as_str().unwrap());
            assert!(path.exists(), "{}: no {}", file.display(), path.display());
        }
        for case in doc["tests"].as_vec().expect("tests") {
            for input in case["input_series"].as_vec().into_iter().flatten() {
                let series = input["series"].as_str().expect("series");
                for name in metric_names(series) {
                    assert!(
                        exported(&name),
                        "{}: {series} is not a series tally exports",
                        file.display()
                    );
                }
            }
            for check in case["alert_rule_test"].as_vec().into_iter().flatten() {
                let name = check["alertname"].as_str().expect("alertname").to_string();
                match check["exp_alerts"].as_vec() {
                    Some(alerts) if !alerts.is_empty() => fires.insert(name),
                    _ => quiet.insert(name),
                };
            }
        }
    }
    for rule in alert_rules() {
        let name = alert_name(&rule);
        assert!(
            fires.contains(name),
            "no promtool test in deploy/prometheus/tests shows {name} firing"
        );
        assert!(
            quiet.contains(name),
            "no promtool test in deploy/prometheus/tests shows {name} staying quiet"
        );
    }
}

#[test]
fn promtool_checks_and_tests_the_rules() {
    let found = Command::new("promtool").arg("--version").output();
    if !found.is_ok_and(|out| out.status.success()) {
        panic!("promtool is not installed; run: {PROMTOOL_INSTALL}");
    }
    let tests = promtool_tests();
    assert!(!tests.is_empty(), "no deploy/prometheus/tests/*.yml");
    // The dashboard's queries, as recording rules, so that promtool parses them too.
    let dir = tempfile::tempdir().unwrap();
    let queries = dir.path().join("dashboard-queries.yml");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in dashboard_exprs().iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "1m")
            .replace("$namespace", ".*")
            .replace("$job", ".*")
            .replace("$instance", ".*");
        rules += &format!("      - record: dashboard:query{i}\n        expr: {expr:?}\n");
    }
    std::fs::write(&queries, rules).unwrap();
    let mut checked: Vec<PathBuf> = RULE_FILES.iter().map(PathBuf::from).collect();
    checked.push(queries);
    for (what, files) in [("check", checked), ("test", tests)] {
        let out = Command::new("promtool")
            .args([what, "rules"])
            .args(&files)
            .current_dir(repo())
            .output()
            .expect("run promtool");
        assert!(
            out.status.success(),
            "promtool {what} rules failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_shipped_settings_are_valid() {
    let text = read(&repo().join("deploy/k8s/tally.toml"));
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
    let scaled = &yaml(&repo().join("deploy/components/keda/scaledobject.yaml"))[0];
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

const KUSTOMIZE_INSTALL: &str = "kubectl 1.27 or later (kustomize v5 built in), or a standalone kustomize v5: Debian's kubernetes-client is too old for components and replacements";

/// The manifests `kubectl kustomize` (or `kustomize build`) renders from `dir`.
fn kustomize(dir: &Path) -> Vec<Yaml> {
    let attempts: [(&str, &[&str]); 2] = [("kustomize", &["build"]), ("kubectl", &["kustomize"])];
    for (program, args) in attempts {
        let Ok(out) = Command::new(program).args(args).arg(dir).output() else {
            continue;
        };
        assert!(
            out.status.success(),
            "{program} {} {} failed:\n{}",
            args.join(" "),
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        return YamlLoader::load_from_str(&String::from_utf8_lossy(&out.stdout))
            .expect("kustomize prints YAML");
    }
    panic!("neither kustomize nor kubectl is installed; install {KUSTOMIZE_INSTALL}");
}

fn of_kind<'a>(docs: &'a [Yaml], kind: &str) -> Vec<&'a Yaml> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect()
}

fn one_of_kind<'a>(docs: &'a [Yaml], kind: &str) -> &'a Yaml {
    match of_kind(docs, kind)[..] {
        [doc] => doc,
        ref found => panic!("{} {kind} manifests rendered, not one", found.len()),
    }
}

/// The ConfigMap kustomize generated from `name` (with its hash suffix).
fn generated<'a>(docs: &'a [Yaml], name: &str) -> &'a Yaml {
    of_kind(docs, "ConfigMap")
        .into_iter()
        .find(|m| {
            let full = m["metadata"]["name"].as_str().unwrap_or_default();
            full.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|hash| hash.len() == 10)
        })
        .unwrap_or_else(|| panic!("no ConfigMap {name}-<hash> generated"))
}

fn container(deployment: &Yaml) -> &Yaml {
    &deployment["spec"]["template"]["spec"]["containers"][0]
}

/// A container's variable: its `valueFrom` source.
fn env_from<'a>(container: &'a Yaml, name: &str) -> &'a Yaml {
    let env = container["env"].as_vec().expect("env");
    let var = env
        .iter()
        .find(|v| v["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no variable {name}"));
    &var["valueFrom"]
}

/// `deploy/` with these components (paths under the repository), through an overlay of its
/// own beside `deploy/` (kustomize refuses one inside the root it builds); `extra` is added to
/// the overlay's kustomization.
fn render(components: &[&str], extra: &str) -> Vec<Yaml> {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(repo().join("deploy"), dir.path().join("deploy")).unwrap();
    let overlay = dir.path().join("overlay");
    std::fs::create_dir(&overlay).unwrap();
    let components: Vec<String> = components.iter().map(|c| format!("../{c}")).collect();
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "resources: [../deploy]\ncomponents: [{}]\n{extra}",
            components.join(", ")
        ),
    )
    .unwrap();
    kustomize(&overlay)
}

/// A bare cluster applies the base; each component adds only its own CRDs' kinds, alone or
/// together, and everything lands in one namespace.
#[test]
fn kustomize_renders_the_base_and_every_component_combination() {
    let base = kustomize(&repo().join("deploy"));
    for combination in 0..1 << COMPONENTS.len() {
        let chosen: Vec<(&str, &[&str])> = COMPONENTS
            .iter()
            .enumerate()
            .filter(|(i, _)| combination & (1 << i) != 0)
            .map(|(_, c)| *c)
            .collect();
        let paths: Vec<&str> = chosen.iter().map(|(path, _)| *path).collect();
        let docs = render(&paths, "");
        for (path, kinds) in COMPONENTS {
            for kind in kinds {
                assert_eq!(
                    of_kind(&docs, kind).is_empty(),
                    !paths.contains(&path),
                    "{kind} is rendered exactly when {path} is chosen ({paths:?})"
                );
            }
        }
        let core: Vec<&Yaml> = docs
            .iter()
            .filter(|d| {
                !chosen
                    .iter()
                    .any(|(_, kinds)| kinds.contains(&d["kind"].as_str().unwrap()))
            })
            .collect();
        assert_eq!(
            core.len(),
            base.len(),
            "{paths:?} changes the base's objects"
        );
        let namespace = one_of_kind(&docs, "Namespace")["metadata"]["name"].clone();
        // Strimzi's operators watch the Kafka cluster's namespace, not tally's.
        let kafka_namespace = Yaml::String(strimzi_setting("namespace"));
        for doc in &docs {
            if doc["kind"].as_str() != Some("Namespace") {
                let expected = if is_strimzi(doc) {
                    &kafka_namespace
                } else {
                    &namespace
                };
                assert_eq!(
                    &doc["metadata"]["namespace"], expected,
                    "{:?} {:?} is not in its namespace",
                    doc["kind"], doc["metadata"]["name"]
                );
            }
            for local in ["tally-runbooks", "tally-strimzi"] {
                assert!(
                    doc["metadata"]["name"].as_str() != Some(local),
                    "{local} is local-config: it is read, not applied"
                );
            }
        }
        if paths.contains(&"deploy/components/keda") {
            let kafka = generated(&docs, "tally-kafka");
            let trigger = &one_of_kind(&docs, "ScaledObject")["spec"]["triggers"][0]["metadata"];
            assert_eq!(
                trigger["bootstrapServers"], kafka["data"]["brokers"],
                "KEDA watches the brokers the pods consume from ({paths:?})"
            );
        }
    }
}

/// Whether a rendered object is one of Strimzi's custom resources.
fn is_strimzi(doc: &Yaml) -> bool {
    doc["apiVersion"]
        .as_str()
        .is_some_and(|v| v.starts_with("kafka.strimzi.io/"))
}

/// A literal of the base's tally-strimzi (the cluster components/strimzi fits tally to).
fn strimzi_setting(key: &str) -> String {
    let kustomization = &yaml(&repo().join("deploy/kustomization.yaml"))[0];
    kustomization["configMapGenerator"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|g| g["name"].as_str() == Some("tally-strimzi"))
        .expect("a tally-strimzi generator in deploy/kustomization.yaml")["literals"]
        .as_vec()
        .unwrap()
        .iter()
        .find_map(|l| l.as_str()?.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("tally-strimzi has no {key}"))
        .to_string()
}

/// The Strimzi component: the like and dead-letter topics as the contract wants them, a principal
/// allowed exactly what tally does on the base's topic, group and dead-letter topic, and the pods
/// that read Kafka mounting the Secrets Strimzi writes, under the key names Strimzi gives them,
/// where tally's settings (which `tally config print` accepts) point. The cluster's name and
/// namespace, set once in an overlay, reach everything that names them.
#[test]
fn kustomize_renders_the_strimzi_component() {
    let component = ["deploy/components/strimzi"];
    let default = render(&component, "");
    check_strimzi(
        &default,
        &strimzi_setting("cluster"),
        &strimzi_setting("namespace"),
    );
    let moved = render(
        &component,
        "configMapGenerator:\n  - name: tally-strimzi\n    behavior: merge\n    literals: [cluster=prod, namespace=kafka-prod]\n",
    );
    check_strimzi(&moved, "prod", "kafka-prod");
}

fn check_strimzi(docs: &[Yaml], cluster: &str, namespace: &str) {
    let kafka = generated(docs, "tally-kafka");
    let data = |key: &str| kafka["data"][key].as_str().unwrap().to_string();
    assert_eq!(
        data("brokers"),
        format!("{cluster}-kafka-bootstrap.{namespace}.svc:9093"),
        "the brokers are the cluster's TLS bootstrap"
    );
    let toml = read(&repo().join("deploy/k8s/tally.toml"));
    let dead_letter = toml
        .lines()
        .find_map(|l| l.strip_prefix("dead-letter-topic = "))
        .expect("tally.toml's dead-letter-topic")
        .trim_matches('"')
        .to_string();
    for doc in docs.iter().filter(|d| is_strimzi(d)) {
        assert_eq!(doc["apiVersion"].as_str(), Some("kafka.strimzi.io/v1beta2"));
        assert_eq!(
            doc["metadata"]["labels"]["strimzi.io/cluster"].as_str(),
            Some(cluster),
            "{:?}'s strimzi.io/cluster label",
            doc["metadata"]["name"]
        );
        assert_eq!(doc["metadata"]["namespace"].as_str(), Some(namespace));
    }

    // The topics: deleted by time, never compacted; the like topic kept for rebuilds.
    let topics = of_kind(docs, "KafkaTopic");
    let topic = |name: &str| {
        *topics
            .iter()
            .find(|t| t["spec"]["topicName"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no KafkaTopic for {name}"))
    };
    let likes = topic(&data("topic"));
    for t in [likes, topic(&dead_letter)] {
        assert_eq!(
            t["spec"]["config"]["cleanup.policy"].as_str(),
            Some("delete"),
            "never compact (docs/contract.md)"
        );
        assert!(t["spec"]["replicas"].as_i64().unwrap() >= 3);
        assert_eq!(t["spec"]["config"]["min.insync.replicas"].as_i64(), Some(2));
    }
    assert_eq!(
        likes["spec"]["config"]["retention.ms"].as_i64(),
        Some(-1),
        "the like topic keeps every event, for rebuilds (docs/contract.md)"
    );
    let scaled = &yaml(&repo().join("deploy/components/keda/scaledobject.yaml"))[0];
    assert_eq!(
        likes["spec"]["partitions"].as_i64(),
        scaled["spec"]["maxReplicaCount"].as_i64(),
        "KEDA scales up to the partition count"
    );

    // The principal: SCRAM-SHA-512, and exactly tally's ACLs on the base's names.
    let user = one_of_kind(docs, "KafkaUser");
    let user_name = user["metadata"]["name"].as_str().unwrap();
    assert_eq!(
        user["spec"]["authentication"]["type"].as_str(),
        Some("scram-sha-512")
    );
    assert_eq!(
        user["spec"]["authorization"]["type"].as_str(),
        Some("simple")
    );
    let acls = user["spec"]["authorization"]["acls"]
        .as_vec()
        .expect("acls");
    let allows = |kind: &str, name: &str, operation: &str| {
        acls.iter().any(|acl| {
            let resource = &acl["resource"];
            let named = match resource["patternType"].as_str() {
                Some("prefix") => name.starts_with(resource["name"].as_str().unwrap()),
                _ => resource["name"].as_str() == Some(name),
            };
            resource["type"].as_str() == Some(kind)
                && named
                && acl["operations"]
                    .as_vec()
                    .unwrap()
                    .iter()
                    .any(|o| o.as_str() == Some(operation))
        })
    };
    let group = data("group");
    for (kind, name, operation) in [
        ("topic", data("topic"), "Read"),
        ("topic", data("topic"), "DescribeConfigs"),
        ("group", group.clone(), "Read"),
        ("group", format!("{group}-rebuild-g1-1700000000000"), "Read"),
        ("group", format!("{group}-verify"), "Read"),
        ("topic", dead_letter.clone(), "Write"),
    ] {
        assert!(
            allows(kind, &name, operation),
            "no {operation} on {kind} {name}"
        );
    }
    for acl in acls {
        assert!(acl["type"].as_str().is_none_or(|t| t == "allow"), "{acl:?}");
        assert_ne!(acl["resource"]["type"].as_str(), Some("cluster"), "{acl:?}");
        for operation in acl["operations"].as_vec().unwrap() {
            assert!(
                ["Read", "Write", "Describe", "DescribeConfigs"]
                    .contains(&operation.as_str().unwrap()),
                "tally needs no {operation:?} (docs/security.md#kafka-acls)"
            );
        }
    }
    assert!(
        !allows("topic", &data("topic"), "Write") && !allows("topic", &dead_letter, "Read"),
        "tally writes only the dead-letter topic and reads only the like topic"
    );

    // Every pod that reads Kafka logs in with the Secrets Strimzi writes.
    let settings = read(&repo().join("docs/settings.md"));
    let deployment = of_kind(docs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"].as_str() == Some("tally"))
        .expect("the tally Deployment");
    let mut pods = vec![("tally", &deployment["spec"]["template"]["spec"])];
    for job in of_kind(docs, "CronJob") {
        let name = job["metadata"]["name"].as_str().unwrap();
        if name != "tally-gc" {
            pods.push((
                name,
                &job["spec"]["jobTemplate"]["spec"]["template"]["spec"],
            ));
        }
    }
    assert_eq!(pods.len(), 3, "tally, tally-rebuild and tally-verify");
    for (name, pod) in pods {
        let tally = &pod["containers"][0];
        let value = |var: &str| {
            tally["env"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|v| v["name"].as_str() == Some(var))
                .and_then(|v| v["value"].as_str())
                .unwrap_or_else(|| panic!("{name}: no {var}"))
                .to_string()
        };
        assert_eq!(value("TALLY_KAFKA_SECURITY_PROTOCOL"), "sasl_ssl", "{name}");
        assert_eq!(
            value("TALLY_KAFKA_SASL_MECHANISM"),
            "SCRAM-SHA-512",
            "{name}"
        );
        assert_eq!(value("TALLY_KAFKA_SASL_USERNAME"), user_name, "{name}");
        // The file a variable names comes from this Secret's key, through a volume.
        let mounted = |var: &str, secret: &str, key: &str| {
            let path = value(var);
            let volume = pod["volumes"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|v| v["secret"]["secretName"].as_str() == Some(secret))
                .unwrap_or_else(|| panic!("{name}: no volume of the Secret {secret}"));
            assert_ne!(
                volume["secret"]["optional"].as_bool(),
                Some(true),
                "{name}: {secret} is required"
            );
            let item = volume["secret"]["items"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|i| i["key"].as_str() == Some(key))
                .unwrap_or_else(|| panic!("{name}: {secret}'s key {key} is not mounted"));
            let mount = tally["volumeMounts"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|m| m["name"] == volume["name"])
                .unwrap_or_else(|| panic!("{name}: {secret}'s volume is not mounted"));
            assert_eq!(
                path,
                format!(
                    "{}/{}",
                    mount["mountPath"].as_str().unwrap(),
                    item["path"].as_str().unwrap()
                ),
                "{name}: {var}"
            );
            path
        };
        let ca = mounted(
            "TALLY_KAFKA_SSL_CA_LOCATION",
            &format!("{cluster}-cluster-ca-cert"),
            "ca.crt",
        );
        let password = mounted("TALLY_KAFKA_SASL_PASSWORD_FILE", user_name, "password");

        // tally takes these settings: the variables exist, and with the files in place
        // `tally config print` finds no problem.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("password"), "from-strimzi").unwrap();
        std::fs::write(dir.path().join("ca.crt"), "-----BEGIN CERTIFICATE-----\n").unwrap();
        let mut print = Command::new(env!("CARGO_BIN_EXE_tally"));
        for (var, _) in std::env::vars().filter(|(k, _)| k.starts_with("TALLY_")) {
            print.env_remove(var);
        }
        for var in tally["env"].as_vec().unwrap() {
            let (Some(var), Some(mut value)) = (var["name"].as_str(), var["value"].as_str()) else {
                continue;
            };
            assert!(
                var == "TALLY_CONFIG" || settings.contains(&format!("`{var}`")),
                "{name}: {var} is no setting of docs/settings.md"
            );
            let local_password = dir.path().join("password");
            let local_ca = dir.path().join("ca.crt");
            if value == password {
                value = local_password.to_str().unwrap();
            } else if value == ca {
                value = local_ca.to_str().unwrap();
            } else if var == "TALLY_CONFIG" {
                continue;
            }
            print.env(var, value);
        }
        let out = print.args(["config", "print"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "{name}'s Kafka settings: {stderr}"
        );
    }
}

/// The runbooks' base, set once in an overlay, reaches every rule of the PrometheusRule.
#[test]
fn kustomize_writes_the_runbook_base_into_every_rule() {
    let base = "https://git.example.org/ops/tally/blob/v9/docs/operations.md";
    let docs = render(
        &["deploy/components/prometheus-operator"],
        &format!(
            "configMapGenerator:\n  - name: tally-runbooks\n    behavior: merge\n    literals: [base={base}]\n"
        ),
    );
    let rule = one_of_kind(&docs, "PrometheusRule");
    let mut alerts = 0;
    for group in rule["spec"]["groups"].as_vec().expect("groups") {
        for rule in group["rules"].as_vec().expect("rules") {
            let name = alert_name(rule);
            assert_eq!(
                rule["annotations"]["runbook_url"].as_str(),
                Some(format!("{base}#{}", name.to_lowercase()).as_str()),
                "{name}'s runbook_url"
            );
            alerts += 1;
        }
    }
    assert_eq!(alerts, alert_rules().len());
    let default = render(&["deploy/components/prometheus-operator"], "");
    let rule = one_of_kind(&default, "PrometheusRule");
    let url = rule["spec"]["groups"][0]["rules"][0]["annotations"]["runbook_url"]
        .as_str()
        .unwrap();
    assert!(url.starts_with(&format!("{}#", runbook_base())), "{url}");
}

/// The read path and the replay tools share the consumers' settings; rebuild and verify run
/// only when started, gc on its schedule.
#[test]
fn kustomize_renders_the_read_path_and_the_replay_tools() {
    let docs = render(&["deploy/components/prometheus-operator"], "");
    let config = generated(&docs, "tally-config");
    let deployments = of_kind(&docs, "Deployment");
    let serve = deployments
        .iter()
        .find(|d| d["metadata"]["name"].as_str() == Some("tally-serve"))
        .expect("a tally-serve Deployment");
    let consumers = deployments
        .iter()
        .find(|d| d["metadata"]["name"].as_str() == Some("tally"))
        .expect("a tally Deployment");
    let serve_labels = &serve["spec"]["template"]["metadata"]["labels"];
    let consumer_selector = consumers["spec"]["selector"]["matchLabels"]
        .as_hash()
        .unwrap();
    assert!(
        !consumer_selector
            .iter()
            .all(|(k, v)| &serve_labels[k.as_str().unwrap()] == v),
        "the consumers' selector also selects the serve pods"
    );
    let container = container(serve);
    assert_eq!(container["args"][0].as_str(), Some("serve"));
    assert!(
        container["env"]
            .as_vec()
            .unwrap()
            .iter()
            .any(|v| v["name"].as_str() == Some("TALLY_LISTEN")
                && v["value"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("0.0.0.0:"))),
        "serve listens beyond loopback in its pod"
    );
    assert_eq!(
        serve["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"],
        config["metadata"]["name"]
    );
    let services = of_kind(&docs, "Service");
    let service = services
        .iter()
        .find(|s| s["spec"]["selector"] == serve["spec"]["selector"]["matchLabels"])
        .expect("a Service for tally serve");
    let monitors = of_kind(&docs, "ServiceMonitor");
    assert!(
        monitors.iter().any(|m| m["spec"]["selector"]["matchLabels"]
            == service["metadata"]["labels"]
            || m["spec"]["selector"]["matchLabels"] == serve["spec"]["selector"]["matchLabels"]),
        "no ServiceMonitor scrapes tally serve"
    );
    for monitor in &monitors {
        assert!(
            monitor["metadata"]["labels"]["release"].as_str().is_some(),
            "the ServiceMonitors carry the `release` label kube-prometheus-stack selects by"
        );
    }
    // A running rebuild serves its progress, and a PodMonitor scrapes it.
    let cronjobs = of_kind(&docs, "CronJob");
    let rebuild = cronjobs
        .iter()
        .find(|j| j["metadata"]["name"].as_str() == Some("tally-rebuild"))
        .expect("no CronJob tally-rebuild");
    let pod = &rebuild["spec"]["jobTemplate"]["spec"]["template"];
    let monitor = one_of_kind(&docs, "PodMonitor");
    assert!(monitor["metadata"]["labels"]["release"].as_str().is_some());
    assert_eq!(
        monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        pod["metadata"]["labels"]["app.kubernetes.io/name"],
        "the PodMonitor selects the rebuild's pods"
    );
    let port_name = &monitor["spec"]["podMetricsEndpoints"][0]["port"];
    let tally = &pod["spec"]["containers"][0];
    let port = tally["ports"]
        .as_vec()
        .expect("the rebuild's ports")
        .iter()
        .find(|p| &p["name"] == port_name)
        .expect("the port the PodMonitor scrapes");
    let addr = tally["env"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|v| v["name"].as_str() == Some("TALLY_METRICS_ADDR"))
        .and_then(|v| v["value"].as_str())
        .expect("the rebuild's TALLY_METRICS_ADDR");
    assert_eq!(
        addr,
        format!("0.0.0.0:{}", port["containerPort"].as_i64().unwrap()),
        "the rebuild listens beyond loopback, on the port scraped"
    );
    for (command, suspended) in [("rebuild", true), ("verify", true), ("gc", false)] {
        let job = cronjobs
            .iter()
            .find(|j| j["metadata"]["name"].as_str() == Some(&format!("tally-{command}")))
            .unwrap_or_else(|| panic!("no CronJob tally-{command}"));
        assert_eq!(
            job["spec"]["suspend"].as_bool().unwrap_or(false),
            suspended,
            "tally-{command}'s suspend"
        );
        let pod = &job["spec"]["jobTemplate"]["spec"]["template"]["spec"];
        assert_eq!(pod["containers"][0]["args"][0].as_str(), Some(command));
        assert_eq!(
            pod["volumes"][0]["configMap"]["name"],
            config["metadata"]["name"]
        );
        assert_eq!(pod["restartPolicy"].as_str(), Some("Never"));
    }
}

#[test]
fn kustomize_renders_what_kubernetes_and_keda_need() {
    let docs = render(
        &[
            "deploy/components/keda",
            "deploy/components/prometheus-operator",
        ],
        "",
    );
    let deployment = of_kind(&docs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"].as_str() == Some("tally"))
        .expect("the tally Deployment");
    assert!(
        deployment["spec"]["replicas"].is_badvalue(),
        "the Deployment sets replicas: every apply would reset KEDA's count"
    );
    let pod = &deployment["spec"]["template"]["spec"];
    let spread: Vec<&str> = pod["topologySpreadConstraints"]
        .as_vec()
        .expect("the Deployment spreads its pods")
        .iter()
        .filter_map(|c| c["topologyKey"].as_str())
        .collect();
    assert!(
        spread.contains(&"kubernetes.io/hostname")
            && spread.contains(&"topology.kubernetes.io/zone"),
        "topology spread over nodes and zones: {spread:?}"
    );
    let tally = container(deployment);
    let kustomization = &yaml(&repo().join("deploy/kustomization.yaml"))[0];
    let image = &kustomization["images"][0];
    assert_eq!(image["name"].as_str(), Some("tally"), "an images: override");
    assert_eq!(
        tally["image"].as_str().map(String::from),
        Some(format!(
            "{}:{}",
            image["newName"].as_str().unwrap(),
            image["newTag"].as_str().unwrap()
        )),
        "the container's image comes from the kustomization's images:"
    );

    // Settings from generated ConfigMaps, whose hashed names roll the pods on an edit.
    let config = generated(&docs, "tally-config");
    let volume = &pod["volumes"][0]["configMap"]["name"];
    assert_eq!(volume, &config["metadata"]["name"], "tally.toml's volume");
    let kafka = generated(&docs, "tally-kafka");
    for (var, key) in [
        ("TALLY_BROKERS", "brokers"),
        ("TALLY_TOPIC", "topic"),
        ("TALLY_GROUP", "group"),
    ] {
        let source = &env_from(tally, var)["configMapKeyRef"];
        assert_eq!(source["name"], kafka["metadata"]["name"], "{var}");
        assert_eq!(source["key"].as_str(), Some(key), "{var}");
    }
    // KEDA watches the lag of the group tally consumes in.
    let scaled = one_of_kind(&docs, "ScaledObject");
    let trigger = &scaled["spec"]["triggers"][0]["metadata"];
    for (field, key) in [
        ("bootstrapServers", "brokers"),
        ("topic", "topic"),
        ("consumerGroup", "group"),
    ] {
        assert_eq!(
            trigger[field], kafka["data"][key],
            "the KEDA trigger's {field}"
        );
    }

    // Secrets an auth mode needs are required.
    let password = &env_from(tally, "TALLY_REDIS_PASSWORD")["secretKeyRef"];
    assert!(
        password["optional"].as_bool() != Some(true),
        "the Redis URL names a user: its password is not optional"
    );
    let pdb = one_of_kind(&docs, "PodDisruptionBudget");
    assert_eq!(
        pdb["spec"]["unhealthyPodEvictionPolicy"].as_str(),
        Some("AlwaysAllow"),
        "pods made unready by a Redis outage must not block node drains"
    );
    for kind in ["ServiceMonitor", "PrometheusRule"] {
        for object in of_kind(&docs, kind) {
            assert!(
                object["metadata"]["labels"]["release"].as_str().is_some(),
                "the {kind} lacks the `release` label kube-prometheus-stack selects by"
            );
        }
    }
}

#[test]
fn kustomize_renders_the_sasl_component() {
    // An overlay beside deploy/ (kustomize refuses one inside the root it builds).
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("deploy");
    std::os::unix::fs::symlink(repo().join("deploy"), &link).unwrap();
    let overlay = dir.path().join("overlay");
    std::fs::create_dir(&overlay).unwrap();
    std::fs::write(
        overlay.join("kustomization.yaml"),
        "resources: [../deploy]\ncomponents: [../deploy/components/keda, ../deploy/k8s/sasl]\n",
    )
    .unwrap();
    let docs = kustomize(&overlay);
    let deployment = of_kind(&docs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"].as_str() == Some("tally"))
        .expect("the tally Deployment");
    let tally = container(deployment);
    let password = &env_from(tally, "TALLY_KAFKA_SASL_PASSWORD")["secretKeyRef"];
    assert_eq!(password["name"].as_str(), Some("tally-secrets"));
    assert!(
        password["optional"].as_bool() != Some(true),
        "with SASL on, the Kafka password is not optional"
    );
    let auth = one_of_kind(&docs, "TriggerAuthentication");
    let trigger = &one_of_kind(&docs, "ScaledObject")["spec"]["triggers"][0];
    assert_eq!(
        trigger["authenticationRef"]["name"], auth["metadata"]["name"],
        "the KEDA trigger logs in with the TriggerAuthentication"
    );
    assert_eq!(trigger["metadata"]["sasl"].as_str(), Some("scram_sha512"));
    // KEDA reads lag as a principal of its own, which may only look.
    let refs = auth["spec"]["secretTargetRef"]
        .as_vec()
        .expect("secretTargetRef");
    for parameter in ["username", "password"] {
        let from = refs
            .iter()
            .find(|r| r["parameter"].as_str() == Some(parameter))
            .unwrap_or_else(|| panic!("the TriggerAuthentication gives KEDA's {parameter}"));
        assert_ne!(
            from["name"].as_str(),
            Some("tally-secrets"),
            "KEDA's {parameter} is not tally's"
        );
    }
}

#[test]
fn the_kafka_cluster_topic_and_group_are_written_once() {
    let kustomization = &yaml(&repo().join("deploy/kustomization.yaml"))[0];
    let generators = kustomization["configMapGenerator"].as_vec().unwrap();
    let kafka = generators
        .iter()
        .find(|g| g["name"].as_str() == Some("tally-kafka"))
        .expect("a tally-kafka ConfigMap generator");
    let literals: Vec<&str> = kafka["literals"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    let brokers = literals
        .iter()
        .find_map(|l| l.strip_prefix("brokers="))
        .expect("brokers=");
    let mut files = Vec::new();
    files_under(&repo().join("deploy/k8s"), &mut files);
    files_under(&repo().join("deploy/components"), &mut files);
    let mut seen = Vec::new();
    for file in &files {
        let text = read(file);
        if text.contains(brokers) {
            seen.push(file.display().to_string());
        }
        if file.extension().is_some_and(|e| e == "toml") {
            for line in text.lines() {
                let key = line.split('=').next().unwrap_or_default().trim();
                assert!(
                    !["brokers", "topic", "group"].contains(&key),
                    "{}: {key} belongs in tally-kafka (deploy/kustomization.yaml)",
                    file.display()
                );
            }
        }
    }
    assert!(
        seen.is_empty(),
        "{brokers} is written again in {seen:?}: it belongs in tally-kafka only"
    );
    let scaled = &yaml(&repo().join("deploy/components/keda/scaledobject.yaml"))[0];
    let trigger = &scaled["spec"]["triggers"][0]["metadata"];
    for (field, key) in [
        ("bootstrapServers", "brokers"),
        ("topic", "topic"),
        ("consumerGroup", "group"),
    ] {
        let value = literals
            .iter()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("tally-kafka has no {key}"));
        assert_ne!(
            trigger[field].as_str(),
            Some(value),
            "scaledobject.yaml writes {field} itself: components/keda's replacements fill it"
        );
    }
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

/// `docker-compose.yml` as compose resolves it (anchors and merges applied).
fn compose_resolved(profile: &[&str]) -> Yaml {
    let compose = compose().unwrap_or_else(|| {
        panic!("neither `docker compose` nor `docker-compose` is installed; run: {COMPOSE_INSTALL}")
    });
    let out = Command::new(compose[0])
        .args(&compose[1..])
        .args(profile)
        .arg("config")
        .current_dir(repo())
        .output()
        .expect("run compose");
    assert!(out.status.success(), "compose config failed");
    YamlLoader::load_from_str(&String::from_utf8_lossy(&out.stdout)).expect("compose prints YAML")
        [0]
    .clone()
}

#[test]
fn compose_services_wait_for_healthy_dependencies() {
    let config = compose_resolved(&["--profile", "cluster"]);
    let services = config["services"].as_hash().expect("services");
    assert!(services.len() >= 14, "{} services", services.len());
    for (name, service) in services {
        let name = name.as_str().unwrap();
        // One-shot jobs (restart: "no") are waited for with service_completed_successfully.
        let one_shot = service["restart"].as_str() == Some("no");
        if !one_shot {
            let test = &service["healthcheck"]["test"];
            assert!(
                !test.is_badvalue() && service["healthcheck"]["disable"].as_bool() != Some(true),
                "{name} has no healthcheck"
            );
        }
        let Some(depends) = service["depends_on"].as_hash() else {
            continue;
        };
        for (on, how) in depends {
            let on = on.as_str().unwrap();
            let condition = how["condition"].as_str();
            let expected = if services[&Yaml::String(on.into())]["restart"].as_str() == Some("no") {
                "service_completed_successfully"
            } else {
                "service_healthy"
            };
            assert_eq!(condition, Some(expected), "{name} depends on {on}");
        }
        let command = format!("{:?}{:?}", service["command"], service["entrypoint"]);
        assert!(
            !command.contains("sleep 3"),
            "{name} sleeps instead of waiting for readiness"
        );
    }
}

#[test]
fn compose_keeps_kafka_and_redis_on_volumes() {
    let config = compose_resolved(&[]);
    let volumes = config["volumes"].as_hash().expect("volumes");
    for (service, path) in [("kafka", "KAFKA_LOG_DIRS"), ("redis", "")] {
        let service = &config["services"][service];
        let dir = if path.is_empty() {
            "/data"
        } else {
            service["environment"][path]
                .as_str()
                .expect("kafka's KAFKA_LOG_DIRS")
        };
        let mounts = service["volumes"].as_vec().expect("volumes");
        // docker-compose 1 prints `source:target:mode`, compose 2 a map.
        let mounted = mounts.iter().any(|m| {
            let (source, target) = match m.as_str() {
                Some(short) => {
                    let mut parts = short.split(':');
                    (parts.next(), parts.next())
                }
                None => (m["source"].as_str(), m["target"].as_str()),
            };
            target == Some(dir)
                && source.is_some_and(|s| volumes.contains_key(&Yaml::String(s.into())))
        });
        assert!(mounted, "{dir} is not on a named volume: {mounts:?}");
    }
    // Every redis-server repairs a torn AOF before it loads it.
    for (name, service) in config["services"].as_hash().expect("services") {
        let command = format!("{:?}", service["command"]);
        if command.contains("redis-server") {
            assert!(
                command.contains("redis-check-aof --fix")
                    && command.find("redis-check-aof") < command.find("redis-server"),
                "{name:?} starts redis-server without redis-check-aof --fix first: {command}"
            );
        }
    }
    let text = read(&repo().join("docker-compose.yml"));
    assert!(
        text.contains("down -v"),
        "docker-compose.yml says what `down -v` removes"
    );
}

/// The named volume `service` mounts at `dir`, if any.
fn named_volume_at(config: &Yaml, service: &Yaml, dir: &str) -> Option<String> {
    let volumes = config["volumes"].as_hash()?;
    service["volumes"].as_vec()?.iter().find_map(|m| {
        // docker-compose 1 prints `source:target:mode`, compose 2 a map.
        let (source, target) = match m.as_str() {
            Some(short) => {
                let mut parts = short.split(':');
                (parts.next(), parts.next())
            }
            None => (m["source"].as_str(), m["target"].as_str()),
        };
        let source = source.filter(|s| volumes.contains_key(&Yaml::String(s.to_string())))?;
        (target == Some(dir)).then(|| source.to_string())
    })
}

/// The cluster profile keeps each node's data (AOF and nodes.conf, in /data) on a volume of its
/// own, and its tally replicas start once the cluster is formed.
#[test]
fn compose_cluster_keeps_its_data_and_tally_waits_for_it() {
    let config = compose_resolved(&["--profile", "cluster"]);
    let services = config["services"].as_hash().expect("services");
    let mut volumes = std::collections::BTreeSet::new();
    let mut nodes = 0;
    for (name, service) in services {
        let name = name.as_str().unwrap();
        if !name.starts_with("redis-node-") {
            continue;
        }
        nodes += 1;
        let volume = named_volume_at(&config, service, "/data")
            .unwrap_or_else(|| panic!("{name}'s /data is not on a named volume"));
        assert!(volumes.insert(volume.clone()), "{name} shares {volume}");
        let command = format!("{:?}", service["command"]);
        assert!(
            command.contains("--appendonly yes") && command.contains("--cluster-enabled yes"),
            "{name} runs without AOF: {command}"
        );
    }
    assert_eq!(nodes, 6, "the cluster's nodes");
    let init = "redis-cluster-init";
    assert_eq!(
        services[&Yaml::String(init.into())]["restart"].as_str(),
        Some("no")
    );
    let mut waiting = Vec::new();
    for (name, service) in services {
        let name = name.as_str().unwrap();
        let profiles = format!("{:?}", service["profiles"]);
        let runs_tally = service["image"].as_str() == Some("tally:local")
            && service["command"][0].as_str() == Some("run");
        if runs_tally && profiles.contains("cluster") {
            assert_eq!(
                service["depends_on"][init]["condition"].as_str(),
                Some("service_completed_successfully"),
                "{name} starts before the cluster is formed"
            );
            assert!(
                service["environment"]["TALLY_REDIS"]
                    .as_str()
                    .is_some_and(|url| url.starts_with("redis+cluster://")),
                "{name} counts into the cluster"
            );
            waiting.push(name);
        }
    }
    assert!(
        waiting.len() >= 2,
        "the cluster profile's tally replicas: {waiting:?}"
    );
    let groups: std::collections::BTreeSet<&str> = services
        .values()
        .filter(|s| s["command"][0].as_str() == Some("run"))
        .filter_map(|s| s["environment"]["TALLY_GROUP"].as_str())
        .collect();
    assert_eq!(groups.len(), 2, "one group per store: {groups:?}");
}

#[test]
fn the_dockerfile_caches_dependencies_and_pins_its_bases() {
    let text = read(&repo().join("Dockerfile"));
    assert!(
        !text.contains("--mount=type=cache"),
        "the dependency cache must work without BuildKit cache mounts"
    );
    // `FROM <image or an earlier stage> [AS <stage>]`: the images are the bases.
    let mut stages: Vec<&str> = Vec::new();
    let mut images: Vec<&str> = Vec::new();
    for from in text.lines().filter_map(|l| l.strip_prefix("FROM ")) {
        let words: Vec<&str> = from.split_whitespace().collect();
        if !stages.contains(&words[0]) {
            images.push(words[0]);
        }
        if let [_, as_, stage] = words[..]
            && as_.eq_ignore_ascii_case("as")
        {
            stages.push(stage);
        }
    }
    assert!(images.len() >= 2, "{images:?}");
    for image in images {
        let tag = image.split_once(':').map(|(_, t)| t).unwrap_or("latest");
        let version: Vec<&str> = tag.split(['-', '.']).collect();
        assert!(
            version.len() >= 2 && version[..2].iter().all(|p| p.parse::<u32>().is_ok()),
            "{image}: pin a release (major.minor), not a moving tag"
        );
    }
    // The dependency layer builds before the sources are copied.
    let deps = text.find("cargo build").expect("a cargo build");
    let sources = text.find("COPY src src").expect("COPY src src");
    assert!(
        deps < sources,
        "dependencies build in a layer of their own, before src/"
    );
    assert!(text.contains("LABEL org.opencontainers.image.title"));
    assert!(
        text.contains("\nHEALTHCHECK ") || text.contains("# No HEALTHCHECK:"),
        "a HEALTHCHECK, or the reason there is none"
    );
}

/// The default target, the last stage, is the service's image: it ships `tally` and nothing
/// of the lab, whose traffic generator has a target of its own.
#[test]
fn the_image_ships_the_service_alone() {
    let text = read(&repo().join("Dockerfile"));
    let last = &text[text.rfind("\nFROM ").expect("a FROM")..];
    let copies: Vec<&str> = last.lines().filter(|l| l.starts_with("COPY ")).collect();
    assert_eq!(
        copies,
        ["COPY --from=build /usr/local/bin/tally /usr/local/bin/tally"],
        "the service's image copies more than tally"
    );
    assert!(
        !last.contains("tally-lab"),
        "the service's image carries the lab"
    );
    assert!(
        text.contains(" AS lab\n"),
        "no `lab` target for the traffic generator"
    );
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

/// A bucket count in an example would refuse every replica started after `tally rebucket`
/// (tests/e2e_running.rs starts one, with the Kubernetes example's settings, after a rebucket).
#[test]
fn no_example_pins_the_bucket_count() {
    let toml: toml::Table = read(&repo().join("deploy/k8s/tally.toml")).parse().unwrap();
    assert!(
        !toml.contains_key("buckets"),
        "deploy/k8s/tally.toml sets buckets"
    );
    let compose = &yaml(&repo().join("docker-compose.yml"))[0];
    let env = &compose["x-tally"]["environment"];
    assert!(env.as_hash().is_some(), "x-tally has an environment");
    assert!(
        env["TALLY_BUCKETS"].is_badvalue(),
        "docker-compose.yml sets TALLY_BUCKETS"
    );
    let mut files = Vec::new();
    files_under(&repo().join("deploy"), &mut files);
    for file in files {
        let text = read(&file);
        assert!(
            !text.contains("TALLY_BUCKETS") && !text.contains("--buckets"),
            "{} pins the bucket count",
            file.display()
        );
    }
}

/// `key=value` or `key="value"` on a Dockerfile line, unquoted.
fn dockerfile_values<'a>(dockerfile: &'a str, key: &str) -> Vec<&'a str> {
    dockerfile
        .lines()
        .filter_map(|line| line.split_once(&format!("{key}=")))
        .map(|(_, rest)| {
            let rest = rest.trim_start_matches('"');
            rest.split(['"', ' ']).next().unwrap_or("")
        })
        .collect()
}

/// Cargo.toml's version is the release's: the image's labels and the kustomization's tag name
/// the same one, and the image ships the stripped `dist` profile with every OCI label.
#[test]
fn the_release_version_has_one_source() {
    let version = env!("CARGO_PKG_VERSION");
    let dockerfile = read(&repo().join("Dockerfile"));
    let args = dockerfile_values(&dockerfile, "ARG VERSION");
    assert!(!args.is_empty(), "the Dockerfile has no ARG VERSION");
    for arg in args {
        assert_eq!(
            arg, version,
            "the Dockerfile's ARG VERSION is {arg}, Cargo.toml's version {version}"
        );
    }
    for label in [
        "title",
        "description",
        "version",
        "revision",
        "source",
        "licenses",
    ] {
        let key = format!("org.opencontainers.image.{label}");
        assert_eq!(
            dockerfile_values(&dockerfile, &key).len(),
            1,
            "the image has no label {key}"
        );
    }
    assert_eq!(
        dockerfile_values(&dockerfile, "org.opencontainers.image.licenses"),
        [env!("CARGO_PKG_LICENSE")],
        "the image's licence label differs from Cargo.toml's"
    );
    assert!(
        dockerfile.contains("cargo build --profile dist")
            && !dockerfile.contains("cargo build --release"),
        "the image builds another profile than dist"
    );
    let manifest: toml::Table = read(&repo().join("Cargo.toml")).parse().unwrap();
    let dist = &manifest["profile"]["dist"];
    assert_eq!(
        dist["strip"].as_str(),
        Some("debuginfo"),
        "dist keeps debug info"
    );

    let kustomization = &yaml(&repo().join("deploy/kustomization.yaml"))[0];
    let images = kustomization["images"].as_vec().expect("images");
    let tally = images
        .iter()
        .find(|image| image["name"].as_str() == Some("tally"))
        .expect("the kustomization sets the tally image");
    assert_eq!(
        tally["newTag"].as_str(),
        Some(version),
        "deploy/kustomization.yaml tags the image {:?}, Cargo.toml's version is {version}",
        tally["newTag"]
    );
    // The examples in its comments too.
    let text = read(&repo().join("deploy/kustomization.yaml"));
    for (at, _) in text.match_indices("tally:") {
        let tag: String = text[at + "tally:".len()..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-')
            .collect();
        if tag.starts_with(|c: char| c.is_ascii_digit()) {
            assert_eq!(tag, version, "deploy/kustomization.yaml names tally:{tag}");
        }
    }
}

/// `tally --version` prints Cargo.toml's version and the commit it was built from.
#[test]
fn the_binary_reports_its_release_and_revision() {
    let out = Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let line = String::from_utf8(out.stdout).unwrap();
    let rest = line
        .trim()
        .strip_prefix(&format!("tally {} (", env!("CARGO_PKG_VERSION")))
        .unwrap_or_else(|| panic!("not tally's version: {line}"));
    let revision = rest.strip_suffix(')').expect("a revision in parentheses");
    if revision != "unknown" {
        assert!(
            revision.len() >= 7 && revision.chars().all(|c| c.is_ascii_hexdigit()),
            "{revision} is not a short commit hash"
        );
        // Built from this checkout: the commit exists in it.
        let known = Command::new("git")
            .args(["cat-file", "-e", &format!("{revision}^{{commit}}")])
            .current_dir(repo())
            .status();
        if let Ok(status) = known {
            assert!(status.success(), "{revision} is no commit of this checkout");
        }
    }
}

/// With `--log-format json` (or TALLY_LOG_FORMAT=json) every log line is one JSON object.
#[test]
fn json_log_lines_parse() {
    for (flag, variable) in [(Some("--log-format=json"), None), (None, Some("json"))] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tally"));
        for (name, _) in std::env::vars().filter(|(k, _)| k.starts_with("TALLY_")) {
            cmd.env_remove(name);
        }
        cmd.env("TALLY_LOG", "tally=debug")
            .args(["docs", "metrics"]);
        if let Some(flag) = flag {
            cmd.arg(flag);
        }
        if let Some(variable) = variable {
            cmd.env("TALLY_LOG_FORMAT", variable);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        let stderr = String::from_utf8(out.stderr).unwrap();
        let lines: Vec<&str> = stderr.lines().collect();
        assert!(!lines.is_empty(), "no log line");
        for line in lines {
            let event: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
            assert!(
                event["timestamp"].is_string() && event["level"].is_string(),
                "{line}"
            );
            if event["message"] == "Starting." {
                assert_eq!(event["version"], env!("CARGO_PKG_VERSION"), "{line}");
            }
        }
    }
}
