//! What one registrar may hold, counted where the chain lives (R16, R25).
//!
//! The per-identity quota is the registry's: with replicas sharing a chain
//! on a real 3-member etcd, one quota for all of them, not one each; and
//! the bytes of an identity's compiled policies are bounded at admission
//! and freed when its guards go.

use crate::etcd::{Cluster, cluster_settings};
use crate::harness::*;
use guardmesh_client::{ClientError, Connection, Registrar, Registration};
use guardmesh_server::registry::etcd::{EtcdConfig, EtcdRegistry};
use guardmesh_server::security::auth::{AuthPolicy, Caller, Principal, Role};
use guardmesh_server::{MeshConfig, Registry};
use std::sync::Arc;
use std::time::Duration;

const TEAM_TOKEN: &str = "team-token";
const OTHER_TOKEN: &str = "other-token";
const ADMIN_TOKEN: &str = "admin-token";

fn principal(id: &str, token: &str, max_registrations: usize) -> Principal {
    Principal {
        id: id.to_owned(),
        token: Some(token.to_owned()),
        caller: Caller {
            id: id.to_owned(),
            roles: [Role::Register].into_iter().collect(),
            name_prefixes: Vec::new(),
            max_registrations,
        },
    }
}

/// Two registrars with bearer tokens over loopback, `team` with a quota
/// of `quota` guards and `other` with 16, and an admin (`List`).
fn auth_config(quota: usize) -> MeshConfig {
    let mut config = fast_config();
    config.security.auth = Some(Arc::new(AuthPolicy {
        principals: vec![
            principal("team", TEAM_TOKEN, quota),
            principal("other", OTHER_TOKEN, 16),
            Principal {
                caller: Caller {
                    roles: [Role::Admin].into_iter().collect(),
                    ..principal("ops", ADMIN_TOKEN, 0).caller
                },
                ..principal("ops", ADMIN_TOKEN, 0)
            },
        ],
        plaintext_tokens_on_loopback: true,
        tokens_without_client_cert: true,
    }));
    config
}

async fn registrar(url: &str, token: &str) -> Registrar {
    Registrar::connect_with(
        url.to_owned(),
        &Connection {
            tls: None,
            token: Some(token.to_owned()),
        },
    )
    .await
    .unwrap()
}

fn status(result: Result<impl std::fmt::Debug, ClientError>) -> (tonic::Code, String) {
    match result {
        Err(ClientError::Status(status)) => (status.code(), status.message().to_owned()),
        other => panic!("expected a gRPC status, got {other:?}"),
    }
}

/// A mesh replica whose registry is on the cluster, under `prefix`.
async fn replica(cluster: &Cluster, prefix: &str, quota: usize) -> (TestMesh, Arc<EtcdRegistry>) {
    let config = auth_config(quota);
    // The fault tests' short request timeout (700 ms) is not what this
    // file tests: on a loaded machine a quorum write can take longer.
    let settings = EtcdConfig {
        request_timeout: Duration::from_secs(5),
        ..cluster_settings(cluster.urls(), prefix)
    };
    let registry = Arc::new(
        EtcdRegistry::connect(settings, config.default_guard_timeout)
            .await
            .unwrap(),
    );
    (
        TestMesh::with_registry(config, registry.clone()).await,
        registry,
    )
}

/// Replicas A and B of one chain on `cluster` under `prefix` (the team's
/// quota 3), each with its registry and the team's registrar on it.
async fn team_replicas(
    cluster: &Cluster,
    prefix: &str,
) -> [(TestMesh, Arc<EtcdRegistry>, Registrar); 2] {
    let mut out = Vec::new();
    for _ in 0..2 {
        let (mesh, registry) = replica(cluster, prefix, 3).await;
        let team = registrar(&mesh.url, TEAM_TOKEN).await;
        out.push((mesh, registry, team));
    }
    out.try_into().unwrap_or_else(|_| unreachable!())
}

/// The names of the guards in `registry`'s chain once it has read
/// `revision` (within 15 s), sorted.
async fn names_at(registry: &EtcdRegistry, revision: u64) -> Vec<String> {
    assert!(registry.wait_for(revision, Duration::from_secs(15)).await);
    let mut names: Vec<String> = registry
        .chain()
        .guards
        .iter()
        .map(|g| g.name.clone())
        .collect();
    names.sort();
    names
}

/// Registers through `on` the policy guard `name` of [`pattern_policy`]
/// of `tag`.
async fn register_policy(on: &Registrar, name: &str, tag: &str) {
    on.register(Registration::policy(name, pattern_policy(tag)))
        .await
        .unwrap();
}

/// The message of `on`'s refusal of `registration`: RESOURCE_EXHAUSTED.
async fn exhausted(on: &Registrar, registration: Registration) -> String {
    let (code, message) = status(on.register(registration).await);
    assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
    message
}

/// The quota refusal as a single mesh has always worded it.
const QUOTA_3: &str = "team already registered 3 guards, its limit";

/// R16/R25: a registrar with a quota of 3 registering alternately through
/// two replicas of one chain gets 3 guards, not 6: the 4th is refused on
/// either replica with the quota refusal; an update of its own guard is
/// not counted; deregistering one (through either replica) frees one;
/// another registrar is not counted against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r16_registration_quota_is_shared_by_etcd_replicas() {
    let cluster = Cluster::start().await;
    let [(a, _, on_a), (b, b_registry, on_b)] = team_replicas(&cluster, "/t/quota").await;
    let endpoint = "127.0.0.1:1";
    on_a.register(Registration::validate("g0", endpoint))
        .await
        .unwrap();
    on_b.register(Registration::validate("g1", endpoint))
        .await
        .unwrap();
    on_a.register(Registration::validate("g2", endpoint))
        .await
        .unwrap();
    for (replica, on) in [("b", &on_b), ("a", &on_a)] {
        let (code, message) = status(on.register(Registration::validate("g3", endpoint)).await);
        assert_eq!(code, tonic::Code::ResourceExhausted, "{replica}: {message}");
        assert_eq!(message, QUOTA_3, "replica {replica}");
    }
    // An update of a guard it owns, through the other replica: not counted.
    let updated = on_b
        .register(Registration::validate("g0", "127.0.0.1:2"))
        .await
        .unwrap();
    assert!(!updated.created);
    // Another registrar has its own quota.
    registrar(&a.url, OTHER_TOKEN)
        .await
        .register(Registration::validate("o0", endpoint))
        .await
        .unwrap();
    // Deregistering one through B frees one place, on either replica.
    assert!(on_b.deregister("g1").await.unwrap());
    on_a.register(Registration::validate("g3", endpoint))
        .await
        .unwrap();
    let message = exhausted(&on_b, Registration::validate("g4", endpoint)).await;
    assert_eq!(message, QUOTA_3);
    let last = registrar(&b.url, ADMIN_TOKEN).await.list().await.unwrap();
    let names = names_at(&b_registry, last.revision).await;
    assert_eq!(names, ["g0", "g2", "g3", "o0"]);
    a.shutdown().await;
    b.shutdown().await;
}

/// R16/R25: registrations of one registrar racing on both replicas never
/// pass its quota: of 10 concurrent registrations of distinct names (5 per
/// replica) with a quota of 3, exactly 3 are applied and every other one is
/// refused with the quota refusal. Three rounds, the guards deregistered
/// between rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r16_concurrent_registrations_on_two_replicas_never_exceed_the_quota() {
    let cluster = Cluster::start().await;
    let [(a, a_registry, on_a), (b, b_registry, on_b)] =
        team_replicas(&cluster, "/t/quota-race").await;
    let admin = registrar(&a.url, ADMIN_TOKEN).await;
    for round in 0..3 {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..10 {
            let on = if i % 2 == 0 {
                on_a.clone()
            } else {
                on_b.clone()
            };
            let name = format!("r{round}-g{i}");
            tasks.spawn(async move {
                let out = on
                    .register(Registration::validate(name.as_str(), "127.0.0.1:1"))
                    .await;
                (name, out)
            });
        }
        let mut applied = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            let (name, out) = joined.unwrap();
            match out {
                Ok(_) => applied.push(name),
                Err(error) => {
                    let (code, message) = status(Err::<(), _>(error));
                    assert_eq!(
                        (code, message.as_str()),
                        (tonic::Code::ResourceExhausted, QUOTA_3),
                        "round {round}: {name}"
                    );
                }
            }
        }
        assert_eq!(applied.len(), 3, "round {round}: applied {applied:?}");
        let revision = admin.list().await.unwrap().revision;
        applied.sort();
        for registry in [&a_registry, &b_registry] {
            let names = names_at(registry, revision).await;
            assert_eq!(names, applied, "round {round}");
        }
        for name in &applied {
            assert!(on_b.deregister(name).await.unwrap());
        }
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// R16: a registration is checked once. The replica that admitted and
/// wrote it serves the very guard it checked, also after its own watch
/// reads the write back; the other replica reads the stored spec and
/// builds the guard once, with the same policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r16_the_writing_replica_serves_the_guard_it_admitted() {
    let cluster = Cluster::start().await;
    let prefix = "/t/checked-once";
    let (a, a_registry) = replica(&cluster, prefix, 3).await;
    let (b, b_registry) = replica(&cluster, prefix, 3).await;
    let admission = guardmesh_server::registry::Admission::of(&a.mesh.config);
    let checked = guardmesh_server::registry::admit(
        Registration::policy("p", pattern_policy("p")).build(),
        &admission,
    )
    .await
    .unwrap();
    let out = a_registry.register(checked.clone(), None).await.unwrap();
    assert!(out.created);
    for registry in [&a_registry, &b_registry] {
        assert!(
            registry
                .wait_for(out.revision, Duration::from_secs(15))
                .await
        );
    }
    let served = a_registry.chain().guards[0].clone();
    assert!(
        Arc::ptr_eq(&served, checked.guard()),
        "the writer serves the guard it admitted, not a second build"
    );
    let other = b_registry.chain().guards[0].clone();
    assert!(!Arc::ptr_eq(&other, checked.guard()));
    assert_eq!(other.to_spec(), served.to_spec());
    // A later change elsewhere in the chain leaves both guards as built.
    let more = guardmesh_server::registry::admit(
        Registration::validate("r", "127.0.0.1:1").build(),
        &admission,
    )
    .await
    .unwrap();
    let out = a_registry.register(more, None).await.unwrap();
    for registry in [&a_registry, &b_registry] {
        assert!(
            registry
                .wait_for(out.revision, Duration::from_secs(15))
                .await
        );
    }
    assert!(Arc::ptr_eq(&a_registry.chain().guards[0], &served));
    assert!(Arc::ptr_eq(&b_registry.chain().guards[0], &other));
    a.shutdown().await;
    b.shutdown().await;
}

/// A policy with one `matches` pattern of its own (`^{tag}$`): each such
/// policy is charged the same bytes.
fn pattern_policy(tag: &str) -> String {
    format!(
        "[[rule]]\nname = \"r\"\nwhen = \"call.tool.matches('^{tag}$')\"\naction = \"cancel\"\nmessage = '\"no\"'\n"
    )
}

/// Bytes a policy guard with `source` is charged against its owner's
/// bound: its compiled patterns plus its source.
fn charged(source: &str) -> usize {
    guardmesh_server::policy::Policy::compile(source)
        .unwrap()
        .pattern_bytes()
        + source.len()
}

/// R25: the compiled policies of one identity's guards are bounded
/// together: with a bound that holds two policies, the third is refused
/// with RESOURCE_EXHAUSTED naming the bound and what the identity holds;
/// a remote guard (no policy) still registers; deregistering a policy
/// guard frees its bytes; another identity is not counted against it;
/// updating a guard in place is charged once.
#[tokio::test]
async fn r25_compiled_policy_bytes_are_bounded_per_identity() {
    let each = charged(&pattern_policy("p0"));
    assert_eq!(each, charged(&pattern_policy("p1")));
    let mut config = auth_config(16);
    config.max_policy_bytes_per_identity = 2 * each + each / 2;
    let mesh = TestMesh::with_config(config).await;
    let team = registrar(&mesh.url, TEAM_TOKEN).await;
    for tag in ["p0", "p1"] {
        register_policy(&team, tag, tag).await;
    }
    // Updating a guard in place replaces its charge.
    register_policy(&team, "p1", "q1").await;
    let message = exhausted(&team, Registration::policy("p2", pattern_policy("p2"))).await;
    for needle in [
        "team:".to_owned(),
        "max_policy_bytes_per_identity".to_owned(),
        format!("bound of {} bytes", 2 * each + each / 2),
        format!("hold {} bytes now", 2 * each),
    ] {
        assert!(message.contains(&needle), "{needle:?} in {message}");
    }
    let admin = registrar(&mesh.url, ADMIN_TOKEN).await;
    assert_eq!(
        admin.list().await.unwrap().guards.len(),
        2,
        "nothing applied"
    );
    team.register(Registration::validate("remote", "127.0.0.1:1"))
        .await
        .unwrap();
    registrar(&mesh.url, OTHER_TOKEN)
        .await
        .register(Registration::policy("o0", pattern_policy("o0")))
        .await
        .unwrap();
    assert!(team.deregister("p0").await.unwrap());
    register_policy(&team, "p2", "p2").await;
    mesh.shutdown().await;
}

/// R25 with replicas: the bound on an identity's compiled policies holds
/// across replicas of one etcd chain: a policy registered through B a
/// moment ago is counted by A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r25_policy_bytes_per_identity_are_counted_across_etcd_replicas() {
    let each = charged(&pattern_policy("p0"));
    let cluster = Cluster::start().await;
    let prefix = "/t/policy-bytes";
    let start = |bound: usize| {
        let mut config = auth_config(16);
        config.max_policy_bytes_per_identity = bound;
        let urls = cluster.urls();
        async move {
            let registry = Arc::new(
                EtcdRegistry::connect(cluster_settings(urls, prefix), config.default_guard_timeout)
                    .await
                    .unwrap(),
            );
            TestMesh::with_registry(config, registry).await
        }
    };
    let bound = 2 * each + each / 2;
    let a = start(bound).await;
    let b = start(bound).await;
    let on_a = registrar(&a.url, TEAM_TOKEN).await;
    let on_b = registrar(&b.url, TEAM_TOKEN).await;
    register_policy(&on_a, "p0", "p0").await;
    register_policy(&on_b, "p1", "p1").await;
    let message = exhausted(&on_a, Registration::policy("p2", pattern_policy("p2"))).await;
    assert!(
        message.contains(&format!("hold {} bytes now", 2 * each)),
        "{message}"
    );
    assert!(on_a.deregister("p1").await.unwrap());
    register_policy(&on_b, "p2", "p2").await;
    a.shutdown().await;
    b.shutdown().await;
}
