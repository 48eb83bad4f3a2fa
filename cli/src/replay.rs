//! `guardmesh replay LOG... --config FILE` (R30): every batch the decision
//! log recorded as decided is judged again by an in-process mesh built from
//! the config file, and every call whose action or deciding guard differs
//! from the record is reported.
//!
//! Deterministic for the same records and chain: batches are replayed one
//! at a time, in log order, and only actions and deciding guards are
//! compared (never latencies). Masked arguments are replayed as masked
//! (the log holds nothing else), and the report says how many records had
//! masked values.

use guardmesh_proto::v1::{self as pb, BatchContext, EvaluateRequest, ToolCall};
use guardmesh_server::config::Config;
use guardmesh_server::decision_log::{
    Action, CallDecisionRecord, DecisionRecord, Entry, LogRecord, OutcomeStatus, segment,
};
use guardmesh_server::{MemoryRegistry, Mesh, Registry, TraceContext};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(clap::Args)]
pub(crate) struct ReplayArgs {
    /// Decision log directories or files, replayed in the order given.
    #[arg(required = true)]
    logs: Vec<PathBuf>,
    /// The mesh config whose chain judges the batches again (its
    /// `[[guard]]` entries; its `[decision_log]` is not opened).
    #[arg(long)]
    config: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// One call's decision: its action and the guard that decided it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct Decided {
    action: String,
    guard: Option<String>,
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
            if args.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(text) => println!("{text}"),
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
    println!(
        "replayed {} batches ({} calls) of {} decision records; {} records had masked values (replayed masked)",
        report.batches, report.calls, report.records, report.masked_records
    );
    if report.differences.is_empty() {
        println!("no call's decision differs");
        return;
    }
    println!("{} calls differ:", report.differences.len());
    println!(
        "{:<6} {:<16} {:<12} {:<20} {:<28} new",
        "seq", "batch", "call", "tool", "recorded"
    );
    let shown = |d: &Decided| match &d.guard {
        Some(guard) => format!("{} by {guard}", d.action),
        None => d.action.clone(),
    };
    for d in &report.differences {
        println!(
            "{:<6} {:<16} {:<12} {:<20} {:<28} {}",
            d.seq,
            d.batch_id,
            d.call_id,
            d.tool,
            shown(&d.recorded),
            shown(&d.new)
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
    let mesh_config = config.build()?;
    let registry = Arc::new(MemoryRegistry::new(mesh_config.default_guard_timeout));
    for guard in &config.guards {
        registry
            .register(guard.to_spec())
            .await
            .map_err(|e| format!("config guard {:?}: {e}", guard.name))?;
    }
    Ok(Mesh::new(mesh_config, registry))
}

async fn replay(args: &ReplayArgs) -> Result<Report, Error> {
    let mesh = mesh(&args.config).await?;
    let mut report = Report::default();
    for log in &args.logs {
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
                let Entry::Decision(decision) = record.entry else {
                    continue;
                };
                report.records += 1;
                if decision.outcome.status != OutcomeStatus::Decided
                    || decision.decisions.is_empty()
                {
                    continue;
                }
                report.batches += 1;
                report.calls += decision.decisions.len() as u64;
                if record.masked > 0 {
                    report.masked_records += 1;
                }
                judge_again(&mesh, record.seq, &record.id, decision, &mut report).await;
            }
        }
    }
    Ok(report)
}

fn action_name(action: Action) -> &'static str {
    match action {
        Action::Proceed => "proceed",
        Action::Steer => "steer",
        Action::Cancel => "cancel",
    }
}

fn recorded(decision: &CallDecisionRecord) -> Decided {
    Decided {
        action: action_name(decision.action).to_owned(),
        guard: decision.decided_by.clone(),
    }
}

async fn judge_again(
    mesh: &Mesh,
    seq: u64,
    id: &str,
    decision: DecisionRecord,
    report: &mut Report,
) {
    let batch = decision.batch;
    let request = EvaluateRequest {
        batch_id: batch.batch_id.clone(),
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
    let timeout = batch
        .timeout_ms
        .map_or(mesh.config.default_batch_timeout, |ms| {
            std::time::Duration::from_millis(u64::from(ms))
        })
        .min(mesh.config.max_batch_timeout);
    let deadline = tokio::time::Instant::now() + timeout;
    let answer = mesh
        .evaluate(request, deadline, TraceContext::default())
        .await;
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
            Ok(answer) => match answer.decisions.iter().find(|d| d.call_id == old.call_id) {
                Some(d) => Decided {
                    action: match pb::Action::try_from(d.action) {
                        Ok(pb::Action::Steer) => "steer",
                        Ok(pb::Action::Cancel) => "cancel",
                        _ => "proceed",
                    }
                    .to_owned(),
                    guard: (!d.decided_by.is_empty()).then(|| d.decided_by.clone()),
                },
                None => Decided {
                    action: "missing".to_owned(),
                    guard: None,
                },
            },
            Err(error) => Decided {
                action: format!("error: {}", error.status().message()),
                guard: None,
            },
        };
        let old_decided = recorded(old);
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
}
