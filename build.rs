//! Compiles `proto/tally/v1/like_event.proto` with protox (a pure-Rust protobuf
//! compiler), so building tally never needs a `protoc` binary on the machine,
//! and stamps the git revision that `tally --version` prints.

use std::path::PathBuf;
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/tally/v1/like_event.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    println!("cargo:rustc-env=TALLY_GIT_REVISION={}", revision());
    Ok(())
}

/// The short hash of the checked-out commit. An image build has no `.git` in its context and
/// passes the revision in `TALLY_GIT_REVISION` (the Dockerfile's `REVISION` argument); a
/// source tree outside git, or without git installed, builds as "unknown".
fn revision() -> String {
    println!("cargo:rerun-if-env-changed=TALLY_GIT_REVISION");
    if let Some(given) = std::env::var("TALLY_GIT_REVISION")
        .ok()
        .filter(|r| !r.trim().is_empty())
    {
        return given.trim().to_string();
    }
    let Some(revision) = git(&["rev-parse", "--short", "HEAD"]) else {
        return "unknown".into();
    };
    // Rebuild when HEAD moves: a new commit on the branch rewrites the branch's ref (or, once
    // packed, packed-refs), a checkout rewrites HEAD. Only files that exist are named, since
    // cargo reruns a script every time for a missing one.
    if let Some(git_dir) = git(&["rev-parse", "--git-dir"]).map(PathBuf::from) {
        let mut watched = vec![git_dir.join("HEAD"), git_dir.join("packed-refs")];
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(git_dir.join(&branch));
            // In a linked worktree the branch's ref lives in the common directory.
            if let Some(common) = git(&["rev-parse", "--git-common-dir"]) {
                watched.push(PathBuf::from(common).join(&branch));
            }
        }
        for path in watched.into_iter().filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    revision
}

/// The trimmed output of a git command that succeeded, if any.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}
