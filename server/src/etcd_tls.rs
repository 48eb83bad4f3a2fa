//! TLS to etcd, shared by the registry and the decision log's anchor (both
//! reach the same etcd with the `[registry]` settings).

use std::path::PathBuf;

/// Client certificates and roots for `https://` endpoints.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// PEM roots to verify etcd's certificate with (the system's otherwise).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for etcd's `--client-cert-auth`.
    pub cert_file: Option<PathBuf>,
    /// PEM key of `cert_file`.
    pub key_file: Option<PathBuf>,
    /// Name to verify etcd's certificate against, when not the endpoint host.
    pub domain: Option<String>,
}

/// Why the TLS files of the etcd client cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EtcdTlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    #[error("cert_file and key_file go together")]
    HalfIdentity,
}

/// `options` with the user and password (both, or neither is used) and,
/// with the `etcd-tls` feature, the TLS files of an etcd client's settings.
pub(crate) fn with_credentials(
    mut options: etcd_client::ConnectOptions,
    username: Option<&String>,
    password: Option<&String>,
    tls: Option<&TlsFiles>,
) -> Result<etcd_client::ConnectOptions, EtcdTlsError> {
    if let (Some(user), Some(password)) = (username, password) {
        options = options.with_user(user.clone(), password.clone());
    }
    #[cfg(feature = "etcd-tls")]
    if let Some(tls) = tls {
        options = options.with_tls(tls_options(tls)?);
    }
    #[cfg(not(feature = "etcd-tls"))]
    let _ = tls;
    Ok(options)
}

/// The etcd client's TLS options for `tls`; the error names the file that
/// cannot be read or the settings that do not go together.
#[cfg(feature = "etcd-tls")]
pub(crate) fn tls_options(tls: &TlsFiles) -> Result<etcd_client::TlsOptions, EtcdTlsError> {
    let read = |path: &PathBuf| {
        crate::files::read(path, crate::files::MAX_SECRET_FILE_BYTES).map_err(|source| {
            EtcdTlsError::Read {
                path: path.clone(),
                source: std::sync::Arc::new(source),
            }
        })
    };
    let mut options = etcd_client::TlsOptions::new();
    if let Some(ca) = &tls.ca_file {
        options = options.ca_certificate(etcd_client::Certificate::from_pem(read(ca)?));
    }
    match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            options = options.identity(etcd_client::Identity::from_pem(read(cert)?, read(key)?));
        }
        (None, None) => {}
        _ => return Err(EtcdTlsError::HalfIdentity),
    }
    if let Some(domain) = &tls.domain {
        options = options.domain_name(domain.clone());
    }
    Ok(options)
}
