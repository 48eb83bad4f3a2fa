//! What happened at one guard of a batch ([`GuardRun`]), and how it is
//! shown: the guard's trace entry (R18, R21), the error it reports, and
//! the names its spans carry.

use super::verdicts::Malformed;
use crate::link::GuardFailure;
use crate::observe::spans::{SpanFailure, SpanGuard};
use crate::registry::spec::Guard;
use guardmesh_proto::v1::{GuardTrace, SkipKind, TraceStatus};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What happened at one guard, collected into its trace entry and, by the
/// batch's record, into metrics, logs and spans.
pub(crate) struct GuardRun {
    pub(crate) sent: Vec<bool>,
    pub(crate) sent_any: bool,
    pub(super) request_id: Option<u64>,
    /// R32: the replica that answered (or failed) the request last.
    pub(crate) replica: Option<Arc<str>>,
    pub(super) started: Option<Instant>,
    pub(super) finished: Option<Instant>,
    pub(crate) skipped: Vec<usize>,
    pub(crate) rewritten: Vec<usize>,
    pub(crate) malformed: Vec<Malformed>,
    pub(crate) failure: Option<GuardFailure>,
    pub(super) superseded: bool,
    pub(super) answered: Vec<bool>,
    /// The kinds (`SkipKind`) of `skipped`, in the same order.
    pub(super) skip_kinds: Vec<i32>,
    /// The guard's `apply_guardrail` span, and a remote guard's client span
    /// under it, while the guard is consulted.
    pub(crate) guardrail: Option<tracing::Span>,
    pub(crate) span: Option<tracing::Span>,
    /// For a policy guard (R27): the rule that decided (or failed on) each
    /// call, by call index.
    pub(super) rules: Vec<(usize, String)>,
    /// Session labels its verdicts (or its policy rules) add (R34), at
    /// most [`MAX_LABELS_PER_GUARD`]; applied only when the guard enforces
    /// and did not fail.
    pub(crate) labels: Vec<String>,
    /// Labels refused: outside the grammar or past a bound.
    pub(crate) refused_labels: usize,
    /// R35: the calls among `skipped` it asked about, with its reasons.
    pub(crate) asked: Vec<(usize, String)>,
    /// R35: the calls it was not sent because an approval of its earlier
    /// ask stood in for it.
    pub(crate) approved: Vec<usize>,
}

/// Labels one guard may add to a session in one batch (R34).
pub(crate) const MAX_LABELS_PER_GUARD: usize = 64;

impl GuardRun {
    /// A guard not sent anything yet: it allocates nothing until
    /// [`Self::send`] (an empty `sent` reads as no call sent).
    pub(super) fn new() -> Self {
        Self {
            sent: Vec::new(),
            sent_any: false,
            request_id: None,
            replica: None,
            started: None,
            finished: None,
            skipped: Vec::new(),
            rewritten: Vec::new(),
            malformed: Vec::new(),
            failure: None,
            superseded: false,
            answered: Vec::new(),
            skip_kinds: Vec::new(),
            guardrail: None,
            span: None,
            rules: Vec::new(),
            labels: Vec::new(),
            refused_labels: 0,
            asked: Vec::new(),
            approved: Vec::new(),
        }
    }

    /// The calls it is sent, by index (R9), none answered yet.
    pub(super) fn send(&mut self, sent: Vec<bool>) {
        self.sent_any = sent.contains(&true);
        self.answered = vec![false; sent.len()];
        self.sent = sent;
    }

    /// The reason of its ask about call `i`, if it asked (R35).
    pub(crate) fn ask_of(&self, i: usize) -> Option<&str> {
        self.asked
            .iter()
            .find(|(c, _)| *c == i)
            .map(|(_, reason)| reason.as_str())
    }

    /// Adds labels a verdict set, within [`MAX_LABELS_PER_GUARD`].
    pub(crate) fn add_labels(&mut self, labels: Vec<String>, refused: usize) {
        self.refused_labels += refused;
        for label in labels {
            if self.labels.contains(&label) {
                continue;
            }
            if self.labels.len() >= MAX_LABELS_PER_GUARD {
                self.refused_labels += 1;
            } else {
                self.labels.push(label);
            }
        }
    }

    /// The labels that apply (R34): those of a guard that enforces and
    /// did not fail (R13, R18).
    pub(crate) fn applied_labels(&self, guard: &Guard) -> &[String] {
        if guard.enforced() && self.failure.is_none() {
            &self.labels
        } else {
            &[]
        }
    }

    /// From sending to the answer or the failure, when both happened.
    pub(crate) fn latency(&self) -> Option<Duration> {
        match (self.started, self.finished) {
            (Some(s), Some(f)) => Some(f - s),
            _ => None,
        }
    }

    /// What the guard said of call `i`, if it was sent it: `proceed`,
    /// `steer`, `cancel` or `rewrite`, `failed` when it failed before
    /// answering it; `None` when its answer was no longer needed (R5).
    pub(crate) fn call_action(&self, i: usize) -> Option<&'static str> {
        if self.sent.get(i) != Some(&true) {
            return None;
        }
        if self.ask_of(i).is_some() {
            return Some("ask");
        }
        if let Some(k) = self.skipped.iter().position(|&s| s == i) {
            return Some(
                match self.skip_kinds.get(k).map(|&k| SkipKind::try_from(k)) {
                    Some(Ok(SkipKind::Cancel)) => "cancel",
                    _ => "steer",
                },
            );
        }
        if self.rewritten.contains(&i) {
            return Some("rewrite");
        }
        let answered = self.answered.get(i) == Some(&true);
        match &self.failure {
            Some(_) if !answered => Some("failed"),
            None if !answered && self.superseded => None,
            _ => Some("proceed"),
        }
    }

    /// The status this run would have if the guard enforced.
    pub(crate) fn status(&self) -> TraceStatus {
        match &self.failure {
            // R34: the memory it reads failed to record what the batch
            // let through, whether or not the guard was sent any of it.
            Some(GuardFailure::SessionMemory(_)) => TraceStatus::Failed,
            _ if !self.sent_any => TraceStatus::NotApplicable,
            Some(GuardFailure::TimedOut(_)) => TraceStatus::TimedOut,
            Some(GuardFailure::RejectedRewrite(_)) => TraceStatus::RejectedRewrite,
            Some(_) => TraceStatus::Failed,
            None if self.superseded => TraceStatus::Superseded,
            None if !self.malformed.is_empty() => TraceStatus::Malformed,
            None if !self.skipped.is_empty()
                && self.skipped.iter().all(|&i| self.ask_of(i).is_some()) =>
            {
                TraceStatus::Asked
            }
            None if !self.skipped.is_empty() => TraceStatus::Skipped,
            None if !self.rewritten.is_empty() => TraceStatus::Rewrote,
            None => TraceStatus::Proceeded,
        }
    }
}

/// Guard `run`'s trace entry (R21); `ids` are the batch's call ids.
pub(super) fn trace_entry(guard: &Guard, run: &GuardRun, ids: &[&str]) -> GuardTrace {
    let status = run.status();
    let reported = reported_status(guard, run);
    let pick =
        |indices: &mut dyn Iterator<Item = usize>| indices.map(|i| ids[i].to_owned()).collect();
    GuardTrace {
        guard: guard.name.clone(),
        role: guard.role as i32,
        status: reported as i32,
        latency_us: run
            .latency()
            .map_or(0, |l| u64::try_from(l.as_micros()).unwrap_or(u64::MAX)),
        sent_call_ids: pick(
            &mut run
                .sent
                .iter()
                .enumerate()
                .filter(|(_, s)| **s)
                .map(|(i, _)| i),
        ),
        skipped_call_ids: pick(&mut run.skipped.iter().copied()),
        rewritten_call_ids: pick(&mut run.rewritten.iter().copied()),
        error: error_text(run),
        dry_run_status: if reported == TraceStatus::DryRun {
            status as i32
        } else {
            TraceStatus::Unspecified as i32
        },
        rules: run
            .rules
            .iter()
            .map(|(i, rule)| (ids[*i].to_owned(), rule.clone()))
            .collect(),
        replica: run.replica.as_deref().unwrap_or_default().to_owned(),
        labels: if guard.enforced() {
            run.applied_labels(guard).to_vec()
        } else {
            run.labels.clone()
        },
        refused_labels: u32::try_from(run.refused_labels).unwrap_or(u32::MAX),
        asked_call_ids: pick(&mut run.asked.iter().map(|(i, _)| *i)),
        approved_call_ids: pick(&mut run.approved.iter().copied()),
    }
}

/// The error a guard's trace entry and span show: its failure, else why
/// verdicts were dropped (R8), else nothing.
pub(crate) fn error_text(run: &GuardRun) -> String {
    match &run.failure {
        Some(failure) => failure.to_string(),
        None if run.malformed.is_empty() => String::new(),
        None => run
            .malformed
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// The status a guard's trace entry shows: a dry-run guard's is `dry_run`
/// unless it was sent nothing (R18).
pub(crate) fn reported_status(guard: &Guard, run: &GuardRun) -> TraceStatus {
    let status = run.status();
    if guard.enforced() || status == TraceStatus::NotApplicable {
        status
    } else {
        TraceStatus::DryRun
    }
}

/// A guard as its spans name it.
pub(crate) fn span_guard(guard: &Guard) -> SpanGuard<'_> {
    SpanGuard {
        name: &guard.name,
        role: guard.role.name(),
        enforced: guard.enforced(),
        policy: guard.is_policy(),
        endpoint: if guard.endpoint.is_empty() {
            guard.replicas.first().map_or("", String::as_str)
        } else {
            &guard.endpoint
        },
        failure_policy: guard.failure_policy,
    }
}

/// A guard's failure as its spans name it: a low-cardinality kind, and the
/// gRPC code of the exchange (`None` when the exchange itself went through
/// and the answer was then refused).
pub(crate) fn span_failure(failure: &GuardFailure) -> SpanFailure {
    use crate::observe::spans::code_name;
    use tonic::Code;
    #[allow(unreachable_patterns)]
    let (kind, code) = match failure {
        GuardFailure::TimedOut(_) => ("timeout", Some(Code::DeadlineExceeded)),
        GuardFailure::Status { code, .. } => (code_name(*code), Some(*code)),
        GuardFailure::Refused(_) => ("refused", Some(Code::Unknown)),
        GuardFailure::Unreachable(_) => ("unreachable", Some(Code::Unavailable)),
        GuardFailure::StreamClosed => ("stream_closed", Some(Code::Unavailable)),
        GuardFailure::CircuitOpen { .. } => ("circuit_open", Some(Code::Unavailable)),
        GuardFailure::NotReading { .. } => ("not_reading", Some(Code::Unavailable)),
        GuardFailure::NoProgress { .. } => ("no_progress", Some(Code::Unavailable)),
        GuardFailure::RejectedRewrite(_) => ("rejected_rewrite", None),
        GuardFailure::UnknownVerdictField(_) => ("unknown_verdict_field", None),
        GuardFailure::Policy(_) => ("policy_error", None),
        GuardFailure::SessionMemory(_) => ("session_memory", None),
        _ => ("_OTHER", Some(Code::Unknown)),
    };
    SpanFailure { kind, code }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::tests::guard;
    use crate::judge::verdicts::Rejection;
    use guardmesh_proto::v1::GuardMode;

    /// A run of a guard that was sent the first of two calls.
    fn run() -> GuardRun {
        let mut run = GuardRun::new();
        run.send(vec![true, false]);
        let now = Instant::now();
        run.started = Some(now);
        run.finished = Some(now + Duration::from_micros(250));
        run
    }

    #[test]
    fn r11_trace_entry_names_the_rejection() {
        let mut run = run();
        let rejection = Rejection::ArgumentsNotObject {
            call_id: "a".into(),
        };
        run.failure = Some(GuardFailure::RejectedRewrite(rejection.to_string()));
        let entry = trace_entry(&guard(GuardMode::Enforce), &run, &["a", "b"]);
        assert_eq!(entry.status, TraceStatus::RejectedRewrite as i32);
        assert!(entry.error.contains("not a JSON object"), "{}", entry.error);
        assert_eq!(entry.sent_call_ids, vec!["a".to_owned()]);
        assert_eq!(entry.latency_us, 250);
    }

    #[test]
    fn r8_trace_entry_lists_dropped_verdicts() {
        let mut run = run();
        run.malformed = vec![
            Malformed::BlankSkip {
                call_id: "a".into(),
            },
            Malformed::UnknownCall {
                call_id: "zz".into(),
            },
        ];
        let entry = trace_entry(&guard(GuardMode::Enforce), &run, &["a", "b"]);
        assert_eq!(entry.status, TraceStatus::Malformed as i32);
        assert_eq!(
            entry.error,
            format!("{}; {}", run.malformed[0], run.malformed[1]),
            "every dropped verdict is named, in order"
        );
        assert!(entry.error.contains("blank content"));
        assert!(entry.error.contains("\"zz\""));
    }

    #[test]
    fn r18_dry_run_trace_says_what_it_would_have_done() {
        let mut run = run();
        run.skipped = vec![0];
        let entry = trace_entry(&guard(GuardMode::DryRun), &run, &["a", "b"]);
        assert_eq!(entry.status, TraceStatus::DryRun as i32);
        assert_eq!(entry.dry_run_status, TraceStatus::Skipped as i32);
        assert_eq!(entry.skipped_call_ids, vec!["a".to_owned()]);
        let mut idle = GuardRun::new();
        idle.send(vec![false, false]);
        let entry = trace_entry(&guard(GuardMode::DryRun), &idle, &["a", "b"]);
        assert_eq!(entry.status, TraceStatus::NotApplicable as i32);
        assert_eq!(entry.dry_run_status, TraceStatus::Unspecified as i32);
    }
}
