//! The decision log (R29): one record per batch answered and per chain
//! change, masked, hash-chained, appended before the answer leaves.
//!
//! * [`record`]: the record types, the format of one line;
//! * [`mask`]: masking sensitive values by key name and path;
//! * [`segment`]: the log's files and their names.
//!
//! The format is described for readers by the JSON Schema
//! `docs/decision-log.schema.json`.

pub mod mask;
pub mod record;
pub mod segment;

pub use mask::{MASKED, MaskError, MaskRules, OMITTED};
pub use record::{
    Action, BatchRecord, CallDecisionRecord, CallRecord, Caller, ChainChangeRecord, ChangeKind,
    ChangeOutcome, ChangeStatus, DecisionRecord, Entry, FORMAT_VERSION, GuardRole,
    GuardTraceRecord, LogRecord, Outcome, OutcomeStatus, TraceStatus,
};
