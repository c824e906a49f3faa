//! `distribute`: one artifact to N = 4 and 8 nodes from a throttled origin.
//!
//! The origin is the in-process S3 server of `hypha_artifacts::testing` (s3s + s3s-fs) with a
//! token bucket on the object bytes it serves, shared by all connections: the origin's egress
//! limit. Every node (gateway and N distributors, each with its own cache directory and its
//! own mTLS network) runs in this process over loopback TCP with the default
//! `hypha_artifacts::Settings` (automatic chunk size: 1 MiB here). The clock starts when every
//! node is asked to fetch (all at once, `expect = N`) and stops when the last one has its file,
//! verified and renamed into place.
//!
//! The floor is the time the origin needs to send the artifact once: size ÷ bandwidth.
//! Measured in the same run, every node downloading the object from the origin on its own
//! (one streaming GET each, all at once, through `object_store` as the nodes use it).

use std::{sync::Arc, time::Duration};

use futures::StreamExt;
use hypha_artifacts::{Distributor, FetchOptions, Kind, Origins, Request, Settings};
use hypha_testing::s3::S3Server;
use tokio::time::Instant;

use super::{
    allocation::{dial_address, start_node},
    ceilings::Pki,
};
use crate::Report;

const KEY: &str = "models/weights.bin";

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    let (size_mib, bandwidth_mib) = if quick { (64u64, 32u64) } else { (256, 64) };
    let size = size_mib * 1024 * 1024;
    let bandwidth = bandwidth_mib * 1024 * 1024;
    let floor = size as f64 / bandwidth as f64;
    let pki = Arc::new(Pki::new()?);
    let tmp = tempfile::tempdir()?;
    let mut report = Report::default();
    report
        .metrics
        .insert("artifact_mib".into(), size_mib as f64);
    report
        .metrics
        .insert("origin_bandwidth_mib_per_s".into(), bandwidth_mib as f64);
    report.metrics.insert("floor_s".into(), floor);

    for n in [4usize, 8] {
        let dir = tmp.path().join(format!("n{n}"));
        let s3 = S3Server::start(&dir.join("s3"), Some(bandwidth)).await?;
        s3.put(KEY, hypha_testing::s3::pattern(size as usize, 1))
            .await?;
        let before = s3.bytes_served();

        let swarm = swarm(&pki, &s3, &dir, n, size).await?;
        let swarm_s = swarm.elapsed;
        let swarm_bytes = swarm.served - before;
        let before = s3.bytes_served();
        let alone_s = alone(&s3, n).await?;
        let alone_bytes = s3.bytes_served() - before;

        report.metrics.insert(format!("swarm_s_n{n}"), swarm_s);
        report
            .metrics
            .insert(format!("swarm_origin_done_s_n{n}"), swarm.origin_done);
        report.metrics.insert(format!("alone_s_n{n}"), alone_s);
        report.ratios.insert(
            format!("origin_bytes_n{n}"),
            swarm_bytes as f64 / size as f64,
        );
        report
            .ratios
            .insert(format!("completion_vs_floor_n{n}"), swarm_s / floor);
        report.ratios.insert(
            format!("alone_origin_bytes_n{n}"),
            alone_bytes as f64 / size as f64,
        );
        report
            .ratios
            .insert(format!("alone_completion_vs_floor_n{n}"), alone_s / floor);
    }
    Ok(report)
}

/// N distributors fetch the object together.
async fn swarm(
    pki: &Pki,
    s3: &S3Server,
    dir: &std::path::Path,
    n: usize,
    artifact_size: u64,
) -> anyhow::Result<Swarm> {
    let (gateway, _inbound) = start_node(pki, "gateway", None).await?;
    let gateway_address = dial_address(&gateway).await?;
    let mut nodes = Vec::new();
    for i in 0..n {
        let (network, _inbound) =
            start_node(pki, &format!("node-{i}"), Some(&gateway_address)).await?;
        let origins = Origins::new([("default".to_string(), s3.profile())].into());
        nodes.push(Distributor::start(
            network,
            origins,
            &dir.join(format!("node-{i}/cache")),
            Settings::default(),
        )?);
    }
    // Let the DHT connections settle; joining is not what is measured.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    // When the origin has sent the artifact once: what follows is the swarm's tail.
    let origin_done = {
        let served = s3.served_counter();
        let target = served.load(std::sync::atomic::Ordering::Relaxed) + artifact_size;
        tokio::spawn(async move {
            while served.load(std::sync::atomic::Ordering::Relaxed) < target {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            started.elapsed().as_secs_f64()
        })
    };
    let fetches = nodes.iter().enumerate().map(|(i, node)| {
        let request = Request {
            profile: "default".into(),
            uri: KEY.into(),
            kind: Kind::Object,
            destination: dir.join(format!("node-{i}/weights.bin")),
            unpack: None,
        };
        async move {
            node.fetch(
                &request,
                &FetchOptions {
                    expect: n,
                    progress: None,
                    admission: None,
                },
            )
            .await
        }
    });
    for result in futures::future::join_all(fetches).await {
        result?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let origin_done = origin_done.await?;
    let served = s3.bytes_served();
    for node in &nodes {
        node.leave_all();
    }
    gateway.shutdown().await;
    Ok(Swarm {
        elapsed,
        origin_done,
        served,
    })
}

struct Swarm {
    elapsed: f64,
    /// Seconds until the origin had sent the artifact's size.
    origin_done: f64,
    served: u64,
}

/// N plain downloads of the whole object at once; returns the seconds until the last ends.
async fn alone(s3: &S3Server, n: usize) -> anyhow::Result<f64> {
    let profile = s3.profile();
    let (store, _) =
        object_store::parse_url_opts(&url::Url::parse(&profile.url)?, profile.options)?;
    let store: Arc<dyn object_store::ObjectStore> = Arc::from(store);
    let started = Instant::now();
    let downloads = (0..n).map(|_| {
        let store = store.clone();
        async move {
            let mut stream = store
                .get(&object_store::path::Path::from(KEY))
                .await?
                .into_stream();
            let mut total = 0u64;
            while let Some(bytes) = stream.next().await {
                total += bytes?.len() as u64;
            }
            Ok::<_, object_store::Error>(total)
        }
    });
    for result in futures::future::join_all(downloads).await {
        result?;
    }
    Ok(started.elapsed().as_secs_f64())
}
