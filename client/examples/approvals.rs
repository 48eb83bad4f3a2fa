//! Approvals (R35): a guard asks a person before a call runs. The
//! coordinator gets an ask, an approver approves it, and the same call,
//! sent again naming the approval, runs once.
//!
//! `cargo run -p guardmesh-client --example approvals -- 127.0.0.1:50051`
//! against `guardmesh serve --config examples/approvals/mesh.toml` (the
//! address may also come from `GUARDMESH_MESH`).

use guardmesh_client::{Approver, Batch, ClientError, Coordinator, Outcome};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), ClientError> {
    let address = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("GUARDMESH_MESH").ok())
        .unwrap_or_else(|| "127.0.0.1:50051".to_owned());
    let mesh = Coordinator::connect(&address).await?;
    let session = mesh.session("refund-session").await?;
    let refund = r#"{"amount": 1500, "to": "acct-7"}"#;

    // 1. The guard asks: the call does not run.
    let decision = session
        .evaluate(Batch::turn(0).call("c1", "refund", refund))
        .await?;
    let Some(request) = decision.calls[0].ask() else {
        println!("no guard asked: {:?}", decision.calls[0].outcome);
        return Ok(());
    };
    println!("asked by {}: {}", request.guard, request.reason);

    // 2. A person approves it (here through the SDK; `guardmesh approvals
    //    approve ID` does the same).
    let approver = Approver::connect(&address).await?;
    approver
        .approve(&request.id, "checked with finance")
        .await?;
    println!("approved");

    // 3. The same call, naming the approval, runs once.
    let again = Batch::turn(1)
        .call("c1", "refund", refund)
        .approval("c1", &request.id);
    let decision = session.evaluate(again.clone()).await?;
    if decision.calls[0].proceeds() {
        println!("runs: {}", decision.calls[0].final_call.arguments);
    }
    // A second use of the same approval is refused: the guard asks again.
    let decision = session.evaluate(again).await?;
    if let Outcome::Ask { .. } = decision.calls[0].outcome {
        let why = decision.calls[0].approval_refused.as_deref();
        println!("asked again: {}", why.unwrap_or("-"));
    }
    Ok(())
}
