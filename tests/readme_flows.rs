//! The README's "Flows and sessions" example, run as written (R33, R34):
//! the section's shell block is read from the README at test time, its
//! `guardmesh serve` line starts the mesh with the example config (on a
//! port of the test's own), its `guardmesh evaluate` line runs through
//! `sh -c` from the repository's root with `GUARDMESH_MESH` pointing at
//! that mesh, and every line of the section's output block must be a line
//! of what it printed. An edit to the README, the example policy or its
//! batches is what gets tested.

use crate::harness::*;

const SECTION: &str = "## Flows and sessions";

/// The fenced blocks of the README's section, in order, with their info
/// strings.
fn blocks() -> Vec<(String, Vec<String>)> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let mut lines = readme.lines().skip_while(|l| !l.starts_with(SECTION));
    assert!(lines.next().is_some(), "README has no {SECTION:?} section");
    let mut blocks = Vec::new();
    let mut open: Option<(String, Vec<String>)> = None;
    for line in lines.take_while(|l| !l.starts_with("## ")) {
        match (line.strip_prefix("```"), open.take()) {
            (Some(info), None) => open = Some((info.trim().to_owned(), Vec::new())),
            (Some(_), Some(block)) => blocks.push(block),
            (None, Some((info, mut body))) => {
                body.push(line.to_owned());
                open = Some((info, body));
            }
            (None, None) => {}
        }
    }
    blocks
}

#[tokio::test]
async fn r33_r34_the_readme_flow_example_runs_as_written() {
    let blocks = blocks();
    let commands = &blocks
        .iter()
        .find(|(info, _)| info == "sh")
        .expect("a sh block")
        .1;
    let expected = &blocks
        .iter()
        .find(|(info, _)| info == "text")
        .expect("a text block of output")
        .1;
    let serve = commands
        .iter()
        .find(|l| l.starts_with("guardmesh serve"))
        .expect("a guardmesh serve line");
    let config = serve
        .split_whitespace()
        .skip_while(|w| *w != "--config")
        .nth(1)
        .expect("serve --config FILE");
    let mesh = MeshProcess::start_file(
        folder("readme-flows"),
        &repo_root().join(config),
        None,
        free_port(),
    )
    .await;
    let evaluate = commands
        .iter()
        .find(|l| l.starts_with("guardmesh evaluate"))
        .expect("a guardmesh evaluate line");
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_guardmesh"))
        .parent()
        .unwrap()
        .to_owned();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(evaluate)
        .current_dir(repo_root())
        .env("PATH", path)
        .env("GUARDMESH_MESH", &mesh.url)
        .output()
        .unwrap();
    let printed = text(&out.stdout);
    let lines: Vec<&str> = printed.lines().map(str::trim_end).collect();
    for want in expected {
        assert!(
            lines.contains(&want.trim_end()),
            "the README's output line {want:?} is not in what `{evaluate}` printed:\n{printed}{}",
            text(&out.stderr)
        );
    }
    // The flow itself, whatever the README shows: the insert after the
    // read is cancelled by the flow rule, and only it.
    assert_eq!(
        lines.iter().filter(|l| l.contains(" CANCEL ")).count(),
        1,
        "{printed}"
    );
}
