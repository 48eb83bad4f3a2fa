//! The mesh's line for a failed accept, shared by its listeners (the gRPC
//! listener in [`crate::security::tls`] and the metrics endpoint): a leaf
//! that both import. The pauses are the shared ones of
//! [`guardmesh_client::listener::AcceptBackoff`].

use guardmesh_client::listener;

/// Pauses between failed accepts on one of the mesh's listeners, logged
/// (at most every few seconds) with the listener's name.
#[derive(Debug)]
pub(crate) struct AcceptBackoff {
    listener: &'static str,
    pauses: listener::AcceptBackoff,
}

impl AcceptBackoff {
    pub(crate) fn new(listener: &'static str) -> Self {
        Self {
            listener,
            pauses: listener::AcceptBackoff::new(),
        }
    }

    pub(crate) fn succeeded(&mut self) {
        self.pauses.succeeded();
    }

    /// Logs (throttled) and sleeps before the next accept.
    pub(crate) async fn failed(&mut self, error: &std::io::Error) {
        let listener = self.listener;
        self.pauses
            .failed(|failures| {
                tracing::warn!(
                    listener,
                    %error,
                    failures,
                    "accept failed; backing off"
                );
            })
            .await;
    }
}
