//! `guardmesh config check` and `guardmesh config reference` as operators
//! and scripts run them, and relative paths in a config file resolved
//! against its folder whatever the working directory (R27 for the policy
//! files a config names).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn guardmesh(args: &[&str], dir: Option<&Path>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_guardmesh"));
    command.args(args);
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    command.output().expect("run guardmesh")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A fresh folder of its own for one test.
fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "guardmesh-config-check-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn check(config: &Path) -> (Option<i32>, String) {
    let output = guardmesh(&["config", "check", config.to_str().unwrap()], None);
    (output.status.code(), stdout(&output))
}

/// `config check`'s output `out` for the file `shown` holds an error at
/// `line` on `key` whose message says `says`, followed by its fix line
/// holding `fix`.
#[track_caller]
fn assert_finding(out: &str, shown: &str, line: usize, key: &str, says: &str, fix: &str) {
    let head = format!("{shown}:{line}: error: {key}: ");
    let at = out
        .find(&head)
        .unwrap_or_else(|| panic!("no `{head}` in:\n{out}"));
    let mut lines = out[at..].lines();
    let first = lines.next().unwrap_or_default();
    assert!(first.contains(says), "{key}: {first:?} in:\n{out}");
    let next = lines.next().unwrap_or_default();
    assert!(
        next.starts_with("    fix: ") && next.contains(fix),
        "{key}: fix line {next:?} in:\n{out}"
    );
}

/// Writes `mesh.toml` in `dir`: a key that is not one (`lisen`, line 1)
/// and a value not allowed (`unguarded = "maybe"`, line 2), then `rest`.
fn write_broken(dir: &Path, rest: &str) -> PathBuf {
    let head = "lisen = \"127.0.0.1:0\"\nunguarded = \"maybe\"\n";
    write(dir, "mesh.toml", &format!("{head}{rest}"))
}

/// `config check` of `config` finds it invalid, with `errors` errors among
/// which `findings`, each a line, key, what it says and its fix as
/// [`assert_finding`] reads them; returns what it printed.
#[track_caller]
fn assert_findings(config: &Path, errors: usize, findings: &[(usize, &str, &str, &str)]) -> String {
    let (code, out) = check(config);
    assert_eq!(code, Some(1), "{out}");
    let shown = config.display().to_string();
    for &(line, key, says, fix) in findings {
        assert_finding(&out, &shown, line, key, says, fix);
    }
    assert!(out.contains(&format!("invalid ({errors} errors")), "{out}");
    out
}

/// Every error of the file at once, each on its line with its key and what
/// to write instead.
#[test]
fn config_check_names_line_key_and_fix_of_every_error() {
    let dir = folder("broken");
    let config = write_broken(
        &dir,
        "[limits]\n\
         max_calls_per_batch = \"many\"\n\
         [[guard]]\n\
         name = \"g\"\n\
         endpoint = \"http://127.0.0.1:1\"\n\
         tols = [\"sql.*\"]\n",
    );
    let findings = [
        (
            1,
            "lisen",
            "unknown key (did you mean `listen`?)",
            "fix: write `listen`",
        ),
        (
            2,
            "unguarded",
            "\"maybe\" is not one of \"proceed\", \"cancel\"",
            "fix: write unguarded = \"proceed\" or \"cancel\"",
        ),
        (
            4,
            "limits.max_calls_per_batch",
            "is a string, and must be an integer",
            "e.g. max_calls_per_batch = 256",
        ),
        (
            8,
            "guard[1].tols",
            "unknown key (did you mean `tools`?)",
            "fix: write `tools`",
        ),
    ];
    assert_findings(&config, 4, &findings);
    // Settings that parse but cannot work are all reported too.
    let config = write(
        &dir,
        "zeros.toml",
        "[limits]\nmax_json_depth = 0\nmax_batch_bytes = 0\n\
         [guard_links]\ndead_peer_timeout_ms = 500\n",
    );
    let (code, out) = check(&config);
    assert_eq!(code, Some(1), "{out}");
    for needle in [
        ":2: error: limits.max_json_depth:",
        ":3: error: limits.max_batch_bytes: limits.max_batch_bytes must be greater than 0",
        "e.g. the default: max_batch_bytes = 4194304",
        ":5: error: guard_links.dead_peer_timeout_ms:",
        "invalid (3 errors",
    ] {
        assert!(out.contains(needle), "no {needle:?} in:\n{out}");
    }
}

/// 0 valid, 1 invalid, 2 when the check cannot run.
#[test]
fn config_check_exit_codes_for_scripts() {
    let dir = folder("codes");
    let valid = write(&dir, "valid.toml", "listen = \"127.0.0.1:0\"\n");
    let (code, out) = check(&valid);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("valid (2 warnings)"), "{out}");
    assert!(out.contains("warning: no [tls]"), "{out}");
    let invalid = write(&dir, "invalid.toml", "listen = 1\n");
    assert_eq!(check(&invalid).0, Some(1));
    let syntax = write(&dir, "syntax.toml", "listen = \n[limits\n");
    let (code, out) = check(&syntax);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("not valid TOML"), "{out}");
    let output = guardmesh(
        &[
            "config",
            "check",
            dir.join("missing.toml").to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("cannot read config file"),
        "{output:?}"
    );
    // A folder is not a config file either.
    assert_eq!(check(&dir).0, Some(2));
    let help = stdout(&guardmesh(&["config", "check", "--help"], None));
    assert!(help.contains("Exit codes: 0"), "{help}");
}

/// `config check` refuses the `[registry]` settings of an etcd mesh that
/// `serve` refuses before it connects (R17), each naming its key, and
/// `https://` endpoints in a build without etcd TLS: a config it calls
/// valid must not keep every replica from starting.
#[test]
fn r17_config_check_refuses_the_etcd_settings_serve_refuses() {
    let dir = folder("etcd-settings");
    std::fs::write(dir.join("session.secret"), (0u8..32).collect::<Vec<_>>()).unwrap();
    let config = |registry: &str| {
        format!(
            "listen = \"127.0.0.1:0\"\n\n[registry]\nkind = \"etcd\"\n{registry}\n\n\
             [sessions]\nsecret_file = \"session.secret\"\n"
        )
    };
    let valid = write(&dir, "valid.toml", &config("prefix = \"/mesh\""));
    let (code, out) = check(&valid);
    assert_eq!(code, Some(0), "{out}");
    for (name, registry, says) in [
        (
            "empty-endpoints",
            "endpoints = []",
            "endpoints must not be empty",
        ),
        (
            "user-without-password",
            "username = \"mesh\"",
            "username and password (or password_env) go together",
        ),
        ("root-prefix", "prefix = \"/\"", "prefix \"/\" is empty"),
        (
            "lease-shorter-than-heartbeat",
            "lease_ttl_s = 1\nheartbeat_interval_ms = 2000",
            "lease_ttl_s",
        ),
    ] {
        let file = write(&dir, &format!("{name}.toml"), &config(registry));
        let (code, out) = check(&file);
        assert_eq!(code, Some(1), "{name}: {out}");
        assert!(
            out.contains("error: registry:") && out.contains(says),
            "{name}: {out}"
        );
    }
    let https = write(
        &dir,
        "https.toml",
        &config("endpoints = [\"https://127.0.0.1:2379\"]"),
    );
    let (code, out) = check(&https);
    if cfg!(feature = "etcd-tls") {
        assert_eq!(code, Some(0), "{out}");
    } else {
        assert_eq!(code, Some(1), "{out}");
        assert!(out.contains("--features etcd-tls"), "{out}");
    }
}

/// The files a config names are read as at start: a missing certificate
/// and a policy file that does not compile are both reported, with the
/// policy's own line (R27).
#[test]
fn r27_config_check_reports_a_missing_certificate_and_a_broken_policy_file() {
    let dir = folder("files");
    write(
        &dir,
        "rules.toml",
        "[[rule]]\nname = \"x\"\nwhen = \"(\"\naction = \"cancel\"\nmessage = '\"m\"'\n",
    );
    let config = write(
        &dir,
        "mesh.toml",
        "[tls]\ncert_file = \"certs/missing.pem\"\nkey_file = \"certs/missing-key.pem\"\n\
         [[guard]]\nname = \"p\"\npolicy = \"rules.toml\"\n",
    );
    let (code, out) = check(&config);
    assert_eq!(code, Some(1), "{out}");
    let certs = dir.join("certs/missing.pem").display().to_string();
    assert!(
        out.contains(&format!(":2: error: tls.cert_file: cannot read {certs}")),
        "{out}"
    );
    assert!(out.contains(":3: error: tls.key_file:"), "{out}");
    assert!(
        out.contains(":6: error: guard[1].policy: policy file"),
        "{out}"
    );
    assert!(out.contains("line 3"), "the policy's own line: {out}");
    // A certificate file that is not PEM.
    write(&dir, "bad.pem", "not a certificate\n");
    std::fs::write(
        &config,
        "[tls]\ncert_file = \"bad.pem\"\nkey_file = \"bad.pem\"\n",
    )
    .unwrap();
    let (code, out) = check(&config);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("tls.cert_file:") && out.contains("no certificate found"),
        "{out}"
    );
}

/// Every key the loader reads is printed, with its type and default.
#[test]
fn config_reference_lists_every_key() {
    let output = guardmesh(&["config", "reference"], None);
    assert!(output.status.success());
    let text = stdout(&output);
    for key in guardmesh_server::config::keys::KEYS {
        assert!(text.contains(key.path), "{} missing:\n{text}", key.path);
        assert!(text.contains(key.meaning), "{}", key.path);
    }
    assert!(text.contains("limits.max_calls_per_batch\n    type: integer; default: 256"));
    assert!(text.contains("tls.cert_file\n    type: path; default: required"));
}

/// docs/configuration.md is the reference's Markdown as the command prints
/// it: regenerate it with `guardmesh config reference --markdown >
/// docs/configuration.md`.
#[test]
fn config_reference_docs_match_the_command() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
    let checked_in = std::fs::read_to_string(&docs).expect("docs/configuration.md");
    let output = guardmesh(&["config", "reference", "--markdown"], None);
    assert!(output.status.success());
    assert!(
        stdout(&output) == checked_in,
        "docs/configuration.md differs from `guardmesh config reference --markdown`; regenerate it"
    );
}

/// A config in its own folder, the mesh started from another working
/// directory: the certificate, key, policy file and log directory are all
/// found next to the config.
#[test]
fn config_relative_paths_resolve_against_the_config_folder() {
    let dir = folder("relative");
    let elsewhere = folder("elsewhere");
    let certs = guardmesh(&["certs", dir.join("certs").to_str().unwrap()], None);
    assert!(certs.status.success(), "{certs:?}");
    write(
        &dir,
        "rules.toml",
        "[[rule]]\nname = \"no-shell\"\ntools = [\"shell.*\"]\nwhen = \"true\"\n\
         action = \"cancel\"\nmessage = '\"no\"'\n",
    );
    write(
        &dir,
        "mesh.toml",
        "listen = \"127.0.0.1:0\"\n\
         [tls]\ncert_file = \"certs/mesh.pem\"\nkey_file = \"certs/mesh-key.pem\"\n\
         [decision_log]\ndir = \"decisions\"\n\
         [[guard]]\nname = \"p\"\npolicy = \"rules.toml\"\ntools = [\"shell.*\"]\n",
    );
    let relative = format!(
        "../{}/mesh.toml",
        dir.file_name().unwrap().to_str().unwrap()
    );
    let output = guardmesh(&["config", "check", &relative], Some(&elsewhere));
    assert_eq!(output.status.code(), Some(0), "{}", stdout(&output));

    let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(["serve", "--config", &relative])
        .current_dir(&elsewhere)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start serve");
    let stderr = child.stderr.take().unwrap();
    let _serve = crate::harness::KillOnDrop(child);
    let (lines, seen) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = String::new();
    let started = loop {
        match seen.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => {
                log.push_str(&line);
                log.push('\n');
                if line.contains("guardmesh serving") {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    assert!(started, "serve did not start:\n{log}");
    assert!(dir.join("decisions").is_dir(), "{log}");
    assert!(!elsewhere.join("decisions").exists());
}

/// Runs `guardmesh` with `args`, killed if it has not ended within `bound`
/// (a FIFO read would hold it forever): its exit code, stdout and stderr,
/// or `None` when it had to be killed.
fn bounded(args: &[&str], bound: Duration) -> Option<(Option<i32>, String, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run guardmesh");
    let start = std::time::Instant::now();
    while start.elapsed() < bound {
        if child.try_wait().expect("wait").is_some() {
            let output = child.wait_with_output().expect("output");
            return Some((
                output.status.code(),
                stdout(&output),
                String::from_utf8_lossy(&output.stderr).into_owned(),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Files a config names that are not what they claim (R25: nothing read
/// without a bound): a FIFO in place of a certificate, token or policy file
/// never holds `config check` or `serve` (no writer ever comes), and a
/// sparse gigabyte named as a certificate, or as the config itself, is
/// refused by its size instead of being read. Each error names the file and
/// what it is.
#[test]
fn r25_a_fifo_or_a_sparse_gigabyte_named_by_a_config_is_refused_not_read() {
    let dir = folder("fifo");
    let fifo = dir.join("cert.pem");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo")
            .success()
    );
    std::fs::File::create(dir.join("big.pem"))
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    write(&dir, "key.pem", "not a key\n");
    let bound = Duration::from_secs(20);
    for cert in ["cert.pem", "big.pem"] {
        let config = write(
            &dir,
            "mesh.toml",
            &format!(
                "listen = \"127.0.0.1:0\"\n[tls]\ncert_file = \"{cert}\"\nkey_file = \"key.pem\"\n"
            ),
        );
        let path = config.to_str().unwrap();
        let (code, out, _) = bounded(&["config", "check", path], bound)
            .unwrap_or_else(|| panic!("config check held by {cert} for {bound:?}"));
        assert_eq!(code, Some(1), "{cert}: {out}");
        let what = if cert == "cert.pem" {
            "it is a FIFO, not a regular file"
        } else {
            "it holds 1073741824 bytes, more than the 1048576 allowed"
        };
        assert!(out.contains(cert) && out.contains(what), "{cert}: {out}");
        let (code, _, err) = bounded(&["serve", "--config", path], bound)
            .unwrap_or_else(|| panic!("serve held by {cert} for {bound:?}"));
        assert_ne!(code, Some(0), "{cert}: {err}");
        assert!(err.contains(cert) && err.contains(what), "{cert}: {err}");
    }
    // The config file itself.
    let huge = dir.join("huge.toml");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let (code, _, err) = bounded(&["config", "check", huge.to_str().unwrap()], bound)
        .expect("config check of a sparse gigabyte ends");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("more than the 4194304 allowed"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// One run reports every error of five kinds, each with its line, its
/// key and its fix: a key that is not one, a value not allowed, an
/// address that is not one, a setting that cannot work, a value out of
/// its type's range (named by its key) and a file that is not there.
#[test]
fn config_check_reports_errors_of_every_kind_in_one_run() {
    let dir = folder("every-kind");
    let config = write_broken(
        &dir,
        "listen = \"localhost\"\n\
         default_guard_timeout_ms = 0\n\
         [limits]\n\
         max_calls_per_batch = -1\n\
         [[guard]]\n\
         name = \"p\"\n\
         policy = \"missing-policy.toml\"\n",
    );
    let findings = [
        (1, "lisen", "unknown key", "write `listen`"),
        (
            2,
            "unguarded",
            "\"maybe\" is not one of",
            "unguarded = \"proceed\"",
        ),
        // The listener's own default, not the metrics port.
        (
            3,
            "listen",
            "is not an address",
            "listen = \"127.0.0.1:50051\"",
        ),
        (
            4,
            "default_guard_timeout_ms",
            "must be greater than 0",
            "e.g.",
        ),
        (
            6,
            "limits.max_calls_per_batch",
            "-1",
            "a whole number, 0 or more, e.g. max_calls_per_batch = ",
        ),
        (
            9,
            "guard[1].policy",
            "cannot read policy file",
            "point it at",
        ),
    ];
    let out = assert_findings(&config, 6, &findings);
    assert!(
        !out.contains("9090"),
        "no hint names the metrics port:\n{out}"
    );
}

/// A config whose files live elsewhere (a ConfigMap checked in CI):
/// `--root DIR` reads its absolute paths under DIR, `--no-files` reads
/// none; relative paths stay relative to the config's folder.
#[test]
fn config_check_reads_named_files_under_a_root_or_not_at_all() {
    let dir = folder("root");
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("etc/guardmesh")).unwrap();
    let policy =
        "[[rule]]\nname = \"x\"\nwhen = \"true\"\naction = \"cancel\"\nmessage = '\"m\"'\n";
    write(&root.join("etc/guardmesh"), "policy.toml", policy);
    write(&dir, "local.toml", policy);
    let config = write(
        &dir,
        "mesh.toml",
        "[[guard]]\nname = \"p\"\npolicy = \"/etc/guardmesh/policy.toml\"\n\
         [[guard]]\nname = \"q\"\npolicy = \"local.toml\"\n",
    );
    // Where the mesh would read them: not on this machine.
    let (code, out) = check(&config);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(
            ":3: error: guard[1].policy: cannot read policy file /etc/guardmesh/policy.toml"
        ),
        "{out}"
    );
    let run = |extra: &[&str]| {
        let mut args = vec!["config", "check", config.to_str().unwrap()];
        args.extend_from_slice(extra);
        let output = guardmesh(&args, None);
        (output.status.code(), stdout(&output))
    };
    let (code, out) = run(&["--root", root.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = run(&["--no-files"]);
    assert_eq!(code, Some(0), "{out}");
    // Under the root, a broken file is still found, named as written.
    write(
        &root.join("etc/guardmesh"),
        "policy.toml",
        "[[rule]]\nname = 1\n",
    );
    let (code, out) = run(&["--root", root.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("guard[1].policy"), "{out}");
    // And an error in the config itself is found without its files.
    std::fs::write(&config, "unguarded = \"maybe\"\n").unwrap();
    let (code, out) = run(&["--no-files"]);
    assert_eq!(code, Some(1), "{out}");
}

/// The environment variables named in the source of `file`: string
/// literals of `RUST_`, `GUARDMESH_` and `OTEL_` names outside comments,
/// and `RUST_LOG` where a log filter is read from the environment.
fn variables_read(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        if line.contains("from_default_env") {
            names.push("RUST_LOG".to_owned());
        }
        for (i, literal) in line.split('"').enumerate() {
            let is_name = ["RUST_", "GUARDMESH_", "OTEL_"]
                .iter()
                .any(|p| literal.starts_with(p))
                && !literal.ends_with('_')
                && literal
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if i % 2 == 1 && is_name {
                names.push(literal.to_owned());
            }
        }
    }
    names
}

/// Every environment variable the code reads is on the reference page
/// (`guardmesh config reference`, docs/configuration.md), whose text
/// `config_reference_docs_match_the_command` checks.
#[test]
fn config_reference_lists_every_environment_variable_the_code_reads() {
    use guardmesh_server::config::environment::listed;
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs")
                // Test files read variables of their own.
                && !path.file_name().is_some_and(|n| n == "tests.rs" || n.to_string_lossy().ends_with("_tests.rs"))
            {
                out.push(path);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for krate in ["server", "cli", "client", "gateway"] {
        rust_files(&root.join(krate).join("src"), &mut files);
    }
    let mut found = std::collections::BTreeSet::new();
    for file in &files {
        found.extend(variables_read(&std::fs::read_to_string(file).unwrap()));
    }
    for expected in [
        "RUST_LOG",
        "GUARDMESH_WORKER_THREADS",
        "GUARDMESH_TOKEN",
        "GUARDMESH_MESH",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ] {
        assert!(
            found.contains(expected),
            "{expected} not found in {found:?}"
        );
    }
    let missing: Vec<&String> = found.iter().filter(|name| !listed(name)).collect();
    assert!(
        missing.is_empty(),
        "read by the code, missing from config::environment: {missing:?}"
    );
    assert!(!listed("GUARDMESH_NOT_A_VARIABLE"));
    let reference = stdout(&guardmesh(&["config", "reference", "--markdown"], None));
    for name in &found {
        assert!(
            reference.contains(&format!("`{name}`")),
            "{name} is not on the reference page"
        );
    }
    assert_eq!(
        variables_read("let x = std::env::var(\"OTEL_X\");\n// \"GUARDMESH_Y\"\n"),
        ["OTEL_X"]
    );
}

/// Each file a config names that cannot be read (R24 token files, R27
/// policy files, R34 the Redis password) is reported on its key's line,
/// saying which file it is and that it cannot be read, with a fix naming
/// what the file should hold.
#[test]
fn r24_r27_r34_config_check_names_each_unreadable_file_and_what_it_should_hold() {
    let dir = folder("unreadable");
    let secret = crate::harness::session_secret(&dir, "sessions.secret");
    let config = write(
        &dir,
        "mesh.toml",
        &format!(
            "[sessions]\n\
             store = \"redis\"\n\
             redis_url = \"redis://127.0.0.1:9\"\n\
             secret_file = {:?}\n\
             redis_password_file = \"missing.password\"\n\
             [[auth.principal]]\n\
             id = \"ops\"\n\
             roles = [\"evaluate\"]\n\
             token_file = \"missing.token\"\n\
             [[guard]]\n\
             name = \"p\"\n\
             policy = \"missing-policy.toml\"\n",
            secret.display().to_string()
        ),
    );
    let (code, out) = check(&config);
    assert_eq!(code, Some(1), "{out}");
    let shown = config.display().to_string();
    let file = |name: &str| dir.join(name).display().to_string();
    for (line, key, says, fix) in [
        (
            5,
            "sessions.redis_password_file",
            format!("cannot read {}: ", file("missing.password")),
            "point it at a readable file holding Redis's password",
        ),
        (
            9,
            "auth[1].principal.token_file",
            format!("cannot read token file {}: ", file("missing.token")),
            "point it at a readable file holding the principal's token",
        ),
        (
            12,
            "guard[1].policy",
            format!("cannot read policy file {}: ", file("missing-policy.toml")),
            "point it at a readable policy file (CEL rules, R27)",
        ),
    ] {
        assert_finding(&out, &shown, line, key, &says, fix);
    }
}
