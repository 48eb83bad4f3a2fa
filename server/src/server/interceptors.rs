//! `InterceptorService`: the chain as MCP interceptors (SEP-2624), for an
//! MCP gateway speaking the interceptor extension. See
//! [`crate::mesh::interceptors`].

use crate::judge::TraceContext;
use crate::mesh::Mesh;
use crate::mesh::interceptors::MAX_EVENT_FILTER_BYTES;
use crate::security::auth::Caller;
use crate::server::service::{grpc_timeout, trace_context};
use guardmesh_proto::v1::interceptor_service_server::InterceptorService;
use guardmesh_proto::v1::{
    InterceptorInvokeRequest, InterceptorInvokeResponse, InterceptorListRequest,
    InterceptorListResponse,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

/// Longest guard name an invocation may name, in bytes (names are at most
/// 128 bytes: anything longer names no guard).
const MAX_NAME_BYTES: usize = 128;

#[derive(Debug, Clone)]
pub(crate) struct Interceptors {
    mesh: Arc<Mesh>,
}

impl Interceptors {
    pub(crate) fn new(mesh: Arc<Mesh>) -> Self {
        Self { mesh }
    }

    /// The invocation's deadline: the batch's `timeout_ms` or the
    /// transport's, capped by the mesh's maximum (R14).
    fn deadline(&self, timeout_ms: u32, transport: Option<Duration>) -> Instant {
        let config = &self.mesh.config;
        let transport = transport.map(|t| t.saturating_sub((t / 20).max(Duration::from_millis(5))));
        let asked = match (timeout_ms, transport) {
            (0, None) => config.default_batch_timeout,
            (0, Some(t)) => t,
            (ms, None) => Duration::from_millis(u64::from(ms)),
            (ms, Some(t)) => Duration::from_millis(u64::from(ms)).min(t),
        };
        Instant::now() + asked.min(config.max_batch_timeout)
    }
}

#[tonic::async_trait]
impl InterceptorService for Interceptors {
    async fn list(
        &self,
        request: Request<InterceptorListRequest>,
    ) -> Result<Response<InterceptorListResponse>, Status> {
        let event = request.into_inner().event;
        if event.len() > MAX_EVENT_FILTER_BYTES {
            return Err(Status::invalid_argument(format!(
                "event filter is {} bytes, over {MAX_EVENT_FILTER_BYTES}",
                event.len()
            )));
        }
        let filter = (!event.is_empty()).then_some(event.as_str());
        Ok(Response::new(self.mesh.interceptors(filter)))
    }

    async fn invoke(
        &self,
        request: Request<InterceptorInvokeRequest>,
    ) -> Result<Response<InterceptorInvokeResponse>, Status> {
        let mut trace: TraceContext = trace_context(request.metadata());
        let caller = request.extensions().get::<Caller>().map(|c| c.id.clone());
        trace.caller = caller.as_deref().map(Arc::from);
        trace.identity = Arc::from(caller.as_deref().unwrap_or_default());
        trace.unary = true;
        let transport = grpc_timeout(request.metadata());
        let InterceptorInvokeRequest { name, batch } = request.into_inner();
        if name.is_empty() || name.len() > MAX_NAME_BYTES {
            return Err(Status::not_found(format!(
                "no guard named {:?} in the chain (a name is 1 to {MAX_NAME_BYTES} bytes)",
                name.chars().take(64).collect::<String>()
            )));
        }
        let Some(batch) = batch else {
            return Err(Status::invalid_argument(
                "`batch` is missing: an invocation judges one call or one result",
            ));
        };
        let deadline = self.deadline(batch.timeout_ms, transport);
        let decision = self
            .mesh
            .invoke_interceptor(&name, batch, deadline, trace)
            .await
            .map_err(|error| error.status())?;
        Ok(Response::new(InterceptorInvokeResponse {
            decision: Some(decision),
        }))
    }
}
