#![allow(clippy::unwrap_used)] // tests fail loudly by design

use hypha_certs::{
    Error, NodeIdentity, Role, Roles, TrustStore,
    authority::{self, Reason, Validity},
};
use time::{Duration, OffsetDateTime};

fn hierarchy() -> (authority::Authority, authority::Authority) {
    let root = authority::create_root("Test Root", Validity::days(30)).unwrap();
    let org = authority::create_org(&root, "Test Org", Validity::days(30)).unwrap();
    (root, org)
}

fn identity(node: &authority::NodeCredentials) -> NodeIdentity {
    NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes()).unwrap()
}

#[test]
fn root_org_node_chain_verifies_to_the_certificates_peer_id() {
    let (root, org) = hierarchy();
    let node = authority::create_node(
        &org,
        "n1",
        &["localhost".into(), "127.0.0.1".into()],
        Roles::NONE.with(Role::Worker).with(Role::Data),
        Validity::days(1),
    )
    .unwrap();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    let id = identity(&node);
    assert_eq!(
        id.chain().len(),
        2,
        "node presents its certificate and the org CA"
    );
    let verified = trust.verify_peer(id.chain(), hypha_certs::now()).unwrap();
    assert_eq!(verified.id, id.peer_id());
    let roles = verified.roles.expect("the certificate states roles");
    assert!(roles.contains(Role::Worker) && roles.contains(Role::Data));
    assert!(!roles.contains(Role::Scheduler) && !roles.contains(Role::Gateway));
    assert_eq!(id.roles(), Some(roles));
}

#[test]
fn a_certificate_without_roles_is_role_less() {
    let (root, org) = hierarchy();
    let node = authority::create_node(&org, "old", &[], Roles::NONE, Validity::days(1)).unwrap();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    let verified = trust
        .verify_peer(identity(&node).chain(), hypha_certs::now())
        .unwrap();
    assert_eq!(verified.roles, None);
}

/// Roles written by another tool, as `openssl req -subj "/CN=w/OU=hypha:worker/OU=hypha:data,admin"`
/// writes them: several units, a unit listing several roles, a role this version does not know.
#[test]
fn roles_written_by_another_ca_tool_are_read() {
    let (root, org) = hierarchy();
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    let mut params = rcgen::CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "w");
    // rcgen keeps one value per attribute type; a custom type with the OU's OID writes a
    // second unit, as other tools do.
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationalUnitName, "hypha:worker");
    params.distinguished_name.push(
        rcgen::DnType::CustomDnType(vec![2, 5, 4, 11]),
        "hypha:data, admin",
    );
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let issuer = rcgen::Issuer::from_ca_cert_pem(
        &org.cert_pem(),
        rcgen::KeyPair::from_pem(&org.key_pem()).unwrap(),
    )
    .unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    let chain = format!("{}{}", cert.pem(), org.cert_pem());
    let id = NodeIdentity::from_pem(chain.as_bytes(), key.serialize_pem().as_bytes()).unwrap();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    let roles = trust
        .verify_peer(id.chain(), hypha_certs::now())
        .unwrap()
        .roles
        .unwrap();
    assert_eq!(roles, Roles::NONE.with(Role::Worker).with(Role::Data));
}

#[test]
fn another_ca_is_rejected() {
    let (_, org) = hierarchy();
    let other_root = authority::create_root("Other Root", Validity::days(30)).unwrap();
    let node = authority::create_node(&org, "n1", &[], Roles::NONE, Validity::days(1)).unwrap();
    let trust = TrustStore::from_pem(other_root.cert_pem().as_bytes(), &[]).unwrap();
    let err = trust
        .verify_peer(identity(&node).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(
        err.to_string().contains("not issued by a trusted CA"),
        "{err}"
    );

    // A CA that impersonates the trusted root's name is caught by the signature.
    let impostor = authority::create_root("Test Root", Validity::days(30)).unwrap();
    let impostor_org = authority::create_org(&impostor, "Test Org", Validity::days(30)).unwrap();
    let forged =
        authority::create_node(&impostor_org, "n1", &[], Roles::NONE, Validity::days(1)).unwrap();
    let (root, _) = hierarchy();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    let err = trust
        .verify_peer(identity(&forged).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(
        err.to_string().contains("not issued by a trusted CA"),
        "{err}"
    );
}

#[test]
fn expired_certificate_is_rejected() {
    let (root, org) = hierarchy();
    let now = OffsetDateTime::now_utc();
    let validity = Validity {
        not_before: now - Duration::days(10),
        not_after: now - Duration::days(1),
    };
    let node = authority::create_node(&org, "old", &[], Roles::NONE, validity).unwrap();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    let err = trust
        .verify_peer(identity(&node).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(err.to_string().contains("expired"), "{err}");
}

#[test]
fn revoked_certificate_is_rejected_and_others_stay_accepted() {
    let (root, org) = hierarchy();
    let bad = authority::create_node(&org, "bad", &[], Roles::NONE, Validity::days(1)).unwrap();
    let good = authority::create_node(&org, "good", &[], Roles::NONE, Validity::days(1)).unwrap();
    let crl = authority::revoke(
        &org,
        None,
        bad.cert_pem().as_bytes(),
        Reason::KeyCompromise,
        30,
    )
    .unwrap();
    // Revoking again keeps earlier entries and bumps the CRL number.
    let third = authority::create_node(&org, "third", &[], Roles::NONE, Validity::days(1)).unwrap();
    let crl = authority::revoke(
        &org,
        Some(crl.as_bytes()),
        third.cert_pem().as_bytes(),
        Reason::Superseded,
        30,
    )
    .unwrap();
    let described = hypha_certs::inspect::describe(crl.as_bytes(), "crl").unwrap();
    assert!(described.contains("revoked:     2"), "{described}");
    assert!(described.contains("number:      2"), "{described}");

    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[crl.as_bytes()]).unwrap();
    let err = trust
        .verify_peer(identity(&bad).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(err.to_string().contains("revoked"), "{err}");
    assert!(
        trust
            .verify_peer(identity(&third).chain(), hypha_certs::now())
            .is_err()
    );
    assert!(
        trust
            .verify_peer(identity(&good).chain(), hypha_certs::now())
            .is_ok()
    );
}

/// A network starts with an empty list (every node reads it from the first day, so that
/// revoking later needs no change of config); revoking adds to it; renewing keeps what it
/// revoked, with a later CRL number.
#[test]
fn an_empty_crl_admits_everyone_and_renewing_keeps_what_was_revoked() {
    let (root, org) = hierarchy();
    let node = authority::create_node(&org, "n", &[], Roles::NONE, Validity::days(1)).unwrap();
    let empty = authority::renew_crl(&org, None, 30).unwrap();
    let described = hypha_certs::inspect::describe(empty.as_bytes(), "crl").unwrap();
    assert!(described.contains("revoked:     0"), "{described}");
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[empty.as_bytes()]).unwrap();
    // Due for renewal within a month, not yet stale: nodes warn ahead of the day.
    let month = std::time::Duration::from_secs(31 * 24 * 3600);
    let due = trust.crl_deadlines().due_within(hypha_certs::now(), month);
    assert_eq!(due.len(), 1, "{due:?}");
    assert!(due[0].contains("reaches its next update in"), "{due:?}");
    assert!(trust.crl_deadlines().stale(hypha_certs::now()).is_empty());
    assert!(
        trust
            .verify_peer(identity(&node).chain(), hypha_certs::now())
            .is_ok()
    );

    let revoked = authority::revoke(
        &org,
        Some(empty.as_bytes()),
        node.cert_pem().as_bytes(),
        Reason::KeyCompromise,
        30,
    )
    .unwrap();
    // A list changed since it was signed is not renewed into a valid one.
    let der = pem::parse(revoked.as_bytes()).unwrap().into_contents();
    let mut tampered = der.clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 1;
    let tampered = pem::encode(&pem::Pem::new("X509 CRL", tampered));
    let refused = authority::renew_crl(&org, Some(tampered.as_bytes()), 60).unwrap_err();
    assert!(refused.to_string().contains("signature"), "{refused}");
    let renewed = authority::renew_crl(&org, Some(revoked.as_bytes()), 60).unwrap();
    let renewed_trust =
        TrustStore::from_pem(root.cert_pem().as_bytes(), &[renewed.as_bytes()]).unwrap();
    assert!(
        renewed_trust
            .crl_deadlines()
            .due_within(hypha_certs::now(), month)
            .is_empty()
    );
    let described = hypha_certs::inspect::describe(renewed.as_bytes(), "crl").unwrap();
    assert!(described.contains("revoked:     1"), "{described}");
    assert!(described.contains("number:      3"), "{described}");
    // The entry keeps its reason (a relying party treats a key compromise differently).
    let der = pem::parse(renewed.as_bytes()).unwrap().into_contents();
    let (_, crl) = <x509_parser::revocation_list::CertificateRevocationList as x509_parser::prelude::FromDer<_>>::from_der(&der).unwrap();
    let entry = crl.iter_revoked_certificates().next().unwrap();
    assert_eq!(
        entry.reason_code().map(|(_, code)| code.0),
        Some(1),
        "key compromise"
    );
    // A file of two issuers' lists is not renewed into one: the other list would be lost.
    let roots = authority::renew_crl(&root, None, 30).unwrap();
    let both = format!("{roots}{renewed}");
    let refused = authority::renew_crl(&org, Some(both.as_bytes()), 60).unwrap_err();
    assert!(refused.to_string().contains("holds 2 lists"), "{refused}");
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[renewed.as_bytes()]).unwrap();
    let err = trust
        .verify_peer(identity(&node).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(err.to_string().contains("revoked"), "{err}");
}

#[test]
fn revoking_needs_the_certificates_own_issuer() {
    let (root, org) = hierarchy();
    let node = authority::create_node(&org, "n", &[], Roles::NONE, Validity::days(1)).unwrap();
    let err = authority::revoke(
        &root,
        None,
        node.cert_pem().as_bytes(),
        Reason::Unspecified,
        30,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("revoke it with its own issuer"),
        "{err}"
    );
}

#[test]
fn key_from_another_certificate_is_refused_at_load() {
    let (_, org) = hierarchy();
    let a = authority::create_node(&org, "a", &[], Roles::NONE, Validity::days(1)).unwrap();
    let b = authority::create_node(&org, "b", &[], Roles::NONE, Validity::days(1)).unwrap();
    let err = NodeIdentity::from_pem(a.chain_pem().as_bytes(), b.key_pem().as_bytes()).unwrap_err();
    assert!(matches!(err, Error::KeyMismatch { .. }), "{err}");
}

#[test]
fn an_org_ca_cannot_sign_another_ca() {
    let (_, org) = hierarchy();
    assert!(authority::create_org(&org, "Sub Org", Validity::days(1)).is_err());
}

#[test]
fn authority_round_trips_through_pem() {
    let (root, org) = hierarchy();
    let reloaded =
        authority::Authority::from_pem(org.cert_pem().as_bytes(), org.key_pem().as_bytes())
            .unwrap();
    let node = authority::create_node(&reloaded, "n", &[], Roles::NONE, Validity::days(1)).unwrap();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    assert!(
        trust
            .verify_peer(identity(&node).chain(), hypha_certs::now())
            .is_ok()
    );
    let err = authority::Authority::from_pem(org.cert_pem().as_bytes(), root.key_pem().as_bytes())
        .unwrap_err();
    assert!(matches!(err, Error::KeyMismatch { .. }), "{err}");
}

/// A CRL file cut short (copied half-way, emptied by mistake) must not read as "nothing is
/// revoked": it is refused, naming the file.
#[test]
fn a_crl_file_without_a_crl_is_refused() {
    let (root, org) = hierarchy();
    let node = authority::create_node(&org, "n", &[], Roles::NONE, Validity::days(1)).unwrap();
    let crl = authority::revoke(
        &org,
        None,
        node.cert_pem().as_bytes(),
        Reason::KeyCompromise,
        30,
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let trust = dir.path().join("root.pem");
    std::fs::write(&trust, root.cert_pem()).unwrap();
    let crls = dir.path().join("crl.pem");
    for text in ["", &crl[..crl.len() / 2], "not pem at all\n"] {
        std::fs::write(&crls, text).unwrap();
        let err = TrustStore::load(&trust, Some(&crls)).unwrap_err();
        assert!(err.to_string().contains("crl.pem"), "{err}");
    }
    std::fs::write(&crls, &crl).unwrap();
    let store = TrustStore::load(&trust, Some(&crls)).unwrap();
    assert!(
        store
            .verify_peer(identity(&node).chain(), hypha_certs::now())
            .is_err()
    );
}

/// A CRL past its next update no longer says whether the issuer revoked more since. By
/// default (`stale_crl = "refuse"`) every peer it covers is refused, naming the fix; with
/// "warn" peers are checked against it and accepted, and revoked ones stay out. Either way the
/// store names the stale list.
#[test]
fn a_stale_crl_refuses_the_peers_it_covers_or_only_warns() {
    use hypha_certs::{Rejection, StaleCrl};
    use rustls::pki_types::UnixTime;
    let (root, org) = hierarchy();
    let bad = authority::create_node(&org, "bad", &[], Roles::NONE, Validity::days(10)).unwrap();
    let good = authority::create_node(&org, "good", &[], Roles::NONE, Validity::days(10)).unwrap();
    let crl = authority::revoke(
        &org,
        None,
        bad.cert_pem().as_bytes(),
        Reason::KeyCompromise,
        1,
    )
    .unwrap();
    let trust = || TrustStore::from_pem(root.cert_pem().as_bytes(), &[crl.as_bytes()]).unwrap();
    let now = hypha_certs::now();
    let later = UnixTime::since_unix_epoch(std::time::Duration::from_secs(
        now.as_secs() + 2 * 24 * 3600,
    ));
    assert!(trust().crl_deadlines().stale(now).is_empty());
    let stale = trust().crl_deadlines().stale(later);
    assert_eq!(stale.len(), 1, "{stale:?}");
    assert!(stale[0].contains("past its next update"), "{stale:?}");

    let refusing = trust();
    assert!(refusing.verify_peer(identity(&good).chain(), now).is_ok());
    let err = refusing
        .verify_peer(identity(&good).chain(), later)
        .unwrap_err();
    assert_eq!(err, Rejection::StaleCrl);
    assert!(err.to_string().contains("hypha-certutil crl"), "{err}");

    let warning = trust().with_stale_crl(StaleCrl::Warn);
    assert!(warning.verify_peer(identity(&good).chain(), later).is_ok());
    assert_eq!(
        warning
            .verify_peer(identity(&bad).chain(), later)
            .unwrap_err(),
        Rejection::Revoked
    );
}
