//! Example guards, written with the Rust SDK exactly as a guard author
//! would. The demo runs them, the tests run them as separate processes
//! (`guardmesh example-guard KIND`), and the conformance kit checks them.

use guardmesh_client::Guard;
use guardmesh_client::proto::{GuardBatch, ToolCall, Verdict};
use guardmesh_client::verdict::{cancel, rewrite_arguments, steer};
use serde_json::{Map, Value};
use std::time::Duration;
use tonic::Status;

/// The example guards by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Steers SQL `DELETE`/`UPDATE` without a `WHERE` clause.
    SqlWhere,
    /// Cancels calls to denied tools (`fs.delete`, `payments.transfer`, ...).
    DenyList,
    /// Cancels `shell.*` calls with `rm -rf` or `sudo` in a string of their
    /// arguments (read as JSON, so escapes hide nothing).
    ShellPolicy,
    /// Mutate: redacts secret-looking argument values (keys like
    /// `password`, `api_key`, `token`).
    RedactSecrets,
    /// Mutate: pins `LIMIT 100` onto SQL `SELECT`s that have none.
    SqlLimit,
    /// Proceeds on everything (use with `--delay-ms` as a slow guard).
    Allow,
    /// Steers every call with the marker `veto` in a string of its
    /// arguments (a key or a value).
    VetoMarker,
    /// Mutate, calls and results (R33): replaces secrets of common formats
    /// (AWS access keys, GitHub tokens, Stripe live keys, PEM private key
    /// blocks) in any string with `[REDACTED:<kind>]` (see `redact`).
    /// Register it with `phases = both`, a grant and a result grant.
    RedactFormats,
}

/// An example guard with an optional artificial latency, and optionally
/// judging at most so many batches at a time (the others wait their turn
/// inside the guard, first come first served, as a busy guard's do).
#[derive(Debug, Clone)]
pub struct Example {
    pub kind: Kind,
    pub delay: Duration,
    workers: Option<std::sync::Arc<tokio::sync::Semaphore>>,
}

impl Example {
    pub fn new(kind: Kind) -> Self {
        Self {
            kind,
            delay: Duration::ZERO,
            workers: None,
        }
    }

    pub fn delayed(kind: Kind, delay: Duration) -> Self {
        Self {
            kind,
            delay,
            workers: None,
        }
    }

    /// Judges at most `workers` batches at a time (0: no bound).
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers =
            (workers > 0).then(|| std::sync::Arc::new(tokio::sync::Semaphore::new(workers)));
        self
    }

    fn verdict(&self, call: &ToolCall) -> Option<Verdict> {
        match self.kind {
            Kind::SqlWhere => sql_where(call),
            Kind::DenyList => matches!(
                call.tool.as_str(),
                "fs.delete" | "payments.transfer" | "iam.grant_admin"
            )
            .then(|| {
                cancel(
                    &call.call_id,
                    format!("The tool {} is not allowed for this agent.", call.tool),
                )
            }),
            Kind::ShellPolicy => {
                if !call.tool.starts_with("shell") {
                    return None;
                }
                let Some(args) = arguments(call) else {
                    return Some(unreadable(call));
                };
                let risky = any_string(&args, &|s| s.contains("rm -rf") || s.contains("sudo"));
                risky.then(|| cancel(&call.call_id, "Destructive shell commands are not allowed."))
            }
            Kind::RedactSecrets => redact_secrets(call),
            Kind::SqlLimit => sql_limit(call),
            Kind::Allow => None,
            Kind::RedactFormats => {
                let Some(args) = arguments(call) else {
                    return Some(unreadable(call));
                };
                let mut args = Value::Object(args);
                crate::redact::redact_value(&mut args)
                    .then(|| rewrite_arguments(&call.call_id, &args))
            }
            Kind::VetoMarker => match arguments(call) {
                None => Some(unreadable(call)),
                Some(args) => any_string(&args, &|s| s.contains("veto"))
                    .then(|| steer(&call.call_id, "vetoed by marker")),
            },
        }
    }
}

impl Guard for Example {
    async fn judge(&self, batch: &GuardBatch) -> Result<Vec<Verdict>, Status> {
        let _worker = match &self.workers {
            Some(workers) => Some(
                workers
                    .acquire()
                    .await
                    .map_err(|_| Status::unavailable("shutting down"))?,
            ),
            None => None,
        };
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let mut verdicts: Vec<Verdict> =
            batch.calls.iter().filter_map(|c| self.verdict(c)).collect();
        if self.kind == Kind::RedactFormats {
            // R33: a result is a whole `CallToolResult`, rewritten whole.
            for result in &batch.results {
                let Ok(mut value) = serde_json::from_str::<Value>(&result.result) else {
                    continue;
                };
                if crate::redact::redact_value(&mut value) {
                    verdicts.push(guardmesh_client::verdict::rewrite_result(
                        &result.call_id,
                        &value,
                    ));
                }
            }
        }
        Ok(verdicts)
    }
}

/// A call's arguments as a JSON object (`""` is `{}`), or `None` when this
/// guard cannot read them. A guard that cannot read a call cannot judge it,
/// so it skips it ([`unreadable`]): letting it through would let a call the
/// guard never saw run.
fn arguments(call: &ToolCall) -> Option<Map<String, Value>> {
    if call.arguments.trim().is_empty() {
        return Some(Map::new());
    }
    match serde_json::from_str::<Value>(&call.arguments) {
        Ok(Value::Object(map)) => Some(map),
        _ => None,
    }
}

/// The skip for a call whose arguments this guard cannot read.
fn unreadable(call: &ToolCall) -> Verdict {
    steer(
        &call.call_id,
        "The arguments of this call could not be read as a JSON object, so it was not \
         judged and not run. Send them as one plain JSON object and retry.",
    )
}

/// Whether some string in `map` (a key or a value, at any depth) passes
/// `test`.
fn any_string(map: &Map<String, Value>, test: &dyn Fn(&str) -> bool) -> bool {
    fn value(v: &Value, test: &dyn Fn(&str) -> bool) -> bool {
        match v {
            Value::String(s) => test(s),
            Value::Array(items) => items.iter().any(|item| value(item, test)),
            Value::Object(map) => any_string(map, test),
            _ => false,
        }
    }
    map.iter().any(|(k, v)| test(k) || value(v, test))
}

fn sql_where(call: &ToolCall) -> Option<Verdict> {
    let Some(args) = arguments(call) else {
        return Some(unreadable(call));
    };
    let sql = match args.get("sql")? {
        Value::String(sql) => sql.to_ascii_uppercase(),
        _ => {
            return Some(steer(
                &call.call_id,
                "The sql argument must be a string; the call was not run.",
            ));
        }
    };
    let writes = sql.trim_start().starts_with("DELETE") || sql.trim_start().starts_with("UPDATE");
    (writes && !sql.contains(" WHERE ")).then(|| {
        steer(
            &call.call_id,
            "This statement changes every row: add a WHERE clause that limits it, then retry.",
        )
    })
}

fn sql_limit(call: &ToolCall) -> Option<Verdict> {
    let Some(mut args) = arguments(call) else {
        return Some(unreadable(call));
    };
    let sql = args
        .get("sql")?
        .as_str()?
        .trim()
        .trim_end_matches(';')
        .to_owned();
    let upper = sql.to_ascii_uppercase();
    if !upper.starts_with("SELECT") || upper.contains(" LIMIT ") {
        return None;
    }
    args.insert("sql".into(), Value::String(format!("{sql} LIMIT 100")));
    Some(rewrite_arguments(&call.call_id, &Value::Object(args)))
}

fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "token",
        "api_key",
        "apikey",
        "authorization",
    ]
    .iter()
    .any(|s| key.contains(s))
}

fn redact(value: &mut Value) -> bool {
    match value {
        Value::Object(map) => {
            let mut changed = false;
            for (key, v) in map.iter_mut() {
                if is_secret_key(key) && !v.is_null() && *v != Value::String("[REDACTED]".into()) {
                    *v = Value::String("[REDACTED]".into());
                    changed = true;
                } else {
                    changed |= redact(v);
                }
            }
            changed
        }
        Value::Array(items) => {
            // Every item, not just up to the first change.
            let mut changed = false;
            for item in items {
                changed |= redact(item);
            }
            changed
        }
        _ => false,
    }
}

fn redact_secrets(call: &ToolCall) -> Option<Verdict> {
    let Some(args) = arguments(call) else {
        return Some(unreadable(call));
    };
    let mut args = Value::Object(args);
    redact(&mut args).then(|| rewrite_arguments(&call.call_id, &args))
}

#[cfg(test)]
mod tests {
    use super::*;
    use guardmesh_client::proto::verdict::Outcome;

    fn call(tool: &str, args: &str) -> ToolCall {
        ToolCall {
            call_id: "c".into(),
            tool: tool.into(),
            arguments: args.into(),
        }
    }

    fn rewritten(v: Option<Verdict>) -> Option<Value> {
        match v?.outcome? {
            Outcome::Rewrite(r) => serde_json::from_str(&r.arguments?).ok(),
            Outcome::Skip(_) | Outcome::Ask(_) => None,
        }
    }

    #[test]
    fn sql_where_steers_unbounded_writes() {
        assert!(sql_where(&call("sql", r#"{"sql":"DELETE FROM users"}"#)).is_some());
        assert!(sql_where(&call("sql", r#"{"sql":"delete from users where id = 1"}"#)).is_none());
        assert!(sql_where(&call("sql", r#"{"sql":"SELECT * FROM t"}"#)).is_none());
    }

    #[test]
    fn redaction_and_limit_rewrite_arguments() {
        let v = rewritten(redact_secrets(&call(
            "http.post",
            r#"{"url":"u","headers":{"Authorization":"Bearer x"},"api_key":"k"}"#,
        )))
        .unwrap();
        assert_eq!(v["api_key"], "[REDACTED]");
        assert_eq!(v["headers"]["Authorization"], "[REDACTED]");
        assert_eq!(v["url"], "u");
        assert!(redact_secrets(&call("http.post", r#"{"url":"u"}"#)).is_none());
        let v = rewritten(sql_limit(&call("sql", r#"{"sql":"SELECT * FROM t;"}"#))).unwrap();
        assert_eq!(v["sql"], "SELECT * FROM t LIMIT 100");
        assert!(sql_limit(&call("sql", r#"{"sql":"SELECT 1 LIMIT 5"}"#)).is_none());
    }

    fn is_steer(v: Option<Verdict>) -> bool {
        matches!(
            v.and_then(|v| v.outcome),
            Some(Outcome::Skip(skip)) if skip.kind == guardmesh_client::proto::SkipKind::Steer as i32
        )
    }

    #[test]
    fn r20_examples_skip_calls_whose_arguments_they_cannot_read() {
        // What serde_json refuses (the mesh refuses these too, but a guard
        // must not count on it): never a proceed.
        let deep = format!(r#"{{"sql":{}"x"{}}}"#, "[".repeat(200), "]".repeat(200));
        let unreadable = [
            r#"{"sql":"DELETE FROM t","n":1e400}"#,
            r#"{"sql":"DELETE FROM t","s":"\ud800"}"#,
            "[1]",
            "{",
            deep.as_str(),
        ];
        let readers = [
            (Kind::SqlWhere, "sql"),
            (Kind::SqlLimit, "sql"),
            (Kind::RedactSecrets, "http.post"),
            (Kind::ShellPolicy, "shell.exec"),
            (Kind::VetoMarker, "t"),
        ];
        for (kind, tool) in readers {
            for args in unreadable {
                let v = Example::new(kind).verdict(&call(tool, args));
                assert!(is_steer(v), "{kind:?} on {args}");
            }
            // The empty text is `{}`, readable: nothing to object to.
            assert!(
                Example::new(kind).verdict(&call(tool, "")).is_none(),
                "{kind:?}"
            );
        }
        // Guards that never read arguments are unaffected.
        assert!(Example::new(Kind::Allow).verdict(&call("t", "{")).is_none());
        assert!(
            Example::new(Kind::ShellPolicy)
                .verdict(&call("ls", "{"))
                .is_none()
        );
    }

    #[test]
    fn r20_examples_judge_what_the_tool_reads_not_the_raw_text() {
        // Escapes hide nothing from a guard that reads the JSON.
        let v = Example::new(Kind::ShellPolicy)
            .verdict(&call("shell.exec", r#"{"cmd":"rm -r\u0066 /"}"#));
        assert!(matches!(v.and_then(|v| v.outcome), Some(Outcome::Skip(_))));
        let v = Example::new(Kind::VetoMarker).verdict(&call("t", r#"{"note":"ve\u0074o"}"#));
        assert!(is_steer(v));
        assert!(
            Example::new(Kind::ShellPolicy)
                .verdict(&call("shell.exec", r#"{"cmd":"ls -l"}"#))
                .is_none()
        );
        // A non-string sql cannot be judged: steered, not proceeded.
        assert!(is_steer(sql_where(&call(
            "sql",
            r#"{"sql":["DELETE FROM t"]}"#
        ))));
    }
}
