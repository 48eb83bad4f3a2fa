//! The mesh under test: in process ([`TestMesh`]) or as a real `guardmesh
//! serve` process ([`MeshProcess`]), plainly or secured.

use super::*;

/// A mesh served on loopback.
pub(crate) struct TestMesh {
    pub url: String,
    pub mesh: Arc<Mesh>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl TestMesh {
    pub(crate) async fn start() -> Self {
        Self::with_config(fast_config()).await
    }

    pub(crate) async fn with_config(config: MeshConfig) -> Self {
        let registry = Arc::new(MemoryRegistry::new(config.default_guard_timeout));
        Self::serve(Server::new(config, registry)).await
    }

    /// Runs `server` on a loopback port, as `guardmesh serve` runs its own
    /// (the same [`Server`]), until [`TestMesh::shutdown`].
    pub(crate) async fn serve(server: Server) -> Self {
        let mesh = server.mesh().clone();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            server
                .run(listener, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Self {
            url,
            mesh,
            stop: Some(stop),
            task,
        }
    }

    pub(crate) async fn coordinator(&self) -> Coordinator {
        Coordinator::connect(self.url.clone()).await.unwrap()
    }

    /// Session `id` on a coordinator (and a connection) of its own.
    pub(crate) async fn session(&self, id: impl Into<String>) -> guardmesh_client::Session {
        self.coordinator().await.session(id).await.unwrap()
    }

    pub(crate) async fn registrar(&self) -> Registrar {
        Registrar::connect(self.url.clone()).await.unwrap()
    }

    pub(crate) async fn register(&self, spec: impl Into<guardmesh_proto::v1::GuardSpec>) {
        self.registrar().await.register(spec).await.unwrap();
    }

    /// `batch` sent as a one-off batch of session `s`.
    async fn once(
        &self,
        batch: guardmesh_client::Batch,
    ) -> Result<guardmesh_client::BatchDecision, guardmesh_client::ClientError> {
        self.coordinator().await.evaluate_once("s", batch).await
    }

    /// `batch` judged as a one-off batch of session `s`.
    pub(crate) async fn decides(
        &self,
        batch: guardmesh_client::Batch,
    ) -> guardmesh_client::BatchDecision {
        self.once(batch).await.unwrap()
    }

    /// `batch` as a one-off batch of session `s`, which the mesh refuses.
    pub(crate) async fn refuses(
        &self,
        batch: guardmesh_client::Batch,
    ) -> guardmesh_client::ClientError {
        self.once(batch).await.unwrap_err()
    }

    /// Opens session "s" and has it evaluate `batch`: the session (open
    /// while the caller holds it) and the decision.
    pub(crate) async fn session_decides(
        &self,
        batch: guardmesh_client::Batch,
    ) -> (guardmesh_client::Session, guardmesh_client::BatchDecision) {
        let session = self.coordinator().await.session("s").await.unwrap();
        let decision = session.evaluate(batch).await.unwrap();
        (session, decision)
    }

    /// Signals shutdown and waits for the server to finish draining.
    pub(crate) async fn shutdown(mut self) {
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

/// Batch `turn`: one call `c1` of tool `t` (arguments `{}`) within
/// `timeout`, as the deadline tests send it.
pub(crate) fn timed_batch(turn: u32, timeout: Duration) -> guardmesh_client::Batch {
    guardmesh_client::Batch::new(turn)
        .call("c1", "t", "{}")
        .timeout(timeout)
}

/// Batch 0: one call of tool `t` (arguments `{}`) per id of `ids`, in
/// order.
pub(crate) fn t_calls(ids: &[&str]) -> guardmesh_client::Batch {
    ids.iter()
        .fold(guardmesh_client::Batch::new(0), |batch, id| {
            batch.call(*id, "t", "{}")
        })
}

/// Short backoffs so that reconnect tests stay quick.
pub(crate) fn fast_config() -> MeshConfig {
    let mut config = MeshConfig::default();
    config.link.backoff_initial = Duration::from_millis(20);
    config.link.backoff_max = Duration::from_millis(200);
    config.link.connect_timeout = Duration::from_millis(500);
    config
}

/// Asserts that a batch was shed (R25), not failed or cancelled:
/// `RESOURCE_EXHAUSTED`, the refusal naming `guard` and the cause; `what`
/// names the batch.
pub(crate) fn assert_shed(error: &guardmesh_client::ClientError, guard: &str, what: &str) {
    assert_eq!(
        error.code(),
        Some(tonic::Code::ResourceExhausted),
        "{what}: shed, never failed or cancelled: {error}"
    );
    assert!(
        error.to_string().contains(guard) && error.to_string().contains("busy"),
        "{what}: the refusal names the guard and the cause: {error}"
    );
}

/// The value of a counter in the mesh's Prometheus text, for the sample
/// whose name and labels start with `sample` (e.g.
/// `guardmesh_guard_spurious_answers_total{guard="g"}`); 0 when absent.
pub(crate) fn metric(mesh: &TestMesh, sample: &str) -> f64 {
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

impl TestMesh {
    /// A mesh served on loopback with the given registry: several meshes
    /// given registries on one shared store act as replicas of one chain.
    pub(crate) async fn with_registry(
        config: MeshConfig,
        registry: Arc<dyn guardmesh_server::Registry>,
    ) -> Self {
        Self::serve(Server::new(config, registry)).await
    }
}

impl TestMesh {
    /// Registers through `url` with the given credentials.
    pub(crate) async fn register_over(
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

/// A principal of [`TestMesh::with_tokens`]: id, token and roles.
pub(crate) type Principal = (&'static str, &'static str, &'static [&'static str]);

/// The operator: token `ops-token`, role `admin`.
pub(crate) const OPS: Principal = ("ops", "ops-token", &["admin"]);

/// The agent: token `agent-token`, role `evaluate`.
pub(crate) const AGENT: Principal = ("agent", "agent-token", &["evaluate"]);

impl TestMesh {
    /// A mesh on TLS (no client certificates) whose `[auth]` knows only
    /// token principals `(id, token, roles)`, built from a config file's
    /// sections as `serve` builds them (`extra`: more sections, such as
    /// `[guard_tls]`); returns it with its `https://localhost:PORT` URL.
    pub(crate) async fn with_tokens(
        pki: &TestPki,
        principals: &[(&str, &str, &[&str])],
        extra: &str,
    ) -> (Self, String) {
        Self::with_tokens_and(pki, principals, extra, |_| {}).await
    }

    /// [`Self::with_tokens`], its config then changed by `adjust`.
    pub(crate) async fn with_tokens_and(
        pki: &TestPki,
        principals: &[(&str, &str, &[&str])],
        extra: &str,
        adjust: impl FnOnce(&mut MeshConfig),
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
        adjust(&mut config);
        let mesh = Self::with_config(config).await;
        let url = mesh.url.replace("http://127.0.0.1", "https://localhost");
        (mesh, url)
    }
}

// ---------------------------------------------------------------------------
// `guardmesh serve` as a separate process (shutdown signals, memory of the
// mesh process alone).
// ---------------------------------------------------------------------------

/// `guardmesh serve` as a child process; killed if a test fails midway.
pub(crate) struct MeshProcess {
    pub child: std::process::Child,
    pub url: String,
    dir: std::path::PathBuf,
}

impl MeshProcess {
    /// Starts `guardmesh serve --listen 127.0.0.1:PORT --config FILE` with
    /// `config` as the file, and waits (bounded) until it accepts. With
    /// `log_level`, the process logs at that level (`RUST_LOG`).
    pub(crate) async fn start(name: &str, config: &str, log_level: Option<&str>) -> Self {
        Self::start_at(name, config, log_level, free_port()).await
    }

    /// [`MeshProcess::start`] on `port` (a mesh restarted where its
    /// clients know it).
    pub(crate) async fn start_at(
        name: &str,
        config: &str,
        log_level: Option<&str>,
        port: u16,
    ) -> Self {
        let dir =
            std::env::temp_dir().join(format!("guardmesh-serve-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("mesh.toml");
        std::fs::write(&file, config).unwrap();
        Self::start_file(dir, &file, log_level, port).await
    }

    /// `guardmesh serve --listen 127.0.0.1:PORT --config FILE` with a file
    /// of the repository (its relative paths resolved from its folder),
    /// logging into `dir`.
    pub(crate) async fn start_file(
        dir: std::path::PathBuf,
        file: &std::path::Path,
        log_level: Option<&str>,
        port: u16,
    ) -> Self {
        std::fs::create_dir_all(&dir).unwrap();
        let child = spawn_serve(file, port, &dir.join("mesh.log"), log_level);
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

    /// A coordinator of the mesh.
    pub(crate) async fn coordinator(&self) -> Coordinator {
        Coordinator::connect(self.url.clone()).await.unwrap()
    }

    /// Registers `spec` with the mesh (it must be accepted).
    pub(crate) async fn register(&self, spec: impl Into<guardmesh_proto::v1::GuardSpec>) {
        Registrar::connect(self.url.clone())
            .await
            .unwrap()
            .register(spec)
            .await
            .unwrap();
    }

    /// What the process wrote to stderr so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("mesh.log")).unwrap_or_default()
    }

    /// (RSS, peak RSS) of the process in MiB.
    pub(crate) fn memory_mib(&self) -> (u64, u64) {
        let (rss, peak) = rss_and_peak_kib(&self.child.id().to_string());
        (rss / 1024, peak / 1024)
    }

    /// Sends the process a signal (`TERM`, `INT`, ...).
    pub(crate) fn signal(&self, signal: &str) {
        send_signal(&self.child, signal);
    }

    /// Waits (bounded) for the process to exit.
    pub(crate) async fn exit_status(&mut self) -> std::process::ExitStatus {
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

/// Runs `work` while `in_flight` (a batch held by a guard) stays
/// unanswered: panics with `what` and the answer if it comes first.
pub(crate) async fn while_held<D: std::fmt::Debug, T>(
    in_flight: &mut (impl std::future::Future<Output = D> + Unpin),
    what: &str,
    work: impl std::future::Future<Output = T>,
) -> T {
    tokio::select! {
        biased;
        d = in_flight => panic!("{what}: {d:?}"),
        out = work => out,
    }
}

/// A mesh config: batches of `batch_ms` by default, then `more` (keys and
/// sections), then the guard `held` at `url` with a timeout of `guard_ms`.
pub(crate) fn held_guard_config(url: &str, batch_ms: u64, more: &str, guard_ms: u64) -> String {
    format!(
        "\ndefault_batch_timeout_ms = {batch_ms}\n{more}\n\
         [[guard]]\nname = \"held\"\nendpoint = \"{url}\"\ntimeout_ms = {guard_ms}\n"
    )
}

/// Waits (bounded) until `held` has the batch `in_flight` carries, which
/// stays unanswered meanwhile.
pub(crate) async fn until_held<D: std::fmt::Debug>(
    in_flight: &mut (impl std::future::Future<Output = D> + Unpin),
    held: &HeldGuard,
) {
    let reached = eventually_within(500, || held.requests() == 1);
    assert!(
        while_held(in_flight, "answered while held", reached).await,
        "the batch reached the guard"
    );
}

/// Waits (bounded) until the draining mesh at `url` refuses new
/// connections, while the batch `in_flight` carries stays unanswered.
pub(crate) async fn refuses_while_held<D: std::fmt::Debug>(
    in_flight: &mut (impl std::future::Future<Output = D> + Unpin),
    url: &str,
) {
    let refused = while_held(
        in_flight,
        "answered while held",
        refuses_new_connections(url),
    )
    .await;
    assert!(refused, "the draining mesh refuses new connections");
}

/// Whether a mesh that drains refuses new connections (polled every 10 ms,
/// at most 500 times).
pub(crate) async fn refuses_new_connections(url: &str) -> bool {
    for _ in 0..500 {
        if guardmesh_client::Coordinator::connect(url.to_owned())
            .await
            .is_err()
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// `guardmesh serve --listen 127.0.0.1:<port> --config <config>` (port 0:
/// any), not started yet: the caller adds its environment and its output.
pub(crate) fn serve_command(config: &std::path::Path, port: u16) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_guardmesh"));
    command
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--config",
        ])
        .arg(config);
    command
}

/// Starts `guardmesh serve --listen 127.0.0.1:<port> --config <config>`,
/// its stderr to the file `log` (`RUST_LOG=log_level` when given).
pub(crate) fn spawn_serve(
    config: &std::path::Path,
    port: u16,
    log: &std::path::Path,
    log_level: Option<&str>,
) -> std::process::Child {
    let log = std::fs::File::create(log).unwrap();
    let mut command = serve_command(config, port);
    command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::from(log));
    if let Some(level) = log_level {
        command.env("RUST_LOG", level);
    }
    command.spawn().expect("start guardmesh serve")
}

/// Sends `child` a signal (`TERM`, `INT`, ...).
pub(crate) fn send_signal(child: &std::process::Child, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal}");
}

/// `GET /metrics` on a mesh process's metrics port, as raw HTTP text: None
/// when nothing answered within `within`.
pub(crate) async fn fetch_metrics(port: u16, within: Duration) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        tcp.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut text = String::new();
        tcp.read_to_string(&mut text).await.ok()?;
        Some(text)
    };
    tokio::time::timeout(within, fetch).await.ok().flatten()
}

/// The sum of the samples of `text` named exactly `sample` (name and
/// labels, e.g. `guardmesh_policy_reloads_total{outcome="applied"}`).
pub(crate) fn sample_sum(text: &str, sample: &str) -> f64 {
    text.lines()
        .filter_map(|line| line.strip_prefix(sample))
        .filter_map(|value| value.trim().parse::<f64>().ok())
        .sum()
}
