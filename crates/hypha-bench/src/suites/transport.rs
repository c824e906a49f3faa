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
        .ratios
        .insert("one_stream_vs_raw_tls".into(), one / tls);
    report
        .ratios
        .insert("four_streams_vs_raw_tls".into(), four / tls);
    report.ratios.insert("raw_tls_vs_raw_tcp".into(), tls / tcp);
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
