//! `matches`, with regexes compiled once per policy.
//!
//! The CEL library compiles a `matches` pattern each time it runs, which
//! costs more than the rest of a typical rule. Here the patterns written in
//! a policy (string literals) are compiled when the policy is, so a bad
//! pattern refuses the file with its line, and kept in the policy's own
//! [`PatternSet`]: freed when the last guard using the policy goes. While a
//! policy compiles or judges, its set is this thread's current one
//! ([`with`]), which `matches` and the fast path read. A pattern computed at
//! evaluation is compiled then, within the size limits, and not kept.
//!
//! Memory is bounded at three levels: each regex by the engine's limits,
//! set explicitly ([`SIZE_LIMIT`] for the compiled program, [`CACHE_LIMIT`]
//! for each lazy-DFA cache); each policy by the bytes its patterns are
//! charged ([`Limits::max_pattern_bytes`](super::Limits)); and the process
//! by [`MESH_PATTERN_BYTES`], released when a set is dropped. A pattern is
//! charged the smallest of [`STEPS`] it compiles within, plus one cache
//! per evaluation thread: an upper bound, since the `regex` crate does not
//! report its memory.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use cel::common::types::{self, CelBool, CelString};
use cel::common::value::CowVal;
use cel::{Env, ExecutionError};
use regex::{Regex, RegexBuilder};

/// Bytes a compiled pattern may take (the `regex` crate's `size_limit`).
pub(crate) const SIZE_LIMIT: usize = 1 << 20;

/// Bytes of each lazy-DFA cache of a pattern (`dfa_size_limit`).
pub(crate) const CACHE_LIMIT: usize = 64 << 10;

/// The size limits a pattern is tried at, smallest first: it is charged
/// the first it compiles within.
const STEPS: [usize; 4] = [16 << 10, 128 << 10, 512 << 10, SIZE_LIMIT];

/// Bytes of compiled patterns all policies of the process may hold
/// together.
pub const MESH_PATTERN_BYTES: usize = 256 << 20;

/// Threads that may hold a cache of one pattern: the evaluation pool's,
/// those judging inline, and one that compiles.
fn cache_threads() -> usize {
    super::pool::threads() + super::pool::INLINE_SLOTS + 1
}

/// Bytes charged to all live sets of the process.
static CHARGED: AtomicUsize = AtomicUsize::new(0);

/// Bytes of compiled patterns held now by every policy of the process.
pub fn charged_bytes() -> usize {
    CHARGED.load(Ordering::Relaxed)
}

/// The patterns of one policy, and what they are charged.
#[derive(Debug)]
pub(crate) struct PatternSet {
    regexes: RwLock<HashMap<String, Arc<Regex>>>,
    /// Bytes charged to this set (and to [`CHARGED`]).
    charged: AtomicUsize,
    /// The policy's bound on `charged`, and on the number of patterns.
    max_bytes: usize,
    max_patterns: usize,
}

impl Drop for PatternSet {
    fn drop(&mut self) {
        CHARGED.fetch_sub(*self.charged.get_mut(), Ordering::Relaxed);
    }
}

/// Why a pattern was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum PatternError {
    /// Not a regular expression (the regex crate's own message).
    #[error("{0}")]
    Invalid(regex::Error),
    /// Larger than the largest compile step.
    #[error("compiled, it is larger than the limit of {limit} bytes")]
    TooBig { limit: usize },
    #[error("the policy's patterns would take more than {limit} bytes compiled")]
    PolicyBytes { limit: usize },
    #[error("the policy has more than {limit} distinct patterns")]
    PolicyCount { limit: usize },
    #[error("the mesh's policies' patterns would take more than {limit} bytes compiled")]
    MeshBytes { limit: usize },
}

fn build(pattern: &str, size_limit: usize) -> Result<Regex, regex::Error> {
    RegexBuilder::new(pattern)
        .size_limit(size_limit)
        .dfa_size_limit(CACHE_LIMIT)
        .build()
}

/// Compiles `pattern` at the smallest step it fits: the regex and the
/// bytes it is charged.
fn compile_charged(pattern: &str) -> Result<(Regex, usize), PatternError> {
    let mut last = None;
    for step in STEPS {
        match build(pattern, step) {
            Ok(regex) => return Ok((regex, step + CACHE_LIMIT * cache_threads())),
            Err(regex::Error::CompiledTooBig(_)) => last = Some(step),
            Err(error) => return Err(PatternError::Invalid(error)),
        }
    }
    Err(PatternError::TooBig {
        limit: last.unwrap_or(SIZE_LIMIT),
    })
}

impl PatternSet {
    pub(crate) fn new(max_bytes: usize, max_patterns: usize) -> Self {
        Self {
            regexes: RwLock::default(),
            charged: AtomicUsize::new(0),
            max_bytes,
            max_patterns,
        }
    }

    /// Bytes charged to this set.
    pub(crate) fn charged(&self) -> usize {
        self.charged.load(Ordering::Relaxed)
    }

    fn get(&self, pattern: &str) -> Option<Arc<Regex>> {
        self.regexes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(pattern)
            .cloned()
    }

    /// Compiles a pattern written in the policy and keeps it, within the
    /// policy's and the mesh's bounds.
    pub(crate) fn add(&self, pattern: &str) -> Result<(), PatternError> {
        if self.get(pattern).is_some() {
            return Ok(());
        }
        let mut regexes = self.regexes.write().unwrap_or_else(PoisonError::into_inner);
        if regexes.len() >= self.max_patterns {
            return Err(PatternError::PolicyCount {
                limit: self.max_patterns,
            });
        }
        let (regex, bytes) = compile_charged(pattern)?;
        let mine = self.charged.load(Ordering::Relaxed);
        if mine.saturating_add(bytes) > self.max_bytes {
            return Err(PatternError::PolicyBytes {
                limit: self.max_bytes,
            });
        }
        let mesh = CHARGED.fetch_add(bytes, Ordering::Relaxed);
        if mesh.saturating_add(bytes) > MESH_PATTERN_BYTES {
            CHARGED.fetch_sub(bytes, Ordering::Relaxed);
            return Err(PatternError::MeshBytes {
                limit: MESH_PATTERN_BYTES,
            });
        }
        self.charged.store(mine + bytes, Ordering::Relaxed);
        regexes.insert(pattern.to_owned(), Arc::new(regex));
        Ok(())
    }
}

thread_local! {
    /// The pattern set of the policy compiling or judging on this thread.
    static CURRENT: RefCell<Option<Arc<PatternSet>>> = const { RefCell::new(None) };
}

/// Runs `f` with `set` as this thread's current pattern set.
pub(crate) fn with<T>(set: &Arc<PatternSet>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<Arc<PatternSet>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = previous);
        }
    }
    let previous = CURRENT.with(|c| c.borrow_mut().replace(Arc::clone(set)));
    let _restore = Restore(previous);
    f()
}

/// Compiles a pattern written in a policy into the current set (see
/// [`with`]); without one, only checks that it compiles.
pub(crate) fn precompile(pattern: &str) -> Result<(), PatternError> {
    match CURRENT.with(|c| c.borrow().clone()) {
        Some(set) => set.add(pattern),
        None => compile_charged(pattern).map(|_| ()),
    }
}

/// A pattern of the current set (see [`precompile`]).
pub(crate) fn cached(pattern: &str) -> Option<Arc<Regex>> {
    CURRENT.with(|c| c.borrow().as_ref().and_then(|set| set.get(pattern)))
}

/// A pattern of the current set, or compiled now within the size limits
/// (a pattern computed at evaluation; not kept).
pub(crate) fn lookup(pattern: &str) -> Result<Arc<Regex>, ExecutionError> {
    if let Some(regex) = cached(pattern) {
        return Ok(regex);
    }
    build(pattern, SIZE_LIMIT).map(Arc::new).map_err(|_| {
        // The pattern may come from the input: its text is not quoted.
        ExecutionError::function_error("matches", "the pattern is not a valid regex")
    })
}

fn matches<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let text = args.first().and_then(|a| a.downcast_ref::<CelString>());
    let pattern = args.get(1).and_then(|a| a.downcast_ref::<CelString>());
    let (Some(text), Some(pattern)) = (text, pattern) else {
        return Err(ExecutionError::function_error(
            "matches",
            "expects a string and a pattern string",
        ));
    };
    let regex = lookup(pattern.inner())?;
    Ok(CowVal::owned(CelBool::from(regex.is_match(text.inner()))))
}

/// Declares `text.matches(pattern)` and `matches(text, pattern)`.
pub(crate) fn declare(env: &mut Env) {
    env.add_member_overload(
        "matches",
        "string_matches_string",
        types::STRING_TYPE,
        vec![types::STRING_TYPE],
        matches,
    )
    .expect("the CEL library declares no `matches` without its regex feature");
    env.add_overload(
        "matches",
        "matches_string_string",
        vec![types::STRING_TYPE, types::STRING_TYPE],
        matches,
    )
    .expect("the CEL library declares no `matches` without its regex feature");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r25_a_sets_patterns_are_charged_and_released_with_it() {
        let set = Arc::new(PatternSet::new(4 << 20, 16));
        with(&set, || precompile("^a+b$")).unwrap();
        with(&set, || precompile("^a+b$")).unwrap();
        let charged = set.charged();
        assert!(charged >= STEPS[0], "{charged}");
        assert!(cached("^a+b$").is_none(), "not current outside `with`");
        assert!(with(&set, || cached("^a+b$")).is_some());
        drop(set);
        // Released: another set can charge as much again (the global count
        // is shared with other tests, so only the set's own is checked).
        let set = PatternSet::new(charged, 16);
        assert!(set.add("^a+b$").is_ok());
    }

    #[test]
    fn r25_a_policy_is_bounded_in_pattern_bytes_and_count() {
        let set = PatternSet::new(2 * (STEPS[0] + CACHE_LIMIT * cache_threads()), 100);
        set.add("^x1$").unwrap();
        set.add("^x2$").unwrap();
        assert!(matches!(
            set.add("^x3$"),
            Err(PatternError::PolicyBytes { .. })
        ));
        let set = PatternSet::new(usize::MAX / 4, 1);
        set.add("^y1$").unwrap();
        assert!(matches!(
            set.add("^y2$"),
            Err(PatternError::PolicyCount { limit: 1 })
        ));
        // A large pattern is charged more than a small one.
        let big = PatternSet::new(usize::MAX / 4, 4);
        big.add(r"\w{10}").unwrap();
        assert!(big.charged() > STEPS[0] + CACHE_LIMIT * cache_threads());
    }
}
