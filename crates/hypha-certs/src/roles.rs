//! What a node may do in the network, as its certificate says.
//!
//! Roles are written into a node certificate's subject as an organizational unit (`OU`) whose
//! value is `hypha:` followed by role names separated by commas: `hypha:worker`,
//! `hypha:scheduler,worker`. The roles are `scheduler`, `worker`, `data`, `gateway` and
//! `operator`. Several
//! such units add up (`/OU=hypha:worker/OU=hypha:data` is the same as `/OU=hypha:worker,data`).
//! An `OU` rather than a private extension, so that any CA tool can issue them
//! (`openssl req -subj "/CN=worker-1/OU=hypha:worker"`) and any tool shows them; the CA's
//! signature covers the subject, so a node cannot give itself a role.
//!
//! A certificate with no `hypha:` unit at all is *role-less* (issued before roles existed, or by a
//! CA that does not know them). Whether a role-less peer may act in every role or in none is the
//! verifying node's choice (`allow_roleless`); see [`Roles::effective`]. A `hypha:` unit naming a
//! role this version does not know grants nothing, but still makes the certificate not
//! role-less.

use std::{fmt, str::FromStr};

/// The prefix of the organizational-unit values that grant roles.
pub const UNIT_PREFIX: &str = "hypha:";

/// One thing a node may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Advertises tasks, accepts offers, leases workers and dispatches jobs to them.
    Scheduler,
    /// Offers to take tasks, runs jobs and reports on them.
    Worker,
    /// Serves datasets; only data nodes are taken as a dataset's providers.
    Data,
    /// Holds the network together; only gateways relay.
    Gateway,
    /// Watches runs: a scheduler tells its run's progress (the task id, the workers) only to
    /// an operator or to the peers running the run's jobs.
    Operator,
}

impl Role {
    /// Every role, in the order they are shown.
    pub const ALL: [Role; 5] = [
        Role::Scheduler,
        Role::Worker,
        Role::Data,
        Role::Gateway,
        Role::Operator,
    ];

    /// The role's name, as `--role` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Role::Scheduler => "scheduler",
            Role::Worker => "worker",
            Role::Data => "data",
            Role::Gateway => "gateway",
            Role::Operator => "operator",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no role.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a role; the roles are scheduler, worker, data, gateway and operator")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| UnknownRole(s.to_string()))
    }
}

/// A set of roles.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Roles(u8);

impl Roles {
    /// No role: the peer may only do what any certified peer may (health, manifests, a data
    /// node's progress).
    pub const NONE: Roles = Roles(0);
    /// Every role.
    pub const ALL: Roles = Roles(0b1_1111);

    /// Whether the set holds `role`.
    pub fn contains(self, role: Role) -> bool {
        self.0 & role.bit() != 0
    }

    /// The set with `role` added.
    #[must_use]
    pub fn with(self, role: Role) -> Roles {
        Roles(self.0 | role.bit())
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The roles in the set, in [`Role::ALL`]'s order.
    pub fn iter(self) -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    /// The organizational-unit value that grants these roles (`hypha:scheduler,worker`).
    pub fn unit(self) -> String {
        let names: Vec<&str> = self.iter().map(Role::name).collect();
        format!("{UNIT_PREFIX}{}", names.join(","))
    }

    /// What a peer whose certificate states `stated` (`None`: role-less) may do, under a node
    /// that does or does not `allow_roleless`.
    pub fn effective(stated: Option<Roles>, allow_roleless: bool) -> Roles {
        match stated {
            Some(roles) => roles,
            None if allow_roleless => Roles::ALL,
            None => Roles::NONE,
        }
    }

    /// The roles a DER certificate states, or `None` if it is role-less (no `hypha:` unit).
    pub fn of_certificate(der: &[u8]) -> Result<Option<Roles>, String> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("not a valid X.509 certificate: {e}"))?;
        let mut stated = false;
        let mut roles = Roles::NONE;
        for unit in cert.subject().iter_organizational_unit() {
            let Some(name) = unit.as_str().ok().and_then(|u| u.strip_prefix(UNIT_PREFIX)) else {
                continue;
            };
            stated = true;
            roles = name
                .split(',')
                .filter_map(|n| n.trim().parse::<Role>().ok())
                .fold(roles, Roles::with);
        }
        Ok(stated.then_some(roles))
    }
}

impl From<Role> for Roles {
    fn from(role: Role) -> Self {
        Roles::NONE.with(role)
    }
}

impl FromIterator<Role> for Roles {
    fn from_iter<I: IntoIterator<Item = Role>>(iter: I) -> Self {
        iter.into_iter().fold(Roles::NONE, Roles::with)
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("no role");
        }
        let names: Vec<&str> = self.iter().map(Role::name).collect();
        f.write_str(&names.join(", "))
    }
}

impl fmt::Debug for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Roles({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for role in Role::ALL {
            assert_eq!(role.name().parse::<Role>(), Ok(role));
        }
        assert!("admin".parse::<Role>().is_err());
        assert!("Worker".parse::<Role>().is_err());
    }

    #[test]
    fn role_less_peers_get_every_role_or_none_as_the_node_says() {
        assert_eq!(Roles::effective(None, true), Roles::ALL);
        assert_eq!(Roles::effective(None, false), Roles::NONE);
        let worker = Roles::NONE.with(Role::Worker);
        assert_eq!(Roles::effective(Some(worker), true), worker);
        assert_eq!(Roles::effective(Some(Roles::NONE), true), Roles::NONE);
    }
}
