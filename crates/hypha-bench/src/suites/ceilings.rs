//! Ceilings shared by suites: raw TCP and raw rustls TLS streams, and a throw-away PKI.

use std::{sync::Arc, time::Instant};

use hypha_certs::{
    NodeIdentity, TrustStore,
    authority::{self, Authority, Validity},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use crate::mb_per_s;

/// Bytes written and read at a time.
pub(crate) const CHUNK: usize = 1024 * 1024;

pub(crate) struct Pki {
    pub(crate) root_pem: String,
    pub(crate) server: NodeIdentity,
    pub(crate) client: NodeIdentity,
    /// The server's chain and key as PEM, for a server in another process.
    pub(crate) server_pem: (String, String),
    org: Authority,
}

impl Pki {
    pub(crate) fn new() -> anyhow::Result<Self> {
        let root = authority::create_root("Bench Root", Validity::days(1))?;
        let org = authority::create_org(&root, "Bench Org", Validity::days(1))?;
        let (server, server_pem) = node(&org, "server")?;
        Ok(Pki {
            root_pem: root.cert_pem(),
            server,
            client: node(&org, "client")?.0,
            server_pem,
            org,
        })
    }

    /// A further node of the same organisation.
    pub(crate) fn identity(&self, name: &str) -> anyhow::Result<NodeIdentity> {
        Ok(node(&self.org, name)?.0)
    }

    pub(crate) fn trust(&self) -> anyhow::Result<Arc<TrustStore>> {
        Ok(Arc::new(TrustStore::from_pem(
            self.root_pem.as_bytes(),
            &[],
        )?))
    }
}

fn node(org: &Authority, name: &str) -> anyhow::Result<(NodeIdentity, (String, String))> {
    let n = authority::create_node(org, name, &["localhost".into()], Validity::days(1))?;
    let pem = (n.chain_pem(), n.key_pem());
    Ok((
        NodeIdentity::from_pem(pem.0.as_bytes(), pem.1.as_bytes())?,
        pem,
    ))
}

/// Reads a stream to its end and returns how many bytes it carried.
pub(crate) async fn drain(mut reader: impl AsyncReadExt + Unpin) -> std::io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
    }
}

/// Writes `bytes` and shuts the write side down. The caller keeps `writer` open until the
/// receiver has counted everything, so unread control data (TLS) cannot reset the connection.
pub(crate) async fn write_n(
    writer: &mut (impl AsyncWriteExt + Unpin),
    bytes: u64,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut left = bytes;
    while left > 0 {
        let n = left.min(payload.len() as u64) as usize;
        writer.write_all(&payload[..n]).await?;
        left -= n as u64;
    }
    writer.shutdown().await
}

pub(crate) async fn raw_tcp(bytes: u64, payload: &[u8]) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let receiver = tokio::spawn(async move {
        let (socket, _) = listener.accept().await?;
        drain(socket).await
    });
    let mut socket = TcpStream::connect(addr).await?;
    socket.set_nodelay(true)?;
    let start = Instant::now();
    write_n(&mut socket, bytes, payload).await?;
    let received = receiver.await??;
    drop(socket);
    anyhow::ensure!(
        received == bytes,
        "raw TCP lost bytes: {received} of {bytes}"
    );
    Ok(mb_per_s(bytes, start.elapsed()))
}

/// The cipher preference our transport uses, so the ceiling is the same cipher.
fn aes_first_provider() -> rustls::crypto::CryptoProvider {
    use rustls::crypto::ring::{self, cipher_suite};
    rustls::crypto::CryptoProvider {
        cipher_suites: vec![
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..ring::default_provider()
    }
}

pub(crate) async fn raw_tls(bytes: u64, payload: &[u8], pki: &Pki) -> anyhow::Result<f64> {
    let provider = Arc::new(aes_first_provider());
    let mut server_config = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(pki.server.chain().to_vec(), pki.server.private_key())?;
    // As in our transport: no session tickets.
    server_config.send_tls13_tickets = 0;
    let mut roots = rustls::RootCertStore::empty();
    for cert in hypha_certs::certificates_from_pem(pki.root_pem.as_bytes(), "root")? {
        roots.add(cert)?;
    }
    let client_config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config));
    let receiver = tokio::spawn(async move {
        let (socket, _) = listener.accept().await?;
        socket.set_nodelay(true)?;
        let tls = acceptor.accept(socket).await?;
        drain(tls).await
    });
    let socket = TcpStream::connect(addr).await?;
    socket.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(client_config))
        .connect(name, socket)
        .await?;
    let start = Instant::now();
    write_n(&mut tls, bytes, payload).await?;
    let received = receiver.await??;
    drop(tls);
    anyhow::ensure!(
        received == bytes,
        "raw TLS lost bytes: {received} of {bytes}"
    );
    Ok(mb_per_s(bytes, start.elapsed()))
}
