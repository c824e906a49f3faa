//! Human-readable descriptions of certificates and revocation lists.

use std::fmt::Write;

use rustls::pki_types::{CertificateRevocationListDer, pem::PemObject};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use crate::Error;

/// Describes every certificate and CRL in a PEM document, one block of lines each.
pub fn describe(pem: &[u8], name: &str) -> Result<String, Error> {
    let mut out = String::new();
    let certs = crate::parse_certificates(pem).map_err(|r| Error::malformed(name, r))?;
    for (i, der) in certs.iter().enumerate() {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| Error::malformed(name, format!("certificate {}: {e}", i + 1)))?;
        describe_certificate(&mut out, &cert, der);
    }
    for der in CertificateRevocationListDer::pem_slice_iter(pem) {
        let der = der.map_err(|e| Error::malformed(name, e.to_string()))?;
        let (_, crl) = x509_parser::revocation_list::CertificateRevocationList::from_der(&der)
            .map_err(|e| Error::malformed(name, format!("CRL: {e}")))?;
        let _ = writeln!(out, "CRL");
        let _ = writeln!(out, "  issuer:      {}", crl.issuer());
        let _ = writeln!(out, "  this update: {}", crl.last_update());
        if let Some(next) = crl.next_update() {
            let _ = writeln!(out, "  next update: {next}");
        }
        if let Some(n) = crl.crl_number() {
            let _ = writeln!(out, "  number:      {n}");
        }
        let revoked: Vec<_> = crl.iter_revoked_certificates().collect();
        let _ = writeln!(out, "  revoked:     {}", revoked.len());
        for entry in revoked {
            let _ = writeln!(
                out,
                "    serial {} at {}",
                hex(entry.raw_serial()),
                entry.revocation_date
            );
        }
    }
    if out.is_empty() {
        return Err(Error::malformed(
            name,
            "no CERTIFICATE or X509 CRL block found; is this a PEM file made by hypha-certutil?",
        ));
    }
    Ok(out)
}

fn describe_certificate(out: &mut String, cert: &X509Certificate<'_>, der: &[u8]) {
    let kind = if !cert.is_ca() {
        "node certificate"
    } else if cert.issuer() == cert.subject() {
        "root CA"
    } else {
        "organisation CA"
    };
    let _ = writeln!(out, "{kind}");
    let _ = writeln!(out, "  subject:     {}", cert.subject());
    let _ = writeln!(out, "  issuer:      {}", cert.issuer());
    let _ = writeln!(out, "  serial:      {}", hex(cert.raw_serial()));
    let validity = cert.validity();
    let _ = writeln!(out, "  not before:  {}", validity.not_before);
    let _ = writeln!(out, "  not after:   {}", validity.not_after);
    if !validity.is_valid() {
        let _ = writeln!(out, "  status:      NOT VALID NOW");
    }
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        let names: Vec<String> = san
            .value
            .general_names
            .iter()
            .map(|n| match n {
                GeneralName::DNSName(d) => d.to_string(),
                GeneralName::IPAddress(ip) => match ip.len() {
                    4 => std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*ip).unwrap_or([0; 4]))
                        .to_string(),
                    16 => std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*ip).unwrap_or([0; 16]))
                        .to_string(),
                    _ => hex(ip),
                },
                other => format!("{other}"),
            })
            .collect();
        let _ = writeln!(out, "  names:       {}", names.join(", "));
    }
    match crate::ed25519_public_key(der).and_then(|k| crate::peer_id_of(&k)) {
        Ok(peer) => {
            let _ = writeln!(out, "  key:         Ed25519");
            if !cert.is_ca() {
                let _ = writeln!(out, "  peer id:     {peer}");
                let roles = match crate::Roles::of_certificate(der) {
                    Ok(Some(roles)) => roles.to_string(),
                    Ok(None) => {
                        "none stated (role-less; peers accept it only with allow_roleless)".into()
                    }
                    Err(reason) => reason,
                };
                let _ = writeln!(out, "  roles:       {roles}");
            }
        }
        Err(reason) => {
            let _ = writeln!(out, "  key:         {reason}");
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}
