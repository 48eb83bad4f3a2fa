//! The Rust SDK as a coordinator uses it, against a real `guardmesh
//! serve`: the coordinator example of `client/examples/` run as written,
//! and a session that outlives a restart of the mesh (R19: every batch is
//! answered once; one that cannot be is said not judged, never proceeds).

use crate::harness::*;
use guardmesh_client::{Batch, ClientError};
use std::path::PathBuf;
use std::time::Duration;

/// A policy guard cancelling `shell.exec` calls that remove files.
const NO_RM: &str = policy_rule!(name: "no-rm", tools: ["shell.*"], action: "cancel",
    when: r#"'call.args.cmd.startsWith("rm ")'"#,
    message: r#"'"removing files is not allowed"'"#);

/// Builds `client/examples/NAME` with the cargo that runs the suite: the
/// executable's path.
fn example(name: &str) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = std::process::Command::new(cargo)
        .args(["build", "-q", "-p", "guardmesh-client", "--example", name])
        .current_dir(repo_root())
        .output()
        .expect("run cargo");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    target.join("debug/examples").join(name)
}

/// Builds `client/examples/NAME` and runs it with the mesh's `url` as its
/// argument: what it printed and how it exited.
pub(crate) async fn run_example(name: &'static str, url: &str) -> std::process::Output {
    let binary = tokio::task::spawn_blocking(move || example(name))
        .await
        .unwrap();
    let url = url.to_owned();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(binary)
            .arg(url)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_example_runs_against_a_real_mesh() {
    let dir = folder("sdk-example");
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, NO_RM).unwrap();
    let config = format!(
        "[[guard]]\nname = \"policy\"\npolicy = {:?}\n",
        path(&policy)
    );
    let mesh = MeshProcess::start("sdk-example", &config, None).await;
    let out = run_example("coordinator", &mesh.url).await;
    assert_succeeded(&out);
    assert_eq!(
        text(&out.stdout),
        "turn 0: run \"ls -la /srv\"\n\
         turn 1: skip c1-0 (policy, rule no-rm): removing files is not allowed\n\
         turn 1: run \"du -sh /srv\"\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r19_a_session_reopens_its_stream_after_the_mesh_restarts() {
    let held = held_guard().await;
    let config = held_guard_config(&held.url, 30_000, "", 20_000);
    let port = free_port();
    let mut mesh = MeshProcess::start_at("sdk-restart", &config, None, port).await;
    let coordinator = guardmesh_client::Coordinator::builder(mesh.url.clone())
        .retry(3, Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let session = coordinator.session("s").await.unwrap();
    let in_flight = session.evaluate(Batch::turn(0).call("c1", "shell.exec", "{}"));
    tokio::pin!(in_flight);
    until_held(&mut in_flight, &held.guard).await;

    // The mesh dies with the batch in flight: it was not judged.
    mesh.child.kill().unwrap();
    mesh.child.wait().unwrap();
    let error = tokio::time::timeout(Duration::from_secs(20), in_flight)
        .await
        .expect("the in-flight batch is answered")
        .expect_err("no decision came");
    assert!(matches!(&error, ClientError::NotJudged { .. }), "{error:?}");
    assert!(error.not_judged());
    assert!(error.to_string().contains("was not judged"), "{error}");
    assert!(
        error.to_string().contains("run none of its calls"),
        "{error}"
    );

    // While the mesh is down, a batch is refused as not judged too.
    let down = session
        .evaluate(Batch::turn(1).call("c1", "shell.exec", "{}"))
        .await
        .expect_err("no mesh");
    assert!(down.not_judged(), "{down:?}");

    // The mesh is back where it was: the same session goes on, on a new
    // stream.
    drop(mesh);
    let mesh = MeshProcess::start_at("sdk-restart", &config, None, port).await;
    held.guard.release();
    let decision = tokio::time::timeout(
        Duration::from_secs(20),
        session.evaluate(Batch::turn(2).call("c1", "shell.exec", "{}")),
    )
    .await
    .expect("answered")
    .unwrap_or_else(|e| panic!("the next batch goes through: {e}\n{}", mesh.log()));
    assert!(decision.calls[0].proceeds());
    // And the one after it, on the same new stream.
    let decision = session
        .evaluate(Batch::turn(3).call("c2", "shell.exec", "{}"))
        .await
        .unwrap();
    assert!(decision.calls[0].proceeds());
}

/// docs/coordinators.md quotes the example the suite runs, whole.
#[test]
fn the_coordinator_example_in_the_docs_is_the_example_file() {
    let page = std::fs::read_to_string(repo_root().join("docs/coordinators.md")).unwrap();
    let example =
        std::fs::read_to_string(repo_root().join("client/examples/coordinator.rs")).unwrap();
    assert!(
        page.contains(&format!("```rust\n{example}```\n")),
        "docs/coordinators.md does not quote client/examples/coordinator.rs as it is"
    );
}
