//! The MCP interceptor extension (SEP-2624): the gateway answers
//! `interceptors/list` and `interceptor/invoke` itself, through the mesh's
//! `InterceptorService`, so that an MCP host that speaks the extension can
//! use guardmesh as its interceptor server. Nothing of these requests is
//! forwarded upstream.
//!
//! * `interceptors/list` (`params.event`: an MCP method, optional): the
//!   chain's guards in chain order as interceptor descriptors: `name`,
//!   `type` (`validation` for a validate guard, `mutation` for a mutate
//!   guard), `hooks` (one per phase the guard judges: `request` for calls,
//!   `response` for results, each with the guard's events), and, only
//!   when not the default, `mode: "audit"` (a dry-run guard, R18),
//!   `failOpen: true` (R13 `fail_open`) and `priority`.
//! * `interceptor/invoke` (`params.name`, `params.phase` `request` or
//!   `response`, `params.payload`): the named guard alone judges the
//!   payload, a `tools/call` request (`{name, arguments}`) as a call, a
//!   response as a result: a `CallToolResult` as it is, any other object
//!   as the `structuredContent` of a result with no content (and back).
//!   A validation answers `valid` (with `severity` and `messages` when
//!   not), a mutation `modified` and the payload as the guard left it.
//!
//! Client input is hostile: `params` must be an object; `name` a string of
//! 1 to 128 bytes; `event` at most 128 bytes; `phase` one of the two;
//! `payload` an object (a request's `name` a string, its `arguments` an
//! object). Anything else, and an unknown interceptor name, is answered
//! with JSON-RPC invalid params (-32602) naming what is wrong. At most
//! [`MAX_IN_FLIGHT`] of these requests are answered at once per gateway;
//! past that one is refused at once.

use crate::json::{self, Json};
use crate::jsonrpc::codes;
use guardmesh_client::proto::interceptor_service_client::InterceptorServiceClient;
use guardmesh_client::proto::{
    Action, BatchContext, BatchDecision, EvaluateRequest, FailurePolicy, GuardMode, GuardPhases,
    GuardRole, InterceptorInvokeRequest, InterceptorListRequest, ResultAction, ToolCall,
    ToolResult,
};
use guardmesh_client::{Credentials, MeshArgs};
use rmcp::model::{ErrorCode, ErrorData};
use serde_json::value::RawValue;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, Semaphore};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// `interceptors/list`.
pub const LIST: &str = "interceptors/list";
/// `interceptor/invoke`.
pub const INVOKE: &str = "interceptor/invoke";
/// Longest interceptor name, in bytes (a guard name's bound).
pub const MAX_NAME_BYTES: usize = 128;
/// Longest event, in bytes.
pub const MAX_EVENT_BYTES: usize = 128;
/// Interceptor requests answered at once by one gateway.
pub const MAX_IN_FLIGHT: usize = 64;
/// The call id an invocation's call or result carries.
const INVOKE_CALL_ID: &str = "interceptor-invoke";

type Client = InterceptorServiceClient<InterceptedService<Channel, Credentials>>;

/// An answer being made: the JSON-RPC response text.
pub type Answer = Pin<Box<dyn Future<Output = String> + Send>>;

/// Why a request's params cannot be invoked or listed, or the mesh's
/// refusal: a JSON-RPC error.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("{0}")]
    Params(String),
    #[error("{0}")]
    Mesh(String),
    #[error("{0}")]
    Unreachable(String),
    #[error("{0}")]
    Failed(String),
}

impl Refused {
    fn data(&self) -> ErrorData {
        let code = match self {
            Self::Params(_) => codes::INVALID_PARAMS,
            Self::Mesh(_) => codes::MESH_REFUSED,
            Self::Unreachable(_) => codes::MESH_UNREACHABLE,
            Self::Failed(_) => ErrorCode::INTERNAL_ERROR,
        };
        ErrorData::new(code, format!("guardmesh: {self}"), None)
    }
}

/// The extension's end in one gateway: its link to the mesh.
pub struct Interceptors {
    connect: MeshArgs,
    /// The gateway judges with a mesh in its own process (`--config`),
    /// which serves no `InterceptorService`: requests are refused.
    in_process: bool,
    timeout: Duration,
    client: Mutex<Option<Client>>,
    in_flight: Arc<Semaphore>,
}

/// Whether `text` (the gateway's own serialization of a request) may be
/// one of the extension's: a cheap test before any parsing, so that other
/// messages pay one substring search.
pub fn may_be_ours(text: &str) -> bool {
    text.contains("\"interceptor")
}

impl Interceptors {
    /// The extension for a gateway reaching the mesh with `connect`.
    pub fn new(connect: MeshArgs, timeout: Duration) -> Arc<Self> {
        Self::with(connect, timeout, false)
    }

    fn with(connect: MeshArgs, timeout: Duration, in_process: bool) -> Arc<Self> {
        Arc::new(Self {
            connect,
            in_process,
            timeout,
            client: Mutex::new(None),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        })
    }

    /// The extension for a gateway with `args`: each request is bounded
    /// by `--timeout-ms` (30 s when 0).
    pub fn from_judge_args(args: &crate::JudgeArgs) -> Arc<Self> {
        let timeout = match args.timeout_ms {
            0 => Duration::from_secs(30),
            ms => Duration::from_millis(ms),
        };
        Self::with(args.connect.clone(), timeout, args.local.is_some())
    }

    /// The answer to `text` when it is a request of the extension (read
    /// from the gateway's serialization; `None` for any other message,
    /// which goes on as before). `session` is the MCP session: the session
    /// an invocation's batch names (its memory is read, never written).
    pub fn take(self: &Arc<Self>, text: &str, session: &str) -> Option<Answer> {
        if !may_be_ours(text) {
            return None;
        }
        let read = json::read(text).ok()?.value;
        let method = read.get("method")?.as_str()?;
        if method != LIST && method != INVOKE {
            return None;
        }
        let id = read.get("id")?.to_text();
        let id = RawValue::from_string(id).ok()?;
        let params = read.get("params").cloned();
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            let error = Refused::Mesh(format!(
                "{MAX_IN_FLIGHT} interceptor requests already in flight; retry later"
            ));
            let text = crate::jsonrpc::error(Some(&id), &error.data());
            return Some(Box::pin(std::future::ready(text)));
        };
        let this = self.clone();
        let session = session.to_owned();
        let invoke = method == INVOKE;
        Some(Box::pin(async move {
            let _permit = permit;
            let answer = if invoke {
                this.invoke(params.as_ref(), session).await
            } else {
                this.list(params.as_ref()).await
            };
            match answer {
                Ok(result) => format!(
                    "{{\"jsonrpc\":\"2.0\",\"id\":{},\"result\":{}}}",
                    id.get(),
                    result.to_text()
                ),
                Err(error) => crate::jsonrpc::error(Some(&id), &error.data()),
            }
        }))
    }

    async fn client(&self) -> Result<Client, Refused> {
        if self.in_process {
            return Err(Refused::Unreachable(
                "the interceptors extension needs a mesh reached with --mesh; this gateway judges with its own (--config)".into(),
            ));
        }
        let mut slot = self.client.lock().await;
        if let Some(client) = slot.as_ref() {
            return Ok(client.clone());
        }
        let unreachable =
            |e: &dyn std::fmt::Display| Refused::Unreachable(format!("mesh unreachable: {e}"));
        let connection = self.connect.connection().map_err(|e| unreachable(&e))?;
        let credentials = Credentials::of(&connection).map_err(|e| unreachable(&e))?;
        let channel = tokio::time::timeout(
            Duration::from_secs(10),
            connection.channel(&self.connect.mesh),
        )
        .await
        .map_err(|_| unreachable(&"connect timed out"))?
        .map_err(|e| unreachable(&e))?;
        let client = InterceptorServiceClient::new(InterceptedService::new(channel, credentials));
        *slot = Some(client.clone());
        Ok(client)
    }

    async fn list(&self, params: Option<&Json>) -> Result<Json, Refused> {
        let event = match params {
            None | Some(Json::Null) => None,
            Some(params @ Json::Object(_)) => match params.get("event") {
                None | Some(Json::Null) => None,
                Some(Json::String(event)) if event.len() <= MAX_EVENT_BYTES => Some(event.clone()),
                Some(Json::String(event)) => {
                    return Err(Refused::Params(format!(
                        "params.event is {} bytes, over {MAX_EVENT_BYTES}",
                        event.len()
                    )));
                }
                Some(_) => return Err(Refused::Params("params.event must be a string".into())),
            },
            Some(_) => return Err(Refused::Params("params must be an object".into())),
        };
        let mut client = self.client().await?;
        let mut request = tonic::Request::new(InterceptorListRequest {
            event: event.unwrap_or_default(),
        });
        request.set_timeout(self.timeout);
        let listed = client
            .list(request)
            .await
            .map_err(|s| mesh_status(&s))?
            .into_inner();
        let interceptors = listed
            .interceptors
            .iter()
            .map(|d| {
                let events = Json::Array(d.events.iter().cloned().map(Json::String).collect());
                let phases = GuardPhases::try_from(d.phases).unwrap_or(GuardPhases::Calls);
                let mut hooks = Vec::new();
                for (judged, phase) in [
                    (
                        matches!(phases, GuardPhases::Calls | GuardPhases::Both),
                        "request",
                    ),
                    (
                        matches!(phases, GuardPhases::Results | GuardPhases::Both),
                        "response",
                    ),
                ] {
                    if judged {
                        hooks.push(object(vec![
                            ("events", events.clone()),
                            ("phase", string(phase)),
                        ]));
                    }
                }
                let mut members = vec![
                    ("name", Json::String(d.name.clone())),
                    ("type", string(wire_type(d.role))),
                    ("hooks", Json::Array(hooks)),
                ];
                if d.mode == GuardMode::DryRun as i32 {
                    members.push(("mode", string("audit")));
                }
                if d.failure_policy == FailurePolicy::FailOpen as i32 {
                    members.push(("failOpen", Json::Bool(true)));
                }
                if d.priority != 0 {
                    members.push(("priority", Json::Number(d.priority.to_string())));
                }
                object(members)
            })
            .collect();
        Ok(object(vec![("interceptors", Json::Array(interceptors))]))
    }

    async fn invoke(&self, params: Option<&Json>, session: String) -> Result<Json, Refused> {
        let invocation = Invocation::read(params)?;
        let mut batch = EvaluateRequest {
            batch_id: String::new(),
            context: Some(BatchContext {
                session_id: session,
                ..Default::default()
            }),
            ..Default::default()
        };
        match &invocation.judged {
            Judged::Call { tool, arguments } => batch.calls.push(ToolCall {
                call_id: INVOKE_CALL_ID.into(),
                tool: tool.clone(),
                arguments: arguments.clone(),
            }),
            Judged::Result { tool, result, .. } => batch.results.push(ToolResult {
                call_id: INVOKE_CALL_ID.into(),
                tool: tool.clone(),
                server: String::new(),
                result: result.clone(),
            }),
        }
        let mut client = self.client().await?;
        let mut request = tonic::Request::new(InterceptorInvokeRequest {
            name: invocation.name.clone(),
            batch: Some(batch),
        });
        request.set_timeout(self.timeout);
        let decision = match client.invoke(request).await {
            Ok(answer) => answer.into_inner().decision.unwrap_or_default(),
            Err(status) => {
                return Err(match status.code() {
                    tonic::Code::NotFound => Refused::Params(format!(
                        "unknown interceptor {:?}",
                        shown(&invocation.name)
                    )),
                    tonic::Code::FailedPrecondition | tonic::Code::InvalidArgument => {
                        Refused::Params(status.message().to_owned())
                    }
                    _ => mesh_status(&status),
                });
            }
        };
        invocation.answer(&decision)
    }
}

/// What an invocation judges.
enum Judged {
    Call {
        tool: String,
        arguments: String,
    },
    Result {
        tool: String,
        result: String,
        /// The payload was wrapped as `structuredContent`.
        wrapped: bool,
    },
}

/// `interceptor/invoke`'s params, checked.
struct Invocation {
    name: String,
    phase: &'static str,
    payload: Json,
    judged: Judged,
}

impl Invocation {
    fn read(params: Option<&Json>) -> Result<Self, Refused> {
        let bad = |m: &str| Refused::Params(m.to_owned());
        let Some(params @ Json::Object(_)) = params else {
            return Err(bad("params must be an object"));
        };
        let name = match params.get("name") {
            Some(Json::String(name)) if !name.is_empty() && name.len() <= MAX_NAME_BYTES => {
                name.clone()
            }
            Some(Json::String(name)) => {
                return Err(Refused::Params(format!(
                    "params.name must be 1 to {MAX_NAME_BYTES} bytes; it is {}",
                    name.len()
                )));
            }
            _ => return Err(bad("params.name (the interceptor) must be a string")),
        };
        match params.get("event") {
            None | Some(Json::Null) => {}
            Some(Json::String(e)) if e.len() <= MAX_EVENT_BYTES => {}
            Some(_) => {
                return Err(Refused::Params(format!(
                    "params.event must be a string of at most {MAX_EVENT_BYTES} bytes"
                )));
            }
        }
        let phase = match params.get("phase") {
            Some(Json::String(p)) if p == "request" => "request",
            Some(Json::String(p)) if p == "response" => "response",
            _ => return Err(bad("params.phase must be \"request\" or \"response\"")),
        };
        let payload = match params.get("payload") {
            Some(payload @ Json::Object(_)) => payload.clone(),
            _ => return Err(bad("params.payload must be an object")),
        };
        let tool = payload
            .get("name")
            .and_then(Json::as_str)
            .map(str::to_owned);
        let judged = if phase == "request" {
            let Some(tool) = tool else {
                return Err(bad(
                    "params.payload.name (the tool of the request) must be a string",
                ));
            };
            let arguments = match payload.get("arguments") {
                None | Some(Json::Null) => "{}".to_owned(),
                Some(arguments @ Json::Object(_)) => arguments.to_text(),
                Some(_) => return Err(bad("params.payload.arguments must be an object")),
            };
            Judged::Call { tool, arguments }
        } else {
            let (result, wrapped) = result_of(&payload);
            Judged::Result {
                tool: tool.unwrap_or_else(|| "unknown".into()),
                result,
                wrapped,
            }
        };
        Ok(Self {
            name,
            phase,
            payload,
            judged,
        })
    }

    /// The SEP result of the guard's decision.
    fn answer(&self, decision: &BatchDecision) -> Result<Json, Refused> {
        let role = decision
            .trace
            .first()
            .map_or(GuardRole::Validate as i32, |t| t.role);
        let kind = wire_type(role);
        let mut members = vec![
            ("interceptor", Json::String(self.name.clone())),
            ("type", string(kind)),
            ("phase", string(self.phase)),
        ];
        // (blocked with this content, the payload as the guard left it)
        let (blocked, payload): (Option<(&str, bool)>, Json) = match &self.judged {
            Judged::Call { .. } => {
                let Some(call) = decision.decisions.first() else {
                    return Err(Refused::Failed("the mesh answered no decision".into()));
                };
                if call.action == Action::Proceed as i32 {
                    let mut payload = self.payload.clone();
                    if let Some(final_call) = &call.call {
                        payload.set("name", Json::String(final_call.tool.clone()));
                        if let Ok(read) = json::read(&final_call.arguments)
                            && (self.payload.get("arguments").is_some()
                                || !call.rewritten_by.is_empty())
                        {
                            payload.set("arguments", read.value);
                        }
                    }
                    (None, payload)
                } else {
                    (
                        Some((call.content.as_str(), call.failure)),
                        self.payload.clone(),
                    )
                }
            }
            Judged::Result { wrapped, .. } => {
                let Some(result) = decision.results.first() else {
                    return Err(Refused::Failed("the mesh answered no decision".into()));
                };
                if result.action == ResultAction::Block as i32 {
                    (
                        Some((result.content.as_str(), result.failure)),
                        self.payload.clone(),
                    )
                } else {
                    let read = json::read(&result.result)
                        .map_err(|e| Refused::Failed(format!("the mesh's result: {e}")))?
                        .value;
                    let payload = if *wrapped {
                        read.get("structuredContent").cloned().unwrap_or(Json::Null)
                    } else {
                        read
                    };
                    (None, payload)
                }
            }
        };
        if let Some((content, true)) = blocked {
            return Err(Refused::Failed(format!(
                "interceptor {:?} failed: {content}",
                shown(&self.name)
            )));
        }
        let message = |content: &str| {
            Json::Array(vec![object(vec![
                ("message", Json::String(content.to_owned())),
                ("severity", string("error")),
            ])])
        };
        if kind == "validation" {
            match blocked {
                None => members.push(("valid", Json::Bool(true))),
                Some((content, _)) => {
                    members.push(("valid", Json::Bool(false)));
                    members.push(("severity", string("error")));
                    members.push(("messages", message(content)));
                }
            }
        } else {
            members.push(("modified", Json::Bool(payload != self.payload)));
            members.push(("payload", payload));
            if let Some((content, _)) = blocked {
                members.push(("messages", message(content)));
            }
        }
        Ok(object(members))
    }
}

/// A response payload as a `CallToolResult`'s JSON: itself when it has a
/// `content` array, else wrapped as the `structuredContent` of a result
/// with no content (true).
pub fn result_of(payload: &Json) -> (String, bool) {
    if matches!(payload.get("content"), Some(Json::Array(_))) {
        (payload.to_text(), false)
    } else {
        let wrapped = object(vec![
            ("content", Json::Array(Vec::new())),
            ("structuredContent", payload.clone()),
        ]);
        (wrapped.to_text(), true)
    }
}

fn wire_type(role: i32) -> &'static str {
    if role == GuardRole::Mutate as i32 {
        "mutation"
    } else {
        "validation"
    }
}

fn mesh_status(status: &tonic::Status) -> Refused {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown => {
            Refused::Unreachable(format!("the mesh did not answer: {}", status.message()))
        }
        code => Refused::Mesh(format!(
            "the mesh refused the request ({code:?}): {}",
            status.message()
        )),
    }
}

fn shown(name: &str) -> String {
    name.chars().take(64).collect()
}

fn string(s: &str) -> Json {
    Json::String(s.to_owned())
}

fn object(members: Vec<(&str, Json)>) -> Json {
    Json::Object(
        members
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(text: &str) -> Json {
        json::read(text).unwrap().value
    }

    fn refused(text: &str) -> String {
        match Invocation::read(Some(&params(text))) {
            Err(Refused::Params(message)) => message,
            Err(other) => panic!("not a params refusal: {other}"),
            Ok(_) => panic!("accepted: {text}"),
        }
    }

    #[test]
    fn sep2624_invoke_params_of_the_wrong_shape_are_refused_naming_the_field() {
        assert!(refused("[1]").contains("params must be an object"));
        assert!(refused(r#"{"phase":"request","payload":{}}"#).contains("params.name"));
        assert!(refused(r#"{"name":7,"phase":"request","payload":{}}"#).contains("params.name"));
        let long = "n".repeat(MAX_NAME_BYTES + 1);
        assert!(
            refused(&format!(
                r#"{{"name":"{long}","phase":"request","payload":{{}}}}"#
            ))
            .contains("1 to 128 bytes")
        );
        assert!(
            refused(r#"{"name":"g","phase":"both","payload":{"name":"t"}}"#)
                .contains("params.phase")
        );
        assert!(refused(r#"{"name":"g","phase":"request","payload":[]}"#).contains("payload"));
        assert!(
            refused(r#"{"name":"g","phase":"request","payload":{"arguments":{}}}"#)
                .contains("params.payload.name")
        );
        assert!(
            refused(r#"{"name":"g","phase":"request","payload":{"name":"t","arguments":"x"}}"#)
                .contains("arguments must be an object")
        );
        let event = "e".repeat(MAX_EVENT_BYTES + 1);
        assert!(
            refused(&format!(
                r#"{{"name":"g","event":"{event}","phase":"request","payload":{{"name":"t"}}}}"#
            ))
            .contains("params.event")
        );
    }

    #[test]
    fn sep2624_a_response_payload_is_a_result_as_it_is_or_wrapped() {
        let (text, wrapped) = result_of(&params(r#"{"content":[{"type":"text","text":"x"}]}"#));
        assert!(!wrapped);
        assert_eq!(text, r#"{"content":[{"type":"text","text":"x"}]}"#);
        let (text, wrapped) = result_of(&params(r#"{"name":"echo","arguments":{"note":"a"}}"#));
        assert!(wrapped);
        assert_eq!(
            text,
            r#"{"content":[],"structuredContent":{"name":"echo","arguments":{"note":"a"}}}"#
        );
    }

    #[test]
    fn sep2624_other_messages_are_not_taken() {
        use clap::Parser;
        #[derive(Parser)]
        struct Args {
            #[command(flatten)]
            mesh: crate::JudgeArgs,
        }
        let args = Args::parse_from(["t", "--mesh", "127.0.0.1:1"]);
        let ic = Interceptors::from_judge_args(&args.mesh);
        assert!(
            ic.take(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#, "s")
                .is_none()
        );
        // The method named inside params is not the method.
        assert!(
            ic.take(
                r#"{"jsonrpc":"2.0","id":1,"method":"ping","params":{"m":"interceptors/list"}}"#,
                "s"
            )
            .is_none()
        );
        // A notification of the method is not answered here.
        assert!(
            ic.take(r#"{"jsonrpc":"2.0","method":"interceptors/list"}"#, "s")
                .is_none()
        );
    }
}
