//! Nodes as real swarms over TCP on 127.0.0.1 with real certificates, and a real S3 server.

#![allow(clippy::unwrap_used, dead_code)] // tests fail loudly by design; not every test uses every helper

use std::{path::Path, sync::Arc, time::Duration};

use hypha_artifacts::{Distributor, FetchOptions, Fetched, Kind, Origins, Request, Settings};
use hypha_certs::{
    NodeIdentity, Roles, TrustStore,
    authority::{self, Authority, Validity},
};
use hypha_network::Network;
use hypha_testing::s3::S3Server;

pub struct Pki {
    root: Authority,
    org: Authority,
}

impl Pki {
    pub fn new() -> Self {
        let root = authority::create_root("Artifacts Root", Validity::days(2)).unwrap();
        let org = authority::create_org(&root, "Artifacts Org", Validity::days(2)).unwrap();
        Pki { root, org }
    }

    pub async fn start(&self, name: &str, gateway: Option<&libp2p::Multiaddr>) -> Network {
        let node =
            authority::create_node(&self.org, name, &[], Roles::ALL, Validity::days(1)).unwrap();
        let identity =
            NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes()).unwrap();
        let trust = Arc::new(TrustStore::from_pem(self.root.cert_pem().as_bytes(), &[]).unwrap());
        let mut settings = hypha_network::Settings::new(name);
        settings.listen_addresses = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        settings.gateway_addresses = gateway.into_iter().cloned().collect();
        settings.relay_circuit = false;
        settings.relay_server = gateway.is_none();
        hypha_network::start(settings, &identity, trust)
            .await
            .unwrap()
            .0
    }

    pub async fn gateway(&self) -> (Network, libp2p::Multiaddr) {
        let network = self.start("gateway", None).await;
        let addr = network
            .listen_addresses()
            .await
            .unwrap()
            .remove(0)
            .with(libp2p::multiaddr::Protocol::P2p(network.local_peer_id()));
        (network, addr)
    }
}

/// Settings small enough that test artifacts have many chunks.
pub fn settings(chunk_size: u64) -> Settings {
    Settings {
        chunk_size: Some(chunk_size),
        download_slots: 4,
        upload_slots: 4,
        origin_connections: 16,
        // Every node a test expects comes; on a loaded machine it may take more than the
        // default 10 s to find the others, and one that joins late reads from the origin what
        // it saw claimed out of its turn (tests count the origin's bytes exactly).
        join_timeout: Duration::from_secs(60),
        discovery_interval: Duration::from_millis(200),
        // Tests count the origin's bytes exactly; the audit's own test sets a share.
        origin_audit: 0.0,
        ..Settings::default()
    }
}

pub fn origins(s3: &S3Server) -> Origins {
    Origins::new([("default".to_string(), s3.profile())].into())
}

/// A node with its own cache directory under `dir`.
pub async fn node(
    pki: &Pki,
    name: &str,
    gateway: &libp2p::Multiaddr,
    s3: &S3Server,
    dir: &Path,
    settings: Settings,
) -> Distributor {
    let network = pki.start(name, Some(gateway)).await;
    Distributor::start(
        network,
        origins(s3),
        &dir.join(name).join("cache"),
        settings,
    )
    .unwrap()
}

pub fn object(uri: &str, destination: &Path) -> Request {
    Request {
        profile: "default".into(),
        uri: uri.into(),
        kind: Kind::Object,
        destination: destination.to_path_buf(),
        unpack: None,
    }
}

pub fn prefix(uri: &str, destination: &Path) -> Request {
    Request {
        kind: Kind::Prefix,
        ..object(uri, destination)
    }
}

pub use hypha_testing::s3::pattern;

pub async fn fetch(node: &Distributor, request: &Request, expect: usize) -> Fetched {
    node.fetch(
        request,
        &FetchOptions {
            expect,
            progress: None,
            admission: None,
        },
    )
    .await
    .unwrap()
}

/// Writes a few bytes into each of `chunks` of the file at `path`, as a disk that rots or a
/// process that made it writable would.
pub fn rot(path: &Path, chunks: &[u64], chunk_size: u64) {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    for chunk in chunks {
        file.write_all_at(b"rot", chunk * chunk_size + 100).unwrap();
    }
}
