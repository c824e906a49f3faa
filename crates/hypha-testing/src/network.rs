//! Real swarms in this process, on 127.0.0.1 with real certificates of one test CA, for tests
//! of what crosses the network without starting programs.

use std::sync::Arc;

use hypha_certs::{
    NodeIdentity, Roles, TrustStore,
    authority::{self, Validity},
};
use hypha_network::{InboundRequest, Network, Settings};
use tokio::sync::mpsc;

/// Nodes named `names`, each connected to the last.
pub async fn connected(names: &[&str]) -> Vec<Network> {
    connected_serving(names).await.0
}

/// Nodes named `names`, each connected to the last, with the requests each receives.
pub async fn connected_serving(
    names: &[&str],
) -> (Vec<Network>, Vec<mpsc::Receiver<InboundRequest>>) {
    let root = authority::create_root("Test Root", Validity::days(2)).unwrap();
    let org = authority::create_org(&root, "Test Org", Validity::days(2)).unwrap();
    let trust = Arc::new(TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap());
    let mut networks = Vec::new();
    let mut inbound = Vec::new();
    for &name in names {
        let node = authority::create_node(&org, name, &[], Roles::ALL, Validity::days(1)).unwrap();
        let identity =
            NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes()).unwrap();
        let mut settings = Settings::new(name);
        settings.listen_addresses = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        settings.relay_circuit = false;
        let (network, requests) = hypha_network::start(settings, &identity, trust.clone())
            .await
            .unwrap();
        networks.push(network);
        inbound.push(requests);
    }
    let (receiver, others) = networks.split_last().unwrap();
    let address = receiver.listen_addresses().await.unwrap().remove(0);
    for other in others {
        other.dial(address.clone()).await.unwrap();
    }
    (networks, inbound)
}
