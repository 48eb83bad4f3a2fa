//! Policy guards (R27): a file of CEL rules that judges tool calls inside
//! the mesh, with no guard process and no network hop.
//!
//! * `file`: the TOML format of a policy file;
//! * `input`: what a rule sees ([`BatchInput`], [`CallInput`]) and the CEL
//!   variables `call`, `calls` and `context`, converted once per batch
//!   ([`BatchValues`]);
//! * `json`: a call's arguments parsed once into borrowed JSON;
//! * `expr`: one CEL expression compiled and checked;
//! * `functions`: which functions a rule may call (a misspelt one is
//!   refused when the policy compiles);
//! * `plan`: the fast path for the expressions policies are made of, the
//!   interpreter deciding wherever it is unsure;
//! * `patterns`: `matches`, with the patterns compiled once;
//! * `strings`: `lowerAscii`, `upperAscii`, `trim` (results no longer than
//!   their input);
//! * `shell`: `shell.commands` and `shell.has_flags`, a command line read
//!   as a POSIX shell splits it (linear in its bytes);
//! * `cost`: the bounds on size and work ([`Limits`], [`Cost`]);
//! * `meter`: the work budget of one call's evaluation, counted as it runs;
//! * `pool`: the bounded threads policies are judged on, off the runtime's
//!   I/O threads;
//! * `engine`: a compiled [`Policy`], first match in file order;
//! * `verdict`: what judging a call gives ([`Outcome`]);
//! * `cases`: [`check`] a file, and [`test`] it against a cases file;
//! * `error`: the errors, typed.
//!
//! The mesh runs it for policy guards: a registration with a `policy`
//! compiles it (`registry/spec.rs`), and `judge` evaluates it for the calls
//! the guard is sent, through the same fold as remote guards.

mod cases;
mod cost;
mod engine;
mod error;
mod expr;
mod file;
mod functions;
mod input;
mod json;
mod meter;
mod patterns;
mod plan;
pub mod pool;
mod reach;
mod session_cel;
mod shell;
mod strings;
mod verdict;

#[cfg(test)]
mod isolation_tests;
#[cfg(test)]
mod tests;

pub use cases::{CheckReport, Failure, RuleSummary, TestReport, check, test};
pub use cases::{NeverSent, never_sent, never_sent_compiled};
pub use cost::{Cost, Inline, Limits, OverInline};
pub use engine::{Policy, Rule};
pub use error::{CasesError, CompileError, CompileErrorKind, EvalError, Field, Scope};
pub use input::{Args, BatchInput, BatchValues, CallInput, CallRef, ContextRef, Members, Recorded};
pub use patterns::{MESH_PATTERN_BYTES, charged_bytes as pattern_bytes};
pub use session_cel::SessionVal;
pub use verdict::{Action, Outcome, Verdict};
