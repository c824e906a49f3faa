//! `dataserve`: slices fetched from a data node by 1, 4 and 16 concurrent fetchers, verified
//! (BLAKE3), beside a raw rustls TLS stream; then the same fetches written to disk as workers
//! write them (temporary file, fsync, rename), beside the disk's own durable write rate.
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
use futures::AsyncReadExt as _;
use hypha_data::{
    DataClient,
    protocol::{self, PROTOCOL, SliceHeader, SliceRequest},
};
use hypha_dataset::SliceEntry;
use hypha_network::{PeerId, Settings};
use std::os::unix::fs::FileExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::ceilings::{Pki, Sides, raw_tls, raw_tls_transfer};
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
    let largest_slice = manifest.slices.iter().map(|e| e.size).max().unwrap_or(0) as usize;
    let mut report = Report::default();
    // CPU seconds of the data node and of this process (the fetcher) over the timed fetches
    // into memory, and the bytes those fetches moved.
    let (mut datanode_cpu, mut fetcher_cpu, mut bytes_in_memory) = (0.0, 0.0, 0u64);
    for destination in [Destination::Memory, Destination::Disk] {
        for concurrency in [1usize, 4, 16] {
            // A fetcher into memory reuses one buffer; it is allocated and touched before the
            // clock starts, as it is after a consumer's first slice, so that the kernel's
            // zeroing of fresh pages is not counted against the data node.
            let buffers: Vec<Vec<u8>> = match destination {
                Destination::Memory => (0..concurrency).map(|_| vec![1u8; largest_slice]).collect(),
                Destination::Disk => Vec::new(),
            };
            let cpu_before = (child.cpu_seconds()?, cpu_seconds(std::process::id())?);
            let start = Instant::now();
            let bytes = fetch_concurrently(
                &client,
                (&manifest.slices, peer),
                (destination, concurrency),
                buffers,
                &downloads,
            )
            .await?;
            let elapsed = start.elapsed();
            if let Destination::Memory = destination {
                datanode_cpu += child.cpu_seconds()? - cpu_before.0;
                fetcher_cpu += cpu_seconds(std::process::id())? - cpu_before.1;
                bytes_in_memory += bytes;
            }
            let key = format!("c{concurrency}{}", destination.suffix());
            report
                .metrics
                .insert(format!("{key}_mb_s"), mb_per_s(bytes, elapsed));
            report.metrics.insert(
                format!("{key}_slices_per_s"),
                (SLICES as f64) / elapsed.as_secs_f64(),
            );
        }
    }
    let peak_rss_mb = child.peak_rss_mb()?;
    child.stop()?;
    network.shutdown().await;

    let tls_bytes = (slice_mib * 4 * 1024 * 1024) as u64;
    let (tls, tls_cpu, verified) = ceilings(&pki, &dataset, &manifest.slices, tls_bytes).await?;
    let slice_bytes = slice_mib * 1024 * 1024;
    let disk =
        tokio::task::spawn_blocking(move || disk_write_mb_s(&downloads, slice_bytes)).await??;

    report.metrics.insert("slice_mib".into(), slice_mib as f64);
    report.metrics.insert("disk_write_mb_s".into(), disk);
    report.metrics.insert("raw_tls_mb_s".into(), tls);
    report
        .metrics
        .insert("raw_tls_verified_mb_s".into(), verified);
    report
        .ratios
        .insert("raw_tls_verified_vs_raw_tls".into(), verified / tls);
    report.metrics.insert("ttfb_ms".into(), median(ttfb));
    let per_gb = |cpu: f64, bytes: u64| cpu / (bytes as f64 / 1e9);
    report.metrics.insert(
        "datanode_cpu_s_per_gb".into(),
        per_gb(datanode_cpu, bytes_in_memory),
    );
    report.metrics.insert(
        "fetcher_cpu_s_per_gb".into(),
        per_gb(fetcher_cpu, bytes_in_memory),
    );
    report.metrics.insert(
        "raw_tls_cpu_s_per_gb".into(),
        per_gb(tls_cpu, 3 * tls_bytes),
    );
    report
        .metrics
        .insert("datanode_peak_rss_mb".into(), peak_rss_mb);
    for c in [1, 4, 16] {
        let mb_s = report.metrics[&format!("c{c}_mb_s")];
        report.ratios.insert(format!("c{c}_vs_raw_tls"), mb_s / tls);
        report
            .ratios
            .insert(format!("c{c}_vs_raw_tls_verified"), mb_s / verified);
        let mb_s = report.metrics[&format!("c{c}_disk_mb_s")];
        report
            .ratios
            .insert(format!("c{c}_disk_vs_disk_write"), mb_s / disk);
    }
    Ok(report)
}

/// What the transfers are measured against, median of 3 each: raw TLS moving `tls_bytes`
/// (MB/s, and the CPU seconds of its three runs), and the verified ceiling over the
/// dataset's `slices` (MB/s).
async fn ceilings(
    pki: &Pki,
    dataset: &Path,
    slices: &[SliceEntry],
    tls_bytes: u64,
) -> anyhow::Result<(f64, f64, f64)> {
    let payload: Vec<u8> = (0..super::ceilings::CHUNK)
        .map(|i| (i % 251) as u8)
        .collect();
    let sides = Sides::new()?;
    let mut tls = Vec::new();
    let cpu_before = cpu_seconds(std::process::id())?;
    for _ in 0..3 {
        tls.push(raw_tls(&sides, tls_bytes, &payload, pki).await?);
    }
    let tls_cpu = cpu_seconds(std::process::id())? - cpu_before;
    let tls = median(tls);
    let mut verified = Vec::new();
    for _ in 0..3 {
        verified.push(raw_tls_verified(&sides, pki, dataset, slices).await?);
    }
    let verified = median(verified);
    Ok((tls, tls_cpu, verified))
}

/// [`SLICES`] fetches of the `slices` `peer` serves, `concurrency` of them in flight at once,
/// into memory (each fetch reusing one of `buffers`, a new one where there are too few) or
/// to files in `downloads` (removed after each): the bytes fetched.
async fn fetch_concurrently(
    client: &DataClient,
    (slices, peer): (&[SliceEntry], PeerId),
    (destination, concurrency): (Destination, usize),
    mut buffers: Vec<Vec<u8>>,
    downloads: &Path,
) -> anyhow::Result<u64> {
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let mut slice = buffers.pop().unwrap_or_default();
        let client = client.clone();
        let entries: Vec<_> = (worker..SLICES)
            .step_by(concurrency)
            .map(|i| slices[i % slices.len()].clone())
            .collect();
        let dir = downloads.to_path_buf();
        tasks.push(tokio::spawn(async move {
            let mut bytes = 0u64;
            for entry in entries {
                match destination {
                    Destination::Memory => {
                        client
                            .fetch_slice_to_vec(DATASET, &entry, &[peer], &mut slice)
                            .await?;
                        anyhow::ensure!(slice.len() as u64 == entry.size);
                    }
                    Destination::Disk => {
                        let dest = dir.join(format!("{worker}-{}.safetensors", entry.index));
                        client.fetch_slice(DATASET, &entry, &[peer], &dest).await?;
                        std::fs::remove_file(&dest)?;
                    }
                }
                bytes += entry.size;
            }
            anyhow::Ok(bytes)
        }));
    }
    let mut bytes = 0u64;
    for task in tasks {
        bytes += task.await??;
    }
    Ok(bytes)
}

/// The least any verified slice transfer can cost, as a ceiling: the dataset's slices over one
/// raw TLS stream, the sender reading each file from the page cache in the data node's block
/// size and the receiver reading each into a reused slice-sized buffer, hashing as it goes and
/// checking the hash against the manifest. No request, header, framing or muxing. MB/s.
async fn raw_tls_verified(
    sides: &Sides,
    pki: &Pki,
    dataset: &Path,
    slices: &[SliceEntry],
) -> anyhow::Result<f64> {
    const BLOCK: usize = 256 * 1024;
    let files: Vec<PathBuf> = slices.iter().map(|e| dataset.join(&e.file)).collect();
    let expected: Vec<(usize, String)> = slices
        .iter()
        .map(|e| (e.size as usize, e.blake3.clone()))
        .collect();
    let total: u64 = slices.iter().map(|e| e.size).sum();
    let received = raw_tls_transfer(
        sides,
        pki,
        |mut tls| async move {
            let mut block = vec![0u8; BLOCK];
            for path in files {
                let file = std::fs::File::open(path)?;
                let mut offset = 0u64;
                loop {
                    let n = file.read_at(&mut block, offset)?;
                    if n == 0 {
                        break;
                    }
                    tls.write_all(&block[..n]).await?;
                    offset += n as u64;
                }
            }
            tls.shutdown().await?;
            Ok(tls)
        },
        |mut tls| async move {
            let largest = expected.iter().map(|(size, _)| *size).max().unwrap_or(0);
            let mut slice = vec![1u8; largest];
            let mut count = 0u64;
            for (size, blake3) in expected {
                let mut hasher = blake3::Hasher::new();
                let mut filled = 0;
                while filled < size {
                    let end = size.min(filled + BLOCK);
                    let n = tls.read(&mut slice[filled..end]).await?;
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    hasher.update(&slice[filled..filled + n]);
                    filled += n;
                }
                if hasher.finalize().to_hex().as_str() != blake3 {
                    return Err(std::io::Error::other("a slice failed its hash"));
                }
                count += size as u64;
            }
            Ok(count)
        },
    )
    .await?;
    anyhow::ensure!(
        received.count == total,
        "verified raw TLS lost bytes: {} of {total}",
        received.count
    );
    Ok(mb_per_s(total, received.elapsed))
}

/// Where fetched slices go.
#[derive(Debug, Clone, Copy)]
enum Destination {
    /// `DataClient::fetch_slice_to_vec`, one buffer per fetcher: the data node, the transport
    /// and verification.
    Memory,
    /// `DataClient::fetch_slice`, as `hypha-data fetch` and workers: also a temporary file,
    /// fsync and rename, so bounded by the disk.
    Disk,
}

impl Destination {
    fn suffix(self) -> &'static str {
        match self {
            Destination::Memory => "",
            Destination::Disk => "_disk",
        }
    }
}

/// The disk's durable write rate, the ceiling of fetches to disk: `SLICES` files of
/// `slice_bytes`, written 256 KiB at a time by four threads, each file fsynced.
fn disk_write_mb_s(dir: &Path, slice_bytes: usize) -> anyhow::Result<f64> {
    let block = vec![7u8; 256 * 1024];
    let start = Instant::now();
    std::thread::scope(|scope| {
        let writers: Vec<_> = (0..4)
            .map(|writer| {
                let block = &block;
                scope.spawn(move || -> std::io::Result<()> {
                    for i in (writer..SLICES).step_by(4) {
                        let path = dir.join(format!("ceiling-{i}"));
                        let mut file = std::fs::File::create(&path)?;
                        write_repeated(&mut file, block, slice_bytes)?;
                        file.sync_all()?;
                        std::fs::remove_file(&path)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for writer in writers {
            writer
                .join()
                .map_err(|_| anyhow::anyhow!("a disk writer panicked"))??;
        }
        anyhow::Ok(())
    })?;
    Ok(mb_per_s((SLICES * slice_bytes) as u64, start.elapsed()))
}

/// Writes `len` bytes: `block` over and over, the last time cut short.
fn write_repeated(file: &mut impl Write, block: &[u8], len: usize) -> std::io::Result<()> {
    let mut left = len;
    while left > 0 {
        let n = left.min(block.len());
        file.write_all(&block[..n])?;
        left -= n;
    }
    Ok(())
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
        write_repeated(&mut file, &block, bytes - 8)?;
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

/// User + system CPU seconds of process `pid`, all threads, from `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
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
        cpu_seconds(self.child.id())
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
            hypha_data::node::Iterations::in_dir(Path::new(dataset).join(".hypha-iterations")),
            hypha_data::server::Limits::default(),
            hypha_data::node::REFRESH_INTERVAL,
            stdin_closed,
        )
        .await;
        anyhow::Ok(())
    })
}
