//! `guardmesh demo`: a mesh, example guards and a coordinator on loopback.
//!
//! Everything runs in this process on `127.0.0.1:0`: the mesh, five example
//! guards served by the Rust SDK, a guard that is down, and a coordinator
//! that drives an agent session through a few rounds and prints each
//! round's decisions and per-guard traces.

use crate::examples::{Example, Kind};
use guardmesh_client::proto::{FailurePolicy, TraceStatus};
use guardmesh_client::{
    Batch, BatchDecision, Coordinator, Outcome, Registrar, Registration, ResultOutcome,
};
use guardmesh_server::MemoryRegistry;
use guardmesh_server::MeshConfig;
use std::fmt::Write;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn start_guard(kind: Kind, delay: Duration) -> Result<String, Error> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(guardmesh_client::serve(
        Example::delayed(kind, delay),
        listener,
        std::future::pending(),
    ));
    Ok(url)
}

/// Certificates for the demo's mTLS mode, made in a temporary folder.
struct DemoPki {
    dir: std::path::PathBuf,
    ca_pem: String,
    coordinator: crate::certs::Issued,
    admin: crate::certs::Issued,
}

impl Drop for DemoPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn demo_pki() -> Result<(DemoPki, guardmesh_server::security::tls::ServerTls), Error> {
    use crate::certs::{Authority, Subject};
    let dir = std::env::temp_dir().join(format!("guardmesh-demo-{}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir)?;
    let ca = Authority::new("guardmesh demo CA")?;
    let (cert, key) = ca.issue(&Subject::loopback("mesh"))?.write(&dir, "mesh")?;
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.cert_pem())?;
    let tls = guardmesh_server::security::tls::ServerTls::new(&cert, &key, Some(&ca_file))?;
    let pki = DemoPki {
        ca_pem: ca.cert_pem(),
        coordinator: ca.issue(&Subject::loopback("coordinator"))?,
        admin: ca.issue(&Subject::loopback("admin"))?,
        dir,
    };
    Ok((pki, tls))
}

fn demo_policy() -> guardmesh_server::security::auth::AuthPolicy {
    use guardmesh_server::security::auth::{AuthPolicy, Caller, Principal, Role};
    let principal = |id: &str, role: Role| {
        let id = format!("spiffe://{}/{id}", crate::certs::TRUST_DOMAIN);
        Principal {
            id: id.clone(),
            token: None,
            caller: Caller {
                id,
                roles: [role].into(),
                name_prefixes: Vec::new(),
                max_registrations: 64,
            },
        }
    };
    AuthPolicy {
        principals: vec![
            principal("coordinator", Role::Evaluate),
            principal("admin", Role::Admin),
        ],
        plaintext_tokens_on_loopback: false,
        tokens_without_client_cert: false,
    }
}

/// Runs the demo, printing to stdout. With `mtls`, the mesh requires client
/// certificates from a CA made for the run and checks roles.
pub async fn run(mtls: bool) -> Result<(), Error> {
    let mut config = MeshConfig::default();
    let pki = if mtls {
        let (pki, tls) = demo_pki()?;
        config.security.server_tls = Some(tls);
        config.security.auth = Some(Arc::new(demo_policy()));
        Some(pki)
    } else {
        None
    };
    let connection = |identity: Option<&crate::certs::Issued>| guardmesh_client::Connection {
        tls: pki.as_ref().map(|p| guardmesh_client::Tls {
            ca_pem: p.ca_pem.clone(),
            identity: identity.map(|i| (i.cert_pem.clone(), i.key_pem.clone())),
            domain: None,
        }),
        token: None,
    };
    let registry = Arc::new(MemoryRegistry::new(config.default_guard_timeout));
    let server = guardmesh_server::Server::new(config, registry);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let mesh_url = match &pki {
        Some(_) => format!("https://localhost:{}", listener.local_addr()?.port()),
        None => format!("http://{}", listener.local_addr()?),
    };
    tokio::spawn(server.run(listener, std::future::pending()));

    let registrar = Registrar::connect_with(
        mesh_url.clone(),
        &connection(pki.as_ref().map(|p| &p.admin)),
    )
    .await?;
    let down = {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        format!("http://{}", l.local_addr()?)
    };
    let chain = [
        Registration::mutate(
            "redact-secrets",
            start_guard(Kind::RedactSecrets, Duration::ZERO).await?,
            ["http.*", "email.*"],
        ),
        Registration::mutate(
            "sql-limit",
            start_guard(Kind::SqlLimit, Duration::ZERO).await?,
            ["sql.query"],
        )
        .tools(["sql.*"]),
        Registration::validate(
            "sql-where",
            start_guard(Kind::SqlWhere, Duration::ZERO).await?,
        )
        .tools(["sql.*"]),
        Registration::validate(
            "deny-list",
            start_guard(Kind::DenyList, Duration::ZERO).await?,
        ),
        Registration::validate(
            "shell-policy-v2",
            start_guard(Kind::ShellPolicy, Duration::ZERO).await?,
        )
        .tools(["shell.*"])
        .dry_run(),
        Registration::validate(
            "audit-log",
            start_guard(Kind::Allow, Duration::from_millis(400)).await?,
        )
        .timeout(Duration::from_millis(100))
        .failure_policy(FailurePolicy::FailOpen),
        Registration::validate("fraud-check", down.clone())
            .tools(["payments.*"])
            .timeout(Duration::from_millis(300)),
    ];
    for registration in chain {
        registrar.register(registration).await?;
    }
    drop(down);

    outln!("guardmesh demo: mesh on {mesh_url}\n");
    if pki.is_some() {
        outln!("mTLS on: the registrar is spiffe://guardmesh.local/admin, the coordinator");
        outln!("spiffe://guardmesh.local/coordinator (certificates from a CA made for this run).");
        let anonymous = Coordinator::connect_with(mesh_url.clone(), &connection(None)).await?;
        let refused = anonymous
            .evaluate_once("intruder", Batch::new(0).call("x", "fs.read", "{}"))
            .await;
        if let Err(error) = refused {
            outln!("A client without a certificate is refused: {error}\n");
        }
    }
    outln!("The chain (guardmesh guards list):");
    for (i, g) in registrar.list().await?.guards.iter().enumerate() {
        let role = g.role().name();
        let tools = if g.tools.is_empty() {
            "*".to_owned()
        } else {
            g.tools.join(",")
        };
        let note = match g.name.as_str() {
            "shell-policy-v2" => "  (dry run: traced, never applied)",
            "audit-log" => "  (slow: 400 ms against a 100 ms timeout, fail_open)",
            "fraud-check" => "  (down: nothing listens, fail_closed)",
            _ => "",
        };
        outln!("  {i}. {:<16} {role:<8} tools {tools}{note}", g.name);
    }
    outln!();

    let coordinator =
        Coordinator::connect_with(mesh_url, &connection(pki.as_ref().map(|p| &p.coordinator)))
            .await?;
    let session = coordinator.session("demo-session").await?;
    let rounds = [
        (
            "The model answers in text only: zero calls, no guard contacted (R1).",
            Batch::new(0).model_text("Hello! How can I help?"),
        ),
        (
            "Five calls in one round: each gets its own decision (R6).",
            Batch::new(1)
                .model_text("Cleaning up as asked.")
                .call("c1", "sql.query", r#"{"sql":"DELETE FROM sessions"}"#)
                .call("c2", "fs.read", r#"{"path":"notes.txt"}"#)
                .call("c3", "fs.delete", r#"{"path":"/var/lib/db"}"#)
                .call(
                    "c4",
                    "http.post",
                    r#"{"url":"https://api.example.com/v1","api_key":"sk-live-123","body":{"q":1}}"#,
                )
                .call("c5", "shell.exec", r#"{"cmd":"sudo rm -rf /tmp/cache"}"#),
        ),
        (
            "The model fixes the steered call; a SELECT is pinned to LIMIT 100.",
            Batch::new(2)
                .call("c6", "sql.query", r#"{"sql":"DELETE FROM sessions WHERE expired = true"}"#)
                .call("c7", "sql.query", r#"{"sql":"SELECT * FROM orders"}"#),
        ),
        (
            "A payment meets a guard that is down: fail_closed blocks it (R13).",
            Batch::new(3).call("c8", "payments.refund", r#"{"order":"A-17","amount":20}"#),
        ),
    ];
    for (i, (story, batch)) in rounds.into_iter().enumerate() {
        outln!("── Round {i}: {story}");
        // The agent's span for this round, as a framework would propagate it
        // (R22); with OTEL_EXPORTER_OTLP_ENDPOINT set, the mesh's spans join it.
        let traceparent = format!(
            "00-{:032x}-{:016x}-01",
            rand::random::<u128>() | 1,
            rand::random::<u64>() | 1
        );
        let decision = session.evaluate(batch.traceparent(traceparent)).await?;
        out!("{}", render(&decision));
        outln!();
    }
    outln!("Run `guardmesh serve --config FILE` for a real mesh; see docs/quick_start.md.");
    Ok(())
}

fn outcome_label(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Proceed => "PROCEED",
        Outcome::Steer { .. } => "STEER",
        Outcome::Cancel { .. } => "CANCEL",
        Outcome::Ask { .. } => "ASK",
    }
}

fn status_label(status: i32) -> String {
    TraceStatus::try_from(status)
        .map(|s| s.name().to_owned())
        .unwrap_or_else(|_| format!("unknown({status})"))
}

fn clip(text: &str, n: usize) -> String {
    if text.chars().count() <= n {
        text.to_owned()
    } else {
        let cut: String = text.chars().take(n.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

/// Renders a decision as readable tables: one row per call, then one row per
/// guard of the chain.
pub fn render(decision: &BatchDecision) -> String {
    let mut out = String::new();
    let trace_id = if decision.trace_id.is_empty() {
        "-"
    } else {
        &decision.trace_id
    };
    let _ = writeln!(
        out,
        "   batch {}  chain revision {}  trace id {}",
        decision.batch_id, decision.chain_revision, trace_id
    );
    if decision.calls.is_empty() && decision.results.is_empty() {
        let _ = writeln!(out, "   no calls: nothing to judge, no guard contacted");
        return out;
    }
    if !decision.results.is_empty() {
        let _ = writeln!(
            out,
            "   {:<6} {:<17} {:<8} {:<16} detail",
            "result", "tool", "outcome", "by"
        );
        for result in &decision.results {
            let by = result.decided_by.clone().unwrap_or_else(|| "-".into());
            let (label, detail) = match &result.outcome {
                ResultOutcome::Pass => ("pass", "the model reads it as returned".to_owned()),
                ResultOutcome::Rewrite => (
                    "rewrite",
                    format!(
                        "the model reads it as rewritten by {}",
                        result.rewritten_by.join(", ")
                    ),
                ),
                ResultOutcome::Block { content } => {
                    let failure = if result.failure {
                        "[guard failure] "
                    } else {
                        ""
                    };
                    (
                        "block",
                        format!("{failure}model reads: {}", clip(content, 70)),
                    )
                }
            };
            let _ = writeln!(
                out,
                "   {:<6} {:<17} {:<8} {:<16} {detail}",
                result.call_id, result.original.tool, label, by
            );
        }
    }
    if !decision.calls.is_empty() {
        let _ = writeln!(
            out,
            "   {:<5} {:<17} {:<8} {:<16} detail",
            "call", "tool", "decision", "by"
        );
    }
    for call in &decision.calls {
        let by = call.decided_by.clone().unwrap_or_else(|| "-".into());
        let detail = match &call.outcome {
            Outcome::Proceed => {
                let mut d = String::from("runs");
                if !call.rewritten_by.is_empty() {
                    let _ = write!(
                        d,
                        " as rewritten by {} (changed: {})",
                        call.rewritten_by.join(", "),
                        call.changed_argument_keys().join(", ")
                    );
                }
                if !call.bypassed.is_empty() {
                    let _ = write!(d, "; bypassed failed guard {}", call.bypassed.join(", "));
                }
                d
            }
            Outcome::Steer { content } | Outcome::Cancel { content } => {
                let failure = if call.failure { "[guard failure] " } else { "" };
                format!("{failure}model reads: {}", clip(content, 70))
            }
            Outcome::Ask { approval, .. } => {
                format!(
                    "waits for approval {}: {}",
                    approval.id,
                    clip(&approval.reason, 50)
                )
            }
        };
        let _ = writeln!(
            out,
            "   {:<5} {:<17} {:<8} {:<16} {detail}",
            call.call_id,
            call.final_call.tool,
            outcome_label(&call.outcome),
            by
        );
        if call.rewritten() {
            let _ = writeln!(
                out,
                "         original: {}",
                clip(&call.original.arguments, 90)
            );
            let _ = writeln!(
                out,
                "         final:    {}",
                clip(&call.final_call.arguments, 90)
            );
        }
    }
    let _ = writeln!(out, "   trace:");
    for entry in &decision.trace {
        let mut status = status_label(entry.status);
        if entry.dry_run_status != 0 {
            status = format!("{status} (would: {})", status_label(entry.dry_run_status));
        }
        let latency = if entry.latency_us == 0 {
            "-".to_owned()
        } else {
            format!("{:.1}ms", entry.latency_us as f64 / 1000.0)
        };
        let mut detail = Vec::new();
        if !entry.sent_call_ids.is_empty() {
            detail.push(format!("sent {}", entry.sent_call_ids.join(",")));
        }
        if !entry.skipped_call_ids.is_empty() {
            detail.push(format!("skipped {}", entry.skipped_call_ids.join(",")));
        }
        if !entry.rewritten_call_ids.is_empty() {
            detail.push(format!("rewrote {}", entry.rewritten_call_ids.join(",")));
        }
        if !entry.error.is_empty() {
            detail.push(format!("error: {}", clip(&entry.error, 60)));
        }
        let _ = writeln!(
            out,
            "     {:<16} {:<34} {:>8}  {}",
            entry.guard,
            status,
            latency,
            detail.join("; ")
        );
    }
    out
}
