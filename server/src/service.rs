//! The gRPC services of the mesh: `PreToolService` for coordinators and
//! `GuardRegistry` for registrars.

use crate::auth::{Caller, Role};
use crate::batch::TraceContext;
use crate::mesh::Mesh;
use crate::registry::RegistryError;
use guardmesh_proto::v1::guard_registry_server::GuardRegistry;
use guardmesh_proto::v1::pre_tool_service_server::PreToolService;
use guardmesh_proto::v1::{
    BatchDecision, DeregisterRequest, DeregisterResponse, EvaluateRequest, EvaluateResponse,
    ListRequest, ListResponse, RegisterRequest, RegisterResponse, evaluate_response,
};
use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

/// Reads W3C trace context from request metadata (R22).
pub fn trace_context(metadata: &MetadataMap) -> TraceContext {
    let get = |key: &str| {
        metadata
            .get(key)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    };
    TraceContext::from_w3c(get("traceparent"), get("tracestate"))
}

/// The batch's own trace context when it carries one, else the stream's.
fn batch_trace(batch: &EvaluateRequest, stream: &TraceContext) -> TraceContext {
    if batch.traceparent.is_empty() {
        stream.clone()
    } else {
        let own = TraceContext::from_w3c(&batch.traceparent, &batch.tracestate);
        if own.trace_id.is_empty() {
            stream.clone()
        } else {
            own
        }
    }
}

/// Parses a `grpc-timeout` header (`<digits><H|M|S|m|u|n>`).
pub fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// `PreToolService`.
#[derive(Debug, Clone)]
pub struct PreTool {
    mesh: Arc<Mesh>,
    draining: watch::Receiver<bool>,
}

impl PreTool {
    /// `draining` turns true when the server shuts down: open streams stop
    /// taking batches, finish the ones in flight, and end cleanly.
    pub fn new(mesh: Arc<Mesh>, draining: watch::Receiver<bool>) -> Self {
        Self { mesh, draining }
    }

    fn deadline(&self, timeout_ms: u32, transport: Option<Duration>) -> Instant {
        let config = &self.mesh.config;
        // A transport deadline is the client's: answer a little before it,
        // so that a guard timing out still yields a decision the client can
        // read rather than its own DEADLINE_EXCEEDED.
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
impl PreToolService for PreTool {
    type EvaluateStream = ReceiverStream<Result<EvaluateResponse, Status>>;

    async fn evaluate(
        &self,
        request: Request<Streaming<EvaluateRequest>>,
    ) -> Result<Response<Self::EvaluateStream>, Status> {
        let trace = trace_context(request.metadata());
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        tokio::spawn(async move {
            let in_flight: Arc<Mutex<HashSet<String>>> = Arc::default();
            let mut tasks = JoinSet::new();
            let mut draining = this.draining.clone();
            let mut stream_error = None;
            loop {
                tokio::select! {
                    message = inbound.message() => match message {
                        Ok(Some(batch)) => {
                            this.spawn_batch(&mut tasks, batch, &trace, &tx, &in_flight);
                        }
                        Ok(None) => break,
                        Err(status) => {
                            // The stream cannot be read further (e.g. a
                            // message above the transport limit). Answer what
                            // is in flight, then tell the coordinator why.
                            tracing::info!(%status, "coordinator stream ended with an error");
                            stream_error = Some(transport_status(status));
                            break;
                        }
                    },
                    Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                    () = tx.closed() => {
                        // The coordinator went away: nobody reads the answers.
                        tasks.abort_all();
                        return;
                    }
                    _ = draining.wait_for(|draining| *draining) => {
                        tracing::debug!("draining: no new batches on this stream");
                        break;
                    }
                }
            }
            while tasks.join_next().await.is_some() {}
            if let Some(status) = stream_error {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn evaluate_batch(
        &self,
        request: Request<EvaluateRequest>,
    ) -> Result<Response<BatchDecision>, Status> {
        let stream_trace = trace_context(request.metadata());
        let transport = grpc_timeout(request.metadata());
        let batch = request.into_inner();
        let mut trace = batch_trace(&batch, &stream_trace);
        trace.unary = true;
        let deadline = self.deadline(batch.timeout_ms, transport);
        match self.mesh.evaluate(batch, deadline, trace).await {
            Ok(decision) => Ok(Response::new(decision)),
            Err(error) => Err(error.status()),
        }
    }
}

impl PreTool {
    fn spawn_batch(
        &self,
        tasks: &mut JoinSet<()>,
        batch: EvaluateRequest,
        trace: &TraceContext,
        tx: &mpsc::Sender<Result<EvaluateResponse, Status>>,
        in_flight: &Arc<Mutex<HashSet<String>>>,
    ) {
        let batch_id = batch.batch_id.clone();
        let duplicate = !in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(batch_id.clone());
        let tx = tx.clone();
        let limit = self.mesh.config.limits.max_batches_per_stream;
        if !duplicate && tasks.len() >= limit {
            in_flight
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&batch_id);
            self.mesh.metrics.refused("stream_overloaded");
            tasks.spawn(async move {
                let error = Status::resource_exhausted(format!(
                    "{limit} batches already in flight on this stream; wait for answers"
                ));
                let _ = tx.send(Ok(error_response(batch_id, &error))).await;
            });
            return;
        }
        if duplicate {
            self.mesh.metrics.refused("duplicate_batch_id");
            tasks.spawn(async move {
                let error = Status::invalid_argument(format!(
                    "batch_id {batch_id:?} is already in flight on this stream"
                ));
                let _ = tx.send(Ok(error_response(batch_id, &error))).await;
            });
            return;
        }
        let mesh = self.mesh.clone();
        let deadline = self.deadline(batch.timeout_ms, None);
        let trace = batch_trace(&batch, trace);
        let in_flight = in_flight.clone();
        tasks.spawn(async move {
            let result = mesh.evaluate(batch, deadline, trace).await;
            in_flight
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&batch_id);
            let response = match result {
                Ok(decision) => EvaluateResponse {
                    batch_id,
                    result: Some(evaluate_response::Result::Decision(decision)),
                },
                Err(error) => error_response(batch_id, &error.status()),
            };
            let _ = tx.send(Ok(response)).await;
        });
    }
}

/// The status to end a stream with after a read error. The transport
/// reports an over-limit message as OUT_OF_RANGE; to the coordinator it is
/// RESOURCE_EXHAUSTED like every other size limit (R20).
fn transport_status(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange {
        Status::resource_exhausted(format!(
            "a message on this stream exceeds the mesh's transport limit and cannot be read: {}",
            status.message()
        ))
    } else {
        status
    }
}

fn error_response(batch_id: String, status: &Status) -> EvaluateResponse {
    EvaluateResponse {
        batch_id,
        result: Some(evaluate_response::Result::Error(
            guardmesh_proto::v1::BatchError {
                code: status.code() as i32,
                message: status.message().to_owned(),
            },
        )),
    }
}

/// `GuardRegistry`.
#[derive(Debug, Clone)]
pub struct Registrar {
    mesh: Arc<Mesh>,
    /// Guards registered through this mesh, by the identity that did it
    /// (for per-identity registration limits).
    owned: Arc<Mutex<std::collections::HashMap<String, HashSet<String>>>>,
}

impl Registrar {
    pub fn new(mesh: Arc<Mesh>) -> Self {
        Self {
            mesh,
            owned: Arc::default(),
        }
    }

    /// Checks what an authenticated caller may do with guard `name`; open
    /// when authentication is off.
    fn authorize<T>(&self, request: &Request<T>, name: &str) -> Result<Option<Caller>, Status> {
        let Some(caller) = request.extensions().get::<Caller>().cloned() else {
            return Ok(None);
        };
        if !caller.may_manage(name) {
            self.mesh
                .metrics
                .auth_refused(tonic::Code::PermissionDenied);
            tracing::warn!(identity = %caller.id, guard = %name, "registration refused: name outside the caller's prefixes");
            return Err(Status::permission_denied(format!(
                "{} may only manage guards named {}",
                caller.id,
                caller.name_prefixes.join(" or ")
            )));
        }
        Ok(Some(caller))
    }
}

fn registry_status(error: RegistryError) -> Status {
    match error {
        RegistryError::Invalid(e) => Status::invalid_argument(e.to_string()),
        RegistryError::Unavailable(e) => Status::unavailable(e),
    }
}

#[tonic::async_trait]
impl GuardRegistry for Registrar {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let Some(spec) = request.get_ref().guard.clone() else {
            return Err(Status::invalid_argument("RegisterRequest.guard is missing"));
        };
        let name = spec.name.clone();
        let caller = self.authorize(&request, &name)?;
        // The endpoint policy: no registration may point the mesh at a
        // metadata service or outside the allow-list (checked again after
        // DNS resolution when dialing).
        let checked = crate::spec::Guard::from_spec(&spec, self.mesh.config.default_guard_timeout)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if let Err(why) = self
            .mesh
            .config
            .security
            .endpoint_policy
            .check_host(&checked.host())
        {
            tracing::warn!(guard = %name, endpoint = %checked.endpoint, "registration refused: {why}");
            return Err(Status::permission_denied(format!(
                "guard {name:?}: endpoint {} refused by the endpoint policy: {why}",
                checked.endpoint
            )));
        }
        if let Some(caller) = &caller
            && !caller.roles.contains(&Role::Admin)
        {
            let owned = self.owned.lock().unwrap_or_else(PoisonError::into_inner);
            let count = owned.get(&caller.id).map_or(0, |s| s.len());
            let already = owned.get(&caller.id).is_some_and(|s| s.contains(&name));
            if !already && count >= caller.max_registrations {
                return Err(Status::resource_exhausted(format!(
                    "{} already registered {count} guards, its limit",
                    caller.id
                )));
            }
        }
        let out = self
            .mesh
            .registry()
            .register(spec)
            .await
            .map_err(registry_status)?;
        if let Some(caller) = &caller {
            self.owned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(caller.id.clone())
                .or_default()
                .insert(name.clone());
        }
        // Start dialing the guard now rather than on its first batch.
        let _ = self.mesh.chain();
        tracing::info!(guard = %name, revision = out.revision, position = out.position, created = out.created, "guard registered");
        Ok(Response::new(RegisterResponse {
            revision: out.revision,
            position: u32::try_from(out.position).unwrap_or(u32::MAX),
            created: out.created,
        }))
    }

    async fn deregister(
        &self,
        request: Request<DeregisterRequest>,
    ) -> Result<Response<DeregisterResponse>, Status> {
        let name = request.get_ref().name.clone();
        self.authorize(&request, &name)?;
        let out = self
            .mesh
            .registry()
            .deregister(name.clone())
            .await
            .map_err(registry_status)?;
        let _ = self.mesh.chain();
        for names in self
            .owned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values_mut()
        {
            names.remove(&name);
        }
        tracing::info!(guard = %name, revision = out.revision, removed = out.removed, "guard deregistered");
        Ok(Response::new(DeregisterResponse {
            revision: out.revision,
            removed: out.removed,
        }))
    }

    async fn list(&self, _request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let chain = self.mesh.registry().chain();
        Ok(Response::new(ListResponse {
            revision: chain.revision,
            guards: chain.guards.iter().map(|g| g.to_spec()).collect(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r14_grpc_timeout_header() {
        let mut m = MetadataMap::new();
        m.insert("grpc-timeout", "250m".parse().unwrap());
        assert_eq!(grpc_timeout(&m), Some(Duration::from_millis(250)));
        m.insert("grpc-timeout", "3S".parse().unwrap());
        assert_eq!(grpc_timeout(&m), Some(Duration::from_secs(3)));
        m.insert("grpc-timeout", "x".parse().unwrap());
        assert_eq!(grpc_timeout(&m), None);
    }
}
