//! Where a guard's replicas come from (R32): every address of a DNS name,
//! re-resolved as it changes and held to the endpoint policy at every
//! resolution; and replicas that join and leave through `guardmesh
//! heartbeat --replica` on a real 3-member etcd cluster (R15).
//!
//! These tests read the replica sets the sources publish (what the guard's
//! pool of links follows). The DNS test resolves through the system's own
//! resolver: it runs in a child process of this binary inside a private
//! mount namespace (`unshare -m`) whose `/etc/hosts` is a file the test
//! writes, so the test owns the name without touching the machine's.

use guardmesh_server::link::dial::EndpointPolicy;
use guardmesh_server::link::discover::dns::{SystemResolver, watch_endpoint};
use guardmesh_server::link::discover::{Replicas, union};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NAME: &str = "replicas.guardmesh.test";
const CHILD_HOSTS: &str = "GUARDMESH_DISCOVERY_HOSTS";

fn endpoints(rx: &Replicas) -> Vec<String> {
    rx.borrow().iter().map(|t| t.endpoint.clone()).collect()
}

fn write_hosts(path: &str, ips: &[&str]) {
    // Written in place (same inode): the bind mount shows the new content.
    let text: String = ips.iter().map(|ip| format!("{ip} {NAME}\n")).collect();
    std::fs::write(path, text).unwrap();
}

async fn until(rx: &mut Replicas, want: &[&str], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while endpoints(rx) != want {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{what}: have {:?}, want {want:?}",
            endpoints(rx)
        );
        let _ = tokio::time::timeout(left, rx.changed()).await;
    }
}

/// A name resolving to three loopback addresses is three replicas;
/// addresses added and removed in the hosts file are followed while the
/// watch is read; a name that re-resolves to the metadata address loses
/// that address and never publishes it (R32, endpoint policy).
#[test]
fn r32_a_dns_name_is_every_address_it_resolves_to_and_never_metadata() {
    let dir = std::env::temp_dir().join(format!(
        "guardmesh-discovery-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "").unwrap();
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "mount --bind '{}' /etc/hosts && exec '{}' guard_discovery::dns_child --exact \
         --include-ignored --test-threads=1 --nocapture",
        hosts.display(),
        exe.display()
    );
    let output = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .env(CHILD_HOSTS, &hosts)
        .output()
        .expect("unshare");
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("DNS-CHILD-PASSED"),
        "the child in its own mount namespace failed: {}\n{stdout}\n{stderr}",
        output.status
    );
}

/// The body of the DNS test, run only as the child above (in a mount
/// namespace whose /etc/hosts is the test's).
#[tokio::test]
#[ignore = "run by r32_a_dns_name_is_every_address_it_resolves_to_and_never_metadata"]
async fn dns_child() {
    let Ok(hosts) = std::env::var(CHILD_HOSTS) else {
        return;
    };
    write_hosts(&hosts, &["127.0.0.3", "127.0.0.2", "127.0.0.4"]);
    let endpoint = format!("http://{NAME}:7001");
    let (mut rx, handle) = watch_endpoint(
        "g",
        &endpoint,
        Arc::new(EndpointPolicy::default()),
        Duration::from_secs(1),
        Arc::new(SystemResolver),
    )
    .await
    .unwrap();
    assert_eq!(
        endpoints(&rx),
        [
            "http://127.0.0.2:7001",
            "http://127.0.0.3:7001",
            "http://127.0.0.4:7001"
        ],
        "every address of the name is a replica"
    );
    // One removed, one added: followed on the interval.
    write_hosts(&hosts, &["127.0.0.3", "127.0.0.4", "127.0.0.5"]);
    until(
        &mut rx,
        &[
            "http://127.0.0.3:7001",
            "http://127.0.0.4:7001",
            "http://127.0.0.5:7001",
        ],
        "re-resolved on the interval",
    )
    .await;
    // A link asks after a failure: resolved again without waiting.
    write_hosts(&hosts, &["127.0.0.4"]);
    handle.resolve_now();
    until(
        &mut rx,
        &["http://127.0.0.4:7001"],
        "re-resolved on request",
    )
    .await;
    // The name now also points at the metadata address: refused, counted,
    // never published.
    let refused = handle.refused();
    write_hosts(&hosts, &["127.0.0.4", "169.254.169.254", "127.0.0.6"]);
    until(
        &mut rx,
        &["http://127.0.0.4:7001", "http://127.0.0.6:7001"],
        "metadata refused",
    )
    .await;
    assert!(handle.refused() > refused, "the refusal is counted");
    write_hosts(&hosts, &["169.254.169.254"]);
    until(&mut rx, &[], "only metadata left: no replica").await;
    // Unresolvable: the last set stays (empty here), nothing else appears.
    write_hosts(&hosts, &["127.0.0.7"]);
    until(&mut rx, &["http://127.0.0.7:7001"], "back").await;
    println!("DNS-CHILD-PASSED");
}

/// `guardmesh heartbeat --replica` processes, one per replica.
struct Heartbeats(Vec<Child>);

impl Drop for Heartbeats {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Three replicas announced by three heartbeat processes on a real 3-member
/// etcd cluster: killing one heartbeat (SIGKILL) removes only that replica
/// when its lease lapses; the registration's own endpoint stays in the
/// union, and the guard stays in the chain (R32, R15). A heartbeat that
/// announces the metadata address is refused by the endpoint policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r32_heartbeat_replicas_leave_with_their_own_lease_only() {
    use guardmesh_server::Registry;
    use guardmesh_server::registry::etcd::{EtcdRegistry, Liveness};
    let cluster = crate::etcd::Cluster::start().await;
    let mut config = crate::etcd::cluster_settings(cluster.urls(), "/t/discovery");
    config.lease_ttl = Duration::from_secs(2);
    let registry = EtcdRegistry::connect(config, Duration::from_secs(2))
        .await
        .unwrap();
    let spec = guardmesh_client::proto::GuardSpec {
        name: "g".into(),
        endpoint: "http://127.0.0.2:7001".into(),
        ..Default::default()
    };
    registry
        .register(crate::etcd::admitted(spec), None)
        .await
        .unwrap();

    let dir = std::env::temp_dir().join(format!(
        "guardmesh-discovery-etcd-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("mesh.toml");
    let endpoints_toml: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    std::fs::write(
        &file,
        format!(
            "[registry]\nkind = \"etcd\"\nendpoints = [{}]\nprefix = \"/t/discovery\"\n\
             heartbeat_interval_ms = 200\nlease_ttl_s = 2\n",
            endpoints_toml.join(", ")
        ),
    )
    .unwrap();
    let beat = |replica: &str| {
        Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["heartbeat", "--name", "g", "--config"])
            .arg(&file)
            .args(["--replica", replica])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut beats = Heartbeats(vec![
        beat("127.0.0.3:7001"),
        beat("http://127.0.0.4:7001"),
        beat("http://127.0.0.5:7001"),
        beat("http://169.254.169.254:80"),
    ]);

    let policy = Arc::new(EndpointPolicy::default());
    let mut announced = registry.replicas("g", policy.clone());
    let mut all = union(vec![
        guardmesh_server::link::discover::fixed(["http://127.0.0.2:7001".to_string()]),
        registry.announced_replicas("g", policy).unwrap(),
    ]);
    until(
        &mut announced,
        &[
            "http://127.0.0.3:7001",
            "http://127.0.0.4:7001",
            "http://127.0.0.5:7001",
        ],
        "three heartbeats, three replicas; metadata never",
    )
    .await;
    until(
        &mut all,
        &[
            "http://127.0.0.2:7001",
            "http://127.0.0.3:7001",
            "http://127.0.0.4:7001",
            "http://127.0.0.5:7001",
        ],
        "the registration's endpoint and the announced replicas",
    )
    .await;
    // The metadata heartbeat may write its key after the three others.
    let refused_by = Instant::now() + Duration::from_secs(20);
    while registry.replicas_refused() < 1 && Instant::now() < refused_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        registry.replicas_refused() >= 1,
        "the metadata address is refused and counted"
    );
    assert_eq!(
        registry.status().liveness,
        [("g".to_owned(), Liveness::Alive)]
    );

    // kill -9 the heartbeat of 127.0.0.4: its lease lapses (2 s TTL).
    let mut killed = beats.0.remove(1);
    killed.kill().unwrap();
    killed.wait().unwrap();
    until(
        &mut announced,
        &["http://127.0.0.3:7001", "http://127.0.0.5:7001"],
        "only the killed replica leaves",
    )
    .await;
    // The others stay over more than a lease's time.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        endpoints(&announced),
        ["http://127.0.0.3:7001", "http://127.0.0.5:7001"]
    );

    // Every announced replica gone: the guard stays in the chain with its
    // registered endpoint (R15).
    drop(beats);
    until(&mut announced, &[], "every announced replica left").await;
    until(
        &mut all,
        &["http://127.0.0.2:7001"],
        "the registration stays",
    )
    .await;
    assert_eq!(
        registry.chain().guards.len(),
        1,
        "liveness never removes policy"
    );
    let _ = std::fs::remove_dir_all(dir);
}
