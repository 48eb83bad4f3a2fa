//! Certificates on disk for secured meshes (R24).

// ---------------------------------------------------------------------------
// Secured meshes: certificates on disk and token principals (R24).
// ---------------------------------------------------------------------------

/// A CA and loopback certificates written to a temporary folder (removed on
/// drop), for meshes with TLS, mTLS or tokens, in process or as `serve`.
pub(crate) struct TestPki {
    pub dir: std::path::PathBuf,
    pub ca: guardmesh_cli::certs::Authority,
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl TestPki {
    pub(crate) fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("guardmesh-testpki-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            dir,
            ca: guardmesh_cli::certs::Authority::new("test CA").unwrap(),
        }
    }

    /// `ca.pem`.
    pub(crate) fn ca_file(&self) -> std::path::PathBuf {
        let path = self.dir.join("ca.pem");
        std::fs::write(&path, self.ca.cert_pem()).unwrap();
        path
    }

    /// A loopback certificate (localhost, 127.0.0.1, ::1) with the identity
    /// `spiffe://guardmesh.local/ID`, written as `ID.pem` and `ID-key.pem`.
    pub(crate) fn issue_files(&self, id: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        self.ca
            .issue(&guardmesh_cli::certs::Subject::loopback(id))
            .unwrap()
            .write(&self.dir, id)
            .unwrap()
    }

    /// A file holding `text` (a token file, a config file...).
    pub(crate) fn file(&self, name: &str, text: &str) -> std::path::PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A coordinator of the mesh at `url` that sends `token` (TLS trusting
    /// this CA).
    pub(crate) async fn coordinator(
        &self,
        url: &str,
        token: &str,
    ) -> guardmesh_client::Coordinator {
        guardmesh_client::Coordinator::connect_with(
            url.to_owned(),
            &self.connection(None, Some(token)),
        )
        .await
        .unwrap()
    }

    /// A registrar of the mesh at `url` that sends `token`.
    pub(crate) async fn registrar(&self, url: &str, token: &str) -> guardmesh_client::Registrar {
        guardmesh_client::Registrar::connect_with(
            url.to_owned(),
            &self.connection(None, Some(token)),
        )
        .await
        .unwrap()
    }

    /// SDK connection settings: TLS trusting this CA, with the certificate of
    /// `identity` (issued now) and `token` when given.
    pub(crate) fn connection(
        &self,
        identity: Option<&str>,
        token: Option<&str>,
    ) -> guardmesh_client::Connection {
        let identity = identity.map(|id| {
            let issued = self
                .ca
                .issue(&guardmesh_cli::certs::Subject::loopback(id))
                .unwrap();
            (issued.cert_pem, issued.key_pem)
        });
        guardmesh_client::Connection {
            tls: Some(guardmesh_client::Tls {
                ca_pem: self.ca.cert_pem(),
                identity,
                domain: None,
            }),
            token: token.map(str::to_owned),
        }
    }
}
