//! `matches`, with regexes compiled once.
//!
//! The CEL library compiles a `matches` pattern each time it runs, which
//! costs more than the rest of a typical rule. Here the patterns written in
//! a policy (string literals) are compiled when the policy is, so a bad
//! pattern refuses the file with its line, and kept in a process-wide cache
//! that `matches` reads. A pattern computed at evaluation is compiled then,
//! within a size limit. The `regex` crate matches in linear time.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

use cel::common::types::{self, CelBool, CelString};
use cel::common::value::CowVal;
use cel::{Env, ExecutionError};
use regex::{Regex, RegexBuilder};

/// At most this many patterns stay cached; past it, patterns are compiled
/// each time (a policy reloaded again and again cannot grow memory).
const MAX_CACHED: usize = 4096;

/// Bytes a compiled pattern may take (the `regex` crate's size limit).
const SIZE_LIMIT: usize = 1 << 20;

fn cache() -> &'static RwLock<HashMap<String, Arc<Regex>>> {
    static CACHE: OnceLock<RwLock<HashMap<String, Arc<Regex>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn build(pattern: &str) -> Result<Regex, regex::Error> {
    RegexBuilder::new(pattern).size_limit(SIZE_LIMIT).build()
}

/// Compiles a pattern written in a policy, and caches it.
pub(crate) fn precompile(pattern: &str) -> Result<(), String> {
    if cache()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(pattern)
    {
        return Ok(());
    }
    let regex = build(pattern).map_err(|error| error.to_string())?;
    let mut cache = cache().write().unwrap_or_else(|p| p.into_inner());
    if cache.len() < MAX_CACHED {
        cache.insert(pattern.to_owned(), Arc::new(regex));
    }
    Ok(())
}

/// A pattern compiled with its policy (see [`precompile`]).
pub(crate) fn cached(pattern: &str) -> Option<Arc<Regex>> {
    cache()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(pattern)
        .cloned()
}

pub(crate) fn lookup(pattern: &str) -> Result<Arc<Regex>, ExecutionError> {
    if let Some(regex) = cache()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(pattern)
    {
        return Ok(Arc::clone(regex));
    }
    build(pattern).map(Arc::new).map_err(|error| {
        ExecutionError::function_error(
            "matches",
            format!("{pattern:?} is not a valid regex: {error}"),
        )
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
