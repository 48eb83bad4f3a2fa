//! A registry shared by several mesh replicas, kept in etcd (v3 API).
//!
//! One mesh process is a single point of failure and a ceiling, so production
//! runs several replicas behind a load balancer; they must all judge with the
//! same chain. This registry keeps the chain in etcd, under a configurable key
//! prefix, and every replica follows it with a watch.
//!
//! # Keys
//!
//! | key | value | lease |
//! |---|---|---|
//! | `<prefix>/guards/<name>` | the `GuardSpec`, protobuf-encoded (the wire message of `guardmesh.v1`) | none |
//! | `<prefix>/revision` | name of the guard changed last | none |
//! | `<prefix>/alive/<name>` | unused (empty) | the guard's heartbeat lease |
//! | `<prefix>/replicas/<name>/<address, `%` and `/` escaped>` | the replica's address (`http://host:port`) | that replica's heartbeat lease |
//! | `<prefix>/removed/<name>` | tombstone of a deregistered guard (a mark unique to the call) | none |
//! | `<prefix>/owner/<name>` | the identity that registered the guard | none |
//! | `<prefix>/owned/<identity>/<name>` | empty: one key per guard an identity owns (`/` and `%` of the identity escaped) | none |
//!
//! * **One quota for all replicas** (R16, R25): a `Register` by an
//!   authenticated caller reads the caller's `owned/` keys (a linearizable
//!   read), checks its quota, and writes the registration together with its
//!   owner keys in one transaction that applies only if none of the
//!   caller's `owned/` keys nor the guard's `owner` key changed since that
//!   read; a replica that loses a race reads again. `Deregister` deletes
//!   the owner keys in its own transaction, which frees the place.
//! * **Checked once** (R16): a registration reaches the registry already
//!   admitted (`registry::admit`). The replica that writes it keeps the
//!   checked guard and uses it when its watch reads the write back; every
//!   other replica decodes and checks the stored spec once, compiling its
//!   policy, which is the work one process cannot share with another.
//!
//! * **Policy is durable** (R15): a registration is a plain key that only
//!   deregistration removes. A crashed guard's registration never expires; the
//!   guard stays in the chain and fails per its failure policy (R13), which the
//!   guard's link already does when the guard cannot be reached.
//! * **Liveness is leased and separate**: a guard (or a sidecar next to it)
//!   may heartbeat `<prefix>/alive/<name>` with a lease (`guardmesh
//!   heartbeat`, through [`client`] and [`EtcdConfig::alive_key`]).
//!   When the lease lapses the replicas log it and report it in
//!   [`EtcdRegistry::status`]; the chain does not change.
//! * **Replicas come and go with their leases** (R32): `guardmesh heartbeat
//!   --replica ADDR`, run once beside each replica of a guard, keeps
//!   `<prefix>/replicas/<name>/<ADDR>` on its own lease. Each mesh replica
//!   follows those keys ([`EtcdRegistry::replicas`]): a replica whose lease
//!   ends leaves the guard's replica set, the others stay. Every announced
//!   address is held to the endpoint policy as a registered one is. A
//!   guard with a live replica key reads as alive; a guard whose announced
//!   replicas all left stays in the chain (R15).
//! * **Order comes from etcd** (R16): the chain is sorted by priority, then by
//!   the registration key's `create_revision`. Every replica computes the same
//!   order from the same keys without coordinating. Registering an existing
//!   name is a plain put on its key, which keeps its `create_revision` and so
//!   its position.
//! * **The chain revision is etcd's** (R17): every write through the mesh
//!   also puts `<prefix>/revision` in the same transaction, so the revision
//!   of the last chain change (deletions included) is that key's
//!   `mod_revision`. A replica that follows the watch and one that has just
//!   listed the keys report the same revision for the same chain, and two
//!   replicas' decisions can be compared. (Keys written past the mesh, e.g.
//!   with `etcdctl`, are picked up too, but a raw delete there does not move
//!   the marker, so a replica that lists afterwards may report an older
//!   revision than one that saw the delete on its watch.)
//!
//! * **A removal is remembered** (R17): `Deregister` deletes the
//!   registration and puts a tombstone in the same transaction. Seeding from
//!   a config file's `[[guard]]` entries creates a guard only where there is
//!   neither a registration nor a tombstone, so a replica starting with an
//!   older file never brings a deregistered guard back. An explicit
//!   `Register` clears the tombstone. (A raw `etcdctl del` of a registration
//!   leaves none.)
//!
//! Protobuf rather than JSON for the stored spec: it is the contract the
//! guards already speak, it decodes with the same code as the wire, and new
//! fields of `GuardSpec` stay readable by older replicas during a rolling
//! upgrade. `etcdctl get --prefix <prefix>/guards/` shows the names; the mesh's
//! `guardmesh guards list` shows the decoded chain.
//!
//! # Staleness
//!
//! Every heartbeat interval a replica confirms its chain with etcd's quorum:
//! a linearizable read of the registration keys (names and revisions only)
//! must match what the replica holds, or the replica lists the chain again.
//! A watch message is not a confirmation: a member cut off from the quorum
//! still answers watches and progress requests from its old state. Every
//! request also requires a leader, so such a member refuses at once ("no
//! leader") and cancels its watches, and requests go to another member.
//! Idempotent requests (reads, the registry's transactions) are retried on
//! another member within the request timeout.
//!
//! A replica that cannot confirm its chain keeps judging with it for the
//! configured staleness window, counted from the last confirmation, and says
//! so in its logs and in [`EtcdRegistry::status`]. After the window,
//! [`Registry::check`] answers per the configured [`AfterWindow`] policy: by
//! default it refuses batches with UNAVAILABLE rather than judge with a chain
//! it can no longer trust. When the quorum answers again the replica resumes
//! its watch (or lists again, if the history it missed was compacted)
//! without a restart.

use crate::registry::spec::Guard;
use crate::registry::{
    ChainSpec, CheckedGuard, Deregistered, Owner, Registered, Registry, RegistryError,
};
use arc_swap::ArcSwap;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, Event, GetOptions, KeyValue, Txn, TxnOp,
    TxnOpResponse, WatchOptions, WatchStream,
};
use futures::future::BoxFuture;
use guardmesh_proto::v1::GuardSpec;
use prost::Message;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What a replica does once etcd has been unreachable for longer than the
/// staleness window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AfterWindow {
    /// Refuse batches with UNAVAILABLE: a chain that may have lost a guard
    /// since (or gained one) is not trusted to judge. The default.
    #[default]
    Refuse,
    /// Keep judging with the last chain, and keep saying it is stale. For
    /// deployments that value availability over a possibly outdated chain.
    ServeStale,
}

pub use crate::etcd_tls::TlsFiles;

/// Settings of the etcd registry (the `[registry]` section of the config).
#[derive(Clone)]
pub struct EtcdConfig {
    /// `http://host:port` (or `https://` with the `etcd-tls` feature).
    pub endpoints: Vec<String>,
    /// Key prefix of this chain, e.g. `/guardmesh/prod`. Meshes with the same
    /// prefix serve the same chain.
    pub prefix: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub tls: Option<TlsFiles>,
    /// How long start-up may take to reach etcd before the replica gives up.
    pub dial_timeout: Duration,
    /// Deadline of every etcd request (retries on another member included),
    /// and of the watch's answer to a progress request.
    pub request_timeout: Duration,
    /// How often the replica confirms its chain with etcd's quorum (and
    /// asks its watch for progress); how often a guard's heartbeat
    /// (`guardmesh heartbeat`) renews its lease.
    pub heartbeat_interval: Duration,
    /// Time to live of a guard's heartbeat lease (etcd rounds it to whole
    /// seconds and enforces its own minimum, about 2 s).
    pub lease_ttl: Duration,
    /// How long a replica that lost etcd keeps judging with its last chain.
    pub staleness_window: Duration,
    /// What it does after that.
    pub after_window: AfterWindow,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".to_owned()],
            prefix: "/guardmesh".to_owned(),
            username: None,
            password: None,
            tls: None,
            dial_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(1),
            lease_ttl: Duration::from_secs(10),
            staleness_window: Duration::from_secs(30),
            after_window: AfterWindow::Refuse,
        }
    }
}

// Hand-written so that the password never reaches a log line.
impl std::fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .field("dial_timeout", &self.dial_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("lease_ttl", &self.lease_ttl)
            .field("staleness_window", &self.staleness_window)
            .field("after_window", &self.after_window)
            .finish()
    }
}

impl EtcdConfig {
    /// Refuses settings that could only fail later, with the key to fix.
    fn validate(&self) -> Result<(), ConnectError> {
        let bad = |what: String| Err(ConnectError::Config(format!("[registry] {what}")));
        if self.endpoints.is_empty() {
            return bad("endpoints must not be empty".into());
        }
        if self.username.is_some() != self.password.is_some() {
            return bad("username and password (or password_env) go together".into());
        }
        let prefix = self.prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return bad(format!(
                "prefix {:?} is empty: give each chain its own prefix, e.g. \"/guardmesh\"",
                self.prefix
            ));
        }
        for (name, value) in [
            ("dial_timeout_ms", self.dial_timeout),
            ("request_timeout_ms", self.request_timeout),
            ("heartbeat_interval_ms", self.heartbeat_interval),
            ("lease_ttl_s", self.lease_ttl),
        ] {
            if value.is_zero() {
                return bad(format!("{name} must be greater than 0"));
            }
        }
        if self.lease_ttl <= self.heartbeat_interval {
            return bad(format!(
                "lease_ttl_s ({:?}) must be longer than heartbeat_interval_ms ({:?}), or every lease lapses between two heartbeats",
                self.lease_ttl, self.heartbeat_interval
            ));
        }
        let https = self.endpoints.iter().any(|e| e.starts_with("https://"));
        if (https || self.tls.is_some()) && !cfg!(feature = "etcd-tls") {
            return bad(
                "TLS (https:// endpoints, ca_file, cert_file, key_file, tls_domain) needs a guardmesh built with `--features etcd-tls`".into(),
            );
        }
        Ok(())
    }

    /// The liveness key of guard `name`: `<prefix>/alive/<name>`, which a
    /// guard (or `guardmesh heartbeat` beside it) keeps on a lease.
    pub fn alive_key(&self, name: &str) -> String {
        self.keys().alive(name.trim())
    }

    /// The key that announces `address` as one replica of guard `name`
    /// (R32): `<prefix>/replicas/<name>/<address>`, with `%` and `/` of the
    /// address escaped so that the name is everything before the last `/`.
    /// `guardmesh heartbeat --replica` keeps it on that replica's lease,
    /// with the address as its value.
    pub fn replica_key(&self, name: &str, address: &str) -> String {
        self.keys().replica(name.trim(), address)
    }

    fn keys(&self) -> Keys {
        let prefix = self.prefix.trim_end_matches('/');
        Keys {
            root: format!("{prefix}/"),
            guards: format!("{prefix}/guards/"),
            alive: format!("{prefix}/alive/"),
            replicas: format!("{prefix}/replicas/"),
            revision: format!("{prefix}/revision"),
            removed: format!("{prefix}/removed/"),
            owner: format!("{prefix}/owner/"),
            owned: format!("{prefix}/owned/"),
        }
    }
}

/// Why the registry could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("invalid etcd registry settings: {0}")]
    Config(String),
    #[error("invalid etcd registry settings: [registry] {0}")]
    Tls(#[from] crate::etcd_tls::EtcdTlsError),
    #[error("cannot reach etcd at {endpoints}: {cause}")]
    Unreachable { endpoints: String, cause: String },
}

/// Why an etcd request failed; `what` names the request.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// etcd answered with an error that a retry only repeats.
    #[error("{what}: {source}")]
    Refused {
        what: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// One attempt, and no answer within its deadline.
    #[error("{what}: no answer within {timeout:?}")]
    Timeout {
        what: &'static str,
        timeout: Duration,
    },
    /// Retried until the deadline; `last` is the last attempt's failure.
    #[error("{what}: {last} ({attempts} attempt(s) within {timeout:?})")]
    Exhausted {
        what: &'static str,
        last: Attempt,
        attempts: u32,
        timeout: Duration,
    },
}

/// How one attempt of a retried request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Attempt {
    /// etcd refused the auth token (a new one is being fetched).
    #[error("{0}")]
    Unauthenticated(tonic::Status),
    #[error("{0}")]
    Etcd(etcd_client::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Why a stored registration cannot be read back as a guard.
#[derive(Debug, thiserror::Error)]
enum StoredError {
    #[error("not a GuardSpec: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("{0}")]
    Invalid(#[from] crate::registry::spec::SpecError),
    #[error("stored under {key:?} but names itself {name:?}")]
    Misnamed { key: String, name: String },
}

/// The key layout under one prefix (see the module docs).
#[derive(Debug, Clone)]
struct Keys {
    root: String,
    guards: String,
    alive: String,
    /// `<prefix>/replicas/<name>/<address>`: replicas announced by their
    /// heartbeats (R32).
    replicas: String,
    revision: String,
    /// Tombstones of guards removed with `Deregister`.
    removed: String,
    /// `<prefix>/owner/<name>`: the identity that registered the guard.
    owner: String,
    /// `<prefix>/owned/<identity>/<name>`: the guards an identity owns,
    /// counted for its quota (R25).
    owned: String,
}

impl Keys {
    fn guard(&self, name: &str) -> String {
        format!("{}{name}", self.guards)
    }

    fn alive(&self, name: &str) -> String {
        format!("{}{name}", self.alive)
    }

    fn replica(&self, name: &str, address: &str) -> String {
        format!("{}{name}/{}", self.replicas, escape_address(address))
    }

    fn removed(&self, name: &str) -> String {
        format!("{}{name}", self.removed)
    }

    fn owner(&self, name: &str) -> String {
        format!("{}{name}", self.owner)
    }

    /// The prefix of the keys of the guards `identity` owns. The identity
    /// is escaped so that no identity's prefix holds another's (`a` and
    /// `a/b`).
    fn owned_by(&self, identity: &str) -> String {
        let escaped = identity.replace('%', "%25").replace('/', "%2F");
        format!("{}{escaped}/", self.owned)
    }
}

/// Whether a guard of the chain is heartbeating (liveness never changes the
/// chain: R15).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Its heartbeat lease is live.
    Alive,
    /// It heartbeated once (as far as this replica saw) and its lease lapsed
    /// or was revoked. It stays in the chain and fails per its policy.
    Expired,
    /// No heartbeat seen. Guards that do not talk to etcd are always here;
    /// that is not an error.
    NoHeartbeat,
}

/// What a replica knows about its registry, for health, metrics and logs.
#[derive(Debug, Clone)]
pub struct RegistryStatus {
    /// Whether etcd's quorum confirmed the chain at the last probe (a
    /// linearizable read, every heartbeat interval).
    pub connected: bool,
    /// Revision of the chain being served (R17).
    pub revision: u64,
    /// Revision of the latest change under the prefix the replica has
    /// applied (guards, heartbeats), or of its latest listing.
    pub applied_revision: u64,
    pub guards: usize,
    /// How long the chain has gone unconfirmed, while etcd is unreachable.
    pub stale_for: Option<Duration>,
    /// Whether batches are judged right now (false after the staleness
    /// window under `after_window = "refuse"`).
    pub serving: bool,
    /// Why etcd was last unreachable.
    pub last_error: Option<String>,
    /// How many times the replica listed the keys again because its watch
    /// could not resume (compacted history, a new cluster) or fell behind
    /// the chain the quorum confirmed.
    pub relists: u64,
    /// The chain's guards, in order, with their liveness.
    pub liveness: Vec<(String, Liveness)>,
    /// Keys under `<prefix>/guards/` that do not decode to a valid
    /// registration, with why. While there is one the replica refuses
    /// batches (`check`), rather than judge without that guard.
    pub invalid: Vec<(String, String)>,
}

/// One registration as stored.
#[derive(Debug, Clone)]
struct Entry {
    create_revision: i64,
    mod_revision: i64,
    guard: Arc<Guard>,
}

/// What a replica knows of the keys under its prefix.
#[derive(Debug, Default)]
struct View {
    /// The etcd revision the view reflects; events at or below it are old.
    revision: i64,
    /// Revision of the last chain change (R17).
    chain_revision: i64,
    guards: HashMap<String, Entry>,
    /// Every key under `<prefix>/guards/` (valid or not), by name, with its
    /// mod revision: what the freshness probe compares with the quorum's.
    guard_keys: BTreeMap<String, i64>,
    invalid: BTreeMap<String, String>,
    alive: HashSet<String>,
    heartbeated: HashSet<String>,
    /// Replicas announced by heartbeats: guard name -> key suffix ->
    /// address (R32).
    replicas: BTreeMap<String, BTreeMap<String, String>>,
}

/// `%` and `/` of an announced address escaped, for its key.
fn escape_address(address: &str) -> String {
    address.replace('%', "%25").replace('/', "%2F")
}

/// Connection state, for staleness.
#[derive(Debug)]
struct Health {
    connected: bool,
    /// When etcd's quorum last confirmed the chain: the time a linearizable
    /// read was sent whose answer matched the chain (or a listing).
    last_contact: Instant,
    last_error: Option<String>,
    relists: u64,
    /// Whether passing the staleness window was logged for this outage.
    window_logged: bool,
}

/// Whether a replica may judge, given how long etcd has been unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Freshness {
    Fresh,
    /// Unreachable, within the window: judge with the last chain.
    Stale,
    /// Past the window, policy `serve_stale`.
    ServeStale,
    /// Past the window, policy `refuse`.
    Refuse,
}

fn freshness(
    connected: bool,
    since_contact: Duration,
    window: Duration,
    policy: AfterWindow,
) -> Freshness {
    if connected {
        Freshness::Fresh
    } else if since_contact <= window {
        Freshness::Stale
    } else {
        match policy {
            AfterWindow::Refuse => Freshness::Refuse,
            AfterWindow::ServeStale => Freshness::ServeStale,
        }
    }
}

/// Registrations a replica is writing: name -> (the bytes stored, the
/// guard admitted).
type Written = HashMap<String, (Vec<u8>, Arc<Guard>)>;

struct Shared {
    config: EtcdConfig,
    default_timeout: Duration,
    keys: Keys,
    client: Client,
    chain: ArcSwap<ChainSpec>,
    /// The first stored registration that cannot be read (key, why), if
    /// any. While one exists the replica refuses batches: a guard this mesh
    /// cannot read is a guard it cannot apply, and leaving it out of the
    /// chain would let its calls through unjudged.
    unreadable: arc_swap::ArcSwapOption<(String, String)>,
    view: Mutex<View>,
    /// The revision the view reflects, published after the chain is swapped,
    /// so that a writer waiting for its revision then reads its own write.
    applied: watch::Sender<u64>,
    health: Mutex<Health>,
    /// Registrations this replica admitted and is writing, by name, with
    /// the bytes stored: when the watch (or a listing) reads one back, the
    /// guard admitted here is used rather than checked and compiled again.
    written: Mutex<Written>,
    /// Whether a new auth token is being fetched.
    reauthenticating: Arc<std::sync::atomic::AtomicBool>,
    /// The replicas heartbeats announce, by guard (R32), as the view has
    /// them: what [`EtcdRegistry::replicas`] filters per guard.
    announced: watch::Sender<Arc<BTreeMap<String, BTreeSet<String>>>>,
    /// Announced addresses the endpoint policy refused, counted once per
    /// change of a guard's announced set.
    replicas_refused: Arc<std::sync::atomic::AtomicU64>,
}

/// The etcd registry of one mesh replica. Dropping it stops its watch.
pub struct EtcdRegistry {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry")
            .field("config", &self.shared.config)
            .finish()
    }
}

impl Drop for EtcdRegistry {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs an etcd request under the request timeout, so that an unreachable
/// etcd answers as an error instead of a hang.
async fn timed<T>(
    timeout: Duration,
    what: &'static str,
    request: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RequestError> {
    match tokio::time::timeout(timeout, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(RequestError::Refused { what, source }),
        Err(_) => Err(RequestError::Timeout { what, timeout }),
    }
}

/// Runs an idempotent etcd request until it succeeds, fails for a reason a
/// retry only repeats, or `timeout` passes.
///
/// The client balances requests over every configured endpoint and keeps
/// sending some of them to a member that is down (connection refused) or cut
/// off from the quorum ("no leader"): trying again goes to another member.
/// With several endpoints no single attempt may take the whole deadline, so
/// that a member that does not answer at all leaves time for another one.
///
/// Only requests whose effect is the same when applied twice go through
/// here: reads, and the registry's transactions (a put of the same value, a
/// delete of what exists, guarded by comparisons). An attempt that timed
/// out may still have been applied; the transactions' answers account for
/// that where it matters (see `Shared::deregister`).
///
/// A refused auth token (etcd forgets its simple tokens when it restarts)
/// calls `reauthenticate`, which gets a new one in the background, and is
/// retried too.
async fn retried<T, F, Fut>(
    timeout: Duration,
    members: usize,
    what: &'static str,
    reauthenticate: &(dyn Fn() + Sync),
    mut request: F,
) -> Result<T, RequestError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let started = Instant::now();
    let mut pause = Duration::from_millis(10);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let left = timeout.saturating_sub(started.elapsed());
        let budget = if members > 1 {
            (left / 2).max(timeout / 4).min(left)
        } else {
            left
        };
        let error = match tokio::time::timeout(budget, request()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(etcd_client::Error::GRpcStatus(status)))
                if status.code() == tonic::Code::Unauthenticated =>
            {
                reauthenticate();
                Attempt::Unauthenticated(status)
            }
            Ok(Err(source)) if !transient(&source) => {
                return Err(RequestError::Refused { what, source });
            }
            Ok(Err(error)) => Attempt::Etcd(error),
            Err(_) => Attempt::Timeout(budget),
        };
        let left = timeout.saturating_sub(started.elapsed());
        if left <= pause {
            return Err(RequestError::Exhausted {
                what,
                last: error,
                attempts,
                timeout,
            });
        }
        tracing::debug!(what, %error, attempts, "etcd: request failed; retrying");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// The first key after every key that starts with `prefix` (etcd's range
/// end for a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: to the end of the keyspace.
    vec![0]
}

fn to_u64(revision: i64) -> u64 {
    u64::try_from(revision).unwrap_or(0)
}

/// Connects a client with the configured credentials and TLS.
///
/// `refresh_in_calls`: whether a request refused for a stale auth token
/// authenticates again itself, inside the request (and its deadline). The
/// registry does that in the background instead (see `Shared::reauthenticate`):
/// a slow authentication cut short by every request's deadline would
/// otherwise never complete.
/// A client of the etcd `config` names, authenticated, its token refreshed
/// in calls: for a process beside the mesh that keeps keys of its own on
/// leases (`guardmesh heartbeat`).
pub async fn client(config: &EtcdConfig) -> Result<Client, ConnectError> {
    connect_client(config, true).await
}

async fn connect_client(
    config: &EtcdConfig,
    refresh_in_calls: bool,
) -> Result<Client, ConnectError> {
    config.validate()?;
    let mut options = ConnectOptions::new()
        .with_connect_timeout(config.request_timeout.min(config.dial_timeout))
        // HTTP/2 pings notice a dead connection even when no request is out.
        .with_keep_alive(config.heartbeat_interval, config.request_timeout)
        // etcd's simple tokens do not survive an etcd restart; without this
        // a replica would stay unauthenticated after etcd comes back.
        .with_auto_token_refresh(refresh_in_calls)
        // A member cut off from the quorum refuses at once ("no leader")
        // instead of answering from its old state, and cancels watches once
        // it has lost its leader: requests go to a member that can answer.
        .with_require_leader(true);
    if let (Some(user), Some(password)) = (&config.username, &config.password) {
        options = options.with_user(user.clone(), password.clone());
    }
    #[cfg(feature = "etcd-tls")]
    if let Some(tls) = &config.tls {
        options = options.with_tls(crate::etcd_tls::tls_options(tls)?);
    }
    let unreachable = |cause: String| ConnectError::Unreachable {
        endpoints: config.endpoints.join(","),
        cause,
    };
    // With credentials, connecting authenticates, which needs etcd up: retry
    // what may pass once etcd answers, fail at once on what will not (a
    // wrong password, a bad endpoint).
    let started = Instant::now();
    let mut last = None;
    loop {
        let left = config.dial_timeout.saturating_sub(started.elapsed());
        match tokio::time::timeout(
            left,
            Client::connect(config.endpoints.clone(), Some(options.clone())),
        )
        .await
        {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(
                error @ (etcd_client::Error::InvalidArgs(_) | etcd_client::Error::InvalidUri(_)),
            )) => {
                return Err(ConnectError::Config(format!(
                    "[registry] endpoints: {error}"
                )));
            }
            Ok(Err(error)) if !transient(&error) => return Err(unreachable(error.to_string())),
            Ok(Err(error)) => {
                tracing::debug!(%error, "etcd: connect failed; retrying");
                last = Some(error.to_string());
                if started.elapsed() + Duration::from_millis(100) >= config.dial_timeout {
                    return Err(unreachable(error.to_string()));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => {
                return Err(unreachable(match last {
                    Some(error) => error,
                    None => format!("no answer within {:?}", config.dial_timeout),
                }));
            }
        }
    }
}

/// Whether an etcd error may go away by itself (etcd starting, a leader
/// election, a network blip), as opposed to one that a retry only repeats.
fn transient(error: &etcd_client::Error) -> bool {
    use tonic::Code;
    match error {
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Aborted => true,
            // Cancelled by the transport (the member's connection closed
            // mid-request, as when it is killed), not by etcd: another
            // member may answer.
            Code::Cancelled => std::error::Error::source(status).is_some(),
            _ => false,
        },
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

impl EtcdRegistry {
    /// Connects to etcd, lists the chain under the prefix and starts
    /// following it. Fails when etcd cannot be reached within the dial
    /// timeout: a replica that never saw the chain has nothing to judge with.
    /// `default_timeout` replaces a guard's `timeout_ms = 0`, as in
    /// [`crate::MemoryRegistry`].
    pub async fn connect(
        config: EtcdConfig,
        default_timeout: Duration,
    ) -> Result<Self, ConnectError> {
        let client = connect_client(&config, false).await?;
        let keys = config.keys();
        let (applied, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            default_timeout,
            keys,
            client,
            chain: ArcSwap::from_pointee(ChainSpec::default()),
            unreadable: arc_swap::ArcSwapOption::empty(),
            view: Mutex::new(View::default()),
            applied,
            written: Mutex::default(),
            health: Mutex::new(Health {
                connected: false,
                last_contact: Instant::now(),
                last_error: None,
                relists: 0,
                window_logged: false,
            }),
            reauthenticating: Arc::default(),
            announced: watch::channel(Arc::default()).0,
            replicas_refused: Arc::default(),
            config,
        });
        let revision = shared
            .list(shared.config.dial_timeout)
            .await
            .map_err(|cause| ConnectError::Unreachable {
                endpoints: shared.config.endpoints.join(","),
                cause: cause.to_string(),
            })?;
        let chain = shared.chain.load_full();
        tracing::info!(
            prefix = %shared.config.prefix,
            revision = chain.revision,
            guards = chain.guards.len(),
            "etcd registry: chain loaded"
        );
        let task = tokio::spawn({
            let shared = shared.clone();
            async move {
                tokio::join!(shared.clone().follow(revision), shared.confirm());
            }
        });
        Ok(Self { shared, task })
    }

    /// The replica's etcd client (its connection, credentials and TLS), for
    /// what else the mesh keeps in the same etcd: session memory (R34).
    pub fn client(&self) -> Client {
        self.shared.client.clone()
    }

    /// The key prefix of the chain.
    pub fn prefix(&self) -> &str {
        &self.shared.config.prefix
    }

    /// What the replica knows about etcd and the chain. Cheap enough for a
    /// health check or a metrics scrape.
    pub fn status(&self) -> RegistryStatus {
        let chain = self.shared.chain.load_full();
        let (connected, since, last_error, relists) = {
            let health = self.shared.health();
            (
                self.shared.confirmed(&health),
                health.last_contact.elapsed(),
                health.last_error.clone(),
                health.relists,
            )
        };
        let freshness = freshness(
            connected,
            since,
            self.shared.config.staleness_window,
            self.shared.config.after_window,
        );
        let view = self.shared.view();
        let liveness = chain
            .guards
            .iter()
            .map(|g| {
                let state = if view.alive.contains(&g.name) || view.replicas.contains_key(&g.name) {
                    Liveness::Alive
                } else if view.heartbeated.contains(&g.name) {
                    Liveness::Expired
                } else {
                    Liveness::NoHeartbeat
                };
                (g.name.clone(), state)
            })
            .collect();
        RegistryStatus {
            connected,
            revision: chain.revision,
            applied_revision: to_u64(view.revision),
            guards: chain.guards.len(),
            stale_for: (!connected).then_some(since),
            serving: freshness != Freshness::Refuse,
            last_error,
            relists,
            liveness,
            invalid: view
                .invalid
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }

    /// The replicas of guard `name` that heartbeats announce (R32), each
    /// held to `policy` as a registered endpoint is (an address that is
    /// malformed, ambiguous or refused is left out, logged and counted in
    /// [`Self::replicas_refused`]), at most
    /// [`MAX_ADDRESSES_PER_NAME`](crate::link::discover::dns::MAX_ADDRESSES_PER_NAME)
    /// of them. The set follows the replicas' leases: a replica whose
    /// heartbeat ends leaves it, the others stay. These are in addition to
    /// the registration's own endpoint (join them with
    /// [`crate::link::discover::union`]), so a guard whose announced
    /// replicas all left keeps its registered endpoint and stays in the
    /// chain (R15). Must be called within a tokio runtime; the task ends
    /// with the last reader or with the registry.
    pub fn replicas(
        &self,
        name: &str,
        policy: Arc<crate::link::dial::EndpointPolicy>,
    ) -> crate::link::discover::Replicas {
        let mut all = self.shared.announced.subscribe();
        let filter = AnnouncedFilter {
            guard: name.trim().to_owned(),
            policy,
            refused: self.shared.replicas_refused.clone(),
        };
        let mut raw = all.borrow_and_update().get(&filter.guard).cloned();
        let (tx, rx) = watch::channel(filter.apply(raw.as_ref()));
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    changed = all.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let next = all.borrow_and_update().get(&filter.guard).cloned();
                        if next == raw {
                            continue;
                        }
                        raw = next;
                        let targets = filter.apply(raw.as_ref());
                        tx.send_if_modified(|current| {
                            let changed = *current != targets;
                            if changed {
                                *current = targets;
                            }
                            changed
                        });
                    }
                    () = tx.closed() => return,
                }
            }
        });
        rx
    }

    /// Announced replica addresses the endpoint policy refused (R32).
    pub fn replicas_refused(&self) -> u64 {
        self.shared
            .replicas_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The revision of the latest change under the prefix this replica has
    /// applied, as it moves. Lets a caller that wrote through another replica
    /// (and got the write's revision back) wait until this one has seen it.
    pub fn applied_revisions(&self) -> watch::Receiver<u64> {
        self.shared.applied.subscribe()
    }

    /// Waits until this replica has applied `revision` (of a write under its
    /// prefix, e.g. a `RegisterResponse.revision`), at most `within`.
    pub async fn wait_for(&self, revision: u64, within: Duration) -> bool {
        let mut applied = self.shared.applied.subscribe();
        matches!(
            tokio::time::timeout(within, applied.wait_for(|r| *r >= revision)).await,
            Ok(Ok(_))
        )
    }

    /// Registers `spec` unless a guard of that name is already registered,
    /// which is left as stored, or was deregistered (its tombstone is
    /// there). For the config file's `[[guard]]` entries: with several
    /// replicas sharing one chain, a replica restarting with an older file
    /// must not roll back a change made through `GuardRegistry`, a removal
    /// included (R17). `created` is false when nothing was written.
    pub async fn register_if_absent(
        &self,
        guard: CheckedGuard,
    ) -> Result<Registered, RegistryError> {
        self.shared.register(guard, None, true).await
    }
}

impl Registry for EtcdRegistry {
    fn chain(&self) -> Arc<ChainSpec> {
        self.shared.chain.load_full()
    }

    fn announced_replicas(
        &self,
        name: &str,
        policy: Arc<crate::link::dial::EndpointPolicy>,
    ) -> Option<crate::link::discover::Replicas> {
        Some(self.replicas(name, policy))
    }

    fn register(
        &self,
        guard: CheckedGuard,
        owner: Option<Owner>,
    ) -> BoxFuture<'_, Result<Registered, RegistryError>> {
        Box::pin(self.shared.register(guard, owner, false))
    }

    fn deregister(&self, name: String) -> BoxFuture<'_, Result<Deregistered, RegistryError>> {
        Box::pin(self.shared.deregister(name))
    }

    fn staleness(&self) -> Option<Duration> {
        self.status().stale_for
    }

    fn check(&self) -> Result<(), RegistryError> {
        if let Some(unreadable) = self.shared.unreadable.load().as_deref() {
            let (key, why) = unreadable;
            return Err(RegistryError::Unavailable(format!(
                "stored registration {key} cannot be read ({why}); not judging without it: \
                 register the guard again or deregister it"
            )));
        }
        let (connected, since) = {
            let health = self.shared.health();
            (
                self.shared.confirmed(&health),
                health.last_contact.elapsed(),
            )
        };
        let window = self.shared.config.staleness_window;
        match freshness(connected, since, window, self.shared.config.after_window) {
            Freshness::Fresh | Freshness::Stale | Freshness::ServeStale => Ok(()),
            Freshness::Refuse => Err(RegistryError::Unavailable(format!(
                "the chain has not been confirmed with etcd's quorum for {}ms, longer than the \
                 staleness window ({}ms): not judging with chain revision {} that may be outdated",
                since.as_millis(),
                window.as_millis(),
                self.shared.chain.load().revision
            ))),
        }
    }
}

/// Why the watch stopped following.
enum Stopped {
    /// etcd could not be reached: resume from the last revision seen.
    Lost(String),
    /// The missed history is gone (compacted) or belongs to another store:
    /// list the keys again.
    Relist(String),
    /// etcd refused the watch's auth token (tokens do not survive an etcd
    /// restart). Unary requests get a new one by themselves; a watch is
    /// cancelled in-band instead, so the replica authenticates again.
    Unauthenticated(String),
}

impl Shared {
    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn written(&self) -> std::sync::MutexGuard<'_, Written> {
        self.written.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The guard this replica admitted and is writing (or wrote) as
    /// `value` under `name`, taken once its write is read back.
    fn own_write(&self, name: &str, value: &[u8]) -> Option<Arc<Guard>> {
        let mut written = self.written();
        match written.get(name) {
            Some((stored, guard)) if stored.as_slice() == value => {
                let guard = guard.clone();
                written.remove(name);
                Some(guard)
            }
            _ => None,
        }
    }

    /// Gets a new auth token in the background, one attempt at a time, when
    /// etcd refused the current one. Not cut short by a request's deadline:
    /// etcd checks the password with bcrypt, which can take longer than a
    /// request timeout on a loaded machine.
    fn reauthenticate(&self) {
        if self.config.username.is_none()
            || self
                .reauthenticating
                .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let client = self.client.clone();
        let flag = self.reauthenticating.clone();
        let within = self
            .config
            .dial_timeout
            .max(self.config.request_timeout * 5);
        tokio::spawn(async move {
            match tokio::time::timeout(within, client.refresh_token()).await {
                Ok(Ok(())) => tracing::info!("etcd registry: authenticated again"),
                Ok(Err(error)) => {
                    tracing::warn!(%error, "etcd registry: cannot authenticate again; retrying")
                }
                Err(_) => tracing::warn!(
                    "etcd registry: no answer to authentication within {within:?}; retrying"
                ),
            }
            flag.store(false, std::sync::atomic::Ordering::SeqCst);
        });
    }

    /// Whether the chain counts as confirmed: the last probe succeeded, and
    /// recently enough (a probe that stopped running confirms nothing).
    fn confirmed(&self, health: &Health) -> bool {
        health.connected
            && health.last_contact.elapsed()
                <= self.config.heartbeat_interval + self.config.request_timeout * 4
    }

    /// Records that etcd's quorum confirmed the chain as of `at` (when the
    /// confirming read was sent).
    fn contact(&self, at: Instant) {
        let mut health = self.health();
        if !health.connected {
            let outage = health.last_contact.elapsed();
            health.connected = true;
            health.window_logged = false;
            if health.last_error.is_some() {
                tracing::info!(
                    outage_ms = u64::try_from(outage.as_millis()).unwrap_or(u64::MAX),
                    revision = self.chain.load().revision,
                    "etcd registry: the chain is confirmed with etcd's quorum again"
                );
            }
        }
        health.last_contact = health.last_contact.max(at);
    }

    /// Records that etcd could not be reached, and logs the staleness once
    /// per outage and once more when the window passes.
    fn lost(&self, cause: &str) {
        let window = self.config.staleness_window;
        let revision = self.chain.load().revision;
        let mut health = self.health();
        if health.connected {
            health.connected = false;
            tracing::warn!(
                cause,
                revision,
                window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
                "etcd registry: cannot confirm the chain with etcd's quorum; judging with the last chain until the staleness window passes"
            );
        } else {
            tracing::debug!(cause, "etcd registry: etcd still unreachable");
        }
        health.last_error = Some(cause.to_owned());
        let since = health.last_contact.elapsed();
        if since > window && !health.window_logged {
            health.window_logged = true;
            match self.config.after_window {
                AfterWindow::Refuse => tracing::error!(
                    cause,
                    revision,
                    stale_ms = u64::try_from(since.as_millis()).unwrap_or(u64::MAX),
                    "etcd registry: staleness window passed; refusing batches with UNAVAILABLE until the quorum confirms the chain"
                ),
                AfterWindow::ServeStale => tracing::error!(
                    cause,
                    revision,
                    stale_ms = u64::try_from(since.as_millis()).unwrap_or(u64::MAX),
                    "etcd registry: staleness window passed; still judging with the stale chain (after_window = serve_stale)"
                ),
            }
        }
    }

    /// Lists every key under the prefix and replaces the view with it.
    /// Returns the listing's revision.
    async fn list(&self, timeout: Duration) -> Result<i64, RequestError> {
        let sent = Instant::now();
        let (revision, kvs) = self.read_all(timeout).await?;
        let changed = {
            let mut view = self.view();
            if revision <= view.revision {
                // An older listing than what the watch already applied.
                None
            } else {
                let mut next = View {
                    revision,
                    heartbeated: view.heartbeated.clone(),
                    ..View::default()
                };
                for kv in &kvs {
                    self.apply_put(&mut next, kv, Some(&view.guards));
                }
                for name in view.alive.difference(&next.alive) {
                    self.log_expired(&next, name);
                }
                let changed = chain_key(&view) != chain_key(&next);
                *view = next;
                if changed {
                    self.rebuild(&view);
                }
                self.publish_replicas(&view);
                Some(changed)
            }
        };
        self.contact(sent);
        if changed.is_some() {
            self.applied.send_replace(to_u64(revision));
        }
        Ok(revision)
    }

    /// Reads every key under the prefix, in pages (etcd limits the size of
    /// one answer, 4 MiB by default), all at the revision of the first page.
    /// The first page is a linearizable read (etcd's default): a member cut
    /// off from the quorum cannot answer it with its old state.
    async fn read_all(&self, timeout: Duration) -> Result<(i64, Vec<KeyValue>), RequestError> {
        const PAGE: i64 = 512;
        let started = Instant::now();
        let end = prefix_end(self.keys.root.as_bytes());
        let mut from = self.keys.root.clone().into_bytes();
        let mut revision = 0;
        let mut kvs = Vec::new();
        loop {
            let mut response = retried(
                timeout.saturating_sub(started.elapsed()),
                self.config.endpoints.len(),
                "listing the registry",
                &|| self.reauthenticate(),
                || {
                    let mut kv = self.client.kv_client();
                    let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
                    if revision > 0 {
                        options = options.with_revision(revision);
                    }
                    let from = from.clone();
                    async move { kv.get(from, Some(options)).await }
                },
            )
            .await?;
            if revision == 0 {
                revision = response.header().map_or(0, |h| h.revision());
            }
            let more = response.more();
            let page = response.take_kvs();
            match page.last() {
                Some(last) if more => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => {
                    kvs.extend(page);
                    return Ok((revision, kvs));
                }
            }
            kvs.extend(page);
        }
    }

    /// Applies a put of `kv` to `view`. `previous` lets a listing reuse the
    /// compiled guard of an unchanged registration.
    fn apply_put(&self, view: &mut View, kv: &KeyValue, previous: Option<&HashMap<String, Entry>>) {
        let Ok(key) = std::str::from_utf8(kv.key()) else {
            return;
        };
        if key == self.keys.revision {
            view.chain_revision = view.chain_revision.max(kv.mod_revision());
        } else if let Some(name) = key.strip_prefix(self.keys.guards.as_str()) {
            view.chain_revision = view.chain_revision.max(kv.mod_revision());
            view.guard_keys.insert(name.to_owned(), kv.mod_revision());
            if let Some(entry) = previous
                .and_then(|p| p.get(name))
                .filter(|e| e.mod_revision == kv.mod_revision())
            {
                view.guards.insert(name.to_owned(), entry.clone());
                return;
            }
            match self.decode(name, kv.value()) {
                Ok(guard) => {
                    view.invalid.remove(key);
                    view.guards.insert(
                        name.to_owned(),
                        Entry {
                            create_revision: kv.create_revision(),
                            mod_revision: kv.mod_revision(),
                            guard,
                        },
                    );
                }
                Err(reason) => {
                    tracing::error!(key, %reason, "etcd registry: registration cannot be read; batches are refused until it is fixed or deregistered");
                    view.guards.remove(name);
                    view.invalid.insert(key.to_owned(), reason.to_string());
                }
            }
        } else if let Some(name) = key.strip_prefix(self.keys.alive.as_str()) {
            if view.alive.insert(name.to_owned()) && previous.is_none() {
                tracing::info!(guard = name, "etcd registry: guard heartbeating");
            }
            view.heartbeated.insert(name.to_owned());
        } else if let Some((name, suffix)) = key
            .strip_prefix(self.keys.replicas.as_str())
            .and_then(|rest| rest.rsplit_once('/'))
        {
            // The value is the address; the key must be its escaped form,
            // so that one address is one key.
            let Ok(address) = std::str::from_utf8(kv.value()) else {
                tracing::warn!(
                    key,
                    "etcd registry: announced replica is not UTF-8; ignored"
                );
                return;
            };
            if name.is_empty() || escape_address(address) != suffix {
                tracing::warn!(
                    key,
                    address,
                    "etcd registry: announced replica's key does not name its address; ignored"
                );
                return;
            }
            let set = view.replicas.entry(name.to_owned()).or_default();
            if set.insert(suffix.to_owned(), address.to_owned()).is_none() && previous.is_none() {
                tracing::info!(guard = name, address, "etcd registry: replica announced");
            }
            view.heartbeated.insert(name.to_owned());
        }
    }

    /// Applies a delete of `kv`'s key to `view`.
    fn apply_delete(&self, view: &mut View, kv: &KeyValue) {
        let Ok(key) = std::str::from_utf8(kv.key()) else {
            return;
        };
        if let Some(name) = key.strip_prefix(self.keys.guards.as_str()) {
            view.chain_revision = view.chain_revision.max(kv.mod_revision());
            view.guard_keys.remove(name);
            view.guards.remove(name);
            view.invalid.remove(key);
        } else if let Some(name) = key.strip_prefix(self.keys.alive.as_str())
            && view.alive.remove(name)
        {
            self.log_expired(view, name);
        } else if let Some((name, suffix)) = key
            .strip_prefix(self.keys.replicas.as_str())
            .and_then(|rest| rest.rsplit_once('/'))
            && let Some(set) = view.replicas.get_mut(name)
            && let Some(address) = set.remove(suffix)
        {
            tracing::info!(
                guard = name,
                address,
                "etcd registry: replica left (its heartbeat lease ended)"
            );
            if set.is_empty() {
                view.replicas.remove(name);
                if !view.alive.contains(name) {
                    self.log_expired(view, name);
                }
            }
        }
    }

    /// Publishes the announced replicas when they changed.
    fn publish_replicas(&self, view: &View) {
        let next: BTreeMap<String, BTreeSet<String>> = view
            .replicas
            .iter()
            .map(|(name, set)| (name.clone(), set.values().cloned().collect()))
            .collect();
        self.announced.send_if_modified(|current| {
            if **current == next {
                return false;
            }
            *current = Arc::new(next);
            true
        });
    }

    fn log_expired(&self, view: &View, name: &str) {
        match view.guards.get(name) {
            Some(entry) => tracing::warn!(
                guard = name,
                failure_policy = entry.guard.failure_policy.name(),
                "etcd registry: guard heartbeat lapsed; it stays in the chain and its failure policy applies while it cannot be reached (R15)"
            ),
            None => tracing::debug!(
                guard = name,
                "etcd registry: heartbeat of an unregistered guard lapsed"
            ),
        }
    }

    /// A stored registration as a guard: the one this replica admitted
    /// and wrote, if it is that one; otherwise read and checked here, its
    /// policy compiled once (another replica wrote it).
    fn decode(&self, name: &str, value: &[u8]) -> Result<Arc<Guard>, StoredError> {
        if let Some(guard) = self.own_write(name, value) {
            return Ok(guard);
        }
        let spec = GuardSpec::decode(value)?;
        let guard = super::admit::from_store(&spec, self.default_timeout).map(Arc::new)?;
        if guard.name != name {
            return Err(StoredError::Misnamed {
                key: name.to_owned(),
                name: guard.name.clone(),
            });
        }
        Ok(guard)
    }

    /// Publishes the view's chain (R17: a new snapshot, old ones unchanged).
    fn rebuild(&self, view: &View) {
        let mut entries: Vec<&Entry> = view.guards.values().collect();
        entries.sort_by(|a, b| {
            (a.guard.priority, a.create_revision, &a.guard.name).cmp(&(
                b.guard.priority,
                b.create_revision,
                &b.guard.name,
            ))
        });
        self.chain.store(Arc::new(ChainSpec {
            revision: to_u64(view.chain_revision),
            guards: entries.into_iter().map(|e| e.guard.clone()).collect(),
        }));
        self.unreadable.store(
            view.invalid
                .iter()
                .next()
                .map(|(key, why)| Arc::new((key.clone(), why.clone()))),
        );
    }

    /// Applies one watch response's events.
    ///
    /// The view's revision moves with the events' own revisions, never with
    /// a response header: etcd 3.4.23 can answer a progress request with a
    /// revision whose events are still on their way, and trusting it would
    /// both skip those events and tell a waiting writer too early.
    fn apply_events(&self, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        let mut view = self.view();
        let floor = view.revision;
        let mut reached = floor;
        let before = chain_key(&view);
        for event in events {
            let Some(kv) = event.kv() else { continue };
            if kv.mod_revision() <= floor {
                // Already in a listing taken after this event.
                continue;
            }
            reached = reached.max(kv.mod_revision());
            // A delete event's key has no version; reading that rather than
            // `Event::event_type` (which panics on an unknown type) keeps a
            // surprising message from taking the replica down.
            if kv.version() == 0 {
                self.apply_delete(&mut view, kv);
            } else {
                self.apply_put(&mut view, kv, None);
            }
        }
        view.revision = reached;
        self.publish_replicas(&view);
        if chain_key(&view) != before {
            self.rebuild(&view);
            tracing::debug!(
                revision = view.chain_revision,
                guards = view.guards.len(),
                "etcd registry: chain changed"
            );
        }
        let revision = view.revision;
        drop(view);
        self.applied.send_if_modified(|applied| {
            let next = to_u64(revision);
            let moved = next > *applied;
            *applied = (*applied).max(next);
            moved
        });
    }

    /// Follows the prefix for as long as the registry lives: watches from
    /// `revision + 1`, resumes after an outage, lists again when the missed
    /// history is gone.
    async fn follow(self: Arc<Self>, mut revision: i64) {
        let initial_backoff = Duration::from_millis(50);
        let max_backoff = self.config.heartbeat_interval.max(initial_backoff);
        let mut backoff = initial_backoff;
        let mut cluster_id = 0u64;
        let mut relist = false;
        let mut failing = false;
        // Whether the chain is current is `confirm`'s to say (it lists
        // when the watch falls behind the quorum); here a broken watch is
        // logged, once per outage, and reopened.
        let broken = |failing: &mut bool, cause: &str| {
            if *failing {
                tracing::debug!(cause, "etcd registry: the watch is still down");
            } else {
                *failing = true;
                tracing::warn!(
                    cause,
                    "etcd registry: the watch stopped; reopening it (the freshness probe picks up changes meanwhile)"
                );
            }
        };
        loop {
            if relist {
                match self.list(self.config.request_timeout).await {
                    Ok(listed) => {
                        self.health().relists += 1;
                        revision = listed;
                        relist = false;
                    }
                    Err(cause) => {
                        broken(&mut failing, &cause.to_string());
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(max_backoff);
                        continue;
                    }
                }
            }
            let stopped = match self.open_watch(revision + 1).await {
                Ok(stream) => {
                    backoff = initial_backoff;
                    if failing {
                        failing = false;
                        tracing::info!("etcd registry: the watch is open again");
                    }
                    self.watch(stream, revision, &mut cluster_id).await
                }
                Err(cause) => Stopped::Lost(cause.to_string()),
            };
            revision = self.view().revision;
            match stopped {
                Stopped::Lost(cause) => {
                    broken(&mut failing, &cause);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(max_backoff);
                }
                Stopped::Relist(cause) => {
                    tracing::info!(%cause, "etcd registry: listing the chain again");
                    relist = true;
                }
                Stopped::Unauthenticated(cause) => {
                    broken(&mut failing, &cause);
                    self.reauthenticate();
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(max_backoff);
                }
            }
        }
    }

    /// Confirms the chain with etcd's quorum every heartbeat, for as long as
    /// the registry lives: this, not the watch, is what keeps the chain
    /// fresh (R17). A member cut off from the quorum still answers the watch
    /// and its progress requests from its old state; it cannot answer a
    /// linearizable read.
    async fn confirm(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let sent = Instant::now();
            match self.probe().await {
                Ok(()) => self.contact(sent),
                Err(cause) => self.lost(&cause.to_string()),
            }
        }
    }

    /// Runs a write transaction, retried on another member within the
    /// request timeout (the transactions of this registry are idempotent).
    async fn transaction(
        &self,
        what: &'static str,
        txn: Txn,
    ) -> Result<etcd_client::TxnResponse, RegistryError> {
        retried(
            self.config.request_timeout,
            self.config.endpoints.len(),
            what,
            &|| self.reauthenticate(),
            || {
                let mut kv = self.client.kv_client();
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            },
        )
        .await
        .map_err(|e| RegistryError::Unavailable(e.to_string()))
    }

    /// One freshness probe: a linearizable read of the registration keys
    /// (names and revisions only). The chain is confirmed when the view has
    /// applied at least the read's revision, or holds the same keys at the
    /// same revisions; otherwise the watch is behind the quorum and the
    /// chain is listed again.
    async fn probe(&self) -> Result<(), RequestError> {
        let response = retried(
            self.config.request_timeout,
            self.config.endpoints.len(),
            "confirming the chain with etcd's quorum",
            &|| self.reauthenticate(),
            || {
                let mut kv = self.client.kv_client();
                let guards = self.keys.guards.clone();
                async move {
                    kv.get(
                        guards,
                        Some(GetOptions::new().with_prefix().with_keys_only()),
                    )
                    .await
                }
            },
        )
        .await?;
        let revision = response.header().map_or(0, |h| h.revision());
        let current = || {
            let view = self.view();
            view.revision >= revision || {
                let quorum = response.kvs().iter().filter_map(|kv| {
                    let key = std::str::from_utf8(kv.key()).ok()?;
                    Some((
                        key.strip_prefix(self.keys.guards.as_str())?,
                        kv.mod_revision(),
                    ))
                });
                quorum.eq(view.guard_keys.iter().map(|(k, v)| (k.as_str(), *v)))
            }
        };
        // Right after a change the watch may be a moment behind the read:
        // give it the request timeout to catch up before listing.
        let mut applied = self.applied.subscribe();
        let caught_up = tokio::time::timeout(self.config.request_timeout, async {
            while !current() {
                if applied.changed().await.is_err() {
                    return false;
                }
            }
            true
        })
        .await;
        if matches!(caught_up, Ok(true)) {
            return Ok(());
        }
        tracing::info!(
            revision,
            "etcd registry: the watch is behind the quorum's chain; listing it"
        );
        self.list(self.config.request_timeout).await?;
        self.health().relists += 1;
        Ok(())
    }

    async fn open_watch(&self, start: i64) -> Result<WatchStream, RequestError> {
        let mut client = self.client.watch_client();
        timed(
            self.config.request_timeout,
            "opening the watch",
            client.watch(
                self.keys.root.clone(),
                Some(WatchOptions::new().with_prefix().with_start_revision(start)),
            ),
        )
        .await
    }

    /// Applies the watch's events until it breaks. Asks the watch for a
    /// progress report every heartbeat: silence for longer than the request
    /// timeout means the watch is gone even when no connection error says so.
    /// (An answer does not confirm the chain: see [`Shared::confirm`].)
    async fn watch(&self, mut stream: WatchStream, from: i64, cluster_id: &mut u64) -> Stopped {
        let mut probe = tokio::time::interval(self.config.heartbeat_interval);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_heard = Instant::now();
        let mut created = false;
        loop {
            tokio::select! {
                message = stream.message() => {
                    let response = match message {
                        Ok(Some(response)) => response,
                        Ok(None) => return Stopped::Lost("etcd closed the watch".into()),
                        Err(error) => return Stopped::Lost(format!("watch: {error}")),
                    };
                    last_heard = Instant::now();
                    if response.compact_revision() > 0 {
                        return Stopped::Relist(format!(
                            "the history from revision {} was compacted (at {})",
                            from + 1,
                            response.compact_revision()
                        ));
                    }
                    if response.canceled() {
                        let cause = format!("etcd cancelled the watch: {}", response.cancel_reason());
                        return if response.cancel_reason().contains("auth token") {
                            Stopped::Unauthenticated(cause)
                        } else {
                            Stopped::Lost(cause)
                        };
                    }
                    let (header_revision, header_cluster) = response
                        .header()
                        .map_or((0, 0), |h| (h.revision(), h.cluster_id()));
                    if !created && response.created() {
                        created = true;
                        // Resuming against another store (a restored backup, a
                        // new cluster) would watch revisions that mean
                        // nothing here.
                        if *cluster_id != 0 && header_cluster != 0 && header_cluster != *cluster_id {
                            *cluster_id = header_cluster;
                            return Stopped::Relist("etcd is another cluster now".into());
                        }
                        if header_revision != 0 && header_revision < from {
                            return Stopped::Relist(format!(
                                "etcd's revision went back from {from} to {header_revision}"
                            ));
                        }
                        if header_cluster != 0 {
                            *cluster_id = header_cluster;
                        }
                    }
                    // Not a confirmation of the chain: a member cut off
                    // from the quorum still answers progress requests.
                    // `confirm` does that with a linearizable read.
                    self.apply_events(response.events());
                }
                _ = probe.tick() => {
                    if last_heard.elapsed() > self.config.heartbeat_interval + self.config.request_timeout {
                        return Stopped::Lost(format!(
                            "the watch did not answer a progress request within {:?}",
                            self.config.request_timeout
                        ));
                    }
                    if let Err(error) = stream.request_progress().await {
                        return Stopped::Lost(format!("watch: {error}"));
                    }
                }
            }
        }
    }

    /// Waits until this replica's view includes `revision`, so that a
    /// `Register` followed by a batch on the same replica sees the guard.
    /// If the watch lags (or is reconnecting), lists instead.
    async fn settle(&self, revision: i64) {
        let target = to_u64(revision);
        let mut applied = self.applied.subscribe();
        let caught_up = matches!(
            tokio::time::timeout(
                self.config.request_timeout,
                applied.wait_for(|r| *r >= target),
            )
            .await,
            Ok(Ok(_))
        );
        if !caught_up && let Err(cause) = self.list(self.config.request_timeout).await {
            tracing::warn!(%cause, revision, "etcd registry: could not read back a write; the chain follows once the watch catches up");
        }
    }

    async fn register(
        &self,
        checked: CheckedGuard,
        owner: Option<Owner>,
        only_if_absent: bool,
    ) -> Result<Registered, RegistryError> {
        let name = checked.name().to_owned();
        // Stored as given (not as compiled): each replica applies its own
        // default timeout to `timeout_ms = 0`.
        let stored = checked.stored().encode_to_vec();
        // This replica's own watch reads the write back: it reuses the
        // guard checked here rather than compile it again.
        self.written()
            .insert(name.clone(), (stored.clone(), checked.guard().clone()));
        let result = self
            .write_registration(&checked, stored, owner, only_if_absent)
            .await;
        if result.is_err() {
            self.written().remove(&name);
        }
        result
    }

    /// The registration's transaction, and the settling of its result.
    async fn write_registration(
        &self,
        checked: &CheckedGuard,
        stored: Vec<u8>,
        owner: Option<Owner>,
        only_if_absent: bool,
    ) -> Result<Registered, RegistryError> {
        let name = checked.name().to_owned();
        let key = self.keys.guard(&name);
        let tombstone = self.keys.removed(&name);
        let write = || {
            vec![
                TxnOp::put(key.clone(), stored.clone(), None),
                TxnOp::put(self.keys.revision.clone(), name.clone(), None),
            ]
        };
        let absent = Compare::version(key.clone(), CompareOp::Equal, 0);
        let txn = if only_if_absent {
            // Seeding from a config file: never over a registration, and
            // never over a deliberate removal (R17), which leaves a tombstone.
            let never_removed = Compare::version(tombstone.clone(), CompareOp::Equal, 0);
            Txn::new()
                .when([absent, never_removed])
                .and_then(write())
                .or_else([TxnOp::get(tombstone.clone(), None)])
        } else {
            // Creating and updating are the same put; the comparison only
            // tells which one happened. An update keeps the key's
            // create_revision, hence its position (R16). An explicit
            // registration clears a tombstone: the name may be seeded again
            // once it is deregistered again.
            let mut ops = write();
            ops.push(TxnOp::delete(tombstone.clone(), None));
            Txn::new().when([absent]).and_then(ops.clone()).or_else(ops)
        };
        // Retried: the same put again leaves the same state. (If an attempt
        // that timed out was applied, the next one reports an update.)
        // The answer of the registration's own transaction, and the
        // revision of the write (a nested transaction's answer has none).
        let (response, written_at) = match &owner {
            None => {
                let response = self.transaction("registering", txn).await?;
                let revision = response.header().map_or(0, |h| h.revision());
                (response, revision)
            }
            Some(owner) => self.owned_transaction(checked.guard(), owner, txn).await?,
        };
        let created = response.succeeded();
        let revision = if only_if_absent && !created {
            let removed_at = response.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get.kvs().first().map(KeyValue::mod_revision),
                _ => None,
            });
            if let Some(removed_at) = removed_at {
                tracing::warn!(
                    guard = %name,
                    removed_at,
                    "etcd registry: this guard was deregistered; its config file entry is not applied (register it through GuardRegistry to bring it back)"
                );
            }
            self.written().remove(&name);
            // Nothing written: answer with what is served.
            i64::try_from(self.chain.load().revision).unwrap_or(i64::MAX)
        } else {
            self.settle(written_at).await;
            written_at
        };
        let chain = self.chain.load();
        let position = chain
            .guards
            .iter()
            .position(|g| g.name == name)
            .unwrap_or(chain.guards.len());
        Ok(Registered {
            revision: to_u64(revision),
            position,
            created,
        })
    }

    /// Runs `registration` (a transaction on the guard's keys) only if
    /// `owner` may register `guard`, and records the guard as the owner's in
    /// the same transaction (R25). The owner's count is read, checked, and
    /// the write made on condition that none of the owner's keys (nor the
    /// guard's owner) changed since the read: two replicas registering for
    /// one identity at once cannot both pass on the same count; the one that
    /// loses reads again. Returns the answer of `registration` itself, and
    /// the revision of the write.
    async fn owned_transaction(
        &self,
        guard: &Guard,
        owner: &Owner,
        registration: Txn,
    ) -> Result<(etcd_client::TxnResponse, i64), RegistryError> {
        let name = &guard.name;
        let owned_by = self.keys.owned_by(&owner.identity);
        let owner_key = self.keys.owner(name);
        let mine = format!("{owned_by}{name}");
        let started = Instant::now();
        loop {
            let read = Txn::new().and_then([
                TxnOp::get(
                    owned_by.clone(),
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                ),
                TxnOp::get(owner_key.clone(), None),
            ]);
            let response = self
                .transaction("reading the registrar's quota", read)
                .await?;
            let read_at = response.header().map_or(0, |h| h.revision());
            let mut owned = Vec::new();
            let mut previous = None;
            for op in response.op_responses() {
                let TxnOpResponse::Get(get) = op else {
                    continue;
                };
                for kv in get.kvs() {
                    let Ok(key) = std::str::from_utf8(kv.key()) else {
                        continue;
                    };
                    if let Some(owned_name) = key.strip_prefix(owned_by.as_str()) {
                        owned.push(owned_name.to_owned());
                    } else if key == owner_key {
                        previous = Some(String::from_utf8_lossy(kv.value()).into_owned());
                    }
                }
            }
            let already = owned.iter().any(|n| n == name);
            owned.retain(|n| n != name);
            // The bytes of the owner's other guards, as this replica
            // compiled them: once its chain holds every one of them (a
            // guard registered through another replica a moment ago may
            // not have reached it yet).
            let holds_all = || {
                let chain = self.chain.load();
                owned
                    .iter()
                    .all(|name| chain.guards.iter().any(|g| g.name == *name))
            };
            if !holds_all() {
                self.settle(read_at).await;
            }
            let used = {
                let chain = self.chain.load();
                chain
                    .guards
                    .iter()
                    .filter(|g| owned.contains(&g.name))
                    .map(|g| super::admit::policy_bytes(g))
                    .fold(0usize, usize::saturating_add)
            };
            owner.admits(guard, owned.len(), already, used)?;
            let mut ops = vec![
                TxnOp::txn(registration.clone()),
                TxnOp::put(mine.clone(), Vec::new(), None),
                TxnOp::put(owner_key.clone(), owner.identity.clone(), None),
            ];
            if let Some(previous) = previous.filter(|p| *p != owner.identity) {
                ops.push(TxnOp::delete(
                    format!("{}{name}", self.keys.owned_by(&previous)),
                    None,
                ));
            }
            let unchanged = [
                Compare::mod_revision(owned_by.clone(), CompareOp::Less, read_at + 1).with_prefix(),
                Compare::mod_revision(owner_key.clone(), CompareOp::Less, read_at + 1),
            ];
            let response = self
                .transaction("registering", Txn::new().when(unchanged).and_then(ops))
                .await?;
            if response.succeeded() {
                let revision = response.header().map_or(0, |h| h.revision());
                return nested(response)
                    .map(|inner| (inner, revision))
                    .ok_or_else(|| {
                        RegistryError::Unavailable(
                            "registering: etcd answered without the registration's result".into(),
                        )
                    });
            }
            if started.elapsed() > self.config.request_timeout {
                return Err(RegistryError::Unavailable(format!(
                    "registering: the quota of {} kept changing for {:?}; try again",
                    owner.identity, self.config.request_timeout
                )));
            }
            tracing::debug!(guard = %name, identity = %owner.identity, "etcd registry: the registrar's guards changed meanwhile; reading its quota again");
        }
    }

    /// Removes a registration and leaves a tombstone `<prefix>/removed/<name>`,
    /// so that no replica's config file brings the guard back (R17). The
    /// tombstone holds a value unique to this call: when a retried attempt
    /// finds the guard gone, the tombstone tells whether an earlier attempt
    /// of this same call removed it (an attempt can time out and still be
    /// applied). The guard's owner records go in the same transaction, which
    /// frees its place in the owner's quota (R25).
    async fn deregister(&self, name: String) -> Result<Deregistered, RegistryError> {
        let name = name.trim();
        let key = self.keys.guard(name);
        let tombstone = self.keys.removed(name);
        let owner_key = self.keys.owner(name);
        let mark = format!("{:016x}", rand::random::<u64>());
        let removal = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Greater, 0)])
            .and_then([
                TxnOp::delete(key, None),
                TxnOp::put(self.keys.revision.clone(), name, None),
                TxnOp::put(tombstone.clone(), mark.clone(), None),
            ])
            .or_else([TxnOp::get(tombstone, None)]);
        let started = Instant::now();
        let response = loop {
            let read = self
                .transaction(
                    "reading the guard's owner",
                    Txn::new().and_then([TxnOp::get(owner_key.clone(), None)]),
                )
                .await?;
            let read_at = read.header().map_or(0, |h| h.revision());
            let owner = read.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get
                    .kvs()
                    .first()
                    .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
                _ => None,
            });
            let mut ops = vec![TxnOp::txn(removal.clone())];
            if let Some(owner) = owner {
                ops.push(TxnOp::delete(owner_key.clone(), None));
                ops.push(TxnOp::delete(
                    format!("{}{name}", self.keys.owned_by(&owner)),
                    None,
                ));
            }
            let unchanged = Compare::mod_revision(owner_key.clone(), CompareOp::Less, read_at + 1);
            let response = self
                .transaction("deregistering", Txn::new().when([unchanged]).and_then(ops))
                .await?;
            if response.succeeded() {
                let revision = response.header().map_or(0, |h| h.revision());
                if let Some(inner) = nested(response) {
                    break (inner, revision);
                }
            }
            if started.elapsed() > self.config.request_timeout {
                return Err(RegistryError::Unavailable(format!(
                    "deregistering: the owner of {name:?} kept changing for {:?}; try again",
                    self.config.request_timeout
                )));
            }
        };
        let (response, written_at) = response;
        let revision = if response.succeeded() {
            written_at
        } else {
            let ours = response.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get
                    .kvs()
                    .first()
                    .filter(|kv| kv.value() == mark.as_bytes())
                    .map(KeyValue::mod_revision),
                _ => None,
            });
            match ours {
                Some(revision) => revision,
                None => {
                    return Ok(Deregistered {
                        revision: self.chain.load().revision,
                        removed: false,
                    });
                }
            }
        };
        self.settle(revision).await;
        Ok(Deregistered {
            revision: to_u64(revision),
            removed: true,
        })
    }
}

/// The answer of the transaction nested in `response`'s first branch.
/// Holds one guard's announced addresses to the endpoint policy.
struct AnnouncedFilter {
    guard: String,
    policy: Arc<crate::link::dial::EndpointPolicy>,
    refused: Arc<std::sync::atomic::AtomicU64>,
}

impl AnnouncedFilter {
    fn apply(
        &self,
        addresses: Option<&BTreeSet<String>>,
    ) -> Arc<[crate::link::discover::ReplicaTarget]> {
        use crate::link::discover::{ReplicaTarget, dns};
        let mut targets = Vec::new();
        for address in addresses.into_iter().flatten() {
            let checked = dns::parse_endpoint(address)
                .map_err(|e| e.to_string())
                .and_then(|p| {
                    match p.literal {
                        Some(ip) => self.policy.check_ip(ip, None),
                        None => self.policy.check_host(&p.host),
                    }
                    .map_err(|e| e.to_string())?;
                    Ok(format!(
                        "{}://{}",
                        p.scheme,
                        match p.literal {
                            Some(ip) => std::net::SocketAddr::new(ip, p.port).to_string(),
                            None => format!("{}:{}", p.host, p.port),
                        }
                    ))
                });
            match checked {
                Ok(endpoint) if targets.len() < dns::MAX_ADDRESSES_PER_NAME => {
                    targets.push(ReplicaTarget::new(endpoint));
                }
                Ok(_) => {
                    tracing::warn!(guard = %self.guard, address, "etcd registry: more announced replicas than a guard may have; left out");
                }
                Err(why) => {
                    self.refused
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(guard = %self.guard, address, %why, "etcd registry: announced replica refused by the endpoint policy; it is not dialed");
                }
            }
        }
        targets.dedup();
        targets.into()
    }
}

fn nested(response: etcd_client::TxnResponse) -> Option<etcd_client::TxnResponse> {
    response.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Txn(inner) => Some(inner),
        _ => None,
    })
}

/// What the chain is made of: a listing that yields the same key reuses the
/// published `ChainSpec` (and the mesh its chain snapshot).
fn chain_key(view: &View) -> (i64, Vec<(String, i64)>) {
    let mut guards: Vec<(String, i64)> = view
        .guards
        .iter()
        .map(|(name, e)| (name.clone(), e.mod_revision))
        .collect();
    guards.sort_unstable();
    (view.chain_revision, guards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staleness_policy() {
        let w = Duration::from_secs(10);
        let refuse = AfterWindow::Refuse;
        let stale = AfterWindow::ServeStale;
        assert_eq!(
            freshness(true, Duration::from_secs(99), w, refuse),
            Freshness::Fresh
        );
        assert_eq!(
            freshness(false, Duration::from_secs(3), w, refuse),
            Freshness::Stale
        );
        assert_eq!(freshness(false, w, w, refuse), Freshness::Stale);
        assert_eq!(
            freshness(false, Duration::from_secs(11), w, refuse),
            Freshness::Refuse
        );
        assert_eq!(
            freshness(false, Duration::from_secs(11), w, stale),
            Freshness::ServeStale
        );
    }

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/guardmesh/"), b"/guardmesh0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }

    #[tokio::test]
    async fn retried_until_it_answers_within_the_deadline() {
        let unavailable =
            || etcd_client::Error::GRpcStatus(tonic::Status::unavailable("no leader"));
        let mut calls = 0;
        let answer = retried(Duration::from_secs(5), 3, "reading", &|| {}, || {
            calls += 1;
            let fail = calls < 4;
            async move { if fail { Err(unavailable()) } else { Ok(calls) } }
        })
        .await;
        assert_eq!(answer.ok(), Some(4));

        // What a retry only repeats fails at once.
        let mut calls = 0;
        let answer: Result<(), RequestError> =
            retried(Duration::from_secs(5), 3, "reading", &|| {}, || {
                calls += 1;
                async {
                    Err(etcd_client::Error::GRpcStatus(
                        tonic::Status::permission_denied("no"),
                    ))
                }
            })
            .await;
        assert_eq!(calls, 1);
        assert!(answer.unwrap_err().to_string().contains("permission"));

        // A member that never answers does not take the whole deadline, and
        // the deadline holds.
        let started = Instant::now();
        let mut calls = 0;
        let answer = retried(Duration::from_millis(400), 3, "reading", &|| {}, || {
            calls += 1;
            let hang = calls == 1;
            async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok::<_, etcd_client::Error>(calls)
            }
        })
        .await;
        assert_eq!(answer.ok(), Some(2));
        let answer: Result<(), RequestError> =
            retried(Duration::from_millis(300), 3, "reading", &|| {}, || async {
                Err(unavailable())
            })
            .await;
        assert!(answer.unwrap_err().to_string().contains("no leader"));
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn keys_under_one_prefix() {
        let config = EtcdConfig {
            prefix: "/guardmesh/prod/".into(),
            ..EtcdConfig::default()
        };
        let keys = config.keys();
        assert_eq!(keys.root, "/guardmesh/prod/");
        assert_eq!(keys.guard("sql/where"), "/guardmesh/prod/guards/sql/where");
        assert_eq!(keys.alive("a"), "/guardmesh/prod/alive/a");
        assert_eq!(
            config.replica_key("sql/where", "http://10.0.0.5:7001"),
            "/guardmesh/prod/replicas/sql/where/http:%2F%2F10.0.0.5:7001"
        );
        assert_eq!(keys.revision, "/guardmesh/prod/revision");
    }

    #[test]
    fn settings_refused_with_the_key_to_fix() {
        let check = |config: EtcdConfig| config.validate().unwrap_err().to_string();
        let base = EtcdConfig::default();
        assert!(
            check(EtcdConfig {
                prefix: "/".into(),
                ..base.clone()
            })
            .contains("prefix")
        );
        assert!(
            check(EtcdConfig {
                endpoints: vec![],
                ..base.clone()
            })
            .contains("endpoints")
        );
        assert!(
            check(EtcdConfig {
                username: Some("u".into()),
                ..base.clone()
            })
            .contains("password")
        );
        assert!(
            check(EtcdConfig {
                lease_ttl: Duration::from_secs(1),
                heartbeat_interval: Duration::from_secs(2),
                ..base.clone()
            })
            .contains("lease_ttl_s")
        );
        assert!(base.validate().is_ok());
        let shown = format!(
            "{:?}",
            EtcdConfig {
                username: Some("u".into()),
                password: Some("hunter2".into()),
                ..base
            }
        );
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}

#[cfg(test)]
mod transient_tests {
    use super::transient;

    /// R17: a request cut off by a member's connection closing is retried
    /// on another member; one etcd itself refuses is not.
    #[test]
    fn r17_a_request_cancelled_by_a_closed_connection_is_retried() {
        let closed = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection closed");
        let mut by_transport = tonic::Status::cancelled("operation was canceled");
        by_transport.set_source(std::sync::Arc::new(closed));
        assert!(transient(&etcd_client::Error::GRpcStatus(by_transport)));
        let by_etcd = tonic::Status::cancelled("canceled by the server");
        assert!(!transient(&etcd_client::Error::GRpcStatus(by_etcd)));
        let refused = tonic::Status::invalid_argument("bad key");
        assert!(!transient(&etcd_client::Error::GRpcStatus(refused)));
    }
}
