//! Admitting a guard's registration: the one place it is checked (R16).
//!
//! A registration, whether it comes from a `Register` call or from a
//! `[[guard]]` entry of the config file, goes through [`admit`]: the spec's
//! own checks (name, enums, tool patterns, grant), the policy compiled
//! (R27), and the endpoint against the mesh's endpoint policy. What comes
//! out is a [`CheckedGuard`], the only thing a [`Registry`](super::Registry)
//! accepts: the registry never checks or compiles again. A replica of a
//! shared registry that reads a registration another replica wrote
//! compiles it once more, because it is another process (see
//! [`from_store`]); the replica that wrote it reuses its own.
//!
//! What an identity may hold (R25) is checked by the registry in the same
//! step as the registration ([`Owner`]), so that replicas sharing a store
//! enforce one quota, not one each.

use crate::link::dial::EndpointPolicy;
use crate::registry::spec::{Guard, SpecError};
use guardmesh_proto::v1::GuardSpec;
use std::sync::Arc;
use std::time::Duration;

/// Default bound on the bytes of compiled policies one identity may have
/// registered (`[registry] max_policy_bytes_per_identity`).
pub const DEFAULT_MAX_POLICY_BYTES_PER_IDENTITY: usize = 64 << 20;

/// What a registration is checked against besides itself. A mesh's is
/// [`Admission::of`] its settings, defined beside them in `mesh` so that the
/// registry does not import the mesh.
#[derive(Debug, Clone)]
pub struct Admission {
    /// Replaces a registration's `timeout_ms = 0`.
    pub default_timeout: Duration,
    /// Which endpoints a remote guard may have.
    pub endpoint_policy: Arc<EndpointPolicy>,
}

/// Why a registration was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    /// The registration itself is invalid (INVALID_ARGUMENT).
    #[error(transparent)]
    Invalid(#[from] SpecError),
    /// Its endpoint is outside the endpoint policy (PERMISSION_DENIED).
    #[error("guard {name:?}: endpoint {endpoint} refused by the endpoint policy: {why}")]
    Endpoint {
        name: String,
        endpoint: String,
        why: String,
    },
    /// The check was cut short (the blocking thread it ran on went away).
    #[error("the registration was interrupted")]
    Interrupted,
}

/// A registration that passed [`admit`]: checked, its policy compiled.
/// Its only constructors are [`admit`] and [`admit_blocking`].
#[derive(Debug, Clone)]
pub struct CheckedGuard {
    guard: Arc<Guard>,
    /// The spec as given, its name trimmed: what a shared store keeps, so
    /// that each replica applies its own default timeout to
    /// `timeout_ms = 0`.
    stored: GuardSpec,
}

impl CheckedGuard {
    /// The checked guard, as the chain holds it.
    pub fn guard(&self) -> &Arc<Guard> {
        &self.guard
    }

    /// Its name, trimmed.
    pub fn name(&self) -> &str {
        &self.guard.name
    }

    /// The registration as a shared store keeps it.
    pub(crate) fn stored(&self) -> &GuardSpec {
        &self.stored
    }
}

/// Checks `spec` against itself and `admission`, and compiles its policy.
/// Runs on the calling thread; a policy can take up to its compile bound
/// (seconds), so async callers use [`admit`].
pub fn admit_blocking(spec: GuardSpec, admission: &Admission) -> Result<CheckedGuard, AdmitError> {
    let guard = Guard::from_spec(&spec, admission.default_timeout)?;
    // The endpoint policy: no registration may point the mesh at a
    // metadata service or outside the allow-list (checked again after DNS
    // resolution when dialing).
    // R32: every replica is held to it.
    if !guard.is_policy() {
        for (endpoint, host) in guard.hosts() {
            if let Err(why) = admission.endpoint_policy.check_host(&host) {
                return Err(AdmitError::Endpoint {
                    name: guard.name.clone(),
                    endpoint,
                    why: why.to_string(),
                });
            }
        }
    }
    let stored = GuardSpec {
        name: guard.name.clone(),
        ..spec
    };
    Ok(CheckedGuard {
        guard: Arc::new(guard),
        stored,
    })
}

/// [`admit_blocking`] off the runtime's threads (R25: a policy compiles
/// within its size and time bounds, and no batch waits for it).
pub async fn admit(spec: GuardSpec, admission: &Admission) -> Result<CheckedGuard, AdmitError> {
    let admission = admission.clone();
    tokio::task::spawn_blocking(move || admit_blocking(spec, &admission))
        .await
        .map_err(|_| AdmitError::Interrupted)?
}

/// A registration read back from a shared store, written there by another
/// replica's admission: its own checks and its policy compiled, once. The
/// endpoint policy is this replica's, applied when it dials.
pub(crate) fn from_store(spec: &GuardSpec, default_timeout: Duration) -> Result<Guard, SpecError> {
    Guard::from_spec(spec, default_timeout)
}

/// Who registers, and what that identity may hold (R25). Checked by the
/// registry in the same step as the registration, so replicas sharing a
/// store count one quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The caller's identity.
    pub identity: String,
    /// Most guards it may have registered; `None`: no count (admins).
    pub max_guards: Option<usize>,
    /// Most bytes of compiled policies its guards may hold together.
    pub max_policy_bytes: usize,
}

/// Bytes a guard's compiled policy is charged against its owner's bound:
/// its compiled patterns (as `policy::patterns` charges them) plus its
/// source, which bounds the compiled rules. 0 for a remote guard.
pub fn policy_bytes(guard: &Guard) -> usize {
    guard.policy.as_ref().map_or(0, |p| {
        p.compiled.pattern_bytes().saturating_add(p.source.len())
    })
}

/// Why an owner may not register one more guard.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    /// Its count of guards (the message of the quota refusal since R16's
    /// registrars were counted in one process).
    #[error("{identity} already registered {count} guards, its limit")]
    Guards { identity: String, count: usize },
    /// Its compiled policies would pass its bound.
    #[error(
        "{identity}: the compiled policies of its guards would take {would} bytes, over the \
         per-identity bound of {limit} bytes ([registry] max_policy_bytes_per_identity); \
         they hold {used} bytes now"
    )]
    PolicyBytes {
        identity: String,
        used: usize,
        would: usize,
        limit: usize,
    },
}

impl Owner {
    /// Whether this owner may register `guard`, owning `owned` other
    /// guards (the guard's own name excluded) whose policies take
    /// `used_policy_bytes`; `already`: it owns `guard`'s name (an update,
    /// which does not count).
    pub(crate) fn admits(
        &self,
        guard: &Guard,
        owned: usize,
        already: bool,
        used_policy_bytes: usize,
    ) -> Result<(), QuotaError> {
        if !already
            && let Some(max) = self.max_guards
            && owned >= max
        {
            return Err(QuotaError::Guards {
                identity: self.identity.clone(),
                count: owned,
            });
        }
        let adding = policy_bytes(guard);
        let would = used_policy_bytes.saturating_add(adding);
        if adding > 0 && would > self.max_policy_bytes {
            return Err(QuotaError::PolicyBytes {
                identity: self.identity.clone(),
                used: used_policy_bytes,
                would,
                limit: self.max_policy_bytes,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open() -> Admission {
        Admission {
            default_timeout: Duration::from_secs(1),
            endpoint_policy: Arc::new(EndpointPolicy::new(&[], true).unwrap()),
        }
    }

    #[test]
    fn r16_admission_checks_the_spec_then_the_endpoint_policy() {
        let spec = |endpoint: &str| GuardSpec {
            name: " g ".into(),
            endpoint: endpoint.into(),
            ..Default::default()
        };
        let checked = admit_blocking(spec("127.0.0.1:9"), &open()).unwrap();
        assert_eq!(checked.name(), "g");
        assert_eq!(checked.stored().name, "g", "stored under its trimmed name");
        assert_eq!(checked.stored().endpoint, "127.0.0.1:9", "stored as given");
        let err = admit_blocking(spec("http://169.254.169.254:80"), &open()).unwrap_err();
        assert!(matches!(err, AdmitError::Endpoint { .. }), "{err}");
        assert!(err.to_string().contains("endpoint policy"), "{err}");
        let err = admit_blocking(spec("ftp://x:1"), &open()).unwrap_err();
        assert!(matches!(err, AdmitError::Invalid(_)), "{err}");
    }

    #[test]
    fn r25_owner_counts_guards_and_policy_bytes() {
        let owner = Owner {
            identity: "team".into(),
            max_guards: Some(2),
            max_policy_bytes: 100,
        };
        let remote = Guard::from_spec(
            &GuardSpec {
                name: "r".into(),
                endpoint: "127.0.0.1:1".into(),
                ..Default::default()
            },
            Duration::from_secs(1),
        )
        .unwrap();
        assert!(owner.admits(&remote, 1, false, 0).is_ok());
        assert_eq!(
            owner.admits(&remote, 2, false, 0).unwrap_err().to_string(),
            "team already registered 2 guards, its limit"
        );
        assert!(owner.admits(&remote, 2, true, 0).is_ok(), "an update");
        let policy = Guard::from_spec(
            &GuardSpec {
                name: "p".into(),
                policy: "[[rule]]\nname = \"r\"\nwhen = \"true\"\naction = \"cancel\"\nmessage = '\"no\"'\n"
                    .into(),
                ..Default::default()
            },
            Duration::from_secs(1),
        )
        .unwrap();
        let bytes = policy_bytes(&policy);
        assert!(bytes > 0);
        let tight = Owner {
            max_policy_bytes: bytes + 10,
            ..owner.clone()
        };
        assert!(tight.admits(&policy, 0, false, 10).is_ok());
        let err = tight.admits(&policy, 0, false, 11).unwrap_err().to_string();
        assert!(
            err.contains("max_policy_bytes_per_identity") && err.contains("hold 11 bytes"),
            "{err}"
        );
        assert!(
            tight.admits(&remote, 0, false, 1 << 30).is_ok(),
            "no policy"
        );
    }
}
