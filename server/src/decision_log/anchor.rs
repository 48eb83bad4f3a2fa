//! The etcd anchor of the decision log (R29): when the mesh's registry is
//! etcd and the log is signed, every checkpoint the writer writes is also
//! put to an etcd key of its own, where the log's writer cannot take it
//! back by editing files:
//!
//! ```text
//! <registry prefix>/decision-log/<key id>/<instance>
//! ```
//!
//! The value is the checkpoint's line exactly as the log and the witness
//! hold it (without newline). The instance is `[decision_log] instance`
//! when set, otherwise the host name and the log directory's absolute path
//! (`host:/var/lib/guardmesh/log`): one writer per directory, so one key
//! per chain. Two meshes given the same instance name overwrite each
//! other's anchor (and then refuse to start on each other's log): give each
//! its own.
//!
//! On open, the anchor is read (within the registry's dial timeout) and
//! checked with the key; a log that does not hold it is refused like one
//! behind its witness ([`LogError::Behind`](super::LogError::Behind), source
//! `etcd`), or continued after a signed gap record with `allow_gap`. An
//! anchor that cannot be read, or that is not a checkpoint signed by the
//! key, refuses the start: the mesh does not start on a log it cannot
//! check.
//!
//! Writing never holds up the log: the writer hands each checkpoint to
//! [`Publisher::offer`], which only replaces the pending line (the latest
//! checkpoint wins, at most one put in flight, one line pending). A task
//! puts it; a put that fails is logged, counted
//! (`decision_log_failures{kind="checkpoint_etcd"}`) and tried again after
//! a pause, unless a newer checkpoint replaced it by then.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use etcd_client::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::observe::metrics::Metrics;

/// How the anchor reaches etcd: the registry's settings (`[registry]`,
/// see `config.rs`), of which it uses the endpoints, prefix, credentials
/// and timeouts.
pub use crate::registry::etcd::EtcdConfig;

pub use crate::etcd_tls::TlsFiles as EtcdTls;

/// The pause after a failed put before the next try, doubled up to
/// [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(5);

/// Where checkpoints are anchored in etcd.
#[derive(Debug, Clone)]
pub struct AnchorConfig {
    /// The registry's endpoints, prefix, credentials and timeouts.
    pub etcd: EtcdConfig,
    /// The instance named in the key.
    pub instance: String,
}

/// The etcd key of the anchor of `instance`'s log signed with `key_id`.
pub fn anchor_key(prefix: &str, key_id: &str, instance: &str) -> String {
    format!(
        "{}/decision-log/{key_id}/{instance}",
        prefix.trim_end_matches('/')
    )
}

/// The default instance name: the host name and the log directory.
pub fn default_instance(dir: &std::path::Path) -> String {
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    format!("{}:{}", host_name(), dir.display())
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer given.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".to_owned();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// An anchor that cannot be read or written.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AnchorError {
    #[error("the settings cannot work: {0}")]
    Config(String),
    #[error("the settings cannot work: {0}")]
    Tls(#[from] crate::etcd_tls::EtcdTlsError),
    #[error("cannot reach etcd at {endpoints}: {cause}")]
    Unreachable { endpoints: String, cause: String },
    #[error("etcd refused {op} of {key}: {cause}")]
    Request {
        op: &'static str,
        key: String,
        cause: String,
    },
}

/// A client for the anchor's key.
pub struct AnchorClient {
    client: Client,
    timeout: Duration,
    endpoints: String,
}

impl AnchorClient {
    /// Connects with the registry's credentials (and TLS, with the
    /// `etcd-tls` feature), within its dial timeout.
    pub async fn connect(config: &EtcdConfig) -> Result<AnchorClient, AnchorError> {
        if config.endpoints.is_empty() {
            return Err(AnchorError::Config("no etcd endpoints".to_owned()));
        }
        let options =
            crate::registry::etcd::connect_options(config)?.with_timeout(config.request_timeout);
        let endpoints = config.endpoints.join(",");
        let unreachable = |cause: String| AnchorError::Unreachable {
            endpoints: endpoints.clone(),
            cause,
        };
        let client = tokio::time::timeout(
            config.dial_timeout,
            Client::connect(config.endpoints.clone(), Some(options)),
        )
        .await
        .map_err(|_| unreachable(format!("no answer within {:?}", config.dial_timeout)))?
        .map_err(|err| unreachable(err.to_string()))?;
        Ok(AnchorClient {
            client,
            timeout: config.request_timeout,
            endpoints,
        })
    }

    /// The value at `key`, if any.
    pub async fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, AnchorError> {
        let request = |cause: String| AnchorError::Request {
            op: "a read",
            key: key.to_owned(),
            cause,
        };
        let answer = tokio::time::timeout(self.timeout, self.client.get(key, None))
            .await
            .map_err(|_| request(format!("no answer within {:?}", self.timeout)))?
            .map_err(|err| request(err.to_string()))?;
        Ok(answer.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Puts `value` at `key`.
    pub async fn put(&mut self, key: &str, value: &[u8]) -> Result<(), AnchorError> {
        let request = |cause: String| AnchorError::Request {
            op: "a write",
            key: key.to_owned(),
            cause,
        };
        tokio::time::timeout(self.timeout, self.client.put(key, value, None))
            .await
            .map_err(|_| request(format!("no answer within {:?}", self.timeout)))?
            .map_err(|err| request(err.to_string()))?;
        Ok(())
    }

    /// The endpoints, for messages.
    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }
}

/// Checkpoints that could not be kept outside the log, counted before and
/// after the mesh's metrics are attached
/// (`decision_log_failures{kind="checkpoint_witness"|"checkpoint_etcd"}`).
#[derive(Debug, Default)]
pub struct OutsideFailures {
    metrics: OnceLock<Arc<Metrics>>,
    witness: AtomicU64,
    etcd: AtomicU64,
}

impl OutsideFailures {
    /// Counts one failure of `kind` (`checkpoint_witness`,
    /// `checkpoint_etcd`).
    pub(crate) fn count(&self, kind: &'static str) {
        let counter = match kind {
            "checkpoint_witness" => &self.witness,
            _ => &self.etcd,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(metrics) = self.metrics.get() {
            metrics.decision_log_failure(kind);
        }
    }

    /// From now on failures are counted in `metrics` too, with those
    /// counted before.
    pub(crate) fn attach(&self, metrics: Arc<Metrics>) {
        if self.metrics.set(metrics.clone()).is_err() {
            return;
        }
        for (kind, counter) in [
            ("checkpoint_witness", &self.witness),
            ("checkpoint_etcd", &self.etcd),
        ] {
            for _ in 0..counter.load(Ordering::Relaxed) {
                metrics.decision_log_failure(kind);
            }
        }
    }

    /// Failed puts to etcd so far.
    pub fn etcd(&self) -> u64 {
        self.etcd.load(Ordering::Relaxed)
    }

    /// Failed witness writes so far.
    pub fn witness(&self) -> u64 {
        self.witness.load(Ordering::Relaxed)
    }
}

/// Hands checkpoints to the task that puts them to etcd.
pub(crate) struct Publisher {
    tx: watch::Sender<Option<Arc<Vec<u8>>>>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").finish_non_exhaustive()
    }
}

impl Publisher {
    /// Starts the task on the current runtime; `client` is the connection
    /// opened for the start check.
    pub(crate) fn start(
        client: AnchorClient,
        config: EtcdConfig,
        key: String,
        failures: Arc<OutsideFailures>,
    ) -> Publisher {
        let (tx, rx) = watch::channel(None);
        let task = tokio::spawn(put_latest(client, config, key, rx, failures));
        Publisher { tx, task }
    }

    /// The checkpoint `line` is the latest: replaces the one pending, if
    /// any. Never blocks.
    pub(crate) fn offer(&self, line: &[u8]) {
        self.tx.send_replace(Some(Arc::new(line.to_vec())));
    }

    /// Stops at once, nothing offered (the log did not open).
    pub(crate) fn abort(self) {
        self.task.abort();
    }

    /// Stops taking checkpoints and waits, at most `within`, for the last
    /// one to be put.
    pub(crate) async fn finish(self, within: Duration) {
        let Publisher { tx, mut task } = self;
        drop(tx);
        if tokio::time::timeout(within, &mut task).await.is_err() {
            task.abort();
            tracing::error!(
                "decision log: the last checkpoint was not put to etcd before shutdown"
            );
        }
    }
}

/// The task: puts the latest checkpoint, one at a time, until the writer
/// is gone and the last one is put (or failed once more).
async fn put_latest(
    client: AnchorClient,
    config: EtcdConfig,
    key: String,
    mut rx: watch::Receiver<Option<Arc<Vec<u8>>>>,
    failures: Arc<OutsideFailures>,
) {
    let mut client = Some(client);
    let mut wait = true;
    loop {
        // `changed` fails once the writer is gone and its last line seen.
        if wait && rx.changed().await.is_err() {
            return;
        }
        wait = true;
        let Some(line) = rx.borrow_and_update().clone() else {
            continue;
        };
        let mut pause = FIRST_RETRY;
        let mut closing = false;
        loop {
            let result = match client.as_mut() {
                Some(c) => c.put(&key, &line).await,
                None => match AnchorClient::connect(&config).await {
                    Ok(mut c) => {
                        let result = c.put(&key, &line).await;
                        client = Some(c);
                        result
                    }
                    Err(error) => Err(error),
                },
            };
            let Err(error) = result else { break };
            failures.count("checkpoint_etcd");
            tracing::error!(
                %error,
                key = %key,
                seq = seq_of(&line),
                "decision log: checkpoint not anchored in etcd"
            );
            if matches!(error, AnchorError::Unreachable { .. }) {
                client = None;
            }
            if closing {
                return;
            }
            // A newer checkpoint replaces this one; otherwise it is tried
            // again after the pause (once more if the writer closed).
            tokio::select! {
                changed = rx.changed() => match changed {
                    Ok(()) => {
                        wait = false;
                        break;
                    }
                    Err(_) => closing = true,
                },
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(MAX_RETRY);
        }
    }
}

/// The `seq` of a checkpoint line, for log lines.
fn seq_of(line: &[u8]) -> u64 {
    super::chain::Header::parse(line).map_or(0, |h| h.seq)
}

#[cfg(test)]
mod tests {
    use super::EtcdConfig;

    /// A printed anchor configuration (a `{:?}` in a log line or an
    /// error) shows who connects, never the password.
    #[test]
    fn debug_redacts_the_password() {
        let mut config = EtcdConfig::plain(vec!["http://127.0.0.1:2379".into()], "/gm");
        config.username = Some("anchor".into());
        config.password = Some("s3cret-anchor-password".into());
        let printed = format!("{config:?}");
        assert!(!printed.contains("s3cret-anchor-password"), "{printed}");
        assert!(
            printed.contains("anchor") && printed.contains("<redacted>"),
            "{printed}"
        );
    }
}
