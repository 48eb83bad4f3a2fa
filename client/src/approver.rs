//! Answering guards' asks (R35): what an approver (a person, or the tool
//! they use) calls.
//!
//! ```no_run
//! # async fn demo() -> Result<(), guardmesh_client::ClientError> {
//! use guardmesh_client::Approver;
//! let approver = Approver::connect("127.0.0.1:50051").await?;
//! for request in approver.pending().await? {
//!     println!("{} asks about {:?}: {}", request.guard, request.call, request.reason);
//!     approver.approve(&request.id, "checked with the customer").await?;
//! }
//! # Ok(()) }
//! ```

use crate::connect::{Authorized, Connection, Credentials, MAX_MESSAGE_BYTES};
use crate::error::ClientError;
use crate::proto::approval_service_client::ApprovalServiceClient;
use crate::proto::{ApprovalListRequest, ApprovalRequest, ApprovalState, ApproveRequest};
use tonic::transport::Channel;

/// A client of a mesh's `ApprovalService`. On a mesh with principals its
/// credentials must carry the `approver` role (or `admin`).
#[derive(Debug, Clone)]
pub struct Approver {
    client: ApprovalServiceClient<Authorized>,
}

impl Approver {
    /// Connects to the mesh at `address` (`host:port` or
    /// `http://host:port`), in plaintext.
    pub async fn connect(address: impl AsRef<str>) -> Result<Self, ClientError> {
        Self::connect_with(address, &Connection::default()).await
    }

    /// Connects with TLS, mTLS and/or a bearer token.
    pub async fn connect_with(
        address: impl AsRef<str>,
        connection: &Connection,
    ) -> Result<Self, ClientError> {
        Ok(Self::from_authorized(
            connection.authorized(address.as_ref()).await?,
        ))
    }

    /// Uses an existing channel; `credentials` go on every call.
    pub fn from_channel_with(channel: Channel, credentials: Credentials) -> Self {
        Self::from_authorized(crate::connect::authorize(channel, credentials))
    }

    fn from_authorized(channel: Authorized) -> Self {
        Self {
            client: ApprovalServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        }
    }

    /// Approves the pending request `id`: the same call may then run once.
    pub async fn approve(
        &self,
        id: impl Into<String>,
        note: impl Into<String>,
    ) -> Result<ApprovalRequest, ClientError> {
        self.answer(id.into(), true, note.into()).await
    }

    /// Denies the pending request `id`: the call is cancelled when it comes
    /// back with it.
    pub async fn deny(
        &self,
        id: impl Into<String>,
        note: impl Into<String>,
    ) -> Result<ApprovalRequest, ClientError> {
        self.answer(id.into(), false, note.into()).await
    }

    async fn answer(
        &self,
        id: String,
        approve: bool,
        note: String,
    ) -> Result<ApprovalRequest, ClientError> {
        let response = self
            .client
            .clone()
            .approve(ApproveRequest { id, approve, note })
            .await?
            .into_inner();
        response
            .request
            .ok_or_else(|| ClientError::Protocol("an approval answered without its request".into()))
    }

    /// The requests waiting for a person, newest first.
    pub async fn pending(&self) -> Result<Vec<ApprovalRequest>, ClientError> {
        self.list(ApprovalState::Pending, "", 0).await
    }

    /// The requests in `state` (`Unspecified`: all) of `session_id` (empty:
    /// all sessions), at most `limit` (0: the mesh's default of 100).
    pub async fn list(
        &self,
        state: ApprovalState,
        session_id: &str,
        limit: u32,
    ) -> Result<Vec<ApprovalRequest>, ClientError> {
        let request = ApprovalListRequest {
            state: state as i32,
            session_id: session_id.to_owned(),
            limit,
        };
        Ok(self
            .client
            .clone()
            .list(request)
            .await?
            .into_inner()
            .requests)
    }
}
