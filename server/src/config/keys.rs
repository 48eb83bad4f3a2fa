//! Every key of the config file: its type, default and meaning.
//!
//! [`KEYS`] is read from the config's types, where each key is declared
//! once (see `config::describe`): its meaning is the field's doc comment,
//! its default what serde fills in when it is left out. It is what the
//! loader checks a file against (after serde has read it: a key serde reads
//! that is missing here refuses the file), what `guardmesh config check`
//! walks to report every error with its line, and what `guardmesh config
//! reference` prints. A test walks the keys serde accepts and fails on one
//! this list does not hold (or the reverse), and another sets each key to
//! its listed default and expects the defaults' config.

use super::describe::{Field, Table};
use std::ops::Range;
use std::sync::LazyLock;
use toml::de::{DeTable, DeValue};

pub use super::reference::{reference_markdown, reference_text};

/// The type of a key's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Bool,
    /// An integer (durations in the unit the key's name says).
    Int,
    Str,
    /// `host:port`, an IP address and a port.
    Addr,
    /// A file or directory, relative to the config file's folder.
    Path,
    Strs,
    /// One of these names.
    Enum(&'static [&'static str]),
    /// A list of these names.
    Names(&'static [&'static str]),
    /// A table of the keys below it.
    Table,
    /// A list of tables (`[[name]]`) of the keys below it.
    Tables,
}

impl Kind {
    /// How the reference writes this type.
    pub fn describe(self) -> String {
        match self {
            Kind::Bool => "boolean".into(),
            Kind::Int => "integer".into(),
            Kind::Str => "string".into(),
            Kind::Addr => "address (\"ip:port\")".into(),
            Kind::Path => "path".into(),
            Kind::Strs => "list of strings".into(),
            Kind::Enum(names) => format!("one of {}", quoted(names)),
            Kind::Names(names) => format!("list of {}", quoted(names)),
            Kind::Table => "table".into(),
            Kind::Tables => "list of tables".into(),
        }
    }

    pub(super) fn is_table(self) -> bool {
        matches!(self, Kind::Table | Kind::Tables)
    }
}

/// `an integer`, `a string`.
fn article(what: &str) -> String {
    let an = what.starts_with(['a', 'e', 'i', 'o', 'u']);
    format!("{} {what}", if an { "an" } else { "a" })
}

fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("\"{n}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One key of the config file.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// Dotted path from the top of the file: `limits.max_json_depth`;
    /// `guard.name` for the `name` of each `[[guard]]`.
    pub path: &'static str,
    pub kind: Kind,
    /// The value when the key is left out, as TOML; empty: unset (or, with
    /// `required`, no default).
    pub default: &'static str,
    /// Must be given whenever its table is.
    pub required: bool,
    pub meaning: &'static str,
}

/// Every key the loader reads, in the order the config's types declare
/// them, each table followed by its keys: read from the types themselves
/// (see `config::describe`).
pub static KEYS: Keys = Keys(());

/// The list of [`KEYS`], made once from the config's types: a slice of
/// [`Key`] (`KEYS.iter()`, `for key in KEYS`).
#[derive(Debug, Clone, Copy)]
pub struct Keys(());

impl std::ops::Deref for Keys {
    type Target = [Key];

    fn deref(&self) -> &[Key] {
        all()
    }
}

impl IntoIterator for Keys {
    type Item = &'static Key;
    type IntoIter = std::slice::Iter<'static, Key>;

    fn into_iter(self) -> Self::IntoIter {
        all().iter()
    }
}

fn all() -> &'static [Key] {
    static ALL: LazyLock<Vec<Key>> = LazyLock::new(|| {
        let mut keys = Vec::new();
        flatten("", <super::Config as Table>::keys(), &mut keys);
        keys
    });
    &ALL
}

/// The keys of the table at `table` (`""`: the top), each followed by the
/// keys of the table it is. Made once per process: the texts are kept for
/// its life.
fn flatten(table: &str, fields: Vec<Field>, out: &mut Vec<Key>) {
    for field in fields {
        let path = if table.is_empty() {
            field.name.to_owned()
        } else {
            format!("{table}.{}", field.name)
        };
        out.push(Key {
            path: String::leak(path.clone()),
            kind: field.kind,
            default: String::leak(field.default.unwrap_or_default()),
            required: field.required,
            meaning: String::leak(field.meaning),
        });
        if let Some(keys) = field.keys {
            flatten(&path, keys(), out);
        }
    }
}

/// The key at `path` (`limits.max_json_depth`, `guard.name`).
pub fn find(path: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.path == path)
}

/// The keys directly inside the table at `table` (`""`: the top).
pub fn children(table: &str) -> impl Iterator<Item = &'static Key> + '_ {
    KEYS.iter().filter(move |k| parent(k.path) == table)
}

fn parent(path: &str) -> &str {
    path.rsplit_once('.').map_or("", |(parent, _)| parent)
}

fn leaf(path: &str) -> &str {
    path.rsplit_once('.').map_or(path, |(_, leaf)| leaf)
}

/// Where a key is in a file: its line (1-based), and its `[[...]]` entry
/// (1-based) where it is inside one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct At {
    pub line: usize,
    /// The key's path with entries numbered: `guard[2].endpoint`.
    pub key: String,
}

impl std::fmt::Display for At {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.is_empty() {
            write!(f, "line {}", self.line)
        } else {
            write!(f, "line {}: {}", self.line, self.key)
        }
    }
}

/// A key the reference does not know, a value of the wrong type, or a
/// required key left out; each names its line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("{at}: not valid TOML: {message}")]
    Syntax { at: At, message: String },
    #[error("{at}: unknown key{}", suggestion.map(|s| format!(" (did you mean `{}`?)", leaf(s))).unwrap_or_default())]
    Unknown {
        at: At,
        suggestion: Option<&'static str>,
    },
    #[error("{at}: is {}, and must be {}", article(found), article(&expected.describe()))]
    Type {
        at: At,
        expected: Kind,
        found: &'static str,
    },
    #[error("{at}: {value:?} is not one of {}", quoted(allowed))]
    Value {
        at: At,
        value: String,
        allowed: &'static [&'static str],
    },
    #[error("{at}: {value:?} is not an address: {why}")]
    Address { at: At, value: String, why: String },
    #[error("{at}: is required in this table")]
    Missing { at: At },
}

impl KeyError {
    /// Where the error is.
    pub fn at(&self) -> &At {
        match self {
            Self::Syntax { at, .. }
            | Self::Unknown { at, .. }
            | Self::Type { at, .. }
            | Self::Value { at, .. }
            | Self::Address { at, .. }
            | Self::Missing { at } => at,
        }
    }

    /// What to write instead.
    pub fn fix(&self) -> String {
        let path = |at: &At| reference_path(&at.key);
        match self {
            Self::Syntax { .. } => {
                "fix the TOML syntax at that line (quote strings, one key = value per line)".into()
            }
            Self::Unknown {
                suggestion: Some(s),
                ..
            } => format!("write `{}`", leaf(s)),
            Self::Unknown { at, .. } => {
                let table = parent(&path(at)).to_owned();
                let known: Vec<&str> = children(&table).map(|k| leaf(k.path)).collect();
                format!(
                    "remove it; {} takes: {}",
                    if table.is_empty() {
                        "the top level".to_owned()
                    } else {
                        format!("[{table}]")
                    },
                    known.join(", ")
                )
            }
            Self::Type { at, expected, .. } => {
                let example = find(&path(at)).map(example).unwrap_or_default();
                format!("write {}{example}", article(&expected.describe()))
            }
            Self::Value { at, allowed, .. } => {
                format!("write {} = \"{}\"", leaf(&at.key), allowed.join("\" or \""))
            }
            // The key's own default or example: the listener's fix is not
            // the metrics port.
            Self::Address { at, .. } => find(&path(at))
                .map(|key| format!("write an address{}", example(key)))
                .unwrap_or_else(|| format!("write {} = \"127.0.0.1:50051\"", leaf(&at.key))),
            Self::Missing { at } => {
                let example = find(&path(at)).map(example).unwrap_or_default();
                format!("add {}{example}", leaf(&at.key))
            }
        }
    }
}

/// What to write for `key` when its value does not read: its type and
/// an example (`write an integer, e.g. max_calls_per_batch = 256`).
pub(crate) fn fix_for(numbered: &str) -> Option<String> {
    let key = find(&reference_path(numbered))?;
    let what = match key.kind {
        Kind::Int => "a whole number, 0 or more".to_owned(),
        kind => article(&kind.describe()),
    };
    Some(format!("write {what}{}", example(key)))
}

/// `, e.g. key = value` for a key, from its default or its type.
fn example(key: &Key) -> String {
    let value = if key.default.is_empty() {
        match key.kind {
            Kind::Bool => "true".into(),
            Kind::Int => "1".into(),
            Kind::Str => "\"...\"".into(),
            Kind::Addr => "\"127.0.0.1:9090\"".into(),
            Kind::Path => "\"file.pem\"".into(),
            Kind::Strs => "[\"...\"]".into(),
            Kind::Enum(names) => format!("\"{}\"", names[0]),
            Kind::Names(names) => format!("[\"{}\"]", names[0]),
            Kind::Table | Kind::Tables => return String::new(),
        }
    } else {
        key.default.to_owned()
    };
    format!(", e.g. {} = {value}", leaf(key.path))
}

/// `guard[2].grant.tools` → `guard.grant.tools`.
fn reference_path(numbered: &str) -> String {
    let mut out = String::with_capacity(numbered.len());
    let mut skip = false;
    for c in numbered.chars() {
        match c {
            '[' => skip = true,
            ']' => skip = false,
            c if !skip => out.push(c),
            _ => {}
        }
    }
    out
}

/// The 1-based line of byte `at` of `text`.
pub fn line_of(text: &str, at: usize) -> usize {
    text.get(..at).unwrap_or(text).matches('\n').count() + 1
}

/// Checks `text` against [`KEYS`]: every syntax error the parser recovers
/// from, then every unknown key, wrongly typed value and missing required
/// key, in file order.
pub fn walk(text: &str) -> Vec<KeyError> {
    let (document, syntax) = DeTable::parse_recoverable(text);
    if !syntax.is_empty() {
        return syntax
            .into_iter()
            .map(|error| {
                let line = error.span().map_or(1, |s| line_of(text, s.start));
                KeyError::Syntax {
                    at: At {
                        line,
                        key: String::new(),
                    },
                    message: error.message().trim().to_owned(),
                }
            })
            .collect();
    }
    let mut errors = Vec::new();
    walk_table(text, document.get_ref(), "", "", 0..0, &mut errors);
    errors.sort_by_key(|e| e.at().line);
    errors
}

/// The line of the table's first key, or of its header span.
fn table_line(text: &str, table: &DeTable<'_>, span: &Range<usize>) -> usize {
    table
        .iter()
        .map(|(k, _)| k.span().start)
        .min()
        .map_or_else(|| line_of(text, span.start), |start| line_of(text, start))
}

fn walk_table(
    text: &str,
    table: &DeTable<'_>,
    path: &str,
    numbered: &str,
    span: Range<usize>,
    errors: &mut Vec<KeyError>,
) {
    let join = |prefix: &str, name: &str| {
        if prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{prefix}.{name}")
        }
    };
    for (name, value) in table.iter() {
        let full = join(path, name.get_ref());
        let shown = join(numbered, name.get_ref());
        let at = At {
            line: line_of(text, name.span().start),
            key: shown.clone(),
        };
        let Some(key) = find(&full) else {
            errors.push(KeyError::Unknown {
                suggestion: suggest(path, name.get_ref()),
                at,
            });
            continue;
        };
        walk_value(
            text,
            key,
            value.get_ref(),
            value.span(),
            &full,
            &shown,
            at,
            errors,
        );
    }
    for key in children(path).filter(|k| k.required) {
        if !table.iter().any(|(k, _)| k.get_ref() == leaf(key.path)) {
            errors.push(KeyError::Missing {
                at: At {
                    line: table_line(text, table, &span),
                    key: join(numbered, leaf(key.path)),
                },
            });
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn walk_value(
    text: &str,
    key: &Key,
    value: &DeValue<'_>,
    span: Range<usize>,
    full: &str,
    shown: &str,
    at: At,
    errors: &mut Vec<KeyError>,
) {
    let wrong = |found: &'static str| KeyError::Type {
        at: at.clone(),
        expected: key.kind,
        found,
    };
    match (key.kind, value) {
        (Kind::Bool, DeValue::Boolean(_)) | (Kind::Int, DeValue::Integer(_)) => {}
        (Kind::Str | Kind::Path, DeValue::String(_)) => {}
        (Kind::Addr, DeValue::String(s)) => {
            if let Err(e) = s.parse::<std::net::SocketAddr>() {
                errors.push(KeyError::Address {
                    at,
                    value: s.to_string(),
                    why: e.to_string(),
                });
            }
        }
        (Kind::Enum(allowed), DeValue::String(s)) => {
            if !allowed.contains(&s.as_ref()) && !allowed.contains(&s.replace('-', "_").as_str()) {
                errors.push(KeyError::Value {
                    at,
                    value: s.to_string(),
                    allowed,
                });
            }
        }
        (Kind::Strs | Kind::Names(_), DeValue::Array(items)) => {
            for item in items.iter() {
                match (key.kind, item.get_ref()) {
                    (Kind::Names(allowed), DeValue::String(s))
                        if !allowed.contains(&s.as_ref()) =>
                    {
                        errors.push(KeyError::Value {
                            at: at.clone(),
                            value: s.to_string(),
                            allowed,
                        });
                    }
                    (_, DeValue::String(_)) => {}
                    (_, other) => errors.push(KeyError::Type {
                        at: At {
                            line: line_of(text, item.span().start),
                            key: at.key.clone(),
                        },
                        expected: key.kind,
                        found: found(other),
                    }),
                }
            }
        }
        (Kind::Table, DeValue::Table(table)) => {
            walk_table(text, table, full, shown, span, errors);
        }
        (Kind::Tables, DeValue::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                match item.get_ref() {
                    DeValue::Table(table) => walk_table(
                        text,
                        table,
                        full,
                        &format!("{shown}[{}]", i + 1),
                        item.span(),
                        errors,
                    ),
                    other => errors.push(KeyError::Type {
                        at: At {
                            line: line_of(text, item.span().start),
                            key: format!("{shown}[{}]", i + 1),
                        },
                        expected: key.kind,
                        found: found(other),
                    }),
                }
            }
        }
        (_, other) => errors.push(wrong(found(other))),
    }
}

fn found(value: &DeValue<'_>) -> &'static str {
    match value {
        DeValue::String(_) => "string",
        DeValue::Integer(_) => "integer",
        DeValue::Float(_) => "float",
        DeValue::Boolean(_) => "boolean",
        DeValue::Datetime(_) => "date-time",
        DeValue::Array(_) => "list",
        DeValue::Table(_) => "table",
    }
}

/// The known key in table `path` nearest to `name`, if near enough to be a
/// misspelling.
fn suggest(path: &str, name: &str) -> Option<&'static str> {
    children(path)
        .map(|k| (strsim::damerau_levenshtein(leaf(k.path), name), k.path))
        .filter(|(distance, candidate)| *distance <= (leaf(candidate).len() / 3).max(2))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, path)| path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// The headers and required keys that make the table at `path` exist
    /// (`guard.grant`: a `[[guard]]` with its name, then `[guard.grant]`).
    fn base(path: &str) -> String {
        let mut text = String::new();
        let mut prefix = String::new();
        for segment in path.split('.').filter(|s| !s.is_empty()) {
            if !prefix.is_empty() {
                prefix.push('.');
            }
            prefix.push_str(segment);
            let table = find(&prefix).expect("a table of the reference");
            match table.kind {
                Kind::Tables => text.push_str(&format!("[[{prefix}]]\n")),
                _ => text.push_str(&format!("[{prefix}]\n")),
            }
            for key in children(&prefix).filter(|k| k.required) {
                let value = match key.kind {
                    Kind::Names(names) => format!("[\"{}\"]", names[0]),
                    _ => "\"x\"".to_owned(),
                };
                text.push_str(&format!("{} = {value}\n", leaf(key.path)));
            }
        }
        text
    }

    /// The keys serde accepts directly in the table at `path`, read from
    /// its answer to a key it does not know.
    fn accepted(path: &str) -> Vec<String> {
        let text = format!("{}__probe__ = 1\n", base(path));
        let error = toml::from_str::<Config>(&text)
            .expect_err("an unknown key is refused")
            .to_string();
        let expected = error
            .split_once("expected")
            .unwrap_or_else(|| panic!("{path}: {error}"))
            .1;
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    }

    /// Every key the loader reads has a reference entry, and every entry
    /// is a key the loader reads: a key added to a config struct without
    /// an entry fails here (and the loader refuses files that use it).
    #[test]
    fn every_key_the_loader_reads_is_in_the_reference_and_back() {
        let tables =
            std::iter::once("").chain(KEYS.iter().filter(|k| k.kind.is_table()).map(|k| k.path));
        let mut walked = 0;
        for table in tables {
            let mut loader = accepted(table);
            loader.sort();
            let mut reference: Vec<String> =
                children(table).map(|k| leaf(k.path).to_owned()).collect();
            reference.sort();
            for key in &loader {
                assert!(
                    reference.contains(key),
                    "the loader reads `{key}` in [{table}], which the reference (config::keys::KEYS) does not list"
                );
            }
            for key in &reference {
                assert!(
                    loader.contains(key),
                    "the reference lists `{key}` in [{table}], which the loader does not read"
                );
            }
            walked += loader.len();
        }
        assert_eq!(walked, KEYS.len(), "every key walked once");
    }

    /// Every key has a meaning: the doc comment of its field.
    #[test]
    fn every_key_has_a_meaning() {
        for key in KEYS {
            assert!(
                !key.meaning.is_empty(),
                "{}: its field has no doc comment, which is its meaning in the reference",
                key.path
            );
        }
    }

    /// Setting a key to the default the reference gives changes nothing,
    /// and every value a one-of key lists is accepted.
    #[test]
    fn every_default_and_value_in_the_reference_is_the_loaders() {
        for key in KEYS.iter().filter(|k| !k.kind.is_table() && !k.required) {
            let table = parent(key.path);
            let base = base(table);
            let plain: Config = toml::from_str(&base).unwrap();
            if !key.default.is_empty() {
                let text = format!("{base}{} = {}\n", leaf(key.path), key.default);
                let set: Config = toml::from_str(&text)
                    .unwrap_or_else(|e| panic!("{}: default {}: {e}", key.path, key.default));
                assert_eq!(
                    format!("{set:?}"),
                    format!("{plain:?}"),
                    "{}: the reference's default {} is not the loader's",
                    key.path,
                    key.default
                );
            }
            if let Kind::Enum(names) = key.kind {
                for name in names {
                    let text = format!("{base}{} = \"{name}\"\n", leaf(key.path));
                    assert!(
                        toml::from_str::<Config>(&text).is_ok(),
                        "{}: {name:?}",
                        key.path
                    );
                }
            }
        }
    }
    /// Every error of a file at once, each with its line, key and fix.
    #[test]
    fn walk_reports_every_error_with_line_key_and_fix() {
        let text = "lisen = \"127.0.0.1:1\"\n\
                    unguarded = \"maybe\"\n\
                    [limits]\n\
                    max_calls_per_batch = \"many\"\n\
                    [[guard]]\n\
                    endpoint = \"http://127.0.0.1:1\"\n\
                    tols = [\"x\"]\n";
        let errors = walk(text);
        let shown: Vec<String> = errors
            .iter()
            .map(|e| format!("{e} | {}", e.fix()))
            .collect();
        assert_eq!(errors.len(), 5, "{shown:#?}");
        assert!(
            shown[0].starts_with("line 1: lisen: unknown key (did you mean `listen`?)"),
            "{shown:#?}"
        );
        assert!(shown[0].ends_with("write `listen`"), "{shown:#?}");
        assert!(
            shown[1].contains("line 2: unguarded") && shown[1].contains("\"cancel\""),
            "{shown:#?}"
        );
        assert!(
            shown[2].contains(
                "line 4: limits.max_calls_per_batch: is a string, and must be an integer"
            ),
            "{shown:#?}"
        );
        assert!(shown[2].contains("max_calls_per_batch = 256"), "{shown:#?}");
        assert!(
            shown
                .iter()
                .any(|s| s.contains("guard[1].name: is required")),
            "{shown:#?}"
        );
        assert!(
            shown
                .iter()
                .any(|s| s.contains("line 7: guard[1].tols") && s.contains("`tools`")),
            "{shown:#?}"
        );
        // Syntax errors: each one the parser recovers from.
        let errors = walk("listen = \"127.0.0.1:1\"\nport = = 1\n[limits\nx = 1\n");
        assert!(errors.len() >= 2, "{errors:?}");
        assert!(
            errors.iter().all(|e| matches!(e, KeyError::Syntax { .. })),
            "{errors:?}"
        );
        assert_eq!(errors[0].at().line, 2, "{errors:?}");
        assert!(errors.iter().any(|e| e.at().line == 3), "{errors:?}");
    }

    /// Every key of type path is resolved against the config's folder.
    #[test]
    fn every_path_key_is_resolved_against_the_config_folder() {
        let mut text = String::new();
        let mut tables: Vec<&str> = Vec::new();
        for key in KEYS.iter().filter(|k| k.kind == Kind::Path) {
            let table = parent(key.path);
            if !tables.contains(&table) {
                tables.push(table);
            }
        }
        for table in &tables {
            let mut section = base(table);
            for key in children(table).filter(|k| k.kind == Kind::Path) {
                let set = format!("{} = \"rel/{}\"\n", leaf(key.path), key.path);
                let required = format!("{} = \"x\"\n", leaf(key.path));
                if section.contains(&required) {
                    section = section.replace(&required, &set);
                } else {
                    section.push_str(&set);
                }
            }
            text.push_str(&section);
        }
        let mut config: Config = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let folder = std::path::Path::new("/configs/here");
        config.resolve_paths(folder);
        let shown = format!("{config:?}");
        for key in KEYS.iter().filter(|k| k.kind == Kind::Path) {
            let resolved = folder.join(format!("rel/{}", key.path));
            assert!(
                shown.contains(&format!("{:?}", resolved)),
                "{} is not resolved against the config's folder: {shown}",
                key.path
            );
        }
    }
}
