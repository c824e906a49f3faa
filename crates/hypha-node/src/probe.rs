use std::time::Duration;

use hypha_config::{Schema, network::NetworkConfig};
use hypha_network::Settings;
use libp2p::Multiaddr;

use crate::{Error, args::ProbeArgs, node};

/// Starts a short-lived client on the network with the certificate from a config file and/or
/// flags: no listeners, no relay; with `join`, it connects to the configured gateways (to use
/// the DHT), otherwise it only dials what it is told to.
pub async fn start_client(
    kind: &str,
    schema: &Schema,
    config: Option<&std::path::Path>,
    overrides: &crate::args::Overrides,
    join: bool,
) -> Result<hypha_network::Network, Error> {
    let config = node::load(schema, config, overrides)?;
    // A client logs nothing; a likely typo is worth a line on stderr all the same.
    for ignored in config.ignored_variables() {
        if ignored.closest.is_some() {
            eprintln!("warning: {ignored}");
        }
    }
    let network_config = NetworkConfig::from_loaded(&config)?;
    let (identity, trust) = node::load_identity(&config, &network_config)?;
    let mut settings = Settings::new(kind);
    settings.relay_circuit = false;
    settings.exclude_cidr = network_config.exclude_cidr.clone();
    if join {
        settings.gateway_addresses = network_config.gateway_addresses.clone();
    }
    let (network, _inbound) = hypha_network::start(settings, &identity, trust)
        .await
        .map_err(|e| Error::Failed(e.to_string()))?;
    Ok(network)
}

/// Checks the health of the node at `args.address`, using the certificate from `args`' config
/// or flags. Prints the node's status; returns `Ok` only when it answered healthy.
pub async fn probe(schema: &Schema, args: &ProbeArgs) -> Result<(), Error> {
    let address: Multiaddr = args.address.parse().map_err(|e| {
        Error::BadInput(format!(
            "address {:?}: {e}; write it like /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...",
            args.address
        ))
    })?;
    let network = start_client(
        "probe",
        schema,
        args.config.as_deref(),
        &args.overrides,
        false,
    )
    .await?;

    let check = async {
        let peer = network.dial(address.clone()).await?;
        network.health(peer).await.map(|status| (peer, status))
    };
    let outcome = tokio::time::timeout(Duration::from_secs(args.timeout), check).await;
    network.shutdown().await;
    match outcome {
        Err(_) => Err(Error::Failed(format!(
            "{address}: no answer within {} s",
            args.timeout
        ))),
        Ok(Err(e)) => Err(Error::Failed(format!("{address}: unreachable: {e}"))),
        Ok(Ok((peer, status))) => {
            println!(
                "{peer}: {} {} — {} ({}; up {} s, {} peers)",
                status.kind,
                status.version,
                if status.healthy {
                    "healthy"
                } else {
                    "UNHEALTHY"
                },
                status.detail,
                status.uptime_secs,
                status.connected_peers
            );
            if !status.nat.is_empty() {
                println!("  NAT: {}", status.nat);
            }
            for path in &status.paths {
                println!("  {}  {}", path.path, path.peer);
            }
            if status.healthy {
                Ok(())
            } else {
                Err(Error::Failed(format!(
                    "{peer} reports itself unhealthy: {}",
                    status.detail
                )))
            }
        }
    }
}
