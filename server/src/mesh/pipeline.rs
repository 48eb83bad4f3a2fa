//! The one way of a batch through the mesh, whatever door it came in by.
//!
//! A batch enters by one of five doors: a coordinator stream (`Evaluate`),
//! a unary call (`EvaluateBatch`), the mesh in a gateway's process
//! ([`crate::run::InProcess`]), the interceptor invoke (one guard alone),
//! and [`Mesh::evaluate_unrecorded`] (replay and tests). A door supplies
//! only what its transport knows, as a [`Door`]: its trace context and
//! caller, the transport's deadline, the stream's gate, whether the door is
//! draining, whether its caller may replay, and which guards judge. Every
//! step after that is taken here, in this order, once:
//!
//! 1. [`Mesh::arrive`] (no await): a batch refused as read is recorded
//!    and refused; then the reserved replay prefix (R20), the session
//!    id's length (R34), draining (R25),
//!    the results taken out of the request (R33), the batch's record
//!    (R29), the stream's gate (R19, R25), the mesh's bytes in flight
//!    (R25), the batch's trace (R22) and deadline (R14).
//! 2. [`Admitted::run`]: the mesh's admission checks and judging
//!    (`mesh/evaluate.rs`: content R20, registry, R1, batches in flight,
//!    session read, the guards, session write R34), the record written
//!    before the answer leaves (R29), and the answer as calls or results
//!    (R33).
//!
//! Doors differ only in what they hand in; a check added here holds at
//! every door (`tests/doors.rs` walks them all with one table).

use super::Mesh;
use super::record::{BatchLog, LogCaller};
use crate::admit::{self, Refusal, StreamGate, StreamTicket};
use crate::judge::{BatchError, Chain, Phase, TraceContext};
use crate::validate::{self, shown_id};
use guardmesh_proto::v1::{BatchDecision, EvaluateRequest};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tonic::Status;

/// One message as a door read it: a batch within the size and count
/// limits, or one refused before it was built.
// Moved once from the door into the pipeline: not boxed (no allocation
// per batch), as `Arrival`.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Inbound {
    /// A batch within the size and count limits; `size` is its encoded size.
    Batch {
        request: EvaluateRequest,
        size: usize,
    },
    /// A batch refused before it was built.
    Refused(Refused),
}

/// A batch refused as read: the id to answer with, and why.
#[derive(Debug)]
pub(crate) struct Refused {
    /// The batch's id as shown by [`validate::shown_id`]: as sent when it is
    /// within `limits.max_id_bytes`, otherwise cut and marked.
    pub batch_id: String,
    pub refusal: validate::Refusal,
}

impl Inbound {
    /// Checks a message already decoded (a stock codec, a batch made in
    /// this process) against the limits the wire reader checks (R20).
    pub(crate) fn from_request(request: EvaluateRequest, limits: &validate::Limits) -> Self {
        use prost::Message;
        let size = request.encoded_len();
        let metadata = request.context.as_ref().map_or(0, |c| c.metadata.len());
        match validate::check_counts(
            &request.batch_id,
            size,
            // R33: results count as calls against the batch's limits.
            request.calls.len() + request.results.len(),
            metadata,
            limits,
        ) {
            Ok(()) => Self::Batch { request, size },
            Err(refusal) => Self::Refused(Refused {
                batch_id: shown_id(&request.batch_id, limits.max_id_bytes),
                refusal,
            }),
        }
    }
}

/// Which guards judge a batch.
#[derive(Debug, Clone, Default)]
pub(crate) enum Judges {
    /// The chain as it is when the batch is judged (R17); the calls that
    /// run and the results read are remembered in the session (R34).
    #[default]
    Chain,
    /// One guard of the chain alone, enforced, a call no guard applies to
    /// proceeding (the interceptor invoke): nothing runs because of it, so
    /// the session is read but never written.
    Alone(Arc<Chain>),
}

impl Judges {
    /// Whether what is judged is remembered in the session (R34).
    pub(crate) fn remembers(&self) -> bool {
        matches!(self, Self::Chain)
    }
}

/// How a batch is judged once admitted: its phase, the chain snapshot it
/// is judged against (R17), by whom, and whether it had its session's turn
/// (`busy`: why not, R34).
pub(crate) struct Pass<'a> {
    pub(crate) phase: Phase,
    pub(crate) chain: Arc<Chain>,
    pub(crate) judges: &'a Judges,
    pub(crate) busy: Option<Arc<str>>,
    /// R35: the approvals the batch named, resolved, one per call.
    pub(crate) approvals: Vec<crate::approval::Resolved>,
}

/// What a door hands the pipeline for one batch: what its transport knows.
#[derive(Debug)]
pub(crate) struct Door<'a> {
    /// The door's trace context (the stream's or the call's), with the
    /// client's key, caller and identity; a batch's own `traceparent`
    /// takes its place (R22).
    pub(crate) trace: &'a TraceContext,
    /// Who sent the batch, for the decision log; `None` writes no decision
    /// record (no log attached, or replay and tests).
    pub(crate) caller: Option<&'a LogCaller>,
    /// The transport's deadline (`grpc-timeout`), when it has one (R14).
    pub(crate) transport: Option<Duration>,
    /// A deadline set by the caller itself (replay, tests) instead of the
    /// batch's `timeout_ms` and the transport's.
    pub(crate) deadline: Option<Instant>,
    /// A unary call rather than a stream (spans name the method).
    pub(crate) unary: bool,
    /// Whether the caller may send batch ids in the prefix the mesh
    /// reserves for its replays (R20).
    pub(crate) may_replay: bool,
    /// The stream's gate (R19: ids unique in flight; R25: batches judged
    /// at once), for a batch read from a stream.
    pub(crate) gate: Option<&'a Arc<StreamGate>>,
    /// The door is draining (R25): the batch is answered UNAVAILABLE.
    pub(crate) draining: bool,
    /// Which guards judge.
    pub(crate) judges: Judges,
}

impl<'a> Door<'a> {
    /// A unary door: one batch, no gate, not draining.
    pub(crate) fn unary(trace: &'a TraceContext, caller: Option<&'a LogCaller>) -> Self {
        Self {
            trace,
            caller,
            transport: None,
            deadline: None,
            unary: true,
            may_replay: true,
            gate: None,
            draining: false,
            judges: Judges::Chain,
        }
    }

    /// A stream's door: its gate, and whether it drains.
    pub(crate) fn stream(
        trace: &'a TraceContext,
        caller: Option<&'a LogCaller>,
        gate: &'a Arc<StreamGate>,
        draining: bool,
    ) -> Self {
        Self {
            unary: false,
            gate: Some(gate),
            draining,
            ..Self::unary(trace, caller)
        }
    }
}

/// What became of a batch at its door: admitted to be judged, or refused.
/// Short-lived and moved once into the task that answers it: not boxed
/// (no allocation per batch).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Arrival {
    Admitted(Admitted),
    Refused(Refusing),
}

/// A batch refused at admission, with its record.
pub(crate) struct Refusing {
    record: BatchLog,
    /// The batch's id as shown.
    pub(crate) batch_id: String,
    refusal: Refusal,
}

impl Refusing {
    /// Whether answering it writes a decision record (and so must be
    /// awaited).
    pub(crate) fn writes(&self) -> bool {
        self.record.writes()
    }

    /// Records the refusal (R29); the status to answer with.
    pub(crate) fn status(self) -> impl std::future::Future<Output = Status> + Send + 'static {
        self.record.refuse(self.refusal)
    }
}

/// How a judged batch is answered: as calls, or as results (R33), once
/// its record (which holds the results as calls) is written.
enum AnswerPhase {
    Calls,
    Results(
        admit::result_batch::ResultBatch,
        Option<super::result_reads::ReadBy>,
    ),
}

impl AnswerPhase {
    fn of(phase: &Phase, batch: &EvaluateRequest, trace: &TraceContext, judges: &Judges) -> Self {
        match phase {
            Phase::Calls => Self::Calls,
            Phase::Results(results) => Self::Results(
                results.clone(),
                judges.remembers().then(|| super::result_reads::ReadBy {
                    session_id: batch
                        .context
                        .as_ref()
                        .map_or_else(String::new, |c| c.session_id.clone()),
                    caller: trace.caller.clone(),
                    batch_id: batch.batch_id.clone(),
                }),
            ),
        }
    }

    /// The answer; a result's decision is handed on to the mesh's hook
    /// (`mesh/result_reads.rs`) once recorded, before the answer leaves.
    async fn answer(&self, mesh: &Mesh, decision: BatchDecision) -> BatchDecision {
        match self {
            Self::Calls => decision,
            Self::Results(results, by) => {
                let decision = results.answer(decision);
                if let Some(by) = by {
                    mesh.results_read(by, &decision);
                }
                decision
            }
        }
    }
}

/// A batch admitted to be judged: everything its door admitted it with,
/// held until it is answered.
pub(crate) struct Admitted {
    batch: EvaluateRequest,
    size: usize,
    phase: Phase,
    record: BatchLog,
    answer: AnswerPhase,
    deadline: Instant,
    trace: TraceContext,
    judges: Judges,
    /// Its place on its stream, given back when it is answered.
    ticket: Option<StreamTicket>,
    /// Its bytes of the mesh's in-flight budget (R25).
    bytes: Option<OwnedSemaphorePermit>,
}

impl Admitted {
    /// The batch's encoded size.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The batch's id as sent.
    pub(crate) fn batch_id(&self) -> &str {
        &self.batch.batch_id
    }

    /// Judges the batch, writes its record (R29: before the answer
    /// leaves), and gives the answer or the status to answer with.
    pub(crate) async fn run(self, mesh: &Mesh) -> Result<BatchDecision, Status> {
        let (outcome, record, answer, turn) = self.judge(mesh).await;
        let decision = record.finish(outcome).await?;
        let decision = answer.answer(mesh, decision).await;
        // R34: the session's next batch reads the memory this one wrote.
        drop(turn);
        Ok(decision)
    }

    /// [`Self::run`] for a door that writes no decision record (replay and
    /// tests): the error as the judge typed it.
    async fn run_unrecorded(self, mesh: &Mesh) -> Result<BatchDecision, BatchError> {
        let (outcome, record, answer, turn) = self.judge(mesh).await;
        let decision = record.emit(outcome)?;
        let decision = answer.answer(mesh, decision).await;
        drop(turn);
        Ok(decision)
    }

    async fn judge(
        self,
        mesh: &Mesh,
    ) -> (
        super::record::Outcome,
        BatchLog,
        AnswerPhase,
        Vec<super::session_turns::Turn>,
    ) {
        // Taken apart before the first await: the judging future holds
        // each part once, not the whole batch beside its parts.
        let Self {
            mut batch,
            phase,
            record,
            answer,
            deadline,
            trace,
            judges,
            ticket,
            bytes,
            size: _,
        } = self;
        // R17: one snapshot of the chain for the whole batch, the session
        // turn's check included.
        let chain = match &judges {
            Judges::Chain => mesh.chain(),
            Judges::Alone(chain) => chain.clone(),
        };
        let (turn, busy) = match session_turn(mesh, &chain, &batch, &trace, deadline).await {
            Ok(turn) => (turn, None),
            Err(why) => (Vec::new(), Some(why)),
        };
        // R35: the approvals the batch names, checked against its session
        // and this chain snapshot before judging; a name of no call of the
        // batch refuses it.
        let named = std::mem::take(&mut batch.approvals);
        // Who asks, in which session: the key is made only when a request
        // is made or used (most batches do neither).
        let asked_by = trace.identity.clone();
        let session_id = batch
            .context
            .as_ref()
            .map_or_else(String::new, |c| c.session_id.clone());
        let approvals = if named.is_empty() {
            Vec::new()
        } else {
            let key = Mesh::session_key(&batch, &trace);
            let ids: Vec<&str> = batch.calls.iter().map(|c| c.call_id.as_str()).collect();
            if let Err(refusal) = crate::approval::check_map(&named, &ids) {
                drop(bytes);
                drop(ticket);
                return (
                    super::record::Outcome::refused(refusal),
                    record,
                    answer,
                    turn,
                );
            }
            crate::approval::resolve(
                mesh.sessions(),
                &mesh.approvals,
                &key,
                &named,
                &ids,
                chain.revision,
                deadline,
            )
            .await
        };
        let remembers = judges.remembers();
        let mut outcome = mesh
            .pass_phase(
                batch,
                deadline,
                trace,
                Pass {
                    phase,
                    chain,
                    judges: &judges,
                    busy,
                    approvals,
                },
            )
            .await;
        // R35: uses recorded and asks made before the record and the
        // answer. An interceptor's invoke (one guard alone) runs nothing,
        // so it makes no request and uses no approval.
        if let Ok(decision) = &mut outcome.result
            && remembers
            && crate::approval::settles(decision)
        {
            let key = crate::session::SessionKey::new(asked_by.as_ref(), session_id.as_str());
            crate::approval::settle(
                mesh.sessions(),
                &mesh.approvals,
                &key,
                &asked_by,
                decision,
                deadline,
            )
            .await;
        }
        drop(bytes);
        drop(ticket);
        (outcome, record, answer, turn)
    }
}

/// The session's turn (R34), when the chain uses session memory (a policy
/// rule reads `session`, or a remote guard asked for the memory): held from
/// before the memory is read until the answer is ready. `Err` with why the
/// memory is not read when the turn did not come before the batch's
/// deadline. A chain that uses no memory is not serialized: its batches
/// stay concurrent (R19, R25).
async fn session_turn(
    mesh: &Mesh,
    chain: &Chain,
    batch: &EvaluateRequest,
    trace: &TraceContext,
    deadline: Instant,
) -> Result<Vec<super::session_turns::Turn>, Arc<str>> {
    let mut turns = Vec::new();
    if !Mesh::chain_uses_session(chain) {
        return Ok(turns);
    }
    // R34: the identity's turn first, then the session's (one order, so no
    // two batches wait on each other): the batches of one identity are
    // judged one after another when a rule reads its memory, whatever
    // their sessions.
    if Mesh::chain_reads_identity(chain) {
        let key = crate::session::SessionKey::identity(trace.identity.as_ref());
        match mesh.session_turns.take(key, deadline).await {
            Ok(turn) => turns.push(turn),
            Err(super::session_turns::Busy) => {
                return Err(Arc::from(
                    "another batch of this identity was still being judged at this batch's \
                     deadline",
                ));
            }
        }
    }
    let key = Mesh::session_key(batch, trace);
    match mesh.session_turns.take(key, deadline).await {
        Ok(turn) => {
            turns.push(turn);
            Ok(turns)
        }
        Err(super::session_turns::Busy) => Err(Arc::from(
            "another batch of this session was still being judged at this batch's deadline",
        )),
    }
}

/// The batch's own trace context when it carries one, else the door's.
fn batch_trace(batch: &EvaluateRequest, door: &TraceContext) -> TraceContext {
    if batch.traceparent.is_empty() {
        return door.clone();
    }
    let mut own = TraceContext::from_w3c(&batch.traceparent, &batch.tracestate);
    if own.trace_id.is_empty() {
        return door.clone();
    }
    own.client = door.client;
    own.caller = door.caller.clone();
    own.identity = door.identity.clone();
    own
}

impl Mesh {
    /// A batch at its door: admitted with everything it holds while it is
    /// judged, or refused with its record. Takes no await, so a stream
    /// admits its batches in the order it reads them.
    pub(crate) fn arrive(&self, inbound: Inbound, door: Door<'_>) -> Arrival {
        let limits = &self.config.limits;
        let refuse = |record, batch_id, refusal| {
            Arrival::Refused(Refusing {
                record,
                batch_id,
                refusal,
            })
        };
        let (mut batch, size) = match inbound {
            Inbound::Batch { request, size } => (request, size),
            Inbound::Refused(refused) => {
                let record = BatchLog::arrived(self, door.caller, None, refused.batch_id.clone());
                return refuse(record, refused.batch_id, refused.refusal.into());
            }
        };
        let shown = shown_id(&batch.batch_id, limits.max_id_bytes);
        // R20: the replay prefix, from a caller that may not replay.
        if !door.may_replay
            && let Err(refusal) = validate::check_reserved(&batch.batch_id)
        {
            let record = BatchLog::arrived(self, door.caller, None, shown.clone());
            return refuse(record, shown, refusal.into());
        }
        // R34: a session id over the id limit is refused before anything
        // (the record, session memory) holds it.
        if let Err(refusal) = validate::check_session_id(&batch, limits) {
            let record = BatchLog::arrived(self, door.caller, None, shown.clone());
            return refuse(record, shown, refusal.into());
        }
        if door.draining {
            let record = BatchLog::arrived(self, door.caller, Some(&batch), shown.clone());
            return refuse(record, shown, Refusal::ShuttingDown);
        }
        // R33: results are judged as calls; taken before the record is made.
        let results = admit::result_batch::take(&mut batch, limits);
        let record = BatchLog::arrived(self, door.caller, Some(&batch), shown.clone());
        let phase = match results {
            Ok(None) => Phase::Calls,
            Ok(Some(results)) => Phase::Results(results),
            Err(refusal) => return refuse(record, shown, refusal.into()),
        };
        let ticket = match door
            .gate
            .map(|gate| StreamGate::enter(gate, &batch, &shown))
        {
            None => None,
            Some(Ok(ticket)) => Some(ticket),
            Some(Err(refusal)) => return refuse(record, shown, refusal),
        };
        let bytes = match admit::inflight_bytes(&self.inflight_bytes, limits, &batch, size) {
            Ok(bytes) => bytes,
            Err(refusal) => return refuse(record, shown, refusal),
        };
        let mut trace = batch_trace(&batch, door.trace);
        trace.unary = door.unary;
        let deadline = door
            .deadline
            .unwrap_or_else(|| self.config.batch_deadline(batch.timeout_ms, door.transport));
        let answer = AnswerPhase::of(&phase, &batch, &trace, &door.judges);
        Arrival::Admitted(Admitted {
            batch,
            size,
            phase,
            record,
            answer,
            deadline,
            trace,
            judges: door.judges,
            ticket,
            bytes,
        })
    }

    /// Judges one batch through the one pipeline as a unary call would be,
    /// writing no decision record: for replay (R30) and tests. `deadline`
    /// is the batch's deadline (R14). The batch's metrics, logs and spans
    /// are emitted.
    pub async fn evaluate_unrecorded(
        &self,
        request: EvaluateRequest,
        deadline: Instant,
        trace: TraceContext,
    ) -> Result<BatchDecision, BatchError> {
        let inbound = Inbound::from_request(request, &self.config.limits);
        let mut door = Door::unary(&trace, None);
        door.deadline = Some(deadline);
        door.unary = trace.unary;
        match self.arrive(inbound, door) {
            Arrival::Admitted(admitted) => admitted.run_unrecorded(self).await,
            Arrival::Refused(refused) => {
                let Refusing {
                    record, refusal, ..
                } = refused;
                record.emit(super::record::Outcome::refused(refusal))
            }
        }
    }
}
