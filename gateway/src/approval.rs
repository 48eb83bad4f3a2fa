//! A guard's *ask* (R35) answered by the person at the MCP client, through
//! elicitation (MCP 2025-06-18 and 2025-11-25).
//!
//! When a `tools/call` is decided *ask* ([`crate::judge::Disposition::Ask`]),
//! the client declared form elicitation at `initialize`, and the gateway has
//! approver credentials (`--approver-token-file`), the gateway sends the
//! client an `elicitation/create` request of its own, naming the guard, its
//! reason, the tool and its arguments (as the guard judged them), with an
//! empty form: the user accepts or declines.
//!
//! * `accept`: the gateway approves the request with its approver
//!   credentials (`ApprovalService.Approve`, note "approved by the MCP
//!   client's user through elicitation"), judges the same call again with
//!   the approval (`EvaluateRequest.approvals`), and does what that decision
//!   says: forwards it on proceed (once: the mesh uses the approval once),
//!   answers it otherwise. A later guard that asks too is asked about the
//!   same way, up to [`MAX_ROUNDS`] asks per call.
//! * `decline` or `cancel`: the gateway denies the request (`Deny`, with a
//!   note saying so) and answers the call with a tool result (`isError`
//!   false, as a cancel) saying the person declined; nothing runs.
//! * No answer within the bound (`--elicitation-timeout-ms`, and never past
//!   the request's expiry), an error answer, or an answer the gateway cannot
//!   read: the call is answered as not approved, with the request's id and
//!   how to approve it out of band; nothing runs. A timed-out elicitation is
//!   cancelled at the client (`notifications/cancelled`), and so is one
//!   whose call the client cancels.
//!
//! An approval given out of band is used when the same call comes again in
//! the session: the gateway names the requests it was asked under
//! ([`crate::judge::Judge`] remembers them), so the approval-needed answer's
//! "then the same call may be made again" holds.
//!
//! What binds an answer to its call: each elicitation has an id of the
//! gateway's own, `guardmesh-approval-` and 128 random bits, sent to this
//! client only and waited for once; the approval request the
//! gateway approves is the one it holds for that elicitation, never anything
//! the client's answer says (its `content` is ignored). A client message
//! answering an id of that form is never forwarded upstream: an answer to
//! an elicitation no longer waited for (a second answer, a late one, a
//! made-up id) is dropped. The mesh checks the rest: the approval holds
//! only for the same call (tool and arguments), in the same session, under
//! the same chain revision, before its expiry, and once.
//!
//! Transports: `mcp stdio` asks for single calls and for the calls of a
//! JSON-RPC batch (one after the other; the batch's array waits for them);
//! `mcp http` asks for a single call's POST, whose answer becomes an SSE
//! stream (the `elicitation/create`, then the call's answer), the client
//! POSTing its answer in the same session; a JSON-RPC batch over HTTP gets
//! the approval-needed answer. An ask waiting for the user holds none of
//! the permits that bound the calls being judged, so the client's other
//! requests (and its answer) are read and served meanwhile. A client that
//! leaves (stdin closed, session deleted) ends its asks unanswered.
//!
//! Otherwise (no elicitation capability, no approver credentials, a mesh
//! in the gateway's process, or [`MAX_WAITING`] elicitations already
//! waiting) the call is answered as before: a tool result saying an
//! approval is needed, naming the request and `guardmesh approvals approve
//! ID`. The 2026-07-28 revision's `input_required` result is not produced
//! by the gateway (only relayed from upstreams); a client of that revision
//! gets the approval-needed answer.

use crate::json::{self, Json};
use crate::judge::{Asked, Disposition, Judge};
use guardmesh_client::{Approver, Connection, MeshArgs};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::oneshot;

/// How the gateway answers asks through the client (flattened into
/// `mcp stdio` and `mcp http`).
#[derive(clap::Args, Debug, Clone)]
pub struct ApprovalArgs {
    /// A file holding the bearer token (its first line) of a principal with
    /// the `approver` role, other than the one of --token-file: with it, a
    /// guard's ask is put to the MCP client's user through elicitation
    /// (clients that declare it), and approved or denied with this token.
    /// The mesh address and its TLS flags are those of the mesh connection.
    #[arg(long, value_name = "PATH")]
    pub approver_token_file: Option<PathBuf>,
    /// Longest wait for the user's answer to an approval elicitation, in
    /// milliseconds (never past the approval request's expiry); past it the
    /// call is answered as not approved.
    #[arg(long, default_value_t = 300_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub elicitation_timeout_ms: u64,
}

/// The start of the id of every elicitation the gateway sends.
pub const ID_PREFIX: &str = "guardmesh-approval-";

/// Elicitations one client session may have waiting at once; past it an
/// ask is answered as approval needed, without asking.
pub const MAX_WAITING: usize = 16;

/// Asks put to the user for one call, at most (a chain whose guards ask
/// one after the other).
pub const MAX_ROUNDS: usize = 3;

/// The arguments shown in an elicitation's message, at most (bytes).
const MAX_SHOWN_ARGUMENTS: usize = 4096;

/// The gateway's approver: the mesh's address and TLS, the approver's token,
/// connected with the first answer.
pub struct ApproverLink {
    mesh: String,
    connection: Connection,
    approver: tokio::sync::OnceCell<Approver>,
}

impl ApproverLink {
    /// The approver for `--approver-token-file` `token_file`, over the
    /// mesh connection `connect` (its token replaced); the files are read
    /// now.
    pub fn new(connect: &MeshArgs, token_file: &std::path::Path) -> Result<Self, String> {
        let mut args = connect.clone();
        args.token = None;
        args.token_file = Some(token_file.to_owned());
        let connection = args
            .connection()
            .map_err(|e| format!("--approver-token-file: {e}"))?;
        Ok(Self {
            mesh: args.mesh,
            connection,
            approver: tokio::sync::OnceCell::new(),
        })
    }

    async fn approver(&self) -> Result<&Approver, String> {
        self.approver
            .get_or_try_init(|| async {
                let connect = Approver::connect_with(&self.mesh, &self.connection);
                match tokio::time::timeout(Duration::from_secs(10), connect).await {
                    Ok(Ok(approver)) => Ok(approver),
                    Ok(Err(e)) => Err(crate::judge::error_chain(&e)),
                    Err(_) => Err("connecting to the mesh timed out".to_owned()),
                }
            })
            .await
    }

    /// Approves (or denies) request `id` with `note`.
    async fn answer(&self, id: &str, approve: bool, note: &str) -> Result<(), String> {
        let approver = self.approver().await?;
        let answered = async {
            if approve {
                approver.approve(id, note).await
            } else {
                approver.deny(id, note).await
            }
        };
        tokio::time::timeout(Duration::from_secs(10), answered)
            .await
            .map_err(|_| "the mesh did not answer in time".to_owned())?
            .map(drop)
            .map_err(|e| crate::judge::error_chain(&e))
    }
}

/// The approver of `--approver-token-file` for a gateway judging with
/// `judge` (none without the flag); refused with `--config` (a mesh in the
/// gateway's process has no `ApprovalService` to reach).
pub fn link(
    judge: &crate::judge::JudgeArgs,
    args: &ApprovalArgs,
) -> Result<Option<Arc<ApproverLink>>, String> {
    let Some(token_file) = &args.approver_token_file else {
        return Ok(None);
    };
    if judge.config.is_some() {
        return Err(
            "--approver-token-file answers asks through a mesh reached with --mesh; \
             it cannot be used with --config"
                .into(),
        );
    }
    ApproverLink::new(&judge.connect, token_file).map(|link| Some(Arc::new(link)))
}

/// Whether the `initialize` request `message` declares form elicitation
/// (`capabilities.elicitation`: `{}` means form, or `{"form": {...}}`), in
/// a revision that has server-to-client elicitation (2025-06-18 up to the
/// 2026-07-28 revision, which has none).
pub fn declares_form_elicitation(message: &Json) -> bool {
    let Some(params) = message.get("params") else {
        return false;
    };
    let revision = params
        .get("protocolVersion")
        .and_then(Json::as_str)
        .unwrap_or("");
    if !("2025-06-18"..="2025-12-31").contains(&revision) {
        return false;
    }
    match params
        .get("capabilities")
        .and_then(|c| c.get("elicitation"))
    {
        Some(Json::Object(members)) => {
            members.is_empty()
                || matches!(
                    members.iter().find(|(k, _)| k == "form"),
                    Some((_, Json::Object(_)))
                )
        }
        _ => false,
    }
}

/// The elicitations of one client session waiting for their answer, by
/// the gateway's id.
#[derive(Default)]
struct Waiting {
    closed: bool,
    /// The waiter of each elicitation, and the id key of the call it asks
    /// about.
    by_id: HashMap<String, (oneshot::Sender<Json>, String)>,
}

/// What a waiter is sent when the client cancels the call it asks about
/// (never a JSON-RPC message: those are objects).
const CALL_CANCELLED: &str = "the call was cancelled by the client";

/// One client session's approvals through elicitation.
pub struct Approvals {
    link: Option<Arc<ApproverLink>>,
    timeout: Duration,
    /// The client declared form elicitation at `initialize`.
    form: AtomicBool,
    waiting: Mutex<Waiting>,
}

/// How an elicitation ended.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Accept,
    Decline,
    Cancel,
    /// An error answer, or one the gateway cannot read: why.
    Unreadable(String),
}

impl Approvals {
    /// Approvals answered with `link` (none: never asked through the
    /// client), waiting at most `timeout` for each answer.
    pub fn new(link: Option<Arc<ApproverLink>>, timeout: Duration) -> Self {
        Self {
            link,
            timeout,
            form: AtomicBool::new(false),
            waiting: Mutex::default(),
        }
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notes what a client message the gateway forwards says of the
    /// client: at `initialize`, whether it declares form elicitation.
    pub fn learn(&self, text: &str) {
        if !text.contains("\"initialize\"") {
            return;
        }
        let Ok(read) = json::read(text) else { return };
        if read.value.get("method").and_then(Json::as_str) == Some("initialize") {
            self.form
                .store(declares_form_elicitation(&read.value), Ordering::Relaxed);
        }
    }

    /// Whether the client declared form elicitation.
    pub fn client_elicits(&self) -> bool {
        self.form.load(Ordering::Relaxed)
    }

    /// Takes a client message (the gateway's serialization) that answers
    /// an elicitation of the gateway's: passed to its waiter, or dropped
    /// when nobody waits for it (a second or late answer, an id the
    /// gateway never sent). True when the message was such an answer: it
    /// is not forwarded upstream.
    pub fn take_answer(&self, text: &str) -> bool {
        if !text.contains(ID_PREFIX) {
            return false;
        }
        let Ok(read) = json::read(text) else {
            return false;
        };
        let message = read.value;
        if message.get("method").is_some() {
            return false;
        }
        let Some(id) = message.get("id").and_then(Json::as_str) else {
            return false;
        };
        if !id.starts_with(ID_PREFIX) {
            return false;
        }
        let waiter = self.waiting().by_id.remove(id);
        match waiter {
            Some((waiter, _)) => {
                let _ = waiter.send(message);
            }
            None => tracing::warn!(
                id,
                "dropped an answer to an approval elicitation nobody waits for"
            ),
        }
        true
    }

    /// The client is gone: every elicitation waiting ends unanswered, and
    /// no other is sent.
    pub fn close(&self) {
        let mut waiting = self.waiting();
        waiting.closed = true;
        waiting.by_id.clear();
    }

    fn open(&self, call: &str) -> Option<(String, oneshot::Receiver<Json>)> {
        let mut waiting = self.waiting();
        if waiting.closed || waiting.by_id.len() >= MAX_WAITING {
            return None;
        }
        let id = format!("{ID_PREFIX}{:032x}", rand::random::<u128>());
        let (tx, rx) = oneshot::channel();
        waiting.by_id.insert(id.clone(), (tx, call.to_owned()));
        Some((id, rx))
    }

    /// The client's `notifications/cancelled` (the gateway's serialization
    /// of a client message): the ask about the call it cancels, if any,
    /// ends (its elicitation cancelled at the client, nothing run). True
    /// when it ended one.
    pub fn cancel_call(&self, text: &str) -> bool {
        if !text.contains("notifications/cancelled") {
            return false;
        }
        let Ok(read) = json::read(text) else {
            return false;
        };
        let message = read.value;
        if message.get("method").and_then(Json::as_str) != Some("notifications/cancelled") {
            return false;
        }
        let Some(request) = message
            .get("params")
            .and_then(|p| p.get("requestId"))
            .and_then(|id| serde_json::value::RawValue::from_string(id.to_text()).ok())
        else {
            return false;
        };
        let key = crate::jsonrpc::id_key(&request);
        let mut waiting = self.waiting();
        let Some(id) = waiting
            .by_id
            .iter()
            .find(|(_, (_, call))| *call == key)
            .map(|(id, _)| id.clone())
        else {
            return false;
        };
        if let Some((waiter, _)) = waiting.by_id.remove(&id) {
            let _ = waiter.send(Json::String(CALL_CANCELLED.to_owned()));
        }
        true
    }

    fn forget(&self, id: &str) {
        self.waiting().by_id.remove(id);
    }

    /// What becomes of a call a guard asked about: put to the client's
    /// user when it can be (`send` writes a message to the client; false
    /// when the client is gone), else answered as approval needed. Never
    /// [`Disposition::Ask`]: forward (approved, and the mesh proceeds) or
    /// answer.
    pub async fn settle<F, Fut>(
        &self,
        judge: &Judge,
        session: &str,
        asked: Asked,
        send: F,
    ) -> Disposition
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let Some(link) = self.link.as_ref().filter(|_| self.client_elicits()) else {
            return Disposition::Answer(asked.answer);
        };
        let mut asked = asked;
        // The requests approved so far, one per guard that asked.
        let mut approved: Vec<String> = Vec::new();
        for _ in 0..MAX_ROUNDS {
            let Some(bound) = self.bound(&asked) else {
                return not_approved(&asked, "the approval request has expired");
            };
            let call = crate::jsonrpc::id_key(&asked.call.id);
            let Some((id, answer)) = self.open(&call) else {
                return Disposition::Answer(asked.answer);
            };
            // Not waited for once this round ends, however it ends (its
            // future dropped too: the client's stream is gone).
            let _forget = Forget(self, &id);
            if !send(elicitation(&id, &asked)).await {
                return not_approved(&asked, "the MCP client is gone");
            }
            let answer = match tokio::time::timeout(bound, answer).await {
                Ok(Ok(Json::String(cancelled))) if cancelled == CALL_CANCELLED => {
                    let _ = send(self::cancelled(&id, "the tool call was cancelled")).await;
                    return not_approved(&asked, CALL_CANCELLED);
                }
                Ok(Ok(message)) => read_answer(&message),
                Ok(Err(_)) => {
                    return not_approved(&asked, "the MCP client is gone");
                }
                Err(_) => {
                    self.forget(&id);
                    let _ = send(cancelled(
                        &id,
                        "the approval request was not answered in time",
                    ))
                    .await;
                    return not_approved(
                        &asked,
                        &format!("nobody answered within {} ms", bound.as_millis()),
                    );
                }
            };
            let approval = &asked.approval.id;
            match answer {
                Answer::Accept => {
                    if let Err(why) = link.answer(approval, true, APPROVED_NOTE).await {
                        tracing::warn!(approval, %why, "the gateway could not approve");
                        return not_approved(
                            &asked,
                            &format!("the approval could not be recorded: {why}"),
                        );
                    }
                    approved.push(approval.clone());
                    match judge.judge_approved(session, &asked.call, &approved).await {
                        // Another guard asks: asked about in turn.
                        Disposition::Ask(next) if !approved.contains(&next.approval.id) => {
                            asked = *next;
                        }
                        // Still asked under a request approved: not run.
                        Disposition::Ask(next) => return Disposition::Answer(next.answer),
                        decided => return decided,
                    }
                }
                Answer::Decline | Answer::Cancel => {
                    let note = if answer == Answer::Decline {
                        DECLINED_NOTE
                    } else {
                        CANCELLED_NOTE
                    };
                    if let Err(why) = link.answer(approval, false, note).await {
                        tracing::warn!(approval, %why, "the gateway could not deny");
                    }
                    return Disposition::Answer(crate::jsonrpc::tool_result(
                        &asked.call.id,
                        &declined(&asked, answer == Answer::Decline),
                        false,
                    ));
                }
                Answer::Unreadable(why) => {
                    tracing::warn!(approval, %why, "an approval elicitation answered unreadably");
                    return not_approved(
                        &asked,
                        &format!("the MCP client's answer could not be used: {why}"),
                    );
                }
            }
        }
        Disposition::Answer(asked.answer)
    }

    /// How long to wait for the answer about `asked`: the timeout, and
    /// never past the request's expiry; `None` when it has expired.
    fn bound(&self, asked: &Asked) -> Option<Duration> {
        let expires = asked.approval.expires_at_ms;
        if expires == 0 {
            return Some(self.timeout);
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let left = expires.checked_sub(now).filter(|left| *left > 0)?;
        Some(self.timeout.min(Duration::from_millis(left)))
    }
}

/// Forgets an elicitation when dropped.
struct Forget<'a>(&'a Approvals, &'a str);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0.forget(self.1);
    }
}

/// The note of an approval given through elicitation.
pub const APPROVED_NOTE: &str = "approved by the MCP client's user through elicitation";
/// The note of a request the user declined.
pub const DECLINED_NOTE: &str = "declined by the MCP client's user through elicitation";
/// The note of a request the user dismissed.
pub const CANCELLED_NOTE: &str =
    "dismissed (cancelled) by the MCP client's user through elicitation; not approved";

/// The tool and arguments an ask is about: the call as the guard judged
/// it, else as the client sent it.
fn asked_call(asked: &Asked) -> (&str, &str) {
    match &asked.approval.call {
        Some(call) => (&call.tool, &call.arguments),
        None => (&asked.call.name, &asked.call.arguments),
    }
}

/// `text` cut to at most `max` bytes, on a character boundary, marked.
fn shortened(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &text[..end], text.len())
}

/// The `elicitation/create` request `id` asking about `asked`.
fn elicitation(id: &str, asked: &Asked) -> String {
    let (tool, arguments) = asked_call(asked);
    let arguments = if arguments.trim().is_empty() {
        "{}"
    } else {
        arguments
    };
    let message = format!(
        "A guard asks you to approve this tool call before it runs.\n\
         Guard: {}\nReason: {}\nTool: {tool}\nArguments: {}\n\
         Accept to let it run once; decline to refuse it.",
        asked.approval.guard,
        asked.approval.reason,
        shortened(arguments, MAX_SHOWN_ARGUMENTS)
    );
    let string = |s: &str| Json::String(s.to_owned());
    Json::Object(vec![
        ("jsonrpc".into(), string("2.0")),
        ("id".into(), string(id)),
        ("method".into(), string("elicitation/create")),
        (
            "params".into(),
            Json::Object(vec![
                ("message".into(), Json::String(message)),
                (
                    "requestedSchema".into(),
                    Json::Object(vec![
                        ("type".into(), string("object")),
                        ("properties".into(), Json::Object(Vec::new())),
                    ]),
                ),
            ]),
        ),
    ])
    .to_text()
}

/// The notification cancelling elicitation `id` at the client, saying
/// `why`.
fn cancelled(id: &str, why: &str) -> String {
    let string = |s: &str| Json::String(s.to_owned());
    Json::Object(vec![
        ("jsonrpc".into(), string("2.0")),
        ("method".into(), string("notifications/cancelled")),
        (
            "params".into(),
            Json::Object(vec![
                ("requestId".into(), string(id)),
                ("reason".into(), Json::String(format!("guardmesh: {why}"))),
            ]),
        ),
    ])
    .to_text()
}

/// What the client's response `message` to an elicitation says.
fn read_answer(message: &Json) -> Answer {
    if let Some(error) = message.get("error") {
        let text = error
            .get("message")
            .and_then(Json::as_str)
            .unwrap_or("(no message)");
        return Answer::Unreadable(format!("the client answered with an error: {text}"));
    }
    let Some(result @ Json::Object(_)) = message.get("result") else {
        return Answer::Unreadable("no result object".into());
    };
    match result.get("action").and_then(Json::as_str) {
        Some("accept") => Answer::Accept,
        Some("decline") => Answer::Decline,
        Some("cancel") => Answer::Cancel,
        Some(other) => Answer::Unreadable(format!(
            "the action {:?} is none of accept, decline, cancel",
            shortened(other, 64)
        )),
        None => Answer::Unreadable("no action".into()),
    }
}

/// The call answered as not approved: why, and how it may still be
/// approved out of band; nothing runs.
fn not_approved(asked: &Asked, why: &str) -> Disposition {
    let text = format!(
        "guardmesh: the tool call was not approved ({why}); it was not run. {}",
        crate::judge::approval_needed(&asked.content, &asked.approval.id)
    );
    Disposition::Answer(crate::jsonrpc::tool_result(&asked.call.id, &text, false))
}

/// The text of a call the user declined (or dismissed).
fn declined(asked: &Asked, decline: bool) -> String {
    let (tool, _) = asked_call(asked);
    let how = if decline {
        "declined"
    } else {
        "dismissed without approving"
    };
    format!(
        "Tool call not run: the person at the MCP client {how} it when guard {} asked for \
         approval. Do not retry {tool} with these arguments.",
        asked.approval.guard
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn initialize(revision: &str, capabilities: &str) -> Json {
        json::read(&format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"initialize","params":{{"protocolVersion":"{revision}","capabilities":{capabilities},"clientInfo":{{"name":"t","version":"0"}}}}}}"#
        ))
        .unwrap()
        .value
    }

    #[test]
    fn r35_form_elicitation_is_what_the_client_declared() {
        for (revision, capabilities, form) in [
            ("2025-11-25", r#"{"elicitation":{}}"#, true),
            (
                "2025-11-25",
                r#"{"elicitation":{"form":{},"url":{}}}"#,
                true,
            ),
            ("2025-06-18", r#"{"elicitation":{}}"#, true),
            ("2025-11-25", r#"{"elicitation":{"url":{}}}"#, false),
            ("2025-11-25", r#"{"elicitation":true}"#, false),
            ("2025-11-25", r#"{"sampling":{}}"#, false),
            ("2025-11-25", r#"{}"#, false),
            ("2025-03-26", r#"{"elicitation":{}}"#, false),
            ("2026-07-28", r#"{"elicitation":{}}"#, false),
        ] {
            assert_eq!(
                declares_form_elicitation(&initialize(revision, capabilities)),
                form,
                "{revision} {capabilities}"
            );
        }
    }

    #[test]
    fn r35_only_accept_decline_and_cancel_are_answers() {
        let read = |text: &str| read_answer(&json::read(text).unwrap().value);
        assert_eq!(
            read(r#"{"jsonrpc":"2.0","id":"x","result":{"action":"accept","content":{}}}"#),
            Answer::Accept
        );
        assert_eq!(
            read(r#"{"jsonrpc":"2.0","id":"x","result":{"action":"decline"}}"#),
            Answer::Decline
        );
        assert_eq!(
            read(r#"{"jsonrpc":"2.0","id":"x","result":{"action":"cancel"}}"#),
            Answer::Cancel
        );
        for garbage in [
            r#"{"jsonrpc":"2.0","id":"x","result":{"action":"ACCEPT"}}"#,
            r#"{"jsonrpc":"2.0","id":"x","result":{"action":true}}"#,
            r#"{"jsonrpc":"2.0","id":"x","result":{}}"#,
            r#"{"jsonrpc":"2.0","id":"x","result":"accept"}"#,
            r#"{"jsonrpc":"2.0","id":"x","error":{"code":-1,"message":"no"}}"#,
        ] {
            assert!(matches!(read(garbage), Answer::Unreadable(_)), "{garbage}");
        }
    }

    #[tokio::test]
    async fn r35_an_answer_reaches_only_its_own_waiter_once() {
        let approvals = Approvals::new(None, Duration::from_secs(1));
        let (a, mut rx_a) = approvals.open("1").unwrap();
        let (b, mut rx_b) = approvals.open("2").unwrap();
        assert_ne!(a, b);
        let answer =
            |id: &str| format!(r#"{{"jsonrpc":"2.0","id":"{id}","result":{{"action":"accept"}}}}"#);
        // An id of the gateway's form that was never sent: taken (never
        // forwarded), and nobody's.
        assert!(approvals.take_answer(&answer(&format!("{ID_PREFIX}{:032x}", 7))));
        assert!(rx_a.try_recv().is_err() && rx_b.try_recv().is_err());
        // Another peer's id: not the gateway's.
        assert!(!approvals.take_answer(&answer("7")));
        assert!(approvals.take_answer(&answer(&a)));
        assert!(rx_a.try_recv().is_ok());
        assert!(rx_b.try_recv().is_err(), "b is not answered by a's answer");
        // A second answer to a: dropped.
        assert!(approvals.take_answer(&answer(&a)));
        // A request with that id is not an answer.
        assert!(!approvals.take_answer(&format!(
            r#"{{"jsonrpc":"2.0","id":"{b}","method":"ping"}}"#
        )));
        approvals.close();
        assert!(rx_b.await.is_err(), "closed: b ends unanswered");
        assert!(approvals.open("3").is_none(), "closed: no more asks");
    }

    #[tokio::test]
    async fn r35_a_cancelled_call_ends_only_its_own_ask() {
        let approvals = Approvals::new(None, Duration::from_secs(1));
        let (_, mut rx_a) = approvals.open("1").unwrap();
        let (_, mut rx_b) = approvals.open("s:1").unwrap();
        let cancel = |id: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","method":"notifications/cancelled","params":{{"requestId":{id}}}}}"#
            )
        };
        assert!(!approvals.cancel_call(&cancel("7")), "no ask about call 7");
        assert!(approvals.cancel_call(&cancel("\"1\"")));
        assert!(
            rx_a.try_recv().is_err(),
            "call 1 (a number) is not call \"1\""
        );
        assert_eq!(
            rx_b.try_recv().unwrap(),
            Json::String(CALL_CANCELLED.to_owned())
        );
        assert!(approvals.cancel_call(&cancel("1")));
        assert!(rx_a.try_recv().is_ok());
    }

    #[test]
    fn r35_waiting_elicitations_are_bounded() {
        let approvals = Approvals::new(None, Duration::from_secs(1));
        let held: Vec<_> = (0..MAX_WAITING)
            .map(|_| approvals.open("1").unwrap())
            .collect();
        assert!(approvals.open("3").is_none());
        approvals.forget(&held[0].0);
        assert!(approvals.open("1").is_some());
    }
}
