//! Ceilings shared by suites: raw TCP and raw rustls TLS streams, the two ends of a transfer,
//! and a throw-away PKI.

use std::{future::Future, sync::Arc, time::Instant};

use hypha_certs::{
    NodeIdentity, Roles, TrustStore,
    authority::{self, Authority, Validity},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    runtime::Runtime,
    sync::oneshot,
    task::JoinHandle,
};

use crate::mb_per_s;

/// Bytes written and read at a time.
pub(crate) const CHUNK: usize = 1024 * 1024;

/// The two ends of a transfer, each on its own one-worker Tokio runtime, as two nodes on two
/// machines would be: everything a side does (the application's reads or writes, the
/// connection's framing and encryption) shares that side's one core, and the ceilings run on the
/// same two runtimes.
///
/// On one shared runtime the comparison was not like with like: a raw TLS transfer is two
/// tasks and always occupied both workers, while a libp2p transfer is four or more tasks that
/// wake each other through Tokio's (unstealable) LIFO slot, so in some runs all of them ran on
/// one worker and the other idled (`perf stat`: 1.0 CPUs used).
pub(crate) struct Sides {
    sender: Option<Runtime>,
    receiver: Option<Runtime>,
}

impl Sides {
    pub(crate) fn new() -> std::io::Result<Self> {
        let side = |name: &str| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name(name)
                .enable_all()
                .build()
        };
        Ok(Sides {
            sender: Some(side("bench-sender")?),
            receiver: Some(side("bench-receiver")?),
        })
    }

    /// Runs `work` on the sending side.
    pub(crate) fn sender<F>(&self, work: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        Self::runtime(&self.sender).spawn(work)
    }

    /// Runs `work` on the receiving side.
    pub(crate) fn receiver<F>(&self, work: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        Self::runtime(&self.receiver).spawn(work)
    }

    fn runtime(side: &Option<Runtime>) -> &Runtime {
        // Both are `Some` until `drop`.
        side.as_ref().unwrap_or_else(|| unreachable!())
    }
}

impl Drop for Sides {
    fn drop(&mut self) {
        // A runtime dropped inside another runtime's task would panic; let its threads wind
        // down on their own.
        for runtime in [self.sender.take(), self.receiver.take()]
            .into_iter()
            .flatten()
        {
            runtime.shutdown_background();
        }
    }
}

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
    let n = authority::create_node(
        org,
        name,
        &["localhost".into()],
        Roles::ALL,
        Validity::days(1),
    )?;
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

pub(crate) async fn raw_tcp(sides: &Sides, bytes: u64, payload: &[u8]) -> anyhow::Result<f64> {
    let (address_tx, address_rx) = oneshot::channel();
    let receiver = sides.receiver(async move {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let _ = address_tx.send(listener.local_addr()?);
        let (socket, _) = listener.accept().await?;
        drain(socket).await
    });
    let address = address_rx.await?;
    let payload = payload.to_vec();
    let sender = sides.sender(async move {
        let mut socket = TcpStream::connect(address).await?;
        socket.set_nodelay(true)?;
        let start = Instant::now();
        write_n(&mut socket, bytes, &payload).await?;
        // Kept open until the receiver has counted everything.
        anyhow::Ok((start, socket))
    });
    let (start, socket) = sender.await??;
    let received = receiver.await??;
    let elapsed = start.elapsed();
    drop(socket);
    anyhow::ensure!(
        received == bytes,
        "raw TCP lost bytes: {received} of {bytes}"
    );
    Ok(mb_per_s(bytes, elapsed))
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

/// One raw rustls TLS 1.3 stream (our transport's cipher preference) carrying `bytes` of
/// `payload`, memory to memory: MB/s.
pub(crate) async fn raw_tls(
    sides: &Sides,
    bytes: u64,
    payload: &[u8],
    pki: &Pki,
) -> anyhow::Result<f64> {
    let payload = payload.to_vec();
    let received = raw_tls_transfer(
        sides,
        pki,
        move |mut tls| async move {
            write_n(&mut tls, bytes, &payload).await?;
            Ok(tls)
        },
        drain,
    )
    .await?;
    anyhow::ensure!(
        received.count == bytes,
        "raw TLS lost bytes: {} of {bytes}",
        received.count
    );
    Ok(mb_per_s(bytes, received.elapsed))
}

/// What the receiving end of [`raw_tls_transfer`] returned, and when it returned it.
pub(crate) struct Received<T> {
    pub(crate) count: T,
    pub(crate) elapsed: std::time::Duration,
}

/// One raw rustls TLS 1.3 connection over loopback between the two [`Sides`]: `send` runs on
/// the sender with the client's stream (and returns it, so that it stays open until the
/// receiver is done) and `receive` on the receiver with the server's. The clock starts once
/// the handshake is done and stops when `receive` returns.
pub(crate) async fn raw_tls_transfer<S, SF, R, RF, T>(
    sides: &Sides,
    pki: &Pki,
    send: S,
    receive: R,
) -> anyhow::Result<Received<T>>
where
    S: FnOnce(tokio_rustls::client::TlsStream<TcpStream>) -> SF + Send + 'static,
    SF: Future<Output = std::io::Result<tokio_rustls::client::TlsStream<TcpStream>>> + Send,
    R: FnOnce(tokio_rustls::server::TlsStream<TcpStream>) -> RF + Send + 'static,
    RF: Future<Output = std::io::Result<T>> + Send,
    T: Send + 'static,
{
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

    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config));
    let (address_tx, address_rx) = oneshot::channel();
    let receiver = sides.receiver(async move {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let _ = address_tx.send(listener.local_addr()?);
        let (socket, _) = listener.accept().await?;
        socket.set_nodelay(true)?;
        let tls = acceptor.accept(socket).await?;
        anyhow::Ok((receive(tls).await?, Instant::now()))
    });
    let address = address_rx.await?;
    let sender = sides.sender(async move {
        let socket = TcpStream::connect(address).await?;
        socket.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::try_from("localhost")?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(client_config))
            .connect(name, socket)
            .await?;
        let start = Instant::now();
        anyhow::Ok((start, send(tls).await?))
    });
    let (start, tls) = sender.await??;
    let (count, end) = receiver.await??;
    drop(tls);
    Ok(Received {
        count,
        elapsed: end - start,
    })
}
