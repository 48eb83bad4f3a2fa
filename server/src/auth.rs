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
//! counted. Health and reflection stay open, so probes and tooling work.

use crate::metrics::Metrics;
use crate::tls::PeerInfo;
use std::collections::HashSet;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::Status;

/// A role a principal may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Evaluate,
    Register,
    Admin,
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
        "/guardmesh.v1.GuardRegistry/Register" | "/guardmesh.v1.GuardRegistry/Deregister" => {
            Some(Role::Register)
        }
        p if p.starts_with("/guardmesh.v1.GuardRegistry/") => Some(Role::Admin),
        p if p.starts_with("/grpc.health.v1.Health/") || p.starts_with("/grpc.reflection.") => None,
        // Anything else is unknown to the mesh: admin only, so that a new
        // service never starts out open by accident.
        _ => Some(Role::Admin),
    }
}

/// The tower layer that enforces an [`AuthPolicy`]. Without a policy every
/// request passes (and the server warned at start).
#[derive(Debug, Clone)]
pub struct AuthLayer {
    policy: Option<Arc<AuthPolicy>>,
    metrics: Arc<Metrics>,
}

impl AuthLayer {
    pub fn new(policy: Option<Arc<AuthPolicy>>, metrics: Arc<Metrics>) -> Self {
        Self { policy, metrics }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            policy: self.policy.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    policy: Option<Arc<AuthPolicy>>,
    metrics: Arc<Metrics>,
}

impl<S, B> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::Either<
        S::Future,
        futures::future::Ready<Result<Self::Response, Self::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let Some(policy) = &self.policy else {
            return futures::future::Either::Left(self.inner.call(request));
        };
        let path = request.uri().path().to_owned();
        let Some(role) = required_role(&path) else {
            return futures::future::Either::Left(self.inner.call(request));
        };
        let peer = request.extensions().get::<PeerInfo>().cloned();
        let authorization = request
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        let refusal = match policy.authenticate(peer.as_ref(), authorization) {
            Err(status) => Some((status, "-".to_owned())),
            Ok(caller) => {
                let allowed = match role {
                    // Name prefixes are checked by the registry service,
                    // which sees the guard's name.
                    Role::Register => caller.has(Role::Register),
                    role => caller.has(role),
                };
                if allowed {
                    request.extensions_mut().insert(caller);
                    None
                } else {
                    let message = format!(
                        "{} may not call {path}: it needs the {role:?} role",
                        caller.id
                    );
                    Some((Status::permission_denied(message), caller.id))
                }
            }
        };
        match refusal {
            None => futures::future::Either::Left(self.inner.call(request)),
            Some((status, identity)) => {
                let remote = peer
                    .and_then(|p| p.remote)
                    .map(|r| r.to_string())
                    .unwrap_or_default();
                tracing::warn!(
                    %identity,
                    %remote,
                    %path,
                    code = ?status.code(),
                    "request refused: {}",
                    status.message()
                );
                self.metrics.auth_refused(status.code());
                futures::future::Either::Right(futures::future::ready(Ok(status.into_http())))
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
        }
    }

    fn peer(tls: bool, identity: Result<Option<String>, String>) -> PeerInfo {
        PeerInfo {
            remote: Some("127.0.0.1:1".parse().unwrap()),
            tls,
            identity,
        }
    }

    #[test]
    fn role_routes() {
        assert_eq!(
            required_role("/guardmesh.v1.PreToolService/Evaluate"),
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
}
