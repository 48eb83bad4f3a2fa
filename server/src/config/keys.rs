//! Every key of the config file: its type, default and meaning.
//!
//! [`KEYS`] is what the loader checks a file against (after serde has read
//! it: a key serde reads that is missing here refuses the file), what
//! `guardmesh config check` walks to report every error with its line, and
//! what `guardmesh config reference` prints. A test walks the keys serde
//! accepts and fails on one this table does not list, and another sets
//! each key to its listed default and expects the defaults' config.

use std::fmt::Write as _;
use std::ops::Range;
use toml::de::{DeTable, DeValue};

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

    fn is_table(self) -> bool {
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

const fn key(path: &'static str, kind: Kind, default: &'static str, meaning: &'static str) -> Key {
    Key {
        path,
        kind,
        default,
        required: false,
        meaning,
    }
}

const fn required(path: &'static str, kind: Kind, meaning: &'static str) -> Key {
    Key {
        path,
        kind,
        default: "",
        required: true,
        meaning,
    }
}

const ROLES: &[&str] = &["evaluate", "register", "admin"];

/// Every key the loader reads, tables first within their section.
pub static KEYS: &[Key] = &[
    key(
        "listen",
        Kind::Addr,
        "\"127.0.0.1:50051\"",
        "Address of the mesh's gRPC listener.",
    ),
    key(
        "metrics_listen",
        Kind::Addr,
        "",
        "Address of the HTTP listener for Prometheus metrics; unset: no metrics listener.",
    ),
    key(
        "default_guard_timeout_ms",
        Kind::Int,
        "1000",
        "Deadline of a guard that registers with `timeout_ms = 0`, in milliseconds.",
    ),
    key(
        "default_batch_timeout_ms",
        Kind::Int,
        "5000",
        "Deadline of a batch that names none, in milliseconds.",
    ),
    key(
        "max_batch_timeout_ms",
        Kind::Int,
        "30000",
        "Longest deadline a batch may ask for, in milliseconds.",
    ),
    key(
        "unguarded",
        Kind::Enum(&["proceed", "cancel"]),
        "\"proceed\"",
        "What happens to a call no enforced guard applies to (R28): it proceeds, or is cancelled (default deny).",
    ),
    key(
        "watch_policies",
        Kind::Bool,
        "true",
        "Reload the policy files of policy guards when they change on disk; false: only on SIGHUP.",
    ),
    // [limits]
    key(
        "limits",
        Kind::Table,
        "",
        "What coordinators may send (R20).",
    ),
    key(
        "limits.max_calls_per_batch",
        Kind::Int,
        "256",
        "Most calls in one batch.",
    ),
    key(
        "limits.max_batch_bytes",
        Kind::Int,
        "4194304",
        "Largest batch, in bytes.",
    ),
    key(
        "limits.max_argument_bytes",
        Kind::Int,
        "1048576",
        "Largest arguments of one call, in bytes.",
    ),
    key(
        "limits.max_inflight_batches",
        Kind::Int,
        "4096",
        "Most batches judged at once in the whole mesh.",
    ),
    key(
        "limits.max_batches_per_stream",
        Kind::Int,
        "256",
        "Most batches judged at once on one coordinator stream.",
    ),
    key(
        "limits.max_json_depth",
        Kind::Int,
        "64",
        "Deepest nesting in one call's arguments, 1 to 127.",
    ),
    key(
        "limits.max_result_bytes",
        Kind::Int,
        "1048576",
        "Largest result (its `CallToolResult` JSON text) of one call sent to be judged (R33).",
    ),
    key(
        "limits.max_id_bytes",
        Kind::Int,
        "256",
        "Longest batch, call or session id, in bytes.",
    ),
    key(
        "limits.max_metadata_entries",
        Kind::Int,
        "1024",
        "Most metadata entries of one batch.",
    ),
    key(
        "limits.max_inflight_bytes",
        Kind::Int,
        "268435456",
        "Bytes of batches being judged at once in the whole mesh.",
    ),
    key(
        "limits.max_stream_bytes",
        Kind::Int,
        "16777216",
        "Bytes of batches being judged at once on one coordinator stream.",
    ),
    key(
        "limits.max_coordinator_streams",
        Kind::Int,
        "4096",
        "Most coordinator streams open at once.",
    ),
    key(
        "limits.max_tool_name_chars",
        Kind::Int,
        "128",
        "Longest tool name a batch may carry, 1 to 1024.",
    ),
    key(
        "limits.tool_name_extra_chars",
        Kind::Str,
        "\"\"",
        "Printable ASCII characters tool names may hold besides letters, digits, `_`, `-` and `.`.",
    ),
    // [guard_links]
    key(
        "guard_links",
        Kind::Table,
        "",
        "How the mesh dials and keeps its links to guards.",
    ),
    key(
        "guard_links.connect_timeout_ms",
        Kind::Int,
        "2000",
        "Deadline of one connection attempt to a guard, in milliseconds.",
    ),
    key(
        "guard_links.backoff_initial_ms",
        Kind::Int,
        "50",
        "First pause before dialing a lost guard again, in milliseconds; doubles up to backoff_max_ms.",
    ),
    key(
        "guard_links.backoff_max_ms",
        Kind::Int,
        "2000",
        "Longest pause between dials of a lost guard, in milliseconds.",
    ),
    key(
        "guard_links.max_answer_bytes",
        Kind::Int,
        "4194304",
        "Largest answer accepted from a guard, in bytes.",
    ),
    key(
        "guard_links.circuit_failures",
        Kind::Int,
        "5",
        "Consecutive failures that open a guard's circuit; 0 disables the circuit.",
    ),
    key(
        "guard_links.circuit_open_ms",
        Kind::Int,
        "5000",
        "How long an open circuit fails at once before one probe goes through, in milliseconds.",
    ),
    key(
        "guard_links.keepalive_interval_ms",
        Kind::Int,
        "300000",
        "HTTP/2 PING after this long without a frame from the guard, in milliseconds; 0: off. Below 300000 only with keepalive_force (R26).",
    ),
    key(
        "guard_links.keepalive_timeout_ms",
        Kind::Int,
        "20000",
        "How long a PING to a guard may go unanswered, in milliseconds.",
    ),
    key(
        "guard_links.keepalive_force",
        Kind::Bool,
        "false",
        "Accept a keepalive_interval_ms below 300000 (for guards whose servers allow it).",
    ),
    key(
        "guard_links.dead_peer_timeout_ms",
        Kind::Int,
        "30000",
        "TCP keepalive and TCP_USER_TIMEOUT: a vanished guard host is noticed within about this long, in milliseconds; 0: off, else at least 2000.",
    ),
    key(
        "guard_links.max_queued_bytes",
        Kind::Int,
        "16777216",
        "Bytes of requests queued for a guard that is not reading them; past it batches fail at that guard per its policy (R25).",
    ),
    key(
        "guard_links.resolve_interval_ms",
        Kind::Int,
        "30000",
        "How often a guard endpoint that is a DNS name is resolved again for its replicas, in milliseconds (at least 1000); a failed connection asks sooner (R32).",
    ),
    // [server]
    key(
        "server",
        Kind::Table,
        "",
        "How the listener treats silent and dead clients (R25).",
    ),
    key(
        "server.handshake_timeout_ms",
        Kind::Int,
        "10000",
        "Time a new connection has to finish TLS and send the HTTP/2 preface, in milliseconds.",
    ),
    key(
        "server.keepalive_interval_ms",
        Kind::Int,
        "60000",
        "HTTP/2 PING interval on connections the mesh hears nothing from, in milliseconds; 0: no pings.",
    ),
    key(
        "server.keepalive_timeout_ms",
        Kind::Int,
        "20000",
        "How long a PING to a client may go unanswered, in milliseconds.",
    ),
    key(
        "server.max_connections",
        Kind::Int,
        "0",
        "Most client connections open at once; 0: the open-file limit less a reserve (1/8, at least 64).",
    ),
    key(
        "server.shutdown_grace_ms",
        Kind::Int,
        "25000",
        "After SIGTERM or SIGINT, how long batches in flight have to be answered before the process exits anyway, in milliseconds (under Kubernetes' 30 s terminationGracePeriodSeconds with room for a 5 s preStop delay); 0: exit at once.",
    ),
    // [tls]
    key(
        "tls",
        Kind::Table,
        "",
        "TLS on the mesh's listener; absent: plaintext (a warning is printed at start).",
    ),
    required(
        "tls.cert_file",
        Kind::Path,
        "PEM certificate chain of the mesh (reloaded when it changes).",
    ),
    required("tls.key_file", Kind::Path, "PEM private key of cert_file."),
    key(
        "tls.client_ca_file",
        Kind::Path,
        "",
        "PEM CA: with it every client must present a certificate it signed (R24).",
    ),
    // [auth]
    key(
        "auth",
        Kind::Table,
        "",
        "Authentication and roles; absent: no roles (a warning is printed at start).",
    ),
    key(
        "auth.plaintext_tokens_on_loopback",
        Kind::Bool,
        "false",
        "Accept bearer tokens over plaintext from loopback clients (development only).",
    ),
    key(
        "auth.tokens_without_client_cert",
        Kind::Bool,
        "false",
        "With tls.client_ca_file: let a caller without a certificate authenticate with a bearer token alone.",
    ),
    key(
        "auth.principal",
        Kind::Tables,
        "",
        "`[[auth.principal]]`: an identity (certificate URI SAN, or a token's name) and its roles.",
    ),
    required(
        "auth.principal.id",
        Kind::Str,
        "The certificate's URI SAN, or the token's name.",
    ),
    required(
        "auth.principal.roles",
        Kind::Names(ROLES),
        "What the principal may do.",
    ),
    key(
        "auth.principal.token_file",
        Kind::Path,
        "",
        "File holding the principal's bearer token (one line); unset: matched by certificate.",
    ),
    key(
        "auth.principal.name_prefixes",
        Kind::Strs,
        "[]",
        "With `register`: the guard names it may manage start with one of these.",
    ),
    key(
        "auth.principal.max_registrations",
        Kind::Int,
        "64",
        "With `register`: most guards it may have registered at once.",
    ),
    // [guard_tls]
    key(
        "guard_tls",
        Kind::Table,
        "",
        "How the mesh verifies `https://` guards, and its client certificate for guards that require mTLS.",
    ),
    required(
        "guard_tls.ca_file",
        Kind::Path,
        "PEM roots for guards' certificates.",
    ),
    key(
        "guard_tls.cert_file",
        Kind::Path,
        "",
        "PEM client certificate the mesh presents to guards.",
    ),
    key(
        "guard_tls.key_file",
        Kind::Path,
        "",
        "PEM private key of cert_file.",
    ),
    // [endpoint_policy]
    key(
        "endpoint_policy",
        Kind::Table,
        "",
        "Which guard endpoints may be registered and dialed.",
    ),
    key(
        "endpoint_policy.allow",
        Kind::Strs,
        "[]",
        "CIDRs, addresses and host names (`*.suffix` allowed); empty: any host that is not denied.",
    ),
    key(
        "endpoint_policy.deny_link_local",
        Kind::Bool,
        "true",
        "Refuse link-local and cloud metadata addresses (169.254.0.0/16, fe80::/10, metadata host names).",
    ),
    // [[guard]]
    key(
        "guard",
        Kind::Tables,
        "",
        "`[[guard]]`: a guard registered at start, in file order (R16).",
    ),
    required("guard.name", Kind::Str, "Unique name of the guard."),
    key(
        "guard.endpoint",
        Kind::Str,
        "",
        "A remote guard's address (`http://host:port`, `https://...`); exactly one of endpoint and policy.",
    ),
    key(
        "guard.replicas",
        Kind::Strs,
        "[]",
        "The guard's replicas (R32), each an address as endpoint takes; each request goes to one, chosen by load. With endpoint, one more each; at most 64.",
    ),
    key(
        "guard.policy",
        Kind::Path,
        "",
        "A policy guard's file of CEL rules (R27); exactly one of endpoint and policy.",
    ),
    key(
        "guard.role",
        Kind::Enum(guardmesh_proto::v1::GuardRole::NAMES),
        "\"validate\"",
        "A validate guard answers verdicts; a mutate guard may also rewrite calls within its grant.",
    ),
    key(
        "guard.tools",
        Kind::Strs,
        "[]",
        "Globs of the tools the guard is sent; empty: every tool.",
    ),
    key(
        "guard.timeout_ms",
        Kind::Int,
        "0",
        "The guard's deadline, in milliseconds; 0: default_guard_timeout_ms.",
    ),
    key(
        "guard.failure_policy",
        Kind::Enum(guardmesh_proto::v1::FailurePolicy::NAMES),
        "\"fail_closed\"",
        "What a failure of the guard means for its calls (R13).",
    ),
    key(
        "guard.priority",
        Kind::Int,
        "0",
        "Place in the chain: lower first; equal priorities keep registration order.",
    ),
    key(
        "guard.mode",
        Kind::Enum(guardmesh_proto::v1::GuardMode::NAMES),
        "\"enforce\"",
        "`dry_run`: the guard is consulted and traced, its verdict not applied.",
    ),
    key(
        "guard.server_identity",
        Kind::Str,
        "",
        "For `https://` endpoints: the identity (URI SAN or name) the guard must present.",
    ),
    key(
        "guard.grant",
        Kind::Table,
        "",
        "For a mutate guard: what it may rewrite.",
    ),
    key(
        "guard.grant.tools",
        Kind::Strs,
        "[]",
        "Globs of the tools whose calls it may rewrite.",
    ),
    key(
        "guard.grant.may_rename",
        Kind::Bool,
        "false",
        "It may change a call's tool name.",
    ),
    key(
        "guard.phases",
        Kind::Enum(guardmesh_proto::v1::GuardPhases::NAMES),
        "\"calls\"",
        "What the guard judges (R33): calls before they run, results before the model reads them, or both.",
    ),
    key(
        "guard.result_grant",
        Kind::Table,
        "",
        "For a mutate guard judging results: which results it may rewrite (R11).",
    ),
    key(
        "guard.result_grant.tools",
        Kind::Strs,
        "[]",
        "Globs of the tools whose results it may rewrite.",
    ),
    key(
        "guard.session_memory",
        Kind::Enum(guardmesh_proto::v1::SessionMemoryUse::NAMES),
        "\"send\"",
        "Whether the guard is sent its batch's session memory (R34); `none` opts out.",
    ),
    // [registry]
    key(
        "registry",
        Kind::Table,
        "",
        "Where the chain of guards lives.",
    ),
    key(
        "registry.kind",
        Kind::Enum(&["memory", "etcd"]),
        "\"memory\"",
        "`memory`: in this process; `etcd`: shared by every replica with the same prefix.",
    ),
    key(
        "registry.endpoints",
        Kind::Strs,
        "[\"http://127.0.0.1:2379\"]",
        "etcd client URLs (`https://` needs the `etcd-tls` build feature).",
    ),
    key(
        "registry.prefix",
        Kind::Str,
        "\"/guardmesh\"",
        "Key prefix of the chain: replicas with the same prefix share it.",
    ),
    key("registry.username", Kind::Str, "", "etcd user name."),
    key(
        "registry.password",
        Kind::Str,
        "",
        "etcd password; prefer password_env.",
    ),
    key(
        "registry.password_env",
        Kind::Str,
        "",
        "Name of an environment variable holding the etcd password.",
    ),
    key(
        "registry.ca_file",
        Kind::Path,
        "",
        "PEM roots for etcd's certificate.",
    ),
    key(
        "registry.cert_file",
        Kind::Path,
        "",
        "PEM client certificate for etcd's client-certificate auth.",
    ),
    key(
        "registry.key_file",
        Kind::Path,
        "",
        "PEM private key of cert_file.",
    ),
    key(
        "registry.tls_domain",
        Kind::Str,
        "",
        "Name to verify etcd's certificate against, when not the endpoint's host.",
    ),
    key(
        "registry.dial_timeout_ms",
        Kind::Int,
        "5000",
        "How long start-up may try to reach etcd, in milliseconds.",
    ),
    key(
        "registry.request_timeout_ms",
        Kind::Int,
        "2000",
        "Deadline of each etcd request, in milliseconds.",
    ),
    key(
        "registry.heartbeat_interval_ms",
        Kind::Int,
        "1000",
        "How often a replica confirms its chain and a guard heartbeat renews, in milliseconds.",
    ),
    key(
        "registry.lease_ttl_s",
        Kind::Int,
        "10",
        "Time to live of a guard's heartbeat lease, in seconds.",
    ),
    key(
        "registry.staleness_window_ms",
        Kind::Int,
        "30000",
        "How long a replica that lost etcd keeps judging with its last chain, in milliseconds.",
    ),
    key(
        "registry.after_window",
        Kind::Enum(&["refuse", "serve_stale"]),
        "\"refuse\"",
        "After the staleness window: refuse batches (UNAVAILABLE) or keep judging with the stale chain.",
    ),
    key(
        "registry.max_policy_bytes_per_identity",
        Kind::Int,
        "67108864",
        "Bytes of compiled policies the guards one identity registered may hold together (R25).",
    ),
    // [sessions]
    key(
        "sessions",
        Kind::Table,
        "",
        "Where the memory kept per session for rules that read `session` lives, and its bounds (R34).",
    ),
    key(
        "sessions.store",
        Kind::Enum(&["registry", "memory", "redis"]),
        "\"registry\"",
        "Where session memory is kept: `registry` (etcd when the registry is etcd, shared by the replicas; else this mesh's memory), `memory` (this mesh's memory, never shared: each replica remembers only what it saw) or `redis` (Redis or Valkey at `redis_url`, shared).",
    ),
    key(
        "sessions.redis_url",
        Kind::Str,
        "",
        "With store = \"redis\": `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS verified against the system's roots; start-up tries for `registry.dial_timeout_ms`.",
    ),
    key(
        "sessions.redis_password_file",
        Kind::Path,
        "",
        "With store = \"redis\": a file holding Redis's password (a final newline is dropped), used instead of one in the URL.",
    ),
    key(
        "sessions.secret_file",
        Kind::Path,
        "",
        "A file whose bytes (at least 32) key the digests of values seen; required with a shared store (etcd or redis), the same file on every replica, never written into the store. Create one with `head -c 32 /dev/urandom > FILE`. Unset with a single mesh: a random secret per process.",
    ),
    key(
        "sessions.store_timeout_ms",
        Kind::Int,
        "500",
        "Deadline of each read or update of a session in the store, in milliseconds; past it the rules that read `session` fail per their guard's failure policy.",
    ),
    key(
        "sessions.max_bytes",
        Kind::Int,
        "16384",
        "Bytes one session's memory may hold; past it the oldest entries go first.",
    ),
    key(
        "sessions.max_entries",
        Kind::Int,
        "1024",
        "Entries (calls, labels, values seen) one session may hold; past it the oldest go first.",
    ),
    key(
        "sessions.max_age_ms",
        Kind::Int,
        "86400000",
        "Entries older than this are dropped.",
    ),
    key(
        "sessions.max_labels",
        Kind::Int,
        "64",
        "Labels one session may hold; past it the oldest go first.",
    ),
    key(
        "sessions.max_label_bytes",
        Kind::Int,
        "128",
        "Bytes of one label; a longer one is refused.",
    ),
    key(
        "sessions.max_values_per_result",
        Kind::Int,
        "256",
        "Digests kept of the values of one result.",
    ),
    key(
        "sessions.max_sessions",
        Kind::Int,
        "4096",
        "Sessions a mesh keeps in its own memory (a shared store bounds them by `max_age_ms` instead); past it the least recently updated goes.",
    ),
    key(
        "sessions.max_sessions_per_identity",
        Kind::Int,
        "1024",
        "Sessions one identity may have in the mesh's own memory; past it its least recently updated goes.",
    ),
    // [decision_log]
    key(
        "decision_log",
        Kind::Table,
        "",
        "One record per batch answered and per chain change (R29); absent: no log.",
    ),
    required(
        "decision_log.dir",
        Kind::Path,
        "The log's directory (created if missing; one mesh per directory).",
    ),
    key(
        "decision_log.max_file_bytes",
        Kind::Int,
        "67108864",
        "A file is rotated before it would grow past this size, in bytes.",
    ),
    key(
        "decision_log.durability",
        Kind::Enum(&["every_record", "interval"]),
        "\"every_record\"",
        "`every_record`: a batch is answered once its record is synced to disk; `interval`: synced every sync_interval_ms.",
    ),
    key(
        "decision_log.sync_interval_ms",
        Kind::Int,
        "100",
        "With durability = \"interval\": most time between a write and its fsync, in milliseconds.",
    ),
    key(
        "decision_log.mask",
        Kind::Strs,
        "[]",
        "Masking rules applied before anything is written: key names, globs (`*.api_key`), paths (`$.headers.authorization`).",
    ),
    key(
        "decision_log.mask_formats",
        Kind::Strs,
        "[\"private-key\", \"aws-access-key\", \"github-token\", \"stripe-live-key\"]",
        "Secret formats masked wherever they appear in a record (values, member names, free text), whatever the key; `[]`: none.",
    ),
    key(
        "decision_log.on_log_failure",
        Kind::Enum(&["refuse", "answer"]),
        "\"refuse\"",
        "A batch whose record cannot be written is refused UNAVAILABLE, or answered and the loss counted.",
    ),
    key(
        "decision_log.instance",
        Kind::Str,
        "",
        "The mesh instance written in every record; unset: the listen address.",
    ),
    key(
        "decision_log.otlp",
        Kind::Bool,
        "false",
        "Also export every record as an OpenTelemetry log record, where the OTEL_EXPORTER_OTLP_* variables say.",
    ),
    key(
        "decision_log.signing_key",
        Kind::Path,
        "",
        "Ed25519 private key (PKCS#8 PEM, `guardmesh log keygen`) that signs checkpoints; unset: no checkpoints.",
    ),
    key(
        "decision_log.checkpoint_every",
        Kind::Int,
        "1000",
        "With a key: a checkpoint at least every this many records.",
    ),
    key(
        "decision_log.checkpoint_interval_ms",
        Kind::Int,
        "10000",
        "With a key: a checkpoint at most this long after a record it does not seal yet, in milliseconds (at least 100).",
    ),
    key(
        "decision_log.witness",
        Kind::Path,
        "",
        "With a key: every checkpoint is also appended to this file (or to checkpoints-<key id>.jsonl in this directory).",
    ),
    key(
        "decision_log.allow_gap",
        Kind::Bool,
        "false",
        "With a key: start on a log that ends before its latest checkpoint, after a signed gap record.",
    ),
    key(
        "decision_log.max_dir_bytes",
        Kind::Int,
        "",
        "Most bytes the log's files may hold together; unset: no budget.",
    ),
    key(
        "decision_log.refusal_interval_ms",
        Kind::Int,
        "10000",
        "Interval of the bounds on refusal records, in milliseconds.",
    ),
    key(
        "decision_log.refusal_records_per_peer",
        Kind::Int,
        "20",
        "Refusal records per peer address per interval.",
    ),
    key(
        "decision_log.refusal_bytes_per_peer",
        Kind::Int,
        "32768",
        "Bytes of refusal records per peer address per interval.",
    ),
    key(
        "decision_log.refusal_records",
        Kind::Int,
        "200",
        "Refusal records of the whole mesh per interval.",
    ),
    key(
        "decision_log.refusal_bytes",
        Kind::Int,
        "262144",
        "Bytes of refusal records of the whole mesh per interval.",
    ),
];

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
            Self::Address { at, .. } => format!("write {} = \"127.0.0.1:9090\"", leaf(&at.key)),
            Self::Missing { at } => {
                let example = find(&path(at)).map(example).unwrap_or_default();
                format!("add {}{example}", leaf(&at.key))
            }
        }
    }
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

/// The section a key is listed under in the reference: its top-level
/// table, or `""` for top-level keys.
fn section(key: &Key) -> &'static str {
    match key.path.split_once('.') {
        Some((top, _)) => top,
        None if key.kind.is_table() => key.path,
        None => "",
    }
}

const PATHS: &str = "Relative paths (every key of type path) are relative to the folder of \
                     the config file, whatever the working directory the mesh starts in.";

const EXIT_CODES: &str = "`guardmesh config check FILE` reports every error it finds with its \
                          line, key and what to write instead, and exits 0 when the file is \
                          valid (warnings are printed), 1 when it is not (a syntax, key or \
                          value error, or a policy, certificate, key or token file it names \
                          that is missing, unreadable or does not parse), and 2 when the \
                          check cannot run (the config file cannot be read, or a usage error).";

/// The reference as plain text: every key with its type, default and
/// meaning.
pub fn reference_text() -> String {
    let mut out = String::new();
    let _ = writeln!(out, "guardmesh config file reference (TOML)\n");
    let _ = writeln!(out, "{PATHS}\n");
    for key in KEYS {
        let name = match key.kind {
            Kind::Table => format!("[{}]", key.path),
            Kind::Tables => format!("[[{}]]", key.path),
            _ => key.path.to_owned(),
        };
        let _ = writeln!(out, "{name}");
        if !key.kind.is_table() {
            let _ = writeln!(
                out,
                "    type: {}; default: {}",
                key.kind.describe(),
                default_text(key)
            );
        }
        let _ = writeln!(out, "    {}", key.meaning);
    }
    out
}

fn default_text(key: &Key) -> String {
    match (key.required, key.default) {
        (true, _) => "required".into(),
        (false, "") => "unset".into(),
        (false, default) => default.to_owned(),
    }
}

/// The reference as Markdown, the text of `docs/configuration.md`.
pub fn reference_markdown() -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Configuration reference\n");
    let _ = writeln!(
        out,
        "<!-- Generated by `guardmesh config reference --markdown`; do not edit by hand. -->\n"
    );
    let _ = writeln!(
        out,
        "The mesh reads one TOML file (`guardmesh serve --config FILE`). Every key has a \
         default unless marked required; a key not listed here is refused at start.\n"
    );
    let _ = writeln!(out, "{PATHS}\n");
    let _ = writeln!(out, "{EXIT_CODES}\n");
    let mut current = None;
    for key in KEYS {
        let section = section(key);
        if current != Some(section) {
            if current.is_some() {
                out.push('\n');
            }
            current = Some(section);
            match find(section).filter(|_| !section.is_empty()) {
                None => {
                    let _ = writeln!(out, "## Top level\n");
                }
                Some(table) => {
                    let header = match table.kind {
                        Kind::Tables => format!("[[{}]]", table.path),
                        _ => format!("[{}]", table.path),
                    };
                    let _ = writeln!(out, "## `{header}`\n\n{}\n", table.meaning);
                }
            }
            let _ = writeln!(out, "| Key | Type | Default | Meaning |");
            let _ = writeln!(out, "|---|---|---|---|");
        }
        if key.path == section {
            continue;
        }
        let name = match key.kind {
            Kind::Tables => format!("`[[{}]]`", key.path),
            Kind::Table => format!("`[{}]`", key.path),
            _ => format!("`{}`", key.path),
        };
        let default = match default_text(key).as_str() {
            "required" => "required".to_owned(),
            "unset" => "unset".to_owned(),
            _ if key.kind.is_table() => String::new(),
            other => format!("`{}`", other.replace('|', "\\|")),
        };
        let _ = writeln!(
            out,
            "| {name} | {} | {default} | {} |",
            key.kind.describe().replace('|', "\\|"),
            key.meaning.replace('|', "\\|")
        );
    }
    out
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

    #[test]
    fn the_reference_prints_every_key_with_its_type_and_default() {
        let text = reference_text();
        let markdown = reference_markdown();
        for key in KEYS {
            assert!(text.contains(key.path), "{}", key.path);
            assert!(markdown.contains(key.path), "{}", key.path);
            assert!(text.contains(key.meaning), "{}", key.path);
        }
        assert!(text.contains("type: integer; default: 256"));
        assert!(markdown.contains("relative to the folder of the config file"));
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

    /// A config named by a relative path with a folder in it (as a user
    /// types `guardmesh serve --config examples/flows/mesh.toml`) reads its
    /// policy file from its own folder, not from that folder joined twice.
    /// Unit tests run in the server crate's folder, so the repository's
    /// example is `../examples/flows/mesh.toml` from here.
    #[test]
    fn a_relative_config_path_reads_its_policy_from_its_own_folder() {
        let config = Config::load(std::path::Path::new("../examples/flows/mesh.toml"))
            .unwrap_or_else(|e| panic!("{e}"));
        let source = config.guards[0].policy_source.as_deref().unwrap_or("");
        assert!(source.contains("fs-values-stay-on-fs"), "{source}");
    }
}
