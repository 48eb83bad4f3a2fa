//! The flags that say how a command reaches a mesh (R24) are one definition
//! (`guardmesh_client::MeshArgs`): `guardmesh guards` and the pre-tool hook
//! (the gateway) read the token and infer `https://` the same way. Each
//! test runs both commands as real processes against one TLS mesh that
//! wants a token.

use crate::harness::*;
use crate::mcp::payload;
use guardmesh_client::Registration;
use serde_json::{Value, json};
use std::io::Write;
use std::process::{Command, Stdio};

/// What a command printed and how it exited.
struct Ran {
    code: i32,
    out: String,
    err: String,
}

/// Runs `guardmesh ARGS` with stdin `input`, `GUARDMESH_TOKEN` set to
/// `token` (or unset) and `GUARDMESH_MESH` unset.
fn guardmesh(args: &[&str], token: Option<&str>, input: &str) -> Ran {
    let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
    command
        .args(args)
        .env_remove("GUARDMESH_MESH")
        .env_remove("GUARDMESH_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(token) = token {
        command.env("GUARDMESH_TOKEN", token);
    }
    let mut child = command.spawn().expect("run guardmesh");
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let output = child.wait_with_output().unwrap();
    Ran {
        code: output.status.code().unwrap_or(-1),
        out: String::from_utf8_lossy(&output.stdout).into_owned(),
        err: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// `guardmesh guards list` with the connection flags `flags`.
fn list(flags: &[&str], token: Option<&str>) -> Ran {
    let mut args = vec!["guards", "list"];
    args.extend_from_slice(flags);
    guardmesh(&args, token, "")
}

/// `guardmesh hook pre-tool-use` judging one harmless call, with the
/// connection flags `flags`: its decision, `None` when it let the call
/// through (no output), or the reason of its deny.
fn hook(flags: &[&str], token: Option<&str>) -> Result<(), String> {
    let mut args = vec!["hook", "pre-tool-use"];
    args.extend_from_slice(flags);
    let ran = guardmesh(&args, token, &payload("read", json!({"path": "/tmp/x"})));
    assert_eq!(ran.code, 0, "the hook answers in-band: {}", ran.err);
    if ran.out.is_empty() {
        return Ok(());
    }
    let out: Value = serde_json::from_str(&ran.out).unwrap_or_else(|_| panic!("{}", ran.out));
    let specific = &out["hookSpecificOutput"];
    assert_eq!(specific["permissionDecision"], "deny", "{out}");
    Err(specific["permissionDecisionReason"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

/// A TLS mesh whose one principal, `ops`, holds `TOKEN` and may list and
/// evaluate, with one guard that lets everything through.
async fn token_mesh(pki: &TestPki) -> (TestMesh, TestGuard, String) {
    let (mesh, url) =
        TestMesh::with_tokens(pki, &[("ops", TOKEN, &["admin", "evaluate"])], "").await;
    let guard = proceed_guard().await;
    mesh.register_over(
        &url,
        &pki.connection(None, Some(TOKEN)),
        Registration::validate("g", &guard.url),
    )
    .await;
    (mesh, guard, url)
}

const TOKEN: &str = "ops-token-8f2c";

/// R24: the token comes from `GUARDMESH_TOKEN` for both commands, and a
/// `--token-file` wins over it for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r24_cli_and_gateway_read_the_token_from_the_environment_and_the_file_alike() {
    let pki = TestPki::new();
    let (_mesh, _guard, url) = token_mesh(&pki).await;
    let ca = pki.ca_file().display().to_string();
    let good = pki
        .file("good.token", &format!("{TOKEN}\n"))
        .display()
        .to_string();
    let bad = pki
        .file("bad.token", "not-the-token\n")
        .display()
        .to_string();
    tokio::task::spawn_blocking(move || {
        let tls = ["--mesh", url.as_str(), "--ca-file", ca.as_str()];
        // The environment's token.
        let ran = list(&tls, Some(TOKEN));
        assert_eq!(ran.code, 0, "{}", ran.err);
        assert!(ran.out.contains(" g "), "{}", ran.out);
        assert_eq!(hook(&tls, Some(TOKEN)), Ok(()));
        // No token: refused by the mesh, both told so.
        let ran = list(&tls, None);
        assert_ne!(ran.code, 0);
        assert!(
            ran.err.contains("Unauthenticated") || ran.err.contains("credentials"),
            "{}",
            ran.err
        );
        assert!(hook(&tls, None).is_err());
        // The file wins over the environment: a wrong file fails with a
        // right variable, a right file passes with a wrong one.
        let with = |file: &str| {
            let mut flags = tls.to_vec();
            flags.extend(["--token-file", file]);
            flags.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()
        };
        let bad_flags = with(&bad);
        let bad_flags: Vec<&str> = bad_flags.iter().map(String::as_str).collect();
        assert_ne!(list(&bad_flags, Some(TOKEN)).code, 0);
        assert!(hook(&bad_flags, Some(TOKEN)).is_err());
        let good_flags = with(&good);
        let good_flags: Vec<&str> = good_flags.iter().map(String::as_str).collect();
        let ran = list(&good_flags, Some("wrong"));
        assert_eq!(ran.code, 0, "{}", ran.err);
        assert_eq!(hook(&good_flags, Some("wrong")), Ok(()));
    })
    .await
    .unwrap();
}

/// R24: an empty token file is refused by both, naming it, before the mesh
/// is asked (the gateway used to send no token and be refused by the mesh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r24_cli_and_gateway_refuse_an_empty_token_file_naming_it() {
    let pki = TestPki::new();
    let (_mesh, guard, url) = token_mesh(&pki).await;
    let ca = pki.ca_file().display().to_string();
    let empty = pki.file("empty.token", "\n").display().to_string();
    tokio::task::spawn_blocking(move || {
        let flags = [
            "--mesh",
            url.as_str(),
            "--ca-file",
            ca.as_str(),
            "--token-file",
            empty.as_str(),
        ];
        let ran = list(&flags, Some(TOKEN));
        assert_ne!(ran.code, 0);
        assert!(
            ran.err
                .contains(&format!("the token file {empty} is empty")),
            "{}",
            ran.err
        );
        let reason = hook(&flags, Some(TOKEN)).unwrap_err();
        assert!(
            reason.contains(&format!("the token file {empty} is empty")),
            "{reason}"
        );
    })
    .await
    .unwrap();
    assert!(guard.guard.batches().is_empty(), "nothing was judged");
}

/// R24: `host:port` with `--ca-file` is https for both; `https://`
/// without a CA, or TLS flags on `http://`, are refused by both saying
/// what to pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r24_cli_and_gateway_infer_https_alike() {
    let pki = TestPki::new();
    let (_mesh, _guard, url) = token_mesh(&pki).await;
    let ca = pki.ca_file().display().to_string();
    tokio::task::spawn_blocking(move || {
        let bare = url.trim_start_matches("https://").to_owned();
        let flags = ["--mesh", bare.as_str(), "--ca-file", ca.as_str()];
        let ran = list(&flags, Some(TOKEN));
        assert_eq!(ran.code, 0, "{}", ran.err);
        assert_eq!(hook(&flags, Some(TOKEN)), Ok(()));

        let flags = ["--mesh", url.as_str()];
        let ran = list(&flags, Some(TOKEN));
        assert_ne!(ran.code, 0);
        assert!(ran.err.contains("pass --ca-file"), "{}", ran.err);
        let reason = hook(&flags, Some(TOKEN)).unwrap_err();
        assert!(reason.contains("pass --ca-file"), "{reason}");

        let plain = format!("http://{bare}");
        let flags = ["--mesh", plain.as_str(), "--ca-file", ca.as_str()];
        let ran = list(&flags, Some(TOKEN));
        assert_ne!(ran.code, 0);
        assert!(ran.err.contains("is not https://"), "{}", ran.err);
        let reason = hook(&flags, Some(TOKEN)).unwrap_err();
        assert!(reason.contains("is not https://"), "{reason}");
    })
    .await
    .unwrap();
}
