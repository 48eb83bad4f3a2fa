//! Errors of the SDK.

/// What went wrong talking to a mesh.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The mesh could not be reached.
    #[error("cannot connect to the mesh: {0}")]
    Connect(#[from] tonic::transport::Error),
    /// The mesh refused the batch or the call (R20), or aborted it (R13).
    #[error("mesh answered {:?}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    /// The session's stream ended before the batch was answered.
    #[error("the session stream ended before batch {0:?} was answered")]
    SessionClosed(String),
    /// The mesh sent something this SDK cannot read.
    #[error("malformed answer from the mesh: {0}")]
    Protocol(String),
    /// Arguments given as JSON could not be encoded.
    #[error("arguments are not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

impl ClientError {
    /// The gRPC code, when the mesh answered with one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Self::Status(status) => Some(status.code()),
            _ => None,
        }
    }
}
