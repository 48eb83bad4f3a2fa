//! `guardmesh serve` under systemd `Type=notify` (deploy/systemd): the
//! service manager is told `READY=1` once the gRPC listener accepts
//! connections (not when the process starts), `WATCHDOG=1` at half the
//! unit's `WatchdogSec=` while the runtime runs, and `STOPPING=1` when a
//! shutdown signal starts the drain. Nothing is sent without
//! `NOTIFY_SOCKET`, so the same binary runs anywhere else.

use guardmesh_server::observe::metrics_http::Probes;
use sd_notify::NotifyState;
use std::sync::Arc;
use std::time::Duration;

/// How often the listener and the drain are looked at.
const POLL: Duration = Duration::from_millis(20);

/// Spawns the task that tells systemd about `probes`' listener and drain.
/// Returns at once; does nothing when not started by a service manager.
pub(crate) fn spawn(probes: Arc<Probes>) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    let watchdog = sd_notify::watchdog_enabled().map(|every| every / 2);
    tokio::spawn(async move {
        while !probes.listening() {
            tokio::time::sleep(POLL).await;
        }
        send(&[NotifyState::Ready, NotifyState::Status("serving")]);
        let mut pinged = tokio::time::Instant::now();
        if watchdog.is_some() {
            send(&[NotifyState::Watchdog]);
        }
        while !probes.draining() {
            tokio::time::sleep(POLL).await;
            // Sent from the runtime: a runtime that no longer runs its
            // tasks stops the pings, and systemd restarts the service.
            if let Some(every) = watchdog
                && pinged.elapsed() >= every
            {
                send(&[NotifyState::Watchdog]);
                pinged = tokio::time::Instant::now();
            }
        }
        send(&[
            NotifyState::Stopping,
            NotifyState::Status("draining batches in flight"),
        ]);
        // The drain is bounded by shutdown_grace_ms; systemd's watchdog
        // still runs meanwhile.
        if let Some(every) = watchdog {
            loop {
                tokio::time::sleep(every).await;
                send(&[NotifyState::Watchdog]);
            }
        }
    });
}

fn send(state: &[NotifyState<'_>]) {
    if let Err(error) = sd_notify::notify(state) {
        tracing::warn!(%error, "could not notify the service manager (NOTIFY_SOCKET)");
    }
}
