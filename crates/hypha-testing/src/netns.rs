//! Machines on slow links, on one machine: network namespaces joined by a bridge, each
//! behind a link that `tc … tbf` limits to a rate in both directions (netem is not available
//! on these machines, so there is no added latency).
//!
//! ```text
//!   root namespace: bridge {prefix}br, 10.77.0.1/24 (gateway, data node, scheduler)
//!     ├── {prefix}0r ═ veth ═ {prefix}0n  in namespace {prefix}0, 10.77.0.10
//!     ├── {prefix}1r ═ veth ═ {prefix}1n  in namespace {prefix}1, 10.77.0.11
//!     …
//! ```
//!
//! The root-side end of each veth limits what the host receives, the namespace-side end what
//! it sends; traffic between two hosts crosses both. A link counts all its bytes
//! ([`Wan::bytes`]); the bytes between two hosts are counted by `iptables` rules in the first
//! one's namespace ([`Wan::count_between`]). Needs root (CAP_NET_ADMIN), iproute2 (`ip`, `tc`)
//! and, to count between hosts, `iptables`. Everything is removed when the [`Wan`] is dropped,
//! and left-overs of a run that was killed are removed when the next one starts.

use std::process::Command;

use crate::cluster::Place;

/// The bridge's address: where the nodes of the root namespace listen.
pub const BRIDGE_IP: &str = "10.77.0.1";

/// Namespaces behind rate-limited links; removed when dropped.
#[derive(Debug)]
pub struct Wan {
    prefix: String,
    hosts: usize,
}

impl Wan {
    /// `hosts` namespaces `{prefix}0`, `{prefix}1`, … each behind a link of `mbit` Mbit/s
    /// each way. `prefix` is at most 10 characters (interface names are at most 15). An
    /// error says which command failed, e.g. without root.
    pub fn new(prefix: &str, hosts: usize, mbit: u32) -> Result<Self, String> {
        let wan = Wan {
            prefix: prefix.to_string(),
            hosts,
        };
        wan.remove();
        let bridge = wan.bridge();
        run(&["ip", "link", "add", &bridge, "type", "bridge"])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{BRIDGE_IP}/24"),
            "dev",
            &bridge,
        ])?;
        run(&["ip", "link", "set", &bridge, "up"])?;
        let rate = format!("{mbit}mbit");
        // A burst of a few ms of traffic and a queue of 50 ms: what a home router holds.
        let limit = ["tbf", "rate", &rate, "burst", "64kb", "latency", "50ms"];
        for i in 0..hosts {
            let (netns, root_end, host_end) = (wan.netns(i), wan.root_end(i), wan.host_end(i));
            run(&["ip", "netns", "add", &netns])?;
            run(&[
                "ip", "link", "add", &root_end, "type", "veth", "peer", "name", &host_end,
            ])?;
            run(&["ip", "link", "set", &host_end, "netns", &netns])?;
            run(&["ip", "link", "set", &root_end, "master", &bridge])?;
            run(&["ip", "link", "set", &root_end, "up"])?;
            let ip = format!("{}/24", wan.ip(i));
            run(&["ip", "-n", &netns, "addr", "add", &ip, "dev", &host_end])?;
            run(&["ip", "-n", &netns, "link", "set", &host_end, "up"])?;
            run(&["ip", "-n", &netns, "link", "set", "lo", "up"])?;
            let mut down = vec!["tc", "qdisc", "add", "dev", &root_end, "root"];
            down.extend(limit);
            run(&down)?;
            let mut up = vec![
                "ip", "netns", "exec", &netns, "tc", "qdisc", "add", "dev", &host_end, "root",
            ];
            up.extend(limit);
            run(&up)?;
        }
        Ok(wan)
    }

    /// Where host `i` runs.
    pub fn host(&self, i: usize) -> Place {
        Place {
            ip: self.ip(i),
            netns: Some(self.netns(i)),
            every_interface: false,
            port: 0,
        }
    }

    /// Where the nodes of the root namespace run: on the bridge.
    pub fn root(&self) -> Place {
        Place {
            ip: BRIDGE_IP.into(),
            netns: None,
            every_interface: false,
            port: 0,
        }
    }

    /// The bytes host `i` has sent and received so far, as its link counted them.
    pub fn bytes(&self, i: usize) -> (u64, u64) {
        let counter = |name: &str| {
            let path = format!("/sys/class/net/{}/statistics/{name}", self.root_end(i));
            std::fs::read_to_string(path)
                .ok()
                .and_then(|text| text.trim().parse().ok())
                .unwrap_or(0)
        };
        // The root end receives what the host sends.
        (counter("rx_bytes"), counter("tx_bytes"))
    }

    /// Starts counting the bytes between hosts `i` and `j`
    /// ([`bytes_between`](Self::bytes_between)): accounting rules in `i`'s namespace, IP
    /// packets whole.
    pub fn count_between(&self, i: usize, j: usize) -> Result<(), String> {
        let (netns, peer) = (self.netns(i), self.ip(j));
        for (chain, side) in [("OUTPUT", "-d"), ("INPUT", "-s")] {
            run(&[
                "ip", "netns", "exec", &netns, "iptables", "-w", "-A", chain, side, &peer,
            ])?;
        }
        Ok(())
    }

    /// The bytes host `i` has sent to host `j` and received from it since
    /// [`count_between`](Self::count_between)`(i, j)`.
    pub fn bytes_between(&self, i: usize, j: usize) -> Result<(u64, u64), String> {
        let (netns, peer) = (self.netns(i), self.ip(j));
        // `iptables -nvxL` rows: pkts bytes [target] prot opt in out source destination.
        let counted = |chain: &str, column_from_end: usize| {
            let command = [
                "ip", "netns", "exec", &netns, "iptables", "-w", "-nvxL", chain,
            ];
            let output = output(&command)?;
            output
                .lines()
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let address = fields.len().checked_sub(column_from_end)?;
                    (fields[address] == peer).then(|| fields.get(1)?.parse::<u64>().ok())?
                })
                .next()
                .ok_or_else(|| format!("no count of {chain} with {peer} in {netns}"))
        };
        Ok((counted("OUTPUT", 1)?, counted("INPUT", 2)?))
    }

    fn bridge(&self) -> String {
        format!("{}br", self.prefix)
    }

    fn netns(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }

    fn root_end(&self, i: usize) -> String {
        format!("{}{i}r", self.prefix)
    }

    fn host_end(&self, i: usize) -> String {
        format!("{}{i}n", self.prefix)
    }

    fn ip(&self, i: usize) -> String {
        format!("10.77.0.{}", 10 + i)
    }

    /// Removes the namespaces (their veths go with them) and the bridge, as far as they
    /// exist.
    fn remove(&self) {
        for i in 0..self.hosts {
            let _ = run(&["ip", "netns", "del", &self.netns(i)]);
            let _ = run(&["ip", "link", "del", &self.root_end(i)]);
        }
        let _ = run(&["ip", "link", "del", &self.bridge()]);
    }
}

impl Drop for Wan {
    fn drop(&mut self) {
        self.remove();
    }
}

pub(crate) fn run(command: &[&str]) -> Result<(), String> {
    output(command).map(drop)
}

/// What `command` printed, or what failed.
pub(crate) fn output(command: &[&str]) -> Result<String, String> {
    let output = Command::new(command[0])
        .args(&command[1..])
        .output()
        .map_err(|e| format!("{}: {e}", command.join(" ")))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "{}: {}",
            command.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}
