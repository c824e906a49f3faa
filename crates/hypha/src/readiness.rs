//! Whether the quickstart's nodes are ready, asked over the network as `probe` asks: every
//! node answers a health check, `starting` until it can do its work and healthy from then on
//! (`hypha_network::Settings::healthy_at_start`). The quickstart joins its own network as a
//! client with a certificate of no role (a health check needs none), through the gateway,
//! and reaches each node by its peer id.

use std::time::Duration;

use hypha_certs::{NodeIdentity, TrustStore};
use hypha_network::{Multiaddr, Network, PeerId, Settings};

/// How long one health check may take, connecting included.
const ASK_WITHIN: Duration = Duration::from_secs(2);

/// The quickstart's client on its own network, with the runtime that drives it.
#[derive(Debug)]
pub struct Prober {
    runtime: tokio::runtime::Runtime,
    network: Network,
}

/// The client could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot join the quickstart's network to ask its nodes how they are: {0}")]
pub struct ProberError(String);

impl Prober {
    /// Joins the network through `gateway` (its address with `/p2p/…`) as `identity`.
    pub fn start(
        identity: &NodeIdentity,
        trust: TrustStore,
        gateway: &str,
    ) -> Result<Self, ProberError> {
        let gateway: Multiaddr = gateway
            .parse()
            .map_err(|e| ProberError(format!("the gateway's address {gateway}: {e}")))?;
        // One thread drives the client's network between questions.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| ProberError(e.to_string()))?;
        let mut settings = Settings::new("quickstart");
        settings.gateway_addresses = vec![gateway];
        settings.relay_circuit = false;
        let network = runtime
            .block_on(hypha_network::start(
                settings,
                identity,
                std::sync::Arc::new(trust),
            ))
            .map(|(network, _inbound)| network)
            .map_err(|e| ProberError(e.to_string()))?;
        Ok(Self { runtime, network })
    }

    /// Whether `peer` answers healthy now: not while it is starting or cannot be reached.
    pub fn ready(&self, peer: PeerId) -> bool {
        let network = &self.network;
        self.runtime.block_on(async {
            let asked = tokio::time::timeout(ASK_WITHIN, async {
                network.connect(peer).await?;
                network.health(peer).await
            })
            .await;
            matches!(asked, Ok(Ok(status)) if status.healthy)
        })
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.runtime.block_on(self.network.shutdown());
    }
}
