//! `guardmesh mcp http`: the gateway in front of a Streamable HTTP MCP
//! server (POST and GET on one endpoint, `Mcp-Session-Id`, JSON or SSE
//! responses).
//!
//! * A POST whose body holds no `tools/call` is forwarded in the gateway's
//!   serialization of what it read ([`crate::json`]; a body it cannot read
//!   alike to every peer is refused, R31), and the upstream's answer (JSON
//!   or an SSE stream) is relayed message by message as it streams, each
//!   message read once and written as the gateway writes it
//!   ([`crate::stream`]).
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
//!
//! # Checks and bounds (R31, R25)
//!
//! * `Host` must name the address the connection arrived on (or
//!   `localhost` on a loopback address), or one given with
//!   `--allowed-host`; otherwise 421. A browser `Origin` must be the same
//!   origin or one given with `--allowed-origin`; otherwise 403. Requests
//!   without `Origin` (non-browser clients) pass. This is the MCP
//!   transport's defence against DNS rebinding.
//! * The client's `Host` and `Origin` are forwarded as received (the
//!   gateway does not put the upstream's own address in `Host`), so an
//!   upstream that checks them itself keeps doing so: a name allowed at
//!   the gateway must be allowed at such an upstream too.
//! * Only POST may carry a message: any other method with a body (a
//!   `Content-Length` above 0, or chunked) is refused with 405 and nothing
//!   is forwarded.
//! * Headers must arrive within `--header-timeout-ms` (also the limit on
//!   an idle kept-alive connection), a POST body within `--body-timeout-ms`
//!   (408). A body is at most `--max-message-bytes` (413); bodies being
//!   read share `--max-buffered-bytes` of memory beyond their first
//!   [`BODY_ALLOWANCE`] bytes (counted as buffers are allocated, see
//!   `body_buffer`), and a body that finds the budget spent is answered
//!   503 at once.
//! * At most `--max-connections` connections are open (default: from the
//!   open-file limit). At the cap, a new connection takes the place of the
//!   one that has waited longest without a request in progress (idle, or
//!   still sending its headers); when every one has a request in progress
//!   the new one is closed. A failed accept ("too many open files") frees
//!   such a connection too, and backs off instead of spinning.
//! * `tools/call` messages being judged: at most `--max-calls-per-session`
//!   per MCP session and `--max-calls-in-flight` in all; past either, the
//!   message is answered at once with HTTP 429 and the JSON-RPC error
//!   [`BUSY`], so no session can fill the shared link to the mesh.

use crate::json::Json;
use crate::jsonrpc::{self, Incoming, Item, ToolCallRequest, codes};
use crate::judge::{Disposition, Judge, JudgeArgs};
use crate::stdio::fresh_session_id;
use bytes::Bytes;
use guardmesh_client::listener::{
    AcceptBackoff, descriptors_for_connections, out_of_descriptors, raise_open_file_limit,
};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming as Body;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rmcp::model::{ErrorCode, ErrorData};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// `mcp http`: a `tools/call` message was not judged because its session
/// (or the gateway) has as many being judged as it may (HTTP 429); the
/// client may send it again later. Nothing was forwarded.
pub const BUSY: ErrorCode = ErrorCode(-32074);

/// The session header of Streamable HTTP.
const SESSION: &str = "mcp-session-id";

/// The first bytes of each request body, which do not count against
/// `--max-buffered-bytes` (so a small request is never refused for lack
/// of budget); bounded by the connection cap.
pub const BODY_ALLOWANCE: usize = 16 << 10;

/// hyper's read buffer per connection, at most (a request's headers must
/// fit in it).
const READ_BUFFER_BYTES: usize = 64 << 10;

/// `guardmesh mcp http`.
#[derive(clap::Args, Debug, Clone)]
pub struct HttpArgs {
    #[command(flatten)]
    pub mesh: JudgeArgs,
    #[command(flatten)]
    pub approval: crate::approval::ApprovalArgs,
    #[command(flatten)]
    pub visibility: crate::visibility::VisibilityArgs,
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
    /// The upstream's server name, sent with each tool result judged by the
    /// mesh (R33); default: the upstream URL's `host:port`.
    #[arg(long)]
    pub server_name: Option<String>,
    /// Largest request body accepted from a client, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_message_bytes: usize,
    /// Single tools/call requests of one MCP session arriving within this
    /// many milliseconds of each other are judged as one guard batch (each
    /// still answered on its own request); 0 judges each on its own.
    #[arg(long, default_value_t = 2)]
    pub batch_window_ms: u64,
    /// Time a client has to send a request's headers (and the longest a
    /// kept-alive connection may sit idle), in milliseconds.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: u64,
    /// Time a client has to send a POST body once its headers are read, in
    /// milliseconds; past it the request is answered 408.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout_ms: u64,
    /// A client connection older than this is closed once its request in
    /// progress is answered (`Connection: close`), so that clients behind
    /// a load balancer spread over gateways added later, in milliseconds;
    /// 0: no age.
    #[arg(long, default_value_t = 30 * 60 * 1000)]
    pub max_connection_age_ms: u64,
    /// Most client connections open at once; 0: automatic (half of the
    /// open-file limit less a reserve, leaving descriptors for the
    /// upstream and the mesh).
    #[arg(long, default_value_t = 0)]
    pub max_connections: usize,
    /// Memory of request bodies being read, over all connections, beyond
    /// the first 16 KiB of each (a body that declares its length holds all
    /// of it from its first bytes); a body that finds it spent is answered
    /// 503.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_buffered_bytes: usize,
    /// tools/call messages (a JSON-RPC batch counts once) of one MCP session
    /// being judged at once; past it, HTTP 429 with JSON-RPC error -32074.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_calls_per_session: u64,
    /// tools/call messages being judged at once over all sessions; past it,
    /// HTTP 429 with JSON-RPC error -32074.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_calls_in_flight: u64,
    /// A browser origin allowed besides the gateway's own (e.g.
    /// `https://app.example`); repeatable. Requests without `Origin` are
    /// always allowed.
    #[arg(long = "allowed-origin", value_name = "ORIGIN")]
    pub allowed_origins: Vec<String>,
    /// A `Host` allowed besides the gateway's own address (`name` allows
    /// any port, `name:port` that port); repeatable.
    #[arg(long = "allowed-host", value_name = "HOST")]
    pub allowed_hosts: Vec<String>,
}

type Out = BoxBody<Bytes, hyper::Error>;

struct Proxy {
    upstream: Uri,
    client: Client<HttpConnector, Out>,
    judge: Arc<Judge>,
    /// SEP-2624: `interceptors/list` and `interceptor/invoke`.
    interceptors: Arc<crate::interceptors::Interceptors>,
    /// The gateway's session ids and the upstream's ([`crate::sessions`]).
    sessions: crate::sessions::Sessions,
    /// Requests in flight under the gateway's own ids ([`crate::upstream`]).
    flight: crate::upstream::InFlight,
    grouper: crate::group::Grouper,
    max: usize,
    body_timeout: Duration,
    /// Memory of bodies being read (their buffers' capacity) beyond
    /// [`BODY_ALLOWANCE`] each, one permit a byte.
    budget: Arc<tokio::sync::Semaphore>,
    calls: CallLimits,
    access: Access,
    /// The upstream's `x-mcp-header` declarations ([`crate::routing`]).
    params: crate::routing::ParamHeaders,
    /// R35: the gateway's approver (`--approver-token-file`), and how long
    /// an elicitation waits.
    approver: Option<Arc<crate::approval::ApproverLink>>,
    elicitation_timeout: Duration,
    /// R35: the sessions whose client declared form elicitation, by the
    /// gateway's session id.
    elicits: Mutex<HashMap<String, Arc<crate::approval::Approvals>>>,
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

/// Headers that belong to one connection, not to the message. `Host` is
/// not one of them: it is forwarded as the client sent it (checked first,
/// [`Access`]), so that an upstream's own check sees it.
fn hop_by_hop(name: &header::HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "transfer-encoding"
            | "te"
            | "upgrade"
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
        // The upstream's session behind the gateway's (checked by
        // `handle`; one ended since is sent without).
        if let Some(client) = request.headers_mut().remove(SESSION)
            && let Some(upstream) = client
                .to_str()
                .ok()
                .and_then(|c| self.sessions.upstream(c))
                .and_then(|u| HeaderValue::from_str(&u).ok())
        {
            request.headers_mut().insert(SESSION, upstream);
        }
        let mut response = self
            .client
            .request(request)
            .await
            .map_err(|e| crate::judge::error_chain(&e))?;
        if let Some(upstream) = response.headers_mut().remove(SESSION)
            && let Ok(upstream) = upstream.to_str()
            && let Ok(client) = HeaderValue::from_str(&self.sessions.client(upstream))
        {
            response.headers_mut().insert(SESSION, client);
        }
        Ok(response)
    }

    fn bad_gateway(why: String) -> Response<Out> {
        let data = ErrorData::new(
            codes::INTERNAL_ERROR_UPSTREAM,
            format!("guardmesh: the upstream MCP server cannot be reached: {why}"),
            None,
        );
        error_response(StatusCode::BAD_GATEWAY, None, &data)
    }

    /// Forwards a request whose answer the gateway reads whole (a call
    /// whose result the mesh judges, R33; an element of a JSON-RPC batch):
    /// `text` (of `session`, id key `key`, reserved) goes upstream under
    /// the gateway's own id, the upstream's answer (JSON or SSE) is read
    /// whole, and the client gets the response with exactly that id
    /// ([`crate::upstream::answer`]: judged when `purpose` says so), in
    /// the gateway's serialization, and the upstream's `Mcp-Session-Id`.
    /// The answer is read message by message as it streams: a request
    /// the upstream sends in it (sampling, elicitation, ...) cannot reach
    /// the client here and is answered by the gateway at once with
    /// [`crate::upstream::WITHHELD_WHILE_JUDGING`], so the upstream does
    /// not wait for it; other messages are dropped (logged). An answer
    /// without that response is a bad gateway, nothing of it forwarded.
    async fn exchange(
        &self,
        headers: &HeaderMap,
        session: &str,
        key: &str,
        purpose: crate::upstream::Purpose,
        text: &str,
    ) -> Result<(String, Option<HeaderValue>), Response<Out>> {
        use crate::upstream::{self, Message};
        let Some((id, text)) = self.flight.send_as(session, key, purpose, text) else {
            return Err(Self::bad_gateway("the request could not be written".into()));
        };
        let response = match self.send(Method::POST, headers, full(text)).await {
            Ok(response) => response,
            Err(why) => return Err(Self::bad_gateway(why)),
        };
        let session_header = response.headers().get("mcp-session-id").cloned();
        // Message by message as the answer streams: a request the upstream
        // sends before its response waits for an answer.
        let mut messages = crate::stream::Messages::new(response);
        while let Some(answer) = messages.next().await {
            match upstream::read(&answer) {
                Ok(Message::Response { id: got, message }) => {
                    match self.flight.answered_as(&got, id) {
                        Some(sent) => {
                            let answer =
                                upstream::answer(&self.judge, &self.flight, sent, message).await;
                            return Ok((answer, session_header));
                        }
                        None => tracing::warn!(
                            id = %got.to_text(),
                            "dropped an upstream response that answers no request in flight"
                        ),
                    }
                }
                Ok(Message::Other(message)) if message.get("id").is_some() => {
                    // A request (sampling, elicitation, ...) the client
                    // cannot be sent here: answered, so the upstream does
                    // not wait for it.
                    tracing::warn!(
                        method = ?message.get("method").map(crate::json::Json::to_text),
                        "answered a request the upstream sent in an answer the gateway reads whole"
                    );
                    let answer = upstream::withheld(
                        &message,
                        "in the answer to a request the gateway reads whole (a tool call \
                         whose result the mesh judges, or an element of a JSON-RPC batch)",
                    );
                    self.answer_upstream(headers, answer).await;
                }
                Ok(Message::Other(message)) => tracing::warn!(
                    method = ?message.get("method").map(crate::json::Json::to_text),
                    "dropped a message the upstream sent while a judged request ran"
                ),
                Err(unreadable) => {
                    let sent = unreadable
                        .id
                        .as_ref()
                        .and_then(|got| self.flight.answered_as(got, id));
                    tracing::warn!(why = %unreadable.why, "refused an upstream message");
                    if let Some(sent) = sent {
                        let answer = upstream::unreadable_answer(&sent.client_id, &unreadable.why);
                        return Ok((answer, session_header));
                    }
                }
            }
        }
        Err(Self::bad_gateway(
            "the upstream's answer holds no response to the request".into(),
        ))
    }

    /// Sends the upstream the gateway's own answer `text` to one of its
    /// requests, in the session of `headers` (the client's request's);
    /// bounded in time: an upstream that does not take it is logged.
    async fn answer_upstream(&self, headers: &HeaderMap, text: String) {
        let headers = crate::routing::without(headers);
        let sent = tokio::time::timeout(
            ANSWER_UPSTREAM_TIMEOUT,
            self.send(Method::POST, &headers, full(text)),
        )
        .await;
        match sent {
            Ok(Ok(response)) => {
                // Read to its end (bounded), so the connection is reused.
                let _ = tokio::time::timeout(
                    ANSWER_UPSTREAM_TIMEOUT,
                    http_body_util::Limited::new(response.into_body(), 64 << 10).collect(),
                )
                .await;
            }
            Ok(Err(why)) => tracing::warn!(%why, "the upstream did not take the gateway's answer"),
            Err(_) => tracing::warn!("the upstream did not take the gateway's answer in time"),
        }
    }

    /// [`Self::exchange`] answered as one JSON message.
    async fn forward_judged(
        &self,
        headers: &HeaderMap,
        session: &str,
        key: &str,
        purpose: crate::upstream::Purpose,
        text: &str,
    ) -> Response<Out> {
        match self.exchange(headers, session, key, purpose, text).await {
            Ok((answer, session_header)) => {
                let mut out = json_response(StatusCode::OK, answer);
                if let Some(value) = session_header {
                    out.headers_mut().insert("mcp-session-id", value);
                }
                out
            }
            Err(response) => response,
        }
    }

    /// Forwards a request and relays the upstream's answer message by
    /// message as it streams ([`crate::stream`]); `expected`: the id of the
    /// request the answer is for, when it is one.
    async fn forward(
        &self,
        method: Method,
        headers: &HeaderMap,
        body: Out,
        expected: Option<Json>,
    ) -> Response<Out> {
        let judging = self.judging(headers);
        match self.send(method, headers, body).await {
            Ok(response) => crate::stream::relay(response, expected, Some(judging)).await,
            Err(why) => Self::bad_gateway(why),
        }
    }

    /// R33: the session the tool results in the upstream's answer to a
    /// request with `headers` are judged in: the request's gateway
    /// session, or one of their own.
    fn judging(&self, headers: &HeaderMap) -> crate::stream::Judging {
        let session = headers
            .get(SESSION)
            .and_then(|v| v.to_str().ok())
            .map_or_else(|| fresh_session_id("mcp-http"), str::to_owned);
        crate::stream::Judging {
            judge: self.judge.clone(),
            session,
        }
    }

    /// [`Self::forward`], and when the request lists tools (`listing`: the
    /// keys of its `tools/list` request ids), the upstream's answer is read
    /// whole (JSON or SSE, at most [`MAX_LISTING_BYTES`]) and relayed
    /// without the tools' output schemas ([`crate::schemas`]).
    /// `session`: the gateway session the request was read in (a
    /// stateless client's own, made for this request), where the tool
    /// results in the answer are judged (R33): the session its sampled
    /// calls were remembered in.
    async fn forward_listing(
        &self,
        method: Method,
        headers: &HeaderMap,
        body: Out,
        listing: &[String],
        expected: Option<Json>,
        session: &str,
    ) -> Response<Out> {
        let response = match self.send(method, headers, body).await {
            Ok(response) => response,
            Err(why) => return Self::bad_gateway(why),
        };
        let judging = crate::stream::Judging {
            judge: self.judge.clone(),
            session: session.to_owned(),
        };
        if listing.is_empty() {
            return crate::stream::relay(response, expected, Some(judging)).await;
        }
        let (parts, body) = response.into_parts();
        let body = match http_body_util::Limited::new(body, MAX_LISTING_BYTES)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(why) => {
                return Self::bad_gateway(format!(
                    "its answer to tools/list could not be read whole (at most \
                     {MAX_LISTING_BYTES} bytes): {why}"
                ));
            }
        };
        let sse = crate::stream::is_sse(&parts.headers);
        let text = String::from_utf8_lossy(&body);
        let body = if sse {
            crate::stream::sse_body(&text, expected.as_ref(), Some(&judging)).await
        } else {
            crate::stream::json_body(&text, expected.as_ref(), Some(&judging)).await
        };
        // Tool visibility: the answers to `listing` without the tools the
        // chain always skips (when hidden), by id key.
        let mut visible = HashMap::new();
        if self.judge.hides_skipped_tools() {
            for (key, message) in listed_messages(&body, sse, listing) {
                visible.insert(key, self.judge.visible_tools(message).await);
            }
        }
        let out = if sse {
            sse_without_schemas(&body, listing, &visible)
        } else {
            json_without_schemas(&body, listing, &visible)
        };
        if sse {
            for event in out.split("\n\n") {
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                self.params.learn(&data.join("\n"));
            }
        } else {
            self.params.learn(&out);
        }
        let mut relayed = Response::new(full(out));
        *relayed.status_mut() = parts.status;
        copy_headers(&parts.headers, relayed.headers_mut());
        relayed
    }

    /// A request as it arrives on a connection whose local address is
    /// `local`: checked ([`Access`], methods with bodies), then handled.
    async fn serve(self: &Arc<Self>, request: Request<Body>, local: SocketAddr) -> Response<Out> {
        if let Err(refused) = self.access.check(request.headers(), local) {
            return refused.response();
        }
        if request.method() != Method::POST && carries_body(&request) {
            let data = ErrorData::new(
                codes::INVALID_REQUEST,
                format!(
                    "guardmesh: a {} request may not carry a body; JSON-RPC messages are POSTed",
                    request.method()
                ),
                None,
            );
            let mut response = error_response(StatusCode::METHOD_NOT_ALLOWED, None, &data);
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, POST, DELETE"));
            return response;
        }
        self.handle(request).await
    }

    /// Reads a POST body within the size limit, the body deadline and the
    /// shared byte budget; the permit holds the body's share of the budget
    /// until the request is answered.
    async fn read_body(
        &self,
        mut body: Body,
    ) -> Result<(Bytes, Option<tokio::sync::OwnedSemaphorePermit>), Response<Out>> {
        let deadline = tokio::time::Instant::now() + self.body_timeout;
        let declared = hyper::body::Body::size_hint(&body).exact();
        let mut buffer = crate::body_buffer::BodyBuffer::new(
            self.budget.clone(),
            BODY_ALLOWANCE,
            self.max,
            declared,
        );
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    let data = ErrorData::new(
                        codes::INVALID_REQUEST,
                        format!(
                            "guardmesh: the request body did not arrive within {} ms",
                            self.body_timeout.as_millis()
                        ),
                        None,
                    );
                    return Err(error_response(StatusCode::REQUEST_TIMEOUT, None, &data));
                }
                Ok(None) => break,
                Ok(Some(Err(error))) => {
                    let data = ErrorData::new(
                        codes::INVALID_REQUEST,
                        format!("guardmesh: reading the request body failed: {error}"),
                        None,
                    );
                    return Err(error_response(StatusCode::BAD_REQUEST, None, &data));
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            match buffer.push(&data) {
                Ok(()) => {}
                Err(crate::body_buffer::Refused::TooLarge) => {
                    let data = ErrorData::new(
                        codes::TOO_LARGE,
                        format!("guardmesh: request body longer than {} bytes", self.max),
                        None,
                    );
                    return Err(error_response(StatusCode::PAYLOAD_TOO_LARGE, None, &data));
                }
                Err(crate::body_buffer::Refused::Busy) => {
                    let data = ErrorData::new(
                        BUSY,
                        "guardmesh: too many request bodies are being read at once; try again",
                        None,
                    );
                    return Err(busy_response(StatusCode::SERVICE_UNAVAILABLE, &data));
                }
            }
        }
        Ok(buffer.finish())
    }

    async fn handle(self: &Arc<Self>, request: Request<Body>) -> Response<Out> {
        let (parts, body) = request.into_parts();
        // R31: a session belongs to the client that opened it.
        if let Some(client) = parts.headers.get(SESSION) {
            let known = client.to_str().ok().and_then(|c| self.sessions.upstream(c));
            if known.is_none() {
                let data = ErrorData::new(
                    codes::INVALID_REQUEST,
                    "guardmesh: unknown session (Mcp-Session-Id not issued by this gateway, \
                     ended or forgotten); initialize a new session",
                    None,
                );
                return error_response(StatusCode::NOT_FOUND, None, &data);
            }
            if parts.method == Method::DELETE {
                let response = self
                    .forward(parts.method.clone(), &parts.headers, body.boxed(), None)
                    .await;
                if let Ok(client) = client.to_str() {
                    self.sessions.end(client);
                    if let Some(approvals) = self.elicits().remove(client) {
                        approvals.close();
                    }
                }
                return response;
            }
        }
        if parts.method != Method::POST {
            return self
                .forward(parts.method, &parts.headers, body.boxed(), None)
                .await;
        }
        let (bytes, _budget) = match self.read_body(body).await {
            Ok(read) => read,
            Err(response) => return response,
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
        // The 2026-07-28 revision's routing headers name what was judged.
        let modern = crate::routing::present(&parts.headers);
        if modern {
            let checked = match &incoming {
                Incoming::Single(Item::Forward { text, .. }) => {
                    crate::routing::check_text(&parts.headers, text)
                }
                Incoming::Single(Item::ToolCall(call)) => {
                    crate::routing::check(&parts.headers, "tools/call", Some(&call.name))
                }
                Incoming::Single(_) => Ok(()),
                Incoming::Batch(_) => Err(ErrorData::new(
                    crate::routing::HEADER_MISMATCH,
                    "guardmesh: routing headers (Mcp-Method, Mcp-Name) on a JSON-RPC batch",
                    None,
                )),
            };
            if let Err(error) = checked {
                let id = match &incoming {
                    Incoming::Single(Item::ToolCall(call)) => Some(call.id.clone()),
                    _ => None,
                };
                return error_response(StatusCode::BAD_REQUEST, id.as_deref(), &error);
            }
        }
        match incoming {
            Incoming::Single(Item::Forward {
                text,
                request,
                lists_tools,
            }) => {
                // SEP-2624: answered by the gateway, never forwarded.
                if request.is_some()
                    && let Some(answer) = self.interceptors.take(&text, &session)
                {
                    return json_response(StatusCode::OK, answer.await);
                }
                // R35: the client's answer to an elicitation of the
                // gateway's is the gateway's, never forwarded.
                if request.is_none()
                    && text.contains(crate::approval::ID_PREFIX)
                    && let Some(approvals) = self.elicits().get(&session).cloned()
                    && approvals.take_answer(&text)
                {
                    let mut response = Response::new(full(Bytes::new()));
                    *response.status_mut() = StatusCode::ACCEPTED;
                    return response;
                }
                // A call cancelled while its user is asked: the ask ends.
                if request.is_none()
                    && text.contains("notifications/cancelled")
                    && let Some(approvals) = self.elicits().get(&session).cloned()
                {
                    approvals.cancel_call(&text);
                }
                // R31: the tool calls a model asks for through sampling are
                // judged before the upstream receives the answer.
                let text = if request.is_none() && crate::sampling::may_use_tools(&text) {
                    match crate::sampling::judged_answer(&self.judge, &session, text).await {
                        Some(text) => text,
                        None => {
                            let mut response = Response::new(full(Bytes::new()));
                            *response.status_mut() = StatusCode::ACCEPTED;
                            return response;
                        }
                    }
                } else {
                    text
                };
                // R35: what the client declares at initialize.
                let initialize = (self.approver.is_some()
                    && request.is_some()
                    && text.contains("\"initialize\""))
                .then(|| text.clone());
                let _held = match &request {
                    Some(key) => match self.flight.hold(&session, key) {
                        Ok(held) => Some(held),
                        Err(error) => {
                            return json_response(
                                StatusCode::OK,
                                crate::upstream::refuse(&text, &error),
                            );
                        }
                    },
                    None => None,
                };
                // R31: the tool calls of sampling answers in its
                // `inputResponses` (2026-07-28), judged first.
                let text = if request.is_some() {
                    match crate::sampling::judged_request(&self.judge, &session, text).await {
                        Ok(text) => text,
                        Err(answer) => return json_response(StatusCode::OK, answer),
                    }
                } else {
                    text
                };
                // R33: a task's result is judged like a call's; one that
                // cannot be judged is not fetched.
                if let Some(key) = &request {
                    use crate::upstream::Purpose;
                    match self.flight.purpose_of(&text) {
                        Ok(purpose @ (Purpose::Task(_) | Purpose::UnseenTask)) => {
                            return self
                                .forward_judged(&parts.headers, &session, key, purpose, &text)
                                .await;
                        }
                        Ok(_) => {}
                        Err(error) => {
                            return json_response(
                                StatusCode::OK,
                                crate::upstream::refuse(&text, &error),
                            );
                        }
                    }
                }
                let Some(text) = self.flight.outgoing_notification(&session, text) else {
                    let mut response = Response::new(full(Bytes::new()));
                    *response.status_mut() = StatusCode::ACCEPTED;
                    return response;
                };
                let expected = request
                    .is_some()
                    .then(|| crate::upstream::id_of(&text))
                    .flatten();
                let listing: Vec<String> = request.filter(|_| lists_tools).into_iter().collect();
                let response = self
                    .forward_listing(
                        parts.method,
                        &parts.headers,
                        full(text),
                        &listing,
                        expected,
                        &session,
                    )
                    .await;
                if let Some(initialize) = initialize {
                    self.learn(&initialize, &response);
                }
                response
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
                let _slot = match self.calls.enter(&session) {
                    Ok(slot) => slot,
                    Err(busy) => return busy.response(Some(&*call.id)),
                };
                let original = modern.then(|| call.message.to_text());
                let key = jsonrpc::id_key(&call.id);
                let held = match self.flight.hold(&session, &key) {
                    Ok(held) => held,
                    Err(error) => {
                        return json_response(
                            StatusCode::OK,
                            jsonrpc::error(Some(&call.id), &error),
                        );
                    }
                };
                match self.grouper.judge_one(&session, call).await {
                    Disposition::Forward(text) => {
                        // R31: tool calls in its `inputResponses`.
                        let text = match crate::sampling::judged_request(
                            &self.judge,
                            &session,
                            text,
                        )
                        .await
                        {
                            Ok(text) => text,
                            Err(answer) => {
                                self.judge.take_pending(&session, &key);
                                return json_response(StatusCode::OK, answer);
                            }
                        };
                        let original = original.unwrap_or_else(|| text.clone());
                        let rewritten = crate::routing::for_final_call(
                            &parts.headers,
                            &original,
                            &text,
                            &self.params,
                        );
                        let headers = &rewritten;
                        // R33: a result the chain judges is read whole and
                        // judged before the client sees it; so is a task's
                        // creation, so that its result is known when fetched.
                        let pending = self.judge.take_pending(&session, &key);
                        if pending.is_some() || crate::upstream::creates_task(&text) {
                            let purpose = crate::upstream::Purpose::Call(pending);
                            self.forward_judged(headers, &session, &key, purpose, &text)
                                .await
                        } else {
                            let expected = crate::upstream::id_of(&text);
                            self.forward(parts.method, headers, full(text), expected)
                                .await
                        }
                    }
                    Disposition::Answer(text) => json_response(StatusCode::OK, text),
                    Disposition::Ask(asked) => {
                        let approvals = self.elicits().get(&session).cloned();
                        match approvals.filter(|a| a.client_elicits()) {
                            Some(approvals) => {
                                // The reservation of the call's id passes
                                // to the task that answers it (released
                                // there).
                                std::mem::forget(held);
                                self.ask_over_sse(approvals, *asked, parts.headers, session, key)
                            }
                            None => json_response(StatusCode::OK, asked.answer),
                        }
                    }
                }
            }
            Incoming::Batch(items) => {
                let ours = |item: &Item| match item {
                    Item::ToolCall(_) => true,
                    Item::Forward {
                        text,
                        request: None,
                        ..
                    } => {
                        text.contains(crate::approval::ID_PREFIX)
                            || crate::sampling::may_use_tools(text)
                    }
                    Item::Forward { text, .. } => {
                        crate::interceptors::may_be_ours(text)
                            || crate::sampling::may_use_tools(text)
                    }
                    _ => false,
                };
                if !items.iter().any(ours) {
                    // Every element read and forwardable: the gateway's
                    // serialization of each, as one batch.
                    let listing = listing_keys(&items);
                    let texts: Vec<String> = items
                        .into_iter()
                        .filter_map(|item| match item {
                            Item::Forward { text, .. } => Some(text),
                            _ => None,
                        })
                        .collect();
                    let body = format!("[{}]", texts.join(","));
                    return self
                        .forward_listing(
                            parts.method,
                            &parts.headers,
                            full(body),
                            &listing,
                            None,
                            &session,
                        )
                        .await;
                }
                let _slot = match self.calls.enter(&session) {
                    Ok(slot) => slot,
                    Err(busy) => return busy.response(None),
                };
                self.batch(items, &session, &parts.headers).await
            }
        }
    }

    fn elicits(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, Arc<crate::approval::Approvals>>> {
        self.elicits.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// R35: notes the session the upstream's `response` to the client's
    /// `initialize` request opened, when the client declares form
    /// elicitation.
    fn learn(&self, initialize: &str, response: &Response<Out>) {
        let approvals =
            crate::approval::Approvals::new(self.approver.clone(), self.elicitation_timeout);
        approvals.learn(initialize);
        if !approvals.client_elicits() {
            return;
        }
        let Some(session) = response
            .headers()
            .get(SESSION)
            .and_then(|v| v.to_str().ok())
        else {
            return;
        };
        let mut elicits = self.elicits();
        if elicits.len() >= crate::sessions::MAX_SESSIONS {
            // Sessions ended or forgotten since.
            elicits.retain(|client, _| self.sessions.upstream(client).is_some());
        }
        if elicits.len() < crate::sessions::MAX_SESSIONS {
            elicits.insert(session.to_owned(), Arc::new(approvals));
        }
    }

    /// R35: a call a guard asked about, put to the client's user: the
    /// answer to its POST is an SSE stream carrying the gateway's
    /// `elicitation/create` (answered by the client's POST of its
    /// response) and then the call's answer: the upstream's response when
    /// approved and the mesh proceeds, else the gateway's. The call's id
    /// stays reserved until then.
    fn ask_over_sse(
        self: &Arc<Self>,
        approvals: Arc<crate::approval::Approvals>,
        asked: crate::judge::Asked,
        headers: HeaderMap,
        session: String,
        key: String,
    ) -> Response<Out> {
        let (tx, rx) = tokio::sync::mpsc::channel::<String>(4);
        let this = self.clone();
        tokio::spawn(async move {
            let call_id = asked.call.id.clone();
            let send = |message: String| {
                let tx = tx.clone();
                async move { tx.send(message).await.is_ok() }
            };
            let answered = approvals.settle(&this.judge, &session, asked, send);
            let decided = tokio::select! {
                decided = answered => decided,
                // The client closed the stream: nobody will read the
                // answer; the ask ends (nothing runs).
                () = tx.closed() => {
                    this.flight.release(&session, &key);
                    return;
                }
            };
            let answer = match decided {
                Disposition::Forward(text) => {
                    let pending = this.judge.take_pending(&session, &key);
                    let purpose = crate::upstream::Purpose::Call(pending);
                    // R31: tool calls in its `inputResponses`.
                    let judged = crate::sampling::judged_request(&this.judge, &session, text).await;
                    let exchanged = match judged {
                        Ok(text) => {
                            this.exchange(&headers, &session, &key, purpose, &text)
                                .await
                        }
                        Err(answer) => Ok((answer, None)),
                    };
                    match exchanged {
                        Ok((answer, _)) => answer,
                        Err(_) => {
                            let data = ErrorData::new(
                                codes::INTERNAL_ERROR_UPSTREAM,
                                "guardmesh: the upstream MCP server did not answer the approved call",
                                None,
                            );
                            jsonrpc::error(Some(&call_id), &data)
                        }
                    }
                }
                Disposition::Answer(text) => text,
                Disposition::Ask(asked) => asked.answer,
            };
            this.flight.release(&session, &key);
            let _ = tx.send(answer).await;
        });
        let events = futures::stream::unfold(rx, |mut rx| async move {
            let message = rx.recv().await?;
            let event = format!("event: message\ndata: {message}\n\n");
            Some((
                Ok::<_, hyper::Error>(hyper::body::Frame::data(Bytes::from(event))),
                rx,
            ))
        });
        let mut response = Response::new(http_body_util::StreamBody::new(events).boxed());
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        response
            .headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        response
    }

    /// A JSON-RPC batch holding tool calls: one guard batch, one array.
    /// Each request is posted on its own under the gateway's id and its
    /// answer read whole ([`Self::exchange`]); one reusing an id in flight
    /// (of the session, or earlier in the batch) is refused.
    async fn batch(&self, items: Vec<Item>, session: &str, headers: &HeaderMap) -> Response<Out> {
        use crate::upstream::Purpose;
        let mut calls: Vec<ToolCallRequest> = Vec::new();
        let mut answers = Vec::new();
        let mut held = Vec::new();
        // (message, its id's key when it is a request, its purpose, lists tools)
        let mut forwards: Vec<(String, Option<String>, Purpose, bool)> = Vec::new();
        let items = crate::upstream::without_repeated_ids(items, &mut answers);
        for item in items {
            match item {
                Item::ToolCall(call) => match self.flight.hold(session, &jsonrpc::id_key(&call.id))
                {
                    Ok(h) => {
                        held.push(h);
                        calls.push(*call);
                    }
                    Err(error) => answers.push(jsonrpc::error(Some(&call.id), &error)),
                },
                Item::Forward {
                    text,
                    request: Some(_),
                    ..
                } if crate::interceptors::may_be_ours(&text)
                    && let Some(answer) = self.interceptors.take(&text, session) =>
                {
                    // SEP-2624: answered by the gateway, never forwarded.
                    answers.push(answer.await);
                }
                Item::Forward {
                    text,
                    request: Some(key),
                    lists_tools,
                } => match self.flight.hold(session, &key) {
                    Ok(h) => {
                        held.push(h);
                        // R31: tool calls in its `inputResponses`.
                        let text = match crate::sampling::judged_request(&self.judge, session, text)
                            .await
                        {
                            Ok(text) => text,
                            Err(answer) => {
                                answers.push(answer);
                                continue;
                            }
                        };
                        match self.flight.purpose_of(&text) {
                            Ok(purpose) => forwards.push((text, Some(key), purpose, lists_tools)),
                            Err(error) => answers.push(crate::upstream::refuse(&text, &error)),
                        }
                    }
                    Err(error) => answers.push(crate::upstream::refuse(&text, &error)),
                },
                Item::Forward {
                    text,
                    request: None,
                    ..
                } => {
                    // R35: an answer to an elicitation of the gateway's.
                    if text.contains(crate::approval::ID_PREFIX)
                        && let Some(approvals) = self.elicits().get(session).cloned()
                        && approvals.take_answer(&text)
                    {
                        continue;
                    }
                    // R31: tool calls asked for through sampling, judged.
                    let Some(text) =
                        crate::sampling::judged_answer(&self.judge, session, text).await
                    else {
                        continue;
                    };
                    if let Some(text) = self.flight.outgoing_notification(session, text) {
                        forwards.push((text, None, Purpose::Plain, false));
                    }
                }
                Item::Reject { id, error } => answers.push(jsonrpc::error(id.as_deref(), &error)),
                Item::Drop(why) => tracing::warn!("{why}"),
            }
        }
        for (call, disposition) in calls.iter().zip(self.judge.judge(session, &calls).await) {
            match disposition {
                Disposition::Forward(text) => {
                    let key = jsonrpc::id_key(&call.id);
                    let pending = self.judge.take_pending(session, &key);
                    // R31: tool calls in its `inputResponses`.
                    match crate::sampling::judged_request(&self.judge, session, text).await {
                        Ok(text) => forwards.push((text, Some(key), Purpose::Call(pending), false)),
                        Err(answer) => answers.push(answer),
                    }
                }
                Disposition::Answer(text) => answers.push(text),
                Disposition::Ask(asked) => answers.push(asked.answer),
            }
        }
        for (message, key, purpose, lists_tools) in forwards {
            let Some(key) = key else {
                // A notification: nothing to answer.
                if let Err(why) = self.send(Method::POST, headers, full(message)).await {
                    return Self::bad_gateway(why);
                }
                continue;
            };
            match self
                .exchange(headers, session, &key, purpose, &message)
                .await
            {
                Ok((answer, _)) if lists_tools => {
                    let answer = self.judge.visible_tools(answer).await;
                    answers.push(crate::schemas::without_output_schemas(&answer).unwrap_or(answer))
                }
                Ok((answer, _)) => answers.push(answer),
                Err(response) => return response,
            }
        }
        drop(held);
        if answers.is_empty() {
            let mut response = Response::new(full(Bytes::new()));
            *response.status_mut() = StatusCode::ACCEPTED;
            return response;
        }
        json_response(StatusCode::OK, format!("[{}]", answers.join(",")))
    }
}

/// How long the gateway's own answer to an upstream's request may take
/// to send.
const ANSWER_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection to the upstream is kept idle for reuse.
const UPSTREAM_IDLE: Duration = Duration::from_secs(2);

/// The upstream's answer to a `tools/list` read whole, at most.
const MAX_LISTING_BYTES: usize = 32 << 20;

/// The id keys of the `tools/list` requests among `items`.
fn listing_keys(items: &[Item]) -> Vec<String> {
    items
        .iter()
        .filter_map(|item| match item {
            Item::Forward {
                request: Some(key),
                lists_tools: true,
                ..
            } => Some(key.clone()),
            _ => None,
        })
        .collect()
}

/// `message` without output schemas when it answers one of `listing`,
/// and as `visible` has it (tool visibility) when it holds its id key.
fn without_schemas_if_listed(
    message: String,
    listing: &[String],
    visible: &HashMap<String, String>,
) -> String {
    let Some(key) = jsonrpc::response_key(message.as_bytes()).filter(|k| listing.contains(k))
    else {
        return message;
    };
    let message = visible.get(&key).cloned().unwrap_or(message);
    crate::schemas::without_output_schemas(&message).unwrap_or(message)
}

/// The messages of a body (JSON, or SSE when `sse`: each event's data)
/// that answer one of `listing`, with their id keys.
fn listed_messages(body: &str, sse: bool, listing: &[String]) -> Vec<(String, String)> {
    let json_messages = |text: &str| -> Vec<String> {
        match serde_json::from_str::<Vec<Box<serde_json::value::RawValue>>>(text) {
            Ok(many) => many.into_iter().map(|m| m.get().to_owned()).collect(),
            Err(_) => vec![text.to_owned()],
        }
    };
    let messages: Vec<String> = if sse {
        body.replace("\r\n", "\n")
            .split("\n\n")
            .map(|event| {
                event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .filter(|data| !data.is_empty())
            .flat_map(|data| json_messages(&data))
            .collect()
    } else {
        json_messages(body)
    };
    messages
        .into_iter()
        .filter_map(|m| {
            let key = jsonrpc::response_key(m.as_bytes()).filter(|k| listing.contains(k))?;
            Some((key, m))
        })
        .collect()
}

/// A JSON body (one message or a batch's array) with the answers to
/// `listing` relayed without output schemas (and as `visible` has them).
fn json_without_schemas(
    text: &str,
    listing: &[String],
    visible: &HashMap<String, String>,
) -> String {
    match serde_json::from_str::<Vec<Box<serde_json::value::RawValue>>>(text) {
        Ok(many) => {
            let answers: Vec<String> = many
                .into_iter()
                .map(|m| without_schemas_if_listed(m.get().to_owned(), listing, visible))
                .collect();
            format!("[{}]", answers.join(","))
        }
        Err(_) => without_schemas_if_listed(text.to_owned(), listing, visible),
    }
}

/// An SSE body whose events' data are relayed as [`json_without_schemas`];
/// each event's other fields (`id:`, `event:`, `retry:`) are kept.
fn sse_without_schemas(
    text: &str,
    listing: &[String],
    visible: &HashMap<String, String>,
) -> String {
    let text = text.replace("\r\n", "\n");
    let mut out = String::with_capacity(text.len());
    for event in text.split_inclusive("\n\n") {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        if data.is_empty() {
            out.push_str(event);
            continue;
        }
        for line in event
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with("data:"))
        {
            out.push_str(line);
            out.push('\n');
        }
        for line in json_without_schemas(&data.join("\n"), listing, visible).lines() {
            out.push_str("data: ");
            out.push_str(line);
            out.push('\n');
        }
        out.push('\n');
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
    #[error("{0}")]
    Approver(String),
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
    crate::approval::link(&args.mesh, &args.approval).map_err(HttpError::Approver)?;
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
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether a request carries a body: a `Content-Length` above 0, or a
/// chunked one (which may hold anything).
fn carries_body(request: &Request<Body>) -> bool {
    use hyper::body::Body as _;
    !request.body().is_end_stream()
}

/// An answer the gateway makes when it is too busy: `status` with a JSON-RPC
/// error, and `Retry-After`.
fn busy_response(status: StatusCode, data: &ErrorData) -> Response<Out> {
    let mut response = error_response(status, None, data);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

// ---------------------------------------------------------------------------
// Origin and Host
// ---------------------------------------------------------------------------

/// The `Origin` and `Host` checks (DNS rebinding).
struct Access {
    /// Allowed origins besides the connection's own, lowercase, without a
    /// trailing slash.
    origins: Vec<String>,
    /// Allowed hosts besides the connection's own: (name, port or any).
    hosts: Vec<(String, Option<u16>)>,
    tls: bool,
}

/// Why a request was refused by [`Access`].
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("guardmesh: Host {0:?} is not this gateway's address nor an --allowed-host")]
    Host(String),
    #[error("guardmesh: the request has no Host")]
    NoHost,
    #[error("guardmesh: Origin {0:?} is not allowed (see --allowed-origin)")]
    Origin(String),
}

impl Refused {
    fn response(&self) -> Response<Out> {
        let status = match self {
            Self::Host(_) => StatusCode::MISDIRECTED_REQUEST,
            Self::NoHost => StatusCode::BAD_REQUEST,
            Self::Origin(_) => StatusCode::FORBIDDEN,
        };
        let data = ErrorData::new(codes::INVALID_REQUEST, self.to_string(), None);
        error_response(status, None, &data)
    }
}

/// Splits `host[:port]` (IPv6 in brackets); the name lowercased.
fn split_host(value: &str) -> Option<(String, Option<u16>)> {
    let authority: http::uri::Authority = value.parse().ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    Some((authority.host().to_ascii_lowercase(), authority.port_u16()))
}

impl Access {
    fn new(args: &HttpArgs, tls: bool) -> Self {
        Self {
            origins: args
                .allowed_origins
                .iter()
                .map(|o| o.trim_end_matches('/').to_ascii_lowercase())
                .collect(),
            hosts: args
                .allowed_hosts
                .iter()
                .filter_map(|h| split_host(h))
                .collect(),
            tls,
        }
    }

    /// Whether `host[:port]` names this gateway as reached at `local`.
    fn own_host(&self, name: &str, port: Option<u16>, local: SocketAddr) -> bool {
        let default_port = if self.tls { 443 } else { 80 };
        let port_ok = port.unwrap_or(default_port) == local.port();
        let ip = local.ip();
        let name_ok = match name
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
        {
            Ok(named) => named == ip,
            Err(_) => name == "localhost" && ip.is_loopback(),
        };
        (port_ok && name_ok)
            || self
                .hosts
                .iter()
                .any(|(allowed, p)| allowed == name && p.is_none_or(|p| Some(p) == port))
    }

    fn check(&self, headers: &HeaderMap, local: SocketAddr) -> Result<(), Refused> {
        let host = headers.get(header::HOST).ok_or(Refused::NoHost)?;
        let host_text = String::from_utf8_lossy(host.as_bytes()).into_owned();
        match split_host(&host_text) {
            Some((name, port)) if self.own_host(&name, port, local) => {}
            _ => return Err(Refused::Host(host_text)),
        }
        let Some(origin) = headers.get(header::ORIGIN) else {
            return Ok(());
        };
        let text = String::from_utf8_lossy(origin.as_bytes()).into_owned();
        let lower = text.trim_end_matches('/').to_ascii_lowercase();
        if self.origins.contains(&lower) {
            return Ok(());
        }
        // Same origin: the scheme the gateway serves, and a host that names
        // it.
        let scheme = if self.tls { "https://" } else { "http://" };
        let same = lower
            .strip_prefix(scheme)
            .and_then(split_host)
            .is_some_and(|(name, port)| {
                let port = port.or(Some(if self.tls { 443 } else { 80 }));
                self.own_host(&name, port, local)
            });
        if same {
            Ok(())
        } else {
            Err(Refused::Origin(text))
        }
    }
}

// ---------------------------------------------------------------------------
// tools/call messages being judged
// ---------------------------------------------------------------------------

/// Bounds on `tools/call` messages being judged: per session and in all.
struct CallLimits {
    per_session: usize,
    total: usize,
    state: Arc<Mutex<(usize, HashMap<String, usize>)>>,
}

/// A message's place under [`CallLimits`], given back on drop.
struct CallSlot {
    session: String,
    state: Arc<Mutex<(usize, HashMap<String, usize>)>>,
}

/// Which bound a message found full.
#[derive(Debug, thiserror::Error)]
enum Busy {
    #[error(
        "guardmesh: this MCP session already has {0} tools/call messages being judged \
         (--max-calls-per-session); try again when one is answered"
    )]
    Session(usize),
    #[error(
        "guardmesh: the gateway already has {0} tools/call messages being judged \
         (--max-calls-in-flight); try again shortly"
    )]
    Total(usize),
}

impl Busy {
    fn response(&self, id: Option<&serde_json::value::RawValue>) -> Response<Out> {
        let data = ErrorData::new(BUSY, self.to_string(), None);
        let mut response = error_response(StatusCode::TOO_MANY_REQUESTS, id, &data);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    }
}

impl CallLimits {
    fn new(per_session: u64, total: u64) -> Self {
        Self {
            per_session: usize::try_from(per_session).unwrap_or(usize::MAX),
            total: usize::try_from(total).unwrap_or(usize::MAX),
            state: Arc::default(),
        }
    }

    fn enter(&self, session: &str) -> Result<CallSlot, Busy> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.0 >= self.total {
            return Err(Busy::Total(self.total));
        }
        let count = state.1.entry(session.to_owned()).or_insert(0);
        if *count >= self.per_session {
            return Err(Busy::Session(self.per_session));
        }
        *count += 1;
        state.0 += 1;
        Ok(CallSlot {
            session: session.to_owned(),
            state: self.state.clone(),
        })
    }
}

impl Drop for CallSlot {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0 -= 1;
        if let Some(count) = state.1.get_mut(&self.session) {
            *count -= 1;
            if *count == 0 {
                state.1.remove(&self.session);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------

/// The open connections, under the cap, and which of them may make room
/// for a new one: those without a request in progress, oldest first.
struct Registry {
    cap: usize,
    state: Mutex<Connections>,
}

#[derive(Default)]
struct Connections {
    open: usize,
    tick: u64,
    /// Connections without a request in progress, by when they became so.
    idle: BTreeMap<u64, Arc<Conn>>,
    evicted: u64,
    refused: u64,
    logged: Option<std::time::Instant>,
}

/// [`Conn::key`] of a connection with a request in progress.
const BUSY_KEY: u64 = 0;
/// [`Conn::key`] of a connection closed to make room.
const EVICTED_KEY: u64 = u64::MAX;

struct Conn {
    /// Its key in [`Connections::idle`], or [`BUSY_KEY`] or
    /// [`EVICTED_KEY`]; changed only under the registry's lock.
    key: AtomicU64,
    close: tokio::sync::Notify,
}

/// A connection's place under the cap; given back on drop.
struct Slot {
    registry: Arc<Registry>,
    conn: Arc<Conn>,
}

/// A request in progress on a connection; the connection is idle again
/// when it is dropped (with the response body, once it is sent).
struct InProgress {
    registry: Arc<Registry>,
    conn: Arc<Conn>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Connections> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the connection idle the longest; whether there was one.
    fn evict(state: &mut Connections) -> bool {
        let Some((_, victim)) = state.idle.pop_first() else {
            return false;
        };
        victim.key.store(EVICTED_KEY, Ordering::Relaxed);
        victim.close.notify_one();
        state.open -= 1;
        state.evicted += 1;
        true
    }

    /// A place for a new connection: free, or made by closing the one idle
    /// the longest; `None` when every open connection has a request in
    /// progress.
    fn admit(self: &Arc<Self>) -> Option<Slot> {
        let mut state = self.lock();
        if state.open >= self.cap && !Self::evict(&mut state) {
            state.refused += 1;
            if state
                .logged
                .is_none_or(|at| at.elapsed() >= Duration::from_secs(5))
            {
                tracing::warn!(
                    cap = self.cap,
                    refused = state.refused,
                    "mcp http: every connection has a request in progress; closing new ones"
                );
                state.logged = Some(std::time::Instant::now());
            }
            return None;
        }
        state.open += 1;
        state.tick += 1;
        let conn = Arc::new(Conn {
            key: AtomicU64::new(state.tick),
            close: tokio::sync::Notify::new(),
        });
        let tick = state.tick;
        state.idle.insert(tick, conn.clone());
        Some(Slot {
            registry: self.clone(),
            conn,
        })
    }

    /// Frees a descriptor after a failed accept by closing the connection
    /// idle the longest.
    fn make_room(&self) -> bool {
        Self::evict(&mut self.lock())
    }

    /// A request starts on `conn`; `None` if it was closed to make room.
    fn start(self: &Arc<Self>, conn: &Arc<Conn>) -> Option<InProgress> {
        let mut state = self.lock();
        match conn.key.load(Ordering::Relaxed) {
            EVICTED_KEY => return None,
            BUSY_KEY => {}
            key => {
                state.idle.remove(&key);
                conn.key.store(BUSY_KEY, Ordering::Relaxed);
            }
        }
        Some(InProgress {
            registry: self.clone(),
            conn: conn.clone(),
        })
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        let mut state = self.registry.lock();
        if self.conn.key.load(Ordering::Relaxed) == BUSY_KEY {
            state.tick += 1;
            let tick = state.tick;
            self.conn.key.store(tick, Ordering::Relaxed);
            state.idle.insert(tick, self.conn.clone());
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = self.registry.lock();
        match self.conn.key.load(Ordering::Relaxed) {
            EVICTED_KEY => {}
            key => {
                if key != BUSY_KEY {
                    state.idle.remove(&key);
                }
                state.open -= 1;
            }
        }
        self.conn.key.store(EVICTED_KEY, Ordering::Relaxed);
    }
}

/// A response body that keeps its connection marked busy until it is
/// sent (or dropped).
struct Tracked {
    inner: Out,
    _in_progress: InProgress,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The connection cap when none is configured: half of the open-file limit
/// less a reserve (an eighth of it, at least 64), since each client
/// connection may need one to the upstream as well; 1024 when the process
/// has no limit.
fn automatic_connection_cap() -> usize {
    let Some(limit) = raise_open_file_limit() else {
        return 1024;
    };
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    (descriptors_for_connections(limit) / 2).max(16)
}

/// Serves HTTP/1.1 on one client connection until it ends or is closed to
/// make room for another.
async fn serve_connection<IO>(
    io: IO,
    proxy: Arc<Proxy>,
    slot: &Slot,
    local: SocketAddr,
    timeouts: ConnectionTimeouts,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (registry, conn) = (slot.registry.clone(), slot.conn.clone());
    let service = hyper::service::service_fn(move |request| {
        let proxy = proxy.clone();
        let in_progress = registry.start(&conn);
        async move {
            let Some(in_progress) = in_progress else {
                let data = ErrorData::new(
                    BUSY,
                    "guardmesh: the connection was closed to make room for another",
                    None,
                );
                return Ok::<_, std::convert::Infallible>(busy_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &data,
                ));
            };
            let response = proxy.serve(request, local).await;
            Ok(response.map(|inner| {
                Tracked {
                    inner,
                    _in_progress: in_progress,
                }
                .boxed()
            }))
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(timeouts.header)
        .max_buf_size(READ_BUFFER_BYTES)
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let aged = async {
        match timeouts.max_age {
            Some(age) => tokio::time::sleep(age).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(aged);
    let mut aging = true;
    loop {
        tokio::select! {
            _ = connection.as_mut() => break,
            () = slot.conn.close.notified() => break,
            // The request in progress, if any, is answered; then closed.
            () = aged.as_mut(), if aging => {
                aging = false;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// A client connection's bounds in time.
#[derive(Debug, Clone, Copy)]
struct ConnectionTimeouts {
    /// Time to send a request's headers (and to sit idle between requests).
    header: Duration,
    /// Age after which the connection is closed between requests.
    max_age: Option<Duration>,
}

async fn serve(
    listener: tokio::net::TcpListener,
    args: HttpArgs,
    upstream: Uri,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let server = args.server_name.clone().unwrap_or_else(|| {
        upstream
            .authority()
            .map_or_else(String::new, |a| a.as_str().to_owned())
    });
    let judge = Arc::new(
        Judge::new(args.mesh.clone(), "mcp-http")
            .with_server(server)
            .with_visibility(args.visibility.hide_skipped_tools),
    );
    let approver = crate::approval::link(&args.mesh, &args.approval).unwrap_or_else(|error| {
        tracing::warn!(%error, "asks are not put to the client's user");
        None
    });
    let proxy = Arc::new(Proxy {
        upstream,
        // An idle connection is dropped before common servers drop it (5 s
        // in uvicorn and Node): a request sent on a connection the upstream
        // is closing fails with a reset that cannot be retried.
        client: Client::builder(TokioExecutor::new())
            .pool_idle_timeout(UPSTREAM_IDLE)
            .build_http(),
        flight: crate::upstream::InFlight::default(),
        sessions: crate::sessions::Sessions::default(),
        grouper: crate::group::Grouper::new(
            judge.clone(),
            Duration::from_millis(args.batch_window_ms),
        ),
        interceptors: crate::interceptors::Interceptors::from_judge_args(&args.mesh),
        judge,
        max: args.max_message_bytes,
        body_timeout: Duration::from_millis(args.body_timeout_ms),
        budget: Arc::new(tokio::sync::Semaphore::new(
            args.max_buffered_bytes
                .min(tokio::sync::Semaphore::MAX_PERMITS),
        )),
        calls: CallLimits::new(args.max_calls_per_session, args.max_calls_in_flight),
        access: Access::new(&args, tls.is_some()),
        params: Default::default(),
        approver,
        elicitation_timeout: Duration::from_millis(args.approval.elicitation_timeout_ms),
        elicits: Mutex::default(),
    });
    let cap = match args.max_connections {
        0 => automatic_connection_cap(),
        n => n,
    };
    tracing::debug!(cap, "mcp http: connection cap");
    let registry = Arc::new(Registry {
        cap,
        state: Mutex::default(),
    });
    let timeouts = ConnectionTimeouts {
        header: Duration::from_millis(args.header_timeout_ms),
        max_age: (args.max_connection_age_ms > 0)
            .then(|| Duration::from_millis(args.max_connection_age_ms)),
    };
    let mut backoff = AcceptBackoff::new();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                backoff.succeeded();
                stream
            }
            Err(error) => {
                // Out of descriptors: the connection idle the longest
                // gives its own back.
                if out_of_descriptors(&error) {
                    registry.make_room();
                }
                backoff
                    .failed(|failures| {
                        tracing::warn!(
                            %error,
                            failures,
                            "mcp http: accept failed; backing off"
                        );
                    })
                    .await;
                continue;
            }
        };
        let Some(slot) = registry.admit() else {
            drop(stream);
            continue;
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let proxy = proxy.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_connection(stream, proxy, &slot, local, timeouts).await,
                Some(acceptor) => {
                    let handshake =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
                    tokio::select! {
                        accepted = handshake => match accepted {
                            Ok(Ok(stream)) => {
                                serve_connection(stream, proxy, &slot, local, timeouts).await;
                            }
                            Ok(Err(error)) => tracing::debug!(%error, "TLS handshake failed"),
                            Err(_) => tracing::debug!("TLS handshake timed out"),
                        },
                        () = slot.conn.close.notified() => {}
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        http: HttpArgs,
    }

    fn args(extra: &[&str]) -> HttpArgs {
        let mut argv = vec!["x", "--upstream", "http://127.0.0.1:1/mcp"];
        argv.extend(extra);
        Cli::parse_from(argv).http
    }

    fn headers(host: Option<&str>, origin: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(host) = host {
            headers.insert(header::HOST, HeaderValue::from_str(host).unwrap());
        }
        if let Some(origin) = origin {
            headers.insert(header::ORIGIN, HeaderValue::from_str(origin).unwrap());
        }
        headers
    }

    #[test]
    fn r31_tool_visibility_finds_and_replaces_listing_answers_in_json_and_sse_alike() {
        let listed =
            r#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"delete_db"},{"name":"w"}]}}"#;
        let other = r#"{"jsonrpc":"2.0","id":8,"result":{"tools":[{"name":"delete_db"}]}}"#;
        let keys = vec!["7".to_owned()];
        let visible = HashMap::from([(
            "7".to_owned(),
            r#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"w"}]}}"#.to_owned(),
        )]);
        // A batch's array: only the answer to the tools/list request.
        let body = format!("[{listed},{other}]");
        let found = listed_messages(&body, false, &keys);
        assert_eq!(found, [("7".to_owned(), listed.to_owned())]);
        let out: serde_json::Value =
            serde_json::from_str(&json_without_schemas(&body, &keys, &visible)).unwrap();
        assert_eq!(out[0]["result"]["tools"].as_array().unwrap().len(), 1);
        assert_eq!(out[1]["result"]["tools"][0]["name"], "delete_db");
        // SSE, the data over several lines.
        let pretty = serde_json::to_string_pretty(
            &serde_json::from_str::<serde_json::Value>(listed).unwrap(),
        )
        .unwrap();
        let data: String = pretty.lines().map(|l| format!("data: {l}\n")).collect();
        let sse = format!("event: message\n{data}\n");
        let found = listed_messages(&sse, true, &keys);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, "7");
        let out = sse_without_schemas(&sse, &keys, &visible);
        assert!(!out.contains("delete_db"), "{out}");
        assert!(out.contains(r#""name":"w""#), "{out}");
    }

    #[test]
    fn r31_output_schemas_leave_tools_list_answers_in_json_and_sse_alike() {
        let listed = r#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"w","inputSchema":{},"outputSchema":{"type":"object"}}]}}"#;
        let other =
            r#"{"jsonrpc":"2.0","id":8,"result":{"tools":[{"name":"w","outputSchema":{}}]}}"#;
        let keys = vec!["7".to_owned()];
        // Only the answer to the tools/list request is changed.
        let json = json_without_schemas(&format!("[{listed},{other}]"), &keys, &HashMap::new());
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert!(
            value[0]["result"]["tools"][0].get("outputSchema").is_none(),
            "{json}"
        );
        assert!(
            value[1]["result"]["tools"][0].get("outputSchema").is_some(),
            "{json}"
        );
        // SSE: each event's other fields kept, its data rewritten; a data
        // spread over several lines is read whole.
        let pretty = serde_json::to_string_pretty(
            &serde_json::from_str::<serde_json::Value>(listed).unwrap(),
        )
        .unwrap();
        let data: String = pretty.lines().map(|l| format!("data: {l}\r\n")).collect();
        let sse = format!("event: message\r\nid: e1\r\n{data}\r\n: comment\n\n");
        let out = sse_without_schemas(&sse, &keys, &HashMap::new());
        assert!(out.starts_with("event: message\nid: e1\ndata: {"), "{out}");
        assert!(!out.contains("outputSchema"), "{out}");
        assert!(out.contains(": comment\n\n"), "{out}");
        let event: String = out
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect::<Vec<_>>()
            .join("\n");
        let value: serde_json::Value = serde_json::from_str(&event).unwrap();
        assert_eq!(value["result"]["tools"][0]["name"], "w");
    }

    #[test]
    fn r31_host_and_origin_name_the_gateway_or_an_allowed_one() {
        let access = Access::new(
            &args(&[
                "--allowed-host",
                "mcp.internal",
                "--allowed-host",
                "Gw.Example:8443",
                "--allowed-origin",
                "https://App.example/",
            ]),
            false,
        );
        let local: SocketAddr = "127.0.0.1:8808".parse().unwrap();
        let v6: SocketAddr = "[::1]:8808".parse().unwrap();
        let ok = |host: &str, origin: Option<&str>, local| {
            access.check(&headers(Some(host), origin), local).is_ok()
        };
        for host in [
            "127.0.0.1:8808",
            "localhost:8808",
            "LOCALHOST:8808",
            "mcp.internal",
            "mcp.internal:1",
            "gw.example:8443",
        ] {
            assert!(ok(host, None, local), "{host}");
        }
        assert!(ok("[::1]:8808", None, v6));
        assert!(ok("localhost:8808", None, v6));
        for host in [
            "127.0.0.1:8809",
            "127.0.0.1",
            "localhost",
            "evil.example:8808",
            "127.0.0.2:8808",
            "gw.example",
            "gw.example:443",
            "[::1]:8808",
            "user@127.0.0.1:8808",
            "",
            "127.0.0.1:8808/x",
        ] {
            assert!(!ok(host, None, local), "{host}");
        }
        assert!(matches!(
            access.check(&headers(None, None), local),
            Err(Refused::NoHost)
        ));
        let host = "127.0.0.1:8808";
        for origin in [
            "http://127.0.0.1:8808",
            "http://localhost:8808",
            "https://app.example",
            "HTTPS://APP.EXAMPLE/",
        ] {
            assert!(ok(host, Some(origin), local), "{origin}");
        }
        for origin in [
            "null",
            "http://evil.example",
            "https://127.0.0.1:8808",
            "http://127.0.0.1:8809",
            "http://127.0.0.1",
            "https://app.example:444",
            "file://",
            "",
        ] {
            assert!(!ok(host, Some(origin), local), "{origin}");
        }
        // Port 80 may be left out.
        let local80: SocketAddr = "127.0.0.1:80".parse().unwrap();
        assert!(ok("127.0.0.1", Some("http://localhost"), local80));
    }

    #[test]
    fn r25_calls_are_bounded_per_session_and_in_all() {
        let limits = CallLimits::new(2, 3);
        let a1 = limits.enter("a").unwrap();
        let _a2 = limits.enter("a").unwrap();
        assert!(matches!(limits.enter("a"), Err(Busy::Session(2))));
        let b1 = limits.enter("b").unwrap();
        assert!(matches!(limits.enter("c"), Err(Busy::Total(3))));
        drop(a1);
        let _c1 = limits.enter("c").unwrap();
        drop(b1);
        let _a3 = limits.enter("a").unwrap();
        assert!(matches!(limits.enter("a"), Err(Busy::Total(3))));
        let state = limits.state.lock().unwrap();
        assert_eq!(state.0, 3);
        assert!(!state.1.contains_key("b"), "an empty session is forgotten");
    }

    #[test]
    fn r25_a_new_connection_takes_the_place_of_the_longest_idle() {
        let registry = Arc::new(Registry {
            cap: 2,
            state: Mutex::default(),
        });
        let first = registry.admit().unwrap();
        let second = registry.admit().unwrap();
        let busy = registry.start(&first.conn).unwrap();
        // At the cap: the idle one (second) makes room, the busy one stays.
        let third = registry.admit().unwrap();
        assert_eq!(second.conn.key.load(Ordering::Relaxed), EVICTED_KEY);
        assert!(registry.start(&second.conn).is_none());
        assert_eq!(registry.lock().open, 2);
        // Every open connection busy: a new one is refused.
        let _busy3 = registry.start(&third.conn).unwrap();
        assert!(registry.admit().is_none());
        // The first becomes idle again: it is the next to make room.
        drop(busy);
        let _fourth = registry.admit().unwrap();
        assert_eq!(first.conn.key.load(Ordering::Relaxed), EVICTED_KEY);
        drop(second);
        drop(first);
        assert_eq!(registry.lock().open, 2);
        drop(third);
        assert_eq!(registry.lock().open, 1);
    }
}
