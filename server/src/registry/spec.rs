//! A guard's registration, checked and compiled for the hot path.
//!
//! `GuardSpec` on the wire is plain data; [`Guard`] is the same registration
//! after validation, with its tool patterns compiled once so that matching a
//! call against a guard costs no allocation per batch.

// Its items are `pub` for the `cargo fuzz` targets, which reach them through
// the crate's `fuzzing` module (feature `fuzzing`); the crate itself keeps them
// private by not exporting this module.
#![allow(unreachable_pub)]

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use guardmesh_proto::v1::{
    FailurePolicy, GuardMode, GuardPhases, GuardRole, GuardSpec, ResultGrant, RewriteGrant,
    SessionMemoryUse,
};
use std::time::Duration;

/// Why a registration was refused. Every variant names the offending field.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("guard name must not be empty")]
    EmptyName,
    #[error("guard name {0:?} is invalid: use letters, digits, '.', '_', '-' or '/' (at most 128)")]
    BadName(String),
    #[error("guard {name:?}: endpoint {endpoint:?} is invalid: {reason}")]
    BadEndpoint {
        name: String,
        endpoint: String,
        reason: String,
    },
    #[error("guard {name:?}: tool pattern {pattern:?} is invalid: {source}")]
    BadPattern {
        name: String,
        pattern: String,
        #[source]
        source: globset::Error,
    },
    #[error("guard {name:?}: unknown {field} value {value}")]
    UnknownEnum {
        name: String,
        field: &'static str,
        value: i32,
    },
    /// R27: a policy guard's rules do not compile; the whole registration
    /// is refused.
    #[error("guard {name:?}: its policy does not compile: {source}")]
    BadPolicy {
        name: String,
        #[source]
        source: crate::policy::CompileError,
    },
    /// R32: more replicas than a guard may have.
    #[error(
        "guard {name:?}: {count} replicas in all (endpoint and replicas); at most {max} are allowed"
    )]
    TooManyReplicas {
        name: String,
        count: usize,
        max: usize,
    },
    /// R32: the same replica address twice.
    #[error("guard {name:?}: replica {endpoint:?} is listed twice")]
    DuplicateReplica { name: String, endpoint: String },
    /// R27: a guard is either remote (`endpoint`) or a policy (`policy`).
    #[error("guard {name:?}: {reason}")]
    PolicyGuard { name: String, reason: &'static str },
    /// SEP-2624: an interceptor event outside the grammar, or too many.
    #[error("guard {name:?}: interceptor_events: {reason}")]
    BadInterceptorEvents { name: String, reason: String },
}

/// Most interceptor events a guard lists (`GuardSpec.interceptor_events`).
pub const MAX_INTERCEPTOR_EVENTS: usize = 16;
/// Longest interceptor event, in bytes.
pub const MAX_INTERCEPTOR_EVENT_BYTES: usize = 128;

/// Checks the MCP events a guard hooks as an interceptor (SEP-2624): at
/// most [`MAX_INTERCEPTOR_EVENTS`], each 1 to
/// [`MAX_INTERCEPTOR_EVENT_BYTES`] bytes of ASCII letters, digits and
/// `/ _ . * -`, no event twice.
pub fn check_interceptor_events(name: &str, events: &[String]) -> Result<(), SpecError> {
    let bad = |reason: String| SpecError::BadInterceptorEvents {
        name: name.to_owned(),
        reason,
    };
    if events.len() > MAX_INTERCEPTOR_EVENTS {
        return Err(bad(format!(
            "{} events, more than {MAX_INTERCEPTOR_EVENTS}",
            events.len()
        )));
    }
    for (i, event) in events.iter().enumerate() {
        let shown: String = event.chars().take(32).collect();
        if event.is_empty() || event.len() > MAX_INTERCEPTOR_EVENT_BYTES {
            return Err(bad(format!(
                "event {i} ({shown:?}) must be 1 to {MAX_INTERCEPTOR_EVENT_BYTES} bytes"
            )));
        }
        if !event
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/_.*-".contains(&b))
        {
            return Err(bad(format!(
                "event {i} ({shown:?}) holds a character outside ASCII letters, digits and / _ . * -"
            )));
        }
        if events[..i].contains(event) {
            return Err(bad(format!("event {shown:?} is listed twice")));
        }
    }
    Ok(())
}

/// Tool-name patterns: exact names and globs. Empty matches every tool.
/// The tools a guard applies to are matched without regard to ASCII case
/// (R9: `Shell.exec` reaches a guard on `shell.*`, so a guard is never
/// skipped because of how a name is capitalised); a grant's tools exactly
/// (R11: a grant never reaches a tool it does not name).
#[derive(Debug, Clone)]
pub struct ToolSet {
    patterns: Vec<String>,
    set: Option<GlobSet>,
}

impl ToolSet {
    /// Compiles `patterns`; an empty list matches all tools when
    /// `empty_matches_all`, no tool otherwise. With `any_case`, letters
    /// match in either ASCII case.
    fn compile(
        name: &str,
        patterns: &[String],
        empty_matches_all: bool,
        any_case: bool,
    ) -> Result<Self, SpecError> {
        if patterns.is_empty() {
            return Ok(Self {
                patterns: Vec::new(),
                set: if empty_matches_all {
                    None
                } else {
                    Some(GlobSet::empty())
                },
            });
        }
        let mut builder = GlobSetBuilder::new();
        for pattern in patterns {
            let glob = GlobBuilder::new(pattern)
                .case_insensitive(any_case)
                .build()
                .map_err(|source| SpecError::BadPattern {
                    name: name.to_owned(),
                    pattern: pattern.clone(),
                    source,
                })?;
            builder.add(glob);
        }
        let set = builder.build().map_err(|source| SpecError::BadPattern {
            name: name.to_owned(),
            pattern: patterns.join(","),
            source,
        })?;
        Ok(Self {
            patterns: patterns.to_vec(),
            set: Some(set),
        })
    }

    /// Whether `tool` is in the set.
    pub fn matches(&self, tool: &str) -> bool {
        match &self.set {
            None => true,
            Some(set) => set.is_match(tool),
        }
    }

    /// The patterns as registered.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }
}

/// A validated registration.
#[derive(Debug, Clone)]
pub struct Guard {
    pub name: String,
    pub endpoint: String,
    pub role: GuardRole,
    pub tools: ToolSet,
    pub timeout: Duration,
    pub failure_policy: FailurePolicy,
    /// R35: what a call it asked about gets when nobody answers in time.
    pub ask_fallback: guardmesh_proto::v1::AskFallback,
    pub priority: i32,
    pub mode: GuardMode,
    /// What a mutate guard may rewrite; always empty for validate guards.
    pub grant_tools: ToolSet,
    pub may_rename: bool,
    /// The identity an `https://` guard must present, if pinned.
    pub server_identity: Option<String>,
    /// For a policy guard (R27): its rules, judged inside the mesh; its
    /// `endpoint` is then empty.
    pub policy: Option<PolicyRules>,
    /// R32: the replicas listed besides `endpoint` (`GuardSpec.replicas`),
    /// normalized as `endpoint` is. See [`Self::targets`].
    pub replicas: Vec<String>,
    /// The phases it judges (R33): calls (the default), results, or both.
    pub phases: GuardPhases,
    /// What a mutate guard may rewrite in results (R11, R33); always empty
    /// for validate guards.
    pub result_grant_tools: ToolSet,
    /// SEP-2624: the MCP events it hooks as an interceptor (listing only;
    /// empty: `tools/call`).
    pub interceptor_events: Vec<String>,
    /// Whether it is sent its batch's session memory (R34; sent by
    /// default). Policy guards read memory through `session` in their
    /// rules instead.
    pub session_memory: SessionMemoryUse,
}

/// Compiles a policy, or shares the compiled policy of a live guard with
/// the same source: a registration is checked and then applied, and the
/// same policy registered under several names is held once. Entries go
/// with the last guard holding them (R25: compiled policies are bounded by
/// the guards registered, and freed with them).
fn compile_shared(
    source: &str,
) -> Result<std::sync::Arc<crate::policy::Policy>, crate::policy::CompileError> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
    type Live = Mutex<HashMap<Arc<str>, Weak<crate::policy::Policy>>>;
    static LIVE: OnceLock<Live> = OnceLock::new();
    let live = LIVE.get_or_init(Live::default);
    if let Some(policy) = live
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(source)
        .and_then(Weak::upgrade)
    {
        return Ok(policy);
    }
    let policy = Arc::new(crate::policy::Policy::compile(source)?);
    let mut live = live.lock().unwrap_or_else(PoisonError::into_inner);
    live.retain(|_, policy| policy.strong_count() > 0);
    live.insert(Arc::from(source), Arc::downgrade(&policy));
    Ok(policy)
}

/// A policy guard's rules: the source as registered, compiled once.
#[derive(Debug, Clone)]
pub struct PolicyRules {
    pub source: std::sync::Arc<str>,
    pub compiled: std::sync::Arc<crate::policy::Policy>,
}

impl Guard {
    /// Checks and compiles a wire registration. `default_timeout` replaces a
    /// zero `timeout_ms`.
    pub fn from_spec(spec: &GuardSpec, default_timeout: Duration) -> Result<Self, SpecError> {
        let name = spec.name.trim();
        if name.is_empty() {
            return Err(SpecError::EmptyName);
        }
        if name.len() > 128
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))
        {
            return Err(SpecError::BadName(shown(&spec.name)));
        }
        let name = name.to_owned();
        let policy_guard = |reason: &'static str| SpecError::PolicyGuard {
            name: name.clone(),
            reason,
        };
        let (endpoint, policy) = if spec.policy.trim().is_empty() {
            if spec.endpoint.trim().is_empty() && !spec.replicas.is_empty() {
                // R32: a guard of replicas only.
                (String::new(), None)
            } else {
                (normalize_endpoint(&name, &spec.endpoint)?, None)
            }
        } else {
            if !spec.replicas.is_empty() {
                return Err(policy_guard(
                    "a policy guard is judged inside the mesh: it has no replicas",
                ));
            }
            if !spec.endpoint.trim().is_empty() {
                return Err(policy_guard(
                    "has both an endpoint and a policy: a guard is one or the other",
                ));
            }
            if spec.role != GuardRole::Validate as i32 {
                return Err(policy_guard(
                    "a policy guard is a validate guard: it may not be a mutate guard",
                ));
            }
            if !spec.server_identity.trim().is_empty() {
                return Err(policy_guard(
                    "a policy guard has no endpoint, so no server_identity",
                ));
            }
            let compiled = compile_shared(&spec.policy).map_err(|source| SpecError::BadPolicy {
                name: name.clone(),
                source,
            })?;
            let rules = PolicyRules {
                source: std::sync::Arc::from(spec.policy.as_str()),
                compiled,
            };
            (String::new(), Some(rules))
        };
        let role = GuardRole::try_from(spec.role).map_err(|_| SpecError::UnknownEnum {
            name: name.clone(),
            field: "role",
            value: spec.role,
        })?;
        let failure_policy =
            FailurePolicy::try_from(spec.failure_policy).map_err(|_| SpecError::UnknownEnum {
                name: name.clone(),
                field: "failure_policy",
                value: spec.failure_policy,
            })?;
        let ask_fallback =
            guardmesh_proto::v1::AskFallback::try_from(spec.ask_fallback).map_err(|_| {
                SpecError::UnknownEnum {
                    name: name.clone(),
                    field: "ask_fallback",
                    value: spec.ask_fallback,
                }
            })?;
        let mode = GuardMode::try_from(spec.mode).map_err(|_| SpecError::UnknownEnum {
            name: name.clone(),
            field: "mode",
            value: spec.mode,
        })?;
        let replicas = normalize_replicas(&name, &endpoint, &spec.replicas)?;
        let tools = ToolSet::compile(&name, &spec.tools, true, true)?;
        let grant = match role {
            GuardRole::Mutate => spec.grant.clone().unwrap_or_default(),
            GuardRole::Validate => RewriteGrant::default(),
        };
        let grant_tools = ToolSet::compile(&name, &grant.tools, false, false)?;
        let phases = GuardPhases::try_from(spec.phases).map_err(|_| SpecError::UnknownEnum {
            name: name.clone(),
            field: "phases",
            value: spec.phases,
        })?;
        if policy.is_some() && phases != GuardPhases::Calls {
            return Err(policy_guard(
                "a policy guard judges calls only: its phases must be calls (R33)",
            ));
        }
        let result_grant = match role {
            GuardRole::Mutate => spec.result_grant.clone().unwrap_or_default(),
            GuardRole::Validate => ResultGrant::default(),
        };
        let result_grant_tools = ToolSet::compile(&name, &result_grant.tools, false, false)?;
        check_interceptor_events(&name, &spec.interceptor_events)?;
        let session_memory = SessionMemoryUse::try_from(spec.session_memory).map_err(|_| {
            SpecError::UnknownEnum {
                name: name.clone(),
                field: "session_memory",
                value: spec.session_memory,
            }
        })?;
        let timeout = if spec.timeout_ms == 0 {
            default_timeout
        } else {
            Duration::from_millis(u64::from(spec.timeout_ms))
        };
        Ok(Self {
            name,
            endpoint,
            role,
            tools,
            timeout,
            failure_policy,
            ask_fallback,
            priority: spec.priority,
            mode,
            grant_tools,
            may_rename: grant.may_rename,
            server_identity: Some(spec.server_identity.trim().to_owned()).filter(|s| !s.is_empty()),
            policy,
            replicas,
            phases,
            result_grant_tools,
            interceptor_events: spec.interceptor_events.clone(),
            session_memory,
        })
    }

    /// R32: every address the guard is reached at: `endpoint` (when set)
    /// first, then `replicas`. One entry for a single-address guard; none
    /// for a policy guard.
    pub fn targets(&self) -> Vec<String> {
        let mut out = Vec::with_capacity(1 + self.replicas.len());
        if !self.endpoint.is_empty() {
            out.push(self.endpoint.clone());
        }
        out.extend(self.replicas.iter().cloned());
        out
    }

    /// The hosts of every address the guard is reached at (for the
    /// endpoint policy, which applies to each replica).
    pub fn hosts(&self) -> Vec<(String, String)> {
        self.targets()
            .into_iter()
            .map(|endpoint| {
                let host = host_of(&endpoint);
                (endpoint, host)
            })
            .collect()
    }

    /// The registration as it goes back on the wire (`List`).
    pub fn to_spec(&self) -> GuardSpec {
        GuardSpec {
            name: self.name.clone(),
            endpoint: self.endpoint.clone(),
            role: self.role as i32,
            tools: self.tools.patterns().to_vec(),
            timeout_ms: u32::try_from(self.timeout.as_millis()).unwrap_or(u32::MAX),
            failure_policy: self.failure_policy as i32,
            ask_fallback: self.ask_fallback as i32,
            priority: self.priority,
            mode: self.mode as i32,
            grant: (self.role == GuardRole::Mutate).then(|| RewriteGrant {
                tools: self.grant_tools.patterns().to_vec(),
                may_rename: self.may_rename,
            }),
            server_identity: self.server_identity.clone().unwrap_or_default(),
            policy: self
                .policy
                .as_ref()
                .map_or_else(String::new, |p| p.source.to_string()),
            replicas: self.replicas.clone(),
            phases: self.phases as i32,
            result_grant: (self.role == GuardRole::Mutate
                && !self.result_grant_tools.patterns().is_empty())
            .then(|| ResultGrant {
                tools: self.result_grant_tools.patterns().to_vec(),
            }),
            interceptor_events: self.interceptor_events.clone(),
            session_memory: self.session_memory as i32,
        }
    }

    /// Whether it is sent session memory with its batches (R34): a remote
    /// guard that registered that it reads it. One that said nothing is
    /// sent none and pays nothing for it.
    pub fn wants_session_memory(&self) -> bool {
        self.policy.is_none() && self.session_memory == SessionMemoryUse::Read
    }

    /// Whether the guard judges calls before they run (R33).
    pub fn judges_calls(&self) -> bool {
        matches!(self.phases, GuardPhases::Calls | GuardPhases::Both)
    }

    /// Whether the guard judges results before the model reads them (R33).
    pub fn judges_results(&self) -> bool {
        matches!(self.phases, GuardPhases::Results | GuardPhases::Both)
    }

    /// The endpoint's host (for the endpoint policy).
    pub fn host(&self) -> String {
        host_of(&self.endpoint)
    }

    /// What this registration allows but was probably not meant: a mutate
    /// guard whose grant names no tool (every rewrite it sends is rejected,
    /// R11). Logged at start for config guards and at registration.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.role == GuardRole::Mutate && self.grant_tools.patterns().is_empty() {
            out.push(format!(
                "guard {:?} is a mutate guard with an empty grant: every rewrite it sends \
                 is rejected (R11) and its failure policy applies; grant it tools, or \
                 register it as a validate guard",
                self.name
            ));
        }
        out
    }

    /// Whether the guard is judged inside the mesh from its rules (R27),
    /// with no link.
    pub fn is_policy(&self) -> bool {
        self.policy.is_some()
    }

    /// Whether the guard's verdicts are applied (not a dry run, R18).
    pub fn enforced(&self) -> bool {
        self.mode == GuardMode::Enforce
    }
}

/// Longest endpoint accepted.
const MAX_ENDPOINT_LEN: usize = 512;

/// R32: most replicas a guard may have, `endpoint` included.
pub const MAX_REPLICAS: usize = 64;

/// The host of a normalized endpoint (empty when it has none).
fn host_of(endpoint: &str) -> String {
    endpoint
        .parse::<tonic::transport::Uri>()
        .ok()
        .and_then(|u| u.host().map(str::to_owned))
        .unwrap_or_default()
}

/// R32: the replica list, each address normalized as `endpoint` is, within
/// [`MAX_REPLICAS`] (counting `endpoint` when set), none twice (nor equal
/// to `endpoint`). The count is checked before any address is parsed.
fn normalize_replicas(
    name: &str,
    endpoint: &str,
    replicas: &[String],
) -> Result<Vec<String>, SpecError> {
    let count = replicas.len() + usize::from(!endpoint.is_empty());
    if count > MAX_REPLICAS {
        return Err(SpecError::TooManyReplicas {
            name: name.to_owned(),
            count,
            max: MAX_REPLICAS,
        });
    }
    let mut out: Vec<String> = Vec::with_capacity(replicas.len());
    for replica in replicas {
        let normalized = normalize_endpoint(name, replica)?;
        if normalized == endpoint || out.contains(&normalized) {
            return Err(SpecError::DuplicateReplica {
                name: name.to_owned(),
                endpoint: normalized,
            });
        }
        out.push(normalized);
    }
    Ok(out)
}

/// `text` for an error message: at most 128 characters.
fn shown(text: &str) -> String {
    match text.char_indices().nth(128) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

/// Accepts `http://host:port`, `https://host:port` or a bare `host:port`
/// (read as `http://`), and refuses anything a channel could not dial.
fn normalize_endpoint(name: &str, endpoint: &str) -> Result<String, SpecError> {
    let bad = |reason: &str| SpecError::BadEndpoint {
        name: name.to_owned(),
        endpoint: shown(endpoint),
        reason: reason.to_owned(),
    };
    let trimmed = endpoint.trim();
    if trimmed.is_empty() {
        return Err(bad("empty"));
    }
    if trimmed.len() > MAX_ENDPOINT_LEN {
        return Err(bad("longer than 512 bytes"));
    }
    // A zone id (`[fe80::1%25eth0]`) is refused by name, before the URI
    // parser gives a vaguer reason.
    if let Some(zone) = trimmed.find('%')
        && trimmed[..zone].contains('[')
        && !trimmed[..zone].contains(']')
    {
        return Err(bad("an IPv6 zone id (`%...`) is not allowed"));
    }
    let full = if trimmed.contains("://") {
        trimmed.to_owned()
    } else {
        format!("http://{trimmed}")
    };
    let uri = full
        .parse::<tonic::transport::Uri>()
        .map_err(|e| bad(&e.to_string()))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(bad("scheme must be http or https")),
    }
    let Some(authority) = uri.authority() else {
        return Err(bad("no host"));
    };
    if authority.host().is_empty() {
        return Err(bad("no host"));
    }
    if authority.port_u16().is_none() {
        return Err(bad("no port"));
    }
    if let Some(why) = crate::link::dial::ambiguous_host(authority.host()) {
        return Err(bad(why));
    }
    if authority.as_str().contains('@') {
        return Err(bad("must not have user information"));
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err(bad("must not have a path"));
    }
    Ok(format!(
        "{}://{}",
        uri.scheme_str().unwrap_or("http"),
        authority
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, endpoint: &str) -> GuardSpec {
        GuardSpec {
            name: name.into(),
            endpoint: endpoint.into(),
            ..Default::default()
        }
    }

    #[test]
    fn r16_endpoint_forms() {
        let d = Duration::from_secs(1);
        let g = Guard::from_spec(&spec("a", "127.0.0.1:9"), d).unwrap();
        assert_eq!(g.endpoint, "http://127.0.0.1:9");
        assert!(Guard::from_spec(&spec("a", "http://[::1]:9"), d).is_ok());
        for bad in [
            "",
            "127.0.0.1",
            "ftp://x:1",
            "http://:1",
            "not a uri:1",
            "http://h:1/path",
        ] {
            let err = Guard::from_spec(&spec("a", bad), d).unwrap_err();
            assert!(matches!(err, SpecError::BadEndpoint { .. }), "{bad}: {err}");
        }
    }

    #[test]
    fn r16_ambiguous_endpoint_hosts_are_refused_at_registration() {
        let d = Duration::from_secs(1);
        for (endpoint, needle) in [
            ("http://2130706433:50051", "dotted-quad"),
            ("http://0x7f.0.0.1:50051", "dotted-quad"),
            ("http://0177.0.0.1:50051", "dotted-quad"),
            ("http://127.1:50051", "dotted-quad"),
            ("http://0xA9FEA9FE:80", "dotted-quad"),
            ("http://127.0.0.01:50051", "dotted-quad"),
            ("http://localhost.:50051", "trailing dot"),
            ("http://169.254.169.254.:80", "trailing dot"),
            ("http://metadata.google.internal.:80", "trailing dot"),
            ("http://[fe80::1%25eth0]:50051", "zone id"),
            ("http://[fe80::1%eth0]:50051", "zone id"),
            ("http://a..b:1", "empty label"),
            ("http://user@127.0.0.1:1", "user information"),
        ] {
            match Guard::from_spec(&spec("a", endpoint), d) {
                Err(SpecError::BadEndpoint {
                    endpoint: shown_endpoint,
                    reason,
                    ..
                }) => {
                    assert_eq!(shown_endpoint, endpoint);
                    assert!(reason.contains(needle), "{endpoint}: {reason}");
                }
                other => panic!("{endpoint}: {other:?}"),
            }
        }
        for ok in [
            "http://127.0.0.1:1",
            "http://10.0.0.7:1",
            "http://guard-1.svc.cluster.local:1",
            "https://localhost:443",
            "http://[::1]:1",
            "http://[::ffff:127.0.0.1]:1",
            "http://3com.example:1",
            "http://a.0x7g:1",
        ] {
            assert!(Guard::from_spec(&spec("a", ok), d).is_ok(), "{ok}");
        }
        let long = format!("http://{}.example:1", "a".repeat(600));
        let err = Guard::from_spec(&spec("a", &long), d)
            .unwrap_err()
            .to_string();
        assert!(err.len() < 400, "the message is bounded: {err}");
    }

    #[test]
    fn r9_tools_globs_and_default_all() {
        let d = Duration::from_secs(1);
        let mut s = spec("a", "h:1");
        let all = Guard::from_spec(&s, d).unwrap();
        assert!(all.tools.matches("anything"));
        s.tools = vec!["sql.*".into(), "shell".into()];
        let some = Guard::from_spec(&s, d).unwrap();
        assert!(some.tools.matches("sql.query"));
        assert!(some.tools.matches("shell"));
        assert!(!some.tools.matches("shell.exec"));
        assert!(
            !some.grant_tools.matches("sql.query"),
            "validate guards have no grant"
        );
        s.tools = vec!["[".into()];
        assert!(matches!(
            Guard::from_spec(&s, d),
            Err(SpecError::BadPattern { .. })
        ));
    }

    /// R9: a guard's tools match without regard to ASCII case, exact names
    /// and globs alike; a grant's tools match exactly (R11).
    #[test]
    fn r9_tools_match_in_any_ascii_case_and_grants_exactly() {
        let d = Duration::from_secs(1);
        let mut s = spec("a", "h:1");
        s.role = GuardRole::Mutate as i32;
        s.tools = vec!["shell.*".into(), "read_file".into(), "[ab]?".into()];
        s.grant = Some(RewriteGrant {
            tools: vec!["read_file".into()],
            ..Default::default()
        });
        let g = Guard::from_spec(&s, d).unwrap();
        for tool in [
            "shell.exec",
            "Shell.exec",
            "SHELL.EXEC",
            "sHeLl.x",
            "read_file",
            "READ_FILE",
            "Read_File",
            "aX",
            "Bx",
        ] {
            assert!(g.tools.matches(tool), "{tool}");
        }
        for tool in ["shellexec", "read-file", "cx", "xshell.exec"] {
            assert!(!g.tools.matches(tool), "{tool}");
        }
        assert!(g.grant_tools.matches("read_file"));
        assert!(!g.grant_tools.matches("READ_FILE"));
        // The patterns are listed as registered.
        assert_eq!(g.tools.patterns()[0], "shell.*");
    }

    const RULE: &str =
        "[[rule]]\nname = \"r\"\nwhen = \"true\"\naction = \"cancel\"\nmessage = '\"no\"'\n";

    #[test]
    fn r27_policy_guard_registration() {
        let d = Duration::from_secs(1);
        let policy = GuardSpec {
            name: "p".into(),
            policy: RULE.into(),
            ..Default::default()
        };
        let guard = Guard::from_spec(&policy, d).unwrap();
        assert!(guard.is_policy());
        assert!(guard.endpoint.is_empty());
        let again = Guard::from_spec(&guard.to_spec(), d).unwrap();
        assert_eq!(again.to_spec(), guard.to_spec(), "the source round-trips");
        for (spec, needle) in [
            (
                GuardSpec {
                    endpoint: "127.0.0.1:9".into(),
                    ..policy.clone()
                },
                "both an endpoint and a policy",
            ),
            (
                GuardSpec {
                    role: GuardRole::Mutate as i32,
                    ..policy.clone()
                },
                "validate guard",
            ),
            (
                GuardSpec {
                    policy: "[[rule]]\nname = \"r\"\nwhen = \"(\"\naction = \"cancel\"\nmessage = '\"no\"'\n".into(),
                    ..policy.clone()
                },
                "line 3",
            ),
        ] {
            let error = Guard::from_spec(&spec, d).unwrap_err().to_string();
            assert!(error.contains(needle), "{error}");
        }
    }

    #[test]
    fn r16_unknown_enum_refused() {
        let mut s = spec("a", "h:1");
        s.failure_policy = 7;
        assert!(matches!(
            Guard::from_spec(&s, Duration::from_secs(1)),
            Err(SpecError::UnknownEnum {
                field: "failure_policy",
                ..
            })
        ));
    }
}
