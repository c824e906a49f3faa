use std::time::Duration;

use ipnet::IpNet;
use libp2p::Multiaddr;

/// How a node takes part in the network. Built from the node's config by the caller.
#[derive(Debug, Clone)]
pub struct Settings {
    /// What the node is (`gateway`, `data`, `worker`, `scheduler`, `probe`); reported by health.
    pub kind: String,
    /// Addresses to listen on, such as `/ip4/0.0.0.0/tcp/4001`.
    pub listen_addresses: Vec<Multiaddr>,
    /// Addresses others can reach this node at, announced as confirmed external addresses.
    pub external_addresses: Vec<Multiaddr>,
    /// Gateways to connect to at start (with `/p2p/<id>` when known) and bootstrap the DHT from.
    pub gateway_addresses: Vec<Multiaddr>,
    /// Address ranges never dialled and never added to the routing table.
    pub exclude_cidr: Vec<IpNet>,
    /// Listen through each gateway's relay, so that peers who cannot reach this node directly
    /// (NAT, firewall) still can. Default: on.
    pub relay_circuit: bool,
    /// Serve as a relay for others (gateways). Default: off.
    pub relay_server: bool,
    /// Bytes a second each TCP connection may carry each way (a peer's share of a gateway's
    /// link, [`link_share`](crate::link_share)); also bounds each relay circuit to as many as
    /// it can carry in its hour. Default: none.
    pub peer_bytes_per_second: Option<u64>,
    /// How long a connection with nothing to do stays open. Default: 5 minutes.
    pub idle_connection_timeout: Duration,
    /// Inbound requests queued for the application before new ones are answered `Busy`.
    /// Default: 256.
    pub inbound_request_queue: usize,
    /// Let peers whose certificates state no role act in every role (certificates issued
    /// before roles existed). Default: off, so a role-less peer may only do what needs no
    /// role.
    pub allow_roleless: bool,
    /// Whether the node answers health checks healthy from the start. A node whose service
    /// comes up after its network (a worker subscribing to advertisements, a data node
    /// announcing its datasets) sets it off and says `set_health(true, …)` once it can do its
    /// job, so that `probe` and the quickstart tell "started" from "ready". Default: on.
    pub healthy_at_start: bool,
}

impl Settings {
    /// Defaults for a node of `kind`; fill in addresses before use.
    pub fn new(kind: impl Into<String>) -> Self {
        Settings {
            kind: kind.into(),
            listen_addresses: Vec::new(),
            external_addresses: Vec::new(),
            gateway_addresses: Vec::new(),
            exclude_cidr: Vec::new(),
            relay_circuit: true,
            relay_server: false,
            peer_bytes_per_second: None,
            idle_connection_timeout: Duration::from_secs(300),
            inbound_request_queue: 256,
            allow_roleless: false,
            healthy_at_start: true,
        }
    }
}
