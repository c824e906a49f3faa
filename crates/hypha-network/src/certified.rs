//! What the handshake learnt of each connected peer's certificate, and what that lets it do.
//!
//! The TLS upgrade writes a peer's entry when a connection's handshake succeeds; the event loop
//! removes it when the peer's last connection closes; handles and the event loop read it. The
//! entry keeps the chain the peer presented, so that a new revocation list can be checked
//! against the peers already connected.
//!
//! Roles are held as the node applies them ([`Roles::effective`]): a role-less certificate holds
//! every role or none, as `allow_roleless` says.

use std::{
    collections::HashMap,
    sync::{Arc, PoisonError, RwLock},
};

use hypha_certs::{Role, Roles};
use hypha_messages::Request;
use libp2p::PeerId;
use rustls::pki_types::CertificateDer;

/// A connected peer's certificate.
#[derive(Debug, Clone)]
pub(crate) struct Certificate {
    pub(crate) roles: Roles,
    /// The CA that signed it ([`hypha_certs::organisation_of_certificate`]).
    pub(crate) organisation: Option<String>,
    /// As presented: the peer's certificate first.
    pub(crate) chain: Vec<CertificateDer<'static>>,
}

/// The certificates of connected peers, shared by the TLS upgrade, the event loop and handles.
#[derive(Debug, Clone)]
pub(crate) struct CertifiedPeers {
    peers: Arc<RwLock<HashMap<PeerId, Certificate>>>,
    allow_roleless: bool,
}

impl CertifiedPeers {
    pub(crate) fn new(allow_roleless: bool) -> Self {
        CertifiedPeers {
            peers: Arc::default(),
            allow_roleless,
        }
    }

    /// Records the chain `peer` presented in a handshake that verified it.
    pub(crate) fn insert(&self, peer: PeerId, chain: Vec<CertificateDer<'static>>) {
        let stated = chain
            .first()
            .and_then(|leaf| Roles::of_certificate(leaf).ok())
            .flatten();
        let roles = Roles::effective(stated, self.allow_roleless);
        let organisation = chain
            .first()
            .and_then(|leaf| hypha_certs::organisation_of_certificate(leaf).ok());
        self.peers
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                peer,
                Certificate {
                    roles,
                    organisation,
                    chain,
                },
            );
    }

    pub(crate) fn remove(&self, peer: &PeerId) {
        self.peers
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(peer);
    }

    /// What `peer` may do; `None` if it is not connected.
    pub(crate) fn roles(&self, peer: &PeerId) -> Option<Roles> {
        self.peers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(peer)
            .map(|c| c.roles)
    }

    /// The organisation `peer`'s certificate belongs to; `None` if it is not connected.
    pub(crate) fn organisation(&self, peer: &PeerId) -> Option<String> {
        self.peers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(peer)
            .and_then(|c| c.organisation.clone())
    }

    /// Every connected peer's certificate.
    pub(crate) fn snapshot(&self) -> Vec<(PeerId, Certificate)> {
        self.peers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(peer, cert)| (*peer, cert.clone()))
            .collect()
    }
}

/// The role a peer must hold to send `request`, if any.
///
/// Only schedulers lease workers and dispatch or cancel jobs; only workers offer to take tasks,
/// report on jobs and iterate a dataset (the consumers of slices: a trainer, or a person's
/// `hypha-data iterate` under a worker certificate), so that a certificate of no role cannot
/// take a data node's iteration places. Everything else any certified peer may ask (health, a
/// manifest, progress); a scheduler's iteration also checks that the asker runs a job of its
/// task, which is more than a role.
pub fn required_role(request: &Request) -> Option<Role> {
    match request {
        Request::Lease(_)
        | Request::Dispatch(_)
        | Request::Cancel { .. }
        | Request::TaskPeers { .. } => Some(Role::Scheduler),
        Request::Offer(_)
        | Request::JobStatus(_)
        | Request::ExecutorStatus { .. }
        | Request::Iterate(_) => Some(Role::Worker),
        Request::Health
        | Request::Manifest { .. }
        | Request::Progress { .. }
        | Request::Neighbour { .. } => None,
    }
}
