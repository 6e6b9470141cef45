//! Optional TLS (rustls with the ring provider, through tonic): servers present a certificate
//! and key (`--tls-cert`, `--tls-key`), clients trust a CA (`--tls-ca`). With TLS every
//! channel is `https`: client to coordinator, worker to coordinator, worker to worker.
//!
//! # Layout
//! - [`ServerTlsArgs`], [`ClientTlsArgs`]: the flags, and loading them into tonic's configs.
//! - [`TlsError`]: a PEM file that is missing or holds the wrong thing, naming the file.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Errors loading TLS files; each names the file and the flag.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file cannot be read.
    #[error("{flag} {path}: {source}")]
    Io {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not a PEM file of the expected kind.
    #[error("{flag} {path}: expected a PEM file with a '-----BEGIN {expected}' block")]
    NotPem {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What the block should be (`CERTIFICATE`, `... PRIVATE KEY`).
        expected: &'static str,
    },
    /// The file is PEM but its certificate or key cannot be used (HTTP port, `rustls`).
    #[error("{flag} {path}: {reason}")]
    Invalid {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Only one of a pair of flags was given.
    #[error("{given} needs {missing} as well")]
    Incomplete {
        /// The flag given.
        given: &'static str,
        /// The flag missing.
        missing: &'static str,
    },
}

/// Reads a PEM file and checks it holds a `-----BEGIN <marker>` block.
fn read_pem(flag: &'static str, path: &Path, marker: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Io {
        flag,
        path: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text.lines().any(|l| {
        l.trim()
            .strip_prefix("-----BEGIN ")
            .is_some_and(|rest| rest.contains(marker))
    });
    if !found {
        return Err(TlsError::NotPem {
            flag,
            path: path.to_path_buf(),
            expected: marker,
        });
    }
    Ok(bytes)
}

/// The flags of a TLS server: its certificate chain and private key (PEM).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServerTlsArgs {
    /// Serve TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "KEEL_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "KEEL_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
}

impl ServerTlsArgs {
    /// Whether TLS was asked for.
    pub fn is_set(&self) -> bool {
        self.tls_cert.is_some() || self.tls_key.is_some()
    }

    /// The server TLS config, or `None` when neither flag is given (plaintext).
    ///
    /// Errors: [`TlsError::Incomplete`] when only one is given, [`TlsError::Io`],
    /// [`TlsError::NotPem`].
    pub fn load(&self) -> Result<Option<ServerTlsConfig>, TlsError> {
        match (&self.tls_cert, &self.tls_key) {
            (None, None) => Ok(None),
            (Some(_), None) => Err(TlsError::Incomplete {
                given: "--tls-cert",
                missing: "--tls-key",
            }),
            (None, Some(_)) => Err(TlsError::Incomplete {
                given: "--tls-key",
                missing: "--tls-cert",
            }),
            (Some(cert), Some(key)) => {
                let cert = read_pem("--tls-cert", cert, "CERTIFICATE")?;
                let key = read_pem("--tls-key", key, "PRIVATE KEY")?;
                Ok(Some(
                    ServerTlsConfig::new().identity(Identity::from_pem(cert, key)),
                ))
            }
        }
    }
}

impl ServerTlsArgs {
    /// The same certificate chain and key as a `rustls` server config for the HTTP port
    /// (`crate::http_port`: HTTP/1.1 over TLS), or `None` without the flags.
    ///
    /// Errors: those of [`ServerTlsArgs::load`], and [`TlsError::Invalid`] when the PEM
    /// blocks do not parse or the key does not fit the certificate.
    pub fn load_http(&self) -> Result<Option<std::sync::Arc<rustls::ServerConfig>>, TlsError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let (Some(cert_path), Some(key_path)) = (&self.tls_cert, &self.tls_key) else {
            return self.load().map(|_| None);
        };
        let cert = read_pem("--tls-cert", cert_path, "CERTIFICATE")?;
        let key = read_pem("--tls-key", key_path, "PRIVATE KEY")?;
        let invalid = |flag, path: &Path, reason: String| TlsError::Invalid {
            flag,
            path: path.to_path_buf(),
            reason,
        };
        let chain = CertificateDer::pem_slice_iter(&cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid("--tls-cert", cert_path, e.to_string()))?;
        let key = PrivateKeyDer::from_pem_slice(&key)
            .map_err(|e| invalid("--tls-key", key_path, e.to_string()))?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("--tls-cert", cert_path, e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| invalid("--tls-key", key_path, e.to_string()))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(std::sync::Arc::new(config)))
    }
}

/// The flag of a TLS client: the CA certificate(s) to trust (PEM).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ClientTlsArgs {
    /// Connect with TLS (https), trusting the CA certificate(s) in this PEM file.
    #[arg(long, env = "KEEL_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
}

impl ClientTlsArgs {
    /// The client TLS config, or `None` without the flag (plaintext).
    ///
    /// Errors: [`TlsError::Io`], [`TlsError::NotPem`].
    pub fn load(&self) -> Result<Option<ClientTlsConfig>, TlsError> {
        match &self.tls_ca {
            None => Ok(None),
            Some(ca) => {
                let pem = read_pem("--tls-ca", ca, "CERTIFICATE")?;
                Ok(Some(
                    ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_name_the_bad_file() {
        let dir = tempfile::tempdir().unwrap();
        let not_pem = dir.path().join("cert.pem");
        std::fs::write(&not_pem, "hello\n").unwrap();
        let args = ServerTlsArgs {
            tls_cert: Some(not_pem.clone()),
            tls_key: Some(not_pem.clone()),
        };
        let e = args.load().unwrap_err();
        assert!(
            e.to_string().contains("--tls-cert") && e.to_string().contains("cert.pem"),
            "{e}"
        );
        let half = ServerTlsArgs {
            tls_cert: Some(not_pem.clone()),
            tls_key: None,
        };
        assert!(matches!(half.load(), Err(TlsError::Incomplete { .. })));
        assert!(ServerTlsArgs::default().load().unwrap().is_none());
        let e = ClientTlsArgs {
            tls_ca: Some(dir.path().join("nope.pem")),
        }
        .load()
        .unwrap_err();
        assert!(
            matches!(e, TlsError::Io { .. }) && e.to_string().contains("nope.pem"),
            "{e}"
        );
    }
}
