use std::{path::Path, sync::Arc};

use libp2p::{PeerId, identity::Keypair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, pem::PemObject};

use crate::{Error, Roles};

/// A node's own identity: the certificate chain it presents and the Ed25519 key behind it.
///
/// Loading checks that the key belongs to the first certificate, so a node can never start with
/// a mismatched pair and fail later in every handshake.
#[derive(Clone)]
pub struct NodeIdentity {
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivatePkcs8KeyDer<'static>>,
    keypair: Keypair,
    peer_id: PeerId,
    roles: Option<Roles>,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("peer_id", &self.peer_id)
            .field("roles", &self.roles)
            .field("chain_len", &self.chain.len())
            .finish_non_exhaustive()
    }
}

impl NodeIdentity {
    /// Loads a certificate chain (the node's certificate first) and its PKCS#8 private key.
    /// Errors name the offending file and say how to fix it.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, Error> {
        let cert_pem = hypha_files::read(cert_path)?;
        let key_pem = hypha_files::read(key_path)?;
        Self::parse(
            &cert_pem,
            &key_pem,
            &cert_path.display().to_string(),
            &key_path.display().to_string(),
        )
    }

    /// Builds an identity from PEM text already in memory.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Self, Error> {
        Self::parse(cert_pem, key_pem, "certificate", "private key")
    }

    fn parse(
        cert_pem: &[u8],
        key_pem: &[u8],
        cert_name: &str,
        key_name: &str,
    ) -> Result<Self, Error> {
        let chain = crate::parse_certificates(cert_pem)
            .map_err(|reason| Error::malformed(cert_name, reason))?;
        let leaf = chain.first().ok_or_else(|| {
            Error::malformed(
                cert_name,
                "no CERTIFICATE block found; point cert_pem at the node certificate made by `hypha-certutil node`",
            )
        })?;
        let public = crate::ed25519_public_key(leaf).map_err(|r| Error::malformed(cert_name, r))?;

        let key = match PrivateKeyDer::from_pem_slice(key_pem) {
            Ok(PrivateKeyDer::Pkcs8(key)) => key,
            Ok(_) => {
                return Err(Error::malformed(
                    key_name,
                    "not a PKCS#8 key; Hypha keys are Ed25519 in PKCS#8 (\"BEGIN PRIVATE KEY\")",
                ));
            }
            Err(e) => {
                return Err(Error::malformed(
                    key_name,
                    format!(
                        "no private key found ({e}); point key_pem at the key made with the certificate"
                    ),
                ));
            }
        };
        let seed = ed25519_seed(key.secret_pkcs8_der()).ok_or_else(|| {
            Error::malformed(
                key_name,
                "not an Ed25519 key; Hypha node keys must be Ed25519",
            )
        })?;
        let keypair = Keypair::ed25519_from_bytes(seed)
            .map_err(|e| Error::malformed(key_name, format!("invalid Ed25519 key: {e}")))?;
        let ed = keypair
            .clone()
            .try_into_ed25519()
            .map_err(|_| Error::malformed(key_name, "not an Ed25519 key"))?;
        if ed.public().to_bytes() != public {
            return Err(Error::KeyMismatch {
                what: format!("{key_name} does not belong to {cert_name}"),
            });
        }
        let peer_id = keypair.public().to_peer_id();
        let roles = Roles::of_certificate(leaf).map_err(|r| Error::malformed(cert_name, r))?;
        Ok(NodeIdentity {
            chain,
            key: Arc::new(key),
            keypair,
            peer_id,
            roles,
        })
    }

    /// The chain presented in handshakes: the node's certificate first.
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    /// The private key in the form rustls takes.
    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }

    /// The libp2p keypair (signs gossipsub messages and identify records).
    pub fn keypair(&self) -> &Keypair {
        &self.keypair
    }

    /// The node's peer id, derived from its certificate's key.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The roles the node's certificate states; `None` if it is role-less.
    pub fn roles(&self) -> Option<Roles> {
        self.roles
    }
}

/// Extracts the 32-byte seed from an Ed25519 PKCS#8 document (RFC 8410; v1 or v2).
///
/// The layout is fixed: `SEQUENCE { INTEGER version, SEQUENCE { OID 1.3.101.112 },
/// OCTET STRING { OCTET STRING seed } [, public key] }`.
fn ed25519_seed(der: &[u8]) -> Option<[u8; 32]> {
    const ALGORITHM: [u8; 7] = [0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70];
    const SEED_HEADER: [u8; 4] = [0x04, 0x22, 0x04, 0x20];
    // SEQUENCE header (2 bytes, short form) + INTEGER version (3 bytes).
    let rest = der.get(5..)?;
    if der.first() != Some(&0x30) || der.get(2..4) != Some(&[0x02, 0x01]) {
        return None;
    }
    let rest = rest.strip_prefix(&ALGORITHM)?;
    let rest = rest.strip_prefix(&SEED_HEADER)?;
    rest.get(..32)?.try_into().ok()
}
