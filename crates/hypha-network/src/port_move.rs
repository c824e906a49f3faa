//! Moving off a listen port that another machine behind the same NAT holds.
//!
//! Deployments that open one port on every machine (4001, as IPFS-style ones do) put the
//! machines of a site on the same listen port. A NAT that keeps ports (Linux MASQUERADE, most
//! home routers) gives the port to whichever machine first uses it towards a peer; another
//! machine's connections to that peer leave from a public port of the NAT's choosing. Every node
//! talks to the gateway, so one machine of the two is seen there on such a port, and a hole punch
//! aimed at "the NAT's address with the listen port" reaches the other machine: between two such
//! sites only one pair of machines can hold the pair of public addresses at all. Each machine
//! needs a public port of its own:
//!
//! - A node behind a NAT whose dials of gateways from its listen port were seen leaving from
//!   other ports, and never one from the port it left (see [`DialedFrom`](crate::nat::DialedFrom)),
//!   probes [`SETTLE`] after the first such observation: it dials the gateways from a new port.
//! - Seen there on that new port, the NAT keeps ports and the listen port was taken: the node
//!   moves, listening on a fresh port (the system's choice) instead of each configured TCP
//!   listener's, and dials the gateways again from it. Seen elsewhere (or not within
//!   [`CHECK`]), the NAT changes every port (symmetric), which hole punching cannot use
//!   whatever the port: the node stays where it is.
//! - A gateway that sees a dial from the fresh port there confirms the move; one that sees it
//!   elsewhere, or none within [`CHECK`], sends the node back to its configured listeners.
//!
//! A node moves at most once, and a listener it cannot open leaves the ones it has as they are.
//! Connections already made are kept; peers are told the new address (identify). State and
//! rules only (time is passed in); the event loop dials, listens and closes listeners as
//! [`Action`]s say.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use crate::nat::{Nat, NatBelief};

/// How long the gateways' observations may show only ports the NAT changed before the node
/// probes: another observation, of a dial that left from the port it was seen on, may be on
/// its way. Short, as a move is best made before any hole punch holds the old port's public
/// pairs of addresses.
pub const SETTLE: Duration = Duration::from_millis(100);
/// How long a probe, a move or its check waits for what it waits for.
pub const CHECK: Duration = Duration::from_secs(5);

/// What the event loop is to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Dial the gateways from a new port (not a listen port), and report what they observe
    /// ([`PortMove::probed`]).
    Probe,
    /// Listen on a fresh port instead of each configured one; once those are up and the old
    /// ones closed, dial the gateways from it ([`PortMove::moved`], [`PortMove::checked`]).
    Move,
    /// Listen on the configured addresses again and close the fresh listeners.
    Return,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// On the configured listeners; `since`: when the gateways' observations first showed only
    /// ports the NAT changed.
    Watching { since: Option<Instant> },
    /// Dialled the gateways from new ports at `since`.
    Probing { since: Instant },
    /// Told to move at `since`; the fresh listeners are not up yet.
    Moving { since: Instant },
    /// On the fresh `ports` since `since`, waiting for a gateway's observation of a dial from
    /// one of them.
    Checking {
        ports: BTreeSet<u16>,
        since: Instant,
    },
    /// Stays where it is.
    Settled,
}

/// Where the node is in moving its port.
#[derive(Debug)]
pub struct PortMove {
    stage: Stage,
}

impl Default for PortMove {
    fn default() -> Self {
        PortMove {
            stage: Stage::Watching { since: None },
        }
    }
}

/// How a move ended, for the node to say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The NAT keeps ports, but gave this node's listen port to another machine: moving.
    Taken,
    /// The NAT changes every port: nothing to move for.
    Symmetric,
    /// The NAT keeps the fresh port: the node stays on it.
    Stayed { port: u16 },
    /// The NAT did not keep the fresh port: back to the configured listeners.
    Returned,
}

impl PortMove {
    /// What is due at `now`, given what the node believes of its NAT; `None`: nothing.
    pub fn poll(&mut self, nat: &NatBelief, now: Instant) -> Option<Action> {
        match &self.stage {
            Stage::Watching { since } => match nat.belief() {
                Nat::ChangesPorts => {
                    let since = since.unwrap_or(now);
                    if now.duration_since(since) >= SETTLE {
                        self.stage = Stage::Probing { since: now };
                        Some(Action::Probe)
                    } else {
                        self.stage = Stage::Watching { since: Some(since) };
                        None
                    }
                }
                // Its own port seen, or on a public address: nothing to move from.
                Nat::KeepsPorts | Nat::Public => {
                    self.stage = Stage::Settled;
                    None
                }
                Nat::Unknown => {
                    self.stage = Stage::Watching { since: None };
                    None
                }
            },
            // No gateway answered the probe, or the fresh listeners never came up.
            Stage::Probing { since } | Stage::Moving { since }
                if now.duration_since(*since) >= CHECK =>
            {
                self.stage = Stage::Settled;
                None
            }
            Stage::Checking { since, .. } if now.duration_since(*since) >= CHECK => {
                self.stage = Stage::Settled;
                Some(Action::Return)
            }
            _ => None,
        }
    }

    /// A gateway saw a probe's dial leave the NAT from the port it left from (`kept`) or not.
    pub fn probed(&mut self, kept: bool, now: Instant) -> Option<(Outcome, Option<Action>)> {
        if !matches!(self.stage, Stage::Probing { .. }) {
            return None;
        }
        Some(if kept {
            self.stage = Stage::Moving { since: now };
            (Outcome::Taken, Some(Action::Move))
        } else {
            self.stage = Stage::Settled;
            (Outcome::Symmetric, None)
        })
    }

    /// The fresh listeners are up on `ports` at `now`, the configured ones closed: the
    /// gateways are dialled from them.
    pub fn moved(&mut self, ports: BTreeSet<u16>, now: Instant) {
        if matches!(self.stage, Stage::Moving { .. }) {
            self.stage = Stage::Checking { ports, since: now };
        }
    }

    /// A gateway observed a dial from a fresh port leave the NAT from `observed_port`.
    pub fn checked(&mut self, observed_port: u16) -> Option<(Outcome, Option<Action>)> {
        let Stage::Checking { ports, .. } = &self.stage else {
            return None;
        };
        let stayed = ports.contains(&observed_port);
        self.stage = Stage::Settled;
        Some(if stayed {
            (
                Outcome::Stayed {
                    port: observed_port,
                },
                None,
            )
        } else {
            (Outcome::Returned, Some(Action::Return))
        })
    }

    /// Listeners could not be opened: the node stays with those it has.
    pub fn give_up(&mut self) {
        self.stage = Stage::Settled;
    }

    /// Whether the node's listeners are settled (no probe, move or check under way): what
    /// gateways observe of its listen port then holds.
    pub fn settled(&self) -> bool {
        matches!(self.stage, Stage::Watching { .. } | Stage::Settled)
    }
}

#[cfg(test)]
mod tests {
    use libp2p::{Multiaddr, PeerId};

    use super::*;

    fn addr(text: &str) -> Multiaddr {
        text.parse().unwrap()
    }

    /// Behind a NAT, listening on `port`, its dial from it seen on `seen`.
    fn seen_on(port: u16, seen: u16) -> NatBelief {
        let mut nat = NatBelief::default();
        nat.own_address(&addr(&format!("/ip4/10.60.0.11/tcp/{port}")));
        nat.observed(
            PeerId::random(),
            &addr(&format!("/ip4/198.51.100.10/tcp/{seen}")),
            Some(port),
        );
        nat
    }

    #[test]
    fn a_node_whose_port_another_machine_holds_probes_moves_and_stays_where_the_nat_keeps_its_port()
    {
        let start = Instant::now();
        let mut moving = PortMove::default();
        assert_eq!(
            moving.poll(&NatBelief::default(), start),
            None,
            "nothing seen"
        );
        let nat = seen_on(4001, 23456);
        assert_eq!(moving.poll(&nat, start), None, "settling");
        assert_eq!(moving.poll(&nat, start + SETTLE), Some(Action::Probe));
        assert_eq!(moving.poll(&nat, start + SETTLE * 2), None, "probing once");
        assert!(!moving.settled());
        assert_eq!(
            moving.probed(true, start + SETTLE * 2),
            Some((Outcome::Taken, Some(Action::Move)))
        );
        moving.moved(BTreeSet::from([40500, 40501]), start + SETTLE * 3);
        assert_eq!(
            moving.checked(40501),
            Some((Outcome::Stayed { port: 40501 }, None))
        );
        assert!(moving.settled());
        assert_eq!(moving.poll(&nat, start + CHECK * 2), None);
        assert_eq!(moving.checked(40500), None, "settled");
        assert_eq!(moving.probed(true, start + CHECK * 2), None, "settled");
    }

    #[test]
    fn behind_a_nat_that_changes_every_port_the_node_never_moves() {
        let start = Instant::now();
        let nat = seen_on(4001, 23456);
        let mut moving = PortMove::default();
        moving.poll(&nat, start);
        assert_eq!(moving.poll(&nat, start + SETTLE), Some(Action::Probe));
        assert_eq!(
            moving.probed(false, start + SETTLE),
            Some((Outcome::Symmetric, None))
        );
        assert!(moving.settled());
        // No answer to the probe at all: the same.
        let mut moving = PortMove::default();
        moving.poll(&nat, start);
        moving.poll(&nat, start + SETTLE);
        assert_eq!(moving.poll(&nat, start + SETTLE + CHECK), None);
        assert!(moving.settled());
    }

    #[test]
    fn a_fresh_port_the_nat_does_not_keep_sends_the_node_back() {
        let start = Instant::now();
        let nat = seen_on(4001, 23456);
        let mut moving = PortMove::default();
        moving.poll(&nat, start);
        moving.poll(&nat, start + SETTLE);
        moving.probed(true, start + SETTLE);
        moving.moved(BTreeSet::from([40500]), start + SETTLE);
        assert_eq!(
            moving.checked(61234),
            Some((Outcome::Returned, Some(Action::Return)))
        );
        // No observation within the check: the same.
        let mut moving = PortMove::default();
        moving.poll(&nat, start);
        moving.poll(&nat, start + SETTLE);
        moving.probed(true, start + SETTLE);
        moving.moved(BTreeSet::from([40500]), start + SETTLE);
        assert_eq!(moving.poll(&nat, start + SETTLE + CHECK / 2), None);
        assert_eq!(
            moving.poll(&nat, start + SETTLE + CHECK),
            Some(Action::Return)
        );
        // Fresh listeners that never came up: it stays as it is.
        let mut moving = PortMove::default();
        moving.poll(&nat, start);
        moving.poll(&nat, start + SETTLE);
        moving.probed(true, start + SETTLE);
        assert_eq!(moving.poll(&nat, start + SETTLE + CHECK), None);
        assert!(moving.settled());
    }

    #[test]
    fn a_node_seen_on_the_port_it_left_from_or_on_a_public_address_never_moves() {
        let start = Instant::now();
        let gateway = PeerId::random();
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.60.0.11/tcp/4001"));
        // A restart within TIME_WAIT: the dial left from 51234, kept.
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/51234"), Some(51234));
        let mut moving = PortMove::default();
        assert_eq!(moving.poll(&nat, start + SETTLE * 10), None);
        assert!(moving.settled());

        let mut public = NatBelief::default();
        public.own_address(&addr("/ip4/198.51.100.2/tcp/4001"));
        public.observed(gateway, &addr("/ip4/198.51.100.2/tcp/50000"), Some(4001));
        let mut moving = PortMove::default();
        assert_eq!(moving.poll(&public, start + SETTLE * 10), None);
    }

    #[test]
    fn its_own_port_seen_while_settling_keeps_the_node_where_it_is() {
        let start = Instant::now();
        let gateway = PeerId::random();
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.60.0.11/tcp/43425"));
        // Where the dial's port is not known: its first observation says another port.
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/54948"), None);
        let mut moving = PortMove::default();
        assert_eq!(moving.poll(&nat, start), None);
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/43425"), None);
        assert_eq!(moving.poll(&nat, start + SETTLE), None);
        assert_eq!(moving.poll(&nat, start + SETTLE * 10), None);
    }
}
