//! `guardmesh config check`: every error of a config file, each with its
//! line, its key and what to write instead, without starting a mesh. Also
//! reads the files the config names (policy files, certificates, keys,
//! tokens) as the mesh would at start.

use super::keys::{self, KeyError};
use super::{Config, SettingError};
use std::ops::Range;
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

/// Where `config check` reads the files a config names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Files {
    /// Where the mesh would: relative paths from the config's folder.
    #[default]
    AsWritten,
    /// Under this folder, as if it were the root of the file system the
    /// mesh runs on: `/etc/guardmesh/policy.toml` is read as
    /// `ROOT/etc/guardmesh/policy.toml` (a ConfigMap's files checked in
    /// CI). Relative paths stay relative to the config's folder.
    Root(PathBuf),
    /// Not read: the keys and values are checked, not the files nor what
    /// needs their contents (a certificate matching its key, a policy
    /// guard's rules).
    Skip,
}

/// Checks the config file at `path`; relative paths in it are relative to
/// its folder, as when the mesh loads it.
pub fn check_file(path: &Path) -> Result<Vec<Finding>, Unreadable> {
    check_file_with(path, &Files::AsWritten)
}

/// [`check_file`], reading the files the config names as `files` says.
pub fn check_file_with(path: &Path, files: &Files) -> Result<Vec<Finding>, Unreadable> {
    let text = crate::files::read_to_string(path, crate::files::MAX_CONFIG_FILE_BYTES).map_err(
        |source| Unreadable {
            path: path.to_owned(),
            source,
        },
    )?;
    Ok(check_text_with(&text, Config::folder_of(path), files))
}

/// Every finding of a config's `text`, whose relative paths are relative to
/// `folder`.
pub fn check_text(text: &str, folder: &Path) -> Vec<Finding> {
    check_text_with(text, folder, &Files::AsWritten)
}

/// The most values that do not read that one check reports one by one
/// (each costs a parse of the file).
const MAX_VALUE_ERRORS: usize = 64;

/// Every finding of a config's `text`, in one run: syntax errors (as many
/// as the parser recovers from), unknown keys and wrong types, values out
/// of range, settings that cannot work, and the files it names; errors
/// first, each group in line order. A key found wrong is left out of the
/// later checks (as if not written), so that one mistake does not hide
/// the others.
pub fn check_text_with(text: &str, folder: &Path, files: &Files) -> Vec<Finding> {
    let key_errors = keys::walk(text);
    let mut findings: Vec<Finding> = key_errors.iter().map(from_key_error).collect();
    if key_errors
        .iter()
        .any(|e| matches!(e, KeyError::Syntax { .. }))
    {
        return findings;
    }
    // The text without the entries found wrong, lines kept in place.
    let mut rest = text.to_owned();
    for error in &key_errors {
        if let Some(span) = entry_span(&rest, &error.at().key) {
            blank(&mut rest, span);
        }
    }
    let mut config = None;
    for _ in 0..MAX_VALUE_ERRORS {
        match toml::from_str::<Config>(&rest) {
            Ok(parsed) => {
                config = Some(parsed);
                break;
            }
            Err(error) => {
                let entry = error.span().and_then(|span| entry_at(&rest, span.start));
                let Some((key, span)) = entry else {
                    // Nothing to point at: said once, unless the errors
                    // already found explain it (a required key left out).
                    if findings.is_empty() {
                        findings.push(Finding {
                            severity: Severity::Error,
                            line: error.span().map(|s| keys::line_of(text, s.start)),
                            key: String::new(),
                            message: error.message().trim().to_owned(),
                            fix: "write a value of the type the reference gives for this key"
                                .into(),
                        });
                    }
                    break;
                };
                if !findings.iter().any(|f| f.key == key) {
                    findings.push(Finding {
                        severity: Severity::Error,
                        line: Some(keys::line_of(text, span.start)),
                        fix: keys::fix_for(&key).unwrap_or_else(|| {
                            "write a value of the type the reference gives for this key".into()
                        }),
                        key,
                        message: error.message().trim().to_owned(),
                    });
                }
                let before = rest.clone();
                blank(&mut rest, span);
                if rest == before {
                    break;
                }
            }
        }
    }
    let Some(mut config) = config else {
        return sorted(findings);
    };
    let document = DeTable::parse(text).ok();
    let locate = |key: &str, index: Option<usize>| {
        document
            .as_ref()
            .and_then(|d| locate(text, d.get_ref(), key, index))
    };
    let reported = findings.len();
    findings.extend(
        config
            .problems()
            .iter()
            .map(|problem| from_setting(problem, &locate)),
    );
    // Absolute paths under the root first: relative ones are the config
    // folder's wherever it is.
    if let Files::Root(root) = files {
        config.map_paths(|path| {
            if path.is_absolute() {
                *path = root.join(path.strip_prefix("/").unwrap_or(path));
            }
        });
    }
    config.resolve_paths(folder);
    if *files != Files::Skip {
        findings.extend(check_files(&mut config, &locate));
    }
    // The assembly reads what the files hold (a policy's rules, a key
    // pair): not without them.
    if findings.len() == reported && reported == 0 && *files != Files::Skip {
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
    sorted(findings)
}

fn sorted(mut findings: Vec<Finding>) -> Vec<Finding> {
    findings.sort_by_key(|f| {
        (
            f.severity == Severity::Warning,
            f.line.unwrap_or(usize::MAX),
        )
    });
    findings
}

/// Replaces the bytes of `span` with spaces, newlines kept: the entry is
/// gone and every line stays where it was.
fn blank(text: &mut String, span: Range<usize>) {
    let Some(part) = text.get(span.clone()) else {
        return;
    };
    let spaces: String = part
        .chars()
        .map(|c| if c == '\n' { '\n' } else { ' ' })
        .collect();
    // Spaces for every char, not byte: keep the length in bytes too.
    let pad = part.len() - spaces.len();
    text.replace_range(span, &format!("{spaces}{}", " ".repeat(pad)));
}

/// The span (from its key to the end of its value) of the entry
/// `numbered` (`limits.max_calls_per_batch`, `guard[2].tools`) in `text`.
fn entry_span(text: &str, numbered: &str) -> Option<Range<usize>> {
    if numbered.is_empty() {
        return None;
    }
    let document = DeTable::parse(text).ok()?;
    let mut table = document.get_ref();
    let mut segments = numbered.split('.').peekable();
    while let Some(segment) = segments.next() {
        let (name, index) = match segment.split_once('[') {
            Some((name, index)) => (name, index.trim_end_matches(']').parse::<usize>().ok()),
            None => (segment, None),
        };
        let (key, value) = table.iter().find(|(k, _)| k.get_ref() == name)?;
        let value = match (value.get_ref(), index) {
            (DeValue::Array(items), Some(i)) => items.get(i.checked_sub(1)?)?,
            _ => value,
        };
        if segments.peek().is_none() {
            // Only a `key = value` entry on its own lines: a table header
            // blanked alone would leave its keys to the table above.
            if matches!(value.get_ref(), DeValue::Table(_)) || index.is_some() {
                return None;
            }
            return Some(key.span().start..value.span().end);
        }
        table = match value.get_ref() {
            DeValue::Table(inner) => inner,
            _ => return None,
        };
    }
    None
}

/// The innermost `key = value` entry of `text` whose value holds byte
/// `at`: its numbered key and its span.
fn entry_at(text: &str, at: usize) -> Option<(String, Range<usize>)> {
    let document = DeTable::parse(text).ok()?;
    fn search(table: &DeTable<'_>, prefix: &str, at: usize) -> Option<(String, Range<usize>)> {
        for (key, value) in table.iter() {
            let name = if prefix.is_empty() {
                key.get_ref().to_string()
            } else {
                format!("{prefix}.{}", key.get_ref())
            };
            match value.get_ref() {
                DeValue::Table(inner) => {
                    if let Some(found) = search(inner, &name, at) {
                        return Some(found);
                    }
                }
                DeValue::Array(items)
                    if items
                        .iter()
                        .all(|item| matches!(item.get_ref(), DeValue::Table(_)))
                        && !items.is_empty() =>
                {
                    for (i, item) in items.iter().enumerate() {
                        if let DeValue::Table(inner) = item.get_ref()
                            && let Some(found) = search(inner, &format!("{name}[{}]", i + 1), at)
                        {
                            return Some(found);
                        }
                    }
                }
                _ => {
                    if value.span().contains(&at) || key.span().contains(&at) {
                        return Some((name, key.span().start..value.span().end));
                    }
                }
            }
        }
        None
    }
    search(document.get_ref(), "", at)
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

/// The findings of [`check_files`], each placed at its key's line.
struct FileFindings<'a> {
    out: Vec<Finding>,
    locate: &'a dyn Fn(&str, Option<usize>) -> Option<usize>,
}

impl FileFindings<'_> {
    fn error(&mut self, key: &str, index: Option<usize>, message: String, fix: String) {
        self.out.push(Finding {
            severity: Severity::Error,
            line: (self.locate)(key, index),
            key: numbered(key, index),
            message,
            fix,
        });
    }

    /// The text of `file` (at most `limit` bytes), or `None` with a
    /// "cannot read" error at `key`: `named` precedes the file's path in
    /// the message, `what` says in the fix what the file should be.
    fn read(
        &mut self,
        key: &str,
        index: Option<usize>,
        file: &Path,
        limit: u64,
        named: &str,
        what: &str,
    ) -> Option<String> {
        match crate::files::read_to_string(file, limit) {
            Ok(text) => Some(text),
            Err(e) => {
                let message = format!("cannot read {named}{}: {e}", file.display());
                self.error(key, index, message, file_fix(what));
                None
            }
        }
    }
}

/// The fix for a file that cannot be read or is not what `what` says.
fn file_fix(what: &str) -> String {
    format!(
        "point it at a readable {what} (relative paths are relative to the config file's folder)"
    )
}

/// Reads every file the config names, as the mesh would at start.
fn check_files(
    config: &mut Config,
    locate: &dyn Fn(&str, Option<usize>) -> Option<usize>,
) -> Vec<Finding> {
    let mut findings = FileFindings {
        out: Vec::new(),
        locate,
    };
    for (i, guard) in config.guards.iter_mut().enumerate() {
        let Some(file) = &guard.policy else { continue };
        let index = Some(i + 1);
        let limit = crate::files::MAX_POLICY_FILE_BYTES;
        let what = "policy file (CEL rules, R27)";
        let Some(source) = findings.read("guard.policy", index, file, limit, "policy file ", what)
        else {
            continue;
        };
        match crate::policy::Policy::compile(&source) {
            Err(e) => findings.error(
                "guard.policy",
                index,
                format!("policy file {}: {e}", file.display()),
                "fix the policy file (`guardmesh policy check FILE` shows its rules)".into(),
            ),
            Ok(_) => guard.policy_source = Some(source),
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
            findings.error(name, None, e.to_string(), file_fix(what));
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
            let key = "auth.principal.token_file";
            let limit = crate::files::MAX_SECRET_FILE_BYTES;
            let what = "file holding the principal's token";
            if let Some(text) = findings.read(key, index, file, limit, "token file ", what)
                && text.trim().is_empty()
            {
                findings.error(
                    key,
                    index,
                    format!("token file {} is empty", file.display()),
                    "write the principal's bearer token on the file's one line".into(),
                );
            }
        }
    }
    if let Some(log) = &config.decision_log
        && let Some(key) = &log.signing_key
        && let Err(e) = crate::decision_log::checkpoint::read_signing_key(key)
    {
        findings.error(
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
            findings.error(e.key(), None, e.to_string(), fix);
        }
        Ok(_) => {
            if let Some(path) = &config.sessions.secret_file
                && let Err(e) = crate::session::secret::read_secret(path)
            {
                findings.error(
                    "sessions.secret_file",
                    None,
                    e.to_string(),
                    crate::session::secret::HOW_TO_CREATE.into(),
                );
            }
            if let Some(path) = &config.sessions.redis_password_file {
                let key = "sessions.redis_password_file";
                let limit = crate::files::MAX_SECRET_FILE_BYTES;
                let what = "file holding Redis's password";
                if let Some(text) = findings.read(key, None, path, limit, "", what)
                    && text.trim_end_matches(['\r', '\n']).is_empty()
                {
                    findings.error(
                        key,
                        None,
                        format!("{} is empty", path.display()),
                        "write Redis's password on the file's one line".into(),
                    );
                }
            }
        }
    }
    findings.out
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
    if config.registry.kind == super::RegistryKind::Etcd {
        match config.registry.etcd() {
            Err(error) => out.push(finding(
                "registry.password_env",
                None,
                error.to_string(),
                "set the variable, or write only one of password and password_env",
            )),
            // What the mesh refuses before it connects (R17).
            Ok(etcd) => {
                if let Err(error) = etcd.validate() {
                    out.push(finding(
                        "registry",
                        None,
                        error.to_string(),
                        "do as the message says: change the key it names, or use a build with the feature it names",
                    ));
                }
            }
        }
    }
    out
}
