//! `session` in rules (R34): a session's memory as CEL reads it.
//!
//! * `session.labels`: the session's labels, a list of strings, oldest
//!   first (`"secret:fs" in session.labels`);
//! * `session.evicted`: entries the session's bounds dropped since it
//!   began (a strict rule may treat a session that lost memory as
//!   tainted); at least 1 once the whole session was dropped for room;
//! * `session.values_lost`: values seen that the memory no longer holds
//!   (dropped by a bound or the age; at least 1 once the whole session
//!   was lost): a value read then may be sent on unseen, so a flow rule
//!   treats such a session as tainted;
//! * `session.dropped`: whether the whole session was dropped to make
//!   room for other sessions, or lost by a store replicas share, and came
//!   back (all it held is lost: it reads as lost, never as new);
//! * `session.calls_total`: calls recorded since the session began;
//! * `session.count(tool_glob, window)`: calls of a tool matching the glob
//!   (ASCII case ignored) that ran in the session within the window
//!   (`"30s"`, `"15m"`, `"1h"`, `"7d"`), plus the calls before this one in
//!   its own batch whose tool matches, whatever their decision (R34: a
//!   call's rules see the calls before it in its batch; a call that an
//!   earlier guard or this rule skips still counts, the safe side): an int;
//! * `session.seen_from(value, server)`: whether a string in `value` (a
//!   string, or any string or map key inside a list or map, such as
//!   `call.args`), or a token of it, in any ASCII case or in one of the
//!   forms `session::encodings` follows (a URL path segment, percent
//!   escapes, base64 or hex as a whole), is a value seen in a result from
//!   `server` (`"*"`: any server);
//! * `session.seen_from_other(value, server)`: the same, from any server
//!   but `server`.
//!
//! A policy none of whose rules names `session` never reads the memory
//! (no store read for its batches). When the memory cannot be read, every
//! use of `session` is an error: the rule fails, and with it the guard
//! per its failure policy (R13), never "no history, so proceed".

use std::any::Any;
use std::sync::Arc;

use cel::common::traits::Indexer;
use cel::common::types::{self, CelBool, CelInt, CelList, CelMap, CelString, Type};
use cel::common::value::{CowVal, StaticVal, Val};
use cel::{Env, ExecutionError};

use crate::session::view::{SessionView, parse_window};

/// The CEL type of `session`.
static SESSION_TYPE: Type = Type::new_unspecified_type("guardmesh.Session");

/// `session`: a session's memory, or why it cannot be read.
#[derive(Debug, Clone)]
pub enum SessionVal {
    Read(Arc<SessionView>),
    Unavailable(Arc<str>),
}

impl SessionVal {
    fn view(&self, function: &str) -> Result<&SessionView, ExecutionError> {
        match self {
            SessionVal::Read(view) => Ok(view),
            SessionVal::Unavailable(why) => Err(ExecutionError::function_error(
                function,
                format!("session memory unavailable: {why}"),
            )),
        }
    }

    /// Bytes a read of it is charged (see `meter`).
    pub(crate) fn bytes(&self) -> u64 {
        match self {
            SessionVal::Read(view) => {
                let labels: usize = view.labels().iter().map(String::len).sum();
                u64::try_from(labels + 16 * view.labels().len()).unwrap_or(u64::MAX)
            }
            SessionVal::Unavailable(_) => 0,
        }
    }
}

/// `session` as the rules of one call of a batch read it (R34): the
/// memory as the batch read it, and the tools of the batch's calls, of
/// which those before this call are counted by `session.count`.
#[derive(Debug, Clone)]
pub(crate) struct SessionAt {
    session: SessionVal,
    tools: Arc<[String]>,
    index: usize,
}

impl SessionAt {
    /// `session` for call `index` of a batch whose calls' tools are
    /// `tools`, in order.
    pub(crate) fn new(session: SessionVal, tools: Arc<[String]>, index: usize) -> Self {
        Self {
            session,
            tools,
            index,
        }
    }

    /// The tools of the calls before this one in its batch.
    fn earlier(&self) -> &[String] {
        self.tools.get(..self.index).unwrap_or(&self.tools)
    }

    /// Bytes a read of it is charged (see `meter`).
    pub(crate) fn bytes(&self) -> u64 {
        self.session.bytes()
    }
}

impl Val for SessionAt {
    fn get_type(&self) -> &Type {
        &SESSION_TYPE
    }

    fn cel_type() -> &'static Type {
        &SESSION_TYPE
    }

    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }

    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
}

impl StaticVal for SessionAt {}

impl Indexer for SessionAt {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let Some(field) = idx.downcast_ref::<CelString>() else {
            return Err(ExecutionError::no_such_key("session"));
        };
        let view = self.session.view(field.inner())?;
        match field.inner() {
            "labels" => {
                let labels: Vec<Box<dyn Val + 'v>> = view
                    .labels()
                    .iter()
                    .map(|l| Box::new(CelString::from(l.clone())) as Box<dyn Val + 'v>)
                    .collect();
                Ok(CowVal::owned(CelList::from(labels)))
            }
            "evicted" => Ok(CowVal::owned(CelInt::from(
                i64::try_from(view.evicted()).unwrap_or(i64::MAX),
            ))),
            "values_lost" => Ok(CowVal::owned(CelInt::from(
                i64::try_from(view.values_lost()).unwrap_or(i64::MAX),
            ))),
            "dropped" => Ok(CowVal::owned(CelBool::from(view.dropped()))),
            "calls_total" => Ok(CowVal::owned(CelInt::from(
                i64::try_from(view.calls_total()).unwrap_or(i64::MAX),
            ))),
            other => Err(ExecutionError::no_such_key(other)),
        }
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

fn session_arg<'a>(
    args: &'a [CowVal<'_, '_>],
    function: &str,
) -> Result<&'a SessionAt, ExecutionError> {
    args.first()
        .and_then(|a| a.downcast_ref::<SessionAt>())
        .ok_or_else(|| ExecutionError::function_error(function, "expects session as its receiver"))
}

fn string_arg<'a>(
    args: &'a [CowVal<'_, '_>],
    i: usize,
    function: &str,
) -> Result<&'a str, ExecutionError> {
    args.get(i)
        .and_then(|a| a.downcast_ref::<CelString>())
        .map(CelString::inner)
        .ok_or_else(|| {
            ExecutionError::function_error(function, format!("argument {i} must be a string"))
        })
}

fn count<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let at = session_arg(&args, "count")?;
    let view = at.session.view("count")?;
    let glob = string_arg(&args, 1, "count")?;
    let window = string_arg(&args, 2, "count")?;
    let window = parse_window(window).ok_or_else(|| {
        ExecutionError::function_error(
            "count",
            "its window is not a duration like \"30s\", \"15m\", \"1h\" or \"7d\"",
        )
    })?;
    let n = view
        .count_with(glob, window, at.earlier())
        .map_err(|e| ExecutionError::function_error("count", e.to_string()))?;
    Ok(CowVal::owned(CelInt::from(
        i64::try_from(n).unwrap_or(i64::MAX),
    )))
}

/// Every string in `value`: itself, or the items, keys and values within.
fn strings<'x>(value: &'x dyn Val, out: &mut Vec<&'x str>, depth: usize) {
    if depth > 64 {
        return;
    }
    if let Some(s) = value.downcast_ref::<CelString>() {
        out.push(s.inner());
    } else if let Some(list) = value.downcast_ref::<CelList>() {
        for item in list.inner() {
            strings(item.as_ref(), out, depth + 1);
        }
    } else if let Some(map) = value.downcast_ref::<CelMap>() {
        for (key, item) in map.inner() {
            if let types::CelMapKey::String(k) = key {
                out.push(k.inner());
            }
            strings(item.as_ref(), out, depth + 1);
        }
    }
}

fn seen<'b, 'v>(
    args: Vec<CowVal<'b, 'v>>,
    function: &str,
    other: bool,
) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let view = session_arg(&args, function)?.session.view(function)?;
    let server = string_arg(&args, 2, function)?;
    let value = args
        .get(1)
        .ok_or_else(|| ExecutionError::function_error(function, "takes a value and a server"))?;
    let mut texts = Vec::new();
    strings(value.as_ref(), &mut texts, 0);
    let found = if other {
        view.seen_from_other(texts, server)
    } else {
        view.seen_from(texts, server)
    }
    .map_err(|e| ExecutionError::function_error(function, e.to_string()))?;
    Ok(CowVal::owned(CelBool::from(found)))
}

fn seen_from<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    seen(args, "seen_from", false)
}

fn seen_from_other<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    seen(args, "seen_from_other", true)
}

/// Declares `session.count`, `session.seen_from` and
/// `session.seen_from_other`.
pub(crate) fn declare(env: &mut Env) {
    env.add_member_overload(
        "count",
        "session_count_string_string",
        SESSION_TYPE.to_owned(),
        vec![types::STRING_TYPE, types::STRING_TYPE],
        count,
    )
    .expect("the CEL library declares no `count` on sessions");
    env.add_member_overload(
        "seen_from",
        "session_seen_from_dyn_string",
        SESSION_TYPE.to_owned(),
        vec![types::DYN_TYPE, types::STRING_TYPE],
        seen_from,
    )
    .expect("the CEL library declares no `seen_from`");
    env.add_member_overload(
        "seen_from_other",
        "session_seen_from_other_dyn_string",
        SESSION_TYPE.to_owned(),
        vec![types::DYN_TYPE, types::STRING_TYPE],
        seen_from_other,
    )
    .expect("the CEL library declares no `seen_from_other`");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::{compiled, rule};
    use crate::policy::{Args, BatchValues, CallRef, ContextRef, Outcome, Policy};
    use crate::session::{SessionKey, SessionLimits, SessionMemory, Update};

    /// Values read from `fs` stay on `fs`, three emails an hour in a
    /// session, and no `http.*` call once the session read a secret.
    fn relaybleed() -> Policy {
        compiled(&[
            rule(
                "fs-values-stay-on-fs",
                &[],
                r#"!call.tool.startsWith("fs.") && session.seen_from(call.args, "fs")"#,
                "cancel",
                r#""Tool call blocked: it sends a value read from the fs server to " + call.tool"#,
            ),
            rule(
                "email-rate",
                &["email.send"],
                r#"session.count("email.send", "1h") >= 3"#,
                "cancel",
                r#""Tool call blocked: no more than 3 emails an hour in a session""#,
            ),
            rule(
                "tainted-no-http",
                &["http.*"],
                r#""secret:fs" in session.labels"#,
                "steer",
                r#""Tool call blocked: this session read a secret""#,
            ),
        ])
    }

    fn judge(policy: &Policy, session: SessionVal, tool: &str, args: &str) -> Outcome {
        let mut values = BatchValues::new(
            ContextRef {
                session_id: "s",
                ..ContextRef::default()
            },
            [],
            [CallRef {
                call_id: "c",
                tool,
                args: Args::Text(args),
            }],
        );
        values.set_session(session);
        policy.evaluate_values(&values, None).remove(0)
    }

    /// The outcomes of `policy` over a batch of one `{}` call per tool of
    /// `tools` (ids `c0`, `c1`, ...) in session `session_id`, with what
    /// `give` adds to its values (session or identity memory).
    pub(super) fn judge_tools(
        policy: &Policy,
        session_id: &str,
        tools: &[&str],
        give: impl FnOnce(&mut BatchValues<'_>),
    ) -> Vec<Outcome> {
        let ids: Vec<String> = (0..tools.len()).map(|i| format!("c{i}")).collect();
        let mut values = BatchValues::new(
            ContextRef {
                session_id,
                ..ContextRef::default()
            },
            [],
            tools.iter().zip(&ids).map(|(tool, id)| CallRef {
                call_id: id,
                tool,
                args: Args::Text("{}"),
            }),
        );
        give(&mut values);
        policy.evaluate_values(&values, None)
    }

    fn blocked_by(outcome: &Outcome) -> Option<&str> {
        match outcome {
            Outcome::Matched(v) => Some(&v.rule),
            _ => None,
        }
    }

    async fn fs_read(mem: &SessionMemory, key: &SessionKey, secret: &str) {
        let call = mem.call("r1", "fs.read_file", "fs", r#"{"path":".env"}"#);
        mem.record(
            key,
            &Update {
                calls: vec![call],
                ..Update::default()
            },
        )
        .await
        .unwrap();
        let result = serde_json::json!({
            "content": [{"type": "text", "text": format!("DB_PASSWORD={secret}\nDEBUG=1\n")}]
        })
        .to_string();
        // Fed through the results phase's hook directly until that phase
        // exists (R33).
        mem.result_seen(
            key,
            "r1",
            "fs.read_file",
            "fs",
            &result,
            &["secret:fs".into()],
        )
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn r34_relaybleed_a_value_read_from_one_server_sent_to_another_is_denied() {
        let policy = relaybleed();
        assert!(policy.reads_session());
        let mem = SessionMemory::in_memory(SessionLimits::default());
        let key = SessionKey::new("agent", "s1");
        let secret = "hunter2-Sup3rS3cret";
        let before = SessionVal::Read(mem.read(&key).await.unwrap());
        let insert = format!(r#"{{"sql":"INSERT INTO notes VALUES ('{secret}')"}}"#);
        // No prior read: allowed.
        assert_eq!(
            judge(&policy, before, "sqlite.query", &insert),
            Outcome::Proceed
        );
        fs_read(&mem, &key, secret).await;
        let after = SessionVal::Read(mem.read(&key).await.unwrap());
        // Sent to another server: denied.
        let denied = judge(&policy, after.clone(), "sqlite.query", &insert);
        assert_eq!(
            blocked_by(&denied),
            Some("fs-values-stay-on-fs"),
            "{denied:?}"
        );
        // Nested deep in the arguments, or as a map key: denied too.
        let nested = format!(r#"{{"rows":[{{"v":["x","{secret}"]}}]}}"#);
        assert!(blocked_by(&judge(&policy, after.clone(), "sqlite.query", &nested)).is_some());
        // Written back to the server it came from: allowed.
        let back = format!(r#"{{"path":".env.bak","content":"DB_PASSWORD={secret}"}}"#);
        assert_eq!(
            judge(&policy, after.clone(), "fs.write_file", &back),
            Outcome::Proceed
        );
        // Another value: allowed.
        let other = r#"{"sql":"INSERT INTO notes VALUES ('nothing secret here')"}"#;
        assert_eq!(
            judge(&policy, after.clone(), "sqlite.query", other),
            Outcome::Proceed
        );
        // The label set with the result.
        assert_eq!(
            blocked_by(&judge(&policy, after, "http.get", r#"{"url":"https://x"}"#)),
            Some("tainted-no-http")
        );
        // Another session (same identity, another id; or another identity
        // with the same id): allowed.
        for other in [
            SessionKey::new("agent", "s2"),
            SessionKey::new("other", "s1"),
        ] {
            let theirs = SessionVal::Read(mem.read(&other).await.unwrap());
            assert_eq!(
                judge(&policy, theirs, "sqlite.query", &insert),
                Outcome::Proceed
            );
        }
    }

    #[tokio::test]
    async fn r34_rate_limit_counts_calls_of_a_tool_in_a_window() {
        let policy = relaybleed();
        let mem = SessionMemory::in_memory(SessionLimits::default());
        let key = SessionKey::new("agent", "s1");
        for i in 0..3 {
            let view = SessionVal::Read(mem.read(&key).await.unwrap());
            assert_eq!(
                judge(&policy, view, "email.send", "{}"),
                Outcome::Proceed,
                "email {i}"
            );
            let call = mem.call(&format!("e{i}"), "email.send", "email", "{}");
            mem.record(
                &key,
                &Update {
                    calls: vec![call],
                    ..Update::default()
                },
            )
            .await
            .unwrap();
        }
        let view = SessionVal::Read(mem.read(&key).await.unwrap());
        assert_eq!(
            blocked_by(&judge(&policy, view, "EMAIL.SEND", "{}")),
            Some("email-rate")
        );
    }

    /// R34: a call's rules see the calls before it in its own batch. A
    /// batch of six emails in a session allowed three lets the first three
    /// run and stops the others; calls of other tools do not count, and
    /// the calls of earlier batches add up with those of this one.
    #[tokio::test]
    async fn r34_a_count_sees_the_earlier_calls_of_its_own_batch() {
        let policy = relaybleed();
        let mem = SessionMemory::in_memory(SessionLimits::default());
        let key = SessionKey::new("agent", "s1");
        let judge_batch = |session: SessionVal, tools: &[&str]| {
            judge_tools(&policy, "s1", tools, |v| v.set_session(session))
                .iter()
                .map(|o| blocked_by(o).is_none())
                .collect::<Vec<bool>>()
        };
        let view = SessionVal::Read(mem.read(&key).await.unwrap());
        assert_eq!(
            judge_batch(view, &["email.send"; 6]),
            [true, true, true, false, false, false],
            "six emails in one batch where three are allowed"
        );
        let view = SessionVal::Read(mem.read(&key).await.unwrap());
        let mixed = [
            "fs.read",
            "email.send",
            "fs.read",
            "EMAIL.SEND",
            "email.send",
            "fs.read",
            "email.send",
        ];
        assert_eq!(
            judge_batch(view, &mixed),
            [true, true, true, true, true, true, false],
            "only the emails count, whatever the case of their names"
        );
        mem.record(
            &key,
            &Update {
                calls: vec![mem.call("e0", "email.send", "email", "{}")],
                ..Update::default()
            },
        )
        .await
        .unwrap();
        let view = SessionVal::Read(mem.read(&key).await.unwrap());
        assert_eq!(
            judge_batch(view, &["email.send"; 4]),
            [true, true, false, false],
            "one email of an earlier batch and two of this one make three"
        );
    }

    /// R34: a session dropped for room and back reads as lost to rules:
    /// `session.dropped`, and `session.evicted` above 0.
    #[test]
    fn r34_rules_read_that_a_session_was_dropped_for_room() {
        let policy = Policy::compile(
            "[[rule]]\nname='lost'\nwhen='session.dropped && session.evicted > 0'\n\
             action='cancel'\nmessage='\"lost\"'\n",
        )
        .unwrap();
        let view = |memory: crate::session::Memory| {
            SessionVal::Read(Arc::new(crate::session::SessionView::new(
                Arc::new(memory),
                crate::session::Digester::random(),
                1_000,
                std::time::Duration::from_secs(60),
            )))
        };
        let dropped = view(crate::session::Memory::dropped_for_room());
        assert_eq!(
            blocked_by(&judge(&policy, dropped, "sqlite.query", "{}")),
            Some("lost")
        );
        let new = view(crate::session::Memory::default());
        assert_eq!(judge(&policy, new, "sqlite.query", "{}"), Outcome::Proceed);
    }

    #[test]
    fn r34_memory_that_cannot_be_read_fails_the_rule_never_proceeds() {
        let policy = relaybleed();
        let down = SessionVal::Unavailable("the session store is unavailable".into());
        for tool in ["sqlite.query", "email.send", "http.get"] {
            let outcome = judge(&policy, down.clone(), tool, r#"{"sql":"x"}"#);
            assert!(matches!(outcome, Outcome::Error(_)), "{tool}: {outcome:?}");
        }
    }

    #[test]
    fn r34_policies_without_session_do_not_read_it_and_misspellings_are_refused() {
        let plain = Policy::compile(
            "[[rule]]\nname='a'\nwhen='call.tool == \"x\"'\naction='cancel'\nmessage='\"no\"'\n",
        )
        .unwrap();
        assert!(!plain.reads_session());
        let typo = Policy::compile(
            "[[rule]]\nname='a'\nwhen='session.cuont(\"x\", \"1h\") > 1'\naction='cancel'\nmessage='\"no\"'\n",
        );
        assert!(typo.is_err(), "{typo:?}");
        let bad_window = Policy::compile(
            "[[rule]]\nname='a'\nwhen='session.count(\"x\", \"an hour\") > 1'\naction='cancel'\nmessage='\"no\"'\n",
        )
        .unwrap();
        let view = SessionVal::Read(std::sync::Arc::new(crate::session::SessionView::empty(
            crate::session::Digester::random(),
            0,
        )));
        assert!(matches!(
            judge(&bad_window, view, "x", "{}"),
            Outcome::Error(_)
        ));
    }
}

#[cfg(test)]
mod identity_tests {
    use super::*;
    use crate::policy::tests::{compiled, rule};
    use crate::policy::{Outcome, Policy};
    use crate::session::{SessionKey, SessionLimits, SessionMemory, Update};

    /// At most three `email.send` calls an hour for one identity.
    fn budget() -> Policy {
        compiled(&[rule(
            "email-budget",
            &["email.send"],
            r#"identity.count("email.send", "1h") >= 3"#,
            "cancel",
            r#""over budget""#,
        )])
    }

    /// The calls' rules of a batch of `tools` in session `session_id`,
    /// reading `identity` (and no session): whether each proceeds.
    fn judge_batch(policy: &Policy, identity: Option<SessionVal>, tools: &[&str]) -> Vec<Outcome> {
        super::tests::judge_tools(policy, "any", tools, |values| {
            if let Some(identity) = identity {
                values.set_identity(identity);
            }
        })
    }

    /// R34: a policy naming `identity` reads the identity's memory and the
    /// session's; one naming only `session` does not read the identity's.
    #[test]
    fn r34_only_policies_naming_identity_read_the_identity_memory() {
        let budget = budget();
        assert!(budget.reads_identity() && budget.reads_session());
        let session_only = Policy::compile(
            "[[rule]]\nname='a'\nwhen='session.count(\"x\", \"1h\") > 1'\naction='cancel'\nmessage='\"no\"'\n",
        )
        .unwrap();
        assert!(session_only.reads_session() && !session_only.reads_identity());
        let typo = Policy::compile(
            "[[rule]]\nname='a'\nwhen='identity.cuont(\"x\", \"1h\") > 1'\naction='cancel'\nmessage='\"no\"'\n",
        );
        assert!(typo.is_err(), "{typo:?}");
    }

    /// R34: `identity.count` counts the identity's calls in its memory
    /// (whatever their session) and the calls before this one in its
    /// batch; memory that cannot be read, or was not given, fails the
    /// rule, never proceeds.
    #[tokio::test]
    async fn r34_identity_count_sees_its_memory_and_its_batch_and_fails_when_unread() {
        let policy = budget();
        let mem = SessionMemory::in_memory(SessionLimits::default());
        let key = SessionKey::identity("alice");
        let view = SessionVal::Read(mem.read(&key).await.unwrap());
        let outcomes = judge_batch(&policy, Some(view), &["email.send"; 5]);
        let proceeded: Vec<bool> = outcomes.iter().map(|o| *o == Outcome::Proceed).collect();
        assert_eq!(proceeded, [true, true, true, false, false]);
        mem.record(
            &key,
            &Update {
                calls: vec![
                    mem.call("e0", "email.send", "email", "{}"),
                    mem.call("e1", "email.send", "email", "{}"),
                ],
                ..Update::default()
            },
        )
        .await
        .unwrap();
        let view = SessionVal::Read(mem.read(&key).await.unwrap());
        let outcomes = judge_batch(&policy, Some(view), &["email.send"; 2]);
        assert_eq!(outcomes[0], Outcome::Proceed);
        assert!(matches!(outcomes[1], Outcome::Matched(_)), "{outcomes:?}");
        let down = SessionVal::Unavailable("the session store is unavailable".into());
        for identity in [Some(down), None] {
            let outcomes = judge_batch(&policy, identity, &["email.send"]);
            assert!(matches!(outcomes[0], Outcome::Error(_)), "{outcomes:?}");
        }
    }
}

#[cfg(test)]
mod secrets_tests {
    use crate::policy::{Args, BatchValues, CallRef, ContextRef, Outcome, Policy};

    #[test]
    fn common_secret_formats_in_arguments_are_cancelled() {
        let policy =
            Policy::compile(include_str!("../../../examples/policy/secrets.toml")).unwrap();
        let judge = |args: &str| {
            let values = BatchValues::new(
                ContextRef::default(),
                [],
                [CallRef {
                    call_id: "c",
                    tool: "http.post",
                    args: Args::Text(args),
                }],
            );
            policy.evaluate_values(&values, None).remove(0)
        };
        for secret in [
            "AKIAIOSFODNN7EXAMPLE",
            "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
            "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
            "-----BEGIN RSA PRIVATE KEY-----\\nMIIE...",
            "-----BEGIN PRIVATE KEY-----",
        ] {
            let args = format!(r#"{{"body":"x {secret} y","n":1}}"#);
            assert!(matches!(judge(&args), Outcome::Matched(_)), "{secret}");
        }
        for clean in [
            "AKIA-not-a-key",
            "sk_test_4eC39HqLyjWDarjtT1zdp7dc",
            "hello",
        ] {
            let args = format!(r#"{{"body":"{clean}"}}"#);
            assert_eq!(judge(&args), Outcome::Proceed, "{clean}");
        }
    }
}
