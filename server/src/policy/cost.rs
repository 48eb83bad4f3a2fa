//! Cost bounds: what keeps a policy from stalling the mesh.
//!
//! CEL has no loops or recursion, but its macros (`all`, `exists`,
//! `exists_one`, `filter`, `map`) iterate lists and maps, and they nest: over
//! a large enough input, `calls.all(a, calls.all(b, ...))` is slow. The CEL
//! library itself has no budget it can enforce while running, so the bounds
//! are checked before anything runs:
//!
//! * when a policy is compiled, each expression is bounded in source size
//!   ([`Limits::max_expression_bytes`]), in syntax-tree nodes after macro
//!   expansion ([`Limits::max_expression_nodes`]) and in how deeply its
//!   macros nest ([`Limits::max_nesting`]); the file in rules
//!   ([`Limits::max_rules`]);
//! * each expression then gets a [`Cost`]: a polynomial in `n`, the number
//!   of items of the largest list or map in the input (the calls, the
//!   metadata, any array or object in any call's arguments). A node costs 1
//!   per evaluation; a node inside `k` nested macros is evaluated up to `n^k`
//!   times; the operators that may walk a whole list or map (`==`, `!=`,
//!   `in`, `+`) cost `n` per evaluation;
//! * before a call is judged, the cost of every rule that applies to its
//!   tool (`when` and `message`) must stay within
//!   [`Limits::max_cost_per_call`]. The `n` is the call's own: the largest
//!   collection of its arguments, or the metadata; only a rule that reads
//!   `calls` (the whole batch) is costed at the batch's `n`. So a call that
//!   a rule never judges cannot push another call's estimate over its
//!   bound. A call over the bound is skipped as steer naming the bound
//!   (R13: the input caused it, so no failure policy turns it into a
//!   proceed), and nothing is evaluated for it.
//!
//! The estimate counts the items of collections, not the bytes of strings,
//! and a macro over a list the expression built is under-estimated: what it
//! cannot see, the [`Meter`](super::meter::Meter) counts while the call is
//! judged ([`Limits::max_work_per_call`]).

use std::fmt;

/// The bounds of a policy; [`Limits::default`] is what the mesh uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Rules in one file.
    pub max_rules: usize,
    /// Bytes of one `when` or `message` expression.
    pub max_expression_bytes: usize,
    /// Nodes of one expression's syntax tree, macros expanded.
    pub max_expression_nodes: usize,
    /// How deeply macros (`all`, `exists`, `map`, ...) may nest.
    pub max_nesting: usize,
    /// Estimated cost units to judge one call (see the module's text).
    pub max_cost_per_call: u64,
    /// Kept for configurations that set it; no longer applied: a call's
    /// bounds depend on that call alone (see the module's text).
    pub max_cost_per_batch: u64,
    /// Units of work (steps and bytes, see `meter`) to judge one call.
    pub max_work_per_call: u64,
    /// Bytes of a policy file.
    pub max_policy_bytes: usize,
    /// Distinct `matches` patterns written in one policy.
    pub max_patterns: usize,
    /// Bytes of compiled regexes one policy may hold, caches included (see
    /// `patterns`).
    pub max_pattern_bytes: usize,
    /// Milliseconds one policy may take to compile (checked between rules).
    pub max_compile_millis: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_rules: 256,
            max_expression_bytes: 4096,
            max_expression_nodes: 512,
            max_nesting: 2,
            max_cost_per_call: 1_000_000,
            max_cost_per_batch: 10_000_000,
            max_work_per_call: 64 << 20,
            max_policy_bytes: 256 << 10,
            max_patterns: 256,
            max_pattern_bytes: 32 << 20,
            max_compile_millis: 2_000,
        }
    }
}

/// The bound under which a batch's policies may be judged on the thread
/// that reads the batch, before any hand-off to the evaluation pool (see
/// `pool`): each call's estimate ([`Cost`]) at most `cost`, and the work
/// of every call judged under it together (counted by the meter, as for
/// [`Limits::max_work_per_call`]) at most `work`, spent as it is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inline {
    /// Units of work left, for all the calls and policies judged under it.
    pub work: u64,
    /// Estimated cost units one call may have.
    pub cost: u64,
}

/// Judging went past its [`Inline`] bound and stopped there: nothing it
/// judged stands, the batch is to be judged again without the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("judging the batch would take more than its inline bound")]
pub struct OverInline;

/// An expression's estimated cost: `terms[k]` units times `n^k`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cost {
    terms: Vec<u64>,
}

impl Cost {
    /// Adds `units` times `n^power`.
    pub(crate) fn add(&mut self, power: usize, units: u64) {
        if self.terms.len() <= power {
            self.terms.resize(power + 1, 0);
        }
        self.terms[power] = self.terms[power].saturating_add(units);
    }

    /// Adds another cost to this one.
    pub(crate) fn add_cost(&mut self, other: &Cost) {
        for (power, units) in other.terms.iter().enumerate() {
            self.add(power, *units);
        }
    }

    /// The estimate for an input whose largest collection has `n` items
    /// (saturating).
    pub fn at(&self, n: usize) -> u64 {
        let n = n as u64;
        let mut total: u64 = 0;
        let mut scale: u64 = 1;
        for units in &self.terms {
            total = total.saturating_add(units.saturating_mul(scale));
            scale = scale.saturating_mul(n);
        }
        total
    }

    /// The highest power of `n` with a non-zero term.
    pub fn degree(&self) -> usize {
        self.terms.iter().rposition(|u| *u != 0).unwrap_or(0)
    }
}

impl fmt::Display for Cost {
    /// `12 + 5n + 3n^2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (power, units) in self.terms.iter().enumerate() {
            if *units == 0 {
                continue;
            }
            if !first {
                f.write_str(" + ")?;
            }
            first = false;
            match power {
                0 => write!(f, "{units}")?,
                1 => write!(f, "{units}n")?,
                _ => write!(f, "{units}n^{power}")?,
            }
        }
        if first {
            f.write_str("0")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_polynomial_in_the_largest_collection() {
        let mut cost = Cost::default();
        cost.add(0, 12);
        cost.add(1, 5);
        cost.add(2, 3);
        assert_eq!(cost.at(10), 12 + 50 + 300);
        assert_eq!(cost.degree(), 2);
        assert_eq!(cost.to_string(), "12 + 5n + 3n^2");
        cost.add(3, u64::MAX);
        assert_eq!(cost.at(2), u64::MAX, "saturates, never wraps");
    }
}
