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

/// How often the listener is looked at until it is up.
const POLL: Duration = Duration::from_millis(20);

/// Spawns the task that tells systemd the listener of `probes` is up, then
/// feeds the watchdog.
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
        // Fed from the runtime, through the drain too (bounded by
        // shutdown_grace_ms): a runtime that no longer runs its tasks stops
        // the pings, and systemd restarts the service.
        if let Some(every) = watchdog {
            loop {
                send(&[NotifyState::Watchdog]);
                tokio::time::sleep(every).await;
            }
        }
    });
}

/// Tells systemd the drain begins; called from the shutdown signal itself,
/// before the drain can end the process.
pub(crate) fn stopping() {
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        send(&[
            NotifyState::Stopping,
            NotifyState::Status("draining batches in flight"),
        ]);
    }
}

fn send(state: &[NotifyState<'_>]) {
    if let Err(error) = sd_notify::notify(state) {
        tracing::warn!(%error, "could not notify the service manager (NOTIFY_SOCKET)");
    }
}
