//! Soak (issue 6, item 10): a bounded run under faults, checking that every
//! batch is answered exactly once, every call gets exactly one decision, and
//! each decision is consistent with what the guards actually said and with
//! their failure policies.
//!
//! The run lasts 10 s by default (CI). For a longer run:
//!
//! ```text
//! GUARDMESH_SOAK_SECS=600 cargo test -p guardmesh-cli --release --test integration soak:: -- --nocapture
//! ```
//!
//! The chain, in the order the mesh consults it:
//!
//! * `stamp`: mutate, `fail_open`, for `m.*`: rewrites the arguments (adds
//!   `"stamp": <batch id>`), sometimes skips, errs or hangs past its timeout;
//! * `flaky`: validate, `fail_closed`: proceeds, steers or cancels at random
//!   per call, and per batch sometimes errs or hangs past its timeout;
//! * `veto`: validate, `fail_closed`, a real `guardmesh example-guard
//!   veto-marker` process (steers calls whose arguments contain "veto") that
//!   the test kills and restarts on the same port during the run;
//! * `open`: validate, `fail_open`: mostly proceeds, sometimes cancels,
//!   errs or hangs.
//!
//! Several coordinator streams send batches concurrently (a few in flight on
//! each), with some empty and some invalid batches mixed in. The in-process
//! guards log what they answered, per guard and batch; at the end every
//! decision is checked against those logs and the guards' policies, and the
//! figures are printed (run with `--nocapture` to see them).

use crate::harness::*;
use guardmesh_client::proto::pre_tool_service_client::PreToolServiceClient;
use guardmesh_client::proto::{
    Action, BatchContext, BatchDecision, CallDecision, EvaluateRequest, EvaluateResponse,
    FailurePolicy, GuardBatch, ToolCall, TraceStatus, Verdict, evaluate_response, verdict,
};
use guardmesh_client::verdict::{cancel, proceed, rewrite_arguments, steer};
use guardmesh_client::{Guard, Registration};
use rand::Rng;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

const SESSIONS: usize = 4;
const IN_FLIGHT_PER_SESSION: usize = 3;
const PROCESS_KILLS: usize = 3;
/// Timeout of the in-process guards; a hang lasts far longer.
const GUARD_TIMEOUT: Duration = Duration::from_millis(150);
const HANG: Duration = Duration::from_secs(2);
const BATCH_TIMEOUT_MS: u32 = 2000;
const VETO_CONTENT: &str = "vetoed by marker";

fn soak_duration() -> Duration {
    let secs = std::env::var("GUARDMESH_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(10);
    Duration::from_secs(secs.max(1))
}

// ---------------------------------------------------------------------------
// What the guards said
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Said {
    /// Answered in time (as far as the guard knows), with these verdicts by
    /// call id. A call without a verdict proceeds.
    Verdicts(HashMap<String, Verdict>),
    /// Answered with an error (`JudgeResponse.error`).
    Error,
    /// Did not answer within its timeout.
    Hang,
}

#[derive(Clone, Debug)]
struct Entry {
    /// The calls the guard was sent, as it received them.
    calls: Vec<ToolCall>,
    said: Said,
}

/// (guard, batch id) → what it received and said.
type Log = Arc<Mutex<HashMap<(String, String), Entry>>>;
type Counts = Arc<Mutex<BTreeMap<String, usize>>>;

fn count(counts: &Counts, key: impl Into<String>) {
    *counts.lock().unwrap().entry(key.into()).or_default() += 1;
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Stamp,
    Flaky,
    Open,
}

/// An in-process guard that misbehaves at random and logs what it said.
struct SoakGuard {
    role: Role,
    p_error: f64,
    p_hang: f64,
    log: Log,
    faults: Counts,
}

impl SoakGuard {
    fn name(&self) -> &'static str {
        match self.role {
            Role::Stamp => "stamp",
            Role::Flaky => "flaky",
            Role::Open => "open",
        }
    }

    fn verdict(&self, batch: &GuardBatch, call: &ToolCall, rng: &mut impl Rng) -> Option<Verdict> {
        let roll: f64 = rng.random();
        let id = &call.call_id;
        match self.role {
            Role::Stamp => {
                if roll < 0.05 {
                    Some(steer(id, format!("stamp steers {id}")))
                } else if roll < 0.10 {
                    Some(proceed(id))
                } else {
                    let mut args: serde_json::Map<String, serde_json::Value> =
                        serde_json::from_str(&call.arguments).unwrap_or_default();
                    args.insert("stamp".into(), batch.batch_id.clone().into());
                    Some(rewrite_arguments(id, &serde_json::Value::Object(args)))
                }
            }
            Role::Flaky => {
                if roll < 0.15 {
                    Some(steer(id, format!("flaky steers {id}")))
                } else if roll < 0.30 {
                    Some(cancel(id, format!("flaky cancels {id}")))
                } else if roll < 0.40 {
                    Some(proceed(id))
                } else {
                    None
                }
            }
            Role::Open => (roll < 0.10).then(|| cancel(id, format!("open cancels {id}"))),
        }
    }
}

impl Guard for SoakGuard {
    async fn judge(&self, batch: &GuardBatch) -> Result<Vec<Verdict>, Status> {
        let said = {
            let mut rng = rand::rng();
            let roll: f64 = rng.random();
            if roll < self.p_hang {
                Said::Hang
            } else if roll < self.p_hang + self.p_error {
                Said::Error
            } else {
                Said::Verdicts(
                    batch
                        .calls
                        .iter()
                        .filter_map(|c| self.verdict(batch, c, &mut rng))
                        .map(|v| (v.call_id.clone(), v))
                        .collect(),
                )
            }
        };
        let name = self.name();
        match &said {
            Said::Hang => count(&self.faults, format!("{name}: hang past timeout")),
            Said::Error => count(&self.faults, format!("{name}: error answer")),
            Said::Verdicts(verdicts) => {
                for v in verdicts.values() {
                    if let Some(verdict::Outcome::Skip(_)) = v.outcome {
                        count(&self.faults, format!("{name}: skip"));
                    }
                }
            }
        }
        self.log.lock().unwrap().insert(
            (name.to_owned(), batch.batch_id.clone()),
            Entry {
                calls: batch.calls.clone(),
                said: said.clone(),
            },
        );
        match said {
            Said::Hang => {
                tokio::time::sleep(HANG).await;
                Ok(Vec::new())
            }
            Said::Error => Err(Status::unavailable(format!("{name} is flaky"))),
            Said::Verdicts(verdicts) => Ok(batch
                .calls
                .iter()
                .filter_map(|c| verdicts.get(&c.call_id).cloned())
                .collect()),
        }
    }
}

async fn serve_soak_guard(guard: SoakGuard) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = guardmesh_client::serve(guard, listener, std::future::pending()).await;
    });
    (url, task)
}

// ---------------------------------------------------------------------------
// Coordinators
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Normal,
    Empty,
    Invalid,
}

struct Sent {
    kind: Kind,
    request: EvaluateRequest,
}

struct SessionRun {
    sent: HashMap<String, Sent>,
    answers: HashMap<String, Vec<EvaluateResponse>>,
    unknown_answers: usize,
    stream_error: Option<Status>,
    drained: bool,
}

fn random_batch(session: usize, n: usize, rng: &mut impl Rng) -> Sent {
    let batch_id = format!("s{session}-b{n}");
    let roll: f64 = rng.random();
    let kind = if roll < 0.05 {
        Kind::Empty
    } else if roll < 0.10 {
        Kind::Invalid
    } else {
        Kind::Normal
    };
    let tools = ["a.read", "a.write", "m.edit", "x.other"];
    let calls: Vec<ToolCall> = match kind {
        Kind::Empty => Vec::new(),
        Kind::Invalid => vec![
            ToolCall {
                call_id: "dup".into(),
                tool: "a.read".into(),
                arguments: "{}".into(),
            },
            ToolCall {
                call_id: "dup".into(),
                tool: "m.edit".into(),
                arguments: "{}".into(),
            },
        ],
        Kind::Normal => (0..rng.random_range(1..=5))
            .map(|i| {
                let mut args = serde_json::json!({ "n": i, "session": session });
                if rng.random_bool(0.25) {
                    args["note"] = "please veto this".into();
                }
                ToolCall {
                    call_id: format!("c{i}"),
                    tool: tools[rng.random_range(0..tools.len())].into(),
                    arguments: args.to_string(),
                }
            })
            .collect(),
    };
    Sent {
        kind,
        request: EvaluateRequest {
            batch_id,
            context: Some(BatchContext {
                session_id: format!("s{session}"),
                turn_index: u32::try_from(n).unwrap_or(u32::MAX),
                ..Default::default()
            }),
            calls,
            timeout_ms: BATCH_TIMEOUT_MS,
            ..Default::default()
        },
    }
}

/// One coordinator stream: sends batches (a few in flight) until `until`,
/// then closes its side and reads every answer until the mesh ends the
/// stream.
async fn run_session(url: String, session: usize, until: tokio::time::Instant) -> SessionRun {
    let channel = guardmesh_client::Connection::default()
        .channel(&url)
        .await
        .unwrap();
    let mut client = PreToolServiceClient::new(channel);
    let (tx, rx) = mpsc::channel::<EvaluateRequest>(64);
    let mut responses = client
        .evaluate(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let permits = Arc::new(Semaphore::new(IN_FLIGHT_PER_SESSION));
    let sent: Arc<Mutex<HashMap<String, Sent>>> = Arc::default();
    let reader = tokio::spawn({
        let permits = permits.clone();
        let sent = sent.clone();
        async move {
            let mut answers: HashMap<String, Vec<EvaluateResponse>> = HashMap::new();
            let mut unknown = 0;
            let error = loop {
                match responses.message().await {
                    Ok(Some(answer)) => {
                        if !sent.lock().unwrap().contains_key(&answer.batch_id) {
                            unknown += 1;
                            continue;
                        }
                        let list = answers.entry(answer.batch_id.clone()).or_default();
                        if list.is_empty() {
                            permits.add_permits(1);
                        }
                        list.push(answer);
                    }
                    Ok(None) => break None,
                    Err(status) => break Some(status),
                }
            };
            (answers, unknown, error)
        }
    });
    let mut n = 0;
    while tokio::time::Instant::now() < until {
        let Ok(permit) =
            tokio::time::timeout(Duration::from_secs(10), permits.clone().acquire_owned()).await
        else {
            break; // answers stopped coming: reported as lost below
        };
        permit.unwrap().forget();
        let batch = random_batch(session, n, &mut rand::rng());
        n += 1;
        let request = batch.request.clone();
        sent.lock().unwrap().insert(request.batch_id.clone(), batch);
        if tx.send(request).await.is_err() {
            break;
        }
    }
    drop(tx);
    // Every in-flight batch is answered before the mesh ends the stream.
    let (answers, unknown_answers, stream_error, drained) =
        match tokio::time::timeout(Duration::from_secs(60), reader).await {
            Ok(Ok((answers, unknown, error))) => (answers, unknown, error, true),
            _ => (HashMap::new(), 0, None, false),
        };
    let sent = std::mem::take(&mut *sent.lock().unwrap());
    SessionRun {
        sent,
        answers,
        unknown_answers,
        stream_error,
        drained,
    }
}

// ---------------------------------------------------------------------------
// Checking decisions against what the guards said
// ---------------------------------------------------------------------------

#[derive(Default)]
struct Figures {
    batches: usize,
    answered: usize,
    duplicates: usize,
    unknown: usize,
    lost_batches: usize,
    lost_calls: usize,
    calls: usize,
    unexpected_errors: usize,
    /// Normal batches shed whole because a guard was busy (R25): answered,
    /// nothing decided, for the coordinator to send again.
    shed: usize,
    outcomes: BTreeMap<String, usize>,
    violations: Vec<String>,
}

impl Figures {
    fn violation(&mut self, text: String) {
        self.violations.push(text);
    }
}

fn status(decision: &BatchDecision, guard: &str) -> TraceStatus {
    decision
        .trace
        .iter()
        .find(|t| t.guard == guard)
        .and_then(|t| TraceStatus::try_from(t.status).ok())
        .unwrap_or(TraceStatus::Unspecified)
}

fn failed(status: TraceStatus) -> bool {
    matches!(status, TraceStatus::Failed | TraceStatus::TimedOut)
}

/// What guard `guard` said about call `id` of `batch`: `None` when it was
/// not sent the call (or the batch).
fn said_about<'a>(
    log: &'a HashMap<(String, String), Entry>,
    guard: &str,
    batch: &str,
    id: &str,
) -> Option<(&'a Entry, Option<&'a Verdict>)> {
    let entry = log.get(&(guard.to_owned(), batch.to_owned()))?;
    entry.calls.iter().find(|c| c.call_id == id)?;
    let verdict = match &entry.said {
        Said::Verdicts(v) => v.get(id),
        _ => None,
    };
    Some((entry, verdict))
}

fn is_proceed(entry: &Entry, verdict: Option<&Verdict>) -> bool {
    matches!(entry.said, Said::Verdicts(_)) && verdict.is_none_or(|v| v.outcome.is_none())
}

fn skip_of(verdict: Option<&Verdict>) -> Option<(String, Action)> {
    match verdict?.outcome.as_ref()? {
        verdict::Outcome::Skip(skip) => Some((
            skip.content.clone(),
            if skip.kind == 1 {
                Action::Cancel
            } else {
                Action::Steer
            },
        )),
        verdict::Outcome::Ask(ask) => Some((ask.content.clone(), Action::Ask)),
        verdict::Outcome::Rewrite(_) => None,
    }
}

fn check_call(
    figures: &mut Figures,
    log: &HashMap<(String, String), Entry>,
    decision: &BatchDecision,
    batch: &str,
    sent: &ToolCall,
    d: &CallDecision,
) {
    let id = &sent.call_id;
    let at = format!("{batch}/{id}");
    let original = d.original.clone().unwrap_or_default();
    let final_call = d.call.clone().unwrap_or_default();
    if original != *sent {
        figures.violation(format!(
            "{at}: original {original:?} is not the call sent {sent:?}"
        ));
    }
    let action = Action::try_from(d.action).unwrap_or(Action::Unspecified);
    let label = match (action, d.failure) {
        (Action::Proceed, _) if !d.bypassed.is_empty() => {
            "proceed (bypassed a fail_open guard)".to_owned()
        }
        (Action::Proceed, _) => "proceed".to_owned(),
        (Action::Steer | Action::Cancel, true) => format!("cancel: {} failed", d.decided_by),
        (Action::Steer, false) => format!("steer by {}", d.decided_by),
        (Action::Cancel, false) => format!("cancel by {}", d.decided_by),
        (Action::Unspecified, _) => "UNSPECIFIED".to_owned(),
        (Action::Ask, _) => format!("ask by {}", d.decided_by),
    };
    *figures.outcomes.entry(label.clone()).or_default() += 1;

    // Every bypass names a fail_open guard that really failed (R13).
    for name in &d.bypassed {
        if !matches!(name.as_str(), "stamp" | "open") || !failed(status(decision, name)) {
            figures.violation(format!(
                "{at}: bypassed {name:?}, which did not fail or is not fail_open"
            ));
        }
    }

    // The mutate guard: a rewrite applied is exactly the one it sent (R10,
    // R12); a failure of it is recorded as a bypass (fail_open).
    let stamp = said_about(log, "stamp", batch, id);
    if d.rewritten_by.is_empty() {
        if final_call != original {
            figures.violation(format!("{at}: changed without a rewrite: {final_call:?}"));
        }
    } else {
        let rewrite = stamp.and_then(|(_, v)| match v?.outcome.as_ref()? {
            verdict::Outcome::Rewrite(r) => r.arguments.clone(),
            verdict::Outcome::Skip(_) | verdict::Outcome::Ask(_) => None,
        });
        if d.rewritten_by != ["stamp"] || rewrite.as_deref() != Some(final_call.arguments.as_str())
        {
            figures.violation(format!(
                "{at}: rewritten by {:?} to {:?}, but stamp sent {rewrite:?}",
                d.rewritten_by, final_call.arguments
            ));
        }
    }
    if let Some((entry, _)) = stamp
        && matches!(entry.said, Said::Error | Said::Hang)
        && !d.bypassed.iter().any(|b| b == "stamp")
    {
        figures.violation(format!(
            "{at}: stamp failed ({:?}) but is not recorded as bypassed",
            entry.said
        ));
    }

    // What each validate guard received is the final call (R10), and a call
    // fixed by the mutate guard's skip reaches no validate guard (R9).
    for guard in ["flaky", "open"] {
        if let Some((entry, _)) = said_about(log, guard, batch, id) {
            let received = entry.calls.iter().find(|c| c.call_id == *id);
            if received != Some(&final_call) && d.decided_by != "stamp" {
                figures.violation(format!(
                    "{at}: {guard} judged {received:?}, not the final call {final_call:?}"
                ));
            }
            if d.decided_by == "stamp" && !d.failure {
                figures.violation(format!(
                    "{at}: skipped by the mutate guard, yet sent to {guard}"
                ));
            }
        }
    }

    let flaky = said_about(log, "flaky", batch, id);
    let flaky_proceeded = flaky.is_some_and(|(e, v)| is_proceed(e, v));
    let marked = final_call.arguments.contains("veto");
    match action {
        Action::Unspecified | Action::Ask => {
            figures.violation(format!("{at}: no guard of the soak asks, yet {action:?}"));
        }
        Action::Proceed => {
            // Never a proceed for a call a guard skipped, or past a
            // fail_closed guard that failed.
            if !flaky_proceeded || failed(status(decision, "flaky")) {
                figures.violation(format!(
                    "{at}: proceeds, but flaky said {:?} (trace {:?})",
                    flaky.map(|(e, v)| (&e.said, v)),
                    status(decision, "flaky")
                ));
            }
            if marked || failed(status(decision, "veto")) {
                figures.violation(format!(
                    "{at}: proceeds past the veto process (marked {marked}, trace {:?})",
                    status(decision, "veto")
                ));
            }
            let open = said_about(log, "open", batch, id);
            let open_proceeded =
                open.is_some_and(|(e, v)| is_proceed(e, v)) && !failed(status(decision, "open"));
            if !open_proceeded && !d.bypassed.iter().any(|b| b == "open") {
                figures.violation(format!(
                    "{at}: proceeds, but open said {:?} and is not bypassed",
                    open.map(|(e, v)| (&e.said, v))
                ));
            }
            if let Some((_, Some(v))) = stamp
                && matches!(v.outcome, Some(verdict::Outcome::Skip(_)))
                && !failed(status(decision, "stamp"))
            {
                figures.violation(format!("{at}: proceeds, but stamp skipped it"));
            }
        }
        Action::Steer | Action::Cancel if !d.failure => {
            // A skip a guard really sent, with every earlier guard having
            // let the call through (R3).
            let by = d.decided_by.as_str();
            let sent_skip = match by {
                "veto" => {
                    (marked && action == Action::Steer && d.content == VETO_CONTENT).then_some(())
                }
                "stamp" | "flaky" | "open" => said_about(log, by, batch, id)
                    .and_then(|(_, v)| skip_of(v))
                    .filter(|(content, kind)| *content == d.content && *kind == action)
                    .map(|_| ()),
                _ => None,
            };
            if sent_skip.is_none() {
                figures.violation(format!(
                    "{at}: {label} ({:?}) is not a skip {by} sent",
                    d.content
                ));
            }
            if matches!(by, "veto" | "open") && !flaky_proceeded {
                figures.violation(format!(
                    "{at}: decided by {by}, but the earlier flaky did not proceed"
                ));
            }
            if by == "open" && marked {
                figures.violation(format!(
                    "{at}: decided by open, but the earlier veto would have steered"
                ));
            }
        }
        Action::Steer | Action::Cancel => {
            // A failure under fail_closed (R13): cancel, by a fail_closed
            // guard that failed, every earlier guard having let it through.
            let by = d.decided_by.as_str();
            if action != Action::Cancel
                || !matches!(by, "flaky" | "veto")
                || !failed(status(decision, by))
            {
                figures.violation(format!(
                    "{at}: failure {label} by {by:?} (trace {:?})",
                    status(decision, by)
                ));
            }
            if by == "veto" && !flaky_proceeded {
                figures.violation(format!(
                    "{at}: veto failure, but the earlier flaky did not proceed"
                ));
            }
        }
    }
}

fn check_session(
    figures: &mut Figures,
    log: &HashMap<(String, String), Entry>,
    logged: &HashSet<&str>,
    run: &SessionRun,
) {
    figures.batches += run.sent.len();
    figures.unknown += run.unknown_answers;
    if let Some(status) = &run.stream_error {
        figures.violation(format!("stream ended with {status:?}"));
    }
    if !run.drained {
        figures.violation("a stream was not drained within 60 s".to_owned());
    }
    for (batch_id, sent) in &run.sent {
        let calls = sent.request.calls.len();
        if sent.kind == Kind::Normal {
            figures.calls += calls;
        }
        let answers = run.answers.get(batch_id).map_or(&[][..], Vec::as_slice);
        match answers.len() {
            0 => {
                figures.lost_batches += 1;
                if sent.kind == Kind::Normal {
                    figures.lost_calls += calls;
                }
                continue;
            }
            1 => figures.answered += 1,
            n => {
                figures.answered += 1;
                figures.duplicates += n - 1;
            }
        }
        let answer = &answers[0];
        match (sent.kind, &answer.result) {
            (Kind::Invalid, Some(evaluate_response::Result::Error(e))) => {
                if e.code != tonic::Code::InvalidArgument as i32 {
                    figures.violation(format!("{batch_id}: invalid batch refused with {e:?}"));
                }
                if logged.contains(batch_id.as_str()) {
                    figures.violation(format!("{batch_id}: a guard saw a refused batch"));
                }
            }
            (Kind::Empty, Some(evaluate_response::Result::Decision(d))) => {
                if !d.decisions.is_empty() || logged.contains(batch_id.as_str()) {
                    figures.violation(format!("{batch_id}: an empty batch contacted a guard (R1)"));
                }
            }
            (Kind::Normal, Some(evaluate_response::Result::Decision(d))) => {
                let ids: Vec<&str> = d.decisions.iter().map(|c| c.call_id.as_str()).collect();
                let want: Vec<&str> = sent
                    .request
                    .calls
                    .iter()
                    .map(|c| c.call_id.as_str())
                    .collect();
                if ids != want {
                    figures.violation(format!(
                        "{batch_id}: decisions {ids:?} for calls {want:?} (R2)"
                    ));
                    figures.lost_calls += want.len().saturating_sub(ids.len());
                    continue;
                }
                let guards: Vec<&str> = d.trace.iter().map(|t| t.guard.as_str()).collect();
                if guards != ["stamp", "flaky", "veto", "open"] {
                    figures.violation(format!("{batch_id}: trace {guards:?} (R21)"));
                }
                for (call, decision) in sent.request.calls.iter().zip(&d.decisions) {
                    check_call(figures, log, d, batch_id, call, decision);
                }
                let execute: Vec<&ToolCall> = d.execute.iter().collect();
                let proceeding: Vec<&ToolCall> = d
                    .decisions
                    .iter()
                    .filter(|c| c.action == Action::Proceed as i32)
                    .filter_map(|c| c.call.as_ref())
                    .collect();
                if execute != proceeding {
                    figures.violation(format!(
                        "{batch_id}: execute list differs from the proceeding calls"
                    ));
                }
            }
            // R25: a guard whose replicas are full (the flaky guard's hung
            // requests hold its limit) sheds the batch whole; busy is an
            // answer, not a decision, and never a cancel.
            (Kind::Normal, Some(evaluate_response::Result::Error(e)))
                if e.code == tonic::Code::ResourceExhausted as i32
                    && e.message.contains("batch shed") =>
            {
                figures.shed += 1;
                if !e.message.contains("is busy") {
                    figures.violation(format!("{batch_id}: shed naming no busy guard: {e:?}"));
                }
            }
            (kind, result) => {
                figures.unexpected_errors += 1;
                figures.violation(format!(
                    "{batch_id}: {kind:?} batch answered with {result:?}"
                ));
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_faulty_chain_every_batch_answered_once_and_every_decision_consistent() {
    let duration = soak_duration();
    let mut config = fast_config();
    config.link.circuit_failures = 5;
    config.link.circuit_open_for = Duration::from_millis(300);
    let mesh = TestMesh::with_config(config).await;
    let log: Log = Arc::default();
    let faults: Counts = Arc::default();
    let soak_guard = |role, p_error, p_hang| SoakGuard {
        role,
        p_error,
        p_hang,
        log: log.clone(),
        faults: faults.clone(),
    };
    let (stamp_url, _stamp) = serve_soak_guard(soak_guard(Role::Stamp, 0.05, 0.03)).await;
    let (flaky_url, _flaky) = serve_soak_guard(soak_guard(Role::Flaky, 0.08, 0.05)).await;
    let (open_url, _open) = serve_soak_guard(soak_guard(Role::Open, 0.05, 0.03)).await;
    let process = GuardProcess::start("veto-marker", 0, &[]);
    let port = process.port;
    let veto_url = process.url.clone();
    mesh.register(
        Registration::mutate("stamp", &stamp_url, ["m.*"])
            .tools(["m.*"])
            .failure_policy(FailurePolicy::FailOpen)
            .timeout(GUARD_TIMEOUT),
    )
    .await;
    for (name, url, policy, timeout) in [
        (
            "flaky",
            &flaky_url,
            FailurePolicy::FailClosed,
            GUARD_TIMEOUT,
        ),
        (
            "veto",
            &veto_url,
            FailurePolicy::FailClosed,
            Duration::from_millis(500),
        ),
        ("open", &open_url, FailurePolicy::FailOpen, GUARD_TIMEOUT),
    ] {
        mesh.register(
            Registration::validate(name, url)
                .failure_policy(policy)
                .timeout(timeout),
        )
        .await;
    }

    let started = tokio::time::Instant::now();
    let until = started + duration;
    // Kills and restarts the veto process, evenly spread over the run.
    let killer = tokio::spawn({
        let faults = faults.clone();
        async move {
            let mut process = process;
            let step = duration / u32::try_from(PROCESS_KILLS + 1).unwrap();
            for k in 1..=PROCESS_KILLS {
                tokio::time::sleep_until(started + step * u32::try_from(k).unwrap()).await;
                process.kill();
                count(&faults, "veto: process killed");
                tokio::time::sleep(Duration::from_millis(300)).await;
                process = tokio::task::spawn_blocking(move || {
                    GuardProcess::start("veto-marker", port, &[])
                })
                .await
                .unwrap();
                count(&faults, "veto: process restarted");
            }
            process
        }
    });
    let sessions: Vec<_> = (0..SESSIONS)
        .map(|s| tokio::spawn(run_session(mesh.url.clone(), s, until)))
        .collect();
    let mut runs = Vec::new();
    for session in sessions {
        runs.push(session.await.unwrap());
    }
    let _process = killer.await.unwrap();

    // After the last restart the veto process judges again.
    let coordinator = mesh.coordinator().await;
    let mut recovered = false;
    for turn in 0..200 {
        let d = coordinator
            .evaluate_once(
                "after",
                guardmesh_client::Batch::new(turn)
                    .call("c", "x.other", r#"{"note":"veto"}"#)
                    .timeout(Duration::from_secs(2)),
            )
            .await
            .unwrap();
        if d.calls[0].decided_by.as_deref() == Some("veto") && !d.calls[0].failure {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let log = log.lock().unwrap().clone();
    let logged: HashSet<&str> = log.keys().map(|(_, b)| b.as_str()).collect();
    let mut figures = Figures::default();
    for run in &runs {
        check_session(&mut figures, &log, &logged, run);
    }
    let faults = faults.lock().unwrap().clone();
    let spurious: f64 = ["stamp", "flaky", "veto", "open"]
        .iter()
        .map(|g| {
            metric(
                &mesh,
                &format!("guardmesh_guard_spurious_answers_total{{guard=\"{g}\"}}"),
            )
        })
        .sum();
    let circuits: f64 = ["stamp", "flaky", "veto", "open"]
        .iter()
        .map(|g| {
            metric(
                &mesh,
                &format!("guardmesh_guard_circuit_opened_total{{guard=\"{g}\"}}"),
            )
        })
        .sum();

    eprintln!(
        "soak: {:?}, {SESSIONS} coordinator streams, up to {IN_FLIGHT_PER_SESSION} batches in flight on each",
        duration
    );
    eprintln!("  batches sent:      {}", figures.batches);
    eprintln!(
        "  batches answered:  {} (duplicates {}, answers for unknown batches {})",
        figures.answered, figures.duplicates, figures.unknown
    );
    eprintln!("  calls (in well-formed batches): {}", figures.calls);
    eprintln!("  decisions by outcome:");
    for (outcome, n) in &figures.outcomes {
        eprintln!("    {outcome:<45} {n}");
    }
    eprintln!("  faults injected:");
    for (fault, n) in &faults {
        eprintln!("    {fault:<45} {n}");
    }
    let kinds = |k: Kind| {
        runs.iter()
            .flat_map(|r| r.sent.values())
            .filter(|s| s.kind == k)
            .count()
    };
    eprintln!(
        "    {:<45} {}",
        "coordinator: invalid batch (duplicate call_id)",
        kinds(Kind::Invalid)
    );
    eprintln!(
        "    {:<45} {}",
        "coordinator: empty batch",
        kinds(Kind::Empty)
    );
    eprintln!("  late/unknown guard answers ignored (metric): {spurious}");
    eprintln!("  circuits opened (metric): {circuits}");
    eprintln!("  unexpected batch errors: {}", figures.unexpected_errors);
    eprintln!("  normal batches shed as busy (R25): {}", figures.shed);
    eprintln!(
        "  decisions lost: {} batches, {} calls (must be 0)",
        figures.lost_batches, figures.lost_calls
    );
    eprintln!("  consistency violations: {}", figures.violations.len());
    for v in figures.violations.iter().take(20) {
        eprintln!("    {v}");
    }

    assert!(figures.batches > 0);
    // Shedding is for bursts, not the run: most batches are judged.
    assert!(
        figures.shed * 4 <= figures.batches,
        "{} of {} batches shed as busy",
        figures.shed,
        figures.batches
    );
    assert_eq!(
        figures.lost_batches + figures.lost_calls,
        0,
        "decisions lost"
    );
    assert_eq!(figures.duplicates, 0, "every batch answered exactly once");
    assert_eq!(
        figures.unknown, 0,
        "no answer for a batch that was not sent"
    );
    assert!(
        figures.violations.is_empty(),
        "{} violations, first: {:?}",
        figures.violations.len(),
        figures.violations.first()
    );
    assert!(
        recovered,
        "the veto process judges again after its last restart"
    );
    // The run did inject what it claims to.
    for fault in [
        "flaky: error answer",
        "flaky: hang past timeout",
        "flaky: skip",
        "open: error answer",
        "stamp: error answer",
    ] {
        assert!(
            faults.get(fault).copied().unwrap_or(0) > 0,
            "no {fault:?} injected: {faults:?}"
        );
    }
    assert_eq!(
        faults.get("veto: process killed").copied(),
        Some(PROCESS_KILLS)
    );
}
