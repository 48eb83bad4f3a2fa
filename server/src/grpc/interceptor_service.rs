//! `InterceptorService`: the chain as MCP interceptors (SEP-2624), for an
//! MCP gateway speaking the interceptor extension. See
//! [`crate::mesh::interceptor_chain`].

use crate::grpc::service::RequestDoor;
use crate::mesh::Mesh;
use crate::mesh::interceptor_chain::MAX_EVENT_FILTER_BYTES;
use guardmesh_proto::v1::interceptor_service_server::InterceptorService;
use guardmesh_proto::v1::{
    InterceptorInvokeRequest, InterceptorInvokeResponse, InterceptorListRequest,
    InterceptorListResponse,
};
use std::sync::Arc;
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
        let door = RequestDoor::read(&self.mesh, &request);
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
        let decision = self
            .mesh
            .invoke_interceptor(&name, batch, door.unary())
            .await
            .map_err(|error| error.status())?;
        Ok(Response::new(InterceptorInvokeResponse {
            decision: Some(decision),
        }))
    }
}
