//! Running a mesh: [`Server`] assembles one from a [`Config`] and runs it
//! until a shutdown future completes. `guardmesh serve` is a shell over it
//! (parse the arguments, load the config, build a `Server`, run it), and the
//! integration tests' mesh is built by the same `Server`.
//!
//! A `Server` owns, beside the [`Mesh`] itself:
//!
//! * the registry `[registry]` asks for (in memory, or shared on etcd), with
//!   the config's `[[guard]]` entries registered in file order (R16);
//! * the decision log (R29), opened before the first batch and closed after
//!   the last, named by the address the listener is bound to;
//! * the watch on the config's policy files and their reload on SIGHUP
//!   (R27, [`policy_reload`]), and the reload of the server certificate on
//!   SIGHUP;
//! * the Prometheus endpoint (`metrics_listen`);
//! * the gRPC listener and its drain on shutdown ([`crate::grpc::run`]).
//!
//! ```no_run
//! # async fn serve(path: &std::path::Path) -> Result<(), guardmesh_server::run::ServerError> {
//! use guardmesh_server::run::{Server, shutdown_signal};
//! let server = Server::load(path).await?;
//! let addr = server.listen_addr();
//! server.serve(addr, shutdown_signal()).await
//! # }
//! ```

mod policy_reload;

use crate::config::{Config, ConfigError, GuardConfig, RegistryKind, SecurityError};
use crate::mesh::{Mesh, MeshConfig};
use crate::observe::metrics_http::Probes;
use crate::registry::etcd::EtcdRegistry;
use crate::registry::{CheckedGuard, MemoryRegistry, Registry, RegistryError};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket};

/// An error with its causes, from the parts of the library whose errors are
/// still being given types of their own.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a mesh could not be built or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The config file cannot be read or is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A security section, or a `[[guard]]` entry, cannot be loaded.
    #[error(transparent)]
    Security(#[from] SecurityError),
    /// The etcd registry's settings are invalid or etcd cannot be reached.
    #[error("[registry]: {0}")]
    Registry(#[source] BoxError),
    /// A `[[guard]]` entry could not be registered.
    #[error("config guard {name:?}: {source}")]
    ConfigGuard {
        name: String,
        #[source]
        source: RegistryError,
    },
    /// The listener's address cannot be bound or listened on.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// `[decision_log]` is invalid.
    #[error("[decision_log] {0}")]
    DecisionLogSettings(#[source] BoxError),
    /// `[sessions]` cannot start a mesh, or its store cannot be reached
    /// (R34).
    #[error("{0}")]
    Sessions(String),
    /// The decision log cannot be opened (R29: the mesh does not start).
    #[error("[decision_log] cannot open the log: {0}")]
    DecisionLogOpen(#[source] crate::decision_log::LogError),
    /// The folders of the policy files cannot be watched.
    #[error("cannot watch the policy files: {0}")]
    PolicyWatch(#[source] notify::Error),
    /// The metrics endpoint cannot listen.
    #[error("metrics endpoint on {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server stopped with an error.
    #[error(transparent)]
    Serve(#[from] crate::grpc::ServeError),
}

/// A mesh and everything that runs beside it, ready to serve.
pub struct Server {
    mesh: Arc<Mesh>,
    /// The config the mesh was built from; the defaults for a mesh built
    /// from its parts ([`Server::new`]).
    config: Config,
    /// The folder the config's policy files are relative to.
    config_dir: PathBuf,
    metrics_listen: Option<SocketAddr>,
    /// What `/healthz` and `/readyz` on the metrics listener report.
    probes: Arc<Probes>,
    /// The metrics listener already serves the probes (started before the
    /// registry was loaded, so probes answer during an etcd connect).
    metrics_started: bool,
    /// A second SIGINT or SIGTERM during the drain cuts it short
    /// ([`Server::second_signal_cuts_drain`]).
    second_signal_cuts: bool,
    /// The config's insecure settings of the listener, logged when it
    /// opens (none for a mesh built from its parts).
    listener_warnings: Vec<String>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("listen", &self.config.listen)
            .field("metrics_listen", &self.metrics_listen)
            .field("config_dir", &self.config_dir)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// A server for a mesh built from its settings and registry: no config
    /// guards, no decision log, no metrics endpoint unless asked for
    /// ([`Server::with_metrics_listen`]).
    pub fn new(config: MeshConfig, registry: Arc<dyn Registry>) -> Self {
        Self::with_mesh(Mesh::new(config, registry), Config::default())
    }

    fn with_mesh(mesh: Arc<Mesh>, config: Config) -> Self {
        Self {
            mesh,
            metrics_listen: config.metrics_listen,
            config,
            config_dir: PathBuf::from("."),
            probes: Probes::new(),
            metrics_started: false,
            second_signal_cuts: false,
            listener_warnings: Vec::new(),
        }
    }

    /// Reads the config file at `path` ([`Config::load`]) and builds its
    /// mesh ([`Server::from_config`]); policy files are relative to the
    /// file's folder.
    pub async fn load(path: &Path) -> Result<Self, ServerError> {
        Self::load_with(path, true).await
    }

    /// As [`Server::load`], with no session memory attached: the caller
    /// attaches its own ([`Mesh::attach_sessions`]) before the first batch,
    /// as the benchmark does to count its store's operations. The config's
    /// `[sessions]` section is still checked, and its bounds are the mesh's.
    pub async fn load_without_sessions(path: &Path) -> Result<Self, ServerError> {
        Self::load_with(path, false).await
    }

    async fn load_with(path: &Path, sessions: bool) -> Result<Self, ServerError> {
        let config = Config::load(path)?;
        let dir = path
            .parent()
            .filter(|dir| !dir.as_os_str().is_empty())
            .unwrap_or_else(|| Path::new("."));
        Ok(Self::build(config, sessions)
            .await?
            .with_config_dir(dir.to_path_buf()))
    }

    /// Builds the mesh a loaded config describes: its security sections,
    /// its registry with the `[[guard]]` entries registered, each checked
    /// once by the admission a `Register` call goes through (R16). Logs the
    /// config's insecure settings and guard warnings, and raises the soft
    /// open-file limit to the hard one (the connection cap is derived from
    /// it unless `[server] max_connections` is set, R25).
    pub async fn from_config(config: Config) -> Result<Self, ServerError> {
        Self::build(config, true).await
    }

    async fn build(config: Config, attach_sessions: bool) -> Result<Self, ServerError> {
        // The listener's own are logged when it opens (Server::serve, run).
        for warning in config.mesh_insecure_settings() {
            tracing::warn!("insecure setting: {warning}");
        }
        for warning in config.guard_warnings() {
            tracing::warn!("{warning}");
        }
        // The probes answer from the start: /healthz at once, /readyz 503
        // until the registry is loaded and the listener accepts.
        let probes = Probes::new();
        if let Some(addr) = config.metrics_listen {
            crate::observe::metrics_http::spawn_with_probes(addr, probes.clone())
                .await
                .map_err(|source| ServerError::Metrics { addr, source })?;
        }
        if let Some(limit) = guardmesh_client::listener::raise_open_file_limit() {
            tracing::info!(open_files = limit, "open-file limit");
        }
        // R34: a shared store without the secret is refused before anything
        // is connected.
        let place = config
            .sessions
            .place(&config.registry)
            .map_err(|e| ServerError::Sessions(e.to_string()))?;
        let digester = match &config.sessions.secret_file {
            Some(path) => Some(
                crate::session::secret::read_secret(path)
                    .map_err(|e| ServerError::Sessions(e.to_string()))?,
            ),
            None => None,
        };
        let (mesh_config, checked) = config.build_with_guards()?;
        let (registry, etcd) =
            build_registry(&config, checked, mesh_config.default_guard_timeout).await?;
        let sessions = if attach_sessions {
            build_sessions(&config, place, etcd, digester).await?
        } else {
            None
        };
        let metrics_started = config.metrics_listen.is_some();
        let mesh = Mesh::new(mesh_config, registry);
        if let Some(sessions) = sessions {
            tracing::info!(
                store = sessions.store().kind(),
                "session memory: {}",
                if place.shared() {
                    "shared with the replicas through the store"
                } else {
                    "in this mesh's memory, not shared with other replicas"
                }
            );
            // A new mesh has no sessions attached yet.
            let _ = mesh.attach_sessions(sessions);
        }
        let listener_warnings = config.listener_insecure_settings();
        let mut server = Self::with_mesh(mesh, config);
        server.listener_warnings = listener_warnings;
        server.probes = probes;
        server.metrics_started = metrics_started;
        Ok(server)
    }

    /// The folder the config's policy files are relative to (default: the
    /// current folder).
    #[must_use]
    pub fn with_config_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.config_dir = dir.into();
        self
    }

    /// Serves Prometheus metrics on `addr` (instead of the config's
    /// `metrics_listen`).
    #[must_use]
    pub fn with_metrics_listen(mut self, addr: SocketAddr) -> Self {
        self.metrics_listen = Some(addr);
        self.metrics_started = false;
        self
    }

    /// What `/healthz` and `/readyz` report for this server.
    pub fn probes(&self) -> &Arc<Probes> {
        &self.probes
    }

    /// The mesh this server runs.
    pub fn mesh(&self) -> &Arc<Mesh> {
        &self.mesh
    }

    /// The config's `listen` address.
    pub fn listen_addr(&self) -> SocketAddr {
        self.config.listen
    }

    /// A handle that does what SIGHUP does: reload the server certificate
    /// and the config's policy files.
    pub fn reloader(&self) -> Reloader {
        Reloader {
            mesh: self.mesh.clone(),
            folder: self.config_dir.clone(),
            guards: self.policy_guards(),
        }
    }

    /// Makes a second SIGINT or SIGTERM during the drain end it at once,
    /// as an operator who presses Ctrl-C twice expects: batches still in
    /// flight are cut (their streams end with an error), the decision log
    /// is still closed cleanly. Off by default, because it installs signal
    /// handlers for the whole process once the first shutdown begins;
    /// `guardmesh serve` turns it on.
    pub fn second_signal_cuts_drain(mut self) -> Self {
        self.second_signal_cuts = true;
        self
    }

    /// Binds `addr` (with `SO_REUSEADDR`), prepares the mesh (decision log,
    /// policy watch, SIGHUP, metrics), and only then listens and serves until
    /// `shutdown` completes: no connection is accepted before the decision
    /// log has recorded the config's guards, and the log names the mesh by
    /// the address bound (the port of `127.0.0.1:0` is known by then).
    pub async fn serve(
        self,
        addr: SocketAddr,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServerError> {
        let listen = |source| ServerError::Listen { addr, source };
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }
        .and_then(|socket| {
            #[cfg(unix)]
            socket.set_reuseaddr(true)?;
            socket.bind(addr)?;
            Ok(socket)
        })
        .map_err(listen)?;
        let bound = socket.local_addr().map_err(listen)?;
        self.warn_listener();
        let running = self.prepare(bound).await?;
        let listener = socket.listen(1024).map_err(|source| ServerError::Listen {
            addr: bound,
            source,
        })?;
        running.serve(listener, shutdown).await
    }

    /// Serves on a listener already listening (tests, and callers that
    /// bind their own), after the same preparation as [`Server::serve`],
    /// until `shutdown` completes; then drains and closes the decision log.
    pub async fn run(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServerError> {
        let bound = listener
            .local_addr()
            .map_err(|source| ServerError::Listen {
                addr: self.config.listen,
                source,
            })?;
        self.warn_listener();
        let running = self.prepare(bound).await?;
        running.serve(listener, shutdown).await
    }

    /// Logs the listener's insecure settings of a config ([`Server::load`]).
    fn warn_listener(&self) {
        for warning in &self.listener_warnings {
            tracing::warn!("insecure setting: {warning}");
        }
    }

    /// The config's policy guards.
    fn policy_guards(&self) -> Vec<GuardConfig> {
        self.config
            .guards
            .iter()
            .filter(|g| g.policy.is_some())
            .cloned()
            .collect()
    }

    /// Everything but the listener: the decision log, the policy watch,
    /// SIGHUP and the metrics endpoint.
    async fn prepare(self, bound: SocketAddr) -> Result<Running, ServerError> {
        self.prepare_as(&bound.to_string()).await
    }

    /// [`Server::prepare`], the decision log naming the mesh `instance`.
    async fn prepare_as(self, instance: &str) -> Result<Running, ServerError> {
        let mesh = self.mesh.clone();
        // R29: the decision log is open before the first batch, or the mesh
        // does not start.
        if let Some(section) = &self.config.decision_log {
            use crate::decision_log::{DecisionLog, MeshLog};
            // The instance is the address bound, not a port-0 address asked for.
            let settings = self
                .config
                .decision_log_settings(section, instance)
                .map_err(|e| ServerError::DecisionLogSettings(e.into()))?;
            let limits = section
                .limits()
                .map_err(|e| ServerError::DecisionLogSettings(e.into()))?;
            let log = DecisionLog::open(settings)
                .await
                .map_err(ServerError::DecisionLogOpen)?;
            let log =
                MeshLog::new(log, section.on_log_failure, mesh.metrics.clone()).with_limits(limits);
            let specs: Vec<_> = self.config.guards.iter().map(|g| g.to_spec()).collect();
            log.config_guards(&specs, mesh.registry().chain().revision)
                .await;
            let _ = mesh.attach_decision_log(log);
            tracing::info!(dir = %section.dir.display(), "decision log open");
        }
        // The config's policy files are reloaded when they change on disk
        // (unless `watch_policies = false`) and on SIGHUP (R27); SIGHUP also
        // reloads the server certificate at once (it is also reloaded when
        // its files change).
        let reloader = self.reloader();
        let policy_watch = if reloader.guards.is_empty() || !self.config.watch_policies {
            None
        } else {
            Some(
                policy_reload::watch(
                    mesh.clone(),
                    reloader.folder.clone(),
                    reloader.guards.clone(),
                )
                .map_err(ServerError::PolicyWatch)?,
            )
        };
        let hangup = reloader.on_sighup();
        if let Some(addr) = self.metrics_listen.filter(|_| !self.metrics_started) {
            crate::observe::metrics_http::spawn_with_probes(addr, self.probes.clone())
                .await
                .map_err(|source| ServerError::Metrics { addr, source })?;
        }
        self.probes.set_mesh(mesh.clone());
        Ok(Running {
            mesh,
            guards: self.config.guards.len(),
            _policy_watch: policy_watch,
            hangup,
            probes: self.probes.clone(),
            grace: self.config.server.shutdown_grace(),
            second_signal_cuts: self.second_signal_cuts,
        })
    }
}

/// A mesh in the caller's own process, with no listener: an MCP gateway
/// started with `--config` judges through it by function calls instead
/// of a gRPC stream to a mesh of its own (one process and one network hop
/// fewer per call). Everything but the listener is as `guardmesh serve`
/// has it: the config's guards and policies (and their reload on change
/// and SIGHUP), the registry, session memory, limits and deadlines, and
/// the decision log, named by the instance given to
/// [`Server::in_process`]. Each batch is judged and recorded as a unary
/// `EvaluateBatch` from an unauthenticated caller would be. Close it
/// ([`InProcess::close`]) when done, so that the decision log is closed
/// cleanly.
pub struct InProcess {
    tool: crate::grpc::service::PreTool,
    /// The decision log's caller of every batch (made once).
    caller: Arc<crate::decision_log::Caller>,
    running: Running,
    /// Held so that the draining flag never turns.
    _draining: tokio::sync::watch::Sender<bool>,
}

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcess")
            .field("guards", &self.running.guards)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Prepares the mesh as [`Server::serve`] does (decision log, policy
    /// watch, SIGHUP, metrics endpoint when configured) and returns it for
    /// judging in this process; no listener is opened. `instance` names the
    /// mesh in the decision log (`log verify --instance`), and `caller`
    /// names what sends its batches (the log's `caller.peer` is
    /// `in-process:<caller>`).
    pub async fn in_process(self, instance: &str, caller: &str) -> Result<InProcess, ServerError> {
        let running = self.prepare_as(instance).await?;
        // Dial the config's guards before the first batch needs them.
        let _ = running.mesh.chain();
        let (draining, watch) = tokio::sync::watch::channel(false);
        let tool = crate::grpc::service::PreTool::new(running.mesh.clone(), watch);
        // No principal was authenticated: the log names the caller by where
        // its batches came from instead of a peer address.
        let caller = Arc::new(crate::decision_log::Caller {
            id: None,
            roles: Vec::new(),
            peer: Some(format!("in-process:{caller}")),
        });
        Ok(InProcess {
            tool,
            caller,
            running,
            _draining: draining,
        })
    }
}

impl InProcess {
    /// Judges one batch (R2-R35 as for a batch sent over gRPC): its
    /// decision, or the status a unary `EvaluateBatch` would have been
    /// answered with (a refusal, R20; an abort, R13, R17).
    pub async fn evaluate(
        &self,
        request: guardmesh_proto::v1::EvaluateRequest,
    ) -> Result<guardmesh_proto::v1::BatchDecision, tonic::Status> {
        self.tool.local(request, &self.caller).await
    }

    /// Tool visibility: the tools of `tools` the current chain skips
    /// whatever a call's arguments, as `PreToolService.AlwaysSkipped`
    /// answers ([`Mesh::always_skipped`]).
    pub fn always_skipped(
        &self,
        tools: &[String],
    ) -> Result<guardmesh_proto::v1::AlwaysSkippedResponse, tonic::Status> {
        self.running.mesh.always_skipped(tools)
    }

    /// The mesh itself (metrics, registry, chain).
    pub fn mesh(&self) -> &Arc<Mesh> {
        &self.running.mesh
    }

    /// Stops the SIGHUP reload and closes the decision log (R29: every
    /// record written and the chain's end recorded).
    pub async fn close(&self) {
        if let Some(hangup) = &self.running.hangup {
            hangup.abort();
        }
        if let Some(log) = self.running.mesh.decision_log()
            && let Err(error) = log.close().await
        {
            tracing::error!(%error, "decision log not closed cleanly");
        }
    }
}

/// A prepared server, waiting for its listener.
struct Running {
    mesh: Arc<Mesh>,
    /// How many `[[guard]]` entries the config has (for the start line).
    guards: usize,
    /// Dropped with the server: the watch stops.
    _policy_watch: Option<notify::RecommendedWatcher>,
    hangup: Option<tokio::task::JoinHandle<()>>,
    probes: Arc<Probes>,
    /// How long the drain may take once `shutdown` completes
    /// (`[server] shutdown_grace_ms`).
    grace: std::time::Duration,
    /// A second SIGINT or SIGTERM during the drain ends it at once.
    second_signal_cuts: bool,
}

impl Running {
    async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServerError> {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, guards = self.guards, "guardmesh serving");
        }
        self.probes.set_listening();
        // On shutdown: /readyz turns 503, the server drains, and the drain
        // has `[server] shutdown_grace_ms` to finish before serving stops
        // anyway (batches still in flight are cut).
        let (stopping, stop) = tokio::sync::watch::channel(false);
        let probes = self.probes.clone();
        let signal = async move {
            shutdown.await;
            probes.set_draining();
            let _ = stopping.send(true);
        };
        let signalled = {
            let mut stop = stop.clone();
            async move {
                let _ = stop.wait_for(|s| *s).await;
            }
        };
        let grace = self.grace;
        let second_signal_cuts = self.second_signal_cuts;
        let grace_over = async move {
            let mut stop = stop;
            let _ = stop.wait_for(|s| *s).await;
            // Listening starts only now: a signal before the first one
            // finished is not a second one.
            let second = async {
                if second_signal_cuts {
                    shutdown_signal().await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = tokio::time::sleep(grace) => DrainCut::GraceOver,
                () = second => DrainCut::SecondSignal,
            }
        };
        let serving = async {
            tokio::select! {
                served = crate::grpc::run(listener, self.mesh.clone(), signalled) => served,
                cut = grace_over => {
                    match cut {
                        DrainCut::GraceOver => tracing::warn!(
                            grace_ms = grace.as_millis() as u64,
                            "shutdown grace period over: exiting with batches still in flight"
                        ),
                        DrainCut::SecondSignal => tracing::warn!(
                            "second shutdown signal: drain cut short, exiting with batches still in flight"
                        ),
                    }
                    Ok(())
                }
            }
        };
        let served = {
            tokio::pin!(signal);
            tokio::pin!(serving);
            let mut signalled = false;
            loop {
                tokio::select! {
                    served = &mut serving => break served,
                    () = &mut signal, if !signalled => signalled = true,
                }
            }
        };
        if let Some(hangup) = &self.hangup {
            hangup.abort();
        }
        if let Some(log) = self.mesh.decision_log()
            && let Err(error) = log.close().await
        {
            tracing::error!(%error, "decision log not closed cleanly");
        }
        served?;
        tracing::info!("guardmesh stopped");
        Ok(())
    }
}

/// Why a drain ended before every batch in flight was answered.
enum DrainCut {
    /// `[server] shutdown_grace_ms` ran out.
    GraceOver,
    /// The operator signalled again.
    SecondSignal,
}

/// Reloads what SIGHUP reloads: the server certificate, and the policy
/// files of the config's policy guards (R27), each read and compiled whole
/// before anything changes.
#[derive(Clone)]
pub struct Reloader {
    mesh: Arc<Mesh>,
    folder: PathBuf,
    guards: Vec<GuardConfig>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("folder", &self.folder)
            .field("guards", &self.guards.len())
            .finish_non_exhaustive()
    }
}

impl Reloader {
    /// Reloads the certificate and every policy file once.
    pub async fn reload(&self) {
        if let Some(tls) = &self.mesh.config.security.server_tls {
            tls.cert.reload();
        }
        for guard in &self.guards {
            policy_reload::reload_policy(
                &self.mesh,
                &self.folder,
                guard.clone(),
                policy_reload::Trigger::Signal,
            )
            .await;
        }
    }

    /// Reloads on every SIGHUP until the returned task is aborted; none
    /// when there is nothing to reload (SIGHUP then keeps its default).
    fn on_sighup(self) -> Option<tokio::task::JoinHandle<()>> {
        if self.mesh.config.security.server_tls.is_none() && self.guards.is_empty() {
            return None;
        }
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let mut hup = signal(SignalKind::hangup()).ok()?;
            Some(tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    self.reload().await;
                }
            }))
        }
        #[cfg(not(unix))]
        None
    }
}

/// The registry `[registry]` asks for, with the file's `[[guard]]` entries
/// registered in file order (R16). With etcd they are only created where
/// absent: the shared chain, not one replica's file, is the source of truth.
/// `guards`: the entries as admitted by `Config::build_with_guards`. With
/// etcd, also its client and the chain's prefix (for session memory).
async fn build_registry(
    config: &Config,
    guards: Vec<CheckedGuard>,
    default_timeout: Duration,
) -> Result<(Arc<dyn Registry>, Option<(etcd_client::Client, String)>), ServerError> {
    let failed = |name: String| move |source| ServerError::ConfigGuard { name, source };
    match config.registry.kind {
        RegistryKind::Memory => {
            let registry = Arc::new(MemoryRegistry::new(default_timeout));
            for guard in guards {
                let name = guard.name().to_owned();
                registry.register(guard, None).await.map_err(failed(name))?;
            }
            Ok((registry, None))
        }
        RegistryKind::Etcd => {
            let etcd = config
                .registry
                .etcd()
                .map_err(|e| ServerError::Registry(e.into()))?;
            let registry = Arc::new(
                EtcdRegistry::connect(etcd, default_timeout)
                    .await
                    .map_err(|e| ServerError::Registry(e.into()))?,
            );
            for guard in guards {
                let name = guard.name().to_owned();
                registry
                    .register_if_absent(guard)
                    .await
                    .map_err(failed(name))?;
            }
            let etcd = (registry.client(), registry.prefix().to_owned());
            Ok((registry, Some(etcd)))
        }
    }
}

/// The session memory `[sessions]` asks for (R34), at `place`: in a shared
/// store (the registry's etcd through its client, or Redis), keyed with
/// `digester` (the secret of `secret_file`); in this mesh's memory keyed
/// with it, or with a random secret. Every store operation has `store_timeout_ms` as its
/// deadline.
async fn build_sessions(
    config: &Config,
    place: crate::config::SessionPlace,
    etcd: Option<(etcd_client::Client, String)>,
    digester: Option<crate::session::Digester>,
) -> Result<Option<Arc<crate::session::SessionMemory>>, ServerError> {
    use crate::config::SessionPlace;
    use crate::session::{LocalStore, SessionMemory, SessionStore};
    let section = &config.sessions;
    let failed = |e: &dyn std::fmt::Display| ServerError::Sessions(e.to_string());
    let limits = section.limits();
    let digester = match digester {
        Some(digester) => digester,
        // A single mesh: a secret of this process.
        None if !place.shared() => crate::session::Digester::random(),
        None => {
            return Err(ServerError::Sessions(
                crate::config::SessionsSettingError::NoSecret {
                    store: place.name(),
                }
                .to_string(),
            ));
        }
    };
    let store: Arc<dyn SessionStore> = match place {
        SessionPlace::Local => Arc::new(LocalStore::new(limits)),
        SessionPlace::Etcd => {
            let (client, prefix) = etcd.ok_or_else(|| {
                ServerError::Sessions("sessions: the etcd registry is not connected".into())
            })?;
            Arc::new(crate::session::etcd::EtcdStore::new(
                client, &prefix, &digester,
            ))
        }
        SessionPlace::Redis => {
            let password = match &section.redis_password_file {
                None => None,
                Some(path) => Some(read_password(path).map_err(|e| failed(&e))?),
            };
            let settings = crate::session::redis::RedisSettings {
                url: section.redis_url.clone().unwrap_or_default(),
                password,
                prefix: config.registry.prefix.clone(),
                request_timeout: section.store_timeout(),
                dial_timeout: Duration::from_millis(config.registry.dial_timeout_ms.max(1)),
            };
            Arc::new(
                crate::session::redis::RedisStore::connect(&settings, &digester)
                    .await
                    .map_err(|e| failed(&e))?,
            )
        }
    };
    if place.shared() {
        agree_on_secret(store.as_ref(), &digester, config).await?;
    }
    Ok(Some(Arc::new(
        SessionMemory::new(store, digester, limits).with_timeout(section.store_timeout()),
    )))
}

/// Refuses to start a replica whose session secret is not the one the
/// replicas already sharing the store use (their digests would never
/// meet: a value read through one replica would not be recognised through
/// another).
async fn agree_on_secret(
    store: &dyn crate::session::SessionStore,
    digester: &crate::session::Digester,
    config: &Config,
) -> Result<(), ServerError> {
    use crate::session::store::{SECRET_CHECK, SecretAgreement, secret_check, sessions_prefix};
    let within = Duration::from_millis(config.registry.dial_timeout_ms.max(1));
    let check = secret_check(digester);
    let key = format!("{}{SECRET_CHECK}", sessions_prefix(&config.registry.prefix));
    match tokio::time::timeout(within, store.agree_on_secret(&check)).await {
        Err(_) => Err(ServerError::Sessions(format!(
            "sessions: the {} store did not answer the check of the session secret within {within:?}",
            store.kind()
        ))),
        Ok(Err(e)) => Err(ServerError::Sessions(format!(
            "sessions: cannot check the session secret in the {} store: {e}",
            store.kind()
        ))),
        Ok(Ok(SecretAgreement::Differs)) => Err(ServerError::Sessions(format!(
            "sessions.secret_file is not the secret the other replicas sharing the {} store use \
             (the check at {key} was written with another): give every replica the same file; \
             to change the secret, stop every replica, delete the keys under {} and start them \
             with the new file",
            store.kind(),
            sessions_prefix(&config.registry.prefix)
        ))),
        Ok(Ok(_)) => Ok(()),
    }
}

/// Reads `sessions.redis_password_file`: its text less a final newline.
fn read_password(path: &Path) -> Result<String, String> {
    let text = crate::files::read_to_string(path, crate::files::MAX_SECRET_FILE_BYTES)
        .map_err(|e| format!("sessions.redis_password_file {}: {e}", path.display()))?;
    let password = text.strip_suffix('\n').unwrap_or(&text);
    let password = password.strip_suffix('\r').unwrap_or(password);
    if password.is_empty() {
        return Err(format!(
            "sessions.redis_password_file {} is empty",
            path.display()
        ));
    }
    Ok(password.to_owned())
}

/// Completes on SIGINT or SIGTERM (on other systems, on Ctrl-C).
pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(term) => term,
            Err(_) => {
                let _ = interrupt.await;
                return;
            }
        };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
