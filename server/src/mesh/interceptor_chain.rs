//! The chain seen as MCP interceptors (SEP-2624), for an MCP gateway that
//! speaks the interceptor extension: the guards as interceptor
//! descriptors ([`Mesh::interceptors`]), and one guard run alone on one
//! call or one result ([`Mesh::invoke_interceptor`]).
//!
//! An invocation is a dry computation: it is judged as a batch is,
//! through the same pipeline as every other door (the same admission
//! checks, R20, R25; the same fold, R3-R5, R13, R14; the same record, R29),
//! by a chain holding the named guard alone, in enforce mode whatever its
//! registered mode (what it *would* decide is the point of invoking it).
//! The session's memory is read for the policy rules that need it, never
//! written: nothing ran.

use super::Mesh;
use super::pipeline::{Arrival, Door, Inbound, Judges};
use crate::judge::{Chain, ChainGuard};
use guardmesh_proto::v1::{
    BatchDecision, EvaluateRequest, GuardMode, InterceptorDescriptor, InterceptorListResponse,
};
use std::sync::Arc;

/// Longest event filter of a list, in bytes.
pub const MAX_EVENT_FILTER_BYTES: usize = 128;

/// The event a guard hooks when it registered none.
pub const DEFAULT_EVENT: &str = "tools/call";

/// Why an invocation got no decision.
#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    /// No guard of the chain has that name.
    #[error("no guard named {0:?} in the chain")]
    UnknownGuard(String),
    /// The request is not one call or one result.
    #[error("{0}")]
    BadRequest(String),
    /// The guard does not judge the phase asked for (R33).
    #[error("guard {guard:?} does not judge {phase}")]
    WrongPhase { guard: String, phase: &'static str },
    /// Refused or aborted as a batch would be: the status it is answered
    /// with.
    #[error("{}", .0.message())]
    Status(tonic::Status),
}

impl InvokeError {
    /// The gRPC status the caller gets.
    pub fn status(&self) -> tonic::Status {
        match self {
            Self::UnknownGuard(_) => tonic::Status::not_found(self.to_string()),
            Self::BadRequest(_) => tonic::Status::invalid_argument(self.to_string()),
            Self::WrongPhase { .. } => tonic::Status::failed_precondition(self.to_string()),
            Self::Status(status) => status.clone(),
        }
    }
}

/// Whether a guard hooking `events` hooks `event` (`*` hooks every one).
pub fn hooks(events: &[String], event: &str) -> bool {
    if events.is_empty() {
        return event == DEFAULT_EVENT;
    }
    events.iter().any(|e| e == "*" || e == event)
}

impl Mesh {
    /// The chain's guards as interceptors, in chain order; with `event`,
    /// only those hooking it.
    pub fn interceptors(&self, event: Option<&str>) -> InterceptorListResponse {
        let chain = self.chain();
        InterceptorListResponse {
            revision: chain.revision,
            interceptors: chain
                .guards
                .iter()
                .map(|g| &g.guard)
                .filter(|g| event.is_none_or(|e| hooks(&g.interceptor_events, e)))
                .map(|g| InterceptorDescriptor {
                    name: g.name.clone(),
                    role: g.role as i32,
                    phases: g.phases as i32,
                    events: if g.interceptor_events.is_empty() {
                        vec![DEFAULT_EVENT.to_owned()]
                    } else {
                        g.interceptor_events.clone()
                    },
                    mode: g.mode as i32,
                    priority: g.priority,
                    failure_policy: g.failure_policy as i32,
                })
                .collect(),
        }
    }

    /// Runs the guard `name` alone on the one call or one result of
    /// `request`, as a batch through the one pipeline (`pipeline.rs`): see
    /// the module's documentation. `door`: what the invoke's transport
    /// knows; its `judges` is set here.
    pub(crate) async fn invoke_interceptor(
        &self,
        name: &str,
        request: EvaluateRequest,
        mut door: Door<'_>,
    ) -> Result<BatchDecision, InvokeError> {
        let items = request.calls.len() + request.results.len();
        if items != 1 {
            return Err(InvokeError::BadRequest(format!(
                "an invocation judges exactly one call or one result; this one has {} calls \
                 and {} results",
                request.calls.len(),
                request.results.len()
            )));
        }
        let whole = self.chain();
        let Some(found) = whole.guards.iter().find(|g| g.guard.name == name) else {
            let shown: String = name.chars().take(128).collect();
            return Err(InvokeError::UnknownGuard(shown));
        };
        let (reaches, phase_name) = if request.results.is_empty() {
            (found.guard.judges_calls(), "calls")
        } else {
            (found.guard.judges_results(), "results")
        };
        if !reaches {
            return Err(InvokeError::WrongPhase {
                guard: name.to_owned(),
                phase: phase_name,
            });
        }
        let mut guard = (*found.guard).clone();
        guard.mode = GuardMode::Enforce;
        door.judges = Judges::Alone(Arc::new(Chain {
            revision: whole.revision,
            guards: vec![ChainGuard {
                guard: Arc::new(guard),
                link: found.link.clone(),
            }],
            spec: whole.spec.clone(),
        }));
        let inbound = Inbound::from_request(request, &self.config.limits);
        match self.arrive(inbound, door) {
            Arrival::Admitted(admitted) => admitted.run(self).await.map_err(InvokeError::Status),
            Arrival::Refused(refused) => Err(InvokeError::Status(refused.status().await)),
        }
    }
}
