//! `guardmesh mcp http`: the gateway in front of a Streamable HTTP MCP
//! server (POST and GET on one endpoint, `Mcp-Session-Id`, JSON or SSE
//! responses).
//!
//! * A POST whose body holds no `tools/call` is forwarded in the gateway's
//!   serialization of what it read ([`crate::json`]; a body it cannot read
//!   alike to every peer is refused, R31), and the upstream's answer (JSON
//!   or an SSE stream) streams back unchanged.
//!   GET (the server's SSE stream), DELETE (session end) and any other
//!   method are forwarded the same way.
//! * A POST with one `tools/call`: judged (R31) with the request's
//!   `Mcp-Session-Id` as the batch's session (one made per request when the
//!   client has none, as in the stateless revision); concurrent ones of one
//!   session within `--batch-window-ms` are one guard batch
//!   ([`crate::group`]). Proceed forwards the
//!   final call and streams the upstream's answer back; steer, cancel and
//!   errors are answered by the gateway as `application/json`.
//! * A JSON-RPC batch with `tools/call`s: one guard batch. A batch with an
//!   element the gateway cannot judge is refused whole. Forwarded elements
//!   are posted one by one; the answer is one JSON array of the gateway's
//!   answers and the upstream's responses (read from JSON or SSE bodies).
//! * With `--tls-cert` and `--tls-key` (PEM) the gateway serves HTTPS
//!   (rustls, HTTP/1.1). Without them only loopback listen addresses are
//!   served: a non-loopback address is refused, so that tool calls and
//!   their session ids never cross a network in clear text.

use crate::jsonrpc::{self, Incoming, Item, ToolCallRequest, codes};
use crate::judge::{Disposition, Judge, MeshArgs};
use crate::stdio::fresh_session_id;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming as Body;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rmcp::model::ErrorData;
use std::sync::Arc;

/// `guardmesh mcp http`.
#[derive(clap::Args, Debug, Clone)]
pub struct HttpArgs {
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// Address to serve on. A non-loopback address needs `--tls-cert` and
    /// `--tls-key`.
    #[arg(long, default_value = "127.0.0.1:8808")]
    pub listen: std::net::SocketAddr,
    /// Serve HTTPS with this certificate chain (PEM, leaf first).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key of `--tls-cert` (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// The upstream MCP server's Streamable HTTP endpoint (`http://`).
    #[arg(long)]
    pub upstream: String,
    /// Largest request body accepted from a client, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_message_bytes: usize,
    /// Single tools/call requests of one MCP session arriving within this
    /// many milliseconds of each other are judged as one guard batch (each
    /// still answered on its own request); 0 judges each on its own.
    #[arg(long, default_value_t = 2)]
    pub batch_window_ms: u64,
}

type Out = BoxBody<Bytes, hyper::Error>;

struct Proxy {
    upstream: Uri,
    client: Client<HttpConnector, Out>,
    judge: Arc<Judge>,
    grouper: crate::group::Grouper,
    max: usize,
}

fn full(bytes: impl Into<Bytes>) -> Out {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

fn json_response(status: StatusCode, body: String) -> Response<Out> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(
    status: StatusCode,
    id: Option<&serde_json::value::RawValue>,
    e: &ErrorData,
) -> Response<Out> {
    json_response(status, jsonrpc::error(id, e))
}

/// Headers that belong to one connection, not to the message.
fn hop_by_hop(name: &header::HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "transfer-encoding"
            | "te"
            | "upgrade"
            | "host"
            | "content-length"
            | "proxy-connection"
    )
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !hop_by_hop(name) {
            to.append(name.clone(), value.clone());
        }
    }
}

impl Proxy {
    /// Sends a request to the upstream with the client's headers.
    async fn send(
        &self,
        method: Method,
        headers: &HeaderMap,
        body: Out,
    ) -> Result<Response<Body>, String> {
        let mut request = Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = self.upstream.clone();
        copy_headers(headers, request.headers_mut());
        self.client
            .request(request)
            .await
            .map_err(|e| crate::judge::error_chain(&e))
    }

    /// Relays the upstream's answer as it streams.
    fn relay(response: Response<Body>) -> Response<Out> {
        let (parts, body) = response.into_parts();
        let mut out = Response::new(body.boxed());
        *out.status_mut() = parts.status;
        copy_headers(&parts.headers, out.headers_mut());
        if let Some(length) = parts.headers.get(header::CONTENT_LENGTH) {
            out.headers_mut()
                .insert(header::CONTENT_LENGTH, length.clone());
        }
        out
    }

    fn bad_gateway(why: String) -> Response<Out> {
        let data = ErrorData::new(
            codes::INTERNAL_ERROR_UPSTREAM,
            format!("guardmesh: the upstream MCP server cannot be reached: {why}"),
            None,
        );
        error_response(StatusCode::BAD_GATEWAY, None, &data)
    }

    async fn forward(&self, method: Method, headers: &HeaderMap, body: Out) -> Response<Out> {
        match self.send(method, headers, body).await {
            Ok(response) => Self::relay(response),
            Err(why) => Self::bad_gateway(why),
        }
    }

    async fn handle(&self, request: Request<Body>) -> Response<Out> {
        let (parts, body) = request.into_parts();
        if parts.method != Method::POST {
            return self
                .forward(parts.method, &parts.headers, body.boxed())
                .await;
        }
        let bytes = match Limited::new(body, self.max).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(_) => {
                let data = ErrorData::new(
                    codes::TOO_LARGE,
                    format!("guardmesh: request body longer than {} bytes", self.max),
                    None,
                );
                return error_response(StatusCode::PAYLOAD_TOO_LARGE, None, &data);
            }
        };
        let session = parts
            .headers
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .unwrap_or_else(|| fresh_session_id("mcp-http"));
        let incoming = match jsonrpc::classify(&bytes) {
            Ok(incoming) => incoming,
            // Not JSON (400), or a batch refused whole (200: a JSON-RPC
            // error answer, as for a single message refused).
            Err(error) if error.code == codes::PARSE_ERROR => {
                return error_response(StatusCode::BAD_REQUEST, None, &error);
            }
            Err(error) => return error_response(StatusCode::OK, None, &error),
        };
        match incoming {
            Incoming::Single(Item::Forward { text, .. }) => {
                self.forward(parts.method, &parts.headers, full(text)).await
            }
            Incoming::Single(Item::Reject { id, error }) => {
                error_response(StatusCode::OK, id.as_deref(), &error)
            }
            Incoming::Single(Item::Drop(why)) => {
                tracing::warn!("{why}");
                let mut response = Response::new(full(Bytes::new()));
                *response.status_mut() = StatusCode::ACCEPTED;
                response
            }
            Incoming::Single(Item::ToolCall(call)) => {
                let call = *call;
                match self.grouper.judge_one(&session, call).await {
                    Disposition::Forward(text) => {
                        self.forward(parts.method, &parts.headers, full(text)).await
                    }
                    Disposition::Answer(text) => json_response(StatusCode::OK, text),
                }
            }
            Incoming::Batch(items) => {
                if !items.iter().any(|i| matches!(i, Item::ToolCall(_))) {
                    // Every element read and forwardable: the gateway's
                    // serialization of each, as one batch.
                    let texts: Vec<String> = items
                        .into_iter()
                        .filter_map(|item| match item {
                            Item::Forward { text, .. } => Some(text),
                            _ => None,
                        })
                        .collect();
                    let body = format!("[{}]", texts.join(","));
                    return self.forward(parts.method, &parts.headers, full(body)).await;
                }
                self.batch(items, &session, &parts.headers).await
            }
        }
    }

    /// A JSON-RPC batch holding tool calls: one guard batch, one array.
    async fn batch(&self, items: Vec<Item>, session: &str, headers: &HeaderMap) -> Response<Out> {
        let mut calls: Vec<ToolCallRequest> = Vec::new();
        let mut answers = Vec::new();
        let mut forwards = Vec::new();
        for item in items {
            match item {
                Item::ToolCall(call) => calls.push(*call),
                Item::Forward { text, .. } => forwards.push(text),
                Item::Reject { id, error } => answers.push(jsonrpc::error(id.as_deref(), &error)),
                Item::Drop(why) => tracing::warn!("{why}"),
            }
        }
        for disposition in self.judge.judge(session, &calls).await {
            match disposition {
                Disposition::Forward(text) => forwards.push(text),
                Disposition::Answer(text) => answers.push(text),
            }
        }
        for message in forwards {
            match self.send(Method::POST, headers, full(message)).await {
                Ok(response) => answers.extend(responses_of(response).await),
                Err(why) => return Self::bad_gateway(why),
            }
        }
        if answers.is_empty() {
            let mut response = Response::new(full(Bytes::new()));
            *response.status_mut() = StatusCode::ACCEPTED;
            return response;
        }
        json_response(StatusCode::OK, format!("[{}]", answers.join(",")))
    }
}

/// The JSON-RPC responses in an upstream answer: a JSON body (one message
/// or an array) or an SSE stream's `data:` events.
async fn responses_of(response: Response<Body>) -> Vec<String> {
    let sse = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let Ok(body) = response.into_body().collect().await else {
        return Vec::new();
    };
    let body = body.to_bytes();
    let texts: Vec<String> = if sse {
        String::from_utf8_lossy(&body)
            .split("\n\n")
            .filter_map(|event| {
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                (!data.is_empty()).then(|| data.join("\n"))
            })
            .collect()
    } else {
        vec![String::from_utf8_lossy(&body).into_owned()]
    };
    let mut out = Vec::new();
    for text in texts {
        match serde_json::from_str::<Vec<Box<serde_json::value::RawValue>>>(&text) {
            Ok(many) => out.extend(many.into_iter().map(|m| m.get().to_owned())),
            Err(_) => {
                if jsonrpc::response_key(text.as_bytes()).is_some() {
                    out.push(text);
                }
            }
        }
    }
    out
}

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error(
        "refusing to listen on {0}: not a loopback address, and no TLS is configured \
         (pass --tls-cert and --tls-key, or listen on 127.0.0.1)"
    )]
    NotLoopback(std::net::SocketAddr),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("--upstream {0:?} is not an http:// URL")]
    Upstream(String),
    #[error("cannot listen on {0}: {1}")]
    Listen(std::net::SocketAddr, std::io::Error),
}

/// Serves the proxy until the process is stopped.
pub async fn run(args: HttpArgs) -> Result<(), HttpError> {
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(tls_acceptor(cert, key)?),
        _ => None,
    };
    if tls.is_none() && !args.listen.ip().is_loopback() {
        return Err(HttpError::NotLoopback(args.listen));
    }
    let upstream: Uri = args
        .upstream
        .parse()
        .ok()
        .filter(|u: &Uri| u.scheme_str() == Some("http") && u.authority().is_some())
        .ok_or_else(|| HttpError::Upstream(args.upstream.clone()))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| HttpError::Listen(args.listen, e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| HttpError::Listen(args.listen, e))?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    eprintln!("guardmesh mcp http: listening on {scheme}://{addr}");
    serve(listener, args, upstream, tls).await;
    Ok(())
}

/// A TLS acceptor for the certificate chain and key in these PEM files.
fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<tokio_rustls::TlsAcceptor, HttpError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| HttpError::Tls(format!("cannot read --tls-cert {}: {e}", cert.display())))?;
    if certs.is_empty() {
        return Err(HttpError::Tls(format!(
            "--tls-cert {} holds no certificate",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| HttpError::Tls(format!("cannot read --tls-key {}: {e}", key.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| HttpError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| HttpError::Tls(format!("--tls-cert and --tls-key: {e}")))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// How long a client may take to complete its TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves HTTP/1.1 on one client connection.
async fn serve_connection<IO>(io: IO, proxy: Arc<Proxy>)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |request| {
        let proxy = proxy.clone();
        async move { Ok::<_, std::convert::Infallible>(proxy.handle(request).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await;
}

async fn serve(
    listener: tokio::net::TcpListener,
    args: HttpArgs,
    upstream: Uri,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let judge = Arc::new(Judge::new(args.mesh.clone(), "mcp-http"));
    let proxy = Arc::new(Proxy {
        upstream,
        client: Client::builder(TokioExecutor::new()).build_http(),
        grouper: crate::group::Grouper::new(
            judge.clone(),
            std::time::Duration::from_millis(args.batch_window_ms),
        ),
        judge,
        max: args.max_message_bytes,
    });
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let proxy = proxy.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_connection(stream, proxy).await,
                Some(acceptor) => {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => serve_connection(stream, proxy).await,
                        Ok(Err(error)) => tracing::debug!(%error, "TLS handshake failed"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
        });
    }
}
