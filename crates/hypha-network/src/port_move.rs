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
//! - A node behind a NAT whose dials of gateways were never seen leaving from its listen port
//!   moves, [`SETTLE`] after the first such observation: it listens on a fresh port (the
//!   system's choice) instead of its TCP listeners' ports, and dials the gateways again from it.
//! - A gateway that sees such a dial come from the fresh port confirms that the NAT keeps ports
//!   and that the old one was taken: the node stays.
//! - A gateway that sees it come from yet another port, or none within [`CHECK`], means a NAT
//!   that changes ports whatever the port (symmetric): the node goes back to its configured
//!   listeners, which hole punching could not use either.
//!
//! A node moves at most once. Connections already made are kept; peers learn the new address
//! from identify. State and rules only (time is passed in); the event loop listens, dials and
//! closes listeners as [`Action`]s say.

use std::time::{Duration, Instant};

use crate::nat::{Nat, NatBelief};

/// How long the gateways' observations may show only other ports before the node moves: a
/// second connection to a gateway (another of its addresses naming the same host) leaves from
/// another port, and its observation may come a moment before the first one's. Short, as the
/// move is best made before any hole punch holds the old port's public pairs.
pub const SETTLE: Duration = Duration::from_millis(100);
/// How long the node waits, on its fresh port, for a gateway to observe a dial from it.
pub const CHECK: Duration = Duration::from_secs(5);

/// What the event loop is to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Listen on a fresh port instead of the configured ones; once it is up, close those and
    /// dial the gateways again (then call [`PortMove::moved`]).
    Move,
    /// Listen on the configured addresses again and close the fresh listener.
    Return,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// On the configured listeners; `since`: when the gateways' observations first showed only
    /// other ports.
    Watching { since: Option<Instant> },
    /// Told to move; the fresh listener is not up yet.
    Moving,
    /// On the fresh `port` since `since`, waiting for a gateway's observation of a dial from it.
    Checking { port: u16, since: Instant },
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The NAT keeps the fresh port: another machine behind it held the old one.
    Stayed { port: u16 },
    /// The NAT changes the fresh port too: back to the configured listeners.
    Returned { port: u16 },
}

impl PortMove {
    /// What is due at `now`, given what the node believes of its NAT; `None`: nothing.
    pub fn poll(&mut self, nat: &NatBelief, now: Instant) -> Option<Action> {
        match self.stage {
            Stage::Watching { since } => match nat.belief() {
                Nat::ChangesPorts => {
                    let since = since.unwrap_or(now);
                    if now.duration_since(since) >= SETTLE {
                        self.stage = Stage::Moving;
                        Some(Action::Move)
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
                Nat::Unknown => None,
            },
            Stage::Checking { port, since } if now.duration_since(since) >= CHECK => {
                if nat.kept(port) {
                    self.stage = Stage::Settled;
                    None
                } else {
                    self.stage = Stage::Settled;
                    Some(Action::Return)
                }
            }
            Stage::Moving | Stage::Checking { .. } | Stage::Settled => None,
        }
    }

    /// The fresh listener is up on `port` at `now`, and the gateways are being dialled from it.
    pub fn moved(&mut self, port: u16, now: Instant) {
        if self.stage == Stage::Moving {
            self.stage = Stage::Checking { port, since: now };
        }
    }

    /// A gateway observed a dial of this node leave its NAT from `observed_port`: how the move
    /// ends, when this ends it.
    pub fn observed(&mut self, observed_port: u16) -> Option<(Outcome, Option<Action>)> {
        let Stage::Checking { port, .. } = self.stage else {
            return None;
        };
        self.stage = Stage::Settled;
        Some(if observed_port == port {
            (Outcome::Stayed { port }, None)
        } else {
            (Outcome::Returned { port }, Some(Action::Return))
        })
    }
}

#[cfg(test)]
mod tests {
    use libp2p::{Multiaddr, PeerId};

    use super::*;

    fn addr(text: &str) -> Multiaddr {
        text.parse().unwrap()
    }

    fn behind_a_nat(port: u16) -> NatBelief {
        let mut nat = NatBelief::default();
        nat.own_address(&addr(&format!("/ip4/10.60.0.11/tcp/{port}")));
        nat
    }

    #[test]
    fn a_node_whose_port_another_machine_holds_moves_and_stays_where_the_nat_keeps_its_port() {
        let start = Instant::now();
        let mut nat = behind_a_nat(4001);
        let mut moving = PortMove::default();
        assert_eq!(moving.poll(&nat, start), None, "nothing observed yet");
        let gateway = PeerId::random();
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/23456"));
        assert_eq!(moving.poll(&nat, start), None, "settling");
        assert_eq!(moving.poll(&nat, start + SETTLE), Some(Action::Move));
        assert_eq!(moving.poll(&nat, start + SETTLE * 2), None, "moving once");
        moving.moved(40500, start + SETTLE);
        assert_eq!(
            moving.observed(40500),
            Some((Outcome::Stayed { port: 40500 }, None))
        );
        assert_eq!(moving.poll(&nat, start + CHECK * 2), None);
        assert_eq!(moving.observed(40500), None, "settled");
    }

    #[test]
    fn behind_a_nat_that_changes_every_port_the_node_returns_to_its_configured_port() {
        let start = Instant::now();
        let mut nat = behind_a_nat(4001);
        let mut moving = PortMove::default();
        nat.observed(PeerId::random(), &addr("/ip4/198.51.100.10/tcp/23456"));
        moving.poll(&nat, start);
        assert_eq!(moving.poll(&nat, start + SETTLE), Some(Action::Move));
        moving.moved(40500, start + SETTLE);
        assert_eq!(
            moving.observed(61234),
            Some((Outcome::Returned { port: 40500 }, Some(Action::Return)))
        );

        // No observation at all within the check: the same.
        let mut moving = PortMove::default();
        moving.poll(&nat, start);
        moving.poll(&nat, start + SETTLE);
        moving.moved(40500, start + SETTLE);
        assert_eq!(moving.poll(&nat, start + SETTLE + CHECK / 2), None);
        assert_eq!(
            moving.poll(&nat, start + SETTLE + CHECK),
            Some(Action::Return)
        );
    }

    #[test]
    fn a_node_seen_on_its_own_port_or_on_a_public_address_never_moves() {
        let start = Instant::now();
        let mut nat = behind_a_nat(4001);
        let mut moving = PortMove::default();
        let gateway = PeerId::random();
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/4001"));
        assert_eq!(moving.poll(&nat, start), None);
        // A second connection from another port later changes nothing.
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/50000"));
        assert_eq!(moving.poll(&nat, start + SETTLE * 10), None);

        let mut public = NatBelief::default();
        public.own_address(&addr("/ip4/198.51.100.2/tcp/4001"));
        public.observed(gateway, &addr("/ip4/198.51.100.2/tcp/50000"));
        let mut moving = PortMove::default();
        assert_eq!(moving.poll(&public, start + SETTLE * 10), None);
    }

    #[test]
    fn its_own_port_seen_while_settling_keeps_the_node_where_it_is() {
        let start = Instant::now();
        let mut nat = behind_a_nat(43425);
        let mut moving = PortMove::default();
        let gateway = PeerId::random();
        // The second connection's observation came first.
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/54948"));
        assert_eq!(moving.poll(&nat, start), None);
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/43425"));
        assert_eq!(moving.poll(&nat, start + SETTLE), None);
        assert_eq!(moving.poll(&nat, start + SETTLE * 10), None);
    }
}
