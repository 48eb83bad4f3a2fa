//! What can be wrong with a config file, each error naming its key.

use std::path::PathBuf;

/// Why the config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A setting that cannot work.
    #[error("config file {path}: {source}")]
    Invalid {
        path: String,
        #[source]
        source: SettingError,
    },
    /// A key the reference does not know, or a value of the wrong type.
    #[error("config file {path}: {source}")]
    Key {
        path: String,
        #[source]
        source: super::keys::KeyError,
    },
    /// A policy guard's file that cannot be read or does not compile (R27).
    #[error("config file {path}: {source}")]
    Policy {
        path: String,
        #[source]
        source: PolicyFileError,
    },
    #[error("config file {path} is invalid: {source}")]
    Parse {
        path: String,
        #[source]
        source: toml::de::Error,
    },
}

/// A setting that parses but cannot work (it would fail every guard or
/// refuse every batch).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    #[error("{key} must be greater than 0")]
    Zero { key: &'static str },
    #[error("{key} must be at most {bound}")]
    Above {
        key: &'static str,
        bound: &'static str,
    },
    #[error(
        "[[guard]] entry {index} ({name:?}) has both `endpoint` and `policy`: a guard is remote or a policy"
    )]
    GuardBoth { index: usize, name: String },
    #[error(
        "[[guard]] entry {index} ({name:?}) needs `endpoint` (a remote guard) or `policy` (a policy file, R27)"
    )]
    GuardNeither { index: usize, name: String },
    /// Two entries (1-based) share a name; `lines`: the lines of their
    /// `name` keys, when known.
    #[error("{}", duplicate(*first, *second, name, *lines))]
    DuplicateGuard {
        first: usize,
        second: usize,
        name: String,
        lines: Option<(usize, usize)>,
    },
    #[error(
        "limits.max_json_depth must be between 1 and {most} (the deepest nesting serde_json-based \
         guards parse); it is {got}"
    )]
    JsonDepth { got: usize, most: usize },
    #[error(transparent)]
    ToolNames(#[from] crate::validate::names::GrammarError),
    #[error(
        "guard_links.keepalive_interval_ms = {got} is below {floor}: default gRPC servers \
         (grpcio) answer pings more frequent than every 5 minutes with GOAWAY \
         \"too_many_pings\" and drop the guard's link; raise it, set it to 0 (off), or set \
         guard_links.keepalive_force = true if every guard's server allows it"
    )]
    KeepaliveBelowFloor { got: u64, floor: u64 },
    #[error(
        "guard_links.dead_peer_timeout_ms = {got} is below 2000 (TCP keepalive counts in \
         seconds); use 0 to turn it off"
    )]
    DeadPeerTooShort { got: u64 },
    #[error(
        "guard_links.resolve_interval_ms = {got}: guard names are resolved again at most once a \
         second (1000)"
    )]
    ResolveIntervalTooShort { got: u64 },
    #[error(transparent)]
    DecisionLog(#[from] LogSettingError),
}

fn duplicate(first: usize, second: usize, name: &str, lines: Option<(usize, usize)>) -> String {
    match lines {
        Some((a, b)) => format!(
            "[[guard]] entries {first} (name at line {a}) and {second} (name at line {b}) are both \
             named {name:?}: guard names are unique (R16); remove or rename one"
        ),
        None => format!(
            "[[guard]] entries {first} and {second} are both named {name:?}: guard names are \
             unique (R16)"
        ),
    }
}

impl SettingError {
    /// The key at fault, as the reference names it (`limits.max_json_depth`,
    /// `guard.name`); with the 1-based `[[guard]]` entry where it is one.
    pub fn key(&self) -> (String, Option<usize>) {
        match self {
            Self::Zero { key } | Self::Above { key, .. } => ((*key).to_owned(), None),
            Self::GuardBoth { index, .. } => ("guard.policy".into(), Some(*index)),
            Self::GuardNeither { index, .. } => ("guard.endpoint".into(), Some(*index)),
            Self::DuplicateGuard { second, .. } => ("guard.name".into(), Some(*second)),
            Self::JsonDepth { .. } => ("limits.max_json_depth".into(), None),
            Self::ToolNames(crate::validate::names::GrammarError::Length { .. }) => {
                ("limits.max_tool_name_chars".into(), None)
            }
            Self::ToolNames(_) => ("limits.tool_name_extra_chars".into(), None),
            Self::KeepaliveBelowFloor { .. } => ("guard_links.keepalive_interval_ms".into(), None),
            Self::DeadPeerTooShort { .. } => ("guard_links.dead_peer_timeout_ms".into(), None),
            Self::ResolveIntervalTooShort { .. } => {
                ("guard_links.resolve_interval_ms".into(), None)
            }
            Self::DecisionLog(error) => (format!("decision_log.{}", error.key()), None),
        }
    }

    /// What to write instead.
    pub fn fix(&self) -> String {
        match self {
            Self::Zero { key } => {
                let leaf = key.rsplit_once('.').map_or(*key, |(_, leaf)| leaf);
                match super::keys::find(key).map(|k| k.default) {
                    Some(default) if !default.is_empty() && default != "0" => {
                        format!("write a number above 0, e.g. the default: {leaf} = {default}")
                    }
                    _ => format!("write a number above 0 for {leaf}"),
                }
            }
            Self::Above { key, bound } => {
                let leaf = key.rsplit_once('.').map_or(*key, |(_, leaf)| leaf);
                format!("write {leaf} no larger than {bound}")
            }
            Self::GuardBoth { .. } => {
                "keep `endpoint` for a remote guard or `policy` for a policy guard, not both".into()
            }
            Self::GuardNeither { .. } => {
                "add endpoint = \"http://host:port\" or policy = \"rules.toml\"".into()
            }
            Self::DuplicateGuard { .. } => "rename or remove one of the two entries".into(),
            Self::JsonDepth { most, .. } => {
                format!("write a depth from 1 to {most}, e.g. the default: max_json_depth = 64")
            }
            Self::ToolNames(crate::validate::names::GrammarError::Length { most, .. }) => {
                format!(
                    "write a length from 1 to {most}, e.g. the default: max_tool_name_chars = 128"
                )
            }
            Self::ToolNames(crate::validate::names::GrammarError::NotPrintableAscii(c)) => {
                format!("remove {c:?} from tool_name_extra_chars")
            }
            Self::KeepaliveBelowFloor { floor, .. } => format!(
                "write keepalive_interval_ms = {floor} (or more), 0 to turn pings off, or add \
                 keepalive_force = true"
            ),
            Self::DeadPeerTooShort { .. } => {
                "write dead_peer_timeout_ms = 2000 (or more), or 0 to turn it off".into()
            }
            Self::ResolveIntervalTooShort { .. } => {
                "write resolve_interval_ms = 1000 (or more); 30000 is the default".into()
            }
            Self::DecisionLog(error) => error.fix(),
        }
    }
}

/// A `[decision_log]` setting that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogSettingError {
    #[error("[decision_log] {key} must be greater than 0")]
    Zero { key: &'static str },
    #[error("[decision_log] max_dir_bytes must be greater than 0 (leave it out for no budget)")]
    ZeroBudget,
    #[error(
        "[decision_log] sync_interval_ms must be greater than 0 (or durability = \"every_record\")"
    )]
    ZeroSync,
    #[error("[decision_log] witness and allow_gap need signing_key")]
    NeedsKey,
    #[error("[decision_log] checkpoint_interval_ms must be at least {min}")]
    CheckpointInterval { min: u64 },
    #[error("[decision_log] mask: {0}")]
    Mask(#[from] crate::decision_log::MaskError),
    #[error("[decision_log] mask_formats: {0}")]
    MaskFormat(#[from] crate::secret_formats::UnknownFormat),
}

impl LogSettingError {
    /// The key at fault, inside `[decision_log]`.
    pub fn key(&self) -> &'static str {
        match self {
            Self::Zero { key } => key,
            Self::ZeroBudget => "max_dir_bytes",
            Self::ZeroSync => "sync_interval_ms",
            Self::NeedsKey => "signing_key",
            Self::CheckpointInterval { .. } => "checkpoint_interval_ms",
            Self::Mask(_) => "mask",
            Self::MaskFormat(_) => "mask_formats",
        }
    }

    /// What to write instead.
    pub fn fix(&self) -> String {
        match self {
            Self::Zero { key } => {
                let default =
                    super::keys::find(&format!("decision_log.{key}")).map_or("", |k| k.default);
                format!("write a number above 0, e.g. the default: {key} = {default}")
            }
            Self::ZeroBudget => "write a size in bytes, or remove max_dir_bytes (no budget)".into(),
            Self::ZeroSync => {
                "write sync_interval_ms = 100, or durability = \"every_record\"".into()
            }
            Self::NeedsKey => "add signing_key = \"log-key.pem\" (`guardmesh log keygen`), or \
                               remove witness and allow_gap"
                .into(),
            Self::CheckpointInterval { min } => {
                format!("write checkpoint_interval_ms = {min} or more")
            }
            Self::Mask(_) => "write a key name (`password`), a glob (`*.api_key`) or a path \
                              (`$.headers.authorization`)"
                .into(),
            Self::MaskFormat(_) => "name formats among aws-access-key, github-token, \
                                    stripe-live-key, private-key; or mask_formats = [] for none"
                .into(),
        }
    }
}

/// The decision log's settings cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum DecisionLogError {
    #[error(transparent)]
    Setting(#[from] LogSettingError),
    /// The checkpoints' etcd anchor takes the `[registry]` settings.
    #[error(transparent)]
    Registry(#[from] crate::registry::etcd::ConnectError),
}

/// A policy guard's file (R27) that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyFileError {
    #[error("[[guard]] entry {index} ({name:?}): cannot read policy file {}: {source}", path.display())]
    Read {
        index: usize,
        name: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("[[guard]] entry {index} ({name:?}): policy file {}: {source}", path.display())]
    Compile {
        index: usize,
        name: String,
        path: PathBuf,
        #[source]
        source: Box<crate::policy::CompileError>,
    },
}
