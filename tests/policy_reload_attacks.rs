//! Policy reloads that cannot be turned against the mesh (R27, R25): a real
//! `guardmesh serve` with a policy guard from its config, whose policy file
//! is written in two parts, or replaced by a FIFO, a link to `/dev/zero` or
//! a 1 GiB sparse file. Only a complete regular file within the size bound
//! is applied; the others are refused (logged and counted) while batches
//! keep being answered. Waits are polls with a bound.

use crate::harness::*;
use guardmesh_client::{Batch, BatchDecision, Coordinator, Outcome};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn rule(name: &str, tools: &str, message: &str) -> String {
    format!(
        "[[rule]]\nname = \"{name}\"\ntools = [\"{tools}\"]\nwhen = \"true\"\n\
         action = \"cancel\"\nmessage = '\"{message}\"'\n"
    )
}

fn content(d: &BatchDecision) -> String {
    match &d.calls[0].outcome {
        Outcome::Cancel { content } | Outcome::Steer { content } => content.clone(),
        Outcome::Proceed => String::new(),
    }
}

async fn shell(coordinator: &Coordinator) -> BatchDecision {
    coordinator
        .evaluate_once("s", Batch::new(0).call("sh", "shell.exec", "{}"))
        .await
        .unwrap()
}

/// The shell call's decision, which must come within 1 s (the canary).
async fn canary(coordinator: &Coordinator, what: &str) -> BatchDecision {
    tokio::time::timeout(Duration::from_secs(1), shell(coordinator))
        .await
        .unwrap_or_else(|_| panic!("{what}: a batch was not answered within 1 s"))
}

/// `guardmesh_policy_reloads_total{outcome=...}` on the metrics endpoint.
async fn reloads(metrics_port: u16, outcome: &str) -> f64 {
    let text = fetch_metrics(metrics_port, Duration::from_secs(1))
        .await
        .expect("the metrics endpoint answers within 1 s");
    let sample = format!("guardmesh_policy_reloads_total{{outcome=\"{outcome}\"}}");
    sample_sum(&text, &sample)
}

/// A mesh process whose guard `policy` reads `rules.toml` in a folder of
/// its own, holding `text`.
struct Reloading {
    mesh: MeshProcess,
    coordinator: Coordinator,
    policy: PathBuf,
    dir: PathBuf,
    metrics_port: u16,
}

impl Reloading {
    async fn start(name: &str, text: &str) -> Self {
        let dir = fresh_dir(&format!("reload-attack-{name}"));
        let policy = dir.join("rules.toml");
        std::fs::write(&policy, text).unwrap();
        let metrics_port = free_port();
        let config = format!(
            "metrics_listen = \"127.0.0.1:{metrics_port}\"\n\n[[guard]]\nname = \"policy\"\npolicy = {:?}\n",
            policy.display().to_string()
        );
        let mesh = MeshProcess::start(name, &config, Some("info")).await;
        let coordinator = Coordinator::connect(mesh.url.clone()).await.unwrap();
        Self {
            mesh,
            coordinator,
            policy,
            dir,
            metrics_port,
        }
    }

    /// Puts `attack` in place of the policy file, then, until the reload
    /// is refused (at most 10 s), checks every 25 ms that a batch is
    /// answered within 1 s by the running policy.
    async fn refused_while_judging(&self, what: &str, attack: impl FnOnce(&Path)) {
        let before = reloads(self.metrics_port, "refused").await;
        attack(&self.policy);
        let mut refused = false;
        for _ in 0..400 {
            let d = canary(&self.coordinator, what).await;
            assert_eq!(
                content(&d),
                "no shell",
                "{what}: the running policy is kept"
            );
            if reloads(self.metrics_port, "refused").await > before {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(refused, "{what}: the reload is refused and counted");
        // And still after the refusal.
        for _ in 0..5 {
            let d = canary(&self.coordinator, what).await;
            assert_eq!(
                content(&d),
                "no shell",
                "{what}: the running policy is kept"
            );
        }
    }

    /// Puts a good file back by a rename; the watch goes on.
    async fn recovers(&self, message: &str) {
        let temporary = self.dir.join("rules.toml.new");
        std::fs::write(&temporary, rule("no-shell", "shell.*", message)).unwrap();
        std::fs::rename(&temporary, &self.policy).unwrap();
        let mut last = String::new();
        for _ in 0..400 {
            last = content(&canary(&self.coordinator, "recovery").await);
            if last == message {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("a good file renamed into place is applied; still {last:?}");
    }
}

impl Drop for Reloading {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn replace_with_fifo(path: &Path) {
    std::fs::remove_file(path).unwrap();
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test]
async fn r27_a_policy_file_written_in_two_parts_is_applied_only_once_closed() {
    let first = format!(
        "{}{}",
        rule("no-bash", "bash", "no bash"),
        rule("no-shell", "shell.*", "no shell")
    );
    let r = Reloading::start("two-parts", &first).await;
    assert_eq!(content(&canary(&r.coordinator, "start").await), "no shell");

    // Rewritten in place: the first part is a valid policy with fewer
    // rules (no shell rule); the second part, 700 ms later, adds it back.
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&r.policy)
        .unwrap();
    file.write_all(rule("no-bash", "bash", "no bash, v2").as_bytes())
        .unwrap();
    file.flush().unwrap();
    let window = std::time::Instant::now();
    while window.elapsed() < Duration::from_millis(700) {
        let d = canary(&r.coordinator, "the write's window").await;
        assert!(
            !d.calls[0].proceeds(),
            "a forbidden call proceeded while the file was half written ({:?} after the first part)",
            window.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    file.write_all(rule("no-shell", "shell.*", "no shell, v2").as_bytes())
        .unwrap();
    drop(file);
    let mut last = String::new();
    for _ in 0..400 {
        let d = canary(&r.coordinator, "after the close").await;
        assert!(!d.calls[0].proceeds(), "{:?}", d.calls[0]);
        last = content(&d);
        if last == "no shell, v2" {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the complete file is applied once closed; still {last:?}");
}

#[tokio::test]
async fn r27_a_fifo_in_place_of_a_policy_file_is_refused_and_batches_are_answered() {
    let r = Reloading::start("fifo", &rule("no-shell", "shell.*", "no shell")).await;
    assert_eq!(content(&canary(&r.coordinator, "start").await), "no shell");
    r.refused_while_judging("a FIFO", replace_with_fifo).await;
    assert!(
        r.mesh.log().contains("not a regular file"),
        "the refusal says why:\n{}",
        r.mesh.log()
    );
    r.recovers("no shell, after the FIFO").await;
}

#[tokio::test]
async fn r27_a_link_to_dev_zero_in_place_of_a_policy_file_is_refused_and_batches_are_answered() {
    let r = Reloading::start("dev-zero", &rule("no-shell", "shell.*", "no shell")).await;
    assert_eq!(content(&canary(&r.coordinator, "start").await), "no shell");
    r.refused_while_judging("a link to /dev/zero", |path| {
        let link = path.with_extension("toml.link");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        std::fs::rename(&link, path).unwrap();
    })
    .await;
    assert!(
        r.mesh.log().contains("character device"),
        "the refusal says why:\n{}",
        r.mesh.log()
    );
    let (rss, _) = r.mesh.memory_mib();
    assert!(rss < 256, "nothing of /dev/zero was read: RSS {rss} MiB");
    r.recovers("no shell, after /dev/zero").await;
}

#[tokio::test]
async fn r27_a_sparse_gigabyte_policy_file_is_refused_by_its_size_and_batches_are_answered() {
    let r = Reloading::start("sparse", &rule("no-shell", "shell.*", "no shell")).await;
    assert_eq!(content(&canary(&r.coordinator, "start").await), "no shell");
    r.refused_while_judging("a 1 GiB sparse file", |path| {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.set_len(1 << 30).unwrap();
    })
    .await;
    assert!(
        r.mesh.log().contains("more than a policy file may"),
        "the refusal says why:\n{}",
        r.mesh.log()
    );
    let (rss, _) = r.mesh.memory_mib();
    assert!(rss < 256, "the sparse file was not read: RSS {rss} MiB");
    r.recovers("no shell, after the sparse file").await;
}
