//! `[decision_log]`: one record per batch answered and per chain change
//! (R29).

use super::describe::table;
use super::{Config, DecisionLogError, LogSettingError, RegistryKind, millis};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

table! {
    /// `[decision_log]` (R29).
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct DecisionLogConfig {
        /// The log's directory (created if missing; one mesh per directory).
        pub dir: PathBuf,
        /// A file is rotated before it would grow past this size, in bytes.
        #[serde(default = "default_max_file_bytes")]
        pub max_file_bytes: u64,
        // The sync is an fdatasync shared by concurrent batches; with
        // `interval` a batch is answered once its record is written to the
        // file.
        /// `every_record`: a batch is answered once its record is synced to
        /// disk; `interval`: synced every sync_interval_ms.
        #[serde(default)]
        pub durability: DurabilityConfig,
        /// With durability = "interval": most time between a write and its
        /// fsync, in milliseconds.
        #[serde(default = "default_sync_interval_ms")]
        pub sync_interval_ms: u64,
        /// Masking rules applied before anything is written: key names, globs
        /// (`*.api_key`), paths (`$.headers.authorization`).
        #[serde(default)]
        pub mask: Vec<String>,
        // Default: all of them (`crate::secret_formats::KINDS`).
        /// Secret formats masked wherever they appear in a record (values,
        /// member names, free text), whatever the key; `[]`: none.
        #[serde(default = "default_mask_formats")]
        pub mask_formats: Vec<String>,
        /// A batch whose record cannot be written is refused UNAVAILABLE, or
        /// answered and the loss counted.
        #[serde(default)]
        pub on_log_failure: crate::decision_log::OnLogFailure,
        /// The mesh instance written in every record; unset: the listen
        /// address.
        #[serde(default)]
        pub instance: Option<String>,
        // Over OTLP/gRPC; the file stays the source of truth.
        /// Also export every record as an OpenTelemetry log record, where the
        /// OTEL_EXPORTER_OTLP_* variables say.
        #[serde(default)]
        pub otlp: bool,
        /// Ed25519 private key (PKCS#8 PEM, `guardmesh log keygen`) that signs
        /// checkpoints; unset: no checkpoints.
        #[serde(default)]
        pub signing_key: Option<PathBuf>,
        /// With a key: a checkpoint at least every this many records.
        #[serde(default = "default_checkpoint_every")]
        pub checkpoint_every: u64,
        /// With a key: a checkpoint at most this long after a record it does
        /// not seal yet, in milliseconds (at least 100).
        #[serde(default = "default_checkpoint_interval_ms")]
        pub checkpoint_interval_ms: u64,
        // Appended and fsynced; put it on another mount.
        /// With a key: every checkpoint is also appended to this file (or to
        /// checkpoints-<key id>.jsonl in this directory).
        #[serde(default)]
        pub witness: Option<PathBuf>,
        // Else the mesh refuses to start on such a log.
        /// With a key: start on a log that ends before its latest checkpoint,
        /// after a signed gap record.
        #[serde(default)]
        pub allow_gap: bool,
        // Past nine tenths refusal records are left out (counted in
        // summaries); at the budget records cannot be written and
        // `on_log_failure` applies.
        /// Most bytes the log's files may hold together; unset: no budget.
        #[serde(default)]
        pub max_dir_bytes: Option<u64>,
        /// Interval of the bounds on refusal records, in milliseconds.
        #[serde(default = "default_refusal_interval_ms")]
        pub refusal_interval_ms: u64,
        /// Refusal records per peer address per interval.
        #[serde(default = "default_refusal_records_per_peer")]
        pub refusal_records_per_peer: u32,
        /// Bytes of refusal records per peer address per interval.
        #[serde(default = "default_refusal_bytes_per_peer")]
        pub refusal_bytes_per_peer: u64,
        /// Refusal records of the whole mesh per interval.
        #[serde(default = "default_refusal_records")]
        pub refusal_records: u32,
        /// Bytes of refusal records of the whole mesh per interval.
        #[serde(default = "default_refusal_bytes")]
        pub refusal_bytes: u64,
    }
}

fn default_mask_formats() -> Vec<String> {
    crate::secret_formats::KINDS
        .iter()
        .map(|kind| (*kind).to_owned())
        .collect()
}

fn default_checkpoint_every() -> u64 {
    crate::decision_log::checkpoint::DEFAULT_EVERY
}

fn default_checkpoint_interval_ms() -> u64 {
    crate::decision_log::checkpoint::DEFAULT_INTERVAL.as_millis() as u64
}

fn default_refusal_interval_ms() -> u64 {
    crate::decision_log::RefusalLimits::default()
        .interval
        .as_millis() as u64
}

fn default_refusal_records_per_peer() -> u32 {
    crate::decision_log::RefusalLimits::default().records_per_peer
}

fn default_refusal_bytes_per_peer() -> u64 {
    crate::decision_log::RefusalLimits::default().bytes_per_peer
}

fn default_refusal_records() -> u32 {
    crate::decision_log::RefusalLimits::default().records
}

fn default_refusal_bytes() -> u64 {
    crate::decision_log::RefusalLimits::default().bytes
}

/// `[decision_log] durability`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DurabilityConfig {
    #[default]
    EveryRecord,
    Interval,
}

fn default_max_file_bytes() -> u64 {
    64 * 1024 * 1024
}

fn default_sync_interval_ms() -> u64 {
    100
}

impl DecisionLogConfig {
    /// The bounds on refusal records and the directory's budget.
    pub fn limits(&self) -> Result<crate::decision_log::LogLimits, LogSettingError> {
        if self.refusal_interval_ms == 0 {
            return Err(LogSettingError::Zero {
                key: "refusal_interval_ms",
            });
        }
        if self.max_dir_bytes == Some(0) {
            return Err(LogSettingError::ZeroBudget);
        }
        Ok(crate::decision_log::LogLimits {
            refusals: crate::decision_log::RefusalLimits {
                interval: Duration::from_millis(self.refusal_interval_ms),
                records_per_peer: self.refusal_records_per_peer,
                bytes_per_peer: self.refusal_bytes_per_peer,
                records: self.refusal_records,
                bytes: self.refusal_bytes,
            },
            max_dir_bytes: self.max_dir_bytes,
        })
    }

    /// The writer's settings; `instance`: the default mesh instance name.
    pub fn log_config(
        &self,
        instance: &str,
    ) -> Result<crate::decision_log::LogConfig, LogSettingError> {
        let mask = crate::decision_log::MaskRules::new(&self.mask)?
            .with_formats(crate::secret_formats::Formats::named(&self.mask_formats)?);
        if self.max_file_bytes == 0 {
            return Err(LogSettingError::Zero {
                key: "max_file_bytes",
            });
        }
        let durability = match self.durability {
            DurabilityConfig::EveryRecord => crate::decision_log::Durability::EveryRecord,
            DurabilityConfig::Interval if self.sync_interval_ms == 0 => {
                return Err(LogSettingError::ZeroSync);
            }
            DurabilityConfig::Interval => crate::decision_log::Durability::Interval(
                Duration::from_millis(self.sync_interval_ms),
            ),
        };
        let seal = match &self.signing_key {
            None if self.witness.is_some() || self.allow_gap => {
                return Err(LogSettingError::NeedsKey);
            }
            None => None,
            Some(_) if self.checkpoint_every == 0 => {
                return Err(LogSettingError::Zero {
                    key: "checkpoint_every",
                });
            }
            Some(_)
                if self.checkpoint_interval_ms
                    < crate::decision_log::checkpoint::MIN_INTERVAL.as_millis() as u64 =>
            {
                return Err(LogSettingError::CheckpointInterval {
                    min: millis(crate::decision_log::checkpoint::MIN_INTERVAL),
                });
            }
            Some(key) => Some(crate::decision_log::SealConfig {
                key_file: key.clone(),
                every: self.checkpoint_every,
                interval: Duration::from_millis(self.checkpoint_interval_ms),
                witness: self.witness.clone(),
                allow_gap: self.allow_gap,
            }),
        };
        Ok(crate::decision_log::LogConfig {
            max_file_bytes: self.max_file_bytes,
            durability,
            mask,
            otlp: self.otlp,
            seal,
            ..crate::decision_log::LogConfig::new(
                &self.dir,
                self.instance.as_deref().unwrap_or(instance),
            )
        })
    }
}

impl Config {
    /// The decision log's settings for a mesh whose default instance name
    /// is `instance`; with a signing key and the etcd registry, the
    /// checkpoints are anchored in etcd under the registry's prefix, named
    /// by `[decision_log] instance`, or else by the host name and the log
    /// directory (see [`crate::decision_log::anchor`]).
    pub fn decision_log_settings(
        &self,
        section: &DecisionLogConfig,
        instance: &str,
    ) -> Result<crate::decision_log::LogConfig, DecisionLogError> {
        let mut settings = section.log_config(instance)?;
        if self.registry.kind == RegistryKind::Etcd && settings.seal.is_some() {
            let etcd = self.registry.etcd()?;
            let instance = section
                .instance
                .clone()
                .unwrap_or_else(|| crate::decision_log::anchor::default_instance(&section.dir));
            settings.anchor = Some(crate::decision_log::anchor::AnchorConfig { etcd, instance });
        }
        Ok(settings)
    }
}
