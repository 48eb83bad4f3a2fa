//! The task behind a [`GuardLink`](super::GuardLink): connect, serve one
//! `Judge` stream, routing each answer to the batch waiting for it (R23: a
//! verdict with a field this mesh does not know fails its request), back
//! off with jitter when it ends, and connect again.

use super::backoff::ExpBackoff;
use super::failure::GuardFailure;
use super::guard_link::{Conn, Shared};
use super::queue::Queue;
use super::transport::{GuardTransport, OpenError, Requests};
use super::{LinkConfig, LinkEvent, wire};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio_stream::StreamExt;

/// The link's life: connect, serve one stream, back off, repeat.
pub(super) async fn run(
    shared: Arc<Shared>,
    config: LinkConfig,
    transport: Arc<dyn GuardTransport>,
    first: Requests,
) {
    let mut first = Some(first);
    let mut backoff = ExpBackoff::new(
        config.backoff_initial,
        config.backoff_max,
        ExpBackoff::LINK_JITTER,
    );
    loop {
        let requests = match first.take() {
            Some(requests) => requests,
            None => {
                let (queue, requests) = Queue::new();
                shared.lock().conn = Conn::Open(queue);
                Box::pin(requests) as Requests
            }
        };
        let answered = serve_stream(&shared, &config, transport.as_ref(), requests).await;
        if answered {
            backoff.reset();
        }
        // Jitter over the current step keeps a fleet of meshes from
        // reconnecting to a restarted guard in lockstep.
        tokio::time::sleep(backoff.next()).await;
    }
}

/// Opens one stream and routes its answers until it ends. Returns whether the
/// guard answered anything (to reset the backoff).
async fn serve_stream(
    shared: &Shared,
    config: &LinkConfig,
    transport: &dyn GuardTransport,
    requests: Requests,
) -> bool {
    let mut answers = match transport.open(&shared.endpoint, config, requests).await {
        Ok(answers) => answers,
        Err(error @ OpenError::BadEndpoint { .. }) => {
            let reason: Arc<str> = error.to_string().into();
            shared.fail_all(
                GuardFailure::Unreachable(reason.clone()),
                Conn::Down(reason),
            );
            return false;
        }
        Err(error @ OpenError::Unreachable { .. }) => {
            let reason: Arc<str> = error.to_string().into();
            // Warn once per outage; the retries that follow log at debug.
            if shared.outage_started() {
                tracing::warn!(guard = %shared.name, error = %reason, "guard unreachable; retrying with backoff");
            } else {
                tracing::debug!(guard = %shared.name, error = %reason, "guard still unreachable");
            }
            shared.fail_all(
                GuardFailure::Unreachable(reason.clone()),
                Conn::Down(reason),
            );
            return false;
        }
        Err(OpenError::Refused(status)) => {
            tracing::warn!(guard = %shared.name, %status, "guard refused the Judge stream");
            let reason: Arc<str> = format!("Judge stream refused: {status}").into();
            shared.fail_all(GuardFailure::from_status(&status), Conn::Down(reason));
            return false;
        }
    };
    tracing::debug!(guard = %shared.name, endpoint = %shared.endpoint, "guard stream open");
    shared.metrics.guard_stream_opened(&shared.name);
    shared.outage.store(false, Ordering::Relaxed);
    shared.lock().last_failure = None;
    let mut answered = false;
    let (failure, reason): (GuardFailure, Arc<str>) = loop {
        match answers.next().await {
            Some(Ok(answer)) => {
                answered = true;
                route(shared, answer);
            }
            None => break (GuardFailure::StreamClosed, "guard closed its stream".into()),
            Some(Err(status)) => {
                break (
                    GuardFailure::from_status(&status),
                    format!("stream failed: {status}").into(),
                );
            }
        }
    };
    tracing::warn!(guard = %shared.name, error = %failure, "guard stream ended");
    shared.fail_all(failure, Conn::Down(reason));
    answered
}

/// Hands an answer to the batch waiting for it. Answers for requests that
/// are not waiting (cancelled, timed out, unknown) are dropped and counted.
/// An answer whose verdicts carry a field this mesh does not know fails its
/// request (R23), partial or not: the guard is told to stop work on it.
fn route(shared: &Shared, answer: wire::Answer) {
    let wire::Answer { response, unknown } = answer;
    let answered = tokio::time::Instant::now();
    let id = response.request_id;
    let mut state = shared.lock();
    let waiter = if response.partial && unknown.is_none() {
        state.waiting.get(&id).map(|w| (w.tag, w.events.clone()))
    } else {
        state.waiting.remove(&id).map(|w| (w.tag, w.events))
    };
    if waiter.is_some() && response.partial && unknown.is_some() {
        shared.send_cancel(&state, id);
    }
    drop(state);
    let replica = shared.endpoint.clone();
    match (waiter, unknown) {
        (Some((tag, events)), None) => {
            events.send(LinkEvent::Answer {
                tag,
                response,
                replica,
                answered,
            });
        }
        (Some((tag, events)), Some(field)) => {
            events.send(LinkEvent::Failed {
                tag,
                failure: GuardFailure::UnknownVerdictField(field),
                replica,
            });
        }
        (None, _) => {
            shared.metrics.spurious_answer(&shared.name);
            tracing::debug!(guard = %shared.name, request_id = id, "answer for a request no one waits for");
        }
    }
}
