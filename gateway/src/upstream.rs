//! What comes back from the upstream (R31, R33): every message read once,
//! as I-JSON, and matched to its request by the gateway's own ids.
//!
//! * Ids: each client request the gateway forwards goes upstream under an
//!   id of the gateway's own (a number, unique in the gateway's life,
//!   [`InFlight::send`]); the upstream's response is matched by that id
//!   exactly (the number as the gateway wrote it: `"114"` does not answer
//!   `114`, nor `114.0`), and the client's id is put back. A response that
//!   matches no request in flight (a second one, a retyped id, an id the
//!   gateway never sent) is dropped and logged. A client request reusing
//!   the id of one of its session's requests still in flight is refused
//!   ([`InFlight::reserve`]): it would otherwise take the other's answer.
//! * Reading ([`read`]): an upstream message is refused when any peer
//!   could read it differently from the gateway (member names equal, or
//!   equal under case folding, at any depth: `"result"` twice, `"id"`
//!   twice), when it is not a JSON-RPC message (unknown envelope members, a
//!   response without exactly one of `result` and `error`), or not JSON. A
//!   refused response whose one `id` names a request in flight answers that
//!   request with [`UPSTREAM_UNREADABLE`]; anything else refused is dropped.
//! * What the client receives is the gateway's serialization of what it
//!   read, or of what the mesh judged ([`crate::judge::Judge::judge_response`]),
//!   never the upstream's bytes.
//! * Tasks: a `tools/call` with `params.task` is answered by a task-created
//!   result, relayed as read; the task is remembered, and the call's
//!   result, when awaited for judging, moves to the task's id: each
//!   `tasks/result` (and a `tasks/get` whose result carries content) of
//!   that task is judged like a plain call's result. A task the gateway
//!   did not see created cannot have its result judged: `tasks/result` of
//!   it is refused ([`TASK_UNSEEN`]) and `tasks/get` of it relays the
//!   task's own fields only.

use crate::json::{self, Json};
use crate::judge::PendingResult;
use guardmesh_client::casefold;
use rmcp::model::{ErrorCode, ErrorData};
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// `tasks/result` of a task the gateway did not see created (before it
/// started, behind its back, or forgotten past [`MAX_TASKS`]): its result
/// could not be judged, so it is not fetched.
pub const TASK_UNSEEN: ErrorCode = ErrorCode(-32077);

/// The error refusing `tasks/result` of the task `task`, not seen created.
pub fn task_unseen(task: Option<&str>) -> ErrorData {
    let task = task.map_or_else(|| "without a taskId".to_owned(), |t| format!("{t:?}"));
    ErrorData::new(
        TASK_UNSEEN,
        format!(
            "guardmesh: task {task} was not created through this gateway (or is no longer \
             remembered: the latest {MAX_TASKS} are), so its result cannot be judged; it was \
             not fetched"
        ),
        None,
    )
}

/// The upstream answered a request with a message the gateway cannot read
/// alike to every peer (a member twice, an unknown envelope member): the
/// request is answered with this error and nothing of the message is
/// forwarded.
pub const UPSTREAM_UNREADABLE: ErrorCode = ErrorCode(-32075);

/// Requests in flight at once per gateway, at most; past it a request is
/// refused (an upstream that never answers cannot grow the table).
pub const MAX_IN_FLIGHT: usize = 16 * 1024;

/// Tasks whose results are judged, remembered at most (the oldest go
/// first).
pub const MAX_TASKS: usize = 4096;

/// The envelope members of a JSON-RPC message.
const ENVELOPE: [&str; 6] = ["jsonrpc", "id", "method", "params", "result", "error"];

/// Why a request forwarded upstream expects its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Purpose {
    /// Relayed as read (with the client's id).
    Plain,
    /// A `tools/call`: its result judged when the mesh asked for it.
    Call(Option<PendingResult>),
    /// `tasks/result` or `tasks/get` of a task whose result is judged.
    Task(PendingResult),
    /// `tasks/get` of a task the gateway did not see created: its status
    /// is relayed, never a result it holds ([`TASK_UNSEEN`]).
    UnseenTask,
}

impl Purpose {
    /// The result the mesh judges, if any.
    pub fn judged(&self) -> Option<&PendingResult> {
        match self {
            Self::Plain | Self::Call(None) | Self::UnseenTask => None,
            Self::Call(Some(pending)) | Self::Task(pending) => Some(pending),
        }
    }
}

/// A request forwarded upstream, until its answer.
#[derive(Debug, Clone)]
pub struct Sent {
    pub session: String,
    /// The client's id, put back on the answer.
    pub client_id: Json,
    pub purpose: Purpose,
}

#[derive(Default)]
struct State {
    by_upstream: HashMap<u64, (String, String, Sent)>,
    /// (session, client id key) of requests being judged or in flight:
    /// the upstream id once sent, 0 before.
    by_client: HashMap<(String, String), u64>,
    /// The tasks created through the gateway, by task id: the result
    /// the mesh judges, when it judges the call's.
    tasks: HashMap<String, Option<PendingResult>>,
    task_order: VecDeque<String>,
}

/// The requests of one gateway in flight to the upstream.
pub struct InFlight {
    next: AtomicU64,
    state: Mutex<State>,
}

impl Default for InFlight {
    fn default() -> Self {
        Self {
            next: AtomicU64::new(1),
            state: Mutex::default(),
        }
    }
}

/// The JSON-RPC error refusing a request whose id is in flight.
pub fn id_in_flight(key: &str) -> ErrorData {
    ErrorData::new(
        ErrorCode::INVALID_REQUEST,
        format!(
            "guardmesh: request id {} is already in flight in this session; \
             use an id of its own for each request",
            shown_key(key)
        ),
        None,
    )
}

fn shown_key(key: &str) -> String {
    match key.strip_prefix("s:") {
        Some(s) => format!("{s:?}"),
        None => key.to_owned(),
    }
}

impl InFlight {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes that request `key` ([`crate::jsonrpc::id_key`]) of `session`
    /// is being judged or forwarded; refused while another request of the
    /// session with that id is (or when too many are in flight).
    pub fn reserve(&self, session: &str, key: &str) -> Result<(), ErrorData> {
        let mut state = self.state();
        let entry = (session.to_owned(), key.to_owned());
        if state.by_client.contains_key(&entry) {
            return Err(id_in_flight(key));
        }
        if state.by_client.len() >= MAX_IN_FLIGHT {
            return Err(ErrorData::new(
                ErrorCode::INVALID_REQUEST,
                format!(
                    "guardmesh: {MAX_IN_FLIGHT} requests are awaiting the upstream's answer; \
                     the request was not forwarded"
                ),
                None,
            ));
        }
        state.by_client.insert(entry, 0);
        Ok(())
    }

    /// Request `key` of `session` is answered (or given up): its id may be
    /// used again, and a late answer from the upstream is dropped.
    pub fn release(&self, session: &str, key: &str) {
        let mut state = self.state();
        if let Some(upstream) = state
            .by_client
            .remove(&(session.to_owned(), key.to_owned()))
        {
            state.by_upstream.remove(&upstream);
        }
    }

    /// [`Self::reserve`], released when the holder is dropped (a request
    /// whose answer is read within one exchange: `mcp http`).
    pub fn hold(&self, session: &str, key: &str) -> Result<Held<'_>, ErrorData> {
        self.reserve(session, key)?;
        Ok(Held {
            flight: self,
            session: session.to_owned(),
            key: key.to_owned(),
        })
    }

    /// The message `text` (the gateway's serialization of a client request
    /// with id key `key`, reserved) under a new id of the gateway's: what
    /// goes upstream. `None` when the text is not a request.
    pub fn send(&self, session: &str, key: &str, purpose: Purpose, text: &str) -> Option<String> {
        self.send_as(session, key, purpose, text)
            .map(|(_, text)| text)
    }

    /// [`Self::send`], with the gateway's id.
    pub fn send_as(
        &self,
        session: &str,
        key: &str,
        purpose: Purpose,
        text: &str,
    ) -> Option<(u64, String)> {
        let mut message = json::read(text).ok()?.value;
        let client_id = message.get("id")?.clone();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        message.set("id", Json::Number(id.to_string()));
        let mut state = self.state();
        let entry = (session.to_owned(), key.to_owned());
        state.by_client.insert(entry.clone(), id);
        state.by_upstream.insert(
            id,
            (
                entry.0,
                entry.1,
                Sent {
                    session: session.to_owned(),
                    client_id,
                    purpose,
                },
            ),
        );
        drop(state);
        Some((id, message.to_text()))
    }

    /// The request an upstream response with id `id` answers, taken:
    /// only a number exactly as the gateway wrote it matches.
    pub fn answered(&self, id: &Json) -> Option<Sent> {
        let upstream = self.upstream_id(id)?;
        let mut state = self.state();
        let (session, key, sent) = state.by_upstream.remove(&upstream)?;
        state.by_client.remove(&(session, key));
        Some(sent)
    }

    /// Whether a request whose result the mesh judges is in flight.
    pub fn judging(&self) -> bool {
        self.state()
            .by_upstream
            .values()
            .any(|(_, _, sent)| sent.purpose.judged().is_some())
    }

    /// [`Self::answered`], only when `id` is the gateway's id `expected`.
    pub fn answered_as(&self, id: &Json, expected: u64) -> Option<Sent> {
        (self.upstream_id(id) == Some(expected))
            .then(|| self.answered(id))
            .flatten()
    }

    fn upstream_id(&self, id: &Json) -> Option<u64> {
        let Json::Number(text) = id else { return None };
        let n: u64 = text.parse().ok()?;
        (n.to_string() == *text).then_some(n)
    }

    /// What a client's `notifications/cancelled` becomes upstream: its
    /// `requestId` mapped to the gateway's id of that request in flight;
    /// `None` (not forwarded) when it names no request in flight. Any
    /// other message is returned as it is.
    pub fn outgoing_notification(&self, session: &str, text: String) -> Option<String> {
        if !text.contains("notifications/cancelled") {
            return Some(text);
        }
        let Ok(read) = json::read(&text) else {
            return Some(text);
        };
        let mut message = read.value;
        if message.get("method").and_then(Json::as_str) != Some("notifications/cancelled") {
            return Some(text);
        }
        let id = message.get("params").and_then(|p| p.get("requestId"))?;
        let key =
            crate::jsonrpc::id_key(&serde_json::value::RawValue::from_string(id.to_text()).ok()?);
        let upstream = *self
            .state()
            .by_client
            .get(&(session.to_owned(), key))
            .filter(|id| **id != 0)?;
        if let Json::Object(members) = &mut message
            && let Some((_, params)) = members.iter_mut().find(|(k, _)| k == "params")
        {
            params.set("requestId", Json::Number(upstream.to_string()));
        }
        Some(message.to_text())
    }

    /// The purpose of a client request other than `tools/call` (`text`:
    /// the gateway's serialization): `tasks/result` and `tasks/get` of a
    /// task whose result is judged are [`Purpose::Task`]; `tasks/get` of a
    /// task the gateway did not see created is [`Purpose::UnseenTask`],
    /// and `tasks/result` of one is refused ([`TASK_UNSEEN`]): its result
    /// could not be judged. `params.taskId` is read under any spelling
    /// Go's `encoding/json` reads as that name.
    pub fn purpose_of(&self, text: &str) -> Result<Purpose, ErrorData> {
        if !text.contains("\"tasks/") {
            return Ok(Purpose::Plain);
        }
        let Ok(read) = json::read(text) else {
            return Ok(Purpose::Plain);
        };
        let method = read.value.get("method").and_then(Json::as_str);
        let fetches = match method {
            Some("tasks/result") => true,
            Some("tasks/get") => false,
            _ => return Ok(Purpose::Plain),
        };
        let task = match read.value.get("params") {
            Some(Json::Object(members)) => members
                .iter()
                .find(|(k, _)| casefold::equal_fold(k, "taskId"))
                .and_then(|(_, v)| v.as_str()),
            _ => None,
        };
        let known = task.and_then(|t| self.state().tasks.get(t).cloned());
        match known {
            Some(Some(pending)) => Ok(Purpose::Task(pending)),
            Some(None) => Ok(Purpose::Plain),
            None if fetches => Err(task_unseen(task)),
            None => Ok(Purpose::UnseenTask),
        }
    }

    /// A task was created through the gateway for a call (whose result
    /// the mesh judges, when `pending`).
    pub fn task_created(&self, task: &str, pending: Option<PendingResult>) {
        let mut state = self.state();
        if state.tasks.insert(task.to_owned(), pending).is_none() {
            state.task_order.push_back(task.to_owned());
        }
        while state.task_order.len() > MAX_TASKS {
            if let Some(old) = state.task_order.pop_front() {
                state.tasks.remove(&old);
            }
        }
    }
}

/// A request reserved by [`InFlight::hold`], released when dropped.
pub struct Held<'a> {
    flight: &'a InFlight,
    session: String,
    key: String,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.flight.release(&self.session, &self.key);
    }
}

/// A message from the upstream, read.
#[derive(Debug)]
pub enum Message {
    /// A response: its id as read, and the message.
    Response { id: Json, message: Json },
    /// A request or a notification of the server.
    Other(Json),
}

/// An upstream message the gateway does not forward: why, and its id when
/// exactly one `id` member names it.
#[derive(Debug)]
pub struct Unreadable {
    pub why: String,
    pub id: Option<Json>,
}

/// Reads one message from the upstream (see the module's documentation).
pub fn read(text: &str) -> Result<Message, Unreadable> {
    let read = json::read(text).map_err(|e| Unreadable {
        why: format!("not JSON: {e}"),
        id: None,
    })?;
    let Json::Object(members) = &read.value else {
        return Err(Unreadable {
            why: "not a JSON-RPC message (an object)".into(),
            id: None,
        });
    };
    let id = {
        let mut ids = members
            .iter()
            .filter(|(k, _)| casefold::equal_fold(k, "id"));
        match (ids.next(), ids.next()) {
            (Some((name, id)), None) if name == "id" => Some(id.clone()),
            _ => None,
        }
    };
    let refuse = |why: String| Unreadable {
        why,
        id: id.clone(),
    };
    if let Some(ambiguity) = read.ambiguity {
        return Err(refuse(ambiguity.to_string()));
    }
    if let Some((name, _)) = members
        .iter()
        .find(|(k, _)| !ENVELOPE.contains(&k.as_str()))
    {
        return Err(refuse(format!(
            "unknown member {name:?} in a JSON-RPC message"
        )));
    }
    if read.value.get("jsonrpc").and_then(Json::as_str) != Some("2.0") {
        return Err(refuse("`jsonrpc` is not \"2.0\"".into()));
    }
    if let Some(method) = read.value.get("method") {
        if method.as_str().is_none()
            || read.value.get("result").is_some()
            || read.value.get("error").is_some()
        {
            return Err(refuse(
                "a request with a non-string method, or a result".into(),
            ));
        }
        return Ok(Message::Other(read.value));
    }
    let Some(id) = id.clone() else {
        return Err(refuse("a response without one `id`".into()));
    };
    if read.value.get("params").is_some()
        || read.value.get("result").is_some() == read.value.get("error").is_some()
    {
        return Err(refuse(
            "a response without exactly one of `result` and `error`".into(),
        ));
    }
    Ok(Message::Response {
        id,
        message: read.value,
    })
}

/// Whether the `tools/call` `text` (the gateway's serialization) asks for
/// a task (`params.task`, under any spelling Go's `encoding/json` reads
/// as that name).
pub fn creates_task(text: &str) -> bool {
    let Ok(read) = json::read(text) else {
        return false;
    };
    matches!(
        read.value.get("params"),
        Some(Json::Object(members)) if members.iter().any(|(k, _)| casefold::equal_fold(k, "task"))
    )
}

/// The task id of a task-created result (`{"task": {"taskId": ...}}`).
pub fn created_task(result: &Json) -> Option<&str> {
    result.get("task")?.get("taskId")?.as_str()
}

/// The error answering the client's request `client_id` when the
/// upstream's response to it could not be read.
pub fn unreadable_answer(client_id: &Json, why: &str) -> String {
    let data = ErrorData::new(
        UPSTREAM_UNREADABLE,
        format!(
            "guardmesh: the upstream's answer could not be read alike to every peer and was \
             not forwarded: {why}"
        ),
        None,
    );
    let id = serde_json::value::RawValue::from_string(client_id.to_text()).ok();
    crate::jsonrpc::error(id.as_deref(), &data)
}

/// A judged `tools/call` (`text`, with the client's id key `key`, reserved)
/// as it goes upstream: under the gateway's own id, its result awaited for
/// judging when the mesh asked for it (R33).
pub fn forward_call(
    judge: &crate::judge::Judge,
    flight: &InFlight,
    session: &str,
    key: &str,
    text: &str,
) -> Option<String> {
    let pending = judge.take_pending(session, key);
    flight.send(session, key, Purpose::Call(pending), text)
}

/// The id keys that more than one request of a JSON-RPC batch uses: each
/// of those requests is refused ([`repeated_in_batch`]), none forwarded.
fn repeated_ids(items: &[crate::jsonrpc::Item]) -> std::collections::HashSet<String> {
    use crate::jsonrpc::Item;
    let mut seen = std::collections::HashSet::new();
    let mut repeated = std::collections::HashSet::new();
    for item in items {
        let key = match item {
            Item::ToolCall(call) => crate::jsonrpc::id_key(&call.id),
            Item::Forward {
                request: Some(key), ..
            } => key.clone(),
            _ => continue,
        };
        if !seen.insert(key.clone()) {
            repeated.insert(key);
        }
    }
    repeated
}

/// The elements of a JSON-RPC batch but the requests whose id another
/// request of the batch uses: each of those is answered in `answers`
/// with [`repeated_in_batch`], none forwarded.
pub fn without_repeated_ids(
    items: Vec<crate::jsonrpc::Item>,
    answers: &mut Vec<String>,
) -> Vec<crate::jsonrpc::Item> {
    use crate::jsonrpc::{Item, error, id_key};
    let repeated = repeated_ids(&items);
    if repeated.is_empty() {
        return items;
    }
    items
        .into_iter()
        .filter(|item| match item {
            Item::ToolCall(call) if repeated.contains(&id_key(&call.id)) => {
                answers.push(error(Some(&call.id), &repeated_in_batch(&id_key(&call.id))));
                false
            }
            Item::Forward {
                text,
                request: Some(key),
                ..
            } if repeated.contains(key) => {
                answers.push(refuse(text, &repeated_in_batch(key)));
                false
            }
            _ => true,
        })
        .collect()
}

/// The JSON-RPC error refusing a request whose id another request of its
/// batch uses.
fn repeated_in_batch(key: &str) -> ErrorData {
    ErrorData::new(
        ErrorCode::INVALID_REQUEST,
        format!(
            "guardmesh: request id {} is used by more than one request of the JSON-RPC batch; none of them was forwarded",
            shown_key(key)
        ),
        None,
    )
}

/// The id of the message `text` (the gateway's serialization of a client
/// message), if it has one.
pub fn id_of(text: &str) -> Option<Json> {
    json::read(text).ok()?.value.get("id").cloned()
}

/// The JSON-RPC error `error` answering the request `text` (the gateway's
/// serialization of a client message), under its id.
pub fn refuse(text: &str, error: &ErrorData) -> String {
    let id = id_of(text).and_then(|id| serde_json::value::RawValue::from_string(id.to_text()).ok());
    crate::jsonrpc::error(id.as_deref(), error)
}

/// The upstream asked the client something (sampling, elicitation) while
/// a call whose result the mesh judges was running: the gateway answers
/// the upstream with this error and does not relay the request.
pub const WITHHELD_WHILE_JUDGING: ErrorCode = ErrorCode(-32076);

/// What becomes of a message the upstream sends on its own (a
/// notification or a request of the server) while a call whose result
/// the mesh judges runs: `Ok` the message for the client (a progress
/// notification without its `message`, other notifications and `ping`
/// and `roots/list` as read), `Err` the answer to send the upstream
/// instead (its text would reach the model unjudged: sampling,
/// elicitation and any other request), or `Err` empty: dropped (a log
/// message).
pub fn while_judging(mut message: Json) -> Result<Json, String> {
    let method = message.get("method").and_then(Json::as_str).unwrap_or("");
    if message.get("id").is_none() {
        return match method {
            "notifications/message" => Err(String::new()),
            "notifications/progress" => {
                if let Json::Object(members) = &mut message
                    && let Some((_, Json::Object(params))) =
                        members.iter_mut().find(|(k, _)| k == "params")
                {
                    params.retain(|(k, _)| k != "message");
                }
                Ok(message)
            }
            _ => Ok(message),
        };
    }
    if matches!(method, "ping" | "roots/list") {
        return Ok(message);
    }
    Err(withheld(
        &message,
        "while a tool call whose result the mesh judges is running",
    ))
}

/// The gateway's answer to the upstream's request `message`, not relayed
/// to the client `when` (what was going on): the error
/// [`WITHHELD_WHILE_JUDGING`], under the request's id.
pub fn withheld(message: &Json, when: &str) -> String {
    let method = message.get("method").and_then(Json::as_str).unwrap_or("");
    let data = ErrorData::new(
        WITHHELD_WHILE_JUDGING,
        format!(
            "guardmesh: {method} is not relayed to the client {when} (its text would reach \
             the model unjudged)"
        ),
        None,
    );
    let id = message
        .get("id")
        .and_then(|id| serde_json::value::RawValue::from_string(id.to_text()).ok());
    crate::jsonrpc::error(id.as_deref(), &data)
}

/// The members of a task (`tasks/get`) kept beside a judged result.
const TASK_FIELDS: [&str; 8] = [
    "resultType",
    "taskId",
    "status",
    "statusMessage",
    "createdAt",
    "lastUpdatedAt",
    "ttl",
    "pollInterval",
];

/// What the client receives for the upstream's response `message` to the
/// request `sent` (read by [`read`], matched by [`InFlight::answered`]):
/// the gateway's serialization, under the client's id, of the message
/// or of what the mesh judged of its result.
pub async fn answer(
    judge: &crate::judge::Judge,
    flight: &InFlight,
    sent: Sent,
    mut message: Json,
) -> String {
    message.set("id", sent.client_id.clone());
    // R33: tool results sent to the client's model in an `input_required`
    // result's sampling requests (2026-07-28).
    if crate::sampling::carries_tool_results(&message) {
        message = crate::sampling::judged_for_client(judge, &sent.session, message).await;
    }
    if let Purpose::Call(pending) = &sent.purpose
        && let Some(task) = message.get("result").and_then(created_task)
    {
        // The call's result is the task's, judged when it is fetched.
        flight.task_created(task, pending.clone());
        return message.to_text();
    }
    if sent.purpose == Purpose::UnseenTask {
        // A task not seen created: its status only, never a result.
        if let Some(Json::Object(members)) = message.get("result") {
            let mut members = members.clone();
            members.retain(|(k, _)| TASK_FIELDS.contains(&k.as_str()));
            message.set("result", Json::Object(members));
        }
        return message.to_text();
    }
    let Some(pending) = sent.purpose.judged() else {
        return message.to_text();
    };
    let Some(result) = message.get("result") else {
        // An error answering the call: judged as an error result.
        return judge.judge_error(&sent.session, pending, &message).await;
    };
    let is_task = matches!(sent.purpose, Purpose::Task(_));
    if is_task && result.get("content").is_none() && result.get("structuredContent").is_none() {
        // A task's status: its own fields only.
        let mut status = result.clone();
        if let Json::Object(members) = &mut status {
            members.retain(|(k, _)| TASK_FIELDS.contains(&k.as_str()));
        }
        message.set("result", status);
        return message.to_text();
    }
    let keep: &[&str] = if is_task {
        &TASK_FIELDS
    } else {
        &["resultType"]
    };
    judge
        .judge_response(&sent.session, pending, &sent.client_id, result, keep)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r31_upstream_messages_peers_read_differently_are_refused() {
        for (text, id) in [
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{},"result":{"x":1}}"#,
                Some("1"),
            ),
            (r#"{"jsonrpc":"2.0","id":1,"id":2,"result":{}}"#, None),
            (r#"{"jsonrpc":"2.0","id":1,"ID":2,"result":{}}"#, None),
            (r#"{"jsonrpc":"2.0","id":1,"Result":{}}"#, Some("1")),
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{"a":{"k":1,"K":2}}}"#,
                Some("1"),
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{},"error":{}}"#,
                Some("1"),
            ),
            (r#"{"jsonrpc":"2.0","id":1}"#, Some("1")),
            (r#"[{"jsonrpc":"2.0","id":1,"result":{}}]"#, None),
            (r#"{"jsonrpc":"2.0","id":1,"result":"#, None),
        ] {
            let unreadable = read(text).expect_err(text);
            assert_eq!(unreadable.id.map(|i| i.to_text()).as_deref(), id, "{text}");
        }
        assert!(matches!(
            read(r#"{"jsonrpc":"2.0","id":"7","result":{}}"#),
            Ok(Message::Response { .. })
        ));
        assert!(matches!(
            read(r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{}}"#),
            Ok(Message::Other(_))
        ));
    }

    #[test]
    fn r31_answers_match_the_gateways_own_ids_exactly() {
        let flight = InFlight::default();
        flight.reserve("s", "114").unwrap();
        assert!(flight.reserve("s", "114").is_err(), "in flight");
        assert!(flight.reserve("t", "114").is_ok(), "another session");
        let sent = flight
            .send(
                "s",
                "114",
                Purpose::Plain,
                r#"{"jsonrpc":"2.0","id":114,"method":"ping"}"#,
            )
            .unwrap();
        let upstream = read(&sent).unwrap();
        let Message::Other(message) = upstream else {
            panic!()
        };
        let id = message.get("id").unwrap().clone();
        let Json::Number(n) = &id else { panic!() };
        for other in [
            Json::String(n.clone()),
            Json::Number(format!("{n}.0")),
            Json::Number(format!("0{n}")),
        ] {
            assert!(flight.answered(&other).is_none(), "{other:?}");
        }
        let answered = flight.answered(&id).unwrap();
        assert_eq!(answered.client_id, Json::Number("114".into()));
        assert!(
            flight.answered(&id).is_none(),
            "a second answer matches nothing"
        );
        assert!(
            flight.reserve("s", "114").is_ok(),
            "answered: the id is free"
        );
    }
}
