//! `guardmesh replay LOG... --config FILE | --mesh URL` (R30): every batch
//! the decision log recorded as decided is judged again, by an in-process
//! mesh built from a config file or by a running mesh over gRPC, and every
//! call whose action, deciding guard or final call (the tool and arguments
//! that would run, after rewrites) differs from the record is reported.
//!
//! A log is replayed only if it verifies (`guardmesh log verify`): a log
//! with an edited, removed or reordered record is refused before anything
//! is judged, naming the record.
//!
//! Deterministic for the same records and chain: the records are read
//! whole first, batches are replayed one at a time, in log order, and only
//! actions, deciding guards and final calls are compared (never
//! latencies). Masked arguments are replayed as masked (the log holds
//! nothing else), and the report says how many records had masked values;
//! with `--config`, the new final calls are masked by the file's
//! `[decision_log] mask` before they are compared, as the recorded ones
//! were.
//!
//! Dry run (R18): a guard in mode `dry_run` never changes the enforced
//! decision, so a candidate is previewed by what it *would* have done. A
//! call that the chain lets proceed but that a dry-run guard would have
//! skipped counts as newly blocked: its new decision is action `skip`
//! (the trace says that the guard would have skipped, not whether as steer
//! or cancel) by that guard, with `dry_run: true`. Enforced decisions
//! always have `dry_run: false`.
//!
//! Against a running mesh, the replayed batches are batches like any other:
//! the mesh answers and records them (R29), under the replay's credentials
//! and batch ids `replay:<record id>`. Records with such batch ids are
//! not replayed again (so replaying the log a mesh is writing gives the
//! same report twice), and the report counts them.

use crate::app::Explain;
use guardmesh_proto::v1::{self as pb, BatchContext, EvaluateRequest, ToolCall};
use guardmesh_server::config::Config;
use guardmesh_server::decision_log::{
    Action, CallDecisionRecord, CallRecord, DecisionRecord, Entry, LogRecord, MaskRules,
    OutcomeStatus, segment,
};
use guardmesh_server::{MemoryRegistry, Mesh, Registry, TraceContext};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

/// The batch id prefix of replayed batches: the one the mesh reserves for
/// them (R20), refused from callers without the admin role.
const REPLAY_PREFIX: &str = guardmesh_server::RESERVED_BATCH_PREFIX;

#[derive(clap::Args)]
pub(crate) struct ReplayArgs {
    /// Decision log directories or files, replayed in the order given.
    #[arg(required = true)]
    logs: Vec<PathBuf>,
    /// The mesh config whose chain judges the batches again, in process
    /// (its `[[guard]]` entries; its `[decision_log]` is not opened).
    /// Without it, the running mesh at --mesh judges them.
    #[arg(long, conflicts_with = "mesh")]
    config: Option<PathBuf>,
    /// The running mesh and the credentials to reach it (--mesh,
    /// --ca-file, --cert-file/--key-file, --token-file, as `evaluate`).
    #[command(flatten)]
    mesh: crate::app::MeshArgs,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// One call's decision: its action and the guard that decided it; with
/// `dry_run`, what a dry-run guard would have decided (R18); for a call
/// that proceeds, the call that would run (after rewrites, R12).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct Decided {
    action: String,
    guard: Option<String>,
    dry_run: bool,
    call: Option<FinalCall>,
}

/// The call that would run: its tool and arguments (masked as in the log).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct FinalCall {
    tool: String,
    arguments: serde_json::Value,
}

impl FinalCall {
    /// From the wire, masked by `mask` when given.
    fn from_wire(call: &ToolCall, mask: Option<&MaskRules>) -> Self {
        let mut record = CallRecord::from_text(&call.call_id, &call.tool, &call.arguments);
        if let Some(mask) = mask {
            mask.mask_arguments(&mut record.arguments);
        }
        FinalCall {
            tool: record.tool,
            arguments: record.arguments,
        }
    }
}

/// A call whose decision differs.
#[derive(Debug, Serialize)]
struct Difference {
    seq: u64,
    record: String,
    batch_id: String,
    call_id: String,
    tool: String,
    recorded: Decided,
    new: Decided,
}

#[derive(Debug, Default, Serialize)]
struct Report {
    /// Decision records read.
    records: u64,
    /// Batches judged again (decided ones with calls).
    batches: u64,
    calls: u64,
    /// Replayed records that had masked or omitted values.
    masked_records: u64,
    /// Records of earlier replays (batch id `replay:...`), not replayed and
    /// not counted in `records`; said on stderr, so that the report of a
    /// log that earlier replays wrote to stays the same.
    #[serde(skip)]
    replay_records: u64,
    /// What judged: `config FILE` or `mesh URL`.
    judged_by: String,
    differences: Vec<Difference>,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Exit 0 when no call differs, 1 when one does, 2 when the replay could
/// not run.
pub(crate) fn main(args: ReplayArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(replay(&args)) {
        Ok(report) => {
            if report.replay_records > 0 {
                eprintln!(
                    "note: {} records of earlier replays (batch ids {REPLAY_PREFIX}...) were not replayed",
                    report.replay_records
                );
            }
            if args.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(text) => outln!("{text}"),
                    Err(error) => {
                        eprintln!("error: {error}");
                        return ExitCode::from(2);
                    }
                }
            } else {
                print_table(&report);
            }
            if report.differences.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("error: {}", guardmesh_server::error_chain(error.as_ref()));
            ExitCode::from(2)
        }
    }
}

fn print_table(report: &Report) {
    outln!(
        "replayed {} batches ({} calls) of {} decision records against {}; {} records had masked values (replayed masked)",
        report.batches,
        report.calls,
        report.records,
        report.judged_by,
        report.masked_records
    );
    if report.differences.is_empty() {
        outln!("no call's decision differs");
        return;
    }
    outln!("{} calls differ:", report.differences.len());
    outln!(
        "{:<6} {:<16} {:<12} {:<20} {:<28} new",
        "seq",
        "batch",
        "call",
        "tool",
        "recorded"
    );
    let shown = |d: &Decided, call: bool| {
        let mut text = match &d.guard {
            Some(guard) => format!("{} by {guard}", d.action),
            None => d.action.clone(),
        };
        if d.dry_run {
            text.push_str(" (dry run: would have)");
        }
        if call && let Some(final_call) = &d.call {
            let arguments = final_call.arguments.to_string();
            let mut cut: String = arguments.chars().take(60).collect();
            if cut.len() < arguments.len() {
                cut.push_str("...");
            }
            text.push_str(&format!(" as {} {cut}", final_call.tool));
        }
        text
    };
    for d in &report.differences {
        // The calls are shown when they are what differs.
        let calls = d.recorded.call != d.new.call;
        outln!(
            "{:<6} {:<16} {:<12} {:<20} {:<28} {}",
            d.seq,
            d.batch_id,
            d.call_id,
            d.tool,
            shown(&d.recorded, calls),
            shown(&d.new, calls)
        );
    }
}

/// The log files of `path`: a directory's in order, or the file itself.
fn files(path: &Path) -> Result<Vec<PathBuf>, Error> {
    if path.is_dir() {
        let files =
            segment::list(path).map_err(|e| format!("cannot list {}: {e}", path.display()))?;
        if files.is_empty() {
            return Err(format!("{}: no decision log files", path.display()).into());
        }
        Ok(files.into_iter().map(|(_, file)| file).collect())
    } else {
        Ok(vec![path.to_path_buf()])
    }
}

/// The in-process mesh the config describes: its guards registered in file
/// order, no listener, no decision log.
async fn mesh(config: &Path) -> Result<Arc<Mesh>, Error> {
    let config = Config::load(config)?;
    let (mesh_config, guards) = config.build_with_guards()?;
    let registry = Arc::new(MemoryRegistry::new(mesh_config.default_guard_timeout));
    for guard in guards {
        let name = guard.name().to_owned();
        registry
            .register(guard, None)
            .await
            .map_err(|e| format!("config guard {name:?}: {e}"))?;
    }
    Ok(Mesh::new(mesh_config, registry))
}

/// What judges the batches again.
enum Judge {
    /// An in-process mesh built from a config file, and the file's mask
    /// rules.
    Local(Arc<Mesh>, Option<MaskRules>),
    /// A running mesh, over one session stream.
    Remote(guardmesh_client::Session),
}

/// One call's new decision, by call id; `Err`: the batch was refused or
/// aborted, with the status message.
type NewDecisions = Result<Vec<(String, Decided)>, String>;

impl Judge {
    async fn connect(args: &ReplayArgs) -> Result<(Judge, String), Error> {
        if let Some(config) = &args.config {
            let mask = match Config::load(config)?.decision_log {
                Some(log) => Some(
                    MaskRules::new(&log.mask)
                        .map_err(|e| format!("[decision_log] mask: {e}"))?
                        .with_formats(
                            guardmesh_server::secret_formats::Formats::named(&log.mask_formats)
                                .map_err(|e| format!("[decision_log] mask_formats: {e}"))?,
                        ),
                ),
                None => None,
            };
            return Ok((
                Judge::Local(mesh(config).await?, mask),
                format!("config {}", config.display()),
            ));
        }
        let mesh = &args.mesh;
        let connection = mesh.connection()?;
        let coordinator =
            guardmesh_client::Coordinator::connect_with(mesh.mesh.clone(), &connection)
                .await
                .map_err(mesh.explain())?;
        let session = coordinator
            .session("replay")
            .await
            .map_err(mesh.explain())?;
        let url = mesh.mesh.clone();
        Ok((Judge::Remote(session), format!("mesh {url}")))
    }

    /// Judges `request`. `Err` only when the replay cannot go on (the mesh
    /// cannot be reached); a refusal is a new decision.
    async fn judge(
        &self,
        request: EvaluateRequest,
        args: &crate::app::MeshArgs,
    ) -> Result<NewDecisions, Error> {
        let original = |call_id: &str| {
            request
                .calls
                .iter()
                .find(|c| c.call_id == call_id)
                .cloned()
                .unwrap_or_default()
        };
        match self {
            Judge::Local(mesh, mask) => {
                let deadline = mesh.config.batch_deadline(request.timeout_ms, None);
                Ok(
                    match mesh
                        .evaluate_unrecorded(request.clone(), deadline, TraceContext::default())
                        .await
                    {
                        Ok(answer) => Ok(answer
                            .decisions
                            .iter()
                            .map(|d| {
                                let action = pb::Action::try_from(d.action)
                                    .unwrap_or(pb::Action::Unspecified);
                                let call = d.call.clone().unwrap_or_else(|| original(&d.call_id));
                                (
                                    d.call_id.clone(),
                                    decided(
                                        &d.call_id,
                                        action,
                                        &d.decided_by,
                                        &answer.trace,
                                        FinalCall::from_wire(&call, mask.as_ref()),
                                    ),
                                )
                            })
                            .collect()),
                        Err(error) => Err(error.status().message().to_owned()),
                    },
                )
            }
            Judge::Remote(session) => match session.evaluate_raw(request.clone()).await {
                Ok(answer) => Ok(Ok(answer
                    .calls
                    .iter()
                    .map(|d| {
                        let action = match d.outcome {
                            guardmesh_client::Outcome::Proceed => pb::Action::Proceed,
                            guardmesh_client::Outcome::Steer { .. } => pb::Action::Steer,
                            guardmesh_client::Outcome::Cancel { .. } => pb::Action::Cancel,
                            guardmesh_client::Outcome::Ask { .. } => pb::Action::Ask,
                        };
                        let by = d.decided_by.clone().unwrap_or_default();
                        (
                            d.call_id.clone(),
                            decided(
                                &d.call_id,
                                action,
                                &by,
                                &answer.trace,
                                FinalCall::from_wire(&d.final_call, None),
                            ),
                        )
                    })
                    .collect())),
                Err(error) => match crate::evaluate::refusal(error) {
                    Ok(status) => Ok(Err(status.message().to_owned())),
                    Err(error) => Err(args.explain()(error)),
                },
            },
        }
    }
}

/// A call's new decision from the answer: the enforced one, or, for a call
/// that proceeds, the first dry-run guard in chain order that would have
/// skipped it. `call`: the call that would run, kept for a call that
/// proceeds.
fn decided(
    call_id: &str,
    action: pb::Action,
    decided_by: &str,
    trace: &[pb::GuardTrace],
    call: FinalCall,
) -> Decided {
    let action = match action {
        pb::Action::Steer => "steer",
        pb::Action::Cancel => "cancel",
        pb::Action::Ask => "ask",
        pb::Action::Proceed => {
            let would = trace.iter().find(|t| {
                t.status == pb::TraceStatus::DryRun as i32
                    && t.skipped_call_ids.iter().any(|id| id == call_id)
            });
            if let Some(guard) = would {
                return Decided {
                    action: "skip".to_owned(),
                    guard: Some(guard.guard.clone()),
                    dry_run: true,
                    call: None,
                };
            }
            "proceed"
        }
        pb::Action::Unspecified => "unspecified",
    };
    Decided {
        action: action.to_owned(),
        guard: (!decided_by.is_empty()).then(|| decided_by.to_owned()),
        dry_run: false,
        call: (action == "proceed").then_some(call),
    }
}

async fn replay(args: &ReplayArgs) -> Result<Report, Error> {
    // Read every record first: a mesh that writes to the same log while it
    // judges the replayed batches does not make the replay longer.
    let mut records = Vec::new();
    for log in &args.logs {
        // R30: only a log that verifies is replayed.
        guardmesh_server::decision_log::verify(log).map_err(|e| {
            format!(
                "{} does not verify, so it is not replayed: {e} (see `guardmesh log verify`)",
                log.display()
            )
        })?;
        for file in files(log)? {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            for (index, line) in text.lines().enumerate() {
                let record: LogRecord = serde_json::from_str(line).map_err(|e| {
                    format!(
                        "{}:{}: not a decision log record ({e}); check the log with `guardmesh log verify`",
                        file.display(),
                        index + 1
                    )
                })?;
                records.push(record);
            }
        }
    }
    let (judge, judged_by) = Judge::connect(args).await?;
    let mut report = Report {
        judged_by,
        ..Report::default()
    };
    for record in records {
        let Entry::Decision(decision) = record.entry else {
            continue;
        };
        if decision.batch.batch_id.starts_with(REPLAY_PREFIX) {
            report.replay_records += 1;
            continue;
        }
        report.records += 1;
        if decision.outcome.status != OutcomeStatus::Decided || decision.decisions.is_empty() {
            continue;
        }
        report.batches += 1;
        report.calls += decision.decisions.len() as u64;
        if record.masked > 0 {
            report.masked_records += 1;
        }
        judge_again(
            &judge,
            &args.mesh,
            record.seq,
            &record.id,
            decision,
            &mut report,
        )
        .await?;
    }
    Ok(report)
}

fn action_name(action: Action) -> &'static str {
    match action {
        Action::Proceed => "proceed",
        Action::Steer => "steer",
        Action::Cancel => "cancel",
        Action::Ask => "ask",
    }
}

/// The recorded decision; `original`: the call as the batch sent it, the
/// one that runs when no rewrite is recorded.
fn recorded(decision: &CallDecisionRecord, original: Option<&CallRecord>) -> Decided {
    let call = decision.call.as_ref().or(original).map(|call| FinalCall {
        tool: call.tool.clone(),
        arguments: call.arguments.clone(),
    });
    Decided {
        action: action_name(decision.action).to_owned(),
        guard: decision.decided_by.clone(),
        dry_run: false,
        call: if decision.action == Action::Proceed {
            call
        } else {
            None
        },
    }
}

async fn judge_again(
    judge: &Judge,
    mesh_args: &crate::app::MeshArgs,
    seq: u64,
    id: &str,
    decision: DecisionRecord,
    report: &mut Report,
) -> Result<(), Error> {
    let batch = decision.batch;
    let request = EvaluateRequest {
        batch_id: match judge {
            Judge::Local(..) => batch.batch_id.clone(),
            Judge::Remote(_) => format!("{REPLAY_PREFIX}{id}"),
        },
        context: Some(BatchContext {
            session_id: batch.session_id,
            turn_index: batch.turn_index,
            model_text: batch.model_text.unwrap_or_default(),
            metadata: batch.metadata.into_iter().collect(),
        }),
        calls: batch
            .calls
            .iter()
            .map(|call| ToolCall {
                call_id: call.call_id.clone(),
                tool: call.tool.clone(),
                arguments: call.arguments.to_string(),
            })
            .collect(),
        timeout_ms: batch.timeout_ms.unwrap_or(0),
        ..Default::default()
    };
    let answer = judge.judge(request, mesh_args).await?;
    let tool_of = |call_id: &str| {
        batch
            .calls
            .iter()
            .find(|c| c.call_id == call_id)
            .map(|c| c.tool.clone())
            .unwrap_or_default()
    };
    for old in &decision.decisions {
        let new = match &answer {
            Ok(decisions) => match decisions
                .iter()
                .find(|(call_id, _)| *call_id == old.call_id)
            {
                Some((_, d)) => d.clone(),
                None => Decided {
                    action: "missing".to_owned(),
                    guard: None,
                    dry_run: false,
                    call: None,
                },
            },
            Err(message) => Decided {
                action: format!("error: {message}"),
                guard: None,
                dry_run: false,
                call: None,
            },
        };
        let original = batch.calls.iter().find(|c| c.call_id == old.call_id);
        let old_decided = recorded(old, original);
        if new != old_decided {
            report.differences.push(Difference {
                seq,
                record: id.to_owned(),
                batch_id: batch.batch_id.clone(),
                call_id: old.call_id.clone(),
                tool: tool_of(&old.call_id),
                recorded: old_decided,
                new,
            });
        }
    }
    Ok(())
}
