//! The event contract, `proto/tally/v1/like_event.proto`, checked with buf (configured by
//! `buf.yaml` at the root): `buf lint` is clean, and `buf breaking` finds nothing against
//! HEAD's version (a change not committed yet) nor against any version of the file in the
//! history (producers in the wild may have compiled any of them). buf comes from npm
//! (`ensure_buf` in scripts/lib.sh); without it these tests fail with the install command.
//! The options that place generated code are pinned here, since buf.yaml turns off the three
//! rules that would otherwise keep them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BUF_INSTALL: &str = "npm install -g @bufbuild/buf@1.75.0";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `buf <args>` at the repository's root; panics with the install command when buf is missing.
fn buf(args: &[&str]) -> Output {
    Command::new("buf")
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("buf is not installed ({e}); run: {BUF_INSTALL}"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The commits that changed `proto/`, newest first (as far as this clone's history goes).
fn proto_commits(repo: &Path) -> Vec<String> {
    let out = Command::new("git")
        .args(["log", "--format=%H", "--", "proto"])
        .current_dir(repo)
        .output()
        .expect("run git log");
    assert!(out.status.success(), "git log: {}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn buf_lint_is_clean() {
    let files = buf(&["ls-files"]);
    assert!(files.status.success(), "buf ls-files: {}", text(&files));
    assert!(
        text(&files).contains("proto/tally/v1/like_event.proto"),
        "buf.yaml does not take in the contract: {}",
        text(&files)
    );
    let lint = buf(&["lint"]);
    assert!(
        lint.status.success(),
        "buf lint ({}):\n{}",
        lint.status,
        text(&lint)
    );
}

#[test]
fn the_contract_breaks_no_earlier_version() {
    let mut against = vec!["HEAD".to_string()];
    against.extend(proto_commits(&repo()));
    for reference in &against {
        let input = format!(".git#ref={reference},subdir=proto");
        let out = buf(&["breaking", "--against", &input]);
        assert!(
            out.status.success(),
            "buf breaking against {reference} ({}): the contract must only grow:\n{}",
            out.status,
            text(&out)
        );
    }
    eprintln!(
        "[proto_contract] no breaking change against {} versions",
        against.len()
    );
}

/// go_package, java_package and java_multiple_files keep their values: changing one moves the
/// generated code of every producer that regenerates. buf.yaml turns off the FILE_SAME_* rules
/// for these three (and only these), since buf also counts adding them as a change.
#[test]
fn the_generated_code_options_keep_their_values() {
    let source = std::fs::read_to_string(repo().join("proto/tally/v1/like_event.proto")).unwrap();
    let options: Vec<&str> = source
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("option "))
        .collect();
    assert_eq!(
        options,
        [
            r#"option go_package = "tally.example.com/gen/go/tally/v1;tallyv1";"#,
            "option java_multiple_files = true;",
            r#"option java_package = "com.example.tally.v1";"#,
        ],
        "the contract's file options changed"
    );
    let config = std::fs::read_to_string(repo().join("buf.yaml")).unwrap();
    let excepted: Vec<&str> = config
        .split("except:")
        .nth(1)
        .expect("buf.yaml's breaking except")
        .lines()
        .map(str::trim)
        .take_while(|l| l.is_empty() || l.starts_with("- "))
        .filter_map(|l| l.strip_prefix("- "))
        .collect();
    assert_eq!(
        excepted,
        [
            "FILE_SAME_GO_PACKAGE",
            "FILE_SAME_JAVA_PACKAGE",
            "FILE_SAME_JAVA_MULTIPLE_FILES"
        ]
    );
}

#[test]
fn buf_breaking_notices_a_renumbered_field() {
    // The check itself works: a copy of the module with a field renumbered is refused.
    let dir = tempfile::tempdir().unwrap();
    let proto = repo().join("proto/tally/v1/like_event.proto");
    let module = dir.path().join("tally/v1");
    std::fs::create_dir_all(&module).unwrap();
    let source = std::fs::read_to_string(&proto).unwrap();
    let renumbered = source.replace("event_time_ms = 4;", "event_time_ms = 6;");
    assert_ne!(source, renumbered, "event_time_ms = 4 not found");
    std::fs::write(module.join("like_event.proto"), renumbered).unwrap();
    let out = Command::new("buf")
        .args(["breaking", dir.path().to_str().unwrap(), "--against"])
        .arg(repo().join("proto"))
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("buf is not installed ({e}); run: {BUF_INSTALL}"));
    assert!(
        !out.status.success() && text(&out).contains("event_time_ms"),
        "buf breaking accepted a renumbered field ({}):\n{}",
        out.status,
        text(&out)
    );
}
