//! The mesh's listener: TLS with certificates from files, reloaded on change
//! without a restart, client certificates checked after the handshake, and
//! connections that must prove themselves HTTP/2 within a deadline (R25).
//!
//! Why check client certificates *after* the handshake? A handshake failure
//! reaches the client as an opaque transport error. Accepting the handshake
//! (the client still proves it holds its key: the signature checks are the
//! real ones) and verifying the chain right after lets the mesh refuse a
//! missing, foreign, expired or ambiguous certificate with UNAUTHENTICATED
//! and a message that says which, before any request is served.

use crate::accept::AcceptBackoff;
use crate::observe::metrics::Metrics;
use guardmesh_client::listener::{descriptors_for_connections, open_file_limit};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use std::future::Future;
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

/// The bytes of a PEM file, and its path as errors show it.
fn read_pem(path: &Path) -> Result<(String, Vec<u8>), TlsError> {
    let shown = path.display().to_string();
    let bytes =
        crate::files::read(path, crate::files::MAX_SECRET_FILE_BYTES).map_err(|source| {
            TlsError::Read {
                path: shown.clone(),
                source,
            }
        })?;
    Ok((shown, bytes))
}

/// Reads every certificate of a PEM file.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let (shown, bytes) = read_pem(path)?;
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
    let (shown, bytes) = read_pem(path)?;
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

/// The end of a certificate's validity period.
pub fn not_after(cert: &CertificateDer<'_>) -> Option<SystemTime> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let seconds = parsed.validity().not_after.timestamp();
    let seconds = u64::try_from(seconds).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(seconds))
}

/// Why a certificate yields no identity.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("unreadable certificate: {0}")]
    Unreadable(#[from] x509_parser::nom::Err<x509_parser::error::X509Error>),
    #[error("the client certificate carries no URI SAN identity")]
    NoUri,
    #[error("the client certificate carries {count} URI SANs; exactly one is accepted")]
    ManyUris { count: usize },
}

/// The single URI SAN of a certificate (its SPIFFE-style identity).
pub fn uri_identity(cert: &CertificateDer<'_>) -> Result<String, IdentityError> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())?;
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
        [] => Err(IdentityError::NoUri),
        many => Err(IdentityError::ManyUris { count: many.len() }),
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
    /// When a verified client certificate stops being valid. Checked on
    /// every call, so a connection kept open past its certificate's expiry
    /// is refused from then on (R24), not only at the handshake.
    pub cert_not_after: Option<SystemTime>,
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
        let cert_not_after = match client_cert {
            ClientCert::Verified => tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(not_after),
            _ => None,
        };
        Ok(MeshStream {
            inner: Inner::Tls(Box::new(tls)),
            info: PeerInfo {
                remote,
                tls: true,
                identity,
                client_cert,
                cert_not_after,
            },
            replay: Vec::new(),
            replayed: 0,
            _slot: None,
            cut_at: None,
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
        (
            ClientCert::Verified,
            uri_identity(end_entity)
                .map(Some)
                .map_err(|e| e.to_string()),
        )
    }
}

type Inner = PlainOrTls<tokio_rustls::server::TlsStream<TcpStream>>;

/// A connection to the mesh, plain or TLS, with what is known of its peer.
pub struct MeshStream {
    inner: Inner,
    info: PeerInfo,
    /// Bytes read ahead (the HTTP/2 preface and first SETTINGS frame), given
    /// to the server before anything else is read.
    replay: Vec<u8>,
    replayed: usize,
    /// This connection's place under the connection cap, and in the open
    /// connections gauge; freed when the connection closes.
    _slot: Option<Slot>,
    /// When the connection is cut, reads and writes failing from then on:
    /// its maximum age and the grace after its GOAWAY have passed.
    cut_at: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl MeshStream {
    pub fn plain(tcp: TcpStream) -> Self {
        Self {
            info: PeerInfo {
                remote: tcp.peer_addr().ok(),
                tls: false,
                identity: Ok(None),
                client_cert: ClientCert::NotAsked,
                cert_not_after: None,
            },
            inner: Inner::Plain(tcp),
            replay: Vec::new(),
            replayed: 0,
            _slot: None,
            cut_at: None,
        }
    }

    /// Fails reads and writes once `cut_at`, if set, has passed: the
    /// connection is then closed under its calls.
    fn past_age(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        let cut_at = self.cut_at.as_mut()?;
        cut_at.as_mut().poll(cx).is_ready().then(|| {
            std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "past server.max_connection_age_ms and its grace",
            )
        })
    }

    /// Reads the HTTP/2 client preface and the client's first frame, which
    /// must be SETTINGS (RFC 9113, 3.4), and keeps them for the server to
    /// read. A connection that sends anything else is not HTTP/2.
    async fn read_preface(&mut self) -> Result<(), Refused> {
        use tokio::io::AsyncReadExt;
        let head = H2_PREFACE.len() + FRAME_HEADER;
        let mut buf = vec![0u8; head];
        // Read as it comes, so that anything that is not the preface (an
        // HTTP/1 request, a TLS hello on a plaintext port) is refused at
        // once instead of after the timeout.
        let mut filled = 0;
        while filled < head {
            let n = self.read(&mut buf[filled..]).await.map_err(Refused::io)?;
            if n == 0 {
                return Err(Refused::Closed);
            }
            filled += n;
            let seen = filled.min(H2_PREFACE.len());
            if buf[..seen] != H2_PREFACE[..seen] {
                return Err(Refused::BadPreface("not an HTTP/2 client preface"));
            }
        }
        let frame = &buf[H2_PREFACE.len()..];
        let length =
            usize::from(frame[0]) << 16 | usize::from(frame[1]) << 8 | usize::from(frame[2]);
        let (kind, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        if kind != FRAME_SETTINGS || flags & FLAG_ACK != 0 || stream != 0 {
            return Err(Refused::BadPreface("the first frame is not SETTINGS"));
        }
        if length % 6 != 0 || length > MAX_FIRST_FRAME {
            return Err(Refused::BadPreface("malformed first SETTINGS frame"));
        }
        buf.resize(head + length, 0);
        self.read_exact(&mut buf[head..])
            .await
            .map_err(Refused::io)?;
        self.replay = buf;
        self.replayed = 0;
        Ok(())
    }
}

/// The HTTP/2 client connection preface.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const FRAME_SETTINGS: u8 = 0x4;
const FLAG_ACK: u8 = 0x1;
/// The largest first frame: the default SETTINGS_MAX_FRAME_SIZE, which binds
/// a client until it has the server's settings.
const MAX_FIRST_FRAME: usize = 16_384;

/// Why a connection was closed before it carried a request; the reason is
/// the label of `guardmesh_connections_refused_total`.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("the TLS handshake and HTTP/2 preface took longer than the handshake timeout")]
    Timeout,
    #[error("TLS handshake failed: {0}")]
    Handshake(std::io::Error),
    #[error("{0}")]
    BadPreface(&'static str),
    #[error("closed before sending the HTTP/2 preface")]
    Closed,
    #[error("read failed: {0}")]
    Read(std::io::Error),
}

impl Refused {
    fn io(error: std::io::Error) -> Self {
        if error.kind() == std::io::ErrorKind::UnexpectedEof {
            Self::Closed
        } else {
            Self::Read(error)
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Self::Timeout => "handshake_timeout",
            Self::Handshake(_) => "handshake_failed",
            Self::BadPreface(_) => "bad_preface",
            Self::Closed | Self::Read(_) => "closed",
        }
    }
}

/// A connection's place under the connection cap and in the open
/// connections gauge.
struct Slot {
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
    metrics: Arc<Metrics>,
}

impl Slot {
    fn new(permit: Option<tokio::sync::OwnedSemaphorePermit>, metrics: Arc<Metrics>) -> Self {
        metrics.connection_open(true);
        Self {
            _permit: permit,
            metrics,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.connection_open(false);
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
        let this = self.get_mut();
        if let Some(cut) = this.past_age(cx) {
            return Poll::Ready(Err(cut));
        }
        if this.replayed < this.replay.len() {
            let rest = &this.replay[this.replayed..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.replayed += n;
            if this.replayed == this.replay.len() {
                this.replay = Vec::new();
                this.replayed = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for MeshStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match this.past_age(cx) {
            Some(cut) => Poll::Ready(Err(cut)),
            None => Pin::new(&mut this.inner).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match this.past_age(cx) {
            Some(cut) => Poll::Ready(Err(cut)),
            None => Pin::new(&mut this.inner).poll_write_vectored(cx, bufs),
        }
    }

    /// h2 writes a frame's header and body with one call when the stream
    /// says it can (half the syscalls per message).
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A TCP connection, plain or under TLS (`T`: the client or the server side
/// of a TLS stream): the guard links' connections and the listener's.
pub enum PlainOrTls<T> {
    Plain(TcpStream),
    Tls(Box<T>),
}

impl<T: AsyncRead + Unpin> AsyncRead for PlainOrTls<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for PlainOrTls<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// How the mesh's listener treats connections before and between requests
/// (R25): what a client that connects and says nothing can hold.
#[derive(Debug, Clone)]
pub struct ListenerLimits {
    /// Time a new connection has to complete its TLS handshake (if any) and
    /// send the HTTP/2 client preface and first SETTINGS frame; a connection
    /// that has not is closed.
    pub handshake_timeout: Duration,
    /// Interval of the HTTP/2 PINGs the mesh sends on connections it has
    /// heard nothing from; `None`: no pings.
    pub keepalive_interval: Option<Duration>,
    /// How long a PING may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Most client connections open at once, handshaking or serving; past
    /// it a new connection is closed at once and counted. 0: automatic
    /// ([`automatic_connection_cap`]).
    pub max_connections: usize,
    /// A connection older than the first is sent GOAWAY, and closed when
    /// the second has passed since; `None`: connections live as long as
    /// their clients keep them.
    pub max_connection_age: Option<(Duration, Duration)>,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            keepalive_interval: Some(Duration::from_secs(60)),
            keepalive_timeout: Duration::from_secs(20),
            max_connections: 0,
            max_connection_age: None,
        }
    }
}

impl ListenerLimits {
    /// The connection cap in force: `max_connections`, or the automatic one.
    pub fn connection_cap(&self) -> Option<usize> {
        match self.max_connections {
            0 => automatic_connection_cap(),
            n => Some(n),
        }
    }
}

/// The connection cap when none is configured: the open-file limit less a
/// reserve (an eighth of it, at least 64) for guard links, the registry,
/// the metrics endpoint and the log, so that silent clients can never
/// leave the mesh without descriptors to reach its guards. `None` when the
/// process has no open-file limit.
pub fn automatic_connection_cap() -> Option<usize> {
    let limit = usize::try_from(open_file_limit()?).ok()?;
    Some(descriptors_for_connections(limit).max(16))
}

/// Accepts connections on `listener`, with TLS when `tls` is set, and hands
/// on only those that complete their handshake and send the HTTP/2 preface
/// and first SETTINGS frame within `limits.handshake_timeout` (R25); the
/// others are closed and counted. Handshakes run concurrently, so a slow
/// client cannot hold up others. Past the connection cap a new connection is
/// closed at once; failed accepts back off.
pub fn incoming(
    listener: TcpListener,
    tls: Option<ServerTls>,
    limits: &ListenerLimits,
    metrics: Arc<Metrics>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<MeshStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let handshake_timeout = limits.handshake_timeout;
    let max_age = limits.max_connection_age;
    let cap = limits.connection_cap();
    let slots = cap.map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1))));
    tokio::spawn(async move {
        let mut backoff = AcceptBackoff::new("grpc");
        let mut over_limit: u64 = 0;
        let mut over_limit_logged: Option<std::time::Instant> = None;
        loop {
            let (tcp, remote) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(pair) => {
                        backoff.succeeded();
                        pair
                    }
                    Err(error) => {
                        backoff.failed(&error).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            let permit = match &slots {
                None => None,
                Some(slots) => match slots.clone().try_acquire_owned() {
                    Ok(permit) => Some(permit),
                    Err(_) => {
                        // Closed at once: the cap keeps descriptors for the
                        // connections already open and for the guard links.
                        drop(tcp);
                        metrics.connection_refused("over_limit");
                        over_limit += 1;
                        if over_limit_logged.is_none_or(|at| at.elapsed() >= Duration::from_secs(5))
                        {
                            tracing::warn!(
                                max_connections = cap.unwrap_or_default(),
                                refused = over_limit,
                                "connection limit reached; new connections are closed"
                            );
                            over_limit_logged = Some(std::time::Instant::now());
                            over_limit = 0;
                        }
                        continue;
                    }
                },
            };
            let slot = Slot::new(permit, metrics.clone());
            // The server sends GOAWAY at the age (tonic's
            // max_connection_age); the cut after the grace is this
            // stream's, since tonic's own grace replaces the GOAWAY.
            let cut_at =
                max_age.map(|(age, grace)| Box::pin(tokio::time::sleep(age.saturating_add(grace))));
            let _ = tcp.set_nodelay(true);
            let tls = tls.clone();
            let tx = tx.clone();
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let ready = async {
                    let mut stream = match &tls {
                        None => MeshStream::plain(tcp),
                        Some(tls) => tls.accept(tcp).await.map_err(Refused::Handshake)?,
                    };
                    stream.read_preface().await?;
                    Ok::<_, Refused>(stream)
                };
                let ready = match tokio::time::timeout(handshake_timeout, ready).await {
                    Ok(ready) => ready,
                    Err(_) => Err(Refused::Timeout),
                };
                match ready {
                    Ok(mut stream) => {
                        stream._slot = Some(slot);
                        stream.cut_at = cut_at;
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Err(refused) => {
                        metrics.connection_refused(refused.reason());
                        tracing::debug!(%remote, reason = refused.reason(), "connection closed: {refused}");
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(year: i32, month: u8, day: u8) -> CertificateDer<'static> {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(year, month, day);
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    /// The end of validity that every call is checked against (R24).
    #[test]
    fn r24_not_after_reads_the_certificate_validity() {
        let expired = self_signed(2021, 1, 1);
        assert_eq!(
            not_after(&expired),
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_609_459_200))
        );
        let current = self_signed(2999, 1, 1);
        assert!(not_after(&current).is_some_and(|t| t > SystemTime::now()));
    }
}
