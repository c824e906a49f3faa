//! `transport`: bulk throughput of one and four streams over our mutual-TLS + yamux stack,
//! beside a raw TCP stream and a raw rustls TLS 1.3 stream (AES-128-GCM) on loopback.
//!
//! All are measured in one process, every sending end on one one-worker runtime and every
//! receiving end on another ([`Sides`]), so the ratios compare like with like. Each figure is the
//! median of several rounds, each ratio the median of the rounds' ratios; a run times from the
//! first byte written to the last byte counted by the receiver.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use anyhow::Context;
use futures::{AsyncWriteExt as _, StreamExt};
use hypha_network::{Network, Settings, StreamProtocol};
use tokio::sync::mpsc;

use super::ceilings::{CHUNK, Pki, Sides, drain, raw_tcp, raw_tls};
use crate::{Report, mb_per_s, median};
const PROTOCOL: StreamProtocol = StreamProtocol::new("/hypha/bench/transport/1");

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    let (bytes, runs): (u64, usize) = if quick {
        (256 * 1024 * 1024, 3)
    } else {
        (1024 * 1024 * 1024, 7)
    };
    let pki = Pki::new()?;
    let payload: Vec<u8> = (0..CHUNK).map(|i| (i % 251) as u8).collect();
    let sides = Sides::new()?;

    let (client, server, mut received) = connected_pair(&sides, &pki).await?;
    // One round measures everything back to back, and each ratio is the median of the rounds'
    // ratios: load from outside the benchmark then shifts both sides of a ratio alike.
    let mut rounds: Vec<BTreeMap<&str, f64>> = Vec::new();
    for _ in 0..runs {
        let tls = raw_tls(&sides, bytes, &payload, &pki).await?;
        let tcp = raw_tcp(&sides, bytes, &payload).await?;
        let one = streams(&sides, &client, &server, &mut received, bytes, 1, &payload).await?;
        let four = streams(&sides, &client, &server, &mut received, bytes, 4, &payload).await?;
        let round = BTreeMap::from([
            ("raw_tcp_mb_s", tcp),
            ("raw_tls_mb_s", tls),
            ("one_stream_mb_s", one),
            ("four_streams_mb_s", four),
            ("one_stream_vs_raw_tls", one / tls),
            ("four_streams_vs_raw_tls", four / tls),
            ("raw_tls_vs_raw_tcp", tls / tcp),
        ]);
        #[cfg(feature = "stock-libp2p")]
        let round = {
            let mut round = round;
            let stock = stock::one_stream(&sides, bytes, &payload).await?;
            round.insert("stock_libp2p_one_stream_mb_s", stock);
            round.insert("stock_libp2p_vs_raw_tls", stock / tls);
            round
        };
        rounds.push(round);
    }
    client.shutdown().await;
    server.shutdown().await;

    let mut report = Report::default();
    report.metrics.insert("bytes_per_run".into(), bytes as f64);
    report.metrics.insert("runs".into(), runs as f64);
    for key in rounds[0].keys() {
        let value = median(rounds.iter().map(|round| round[key]).collect());
        let table = if key.contains("_vs_") {
            &mut report.ratios
        } else {
            &mut report.metrics
        };
        table.insert(key.to_string(), value);
    }
    Ok(report)
}

/// Two connected nodes, the client on the sending side and the server on the receiving side;
/// the server counts every stream of [`PROTOCOL`] and reports each total.
async fn connected_pair(
    sides: &Sides,
    pki: &Pki,
) -> anyhow::Result<(Network, Network, mpsc::Receiver<u64>)> {
    let mut server_settings = Settings::new("bench-server");
    server_settings.listen_addresses = vec!["/ip4/127.0.0.1/tcp/0".parse()?];
    server_settings.relay_circuit = false;
    let (identity, trust) = (pki.server.clone(), pki.trust()?);
    let (server, _) = sides
        .receiver(async move { hypha_network::start(server_settings, &identity, trust).await })
        .await??;
    let mut client_settings = Settings::new("bench-client");
    client_settings.relay_circuit = false;
    let (identity, trust) = (pki.client.clone(), pki.trust()?);
    let (client, _) = sides
        .sender(async move { hypha_network::start(client_settings, &identity, trust).await })
        .await??;

    let address = server
        .listen_addresses()
        .await?
        .into_iter()
        .next()
        .context("the server has no listen address")?;
    client.dial(address).await?;

    let mut incoming = server.accept_streams(PROTOCOL)?;
    let (tx, received) = mpsc::channel(16);
    sides.receiver(async move {
        while let Some((_, stream)) = incoming.next().await {
            let tx = tx.clone();
            // Detached: each drains one stream to its end, which the sender closes.
            tokio::spawn(async move {
                let stream = tokio_util::compat::FuturesAsyncReadCompatExt::compat(stream);
                let total = drain(stream).await.unwrap_or(0);
                let _ = tx.send(total).await;
            });
        }
    });
    Ok((client, server, received))
}

async fn streams(
    sides: &Sides,
    client: &Network,
    server: &Network,
    received: &mut mpsc::Receiver<u64>,
    bytes: u64,
    count: u64,
    payload: &[u8],
) -> anyhow::Result<f64> {
    let per_stream = bytes / count;
    let mut opened = Vec::new();
    for _ in 0..count {
        opened.push(client.open_stream(server.local_peer_id(), PROTOCOL).await?);
    }
    let start = Instant::now();
    let writers = opened.into_iter().map(|mut stream| {
        let payload = payload.to_vec();
        sides.sender(async move {
            let mut left = per_stream;
            while left > 0 {
                let n = left.min(payload.len() as u64) as usize;
                stream.write_all(&payload[..n]).await?;
                left -= n as u64;
            }
            stream.close().await
        })
    });
    for writer in futures::future::join_all(writers).await {
        writer??;
    }
    let mut total = 0u64;
    for _ in 0..count {
        total += tokio::time::timeout(Duration::from_secs(120), received.recv())
            .await?
            .context("the receiver stopped")?;
    }
    anyhow::ensure!(
        total == per_stream * count,
        "streams lost bytes: {total} of {}",
        per_stream * count
    );
    Ok(mb_per_s(total, start.elapsed()))
}

/// The comparison with stock crates.io libp2p (`--features stock-libp2p`): its TLS needs
/// aws-lc, a C library that alone takes a minute to build, so the default build leaves it out.
#[cfg(feature = "stock-libp2p")]
mod stock {
    use std::time::{Duration, Instant};

    use anyhow::Context;
    use futures::{AsyncWriteExt as _, StreamExt};
    use libp2p::swarm::SwarmEvent;
    use tokio::sync::oneshot;

    use super::{PROTOCOL, Sides, drain};
    use crate::mb_per_s;

    /// One stream over stock libp2p-tls (self-signed libp2p certificates) and libp2p-yamux
    /// (16 KiB frames) from crates.io: what our transport replaces, measured for comparison.
    pub(super) async fn one_stream(
        sides: &Sides,
        bytes: u64,
        payload: &[u8],
    ) -> anyhow::Result<f64> {
        let (listening_tx, listening_rx) = oneshot::channel();
        let server = sides.receiver(async move {
            let mut server = swarm()?;
            server.listen_on("/ip4/127.0.0.1/tcp/0".parse()?)?;
            let address = loop {
                if let SwarmEvent::NewListenAddr { address, .. } = server.select_next_some().await {
                    break address;
                }
            };
            let mut incoming = server.behaviour().new_control().accept(PROTOCOL)?;
            let _ = listening_tx.send((address, *server.local_peer_id()));
            let swarm = tokio::spawn(async move {
                loop {
                    server.select_next_some().await;
                }
            });
            let (_, stream) = incoming.next().await.context("no stream")?;
            let received = drain(tokio_util::compat::FuturesAsyncReadCompatExt::compat(
                stream,
            ))
            .await;
            swarm.abort();
            anyhow::Ok(received?)
        });
        let (address, server_peer) = listening_rx.await?;
        let payload = payload.to_vec();
        let client = sides.sender(async move {
            let mut client = swarm()?;
            let mut control = client.behaviour().new_control();
            client.dial(address)?;
            loop {
                match client.select_next_some().await {
                    SwarmEvent::ConnectionEstablished { .. } => break,
                    SwarmEvent::OutgoingConnectionError { error, .. } => {
                        anyhow::bail!("stock libp2p could not connect: {error}")
                    }
                    _ => {}
                }
            }
            let swarm = tokio::spawn(async move {
                loop {
                    client.select_next_some().await;
                }
            });
            let mut stream = control.open_stream(server_peer, PROTOCOL).await?;
            let start = Instant::now();
            let mut left = bytes;
            while left > 0 {
                let n = left.min(payload.len() as u64) as usize;
                stream.write_all(&payload[..n]).await?;
                left -= n as u64;
            }
            stream.close().await?;
            anyhow::Ok((start, swarm))
        });
        let (start, client_swarm) = client.await??;
        let received = server.await??;
        let elapsed = start.elapsed();
        client_swarm.abort();
        anyhow::ensure!(
            received == bytes,
            "stock libp2p lost bytes: {received} of {bytes}"
        );
        Ok(mb_per_s(bytes, elapsed))
    }

    fn swarm() -> anyhow::Result<libp2p::Swarm<libp2p_stream::Behaviour>> {
        Ok(libp2p::SwarmBuilder::with_new_identity()
            .with_tokio()
            .with_tcp(
                libp2p::tcp::Config::default().nodelay(true),
                libp2p::tls::Config::new,
                libp2p::yamux::Config::default,
            )?
            .with_behaviour(|_| libp2p_stream::Behaviour::new())?
            .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
            .build())
    }
}
