//! The coordinator side: evaluate rounds of tool calls before running them.
//!
//! ```no_run
//! # async fn demo() -> Result<(), guardmesh_client::ClientError> {
//! use guardmesh_client::{Batch, Coordinator, Outcome};
//! let mesh = Coordinator::connect("127.0.0.1:50051").await?;
//! let session = mesh.session("session-1").await?;
//! let decision = session
//!     .evaluate(Batch::turn(0).call("c1", "sql.query", r#"{"sql":"DELETE FROM t"}"#))
//!     .await?;
//! for call in &decision.calls {
//!     match &call.outcome {
//!         Outcome::Proceed => { /* run call.final_call */ }
//!         Outcome::Steer { content } | Outcome::Cancel { content } => {
//!             /* give `content` to the model instead of the tool's result */
//!         }
//!         Outcome::Ask { content, approval } => {
//!             /* give `content` to the model; once a person approves
//!                `approval.id`, submit the same call again with
//!                `Batch::approval(&call.call_id, &approval.id)` (R35) */
//!         }
//!     }
//! }
//! # Ok(()) }
//! ```

use crate::connect::{Authorized, Connection, Credentials, MAX_MESSAGE_BYTES};
use crate::error::ClientError;
use crate::proto::pre_tool_service_client::PreToolServiceClient;
use crate::proto::{
    self, Action, BatchContext, EvaluateRequest, EvaluateResponse, GuardTrace, ResultAction,
    ToolCall, ToolResult, TraceStatus, evaluate_response,
};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// One round of tool calls to evaluate.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    /// The turn of the session this round belongs to.
    pub turn_index: u32,
    /// The model's text for the round.
    pub model_text: String,
    /// Free metadata: tenant, user, agent, ...
    pub metadata: HashMap<String, String>,
    /// The calls, in the model's order.
    pub calls: Vec<ToolCall>,
    /// Deadline for the batch; `None` uses the mesh's default.
    pub timeout: Option<Duration>,
    /// W3C `traceparent` to send; `None` sends the current span's (R22).
    pub traceparent: Option<String>,
    /// Results of calls that ran, to judge before the model reads them
    /// (R33). A batch carries calls or results, not both: the mesh refuses
    /// one with both (INVALID_ARGUMENT).
    pub results: Vec<ToolResult>,
    /// Approvals the batch uses, by call id (R35): see [`Batch::approval`].
    pub approvals: HashMap<String, String>,
}

impl Batch {
    /// An empty batch for turn `turn_index` of the session: the index of
    /// the model's round the calls come from (0, 1, 2, ...), which guards
    /// and the decision log see. Same as [`Batch::new`].
    ///
    /// ```
    /// use guardmesh_client::Batch;
    /// let batch = Batch::turn(3).call("c1", "sql.query", r#"{"sql":"SELECT 1"}"#);
    /// assert_eq!(batch.turn_index, 3);
    /// ```
    pub fn turn(turn_index: u32) -> Self {
        Self {
            turn_index,
            ..Self::default()
        }
    }

    /// An empty batch for turn `turn_index` (see [`Batch::turn`]).
    pub fn new(turn_index: u32) -> Self {
        Self::turn(turn_index)
    }

    /// Adds a call whose arguments are any value that serializes to a JSON
    /// object (a `serde_json::Value`, a struct deriving `Serialize`, a
    /// map). Refused, naming the call, when it does not serialize or is
    /// not an object.
    ///
    /// ```
    /// use guardmesh_client::Batch;
    /// let batch = Batch::turn(0)
    ///     .call_args("c1", "email.send", &serde_json::json!({"to": "a@example.com"}))?;
    /// assert_eq!(batch.calls[0].arguments, r#"{"to":"a@example.com"}"#);
    /// assert!(Batch::turn(0).call_args("c2", "t", &[1, 2]).is_err());
    /// # Ok::<(), guardmesh_client::ClientError>(())
    /// ```
    pub fn call_args(
        self,
        call_id: impl Into<String>,
        tool: impl Into<String>,
        arguments: &impl serde::Serialize,
    ) -> Result<Self, ClientError> {
        let call_id = call_id.into();
        let value = serde_json::to_value(arguments)?;
        if !value.is_object() {
            return Err(ClientError::Arguments {
                call_id,
                reason: format!("a JSON object is expected, not {}", json_kind(&value)),
            });
        }
        let text = serde_json::to_string(&value)?;
        Ok(self.call(call_id, tool, text))
    }

    /// Adds a call; `arguments` is a JSON object as text (see
    /// [`Batch::call_args`] for values).
    pub fn call(
        mut self,
        call_id: impl Into<String>,
        tool: impl Into<String>,
        arguments: impl Into<String>,
    ) -> Self {
        self.calls.push(ToolCall {
            call_id: call_id.into(),
            tool: tool.into(),
            arguments: arguments.into(),
        });
        self
    }

    /// Adds the result of a call that ran (R33): `result` is the MCP
    /// `CallToolResult` as JSON text (`content`, and optionally
    /// `structuredContent`, `isError`, `_meta`); `server` is the server or
    /// namespace the tool belongs to (may be empty).
    pub fn result(
        mut self,
        call_id: impl Into<String>,
        tool: impl Into<String>,
        server: impl Into<String>,
        result: impl Into<String>,
    ) -> Self {
        self.results.push(ToolResult {
            call_id: call_id.into(),
            tool: tool.into(),
            server: server.into(),
            result: result.into(),
        });
        self
    }

    /// Uses the approval request `request_id` (from an earlier
    /// [`Outcome::Ask`] of this same call, now approved by a person) for
    /// the call `call_id` of this batch (R35). The mesh then does not ask
    /// that guard again for it; the guards after it still judge it. The
    /// call must be the same (tool and arguments) and the approval unused;
    /// otherwise the decision says why in
    /// [`CallDecision::approval_refused`]. A call several guards asked
    /// about takes one approval per guard: call this once for each.
    ///
    /// ```
    /// use guardmesh_client::Batch;
    /// let batch = Batch::turn(1)
    ///     .call("c1", "refund", r#"{"amount":1500}"#)
    ///     .approval("c1", "9f2c...");
    /// assert_eq!(batch.approvals["c1"], "9f2c...");
    /// ```
    pub fn approval(mut self, call_id: impl Into<String>, request_id: impl Into<String>) -> Self {
        // A call two guards asked about names both requests.
        let request_id = request_id.into();
        self.approvals
            .entry(call_id.into())
            .and_modify(|ids| {
                ids.push(',');
                ids.push_str(&request_id);
            })
            .or_insert(request_id);
        self
    }

    /// Whether the batch has nothing to judge (R1): no call and no result.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty() && self.results.is_empty()
    }

    /// Sets the model's text for the round.
    pub fn model_text(mut self, text: impl Into<String>) -> Self {
        self.model_text = text.into();
        self
    }

    /// Adds a metadata entry (tenant, user, agent, ...).
    pub fn meta(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Sends this W3C `traceparent` instead of the current span's.
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.traceparent = Some(traceparent.into());
        self
    }

    /// Sets the batch's deadline.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The batch's wire form, as a session sends it: `batch_id`, in the
    /// agent session `session_id`, with the current span's `traceparent`
    /// when none was set (R22). For callers that hand batches to a mesh
    /// other than over a [`Session`] (a gateway embedding the mesh).
    pub fn into_request(self, batch_id: String, session_id: &str) -> EvaluateRequest {
        // R22: the batch joins the trace of the caller's current span.
        let traceparent = self
            .traceparent
            .or_else(crate::trace::current_traceparent)
            .unwrap_or_default();
        EvaluateRequest {
            traceparent,
            tracestate: String::new(),
            batch_id,
            context: Some(BatchContext {
                session_id: session_id.to_owned(),
                turn_index: self.turn_index,
                model_text: self.model_text,
                metadata: self.metadata,
            }),
            calls: self.calls,
            results: self.results,
            approvals: self.approvals,
            timeout_ms: self.timeout.map_or(0, |t| {
                u32::try_from(t.as_millis()).unwrap_or(u32::MAX).max(1)
            }),
        }
    }
}

/// What to do with one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Run [`CallDecision::final_call`].
    Proceed,
    /// Do not run it; give the model `content` as an error result (it should
    /// fix the call and retry).
    Steer {
        /// What the model reads instead of the tool's result.
        content: String,
    },
    /// Do not run it; give the model `content` as a benign result (it should
    /// move on).
    Cancel {
        /// What the model reads instead of the tool's result.
        content: String,
    },
    /// Do not run it yet: a guard asks a person to approve it (R35). Give
    /// the model `content`; once `approval` is approved (by an approver,
    /// through [`crate::Approver`] or `guardmesh approvals approve`),
    /// submit the same call again with [`Batch::approval`].
    Ask {
        /// What the model reads meanwhile.
        content: String,
        /// The approval request: its id, the guard that asked, its reason,
        /// the call's digest, the expiry.
        approval: Box<proto::ApprovalRequest>,
    },
}

/// The mesh's decision for one call (R2, R12).
#[derive(Debug, Clone, PartialEq)]
pub struct CallDecision {
    /// The call's id, as the coordinator sent it.
    pub call_id: String,
    /// Run it, or what the model reads instead.
    pub outcome: Outcome,
    /// The call as the coordinator sent it (R12).
    pub original: ToolCall,
    /// The call as it must run, after rewrites (R12).
    pub final_call: ToolCall,
    /// The guard whose skip decided, for steer and cancel.
    pub decided_by: Option<String>,
    /// For a skip by a policy guard (R27): the rule that decided, as the
    /// decision log records it; for a policy guard's failure, the rule
    /// that failed to evaluate. `None` for other guards.
    pub rule: Option<String>,
    /// True when the skip comes from a guard's failure (R13).
    pub failure: bool,
    /// Mutate guards that rewrote the call, in order.
    pub rewritten_by: Vec<String>,
    /// `fail_open` guards that failed and were bypassed.
    pub bypassed: Vec<String>,
    /// When the batch named an approval for this call that did not hold:
    /// why (R35). The approval was not used.
    pub approval_refused: Option<String>,
    /// When an approval stood in for a guard's ask and the call proceeds:
    /// the approval request's id, now used (R35).
    pub approved_by_request: Option<String>,
}

/// `an array`, `a string`, ...: what a JSON value is.
fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

impl CallDecision {
    /// The arguments of the call as it must run (after rewrites), as a
    /// JSON value; `{}` when they are empty.
    pub fn arguments(&self) -> Result<serde_json::Value, ClientError> {
        let text = self.final_call.arguments.trim();
        if text.is_empty() {
            return Ok(serde_json::Value::Object(serde_json::Map::new()));
        }
        serde_json::from_str(text).map_err(|error| ClientError::Arguments {
            call_id: self.call_id.clone(),
            reason: format!("the mesh's arguments are not JSON: {error}"),
        })
    }

    /// The arguments of the call as it must run, read into `T` (the type
    /// the tool takes).
    ///
    /// ```
    /// # use guardmesh_client::{CallDecision, Outcome, proto::ToolCall};
    /// #[derive(serde::Deserialize)]
    /// struct Query { sql: String }
    /// # let call = ToolCall { call_id: "c1".into(), tool: "sql.query".into(), arguments: r#"{"sql":"SELECT 1"}"#.into() };
    /// # let decision = CallDecision { call_id: "c1".into(), outcome: Outcome::Proceed, original: call.clone(), final_call: call, decided_by: None, rule: None, failure: false, rewritten_by: vec![], bypassed: vec![], approval_refused: None, approved_by_request: None };
    /// let query: Query = decision.arguments_as()?;
    /// assert_eq!(query.sql, "SELECT 1");
    /// # Ok::<(), guardmesh_client::ClientError>(())
    /// ```
    pub fn arguments_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, ClientError> {
        serde_json::from_value(self.arguments()?).map_err(|error| ClientError::Arguments {
            call_id: self.call_id.clone(),
            reason: format!("the arguments do not read as the type asked for: {error}"),
        })
    }

    /// Whether the call may run.
    pub fn proceeds(&self) -> bool {
        self.outcome == Outcome::Proceed
    }

    /// The approval request, when a guard asks a person first (R35).
    pub fn ask(&self) -> Option<&proto::ApprovalRequest> {
        match &self.outcome {
            Outcome::Ask { approval, .. } => Some(approval),
            _ => None,
        }
    }

    /// Whether a guard rewrote the call.
    pub fn rewritten(&self) -> bool {
        self.original != self.final_call
    }

    /// A diff-friendly view of a rewrite: the top-level argument keys that
    /// were added, removed or changed, sorted. Empty when nothing changed or
    /// the arguments are not JSON objects.
    pub fn changed_argument_keys(&self) -> Vec<String> {
        let parse = |text: &str| match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        let before = parse(&self.original.arguments);
        let after = parse(&self.final_call.arguments);
        let keys: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
        keys.into_iter()
            .filter(|k| before.get(*k) != after.get(*k))
            .cloned()
            .collect()
    }
}

/// What becomes of one result (R33).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResultOutcome {
    /// The model reads the result as the tool returned it.
    Pass,
    /// The model reads the result as mutate guards rewrote it
    /// ([`ResultDecision::result`]).
    Rewrite,
    /// A guard blocked it: the model reads an error result holding
    /// `content` ([`ResultDecision::result`]).
    Block {
        /// The guard's content.
        content: String,
    },
}

/// The mesh's decision for one result (R33).
#[derive(Debug, Clone, PartialEq)]
pub struct ResultDecision {
    /// The id of the call that produced the result.
    pub call_id: String,
    /// Pass, rewrite or block.
    pub outcome: ResultOutcome,
    /// What the model reads: a `CallToolResult` as JSON text (the result
    /// as sent, as rewritten, or the error result of a block).
    pub result: String,
    /// The result as the coordinator sent it.
    pub original: ToolResult,
    /// The guard that blocked it.
    pub decided_by: Option<String>,
    /// True when the block comes from a guard's failure (R13).
    pub failure: bool,
    /// Mutate guards that rewrote the result, in order.
    pub rewritten_by: Vec<String>,
    /// `fail_open` guards that failed and were bypassed.
    pub bypassed: Vec<String>,
}

impl ResultDecision {
    /// Whether a guard blocked the result.
    pub fn blocked(&self) -> bool {
        matches!(self.outcome, ResultOutcome::Block { .. })
    }

    /// What the model reads, parsed.
    pub fn result_json(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(&self.result)
    }
}

/// The mesh's answer for one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchDecision {
    /// The batch's id.
    pub batch_id: String,
    /// One per call, in batch order (R2).
    pub calls: Vec<CallDecision>,
    /// The calls to run, final form, in batch order.
    pub execute: Vec<ToolCall>,
    /// One entry per guard of the chain (R21).
    /// See [`BatchDecision::guard`] and [`BatchDecision::status`].
    pub trace: Vec<GuardTrace>,
    /// The revision of the chain that judged the batch (R17).
    pub chain_revision: u64,
    /// OpenTelemetry trace id, when tracing is on.
    pub trace_id: String,
    /// For a batch of results: one per result, in order (R33).
    pub results: Vec<ResultDecision>,
    /// Whether the chain judges results (R33): when false, sending the
    /// results of this batch's calls changes nothing.
    pub judges_results: bool,
}

impl BatchDecision {
    /// The decision of a batch with no calls, made without the mesh (R1).
    pub fn empty(batch_id: String) -> Self {
        Self {
            batch_id,
            calls: Vec::new(),
            execute: Vec::new(),
            trace: Vec::new(),
            chain_revision: 0,
            trace_id: String::new(),
            results: Vec::new(),
            judges_results: false,
        }
    }

    /// Reads a wire decision.
    pub fn from_wire(batch_id: String, wire: proto::BatchDecision) -> Result<Self, ClientError> {
        // The rule that decided: the deciding guard's trace says it, by
        // call id (R21, R27).
        let rule = |guard: &str, call_id: &str| {
            wire.trace
                .iter()
                .find(|t| !guard.is_empty() && t.guard == guard)
                .and_then(|t| t.rules.get(call_id))
                .cloned()
        };
        let calls = wire
            .decisions
            .into_iter()
            .map(|d| {
                let outcome = match Action::try_from(d.action) {
                    Ok(Action::Proceed) => Outcome::Proceed,
                    Ok(Action::Steer) => Outcome::Steer { content: d.content },
                    Ok(Action::Cancel) => Outcome::Cancel { content: d.content },
                    Ok(Action::Ask) => match d.approval {
                        Some(approval) if !approval.id.is_empty() => Outcome::Ask {
                            content: d.content,
                            approval: Box::new(approval),
                        },
                        _ => {
                            return Err(ClientError::Protocol(format!(
                                "call {:?} is asked about without an approval request",
                                d.call_id
                            )));
                        }
                    },
                    _ => {
                        return Err(ClientError::Protocol(format!(
                            "call {:?} has no action ({})",
                            d.call_id, d.action
                        )));
                    }
                };
                let original = d.original.unwrap_or_default();
                Ok(CallDecision {
                    rule: rule(&d.decided_by, &d.call_id),
                    call_id: d.call_id,
                    outcome,
                    final_call: d.call.unwrap_or_else(|| original.clone()),
                    original,
                    decided_by: (!d.decided_by.is_empty()).then_some(d.decided_by),
                    failure: d.failure,
                    rewritten_by: d.rewritten_by,
                    bypassed: d.bypassed,
                    approval_refused: (!d.approval_refused.is_empty())
                        .then_some(d.approval_refused),
                    approved_by_request: (!d.approved_by_request.is_empty())
                        .then_some(d.approved_by_request),
                })
            })
            .collect::<Result<_, _>>()?;
        let results = wire
            .results
            .into_iter()
            .map(|d| {
                let outcome = match ResultAction::try_from(d.action) {
                    Ok(ResultAction::Pass) => ResultOutcome::Pass,
                    Ok(ResultAction::Rewrite) => ResultOutcome::Rewrite,
                    Ok(ResultAction::Block) => ResultOutcome::Block { content: d.content },
                    _ => {
                        return Err(ClientError::Protocol(format!(
                            "result {:?} has no action ({})",
                            d.call_id, d.action
                        )));
                    }
                };
                Ok(ResultDecision {
                    call_id: d.call_id,
                    outcome,
                    result: d.result,
                    original: d.original.unwrap_or_default(),
                    decided_by: (!d.decided_by.is_empty()).then_some(d.decided_by),
                    failure: d.failure,
                    rewritten_by: d.rewritten_by,
                    bypassed: d.bypassed,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            batch_id,
            calls,
            execute: wire.execute,
            trace: wire.trace,
            chain_revision: wire.chain_revision,
            trace_id: wire.trace_id,
            results,
            judges_results: wire.judges_results,
        })
    }

    /// The decision for the result of `call_id` (R33).
    pub fn result(&self, call_id: &str) -> Option<&ResultDecision> {
        self.results.iter().find(|r| r.call_id == call_id)
    }

    /// The decision for `call_id`.
    pub fn call(&self, call_id: &str) -> Option<&CallDecision> {
        self.calls.iter().find(|c| c.call_id == call_id)
    }

    /// The trace entry of the guard named `guard` (R21).
    pub fn guard(&self, guard: &str) -> Option<&GuardTrace> {
        self.trace.iter().find(|t| t.guard == guard)
    }

    /// What the guard named `guard` did with the batch (R21): `proceeded`,
    /// `skipped`, `timed_out`, ... ([`TraceStatus`] displays as these names).
    /// A status this SDK does not know reads as
    /// [`TraceStatus::Unspecified`].
    pub fn status(&self, guard: &str) -> Option<TraceStatus> {
        self.guard(guard).map(GuardTrace::status)
    }
}

/// A connection to a mesh's `PreToolService`. The credentials it was
/// connected with go on every call, unary and streaming (R24).
#[derive(Debug, Clone)]
pub struct Coordinator {
    client: PreToolServiceClient<Authorized>,
}

impl Coordinator {
    /// Connects to the mesh at `address` (`host:port` or
    /// `http://host:port`), in plaintext.
    pub async fn connect(address: impl AsRef<str>) -> Result<Self, ClientError> {
        Self::connect_with(address, &Connection::default()).await
    }

    /// How to connect to the mesh at `address`, spelled out: TLS, token,
    /// connect timeout, retries (see [`CoordinatorBuilder`](crate::CoordinatorBuilder)).
    pub fn builder(address: impl Into<String>) -> crate::builder::CoordinatorBuilder {
        crate::builder::CoordinatorBuilder::new(address)
    }

    /// Connects with TLS, mTLS and/or a bearer token.
    pub async fn connect_with(
        address: impl AsRef<str>,
        connection: &Connection,
    ) -> Result<Self, ClientError> {
        Ok(Self::from_authorized(
            connection.authorized(address.as_ref()).await?,
        ))
    }

    /// Uses an existing channel (for custom settings), without a token.
    pub fn from_channel(channel: Channel) -> Self {
        Self::from_channel_with(channel, Credentials::none())
    }

    /// Uses an existing channel; `credentials` go on every call.
    pub fn from_channel_with(channel: Channel, credentials: Credentials) -> Self {
        Self::from_authorized(crate::connect::authorize(channel, credentials))
    }

    fn from_authorized(channel: Authorized) -> Self {
        Self {
            client: PreToolServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        }
    }

    /// Opens a stream for one agent session.
    pub async fn session(&self, session_id: impl Into<String>) -> Result<Session, ClientError> {
        self.session_with(session_id, tonic::metadata::MetadataMap::new())
            .await
    }

    /// Opens a session stream with extra request metadata (e.g. a W3C
    /// `traceparent`, R22).
    pub async fn session_with(
        &self,
        session_id: impl Into<String>,
        metadata: tonic::metadata::MetadataMap,
    ) -> Result<Session, ClientError> {
        let stream = Stream::open(&self.client, &metadata).await?;
        Ok(Session {
            session_id: session_id.into(),
            opens: Arc::new((self.client.clone(), metadata)),
            stream: tokio::sync::Mutex::new(Arc::new(stream)),
            next: AtomicU64::new(1),
        })
    }

    /// Evaluates one batch with a unary call, without a session stream.
    pub async fn evaluate_once(
        &self,
        session_id: &str,
        batch: Batch,
    ) -> Result<BatchDecision, ClientError> {
        let batch_id = format!("{session_id}/{}", batch.turn_index);
        if batch.is_empty() {
            return Ok(BatchDecision::empty(batch_id));
        }
        let mut client = self.client.clone();
        let timeout = batch.timeout;
        let mut request = tonic::Request::new(batch.into_request(batch_id.clone(), session_id));
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        let decision = client.evaluate_batch(request).await?.into_inner();
        BatchDecision::from_wire(batch_id, decision)
    }
}

impl Coordinator {
    /// Tool visibility: which of `tools` the mesh's chain skips whatever a
    /// call's arguments (`PreToolService.AlwaysSkipped`), so that they may
    /// be left out of what a model is offered. Advisory: every call is
    /// still judged. At most [`guardmesh_proto::ALWAYS_SKIPPED_MAX_TOOLS`]
    /// names of at most [`guardmesh_proto::ALWAYS_SKIPPED_MAX_NAME_BYTES`]
    /// bytes each; the mesh refuses more with INVALID_ARGUMENT.
    pub async fn always_skipped(
        &self,
        tools: Vec<String>,
        timeout: Option<Duration>,
    ) -> Result<proto::AlwaysSkippedResponse, ClientError> {
        let mut client = self.client.clone();
        let mut request = tonic::Request::new(proto::AlwaysSkippedRequest { tools });
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        Ok(client.always_skipped(request).await?.into_inner())
    }
}

/// Marks a stream that has ended.
const CLOSED: &str = "\0closed";

type Waiting = Arc<Mutex<HashMap<String, oneshot::Sender<Result<EvaluateResponse, ClientError>>>>>;

/// One open `Evaluate` stream: where batches are sent, who waits for
/// which answer, and the task that reads the answers.
#[derive(Debug)]
struct Stream {
    tx: mpsc::Sender<EvaluateRequest>,
    waiting: Waiting,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Stream {
    async fn open(
        client: &PreToolServiceClient<Authorized>,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Self, ClientError> {
        let (tx, rx) = mpsc::channel(64);
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        *request.metadata_mut() = metadata.clone();
        let mut client = client.clone();
        let mut answers = client.evaluate(request).await?.into_inner();
        let waiting: Waiting = Arc::default();
        let reader_waiting = waiting.clone();
        let reader = tokio::spawn(async move {
            let end = loop {
                match answers.message().await {
                    Ok(Some(answer)) => {
                        let waiter = reader_waiting
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .remove(&answer.batch_id);
                        if let Some(waiter) = waiter {
                            let _ = waiter.send(Ok(answer));
                        }
                    }
                    Ok(None) => break None,
                    Err(status) => break Some(status),
                }
            };
            // Marked closed first, under the same lock: no batch is queued
            // on this stream once its waiters are told.
            let waiters = {
                let mut waiting = reader_waiting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let waiters = std::mem::take(&mut *waiting);
                waiting.insert(CLOSED.to_owned(), oneshot::channel().0);
                waiters
            };
            for (batch_id, waiter) in waiters {
                let _ = waiter.send(Err(unanswered(batch_id, end.as_ref())));
            }
        });
        Ok(Stream {
            tx,
            waiting,
            reader,
        })
    }

    fn closed(&self) -> bool {
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(CLOSED)
    }
}

/// What a batch still waiting when its stream ended gets: a status the
/// mesh chose for the stream (a refusal of the caller: `UNAUTHENTICATED`,
/// `RESOURCE_EXHAUSTED`, ...) as it is; a stream that ended cleanly or
/// with a transport failure (a restart, a cut connection) as
/// [`ClientError::NotJudged`].
fn unanswered(batch_id: String, end: Option<&tonic::Status>) -> ClientError {
    match end {
        Some(status)
            if !matches!(
                status.code(),
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
            ) =>
        {
            ClientError::Status(status.clone())
        }
        status => ClientError::NotJudged {
            batch_id,
            status: status.cloned(),
        },
    }
}

/// One agent session: a stream on which batches are evaluated. Several
/// batches may be in flight at once; each is answered exactly once (R19).
///
/// When the stream ends (the mesh restarted, the connection was cut),
/// the batches in flight fail with [`ClientError::NotJudged`]: none of
/// their calls may run. The next batch opens a new stream to the mesh
/// and goes through once the mesh is back; while it cannot be opened,
/// batches fail with [`ClientError::SessionClosed`].
#[derive(Debug)]
pub struct Session {
    session_id: String,
    /// What a new stream is opened with: the client and the metadata.
    opens: Arc<(
        PreToolServiceClient<Authorized>,
        tonic::metadata::MetadataMap,
    )>,
    stream: tokio::sync::Mutex<Arc<Stream>>,
    next: AtomicU64,
}

impl Session {
    /// The session's id.
    pub fn id(&self) -> &str {
        &self.session_id
    }

    /// Evaluates one round of calls. A batch with no calls is answered here,
    /// without contacting the mesh (R1).
    pub async fn evaluate(&self, batch: Batch) -> Result<BatchDecision, ClientError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let batch_id = format!("{}/{}/{n}", self.session_id, batch.turn_index);
        if batch.is_empty() {
            return Ok(BatchDecision::empty(batch_id));
        }
        self.evaluate_raw(batch.into_request(batch_id, &self.session_id))
            .await
    }

    /// [`Session::evaluate`] for another agent session, `session_id`, on
    /// this stream: a relay that judges for many sessions (an MCP gateway)
    /// keeps one stream instead of a call per batch. The batch id is
    /// `session_id/turn/n`, `n` counted on this stream.
    pub async fn evaluate_as(
        &self,
        session_id: &str,
        batch: Batch,
    ) -> Result<BatchDecision, ClientError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let batch_id = format!("{session_id}/{}/{n}", batch.turn_index);
        if batch.is_empty() {
            return Ok(BatchDecision::empty(batch_id));
        }
        self.evaluate_raw(batch.into_request(batch_id, session_id))
            .await
    }

    /// Sends a batch exactly as given (its `batch_id` included) and waits
    /// for its answer. Unlike [`Session::evaluate`], an empty batch is sent.
    pub async fn evaluate_raw(
        &self,
        request: EvaluateRequest,
    ) -> Result<BatchDecision, ClientError> {
        let batch_id = request.batch_id.clone();
        let answer =
            self.send_raw(request)
                .await?
                .await
                .map_err(|_| ClientError::NotJudged {
                    batch_id: batch_id.clone(),
                    status: None,
                })??;
        let batch_id = answer.batch_id;
        match answer.result {
            Some(evaluate_response::Result::Decision(decision)) => {
                BatchDecision::from_wire(batch_id, decision)
            }
            Some(evaluate_response::Result::Error(error)) => Err(ClientError::Status(
                tonic::Status::new(tonic::Code::from(error.code), error.message),
            )),
            None => Err(ClientError::Protocol(format!(
                "answer for batch {batch_id:?} has neither decision nor error"
            ))),
        }
    }

    /// Queues a batch; the returned receiver yields its answer. On a
    /// stream that has ended, a new one is opened first.
    async fn send_raw(
        &self,
        request: EvaluateRequest,
    ) -> Result<oneshot::Receiver<Result<EvaluateResponse, ClientError>>, ClientError> {
        let batch_id = request.batch_id.clone();
        // Twice at most: a stream that ends between the check and the
        // queueing is replaced once.
        let mut queued = None;
        for _ in 0..2 {
            let stream = {
                let mut current = self.stream.lock().await;
                if current.closed() {
                    match Stream::open(&self.opens.0, &self.opens.1).await {
                        Ok(stream) => *current = Arc::new(stream),
                        Err(error) => {
                            tracing::debug!(%error, "the session's stream cannot be opened again");
                            return Err(ClientError::SessionClosed(batch_id));
                        }
                    }
                }
                current.clone()
            };
            let mut waiting = stream
                .waiting
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if waiting.contains_key(CLOSED) {
                continue;
            }
            let (tx, rx) = oneshot::channel();
            waiting.insert(batch_id.clone(), tx);
            drop(waiting);
            queued = Some((stream, rx));
            break;
        }
        let Some((stream, rx)) = queued else {
            return Err(ClientError::SessionClosed(batch_id));
        };
        if stream.tx.send(request).await.is_err() {
            stream
                .waiting
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&batch_id);
            return Err(ClientError::SessionClosed(batch_id));
        }
        Ok(rx)
    }
}
