//! The decision log at the mesh's edges (R29 with R24): requests refused by
//! the auth layer, before any service reads them, are recorded; a chain
//! change whose record cannot be written is refused and not applied.

use crate::harness::*;
use guardmesh_client::{Batch, Coordinator, Registrar, Registration};
use guardmesh_server::decision_log::{LogConfig, OnLogFailure, segment};
use std::path::Path;

/// R29 with R24: a batch or chain change the auth layer refuses
/// (UNAUTHENTICATED, PERMISSION_DENIED) is recorded with the caller as far
/// as it is known and the status, and no batch; other refused calls (a
/// `List`) are not decisions and are not recorded.
#[tokio::test]
async fn r29_requests_refused_by_the_auth_layer_are_recorded() {
    let dir = folder("auth-refusals");
    let log = dir.join("log");
    let pki = TestPki::new();
    let (mesh, url) =
        TestMesh::with_tokens(&pki, &[AGENT, ("reg", "reg-token", &["register"])], "").await;
    mesh.attach_log(LogConfig::new(&log, "test"), OnLogFailure::Refuse)
        .await;
    let batch = || Batch::new(0).call("c1", "t", "{}");

    // No credentials: UNAUTHENTICATED, a batch and a deregistration.
    let anonymous = pki.connection(None, None);
    let err = Coordinator::connect_with(url.clone(), &anonymous)
        .await
        .unwrap()
        .evaluate_once("s", batch())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unauthenticated), "{err}");
    let nobody = Registrar::connect_with(url.clone(), &anonymous)
        .await
        .unwrap();
    let err = nobody.deregister("g").await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unauthenticated), "{err}");
    // Not a batch nor a change: refused, not recorded.
    assert!(nobody.list().await.is_err());

    // Valid credentials without the role: PERMISSION_DENIED.
    let err = pki
        .coordinator(&url, "reg-token")
        .await
        .evaluate_once("s", batch())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::PermissionDenied), "{err}");
    let err = pki
        .registrar(&url, "agent-token")
        .await
        .register(Registration::validate("p", "http://127.0.0.1:1"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::PermissionDenied), "{err}");

    let all = records(&log);
    assert_eq!(
        all.len(),
        4,
        "one record per refused batch or change: {all:?}"
    );
    let kinds: Vec<_> = all.iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["decision", "chain_change", "decision", "chain_change"]
    );
    let codes: Vec<_> = all
        .iter()
        .map(|r| r["outcome"]["code"].as_i64().unwrap())
        .collect();
    assert_eq!(codes, [16, 16, 7, 7]);
    for record in &all {
        assert_eq!(record["outcome"]["status"], "refused", "{record}");
        assert!(
            record["caller"]["peer"]
                .as_str()
                .is_some_and(|p| p.starts_with("127.0.0.1:")),
            "{record}"
        );
    }
    // Unknown callers are unnamed; known ones named with their roles.
    assert!(all[0]["caller"]["id"].is_null());
    assert!(all[1]["caller"]["id"].is_null());
    assert_eq!(all[1]["change"], "deregister");
    assert_eq!(all[2]["caller"]["id"], "reg");
    assert_eq!(all[2]["caller"]["roles"], serde_json::json!(["register"]));
    assert_eq!(all[3]["caller"]["id"], "agent");
    assert_eq!(all[3]["change"], "register");
    assert!(
        all[3]["outcome"]["message"]
            .as_str()
            .unwrap()
            .contains("Register")
    );
    // No batch was read: none is recorded.
    for decision in [&all[0], &all[2]] {
        assert_eq!(decision["batch"]["calls"], serde_json::json!([]));
        assert!(decision["chain_revision"].is_null());
    }
    let report = guardmesh_server::decision_log::verify(&log).unwrap();
    assert_eq!(report.records, 4);
    drop(mesh);
    let _ = std::fs::remove_dir_all(&dir);
}

/// R29: under `on_log_failure = "refuse"`, a registration or deregistration
/// whose record cannot be written is refused UNAVAILABLE naming the log, and
/// the chain is left as it was. (The log writes to /dev/full: every write
/// fails, whoever the mesh runs as.)
#[tokio::test]
async fn r29_a_chain_change_that_cannot_be_recorded_is_refused_and_not_applied() {
    if !Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full");
        return;
    }
    let dir = folder("change-unrecorded");
    let mesh = TestMesh::start().await;
    let guard = proceed_guard().await;
    mesh.register(Registration::validate("g", &guard.url)).await;
    let registrar = mesh.registrar().await;
    let before = registrar.list().await.unwrap();

    std::os::unix::fs::symlink("/dev/full", dir.join(segment::file_name(0))).unwrap();
    mesh.attach_log(LogConfig::new(&dir, "test"), OnLogFailure::Refuse)
        .await;

    let err = registrar
        .register(Registration::validate("h", &guard.url))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
    assert!(err.to_string().contains("decision log"), "{err}");
    let err = registrar.deregister("g").await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::Unavailable), "{err}");
    assert!(err.to_string().contains("not applied"), "{err}");

    let after = registrar.list().await.unwrap();
    assert_eq!(after.revision, before.revision, "the chain did not change");
    let names: Vec<_> = after.guards.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["g"]);
    assert!(
        metric(
            &mesh,
            "guardmesh_decision_log_failures_total{kind=\"chain_change\"}"
        ) >= 2.0,
        "{}",
        mesh.mesh.metrics.encode()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
