//! guardmesh's integration tests: one binary, real processes and real
//! sockets on 127.0.0.1 with port 0, every test named after the rule of
//! `docs/behaviour.md` it holds. The harness is split by role in
//! `harness/`; the tests by area:
//!
//! * `rules`, `rewrites`: the decision rules and checked rewrites (R1..R22).
//! * `approvals`: a guard's ask, its approval and one use (R35), on one
//!   mesh and on replicas sharing etcd or Redis; `approvals_cli`:
//!   `guardmesh approvals`; `mcp_approvals`: asks put to the MCP client's
//!   user through elicitation by the gateway.
//! * `faults`: unreachable, closing, hanging, spurious, oversized and
//!   restarted guards (R12..R16, R23, R26).
//! * `overload`, `soak`: bounds under load, and a bounded soak under faults;
//!   `busy`: a slow healthy guard under a flood is busy, not failed (R25,
//!   R13); `registration`: what one registrar may hold (R16, R25).
//! * `security`: TLS, mTLS, tokens, roles and endpoint policy (R24, R25).
//! * `etcd`: replicas sharing one chain on a real etcd (R17).
//! * `guard_discovery`: a guard's replicas from a DNS name and from
//!   heartbeats on a 3-member etcd (R32); `guard_replicas`: a guard run as
//!   several replica processes, balancing and failover;
//!   `guard_replicas_health`: replicas drained through `grpc.health.v1`
//!   (R32); `guard_replicas_balance`: replicas that hang or slow down, priced
//!   and failed over (R32, R13); `guard_busy`: a guard busy under one
//!   client's burst sheds that client and judges the others, across
//!   connections, sessions and identities (R25, R13, R32).
//! * `results`: results through the mesh, from the SDK and the MCP gateway
//!   (R33).
//! * `sessions`: session memory through a real mesh, flows, rates and
//!   isolation (R34); `sessions_guards`: the memory as guards are sent it and
//!   label it, and labels from policy rules; `sessions_store`: the memory
//!   shared by replicas through etcd and Redis; `readme_flows`: the README's
//!   "Flows and sessions" example as written (R33, R34).
//! * `observability`, `otel`, `otel_http`: metrics (parsed as Prometheus text
//!   and OpenMetrics), logs, and traces exported over OTLP/gRPC and
//!   OTLP/HTTP (R21, R22).
//! * `polyglot`, `conformance`: Python, Node and Rust guard processes in one
//!   chain, and the conformance kit against each.
//! * `gate`: what the mesh refuses before any guard sees it: names and
//!   arguments that readers take differently (R20), and applicability in
//!   any case (R9).
//! * `hook`: the pre-tool hook against hung meshes, rewrites and each
//!   host's format (R31b).
//! * `mcp`: the MCP gateway and the pre-tool hook through the official MCP
//!   SDK (R31); `mcp_readme`: the client and hook snippets of
//!   `docs/mcp-and-hooks.md` as written; `mcp_relay`: grouping over HTTP and the stderr relay;
//!   `mcp_smuggling`: calls smuggled past the gateway to Python, Go and
//!   TypeScript peers; `mcp_returns`: what comes back from the upstream;
//!   `mcp_sampling`: tool calls a model asks for through sampling.
//!   `mcp_bounds`: slow, idle and flooding clients, Origin and Host, and a
//!   chatty upstream (R25 through the gateway); `mcp_answers`: every answer
//!   accepted by the official SDK clients; `mcp_revision`,
//!   `mcp_revision_ts`: the 2026-07-28 revision's routing headers with the
//!   Python and TypeScript SDKs; `mcp_embedded`: the gateway with the mesh in
//!   its own process (`--config`); `interceptors_conformance`: the MCP
//!   interceptor conformance fixtures (SEP-2624).
//! * `sdk`: the Rust SDK's coordinator example run against a real mesh,
//!   and a session that outlives a restart of the mesh (R19).
//! * `cli`, `shutdown`: the `guardmesh` command as users run it;
//!   `mesh_args`: the flags that say how a command reaches a mesh (R24);
//!   `probes`: `/healthz`, `/readyz` and the drain on SIGTERM.
//! * `docs`: the README's length and links, the docs pages' links, the
//!   contract's rule numbers, no page calling a tested rule untested, one
//!   version number, no exact pins in the SDK, and the proto against the
//!   last release.
//! * `config_check`: `guardmesh config check|reference` (every error in one
//!   run, `--root`, the environment variables), and relative paths in a
//!   config file resolved against its folder.
//! * `decision_log`: the decision log in the mesh, `guardmesh log verify`
//!   and `guardmesh replay` (R29, R30); `decision_log_replay`: replay
//!   against a running mesh with a dry-run candidate;
//!   `decision_log_refusals`: refusals by the auth layer and chain changes
//!   that cannot be recorded; `decision_log_otlp`: the records exported as
//!   OpenTelemetry log records; `decision_log_hardening`: masked values
//!   nowhere, bounded refusal records, the directory budget and a full
//!   disk, replay of final calls and of logs that verify only, policy
//!   digests in chain changes; `decision_log_tamper`: logs tampered with
//!   in every way and verified; `decision_log_anchor`: the etcd anchor of
//!   checkpoints; `decision_log_show`: `guardmesh log show|tail`, filtered,
//!   verified as read, followed across rotation.
//! * `policy`: policy guards and unguarded calls (R27, R28), and
//!   `guardmesh policy check|test`; `policy_order`: R3/R4 across policy,
//!   Rust and Python guards with random verdicts; `policy_watch`: policy
//!   files reloaded when they change on disk; `policy_reload_attacks`:
//!   reloads that cannot be turned against the mesh; `policy_isolation`,
//!   `policy_lanes`: fail closed, and every client in its lane (R13, R14,
//!   R25).
//!
//! Tests that measure memory take [`harness::HEAVY`]; tests that must own the
//! process (its global telemetry, its resident set) run in a child process of
//! this binary through [`harness::isolated`].

mod harness;

mod approvals;
mod approvals_cli;
mod busy;
mod cli;
mod config_check;
mod conformance;
mod decision_log;
mod decision_log_anchor;
mod decision_log_hardening;
mod decision_log_otlp;
mod decision_log_refusals;
mod decision_log_replay;
mod decision_log_show;
mod decision_log_tamper;
mod docs;
mod doors;
mod etcd;
mod faults;
mod gate;
mod guard_busy;
mod guard_discovery;
mod guard_replicas;
mod guard_replicas_balance;
mod guard_replicas_health;
mod hook;
mod identity_memory;
mod interceptors_conformance;
mod mcp;
mod mcp_answers;
mod mcp_approvals;
mod mcp_bounds;
mod mcp_embedded;
mod mcp_readme;
mod mcp_relay;
mod mcp_returns;
mod mcp_revision;
mod mcp_revision_ts;
mod mcp_sampling;
mod mcp_smuggling;
mod mcp_visibility;
mod mesh_args;
mod observability;
mod otel;
mod otel_http;
mod overload;
mod policy;
mod policy_isolation;
mod policy_lanes;
mod policy_order;
mod policy_reload_attacks;
mod policy_watch;
mod polyglot;
mod probes;
mod readme_flows;
mod registration;
mod results;
mod rewrites;
mod rules;
mod sdk;
mod security;
mod sessions;
mod sessions_guards;
mod sessions_serialized;
mod sessions_store;
mod shutdown;
mod soak;
