//! TLS for every hop: the pool CA and the identities it issues (`ditstream certs`), the
//! mutual-TLS configs of the control plane (the gateway's registry, the pool services, the QUIC
//! latent link: every peer presents a certificate the pool CA signed), the public API's
//! server-only TLS, and the check that binds a registered address to the certificate that
//! registered it. One CA setting (`pools.tls_ca`) covers every internal hop.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A peer's certificate (DER), as a verified handshake gives it.
pub type Certificate = CertificateDer<'static>;

/// A TLS identity or config could not be built: the message names the file or the step.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

fn error(what: impl std::fmt::Display) -> impl Fn(String) -> TlsError {
    move |e| TlsError(format!("{what}: {e}"))
}

/// The one crypto provider (ring) every config here uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A member of the control plane (gateway, pool): its certificate chain and key, and the pool CA
/// it trusts. Kept as PEM too, for tonic's client TLS.
pub struct Identity {
    ca: CertificateDer<'static>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    pem: [String; 3],
}

fn certs(pem: &str, origin: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError(format!("{origin}: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError(format!("{origin}: no certificate in the file")));
    }
    Ok(certs)
}

fn read(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|e| TlsError(format!("{}: {e}", path.display())))
}

impl Identity {
    /// From PEM text: this member's certificate (chain), its private key, and the pool CA.
    pub fn from_pem(cert: &str, key: &str, ca: &str) -> Result<Identity, TlsError> {
        Self::parse(cert, key, ca, ["certificate", "key", "pool CA"])
    }

    /// Loads PEM files: this member's certificate (chain), its private key, and the pool CA.
    pub fn from_pem_files(cert: &Path, key: &Path, ca: &Path) -> Result<Identity, TlsError> {
        let names = [cert, key, ca].map(|p| p.display().to_string());
        Self::parse(
            &read(cert)?,
            &read(key)?,
            &read(ca)?,
            [&names[0], &names[1], &names[2]].map(String::as_str),
        )
    }

    fn parse(cert: &str, key: &str, ca: &str, origin: [&str; 3]) -> Result<Identity, TlsError> {
        let chain = certs(cert, origin[0])?;
        let ca_der = certs(ca, origin[2])?.swap_remove(0);
        let key_der = PrivateKeyDer::from_pem_slice(key.as_bytes())
            .map_err(|e| TlsError(format!("{}: {e}", origin[1])))?;
        Ok(Identity {
            ca: ca_der,
            chain,
            key: key_der,
            pem: [cert.to_string(), key.to_string(), ca.to_string()],
        })
    }

    /// The certificate chain this member presents.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.chain.clone()
    }

    /// Its private key.
    pub fn key(&self) -> PrivateKeyDer<'static> {
        self.key.clone_key()
    }

    /// The pool CA as the only root.
    pub fn roots(&self) -> Arc<rustls::RootCertStore> {
        let mut roots = rustls::RootCertStore::empty();
        // The CA parsed as a certificate when the identity was built; a CA webpki cannot use
        // as a trust anchor fails every handshake instead, with a message naming it.
        let _ = roots.add(self.ca.clone());
        Arc::new(roots)
    }

    /// The server side of the control plane's mutual TLS: a gRPC (HTTP/2) listener that accepts
    /// only clients whose certificate the pool CA signed.
    pub fn mtls_server(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        self.mtls_server_with_alpn(b"h2")
    }

    /// Mutual TLS 1.3 for a server speaking the protocol `alpn` (h2 for gRPC; the QUIC latent
    /// link has its own).
    pub fn mtls_server_with_alpn(
        &self,
        alpn: &[u8],
    ) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let err = error("control-plane TLS");
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots(), provider())
                .build()
                .map_err(|e| err(e.to_string()))?;
        let mut tls = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| err(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain(), self.key())
            .map_err(|e| err(e.to_string()))?;
        tls.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(tls))
    }

    /// A gRPC endpoint at `address` (host:port) over mutual TLS: the server's certificate must
    /// come from the pool CA and name `host`; this member presents its own.
    pub fn endpoint(&self, address: &str) -> Result<tonic::transport::Endpoint, TlsError> {
        let err = error(address);
        let host = host_of(address);
        let [cert, key, ca] = &self.pem;
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca))
            .identity(tonic::transport::Identity::from_pem(cert, key))
            .domain_name(host);
        tonic::transport::Endpoint::from_shared(format!("https://{address}"))
            .map_err(|e| err(e.to_string()))?
            .tls_config(tls)
            .map_err(|e| err(e.to_string()))
    }
}

/// The host part of `host:port` (an IPv6 literal without its brackets).
pub fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Whether the certificate `cert` is valid for `host` (a DNS name or an IP address, matched
/// against its subject alternative names the way a TLS client would).
pub fn names(cert: &CertificateDer<'_>, host: &str) -> bool {
    let Ok(name) = ServerName::try_from(host) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .is_ok_and(|c| c.verify_is_valid_for_subject_name(&name).is_ok())
}

/// The public API's TLS: the certificate (chain) and key from `serving.tls`, no client
/// certificates (API keys authenticate clients).
pub fn public_server(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain = certs(&read(cert)?, &cert.display().to_string())?;
    let key_der = PrivateKeyDer::from_pem_slice(read(key)?.as_bytes())
        .map_err(|e| TlsError(format!("{}: {e}", key.display())))?;
    let err = error("serving.tls");
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| err(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| err(e.to_string()))?;
    tls.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(tls))
}

/// A certificate authority for one deployment's control plane: issues the identities its
/// members present to each other. Operators may use their own CA and load PEM files instead.
pub struct PoolCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl PoolCa {
    /// A fresh CA named `name`.
    pub fn generate(name: &str) -> Result<PoolCa, TlsError> {
        let err = error("generating the pool CA");
        let mut params =
            rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| err(e.to_string()))?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().map_err(|e| err(e.to_string()))?;
        let issuer =
            rcgen::CertifiedIssuer::self_signed(params, key).map_err(|e| err(e.to_string()))?;
        Ok(PoolCa { issuer })
    }

    /// An identity for a member reachable as `host` (a DNS name or an IP address).
    pub fn issue(&self, host: &str) -> Result<Identity, TlsError> {
        let (cert, key) = self.issue_pem(&[host.to_string()])?;
        Identity::from_pem(&cert, &key, &self.pem())
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `hosts` (DNS names or IP addresses) and its private key, both PEM: what
    /// `ditstream certs` writes for the members to load with [`Identity::from_pem_files`].
    pub fn issue_pem(&self, hosts: &[String]) -> Result<(String, String), TlsError> {
        let err = error("issuing a certificate");
        let params =
            rcgen::CertificateParams::new(hosts.to_vec()).map_err(|e| err(e.to_string()))?;
        let key = rcgen::KeyPair::generate().map_err(|e| err(e.to_string()))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| err(e.to_string()))?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_certificate_names_exactly_its_hosts() {
        let ca = PoolCa::generate("t").unwrap();
        let id = ca.issue("pool-a.internal").unwrap();
        let cert = &id.chain()[0];
        assert!(names(cert, "pool-a.internal"));
        assert!(!names(cert, "pool-b.internal"));
        assert!(!names(cert, "127.0.0.1"));
        let (pem, _) = ca.issue_pem(&["127.0.0.1".to_string()]).unwrap();
        let ip = certs(&pem, "t").unwrap().swap_remove(0);
        assert!(names(&ip, "127.0.0.1"));
        assert!(!names(&ip, "127.0.0.2"));
    }

    #[test]
    fn host_of_strips_port_and_brackets() {
        assert_eq!(host_of("127.0.0.1:50052"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7"), "::1");
        assert_eq!(host_of("gw.example:443"), "gw.example");
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = Identity::from_pem_files(
            Path::new("/nonexistent/cert.pem"),
            Path::new("k"),
            Path::new("c"),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("/nonexistent/cert.pem"), "{e}");
    }
}
