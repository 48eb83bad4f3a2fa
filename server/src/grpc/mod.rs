//! The mesh's gRPC server: `PreToolService`, `GuardRegistry`, health and
//! reflection, composed in one place.

mod answer_body;
mod approval_service;
mod inbound;
mod interceptor_service;
pub(crate) mod service;

use crate::grpc::service::{PreTool, PreToolServer, Registrar};
use crate::mesh::Mesh;
use crate::security::auth::AuthLayer;
use guardmesh_proto::v1::guard_registry_server::GuardRegistryServer;
use guardmesh_proto::v1::pre_tool_service_server::PreToolServiceServer;
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// How far above `limits.max_batch_bytes` a coordinator's message may be
/// and still be read (and refused in-band when over the batch limit).
pub const TRANSPORT_SLACK: usize = 64 * 1024;

/// Errors that stop the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves the mesh on `listener` until `shutdown` completes, then drains:
/// no new connections or streams, open coordinator streams stop taking
/// batches, in-flight batches are answered, and streams end cleanly.
pub async fn run(
    listener: TcpListener,
    mesh: Arc<Mesh>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    // Dial the guards of the config file before the first batch needs them.
    let _ = mesh.chain();
    if let Ok(addr) = listener.local_addr() {
        let _ = mesh.served_at.set(addr);
    }
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<PreToolServiceServer<PreTool>>().await;
    health.set_serving::<GuardRegistryServer<Registrar>>().await;
    // Reflection v1, and v1alpha for the clients that still speak only it
    // (Python's grpcio-reflection, older grpcurl).
    let reflection_builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(guardmesh_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = reflection_builder().build_v1()?;
    let reflection_v1alpha = reflection_builder().build_v1alpha()?;
    // The registry's state in health and metrics: a replica whose shared
    // store has been gone past its staleness window reports NOT_SERVING, so
    // load balancers steer coordinators to replicas that can judge.
    let registry_watch = tokio::spawn({
        let mesh = mesh.clone();
        let health = health.clone();
        async move {
            let mut serving = true;
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tick.tick().await;
                let usable = mesh.registry().check().is_ok();
                mesh.metrics
                    .registry_state(mesh.registry().staleness(), usable);
                if usable != serving {
                    serving = usable;
                    if usable {
                        health.set_serving::<PreToolServiceServer<PreTool>>().await;
                    } else {
                        health
                            .set_not_serving::<PreToolServiceServer<PreTool>>()
                            .await;
                    }
                }
            }
        }
    });
    let (drain_tx, drain_rx) = watch::channel(false);
    // The transport limit is a little above the per-batch limit: a batch
    // up to it is read, its size and counts checked before it is decoded,
    // and an oversized one refused alone while its stream stays open (R20);
    // only a message above it ends its stream. Answers (a decision holds
    // each call twice, plus the calls to execute) may be larger.
    let limits = &mesh.config.limits;
    let transport_limit = limits.max_batch_bytes.saturating_add(TRANSPORT_SLACK);
    let answer_limit = limits.max_batch_bytes.saturating_mul(4).max(16 << 20);
    let pre_tool = PreToolServer::new(
        PreTool::new(mesh.clone(), drain_rx),
        transport_limit,
        answer_limit,
    );
    let registrar = GuardRegistryServer::new(Registrar::new(mesh.clone()));
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down: draining in-flight batches");
        health
            .set_not_serving::<PreToolServiceServer<PreTool>>()
            .await;
        let _ = drain_tx.send(true);
    };
    let security = &mesh.config.security;
    let cert_watch = security
        .server_tls
        .as_ref()
        .map(|tls| tls.cert.watch(std::time::Duration::from_secs(1)));
    // Silent and dead clients (R25): a connection must send the HTTP/2
    // preface within the handshake timeout, idle ones are pinged, and the
    // number open is capped.
    let limits = &security.listener;
    tracing::info!(
        handshake_timeout_ms = limits.handshake_timeout.as_millis() as u64,
        max_connections = limits.connection_cap().unwrap_or(0),
        "client connections: handshake deadline and cap (0: none)"
    );
    let incoming = crate::security::tls::incoming(
        listener,
        security.server_tls.clone(),
        limits,
        mesh.metrics.clone(),
    );
    // A connection past its age is sent GOAWAY, so that clients of a
    // Service spread over replicas added since (docs/operations.md).
    // Only the age: tonic 0.14's max_connection_age_grace closes the
    // connection at age + grace without a GOAWAY first; the connection is
    // cut after the grace by the listener's stream (security::tls).
    let mut builder = tonic::transport::Server::builder();
    if let Some((age, _grace)) = limits.max_connection_age {
        builder = builder.max_connection_age(age);
    }
    let result = builder
        .max_concurrent_streams(security.max_concurrent_streams)
        .http2_keepalive_interval(limits.keepalive_interval)
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .layer(
            AuthLayer::new(security.auth.clone(), mesh.metrics.clone())
                .require_client_cert(
                    security
                        .server_tls
                        .as_ref()
                        .is_some_and(|tls| tls.require_client_cert),
                )
                .decision_log(crate::mesh::record::refusals(mesh.clone())),
        )
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(pre_tool)
        .add_service(registrar)
        .add_service(
            guardmesh_proto::v1::interceptor_service_server::InterceptorServiceServer::new(
                interceptor_service::Interceptors::new(mesh.clone()),
            ),
        )
        .add_service(
            guardmesh_proto::v1::approval_service_server::ApprovalServiceServer::new(
                approval_service::Approvals::new(mesh.clone()),
            ),
        )
        .serve_with_incoming_shutdown(incoming, signal)
        .await;
    if let Some(watch) = cert_watch {
        watch.abort();
    }
    registry_watch.abort();
    result?;
    Ok(())
}
