//! Why the registry could not start, why an etcd request failed, and why
//! a stored registration cannot be read back as a guard.

use std::time::Duration;

/// Why the registry could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("invalid etcd registry settings: {0}")]
    Config(String),
    #[error("invalid etcd registry settings: [registry] {0}")]
    Tls(#[from] crate::etcd_tls::EtcdTlsError),
    #[error("cannot reach etcd at {endpoints}: {cause}")]
    Unreachable { endpoints: String, cause: String },
}

/// Why an etcd request failed; `what` names the request.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// etcd answered with an error that a retry only repeats.
    #[error("{what}: {source}")]
    Refused {
        what: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// One attempt, and no answer within its deadline.
    #[error("{what}: no answer within {timeout:?}")]
    Timeout {
        what: &'static str,
        timeout: Duration,
    },
    /// Retried until the deadline; `last` is the last attempt's failure.
    #[error("{what}: {last} ({attempts} attempt(s) within {timeout:?})")]
    Exhausted {
        what: &'static str,
        last: Attempt,
        attempts: u32,
        timeout: Duration,
    },
}

/// How one attempt of a retried request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Attempt {
    /// etcd refused the auth token (a new one is being fetched).
    #[error("{0}")]
    Unauthenticated(tonic::Status),
    #[error("{0}")]
    Etcd(etcd_client::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// Why a stored registration cannot be read back as a guard.
#[derive(Debug, thiserror::Error)]
pub(super) enum StoredError {
    #[error("not a GuardSpec: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("{0}")]
    Invalid(#[from] crate::registry::spec::SpecError),
    #[error("stored under {key:?} but names itself {name:?}")]
    Misnamed { key: String, name: String },
}
