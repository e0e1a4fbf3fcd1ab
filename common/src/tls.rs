//! TLS for the coordinator's gRPC port, which workers and the CLI call.
//!
//! The coordinator serves TLS when `[coordinator] tls = { cert, key }` is set, and with
//! `client_ca` it accepts only clients whose certificate that CA signed (mutual TLS: a worker
//! or operator without one cannot connect). Clients choose by the address: `https://…` is
//! TLS, verified against the CA in `TIDEMARK_TLS_CA`; `TIDEMARK_TLS_CERT` and
//! `TIDEMARK_TLS_KEY` give the client's own certificate. `http://…` is plaintext.
//!
//! The coordinator reaches etcd over TLS with `[coordinator] etcd_tls = { ca, cert, key }`
//! (a [`ClientTls`]) and `https://` endpoints.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// `[coordinator] tls = { cert = "server.pem", key = "server.key", client_ca = "ca.pem" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    /// The server's certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// Accept only clients presenting a certificate this CA (PEM) signed.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

impl ServerTls {
    pub fn config(&self) -> Result<ServerTlsConfig, String> {
        let identity = Identity::from_pem(read("tls.cert", &self.cert)?, read("tls.key", &self.key)?);
        let mut config = ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.client_ca {
            config = config.client_ca_root(Certificate::from_pem(read("tls.client_ca", ca)?));
        }
        Ok(config)
    }
}

/// A client's TLS settings: the CA that signed the server's certificate, and the client's
/// own certificate and key (both or neither). From `TIDEMARK_TLS_CA`, `TIDEMARK_TLS_CERT` and
/// `TIDEMARK_TLS_KEY` for the coordinator's clients; `etcd_tls = { ca, cert, key }` for etcd.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientTls {
    #[serde(default)]
    pub ca: Option<PathBuf>,
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
}

impl ClientTls {
    pub fn from_env() -> ClientTls {
        ClientTls::from_lookup(|name| std::env::var(name).ok())
    }

    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> ClientTls {
        let path = |name: &str| lookup(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        ClientTls {
            ca: path("TIDEMARK_TLS_CA"),
            cert: path("TIDEMARK_TLS_CERT"),
            key: path("TIDEMARK_TLS_KEY"),
        }
    }

    /// The endpoint for a coordinator address: TLS for `https://`, plaintext for `http://`.
    pub fn endpoint(&self, address: &str) -> Result<Endpoint, String> {
        let endpoint =
            Endpoint::from_shared(address.to_string()).map_err(|e| format!("coordinator address {address:?}: {e}"))?;
        if !address.starts_with("https://") {
            return Ok(endpoint);
        }
        if self.ca.is_none() {
            return Err(format!(
                "coordinator address {address} is https: set TIDEMARK_TLS_CA to the CA certificate that signed its certificate"
            ));
        }
        endpoint
            .tls_config(self.config("TIDEMARK_TLS_CA", "TIDEMARK_TLS_CERT", "TIDEMARK_TLS_KEY")?)
            .map_err(|e| format!("coordinator address {address}: TLS: {e}"))
    }

    /// The rustls client configuration; `ca`, `cert` and `key` name the settings in errors.
    pub fn config(&self, ca: &str, cert: &str, key: &str) -> Result<ClientTlsConfig, String> {
        let mut config = ClientTlsConfig::new();
        if let Some(path) = &self.ca {
            config = config.ca_certificate(Certificate::from_pem(read(ca, path)?));
        }
        match (&self.cert, &self.key) {
            (Some(cert_path), Some(key_path)) => {
                config = config.identity(Identity::from_pem(read(cert, cert_path)?, read(key, key_path)?));
            }
            (None, None) => {}
            _ => return Err(format!("{cert} and {key} go together: set both or neither")),
        }
        Ok(config)
    }
}
