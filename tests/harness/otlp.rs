//! An OTLP/gRPC collector on loopback: the spans and log records a mesh
//! (or this process's exporter) sends it.

use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{
    LogsService, LogsServiceServer,
};
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsServiceRequest, ExportLogsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::logs::v1::LogRecord;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

/// What a collector received.
#[derive(Default, Clone)]
pub(crate) struct Collector {
    pub spans: Arc<Mutex<Vec<Span>>>,
    pub logs: Arc<Mutex<Vec<LogRecord>>>,
}

impl Collector {
    /// Serves both the trace and the logs services on a loopback port, until
    /// the test's runtime ends: the collector and its `http://` endpoint.
    pub(crate) async fn serve() -> (Self, String) {
        let collector = Self::default();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn({
            let collector = collector.clone();
            async move {
                tonic::transport::Server::builder()
                    .add_service(TraceServiceServer::new(collector.clone()))
                    .add_service(LogsServiceServer::new(collector))
                    .serve_with_incoming(TcpListenerStream::new(listener))
                    .await
                    .unwrap();
            }
        });
        (collector, endpoint)
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let resources = request.into_inner().resource_spans;
        let spans = resources.into_iter().flat_map(|r| r.scope_spans);
        kept(&self.spans, spans.flat_map(|s| s.spans))
    }
}

#[tonic::async_trait]
impl LogsService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportLogsServiceRequest>,
    ) -> Result<tonic::Response<ExportLogsServiceResponse>, tonic::Status> {
        let resources = request.into_inner().resource_logs;
        let logs = resources.into_iter().flat_map(|r| r.scope_logs);
        kept(&self.logs, logs.flat_map(|s| s.log_records))
    }
}

/// Keeps `items` in `store`, and answers the export as fully accepted.
fn kept<T, R: Default>(
    store: &Mutex<Vec<T>>,
    items: impl IntoIterator<Item = T>,
) -> Result<tonic::Response<R>, tonic::Status> {
    store.lock().unwrap().extend(items);
    Ok(tonic::Response::new(R::default()))
}
