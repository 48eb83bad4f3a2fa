//! Policy files reloaded when they change on disk (R27), besides SIGHUP: a
//! real `guardmesh serve` with a policy guard from its config, the file
//! edited in place and replaced by a rename, then broken. Waits are polls
//! with a bound; nothing is asserted on time.

use crate::harness::*;
use guardmesh_client::{Batch, BatchDecision, Coordinator, Outcome};
use std::path::Path;
use std::time::Duration;

/// A policy of one rule that cancels the calls of `tools` with `message`.
pub(crate) fn rule(name: &str, tools: &str, message: &str) -> String {
    format!(
        "[[rule]]\nname = \"{name}\"\ntools = [\"{tools}\"]\nwhen = \"true\"\n\
         action = \"cancel\"\nmessage = '\"{message}\"'\n"
    )
}

/// The content of the first call's skip ("" when it proceeds).
pub(crate) fn content(d: &BatchDecision) -> String {
    match &d.calls[0].outcome {
        Outcome::Cancel { content } | Outcome::Steer { content } | Outcome::Ask { content, .. } => {
            content.clone()
        }
        Outcome::Proceed => String::new(),
    }
}

/// A batch of one `shell.exec` call.
pub(crate) async fn shell(coordinator: &Coordinator) -> BatchDecision {
    coordinator
        .evaluate_once("s", Batch::new(0).call("sh", "shell.exec", "{}"))
        .await
        .unwrap()
}

/// Polls (every 25 ms, at most 10 s) until the shell call's content is
/// `want`; the last decision.
async fn until_content(coordinator: &Coordinator, want: &str) -> BatchDecision {
    let mut last = shell(coordinator).await;
    for _ in 0..400 {
        if content(&last) == want {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        last = shell(coordinator).await;
    }
    panic!(
        "the policy did not become {want:?}; still {:?}",
        content(&last)
    );
}

/// `guardmesh_policy_reloads_total{outcome=...}` on the metrics endpoint,
/// which must answer `within`.
pub(crate) async fn reloads(metrics_port: u16, outcome: &str, within: Duration) -> f64 {
    let text = fetch_metrics(metrics_port, within)
        .await
        .unwrap_or_else(|| panic!("the metrics endpoint answers within {within:?}"));
    let sample = format!("guardmesh_policy_reloads_total{{outcome=\"{outcome}\"}}");
    sample_sum(&text, &sample)
}

/// Writes `text` to `path` through a temporary file and a rename, as
/// editors and deployment tools do.
fn replace(path: &Path, text: &str) {
    let temporary = path.with_extension("toml.new");
    std::fs::write(&temporary, text).unwrap();
    std::fs::rename(&temporary, path).unwrap();
}

#[tokio::test]
async fn r27_a_changed_policy_file_is_reloaded_and_a_broken_one_keeps_the_running_policy() {
    let dir = std::env::temp_dir().join(format!("guardmesh-policy-watch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("rules.toml");
    std::fs::write(&policy, rule("no-shell", "shell.*", "first")).unwrap();
    let metrics_port = free_port();
    let config = format!(
        "metrics_listen = \"127.0.0.1:{metrics_port}\"\n\n[[guard]]\nname = \"policy\"\npolicy = {:?}\n",
        policy.display().to_string()
    );
    let mesh = MeshProcess::start("policy-watch", &config, Some("info")).await;
    let coordinator = mesh.coordinator().await;
    let first = shell(&coordinator).await;
    assert_eq!(content(&first), "first");

    // Edited in place: the new rule decides, under a new chain revision.
    std::fs::write(&policy, rule("no-shell", "shell.*", "second")).unwrap();
    let second = until_content(&coordinator, "second").await;
    assert!(
        second.chain_revision > first.chain_revision,
        "the revision covers the rules"
    );
    assert!(reloads(metrics_port, "applied", Duration::from_secs(10)).await >= 1.0);

    // Replaced by a rename: seen as well.
    replace(&policy, &rule("no-shell", "shell.*", "third"));
    until_content(&coordinator, "third").await;

    // Broken: refused, logged and counted; the running policy still decides.
    let refused = reloads(metrics_port, "refused", Duration::from_secs(10)).await;
    std::fs::write(&policy, "[[rule]]\nname = \"x\"\nwhen = \"(\"\n").unwrap();
    let counted = eventually_within(500, || mesh.log().contains("policy reload refused")).await;
    assert!(counted, "a broken file is logged:\n{}", mesh.log());
    let mut rose = false;
    for _ in 0..400 {
        if reloads(metrics_port, "refused", Duration::from_secs(10)).await > refused {
            rose = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(rose, "the refusal is counted");
    assert_eq!(
        content(&shell(&coordinator).await),
        "third",
        "the running policy is kept"
    );
    // A broken file does not stop the watch: the next good one applies.
    std::fs::write(&policy, rule("no-shell", "shell.*", "fourth")).unwrap();
    until_content(&coordinator, "fourth").await;
    let _ = std::fs::remove_dir_all(&dir);
}
