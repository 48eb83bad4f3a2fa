//! The decision log (R29): one record per batch answered and per chain
//! change, masked, hash-chained, appended before the answer leaves.
//!
//! * [`record`]: the record types, the format of one line;
//! * [`mask`]: masking sensitive values by key name and path, and
//!   scrubbing them from free text, log lines and spans;
//! * [`budget`]: the log directory's budget (`max_dir_bytes`);
//! * [`chain`]: how a line is sealed with its own hash and linked to the
//!   one before;
//! * [`checkpoint`]: checkpoints signed with the writer's Ed25519 key, the
//!   witness, the restart check, and [`gap`](record::GapRecord) records;
//! * [`segment`]: the log's files and their names;
//! * [`writer`]: [`DecisionLog`], the append-only writer (group commit,
//!   rotation by size, fsync per record or per interval, resuming);
//! * [`read`]: [`LogReader`], which reads the log's files in order,
//!   verifying each line as it reads it, and reads on as the log grows;
//! * [`verify`](mod@verify): [`verify()`](verify::verify), which names the first
//!   record that breaks the chain;
//! * [`from_mesh`]: the mesh's batches, answers and registrations as
//!   records, and [`MeshLog`], the log with its failure policy
//!   (`on_log_failure`);
//! * [`error`]: what opening and appending can fail with, [`LogError`];
//! * [`anchor`]: the etcd anchor of the checkpoints, when the registry is
//!   etcd;
//! * [`otlp`]: the optional export of the records as OpenTelemetry log
//!   records.
//!
//! The format is described for readers by the JSON Schema
//! `docs/decision-log.schema.json`.

pub mod anchor;
pub mod budget;
pub mod chain;
pub mod checkpoint;
pub mod error;
pub mod from_mesh;
pub mod mask;
pub mod otlp;
pub mod read;
pub mod record;
pub mod segment;
pub mod verify;
pub mod writer;

#[cfg(test)]
mod tests;

pub use budget::{BudgetReached, DirBudget};
pub use chain::GENESIS;
pub use checkpoint::{KeyError, SealConfig};
pub use error::LogError;
pub use from_mesh::{LogLimits, MeshLog, OnLogFailure, RefusalLimits};
pub use mask::{Held, MASKED, MaskError, MaskRules, OMITTED, Secrets, scrub_live};
pub use read::{LogReader, ReadLine};
pub use record::{
    Action, BatchRecord, CallDecisionRecord, CallRecord, Caller, ChainChangeRecord, ChangeKind,
    ChangeOutcome, ChangeStatus, CheckpointRecord, DecisionRecord, Entry, FORMAT_VERSION,
    GapRecord, GuardRole, GuardTraceRecord, LogRecord, Outcome, OutcomeStatus, PeerCount,
    RefusalSummaryRecord, TraceStatus,
};
pub use verify::{
    BadRecord, RecordRef, VerifyError, VerifyOptions, VerifyReport, verify, verify_with,
};
pub use writer::{Appended, DecisionLog, Durability, LogConfig};
