//! Judging: a set of `tools/call` requests becomes one mesh batch, and each
//! call's decision becomes what the gateway does with it (R31):
//!
//! | mesh answer | gateway |
//! |---|---|
//! | proceed | forward, with the final tool name and arguments (rewrites applied, R10-R12), in the gateway's serialization of the message it judged |
//! | steer | answer `CallToolResult { isError: true }` with the content |
//! | cancel | answer `CallToolResult { isError: false }` with the content |
//! | ask (R35) | [`Disposition::Ask`]: put to the client's user through elicitation ([`crate::approval`]), else answered `CallToolResult { isError: false }` saying an approval is needed, naming the request; the same call made again in the session names that request |
//! | batch refused (R20) or aborted (R13, R17) | JSON-RPC error [`codes::MESH_REFUSED`] |
//! | mesh unreachable | JSON-RPC error [`codes::MESH_UNREACHABLE`] |
//!
//! A call the mesh returned no decision for is never forwarded.
//!
//! Results (R33): when the chain judges results (the call's decision says
//! so, `judges_results`), each forwarded call is remembered
//! ([`Judge::take_pending`]) and the upstream's response to it goes through
//! the mesh's results phase ([`Judge::judge_response`]) before the client
//! sees it, with the upstream's server name: the client reads the result
//! as the mesh decided it (passed, rewritten, or blocked as an error
//! result), in the gateway's own serialization. A result the mesh cannot
//! judge (unreachable, refused) is withheld and answered with a JSON-RPC
//! error, never forwarded unjudged. A chain without a results guard costs
//! no extra round trip.

use crate::jsonrpc::{self, ToolCallRequest, codes};
use guardmesh_client::{
    Batch, BatchDecision, CallDecision, ClientError, Coordinator, MeshArgs, Outcome, Session,
};
use rmcp::model::ErrorData;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::sync::Mutex;

/// How the gateway reaches the mesh: the connection flags every
/// `guardmesh` command shares ([`MeshArgs`]: address, TLS, token, read the
/// same way), or a mesh config to judge with in this process
/// (`--config`), and the deadline of each batch.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct JudgeArgs {
    #[command(flatten)]
    pub connect: MeshArgs,
    /// Judges in this process with the mesh this config describes (the file
    /// `guardmesh serve --config` reads: guards, policies, sessions,
    /// decision log), instead of reaching a mesh with --mesh: one process
    /// and one network hop fewer per call. --mesh and GUARDMESH_MESH are
    /// then not used.
    #[arg(long, value_name = "MESH_TOML")]
    pub config: Option<std::path::PathBuf>,
    /// Deadline of each batch at the mesh, in milliseconds (0: the mesh's
    /// default, R14).
    #[arg(long, default_value_t = 0)]
    pub timeout_ms: u64,
    /// The mesh built from `--config`, once loaded (set by whoever runs the
    /// gateway, [`crate::main_mcp_with`]).
    #[arg(skip)]
    pub local: Option<InProcessMesh>,
}

/// A mesh judging in the gateway's own process (`--config`): what the
/// gateway asks of it. The gateway crate does not build it (it does not
/// depend on the server): the `guardmesh` binary does, from the config.
pub trait LocalMesh: Send + Sync {
    /// Judges one batch: its decision, or the status a unary
    /// `EvaluateBatch` would have been answered with.
    fn evaluate(
        &self,
        request: guardmesh_client::proto::EvaluateRequest,
    ) -> futures::future::BoxFuture<'_, Result<guardmesh_client::proto::BatchDecision, tonic::Status>>;
    /// Tool visibility: which of `tools` the chain skips whatever a call's
    /// arguments, or the status `PreToolService.AlwaysSkipped` would have
    /// been answered with.
    fn always_skipped(
        &self,
        tools: Vec<String>,
    ) -> futures::future::BoxFuture<
        '_,
        Result<guardmesh_client::proto::AlwaysSkippedResponse, tonic::Status>,
    >;
    /// Called once when the gateway is done: the decision log is closed.
    fn close(&self) -> futures::future::BoxFuture<'_, ()>;
}

/// A [`LocalMesh`], shared by everything in the gateway that judges.
#[derive(Clone)]
pub struct InProcessMesh(pub Arc<dyn LocalMesh>);

impl std::fmt::Debug for InProcessMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InProcessMesh")
    }
}

/// What the gateway's errors call a mesh judging in its own process.
pub const IN_PROCESS: &str = "the mesh in this process (--config)";

/// What to do with one judged call.
#[derive(Debug, Clone)]
pub enum Disposition {
    /// Forward this message to the upstream server.
    Forward(String),
    /// Answer the client with this message; forward nothing.
    Answer(String),
    /// A guard asks a person first (R35): the call does not run now. The
    /// transport asks the MCP client's user when it can
    /// ([`crate::approval`]), else answers [`Asked::answer`].
    Ask(Box<Asked>),
}

/// A call a guard asked a person about (R35).
#[derive(Debug, Clone)]
pub struct Asked {
    /// The answer when nobody is asked through the client: a tool result
    /// saying an approval is needed, naming the request and how to approve
    /// it.
    pub answer: String,
    /// The guard's content for the model.
    pub content: String,
    /// The mesh's approval request.
    pub approval: guardmesh_client::proto::ApprovalRequest,
    /// The call, judged again with the approval once approved.
    pub call: ToolCallRequest,
}

impl Disposition {
    /// This disposition with an ask answered as nobody asked the client's
    /// user ([`Asked::answer`]).
    pub fn unasked(self) -> Self {
        match self {
            Self::Ask(asked) => Self::Answer(asked.answer),
            other => other,
        }
    }
}

/// Why a batch got no decisions.
#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    /// The mesh answered with an error instead of decisions.
    #[error("the mesh refused the batch ({code:?}): {message}")]
    Refused { code: tonic::Code, message: String },
    /// The mesh could not be reached.
    #[error("the mesh at {mesh} cannot be reached: {message}")]
    Unreachable { mesh: String, message: String },
}

impl JudgeError {
    /// The JSON-RPC error the client gets for each call of the batch.
    pub fn error_data(&self) -> ErrorData {
        match self {
            Self::Refused { code, message } => ErrorData::new(
                codes::MESH_REFUSED,
                format!("guardmesh: the mesh refused the call: {message}"),
                Some(serde_json::json!({ "grpcCode": format!("{code:?}"), "message": message })),
            ),
            Self::Unreachable { mesh, message } => ErrorData::new(
                codes::MESH_UNREACHABLE,
                format!("guardmesh: the mesh cannot be reached, the call was not run: {message}"),
                Some(serde_json::json!({ "mesh": mesh })),
            ),
        }
    }
}

/// A lazily connected link to the mesh for one gateway session. Nothing is
/// connected until the first call is judged, so a session without calls
/// never contacts the mesh (R1).
pub struct Judge {
    args: JudgeArgs,
    /// Connected with the first batch; a failed connect is tried again
    /// with the next.
    coordinator: tokio::sync::OnceCell<Coordinator>,
    /// The one `Evaluate` stream every batch of this gateway is judged on,
    /// opened with the first; reopened when it ends.
    stream: Mutex<Option<Arc<Session>>>,
    turn: AtomicU32,
    /// Batches judged in this process, counted for their ids.
    sent: std::sync::atomic::AtomicU64,
    metadata: HashMap<String, String>,
    /// The upstream's server name, sent with each result (R33).
    server: String,
    /// Forwarded calls whose results the mesh must judge (R33), by
    /// session and JSON-RPC id, until the upstream answers them.
    pending: std::sync::Mutex<HashMap<(String, String), PendingResult>>,
    /// R35: the approval requests of calls a guard asked about, by session,
    /// tool and arguments: named again when the same call comes again.
    asked: std::sync::Mutex<AskedCalls>,
    /// Tool visibility (`--hide-skipped-tools`, [`crate::visibility`]).
    hide_skipped_tools: bool,
    /// R31, R33: the `tool_use` blocks of sampling answers the mesh let
    /// proceed, by session and block id: the result the mesh judges when
    /// the upstream sends the tool's result to the client's model
    /// ([`crate::sampling`]).
    sampled: std::sync::Mutex<SampledCalls>,
    /// Whether the chain judges results, as the latest decision said:
    /// [`UNKNOWN`] before any.
    results_judged: std::sync::atomic::AtomicU8,
}

/// [`Judge::results_judged`] before any decision said.
const UNKNOWN: u8 = 0;
const RESULTS_NOT_JUDGED: u8 = 1;
const RESULTS_JUDGED: u8 = 2;

/// Tool calls asked for through sampling that the mesh let proceed, by
/// session and `tool_use` id: the result the mesh judges (`None`: the chain
/// judged no results then). At most [`MAX_SAMPLED_CALLS`], the oldest going
/// first.
#[derive(Default)]
struct SampledCalls {
    by_id: HashMap<(String, String), Option<PendingResult>>,
    order: std::collections::VecDeque<(String, String)>,
}

/// Tool calls asked for through sampling remembered at once, at most.
pub const MAX_SAMPLED_CALLS: usize = 4096;

/// Of [`MAX_SAMPLED_CALLS`], what one session may hold: a session's flood
/// forgets its own oldest calls, not other sessions'.
pub const MAX_SAMPLED_CALLS_PER_SESSION: usize = MAX_SAMPLED_CALLS / 16;

/// A `tool_use` id longer than this is not remembered (its result is then
/// judged as one the gateway never saw called, or withheld): what the
/// gateway holds is bounded by its count, not by what a peer writes.
pub const MAX_SAMPLED_ID_BYTES: usize = 256;

/// Calls a guard asked about whose approval requests the gateway names
/// when the same call (session, tool, arguments as the gateway writes
/// them) comes again (R35): an approval given out of band (`guardmesh
/// approvals approve ID`) then lets that call run once; a request still
/// pending asks again under the same id (no new request); a denied or
/// expired one cancels the call. Forgotten once a decision settles it;
/// at most [`MAX_ASKED_CALLS`], the oldest going first.
#[derive(Default)]
struct AskedCalls {
    by_call: HashMap<(String, String, String), Vec<String>>,
    order: std::collections::VecDeque<(String, String, String)>,
}

/// Calls whose approval requests are remembered at once, at most.
pub const MAX_ASKED_CALLS: usize = 4096;

/// Approval requests named for one call, at most (one per guard that
/// asked; the mesh takes 8).
const MAX_NAMED_APPROVALS: usize = 8;

impl AskedCalls {
    /// What the decision `decided` of `call` (named `named`) leaves to
    /// name the next time.
    fn note(&mut self, key: (String, String, String), named: &[String], decided: &CallDecision) {
        let Outcome::Ask { approval, .. } = &decided.outcome else {
            self.by_call.remove(&key);
            return;
        };
        let mut ids: Vec<String> = if decided.approval_refused.is_some() {
            Vec::new()
        } else {
            named.to_vec()
        };
        if !ids.contains(&approval.id) {
            ids.push(approval.id.clone());
        }
        ids.truncate(MAX_NAMED_APPROVALS);
        if self.by_call.insert(key.clone(), ids).is_none() {
            self.order.push_back(key);
        }
        while self.by_call.len() > MAX_ASKED_CALLS {
            match self.order.pop_front() {
                Some(old) => {
                    self.by_call.remove(&old);
                }
                None => break,
            }
        }
        if self.order.len() > 2 * MAX_ASKED_CALLS {
            let by_call = &self.by_call;
            self.order.retain(|k| by_call.contains_key(k));
        }
    }
}

/// The members of a tool result the results phase judges (R33).
const JUDGED: [&str; 4] = ["content", "structuredContent", "isError", "_meta"];

/// A forwarded call whose result the mesh judges before the client sees
/// it (R33).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingResult {
    /// The call id the call was judged under.
    pub call_id: String,
    /// The tool that runs (the final name).
    pub tool: String,
}

/// Forwarded calls whose results are awaited at once, at most (R25); a
/// call past it is not forwarded (its result could not be judged).
pub const MAX_PENDING_RESULTS: usize = 4096;

impl Judge {
    /// A judge for `args`; `source` goes into each batch's metadata
    /// (`gateway`).
    pub fn new(args: JudgeArgs, source: &str) -> Self {
        Self {
            args,
            coordinator: tokio::sync::OnceCell::new(),
            stream: Mutex::new(None),
            turn: AtomicU32::new(0),
            sent: std::sync::atomic::AtomicU64::new(1),
            metadata: HashMap::from([("gateway".to_owned(), source.to_owned())]),
            server: String::new(),
            pending: std::sync::Mutex::default(),
            asked: std::sync::Mutex::default(),
            hide_skipped_tools: false,
            sampled: std::sync::Mutex::default(),
            results_judged: std::sync::atomic::AtomicU8::new(UNKNOWN),
        }
    }

    fn sampled(&self) -> std::sync::MutexGuard<'_, SampledCalls> {
        self.sampled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// R33: the `tool_use` block `id` of a sampling answer in `session`
    /// proceeded; its result is judged as `pending` says when the upstream
    /// sends it to the client's model (`None`: not judged).
    pub fn remember_sampled(&self, session: &str, id: &str, pending: Option<PendingResult>) {
        if id.len() > MAX_SAMPLED_ID_BYTES || session.len() > MAX_SAMPLED_ID_BYTES {
            tracing::debug!(
                bytes = id.len(),
                "a sampled tool_use id past the bound was not remembered"
            );
            return;
        }
        let mut sampled = self.sampled();
        let key = (session.to_owned(), id.to_owned());
        if sampled.by_id.insert(key.clone(), pending).is_none() {
            sampled.order.push_back(key);
        }
        // A session past its share forgets its own oldest call.
        let held = sampled.order.iter().filter(|(s, _)| s == session).count();
        if held > MAX_SAMPLED_CALLS_PER_SESSION
            && let Some(at) = sampled.order.iter().position(|(s, _)| s == session)
            && let Some(old) = sampled.order.remove(at)
        {
            sampled.by_id.remove(&old);
        }
        while sampled.by_id.len() > MAX_SAMPLED_CALLS {
            match sampled.order.pop_front() {
                Some(old) => {
                    sampled.by_id.remove(&old);
                }
                None => break,
            }
        }
    }

    /// What [`Self::remember_sampled`] noted of the `tool_use` block `id`
    /// in `session`: `None` when nothing (never seen, or forgotten).
    pub fn sampled_call(&self, session: &str, id: &str) -> Option<Option<PendingResult>> {
        let sampled = self.sampled();
        if sampled.by_id.is_empty() {
            return None;
        }
        sampled
            .by_id
            .get(&(session.to_owned(), id.to_owned()))
            .cloned()
    }

    /// Whether the latest decision of the mesh said the chain judges no
    /// results (false before any decision, and when it judges them).
    pub fn judges_no_results(&self) -> bool {
        self.results_judged.load(Ordering::Relaxed) == RESULTS_NOT_JUDGED
    }

    /// The upstream's server name, sent with each result (R33).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// Evaluates `results` (each the result judged for a call, and the
    /// result's JSON text) as one batch of results (R33).
    pub async fn evaluate_results(
        &self,
        session: &str,
        results: Vec<(PendingResult, String)>,
    ) -> Result<BatchDecision, JudgeError> {
        let mut batch = Batch::new(self.turn.fetch_add(1, Ordering::Relaxed));
        batch.metadata = self.metadata.clone();
        for (pending, result) in results {
            batch = batch.result(pending.call_id, pending.tool, self.server.clone(), result);
        }
        self.evaluate_batch(session, batch).await
    }

    /// Hides the tools the chain always skips from `tools/list` answers
    /// when `hide` ([`crate::visibility`]).
    pub fn with_visibility(mut self, hide: bool) -> Self {
        self.hide_skipped_tools = hide;
        self
    }

    /// Whether `tools/list` answers go without the tools the chain always
    /// skips ([`crate::visibility`]).
    pub fn hides_skipped_tools(&self) -> bool {
        self.hide_skipped_tools
    }

    /// The mesh in this process (`--config`), if the gateway judges with
    /// one.
    pub(crate) fn local_mesh(&self) -> Option<&InProcessMesh> {
        self.args.local.as_ref()
    }

    /// The connection to the mesh (`--mesh`), made on first need.
    pub(crate) async fn connected(&self) -> Result<&Coordinator, JudgeError> {
        self.coordinator().await
    }

    /// Names the upstream server the results come from (R33).
    pub fn with_server(mut self, server: impl Into<String>) -> Self {
        self.server = server.into();
        self
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), PendingResult>> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The forwarded call of `session` whose response has JSON-RPC id key
    /// `key` ([`jsonrpc::id_key`]), if its result must be judged; taken.
    pub fn take_pending(&self, session: &str, key: &str) -> Option<PendingResult> {
        let mut pending = self.pending();
        if pending.is_empty() {
            return None;
        }
        pending.remove(&(session.to_owned(), key.to_owned()))
    }

    /// Judges the result of a forwarded call (`result`: the `result` of
    /// the upstream's response, read by [`crate::upstream::read`]) through
    /// the results phase (R33); the message the client gets, under
    /// `client_id`. What the mesh judges is the tool result's own members
    /// (`content`, `structuredContent`, `isError`, `_meta`); of the rest,
    /// only the members in `keep` that the revision requires
    /// (`resultType`, a task's own fields) are written back, so nothing
    /// the mesh did not see reaches the client. An `input_required`
    /// result (2026-07-28) is no tool result yet: relayed as read; the call
    /// sent again with its answers is judged, and its result.
    pub async fn judge_response(
        &self,
        session: &str,
        pending: &PendingResult,
        client_id: &crate::json::Json,
        result: &crate::json::Json,
        keep: &[&str],
    ) -> String {
        use crate::json::Json;
        let message = |result: Json| {
            Json::Object(vec![
                ("jsonrpc".into(), Json::String("2.0".into())),
                ("id".into(), client_id.clone()),
                ("result".into(), result),
            ])
            .to_text()
        };
        if result.get("resultType").and_then(Json::as_str) == Some("input_required") {
            return message(result.clone());
        }
        let Json::Object(members) = result else {
            return message(result.clone());
        };
        let (judged, kept): (Vec<_>, Vec<_>) = members
            .iter()
            .filter(|(k, _)| JUDGED.contains(&k.as_str()) || keep.contains(&k.as_str()))
            .cloned()
            .partition(|(k, _)| JUDGED.contains(&k.as_str()));
        match self
            .judged(session, pending, client_id, Json::Object(judged).to_text())
            .await
        {
            Ok(mut decided) => {
                for (key, value) in kept {
                    if decided.get(&key).is_none() {
                        decided.set(&key, value);
                    }
                }
                message(decided)
            }
            Err(answer) => answer,
        }
    }

    /// Judges a JSON-RPC error answering a forwarded call (`response`: the
    /// upstream's error response, its id the client's) through the results
    /// phase (R33), as an error result whose text is the error's message
    /// (and its `data`, as JSON text): passed unchanged, the client gets
    /// the error as read; rewritten or blocked, the judged result.
    pub async fn judge_error(
        &self,
        session: &str,
        pending: &PendingResult,
        response: &crate::json::Json,
    ) -> String {
        use crate::json::Json;
        let Some(client_id) = response.get("id") else {
            return response.to_text();
        };
        let error = response.get("error");
        let text = |s: String| {
            Json::Object(vec![
                ("type".into(), Json::String("text".into())),
                ("text".into(), Json::String(s)),
            ])
        };
        let mut content = vec![text(
            error
                .and_then(|e| e.get("message"))
                .map(|m| m.as_str().map_or_else(|| m.to_text(), str::to_owned))
                .unwrap_or_default(),
        )];
        if let Some(data) = error.and_then(|e| e.get("data")) {
            content.push(text(data.to_text()));
        }
        let result = Json::Object(vec![
            ("content".into(), Json::Array(content)),
            ("isError".into(), Json::Bool(true)),
        ]);
        match self
            .judged(session, pending, client_id, result.to_text())
            .await
        {
            Ok(decided) if decided == result => response.to_text(),
            Ok(decided) => Json::Object(vec![
                ("jsonrpc".into(), Json::String("2.0".into())),
                ("id".into(), client_id.clone()),
                ("result".into(), decided),
            ])
            .to_text(),
            Err(answer) => answer,
        }
    }

    /// The result the mesh decided for `result` (a tool result's JSON
    /// text), or the JSON-RPC error answering `client_id` when it did not
    /// judge it: withheld, never forwarded unjudged.
    async fn judged(
        &self,
        session: &str,
        pending: &PendingResult,
        client_id: &crate::json::Json,
        result: String,
    ) -> Result<crate::json::Json, String> {
        let id = serde_json::value::RawValue::from_string(client_id.to_text()).ok();
        let id = id.as_deref();
        match self.evaluate_result(session, pending, result).await {
            Ok(decision) => decision
                .result(&pending.call_id)
                .and_then(|decided| crate::json::read(&decided.result).ok())
                .map(|decided| decided.value)
                .ok_or_else(|| no_result_decision(id)),
            Err(error) => {
                tracing::warn!(%error, "a tool's result was withheld: the mesh did not judge it");
                let data = match &error {
                    JudgeError::Refused { code, message } => ErrorData::new(
                        codes::MESH_REFUSED,
                        format!(
                            "guardmesh: the tool ran, but the mesh refused its result: {message}"
                        ),
                        Some(
                            serde_json::json!({ "grpcCode": format!("{code:?}"), "message": message }),
                        ),
                    ),
                    JudgeError::Unreachable { mesh, message } => ErrorData::new(
                        codes::MESH_UNREACHABLE,
                        format!(
                            "guardmesh: the tool ran, but the mesh cannot be reached to check its result, so it is withheld: {message}"
                        ),
                        Some(serde_json::json!({ "mesh": mesh })),
                    ),
                };
                Err(jsonrpc::error(id, &data))
            }
        }
    }

    /// Evaluates one result as a batch of results (R33).
    async fn evaluate_result(
        &self,
        session: &str,
        pending: &PendingResult,
        result: String,
    ) -> Result<BatchDecision, JudgeError> {
        let mut batch = Batch::new(self.turn.fetch_add(1, Ordering::Relaxed));
        batch.metadata = self.metadata.clone();
        batch = batch.result(
            pending.call_id.clone(),
            pending.tool.clone(),
            self.server.clone(),
            result,
        );
        self.evaluate_batch(session, batch).await
    }

    async fn coordinator(&self) -> Result<&Coordinator, JudgeError> {
        self.coordinator.get_or_try_init(|| self.connect()).await
    }

    async fn connect(&self) -> Result<Coordinator, JudgeError> {
        let unreachable = |message: String| JudgeError::Unreachable {
            mesh: self.args.connect.mesh.clone(),
            message,
        };
        let connection = self
            .args
            .connect
            .connection()
            .map_err(|e| unreachable(e.to_string()))?;
        let connect = Coordinator::connect_with(self.args.connect.mesh.clone(), &connection);
        let coordinator = tokio::time::timeout(Duration::from_secs(10), connect)
            .await
            .map_err(|_| unreachable("connect timed out".into()))?
            .map_err(|e| unreachable(error_chain(&e)))?;
        Ok(coordinator)
    }

    /// Evaluates one batch of calls (R31: a JSON-RPC batch is one batch).
    pub async fn evaluate(
        &self,
        session: &str,
        calls: Vec<(String, String, String)>,
        traceparent: Option<&str>,
    ) -> Result<BatchDecision, JudgeError> {
        let mut batch = Batch::new(self.turn.fetch_add(1, Ordering::Relaxed));
        batch.metadata = self.metadata.clone();
        for (call_id, tool, arguments) in calls {
            batch = batch.call(call_id, tool, arguments);
        }
        if let Some(tp) = traceparent {
            batch = batch.traceparent(tp);
        }
        self.evaluate_batch(session, batch).await
    }

    /// Evaluates a batch of calls or results on the gateway's stream, or
    /// by the mesh in this process.
    async fn evaluate_batch(
        &self,
        session: &str,
        batch: Batch,
    ) -> Result<BatchDecision, JudgeError> {
        let empty = batch.is_empty();
        let decision = self.evaluate_any(session, batch).await;
        if let Ok(decision) = &decision
            && !empty
        {
            let judged = if decision.judges_results {
                RESULTS_JUDGED
            } else {
                RESULTS_NOT_JUDGED
            };
            self.results_judged.store(judged, Ordering::Relaxed);
        }
        decision
    }

    /// [`Self::evaluate_batch`], without noting what the decision says.
    async fn evaluate_any(
        &self,
        session: &str,
        mut batch: Batch,
    ) -> Result<BatchDecision, JudgeError> {
        if self.args.timeout_ms > 0 {
            batch = batch.timeout(Duration::from_millis(self.args.timeout_ms));
        }
        if let Some(local) = &self.args.local {
            return self.in_process(local, session, batch).await;
        }
        let coordinator = self.coordinator().await?;
        // One retry, on a fresh stream, when the stream had ended: the
        // mesh restarted, or the connection was cut between two batches.
        let mut answer = self.on_stream(session, batch.clone(), coordinator).await;
        if matches!(
            answer,
            Err(ClientError::SessionClosed(_) | ClientError::NotJudged { status: None, .. })
        ) {
            answer = self.on_stream(session, batch, coordinator).await;
        }
        answer.map_err(|e| match e {
            ClientError::Protocol(message) if message.starts_with(NO_ANSWER) => {
                JudgeError::Unreachable {
                    mesh: self.args.connect.mesh.clone(),
                    message,
                }
            }
            // A status the mesh sent (no transport error under it) is its
            // refusal; one made from a broken connection (the mesh died or
            // the connection was cut mid-batch) is an unreachable mesh,
            // whatever code the transport error was mapped to.
            ClientError::Status(status) if !from_transport(&status) => JudgeError::Refused {
                code: status.code(),
                message: status.message().to_owned(),
            },
            other => JudgeError::Unreachable {
                mesh: self.args.connect.mesh.clone(),
                message: error_chain(&other),
            },
        })
    }

    /// Evaluates `batch` with the mesh in this process. Its batch ids are
    /// those a stream gives (`session/turn/n`). The mesh answers by the
    /// batch's deadline (R14) as over gRPC: no timer of the gateway's own.
    async fn in_process(
        &self,
        local: &InProcessMesh,
        session: &str,
        batch: Batch,
    ) -> Result<BatchDecision, JudgeError> {
        let n = self.sent.fetch_add(1, Ordering::Relaxed);
        let batch_id = format!("{session}/{}/{n}", batch.turn_index);
        if batch.is_empty() {
            return Ok(BatchDecision::empty(batch_id));
        }
        let request = batch.into_request(batch_id.clone(), session);
        match local.0.evaluate(request).await {
            Ok(decision) => {
                BatchDecision::from_wire(batch_id, decision).map_err(|e| JudgeError::Refused {
                    code: tonic::Code::Internal,
                    message: e.to_string(),
                })
            }
            Err(status) => Err(JudgeError::Refused {
                code: status.code(),
                message: status.message().to_owned(),
            }),
        }
    }

    /// Evaluates `batch` on the gateway's stream, opening it first if
    /// needed; a stream that ended is dropped, so the next batch opens
    /// another.
    async fn on_stream(
        &self,
        session: &str,
        batch: Batch,
        coordinator: &Coordinator,
    ) -> Result<BatchDecision, ClientError> {
        // The mesh answers by the batch's deadline (R14); a mesh that does
        // not (stopped, or cut off) gets its stream given up.
        let bound = match self.args.timeout_ms {
            0 => NO_ANSWER_BOUND,
            ms => Duration::from_millis(ms) + NO_ANSWER_GRACE,
        };
        let mut used = None;
        let judged = tokio::time::timeout(bound, async {
            let stream = {
                let mut slot = self.stream.lock().await;
                match slot.as_ref() {
                    Some(stream) => stream.clone(),
                    None => {
                        let stream = Arc::new(coordinator.session("gateway").await?);
                        *slot = Some(stream.clone());
                        stream
                    }
                }
            };
            used = Some(stream.clone());
            stream.evaluate_as(session, batch).await
        })
        .await;
        let answer =
            judged.unwrap_or_else(|_| Err(ClientError::Protocol(format!("{NO_ANSWER} {bound:?}"))));
        if let (Err(error), Some(stream)) = (&answer, &used)
            && stream_ended(error)
        {
            let mut slot = self.stream.lock().await;
            if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, stream)) {
                *slot = None;
            }
        }
        answer
    }

    /// Judges `calls` as one batch and says what to do with each, in order.
    pub async fn judge(&self, session: &str, calls: &[ToolCallRequest]) -> Vec<Disposition> {
        match self.try_judge(session, calls).await {
            Ok(dispositions) => dispositions,
            Err(error) => self.answer_errors(calls, &error),
        }
    }

    /// [`Judge::judge`], with a batch the mesh did not decide as the error.
    pub async fn try_judge(
        &self,
        session: &str,
        calls: &[ToolCallRequest],
    ) -> Result<Vec<Disposition>, JudgeError> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        let traceparent = calls.iter().find_map(|c| c.traceparent.as_deref());
        let mut batch = Batch::new(self.turn.fetch_add(1, Ordering::Relaxed));
        batch.metadata = self.metadata.clone();
        // R35: the requests of an earlier ask of the same call, named for
        // its first occurrence in the batch only.
        let mut named: Vec<Vec<String>> = Vec::with_capacity(calls.len());
        {
            let asked = self.asked();
            let mut seen = std::collections::HashSet::new();
            for c in calls {
                let key = asked_key(session, c);
                let ids = match asked.by_call.get(&key) {
                    Some(ids) if seen.insert(key) => ids.clone(),
                    _ => Vec::new(),
                };
                batch = batch.call(c.call_id(), c.name.clone(), c.arguments.clone());
                for id in &ids {
                    batch = batch.approval(c.call_id(), id);
                }
                named.push(ids);
            }
        }
        if let Some(tp) = traceparent {
            batch = batch.traceparent(tp);
        }
        let decision = self.evaluate_batch(session, batch).await?;
        Ok(calls
            .iter()
            .zip(named)
            .map(|(c, named)| {
                self.note_asked(session, c, &named, &decision);
                let disposition = dispose(c, &decision);
                self.await_result(session, c, &decision, disposition)
            })
            .collect())
    }

    fn asked(&self) -> std::sync::MutexGuard<'_, AskedCalls> {
        self.asked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// R35: what `decision` leaves to name when `call` (named `named`)
    /// comes again.
    fn note_asked(
        &self,
        session: &str,
        call: &ToolCallRequest,
        named: &[String],
        decision: &BatchDecision,
    ) {
        let Some(decided) = decision.call(call.call_id()) else {
            return;
        };
        let key = asked_key(session, call);
        let mut asked = self.asked();
        if named.is_empty()
            && !matches!(decided.outcome, Outcome::Ask { .. })
            && !asked.by_call.contains_key(&key)
        {
            return;
        }
        asked.note(key, named, decided);
    }

    /// Judges `call` again with the approvals `approvals` (R35: approved
    /// by a person since their asks, one per guard that asked), as a batch
    /// of its own: what to do with it now. A batch the mesh did not decide
    /// is answered with its error; nothing is forwarded.
    pub async fn judge_approved(
        &self,
        session: &str,
        call: &ToolCallRequest,
        approvals: &[String],
    ) -> Disposition {
        let mut batch = Batch::new(self.turn.fetch_add(1, Ordering::Relaxed));
        batch.metadata = self.metadata.clone();
        batch = batch.call(call.call_id(), call.name.clone(), call.arguments.clone());
        for approval in approvals {
            batch = batch.approval(call.call_id(), approval);
        }
        if let Some(tp) = &call.traceparent {
            batch = batch.traceparent(tp.clone());
        }
        match self.evaluate_batch(session, batch).await {
            Ok(decision) => {
                self.note_asked(session, call, approvals, &decision);
                if let Some(why) = decision
                    .call(call.call_id())
                    .and_then(|d| d.approval_refused.as_deref())
                {
                    tracing::warn!(?approvals, why, "the mesh refused an approval");
                }
                let disposition = dispose(call, &decision);
                self.await_result(session, call, &decision, disposition)
            }
            Err(error) => self
                .answer_errors(std::slice::from_ref(call), &error)
                .pop()
                .unwrap_or_else(|| Disposition::Answer(String::new())),
        }
    }

    /// Whether the gateway judges with a mesh in its own process
    /// (`--config`).
    pub fn judges_in_process(&self) -> bool {
        self.args.local.is_some()
    }

    /// How the gateway reaches the mesh (`--mesh` and its TLS and token).
    pub fn connect_args(&self) -> &MeshArgs {
        &self.args.connect
    }

    /// R33: a call forwarded under a chain that judges results is
    /// remembered, so that its response is judged before the client sees
    /// it; past [`MAX_PENDING_RESULTS`] it is not forwarded.
    fn await_result(
        &self,
        session: &str,
        call: &ToolCallRequest,
        decision: &BatchDecision,
        disposition: Disposition,
    ) -> Disposition {
        let Disposition::Forward(_) = &disposition else {
            return disposition;
        };
        if !decision.judges_results {
            return disposition;
        }
        let Some(decided) = decision.call(call.call_id()) else {
            return disposition;
        };
        let mut pending = self.pending();
        if pending.len() >= MAX_PENDING_RESULTS {
            let data = ErrorData::new(
                codes::MESH_REFUSED,
                format!(
                    "guardmesh: {MAX_PENDING_RESULTS} tool results are already awaited; the call was not run"
                ),
                None,
            );
            return Disposition::Answer(jsonrpc::error(Some(&call.id), &data));
        }
        pending.insert(
            (session.to_owned(), jsonrpc::id_key(&call.id)),
            PendingResult {
                call_id: decided.call_id.clone(),
                tool: decided.final_call.tool.clone(),
            },
        );
        disposition
    }

    /// The JSON-RPC error each of `calls` is answered with when their batch
    /// got no decisions; nothing is forwarded.
    pub fn answer_errors(&self, calls: &[ToolCallRequest], error: &JudgeError) -> Vec<Disposition> {
        tracing::warn!(%error, calls = calls.len(), "tools/call not forwarded");
        let data = error.error_data();
        calls
            .iter()
            .map(|c| Disposition::Answer(jsonrpc::error(Some(&c.id), &data)))
            .collect()
    }
}

/// The start of the error of a batch the mesh did not answer in time.
const NO_ANSWER: &str = "no answer from the mesh within";

/// How long a batch without a deadline of its own waits for the mesh's
/// answer (the mesh's deadlines are shorter).
const NO_ANSWER_BOUND: Duration = Duration::from_secs(60);

/// How much longer than its deadline a batch waits for the mesh's answer.
const NO_ANSWER_GRACE: Duration = Duration::from_secs(2);

/// Whether `error` means the stream it came on is gone: closed, or ended
/// with a transport failure (a refusal of one batch leaves it open).
fn stream_ended(error: &ClientError) -> bool {
    match error {
        ClientError::SessionClosed(_) => true,
        ClientError::Status(status) => {
            std::error::Error::source(status).is_some()
                || matches!(
                    status.code(),
                    tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
                )
        }
        _ => true,
    }
}

/// Whether `status` was made on this side from a transport failure (a
/// connection refused, reset or closed mid-stream) rather than sent by the
/// mesh: tonic keeps the transport error as its source, and a stream reset
/// by the peer's end arrives as `Cancelled`.
fn from_transport(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some() || status.code() == tonic::Code::Cancelled
}

/// The key of `call` of `session` among the calls asked about (R35).
fn asked_key(session: &str, call: &ToolCallRequest) -> (String, String, String) {
    (
        session.to_owned(),
        call.name.clone(),
        call.arguments.clone(),
    )
}

/// What the decision says to do with `call`.
fn dispose(call: &ToolCallRequest, decision: &BatchDecision) -> Disposition {
    let Some(outcome) = decision.call(call.call_id()) else {
        let data = ErrorData::new(
            codes::MESH_REFUSED,
            "guardmesh: the mesh returned no decision for this call",
            None,
        );
        return Disposition::Answer(jsonrpc::error(Some(&call.id), &data));
    };
    match &outcome.outcome {
        Outcome::Proceed => {
            match call.forward(&outcome.final_call.tool, &outcome.final_call.arguments) {
                Ok(text) => Disposition::Forward(text),
                Err(error) => {
                    tracing::warn!(%error, "a proceed the gateway cannot write: not forwarded");
                    let data = ErrorData::new(
                        codes::MESH_REFUSED,
                        format!("guardmesh: the call was not run: {error}"),
                        None,
                    );
                    Disposition::Answer(jsonrpc::error(Some(&call.id), &data))
                }
            }
        }
        Outcome::Steer { content } => {
            Disposition::Answer(jsonrpc::tool_result(&call.id, content, true))
        }
        Outcome::Cancel { content } => {
            Disposition::Answer(jsonrpc::tool_result(&call.id, content, false))
        }
        // R35: the call does not run; the transport may ask the client's
        // user; if not, the model reads that a person must approve it, and
        // which request to approve.
        Outcome::Ask { content, approval } => Disposition::Ask(Box::new(Asked {
            answer: jsonrpc::tool_result(&call.id, &approval_needed(content, &approval.id), false),
            content: content.clone(),
            approval: (**approval).clone(),
            call: call.clone(),
        })),
    }
}

/// The text of a call a guard asked about when nobody was asked through
/// the client: the guard's content, the request, and how to approve it.
pub fn approval_needed(content: &str, id: &str) -> String {
    format!(
        "{content} (approval needed: approval request {id}; an approver runs \
         `guardmesh approvals approve {id}`, then the same call may be made again)"
    )
}

/// The answer to a result the mesh returned no decision for: withheld.
fn no_result_decision(id: Option<&serde_json::value::RawValue>) -> String {
    let data = ErrorData::new(
        codes::MESH_REFUSED,
        "guardmesh: the mesh returned no decision for this tool's result; it is withheld",
        None,
    );
    jsonrpc::error(id, &data)
}

/// An error with its sources, `: `-separated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}
