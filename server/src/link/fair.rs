//! The requests waiting for room at a guard's replicas, taken fairly
//! across clients (R25): one client's burst never stands in front of
//! another client's request.
//!
//! A waiting request belongs to a [`Sender`]: its *client* (the caller's
//! identity when the mesh authenticates callers, else its connection) and
//! its *flow* within that client (the batch's session). Requests leave in
//! rounds: one per client with requests waiting, in turn; within a client,
//! one per flow, in turn; within a flow, first in first out. So a client
//! sending one batch now and then waits for at most one request of each
//! other client, however many those have waiting; and two sessions on one
//! connection are served in turn as two clients are.
//!
//! The queue is bounded ([`Bounds`]): one client holds at most `share`
//! requests; when the queue is full, a newcomer from a client holding
//! fewer than the client that holds the most takes the place of that
//! client's newest request, which is shed; otherwise the newcomer is
//! refused. Either way what is shed belongs to the client whose requests
//! exceed its share of the queue.

use std::collections::VecDeque;
use std::hash::BuildHasher;

/// Hashes identities and sessions into clients and flows: a fixed seed, so
/// a sender's key is the same in every run.
const FLOWS: foldhash::fast::FixedState =
    foldhash::fast::FixedState::with_seed(0x6775_6172_646d_6573);

/// Who sent a waiting request: its client and its flow within the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Sender {
    pub client: u64,
    pub flow: u64,
}

impl Sender {
    /// The sender of a batch from connection `connection` (its key), sent
    /// by the authenticated `identity` (empty without one) in session
    /// `session`: the client is the identity when there is one, else the
    /// connection.
    pub fn of(connection: u64, identity: &str, session: &str) -> Self {
        let hash = |tag: u8, text: &str| FLOWS.hash_one((tag, text));
        Self {
            client: if identity.is_empty() {
                connection
            } else {
                hash(0, identity)
            },
            flow: hash(1, session),
        }
    }
}

/// How many requests may wait, in all and per client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) total: usize,
    pub(crate) share: usize,
}

/// Why a request was not queued: the requests waiting in all, and those of
/// its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused {
    pub(crate) waiting: usize,
    pub(crate) held: usize,
}

/// One client's waiting requests, by flow.
#[derive(Debug)]
struct Lane<T> {
    flows: super::IdMap<u64, VecDeque<T>>,
    turn: VecDeque<u64>,
    len: usize,
}

impl<T> Lane<T> {
    fn new() -> Self {
        Self {
            flows: super::IdMap::default(),
            turn: VecDeque::new(),
            len: 0,
        }
    }

    fn push(&mut self, flow: u64, item: T) {
        let queue = self.flows.entry(flow).or_default();
        if queue.is_empty() {
            self.turn.push_back(flow);
        }
        queue.push_back(item);
        self.len += 1;
    }

    fn pop(&mut self) -> Option<T> {
        let flow = self.turn.pop_front()?;
        let queue = self.flows.get_mut(&flow)?;
        let item = queue.pop_front()?;
        if queue.is_empty() {
            self.flows.remove(&flow);
        } else {
            self.turn.push_back(flow);
        }
        self.len -= 1;
        Some(item)
    }

    /// The newest request of its longest flow.
    fn pop_newest(&mut self) -> Option<T> {
        let (&flow, _) = self.flows.iter().max_by_key(|(_, q)| q.len())?;
        let queue = self.flows.get_mut(&flow)?;
        let item = queue.pop_back()?;
        if queue.is_empty() {
            self.flows.remove(&flow);
            self.turn.retain(|f| *f != flow);
        }
        self.len -= 1;
        Some(item)
    }

    fn remove(&mut self, flow: u64, item: &T) -> bool
    where
        T: PartialEq,
    {
        let Some(queue) = self.flows.get_mut(&flow) else {
            return false;
        };
        let Some(at) = queue.iter().position(|i| i == item) else {
            return false;
        };
        queue.remove(at);
        if queue.is_empty() {
            self.flows.remove(&flow);
            self.turn.retain(|f| *f != flow);
        }
        self.len -= 1;
        true
    }
}

/// Requests waiting, taken in turn across clients, then flows.
#[derive(Debug)]
pub(crate) struct Fair<T> {
    lanes: super::IdMap<u64, Lane<T>>,
    turn: VecDeque<u64>,
    len: usize,
}

impl<T: PartialEq> Fair<T> {
    pub(crate) fn new() -> Self {
        Self {
            lanes: super::IdMap::default(),
            turn: VecDeque::new(),
            len: 0,
        }
    }

    /// Requests waiting in all.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Requests of `client` waiting.
    pub(crate) fn held(&self, client: u64) -> usize {
        self.lanes.get(&client).map_or(0, |lane| lane.len)
    }

    /// Queues `item` from `sender` within `bounds`. When the queue is full
    /// and another client holds more than `sender`'s client would, that
    /// client's newest request makes room: it is returned, to be shed.
    pub(crate) fn push(
        &mut self,
        sender: Sender,
        item: T,
        bounds: Bounds,
    ) -> Result<Option<(u64, T)>, Refused> {
        let held = self.held(sender.client);
        let refused = Refused {
            waiting: self.len,
            held,
        };
        if held >= bounds.share.max(1) {
            return Err(refused);
        }
        let mut evicted = None;
        if self.len >= bounds.total.max(1) {
            let heaviest = self
                .lanes
                .iter()
                .filter(|(client, _)| **client != sender.client)
                .max_by_key(|(_, lane)| lane.len)
                .map(|(client, lane)| (*client, lane.len));
            match heaviest {
                Some((client, len)) if len > held + 1 => {
                    evicted = self.pop_newest(client).map(|item| (client, item));
                }
                _ => return Err(refused),
            }
        }
        let lane = self.lanes.entry(sender.client).or_insert_with(Lane::new);
        if lane.len == 0 {
            self.turn.push_back(sender.client);
        }
        lane.push(sender.flow, item);
        self.len += 1;
        Ok(evicted)
    }

    /// The next request, in turn.
    pub(crate) fn pop(&mut self) -> Option<T> {
        let client = self.turn.pop_front()?;
        let lane = self.lanes.get_mut(&client)?;
        let item = lane.pop()?;
        if lane.len == 0 {
            self.lanes.remove(&client);
        } else {
            self.turn.push_back(client);
        }
        self.len -= 1;
        Some(item)
    }

    fn pop_newest(&mut self, client: u64) -> Option<T> {
        let lane = self.lanes.get_mut(&client)?;
        let item = lane.pop_newest()?;
        if lane.len == 0 {
            self.lanes.remove(&client);
            self.turn.retain(|c| *c != client);
        }
        self.len -= 1;
        Some(item)
    }

    /// Takes `item` of `sender` out (it was withdrawn, or waited too long).
    pub(crate) fn remove(&mut self, sender: Sender, item: &T) -> bool {
        let Some(lane) = self.lanes.get_mut(&sender.client) else {
            return false;
        };
        if !lane.remove(sender.flow, item) {
            return false;
        }
        if lane.len == 0 {
            self.lanes.remove(&sender.client);
            self.turn.retain(|c| *c != sender.client);
        }
        self.len -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(client: u64, flow: u64) -> Sender {
        Sender { client, flow }
    }

    const WIDE: Bounds = Bounds {
        total: 1000,
        share: 1000,
    };

    /// A queue holding `items`, pushed in order within [`WIDE`] bounds.
    fn queued(items: impl IntoIterator<Item = (Sender, i32)>) -> Fair<i32> {
        let mut q = Fair::new();
        for (sender, item) in items {
            assert_eq!(q.push(sender, item, WIDE), Ok(None), "item {item}");
        }
        q
    }

    /// What `q` holds, in the order it hands it out.
    fn drain(q: &mut Fair<i32>) -> Vec<i32> {
        std::iter::from_fn(|| q.pop()).collect()
    }

    #[test]
    fn r25_one_request_of_a_quiet_client_waits_for_one_of_a_bursting_client() {
        let mut q = queued((0..200).map(|i| (s(1, 0), i)).chain([(s(2, 0), 1000)]));
        assert_eq!(q.pop(), Some(0));
        assert_eq!(q.pop(), Some(1000), "the quiet client's turn comes next");
        assert_eq!(q.pop(), Some(1));
        assert_eq!(q.len(), 198);
    }

    #[test]
    fn r25_flows_of_one_client_take_turns_and_each_flow_is_first_in_first_out() {
        let mut q = queued(
            (0..3)
                .map(|i| (s(1, 7), i))
                .chain([(s(1, 8), 100), (s(2, 0), 200)]),
        );
        assert_eq!(drain(&mut q), vec![0, 200, 100, 1, 2]);
        assert!(q.is_empty());
    }

    #[test]
    fn r25_a_client_holds_at_most_its_share() {
        let mut q = Fair::new();
        let bounds = Bounds { total: 8, share: 2 };
        q.push(s(1, 0), 1, bounds).unwrap();
        q.push(s(1, 1), 2, bounds).unwrap();
        assert_eq!(
            q.push(s(1, 0), 3, bounds),
            Err(Refused {
                waiting: 2,
                held: 2
            })
        );
        assert_eq!(q.push(s(2, 0), 4, bounds), Ok(None));
    }

    #[test]
    fn r25_a_full_queue_sheds_the_newest_request_of_the_client_holding_the_most() {
        let mut q = Fair::new();
        let bounds = Bounds { total: 4, share: 4 };
        for i in 0..4 {
            q.push(s(1, 0), i, bounds).unwrap();
        }
        // Client 2 holds nothing: client 1's newest makes room.
        assert_eq!(q.push(s(2, 0), 10, bounds), Ok(Some((1, 3))));
        // Client 1 itself is refused: it holds the most.
        assert_eq!(
            q.push(s(1, 0), 4, bounds),
            Err(Refused {
                waiting: 4,
                held: 3
            })
        );
        assert_eq!(q.push(s(3, 0), 20, bounds), Ok(Some((1, 2))));
        // Two, one and one: client 1 still holds the most.
        assert_eq!(q.push(s(4, 0), 30, bounds), Ok(Some((1, 1))));
        // One each: a fifth client would hold as many; refused.
        assert!(q.push(s(5, 0), 40, bounds).is_err());
        assert_eq!(drain(&mut q), vec![0, 10, 20, 30]);
    }

    #[test]
    fn r25_a_withdrawn_request_leaves_its_turn() {
        let mut q = queued([(s(1, 0), 1), (s(2, 0), 2), (s(2, 0), 3)]);
        assert!(q.remove(s(1, 0), &1));
        assert!(!q.remove(s(1, 0), &1));
        assert_eq!(q.held(1), 0);
        assert_eq!(drain(&mut q), vec![2, 3]);
    }
}
