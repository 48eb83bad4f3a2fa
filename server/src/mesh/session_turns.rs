//! R34: the batches of one session are judged one after another on this
//! mesh, so that a count or a flow cannot be raced by sending them at once.
//!
//! A batch whose chain has a policy rule reading session memory takes its
//! session's turn before its memory is read and keeps it until its answer
//! is ready: its calls
//! are remembered (and, for results, what the model reads) before the next
//! batch of the session reads the memory. A batch that cannot have its
//! turn before its deadline is judged without the memory: the rules that
//! need it fail per their guard's policy (R13), never as a new session.
//!
//! Only sessions with a batch in flight have an entry: an entry goes with
//! its last holder, so the map is bounded by the batches in flight.

use crate::session::SessionKey;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

/// The turns of the sessions with a batch in flight.
#[derive(Debug, Default)]
pub(crate) struct SessionTurns {
    held: Mutex<HashMap<SessionKey, Arc<tokio::sync::Mutex<()>>>>,
}

/// A place in a session's line: removes the session's entry when it is
/// the last one.
struct Place {
    turns: Arc<SessionTurns>,
    key: SessionKey,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut held = self
            .turns
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // The map's and this one: nobody else waits.
        if Arc::strong_count(&self.lock) == 2 {
            held.remove(&self.key);
        }
    }
}

/// A batch's turn in its session, given back when dropped.
pub(crate) struct Turn {
    // Field order: the guard is released before the place is left.
    _guard: OwnedMutexGuard<()>,
    _place: Place,
}

/// No turn before the batch's deadline.
#[derive(Debug)]
pub(crate) struct Busy;

impl SessionTurns {
    /// Waits for `key`'s turn until `deadline`.
    pub(crate) async fn take(
        self: &Arc<Self>,
        key: SessionKey,
        deadline: Instant,
    ) -> Result<Turn, Busy> {
        let lock = self
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.clone())
            .or_default()
            .clone();
        let place = Place {
            turns: self.clone(),
            key,
            lock: lock.clone(),
        };
        match tokio::time::timeout_at(deadline, lock.lock_owned()).await {
            Ok(guard) => Ok(Turn {
                _guard: guard,
                _place: place,
            }),
            Err(_) => Err(Busy),
        }
    }

    /// Sessions with a batch in flight.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn r34_one_turn_at_a_time_per_session_and_entries_go_with_their_last_holder() {
        let turns = Arc::new(SessionTurns::default());
        let far = Instant::now() + Duration::from_secs(60);
        let a = SessionKey::new("", "a");
        let first = turns.take(a.clone(), far).await.unwrap();
        // Another session is not held up.
        let other = turns.take(SessionKey::new("", "b"), far).await.unwrap();
        // The same session waits, and gives up at its deadline.
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(turns.take(a.clone(), soon).await.is_err());
        let waiting = {
            let turns = turns.clone();
            let a = a.clone();
            tokio::spawn(async move { turns.take(a, far).await.is_ok() })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!waiting.is_finished());
        drop(first);
        assert!(waiting.await.unwrap());
        drop(other);
        assert_eq!(turns.len(), 0, "entries outlived their holders");
    }
}
