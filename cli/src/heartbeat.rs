//! `guardmesh heartbeat`: a sidecar that keeps a guard's liveness lease in the
//! etcd registry for guards that cannot (Python, Node, any language), so they
//! are not limited to "no heartbeat" (R15: liveness never changes the chain).
//!
//! With `--guard URL` the lease follows the guard's own gRPC health: the
//! sidecar holds the lease only while the guard answers `SERVING`, revokes it
//! as soon as the guard stops answering, and takes a new one when it is back.
//! Without it the lease only says the sidecar runs. SIGTERM or SIGINT revoke
//! the lease and exit.

use guardmesh_server::config::{Config, RegistryKind};
use guardmesh_server::registry::etcd::GuardHeartbeat;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;
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
    let every = etcd.heartbeat_interval.max(Duration::from_millis(100));
    let mut beat: Option<GuardHeartbeat> = None;
    tokio::pin!(shutdown);
    loop {
        let serving = match &guard {
            Some(url) => serving(url, every).await,
            None => true,
        };
        if serving && beat.is_none() {
            match GuardHeartbeat::start(&etcd, &args.name).await {
                Ok(started) => {
                    tracing::info!(guard = %args.name, "liveness lease held");
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
}
