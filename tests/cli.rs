//! The `guardmesh` command line end to end: `serve`, `guards register /
//! list / deregister` and `evaluate FILE`, each a real process.

mod common;

use common::*;
use std::process::{Command, Output};
use std::time::Duration;

fn guardmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(args)
        .output()
        .expect("run guardmesh")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

struct Serve(std::process::Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn cli_serve_register_evaluate_deregister() {
    let guard = GuardProcess::start("deny-list", 0, &[]);
    let port = free_port();
    let mesh = format!("http://127.0.0.1:{port}");
    let _serve = Serve(
        Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start serve"),
    );
    let mut listed = None;
    for _ in 0..200 {
        let out = guardmesh(&["guards", "--mesh", &mesh, "list"]);
        if out.status.success() {
            listed = Some(stdout(&out));
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        listed
            .expect("the mesh came up")
            .contains("chain revision 0")
    );

    let out = guardmesh(&[
        "guards",
        "--mesh",
        &mesh,
        "register",
        "--name",
        "deny",
        "--endpoint",
        &guard.url,
        "--timeout-ms",
        "2000",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout(&out).contains("registered at position 0"),
        "{}",
        stdout(&out)
    );
    let list = stdout(&guardmesh(&["guards", "--mesh", &mesh, "list"]));
    assert!(list.contains("deny") && list.contains(&guard.url), "{list}");

    let dir = std::env::temp_dir().join(format!("guardmesh-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("batch.json");
    std::fs::write(
        &file,
        r#"{"session_id": "cli", "turn_index": 1, "calls": [
            {"call_id": "c1", "tool": "fs.delete", "arguments": {"path": "/x"}},
            {"call_id": "c2", "tool": "fs.read", "arguments": {"path": "/x"}}]}"#,
    )
    .unwrap();
    let out = guardmesh(&["evaluate", "--mesh", &mesh, file.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    let c1 = text
        .lines()
        .find(|l| l.trim_start().starts_with("c1"))
        .unwrap_or_default();
    let c2 = text
        .lines()
        .find(|l| l.trim_start().starts_with("c2"))
        .unwrap_or_default();
    assert!(c1.contains("CANCEL") && c1.contains("deny"), "{text}");
    assert!(c2.contains("PROCEED"), "{text}");

    // A file that is not a batch is refused with a message naming it.
    std::fs::write(&file, r#"{"calls": "nope"}"#).unwrap();
    let out = guardmesh(&["evaluate", "--mesh", &mesh, file.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a batch"));

    let out = guardmesh(&["guards", "--mesh", &mesh, "deregister", "deny"]);
    assert!(stdout(&out).contains("deregistered deny"));
    let list = stdout(&guardmesh(&["guards", "--mesh", &mesh, "list"]));
    assert!(!list.contains("deny"), "{list}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn code_of<T: std::fmt::Debug>(
    result: Result<T, guardmesh_client::ClientError>,
) -> (tonic::Code, String) {
    match result {
        Err(guardmesh_client::ClientError::Status(status)) => {
            (status.code(), status.message().to_owned())
        }
        other => panic!("expected a gRPC status, got {other:?}"),
    }
}

/// R24: the SDK sends the token it was given on every call it makes:
/// register, list, deregister, a session stream and a unary evaluate,
/// against a mesh over TLS whose principals are known by token only.
#[tokio::test]
async fn r24_sdk_sends_its_token_on_every_call() {
    use guardmesh_client::{Batch, Coordinator, Registrar, Registration};
    let pki = TestPki::new();
    let (mesh, url) = TestMesh::with_tokens(
        &pki,
        &[
            ("ops", "ops-token", &["admin"]),
            ("agent", "agent-token", &["evaluate"]),
        ],
    )
    .await;
    let guard = proceed_guard().await;
    let ops = pki.connection(None, Some("ops-token"));
    let registrar = Registrar::connect_with(url.clone(), &ops).await.unwrap();
    registrar
        .register(Registration::validate("g", &guard.url))
        .await
        .expect("register with a token");
    let list = registrar.list().await.expect("list with a token");
    assert_eq!(list.guards.len(), 1);

    let agent = pki.connection(None, Some("agent-token"));
    let coordinator = Coordinator::connect_with(url.clone(), &agent)
        .await
        .unwrap();
    let unary = coordinator
        .evaluate_once("s", Batch::new(0).call("c", "t", "{}"))
        .await
        .expect("unary evaluate with a token");
    assert!(unary.calls[0].proceeds());
    let streamed = coordinator
        .session("s")
        .await
        .expect("session with a token")
        .evaluate(Batch::new(1).call("c", "t", "{}"))
        .await
        .expect("streamed evaluate with a token");
    assert!(streamed.calls[0].proceeds());

    assert!(
        registrar.deregister("g").await.expect("deregister with a token"),
        "the guard was removed"
    );
    assert_eq!(mesh.mesh.registry().chain().guards.len(), 0);

    // Without the token, each of them is refused.
    let anonymous = pki.connection(None, None);
    let registrar = Registrar::connect_with(url.clone(), &anonymous)
        .await
        .unwrap();
    let coordinator = Coordinator::connect_with(url.clone(), &anonymous)
        .await
        .unwrap();
    let refused = [
        code_of(
            registrar
                .register(Registration::validate("g", &guard.url))
                .await,
        ),
        code_of(registrar.list().await),
        code_of(registrar.deregister("g").await),
        code_of(
            coordinator
                .evaluate_once("s", Batch::new(0).call("c", "t", "{}"))
                .await,
        ),
    ];
    for (code, message) in refused {
        assert_eq!(code, tonic::Code::Unauthenticated, "{message}");
    }
}
