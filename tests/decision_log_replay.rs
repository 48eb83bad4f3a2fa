//! Replay against a running mesh (R30 with R18 and R24): `guardmesh replay
//! LOG --mesh URL` judges recorded batches with the mesh's current chain,
//! where a candidate guard registered in `dry_run` previews what it would
//! have blocked; the replay sends the credentials the mesh asks for.

use crate::harness::*;
use guardmesh_client::Registration;
use guardmesh_server::decision_log::{LogConfig, OnLogFailure};
use serde_json::Value;

#[tokio::test]
async fn r30_replay_against_a_running_mesh_lists_what_a_dry_run_candidate_would_block() {
    let dir = folder("replay-mesh");
    let log = dir.join("log");
    let pki = TestPki::new();
    let (mesh, url) = TestMesh::with_tokens(&pki, &[OPS, AGENT], "").await;
    let config = LogConfig {
        mask: guardmesh_server::decision_log::MaskRules::new(["password"]).unwrap(),
        ..LogConfig::new(&log, "test")
    };
    mesh.attach_log(config, OnLogFailure::Refuse).await;
    let ops = pki.registrar(&url, "ops-token").await;
    ops.register(Registration::policy("policy", LOG_POLICY))
        .await
        .unwrap();

    // The recorded run: two /etc reads proceed, a danger call is cancelled.
    let agent = pki.coordinator(&url, "agent-token").await;
    let session = agent.session("s").await.unwrap();
    let first = session
        .evaluate_raw(evaluate_request(
            "b1",
            &[
                ("c1", "read", r#"{"path": "/etc/passwd", "password": "p"}"#),
                ("c2", "danger", "{}"),
                ("c3", "read", r#"{"path": "/data/x"}"#),
            ],
        ))
        .await
        .unwrap();
    assert!(first.call("c1").unwrap().proceeds());
    assert!(!first.call("c2").unwrap().proceeds());
    session
        .evaluate_raw(evaluate_request(
            "b2",
            &[
                ("c4", "read", r#"{"path": "/etc/hosts"}"#),
                ("c5", "write", r#"{"path": "/etc/x"}"#),
            ],
        ))
        .await
        .unwrap();

    // The candidate, in dry run: it changes no decision of the mesh.
    ops.register(Registration::policy("veto", LOG_VETO).dry_run())
        .await
        .unwrap();

    // Replaying against a running mesh is an operator's task: the batch
    // ids it uses are reserved (R20) to callers with the admin role.
    let token = pki.file("ops-cli.token", "ops-token\n");
    let agent_token = pki.file("agent-cli.token", "agent-token\n");
    let args = |with_token: bool| {
        let mut args = vec![
            "replay".to_owned(),
            log.display().to_string(),
            "--mesh".to_owned(),
            url.clone(),
            "--ca-file".to_owned(),
            pki.ca_file().display().to_string(),
            "--json".to_owned(),
        ];
        if with_token {
            args.extend(["--token-file".to_owned(), token.display().to_string()]);
        }
        args
    };

    // R24: without credentials the mesh refuses the replay, and it says so.
    let out = guardmesh_off_thread(args(false)).await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("token"), "{stderr}");

    let out = guardmesh_off_thread(args(true)).await;
    assert_exit_code(&out, 1);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["batches"], 2, "{report}");
    assert_eq!(report["calls"], 5, "{report}");
    assert_eq!(report["masked_records"], 1, "{report}");
    let differences = report["differences"].as_array().unwrap();
    let blocked: Vec<_> = differences
        .iter()
        .map(|d| d["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(blocked, ["c1", "c4"], "exactly the /etc reads: {report}");
    for d in differences {
        assert_eq!(d["tool"], "read");
        assert_eq!(d["recorded"]["action"], "proceed");
        assert_eq!(d["recorded"]["dry_run"], false);
        assert_eq!(d["new"]["action"], "skip", "{d}");
        assert_eq!(d["new"]["guard"], "veto");
        assert_eq!(d["new"]["dry_run"], true);
    }

    // The replayed batches were answered and recorded by the mesh (R29),
    // under the replay's identity; a second replay of the same (grown) log
    // skips them and gives the same report.
    let replayed: Vec<_> = records(&log)
        .into_iter()
        .filter(|r| {
            r["kind"] == "decision"
                && r["batch"]["batch_id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("replay:"))
        })
        .collect();
    assert_eq!(replayed.len(), 2, "{replayed:?}");
    assert!(replayed.iter().all(|r| r["caller"]["id"] == "ops"));
    let again = guardmesh_off_thread(args(true)).await;
    assert_eq!(again.status.code(), Some(1));
    assert_eq!(text(&again.stdout), text(&out.stdout), "same report twice");
    assert!(text(&again.stderr).contains("2 records of earlier replays"));

    // The table names the would-have decision as a dry run.
    let mut table_args = args(true);
    table_args.retain(|a| a != "--json");
    let out = guardmesh_off_thread(table_args).await;
    assert_eq!(out.status.code(), Some(1));
    let table = text(&out.stdout);
    assert!(
        table.contains("skip by veto (dry run: would have)"),
        "{table}"
    );

    // A coordinator without the admin role cannot pass its batches off as
    // replays: each replayed batch is refused (R20).
    let mut agent_args = args(false);
    agent_args.extend(["--token-file".to_owned(), agent_token.display().to_string()]);
    let out = guardmesh_off_thread(agent_args).await;
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let differences = report["differences"].as_array().unwrap();
    assert!(!differences.is_empty(), "{report}");
    assert!(
        differences.iter().all(|d| d["new"]["action"]
            .as_str()
            .is_some_and(|a| a.starts_with("error:") && a.contains("reserves"))),
        "{report}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
