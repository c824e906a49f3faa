use std::path::Path;

use libp2p::PeerId;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, UnixTime, pem::PemObject};
use webpki::{
    CertRevocationList, EndEntityCert, ExpirationPolicy, KeyUsage, OwnedCertRevocationList,
    RevocationCheckDepth, RevocationOptionsBuilder, UnknownStatusPolicy,
};

use crate::{Error, Roles};

/// Why a peer's certificate chain was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("the peer presented no certificate")]
    NoCertificate,
    #[error("the certificate has expired")]
    Expired,
    #[error("the certificate is not valid yet")]
    NotYetValid,
    #[error("the certificate has been revoked")]
    Revoked,
    #[error(
        "the revocation list of the certificate's issuer is past its next update: renew it with `hypha-certutil crl` and put it in crls_pem (or set stale_crl = \"warn\" to accept peers meanwhile)"
    )]
    StaleCrl,
    #[error("the certificate was not issued by a trusted CA")]
    UnknownIssuer,
    #[error(
        "a signature in the chain does not verify: the certificate was not issued by a trusted CA, or was altered"
    )]
    BadSignature,
    #[error("the certificate may not be used for this purpose (extended key usage)")]
    WrongUsage,
    /// What in a certificate that verified cannot be used (its key, its roles, its form),
    /// described: the peer is refused whatever the detail.
    #[error("{0}")]
    Unusable(String),
}

/// The current time, in the form verification takes.
pub fn now() -> UnixTime {
    UnixTime::now()
}

/// Which side of a connection a peer's certificate was presented by; selects the extended key
/// usage the certificate must allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerRole {
    /// The peer accepted our connection (it must allow server authentication).
    Server,
    /// The peer opened the connection (it must allow client authentication).
    Client,
}

/// What a node does with a CRL past its next update (`nextUpdate`): the issuer has not said
/// whether it revoked more since.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StaleCrl {
    /// Peers whose chain that CRL covers are refused until it is renewed: a revoked peer is
    /// never let back in because the list about it went out of date.
    #[default]
    Refuse,
    /// Peers are checked against the stale list and accepted; the node warns.
    Warn,
}

/// Each CRL's issuer and next update (seconds since the epoch).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CrlDeadlines(Vec<(String, Option<u64>)>);

impl CrlDeadlines {
    /// The CRLs past their next update at `now`: a line for each, naming its issuer.
    pub fn stale(&self, now: UnixTime) -> Vec<String> {
        let now = now.as_secs();
        self.0
            .iter()
            .filter_map(|(issuer, next)| {
                let next = next.filter(|next| *next <= now)?;
                let hours = (now - next) / 3600;
                Some(format!(
                    "the CRL of {issuer} is past its next update (by {hours} h)"
                ))
            })
            .collect()
    }

    /// The CRLs not past their next update at `now` but within `within` of it: a line for
    /// each, naming its issuer, for the operator to renew them before peers are refused.
    pub fn due_within(&self, now: UnixTime, within: std::time::Duration) -> Vec<String> {
        let now = now.as_secs();
        self.0
            .iter()
            .filter_map(|(issuer, next)| {
                let next = next.filter(|next| *next > now && next - now <= within.as_secs())?;
                let days = (next - now) / 86_400;
                Some(format!(
                    "the CRL of {issuer} reaches its next update in {days} days"
                ))
            })
            .collect()
    }
}

/// A peer whose chain verified: who it is and what its certificate lets it do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifiedPeer {
    /// Derived from the leaf certificate's key.
    pub id: PeerId,
    /// The roles the leaf certificate states; `None` for a role-less certificate.
    pub roles: Option<Roles>,
}

/// The CAs a node trusts and the revocation lists it honours.
///
/// A peer is accepted when its chain leads to one of the trust anchors with valid signatures,
/// every certificate is within its validity dates, none is revoked by a CRL signed by its issuer,
/// and the leaf key is Ed25519 (from which the peer id is derived). CRLs are optional per issuer:
/// a certificate whose issuer published none is not considered revoked.
#[derive(Debug)]
pub struct TrustStore {
    anchors: Vec<rustls::pki_types::TrustAnchor<'static>>,
    crls: Vec<CertRevocationList<'static>>,
    next_updates: CrlDeadlines,
    stale_crl: StaleCrl,
}

impl TrustStore {
    /// Loads trust anchors from `trust_pem` (one or more CA certificates) and the CRLs in
    /// `crls_pem`, if given. Errors name the file.
    pub fn load(trust_pem: &Path, crls_pem: Option<&Path>) -> Result<Self, Error> {
        let trust = hypha_files::read(trust_pem)?;
        let crls = crls_pem.map(hypha_files::read).transpose()?;
        let trust_name = trust_pem.display().to_string();
        let crls_name = crls_pem
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        Self::parse(&trust, crls.as_deref(), &trust_name, &crls_name)
    }

    /// Builds a trust store from PEM text already in memory.
    pub fn from_pem(trust_pem: &[u8], crls_pem: &[&[u8]]) -> Result<Self, Error> {
        let mut store = Self::parse(trust_pem, None, "trust anchors", "")?;
        for crl in crls_pem {
            let (crls, next_updates) = Self::parse_crls(crl, "CRL")?;
            store.crls.extend(crls);
            store.next_updates.0.extend(next_updates);
        }
        Ok(store)
    }

    /// The same store with `policy` for CRLs past their next update (by default: refuse).
    pub fn with_stale_crl(mut self, policy: StaleCrl) -> Self {
        self.stale_crl = policy;
        self
    }

    /// When each CRL goes stale.
    pub fn crl_deadlines(&self) -> &CrlDeadlines {
        &self.next_updates
    }

    fn parse(
        trust_pem: &[u8],
        crls_pem: Option<&[u8]>,
        trust_name: &str,
        crls_name: &str,
    ) -> Result<Self, Error> {
        let certs =
            crate::parse_certificates(trust_pem).map_err(|r| Error::malformed(trust_name, r))?;
        if certs.is_empty() {
            return Err(Error::malformed(
                trust_name,
                "no CERTIFICATE block found; point trust_pem at the root CA certificate",
            ));
        }
        let anchors = certs
            .iter()
            .map(|c| {
                webpki::anchor_from_trusted_cert(c)
                    .map(|a| a.to_owned())
                    .map_err(|e| {
                        Error::malformed(trust_name, format!("unusable CA certificate: {e}"))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (crls, next_updates) = match crls_pem {
            Some(pem) => Self::parse_crls(pem, crls_name)?,
            None => (Vec::new(), Vec::new()),
        };
        Ok(TrustStore {
            anchors,
            crls,
            next_updates: CrlDeadlines(next_updates),
            stale_crl: StaleCrl::default(),
        })
    }

    /// The CRLs of a PEM document, with each one's issuer and next update. A document
    /// without any is refused rather than read as "nothing revoked": a truncated or mistaken
    /// file must not readmit revoked peers.
    #[allow(clippy::type_complexity)]
    fn parse_crls(
        pem: &[u8],
        name: &str,
    ) -> Result<(Vec<CertRevocationList<'static>>, Vec<(String, Option<u64>)>), Error> {
        use x509_parser::prelude::FromDer;
        let (crls, next_updates) = CertificateRevocationListDer::pem_slice_iter(pem)
            .map(|der| {
                let der = der.map_err(|e| Error::malformed(name, format!("not valid PEM: {e}")))?;
                let crl = OwnedCertRevocationList::from_der(&der)
                    .map(CertRevocationList::from)
                    .map_err(|e| Error::malformed(name, format!("not a valid CRL: {e}")))?;
                let (_, parsed) =
                    x509_parser::revocation_list::CertificateRevocationList::from_der(&der)
                        .map_err(|e| Error::malformed(name, format!("not a valid CRL: {e}")))?;
                let next_update = parsed
                    .next_update()
                    .map(|t| u64::try_from(t.timestamp()).unwrap_or(0));
                Ok((crl, (parsed.issuer().to_string(), next_update)))
            })
            .collect::<Result<(Vec<_>, Vec<_>), Error>>()?;
        if crls.is_empty() {
            return Err(Error::malformed(
                name,
                "no X509 CRL block found; point crls_pem at a CRL made by `hypha-certutil crl` or `revoke`",
            ));
        }
        Ok((crls, next_updates))
    }

    /// Verifies a peer's chain (leaf first) at `now`, as presented in a handshake by a peer
    /// acting as `role`, and returns the peer id derived from the leaf's key with the roles it
    /// states.
    pub fn verify(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
        role: PeerRole,
    ) -> Result<VerifiedPeer, Rejection> {
        let (leaf, intermediates) = chain.split_first().ok_or(Rejection::NoCertificate)?;
        let public = crate::ed25519_public_key(leaf).map_err(Rejection::Unusable)?;
        let end_entity = EndEntityCert::try_from(leaf)
            .map_err(|e| Rejection::Unusable(format!("unparsable certificate: {e}")))?;
        let crl_refs: Vec<&CertRevocationList<'_>> = self.crls.iter().collect();
        let revocation = match RevocationOptionsBuilder::new(&crl_refs) {
            Ok(builder) => Some(
                builder
                    .with_depth(RevocationCheckDepth::Chain)
                    .with_status_policy(UnknownStatusPolicy::Allow)
                    .with_expiration_policy(match self.stale_crl {
                        StaleCrl::Refuse => ExpirationPolicy::Enforce,
                        StaleCrl::Warn => ExpirationPolicy::Ignore,
                    })
                    .build(),
            ),
            Err(_) => None, // no CRLs configured
        };
        let usage = match role {
            PeerRole::Server => KeyUsage::server_auth(),
            PeerRole::Client => KeyUsage::client_auth(),
        };
        end_entity
            .verify_for_usage(
                rustls::crypto::ring::default_provider()
                    .signature_verification_algorithms
                    .all,
                &self.anchors,
                intermediates,
                now,
                usage,
                revocation,
                None,
            )
            .map_err(|e| explain(&e))?;
        Ok(VerifiedPeer {
            id: crate::peer_id_of(&public).map_err(Rejection::Unusable)?,
            roles: Roles::of_certificate(leaf).map_err(Rejection::Unusable)?,
        })
    }

    /// [`verify`](Self::verify) for a chain presented by a peer that may act in either role.
    pub fn verify_peer(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<VerifiedPeer, Rejection> {
        self.verify(chain, now, PeerRole::Client)
    }
}

fn explain(e: &webpki::Error) -> Rejection {
    match e {
        webpki::Error::CertExpired { .. } => Rejection::Expired,
        webpki::Error::CertNotValidYet { .. } => Rejection::NotYetValid,
        webpki::Error::CertRevoked => Rejection::Revoked,
        webpki::Error::CrlExpired { .. } => Rejection::StaleCrl,
        webpki::Error::UnknownIssuer => Rejection::UnknownIssuer,
        webpki::Error::InvalidSignatureForPublicKey => Rejection::BadSignature,
        webpki::Error::RequiredEkuNotFoundContext(_) => Rejection::WrongUsage,
        other => Rejection::Unusable(format!("{other:?}")),
    }
}
