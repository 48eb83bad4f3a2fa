//! TLS on the mesh's listener: certificates from files, reloaded on change
//! without a restart, and client certificates checked after the handshake.
//!
//! Why check client certificates *after* the handshake? A handshake failure
//! reaches the client as an opaque transport error. Accepting the handshake
//! (the client still proves it holds its key: the signature checks are the
//! real ones) and verifying the chain right after lets the mesh refuse a
//! missing, foreign, expired or ambiguous certificate with UNAUTHENTICATED
//! and a message that says which, before any request is served.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Pem { path: String, reason: String },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client CA: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// The crypto provider used everywhere in the mesh.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every certificate of a PEM file.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        path: shown.clone(),
        source,
    })?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: shown,
            reason: "no certificate found".into(),
        });
    }
    Ok(certs)
}

/// Reads the private key of a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        path: shown.clone(),
        source,
    })?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Pem {
        path: shown,
        reason: e.to_string(),
    })
}

/// A root store from a PEM file of CA certificates.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|e| TlsError::Pem {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// The single URI SAN of a certificate (its SPIFFE-style identity).
pub fn uri_identity(cert: &CertificateDer<'_>) -> Result<String, String> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| format!("unreadable certificate: {e}"))?;
    let uris: Vec<String> = parsed
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|name| match name {
                    GeneralName::URI(uri) => Some((*uri).to_owned()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    match uris.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err("the client certificate carries no URI SAN identity".into()),
        many => Err(format!(
            "the client certificate carries {} URI SANs; exactly one is accepted",
            many.len()
        )),
    }
}

/// Serves the certificate and key from files, reloading them when they
/// change. Connections already established keep the certificate they began
/// with; new ones get the new one.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: arc_swap::ArcSwap<CertifiedKey>,
    stamp: Mutex<Option<(SystemTime, SystemTime)>>,
}

impl ReloadingCert {
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Arc<Self>, TlsError> {
        let key = Self::read(cert_file, key_file)?;
        let this = Arc::new(Self {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: arc_swap::ArcSwap::from_pointee(key),
            stamp: Mutex::new(None),
        });
        *this.stamp.lock().unwrap_or_else(PoisonError::into_inner) = this.mtimes();
        Ok(this)
    }

    fn read(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, TlsError> {
        let certs = load_certs(cert_file)?;
        let key = load_key(key_file)?;
        Ok(CertifiedKey::from_der(certs, key, &provider())?)
    }

    fn mtimes(&self) -> Option<(SystemTime, SystemTime)> {
        let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        Some((m(&self.cert_file)?, m(&self.key_file)?))
    }

    /// Reloads when the files changed. A bad new pair is logged and the
    /// current certificate kept: a half-written rotation never takes the
    /// listener down. Returns whether a new certificate is in use.
    pub fn reload_if_changed(&self) -> bool {
        let now = self.mtimes();
        {
            let stamp = self.stamp.lock().unwrap_or_else(PoisonError::into_inner);
            if *stamp == now {
                return false;
            }
        }
        self.reload()
    }

    /// Reloads unconditionally (SIGHUP).
    pub fn reload(&self) -> bool {
        let stamp = self.mtimes();
        match Self::read(&self.cert_file, &self.key_file) {
            Ok(key) => {
                self.current.store(Arc::new(key));
                *self.stamp.lock().unwrap_or_else(PoisonError::into_inner) = stamp;
                tracing::info!(cert = %self.cert_file.display(), "server certificate reloaded");
                true
            }
            Err(error) => {
                tracing::warn!(%error, "server certificate not reloaded; keeping the current one");
                false
            }
        }
    }

    /// Polls the files every `every` until the returned task is aborted.
    pub fn watch(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                this.reload_if_changed();
            }
        })
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// Accepts any offered client certificate at the handshake, with the real
/// signature checks, and leaves the chain verdict to [`ServerTls::accept`].
#[derive(Debug)]
struct DeferredClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for DeferredClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Who is on the other end of a connection, as far as TLS can tell.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// Whether the connection is TLS.
    pub tls: bool,
    /// The client certificate's identity: `Ok(None)` when none was offered,
    /// `Err(why)` when one was offered and is not acceptable.
    pub identity: Result<Option<String>, String>,
    /// The verdict on the client certificate's chain (R24), apart from the
    /// identity it carries: a certificate from the client CA without a URI
    /// SAN is `Verified` here and refused only where roles need identities.
    pub client_cert: ClientCert,
}

/// What the listener made of a client certificate (R24).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientCert {
    /// The listener has no client CA (or is plaintext): none was asked for.
    NotAsked,
    /// The listener has a client CA and the client offered no certificate.
    Missing,
    /// A certificate was offered that does not chain to the client CA, or
    /// is not valid now; the reason.
    Rejected(String),
    /// A certificate from the client CA, valid at the handshake.
    Verified,
}

/// The mesh's TLS listener settings.
#[derive(Debug, Clone)]
pub struct ServerTls {
    config: Arc<rustls::ServerConfig>,
    pub cert: Arc<ReloadingCert>,
    client_verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// Whether a client certificate is required (a client CA is set).
    pub require_client_cert: bool,
}

impl ServerTls {
    /// TLS with `cert_file`/`key_file`; with `client_ca_file`, client
    /// certificates signed by that CA are required (mTLS).
    pub fn new(
        cert_file: &Path,
        key_file: &Path,
        client_ca_file: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let cert = ReloadingCert::load(cert_file, key_file)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?;
        let (builder, client_verifier) = match client_ca_file {
            Some(ca) => {
                let roots = Arc::new(load_roots(ca)?);
                let inner =
                    WebPkiClientVerifier::builder_with_provider(roots, provider()).build()?;
                let deferred = Arc::new(DeferredClientVerifier {
                    inner: inner.clone(),
                });
                (builder.with_client_cert_verifier(deferred), Some(inner))
            }
            None => (builder.with_no_client_auth(), None),
        };
        let mut config = builder.with_cert_resolver(cert.clone());
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            cert,
            require_client_cert: client_verifier.is_some(),
            client_verifier,
        })
    }

    /// Completes the handshake on `tcp` and says who the client is.
    pub async fn accept(&self, tcp: TcpStream) -> std::io::Result<MeshStream> {
        let remote = tcp.peer_addr().ok();
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config.clone());
        let tls = acceptor.accept(tcp).await?;
        let (client_cert, identity) = self.identify(&tls);
        Ok(MeshStream {
            inner: Inner::Tls(Box::new(tls)),
            info: PeerInfo {
                remote,
                tls: true,
                identity,
                client_cert,
            },
        })
    }

    fn identify(
        &self,
        tls: &tokio_rustls::server::TlsStream<TcpStream>,
    ) -> (ClientCert, Result<Option<String>, String>) {
        let Some(verifier) = &self.client_verifier else {
            return (ClientCert::NotAsked, Ok(None));
        };
        let Some((end_entity, intermediates)) = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.split_first())
        else {
            return (ClientCert::Missing, Ok(None));
        };
        if let Err(e) = verifier.verify_client_cert(end_entity, intermediates, UnixTime::now()) {
            let why = format!("client certificate rejected: {e}");
            return (ClientCert::Rejected(why.clone()), Err(why));
        }
        (ClientCert::Verified, uri_identity(end_entity).map(Some))
    }
}

enum Inner {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// A connection to the mesh, plain or TLS, with what is known of its peer.
pub struct MeshStream {
    inner: Inner,
    info: PeerInfo,
}

impl MeshStream {
    pub fn plain(tcp: TcpStream) -> Self {
        Self {
            info: PeerInfo {
                remote: tcp.peer_addr().ok(),
                tls: false,
                identity: Ok(None),
                client_cert: ClientCert::NotAsked,
            },
            inner: Inner::Plain(tcp),
        }
    }
}

impl tonic::transport::server::Connected for MeshStream {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for MeshStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Inner::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for MeshStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match &mut self.get_mut().inner {
            Inner::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Inner::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match &mut self.get_mut().inner {
            Inner::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Inner::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    /// h2 writes a frame's header and body with one call when the stream
    /// says it can (half the syscalls per message).
    fn is_write_vectored(&self) -> bool {
        match &self.inner {
            Inner::Plain(s) => s.is_write_vectored(),
            Inner::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Plain(s) => Pin::new(s).poll_flush(cx),
            Inner::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Inner::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Accepts connections on `listener`, with TLS when `tls` is set. A failed
/// handshake drops that connection only; the listener goes on. Handshakes
/// run concurrently, each bounded by `handshake_timeout`, so a slow client
/// cannot hold up others.
pub fn incoming(
    listener: TcpListener,
    tls: Option<ServerTls>,
    handshake_timeout: Duration,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<MeshStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, remote) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            match &tls {
                None => {
                    if tx.send(Ok(MeshStream::plain(tcp))).await.is_err() {
                        return;
                    }
                }
                Some(tls) => {
                    let tls = tls.clone();
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        match tokio::time::timeout(handshake_timeout, tls.accept(tcp)).await {
                            Ok(Ok(stream)) => {
                                let _ = tx.send(Ok(stream)).await;
                            }
                            Ok(Err(error)) => {
                                tracing::info!(%remote, %error, "TLS handshake failed");
                            }
                            Err(_) => {
                                tracing::info!(%remote, "TLS handshake timed out");
                            }
                        }
                    });
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
