//! `guardmesh heartbeat`: a sidecar that keeps a guard's liveness lease in the
//! etcd registry for guards that cannot (Python, Node, any language), so they
//! are not limited to "no heartbeat" (R15: liveness never changes the chain).
//!
//! With `--guard URL` the lease follows the guard's own gRPC health: the
//! sidecar holds the lease only while the guard answers `SERVING`, revokes it
//! as soon as the guard stops answering, and takes a new one when it is back.
//! Without it the lease only says the sidecar runs. SIGTERM or SIGINT revoke
//! the lease and exit.
//!
//! With `--replica ADDR` the sidecar announces one replica of the guard
//! (R32): it keeps `<prefix>/replicas/<name>/<ADDR>` on its lease instead
//! of `<prefix>/alive/<name>`, and the mesh adds ADDR to the guard's
//! replicas while the lease lives. Run one sidecar per replica, each with
//! the address the mesh dials for it (`--guard` is the address the sidecar
//! checks, usually the replica's loopback one).

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use guardmesh_server::config::{Config, RegistryKind};
use guardmesh_server::registry::etcd::{ConnectError, EtcdConfig};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;
use tokio::task::JoinHandle;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The options of `guardmesh heartbeat`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct HeartbeatArgs {
    /// The guard's registered name.
    #[arg(long)]
    name: String,
    /// The mesh's config file: its `[registry]` (kind = "etcd") gives the
    /// endpoints, prefix, credentials, lease TTL and heartbeat interval.
    #[arg(long)]
    config: PathBuf,
    /// The guard's address (`http://host:port` or `host:port`): hold the lease
    /// only while its `grpc.health.v1.Health` says SERVING.
    #[arg(long)]
    guard: Option<String>,
    /// Announce this address (`http://host:port`, `https://host:port` or
    /// `host:port`) as one replica of the guard while the lease is held:
    /// the address the mesh dials for this replica (R32).
    #[arg(long)]
    replica: Option<String>,
}

/// Runs until `shutdown`, then revokes the lease.
pub(crate) async fn run(
    args: HeartbeatArgs,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let text = std::fs::read_to_string(&args.config)
        .map_err(|e| format!("cannot read {}: {e}", args.config.display()))?;
    let mut config = Config::parse(&text, &args.config.display().to_string())?;
    // As `serve` reads it: [registry] files relative to the config's folder.
    config.resolve_paths(Config::folder_of(&args.config));
    if config.registry.kind != RegistryKind::Etcd {
        return Err(format!(
            "{}: [registry] kind is not \"etcd\": liveness needs the shared registry",
            args.config.display()
        )
        .into());
    }
    let etcd = config.registry.etcd()?;
    let guard = match &args.guard {
        Some(address) => Some(guard_url(address)?),
        None => None,
    };
    let replica = match &args.replica {
        Some(address) => Some(replica_url(address)?),
        None => None,
    };
    let every = etcd.heartbeat_interval.max(Duration::from_millis(100));
    let mut beat: Option<GuardHeartbeat> = None;
    tokio::pin!(shutdown);
    loop {
        let serving = match &guard {
            Some(url) => serving(url, every).await,
            None => true,
        };
        if serving && beat.is_none() {
            let started = match &replica {
                Some(address) => GuardHeartbeat::start_replica(&etcd, &args.name, address).await,
                None => GuardHeartbeat::start(&etcd, &args.name).await,
            };
            match started {
                Ok(started) => {
                    tracing::info!(guard = %args.name, replica = ?replica, "liveness lease held");
                    println!("ALIVE {}", args.name);
                    beat = Some(started);
                }
                Err(error) => {
                    tracing::warn!(guard = %args.name, %error, "cannot take the liveness lease; retrying")
                }
            }
        } else if !serving && let Some(held) = beat.take() {
            held.stop().await;
            tracing::warn!(guard = %args.name, "the guard is not serving: liveness lease revoked");
            println!("DOWN {}", args.name);
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = &mut shutdown => break,
        }
    }
    if let Some(held) = beat {
        held.stop().await;
    }
    Ok(())
}

/// Keeps a guard's liveness key `<prefix>/alive/<name>` on a lease while it
/// runs: what a guard process (or this sidecar beside it) uses to say it is
/// up.
///
/// Liveness never changes the chain (R15). Dropping the heartbeat (or the
/// process dying) stops renewing the lease, which lapses after its TTL, like
/// a crash; [`GuardHeartbeat::stop`] revokes it at once, for a clean shutdown.
pub struct GuardHeartbeat {
    client: Client,
    lease: Arc<AtomicI64>,
    timeout: Duration,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for GuardHeartbeat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardHeartbeat").finish_non_exhaustive()
    }
}

impl Drop for GuardHeartbeat {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why etcd did not do what the heartbeat asked.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// etcd answered with an error.
    #[error("{what}: {source}")]
    Etcd {
        what: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// etcd did not answer in time.
    #[error("{what}: no answer within {timeout:?}")]
    Timeout {
        what: &'static str,
        timeout: Duration,
    },
    /// etcd ended the keep-alive stream.
    #[error("etcd closed the keep-alive stream")]
    Closed,
}

impl GuardHeartbeat {
    /// Puts the liveness key of guard `name` on a new lease (the guard is
    /// alive when this returns) and renews it every heartbeat interval.
    pub async fn start(config: &EtcdConfig, name: &str) -> Result<Self, ConnectError> {
        Self::hold(config, config.alive_key(name), Vec::new()).await
    }

    /// Announces `address` as one replica of guard `name` (R32): puts
    /// `<prefix>/replicas/<name>/<address>` on a new lease and renews it
    /// every heartbeat interval. The replica leaves the guard's replica set
    /// when the lease ends (revoked by [`Self::stop`], or lapsed).
    pub async fn start_replica(
        config: &EtcdConfig,
        name: &str,
        address: &str,
    ) -> Result<Self, ConnectError> {
        Self::hold(
            config,
            config.replica_key(name, address),
            address.as_bytes().to_vec(),
        )
        .await
    }

    async fn hold(config: &EtcdConfig, key: String, value: Vec<u8>) -> Result<Self, ConnectError> {
        let client = guardmesh_server::registry::etcd::client(config).await?;
        let ttl = i64::try_from(config.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        // Renew well within the TTL, whatever the configured interval.
        let every = config
            .heartbeat_interval
            .min(config.lease_ttl / 3)
            .max(Duration::from_millis(10));
        let timeout = config.request_timeout;
        let lease = grant(&client, &key, &value, ttl, timeout)
            .await
            .map_err(|cause| ConnectError::Unreachable {
                endpoints: config.endpoints.join(","),
                cause: cause.to_string(),
            })?;
        let lease = Arc::new(AtomicI64::new(lease));
        let task = tokio::spawn(renew(
            client.clone(),
            key,
            value,
            ttl,
            every,
            timeout,
            lease.clone(),
        ));
        Ok(Self {
            client,
            lease,
            timeout,
            task,
        })
    }

    /// Stops heartbeating and revokes the lease: the guard reads as expired
    /// at once instead of after its TTL.
    pub async fn stop(self) {
        self.task.abort();
        let lease = self.lease.load(Ordering::SeqCst);
        let mut client = self.client.lease_client();
        if let Err(error) = timed(self.timeout, "revoking the lease", client.revoke(lease)).await {
            tracing::warn!(%error, "guard heartbeat: the lease will lapse after its TTL instead");
        }
    }
}

/// `request` within `timeout`.
async fn timed<T>(
    timeout: Duration,
    what: &'static str,
    request: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, LeaseError> {
    match tokio::time::timeout(timeout, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(LeaseError::Etcd { what, source }),
        Err(_) => Err(LeaseError::Timeout { what, timeout }),
    }
}

/// Grants a lease and puts the liveness (or replica) key on it.
async fn grant(
    client: &Client,
    key: &str,
    value: &[u8],
    ttl: i64,
    timeout: Duration,
) -> Result<i64, LeaseError> {
    let mut leases = client.lease_client();
    let lease = timed(timeout, "granting a lease", leases.grant(ttl, None))
        .await?
        .id();
    let mut kv = client.kv_client();
    timed(
        timeout,
        "putting the liveness key",
        kv.put(
            key,
            value.to_vec(),
            Some(PutOptions::new().with_lease(lease)),
        ),
    )
    .await?;
    Ok(lease)
}

/// Why a renewal failed.
enum Renewal {
    /// etcd says the lease no longer exists (it lapsed during an outage
    /// longer than its TTL): grant a new one and put the key again.
    Gone,
    /// etcd could not be asked: keep trying the same lease, which etcd
    /// extends when it restarts.
    Unreachable(LeaseError),
}

/// Renews the lease every `every`, and replaces it when it is gone. Logs a
/// failure once per outage, not once per tick.
async fn renew(
    client: Client,
    key: String,
    value: Vec<u8>,
    ttl: i64,
    every: Duration,
    timeout: Duration,
    lease: Arc<AtomicI64>,
) {
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut failing = false;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let id = lease.load(Ordering::SeqCst);
        let renewed = async {
            if stream.is_none() {
                let mut leases = client.lease_client();
                stream = Some(
                    timed(timeout, "lease keep-alive", leases.keep_alive(id))
                        .await
                        .map_err(Renewal::Unreachable)?,
                );
            }
            let Some((keeper, responses)) = stream.as_mut() else {
                return Err(Renewal::Unreachable(LeaseError::Closed));
            };
            timed(timeout, "lease keep-alive", keeper.keep_alive())
                .await
                .map_err(Renewal::Unreachable)?;
            match timed(timeout, "lease keep-alive", responses.message()).await {
                Ok(Some(response)) if response.ttl() > 0 => Ok(()),
                Ok(Some(_)) => Err(Renewal::Gone),
                Ok(None) => Err(Renewal::Unreachable(LeaseError::Closed)),
                Err(cause) => Err(Renewal::Unreachable(cause)),
            }
        }
        .await;
        let outcome = match renewed {
            Ok(()) => Ok(()),
            Err(Renewal::Unreachable(cause)) => {
                stream = None;
                Err(cause)
            }
            Err(Renewal::Gone) => {
                stream = None;
                match grant(&client, &key, &value, ttl, timeout).await {
                    Ok(id) => {
                        lease.store(id, Ordering::SeqCst);
                        tracing::info!(
                            key,
                            "guard heartbeat: the lease had lapsed; heartbeating on a new one"
                        );
                        Ok(())
                    }
                    Err(cause) => Err(cause),
                }
            }
        };
        match outcome {
            Ok(()) if failing => {
                failing = false;
                tracing::info!(key, "guard heartbeat: renewing again");
            }
            Ok(()) => {}
            Err(cause) if !failing => {
                failing = true;
                tracing::warn!(key, %cause, "guard heartbeat: cannot renew the lease; retrying every heartbeat");
            }
            Err(cause) => tracing::debug!(key, %cause, "guard heartbeat: still cannot renew"),
        }
    }
}

/// `host:port` or an `http://` URL; TLS to the guard is not supported here
/// (the sidecar runs beside the guard, on loopback).
fn guard_url(address: &str) -> Result<String, Error> {
    if address.starts_with("https://") {
        return Err(format!(
            "--guard {address}: TLS to the guard is not supported by the sidecar; \
             give the guard's plaintext loopback address"
        )
        .into());
    }
    let url = if address.starts_with("http://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    };
    url.parse::<tonic::transport::Uri>()
        .map_err(|e| format!("--guard {address}: not an address: {e}"))?;
    Ok(url)
}

/// The address a replica is announced with: `host:port` reads as
/// `http://host:port`; the host is checked as a registration's is (no
/// ambiguous forms). The endpoint policy is the mesh's to apply, to every
/// announced address.
fn replica_url(address: &str) -> Result<String, Error> {
    let parsed = guardmesh_server::link::discover::dns::parse_endpoint(address)
        .map_err(|e| format!("--replica: {e}"))?;
    let host = match parsed.literal {
        Some(std::net::IpAddr::V6(ip)) => format!("[{ip}]"),
        _ => parsed.host,
    };
    Ok(format!("{}://{host}:{}", parsed.scheme, parsed.port))
}

/// Whether the guard answers its overall health as SERVING within `timeout`.
async fn serving(url: &str, timeout: Duration) -> bool {
    let check = async {
        let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
            .ok()?
            .connect_timeout(timeout)
            .connect()
            .await
            .ok()?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .ok()?;
        Some(answer.into_inner().status == ServingStatus::Serving as i32)
    };
    matches!(tokio::time::timeout(timeout, check).await, Ok(Some(true)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_addresses_are_host_port_or_http() {
        assert_eq!(
            guard_url("127.0.0.1:7000").unwrap(),
            "http://127.0.0.1:7000"
        );
        assert_eq!(guard_url("http://[::1]:7000").unwrap(), "http://[::1]:7000");
        let error = guard_url("https://g:7000").unwrap_err().to_string();
        assert!(
            error.contains("TLS to the guard is not supported"),
            "{error}"
        );
        assert!(guard_url("not an address").is_err());
    }

    #[test]
    fn r32_replica_addresses_are_read_as_the_mesh_dials_them() {
        assert_eq!(
            replica_url("10.0.0.5:7001").unwrap(),
            "http://10.0.0.5:7001"
        );
        assert_eq!(
            replica_url("https://pod-1.guard.ns.svc:7001").unwrap(),
            "https://pod-1.guard.ns.svc:7001"
        );
        assert_eq!(replica_url("http://[::1]:7").unwrap(), "http://[::1]:7");
        for bad in ["http://0x7f.1:7", "ftp://a:1", "http://a:1/x", "http://a:0"] {
            assert!(replica_url(bad).is_err(), "{bad}");
        }
    }
}
