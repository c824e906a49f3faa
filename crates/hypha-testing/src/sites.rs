//! Sites behind NATs, on one machine: a public network with the gateway, and sites that are
//! each a private LAN behind a NAT router with a rate-limited uplink, as homes and labs are.
//!
//! ```text
//!   root namespace ("the internet"): bridge {p}pb, 198.51.100.1/24, no route to any LAN
//!     ├── {p}gr ═ veth ═ {p}gn  in {p}gw, 198.51.100.2: the gateway's public host
//!     ├── {p}r0w ═ veth ═ {p}r0u in router {p}r0, 198.51.100.10 (tbf both ways)
//!     │     router {p}r0: MASQUERADE out of {p}r0u (`--random-fully`: symmetric NAT),
//!     │     a stateful firewall (nothing in from the WAN but replies), LAN bridge {p}r0l
//!     │     10.60.0.1/24
//!     │       ├── {p}r0h0 ═ veth ═ {p}s0n0 in {p}s0n0, 10.60.0.10 (default route: the router)
//!     │       └── {p}r0h1 ═ veth ═ {p}s0n1 in {p}s0n1, 10.60.0.11
//!     ├── {p}r1w ═ veth ═ {p}r1u in router {p}r1, 198.51.100.11, LAN 10.61.0.0/24
//!     …
//! ```
//!
//! Public addresses are from TEST-NET-2 (198.51.100.0/24), which is no private range, so
//! nodes treat them as public. The LANs are unroutable beyond their router: a node of one
//! site that dials another site's private address gets no answer, as on the internet. The
//! routers do not hairpin (a node dialling its own router's public address gets nowhere):
//! nodes of one site must find each other on their LAN.
//!
//! A site behind a carrier-grade NAT ([`Nat::CarrierGrade`]) has two NATs in a row: the ISP's
//! host `{p}i{k}` holds the public address and the rate limits (`{p}r{k}w ═ {p}i{k}u`) and
//! reaches the site's router over the shared range (`{p}i{k}d`, 100.64.k.1 ═ `{p}r{k}u`,
//! 100.64.k.2); both MASQUERADE, both with the stateful firewall.
//!
//! [`Sites::with_port`] makes every node listen on one port, as deployments that open the same
//! port on every machine do: two machines of a site then share their router's public ports.
//!
//! A site without NAT ([`Nat::None`]) is the same LAN on the same links, but public: its
//! nodes have addresses from TEST-NET-3 (203.0.113.32k + 10 + j), its router only routes, and
//! every other host has a route to it. Sites without NAT are what the links allow, the
//! yardstick for sites behind NATs.
//!
//! One testbed at a time in a process (its public addresses are fixed): [`Sites::new`] waits
//! for the one before to be dropped.
//!
//! Bytes are counted where they cross: [`Sites::gateway_bytes`] (the gateway's host) and
//! [`Sites::site_bytes`] (a site's uplink and downlink). Needs root (CAP_NET_ADMIN), iproute2
//! and iptables; everything is removed when the [`Sites`] is dropped, and left-overs of a run
//! that was killed when the next one with the same prefix starts.

use std::collections::BTreeMap;

use crate::{
    cluster::{Cluster, Place, Proc, bin, command_in},
    netns::{output, run},
};

/// The public address of the root namespace on the internet bridge.
pub const INTERNET_IP: &str = "198.51.100.1";
/// The gateway host's public address.
pub const GATEWAY_IP: &str = "198.51.100.2";

/// How a site's router translates addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nat {
    /// No NAT, no firewall: a public LAN, routed.
    None,
    /// Linux MASQUERADE: keeps a connection's source port where it is free (an
    /// endpoint-independent mapping, as most home routers), lets in only replies.
    Cone,
    /// MASQUERADE `--random-fully`: a random port for every connection, so what one peer
    /// observes says nothing about the port another will see.
    Symmetric,
    /// Two NATs in a row, as a home router on an ISP that shares its public addresses: the
    /// site's router (cone, its WAN in the shared range 100.64.0.0/10) behind the ISP's
    /// carrier-grade NAT (cone, the public address), each with a stateful firewall.
    CarrierGrade,
}

/// One site: its NAT and how many nodes sit on its LAN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub nat: Nat,
    pub nodes: usize,
}

/// The internet, a gateway host and sites behind NATs; removed when dropped.
#[derive(Debug)]
pub struct Sites {
    prefix: String,
    sites: Vec<Site>,
    /// The port every node listens on; 0: each a free one.
    port: u16,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

/// Held by the testbed that exists.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Sites {
    /// The testbed `prefix` (at most 5 characters: interface names are at most 15), with
    /// each site's uplink and downlink limited to `mbit` Mbit/s. An error says which command
    /// failed, e.g. without root.
    pub fn new(prefix: &str, sites: &[Site], mbit: u32) -> Result<Self, String> {
        let testbed = Sites {
            prefix: prefix.to_string(),
            sites: sites.to_vec(),
            port: 0,
            _one_at_a_time: ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner()),
        };
        testbed.remove();
        testbed.build(mbit)?;
        Ok(testbed)
    }

    fn build(&self, mbit: u32) -> Result<(), String> {
        let p = &self.prefix;
        let internet = format!("{p}pb");
        run(&["ip", "link", "add", &internet, "type", "bridge"])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{INTERNET_IP}/24"),
            "dev",
            &internet,
        ])?;
        run(&["ip", "link", "set", &internet, "up"])?;

        let gateway = self.gateway_netns();
        self.host_on(&internet, &gateway, &format!("{p}gr"), &format!("{p}gn"))?;
        run_in(
            &gateway,
            &[
                "ip",
                "addr",
                "add",
                &format!("{GATEWAY_IP}/24"),
                "dev",
                &format!("{p}gn"),
            ],
        )?;
        run_in(&gateway, &["ip", "link", "set", &format!("{p}gn"), "up"])?;

        let rate = format!("{mbit}mbit");
        // A burst of a few ms of traffic and a queue of 50 ms: what a home router holds.
        let limit = [
            "tbf",
            "rate",
            rate.as_str(),
            "burst",
            "64kb",
            "latency",
            "50ms",
        ];
        for (k, site) in self.sites.iter().enumerate() {
            let router = self.router_netns(k);
            let (wan_root, wan) = (format!("{p}r{k}w"), format!("{p}r{k}u"));
            // Behind a carrier-grade NAT, the ISP's host is on the internet and reaches the
            // router over the shared range.
            let public_host = self.public_host(k);
            let public_end = if site.nat == Nat::CarrierGrade {
                format!("{p}i{k}u")
            } else {
                wan.clone()
            };
            self.host_on(&internet, &public_host, &wan_root, &public_end)?;
            run_in(
                &public_host,
                &[
                    "ip",
                    "addr",
                    "add",
                    &format!("{}/24", self.public_ip(k)),
                    "dev",
                    &public_end,
                ],
            )?;
            run_in(&public_host, &["ip", "link", "set", &public_end, "up"])?;
            let mut down = vec!["tc", "qdisc", "add", "dev", wan_root.as_str(), "root"];
            down.extend(limit);
            run(&down)?;
            let mut up = vec!["tc", "qdisc", "add", "dev", public_end.as_str(), "root"];
            up.extend(limit);
            run_in(&public_host, &up)?;
            if site.nat == Nat::CarrierGrade {
                self.access_link(k, &public_host, &router, &wan)?;
                masquerade(&public_host, &public_end, false)?;
            }

            let lan = format!("{p}r{k}l");
            let lan_prefix = self
                .lan_net(k)
                .split('/')
                .nth(1)
                .unwrap_or("24")
                .to_string();
            run_in(&router, &["ip", "link", "add", &lan, "type", "bridge"])?;
            let router_lan_ip = format!("{}/{lan_prefix}", self.lan_ip(k, None));
            run_in(&router, &["ip", "addr", "add", &router_lan_ip, "dev", &lan])?;
            run_in(&router, &["ip", "link", "set", &lan, "up"])?;
            run_in(&router, &["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
            if site.nat != Nat::None {
                masquerade(&router, &wan, site.nat == Nat::Symmetric)?;
            }

            for j in 0..site.nodes {
                self.node_on_lan(k, j, &lan, &lan_prefix)?;
            }
        }
        self.route_public_lans(&gateway)?;
        Ok(())
    }

    /// Node `j` of site `k`: its namespace, on the site's LAN bridge `lan` (addresses of
    /// prefix length `lan_prefix`), its default route through the site's router.
    fn node_on_lan(&self, k: usize, j: usize, lan: &str, lan_prefix: &str) -> Result<(), String> {
        let router = self.router_netns(k);
        let p = &self.prefix;
        let node = self.node_netns(k, j);
        let (router_end, node_end) = (format!("{p}r{k}h{j}"), format!("{p}s{k}n{j}"));
        run(&["ip", "netns", "add", &node])?;
        run_in(
            &router,
            &[
                "ip",
                "link",
                "add",
                &router_end,
                "type",
                "veth",
                "peer",
                "name",
                &node_end,
            ],
        )?;
        run_in(&router, &["ip", "link", "set", &node_end, "netns", &node])?;
        run_in(&router, &["ip", "link", "set", &router_end, "master", lan])?;
        run_in(&router, &["ip", "link", "set", &router_end, "up"])?;
        run_in(
            &node,
            &[
                "ip",
                "addr",
                "add",
                &format!("{}/{lan_prefix}", self.lan_ip(k, Some(j))),
                "dev",
                &node_end,
            ],
        )?;
        run_in(&node, &["ip", "link", "set", &node_end, "up"])?;
        run_in(&node, &["ip", "link", "set", "lo", "up"])?;
        run_in(
            &node,
            &[
                "ip",
                "route",
                "add",
                "default",
                "via",
                &self.lan_ip(k, None),
            ],
        )?;
        Ok(())
    }

    /// A public LAN: the other hosts of the internet (the gateway's `gateway` among them)
    /// route to it through its router.
    fn route_public_lans(&self, gateway: &str) -> Result<(), String> {
        for (k, _) in self
            .sites
            .iter()
            .enumerate()
            .filter(|(_, s)| s.nat == Nat::None)
        {
            let (net, via) = (self.lan_net(k), self.public_ip(k));
            run(&["ip", "route", "add", &net, "via", &via])?;
            run_in(gateway, &["ip", "route", "add", &net, "via", &via])?;
            for other in (0..self.sites.len()).filter(|other| *other != k) {
                run_in(
                    &self.public_host(other),
                    &["ip", "route", "add", &net, "via", &via],
                )?;
            }
        }
        Ok(())
    }

    /// Behind a carrier-grade NAT: the link from the ISP's host `isp` to the home router
    /// `router` (made here), whose WAN end `wan` has an address of the shared range
    /// 100.64.0.0/10 and its default route through the ISP.
    fn access_link(&self, site: usize, isp: &str, router: &str, wan: &str) -> Result<(), String> {
        let p = &self.prefix;
        let isp_end = format!("{p}i{site}d");
        let (isp_ip, router_ip) = (format!("100.64.{site}.1"), format!("100.64.{site}.2"));
        run(&["ip", "netns", "add", router])?;
        run_in(router, &["ip", "link", "set", "lo", "up"])?;
        run_in(
            isp,
            &[
                "ip", "link", "add", &isp_end, "type", "veth", "peer", "name", wan,
            ],
        )?;
        run_in(isp, &["ip", "link", "set", wan, "netns", router])?;
        run_in(
            isp,
            &[
                "ip",
                "addr",
                "add",
                &format!("{isp_ip}/24"),
                "dev",
                &isp_end,
            ],
        )?;
        run_in(isp, &["ip", "link", "set", &isp_end, "up"])?;
        run_in(isp, &["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
        run_in(
            router,
            &["ip", "addr", "add", &format!("{router_ip}/24"), "dev", wan],
        )?;
        run_in(router, &["ip", "link", "set", wan, "up"])?;
        run_in(router, &["ip", "route", "add", "default", "via", &isp_ip])
    }

    /// Makes namespace `netns` with a veth whose end `root_end` is on the internet bridge and
    /// whose end `inner` is inside it.
    fn host_on(
        &self,
        bridge: &str,
        netns: &str,
        root_end: &str,
        inner: &str,
    ) -> Result<(), String> {
        run(&["ip", "netns", "add", netns])?;
        run(&[
            "ip", "link", "add", root_end, "type", "veth", "peer", "name", inner,
        ])?;
        run(&["ip", "link", "set", inner, "netns", netns])?;
        run(&["ip", "link", "set", root_end, "master", bridge])?;
        run(&["ip", "link", "set", root_end, "up"])?;
        run_in(netns, &["ip", "link", "set", "lo", "up"])
    }

    /// Where the gateway runs: its public host, listening on every interface as `init`
    /// writes.
    pub fn gateway(&self) -> Place {
        Place {
            ip: GATEWAY_IP.into(),
            netns: Some(self.gateway_netns()),
            every_interface: true,
            port: 0,
        }
    }

    /// Every node listens on `port`, as deployments that open one port on every machine
    /// do: machines behind one NAT then share the router's public ports.
    pub fn with_port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// Where node `node` of site `site` runs, listening on every interface as `init` writes.
    pub fn node(&self, site: usize, node: usize) -> Place {
        Place {
            ip: self.lan_ip(site, Some(node)),
            netns: Some(self.node_netns(site, node)),
            every_interface: true,
            port: self.port,
        }
    }

    /// Site `site`'s public address: its router's on the internet.
    pub fn public_ip(&self, site: usize) -> String {
        format!("198.51.100.{}", 10 + site)
    }

    /// How many sites the testbed has.
    pub fn count(&self) -> usize {
        self.sites.len()
    }

    /// The bytes the gateway's host has sent and received so far.
    pub fn gateway_bytes(&self) -> (u64, u64) {
        // The root end receives what the host sends.
        let end = format!("{}gr", self.prefix);
        (counter(&end, "rx_bytes"), counter(&end, "tx_bytes"))
    }

    /// The bytes site `site` has sent (its uplink) and received (its downlink) so far.
    pub fn site_bytes(&self, site: usize) -> (u64, u64) {
        let end = format!("{}r{site}w", self.prefix);
        (counter(&end, "rx_bytes"), counter(&end, "tx_bytes"))
    }

    fn gateway_netns(&self) -> String {
        format!("{}gw", self.prefix)
    }

    fn router_netns(&self, site: usize) -> String {
        format!("{}r{site}", self.prefix)
    }

    /// Site `site`'s host on the internet: its router, or behind a carrier-grade NAT the
    /// ISP's.
    fn public_host(&self, site: usize) -> String {
        if self.sites[site].nat == Nat::CarrierGrade {
            format!("{}i{site}", self.prefix)
        } else {
            self.router_netns(site)
        }
    }

    fn node_netns(&self, site: usize, node: usize) -> String {
        format!("{}s{site}n{node}", self.prefix)
    }

    /// The LAN address of node `node` of site `site`, or its router's with `None`.
    fn lan_ip(&self, site: usize, node: Option<usize>) -> String {
        let host = node.map_or(1, |n| 10 + n);
        match self.sites[site].nat {
            Nat::None => format!("203.0.113.{}", 32 * site + host),
            Nat::Cone | Nat::Symmetric | Nat::CarrierGrade => format!("10.{}.0.{host}", 60 + site),
        }
    }

    /// The LAN's network, as `ip route` takes it.
    fn lan_net(&self, site: usize) -> String {
        match self.sites[site].nat {
            Nat::None => format!("203.0.113.{}/27", 32 * site),
            Nat::Cone | Nat::Symmetric | Nat::CarrierGrade => format!("10.{}.0.0/24", 60 + site),
        }
    }

    /// Removes the namespaces (their veths and LAN bridges go with them) and the internet
    /// bridge, as far as they exist.
    fn remove(&self) {
        let p = &self.prefix;
        // Left-overs of a run with more sites or nodes go too: every namespace of the prefix.
        if let Ok(list) = output(&["ip", "netns", "list"]) {
            for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
                let ours = name == self.gateway_netns()
                    || name
                        .strip_prefix(p.as_str())
                        .is_some_and(|rest| rest.starts_with(['r', 's', 'i']));
                if ours {
                    let _ = run(&["ip", "netns", "del", name]);
                }
            }
        }
        if let Ok(links) = output(&["ip", "-o", "link", "show"]) {
            for link in links.lines().filter_map(|l| l.split(": ").nth(1)) {
                let name = link.split('@').next().unwrap_or(link);
                if name.starts_with(p.as_str()) {
                    let _ = run(&["ip", "link", "del", name]);
                }
            }
        }
    }
}

impl Drop for Sites {
    fn drop(&mut self) {
        self.remove();
    }
}

/// NAT out of interface `wan` of namespace `router` (MASQUERADE; `--random-fully` if
/// `symmetric`), with a stateful firewall: from the WAN only replies come in.
fn masquerade(router: &str, wan: &str, symmetric: bool) -> Result<(), String> {
    let mut masquerade = vec!["iptables", "-w", "-t", "nat", "-A", "POSTROUTING"];
    masquerade.extend(["-o", wan, "-j", "MASQUERADE"]);
    if symmetric {
        masquerade.push("--random-fully");
    }
    run_in(router, &masquerade)?;
    for chain in ["FORWARD", "INPUT"] {
        let mut replies = vec!["iptables", "-w", "-A", chain, "-i", wan];
        replies.extend(["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED"]);
        replies.extend(["-j", "ACCEPT"]);
        run_in(router, &replies)?;
        run_in(
            router,
            &["iptables", "-w", "-A", chain, "-i", wan, "-j", "DROP"],
        )?;
    }
    Ok(())
}

/// Runs `command` in namespace `netns`.
fn run_in(netns: &str, command: &[&str]) -> Result<(), String> {
    let mut full = vec!["ip", "netns", "exec", netns];
    full.extend_from_slice(command);
    run(&full)
}

fn counter(interface: &str, name: &str) -> u64 {
    let path = format!("/sys/class/net/{interface}/statistics/{name}");
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(0)
}

/// The layout of issue 35 on three sites: site A holds the data node (`data`, serving
/// `blobs`) and the scheduler, site B two trainers (`trainer0`, `trainer1`), site C the
/// parameter server (`ps`) and a trainer (`trainer2`). Starts all but the scheduler, whose
/// place `cluster.place` is left at; returns the nodes with where each runs.
pub fn start_three_site_nodes(cluster: &mut Cluster, sites: &Sites) -> Vec<(Proc, Place)> {
    start_three_site_layout(cluster, &|site, node| sites.node(site, node))
}

/// The nodes of [`start_three_site_nodes`], node `j` of site `k` at `place(k, j)` (the same
/// layout on loopback, say).
pub fn start_three_site_layout(
    cluster: &mut Cluster,
    place: &dyn Fn(usize, usize) -> Place,
) -> Vec<(Proc, Place)> {
    let mut nodes = Vec::new();
    let mut at = |cluster: &mut Cluster, site, node, start: &dyn Fn(&Cluster) -> Proc| {
        cluster.place = place(site, node);
        nodes.push((start(cluster), cluster.place.clone()));
    };
    at(cluster, 0, 0, &|c| c.blobs_data_node("data"));
    at(cluster, 1, 0, &|c| c.trainer_worker("trainer0", ""));
    at(cluster, 1, 1, &|c| c.trainer_worker("trainer1", ""));
    at(cluster, 2, 0, &|c| c.server_worker("ps"));
    at(cluster, 2, 1, &|c| c.trainer_worker("trainer2", ""));
    cluster.place = place(0, 1);
    nodes
}

/// What `hypha-gateway probe` says of a node: the NAT it believes it is behind, and how it
/// reaches each connected peer (`direct`, `hole-punched`, `relayed`) by peer id.
#[derive(Debug, Clone, Default)]
pub struct Probed {
    pub nat: String,
    pub paths: BTreeMap<String, String>,
    /// The whole output, for messages.
    pub text: String,
}

impl Probed {
    /// How the probed node reaches node `name` of `cluster` (`None`: not connected).
    pub fn path_to(&self, cluster: &Cluster, name: &str) -> Option<&str> {
        self.paths.get(&cluster.peer_id(name)).map(String::as_str)
    }
}

/// Probes `node` (started by `cluster`, running at `place`, its log read for the port it
/// listens on) with `hypha-gateway probe` run at `from`, a place on the same LAN (behind a NAT
/// nothing else reaches it).
pub fn probe(cluster: &Cluster, node: &mut Proc, place: &Place, from: &Place) -> Probed {
    while let Ok(line) = node.lines.try_recv() {
        node.seen.push(line);
    }
    let prefix = format!("listening address=/ip4/{}/tcp/", place.ip);
    // The latest: a node behind a NAT that gave its port to another machine moves to a
    // fresh one.
    let port = node
        .seen
        .iter()
        .rev()
        .filter(|l| !l.contains("no longer listening"))
        .find_map(|l| l.split(&prefix).nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{} never listened on {}", node.name, place.ip))
        .to_string();
    if !cluster.path("prober.toml").exists() {
        cluster.config("prober", hypha_certs::Roles::NONE, "");
    }
    let address = format!(
        "/ip4/{}/tcp/{port}/p2p/{}",
        place.ip,
        cluster.peer_id(&node.name)
    );
    let out = command_in(from.netns.as_deref(), bin("hypha-gateway"))
        .args(["probe", &address, "--config"])
        .arg(cluster.path("prober.toml"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let nat = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("NAT: "))
        .unwrap_or_default()
        .to_string();
    let paths = text
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let (path, peer) = (words.next()?, words.next()?);
            ["direct", "hole-punched", "relayed"]
                .contains(&path)
                .then(|| (peer.to_string(), path.to_string()))
        })
        .collect();
    Probed { nat, paths, text }
}
