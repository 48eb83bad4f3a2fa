//! Command-line flags that say how to reach a mesh (feature `args`): the
//! one definition the `guardmesh` commands (`guards`, `evaluate`, `replay`)
//! and the MCP gateway and hooks (`mcp`, `hook`) share, so that they read a
//! token and infer `https://` the same way.
//!
//! * The address is a URL, or `host:port`, which is `https://` when
//!   `--ca-file` is given and `http://` otherwise (as [`crate::connect::url`]
//!   completes it).
//! * An `https://` address needs `--ca-file`; TLS flags with an `http://`
//!   address are refused rather than ignored.
//! * The token is the first line of `--token-file`, which wins over
//!   `--token` and `GUARDMESH_TOKEN`; an empty token file is refused (a
//!   mesh that wants a token would refuse every call without one).

use crate::connect::{Connection, Tls};
use std::path::{Path, PathBuf};

/// The mesh address a command uses unless told otherwise.
pub const DEFAULT_MESH: &str = "http://127.0.0.1:50051";

/// How a command reaches a mesh: its address and the credentials sent on
/// every call (R24). Flatten it into a command's arguments
/// (`#[command(flatten)]`).
#[derive(clap::Args, Debug, Clone)]
pub struct MeshArgs {
    /// The mesh's address: a URL (`https://` for a mesh with TLS), or
    /// `host:port` (https:// when --ca-file is given).
    #[arg(
        long,
        env = "GUARDMESH_MESH",
        default_value = DEFAULT_MESH,
        global = true
    )]
    pub mesh: String,
    /// PEM of the CA that signed the mesh's certificate (TLS).
    #[arg(long, global = true)]
    pub ca_file: Option<PathBuf>,
    /// This client's PEM certificate, for a mesh that requires mTLS.
    #[arg(long, global = true, requires = "key_file")]
    pub cert_file: Option<PathBuf>,
    /// The key of `--cert-file`, PEM.
    #[arg(long, global = true, requires = "cert_file")]
    pub key_file: Option<PathBuf>,
    /// The name to verify the mesh's certificate against, when it differs
    /// from the address's host.
    #[arg(long, global = true)]
    pub tls_domain: Option<String>,
    /// Bearer token. Prefer `--token-file` or the environment variable:
    /// a command line is visible to every user of the machine.
    #[arg(long, global = true, env = "GUARDMESH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A file holding the bearer token (its first line); wins over
    /// `--token` and `GUARDMESH_TOKEN`.
    #[arg(long, global = true)]
    pub token_file: Option<PathBuf>,
}

impl Default for MeshArgs {
    /// The local mesh (`http://127.0.0.1:50051`), without TLS or token.
    fn default() -> Self {
        Self {
            mesh: "http://127.0.0.1:50051".to_owned(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            tls_domain: None,
            token: None,
            token_file: None,
        }
    }
}

/// Why the flags do not describe a connection.
#[derive(Debug, thiserror::Error)]
pub enum MeshArgsError {
    /// A file named by a flag cannot be read.
    #[error("cannot read {what} {path}: {source}")]
    Read {
        /// Which flag's file: `CA file`, `certificate`, `key`, `token file`.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `--token-file` holds no token on its first line.
    #[error("the token file {0} is empty")]
    EmptyToken(String),
    /// The address is `https://` but no CA was given.
    #[error(
        "--mesh {0} is https://: pass --ca-file with the CA that signed the mesh's certificate"
    )]
    NoCa(String),
    /// TLS flags were given for an `http://` address.
    #[error("TLS settings given but --mesh {0} is not https://")]
    NotHttps(String),
}

impl MeshArgs {
    /// Whether the address is `https://`: written so, or `host:port` with
    /// `--ca-file`.
    pub fn https(&self) -> bool {
        let mesh = self.mesh.trim_start();
        mesh.starts_with("https://") || (!mesh.contains("://") && self.ca_file.is_some())
    }

    /// The SDK connection these flags describe, reading the files they
    /// name.
    pub fn connection(&self) -> Result<Connection, MeshArgsError> {
        let read = |what: &'static str, path: &Path| {
            std::fs::read_to_string(path).map_err(|source| MeshArgsError::Read {
                what,
                path: path.display().to_string(),
                source,
            })
        };
        let https = self.https();
        let tls_flags =
            self.ca_file.is_some() || self.cert_file.is_some() || self.tls_domain.is_some();
        let tls = match &self.ca_file {
            Some(ca) if https => Some(Tls {
                ca_pem: read("CA file", ca)?,
                identity: match (&self.cert_file, &self.key_file) {
                    (Some(cert), Some(key)) => {
                        Some((read("certificate", cert)?, read("key", key)?))
                    }
                    _ => None,
                },
                domain: self.tls_domain.clone(),
            }),
            _ if https => return Err(MeshArgsError::NoCa(self.mesh.clone())),
            _ if tls_flags => return Err(MeshArgsError::NotHttps(self.mesh.clone())),
            _ => None,
        };
        let token = match (&self.token_file, &self.token) {
            (Some(path), _) => {
                let text = read("token file", path)?;
                let token = text.lines().next().unwrap_or_default().trim().to_owned();
                if token.is_empty() {
                    return Err(MeshArgsError::EmptyToken(path.display().to_string()));
                }
                Some(token)
            }
            (None, Some(token)) => Some(token.trim().to_owned()),
            (None, None) => None,
        }
        .filter(|t| !t.is_empty());
        Ok(Connection { tls, token })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        mesh: MeshArgs,
    }

    /// Parses `args` as a command line, with `GUARDMESH_TOKEN` and
    /// `GUARDMESH_MESH` taken from `env` instead of the process.
    fn parse(args: &[&str], env: &[(&str, &'static str)]) -> MeshArgs {
        let mut command = <Command as clap::CommandFactory>::command();
        // clap reads the environment when parsing; give it only `env`.
        command = command.mut_args(|arg| {
            let Some(name) = arg.get_env().map(|n| n.to_string_lossy().into_owned()) else {
                return arg;
            };
            match env.iter().find(|(k, _)| *k == name) {
                Some((_, value)) => arg.default_value(*value).env(None::<&str>),
                None => arg.env(None::<&str>),
            }
        });
        let matches = command
            .try_get_matches_from(std::iter::once("test").chain(args.iter().copied()))
            .unwrap();
        <Command as clap::FromArgMatches>::from_arg_matches(&matches)
            .unwrap()
            .mesh
    }

    fn dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("guardmesh-mesh-args-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn r24_the_token_file_wins_over_the_flag_and_the_environment() {
        let file = dir("wins").join("token");
        std::fs::write(&file, "  from-file  \nsecond line\n").unwrap();
        let path = file.display().to_string();
        let args = parse(
            &["--token-file", &path, "--token", "from-flag"],
            &[("GUARDMESH_TOKEN", "from-env")],
        );
        assert_eq!(
            args.connection().unwrap().token.as_deref(),
            Some("from-file")
        );
        let args = parse(&["--token-file", &path], &[("GUARDMESH_TOKEN", "from-env")]);
        assert_eq!(
            args.connection().unwrap().token.as_deref(),
            Some("from-file")
        );
    }

    #[test]
    fn r24_the_environment_gives_the_token_unless_the_flag_does() {
        let args = parse(&[], &[("GUARDMESH_TOKEN", " from-env ")]);
        assert_eq!(
            args.connection().unwrap().token.as_deref(),
            Some("from-env")
        );
        let args = parse(
            &["--token", "from-flag"],
            &[("GUARDMESH_TOKEN", "from-env")],
        );
        assert_eq!(
            args.connection().unwrap().token.as_deref(),
            Some("from-flag")
        );
        // An empty variable is no token, not an empty one.
        let args = parse(&[], &[("GUARDMESH_TOKEN", "  ")]);
        assert_eq!(args.connection().unwrap().token, None);
        assert_eq!(parse(&[], &[]).connection().unwrap().token, None);
    }

    #[test]
    fn r24_an_empty_or_missing_token_file_is_refused_naming_it() {
        let file = dir("empty").join("token");
        std::fs::write(&file, "\n\n").unwrap();
        let path = file.display().to_string();
        let error = parse(&["--token-file", &path], &[("GUARDMESH_TOKEN", "from-env")])
            .connection()
            .unwrap_err();
        assert!(matches!(error, MeshArgsError::EmptyToken(_)), "{error}");
        assert!(error.to_string().contains(&path), "{error}");
        let missing = dir("missing").join("absent");
        let error = parse(&["--token-file", &missing.display().to_string()], &[])
            .connection()
            .unwrap_err();
        assert!(
            matches!(
                error,
                MeshArgsError::Read {
                    what: "token file",
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn r24_https_is_inferred_from_the_scheme_or_a_ca_for_host_port() {
        let ca = dir("ca").join("ca.pem");
        std::fs::write(&ca, "PEM").unwrap();
        let ca = ca.display().to_string();
        // host:port with a CA: https, with the CA's text.
        let args = parse(&["--mesh", "mesh.internal:443", "--ca-file", &ca], &[]);
        assert!(args.https());
        assert_eq!(args.connection().unwrap().tls.unwrap().ca_pem, "PEM");
        // host:port without: plaintext.
        let args = parse(&["--mesh", "127.0.0.1:50051"], &[]);
        assert!(!args.https());
        assert!(args.connection().unwrap().tls.is_none());
        // https:// with a CA: TLS.
        let args = parse(&["--mesh", "https://mesh:443", "--ca-file", &ca], &[]);
        assert!(args.connection().unwrap().tls.is_some());
        // https:// without one: refused, saying what to pass.
        let error = parse(&["--mesh", "https://mesh:443"], &[])
            .connection()
            .unwrap_err();
        assert!(matches!(error, MeshArgsError::NoCa(_)), "{error}");
        assert!(error.to_string().contains("--ca-file"), "{error}");
        // TLS flags with http://: refused, not silently plaintext.
        let error = parse(&["--mesh", "http://mesh:80", "--ca-file", &ca], &[])
            .connection()
            .unwrap_err();
        assert!(matches!(error, MeshArgsError::NotHttps(_)), "{error}");
        let error = parse(&["--mesh", "http://mesh:80", "--tls-domain", "m"], &[])
            .connection()
            .unwrap_err();
        assert!(matches!(error, MeshArgsError::NotHttps(_)), "{error}");
    }

    #[test]
    fn the_address_comes_from_the_flag_the_environment_or_the_default() {
        assert_eq!(parse(&[], &[]).mesh, "http://127.0.0.1:50051");
        assert_eq!(MeshArgs::default().mesh, "http://127.0.0.1:50051");
        let env = [("GUARDMESH_MESH", "http://10.0.0.1:1")];
        assert_eq!(parse(&[], &env).mesh, "http://10.0.0.1:1");
        assert_eq!(parse(&["--mesh", "h:2"], &env).mesh, "h:2");
    }
}
