//! The QUIC latent link (quinn), for denoiser and decoder pools on different hosts: mutual TLS
//! (both ends present a certificate from the deployment's pool CA), one connection per
//! denoiser → decoder pair, one unidirectional stream per request carrying its chunks in order,
//! so requests never wait behind each other. Host-staged: chunks are host bytes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use quinn::Connection;

use super::{LatentChunk, LinkError, read_chunk, write_chunk};
use crate::tls::{Identity, provider};

/// ALPN protocol id of the latent link.
const ALPN: &[u8] = b"ditstream-latent/1";

fn identity_error(what: &str) -> impl Fn(String) -> LinkError + '_ {
    move |e| LinkError::Identity(format!("{what}: {e}"))
}

/// Windows sized for latents (tens of MB per request) rather than web traffic; quinn's defaults
/// make an 8 MiB transfer take ~70 ms on loopback.
fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(64 << 20));
    t.receive_window(quinn::VarInt::from_u32(256 << 20));
    t.send_window(256 << 20);
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(256));
    t.keep_alive_interval(Some(Duration::from_secs(5)));
    Arc::new(t)
}

/// A decoder pool's listening endpoint: accepts denoiser connections whose certificate the pool CA
/// signed, and refuses the rest during the handshake.
pub fn listen(addr: SocketAddr, identity: &Identity) -> Result<quinn::Endpoint, LinkError> {
    let err = identity_error("server TLS config");
    let tls = identity
        .mtls_server_with_alpn(ALPN)
        .map_err(|e| err(e.to_string()))?;
    let crypto =
        quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| err(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport());
    quinn::Endpoint::server(config, addr)
        .map_err(|e| LinkError::Transport(format!("listen on {addr}: {e}")))
}

/// A denoiser's connection to the decoder pool at `addr`, whose certificate must name `host`.
pub async fn connect(
    addr: SocketAddr,
    host: &str,
    identity: &Identity,
) -> Result<quinn::Connection, LinkError> {
    let err = identity_error("client TLS config");
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| err(e.to_string()))?
        .with_root_certificates(identity.roots())
        .with_client_auth_cert(identity.chain(), identity.key())
        .map_err(|e| err(e.to_string()))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto =
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| err(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport());
    let bind: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .map_err(|e| LinkError::Transport(format!("{e}")))?;
    let mut endpoint =
        quinn::Endpoint::client(bind).map_err(|e| LinkError::Transport(e.to_string()))?;
    endpoint.set_default_client_config(config);
    let connecting = endpoint
        .connect(addr, host)
        .map_err(|e| LinkError::Transport(format!("connect to {addr}: {e}")))?;
    connecting
        .await
        .map_err(|e| LinkError::Transport(format!("connect to {addr} ({host}): {e}")))
}

/// Sends one request's chunks, in order.
pub struct ChunkSender {
    stream: quinn::SendStream,
}

impl ChunkSender {
    /// Opens the request's stream on `conn`.
    pub async fn open(conn: &quinn::Connection) -> Result<ChunkSender, LinkError> {
        let stream = conn
            .open_uni()
            .await
            .map_err(|e| LinkError::Transport(e.to_string()))?;
        Ok(ChunkSender { stream })
    }

    /// Sends one chunk; it is on its way when this returns.
    pub async fn send(&mut self, chunk: &LatentChunk) -> Result<(), LinkError> {
        write_chunk(&mut self.stream, chunk).await
    }

    /// Ends the request's stream after its last chunk.
    pub fn finish(mut self) -> Result<(), LinkError> {
        self.stream
            .finish()
            .map_err(|e| LinkError::Transport(e.to_string()))
    }
}

/// Receives one request's chunks, in order.
pub struct ChunkReceiver {
    stream: quinn::RecvStream,
}

impl ChunkReceiver {
    /// The next request stream a denoiser opened on `conn`; `None` once the peer closed cleanly.
    pub async fn accept(conn: &quinn::Connection) -> Result<Option<ChunkReceiver>, LinkError> {
        match conn.accept_uni().await {
            Ok(stream) => Ok(Some(ChunkReceiver { stream })),
            Err(
                quinn::ConnectionError::ApplicationClosed(_)
                | quinn::ConnectionError::LocallyClosed,
            ) => Ok(None),
            Err(e) => Err(LinkError::Transport(e.to_string())),
        }
    }

    /// The next chunk (verified against its checksum); `None` after the last.
    pub async fn next(&mut self) -> Result<Option<LatentChunk>, LinkError> {
        read_chunk(&mut self.stream).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::PoolCa;

    /// The server half of mutual TLS: a client that trusts the pool CA but presents a certificate
    /// from another CA never gets a connection.
    #[tokio::test]
    async fn a_client_certificate_from_another_ca_is_refused() {
        let ca = PoolCa::generate("pools").unwrap();
        let server = listen(
            "127.0.0.1:0".parse().unwrap(),
            &ca.issue("localhost").unwrap(),
        )
        .unwrap();
        let addr = server.local_addr().unwrap();
        // Trusts the pool CA, presents a certificate another CA signed.
        let (cert, key) = PoolCa::generate("someone else")
            .unwrap()
            .issue_pem(&["intruder".to_string()])
            .unwrap();
        let intruder = Identity::from_pem(&cert, &key, &ca.pem()).unwrap();
        let accepted = tokio::spawn(async move { server.accept().await.unwrap().await });
        let client = connect(addr, "localhost", &intruder).await;
        let server_side = accepted.await.unwrap();
        assert!(
            server_side.is_err(),
            "the server accepted a certificate from another CA"
        );
        if let Ok(conn) = client {
            // TLS 1.3 may finish on the client before the server rejects: the connection dies.
            let reason = tokio::time::timeout(Duration::from_secs(5), conn.closed())
                .await
                .unwrap();
            assert!(
                !matches!(reason, quinn::ConnectionError::LocallyClosed),
                "{reason}"
            );
        }
    }
}
