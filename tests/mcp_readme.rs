//! The "Agents and MCP" configuration snippets of `docs/mcp-and-hooks.md`,
//! tested as written (R31): each is read from that page at test time, so an
//! edit to the docs is what gets tested, and run as an agent host runs it.
//!
//! * The `mcpServers` entry: its `command` and `args` are spawned exactly as
//!   given by the official Python MCP SDK's stdio client, which then talks
//!   MCP through them. `guardmesh` is found on `PATH` (the built binary's
//!   folder comes first); the upstream server command after `--` is found
//!   on `PATH` too, where the test puts a stand-in of that name that records
//!   its arguments and runs the test's MCP server.
//! * The `PreToolUse` hook: its `command` string runs through `sh -c` with a
//!   recorded `PreToolUse` payload on stdin, and its JSON answer is checked.
//!
//! The only text replaced is the mesh address the snippets use (the mesh's
//! default, `http://127.0.0.1:50051`), by the test mesh's address on a port
//! of its own; it must appear exactly once in each snippet.

use crate::harness::*;
use crate::mcp::{Scratch, calls, mcp_python, mesh_with_policy, sdk_dir};
use guardmesh_client::Registration;
use guardmesh_client::verdict::{rewrite_arguments, steer};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The mesh address the docs' snippets use.
const DOCS_MESH: &str = "http://127.0.0.1:50051";
/// The page that holds the snippets, relative to the repository's root.
const PAGE: &str = "docs/mcp-and-hooks.md";
const SECTION: &str = "## Agents and MCP";

/// The page's "Agents and MCP" section: from its heading to the next
/// second-level heading.
fn section() -> String {
    let readme = std::fs::read_to_string(repo_root().join(PAGE)).unwrap();
    let start = readme
        .lines()
        .position(|l| l.starts_with(SECTION))
        .unwrap_or_else(|| panic!("{PAGE} has no section {SECTION:?}"));
    readme
        .lines()
        .skip(start)
        .enumerate()
        .take_while(|(i, l)| *i == 0 || !l.starts_with("## "))
        .map(|(_, l)| l)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The one ```json block of the section whose object has `key` at its top
/// level, parsed.
fn snippet(key: &str) -> Value {
    let section = section();
    let mut blocks = Vec::new();
    let mut lines = section.lines();
    while let Some(line) = lines.next() {
        if line.trim() == "```json" {
            let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
            blocks.push(body.join("\n"));
        }
    }
    let matching: Vec<Value> = blocks
        .iter()
        .filter_map(|b| serde_json::from_str::<Value>(b).ok())
        .filter(|v| v.get(key).is_some())
        .collect();
    assert_eq!(
        matching.len(),
        1,
        "{PAGE}'s {SECTION:?} section should hold exactly one valid ```json block with \
         a top-level {key:?} (found {} json blocks)",
        blocks.len()
    );
    matching.into_iter().next().unwrap()
}

/// Replaces the docs' mesh address by `mesh` in the one string holding it.
fn with_mesh(strings: &[String], mesh: &str) -> Vec<String> {
    let holding = strings.iter().filter(|s| s.contains(DOCS_MESH)).count();
    assert_eq!(
        holding, 1,
        "the snippet should name the mesh {DOCS_MESH} exactly once: {strings:?}"
    );
    strings.iter().map(|s| s.replace(DOCS_MESH, mesh)).collect()
}

/// `PATH` with the built `guardmesh`'s folder first, then `extra`.
fn path_with(extra: &[&Path]) -> std::ffi::OsString {
    let binary = Path::new(env!("CARGO_BIN_EXE_guardmesh"));
    let mut dirs: Vec<PathBuf> = vec![binary.parent().unwrap().to_path_buf()];
    dirs.extend(extra.iter().map(|p| p.to_path_buf()));
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(dirs).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_readme_mcp_servers_entry_runs_as_written() {
    let entry = snippet("mcpServers");
    let servers = entry["mcpServers"].as_object().expect("mcpServers object");
    assert_eq!(servers.len(), 1, "{servers:?}");
    let (_, server) = servers.iter().next().unwrap();
    for key in server.as_object().expect("a server entry object").keys() {
        assert!(
            ["command", "args", "env"].contains(&key.as_str()),
            "a key this test does not run as a host would: {key}"
        );
    }
    let command = server["command"].as_str().expect("command").to_owned();
    let args: Vec<String> = server["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string args").to_owned())
        .collect();
    // A path to guardmesh is the one thing that differs per machine;
    // a bare name is found on PATH.
    let command = if command.contains('/') {
        assert!(command.ends_with("/guardmesh"), "{command}");
        env!("CARGO_BIN_EXE_guardmesh").to_owned()
    } else {
        command
    };
    let (mesh, guard) = mesh_with_policy("mcp-readme").await;
    let args = with_mesh(&args, &mesh.url);

    // The upstream server command, as the gateway will start it.
    let dash = args
        .iter()
        .position(|a| a == "--")
        .expect("the upstream command follows `--`");
    let upstream = &args[dash + 1..];
    let program = upstream.first().expect("an upstream command");
    assert!(
        !program.contains('/'),
        "the upstream command should be found on PATH: {program}"
    );
    // A stand-in of the same name on PATH: records its arguments, then runs
    // the test's MCP server (the official SDK's, logging what it executes).
    let scratch = Scratch::new("readme");
    let bin = scratch.dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let argv = scratch.dir.join("upstream-argv");
    let script = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$@\" > '{}'\nexec '{}' '{}' '{}' stdio\n",
        argv.display(),
        mcp_python().display(),
        sdk_dir().join("upstream.py").display(),
        scratch.log().display(),
    );
    let stand_in = bin.join(program);
    std::fs::write(&stand_in, script).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&stand_in, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    let mut scenario = json!({"mode": "legacy", "steps": [
        {"op": "list_tools"},
        {"op": "call", "name": "read_file", "arguments": {"path": "/etc/shadow"}},
        {"op": "call", "name": "delete_file", "arguments": {"path": "/home/a"}},
        {"op": "call", "name": "pay", "arguments": {"amount": 5, "to": "bob"}},
    ]});
    if let Some(env) = server.get("env") {
        scenario["env"] = with_mesh_env(env, &mesh.url);
    }
    let path = path_with(&[&bin]);
    let mut target = vec!["stdio".to_owned(), command];
    target.extend(args.iter().cloned());
    let output = tokio::task::spawn_blocking(move || {
        Command::new(mcp_python())
            .arg(sdk_dir().join("client.py"))
            .arg(scenario.to_string())
            .args(&target)
            .env("PATH", path)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the MCP client could not run the docs' entry: {}\nstdout: {stdout}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let listed = lines.iter().find(|l| l["op"] == "list_tools").unwrap();
    assert_eq!(listed["tools"].as_array().unwrap().len(), 4, "{lines:?}");
    let results = calls(&lines);
    assert_eq!(results.len(), 3, "{lines:?}");
    assert_eq!(results[0]["text"][0], "contents of /redacted");
    assert_eq!(results[1]["isError"], true);
    assert_eq!(results[1]["text"][0], "deleting is not allowed; use trash");
    assert_eq!(results[2]["text"][0], "paid 5.0 to bob");
    // The gateway started the upstream with the snippet's arguments, and
    // every call went through the mesh: the steered one never ran.
    let recorded = std::fs::read_to_string(&argv).unwrap();
    assert_eq!(
        recorded.lines().collect::<Vec<_>>(),
        upstream[1..].iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert_eq!(
        scratch.executed(),
        vec![
            json!({"tool": "read_file", "arguments": {"path": "/redacted"}}),
            json!({"tool": "pay", "arguments": {"amount": 5.0, "to": "bob"}}),
        ]
    );
    assert_eq!(guard.guard.batches().len(), 3);
}

/// The entry's `env`, with the mesh address replaced where it appears.
fn with_mesh_env(env: &Value, mesh: &str) -> Value {
    let env = env.as_object().expect("env object");
    Value::Object(
        env.iter()
            .map(|(k, v)| {
                let v = v.as_str().expect("string env values");
                (k.clone(), json!(v.replace(DOCS_MESH, mesh)))
            })
            .collect(),
    )
}

/// A `PreToolUse` payload as an agent host sends it: the host's fields,
/// its tool names, and fields the hook does not read.
fn recorded_payload(tool: &str, input: Value) -> String {
    json!({
        "session_id": "9a1f6c2e-5b1d-4c55-9d0e-2f3a8b7c6d10",
        "transcript_path": "/home/dev/.agent/projects/-home-dev-shop/9a1f6c2e-5b1d-4c55-9d0e-2f3a8b7c6d10.jsonl",
        "cwd": "/home/dev/shop",
        "permission_mode": "default",
        "hook_event_name": "PreToolUse",
        "tool_name": tool,
        "tool_input": input,
        "tool_use_id": "toolu_01Hx7vTqYkq2m3QeZ5R8bNcd",
    })
    .to_string()
}

/// Runs the hook's command string with `sh -c` as the host does, `input`
/// on stdin: (exit code, stdout); panics with its stderr unless it exits 0.
fn run_hook(command: &str, input: &str) -> (i32, String) {
    let output = run_with_input(
        Command::new("sh")
            .arg("-c")
            .arg(command)
            .env("PATH", path_with(&[])),
        input.as_bytes(),
    );
    assert!(
        output.status.success(),
        "the docs' hook command failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_readme_pre_tool_use_hook_runs_as_written() {
    let settings = snippet("hooks");
    let entries = settings["hooks"]["PreToolUse"]
        .as_array()
        .expect("hooks.PreToolUse array");
    let mut commands = Vec::new();
    for entry in entries {
        // Every tool goes to the mesh: the matcher matches all of them.
        let matcher = entry.get("matcher").and_then(Value::as_str).unwrap_or("");
        assert!(
            matcher == "*" || matcher.is_empty(),
            "the hook should apply to every tool: {entry}"
        );
        for hook in entry["hooks"].as_array().expect("hooks array") {
            assert_eq!(hook["type"], "command", "{hook}");
            commands.push(hook["command"].as_str().expect("command").to_owned());
        }
    }
    assert_eq!(commands.len(), 1, "{commands:?}");

    // Bash `rm -rf` steered; Read of /etc/* rewritten; the rest proceeds.
    let mesh = MeshProcess::start("mcp-readme-hook", "", None).await;
    let guard = call_guard(Duration::ZERO, |call| {
        let input: Value = serde_json::from_str(&call.arguments).unwrap_or(json!({}));
        match call.tool.as_str() {
            "Bash" if input["command"].as_str().unwrap_or("").contains("rm -rf") => {
                Some(steer(&call.call_id, "rm -rf is not allowed here"))
            }
            "Read"
                if input["file_path"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with("/etc/") =>
            {
                Some(rewrite_arguments(
                    &call.call_id,
                    &json!({"file_path": "/dev/null"}),
                ))
            }
            _ => None,
        }
    })
    .await;
    mesh.register(Registration::mutate("policy", &guard.url, ["Read"]))
        .await;
    let command = with_mesh(&commands, &mesh.url).remove(0);
    tokio::task::spawn_blocking(move || {
        let (code, out) = run_hook(
            &command,
            &recorded_payload(
                "Bash",
                json!({"command": "rm -rf /srv/shop", "description": "clean"}),
            ),
        );
        assert_eq!(code, 0);
        let out: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(out["hookSpecificOutput"]["hookEventName"], "PreToolUse");
        assert_eq!(out["hookSpecificOutput"]["permissionDecision"], "deny");
        assert_eq!(
            out["hookSpecificOutput"]["permissionDecisionReason"],
            "rm -rf is not allowed here"
        );
        let (code, out) = run_hook(
            &command,
            &recorded_payload("Read", json!({"file_path": "/etc/shadow"})),
        );
        assert_eq!(code, 0);
        let out: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(out["hookSpecificOutput"]["permissionDecision"], "ask");
        assert_eq!(
            out["hookSpecificOutput"]["updatedInput"],
            json!({"file_path": "/dev/null"})
        );
        let (code, out) = run_hook(
            &command,
            &recorded_payload("Bash", json!({"command": "ls -la"})),
        );
        assert_eq!((code, out.as_str()), (0, ""), "proceed: the host decides");
    })
    .await
    .unwrap();
    let batches = guard.guard.batches();
    assert_eq!(batches.len(), 3, "every run reached the mesh");
    assert_eq!(
        batches[0].context.as_ref().unwrap().session_id,
        "9a1f6c2e-5b1d-4c55-9d0e-2f3a8b7c6d10"
    );
}
