//! Paused-time versions of the real-socket fault, deadline, restart and
//! circuit tests (R3-R5, R8-R10, R12-R15, R17, R23, R25): the real judging
//! ([`Mesh::evaluate_unrecorded`] over a registry, a chain and its guard links) with
//! guards scripted in memory ([`crate::link::scripted`]) in place of gRPC
//! servers on loopback. Time is tokio's paused clock: a guard that "hangs
//! for 30 s" costs nothing, and every duration a batch takes is exact, so
//! the tests assert them. Each test names the integration test it mirrors;
//! those keep the real sockets, end to end.
//!
//! Most scenarios are written once (in [`scenarios`]) and run on both
//! transports: in paused time over the scripted guards, and in real time
//! (`on_a_socket::`) over the same guards served on loopback sockets and
//! reached by the mesh's own gRPC transport, where they assert outcomes and
//! order rather than exact durations. The rest run in paused time only:
//! they stop reading (which only the scripted transport can do), or depend
//! on the moment a timer fires (a circuit's open period, a redial's probe,
//! a recovery bound), which a real clock cannot promise.

use super::{BatchError, TraceContext};
use crate::link::scripted::{
    ScriptedGuard, ScriptedNet, Step, Transport, cancel, on_both_transports, proceed, rewrite,
    serve_on_loopback, skip, steer,
};
use crate::link::transport::GuardTransport;
use crate::registry::{Admission, MemoryRegistry, Registry, admit_blocking};
use crate::{Mesh, MeshConfig};
use guardmesh_proto::v1::FailurePolicy::{Abort, FailClosed, FailOpen};
use guardmesh_proto::v1::{
    Action, BatchDecision, CallDecision, EvaluateRequest, FailurePolicy, GuardBatch, GuardRole,
    GuardSpec, GuardTrace, RewriteGrant, ToolCall, TraceStatus, Verdict,
};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// The integration harness's `fast_config`: quick redials.
fn fast_config() -> MeshConfig {
    let mut config = MeshConfig::default();
    config.link.backoff_initial = ms(20);
    config.link.backoff_max = ms(200);
    config.link.connect_timeout = ms(500);
    config
}

/// `faults::restart_config`: a circuit that opens after 5 failures and
/// lets a probe through after 300 ms.
fn restart_config(config: &mut MeshConfig) {
    config.link.circuit_failures = 5;
    config.link.circuit_open_for = ms(300);
}

/// A mesh whose guards are scripted guards, in memory or on sockets (also
/// the world of the results phase's tests).
pub(super) struct World {
    transport: Transport,
    net: Arc<ScriptedNet>,
    registry: Arc<MemoryRegistry>,
    pub(super) mesh: Arc<Mesh>,
    next_port: AtomicU16,
}

impl World {
    pub(super) fn new() -> Self {
        Self::on(Transport::Scripted)
    }

    fn on(transport: Transport) -> Self {
        Self::on_with(transport, |_| {})
    }

    fn with(change: impl FnOnce(&mut MeshConfig)) -> Self {
        Self::on_with(Transport::Scripted, change)
    }

    fn on_with(transport: Transport, change: impl FnOnce(&mut MeshConfig)) -> Self {
        let net = ScriptedNet::new();
        let mut config = fast_config();
        change(&mut config);
        if transport == Transport::Scripted {
            config.link.transport = Some(net.clone() as Arc<dyn GuardTransport>);
        }
        let registry = Arc::new(MemoryRegistry::new(config.default_guard_timeout));
        let mesh = Mesh::new(config, registry.clone());
        Self {
            transport,
            net,
            registry,
            mesh,
            next_port: AtomicU16::new(20_000),
        }
    }

    /// An endpoint where nothing listens.
    fn closed_port(&self) -> String {
        match self.transport {
            Transport::Scripted => format!(
                "http://127.0.0.1:{}",
                self.next_port.fetch_add(1, Ordering::Relaxed)
            ),
            Transport::Socket => {
                let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
                format!("http://{}", listener.local_addr().expect("a bound port"))
            }
        }
    }

    /// A scripted guard at a new endpoint.
    pub(super) fn guard(
        &self,
        script: impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static,
    ) -> (String, Arc<ScriptedGuard>) {
        match self.transport {
            Transport::Scripted => {
                let url = self.closed_port();
                let guard = self.net.guard(&url, script);
                (url, guard)
            }
            Transport::Socket => {
                let guard = ScriptedGuard::new(script);
                (serve_on_loopback(guard.clone()), guard)
            }
        }
    }

    /// Lets the spawned tasks (links, guards' streams) run (see
    /// [`Transport::settle`]).
    async fn settle(&self) {
        self.transport.settle().await;
    }

    /// Sleeps `pause`, and on sockets at least 100 ms: time for what is
    /// sent to reach the guards.
    async fn sleep_at_least(&self, pause: Duration) {
        match self.transport {
            Transport::Scripted => tokio::time::sleep(pause).await,
            Transport::Socket => tokio::time::sleep(pause.max(ms(100))).await,
        }
    }

    /// Asserts that what began at `started` took `want` (see
    /// [`Transport::assert_took`]).
    fn took(&self, started: Instant, want: Duration, what: &str) {
        self.transport.assert_took(started.elapsed(), want, what);
    }

    /// Asserts the deadline a guard was told (R14): `want` exactly in
    /// paused time; on sockets, no more than `want` (the real clock has
    /// moved on by the time the request is written).
    fn told(&self, deadline_ms: u32, want: u32, what: &str) {
        match self.transport {
            Transport::Scripted => assert_eq!(deadline_ms, want, "{what}"),
            Transport::Socket => assert!(
                deadline_ms > 0 && deadline_ms <= want,
                "{what}: {deadline_ms} ms, want at most {want} ms"
            ),
        }
    }

    /// A guard that proceeds every call at once.
    fn proceed_guard(&self) -> (String, Arc<ScriptedGuard>) {
        self.guard(proceed_all)
    }

    pub(super) async fn register(&self, spec: GuardSpec) {
        let admission = Admission {
            default_timeout: self.mesh.config.default_guard_timeout,
            endpoint_policy: Arc::default(),
        };
        let checked = admit_blocking(spec, &admission).expect("a valid registration");
        self.registry
            .register(checked, None)
            .await
            .expect("registered");
    }

    /// A scripted guard at a new endpoint, registered as `spec(endpoint)`.
    pub(super) async fn guarded(
        &self,
        spec: impl FnOnce(&str) -> GuardSpec,
        script: impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static,
    ) -> Arc<ScriptedGuard> {
        let (url, guard) = self.guard(script);
        self.register(spec(&url)).await;
        guard
    }

    async fn evaluate(&self, batch: Batch) -> Result<BatchDecision, BatchError> {
        evaluate(&self.mesh, batch).await
    }

    /// The decision on `batch`, asserting it took `want` (see
    /// [`World::took`]).
    async fn decision_after(&self, batch: Batch, want: Duration, what: &str) -> BatchDecision {
        let started = Instant::now();
        let d = self.decision(batch).await;
        self.took(started, want, what);
        d
    }

    /// Evaluates `batch`, which must get a decision.
    async fn decision(&self, batch: Batch) -> BatchDecision {
        self.evaluate(batch)
            .await
            .unwrap_or_else(|e| panic!("a decision, not {e}"))
    }

    /// Evaluates `batch` in a task of its own: a batch left in flight while
    /// the test goes on.
    fn spawn(&self, batch: Batch) -> tokio::task::JoinHandle<Result<BatchDecision, BatchError>> {
        let mesh = self.mesh.clone();
        tokio::spawn(async move { evaluate(&mesh, batch).await })
    }

    /// A counter of the mesh's metrics, by sample name and labels.
    fn metric(&self, sample: &str) -> f64 {
        self.mesh
            .metrics
            .encode()
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| {
                let (name, value) = line.rsplit_once(' ')?;
                (name == sample)
                    .then(|| value.parse::<f64>().ok())
                    .flatten()
            })
            .sum()
    }
}

async fn evaluate(mesh: &Mesh, batch: Batch) -> Result<BatchDecision, BatchError> {
    let request = EvaluateRequest {
        batch_id: batch.id,
        calls: batch.calls,
        timeout_ms: u32::try_from(batch.timeout.as_millis()).unwrap_or(u32::MAX),
        ..Default::default()
    };
    let trace = TraceContext {
        client: batch.client,
        unary: batch.unary,
        ..TraceContext::default()
    };
    mesh.evaluate_unrecorded(request, Instant::now() + batch.timeout, trace)
        .await
}

/// A batch as a coordinator sends it.
struct Batch {
    id: String,
    calls: Vec<ToolCall>,
    timeout: Duration,
    client: u64,
    unary: bool,
}

impl Batch {
    fn new(id: impl std::fmt::Display) -> Self {
        Self {
            id: format!("b{id}"),
            calls: Vec::new(),
            timeout: secs(5),
            client: 0,
            unary: false,
        }
    }

    /// A batch of `calls` (id and tool) without arguments.
    fn of(id: impl std::fmt::Display, calls: &[(&str, &str)]) -> Self {
        calls.iter().fold(Self::new(id), |batch, (call, tool)| {
            batch.call(call, tool, "{}")
        })
    }

    /// A batch of one call, `c1` of tool `t`, without arguments.
    fn one(id: impl std::fmt::Display) -> Self {
        Self::of(id, &[("c1", "t")])
    }

    fn call(mut self, id: &str, tool: &str, arguments: &str) -> Self {
        self.calls.push(ToolCall {
            call_id: id.into(),
            tool: tool.into(),
            arguments: arguments.into(),
        });
        self
    }

    fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn client(mut self, client: u64) -> Self {
        self.client = client;
        self
    }
}

/// A validate guard `name` at `url` (also for the results phase tests).
pub(super) fn validate(name: &str, url: &str) -> GuardSpec {
    GuardSpec {
        name: name.into(),
        endpoint: url.into(),
        ..Default::default()
    }
}

fn mutate(name: &str, url: &str, grant: &[&str]) -> GuardSpec {
    GuardSpec {
        role: GuardRole::Mutate as i32,
        grant: Some(RewriteGrant {
            tools: grant.iter().map(|t| (*t).to_owned()).collect(),
            may_rename: false,
        }),
        ..validate(name, url)
    }
}

pub(super) trait SpecExt {
    fn tools(self, tools: &[&str]) -> Self;
    fn policy(self, policy: FailurePolicy) -> Self;
    fn timeout(self, timeout: Duration) -> Self;
    fn priority(self, priority: i32) -> Self;
}

impl SpecExt for GuardSpec {
    fn tools(mut self, tools: &[&str]) -> Self {
        self.tools = tools.iter().map(|t| (*t).to_owned()).collect();
        self
    }
    fn policy(mut self, policy: FailurePolicy) -> Self {
        self.failure_policy = policy as i32;
        self
    }
    fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        self
    }
    fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }
}

fn entry<'a>(d: &'a BatchDecision, guard: &str) -> &'a GuardTrace {
    d.trace
        .iter()
        .find(|t| t.guard == guard)
        .unwrap_or_else(|| panic!("no trace entry for {guard}: {:?}", d.trace))
}

pub(super) fn status(d: &BatchDecision, guard: &str) -> TraceStatus {
    TraceStatus::try_from(entry(d, guard).status).unwrap_or(TraceStatus::Unspecified)
}

fn action(call: &CallDecision) -> Action {
    Action::try_from(call.action).unwrap_or(Action::Unspecified)
}

fn ids(d: &BatchDecision) -> Vec<&str> {
    d.decisions.iter().map(|c| c.call_id.as_str()).collect()
}

fn executed(d: &BatchDecision) -> Vec<&str> {
    d.execute.iter().map(|c| c.call_id.as_str()).collect()
}

fn proceeds(call: &CallDecision) -> bool {
    action(call) == Action::Proceed
}

/// R13 `fail_closed`: cancelled, a failure, decided by `guard`, naming it.
fn assert_failure_cancel(call: &CallDecision, guard: &str, what: &str) {
    assert_eq!(action(call), Action::Cancel, "{what}: {call:?}");
    assert!(call.failure, "{what}: {call:?}");
    assert_eq!(call.decided_by, guard, "{what}: {call:?}");
    assert!(call.content.contains(guard), "{what}: {call:?}");
}

/// R13 `fail_open`: proceeds, the bypass recorded.
fn assert_bypassed(call: &CallDecision, guard: &str, what: &str) {
    assert!(proceeds(call), "{what}: {call:?}");
    assert_eq!(call.bypassed, [guard], "{what}: {call:?}");
    assert!(!call.failure, "{what}: {call:?}");
}

/// A skip the guard sent (not a failure).
fn assert_skip(call: &CallDecision, guard: &str, want: Action, content: &str, what: &str) {
    assert_eq!(action(call), want, "{what}: {call:?}");
    assert_eq!(call.content, content, "{what}: {call:?}");
    assert_eq!(call.decided_by, guard, "{what}: {call:?}");
    assert!(!call.failure, "{what}: {call:?}");
}

/// Lets the spawned tasks (links, scripted streams) run: 1 ms of virtual
/// time.
async fn settle() {
    tokio::time::sleep(ms(1)).await;
}

/// `faults::register_each_policy`: `fc` (fail_closed, `a.*`), `fo`
/// (fail_open, `b.*`), `ab` (abort, `c.*`), all at `url`.
async fn register_each_policy(world: &World, url: &str, timeout: Duration) {
    for (name, tools, policy) in [
        ("fc", "a.*", FailClosed),
        ("fo", "b.*", FailOpen),
        ("ab", "c.*", Abort),
    ] {
        world
            .register(
                validate(name, url)
                    .tools(&[tools])
                    .policy(policy)
                    .timeout(timeout),
            )
            .await;
    }
}

/// `faults::assert_each_policy_fails` where each guard fails at once,
/// traced as failed with its cause `needle`.
async fn assert_each_policy_fails(world: &World, what: &str, rounds: u32, needle: &str) {
    assert_each_policy_fails_as(
        world,
        what,
        rounds,
        TraceStatus::Failed,
        needle,
        Duration::ZERO,
    )
    .await;
}

/// `faults::assert_each_policy_fails`, plus the virtual time each batch
/// took: `waited` exactly; each failed guard is traced `want`.
async fn assert_each_policy_fails_as(
    world: &World,
    what: &str,
    rounds: u32,
    want: TraceStatus,
    needle: &str,
    waited: Duration,
) {
    for round in 0..rounds {
        let what = format!("{what}, round {round}");
        let started = Instant::now();
        let d = world
            .evaluate(
                Batch::of(round, &[("a1", "a.x"), ("b1", "b.x"), ("z1", "z.x")]).timeout(secs(10)),
            )
            .await
            .unwrap_or_else(|e| panic!("{what}: every batch gets a decision: {e}"));
        world.took(started, waited, &format!("{what}: decided after"));
        assert_eq!(ids(&d), ["a1", "b1", "z1"], "{what}: R2");
        assert_failure_cancel(&d.decisions[0], "fc", &what);
        assert_bypassed(&d.decisions[1], "fo", &what);
        assert!(
            proceeds(&d.decisions[2]) && d.decisions[2].bypassed.is_empty(),
            "{what}: R6"
        );
        assert_eq!(executed(&d), ["b1", "z1"], "{what}");
        for guard in ["fc", "fo"] {
            assert_eq!(status(&d, guard), want, "{what}: {guard}");
            let error = &entry(&d, guard).error;
            assert!(
                error.contains(needle),
                "{what}: {guard}'s failure is traced with its cause ({needle:?}): {error:?}"
            );
        }
        assert_eq!(status(&d, "ab"), TraceStatus::NotApplicable, "{what}");

        let started = Instant::now();
        let err = world
            .evaluate(Batch::of(round, &[("c1", "c.x"), ("z2", "z.x")]).timeout(secs(10)))
            .await
            .expect_err("abort: no call proceeds");
        world.took(started, waited, &format!("{what}: aborted after"));
        assert!(matches!(err, BatchError::Aborted { .. }), "{what}: {err}");
        assert_eq!(err.status().code(), tonic::Code::Unavailable, "{what}");
        assert!(err.to_string().contains("\"ab\""), "{what}: {err}");
    }
}

// ---------------------------------------------------------------------------
// Unreachable guards
// ---------------------------------------------------------------------------

// ---------------------------------------------------------------------------
// Guards that close their stream
// ---------------------------------------------------------------------------

/// A guard that skips the first call in a partial answer `after`, then
/// ends its stream.
fn partial_then_close(after: Duration) -> impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync {
    move |b| {
        vec![
            Step::partial(b, vec![steer(&b.calls[0].call_id, "partial skip")]).after(after),
            Step::end().after(after),
        ]
    }
}

async fn partial_then_close_batch(
    transport: Transport,
    role_mutate: bool,
    policy: FailurePolicy,
) -> (Result<BatchDecision, BatchError>, Duration) {
    let world = World::on(transport);
    let (url, _guard) = world.guard(partial_then_close(ms(40)));
    let spec = if role_mutate {
        mutate("g", &url, &["t"])
    } else {
        validate("g", &url)
    };
    world.register(spec.policy(policy).timeout(secs(5))).await;
    let started = Instant::now();
    let result = world
        .evaluate(Batch::of(0, &[("c1", "t"), ("c2", "t"), ("c3", "t")]).timeout(secs(10)))
        .await;
    (result, started.elapsed())
}

/// The batch of [`partial_then_close_batch`] under `fail_closed` and
/// `fail_open`: decided when the stream ended, the skip sent kept.
async fn assert_partial_then_close_per_policy(transport: Transport, role_mutate: bool) {
    let role = if role_mutate { "mutate" } else { "validate" };
    for policy in [FailClosed, FailOpen] {
        let what = format!("{role} guard, {policy:?}");
        let (d, took) = partial_then_close_batch(transport, role_mutate, policy).await;
        let d = d.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_partial_then_close(&d, policy, &what);
        let when = format!("{what}: decided when the stream ended");
        transport.assert_took(took, ms(40), &when);
    }
}

fn assert_partial_then_close(d: &BatchDecision, policy: FailurePolicy, what: &str) {
    assert_eq!(ids(d), ["c1", "c2", "c3"], "{what}: R2");
    assert_skip(&d.decisions[0], "g", Action::Steer, "partial skip", what);
    for call in &d.decisions[1..] {
        match policy {
            FailClosed => assert_failure_cancel(call, "g", what),
            _ => assert_bypassed(call, "g", what),
        }
    }
    match policy {
        FailClosed => assert!(d.execute.is_empty(), "{what}"),
        _ => assert_eq!(executed(d), ["c2", "c3"], "{what}"),
    }
    assert_eq!(status(d, "g"), TraceStatus::Failed, "{what}");
    assert!(entry(d, "g").error.contains("closed its stream"), "{what}");
}

// ---------------------------------------------------------------------------
// Guards that hang, and deadlines (R14)
// ---------------------------------------------------------------------------

fn never(_: &GuardBatch) -> Vec<Step> {
    Vec::new()
}

/// A steer with `content` for each call of `b` that `which` picks.
fn steer_each(b: &GuardBatch, which: impl Fn(&ToolCall) -> bool, content: &str) -> Vec<Verdict> {
    b.calls
        .iter()
        .filter(|c| which(c))
        .map(|c| steer(&c.call_id, content))
        .collect()
}

/// Proceeds every call at once.
fn proceed_all(b: &GuardBatch) -> Vec<Step> {
    vec![Step::answer(b, Vec::new())]
}

/// Proceeds every call `after` the batch arrived.
fn proceed_after(after: Duration) -> impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync {
    move |b| vec![Step::answer(b, Vec::new()).after(after)]
}

// ---------------------------------------------------------------------------
// Spurious answers
// ---------------------------------------------------------------------------

fn spurious(world: &World, guard: &str) -> f64 {
    world.metric(&format!(
        "guardmesh_guard_spurious_answers_total{{guard=\"{guard}\"}}"
    ))
}

// ---------------------------------------------------------------------------
// Oversized answers, restarts
// ---------------------------------------------------------------------------

/// Paused-time version of
/// `faults::oversized_guard_answer_fails_that_guard_per_policy_then_it_reconnects`.
#[tokio::test(start_paused = true)]
async fn r13_oversized_guard_answer_fails_that_guard_per_policy_then_it_reconnects() {
    let world = World::with(|config| {
        restart_config(config);
        config.link.max_decoding_message_size = 64 * 1024;
    });
    let (url, guard) = world.guard(|b: &GuardBatch| {
        let verdicts = b
            .calls
            .iter()
            .filter_map(|c| {
                if c.arguments.contains("big") {
                    Some(steer(&c.call_id, &"x".repeat(100 * 1024)))
                } else if c.arguments.contains("deny") {
                    Some(steer(&c.call_id, "small"))
                } else {
                    None
                }
            })
            .collect();
        vec![Step::answer(b, verdicts)]
    });
    world
        .register(validate("fc", &url).tools(&["a.*"]).policy(FailClosed))
        .await;
    world
        .register(validate("fo", &url).tools(&["b.*"]).policy(FailOpen))
        .await;
    let normal = || {
        Batch::new(0)
            .call("a1", "a.x", r#"{"m":"deny"}"#)
            .call("b1", "b.x", r#"{"m":"deny"}"#)
    };
    let judged = |d: &BatchDecision| {
        d.decisions
            .iter()
            .all(|c| action(c) == Action::Steer && c.content == "small" && !c.failure)
    };
    let d = world.decision(normal()).await;
    assert!(judged(&d), "{:?}", d.decisions);
    for round in 0..2 {
        let what = format!("round {round}");
        let streams = guard.streams();
        let d = world
            .decision(
                Batch::new(1)
                    .call("a1", "a.x", r#"{"m":"big"}"#)
                    .call("b1", "b.x", r#"{"m":"big"}"#)
                    .call("z1", "z.x", "{}"),
            )
            .await;
        assert_failure_cancel(&d.decisions[0], "fc", &what);
        assert_bypassed(&d.decisions[1], "fo", &what);
        assert!(proceeds(&d.decisions[2]));
        assert_eq!(status(&d, "fc"), TraceStatus::Failed, "{what}");
        assert!(entry(&d, "fc").error.contains("too large"), "{what}");
        // Redialled after the first backoff step (reset: the stream had
        // answered), at most 20 ms; until then batches fail per policy.
        let down = Instant::now();
        let mut recovered = None;
        for _ in 0..200 {
            let d = world.decision(normal()).await;
            if judged(&d) {
                recovered = Some(down.elapsed());
                break;
            }
            // Each link redials on its own: a call is judged, or fails
            // per its guard's policy.
            for (call, guard) in d.decisions.iter().zip(["fc", "fo"]) {
                if call.content != "small" {
                    match guard {
                        "fc" => assert_failure_cancel(call, guard, &what),
                        _ => assert_bypassed(call, guard, &what),
                    }
                }
            }
            tokio::time::sleep(ms(20)).await;
        }
        let recovered = recovered.expect("the guard judges again after reconnecting");
        assert!(recovered <= ms(40), "{what}: recovered after {recovered:?}");
        assert_eq!(
            guard.streams(),
            streams + 2,
            "{what}: one new stream per link"
        );
    }
}

/// The `veto-marker` guard: steers every call whose arguments say "veto".
fn veto_marker(b: &GuardBatch) -> Vec<Step> {
    let verdicts = steer_each(b, |c| c.arguments.contains("veto"), "vetoed by marker");
    vec![Step::answer(b, verdicts)]
}

fn restart_round(turn: u32) -> Batch {
    Batch::new(turn)
        .call("a1", "a.x", r#"{"note":"veto"}"#)
        .call("a2", "a.x", "{}")
        .call("b1", "b.x", r#"{"note":"veto"}"#)
        .call("b2", "b.x", "{}")
        .timeout(ms(1500))
}

fn judged_by_marker(d: &BatchDecision) -> bool {
    let vetoed = |c: &CallDecision| action(c) == Action::Steer && c.content == "vetoed by marker";
    vetoed(&d.decisions[0])
        && proceeds(&d.decisions[1])
        && vetoed(&d.decisions[2])
        && proceeds(&d.decisions[3])
        && d.decisions
            .iter()
            .all(|c| !c.failure && c.bypassed.is_empty())
}

/// Paused-time version of
/// `faults::restart_killed_guard_process_fails_per_policy_while_down_then_judges_again`:
/// the half-open probe that finds it again goes exactly when the circuit
/// allows.
#[tokio::test(start_paused = true)]
async fn r15_killed_guard_fails_per_policy_while_down_then_judges_again() {
    let world = World::with(restart_config);
    let (url, guard) = world.guard(veto_marker);
    for (name, tools, policy) in [("closed", "a.*", FailClosed), ("open", "b.*", FailOpen)] {
        world
            .register(
                validate(name, &url)
                    .tools(&[tools])
                    .policy(policy)
                    .timeout(secs(10)),
            )
            .await;
    }
    let mut turn = 0;
    let d = world.decision(restart_round(turn)).await;
    assert!(judged_by_marker(&d), "{:?}", d.decisions);
    for cycle in 0..2 {
        guard.kill();
        for _ in 0..5 {
            turn += 1;
            let what = format!("cycle {cycle}, down, turn {turn}");
            let started = Instant::now();
            let d = world.decision(restart_round(turn)).await;
            assert_eq!(started.elapsed(), Duration::ZERO, "{what}: at once");
            assert_failure_cancel(&d.decisions[0], "closed", &what);
            assert_failure_cancel(&d.decisions[1], "closed", &what);
            assert_bypassed(&d.decisions[2], "open", &what);
            assert_bypassed(&d.decisions[3], "open", &what);
            assert_eq!(status(&d, "closed"), TraceStatus::Failed, "{what}");
        }
        // Five failures opened both circuits (300 ms) just now.
        guard.restart();
        let back = Instant::now();
        let mut recovered = None;
        for _ in 0..100 {
            turn += 1;
            let d = world.decision(restart_round(turn)).await;
            if judged_by_marker(&d) {
                recovered = Some(back.elapsed());
                break;
            }
            assert!(
                entry(&d, "closed").error.contains("circuit open"),
                "cycle {cycle}: {:?}",
                d.trace
            );
            tokio::time::sleep(ms(20)).await;
        }
        let recovered = recovered.expect("the mesh reconnects to the restarted guard");
        assert!(
            (ms(300)..=ms(320)).contains(&recovered),
            "cycle {cycle}: judged again by the first probe, after {recovered:?}"
        );
        for _ in 0..3 {
            turn += 1;
            let d = world.decision(restart_round(turn)).await;
            assert!(judged_by_marker(&d), "cycle {cycle}: {:?}", d.decisions);
        }
    }
}

// ---------------------------------------------------------------------------
// R23: a verdict the mesh cannot read is not a proceed
// ---------------------------------------------------------------------------

mod raw_pb {
    use prost::encoding::{WireType, encode_key, encode_varint};

    pub(super) fn bytes_field(out: &mut Vec<u8>, number: u32, payload: &[u8]) {
        encode_key(number, WireType::LengthDelimited, out);
        encode_varint(payload.len() as u64, out);
        out.extend_from_slice(payload);
    }

    pub(super) fn varint_field(out: &mut Vec<u8>, number: u32, value: u64) {
        encode_key(number, WireType::Varint, out);
        encode_varint(value, out);
    }

    /// A `Verdict` with `call_id` and the encoded `outcome` fields.
    pub(super) fn verdict(call_id: &str, outcome: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        bytes_field(&mut out, 1, call_id.as_bytes());
        out.extend_from_slice(outcome);
        out
    }

    /// A skip outcome (field 2) with `content` and `extra` fields inside.
    pub(super) fn skip_outcome(content: &str, extra: &[u8]) -> Vec<u8> {
        let mut skip = Vec::new();
        bytes_field(&mut skip, 1, content.as_bytes());
        skip.extend_from_slice(extra);
        let mut out = Vec::new();
        bytes_field(&mut out, 2, &skip);
        out
    }

    /// A `JudgeResponse` with `verdicts`, then `extra` fields.
    pub(super) fn judge_response(request_id: u64, verdicts: &[Vec<u8>], extra: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        varint_field(&mut out, 1, request_id);
        for verdict in verdicts {
            bytes_field(&mut out, 2, verdict);
        }
        out.extend_from_slice(extra);
        out
    }
}

// ---------------------------------------------------------------------------
// R25: busy is not failed; not reading is
// ---------------------------------------------------------------------------

/// Paused-time version of
/// `busy::r13_a_guard_that_takes_nothing_for_its_timeout_still_fails_as_not_reading`:
/// the first batch times out, and from the moment the queue has been
/// stuck for the guard's timeout, every batch fails at once as not reading.
#[tokio::test(start_paused = true)]
async fn r25_r13_a_guard_that_takes_nothing_for_its_timeout_fails_as_not_reading() {
    let world = World::with(|config| config.link.max_queued_bytes = 1 << 20);
    let (url, stuck) = world.proceed_guard();
    stuck.reading(false);
    world
        .register(validate("stuck", &url).policy(FailClosed).timeout(ms(300)))
        .await;
    let blob = format!(r#"{{"blob":"{}"}}"#, "x".repeat(256 * 1024));
    for round in 0..4u32 {
        let started = Instant::now();
        let d = world
            .evaluate(
                Batch::new(round)
                    .call("u", "upload", &blob)
                    .timeout(secs(10)),
            )
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_failure_cancel(&d.decisions[0], "stuck", &format!("round {round}"));
        let error = &entry(&d, "stuck").error;
        if round == 0 {
            assert_eq!(started.elapsed(), ms(300));
            assert_eq!(status(&d, "stuck"), TraceStatus::TimedOut);
        } else {
            assert_eq!(started.elapsed(), Duration::ZERO, "round {round}");
            assert!(error.contains("not reading"), "round {round}: {error}");
        }
    }
    assert_eq!(stuck.requests(), 0, "it took nothing");
}

/// Paused-time version of
/// `busy::r25_a_busy_guard_sheds_the_flooding_client_and_never_cancels_or_opens_its_circuit`.
#[tokio::test(start_paused = true)]
async fn r25_a_busy_guard_sheds_the_flooding_client_and_never_cancels_or_opens_its_circuit() {
    const FLOOD: usize = 16;
    let world = World::with(|config| config.link.max_queued_bytes = 64 * 1024);
    let (url, slow) = world.guard(|b: &GuardBatch| {
        let verdicts = steer_each(b, |c| c.tool == "forbidden", "not that one");
        vec![Step::answer(b, verdicts).after(ms(300))]
    });
    slow.serial();
    world
        .register(validate("slow", &url).policy(FailClosed).timeout(secs(20)))
        .await;
    let victim = |round: u32| {
        Batch::of(round, &[("bad", "forbidden"), ("ok", "read")])
            .timeout(secs(30))
            .client(2)
    };
    let assert_judged = |d: &BatchDecision, what: &str| {
        assert_skip(&d.decisions[0], "slow", Action::Steer, "not that one", what);
        assert!(proceeds(&d.decisions[1]), "{what}");
    };
    assert_judged(&world.decision(victim(0)).await, "before the flood");

    // 4 calls of 4 KB: a client's share (a quarter of 64 KiB) holds one.
    let blob = format!(r#"{{"blob":"{}"}}"#, "x".repeat(4000));
    let flood: Vec<_> = (0..FLOOD)
        .map(|i| {
            world.spawn(
                Batch::new(100 + i)
                    .call("u1", "upload", &blob)
                    .call("u2", "upload", &blob)
                    .call("u3", "upload", &blob)
                    .call("u4", "upload", &blob)
                    .timeout(secs(30))
                    .client(1),
            )
        })
        .collect();
    settle().await;
    for round in 1..=3 {
        let d = world.decision(victim(round)).await;
        assert_judged(&d, &format!("victim round {round} during the flood"));
    }
    let (mut shed, mut judged) = (0, 0);
    for (i, task) in flood.into_iter().enumerate() {
        match task.await.unwrap() {
            Ok(d) => {
                assert!(
                    d.decisions.iter().all(proceeds),
                    "flood {i}: never a cancel"
                );
                assert_eq!(status(&d, "slow"), TraceStatus::Proceeded, "flood {i}");
                judged += 1;
            }
            Err(e) => {
                assert!(matches!(e, BatchError::Shed { .. }), "flood {i}: {e}");
                assert_eq!(e.status().code(), tonic::Code::ResourceExhausted);
                let text = e.to_string();
                assert!(text.contains("slow") && text.contains("busy"), "{text}");
                shed += 1;
            }
        }
    }
    assert!(shed > 0 && judged > 0, "shed {shed}, judged {judged}");
    assert_eq!(
        world.metric("guardmesh_guard_circuit_opened_total{guard=\"slow\"}"),
        0.0
    );
    assert_eq!(
        world.metric("guardmesh_batches_refused_total{reason=\"guard_busy\"}"),
        f64::from(shed)
    );
    assert!(slow.cancels().is_empty(), "load never cancels a request");
    let d = world
        .decision(Batch::of(99, &[("bad", "forbidden"), ("ok", "read")]).client(1))
        .await;
    assert_judged(&d, "the flooding client after the flood");
}

// ---------------------------------------------------------------------------
// The circuit (R13)
// ---------------------------------------------------------------------------

/// Paused-time version of
/// `overload::circuit_opens_after_repeated_failures_and_fail_closed_still_blocks`:
/// the circuit holds for exactly its open period, then one probe closes it.
#[tokio::test(start_paused = true)]
async fn r13_circuit_opens_after_repeated_failures_and_fail_closed_still_blocks() {
    let world = World::with(|config| {
        config.link.circuit_failures = 3;
        config.link.circuit_open_for = ms(300);
    });
    let guard = world
        .guarded(|url| validate("hangs", url).timeout(ms(100)), never)
        .await;
    for turn in 0..3 {
        let d = world.decision(Batch::new(turn).call("c", "t", "{}")).await;
        assert_eq!(status(&d, "hangs"), TraceStatus::TimedOut);
    }
    let opened = Instant::now();
    let sent = guard.requests();
    let d = world.decision(Batch::new(3).call("c", "t", "{}")).await;
    assert_eq!(opened.elapsed(), Duration::ZERO, "no wait while open");
    assert_eq!(status(&d, "hangs"), TraceStatus::Failed);
    assert!(entry(&d, "hangs").error.contains("circuit open"));
    assert_failure_cancel(&d.decisions[0], "hangs", "open circuit");
    assert_eq!(guard.requests(), sent, "not contacted while open");
    assert_eq!(
        world.metric("guardmesh_guard_circuit_opened_total{guard=\"hangs\"}"),
        1.0
    );
    // The guard recovers; still refused until the open period is over.
    guard.set_script(proceed_all);
    tokio::time::sleep(ms(299)).await;
    let d = world.decision(Batch::new(4).call("c", "t", "{}")).await;
    assert!(entry(&d, "hangs").error.contains("circuit open"));
    assert_eq!(guard.requests(), sent);
    tokio::time::sleep(ms(1)).await;
    let d = world.decision(Batch::new(5).call("c", "t", "{}")).await;
    assert!(proceeds(&d.decisions[0]), "the probe: {:?}", d.trace);
    let d = world.decision(Batch::new(6).call("c", "t", "{}")).await;
    assert!(proceeds(&d.decisions[0]), "closed");
    assert_eq!(guard.requests(), sent + 2);
}

/// Paused-time version of
/// `overload::circuit_open_under_fail_open_is_recorded_as_bypass`.
#[tokio::test(start_paused = true)]
async fn r13_circuit_open_under_fail_open_is_recorded_as_bypass() {
    let world = World::with(|config| {
        config.link.circuit_failures = 2;
        config.link.circuit_open_for = secs(60);
    });
    let down = world.closed_port();
    world
        .register(validate("down", &down).policy(FailOpen))
        .await;
    let mut open = Vec::new();
    for turn in 0..10 {
        let d = world.decision(Batch::new(turn).call("c", "t", "{}")).await;
        assert_bypassed(&d.decisions[0], "down", &format!("turn {turn}"));
        open.push(entry(&d, "down").error.contains("circuit open"));
        tokio::time::sleep(ms(10)).await;
    }
    // Two failures open it; it stays open for the rest (60 s).
    assert_eq!(open[..2], [false, false]);
    assert!(open[2..].iter().all(|o| *o), "{open:?}");
}

// ---------------------------------------------------------------------------
// Order and early answers (R1, R3-R5, R8, R9, R12, R17)
// ---------------------------------------------------------------------------

// ---------------------------------------------------------------------------
// Scenarios on both transports
// ---------------------------------------------------------------------------

on_both_transports!(
    r13_closed_port_blocks_under_fail_closed_and_is_bypassed_under_fail_open,
    r13_endpoint_that_refuses_the_judge_stream_blocks_under_fail_closed,
    r13_r15_guard_closes_stream_with_ok_without_answering_fails_per_policy,
    r13_guard_closes_stream_with_an_error_fails_per_policy,
    r13_guard_closes_stream_mid_batch_answered_call_keeps_its_verdict_pending_calls_fail,
    r12_r13_guard_closes_stream_mid_batch_mutate_guard_keeps_the_skip_it_sent,
    r14_hang_guard_fails_at_its_own_timeout_and_is_told_to_stop,
    r14_hang_batch_deadline_smaller_than_the_guard_timeout_bounds_the_guard,
    r14_hang_unary_batch_gets_a_decision_at_its_deadline,
    r10_r14_remaining_batch_budget_shrinks_across_mutate_guards,
    r14_exhausted_batch_budget_fails_later_guards_without_contacting_them,
    r14_guard_gets_the_smaller_of_its_timeout_and_the_batch_deadline,
    r8_spurious_late_verdict_for_a_decided_batch_is_ignored_and_counted,
    r8_spurious_answers_for_unknown_request_ids_are_ignored_and_counted,
    r7_unknown_skip_kind_is_still_a_skip_read_as_steer,
    r13_abort_guard_failure_is_counted_in_guard_outcomes,
    r13_each_failure_cause_under_each_policy,
    r1_zero_calls_contact_no_guard,
    r3_r4_slow_early_skip_beats_fast_later_skip,
    r8_malformed_verdicts_are_dropped_and_traced,
    r9_guard_receives_only_the_calls_it_applies_to,
    r12_a_mutate_skip_is_final_and_later_guards_never_see_the_call,
    r17_registration_during_a_batch_applies_from_the_next,
    r13_guard_killed_with_a_batch_in_flight_fails_that_batch_at_once,
    r15_a_killed_guard_keeps_failing_until_deregistered,
    r9_r19_held_guard_for_some_tools_does_not_delay_batches_that_do_not_need_it,
    r5_early_veto_answers_and_cancels_the_slow_later_guard,
    r23_unknown_verdict_outcome_fails_the_guard_per_its_policy,
    r23_unknown_fields_outside_a_verdict_are_ignored,
    r23_unknown_rewrite_field_fails_a_mutate_guard_and_nothing_is_rewritten,
);

/// The scenarios run on both transports, each written once.
mod scenarios {
    use super::*;

    /// The chain of the R14 budget scenarios, each guard given 20 s: mutate
    /// guards `m1` (scripted `first`) and `m2` (proceeds), granted `t`,
    /// under `policies`; then validate guard `v` (proceeds).
    async fn budget_chain(
        world: &World,
        first: impl Fn(&GuardBatch) -> Vec<Step> + Send + Sync + 'static,
        policies: [FailurePolicy; 2],
    ) -> [Arc<ScriptedGuard>; 3] {
        let [p1, p2] = policies;
        let m1 = |url: &str| mutate("m1", url, &["t"]).policy(p1).timeout(secs(20));
        let m2 = |url: &str| mutate("m2", url, &["t"]).policy(p2).timeout(secs(20));
        [
            world.guarded(m1, first).await,
            world.guarded(m2, proceed_all).await,
            world
                .guarded(|url| validate("v", url).timeout(secs(20)), proceed_all)
                .await,
        ]
    }

    /// Mirrors
    /// `faults::unreachable_guard_closed_port_blocks_under_fail_closed_and_is_bypassed_under_fail_open`:
    /// every round fails per policy at once, never at a timeout.
    pub(super) async fn r13_closed_port_blocks_under_fail_closed_and_is_bypassed_under_fail_open(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let url = world.closed_port();
        register_each_policy(&world, &url, secs(2)).await;
        assert_each_policy_fails(&world, "closed port", 4, "unreachable").await;
    }

    /// Mirrors
    /// `faults::unreachable_guard_endpoint_that_is_not_grpc_blocks_under_fail_closed`:
    /// a peer that accepts the connection but refuses the `Judge` stream.
    pub(super) async fn r13_endpoint_that_refuses_the_judge_stream_blocks_under_fail_closed(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (url, guard) = world.guard(proceed_all);
        for _ in 0..100 {
            guard.refuse_stream(tonic::Status::unimplemented("not a guard"));
        }
        register_each_policy(&world, &url, ms(300)).await;
        assert_each_policy_fails(&world, "not a guard", 3, "not a guard").await;
        assert_eq!(guard.streams(), 0, "no stream was ever opened");
        assert_eq!(guard.requests(), 0);
    }

    /// Mirrors
    /// `faults::guard_closes_stream_with_ok_without_answering_fails_per_policy`.
    pub(super) async fn r13_r15_guard_closes_stream_with_ok_without_answering_fails_per_policy(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (url, guard) = world.guard(|_| vec![Step::end()]);
        register_each_policy(&world, &url, secs(5)).await;
        assert_each_policy_fails(&world, "closed with OK", 3, "closed its stream").await;
        // R15: the mesh keeps redialling a guard that closes on it.
        let streams = guard.streams();
        tokio::time::sleep(secs(1)).await;
        assert!(
            guard.streams() > streams && streams >= 3,
            "the mesh reopens the guard's streams: {streams} then {}",
            guard.streams()
        );
    }

    /// Mirrors
    /// `faults::guard_closes_stream_with_an_error_fails_per_policy`.
    pub(super) async fn r13_guard_closes_stream_with_an_error_fails_per_policy(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (url, _guard) =
            world.guard(|_| vec![Step::fail(tonic::Status::internal("guard exploded"))]);
        register_each_policy(&world, &url, secs(5)).await;
        assert_each_policy_fails(&world, "closed with an error", 3, "guard exploded").await;
    }

    /// Mirrors
    /// `faults::guard_closes_stream_mid_batch_answered_call_keeps_its_verdict_pending_calls_fail`.
    pub(super) async fn r13_guard_closes_stream_mid_batch_answered_call_keeps_its_verdict_pending_calls_fail(
        transport: Transport,
    ) {
        assert_partial_then_close_per_policy(transport, false).await;
        let (err, took) = partial_then_close_batch(transport, false, Abort).await;
        let err = err.expect_err("abort: the whole batch is refused");
        assert_eq!(err.status().code(), tonic::Code::Unavailable, "{err}");
        assert!(err.to_string().contains("\"g\""), "{err}");
        transport.assert_took(took, ms(40), "abort");
    }

    /// Mirrors
    /// `faults::guard_closes_stream_mid_batch_mutate_guard_keeps_the_skip_it_sent`.
    pub(super) async fn r12_r13_guard_closes_stream_mid_batch_mutate_guard_keeps_the_skip_it_sent(
        transport: Transport,
    ) {
        assert_partial_then_close_per_policy(transport, true).await;
    }

    /// Mirrors
    /// `faults::hang_guard_fails_at_its_own_timeout_and_is_told_to_stop`.
    pub(super) async fn r14_hang_guard_fails_at_its_own_timeout_and_is_told_to_stop(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (url, hung) = world.guard(never);
        register_each_policy(&world, &url, ms(200)).await;
        assert_each_policy_fails_as(
            &world,
            "hung guard",
            2,
            TraceStatus::TimedOut,
            "did not answer",
            ms(200),
        )
        .await;
        world.settle().await;
        let sent = hung.requests();
        assert_eq!(sent, 2 * 3, "fc and fo once per round, ab once per round");
        for batch in hung.batches() {
            world.told(batch.deadline_ms, 200, "R14: the guard is told its timeout");
        }
        let mut cancelled = hung.cancels();
        cancelled.sort_unstable();
        let mut request_ids: Vec<u64> = hung.batches().iter().map(|b| b.request_id).collect();
        request_ids.sort_unstable();
        assert_eq!(cancelled, request_ids, "every request was withdrawn");
        assert_eq!(hung.answered(), 0);
    }

    /// Mirrors
    /// `faults::hang_batch_deadline_smaller_than_the_guard_timeout_bounds_the_guard`.
    pub(super) async fn r14_hang_batch_deadline_smaller_than_the_guard_timeout_bounds_the_guard(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (url, hung) = world.guard(never);
        register_each_policy(&world, &url, secs(20)).await;
        let started = Instant::now();
        let d = world
            .evaluate(Batch::of(0, &[("a1", "a.x"), ("b1", "b.x")]).timeout(ms(400)))
            .await
            .expect("a decision, not DEADLINE_EXCEEDED");
        world.took(started, ms(400), "decided after");
        assert_failure_cancel(&d.decisions[0], "fc", "batch deadline");
        assert_bypassed(&d.decisions[1], "fo", "batch deadline");
        assert_eq!(status(&d, "fc"), TraceStatus::TimedOut);
        assert_eq!(status(&d, "fo"), TraceStatus::TimedOut);
        let batches = hung.batches();
        assert_eq!(batches.len(), 2);
        for batch in &batches {
            world.told(
                batch.deadline_ms,
                400,
                "R14: the smaller of 20 s and 400 ms",
            );
        }
    }

    /// Mirrors
    /// `faults::hang_unary_batch_gets_a_decision_before_its_grpc_deadline`.
    pub(super) async fn r14_hang_unary_batch_gets_a_decision_at_its_deadline(transport: Transport) {
        let world = World::on(transport);
        let _hung = world
            .guarded(
                |url| validate("fc", url).policy(FailClosed).timeout(secs(20)),
                never,
            )
            .await;
        for turn in 0..3 {
            let mut batch = Batch::new(turn).call("a1", "a.x", "{}").timeout(ms(500));
            batch.unary = true;
            let started = Instant::now();
            let d = world
                .evaluate(batch)
                .await
                .unwrap_or_else(|e| panic!("turn {turn}: a decision, not {e}"));
            world.took(started, ms(500), &format!("turn {turn}"));
            assert_failure_cancel(&d.decisions[0], "fc", "unary");
            assert_eq!(status(&d, "fc"), TraceStatus::TimedOut);
        }
    }

    /// Mirrors
    /// `faults::hang_remaining_batch_budget_shrinks_across_mutate_guards`: the
    /// budgets are exact.
    pub(super) async fn r10_r14_remaining_batch_budget_shrinks_across_mutate_guards(
        transport: Transport,
    ) {
        let world = World::on(transport);
        // The default policy (fail_closed), as the test mirrored.
        let policies = [FailClosed; 2];
        let [first, second, v] = budget_chain(&world, proceed_after(ms(300)), policies).await;
        let d = world
            .decision_after(Batch::one(0).timeout(secs(3)), ms(300), "decided after")
            .await;
        assert!(proceeds(&d.decisions[0]), "{:?}", d.decisions[0]);
        // R10: the second is asked once the first has answered.
        transport.assert_took(
            second.read_at()[0] - first.read_at()[0],
            ms(300),
            "R10: the second once the first answered",
        );
        world.told(first.batches()[0].deadline_ms, 3000, "R14");
        world.told(second.batches()[0].deadline_ms, 2700, "R14");
        world.told(v.batches()[0].deadline_ms, 2700, "R14");
    }

    /// Mirrors
    /// `faults::hang_exhausted_batch_budget_fails_later_guards_without_contacting_them`.
    pub(super) async fn r14_exhausted_batch_budget_fails_later_guards_without_contacting_them(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let [hung, later, v] = budget_chain(&world, never, [FailOpen, FailClosed]).await;
        let d = world
            .decision_after(Batch::one(0).timeout(ms(400)), ms(400), "decided after")
            .await;
        let call = &d.decisions[0];
        assert_failure_cancel(call, "m2", "exhausted budget");
        assert_eq!(call.bypassed, ["m1"], "{call:?}");
        assert_eq!(status(&d, "m1"), TraceStatus::TimedOut);
        assert_eq!(status(&d, "m2"), TraceStatus::TimedOut);
        assert_eq!(status(&d, "v"), TraceStatus::NotApplicable);
        assert_eq!(hung.requests(), 1);
        assert_eq!(later.requests(), 0, "no budget left: not contacted");
        assert_eq!(v.requests(), 0);
    }

    /// Mirrors
    /// `rules::r14_guard_gets_the_smaller_of_its_timeout_and_the_batch_deadline`.
    pub(super) async fn r14_guard_gets_the_smaller_of_its_timeout_and_the_batch_deadline(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (url, slow) = world.guard(proceed_after(ms(3000)));
        // (turn, the guard's timeout, the batch's, the one that bounds it)
        let rounds = [(0, secs(20), ms(300), 300), (1, ms(100), secs(20), 100)];
        for (turn, guard, batch, want) in rounds {
            world.register(validate("slow", &url).timeout(guard)).await;
            let want_ms = ms(u64::from(want));
            let d = world
                .decision_after(Batch::one(turn).timeout(batch), want_ms, "decided after")
                .await;
            assert_eq!(status(&d, "slow"), TraceStatus::TimedOut, "turn {turn}");
            assert!(d.decisions[0].failure, "turn {turn}");
            world.told(slow.batches()[turn].deadline_ms, want, "R14");
        }
    }

    /// Mirrors
    /// `faults::spurious_late_verdict_for_a_decided_batch_is_ignored_and_counted`.
    pub(super) async fn r8_spurious_late_verdict_for_a_decided_batch_is_ignored_and_counted(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let ids: Arc<Mutex<Vec<u64>>> = Arc::default();
        let (url, guard) = world.guard({
            let ids = ids.clone();
            move |b: &GuardBatch| {
                let mut ids = ids.lock().unwrap();
                ids.push(b.request_id);
                let call = b.calls[0].call_id.clone();
                match b.batch_id.as_str() {
                    "b1" => Vec::new(),
                    "b2" => vec![
                        Step::answer_to(ids[0], vec![proceed("c1")], false),
                        Step::answer(b, vec![steer(&call, "b2 skipped")]),
                    ],
                    "b3" => vec![
                        Step::answer(b, vec![steer(&call, "b3 skipped")]),
                        Step::answer(b, vec![proceed(&call)]),
                    ],
                    _ => vec![Step::answer(b, Vec::new())],
                }
            }
        });
        guard.ignore_cancels();
        world
            .register(validate("late", &url).policy(FailClosed).timeout(ms(200)))
            .await;
        let batch = |n: u32| Batch::one(n).timeout(secs(10));
        let d1 = world.decision(batch(1)).await;
        assert_failure_cancel(&d1.decisions[0], "late", "b1");
        assert_eq!(status(&d1, "late"), TraceStatus::TimedOut);
        assert_eq!(spurious(&world, "late"), 0.0);

        let d2 = world.decision(batch(2)).await;
        assert_skip(&d2.decisions[0], "late", Action::Steer, "b2 skipped", "b2");
        assert_eq!(spurious(&world, "late"), 1.0, "b1's late answer is counted");

        let d3 = world.decision(batch(3)).await;
        assert_skip(&d3.decisions[0], "late", Action::Steer, "b3 skipped", "b3");
        world.settle().await;
        assert_eq!(
            spurious(&world, "late"),
            2.0,
            "the second answer is counted"
        );
        let d4 = world.decision(batch(4)).await;
        assert!(proceeds(&d4.decisions[0]), "the stream goes on");
        assert_eq!(status(&d4, "late"), TraceStatus::Proceeded);
        assert_eq!(
            guard.cancels(),
            [ids.lock().unwrap()[0]],
            "b1 was withdrawn"
        );
    }

    /// Mirrors
    /// `faults::spurious_answers_for_unknown_request_ids_are_ignored_and_counted`.
    pub(super) async fn r8_spurious_answers_for_unknown_request_ids_are_ignored_and_counted(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (url, _guard) = world.guard(|b: &GuardBatch| {
            let all_proceed: Vec<_> = b.calls.iter().map(|c| proceed(&c.call_id)).collect();
            let all_skip: Vec<_> = b.calls.iter().map(|c| steer(&c.call_id, "noise")).collect();
            let mut steps = vec![
                Step::answer_to(0, all_proceed.clone(), false),
                Step::answer_to(b.request_id + 1_000_000, all_proceed.clone(), false),
                Step::answer_to(b.request_id + 2_000_000, all_skip, true),
                Step::Answer {
                    after: Duration::ZERO,
                    response: guardmesh_proto::v1::JudgeResponse {
                        request_id: b.request_id + 3_000_000,
                        error: "noise error".into(),
                        ..Default::default()
                    },
                },
                Step::answer_to(u64::MAX, all_proceed, false),
            ];
            let verdicts = steer_each(b, |c| c.tool == "deny", "real skip");
            steps.push(Step::answer(b, verdicts));
            steps
        });
        world.register(validate("g", &url).timeout(secs(5))).await;
        for turn in 0..3u32 {
            let d = world
                .decision(Batch::of(turn, &[("c1", "deny"), ("c2", "ok")]))
                .await;
            assert_skip(
                &d.decisions[0],
                "g",
                Action::Steer,
                "real skip",
                "unknown ids",
            );
            assert!(proceeds(&d.decisions[1]));
            assert_eq!(status(&d, "g"), TraceStatus::Skipped);
            assert_eq!(spurious(&world, "g"), f64::from(5 * (turn + 1)));
        }
    }

    /// Mirrors
    /// `faults::spurious_unknown_skip_kind_is_still_a_skip_read_as_steer`.
    pub(super) async fn r7_unknown_skip_kind_is_still_a_skip_read_as_steer(transport: Transport) {
        for mutating in [false, true] {
            let world = World::on(transport);
            let (url, _guard) = world.guard(|b: &GuardBatch| {
                let verdicts = b
                    .calls
                    .iter()
                    .filter_map(|c| {
                        let kind = match c.tool.as_str() {
                            "seven" => 7,
                            "negative" => -3,
                            "max" => i32::MAX,
                            _ => return None,
                        };
                        Some(skip(&c.call_id, &format!("kind {kind}"), kind))
                    })
                    .collect();
                vec![Step::answer(b, verdicts)]
            });
            let spec = if mutating {
                mutate("g", &url, &["*"])
            } else {
                validate("g", &url)
            };
            world.register(spec.policy(FailOpen)).await;
            let d = world
                .decision(Batch::of(
                    0,
                    &[
                        ("c1", "seven"),
                        ("c2", "negative"),
                        ("c3", "max"),
                        ("c4", "fine"),
                    ],
                ))
                .await;
            let what = if mutating { "mutate" } else { "validate" };
            for (call, kind) in d.decisions.iter().zip([7, -3, i32::MAX]) {
                assert_skip(call, "g", Action::Steer, &format!("kind {kind}"), what);
                assert!(call.bypassed.is_empty(), "{what}");
            }
            assert!(proceeds(&d.decisions[3]));
            assert_eq!(status(&d, "g"), TraceStatus::Skipped, "{what}");
            assert_eq!(executed(&d), ["c4"], "{what}");
        }
    }

    /// Mirrors
    /// `faults::r13_abort_guard_failure_is_counted_in_guard_outcomes`.
    pub(super) async fn r13_abort_guard_failure_is_counted_in_guard_outcomes(transport: Transport) {
        let world = World::on(transport);
        let down = world.closed_port();
        world
            .register(mutate("mab", &down, &["m.*"]).tools(&["m.*"]).policy(Abort))
            .await;
        let _fine = world
            .guarded(|url| validate("fine", url), proceed_all)
            .await;
        world
            .register(validate("ab", &down).tools(&["c.*"]).policy(Abort))
            .await;
        for (tool, guard) in [("c.x", "ab"), ("m.x", "mab")] {
            let err = world
                .evaluate(Batch::new(0).call("c1", tool, "{}"))
                .await
                .expect_err("abort");
            assert!(err.to_string().contains(&format!("{guard:?}")), "{err}");
            let failed = world.metric(&format!(
                "guardmesh_guard_outcomes_total{{guard=\"{guard}\",status=\"failed\"}}"
            ));
            assert_eq!(failed, 1.0, "{guard}");
        }
        let fine: f64 = ["proceeded", "superseded"]
            .iter()
            .map(|s| {
                world.metric(&format!(
                    "guardmesh_guard_outcomes_total{{guard=\"fine\",status=\"{s}\"}}"
                ))
            })
            .sum();
        assert_eq!(fine, 1.0);
        assert_eq!(
            world.metric("guardmesh_batches_total{outcome=\"aborted\"}"),
            2.0
        );
    }

    /// Mirrors `rules::r13_each_failure_cause_under_each_policy`.
    pub(super) async fn r13_each_failure_cause_under_each_policy(transport: Transport) {
        type Cause = (&'static str, fn(&GuardBatch) -> Vec<Step>);
        let causes: [Cause; 5] = [
            ("unreachable", |_| Vec::new()),
            ("error answer", |b| vec![Step::error(b, "database down")]),
            ("stream error", |_| {
                vec![Step::fail(tonic::Status::internal("guard exploded"))]
            }),
            ("stream closed", |_| vec![Step::end()]),
            ("timeout", never),
        ];
        for (cause, script) in causes {
            for policy in [FailClosed, FailOpen, Abort] {
                let what = format!("{cause} under {policy:?}");
                let world = World::on(transport);
                let url = if cause == "unreachable" {
                    world.closed_port()
                } else {
                    world.guard(script).0
                };
                world
                    .register(
                        validate("flaky", &url)
                            .policy(policy)
                            .timeout(ms(200))
                            .tools(&["db.*"]),
                    )
                    .await;
                let _ok = world.guarded(|url| validate("ok", url), proceed_all).await;
                let started = Instant::now();
                let result = world
                    .evaluate(Batch::of(0, &[("c1", "db.query"), ("c2", "fs.read")]))
                    .await;
                let waited = if cause == "timeout" {
                    ms(200)
                } else {
                    Duration::ZERO
                };
                world.took(started, waited, &what);
                match policy {
                    FailClosed => {
                        let d = result.unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_failure_cancel(&d.decisions[0], "flaky", &what);
                        assert!(proceeds(&d.decisions[1]), "{what}: R6");
                        let want = if cause == "timeout" {
                            TraceStatus::TimedOut
                        } else {
                            TraceStatus::Failed
                        };
                        assert_eq!(status(&d, "flaky"), want, "{what}");
                        assert!(!entry(&d, "flaky").error.is_empty(), "{what}");
                    }
                    FailOpen => {
                        let d = result.unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_bypassed(&d.decisions[0], "flaky", &what);
                        assert!(d.decisions[1].bypassed.is_empty(), "{what}");
                        assert_ne!(status(&d, "flaky"), TraceStatus::Proceeded, "{what}");
                    }
                    Abort => {
                        let err = result.expect_err(&what);
                        assert_eq!(err.status().code(), tonic::Code::Unavailable, "{what}");
                        assert!(err.to_string().contains("flaky"), "{what}: {err}");
                        let d = world
                            .decision(Batch::new(1).call("c3", "fs.read", "{}"))
                            .await;
                        assert!(proceeds(&d.decisions[0]), "{what}");
                    }
                }
            }
        }
    }

    /// Mirrors `rules::r1_zero_calls_contact_no_guard`.
    pub(super) async fn r1_zero_calls_contact_no_guard(transport: Transport) {
        let world = World::on(transport);
        let guard = world.guarded(|url| validate("g", url), proceed_all).await;
        let d = world.decision(Batch::new(0)).await;
        assert!(d.decisions.is_empty() && d.execute.is_empty());
        assert_eq!(status(&d, "g"), TraceStatus::NotApplicable);
        world.settle().await;
        assert_eq!(guard.requests(), 0, "zero calls contact no guard");
        world.decision(Batch::one(1)).await;
        assert_eq!(guard.requests(), 1);
    }

    /// Mirrors `rules::r3_r4_slow_early_skip_beats_fast_later_skip`.
    pub(super) async fn r3_r4_slow_early_skip_beats_fast_later_skip(transport: Transport) {
        let world = World::on(transport);
        let (early_url, _early) = world.guard(|b| {
            vec![
                Step::answer(b, vec![steer(&b.calls[0].call_id, "early guard says no")])
                    .after(ms(300)),
            ]
        });
        let (late_url, _late) = world.guard(|b| {
            vec![Step::answer(
                b,
                vec![cancel(&b.calls[0].call_id, "late guard says no")],
            )]
        });
        world.register(validate("early", &early_url)).await;
        world.register(validate("late", &late_url)).await;
        for turn in 0..3 {
            let d = world
                .decision_after(Batch::one(turn), ms(300), "waits for the earlier guard")
                .await;
            assert_skip(
                &d.decisions[0],
                "early",
                Action::Steer,
                "early guard says no",
                "chain order decides, not answer order",
            );
            assert_eq!(status(&d, "early"), TraceStatus::Skipped);
            assert_eq!(status(&d, "late"), TraceStatus::Skipped);
        }
    }

    /// Mirrors `rules::r8_malformed_verdicts_are_dropped_and_traced`.
    pub(super) async fn r8_malformed_verdicts_are_dropped_and_traced(transport: Transport) {
        let world = World::on(transport);
        let (url, _buggy) = world.guard(|b: &GuardBatch| {
            let mut verdicts = Vec::new();
            for c in &b.calls {
                match c.call_id.as_str() {
                    "blank" => verdicts.push(steer(&c.call_id, "   ")),
                    "twice" => {
                        verdicts.push(proceed(&c.call_id));
                        verdicts.push(cancel(&c.call_id, "second verdict"));
                    }
                    _ => {}
                }
            }
            verdicts.push(steer("never-sent", "unknown call id"));
            vec![Step::answer(b, verdicts)]
        });
        world.register(validate("buggy", &url)).await;
        let _later = world
            .guarded(|url| validate("later", url), proceed_all)
            .await;
        let d = world
            .decision(Batch::of(0, &[("blank", "t"), ("twice", "t")]))
            .await;
        assert!(proceeds(&d.decisions[0]), "a blank skip counts as proceed");
        assert!(proceeds(&d.decisions[1]), "the second verdict is ignored");
        assert_eq!(status(&d, "buggy"), TraceStatus::Malformed);
        assert_eq!(status(&d, "later"), TraceStatus::Proceeded);
        let error = &entry(&d, "buggy").error;
        for needle in ["blank", "second verdict", "never-sent"] {
            assert!(error.contains(needle), "{needle} in {error:?}");
        }
    }

    /// Mirrors `rules::r9_guard_receives_only_the_calls_it_applies_to`.
    pub(super) async fn r9_guard_receives_only_the_calls_it_applies_to(transport: Transport) {
        let world = World::on(transport);
        let sql = world
            .guarded(|url| validate("sql", url).tools(&["sql.*"]), proceed_all)
            .await;
        let files = world
            .guarded(
                |url| validate("files", url).tools(&["fs.read", "fs.write"]),
                proceed_all,
            )
            .await;
        let none = world
            .guarded(
                |url| validate("none", url).tools(&["payments.*"]),
                proceed_all,
            )
            .await;
        let d = world
            .decision(
                Batch::new(0)
                    .call("q", "sql.query", r#"{"sql":"SELECT 1"}"#)
                    .call("r", "fs.read", "{}")
                    .call("x", "shell", "{}"),
            )
            .await;
        let got = |g: &ScriptedGuard| -> Vec<String> {
            g.batches()[0]
                .calls
                .iter()
                .map(|c| c.call_id.clone())
                .collect()
        };
        assert_eq!(got(&sql), ["q"]);
        assert_eq!(got(&files), ["r"]);
        assert_eq!(none.requests(), 0);
        assert_eq!(status(&d, "none"), TraceStatus::NotApplicable);
        assert!(d.decisions.iter().all(proceeds));
    }

    /// Mirrors
    /// `rewrites::r12_a_mutate_skip_is_final_and_later_guards_never_see_the_call`.
    pub(super) async fn r12_a_mutate_skip_is_final_and_later_guards_never_see_the_call(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (m_url, _m) = world.guard(|b: &GuardBatch| {
            let verdicts = b
                .calls
                .iter()
                .map(|c| match c.call_id.as_str() {
                    "c1" => steer("c1", "mutate says no"),
                    _ => rewrite(&c.call_id, None, Some(r#"{"safe":true}"#)),
                })
                .collect();
            vec![Step::answer(b, verdicts)]
        });
        world.register(mutate("m", &m_url, &["t"])).await;
        let v = world.guarded(|url| validate("v", url), proceed_all).await;
        let d = world
            .decision(Batch::of(0, &[("c1", "t"), ("c2", "t")]))
            .await;
        assert_skip(&d.decisions[0], "m", Action::Steer, "mutate says no", "c1");
        assert!(proceeds(&d.decisions[1]));
        assert_eq!(d.decisions[1].rewritten_by, ["m"]);
        assert_eq!(
            d.decisions[1].call.as_ref().map(|c| c.arguments.as_str()),
            Some(r#"{"safe":true}"#)
        );
        assert_eq!(
            d.decisions[1]
                .original
                .as_ref()
                .map(|c| c.arguments.as_str()),
            Some("{}"),
            "R12: the original is kept"
        );
        let seen: Vec<_> = v.batches()[0]
            .calls
            .iter()
            .map(|c| c.call_id.clone())
            .collect();
        assert_eq!(
            seen,
            ["c2"],
            "the validate guard never sees the skipped call"
        );
        assert_eq!(v.batches()[0].calls[0].arguments, r#"{"safe":true}"#);
    }

    /// Mirrors
    /// `rules::r17_registration_during_a_batch_applies_from_the_next`.
    pub(super) async fn r17_registration_during_a_batch_applies_from_the_next(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (veto_url, veto) = world.guard(|b| {
            vec![Step::answer(
                b,
                vec![cancel(&b.calls[0].call_id, "new guard")],
            )]
        });
        let slow = world
            .guarded(|url| validate("slow", url), proceed_after(ms(500)))
            .await;
        let in_flight = world.spawn(Batch::new(0).call("c", "t", "{}"));
        world.settle().await;
        assert_eq!(slow.requests(), 1);
        world
            .register(validate("veto", &veto_url).priority(-1))
            .await;
        let d = in_flight.await.unwrap().unwrap();
        assert!(
            proceeds(&d.decisions[0]),
            "judged with the chain it started with"
        );
        assert_eq!(d.trace.len(), 1);
        let next = world.decision(Batch::new(1).call("c", "t", "{}")).await;
        assert_eq!(next.decisions[0].decided_by, "veto");
        assert_eq!(next.trace.len(), 2);
        assert!(next.chain_revision > d.chain_revision);
        assert_eq!(veto.requests(), 1);
    }

    /// Mirrors
    /// `faults::restart_guard_process_killed_with_a_batch_in_flight_fails_that_batch_per_policy`.
    pub(super) async fn r13_guard_killed_with_a_batch_in_flight_fails_that_batch_at_once(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (proc_url, process) = world.guard(proceed_after(ms(20_000)));
        world
            .register(
                validate("proc", &proc_url)
                    .policy(FailClosed)
                    .timeout(secs(30)),
            )
            .await;
        let probe = world
            .guarded(|url| validate("probe", url), proceed_all)
            .await;
        let started = Instant::now();
        let batch = world.spawn(Batch::one(0).timeout(secs(30)));
        world.sleep_at_least(ms(10)).await;
        assert_eq!((probe.requests(), process.requests()), (1, 1));
        assert!(!batch.is_finished());
        process.kill();
        let d = batch.await.unwrap().expect("a decision, not an error");
        world.took(started, ms(10), "at once, not at its deadline");
        assert_failure_cancel(&d.decisions[0], "proc", "killed mid-batch");
        assert_eq!(status(&d, "proc"), TraceStatus::Failed);
    }

    /// Mirrors
    /// `rules::r15_a_killed_guard_keeps_failing_until_deregistered`.
    pub(super) async fn r15_a_killed_guard_keeps_failing_until_deregistered(transport: Transport) {
        let world = World::on(transport);
        let guard = world
            .guarded(|url| validate("g", url).timeout(ms(300)), proceed_all)
            .await;
        let d = world.decision(Batch::new(0).call("c", "t", "{}")).await;
        assert_eq!(status(&d, "g"), TraceStatus::Proceeded);
        guard.kill();
        for turn in 1..5 {
            let d = world.decision(Batch::new(turn).call("c", "t", "{}")).await;
            assert_failure_cancel(&d.decisions[0], "g", &format!("turn {turn}"));
            assert_eq!(status(&d, "g"), TraceStatus::Failed);
            tokio::time::sleep(ms(100)).await;
        }
        assert_eq!(world.registry.chain().guards.len(), 1, "still in the chain");
        assert!(world.registry.deregister("g".into()).await.unwrap().removed);
        let d = world.decision(Batch::new(9).call("c", "t", "{}")).await;
        assert!(proceeds(&d.decisions[0]));
        assert!(d.trace.is_empty());
    }

    /// Mirrors
    /// `faults::hang_guard_for_some_tools_does_not_delay_batches_that_do_not_need_it`.
    pub(super) async fn r9_r19_held_guard_for_some_tools_does_not_delay_batches_that_do_not_need_it(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let held = world
            .guarded(
                |url| validate("held", url).tools(&["slow.*"]).timeout(secs(60)),
                proceed_after(ms(2_000)),
            )
            .await;
        let _other = world
            .guarded(|url| validate("other", url), proceed_all)
            .await;
        let started = Instant::now();
        let slow = world.spawn(Batch::new(0).call("s1", "slow.op", "{}").timeout(secs(60)));
        world.settle().await;
        assert_eq!(held.requests(), 1, "the slow batch reached the held guard");
        for i in 0..10 {
            let fast_started = Instant::now();
            let d = world
                .decision(
                    Batch::new(1 + i)
                        .call(&format!("f{i}"), "fast.op", "{}")
                        .client(i % 2),
                )
                .await;
            world.took(fast_started, Duration::ZERO, &format!("fast batch {i}"));
            assert!(!slow.is_finished(), "fast batch {i} before the slow one");
            assert!(proceeds(&d.decisions[0]));
            assert_eq!(status(&d, "held"), TraceStatus::NotApplicable);
        }
        let mixed =
            world.spawn(Batch::of(50, &[("m1", "fast.op"), ("m2", "slow.op")]).timeout(secs(60)));
        world.settle().await;
        assert_eq!(held.requests(), 2);
        assert!(!mixed.is_finished());
        let d = slow.await.unwrap().unwrap();
        world.took(started, ms(2_000), "the held guard's own delay");
        assert!(proceeds(&d.decisions[0]));
        assert_eq!(status(&d, "held"), TraceStatus::Proceeded);
        let d = mixed.await.unwrap().unwrap();
        assert!(d.decisions.iter().all(proceeds));
        assert_eq!(status(&d, "held"), TraceStatus::Proceeded);
    }

    /// Mirrors
    /// `rules::r5_early_veto_answers_and_cancels_the_slow_later_guard`.
    pub(super) async fn r5_early_veto_answers_and_cancels_the_slow_later_guard(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (veto_url, _veto) =
            world.guard(|b| vec![Step::answer(b, vec![cancel(&b.calls[0].call_id, "denied")])]);
        world.register(validate("veto", &veto_url)).await;
        let slow = world
            .guarded(
                |url| validate("slow", url).timeout(secs(20)),
                proceed_after(ms(1_000)),
            )
            .await;
        let d = world
            .decision_after(
                Batch::one(0).timeout(secs(30)),
                Duration::ZERO,
                "answered at the veto",
            )
            .await;
        assert_eq!(d.decisions[0].decided_by, "veto");
        assert_eq!(status(&d, "slow"), TraceStatus::Superseded);
        world.settle().await;
        assert_eq!(slow.requests(), 1);
        assert_eq!(slow.cancels(), [slow.batches()[0].request_id]);
        tokio::time::sleep(secs(2)).await;
        assert_eq!(slow.answered(), 0, "the cancelled work never answered");
    }

    /// Mirrors
    /// `faults::r23_unknown_verdict_outcome_fails_the_guard_per_its_policy`.
    pub(super) async fn r23_unknown_verdict_outcome_fails_the_guard_per_its_policy(
        transport: Transport,
    ) {
        for variant in ["message", "varint", "partial"] {
            let world = World::on(transport);
            let (url, guard) = world.guard(move |b: &GuardBatch| {
                let verdicts: Vec<Vec<u8>> = b
                    .calls
                    .iter()
                    .map(|c| {
                        let mut outcome = Vec::new();
                        match variant {
                            "message" => {
                                let mut defer = Vec::new();
                                raw_pb::bytes_field(&mut defer, 1, b"ask the user first");
                                raw_pb::bytes_field(&mut outcome, 9, &defer);
                            }
                            "varint" => raw_pb::varint_field(&mut outcome, 9, 1),
                            _ => raw_pb::bytes_field(&mut outcome, 9, b""),
                        }
                        raw_pb::verdict(&c.call_id, &outcome)
                    })
                    .collect();
                let mut extra = Vec::new();
                if variant == "partial" {
                    raw_pb::varint_field(&mut extra, 3, 1);
                }
                vec![Step::raw(raw_pb::judge_response(
                    b.request_id,
                    &verdicts,
                    &extra,
                ))]
            });
            register_each_policy(&world, &url, secs(5)).await;
            assert_each_policy_fails(&world, variant, 2, "field 9").await;
            assert_eq!(
                guard.streams(),
                3,
                "{variant}: one per link, never reopened"
            );
            if variant == "partial" {
                world.settle().await;
                assert_eq!(
                    guard.cancels().len(),
                    guard.requests(),
                    "a partial answer it cannot read withdraws the request"
                );
            }
        }
    }

    /// Mirrors
    /// `faults::r23_unknown_fields_outside_a_verdict_are_ignored`.
    pub(super) async fn r23_unknown_fields_outside_a_verdict_are_ignored(transport: Transport) {
        let world = World::on(transport);
        let (url, _guard) = world.guard(|b: &GuardBatch| {
            let verdicts: Vec<Vec<u8>> = b
                .calls
                .iter()
                .filter(|c| c.tool == "fs.delete")
                .map(|c| {
                    let mut inside = Vec::new();
                    raw_pb::bytes_field(&mut inside, 9, b"policy-17");
                    raw_pb::verdict(&c.call_id, &raw_pb::skip_outcome("no deletes", &inside))
                })
                .collect();
            let mut extra = Vec::new();
            raw_pb::bytes_field(&mut extra, 5, b"guard-version 2");
            raw_pb::varint_field(&mut extra, 6, 42);
            raw_pb::bytes_field(&mut extra, 1000, &[1, 2, 3]);
            vec![Step::raw(raw_pb::judge_response(
                b.request_id,
                &verdicts,
                &extra,
            ))]
        });
        world
            .register(validate("g", &url).policy(FailOpen).timeout(secs(5)))
            .await;
        let d = world
            .decision(Batch::of(0, &[("c1", "fs.delete"), ("c2", "fs.read")]))
            .await;
        assert_skip(&d.decisions[0], "g", Action::Steer, "no deletes", "outside");
        assert!(d.decisions[0].bypassed.is_empty());
        assert!(proceeds(&d.decisions[1]) && d.decisions[1].bypassed.is_empty());
        assert_eq!(status(&d, "g"), TraceStatus::Skipped);
        assert_eq!(entry(&d, "g").error, "");
    }

    /// Mirrors
    /// `faults::r23_unknown_rewrite_field_fails_a_mutate_guard_and_nothing_is_rewritten`.
    pub(super) async fn r23_unknown_rewrite_field_fails_a_mutate_guard_and_nothing_is_rewritten(
        transport: Transport,
    ) {
        let world = World::on(transport);
        let (url, _guard) = world.guard(|b: &GuardBatch| {
            let verdicts: Vec<Vec<u8>> = b
                .calls
                .iter()
                .map(|c| {
                    let mut rewrite = Vec::new();
                    raw_pb::bytes_field(&mut rewrite, 2, br#"{"path":"/tmp/safe"}"#);
                    raw_pb::bytes_field(&mut rewrite, 3, b"drop: secrets");
                    let mut outcome = Vec::new();
                    raw_pb::bytes_field(&mut outcome, 3, &rewrite);
                    raw_pb::verdict(&c.call_id, &outcome)
                })
                .collect();
            vec![Step::raw(raw_pb::judge_response(
                b.request_id,
                &verdicts,
                &[],
            ))]
        });
        world
            .register(
                mutate("m", &url, &["fs.*"])
                    .tools(&["fs.*"])
                    .policy(FailClosed)
                    .timeout(secs(5)),
            )
            .await;
        let _later = world.guarded(|url| validate("v", url), proceed_all).await;
        let d = world
            .decision(
                Batch::new(0)
                    .call("c1", "fs.write", r#"{"path":"/etc/passwd"}"#)
                    .call("c2", "net.get", "{}"),
            )
            .await;
        assert_failure_cancel(&d.decisions[0], "m", "unknown rewrite field");
        assert!(d.decisions[0].rewritten_by.is_empty());
        assert_eq!(
            d.decisions[0].call.as_ref().map(|c| c.arguments.as_str()),
            Some(r#"{"path":"/etc/passwd"}"#)
        );
        assert!(proceeds(&d.decisions[1]));
        assert_eq!(status(&d, "m"), TraceStatus::Failed);
        assert!(entry(&d, "m").error.contains("Rewrite field 3"));
    }
}
