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
//! [`MASKED`]; its children are not visited. Free text (the model's text,
//! skip content, error messages) is not masked: no key rule can reach it.
//!
//! Arguments that are not a JSON object (unparseable text, or another JSON
//! type; R20 refuses such batches, but the refusal is recorded too) are
//! never written: they are replaced whole by [`OMITTED`], counted as one
//! masked value.

use globset::{GlobBuilder, GlobMatcher};
use serde_json::Value;

use super::record::{CallRecord, Entry};

/// What a masked value is replaced by.
pub const MASKED: &str = "[masked]";

/// What call arguments that are not a JSON object are replaced by.
pub const OMITTED: &str = "[omitted: not a JSON object]";

/// A mask rule that cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[error("mask rule {rule:?}: {reason}")]
pub struct MaskError {
    pub rule: String,
    pub reason: String,
}

/// The configured mask rules, compiled.
#[derive(Debug, Clone, Default)]
pub struct MaskRules {
    rules: Vec<Rule>,
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
        Ok(MaskRules { rules })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Masks `value` in place, as the root of a document; returns how many
    /// values were masked.
    pub fn mask_value(&self, value: &mut Value) -> u32 {
        if self.rules.is_empty() {
            return 0;
        }
        let mut path = Vec::new();
        self.walk(value, &mut path)
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
                change.spec.as_mut().map_or(0, |spec| self.mask_value(spec))
            }
            // The writer's own seals hold no caller data.
            Entry::Checkpoint(_) | Entry::Gap(_) => 0,
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

#[cfg(test)]
mod tests {
    //! R29: fields configured as sensitive are masked before anything is
    //! written.

    use serde_json::json;

    use super::*;

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
}
