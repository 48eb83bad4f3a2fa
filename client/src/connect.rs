//! How the SDK reaches a mesh: plaintext, TLS, or mTLS, with an optional
//! bearer token. [`Coordinator`](crate::Coordinator) and
//! [`Registrar`](crate::Registrar) both connect through [`Connection`], so
//! they dial the same way (`TCP_NODELAY`, message limits, TLS) and send the
//! same [`Credentials`] on every call.
//!
//! An address is a URL (`http://host:port`, `https://host:port`) or just
//! `host:port`, which [`url`] completes with `https://` when TLS is
//! configured and `http://` otherwise.

pub use crate::MAX_MESSAGE_BYTES;
use crate::error::ClientError;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, Endpoint};

/// The URL for `address`: a URL as given, or `host:port` completed with
/// `https://` when `tls` is set and `http://` otherwise.
///
/// ```
/// use guardmesh_client::connect::url;
/// assert_eq!(url("127.0.0.1:50051", false), "http://127.0.0.1:50051");
/// assert_eq!(url("mesh.internal:443", true), "https://mesh.internal:443");
/// assert_eq!(url("http://127.0.0.1:50051", true), "http://127.0.0.1:50051");
/// ```
pub fn url(address: &str, tls: bool) -> String {
    let address = address.trim();
    if address.contains("://") {
        address.to_owned()
    } else if tls {
        format!("https://{address}")
    } else {
        format!("http://{address}")
    }
}

/// The URL for `address` (as [`url`]), refused unless it is a mesh's
/// address: `http://` or `https://`, a host, an optional port, and
/// nothing after it (no path, query or user). A mistyped scheme
/// (`http//mesh:50051`, `http:/mesh`) is refused here rather than dialed
/// as a host named `http`.
///
/// ```
/// use guardmesh_client::connect::validate;
/// assert_eq!(validate("mesh:50051", false).unwrap(), "http://mesh:50051");
/// assert!(validate("http//bad", false).is_err());
/// assert!(validate("ftp://mesh:21", false).is_err());
/// ```
pub fn validate(address: &str, tls: bool) -> Result<String, ClientError> {
    let refuse = |reason: &str| ClientError::Address {
        address: address.trim().to_owned(),
        reason: reason.to_owned(),
    };
    let trimmed = address.trim();
    if trimmed.is_empty() {
        return Err(refuse("empty: give host:port or http(s)://host:port"));
    }
    if !trimmed.contains("://") && trimmed.contains('/') {
        return Err(refuse(
            "a `/` without `scheme://`: write host:port or http(s)://host:port (a mistyped scheme?)",
        ));
    }
    let url = url(trimmed, tls);
    let uri: tonic::codegen::http::Uri = url
        .parse()
        .map_err(|e: tonic::codegen::http::uri::InvalidUri| refuse(&e.to_string()))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(refuse(&format!(
                "scheme {other:?}: the mesh is reached over http:// or https://"
            )));
        }
        None => return Err(refuse("no scheme")),
    }
    let Some(authority) = uri.authority() else {
        return Err(refuse("no host"));
    };
    if authority.host().is_empty() {
        return Err(refuse("no host"));
    }
    if authority.as_str().contains('@') {
        return Err(refuse(
            "a user in the address: credentials go in the token, never in the address",
        ));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(refuse(
            "a path or query after the host: give only the host and port",
        ));
    }
    Ok(url)
}

/// TLS settings for connecting to a mesh (feature `tls`).
#[derive(Debug, Clone, Default)]
pub struct Tls {
    /// PEM of the CA that signed the mesh's certificate.
    pub ca_pem: String,
    /// PEM certificate and key of this client, for mTLS.
    pub identity: Option<(String, String)>,
    /// The name to verify the mesh's certificate against, when it differs
    /// from the endpoint's host.
    pub domain: Option<String>,
}

/// How to connect: TLS and credentials. The default is plaintext without a
/// token.
#[derive(Debug, Clone, Default)]
pub struct Connection {
    /// TLS to the mesh; `None` for plaintext.
    pub tls: Option<Tls>,
    /// Bearer token sent with every request (the mesh accepts tokens only
    /// over TLS unless configured otherwise).
    pub token: Option<String>,
}

impl Connection {
    /// The URL this connection dials for `address` (see [`url`]).
    pub fn url(&self, address: &str) -> String {
        url(address, self.tls.is_some())
    }

    /// Opens a channel to `address` with these settings: `TCP_NODELAY`, and
    /// TLS when configured. The token is not part of the channel: it goes on
    /// each call, through [`Credentials`].
    pub async fn channel(&self, address: &str) -> Result<Channel, ClientError> {
        let (endpoint, address) = self.endpoint(address)?;
        endpoint
            .connect()
            .await
            .map_err(|source| ClientError::Connect { address, source })
    }

    /// The endpoint for `address` (validated, see [`validate`]) with these
    /// settings, and the URL it dials.
    pub(crate) fn endpoint(&self, address: &str) -> Result<(Endpoint, String), ClientError> {
        let address = validate(address, self.tls.is_some())?;
        let endpoint = Endpoint::from_shared(address.clone())
            .map_err(|error| ClientError::Address {
                address: address.clone(),
                reason: crate::error::cause(&error),
            })?
            .tcp_nodelay(true);
        let endpoint = self.with_tls(endpoint, &address)?;
        Ok((endpoint, address))
    }

    /// A channel to `address` whose every call carries this connection's
    /// [`Credentials`].
    pub(crate) async fn authorized(&self, address: &str) -> Result<Authorized, ClientError> {
        let credentials = Credentials::of(self)?;
        let channel = self.channel(address).await?;
        Ok(authorize(channel, credentials))
    }

    #[cfg(feature = "tls")]
    fn with_tls(&self, endpoint: Endpoint, address: &str) -> Result<Endpoint, ClientError> {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let Some(tls) = &self.tls else {
            return Ok(endpoint);
        };
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
        if let Some((cert, key)) = &tls.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        if let Some(domain) = &tls.domain {
            config = config.domain_name(domain.clone());
        }
        endpoint
            .tls_config(config)
            .map_err(|source| ClientError::Connect {
                address: address.to_owned(),
                source,
            })
    }

    #[cfg(not(feature = "tls"))]
    fn with_tls(&self, endpoint: Endpoint, address: &str) -> Result<Endpoint, ClientError> {
        match &self.tls {
            None => Ok(endpoint),
            Some(_) => Err(ClientError::Address {
                address: address.to_owned(),
                reason: "TLS requested but the SDK was built without the `tls` feature".into(),
            }),
        }
    }

    /// The `authorization` header value, if a token is set.
    fn authorization(&self) -> Result<Option<AsciiMetadataValue>, ClientError> {
        self.token
            .as_ref()
            .map(|t| {
                let mut value = format!("Bearer {}", t.trim())
                    .parse::<AsciiMetadataValue>()
                    .map_err(|_| {
                        ClientError::Protocol("the token is not valid header text".into())
                    })?;
                // Kept out of debug output and of HPACK's dynamic table.
                value.set_sensitive(true);
                Ok(value)
            })
            .transpose()
    }
}

/// The credentials a client sends with every request it makes (R24): the
/// bearer token, if one is set. Installed as the interceptor of every SDK
/// client, so no call path (unary, streaming, one added later) can leave it
/// out. The certificate, if any, is part of the channel itself.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    token: Option<AsciiMetadataValue>,
}

impl Credentials {
    /// No credentials beyond the channel's.
    pub fn none() -> Self {
        Self::default()
    }

    /// The credentials of `connection`.
    pub fn of(connection: &Connection) -> Result<Self, ClientError> {
        Ok(Self {
            token: connection.authorization()?,
        })
    }

    /// Whether a token is sent.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }
}

impl tonic::service::Interceptor for Credentials {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.token {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        Ok(request)
    }
}

/// A channel whose every request carries [`Credentials`].
pub type Authorized = tonic::service::interceptor::InterceptedService<Channel, Credentials>;

/// `channel` with `credentials` on every request.
pub(crate) fn authorize(channel: Channel, credentials: Credentials) -> Authorized {
    tonic::service::interceptor::InterceptedService::new(channel, credentials)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_is_a_url() {
        let plain = Connection::default();
        let tls = Connection {
            tls: Some(Tls::default()),
            token: None,
        };
        assert_eq!(plain.url("127.0.0.1:50051"), "http://127.0.0.1:50051");
        assert_eq!(plain.url(" localhost:1 "), "http://localhost:1");
        assert_eq!(tls.url("mesh:443"), "https://mesh:443");
        assert_eq!(tls.url("[::1]:50051"), "https://[::1]:50051");
        for given in ["http://127.0.0.1:50051", "https://mesh:443"] {
            assert_eq!(plain.url(given), given);
            assert_eq!(tls.url(given), given);
        }
    }

    #[tokio::test]
    async fn connect_error_names_the_address_and_the_cause() {
        // Port 1 on loopback: nothing listens there, the kernel refuses.
        let error = Connection::default()
            .channel("127.0.0.1:1")
            .await
            .unwrap_err();
        assert!(error.is_connect(), "{error:?}");
        assert_eq!(
            error.to_string(),
            "cannot connect to http://127.0.0.1:1: connection refused"
        );
        assert_eq!(error.code(), None);
    }

    #[test]
    fn a_mistyped_address_is_refused_not_dialed() {
        for bad in [
            "http//bad",
            "http:/mesh:1",
            "mesh:1/path",
            "ftp://mesh:21",
            "http://",
            "",
            "http://user:pw@mesh:1",
            "http://mesh:1/x?y",
        ] {
            let error =
                futures::executor::block_on(Connection::default().channel(bad)).expect_err(bad);
            assert!(
                matches!(&error, ClientError::Address { .. }),
                "{bad}: {error:?}"
            );
            assert!(
                error.to_string().contains("invalid mesh address"),
                "{error}"
            );
        }
        let error = validate("http//bad", false).unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid mesh address \"http//bad\": a `/` without `scheme://`: write host:port or \
             http(s)://host:port (a mistyped scheme?)"
        );
        for good in [
            "127.0.0.1:1",
            "http://mesh:1",
            "https://mesh:443/",
            "[::1]:50051",
            "mesh",
        ] {
            assert!(validate(good, false).is_ok(), "{good}");
        }
    }

    #[test]
    fn a_bad_address_is_named() {
        let error =
            futures::executor::block_on(Connection::default().channel("not a url")).unwrap_err();
        assert!(
            matches!(&error, ClientError::Address { address, .. } if address == "not a url"),
            "{error:?}"
        );
        assert!(
            error
                .to_string()
                .starts_with("invalid mesh address \"not a url\"")
        );
    }
}
