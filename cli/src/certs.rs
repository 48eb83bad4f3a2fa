//! A local certificate authority for development and tests
//! (`guardmesh certs DIR`).
//!
//! Creates a CA and certificates whose identities are SPIFFE-style URI SANs,
//! so that a mesh with mTLS on every link can be tried without any other
//! tooling. Not for production: use your organisation's CA there.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// Why certificates could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A certificate authority that can issue certificates.
pub struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// What to put in an issued certificate.
#[derive(Debug, Clone, Default)]
pub struct Subject {
    pub common_name: String,
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
    /// URI SANs (identities such as `spiffe://guardmesh.local/coordinator`).
    pub uris: Vec<String>,
    /// Issue a certificate that expired in the past (tests).
    pub expired: bool,
}

impl Subject {
    /// A certificate for a party on this machine: `localhost`, 127.0.0.1 and
    /// ::1, with the identity `spiffe://guardmesh.local/ID`.
    pub fn loopback(id: &str) -> Self {
        Self {
            common_name: id.to_owned(),
            dns: vec!["localhost".into()],
            ips: vec![
                IpAddr::from([127, 0, 0, 1]),
                IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]),
            ],
            uris: vec![format!("spiffe://{TRUST_DOMAIN}/{id}")],
            expired: false,
        }
    }
}

/// An issued certificate and its key, PEM encoded.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Authority {
    /// A new self-signed CA.
    pub fn new(name: &str) -> Result<Self, CertsError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(Self { issuer })
    }

    /// The CA certificate, PEM encoded.
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// Issues a certificate usable for both TLS server and client auth.
    pub fn issue(&self, subject: &Subject) -> Result<Issued, CertsError> {
        let mut params = CertificateParams::new(subject.dns.clone())?;
        params
            .distinguished_name
            .push(DnType::CommonName, subject.common_name.as_str());
        for ip in &subject.ips {
            params.subject_alt_names.push(SanType::IpAddress(*ip));
        }
        for uri in &subject.uris {
            params
                .subject_alt_names
                .push(SanType::URI(uri.as_str().try_into()?));
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        if subject.expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

fn write(path: &Path, text: &str) -> Result<(), CertsError> {
    write_mode(path, text, 0o644)
}

/// Writes a private key (or a file holding one) readable by its owner only.
fn write_secret(path: &Path, text: &str) -> Result<(), CertsError> {
    write_mode(path, text, 0o600)
}

fn write_mode(path: &Path, text: &str, mode: u32) -> Result<(), CertsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .map_err(|source| CertsError::Write {
            path: path.display().to_string(),
            source,
        })
}

impl Issued {
    /// Writes `NAME.pem` and `NAME-key.pem` into `dir`.
    pub fn write(&self, dir: &Path, name: &str) -> Result<(PathBuf, PathBuf), CertsError> {
        let cert = dir.join(format!("{name}.pem"));
        let key = dir.join(format!("{name}-key.pem"));
        write(&cert, &self.cert_pem)?;
        write_secret(&key, &self.key_pem)?;
        Ok((cert, key))
    }
}

/// The SPIFFE trust domain of the generated identities.
pub const TRUST_DOMAIN: &str = "guardmesh.local";

/// Creates `ca.pem` and certificates for the mesh, a coordinator, a
/// registrar, an admin and a guard in `dir`. Returns the files written.
pub fn generate(dir: &Path) -> Result<Vec<PathBuf>, CertsError> {
    generate_for(dir, None)
}

/// [`generate`]; with a Kubernetes `namespace`, the mesh's certificate also
/// names the Service `guardmesh` there, and `secrets.yaml` holds the
/// Secrets of the production overlay: `guardmesh-tls` for the mesh and
/// `guardmesh-coordinator`, `-registrar`, `-admin` and `-approver` for its
/// clients, each
/// `kubernetes.io/tls` with `ca.crt`.
pub fn generate_for(dir: &Path, namespace: Option<&str>) -> Result<Vec<PathBuf>, CertsError> {
    std::fs::create_dir_all(dir).map_err(|source| CertsError::Write {
        path: dir.display().to_string(),
        source,
    })?;
    let ca = Authority::new("guardmesh local CA")?;
    let ca_file = dir.join("ca.pem");
    write(&ca_file, &ca.cert_pem())?;
    let mut files = vec![ca_file];
    let mut secrets = String::new();
    for name in [
        "mesh",
        "coordinator",
        "registrar",
        "admin",
        "approver",
        "guard",
    ] {
        let mut subject = Subject::loopback(name);
        if let (Some(namespace), "mesh") = (namespace, name) {
            for dns in [
                "guardmesh".to_owned(),
                format!("guardmesh.{namespace}.svc"),
                format!("guardmesh.{namespace}.svc.cluster.local"),
            ] {
                subject.dns.push(dns);
            }
        }
        let issued = ca.issue(&subject)?;
        let (cert, key) = issued.write(dir, name)?;
        files.push(cert);
        files.push(key);
        if let Some(namespace) = namespace
            && name != "guard"
        {
            let secret = if name == "mesh" {
                "guardmesh-tls".to_owned()
            } else {
                format!("guardmesh-{name}")
            };
            secrets.push_str(&tls_secret(&secret, namespace, &issued, &ca.cert_pem()));
        }
    }
    if namespace.is_some() {
        let path = dir.join("secrets.yaml");
        write_secret(&path, &secrets)?;
        files.push(path);
    }
    Ok(files)
}

/// A `kubernetes.io/tls` Secret holding `issued` and the CA, as YAML.
fn tls_secret(name: &str, namespace: &str, issued: &Issued, ca_pem: &str) -> String {
    use base64::Engine;
    let b64 = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
    format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: {namespace}\n\
         type: kubernetes.io/tls\ndata:\n  tls.crt: {}\n  tls.key: {}\n  ca.crt: {}\n",
        b64(&issued.cert_pem),
        b64(&issued.key_pem),
        b64(ca_pem)
    )
}
