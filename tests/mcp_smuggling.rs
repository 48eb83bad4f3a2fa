//! The MCP gateway forwards only what it judged (R31, R20): messages that
//! peers would read differently from the gateway are refused, and what is
//! forwarded is the gateway's own serialization. Each attack is played
//! against a real peer that would run the smuggled call:
//!
//! * the official Python SDK over stdio, which reads stdin with universal
//!   newlines (a bare CR ends a line there, not in the gateway);
//! * a Go server decoding with `encoding/json` into structs (member names
//!   match case-insensitively, the last of two that fold alike wins), over
//!   stdio;
//! * the official TypeScript SDK over Streamable HTTP (`JSON.parse`: the
//!   last of two equal member names wins; JSON-RPC batches accepted).
//!
//! Each upstream logs every tool it executes; the tests assert that nothing
//! forbidden ran. Needs `scripts/setup-polyglot` (Python SDK, TypeScript
//! SDK in tests/mcp-sdk/ts) and `scripts/setup-go` (golang-go).

use crate::harness::*;
use crate::mcp::{RawGateway, Scratch, gateway_before, listening, mesh_with_policy, post, sdk_dir};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// A call the policy forbids (delete_file is steered): it must never run.
const SMUGGLED: &str = r#"{"jsonrpc":"2.0","id":"evil","method":"tools/call","params":{"name":"delete_file","arguments":{"path":"/important"}}}"#;

/// The Go upstream, built once per test run into the target folder.
fn go_upstream() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mcp-upstream-go");
            let go = Command::new("go").arg("version").output();
            assert!(
                go.is_ok_and(|o| o.status.success()),
                "Go is not installed: run scripts/setup-go (apt-get install golang-go)"
            );
            let status = Command::new("go")
                .args(["build", "-o"])
                .arg(&out)
                .arg(".")
                .current_dir(sdk_dir().join("go"))
                .env(
                    "GOCACHE",
                    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gocache"),
                )
                .env("GOFLAGS", "-mod=mod")
                .env("GOTOOLCHAIN", "local")
                .status()
                .expect("run go build");
            assert!(status.success(), "go build of tests/mcp-sdk/go failed");
            out
        })
        .clone()
}

/// The TypeScript SDK server's folder, with its packages installed.
fn ts_dir() -> PathBuf {
    let dir = sdk_dir().join("ts");
    assert!(
        dir.join("node_modules/@modelcontextprotocol/sdk").exists(),
        "the TypeScript MCP SDK is not installed: run scripts/setup-polyglot"
    );
    dir
}

/// What an upstream executed: its log's lines.
fn executed(log: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Asserts that nothing forbidden ran: no delete_file, no read of /etc.
fn assert_nothing_forbidden(log: &std::path::Path, attack: &str) {
    for call in executed(log) {
        assert_ne!(call["tool"], "delete_file", "{attack}: ran {call}");
        let path = call["arguments"]["path"].as_str().unwrap_or("");
        assert!(!path.starts_with("/etc"), "{attack}: ran {call}");
    }
}

/// Sends `line` (bytes as given; a newline is added), then a harmless call
/// as a probe, and reads until the probe's answer: returns everything read
/// before it. The upstream handles messages in order, so whatever the line
/// made it run has run (or started) by then; a short grace covers the rest.
fn send_and_probe(gateway: &mut RawGateway, line: &str, probe: usize) -> Vec<Value> {
    gateway.send(line);
    let id = format!("probe-{probe}");
    gateway
        .send(&RawGateway::call(json!(id), "read_file", json!({"path": "/tmp/probe"})).to_string());
    let mut before = Vec::new();
    loop {
        let message = gateway.recv();
        if message["id"] == id.as_str() {
            assert_eq!(message["result"]["isError"], false, "{message}");
            break;
        }
        before.push(message);
    }
    std::thread::sleep(Duration::from_millis(300));
    before
}

/// The answer to `id` among `messages`.
fn answer<'a>(messages: &'a [Value], id: &Value) -> Option<&'a Value> {
    messages.iter().find(|m| m["id"] == *id)
}

/// A refusal: a JSON-RPC error whose message names `what`.
fn assert_refused(messages: &[Value], id: &Value, what: &str, attack: &str) {
    let answer =
        answer(messages, id).unwrap_or_else(|| panic!("{attack}: no answer in {messages:?}"));
    // -32600: read and refused; -32700: not one JSON text (the id unknown).
    let code = if id.is_null() && answer["error"]["code"] == -32700 {
        -32700
    } else {
        -32600
    };
    assert_eq!(answer["error"]["code"], code, "{attack}: {answer}");
    let message = answer["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains(what),
        "{attack}: {message:?} does not name {what:?}"
    );
}

/// A bare CR is a line break to the Python SDK's stdin (universal
/// newlines) and JSON whitespace to the gateway: a call hidden between two
/// CRs inside a harmless message would run unjudged. The message is
/// refused, whatever carries it: a request, a notification, or a tools/call
/// the mesh allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_cr_in_a_message_is_refused_not_forwarded() {
    let (mesh, guard) = mesh_with_policy("smuggle-cr").await;
    let scratch = Scratch::new("smuggle-cr");
    let carriers = [
        (
            "a ping",
            json!("x"),
            format!(
                r#"{{"jsonrpc":"2.0","id":"x","method":"ping","params":{{"_meta":{{"x":{}{SMUGGLED}{}}}}}}}"#,
                '\r', '\r'
            ),
        ),
        (
            "a notification",
            Value::Null,
            format!(
                r#"{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"progressToken":"t","progress":1,"_meta":{{"x":{}{SMUGGLED}{}}}}}}}"#,
                '\r', '\r'
            ),
        ),
        (
            "an allowed tools/call",
            json!("ok"),
            format!(
                r#"{{"jsonrpc":"2.0","id":"ok","method":"tools/call","params":{{"name":"read_file","arguments":{{"path":"/tmp/ok"}},"_meta":{{"x":{}{SMUGGLED}{}}}}}}}"#,
                '\r', '\r'
            ),
        ),
        (
            "CRs around the whole message (not one JSON text)",
            Value::Null,
            format!("{{\"jsonrpc\":\"2.0\",\"id\":\"y\",\"method\":\"ping\"}}\r{SMUGGLED}\r"),
        ),
    ];
    let upstream = scratch.upstream(&["stdio"]);
    let url = mesh.url.clone();
    let mut gateway = tokio::task::spawn_blocking(move || {
        RawGateway::start_with_stderr(&url, &[], upstream, Stdio::inherit())
    })
    .await
    .unwrap();
    let log = scratch.log();
    let gateway = tokio::task::spawn_blocking(move || {
        for (probe, (attack, id, line)) in carriers.iter().enumerate() {
            let before = send_and_probe(&mut gateway, line, probe);
            assert!(
                answer(&before, &json!("evil")).is_none(),
                "{attack}: the smuggled call was answered: {before:?}"
            );
            assert_nothing_forbidden(&log, attack);
            assert_refused(&before, id, "CR", attack);
        }
        gateway
    })
    .await
    .unwrap();
    drop(gateway);
    // Only the probes were judged: the carriers never reached the mesh.
    let judged: Vec<String> = guard
        .guard
        .batches()
        .iter()
        .flat_map(|b| b.calls.iter().map(|c| c.tool.clone()))
        .collect();
    assert!(judged.iter().all(|t| t == "read_file"), "{judged:?}");
    assert_eq!(
        executed(&scratch.log()).len(),
        4,
        "the four probes ran, nothing else: {:?}",
        executed(&scratch.log())
    );
}

/// A CRLF line ending is one line break to every peer: accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_crlf_line_endings_are_read_as_one_line_break() {
    let (mesh, _guard) = mesh_with_policy("smuggle-crlf").await;
    let scratch = Scratch::new("smuggle-crlf");
    let upstream = scratch.upstream(&["stdio"]);
    let url = mesh.url.clone();
    tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start_with_stderr(&url, &[], upstream, Stdio::inherit());
        gateway.send(&format!(
            "{}\r",
            RawGateway::call(json!(1), "read_file", json!({"path": "/tmp/crlf"}))
        ));
        let answer = gateway.recv();
        assert_eq!(answer["id"], 1, "{answer}");
        assert_eq!(answer["result"]["isError"], false, "{answer}");
    })
    .await
    .unwrap();
    assert_eq!(
        executed(&scratch.log()),
        vec![json!({"tool": "read_file", "arguments": {"path": "/tmp/crlf"}})]
    );
}

/// Go's `encoding/json` matches member names case-insensitively (`METHOD`
/// is `method`, `paramſ` is `params`, `PATH` is `path`), and of two that
/// fold alike the last wins: a Go server would run a call other than the
/// one judged. Every such message is refused, at any depth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r20_member_names_colliding_under_case_folding_are_refused() {
    let (mesh, _guard) = mesh_with_policy("smuggle-fold").await;
    let scratch = Scratch::new("smuggle-fold");
    let delete = r#"{"name":"delete_file","arguments":{"path":"/important"}}"#;
    let attacks: Vec<(&str, Value, String, &str)> = vec![
        (
            "METHOD after method",
            json!("c1"),
            format!(r#"{{"jsonrpc":"2.0","id":"c1","method":"ping","METHOD":"tools/call","params":{delete}}}"#),
            "METHOD",
        ),
        (
            "Method alone",
            json!("c2"),
            format!(r#"{{"jsonrpc":"2.0","id":"c2","Method":"tools/call","params":{delete}}}"#),
            "Method",
        ),
        (
            "Name after name",
            json!("c3"),
            r#"{"jsonrpc":"2.0","id":"c3","method":"tools/call","params":{"name":"read_file","Name":"delete_file","arguments":{"path":"/tmp/ok"}}}"#.to_owned(),
            "Name",
        ),
        (
            "paramſ after params",
            json!("c4"),
            format!(r#"{{"jsonrpc":"2.0","id":"c4","method":"tools/call","params":{{"name":"read_file","arguments":{{"path":"/tmp/ok"}}}},"paramſ":{delete}}}"#),
            "paramſ",
        ),
        (
            "Arguments after arguments",
            json!("c5"),
            r#"{"jsonrpc":"2.0","id":"c5","method":"tools/call","params":{"name":"read_file","arguments":{"path":"/tmp/ok"},"Arguments":{"path":"/etc/shadow"}}}"#.to_owned(),
            "Arguments",
        ),
        (
            "PATH after path in arguments",
            json!("c6"),
            r#"{"jsonrpc":"2.0","id":"c6","method":"tools/call","params":{"name":"read_file","arguments":{"path":"/tmp/ok","PATH":"/etc/shadow"}}}"#.to_owned(),
            "PATH",
        ),
        (
            "argumentſ after arguments",
            json!("c7"),
            r#"{"jsonrpc":"2.0","id":"c7","method":"tools/call","params":{"name":"read_file","arguments":{"path":"/tmp/ok"},"argumentſ":{"path":"/etc/passwd"}}}"#.to_owned(),
            "argumentſ",
        ),
    ];
    let upstream = vec![
        go_upstream().display().to_string(),
        scratch.log().display().to_string(),
    ];
    let log = scratch.log();
    let url = mesh.url.clone();
    tokio::task::spawn_blocking(move || {
        let mut gateway = RawGateway::start_with_stderr(&url, &[], upstream, Stdio::inherit());
        for (probe, (attack, id, line, what)) in attacks.iter().enumerate() {
            let before = send_and_probe(&mut gateway, line, probe);
            assert_nothing_forbidden(&log, attack);
            assert_refused(&before, id, what, attack);
        }
    })
    .await
    .unwrap();
    assert_eq!(executed(&scratch.log()).len(), 7, "only the probes ran");
}

/// The TypeScript SDK server on Streamable HTTP and `guardmesh mcp http` in
/// front of it; returns the gateway's endpoint URL and the upstream's log.
async fn ts_gateway(mesh: &str, scratch: &Scratch) -> (String, KillOnDrop, KillOnDrop) {
    let dir = ts_dir();
    let upstream_port = free_port();
    let upstream = listening(
        Command::new("node")
            .arg(dir.join("server.mjs"))
            .arg(scratch.log())
            .arg(upstream_port.to_string())
            .current_dir(&dir),
        upstream_port,
        "the TypeScript MCP server",
    )
    .await;
    let (url, gateway) = gateway_before(mesh, "127.0.0.1", upstream_port, &[]).await;
    (url, upstream, gateway)
}

/// A JSON-RPC batch whose tools/call the gateway cannot read (a repeated
/// `name`, `method`, `params` or `arguments`) was forwarded as the raw body,
/// and the TypeScript SDK takes the last of two equal members: the batch is
/// refused whole, as each element alone is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r20_a_batch_with_an_element_the_gateway_cannot_judge_is_refused_whole() {
    let (mesh, _guard) = mesh_with_policy("smuggle-batch").await;
    let scratch = Scratch::new("smuggle-batch");
    let (url, _upstream, _gateway) = ts_gateway(&mesh.url, &scratch).await;
    let ping = r#"{"jsonrpc":"2.0","id":"p","method":"ping"}"#;
    let elements = [
        (
            "a repeated name",
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"read_file","name":"delete_file","arguments":{"path":"/x"}}}"#,
        ),
        (
            "a repeated method",
            r#"{"jsonrpc":"2.0","id":3,"method":"ping","method":"tools/call","params":{"name":"delete_file","arguments":{"path":"/x"}}}"#,
        ),
        (
            "a repeated params",
            r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"read_file","arguments":{"path":"/x"}},"params":{"name":"delete_file","arguments":{"path":"/x"}}}"#,
        ),
        (
            "a repeated arguments",
            r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"read_file","arguments":{"path":"/x"},"arguments":{"path":"/etc/shadow"}}}"#,
        ),
    ];
    for (attack, element) in elements {
        for body in [
            format!("[{ping},{element}]"),
            format!("[{element}]"),
            element.to_owned(),
        ] {
            let (status, head, answer) = post(&url, None, &body).await;
            assert_nothing_forbidden(&scratch.log(), attack);
            assert_eq!(status, 200, "{attack}: {head}\n{answer}");
            let answer: Value = serde_json::from_str(answer.trim())
                .unwrap_or_else(|e| panic!("{attack}: {e}: {answer}"));
            let errors: Vec<&Value> = match &answer {
                Value::Array(items) => items.iter().collect(),
                one => vec![one],
            };
            assert!(
                !errors.is_empty()
                    && errors
                        .iter()
                        .all(|e| e["error"]["code"] == -32600 || e["error"]["code"] == -32602),
                "{attack}: {body} answered {answer}"
            );
        }
    }
    assert_eq!(
        executed(&scratch.log()),
        Vec::<Value>::new(),
        "nothing of a refused batch ran"
    );
    // A batch the gateway can read is still served.
    let body = format!(
        "[{ping},{}]",
        RawGateway::call(json!(9), "read_file", json!({"path": "/tmp/ok"}))
    );
    let (status, _, answer) = post(&url, None, &body).await;
    assert_eq!(status, 200, "{answer}");
    let answer: Value = serde_json::from_str(answer.trim()).unwrap();
    assert_eq!(answer.as_array().map(Vec::len), Some(2), "{answer}");
    assert_eq!(
        executed(&scratch.log()),
        vec![json!({"tool": "read_file", "arguments": {"path": "/tmp/ok"}})]
    );
}

// ---------------------------------------------------------------------------
// Property: what the gateway forwards is read alike by Python's `json`
// (through universal newlines, as the SDK reads stdin), JavaScript's
// `JSON.parse` (lines split at LF, as the TypeScript SDK's stdio) and Go's
// `encoding/json` (structs, case-insensitive), and is the call judged.
// ---------------------------------------------------------------------------

/// Python: one view per line read with universal newlines.
const PY_DECODER: &str = r#"
import io, json, sys
out = sys.stdout
for line in io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace"):
    line = line.rstrip("\n")
    if not line:
        continue
    try:
        m = json.loads(line)
    except Exception as e:
        out.write(json.dumps({"error": str(e)}) + "\n"); out.flush(); continue
    if isinstance(m, dict) and "sentinel" in m:
        out.write(line + "\n"); out.flush(); continue
    view = {}
    if isinstance(m, dict):
        view["method"] = m.get("method")
        view["id"] = m.get("id")
        p = m.get("params")
        if isinstance(p, dict):
            view["name"] = p.get("name")
            view["arguments"] = p.get("arguments")
    out.write(json.dumps(view) + "\n"); out.flush()
"#;

/// JavaScript: lines split at LF (a trailing CR dropped), as the TypeScript
/// SDK's stdio transport reads them.
const JS_DECODER: &str = r#"
let buf = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => {
  buf += chunk;
  let i;
  while ((i = buf.indexOf("\n")) >= 0) {
    const line = buf.slice(0, i).replace(/\r$/, "");
    buf = buf.slice(i + 1);
    if (!line) continue;
    let m;
    try { m = JSON.parse(line); } catch (e) { process.stdout.write(JSON.stringify({ error: String(e) }) + "\n"); continue; }
    if (m && typeof m === "object" && "sentinel" in m) { process.stdout.write(line + "\n"); continue; }
    const view = {};
    if (m && typeof m === "object" && !Array.isArray(m)) {
      view.method = m.method ?? null;
      view.id = m.id ?? null;
      const p = m.params;
      if (p && typeof p === "object" && !Array.isArray(p)) {
        view.name = p.name ?? null;
        view.arguments = p.arguments ?? null;
      }
    }
    process.stdout.write(JSON.stringify(view) + "\n");
  }
});
"#;

/// A long-lived decoder process fed one message per line.
struct Decoder {
    name: &'static str,
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    sentinel: u64,
}

impl Decoder {
    fn start(name: &'static str, mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start the {name} decoder: {e}"));
        let stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        Self {
            name,
            child,
            stdin,
            stdout,
            sentinel: 0,
        }
    }

    /// Every view the decoder printed for `text` (one line, a newline
    /// added): exactly one unless it split the line.
    fn views(&mut self, text: &str) -> Vec<Value> {
        use std::io::{BufRead, Write};
        self.sentinel += 1;
        let sentinel = json!({"sentinel": self.sentinel});
        write!(self.stdin, "{text}\n{sentinel}\n").unwrap();
        self.stdin.flush().unwrap();
        let mut views = Vec::new();
        loop {
            let mut line = String::new();
            assert!(
                self.stdout.read_line(&mut line).unwrap() > 0,
                "the {} decoder ended",
                self.name
            );
            let value: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("{}: {e}: {line:?}", self.name));
            if value == sentinel {
                return views;
            }
            views.push(value);
        }
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Numbers as doubles, so that `1`, `1.0` and `1e0` from three languages
/// compare equal; `null` members dropped (absent and null read alike here).
fn normal(value: &Value) -> Value {
    match value {
        Value::Number(n) => json!(n.as_f64()),
        Value::Array(items) => Value::Array(items.iter().map(normal).collect()),
        Value::Object(members) => Value::Object(
            members
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), normal(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// A generated JSON text, with whatever peers might read differently:
/// repeated names, case variants, CRs and odd line breaks, nesting.
#[derive(Debug, Clone)]
enum Gen {
    Atom(String),
    Array(Vec<Gen>),
    Object(Vec<(String, Gen)>),
}

/// Whitespace between tokens: mostly none; sometimes a CR.
fn render(tree: &Gen, ws: &[&str], at: &mut usize, out: &mut String) {
    fn pad(ws: &[&str], at: &mut usize, out: &mut String) {
        *at += 1;
        out.push_str(ws[*at % ws.len()]);
    }
    match tree {
        Gen::Atom(text) => out.push_str(text),
        Gen::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                pad(ws, at, out);
                render(item, ws, at, out);
            }
            out.push(']');
        }
        Gen::Object(members) => {
            out.push('{');
            for (i, (key, value)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                pad(ws, at, out);
                out.push_str(&serde_json::to_string(key).unwrap());
                out.push(':');
                pad(ws, at, out);
                render(value, ws, at, out);
            }
            out.push('}');
        }
    }
}

mod strategies {
    use super::Gen;
    use proptest::prelude::*;

    /// A member name and its case variants as Go would match them.
    pub(super) fn name(base: &'static str) -> impl Strategy<Value = String> {
        (any::<u32>(), 0..10u8).prop_map(move |(bits, how)| match how {
            0..=5 => base.to_owned(),
            6 | 7 => base
                .chars()
                .enumerate()
                .map(|(i, c)| {
                    if bits >> (i % 32) & 1 == 1 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    }
                })
                .collect(),
            _ => base.replace('s', "\u{17F}").replace('k', "\u{212A}"),
        })
    }

    pub(super) fn scalar() -> impl Strategy<Value = Gen> {
        prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            (-1000i64..1000).prop_map(|n| n.to_string()),
            Just("1.50".to_owned()),
            Just("-0.25".to_owned()),
            Just("1e3".to_owned()),
            "[a-z/ .]{0,8}".prop_map(|s| serde_json::to_string(&s).unwrap()),
            Just("\"a\u{2028}b\u{2029}c\u{85}d\"".to_owned()),
            Just("\"\\r\\n\\u2028\"".to_owned()),
            Just("\"caf\u{e9} \u{1F600}\"".to_owned()),
        ]
        .prop_map(Gen::Atom)
    }

    /// Arguments: members drawn from a few names (with variants and
    /// repeats), values nested up to three levels.
    pub(super) fn arguments() -> impl Strategy<Value = Gen> {
        let value = scalar().prop_recursive(3, 16, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Gen::Array),
                prop::collection::vec((name("mask"), inner), 0..3).prop_map(Gen::Object),
            ]
        });
        let key = prop_oneof![
            name("path"),
            name("to"),
            name("amount"),
            name("mask"),
            Just("x".to_owned())
        ];
        prop::collection::vec((key, value), 0..3).prop_map(Gen::Object)
    }

    /// One JSON-RPC message, possibly with a smuggled or ambiguous member.
    pub(super) fn message() -> impl Strategy<Value = Gen> {
        let method = prop_oneof![
            3 => Just("tools/call"),
            1 => Just("ping"),
            1 => Just("tools/list"),
            1 => Just("notifications/progress"),
        ];
        let tool = prop_oneof![Just("read_file"), Just("delete_file"), Just("pay")];
        let id = prop_oneof![
            (0u32..100).prop_map(|n| n.to_string()),
            "[a-z]{1,4}".prop_map(|s| format!("\"{s}\"")),
        ];
        let id = prop_oneof![9 => id, 1 => Just("null".to_owned())];
        (
            method,
            tool.clone(),
            id,
            arguments(),
            prop::option::weighted(0.1, (name("params"), tool_params_extra())),
            prop::option::weighted(0.1, (name("method"), Just("\"tools/call\""))),
            prop::option::weighted(0.1, (name("name"), tool)),
            prop::option::weighted(0.1, (name("arguments"), arguments())),
            prop::bool::weighted(0.9),
        )
            .prop_map(
                |(
                    method,
                    tool,
                    id,
                    args,
                    extra_params,
                    extra_method,
                    extra_name,
                    extra_args,
                    with_id,
                )| {
                    let mut params = vec![
                        ("name".to_owned(), Gen::Atom(format!("\"{tool}\""))),
                        ("arguments".to_owned(), args),
                    ];
                    if let Some((key, name)) = extra_name {
                        params.push((key, Gen::Atom(format!("\"{name}\""))));
                    }
                    if let Some((key, args)) = extra_args {
                        params.push((key, args));
                    }
                    let mut members = vec![("jsonrpc".to_owned(), Gen::Atom("\"2.0\"".into()))];
                    if with_id {
                        members.push(("id".to_owned(), Gen::Atom(id)));
                    }
                    members.push(("method".to_owned(), Gen::Atom(format!("\"{method}\""))));
                    members.push(("params".to_owned(), Gen::Object(params)));
                    if let Some((key, value)) = extra_method {
                        members.push((key, Gen::Atom(value.to_owned())));
                    }
                    if let Some((key, value)) = extra_params {
                        members.push((key, value));
                    }
                    Gen::Object(members)
                },
            )
    }

    fn tool_params_extra() -> impl Strategy<Value = Gen> {
        arguments().prop_map(|args| {
            Gen::Object(vec![
                ("name".to_owned(), Gen::Atom("\"delete_file\"".into())),
                ("arguments".to_owned(), args),
            ])
        })
    }

    /// A message or a batch of up to three, rendered with whitespace that
    /// is sometimes a CR.
    pub(super) fn line() -> impl Strategy<Value = (Gen, Vec<&'static str>)> {
        let tree = prop_oneof![
            3 => message(),
            1 => prop::collection::vec(message(), 1..4).prop_map(Gen::Array),
        ];
        let ws = prop::collection::vec(
            prop_oneof![16 => Just(""), 4 => Just(" "), 2 => Just("\t"), 1 => Just("\r")],
            1..6,
        );
        (tree, ws)
    }
}

/// What each peer reads in a forwarded text equals what the gateway
/// judged; returns a description of the first difference.
fn check_forwarded(
    text: &str,
    judged: Option<(&str, &str)>,
    decoders: &mut [Decoder],
) -> Result<(), String> {
    if text.contains(['\r', '\n', '\u{85}', '\u{2028}', '\u{2029}']) {
        return Err(format!("a line break forwarded raw: {text:?}"));
    }
    let mut seen: Vec<(&'static str, Value)> = Vec::new();
    for decoder in decoders.iter_mut() {
        let views = decoder.views(text);
        let [view] = &views[..] else {
            return Err(format!(
                "{} read {} messages in {text:?}: {views:?}",
                decoder.name,
                views.len()
            ));
        };
        seen.push((decoder.name, view.clone()));
    }
    let plain = |v: &Value| {
        let mut v = normal(v);
        if let Value::Object(m) = &mut v {
            m.remove("known");
        }
        v
    };
    let first = plain(&seen[0].1);
    for (name, view) in &seen[1..] {
        if plain(view) != first {
            return Err(format!(
                "{} and {name} differ on {text:?}: {first} / {}",
                seen[0].0,
                plain(view)
            ));
        }
    }
    match judged {
        Some((tool, arguments)) => {
            let arguments: Value = if arguments.is_empty() {
                Value::Null
            } else {
                serde_json::from_str(arguments).unwrap()
            };
            if first["method"] != "tools/call"
                || first["name"] != tool
                || normal(&first["arguments"]) != normal(&arguments)
            {
                return Err(format!(
                    "judged {tool} {arguments} but peers read {first} in {text:?}"
                ));
            }
            // Go's struct fields, matched case-insensitively, hold the
            // member of the judged arguments of that name.
            if let Some((_, go)) = seen.iter().find(|(n, _)| *n == "go") {
                for field in ["path", "to", "amount", "mask"] {
                    let expected = arguments
                        .as_object()
                        .and_then(|m| {
                            m.iter()
                                .find(|(k, _)| guardmesh_client::casefold::equal_fold(k, field))
                        })
                        .map_or(Value::Null, |(_, v)| v.clone());
                    if normal(&go["known"][field]) != normal(&expected) {
                        return Err(format!(
                            "Go's field {field} is {} where {expected} was judged, in {text:?}",
                            go["known"][field]
                        ));
                    }
                }
            }
        }
        None => {
            if first["method"] == "tools/call" {
                return Err(format!("an unjudged tools/call forwarded: {text:?}"));
            }
        }
    }
    Ok(())
}

/// See the section's heading. Bounded: 300 cases (`PROPTEST_CASES` to
/// change), each a line through `classify_line` and every forwarded text
/// through the three decoders.
#[test]
fn r31_what_is_forwarded_is_read_alike_by_python_javascript_and_go() {
    use guardmesh_gateway::jsonrpc::{Incoming, Item, classify_line};
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let decoders = vec![
        Decoder::start("python", {
            let mut c = Command::new(crate::mcp::mcp_python());
            c.args(["-c", PY_DECODER]);
            c
        }),
        Decoder::start("javascript", {
            let mut c = Command::new("node");
            c.args(["-e", JS_DECODER]);
            c
        }),
        Decoder::start("go", {
            let mut c = Command::new(go_upstream());
            c.arg("decode");
            c
        }),
    ];
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let decoders = std::cell::RefCell::new(decoders);
    let (forwarded, refused) = (std::cell::Cell::new(0usize), std::cell::Cell::new(0usize));
    let result = runner.run(&strategies::line(), |(tree, ws)| {
        let mut text = String::new();
        render(&tree, &ws, &mut 0, &mut text);
        let fail = |e: String| TestCaseError::fail(e);
        let one = |item: Item| -> Result<(), TestCaseError> {
            let mut decoders = decoders.borrow_mut();
            match item {
                Item::Forward { text, .. } => {
                    forwarded.set(forwarded.get() + 1);
                    check_forwarded(&text, None, &mut decoders).map_err(fail)
                }
                Item::ToolCall(call) => {
                    forwarded.set(forwarded.get() + 1);
                    let out = call
                        .forward(&call.name, &call.arguments)
                        .map_err(|e| fail(e.to_string()))?;
                    check_forwarded(&out, Some((&call.name, &call.arguments)), &mut decoders)
                        .map_err(fail)
                }
                Item::Reject { .. } | Item::Drop(_) => {
                    refused.set(refused.get() + 1);
                    Ok(())
                }
            }
        };
        match classify_line(text.as_bytes()) {
            Ok(Incoming::Single(item)) => one(item)?,
            Ok(Incoming::Batch(items)) => {
                for item in items {
                    one(item)?;
                }
            }
            Err(_) => refused.set(refused.get() + 1),
        }
        Ok(())
    });
    if let Err(error) = result {
        panic!("{error}");
    }
    let (forwarded, refused) = (forwarded.get(), refused.get());
    eprintln!("property: {forwarded} forwarded, {refused} refused");
    assert!(
        forwarded > 0 && refused > 0,
        "the generator exercises both: {forwarded} / {refused}"
    );
}

/// The gateway's case folding (`guardmesh_client::casefold`) is Go's:
/// every rune Go's `encoding/json` folds to another folds to the same one
/// here; the few runes folded here and not by this Go are letters of a
/// later Unicode version than this Go's.
#[test]
fn r20_r31_case_folding_is_gos_for_every_rune() {
    use guardmesh_client::casefold;
    use std::io::{BufRead, Write};
    let mut go = Command::new(go_upstream())
        .arg("fold")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let runes: Vec<char> = (0..=0x10FFFFu32).filter_map(char::from_u32).collect();
    let chunks: Vec<String> = runes.chunks(4096).map(|c| c.iter().collect()).collect();
    let mut stdin = go.stdin.take().unwrap();
    let input: String = chunks
        .iter()
        .map(|c| serde_json::to_string(c).unwrap() + "\n")
        .collect();
    let writer = std::thread::spawn(move || {
        stdin.write_all(input.as_bytes()).unwrap();
    });
    let mut stdout = std::io::BufReader::new(go.stdout.take().unwrap());
    let (mut agreed, mut later) = (0usize, Vec::new());
    for chunk in &chunks {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let folded: String = serde_json::from_str(&line).unwrap();
        for (c, g) in chunk.chars().zip(folded.chars()) {
            let ours = casefold::fold_char(c);
            if g != c {
                assert_eq!(ours, g, "U+{:04X}", u32::from(c));
                agreed += 1;
            } else if ours != c {
                later.push(c);
            }
        }
        assert_eq!(folded.chars().count(), chunk.chars().count());
    }
    writer.join().unwrap();
    let _ = go.wait();
    assert!(agreed > 1300, "{agreed}");
    assert!(
        later.len() < 200 && later.iter().all(|c| u32::from(*c) >= 0x1C80),
        "folded here, not by Go: {later:?}"
    );
}
