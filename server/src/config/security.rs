//! `[tls]`, `[auth]` and its principals, `[guard_tls]` and
//! `[endpoint_policy]`: who may talk to the mesh, and how the mesh talks to
//! guards; the settings that leave it open.

use super::Config;
use super::describe::table;
use crate::mesh::MeshConfig;
use crate::security::auth::Role;
use serde::Deserialize;
use std::path::PathBuf;

table! {
    /// `[tls]`: the mesh's certificate, and the CA of client certificates.
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct TlsConfig {
        /// PEM certificate chain of the mesh (reloaded when it changes).
        pub cert_file: PathBuf,
        /// PEM private key of cert_file.
        pub key_file: PathBuf,
        /// PEM CA: with it every client must present a certificate it signed
        /// (R24).
        #[serde(default)]
        pub client_ca_file: Option<PathBuf>,
    }
}

table! {
    /// `[auth]`: who may do what.
    #[derive(Debug, Clone, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct AuthConfig {
        /// Accept bearer tokens over plaintext from loopback clients
        /// (development only).
        #[serde(default)]
        pub plaintext_tokens_on_loopback: bool,
        // Default false: with a client CA every connection needs a
        // certificate (R24).
        /// With tls.client_ca_file: let a caller without a certificate
        /// authenticate with a bearer token alone.
        #[serde(default)]
        pub tokens_without_client_cert: bool,
        /// `[[auth.principal]]`: an identity (certificate URI SAN, or a
        /// token's name) and its roles.
        #[serde(default, rename = "principal")]
        pub principals: Vec<PrincipalConfig>,
    }
}

table! {
    /// `[[auth.principal]]`: an identity (certificate URI SAN, or a token's
    /// name) and its roles.
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct PrincipalConfig {
        /// The certificate's URI SAN, or the token's name.
        pub id: String,
        /// What the principal may do.
        pub roles: Vec<Role>,
        /// File holding the principal's bearer token (one line); unset:
        /// matched by certificate.
        #[serde(default)]
        pub token_file: Option<PathBuf>,
        /// With `register`: the guard names it may manage start with one of
        /// these.
        #[serde(default)]
        pub name_prefixes: Vec<String>,
        /// With `register`: most guards it may have registered at once.
        #[serde(default = "default_max_registrations")]
        pub max_registrations: usize,
    }
}

fn default_max_registrations() -> usize {
    64
}

table! {
    /// `[guard_tls]`: how the mesh verifies `https://` guards, and the client
    /// certificate it presents to guards that require mTLS.
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct GuardTlsConfig {
        /// PEM roots for guards' certificates.
        pub ca_file: PathBuf,
        /// PEM client certificate the mesh presents to guards.
        #[serde(default)]
        pub cert_file: Option<PathBuf>,
        /// PEM private key of cert_file.
        #[serde(default)]
        pub key_file: Option<PathBuf>,
    }
}

table! {
    /// `[endpoint_policy]`: which guard endpoints may be registered and
    /// dialed.
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct EndpointPolicyConfig {
        /// CIDRs, addresses and host names (`*.suffix` allowed); empty: any
        /// host that is not denied.
        pub allow: Vec<String>,
        /// Refuse link-local and cloud metadata addresses (169.254.0.0/16,
        /// fe80::/10, metadata host names).
        pub deny_link_local: bool,
    }
}

impl Default for EndpointPolicyConfig {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            deny_link_local: true,
        }
    }
}

/// Why the security settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(transparent)]
    Tls(#[from] crate::security::tls::TlsError),
    #[error("[endpoint_policy]: {0}")]
    Policy(#[from] crate::link::dial::AllowListError),
    #[error("[auth] principal {id:?}: cannot read token file {path}: {source}")]
    Token {
        id: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("[auth] principal {0:?}: its token file is empty")]
    EmptyToken(String),
    #[error("[[guard]] entry {index} ({name:?}): {source}")]
    Guard {
        index: usize,
        name: String,
        #[source]
        source: Box<crate::registry::spec::SpecError>,
    },
    #[error(
        "[[guard]] entry {index} ({name:?}): endpoint {endpoint} is refused by the endpoint policy: {why}"
    )]
    GuardEndpoint {
        index: usize,
        name: String,
        endpoint: String,
        why: String,
    },
    #[error("[[guard]] entry {index} ({name:?}): its check was interrupted")]
    GuardInterrupted { index: usize, name: String },
}

impl Config {
    /// The mesh settings with the security sections loaded (certificate,
    /// key and token files are read here), the `[[guard]]` entries checked
    /// as a `Register` call is.
    pub fn build(&self) -> Result<MeshConfig, SecurityError> {
        self.build_with_guards().map(|(config, _)| config)
    }

    pub(super) fn build_security(&self) -> Result<MeshConfig, SecurityError> {
        let mut config = self.mesh_config();
        let security = &mut config.security;
        security.listener = self.server.listener_limits();
        if let Some(tls) = &self.tls {
            security.server_tls = Some(crate::security::tls::ServerTls::new(
                &tls.cert_file,
                &tls.key_file,
                tls.client_ca_file.as_deref(),
            )?);
        }
        if let Some(guard_tls) = &self.guard_tls {
            security.guard_tls = Some(std::sync::Arc::new(crate::link::dial::GuardTls::new(
                &guard_tls.ca_file,
                guard_tls.cert_file.as_deref(),
                guard_tls.key_file.as_deref(),
            )?));
        }
        security.endpoint_policy = std::sync::Arc::new(
            crate::link::dial::EndpointPolicy::new(
                &self.endpoint_policy.allow,
                self.endpoint_policy.deny_link_local,
            )
            .map_err(SecurityError::Policy)?,
        );
        if let Some(auth) = &self.auth {
            let mut principals = Vec::new();
            for p in &auth.principals {
                let token = match &p.token_file {
                    None => None,
                    Some(path) => {
                        let text =
                            crate::files::read_to_string(path, crate::files::MAX_SECRET_FILE_BYTES)
                                .map_err(|source| SecurityError::Token {
                                    id: p.id.clone(),
                                    path: path.display().to_string(),
                                    source,
                                })?;
                        let token = text.trim().to_owned();
                        if token.is_empty() {
                            return Err(SecurityError::EmptyToken(p.id.clone()));
                        }
                        Some(token)
                    }
                };
                principals.push(crate::security::auth::Principal {
                    id: p.id.clone(),
                    token,
                    caller: crate::security::auth::Caller {
                        id: p.id.clone(),
                        roles: p.roles.iter().copied().collect(),
                        name_prefixes: p.name_prefixes.clone(),
                        max_registrations: p.max_registrations,
                    },
                });
            }
            security.auth = Some(std::sync::Arc::new(crate::security::auth::AuthPolicy {
                principals,
                plaintext_tokens_on_loopback: auth.plaintext_tokens_on_loopback,
                tokens_without_client_cert: auth.tokens_without_client_cert,
            }));
        }
        Ok(config)
    }

    /// Settings that leave the mesh open; printed as warnings at start.
    pub fn insecure_settings(&self) -> Vec<String> {
        let mut out = self.listener_insecure_settings();
        out.extend(self.mesh_insecure_settings());
        out
    }

    /// The [`Config::insecure_settings`] of the gRPC listener (`[tls]`,
    /// `[auth]`): moot for a mesh judging in a gateway's process, which
    /// opens no listener.
    pub fn listener_insecure_settings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.tls.is_none() {
            out.push("no [tls]: coordinators and registrars talk to the mesh in plaintext".into());
        } else if self
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_none())
        {
            out.push("[tls] has no client_ca_file: client certificates are not required".into());
        }
        let client_ca = self
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_some());
        match &self.auth {
            // R24: the client CA is enforced without roles too.
            None if client_ca => out.push(
                "no [auth]: any client with a valid certificate from client_ca_file may evaluate, \
                 list, register and deregister guards (no roles; clients without one are refused, \
                 health checks stay open)"
                    .into(),
            ),
            None => out.push(
                "no [auth]: any caller may evaluate, register and deregister guards, and answer approvals".into(),
            ),
            Some(auth) if client_ca && auth.tokens_without_client_cert => out.push(
                "[auth] tokens_without_client_cert: callers without a client certificate are \
                 admitted with a bearer token alone"
                    .into(),
            ),
            Some(auth) if auth.plaintext_tokens_on_loopback => out.push(
                "[auth] plaintext_tokens_on_loopback: bearer tokens accepted without TLS on loopback".into(),
            ),
            Some(_) => {}
        }
        out
    }

    /// The [`Config::insecure_settings`] of the mesh itself, listener or
    /// not (how it reaches its guards).
    pub fn mesh_insecure_settings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.endpoint_policy.deny_link_local {
            out.push(
                "[endpoint_policy] deny_link_local = false: guards may point at metadata addresses"
                    .into(),
            );
        }
        if self.guards.iter().any(|g| {
            g.endpoint.starts_with("https://")
                || g.replicas.iter().any(|r| r.starts_with("https://"))
        }) && self.guard_tls.is_none()
        {
            out.push("https guards but no [guard_tls]: they cannot be dialed".into());
        }
        out
    }
}
