//! Guards as real separate processes: `guardmesh example-guard`, the Python
//! and Node kits (installed by `scripts/setup-polyglot`), and the
//! conformance kit run against them.

use super::*;

/// Runs `guardmesh ARGS...` to its end: its output.
pub(crate) fn guardmesh(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(args)
        .output()
        .expect("run guardmesh")
}

/// [`guardmesh`] off the runtime's thread: for commands that talk to a mesh
/// this test's runtime serves.
pub(crate) async fn guardmesh_off_thread(
    args: impl IntoIterator<Item = impl Into<String>>,
) -> std::process::Output {
    let args: Vec<String> = args.into_iter().map(Into::into).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        guardmesh(&args)
    })
    .await
    .unwrap()
}

/// A child process, killed (and reaped) when dropped.
pub(crate) struct KillOnDrop(pub std::process::Child);

impl KillOnDrop {
    /// Kills the process (SIGKILL) and reaps it.
    pub(crate) fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits (bounded: 20 s) for `child`, spawned with its stderr piped, to
/// exit: its exit status (none: it was still running, and is killed) and
/// what it wrote to stderr.
pub(crate) fn exit_within_20s(
    child: &mut std::process::Child,
) -> (Option<std::process::ExitStatus>, String) {
    let mut exited = None;
    for _ in 0..400 {
        if let Some(status) = child.try_wait().unwrap() {
            exited = Some(status);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if exited.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    (exited, stderr)
}

/// Waits (bounded: 15 s) until something accepts on loopback `port`;
/// `what` names it in the failure.
pub(crate) async fn wait_for_port(port: u16, what: &str) {
    for _ in 0..300 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} did not start listening on {port}");
}

/// Runs `command` with `input` on its stdin, its stdout and stderr
/// captured: its output.
pub(crate) fn run_with_input(
    command: &mut std::process::Command,
    input: &[u8],
) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {command:?}: {e}"));
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// A guard running as a real separate process: `guardmesh example-guard`.
pub(crate) struct GuardProcess {
    pub url: String,
    pub port: u16,
    child: KillOnDrop,
}

impl GuardProcess {
    /// Starts `guardmesh example-guard KIND ARGS...` on `port` (0 = any)
    /// and waits for its `LISTENING <port>` line.
    pub(crate) fn start(kind: &str, port: u16, args: &[&str]) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args([
                "example-guard",
                kind,
                "--listen",
                &format!("127.0.0.1:{port}"),
            ])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("start guard process");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read LISTENING line");
        let port = listening_port(&line, kind);
        Self {
            url: format!("http://127.0.0.1:{port}"),
            port,
            child: KillOnDrop(child),
        }
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub(crate) fn kill(&mut self) {
        self.child.kill();
    }
}

// ---------------------------------------------------------------------------
// Polyglot guards (issue 5): the Python and Node example guards of `guards/`
// as real separate processes. They need `scripts/setup-polyglot` (which
// `scripts/test` runs before `cargo test`).
// ---------------------------------------------------------------------------

/// The repository's root folder.
pub(crate) fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("server/ has a parent")
        .to_path_buf()
}

/// `build/venv/bin/python`, with the `guardmesh` package installed; panics
/// with what to run when it is missing.
pub(crate) fn python() -> std::path::PathBuf {
    let root = repo_root();
    let python = root.join("build/venv/bin/python");
    assert!(
        python.exists(),
        "the Python guard kit is not set up ({} missing): \
         run scripts/setup-polyglot (scripts/test runs it before cargo test)",
        python.display()
    );
    python
}

/// `node`, with the Node kit's packages installed under `guards/node`;
/// panics with what to run when they are missing.
pub(crate) fn node() -> std::path::PathBuf {
    let modules = repo_root().join("guards/node/node_modules/@grpc/grpc-js");
    assert!(
        modules.is_dir(),
        "the Node guard kit is not set up ({} missing): run scripts/setup-polyglot \
         (scripts/test runs it before cargo test)",
        modules.display()
    );
    let node = std::path::PathBuf::from(std::env::var_os("NODE").unwrap_or_else(|| "node".into()));
    let works = std::process::Command::new(&node)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        works,
        "`{}` does not run: install Node.js 20 and run scripts/setup-polyglot",
        node.display()
    );
    node
}

/// A guard of the Python or Node kit running as a separate process.
pub(crate) struct KitGuard {
    pub url: String,
    /// `127.0.0.1:PORT`, for `guardmesh conformance --guard`.
    pub addr: String,
    pub port: u16,
    child: KillOnDrop,
}

impl KitGuard {
    /// Starts `guards/python/examples/SCRIPT ARGS...` (with `--port 0`
    /// unless ARGS has a `--port`) and waits for its `LISTENING` line.
    pub(crate) fn python(script: &str, args: &[&str]) -> Self {
        let mut command = std::process::Command::new(python());
        command.arg(repo_root().join("guards/python/examples").join(script));
        Self::spawn(command, script, args)
    }

    /// Starts `node guards/node/examples/SCRIPT ARGS...` likewise.
    pub(crate) fn node(script: &str, args: &[&str]) -> Self {
        let mut command = std::process::Command::new(node());
        command.arg(repo_root().join("guards/node/examples").join(script));
        Self::spawn(command, script, args)
    }

    fn spawn(mut command: std::process::Command, script: &str, args: &[&str]) -> Self {
        use std::io::BufRead;
        if !args.contains(&"--port") {
            command.args(["--port", "0"]);
        }
        let mut child = command
            .args(args)
            .current_dir(repo_root())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {script}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let (line_tx, line_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = std::io::BufReader::new(stdout).lines();
            let _ = line_tx.send(lines.next());
            // Keep draining: the contract says nothing more comes, but a
            // closed pipe must not kill the guard if something does.
            for _ in lines {}
        });
        let line = match line_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Some(Ok(line))) => line,
            other => {
                let _ = child.kill();
                let status = child.wait();
                panic!("{script} {args:?} printed no LISTENING line ({other:?}); exit: {status:?}")
            }
        };
        let port = listening_port(&line, script);
        Self {
            url: format!("http://127.0.0.1:{port}"),
            addr: format!("127.0.0.1:{port}"),
            port,
            child: KillOnDrop(child),
        }
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub(crate) fn kill(&mut self) {
        self.child.kill();
    }
}

/// Runs `guardmesh conformance --guard ADDR ARGS...`; returns its exit
/// status and stdout (its stderr is passed through).
pub(crate) fn run_conformance(addr: &str, args: &[&str]) -> (std::process::ExitStatus, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["conformance", "--guard", addr])
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run guardmesh conformance");
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

/// The R21 status of `guard` in a decision's trace.
pub(crate) fn status_of(
    decision: &guardmesh_client::BatchDecision,
    guard: &str,
) -> guardmesh_client::proto::TraceStatus {
    let entry = decision
        .trace
        .iter()
        .find(|t| t.guard == guard)
        .unwrap_or_else(|| panic!("no trace entry for {guard}: {:?}", decision.trace));
    guardmesh_client::proto::TraceStatus::try_from(entry.status).unwrap()
}

/// The port of a guard process's `LISTENING <port>` line, the first line
/// every example guard (Rust, Python, Node) prints once it serves.
pub(crate) fn listening_port(line: &str, what: &str) -> u16 {
    line.trim()
        .strip_prefix("LISTENING ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{what}: unexpected first line {line:?}"))
}

/// A Python guard script run as a replica that takes commands: it prints
/// its `LISTENING` line first, then answers each line written to its
/// stdin with one line ([`ScriptedReplica::ask`]). Killed when dropped.
pub(crate) struct ScriptedReplica {
    pub url: String,
    _child: KillOnDrop,
    stdin: std::process::ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ScriptedReplica {
    /// Starts `script` with the checkout's Python package; `what` names
    /// it in failures.
    pub(crate) fn start(script: &std::path::Path, what: &str) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(python())
            .arg(script)
            .env("PYTHONPATH", repo_root().join("guards/python/src"))
            .current_dir(repo_root())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("start a Python replica");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("the replica prints LISTENING");
        let port = listening_port(&first, what);
        Self {
            url: format!("http://127.0.0.1:{port}"),
            _child: KillOnDrop(child),
            stdin,
            lines,
        }
    }

    /// Writes `command` as a line and returns the replica's answer (within
    /// 10 s).
    pub(crate) fn ask(&mut self, command: &str) -> String {
        use std::io::Write;
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        self.lines
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("the replica answers {command:?}"))
    }
}
