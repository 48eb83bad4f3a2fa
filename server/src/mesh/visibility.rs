//! Tool visibility: which tools the chain skips whatever a call's
//! arguments (`PreToolService.AlwaysSkipped`), so that an MCP gateway may
//! leave them out of the `tools/list` answers it relays and a model is not
//! offered what it may never call.
//!
//! Only what is certain from the chain alone is listed; anything else is
//! shown. A tool T is listed when, in the current snapshot (R17):
//!
//! * **unguarded**: the mesh cancels unguarded calls (R28) and no enforced
//!   guard that judges calls applies to T (its patterns, without regard to
//!   ASCII case, R9); then no mutate guard reaches T either, so no rename
//!   can take a call of it to a guarded tool; or
//! * **by policy**: an enforced policy guard (R27) that judges calls and is
//!   not `fail_open` applies to T, every rule of it that applies to T, up
//!   to and including the first whose `when` is the constant `true`, steers
//!   or cancels, and that rule's `message` is a constant
//!   ([`crate::policy::Policy::always_skips`]); and no enforced mutate
//!   guard that may rename T applies to it (mutate guards run first, R10,
//!   and a renamed call is judged as another tool).
//!
//! Why that is a skip for every call of T: the guard is sent every call of
//! T (no earlier guard can rename it; an earlier skip is a skip anyway, and
//! an earlier ask only holds it until an approval, after which the guards
//! after it still judge it, R35). An earlier rule of it either decides
//! with its own steer or cancel, or fails and leaves the decision to the
//! constant rule, whose verdict stands whatever the failure policy (R27);
//! a call over the guard's bounds is steered (R13); a guard that times out
//! or fails is `fail_closed` (cancel) or `abort` (no call runs). An `ask`
//! rule is not a skip: an approval lets the call run. A tool outside the
//! mesh's tool-name grammar is never listed: its calls are refused (R20),
//! not skipped.
//!
//! The answer is advisory: every call is still judged when it comes.

use super::Mesh;
use crate::judge::Unguarded;
use crate::registry::spec::Guard;
use guardmesh_proto::v1::{AlwaysSkippedResponse, FailurePolicy, GuardRole, SkippedTool};
use guardmesh_proto::{ALWAYS_SKIPPED_MAX_NAME_BYTES, ALWAYS_SKIPPED_MAX_TOOLS};

impl Mesh {
    /// The tools of `tools` the current chain skips whatever a call's
    /// arguments (see the module's documentation), in request order, each
    /// once. Refused with INVALID_ARGUMENT past
    /// [`ALWAYS_SKIPPED_MAX_TOOLS`] names or a name longer than
    /// [`ALWAYS_SKIPPED_MAX_NAME_BYTES`], and with UNAVAILABLE when the
    /// registry cannot be trusted to be current (R17: what a stale chain
    /// skips may not be what the current one does).
    pub fn always_skipped(&self, tools: &[String]) -> Result<AlwaysSkippedResponse, tonic::Status> {
        if tools.len() > ALWAYS_SKIPPED_MAX_TOOLS {
            return Err(tonic::Status::invalid_argument(format!(
                "{} tool names asked about; at most {ALWAYS_SKIPPED_MAX_TOOLS} may be \
                 (AlwaysSkippedRequest.tools)",
                tools.len()
            )));
        }
        if let Some((i, long)) = tools
            .iter()
            .enumerate()
            .find(|(_, t)| t.len() > ALWAYS_SKIPPED_MAX_NAME_BYTES)
        {
            return Err(tonic::Status::invalid_argument(format!(
                "tool name {i} ({:?}) is {} bytes long; at most {ALWAYS_SKIPPED_MAX_NAME_BYTES} \
                 bytes may be (AlwaysSkippedRequest.tools)",
                crate::validate::shown_id(long, crate::validate::SHOWN_PREFIX),
                long.len()
            )));
        }
        crate::admit::registry(self.registry()).map_err(|refusal| refusal.status())?;
        let chain = self.chain();
        let guards: Vec<&Guard> = chain.guards.iter().map(|g| &*g.guard).collect();
        let grammar = &self.config.limits.tool_names;
        let mut seen = std::collections::HashSet::new();
        let skipped = tools
            .iter()
            .filter(|tool| seen.insert(tool.as_str()))
            .filter(|tool| grammar.check(tool).is_ok())
            .filter_map(|tool| always_skipped(&guards, self.config.unguarded, tool))
            .collect();
        Ok(AlwaysSkippedResponse {
            chain_revision: chain.revision,
            tools: skipped,
        })
    }
}

/// Whether `guard` is consulted for calls and its verdicts applied.
fn judges_calls(guard: &Guard) -> bool {
    guard.enforced() && guard.judges_calls()
}

/// How the chain `guards` skips every call of `tool`, if it certainly
/// does (see the module's documentation); `None`: shown.
pub(crate) fn always_skipped(
    guards: &[&Guard],
    unguarded: Unguarded,
    tool: &str,
) -> Option<SkippedTool> {
    let applying = || {
        guards
            .iter()
            .copied()
            .filter(|g| judges_calls(g) && g.tools.matches(tool))
    };
    if applying().next().is_none() {
        return (unguarded == Unguarded::Cancel).then(|| SkippedTool {
            tool: tool.to_owned(),
            guard: String::new(),
            rule: String::new(),
        });
    }
    // R10, R11: a mutate guard that may rename the tool sends its calls on
    // as another tool, which this tool's rules may not reach.
    if applying()
        .any(|g| g.role == GuardRole::Mutate && g.may_rename && g.grant_tools.matches(tool))
    {
        return None;
    }
    applying()
        .filter(|g| g.failure_policy != FailurePolicy::FailOpen)
        .find_map(|g| {
            let rules = g.policy.as_ref()?;
            let rule = rules.compiled.always_skips(tool)?;
            Some(SkippedTool {
                tool: tool.to_owned(),
                guard: g.name.clone(),
                rule: rule.name().to_owned(),
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::{GuardMode, GuardPhases, GuardSpec, RewriteGrant};
    use std::time::Duration;

    const CANCEL_DELETE: &str = r#"
[[rule]]
name = "no-delete"
tools = ["delete_db"]
when = "true"
action = "cancel"
message = '"deleting the database is not allowed"'
"#;

    fn policy_guard(name: &str, policy: &str) -> GuardSpec {
        GuardSpec {
            name: name.into(),
            policy: policy.into(),
            ..Default::default()
        }
    }

    /// A policy of one rule (on the tools `tools` matches; its `message`
    /// a CEL expression) and then [`CANCEL_DELETE`].
    fn rule_then_cancel_delete(
        name: &str,
        tools: &str,
        when: &str,
        action: &str,
        message: &str,
    ) -> String {
        format!(
            "[[rule]]\nname = \"{name}\"\ntools = [\"{tools}\"]\nwhen = \"{when}\"\n\
             action = \"{action}\"\nmessage = '{message}'\n{CANCEL_DELETE}"
        )
    }

    /// `spec` made a mutate guard granted `tools`, and renames if
    /// `may_rename`.
    fn mutate(mut spec: GuardSpec, tools: &[&str], may_rename: bool) -> GuardSpec {
        spec.role = GuardRole::Mutate as i32;
        spec.grant = Some(RewriteGrant {
            tools: tools.iter().map(|t| (*t).to_owned()).collect(),
            may_rename,
        });
        spec
    }

    fn remote(name: &str, tools: &[&str]) -> GuardSpec {
        GuardSpec {
            name: name.into(),
            endpoint: "http://127.0.0.1:1".into(),
            tools: tools.iter().map(|t| (*t).to_owned()).collect(),
            ..Default::default()
        }
    }

    fn guards(specs: &[GuardSpec]) -> Vec<Guard> {
        specs
            .iter()
            .map(|s| Guard::from_spec(s, Duration::from_secs(1)).expect("a valid guard"))
            .collect()
    }

    fn skipped(specs: &[GuardSpec], unguarded: Unguarded, tool: &str) -> Option<SkippedTool> {
        let guards = guards(specs);
        let refs: Vec<&Guard> = guards.iter().collect();
        always_skipped(&refs, unguarded, tool)
    }

    fn hidden(specs: &[GuardSpec], tool: &str) -> bool {
        skipped(specs, Unguarded::Proceed, tool).is_some()
    }

    #[test]
    fn r27_a_constant_cancel_rule_skips_every_call_of_its_tool() {
        let got = skipped(
            &[policy_guard("p", CANCEL_DELETE)],
            Unguarded::Proceed,
            "delete_db",
        )
        .expect("skipped");
        assert_eq!((got.guard.as_str(), got.rule.as_str()), ("p", "no-delete"));
        // A constant steer is a skip too.
        let steer = CANCEL_DELETE.replace("\"cancel\"", "\"steer\"");
        assert!(hidden(&[policy_guard("p", &steer)], "delete_db"));
    }

    #[test]
    fn r9_a_name_differing_only_in_case_is_skipped_as_its_calls_would_be() {
        for tool in ["DELETE_DB", "Delete_Db"] {
            assert!(hidden(&[policy_guard("p", CANCEL_DELETE)], tool), "{tool}");
        }
        // Unguarded: a guard on `read_*` applies to `READ_FILE` (R9).
        let specs = [remote("r", &["read_*"])];
        assert!(skipped(&specs, Unguarded::Cancel, "READ_FILE").is_none());
        assert!(skipped(&specs, Unguarded::Cancel, "write_file").is_some());
    }

    #[test]
    fn r27_a_tool_no_rule_names_is_shown() {
        assert!(!hidden(&[policy_guard("p", CANCEL_DELETE)], "read_file"));
    }

    #[test]
    fn r13_a_fail_open_policy_guard_is_shown() {
        let mut spec = policy_guard("p", CANCEL_DELETE);
        spec.failure_policy = FailurePolicy::FailOpen as i32;
        assert!(!hidden(&[spec], "delete_db"));
        // fail_closed and abort: a failure never lets the call run.
        for policy in [FailurePolicy::FailClosed, FailurePolicy::Abort] {
            let mut spec = policy_guard("p", CANCEL_DELETE);
            spec.failure_policy = policy as i32;
            assert!(hidden(&[spec], "delete_db"), "{policy:?}");
        }
    }

    #[test]
    fn r35_an_ask_rule_before_the_constant_one_is_shown() {
        let policy = rule_then_cancel_delete(
            "ask-first",
            "delete_*",
            "call.args.force == true",
            "ask",
            r#""a person decides""#,
        );
        assert!(!hidden(&[policy_guard("p", &policy)], "delete_db"));
        // A constant ask is never a skip.
        let ask = CANCEL_DELETE.replace("\"cancel\"", "\"ask\"");
        assert!(!hidden(&[policy_guard("p", &ask)], "delete_db"));
    }

    #[test]
    fn r27_earlier_steer_or_cancel_rules_still_skip_whatever_their_when() {
        let policy = rule_then_cancel_delete(
            "steer-first",
            "delete_db",
            "call.args.table == 'users'",
            "steer",
            r#""name another table: " + call.args.table"#,
        );
        let got = skipped(
            &[policy_guard("p", &policy)],
            Unguarded::Proceed,
            "delete_db",
        )
        .expect("skipped");
        assert_eq!(got.rule, "no-delete");
    }

    #[test]
    fn r27_a_when_that_is_not_the_literal_true_is_shown() {
        for when in [
            "call.args.table == 'users'",
            "1 == 1",
            "!false",
            "size(calls) >= 0",
        ] {
            let policy = CANCEL_DELETE.replace("when = \"true\"", &format!("when = \"{when}\""));
            assert!(
                !hidden(&[policy_guard("p", &policy)], "delete_db"),
                "{when}"
            );
        }
    }

    #[test]
    fn r27_a_constant_rule_whose_message_can_fail_is_shown() {
        let policy = CANCEL_DELETE.replace(
            r#"message = '"deleting the database is not allowed"'"#,
            r#"message = '"no: " + call.args.table'"#,
        );
        assert!(!hidden(&[policy_guard("p", &policy)], "delete_db"));
    }

    #[test]
    fn r10_a_mutate_guard_that_may_rename_the_tool_shows_it() {
        let renamer = mutate(
            remote("m", &["delete_*"]),
            &["delete_db", "archive_db"],
            true,
        );
        let specs = [renamer.clone(), policy_guard("p", CANCEL_DELETE)];
        assert!(!hidden(&specs, "delete_db"));
        assert!(
            skipped(&specs, Unguarded::Cancel, "delete_db").is_none(),
            "guarded: not unguarded either"
        );
        // One that may only rewrite arguments, or whose grant does not
        // hold the tool, cannot make it another tool.
        let args_only = mutate(renamer.clone(), &["delete_db"], false);
        assert!(hidden(
            &[args_only, policy_guard("p", CANCEL_DELETE)],
            "delete_db"
        ));
        let elsewhere = mutate(renamer.clone(), &["archive_db"], true);
        assert!(hidden(
            &[elsewhere, policy_guard("p", CANCEL_DELETE)],
            "delete_db"
        ));
        // A dry-run renamer's rewrites are never applied (R18).
        let mut dry = renamer;
        dry.mode = GuardMode::DryRun as i32;
        assert!(hidden(
            &[dry, policy_guard("p", CANCEL_DELETE)],
            "delete_db"
        ));
    }

    #[test]
    fn r18_a_dry_run_policy_guard_is_shown() {
        let mut dry = policy_guard("p", CANCEL_DELETE);
        dry.mode = GuardMode::DryRun as i32;
        assert!(!hidden(&[dry], "delete_db"));
    }

    #[test]
    fn r28_unguarded_tools_are_skipped_only_when_the_mesh_cancels_them() {
        let specs = [remote("r", &["read_*"])];
        let got = skipped(&specs, Unguarded::Cancel, "write_file").expect("skipped");
        assert_eq!((got.guard.as_str(), got.rule.as_str()), ("", ""));
        assert!(skipped(&specs, Unguarded::Proceed, "write_file").is_none());
        assert!(skipped(&[], Unguarded::Proceed, "write_file").is_none());
        assert!(skipped(&[], Unguarded::Cancel, "write_file").is_some());
        // A dry-run guard does not guard (R18), one judging results only
        // does not judge calls (R33).
        let mut dry = remote("d", &[]);
        dry.mode = GuardMode::DryRun as i32;
        let mut results = remote("s", &[]);
        results.phases = GuardPhases::Results as i32;
        assert!(skipped(&[dry, results], Unguarded::Cancel, "write_file").is_some());
    }

    /// A mesh over a memory registry holding `specs`, cancelling unguarded
    /// calls when `cancel`.
    async fn mesh(specs: &[GuardSpec], cancel: bool) -> std::sync::Arc<Mesh> {
        use crate::registry::{Admission, MemoryRegistry, Registry, admit_blocking};
        let mut config = crate::MeshConfig::default();
        if cancel {
            config.unguarded = Unguarded::Cancel;
        }
        let registry = std::sync::Arc::new(MemoryRegistry::new(config.default_guard_timeout));
        let mesh = Mesh::new(config, registry.clone());
        let admission = Admission {
            default_timeout: mesh.config.default_guard_timeout,
            endpoint_policy: std::sync::Arc::default(),
        };
        for spec in specs {
            let checked = admit_blocking(spec.clone(), &admission).expect("a valid registration");
            registry.register(checked, None).await.expect("registered");
        }
        mesh
    }

    #[tokio::test]
    async fn r17_the_answer_is_the_current_chains_and_what_it_lists_is_skipped_when_called() {
        use guardmesh_proto::v1::{Action, EvaluateRequest, ToolCall};
        let mesh = mesh(&[policy_guard("p", CANCEL_DELETE)], false).await;
        let asked: Vec<String> = [
            "read_file",
            "delete_db",
            "DELETE_DB",
            "delete_db",
            "bad name",
        ]
        .map(String::from)
        .to_vec();
        let answer = mesh.always_skipped(&asked).expect("answered");
        let listed: Vec<&str> = answer.tools.iter().map(|t| t.tool.as_str()).collect();
        assert_eq!(listed, ["delete_db", "DELETE_DB"], "each once, in order");
        assert_eq!(answer.chain_revision, mesh.chain().revision);
        // What is listed is what judging does, whatever the arguments.
        for (i, args) in ["{}", r#"{"table":"users"}"#, r#"{"force":true,"x":[1,2]}"#]
            .into_iter()
            .enumerate()
        {
            let request = EvaluateRequest {
                batch_id: format!("b{i}"),
                calls: listed
                    .iter()
                    .chain(&["read_file"])
                    .enumerate()
                    .map(|(n, tool)| ToolCall {
                        call_id: format!("c{n}"),
                        tool: (*tool).to_owned(),
                        arguments: args.to_owned(),
                    })
                    .collect(),
                ..Default::default()
            };
            let decision = mesh
                .evaluate_unrecorded(
                    request,
                    tokio::time::Instant::now() + Duration::from_secs(5),
                    crate::judge::TraceContext::default(),
                )
                .await
                .expect("decided");
            let actions: Vec<i32> = decision.decisions.iter().map(|d| d.action).collect();
            assert_eq!(
                actions,
                [
                    Action::Cancel as i32,
                    Action::Cancel as i32,
                    Action::Proceed as i32
                ],
                "{args}"
            );
        }
        // R28: with unguarded calls cancelled, a tool no guard names too.
        let mesh = self::mesh(&[remote("r", &["read_*"])], true).await;
        let answer = mesh.always_skipped(&asked).expect("answered");
        let listed: Vec<&str> = answer.tools.iter().map(|t| t.tool.as_str()).collect();
        assert_eq!(listed, ["delete_db", "DELETE_DB"]);
    }

    #[tokio::test]
    async fn r20_requests_past_the_bounds_are_refused_naming_the_limit() {
        let mesh = mesh(&[policy_guard("p", CANCEL_DELETE)], false).await;
        let many = vec!["t".to_owned(); ALWAYS_SKIPPED_MAX_TOOLS + 1];
        let refused = mesh.always_skipped(&many).expect_err("too many");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(
            refused.message().contains("at most 4096"),
            "{}",
            refused.message()
        );
        let mut long = vec!["ok".to_owned()];
        long.push("x".repeat(ALWAYS_SKIPPED_MAX_NAME_BYTES + 1));
        let refused = mesh.always_skipped(&long).expect_err("too long");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(
            refused.message().contains("tool name 1")
                && refused.message().contains("at most 256 bytes")
                && refused.message().len() < 400,
            "{}",
            refused.message()
        );
        // At the bounds: answered.
        let at = vec!["x".repeat(ALWAYS_SKIPPED_MAX_NAME_BYTES); ALWAYS_SKIPPED_MAX_TOOLS];
        assert!(mesh.always_skipped(&at).expect("answered").tools.is_empty());
    }

    #[test]
    fn r27_a_remote_guard_is_never_proof_of_a_skip() {
        // Its verdicts depend on the arguments; only a policy's constant
        // rules are known.
        assert!(!hidden(&[remote("r", &["delete_db"])], "delete_db"));
        // A remote guard before a policy guard changes nothing: it may
        // skip first, never make the policy let the call run.
        assert!(hidden(
            &[remote("r", &[]), policy_guard("p", CANCEL_DELETE)],
            "delete_db"
        ));
    }
}
