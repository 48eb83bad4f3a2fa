//! Reaching etcd: the client with its credentials and TLS, the deadline
//! and retries of every request, which errors a retry may get past, and a
//! new auth token when etcd refused the current one.

use super::Shared;
use super::config::EtcdConfig;
use super::error::{Attempt, ConnectError, RequestError};
use crate::etcd_tls::EtcdTlsError;
use etcd_client::{Client, ConnectOptions};
use std::future::Future;
use std::time::{Duration, Instant};

/// Runs an etcd request under the request timeout, so that an unreachable
/// etcd answers as an error instead of a hang.
pub(super) async fn timed<T>(
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
pub(super) async fn retried<T, F, Fut>(
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

/// A client of the etcd `config` names, authenticated, its token refreshed
/// in calls: for a process beside the mesh that keeps keys of its own on
/// leases (`guardmesh heartbeat`).
pub async fn client(config: &EtcdConfig) -> Result<Client, ConnectError> {
    connect_client(config, true).await
}

/// What every client of the mesh's etcd connects with: the configured
/// credentials and TLS, the dial and request timeouts, and a leader
/// required: a member cut off from the quorum refuses at once ("no
/// leader") instead of answering from its old state, and cancels watches
/// once it has lost its leader, so requests go to a member that can
/// answer.
pub(crate) fn options(config: &EtcdConfig) -> Result<ConnectOptions, EtcdTlsError> {
    let options = ConnectOptions::new()
        .with_connect_timeout(config.request_timeout.min(config.dial_timeout))
        .with_require_leader(true);
    crate::etcd_tls::with_credentials(
        options,
        config.username.as_ref(),
        config.password.as_ref(),
        config.tls.as_ref(),
    )
}

/// Connects a client with the configured credentials and TLS.
///
/// `refresh_in_calls`: whether a request refused for a stale auth token
/// authenticates again itself, inside the request (and its deadline). The
/// registry does that in the background instead (see `Shared::reauthenticate`):
/// a slow authentication cut short by every request's deadline would
/// otherwise never complete.
pub(super) async fn connect_client(
    config: &EtcdConfig,
    refresh_in_calls: bool,
) -> Result<Client, ConnectError> {
    config.validate()?;
    let options = options(config)?
        // HTTP/2 pings notice a dead connection even when no request is out.
        .with_keep_alive(config.heartbeat_interval, config.request_timeout)
        // etcd's simple tokens do not survive an etcd restart; without this
        // a replica would stay unauthenticated after etcd comes back.
        .with_auto_token_refresh(refresh_in_calls);
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

impl Shared {
    /// Gets a new auth token in the background, one attempt at a time, when
    /// etcd refused the current one. Not cut short by a request's deadline:
    /// etcd checks the password with bcrypt, which can take longer than a
    /// request timeout on a loaded machine.
    pub(super) fn reauthenticate(&self) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
