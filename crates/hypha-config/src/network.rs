//! The keys every network node shares: identity, trust, addresses.

use std::path::PathBuf;

use ipnet::IpNet;
use libp2p::{Multiaddr, multiaddr::Protocol};
use serde::Deserialize;

use crate::{ConfigError, DefaultValue, Key, Kind, Loaded};

/// Ranges excluded by default: addresses that never lead to another machine worth dialling.
/// Loopback and other sites' private addresses need no entry: a node dials them only where
/// they lead somewhere (`hypha_network::reach`).
pub const DEFAULT_EXCLUDE_CIDR: &str =
    r#"["0.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "fe80::/10", "ff00::/8"]"#;

/// The network keys, with `listen_default` as the default of `listen_addresses`.
pub fn keys_with_listen_default(listen_default: &'static str) -> Vec<Key> {
    vec![
        Key {
            name: "cert_pem",
            kind: Kind::Path,
            default: DefaultValue::Required {
                example: r#""certs/node-cert.pem""#,
            },
            doc: "This node's certificate chain (PEM, its own certificate first), made by `hypha-certutil node`. Relative paths are relative to this file.",
        },
        Key {
            name: "key_pem",
            kind: Kind::Path,
            default: DefaultValue::Required {
                example: r#""certs/node-key.pem""#,
            },
            doc: "The Ed25519 private key (PKCS#8 PEM) belonging to cert_pem.",
        },
        Key {
            name: "trust_pem",
            kind: Kind::Path,
            default: DefaultValue::Required {
                example: r#""certs/root-cert.pem""#,
            },
            doc: "The CA certificate(s) this node trusts; peers whose chain does not lead here are refused during the handshake.",
        },
        Key {
            name: "crls_pem",
            kind: Kind::Path,
            default: DefaultValue::Unset {
                example: r#""certs/crl.pem""#,
            },
            doc: "Certificate revocation lists (PEM) to honour, made by `hypha-certutil crl` (an empty one to start with) or `revoke`.",
        },
        Key {
            name: "stale_crl",
            kind: Kind::String,
            default: DefaultValue::Value(r#""refuse""#),
            doc: "What to do with a CRL in crls_pem past its next update (the issuer has not said whether it revoked more since): \"refuse\" the peers whose chains it covers until it is renewed with `hypha-certutil crl`, or \"warn\" and accept them on the stale list.",
        },
        Key {
            name: "allow_roleless",
            kind: Kind::Bool,
            default: DefaultValue::Value("false"),
            doc: "Let peers whose certificates state no role (issued before roles, without `hypha-certutil node --role`) act in every role. Off: they may only do what needs no role (health, manifests, data reads). Turn on while migrating a network to certificates with roles.",
        },
        Key {
            name: "gateway_addresses",
            kind: Kind::Multiaddrs,
            default: DefaultValue::Value("[]"),
            doc: "Gateways to join, as multiaddrs ending in /p2p/<peer id>, e.g. \"/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW...\". The node connects to them at start, reconnects when they drop, and bootstraps the DHT from them.",
        },
        Key {
            name: "listen_addresses",
            kind: Kind::Multiaddrs,
            default: DefaultValue::Value(listen_default),
            doc: "Addresses to listen on. Port 0 picks a free port.",
        },
        Key {
            name: "external_addresses",
            kind: Kind::Multiaddrs,
            default: DefaultValue::Value("[]"),
            doc: "Addresses other nodes can reach this one at (for example behind port forwarding); announced to peers.",
        },
        Key {
            name: "exclude_cidr",
            kind: Kind::Cidrs,
            default: DefaultValue::Value(DEFAULT_EXCLUDE_CIDR),
            doc: "Address ranges never dialled and never added to the routing table, whatever peers announce. Loopback and other sites' private addresses need no entry: they are dialled only where they lead somewhere (one machine; the same LAN).",
        },
        Key {
            name: "relay_circuit",
            kind: Kind::Bool,
            default: DefaultValue::Value("true"),
            doc: "Also listen through each gateway's relay, so peers that cannot reach this node directly (NAT, firewall) still can.",
        },
    ]
}

/// The network keys with the default listen address of ordinary nodes (any interface, a free
/// port).
pub fn keys() -> Vec<Key> {
    keys_with_listen_default(r#"["/ip4/0.0.0.0/tcp/0"]"#)
}

/// What a node does with a CRL past its next update (`stale_crl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StaleCrl {
    Refuse,
    Warn,
}

/// The network settings, as read by [`Loaded::section`].
#[derive(Debug, Clone, Deserialize)]
pub struct NetworkConfig {
    pub cert_pem: PathBuf,
    pub key_pem: PathBuf,
    pub trust_pem: PathBuf,
    pub crls_pem: Option<PathBuf>,
    pub stale_crl: StaleCrl,
    pub allow_roleless: bool,
    pub gateway_addresses: Vec<Multiaddr>,
    pub listen_addresses: Vec<Multiaddr>,
    pub external_addresses: Vec<Multiaddr>,
    pub exclude_cidr: Vec<IpNet>,
    pub relay_circuit: bool,
}

impl NetworkConfig {
    /// Reads and checks the network settings.
    pub fn from_loaded(loaded: &Loaded) -> Result<Self, ConfigError> {
        let config: NetworkConfig = loaded.section()?;
        config.validate(loaded)?;
        Ok(config)
    }

    /// Checks what types alone cannot: dialable gateway addresses outside `exclude_cidr`.
    pub fn validate(&self, loaded: &Loaded) -> Result<(), ConfigError> {
        for (i, address) in self.gateway_addresses.iter().enumerate() {
            let key = format!("gateway_addresses[{i}]");
            let ip = address.iter().find_map(|p| match p {
                Protocol::Ip4(ip) => Some(std::net::IpAddr::V4(ip)),
                Protocol::Ip6(ip) => Some(std::net::IpAddr::V6(ip)),
                _ => None,
            });
            let has_host = ip.is_some()
                || address
                    .iter()
                    .any(|p| matches!(p, Protocol::Dns(_) | Protocol::Dns4(_) | Protocol::Dns6(_)));
            if !has_host || !address.iter().any(|p| matches!(p, Protocol::Tcp(_))) {
                return Err(loaded.error(
                    &key,
                    format!("{address} names no host and TCP port to dial"),
                    "write it like \"/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW...\" or \"/dns4/gateway.example.org/tcp/4001/p2p/12D3KooW...\"",
                ));
            }
            if let Some(ip) = ip
                && let Some((j, range)) = self
                    .exclude_cidr
                    .iter()
                    .enumerate()
                    .find(|(_, range)| range.contains(&ip))
            {
                let range_key = format!("exclude_cidr[{j}]");
                return Err(loaded.error(
                    &key,
                    format!(
                        "{address} lies inside exclude_cidr range {range} (set at {}), so it would never be dialled",
                        loaded.origin(&range_key)
                    ),
                    format!("remove {range} from exclude_cidr, or use an address of the gateway outside it"),
                ));
            }
        }
        Ok(())
    }
}
