//! The integration tests' harness, split by role. Everything here runs on
//! 127.0.0.1 with port 0 and stops with its handle (`Drop`).
//!
//! * [`mesh`]: the mesh under test, in process or as a `guardmesh serve`
//!   process.
//! * [`guards`]: scripted and misbehaving guards served in process.
//! * [`processes`]: guards as separate processes (Rust, Python, Node) and the
//!   conformance kit.
//! * [`coordinator`]: raw protobuf bytes towards `PreToolService`, raw HTTP
//!   towards the MCP gateway.
//! * [`pki`]: certificates for secured meshes.
//! * [`measure`]: memory measurements.
//! * [`otlp`]: an OTLP/gRPC collector for exported spans and log records.
//! * [`replicas`]: what a guard run as replicas decides, and which replica
//!   judged each batch.

use guardmesh_client::proto::guard_service_server::{GuardService, GuardServiceServer};
use guardmesh_client::proto::{GuardBatch, JudgeRequest, JudgeResponse, Verdict};
use guardmesh_client::{Coordinator, Guard, Registrar, Registration};
use guardmesh_server::{MemoryRegistry, Mesh, MeshConfig, Server};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Status;

/// One `[[rule]]` of a policy file, as text: `name` and `action` plain,
/// `tools` a list of patterns, `when`, `message` and `labels` as their
/// TOML values are written (quotes included); the fields come out in the
/// order a policy file has them. Rules put one after the other with
/// `concat!` make a policy of several rules.
macro_rules! policy_rule {
    (
        name: $name:literal,
        $(tools: [$($tool:literal),+],)?
        action: $action:literal,
        when: $when:literal,
        message: $message:literal
        $(, labels: $labels:literal)? $(,)?
    ) => {
        concat!(
            "\n[[rule]]\nname = \"", $name, "\"\n",
            $("tools = [", $crate::harness::policy_rule!(@list $($tool),+), "]\n",)?
            "when = ", $when, "\n",
            "action = \"", $action, "\"\n",
            "message = ", $message, "\n",
            $("labels = ", $labels, "\n",)?
        )
    };
    (@list $first:literal $(, $rest:literal)*) => {
        concat!("\"", $first, "\"", $(", \"", $rest, "\"",)*)
    };
}
pub(crate) use policy_rule;

mod coordinator;
mod guards;
mod measure;
mod mesh;
mod otlp;
mod pki;
mod processes;
mod records;
mod replicas;

pub(crate) use coordinator::*;
pub(crate) use guards::*;
pub(crate) use measure::*;
pub(crate) use mesh::*;
pub(crate) use otlp::*;
pub(crate) use pki::*;
pub(crate) use processes::*;
pub(crate) use records::*;
pub(crate) use replicas::*;

/// Polls `check` every 20 ms, at most `tries` times.
pub(crate) async fn eventually_within(tries: usize, mut check: impl FnMut() -> bool) -> bool {
    for _ in 0..tries {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}

/// A free loopback port (bound and released; for processes that need a
/// port number before they start).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh, empty folder under the system's temporary folder, named after
/// `name`, this process and a counter: another one at each call.
pub(crate) fn fresh_dir(name: &str) -> std::path::PathBuf {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "guardmesh-{name}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A session secret (`[sessions] secret_file`, R34) of 32 random bytes,
/// readable by its owner only, at `dir/name`: what a mesh whose session
/// memory is shared (an etcd registry, Redis) needs to start. Written once:
/// a mesh restarted on the same folder keeps its secret (another one would
/// not start against the store its first run wrote).
pub(crate) fn session_secret(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let file = dir.join(name);
    if file.exists() {
        return file;
    }
    std::fs::write(&file, rand::random::<[u8; 32]>()).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    file
}

/// Serializes the tests that measure memory or load the machine, so that
/// their bounds are not disturbed by each other.
pub(crate) static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs the test `path` (e.g. `otel::exported_trace_in_own_process`, marked
/// `#[ignore]` so that it does not also run in this process) alone in a
/// child process of this test binary, and fails if it fails. For tests that
/// own process-wide state: the global trace exporter and its environment, or
/// the resident set they measure.
pub(crate) fn isolated(path: &str) {
    // The child measures the whole machine's share it gets: no other heavy
    // test of this process runs meanwhile.
    let _heavy = HEAVY.blocking_lock();
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = std::process::Command::new(exe)
        .args([path, "--exact", "--include-ignored", "--test-threads=1"])
        .arg("--nocapture")
        .output()
        .expect("start the test binary");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The reason first: a long log would push it out of a CI excerpt.
    let reason: Vec<&str> = stderr
        .lines()
        .chain(stdout.lines())
        .skip_while(|line| !line.contains("panicked at"))
        .take(12)
        .collect();
    assert!(
        output.status.success(),
        "{path} failed in its own process: {}\n--- stdout:\n{}\n--- stderr (last part):\n{}",
        reason.join("\n"),
        tail(&stdout, 4000),
        tail(&stderr, 8000)
    );
    assert!(
        stdout.contains("1 passed"),
        "{path} did not run in its own process (wrong name?):\n{stdout}"
    );
    eprint!("{stderr}");
}

/// The last `max` bytes of `text`, cut at a character boundary.
fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}
