//! `guardmesh log`: reads the decision log (R29).
//!
//! * `verify PATH [--key PUB [--witness PATH | --checkpoint FILE |
//!   --etcd ENDPOINTS --instance NAME | --config MESH.toml]]` checks the hash chain and, with
//!   the writer's public key, the signed checkpoints, and with an outside
//!   checkpoint (a witness, a file, or the etcd anchor) that the log was
//!   not cut before it or rewritten after it;
//! * `show PATH [filters] [--json | --jsonl] [--follow]` and `tail`: the
//!   decisions, verified as read (see `log_show`);
//! * `keygen --out FILE` writes a signing key for `[decision_log]
//!   signing_key` and its public key.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Subcommand;
use guardmesh_server::decision_log::anchor::{
    AnchorClient, AnchorConfig, EtcdConfig, anchor_key, default_instance,
};
use guardmesh_server::decision_log::{self, VerifyOptions, checkpoint};

#[derive(Subcommand)]
pub(crate) enum LogAction {
    /// Checks the hash chain of a decision log (its directory, or one of
    /// its files); exits non-zero naming the first record that breaks it.
    /// With --key, also its signed checkpoints; with --witness or
    /// --checkpoint, also that it holds the latest checkpoint kept outside.
    Verify {
        path: PathBuf,
        /// The writer's public key (PEM): checkpoints must verify with it.
        #[arg(long)]
        key: Option<PathBuf>,
        /// The witness file, or the directory holding it: the log must hold
        /// its last checkpoint.
        #[arg(long, requires = "key", conflicts_with = "checkpoint")]
        witness: Option<PathBuf>,
        /// A file whose last line is a checkpoint exported from the log
        /// (e.g. from the OTLP export): the log must hold it.
        #[arg(long, requires = "key", conflicts_with = "etcd")]
        checkpoint: Option<PathBuf>,
        /// etcd client URLs (comma-separated): the log must hold the
        /// checkpoint the mesh anchored there (needs --instance).
        #[arg(
            long,
            requires_all = ["key", "instance"],
            conflicts_with = "witness",
            value_delimiter = ','
        )]
        etcd: Vec<String>,
        /// The registry's key prefix the mesh ran with.
        #[arg(long, default_value = "/guardmesh", requires = "etcd")]
        etcd_prefix: String,
        /// The mesh instance whose anchor is read: `[decision_log]
        /// instance`, or `HOST:LOG_DIR` when it is not set.
        #[arg(long)]
        instance: Option<String>,
        /// The mesh's config file: read the etcd anchor with its
        /// `[registry]` (endpoints, prefix, user and password or
        /// password_env, TLS files) and its `[decision_log]` instance, as
        /// the mesh wrote it (instead of --etcd and --etcd-prefix).
        #[arg(long, requires = "key", conflicts_with_all = ["etcd", "witness", "checkpoint"])]
        config: Option<PathBuf>,
        /// Reports gap records (a restart on a shortened log, allowed by
        /// `allow_gap`) instead of failing on them.
        #[arg(long)]
        allow_gap: bool,
    },
    /// Prints the decisions of a decision log, one line each (or JSON),
    /// verifying the chain as it reads; filters by time, batch, session,
    /// tool, guard, rule, action, failure and caller; --follow reads on as
    /// the log grows and rotates. Exits 1, naming the record, when the log
    /// does not verify.
    Show(crate::log_show::ShowArgs),
    /// Prints the last decisions of a decision log (as `show`), then with
    /// --follow the new ones as they are written.
    Tail {
        /// How many of the last decisions to print.
        #[arg(long, short = 'n', default_value_t = 10)]
        lines: usize,
        #[command(flatten)]
        show: crate::log_show::ShowArgs,
    },
    /// Writes a new Ed25519 signing key for `[decision_log] signing_key`
    /// (PKCS#8 PEM, mode 0600, never overwriting a file) and its public key
    /// to FILE.pub, and prints the public key.
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
}

/// Runs a `guardmesh log` command: 0 when it holds, 1 when the log does
/// not verify, 2 when the command cannot run.
pub(crate) fn run(action: LogAction) -> ExitCode {
    match action {
        LogAction::Show(show) => crate::log_show::run(&show, None),
        LogAction::Tail { lines, show } => crate::log_show::run(&show, Some(lines)),
        LogAction::Keygen { out } => match checkpoint::generate(&out) {
            Ok(key) => {
                out!("{}", key.public_pem);
                eprintln!(
                    "wrote the private key to {} and the public key to {} (key id {})",
                    key.private_path.display(),
                    key.public_path.display(),
                    key.key_id
                );
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("error: {error}");
                ExitCode::from(2)
            }
        },
        LogAction::Verify {
            path,
            key,
            witness,
            checkpoint,
            etcd,
            etcd_prefix,
            instance,
            config,
            allow_gap,
        } => {
            let key = match key
                .as_deref()
                .map(checkpoint::read_verifying_key)
                .transpose()
            {
                Ok(key) => key,
                Err(error) => {
                    eprintln!("error: {error}");
                    return ExitCode::from(2);
                }
            };
            let anchor = match (config, etcd.is_empty()) {
                (Some(config), _) => match anchor_from_config(&config, instance) {
                    Ok(anchor) => Some(anchor),
                    Err(error) => {
                        eprintln!("error: {error}");
                        return ExitCode::from(2);
                    }
                },
                (None, false) => match instance {
                    Some(instance) => Some(AnchorConfig {
                        etcd: EtcdConfig::plain(etcd, &etcd_prefix),
                        instance,
                    }),
                    None => {
                        eprintln!("error: --etcd needs --instance (or use --config)");
                        return ExitCode::from(2);
                    }
                },
                (None, true) => {
                    if instance.is_some() {
                        // Without a source to read the anchor from, the
                        // instance would be ignored and the log checked
                        // without the anchor the user asked for.
                        eprintln!(
                            "error: --instance names whose etcd anchor to read: \
                             give --etcd ENDPOINTS or --config MESH.toml with it"
                        );
                        return ExitCode::from(2);
                    }
                    None
                }
            };
            let anchor_line = match (&key, anchor) {
                (Some(key), Some(anchor)) => {
                    match read_etcd_anchor(&anchor, &checkpoint::key_id(key)) {
                        Ok(line) => Some(line),
                        Err(error) => {
                            eprintln!("error: {error}");
                            return ExitCode::from(2);
                        }
                    }
                }
                _ => None,
            };
            let options = VerifyOptions {
                key,
                anchor: witness.or(checkpoint),
                anchor_line,
                allow_gap,
            };
            verify(&path, &options)
        }
    }
}

/// Where the mesh of the config file at `path` anchors its checkpoints:
/// its etcd registry's endpoints, prefix, credentials and TLS files, and
/// its decision log's instance (`instance` overrides it).
fn anchor_from_config(path: &Path, instance: Option<String>) -> Result<AnchorConfig, String> {
    use guardmesh_server::config::{Config, RegistryKind};
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut config =
        Config::parse(&text, &path.display().to_string()).map_err(|e| e.to_string())?;
    // As `serve` reads it: files relative to the config's folder.
    config.resolve_paths(Config::folder_of(path));
    if config.registry.kind != RegistryKind::Etcd {
        return Err(format!(
            "{}: [registry] kind is not \"etcd\": the mesh anchored nothing in etcd",
            path.display()
        ));
    }
    let registry = config.registry.etcd().map_err(|e| e.to_string())?;
    let instance = match (instance, &config.decision_log) {
        (Some(instance), _) => instance,
        (None, Some(log)) => log
            .instance
            .clone()
            .unwrap_or_else(|| default_instance(&log.dir)),
        (None, None) => {
            return Err(format!(
                "{}: no [decision_log] section; name the instance with --instance",
                path.display()
            ));
        }
    };
    Ok(AnchorConfig {
        etcd: registry,
        instance,
    })
}

/// The checkpoint line `anchor` names, for the log signed with the key
/// `key_id`.
fn read_etcd_anchor(anchor: &AnchorConfig, key_id: &str) -> Result<Vec<u8>, String> {
    let name = anchor_key(&anchor.etcd.prefix, key_id, &anchor.instance);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| format!("cannot start a runtime: {err}"))?;
    runtime.block_on(async {
        let mut client = AnchorClient::connect(&anchor.etcd)
            .await
            .map_err(|err| err.to_string())?;
        match client.get(&name).await.map_err(|err| err.to_string())? {
            Some(line) => Ok(line),
            None => Err(format!(
                "no checkpoint anchored in etcd at {name} (check the prefix, the instance and --key)"
            )),
        }
    })
}

fn verify(path: &std::path::Path, options: &VerifyOptions) -> ExitCode {
    match decision_log::verify_with(path, options) {
        Ok(report) => {
            outln!(
                "ok: {} records in {} files, {} with masked values",
                report.records,
                report.files.len(),
                report.masked_records
            );
            if let Some(last) = &report.last {
                outln!(
                    "head: seq {} id {} hash {} ({}:{})",
                    last.seq,
                    last.id,
                    last.hash,
                    last.file.display(),
                    last.line
                );
            }
            if report.signatures_checked {
                outln!(
                    "signatures: {} checkpoints verified; {} records after the last one{}",
                    report.checkpoints,
                    report.unsealed,
                    if report.closed {
                        " (the log ends with the mesh's closing checkpoint)"
                    } else {
                        " (not sealed yet: a running mesh, or one that stopped without closing)"
                    }
                );
                for (seq, missing) in &report.gaps {
                    outln!(
                        "gap: at seq {seq}, the mesh restarted on a log missing the checkpoint at seq {missing}"
                    );
                }
                match report.anchored_at {
                    Some(seq) => {
                        outln!("anchor: the log holds the outside checkpoint at seq {seq}")
                    }
                    None => outln!(
                        "anchor: none given; a cut at the end of the log is not detected (--witness, --checkpoint or --etcd)"
                    ),
                }
            } else {
                outln!(
                    "signatures: none checked (no --key): a rewritten, cut or appended log is not detected"
                );
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: decision log does not verify: {error}");
            ExitCode::FAILURE
        }
    }
}
