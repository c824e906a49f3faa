//! The gateway: a stable, publicly reachable node that holds a Hypha network together.
//!
//! A gateway is where nodes first connect (`gateway_addresses`), the anchor from which they
//! bootstrap the Kademlia DHT, and a relay for peers that cannot reach each other directly
//! (nodes behind NAT listen through it). It runs no jobs and serves no data: everything it does
//! is the shared network stack with the relay server switched on.

use hypha_config::{Schema, network, telemetry};
use hypha_messages::market::WORKER_TOPIC;
use hypha_network::{Network, NetworkError};
use hypha_node::{Error, Node, RunArgs};

/// The default listen address: a fixed port, because nodes are configured with it.
pub const DEFAULT_LISTEN: &str = r#"["/ip4/0.0.0.0/tcp/4001"]"#;

/// Every key a gateway accepts.
pub fn schema() -> Schema {
    let mut keys = network::keys_with_listen_default(DEFAULT_LISTEN);
    keys.extend(telemetry::keys());
    Schema::new("hypha-gateway", keys)
}

/// Runs a gateway until the process is asked to stop.
pub async fn run(args: &RunArgs) -> Result<(), Error> {
    let node = Node::start("gateway", &schema(), args, |settings| {
        settings.relay_server = true;
        // Gateways are the relay; listening through another gateway's relay would be circular.
        settings.relay_circuit = false;
    })
    .await?;
    let served = tokio::select! {
        served = serve(&node.network, hypha_node::shutdown_signal()) => served,
        () = announce_join_addresses(&node.network) => Ok(()),
    };
    served.map_err(|e| Error::Failed(e.to_string()))?;
    tracing::info!("shutting down");
    node.network.shutdown().await;
    Ok(())
}

/// Logs, once each, the addresses nodes can join at, as listeners report them: a wildcard
/// listener reports each interface's address separately, some after the network has started.
/// Returns only when the network has shut down.
async fn announce_join_addresses(network: &Network) {
    let peer_id = network.local_peer_id();
    let mut listening = network.listen_address_changes();
    let mut announced = std::collections::HashSet::new();
    loop {
        let addresses: Vec<_> = listening.borrow_and_update().clone();
        for address in addresses {
            if announced.insert(address.clone()) {
                tracing::info!(
                    "nodes can join with gateway_addresses = [\"{address}/p2p/{peer_id}\"]"
                );
            }
        }
        if listening.changed().await.is_err() {
            return;
        }
    }
}

/// Does a gateway's work on a started network (started with `relay_server`) until `shutdown`
/// resolves.
pub async fn serve(
    network: &Network,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), NetworkError> {
    // Workers usually reach the network only through gateways, so a gateway joins the market
    // topic to relay advertisements between schedulers and workers; it reads none of them.
    let mut market = network.subscribe(WORKER_TOPIC, 16).await?;
    network
        .set_health(true, "relaying, serving the DHT and the market topic")
        .await?;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            Some(_) = market.recv() => {}
        }
    }
}
