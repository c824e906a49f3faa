//! The gateway: a stable, publicly reachable node that holds a Hypha network together.
//!
//! A gateway is where nodes first connect (`gateway_addresses`), the anchor from which they
//! bootstrap the Kademlia DHT, and a relay for peers that cannot reach each other directly
//! (nodes behind NAT listen through it). It runs no jobs and serves no data: everything it does
//! is the shared network stack with the relay server switched on.

use hypha_config::{ConfigError, DefaultValue, Key, Kind, Loaded, Schema, network, telemetry};
use hypha_messages::market::WORKER_TOPIC;
use hypha_network::{Network, NetworkError};
use hypha_node::{Error, Node, RunArgs, load_run_config};
use serde::Deserialize;

/// The default listen address: a fixed port, because nodes are configured with it.
pub const DEFAULT_LISTEN: &str = r#"["/ip4/0.0.0.0/tcp/4001"]"#;

/// Every key a gateway accepts.
pub fn schema() -> Schema {
    let mut keys = network::keys_with_listen_default(DEFAULT_LISTEN);
    keys.push(Key {
        name: "relay_peer_mbit",
        kind: Kind::Float,
        default: DefaultValue::Value("100"),
        doc: "The most one peer's connection carries each way, in Mbit/s: everything the gateway relays for a peer crosses it, so no relayed peer takes the gateway's whole link. Each relay circuit carries at most what this passes in its hour. Set it to the link's speed to let one peer use it all.",
    });
    keys.extend(telemetry::keys());
    Schema::new("hypha-gateway", keys)
}

/// The gateway's own settings.
#[derive(Debug, Deserialize)]
struct GatewayConfig {
    relay_peer_mbit: f64,
}

impl GatewayConfig {
    /// Reads and checks them; the bytes a second of each peer's share.
    fn peer_bytes_per_second(loaded: &Loaded) -> Result<u64, ConfigError> {
        let config: GatewayConfig = loaded.section()?;
        let mbit = config.relay_peer_mbit;
        if !mbit.is_finite() || mbit <= 0.0 {
            return Err(loaded.error(
                "relay_peer_mbit",
                format!("{mbit} is no speed"),
                "give the most one peer may use of the gateway's link in Mbit/s, such as 100",
            ));
        }
        // At most 2^53 bytes a second: far beyond any link, exact in f64.
        Ok((mbit * 1e6 / 8.0).clamp(1.0, 9.0e15) as u64)
    }
}

/// Runs a gateway until the process is asked to stop.
pub async fn run(args: &RunArgs) -> Result<(), Error> {
    let loaded = load_run_config(&schema(), args)?;
    let peer_rate = GatewayConfig::peer_bytes_per_second(&loaded)?;
    let node = Node::start_with("gateway", loaded, |settings| {
        settings.relay_server = true;
        settings.peer_bytes_per_second = Some(peer_rate);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests fail loudly by design

    use hypha_config::Layers;

    use super::*;

    fn loaded(text: &str) -> Loaded {
        let required = "cert_pem = \"c.pem\"\nkey_pem = \"k.pem\"\ntrust_pem = \"t.pem\"\n";
        Layers::new(&schema())
            .file_text("gateway.toml", &format!("{required}{text}"))
            .unwrap()
            .load()
            .unwrap()
    }

    #[test]
    fn each_peer_gets_a_share_of_the_link_in_mbit_and_no_speed_is_refused_by_its_key() {
        let default = loaded("");
        assert_eq!(
            GatewayConfig::peer_bytes_per_second(&default).unwrap(),
            12_500_000
        );
        let gigabit = loaded("relay_peer_mbit = 1000\n");
        assert_eq!(
            GatewayConfig::peer_bytes_per_second(&gigabit).unwrap(),
            125_000_000
        );
        let error = GatewayConfig::peer_bytes_per_second(&loaded("relay_peer_mbit = 0\n"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("relay_peer_mbit"), "{error}");
        assert!(error.contains("Mbit/s"), "{error}");
    }
}
