//! Shared test harness: a real mesh and real guards on 127.0.0.1:0.
#![allow(dead_code)]

use guardmesh_client::proto::guard_service_server::{GuardService, GuardServiceServer};
use guardmesh_client::proto::{GuardBatch, JudgeRequest, JudgeResponse, Verdict};
use guardmesh_client::{Coordinator, Guard, Registrar, Registration};
use guardmesh_server::{MemoryRegistry, Mesh, MeshConfig};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Status;

/// A mesh served on loopback.
pub struct TestMesh {
    pub url: String,
    pub mesh: Arc<Mesh>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl TestMesh {
    pub async fn start() -> Self {
        Self::with_config(fast_config()).await
    }

    pub async fn with_config(config: MeshConfig) -> Self {
        let registry = Arc::new(MemoryRegistry::new(config.default_guard_timeout));
        let mesh = Mesh::new(config, registry);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn({
            let mesh = mesh.clone();
            async move {
                guardmesh_server::server::run(listener, mesh, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
            }
        });
        Self {
            url,
            mesh,
            stop: Some(stop),
            task,
        }
    }

    pub async fn coordinator(&self) -> Coordinator {
        Coordinator::connect(self.url.clone()).await.unwrap()
    }

    pub async fn registrar(&self) -> Registrar {
        Registrar::connect(self.url.clone()).await.unwrap()
    }

    pub async fn register(&self, spec: Registration) {
        self.registrar().await.register(spec).await.unwrap();
    }

    /// Signals shutdown and waits for the server to finish draining.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for TestMesh {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Short backoffs so that reconnect tests stay quick.
pub fn fast_config() -> MeshConfig {
    let mut config = MeshConfig::default();
    config.link.backoff_initial = Duration::from_millis(20);
    config.link.backoff_max = Duration::from_millis(200);
    config.link.connect_timeout = Duration::from_millis(500);
    config
}

/// What a scripted guard does with a batch.
#[derive(Clone, Default)]
pub struct Script {
    pub delay: Duration,
    pub verdicts: Vec<Verdict>,
    pub error: Option<Status>,
}

type Behaviour = dyn Fn(&GuardBatch) -> Script + Send + Sync;

/// A guard served by the Rust SDK whose answers a test scripts, and which
/// records what it received and what was cancelled.
pub struct ScriptGuard {
    behaviour: Box<Behaviour>,
    pub received: Mutex<Vec<GuardBatch>>,
    pub cancelled: AtomicUsize,
    pub answered: AtomicUsize,
}

impl ScriptGuard {
    pub fn batches(&self) -> Vec<GuardBatch> {
        self.received.lock().unwrap().clone()
    }

    pub fn requests(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    pub fn cancelled(&self) -> usize {
        self.cancelled.load(Ordering::SeqCst)
    }
}

struct CountOnDrop<'a> {
    counter: &'a AtomicUsize,
    armed: bool,
}

impl Drop for CountOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.counter.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Guard for ScriptGuard {
    async fn judge(&self, batch: &GuardBatch) -> Result<Vec<Verdict>, Status> {
        self.received.lock().unwrap().push(batch.clone());
        let script = (self.behaviour)(batch);
        // Counts the batch as cancelled if the mesh aborts this future.
        let mut on_cancel = CountOnDrop {
            counter: &self.cancelled,
            armed: true,
        };
        if !script.delay.is_zero() {
            tokio::time::sleep(script.delay).await;
        }
        on_cancel.armed = false;
        self.answered.fetch_add(1, Ordering::SeqCst);
        match script.error {
            Some(status) => Err(status),
            None => Ok(script.verdicts),
        }
    }
}

/// A running guard process-in-a-task.
pub struct TestGuard {
    pub url: String,
    pub guard: Arc<ScriptGuard>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl TestGuard {
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for TestGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves a scripted guard on a fresh loopback port.
pub async fn script_guard(
    behaviour: impl Fn(&GuardBatch) -> Script + Send + Sync + 'static,
) -> TestGuard {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    serve_script_guard(listener, behaviour).await
}

pub async fn serve_script_guard(
    listener: TcpListener,
    behaviour: impl Fn(&GuardBatch) -> Script + Send + Sync + 'static,
) -> TestGuard {
    let url = format!("http://{}", listener.local_addr().unwrap());
    let guard = Arc::new(ScriptGuard {
        behaviour: Box::new(behaviour),
        received: Mutex::default(),
        cancelled: AtomicUsize::new(0),
        answered: AtomicUsize::new(0),
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn({
        let guard = guard.clone();
        async move {
            let _ = guardmesh_client::guard::serve_arc(guard, listener, async {
                let _ = stopped.await;
            })
            .await;
        }
    });
    TestGuard {
        url,
        guard,
        stop: Some(stop),
        task,
    }
}

/// A guard that proceeds on everything.
pub async fn proceed_guard() -> TestGuard {
    script_guard(|_| Script::default()).await
}

/// A guard that applies `f` to each call: `Some(verdict)` or proceed.
pub async fn call_guard(
    delay: Duration,
    f: impl Fn(&guardmesh_client::proto::ToolCall) -> Option<Verdict> + Send + Sync + 'static,
) -> TestGuard {
    script_guard(move |batch| Script {
        delay,
        verdicts: batch.calls.iter().filter_map(&f).collect(),
        error: None,
    })
    .await
}

/// How a raw (non-SDK) guard misbehaves on its Judge stream.
#[derive(Clone, Copy, Debug)]
pub enum Misbehaviour {
    /// Ends the stream with OK without answering anything.
    CloseOk,
    /// Ends the stream with an INTERNAL error.
    CloseError,
    /// Answers with partial verdicts for the first call of each batch
    /// (partial = true), then ends the stream.
    PartialThenClose,
    /// Never answers, keeps the stream open.
    Silent,
}

pub struct RawGuard {
    mode: Misbehaviour,
    pub streams: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl GuardService for RawGuard {
    type JudgeStream = tokio_stream::wrappers::ReceiverStream<Result<JudgeResponse, Status>>;

    async fn judge(
        &self,
        request: tonic::Request<tonic::Streaming<JudgeRequest>>,
    ) -> Result<tonic::Response<Self::JudgeStream>, Status> {
        self.streams.fetch_add(1, Ordering::SeqCst);
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let mode = self.mode;
        tokio::spawn(async move {
            let Ok(Some(first)) = inbound.message().await else {
                return;
            };
            match mode {
                Misbehaviour::CloseOk => {}
                Misbehaviour::CloseError => {
                    let _ = tx.send(Err(Status::internal("guard exploded"))).await;
                }
                Misbehaviour::PartialThenClose => {
                    if let Some(guardmesh_client::proto::judge_request::Kind::Batch(batch)) =
                        first.kind
                    {
                        let verdicts = batch
                            .calls
                            .first()
                            .map(|c| guardmesh_client::verdict::steer(&c.call_id, "partial skip"))
                            .into_iter()
                            .collect();
                        let _ = tx
                            .send(Ok(JudgeResponse {
                                request_id: batch.request_id,
                                verdicts,
                                partial: true,
                                error: String::new(),
                            }))
                            .await;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                Misbehaviour::Silent => while let Ok(Some(_)) = inbound.message().await {},
            }
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

/// Serves a misbehaving raw guard.
pub async fn raw_guard(mode: Misbehaviour) -> (String, Arc<AtomicUsize>, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let streams = Arc::new(AtomicUsize::new(0));
    let service = RawGuard {
        mode,
        streams: streams.clone(),
    };
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(GuardServiceServer::new(service))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
    });
    (url, streams, task)
}

/// A loopback URL where nothing listens.
pub async fn closed_port() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

/// `{"sql": ...}` arguments.
pub fn sql(text: &str) -> String {
    serde_json::json!({ "sql": text }).to_string()
}

/// A guard running as a real separate process: `guardmesh example-guard`.
pub struct GuardProcess {
    pub url: String,
    pub port: u16,
    child: std::process::Child,
}

impl GuardProcess {
    /// Starts `guardmesh example-guard KIND ARGS...` on `port` (0 = any)
    /// and waits for its `LISTENING <port>` line.
    pub fn start(kind: &str, port: u16, args: &[&str]) -> Self {
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
            child,
        }
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for GuardProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------
// Fault-injection helpers (issue 6): a raw guard whose every message is
// scripted, including answers for requests that do not exist and answers
// after a cancel, and an SDK guard that holds batches until released.
// ---------------------------------------------------------------------------

/// One message a [`RawScriptGuard`] sends for a batch: `response` exactly as
/// given (its `request_id` included, so a test can answer requests that do
/// not exist), `after` the previous message of the same batch was sent.
#[derive(Clone, Debug)]
pub struct RawSend {
    pub after: Duration,
    pub response: JudgeResponse,
}

impl RawSend {
    pub fn now(response: JudgeResponse) -> Self {
        Self {
            after: Duration::ZERO,
            response,
        }
    }

    pub fn after(after: Duration, response: JudgeResponse) -> Self {
        Self { after, response }
    }
}

/// A final answer to `batch` with `verdicts`.
pub fn final_answer(batch: &GuardBatch, verdicts: Vec<Verdict>) -> JudgeResponse {
    JudgeResponse {
        request_id: batch.request_id,
        verdicts,
        partial: false,
        error: String::new(),
    }
}

type RawBehaviour = dyn Fn(&GuardBatch) -> Vec<RawSend> + Send + Sync;

/// A guard on the raw `GuardService` whose messages a test scripts per batch.
/// Unlike the SDK it ignores cancels (it records them) and keeps sending what
/// the script says: late answers, answers for unknown request ids, verdicts
/// with unknown enum values.
pub struct RawScriptGuard {
    behaviour: Arc<RawBehaviour>,
    pub received: Arc<Mutex<Vec<GuardBatch>>>,
    pub cancels: Arc<Mutex<Vec<u64>>>,
    /// Messages actually written to the stream.
    pub sent: Arc<AtomicUsize>,
    pub streams: Arc<AtomicUsize>,
}

impl RawScriptGuard {
    pub fn batches(&self) -> Vec<GuardBatch> {
        self.received.lock().unwrap().clone()
    }

    pub fn cancels(&self) -> Vec<u64> {
        self.cancels.lock().unwrap().clone()
    }

    pub fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct RawScriptService(Arc<RawScriptGuard>);

#[tonic::async_trait]
impl GuardService for RawScriptService {
    type JudgeStream = tokio_stream::wrappers::ReceiverStream<Result<JudgeResponse, Status>>;

    async fn judge(
        &self,
        request: tonic::Request<tonic::Streaming<JudgeRequest>>,
    ) -> Result<tonic::Response<Self::JudgeStream>, Status> {
        use guardmesh_client::proto::judge_request::Kind;
        let guard = self.0.clone();
        guard.streams.fetch_add(1, Ordering::SeqCst);
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                match message.kind {
                    Some(Kind::Batch(batch)) => {
                        guard.received.lock().unwrap().push(batch.clone());
                        let sends = (guard.behaviour)(&batch);
                        let tx = tx.clone();
                        let sent = guard.sent.clone();
                        tokio::spawn(async move {
                            for send in sends {
                                if !send.after.is_zero() {
                                    tokio::time::sleep(send.after).await;
                                }
                                if tx.send(Ok(send.response)).await.is_err() {
                                    return;
                                }
                                sent.fetch_add(1, Ordering::SeqCst);
                            }
                        });
                    }
                    Some(Kind::Cancel(cancel)) => {
                        guard.cancels.lock().unwrap().push(cancel.request_id);
                    }
                    None => {}
                }
            }
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

/// A running [`RawScriptGuard`].
pub struct RawScriptHandle {
    pub url: String,
    pub guard: Arc<RawScriptGuard>,
    task: JoinHandle<()>,
}

impl Drop for RawScriptHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves a raw scripted guard on a fresh loopback port.
pub async fn raw_script_guard(
    behaviour: impl Fn(&GuardBatch) -> Vec<RawSend> + Send + Sync + 'static,
) -> RawScriptHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let guard = Arc::new(RawScriptGuard {
        behaviour: Arc::new(behaviour),
        received: Arc::default(),
        cancels: Arc::default(),
        sent: Arc::default(),
        streams: Arc::default(),
    });
    let service = RawScriptService(guard.clone());
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(GuardServiceServer::new(service))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
    });
    RawScriptHandle { url, guard, task }
}

/// An SDK guard that holds every batch until [`HeldGuard::release`], then
/// proceeds on it. Records each batch it receives.
pub struct HeldGuard {
    release: tokio::sync::watch::Sender<bool>,
    pub received: Mutex<Vec<GuardBatch>>,
    pub answered: AtomicUsize,
}

impl HeldGuard {
    pub fn release(&self) {
        self.release.send_replace(true);
    }

    pub fn requests(&self) -> usize {
        self.received.lock().unwrap().len()
    }
}

impl Guard for HeldGuard {
    async fn judge(&self, batch: &GuardBatch) -> Result<Vec<Verdict>, Status> {
        self.received.lock().unwrap().push(batch.clone());
        let mut released = self.release.subscribe();
        let _ = released.wait_for(|r| *r).await;
        self.answered.fetch_add(1, Ordering::SeqCst);
        Ok(Vec::new())
    }
}

/// A running [`HeldGuard`].
pub struct HeldHandle {
    pub url: String,
    pub guard: Arc<HeldGuard>,
    task: JoinHandle<()>,
}

impl Drop for HeldHandle {
    fn drop(&mut self) {
        self.guard.release();
        self.task.abort();
    }
}

/// Serves a [`HeldGuard`] on a fresh loopback port.
pub async fn held_guard() -> HeldHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let guard = Arc::new(HeldGuard {
        release: tokio::sync::watch::channel(false).0,
        received: Mutex::default(),
        answered: AtomicUsize::new(0),
    });
    let task = tokio::spawn({
        let guard = guard.clone();
        async move {
            let _ =
                guardmesh_client::guard::serve_arc(guard, listener, std::future::pending()).await;
        }
    });
    HeldHandle { url, guard, task }
}

/// The value of a counter in the mesh's Prometheus text, for the sample
/// whose name and labels start with `sample` (e.g.
/// `guardmesh_guard_spurious_answers_total{guard="g"}`); 0 when absent.
pub fn metric(mesh: &TestMesh, sample: &str) -> f64 {
    mesh.mesh
        .metrics
        .encode()
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == sample)
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// Polls `check` every 20 ms, at most `tries` times.
pub async fn eventually_within(tries: usize, mut check: impl FnMut() -> bool) -> bool {
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
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl TestMesh {
    /// A mesh served on loopback with the given registry: several meshes
    /// given registries on one shared store act as replicas of one chain.
    pub async fn with_registry(
        config: MeshConfig,
        registry: Arc<dyn guardmesh_server::Registry>,
    ) -> Self {
        let mesh = Mesh::new(config, registry);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn({
            let mesh = mesh.clone();
            async move {
                guardmesh_server::server::run(listener, mesh, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
            }
        });
        Self {
            url,
            mesh,
            stop: Some(stop),
            task,
        }
    }
}

/// A scripted guard's state without a server (to serve it yourself).
pub fn script_guard_state(
    behaviour: impl Fn(&GuardBatch) -> Script + Send + Sync + 'static,
) -> ScriptGuard {
    ScriptGuard {
        behaviour: Box::new(behaviour),
        received: Mutex::default(),
        cancelled: AtomicUsize::new(0),
        answered: AtomicUsize::new(0),
    }
}

impl TestMesh {
    /// Registers through `url` with the given credentials.
    pub async fn register_over(
        &self,
        url: &str,
        connection: &guardmesh_client::Connection,
        spec: Registration,
    ) {
        Registrar::connect_with(url.to_owned(), connection)
            .await
            .unwrap()
            .register(spec)
            .await
            .unwrap();
    }
}

// ---------------------------------------------------------------------------
// Polyglot guards (issue 5): the Python and Node example guards of `guards/`
// as real separate processes. They need `scripts/setup-polyglot` (which
// `scripts/test` runs before `cargo test`).
// ---------------------------------------------------------------------------

/// The repository's root folder.
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("server/ has a parent")
        .to_path_buf()
}

/// `build/venv/bin/python`, with the generated stubs in place; panics with
/// what to run when they are missing.
pub fn python() -> std::path::PathBuf {
    let root = repo_root();
    let python = root.join("build/venv/bin/python");
    assert!(
        python.exists() && root.join("build/python-gen/guardmesh/v1").is_dir(),
        "the Python guard kit is not set up ({} or build/python-gen missing): \
         run scripts/setup-polyglot (scripts/test runs it before cargo test)",
        python.display()
    );
    python
}

/// `node`, with the Node kit's packages installed under `guards/node`;
/// panics with what to run when they are missing.
pub fn node() -> std::path::PathBuf {
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
pub struct KitGuard {
    pub url: String,
    /// `127.0.0.1:PORT`, for `guardmesh conformance --guard`.
    pub addr: String,
    pub port: u16,
    child: std::process::Child,
}

impl KitGuard {
    /// Starts `guards/python/examples/SCRIPT ARGS...` (with `--port 0`
    /// unless ARGS has a `--port`) and waits for its `LISTENING` line.
    pub fn python(script: &str, args: &[&str]) -> Self {
        let mut command = std::process::Command::new(python());
        command.arg(repo_root().join("guards/python/examples").join(script));
        Self::spawn(command, script, args)
    }

    /// Starts `node guards/node/examples/SCRIPT ARGS...` likewise.
    pub fn node(script: &str, args: &[&str]) -> Self {
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
            child,
        }
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for KitGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `guardmesh conformance --guard ADDR ARGS...`; returns its exit
/// status and stdout (its stderr is passed through).
pub fn run_conformance(addr: &str, args: &[&str]) -> (std::process::ExitStatus, String) {
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
pub fn status_of(
    decision: &guardmesh_client::Decision,
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
pub fn listening_port(line: &str, what: &str) -> u16 {
    line.trim()
        .strip_prefix("LISTENING ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{what}: unexpected first line {line:?}"))
}

// ---------------------------------------------------------------------------
// Secured meshes: certificates on disk and token principals (R24).
// ---------------------------------------------------------------------------

/// A CA and loopback certificates written to a temporary folder (removed on
/// drop), for meshes with TLS, mTLS or tokens, in process or as `serve`.
pub struct TestPki {
    pub dir: std::path::PathBuf,
    pub ca: guardmesh_server::certs::Authority,
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl TestPki {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("guardmesh-testpki-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            dir,
            ca: guardmesh_server::certs::Authority::new("test CA").unwrap(),
        }
    }

    /// `ca.pem`.
    pub fn ca_file(&self) -> std::path::PathBuf {
        let path = self.dir.join("ca.pem");
        std::fs::write(&path, self.ca.cert_pem()).unwrap();
        path
    }

    /// A loopback certificate (localhost, 127.0.0.1, ::1) with the identity
    /// `spiffe://guardmesh.local/ID`, written as `ID.pem` and `ID-key.pem`.
    pub fn issue_files(&self, id: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        self.ca
            .issue(&guardmesh_server::certs::Subject::loopback(id))
            .unwrap()
            .write(&self.dir, id)
            .unwrap()
    }

    /// A file holding `text` (a token file, a config file...).
    pub fn file(&self, name: &str, text: &str) -> std::path::PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// SDK connection settings: TLS trusting this CA, with the certificate of
    /// `identity` (issued now) and `token` when given.
    pub fn connection(
        &self,
        identity: Option<&str>,
        token: Option<&str>,
    ) -> guardmesh_client::Connection {
        let identity = identity.map(|id| {
            let issued = self
                .ca
                .issue(&guardmesh_server::certs::Subject::loopback(id))
                .unwrap();
            (issued.cert_pem, issued.key_pem)
        });
        guardmesh_client::Connection {
            tls: Some(guardmesh_client::Tls {
                ca_pem: self.ca.cert_pem(),
                identity,
                domain: None,
            }),
            token: token.map(str::to_owned),
        }
    }
}

impl TestMesh {
    /// A mesh on TLS (no client certificates) whose `[auth]` knows only
    /// token principals `(id, token, roles)`, built from a config file's
    /// sections as `serve` builds them (`extra`: more sections, such as
    /// `[guard_tls]`); returns it with its `https://localhost:PORT` URL.
    pub async fn with_tokens(
        pki: &TestPki,
        principals: &[(&str, &str, &[&str])],
        extra: &str,
    ) -> (Self, String) {
        let (cert, key) = pki.issue_files("mesh");
        let mut text = format!(
            "[tls]\ncert_file = {:?}\nkey_file = {:?}\n{extra}\n",
            cert.display().to_string(),
            key.display().to_string()
        );
        for (id, token, roles) in principals {
            let token_file = pki.file(&format!("{id}.token"), &format!("{token}\n"));
            text.push_str(&format!(
                "[[auth.principal]]\nid = {id:?}\nroles = {roles:?}\ntoken_file = {:?}\n",
                token_file.display().to_string()
            ));
        }
        let built = guardmesh_server::config::Config::parse(&text, "test")
            .unwrap()
            .build()
            .unwrap();
        let mut config = fast_config();
        config.security = built.security;
        let mesh = Self::with_config(config).await;
        let url = mesh.url.replace("http://127.0.0.1", "https://localhost");
        (mesh, url)
    }
}

// ---------------------------------------------------------------------------
// Raw-bytes guards (R23, R25): a `GuardService` whose answers are bytes a test
// writes by hand (fields a newer protocol might send), and one that accepts
// its Judge stream and never reads it.
// ---------------------------------------------------------------------------

/// What a [`raw_bytes_guard`] answers a batch with: each entry is the
/// protobuf encoding of one `JudgeResponse`, sent as it is.
type BytesBehaviour = dyn Fn(&GuardBatch) -> Vec<Vec<u8>> + Send + Sync;

/// The codec of the raw-bytes guard: requests decoded by prost, answers
/// written as the test gave them.
#[derive(Clone, Copy, Default)]
struct RawBytesCodec;

impl tonic::codec::Codec for RawBytesCodec {
    type Encode = Vec<u8>;
    type Decode = JudgeRequest;
    type Encoder = RawBytesCodec;
    type Decoder = RawBytesCodec;

    fn encoder(&mut self) -> Self::Encoder {
        *self
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl tonic::codec::Encoder for RawBytesCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawBytesCodec {
    type Item = JudgeRequest;
    type Error = Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<JudgeRequest>, Status> {
        use prost::Message;
        JudgeRequest::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

/// The `Judge` method of the raw-bytes guard.
struct RawBytesJudge {
    behaviour: Arc<BytesBehaviour>,
    streams: Arc<AtomicUsize>,
    /// Never read the stream: hold it open until the connection ends.
    never_read: bool,
}

type BoxStream<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = T> + Send>>;

impl tonic::server::StreamingService<JudgeRequest> for RawBytesJudge {
    type Response = Vec<u8>;
    type ResponseStream = BoxStream<Result<Vec<u8>, Status>>;
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<tonic::Response<Self::ResponseStream>, Status>>
                + Send,
        >,
    >;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<JudgeRequest>>) -> Self::Future {
        use guardmesh_client::proto::judge_request::Kind;
        self.streams.fetch_add(1, Ordering::SeqCst);
        let behaviour = self.behaviour.clone();
        let never_read = self.never_read;
        Box::pin(async move {
            let mut inbound = request.into_inner();
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, Status>>(256);
            tokio::spawn(async move {
                if never_read {
                    // Keep the stream (and so its flow-control window) open
                    // without ever polling it, until the mesh goes away.
                    tx.closed().await;
                    drop(inbound);
                    return;
                }
                while let Ok(Some(message)) = inbound.message().await {
                    if let Some(Kind::Batch(batch)) = message.kind {
                        for answer in behaviour(&batch) {
                            if tx.send(Ok(answer)).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
            let stream: Self::ResponseStream =
                Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
            Ok(tonic::Response::new(stream))
        })
    }
}

/// A hand-written `GuardService` server around [`RawBytesJudge`].
#[derive(Clone)]
struct RawBytesServer {
    behaviour: Arc<BytesBehaviour>,
    streams: Arc<AtomicUsize>,
    never_read: bool,
}

impl tonic::server::NamedService for RawBytesServer {
    const NAME: &'static str = "guardmesh.v1.GuardService";
}

impl tower::Service<http::Request<tonic::body::Body>> for RawBytesServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let judge = RawBytesJudge {
            behaviour: self.behaviour.clone(),
            streams: self.streams.clone(),
            never_read: self.never_read,
        };
        Box::pin(async move {
            if request.uri().path() != "/guardmesh.v1.GuardService/Judge" {
                return Ok(Status::unimplemented("only Judge").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(RawBytesCodec);
            Ok(grpc.streaming(judge, request).await)
        })
    }
}

/// A running raw-bytes guard.
pub struct RawBytesHandle {
    pub url: String,
    /// Judge streams opened to it.
    pub streams: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for RawBytesHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_raw_bytes(server: RawBytesServer) -> RawBytesHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let streams = server.streams.clone();
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
    });
    RawBytesHandle { url, streams, task }
}

/// Serves a guard that answers each batch with the hand-encoded
/// `JudgeResponse`s `behaviour` returns, byte for byte.
pub async fn raw_bytes_guard(
    behaviour: impl Fn(&GuardBatch) -> Vec<Vec<u8>> + Send + Sync + 'static,
) -> RawBytesHandle {
    serve_raw_bytes(RawBytesServer {
        behaviour: Arc::new(behaviour),
        streams: Arc::default(),
        never_read: false,
    })
    .await
}

/// Serves a guard that accepts its Judge stream and never reads from it.
pub async fn never_reading_guard() -> RawBytesHandle {
    serve_raw_bytes(RawBytesServer {
        behaviour: Arc::new(|_| Vec::new()),
        streams: Arc::default(),
        never_read: true,
    })
    .await
}

/// Protobuf encoding helpers for hand-made answers.
pub mod raw_pb {
    use prost::encoding::{WireType, encode_key, encode_varint};

    /// Appends field `number` as a length-delimited value.
    pub fn bytes_field(out: &mut Vec<u8>, number: u32, payload: &[u8]) {
        encode_key(number, WireType::LengthDelimited, out);
        encode_varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }

    /// Appends field `number` as a varint.
    pub fn varint_field(out: &mut Vec<u8>, number: u32, value: u64) {
        encode_key(number, WireType::Varint, out);
        encode_varint(value, out);
    }

    /// A `JudgeResponse` (final) for `request_id` whose `verdicts` are the
    /// given encoded `Verdict`s, followed by `extra` bytes of top-level
    /// fields.
    pub fn judge_response(request_id: u64, verdicts: &[Vec<u8>], extra: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        varint_field(&mut out, 1, request_id);
        for verdict in verdicts {
            bytes_field(&mut out, 2, verdict);
        }
        out.extend_from_slice(extra);
        out
    }

    /// A `Verdict` with `call_id` and then `extra` bytes (its outcome,
    /// known or not).
    pub fn verdict(call_id: &str, extra: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        bytes_field(&mut out, 1, call_id.as_bytes());
        out.extend_from_slice(extra);
        out
    }

    /// A `Skip` outcome (field 2 of `Verdict`) with `content`, kind steer,
    /// followed by `extra` bytes inside the skip.
    pub fn skip_outcome(content: &str, extra: &[u8]) -> Vec<u8> {
        let mut skip = Vec::new();
        bytes_field(&mut skip, 1, content.as_bytes());
        skip.extend_from_slice(extra);
        let mut out = Vec::new();
        bytes_field(&mut out, 2, &skip);
        out
    }
}

/// The mesh process's resident set size (`VmRSS`), in bytes. The mesh runs
/// in the test process.
pub fn self_vmrss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

// ---------------------------------------------------------------------------
// Raw protobuf bytes on `PreToolService` (attack tests): messages sent
// exactly as given, answers read (or not) as bytes.
// ---------------------------------------------------------------------------

/// A codec that sends and receives messages as raw bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

#[derive(Debug)]
pub struct RawClientBytes;

impl tonic::codec::Encoder for RawClientBytes {
    type Item = prost::bytes::Bytes;
    type Error = Status;
    fn encode(
        &mut self,
        item: Self::Item,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawClientBytes {
    type Item = prost::bytes::Bytes;
    type Error = Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Self::Item>, Status> {
        use prost::bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = prost::bytes::Bytes;
    type Decode = prost::bytes::Bytes;
    type Encoder = RawClientBytes;
    type Decoder = RawClientBytes;
    fn encoder(&mut self) -> Self::Encoder {
        RawClientBytes
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawClientBytes
    }
}

/// A gRPC client on its own connection that speaks raw bytes.
pub async fn raw_client(url: &str) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic::client::Grpc::new(channel).max_decoding_message_size(64 << 20)
}

/// Opens `Evaluate` sending `requests` as raw messages; the answers are
/// returned unread.
pub async fn raw_evaluate(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    requests: impl futures::Stream<Item = prost::bytes::Bytes> + Send + 'static,
) -> Result<tonic::Streaming<prost::bytes::Bytes>, Status> {
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static("/guardmesh.v1.PreToolService/Evaluate");
    client
        .streaming(tonic::Request::new(requests), path, RawCodec)
        .await
        .map(|r| r.into_inner())
}

/// `EvaluateBatch` with a raw message.
pub async fn raw_evaluate_batch(
    client: &mut tonic::client::Grpc<tonic::transport::Channel>,
    request: prost::bytes::Bytes,
) -> Result<guardmesh_client::proto::BatchDecision, Status> {
    use prost::Message;
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static("/guardmesh.v1.PreToolService/EvaluateBatch");
    let answer = client
        .unary(tonic::Request::new(request), path, RawCodec)
        .await?
        .into_inner();
    guardmesh_client::proto::BatchDecision::decode(answer)
        .map_err(|e| Status::internal(e.to_string()))
}

/// Reads one raw answer of an `Evaluate` stream.
pub async fn next_answer(
    answers: &mut tonic::Streaming<prost::bytes::Bytes>,
) -> Result<Option<guardmesh_client::proto::EvaluateResponse>, Status> {
    use prost::Message;
    match answers.message().await? {
        Some(bytes) => guardmesh_client::proto::EvaluateResponse::decode(bytes)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string())),
        None => Ok(None),
    }
}

/// A well-formed batch's bytes.
pub fn batch_bytes(request: &guardmesh_client::proto::EvaluateRequest) -> prost::bytes::Bytes {
    use prost::Message;
    request.encode_to_vec().into()
}

/// `VmRSS` and `VmHWM` (peak) of process `pid` ("self" for this one), KiB.
pub fn rss_and_peak_kib(pid: &str) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

// ---------------------------------------------------------------------------
// `guardmesh serve` as a separate process (shutdown signals, memory of the
// mesh process alone).
// ---------------------------------------------------------------------------

/// `guardmesh serve` as a child process; killed if a test fails midway.
pub struct MeshProcess {
    pub child: std::process::Child,
    pub url: String,
    dir: std::path::PathBuf,
}

impl MeshProcess {
    /// Starts `guardmesh serve --listen 127.0.0.1:PORT --config FILE` with
    /// `config` as the file, and waits (bounded) until it accepts. With
    /// `log_level`, the process logs at that level (`RUST_LOG`).
    pub async fn start(name: &str, config: &str, log_level: Option<&str>) -> Self {
        let dir =
            std::env::temp_dir().join(format!("guardmesh-serve-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("mesh.toml");
        std::fs::write(&file, config).unwrap();
        let log = std::fs::File::create(dir.join("mesh.log")).unwrap();
        let port = free_port();
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"));
        command
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--config",
            ])
            .arg(&file)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::from(log));
        if let Some(level) = log_level {
            command.env("RUST_LOG", level);
        }
        let child = command.spawn().expect("start guardmesh serve");
        let mut mesh = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir,
        };
        for _ in 0..500 {
            if guardmesh_client::Coordinator::connect(mesh.url.clone())
                .await
                .is_ok()
            {
                return mesh;
            }
            if let Ok(Some(status)) = mesh.child.try_wait() {
                panic!("guardmesh serve exited with {status}:\n{}", mesh.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("guardmesh serve did not start:\n{}", mesh.log());
    }

    /// What the process wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("mesh.log")).unwrap_or_default()
    }

    /// (RSS, peak RSS) of the process in MiB.
    pub fn memory_mib(&self) -> (u64, u64) {
        let (rss, peak) = rss_and_peak_kib(&self.child.id().to_string());
        (rss / 1024, peak / 1024)
    }

    /// Sends the process a signal (`TERM`, `INT`, ...).
    pub fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal}");
    }

    /// Waits (bounded) for the process to exit.
    pub async fn exit_status(&mut self) -> std::process::ExitStatus {
        for _ in 0..1000 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the mesh did not exit after draining:\n{}", self.log());
    }
}

impl Drop for MeshProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
