//! The benchmark's guard process (`guardmesh bench-guards`, hidden): the
//! guards, served by the Rust SDK, each on its own port, and the unary
//! baselines of `guardmesh.bench.v1`.
//!
//! For each guard it serves:
//!
//! * its `GuardService` port, with `GuardServer::serve`
//!   exactly as a guard author serves a guard (health and reflection
//!   included): the mesh's `Judge` stream lands here;
//! * its `DirectGuard` port: the same guard object behind a unary call, what
//!   a coordinator without a mesh calls.
//!
//! It also serves one raw `Echo` port (a unary echo and a bidi echo stream). It prints `GUARD <name>
//! <stream port> <direct port>` per guard, `ECHO <port>`, then `READY`, and
//! exits when its stdin closes (the benchmark holds the other end), on
//! SIGINT or SIGTERM.

use super::{Error, Flavor};
use crate::proto::EchoMessage;
use crate::proto::direct_guard_server::{DirectGuard, DirectGuardServer};
use crate::proto::echo_server::{Echo, EchoServer};
use guardmesh_client::Guard;
use guardmesh_client::guard::GuardServer;
use guardmesh_client::proto::{GuardBatch, JudgeResponse, Verdict};
use guardmesh_client::verdict::steer;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// Arguments of `guardmesh bench-guards`.
#[derive(Debug, Clone, clap::Args)]
pub struct GuardsArgs {
    /// A guard to serve: `NAME:DELAY_MS`, `NAME:DELAY_MS:veto` for one
    /// that steers every call it is sent, or `NAME:DELAY_MS:cpu` for one
    /// that spends the delay busy on the CPU instead of asleep. Repeatable.
    #[arg(long = "guard", required = true)]
    pub guards: Vec<String>,
    /// Also serves the raw unary echo.
    #[arg(long)]
    pub echo: bool,
    /// Runtime flavour of this process.
    #[arg(long, value_enum, default_value_t = Flavor::Current)]
    pub runtime: Flavor,
    /// Serves the guards' `Judge` streams with the SDK's `GuardServer` on
    /// sockets with `TCP_NODELAY`, instead of through the SDK's `serve`
    /// (which leaves Nagle's algorithm on), to measure what that costs.
    #[arg(long)]
    pub stream_nodelay: bool,
    /// Diagnostic: a `:cpu` guard does its work on the runtime's thread,
    /// timed by the wall clock (how the benchmark ran it before).
    #[arg(long)]
    pub cpu_inline: bool,
}

/// One guard of the benchmark: answers after `delay`, proceeding on every
/// call, or skipping (steer) every call when `veto`; when `cpu`, the delay
/// is spent busy on the CPU (a CPU-bound guard) rather than asleep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct GuardDef {
    pub name: String,
    pub delay: Duration,
    pub veto: bool,
    pub cpu: bool,
}

impl GuardDef {
    pub(super) fn new(name: &str, delay_ms: u64, veto: bool) -> Self {
        Self {
            name: name.to_owned(),
            delay: Duration::from_millis(delay_ms),
            veto,
            cpu: false,
        }
    }

    /// A guard that proceeds on every call after `delay_ms` of CPU work.
    pub(super) fn cpu(name: &str, delay_ms: u64) -> Self {
        Self {
            cpu: true,
            ..Self::new(name, delay_ms, false)
        }
    }

    /// The `--guard` argument that describes it.
    pub(super) fn to_arg(&self) -> String {
        let mode = if self.veto {
            ":veto"
        } else if self.cpu {
            ":cpu"
        } else {
            ""
        };
        format!("{}:{}{mode}", self.name, self.delay.as_millis())
    }

    /// Parses a `--guard` argument.
    pub(super) fn parse(text: &str) -> Result<Self, Error> {
        let mut parts = text.split(':');
        let bad = || format!("bad --guard {text:?}: expected NAME:DELAY_MS[:veto|:cpu]");
        let name = parts.next().filter(|n| !n.is_empty()).ok_or_else(bad)?;
        let delay_ms: u64 = parts.next().and_then(|d| d.parse().ok()).ok_or_else(bad)?;
        let (veto, cpu) = match parts.next() {
            None => (false, false),
            Some("veto") => (true, false),
            Some("cpu") => (false, true),
            Some(_) => return Err(bad().into()),
        };
        if parts.next().is_some() {
            return Err(bad().into());
        }
        Ok(Self {
            cpu,
            ..Self::new(name, delay_ms, veto)
        })
    }
}

/// The guard behind both ports.
#[derive(Debug)]
pub(super) struct BenchGuard {
    delay: Duration,
    veto: bool,
    cpu: bool,
    /// A CPU-bound guard judges one request at a time (one core's worth of
    /// judging per process), in turn.
    one_at_a_time: tokio::sync::Mutex<()>,
    /// `--cpu-inline`: the work on the runtime's thread, by the wall clock.
    inline: bool,
}

/// Keeps this thread busy until it has used `work` of CPU time: a guard
/// whose judging costs CPU (a classifier, a parser), which no await lets
/// another request overlap. Counted on the thread's own CPU clock, not the
/// wall clock: a replica preempted in the middle of a request (by the mesh,
/// the load generator or another replica sharing its core) still spends
/// the whole `work` on it, as a real CPU-bound guard would, rather than
/// finishing it early with less work done.
fn busy(work: Duration) {
    let Some(started) = thread_cpu() else {
        // No thread CPU clock: the wall clock (overstates the work done
        // when the thread is preempted).
        let started = std::time::Instant::now();
        while started.elapsed() < work {
            spin();
        }
        return;
    };
    while thread_cpu().is_some_and(|now| now.saturating_sub(started) < work) {
        spin();
    }
}

/// A few microseconds of work between two reads of the clock.
fn spin() {
    let mut spins: u64 = 0;
    for _ in 0..2_000 {
        spins = std::hint::black_box(spins.wrapping_add(1));
    }
}

/// The CPU time this thread has used (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu() -> Option<Duration> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given, which
    // lives for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    if rc != 0 {
        return None;
    }
    Some(Duration::new(
        u64::try_from(now.tv_sec).ok()?,
        u32::try_from(now.tv_nsec).ok()?,
    ))
}

impl Guard for BenchGuard {
    async fn judge(&self, batch: &GuardBatch) -> Result<Vec<Verdict>, Status> {
        if self.cpu && self.inline {
            let started = std::time::Instant::now();
            while started.elapsed() < self.delay {
                spin();
            }
        } else if self.cpu {
            // On a thread of its own, as a CPU-bound guard must run: work
            // done on the runtime's one thread would hold the process's
            // I/O for as long as every request read before it takes. The
            // requests read meanwhile and the answers written would wait
            // for it, and the guard would answer in bursts of the whole
            // queue at once (the mesh would see a replica that holds every
            // request and then answers them all).
            let _turn = self.one_at_a_time.lock().await;
            let work = self.delay;
            tokio::task::spawn_blocking(move || busy(work))
                .await
                .map_err(|e| Status::internal(format!("the guard's CPU work failed: {e}")))?;
        } else if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Ok(if self.veto {
            batch
                .calls
                .iter()
                .map(|call| steer(&call.call_id, "Vetoed by the benchmark's guard."))
                .collect()
        } else {
            Vec::new()
        })
    }
}

/// `DirectGuard`: one unary call per batch, answered by the same guard.
struct Direct(Arc<BenchGuard>);

#[tonic::async_trait]
impl DirectGuard for Direct {
    async fn judge(&self, request: Request<GuardBatch>) -> Result<Response<JudgeResponse>, Status> {
        let batch = request.into_inner();
        let answer = match self.0.judge(&batch).await {
            Ok(verdicts) => JudgeResponse {
                request_id: batch.request_id,
                verdicts,
                ..JudgeResponse::default()
            },
            Err(status) => JudgeResponse {
                request_id: batch.request_id,
                error: format!("{}: {}", status.code(), status.message()),
                ..JudgeResponse::default()
            },
        };
        Ok(Response::new(answer))
    }
}

/// `Echo`: the request back, unchanged; on the stream, each message back.
struct Echoer;

/// The answers of one `EchoStream`.
type EchoStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<EchoMessage, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Echo for Echoer {
    async fn echo(&self, request: Request<EchoMessage>) -> Result<Response<EchoMessage>, Status> {
        Ok(Response::new(request.into_inner()))
    }

    type EchoStreamStream = EchoStream;

    async fn echo_stream(
        &self,
        request: Request<tonic::Streaming<EchoMessage>>,
    ) -> Result<Response<EchoStream>, Status> {
        Ok(Response::new(Box::pin(request.into_inner())))
    }
}

/// Entry point of `guardmesh bench-guards`.
pub(super) fn main(args: GuardsArgs) -> ExitCode {
    super::run_child(args.runtime.build(), serve(args))
}

/// Accepted connections with `TCP_NODELAY` set. Tonic applies its own
/// `tcp_nodelay(true)` only to listeners it binds itself (`serve`), never to
/// an incoming stream handed to `serve_with_incoming`; without it, Nagle's
/// algorithm holds back small writes until the peer's delayed ACK (~40 ms).
fn nodelay(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

async fn bind() -> Result<(TcpListener, u16), Error> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    Ok((listener, port))
}

async fn serve(args: GuardsArgs) -> Result<(), Error> {
    let defs = args
        .guards
        .iter()
        .map(|g| GuardDef::parse(g))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = String::new();
    for def in defs {
        let guard = Arc::new(BenchGuard {
            delay: def.delay,
            veto: def.veto,
            cpu: def.cpu,
            one_at_a_time: tokio::sync::Mutex::new(()),
            inline: args.cpu_inline,
        });
        let (stream_listener, stream_port) = bind().await?;
        let (direct_listener, direct_port) = bind().await?;
        let name = def.name.clone();
        let stream_nodelay = args.stream_nodelay;
        tokio::spawn({
            let guard = guard.clone();
            async move {
                let served = if stream_nodelay {
                    tonic::transport::Server::builder()
                        .add_service(GuardServer::from_arc(guard).into_service())
                        .serve_with_incoming(nodelay(stream_listener))
                        .await
                        .map_err(Error::from)
                } else {
                    GuardServer::from_arc(guard)
                        .serve(stream_listener, std::future::pending())
                        .await
                        .map_err(Error::from)
                };
                if let Err(error) = served {
                    tracing::error!(guard = %name, %error, "guard server stopped");
                }
            }
        });
        let name = def.name.clone();
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(DirectGuardServer::new(Direct(guard)))
                .serve_with_incoming(nodelay(direct_listener))
                .await;
            if let Err(error) = served {
                tracing::error!(guard = %name, %error, "direct server stopped");
            }
        });
        out.push_str(&format!("GUARD {} {stream_port} {direct_port}\n", def.name));
    }
    if args.echo {
        let (listener, port) = bind().await?;
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(EchoServer::new(Echoer))
                .serve_with_incoming(nodelay(listener))
                .await;
            if let Err(error) = served {
                tracing::error!(%error, "echo server stopped");
            }
        });
        out.push_str(&format!("ECHO {port}\n"));
    }
    out.push_str("READY\n");
    {
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(out.as_bytes())?;
        stdout.flush()?;
    }
    super::until_released().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_args_round_trip() {
        for def in [
            GuardDef::new("zero-1", 0, false),
            GuardDef::new("veto-1ms", 1, true),
            GuardDef::cpu("cpu-1ms", 1),
        ] {
            assert_eq!(GuardDef::parse(&def.to_arg()).ok(), Some(def));
        }
        for bad in [
            "",
            "x",
            "x:",
            "x:y",
            "x:1:maybe",
            "x:1:veto:1",
            "x:1:cpu:veto",
            ":1",
        ] {
            assert!(GuardDef::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_cpu_guard_spends_its_delay_in_cpu_time() {
        // The replicas figure rests on it: each request costs the guard
        // this much CPU, however often its thread is preempted meanwhile.
        let before = thread_cpu().expect("a thread CPU clock");
        busy(Duration::from_millis(5));
        let spent = thread_cpu().expect("a thread CPU clock") - before;
        assert!(
            spent >= Duration::from_millis(5) && spent < Duration::from_millis(50),
            "{spent:?}"
        );
    }
}
