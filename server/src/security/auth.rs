//! Who may call the mesh, and what they may do.
//!
//! A caller is identified by its client certificate (exactly one URI SAN,
//! SPIFFE style) or by a bearer token. Tokens are accepted only over TLS,
//! unless the listener is loopback and the config allows it explicitly.
//! Principals map identities to roles:
//!
//! * `evaluate`: `PreToolService` (coordinators);
//! * `register`: `GuardRegistry.Register`/`Deregister`, optionally only for
//!   guard names with given prefixes, and up to a number of registrations;
//! * `admin`: everything, including `GuardRegistry.List`.
//!
//! Missing or bad credentials get UNAUTHENTICATED; valid credentials without
//! the role get PERMISSION_DENIED. Both are logged with the identity and
//! counted. Health stays open, so probes work; reflection is open to every
//! caller the listener admits. A refused batch (`PreToolService`) or chain
//! change (`Register`, `Deregister`) is handed to the mesh's record path
//! ([`RecordRefusal`]), which, with a decision log (R29), records it before
//! the refusal is answered: the caller as far as known (identity, roles,
//! peer address), the status, and no batch (none was read). The layer
//! itself writes no record.
//!
//! A listener with a client CA admits no one without a valid certificate
//! from it, whether or not there are roles (R24): every request but health
//! checks is refused with UNAUTHENTICATED naming the reason (none presented,
//! another CA, expired, ...). Only `tokens_without_client_cert` lets a
//! caller with no certificate authenticate with a bearer token instead.

use crate::observe::metrics::Metrics;
use crate::security::tls::{ClientCert, PeerInfo};
use std::collections::HashSet;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;
use tonic::Status;

/// A role a principal may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Evaluate,
    Register,
    Admin,
    /// R35: answers approval requests (`ApprovalService`).
    Approver,
}

/// An authenticated caller and what it may do; handed to the services in
/// the request's extensions.
#[derive(Debug, Clone)]
pub struct Caller {
    pub id: String,
    pub roles: HashSet<Role>,
    /// For `register`: guard names must start with one of these (empty:
    /// any name).
    pub name_prefixes: Vec<String>,
    /// For `register`: most guards this caller may have registered.
    pub max_registrations: usize,
}

impl Caller {
    pub fn has(&self, role: Role) -> bool {
        self.roles.contains(&role) || self.roles.contains(&Role::Admin)
    }

    /// Whether this caller may register or deregister the guard `name`.
    pub fn may_manage(&self, name: &str) -> bool {
        self.roles.contains(&Role::Admin)
            || (self.roles.contains(&Role::Register)
                && (self.name_prefixes.is_empty()
                    || self.name_prefixes.iter().any(|p| name.starts_with(p))))
    }
}

/// One principal of the config.
#[derive(Debug, Clone)]
pub struct Principal {
    pub id: String,
    /// The bearer token that identifies it, if it uses one.
    pub token: Option<String>,
    pub caller: Caller,
}

/// The authentication and authorization policy.
#[derive(Debug, Clone, Default)]
pub struct AuthPolicy {
    pub principals: Vec<Principal>,
    /// Accept bearer tokens over plaintext on a loopback listener (local
    /// development only).
    pub plaintext_tokens_on_loopback: bool,
    /// On a listener with a client CA, let a caller that presents no
    /// certificate authenticate with a bearer token alone. Off by default:
    /// with a client CA, every connection needs a certificate (R24).
    pub tokens_without_client_cert: bool,
}

/// Compares secrets in time independent of where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl AuthPolicy {
    /// Identifies the caller of a request, or says why it cannot be.
    pub fn authenticate(
        &self,
        peer: Option<&PeerInfo>,
        authorization: Option<&str>,
    ) -> Result<Caller, Status> {
        let tls = peer.is_some_and(|p| p.tls);
        let loopback = peer
            .and_then(|p| p.remote)
            .is_some_and(|r| r.ip().is_loopback());
        // A certificate that was offered but is not acceptable is refused
        // even if a token is also present.
        let cert_identity = match peer.map(|p| &p.identity) {
            Some(Err(why)) => return Err(Status::unauthenticated(why.clone())),
            Some(Ok(id)) => id.clone(),
            None => None,
        };
        if let Some(id) = cert_identity {
            return self.caller_for(&id);
        }
        let Some(header) = authorization else {
            return Err(Status::unauthenticated(
                "no credentials: present a client certificate or a bearer token",
            ));
        };
        let Some(token) = header.strip_prefix("Bearer ").map(str::trim) else {
            return Err(Status::unauthenticated(
                "the authorization header must be `Bearer <token>`",
            ));
        };
        let plaintext_allowed = loopback && self.plaintext_tokens_on_loopback;
        if !(tls || plaintext_allowed) {
            return Err(Status::unauthenticated(
                "bearer tokens are only accepted over TLS",
            ));
        }
        self.principals
            .iter()
            .find(|p| {
                p.token
                    .as_deref()
                    .is_some_and(|t| same_secret(t.as_bytes(), token.as_bytes()))
            })
            .map(|p| p.caller.clone())
            .ok_or_else(|| Status::unauthenticated("unknown bearer token"))
    }

    fn caller_for(&self, id: &str) -> Result<Caller, Status> {
        match self
            .principals
            .iter()
            .find(|p| p.token.is_none() && p.id == id)
        {
            Some(p) => Ok(p.caller.clone()),
            // Authenticated by a valid certificate, but granted nothing.
            None => Ok(Caller {
                id: id.to_owned(),
                roles: HashSet::new(),
                name_prefixes: Vec::new(),
                max_registrations: 0,
            }),
        }
    }
}

/// The role a gRPC method needs; `None` for open services.
pub fn required_role(path: &str) -> Option<Role> {
    match path {
        p if p.starts_with("/guardmesh.v1.PreToolService/") => Some(Role::Evaluate),
        // SEP-2624: the chain as interceptors, for an MCP gateway.
        p if p.starts_with("/guardmesh.v1.InterceptorService/") => Some(Role::Evaluate),
        "/guardmesh.v1.GuardRegistry/Register" | "/guardmesh.v1.GuardRegistry/Deregister" => {
            Some(Role::Register)
        }
        p if p.starts_with("/guardmesh.v1.GuardRegistry/") => Some(Role::Admin),
        // R35: approvers answer and list approval requests.
        p if p.starts_with("/guardmesh.v1.ApprovalService/") => Some(Role::Approver),
        p if p.starts_with("/grpc.health.v1.Health/") || p.starts_with("/grpc.reflection.") => None,
        // Anything else is unknown to the mesh: admin only, so that a new
        // service never starts out open by accident.
        _ => Some(Role::Admin),
    }
}

/// The message of a refusal for a missing client certificate (R24).
pub const NO_CLIENT_CERT: &str = "no credentials: no client certificate was presented, and this \
     listener requires one signed by its client CA";

/// The refusal of a call on a connection whose client certificate has
/// expired since the handshake.
pub const CERT_EXPIRED: &str = "client certificate rejected: it expired after this connection \
     was opened; reconnect with a valid certificate";

/// Whether `path` is open to every client, with or without credentials:
/// health checks, so that load balancers and probes work.
pub fn open_to_all(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/")
}

/// The tower layer that enforces a listener's client CA (R24) and an
/// [`AuthPolicy`].
///
/// With a client CA every request but health checks needs a certificate
/// from that CA, valid at the handshake, whether or not there is a policy.
/// Without a policy, such a certificate (or, without a client CA, nothing)
/// lets the caller do everything (and the server warned at start).
#[derive(Clone)]
pub struct AuthLayer {
    policy: Option<Arc<AuthPolicy>>,
    metrics: Arc<Metrics>,
    require_client_cert: bool,
    log: Option<LogSource>,
}

/// Where the layer hands the requests it refuses: the mesh's record path.
pub type LogSource = Arc<dyn RecordRefusal>;

/// What a refused request would have been.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedKind {
    /// A batch (`PreToolService`).
    Batch,
    /// `GuardRegistry.Register`.
    Register,
    /// `GuardRegistry.Deregister`.
    Deregister,
}

/// A request the layer refused.
#[derive(Debug)]
pub struct AuthRefusal {
    pub kind: RefusedKind,
    /// Who asked, when known.
    pub caller: Option<Caller>,
    /// The connection's peer address, when known.
    pub remote: Option<std::net::SocketAddr>,
    pub status: Status,
}

/// Records the requests the layer refuses (R29).
pub trait RecordRefusal: Send + Sync {
    /// `None` when nothing is recorded (no decision log attached): the
    /// refusal is answered at once. Else the status to answer once the
    /// record is written: the refusal's, or UNAVAILABLE when it cannot be
    /// written and the log's policy is `refuse`.
    fn record(&self, refusal: AuthRefusal) -> Option<futures::future::BoxFuture<'static, Status>>;
}

impl std::fmt::Debug for AuthLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthLayer")
            .field("policy", &self.policy)
            .field("require_client_cert", &self.require_client_cert)
            .field("log", &self.log.is_some())
            .finish()
    }
}

impl AuthLayer {
    pub fn new(policy: Option<Arc<AuthPolicy>>, metrics: Arc<Metrics>) -> Self {
        Self {
            policy,
            metrics,
            require_client_cert: false,
            log: None,
        }
    }

    /// Hands refused batches and chain changes to `log`, which records
    /// them (R29).
    pub fn decision_log(mut self, log: LogSource) -> Self {
        self.log = Some(log);
        self
    }

    /// Refuses every request but health checks from connections without a
    /// valid client certificate (the listener has a client CA).
    pub fn require_client_cert(mut self, required: bool) -> Self {
        self.require_client_cert = required;
        self
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            policy: self.policy.clone(),
            metrics: self.metrics.clone(),
            require_client_cert: self.require_client_cert,
            log: self.log.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    policy: Option<Arc<AuthPolicy>>,
    metrics: Arc<Metrics>,
    require_client_cert: bool,
    log: Option<LogSource>,
}

/// Why a request is refused, and who asked (`None` when unknown).
type Refusal = (Status, Option<Caller>);

fn refused_kind(path: &str) -> Option<RefusedKind> {
    match path {
        p if p.starts_with("/guardmesh.v1.PreToolService/") => Some(RefusedKind::Batch),
        "/guardmesh.v1.GuardRegistry/Register" => Some(RefusedKind::Register),
        "/guardmesh.v1.GuardRegistry/Deregister" => Some(RefusedKind::Deregister),
        _ => None,
    }
}

/// Decides a request: `Ok(Some(caller))` to hand to the services,
/// `Ok(None)` to let it through without a caller, or a refusal.
fn decide(
    policy: Option<&AuthPolicy>,
    require_client_cert: bool,
    path: &str,
    peer: Option<&PeerInfo>,
    authorization: Option<&str>,
) -> Result<Option<Caller>, Refusal> {
    if open_to_all(path) {
        return Ok(None);
    }
    let unknown = || None;
    // R24: configured security is enforced security. A listener with a
    // client CA serves no one without a valid certificate from it, roles or
    // not; only a policy that explicitly allows token callers without a
    // certificate lets a request with a token go on to the token check.
    let mut token_instead_of_cert = false;
    if require_client_cert {
        match peer.map(|p| &p.client_cert) {
            Some(ClientCert::Verified) => {
                if let Some(not_after) = peer.and_then(|p| p.cert_not_after)
                    && SystemTime::now() > not_after
                {
                    return Err((Status::unauthenticated(CERT_EXPIRED), unknown()));
                }
            }
            Some(ClientCert::Rejected(why)) => {
                return Err((Status::unauthenticated(why.clone()), unknown()));
            }
            Some(ClientCert::Missing)
                if authorization.is_some()
                    && policy.is_some_and(|p| p.tokens_without_client_cert) =>
            {
                token_instead_of_cert = true;
            }
            // Missing, or a connection that was never asked (which a
            // listener with a client CA does not make): refused.
            _ => return Err((Status::unauthenticated(NO_CLIENT_CERT), unknown())),
        }
    }
    let Some(policy) = policy else {
        return Ok(None);
    };
    let role = required_role(path);
    if role.is_none() && !token_instead_of_cert {
        return Ok(None);
    }
    let caller = policy
        .authenticate(peer, authorization)
        .map_err(|status| (status, unknown()))?;
    let Some(role) = role else {
        return Ok(None);
    };
    // Name prefixes of `register` are checked by the registry service,
    // which sees the guard's name.
    if caller.has(role) {
        Ok(Some(caller))
    } else {
        let message = format!(
            "{} may not call {path}: it needs the {role:?} role",
            caller.id
        );
        Err((Status::permission_denied(message), Some(caller)))
    }
}

impl<S, B> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::Either<
        S::Future,
        futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if self.policy.is_none() && !self.require_client_cert {
            return futures::future::Either::Left(self.inner.call(request));
        }
        let path = request.uri().path().to_owned();
        let peer = request.extensions().get::<PeerInfo>().cloned();
        let authorization = request
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        let decision = decide(
            self.policy.as_deref(),
            self.require_client_cert,
            &path,
            peer.as_ref(),
            authorization,
        );
        match decision {
            Ok(caller) => {
                if let Some(caller) = caller {
                    request.extensions_mut().insert(caller);
                }
                futures::future::Either::Left(self.inner.call(request))
            }
            Err((status, caller)) => {
                let identity = caller.as_ref().map_or("-", |c| c.id.as_str()).to_owned();
                let remote_addr = peer.as_ref().and_then(|p| p.remote);
                let remote = remote_addr.map(|r| r.to_string()).unwrap_or_default();
                tracing::warn!(
                    %identity,
                    %remote,
                    %path,
                    code = ?status.code(),
                    "request refused: {}",
                    status.message()
                );
                self.metrics.auth_refused(status.code());
                let recorded = match (&self.log, refused_kind(&path)) {
                    (Some(log), Some(kind)) => log.record(AuthRefusal {
                        kind,
                        caller,
                        remote: remote_addr,
                        status: status.clone(),
                    }),
                    _ => None,
                };
                match recorded {
                    Some(recorded) => futures::future::Either::Right(Box::pin(async move {
                        Ok(recorded.await.into_http())
                    })),
                    None => futures::future::Either::Right(Box::pin(futures::future::ready(Ok(
                        status.into_http(),
                    )))),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> AuthPolicy {
        AuthPolicy {
            principals: vec![
                Principal {
                    id: "spiffe://t/coord".into(),
                    token: None,
                    caller: Caller {
                        id: "spiffe://t/coord".into(),
                        roles: [Role::Evaluate].into(),
                        name_prefixes: vec![],
                        max_registrations: 0,
                    },
                },
                Principal {
                    id: "ci".into(),
                    token: Some("s3cret".into()),
                    caller: Caller {
                        id: "ci".into(),
                        roles: [Role::Register].into(),
                        name_prefixes: vec!["ci-".into()],
                        max_registrations: 2,
                    },
                },
            ],
            plaintext_tokens_on_loopback: false,
            tokens_without_client_cert: false,
        }
    }

    fn peer(tls: bool, identity: Result<Option<String>, String>) -> PeerInfo {
        PeerInfo {
            remote: Some("127.0.0.1:1".parse().unwrap()),
            tls,
            identity,
            client_cert: ClientCert::NotAsked,
            cert_not_after: None,
        }
    }

    #[test]
    fn role_routes() {
        assert_eq!(
            required_role("/guardmesh.v1.PreToolService/Evaluate"),
            Some(Role::Evaluate)
        );
        // Tool visibility: whoever may evaluate may ask.
        assert_eq!(
            required_role("/guardmesh.v1.PreToolService/AlwaysSkipped"),
            Some(Role::Evaluate)
        );
        assert_eq!(
            required_role("/guardmesh.v1.GuardRegistry/Register"),
            Some(Role::Register)
        );
        assert_eq!(
            required_role("/guardmesh.v1.GuardRegistry/List"),
            Some(Role::Admin)
        );
        assert_eq!(
            required_role("/guardmesh.v1.ApprovalService/Approve"),
            Some(Role::Approver)
        );
        assert_eq!(required_role("/grpc.health.v1.Health/Check"), None);
        assert_eq!(required_role("/other.Service/Call"), Some(Role::Admin));
    }

    #[test]
    fn tokens_need_tls_and_certificates_must_be_valid() {
        let p = policy();
        let err = p
            .authenticate(Some(&peer(false, Ok(None))), Some("Bearer s3cret"))
            .unwrap_err();
        assert!(err.message().contains("only accepted over TLS"));
        let ok = p
            .authenticate(Some(&peer(true, Ok(None))), Some("Bearer s3cret"))
            .unwrap();
        assert_eq!(ok.id, "ci");
        assert!(ok.may_manage("ci-guard") && !ok.may_manage("prod-guard"));
        let err = p
            .authenticate(Some(&peer(true, Ok(None))), Some("Bearer nope"))
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        let err = p
            .authenticate(
                Some(&peer(true, Err("two URI SANs".into()))),
                Some("Bearer s3cret"),
            )
            .unwrap_err();
        assert!(err.message().contains("two URI SANs"));
        let coord = p
            .authenticate(Some(&peer(true, Ok(Some("spiffe://t/coord".into())))), None)
            .unwrap();
        assert!(coord.has(Role::Evaluate) && !coord.has(Role::Admin));
        let unknown = p
            .authenticate(Some(&peer(true, Ok(Some("spiffe://t/other".into())))), None)
            .unwrap();
        assert!(unknown.roles.is_empty(), "authenticated, granted nothing");
    }

    fn cert_peer(client_cert: ClientCert, identity: Option<&str>) -> PeerInfo {
        PeerInfo {
            client_cert,
            ..peer(true, Ok(identity.map(str::to_owned)))
        }
    }

    #[test]
    fn r24_a_client_ca_is_enforced_with_or_without_roles() {
        let list = "/guardmesh.v1.GuardRegistry/List";
        let evaluate = "/guardmesh.v1.PreToolService/Evaluate";
        let health = "/grpc.health.v1.Health/Check";
        let reflection = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
        let missing = cert_peer(ClientCert::Missing, None);
        let rejected = cert_peer(
            ClientCert::Rejected("client certificate rejected: expired".into()),
            None,
        );
        let verified = cert_peer(ClientCert::Verified, Some("spiffe://t/coord"));
        // No policy: the certificate alone decides.
        for path in [list, evaluate, reflection] {
            let (status, _) = decide(None, true, path, Some(&missing), None).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
            assert!(
                status.message().contains("no client certificate"),
                "{}",
                status.message()
            );
            let (status, _) = decide(None, true, path, Some(&rejected), None).unwrap_err();
            assert!(status.message().contains("expired"));
            assert!(decide(None, true, path, Some(&verified), None).is_ok());
            // No peer information at all: refused, never waved through.
            assert!(decide(None, true, path, None, None).is_err());
        }
        assert!(decide(None, true, health, Some(&missing), None).is_ok());
        assert!(decide(None, false, list, Some(&missing), None).is_ok());
        // With a policy, a token does not replace the certificate...
        let mut p = policy();
        let (status, _) =
            decide(Some(&p), true, list, Some(&missing), Some("Bearer s3cret")).unwrap_err();
        assert!(status.message().contains("no client certificate"));
        let (status, _) = decide(
            Some(&p),
            true,
            reflection,
            Some(&missing),
            Some("Bearer s3cret"),
        )
        .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        // ...unless the policy says so; then the token is checked, also
        // for reflection, and a rejected certificate is still refused.
        p.tokens_without_client_cert = true;
        let caller = decide(
            Some(&p),
            true,
            "/guardmesh.v1.GuardRegistry/Register",
            Some(&missing),
            Some("Bearer s3cret"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(caller.id, "ci");
        assert!(
            decide(
                Some(&p),
                true,
                reflection,
                Some(&missing),
                Some("Bearer nope")
            )
            .is_err()
        );
        assert!(decide(Some(&p), true, list, Some(&missing), None).is_err());
        assert!(decide(Some(&p), true, list, Some(&rejected), Some("Bearer s3cret")).is_err());
        let coord = decide(Some(&p), true, evaluate, Some(&verified), None)
            .unwrap()
            .unwrap();
        assert_eq!(coord.id, "spiffe://t/coord");
    }

    /// R24: a certificate valid at the handshake but expired since is
    /// refused on the next call of that connection, with or without roles.
    #[test]
    fn r24_a_certificate_that_expires_on_an_open_connection_is_refused_from_then_on() {
        let list = "/guardmesh.v1.GuardRegistry/List";
        let now = SystemTime::now();
        let later = PeerInfo {
            cert_not_after: Some(now + std::time::Duration::from_secs(3600)),
            ..cert_peer(ClientCert::Verified, None)
        };
        let expired = PeerInfo {
            cert_not_after: Some(now - std::time::Duration::from_secs(1)),
            ..cert_peer(ClientCert::Verified, Some("spiffe://t/coord"))
        };
        assert!(decide(None, true, list, Some(&later), None).is_ok());
        let (status, _) = decide(None, true, list, Some(&expired), None).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        assert_eq!(status.message(), CERT_EXPIRED);
        let p = policy();
        let (status, _) = decide(
            Some(&p),
            true,
            "/guardmesh.v1.PreToolService/Evaluate",
            Some(&expired),
            None,
        )
        .unwrap_err();
        assert_eq!(status.message(), CERT_EXPIRED);
    }
}
