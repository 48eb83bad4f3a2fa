//! How the mesh reaches guards: which endpoints it may dial at all, and the
//! TLS it speaks to them.
//!
//! A registration can point the mesh at any address, so it is checked twice:
//! at registration (the host as written) and when dialing, after DNS
//! resolution (so a name that resolves to a cloud metadata address is
//! refused too). By default link-local and metadata addresses are refused;
//! an allow-list narrows the rest.
//!
//! With `https://` endpoints the mesh verifies the guard's certificate
//! against the configured CA and, when the registration pins one, against
//! the expected identity (a DNS name, or a SPIFFE ID in a URI SAN), so a
//! registration cannot point the mesh at an impostor.

use crate::security::tls::{TlsError, load_certs, load_key, load_roots, provider, uri_identity};
use ipnet::IpNet;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;
use tonic::transport::Uri;

/// Host names of cloud metadata services.
const METADATA_HOSTS: &[&str] = &[
    "metadata",
    "metadata.google.internal",
    "metadata.goog",
    "instance-data",
    "instance-data.ec2.internal",
];

/// Why `host` (as written in an endpoint URL, IPv6 in brackets) is not an
/// unambiguous host, or `None` when it is one. Resolvers and URL parsers
/// disagree on these forms (`getaddrinfo` reads `0177.0.0.1`, `0x7f.1` and
/// `2130706433` as 127.0.0.1; a trailing dot makes `localhost.` and
/// `metadata.google.internal.` different strings for the same name; a zone
/// id picks an interface), so the host the endpoint policy checks would not
/// be the host the mesh dials. They are refused at registration and at dial.
pub fn ambiguous_host(host: &str) -> Option<&'static str> {
    if let Some(inner) = host.strip_prefix('[') {
        let Some(inner) = inner.strip_suffix(']') else {
            return Some("an IPv6 address must be in brackets");
        };
        if inner.contains('%') {
            return Some("an IPv6 zone id (`%...`) is not allowed");
        }
        if inner.parse::<std::net::Ipv6Addr>().is_err() {
            return Some("not an IPv6 address");
        }
        return None;
    }
    if host.is_empty() {
        return Some("the host is empty");
    }
    if host.ends_with('.') {
        return Some("a host with a trailing dot is not allowed: write it without the dot");
    }
    if !host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Some("a host name may only have letters, digits, '-', '_' and '.'");
    }
    if host.split('.').any(str::is_empty) {
        return Some("a host name must not have an empty label");
    }
    // As URL parsers do (WHATWG "ends in a number"): a host whose last label
    // is a number is an IPv4 address, and only the plain dotted quad (four
    // decimal parts, no leading zeros) reads the same everywhere.
    let last = host.rsplit('.').next().unwrap_or_default();
    let hex = last
        .strip_prefix("0x")
        .or_else(|| last.strip_prefix("0X"))
        .is_some_and(|digits| digits.bytes().all(|b| b.is_ascii_hexdigit()));
    if (hex || last.bytes().all(|b| b.is_ascii_digit()))
        && host.parse::<std::net::Ipv4Addr>().is_err()
    {
        return Some(
            "a numeric host must be a dotted-quad IPv4 address (decimal, hex, octal and \
             short forms are read differently by different resolvers)",
        );
    }
    None
}

/// An `[endpoint_policy] allow` entry that is neither a CIDR nor a host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allow-list entry {entry:?} is neither a CIDR nor a host")]
pub struct AllowListError {
    pub entry: String,
}

/// Why the endpoint policy refuses a host or an address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointRefused {
    /// Never dialed: unspecified, multicast, link-local or metadata.
    #[error("{ip} is {why}")]
    Denied { ip: IpAddr, why: &'static str },
    #[error("{host} is a cloud metadata host")]
    MetadataHost { host: String },
    #[error("{host} is not in the endpoint allow-list")]
    HostNotAllowed { host: String },
    #[error("{ip} is not in the endpoint allow-list")]
    IpNotAllowed { ip: IpAddr },
}

/// Which guard endpoints the mesh may dial.
#[derive(Debug, Clone)]
pub struct EndpointPolicy {
    nets: Vec<IpNet>,
    hosts: Vec<String>,
    /// Refuse link-local and metadata addresses (default true).
    pub deny_link_local: bool,
}

impl Default for EndpointPolicy {
    fn default() -> Self {
        Self {
            nets: Vec::new(),
            hosts: Vec::new(),
            deny_link_local: true,
        }
    }
}

impl EndpointPolicy {
    /// An allow-list of CIDRs/addresses and host names (`*.suffix` globs).
    /// Empty allows every host not denied.
    pub fn new(allow: &[String], deny_link_local: bool) -> Result<Self, AllowListError> {
        let mut policy = Self {
            deny_link_local,
            ..Self::default()
        };
        for entry in allow {
            let entry = entry.trim();
            if let Ok(net) = entry.parse::<IpNet>() {
                policy.nets.push(net);
            } else if let Ok(ip) = entry.parse::<IpAddr>() {
                policy.nets.push(IpNet::from(ip));
            } else if !entry.is_empty() && !entry.contains('/') {
                policy.hosts.push(entry.to_ascii_lowercase());
            } else {
                return Err(AllowListError {
                    entry: entry.to_owned(),
                });
            }
        }
        Ok(policy)
    }

    fn restricted(&self) -> bool {
        !self.nets.is_empty() || !self.hosts.is_empty()
    }

    fn denied_ip(&self, ip: IpAddr) -> Option<&'static str> {
        if ip.is_unspecified() || ip.is_multicast() {
            return Some("an unspecified or multicast address");
        }
        if !self.deny_link_local {
            return None;
        }
        let link_local = match ip {
            IpAddr::V4(v4) => v4.is_link_local() || v4.octets() == [100, 100, 100, 200],
            IpAddr::V6(v6) => {
                (v6.segments()[0] & 0xffc0) == 0xfe80
                    || v6 == std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)
                    || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_link_local())
            }
        };
        link_local.then_some("a link-local or cloud metadata address")
    }

    fn host_allowed(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        self.hosts
            .iter()
            .any(|pattern| match pattern.strip_prefix("*.") {
                Some(suffix) => host.ends_with(&format!(".{suffix}")),
                None => *pattern == host,
            })
    }

    /// Checks an endpoint's host as registered.
    pub fn check_host(&self, host: &str) -> Result<(), EndpointRefused> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return self.check_ip(ip, None);
        }
        if self.deny_link_local && METADATA_HOSTS.contains(&bare.to_ascii_lowercase().as_str()) {
            return Err(EndpointRefused::MetadataHost {
                host: host.to_owned(),
            });
        }
        if self.restricted() && !self.host_allowed(bare) {
            return Err(EndpointRefused::HostNotAllowed {
                host: host.to_owned(),
            });
        }
        Ok(())
    }

    /// Checks an address the mesh is about to dial. `host` is the name it
    /// was resolved from, if any: a name on the allow-list may resolve to
    /// any address that is not denied.
    pub fn check_ip(&self, ip: IpAddr, host: Option<&str>) -> Result<(), EndpointRefused> {
        if let Some(why) = self.denied_ip(ip) {
            return Err(EndpointRefused::Denied { ip, why });
        }
        let by_name = host.is_some_and(|h| self.host_allowed(h));
        if self.restricted() && !by_name && !self.nets.iter().any(|n| n.contains(&ip)) {
            return Err(EndpointRefused::IpNotAllowed { ip });
        }
        Ok(())
    }
}

/// TLS settings of the mesh's links to guards.
#[derive(Debug, Clone)]
pub struct GuardTls {
    roots: Arc<RootCertStore>,
    /// The mesh's client certificate and key, for guards that require mTLS.
    identity: Option<(
        Vec<CertificateDer<'static>>,
        Arc<rustls::pki_types::PrivateKeyDer<'static>>,
    )>,
}

impl GuardTls {
    pub fn new(
        ca_file: &Path,
        cert_file: Option<&Path>,
        key_file: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let identity = match (cert_file, key_file) {
            (Some(cert), Some(key)) => Some((load_certs(cert)?, Arc::new(load_key(key)?))),
            _ => None,
        };
        Ok(Self {
            roots: Arc::new(load_roots(ca_file)?),
            identity,
        })
    }

    fn client_config(&self, pin: Option<&str>) -> Result<rustls::ClientConfig, rustls::Error> {
        let verifier = Arc::new(PinnedVerifier {
            roots: self.roots.clone(),
            pin: pin.map(str::to_owned),
            provider: provider(),
        });
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match &self.identity {
            Some((certs, key)) => builder.with_client_auth_cert(certs.clone(), key.clone_key())?,
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// Verifies a guard's certificate chain against the CA, then its identity:
/// the pinned one when set (a SPIFFE ID or a name), else the dialed host.
#[derive(Debug)]
struct PinnedVerifier {
    roots: Arc<RootCertStore>,
    pin: Option<String>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        match self.pin.as_deref() {
            Some(pin) if pin.contains("://") => {
                let found = uri_identity(end_entity).map_err(|e| refused(e.to_string()))?;
                if found != pin {
                    return Err(refused(format!(
                        "guard presented identity {found}, expected {pin}"
                    )));
                }
            }
            Some(pin) => {
                let name = ServerName::try_from(pin.to_owned())
                    .map_err(|e| rustls::Error::General(format!("pinned name {pin:?}: {e}")))?;
                rustls::client::verify_server_name(&parsed, &name)?;
            }
            None => rustls::client::verify_server_name(&parsed, server_name)?,
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A connection to a guard.
pub type GuardIo = crate::security::tls::PlainOrTls<tokio_rustls::client::TlsStream<TcpStream>>;

fn io_error(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, message)
}

/// A guard's certificate refused at the TLS handshake (R24): not the
/// pinned identity (an impostor), not valid for the name dialed, or not
/// issued by the CA. A dial's error holds it, so the link can tell a
/// refused replica (`guardmesh_guard_replica_certificate_refused_total`)
/// from one that is merely down.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CertificateRefused(String);

impl CertificateRefused {
    /// Whether `error`, or an error it was caused by, is a refused
    /// certificate.
    pub fn in_chain(error: &(dyn std::error::Error + 'static)) -> bool {
        let mut next = Some(error);
        while let Some(error) = next {
            if error.is::<Self>() {
                return true;
            }
            // An `io::Error`'s `source` skips the error it wraps.
            if let Some(inner) = error
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                && Self::in_chain(inner)
            {
                return true;
            }
            next = error.source();
        }
        false
    }
}

/// The verifier's refusal of a certificate that is not the pinned
/// identity: a certificate error, so the dial reports it as one.
fn refused(message: String) -> rustls::Error {
    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct NotPinned(String);
    rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
        Arc::new(NotPinned(message)),
    )))
}

/// A failed TLS handshake whose cause is the guard's certificate, as a
/// [`CertificateRefused`]; any other error as it was.
fn certificate_error(error: std::io::Error) -> std::io::Error {
    let message = match error
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other))) => {
            other.0.to_string()
        }
        Some(tls @ rustls::Error::InvalidCertificate(_)) => tls.to_string(),
        _ => return error,
    };
    std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        CertificateRefused(message),
    )
}

/// Dials one guard: resolves, applies the endpoint policy to every address,
/// connects, and speaks TLS for `https://` endpoints.
#[derive(Clone)]
pub struct GuardConnector {
    pub policy: Arc<EndpointPolicy>,
    pub tls: Option<Arc<GuardTls>>,
    /// The identity the guard must present (no impostors).
    pub pin: Option<String>,
    /// Speak TLS (the registered endpoint is `https://`). The channel itself
    /// is opened on an `http://` URI so that TLS happens here, once.
    pub https: bool,
    pub connect_timeout: Duration,
}

impl GuardConnector {
    async fn connect(self, uri: Uri) -> std::io::Result<hyper_util::rt::TokioIo<GuardIo>> {
        let written = uri
            .host()
            .ok_or_else(|| io_error(format!("{uri} has no host")))?;
        if let Some(why) = ambiguous_host(written) {
            return Err(io_error(format!(
                "endpoint policy refuses {written}: {why}"
            )));
        }
        let host = written
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let https = self.https || uri.scheme_str() == Some("https");
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let literal = host.parse::<IpAddr>().ok();
        let addrs: Vec<SocketAddr> = match literal {
            Some(ip) => vec![SocketAddr::new(ip, port)],
            None => tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect(),
        };
        let name = literal.is_none().then_some(host.as_str());
        let mut last = io_error(format!("{host} resolved to no address"));
        let mut tcp = None;
        for addr in addrs {
            if let Err(why) = self.policy.check_ip(addr.ip(), name) {
                last = io_error(format!("endpoint policy refuses {host}: {why}"));
                continue;
            }
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => {
                    tcp = Some(stream);
                    break;
                }
                Ok(Err(error)) => last = error,
                Err(_) => {
                    last = std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("connect to {addr} timed out"),
                    )
                }
            }
        }
        let tcp = tcp.ok_or(last)?;
        let _ = tcp.set_nodelay(true);
        if !https {
            return Ok(hyper_util::rt::TokioIo::new(GuardIo::Plain(tcp)));
        }
        let Some(tls) = &self.tls else {
            return Err(io_error(
                "https endpoint but no [guard_tls] CA is configured".into(),
            ));
        };
        let config = tls
            .client_config(self.pin.as_deref())
            .map_err(|e| io_error(format!("TLS configuration: {e}")))?;
        let server_name = ServerName::try_from(host.clone())
            .map_err(|e| io_error(format!("server name {host:?}: {e}")))?;
        let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(server_name, tcp)
            .await
            .map_err(certificate_error)?;
        Ok(hyper_util::rt::TokioIo::new(GuardIo::Tls(Box::new(stream))))
    }
}

impl GuardConnector {
    /// The connector of one replica of a guard registered at `registered`
    /// (R32). A replica found by resolving the registered name is dialed by
    /// its address, but it is still that name's guard: over TLS it must
    /// present the pinned identity, or, with no pin, the registered name
    /// (never merely a certificate for the IP address); and a name on the
    /// endpoint allow-list vouches for the addresses it resolved to, which
    /// were checked against the policy with that name when they were
    /// resolved (and are checked again, denied ranges first, at dial). A
    /// replica whose endpoint is the registered one, or that names its own
    /// host, gets this connector unchanged. (Over TLS the replica's
    /// connector is pinned to the name, so its `pin` differs from the
    /// registration's `server_identity` when that is empty.)
    pub fn for_replica(&self, registered: &str, replica: &str) -> Self {
        let mut connector = self.clone();
        let (Some(name), Some(ip)) = (uri_host(registered), uri_host(replica)) else {
            return connector;
        };
        let Ok(ip) = ip.parse::<IpAddr>() else {
            return connector;
        };
        if name.parse::<IpAddr>().is_ok() {
            return connector;
        }
        let tls = self.https || replica.starts_with("https://");
        if tls && connector.pin.is_none() {
            connector.pin = Some(name.to_owned());
        }
        if self.policy.restricted() && self.policy.check_ip(ip, Some(name)).is_ok() {
            let mut policy = (*self.policy).clone();
            policy.nets.push(IpNet::from(ip));
            connector.policy = Arc::new(policy);
        }
        connector
    }
}

/// The host of `scheme://host:port` (or `host:port`), without brackets.
fn uri_host(endpoint: &str) -> Option<&str> {
    let rest = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    let authority = rest.split('/').next()?;
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split_once(']')?.0,
        None => authority
            .rsplit_once(':')
            .map_or(authority, |(host, _)| host),
    };
    (!host.is_empty()).then_some(host)
}

impl tower::Service<Uri> for GuardConnector {
    type Response = hyper_util::rt::TokioIo<GuardIo>;
    type Error = std::io::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(self.clone().connect(uri))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssrf_default_policy_refuses_metadata_and_link_local() {
        let p = EndpointPolicy::default();
        for bad in [
            "169.254.169.254",
            "169.254.1.1",
            "[fe80::1]",
            "metadata.google.internal",
            "0.0.0.0",
        ] {
            assert!(p.check_host(bad).is_err(), "{bad}");
        }
        for ok in ["127.0.0.1", "10.1.2.3", "guards.internal", "[::1]"] {
            assert!(p.check_host(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn r16_ambiguous_hosts() {
        for bad in [
            "2130706433",
            "0x7f.0.0.1",
            "0177.0.0.1",
            "127.1",
            "localhost.",
            "169.254.169.254.",
            "[fe80::1%25eth0]",
            "[fe80::1",
            "a..b",
            "loc%61lhost",
            "",
        ] {
            assert!(ambiguous_host(bad).is_some(), "{bad}");
        }
        for ok in ["127.0.0.1", "localhost", "guards.svc", "[::1]", "a-b_c.d9"] {
            assert_eq!(ambiguous_host(ok), None, "{ok}");
        }
    }

    #[test]
    fn ssrf_allow_list_by_cidr_and_name() {
        let p = EndpointPolicy::new(&["127.0.0.0/8".into(), "*.guards.svc".into()], true).unwrap();
        assert!(p.check_host("127.0.0.1").is_ok());
        assert!(p.check_host("10.0.0.1").is_err());
        assert!(
            p.check_ip("10.0.0.7".parse().unwrap(), Some("a.guards.svc"))
                .is_ok()
        );
        assert!(
            p.check_ip("10.0.0.7".parse().unwrap(), Some("evil.example"))
                .is_err()
        );
        assert!(
            p.check_ip("169.254.169.254".parse().unwrap(), Some("a.guards.svc"))
                .is_err(),
            "a name on the list that resolves to metadata is still refused"
        );
        assert!(EndpointPolicy::new(&["10.0.0.0/33".into()], true).is_err());
    }

    fn connector(policy: EndpointPolicy, pin: Option<&str>) -> GuardConnector {
        GuardConnector {
            policy: Arc::new(policy),
            tls: None,
            pin: pin.map(str::to_owned),
            https: true,
            connect_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn r32_a_replica_reached_by_address_is_still_held_to_the_guards_name() {
        let base = connector(EndpointPolicy::default(), None);
        let replica = base.for_replica("https://guard.test:7001", "https://127.0.0.2:7001");
        assert_eq!(replica.pin.as_deref(), Some("guard.test"));
        // A pinned identity stays the one to verify.
        let pinned = connector(EndpointPolicy::default(), Some("spiffe://mesh/g"));
        let replica = pinned.for_replica("https://guard.test:7001", "https://[::1]:7001");
        assert_eq!(replica.pin.as_deref(), Some("spiffe://mesh/g"));
        // An address registration, or a replica named by its own host: as is.
        assert_eq!(
            base.for_replica("https://127.0.0.2:1", "https://127.0.0.2:1")
                .pin,
            None
        );
        assert_eq!(
            base.for_replica("https://guard.test:1", "https://pod-1.guard.test:1")
                .pin,
            None
        );
        // Plaintext has no identity to verify.
        let plain = GuardConnector {
            https: false,
            ..base.clone()
        };
        assert_eq!(
            plain
                .for_replica("http://guard.test:1", "http://127.0.0.2:1")
                .pin,
            None
        );
    }

    /// Whether `replica`'s policy lets it dial `ip`.
    fn vouched(replica: &GuardConnector, ip: &str) -> bool {
        replica.policy.check_ip(ip.parse().unwrap(), None).is_ok()
    }

    #[test]
    fn ssrf_a_name_on_the_allow_list_vouches_only_for_allowed_addresses() {
        let allow = EndpointPolicy::new(&["*.guards.svc".into()], true).unwrap();
        let base = connector(allow, None);
        let replica = base.for_replica("http://a.guards.svc:1", "http://10.0.0.7:1");
        assert!(vouched(&replica, "10.0.0.7"));
        assert!(!vouched(&replica, "10.0.0.8"));
        // Metadata is never vouched for, whatever the name.
        let replica = base.for_replica("http://a.guards.svc:1", "http://169.254.169.254:1");
        assert!(!vouched(&replica, "169.254.169.254"));
        // A name off the list vouches for nothing.
        let replica = base.for_replica("http://evil.example:1", "http://10.0.0.7:1");
        assert!(!vouched(&replica, "10.0.0.7"));
    }
}
