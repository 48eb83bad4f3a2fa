//! The decision log keeps its promise (R29): a log written by a real
//! `guardmesh serve` with a signing key and a witness, tampered with in
//! every way the table below names, then checked by the real `guardmesh
//! log verify` without a key, with the key, and with the key and the
//! witness. And a mesh restarted on a log cut short refuses to continue
//! its chain, or continues after a signed gap record when allowed.
//!
//! `true` in a table row means the verification passes (the tampering is
//! NOT detected in that mode); docs/decision-log.md shows the
//! same table.

use crate::harness::*;
use guardmesh_server::decision_log::{GENESIS, chain, segment};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// A mesh config with the decision log in `dir/log`, signed with
/// `dir/log.key`, its witness in `dir/witness`, checkpoints every 4 records
/// and small files (so that the log has several).
fn sealed_config(dir: &Path, extra: &str) -> String {
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, LOG_POLICY).unwrap();
    format!(
        "[decision_log]\ndir = {:?}\nmax_file_bytes = 5000\nsigning_key = {:?}\n\
         checkpoint_every = 4\nwitness = {:?}\n{extra}\n\n\
         [[guard]]\nname = \"policy\"\npolicy = {:?}\n",
        path(&dir.join("log")),
        path(&dir.join("log.key")),
        path(&dir.join("witness")),
        path(&policy),
    )
}

/// A fresh folder with a key pair (written by `guardmesh log keygen`) and
/// an empty witness directory.
fn keyed_folder(name: &str) -> PathBuf {
    let dir = folder(name);
    let out = log_keygen(&dir);
    assert!(text(&out.stdout).starts_with("-----BEGIN PUBLIC KEY-----"));
    std::fs::create_dir_all(dir.join("witness")).unwrap();
    dir
}

/// Starts `guardmesh serve` on `dir`'s config, runs `n` batches, stops it
/// with SIGTERM (a clean shutdown: the `close` checkpoint).
async fn serve_and_stop(name: &str, dir: &Path, extra: &str, n: usize) {
    let mut mesh = MeshProcess::start(name, &sealed_config(dir, extra), None).await;
    log_batches(&mesh.url, name, n, None).await;
    mesh.signal("TERM");
    let status = mesh.exit_status().await;
    assert!(status.success(), "{status}\n{}", mesh.log());
}

/// The log every tampering starts from, written once by a real mesh.
struct Pristine {
    dir: PathBuf,
}

fn pristine() -> &'static Pristine {
    static PRISTINE: OnceLock<Pristine> = OnceLock::new();
    PRISTINE.get_or_init(|| {
        std::thread::spawn(|| {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let dir = keyed_folder("tamper-pristine");
                serve_and_stop("tamper-pristine", &dir, "", 24).await;
                let files = segment::list(&dir.join("log")).unwrap();
                assert!(files.len() >= 4, "{files:?}");
                Pristine { dir }
            })
        })
        .join()
        .unwrap()
    })
}

/// The log as files of lines.
type Files = Vec<(PathBuf, Vec<String>)>;

fn read_log(dir: &Path) -> Files {
    segment::list(dir)
        .unwrap()
        .into_iter()
        .map(|(_, file)| {
            let text = std::fs::read_to_string(&file).unwrap();
            (file, text.lines().map(str::to_owned).collect())
        })
        .collect()
}

/// Writes `files` back as the log of `dir`: every old file removed, each
/// file named for the seq of its first line (as a forger would).
fn write_log(dir: &Path, files: &Files) {
    for (_, file) in segment::list(dir).unwrap() {
        std::fs::remove_file(file).unwrap();
    }
    for (file, lines) in files {
        let name = match lines.first() {
            Some(line) => segment::file_name(seq_of(line)),
            None => file.file_name().unwrap().to_str().unwrap().to_owned(),
        };
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(dir.join(name), text).unwrap();
    }
}

fn seq_of(line: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    v["seq"].as_u64().unwrap()
}

/// Recomputes a line's own hash, as a forger with the format at hand would.
fn reseal(line: &str) -> String {
    let body = &line[..line.rfind(",\"hash\":\"").unwrap()];
    format!(
        "{body},\"hash\":\"{}\"}}",
        chain::sha256_hex(body.as_bytes())
    )
}

/// Renumbers and rechains every line from the genesis record on.
fn rechain(files: &mut Files) {
    let mut prev = GENESIS.to_owned();
    let mut seq = 0u64;
    for (_, lines) in files.iter_mut() {
        for line in lines.iter_mut() {
            let moved = set_member(line, "seq", &seq.to_string());
            let moved = set_member(&moved, "prev", &format!("\"{prev}\""));
            *line = reseal(&moved);
            prev = chain::sha256_hex(line.as_bytes());
            seq += 1;
        }
    }
}

/// (file index, line index) of a cancelled decision in the second file.
fn a_cancel(files: &Files) -> (usize, usize) {
    let index = files[1]
        .1
        .iter()
        .position(|l| l.contains("\"action\":\"cancel\""))
        .expect("a cancel in the second file");
    (1, index)
}

fn to_proceed(line: &str) -> String {
    line.replace("\"action\":\"cancel\"", "\"action\":\"proceed\"")
}

#[derive(Debug, Clone, Copy)]
enum Tamper {
    None,
    Edit,
    ResealedEdit,
    RechainedEdit,
    DeletedMiddleRecord,
    RechainedDeletion,
    SwappedRecords,
    MidRecordCut,
    TailCut,
    DeletedFirstSegment,
    DeletedMiddleSegment,
    DeletedLastSegment,
    RewrittenChain,
    RewrittenWithoutCheckpoints,
    ForgedAppend,
}

fn tamper(dir: &Path, how: Tamper) {
    let mut files = read_log(dir);
    match how {
        Tamper::None => return,
        Tamper::Edit | Tamper::ResealedEdit | Tamper::RechainedEdit => {
            let (f, l) = a_cancel(&files);
            let edited = to_proceed(&files[f].1[l]);
            files[f].1[l] = match how {
                Tamper::Edit => edited,
                _ => reseal(&edited),
            };
            if matches!(how, Tamper::RechainedEdit) {
                rechain(&mut files);
            }
        }
        Tamper::DeletedMiddleRecord | Tamper::RechainedDeletion => {
            let (f, l) = a_cancel(&files);
            files[f].1.remove(l);
            if matches!(how, Tamper::RechainedDeletion) {
                rechain(&mut files);
            } else {
                // Only the one file changes.
                let (file, lines) = &files[f];
                let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
                std::fs::write(file, text).unwrap();
                return;
            }
        }
        Tamper::SwappedRecords => {
            let (f, l) = a_cancel(&files);
            files[f].1.swap(l, l + 1);
        }
        Tamper::MidRecordCut => {
            let (file, _) = files.last().unwrap();
            let len = std::fs::metadata(file).unwrap().len();
            let out = std::fs::OpenOptions::new().write(true).open(file).unwrap();
            out.set_len(len - 40).unwrap();
            return;
        }
        Tamper::TailCut => {
            // The last three lines (the closing checkpoint and what comes
            // before it, across files), files left empty removed.
            for _ in 0..3 {
                files.last_mut().unwrap().1.pop();
                if files.last().unwrap().1.is_empty() {
                    files.pop();
                }
            }
        }
        Tamper::DeletedFirstSegment => {
            std::fs::remove_file(&files[0].0).unwrap();
            return;
        }
        Tamper::DeletedMiddleSegment => {
            std::fs::remove_file(&files[files.len() / 2].0).unwrap();
            return;
        }
        Tamper::DeletedLastSegment => {
            std::fs::remove_file(&files.last().unwrap().0).unwrap();
            return;
        }
        Tamper::RewrittenChain => {
            for (_, lines) in files.iter_mut() {
                for line in lines.iter_mut() {
                    *line = to_proceed(line);
                }
            }
            rechain(&mut files);
        }
        Tamper::RewrittenWithoutCheckpoints => {
            for (_, lines) in files.iter_mut() {
                lines.retain(|l| !l.contains("\"kind\":\"checkpoint\""));
                for line in lines.iter_mut() {
                    *line = to_proceed(line);
                }
            }
            rechain(&mut files);
        }
        Tamper::ForgedAppend => {
            let last = files.last().unwrap().1.last().unwrap().clone();
            let decision = files
                .iter()
                .flat_map(|(_, lines)| lines.iter())
                .rfind(|l| l.contains("\"kind\":\"decision\""))
                .unwrap()
                .replace("\"action\":\"cancel\"", "\"action\":\"proceed\"");
            let forged = set_member(&decision, "seq", &(seq_of(&last) + 1).to_string());
            let forged = set_member(
                &forged,
                "prev",
                &format!("\"{}\"", chain::sha256_hex(last.as_bytes())),
            );
            files.last_mut().unwrap().1.push(reseal(&forged));
        }
    }
    write_log(dir, &files);
}

/// Copies the pristine log, tampers with it, and checks `guardmesh log
/// verify` without a key, with the key, and with the key and the witness:
/// `expected[i]` is whether that verification passes.
fn check(name: &str, how: Tamper, expected: [bool; 3]) {
    let pristine = pristine();
    let dir = folder(&format!("tamper-{name}"));
    let log = dir.join("log");
    std::fs::create_dir_all(&log).unwrap();
    for (_, file) in segment::list(&pristine.dir.join("log")).unwrap() {
        std::fs::copy(&file, log.join(file.file_name().unwrap())).unwrap();
    }
    tamper(&log, how);
    let public = pristine.dir.join("log.key.pub");
    let witness = pristine.dir.join("witness");
    let runs: [Vec<&str>; 3] = [
        vec!["log", "verify", path(&log)],
        vec!["log", "verify", path(&log), "--key", path(&public)],
        vec![
            "log",
            "verify",
            path(&log),
            "--key",
            path(&public),
            "--witness",
            path(&witness),
        ],
    ];
    let mut report = Vec::new();
    let mut wrong = false;
    for (args, expect) in runs.iter().zip(expected) {
        let out = guardmesh(args);
        let passed = out.status.success();
        // A refusal is exit 1 with a reason; never a crash or a usage error.
        if !passed {
            assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
            assert!(
                text(&out.stderr).contains("does not verify"),
                "{}",
                text(&out.stderr)
            );
        } else if args.len() == 3 {
            assert!(text(&out.stdout).contains("signatures: none checked"));
        }
        wrong |= passed != expect;
        report.push(format!(
            "{:?}: expected {}, got {}\n{}{}",
            &args[3..],
            if expect { "pass" } else { "refusal" },
            if passed { "pass" } else { "refusal" },
            text(&out.stdout),
            text(&out.stderr)
        ));
    }
    assert!(!wrong, "{how:?}:\n{}", report.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

//                                                           no key, key,  key+witness
#[test]
fn r29_an_untouched_signed_log_verifies_in_every_mode() {
    check("none", Tamper::None, [true, true, true]);
}

#[test]
fn r29_tamper_an_edited_record_is_detected() {
    check("edit", Tamper::Edit, [false, false, false]);
}

#[test]
fn r29_tamper_a_resealed_edit_is_detected() {
    check("resealed-edit", Tamper::ResealedEdit, [false, false, false]);
}

#[test]
fn r29_tamper_a_rechained_edit_is_detected_with_the_key() {
    check(
        "rechained-edit",
        Tamper::RechainedEdit,
        [true, false, false],
    );
}

#[test]
fn r29_tamper_a_deleted_middle_record_is_detected() {
    check(
        "deleted-record",
        Tamper::DeletedMiddleRecord,
        [false, false, false],
    );
}

#[test]
fn r29_tamper_a_rechained_deletion_is_detected_with_the_key() {
    check(
        "rechained-deletion",
        Tamper::RechainedDeletion,
        [true, false, false],
    );
}

#[test]
fn r29_tamper_swapped_records_are_detected() {
    check("swapped", Tamper::SwappedRecords, [false, false, false]);
}

#[test]
fn r29_tamper_a_record_cut_in_the_middle_is_detected() {
    check(
        "mid-record-cut",
        Tamper::MidRecordCut,
        [false, false, false],
    );
}

#[test]
fn r29_tamper_a_tail_cut_by_whole_records_is_detected_with_the_witness() {
    check("tail-cut", Tamper::TailCut, [true, true, false]);
}

#[test]
fn r29_tamper_a_deleted_first_segment_is_detected() {
    check(
        "deleted-first",
        Tamper::DeletedFirstSegment,
        [false, false, false],
    );
}

#[test]
fn r29_tamper_a_deleted_middle_segment_is_detected() {
    check(
        "deleted-middle",
        Tamper::DeletedMiddleSegment,
        [false, false, false],
    );
}

#[test]
fn r29_tamper_a_deleted_last_segment_is_detected_with_the_key() {
    check(
        "deleted-last",
        Tamper::DeletedLastSegment,
        [true, false, false],
    );
}

#[test]
fn r29_tamper_a_rewritten_chain_is_detected_with_the_key() {
    check("rewritten", Tamper::RewrittenChain, [true, false, false]);
}

#[test]
fn r29_tamper_a_chain_rewritten_without_its_checkpoints_is_detected_with_the_key() {
    check(
        "rewritten-bare",
        Tamper::RewrittenWithoutCheckpoints,
        [true, false, false],
    );
}

#[test]
fn r29_tamper_a_forged_append_is_detected_with_the_key() {
    check("forged-append", Tamper::ForgedAppend, [true, false, false]);
}

#[tokio::test]
async fn r29_a_mesh_restarted_on_a_cut_log_refuses_or_continues_after_a_signed_gap() {
    let dir = keyed_folder("tamper-restart");
    let log = dir.join("log");
    serve_and_stop("tamper-restart-1", &dir, "", 3).await;
    cut_last_lines(&log, 2);
    let before = read_log(&log);

    // Refused, naming what is missing and the way out.
    let stderr = serve_refused(&dir, &sealed_config(&dir, "")).await;
    assert!(
        stderr.contains("does not hold the latest checkpoint") && stderr.contains("allow_gap"),
        "{stderr}"
    );
    assert_eq!(read_log(&log), before, "a refused start wrote to the log");
    // The state file alone is enough: without the witness it is refused too.
    let moved = dir.join("witness-away");
    std::fs::rename(dir.join("witness"), &moved).unwrap();
    std::fs::create_dir(dir.join("witness")).unwrap();
    let stderr = serve_refused(&dir, &sealed_config(&dir, "")).await;
    assert!(stderr.contains("known from the state"), "{stderr}");
    std::fs::remove_dir_all(dir.join("witness")).unwrap();
    std::fs::rename(&moved, dir.join("witness")).unwrap();

    // Allowed: the mesh starts after a signed gap record naming the loss.
    serve_and_stop("tamper-restart-2", &dir, "allow_gap = true", 2).await;
    let gaps: Vec<_> = records(&log)
        .into_iter()
        .filter(|r| r["kind"] == "gap")
        .collect();
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    let public = dir.join("log.key.pub");
    let verify = |extra: &[&str]| {
        let mut args = vec!["log", "verify", path(&log), "--key", path(&public)];
        args.extend_from_slice(extra);
        guardmesh(&args)
    };
    let out = verify(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("gap"), "{}", text(&out.stderr));
    let out = verify(&["--allow-gap", "--witness", path(&dir.join("witness"))]);
    assert_succeeded(&out);
    assert!(
        text(&out.stdout).contains("gap: at seq"),
        "{}",
        text(&out.stdout)
    );
}

/// A logs collector for the OTLP anchor test: keeps every record's body.
#[derive(Default, Clone)]
struct Bodies {
    received: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::LogsService for Bodies {
    async fn export(
        &self,
        request: tonic::Request<
            opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest,
        >,
    ) -> Result<
        tonic::Response<opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceResponse>,
        tonic::Status,
    > {
        use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
        let mut received = self.received.lock().unwrap();
        for resource in request.into_inner().resource_logs {
            for scope in resource.scope_logs {
                for record in scope.log_records {
                    if let Some(Any::StringValue(body)) = record.body.and_then(|b| b.value) {
                        received.push((record.event_name, body));
                    }
                }
            }
        }
        Ok(tonic::Response::new(Default::default()))
    }
}

/// The checkpoints exported over OTLP are an outside anchor: the latest
/// one received, saved to a file, makes `verify --checkpoint` detect a tail
/// cut that the key alone does not.
#[tokio::test]
async fn r29_checkpoints_exported_over_otlp_anchor_the_tail() {
    use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::LogsServiceServer;
    let bodies = Bodies::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn({
        let bodies = bodies.clone();
        async move {
            tonic::transport::Server::builder()
                .add_service(LogsServiceServer::new(bodies))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        }
    });

    let dir = keyed_folder("tamper-otlp");
    let log = dir.join("log");
    let config = dir.join("mesh.toml");
    std::fs::write(&config, sealed_config(&dir, "otlp = true")).unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let mut child = serve_command(&config, port)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_BLRP_SCHEDULE_DELAY", "100")
        .env_remove("OTEL_TRACES_EXPORTER")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = tokio::time::timeout(Duration::from_secs(20), async {
        while guardmesh_client::Coordinator::connect(url.clone())
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    if started.is_err() {
        let _ = child.kill();
        panic!("the mesh did not start");
    }
    log_batches(&url, "otlp", 6, None).await;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let mut stopped = false;
    for _ in 0..1000 {
        if child.try_wait().unwrap().is_some() {
            stopped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !stopped {
        let _ = child.kill();
        panic!("the mesh did not stop");
    }

    let received = bodies.received.lock().unwrap().clone();
    let checkpoints: Vec<&(String, String)> = received
        .iter()
        .filter(|(event, _)| event == "guardmesh.decision_log.checkpoint")
        .collect();
    assert!(checkpoints.len() >= 3, "{received:?}");
    let (_, latest) = checkpoints.last().unwrap();
    assert!(latest.contains("\"reason\":\"close\""), "{latest}");
    let anchor = dir.join("latest-checkpoint.jsonl");
    std::fs::write(&anchor, format!("{latest}\n")).unwrap();
    let public = dir.join("log.key.pub");
    let verify = || {
        guardmesh(&[
            "log",
            "verify",
            path(&log),
            "--key",
            path(&public),
            "--checkpoint",
            path(&anchor),
        ])
    };
    let out = verify();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Cut the closing checkpoint and the record before it.
    cut_last_lines(&log, 2);
    let keyed = guardmesh(&["log", "verify", path(&log), "--key", path(&public)]);
    assert!(keyed.status.success(), "{}", text(&keyed.stderr));
    let out = verify();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("records were cut"),
        "{}",
        text(&out.stderr)
    );
}
