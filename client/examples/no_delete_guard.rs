//! The minimal Rust guard of the README: steers SQL `DELETE` without `WHERE`.
//!
//! `cargo run -p guardmesh-client --example no_delete_guard` serves it on
//! 127.0.0.1:7001; register it with
//! `guardmesh guards register --name no-delete --endpoint http://127.0.0.1:7001`.

use guardmesh_client::guard::{Guard, serve};
use guardmesh_client::proto::{GuardBatch, ToolCall, Verdict};
use guardmesh_client::verdict::steer;

struct NoDeleteWithoutWhere;

impl Guard for NoDeleteWithoutWhere {
    fn check(&self, call: &ToolCall, _batch: &GuardBatch) -> Option<Verdict> {
        // Judge what the tool will read (the decoded `sql` string, so that
        // `DEL\u0045TE` is a DELETE too), and never let through what this
        // guard cannot read. Empty arguments mean `{}`.
        let text = match call.arguments.trim() {
            "" => "{}",
            text => text,
        };
        let Ok(args) = serde_json::from_str::<serde_json::Value>(text) else {
            return Some(steer(&call.call_id, "arguments are not valid JSON"));
        };
        let sql = args["sql"]
            .as_str()
            .unwrap_or_default()
            .to_ascii_uppercase();
        (sql.contains("DELETE") && !sql.contains("WHERE")).then(|| {
            steer(
                &call.call_id,
                "DELETE needs a WHERE clause; add one and retry.",
            )
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:7001").await?;
    serve(NoDeleteWithoutWhere, listener, std::future::pending()).await?;
    Ok(())
}
