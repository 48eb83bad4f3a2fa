//! `[[guard]]`: the guards registered at start, in file order (R16).

use super::describe::table;
use super::{Config, PolicyFileError, SecurityError, SettingError};
use crate::mesh::MeshConfig;
use guardmesh_proto::v1::{FailurePolicy, GuardMode, GuardRole, GuardSpec, RewriteGrant};
use serde::Deserialize;
use std::path::Path;
use std::time::Duration;

table! {
    /// `[[guard]]`: one registration (R16).
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct GuardConfig {
        /// Unique name of the guard.
        pub name: String,
        // Empty is the same as left out: the reference says unset.
        /// A remote guard's address (`http://host:port`, `https://...`);
        /// exactly one of endpoint and policy.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pub endpoint: String,
        /// The guard's replicas (R32), each an address as endpoint takes; each
        /// request goes to one, chosen by load. With endpoint, one more each;
        /// at most 64.
        #[serde(default)]
        pub replicas: Vec<String>,
        // Relative to the config file's folder.
        /// A policy guard's file of CEL rules (R27); exactly one of endpoint
        /// and policy.
        #[serde(default)]
        pub policy: Option<std::path::PathBuf>,
        // The policy file's text, read by `Config::load`.
        #[serde(skip)]
        pub policy_source: Option<String>,
        /// A validate guard answers verdicts; a mutate guard may also rewrite
        /// calls within its grant.
        #[serde(default, deserialize_with = "by_name")]
        pub role: GuardRole,
        /// Globs of the tools the guard is sent; empty: every tool.
        #[serde(default)]
        pub tools: Vec<String>,
        /// The guard's deadline, in milliseconds; 0: default_guard_timeout_ms.
        #[serde(default)]
        pub timeout_ms: u32,
        /// What a failure of the guard means for its calls (R13).
        #[serde(default, deserialize_with = "by_name")]
        pub failure_policy: FailurePolicy,
        /// What a call the guard asked about gets when its approval request
        /// expires unanswered (R35): `cancel` (the default) or `steer`.
        #[serde(default, deserialize_with = "by_name")]
        pub ask_fallback: guardmesh_proto::v1::AskFallback,
        /// Place in the chain: lower first; equal priorities keep
        /// registration order.
        #[serde(default)]
        pub priority: i32,
        /// `dry_run`: the guard is consulted and traced, its verdict not
        /// applied.
        #[serde(default, deserialize_with = "by_name")]
        pub mode: GuardMode,
        /// For `https://` endpoints: the identity (URI SAN or name) the guard
        /// must present.
        #[serde(default)]
        pub server_identity: Option<String>,
        /// For a mutate guard: what it may rewrite.
        #[serde(default)]
        pub grant: Option<GrantConfig>,
        /// What the guard judges (R33): calls before they run, results before
        /// the model reads them, or both.
        #[serde(default, deserialize_with = "by_name")]
        pub phases: guardmesh_proto::v1::GuardPhases,
        // R11, R33.
        /// For a mutate guard judging results: which results it may rewrite
        /// (R11).
        #[serde(default)]
        pub result_grant: Option<ResultGrantConfig>,
        /// Whether the guard reads its batch's session memory (R34): `read`
        /// sends it with each batch the guard judges; `none` (or leaving it
        /// out) sends none, and the guard pays nothing for it.
        #[serde(default, deserialize_with = "by_name")]
        pub session_memory: guardmesh_proto::v1::SessionMemoryUse,
    }
}

table! {
    /// `[guard.result_grant]`: the results a mutate guard may rewrite.
    #[derive(Debug, Clone, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct ResultGrantConfig {
        /// Globs of the tools whose results it may rewrite.
        #[serde(default)]
        pub tools: Vec<String>,
    }
}

/// Reads an enum of the contract by its one spelling (`fail_closed`,
/// `dry_run`, ...), see `guardmesh_proto`'s names.
fn by_name<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr<Err = guardmesh_proto::UnknownName>,
{
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(serde::de::Error::custom)
}

table! {
    /// `[guard.grant]`: the calls a mutate guard may rewrite.
    #[derive(Debug, Clone, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct GrantConfig {
        /// Globs of the tools whose calls it may rewrite.
        #[serde(default)]
        pub tools: Vec<String>,
        /// It may change a call's tool name.
        #[serde(default)]
        pub may_rename: bool,
    }
}

impl GuardConfig {
    pub fn to_spec(&self) -> GuardSpec {
        GuardSpec {
            name: self.name.clone(),
            endpoint: self.endpoint.clone(),
            role: self.role as i32,
            tools: self.tools.clone(),
            timeout_ms: self.timeout_ms,
            failure_policy: self.failure_policy as i32,
            ask_fallback: self.ask_fallback as i32,
            priority: self.priority,
            mode: self.mode as i32,
            grant: self.grant.as_ref().map(|g| RewriteGrant {
                tools: g.tools.clone(),
                may_rename: g.may_rename,
            }),
            server_identity: self.server_identity.clone().unwrap_or_default(),
            policy: self.policy_source.clone().unwrap_or_default(),
            replicas: self.replicas.clone(),
            phases: self.phases as i32,
            result_grant: self
                .result_grant
                .as_ref()
                .map(|g| guardmesh_proto::v1::ResultGrant {
                    tools: g.tools.clone(),
                }),
            // Registered over `GuardRegistry` only (SEP-2624 listing).
            interceptor_events: Vec::new(),
            session_memory: self.session_memory as i32,
        }
    }
}

/// The line of each `[[guard]]` entry's `name`, in file order (empty when
/// the text does not parse this way).
pub(super) fn guard_name_lines(text: &str) -> Vec<usize> {
    #[derive(Deserialize)]
    struct Names {
        #[serde(default, rename = "guard")]
        guards: Vec<Name>,
    }
    #[derive(Deserialize)]
    struct Name {
        name: toml::Spanned<String>,
    }
    toml::from_str::<Names>(text).map_or_else(
        |_| Vec::new(),
        |names| {
            names
                .guards
                .iter()
                .map(|g| text[..g.name.span().start].matches('\n').count() + 1)
                .collect()
        },
    )
}

impl Config {
    /// Every `[[guard]]` entry that is not exactly one of remote and policy.
    pub(super) fn guard_shapes(&self) -> Vec<SettingError> {
        self.guards
            .iter()
            .enumerate()
            .filter_map(|(i, guard)| {
                let endpoint = !guard.endpoint.trim().is_empty() || !guard.replicas.is_empty();
                let (index, name) = (i + 1, guard.name.clone());
                match (endpoint, guard.policy.is_some()) {
                    (true, true) => Some(SettingError::GuardBoth { index, name }),
                    (false, false) => Some(SettingError::GuardNeither { index, name }),
                    _ => None,
                }
            })
            .collect()
    }

    /// The first two `[[guard]]` entries (0-based) that share a name, as
    /// registration compares names (trimmed).
    pub fn duplicate_guard(&self) -> Option<(usize, usize)> {
        let mut seen = std::collections::HashMap::new();
        for (i, guard) in self.guards.iter().enumerate() {
            if let Some(first) = seen.insert(guard.name.trim(), i) {
                return Some((first, i));
            }
        }
        None
    }

    /// What is accepted but probably not meant, in the `[[guard]]` entries;
    /// printed as warnings at start.
    pub fn guard_warnings(&self) -> Vec<String> {
        let default = Duration::from_millis(self.default_guard_timeout_ms);
        self.guards
            .iter()
            .enumerate()
            // A policy guard is a validate guard, with none of these
            // warnings: its policy is not compiled here (admission does).
            .filter(|(_, g)| g.policy.is_none())
            .filter_map(|(i, g)| {
                let guard = crate::registry::spec::Guard::from_spec(&g.to_spec(), default).ok()?;
                Some(
                    guard
                        .warnings()
                        .into_iter()
                        .map(move |w| format!("[[guard]] entry {}: {w}", i + 1)),
                )
            })
            .flatten()
            .collect()
    }

    /// Reads the policy file of every policy guard (R27), relative to
    /// `folder`, and refuses one that does not compile, naming its line.
    pub fn read_policies(&mut self, folder: &Path) -> Result<(), PolicyFileError> {
        for (i, guard) in self.guards.iter_mut().enumerate() {
            let Some(file) = &guard.policy else { continue };
            // Resolved against the config's folder already
            // (`resolve_paths`): joined again only if it is still relative
            // to it, never twice.
            let file = if file.starts_with(folder) {
                file.clone()
            } else {
                folder.join(file)
            };
            let source = crate::files::read_to_string(&file, crate::files::MAX_POLICY_FILE_BYTES)
                .map_err(|source| PolicyFileError::Read {
                index: i + 1,
                name: guard.name.clone(),
                path: file.clone(),
                source,
            })?;
            crate::policy::Policy::compile(&source).map_err(|source| PolicyFileError::Compile {
                index: i + 1,
                name: guard.name.clone(),
                path: file.clone(),
                source: Box::new(source),
            })?;
            // R27: a rule naming a tool the guard is never sent is reported
            // (the file compiled just above: not compiled again).
            for never in
                crate::policy::never_sent_compiled(&source, &guard.tools).unwrap_or_default()
            {
                tracing::warn!(guard = %guard.name, file = %file.display(), "{never}");
            }
            guard.policy_source = Some(source);
        }
        Ok(())
    }

    /// [`build`](Self::build), and the `[[guard]]` entries admitted, in
    /// file order, for the registry: each checked once, by the admission a
    /// `Register` call goes through (R16).
    pub fn build_with_guards(
        &self,
    ) -> Result<(MeshConfig, Vec<crate::registry::CheckedGuard>), SecurityError> {
        let config = self.build_security()?;
        let admission = crate::registry::Admission::of(&config);
        let mut guards = Vec::with_capacity(self.guards.len());
        for (i, g) in self.guards.iter().enumerate() {
            let guard =
                crate::registry::admit_blocking(g.to_spec(), &admission).map_err(|error| {
                    match error {
                        crate::registry::AdmitError::Endpoint {
                            name,
                            endpoint,
                            why,
                        } => SecurityError::GuardEndpoint {
                            index: i + 1,
                            name,
                            endpoint,
                            why,
                        },
                        crate::registry::AdmitError::Invalid(source) => SecurityError::Guard {
                            index: i + 1,
                            name: g.name.clone(),
                            source: Box::new(source),
                        },
                        crate::registry::AdmitError::Interrupted => {
                            SecurityError::GuardInterrupted {
                                index: i + 1,
                                name: g.name.clone(),
                            }
                        }
                    }
                })?;
            guards.push(guard);
        }
        Ok((config, guards))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r16_config_guards_in_file_order() {
        let config = Config::parse(
            r#"
            listen = "127.0.0.1:0"
            [[guard]]
            name = "b"
            endpoint = "127.0.0.1:1"
            failure_policy = "abort"
            [[guard]]
            name = "a"
            endpoint = "127.0.0.1:2"
            role = "mutate"
            mode = "dry_run"
            grant = { tools = ["sql.*"], may_rename = true }
            "#,
            "test",
        )
        .unwrap();
        let names: Vec<_> = config.guards.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        let a = config.guards[1].to_spec();
        assert_eq!(a.role, GuardRole::Mutate as i32);
        assert_eq!(a.mode, GuardMode::DryRun as i32);
        assert!(a.grant.unwrap().may_rename);
        assert_eq!(
            config.guards[0].to_spec().failure_policy,
            FailurePolicy::Abort as i32
        );
    }

    #[test]
    fn r16_config_refuses_two_guards_of_one_name_naming_both() {
        let text = "listen = \"127.0.0.1:0\"\n\
            [[guard]]\nname = \"a\"\nendpoint = \"127.0.0.1:1\"\n\
            [[guard]]\nname = \"b\"\nendpoint = \"127.0.0.1:2\"\n\
            [[guard]]\nendpoint = \"127.0.0.1:3\"\nname = \" a\"\n";
        let err = Config::parse(text, "cfg.toml").unwrap_err().to_string();
        assert!(
            err.contains("cfg.toml")
                && err.contains("entries 1 (name at line 3) and 3 (name at line 10)")
                && err.contains("\"a\""),
            "{err}"
        );
        // Built another way, the check still refuses it (without lines).
        let mut config = Config::parse(&text.replace("\" a\"", "\"c\""), "t").unwrap();
        config.guards[2].name = "a".into();
        assert!(
            config
                .check()
                .unwrap_err()
                .to_string()
                .contains("entries 1 and 3")
        );
    }

    #[test]
    fn r11_config_warns_about_a_mutate_guard_with_an_empty_grant() {
        let config = Config::parse(
            r#"
            [[guard]]
            name = "no-grant"
            endpoint = "127.0.0.1:1"
            role = "mutate"
            [[guard]]
            name = "empty-grant"
            endpoint = "127.0.0.1:2"
            role = "mutate"
            grant = { tools = [], may_rename = true }
            [[guard]]
            name = "granted"
            endpoint = "127.0.0.1:3"
            role = "mutate"
            grant = { tools = ["sql.*"] }
            [[guard]]
            name = "validate"
            endpoint = "127.0.0.1:4"
            "#,
            "t",
        )
        .unwrap();
        let warnings = config.guard_warnings();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].contains("entry 1") && warnings[0].contains("no-grant"),
            "{warnings:?}"
        );
        assert!(warnings[1].contains("empty-grant") && warnings[1].contains("empty grant"));
    }

    #[test]
    fn r16_config_guard_endpoints_are_checked_against_the_policy_at_load() {
        let guard =
            |endpoint: &str| format!("[[guard]]\nname = \"g\"\nendpoint = \"{endpoint}\"\n");
        let err = Config::parse(&guard("http://169.254.169.254:80"), "t")
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("entry 1") && err.contains("169.254.169.254") && err.contains("policy"),
            "{err}"
        );
        let text = format!(
            "[endpoint_policy]\nallow = [\"10.0.0.0/8\"]\n{}",
            guard("127.0.0.1:1")
        );
        let err = Config::parse(&text, "t")
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains("allow-list"), "{err}");
        let err = Config::parse(&guard("http://0x7f.0.0.1:1"), "t")
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains("dotted-quad"), "{err}");
        assert!(
            Config::parse(&guard("127.0.0.1:1"), "t")
                .unwrap()
                .build()
                .is_ok()
        );
    }
}
