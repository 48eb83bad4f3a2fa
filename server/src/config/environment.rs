//! The environment variables guardmesh reads, for the reference
//! (`guardmesh config reference`, `docs/configuration.md`). A test reads
//! the source of every crate for the variables it reads and checks that
//! each one is here (tests/config_check.rs): the page follows the code.

/// One environment variable.
#[derive(Debug, Clone, Copy)]
pub struct EnvVar {
    /// Its name; a name ending in `*` stands for a family.
    pub name: &'static str,
    /// The commands that read it.
    pub read_by: &'static str,
    pub meaning: &'static str,
}

/// Every environment variable guardmesh reads, in the order the reference
/// lists them.
pub static ENVIRONMENT: &[EnvVar] = &[
    EnvVar {
        name: "RUST_LOG",
        read_by: "every command that logs (`serve`, `mcp`, `hook`, ...)",
        meaning: "What is logged on stderr, as `tracing-subscriber`'s filter \
                  (`info`, `guardmesh_server=debug,h2=warn`); default `info`. The format is \
                  `--log-format human|json`.",
    },
    EnvVar {
        name: "GUARDMESH_WORKER_THREADS",
        read_by: "every command (`--worker-threads`)",
        meaning: "Runtime threads: 1 runs everything on one thread, 0 one worker per core; \
                  default 1 on up to 2 cores, one per core above.",
    },
    EnvVar {
        name: "GUARDMESH_MESH",
        read_by: "the commands that talk to a mesh (`guards`, `evaluate`, `replay --mesh`, \
                  `mcp`, `hook`; `--mesh`)",
        meaning: "The mesh's address, `host:port` or `http(s)://host:port`.",
    },
    EnvVar {
        name: "GUARDMESH_TOKEN",
        read_by: "the commands that talk to a mesh (`--token`)",
        meaning: "The bearer token sent on every call (R24); `--token-file` wins over it. \
                  Never shown in `--help`.",
    },
    EnvVar {
        name: "GUARDMESH_HIDE_SKIPPED_TOOLS",
        read_by: "`mcp` (`--hide-skipped-tools`)",
        meaning: "`true`: `tools/list` answers leave out the tools the chain skips whatever \
                  the arguments (asked of the mesh; a mesh that cannot be asked shows every \
                  tool). Calls are judged either way; default off.",
    },
    EnvVar {
        name: "registry.password_env",
        read_by: "`serve`, `log verify --config`",
        meaning: "The variable `[registry] password_env` names holds etcd's password (for \
                  example `GUARDMESH_ETCD_PASSWORD`).",
    },
    EnvVar {
        name: "OTEL_TRACES_EXPORTER",
        read_by: "`serve`, `mcp`",
        meaning: "`otlp` exports spans, `none` does not; unset: exported when an OTLP \
                  endpoint variable is set.",
    },
    EnvVar {
        name: "OTEL_EXPORTER_OTLP_ENDPOINT",
        read_by: "`serve`, `mcp`",
        meaning: "Where spans (and, with `[decision_log] otlp = true`, decision records) are \
                  exported; `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and \
                  `OTEL_EXPORTER_OTLP_LOGS_ENDPOINT` per signal. An `https://` endpoint over \
                  `http/protobuf` is refused.",
    },
    EnvVar {
        name: "OTEL_EXPORTER_OTLP_PROTOCOL",
        read_by: "`serve`, `mcp`",
        meaning: "`grpc` (default) or `http/protobuf`; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` \
                  and `OTEL_EXPORTER_OTLP_LOGS_PROTOCOL` per signal. Another value is refused \
                  at start, naming the variable.",
    },
    EnvVar {
        name: "OTEL_EXPORTER_OTLP_TIMEOUT",
        read_by: "`serve`, `mcp`",
        meaning: "Milliseconds per export, default 10000; \
                  `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` and `OTEL_EXPORTER_OTLP_LOGS_TIMEOUT` \
                  per signal.",
    },
    EnvVar {
        name: "OTEL_EXPORTER_OTLP_HEADERS",
        read_by: "`serve`, `mcp` (the OpenTelemetry SDK)",
        meaning: "Headers sent with every export (`key=value,...`), and the per-signal \
                  `_TRACES_` and `_LOGS_` variants.",
    },
    EnvVar {
        name: "OTEL_SERVICE_NAME",
        read_by: "`serve`, `mcp`",
        meaning: "The service name on spans and exported records; default `guardmesh`.",
    },
    EnvVar {
        name: "OTEL_RESOURCE_ATTRIBUTES",
        read_by: "`serve`, `mcp` (the OpenTelemetry SDK)",
        meaning: "More resource attributes (`key=value,...`).",
    },
    EnvVar {
        name: "OTEL_TRACES_SAMPLER",
        read_by: "`serve`, `mcp` (the OpenTelemetry SDK)",
        meaning: "The sampler (`parentbased_traceidratio`, ...) and `OTEL_TRACES_SAMPLER_ARG` \
                  its argument.",
    },
    EnvVar {
        name: "CREDENTIALS_DIRECTORY",
        read_by: "`serve`, `config check`",
        meaning: "The folder systemd passes a unit's `LoadCredential=` files in: a config \
                  path starting with `$CREDENTIALS_DIRECTORY/` is read from it.",
    },
    EnvVar {
        name: "NOTIFY_SOCKET",
        read_by: "`serve` (under systemd, `Type=notify`)",
        meaning: "Where readiness (`READY=1` once the listener is up), stopping and the \
                  watchdog's keep-alives are sent; `WATCHDOG_USEC` sets the watchdog's \
                  period. Unset: nothing is sent.",
    },
    EnvVar {
        name: "GUARDMESH_COMMIT",
        read_by: "the build (`cargo build`), not the binary",
        meaning: "The commit `guardmesh --version` names, for a build from sources without \
                  git history (a packager's tarball); otherwise read from git.",
    },
    EnvVar {
        name: "OTEL_SEMCONV_STABILITY_OPT_IN",
        read_by: "`serve`",
        meaning: "`rpc`: spans carry the current RPC semantic conventions instead of the \
                  older ones.",
    },
];

/// Whether `name` is listed, itself or as a per-signal variant of a
/// listed `OTEL_EXPORTER_OTLP_*` variable or named in one's meaning.
pub fn listed(name: &str) -> bool {
    ENVIRONMENT
        .iter()
        .any(|var| var.name == name || var.meaning.contains(&format!("`{name}`")))
}
