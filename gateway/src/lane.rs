//! An ordered judging lane (`mcp stdio`, R25, R31): the messages of one
//! direction that wait for the mesh before they go on (the tool calls of a
//! client's sampling answer, the tool results of an upstream's sampling
//! request) are judged concurrently, each in a task of its own, at most as
//! many at once as the lane's permits allow; they reach the peer in the
//! order they were read, and so does every message read after them that
//! goes the same way: a later message never overtakes one being judged.
//!
//! Past the bound the reader waits (for a permit, or for room in the
//! queue): it stops reading its peer, so a flood is held back, never
//! dropped, and nothing of it is unbounded. While nothing is queued, a
//! message is sent at once, with no hop.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;

/// Writes one message to the lane's peer; false when the peer is gone.
pub(crate) type Sink =
    Arc<dyn Fn(String) -> Pin<Box<dyn Future<Output = bool> + Send>> + Sync + Send>;

/// What is made of a message when its turn comes: `None`, nothing is sent.
type Later = Box<dyn FnOnce() -> Option<String> + Send>;

enum Entry {
    /// Made when its turn comes (after every message before it is sent).
    Later(Later),
    /// Being judged.
    Judging(JoinHandle<Option<String>>),
}

/// One direction's lane.
pub(crate) struct Lane {
    queue: mpsc::Sender<Entry>,
    /// Entries queued and not yet sent.
    queued: Arc<AtomicUsize>,
    /// The peer is gone: a send failed.
    closed: Arc<AtomicBool>,
    permits: Arc<Semaphore>,
    send: Sink,
    writer: JoinHandle<()>,
}

impl Lane {
    /// A lane sending with `send`, judging at most as many messages at once
    /// as `permits` has (shared with whatever else they bound), with room
    /// for `queued` messages waiting their turn.
    pub(crate) fn new(permits: Arc<Semaphore>, queued: usize, send: Sink) -> Self {
        let (queue, mut entries) = mpsc::channel::<Entry>(queued.max(1));
        let queued = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicBool::new(false));
        let writer = tokio::spawn({
            let (queued, closed, send) = (queued.clone(), closed.clone(), send.clone());
            async move {
                while let Some(entry) = entries.recv().await {
                    let message = match entry {
                        Entry::Later(make) => make(),
                        Entry::Judging(task) => task.await.ok().flatten(),
                    };
                    if let Some(message) = message
                        && !closed.load(Ordering::SeqCst)
                        && !send(message).await
                    {
                        closed.store(true, Ordering::SeqCst);
                    }
                    queued.fetch_sub(1, Ordering::SeqCst);
                }
            }
        });
        Self {
            queue,
            queued,
            closed,
            permits,
            send,
            writer,
        }
    }

    /// Whether a permit is free now (one judging could start at once).
    pub(crate) fn has_permit(&self) -> bool {
        self.permits.available_permits() > 0
    }

    /// Sends `message` after every message before it. False when the peer
    /// is gone.
    pub(crate) async fn send(&self, message: String) -> bool {
        self.send_made(Box::new(move || Some(message))).await
    }

    /// Sends what `make` makes when its turn comes (after every message
    /// before it is sent; `None`: nothing). False when the peer is gone.
    pub(crate) async fn send_made(&self, make: Later) -> bool {
        if self.closed.load(Ordering::SeqCst) {
            return false;
        }
        // Only the reader queues: with nothing queued, every message before
        // this one is out.
        if self.queued.load(Ordering::SeqCst) == 0 {
            let Some(message) = make() else {
                return true;
            };
            if (self.send)(message).await {
                return true;
            }
            self.closed.store(true, Ordering::SeqCst);
            return false;
        }
        self.enqueue(Entry::Later(make)).await
    }

    /// Judges a message (`judging` makes what is sent; `None`: nothing) in
    /// a task of its own once a permit is free, and sends the outcome in its
    /// turn. False when the peer is gone (nothing is judged then).
    pub(crate) async fn judge(
        &self,
        judging: impl Future<Output = Option<String>> + Send + 'static,
    ) -> bool {
        if self.closed.load(Ordering::SeqCst) {
            return false;
        }
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            return false;
        };
        let task = tokio::spawn(async move {
            let judged = judging.await;
            drop(permit);
            judged
        });
        self.enqueue(Entry::Judging(task)).await
    }

    async fn enqueue(&self, entry: Entry) -> bool {
        self.queued.fetch_add(1, Ordering::SeqCst);
        if self.queue.send(entry).await.is_err() {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        !self.closed.load(Ordering::SeqCst)
    }

    /// Sends what is queued (judging what is being judged), then ends.
    pub(crate) async fn finish(self) {
        drop(self.queue);
        let _ = self.writer.await;
    }

    /// Ends now: what is queued is not sent.
    pub(crate) fn abort(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.writer.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    fn recording() -> (Sink, Arc<Mutex<Vec<String>>>) {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let send: Sink = Arc::new({
            let sent = sent.clone();
            move |m: String| {
                let sent = sent.clone();
                Box::pin(async move {
                    sent.lock().unwrap().push(m);
                    true
                })
            }
        });
        (send, sent)
    }

    /// R31: a message read after one being judged is sent after it, and
    /// what the writer makes when its turn comes sees what was sent before.
    #[tokio::test]
    async fn r31_a_later_message_never_overtakes_one_being_judged() {
        let (send, sent) = recording();
        let lane = Lane::new(Arc::new(Semaphore::new(4)), 8, send);
        assert!(lane.send("first".into()).await);
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        assert!(
            lane.judge(async move {
                let _ = released.await;
                Some("judged".into())
            })
            .await
        );
        assert!(lane.send("after".into()).await);
        let seen = sent.clone();
        assert!(
            lane.send_made(Box::new(move || Some(format!(
                "made after {}",
                seen.lock().unwrap().len()
            ))))
            .await
        );
        assert!(lane.judge(async { None }).await);
        assert!(lane.send("last".into()).await);
        tokio::task::yield_now().await;
        assert_eq!(*sent.lock().unwrap(), ["first"]);
        let _ = release.send(());
        lane.finish().await;
        assert_eq!(
            *sent.lock().unwrap(),
            ["first", "judged", "after", "made after 3", "last"]
        );
    }

    /// R25: at most the permits' count is judged at once; the reader waits
    /// for one past it (and nothing is dropped).
    #[tokio::test]
    async fn r25_judging_holds_at_most_the_permits() {
        let (send, sent) = recording();
        let permits = Arc::new(Semaphore::new(2));
        let lane = Arc::new(Lane::new(permits.clone(), 8, send));
        let (release, released) = tokio::sync::watch::channel(false);
        let judging = Arc::new(AtomicUsize::new(0));
        let reader = tokio::spawn({
            let (lane, judging) = (lane.clone(), judging.clone());
            async move {
                for n in 0..5 {
                    let (mut released, judging) = (released.clone(), judging.clone());
                    lane.judge(async move {
                        judging.fetch_add(1, Ordering::SeqCst);
                        let _ = released.wait_for(|r| *r).await;
                        Some(format!("m{n}"))
                    })
                    .await;
                }
            }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while judging.load(Ordering::SeqCst) < 2 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(judging.load(Ordering::SeqCst), 2);
        assert!(!reader.is_finished(), "the reader waits for a permit");
        assert!(!lane.has_permit());
        release.send_replace(true);
        reader.await.unwrap();
        let Ok(lane) = Arc::try_unwrap(lane) else {
            panic!("the lane is still shared")
        };
        lane.finish().await;
        assert_eq!(*sent.lock().unwrap(), ["m0", "m1", "m2", "m3", "m4"]);
        assert_eq!(permits.available_permits(), 2);
    }
}
