//! A batch's mailbox: where the requests it sent to guards report their
//! answers, failures and sheds ([`LinkEvent`]), in the order they happen.
//!
//! One per batch, made when it sends its first guard request and dropped
//! with it; every request of the batch holds a sender. A batch has a few
//! requests out and reads each event as it comes, so the mailbox is a short
//! queue under a lock and one waker: one small allocation per batch where a
//! general channel made two (its shared state and a block of 32 slots) and
//! counted its senders and permits on every event. The batch holds a sender
//! of its own while it waits, so [`Events::recv`] never waits on a mailbox
//! nobody can write to; a request that ends without an event is still
//! bounded by the guard's deadline the batch waits with (R14). Once the
//! batch is gone (decided, or its coordinator left) the mailbox is closed:
//! what its requests still send (a slow guard's answers, partial ones) is
//! dropped, not kept for as long as a request lives.

use super::LinkEvent;
use futures::task::AtomicWaker;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;

/// A new mailbox: its sending side (cloned into each request) and the
/// batch's reading side.
pub fn mailbox() -> (EventSender, Events) {
    let shared = Arc::new(Mailbox {
        inbox: Mutex::new(Inbox::default()),
        waker: AtomicWaker::new(),
    });
    (EventSender(shared.clone()), Events(shared))
}

#[derive(Debug)]
struct Mailbox {
    inbox: Mutex<Inbox>,
    /// The batch's task, while it waits for an event.
    waker: AtomicWaker,
}

#[derive(Debug, Default)]
struct Inbox {
    events: VecDeque<LinkEvent>,
    /// The batch is gone: nothing more is kept.
    closed: bool,
}

impl Mailbox {
    fn inbox(&self) -> std::sync::MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn pop(&self) -> Option<LinkEvent> {
        self.inbox().events.pop_front()
    }
}

/// Where a request reports to its batch.
#[derive(Debug, Clone)]
pub struct EventSender(Arc<Mailbox>);

impl EventSender {
    /// Queues `event` for the batch and wakes it. An event for a batch that
    /// is gone (it was decided, or its coordinator left) is dropped with
    /// the mailbox.
    pub fn send(&self, event: LinkEvent) {
        {
            let mut inbox = self.0.inbox();
            if inbox.closed {
                return;
            }
            inbox.events.push_back(event);
        }
        self.0.waker.wake();
    }

    /// Events queued and not yet read.
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.0.inbox().events.len()
    }
}

/// The batch's side of its mailbox.
#[derive(Debug)]
pub struct Events(Arc<Mailbox>);

impl Events {
    /// The next event, waiting for one (cancel-safe: an event is taken
    /// only when returned).
    pub async fn recv(&mut self) -> LinkEvent {
        poll_fn(|cx| {
            if let Some(event) = self.0.pop() {
                return Poll::Ready(event);
            }
            self.0.waker.register(cx.waker());
            // An event queued between the look and the registration.
            match self.0.pop() {
                Some(event) => Poll::Ready(event),
                None => Poll::Pending,
            }
        })
        .await
    }

    /// The next event if one is queued.
    pub fn try_recv(&mut self) -> Option<LinkEvent> {
        self.0.pop()
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        let mut inbox = self.0.inbox();
        inbox.closed = true;
        // Dropped outside the lock.
        let events = std::mem::take(&mut inbox.events);
        drop(inbox);
        drop(events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::GuardFailure;
    use std::time::Duration;

    fn failed(tag: usize) -> LinkEvent {
        LinkEvent::Failed {
            tag,
            failure: GuardFailure::StreamClosed,
            replica: Arc::from("r"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn r14_events_arrive_in_order_and_wake_the_waiting_batch() {
        let (tx, mut events) = mailbox();
        assert!(events.try_recv().is_none(), "a new mailbox is empty");
        let waiting = tokio::spawn(async move {
            let mut tags = Vec::new();
            for _ in 0..3 {
                tags.push(events.recv().await.tag());
            }
            tags
        });
        // The batch waits first; each send wakes it (R13, R14: an answer
        // sent is an answer read).
        tokio::time::sleep(Duration::from_millis(1)).await;
        let other = tx.clone();
        tx.send(failed(2));
        tokio::time::sleep(Duration::from_millis(1)).await;
        other.send(failed(0));
        other.send(failed(1));
        let tags = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("R14: every event sent wakes the batch");
        assert_eq!(tags.expect("the batch ends"), vec![2, 0, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn r14_a_withdrawn_wait_takes_nothing_and_a_gone_batch_keeps_nothing() {
        let (tx, mut events) = mailbox();
        // A wait given up (the batch's deadline won a select) takes no
        // event: the next wait gets it.
        let gave_up = tokio::time::timeout(Duration::from_millis(5), events.recv()).await;
        assert!(gave_up.is_err(), "nothing was sent");
        tx.send(failed(7));
        assert_eq!(events.recv().await.tag(), 7);
        // A batch gone: what was queued goes with it, and what its
        // requests still send is not kept (a slow guard's answers would
        // otherwise live as long as its request).
        tx.send(failed(8));
        assert_eq!(tx.queued(), 1);
        drop(events);
        assert_eq!(tx.queued(), 0, "the batch's events outlive it");
        tx.send(failed(9));
        assert_eq!(tx.queued(), 0, "an event kept for a batch that is gone");
    }
}
