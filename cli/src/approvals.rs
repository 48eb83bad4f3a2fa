//! `guardmesh approvals list|approve|deny`: a person answering guards'
//! asks (R35) from the command line, through the mesh's `ApprovalService`
//! (the SDK's [`Approver`]). On a mesh with principals the credentials
//! (`--cert-file`/`--key-file` or a token) need the `approver` role, or
//! `admin`; an approver may not answer a request its own identity asked.
//!
//! A refusal is said with the mesh's message and its gRPC code, and the
//! command exits non-zero: `NOT_FOUND` (no such request, or long expired),
//! `FAILED_PRECONDITION` (already answered, or expired unanswered),
//! `PERMISSION_DENIED` (the role is missing, or the approver asked the call
//! itself), `INVALID_ARGUMENT` (not a request id, a note too long).

use crate::app::{Explain, MeshArgs};
use clap::{Args, Subcommand};
use guardmesh_client::proto::{ApprovalRequest, ApprovalState, ToolCall};
use guardmesh_client::{Approver, ClientError};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// `guardmesh approvals`: the mesh to reach, and what to do.
#[derive(Args)]
pub(crate) struct ApprovalsArgs {
    #[command(flatten)]
    mesh: MeshArgs,
    #[command(subcommand)]
    action: ApprovalsAction,
}

#[derive(Subcommand)]
enum ApprovalsAction {
    /// Lists the approval requests the mesh holds, pending first, then
    /// newest first: one line per request (id, state, guard, tool,
    /// session, expiry, reason), or JSON with --json.
    List {
        /// Only requests in this state: pending, approved, denied, used or
        /// expired. Default: every state.
        #[arg(long)]
        state: Option<ApprovalState>,
        /// Only requests of this session (`BatchContext.session_id`).
        #[arg(long, value_name = "ID")]
        session: Option<String>,
        /// At most this many (1 to 1000; default: the mesh's 100).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: Option<u32>,
        /// Prints `{"requests": [...]}`: the proto's `ApprovalRequest`
        /// fields, the state by name, arguments as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Approves a pending request: the same call, sent again with the
    /// request's id (`Batch::approval`), may then run once. Prints the
    /// request as it now stands.
    Approve(Answer),
    /// Denies a pending request: the call is cancelled when it is sent
    /// again with it. Prints the request as it now stands.
    Deny(Answer),
}

#[derive(Args)]
struct Answer {
    /// The request's id (64 hex digits), as `approvals list` shows it.
    id: String,
    /// Why, for the record (the decision log keeps it). At most 1,024
    /// bytes.
    #[arg(long, default_value = "")]
    note: String,
    /// Prints the request as JSON (as one element of `list --json`).
    #[arg(long)]
    json: bool,
}

/// Runs `guardmesh approvals ...`.
pub(crate) async fn run(args: ApprovalsArgs) -> Result<(), Error> {
    let mesh = &args.mesh;
    let approver = Approver::connect_with(mesh.mesh.clone(), &mesh.connection()?)
        .await
        .map_err(mesh.explain())?;
    match args.action {
        ApprovalsAction::List {
            state,
            session,
            limit,
            json,
        } => {
            let state = state.unwrap_or(ApprovalState::Unspecified);
            let requests = approver
                .list(state, session.as_deref().unwrap_or(""), limit.unwrap_or(0))
                .await
                .map_err(|e| refused(mesh, e))?;
            if json {
                let requests: Vec<Value> = requests.iter().map(request_json).collect();
                outln!("{}", json!({ "requests": requests }));
            } else {
                print_list(&requests, state);
            }
        }
        ApprovalsAction::Approve(answer) | ApprovalsAction::Deny(answer)
            if answer.id.trim().is_empty() =>
        {
            return Err("the request's id is empty (see `guardmesh approvals list`)".into());
        }
        ApprovalsAction::Approve(Answer { id, note, json }) => {
            let request = approver
                .approve(id.trim(), note)
                .await
                .map_err(|e| refused(mesh, e))?;
            print_request(&request, json);
        }
        ApprovalsAction::Deny(Answer { id, note, json }) => {
            let request = approver
                .deny(id.trim(), note)
                .await
                .map_err(|e| refused(mesh, e))?;
            print_request(&request, json);
        }
    }
    Ok(())
}

/// What to say about a failed call: the mesh's own message and its code
/// when it answered (the message names what was wrong), else what
/// `guards` and `evaluate` say about a mesh they cannot reach.
fn refused(mesh: &MeshArgs, error: ClientError) -> Error {
    let status = match crate::evaluate::refusal(error) {
        Ok(status) if status.code() != tonic::Code::Unauthenticated => status,
        Ok(status) => return mesh.explain()(ClientError::Status(status)),
        Err(error) => return mesh.explain()(error),
    };
    let hint = match status.code() {
        tonic::Code::NotFound => {
            " (no such request, or it expired long ago: `guardmesh approvals list` shows \
             those the mesh holds)"
        }
        tonic::Code::FailedPrecondition => " (only a pending request can be answered)",
        tonic::Code::PermissionDenied if !status.message().contains("may not approve") => {
            " (answering needs the approver or admin role)"
        }
        tonic::Code::Aborted => " (answered concurrently; list it and answer again)",
        _ => "",
    };
    format!("{} ({}){hint}", status.message(), code_name(status.code())).into()
}

/// The gRPC code as the gRPC specification spells it.
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

fn state_name(state: i32) -> String {
    ApprovalState::try_from(state).map_or_else(|_| format!("unknown({state})"), |s| s.to_string())
}

/// Milliseconds since the Unix epoch as RFC 3339 (UTC, to the second).
fn when(ms: u64) -> String {
    i64::try_from(ms / 1000)
        .ok()
        .and_then(|s| OffsetDateTime::from_unix_timestamp(s).ok())
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| format!("{ms} ms"))
}

/// Text from a guard or an approver, quoted with its control characters
/// escaped: it cannot move the terminal's cursor or forge a line.
fn quoted(text: &str) -> String {
    format!("{text:?}")
}

/// A call's arguments as JSON: the object when they parse, else the text.
fn arguments(text: &str) -> Value {
    if text.is_empty() {
        return json!({});
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

fn call_json(call: &ToolCall) -> Value {
    json!({
        "call_id": call.call_id,
        "tool": call.tool,
        "arguments": arguments(&call.arguments),
    })
}

/// One request as JSON: the proto's `ApprovalRequest` field names, the
/// state by name (`pending`, ...), the call's arguments as JSON.
fn request_json(r: &ApprovalRequest) -> Value {
    json!({
        "id": r.id,
        "state": state_name(r.state),
        "guard": r.guard,
        "reason": r.reason,
        "digest": r.digest,
        "session_id": r.session_id,
        "chain_revision": r.chain_revision,
        "asked_at_ms": r.asked_at_ms,
        "expires_at_ms": r.expires_at_ms,
        "asked_by": r.asked_by,
        "answered_by": r.answered_by,
        "note": r.note,
        "call": r.call.as_ref().map(call_json),
    })
}

fn tool(r: &ApprovalRequest) -> &str {
    r.call.as_ref().map_or("", |c| c.tool.as_str())
}

/// `approvals list`: a header, then one line per request, reason last
/// (quoted: it is the guard's text).
fn print_list(requests: &[ApprovalRequest], state: ApprovalState) {
    if requests.is_empty() {
        match state {
            ApprovalState::Unspecified => outln!("no approval requests"),
            state => outln!("no {state} approval requests"),
        }
        return;
    }
    outln!(
        "{:<64} {:<8} {:<20} {:<20} {:<16} {:<20} reason",
        "id",
        "state",
        "guard",
        "tool",
        "session",
        "expires"
    );
    for r in requests {
        outln!(
            "{:<64} {:<8} {:<20} {:<20} {:<16} {:<20} {}",
            r.id,
            state_name(r.state),
            r.guard,
            tool(r),
            r.session_id,
            when(r.expires_at_ms),
            quoted(&r.reason)
        );
    }
}

/// `approvals approve|deny`: the request as it now stands.
fn print_request(r: &ApprovalRequest, json: bool) {
    if json {
        outln!("{}", request_json(r));
        return;
    }
    outln!("approval request {}: {}", r.id, state_name(r.state));
    outln!("  guard:      {}", r.guard);
    outln!("  reason:     {}", quoted(&r.reason));
    if let Some(call) = &r.call {
        outln!("  tool:       {}", call.tool);
        outln!("  arguments:  {}", arguments(&call.arguments));
    }
    outln!("  digest:     {}", r.digest);
    outln!("  session:    {}", r.session_id);
    outln!("  chain:      revision {}", r.chain_revision);
    let by = |who: &str| {
        if who.is_empty() {
            String::new()
        } else {
            format!(" by {who}")
        }
    };
    outln!("  asked:      {}{}", when(r.asked_at_ms), by(&r.asked_by));
    outln!("  expires:    {}", when(r.expires_at_ms));
    let state = ApprovalState::try_from(r.state).unwrap_or(ApprovalState::Unspecified);
    if matches!(
        state,
        ApprovalState::Approved | ApprovalState::Denied | ApprovalState::Used
    ) {
        let note = if r.note.is_empty() {
            String::new()
        } else {
            format!(", note {}", quoted(&r.note))
        };
        outln!("  answered:  {state}{}{note}", by(&r.answered_by));
    }
}
