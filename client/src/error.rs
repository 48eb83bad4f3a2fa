//! Errors of the SDK.

use std::error::Error as StdError;

/// What went wrong talking to a mesh. Its `Display` names the address and
/// the cause, e.g. `cannot connect to http://127.0.0.1:1: connection
/// refused`.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address is not a usable `host:port` or URL.
    #[error("invalid mesh address {address:?}: {reason}")]
    Address {
        /// The address as given.
        address: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The mesh could not be reached at `address`.
    #[error("cannot connect to {address}: {}", cause(source))]
    Connect {
        /// The URL dialed (after [`crate::connect::url`]).
        address: String,
        /// The transport's error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The mesh refused the batch or the call (R20), or aborted it (R13).
    #[error("mesh answered {:?}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    /// The session's stream ended, and could not be opened again, before
    /// the batch was sent.
    #[error("the session stream ended before batch {0:?} was answered")]
    SessionClosed(String),
    /// The batch was in flight when the session's stream to the mesh
    /// ended (the mesh restarted or the connection was cut): no decision
    /// came back, so none of its calls may run. Evaluate it again: the
    /// [`Session`](crate::Session) opens a new stream for the next batch.
    #[error(
        "batch {batch_id:?} was not judged: the session's stream to the mesh ended{} before its \
         decision came; run none of its calls and evaluate it again (the session reopens its stream)",
        status.as_ref().map(|s| format!(" ({:?}: {})", s.code(), s.message())).unwrap_or_default()
    )]
    NotJudged {
        /// The batch's id.
        batch_id: String,
        /// How the stream ended, when the mesh or the transport said.
        status: Option<tonic::Status>,
    },
    /// The mesh sent something this SDK cannot read.
    #[error("malformed answer from the mesh: {0}")]
    Protocol(String),
    /// A call's arguments are not what a call carries (a JSON object), or
    /// do not read as the type asked for.
    #[error("call {call_id:?}: arguments: {reason}")]
    Arguments {
        /// The call's id.
        call_id: String,
        /// What is wrong with them.
        reason: String,
    },
    /// Arguments given as JSON could not be encoded.
    #[error("arguments are not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

impl ClientError {
    /// The gRPC code, when the mesh answered with one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Self::Status(status) => Some(status.code()),
            Self::NotJudged { status, .. } => status.as_ref().map(tonic::Status::code),
            _ => None,
        }
    }

    /// Whether the batch went unjudged because its stream ended
    /// ([`ClientError::NotJudged`], [`ClientError::SessionClosed`]): none
    /// of its calls may run, and evaluating it again may succeed.
    pub fn not_judged(&self) -> bool {
        matches!(self, Self::NotJudged { .. } | Self::SessionClosed(_))
    }

    /// Whether the mesh could not be reached at all (as opposed to answering
    /// with an error).
    pub fn is_connect(&self) -> bool {
        matches!(self, Self::Connect { .. })
    }
}

/// The root cause of a transport error, in words: the innermost I/O error's
/// kind (`connection refused`, `timed out`, ...) when there is one, else the
/// innermost error's message. tonic's own message ("transport error") says
/// nothing about why.
pub(crate) fn cause(error: &tonic::transport::Error) -> String {
    let mut innermost: &(dyn StdError + 'static) = error;
    let mut io_kind = None;
    let mut next = Some(innermost);
    while let Some(current) = next {
        innermost = current;
        if let Some(io) = current.downcast_ref::<std::io::Error>() {
            io_kind = Some(io.kind());
        }
        next = current.source();
    }
    match io_kind {
        Some(kind) if kind != std::io::ErrorKind::Other => kind.to_string(),
        _ => innermost.to_string(),
    }
}
