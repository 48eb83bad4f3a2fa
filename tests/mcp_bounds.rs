//! What one client or a chatty upstream can make the MCP gateway hold (R31,
//! R25): slow headers and bodies, many connections, one session's flood of
//! calls on the shared mesh link, an upstream line without end, and a
//! gateway whose own stderr nobody reads. Every attack runs against real
//! processes on loopback, bounded in count and time, while a canary call
//! from another client must be answered within the canary's bound (3 s); memory is read
//! from the gateway's `/proc/PID/status`.
//!
//! Also the HTTP transport's checks: `Origin` and `Host` (DNS rebinding),
//! and request methods other than POST that carry a body.

use crate::harness::*;
use crate::mcp::{Scratch, mcp_python, mesh_with_policy, post};
use guardmesh_client::Registration;
use serde_json::{Value, json};
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The canary's bound: well above a loopback call through the gateway, mesh
/// and upstream (tens of milliseconds, a second or more on a loaded 2-core
/// machine with 1,100 attack connections beside it), well below any
/// attack's hold (6 s for the slow guard, 10 s for the header and body
/// timeouts).
const CANARY: Duration = Duration::from_secs(3);

/// `guardmesh mcp http` in front of the Python SDK upstream.
struct HttpGateway {
    port: u16,
    url: String,
    gateway: KillOnDrop,
    _upstream: KillOnDrop,
    stderr: std::path::PathBuf,
}

impl HttpGateway {
    /// Starts the upstream and the gateway with `extra` arguments; with
    /// `nofile`, the gateway runs under that open-file limit.
    async fn start(mesh: &str, scratch: &Scratch, nofile: Option<u64>, extra: &[&str]) -> Self {
        let (upstream_port, upstream) = scratch.http_upstream().await;
        let port = free_port();
        let stderr = scratch.dir.join("gateway.stderr");
        let mut command = match nofile {
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}"))
                    .arg("--")
                    .arg(env!("CARGO_BIN_EXE_guardmesh"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_guardmesh")),
        };
        command
            .args(["mcp", "http", "--mesh", mesh, "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--upstream")
            .arg(format!("http://127.0.0.1:{upstream_port}/mcp"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap());
        let gateway = KillOnDrop(command.spawn().unwrap());
        wait_for_port(port, "guardmesh mcp http").await;
        Self {
            port,
            url: format!("http://127.0.0.1:{port}/mcp"),
            gateway,
            _upstream: upstream,
            stderr,
        }
    }

    fn pid(&self) -> String {
        self.gateway.0.id().to_string()
    }

    /// (RSS, peak RSS) of the gateway in MiB.
    fn memory_mib(&self) -> (u64, u64) {
        let (rss, peak) = rss_and_peak_kib(&self.pid());
        (rss / 1024, peak / 1024)
    }

    /// CPU time (user + system) the gateway has used, in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        // Fields after the command name (which may hold spaces): state is
        // field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// An initialized MCP session: its id.
    async fn session(&self) -> String {
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "canary", "version": "0"}}});
        let (status, head, body) = post(&self.url, None, &init.to_string()).await;
        assert_eq!(status, 200, "{head}\n{body}");
        let session = header_value(&head, "mcp-session-id").expect("Mcp-Session-Id");
        let (status, _, _) = post(
            &self.url,
            Some(&session),
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        )
        .await;
        assert_eq!(status, 202);
        session
    }

    /// One call from another client (its own connection and session):
    /// answered, with the upstream's result, within [`CANARY`].
    async fn canary(&self, session: &str, n: u32) -> Duration {
        let start = Instant::now();
        let call = json!({"jsonrpc": "2.0", "id": n, "method": "tools/call",
            "params": {"name": "pay", "arguments": {"amount": n, "to": "canary"}}});
        let answer = tokio::time::timeout(
            CANARY * 5,
            post(&self.url, Some(session), &call.to_string()),
        )
        .await;
        let took = start.elapsed();
        let (status, head, body) = answer.unwrap_or_else(|_| {
            panic!(
                "canary {n}: no answer within {:?}; gateway stderr:\n{}",
                CANARY * 5,
                self.stderr()
            )
        });
        assert_eq!(status, 200, "canary {n}: {head}\n{body}");
        assert!(
            body.contains(&format!("paid {n}.0 to canary")),
            "canary {n}: {body}"
        );
        assert!(took < CANARY, "canary {n} took {took:?}");
        took
    }
}

/// One raw HTTP/1.1 exchange: writes `request`, reads to the end (bounded).
async fn raw(port: u16, request: &[u8]) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

/// Whether the peer closed `stream` (EOF, reset, or an answer and EOF)
/// within `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

// ---------------------------------------------------------------------------
// HTTP: connections, headers, bodies
// ---------------------------------------------------------------------------

/// 1,100 connections that send half a request line and then nothing, against
/// a gateway with 512 descriptors: the connection cap (automatic, from the
/// open-file limit) keeps descriptors free, a new connection takes the place
/// of the oldest one that has not sent a whole request, the accept loop does
/// not spin, a canary is answered within its bound throughout, and the
/// header timeout (default 10 s) closes what is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r25_http_half_sent_requests_hold_no_descriptors_and_spin_nothing() {
    let _heavy = HEAVY.lock().await;
    let (mesh, _guard) = mesh_with_policy("bounds-slowloris").await;
    let scratch = Scratch::new("bounds-slowloris");
    let gw = HttpGateway::start(&mesh.url, &scratch, Some(512), &[]).await;
    let session = gw.session().await;
    gw.canary(&session, 1).await;

    let start = Instant::now();
    let mut attack = Vec::new();
    for _ in 0..1100 {
        // Bounded in time: connections the gateway never accepts wait in
        // its backlog, and past the backlog connecting times out.
        if start.elapsed() > Duration::from_secs(8) {
            break;
        }
        let Ok(Ok(mut stream)) = tokio::time::timeout(
            Duration::from_millis(500),
            TcpStream::connect(("127.0.0.1", gw.port)),
        )
        .await
        else {
            continue;
        };
        let _ = stream
            .write_all(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
            .await;
        attack.push(stream);
    }
    eprintln!(
        "{} half-sent requests in {:?}",
        attack.len(),
        start.elapsed()
    );
    assert!(
        attack.len() > 512,
        "the attack reached past the fd limit: {} connections",
        attack.len()
    );
    // Throughout: canaries answered, and the gateway mostly idle.
    let ticks = gw.cpu_ticks();
    let window = Instant::now();
    for n in 2..6 {
        gw.canary(&session, n).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let used = (gw.cpu_ticks() - ticks) as f64 / 100.0;
    let share = used / window.elapsed().as_secs_f64();
    eprintln!(
        "gateway CPU under the attack: {:.0}% of a core",
        share * 100.0
    );
    assert!(share < 0.5, "the gateway spun at {share:.2} of a core");
    // The header timeout closes every attack connection still open.
    let left = Duration::from_secs(10 + 4).saturating_sub(start.elapsed());
    let mut open = 0;
    for stream in &mut attack {
        if !closed_within(stream, left).await {
            open += 1;
        }
    }
    assert_eq!(
        open, 0,
        "attack connections left open after the header timeout"
    );
    gw.canary(&session, 7).await;
    let (_, peak) = gw.memory_mib();
    eprintln!("gateway peak RSS {peak} MiB");
}

/// How a slow body is framed.
#[derive(Clone, Copy, Debug)]
enum Framing {
    /// `Content-Length`: the gateway knows the length before the bytes.
    Declared,
    /// `Transfer-Encoding: chunked`: it learns the length as it reads.
    Chunked,
}

/// Slow bodies: 100 connections each send 4 MiB less 64 bytes of a 4 MiB
/// body and then nothing. The memory the gateway holds for them is bounded
/// by the global body budget (`--max-buffered-bytes`, 64 MiB by default)
/// plus, per connection, the uncounted allowance and hyper's read buffer
/// (80 KiB): its RSS never grows past that above what it held before,
/// with a margin of half the budget (buffers grown by doubling, and those
/// they outgrew that the allocator kept, held up to three times the
/// budget). A canary is answered within its bound throughout, and the body
/// timeout (default 10 s) ends what is left.
async fn slow_bodies_are_bounded(framing: Framing) {
    let _heavy = HEAVY.lock().await;
    let (mesh, _guard) = mesh_with_policy("bounds-bodies").await;
    let scratch = Scratch::new("bounds-bodies");
    let gw = HttpGateway::start(&mesh.url, &scratch, None, &[]).await;
    let session = gw.session().await;
    gw.canary(&session, 1).await;
    let (before, _) = gw.memory_mib();
    const BODY: usize = 4 << 20;
    const CONNECTIONS: u64 = 100;
    let bound = before + 64 + (CONNECTIONS * 80).div_ceil(1024) + 32;
    let start = Instant::now();
    let port = gw.port;
    // The attack on a thread and runtime of its own, so that it does not
    // hold up the guard this test serves.
    let attack = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let mut attack = tokio::task::JoinSet::new();
            for _ in 0..CONNECTIONS {
                attack.spawn(async move {
                    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
                    let framing_header = match framing {
                        Framing::Declared => format!("Content-Length: {BODY}"),
                        Framing::Chunked => "Transfer-Encoding: chunked".to_owned(),
                    };
                    let head = format!(
                        "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
                         Content-Type: application/json\r\n\
                         Accept: application/json, text/event-stream\r\n\
                         {framing_header}\r\n\r\n"
                    );
                    stream.write_all(head.as_bytes()).await.ok()?;
                    let chunk = vec![b' '; 64 << 10];
                    let mut sent = 0;
                    while sent < BODY - 64 {
                        let n = chunk.len().min(BODY - 64 - sent);
                        if let Framing::Chunked = framing {
                            let size = format!("{n:x}\r\n");
                            if stream.write_all(size.as_bytes()).await.is_err() {
                                break;
                            }
                        }
                        if stream.write_all(&chunk[..n]).await.is_err() {
                            break;
                        }
                        if let Framing::Chunked = framing
                            && stream.write_all(b"\r\n").await.is_err()
                        {
                            break;
                        }
                        sent += n;
                    }
                    Some(stream)
                });
            }
            let mut streams = Vec::new();
            while let Some(stream) = attack.join_next().await {
                if let Some(stream) = stream.unwrap() {
                    streams.push(stream);
                }
            }
            // The body timeout ends every connection still waiting for its
            // body.
            let left = Duration::from_secs(10 + 4).saturating_sub(start.elapsed());
            let mut open = 0;
            for stream in &mut streams {
                if !closed_within(stream, left).await {
                    open += 1;
                }
            }
            (streams.len(), open)
        })
    });
    // Canaries while the bodies arrive.
    let mut n = 2;
    let mut peak = 0;
    while start.elapsed() < Duration::from_secs(4) {
        gw.canary(&session, n).await;
        n += 1;
        peak = peak.max(gw.memory_mib().1);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (written, open) = tokio::task::spawn_blocking(move || attack.join().unwrap())
        .await
        .unwrap();
    gw.canary(&session, n).await;
    let (_, hwm) = gw.memory_mib();
    peak = peak.max(hwm);
    eprintln!(
        "slow bodies ({framing:?}): {written} connections written, gateway RSS {before} MiB \
         before, peak {peak} MiB (bound {bound}), {:?}",
        start.elapsed()
    );
    assert!(
        peak <= bound,
        "{framing:?} bodies: the gateway peaked at {peak} MiB, {} MiB over the {before} MiB it \
         held before; the bound is the 64 MiB budget, 80 KiB per connection and 32 MiB",
        peak - before
    );
    assert_eq!(open, 0, "connections left open after the body timeout");
    assert_eq!(
        scratch.executed().len(),
        n as usize,
        "only the canaries ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r25_http_slow_bodies_are_bounded_in_bytes_and_time() {
    slow_bodies_are_bounded(Framing::Declared).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r25_http_slow_chunked_bodies_are_bounded_in_memory() {
    slow_bodies_are_bounded(Framing::Chunked).await;
}

/// A slow guard, and one session that sends 1,100 calls at once (each its
/// own request, judged on its own): past its bound the session's calls are
/// answered at once with a JSON-RPC error (HTTP 429), so the shared link to
/// the mesh is never full and another session's call is answered within the
/// canary's bound, well before the slow guard's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r25_http_one_session_cannot_starve_the_mesh_link() {
    // How long the slow guard holds each of the flood's calls: its
    // deadline (it would answer after 6 s), then its failure policy.
    const HOLD: Duration = Duration::from_secs(3);
    let _heavy = HEAVY.lock().await;
    let (mesh, _guard) = mesh_with_policy("bounds-fair").await;
    let slow = call_guard(Duration::from_secs(6), |_| None).await;
    mesh.register(
        Registration::validate("slow", &slow.url)
            .tools(["read_file"])
            .timeout(HOLD),
    )
    .await;
    let scratch = Scratch::new("bounds-fair");
    let gw = HttpGateway::start(&mesh.url, &scratch, None, &["--batch-window-ms", "0"]).await;
    let session = gw.session().await;
    gw.canary(&session, 1).await;
    // The attacker's own session (R31: a session id the gateway did not
    // issue is answered 404, not judged).
    let attacker = std::sync::Arc::new(gw.session().await);
    let start = Instant::now();
    let mut attack = tokio::task::JoinSet::new();
    for i in 0..1100 {
        let url = gw.url.clone();
        let attacker = attacker.clone();
        attack.spawn(async move {
            // A read the policy guard lets pass, so the slow guard holds it.
            let call = json!({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                "params": {"name": "read_file", "arguments": {"path": format!("/{i}")}}});
            let answer = tokio::time::timeout(
                Duration::from_secs(20),
                post(&url, Some(&attacker), &call.to_string()),
            )
            .await;
            (answer.ok(), Instant::now())
        });
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for n in 2..5 {
        gw.canary(&session, n).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut busy = 0u32;
    let mut judged = 0u32;
    let mut lost = 0u32;
    let mut last_busy = start;
    while let Some(answer) = attack.join_next().await {
        let (answer, at) = answer.unwrap();
        let Some((status, _, body)) = answer else {
            lost += 1;
            continue;
        };
        if status == 429 {
            let error: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(error["error"]["code"], -32074, "{body}");
            busy += 1;
            last_busy = last_busy.max(at);
        } else {
            judged += 1;
        }
    }
    let flood = last_busy - start;
    eprintln!("one session's flood: {busy} answered busy, {judged} judged, over {flood:?}");
    // Nothing lost: every call of the flood has an answer.
    assert_eq!(lost, 0, "{lost} calls of the flood never answered");
    // The bound, not the machine's speed: at most 16 of the session's
    // calls are judged at once, and each holds its place for HOLD. So while
    // the flood lasts, at most 16 more are let through per HOLD (plus the
    // first 16); the rest are answered busy at once.
    let windows = u32::try_from(flood.as_millis().div_ceil(HOLD.as_millis())).unwrap() + 1;
    assert!(
        judged <= 16 * windows,
        "{judged} judged over {flood:?}: more than 16 at once ({busy} busy)"
    );
    assert!(busy >= 1100 - 16 * windows, "{busy} busy, {judged} judged");
}

// ---------------------------------------------------------------------------
// HTTP: Origin, Host, methods
// ---------------------------------------------------------------------------

fn request(method: &str, host: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} /mcp HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\n{extra}Content-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A browser page on another origin (DNS rebinding, or a plain cross-origin
/// POST) is refused with 403; a Host that is not the gateway's own address
/// or an allowed one is refused with 421; requests without Origin, and
/// allowed origins and hosts, pass. The client's Host reaches the upstream
/// (its own check still applies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_http_origin_and_host_are_checked() {
    let (mesh, guard) = mesh_with_policy("bounds-origin").await;
    let scratch = Scratch::new("bounds-origin");
    let gw = HttpGateway::start(
        &mesh.url,
        &scratch,
        None,
        &[
            "--allowed-origin",
            "https://app.example",
            "--allowed-host",
            "mcp.internal",
        ],
    )
    .await;
    let port = gw.port;
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"}}})
    .to_string();
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "pay", "arguments": {"amount": 1, "to": "evil"}}})
    .to_string();
    let own = format!("127.0.0.1:{port}");
    for (host, origin, body, want) in [
        // A rebound name: the browser sends its own Host and Origin.
        (
            "evil.example:80",
            "Origin: http://evil.example\r\n",
            &call,
            421,
        ),
        ("evil.example", "", &call, 421),
        (own.as_str(), "Origin: http://evil.example\r\n", &call, 403),
        (own.as_str(), "Origin: null\r\n", &call, 403),
        (&format!("localhost:{}", port + 1), "", &call, 421),
    ] {
        let (status, answer) = raw(port, &request("POST", host, origin, body)).await;
        assert_eq!(status, want, "Host {host} {origin}: {answer}");
        assert!(answer.contains("\"jsonrpc\""), "{answer}");
    }
    assert_eq!(guard.guard.requests(), 0, "nothing refused was judged");
    // Allowed: no Origin, the gateway's own address, localhost, an allowed
    // origin.
    for (host, origin) in [
        (own.clone(), String::new()),
        (format!("localhost:{port}"), String::new()),
        (own.clone(), format!("Origin: http://127.0.0.1:{port}\r\n")),
    ] {
        let (status, answer) = raw(port, &request("POST", &host, &origin, &init)).await;
        assert_eq!(status, 200, "Host {host} {origin}: {answer}");
    }
    // An allowed origin passes the gateway and reaches the upstream as sent
    // (the upstream, which allows only loopback origins, refuses it itself).
    let (_, answer) = raw(
        port,
        &request("POST", &own, "Origin: https://app.example\r\n", &init),
    )
    .await;
    assert!(!answer.contains("guardmesh"), "{answer}");
    // An allowed host reaches the upstream as the client sent it: the
    // upstream (which allows only loopback names) refuses it itself.
    let (status, answer) = raw(port, &request("POST", "mcp.internal", "", &init)).await;
    assert!(
        (400..500).contains(&status) && status != 403,
        "the upstream saw Host mcp.internal: {answer}"
    );
    assert!(scratch.executed().is_empty());
}

/// Only POST may carry a message: a body on PUT, PATCH, DELETE, GET or
/// OPTIONS (a tools/call the gateway would not judge) is refused with 405
/// and nothing is forwarded; the same methods without a body pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_http_bodies_on_other_methods_are_refused() {
    let (mesh, guard) = mesh_with_policy("bounds-methods").await;
    let scratch = Scratch::new("bounds-methods");
    let gw = HttpGateway::start(&mesh.url, &scratch, None, &[]).await;
    let session = gw.session().await;
    let host = format!("127.0.0.1:{}", gw.port);
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "delete_file", "arguments": {"path": "/"}}})
    .to_string();
    let with_session = format!("Mcp-Session-Id: {session}\r\n");
    for method in ["PUT", "PATCH", "DELETE", "GET", "OPTIONS"] {
        let (status, answer) = raw(gw.port, &request(method, &host, &with_session, &call)).await;
        assert_eq!(status, 405, "{method}: {answer}");
        assert!(answer.contains("\"jsonrpc\""), "{method}: {answer}");
        // Chunked too.
        let chunked = format!(
            "{method} /mcp HTTP/1.1\r\nHost: {host}\r\n{with_session}Content-Type: application/json\r\n\
             Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n{call}\r\n0\r\n\r\n",
            call.len()
        );
        let (status, answer) = raw(gw.port, chunked.as_bytes()).await;
        assert_eq!(status, 405, "{method} chunked: {answer}");
    }
    assert!(scratch.executed().is_empty(), "nothing ran");
    assert_eq!(guard.guard.requests(), 0);
    // Without a body they pass: the session still works, and DELETE ends it.
    gw.canary(&session, 1).await;
    let (status, answer) = raw(gw.port, &request("DELETE", &host, &with_session, "")).await;
    assert!(status == 200 || status == 204, "{answer}");
    assert_eq!(scratch.executed().len(), 1);
}

// ---------------------------------------------------------------------------
// stdio: the upstream's lines and stderr
// ---------------------------------------------------------------------------

/// `guardmesh mcp stdio` with stdout read on a thread (so that every read
/// has a deadline) and its stderr as given.
struct StdioGateway {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl StdioGateway {
    fn start(mesh: &str, extra: &[&str], upstream: Vec<String>, stderr: Stdio) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_guardmesh"))
            .args(["mcp", "stdio", "--mesh", mesh])
            .args(extra)
            .arg("--")
            .args(upstream)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            stdin: child.stdin.take(),
            child,
            lines,
        }
    }

    fn send(&mut self, message: &Value) {
        let stdin = self.stdin.as_mut().unwrap();
        let _ = stdin.write_all(format!("{message}\n").as_bytes());
        let _ = stdin.flush();
    }

    fn recv(&self, within: Duration) -> Option<Value> {
        let line = self.lines.recv_timeout(within).ok()?;
        Some(serde_json::from_str(&line).unwrap())
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    fn initialize(&mut self, within: Duration) -> Option<Value> {
        self.send(
            &json!({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}}),
        );
        let init = self.recv(within)?;
        self.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        Some(init)
    }
}

impl Drop for StdioGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An upstream that answers `initialize`, then answers `tools/list` with a
/// line of `bytes` bytes that never ends.
fn endless_upstream(bytes: usize) -> Vec<String> {
    let script = format!(
        r#"
import sys, json, time
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("method") == "initialize":
        print(json.dumps({{"jsonrpc": "2.0", "id": msg["id"], "result": {{
            "protocolVersion": "2025-11-25", "capabilities": {{"tools": {{}}}},
            "serverInfo": {{"name": "endless", "version": "0"}}}}}}), flush=True)
    elif msg.get("method") == "tools/list":
        out = sys.stdout.buffer
        out.write(b'{{"jsonrpc": "2.0", "id": ' + json.dumps(msg["id"]).encode() + b', "result": {{"x": "')
        chunk = b"x" * (1 << 20)
        for _ in range({bytes} >> 20):
            out.write(chunk)
        out.flush()
        time.sleep(60)
"#
    );
    vec![mcp_python().display().to_string(), "-c".into(), script]
}

/// An upstream line of 400 MiB without a newline: the gateway holds at most
/// its line limit (`--max-upstream-message-bytes`, default 32 MiB), then
/// ends the session with an error naming the limit, and its peak RSS stays
/// under 160 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r25_stdio_an_endless_upstream_line_is_bounded() {
    let _heavy = HEAVY.lock().await;
    let (mesh, _guard) = mesh_with_policy("bounds-endless").await;
    let scratch = Scratch::new("bounds-endless");
    let stderr_path = scratch.dir.join("gateway.stderr");
    let stderr = std::fs::File::create(&stderr_path).unwrap();
    let url = mesh.url.clone();
    let (peak, status) = tokio::task::spawn_blocking(move || {
        let mut gw = StdioGateway::start(&url, &[], endless_upstream(400 << 20), stderr.into());
        gw.initialize(Duration::from_secs(10)).expect("initialized");
        gw.send(&json!({"jsonrpc": "2.0", "id": "l", "method": "tools/list"}));
        let start = Instant::now();
        let mut peak = 0;
        let status = loop {
            if let Ok(Some(status)) = gw.child.try_wait() {
                break Some(status);
            }
            if start.elapsed() > Duration::from_secs(20) {
                break None;
            }
            peak = peak.max(rss_and_peak_kib(&gw.pid()).1 / 1024);
            std::thread::sleep(Duration::from_millis(20));
        };
        (peak, status)
    })
    .await
    .unwrap();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    eprintln!("endless upstream line: gateway peak RSS {peak} MiB, exit {status:?}");
    assert!(peak < 160, "the gateway peaked at {peak} MiB");
    let status = status.expect("the gateway ended the session");
    assert!(!status.success(), "{status}");
    assert!(
        stderr.contains("longer than 33554432 bytes"),
        "the error names the limit: {stderr}"
    );
}

/// Nobody reads the gateway's stderr: the upstream writes far more to its
/// stderr than a pipe holds, and the gateway logs a warning per dropped
/// message. The relay never blocks: the session is initialized and every
/// call answered within the canary's bound; the lines that did not fit are dropped
/// and counted, and the count is reported once stderr is read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r31_r25_stdio_unread_stderr_never_blocks_the_relay() {
    let (mesh, _guard) = mesh_with_policy("bounds-stderr").await;
    let scratch = Scratch::new("bounds-stderr");
    let upstream = scratch.upstream(&["noisy"]);
    let url = mesh.url.clone();
    let stderr = tokio::task::spawn_blocking(move || {
        let mut gw = StdioGateway::start(&url, &[], upstream, Stdio::piped());
        let stderr = gw.child.stderr.take().unwrap();
        let init = gw.initialize(CANARY * 10);
        assert!(
            init.is_some(),
            "initialize was not answered: the relay blocked"
        );
        // Warnings: each tools/call notification is dropped with one.
        for _ in 0..2000 {
            gw.send(&json!({"jsonrpc": "2.0", "method": "tools/call",
                "params": {"name": "pay", "arguments": {"amount": 1, "to": "x"}}}));
        }
        for n in 1..=5 {
            let start = Instant::now();
            gw.send(&json!({"jsonrpc": "2.0", "id": n, "method": "tools/call",
                "params": {"name": "pay", "arguments": {"amount": n, "to": "b"}}}));
            let answer = gw
                .recv(CANARY * 5)
                .unwrap_or_else(|| panic!("call {n} not answered: the relay blocked"));
            assert_eq!(answer["id"], n, "{answer}");
            assert!(
                start.elapsed() < CANARY,
                "call {n} took {:?}",
                start.elapsed()
            );
        }
        // stderr is read again: the gateway reports what it dropped.
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut { stderr }, &mut text);
            text
        });
        drop(gw.stdin.take());
        let status = gw.child.wait().unwrap();
        assert!(status.success(), "{status}");
        reader.join().unwrap()
    })
    .await
    .unwrap();
    let report = stderr
        .lines()
        .find(|l| l.contains("stderr lines dropped"))
        .unwrap_or_else(|| {
            panic!(
                "no report of dropped lines:\n{}",
                &stderr[stderr.len().saturating_sub(2000)..]
            )
        });
    eprintln!("{report}");
    assert_eq!(scratch.executed().len(), 5);
}

/// `--max-connection-age-ms`: a kept-alive client connection past its age
/// is closed once its request is answered (the answer arrives whole), so
/// that clients behind a load balancer spread over gateways added later;
/// the client's next connection is served. Without the age the connection
/// would stay open until the (here one-minute) idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r25_http_connections_past_their_age_are_closed_between_requests() {
    let (mesh, _guard) = mesh_with_policy("bounds-age").await;
    let scratch = Scratch::new("bounds-age");
    let gw = HttpGateway::start(
        &mesh.url,
        &scratch,
        None,
        &[
            "--max-connection-age-ms",
            "300",
            "--header-timeout-ms",
            "60000",
        ],
    )
    .await;
    let session = gw.session().await;
    let host = format!("127.0.0.1:{}", gw.port);
    let mut tcp = TcpStream::connect(("127.0.0.1", gw.port)).await.unwrap();
    // Kept alive: no `Connection: close`; answered 405 by the gateway.
    let put = format!(
        "PUT /mcp HTTP/1.1\r\nHost: {host}\r\nMcp-Session-Id: {session}\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
    );
    tcp.write_all(put.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        closed.is_ok(),
        "the connection outlived its age: {answer}\n{}",
        gw.stderr()
    );
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    gw.canary(&session, 1).await;
}
