//! `transport`: bulk throughput of one and four streams over our mutual-TLS + yamux stack,
//! beside a raw TCP stream and a raw rustls TLS 1.3 stream (AES-128-GCM) on loopback.
//!
//! All four are measured in one process on one Tokio runtime, sender and receiver sharing the
//! machine's cores, so the ratios compare like with like. Each figure is the median of several
//! runs; a run times from the first byte written to the last byte counted by the receiver.

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::{AsyncWriteExt as _, StreamExt};
use hypha_network::{Network, Settings, StreamProtocol};
use tokio::sync::mpsc;

use super::ceilings::{CHUNK, Pki, drain, raw_tcp, raw_tls};
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

    let mut tcp = Vec::new();
    let mut tls = Vec::new();
    for _ in 0..runs {
        tcp.push(raw_tcp(bytes, &payload).await?);
        tls.push(raw_tls(bytes, &payload, &pki).await?);
    }

    let (client, server, mut received) = connected_pair(&pki).await?;
    let mut one = Vec::new();
    let mut four = Vec::new();
    for _ in 0..runs {
        one.push(streams(&client, &server, &mut received, bytes, 1, &payload).await?);
        four.push(streams(&client, &server, &mut received, bytes, 4, &payload).await?);
    }
    client.shutdown().await;
    server.shutdown().await;

    let mut stock = Vec::new();
    for _ in 0..runs {
        stock.push(stock_libp2p(bytes, &payload).await?);
    }
    let stock = median(stock);

    let mut report = Report::default();
    let tcp = median(tcp);
    let tls = median(tls);
    let one = median(one);
    let four = median(four);
    report.metrics.insert("bytes_per_run".into(), bytes as f64);
    report.metrics.insert("runs".into(), runs as f64);
    report.metrics.insert("raw_tcp_mb_s".into(), tcp);
    report.metrics.insert("raw_tls_mb_s".into(), tls);
    report.metrics.insert("one_stream_mb_s".into(), one);
    report.metrics.insert("four_streams_mb_s".into(), four);
    report
        .metrics
        .insert("stock_libp2p_one_stream_mb_s".into(), stock);
    report
        .ratios
        .insert("one_stream_vs_raw_tls".into(), one / tls);
    report
        .ratios
        .insert("four_streams_vs_raw_tls".into(), four / tls);
    report.ratios.insert("raw_tls_vs_raw_tcp".into(), tls / tcp);
    report
        .ratios
        .insert("stock_libp2p_vs_raw_tls".into(), stock / tls);
    Ok(report)
}

/// Two connected nodes; the server counts every stream of [`PROTOCOL`] and reports each total.
async fn connected_pair(pki: &Pki) -> anyhow::Result<(Network, Network, mpsc::Receiver<u64>)> {
    let mut server_settings = Settings::new("bench-server");
    server_settings.listen_addresses = vec!["/ip4/127.0.0.1/tcp/0".parse()?];
    server_settings.relay_circuit = false;
    let (server, _) = hypha_network::start(server_settings, &pki.server, pki.trust()?).await?;
    let mut client_settings = Settings::new("bench-client");
    client_settings.relay_circuit = false;
    let (client, _) = hypha_network::start(client_settings, &pki.client, pki.trust()?).await?;

    let address = server
        .listen_addresses()
        .await?
        .into_iter()
        .next()
        .context("the server has no listen address")?;
    client.dial(address).await?;

    let mut incoming = server.accept_streams(PROTOCOL)?;
    let (tx, received) = mpsc::channel(16);
    tokio::spawn(async move {
        while let Some((_, stream)) = incoming.next().await {
            let tx = tx.clone();
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
        tokio::spawn(async move {
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

/// One stream over stock libp2p-tls (self-signed libp2p certificates) and libp2p-yamux
/// (16 KiB frames) from crates.io: what our transport replaces, measured for comparison.
async fn stock_libp2p(bytes: u64, payload: &[u8]) -> anyhow::Result<f64> {
    use futures::StreamExt as _;
    use libp2p::swarm::SwarmEvent;

    let build = || -> anyhow::Result<libp2p::Swarm<libp2p_stream::Behaviour>> {
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
    };
    let mut server = build()?;
    let mut client = build()?;
    server.listen_on("/ip4/127.0.0.1/tcp/0".parse()?)?;
    let address = loop {
        if let SwarmEvent::NewListenAddr { address, .. } = server.select_next_some().await {
            break address;
        }
    };
    let server_peer = *server.local_peer_id();
    let mut incoming = server.behaviour().new_control().accept(PROTOCOL)?;
    let mut control = client.behaviour().new_control();
    let server_task = tokio::spawn(async move {
        loop {
            server.select_next_some().await;
        }
    });
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
    let client_task = tokio::spawn(async move {
        loop {
            client.select_next_some().await;
        }
    });
    let receiver = tokio::spawn(async move {
        let (_, stream) = incoming.next().await.context("no stream")?;
        let stream = tokio_util::compat::FuturesAsyncReadCompatExt::compat(stream);
        anyhow::Ok(drain(stream).await?)
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
    let received = receiver.await??;
    let elapsed = start.elapsed();
    server_task.abort();
    client_task.abort();
    anyhow::ensure!(
        received == bytes,
        "stock libp2p lost bytes: {received} of {bytes}"
    );
    Ok(mb_per_s(bytes, elapsed))
}
