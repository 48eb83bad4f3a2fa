//! How the SDK reaches a mesh: plaintext, TLS, or mTLS, with an optional
//! bearer token.

use crate::error::ClientError;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, Endpoint};

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

/// How to connect: TLS and credentials.
#[derive(Debug, Clone, Default)]
pub struct Connection {
    pub tls: Option<Tls>,
    /// Bearer token sent with every request (the mesh accepts tokens only
    /// over TLS unless configured otherwise).
    pub token: Option<String>,
}

impl Connection {
    /// Opens a channel to `endpoint` with these settings.
    pub async fn channel(&self, endpoint: impl Into<String>) -> Result<Channel, ClientError> {
        #[allow(unused_mut)]
        let mut endpoint = Endpoint::from_shared(endpoint.into())?.tcp_nodelay(true);
        if let Some(tls) = &self.tls {
            #[cfg(feature = "tls")]
            {
                use tonic::transport::{Certificate, ClientTlsConfig, Identity};
                let mut config =
                    ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
                if let Some((cert, key)) = &tls.identity {
                    config = config.identity(Identity::from_pem(cert, key));
                }
                if let Some(domain) = &tls.domain {
                    config = config.domain_name(domain.clone());
                }
                endpoint = endpoint.tls_config(config)?;
            }
            #[cfg(not(feature = "tls"))]
            {
                let _ = tls;
                return Err(ClientError::Protocol(
                    "TLS requested but the SDK was built without the `tls` feature".into(),
                ));
            }
        }
        Ok(endpoint.connect().await?)
    }

    /// The `authorization` header value, if a token is set.
    pub(crate) fn authorization(&self) -> Result<Option<AsciiMetadataValue>, ClientError> {
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
