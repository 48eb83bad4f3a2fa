//! Masking of sensitive values before a record is written (R29).
//!
//! Rules are configured as strings, each one of:
//!
//! * a **key name**, `password`: a member of that name is masked wherever
//!   it appears, at any depth;
//! * an **unanchored path**, `*.api_key`, `db.password`: segments separated
//!   by `.`, matched against the end of a member's path at any depth (so
//!   `*.api_key` is an `api_key` member one or more levels down, not a
//!   top-level one: write `api_key` for every depth);
//! * an **anchored path**, `$.headers.authorization`: matched from the root
//!   of the document only.
//!
//! A segment is a member name or an array index, and may be a glob (`*`
//! for any one member or element, `*token*`, `api_?ey`, `{pass,pwd}`);
//! `items[*]` and `items[0]` are the same as `items.*` and `items.0`, so
//! `[...]` is an index, not a glob character class. Names are compared
//! without regard to ASCII case, so that `Authorization` and
//! `authorization` are both masked: masking too much is the safe side.
//! Member names that contain `.`, `[` or `]` cannot be addressed by a path
//! (a key-name glob still reaches them).
//!
//! The rules apply to every JSON document a record holds, each as its own
//! root: the arguments of every call (as sent, and as rewritten), the
//! batch metadata (an object of strings) and a chain change's guard spec.
//! A masked value, whatever its type, is replaced by the string
//! [`MASKED`]; its children are not visited.
//!
//! Free text (the model's text, skip content, guard and policy error
//! messages, refusal messages) is not reached by any key rule, but a masked
//! value can be quoted in it: a CEL error naming its operand, a rule that
//! echoes an argument into its message, a refusal naming a member inside a
//! masked object. So the texts of the masked values ([`Secrets`]: strings,
//! numbers as written, member names inside a masked object, each also as
//! JSON and Rust escaping would write it) are scrubbed from every free-text
//! field of the record, replaced by [`MASKED`]. Values shorter than
//! [`MIN_SCRUBBED_CHARS`] are not scrubbed from free text: they would match
//! everywhere. While a batch is judged, its masked values are also held in
//! a process-wide set ([`hold`]) that the mesh's log lines and exported
//! spans are scrubbed against ([`scrub_live`]), so that a masked value
//! appears nowhere else either.
//!
//! Arguments that are not a JSON object (unparseable text, or another JSON
//! type; R20 refuses such batches, but the refusal is recorded too) are
//! never written: they are replaced whole by [`OMITTED`], counted as one
//! masked value.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use globset::{GlobBuilder, GlobMatcher};
use serde_json::Value;

use super::record::{BatchRecord, CallRecord, DecisionRecord, Entry};
use crate::secret_formats::Formats;

/// What a masked value is replaced by.
pub const MASKED: &str = "[masked]";

/// What call arguments that are not a JSON object are replaced by.
pub const OMITTED: &str = "[omitted: not a JSON object]";

/// A mask rule that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mask rule {rule:?}: {reason}")]
pub struct MaskError {
    pub rule: String,
    pub reason: String,
}

/// The configured mask rules, compiled, and the secret formats masked
/// wherever they appear (`decision_log.mask_formats`).
#[derive(Debug, Clone, Default)]
pub struct MaskRules {
    rules: Vec<Rule>,
    formats: Formats,
}

/// What a secret of a known format is replaced by in a record:
/// `[masked:<kind>]`.
pub fn masked_format(kind: &str) -> String {
    format!("[masked:{kind}]")
}

#[derive(Debug, Clone)]
struct Rule {
    anchored: bool,
    segments: Vec<Segment>,
}

/// One segment of a rule. Plain names and `*` are compared directly; the
/// glob matcher is only for segments with other glob characters.
#[derive(Debug, Clone)]
enum Segment {
    Any,
    Name(String),
    Glob(GlobMatcher),
}

impl Segment {
    fn matches(&self, name: &str) -> bool {
        match self {
            Segment::Any => true,
            Segment::Name(literal) => literal.eq_ignore_ascii_case(name),
            Segment::Glob(glob) => glob.is_match(name),
        }
    }
}

impl MaskRules {
    /// No masking.
    pub fn none() -> Self {
        MaskRules::default()
    }

    /// Compiles the rules; an unusable rule is an error naming it.
    pub fn new<I, S>(rules: I) -> Result<Self, MaskError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let rules = rules
            .into_iter()
            .map(|rule| Rule::parse(rule.as_ref()))
            .collect::<Result<_, _>>()?;
        Ok(MaskRules {
            rules,
            formats: Formats::none(),
        })
    }

    /// These rules, also masking every secret of `formats` in every string
    /// of a record (values, member names and free text), whatever its key.
    pub fn with_formats(mut self, formats: Formats) -> Self {
        self.formats = formats;
        self
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.formats.is_empty()
    }

    /// Masks `value` in place, as the root of a document; returns how many
    /// values were masked.
    pub fn mask_value(&self, value: &mut Value) -> u32 {
        let mut count = 0;
        if !self.rules.is_empty() {
            let mut path = Vec::new();
            count += self.walk(value, &mut path);
        }
        count + self.formats.replace_in(value, &masked_format)
    }

    /// Masks the secrets of the configured formats in a free-text field.
    fn mask_text(&self, text: &mut String) {
        if let Some(masked) = self.formats.replace(text, masked_format) {
            *text = masked;
        }
    }

    fn mask_text_option(&self, text: &mut Option<String>) {
        if let Some(text) = text {
            self.mask_text(text);
        }
    }

    /// Masks call arguments: a JSON object is masked by the rules, anything
    /// else is replaced by [`OMITTED`] (counted as one).
    pub fn mask_arguments(&self, arguments: &mut Value) -> u32 {
        if arguments.is_object() {
            self.mask_value(arguments)
        } else {
            *arguments = Value::String(OMITTED.to_owned());
            1
        }
    }

    /// Masks everything a record entry holds (see the module docs);
    /// returns how many values were masked.
    pub fn mask_entry(&self, entry: &mut Entry) -> u32 {
        match entry {
            Entry::Decision(decision) => {
                let mut secrets = Secrets::default();
                self.batch_secrets(&decision.batch, &mut secrets);
                for decided in &decision.decisions {
                    if let Some(call) = &decided.call {
                        self.secrets_of(&call.arguments, &mut secrets);
                    }
                }
                secrets.scrub_decision(decision);
                if !self.formats.is_empty() {
                    self.mask_text_option(&mut decision.batch.model_text);
                    for decided in &mut decision.decisions {
                        self.mask_text_option(&mut decided.content);
                    }
                    for trace in &mut decision.trace {
                        self.mask_text_option(&mut trace.error);
                        trace.labels.iter_mut().for_each(|l| self.mask_text(l));
                    }
                    self.mask_text_option(&mut decision.outcome.message);
                    self.mask_ids(decision);
                }
                let mut count = 0;
                for call in &mut decision.batch.calls {
                    count += self.mask_call(call);
                }
                for decided in &mut decision.decisions {
                    if let Some(call) = &mut decided.call {
                        count += self.mask_call(call);
                    }
                }
                count += self.mask_metadata(&mut decision.batch.metadata);
                count
            }
            Entry::ChainChange(change) => {
                let mut secrets = Secrets::default();
                if let Some(spec) = &change.spec {
                    self.secrets_of(spec, &mut secrets);
                }
                if let Some(message) = &mut change.outcome.message {
                    secrets.scrub(message);
                    self.mask_text(message);
                }
                change.spec.as_mut().map_or(0, |spec| self.mask_value(spec))
            }
            // The writer's own seals hold no caller data.
            Entry::Checkpoint(_) | Entry::Gap(_) => 0,
            Entry::RefusalSummary(_) => 0,
            Entry::Approval(answer) => {
                self.mask_text(&mut answer.note);
                0
            }
        }
    }

    /// Masks the secrets of the configured formats in every id field of a
    /// decision record (R29, R34): ids are the caller's text like any
    /// other, and a forged result's `call_id` may be a secret.
    fn mask_ids(&self, decision: &mut DecisionRecord) {
        self.mask_text(&mut decision.batch.batch_id);
        self.mask_text(&mut decision.batch.session_id);
        for call in &mut decision.batch.calls {
            self.mask_text(&mut call.call_id);
        }
        for decided in &mut decision.decisions {
            self.mask_text(&mut decided.call_id);
            if let Some(call) = &mut decided.call {
                self.mask_text(&mut call.call_id);
            }
        }
        for trace in &mut decision.trace {
            for ids in [
                &mut trace.sent_call_ids,
                &mut trace.skipped_call_ids,
                &mut trace.rewritten_call_ids,
            ] {
                ids.iter_mut().for_each(|id| self.mask_text(id));
            }
        }
    }

    /// The texts of the values these rules mask in a batch's calls and
    /// metadata.
    pub fn batch_secrets(&self, batch: &BatchRecord, secrets: &mut Secrets) {
        if self.is_empty() {
            return;
        }
        for call in &batch.calls {
            self.secrets_of(&call.arguments, secrets);
        }
        for (key, value) in &batch.metadata {
            if self.matches(&[key.as_str()]) {
                secrets.add(value);
            } else {
                self.formats
                    .found(value)
                    .into_iter()
                    .for_each(|found| secrets.add(found));
            }
        }
        if let Some(text) = &batch.model_text {
            self.formats
                .found(text)
                .into_iter()
                .for_each(|found| secrets.add(found));
        }
    }

    /// The texts of the values these rules mask in `value`, as the root of
    /// a document (read only: `value` is not masked).
    pub fn secrets_of(&self, value: &Value, secrets: &mut Secrets) {
        if self.is_empty() {
            return;
        }
        if !(value.is_object() || value.is_array()) {
            if let Value::String(text) = value {
                self.formats
                    .found(text)
                    .into_iter()
                    .for_each(|found| secrets.add(found));
            }
            return;
        }
        let mut path = Vec::new();
        self.collect(value, &mut path, secrets);
    }

    fn collect(&self, value: &Value, path: &mut Vec<String>, secrets: &mut Secrets) {
        let child = |name: String, child: &Value, path: &mut Vec<String>, secrets: &mut Secrets| {
            path.push(name);
            if self.matches(path) {
                secrets.add_value(child);
            } else {
                self.collect(child, path, secrets);
            }
            path.pop();
        };
        match value {
            Value::String(text) => {
                self.formats
                    .found(text)
                    .into_iter()
                    .for_each(|found| secrets.add(found));
            }
            Value::Object(members) => {
                for (key, value) in members {
                    self.formats
                        .found(key)
                        .into_iter()
                        .for_each(|found| secrets.add(found));
                    child(key.clone(), value, path, secrets);
                }
            }
            Value::Array(items) => {
                for (index, value) in items.iter().enumerate() {
                    child(index.to_string(), value, path, secrets);
                }
            }
            _ => {}
        }
    }

    fn mask_call(&self, call: &mut CallRecord) -> u32 {
        self.mask_arguments(&mut call.arguments)
    }

    fn mask_metadata(&self, metadata: &mut std::collections::BTreeMap<String, String>) -> u32 {
        let mut count = 0;
        for (key, value) in metadata.iter_mut() {
            if self.matches(&[key.as_str()]) {
                *value = MASKED.to_owned();
                count += 1;
            } else if let Some(masked) = self.formats.replace(value, masked_format) {
                *value = masked;
                count += 1;
            }
        }
        count
    }

    fn walk(&self, value: &mut Value, path: &mut Vec<String>) -> u32 {
        let mut count = 0;
        match value {
            Value::Object(members) => {
                for (key, child) in members.iter_mut() {
                    path.push(key.clone());
                    count += self.visit(child, path);
                    path.pop();
                }
            }
            Value::Array(items) => {
                for (index, child) in items.iter_mut().enumerate() {
                    path.push(index.to_string());
                    count += self.visit(child, path);
                    path.pop();
                }
            }
            _ => {}
        }
        count
    }

    fn visit(&self, value: &mut Value, path: &mut Vec<String>) -> u32 {
        if self.matches(path) {
            *value = Value::String(MASKED.to_owned());
            1
        } else {
            self.walk(value, path)
        }
    }

    /// Whether the member at `path` (from the document's root) is masked.
    fn matches<S: AsRef<str>>(&self, path: &[S]) -> bool {
        self.rules.iter().any(|rule| rule.matches(path))
    }
}

impl Rule {
    fn parse(source: &str) -> Result<Rule, MaskError> {
        let error = |reason: &str| MaskError {
            rule: source.to_owned(),
            reason: reason.to_owned(),
        };
        let (anchored, rest) = match source.strip_prefix('$') {
            Some(rest) => match rest.strip_prefix('.') {
                Some(rest) => (true, rest),
                None if rest.starts_with('[') => (true, rest),
                None if rest.is_empty() => {
                    return Err(error("`$` alone would mask whole documents; name a member"));
                }
                None => return Err(error("a path from the root starts with `$.`")),
            },
            None => (false, source),
        };
        if rest.starts_with('.') {
            return Err(error(
                "`..` (any depth) is not supported: a rule without `$` matches at any depth",
            ));
        }
        let mut segments = Vec::new();
        for part in rest.split('.') {
            // `items[*]` and `items[0]` are `items.*` and `items.0`.
            let (name, mut brackets) = match part.find('[') {
                Some(at) => (&part[..at], &part[at..]),
                None => (part, ""),
            };
            if !name.is_empty() || brackets.is_empty() {
                segments.push(name);
            }
            while !brackets.is_empty() {
                let Some(close) = brackets.find(']') else {
                    return Err(error("unclosed `[`"));
                };
                if !brackets.starts_with('[') {
                    return Err(error("expected `[` after `]`"));
                }
                segments.push(&brackets[1..close]);
                brackets = &brackets[close + 1..];
            }
        }
        if segments.iter().any(|segment| segment.is_empty()) {
            return Err(error("empty segment"));
        }
        let segments = segments
            .into_iter()
            .map(|segment| {
                if segment == "*" {
                    return Ok(Segment::Any);
                }
                if !segment.contains(['*', '?', '[', ']', '{', '}', '\\']) {
                    return Ok(Segment::Name(segment.to_owned()));
                }
                GlobBuilder::new(segment)
                    .case_insensitive(true)
                    .literal_separator(false)
                    .backslash_escape(true)
                    .build()
                    .map(|glob| Segment::Glob(glob.compile_matcher()))
                    .map_err(|err| error(&err.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Rule { anchored, segments })
    }

    fn matches<S: AsRef<str>>(&self, path: &[S]) -> bool {
        let n = self.segments.len();
        if path.len() < n || (self.anchored && path.len() != n) {
            return false;
        }
        let tail = &path[path.len() - n..];
        self.segments
            .iter()
            .zip(tail)
            .all(|(segment, name)| segment.matches(name.as_ref()))
    }
}

/// Masked values shorter than this, in characters, are not scrubbed from
/// free text: they would match everywhere (`1`, `yes`).
pub const MIN_SCRUBBED_CHARS: usize = 4;

/// The texts of masked values, to be scrubbed from free text: each text as
/// it is, and as JSON and Rust's `{:?}` would escape it (a quote, a
/// newline), so that an error message quoting it is caught too.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Secrets {
    texts: Vec<String>,
}

impl Secrets {
    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    /// The texts, longest first.
    pub fn texts(&self) -> &[String] {
        &self.texts
    }

    /// Adds `text` (and its escaped forms) if long enough.
    pub fn add(&mut self, text: &str) {
        if text.chars().count() < MIN_SCRUBBED_CHARS {
            return;
        }
        let json = serde_json::to_string(text).unwrap_or_default();
        let debug = format!("{text:?}");
        for form in [
            text,
            json.get(1..json.len().saturating_sub(1)).unwrap_or(""),
            debug.get(1..debug.len().saturating_sub(1)).unwrap_or(""),
        ] {
            if form.chars().count() >= MIN_SCRUBBED_CHARS && !self.texts.iter().any(|t| t == form) {
                let at = self
                    .texts
                    .iter()
                    .position(|t| t.len() < form.len())
                    .unwrap_or(self.texts.len());
                self.texts.insert(at, form.to_owned());
            }
        }
    }

    /// Adds the texts of a masked value: a string, a number as written,
    /// and, inside objects and arrays, every member name and leaf.
    pub fn add_value(&mut self, value: &Value) {
        match value {
            Value::String(text) => self.add(text),
            Value::Number(number) => self.add(&number.to_string()),
            Value::Array(items) => items.iter().for_each(|item| self.add_value(item)),
            Value::Object(members) => {
                for (key, value) in members {
                    self.add(key);
                    self.add_value(value);
                }
            }
            Value::Bool(_) | Value::Null => {}
        }
    }

    /// Replaces every occurrence of a text by [`MASKED`]; whether any was
    /// found.
    pub fn scrub(&self, text: &mut String) -> bool {
        match scrub_with(self.texts.iter().map(String::as_str), text) {
            Cow::Borrowed(_) => false,
            Cow::Owned(scrubbed) => {
                *text = scrubbed;
                true
            }
        }
    }

    fn scrub_option(&self, text: &mut Option<String>) {
        if let Some(text) = text {
            self.scrub(text);
        }
    }

    /// Scrubs every free-text field of a decision record.
    pub fn scrub_decision(&self, decision: &mut DecisionRecord) {
        if self.is_empty() {
            return;
        }
        self.scrub_option(&mut decision.batch.model_text);
        for decided in &mut decision.decisions {
            self.scrub_option(&mut decided.content);
        }
        for trace in &mut decision.trace {
            self.scrub_option(&mut trace.error);
            // R34: a guard's labels are its own text: a masked value
            // spelled into one is masked there too.
            for label in &mut trace.labels {
                self.scrub(label);
            }
        }
        self.scrub_option(&mut decision.outcome.message);
    }
}

/// `text` with every one of `needles` (longest first) replaced by
/// [`MASKED`]; borrowed when none occurs.
fn scrub_with<'a, 't>(needles: impl Iterator<Item = &'a str>, text: &'t str) -> Cow<'t, str> {
    let mut out = Cow::Borrowed(text);
    for needle in needles {
        if !needle.is_empty() && out.contains(needle) {
            out = Cow::Owned(out.replace(needle, MASKED));
        }
    }
    out
}

/// How long a released value stays in the process-wide set: spans are
/// exported and log lines written a little after their batch is answered.
const LIVE_GRACE: Duration = Duration::from_secs(60);

/// Above this many texts, released ones are dropped before their grace.
const LIVE_MAX: usize = 100_000;

#[derive(Default)]
struct Live {
    texts: HashMap<Arc<str>, LiveText>,
}

struct LiveText {
    holders: usize,
    released: Option<Instant>,
}

static LIVE: LazyLock<Mutex<Live>> = LazyLock::new(Mutex::default);
/// How many texts [`LIVE`] holds: 0 lets [`scrub_live`] return at once.
static LIVE_COUNT: AtomicUsize = AtomicUsize::new(0);

/// The masked values of a batch being judged, held in the process-wide set
/// until dropped (and [`LIVE_GRACE`] after).
#[derive(Debug, Default)]
pub struct Held {
    texts: Vec<Arc<str>>,
}

/// Holds `secrets` in the process-wide set that log lines and spans are
/// scrubbed against ([`scrub_live`]).
pub fn hold(secrets: &Secrets) -> Held {
    if secrets.is_empty() {
        return Held::default();
    }
    let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
    let mut texts = Vec::with_capacity(secrets.texts.len());
    for text in &secrets.texts {
        let key: Arc<str> = Arc::from(text.as_str());
        let entry = live.texts.entry(key.clone()).or_insert(LiveText {
            holders: 0,
            released: None,
        });
        entry.holders += 1;
        entry.released = None;
        texts.push(key);
    }
    LIVE_COUNT.store(live.texts.len(), Ordering::Relaxed);
    Held { texts }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.texts.is_empty() {
            return;
        }
        let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        for text in &self.texts {
            if let Some(entry) = live.texts.get_mut(text) {
                entry.holders = entry.holders.saturating_sub(1);
                if entry.holders == 0 {
                    entry.released = Some(now);
                }
            }
        }
    }
}

/// `text` with every masked value held now (or released within the last
/// minute) replaced by [`MASKED`]; `None` when there is nothing to
/// replace. For the mesh's log lines and exported spans.
pub fn scrub_live(text: &str) -> Option<String> {
    if LIVE_COUNT.load(Ordering::Relaxed) == 0 || text.len() < MIN_SCRUBBED_CHARS {
        return None;
    }
    let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
    let now = Instant::now();
    let grace = if live.texts.len() > LIVE_MAX {
        Duration::ZERO
    } else {
        LIVE_GRACE
    };
    live.texts.retain(|_, entry| {
        entry
            .released
            .is_none_or(|released| now.duration_since(released) < grace)
    });
    LIVE_COUNT.store(live.texts.len(), Ordering::Relaxed);
    let mut found: Vec<&str> = live
        .texts
        .keys()
        .map(|k| &**k)
        .filter(|k| text.contains(k))
        .collect();
    if found.is_empty() {
        return None;
    }
    found.sort_by_key(|k| std::cmp::Reverse(k.len()));
    Some(scrub_with(found.into_iter(), text).into_owned())
}

#[cfg(test)]
mod tests {
    //! R29: fields configured as sensitive are masked before anything is
    //! written.

    use serde_json::json;

    use super::*;
    use crate::decision_log::record::{
        Action, BatchRecord, CallDecisionRecord, GuardRole, GuardTraceRecord, Outcome, TraceStatus,
    };
    use crate::decision_log::tests::{bare_trace, call_decision};

    /// The record of `batch` with one call decision and one guard's trace.
    fn one_call_entry(
        batch: BatchRecord,
        decision: CallDecisionRecord,
        trace: GuardTraceRecord,
        outcome: Outcome,
    ) -> Entry {
        Entry::Decision(DecisionRecord {
            caller: Default::default(),
            batch,
            chain_revision: Some(1),
            decisions: vec![decision],
            trace: vec![trace],
            trace_id: None,
            outcome,
        })
    }

    fn masked(rules: &[&str], mut value: Value) -> (Value, u32) {
        let count = MaskRules::new(rules).unwrap().mask_value(&mut value);
        (value, count)
    }

    #[test]
    fn r29_a_key_name_is_masked_at_any_depth_and_in_any_case() {
        let (value, count) = masked(
            &["password"],
            json!({"password": "a", "db": {"Password": {"x": 1}}, "list": [{"PASSWORD": 3}], "user": "bob"}),
        );
        assert_eq!(
            value,
            json!({"password": MASKED, "db": {"Password": MASKED}, "list": [{"PASSWORD": MASKED}], "user": "bob"})
        );
        assert_eq!(count, 3);
    }

    #[test]
    fn r29_a_glob_path_matches_below_the_top_level_only() {
        let (value, count) = masked(
            &["*.api_key"],
            json!({"api_key": "top", "svc": {"api_key": "k1"}, "a": {"b": {"api_key": "k2"}}}),
        );
        assert_eq!(
            value,
            json!({"api_key": "top", "svc": {"api_key": MASKED}, "a": {"b": {"api_key": MASKED}}})
        );
        assert_eq!(count, 2);
    }

    #[test]
    fn r29_an_anchored_path_matches_from_the_root_only() {
        let (value, count) = masked(
            &["$.headers.authorization"],
            json!({"headers": {"Authorization": "Bearer x", "accept": "*/*"}, "inner": {"headers": {"authorization": "kept"}}}),
        );
        assert_eq!(
            value,
            json!({"headers": {"Authorization": MASKED, "accept": "*/*"}, "inner": {"headers": {"authorization": "kept"}}})
        );
        assert_eq!(count, 1);
    }

    #[test]
    fn r29_globs_in_names_and_array_indices() {
        let (value, count) = masked(
            &["*token*", "$.items[*].secret", "$.pairs[1]"],
            json!({"access_token": "t", "Token": "u", "items": [{"secret": 1}, {"secret": 2, "name": "n"}], "pairs": ["a", "b"]}),
        );
        assert_eq!(
            value,
            json!({"access_token": MASKED, "Token": MASKED, "items": [{"secret": MASKED}, {"secret": MASKED, "name": "n"}], "pairs": ["a", MASKED]})
        );
        assert_eq!(count, 5);
    }

    #[test]
    fn r29_a_masked_object_counts_once_and_is_not_visited() {
        let (value, count) = masked(
            &["auth", "password"],
            json!({"auth": {"password": "p", "user": "u"}}),
        );
        assert_eq!(value, json!({"auth": MASKED}));
        assert_eq!(count, 1);
    }

    #[test]
    fn r29_arguments_that_are_not_an_object_are_never_written_raw() {
        let rules = MaskRules::none();
        for text in [
            "{\"password\": \"hunter2\"",
            "[\"hunter2\"]",
            "\"hunter2\"",
            "",
        ] {
            let mut call = CallRecord::from_text("c1", "t", text);
            assert_eq!(call.arguments, json!(OMITTED), "{text:?}");
            assert_eq!(rules.mask_arguments(&mut call.arguments), 1);
            assert_eq!(call.arguments, json!(OMITTED));
        }
        // Any other non-object value a caller puts in is replaced too.
        let mut value = json!(["hunter2"]);
        assert_eq!(rules.mask_arguments(&mut value), 1);
        assert_eq!(value, json!(OMITTED));
    }

    #[test]
    fn r29_unusable_rules_are_refused_naming_them() {
        for rule in ["", "$", "$..password", "a..b", "$.a[", "$x", "a.[b"] {
            let err = MaskRules::new([rule]).unwrap_err();
            assert_eq!(err.rule, rule);
        }
    }

    #[test]
    fn r29_masked_values_are_scrubbed_from_every_free_text_field() {
        let rules = MaskRules::new(["pin", "auth"]).unwrap();
        let mut batch = crate::decision_log::from_mesh::batch_id_only("b");
        batch.model_text = Some("my pin is 4242-77 ok".into());
        batch.calls.push(CallRecord::from_text(
            "c1",
            "t",
            r#"{"pin": 9223372036854775807, "auth": {"Key-Name": "tok\"en"}, "user": "ann"}"#,
        ));
        batch
            .calls
            .push(CallRecord::from_text("c2", "t", r#"{"pin": "4242-77"}"#));
        let mut entry = one_call_entry(
            batch,
            CallDecisionRecord {
                content: Some("your pin 4242-77 is wrong".into()),
                decided_by: Some("g".into()),
                ..call_decision("c1", Action::Steer)
            },
            GuardTraceRecord {
                error: Some(
                    "Overflow: Int(9223372036854775807) + 1; saw \"tok\\\"en\" at Key-Name".into(),
                ),
                ..bare_trace("g", TraceStatus::Failed)
            },
            Outcome::refused(3, "duplicate member name \"Key-Name\" at $.auth"),
        );
        rules.mask_entry(&mut entry);
        let text = serde_json::to_string(&entry).unwrap();
        for secret in ["9223372036854775807", "4242-77", "Key-Name", "tok"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(text.contains("ann"), "{text}");
        assert!(text.contains("Overflow"), "{text}");
    }

    /// R29, R33: with secret formats configured, a secret of a known shape
    /// is masked in every field of a record whatever its key (values,
    /// member names, metadata, the model's text, a decided call, a result
    /// recorded as a call, a guard's error and labels), and a free-text
    /// field quoting it is scrubbed; other text is kept.
    #[test]
    fn r29_secret_formats_are_masked_in_every_field_whatever_the_key() {
        let aws = "AKIAIOSFODNN7EXAMPLE";
        let stripe = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
        let rules = MaskRules::new(["pin"])
            .unwrap()
            .with_formats(Formats::all());
        let mut batch = crate::decision_log::from_mesh::batch_id_only("b");
        batch.model_text = Some(format!("use {stripe} please"));
        batch.metadata.insert("note".into(), format!("k={aws}"));
        batch.calls.push(CallRecord::from_text(
            "c1",
            "t",
            &format!(r#"{{"body": "key {aws}", "{stripe}": 1, "pin": "1234", "user": "ann"}}"#),
        ));
        let mut rewritten = batch.calls[0].clone();
        rewritten.arguments = serde_json::json!({"body": format!("still {aws}")});
        let mut entry = one_call_entry(
            batch,
            CallDecisionRecord {
                call: Some(rewritten),
                content: Some(format!("saw {aws}")),
                rewritten_by: vec!["g".into()],
                ..call_decision("c1", Action::Proceed)
            },
            GuardTraceRecord {
                role: GuardRole::Mutate,
                error: Some(format!("bad value {stripe}")),
                labels: vec![format!("seen:{aws}")],
                ..bare_trace("g", TraceStatus::Failed)
            },
            Outcome::refused(3, format!("near {aws}")),
        );
        let count = rules.mask_entry(&mut entry);
        let text = serde_json::to_string(&entry).unwrap();
        for secret in [aws, stripe, "1234"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(text.contains("[masked:aws-access-key]"), "{text}");
        assert!(text.contains("[masked:stripe-live-key]"), "{text}");
        assert!(text.contains("ann") && text.contains("bad value"), "{text}");
        assert!(count >= 5, "{count}: {text}");
        // The same record without formats keeps them: the choice is the
        // operator's.
        let mut secrets = Secrets::default();
        MaskRules::new(["pin"])
            .unwrap()
            .secrets_of(&serde_json::json!({"body": aws}), &mut secrets);
        assert!(secrets.is_empty());
    }

    /// R29, R34: a secret of a known shape sent as an id (a forged
    /// result's `call_id`, a batch or session id) is masked in every id
    /// field of the record: the batch's, the calls', the decisions' and the
    /// traces' lists of call ids.
    #[test]
    fn r29_r34_secret_formats_are_masked_in_every_id_field() {
        let aws = "AKIAIOSFODNN7EXAMPLE";
        let github = "ghp_16C7e42F292c6912E7710c838347Ae178B4a";
        let rules = MaskRules::none().with_formats(Formats::all());
        let mut batch = crate::decision_log::from_mesh::batch_id_only(&format!("b-{aws}"));
        batch.session_id = format!("s-{github}");
        batch.calls.push(CallRecord::from_text(aws, "t", "{}"));
        let mut entry = one_call_entry(
            batch,
            CallDecisionRecord {
                call: Some(CallRecord::from_text(aws, "t", "{}")),
                ..call_decision(aws, Action::Proceed)
            },
            GuardTraceRecord {
                sent_call_ids: vec![aws.into()],
                skipped_call_ids: vec![aws.into()],
                rewritten_call_ids: vec![github.into()],
                ..bare_trace("g", TraceStatus::Proceeded)
            },
            Outcome::decided(),
        );
        rules.mask_entry(&mut entry);
        let text = serde_json::to_string(&entry).unwrap();
        for secret in [aws, github] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(text.contains("b-[masked:aws-access-key]"), "{text}");
    }

    /// Pinned on purpose: masked values of 1 to 3 characters are masked in
    /// the record's fields but not scrubbed from free text, which they
    /// would mangle (every `7`, `no` or `abc` in a message). docs/decision-log.md
    /// ("Masked means masked everywhere") says so.
    #[test]
    fn r29_short_values_are_not_scrubbed_and_held_values_scrub_log_text() {
        let mut secrets = Secrets::default();
        secrets.add("abc");
        assert!(secrets.is_empty());
        for short in ["7", "no", "123"] {
            let mut secrets = Secrets::default();
            secrets.add(short);
            let mut text = format!("rule failed on {short}");
            assert!(!secrets.scrub(&mut text), "{short}");
            assert_eq!(text, format!("rule failed on {short}"));
        }
        let mut secrets = Secrets::default();
        secrets.add("1234");
        let mut text = "rule failed on 1234".to_owned();
        assert!(secrets.scrub(&mut text));
        assert_eq!(text, "rule failed on [masked]");
        secrets.add("held-secret-1");
        let held = hold(&secrets);
        assert_eq!(
            scrub_live("error: held-secret-1 refused").as_deref(),
            Some("error: [masked] refused")
        );
        assert_eq!(scrub_live("nothing here"), None);
        drop(held);
        // Within its grace it is still scrubbed.
        assert!(scrub_live("held-secret-1").is_some());
    }
}
