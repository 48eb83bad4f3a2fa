//! The string functions rules may call beyond CEL's standard ones: those
//! whose result is no longer than their receiver (`lowerAscii`,
//! `upperAscii`, `trim`), so that a rule's work stays linear in what the
//! agent sent. The rest of CEL's strings extension (`replace`, `split`,
//! `format`, ...) is left out: their results can outgrow their input.
//!
//! As in CEL's strings extension: `lowerAscii` and `upperAscii` change the
//! ASCII letters only; `trim` removes leading and trailing white space
//! (Unicode `White_Space`).

use cel::common::types::{self, CelString};
use cel::common::value::CowVal;
use cel::{Env, ExecutionError};

/// `f` of the receiver, which must be a string.
fn apply<'b, 'v>(
    name: &str,
    args: &[CowVal<'b, 'v>],
    f: impl FnOnce(&str) -> String,
) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let Some(text) = args.first().and_then(|a| a.downcast_ref::<CelString>()) else {
        return Err(ExecutionError::function_error(name, "expects a string"));
    };
    Ok(CowVal::owned(CelString::from(f(text.inner()))))
}

fn lower_ascii<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    apply("lowerAscii", &args, str::to_ascii_lowercase)
}

fn upper_ascii<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    apply("upperAscii", &args, str::to_ascii_uppercase)
}

fn trim<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    apply("trim", &args, |text| text.trim().to_owned())
}

/// Declares `text.lowerAscii()`, `text.upperAscii()` and `text.trim()`.
pub(crate) fn declare(env: &mut Env) {
    env.add_member_overload(
        "lowerAscii",
        "string_lower_ascii",
        types::STRING_TYPE,
        vec![],
        lower_ascii,
    )
    .expect("the CEL library declares no `lowerAscii` without its strings extension");
    env.add_member_overload(
        "upperAscii",
        "string_upper_ascii",
        types::STRING_TYPE,
        vec![],
        upper_ascii,
    )
    .expect("the CEL library declares no `upperAscii` without its strings extension");
    env.add_member_overload("trim", "string_trim", types::STRING_TYPE, vec![], trim)
        .expect("the CEL library declares no `trim` without its strings extension");
}
