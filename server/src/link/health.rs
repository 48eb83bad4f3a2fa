//! A replica's own word on whether it takes new requests (R32): the
//! `grpc.health.v1.Health/Watch` stream of its guard service.
//!
//! A replica that reports `NOT_SERVING` is draining: it gets no new
//! requests (unless no other replica can take them) and finishes the ones
//! it holds; back to `SERVING`, it gets requests again. The watch rides on
//! the connection of the replica's `Judge` stream (one more HTTP/2 stream on
//! it, no connection and no polling of its own), is opened with each new
//! `Judge` stream and ends with it. A guard that does not serve the health
//! service (`UNIMPLEMENTED`), or does not know the guard service's name, is
//! taken at its word that it serves: only an explicit `NOT_SERVING` drains.
//!
//! The watch sends nothing after its request and no pings of its own, so it
//! is within what default gRPC servers allow (R26).

use crate::observe::metrics::Metrics;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// The service whose status is watched: the guard service itself.
pub const GUARD_SERVICE: &str = "guardmesh.v1.GuardService";

const UNKNOWN: u8 = 0;
const SERVING: u8 = 1;
const NOT_SERVING: u8 = 2;

/// The last status a replica reported; shared by its link (which reads it)
/// and its transport (whose watch writes it).
#[derive(Debug, Default)]
pub struct Health {
    status: AtomicU8,
}

impl Health {
    /// Whether the replica said it does not serve (draining).
    pub fn draining(&self) -> bool {
        self.status.load(Ordering::Relaxed) == NOT_SERVING
    }

    /// Sets what the watch would (unit tests of the choice).
    #[cfg(test)]
    pub(crate) fn set_draining(&self, draining: bool) {
        self.set(if draining { NOT_SERVING } else { SERVING });
    }

    fn set(&self, status: u8) -> u8 {
        self.status.swap(status, Ordering::Relaxed)
    }
}

/// Watches the guard service's health on `channel` (the connection of the
/// replica's `Judge` stream) until the stream ends or the task is aborted,
/// writing each status into `health` (and whether it drains into
/// `metrics`, `guardmesh_guard_replica_draining`).
pub async fn watch(
    channel: tonic::transport::Channel,
    health: Arc<Health>,
    guard: Arc<str>,
    endpoint: Arc<str>,
    metrics: Option<Arc<Metrics>>,
) {
    let report = |status| report(&health, status, &guard, &endpoint, metrics.as_deref());
    let mut client = HealthClient::new(channel);
    let request = HealthCheckRequest {
        service: GUARD_SERVICE.to_owned(),
    };
    let mut updates = match client.watch(request).await {
        Ok(updates) => updates.into_inner(),
        Err(status) => {
            if matches!(
                status.code(),
                tonic::Code::Unimplemented | tonic::Code::NotFound
            ) {
                // No health service: only the Judge stream speaks for it.
                report(UNKNOWN);
            }
            tracing::debug!(guard = %guard, replica = %endpoint, %status, "no health watch");
            return;
        }
    };
    loop {
        match updates.message().await {
            Ok(Some(update)) => {
                let status = match ServingStatus::try_from(update.status) {
                    Ok(ServingStatus::Serving) => SERVING,
                    Ok(ServingStatus::NotServing) => NOT_SERVING,
                    // Unknown, or a service the guard does not name: not a
                    // word about draining.
                    _ => UNKNOWN,
                };
                report(status);
            }
            // The stream ended (a guard that shuts down ends its watches
            // after reporting NOT_SERVING): the last status stands until
            // the next Judge stream's watch says otherwise.
            Ok(None) | Err(_) => return,
        }
    }
}

fn report(health: &Health, status: u8, guard: &str, endpoint: &str, metrics: Option<&Metrics>) {
    let before = health.set(status);
    // After the choice reads it: the gauge never says draining before the
    // choice acts on it.
    if let Some(metrics) = metrics {
        metrics.replica_draining(guard, endpoint, status == NOT_SERVING);
    }
    if before == status {
        return;
    }
    if status == NOT_SERVING {
        tracing::info!(guard = %guard, replica = %endpoint, "replica draining (health NOT_SERVING): no new requests");
    } else if before == NOT_SERVING {
        tracing::info!(guard = %guard, replica = %endpoint, "replica serving again");
    }
}
