//! `guardmesh log show` and `guardmesh log tail`: the decisions of a
//! decision log (R29), one line each, filtered, as text or JSON, and on
//! as the log grows (`--follow`).
//!
//! The log is read with the reader `guardmesh log verify` uses
//! ([`LogReader`]): every line is checked as it is read, so what is printed
//! has verified, and a record that breaks the chain stops the command with
//! the record named (exit 1). `--no-verify` reads without the checks.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, ValueEnum};
use globset::{GlobBuilder, GlobMatcher};
use guardmesh_server::decision_log::{
    self, DecisionRecord, Entry, LogReader, LogRecord, OutcomeStatus, ReadLine, VerifyError,
    VerifyOptions, checkpoint,
};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// What to read and which decisions to print.
#[derive(Args, Debug)]
pub(crate) struct ShowArgs {
    /// The decision log's directory (its rotated files are read in order),
    /// or one of its files.
    path: PathBuf,
    /// The writer's public key (PEM): its signed checkpoints are checked
    /// as well as the hash chain.
    #[arg(long, conflicts_with = "no_verify")]
    key: Option<PathBuf>,
    /// Reads without checking the chain: what is printed is not vouched
    /// for (a log being repaired, a file cut from its log).
    #[arg(long)]
    no_verify: bool,
    /// Accepts gap records (a restart on a shortened log) instead of
    /// failing on them.
    #[arg(long)]
    allow_gap: bool,
    /// Only decisions recorded at or after TIME: RFC 3339
    /// (`2026-12-06T10:00:00Z`) or an age (`30s`, `15m`, `2h`, `7d`).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    since: Option<OffsetDateTime>,
    /// Only decisions recorded before TIME (as --since).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    until: Option<OffsetDateTime>,
    /// Only the batch with this id.
    #[arg(long)]
    batch: Option<String>,
    /// Only batches of this session.
    #[arg(long)]
    session: Option<String>,
    /// Only calls whose tool matches this glob (`shell.*`), letters in
    /// either ASCII case, as guards' tool patterns match.
    #[arg(long, value_name = "GLOB", value_parser = parse_glob)]
    tool: Option<GlobMatcher>,
    /// Only calls this guard decided, rewrote or bypassed.
    #[arg(long)]
    guard: Option<String>,
    /// Only calls decided by this policy rule (R27).
    #[arg(long)]
    rule: Option<String>,
    /// Only decisions with this action (refused and aborted: batches
    /// answered without decisions).
    #[arg(long, value_enum)]
    action: Option<ShownAction>,
    /// Only skips caused by a guard's failure (R13).
    #[arg(long)]
    failure: bool,
    /// Only batches sent by this caller (its authenticated id).
    #[arg(long)]
    caller: Option<String>,
    /// Prints a JSON array of decisions.
    #[arg(long, conflicts_with_all = ["jsonl", "follow"])]
    json: bool,
    /// Prints one JSON object per decision, one per line.
    #[arg(long)]
    jsonl: bool,
    /// Keeps reading as the log grows and rotates, until interrupted.
    #[arg(long, short = 'f')]
    follow: bool,
    /// How often --follow looks for new records, in milliseconds.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    poll_ms: u64,
}

/// `--action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ShownAction {
    Proceed,
    Steer,
    Cancel,
    Ask,
    Refused,
    Aborted,
}

impl ShownAction {
    fn name(self) -> &'static str {
        match self {
            ShownAction::Proceed => "proceed",
            ShownAction::Steer => "steer",
            ShownAction::Cancel => "cancel",
            ShownAction::Ask => "ask",
            ShownAction::Refused => "refused",
            ShownAction::Aborted => "aborted",
        }
    }
}

/// One decision as printed: a call's decision, or a batch answered
/// without decisions (refused, aborted).
struct Shown<'a> {
    record: &'a LogRecord,
    decision: &'a DecisionRecord,
    action: ShownAction,
    call_id: Option<&'a str>,
    tool: Option<&'a str>,
    arguments: Option<&'a Value>,
    decided_by: Option<&'a str>,
    rule: Option<&'a str>,
    failure: bool,
    content: Option<&'a str>,
    rewritten_by: &'a [String],
    bypassed: &'a [String],
    time: Option<OffsetDateTime>,
}

/// The decisions of one record, in batch order.
fn decisions(record: &LogRecord) -> Vec<Shown<'_>> {
    let Entry::Decision(decision) = &record.entry else {
        return Vec::new();
    };
    let time = OffsetDateTime::parse(&record.time, &Rfc3339).ok();
    let batch_action = match decision.outcome.status {
        OutcomeStatus::Refused => Some(ShownAction::Refused),
        OutcomeStatus::Aborted => Some(ShownAction::Aborted),
        OutcomeStatus::Decided => None,
    };
    if decision.decisions.is_empty() {
        let action = batch_action.unwrap_or(ShownAction::Proceed);
        // A batch with no decision: one line, or none for a decided
        // batch of no calls (R1).
        if batch_action.is_none() {
            return Vec::new();
        }
        return vec![Shown {
            record,
            decision,
            action,
            call_id: None,
            tool: None,
            arguments: None,
            decided_by: None,
            rule: None,
            failure: false,
            content: decision.outcome.message.as_deref(),
            rewritten_by: &[],
            bypassed: &[],
            time,
        }];
    }
    decision
        .decisions
        .iter()
        .map(|d| {
            let sent = decision.batch.calls.iter().find(|c| c.call_id == d.call_id);
            // The call as it ran when rewritten, else as it was sent.
            let call = d.call.as_ref().or(sent);
            Shown {
                record,
                decision,
                action: batch_action.unwrap_or(match d.action {
                    decision_log::Action::Proceed => ShownAction::Proceed,
                    decision_log::Action::Steer => ShownAction::Steer,
                    decision_log::Action::Cancel => ShownAction::Cancel,
                    decision_log::Action::Ask => ShownAction::Ask,
                }),
                call_id: Some(&d.call_id),
                tool: call.map(|c| c.tool.as_str()),
                arguments: call.map(|c| &c.arguments),
                decided_by: d.decided_by.as_deref(),
                rule: d.rule.as_deref(),
                failure: d.failure,
                content: d.content.as_deref(),
                rewritten_by: &d.rewritten_by,
                bypassed: &d.bypassed,
                time,
            }
        })
        .collect()
}

impl ShowArgs {
    fn keeps(&self, shown: &Shown<'_>) -> bool {
        let batch = &shown.decision.batch;
        let same = |wanted: &Option<String>, value: Option<&str>| {
            wanted.as_deref().is_none_or(|wanted| value == Some(wanted))
        };
        // A record whose time does not read is kept only without bounds.
        let time_ok = match shown.time {
            Some(time) => {
                self.since.is_none_or(|since| time >= since)
                    && self.until.is_none_or(|until| time < until)
            }
            None => self.since.is_none() && self.until.is_none(),
        };
        let tool_ok = self.tool.as_ref().is_none_or(|glob| match shown.tool {
            Some(tool) => glob.is_match(tool),
            // A batch refused whole: any of its calls.
            None => batch.calls.iter().any(|c| glob.is_match(&c.tool)),
        });
        let guard_ok = self.guard.as_deref().is_none_or(|guard| {
            shown.decided_by == Some(guard)
                || shown.rewritten_by.iter().any(|g| g == guard)
                || shown.bypassed.iter().any(|g| g == guard)
        });
        time_ok
            && tool_ok
            && guard_ok
            && same(&self.batch, Some(&batch.batch_id))
            && same(&self.session, Some(&batch.session_id))
            && same(&self.rule, shown.rule)
            && same(&self.caller, shown.decision.caller.id.as_deref())
            && self.action.is_none_or(|action| action == shown.action)
            && (!self.failure || shown.failure)
    }
}

/// One decision as a JSON object (`--json`, `--jsonl`).
fn to_json(shown: &Shown<'_>) -> Value {
    let batch = &shown.decision.batch;
    json!({
        "seq": shown.record.seq,
        "time": shown.record.time,
        "mesh": shown.record.mesh,
        "batch_id": batch.batch_id,
        "session_id": batch.session_id,
        "turn_index": batch.turn_index,
        "caller": shown.decision.caller.id,
        "call_id": shown.call_id,
        "tool": shown.tool,
        "arguments": shown.arguments,
        "action": shown.action.name(),
        "decided_by": shown.decided_by,
        "rule": shown.rule,
        "failure": shown.failure,
        "content": shown.content,
        "rewritten_by": shown.rewritten_by,
        "bypassed": shown.bypassed,
    })
}

/// A value for a text line: as it is when it is one plain word, else
/// quoted with every control character escaped, so that a record cannot
/// forge a line or drive the terminal.
fn word(text: &str) -> String {
    if !text.is_empty()
        && text
            .chars()
            .all(|c| !c.is_control() && !c.is_whitespace() && c != '"' && c != '\\')
    {
        text.to_owned()
    } else {
        format!("{text:?}")
    }
}

/// One decision as one line of text.
fn to_line(shown: &Shown<'_>) -> String {
    let batch = &shown.decision.batch;
    let mut line = format!(
        "{} {:>6} {:<8} {}",
        word(&shown.record.time),
        shown.record.seq,
        shown.action.name(),
        shown.tool.map_or_else(|| "-".to_owned(), word),
    );
    if let Some(call_id) = shown.call_id {
        line.push_str(&format!(" call={}", word(call_id)));
    }
    line.push_str(&format!(
        " batch={} session={}",
        word(&batch.batch_id),
        word(&batch.session_id)
    ));
    if let Some(by) = shown.decided_by {
        line.push_str(&format!(" by={}", word(by)));
    }
    if let Some(rule) = shown.rule {
        line.push_str(&format!(" rule={}", word(rule)));
    }
    if shown.failure {
        line.push_str(" failure");
    }
    if !shown.rewritten_by.is_empty() {
        let names: Vec<String> = shown.rewritten_by.iter().map(|g| word(g)).collect();
        line.push_str(&format!(" rewritten_by={}", names.join(",")));
    }
    if !shown.bypassed.is_empty() {
        let names: Vec<String> = shown.bypassed.iter().map(|g| word(g)).collect();
        line.push_str(&format!(" bypassed={}", names.join(",")));
    }
    if let Some(caller) = &shown.decision.caller.id {
        line.push_str(&format!(" caller={}", word(caller)));
    }
    if let Some(content) = shown.content {
        line.push_str(&format!(" content={content:?}"));
    }
    line
}

/// Why the command stopped.
enum Stop {
    /// The log does not verify (exit 1).
    Bad(VerifyError),
    /// It cannot run (exit 2).
    Usage(String),
}

impl From<VerifyError> for Stop {
    fn from(error: VerifyError) -> Self {
        match error {
            VerifyError::Io { .. } | VerifyError::Anchor(_) | VerifyError::Empty(_) => {
                Stop::Usage(error.to_string())
            }
            other => Stop::Bad(other),
        }
    }
}

/// Runs `log show` (`last: None`) or `log tail` (the last `last`
/// decisions): 0 when the log read verifies, 1 when it does not, 2 when
/// the command cannot run.
pub(crate) fn run(args: &ShowArgs, last: Option<usize>) -> ExitCode {
    match show(args, last) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Stop::Bad(error)) => {
            eprintln!("error: decision log does not verify: {error}");
            ExitCode::FAILURE
        }
        Err(Stop::Usage(error)) => {
            eprintln!("error: {error}");
            ExitCode::from(2)
        }
    }
}

fn show(args: &ShowArgs, last: Option<usize>) -> Result<(), Stop> {
    let options = if args.no_verify {
        None
    } else {
        let key = args
            .key
            .as_deref()
            .map(checkpoint::read_verifying_key)
            .transpose()
            .map_err(|error| Stop::Usage(error.to_string()))?;
        Some(VerifyOptions {
            key,
            allow_gap: args.allow_gap,
            ..VerifyOptions::default()
        })
    };
    let mut reader = LogReader::open(&args.path, options.as_ref())?;
    if !reader.verifies() {
        eprintln!("warning: --no-verify: the records shown are not checked against the chain");
    }
    let mut printer = Printer {
        args,
        kept: VecDeque::new(),
        last,
        first_json: true,
    };
    if args.json {
        out!("[");
    }
    reader.read(|line| printer.line(&line))?;
    printer.flush();
    if args.follow {
        return follow(reader, &mut printer);
    }
    if args.json {
        outln!("{}]", if printer.first_json { "" } else { "\n" });
    }
    // The whole log was read: the rules about it as a whole (a cut end, a
    // line left incomplete, no checkpoint with --key).
    reader.finish()?;
    Ok(())
}

/// Reads on as the log grows, until stdout's reader goes.
fn follow(mut reader: LogReader, printer: &mut Printer<'_>) -> Result<(), Stop> {
    let poll = Duration::from_millis(printer.args.poll_ms);
    while !crate::out::gone() {
        std::thread::sleep(poll);
        reader.read(|line| printer.line(&line))?;
    }
    Ok(())
}

/// Prints the decisions kept, as they are read (or the last ones, for
/// `tail`).
struct Printer<'a> {
    args: &'a ShowArgs,
    /// For `tail`: the last decisions kept, printed at the end of the
    /// first read.
    kept: VecDeque<String>,
    last: Option<usize>,
    first_json: bool,
}

impl Printer<'_> {
    fn line(&mut self, line: &ReadLine<'_>) -> Result<(), Stop> {
        if line.kind != "decision" {
            return Ok(());
        }
        let record: LogRecord = serde_json::from_slice(line.bytes).map_err(|error| {
            Stop::Bad(VerifyError::Bad(decision_log::BadRecord {
                file: line.file.to_path_buf(),
                line: line.line,
                seq: Some(line.seq),
                id: None,
                reason: format!("not a decision record of this format: {error}"),
            }))
        })?;
        for shown in decisions(&record) {
            if !self.args.keeps(&shown) {
                continue;
            }
            let text = if self.args.json || self.args.jsonl {
                to_json(&shown).to_string()
            } else {
                to_line(&shown)
            };
            match self.last {
                Some(n) => {
                    if n > 0 {
                        if self.kept.len() == n {
                            self.kept.pop_front();
                        }
                        self.kept.push_back(text);
                    }
                }
                None => self.print(&text),
            }
        }
        Ok(())
    }

    fn print(&mut self, text: &str) {
        if self.args.json {
            out!("{}\n  {text}", if self.first_json { "" } else { "," });
            self.first_json = false;
        } else {
            outln!("{text}");
        }
    }

    /// Prints what `tail` kept; from then on, decisions are printed as
    /// they are read.
    fn flush(&mut self) {
        let kept = std::mem::take(&mut self.kept);
        for text in &kept {
            self.print(text);
        }
        self.last = None;
    }
}

/// `--since` and `--until`: RFC 3339, or an age before now.
fn parse_time(text: &str) -> Result<OffsetDateTime, String> {
    if let Ok(time) = OffsetDateTime::parse(text, &Rfc3339) {
        return Ok(time);
    }
    let age = parse_age(text).ok_or_else(|| {
        format!(
            "{text:?} is neither an RFC 3339 time (2026-12-06T10:00:00Z) nor an age (30s, 15m, 2h, 7d)"
        )
    })?;
    OffsetDateTime::now_utc()
        .checked_sub(age)
        .ok_or_else(|| format!("{text:?} is before any time this can read"))
}

fn parse_age(text: &str) -> Option<time::Duration> {
    let unit = text.chars().last()?;
    let number: i64 = text[..text.len() - unit.len_utf8()].parse().ok()?;
    if number < 0 {
        return None;
    }
    let seconds = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        _ => return None,
    };
    number.checked_mul(seconds).map(time::Duration::seconds)
}

/// `--tool`: a glob in either ASCII case.
fn parse_glob(text: &str) -> Result<GlobMatcher, String> {
    GlobBuilder::new(text)
        .case_insensitive(true)
        .literal_separator(false)
        .build()
        .map(|glob| glob.compile_matcher())
        .map_err(|error| format!("not a glob: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_and_times_read() {
        assert!(parse_time("2026-12-06T10:00:00Z").is_ok());
        for age in ["30s", "15m", "2h", "7d", "0s"] {
            assert!(parse_time(age).is_ok(), "{age}");
        }
        for bad in ["", "m", "-5m", "5w", "yesterday", "99999999999999999d"] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_value_cannot_forge_a_line_or_drive_the_terminal() {
        assert_eq!(word("shell.exec"), "shell.exec");
        assert_eq!(word("a\nb"), "\"a\\nb\"");
        assert_eq!(word("\u{1b}[2J"), "\"\\u{1b}[2J\"");
        assert_eq!(word("a b"), "\"a b\"");
        assert_eq!(word(""), "\"\"");
    }

    #[test]
    fn tool_globs_ignore_ascii_case() {
        let glob = parse_glob("email.*").unwrap();
        assert!(glob.is_match("Email.Send"));
        assert!(!glob.is_match("sms.send"));
        assert!(parse_glob("a[").is_err());
    }
}
