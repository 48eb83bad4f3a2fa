//! A coordinator: the agent loop's side of the mesh. Each round of tool
//! calls the model asks for is judged before any of it runs; the calls
//! that may run are run, and the others answered with what the mesh says
//! the model should read instead.
//!
//! `cargo run -p guardmesh-client --example coordinator -- 127.0.0.1:50051`
//! (the address may also come from `GUARDMESH_MESH`).

use guardmesh_client::{Batch, ClientError, Coordinator, Outcome};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The arguments of the `shell.exec` tool, as the tool takes them.
#[derive(Serialize, Deserialize)]
struct Exec {
    cmd: String,
}

/// What the model asked for in one round: (tool, command).
const ROUNDS: &[&[&str]] = &[&["ls -la /srv"], &["rm -rf /srv/data", "du -sh /srv"]];

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), ClientError> {
    let address = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("GUARDMESH_MESH").ok())
        .unwrap_or_else(|| "127.0.0.1:50051".to_owned());
    // Waits for a mesh that is still starting, within bounds.
    let mesh = Coordinator::builder(address)
        .connect_timeout(Duration::from_secs(2))
        .retry(5, Duration::from_millis(200))
        .connect()
        .await?;
    // One stream per agent session; it reopens itself if the mesh restarts.
    let session = mesh.session("example-session").await?;
    for (turn, commands) in ROUNDS.iter().enumerate() {
        let mut batch = Batch::turn(turn as u32).model_text("let me look at /srv");
        for (i, cmd) in commands.iter().enumerate() {
            let args = Exec {
                cmd: (*cmd).to_owned(),
            };
            batch = batch.call_args(format!("c{turn}-{i}"), "shell.exec", &args)?;
        }
        let decision = match session.evaluate(batch.clone()).await {
            // The stream ended before the answer (a restart): nothing of
            // this round was judged, so nothing runs; ask once more.
            Err(error) if error.not_judged() => session.evaluate(batch).await?,
            other => other?,
        };
        for call in &decision.calls {
            match &call.outcome {
                Outcome::Proceed => {
                    // The call as it must run: rewritten arguments included.
                    let exec: Exec = call.arguments_as()?;
                    println!("turn {turn}: run {:?}", exec.cmd);
                }
                Outcome::Steer { content } | Outcome::Cancel { content } => {
                    println!(
                        "turn {turn}: skip {} ({}{}): {content}",
                        call.call_id,
                        call.decided_by.as_deref().unwrap_or("-"),
                        call.rule
                            .as_deref()
                            .map(|rule| format!(", rule {rule}"))
                            .unwrap_or_default(),
                    );
                }
                Outcome::Ask { content, approval } => {
                    // A person decides (R35): `guardmesh approvals approve
                    // ID`, then this same call again with
                    // `Batch::approval(call_id, ID)`.
                    println!(
                        "turn {turn}: {} waits for approval {} ({}): {content}",
                        call.call_id, approval.id, approval.reason
                    );
                }
            }
        }
    }
    Ok(())
}
