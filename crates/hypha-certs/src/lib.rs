//! Hypha's public-key infrastructure.
//!
//! Every Hypha node proves who it is with an X.509 certificate whose key is Ed25519; the node's
//! libp2p `PeerId` is derived from that key, so a certificate *is* a network identity. This crate
//! owns everything about those certificates and nothing about the network that uses them:
//!
//! - [`authority`] issues certificates: a self-signed root CA, organisation CAs signed by a root,
//!   node (end-entity) certificates signed by an organisation, and certificate revocation lists.
//! - [`NodeIdentity`] is a node's own certificate chain and private key, loaded from PEM files and
//!   checked to belong together.
//! - [`TrustStore`] holds the trust anchors and CRLs a node accepts peers under, and verifies a
//!   peer's presented chain (signatures, validity dates, revocation, key usage) down to a
//!   [`PeerId`](libp2p::PeerId).
//! - [`roles`]: what a node may do (scheduler, worker, data, gateway), written into its
//!   certificate by the CA; [`organisation_of_certificate`]: whose it is, the CA that signed it.
//! - [`inspect`] describes certificates and CRLs for humans.
//!
//! Reading certificate files names the file in every error; writing them is the caller's, with
//! `hypha-files` (keys 0600, nothing overwritten unless asked).
//!
//! ```
//! use hypha_certs::{Role, Roles, authority::{self, Validity}};
//!
//! let root = authority::create_root("Example Root", Validity::days(3650)).unwrap();
//! let org = authority::create_org(&root, "Example Org", Validity::days(1825)).unwrap();
//! let worker = Roles::NONE.with(Role::Worker);
//! let node = authority::create_node(&org, "worker-1", &["localhost".into()], worker, Validity::days(365)).unwrap();
//!
//! let trust = hypha_certs::TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
//! let identity = hypha_certs::NodeIdentity::from_pem(
//!     node.chain_pem().as_bytes(),
//!     node.key_pem().as_bytes(),
//! ).unwrap();
//! let peer = trust.verify_peer(identity.chain(), hypha_certs::now()).unwrap();
//! assert_eq!(peer.id, identity.peer_id());
//! assert_eq!(peer.roles, Some(worker));
//! ```

pub mod authority;
mod error;
mod identity;
pub mod inspect;
pub mod roles;
mod trust;

pub use error::Error;
pub use identity::NodeIdentity;
pub use libp2p::PeerId;
pub use roles::{Role, Roles};
pub use rustls::pki_types::CertificateDer;
pub use trust::{CrlDeadlines, PeerRole, Rejection, StaleCrl, TrustStore, VerifiedPeer, now};

/// Parses every `CERTIFICATE` block of a PEM document, in order.
pub fn certificates_from_pem(
    pem: &[u8],
    name: &str,
) -> Result<Vec<CertificateDer<'static>>, Error> {
    parse_certificates(pem).map_err(|reason| Error::malformed(name, reason))
}

pub(crate) fn parse_certificates(
    pem: &[u8],
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not valid PEM: {e}"))
}

/// The peer id a certificate stands for: derived from its Ed25519 key.
pub fn peer_id_of_certificate(cert_der: &[u8]) -> Result<PeerId, Rejection> {
    let key = ed25519_public_key(cert_der).map_err(Rejection::Unusable)?;
    peer_id_of(&key).map_err(Rejection::Unusable)
}

/// The organisation a DER certificate belongs to: the distinguished name of the CA that signed
/// it (`CN=Example Org`). A node signed by an organisation CA belongs to that organisation; one
/// signed by the root directly (a small set-up) to the root's. Shares that one organisation may
/// hold of a node's places (a data node's iterations) count by it.
pub fn organisation_of_certificate(cert_der: &[u8]) -> Result<String, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| format!("not a valid X.509 certificate: {e}"))?;
    Ok(cert.issuer().to_string())
}

/// The raw 32-byte Ed25519 public key of a DER certificate, or why there is none.
pub(crate) fn ed25519_public_key(cert_der: &[u8]) -> Result<[u8; 32], String> {
    const ED25519_OID: &str = "1.3.101.112";
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| format!("not a valid X.509 certificate: {e}"))?;
    let spki = cert.public_key();
    let algorithm = spki.algorithm.algorithm.to_id_string();
    if algorithm != ED25519_OID {
        return Err(format!(
            "its key is not Ed25519 (algorithm {algorithm}); Hypha node certificates must use Ed25519"
        ));
    }
    spki.subject_public_key
        .data
        .as_ref()
        .try_into()
        .map_err(|_| "its Ed25519 key is not 32 bytes long".to_string())
}

/// The libp2p peer id for a raw Ed25519 public key.
pub(crate) fn peer_id_of(public_key: &[u8; 32]) -> Result<libp2p::PeerId, String> {
    let key = libp2p::identity::ed25519::PublicKey::try_from_bytes(public_key)
        .map_err(|e| format!("invalid Ed25519 public key: {e}"))?;
    Ok(libp2p::identity::PublicKey::from(key).to_peer_id())
}
