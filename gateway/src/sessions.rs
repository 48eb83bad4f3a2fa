//! `mcp http`: gateway sessions bound to their client (R31). The upstream's
//! `Mcp-Session-Id` never reaches the client: the gateway answers with an
//! id of its own, a 128-bit random secret, and maps it to the upstream's
//! both ways. A request naming a session id the gateway did not issue (the
//! upstream's own, a guessed one, one that ended or was forgotten) is
//! answered 404, as the MCP transport asks of an unknown session, and
//! nothing of it is judged or forwarded; the client then initializes a new
//! session. So a client that did not open a session cannot spend its
//! budgets, read its memory through `interceptor/invoke`, or join its
//! flows.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Sessions remembered at most; the oldest are forgotten first (their
/// clients get 404 and initialize again).
pub const MAX_SESSIONS: usize = 64 * 1024;

#[derive(Default)]
struct State {
    to_upstream: HashMap<String, String>,
    to_client: HashMap<String, String>,
    order: VecDeque<String>,
}

/// The gateway's sessions and the upstream's behind them.
#[derive(Default)]
pub struct Sessions {
    state: Mutex<State>,
}

impl Sessions {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The upstream's session behind the client's id; `None`: the gateway
    /// did not issue it (404).
    pub fn upstream(&self, client: &str) -> Option<String> {
        self.state().to_upstream.get(client).cloned()
    }

    /// The client's id for the upstream's session `upstream`, issued the
    /// first time the upstream names it.
    pub fn client(&self, upstream: &str) -> String {
        let mut state = self.state();
        if let Some(client) = state.to_client.get(upstream) {
            return client.clone();
        }
        let client = format!("gm-{:032x}", rand::random::<u128>());
        state.to_client.insert(upstream.to_owned(), client.clone());
        state
            .to_upstream
            .insert(client.clone(), upstream.to_owned());
        state.order.push_back(client.clone());
        while state.order.len() > MAX_SESSIONS {
            if let Some(old) = state.order.pop_front()
                && let Some(up) = state.to_upstream.remove(&old)
            {
                state.to_client.remove(&up);
            }
        }
        client
    }

    /// The client ended its session (DELETE).
    pub fn end(&self, client: &str) {
        let mut state = self.state();
        if let Some(up) = state.to_upstream.remove(client) {
            state.to_client.remove(&up);
        }
        state.order.retain(|c| c != client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r31_only_ids_the_gateway_issued_name_a_session() {
        let sessions = Sessions::default();
        let client = sessions.client("upstream-1");
        assert_ne!(client, "upstream-1");
        assert_eq!(sessions.client("upstream-1"), client, "one id per session");
        assert_eq!(sessions.upstream(&client).as_deref(), Some("upstream-1"));
        assert_eq!(
            sessions.upstream("upstream-1"),
            None,
            "the upstream's id is not one"
        );
        assert_ne!(sessions.client("upstream-2"), client);
        sessions.end(&client);
        assert_eq!(sessions.upstream(&client), None);
    }
}
