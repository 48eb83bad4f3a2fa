//! [`CoordinatorBuilder`]: how a [`Coordinator`] connects, spelled out:
//! TLS and token, a connect timeout, and retries with backoff while the
//! mesh is not up yet.
//!
//! ```no_run
//! # async fn demo() -> Result<(), guardmesh_client::ClientError> {
//! use guardmesh_client::Coordinator;
//! use std::time::Duration;
//! let mesh = Coordinator::builder("127.0.0.1:50051")
//!     .connect_timeout(Duration::from_secs(2))
//!     .retry(5, Duration::from_millis(200))
//!     .connect()
//!     .await?;
//! # Ok(()) }
//! ```

use crate::connect::{Connection, Tls};
use crate::coordinator::Coordinator;
use crate::error::ClientError;
use std::time::Duration;

/// The longest pause between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How to connect a [`Coordinator`]; made by [`Coordinator::builder`].
#[derive(Debug, Clone)]
pub struct CoordinatorBuilder {
    address: String,
    connection: Connection,
    connect_timeout: Option<Duration>,
    attempts: u32,
    backoff: Duration,
}

impl CoordinatorBuilder {
    pub(crate) fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            connection: Connection::default(),
            connect_timeout: None,
            attempts: 1,
            backoff: Duration::from_millis(100),
        }
    }

    /// TLS, mTLS and token together (replaces what [`Self::tls`] and
    /// [`Self::token`] set).
    pub fn connection(mut self, connection: Connection) -> Self {
        self.connection = connection;
        self
    }

    /// Connects over TLS (`host:port` is then dialed as `https://`).
    pub fn tls(mut self, tls: Tls) -> Self {
        self.connection.tls = Some(tls);
        self
    }

    /// Sends this bearer token on every call (R24).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.connection.token = Some(token.into());
        self
    }

    /// Gives up on one connection attempt after `timeout` (by default the
    /// system's TCP timeout applies).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// Tries to connect up to `attempts` times (at least once), pausing
    /// `backoff` after the first failure and twice as long after each
    /// next one (at most 30 s). Only failures to reach the mesh are
    /// retried: an address that is not one is refused at once.
    pub fn retry(mut self, attempts: u32, backoff: Duration) -> Self {
        self.attempts = attempts.max(1);
        self.backoff = backoff;
        self
    }

    /// Connects: the address is checked first, then dialed, with retries.
    pub async fn connect(self) -> Result<Coordinator, ClientError> {
        let credentials = crate::connect::Credentials::of(&self.connection)?;
        let (mut endpoint, address) = self.connection.endpoint(&self.address)?;
        if let Some(timeout) = self.connect_timeout {
            endpoint = endpoint.connect_timeout(timeout);
        }
        let mut backoff = self.backoff;
        let mut attempt = 1;
        loop {
            match endpoint.connect().await {
                Ok(channel) => return Ok(Coordinator::from_channel_with(channel, credentials)),
                Err(source) if attempt >= self.attempts => {
                    return Err(ClientError::Connect { address, source });
                }
                Err(error) => {
                    tracing::debug!(
                        %address,
                        attempt,
                        error = %crate::error::cause(&error),
                        "cannot connect to the mesh yet; retrying"
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    attempt += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn retries_until_the_mesh_listens() {
        // A port that was free: nothing listens there until the task binds
        // it, after the first attempts were refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let refused = Coordinator::builder(format!("127.0.0.1:{port}"))
            .connect()
            .await
            .unwrap_err();
        assert!(refused.is_connect(), "{refused:?}");
        let listener = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .unwrap();
            // Accepts and holds the connection: enough for a channel.
            let (socket, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(socket);
        });
        let connected = Coordinator::builder(format!("127.0.0.1:{port}"))
            .connect_timeout(Duration::from_secs(2))
            .retry(40, Duration::from_millis(50))
            .connect()
            .await;
        assert!(connected.is_ok(), "{connected:?}");
        listener.abort();
    }

    #[tokio::test]
    async fn a_bad_address_is_refused_without_retrying() {
        let error = Coordinator::builder("http//bad")
            .retry(1000, Duration::from_secs(10))
            .connect()
            .await
            .unwrap_err();
        assert!(matches!(error, ClientError::Address { .. }), "{error:?}");
    }
}
