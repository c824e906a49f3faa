//! Issuing certificates and revocation lists.
//!
//! The hierarchy is root CA → organisation CA → node. A root is self-signed and may sign
//! organisation CAs (and, for small set-ups, nodes directly); an organisation CA has a path length
//! of zero, so it can sign nodes but no further CAs. Every key is Ed25519. Node certificates carry
//! both the server and the client extended key usage, because every libp2p connection is mutual.

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, RevocationReason,
    RevokedCertParams, SerialNumber,
};
use rustls::pki_types::CertificateDer;
use time::{Duration, OffsetDateTime};

use crate::{Error, Roles};

/// When a certificate is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl Validity {
    /// Valid from an hour ago (to tolerate clock skew between machines) for `days` days.
    pub fn days(days: u32) -> Self {
        let now = OffsetDateTime::now_utc();
        Validity {
            not_before: now - Duration::hours(1),
            not_after: now + Duration::days(i64::from(days)),
        }
    }
}

/// A certificate authority that can sign: its certificate, its key and the chain of CA
/// certificates between it and the root (empty for a root).
#[derive(Debug)]
pub struct Authority {
    cert: CertificateDer<'static>,
    key: KeyPair,
    intermediates: Vec<CertificateDer<'static>>,
    name: String,
}

/// A node's certificate, the chain it presents (its own certificate first) and its key.
#[derive(Debug)]
pub struct NodeCredentials {
    chain: Vec<CertificateDer<'static>>,
    key: KeyPair,
}

/// Why a certificate is revoked, as a CRL records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Unspecified,
    KeyCompromise,
    Superseded,
    CessationOfOperation,
}

impl Reason {
    fn to_rcgen(self) -> RevocationReason {
        match self {
            Reason::Unspecified => RevocationReason::Unspecified,
            Reason::KeyCompromise => RevocationReason::KeyCompromise,
            Reason::Superseded => RevocationReason::Superseded,
            Reason::CessationOfOperation => RevocationReason::CessationOfOperation,
        }
    }
}

/// The reason of a CRL entry's code (RFC 5280, 5.3.1), to sign it again as it was.
fn reason_from_code(code: u8) -> Option<RevocationReason> {
    Some(match code {
        0 => RevocationReason::Unspecified,
        1 => RevocationReason::KeyCompromise,
        2 => RevocationReason::CaCompromise,
        3 => RevocationReason::AffiliationChanged,
        4 => RevocationReason::Superseded,
        5 => RevocationReason::CessationOfOperation,
        6 => RevocationReason::CertificateHold,
        8 => RevocationReason::RemoveFromCrl,
        9 => RevocationReason::PrivilegeWithdrawn,
        10 => RevocationReason::AaCompromise,
        _ => return None,
    })
}

/// Creates a self-signed root CA.
pub fn create_root(name: &str, validity: Validity) -> Result<Authority, Error> {
    let key = new_key()?;
    let mut params = ca_params(name, validity);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).map_err(|error| Error::Issue {
        what: format!("root CA {name:?}"),
        error,
    })?;
    Ok(Authority {
        cert: cert.der().clone(),
        key,
        intermediates: Vec::new(),
        name: name.to_string(),
    })
}

/// Creates an organisation CA signed by `root`. It can sign nodes but no further CAs.
pub fn create_org(root: &Authority, name: &str, validity: Validity) -> Result<Authority, Error> {
    if !root.intermediates.is_empty() {
        return Err(Error::malformed(
            format!("CA {:?}", root.name),
            "an organisation CA cannot sign another CA; sign it with the root CA",
        ));
    }
    let key = new_key()?;
    let mut params = ca_params(name, validity);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    let cert = params
        .signed_by(&key, &root.issuer()?)
        .map_err(|error| Error::Issue {
            what: format!("organisation CA {name:?}"),
            error,
        })?;
    Ok(Authority {
        cert: cert.der().clone(),
        key,
        intermediates: vec![cert.der().clone()],
        name: name.to_string(),
    })
}

/// Creates a node certificate signed by `issuer`, with the given DNS names or IP addresses as
/// subject alternative names, granting `roles` (none: a role-less certificate; see
/// [`crate::roles`]).
pub fn create_node(
    issuer: &Authority,
    name: &str,
    subject_alt_names: &[String],
    roles: Roles,
    validity: Validity,
) -> Result<NodeCredentials, Error> {
    let key = new_key()?;
    let mut params =
        CertificateParams::new(subject_alt_names.to_vec()).map_err(|error| Error::Issue {
            what: format!("node certificate {name:?}"),
            error,
        })?;
    params.distinguished_name.remove(DnType::CommonName);
    params.distinguished_name.push(DnType::CommonName, name);
    if !roles.is_empty() {
        params
            .distinguished_name
            .push(DnType::OrganizationalUnitName, roles.unit());
    }
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
    params.serial_number = Some(random_serial());
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    let cert = params
        .signed_by(&key, &issuer.issuer()?)
        .map_err(|error| Error::Issue {
            what: format!("node certificate {name:?}"),
            error,
        })?;
    let mut chain = vec![cert.der().clone()];
    chain.extend(issuer.intermediates.iter().cloned());
    Ok(NodeCredentials { chain, key })
}

/// Adds `cert_pem`'s certificate to the CRL of `issuer`, returning the new CRL as PEM.
///
/// `existing_crl_pem` is the issuer's current CRL, if there is one: its entries are kept and its
/// CRL number is incremented. The certificate must have been issued by `issuer`.
pub fn revoke(
    issuer: &Authority,
    existing_crl_pem: Option<&[u8]>,
    cert_pem: &[u8],
    reason: Reason,
    next_update_days: u32,
) -> Result<String, Error> {
    let certs = crate::parse_certificates(cert_pem)
        .map_err(|reason| Error::malformed("certificate to revoke", reason))?;
    let cert_der = certs
        .first()
        .ok_or_else(|| Error::malformed("certificate to revoke", "no CERTIFICATE block found"))?;
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| Error::malformed("certificate to revoke", e.to_string()))?;
    let (_, issuer_cert) = x509_parser::parse_x509_certificate(&issuer.cert)
        .map_err(|e| Error::malformed("issuer certificate", e.to_string()))?;
    if cert.issuer() != issuer_cert.subject() {
        return Err(Error::malformed(
            "certificate to revoke",
            format!(
                "it was issued by \"{}\", not by \"{}\"; revoke it with its own issuer's certificate and key",
                cert.issuer(),
                issuer_cert.subject()
            ),
        ));
    }
    let serial = SerialNumber::from_slice(cert.raw_serial());
    issue_crl(
        issuer,
        existing_crl_pem,
        Some((serial, reason)),
        next_update_days,
    )
}

/// The CRL of `issuer` with the entries of `existing_crl_pem` (none for a new, empty list)
/// and a next update `next_update_days` from now, as PEM: how a network starts with a list
/// every node reads (so that revoking later needs no change of config), and how the list is
/// renewed before its next update, when nodes would refuse the peers it covers as stale.
pub fn renew_crl(
    issuer: &Authority,
    existing_crl_pem: Option<&[u8]>,
    next_update_days: u32,
) -> Result<String, Error> {
    issue_crl(issuer, existing_crl_pem, None, next_update_days)
}

/// Signs `issuer`'s CRL: the entries of `existing_crl_pem` (its CRL number incremented), and
/// `revoke`'s serial if it is not among them.
fn issue_crl(
    issuer: &Authority,
    existing_crl_pem: Option<&[u8]>,
    revoke: Option<(SerialNumber, Reason)>,
    next_update_days: u32,
) -> Result<String, Error> {
    use x509_parser::prelude::FromDer;

    let (_, issuer_cert) = x509_parser::parse_x509_certificate(&issuer.cert)
        .map_err(|e| Error::malformed("issuer certificate", e.to_string()))?;
    let now = OffsetDateTime::now_utc();
    let mut revoked = Vec::new();
    let mut crl_number = 1u64;
    if let Some(pem) = existing_crl_pem {
        use rustls::pki_types::{CertificateRevocationListDer, pem::PemObject};
        // One list per file, as nodes read them (`crls_pem` takes several files): the file is
        // written back whole, and another issuer's list in it would be lost.
        let ders = CertificateRevocationListDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::malformed("existing CRL", format!("not a PEM CRL: {e}")))?;
        let der = match &ders[..] {
            [der] => der,
            [] => return Err(Error::malformed("existing CRL", "no X509 CRL block found")),
            more => {
                return Err(Error::malformed(
                    "existing CRL",
                    format!(
                        "the file holds {} lists; keep each issuer's list in a file of its own (nodes take several files in crls_pem)",
                        more.len()
                    ),
                ));
            }
        };
        let (_, crl) = x509_parser::revocation_list::CertificateRevocationList::from_der(der)
            .map_err(|e| Error::malformed("existing CRL", e.to_string()))?;
        if crl.issuer() != issuer_cert.subject() {
            return Err(Error::malformed(
                "existing CRL",
                format!(
                    "it belongs to \"{}\", not to the issuer \"{}\"",
                    crl.issuer(),
                    issuer_cert.subject()
                ),
            ));
        }
        // Re-signed entries must be the issuer's own: a list changed since it was signed (an
        // entry dropped to un-revoke a certificate) is refused, never laundered.
        let key = crate::ed25519_public_key(&issuer.cert)
            .map_err(|reason| Error::malformed("issuer certificate", reason))?;
        rustls::pki_types::SignatureVerificationAlgorithm::verify_signature(
            webpki::ring::ED25519,
            &key,
            crl.tbs_cert_list.as_ref(),
            &crl.signature_value.data,
        )
        .map_err(|_| {
            Error::malformed(
                "existing CRL",
                "its signature is not its issuer's: it was changed since it was signed, or signed by another key",
            )
        })?;
        crl_number = crl
            .crl_number()
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(0)
            + 1;
        for entry in crl.iter_revoked_certificates() {
            revoked.push(RevokedCertParams {
                serial_number: SerialNumber::from_slice(entry.raw_serial()),
                revocation_time: entry.revocation_date.to_datetime(),
                reason_code: entry
                    .reason_code()
                    .and_then(|(_, code)| reason_from_code(code.0)),
                invalidity_date: entry.invalidity_date().map(|(_, date)| date.to_datetime()),
            });
        }
    }
    if let Some((serial, reason)) = revoke
        && !revoked.iter().any(|r| r.serial_number == serial)
    {
        revoked.push(RevokedCertParams {
            serial_number: serial,
            revocation_time: now,
            reason_code: Some(reason.to_rcgen()),
            invalidity_date: None,
        });
    }
    let params = CertificateRevocationListParams {
        this_update: now,
        next_update: now + Duration::days(i64::from(next_update_days.max(1))),
        crl_number: SerialNumber::from_slice(&crl_number.to_be_bytes()),
        issuing_distribution_point: None,
        revoked_certs: revoked,
        key_identifier_method: rcgen::KeyIdMethod::Sha256,
    };
    let crl = params
        .signed_by(&issuer.issuer()?)
        .map_err(|error| Error::Issue {
            what: format!("CRL of {:?}", issuer.name),
            error,
        })?;
    crl.pem().map_err(|error| Error::Issue {
        what: format!("CRL of {:?}", issuer.name),
        error,
    })
}

impl Authority {
    /// Loads a CA from its certificate (PEM; the CA's own certificate first, then any
    /// intermediates up to but excluding the root) and its private key (PKCS#8 PEM).
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Self, Error> {
        let certs = crate::parse_certificates(cert_pem)
            .map_err(|reason| Error::malformed("CA certificate", reason))?;
        let (cert, intermediates) = certs
            .split_first()
            .ok_or_else(|| Error::malformed("CA certificate", "no CERTIFICATE block found"))?;
        let key_text = std::str::from_utf8(key_pem)
            .map_err(|_| Error::malformed("CA key", "not a PEM text file"))?;
        let key = KeyPair::from_pem(key_text)
            .map_err(|e| Error::malformed("CA key", format!("not a PKCS#8 private key: {e}")))?;
        let public = crate::ed25519_public_key(cert)
            .map_err(|reason| Error::malformed("CA certificate", reason))?;
        if key.public_key_raw() != public {
            return Err(Error::KeyMismatch {
                what: "CA key".into(),
            });
        }
        let (_, parsed) = x509_parser::parse_x509_certificate(cert)
            .map_err(|e| Error::malformed("CA certificate", e.to_string()))?;
        if !parsed.is_ca() {
            return Err(Error::malformed(
                "CA certificate",
                "it is not a CA certificate (basic constraints say CA:false); sign with a root or organisation CA",
            ));
        }
        let name = parsed
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .unwrap_or("unnamed CA")
            .to_string();
        // A self-signed certificate is a root, which never travels in a chain.
        let self_signed = parsed.issuer() == parsed.subject();
        let mut own_chain = Vec::new();
        if !self_signed {
            own_chain.push(cert.clone());
            own_chain.extend(intermediates.iter().cloned());
        }
        Ok(Authority {
            cert: cert.clone(),
            key,
            intermediates: own_chain,
            name,
        })
    }

    /// The CA certificate as PEM.
    pub fn cert_pem(&self) -> String {
        to_pem(std::slice::from_ref(&self.cert))
    }

    /// The CA's private key as PKCS#8 PEM.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// The CA's common name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn issuer(&self) -> Result<Issuer<'static, &KeyPair>, Error> {
        Issuer::from_ca_cert_der(&self.cert, &self.key).map_err(|error| Error::Issue {
            what: format!("an issuer from CA {:?}", self.name),
            error,
        })
    }
}

impl NodeCredentials {
    /// The node's own certificate as PEM.
    pub fn cert_pem(&self) -> String {
        to_pem(&self.chain[..1])
    }

    /// The chain the node presents (its certificate, then the CA certificates below the root).
    pub fn chain_pem(&self) -> String {
        to_pem(&self.chain)
    }

    /// The node's private key as PKCS#8 PEM.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }
}

fn new_key() -> Result<KeyPair, Error> {
    KeyPair::generate_for(&rcgen::PKCS_ED25519).map_err(|error| Error::Issue {
        what: "an Ed25519 key".into(),
        error,
    })
}

fn ca_params(name: &str, validity: Validity) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name.remove(DnType::CommonName);
    params.distinguished_name.push(DnType::CommonName, name);
    params
        .distinguished_name
        .push(DnType::OrganizationName, name);
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
    params.serial_number = Some(random_serial());
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.use_authority_key_identifier_extension = true;
    params
}

/// A random positive 127-bit serial number, as RFC 5280 recommends (unpredictable, ≤ 20 octets).
fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    SerialNumber::from_slice(&bytes)
}

fn to_pem(certs: &[CertificateDer<'_>]) -> String {
    let blocks: Vec<pem::Pem> = certs
        .iter()
        .map(|c| pem::Pem::new("CERTIFICATE", c.to_vec()))
        .collect();
    pem::encode_many_config(
        &blocks,
        pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
    )
}
