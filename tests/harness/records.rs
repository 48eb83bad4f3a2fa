//! Decision logs on disk (R29): a fresh folder per test, the records a
//! log holds read back as JSON, and the policies the log tests judge with.

use super::TestMesh;
use guardmesh_server::decision_log::{DecisionLog, LogConfig, MeshLog, OnLogFailure, segment};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A fresh folder for one test's log.
pub(crate) fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("guardmesh-declog-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every line of the log in `dir`, in order, across its segment files.
pub(crate) fn log_lines(dir: &Path) -> Vec<String> {
    segment::list(dir)
        .unwrap()
        .into_iter()
        .flat_map(|(_, file)| {
            std::fs::read_to_string(file)
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every record of the log in `dir`, in order, across its segment files.
pub(crate) fn records(dir: &Path) -> Vec<Value> {
    log_lines(dir)
        .iter()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .collect()
}

impl TestMesh {
    /// Opens the decision log `config` describes and attaches it to the
    /// mesh, which does `on_failure` when a record cannot be written.
    pub(crate) async fn attach_log(&self, config: LogConfig, on_failure: OnLogFailure) {
        let log = DecisionLog::open(config).await.unwrap();
        self.mesh
            .attach_decision_log(MeshLog::new(log, on_failure, self.mesh.metrics.clone()))
            .unwrap();
    }
}

/// Writes `dir/mesh.toml`: a `[decision_log]` in `log`, then `more` (its
/// other keys, other sections): the file's path.
pub(crate) fn log_config_file(dir: &Path, log: &Path, more: &str) -> PathBuf {
    let config = dir.join("mesh.toml");
    std::fs::write(
        &config,
        format!(
            "[decision_log]\ndir = {:?}\n{more}",
            log.display().to_string()
        ),
    )
    .unwrap();
    config
}

/// A path as the `&str` a command line takes.
pub(crate) fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Writes a signing key pair into `dir` (`log.key`, `log.key.pub`) with
/// `guardmesh log keygen`, which must succeed: its output.
pub(crate) fn log_keygen(dir: &Path) -> std::process::Output {
    let out = super::guardmesh(&["log", "keygen", "--out", path(&dir.join("log.key"))]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    out
}

/// Runs `n` batches through the mesh at `url`, ids `prefix0`, `prefix1`...:
/// even ones a `danger` call (cancelled by [`LOG_POLICY`]), odd ones a
/// `read` (proceeds). With `within`, each must be answered within it.
pub(crate) async fn log_batches(url: &str, prefix: &str, n: usize, within: Option<Duration>) {
    use guardmesh_client::proto::{EvaluateRequest, ToolCall};
    let coordinator = guardmesh_client::Coordinator::connect(url.to_owned())
        .await
        .unwrap();
    let session = coordinator.session("s").await.unwrap();
    for i in 0..n {
        let tool = if i % 2 == 0 { "danger" } else { "read" };
        let answer = session.evaluate_raw(EvaluateRequest {
            batch_id: format!("{prefix}{i}"),
            calls: vec![ToolCall {
                call_id: "c".into(),
                tool: tool.into(),
                arguments: "{}".into(),
            }],
            ..Default::default()
        });
        let answer = match within {
            Some(within) => tokio::time::timeout(within, answer)
                .await
                .unwrap_or_else(|_| panic!("batch {prefix}{i} not answered within {within:?}")),
            None => answer.await,
        };
        answer.unwrap_or_else(|e| panic!("batch {prefix}{i}: {e}"));
    }
}

/// `guardmesh serve` on `config` (written to `dir/mesh.toml`), expected to
/// refuse to start: its stderr. Bounded: killed and failed after 30 s.
pub(crate) async fn serve_refused(dir: &Path, config: &str) -> String {
    let file = dir.join("mesh.toml");
    std::fs::write(&file, config).unwrap();
    let stderr = std::fs::File::create(dir.join("refused.log")).unwrap();
    let mut child = super::serve_command(&file, 0)
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    for _ in 0..1500 {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success());
            return std::fs::read_to_string(dir.join("refused.log")).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("guardmesh serve started on a log cut short");
}

/// Cuts the last `n` lines of the log in `log` (of its last file).
pub(crate) fn cut_last_lines(log: &Path, n: usize) {
    let (_, last) = segment::list(log).unwrap().pop().unwrap();
    let text = std::fs::read_to_string(&last).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() > n, "{lines:?}");
    let kept: String = lines[..lines.len() - n]
        .iter()
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&last, kept).unwrap();
}

/// Replaces the value of `"member":` (a number or a string) in a line.
pub(crate) fn set_member(line: &str, member: &str, value: &str) -> String {
    let key = format!("\"{member}\":");
    let start = line.find(&key).unwrap() + key.len();
    let rest = &line[start..];
    let end = match rest.strip_prefix('"') {
        Some(string) => string.find('"').unwrap() + 2,
        None => rest.find([',', '}']).unwrap(),
    };
    format!("{}{value}{}", &line[..start], &rest[end..])
}

/// Fails, with its stdout and stderr, unless `out` is a success.
#[track_caller]
pub(crate) fn assert_succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// Fails, with its stdout and stderr, unless `out` exited with `code`.
#[track_caller]
pub(crate) fn assert_exit_code(out: &std::process::Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// Text of a process's output.
pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The decision-log tests' policy: cancels every call of tool `danger`.
pub(crate) const LOG_POLICY: &str = policy_rule!(name: "no-danger", tools: ["danger"], action: "cancel",
    when: r#""true""#,
    message: r#"'"no danger"'"#);

/// A stricter candidate: also cancels `read` calls of paths under /etc.
pub(crate) const LOG_VETO: &str = policy_rule!(name: "no-etc", tools: ["read"], action: "cancel",
    when: r#""has(call.args.path) && call.args.path.startsWith('/etc')""#,
    message: r#"'"not /etc"'"#);
