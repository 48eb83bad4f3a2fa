//! `guardmesh config check`: every error of a config file, each with its
//! line, its key and what to write instead, without starting a mesh. Also
//! reads the files the config names (policy files, certificates, keys,
//! tokens) as the mesh would at start.

use super::keys::{self, KeyError};
use super::{Config, SettingError};
use std::path::{Path, PathBuf};
use toml::de::{DeTable, DeValue};

/// Whether a finding makes the file invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Error,
    /// Accepted, but probably not meant (printed at start too).
    Warning,
}

/// One thing `config check` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub severity: Severity,
    /// 1-based line, where the finding has one.
    pub line: Option<usize>,
    /// The key, with `[[...]]` entries numbered from 1: `guard[2].policy`;
    /// empty for the file as a whole.
    pub key: String,
    pub message: String,
    /// What to write instead (empty for warnings that need nothing).
    pub fix: String,
}

/// The config file could not be read at all.
#[derive(Debug, thiserror::Error)]
#[error("cannot read config file {}: {source}", path.display())]
pub struct Unreadable {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Checks the config file at `path`; relative paths in it are relative to
/// its folder, as when the mesh loads it.
pub fn check_file(path: &Path) -> Result<Vec<Finding>, Unreadable> {
    let text = crate::files::read_to_string(path, crate::files::MAX_CONFIG_FILE_BYTES).map_err(
        |source| Unreadable {
            path: path.to_owned(),
            source,
        },
    )?;
    Ok(check_text(&text, Config::folder_of(path)))
}

/// Every finding of a config's `text`, whose relative paths are relative to
/// `folder`: syntax errors (as many as the parser recovers from), then
/// unknown keys and wrong types, then settings that cannot work, then the
/// files it names; errors first, each group in line order.
pub fn check_text(text: &str, folder: &Path) -> Vec<Finding> {
    let key_errors = keys::walk(text);
    if !key_errors.is_empty() {
        return key_errors.iter().map(from_key_error).collect();
    }
    let mut config: Config = match toml::from_str(text) {
        Ok(config) => config,
        Err(error) => {
            // Not expected once the walk passes (the walk and serde read
            // the same keys); a value out of range (a negative size) is
            // one way.
            return vec![Finding {
                severity: Severity::Error,
                line: error.span().map(|s| keys::line_of(text, s.start)),
                key: String::new(),
                message: error.message().trim().to_owned(),
                fix: "write a value of the type the reference gives for this key".into(),
            }];
        }
    };
    let document = DeTable::parse(text).ok();
    let locate = |key: &str, index: Option<usize>| {
        document
            .as_ref()
            .and_then(|d| locate(text, d.get_ref(), key, index))
    };
    let mut findings: Vec<Finding> = config
        .problems()
        .iter()
        .map(|problem| from_setting(problem, &locate))
        .collect();
    config.resolve_paths(folder);
    findings.extend(check_files(&mut config, &locate));
    if findings.is_empty() {
        findings.extend(check_assembly(&config, &locate));
    }
    if findings.is_empty() {
        let warnings = config
            .insecure_settings()
            .into_iter()
            .chain(config.guard_warnings());
        findings.extend(warnings.map(|message| Finding {
            severity: Severity::Warning,
            line: None,
            key: String::new(),
            message,
            fix: String::new(),
        }));
    }
    findings.sort_by_key(|f| {
        (
            f.severity == Severity::Warning,
            f.line.unwrap_or(usize::MAX),
        )
    });
    findings
}

fn from_key_error(error: &KeyError) -> Finding {
    let at = error.at();
    let message = error.to_string();
    // The message starts with "line N: key: " (see `At`); keep the rest.
    let message = message
        .strip_prefix(&format!("{at}: "))
        .unwrap_or(&message)
        .to_owned();
    Finding {
        severity: Severity::Error,
        line: Some(at.line),
        key: at.key.clone(),
        message,
        fix: error.fix(),
    }
}

fn numbered(key: &str, index: Option<usize>) -> String {
    match (index, key.split_once('.')) {
        (Some(i), Some((table, rest))) => format!("{table}[{i}].{rest}"),
        (Some(i), None) => format!("{key}[{i}]"),
        (None, _) => key.to_owned(),
    }
}

fn from_setting(
    problem: &SettingError,
    locate: &dyn Fn(&str, Option<usize>) -> Option<usize>,
) -> Finding {
    let (key, index) = problem.key();
    Finding {
        severity: Severity::Error,
        line: locate(&key, index),
        key: numbered(&key, index),
        message: problem.to_string(),
        fix: problem.fix(),
    }
}

/// The line of `key` (a reference path) in the `index`-th entry of its
/// list of tables; the line of its table when the key is not written.
fn locate(text: &str, document: &DeTable<'_>, key: &str, index: Option<usize>) -> Option<usize> {
    let mut table = document;
    let mut best = None;
    let mut segments = key.split('.').peekable();
    while let Some(segment) = segments.next() {
        let Some((name, value)) = table.iter().find(|(k, _)| k.get_ref() == segment) else {
            return best;
        };
        best = Some(keys::line_of(text, name.span().start));
        if segments.peek().is_none() {
            return best;
        }
        table = match value.get_ref() {
            DeValue::Table(inner) => inner,
            DeValue::Array(items) => {
                let item = items.get(index?.checked_sub(1)?)?;
                best = Some(keys::line_of(text, item.span().start));
                match item.get_ref() {
                    DeValue::Table(inner) => inner,
                    _ => return best,
                }
            }
            _ => return best,
        };
        if let Some(first) = table.iter().map(|(k, _)| k.span().start).min() {
            best = Some(keys::line_of(text, first));
        }
    }
    best
}

/// Reads every file the config names, as the mesh would at start.
fn check_files(
    config: &mut Config,
    locate: &dyn Fn(&str, Option<usize>) -> Option<usize>,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut error = |key: &str, index: Option<usize>, message: String, fix: String| {
        out.push(Finding {
            severity: Severity::Error,
            line: locate(key, index),
            key: numbered(key, index),
            message,
            fix,
        });
    };
    let file_fix = |what: &str| {
        format!(
            "point it at a readable {what} (relative paths are relative to the config file's folder)"
        )
    };
    for (i, guard) in config.guards.iter_mut().enumerate() {
        let Some(file) = &guard.policy else { continue };
        let index = Some(i + 1);
        match crate::files::read_to_string(file, crate::files::MAX_POLICY_FILE_BYTES) {
            Err(e) => error(
                "guard.policy",
                index,
                format!("cannot read policy file {}: {e}", file.display()),
                file_fix("policy file (CEL rules, R27)"),
            ),
            Ok(source) => match crate::policy::Policy::compile(&source) {
                Err(e) => error(
                    "guard.policy",
                    index,
                    format!("policy file {}: {e}", file.display()),
                    "fix the policy file (`guardmesh policy check FILE` shows its rules)".into(),
                ),
                Ok(_) => guard.policy_source = Some(source),
            },
        }
    }
    let certs = |path: &Path| crate::security::tls::load_certs(path).map(|_| ());
    let key = |path: &Path| crate::security::tls::load_key(path).map(|_| ());
    let mut pem = |name: &str, path: Option<&PathBuf>, certificate: bool| {
        let Some(path) = path else { return };
        let result = if certificate { certs(path) } else { key(path) };
        if let Err(e) = result {
            let what = if certificate {
                "PEM certificate file"
            } else {
                "PEM private key file"
            };
            error(name, None, e.to_string(), file_fix(what));
        }
    };
    if let Some(tls) = &config.tls {
        pem("tls.cert_file", Some(&tls.cert_file), true);
        pem("tls.key_file", Some(&tls.key_file), false);
        pem("tls.client_ca_file", tls.client_ca_file.as_ref(), true);
    }
    if let Some(guard_tls) = &config.guard_tls {
        pem("guard_tls.ca_file", Some(&guard_tls.ca_file), true);
        pem("guard_tls.cert_file", guard_tls.cert_file.as_ref(), true);
        pem("guard_tls.key_file", guard_tls.key_file.as_ref(), false);
    }
    pem("registry.ca_file", config.registry.ca_file.as_ref(), true);
    pem(
        "registry.cert_file",
        config.registry.cert_file.as_ref(),
        true,
    );
    pem(
        "registry.key_file",
        config.registry.key_file.as_ref(),
        false,
    );
    if let Some(auth) = &config.auth {
        for (i, principal) in auth.principals.iter().enumerate() {
            let Some(file) = &principal.token_file else {
                continue;
            };
            let index = Some(i + 1);
            match crate::files::read_to_string(file, crate::files::MAX_SECRET_FILE_BYTES) {
                Err(e) => error(
                    "auth.principal.token_file",
                    index,
                    format!("cannot read token file {}: {e}", file.display()),
                    file_fix("file holding the principal's token"),
                ),
                Ok(text) if text.trim().is_empty() => error(
                    "auth.principal.token_file",
                    index,
                    format!("token file {} is empty", file.display()),
                    "write the principal's bearer token on the file's one line".into(),
                ),
                Ok(_) => {}
            }
        }
    }
    if let Some(log) = &config.decision_log
        && let Some(key) = &log.signing_key
        && let Err(e) = crate::decision_log::checkpoint::read_signing_key(key)
    {
        error(
            "decision_log.signing_key",
            None,
            e.to_string(),
            "point it at a key written by `guardmesh log keygen --out FILE`".into(),
        );
    }
    // R34: where session memory is kept, and the secret replicas share.
    match config.sessions.place(&config.registry) {
        Err(e) => {
            let fix = match e {
                super::SessionsSettingError::NoSecret { .. } => format!(
                    "write secret_file = \"FILE\" under [sessions]: {}",
                    crate::session::secret::HOW_TO_CREATE
                ),
                _ => "fix the [sessions] section as the message says".into(),
            };
            error(e.key(), None, e.to_string(), fix);
        }
        Ok(_) => {
            if let Some(path) = &config.sessions.secret_file
                && let Err(e) = crate::session::secret::read_secret(path)
            {
                error(
                    "sessions.secret_file",
                    None,
                    e.to_string(),
                    crate::session::secret::HOW_TO_CREATE.into(),
                );
            }
            if let Some(path) = &config.sessions.redis_password_file {
                match crate::files::read_to_string(path, crate::files::MAX_SECRET_FILE_BYTES) {
                    Err(e) => error(
                        "sessions.redis_password_file",
                        None,
                        format!("cannot read {}: {e}", path.display()),
                        file_fix("file holding Redis's password"),
                    ),
                    Ok(text) if text.trim_end_matches(['\r', '\n']).is_empty() => error(
                        "sessions.redis_password_file",
                        None,
                        format!("{} is empty", path.display()),
                        "write Redis's password on the file's one line".into(),
                    ),
                    Ok(_) => {}
                }
            }
        }
    }
    out
}

/// What only the assembled settings show: the listener's certificate and
/// key together, the endpoint policy, each `[[guard]]` admitted as a
/// `Register` call is, the etcd settings. The first error only.
fn check_assembly(
    config: &Config,
    locate: &dyn Fn(&str, Option<usize>) -> Option<usize>,
) -> Vec<Finding> {
    use super::SecurityError;
    let finding = |key: &str, index: Option<usize>, message: String, fix: &str| Finding {
        severity: Severity::Error,
        line: locate(key, index),
        key: numbered(key, index),
        message,
        fix: fix.to_owned(),
    };
    let mut out = Vec::new();
    if let Err(error) = config.build_with_guards() {
        let message = error.to_string();
        out.push(match &error {
            SecurityError::Tls(_) => finding(
                "tls",
                None,
                message,
                "use a certificate and the key it was issued for",
            ),
            SecurityError::Policy(_) => finding(
                "endpoint_policy.allow",
                None,
                message,
                "write CIDRs (\"10.0.0.0/8\"), addresses or host names (\"*.guards.svc\")",
            ),
            SecurityError::Token { .. } | SecurityError::EmptyToken(_) => finding(
                "auth.principal",
                None,
                message,
                "point token_file at a file holding the token",
            ),
            SecurityError::Guard { index, .. } | SecurityError::GuardInterrupted { index, .. } => {
                finding(
                    "guard.name",
                    Some(*index),
                    message,
                    "fix the entry as the message says",
                )
            }
            SecurityError::GuardEndpoint { index, .. } => finding(
                "guard.endpoint",
                Some(*index),
                message,
                "point it at an address the endpoint policy allows, or add it to [endpoint_policy] allow",
            ),
        });
    }
    if config.registry.kind == super::RegistryKind::Etcd
        && let Err(error) = config.registry.etcd()
    {
        out.push(finding(
            "registry.password_env",
            None,
            error.to_string(),
            "set the variable, or write only one of password and password_env",
        ));
    }
    out
}
