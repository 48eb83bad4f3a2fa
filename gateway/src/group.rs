//! Grouping: single `tools/call` requests of one session that arrive within
//! a short window are judged as one guard batch (one round's calls, sent by a
//! client as concurrent requests rather than a JSON-RPC batch), and each
//! request still gets its own answer under its own id.
//!
//! Over stdio the gateway can also group without waiting
//! ([`Grouper::until_idle`]): the calls read together (in the bytes one
//! read of the client's stream returned) are one batch, judged as soon as
//! the gateway has read everything the client has sent so far
//! ([`Grouper::flush`]). A lone call then waits for nothing.
//!
//! A group is only formed from calls that can share a batch: the same
//! session, the same W3C trace context (R22), and distinct call ids (R20
//! refuses a batch that repeats one; a call whose id is already pending
//! closes the group and starts the next). A group the mesh refuses as
//! invalid (R20: no guard was contacted) is judged again call by call, so
//! one malformed call does not fail the calls it happened to arrive with.

use crate::jsonrpc::ToolCallRequest;
use crate::judge::{Disposition, Judge, JudgeError};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::oneshot;

/// Most calls in one group; a full group is judged at once.
pub const MAX_GROUP: usize = 64;

/// Which calls may share a batch: session and trace context.
type Key = (String, Option<String>);

struct Pending {
    generation: u64,
    calls: Vec<ToolCallRequest>,
    ids: HashSet<String>,
    waiters: Vec<oneshot::Sender<Disposition>>,
}

/// When a group closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Close {
    /// Each call is judged on its own.
    Alone,
    /// This long after its first call.
    After(Duration),
    /// When [`Grouper::flush`] is called.
    OnFlush,
}

struct Inner {
    judge: Arc<Judge>,
    close: Close,
    state: Mutex<(u64, HashMap<Key, Pending>)>,
}

/// Groups single calls into batches; see the module's documentation.
#[derive(Clone)]
pub struct Grouper {
    inner: Arc<Inner>,
}

impl Grouper {
    /// Groups calls arriving within `window`; a zero window judges each call
    /// on its own.
    pub fn new(judge: Arc<Judge>, window: Duration) -> Self {
        let close = if window.is_zero() {
            Close::Alone
        } else {
            Close::After(window)
        };
        Self::with(judge, close)
    }

    /// Groups calls until [`Grouper::flush`]: the reader of the client's
    /// stream flushes when it has read everything sent so far.
    pub fn until_idle(judge: Arc<Judge>) -> Self {
        Self::with(judge, Close::OnFlush)
    }

    fn with(judge: Arc<Judge>, close: Close) -> Self {
        Self {
            inner: Arc::new(Inner {
                judge,
                close,
                state: Mutex::new((0, HashMap::new())),
            }),
        }
    }

    /// Judges every pending group now, for a [`Grouper::until_idle`]; a
    /// grouper with a window keeps waiting for it.
    pub fn flush(&self) {
        if self.inner.close != Close::OnFlush {
            return;
        }
        let groups = {
            let mut state = self
                .inner
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            std::mem::take(&mut state.1)
        };
        for ((session, _), group) in groups {
            let judge = self.inner.judge.clone();
            tokio::spawn(async move { settle(&judge, &session, group).await });
        }
    }

    /// The judge the groups are sent to.
    pub fn judge(&self) -> &Judge {
        &self.inner.judge
    }

    /// Judges one call, in a group with the calls of `session` that arrive
    /// within the window; returns what to do with this call.
    pub async fn judge_one(&self, session: &str, call: ToolCallRequest) -> Disposition {
        self.enqueue(session, call).await
    }

    /// Adds one call to its group now, and returns its disposition to come:
    /// a reader that enqueues the calls it has read and then flushes knows
    /// they are all in the group.
    pub fn enqueue(
        &self,
        session: &str,
        call: ToolCallRequest,
    ) -> impl std::future::Future<Output = Disposition> + Send + 'static {
        let this = self.clone();
        let session = session.to_owned();
        let window = match self.inner.close {
            Close::Alone => {
                return futures::future::Either::Left(async move {
                    judge_alone(&this.inner.judge, &session, call).await
                });
            }
            Close::After(window) => Some(window),
            Close::OnFlush => None,
        };
        let id = call.id.clone();
        let (tx, rx) = oneshot::channel();
        let key: Key = (session.clone(), call.traceparent.clone());
        let mut flush_now = None;
        let mut start_timer = None;
        {
            let mut state = self
                .inner
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let (next_generation, groups) = &mut *state;
            // A repeated id cannot share the pending group: close it.
            if groups
                .get(&key)
                .is_some_and(|p| p.ids.contains(call.call_id()))
            {
                flush_now = groups.remove(&key);
            }
            let pending = groups.entry(key.clone()).or_insert_with(|| {
                *next_generation += 1;
                start_timer = Some(*next_generation);
                Pending {
                    generation: *next_generation,
                    calls: Vec::new(),
                    ids: HashSet::new(),
                    waiters: Vec::new(),
                }
            });
            pending.ids.insert(call.call_id().to_owned());
            pending.calls.push(call);
            pending.waiters.push(tx);
            if pending.calls.len() >= MAX_GROUP {
                if let Some(full) = groups.remove(&key) {
                    let judge = self.inner.judge.clone();
                    let session = key.0.clone();
                    tokio::spawn(async move { settle(&judge, &session, full).await });
                }
                start_timer = None;
            }
        }
        if let Some(closed) = flush_now {
            let judge = self.inner.judge.clone();
            let session = key.0.clone();
            tokio::spawn(async move { settle(&judge, &session, closed).await });
        }
        if let (Some(generation), Some(window)) = (start_timer, window) {
            let inner = self.inner.clone();
            tokio::spawn(async move {
                tokio::time::sleep(window).await;
                let due = {
                    let mut state = inner.state.lock().unwrap_or_else(PoisonError::into_inner);
                    match state.1.get(&key) {
                        Some(p) if p.generation == generation => state.1.remove(&key),
                        _ => None,
                    }
                };
                if let Some(group) = due {
                    settle(&inner.judge, &key.0, group).await;
                }
            });
        }
        futures::future::Either::Right(async move {
            rx.await.unwrap_or_else(|_| {
                // The group's task ended without an answer (the runtime is
                // stopping): never forward.
                not_judged(&id)
            })
        })
    }
}

/// The answer for a call that got no disposition: an error, never a forward.
fn not_judged(id: &serde_json::value::RawValue) -> Disposition {
    let error = JudgeError::Refused {
        code: tonic::Code::Unavailable,
        message: "the call was not judged (the gateway is stopping)".into(),
    };
    Disposition::Answer(crate::jsonrpc::error(Some(id), &error.error_data()))
}

async fn judge_alone(judge: &Judge, session: &str, call: ToolCallRequest) -> Disposition {
    let mut out = judge.judge(session, std::slice::from_ref(&call)).await;
    out.pop().unwrap_or_else(|| not_judged(&call.id))
}

/// Judges a closed group and answers each of its waiters.
async fn settle(judge: &Judge, session: &str, group: Pending) {
    let Pending { calls, waiters, .. } = group;
    let dispositions = if calls.len() == 1 {
        judge.judge(session, &calls).await
    } else {
        match judge.try_judge(session, &calls).await {
            Ok(dispositions) => dispositions,
            // Invalid as a whole (R20, no guard contacted): each on its own,
            // so one bad call does not fail the others.
            Err(JudgeError::Refused {
                code: tonic::Code::InvalidArgument,
                ..
            }) => {
                let mut out = Vec::with_capacity(calls.len());
                for call in &calls {
                    out.extend(judge.judge(session, std::slice::from_ref(call)).await);
                }
                out
            }
            Err(error) => judge.answer_errors(&calls, &error),
        }
    };
    for (waiter, disposition) in waiters.into_iter().zip(dispositions) {
        let _ = waiter.send(disposition);
    }
}
