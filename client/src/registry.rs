//! Registering guards with a mesh.

use crate::connect::{Authorized, Connection, Credentials, MAX_MESSAGE_BYTES};
use crate::error::ClientError;
use crate::proto::guard_registry_client::GuardRegistryClient;
use crate::proto::{
    DeregisterRequest, FailurePolicy, GuardMode, GuardPhases, GuardRole, GuardSpec, ListRequest,
    ListResponse, RegisterRequest, RegisterResponse, ResultGrant, RewriteGrant,
};
use std::time::Duration;
use tonic::transport::Channel;

/// A guard registration, built fluently.
///
/// ```
/// use guardmesh_client::Registration;
/// use guardmesh_client::proto::FailurePolicy;
/// use std::time::Duration;
/// let spec = Registration::validate("sql-where", "http://127.0.0.1:7001")
///     .tools(["sql.*"])
///     .timeout(Duration::from_millis(200))
///     .failure_policy(FailurePolicy::FailClosed)
///     .build();
/// assert_eq!(spec.tools, ["sql.*"]);
/// ```
#[derive(Debug, Clone)]
pub struct Registration(GuardSpec);

impl Registration {
    /// A validate guard: judges calls (R3).
    pub fn validate(name: impl Into<String>, endpoint: impl Into<String>) -> Self {
        Self(GuardSpec {
            name: name.into(),
            endpoint: endpoint.into(),
            ..GuardSpec::default()
        })
    }

    /// A policy guard (R27): judged inside the mesh by the CEL rules of
    /// `source` (a policy file's text), with no endpoint. A validate guard.
    pub fn policy(name: impl Into<String>, source: impl Into<String>) -> Self {
        Self(GuardSpec {
            name: name.into(),
            policy: source.into(),
            ..GuardSpec::default()
        })
    }

    /// A mutate guard: may rewrite the tools of `grant` (R10, R11).
    pub fn mutate<I, S>(name: impl Into<String>, endpoint: impl Into<String>, grant: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut r = Self::validate(name, endpoint);
        r.0.role = GuardRole::Mutate as i32;
        r.0.grant = Some(RewriteGrant {
            tools: grant.into_iter().map(Into::into).collect(),
            may_rename: false,
        });
        r
    }

    /// Lets a mutate guard rename tools within its grant.
    pub fn may_rename(mut self) -> Self {
        if let Some(grant) = self.0.grant.as_mut() {
            grant.may_rename = true;
        }
        self
    }

    /// The tools the guard judges (names or globs); default all (R9).
    pub fn tools<I, S>(mut self, tools: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.0.tools = tools.into_iter().map(Into::into).collect();
        self
    }

    /// Its timeout (R14).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.0.timeout_ms = u32::try_from(timeout.as_millis())
            .unwrap_or(u32::MAX)
            .max(1);
        self
    }

    /// What a call it asked about gets when nobody answers the approval
    /// request in time (R35): cancel (the default) or steer.
    pub fn ask_fallback(mut self, fallback: crate::proto::AskFallback) -> Self {
        self.0.ask_fallback = fallback as i32;
        self
    }

    /// Its failure policy (R13).
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.0.failure_policy = policy as i32;
        self
    }

    /// Its priority: lower runs first.
    pub fn priority(mut self, priority: i32) -> Self {
        self.0.priority = priority;
        self
    }

    /// For `https://` endpoints: the identity the guard must present (a DNS
    /// name or a `spiffe://` ID).
    pub fn server_identity(mut self, identity: impl Into<String>) -> Self {
        self.0.server_identity = identity.into();
        self
    }

    /// More replicas of the same guard (R32), each an endpoint in the form
    /// of the registration's own (`http://host:port`): the mesh keeps a
    /// link to every replica and sends each request to one of them. Adds
    /// to the list; the endpoint stays a replica.
    pub fn replicas<I, S>(mut self, replicas: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.0.replicas.extend(replicas.into_iter().map(Into::into));
        self
    }

    /// The phases the guard judges (R33): calls (the default), results,
    /// or both.
    pub fn phases(mut self, phases: GuardPhases) -> Self {
        self.0.phases = phases as i32;
        self
    }

    /// For a mutate guard judging results: the tools whose results it may
    /// rewrite (R11, R33).
    pub fn result_grant<I, S>(mut self, tools: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.0.result_grant = Some(ResultGrant {
            tools: tools.into_iter().map(Into::into).collect(),
        });
        self
    }

    /// The MCP events the guard hooks when the chain is listed as MCP
    /// interceptors (SEP-2624): `tools/call`, `*`, ... (listing only; the
    /// mesh refuses more than 16, or one outside ASCII letters, digits and
    /// `/ _ . * -`). None given: `tools/call`.
    pub fn interceptor_events<I, S>(mut self, events: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.0.interceptor_events = events.into_iter().map(Into::into).collect();
        self
    }

    /// Asks for session memory (R34): the guard is sent the batch's
    /// `GuardBatch.session` with each batch it judges. By default it is sent
    /// none and pays nothing for it. A kit guard whose `Guard::READS_SESSION`
    /// is true is registered this way by `GuardServer::registration`.
    pub fn reads_session_memory(mut self) -> Self {
        self.0.session_memory = crate::proto::SessionMemoryUse::Read as i32;
        self
    }

    /// Says the guard does not read session memory (R34): it is sent none.
    /// The same as saying nothing.
    pub fn without_session_memory(mut self) -> Self {
        self.0.session_memory = crate::proto::SessionMemoryUse::None as i32;
        self
    }

    /// Consulted and traced, never applied (R18).
    pub fn dry_run(mut self) -> Self {
        self.0.mode = GuardMode::DryRun as i32;
        self
    }

    /// The wire registration.
    pub fn build(self) -> GuardSpec {
        self.0
    }
}

impl From<Registration> for GuardSpec {
    fn from(r: Registration) -> Self {
        r.0
    }
}

/// A client of a mesh's `GuardRegistry`. It connects through the same
/// [`Connection`] as [`crate::Coordinator`], and the credentials it was
/// connected with go on every call: register, deregister and list (R24).
#[derive(Debug, Clone)]
pub struct Registrar {
    client: GuardRegistryClient<Authorized>,
}

impl Registrar {
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

    /// Uses an existing channel, without a token.
    pub fn from_channel(channel: Channel) -> Self {
        Self::from_channel_with(channel, Credentials::none())
    }

    /// Uses an existing channel; `credentials` go on every call.
    pub fn from_channel_with(channel: Channel, credentials: Credentials) -> Self {
        Self::from_authorized(crate::connect::authorize(channel, credentials))
    }

    fn from_authorized(channel: Authorized) -> Self {
        Self {
            client: GuardRegistryClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        }
    }

    /// Registers (or updates in place) a guard.
    pub async fn register(
        &self,
        spec: impl Into<GuardSpec>,
    ) -> Result<RegisterResponse, ClientError> {
        let request = RegisterRequest {
            guard: Some(spec.into()),
        };
        Ok(self.client.clone().register(request).await?.into_inner())
    }

    /// Removes a guard; returns whether one was removed.
    pub async fn deregister(&self, name: impl Into<String>) -> Result<bool, ClientError> {
        let request = DeregisterRequest { name: name.into() };
        Ok(self
            .client
            .clone()
            .deregister(request)
            .await?
            .into_inner()
            .removed)
    }

    /// The chain in order.
    pub async fn list(&self) -> Result<ListResponse, ClientError> {
        Ok(self.client.clone().list(ListRequest {}).await?.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r32_a_registration_carries_its_replicas_beside_its_endpoint() {
        let spec = Registration::validate("g", "http://10.0.0.5:7001")
            .replicas(["http://10.0.0.6:7001"])
            .replicas(vec!["http://10.0.0.7:7001".to_string()])
            .build();
        assert_eq!(spec.endpoint, "http://10.0.0.5:7001");
        assert_eq!(
            spec.replicas,
            ["http://10.0.0.6:7001", "http://10.0.0.7:7001"]
        );
        // The old single endpoint: no replicas on the wire.
        assert!(
            Registration::validate("g", "http://10.0.0.5:7001")
                .build()
                .replicas
                .is_empty()
        );
    }
}
