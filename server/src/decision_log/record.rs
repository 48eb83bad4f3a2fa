//! The records of the decision log (R29): what one line holds.
//!
//! One line is one [`LogRecord`]: an envelope (format version, sequence
//! number, time-sortable id, time, mesh instance, the hash of the previous
//! line, how many fields were masked) around an [`Entry`], which is either a
//! [`DecisionRecord`] (one batch answered: decided, refused or aborted) or a
//! [`ChainChangeRecord`] (a guard registered or deregistered, a config
//! reload), and ends with the line's own hash. The envelope is filled in by
//! the writer; callers build entries.
//!
//! These are plain types (strings, numbers, `serde_json::Value`), not the
//! mesh's internal ones, so that the format is defined here and nowhere
//! else. The JSON Schema `docs/decision-log.schema.json` describes the same
//! format, and a test checks written records against it.
//!
//! Every field is always written (`null` or `[]` when there is nothing), so
//! that a reader sees the same columns in every record.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The version of the record format, the `v` of every line.
pub const FORMAT_VERSION: u32 = 1;

/// One line of the log, as read back.
///
/// Serializing a `LogRecord` read from a line gives that line's bytes again
/// (the field order below is the order in which the writer emits them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogRecord {
    /// [`FORMAT_VERSION`].
    pub v: u32,
    /// 0 for the first record of the log, then +1 per record, across files.
    pub seq: u64,
    /// A UUIDv7 (time-ordered): unique, and sorting ids sorts records by the
    /// time they were written.
    pub id: String,
    /// When the record was written, RFC 3339 in UTC.
    pub time: String,
    /// The mesh instance that wrote it.
    pub mesh: String,
    /// SHA-256 (lowercase hex) of the previous line's bytes, without its
    /// newline; [`super::chain::GENESIS`] for the first record of the log.
    pub prev: String,
    /// How many values were masked or omitted in this record (see
    /// [`super::mask`]); 0 when none.
    pub masked: u32,
    /// The decision or chain change.
    #[serde(flatten)]
    pub entry: Entry,
    /// SHA-256 (lowercase hex) of this line's bytes before `,"hash":"`.
    pub hash: String,
}

/// The envelope as written, without `hash` (the seal adds it). The member
/// order is [`LogRecord`]'s.
#[derive(Serialize)]
pub(crate) struct Unsealed<'a> {
    pub v: u32,
    pub seq: u64,
    pub id: &'a str,
    pub time: &'a str,
    pub mesh: &'a str,
    pub prev: &'a str,
    pub masked: u32,
    #[serde(flatten)]
    pub entry: &'a Entry,
}

/// What a record is about: `"kind": "decision"`, `"chain_change"`, or one
/// of the writer's own seals, `"checkpoint"` and `"gap"` (see
/// [`super::checkpoint`]). Callers append decisions and chain changes; the
/// writer refuses checkpoints and gaps from them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    Decision(DecisionRecord),
    ChainChange(ChainChangeRecord),
    /// `"kind": "refusal_summary"`: refusal records left out by the bounds
    /// on what refused peers may make the log write.
    RefusalSummary(RefusalSummaryRecord),
    Checkpoint(CheckpointRecord),
    Gap(GapRecord),
    /// R35: an approver's answer to an approval request.
    Approval(ApprovalAnswerRecord),
}

/// An approver's answer to an approval request (R35), attributed to its
/// caller. (The ask and the use are in the decision records of the
/// batches that made and used the request.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalAnswerRecord {
    pub caller: Caller,
    /// The request answered (its id; not `id`, which is the record's own).
    pub request: String,
    /// `approve` or `deny`.
    pub answer: String,
    /// The approver's note. Free text: masked by the text formats.
    pub note: String,
    /// The guard that asked, the call's tool and digest, the session.
    pub guard: String,
    pub tool: String,
    pub digest: String,
    pub session_id: String,
    /// `answered`, or why it was refused.
    pub outcome: String,
}

/// A signed checkpoint (R29): the writer vouches, with its Ed25519 key,
/// for the chain up to the record before this one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    /// Why it was written: `open`, `count`, `interval`, `rotate`, `close`.
    pub reason: String,
    /// Records before this one in the log (its own `seq`).
    pub records: u64,
    /// The hash of the line before it (its own `prev`): the head it seals.
    pub head: String,
    /// The name of the file it is written in.
    pub segment: String,
    /// The writer writes a checkpoint at least every this many records.
    pub every: u64,
    /// ... and within this many milliseconds of an unsealed record.
    pub interval_ms: u64,
    /// The first 16 hex digits of the SHA-256 of the raw public key.
    pub key_id: String,
    /// Ed25519 signature (128 hex digits) of the record's line with `sig`
    /// empty and without `hash` (see [`super::checkpoint`]).
    pub sig: String,
}

/// A signed gap (R29): the mesh was restarted on a log that ends before
/// the latest checkpoint it knew of, and was told to go on (`allow_gap`).
/// It names what is missing; it also seals the chain as a checkpoint does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GapRecord {
    /// Records before this one in the log (its own `seq`).
    pub records: u64,
    /// The hash of the line before it (its own `prev`).
    pub head: String,
    pub segment: String,
    pub every: u64,
    pub interval_ms: u64,
    /// The latest checkpoint known before the restart, which the log no
    /// longer holds: its `seq` and line hash.
    pub missing_seq: u64,
    pub missing_hash: String,
    /// Where it was known from: `state` (the log's `checkpoint.state`) or
    /// `witness`.
    pub source: String,
    pub key_id: String,
    pub sig: String,
}

/// Who sent the batch or made the change, as the mesh authenticated it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Caller {
    /// The principal's id; `None` when the listener authenticates no one.
    pub id: Option<String>,
    /// The roles it held (`evaluate`, `register`, `admin`).
    #[serde(default)]
    pub roles: Vec<String>,
    /// The peer address of the connection, if known.
    pub peer: Option<String>,
}

/// One batch answered by the mesh.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    pub caller: Caller,
    pub batch: BatchRecord,
    /// The chain revision the batch was judged against (R17); `None` when
    /// it was refused before a chain snapshot was taken.
    pub chain_revision: Option<u64>,
    /// One per call, in batch order (R2); empty for refused and aborted
    /// batches and for zero-call batches (R1).
    #[serde(default)]
    pub decisions: Vec<CallDecisionRecord>,
    /// One per guard of the chain, in chain order (R21).
    #[serde(default)]
    pub trace: Vec<GuardTraceRecord>,
    /// The OpenTelemetry trace id (32 lowercase hex digits), if traced.
    pub trace_id: Option<String>,
    pub outcome: Outcome,
}

/// The batch as the coordinator sent it, masked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchRecord {
    pub batch_id: String,
    pub session_id: String,
    pub turn_index: u32,
    /// The model's text for the round, if any. Free text: not masked.
    pub model_text: Option<String>,
    /// The batch's free metadata (tenant, user, agent, ...), masked by key.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The deadline the batch was judged under, in milliseconds, if known.
    pub timeout_ms: Option<u32>,
    /// The calls as sent (before any rewrite), masked.
    #[serde(default)]
    pub calls: Vec<CallRecord>,
}

/// One tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    pub call_id: String,
    pub tool: String,
    /// The arguments as a JSON object, masked. Arguments that are not a
    /// JSON object are never written: they are replaced by the string
    /// [`super::mask::OMITTED`] (and counted in `masked`).
    pub arguments: Value,
}

impl CallRecord {
    /// A call from its arguments as the JSON text the coordinator sent.
    /// Text that is not a JSON object is replaced by
    /// [`super::mask::OMITTED`] here already, so the raw text is never
    /// held by a record.
    pub fn from_text(call_id: impl Into<String>, tool: impl Into<String>, arguments: &str) -> Self {
        let arguments = match serde_json::from_str::<Value>(arguments) {
            Ok(value @ Value::Object(_)) => value,
            _ => Value::String(super::mask::OMITTED.to_owned()),
        };
        CallRecord {
            call_id: call_id.into(),
            tool: tool.into(),
            arguments,
        }
    }
}

/// The mesh's final answer for one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallDecisionRecord {
    pub call_id: String,
    pub action: Action,
    /// The call as it must run, when rewrites changed it (R12); `None` when
    /// it is the call of the batch unchanged. Masked like the batch's calls.
    pub call: Option<CallRecord>,
    /// For steer and cancel: what the model reads instead. Free text: not
    /// masked.
    pub content: Option<String>,
    /// For steer and cancel: the guard whose skip decided.
    pub decided_by: Option<String>,
    /// The rule that decided, where the guard names one (a policy rule,
    /// R27; the `unguarded` setting, R28).
    pub rule: Option<String>,
    /// The skip comes from a guard's failure under `fail_closed` (R13).
    pub failure: bool,
    /// The mutate guards that rewrote the call, in order (R12).
    #[serde(default)]
    pub rewritten_by: Vec<String>,
    /// `fail_open` guards that failed on this call and were bypassed (R13).
    #[serde(default)]
    pub bypassed: Vec<String>,
    /// R35: for ask, the approval request made (its id, guard, reason,
    /// digest, expiry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalAsked>,
    /// R35: why the approval the batch named for this call did not hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_refused: Option<String>,
    /// R35: the approval request this call ran on (now used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_by_request: Option<String>,
}

/// The approval request an ask made (R35).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalAsked {
    pub id: String,
    pub guard: String,
    pub reason: String,
    pub digest: String,
    pub expires_at_ms: u64,
}

/// A decision's action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Proceed,
    Steer,
    Cancel,
    /// R35: the call waits for a person's approval.
    Ask,
}

/// A guard's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardRole {
    Validate,
    Mutate,
}

/// What happened at one guard (R21).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceStatus {
    Proceeded,
    Skipped,
    Rewrote,
    NotApplicable,
    Superseded,
    Failed,
    TimedOut,
    Malformed,
    RejectedRewrite,
    DryRun,
    Asked,
}

/// One guard's part in the batch (R21).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuardTraceRecord {
    pub guard: String,
    pub role: GuardRole,
    pub status: TraceStatus,
    /// From sending the request to its answer or failure; 0 when nothing
    /// was sent.
    pub latency_us: u64,
    #[serde(default)]
    pub sent_call_ids: Vec<String>,
    /// For `dry_run`: would have skipped.
    #[serde(default)]
    pub skipped_call_ids: Vec<String>,
    /// For `dry_run`: would have rewritten.
    #[serde(default)]
    pub rewritten_call_ids: Vec<String>,
    pub error: Option<String>,
    /// For `dry_run` guards: the status it would have had if enforced.
    pub dry_run_status: Option<TraceStatus>,
    /// R32: the replica that judged (or failed), as dialed; absent for a
    /// policy guard, when nothing was sent, and in records written before
    /// guards had replicas (so those verify unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    /// R34: the session labels the guard added (for `dry_run`: would have
    /// added); absent when none, so records without labels verify
    /// unchanged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// R34: labels it sent that were refused.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refused_labels: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// How the batch ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub status: OutcomeStatus,
    /// The gRPC status code answered: 0 (OK) when decided, else e.g. 3
    /// INVALID_ARGUMENT, 8 RESOURCE_EXHAUSTED, 10 ABORTED, 14 UNAVAILABLE.
    pub code: i32,
    /// The gRPC status message, when not decided.
    pub message: Option<String>,
}

impl Outcome {
    /// A batch judged and answered with its decisions.
    pub fn decided() -> Self {
        Outcome {
            status: OutcomeStatus::Decided,
            code: 0,
            message: None,
        }
    }

    /// A batch refused before it was judged (R17, R20, R25).
    pub fn refused(code: i32, message: impl Into<String>) -> Self {
        Outcome {
            status: OutcomeStatus::Refused,
            code,
            message: Some(message.into()),
        }
    }

    /// A batch aborted by a guard with failure policy `abort` (R13).
    pub fn aborted(code: i32, message: impl Into<String>) -> Self {
        Outcome {
            status: OutcomeStatus::Aborted,
            code,
            message: Some(message.into()),
        }
    }
}

/// `decided`, `refused` or `aborted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeStatus {
    Decided,
    Refused,
    Aborted,
}

/// A change of the chain, attributed to its caller (R29).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainChangeRecord {
    pub caller: Caller,
    pub change: ChangeKind,
    /// The guard concerned; `None` for a change that is not about one guard.
    pub guard: Option<String>,
    /// The guard's registration as submitted (register, config reload),
    /// masked like call arguments.
    pub spec: Option<Value>,
    /// The chain revision before the change.
    pub old_revision: Option<u64>,
    /// The chain revision after it; `None` when it was refused.
    pub new_revision: Option<u64>,
    pub outcome: ChangeOutcome,
}

/// `register`, `deregister` or `config_reload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Register,
    Deregister,
    ConfigReload,
}

/// Whether a chain change was applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeOutcome {
    pub status: ChangeStatus,
    /// The gRPC status code answered to the caller (0 when applied).
    pub code: i32,
    pub message: Option<String>,
}

impl ChangeOutcome {
    pub fn applied() -> Self {
        ChangeOutcome {
            status: ChangeStatus::Applied,
            code: 0,
            message: None,
        }
    }

    /// A change about to be applied (see [`ChangeStatus::Requested`]).
    pub fn requested() -> Self {
        ChangeOutcome {
            status: ChangeStatus::Requested,
            code: 0,
            message: None,
        }
    }

    pub fn refused(code: i32, message: impl Into<String>) -> Self {
        ChangeOutcome {
            status: ChangeStatus::Refused,
            code,
            message: Some(message.into()),
        }
    }
}

/// `requested`, `applied` or `refused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeStatus {
    /// Written before the change is applied, under `on_log_failure =
    /// "refuse"`: the change is applied only once this record is written,
    /// and the record of its result (`applied` or `refused`) follows.
    Requested,
    Applied,
    Refused,
}

/// The refusal records left out during one interval, because a peer or the
/// whole mesh was past its bound (records or bytes per interval), or the
/// log directory past nine tenths of its budget (R29). Written once per
/// interval in which something was left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusalSummaryRecord {
    /// The interval, RFC 3339 in UTC.
    pub from: String,
    pub to: String,
    /// Refusal records left out.
    pub left_out: u64,
    /// Their size as records, in bytes (estimated).
    pub left_out_bytes: u64,
    /// The peers whose refusals were left out (address without port), the
    /// most first, at most [`SUMMARY_PEERS`].
    #[serde(default)]
    pub peers: Vec<PeerCount>,
    /// Left out from peers not listed.
    pub other_peers_left_out: u64,
}

/// The most peers a summary names.
pub const SUMMARY_PEERS: usize = 16;

/// One peer's refusal records left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerCount {
    pub peer: String,
    pub left_out: u64,
}
