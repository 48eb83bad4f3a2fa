//! `guardmesh mcp stdio|http --config MESH_TOML`: the gateway judges with a
//! mesh built in its own process from the config `guardmesh serve` reads,
//! instead of reaching one over gRPC (see docs/mcp-and-hooks.md).

use guardmesh_client::proto::{AlwaysSkippedResponse, BatchDecision, EvaluateRequest};
use guardmesh_gateway::{LocalMesh, MeshLoader};
use guardmesh_server::run::{InProcess, Server};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// The loader the gateway calls with `--config`'s path; `source` names the
/// gateway (`mcp-stdio`, `mcp-http`) in the decision log.
pub(crate) fn loader(source: &'static str) -> MeshLoader {
    Box::new(move |path| {
        Box::pin(async move {
            let server = Server::load(&path).await.map_err(chain)?;
            let mesh = server
                .in_process(&format!("in-process:{source}"), source)
                .await
                .map_err(chain)?;
            Ok(Arc::new(Embedded(mesh)) as Arc<dyn LocalMesh>)
        })
    })
}

/// A server error with its causes.
fn chain(error: guardmesh_server::run::ServerError) -> String {
    guardmesh_server::error_chain(&error)
}

/// The server's in-process mesh as the gateway asks for it.
struct Embedded(InProcess);

type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl LocalMesh for Embedded {
    fn evaluate(
        &self,
        request: EvaluateRequest,
    ) -> Boxed<'_, Result<BatchDecision, tonic::Status>> {
        Box::pin(self.0.evaluate(request))
    }

    fn always_skipped(
        &self,
        tools: Vec<String>,
    ) -> Boxed<'_, Result<AlwaysSkippedResponse, tonic::Status>> {
        Box::pin(std::future::ready(self.0.always_skipped(&tools)))
    }

    fn close(&self) -> Boxed<'_, ()> {
        Box::pin(self.0.close())
    }
}
