//! Names the commit the `guardmesh` binary was built from, for
//! `guardmesh --version`.
//!
//! Sets `GUARDMESH_COMMIT` to the commit's first 12 hex digits, with
//! `-dirty` when the binary's sources (the tracked files under [`SOURCES`])
//! differ from it, read from (first found):
//!
//! 1. the `GUARDMESH_COMMIT` environment variable (a packager that knows
//!    better, e.g. a build from an exported tree);
//! 2. git, when the crate is built inside a clone;
//! 3. `.cargo_vcs_info.json`, which `cargo package` writes into the crate
//!    it packs (a build from the `.crate` tarball, without git);
//! 4. otherwise `unknown`.
//!
//! Nothing here fails the build: a version without a commit is still a
//! binary.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What the binary is built from, relative to the repository's top: the
/// workspace's crates and the proto. (Tests and docs are not: editing them
/// neither rebuilds the binary nor makes it dirty.)
const SOURCES: &[&str] = &[
    "Cargo.toml",
    "Cargo.lock",
    "build.rs",
    "src",
    "proto",
    "server",
    "client",
    "cli/src",
    "cli/build.rs",
    "cli/Cargo.toml",
    "gateway",
    "bench",
    "conformance",
];

fn main() {
    println!("cargo:rerun-if-env-changed=GUARDMESH_COMMIT");
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let commit = std::env::var("GUARDMESH_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| from_git(&dir))
        .or_else(|| from_vcs_info(&dir))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=GUARDMESH_COMMIT={commit}");
    // For tests/cli.rs, which checks `-dirty` against the same paths.
    println!("cargo:rustc-env=GUARDMESH_SOURCES={}", SOURCES.join(" "));
}

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn from_git(dir: &Path) -> Option<String> {
    let sha = git(dir, &["rev-parse", "--verify", "HEAD"])?;
    // Built again when HEAD moves (a commit, a checkout) or the index
    // changes (files staged, or their stat data refreshed after an edit).
    for (what, file) in [
        ("--git-path", "HEAD"),
        ("--git-path", "index"),
        ("--git-path", "packed-refs"),
    ] {
        if let Some(path) = git(dir, &["rev-parse", what, file]) {
            watch(dir, &path);
        }
    }
    if let Some(branch) = git(dir, &["symbolic-ref", "-q", "HEAD"])
        && let Some(path) = git(dir, &["rev-parse", "--git-path", &branch])
    {
        watch(dir, &path);
    }
    let top = PathBuf::from(git(dir, &["rev-parse", "--show-toplevel"])?);
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    for source in SOURCES {
        let path = top.join(source);
        if path.exists() {
            // A file edited but not yet staged changes no git file.
            println!("cargo:rerun-if-changed={}", path.display());
            status.push(source);
        }
    }
    let dirty = git(&top, &status).is_some_and(|s| !s.is_empty());
    Some(short(&sha, dirty))
}

fn watch(dir: &Path, path: &str) {
    let path = dir.join(path);
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// `{"git": {"sha1": "...", "dirty": true}, "path_in_vcs": "cli"}`, read
/// without a JSON parser: the build script has no dependencies.
fn from_vcs_info(dir: &Path) -> Option<String> {
    let path = dir.join(".cargo_vcs_info.json");
    println!("cargo:rerun-if-changed={}", path.display());
    let text = std::fs::read_to_string(path).ok()?;
    let after = text.split_once("\"sha1\"")?.1;
    let sha: String = after
        .split_once('"')?
        .1
        .chars()
        .take_while(char::is_ascii_hexdigit)
        .collect();
    if sha.len() < 12 {
        return None;
    }
    let dirty = text
        .split_once("\"dirty\"")
        .is_some_and(|(_, rest)| rest.trim_start_matches([':', ' ']).starts_with("true"));
    Some(short(&sha, dirty))
}

fn short(sha: &str, dirty: bool) -> String {
    let sha = &sha[..sha.len().min(12)];
    if dirty {
        format!("{sha}-dirty")
    } else {
        sha.to_owned()
    }
}
