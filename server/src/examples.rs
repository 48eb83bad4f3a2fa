//! Example guards, written with the Rust SDK exactly as a guard author
//! would. The demo runs them, the tests run them as separate processes
//! (`guardmesh example-guard KIND`), and the conformance kit checks them.

use guardmesh_client::Guard;
use guardmesh_client::proto::{GuardBatch, ToolCall, Verdict};
use guardmesh_client::verdict::{cancel, rewrite_arguments, steer};
use serde_json::Value;
use std::time::Duration;
use tonic::Status;

/// The example guards by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Steers SQL `DELETE`/`UPDATE` without a `WHERE` clause.
    SqlWhere,
    /// Cancels calls to denied tools (`fs.delete`, `payments.transfer`, ...).
    DenyList,
    /// Cancels `shell.*` calls that mention `rm -rf` or `sudo`.
    ShellPolicy,
    /// Mutate: redacts secret-looking argument values (keys like
    /// `password`, `api_key`, `token`).
    RedactSecrets,
    /// Mutate: pins `LIMIT 100` onto SQL `SELECT`s that have none.
    SqlLimit,
    /// Proceeds on everything (use with `--delay-ms` as a slow guard).
    Allow,
    /// Steers every call whose arguments contain the marker `"veto"`.
    VetoMarker,
}

/// An example guard with an optional artificial latency.
#[derive(Debug, Clone)]
pub struct Example {
    pub kind: Kind,
    pub delay: Duration,
}

impl Example {
    pub fn new(kind: Kind) -> Self {
        Self {
            kind,
            delay: Duration::ZERO,
        }
    }

    pub fn delayed(kind: Kind, delay: Duration) -> Self {
        Self { kind, delay }
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
                let risky = call.tool.starts_with("shell")
                    && (call.arguments.contains("rm -rf") || call.arguments.contains("sudo"));
                risky.then(|| cancel(&call.call_id, "Destructive shell commands are not allowed."))
            }
            Kind::RedactSecrets => redact_secrets(call),
            Kind::SqlLimit => sql_limit(call),
            Kind::Allow => None,
            Kind::VetoMarker => call
                .arguments
                .contains("veto")
                .then(|| steer(&call.call_id, "vetoed by marker")),
        }
    }
}

impl Guard for Example {
    async fn judge(&self, batch: &GuardBatch) -> Result<Vec<Verdict>, Status> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Ok(batch.calls.iter().filter_map(|c| self.verdict(c)).collect())
    }
}

fn sql_text(call: &ToolCall) -> Option<String> {
    match serde_json::from_str::<Value>(&call.arguments).ok()? {
        Value::Object(map) => map.get("sql")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn sql_where(call: &ToolCall) -> Option<Verdict> {
    let sql = sql_text(call)?.to_ascii_uppercase();
    let writes = sql.trim_start().starts_with("DELETE") || sql.trim_start().starts_with("UPDATE");
    (writes && !sql.contains(" WHERE ")).then(|| {
        steer(
            &call.call_id,
            "This statement changes every row: add a WHERE clause that limits it, then retry.",
        )
    })
}

fn sql_limit(call: &ToolCall) -> Option<Verdict> {
    let Ok(Value::Object(mut args)) = serde_json::from_str::<Value>(&call.arguments) else {
        return None;
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
    let mut args: Value = serde_json::from_str(&call.arguments).ok()?;
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
            Outcome::Skip(_) => None,
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
}
