//! `dataserve`: slices fetched from a data node by 1, 4 and 16 concurrent fetchers, verified
//! (BLAKE3) and written to disk as `DataClient` does, beside a raw rustls TLS stream.
//!
//! The data node runs in a child process (this binary, re-executed), so its CPU time and peak
//! memory are its own: read from `/proc/<pid>/stat` (user + system time, in clock ticks of
//! 1/100 s) and `/proc/<pid>/status` (`VmHWM`).

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context;
use futures::AsyncReadExt;
use hypha_data::{
    DataClient,
    protocol::{self, PROTOCOL, SliceHeader, SliceRequest},
};
use hypha_network::{PeerId, Settings};

use super::ceilings::{Pki, Sides, raw_tls};
use crate::{Report, mb_per_s, median};

const SLICES: usize = 16;
const DATASET: &str = "bench";

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    let slice_mib: usize = if quick { 16 } else { 64 };
    let tmp = tempfile::tempdir()?;
    let pki = Pki::new()?;
    let dataset = tmp.path().join(DATASET);
    write_dataset(&dataset, slice_mib * 1024 * 1024)?;
    let certs = write_certs(tmp.path(), &pki)?;

    let mut child = DataNode::spawn(&dataset, &certs)?;
    let mut settings = Settings::new("bench-fetcher");
    settings.relay_circuit = false;
    let (network, _) = hypha_network::start(settings, &pki.client, pki.trust()?).await?;
    let peer = network.dial(child.address.parse()?).await?;
    let client = DataClient::new(network.clone());
    let manifest = client.manifest(peer, DATASET).await?;

    let mut ttfb = Vec::new();
    for _ in 0..5 {
        ttfb.push(time_to_first_byte(&network, peer).await?.as_secs_f64() * 1000.0);
    }

    let downloads = tmp.path().join("downloads");
    std::fs::create_dir(&downloads)?;
    let cpu_before = child.cpu_seconds()?;
    let mut bytes_served = 0u64;
    let mut report = Report::default();
    for (concurrency, fetches) in [(1usize, 4usize), (4, SLICES), (16, SLICES)] {
        let start = Instant::now();
        let mut tasks = Vec::new();
        for worker in 0..concurrency {
            let client = client.clone();
            let entries: Vec<_> = (worker..fetches)
                .step_by(concurrency)
                .map(|i| manifest.slices[i % manifest.slices.len()].clone())
                .collect();
            let dir = downloads.clone();
            tasks.push(tokio::spawn(async move {
                let mut bytes = 0u64;
                for entry in entries {
                    let dest = dir.join(format!("{worker}-{}.safetensors", entry.index));
                    client.fetch_slice(DATASET, &entry, &[peer], &dest).await?;
                    std::fs::remove_file(&dest)?;
                    bytes += entry.size;
                }
                anyhow::Ok(bytes)
            }));
        }
        let mut bytes = 0u64;
        for task in tasks {
            bytes += task.await??;
        }
        bytes_served += bytes;
        report.metrics.insert(
            format!("c{concurrency}_mb_s"),
            mb_per_s(bytes, start.elapsed()),
        );
        report.metrics.insert(
            format!("c{concurrency}_slices_per_s"),
            (fetches as f64) / start.elapsed().as_secs_f64(),
        );
    }
    let cpu = child.cpu_seconds()? - cpu_before;
    let peak_rss_mb = child.peak_rss_mb()?;
    child.stop()?;
    network.shutdown().await;

    let payload: Vec<u8> = (0..super::ceilings::CHUNK)
        .map(|i| (i % 251) as u8)
        .collect();
    let sides = Sides::new()?;
    let mut tls = Vec::new();
    for _ in 0..3 {
        tls.push(raw_tls(&sides, (slice_mib * 4 * 1024 * 1024) as u64, &payload, &pki).await?);
    }
    let tls = median(tls);

    report.metrics.insert("slice_mib".into(), slice_mib as f64);
    report.metrics.insert("raw_tls_mb_s".into(), tls);
    report.metrics.insert("ttfb_ms".into(), median(ttfb));
    report.metrics.insert(
        "datanode_cpu_s_per_gb".into(),
        cpu / (bytes_served as f64 / 1e9),
    );
    report
        .metrics
        .insert("datanode_peak_rss_mb".into(), peak_rss_mb);
    for c in [1, 4, 16] {
        let mb_s = report.metrics[&format!("c{c}_mb_s")];
        report.ratios.insert(format!("c{c}_vs_raw_tls"), mb_s / tls);
    }
    Ok(report)
}

/// Writes `SLICES` plain SafeTensors slices of `bytes` each and their manifest.
fn write_dataset(dir: &Path, bytes: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let header =
        format!(r#"{{"data":{{"dtype":"U8","shape":[{bytes}],"data_offsets":[0,{bytes}]}}}}"#);
    let mut header = header.into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let block: Vec<u8> = (0..1024 * 1024).map(|i| (i % 253) as u8).collect();
    for i in 0..SLICES {
        let mut file = std::io::BufWriter::new(std::fs::File::create(
            dir.join(format!("slice-{i:04}.safetensors")),
        )?);
        file.write_all(&(header.len() as u64).to_le_bytes())?;
        file.write_all(&header)?;
        file.write_all(&[i as u8; 8])?;
        let mut left = bytes - 8;
        while left > 0 {
            let n = left.min(block.len());
            file.write_all(&block[..n])?;
            left -= n;
        }
        file.flush()?;
    }
    hypha_dataset::Dataset::derive(dir)?.write_manifest()?;
    Ok(())
}

struct Certs {
    cert: PathBuf,
    key: PathBuf,
    trust: PathBuf,
}

fn write_certs(dir: &Path, pki: &Pki) -> anyhow::Result<Certs> {
    let certs = Certs {
        cert: dir.join("server-cert.pem"),
        key: dir.join("server-key.pem"),
        trust: dir.join("root.pem"),
    };
    std::fs::write(&certs.cert, &pki.server_pem.0)?;
    std::fs::write(&certs.key, &pki.server_pem.1)?;
    std::fs::write(&certs.trust, &pki.root_pem)?;
    Ok(certs)
}

async fn time_to_first_byte(
    network: &hypha_network::Network,
    peer: PeerId,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut stream = network.open_stream(peer, PROTOCOL).await?;
    let request = SliceRequest {
        dataset: DATASET.into(),
        slice: 0,
        offset: 0,
        file: None,
    };
    protocol::write_frame(&mut stream, &request).await?;
    let header: SliceHeader = protocol::read_frame(&mut stream).await?;
    anyhow::ensure!(matches!(header, SliceHeader::Ok { .. }), "{header:?}");
    let mut first = [0u8; 1];
    stream.read_exact(&mut first).await?;
    // Dropping the stream unclosed resets it, so the server stops sending at once.
    Ok(start.elapsed())
}

/// The data node child process.
struct DataNode {
    child: Child,
    address: String,
}

impl DataNode {
    fn spawn(dataset: &Path, certs: &Certs) -> anyhow::Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg(CHILD_COMMAND)
            .arg(dataset)
            .arg(&certs.cert)
            .arg(&certs.key)
            .arg(&certs.trust)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let address = line
            .strip_prefix("ADDRESS ")
            .context("the data node did not report its address")?
            .trim()
            .to_string();
        Ok(DataNode { child, address })
    }

    fn cpu_seconds(&self) -> anyhow::Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        // Fields after the command name (which may hold spaces) start at ')'.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let ticks = |i: usize| -> anyhow::Result<f64> {
            Ok(fields.get(i).context("short /proc stat")?.parse::<f64>()?)
        };
        // utime and stime are fields 14 and 15 of the full line, 12 and 13 after ')'.
        Ok((ticks(11)? + ticks(12)?) / 100.0)
    }

    fn peak_rss_mb(&self) -> anyhow::Result<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .context("no VmHWM in /proc status")?;
        Ok(kb / 1024.0)
    }

    fn stop(&mut self) -> anyhow::Result<()> {
        drop(self.child.stdin.take());
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for DataNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The hidden first argument that turns this binary into the benchmark's data node.
pub const CHILD_COMMAND: &str = "__dataserve-node";

/// Runs a data node serving `args` = [dataset, cert, key, trust] on a loopback port, prints
/// `ADDRESS <multiaddr>` and serves until its standard input closes.
pub fn child_main(args: &[String]) -> anyhow::Result<()> {
    let [dataset, cert, key, trust] = args else {
        anyhow::bail!("usage: {CHILD_COMMAND} DATASET CERT KEY TRUST");
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let identity = hypha_certs::NodeIdentity::load(Path::new(cert), Path::new(key))?;
        let trust = std::sync::Arc::new(hypha_certs::TrustStore::load(Path::new(trust), None)?);
        let mut settings = Settings::new("data");
        settings.listen_addresses = vec!["/ip4/127.0.0.1/tcp/0".parse()?];
        settings.relay_circuit = false;
        let (network, inbound) = hypha_network::start(settings, &identity, trust).await?;
        let address = network
            .listen_addresses()
            .await?
            .into_iter()
            .next()
            .context("no listen address")?;
        println!("ADDRESS {address}/p2p/{}", network.local_peer_id());
        std::io::stdout().flush()?;
        let catalog = std::sync::Arc::new(std::sync::RwLock::new(hypha_data::Catalog::open(
            Path::new(dataset),
        )?));
        let stdin_closed = async {
            let _ = tokio::task::spawn_blocking(|| {
                let mut sink = String::new();
                while std::io::stdin()
                    .read_line(&mut sink)
                    .map(|n| n > 0)
                    .unwrap_or(false)
                {}
            })
            .await;
        };
        hypha_data::node::serve(
            network,
            inbound,
            catalog,
            Path::new(dataset).join(".hypha-iterations"),
            hypha_data::server::Limits::default(),
            hypha_data::node::REFRESH_INTERVAL,
            stdin_closed,
        )
        .await;
        anyhow::Ok(())
    })
}
