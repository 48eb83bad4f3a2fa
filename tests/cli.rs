//! The `guardmesh` command line end to end: `serve`, `guards register /
//! list / deregister` and `evaluate FILE`, each a real process.

use crate::harness::*;
use std::process::{Command, Output};
use std::time::Duration;

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn cli_serve_register_evaluate_deregister() {
    let guard = GuardProcess::start("deny-list", 0, &[]);
    let (_serve, port) = serve(&[]);
    let mesh = format!("http://127.0.0.1:{port}");
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
    // A call was cancelled: exit 3.
    assert_eq!(out.status.code(), Some(3), "{out:?}");
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
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a batch"));

    let out = guardmesh(&["guards", "--mesh", &mesh, "deregister", "deny"]);
    assert!(stdout(&out).contains("deregistered deny"));
    let list = stdout(&guardmesh(&["guards", "--mesh", &mesh, "list"]));
    assert!(!list.contains("deny"), "{list}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `guardmesh evaluate --mesh MESH EXTRA... -` with `input` on stdin:
/// (exit code, stdout, stderr).
fn evaluate_stdin(mesh: &str, extra: &[&str], input: &str) -> (Option<i32>, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["evaluate", "--mesh", mesh])
        .args(extra)
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run guardmesh evaluate");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    (out.status.code(), stdout(&out), stderr(&out))
}

/// `guardmesh evaluate` for scripts, against a real mesh process: `-` reads
/// stdin, `--json` prints one JSON object per batch (JSON Lines in, JSON
/// Lines out), and the exit code says how the batches went: 0 every call
/// proceeds (R1: a zero-call batch too), 3 a call was steered or cancelled,
/// 4 the mesh refused (R20) or aborted (R13) a batch, 1 the mesh cannot be
/// reached or the input is not a batch, 2 a usage error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2_r13_r20_evaluate_for_scripts_json_and_exit_codes() {
    let guard = GuardProcess::start("deny-list", 0, &[]);
    let (_serve, port) = serve(&[]);
    let mesh = format!("http://127.0.0.1:{port}");
    let closed = closed_port().await;
    let m = mesh.clone();
    tokio::task::spawn_blocking(move || {
        let mesh = m;
        guards_when_up(&[
            "guards", "--mesh", &mesh, "register", "--name", "deny", "--endpoint", &guard.url,
            "--timeout-ms", "2000",
        ]);
        // A guard that cannot be reached, with the abort policy, for `x.*`.
        guards_when_up(&[
            "guards", "--mesh", &mesh, "register", "--name", "strict", "--endpoint", &closed,
            "--tools", "x.*", "--failure-policy", "abort", "--timeout-ms", "2000",
        ]);

        // Every call proceeds: exit 0, the decision as JSON.
        let (code, out, err) = evaluate_stdin(
            &mesh,
            &["--json"],
            r#"{"session_id": "s1", "calls": [{"call_id": "c1", "tool": "fs.read", "arguments": {"path": "/a"}}]}"#,
        );
        assert_eq!(code, Some(0), "{out}{err}");
        assert_eq!(out.lines().count(), 1, "{out}");
        let d: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(d["session_id"], "s1");
        assert_eq!(d["chain_revision"], 2, "{d}");
        assert!(d["trace_id"].is_string());
        let call = &d["decisions"][0];
        assert_eq!(call["call_id"], "c1");
        assert_eq!(call["action"], "proceed");
        assert_eq!(call["content"], serde_json::Value::Null);
        assert_eq!(call["failure"], false);
        assert_eq!(call["bypassed"], serde_json::json!([]));
        assert_eq!(call["call"]["tool"], "fs.read");
        assert_eq!(call["call"]["arguments"], serde_json::json!({"path": "/a"}));
        let trace = d["trace"].as_array().unwrap();
        assert_eq!(trace.len(), 2, "one entry per guard (R21): {d}");
        assert_eq!(trace[0]["guard"], "deny");
        assert_eq!(trace[0]["status"], "proceeded");
        assert_eq!(trace[1]["status"], "not_applicable");

        // A zero-call batch: exit 0, no decision (R1).
        let (code, out, _) = evaluate_stdin(&mesh, &["--json"], r#"{"calls": []}"#);
        assert_eq!(code, Some(0));
        let d: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(d["decisions"], serde_json::json!([]));

        // JSON Lines: one batch per line, one line out per batch; a cancelled
        // call makes the run exit 3.
        let input = concat!(
            r#"{"calls": [{"call_id": "a", "tool": "fs.read", "arguments": {}}]}"#,
            "\n",
            r#"{"calls": [{"call_id": "b", "tool": "fs.delete", "arguments": {"path": "/"}},"#,
            r#" {"call_id": "c", "tool": "fs.read"}]}"#,
            "\n"
        );
        let (code, out, err) = evaluate_stdin(&mesh, &["--json"], input);
        assert_eq!(code, Some(3), "{out}{err}");
        let lines: Vec<serde_json::Value> =
            out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert_eq!(lines[0]["decisions"][0]["action"], "proceed");
        let b = &lines[1]["decisions"][0];
        assert_eq!(b["action"], "cancel");
        assert_eq!(b["decided_by"], "deny");
        assert_eq!(b["content"], "The tool fs.delete is not allowed for this agent.");
        assert!(b.get("call").is_none(), "no call to run for a skip: {b}");
        assert_eq!(lines[1]["decisions"][1]["action"], "proceed", "R6");
        // The same without --json: tables, same exit code.
        let (code, out, _) = evaluate_stdin(&mesh, &[], input);
        assert_eq!(code, Some(3));
        assert!(out.contains("CANCEL") && out.contains("PROCEED"), "{out}");

        // Refused (R20, duplicate call ids): exit 4, the error as JSON.
        let (code, out, err) = evaluate_stdin(
            &mesh,
            &["--json"],
            r#"{"calls": [{"call_id": "d", "tool": "fs.read"}, {"call_id": "d", "tool": "fs.read"}]}"#,
        );
        assert_eq!(code, Some(4), "{out}{err}");
        let d: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(d["error"]["code"], "InvalidArgument", "{d}");
        assert!(err.contains("refused"), "{err}");
        // Arguments go to the mesh as written: duplicate members refused (R20).
        let (code, _, err) = evaluate_stdin(
            &mesh,
            &[],
            r#"{"calls": [{"call_id": "e", "tool": "fs.read", "arguments": {"p": 1, "p": 2}}]}"#,
        );
        assert_eq!(code, Some(4), "{err}");
        // Aborted (R13: the abort guard cannot be reached): exit 4, and 4
        // wins over 3 when batches of one run differ.
        let input = concat!(
            r#"{"calls": [{"call_id": "f", "tool": "fs.delete"}]}"#,
            "\n",
            r#"{"calls": [{"call_id": "g", "tool": "x.run"}]}"#,
        );
        let (code, out, err) = evaluate_stdin(&mesh, &["--json"], input);
        assert_eq!(code, Some(4), "{out}{err}");
        let lines: Vec<serde_json::Value> =
            out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines[0]["decisions"][0]["action"], "cancel");
        assert!(
            lines[1]["error"]["message"].as_str().unwrap().contains("strict"),
            "{out}"
        );

        // Not a batch: exit 1, naming stdin and the line; nothing judged.
        let (code, out, err) = evaluate_stdin(&mesh, &["--json"], "{\"calls\": []}\n{\"calls\": 1}\n");
        assert_eq!((code, out.as_str()), (Some(1), ""), "{err}");
        assert!(err.contains("stdin is not a batch (batch 2, line 2)"), "{err}");
        // The mesh cannot be reached: exit 1.
        let (code, out, err) = evaluate_stdin(&closed, &["--json"], r#"{"calls": [{"call_id": "h", "tool": "fs.read"}]}"#);
        assert_eq!((code, out.as_str()), (Some(1), ""), "{err}");
        assert!(err.contains("error:"), "{err}");
        // Usage error: exit 2 (clap's); the help lists the exit codes.
        let out = guardmesh(&["evaluate", "--no-such-flag", "-"]);
        assert_eq!(out.status.code(), Some(2));
        let help = stdout(&guardmesh(&["evaluate", "--help"]));
        assert!(help.contains("Exit codes: 0 every call proceeds"), "{help}");
        assert!(help.contains("--json"), "{help}");
    })
    .await
    .unwrap();
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
    let (mesh, url) = TestMesh::with_tokens(&pki, &[OPS, AGENT], "").await;
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
        registrar
            .deregister("g")
            .await
            .expect("deregister with a token"),
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

/// Starts `guardmesh serve --config CONFIG` on a free port; returns it
/// with the port.
fn serve_config(config: &std::path::Path) -> (KillOnDrop, u16) {
    serve(&["--config".as_ref(), config.as_os_str()])
}

/// Starts `guardmesh serve ARGS...` on a free port, its stderr to nowhere;
/// returns it with the port.
fn serve(args: &[&std::ffi::OsStr]) -> (KillOnDrop, u16) {
    let port = free_port();
    let serve = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(args)
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start serve"),
    );
    (serve, port)
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs `guardmesh guards ARGS` (retrying while the mesh starts) until it
/// succeeds; panics after ten seconds.
fn guards_when_up(args: &[&str]) -> Output {
    let mut last = None;
    for _ in 0..200 {
        let out = guardmesh(args);
        if out.status.success() {
            return out;
        }
        last = Some(out);
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the mesh did not answer {args:?}: {last:?}")
}

/// R24: `guardmesh guards` and `guardmesh evaluate` send the certificate and
/// token they are given on every call, and without them are refused with a
/// message that says what is missing.
#[test]
fn r24_cli_reaches_a_secured_mesh_with_certificates_or_tokens() {
    let pki = TestPki::new();
    let guard = GuardProcess::start("deny-list", 0, &[]);
    let ca = pki.ca_file();
    let ca = ca.to_str().unwrap();
    let (mesh_cert, mesh_key) = pki.issue_files("mesh");
    let (admin_cert, admin_key) = pki.issue_files("admin");
    let token_file = pki.file("ops.token", "ops-token\n");
    let batch = pki.file(
        "batch.json",
        r#"{"calls": [{"call_id": "c1", "tool": "fs.delete", "arguments": {}}]}"#,
    );

    // One mesh requiring mTLS, one taking tokens over TLS.
    let mtls = pki.file(
        "mtls.toml",
        &format!(
            "[tls]\ncert_file = {:?}\nkey_file = {:?}\nclient_ca_file = {ca:?}\n\
             [[auth.principal]]\nid = \"spiffe://guardmesh.local/admin\"\nroles = [\"admin\"]\n",
            mesh_cert.to_str().unwrap(),
            mesh_key.to_str().unwrap(),
        ),
    );
    let tokens = pki.file(
        "tokens.toml",
        &format!(
            "[tls]\ncert_file = {:?}\nkey_file = {:?}\n\
             [[auth.principal]]\nid = \"ops\"\nroles = [\"admin\"]\ntoken_file = {:?}\n",
            mesh_cert.to_str().unwrap(),
            mesh_key.to_str().unwrap(),
            token_file.to_str().unwrap(),
        ),
    );
    let cert_args = [
        "--cert-file",
        admin_cert.to_str().unwrap(),
        "--key-file",
        admin_key.to_str().unwrap(),
    ];
    let token_args = ["--token-file", token_file.to_str().unwrap()];

    for (what, config, credentials) in [
        ("mTLS", &mtls, &cert_args[..]),
        ("token", &tokens, &token_args[..]),
    ] {
        let (_serve, port) = serve_config(config);
        let mesh = format!("https://localhost:{port}");
        let base = ["--mesh", mesh.as_str(), "--ca-file", ca];
        let with = |tail: &[&str]| -> Vec<String> {
            base.iter()
                .chain(credentials)
                .chain(tail)
                .map(|s| (*s).to_owned())
                .collect()
        };
        let run = |args: Vec<String>| {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            guardmesh(&args)
        };
        let mut list = vec!["guards".to_owned()];
        list.extend(with(&["list"]));
        let args: Vec<&str> = list.iter().map(String::as_str).collect();
        assert!(stdout(&guards_when_up(&args)).contains("chain revision 0"));

        let mut register = vec!["guards".to_owned()];
        register.extend(with(&[
            "register",
            "--name",
            "deny",
            "--endpoint",
            &guard.url,
        ]));
        let out = run(register.clone());
        assert!(out.status.success(), "{what}: {out:?}");
        assert!(stdout(&out).contains("registered at position 0"), "{what}");
        let out = run(list.clone());
        assert!(stdout(&out).contains("deny"), "{what}: {out:?}");

        let mut evaluate = vec!["evaluate".to_owned()];
        evaluate.extend(with(&[batch.to_str().unwrap()]));
        let out = run(evaluate);
        // Judged, with a call cancelled: exit 3.
        assert_eq!(out.status.code(), Some(3), "{what}: {out:?}");
        assert!(stdout(&out).contains("CANCEL"), "{what}: {out:?}");

        // Without credentials: refused, saying why, and nothing changes.
        let bare = |tail: &[&str]| -> Vec<String> {
            base.iter().chain(tail).map(|s| (*s).to_owned()).collect()
        };
        for args in [
            [vec!["guards".to_owned()], bare(&["list"])].concat(),
            [
                vec!["guards".to_owned()],
                bare(&["register", "--name", "evil", "--endpoint", "127.0.0.1:1"]),
            ]
            .concat(),
            [vec!["guards".to_owned()], bare(&["deregister", "deny"])].concat(),
            [
                vec!["evaluate".to_owned()],
                bare(&[batch.to_str().unwrap()]),
            ]
            .concat(),
        ] {
            let out = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
                .args(&args)
                .env_remove("GUARDMESH_TOKEN")
                .output()
                .unwrap();
            let message = stderr(&out);
            assert!(!out.status.success(), "{what} {args:?}: {out:?}");
            assert!(
                message.contains("Unauthenticated")
                    || message.contains("pass --cert-file and --key-file"),
                "{what} {args:?}: {message}"
            );
        }
        // The token may come from the environment; a wrong one is refused.
        if what == "token" {
            let args = [vec!["guards".to_owned()], bare(&["list"])].concat();
            for (token, works) in [("ops-token", true), ("wrong", false)] {
                let out = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
                    .args(&args)
                    .env("GUARDMESH_TOKEN", token)
                    .output()
                    .unwrap();
                assert_eq!(out.status.success(), works, "{token}: {out:?}");
                if !works {
                    assert!(stderr(&out).contains("Unauthenticated"), "{out:?}");
                }
            }
        }

        let mut deregister = vec!["guards".to_owned()];
        deregister.extend(with(&["deregister", "deny"]));
        let out = run(deregister);
        assert!(
            stdout(&out).contains("deregistered deny"),
            "{what}: {out:?}"
        );
        let out = run(list.clone());
        assert!(!stdout(&out).contains("deny"), "{what}: {out:?}");
    }
}

/// R16: endpoints whose host resolvers read differently (numeric forms other
/// than the dotted quad, a trailing dot, an IPv6 zone id) are refused at
/// registration with INVALID_ARGUMENT naming the endpoint and the reason,
/// not only when the mesh dials them.
#[tokio::test]
async fn r16_registration_refuses_ambiguous_endpoint_forms() {
    use guardmesh_client::Registration;
    let mesh = TestMesh::start().await;
    let registrar = mesh.registrar().await;
    for (endpoint, needle) in [
        ("http://2130706433:50051", "dotted-quad"),
        ("http://0x7f.0.0.1:50051", "dotted-quad"),
        ("http://0177.0.0.1:50051", "dotted-quad"),
        ("http://localhost.:50051", "trailing dot"),
        ("http://169.254.169.254.:80", "trailing dot"),
        ("http://[fe80::1%25eth0]:50051", "zone id"),
    ] {
        let (code, message) = code_of(
            registrar
                .register(Registration::validate("odd", endpoint))
                .await,
        );
        assert_eq!(code, tonic::Code::InvalidArgument, "{endpoint}: {message}");
        assert!(
            message.contains(endpoint) && message.contains(needle),
            "{endpoint}: {message}"
        );
    }
    assert_eq!(mesh.mesh.registry().chain().guards.len(), 0);
    assert_eq!(registrar.list().await.unwrap().revision, 0);
}

/// R24: a server that refuses the TLS handshake for want of a client
/// certificate (as a mesh with a client CA may, before any RPC) is reported
/// with what to pass, not as a bare transport error.
#[tokio::test]
async fn r24_cli_says_what_to_pass_when_a_client_certificate_is_required() {
    let pki = TestPki::new();
    let (port, stop, server) = tls_server(&pki, true).await;
    let ca = pki.ca_file();
    let mesh = format!("https://localhost:{port}");
    let out = guardmesh_off_thread([
        "guards",
        "--mesh",
        &mesh,
        "--ca-file",
        ca.to_str().unwrap(),
        "list",
    ])
    .await;
    let message = stderr(&out);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        message.contains("pass --cert-file and --key-file"),
        "{message}"
    );
    let _ = stop.send(());
    let _ = server.await;
}

/// A gRPC server on loopback serving TLS with a certificate of `pki`,
/// requiring client certificates of it when `mtls`: (port, its stop
/// signal, its task).
async fn tls_server(
    pki: &TestPki,
    mtls: bool,
) -> (
    u16,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), guardmesh_client::ServeError>>,
) {
    let (cert, key) = pki.issue_files("server");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let guard = guardmesh_client::GuardServer::new(script_guard_state(|_| Script::default()));
    let server = tokio::spawn(guard.serve_with(
        listener,
        Some(guardmesh_client::ServerTls {
            cert_pem: std::fs::read_to_string(&cert).unwrap(),
            key_pem: std::fs::read_to_string(&key).unwrap(),
            client_ca_pem: mtls.then(|| pki.ca.cert_pem()),
        }),
        async {
            let _ = stopped.await;
        },
    ));
    (port, stop, server)
}

/// A plaintext client at a mesh that serves TLS is told what to change,
/// not left with a bare transport error.
#[tokio::test]
async fn r24_a_plaintext_client_at_a_tls_mesh_is_told_to_use_https() {
    let pki = TestPki::new();
    let (port, stop, server) = tls_server(&pki, false).await;
    for mesh in [
        format!("http://127.0.0.1:{port}"),
        format!("127.0.0.1:{port}"),
    ] {
        let out = guardmesh_off_thread(["guards", "--mesh", &mesh, "list"]).await;
        let message = stderr(&out);
        assert!(!out.status.success(), "{mesh}: {out:?}");
        assert!(
            message.contains("if this mesh serves TLS, use --mesh https://"),
            "{mesh}: {message}"
        );
    }
    // A mesh that is simply not there is not sent to TLS.
    let closed = free_port();
    let out = guardmesh_off_thread([
        "guards",
        "--mesh",
        &format!("http://127.0.0.1:{closed}"),
        "list",
    ])
    .await;
    assert!(!out.status.success(), "{out:?}");
    assert!(!stderr(&out).contains("serves TLS"), "{}", stderr(&out));
    let _ = stop.send(());
    let _ = server.await;
}

/// Enum values are read in both spellings: `fail_open` as config files
/// and the proto's names have it, `fail-open` as command lines do.
#[tokio::test]
async fn r13_failure_policies_and_roles_are_read_in_kebab_case_too() {
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    // `guardmesh guards register --name NAME` of the guard, with `more`.
    let register = async |name: &str, more: &[&str]| {
        let args = ["guards", "--mesh", &mesh.url, "register", "--name", name];
        let endpoint = ["--endpoint", guard.url.as_str()];
        guardmesh_off_thread([&args[..], &endpoint, more].concat()).await
    };
    for (name, policy, shown) in [
        ("a", "fail-open", "fail_open"),
        ("b", "fail_closed", "fail_closed"),
        ("c", "fail-closed", "fail_closed"),
    ] {
        let out = register(name, &["--role", "validate", "--failure-policy", policy]).await;
        assert!(out.status.success(), "{policy}: {}", stderr(&out));
        let chain = mesh.registrar().await.list().await.unwrap();
        let registered = chain
            .guards
            .iter()
            .find(|g| g.name == name)
            .unwrap_or_else(|| panic!("{name} registered"));
        assert_eq!(registered.failure_policy().to_string(), shown, "{policy}");
    }
    // A name in neither spelling is refused, naming the ones that exist.
    let out = register("d", &["--failure-policy", "open"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr(&out).contains("fail_closed, fail_open, abort"),
        "{}",
        stderr(&out)
    );
}

/// A report command whose reader stops early (`guardmesh demo | head -1`)
/// ends quietly, as `ls | head` does: no panic, no error text.
#[test]
fn report_commands_end_quietly_when_their_reader_stops() {
    use std::io::BufRead;
    let mut demo = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .arg("demo")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the demo");
    let mut first = String::new();
    std::io::BufReader::new(demo.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader goes: the pipe is closed.
    assert!(first.contains("guardmesh demo"), "{first}");
    let out = demo.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!text.contains("panicked"), "{text}");
    use std::os::unix::process::ExitStatusExt;
    assert!(
        out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
        "{:?}: {text}",
        out.status
    );
}

/// `guardmesh --version` names the commit it was built from (cli/build.rs),
/// so a binary in the field can be traced to its source: in a clone, the
/// first 12 hex digits of HEAD, and `-dirty` exactly when the binary's
/// tracked sources differ from HEAD.
#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = guardmesh(&["--version"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = stdout(&out);
    assert!(
        printed.starts_with(&format!("guardmesh {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{printed}"
    );
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| stdout(&o).trim().to_owned())
    };
    let Some(head) = git(&["rev-parse", "HEAD"]) else {
        // A build from a packed crate: the commit cargo package recorded.
        assert!(!printed.contains("(commit )"), "{printed}");
        return;
    };
    // cli/build.rs's SOURCES: what the binary is built from.
    let sources = env!("GUARDMESH_SOURCES").split(' ');
    let pathspecs: Vec<String> = sources.map(|s| format!(":/{s}")).collect();
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    status.extend(pathspecs.iter().map(String::as_str));
    let dirty = git(&status).is_some_and(|s| !s.is_empty());
    let expected = format!(
        "(commit {}{})",
        &head[..12],
        if dirty { "-dirty" } else { "" }
    );
    assert!(printed.contains(&expected), "{printed} lacks {expected}");
}
