//! Policy reloads that cannot be turned against the mesh (R27, R25): a real
//! `guardmesh serve` with a policy guard from its config, whose policy file
//! is written in two parts, or replaced by a FIFO, a link to `/dev/zero` or
//! a 1 GiB sparse file. Only a complete regular file within the size bound
//! is applied; the others are refused (logged and counted) while batches
//! keep being answered. Waits are polls with a bound.

use crate::harness::*;
use crate::policy_watch::{content, rule, shell};
use guardmesh_client::{BatchDecision, Coordinator};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The shell call's decision, which must come within 1 s (the canary).
async fn canary(coordinator: &Coordinator, what: &str) -> BatchDecision {
    tokio::time::timeout(Duration::from_secs(1), shell(coordinator))
        .await
        .unwrap_or_else(|_| panic!("{what}: a batch was not answered within 1 s"))
}

/// `guardmesh_policy_reloads_total{outcome=...}`, within 1 s.
async fn reloads(metrics_port: u16, outcome: &str) -> f64 {
    crate::policy_watch::reloads(metrics_port, outcome, Duration::from_secs(1)).await
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
    /// A mesh whose policy cancels shell calls with "no shell", which it
    /// does from the start.
    async fn no_shell(name: &str) -> Self {
        let r = Self::start(name, &rule("no-shell", "shell.*", "no shell")).await;
        assert_eq!(content(&canary(&r.coordinator, "start").await), "no shell");
        r
    }

    /// Fails unless the mesh stays under 256 MiB resident: `what` was not
    /// read.
    #[track_caller]
    fn read_nothing(&self, what: &str) {
        let (rss, _) = self.mesh.memory_mib();
        assert!(rss < 256, "{what}: RSS {rss} MiB");
    }

    /// Fails unless the mesh's log says `why` (the reason of a refusal).
    #[track_caller]
    fn says(&self, why: &str) {
        assert!(
            self.mesh.log().contains(why),
            "the refusal says why:\n{}",
            self.mesh.log()
        );
    }

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
        let coordinator = mesh.coordinator().await;
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
        let kept = async || {
            let d = canary(&self.coordinator, what).await;
            assert_eq!(
                content(&d),
                "no shell",
                "{what}: the running policy is kept"
            );
        };
        for _ in 0..400 {
            kept().await;
            if reloads(self.metrics_port, "refused").await > before {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(refused, "{what}: the reload is refused and counted");
        // And still after the refusal.
        for _ in 0..5 {
            kept().await;
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
    let r = Reloading::no_shell("fifo").await;
    r.refused_while_judging("a FIFO", replace_with_fifo).await;
    r.says("not a regular file");
    r.recovers("no shell, after the FIFO").await;
}

#[tokio::test]
async fn r27_a_link_to_dev_zero_in_place_of_a_policy_file_is_refused_and_batches_are_answered() {
    let r = Reloading::no_shell("dev-zero").await;
    r.refused_while_judging("a link to /dev/zero", |path| {
        let link = path.with_extension("toml.link");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        std::fs::rename(&link, path).unwrap();
    })
    .await;
    r.says("character device");
    r.read_nothing("nothing of /dev/zero was read");
    r.recovers("no shell, after /dev/zero").await;
}

#[tokio::test]
async fn r27_a_sparse_gigabyte_policy_file_is_refused_by_its_size_and_batches_are_answered() {
    let r = Reloading::no_shell("sparse").await;
    r.refused_while_judging("a 1 GiB sparse file", |path| {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.set_len(1 << 30).unwrap();
    })
    .await;
    r.says("more than a policy file may");
    r.read_nothing("the sparse file was not read");
    r.recovers("no shell, after the sparse file").await;
}
