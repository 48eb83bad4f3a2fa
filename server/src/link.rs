//! One long-lived `Judge` stream per guard, multiplexed by request id.
//!
//! Opening a gRPC call per guard per batch costs several times the CPU of
//! sending one message on an open stream, so the mesh keeps one stream per
//! guard and tags each batch with a `request_id`. A [`GuardLink`] owns that
//! stream: a background task connects, reads answers and routes each to the
//! batch waiting for it, and reconnects with bounded exponential backoff and
//! jitter when the stream ends.
//!
//! A link never blocks a batch on a reconnect: while the guard is known to be
//! down (between attempts) a request fails at once as unreachable, and the
//! batch applies the guard's failure policy (R13). The first request on a new
//! stream is queued *before* the mesh waits for response headers, because some
//! gRPC stacks (Python's sync server) send none until their first answer.

use guardmesh_proto::v1::guard_service_client::GuardServiceClient;
use guardmesh_proto::v1::{CancelBatch, GuardBatch, JudgeRequest, JudgeResponse, judge_request};
use rand::Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// Why a guard could not answer a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GuardFailure {
    #[error("unreachable: {0}")]
    Unreachable(Arc<str>),
    #[error("answered with gRPC error {code:?}: {message}")]
    Status { code: tonic::Code, message: String },
    #[error("answered with an error: {0}")]
    Refused(String),
    #[error("closed its stream without answering")]
    StreamClosed,
    #[error("did not answer within {0:?}")]
    TimedOut(Duration),
    #[error("rewrite rejected: {0}")]
    RejectedRewrite(String),
    #[error(
        "circuit open after {failures} consecutive failures (last: {last}); next probe in {retry_in:?}"
    )]
    CircuitOpen {
        failures: u32,
        last: Arc<str>,
        retry_in: Duration,
    },
}

impl GuardFailure {
    /// Whether this failure says something about the guard's availability
    /// (and so counts towards opening its circuit). A rejected rewrite is a
    /// policy bug, not an outage; an open circuit is not a new failure.
    pub fn counts_for_circuit(&self) -> bool {
        !matches!(self, Self::RejectedRewrite(_) | Self::CircuitOpen { .. })
    }
}

impl GuardFailure {
    fn from_status(status: &tonic::Status) -> Self {
        Self::Status {
            code: status.code(),
            message: status.message().to_owned(),
        }
    }
}

/// What a link reports to the batch that sent a request.
#[derive(Debug)]
pub enum LinkEvent {
    /// An answer (possibly partial) from the guard at index `tag`.
    Answer { tag: usize, response: JudgeResponse },
    /// The request to the guard at index `tag` failed.
    Failed { tag: usize, failure: GuardFailure },
}

/// Settings for connecting to guards.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    pub connect_timeout: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Largest answer accepted from a guard.
    pub max_decoding_message_size: usize,
    /// Largest request sent to a guard.
    pub max_encoding_message_size: usize,
    /// Consecutive failures that open a guard's circuit; 0 disables it.
    pub circuit_failures: u32,
    /// How long an open circuit fails requests at once before it lets one
    /// probe request through (half-open).
    pub circuit_open_for: Duration,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            max_decoding_message_size: 4 * 1024 * 1024,
            max_encoding_message_size: 16 * 1024 * 1024,
            circuit_failures: 5,
            circuit_open_for: Duration::from_secs(5),
        }
    }
}

struct Waiter {
    tag: usize,
    events: mpsc::UnboundedSender<LinkEvent>,
}

enum Conn {
    /// A stream is being opened or is open; requests go into `tx`.
    Open(mpsc::UnboundedSender<JudgeRequest>),
    /// The last attempt failed; requests fail fast until the next attempt.
    Down(Arc<str>),
}

struct State {
    conn: Conn,
    waiting: HashMap<u64, Waiter>,
    circuit: Circuit,
}

/// A circuit breaker: after `circuit_failures` consecutive failures the
/// guard's failure policy applies at once, without waiting for timeouts,
/// until a probe request succeeds. An open circuit is a failure like any
/// other (R13): under `fail_closed` it blocks, it never bypasses.
#[derive(Debug, Default)]
struct Circuit {
    failures: u32,
    last: Option<Arc<str>>,
    /// Set while open: when the next probe may go.
    open_until: Option<tokio::time::Instant>,
    /// Set while a half-open probe is out: when it was sent.
    probe_since: Option<tokio::time::Instant>,
}

struct Shared {
    name: String,
    circuit_failures: u32,
    circuit_open_for: Duration,
    metrics: Arc<crate::metrics::Metrics>,
    endpoint: String,
    state: Mutex<State>,
    next_id: AtomicU64,
    /// Whether the current outage was already logged.
    outage: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Marks an outage; true when it is a new one (to be logged).
    fn outage_started(&self) -> bool {
        !self.outage.swap(true, Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Fails every waiting request and moves to `conn`.
    fn fail_all(&self, failure: GuardFailure, conn: Conn) {
        let waiting = {
            let mut state = self.lock();
            state.conn = conn;
            std::mem::take(&mut state.waiting)
        };
        for (_, waiter) in waiting {
            let _ = waiter.events.send(LinkEvent::Failed {
                tag: waiter.tag,
                failure: failure.clone(),
            });
        }
    }
}

/// The mesh's connection to one guard.
pub struct GuardLink {
    shared: Arc<Shared>,
    task: tokio::task::AbortHandle,
    pin: Option<String>,
}

impl std::fmt::Debug for GuardLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardLink")
            .field("name", &self.shared.name)
            .field("endpoint", &self.shared.endpoint)
            .finish()
    }
}

impl Drop for GuardLink {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.fail_all(
            GuardFailure::Unreachable("guard link closed".into()),
            Conn::Down("guard link closed".into()),
        );
    }
}

impl GuardLink {
    /// Starts connecting to `endpoint` in the background. Must be called
    /// within a tokio runtime.
    pub fn spawn(
        name: &str,
        endpoint: &str,
        config: LinkConfig,
        connector: crate::dial::GuardConnector,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Self {
        let pin = connector.pin.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            circuit_failures: config.circuit_failures,
            circuit_open_for: config.circuit_open_for,
            metrics,
            endpoint: endpoint.to_owned(),
            state: Mutex::new(State {
                conn: Conn::Open(tx),
                waiting: HashMap::new(),
                circuit: Circuit::default(),
            }),
            next_id: AtomicU64::new(1),
            outage: std::sync::atomic::AtomicBool::new(false),
        });
        let task = tokio::spawn(run(shared.clone(), config, connector, rx)).abort_handle();
        Self { shared, task, pin }
    }

    /// The identity this link requires of the guard, if pinned.
    pub fn pin(&self) -> Option<&str> {
        self.pin.as_deref()
    }

    /// The endpoint this link dials.
    pub fn endpoint(&self) -> &str {
        &self.shared.endpoint
    }

    /// Sends `batch` (its `request_id` is assigned here). The answer or the
    /// failure arrives on `events`, tagged with `tag`. Fails at once when the
    /// guard is known to be down.
    pub fn send(
        &self,
        mut batch: GuardBatch,
        tag: usize,
        events: &mpsc::UnboundedSender<LinkEvent>,
    ) -> Result<u64, GuardFailure> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        batch.request_id = id;
        let mut state = self.shared.lock();
        self.admit(&mut state)?;
        let tx = match &state.conn {
            Conn::Open(tx) => tx.clone(),
            Conn::Down(error) => return Err(GuardFailure::Unreachable(error.clone())),
        };
        let request = JudgeRequest {
            kind: Some(judge_request::Kind::Batch(batch)),
        };
        if tx.send(request).is_err() {
            return Err(GuardFailure::Unreachable("stream is closing".into()));
        }
        state.waiting.insert(
            id,
            Waiter {
                tag,
                events: events.clone(),
            },
        );
        Ok(id)
    }

    /// Lets a request through the circuit breaker, or refuses it at once.
    fn admit(&self, state: &mut State) -> Result<(), GuardFailure> {
        let circuit = &mut state.circuit;
        let Some(until) = circuit.open_until else {
            return Ok(());
        };
        let now = tokio::time::Instant::now();
        let probe_stale = circuit
            .probe_since
            .is_none_or(|since| now.duration_since(since) >= self.shared.circuit_open_for);
        if now >= until && probe_stale {
            // Half-open: this request is the probe.
            circuit.probe_since = Some(now);
            return Ok(());
        }
        Err(GuardFailure::CircuitOpen {
            failures: circuit.failures,
            last: circuit.last.clone().unwrap_or_else(|| "unknown".into()),
            retry_in: until.saturating_duration_since(now),
        })
    }

    /// Records how a request to this guard ended, for its circuit breaker.
    pub fn record(&self, outcome: Result<(), &GuardFailure>) {
        let threshold = self.shared.circuit_failures;
        if threshold == 0 {
            return;
        }
        let mut state = self.shared.lock();
        let circuit = &mut state.circuit;
        match outcome {
            Ok(()) => {
                if circuit.open_until.is_some() {
                    tracing::info!(guard = %self.shared.name, "circuit closed: probe succeeded");
                }
                *circuit = Circuit::default();
            }
            Err(failure) if failure.counts_for_circuit() => {
                circuit.failures = circuit.failures.saturating_add(1);
                circuit.last = Some(failure.to_string().into());
                let probing = circuit.probe_since.take().is_some();
                if circuit.failures >= threshold || probing {
                    let until = tokio::time::Instant::now() + self.shared.circuit_open_for;
                    if circuit.open_until.is_none() || probing {
                        tracing::warn!(
                            guard = %self.shared.name,
                            failures = circuit.failures,
                            error = %failure,
                            "circuit open: the guard's failure policy applies at once for {:?}",
                            self.shared.circuit_open_for
                        );
                        self.shared.metrics.circuit_opened(&self.shared.name);
                    }
                    circuit.open_until = Some(until);
                }
            }
            Err(_) => {}
        }
    }

    /// Withdraws a request: its answer no longer matters (R5, or a timeout).
    /// The guard is told so it can stop work; a late answer is ignored.
    pub fn cancel(&self, request_id: u64) {
        let mut state = self.shared.lock();
        if state.waiting.remove(&request_id).is_some()
            && let Conn::Open(tx) = &state.conn
        {
            let _ = tx.send(JudgeRequest {
                kind: Some(judge_request::Kind::Cancel(CancelBatch { request_id })),
            });
        }
    }
}

/// The link's life: connect, serve one stream, back off, repeat.
async fn run(
    shared: Arc<Shared>,
    config: LinkConfig,
    connector: crate::dial::GuardConnector,
    first_rx: mpsc::UnboundedReceiver<JudgeRequest>,
) {
    let mut rx = Some(first_rx);
    let mut backoff = config.backoff_initial;
    loop {
        let requests = match rx.take() {
            Some(rx) => rx,
            None => {
                let (tx, rx) = mpsc::unbounded_channel();
                shared.lock().conn = Conn::Open(tx);
                rx
            }
        };
        let answered = serve_stream(&shared, &config, &connector, requests).await;
        if answered {
            backoff = config.backoff_initial;
        }
        // Full jitter over the current step keeps a fleet of meshes from
        // reconnecting to a restarted guard in lockstep.
        let pause = backoff.mul_f64(rand::rng().random_range(0.5..=1.0));
        tokio::time::sleep(pause).await;
        backoff = (backoff * 2).min(config.backoff_max);
    }
}

/// Opens one stream and routes its answers until it ends. Returns whether the
/// guard answered anything (to reset the backoff).
async fn serve_stream(
    shared: &Shared,
    config: &LinkConfig,
    connector: &crate::dial::GuardConnector,
    requests: mpsc::UnboundedReceiver<JudgeRequest>,
) -> bool {
    // The connector resolves, applies the endpoint policy, connects and
    // speaks TLS for https:// guards (see dial.rs).
    let dial = match shared.endpoint.strip_prefix("https://") {
        Some(rest) => format!("http://{rest}"),
        None => shared.endpoint.clone(),
    };
    let channel = match tonic::transport::Endpoint::from_shared(dial) {
        Ok(endpoint) => {
            // HTTP/2 keepalive finds half-dead connections (a guard host that
            // vanished without a FIN) instead of waiting for timeouts.
            endpoint
                .connect_timeout(config.connect_timeout)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true)
                .connect_with_connector(connector.clone())
                .await
        }
        Err(error) => {
            let reason: Arc<str> = format!("bad endpoint {}: {error}", shared.endpoint).into();
            shared.fail_all(
                GuardFailure::Unreachable(reason.clone()),
                Conn::Down(reason),
            );
            return false;
        }
    };
    let channel = match channel {
        Ok(channel) => channel,
        Err(error) => {
            let reason: Arc<str> = format!("{}: {}", shared.endpoint, error_chain(&error)).into();
            // Warn once per outage; the retries that follow log at debug.
            if shared.outage_started() {
                tracing::warn!(guard = %shared.name, error = %reason, "guard unreachable; retrying with backoff");
            } else {
                tracing::debug!(guard = %shared.name, error = %reason, "guard still unreachable");
            }
            shared.fail_all(
                GuardFailure::Unreachable(reason.clone()),
                Conn::Down(reason),
            );
            return false;
        }
    };
    let mut client = GuardServiceClient::new(channel)
        .max_decoding_message_size(config.max_decoding_message_size)
        .max_encoding_message_size(config.max_encoding_message_size);
    let mut answers = match client.judge(UnboundedReceiverStream::new(requests)).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tracing::warn!(guard = %shared.name, %status, "guard refused the Judge stream");
            let reason: Arc<str> = format!("Judge stream refused: {status}").into();
            shared.fail_all(GuardFailure::from_status(&status), Conn::Down(reason));
            return false;
        }
    };
    tracing::debug!(guard = %shared.name, endpoint = %shared.endpoint, "guard stream open");
    shared.outage.store(false, Ordering::Relaxed);
    let mut answered = false;
    let (failure, reason): (GuardFailure, Arc<str>) = loop {
        match answers.message().await {
            Ok(Some(response)) => {
                answered = true;
                route(shared, response);
            }
            Ok(None) => break (GuardFailure::StreamClosed, "guard closed its stream".into()),
            Err(status) => {
                break (
                    GuardFailure::from_status(&status),
                    format!("stream failed: {status}").into(),
                );
            }
        }
    };
    tracing::warn!(guard = %shared.name, error = %failure, "guard stream ended");
    shared.fail_all(failure, Conn::Down(reason));
    answered
}

/// Hands an answer to the batch waiting for it. Answers for requests that
/// are not waiting (cancelled, timed out, unknown) are dropped and counted.
fn route(shared: &Shared, response: JudgeResponse) {
    let id = response.request_id;
    let mut state = shared.lock();
    let waiter = if response.partial {
        state.waiting.get(&id).map(|w| (w.tag, w.events.clone()))
    } else {
        state.waiting.remove(&id).map(|w| (w.tag, w.events))
    };
    drop(state);
    match waiter {
        Some((tag, events)) => {
            let _ = events.send(LinkEvent::Answer { tag, response });
        }
        None => {
            shared.metrics.spurious_answer(&shared.name);
            tracing::debug!(guard = %shared.name, request_id = id, "answer for a request no one waits for");
        }
    }
}

/// Renders an error with its sources, walking the chain rather than relying
/// on one layer's `Display`.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}
