//! The checks on one guard's verdicts before they count: malformed verdicts
//! are dropped (R8), rewrites are held to the guard's grant (R11). Pure: no
//! I/O, no clock, no telemetry.

use super::call_index::CallIndex;
use crate::registry::spec::Guard;
use crate::validate;
use crate::validate::ijson::clip;
use guardmesh_proto::v1::{GuardRole, Skip, SkipKind, ToolCall, Verdict, verdict::Outcome};

/// Longest guard-supplied text (an unknown call id, a new tool name) shown
/// in a message, in characters.
const SHOWN_CHARS: usize = 64;

/// Why a guard's whole answer is rejected (R11). The guard then fails per
/// its failure policy (R13), traced `rejected_rewrite` with this reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Rejection {
    /// A rewrite for a call the guard was not sent.
    #[error("rewrite for call id {call_id:?}, which was not sent to this guard")]
    UnknownCall { call_id: String },
    /// A validate guard sent a rewrite.
    #[error("validate guard sent a rewrite for call {call_id:?}; only mutate guards may rewrite")]
    NotMutate { call_id: String },
    /// The grant does not cover the call's tool.
    #[error("rewrite of call {call_id:?}: the grant does not cover tool {tool:?}")]
    ToolNotGranted { call_id: String, tool: String },
    /// The rewrite renames the tool, and the grant does not allow renames.
    #[error("rewrite of call {call_id:?} renames tool {from:?} to {to:?} without the rename grant")]
    RenameNotGranted {
        call_id: String,
        from: String,
        to: String,
    },
    /// The rewrite renames the tool to one outside the grant (or blank).
    #[error("rewrite of call {call_id:?} renames tool {from:?} to {to:?}, outside the grant")]
    RenameOutsideGrant {
        call_id: String,
        from: String,
        to: String,
    },
    /// The rewritten arguments are not a JSON object.
    #[error("rewrite of call {call_id:?}: arguments are not a JSON object")]
    ArgumentsNotObject { call_id: String },
    /// The rewrite renames the tool to a name the gate would refuse (R20):
    /// a client could not have sent it, so no guard may make it run.
    #[error(
        "rewrite of call {call_id:?} renames tool {from:?} to {to:?}, outside the tool-name grammar: {why}"
    )]
    RenameOutsideGrammar {
        call_id: String,
        from: String,
        to: String,
        why: String,
    },
    /// The rewritten arguments are not what the gate accepts (R20: I-JSON,
    /// within the depth limit, no member names equal under case folding),
    /// so validate guards and the tool could read them differently.
    #[error("rewrite of call {call_id:?}: arguments refused as the gate refuses them: {why}")]
    ArgumentsRefused { call_id: String, why: String },
    /// The result grant does not cover the result's tool (R33).
    #[error(
        "rewrite of the result of call {call_id:?}: the result grant does not cover tool {tool:?}"
    )]
    ResultNotGranted { call_id: String, tool: String },
    /// The rewritten result is not what the mesh accepts of a result (R33).
    #[error("rewrite of the result of call {call_id:?} refused: {why}")]
    ResultRefused { call_id: String, why: String },
}

/// Why a verdict was dropped and counted as proceed from that guard (R8).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Malformed {
    /// A verdict for a call the guard was not sent.
    #[error("verdict for call id {call_id:?}, which was not sent to this guard")]
    UnknownCall { call_id: String },
    /// A second verdict for the same call.
    #[error("second verdict for call {call_id:?} ignored")]
    Second { call_id: String },
    /// A skip with missing or blank content.
    #[error("skip for call {call_id:?} has blank content; counted as proceed")]
    BlankSkip { call_id: String },
}

/// A guard's verdicts after the checks of R8 and R11.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Checked {
    /// (call index, skip); blank skips already dropped, unknown kinds steered.
    /// An ask (R35) is here too, as a cancel: it fixes its call as a skip.
    pub skips: Vec<(usize, Skip)>,
    /// (call index, reason) of the asks among `skips` (R35), on calls.
    pub asks: Vec<(usize, String)>,
    /// (call index, the call as rewritten).
    pub rewrites: Vec<(usize, ToolCall)>,
    /// Call indices answered with a plain proceed (or a rewrite that changes
    /// nothing).
    pub proceeds: Vec<usize>,
    /// Verdicts dropped (R8).
    pub malformed: Vec<Malformed>,
    /// Session labels the verdicts add (R34), each within the label
    /// grammar, at most [`MAX_LABELS_PER_VERDICT`] per verdict; only of
    /// verdicts that count (for a call the guard was sent, its first).
    pub labels: Vec<String>,
    /// Labels refused: outside the grammar, past the per-verdict bound, or
    /// on a verdict that was dropped.
    pub refused_labels: usize,
}

pub(crate) use crate::session::limits::{MAX_LABEL_BYTES, MAX_LABELS_PER_VERDICT};

/// Checks `verdicts` from `guard`, which was sent the calls at `sent`;
/// `current(i)` is call `i` as the guard saw it. `answered` tracks calls
/// already answered by this guard (R8: a second verdict is ignored). A
/// rewrite outside the grant rejects the whole answer (R11). With
/// `results`, the calls are results (R33), and a rewrite is held to the
/// guard's result grant, may not rename, and must leave a
/// `CallToolResult` (R11).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_verdicts_in<'c>(
    results: bool,
    guard: &Guard,
    limits: &validate::Limits,
    current: impl Fn(usize) -> &'c ToolCall,
    index_of: &CallIndex,
    sent: &[bool],
    answered: &mut [bool],
    verdicts: Vec<Verdict>,
) -> Result<Checked, Rejection> {
    let mut checked = Checked::default();
    for mut verdict in verdicts {
        let index = index_of
            .get(&verdict.call_id, |i| current(i).call_id.as_str())
            .filter(|&i| sent[i]);
        if !verdict.labels.is_empty() {
            let labels = std::mem::take(&mut verdict.labels);
            if index.is_some_and(|i| !answered[i]) {
                for (n, label) in labels.into_iter().enumerate() {
                    if n < MAX_LABELS_PER_VERDICT
                        && crate::session::memory::label_ok(&label, MAX_LABEL_BYTES)
                    {
                        if !checked.labels.contains(&label) {
                            checked.labels.push(label);
                        }
                    } else {
                        checked.refused_labels += 1;
                    }
                }
            } else {
                checked.refused_labels += labels.len();
            }
        }
        match (verdict.outcome, index) {
            (Some(Outcome::Rewrite(_)), None) => {
                return Err(Rejection::UnknownCall {
                    call_id: clip(&verdict.call_id, SHOWN_CHARS),
                });
            }
            (_, None) => checked.malformed.push(Malformed::UnknownCall {
                call_id: clip(&verdict.call_id, SHOWN_CHARS),
            }),
            (_, Some(i)) if answered[i] => {
                checked.malformed.push(Malformed::Second {
                    call_id: verdict.call_id,
                });
            }
            (None, Some(i)) => {
                answered[i] = true;
                checked.proceeds.push(i);
            }
            (Some(Outcome::Skip(skip)), Some(i)) => {
                answered[i] = true;
                if skip.content.trim().is_empty() {
                    checked.malformed.push(Malformed::BlankSkip {
                        call_id: verdict.call_id,
                    });
                    checked.proceeds.push(i);
                } else if SkipKind::try_from(skip.kind).is_err() {
                    // An unknown kind from a newer guard: the skip stands, as
                    // the safer reading, and is steered (R7's default).
                    checked.skips.push((
                        i,
                        Skip {
                            content: skip.content,
                            kind: SkipKind::Steer as i32,
                        },
                    ));
                } else {
                    checked.skips.push((i, skip));
                }
            }
            (Some(Outcome::Ask(ask)), Some(i)) => {
                answered[i] = true;
                // R35: never a proceed. It orders as a skip (R3); on a
                // result it blocks it (R33).
                let content = if ask.content.trim().is_empty() {
                    crate::approval::waiting_content(&guard.name)
                } else {
                    ask.content
                };
                if !results {
                    checked
                        .asks
                        .push((i, crate::approval::record::clip(&ask.reason)));
                }
                checked.skips.push((
                    i,
                    Skip {
                        content,
                        kind: SkipKind::Cancel as i32,
                    },
                ));
            }
            (Some(Outcome::Rewrite(rewrite)), Some(i)) => {
                answered[i] = true;
                let call = current(i);
                let next = check_rewrite(guard, limits, call, rewrite, results)?;
                if next == *call {
                    checked.proceeds.push(i);
                } else {
                    checked.rewrites.push((i, next));
                }
            }
        }
    }
    Ok(checked)
}

/// `call` as `guard`'s rewrite leaves it, in the phase of calls or, with
/// `results`, of results (`call`: the result as a call), if the guard is a
/// mutate guard whose grant for that phase holds the tool (R11, R33).
fn check_rewrite(
    guard: &Guard,
    limits: &validate::Limits,
    call: &ToolCall,
    rewrite: guardmesh_proto::v1::Rewrite,
    results: bool,
) -> Result<ToolCall, Rejection> {
    if guard.role != GuardRole::Mutate {
        return Err(Rejection::NotMutate {
            call_id: call.call_id.clone(),
        });
    }
    let grant = if results {
        &guard.result_grant_tools
    } else {
        &guard.grant_tools
    };
    if !grant.matches(&call.tool) {
        let (call_id, tool) = (call.call_id.clone(), call.tool.clone());
        return Err(if results {
            Rejection::ResultNotGranted { call_id, tool }
        } else {
            Rejection::ToolNotGranted { call_id, tool }
        });
    }
    if results {
        rewritten_result(limits, call, rewrite)
    } else {
        rewritten_call(guard, limits, call, rewrite)
    }
}

/// A result as a granted rewrite leaves it: no rename, the new result an
/// I-JSON `CallToolResult` object.
fn rewritten_result(
    limits: &validate::Limits,
    call: &ToolCall,
    rewrite: guardmesh_proto::v1::Rewrite,
) -> Result<ToolCall, Rejection> {
    if let Some(tool) = &rewrite.tool
        && *tool != call.tool
    {
        return Err(Rejection::RenameNotGranted {
            call_id: call.call_id.clone(),
            from: call.tool.clone(),
            to: clip(tool, SHOWN_CHARS),
        });
    }
    let Some(result) = rewrite.arguments else {
        return Ok(call.clone());
    };
    if result.len() > limits.max_result_bytes {
        return Err(Rejection::ResultRefused {
            call_id: call.call_id.clone(),
            why: format!(
                "{} bytes, over limits.max_result_bytes ({})",
                result.len(),
                limits.max_result_bytes
            ),
        });
    }
    if let Err(why) = validate::ijson::check(&result, limits.max_json_depth) {
        return Err(Rejection::ResultRefused {
            call_id: call.call_id.clone(),
            why: why.to_string(),
        });
    }
    if let Err(why) = crate::admit::result_batch::check_shape(&result) {
        return Err(Rejection::ResultRefused {
            call_id: call.call_id.clone(),
            why: format!("the new result {why}"),
        });
    }
    let mut next = call.clone();
    next.arguments = result;
    Ok(next)
}

/// A call as a granted rewrite leaves it (R11): a rename only when the
/// guard may rename, to a tool within its grant and the tool-name grammar;
/// new arguments an I-JSON object.
fn rewritten_call(
    guard: &Guard,
    limits: &validate::Limits,
    call: &ToolCall,
    rewrite: guardmesh_proto::v1::Rewrite,
) -> Result<ToolCall, Rejection> {
    let mut next = call.clone();
    if let Some(tool) = rewrite.tool
        && tool != call.tool
    {
        if !guard.may_rename {
            return Err(Rejection::RenameNotGranted {
                call_id: call.call_id.clone(),
                from: call.tool.clone(),
                to: clip(&tool, SHOWN_CHARS),
            });
        }
        if tool.trim().is_empty() || !guard.grant_tools.matches(&tool) {
            return Err(Rejection::RenameOutsideGrant {
                call_id: call.call_id.clone(),
                from: call.tool.clone(),
                to: clip(&tool, SHOWN_CHARS),
            });
        }
        if let Err(bad) = limits.tool_names.check(&tool) {
            return Err(Rejection::RenameOutsideGrammar {
                call_id: call.call_id.clone(),
                from: call.tool.clone(),
                to: clip(&tool, SHOWN_CHARS),
                why: bad.to_string(),
            });
        }
        next.tool = tool;
    }
    if let Some(arguments) = rewrite.arguments {
        if arguments.trim().is_empty() {
            return Err(Rejection::ArgumentsNotObject {
                call_id: call.call_id.clone(),
            });
        }
        if let Err(why) = validate::ijson::check(&arguments, limits.max_json_depth) {
            // An object a lenient reader takes is refused for what the gate
            // refuses in it; anything else is not an object at all.
            let object =
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&arguments)
                    .is_ok();
            let call_id = call.call_id.clone();
            return Err(if object {
                Rejection::ArgumentsRefused {
                    call_id,
                    why: why.to_string(),
                }
            } else {
                Rejection::ArgumentsNotObject { call_id }
            });
        }
        next.arguments = arguments;
    }
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_proto::v1::{GuardSpec, Rewrite, RewriteGrant};
    use std::time::Duration;

    fn guard(role: GuardRole, grant: &[&str], may_rename: bool) -> Guard {
        let spec = GuardSpec {
            name: "g".into(),
            endpoint: "127.0.0.1:9".into(),
            role: role as i32,
            grant: Some(RewriteGrant {
                tools: grant.iter().map(|t| (*t).to_owned()).collect(),
                may_rename,
            }),
            ..Default::default()
        };
        Guard::from_spec(&spec, Duration::from_secs(1)).unwrap()
    }

    fn calls() -> Vec<ToolCall> {
        ["fs.write", "fs.read", "shell.run"]
            .iter()
            .enumerate()
            .map(|(i, tool)| ToolCall {
                call_id: format!("c{i}"),
                tool: (*tool).to_owned(),
                arguments: "{}".into(),
            })
            .collect()
    }

    fn verdict(call_id: &str, outcome: Option<Outcome>) -> Verdict {
        Verdict {
            labels: Vec::new(),
            call_id: call_id.into(),
            outcome,
        }
    }

    fn skip(content: &str, kind: i32) -> Option<Outcome> {
        Some(Outcome::Skip(Skip {
            content: content.into(),
            kind,
        }))
    }

    fn rewrite(tool: Option<&str>, arguments: Option<&str>) -> Option<Outcome> {
        Some(Outcome::Rewrite(Rewrite {
            tool: tool.map(str::to_owned),
            arguments: arguments.map(str::to_owned),
        }))
    }

    /// Checks `verdicts` from `guard`, which was sent calls c0 and c1 (not c2).
    fn check(guard: &Guard, verdicts: Vec<Verdict>) -> (Result<Checked, Rejection>, Vec<bool>) {
        let calls = calls();
        let index_of = CallIndex::new(calls.len(), |i| calls[i].call_id.as_str());
        let mut answered = vec![false; 3];
        let result = check_verdicts_in(
            false,
            guard,
            &validate::Limits::default(),
            |i| &calls[i],
            &index_of,
            &[true, true, false],
            &mut answered,
            verdicts,
        );
        (result, answered)
    }

    /// R11, R20: a rewrite may not make run what the gate would refuse from
    /// a client: a tool name outside the grammar, or arguments with member
    /// names equal under case folding (validate guards and a Go tool would
    /// read them differently). Rejected whole, like any rewrite R11 rejects.
    #[test]
    fn r11_r20_a_rewrite_is_held_to_the_gate_s_checks() {
        let g = guard(GuardRole::Mutate, &["fs.*"], true);
        for (tool, arguments, expected) in [
            (
                Some("fs.\u{200b}write"),
                None,
                "outside the tool-name grammar",
            ),
            (Some("fs. write"), None, "outside the tool-name grammar"),
            (
                None,
                Some(r#"{"path":"/tmp/ok","PATH":"/etc/shadow"}"#),
                "refused as the gate refuses them",
            ),
            (
                None,
                Some(r#"{"a":{"s":1,"\u017f":2}}"#),
                "refused as the gate refuses them",
            ),
        ] {
            let (result, _) = check(&g, vec![verdict("c0", rewrite(tool, arguments))]);
            let Err(rejection) = result else {
                panic!("rewrite {tool:?} {arguments:?} was accepted");
            };
            assert!(
                rejection.to_string().contains(expected),
                "{rejection} should say {expected:?}"
            );
        }
        // Within the grammar and I-JSON, the same guard's rewrite applies.
        let (result, _) = check(
            &g,
            vec![verdict(
                "c0",
                rewrite(Some("fs.write_all"), Some(r#"{"path":"/tmp/ok"}"#)),
            )],
        );
        assert_eq!(result.map(|c| c.rewrites.len()).ok(), Some(1));
    }

    #[test]
    fn r8_unknown_second_and_blank_verdicts_are_dropped() {
        let g = guard(GuardRole::Validate, &[], false);
        let (checked, answered) = check(
            &g,
            vec![
                verdict("c0", skip("  ", SkipKind::Cancel as i32)),
                verdict("c0", skip("again", SkipKind::Cancel as i32)),
                verdict("c2", skip("not sent", 0)),
                verdict("nope", None),
                verdict("c1", None),
            ],
        );
        let checked = checked.unwrap();
        assert_eq!(
            checked.malformed,
            vec![
                Malformed::BlankSkip {
                    call_id: "c0".into()
                },
                Malformed::Second {
                    call_id: "c0".into()
                },
                Malformed::UnknownCall {
                    call_id: "c2".into()
                },
                Malformed::UnknownCall {
                    call_id: "nope".into()
                },
            ]
        );
        assert_eq!(
            checked.proceeds,
            vec![0, 1],
            "a blank skip counts as proceed"
        );
        assert!(checked.skips.is_empty());
        assert_eq!(answered, vec![true, true, false]);
        assert!(
            Malformed::BlankSkip {
                call_id: "c0".into()
            }
            .to_string()
            .contains("blank content")
        );
    }

    #[test]
    fn r7_unknown_skip_kind_stands_as_steer() {
        let g = guard(GuardRole::Validate, &[], false);
        let (checked, _) = check(
            &g,
            vec![
                verdict("c0", skip("no", 99)),
                verdict("c1", skip("stop", SkipKind::Cancel as i32)),
            ],
        );
        let skips = checked.unwrap().skips;
        assert_eq!(skips[0].1.kind, SkipKind::Steer as i32);
        assert_eq!(skips[1].1.kind, SkipKind::Cancel as i32);
    }

    #[test]
    fn r11_rewrite_within_grant_is_checked_whole() {
        let g = guard(GuardRole::Mutate, &["fs.*"], true);
        let (checked, _) = check(
            &g,
            vec![
                verdict("c0", rewrite(Some("fs.append"), Some(r#"{"a":1}"#))),
                // A rewrite that changes nothing is a proceed.
                verdict("c1", rewrite(Some("fs.read"), None)),
            ],
        );
        let checked = checked.unwrap();
        assert_eq!(checked.rewrites.len(), 1);
        let (i, call) = &checked.rewrites[0];
        assert_eq!(*i, 0);
        assert_eq!(call.tool, "fs.append");
        assert_eq!(call.arguments, r#"{"a":1}"#);
        assert_eq!(call.call_id, "c0", "a rewrite never changes the call id");
        assert_eq!(checked.proceeds, vec![1]);
    }

    #[test]
    fn r11_each_rejection_has_its_kind() {
        let mutate = guard(GuardRole::Mutate, &["fs.*"], true);
        let no_rename = guard(GuardRole::Mutate, &["fs.*"], false);
        let validate = guard(GuardRole::Validate, &[], false);
        let narrow = guard(GuardRole::Mutate, &["fs.write"], true);
        let cases: Vec<(&Guard, Verdict, Rejection)> = vec![
            (
                &mutate,
                verdict("c2", rewrite(None, Some("{}"))),
                Rejection::UnknownCall {
                    call_id: "c2".into(),
                },
            ),
            (
                &validate,
                verdict("c0", rewrite(None, Some("{}"))),
                Rejection::NotMutate {
                    call_id: "c0".into(),
                },
            ),
            (
                &narrow,
                verdict("c1", rewrite(None, Some("{}"))),
                Rejection::ToolNotGranted {
                    call_id: "c1".into(),
                    tool: "fs.read".into(),
                },
            ),
            (
                &no_rename,
                verdict("c0", rewrite(Some("fs.append"), None)),
                Rejection::RenameNotGranted {
                    call_id: "c0".into(),
                    from: "fs.write".into(),
                    to: "fs.append".into(),
                },
            ),
            (
                &mutate,
                verdict("c0", rewrite(Some("shell.run"), None)),
                Rejection::RenameOutsideGrant {
                    call_id: "c0".into(),
                    from: "fs.write".into(),
                    to: "shell.run".into(),
                },
            ),
            (
                &mutate,
                verdict("c0", rewrite(Some(" "), None)),
                Rejection::RenameOutsideGrant {
                    call_id: "c0".into(),
                    from: "fs.write".into(),
                    to: " ".into(),
                },
            ),
            (
                &mutate,
                verdict("c0", rewrite(None, Some("[1, 2]"))),
                Rejection::ArgumentsNotObject {
                    call_id: "c0".into(),
                },
            ),
            (
                &mutate,
                verdict("c0", rewrite(None, Some(""))),
                Rejection::ArgumentsNotObject {
                    call_id: "c0".into(),
                },
            ),
        ];
        for (g, v, want) in cases {
            // A rejection rejects the whole answer, whatever came before it.
            let other = if v.call_id == "c1" { "c0" } else { "c1" };
            let (got, _) = check(g, vec![verdict(other, skip("no", 0)), v]);
            assert_eq!(got.unwrap_err(), want);
        }
    }

    #[test]
    fn r11_rejection_messages_name_the_reason() {
        let messages = [
            (
                Rejection::ToolNotGranted {
                    call_id: "c".into(),
                    tool: "fs.read".into(),
                }
                .to_string(),
                "grant does not cover tool \"fs.read\"",
            ),
            (
                Rejection::RenameNotGranted {
                    call_id: "c".into(),
                    from: "a".into(),
                    to: "b".into(),
                }
                .to_string(),
                "without the rename grant",
            ),
            (
                Rejection::ArgumentsNotObject {
                    call_id: "c".into(),
                }
                .to_string(),
                "not a JSON object",
            ),
            (
                Rejection::NotMutate {
                    call_id: "c".into(),
                }
                .to_string(),
                "only mutate guards may rewrite",
            ),
        ];
        for (message, needle) in messages {
            assert!(message.contains(needle), "{message}");
        }
    }

    #[test]
    fn guard_supplied_text_is_clipped_in_messages() {
        let g = guard(GuardRole::Mutate, &["fs.*"], false);
        let long = "x".repeat(10_000);
        let (got, _) = check(&g, vec![verdict(&long, rewrite(None, Some("{}")))]);
        assert!(got.unwrap_err().to_string().len() < 200);
        let (got, _) = check(&g, vec![verdict("c0", rewrite(Some(&long), None))]);
        assert!(got.unwrap_err().to_string().len() < 300);
    }
}
